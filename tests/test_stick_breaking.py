"""Stick-breaking attention (Tan et al. 2025): the formula against a hand loop, its row laws, the decoder-only rule,
and its chunked ``sdpa`` path against eager (values, gradients, what it keeps for the backward)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from conftest import make_model, random_ids

import hf_posenc
from hf_posenc import relative_tables
from hf_posenc.attention_normalizers import ATTENTION_NORMALIZERS
from hf_posenc.configuration_posenc import resolve_attention_normalizer
from hf_posenc.posenc_attention import build_dense_mask, choose_backend, positional_attention
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import AttentionDims


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
def test_bfloat16_rows_of_4096_keys_are_finite_and_match_float64(path):
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
