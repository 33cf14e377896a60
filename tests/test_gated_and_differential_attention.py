"""Gated attention (option ``output_gate``) against a hand loop on the layer's input, and the ``differential``
normalizer against Transformers' ``DiffLlamaAttention`` on the same weights; their options, init and backends."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_config, make_model, random_ids
from transformers.models.diffllama.configuration_diffllama import DiffLlamaConfig
from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention, lambda_init_fn

import hf_posenc
from hf_posenc.attention_normalizers import ATTENTION_NORMALIZERS
from hf_posenc.configuration_posenc import resolve_attention_normalizer
from hf_posenc.posenc_attention import build_dense_mask, choose_backend, positional_attention
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import AttentionDims


HIDDEN, HEADS, HEAD_DIM = 32, 4, 8
CPU = torch.device("cpu")


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


def hand_gated_attention(x, weights, gate_weight, visible, headwise: bool) -> torch.Tensor:
    """Softmax attention with ``Y * sigmoid(X W_g)`` per head by loops over rows, heads and keys, in float64:
    ``x`` ``(batch, n, hidden)``, ``visible`` ``(batch, n, n)``; the output projection's result."""
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
    config = DiffLlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=num_key_value_heads,
        head_dim=HEAD_DIM,
        attention_bias=True,
        attention_dropout=0.0,
        rms_norm_eps=1e-5,
    )
    config._attn_implementation = "eager"
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
