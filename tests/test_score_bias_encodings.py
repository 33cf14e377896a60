"""Position-only score biases (``score_bias_encodings.py``): T5's buckets and ALiBi's slopes against published values
and Transformers' T5 and BLOOM, KERPLE, FIRE and the t5 table scale against the papers' formulas by hand; which
backend runs each scheme, and the fast paths (dense bias on SDPA, score_mod on flex) against the eager reference; the
per-distance paths against the per-pair formula (values and gradients): the Toeplitz-expanded dense bias (eager,
SDPA), the FlexAttention ``score_mod`` reading the padded per-distance table, FIRE's MLP evaluated densely, and what
a model builds (one bias shared by the batch)."""

from __future__ import annotations

import json
import math

import pytest
import safetensors.torch
import torch
import transformers
from conftest import make_config, make_model, perturb_position_parameters, random_ids
from torch.nn.attention.flex_attention import flex_attention
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.t5.modeling_t5 import T5Attention

import hf_posenc.modeling_posenc_common as common
from hf_posenc.attention_backends import choose_backend
from hf_posenc.configuration_posenc import resolve_attention_normalizer
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import AttentionDims
from hf_posenc.score_bias_encodings import (
    alibi_slopes,
    relu_mlp_of_scalars,
    relu_mlp_pieces,
    t5_bias_from_steps,
    t5_relative_bucket,
    t5_steps_from_bias,
)


# kexue.fm/archives/8130, "T5式": f(i - j) for i - j = 0..30 (32 bidirectional buckets, max_distance 128), as the
# Chinese original prints it: 16..22 -> 10, 23..30 -> 11. (The English rendering in seeds/ shifts the 10/11 boundary
# by one; the original agrees with T5's formula, 8 + floor(2 log2(n / 8)), and with transformers' T5.)
SU_T5_TABLE = [0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 8, 8, 9, 9, 9, 9] + [10] * 7 + [11] * 8


def test_t5_buckets_match_the_table_in_kexue_8130():
    distance = torch.arange(31)
    buckets = t5_relative_bucket(distance, bidirectional=True, num_buckets=32, max_distance=128)
    assert buckets.tolist() == SU_T5_TABLE


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 64), (64, 256)])
def test_t5_buckets_match_transformers_t5(bidirectional, num_buckets, max_distance):
    distance = torch.arange(-300, 301)  # i - j
    options = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    ours = t5_relative_bucket(distance, **options)
    # T5 takes memory_position - query_position = j - i.
    theirs = T5Attention._relative_position_bucket(-distance, **options)
    assert torch.equal(ours, theirs)


def test_t5_causal_buckets_by_hand():
    distance = torch.tensor([-5, 0, 15, 16, 20, 32, 127, 500])
    buckets = t5_relative_bucket(distance, bidirectional=False, num_buckets=32, max_distance=128)
    # future keys -> 0; 0..15 exact; then 16 + floor(16 * log(n/16) / log(8)), capped at 31.
    expected = [0, 0, 15, 16, 16 + math.floor(16 * math.log(20 / 16) / math.log(8)), 21, 31, 31]
    assert buckets.tolist() == expected


def test_alibi_slopes_for_a_power_of_two_are_2_pow_minus_8h_over_H():
    assert alibi_slopes(8).tolist() == [2.0 ** (-h) for h in range(1, 9)]
    assert alibi_slopes(4).tolist() == [2.0 ** (-2 * h) for h in range(1, 5)]


def test_alibi_slopes_for_six_heads_by_hand():
    # Press et al.: the 4-head slopes, then every other slope of the 8-head sequence.
    assert alibi_slopes(6).tolist() == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]


@pytest.mark.parametrize("num_heads", [1, 3, 4, 6, 12, 16])
def test_alibi_slopes_match_transformers_bloom(num_heads):
    mask = torch.ones(1, 2)
    bloom = build_alibi_tensor(mask, num_heads, torch.float32)  # slope_h * position, position 1 in column 1
    torch.testing.assert_close(alibi_slopes(num_heads).float(), bloom[:, 0, 1])


def reference_biased_attention_logits(model, ids, bias_fn):
    """Layer-0 attention weights by the formula: softmax_j(q_i.k_j / sqrt(d) + bias(h, i, j)), built from the
    model's own projections but none of its attention code."""
    layer = model.bert.encoder.layer[0].attention.self
    with torch.no_grad():
        hidden = model.bert.embeddings(model.bert.position_encoding, torch.arange(ids.shape[1])[None], ids)
        heads, head_dim = layer.num_heads, layer.head_dim
        q = layer.query(hidden).view(1, -1, heads, head_dim).transpose(1, 2)[0]
        k = layer.key(hidden).view(1, -1, heads, head_dim).transpose(1, 2)[0]
    n = ids.shape[1]
    weights = torch.zeros(heads, n, n)
    for h in range(heads):
        for i in range(n):
            row = torch.tensor([float(q[h, i] @ k[h, j]) / math.sqrt(head_dim) + bias_fn(h, i, j) for j in range(n)])
            weights[h, i] = torch.softmax(row, dim=0)
    return weights


def test_t5_attention_weights_match_a_hand_written_reference():
    model = make_model("bert", "t5")
    ids = random_ids(1, 6)
    encoding = model.bert.position_encoding
    steps = encoding.relative_attention_steps.weight.detach() * math.sqrt(encoding.dims.head_dim)  # table_scale

    def bias(h, i, j):
        # The stored table holds steps outward from distance 0: sum them up to the bucket, in its direction.
        if i >= j:
            return sum(float(steps[b, h]) for b in range(SU_T5_TABLE[i - j] + 1))
        return float(steps[0, h]) + sum(float(steps[b, h]) for b in range(16, 16 + SU_T5_TABLE[j - i] + 1))

    expected = reference_biased_attention_logits(model, ids, bias)
    with torch.no_grad():
        actual = model(ids, output_attentions=True).attentions[0][0]
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


def test_alibi_attention_weights_match_a_hand_written_reference():
    model = make_model("bert", "alibi")
    ids = random_ids(1, 6)
    slopes = [2.0 ** (-2 * h) for h in range(1, 5)]  # 4 heads

    expected = reference_biased_attention_logits(model, ids, lambda h, i, j: -slopes[h] * abs(i - j))
    with torch.no_grad():
        actual = model(ids, output_attentions=True).attentions[0][0]
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


def test_t5_decoder_bias_ignores_future_buckets():
    """In the decoder the table has no 'key to the right' half: all 32 buckets are for i - j >= 0."""
    model = make_model("gpt2", "t5")
    assert model.transformer.position_encoding.dims.causal
    distance = torch.tensor([0, 16, 100])
    buckets = t5_relative_bucket(distance, bidirectional=False, num_buckets=32, max_distance=128)
    assert buckets.tolist() == [0, 16, 16 + math.floor(16 * math.log(100 / 16) / math.log(8))]


CPU = torch.device("cpu")
SOFTMAX = resolve_attention_normalizer("softmax")


def scheme(name, causal, heads=2, head_dim=4, **options):
    entry = POSITION_ENCODINGS[name]
    spec = {"type": name, **{k: o.default for k, o in entry.options.items()}, **options}
    dims = AttentionDims(
        hidden_size=heads * head_dim, num_heads=heads, head_dim=head_dim, max_positions=16, causal=causal
    )
    return entry(spec, dims)


def dense_bias(encoding, positions):
    positions = torch.tensor(positions)[None]
    return encoding.prepare(positions, positions, "sdpa")["score_bias"][0]


@pytest.mark.parametrize("causal", [False, True])
def test_kerple_log_by_hand(causal):
    encoding = scheme("kerple", causal, variant="log")
    with torch.no_grad():
        encoding.r1.copy_(torch.tensor([0.5, 1.5]))
        encoding.r2.copy_(torch.tensor([0.25, 2.0]))
    positions = [0, 1, 2, 5, 9]
    bias = dense_bias(encoding, positions)
    for h, (r1, r2) in enumerate([(0.5, 0.25), (1.5, 2.0)]):
        for a, i in enumerate(positions):
            for b, j in enumerate(positions):
                assert bias[h, a, b].item() == pytest.approx(-r1 * math.log(1 + r2 * abs(i - j)), rel=1e-6)


def test_kerple_power_by_hand_and_clamps_like_the_paper():
    encoding = scheme("kerple", True, variant="power")
    with torch.no_grad():
        encoding.r1.copy_(torch.tensor([0.5, -3.0]))  # -3 is used as 0.01
        encoding.r2.copy_(torch.tensor([1.5, 7.0]))  # 7 is used as 2 (power kernels need r2 <= 2)
    positions = [0, 3, 4, 10]
    bias = dense_bias(encoding, positions)
    for h, (r1, r2) in enumerate([(0.5, 1.5), (0.01, 2.0)]):
        for a, i in enumerate(positions):
            for b, j in enumerate(positions):
                assert bias[h, a, b].item() == pytest.approx(-r1 * abs(i - j) ** r2, rel=1e-5, abs=1e-7)
    # The clamp passes the gradient through (the paper projects the parameter and differentiates the projection).
    bias.sum().backward()
    assert encoding.r1.grad[1] != 0 and encoding.r2.grad[1] != 0


def test_kerple_initialisation_follows_the_paper_code():
    torch.manual_seed(0)
    log, power = scheme("kerple", True, heads=64, variant="log"), scheme("kerple", True, heads=64, variant="power")
    assert 0 <= log.r1.min() and log.r1.max() <= 2 and log.r1.max() > 1  # r1 ~ U(0, 2), r2 ~ U(0, 1)
    assert 0 <= log.r2.min() and log.r2.max() <= 1
    assert 0 <= power.r1.min() and power.r1.max() <= 1  # power: r1 ~ U(0, 1), r2 ~ U(0, 2)
    assert 0 <= power.r2.min() and power.r2.max() <= 2 and power.r2.max() > 1


def fire_by_hand(encoding, i, j):
    """Li et al. 2024: f(psi(|i - j|) / psi(max(L, i, j))), psi(x) = log(|c| x + 1), f a ReLU MLP, in loops."""
    c = abs(encoding.c.item())
    threshold = abs(encoding.threshold_scale.item() * encoding.spec["threshold"])

    def psi(x):
        return math.log(c * x + 1)

    x = psi(abs(i - j)) / (psi(max(threshold, i, j)) + 1e-6)
    mlp_in, mlp_out = encoding.mlp_in.tolist(), encoding.mlp_out.tolist()
    hidden = [max(0.0, w * x + b) for w, b in mlp_in]
    return [sum(w * u for w, u in zip(row[:-1], hidden, strict=True)) + row[-1] for row in mlp_out]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("threshold", [3.0, 512.0])
def test_fire_by_hand(causal, threshold):
    torch.manual_seed(0)
    encoding = scheme("fire", causal, threshold=threshold, mlp_width=8)
    with torch.no_grad():
        encoding.c.fill_(-0.7)  # psi uses |c|
        encoding.threshold_scale.fill_(1.5)
    positions = [0, 1, 2, 4, 7, 12]
    bias = dense_bias(encoding, positions)
    for a, i in enumerate(positions):
        for b, j in enumerate(positions):
            torch.testing.assert_close(bias[:, a, b], torch.tensor(fire_by_hand(encoding, i, j)), atol=1e-5, rtol=1e-5)


def test_fire_mlp_as_pieces_equals_the_mlp_everywhere():
    """The per-forward table: slope and intercept per piece reproduce W relu(w x + b) + b_out, flat units included,
    and their gradients are the MLP's."""
    torch.manual_seed(1)
    weight_in, bias_in = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    weight_out, bias_out = torch.randn(3, 16, requires_grad=True), torch.randn(3, requires_grad=True)
    with torch.no_grad():
        weight_in[[2, 5]] = 0.0
    breakpoints, slope, intercept = relu_mlp_pieces(weight_in, bias_in, weight_out, bias_out)

    def both(x):
        piece = torch.bucketize(x, breakpoints)
        return slope[piece] * x[:, None] + intercept[piece], torch.relu(
            x[:, None] * weight_in + bias_in
        ) @ weight_out.T + bias_out

    at_breakpoints = breakpoints[breakpoints.isfinite()]
    torch.testing.assert_close(*both(at_breakpoints), atol=1e-5, rtol=1e-5)
    pieces, reference = both(torch.linspace(-4, 4, 997))  # gradients away from the kinks, where both are defined
    torch.testing.assert_close(pieces, reference, atol=1e-5, rtol=1e-5)
    params = (weight_in, bias_in, weight_out, bias_out)
    expected = torch.autograd.grad(reference.square().sum(), params, retain_graph=True)
    for got, want in zip(torch.autograd.grad(pieces.square().sum(), params), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def test_fire_evaluates_its_mlp_once_per_forward_not_per_layer(monkeypatch):
    import hf_posenc.score_bias_encodings as module

    calls = []
    original = module.relu_mlp_pieces
    monkeypatch.setattr(module, "relu_mlp_pieces", lambda *args: calls.append(1) or original(*args))
    model = make_model("gpt2", "fire", n_layer=3)
    with torch.no_grad():
        model(random_ids(2, 7))
    assert len(calls) == 1


def test_fire_is_shift_invariant_only_below_its_threshold():
    ids, positions = random_ids(2, 9), torch.arange(9)[None]
    for threshold, invariant in ((512.0, True), (4.0, False)):
        model = make_model("gpt2", {"type": "fire", "threshold": threshold})
        with torch.no_grad():
            model.transformer.position_encoding.threshold_scale.fill_(1.0)
            model.transformer.position_encoding.c.fill_(0.5)
            moved = model(ids, position_ids=positions + 13).logits - model(ids, position_ids=positions).logits
        assert (moved.abs().max() < 1e-4) == invariant


def test_t5_table_scale_multiplies_the_stored_table():
    default = scheme("t5", False, head_dim=16)
    assert default.table_scale == 4.0  # sqrt(head_dim)
    unscaled = scheme("t5", False, head_dim=16, table_scale=1.0)
    with torch.no_grad():
        unscaled.relative_attention_steps.weight.copy_(default.relative_attention_steps.weight * 4.0)
    positions = list(range(12))
    torch.testing.assert_close(dense_bias(default, positions), dense_bias(unscaled, positions))


def t5_bias_by_hand(steps, causal):
    """beta[k] = the sum of the steps from bucket 0 out to bucket k, in k's direction (the upper half of a
    bidirectional table starts from bucket 0)."""
    buckets, heads = steps.shape
    half = buckets if causal else buckets // 2
    bias = torch.zeros(buckets, heads)
    for h in range(heads):
        for k in range(buckets):
            chain = range(k + 1) if k < half else [0, *range(half, k + 1)]
            bias[k, h] = sum(float(steps[m, h]) for m in chain)
    return bias


@pytest.mark.parametrize("causal", [False, True])
def test_t5_bias_is_the_sum_of_the_steps_out_to_its_bucket(causal):
    steps = torch.randn(8, 3, dtype=torch.float64)
    torch.testing.assert_close(
        t5_bias_from_steps(steps, bidirectional=not causal), t5_bias_by_hand(steps, causal).double()
    )
    torch.testing.assert_close(
        t5_steps_from_bias(t5_bias_from_steps(steps, bidirectional=not causal), bidirectional=not causal), steps
    )


@pytest.mark.parametrize("causal", [False, True])
def test_t5_bias_table_is_table_scale_times_the_summed_steps(causal):
    encoding = scheme("t5", causal, head_dim=16)  # table_scale 4
    with torch.no_grad():
        encoding.relative_attention_steps.weight.normal_()
    expected = 4.0 * t5_bias_by_hand(encoding.relative_attention_steps.weight, causal)
    torch.testing.assert_close(encoding.bias_table(CPU), expected)


def test_t5_checkpoint_values_convert_to_steps():
    """A T5 table of bias values, stored as ``t5_steps_from_bias(values) / table_scale`` (``store_bias``), gives back
    those values."""
    values = torch.randn(32, 2)
    for causal in (False, True):
        encoding = scheme("t5", causal, head_dim=16)
        encoding.store_bias(values)
        torch.testing.assert_close(
            encoding.relative_attention_steps.weight * 4.0, t5_bias_by_hand_inverse(values, causal)
        )
        torch.testing.assert_close(encoding.bias_table(CPU), values)


def t5_bias_by_hand_inverse(values, causal):
    """Each bucket's value minus the value of the bucket one step nearer (bucket 0 for the first upper one)."""
    half = values.shape[0] if causal else values.shape[0] // 2
    steps = values.clone()
    for k in range(1, values.shape[0]):
        steps[k] = values[k] - values[0 if k == half else k - 1]
    return steps


def old_t5_folder(model, folder):
    """``model`` saved as hf_posenc saved ``t5`` before the steps: its bias values / table_scale under
    ``relative_attention_bias`` (old bias = table_scale * stored value, per bucket), and no ``init`` option in its
    config. Returns the stored values."""
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    del config["position_encoding"]["init"]
    (folder / "config.json").write_text(json.dumps(config))
    weights = safetensors.torch.load_file(folder / "model.safetensors")
    (key,) = [k for k in weights if k.endswith("relative_attention_steps.weight")]
    values = torch.randn_like(weights.pop(key))
    weights[key.replace("relative_attention_steps", "relative_attention_bias")] = values
    safetensors.torch.save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return values


@pytest.mark.parametrize("model_type", ["bert", "gpt2"])
def test_t5_old_checkpoint_loads_exactly_with_load_state_dict(tmp_path, model_type):
    model = make_model(model_type, "t5")
    values = old_t5_folder(model, tmp_path)
    fresh = make_model(model_type, "t5", seed=1)
    loaded = fresh.load_state_dict(safetensors.torch.load_file(tmp_path / "model.safetensors"), strict=False)
    assert loaded.unexpected_keys == [] and all("position_encoding" not in key for key in loaded.missing_keys)
    encoding = fresh.base_model.position_encoding
    torch.testing.assert_close(encoding.bias_table(CPU), encoding.table_scale * values)


@pytest.mark.parametrize("model_type", ["bert", "gpt2"])
def test_t5_old_checkpoint_is_refused_by_from_pretrained(tmp_path, model_type):
    old_t5_folder(make_model(model_type, "t5"), tmp_path)
    head = transformers.AutoModelForMaskedLM if model_type == "bert" else transformers.AutoModelForCausalLM
    for auto in (head, transformers.AutoModel):  # the base model: the checkpoint's keys carry the head's prefix
        with pytest.raises(ValueError, match="relative_attention_bias.*load_state_dict"):
            auto.from_pretrained(tmp_path)


def test_t5_reference_init_draws_t5s_bias_values():
    """``init="reference"``: the bias values are N(0, hidden_size^-1/2), as Transformers' T5 draws its
    ``relative_attention_bias`` (``T5PreTrainedModel._init_weights``, ``initializer_factor`` 1): the same std in every
    bucket (drawn as values, not a random walk of steps) whatever ``table_scale``. 60 draws of a 32 x 4 table."""
    t5 = transformers.T5EncoderModel(
        transformers.T5Config(vocab_size=8, d_model=64, d_kv=16, num_heads=4, num_layers=1, d_ff=8)
    )
    transformers_std = t5.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.std().item()
    assert transformers_std == pytest.approx(64**-0.5, rel=0.2)  # one 32 x 4 draw
    for causal in (False, True):
        tables = []
        for seed in range(60):
            encoding = scheme("t5", causal, heads=4, head_dim=16)  # hidden_size 64, table_scale 4
            torch.manual_seed(seed)
            encoding.init_weights(0.02)
            tables.append(encoding.bias_table(CPU).detach())
        values = torch.stack(tables)  # (seeds, buckets, heads)
        assert values.mean().abs() < 0.01
        assert values.std().item() == pytest.approx(64**-0.5, rel=0.05)
        per_bucket = values.transpose(0, 1).flatten(1).std(dim=1)  # 240 draws per bucket
        assert ((per_bucket / 64**-0.5 - 1).abs() < 0.25).all(), per_bucket
        unscaled = scheme("t5", causal, heads=4, head_dim=16, table_scale=1.0)
        torch.manual_seed(seed)
        unscaled.init_weights(0.02)
        torch.testing.assert_close(unscaled.bias_table(CPU), tables[-1])  # the same values, stored 4x larger
        steps = encoding.relative_attention_steps.weight
        torch.testing.assert_close(unscaled.relative_attention_steps.weight, 4 * steps)


@pytest.mark.parametrize("model_type", ["bert", "gpt2"])
def test_t5_decay_init_starts_each_logarithmic_bucket_one_nat_below_the_one_before(model_type):
    """``init="decay"``: the reference draw plus 0 nats over the exact distances and -1, -2, ... at the logarithmic
    buckets. Per bucket, and per distance from the dense bias against the bucket table of kexue.fm/archives/8130
    (32 buckets, max_distance 128, bidirectional: distances 0..30 -> buckets 0..7, 8 x4, 9 x4, 10 x7, 11 x8)."""
    width = {"hidden_size": 64} if model_type == "bert" else {"n_embd": 64}
    auto = transformers.AutoModelForMaskedLM if model_type == "bert" else transformers.AutoModelForCausalLM
    tables, biases = {}, {}
    for init in ("reference", "decay"):
        torch.manual_seed(0)
        encoding = auto.from_config(make_config(model_type, {"type": "t5", "init": init}, **width)).base_model
        tables[init] = encoding.position_encoding.bias_table(CPU).detach()
        biases[init] = dense_bias(encoding.position_encoding, list(range(31))).detach()
    fall = tables["decay"] - tables["reference"]  # the same draw underneath
    if model_type == "bert":  # per direction: 8 exact buckets at 0, then 8 logarithmic ones
        by_bucket = [0, 0, 0, 0, 0, 0, 0, 0, -1, -2, -3, -4, -5, -6, -7, -8] * 2
    else:  # 16 exact buckets, then 16 logarithmic ones
        by_bucket = [0] * 16 + [-1, -2, -3, -4, -5, -6, -7, -8, -9, -10, -11, -12, -13, -14, -15, -16]
    torch.testing.assert_close(fall, torch.tensor(by_bucket, dtype=torch.float32)[:, None].expand(32, 4))
    if model_type == "bert":
        by_distance = torch.tensor([0.0] * 8 + [-1.0] * 4 + [-2.0] * 4 + [-3.0] * 7 + [-4.0] * 8)
        decay = biases["decay"] - biases["reference"]  # (heads, query, key)
        torch.testing.assert_close(decay[:, 30, :].flip(-1), by_distance.expand(4, 31))  # keys to the left
        torch.testing.assert_close(decay[:, 0, :], by_distance.expand(4, 31))  # keys to the right: the same fall


def test_t5_default_init_leaves_far_keys_alive_under_relu2():
    """At init ``q.k`` is near 0, so the bias's sign decides which keys ``relu2`` keeps. T5's zero-mean draw leaves
    about half the far (head, key) pairs positive; the decay option makes every key past the exact distances
    negative: no weight and no gradient through it."""
    ids = random_ids(2, 32)
    alive = {}
    for init in ("reference", "decay"):
        torch.manual_seed(0)
        config = make_config("bert", {"type": "t5", "init": init}, "relu2", hidden_size=64, initializer_range=0.02)
        model = transformers.AutoModel.from_config(config, attn_implementation="eager").eval()
        with torch.no_grad():
            weights = model(ids, output_attentions=True).attentions[0]  # (batch, heads, query, key)
        distance = (torch.arange(32)[:, None] - torch.arange(32)[None, :]).abs()
        alive[init] = (weights[..., distance >= 8] > 0).float().mean().item()
    assert 0.25 < alive["reference"] < 0.75 and alive["decay"] == 0.0, alive


def test_t5_never_reached_buckets_keep_their_initial_steps():
    """Train a decoder on 12-token blocks: the loss reaches distances 0..10 (buckets 0..10 of 32). Every bucket
    training never reaches keeps its initial step, so its bias is the farthest trained bucket's plus its initial
    difference from it: stored as values, such a bucket would keep its initial value however far the trained ones
    moved."""
    torch.manual_seed(0)
    config = make_config("gpt2", "t5", n_layer=1, n_head=2, initializer_range=0.02)
    model = transformers.AutoModelForCausalLM.from_config(config)
    encoding = model.transformer.position_encoding
    initial = encoding.bias_table(CPU).detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.0)
    for _ in range(60):
        ids = torch.randint(3, 60, (16, 12))
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    bias = encoding.bias_table(CPU).detach()
    assert (bias[10] - initial[10]).abs().min() > 0.05  # the farthest trained bucket moved, in every head
    torch.testing.assert_close(bias[11:] - bias[10], initial[11:] - initial[10])


POSITION_ONLY = ["t5", "alibi", "kerple", "fire"]


@pytest.mark.parametrize("name", POSITION_ONLY + ["xpos", "rope"])
def test_backend_each_scheme_runs_on(name):
    spec = {"type": name, **{k: o.default for k, o in POSITION_ENCODINGS[name].options.items()}}
    for requested in ("eager", "sdpa"):
        assert choose_backend(requested, spec, SOFTMAX, CPU) == requested
    with torch.no_grad():
        assert choose_backend("flex_attention", spec, SOFTMAX, CPU) == "flex_attention"
    assert choose_backend("flex_attention", spec, SOFTMAX, CPU) == "sdpa"  # CPU flex has no backward
    assert choose_backend("sdpa", spec, SOFTMAX, CPU, need_weights=True) == "eager"


@pytest.mark.parametrize("name", ["kerple", "fire"])
def test_fast_paths_equal_eager_and_are_what_runs(name, monkeypatch):
    """SDPA gets the dense bias folded into its mask, flex a score_mod (no dense bias); both equal eager."""
    import hf_posenc.posenc_attention as attention

    ids = random_ids(2, 11)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 8:] = 0
    seen, sdpa = [], attention._sdpa

    def recording_sdpa(*args, **kwargs):
        seen.append(args[3]["mask"].dtype)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention, "_sdpa", recording_sdpa)
    hidden = {}
    for attn in ("eager", "sdpa", "flex_attention"):
        model = make_model("gpt2", {"type": name}, attn=attn)
        with torch.no_grad():
            hidden[attn] = model.transformer(ids, attention_mask=attention_mask).last_hidden_state
    assert seen and all(dtype == torch.float32 for dtype in seen)  # a float mask: the bias rides along
    visible = attention_mask.bool()
    for attn in ("sdpa", "flex_attention"):
        torch.testing.assert_close(hidden[attn][visible], hidden["eager"][visible], atol=1e-5, rtol=1e-4)
    encoding = make_model("gpt2", {"type": name}).transformer.position_encoding
    positions = torch.arange(5)[None]
    tables = encoding.prepare(positions, positions, "flex_attention")
    assert "score_bias" not in tables and encoding.score_mod(tables, positions, positions) is not None


SHIFT_INVARIANT = ["t5", "alibi", "kerple"]
HEADS = 3


def perturbed_scheme(name, causal, **options):
    entry = POSITION_ENCODINGS[name]
    spec = {"type": name, **{k: o.default for k, o in entry.options.items()}, **options}
    dims = AttentionDims(hidden_size=HEADS * 4, num_heads=HEADS, head_dim=4, max_positions=64, causal=causal)
    encoding = entry(spec, dims).double()
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in encoding.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter)).abs_()  # kerple's r1, r2 stay inside the clamp
    return encoding


def by_pair(encoding, query_row, key_row, head):
    """The scheme's formula for each (query, key) pair, one pair at a time: the reference of the table paths."""
    table = encoding.bias_table(torch.device("cpu"))
    return torch.stack(
        [
            torch.stack(
                [
                    torch.stack(
                        [
                            encoding.position_bias(torch.tensor(i), torch.tensor(j), torch.tensor(h), table)
                            for j in key_row.tolist()
                        ]
                    )
                    for i in query_row.tolist()
                ]
            )
            for h in range(head)
        ]
    )


# (query positions, key positions): no cache, a query block after cached keys, positions shifted (left padding).
LAYOUTS = {
    "plain": (torch.arange(6), torch.arange(6)),
    "cache": (torch.arange(5, 8), torch.arange(8)),
    "shifted": (torch.arange(4, 11), torch.arange(4, 11)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", SHIFT_INVARIANT)
def test_per_distance_bias_equals_the_formula_per_pair_in_values_and_gradients(name, causal, layout):
    encoding = perturbed_scheme(name, causal)
    query_positions, key_positions = (p[None] for p in LAYOUTS[layout])
    bias = encoding.prepare(query_positions, key_positions, "sdpa", consecutive=True)["score_bias"]
    expected = by_pair(encoding, query_positions[0], key_positions[0], HEADS)[None]
    assert bias.shape == expected.shape
    torch.testing.assert_close(bias, expected)
    upstream = torch.randn(expected.shape, dtype=expected.dtype)
    parameters = [p for p in encoding.parameters()]
    if parameters:
        grads = torch.autograd.grad((bias * upstream).sum(), parameters)
        expected_grads = torch.autograd.grad((expected * upstream).sum(), parameters)
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", SHIFT_INVARIANT + ["fire"])
def test_general_positions_equal_the_formula_per_pair(name):
    """Positions that are not consecutive, different per row: the per-pair path, ``(batch, heads, q, k)``."""
    encoding = perturbed_scheme(name, causal=False, **({"threshold": 6.0} if name == "fire" else {}))
    positions = torch.tensor([[0, 2, 3, 9, 10], [4, 1, 0, 7, 12]])
    bias = encoding.prepare(positions, positions, "sdpa")["score_bias"]
    assert bias.shape == (2, HEADS, 5, 5)
    for row in range(2):
        torch.testing.assert_close(bias[row], by_pair(encoding, positions[row], positions[row], HEADS))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("threshold", [4.0, 512.0])
def test_fire_dense_mlp_equals_its_pieces_per_pair_in_values_and_gradients(causal, threshold):
    """FIRE's dense bias (the MLP, dense backward) = its piecewise lookup per pair, below and past the threshold."""
    encoding = perturbed_scheme("fire", causal, threshold=threshold, mlp_width=8)
    query_positions, key_positions = torch.arange(3, 9)[None], torch.arange(9)[None]
    bias = encoding.mlp_bias(query_positions, key_positions, encoding.bias_table(torch.device("cpu")))  # off CPU
    heads = torch.arange(HEADS)[None, :, None, None]
    table = encoding.bias_table(torch.device("cpu"))
    expected = encoding.position_bias(query_positions[:, None, :, None], key_positions[:, None, None, :], heads, table)
    torch.testing.assert_close(bias, expected)
    upstream = torch.randn(expected.shape, dtype=expected.dtype)
    parameters = list(encoding.parameters())
    grads = torch.autograd.grad((bias * upstream).sum(), parameters)
    for got, want in zip(grads, torch.autograd.grad((expected * upstream).sum(), parameters), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("threshold", "first_query"), [(4.0, 3), (512.0, 3), (4.0, 0)])
def test_fire_spread_tables_on_flex_equal_its_dense_mlp_in_values_and_gradients(causal, threshold, first_query):
    """FIRE's flex path on consecutive positions (off CPU: tables per distance, per position and per query, read in
    the score_mod; the pieces counted against the breakpoints) evaluated on every pair as flex's unfused path does
    (vmap), against the MLP evaluated on each pair's normalised distance (``mlp_bias``, dense): values and the
    gradients of c, L and the MLP, below and past the threshold, queries at 3..8 or 0..5 after keys at 0..8."""
    from hf_posenc import score_bias_encodings
    from hf_posenc.posenc_attention import _on_pairs

    encoding = perturbed_scheme("fire", causal, threshold=threshold, mlp_width=8)
    query_positions, key_positions = torch.arange(first_query, first_query + 6)[None], torch.arange(9)[None]
    on_cpu = encoding.prepare(query_positions, key_positions, "flex_attention", consecutive=True)
    assert set(on_cpu) == {"bias_table"}  # CPU flex cannot compile length-sized tables: the per-pair formula
    assert encoding.flex_spreads_gradients(True) and not encoding.flex_spreads_gradients(False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(score_bias_encodings, "flex_compiles_length_sized_tables", lambda device: True)
        tables = encoding.prepare(query_positions, key_positions, "flex_attention", consecutive=True)
    assert {name: tuple(table.shape) for name, table in tables.items()} == {
        "fire_distance": (14,),
        "fire_query_scale": (1, 6),
        "fire_key_scale": (1, 9),
        "fire_breakpoints": (8,),
        "fire_slope": (HEADS, 6, 9),
        "fire_intercept": (HEADS, 6, 9),
    }
    assert not tables["fire_breakpoints"].requires_grad
    score_mod = encoding.score_mod(tables, query_positions, key_positions)
    q_idx, kv_idx = (index.flatten() for index in torch.meshgrid(torch.arange(6), torch.arange(9), indexing="ij"))
    zeros = torch.zeros(2, HEADS, 6 * 9, dtype=torch.float64)
    bias = _on_pairs(score_mod, 2, HEADS, q_idx, kv_idx, zeros).view(2, HEADS, 6, 9)
    expected = encoding.mlp_bias(query_positions, key_positions, encoding.bias_table(torch.device("cpu")))
    torch.testing.assert_close(bias, expected.expand_as(bias))
    upstream = torch.randn(bias.shape, dtype=bias.dtype)
    parameters = list(encoding.parameters())
    grads = torch.autograd.grad((bias * upstream).sum(), parameters)
    for got, want in zip(grads, torch.autograd.grad((expected * upstream).sum(), parameters), strict=True):
        torch.testing.assert_close(got, want)


def test_relu_mlp_of_scalars_in_chunks_equals_the_mlp_in_values_and_gradients():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 5, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in ((6,), (6,), (3, 6), (3,))]
    weight_in, bias_in, weight_out, bias_out = weights
    reference = torch.einsum("hu,...u->h...", weight_out, torch.relu(x[..., None] * weight_in + bias_in))
    reference = reference + bias_out[:, None, None, None]
    chunked = relu_mlp_of_scalars(x, *weights, chunk=8)  # 70 elements: 9 chunks, the last one short
    torch.testing.assert_close(chunked, reference)
    upstream = torch.randn(reference.shape, dtype=torch.float64)
    inputs = [x, *weights]
    for got, want in zip(
        torch.autograd.grad((chunked * upstream).sum(), inputs),
        torch.autograd.grad((reference * upstream).sum(), inputs),
        strict=True,
    ):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("layout", ["plain", "cache"])
@pytest.mark.parametrize("name", SHIFT_INVARIANT)
def test_flex_score_mod_reading_the_padded_table_equals_eager(name, layout):
    """Uncompiled FlexAttention on CPU with the score_mod reading the per-distance table as ``prepare(...,
    consecutive=True)`` builds it off CPU (padded to a multiple of 8 columns): the scores equal eager softmax with the
    per-pair bias. On CPU ``prepare`` gives flex the fixed-size table (inductor's CPU template cannot recompile a
    length-sized one)."""
    encoding = perturbed_scheme(name, causal=False)
    query_positions, key_positions = (p[None] for p in LAYOUTS[layout])
    on_cpu = encoding.prepare(query_positions, key_positions, "flex_attention", consecutive=True)
    assert set(on_cpu) == {"bias_table"}
    table = encoding.bias_table(query_positions.device)
    per_distance = encoding.per_distance_bias(query_positions, key_positions, table)
    tables = {"per_distance_bias": torch.nn.functional.pad(per_distance, (0, -per_distance.shape[-1] % 8))}
    score_mod = encoding.score_mod(tables, query_positions, key_positions)
    torch.manual_seed(0)
    q_len, kv_len = query_positions.shape[-1], key_positions.shape[-1]
    query, key, value = (torch.randn(2, HEADS, n, 8, dtype=torch.float64) for n in (q_len, kv_len, kv_len))
    output = flex_attention(query, key, value, score_mod=score_mod)
    bias = by_pair(encoding, query_positions[0], key_positions[0], HEADS)
    weights = torch.softmax(query @ key.transpose(-1, -2) / 8**0.5 + bias, dim=-1)
    torch.testing.assert_close(output, weights @ value)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
@pytest.mark.parametrize("name", SHIFT_INVARIANT)
def test_a_model_with_default_positions_builds_one_bias_for_the_batch(name, family, monkeypatch):
    """Default positions: one ``(1, heads, q, k)`` bias from the per-distance table, and, with nothing padded, a
    ``(1, heads, q, k)`` mask too (not ``(batch, ...)``); the outputs equal those with the same positions given
    (the per-pair path), padded or not."""
    seen = []
    build_dense_mask = common.build_dense_mask

    def recording(mask, score_bias, dtype, keep_boolean):
        inputs = build_dense_mask(mask, score_bias, dtype, keep_boolean)
        seen.append((tuple(score_bias.shape), tuple(inputs["mask"].shape)))
        return inputs

    monkeypatch.setattr(common, "build_dense_mask", recording)
    model = make_model(family, name, attn="sdpa")
    perturb_position_parameters(model)
    ids = random_ids(3, 9)
    heads = model.config.num_attention_heads
    with torch.no_grad():
        default = model(ids).logits
        assert seen == [((1, heads, 9, 9), (1, heads, 9, 9))]
        given = model(ids, position_ids=torch.arange(9).expand(3, 9)).logits
        assert seen[-1][0] == (3, heads, 9, 9)
        torch.testing.assert_close(default, given, atol=1e-5, rtol=1e-5)
        padded = torch.ones_like(ids)
        padded[0, :3] = 0
        for positions in (None, torch.arange(9).expand(3, 9)):
            model(ids, attention_mask=padded, position_ids=positions)
        assert seen[-2][0] == (1, heads, 9, 9)


@pytest.mark.parametrize("name", SHIFT_INVARIANT)
def test_gradients_through_a_model_equal_with_and_without_the_table_path(name):
    """A training step's parameter gradients: default positions (per-distance table, Toeplitz) = the same positions
    given (per-pair formula)."""
    model = make_model("gpt2", name, attn="sdpa")
    perturb_position_parameters(model)
    ids = random_ids(2, 10)
    grads = []
    for positions in (None, torch.arange(10).expand(2, 10)):
        model.zero_grad()
        model(ids, position_ids=positions, labels=ids).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
