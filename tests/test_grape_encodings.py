"""GRAPE (``grape_encodings.py``) against hand loops of its reference's modules (``model-architectures/GRAPE``,
``model/llama-mha-grape-*.py``), re-derived here on float64 tensors: GRAPE-M's rotations by learned frequencies
(``MSGRAPECommuting``) and by contextual phases (``MSGRAPEContextType1``), GRAPE-A's gated distance penalty
(``QueryKeyGatedAdditiveBias`` and its query- and key-gated forms), GRAPE-AP's gate sums; its init as the reference's;
the variants the shared properties (which run the default, ``m``) do not reach through a cache, a shift and padding."""

from __future__ import annotations

import math
import re

import pytest
import test_input_dependent_encodings as input_dependent
import torch
import transformers
from conftest import left_padded_prompt, make_config, make_model, random_ids
from test_input_dependent_encodings import layer_input, softmax_output
from torch.nn import functional as F

from hf_posenc.grape_encodings import softplus_inverse
from hf_posenc.position_encodings import POSITION_ENCODINGS


CONTEXTUAL = {"type": "grape", "contextual": True}
CONTEXTUAL_PER_HEAD = {**CONTEXTUAL, "per_head_phase": True, "share_across_heads": False}
ADDITIVE = {"type": "grape", "variant": "a"}
PATH = {"type": "grape", "variant": "ap"}
ALIBI_SLOPES_4_HEADS = [2**-2, 2**-4, 2**-6, 2**-8]  # Press et al.: 2^(-8h/H), h = 1..4


def reference_rotation(states: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """The reference's ``apply_rotary_emb`` written per pair: ``(x_m, x_(m+d/2)) -> (x_m cos + x_(m+d/2) sin,
    -x_m sin + x_(m+d/2) cos)``, ``states`` ``(n, d)``, ``angles`` ``(n, d/2)``."""
    out = torch.empty_like(states)
    half = states.shape[-1] // 2
    for t in range(states.shape[0]):
        for m in range(half):
            c, s = math.cos(angles[t, m]), math.sin(angles[t, m])
            first, second = states[t, m], states[t, m + half]
            out[t, m], out[t, m + half] = first * c + second * s, -first * s + second * c
    return out


def run_layer(spec, n=7, seed=2):
    """A float64 one-layer GPT-2 with 4 heads of 8 on ``n`` tokens: its attention weights and layer output, the
    layer's input, q, k, v (``layer_input``) and its GRAPE term."""
    model = make_model("gpt2", spec, n_layer=1, attn="eager").double()
    ids = random_ids(1, n, seed=seed)
    captured = {}
    model.transformer.h[0].attn.register_forward_hook(lambda module, args, output: captured.update(out=output[0]))
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions[0][0]
    block, x, query, key, value = layer_input(model, ids)
    return model, weights, captured["out"][0], block, x, query, key, value, block.attn.position_term


@pytest.mark.parametrize("spec", ["grape", {"type": "grape", "share_across_heads": False, "base": 100}])
def test_grape_m_equals_the_reference_rotation_by_learned_frequencies(spec):
    """``MSGRAPECommuting``: ``freq = exp(log_freq / 16)``, token ``t`` turned by ``t freq_m`` in plane ``m``; the
    scores ``q'_i . k'_j / sqrt(d)``."""
    model, weights, out, block, x, query, key, value, term = run_layer(spec)
    with torch.no_grad():
        log_freq = term.log_freq.detach().expand(4, 4) / 16
        scores = torch.zeros(4, 7, 7, dtype=torch.float64)
        for h in range(4):
            angles = torch.arange(7, dtype=torch.float64)[:, None] * torch.exp(log_freq[h])[None]
            scores[h] = reference_rotation(query[h], angles) @ reference_rotation(key[h], angles).T / math.sqrt(8)
        expected, output = softmax_output(block, scores, value)
    torch.testing.assert_close(weights, expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(out, output, atol=1e-10, rtol=0)


@pytest.mark.parametrize("spec", [CONTEXTUAL, CONTEXTUAL_PER_HEAD])
def test_contextual_grape_m_equals_the_reference_phase_loop(spec):
    """``MSGRAPEContextType1`` with the reference attention's ``_cumulative_phase``: ``w_t = sigmoid((W x_t + b) /
    16)``, ``Phi_t = sum_(s<t) w_s``, token ``t`` turned by ``Phi_t freq_m`` (``freq = exp(log_freq)``, unscaled)."""
    model, weights, out, block, x, query, key, value, term = run_layer(spec)
    with torch.no_grad():
        logits = term.phase_proj(x)  # (n, 1 or heads)
        log_freq = term.log_freq.detach().expand(4, 4)
        scores = torch.zeros(4, 7, 7, dtype=torch.float64)
        for h in range(4):
            phase, phases = 0.0, []
            for t in range(7):
                phases.append(phase)
                phase += torch.sigmoid(logits[t, h if logits.shape[-1] > 1 else 0] / 16).item()
            angles = torch.tensor(phases, dtype=torch.float64)[:, None] * torch.exp(log_freq[h])[None]
            scores[h] = reference_rotation(query[h], angles) @ reference_rotation(key[h], angles).T / math.sqrt(8)
        expected, output = softmax_output(block, scores, value)
    torch.testing.assert_close(weights, expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(out, output, atol=1e-10, rtol=0)


@pytest.mark.parametrize("gate", ["query_key", "query", "key"])
def test_grape_a_equals_the_reference_gated_distance_penalty(gate):
    """``QueryKeyGatedAdditiveBias`` (and the query- or key-gated files): ``b_ij = -(i - j) softplus(omega_h) m_h
    (softplus(v_h . q_i / sqrt(d)) + softplus(u_h . k_j / sqrt(d)))``, unit ``u``, ``v``, added to the scaled
    scores."""
    model, weights, out, block, x, query, key, value, term = run_layer({**ADDITIVE, "gate": gate})
    with torch.no_grad():
        scores = torch.zeros(4, 7, 7, dtype=torch.float64)
        for h in range(4):
            rate = F.softplus(term.omega[h]).item() * ALIBI_SLOPES_4_HEADS[h]
            for i in range(7):
                for j in range(i + 1):
                    gates = 0.0
                    if gate != "key":
                        v = term.query_direction[h] / term.query_direction[h].norm()
                        gates += F.softplus(query[h, i] @ v / math.sqrt(8)).item()
                    if gate != "query":
                        u = term.key_direction[h] / term.key_direction[h].norm()
                        gates += F.softplus(key[h, j] @ u / math.sqrt(8)).item()
                    scores[h, i, j] = query[h, i] @ key[h, j] / math.sqrt(8) - (i - j) * rate * gates
        expected, output = softmax_output(block, scores, value)
    torch.testing.assert_close(weights, expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(out, output, atol=1e-10, rtol=0)


@pytest.mark.parametrize("p_head_dim", [8, 4])
def test_grape_ap_equals_the_reference_gate_sums(p_head_dim):
    """``llama-mha-grape-ap-v1.py``: ``b_ij = m_h sum_(t=j+1..i) log sigmoid(p_i . R_t rmsnorm(p_t) / d_p)``, ``p =
    W_p x``, ``R_t`` the reference's rotation of base 1 (every pair turned by ``t``), added to the scaled scores."""
    model, weights, out, block, x, query, key, value, term = run_layer({**PATH, "p_head_dim": p_head_dim})
    with torch.no_grad():
        p = term.p_proj(x).view(7, 4, p_head_dim)
        scores = torch.zeros(4, 7, 7, dtype=torch.float64)
        for h in range(4):
            normed = p[:, h] / (p[:, h].square().mean(-1, keepdim=True) + torch.finfo(torch.float64).eps).sqrt()
            angles = torch.arange(7, dtype=torch.float64)[:, None].expand(7, p_head_dim // 2)
            rotated = reference_rotation(normed, angles)
            for i in range(7):
                for j in range(i + 1):
                    gates = sum(F.logsigmoid(p[i, h] @ rotated[t] / p_head_dim).item() for t in range(j + 1, i + 1))
                    scores[h, i, j] = query[h, i] @ key[h, j] / math.sqrt(8) + ALIBI_SLOPES_4_HEADS[h] * gates
        expected, output = softmax_output(block, scores, value)
    torch.testing.assert_close(weights, expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(out, output, atol=1e-10, rtol=0)


def test_grape_starts_as_the_reference_initialises_it():
    """``log_freq = 16 log(10000^(-2m/d))`` (non-contextual), ``log(10000^(-2m/d))`` (contextual); the phase gate's
    weight 0 and bias ``log(expm1(1e-3))``; ``softplus(omega) = 1``; ``u``, ``v`` drawn with std ``1/sqrt(d)``."""
    config = make_config("gpt2", "grape", n_embd=64, n_head=2)  # head_dim 32: 16 frequencies
    spectrum = torch.log(10000.0 ** (-torch.arange(0, 32, 2) / 32))
    term = transformers.AutoModelForCausalLM.from_config(config).transformer.h[0].attn.position_term
    torch.testing.assert_close(term.log_freq.detach(), 16 * spectrum)
    config = make_config("gpt2", CONTEXTUAL, n_embd=64, n_head=2)
    term = transformers.AutoModelForCausalLM.from_config(config).transformer.h[0].attn.position_term
    torch.testing.assert_close(term.log_freq.detach(), spectrum)
    assert torch.equal(term.phase_proj.weight, torch.zeros(1, 64))
    torch.testing.assert_close(term.phase_proj.bias, torch.tensor([math.log(math.expm1(1e-3))]))
    config = make_config("gpt2", ADDITIVE, n_embd=512, n_head=2)  # head_dim 256: 512 draws per direction
    term = transformers.AutoModelForCausalLM.from_config(config).transformer.h[0].attn.position_term
    torch.testing.assert_close(F.softplus(term.omega.detach()), torch.ones(2))
    for direction in (term.query_direction, term.key_direction):
        assert abs(direction.std().item() * math.sqrt(256) - 1) < 0.1
    assert softplus_inverse(2.0) == pytest.approx(math.log(math.e**2 - 1))


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"type": "grape", "gate": "key"}, "option 'gate'='key' has no effect with variant 'm'"),
        ({"type": "grape", "per_head_phase": True}, "with variant 'm' and contextual=False"),
        ({**ADDITIVE, "base": 500}, "variant 'a' reads ['gate', 'omega_init']"),
        ({**PATH, "p_head_dim": 5}, "'p_head_dim' must be even"),
        ({"type": "grape", "variant": "b"}, "'m', 'a' or 'ap'"),
    ],
)
def test_bad_or_unused_options_are_refused_by_name(spec, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        make_config("gpt2", spec)


def test_an_encoder_config_says_why_grape_is_refused():
    with pytest.raises(ValueError, match="'grape' has no encoder form"):
        make_config("bert", "grape")


@pytest.mark.parametrize("spec", [CONTEXTUAL_PER_HEAD, ADDITIVE, {**ADDITIVE, "gate": "key"}, PATH, ["grape", PATH]])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_variants_through_a_cache_equal_one_forward(spec, cache):
    """The variants the shared properties (run on the default, ``m``) do not reach: three forwards through a cache,
    the second prompt left-padded, equal one forward (the input-dependent schemes' test), and the padded row equals
    the row alone."""
    input_dependent.test_chunked_forwards_with_a_cache_equal_one_forward(spec, cache)
    model = make_model("gpt2", spec, attn="sdpa")
    ids, attention_mask = left_padded_prompt(9)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = model(ids, attention_mask=attention_mask, position_ids=positions).logits
        alone = model(ids[1:, 2:]).logits
    torch.testing.assert_close(padded[1, 2:], alone[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("spec", "moves"), [(CONTEXTUAL, False), (ADDITIVE, False), (PATH, True)])
def test_a_shift_moves_only_grape_ap(spec, moves):
    """``m`` and ``a`` read distances or phases (shift invariant, ``is_relative``); ``ap`` rotates each key's ``p`` by
    its position while the query's is not rotated, so a shift of every position changes it, as in the reference."""
    model = make_model("gpt2", spec)
    ids = random_ids(2, 9)
    positions = torch.arange(9)[None]
    with torch.no_grad():
        base, shifted = model(ids, position_ids=positions).logits, model(ids, position_ids=positions + 13).logits
    assert ((shifted - base).abs().max() > 1e-3) == moves
    assert POSITION_ENCODINGS["grape"].is_relative(model.config.position_encoding) != moves
