"""Relative schemes that read the content through position tables (``content_position_encodings.py``: shaw, xlnet,
deberta, tupe, cope, relative_key): each term checked against a hand-written loop of its formula on tiny tensors,
DeBERTa against Transformers' ``deberta_v2``, BERT's relative_key / relative_key_query against a loop of
Transformers 4.x's formula and ``convert`` of a 4.x checkpoint folder against a hand-written copy of 4.x's BertModel
forward, the memory promise (no ``(q_len, kv_len, head_dim)`` tensor), family and option errors, and loading as
remote code."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from conftest import (
    assert_flex_training_step_equals_eager,
    make_config,
    make_model,
    random_ids,
)
from safetensors.torch import save_file
from torch.nn import functional as F
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention, noop_mask
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DebertaV2Config
from transformers.models.deberta_v2 import modeling_deberta_v2

import hf_posenc
from hf_posenc import attention_backends, posenc_attention, relative_tables
from hf_posenc.attention_backends import build_dense_mask
from hf_posenc.configuration_posenc import resolve_attention_normalizer
from hf_posenc.content_position_encodings import DeBERTaBuckets, deberta_log_bucket
from hf_posenc.modeling_posenc_common import build_layer_position_term, build_position_encoding
from hf_posenc.posenc_attention import positional_attention, value_rows_term
from hf_posenc.position_interface import ValueRows
from hf_posenc.score_bias_encodings import t5_relative_bucket
from hf_posenc.softmax_normalizers import Softmax


ATOL = 1e-5
HEADS, HEAD_DIM, HIDDEN = 4, 8, 32
# Query positions after a gap and keys of a cache (two rows with different positions), so nothing assumes 0..n-1.
QUERY_POSITIONS = torch.tensor([[5, 6, 9], [0, 1, 2]])
KEY_POSITIONS = torch.tensor([[0, 1, 2, 3, 5, 6, 9], [0, 0, 0, 0, 0, 1, 2]])


def scheme_and_term(family: str, spec, layer: int = 0):
    """The scheme and layer ``layer``'s position term of a tiny model, with every parameter perturbed."""
    model = make_model(family, spec)
    base = model.base_model
    attention = base.encoder.layer[layer].attention.self if family == "bert" else base.h[layer].attn
    return model, base.position_encoding, attention


def qkv(batch: int = 2, q_len: int = 3, kv_len: int = 7, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, HEADS)
    return (
        torch.randn(*shape, q_len, HEAD_DIM, generator=generator),
        torch.randn(*shape, kv_len, HEAD_DIM, generator=generator),
        torch.randn(*shape, kv_len, HEAD_DIM, generator=generator),
    )


def attention_inputs(encoding, query_positions, key_positions, visible=None, consecutive=False):
    tables = encoding.prepare(query_positions, key_positions, "eager", consecutive)
    inputs = {"backend": "eager", "query_positions": query_positions, "key_positions": key_positions}
    mask = None if visible is None else visible[:, None]
    inputs.update(build_dense_mask(mask, tables.pop("score_bias", None), torch.float32, keep_boolean=False))
    inputs["position"] = tables
    return inputs


def softmax_attention_loop(scores: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``o_i = sum_j softmax_j(s_ij) v_j`` for ``(batch, heads, q, k)`` scores, -> ``(batch, q, heads, d)``."""
    return torch.matmul(scores.softmax(-1), value).transpose(1, 2)


def seven_token_attention(spec) -> tuple:
    """A BERT layer's scheme and attention module for ``spec``, ``(query, key, value)`` of 7 tokens, their positions
    (0 to 6) and the eager attention inputs of those positions."""
    _, encoding, attention = scheme_and_term("bert", spec)
    positions = torch.arange(7)[None]
    return encoding, attention, qkv(q_len=7), positions, attention_inputs(encoding, positions, positions)


def assert_output_is_softmax_loop(attention_module, encoding, tensors: tuple, inputs, scores: torch.Tensor) -> None:
    """The module's softmax attention (:func:`run_attention`) gives :func:`softmax_attention_loop` over ``scores``,
    the whole pre-softmax scores written out by the test, with nothing added to the values."""
    query, key, value = tensors
    with torch.no_grad():
        expected = softmax_attention_loop(scores, value)
        output = run_attention(attention_module, encoding, query, key, value, inputs)
    torch.testing.assert_close(output, expected, atol=ATOL, rtol=1e-4)


def run_attention(attention_module, encoding, query, key, value, inputs):
    output, _ = positional_attention(
        query,
        key,
        value,
        inputs,
        encoding,
        Softmax(resolve_attention_normalizer("softmax"), encoding.dims),
        attention_module.position_term,
        scaling=HEAD_DIM**-0.5,
        dropout=0.0,
        training=False,
        causal=False,
        project_query_key=attention_module.project_query_key,
    )
    return output


# ---- Shaw (seed eqs. (4)-(6)) ----


@pytest.mark.parametrize("positions", ["given", "consecutive"])
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_shaw_key_and_value_terms_equal_the_loop(family, positions):
    """Given positions (a gap, cached keys, rows that differ: gathered and scattered) and the model's consecutive
    positions (the sorted index: read and summed by runs)."""
    k = 2
    _, encoding, attention = scheme_and_term(family, {"type": "shaw", "max_distance": k})
    term = attention.position_term
    query, key, value = qkv()
    query_positions, key_positions = QUERY_POSITIONS, KEY_POSITIONS
    if positions == "consecutive":
        query_positions, key_positions = torch.arange(3)[None].expand(2, -1), torch.arange(7)[None].expand(2, -1)
    inputs = attention_inputs(encoding, query_positions, key_positions, consecutive=positions == "consecutive")
    assert ("shaw_index_starts" in inputs["position"]) is (positions == "consecutive")
    weights = torch.rand(2, HEADS, 3, 7)
    key_table, value_table = term.key_table.weight, term.value_table.weight
    expected_key, expected_value = torch.zeros(2, HEADS, 3, 7), torch.zeros(2, HEADS, 3, HEAD_DIM)
    for b in range(2):
        for i in range(3):
            for j in range(7):
                row = max(-k, min(k, int(key_positions[b, j] - query_positions[b, i]))) + k  # clip(j - i)
                for h in range(HEADS):
                    expected_key[b, h, i, j] = query[b, h, i] @ key_table[row] * 0.5
                    expected_value[b, h, i] += weights[b, h, i, j] * value_table[row]
    with torch.no_grad():
        torch.testing.assert_close(term.score_term(query, key, inputs, 0.5, None), expected_key)
        torch.testing.assert_close(value_rows_term(weights, term.value_rows(inputs)), expected_value)


def test_shaw_attention_equals_equations_4_and_5():
    """o_i = sum_j softmax_j(q_i (k_j + R^K_ij) / sqrt(d)) (v_j + R^V_ij), composed by the attention function."""
    _, encoding, attention = scheme_and_term("bert", {"type": "shaw", "max_distance": 3})
    term = attention.position_term
    query, key, value = qkv(q_len=7)
    positions = torch.arange(7)[None]
    rows = (positions[0][None, :] - positions[0][:, None]).clamp(-3, 3) + 3  # [i, j] -> clip(j - i) + 3
    relative_keys, relative_values = term.key_table.weight[rows], term.value_table.weight[rows]  # (i, j, d): loop only
    scores = torch.einsum("bhid,bhjd->bhij", query, key)
    scores = (scores + torch.einsum("bhid,ijd->bhij", query, relative_keys)) / math.sqrt(HEAD_DIM)
    weights = scores.softmax(-1)
    expected = torch.einsum("bhij,bhjd->bhid", weights, value) + torch.einsum(
        "bhij,ijd->bhid", weights, relative_values
    )
    with torch.no_grad():
        output = run_attention(
            attention, encoding, query, key, value, attention_inputs(encoding, positions, positions)
        )
    torch.testing.assert_close(output, expected.transpose(1, 2), atol=ATOL, rtol=1e-4)


def test_nezha_table_is_the_sinusoid_of_the_clipped_distance():
    k = 3
    _, encoding, attention = scheme_and_term("bert", {"type": "shaw", "max_distance": k, "table": "sinusoidal"})
    assert not list(attention.position_term.parameters())
    table = encoding.prepare(torch.arange(2)[None], torch.arange(2)[None], "eager")["shaw_table"]
    for row, distance in enumerate(range(-k, k + 1)):
        for i in range(HEAD_DIM // 2):
            angle = distance / 10000 ** (2 * i / HEAD_DIM)
            assert table[row, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[row, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


@pytest.mark.parametrize(
    ("use_value", "dropout", "backend"),
    [(True, 0.0, "sdpa"), (False, 0.0, "sdpa"), (True, 0.1, "eager"), (False, 0.1, "sdpa")],
)
def test_shaw_runs_on_sdpa_and_on_eager_only_with_attention_dropout_and_its_value_term(use_value, dropout, backend):
    """SDPA recomputes the weights for the value term, without SDPA's dropout mask: training with attention dropout
    and the value term runs eager (the weights dropped once, for v and R^V alike)."""
    model = make_model("gpt2", {"type": "shaw", "use_value": use_value}, attn="sdpa", attn_pdrop=dropout).train()
    seen = []
    model.transformer.h[0].register_forward_pre_hook(lambda module, args: seen.extend(args))
    model(random_ids(1, 5))
    assert [leaf for leaf in seen if isinstance(leaf, str)] == [backend]


# ---- Transformer-XL / XLNet (seed eq. (9)) ----


def transformer_xl_sinusoid(distance: int, dim: int) -> torch.Tensor:
    frequencies = [1 / 10000 ** (2 * i / dim) for i in range(dim // 2)]
    return torch.tensor([math.sin(distance * f) for f in frequencies] + [math.cos(distance * f) for f in frequencies])


CONTIGUOUS_QUERY_POSITIONS, CONTIGUOUS_KEY_POSITIONS = (
    torch.tensor([[4, 5, 6]] * 2),
    torch.tensor([list(range(7))] * 2),
)


@pytest.mark.parametrize("contiguous", [False, True], ids=["gather", "skew"])
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_xlnet_terms_2_3_4_equal_the_loop(family, contiguous):
    """Both reads of the rows (the skew on the model's static promise of consecutive positions, ``consecutive``; the
    gather otherwise) against the loop."""
    _, encoding, attention = scheme_and_term(family, "xlnet")
    term = attention.position_term
    query, key, _ = qkv()
    query_positions, key_positions = QUERY_POSITIONS, KEY_POSITIONS
    if contiguous:
        query_positions, key_positions = CONTIGUOUS_QUERY_POSITIONS, CONTIGUOUS_KEY_POSITIONS
    inputs = attention_inputs(encoding, query_positions, key_positions, consecutive=contiguous)
    assert ("xl_index" not in inputs["position"]) is contiguous
    w_kr = term.position_key.weight  # (hidden, hidden): W_{K,R} R = w_kr @ R
    u, v = term.content_bias, term.position_bias
    expected = torch.zeros(2, HEADS, 3, 7)
    for b in range(2):
        for i in range(3):
            for j in range(7):
                relative = w_kr @ transformer_xl_sinusoid(int(query_positions[b, i] - key_positions[b, j]), HIDDEN)
                for h in range(HEADS):
                    r = relative[h * HEAD_DIM : (h + 1) * HEAD_DIM]
                    content_position = query[b, h, i] @ r  # x_i W_Q W_{K,R} R_{i-j}
                    global_content = u[h] @ key[b, h, j]  # u W_K x_j
                    global_position = v[h] @ r  # v W_{K,R} R_{i-j}
                    expected[b, h, i, j] = (content_position + global_content + global_position) * 0.25
    with torch.no_grad():
        torch.testing.assert_close(term.score_term(query, key, inputs, 0.25, None), expected, atol=ATOL, rtol=1e-4)


def test_xlnet_attention_adds_the_content_term_and_nothing_to_the_values():
    encoding, attention, (query, key, value), _, inputs = seven_token_attention("xlnet")
    with torch.no_grad():
        position_terms = attention.position_term.score_term(query, key, inputs, HEAD_DIM**-0.5, None)
    scores = query @ key.transpose(-1, -2) / math.sqrt(HEAD_DIM) + position_terms
    assert_output_is_softmax_loop(attention, encoding, (query, key, value), inputs, scores)


def test_xlnet_init_follows_transformer_xl():
    model = transformers_model("bert", "xlnet", initializer_range=0.02, hidden_size=256, num_attention_heads=4)
    term = model.bert.encoder.layer[0].attention.self.position_term
    for parameter in (term.content_bias, term.position_bias):
        assert parameter.std().item() == pytest.approx(0.02, rel=0.2)


def transformers_model(family, spec, **overrides):
    import transformers

    config = make_config(family, spec, **overrides)
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    return auto.from_config(config)


# ---- DeBERTa (disentangled attention; Transformers' deberta_v2) ----


@pytest.mark.parametrize(("buckets", "largest"), [(256, 512), (8, 40), (32, 100), (6, 5)])
def test_deberta_log_buckets_equal_transformers(buckets, largest):
    distances = torch.arange(-700, 701)
    expected = modeling_deberta_v2.make_log_bucket_position(distances, buckets, largest)
    log_scale = DeBERTaBuckets(buckets, largest).log_scale
    assert torch.equal(deberta_log_bucket(distances, buckets, log_scale), expected.long())


@pytest.mark.parametrize("spec", [{}, {"position_buckets": 8, "max_relative_positions": 20}, {"position_buckets": 0}])
def test_deberta_relative_index_equals_transformers_build_relative_position(spec):
    config = make_config("bert", {"type": "deberta", **spec}, max_position_embeddings=64)
    encoding = build_position_encoding(config, causal=False)
    positions = torch.arange(30)[None]
    index = encoding.prepare(positions, positions, "eager")["deberta_index"]
    spec = config.position_encoding
    states = torch.zeros(1, 30, 4)
    buckets, largest = spec["position_buckets"], spec["max_relative_positions"]
    relative = modeling_deberta_v2.build_relative_position(states, states, bucket_size=buckets, max_position=largest)
    span = buckets if buckets > 0 else largest
    assert torch.equal(index, (relative + span).clamp(0, 2 * span - 1))


@pytest.mark.parametrize("spec", [{}, {"position_buckets": 8, "max_relative_positions": 20}, {"position_buckets": 0}])
def test_deberta_row_per_distance_equals_transformers_log_bucket_for_every_distance(spec):
    """Consecutive positions (queries 200..599, keys 0..699): the row of each distance, computed once per distance
    (``deberta_rows``, what flex reads at ``i - j + kv_len - 1``), and the per-pair index expanded from it (eager,
    SDPA), against Transformers' ``make_log_bucket_position`` of every distance -499..599 and of every pair."""
    config = make_config("bert", {"type": "deberta", **spec}, max_position_embeddings=1024)
    encoding = build_position_encoding(config, causal=False)
    spec = config.position_encoding
    buckets, largest = spec["position_buckets"], spec["max_relative_positions"]
    span = buckets if buckets > 0 else largest

    def expected_row(distances):
        if buckets > 0:
            distances = modeling_deberta_v2.make_log_bucket_position(distances, buckets, largest)
        return (distances + span).clamp(0, 2 * span - 1)

    query_positions, key_positions = torch.arange(200, 600)[None], torch.arange(700)[None]
    rows = encoding.prepare(query_positions, key_positions, "flex_attention", consecutive=True)["deberta_rows"]
    assert torch.equal(rows, expected_row(torch.arange(-499, 600)))
    index = encoding.prepare(query_positions, key_positions, "eager", consecutive=True)["deberta_index"]
    assert torch.equal(index, expected_row(query_positions[0, :, None] - key_positions[0, None, :])[None])


@pytest.mark.parametrize("att_type", ["c2p|p2c", "c2p", "p2c"])
@pytest.mark.parametrize("share_att_key", [True, False])
@pytest.mark.parametrize("positions", ["given", "consecutive"])
def test_deberta_c2p_and_p2c_equal_the_loop(att_type, share_att_key, positions):
    """Given positions (gathered per pair) and consecutive ones (the sorted index, read by runs, c2p reversed)."""
    spec = dict(type="deberta", att_type=att_type, share_att_key=share_att_key, position_buckets=4)
    spec["max_relative_positions"] = 8
    _, encoding, attention = scheme_and_term("gpt2", spec)
    term = attention.position_term
    query, key, _ = qkv(q_len=9, kv_len=9) if positions == "consecutive" else qkv()
    query_positions, key_positions = QUERY_POSITIONS, KEY_POSITIONS
    if positions == "consecutive":
        query_positions = key_positions = torch.arange(9)[None].expand(2, -1)
    inputs = attention_inputs(encoding, query_positions, key_positions, consecutive=positions == "consecutive")
    assert ("deberta_c2p_starts" in inputs["position"]) is (positions == "consecutive")
    with torch.no_grad():
        embeddings = encoding.LayerNorm(encoding.rel_embeddings.weight)  # (2 span, hidden)
        if share_att_key:
            projected_query, projected_key, _ = attention.c_attn(embeddings).split(HIDDEN, dim=-1)
        else:
            projected_key = term.pos_key_proj(embeddings) if "c2p" in att_type else None
            projected_query = term.pos_query_proj(embeddings) if "p2c" in att_type else None
    scale = 1 / math.sqrt(HEAD_DIM * (1 + len(att_type.split("|"))))
    q_len, kv_len = query.shape[-2], key.shape[-2]
    expected = torch.zeros(2, HEADS, q_len, kv_len)
    for b in range(2):
        for i in range(q_len):
            for j in range(kv_len):
                distance = int(query_positions[b, i] - key_positions[b, j])
                if abs(distance) > 2:  # mid = 2: sign(d) (2 + ceil(log(|d| / 2) / log(7 / 2) * 1))
                    distance = int(math.copysign(2 + math.ceil(math.log(abs(distance) / 2) / math.log(3.5)), distance))
                row = min(max(distance + 4, 0), 7)
                for h in range(HEADS):
                    heads = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
                    if "c2p" in att_type:
                        expected[b, h, i, j] += query[b, h, i] @ projected_key[row, heads] * scale
                    if "p2c" in att_type:
                        expected[b, h, i, j] += key[b, h, j] @ projected_query[row, heads] * scale
    assert encoding.content_scale == pytest.approx(math.sqrt(HEAD_DIM) * scale)
    with torch.no_grad():
        score = term.score_term(
            query, key, inputs, HEAD_DIM**-0.5 * encoding.content_scale, attention.project_query_key
        )
    torch.testing.assert_close(score, expected, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize(
    ("att_type", "share_att_key", "buckets"), [("c2p|p2c", True, 8), ("c2p|p2c", False, 8), ("p2c", False, 0)]
)
def test_deberta_attention_layer_equals_transformers_disentangled_attention(att_type, share_att_key, buckets):
    """One PosEnc BERT attention layer with DeBERTa weights copied in gives DebertaV2's context layer."""
    spec = dict(type="deberta", att_type=att_type, share_att_key=share_att_key)
    spec.update(position_buckets=buckets, max_relative_positions=20)
    model = make_model("bert", spec)
    ours = model.bert.encoder.layer[0].attention.self
    reference_config = DebertaV2Config(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        relative_attention=True,
        pos_att_type=att_type.split("|"),
        share_att_key=share_att_key,
        position_buckets=buckets if buckets else -1,
        max_relative_positions=20,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    reference = modeling_deberta_v2.DisentangledSelfAttention(reference_config).eval()
    weights = {"query_proj": ours.query, "key_proj": ours.key, "value_proj": ours.value}
    for name in ("pos_key_proj", "pos_query_proj"):
        if hasattr(ours.position_term, name):
            weights[name] = getattr(ours.position_term, name)
    reference.load_state_dict({f"{n}.{p}": t for n, m in weights.items() for p, t in m.state_dict().items()})
    ids = random_ids(2, 13)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 10:] = 0
    captured = {}
    ours.register_forward_hook(lambda module, args, output: captured.update(states=args[0], output=output[0]))
    encoding = model.bert.position_encoding
    with torch.no_grad():
        model(ids, attention_mask=attention_mask)
        mask_4d = attention_mask[:, None, None, :] * attention_mask[:, None, :, None]
        expected, _ = reference(
            captured["states"], mask_4d, rel_embeddings=encoding.LayerNorm(encoding.rel_embeddings.weight)
        )
    real = attention_mask.bool()
    torch.testing.assert_close(captured["output"][real], expected[real], atol=ATOL, rtol=1e-4)


def test_deberta_refuses_buckets_wider_than_the_largest_distance():
    with pytest.raises(ValueError, match="max_relative_positions=9 must exceed position_buckets / 2 \\+ 1 = 9"):
        make_config("bert", {"type": "deberta", "position_buckets": 16, "max_relative_positions": 9})
    with pytest.raises(ValueError, match="'att_type'='c2c' is out of range"):
        make_config("bert", {"type": "deberta", "att_type": "c2c"})


# ---- TUPE (eq. (7) and the [CLS] untying) ----


@pytest.mark.parametrize(("family", "untying"), [("bert", True), ("bert", False), ("gpt2", False)])
def test_tupe_untied_term_relative_bias_and_cls_untying_equal_the_loop(family, untying):
    spec = {"type": "tupe", "num_buckets": 8, "max_distance": 16}
    if family == "bert":
        spec["cls_untying"] = untying
    _, encoding, _ = scheme_and_term(family, spec)
    with torch.no_grad():
        bias = encoding.prepare(QUERY_POSITIONS, KEY_POSITIONS, "eager")["score_bias"]
        layer_norm, table = encoding.LayerNorm, encoding.table.weight
        expected = torch.zeros(2, HEADS, 3, 7)
        for b in range(2):
            for i in range(3):
                for j in range(7):
                    p_i, p_j = layer_norm(table[QUERY_POSITIONS[b, i]]), layer_norm(table[KEY_POSITIONS[b, j]])
                    distance = torch.tensor(int(QUERY_POSITIONS[b, i] - KEY_POSITIONS[b, j]))
                    bucket = t5_relative_bucket(
                        distance, bidirectional=family == "bert", num_buckets=8, max_distance=16
                    )
                    for h in range(HEADS):
                        heads = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
                        untied = encoding.query(p_i)[heads] @ encoding.key(p_j)[heads] / math.sqrt(2 * HEAD_DIM)
                        value = untied + encoding.relative_attention_bias.weight[bucket, h]
                        if untying and QUERY_POSITIONS[b, i] == 0:
                            value = encoding.cls_to_others[h]  # theta_1: [CLS] to others (and to itself)
                        elif untying and KEY_POSITIONS[b, j] == 0:
                            value = encoding.others_to_cls[h]  # theta_2: others to [CLS]
                        expected[b, h, i, j] = value
    torch.testing.assert_close(bias, expected, atol=ATOL, rtol=1e-4)
    assert encoding.cls_untying is untying


def test_tupe_scales_the_content_term_by_one_over_sqrt_2d():
    encoding, attention, (query, key, value), positions, inputs = seven_token_attention("tupe")
    with torch.no_grad():
        bias = encoding.prepare(positions, positions, "eager")["score_bias"]
    scores = query @ key.transpose(-1, -2) / math.sqrt(2 * HEAD_DIM) + bias
    assert_output_is_softmax_loop(attention, encoding, (query, key, value), inputs, scores)


def test_tupe_untying_defaults_by_family_and_is_refused_in_a_decoder():
    assert make_model("bert", "tupe").bert.position_encoding.cls_untying is True
    assert make_model("gpt2", "tupe").transformer.position_encoding.cls_untying is False
    with pytest.raises(ValueError, match="cls_untying=True has no decoder form"):
        make_config("gpt2", {"type": "tupe", "cls_untying": True})
    with pytest.raises(ValueError, match="cls_untying=True has no decoder form"):
        make_config("bert", {"type": "tupe", "cls_untying": True}, is_decoder=True)


def test_tupe_positions_past_its_table_raise():
    model = make_model("bert", {"type": "tupe", "max_positions": 8})
    with pytest.raises(ValueError, match=r"tupe: positions must be in 0..7 \(its absolute table has 8 rows\)"):
        model(random_ids(1, 9))


@pytest.mark.parametrize(("family", "first_query"), [("bert", 0), ("gpt2", 0), ("gpt2", 4)])
def test_tupe_bias_on_consecutive_positions_equals_the_per_pair_path_values_and_grads(family, first_query):
    """Consecutive positions (keys as a cache gives them, one row per batch element): the bucket bias per distance
    expanded by Toeplitz, one ``(1, heads, q, k)`` bias, against the per-pair path's ``(batch, heads, q, k)``."""
    _, encoding, _ = scheme_and_term(family, {"type": "tupe", "num_buckets": 8, "max_distance": 16})
    query_positions = torch.arange(first_query, 9)[None]
    key_positions = torch.arange(9)[None].expand(3, -1)
    weights = torch.randn(3, HEADS, 9 - first_query, 9, generator=torch.Generator().manual_seed(1))
    parameters = [p for p in encoding.parameters() if p.requires_grad]
    results = []
    for consecutive in (True, False):
        bias = encoding.prepare(query_positions, key_positions, "eager", consecutive=consecutive)["score_bias"]
        results.append((bias.expand(3, -1, -1, -1), *torch.autograd.grad((bias * weights).sum(), parameters)))
        assert bias.shape == ((1 if consecutive else 3), HEADS, 9 - first_query, 9)
    for fast, per_pair in zip(*results, strict=True):
        torch.testing.assert_close(fast, per_pair, atol=ATOL, rtol=1e-4)


def test_tupe_model_folds_one_bias_shared_by_the_batch(monkeypatch):
    """Through the model (default positions, batch 3, padding): the bias ``prepare`` hands over is ``(1, heads,
    q, k)`` on SDPA, and the output equals eager's."""
    outputs, shapes = {}, []
    ids = random_ids(3, 10)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 7:] = 0
    for attn in ("eager", "sdpa"):
        model = make_model("bert", "tupe", attn=attn)
        encoding = model.base_model.position_encoding
        prepare = encoding.prepare

        def recording_prepare(*args, prepare=prepare, **kwargs):
            tables = prepare(*args, **kwargs)
            shapes.append(tuple(tables["score_bias"].shape))
            return tables

        monkeypatch.setattr(encoding, "prepare", recording_prepare)
        with torch.no_grad():
            outputs[attn] = model(ids, attention_mask=attention_mask).logits
    assert shapes == [(1, HEADS, 10, 10)] * 2
    visible = attention_mask.bool()
    torch.testing.assert_close(outputs["sdpa"][visible], outputs["eager"][visible], atol=ATOL, rtol=1e-4)


def uncompiled_flex_models(monkeypatch, family: str, calls: list, spec="tupe"):
    """The scheme ``spec`` on eager and on flex (uncompiled FlexAttention standing in for the compiled kernel: same
    semantics, any head width; each call recorded in ``calls``), with the same weights."""

    def uncompiled_flex(*args, **kwargs):
        calls.append(kwargs["score_mod"])
        return flex_attention(*args, **kwargs)

    monkeypatch.setattr(attention_backends, "flex_returns_lse", lambda device: True)
    monkeypatch.setattr(attention_backends, "FLEX_CPU_MIN_HEAD_DIM", 0)
    monkeypatch.setattr(attention_backends, "_compiled_flex_attention", lambda *region: uncompiled_flex)
    name = spec if isinstance(spec, str) else spec["type"]
    monkeypatch.setattr(hf_posenc.POSITION_ENCODINGS[name], "flex_compiles_on_cpu", True)
    return make_model(family, spec, attn="eager"), make_model(family, spec, attn="flex_attention")


FLEX_CONTENT_SCHEMES = [
    ("bert", {"type": "shaw", "use_value": False, "max_distance": 3}),
    ("gpt2", {"type": "shaw", "use_value": False, "table": "sinusoidal", "max_distance": 3}),
    ("bert", "xlnet"),
    ("gpt2", "xlnet"),
    ("bert", {"type": "deberta", "position_buckets": 8, "max_relative_positions": 16}),
    ("gpt2", {"type": "deberta", "share_att_key": False, "position_buckets": 4, "max_relative_positions": 8}),
    ("bert", {"type": "deberta", "att_type": "p2c", "position_buckets": 0, "max_relative_positions": 3}),
    ("bert", "relative_key"),
    ("gpt2", {"type": "relative_key", "variant": "key"}),
]


FLEX_VALUE_TERM_SCHEMES = [  # Shaw with use_value (the default)
    ("bert", {"type": "shaw", "max_distance": 3}),
    ("gpt2", {"type": "shaw", "table": "sinusoidal", "max_distance": 2}),
]


@pytest.mark.parametrize("positions", ["default", "given"])
@pytest.mark.parametrize(("family", "spec"), FLEX_CONTENT_SCHEMES + [("bert", "tupe"), ("gpt2", "tupe")])
def test_content_score_mod_on_flex_equals_eager(family, spec, positions, monkeypatch):
    """Each layer's content term (tupe: the scheme's position-only one) read per (query, key) inside
    FlexAttention's score_mod, against eager: default positions (tupe: per-distance bucket table, one untied table for
    the batch) and given positions that differ per row with a gap and [CLS] (position 0) only in the first row, a
    padded row; buckets and clipping that bite."""
    calls = []
    eager, flex = uncompiled_flex_models(monkeypatch, family, calls, spec)
    ids = random_ids(2, 12)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 9:] = 0
    position_ids = None
    if positions == "given":
        position_ids = torch.stack([torch.cat([torch.arange(4), torch.arange(9, 17)]), torch.arange(2, 14)])
    outputs = []
    for model in (eager, flex):
        with torch.no_grad():
            outputs.append(model(ids, attention_mask=attention_mask, position_ids=position_ids).logits)
    name = spec if isinstance(spec, str) else spec["type"]
    assert len(calls) == flex.config.num_hidden_layers and calls[0].__name__ == f"{name}_score_mod"
    visible = attention_mask.bool()
    torch.testing.assert_close(outputs[1][visible], outputs[0][visible], atol=ATOL, rtol=1e-4)


# Each scheme on consecutive positions (its window of distances) and given ones (its per-pair index or positions),
# each family with each scheme and each kind of positions once.
FLEX_QUERY_CHUNK_CASES = [
    ("bert", "xlnet", "default"),
    ("gpt2", "xlnet", "given"),
    ("bert", "relative_key", "given"),
    ("gpt2", "relative_key", "default"),
]


@pytest.mark.parametrize(("family", "spec", "positions"), FLEX_QUERY_CHUNK_CASES)
def test_flex_in_query_chunks_equals_eager_values_and_grads(family, spec, positions, flex_trained_on_cpu, monkeypatch):
    """Row tables beyond the chunk budget (here any table): FlexAttention runs per block of 128 queries (three
    checkpointed calls a layer for 300 tokens, the last of 44), each with its chunk's rows of the tables and of the
    mask. Logits, the loss and every gradient equal eager's, with a padded row, on consecutive positions (the chunk's
    window of distances) and on given ones with a gap (the chunk's rows of the per-pair index, or of the positions).
    FlexAttention is compiled on ``aot_eager`` (``flex_trained_on_cpu``), as the kernel's graph is traced."""
    monkeypatch.setattr(relative_tables, "CHUNK_ELEMENTS", 1)
    calls = []
    monkeypatch.setattr(
        posenc_attention, "query_chunk_block_mask", counted(posenc_attention.query_chunk_block_mask, calls)
    )
    lengths = dict(max_position_embeddings=512) if family == "bert" else dict(n_positions=512)
    models = {attn: make_model(family, spec, attn=attn, **lengths).train() for attn in ("eager", "flex_attention")}
    ids = random_ids(2, 300)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 260:] = 0
    position_ids = None
    if positions == "given":
        position_ids = torch.stack([torch.cat([torch.arange(100), torch.arange(150, 350)]), torch.arange(2, 302)])
    logits = assert_flex_training_step_equals_eager(models, ids, attention_mask, 1e-5, 1e-4, position_ids)
    layers = models["flex_attention"].config.num_hidden_layers
    assert [(start, stop) for start, stop in calls[:3]] == [(0, 128), (128, 256), (256, 300)]
    assert len(calls) == 2 * 3 * layers  # each chunk's forward, and its recompute in the backward
    visible = attention_mask.bool()
    torch.testing.assert_close(logits["flex_attention"][visible], logits["eager"][visible], atol=ATOL, rtol=1e-4)


def counted(function, calls: list):
    """``function(block_mask, start, stop)``, each call's ``(start, stop)`` appended to ``calls``."""

    def counting(block_mask, start, stop):
        calls.append((start, stop))
        return function(block_mask, start, stop)

    return counting


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize(("family", "spec"), FLEX_VALUE_TERM_SCHEMES)
def test_shaw_value_term_on_flex_equals_eager(family, spec, padding, monkeypatch):
    """Shaw's value term on FlexAttention (the keys inside the clip from the band of scores and the log-sum-exp, the
    clipped tails from the rest of the mass; an encoder splits them with a second pass) against eager, on the model's
    default positions: clipping that bites (12 tokens, k = 3 or 2), a padded row (left padding in the decoder: query
    rows that see no key, whose log-sum-exp is -inf)."""
    calls = []
    eager, flex = uncompiled_flex_models(monkeypatch, family, calls, spec)
    ids = random_ids(2, 12)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 9:] = 0
    if padding == "left":
        attention_mask = attention_mask.flip(-1)
    outputs = []
    for model in (eager, flex):
        with torch.no_grad():
            outputs.append(model(ids, attention_mask=attention_mask).logits)
    passes = 2 if family == "bert" else 1  # the encoder's second pass over the keys left of the clip
    assert len(calls) == passes * flex.config.num_hidden_layers
    visible = attention_mask.bool()
    torch.testing.assert_close(outputs[1][visible], outputs[0][visible], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("k", [3, 12])
def test_clipped_value_rows_term_equals_the_formula_under_any_mask(k):
    """``sum_j a_ij R[clip(j - i, -k, k) + k]`` from FlexAttention's log-sum-exp against softmax weights computed by
    hand, float64: a padded row, a key hidden inside the clip (a mask that is neither causal nor padding), a query
    row that sees no key (its term is 0), with a score_mod; one tail pass, none when k >= n (both tails empty)."""
    torch.manual_seed(0)
    batch, heads, n, head_dim = 2, 2, 11, 8
    query, key, value = (torch.randn(batch, heads, n, head_dim, dtype=torch.float64) for _ in range(3))
    table = torch.randn(2 * k + 1, head_dim, dtype=torch.float64)
    lengths = torch.tensor([11, 7])
    row_bias = torch.randn(batch, heads, n, 2 * k + 1, dtype=torch.float64)

    def mask_mod(batch_idx, head_idx, q_idx, kv_idx):
        return (kv_idx < lengths[batch_idx]) & (kv_idx != q_idx + 1) & (q_idx != 4)

    def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        return score + row_bias[batch_idx, head_idx, q_idx, (kv_idx - q_idx).clamp(-k, k) + k]

    block_mask = create_block_mask(mask_mod, batch, 1, n, n, device="cpu")

    tail_passes = []

    def attend(*args, pass_name=None, **kwargs):
        tail_passes.append(pass_name)
        return flex_attention(*args, **kwargs)

    _, aux = flex_attention(query, key, value, score_mod, block_mask, 0.3, return_aux=AuxRequest(lse=True))
    rows = ValueRows(table, None, None, k)
    term = posenc_attention.clipped_value_rows_term(
        attend, query, key, value, score_mod, block_mask, 0.3, aux.lse, rows, causal=False
    )
    index = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).clamp(-k, k) + k  # clip(j - i) + k
    scores = query @ key.transpose(-1, -2) * 0.3 + row_bias.gather(-1, index.expand(batch, heads, n, n))
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = (j < lengths[:, None, None]) & (j != i + 1) & (i != 4)
    weights = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1).nan_to_num()
    expected = torch.einsum("bhij,ijd->bhid", weights, table[index])
    torch.testing.assert_close(term, expected)
    assert term[:, :, 4].abs().max() == 0
    assert tail_passes == (["tail"] if k < n else [])


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padding"])
@pytest.mark.parametrize("reach", [3, 150, 400])
def test_left_tail_block_mask_drops_only_the_tiles_with_no_tail_pair(padded, reach):
    """The tail pass's BlockMask: every tile of the given mask (None: all of them, full) that holds a pair ``j <= i -
    reach`` inside the sequence, with its kind (full or partial) and mask_mod; the others gone. 300 tokens in tiles of
    128, the second row padded after 200 keys; reach 150 leaves the first row of tiles empty, 400 every tile."""
    from hf_posenc.posenc_attention import left_tail_block_mask

    n, lengths = 300, torch.tensor([300, 200])

    def mask_mod(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx < lengths[batch_idx]

    given = create_block_mask(mask_mod, 2, 1, n, n, device="cpu") if padded else None
    tail = left_tail_block_mask(given, n, reach, torch.device("cpu"))
    assert tail.BLOCK_SIZE == (128, 128) and tail.seq_lengths == (n, n)
    assert tail.mask_mod is (given.mask_mod if padded else noop_mask)

    def tiles(num_blocks, indices):
        dense = torch.zeros(*num_blocks.shape, 3, dtype=torch.bool)
        for position in itertools.product(*(range(size) for size in num_blocks.shape)):
            for column in indices[position][: num_blocks[position]].tolist():
                dense[position + (column,)] = True
        return dense

    holds_tail = torch.tensor(
        [[any(j <= i - reach for i in range(128 * a, min(128 * a + 128, n)) for j in range(128 * c, 128 * c + 128))
          for c in range(3)] for a in range(3)]
    )  # fmt: skip
    if padded:
        expected_partial = tiles(given.kv_num_blocks, given.kv_indices) & holds_tail
        expected_full = tiles(given.full_kv_num_blocks, given.full_kv_indices) & holds_tail
    else:
        expected_full, expected_partial = holds_tail[None, None], torch.zeros(1, 1, 3, 3, dtype=torch.bool)
    assert torch.equal(tiles(tail.kv_num_blocks, tail.kv_indices), expected_partial)
    assert torch.equal(tiles(tail.full_kv_num_blocks, tail.full_kv_indices), expected_full)
    assert torch.equal(tail.to_dense().bool(), (expected_partial | expected_full).expand_as(tail.to_dense()))


def test_a_decoder_refuses_a_given_block_mask_with_a_value_term_on_flex(monkeypatch):
    """A decoder's value term on FlexAttention takes the mask to be causal; a BlockMask the user passes is used as
    given, so it is refused with the alternatives named, not trusted."""
    monkeypatch.setattr(attention_backends, "flex_refusal", lambda *args, **kwargs: [])
    model = make_model("gpt2", {"type": "shaw", "max_distance": 2}, attn="flex_attention")
    ids = random_ids(1, 8)
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, 1, 1, 8, 8, device="cpu")
    with torch.no_grad(), pytest.raises(ValueError, match="shaw's value term on FlexAttention in a decoder"):
        model(ids, attention_mask=block_mask)


@pytest.mark.parametrize(("family", "first_position"), [("bert", 0), ("bert", 3), ("gpt2", 0)])
def test_tupe_flex_features_and_score_mod_equal_the_dense_bias_values_and_grads(family, first_position):
    """On consecutive positions flex scores ``[q ; p U_Q] . [k ; p U_K] / sqrt(2d)`` (position features zeroed at
    [CLS]) plus the score_mod's bucket bias per distance and [CLS]'s values, nothing ``(q, k)``-sized; against
    ``q . k / sqrt(2d)`` plus the bias eager adds (the untied matmul, the Toeplitz bucket bias, ``untie_cls``),
    every pair evaluated as flex's unfused path does (vmap): values and the gradients of q, k and every parameter of
    the scheme. Positions from 0 (the encoder's [CLS] row and column replaced) and from 3 (no [CLS])."""
    from hf_posenc.posenc_attention import _on_pairs

    _, encoding, _ = scheme_and_term(family, {"type": "tupe", "num_buckets": 8, "max_distance": 16})
    positions = torch.arange(first_position, first_position + 10)[None]
    generator = torch.Generator().manual_seed(5)
    query, key = (torch.randn(3, HEADS, 10, HEAD_DIM, generator=generator) for _ in range(2))
    grad_output = torch.randn(3, HEADS, 10, 10, generator=generator)
    scale = (2 * HEAD_DIM) ** -0.5
    parameters = [p for p in encoding.parameters()]
    results = []
    for backend in ("flex_attention", "eager"):
        leaves = [t.clone().requires_grad_() for t in (query, key)]
        tables = encoding.prepare(positions, positions, backend, True)
        if backend == "eager":
            scores = leaves[0] @ leaves[1].transpose(-1, -2) * scale + tables["score_bias"]
        else:
            shapes = {name: tuple(table.shape) for name, table in tables.items()}
            cls = {"tupe_cls_per_key": (HEADS, 10), "tupe_cls_per_query": (HEADS, 10)} if family == "bert" else {}
            features = (1, HEADS, 10, HEAD_DIM)
            assert shapes == {
                "tupe_per_distance": (HEADS, 24),  # 19 distances, padded to a multiple of 8
                "tupe_query_features": features,
                "tupe_key_features": features,
                **cls,
            }
            flex_query, flex_key = encoding.flex_query_key(*leaves, tables)
            assert flex_query.shape[-1] == flex_key.shape[-1] == 2 * HEAD_DIM
            scores = flex_query @ flex_key.transpose(-1, -2) * scale
            q_idx, kv_idx = (index.flatten() for index in torch.meshgrid(torch.arange(10), torch.arange(10)))
            score_mod = encoding.score_mod(tables, positions, positions)
            scores = _on_pairs(score_mod, 3, HEADS, q_idx, kv_idx, scores.flatten(-2)).view_as(scores)
        grads = torch.autograd.grad((scores * grad_output).sum(), leaves + parameters, materialize_grads=True)
        results.append((scores, *grads))
    for actual, expected in zip(*results, strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_tupe_flex_request_on_cpu_runs_sdpa_with_the_reason(caplog):
    """Compiled CPU FlexAttention cannot compile tupe's score_mod at a second length (torch 2.13): SDPA, logged; CUDA
    keeps flex."""
    attention_backends._log.cache_clear()
    spec = make_config("bert", "tupe").position_encoding
    softmax = resolve_attention_normalizer("softmax")
    with torch.no_grad(), caplog.at_level("INFO", logger="hf_posenc"):
        assert (
            attention_backends.choose_backend("flex_attention", spec, softmax, torch.device("cpu"), head_dim=32)
            == "sdpa"
        )
        cuda = torch.device("cuda")
        assert (
            attention_backends.choose_backend("flex_attention", spec, softmax, cuda, head_dim=32) == "flex_attention"
        )
    assert "emits C++ that does not compile for this scheme's score_mod" in caplog.text


def test_content_row_tables_get_the_cuda_kernel_options_for_tables_that_need_gradients():
    """A layer's content row tables are built from q and k, so with gradients on they need gradients whatever the
    scheme's own parameters: on CUDA FlexAttention then gets the kernel options measured on an H100, off CUDA or
    without gradients torch's defaults."""
    _, encoding, attention = scheme_and_term("bert", {"type": "shaw", "use_value": False, "table": "sinusoidal"})
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    options = {"kernel_options": attention_backends.FLEX_CUDA_KERNEL_OPTIONS}
    assert attention_backends.flex_kernel_options(cuda, encoding, attention.position_term) == options
    assert attention_backends.flex_kernel_options(cpu, encoding, attention.position_term) == {}
    with torch.no_grad():
        assert attention_backends.flex_kernel_options(cuda, encoding, attention.position_term) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward runs on CUDA only (torch 2.13)")
@pytest.mark.parametrize(
    ("family", "spec"), FLEX_CONTENT_SCHEMES + FLEX_VALUE_TERM_SCHEMES + [("bert", "tupe"), ("gpt2", "tupe")]
)
def test_content_score_mod_compiled_on_cuda_equals_eager_values_and_grads(family, spec):
    """Compiled FlexAttention on CUDA (heads of 32, a padded row): loss and every parameter's gradient (the tables'
    gradients flow back through the score_mod's captured tensors; tupe: its position-only score_mod) against eager."""
    wide = dict(hidden_size=64, num_attention_heads=2) if family == "bert" else dict(n_embd=64, n_head=2)
    ids = random_ids(2, 24).cuda()
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 20:] = 0
    models = {attn: make_model(family, spec, attn=attn, **wide).cuda().train() for attn in ("eager", "flex_attention")}
    assert_flex_training_step_equals_eager(models, ids, attention_mask, atol=1e-4, rtol=1e-3)


# ---- CoPE (gates, contextual positions, interpolation) ----


@pytest.mark.parametrize("max_positions", [64, 3])
def test_cope_gates_positions_and_interpolation_equal_the_loop(max_positions):
    """Causal visibility over cached keys with a padded slot; max_positions=3 makes the clamp bite."""
    _, _, attention = scheme_and_term("gpt2", {"type": "cope", "max_positions": max_positions})
    term = attention.position_term
    query, key, _ = qkv()
    visible = KEY_POSITIONS[:, None, :] <= QUERY_POSITIONS[:, :, None]  # (batch, q, k), causal
    visible[1, :, :4] = False  # left padding of the second row
    inputs = {"visible": visible[:, None], "position": {}}
    embeddings = term.position_embeddings  # (head_dim, max_positions)
    expected = torch.zeros(2, HEADS, 3, 7)
    for b in range(2):
        for h in range(HEADS):
            for i in range(3):
                gates = [
                    torch.sigmoid(query[b, h, i] @ key[b, h, t] * 0.5) if visible[b, i, t] else torch.tensor(0.0)
                    for t in range(7)
                ]
                for j in range(7):
                    position = min(float(sum(gates[j:])), max_positions - 1)  # p_ij = sum_{t=j..i} g_it
                    low, high = math.floor(position), math.ceil(position)
                    interpolated = embeddings[:, low] * (1 - (position - low)) + embeddings[:, high] * (position - low)
                    expected[b, h, i, j] = query[b, h, i] @ interpolated
    with torch.no_grad():
        score = term.score_term(query, key, inputs, 0.5, None)
    torch.testing.assert_close(score, expected, atol=ATOL, rtol=1e-4)


def test_cope_embeddings_start_at_zero_as_the_reference():
    model = transformers_model("gpt2", "cope")
    assert torch.count_nonzero(model.transformer.h[1].attn.position_term.position_embeddings) == 0


def test_cope_has_no_encoder_form():
    with pytest.raises(ValueError, match=r"'cope' has no encoder form; it runs in: \['decoder'\]"):
        make_config("bert", "cope")
    assert make_config("bert", "cope", is_decoder=True).position_encoding["type"] == "cope"


# ---- shared promises ----


class ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor an operator returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in torch.utils._pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.shapes.add(tuple(leaf.shape))
        return out


CONTENT_SCHEMES = [
    ("bert", "shaw"),
    ("gpt2", {"type": "shaw", "table": "sinusoidal"}),
    ("bert", "xlnet"),
    ("gpt2", "xlnet"),
    ("bert", "deberta"),
    ("gpt2", {"type": "deberta", "share_att_key": False}),
    ("bert", "tupe"),
    ("gpt2", "tupe"),
    ("gpt2", "cope"),
    ("bert", "relative_key"),
    ("gpt2", {"type": "relative_key", "variant": "key"}),
]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(("family", "spec"), CONTENT_SCHEMES)
def test_no_tensor_of_shape_n_by_n_by_head_dim_is_built(family, spec, attn):
    """13 tokens, head_dim 8, batch 3 (batch x heads = 12): a (13, 13, 8)-shaped tensor would show as two 13s and
    an 8 in one shape, in the forward or the backward."""
    model = make_model(family, spec, attn=attn).train()
    ids = random_ids(3, 13)
    recorder = ShapeRecorder()
    with recorder:
        model(ids, labels=ids).loss.backward()
    offending = [shape for shape in recorder.shapes if shape.count(13) >= 2 and HEAD_DIM in shape]
    assert not offending, offending


LOAD_ALL_WITHOUT_HF_POSENC = textwrap.dedent(
    """
    import sys
    sys.modules["hf_posenc"] = None  # any import of hf_posenc now raises ImportError
    import torch, transformers
    for folder in sys.argv[1:]:
        auto = open(folder + "/auto.txt").read()
        model = getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True).eval()
        assert model.__class__.__module__.startswith("transformers_modules."), model.__class__.__module__
        with torch.no_grad():
            torch.save(model(torch.load(folder + "/ids.pt")).logits, folder + "/logits.pt")
    """
)


def test_every_content_scheme_loads_as_remote_code_without_hf_posenc(tmp_path):
    folders, expected = [], {}
    for index, (family, spec) in enumerate(CONTENT_SCHEMES):
        folder = tmp_path / str(index)
        model = make_model(family, spec)
        model.save_pretrained(folder)
        assert (folder / "content_position_encodings.py").is_file()
        ids = random_ids(2, 9)
        torch.save(ids, folder / "ids.pt")
        (folder / "auto.txt").write_text("AutoModelForMaskedLM" if family == "bert" else "AutoModelForCausalLM")
        with torch.no_grad():
            expected[folder] = model(ids).logits
        folders.append(str(folder))
    result = subprocess.run(
        [sys.executable, "-c", LOAD_ALL_WITHOUT_HF_POSENC, *folders],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for folder, logits in expected.items():
        torch.testing.assert_close(torch.load(folder / "logits.pt"), logits, atol=1e-5, rtol=1e-4)
        spec = json.loads((folder / "config.json").read_text())["position_encoding"]
        assert spec["type"] in ("shaw", "xlnet", "deberta", "tupe", "cope", "relative_key")


def test_catalogue_describes_each_scheme_with_options_and_defaults():
    catalogue = hf_posenc.list_position_encodings()
    expected_defaults = {
        "shaw": {"max_distance": 16, "use_value": True, "table": "learned"},
        "xlnet": {},
        "deberta": {"att_type": "c2p|p2c", "position_buckets": 256, "max_relative_positions": 512},
        "tupe": {"max_positions": None, "num_buckets": 32, "max_distance": 128, "cls_untying": None},
        "cope": {"max_positions": 64},
        "relative_key": {"variant": "key_query", "max_positions": None},
    }
    for name, defaults in expected_defaults.items():
        entry = catalogue[name]
        assert entry["description"] and entry["backends"]
        for option, default in defaults.items():
            assert entry["options"][option]["default"] == default and entry["options"][option]["doc"]
    relative = ["shaw", "xlnet", "deberta", "cope", "relative_key"]
    assert [name for name in expected_defaults if catalogue[name]["relative"]] == relative
    assert catalogue["cope"]["families"] == ["decoder"]
    assert catalogue["deberta"]["options"]["share_att_key"]["default"] is True


def test_a_layer_term_is_built_per_layer_with_its_own_parameters():
    config = make_config("bert", "xlnet")
    first, second = (build_layer_position_term(config, False, index) for index in (0, 1))
    assert first.content_bias is not second.content_bias


@pytest.mark.parametrize("scheme", ["shaw", "xlnet", "deberta", "tupe"])
def test_convert_keeps_the_stock_weights_and_initialises_the_layer_terms(scheme):
    import transformers

    stock = transformers.BertModel(
        transformers.BertConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, vocab_size=61)
    ).eval()
    converted = hf_posenc.convert(stock, position_encoding=scheme)
    layer, stock_layer = converted.encoder.layer[1].attention.self, stock.encoder.layer[1].attention.self
    assert torch.equal(layer.query.weight, stock_layer.query.weight)
    assert all(torch.isfinite(p).all() for p in converted.parameters())
    with torch.no_grad():
        assert torch.isfinite(converted(random_ids(2, 9)).last_hidden_state).all()


# ---- the fast paths against the eager reference ----


@pytest.mark.parametrize("chunk_queries", [5, 2], ids=["one-chunk", "chunks-of-2"])
def test_attention_with_learned_bias_equals_softmax_attention_values_and_grads(chunk_queries, monkeypatch):
    """SDPA's forward with the bias detached and the recomputed backward (in one chunk, and in chunks of 2 of the 5
    queries), against autograd through the formula; a bias broadcast over the batch, masked keys at finfo.min."""
    from hf_posenc.learned_bias_attention import attention_with_learned_bias

    monkeypatch.setattr(relative_tables, "CHUNK_ELEMENTS", 2 * 3 * 6 * chunk_queries)

    generator = torch.Generator().manual_seed(3)
    query = torch.randn(2, 3, 5, 8, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(2, 3, 6, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    bias = torch.randn(1, 3, 5, 6, generator=generator, dtype=torch.float64)
    visible = torch.rand(2, 1, 5, 6, generator=generator) > 0.3
    visible[..., 0] = True
    grad_output = torch.randn(2, 3, 5, 8, generator=generator, dtype=torch.float64)
    results = []
    for attend in (
        lambda q, k, v, m: torch.matmul((torch.matmul(q, k.transpose(-1, -2)) * 0.3 + m).softmax(-1), v),
        lambda q, k, v, m: attention_with_learned_bias(q, k, v, m, 0.3),
    ):
        inputs = [t.clone().requires_grad_() for t in (query, key, value, bias)]
        mask = inputs[3].masked_fill(~visible, torch.finfo(torch.float64).min)
        output = attend(*inputs[:3], mask)
        results.append((output, *torch.autograd.grad((output * grad_output).sum(), inputs)))
    for expected, actual in zip(*results, strict=True):
        torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("sorted_index", [True, False], ids=["runs", "scatter"])
@pytest.mark.parametrize("mask", ["additive", "boolean", "causal"])
def test_sdpa_with_the_value_term_equals_the_formula_values_and_grads(mask, sorted_index, monkeypatch):
    """SDPA's path for Shaw's value term: SDPA's output plus the weights recomputed in chunks of 2 queries and summed
    per row times the table, the backward recomputed in chunks, against autograd through
    ``softmax(s) v + sum_j a_ij table[index_ij]``; SDPA's mask additive with a learned part, boolean, or none with
    is_causal (made additive by ``additive_mask``); gradients of q, k, v, the learned mask and the table."""
    from hf_posenc.learned_bias_attention import attention_with_learned_bias
    from hf_posenc.posenc_attention import additive_mask
    from hf_posenc.position_interface import ValueRows

    monkeypatch.setattr(relative_tables, "CHUNK_ELEMENTS", 2 * HEADS * 7 * 2)
    generator = torch.Generator().manual_seed(4)
    query, key, value = qkv(q_len=5, kv_len=7, seed=4)
    table = torch.randn(5, HEAD_DIM, generator=generator)
    index = (torch.arange(7)[None, :] - torch.arange(5)[:, None] - 2).clamp(-2, 2)[None] + 2  # queries at 2..6
    starts = relative_tables.run_starts(index, 5) if sorted_index else None
    if not sorted_index:
        index = index.expand(2, -1, -1).clone()
    visible = torch.rand(2, 1, 5, 7, generator=generator) > 0.3
    visible[..., 0] = True
    learned = torch.randn(2, HEADS, 5, 7, generator=generator)
    if mask == "causal":  # no mask: SDPA's is_causal, top-left aligned (a prefill into a longer static cache)
        visible = (torch.arange(7)[None, :] <= torch.arange(5)[:, None]).expand(2, 1, 5, 7)
    results = []
    for fused in (False, True):
        leaves = [t.clone().requires_grad_() for t in (query, key, value, learned, table)]
        rows = ValueRows(leaves[4], index, starts)
        if mask == "additive":
            sdpa_mask = leaves[3].masked_fill(~visible, torch.finfo(torch.float32).min)
        else:
            sdpa_mask = visible if mask == "boolean" else None
        if fused:
            bias = additive_mask(sdpa_mask, mask == "causal", leaves[0], leaves[1])
            output = attention_with_learned_bias(*leaves[:3], bias, 0.4, rows)
        else:
            scores = torch.matmul(leaves[0], leaves[1].transpose(-1, -2)) * 0.4
            scores = scores + leaves[3] if mask == "additive" else scores
            weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            output = torch.matmul(weights, leaves[2]) + value_rows_term(weights, rows)
        grads = torch.autograd.grad(output.square().sum(), leaves, allow_unused=True, materialize_grads=True)
        results.append((output, *grads))
    for actual, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("family", "spec"), CONTENT_SCHEMES)
def test_sdpa_training_step_equals_eager_values_and_grads(family, spec):
    """A padded batch through the whole model: SDPA (skew, learned-bias backward, chunks) against eager."""
    model = make_model(family, spec)
    ids = random_ids(2, 11)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0  # left padding (the position ids stay 0..10: queries of the padded row see fewer keys)
    results = []
    for backend in ("eager", "sdpa"):
        model.set_attn_implementation(backend)
        model.zero_grad()
        logits = model(ids, attention_mask=attention_mask).logits
        (logits[attention_mask.bool()] ** 2).mean().backward()
        results.append(
            (logits[attention_mask.bool()], [p.grad.clone() for p in model.parameters() if p.grad is not None])
        )
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-4)
    for actual, expected in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


def test_cope_in_chunks_of_queries_equals_one_chunk_values_and_grads():
    """Chunks of 2 queries (checkpointed: recomputed in the backward) against the whole (q, kv) term at once."""
    _, _, attention = scheme_and_term("gpt2", {"type": "cope", "max_positions": 4})
    term = attention.position_term
    with torch.no_grad():
        term.position_embeddings.normal_(generator=torch.Generator().manual_seed(1))
    query, key, _ = qkv(q_len=5, kv_len=7)
    visible = KEY_POSITIONS[:1, None, None, :] <= torch.tensor([2, 3, 5, 6, 9])[None, None, :, None]
    grad_output = torch.randn(2, HEADS, 5, 7)
    results = []
    for chunk in (None, 2):
        term.query_chunk = chunk
        inputs = [t.clone().requires_grad_() for t in (query, key)]
        score = term.score_term(*inputs, {"visible": visible}, 0.5, None)
        parameters = [*inputs, term.position_embeddings]
        results.append((score, *torch.autograd.grad((score * grad_output).sum(), parameters)))
    for actual, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("contiguous", [True, False], ids=["skew", "gather"])
@pytest.mark.parametrize(
    "spec",
    [
        "xlnet",
        "deberta",
        {"type": "deberta", "att_type": "p2c", "share_att_key": False},
        {"type": "relative_key", "max_positions": 16},
    ],
)
def test_score_term_in_chunks_of_queries_equals_one_chunk_values_and_grads(spec, contiguous, monkeypatch):

    _, encoding, attention = scheme_and_term("bert", spec)
    query, key, _ = qkv(q_len=5, kv_len=7)
    query_positions = torch.tensor([[2, 3, 4, 5, 6]] * 2) if contiguous else torch.tensor([[5, 6, 9, 10, 12]] * 2)
    inputs = attention_inputs(
        encoding,
        query_positions,
        KEY_POSITIONS[:1].expand(2, -1) if not contiguous else CONTIGUOUS_KEY_POSITIONS,
        consecutive=contiguous,
    )
    grad_output = torch.randn(2, HEADS, 5, 7)
    parameters = [p for p in attention.position_term.parameters()] + [p for p in attention.parameters()][:2]
    results = []
    for elements in (2**23, 2 * HEADS * 7 * 2):  # one chunk, chunks of 2 queries
        monkeypatch.setattr(relative_tables, "CHUNK_ELEMENTS", elements)
        leaves = [t.clone().requires_grad_() for t in (query, key)]
        score = attention.position_term.score_term(*leaves, inputs, 0.3, attention.project_query_key)
        results.append(
            (score, *torch.autograd.grad((score * grad_output).sum(), leaves + parameters, materialize_grads=True))
        )
    for actual, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(actual, expected)


HEADS, HEAD_DIM = 4, 8


def relative_key_scheme_and_term(family: str, spec):
    model = make_model(family, spec)
    base = model.base_model
    attention = base.encoder.layer[1].attention.self if family == "bert" else base.h[1].attn
    return base.position_encoding, attention.position_term


@pytest.mark.parametrize("variant", ["key_query", "key"])
@pytest.mark.parametrize(
    ("family", "query_positions", "key_positions", "consecutive"),
    [
        ("bert", [[0, 1, 2, 3, 4]] * 2, [[0, 1, 2, 3, 4, 5, 6]] * 2, True),
        ("gpt2", [[4, 5, 6, 7, 8]] * 2, [[0, 1, 2, 3, 4, 5, 6]] * 2, True),
        ("gpt2", [[5, 6, 9, 11, 12], [0, 1, 2, 3, 4]], [[0, 1, 2, 3, 5, 6, 9], [0, 0, 0, 0, 0, 1, 2]], False),
    ],
    ids=["consecutive", "consecutive-offset", "given"],
)
def test_score_term_equals_the_loop_of_4x_formula(family, variant, query_positions, key_positions, consecutive):
    """``scaling * (q_i . r[i - j + M - 1] + k_j . r[i - j + M - 1])`` (key: without the k term), per pair: the
    model's consecutive positions (the window of rows present, read by a skew; also with the queries 4 positions
    after the first key) and given positions with a gap and cached keys (gathered); values and gradients of q, k and
    the whole table (the window's gradient lands in its rows of the parameter, the other rows get 0)."""
    encoding, term = relative_key_scheme_and_term(
        family, {"type": "relative_key", "variant": variant, "max_positions": 13}
    )
    query_positions, key_positions = torch.tensor(query_positions), torch.tensor(key_positions)
    tables = encoding.prepare(query_positions, key_positions, "eager", consecutive)
    assert ("relative_key_window" in tables) is consecutive
    inputs = {"position": tables, "query_positions": query_positions, "key_positions": key_positions}
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, HEADS, 5, HEAD_DIM, generator=generator, requires_grad=True)
    key = torch.randn(2, HEADS, 7, HEAD_DIM, generator=generator, requires_grad=True)
    table = term.distance_embedding.weight
    assert table.shape == (2 * 13 - 1, HEAD_DIM)
    scaling, grad_output = 0.3, torch.randn(2, HEADS, 5, 7, generator=generator)
    score = term.score_term(query, key, inputs, scaling, None)
    expected = torch.zeros(2, HEADS, 5, 7)
    for b in range(2):
        for i in range(5):
            for j in range(7):
                row = table[int(query_positions[b, i] - key_positions[b, j]) + 13 - 1]
                for h in range(HEADS):
                    position_score = query[b, h, i] @ row
                    if variant == "key_query":
                        position_score = position_score + key[b, h, j] @ row
                    expected[b, h, i, j] = scaling * position_score
    torch.testing.assert_close(score, expected)
    grads = torch.autograd.grad((score * grad_output).sum(), (query, key, table), allow_unused=True)
    expected_grads = torch.autograd.grad((expected * grad_output).sum(), (query, key, table), allow_unused=True)
    for actual, wanted in zip(grads, expected_grads, strict=True):
        assert (actual is None) is (wanted is None)  # key: k has no position term
        if wanted is not None:
            torch.testing.assert_close(actual, wanted)
    pairs = zip(query_positions, key_positions, strict=True)
    distances = {int(q - k) for q_row, k_row in pairs for q in q_row for k in k_row}
    untouched = [row for row in range(2 * 13 - 1) if row - 12 not in distances]
    assert untouched and grads[2][untouched].abs().max() == 0  # the rows of absent distances get no gradient


def test_a_distance_past_the_table_raises_naming_the_limit():
    model = make_model("bert", {"type": "relative_key", "max_positions": 6})
    model(random_ids(1, 6))  # distances up to 5 = max_positions - 1
    with pytest.raises(ValueError, match=r"6 positions apart; its distance table reaches 5 \(max_positions=6"):
        model(random_ids(1, 7))


def test_options_defaults_and_refusals():
    spec = hf_posenc.PosEncBertConfig(position_encoding="relative_key", max_position_embeddings=24).position_encoding
    assert spec == {"type": "relative_key", "variant": "key_query", "max_positions": 24}
    entry = hf_posenc.list_position_encodings()["relative_key"]
    assert entry["relative"] and entry["families"] == ["encoder", "decoder"]
    with pytest.raises(ValueError, match=r"option 'variant'='query' is out of range; valid: 'key_query' or 'key'"):
        hf_posenc.PosEncBertConfig(position_encoding={"type": "relative_key", "variant": "query"})
    first, second = (build_layer_position_term(make_model("bert", "relative_key").config, False, i) for i in (0, 1))
    assert first.distance_embedding.weight is not second.distance_embedding.weight


# ---- convert() of a Transformers 4.x checkpoint ----

MAX_POSITIONS, LAYERS, HIDDEN = 16, 2, 32


def write_4x_checkpoint(folder, model_type: str, position_embedding_type: str) -> dict[str, torch.Tensor]:
    """A tiny BertModel / RobertaModel folder as Transformers 4.x saved it with ``position_embedding_type``: its
    config field, per-layer ``encoder.layer.<i>.attention.self.distance_embedding.weight`` and the absolute table
    4.x builds but never adds for a relative type (random here, so using it would show)."""
    config_class, model_class = (
        (transformers.BertConfig, transformers.BertModel)
        if model_type == "bert"
        else (transformers.RobertaConfig, transformers.RobertaModel)
    )
    config = config_class(
        vocab_size=61, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=48,
        max_position_embeddings=MAX_POSITIONS, pad_token_id=1, position_embedding_type=position_embedding_type,
        architectures=[model_class.__name__], initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    state = {name: tensor.contiguous() for name, tensor in model_class(config).state_dict().items()}
    for layer in range(LAYERS):
        table = torch.randn(2 * MAX_POSITIONS - 1, HIDDEN // HEADS) * 0.5
        state[f"encoder.layer.{layer}.attention.self.distance_embedding.weight"] = table
    state["embeddings.position_ids"] = torch.arange(MAX_POSITIONS)[None]  # a persistent buffer of 4.x
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["position_embedding_type"] == position_embedding_type
    return state


def bert_4x_relative_forward(state, ids, attention_mask, key_query: bool, eps: float) -> torch.Tensor:
    """4.x ``BertModel``'s last hidden state for ``relative_key(_query)``, written out: word + token-type embeddings
    (no absolute positions), then per layer 4.x ``BertSelfAttention``'s scores
    ``(q k^T + einsum("bhld,lrd->bhlr", q, r) [+ einsum("bhrd,lrd->bhlr", k, r)]) / sqrt(d)`` with ``r =
    distance_embedding(l - r + max_position_embeddings - 1)`` over local indices, plus the additive padding mask,
    softmax, and BERT's output, intermediate (gelu) and LayerNorm blocks."""

    def linear(x, name):
        return x @ state[f"{name}.weight"].T + state[f"{name}.bias"]

    def layer_norm(x, name):
        return F.layer_norm(x, (HIDDEN,), state[f"{name}.weight"], state[f"{name}.bias"], eps)

    batch, n = ids.shape
    x = state["embeddings.word_embeddings.weight"][ids] + state["embeddings.token_type_embeddings.weight"][0]
    x = layer_norm(x, "embeddings.LayerNorm")
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    additive = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
    for layer in range(LAYERS):
        prefix = f"encoder.layer.{layer}."
        q, k, v = (
            linear(x, f"{prefix}attention.self.{name}").view(batch, n, HEADS, HEAD_DIM).transpose(1, 2)
            for name in ("query", "key", "value")
        )
        scores = q @ k.transpose(-1, -2)
        positional = state[f"{prefix}attention.self.distance_embedding.weight"][distance + MAX_POSITIONS - 1]
        scores = scores + torch.einsum("bhld,lrd->bhlr", q, positional)
        if key_query:
            scores = scores + torch.einsum("bhrd,lrd->bhlr", k, positional)
        probs = (scores / math.sqrt(HEAD_DIM) + additive).softmax(-1)
        context = (probs @ v).transpose(1, 2).reshape(batch, n, HIDDEN)
        x = layer_norm(linear(context, f"{prefix}attention.output.dense") + x, f"{prefix}attention.output.LayerNorm")
        intermediate = F.gelu(linear(x, f"{prefix}intermediate.dense"))
        x = layer_norm(linear(intermediate, f"{prefix}output.dense") + x, f"{prefix}output.LayerNorm")
    return x


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
@pytest.mark.parametrize("position_embedding_type", ["relative_key_query", "relative_key"])
def test_convert_of_a_4x_relative_checkpoint_gives_4x_outputs(tmp_path, model_type, position_embedding_type):
    state = write_4x_checkpoint(tmp_path, model_type, position_embedding_type)
    converted = hf_posenc.convert(tmp_path).eval()
    assert type(converted) is hf_posenc.PosEncBertModel
    variant = "key_query" if position_embedding_type == "relative_key_query" else "key"
    assert converted.config.position_encoding == {
        "type": "relative_key",
        "variant": variant,
        "max_positions": MAX_POSITIONS,
    }
    assert not hasattr(converted.config, "position_embedding_type")
    ids = random_ids(2, MAX_POSITIONS)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 11:] = 0  # right padding
    ids[1, 11:] = 1
    expected = bert_4x_relative_forward(state, ids, attention_mask, variant == "key_query", eps=1e-12)
    with torch.no_grad():
        actual = converted(ids, attention_mask=attention_mask).last_hidden_state
    visible = attention_mask.bool()
    torch.testing.assert_close(actual[visible], expected[visible], atol=1e-5, rtol=0)


def test_convert_refuses_what_it_cannot_honour(tmp_path):
    relative = tmp_path / "relative"
    relative.mkdir()
    write_4x_checkpoint(relative, "bert", "relative_key_query")
    loaded = transformers.BertModel.from_pretrained(relative)  # v5 drops the distance tables
    with pytest.raises(ValueError, match=r"relative_key_query'.* pass convert\(\) the checkpoint folder"):
        hf_posenc.convert(loaded)
    with pytest.raises(ValueError, match=r"retrofit\(\): .*'relative_key_query' .* Use hf_posenc.convert"):
        hf_posenc.retrofit(loaded)
    with pytest.raises(ValueError, match=r"trained with position_encoding .*'relative_key'.* Leave position_encoding"):
        hf_posenc.convert(relative, position_encoding="learned")
    with pytest.raises(ValueError, match=r"'variant': 'key'.* would not compute what it computes"):
        hf_posenc.convert(relative, position_encoding={"type": "relative_key", "variant": "key"})
    other = tmp_path / "other"
    other.mkdir()
    write_4x_checkpoint(other, "bert", "rotary")
    with pytest.raises(ValueError, match=r"position_embedding_type='rotary' .* reads 'absolute' and \['relative_key'"):
        hf_posenc.convert(other)


def test_convert_of_a_4x_relative_checkpoint_to_another_scheme_drops_the_distance_tables(tmp_path):
    write_4x_checkpoint(tmp_path, "bert", "relative_key")
    converted = hf_posenc.convert(tmp_path, position_encoding="rope")
    assert converted.config.position_encoding["type"] == "rope"
    assert not any("distance_embedding" in name for name in converted.state_dict())
