"""Rotary schemes (``rotary_encodings.py``): RoPE against explicit rotation matrices and Transformers' Llama rotary,
its scalings against ``transformers.modeling_rope_utils``, RoPE on values, xPos against its formula by hand, and PoPE
against a hand loop of its paper's polar sum."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from conftest import make_config, make_model, random_ids
from torch.nn import functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import hf_posenc
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import AttentionDims
from hf_posenc.rotary_encodings import apply_rotary, rotary_inverse_frequencies, xpos_decay_base


HEAD_DIM, MAX_POSITIONS = 16, 32


def rope(scaling=None, rotary_fraction=1.0, apply_to_value=False, theta=10000.0, kept_frequency_fraction=1.0):
    spec = hf_posenc.PosEncGPT2Config(
        position_encoding={
            "type": "rope",
            "theta": theta,
            "rotary_fraction": rotary_fraction,
            "kept_frequency_fraction": kept_frequency_fraction,
            "apply_to_value": apply_to_value,
            "scaling": scaling,
        }
    ).position_encoding
    dims = AttentionDims(
        hidden_size=4 * HEAD_DIM, num_heads=4, head_dim=HEAD_DIM, max_positions=MAX_POSITIONS, causal=True
    )
    return POSITION_ENCODINGS["rope"](spec, dims)


def transformers_rope(rope_type, seq_len=None, rotary_fraction=1.0, **parameters):
    """Inverse frequencies and attention factor from Transformers for a Llama config with the same settings."""
    config = transformers.LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, **parameters},
        # Transformers 5.15's standardize_rope_params copies the config's own factor into rope_parameters
        partial_rotary_factor=parameters.get("partial_rotary_factor", rotary_fraction),
    )
    if rotary_fraction != 1.0:
        config.rope_parameters["partial_rotary_factor"] = rotary_fraction
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)


@pytest.mark.parametrize(
    ("scaling", "theirs"),
    [
        ({"type": "linear", "factor": 4.0}, ("linear", {"factor": 4.0})),
        ({"type": "yarn", "factor": 4.0}, ("yarn", {"factor": 4.0, "original_max_position_embeddings": 32})),
        (
            {"type": "yarn", "factor": 8.0, "original_max_positions": 16, "beta_fast": 16, "beta_slow": 2},
            ("yarn", {"factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 16, "beta_slow": 2}),
        ),
        (
            {"type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False},
            (
                "yarn",
                {
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                    "mscale": 0.707,
                    "mscale_all_dim": 1.0,
                    "truncate": False,
                },
            ),
        ),
        (
            {"type": "yarn", "factor": 2.0, "attention_factor": 1.3},
            ("yarn", {"factor": 2.0, "original_max_position_embeddings": 32, "attention_factor": 1.3}),
        ),
        (
            {"type": "llama3", "factor": 8.0, "original_max_positions": 64},
            (
                "llama3",
                {
                    "factor": 8.0,
                    "original_max_position_embeddings": 64,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                },
            ),
        ),
        (
            {"type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0},
            (
                "llama3",
                {
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                    "low_freq_factor": 2.0,
                    "high_freq_factor": 8.0,
                },
            ),
        ),
    ],
)
def test_static_scalings_match_transformers(scaling, theirs):
    encoding = rope(scaling)
    inv_freq, attention_factor = transformers_rope(theirs[0], **theirs[1])
    ours = encoding.inverse_frequencies(torch.arange(5)[None])[0, 0]
    torch.testing.assert_close(ours.float(), inv_freq, rtol=1e-6, atol=0)
    assert encoding.attention_factor == pytest.approx(attention_factor)


def test_dynamic_ntk_matches_transformers_at_each_tokens_length():
    """Each token uses the length it ends, position + 1; at or below the original length nothing changes."""
    encoding = rope({"type": "dynamic", "factor": 2.0})
    positions = [0, 9, 31, 32, 47, 99]
    ours = encoding.inverse_frequencies(torch.tensor([positions]))[0]
    for index, position in enumerate(positions):
        inv_freq, attention_factor = transformers_rope("dynamic", seq_len=position + 1, factor=2.0)
        torch.testing.assert_close(ours[index].float(), inv_freq, rtol=1e-6, atol=0)
        assert attention_factor == 1.0
    torch.testing.assert_close(ours[0], rotary_inverse_frequencies(HEAD_DIM, 10000.0))


def test_ntk_base_change_by_hand_and_equals_dynamic_at_its_factor():
    """NTK-aware: base theta * factor^(d/(d-2)). Transformers' dynamic NTK reaches that base at the length where
    factor L / L0 - (factor - 1) = factor, i.e. L = L0 (2 factor - 1) / factor (48 for factor 2, L0 32)."""
    ours = rope({"type": "ntk", "factor": 2.0}).inverse_frequencies(torch.arange(3)[None])[0, 0]
    base = 10000.0 * 2.0 ** (HEAD_DIM / (HEAD_DIM - 2))
    torch.testing.assert_close(
        ours, torch.tensor([base ** (-2 * i / HEAD_DIM) for i in range(8)], dtype=torch.float64)
    )
    inv_freq, _ = transformers_rope("dynamic", seq_len=48, factor=2.0)
    torch.testing.assert_close(ours.float(), inv_freq, rtol=1e-6, atol=0)


def test_linear_scaling_with_a_rotary_fraction_matches_transformers():
    encoding = rope({"type": "linear", "factor": 2.0}, rotary_fraction=0.5)
    inv_freq, _ = transformers_rope("linear", rotary_fraction=0.5, factor=2.0)
    torch.testing.assert_close(encoding.inverse_frequencies(torch.arange(2)[None])[0, 0].float(), inv_freq)


@pytest.mark.parametrize(("fraction", "factor"), [(0.5, None), (0.25, None), (0.4, 2.0), (0.99, None)])
def test_p_rope_frequencies_equal_transformers_proportional_rope(fraction, factor):
    """p-RoPE keeps the highest floor(p d / 2) frequencies theta^(-2i/d) of the whole head and zeroes the rest, as
    Transformers' ``proportional`` RoPE (Gemma 4; the paper's ``apply_p_rope``), linear factor included."""
    scaling = None if factor is None else {"type": "linear", "factor": factor}
    encoding = rope(scaling, kept_frequency_fraction=fraction)
    positions = torch.arange(1, 2)[None]  # position 1: the angles are the frequencies
    tables = encoding.prepare(positions, positions, "sdpa")
    parameters = {"partial_rotary_factor": fraction} | ({} if factor is None else {"factor": factor})
    inv_freq, attention_factor = transformers_rope("proportional", **parameters)
    kept = int(fraction * HEAD_DIM // 2)
    assert encoding.kept_frequencies == kept and (inv_freq[kept:] == 0).all() and (inv_freq[:kept] > 0).all()
    torch.testing.assert_close(tables["sin"][0, 0, 0].asin(), inv_freq, rtol=1e-5, atol=0)
    assert attention_factor == encoding.attention_factor == 1.0


def test_p_rope_scores_by_hand_and_leaves_the_lowest_pairs_untouched():
    """q_m . k_n = sum_i Re(z_q conj(z_k) e^(i (m - n) w_i)) over the pairs (x_i, x_(i + d/2)), with w_i =
    10000^(-2i/d) for the highest floor(p d / 2) = 2 frequencies (p = 0.25, d = 16) and w_i = 0 for the rest, whose
    features come out exactly as they went in."""
    encoding = rope(kept_frequency_fraction=0.25)
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, 6, HEAD_DIM, generator=generator, dtype=torch.float64) for _ in range(2))
    positions = torch.arange(3, 9)[None]
    rotated_q, rotated_k, _ = encoding.transform_qkv(q, k, k, encoding.prepare(positions, positions, "sdpa"))
    half, kept = HEAD_DIM // 2, 2
    for x, rotated in ((q, rotated_q), (k, rotated_k)):
        for first, last in ((kept, half), (half + kept, HEAD_DIM)):
            assert torch.equal(rotated[..., first:last], x[..., first:last])
    scores = rotated_q[0, 0] @ rotated_k[0, 0].T
    for m in range(6):
        for n in range(6):
            expected = 0.0
            for i in range(half):
                w = 10000.0 ** (-2 * i / HEAD_DIM) if i < kept else 0.0
                z_q = complex(q[0, 0, m, i], q[0, 0, m, i + half])
                z_k = complex(k[0, 0, n, i], k[0, 0, n, i + half])
                expected += (z_q * z_k.conjugate() * complex(math.cos((m - n) * w), math.sin((m - n) * w))).real
            assert scores[m, n].item() == pytest.approx(expected, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kept_frequency_fraction": 0.0}, r"option 'kept_frequency_fraction'=0.0 is out of range; valid: 0 < x <= 1"),
        ({"kept_frequency_fraction": 1.5}, r"option 'kept_frequency_fraction'=1.5 is out of range"),
        (
            {"kept_frequency_fraction": 0.5, "rotary_fraction": 0.5},
            r"kept_frequency_fraction=0.5 .* and rotary_fraction=0.5 .* give one of them",
        ),
        (
            {"kept_frequency_fraction": 0.5, "scaling": {"type": "yarn", "factor": 2.0}},
            r"scaling 'yarn' with kept_frequency_fraction=0.5: .* p-RoPE takes scaling 'linear' only",
        ),
    ],
)
def test_p_rope_refuses_options_without_meaning(options, message):
    with pytest.raises(ValueError, match=message):
        hf_posenc.PosEncGPT2Config(position_encoding={"type": "rope", **options})


def test_p_rope_that_keeps_no_frequency_of_the_head_is_refused():
    """head_dim 8 (hidden 32, 4 heads): p = 0.2 keeps floor(0.8) = 0 frequencies."""
    with pytest.raises(ValueError, match=r"kept_frequency_fraction=0.2 of head_dim=8 keeps no frequency .* 'none'"):
        make_model("gpt2", {"type": "rope", "kept_frequency_fraction": 0.2})


def test_yarn_attention_factor_scales_the_logits_like_transformers():
    """Transformers multiplies cos and sin by the attention factor: q.k is multiplied by its square."""
    encoding = rope({"type": "yarn", "factor": 4.0})
    q, k, v = (torch.randn(1, 1, 1, HEAD_DIM) for _ in range(3))
    positions = torch.zeros(1, 1, dtype=torch.long)
    tables = encoding.prepare(positions, positions, "sdpa")
    q2, k2, v2 = encoding.transform_qkv(q, k, v, tables)
    factor = 0.1 * math.log(4.0) + 1
    torch.testing.assert_close((q2 * k2).sum(), (q * k).sum() * factor**2)
    assert torch.equal(v2, v)


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"type": "ropeyarn", "factor": 2.0}, r"scaling type 'ropeyarn' is unknown; valid types: \['linear', 'ntk'"),
        ({"type": "longrope", "factor": 2.0}, r"short_factor must be a list of numbers \(one per frequency\)"),
        (
            {"type": "longrope", "factor": 2.0, "short_factor": [1.0] * 8, "long_factor": [1, "2"]},
            r"long_factor must be a list of numbers",
        ),
        ({"type": "linear"}, r"scaling 'linear' needs a 'factor'"),
        ({"type": "linear", "factor": 0.5}, r"option 'factor'=0.5 is out of range; valid: >= 1"),
        ({"type": "ntk", "factor": 2.0, "beta_fast": 3}, r"unknown scaling option\(s\) \['beta_fast'\] for 'ntk'"),
        ({"type": "llama3", "factor": 2.0, "low_freq_factor": 4.0}, r"high_freq_factor must be larger"),
        ({"type": "yarn", "factor": 2.0, "truncate": 1}, r"option 'truncate' must be bool, got 1"),
        ({"type": "yarn", "factor": 2.0, "beta_fast": 1, "beta_slow": 32}, r"beta_fast=1.0 must be >= beta_slow=32"),
        ({"rope_type": "linear", "type": "ntk", "factor": 2.0}, r"type='ntk' and its Transformers name rope_type"),
    ],
)
def test_bad_scaling_raises_when_the_config_is_built(scaling, message):
    with pytest.raises(ValueError, match=message):
        hf_posenc.PosEncGPT2Config(position_encoding={"type": "rope", "scaling": scaling})


@pytest.mark.parametrize("kind", ["dynamic", "yarn", "llama3"])
def test_original_length_beyond_max_position_embeddings_is_refused(kind):
    scaling = {"type": kind, "factor": 2.0, "original_max_positions": 64}
    with pytest.raises(ValueError, match=r"original_max_positions=64 is beyond max_position_embeddings=40"):
        make_config("gpt2", {"type": "rope", "scaling": scaling})
    with pytest.raises(ValueError, match=r"original_max_positions=64 is beyond max_position_embeddings=40"):
        make_config("bert", {"type": "rope", "scaling": scaling})
    assert make_config("gpt2", {"type": "rope", "scaling": {**scaling, "original_max_positions": 40}})


def test_transformers_rope_parameters_keys_are_read_as_ours():
    """A Transformers user writes ``rope_type`` and ``original_max_position_embeddings``."""
    theirs = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16}
    ours = {"type": "yarn", "factor": 4.0, "original_max_positions": 16, "beta_fast": 16}
    spec = hf_posenc.PosEncGPT2Config(position_encoding={"type": "rope", "scaling": theirs}).position_encoding
    assert spec == hf_posenc.PosEncGPT2Config(position_encoding={"type": "rope", "scaling": ours}).position_encoding
    assert spec["scaling"]["type"] == "yarn" and "rope_type" not in spec["scaling"]


def test_scaling_is_stored_in_full():
    config = hf_posenc.PosEncBertConfig(position_encoding={"type": "rope", "scaling": {"type": "llama3", "factor": 8}})
    assert config.position_encoding["scaling"] == {
        "type": "llama3",
        "factor": 8.0,
        "original_max_positions": None,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }


def test_rope_on_values_rotates_each_value_by_its_position():
    """kexue.fm/archives/8130, fused style on v: o_i = sum_j a_ij R_j v_j (absolute positions in the output)."""
    encoding = rope(apply_to_value=True)
    q, k, v = (torch.randn(1, 2, 5, HEAD_DIM) for _ in range(3))
    positions = torch.arange(3, 8)[None]
    _, _, rotated = encoding.transform_qkv(q, k, v, encoding.prepare(positions, positions, "sdpa"))
    for j in range(5):
        angles = (3 + j) * rotary_inverse_frequencies(HEAD_DIM, 10000.0)
        half = HEAD_DIM // 2
        x1, x2 = v[0, :, j, :half].double(), v[0, :, j, half:].double()
        expected = torch.cat([x1 * angles.cos() - x2 * angles.sin(), x1 * angles.sin() + x2 * angles.cos()], -1)
        torch.testing.assert_close(rotated[0, :, j].double(), expected, atol=1e-5, rtol=1e-5)


def test_rope_on_values_sees_a_shift_and_plain_rope_does_not(family):
    ids, positions = random_ids(2, 9), torch.arange(9)[None]
    moved = {}
    for apply_to_value in (False, True):
        model = make_model(family, {"type": "rope", "apply_to_value": apply_to_value})
        with torch.no_grad():
            shifted = model(ids, position_ids=positions + 13).logits
            moved[apply_to_value] = (shifted - model(ids, position_ids=positions).logits).abs().max()
    assert moved[False] < 1e-4 < moved[True]


@pytest.mark.parametrize(
    ("options", "relative"),
    [
        ({}, True),
        ({"apply_to_value": True}, False),
        ({"scaling": {"type": "dynamic", "factor": 2.0}}, False),
        ({"scaling": {"type": "longrope", "factor": 2.0, "short_factor": [1.0], "long_factor": [2.0]}}, False),
        ({"scaling": {"type": "yarn", "factor": 2.0}}, True),
        ({"scaling": {"type": "linear", "factor": 2.0}}, True),
        ({"kept_frequency_fraction": 0.5}, True),
    ],
)
def test_rope_relative_flag_follows_its_options(options, relative):
    spec = hf_posenc.PosEncGPT2Config(position_encoding={"type": "rope", **options}).position_encoding
    assert POSITION_ENCODINGS["rope"].is_relative(spec) is relative
    listed = hf_posenc.list_position_encodings()["rope"]
    assert listed["relative"] is True  # the defaults' value
    assert listed["relative_unless"] == "apply_to_value, or scaling of type 'dynamic' or 'longrope'"


LONG_ROPES = [
    {"type": "rope", "scaling": {"type": "dynamic", "factor": 2.0, "original_max_positions": 8}},
    {
        "type": "rope",
        "scaling": {"type": "dynamic", "factor": 3.0, "original_max_positions": 8},
        "apply_to_value": True,
    },
    {"type": "rope", "scaling": {"type": "yarn", "factor": 4.0, "original_max_positions": 8}},
    {"type": "rope", "scaling": {"type": "llama3", "factor": 4.0, "original_max_positions": 8}},
    {"type": "xpos", "scale_base": 16.0},
]


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
@pytest.mark.parametrize("position_encoding", LONG_ROPES)
def test_generation_past_the_original_length_with_cache_equals_without(position_encoding, cache_implementation):
    """Prompt 6 tokens, 10 generated past the original length 8: the cached keys keep their rotation (for dynamic
    NTK, that of their own length), so the scores equal recomputing the whole sequence."""
    model = make_model("gpt2", position_encoding, attn="sdpa")
    prompt = random_ids(2, 6, seed=3)
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :2] = 0
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    kwargs.update(output_scores=True, return_dict_in_generate=True)
    cached = model.generate(prompt, cache_implementation=cache_implementation, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    for a, b in zip(cached.scores, uncached.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_dynamic_ntk_changes_the_model_only_past_the_original_length():
    ids = random_ids(1, 12)
    dynamic = make_model(
        "gpt2", {"type": "rope", "scaling": {"type": "dynamic", "factor": 2.0, "original_max_positions": 8}}
    )
    plain = make_model("gpt2", "rope")
    with torch.no_grad():
        torch.testing.assert_close(dynamic(ids[:, :8]).logits, plain(ids[:, :8]).logits)
        assert (dynamic(ids).logits - plain(ids).logits).abs().max() > 1e-3


def test_xpos_decay_base_by_hand():
    # Sun et al. 2022 / torchscale: (arange(0, d, 2) + 0.4 d) / (1.4 d); d = 8.
    torch.testing.assert_close(xpos_decay_base(8), torch.tensor([3.2, 5.2, 7.2, 9.2], dtype=torch.float64) / 11.2)


def xpos_score_by_hand(q, k, n, m, theta=10000.0, scale_base=16.0):
    """sum over feature pairs i (i, i + d/2): zeta_i^((n - m)/s) * <q_pair, R_((m - n) theta_i) k_pair>."""
    d = len(q)
    half, total = d // 2, 0.0
    for i in range(half):
        zeta = (2 * i / d + 0.4) / 1.4
        angle = (m - n) * theta ** (-2 * i / d)
        q1, q2, k1, k2 = q[i], q[i + half], k[i], k[i + half]
        rope_score = q1 * (k1 * math.cos(angle) - k2 * math.sin(angle)) + q2 * (
            k1 * math.sin(angle) + k2 * math.cos(angle)
        )
        total += zeta ** ((n - m) / scale_base) * rope_score
    return total


def xpos_scores(q, k, query_positions, key_positions, scale_base=16.0):
    config = make_config("gpt2", {"type": "xpos", "scale_base": scale_base}, n_embd=8, n_head=1)
    encoding = POSITION_ENCODINGS["xpos"](config.position_encoding, AttentionDims(8, 1, 8, 40, True))
    query = encoding.transform_qkv(q, q, q, encoding.prepare(query_positions, query_positions, "sdpa"))[0]
    key = encoding.transform_qkv(k, k, k, encoding.prepare(key_positions, key_positions, "sdpa"))[1]
    return query[0, 0] @ key[0, 0].T


def test_xpos_scores_by_hand_and_depend_only_on_the_offset():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 4, 8, dtype=torch.float64), torch.randn(1, 1, 3, 8, dtype=torch.float64)
    query_positions, key_positions = torch.tensor([[5, 9, 12, 30]]), torch.tensor([[0, 4, 11]])
    scores = xpos_scores(q.float(), k.float(), query_positions, key_positions)
    for a, n in enumerate(query_positions[0].tolist()):
        for b, m in enumerate(key_positions[0].tolist()):
            expected = xpos_score_by_hand(q[0, 0, a].tolist(), k[0, 0, b].tolist(), n, m)
            assert scores[a, b].item() == pytest.approx(expected, rel=1e-4, abs=1e-5)
    shifted = xpos_scores(q.float(), k.float(), query_positions + 40, key_positions + 40)
    torch.testing.assert_close(shifted, scores, rtol=1e-4, atol=1e-5)


def test_xpos_scales_q_up_and_k_down_by_position():
    """At zero rotation angle (position 0 features aside) the q scale is zeta^(n/s) and the k scale zeta^(-n/s)."""
    config = make_config("gpt2", {"type": "xpos", "scale_base": 4.0}, n_embd=8, n_head=1)
    encoding = POSITION_ENCODINGS["xpos"](config.position_encoding, AttentionDims(8, 1, 8, 40, True))
    positions = torch.tensor([[8]])
    tables = encoding.prepare(positions, positions, "sdpa")
    zeta = xpos_decay_base(8)
    cos = torch.cos(8 * rotary_inverse_frequencies(8, 10000.0))
    torch.testing.assert_close(tables["query_cos"][0, 0, 0].double(), cos * zeta**2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(tables["key_cos"][0, 0, 0].double(), cos * zeta ** (-2), rtol=1e-6, atol=1e-7)
    x = torch.randn(1, 1, 1, 8)
    rotated = apply_rotary(x, tables["query_cos"], tables["query_sin"])
    assert rotated.norm() < x.norm()  # every pair shrinks: zeta < 1


def test_xpos_has_no_encoder_form():
    with pytest.raises(ValueError, match=r"position_encoding 'xpos' has no encoder form; it runs in: \['decoder'\]"):
        hf_posenc.PosEncBertConfig(position_encoding="xpos")


def hand_yarn(dim: int, theta: float, factor: float, original: int, beta_fast=32.0, beta_slow=1.0) -> torch.Tensor:
    """YaRN's "NTK-by-parts" (Peng et al. 2023, section 3.2), by hand: dimension i turns ``original / wavelength``
    times over the original length; dimensions turning more than ``beta_fast`` times keep ``theta^(-2i/d)``, fewer
    than ``beta_slow`` are divided by ``factor``, linear in between over the (whole-dimension) correction range."""
    base = [theta ** (-2 * i / dim) for i in range(dim // 2)]

    def dimension(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(dimension(beta_fast)), 0), min(math.ceil(dimension(beta_slow)), dim - 1)
    ramp = [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(dim // 2)]
    return torch.tensor([b / factor * r + b * (1 - r) for b, r in zip(base, ramp, strict=True)], dtype=torch.float64)


def hand_llama3(dim: int, theta: float, factor: float, original: int, low=1.0, high=4.0) -> torch.Tensor:
    """Llama 3.1's scaling (Meta's ``apply_scaling``), by hand: wavelengths above ``original / low`` divided by
    ``factor``, below ``original / high`` kept, smooth in between."""
    frequencies = []
    for i in range(dim // 2):
        frequency = theta ** (-2 * i / dim)
        wavelength = 2 * math.pi / frequency
        if wavelength < original / high:
            frequencies.append(frequency)
        elif wavelength > original / low:
            frequencies.append(frequency / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            frequencies.append((1 - smooth) * frequency / factor + smooth * frequency)
    return torch.tensor(frequencies, dtype=torch.float64)


@pytest.mark.parametrize(
    ("scaling", "expected", "attention_factor"),
    [
        ({"type": "yarn", "factor": 4.0}, hand_yarn(HEAD_DIM, 10000.0, 4.0, 32), 0.1 * math.log(4.0) + 1),
        (
            {"type": "yarn", "factor": 8.0, "original_max_positions": 16, "beta_fast": 16, "beta_slow": 2},
            hand_yarn(HEAD_DIM, 10000.0, 8.0, 16, 16.0, 2.0),
            0.1 * math.log(8.0) + 1,
        ),
        ({"type": "llama3", "factor": 8.0, "original_max_positions": 32}, hand_llama3(HEAD_DIM, 10000.0, 8.0, 32), 1),
        ({"type": "linear", "factor": 3.0}, rotary_inverse_frequencies(HEAD_DIM, 10000.0) / 3.0, 1.0),
    ],
)
def test_scalings_from_transformers_equal_their_papers_formulas_by_hand(scaling, expected, attention_factor):
    encoding = rope(scaling)
    torch.testing.assert_close(encoding.inverse_frequencies(torch.arange(3)[None])[0, 0], expected, rtol=1e-6, atol=0)
    assert encoding.attention_factor == pytest.approx(attention_factor)


SHORT = [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)]
LONG = [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)]


def test_longrope_reads_short_and_long_factors_per_token_as_transformers_and_by_hand():
    """Transformers' ``longrope`` at a length within and past the original (16), and by hand: ``theta^(-2i/d) /
    factor_i``, q and k times ``sqrt(1 + ln(factor) / ln(16))``; here each token by its own position."""
    scaling = {"type": "longrope", "factor": 2.0, "original_max_positions": 16, "short_factor": SHORT}
    encoding = rope({**scaling, "long_factor": LONG})
    positions = torch.tensor([[0, 14, 15, 16, 40]])
    ours = encoding.inverse_frequencies(positions)[0]
    base = rotary_inverse_frequencies(HEAD_DIM, 10000.0)
    theirs = {"factor": 2.0, "original_max_position_embeddings": 16, "short_factor": SHORT, "long_factor": LONG}
    for seq_len, factors, rows in ((16, SHORT, [0, 1, 2]), (17, LONG, [3, 4])):
        inv_freq, attention_factor = transformers_rope("longrope", seq_len=seq_len, **theirs)
        torch.testing.assert_close(ours[rows].float(), inv_freq.expand(len(rows), -1), rtol=1e-6, atol=0)
        torch.testing.assert_close(ours[rows[0]], base / torch.tensor(factors, dtype=torch.float64), rtol=1e-6, atol=0)
    assert encoding.attention_factor == pytest.approx(math.sqrt(1 + math.log(2.0) / math.log(16)))
    assert encoding.attention_factor == pytest.approx(attention_factor)


def test_longrope_generates_past_the_original_length_with_cache_as_without():
    scaling = {"type": "longrope", "factor": 2.0, "original_max_positions": 8}
    scaling.update(short_factor=SHORT[:4], long_factor=LONG[:4])  # head_dim 8: 4 frequencies
    model = make_model("gpt2", {"type": "rope", "scaling": scaling})
    ids = random_ids(2, 6)
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    kwargs.update(output_scores=True, return_dict_in_generate=True)
    cached, uncached = (model.generate(ids, use_cache=use_cache, **kwargs) for use_cache in (True, False))
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(cached.scores), torch.stack(uncached.scores), atol=1e-5, rtol=1e-4)


def test_longrope_factors_of_the_wrong_length_are_refused():
    scaling = {"type": "longrope", "factor": 2.0, "short_factor": [1.0] * 3, "long_factor": [1.0] * 4}
    with pytest.raises(ValueError, match=r"short_factor has 3 numbers; it needs one per rotated frequency, 4"):
        make_model("gpt2", {"type": "rope", "scaling": scaling})


@pytest.mark.parametrize("kind", ["linear", "yarn", "llama3", "longrope"])
def test_transformers_scalings_load_with_from_pretrained(kind, tmp_path):
    """``from_pretrained`` builds the model on the meta device; the scalings Transformers computes are computed on
    the CPU there too, and the loaded model gives the outputs of one built directly with the same weights."""
    scaling = {"type": kind, "factor": 4.0}
    if kind == "longrope":
        scaling.update(short_factor=[1.0] * 4, long_factor=[2.0] * 4)
    make_model("gpt2", "rope").save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, position_encoding={"type": "rope", "scaling": scaling}
    ).eval()
    built = transformers.AutoModelForCausalLM.from_config(loaded.config).eval()
    built.load_state_dict(loaded.state_dict())
    ids = random_ids(2, 40)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, built(ids).logits)


PARTIAL_ROTARY_CASES = [
    (
        "gpt_neox",
        {"type": "yarn", "factor": 4.0, "original_max_positions": 16},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        torch.arange(12),
    ),
    (
        "phi3",
        {"type": "longrope", "factor": 2.0, "original_max_positions": 16, "short_factor": SHORT[:4]},
        {"rope_type": "longrope", "short_factor": SHORT[:4]},
        torch.arange(16),
    ),
    (
        "phi3",
        {"type": "longrope", "factor": 2.0, "original_max_positions": 16, "short_factor": SHORT[:4]},
        {"rope_type": "longrope", "short_factor": SHORT[:4]},
        torch.arange(16, 30),  # past the original length: the long factors
    ),
]


@pytest.mark.parametrize(("model_type", "scaling", "theirs", "positions"), PARTIAL_ROTARY_CASES)
def test_a_partial_rotary_with_an_attention_factor_scales_only_the_rotated_features_like_transformers(
    model_type, scaling, theirs, positions
):
    """GPT-NeoX (yarn) and Phi-3 (longrope) with ``partial_rotary_factor`` 0.5: Transformers' rotary embedding puts
    the attention factor on cos and sin, and its ``apply_rotary_pos_emb`` rotates the first half of each head and
    passes the other half through unscaled."""
    scaling = {**scaling, "long_factor": LONG[:4]} if scaling["type"] == "longrope" else scaling
    encoding = rope(scaling, rotary_fraction=0.5)
    module = getattr(transformers.models, model_type)
    rope_parameters = {"rope_theta": 10000.0, "partial_rotary_factor": 0.5, **theirs}
    if model_type == "phi3":  # Phi-3's factor is max_position_embeddings / original_max_position_embeddings
        rope_parameters["long_factor"] = LONG[:4]
        config = transformers.Phi3Config(
            hidden_size=4 * HEAD_DIM,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=32,
            original_max_position_embeddings=16,
            rope_parameters=rope_parameters,
        )
        rotary, apply = module.modeling_phi3.Phi3RotaryEmbedding(config), module.modeling_phi3.apply_rotary_pos_emb
    else:
        config = transformers.GPTNeoXConfig(
            hidden_size=4 * HEAD_DIM,
            num_attention_heads=4,
            max_position_embeddings=64,
            rope_parameters=rope_parameters,
        )
        rotary = module.modeling_gpt_neox.GPTNeoXRotaryEmbedding(config)
        apply = module.modeling_gpt_neox.apply_rotary_pos_emb
    assert rotary.attention_scaling != pytest.approx(1.0)
    assert encoding.attention_factor == pytest.approx(rotary.attention_scaling)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, len(positions), HEAD_DIM) for _ in range(3))
    cos, sin = rotary(q, positions[None])
    expected_q, expected_k = apply(q, k, cos, sin)
    tables = encoding.prepare(positions[None], positions[None], "eager")
    ours_q, ours_k, ours_v = encoding.transform_qkv(q, k, v, tables)
    torch.testing.assert_close(ours_q, expected_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_k, expected_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours_q[..., HEAD_DIM // 2 :], q[..., HEAD_DIM // 2 :])  # the features that carry no position
    assert torch.equal(ours_v, v)


def rotation_matrix(position: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """R_m built entry by entry: feature i pairs with i + d/2 and turns by m * theta^(-2i/d)."""
    matrix = torch.zeros(dim, dim, dtype=torch.float64)
    half = dim // 2
    for i in range(half):
        angle = position * theta ** (-2 * i / dim)
        matrix[i, i], matrix[i, i + half] = math.cos(angle), -math.sin(angle)
        matrix[i + half, i], matrix[i + half, i + half] = math.sin(angle), math.cos(angle)
    return matrix


def rotate(x: torch.Tensor, position: int, theta: float = 10000.0) -> torch.Tensor:
    dim = x.shape[-1]
    angles = position * rotary_inverse_frequencies(dim, theta)
    return apply_rotary(x[None, None, None], angles.cos()[None, None, None], angles.sin()[None, None, None])[0, 0, 0]


@pytest.mark.parametrize(("m", "n"), [(0, 0), (3, 7), (11, 2), (100, 37)])
def test_rotation_matches_the_explicit_matrix(m, n):
    x = torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(rotate(x, m), rotation_matrix(m, 8) @ x)


@pytest.mark.parametrize(("m", "n"), [(0, 5), (3, 7), (11, 2), (100, 37)])
def test_rotated_dot_product_depends_only_on_the_offset(m, n):
    """<R_m q, R_n k> = <q, R_(n-m) k> (kexue.fm/archives/8130, RoPE)."""
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    torch.testing.assert_close(rotate(q, m) @ rotate(k, n), q @ rotate(k, n - m))


def test_rotation_matches_transformers_llama():
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    angles = torch.arange(6)[:, None].float() * rotary_inverse_frequencies(8, 10000.0).float()
    cos, sin = angles.cos(), angles.sin()
    llama_q, llama_k = apply_rotary_pos_emb(q, k, torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None])
    torch.testing.assert_close(apply_rotary(q, cos[None, None], sin[None, None]), llama_q)
    torch.testing.assert_close(apply_rotary(k, cos[None, None], sin[None, None]), llama_k)


def test_rotary_fraction_rotates_only_the_leading_features():
    model = make_model("gpt2", {"type": "rope", "rotary_fraction": 0.5})
    encoding = model.transformer.position_encoding
    assert encoding.rotary_dim == 4  # head_dim 8
    x = torch.randn(1, 1, 3, 8)
    angles = torch.arange(3)[None, None, :, None].float() * rotary_inverse_frequencies(4, 10000.0).float()
    rotated = apply_rotary(x, angles.cos(), angles.sin())
    assert torch.equal(rotated[..., 4:], x[..., 4:])
    torch.testing.assert_close(rotated[0, 0, 2, :4], (rotation_matrix(2, 4).float() @ x[0, 0, 2, :4]))


def test_theta_changes_the_model():
    ids = random_ids(1, 8)
    with torch.no_grad():
        a = make_model("bert", {"type": "rope", "theta": 10000.0})(ids).logits
        b = make_model("bert", {"type": "rope", "theta": 100.0})(ids).logits
    assert (a - b).abs().max() > 1e-4


def pope_scheme(phase_bias: bool = True, heads: int = 2, head_dim: int = 6):
    dims = AttentionDims(heads * head_dim, heads, head_dim, max_positions=64, causal=False)
    return POSITION_ENCODINGS["pope"]({"type": "pope", "theta": 100.0, "phase_bias": phase_bias}, dims)


@pytest.mark.parametrize("phase_bias", [True, False])
def test_pope_scores_equal_the_polar_sum(phase_bias):
    """Gopalakrishnan et al. 2025: ``q~ . k~ = sum_c softplus(q_tc) softplus(k_sc) cos((t - s) theta_c - delta_c)``,
    ``theta_c = theta^(-c/d)``, ``delta`` clamped to ``[-2 pi, 0]``; v unchanged, q and k of width 2 d."""
    torch.manual_seed(0)
    scheme = pope_scheme(phase_bias)
    if phase_bias:
        with torch.no_grad():
            scheme.phase_bias.uniform_(-8.0, 1.0)  # some entries outside [-2 pi, 0]: read clamped
    query, key, value = (torch.randn(1, 2, 4, 6, dtype=torch.float64) for _ in range(3))
    positions = torch.tensor([[3, 7, 8, 20]])
    tables = scheme.prepare(positions, positions, "eager")
    new_query, new_key, new_value = scheme.transform_qkv(query, key, value, tables)
    assert new_query.shape == new_key.shape == (1, 2, 4, 12) and new_value is value
    scores = new_query @ new_key.transpose(-1, -2)
    for h in range(2):
        for t in range(4):
            for s in range(4):
                expected = 0.0
                for c in range(6):
                    delta = min(max(scheme.phase_bias[h, c].item(), -2 * math.pi), 0.0) if phase_bias else 0.0
                    angle = (positions[0, t] - positions[0, s]).item() * 100.0 ** (-c / 6) - delta
                    magnitude = F.softplus(query[0, h, t, c]) * F.softplus(key[0, h, s, c])
                    expected += magnitude.item() * math.cos(angle)
                assert scores[0, h, t, s].item() == pytest.approx(expected, abs=1e-5)


def test_pope_phase_bias_starts_at_zero_and_learns():
    """x-transformers' ``learned_bias``: zeros, one per head and frequency; the clamp to ``[-2 pi, 0]`` passes the
    gradient at its bound 0, so it learns from its start."""
    torch.manual_seed(0)
    model = hf_posenc.PosEncGPT2LMHeadModel(make_config("gpt2", "pope")).train()
    bias = model.transformer.position_encoding.phase_bias
    assert torch.equal(bias, torch.zeros(4, 8))
    ids = random_ids(2, 8)
    model(ids, labels=ids).loss.backward()
    assert bias.grad is not None and bias.grad.abs().min() > 0


def vo_rope_attention_by_hand(x, weights, biases, output_projection, heads: int, causal: bool, first_position: int):
    """VO-RoPE (kexue.fm/archives/10862) by a loop over queries and keys: ``a_ij = softmax_j((R_i q_i).(R_j k_j) /
    sqrt(d))``, ``o_i = R_i^T sum_j a_ij R_j v_j``, heads merged, then the output projection."""
    length, hidden = x.shape
    head_dim = hidden // heads
    q, k, v = (x @ weight + bias for weight, bias in zip(weights, biases, strict=True))
    rotations = [rotation_matrix(first_position + t, head_dim) for t in range(length)]
    output = torch.zeros(length, hidden, dtype=torch.float64)
    for h in range(heads):
        part = slice(h * head_dim, (h + 1) * head_dim)
        for i in range(length):
            keys = range(i + 1) if causal else range(length)
            scores = torch.stack([(rotations[i] @ q[i, part]) @ (rotations[j] @ k[j, part]) for j in keys])
            a = torch.softmax(scores / math.sqrt(head_dim), dim=0)
            mixed = sum(a[n] * (rotations[j] @ v[j, part]) for n, j in enumerate(keys))
            output[i, part] = rotations[i].T @ mixed
    weight, bias = output_projection
    return output @ weight + bias


def test_vo_rope_rotates_values_by_the_keys_position_and_the_output_back_by_the_querys(family):
    """A layer's attention output against the hand loop of ``o_i = R_i^T sum_j a_ij R_j v_j``, at positions that do
    not start at 0, in both families (BERT's self-attention has no output projection)."""
    model = make_model(family, {"type": "rope", "vo_rope": True}).double()
    ids, first = random_ids(1, 7), 5
    positions = torch.arange(first, first + 7)[None]
    if family == "gpt2":
        attention = model.transformer.h[0].attn
        weight, bias = attention.c_attn.weight, attention.c_attn.bias
        parts = [slice(i * 32, (i + 1) * 32) for i in range(3)]
        weights, biases = [weight[:, p] for p in parts], [bias[p] for p in parts]
        output_projection = (attention.c_proj.weight, attention.c_proj.bias)
    else:
        attention = model.bert.encoder.layer[0].attention.self
        linears = (attention.query, attention.key, attention.value)
        weights, biases = [linear.weight.T for linear in linears], [linear.bias for linear in linears]
        output_projection = (torch.eye(32, dtype=torch.float64), torch.zeros(32, dtype=torch.float64))
    seen = {}
    handle = attention.register_forward_hook(lambda module, args, output: seen.update(x=args[0], y=output[0]))
    with torch.no_grad():
        model(ids, position_ids=positions)
        handle.remove()
        expected = vo_rope_attention_by_hand(
            seen["x"][0], weights, biases, output_projection, heads=4, causal=family == "gpt2", first_position=first
        )
    # the model's angles are float32 (RoPE's tables), the loop's float64
    torch.testing.assert_close(seen["y"][0], expected, atol=1e-6, rtol=1e-6)


def test_vo_rope_and_rope_on_values_are_two_forms_of_one_option():
    with pytest.raises(ValueError, match="vo_rope=True .* and apply_to_value=True .* give one of them"):
        make_config("gpt2", {"type": "rope", "vo_rope": True, "apply_to_value": True})
