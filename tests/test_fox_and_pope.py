"""FoX (forget-gate bias) and PoPE (polar coordinate position embeddings), each against a hand loop of its paper's
formula; the shared properties (padding, caches, backends, save/load, compile) run them through the registry."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_flex_training_step_equals_eager, cache_of, make_config, make_model, random_ids, with_cache
from torch.nn import functional as F

import hf_posenc
from hf_posenc import posenc_attention
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import AttentionDims


def test_fox_attention_weights_equal_the_forget_gate_loop():
    """Lin et al. 2025, eqs. (5)-(7): ``f_l = sigmoid(w_h . x_l + b_h)`` from the layer's input, ``a_ij`` the softmax
    over ``j <= i`` of ``q_i . k_j / sqrt(d) + sum_{l=j+1..i} log f_l``, in float64 loops."""
    model = make_model("gpt2", "fox", n_layer=1, attn="eager").double()
    ids = random_ids(1, 6)
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions[0][0]
        block = model.transformer.h[0]
        x = block.ln_1(model.transformer.wte(ids))[0]
        query, key, _ = block.attn.c_attn(x).split(32, dim=-1)
        gate = block.attn.position_term.forget_gate.requires_grad_(False)
    heads, head_dim, n = 4, 8, 6
    expected = torch.zeros(heads, n, n, dtype=torch.float64)
    for h in range(heads):
        forget = [torch.sigmoid(gate.weight[h] @ x[t] + gate.bias[h]) for t in range(n)]
        for i in range(n):
            scores = []
            for j in range(i + 1):
                dot = query[i, h * head_dim : (h + 1) * head_dim] @ key[j, h * head_dim : (h + 1) * head_dim]
                decay = sum(math.log(forget[t]) for t in range(j + 1, i + 1))
                scores.append(dot / math.sqrt(head_dim) + decay)
            expected[h, i, : i + 1] = torch.softmax(torch.stack(scores), dim=0)
    torch.testing.assert_close(weights, expected, atol=1e-10, rtol=0)


def test_fox_gates_start_as_the_reference_initialises_them():
    """The reference's ``fgate_proj``: ``nn.Linear(hidden, heads)``, weight ``N(0, initializer_range)``, bias 0."""
    torch.manual_seed(0)
    config = make_config("gpt2", "fox", n_embd=256, n_head=8, initializer_range=0.02)
    model = hf_posenc.PosEncGPT2Model(config)
    gate = model.h[1].attn.position_term.forget_gate
    assert gate.weight.shape == (8, 256)
    assert torch.equal(gate.bias, torch.zeros(8))
    assert abs(gate.weight.std().item() - 0.02) < 0.002


def test_fox_keeps_each_layers_gates_with_the_cache():
    """The cached keys' log gates are kept per layer (extra cache layers after the positions): a second chunk's bias
    reads them, so chunked forwards equal one forward only if each layer's own gates come back."""
    model = make_model("gpt2", "fox", attn="eager")
    ids = random_ids(1, 9)
    with torch.no_grad():
        first = model(ids[:, :5], use_cache=True)
        cache = cache_of(first)
        logits = model(ids[:, 5:], **with_cache(cache)).logits
        full = model(ids).logits
    # attention layers, key positions (full layers; the sliding layers' slot unused), one log-gate slot per layer
    assert len(cache.layers) == 2 + 2 + 2
    stored = [cache.layers[4 + layer].keys[0, 0] for layer in range(2)]  # (kv_len, heads)
    assert stored[0].shape == (9, 4) and not torch.allclose(stored[0], stored[1])
    assert (stored[0] < 0).all()
    torch.testing.assert_close(logits, full[:, 5:], atol=1e-5, rtol=1e-4)


def test_fox_in_an_encoder_config_says_why_it_is_refused():
    with pytest.raises(ValueError, match="'fox' has no encoder form: its bias sums the forget gates"):
        make_config("bert", "fox")
    assert make_config("bert", "fox", is_decoder=True).position_encoding == {"type": "fox"}


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


def test_fox_flex_runs_sdpa_on_cpu_with_the_reason_and_flex_on_cuda(caplog):
    """Compiled CPU FlexAttention (torch 2.13) cannot recompile FoX's score_mod at a second length; CUDA runs it."""
    config = make_config("gpt2", "fox")
    spec, softmax = config.position_encoding, config.attention_normalizer
    with torch.no_grad(), caplog.at_level("INFO", logger="hf_posenc"):
        cpu = posenc_attention.choose_backend("flex_attention", spec, softmax, torch.device("cpu"), head_dim=32)
        cuda = posenc_attention.choose_backend("flex_attention", spec, softmax, torch.device("cuda"), head_dim=32)
    assert (cpu, cuda) == ("sdpa", "flex_attention")
    assert "emits C++ that does not compile for this scheme's score_mod" in caplog.text


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
