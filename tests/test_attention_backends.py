"""Which backend runs each combination, and the shared attention against a hand-written reference."""

from __future__ import annotations

import math

import pytest
import torch

from hf_posenc.attention_normalizers import ATTENTION_NORMALIZERS
from hf_posenc.configuration_posenc import resolve_attention_normalizer
from hf_posenc.posenc_attention import build_dense_mask, choose_backend, positional_attention
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import AttentionDims


DIMS = AttentionDims(hidden_size=8, num_heads=2, head_dim=4, max_positions=16, causal=True)
CPU = torch.device("cpu")


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
            past_key_values=cache,
            layer_idx=0,
        )
        outputs.append(out.transpose(1, 2))
    expected = reference_alibi_l2_causal(q, k, v, [2**-4, 2**-8])
    torch.testing.assert_close(torch.cat(outputs, 2), expected)


@pytest.mark.parametrize(
    ("backend", "scheme_name", "normalizer_name"),
    [("eager", "t5", "softmax"), ("eager", "none", "softmax"), ("eager", "t5", "l2")]
    + [("sdpa", "t5", "softmax"), ("sdpa", "none", "softmax")],  # l2 never runs on sdpa
)
def test_rows_without_a_visible_key_give_zero_and_others_are_unchanged(backend, scheme_name, normalizer_name):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 4) for _ in range(3))
    encoding = scheme(scheme_name)
    normalizer = ATTENTION_NORMALIZERS[normalizer_name](resolve_attention_normalizer(normalizer_name), DIMS)
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
