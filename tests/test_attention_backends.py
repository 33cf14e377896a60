"""Which backend runs each combination, and the shared attention against a hand-written reference."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import transformers
from conftest import (
    COMBOS,
    assert_flex_training_step_equals_eager,
    combos_in_turn_by_family,
    make_config,
    make_model,
    random_ids,
    with_cache,
)
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import flex_attention

from hf_posenc import attention_backends
from hf_posenc.attention_backends import build_dense_mask, choose_backend, flex_attend, position_bias_needs_grad
from hf_posenc.attention_normalizers import ATTENTION_NORMALIZERS
from hf_posenc.configuration_posenc import layer_position_specs, resolve_attention_normalizer
from hf_posenc.posenc_attention import positional_attention
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import AttentionDims


DIMS = AttentionDims(hidden_size=8, num_heads=2, head_dim=4, max_positions=16, causal=True)
CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # choose_backend is pure logic: CUDA rules are tested without a GPU
FUSED_NORMALIZERS = ["l2", "exp", "relu2", "swish_l2"]


def spec(name):
    return {"type": name, **{k: o.default for k, o in POSITION_ENCODINGS[name].options.items()}}


def scheme(name):
    return POSITION_ENCODINGS[name](spec(name), DIMS)


SOFTMAX, L2 = resolve_attention_normalizer("softmax"), resolve_attention_normalizer("l2")


def attention_inputs(encoding, query_positions, key_positions, backend, visible, dtype):
    """What a model builds once per forward (``prepare_attention``), for a bare scheme."""
    tables = encoding.prepare(query_positions, key_positions, backend)
    inputs = {"backend": backend, "query_positions": query_positions, "key_positions": key_positions}
    inputs.update(build_dense_mask(visible, tables.pop("score_bias", None), dtype, keep_boolean=backend == "sdpa"))
    return {**inputs, "position": tables}


@pytest.mark.parametrize("name", ["learned", "sinusoidal", "none", "rope", "t5", "alibi"])
def test_softmax_runs_where_it_is_asked(name):
    encoding = spec(name)
    for backend in ("eager", "sdpa"):
        assert choose_backend(backend, encoding, SOFTMAX, CPU) == backend
    with torch.no_grad():
        assert choose_backend("flex_attention", encoding, SOFTMAX, CPU) == "flex_attention"


def test_fallbacks():
    t5, softmax, l2 = spec("t5"), SOFTMAX, L2
    assert choose_backend("sdpa", t5, l2, CPU) == "eager"  # SDPA returns no log-sum-exp for l2
    with torch.no_grad():
        assert choose_backend("flex_attention", t5, l2, CPU) == "eager"  # nor does compiled flex on CPU
        assert choose_backend("flex_attention", t5, softmax, CPU, attention_dropout=True) == "sdpa"
        assert choose_backend("flex_attention", t5, softmax, CPU, query_length=1) == "sdpa"  # decoding step
    assert choose_backend("flex_attention", t5, softmax, CPU) == "sdpa"  # CPU flex cannot backpropagate
    assert choose_backend("sdpa", t5, softmax, CPU, need_weights=True) == "eager"
    assert choose_backend(None, t5, softmax, CPU) == "sdpa"
    with torch.no_grad():  # CPU FlexAttention takes float32, float16, bfloat16
        assert choose_backend("flex_attention", t5, softmax, CPU, torch.float64) == "sdpa"
        assert choose_backend("flex_attention", t5, softmax, CPU, torch.bfloat16) == "flex_attention"


def test_cuda_rule_table_runs_each_combination_on_its_fastest_exact_backend():
    """On CUDA a request for SDPA (or none) runs flex for the normalizers SDPA cannot compute and for a position-only
    bias that needs gradients; a fixed bias stays on SDPA; what flex cannot take falls back as on any device."""
    t5, alibi, shaw = spec("t5"), spec("alibi"), spec("shaw")
    gated_l2 = resolve_attention_normalizer({"type": "l2", "toeplitz_gate": True})
    for requested in ("sdpa", None):
        assert choose_backend(requested, t5, SOFTMAX, CUDA) == "sdpa"  # inference: the bias is a constant
        assert choose_backend(requested, t5, SOFTMAX, CUDA, position_bias_needs_grad=True) == "flex_attention"
        assert choose_backend(requested, alibi, SOFTMAX, CUDA) == "sdpa"
        trained_with_dropout = dict(position_bias_needs_grad=True, attention_dropout=True)
        assert choose_backend(requested, t5, SOFTMAX, CUDA, **trained_with_dropout) == "sdpa"
        for name in FUSED_NORMALIZERS:
            normalizer_spec = resolve_attention_normalizer(name)
            assert choose_backend(requested, t5, normalizer_spec, CUDA) == "flex_attention"
            assert choose_backend(requested, alibi, normalizer_spec, CUDA) == "flex_attention"
            assert choose_backend(requested, t5, normalizer_spec, CUDA, attention_dropout=True) == "eager"
            assert choose_backend(requested, t5, normalizer_spec, CUDA, need_weights=True) == "eager"
            assert choose_backend(requested, t5, normalizer_spec, CUDA, query_length=1) == "eager"
            assert choose_backend(requested, shaw, normalizer_spec, CUDA) == "eager"  # its value term needs softmax
        assert choose_backend(requested, t5, gated_l2, CUDA) == "eager"  # the gate needs the weights
    assert choose_backend("eager", t5, L2, CUDA) == "eager"
    assert choose_backend("eager", t5, SOFTMAX, CUDA, position_bias_needs_grad=True) == "eager"
    assert choose_backend("flex_attention", alibi, SOFTMAX, CUDA) == "flex_attention"


def test_a_value_term_runs_flex_on_consecutive_positions_with_softmax_only(caplog):
    """Shaw's value term on FlexAttention is read from a band of scores and the log-sum-exp: a flex request runs it on
    the model's default positions (no cached key) with softmax; other positions run SDPA, with the reason logged,
    other normalizers eager. Without the value term Shaw runs flex on any positions. On CUDA the default (SDPA
    requested) runs it on flex too (a layer term's score_mod), on CPU SDPA."""
    shaw, without_value = spec("shaw"), {**spec("shaw"), "use_value": False}
    attention_backends._log.cache_clear()
    with caplog.at_level("INFO", logger="hf_posenc"):
        assert choose_backend("flex_attention", shaw, SOFTMAX, CUDA, consecutive=True) == "flex_attention"
        assert choose_backend("flex_attention", shaw, SOFTMAX, CUDA) == "sdpa"
    assert "the value term on FlexAttention needs the model's default positions" in caplog.text
    assert choose_backend("flex_attention", without_value, SOFTMAX, CUDA) == "flex_attention"
    assert choose_backend("flex_attention", shaw, L2, CUDA, consecutive=True) == "eager"
    assert choose_backend("sdpa", shaw, SOFTMAX, CUDA, consecutive=True) == "flex_attention"  # the CUDA default
    assert choose_backend("sdpa", shaw, SOFTMAX, CPU, consecutive=True) == "sdpa"


def test_cpu_keeps_sdpa_for_a_trainable_bias_and_eager_for_the_fused_normalizers():
    t5 = spec("t5")
    assert choose_backend("sdpa", t5, SOFTMAX, CPU, position_bias_needs_grad=True) == "sdpa"
    for name in FUSED_NORMALIZERS:
        assert choose_backend("sdpa", t5, resolve_attention_normalizer(name), CPU) == "eager"
        with torch.no_grad():
            assert choose_backend("flex_attention", t5, resolve_attention_normalizer(name), CPU) == "eager"


@pytest.mark.parametrize("name", ["t5", "kerple", "fire"])
def test_a_trainable_position_bias_needs_grad_only_while_gradients_are_on(name):
    encoding = scheme(name)
    assert position_bias_needs_grad(encoding)
    with torch.no_grad():
        assert not position_bias_needs_grad(encoding)
    encoding.requires_grad_(False)  # frozen (PEFT): the bias is a constant
    assert not position_bias_needs_grad(encoding)


@pytest.mark.parametrize("name", ["alibi", "learned", "rope"])
def test_a_fixed_bias_or_no_score_bias_never_needs_grad(name):
    assert not position_bias_needs_grad(scheme(name))


def test_flex_on_cpu_is_refused_below_head_dim_24_with_the_reason_logged(caplog):
    """Compiled CPU FlexAttention (torch 2.13) is wrong for head_dim 8 and 16 with 8 mod 16 keys (AVX2)."""
    attention_backends._log.cache_clear()
    t5 = spec("t5")
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="hf_posenc"):
        assert choose_backend("flex_attention", t5, SOFTMAX, CPU, head_dim=8) == "sdpa"
        assert choose_backend("flex_attention", t5, SOFTMAX, CPU, head_dim=16) == "sdpa"
        assert choose_backend("flex_attention", t5, SOFTMAX, CPU, head_dim=24) == "flex_attention"
        assert choose_backend("flex_attention", t5, SOFTMAX, CUDA, head_dim=16) == "flex_attention"
    assert "wrong numbers for head_dim 8 < 24" in caplog.text and "head_dim 16 < 24" in caplog.text


def test_flex_request_with_head_dim_8_on_cpu_gives_eager_numbers(family, caplog):
    """A PosEnc model with 4 heads of 8 and 8 tokens: the compiled CPU kernel gave NaN here; now SDPA runs it."""
    attention_backends._log.cache_clear()
    ids = random_ids(2, 8)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 6:] = 0
    outputs = {}
    with caplog.at_level(logging.INFO, logger="hf_posenc"):
        for attn in ("eager", "flex_attention"):
            model = make_model(family, "t5", attn=attn)  # hidden 32, 4 heads: head_dim 8
            with torch.no_grad():
                outputs[attn] = model(ids, attention_mask=attention_mask).logits
    assert "wrong numbers for head_dim 8" in caplog.text
    assert torch.isfinite(outputs["flex_attention"]).all()
    visible = attention_mask.bool()
    torch.testing.assert_close(outputs["flex_attention"][visible], outputs["eager"][visible], atol=1e-5, rtol=1e-4)


# Each combination in one family, the encoder and the decoder in turn (every scheme once, every normalizer with an
# absolute and a relative scheme): the score_mod and flex_output are the scheme's and the normalizer's, the
# BlockMask's causal and padding parts run in both families with a spread of schemes.
@pytest.mark.parametrize(("family", "scheme", "normalizer"), combos_in_turn_by_family(COMBOS))
def test_flex_path_of_every_combination_equals_eager(family, scheme, normalizer, uncompiled_flex):
    """The flex path (the scheme's score_mod, the normalizer's flex_output, the BlockMask) of every combination,
    with uncompiled FlexAttention standing in for the compiled kernel (same semantics, no compile per combination,
    any head width; it returns the log-sum-exp on CPU); combinations flex cannot express fall back. The compiled
    CPU kernel is checked by the tests below on heads of 32."""
    calls = uncompiled_flex
    ids = random_ids(2, 10)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 7:] = 0
    outputs = {}
    for attn in ("eager", "flex_attention"):
        model = make_model(family, scheme, normalizer, attn=attn)
        with torch.no_grad():
            outputs[attn] = model(ids, attention_mask=attention_mask).logits
    specs = layer_position_specs(model.config.position_encoding, model.config.num_hidden_layers)
    normalizer_spec = model.config.attention_normalizer
    runs_flex = any("flex_attention" in POSITION_ENCODINGS[spec["type"]].supported_backends(spec) for spec in specs)
    runs_flex &= "flex_attention" in ATTENTION_NORMALIZERS[normalizer_spec["type"]].supported_backends(normalizer_spec)
    assert bool(calls) == runs_flex
    visible = attention_mask.bool()
    torch.testing.assert_close(outputs["flex_attention"][visible], outputs["eager"][visible], atol=1e-5, rtol=1e-4)


# (family, scheme, normalizer): every kind of table a score_mod captures once, and every normalizer FlexAttention
# runs once, paired with those schemes (a compile per case: not their cross product)
COMPILED_FLEX_CASES = [
    ("gpt2", "kerple", "exp"),
    # fire on default positions: its tables per distance, position and query (spread_tables; given positions train
    # on SDPA, flex_gradient_refusal); CPU flex reads the per-pair formula, so the test asks for the CUDA tables
    ("bert", {"type": "fire", "threshold": 4.0}, "softmax"),
    ("gpt2", "fire", "softmax"),
    ("bert", "tupe", "relu2"),
    # Shaw's value term: band, log-sum-exp and the encoder's tail pass; causal
    ("bert", {"type": "shaw", "max_distance": 3}, "softmax"),
    ("gpt2", {"type": "shaw", "table": "sinusoidal", "max_distance": 2}, "softmax"),
    ("bert", "xlnet", "l2"),
    ("bert", {"type": "deberta", "position_buckets": 8, "max_relative_positions": 16}, "softmax"),
    (
        "gpt2",
        {"type": "deberta", "share_att_key": False, "position_buckets": 4, "max_relative_positions": 8},
        "softmax",
    ),
    ("bert", {"type": "relative_key", "max_positions": 12}, "sigmoid"),
    ("gpt2", "fox", "softpick"),  # two per-token tables of the layer's forget gates
    ("gpt2", "t5", "swish_l2"),
    ("gpt2", "t5", "ssmax"),  # s_h log n_i as a per-query table read in the score_mod
    ("bert", "rope", "ssmax"),  # no score_mod: s_h log n_i folded into q
    ("bert", "t5", {"type": "softmax", "sink": "learned"}),
]


@pytest.mark.parametrize(("family", "spec", "normalizer"), COMPILED_FLEX_CASES)
def test_flex_gradients_through_the_compiled_operator_equal_eager(family, spec, normalizer, flex_trained_on_cpu):
    """A training step with FlexAttention compiled on ``aot_eager`` (``flex_trained_on_cpu``: the operator traced as
    for the CUDA kernel, its CPU reference backward): loss and every parameter's gradient against eager, with the
    gradients of the score_mod's captured tables and of the log-sum-exp, which the normalizers other than softmax and
    Shaw's value term read; a padded row. It caught gradients torch drops: a captured view (xlnet's ``u . k``) and
    0-d tables (FIRE's c and L) got none (``LayerPositionTerm.score_mod``'s rule)."""
    ids = random_ids(2, 10)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 7:] = 0
    models = {attn: make_model(family, spec, normalizer, attn=attn).train() for attn in ("eager", "flex_attention")}
    assert_flex_training_step_equals_eager(models, ids, attention_mask, atol=1e-5, rtol=1e-4)
    assert flex_trained_on_cpu, "the flex model ran FlexAttention"


# --- the compile cache of FlexAttention (compiled on CPU: inference only, head_dim >= 24; ~20 s a compile) ---------


def wide_head_models(family):
    """A 1-layer model with 2 heads of 32 on flex and the same weights on eager."""
    wide = dict(hidden_size=64, num_attention_heads=2) if family == "bert" else dict(n_embd=64, n_head=2)
    layers = dict(num_hidden_layers=1) if family == "bert" else dict(n_layer=1)
    flex = make_model(family, "t5", attn="flex_attention", **wide, **layers)
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    eager = auto.from_config(copy.deepcopy(make_config(family, "t5", **wide, **layers)), attn_implementation="eager")
    eager.load_state_dict(flex.state_dict())
    return flex, eager.eval()


@pytest.mark.skipif(
    not attention_backends.FLEX_CPU_COMPILES_SYMBOLIC_SIZES,
    reason="this torch's CPU FlexAttention cannot compile symbolic sizes: every length compiles a static kernel "
    "(test_without_symbolic_cpu_kernels_each_new_length_compiles_a_static_one)",
)
def test_new_sequence_lengths_reuse_the_compiled_flex_attention():
    """Ten lengths (more than torch's recompile limit of 8): compiled for the first, once more with symbolic sizes
    for the second, then reused; never the unfused path; every output equals eager. Before the compile cache
    (``dynamic=False``) every length compiled and the ninth ran unfused."""
    attention_backends.clear_flex_compile_cache()
    flex, eager = wide_head_models("bert")
    compiles = []
    for length in (9, 14, 21, 30, 37, 45, 52, 64, 71, 80):
        ids = random_ids(2, length)
        attention_mask = torch.ones_like(ids)
        attention_mask[0, length - 3 :] = 0
        before = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            output = flex.bert(ids, attention_mask=attention_mask).last_hidden_state
            expected = eager.bert(ids, attention_mask=attention_mask).last_hidden_state
        compiles.append(counters["stats"]["unique_graphs"] - before)
        visible = attention_mask.bool()
        torch.testing.assert_close(output[visible], expected[visible], atol=1e-5, rtol=1e-4)
    # The first two lengths compile FlexAttention and Transformers' compiled create_block_mask (masking_utils), fewer
    # when an earlier test already made their sizes symbolic (torch keeps that per function); later lengths nothing.
    assert sum(compiles[:2]) <= 4 and compiles[2:] == [0] * 8, compiles
    assert attention_backends._warn_unfused_flex.cache_info().currsize == 0


def test_without_symbolic_cpu_kernels_each_new_length_compiles_a_static_one(monkeypatch):
    """Where the CPU template cannot compile symbolic sizes (torch 2.11), a region's second and later shapes ask
    for static kernels on the CPU; with symbolic sizes, for the shared symbolic one."""
    requested = []

    def compiled_for(grad_enabled, region, dynamic):
        requested.append(dynamic)
        return flex_attention

    monkeypatch.setattr(attention_backends, "_compiled_flex_attention", compiled_for)
    for compiles_symbolic_sizes in (True, False):
        monkeypatch.setattr(attention_backends, "FLEX_CPU_COMPILES_SYMBOLIC_SIZES", compiles_symbolic_sizes)
        monkeypatch.setattr(attention_backends, "_FIRST_SHAPES", {})
        with torch.no_grad():
            for length in (16, 24, 32):
                q, k, v = (torch.randn(1, 2, length, 32) for _ in range(3))
                flex_attend(q, k, v, region="test")
    assert requested == [False, True, True, False, False, False]


def test_hitting_the_recompile_limit_warns_and_runs_the_unfused_path(caplog):
    """With the limit at 1, a third head width cannot compile (the first ran the region's static kernel, the second
    compiled its symbolic-size kernel, which a new head width compiles again): FlexAttention runs uncompiled, with a
    warning."""
    attention_backends.clear_flex_compile_cache()
    attention_backends._warn_unfused_flex.cache_clear()
    torch.manual_seed(0)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1), caplog.at_level(logging.WARNING):
        for head_dim in (32, 48, 64):
            q, k, v = (torch.randn(1, 2, 16, head_dim) for _ in range(3))
            output = flex_attend(q, k, v, region="test")
            expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-4)
    assert "compiled FlexAttention for test (inference) hit torch's recompile limit" in caplog.text
    assert "accumulated_recompile_limit" in caplog.text and "unfused path" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward runs on CUDA only (torch 2.13)")
def test_train_and_eval_alternating_on_cuda_never_end_on_the_unfused_path(caplog):
    """What Trainer does: training steps and evaluations alternate (grad mode on and off), lengths vary."""
    attention_backends._warn_unfused_flex.cache_clear()
    config = make_config("bert", "t5", "l2", hidden_size=128, num_attention_heads=2, num_hidden_layers=2)
    model = transformers.AutoModelForMaskedLM.from_config(config, attn_implementation="sdpa").cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with caplog.at_level(logging.WARNING):
        for step in range(24):
            ids = random_ids(4, 32 + 8 * (step % 3)).cuda()
            model.train()
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            model.eval()
            with torch.no_grad():
                assert torch.isfinite(model(ids, labels=ids).loss)
    assert "unfused path" not in caplog.text
    assert attention_backends._warn_unfused_flex.cache_info().currsize == 0


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match=r"attn_implementation 'paged' is not supported.*'flex_attention', 'sdpa'"):
        choose_backend("paged", spec("t5"), SOFTMAX, CPU)


def reference_alibi_l2_causal(q, k, v, slopes):
    """o_i = sum_{j<=i} e^{b_ij} v_j / sqrt(sum_{j<=i} e^{2 b_ij}), b_ij = q_i.k_j/sqrt(d) - m_h (i - j); loops."""
    batch, heads, n, d = q.shape
    out = torch.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            for i in range(n):
                scores = [float(q[b, h, i] @ k[b, h, j]) / math.sqrt(d) - slopes[h] * (i - j) for j in range(i + 1)]
                norm = math.sqrt(sum(math.exp(2 * s) for s in scores))
                out[b, h, i] = sum(math.exp(s) / norm * v[b, h, j] for j, s in enumerate(scores))
    return out


def test_positional_attention_matches_the_formula_with_a_cache():
    """ALiBi + l2 through the KV cache: 5 tokens, then 3 more, against the loop reference on all 8."""
    from transformers.cache_utils import DynamicCache

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    encoding, normalizer = scheme("alibi").double(), ATTENTION_NORMALIZERS["l2"](L2, DIMS)
    cache = DynamicCache()
    outputs = []
    for chunk in (slice(0, 5), slice(5, 8)):
        positions = torch.arange(chunk.start, chunk.stop)[None]
        visible = torch.ones(chunk.stop - chunk.start, chunk.stop, dtype=torch.bool).tril(chunk.start)[None, None]
        inputs = attention_inputs(encoding, positions, torch.arange(chunk.stop)[None], "eager", visible, torch.float64)
        out, _ = positional_attention(
            q[:, :, chunk],
            k[:, :, chunk],
            v[:, :, chunk],
            inputs,
            encoding,
            normalizer,
            None,
            scaling=0.5,
            dropout=0.0,
            training=False,
            causal=True,
            **with_cache(cache),
            layer_idx=0,
        )
        outputs.append(out.transpose(1, 2))
    expected = reference_alibi_l2_causal(q, k, v, [2**-4, 2**-8])
    torch.testing.assert_close(torch.cat(outputs, 2), expected)


@pytest.mark.parametrize(
    ("backend", "scheme_name", "normalizer_name"),
    [("eager", "t5", "softmax"), ("eager", "none", "softmax"), ("eager", "t5", "l2")]
    + [("sdpa", "t5", "softmax"), ("sdpa", "none", "softmax")]  # l2 never runs on sdpa
    + [("eager", "t5", name) for name in ("sigmoid", "ssmax", "softpick", {"type": "softmax", "sink": 0.5})]
    + [("sdpa", "t5", "ssmax"), ("sdpa", "none", "ssmax"), ("sdpa", "t5", {"type": "softmax", "sink": 0.5})],
)
def test_rows_without_a_visible_key_give_zero_and_others_are_unchanged(backend, scheme_name, normalizer_name):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 4) for _ in range(3))
    encoding = scheme(scheme_name)
    normalizer_spec = resolve_attention_normalizer(normalizer_name)
    normalizer = ATTENTION_NORMALIZERS[normalizer_spec["type"]](normalizer_spec, DIMS)
    positions = torch.arange(4)[None]
    visible = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    visible[..., 1, :] = False  # query 1 sees nothing
    kwargs = dict(scaling=0.5, dropout=0.0, training=False, causal=True)
    inputs = attention_inputs(encoding, positions, positions, backend, visible, torch.float32)
    out, weights = positional_attention(q, k, v, inputs, encoding, normalizer, None, **kwargs)
    assert torch.equal(out[:, 1], torch.zeros(1, 2, 4))
    if weights is not None:
        assert torch.equal(weights[..., 1, :], torch.zeros(1, 2, 4))
    causal = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    full = attention_inputs(encoding, positions, positions, "eager", causal, torch.float32)
    reference, _ = positional_attention(q, k, v, full, encoding, normalizer, None, **kwargs)
    torch.testing.assert_close(out[:, [0, 2, 3]], reference[:, [0, 2, 3]])


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_grouped_query_attention_reads_shared_heads_on_sdpa_and_equals_repeated_heads(backend, monkeypatch):
    """Grouped-query keys and values go to SDPA as they are (``enable_gqa``), not repeated per query head; eager
    repeats them. Both equal softmax attention with the heads repeated by hand."""
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    sdpa_keys = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(q, k, v, **kwargs):
        sdpa_keys.append(k.shape[1])
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    encoding = scheme("none")
    normalizer = ATTENTION_NORMALIZERS["softmax"](SOFTMAX, DIMS)
    positions = torch.arange(6)[None]
    inputs = attention_inputs(encoding, positions, positions, backend, None, torch.float32)
    output, _ = positional_attention(
        query,
        key,
        value,
        inputs,
        encoding,
        normalizer,
        None,
        scaling=8**-0.5,
        dropout=0.0,
        training=False,
        causal=False,
    )
    repeated = [t.repeat_interleave(2, dim=1) for t in (key, value)]
    expected = torch.softmax(query @ repeated[0].transpose(-1, -2) * 8**-0.5, dim=-1) @ repeated[1]
    torch.testing.assert_close(output, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)
    assert sdpa_keys == ([2] if backend == "sdpa" else [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward runs on CUDA only (torch 2.13)")
@pytest.mark.parametrize("scheme", ["fox", "pope"])
def test_fox_and_pope_compiled_on_cuda_equal_eager_values_and_grads(scheme):
    """Compiled FlexAttention on CUDA (heads of 32, a padded row): loss and every parameter's gradient against eager
    (FoX: the gates' gradients through the score_mod's two captured tables; PoPE: q, k of width 64, v of 32)."""
    ids = random_ids(2, 24).cuda()
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 20:] = 0
    models = {
        attn: make_model("gpt2", scheme, attn=attn, n_embd=64, n_head=2).cuda().train()
        for attn in ("eager", "flex_attention")
    }
    assert_flex_training_step_equals_eager(models, ids, attention_mask, atol=1e-4, rtol=1e-3)


def test_without_isolate_recompiles_each_region_keeps_its_own_recompile_budget(monkeypatch):
    """Torch before 2.13 has no ``isolate_recompiles``: each region then compiles ``flex_attention`` behind a code
    object of its own, on which dynamo counts recompiles. With the limit at 1, a second region compiling other shapes
    is its own first compilation, not a recompile of the first region's code (a shared code object would hit the
    limit and run the unfused path)."""
    monkeypatch.setattr(attention_backends, "COMPILE_ISOLATES_RECOMPILES", False)
    attention_backends.clear_flex_compile_cache()
    attention_backends._warn_unfused_flex.cache_clear()
    first = attention_backends._compiled_flex_attention(False, "first", False)
    second = attention_backends._compiled_flex_attention(False, "second", False)
    assert first._torchdynamo_orig_callable.__code__ is not second._torchdynamo_orig_callable.__code__
    torch.manual_seed(0)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
        for region, head_dim in (("first", 32), ("second", 48)):
            q, k, v = (torch.randn(1, 2, 16, head_dim) for _ in range(3))
            output = flex_attend(q, k, v, region=region)
            torch.testing.assert_close(output, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert attention_backends._warn_unfused_flex.cache_info().currsize == 0
    attention_backends.clear_flex_compile_cache()
