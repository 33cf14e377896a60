"""Attention normalizers (``softmax_normalizers.py``, ``softmax_free_normalizers.py``) and the Toeplitz gate
(kexue.fm/archives/9105) against float64 references of their formulas, inside both model families, with padding,
causal masks and rows that see no key; their numerics; their init. Stick-breaking attention (Tan et al. 2025)
against a hand loop, its row laws, the decoder-only rule and its chunked ``sdpa`` path against eager (values,
gradients, what it keeps for the backward); gated attention (option ``output_gate``) against a hand loop on the
layer's input, and the ``differential`` normalizer against Transformers' ``DiffLlamaAttention`` on the same weights;
their options, init and backends."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import transformers
from conftest import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    forward_in_two_chunks,
    make_config,
    make_model,
    random_ids,
    stock_attention_config,
)
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from transformers.models.diffllama.configuration_diffllama import DiffLlamaConfig
from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention, lambda_init_fn

import hf_posenc
from hf_posenc import attention_backends, relative_tables
from hf_posenc.attention_backends import build_dense_mask, choose_backend
from hf_posenc.attention_normalizers import ATTENTION_NORMALIZERS
from hf_posenc.configuration_posenc import resolve_attention_normalizer
from hf_posenc.posenc_attention import positional_attention
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import AttentionDims


NORMALIZERS = ["softmax", "l2", "exp", "relu2", "swish_l2", "sigmoid", "ssmax", "softpick"]
# Names of the tests for options that make another formula: softmax with a learned sink, and with a fixed one.
SPECS = {"sink": {"type": "softmax", "sink": "learned"}, "plus_one": {"type": "softmax", "sink": 0.0}}
CASES = NORMALIZERS + list(SPECS)
ATOL = 1e-5
CPU = torch.device("cpu")


def spec_of(name, **options):
    return {**SPECS.get(name, {"type": name}), **options}


def normalizer(name, causal=False, num_heads=2, max_positions=16, **options):
    """A normalizer layer; a learned sink and SSMax's s_h get values that differ per head."""
    dims = AttentionDims(hidden_size=8 * num_heads, num_heads=num_heads, head_dim=8, max_positions=max_positions,
                         causal=causal)  # fmt: skip
    spec = resolve_attention_normalizer(spec_of(name, **options))
    layer = ATTENTION_NORMALIZERS[spec["type"]](spec, dims)
    with torch.no_grad():
        for parameter_name, parameter in layer.named_parameters():
            if parameter_name in ("sink", "scale"):
                parameter.copy_(torch.linspace(-1.0, 1.5, num_heads) if parameter_name == "sink" else
                                torch.linspace(0.3, 0.8, num_heads))  # fmt: skip
    return layer


def reference_weights(name, scores, visible, gate=None, layer=None):
    """a_ij by the formula in float64, written out independently of the library: masked keys 0, rows with no
    visible key 0, then times the gate values ``c_ij``. ``scores``, ``visible``, ``gate`` broadcast together; the
    formula's parameters (sigmoid's n, a sink's logits, SSMax's s_h per head) are read from ``layer``."""
    visible = visible.expand(scores.shape)
    b = scores.double().masked_fill(~visible, 0.0)  # the values at masked keys are never read
    on = visible.double()
    if name == "softmax":
        weights = b.exp() * on / (b.exp() * on).sum(-1, keepdim=True)
    elif name in SPECS:  # e^b / (e^c_h + sum_j e^b)
        sink = layer.sink.detach() if name == "sink" else torch.zeros(layer.dims.num_heads)
        weights = b.exp() * on / ((b.exp() * on).sum(-1, keepdim=True) + sink.double().exp()[:, None, None])
    elif name == "sigmoid":
        weights = on / (1 + (-(b - math.log(layer.dims.max_positions))).exp())
    elif name == "ssmax":  # softmax(s_h log(n_i) b), n_i the visible keys of row i
        factor = layer.scale.detach().double()[:, None, None] * on.sum(-1, keepdim=True).clamp(min=1).log()
        weights = (factor * b).exp() * on / ((factor * b).exp() * on).sum(-1, keepdim=True)
    elif name == "softpick":
        weights = reference_softpick(scores.double().masked_fill(~visible, -math.inf), layer.spec["eps"])
    elif name == "l2":
        weights = b.exp() * on / ((2 * b).exp() * on).sum(-1, keepdim=True).sqrt()
    elif name == "exp":
        weights = b.exp() * on
    elif name == "relu2":
        weights = b.clamp(min=0) ** 2 * on / on.sum(-1, keepdim=True)
    else:
        swish = b / (1 + (-b).exp()) * on
        weights = swish / (swish**2).sum(-1, keepdim=True).sqrt()
    weights = torch.where(visible.any(-1, keepdim=True), weights, 0.0)
    return weights if gate is None else weights * gate.double()


def reference_softpick(scores, eps):
    """The reference's ``softpick`` (``zaydzuhri/softpick-attention``, ``naive_softpick_attn.py``): shifted by the row
    max ``m``, ``eps`` added to the shifted sum, ``-inf`` (masked) keys left out; a row with no finite score 0."""
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    shifted = torch.exp(scores - row_max) - torch.exp(-row_max)
    total = torch.where(torch.isfinite(scores), shifted.abs(), 0.0).sum(-1, keepdim=True)
    return shifted.clamp(min=0) / (total + eps)


def reference_gate(table, query_positions, key_positions, max_distance, causal):
    """c_ij = g_h(clip(i - j)) by loops: ``table`` (heads, width), positions (batch, n); (batch, heads, q, k)."""
    batch, heads = query_positions.shape[0], table.shape[0]
    gate = torch.zeros(batch, heads, query_positions.shape[1], key_positions.shape[1], dtype=torch.float64)
    for b in range(batch):
        for i, query in enumerate(query_positions[b].tolist()):
            for j, key in enumerate(key_positions[b].tolist()):
                distance = (
                    max(0, min(query - key, max_distance))
                    if causal
                    else max(-max_distance, min(query - key, max_distance))
                )
                gate[b, :, i, j] = table[:, distance if causal else distance + max_distance].double()
    return gate


def perturb_gates(model):
    """Gates start at 1 (a fresh gated model is the ungated one): give them values that matter."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("normalizer.toeplitz_gate"):
                param.normal_(1.0, 0.5)


def hf_position_ids(attention_mask):
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# --- the formulas on bare tensors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", CASES)
def test_each_normalizer_matches_its_formula_with_masked_keys(name, causal):
    torch.manual_seed(0)
    scores = 3 * torch.randn(2, 2, 4, 5, dtype=torch.float64)
    visible = torch.ones(2, 1, 4, 5, dtype=torch.bool)
    visible[0, ..., 3:] = False  # padding
    if causal:
        visible = visible & torch.ones(4, 5, dtype=torch.bool).tril(1)
    layer = normalizer(name).double()
    weights = layer(scores.masked_fill(~visible, torch.finfo(torch.float64).min), {"visible": visible})
    torch.testing.assert_close(weights, reference_weights(name, scores, visible, layer=layer))
    assert torch.equal(
        weights.masked_select(~visible.expand_as(weights)), torch.zeros(int((~visible).sum()) * 2).double()
    )


@pytest.mark.parametrize(("q_len", "kv_len"), [(5, 9), (1, 9), (6, 6)])
@pytest.mark.parametrize("causal", [False, True])
def test_a_missing_mask_means_what_transformers_sdpa_makes_of_it(q_len, kv_len, causal):
    """Transformers leaves the mask out (a prefill of 5 tokens into a static cache of 9 slots, a decoding step, a
    plain forward) and its SDPA integration decides what that means. Its weights, read off with zero queries and
    one-hot values, against the library's reading of no mask: SDPA's mask (``additive_mask``) and the row counts of
    ssmax (``visible_key_counts``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_posenc.normalizer_interface import additive_mask, visible_key_counts

    query, key = torch.zeros(1, 1, q_len, 4), torch.randn(1, 1, kv_len, 4)
    one_hot = torch.eye(kv_len)[None, None]
    output, _ = sdpa_attention_forward(SimpleNamespace(is_causal=causal), query, key, one_hot, None, scaling=1.0)
    expected = output.transpose(1, 2)[0, 0]  # (q_len, kv_len): 1 / n_i on the keys row i sees
    mask = additive_mask(None, causal, query, key)
    torch.testing.assert_close(torch.softmax(mask, dim=-1), expected)
    counts = visible_key_counts({"visible": None}, q_len, kv_len, causal, CPU)
    torch.testing.assert_close(counts[0, 0, :, 0], 1 / expected.amax(dim=-1))


def test_softmax_rows_sum_to_one_l2_rows_have_unit_norm_and_free_sum():
    scores = torch.randn(3, 2, 4, 6)
    torch.testing.assert_close(normalizer("softmax")(scores, {}).sum(-1), torch.ones(3, 2, 4))
    l2 = normalizer("l2")(scores, {})
    torch.testing.assert_close(l2.norm(dim=-1), torch.ones(3, 2, 4))
    assert (l2.sum(-1) > 1.0 + 1e-3).all()  # the l1 sum is in [1, sqrt(n)]
    swish = normalizer("swish_l2")(scores, {})
    torch.testing.assert_close(swish.norm(dim=-1), torch.ones(3, 2, 4))
    assert (swish < 0).any()  # swish is signed


def test_row_sums_follow_each_normalizers_law():
    """sigmoid: ``n_i sigmoid(b + beta)`` for equal scores, beta = -log(max_positions); ssmax: 1, and a row of one key
    gives it 1 (log 1 = 0); softpick: below 1, 1 to within eps when every score is positive, 0 when none is; a sink:
    ``1 - sigmoid(c_h - lse_i)``; every masked key exactly 0."""
    causal = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    min_ = torch.finfo(torch.float32).min
    equal = torch.full((1, 2, 4, 4), 0.5).masked_fill(~causal, min_)
    sums = normalizer("sigmoid", max_positions=16)(equal, {"visible": causal}).sum(-1)
    torch.testing.assert_close(sums, torch.arange(1.0, 5.0).expand(1, 2, 4) / (1 + math.exp(-0.5) * 16))
    torch.manual_seed(0)
    scores = torch.randn(1, 2, 4, 4).masked_fill(~causal, min_)
    ssmax = normalizer("ssmax", causal=True)(scores, {"visible": causal})
    torch.testing.assert_close(ssmax.sum(-1), torch.ones(1, 2, 4))
    assert torch.equal(ssmax[..., 0, 0], torch.ones(1, 2)) and (ssmax[~causal.expand_as(ssmax)] == 0).all()
    softpick = normalizer("softpick")
    mixed = softpick(torch.tensor([[[[2.0, -1.0, 0.5], [1.0, 2.0, 3.0], [-1.0, -2.0, 0.0]]]]), {})
    assert (mixed.sum(-1) <= 1).all() and mixed[0, 0, 0].sum() < 1 and mixed[0, 0, 0, 1] == 0
    torch.testing.assert_close(mixed[0, 0, 1].sum(), torch.tensor(1.0))
    assert torch.equal(mixed[0, 0, 2], torch.zeros(3))
    for name in SPECS:
        layer = normalizer(name)
        scores = torch.randn(1, 2, 3, 5)
        sink = layer.sink_logits(CPU)[:, None]
        expected = 1 - torch.sigmoid(sink - torch.logsumexp(scores, -1))
        torch.testing.assert_close(layer(scores, {}).sum(-1), expected)
        assert (expected < 1).all()


def test_new_normalizer_options_are_checked():
    for bad, match in [
        (
            {"type": "softmax", "sink": "fixed"},
            r"option 'sink'='fixed' is out of range; valid: \"learned\" or a finite",
        ),
        ({"type": "softmax", "sink": float("inf")}, "option 'sink'=inf is out of range"),
        ({"type": "softmax", "sink": True}, "option 'sink' must be str or float or int"),
        ({"type": "sigmoid", "bias": float("nan")}, "option 'bias'=nan is out of range; valid: finite"),
        ({"type": "ssmax", "initial_scale": "0.4"}, "option 'initial_scale' must be float or int"),
    ]:
        with pytest.raises(ValueError, match=match):
            resolve_attention_normalizer(bad)
    assert resolve_attention_normalizer({"type": "softmax", "sink": 1})["sink"] == 1.0
    assert resolve_attention_normalizer({"type": "sigmoid", "bias": -3})["bias"] == -3.0
    assert normalizer("sigmoid", max_positions=16, bias=-2).logit_bias == -2.0
    assert normalizer("sigmoid", max_positions=16).logit_bias == -math.log(16)
    assert normalizer("sigmoid", max_positions=16, bias=0.0).value_init_scale() == pytest.approx(8**-0.5)


@pytest.mark.parametrize("name", ["softmax", "l2"])
def test_large_scores_stay_finite_and_correct(name):
    scores = torch.tensor([[[[1000.0, 999.0, -1000.0]]]])
    weights = normalizer(name)(scores, {})
    shifted = reference_weights(name, torch.tensor([0.0, -1.0, -2000.0]), torch.ones(3, dtype=torch.bool))
    torch.testing.assert_close(weights[0, 0, 0], shifted.float())  # both formulas are invariant to a shift of the row


def test_relu2_divides_by_the_visible_keys_of_each_row():
    scores = torch.full((1, 1, 3, 4), 2.0)
    visible = torch.ones(1, 1, 3, 4, dtype=torch.bool).tril()
    weights = normalizer("relu2")(scores.masked_fill(~visible, torch.finfo(torch.float32).min), {"visible": visible})
    torch.testing.assert_close(weights.sum(-1)[0, 0], torch.tensor([4.0, 4.0, 4.0]))  # 4 * i / i
    torch.testing.assert_close(weights[0, 0, 2, :3], torch.full((3,), 4 / 3))
    assert torch.equal(normalizer("relu2")(scores, {"visible": None}), torch.full((1, 1, 3, 4), 1.0))  # 4 / 4 keys


def test_exp_raises_on_overflow_and_float64_widens_the_range():
    exp = normalizer("exp")
    torch.testing.assert_close(exp(torch.tensor([[[[88.0, 0.0]]]]), {}), torch.tensor([[[[math.exp(88.0), 1.0]]]]))
    with pytest.raises(OverflowError, match=r"a score of 90 gives e\^b = inf in torch.float32.*below log\(finfo"):
        exp(torch.tensor([[[[90.0, 0.0]]]]), {})
    with pytest.raises(OverflowError, match="inf in torch.float32"):  # bf16 scores are computed in float32
        exp(torch.tensor([[[[90.0, 0.0]]]], dtype=torch.bfloat16), {})
    assert math.isfinite(exp(torch.tensor([[[[700.0]]]], dtype=torch.float64), {}).item())


def test_swish_l2_row_that_underflows_gives_zero_not_nan():
    scores = torch.tensor([[[[-200.0, -300.0], [0.0, 0.0], [1.0, -1.0]]]])
    weights = normalizer("swish_l2")(scores, {})
    assert torch.equal(weights[0, 0, :2], torch.zeros(2, 2))  # swish underflows (and swish(0) = 0): weights 0
    torch.testing.assert_close(
        weights[0, 0, 2], reference_weights("swish_l2", scores[0, 0, 2], torch.ones(2).bool()).float()
    )


def test_gate_values_follow_clipped_distances_per_head():
    for causal in (False, True):
        gated = normalizer("softmax", causal=causal, num_heads=3, toeplitz_gate=True, toeplitz_max_distance=2)
        assert gated.toeplitz_gate.shape == (3, 3 if causal else 5)
        torch.nn.init.normal_(gated.toeplitz_gate)
        queries, keys = torch.tensor([[4, 5, 9], [0, 1, 2]]), torch.tensor([[0, 3, 4, 5, 9, 12], [0, 1, 2, 3, 4, 5]])
        expected = reference_gate(gated.toeplitz_gate.detach(), queries, keys, 2, causal)
        torch.testing.assert_close(gated.gate_values(queries, keys).double(), expected)


@pytest.mark.parametrize("name", CASES)
def test_gated_normalizer_is_the_formula_times_the_gate(name):
    torch.manual_seed(0)
    gated = normalizer(name, toeplitz_gate=True, toeplitz_max_distance=2).double()
    torch.nn.init.normal_(gated.toeplitz_gate)
    scores = torch.randn(1, 2, 3, 5, dtype=torch.float64)
    visible = torch.tensor([True, True, True, True, False]).expand(1, 1, 3, 5)
    inputs = {"visible": visible, "query_positions": torch.tensor([[0, 2, 4]]), "key_positions": torch.arange(5)[None]}
    weights = gated(scores.masked_fill(~visible, torch.finfo(torch.float64).min), inputs)
    gate = reference_gate(gated.toeplitz_gate.detach(), inputs["query_positions"], inputs["key_positions"], 2, False)
    torch.testing.assert_close(weights, reference_weights(name, scores, visible, gate, layer=gated))


def test_the_gate_runs_on_eager_only():
    t5 = {"type": "t5", "num_buckets": 32, "max_distance": 128}
    gated = resolve_attention_normalizer({"type": "softmax", "toeplitz_gate": True})
    assert ATTENTION_NORMALIZERS["softmax"].supported_backends(gated) == ("eager",)
    assert choose_backend("sdpa", t5, gated, CPU) == "eager"
    with torch.no_grad():
        assert choose_backend("flex_attention", t5, gated, CPU) == "eager"


# --- inside the models: each normalizer x gate, both families, an absolute and a relative scheme ----------------


def masked_batch(family):
    """ids, attention mask, position ids and the visible keys ``(batch, 1, q, k)``: BERT with right padding and a row
    that is all padding; GPT-2 causal with left padding (its pad queries see no key)."""
    ids = random_ids(2, 7)
    attention_mask = torch.ones_like(ids)
    if family == "bert":
        attention_mask[0] = 0
        attention_mask[1, 5:] = 0
        visible = attention_mask.bool()[:, None, None, :].expand(2, 1, 7, 7)
    else:
        attention_mask[0, :3] = 0
        visible = attention_mask.bool()[:, None, None, :] & torch.ones(7, 7, dtype=torch.bool).tril()
    return ids, attention_mask, hf_position_ids(attention_mask), visible


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("scheme", ["learned", "t5"])
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_model_attention_weights_match_the_float64_reference(family, scheme, name, gate):
    spec = spec_of(name, toeplitz_gate=gate, toeplitz_max_distance=3)
    model = make_model(family, scheme, spec, attn="eager").double()
    perturb_gates(model)
    ids, attention_mask, position_ids, visible = masked_batch(family)
    captured = []
    layers = [m for m in model.modules() if type(m) is ATTENTION_NORMALIZERS[spec["type"]]]
    layers[0].register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    with torch.no_grad():
        output = model(ids, attention_mask=attention_mask, position_ids=position_ids, output_attentions=True)
    expected_gate = None
    if gate:
        table = layers[0].toeplitz_gate.detach()
        expected_gate = reference_gate(table, position_ids, position_ids, 3, causal=family == "gpt2")
    expected = reference_weights(name, captured[0], visible, expected_gate, layer=layers[0])
    torch.testing.assert_close(output.attentions[0], expected)
    assert torch.isfinite(output.logits).all()


def test_a_fresh_gated_model_equals_the_ungated_one(family):
    ids = random_ids(2, 9)
    with torch.no_grad():
        plain = make_model(family, "t5", "l2", attn="eager")(ids).logits
        gated = make_model(family, "t5", {"type": "l2", "toeplitz_gate": True}, attn="eager")
        assert torch.equal(gated(ids).logits, plain)
    gates = [p for name, p in gated.named_parameters() if name.endswith("toeplitz_gate")]
    assert len(gates) == 2 and all(torch.equal(g, torch.ones_like(g)) for g in gates)  # one per layer, at 1
    assert gates[0] is not gates[1]


# --- the gate keeps every combination's behaviours --------------------------------------------------------------


def gated_model(family, scheme="t5", name="softmax", **kwargs):
    model = make_model(family, scheme, {"type": name, "toeplitz_gate": True, "toeplitz_max_distance": 4}, **kwargs)
    perturb_gates(model)
    return model


@pytest.mark.parametrize("name", ["softmax", "l2"])
def test_gated_decoder_cached_forward_and_generate_equal_uncached(name):
    model = gated_model("gpt2", name=name, attn="eager")
    chunked, full, _ = forward_in_two_chunks(model, random_ids(2, 12, seed=4), 7)
    torch.testing.assert_close(chunked, full, atol=ATOL, rtol=1e-4)
    prompt = random_ids(2, 6, seed=3)
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :2] = 0
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    kwargs.update(output_scores=True, return_dict_in_generate=True)
    cached, uncached = model.generate(prompt, **kwargs), model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(cached.scores), torch.stack(uncached.scores), atol=ATOL, rtol=1e-4)


def test_gated_model_row_alone_equals_row_in_padded_batch_and_is_shift_invariant(family):
    model = gated_model(family, name="exp")
    short, full = random_ids(1, 7, seed=1), random_ids(1, 11, seed=2)
    pad = torch.zeros(1, 4, dtype=torch.long)
    padded = torch.cat([pad, short], 1) if family == "gpt2" else torch.cat([short, pad], 1)
    attention_mask = torch.ones(2, 11, dtype=torch.long)
    if family == "gpt2":
        attention_mask[0, :4] = 0
    else:
        attention_mask[0, 7:] = 0
    with torch.no_grad():
        alone = model(short).logits[0]
        batch = model(
            torch.cat([padded, full]), attention_mask=attention_mask, position_ids=hf_position_ids(attention_mask)
        )
        shifted = model(short, position_ids=torch.arange(7)[None] + 13).logits[0]
    torch.testing.assert_close(batch.logits[0][attention_mask[0].bool()], alone, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(shifted, alone, atol=ATOL, rtol=1e-4)


def test_gated_model_save_load_is_exact_and_gradients_reach_the_gate(family, tmp_path):
    model = gated_model(family, name="relu2")
    model.save_pretrained(tmp_path)
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    reloaded = auto.from_pretrained(tmp_path).eval()
    ids = random_ids(2, 9)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    model.train()
    model(ids, labels=ids).loss.backward()
    grads = [p.grad for name, p in model.named_parameters() if name.endswith("toeplitz_gate")]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


# --- numerics at length, and the fused FlexAttention path ------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", CASES + ["gated"])
def test_bfloat16_rows_of_4096_keys_are_finite_and_match_float64(name, causal):
    """8 queries at the end of 4096 keys, a T5 bias, bf16 q/k/v; the weights are computed in float32."""
    torch.manual_seed(0)
    n, heads = 4096, 2
    query_positions, key_positions = torch.arange(n - 8, n)[None], torch.arange(n)[None]
    q, k, v = (torch.randn(1, heads, length, 16).bfloat16() for length in (8, n, n))
    dims = AttentionDims(hidden_size=32, num_heads=heads, head_dim=16, max_positions=n, causal=causal)
    spec = {"type": "softmax", "toeplitz_gate": True} if name == "gated" else spec_of(name)
    layer = ATTENTION_NORMALIZERS[spec["type"]](resolve_attention_normalizer(spec), dims)
    if name == "gated":
        torch.nn.init.normal_(layer.toeplitz_gate, 1.0, 0.5)
    if name == "sink":
        torch.nn.init.normal_(layer.sink, 2.0, 1.0)
    t5 = POSITION_ENCODINGS["t5"]({"type": "t5", "num_buckets": 32, "max_distance": 128, "table_scale": 1.0}, dims)
    torch.nn.init.normal_(t5.relative_attention_steps.weight)
    visible = (query_positions[:, None, :, None] >= key_positions[:, None, None, :]) if causal else None
    bias = t5.prepare(query_positions, key_positions, "eager")["score_bias"]
    inputs = {"backend": "eager", "query_positions": query_positions, "key_positions": key_positions, "position": {}}
    inputs.update(build_dense_mask(visible, bias, torch.float32, keep_boolean=False))
    encoding = POSITION_ENCODINGS["none"]({"type": "none"}, dims)
    with torch.no_grad():
        out, weights = positional_attention(
            q, k, v, inputs, encoding, layer, None, scaling=0.25, dropout=0.0, training=False, causal=causal
        )
        scores = q.double() @ k.double().transpose(-1, -2) * 0.25 + bias.double()
        gate = layer.gate_values(query_positions, key_positions) if name == "gated" else None
        full = torch.ones(1, 1, 8, n, dtype=torch.bool) if visible is None else visible
        expected = reference_weights("softmax" if name == "gated" else name, scores, full, gate, layer) @ v.double()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all() and torch.isfinite(weights).all()
    scale = expected.abs().amax()
    torch.testing.assert_close(out.transpose(1, 2).double() / scale, expected / scale, atol=2e-2, rtol=0)


FUSED = [("bert", "l2"), ("gpt2", "exp"), ("bert", "relu2"), ("gpt2", "relu2"), ("bert", "swish_l2")]
FUSED += [("gpt2", "swish_l2"), ("bert", "sigmoid"), ("gpt2", "sigmoid"), ("bert", "softpick"), ("gpt2", "softpick")]
FUSED += [("bert", "ssmax"), ("gpt2", "ssmax"), ("bert", "sink"), ("gpt2", "plus_one")]
FLEX_CALLS = {"l2": 2, "exp": 1, "relu2": 2, "swish_l2": 2, "sigmoid": 1, "softpick": 2, "sink": 1, "plus_one": 1}
FLEX_CALLS["ssmax"] = 2  # the visible-key count (log n_i), then softmax with s_h log n_i in the score_mod


@pytest.mark.parametrize(("family", "name"), FUSED)  # uncompiled flex is slow
def test_fused_flex_path_from_the_log_sum_exp_equals_eager(family, name, uncompiled_flex):
    """``O = softmax(b) V x exp(lse(b) - lse(2b)/2)`` (l2), ``x exp(lse(b))`` (exp), ``softmax(2 log relu b) V x
    exp(lse - log n)`` (relu2), the positive and negative parts of swish over its l2 norm (swish_l2). Compiled
    FlexAttention returns the log-sum-exp off CPU only (torch 2.13); uncompiled FlexAttention returns it on CPU (and
    is right for any head width), so it stands in here. With a padded row, and in BERT a row that sees no key
    (FlexAttention: lse = -inf, output 0)."""
    calls = uncompiled_flex
    ids = random_ids(3, 8)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 5:] = 0
    if family == "bert":
        attention_mask[2] = 0
    outputs = {}
    for attn in ("eager", "flex_attention"):
        model = make_model(family, "t5", spec_of(name), attn=attn)
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():  # a learned sink / s_h that differ per head
                if parameter_name.endswith(("normalizer.sink", "normalizer.scale")):
                    parameter.copy_(torch.linspace(-1.0, 1.5, parameter.numel()))
            outputs[attn] = model.base_model(ids, attention_mask=attention_mask).last_hidden_state
    assert len(calls) == 2 * FLEX_CALLS[name]  # two layers (relu2: and the visible-key count)
    assert torch.isfinite(outputs["flex_attention"]).all()
    real = attention_mask.bool()
    torch.testing.assert_close(outputs["flex_attention"][real], outputs["eager"][real], atol=ATOL, rtol=1e-4)


def differentiable_flex(query, key, value, score_mod=None, block_mask=None, scale=1.0, return_aux=None, **options):
    """FlexAttention's own eager semantics (``math_attention``: score_mod, mask, a row with no finite score gives
    output 0 and lse -inf) through autograd, which FlexAttention refuses on CPU; lse in natural log."""
    from torch._higher_order_ops.flex_attention import math_attention

    if block_mask is None:
        block_mask = create_block_mask(lambda b, h, q, kv: q >= 0, None, None, query.shape[-2], key.shape[-2], "cpu")
    score_mod = score_mod or (lambda score, batch_idx, head_idx, q_idx, kv_idx: score)
    output, lse, _ = math_attention(query, key, value, score_mod, block_mask.as_tuple(), scale, {})
    return output if return_aux is None else (output, SimpleNamespace(lse=lse * math.log(2)))


def scores_mod(scores):
    """A score_mod that replaces q.k with given scores ``(heads, q, k)`` (which may then hold exact zeros)."""
    return lambda score, batch_idx, head_idx, q_idx, kv_idx: scores[head_idx, q_idx, kv_idx]


def softpick_by_hand(row: list[float], eps: float) -> list[float]:
    """The reference's softpick of one row, unshifted: its ``eps`` is added to the sum shifted by the row max ``m``,
    that is ``eps e^m`` here; ``e^b - 1`` by ``math.expm1``, exact for scores near 0."""
    total = sum(abs(math.expm1(b)) for b in row) + eps * math.exp(max(row))
    return [max(math.expm1(b), 0.0) / total for b in row]


@pytest.mark.parametrize("eps", [None, 1e-6])
def test_softpick_keeps_the_references_eps_for_rows_of_scores_near_zero(eps):
    """Rows whose ``sum_j |e^b - 1|`` is near eps (scores around 1e-9, 1e-8, 1e-7), one at 1e-12 where eps takes
    almost all, a row of exact zeros and a row of ordinary scores, in float64, eager and FlexAttention's log form
    against the reference's formula by hand (eps 1e-8, the default; 1e-6, its Triton kernel's); the two paths'
    gradients agree."""
    torch.manual_seed(3)
    scales = torch.tensor([1e-9, 1e-8, 1e-7, 1e-12, 0.0, 1.0], dtype=torch.float64)
    scores = torch.randn(1, len(scales), 5, dtype=torch.float64) * scales[:, None]
    layer = normalizer("softpick", num_heads=1, **({} if eps is None else {"eps": eps})).double()
    assert layer.spec["eps"] == (1e-8 if eps is None else eps)
    by_hand = [softpick_by_hand(row, layer.spec["eps"]) for row in scores[0].tolist()]
    expected = torch.tensor(by_hand, dtype=torch.float64)
    value = torch.randn(1, 1, 5, 4, dtype=torch.float64)
    grads = {}
    for path in ("eager", "flex"):
        b = scores.clone().requires_grad_()
        if path == "flex":
            query = torch.zeros(1, 1, len(scales), 4, dtype=torch.float64)
            output = layer.flex_output(differentiable_flex, query, query[:, :, :1].expand(1, 1, 5, 4), value,
                                       scores_mod(b), None, 1.0)  # fmt: skip
        else:
            weights = layer(b[None], {})[0, 0]
            output = weights[None, None] @ value
            # eps against the reference's eps e^m: a relative difference below eps (and below e^m - 1)
            torch.testing.assert_close(weights, expected, rtol=layer.spec["eps"], atol=0)
        torch.testing.assert_close(output[0, 0], expected @ value[0, 0], rtol=layer.spec["eps"], atol=1e-30)
        (output * torch.linspace(-1, 1, output.numel(), dtype=torch.float64).view_as(output)).sum().backward()
        grads[path] = b.grad
    torch.testing.assert_close(grads["flex"], grads["eager"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", CASES)
def test_fused_flex_values_and_gradients_equal_eager_at_zero_and_negative_scores(name):
    """Scores with exact zeros, values near 0 of both signs, large negatives (-120: float32 swish underflows there),
    a row with no positive score and a row with no visible key; output and the gradients of the scores and values
    against eager's weights. The one documented difference: swish_l2's gradient at a score of exactly 0 (eager's
    d swish/db = 1/2 there; a log-domain weight has no derivative at its zero) is 0 on the fused path."""
    torch.manual_seed(0)
    scores = torch.randn(2, 5, 6, dtype=torch.float64) * 2
    scores[0, 0, :3] = 0.0
    scores[0, 1] = -torch.rand(6, dtype=torch.float64)  # no positive score: relu2 gives the row 0
    scores[1, 2, :2] = torch.tensor([1e-6, -1e-6])
    scores[1, 3, 1:3] = -120.0
    visible = torch.ones(5, 6, dtype=torch.bool)
    visible[:, 4:] = False  # padding
    visible[4] = False  # a query that sees no key
    block_mask = create_block_mask(lambda b, h, q, kv: visible[q, kv], None, None, 5, 6, "cpu")
    value = torch.randn(1, 2, 6, 16, dtype=torch.float64)
    layer = normalizer(name, num_heads=2).double()
    results = {}
    for path in ("eager", "flex"):
        b, v = scores.clone().requires_grad_(), value.clone().requires_grad_()
        if path == "flex":
            query = torch.zeros(1, 2, 5, 16, dtype=torch.float64)
            output = layer.flex_output(differentiable_flex, query, query[:, :, :1].expand(1, 2, 6, 16), v,
                                       scores_mod(b), block_mask, 1.0)  # fmt: skip
        else:
            masked = b[None].masked_fill(~visible, torch.finfo(torch.float64).min)
            weights = layer(masked.masked_fill(~visible.any(-1, keepdim=True), 0.0), {"visible": visible})
            output = (weights * visible.any(-1, keepdim=True)) @ v
        (output * torch.linspace(-1, 1, output.numel(), dtype=torch.float64).view_as(output)).sum().backward()
        results[path] = (output, b.grad, v.grad, [p.grad.clone() for p in layer.parameters()])
        layer.zero_grad()
    expected = reference_weights(name, scores, visible, layer=layer) @ value
    torch.testing.assert_close(results["eager"][0], expected)
    torch.testing.assert_close(results["flex"][0], expected)
    if name == "relu2":
        assert torch.equal(results["flex"][0][0, 0, 1], torch.zeros(16, dtype=torch.float64))
    assert torch.equal(results["flex"][0][0, :, 4], torch.zeros(2, 16, dtype=torch.float64))
    torch.testing.assert_close(results["flex"][2], results["eager"][2])
    exact_zero = scores == 0
    if name == "swish_l2":
        assert torch.equal(results["flex"][1][exact_zero], torch.zeros(3, dtype=torch.float64))
        assert results["eager"][1][exact_zero].abs().min() > 1e-3
    else:  # softpick: the weight's and the denominator's derivative are both 0 at 0 on both paths
        torch.testing.assert_close(results["flex"][1][exact_zero], results["eager"][1][exact_zero])
    torch.testing.assert_close(results["flex"][1][~exact_zero], results["eager"][1][~exact_zero])
    assert torch.isfinite(results["flex"][1]).all()
    for flex_grad, eager_grad in zip(results["flex"][3], results["eager"][3], strict=True):  # a sink, s_h
        torch.testing.assert_close(flex_grad, eager_grad)


LSE_ONLY_CALLS = {"l2": [2, 16], "softpick": [2, 16], "swish_l2": [4, 16]}
"""Per normalizer, its FlexAttention calls' query heads (of 2) in order, then the width of the pass read for its
log-sum-exp only (the others take the 8-wide values)."""


@pytest.mark.parametrize("name", sorted(LSE_ONLY_CALLS))
@pytest.mark.parametrize("mask_heads", [1, 2])
def test_lse_only_passes_take_a_narrow_zero_value_and_shared_passes_one_call(name, mask_heads):
    """The pass read for its log-sum-exp only (l2's ``lse(2b)``, softpick's ``lse(s|)``, swish_l2's ``lse(s2)``)
    gets a zero value 16 wide that needs no gradient; swish_l2's positive and negative parts run as one call with
    each query head stacked twice over the same keys and values (a per-head mask: two calls). Output and gradients
    equal eager's weights (float64, a causal mask, grouped-query keys)."""
    torch.manual_seed(1)
    calls = []

    def recording_flex(query, key, value, **kwargs):
        calls.append((query.shape[1], value.shape[-1], value.requires_grad, bool((value == 0).all())))
        return differentiable_flex(query, key, value, **kwargs)

    visible = torch.ones(5, 6, dtype=torch.bool).tril(1)
    block_mask = create_block_mask(lambda b, h, q, kv: visible[q, kv], None, mask_heads if mask_heads > 1 else None,
                                   5, 6, "cpu")  # fmt: skip
    scores = (torch.randn(2, 5, 6, dtype=torch.float64) * 2).requires_grad_()
    value = torch.randn(1, 1, 6, 8, dtype=torch.float64, requires_grad=True)
    query = torch.zeros(1, 2, 5, 16, dtype=torch.float64)
    layer = normalizer(name, num_heads=2).double()
    output = layer.flex_output(recording_flex, query, query[:, :1, :1].expand(1, 1, 6, 16), value, scores_mod(scores),
                               block_mask, 1.0)  # fmt: skip
    expected = reference_weights(name, scores.detach(), visible, layer=layer) @ value.detach()
    torch.testing.assert_close(output, expected)
    (output * torch.linspace(-1, 1, output.numel(), dtype=torch.float64).view_as(output)).sum().backward()
    flex_grads = scores.grad, value.grad
    scores.grad = value.grad = None
    masked = scores[None].masked_fill(~visible, torch.finfo(torch.float64).min)
    eager = layer(masked, {"visible": visible}) @ value
    (eager * torch.linspace(-1, 1, eager.numel(), dtype=torch.float64).view_as(eager)).sum().backward()
    for flex_grad, eager_grad in zip(flex_grads, (scores.grad, value.grad), strict=True):
        torch.testing.assert_close(flex_grad, eager_grad)
    *full_heads, lse_width = LSE_ONLY_CALLS[name]
    if mask_heads == 2 and name == "swish_l2":
        full_heads = [2, 2]
    assert calls == [(heads, 8, True, False) for heads in full_heads] + [(2, lse_width, False, True)]


@pytest.mark.parametrize("name", ["relu2", "swish_l2", "sigmoid", "ssmax", "softpick", "sink"])
def test_fused_flex_path_with_a_t5_bias_and_a_causal_padded_mask_has_eager_gradients(name, monkeypatch):
    """Through ``positional_attention`` with a causal, left-padded mask: the bias table's gradient reaches it through
    the scheme's score_mod in every pass of the normalizer."""
    monkeypatch.setattr(attention_backends, "_compiled_flex_attention", lambda *region: differentiable_flex)
    torch.manual_seed(0)
    dims = AttentionDims(hidden_size=32, num_heads=2, head_dim=16, max_positions=16, causal=True)
    spec = resolve_attention_normalizer(spec_of(name))
    layer = ATTENTION_NORMALIZERS[spec["type"]](spec, dims).double()
    for parameter in layer.parameters():  # a learned sink / s_h that differ per head
        torch.nn.init.uniform_(parameter, 0.2, 1.0)
    t5 = POSITION_ENCODINGS["t5"]({"type": "t5", "num_buckets": 8, "max_distance": 16, "table_scale": 1.0}, dims)
    torch.nn.init.normal_(t5.relative_attention_steps.weight)
    t5 = t5.double()
    positions = torch.arange(7)[None]
    visible = (positions[:, None, :, None] >= positions[:, None, None, :]) & (positions >= 2)[:, None, None, :]
    qkv = [torch.randn(1, 2, 7, 16, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    kwargs = dict(scaling=0.25, dropout=0.0, training=False, causal=True)
    gradients = {}
    for backend in ("eager", "flex_attention"):
        if backend == "flex_attention":
            block_mask = create_block_mask(lambda b, h, q, kv: visible[0, 0, q, kv], None, None, 7, 7, "cpu")
            inputs = {"backend": backend, "mask": block_mask, "visible": None, "row_has_key": None}
            inputs.update(position=t5.prepare(positions, positions, backend))
        else:
            tables = t5.prepare(positions, positions, backend)
            inputs = {"backend": backend, "position": tables}
            inputs.update(build_dense_mask(visible, tables.pop("score_bias"), torch.float64, keep_boolean=False))
        inputs.update(query_positions=positions, key_positions=positions)
        output, _ = positional_attention(*qkv, inputs, t5, layer, None, **kwargs)
        output[:, 2:].pow(2).sum().backward()  # queries 0, 1 see no key: output 0 on both paths
        table = t5.relative_attention_steps.weight
        gradients[backend] = [output.detach(), table.grad] + [tensor.grad for tensor in qkv]
        gradients[backend] += [parameter.grad for parameter in layer.parameters()]
        for tensor in [*qkv, table, *layer.parameters()]:
            tensor.grad = None
    for flex, eager in zip(gradients["flex_attention"], gradients["eager"], strict=True):
        torch.testing.assert_close(flex, eager)


def test_fused_normalizers_run_eager_on_cpu_and_flex_elsewhere():
    t5 = {"type": "t5", "num_buckets": 32, "max_distance": 128}
    for name in ("l2", "exp", "relu2", "swish_l2", "sigmoid", "softpick"):
        spec = resolve_attention_normalizer(name)
        with torch.no_grad():
            assert choose_backend("flex_attention", t5, spec, CPU) == "eager"
            assert choose_backend("flex_attention", t5, spec, torch.device("cuda")) == "flex_attention"
        assert choose_backend("sdpa", t5, spec, CPU) == "eager"
        assert choose_backend("sdpa", t5, spec, torch.device("cuda")) == "flex_attention"


def test_ssmax_and_a_sink_run_sdpa_and_flex_from_the_log_sum_exp_off_cpu():
    """SDPA computes them exactly (queries and additive terms scaled by s_h log n_i; the sink as a zero key); flex
    reads the log-sum-exp (n_i, the sink's share), which compiled CPU FlexAttention does not return: CPU requests for
    flex run SDPA. A scheme's value term reads softmax weights on SDPA and flex: with them it runs eager."""
    t5 = {"type": "t5", "num_buckets": 32, "max_distance": 128}
    shaw = resolve_position_encoding_for_test("shaw")
    for name in ("ssmax", "sink", "plus_one"):
        spec = resolve_attention_normalizer(spec_of(name))
        assert choose_backend("sdpa", t5, spec, CPU) == "sdpa"
        assert choose_backend("sdpa", t5, spec, torch.device("cuda")) == "sdpa"
        with torch.no_grad():
            assert choose_backend("flex_attention", t5, spec, CPU) == "sdpa"
            assert choose_backend("flex_attention", t5, spec, torch.device("cuda")) == "flex_attention"
            assert choose_backend("flex_attention", shaw, spec, torch.device("cuda"), consecutive=True) == "eager"
        assert choose_backend("sdpa", shaw, spec, CPU) == "eager"
    with torch.no_grad():  # without a sink softmax keeps its value-term paths
        softmax = resolve_attention_normalizer("softmax")
        assert (
            choose_backend("flex_attention", shaw, softmax, torch.device("cuda"), consecutive=True) == "flex_attention"
        )
    assert choose_backend("sdpa", shaw, softmax, CPU) == "sdpa"


def resolve_position_encoding_for_test(name):
    return make_config("bert", name).position_encoding


def test_models_initialise_a_learned_sink_as_gpt_oss_and_s_h_at_its_initial_scale(family):
    """gpt-oss's sinks start N(0, initializer_range) (Transformers' GptOssPreTrainedModel); s_h at ``initial_scale``;
    a saved model's values are loaded, not re-initialised."""
    sink = make_model(family, "rope", {"type": "softmax", "sink": "learned"}, initializer_range=0.5)
    sinks = torch.cat([p for name, p in sink.named_parameters() if name.endswith("normalizer.sink")])
    assert sinks.shape == (8,) and sinks.std() > 0.1 and sinks.abs().max() < 3.0
    ssmax = make_model(family, "rope", {"type": "ssmax", "initial_scale": 0.3})
    scales = [p for name, p in ssmax.named_parameters() if name.endswith("normalizer.scale")]
    assert len(scales) == 2 and all(torch.equal(s, torch.full((4,), 0.3)) for s in scales)


# --- initialisation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_value_init_scale_undoes_the_row_sum_at_init(name):
    """At init the scores are near 0 (a small constant c for n equal tokens): a normalizer whose row sums to r(n)
    (softmax: 1) scales W_V and W_O by r(n)^(-1/2) each, so the output starts at softmax's scale; r(n) <= 1 keeps 1."""
    n = 64
    layer = normalizer(name, max_positions=n)
    row_sum = (
        layer.double()(torch.full((1, 2, 1, n), 0.01, dtype=torch.float64), {"visible": None}).sum(-1).max().item()
    )
    expected = row_sum**-0.5 if row_sum > 1.0 + 1e-6 else 1.0
    assert layer.value_init_scale() == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("name", ["l2", "exp", "relu2"])
def test_models_shrink_the_value_and_output_init_by_the_factor(family, name):
    big = dict(hidden_size=256, num_attention_heads=4) if family == "bert" else dict(n_embd=256, n_head=4)
    model = make_model(family, "learned", name, initializer_range=0.02, **big)  # max_positions = 40
    scale = {"l2": 40**-0.25, "exp": 40**-0.5, "relu2": 1.0}[name]
    if family == "bert":
        attention = model.bert.encoder.layer[0].attention
        value, output, query = attention.self.value.weight, attention.output.dense.weight, attention.self.query.weight
        expected_output_std = 0.02 * scale
    else:
        attention = model.transformer.h[0].attn
        value, output, query = (
            attention.c_attn.weight[:, 512:],
            attention.c_proj.weight,
            attention.c_attn.weight[:, :256],
        )
        expected_output_std = 0.02 / math.sqrt(4) * scale  # GPT-2's residual scaling, 2 layers
    assert value.std().item() == pytest.approx(0.02 * scale, rel=0.05)
    assert output.std().item() == pytest.approx(expected_output_std, rel=0.05)
    assert query.std().item() == pytest.approx(0.02, rel=0.05)


def test_listing_names_every_normalizer_with_the_gate_options():
    listing = hf_posenc.list_attention_normalizers()
    assert list(listing) == [*NORMALIZERS, "stick_breaking", "differential"]
    for entry in listing.values():
        assert entry["options"]["toeplitz_max_distance"]["default"] == 128
        assert entry["options"]["output_gate"]["default"] is None
        assert entry["options"]["output_norm"]["default"] is False
    assert make_config("gpt2", "t5", {"type": "relu2", "toeplitz_gate": True}).attention_normalizer == {
        "type": "relu2", "output_gate": None, "output_norm": False, "toeplitz_gate": True, "toeplitz_max_distance": 128
    }  # fmt: skip


def test_convert_with_a_gated_softmax_gives_the_stock_logits():
    """convert() starts the gate from its init (1): a converted stock GPT-2 computes what the stock one does."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=40, vocab_size=61)
    stock = transformers.GPT2LMHeadModel(config).eval()
    converted = hf_posenc.convert(stock, attention_normalizer={"type": "softmax", "toeplitz_gate": True}).eval()
    ids = random_ids(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, stock(ids).logits, atol=ATOL, rtol=1e-4)
    assert converted.transformer.h[1].attn.normalizer.toeplitz_gate.eq(1).all()


def test_exp_on_flex_applies_the_row_factor_in_float32_without_a_host_sync(monkeypatch):
    """A float16 row whose ``e^lse`` passes float16's largest value (lse > 11.09) but whose output does not: the
    factor is applied in float32, so the output is finite and equals e^b V by hand; and no ``.item()`` (a host sync
    per layer on a GPU) runs."""
    torch.manual_seed(0)
    query = torch.nn.functional.normalize(torch.randn(1, 1, 4, 16), dim=-1).mul(4).half()  # |q|^2 = 16
    key = query.clone()
    value = torch.randn(1, 1, 4, 16, dtype=torch.float16) * 1e-3
    scale = 14.0 / 16  # q.k ~ 16 on the diagonal: scores ~ 14, e^14 > 65504

    item = torch.Tensor.item
    in_kernel = []  # FlexAttention's own Python may read values; the normalizer's code around it must not

    def no_item(self):
        if not in_kernel:
            raise AssertionError("exp's flex path synced the host")
        return item(self)

    def attend(*args, pass_name=None, **kwargs):
        in_kernel.append(True)
        try:
            return flex_attention(*args, **kwargs)
        finally:
            in_kernel.pop()

    monkeypatch.setattr(torch.Tensor, "item", no_item)
    output = normalizer("exp").flex_output(attend, query, key, value, None, None, scale)
    monkeypatch.undo()
    scores = query.double() @ key.double().transpose(-1, -2) * scale
    expected = torch.exp(scores) @ value.double()
    assert scores.max() > math.log(torch.finfo(torch.float16).max) and torch.isfinite(output).all()
    torch.testing.assert_close(output.double(), expected, rtol=1e-2, atol=1e-2)


def stick_breaking(heads=2, max_positions=16, **options):
    dims = AttentionDims(hidden_size=8 * heads, num_heads=heads, head_dim=8, max_positions=max_positions, causal=True)
    spec = resolve_attention_normalizer({"type": "stick_breaking", **options}, causal=True)
    return ATTENTION_NORMALIZERS["stick_breaking"](spec, dims)


def loop_weights(scores, visible, query_positions, key_positions, attend_current=False):
    """The product formula by loops in float64: walking from the query outward over the keys it may see (visible, at
    an earlier position, or the same one with ``attend_current``), each key takes sigmoid(b) of what is left."""
    batch, heads, q_len, kv_len = scores.shape
    weights = torch.zeros(scores.shape, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(q_len):
                left = 1.0
                for j in reversed(range(kv_len)):
                    before = (
                        key_positions[b, j] <= query_positions[b, i]
                        if attend_current
                        else (key_positions[b, j] < query_positions[b, i])
                    )
                    if not (visible[b, 0, i, j] and before):
                        continue
                    share = 1.0 / (1.0 + math.exp(-scores[b, h, i, j].item()))
                    weights[b, h, i, j] = share * left
                    left *= 1.0 - share
    return weights


def masked(scores, visible):
    return scores.masked_fill(~visible, torch.finfo(scores.dtype).min)


def gapped_causal_visible(batch, q_len, kv_len):
    """Causal (queries at the last ``q_len`` of ``kv_len`` keys), with left padding in row 0 and a key hidden in the
    middle of row 1 (a masked key between the query and the keys before it)."""
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    visible = causal[None, None].repeat(batch, 1, 1, 1)
    visible[0, ..., :2] = False
    visible[1, ..., 3] = False
    return visible


@pytest.mark.parametrize("attend_current", [False, True])
def test_weights_match_the_product_formula_by_loops(attend_current):
    torch.manual_seed(0)
    batch, q_len, kv_len = 2, 5, 7
    scores = 2 * torch.randn(batch, 2, q_len, kv_len, dtype=torch.float64)
    visible = gapped_causal_visible(batch, q_len, kv_len)
    query_positions = torch.arange(kv_len - q_len, kv_len)[None].repeat(batch, 1) + torch.tensor([[0], [5]])
    key_positions = torch.arange(kv_len)[None].repeat(batch, 1) + torch.tensor([[0], [5]])
    inputs = {"visible": visible, "query_positions": query_positions, "key_positions": key_positions}
    weights = stick_breaking(attend_current=attend_current)(masked(scores, visible), inputs)
    expected = loop_weights(scores, visible, query_positions, key_positions, attend_current)
    torch.testing.assert_close(weights, expected, atol=1e-12, rtol=1e-10)
    assert (weights.masked_select(~visible) == 0).all()  # masked keys weigh exactly 0


def test_a_masked_key_between_is_absent_from_the_product():
    """Hiding a key removes it from the stick: the keys beyond it weigh what they weigh without it."""
    torch.manual_seed(1)
    scores = torch.randn(1, 1, 1, 6, dtype=torch.float64)
    positions = {"query_positions": torch.tensor([[6]]), "key_positions": torch.arange(6)[None]}
    hidden = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    hidden[..., 3] = False
    with_gap = stick_breaking()(masked(scores, hidden), {"visible": hidden, **positions})
    without = stick_breaking()(
        scores[..., [0, 1, 2, 4, 5]],
        {"visible": None, "query_positions": torch.tensor([[6]]), "key_positions": torch.tensor([[0, 1, 2, 4, 5]])},
    )
    assert with_gap[..., 3].item() == 0.0
    torch.testing.assert_close(with_gap[..., [0, 1, 2, 4, 5]], without, atol=0, rtol=0)


def test_rows_sum_to_one_minus_the_stick_left_and_a_row_without_an_earlier_key_is_zero():
    torch.manual_seed(2)
    n = 6
    scores = 3 * torch.randn(2, 2, n, n, dtype=torch.float64)
    visible = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(2, 1, n, n)
    positions = {"query_positions": torch.arange(n)[None], "key_positions": torch.arange(n)[None]}
    weights = stick_breaking()(masked(scores, visible), {"visible": visible, **positions})
    left = (1 - torch.sigmoid(scores)).tril(-1).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(-1), 1.0)
    torch.testing.assert_close(weights.sum(-1), 1 - left.prod(-1))
    assert (weights.sum(-1) <= 1).all() and (weights >= 0).all()
    assert (weights[..., 0, :] == 0).all()  # the first query sees only itself: nothing before it


def test_a_model_gives_zero_attention_output_to_a_row_with_no_visible_key():
    """A 4-D mask that hides every key from one query: its attention output is 0, with no NaN, eager and chunked."""
    ids = random_ids(1, 6)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    mask[..., 4, :] = False
    outputs = {}
    for attn in ("eager", "sdpa"):
        model = make_model("gpt2", "none", "stick_breaking", attn=attn)
        captured = []
        hook = model.transformer.h[0].attn.c_proj.register_forward_hook(
            lambda module, args, output, captured=captured: captured.append(args[0])
        )
        with torch.no_grad():
            outputs[attn] = model(ids, attention_mask=mask).logits
        hook.remove()
        assert torch.isfinite(outputs[attn]).all()
        assert (captured[0][0, 4] == 0).all() and (captured[0][0, 0] == 0).all()  # no key; only itself
    torch.testing.assert_close(outputs["sdpa"], outputs["eager"], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("path", ["eager", "sdpa"])
def test_stick_breaking_bfloat16_rows_of_4096_keys_are_finite_and_match_float64(path):
    """8 queries at the end of 4096 keys, a T5 bias, bf16 q/k/v, the eager or the chunked path (3 queries a chunk);
    the reference multiplies the stick's shares in float64 (no logarithms)."""
    torch.manual_seed(0)
    n, heads = 4096, 2
    query_positions, key_positions = torch.arange(n - 8, n)[None], torch.arange(n)[None]
    q, k, v = (torch.randn(1, heads, length, 16).bfloat16() for length in (8, n, n))
    dims = AttentionDims(hidden_size=32, num_heads=heads, head_dim=16, max_positions=n, causal=True)
    layer = stick_breaking(heads=heads, max_positions=n)
    t5 = POSITION_ENCODINGS["t5"]({"type": "t5", "num_buckets": 32, "max_distance": 128, "table_scale": 1.0}, dims)
    torch.nn.init.normal_(t5.relative_attention_steps.weight)
    visible = query_positions[:, None, :, None] >= key_positions[:, None, None, :]
    bias = t5.prepare(query_positions, key_positions, path)["score_bias"]
    inputs = {"backend": path, "query_positions": query_positions, "key_positions": key_positions, "position": {}}
    inputs.update(build_dense_mask(visible, bias, torch.bfloat16 if path == "sdpa" else torch.float32, path == "sdpa"))
    encoding = POSITION_ENCODINGS["none"]({"type": "none"}, dims)
    with torch.no_grad():
        out, _ = positional_attention(
            q, k, v, inputs, encoding, layer, None, scaling=0.25, dropout=0.0, training=False, causal=True
        )
    scores = q.double() @ k.double().transpose(-1, -2) * 0.25 + bias.double()
    shares = torch.sigmoid(scores).masked_fill(~(key_positions < query_positions[..., None])[:, None], 0.0)
    # what is left after the keys j+1 .. i-1: the product of (1 - share) over the keys after j, by a reversed cumprod
    left = (1 - shares).flip(-1).cumprod(-1).flip(-1)
    left = torch.cat((left[..., 1:], torch.ones_like(left[..., :1])), dim=-1)
    expected = (shares * left) @ v.double()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    scale = expected.abs().amax()
    torch.testing.assert_close(out.transpose(1, 2).double() / scale, expected / scale, atol=2e-2, rtol=0)


def test_the_toeplitz_gate_composes():
    torch.manual_seed(3)
    n = 6
    layer = stick_breaking(toeplitz_gate=True, toeplitz_max_distance=3)
    torch.nn.init.normal_(layer.toeplitz_gate, 1.0, 0.5)
    scores = torch.randn(1, 2, n, n, dtype=torch.float64)
    visible = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    positions = {"query_positions": torch.arange(n)[None], "key_positions": torch.arange(n)[None]}
    weights = layer.double()(masked(scores, visible), {"visible": visible, **positions})
    distance = (torch.arange(n)[:, None] - torch.arange(n)).clamp(0, 3)
    gate = layer.toeplitz_gate.detach()[:, distance][None]
    expected = loop_weights(scores, visible, positions["query_positions"], positions["key_positions"]) * gate
    torch.testing.assert_close(weights, expected)
    assert ATTENTION_NORMALIZERS["stick_breaking"].supported_backends(layer.spec) == ("eager",)
    model = make_model("gpt2", "none", {"type": "stick_breaking", "toeplitz_gate": True}, attn="sdpa")
    assert torch.isfinite(model(random_ids(2, 7)).logits).all()


def test_an_encoder_config_raises_naming_why():
    with pytest.raises(ValueError, match="'stick_breaking' has no encoder form \\(causal by construction"):
        hf_posenc.PosEncBertConfig(attention_normalizer="stick_breaking")
    config = hf_posenc.PosEncBertConfig(
        attention_normalizer="stick_breaking", is_decoder=True, hidden_size=32, num_attention_heads=4,
        num_hidden_layers=1, intermediate_size=48, vocab_size=61,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert torch.isfinite(model(random_ids(2, 5)).logits).all()


def test_no_position_encoding_is_needed_to_tell_positions_apart():
    """``none`` + stick_breaking is a complete model: identical tokens get different outputs at each position (with
    softmax every row of identical tokens is the same mean, so the outputs are all equal)."""
    ids = torch.full((1, 8), 5)
    with torch.no_grad():
        softmax = make_model("gpt2", "none", "softmax").transformer(ids).last_hidden_state[0]
        sticks = make_model("gpt2", "none", "stick_breaking").transformer(ids).last_hidden_state[0]
    torch.testing.assert_close(softmax, softmax[:1].expand_as(softmax), atol=1e-5, rtol=1e-5)
    assert (sticks[1:] - sticks[:1]).abs().amax(-1).min() > 1e-3


CHUNKED_SCHEMES = ["t5", "rope", {"type": "shaw", "use_value": True}, "cope"]


@pytest.mark.parametrize("scheme", CHUNKED_SCHEMES)
def test_chunked_path_equals_eager_in_values_and_gradients(scheme, monkeypatch):
    """The sdpa backend runs stick_breaking a chunk of 3 queries at a time (checkpointed), with left padding: the
    loss and every gradient equal eager's, for a position bias, a rotary scheme, Shaw's value term (its row index
    sliced per chunk) and a content term (CoPE, its ``(q, k)`` term sliced per chunk)."""
    monkeypatch.setattr(relative_tables, "CHUNK_ELEMENTS", 3 * 2 * 4 * 11)  # batch 2, 4 heads, 11 keys: 3 queries
    ids = random_ids(2, 11)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :3] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    results = {}
    for attn in ("eager", "sdpa"):
        model = make_model("gpt2", scheme, "stick_breaking", attn=attn).train()
        loss = model(ids, attention_mask=attention_mask, position_ids=position_ids, labels=ids).loss
        loss.backward()
        results[attn] = loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(results["sdpa"][0], results["eager"][0], atol=1e-6, rtol=1e-6)
    assert results["sdpa"][1].keys() == results["eager"][1].keys()
    for name, grad in results["eager"][1].items():
        torch.testing.assert_close(results["sdpa"][1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def largest_tensor_saved_for_backward(path: str, q_len: int) -> int:
    """Elements of the largest tensor one attention call saves for its backward (``saved_tensors_hooks`` sees what
    autograd saves outside the checkpointed chunks, whose own intermediates are dropped and recomputed)."""
    dims = AttentionDims(hidden_size=32, num_heads=2, head_dim=16, max_positions=q_len, causal=True)
    q, k, v = (torch.randn(1, 2, q_len, 16, requires_grad=True) for _ in range(3))
    positions = torch.arange(q_len)[None]
    inputs = {"backend": path, "query_positions": positions, "key_positions": positions, "position": {}}
    visible = None if path == "sdpa" else torch.ones(q_len, q_len, dtype=torch.bool).tril()[None, None]
    inputs.update(build_dense_mask(visible, None, torch.float32, keep_boolean=path == "sdpa"))
    encoding = POSITION_ENCODINGS["none"]({"type": "none"}, dims)
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out, _ = positional_attention(
            q, k, v, inputs, encoding, stick_breaking(max_positions=q_len), None,
            scaling=0.25, dropout=0.0, training=True, causal=True,
        )  # fmt: skip
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    return max(sizes, default=0)


def test_chunked_path_keeps_no_query_by_key_tensor_for_the_backward(monkeypatch):
    q_len = 256
    monkeypatch.setattr(relative_tables, "CHUNK_ELEMENTS", 2 * 16 * q_len)  # 16 queries a chunk
    assert largest_tensor_saved_for_backward("eager", q_len) >= 2 * q_len * q_len  # the (heads, q, k) weights
    assert largest_tensor_saved_for_backward("sdpa", q_len) <= 2 * q_len * 16  # q, k, v and chunk outputs only


def test_chunked_path_with_attention_dropout_recomputes_the_same_mask():
    """Training with attention dropout: one chunk draws the same dropout mask as eager (same RNG state, same shape),
    and the checkpoint's recompute in the backward restores that state, so the loss and every gradient equal eager's
    (a recompute with another mask would give gradients of another forward)."""
    ids = random_ids(2, 9)
    results = {}
    for attn in ("eager", "sdpa"):
        model = make_model("gpt2", "t5", "stick_breaking", attn=attn, attn_pdrop=0.3).train()
        torch.manual_seed(5)
        loss = model(ids, labels=ids).loss
        torch.manual_seed(6)  # the backward must not depend on the RNG state after the forward
        loss.backward()
        results[attn] = loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(results["sdpa"][0], results["eager"][0], atol=1e-6, rtol=1e-6)
    for name, grad in results["eager"][1].items():
        torch.testing.assert_close(results["sdpa"][1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_request_but_eager_runs_the_chunked_path(device):
    """No kernel computes stick-breaking: the default and a flex request run its chunked ``sdpa`` path on CPU and on
    CUDA (routing only: no GPU needed), trained with a learned bias or not; ``output_attentions`` needs eager."""
    normalizer = resolve_attention_normalizer("stick_breaking", causal=True)
    for scheme in ("none", "t5"):
        spec = hf_posenc.PosEncGPT2Config(position_encoding=scheme).position_encoding
        for requested in (None, "sdpa", "flex_attention"):
            for needs_grad in (False, True):
                backend = choose_backend(
                    requested, spec, normalizer, torch.device(device), position_bias_needs_grad=needs_grad
                )
                assert backend == "sdpa", (scheme, requested, needs_grad)
        assert choose_backend("eager", spec, normalizer, torch.device(device)) == "eager"
        assert choose_backend(None, spec, normalizer, torch.device(device), need_weights=True) == "eager"


def attention_of(model, family: str, layer: int) -> torch.nn.Module:
    """The module around ``positional_attention`` of a layer: GPT-2's attention (output projection included) or
    BERT's self-attention (the context, before ``output.dense``)."""
    if family == "gpt2":
        return model.transformer.h[layer].attn
    return model.bert.encoder.layer[layer].attention.self


def projections(attention, family: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``(weight (out, in), bias)`` of q, k, v and the output projection (BERT's self-attention has none: identity)."""
    if family == "gpt2":
        weight, bias = attention.c_attn.weight.T, attention.c_attn.bias
        parts = {name: (weight[i * HIDDEN : (i + 1) * HIDDEN], bias[i * HIDDEN : (i + 1) * HIDDEN])
                 for i, name in enumerate("qkv")}  # fmt: skip
        return {**parts, "o": (attention.c_proj.weight.T, attention.c_proj.bias)}
    parts = {name: (getattr(attention, long).weight, getattr(attention, long).bias)
             for name, long in zip("qkv", ("query", "key", "value"), strict=True)}  # fmt: skip
    return {**parts, "o": (torch.eye(HIDDEN), torch.zeros(HIDDEN))}


def run_capturing(model, family: str, layer: int, ids, attention_mask, **kwargs):
    """The layer's attention input and output (and weights, with ``output_attentions``) in a forward of the model."""
    captured = {}

    def hook(module, args, kwargs_, output):
        captured.update(x=args[0], y=output[0], weights=output[1])

    handle = attention_of(model, family, layer).register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids, attention_mask=attention_mask, **kwargs)
    finally:
        handle.remove()
    return captured


def visible_keys(attention_mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """``(batch, q, k)``: key j visible from query i."""
    n = attention_mask.shape[1]
    visible = attention_mask.bool()[:, None, :].expand(-1, n, n)
    return visible & torch.ones(n, n, dtype=torch.bool).tril() if causal else visible


def padded_batch():
    ids = random_ids(2, 7, seed=3)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 5:] = 0
    return ids, attention_mask


# --- gated attention --------------------------------------------------------------------------------------------


def hand_gated_attention(x, weights, gate_weight, visible, headwise: bool, norm_weight=None) -> torch.Tensor:
    """Softmax attention with ``Y * sigmoid(X W_g)`` per head by loops over rows, heads and keys, in float64:
    ``x`` ``(batch, n, hidden)``, ``visible`` ``(batch, n, n)``; with ``norm_weight`` ``(heads * head_dim,)`` each
    head's output first becomes ``y / sqrt(mean(y^2) + 1e-6) * w_h`` (FoX-Pro's output norm); the output projection's
    result."""
    x = x.double()
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = ((w.double(), b.double()) for w, b in weights.values())
    q, k, v = (x @ w.T + b for w, b in ((wq, bq), (wk, bk), (wv, bv)))
    gates = torch.sigmoid(x @ gate_weight.double().T)
    batch, n, _ = x.shape
    y = torch.zeros(batch, n, HIDDEN, dtype=torch.float64)
    for b in range(batch):
        for i in range(n):
            for h in range(HEADS):
                head = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
                keys = [j for j in range(n) if visible[b, i, j]]
                scores = torch.stack([q[b, i, head] @ k[b, j, head] / math.sqrt(HEAD_DIM) for j in keys])
                weights_ = torch.softmax(scores, dim=0)
                out = sum(a * v[b, j, head] for a, j in zip(weights_, keys, strict=True))
                if norm_weight is not None:
                    out = out / torch.sqrt((out**2).sum() / HEAD_DIM + 1e-6)
                    out = out * norm_weight[head].double()
                y[b, i, head] = out * (gates[b, i, h] if headwise else gates[b, i, head])
    return y @ wo.T + bo


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_output_gate_equals_a_hand_loop_of_gated_attention(family, gate, attn):
    model = make_model(family, "learned", {"type": "softmax", "output_gate": gate}, attn=attn)
    ids, attention_mask = padded_batch()
    captured = run_capturing(model, family, 1, ids, attention_mask)
    attention = attention_of(model, family, 1)
    gate_weight = attention.normalizer.output_gate.weight
    assert gate_weight.shape == (HEADS * HEAD_DIM if gate == "elementwise" else HEADS, HIDDEN)
    expected = hand_gated_attention(
        captured["x"], projections(attention, family), gate_weight, visible_keys(attention_mask, family == "gpt2"),
        headwise=gate == "headwise",
    )  # fmt: skip
    torch.testing.assert_close(captured["y"].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_output_norm_then_gate_equals_a_hand_loop(family, attn):
    """FoX-Pro's output: each head's output RMS-normalised with its own scale per feature (here drawn, not 1), then
    gated, then projected; loops in float64."""
    spec = {"type": "softmax", "output_norm": True, "output_gate": "elementwise"}
    model = make_model(family, "learned", spec, attn=attn)
    attention = attention_of(model, family, 1)
    norm_weight = attention.normalizer.output_norm
    assert norm_weight.shape == (HEADS * HEAD_DIM,) and torch.equal(norm_weight, torch.ones(HEADS * HEAD_DIM))
    with torch.no_grad():
        norm_weight.copy_(torch.linspace(0.5, 2.0, HEADS * HEAD_DIM))
    ids, attention_mask = padded_batch()
    captured = run_capturing(model, family, 1, ids, attention_mask)
    expected = hand_gated_attention(
        captured["x"], projections(attention, family), attention.normalizer.output_gate.weight,
        visible_keys(attention_mask, family == "gpt2"), headwise=False, norm_weight=norm_weight.detach(),
    )  # fmt: skip
    torch.testing.assert_close(captured["y"].double(), expected, atol=1e-5, rtol=1e-5)


def test_output_gate_starts_as_qwen3_next_q_proj_and_has_no_bias():
    """Qwen3-Next holds the gate in ``q_proj`` (no bias, ``N(0, initializer_range)``): the separate projection starts
    the same."""
    config = make_config("gpt2", "learned", {"type": "softmax", "output_gate": "elementwise"}, n_embd=128)
    model = hf_posenc.PosEncGPT2Model(config)
    gate = model.h[0].attn.normalizer.output_gate
    assert gate.bias is None
    assert gate.weight.mean().abs() < 0.02
    assert abs(gate.weight.std().item() - config.initializer_range) < 0.02


def test_output_gate_refuses_an_unknown_kind_naming_the_choices():
    with pytest.raises(ValueError, match=r"output_gate'='channelwise'.*\"elementwise\" or \"headwise\""):
        hf_posenc.PosEncGPT2Config(attention_normalizer={"type": "l2", "output_gate": "channelwise"})


# --- differential attention -------------------------------------------------------------------------------------


def diffllama_attention(layer_idx: int, num_key_value_heads: int = HEADS) -> DiffLlamaAttention:
    config = stock_attention_config(
        DiffLlamaConfig, num_key_value_heads=num_key_value_heads, attention_dropout=0.0, rms_norm_eps=1e-5
    )
    return DiffLlamaAttention(config, layer_idx=layer_idx).eval()


def copy_lambdas(reference: DiffLlamaAttention, normalizer) -> None:
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        getattr(reference, name).data.copy_(getattr(normalizer, name))


def diffllama_output(reference: DiffLlamaAttention, x: torch.Tensor, visible: torch.Tensor | None):
    """DiffLlama's attention output and its (first call's) softmax weights, with identity rotary embeddings."""
    batch, n, _ = x.shape
    cos, sin = torch.ones(batch, n, HEAD_DIM), torch.zeros(batch, n, HEAD_DIM)
    mask = None
    if visible is not None:
        mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)[:, None]
    with torch.no_grad():
        return reference(hidden_states=x, position_embeddings=(cos, sin), attention_mask=mask)


def diffllama_lambda(reference: DiffLlamaAttention) -> torch.Tensor:
    first = torch.exp((reference.lambda_q1 * reference.lambda_k1).sum())
    second = torch.exp((reference.lambda_q2 * reference.lambda_k2).sum())
    return first - second + lambda_init_fn(reference.layer_idx)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_differential_equals_diffllama_attention_on_the_same_weights(family, attn):
    model = make_model(family, "learned", "differential", attn=attn)
    ids, attention_mask = padded_batch()
    captured = run_capturing(model, family, 1, ids, attention_mask, output_attentions=attn == "eager")
    attention = attention_of(model, family, 1)
    reference = diffllama_attention(layer_idx=1)
    with torch.no_grad():
        for name, (weight, bias) in projections(attention, family).items():
            getattr(reference, f"{name}_proj").weight.copy_(weight)
            getattr(reference, f"{name}_proj").bias.copy_(bias)
    copy_lambdas(reference, attention.normalizer)
    visible = visible_keys(attention_mask, family == "gpt2")
    expected, softmax_weights = diffllama_output(reference, captured["x"], visible)
    torch.testing.assert_close(captured["y"], expected, atol=1e-5, rtol=1e-5)
    if attn == "eager":  # output_attentions: A1 - lambda A2 per pair of heads
        first, second = softmax_weights.chunk(2, dim=1)
        differential = first - diffllama_lambda(reference) * second
        torch.testing.assert_close(captured["weights"], differential, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_differential_with_grouped_query_heads_equals_diffllama(backend):
    """Two key/value heads for four query heads: the value halves split as diffllama splits them."""
    torch.manual_seed(0)
    reference = diffllama_attention(layer_idx=2, num_key_value_heads=2)
    with torch.no_grad():
        reference.o_proj.weight.copy_(torch.eye(HIDDEN))
        reference.o_proj.bias.zero_()
    dims = AttentionDims(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, max_positions=16, causal=False)
    spec = resolve_attention_normalizer("differential")
    normalizer = ATTENTION_NORMALIZERS["differential"](spec, dims, layer_idx=2)
    copy_lambdas(reference, normalizer)
    x = torch.randn(2, 6, HIDDEN)
    q, k, v = (
        getattr(reference, f"{name}_proj")(x).view(2, 6, -1, HEAD_DIM).transpose(1, 2).detach() for name in "qkv"
    )
    encoding = POSITION_ENCODINGS["none"](hf_posenc.PosEncBertConfig(position_encoding="none").position_encoding, dims)
    positions = torch.arange(6)[None]
    inputs = {"backend": backend, "query_positions": positions, "key_positions": positions, "position": {}}
    inputs.update(build_dense_mask(None, None, torch.float32, keep_boolean=backend == "sdpa"))
    with torch.no_grad():
        output, _ = positional_attention(
            q, k, v, inputs, encoding, normalizer, None, scaling=HEAD_DIM**-0.5, dropout=0.0, training=False,
            causal=False,
        )  # fmt: skip
    expected, _ = diffllama_output(reference, x, None)
    torch.testing.assert_close(output.reshape(2, 6, HIDDEN), expected, atol=1e-5, rtol=1e-5)


def test_differential_lambda_init_and_parameters_start_as_diffllama():
    model = make_model("gpt2", "learned", "differential", n_layer=3, n_embd=64)
    for layer_idx, block in enumerate(model.transformer.h):
        normalizer = block.attn.normalizer
        assert normalizer.lambda_init == lambda_init_fn(layer_idx)
    values = torch.cat([p.detach() for n, p in model.named_parameters() if ".lambda_" in n])
    assert values.numel() == 3 * 4 * 16
    assert abs(values.std().item() - 0.1) < 0.03  # diffllama's lambda_std_dev


def test_differential_needs_an_even_number_of_heads():
    with pytest.raises(ValueError, match="num_attention_heads must be even, got 3"):
        make_model("gpt2", "learned", "differential", n_embd=24, n_head=3)


@pytest.mark.parametrize(("family", "heads"), [("bert", {"num_attention_heads": 3}), ("gpt2", {"n_head": 3})])
def test_differential_with_an_odd_number_of_heads_is_refused_when_the_config_is_built(family, heads):
    config_class = hf_posenc.PosEncBertConfig if family == "bert" else hf_posenc.PosEncGPT2Config
    with pytest.raises(ValueError, match="'differential' pairs the attention heads: num_attention_heads must be even"):
        config_class(attention_normalizer="differential", **heads)
    config_class(attention_normalizer="softmax", **heads)  # the other normalizers take any number of heads


def test_differential_trains_with_attention_dropout_on_eager_where_both_halves_share_the_mask():
    spec = resolve_attention_normalizer("differential")
    position = hf_posenc.PosEncGPT2Config().position_encoding
    assert choose_backend("sdpa", position, spec, CPU) == "sdpa"
    assert choose_backend("sdpa", position, spec, CPU, attention_dropout=True) == "eager"


@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_differential_with_shaws_value_term_gives_eager_numbers_on_every_backend(family, attn, uncompiled_flex):
    """The value term added to each value half; flex with uncompiled FlexAttention standing in for the kernel (it
    returns the log-sum-exp on CPU), as ``test_flex_path_of_every_combination_equals_eager``."""
    calls = uncompiled_flex
    ids, attention_mask = padded_batch()
    logits = {}
    for backend in ("eager", attn):
        model = make_model(family, "shaw", "differential", attn=backend)
        with torch.no_grad():
            logits[backend] = model(ids, attention_mask=attention_mask).logits
    assert bool(calls) == (attn == "flex_attention")
    visible = attention_mask.bool()
    torch.testing.assert_close(logits[attn][visible], logits["eager"][visible], atol=1e-5, rtol=1e-4)
