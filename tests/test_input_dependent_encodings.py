"""Schemes whose per-channel decay or rotation is computed from the layer's input (``input_dependent_encodings.py``):
Wall attention against hand loops of its formula and fla's eager oracle re-derived (``naive_wall_attn``: exponents
in base 2, a dense ``(n, n, d)`` tensor on tiny inputs), Selective RoPE against a hand loop of its reference's
rotation; the shared properties (padding, caches, backends, save/load, checkpointing, bf16, shift) run ``wall`` and
``selective_rope`` through the registry."""

from __future__ import annotations

import math
import re

import pytest
import torch
import transformers
from conftest import cache_of, make_config, make_model, random_ids, with_cache
from torch.nn import functional as F

import hf_posenc
from hf_posenc.input_dependent_encodings import WallTerm, wall_decay_term


WALL_STRONG = {"type": "wall", "gate_init_bias": 0.0}  # log sigmoid(0) = -0.69 a token: decays the tests can see
WALL_FOX = {**WALL_STRONG, "use_scalar_gate": True}
SELECTIVE_OPTIONS = {"type": "selective_rope", "skip_conv": True, "use_bias": True, "use_gate": True}
SELECTIVE_OPTIONS.update(temp_theta=100, temp_grad=True)


def layer_input(model, ids):
    """The first layer's input, q, k, v ``(heads, n, head_dim)`` of a float64 GPT-2 with 4 heads of 8."""
    block = model.transformer.h[0]
    x = block.ln_1(model.transformer.wte(ids))[0]
    query, key, value = (part.view(-1, 4, 8).transpose(0, 1) for part in block.attn.c_attn(x).split(32, dim=-1))
    return block, x, query, key, value


def softmax_output(block, scores, value):
    """Causal softmax weights of ``(heads, n, n)`` scores and the layer's output."""
    n = scores.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    weights = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
    return weights, block.attn.c_proj((weights @ value).transpose(0, 1).reshape(n, 32))


@pytest.mark.parametrize(("spec", "block_size"), [(WALL_STRONG, 64), (WALL_FOX, 64), (WALL_STRONG, 4)])
def test_wall_attention_and_output_equal_the_per_channel_decay_loop(spec, block_size, monkeypatch):
    """fla ``WallAttention``: ``s_ij = q_i . (k_j * exp(P_i - P_j)) / sqrt(d)``, ``P = cumsum(log sigmoid(g_proj x))``
    per head and channel, plus FoX's ``sum_(l=j+1..i) log f_l`` with ``use_scalar_gate``; float64 loops; queries in
    one block and in blocks of 4."""
    monkeypatch.setattr(WallTerm, "block_size", block_size)
    model = make_model("gpt2", spec, n_layer=1, attn="eager").double()
    ids = random_ids(1, 6)
    captured = {}
    model.transformer.h[0].attn.register_forward_hook(lambda module, args, output: captured.update(out=output[0]))
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions[0][0]
        block, x, query, key, value = layer_input(model, ids)
        term = block.attn.position_term
        log_decay = F.logsigmoid(term.g_proj(x)).view(6, 4, 8)  # (n, heads, channels)
        scores = torch.zeros(4, 6, 6, dtype=torch.float64)
        for h in range(4):
            for i in range(6):
                for j in range(i + 1):
                    for c in range(8):
                        decay = sum(log_decay[t, h, c] for t in range(j + 1, i + 1))
                        scores[h, i, j] += query[h, i, c] * key[h, j, c] * math.exp(decay)
                    scores[h, i, j] /= math.sqrt(8)
                    if spec.get("use_scalar_gate"):
                        gate = term.forget_gate.forget_gate
                        scores[h, i, j] += sum(F.logsigmoid(gate(x[t]))[h] for t in range(j + 1, i + 1))
        expected, output = softmax_output(block, scores, value)
    torch.testing.assert_close(weights, expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(captured["out"][0], output, atol=1e-10, rtol=0)


def fla_naive_scores(query, key, log_decay):
    """fla ``naive_wall_attn``'s logits before its scale, re-derived: ``P = cumsum(g) / ln 2`` (base 2), ``s_ij =
    sum_n q_in k_jn 2^(P_in - P_jn)`` from the dense ``(n, n, d)`` tensor of exponents, causal (0 above: the
    exponents there are set to ``-inf`` first, where fla masks the scores after, so that no ``inf`` meets a 0 in the
    backward)."""
    cumulative = log_decay.cumsum(-2) / math.log(2)
    difference = cumulative[..., :, None, :] - cumulative[..., None, :, :]
    n = query.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool).tril()[..., None]
    difference = difference.masked_fill(~causal, -math.inf)
    return (query[..., :, None, :] * key[..., None, :, :] * torch.exp2(difference)).sum(-1)


@pytest.mark.parametrize(
    ("n", "first_query", "per_token", "block_size"),
    [(7, 0, 0.3, 64), (11, 4, 0.3, 64), (40, 0, 30.0, 64), (40, 33, 30.0, 64), (40, 0, 30.0, 4), (40, 9, 30.0, 3)],
)
def test_the_decay_term_equals_fla_naive_oracle_even_where_exp_of_minus_p_overflows(
    n, first_query, per_token, block_size
):
    """Queries from ``first_query`` on (a cache's earlier keys before them), in blocks of 64, 4 and 3, values and
    gradients, float64. At 30 nats a token ``P`` reaches -1200: ``exp(-P)`` overflows float64, the anchored products do
    not (and agree)."""
    generator = torch.Generator().manual_seed(0)
    query, key = (torch.randn(2, 3, n, 5, generator=generator, dtype=torch.float64) for _ in range(2))
    log_decay = -per_token * torch.rand(2, 3, n, 5, generator=generator, dtype=torch.float64)
    assert torch.exp(-log_decay.sum(-2)).isinf().any() == (per_token > 1)
    query, log_decay = query.requires_grad_(), log_decay.requires_grad_()
    queries = query[..., first_query:, :]
    got = wall_decay_term(queries, key, log_decay.cumsum(-2), first_query, block_size) + queries @ key.transpose(
        -1, -2
    )
    causal = torch.arange(n) <= first_query + torch.arange(n - first_query)[:, None]
    got = got * causal
    expected = fla_naive_scores(query, key, log_decay)[..., first_query:, :]
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)
    weights = torch.randn(got.shape, generator=generator, dtype=torch.float64)
    got_grads = torch.autograd.grad((got * weights).sum(), (query, log_decay))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, log_decay))
    for got_grad, expected_grad in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(got_grad, expected_grad, atol=1e-10, rtol=1e-8)


def test_wall_starts_as_the_reference_initialises_it():
    """fla's ``_init_weights`` for ``g_proj`` and ``gs_proj``: weight ``N(0, initializer_range)``, bias
    ``gate_init_bias`` (8), so every gate starts at ``log sigmoid(8) = -3.4e-4``."""
    torch.manual_seed(0)
    config = make_config(
        "gpt2", {"type": "wall", "use_scalar_gate": True}, n_embd=256, n_head=8, initializer_range=0.02
    )
    term = hf_posenc.PosEncGPT2Model(config).h[1].attn.position_term
    assert term.g_proj.weight.shape == (256, 256)
    assert torch.equal(term.g_proj.bias, torch.full((256,), 8.0))
    assert torch.equal(term.forget_gate.forget_gate.bias, torch.full((8,), 8.0))
    assert abs(term.g_proj.weight.std().item() - 0.02) < 0.002


def test_selective_rope_starts_as_the_reference_initialises_it():
    """The reference's ``phi_proj`` (hidden -> 16 -> heads * head_dim / 2, no biases) and ``nn.Conv1d`` weights
    ``N(0, initializer_range)``; the temperature ``temp_max / temp_theta^(2m/d)`` (a parameter with ``temp_grad``)."""
    torch.manual_seed(0)
    spec = {"type": "selective_rope", "temp_grad": True}
    config = make_config("gpt2", spec, n_embd=256, n_head=4, initializer_range=0.02)
    term = hf_posenc.PosEncGPT2Model(config).h[1].attn.position_term
    assert [layer.weight.shape for layer in term.phi_proj] == [(16, 256), (128, 16)]
    assert all(layer.bias is None for layer in term.phi_proj)
    assert term.phi_conv_weight.shape == (128, 1, 4)
    assert abs(term.phi_conv_weight.std().item() - 0.02) < 0.003
    expected = torch.tensor([500000.0 ** (-2 * m / 64) for m in range(32)])
    torch.testing.assert_close(term.temperature.detach(), expected)


@pytest.mark.parametrize(("scheme", "says"), [("wall", "a key's channels decay"), ("selective_rope", "angles are")])
def test_an_encoder_config_says_why_it_is_refused(scheme, says):
    with pytest.raises(ValueError, match=f"'{scheme}' has no encoder form: .*{says}"):
        make_config("bert", scheme)
    assert make_config("bert", scheme, is_decoder=True).position_encoding["type"] == scheme


def rotated(states, angles):
    """Each pair ``(m, m + d/2)`` of ``states`` ``(n, d)`` turned by ``angles[t, m]`` with an explicit 2x2 matrix."""
    n, d = states.shape
    out = torch.empty_like(states)
    for t in range(n):
        for m in range(d // 2):
            c, s = math.cos(angles[t, m]), math.sin(angles[t, m])
            pair = torch.tensor([[c, -s], [s, c]], dtype=states.dtype) @ states[t, [m, m + d // 2]]
            out[t, m], out[t, m + d // 2] = pair[0], pair[1]
    return out


@pytest.mark.parametrize("spec", ["selective_rope", SELECTIVE_OPTIONS])
def test_selective_rope_attention_and_output_equal_the_rotation_loop(spec):
    """The reference's ``SelectiveRoPE``: ``phi_t = W_2 W_1 l2norm(x_t)`` (per head's slice of ``x``), a causal
    depthwise convolution of width ``d_conv`` (or with ``skip_conv`` the first difference), ``+ exp(b)``, times the
    phase gate, summed over the tokens, times ``temp_max / temp_theta^(2m/d)``, and q, k rotated as RoPE's halves;
    float64 loops."""
    model = make_model("gpt2", spec, n_layer=1, attn="eager").double()
    resolved = model.config.position_encoding
    n = 7
    ids = random_ids(1, n, seed=2)
    captured = {}
    model.transformer.h[0].attn.register_forward_hook(lambda module, args, output: captured.update(out=output[0]))
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions[0][0]
        block, x, query, key, value = layer_input(model, ids)
        term = block.attn.position_term
        slices = x.view(n, 4, 8)
        normed = (slices / (slices.square().sum(-1, keepdim=True) + 1e-6).sqrt()).reshape(n, 32)
        phi = term.phi_proj[1](term.phi_proj[0](normed)).view(n, 4, 4)  # (n, heads, head_dim / 2)
        increments = torch.zeros(n, 4, 4, dtype=torch.float64)
        for t in range(n):
            for h in range(4):
                for m in range(4):
                    if resolved["skip_conv"]:
                        previous = phi[t - 1, h, m] if t > 0 else 0.0
                        increments[t, h, m] = phi[t, h, m] - previous
                    else:
                        width = resolved["d_conv"]
                        weight = term.phi_conv_weight[h * 4 + m, 0]
                        for k in range(width):
                            source = t - (width - 1) + k
                            if source >= 0:
                                increments[t, h, m] += weight[k] * phi[source, h, m]
                    if resolved["use_bias"]:
                        increments[t, h, m] += math.exp(term.phi_bias[h, m])
                    if resolved["use_gate"]:
                        increments[t, h, m] *= torch.sigmoid(term.phase_gate_proj(normed[t]))[h]
        temperature = [resolved["temp_max"] / resolved["temp_theta"] ** (2 * m / 8) for m in range(4)]
        if resolved["temp_grad"]:  # trained: its value (perturbed here), not the formula
            temperature = term.temperature.tolist()
        scores = torch.zeros(4, n, n, dtype=torch.float64)
        for h in range(4):
            angles = increments[:, h].cumsum(0) * torch.tensor(temperature, dtype=torch.float64)
            scores[h] = rotated(query[h], angles) @ rotated(key[h], angles).T / math.sqrt(8)
        expected, output = softmax_output(block, scores, value)
    torch.testing.assert_close(weights, expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(captured["out"][0], output, atol=1e-10, rtol=0)


def test_selective_rope_with_a_bias_and_no_projection_is_rope_of_base_temp_theta():
    """``use_bias`` with ``b = 0`` and a zero projection: every token adds 1 to the angle sum, ``theta_t = t + 1``, so
    the scores are RoPE's of base ``temp_theta`` (Transformers' rotate-half convention)."""
    spec = {"type": "selective_rope", "use_bias": True, "temp_theta": 10000}
    model = make_model("gpt2", spec, n_layer=1, attn="eager").double()
    reference = make_model("gpt2", {"type": "rope", "theta": 10000.0}, n_layer=1, attn="eager").double()
    term = model.transformer.h[0].attn.position_term
    missing, unexpected = model.load_state_dict(reference.state_dict(), strict=False)
    assert not unexpected and all("position_term" in name for name in missing)
    with torch.no_grad():
        term.phi_bias.zero_()
        term.phi_proj[1].weight.zero_()
        ids = random_ids(1, 6)
        got = model(ids, output_attentions=True).attentions[0]
        expected = reference(ids, output_attentions=True).attentions[0]
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)  # rope computes its frequencies in float32


@pytest.mark.parametrize(
    "spec", [WALL_FOX, SELECTIVE_OPTIONS, {"type": "selective_rope", "use_gate": True}, ["selective_rope", "fox"]]
)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_chunked_forwards_with_a_cache_equal_one_forward(spec, cache):
    """Options the shared properties do not run, and a layout whose terms keep two and one states per layer (their
    cache slots apart): three forwards through a cache, the second prompt left-padded, equal one forward."""
    model = make_model("gpt2", spec, attn="sdpa")
    ids = random_ids(2, 9, seed=4)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :2] = 0
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    kwargs = {}
    if cache == "static":
        kwargs = with_cache(transformers.StaticCache(config=model.config, max_cache_len=9))
    pieces = []
    with torch.no_grad():
        for start, stop in ((0, 4), (4, 5), (5, 9)):
            out = model(
                ids[:, start:stop],
                attention_mask=attention_mask[:, :stop],
                position_ids=positions[:, start:stop],
                use_cache=True,
                **kwargs,
            )
            kwargs = with_cache(cache_of(out))
            pieces.append(out.logits)
        full = model(ids, attention_mask=attention_mask, position_ids=positions).logits
    torch.testing.assert_close(torch.cat(pieces, dim=1)[1, 2:], full[1, 2:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(pieces, dim=1)[0], full[0], atol=1e-5, rtol=1e-4)


def test_the_wall_term_runs_in_float32_under_bf16_autocast():
    """bf16 queries and keys under autocast: the products and exponentials in float32 (the float32 term of the same
    rounded inputs), not in bf16."""
    generator = torch.Generator().manual_seed(1)
    query, key = (torch.randn(1, 2, 9, 4, generator=generator).bfloat16() for _ in range(2))
    cumulative = (-0.5 * torch.rand(1, 2, 9, 4, generator=generator)).cumsum(-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = wall_decay_term(query, key, cumulative, 0, 64)
    assert got.dtype == torch.float32
    torch.testing.assert_close(
        got, wall_decay_term(query.float(), key.float(), cumulative, 0, 64), atol=1e-6, rtol=1e-6
    )


MAMBA3 = {"type": "selective_rope", "angles": "mamba3"}


@pytest.mark.parametrize("rope_fraction", [0.5, 1.0])
def test_mamba3_angles_equal_the_reference_rotation_loop(rope_fraction):
    """Mamba-3's SISO rotation (``apply_rotary_qk_inference_reference`` with ``rotate_pairwise``, the angles as
    ``angle_dt``): ``theta_thm = pi sum_(s<=t) softplus(W_dt x_s + b_h) tanh(W_theta x_s)_m``, adjacent pairs of the
    first ``2 floor(8 rope_fraction / 2)`` features turned by ``[[cos, -sin], [sin, cos]]``; float64 loops."""
    model = make_model("gpt2", {**MAMBA3, "rope_fraction": rope_fraction}, n_layer=1, attn="eager").double()
    n, pairs = 7, int(8 * rope_fraction) // 2
    ids = random_ids(1, n, seed=2)
    captured = {}
    model.transformer.h[0].attn.register_forward_hook(lambda module, args, output: captured.update(out=output[0]))
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions[0][0]
        block, x, query, key, value = layer_input(model, ids)
        term = block.attn.position_term
        angle_logits, step_logits = term.angle_proj(x), term.dt_proj(x)  # (n, pairs), (n, heads)
        scores = torch.zeros(4, n, n, dtype=torch.float64)
        for h in range(4):
            turned = {"q": query[h].clone(), "k": key[h].clone()}
            for m in range(pairs):
                angle = 0.0
                for t in range(n):
                    step = F.softplus(step_logits[t, h] + term.dt_bias[h]).item()
                    angle += math.pi * math.tanh(angle_logits[t, m].item()) * step
                    c, s = math.cos(angle), math.sin(angle)
                    for name, states in (("q", query[h]), ("k", key[h])):
                        x0, x1 = states[t, 2 * m].item(), states[t, 2 * m + 1].item()
                        turned[name][t, 2 * m], turned[name][t, 2 * m + 1] = x0 * c - x1 * s, x0 * s + x1 * c
            scores[h] = turned["q"] @ turned["k"].T / math.sqrt(8)
        expected, output = softmax_output(block, scores, value)
    torch.testing.assert_close(weights, expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(captured["out"][0], output, atol=1e-10, rtol=0)


def test_mamba3_angles_start_as_the_reference_initialises_them():
    """``dt_bias = dt + log(-expm1(-dt))`` (``softplus^-1(dt)``) with ``dt`` log-uniform in ``[dt_min, dt_max]``,
    floored at ``dt_init_floor``: every initial step ``softplus(dt_bias)`` lies in the range."""
    config = make_config("gpt2", {**MAMBA3, "dt_min": 0.01, "dt_max": 0.02}, n_embd=256, n_head=64)
    term = transformers.AutoModelForCausalLM.from_config(config).transformer.h[0].attn.position_term
    steps = F.softplus(term.dt_bias.detach())
    assert steps.shape == (64,) and bool(((steps >= 0.01 - 1e-7) & (steps <= 0.02 + 1e-7)).all())
    assert steps.std() > 0  # drawn, not constant
    floored = make_config("gpt2", {**MAMBA3, "dt_min": 1e-6, "dt_max": 2e-6, "dt_init_floor": 1e-3})
    term = transformers.AutoModelForCausalLM.from_config(floored).transformer.h[0].attn.position_term
    torch.testing.assert_close(F.softplus(term.dt_bias.detach()), torch.full((4,), 1e-3))


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({**MAMBA3, "d_conv": 3}, "option 'd_conv'=3 has no effect with angles='mamba3'"),
        ({"type": "selective_rope", "rope_fraction": 1.0}, "option 'rope_fraction'=1.0 has no effect with angles="),
        ({**MAMBA3, "rope_fraction": 1.5}, "0 < x <= 1"),
        ({**MAMBA3, "dt_min": 0.5}, "dt_min 0.5 must be at most dt_max 0.1"),
    ],
)
def test_mamba3_options_are_checked_by_name(spec, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        make_config("gpt2", spec)


def test_a_rope_fraction_that_turns_no_pair_is_refused_when_the_model_is_built():
    with pytest.raises(ValueError, match=re.escape("none for head size 8 and rope_fraction 0.1")):
        make_model("gpt2", {**MAMBA3, "rope_fraction": 0.1})


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_mamba3_angles_through_a_cache_equal_one_forward(cache):
    test_chunked_forwards_with_a_cache_equal_one_forward(MAMBA3, cache)
