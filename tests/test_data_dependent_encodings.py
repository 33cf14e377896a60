"""Schemes computed from the layer's input tokens (``data_dependent_encodings.py``): FoX's forget-gate bias against a
hand loop of its paper's formula, FoX-Pro's options against a loop of the reference's layer, PaTH (Householder
position encoding, Yang et al. 2025) against explicit products of its matrices, and PaTH-FoX; the shared properties
(padding, caches, backends, save/load, checkpointing, bf16, shift) run ``fox``, FoX-Pro and ``path`` through the
registry."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from conftest import (
    FOX_PRO,
    TINY_LLAMA,
    cache_of,
    forward_in_two_chunks,
    make_config,
    make_model,
    random_ids,
    with_cache,
)
from torch.nn import functional as F

import hf_posenc
from hf_posenc import attention_backends
from hf_posenc.data_dependent_encodings import HouseholderTerm, path_householder_term


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


@pytest.mark.parametrize("bias", [5.0, 8.0, -1.5])
def test_fox_gate_bias_init_starts_every_gate_at_sigmoid_of_it(bias, tmp_path):
    """``gate_bias_init=b``: every gate's bias starts at b. With the gates' weights and q, k at zero,
    ``f = sigmoid(b)`` for every token and ``a_ij = f^(i-j) / sum_(m=0..i) f^m``, computed with ``math``; a saved
    model loads its trained bias, not the init; a BERT-family decoder starts its gates at b too."""
    torch.manual_seed(0)
    model = make_model("gpt2", {"type": "fox", "gate_bias_init": bias}, n_layer=1, attn="eager").double()
    gate = model.transformer.h[0].attn.position_term.forget_gate
    assert torch.equal(gate.bias, torch.full((4,), bias, dtype=torch.float64))
    with torch.no_grad():
        gate.weight.zero_()
        model.transformer.h[0].attn.c_attn.weight[:, :64].zero_()  # q and k
        weights = model(random_ids(1, 5), output_attentions=True).attentions[0][0]
    f = 1 / (1 + math.exp(-bias))
    expected = torch.zeros(5, 5, dtype=torch.float64)
    for i in range(5):
        for j in range(i + 1):
            expected[i, j] = f ** (i - j) / sum(f**m for m in range(i + 1))
    torch.testing.assert_close(weights, expected.expand(4, 5, 5), atol=1e-12, rtol=0)
    with torch.no_grad():
        gate.bias.fill_(1.25)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.transformer.h[0].attn.position_term.forget_gate.bias, torch.full((4,), 1.25))
    bert = make_model("bert", {"type": "fox", "gate_bias_init": bias}, is_decoder=True)
    gates = [module.forget_gate.bias for name, module in bert.named_modules() if name.endswith("position_term")]
    assert len(gates) == 2 and all(torch.equal(gate, torch.full((4,), bias)) for gate in gates)


def test_fox_gate_bias_init_refuses_what_is_not_a_finite_number():
    with pytest.raises(ValueError, match="option 'gate_bias_init'=inf is out of range; valid: a finite number"):
        make_config("gpt2", {"type": "fox", "gate_bias_init": math.inf})
    with pytest.raises(ValueError, match="option 'gate_bias_init' must be float or int, got '5'"):
        make_config("gpt2", {"type": "fox", "gate_bias_init": "5"})


def test_fox_keeps_each_layers_gates_with_the_cache():
    """The cached keys' log gates are kept per layer (extra cache layers after the positions): a second chunk's bias
    reads them, so chunked forwards equal one forward only if each layer's own gates come back."""
    model = make_model("gpt2", "fox", attn="eager")
    chunked, full, cache = forward_in_two_chunks(model, random_ids(1, 9), 5)
    # attention layers, key positions (full layers; the sliding layers' slot unused), one log-gate slot per layer
    assert len(cache.layers) == 2 + 2 + 2
    stored = [cache.layers[4 + layer].keys[0, 0] for layer in range(2)]  # (kv_len, heads)
    assert stored[0].shape == (9, 4) and not torch.allclose(stored[0], stored[1])
    assert (stored[0] < 0).all()
    torch.testing.assert_close(chunked[:, 5:], full[:, 5:], atol=1e-5, rtol=1e-4)


def test_fox_in_an_encoder_config_says_why_it_is_refused():
    with pytest.raises(ValueError, match="'fox' has no encoder form: its bias sums the forget gates"):
        make_config("bert", "fox")
    assert (
        make_config("bert", "fox", is_decoder=True).position_encoding == make_config("gpt2", "fox").position_encoding
    )


def test_fox_flex_runs_sdpa_on_cpu_with_the_reason_and_flex_on_cuda(caplog):
    """Compiled CPU FlexAttention (torch 2.13) cannot recompile FoX's score_mod at a second length; CUDA runs it."""
    config = make_config("gpt2", "fox")
    spec, softmax = config.position_encoding, config.attention_normalizer
    with torch.no_grad(), caplog.at_level("INFO", logger="hf_posenc"):
        cpu = attention_backends.choose_backend("flex_attention", spec, softmax, torch.device("cpu"), head_dim=32)
        cuda = attention_backends.choose_backend("flex_attention", spec, softmax, torch.device("cuda"), head_dim=32)
    assert (cpu, cuda) == ("sdpa", "flex_attention")
    assert "emits C++ that does not compile for this scheme's score_mod" in caplog.text


FOX_PRO_OPTIONS = ["use_k_shift", "use_v_shift", "use_qk_norm", "use_output_norm", "use_output_gate"]


def fox_pro_loop(module, x: torch.Tensor, query, key, value, options: dict) -> torch.Tensor:
    """The reference's ``ForgettingAttentionLayer`` (``zhixuan-lin/forgetting-transformer``) one head and token at a
    time, ``x`` ``(n, hidden)``, q, k, v ``(n, heads * head_dim)``: the shifts ``k'_t = a_t k_(t-1) + (1 - a_t) k_t``,
    ``a_t = sigmoid(w_h . x_t)``, ``k_(-1) = 0`` (``ShiftLinear``); QK-norm ``y / sqrt(mean(y^2) + 1e-5) * g`` per head
    (``GroupNorm(is_rms_norm=True)``); the forget-gate softmax; the output norm (eps 1e-6), then ``sigmoid(W x)``
    (``FusedGroupNormGated``). Returns what the output projection reads, ``(n, heads * head_dim)``."""
    heads, head_dim, n = 4, 8, x.shape[0]

    def head(tensor, t, h):
        return tensor[t, h * head_dim : (h + 1) * head_dim]

    def rms(vector, scale, eps):
        return vector / math.sqrt(float((vector * vector).mean()) + eps) * scale

    out = torch.zeros(n, heads * head_dim, dtype=torch.float64)
    for h in range(heads):
        keys, values = [head(key, t, h) for t in range(n)], [head(value, t, h) for t in range(n)]
        for flag, shift, states in (("use_k_shift", "key_shift", keys), ("use_v_shift", "value_shift", values)):
            if options.get(flag):
                weight = getattr(module, shift).weight[h]
                projected = list(states)
                for t in range(n):
                    mix = torch.sigmoid(weight @ x[t])
                    before = projected[t - 1] if t > 0 else torch.zeros(head_dim, dtype=torch.float64)
                    states[t] = mix * before + (1 - mix) * projected[t]
        queries = [head(query, t, h) for t in range(n)]
        if options.get("use_qk_norm"):
            query_scale = module.query_norm[h * head_dim : (h + 1) * head_dim]
            key_scale = module.key_norm[h * head_dim : (h + 1) * head_dim]
            queries = [rms(q, query_scale, 1e-5) for q in queries]
            keys = [rms(k, key_scale, 1e-5) for k in keys]
        forget = [torch.sigmoid(module.forget_gate.weight[h] @ x[t] + module.forget_gate.bias[h]) for t in range(n)]
        for i in range(n):
            scores = []
            for j in range(i + 1):
                decay = sum(math.log(forget[t]) for t in range(j + 1, i + 1))
                scores.append(queries[i] @ keys[j] / math.sqrt(head_dim) + decay)
            weights = torch.softmax(torch.stack(scores), dim=0)
            output = sum(weights[j] * values[j] for j in range(i + 1))
            if options.get("use_output_norm"):
                output = rms(output, module.output_norm[h * head_dim : (h + 1) * head_dim], 1e-6)
            if options.get("use_output_gate"):
                output = output * torch.sigmoid(module.output_gate.weight[h * head_dim : (h + 1) * head_dim] @ x[i])
            out[i, h * head_dim : (h + 1) * head_dim] = output
    return out


@pytest.mark.parametrize("options", [{name: True} for name in FOX_PRO_OPTIONS] + [FOX_PRO], ids=str)
def test_fox_pro_options_equal_the_reference_layer_loop(options):
    """Each FoX-Pro option alone, and all of them, against :func:`fox_pro_loop` in float64: what GPT-2's output
    projection reads, for every token."""
    spec = {"type": "fox", **{name: value for name, value in options.items() if name != "type"}}
    model = make_model("gpt2", spec, n_layer=1, attn="eager").double()
    ids = random_ids(1, 6)
    block = model.transformer.h[0]
    seen = []
    handle = block.attn.c_proj.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
    with torch.no_grad():
        model(ids)
        handle.remove()
        x = block.ln_1(model.transformer.wte(ids))[0]
        query, key, value = block.attn.c_attn(x).split(32, dim=-1)
        expected = fox_pro_loop(block.attn.position_term, x, query, key, value, options)
    torch.testing.assert_close(seen[0][0], expected, atol=1e-10, rtol=0)


def test_fox_pro_pieces_start_as_the_reference_initialises_them():
    """The reference's ``shift_proj`` (``nn.Linear(hidden, heads, bias=False)``) and ``ogate_proj``
    (``nn.Linear(hidden, hidden, bias=False)``), weights ``N(0, initializer_range)``; the QK and output norms' scales
    (one per head and feature) at 1."""
    torch.manual_seed(0)
    config = make_config("gpt2", FOX_PRO, n_embd=256, n_head=8, initializer_range=0.02)
    term = hf_posenc.PosEncGPT2Model(config).h[1].attn.position_term
    for shift in (term.key_shift, term.value_shift):
        assert shift.weight.shape == (8, 256) and shift.bias is None
        assert abs(shift.weight.std().item() - 0.02) < 0.003
    assert term.output_gate.weight.shape == (256, 256) and term.output_gate.bias is None
    assert abs(term.output_gate.weight.std().item() - 0.02) < 0.002
    for scale in (term.query_norm, term.key_norm, term.output_norm):
        assert torch.equal(scale, torch.ones(256))
    assert make_config("gpt2", "fox").position_encoding == {
        "type": "fox",
        "gate_bias_init": 0.0,
        **dict.fromkeys(FOX_PRO_OPTIONS, False),
    }


def test_fox_shifts_keep_each_layers_key_and_value_inputs_with_the_cache():
    """The shifts read the token before a chunk's first from the cache: its projected k|v per layer, one more state
    slot per layer after the log gates; chunked forwards equal one forward."""
    model = make_model("gpt2", FOX_PRO, attn="eager")
    chunked, full, cache = forward_in_two_chunks(model, random_ids(1, 9), 5)
    # attention layers, key positions, the log gates' slot per layer, the shift inputs' slot per layer
    assert len(cache.layers) == 2 + 2 + 2 + 2
    stored = cache.layers[6].keys[0, 0]  # layer 0: (kv_len, heads * 2 * head_dim)
    assert stored.shape == (9, 4 * 2 * 8)
    torch.testing.assert_close(chunked[:, 5:], full[:, 5:], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("option", ["use_qk_norm", "use_output_gate", "use_output_norm"])
def test_a_fox_pro_piece_asked_for_twice_is_refused(option):
    """QK-norm, the output gate and the output norm exist as the config's ``use_qk_norm`` and the normalizer's
    ``output_gate`` / ``output_norm`` too: asking the scheme and one of those is refused, naming both."""
    elsewhere = {
        "use_qk_norm": ({"use_qk_norm": True}, "softmax", "the config's use_qk_norm=True"),
        "use_output_gate": (
            {},
            {"type": "softmax", "output_gate": "headwise"},
            "the normalizer's output_gate='headwise'",
        ),
        "use_output_norm": ({}, {"type": "softmax", "output_norm": True}, "the normalizer's output_norm=True"),
    }
    fields, normalizer, named = elsewhere[option]
    with pytest.raises(ValueError, match=f"'fox' builds its own .* with these options, and {named}"):
        make_config("gpt2", {"type": "fox", option: True}, normalizer, **fields)
    make_config("gpt2", {"type": "fox", option: True})


@pytest.mark.parametrize("option", FOX_PRO_OPTIONS)
def test_a_fox_pro_option_that_is_not_a_bool_is_refused(option):
    with pytest.raises(ValueError, match=f"option '{option}' must be bool, got 'yes'"):
        make_config("gpt2", {"type": "fox", option: "yes"})


@pytest.mark.parametrize("option", ["use_qk_norm", "use_k_shift", "use_v_shift"])
def test_fox_pro_per_head_pieces_refuse_grouped_query_attention(option):
    """A retrofitted Llama with 2 key/value heads for 4 query heads: the output norm and gate run, the per-query-head
    QK-norm scales and shift gates are refused, naming the options."""
    pieces = {"type": "fox", "use_output_gate": True, "use_output_norm": True}
    for spec in (pieces, {**pieces, option: True}):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).eval()
        hf_posenc.retrofit(model, position_encoding=spec)
        with torch.no_grad():
            if option not in spec:
                assert torch.isfinite(model(random_ids(1, 5)).logits).all()
                continue
            with pytest.raises(ValueError, match="2 key/value heads for 4 query heads: leave those options False"):
                model(random_ids(1, 5))


def test_fox_shifts_refuse_flex_with_the_reason(caplog):
    """The shifts read the padding from the dense mask: a flex request runs SDPA, on CUDA too, with the reason."""
    config = make_config("gpt2", {"type": "fox", "use_v_shift": True})
    spec, softmax = config.position_encoding, config.attention_normalizer
    attention_backends._log.cache_clear()  # logged once per process
    with torch.no_grad(), caplog.at_level("INFO", logger="hf_posenc"):
        cuda = attention_backends.choose_backend("flex_attention", spec, softmax, torch.device("cuda"), head_dim=32)
    assert cuda == "sdpa"
    assert "its key/value shift zeroes the padding tokens" in caplog.text


PATH_FOX = {"type": "path", "forget_gate": True}


def householder_loop(query, key, directions, strengths):
    """``q_i^T H_i H_(i-1) ... H_(j+1) k_j`` for ``j <= i`` (0 elsewhere), ``H_t = I - beta_t w_t w_t^T``, as
    explicit ``(d, d)`` matrix products, one (batch, head, i, j) at a time; ``(batch, heads, n, n)``."""
    batch, heads, n, d = query.shape
    rows = []
    for b in range(batch):
        for h in range(heads):
            eye = torch.eye(d, dtype=query.dtype)
            factors = [eye - strengths[b, h, t] * torch.outer(w, w) for t, w in enumerate(directions[b, h])]
            scores = []
            for i in range(n):
                for j in range(n):
                    if j > i:
                        scores.append(query.new_zeros(()))
                        continue
                    product = eye
                    for t in range(i, j, -1):  # H_i first (leftmost)
                        product = product @ factors[t]
                    scores.append(query[b, h, i] @ product @ key[b, h, j])
            rows.append(torch.stack(scores).view(n, n))
    return torch.stack(rows).view(batch, heads, n, n)


def random_factors(batch=2, heads=2, n=6, d=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query, key, raw = (torch.randn(batch, heads, n, d, generator=generator, dtype=torch.float64) for _ in range(3))
    directions = F.normalize(raw, dim=-1)
    strengths = 2 * torch.rand(batch, heads, n, generator=generator, dtype=torch.float64)
    return query, key, directions, strengths


def ut_term(query, key, directions, strengths, block_size=64, first_query=None):
    first_query = key.shape[-2] - query.shape[-2] if first_query is None else first_query
    return path_householder_term(query, key, directions, strengths, first_query, block_size)


@pytest.mark.parametrize("block_size", [64, 4, 3, 1])
def test_the_blockwise_term_equals_explicit_householder_products(block_size):
    """One block (64), and blocks of 4, 3 and 1 over 11 tokens: padding in front, products across several blocks."""
    query, key, directions, strengths = random_factors(n=11)
    causal = torch.ones(11, 11, dtype=torch.bool).tril()
    expected = householder_loop(query, key, directions, strengths)
    got = (query @ key.transpose(-1, -2) + ut_term(query, key, directions, strengths, block_size)) * causal
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("block_size", [64, 4])
@pytest.mark.parametrize(("first_query", "q_len"), [(7, 4), (3, 4), (10, 1), (0, 2)])
def test_queries_inside_the_keys_take_the_factors_up_to_their_own_token(block_size, first_query, q_len):
    """Queries at key rows ``first_query ..`` (a static cache's prefill or decoding step: later rows unwritten, or a
    cache's last tokens): row ``i`` of the term is row ``first_query + i`` of the whole sequence's."""
    query, key, directions, strengths = random_factors(n=11, seed=2)
    rows = slice(first_query, first_query + q_len)
    expected = ut_term(query, key, directions, strengths, 64)[:, :, rows]
    got = ut_term(query[:, :, rows], key, directions, strengths, block_size, first_query)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("block_size", [64, 2])
def test_the_blockwise_term_has_the_gradients_of_the_explicit_products(block_size):
    inputs = [tensor.requires_grad_() for tensor in random_factors(batch=1, n=5, seed=1)]
    weights = torch.randn(1, 2, 5, 5, dtype=torch.float64).tril()
    loop_grads = torch.autograd.grad((householder_loop(*inputs) * weights).sum(), inputs)
    query, key = inputs[:2]
    scores = query @ key.transpose(-1, -2) + ut_term(*inputs, block_size)
    term_grads = torch.autograd.grad((scores * weights).sum(), inputs)
    for got, expected in zip(term_grads, loop_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)


def model_factors(model, ids, layer=0):
    """The first layer's input, q, k, v and PaTH's w, beta (float64 model), by hand from its weights."""
    block = model.transformer.h[layer]
    x = block.ln_1(model.transformer.wte(ids))[0]
    query, key, value = (part.view(-1, 4, 8).transpose(0, 1) for part in block.attn.c_attn(x).split(32, dim=-1))
    term = block.attn.position_term
    raw = term.direction(x).view(-1, 4, 8)
    directions = (raw / (raw.square().sum(-1, keepdim=True) + 1e-6).sqrt()).transpose(0, 1)  # fla's l2_norm, eps 1e-6
    strengths = 2 * torch.sigmoid(term.strength(x)).T
    return block, x, query, key, value, directions, strengths


@pytest.mark.parametrize("spec", ["path", PATH_FOX])
def test_path_attention_and_output_equal_the_householder_loop(spec):
    """The model's weights and attention output: softmax over ``j <= i`` of ``q_i^T H_i...H_(j+1) k_j / sqrt(d)``
    (plus FoX's ``sum_(l=j+1..i) log f_l`` with ``forget_gate``), ``w``, ``beta`` computed from the layer's input by
    hand, the product of explicit matrices, float64."""
    model = make_model("gpt2", spec, n_layer=1, attn="eager").double()
    ids = random_ids(1, 6)
    captured = {}
    model.transformer.h[0].attn.register_forward_hook(lambda module, args, output: captured.update(out=output[0]))
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions[0][0]
        block, x, query, key, value, directions, strengths = model_factors(model, ids)
        scores = householder_loop(query[None], key[None], directions[None], strengths[None])[0] / math.sqrt(8)
        if spec == PATH_FOX:
            gate = block.attn.position_term.forget_gate.forget_gate
            log_forget = F.logsigmoid(gate(x)).T  # (heads, n)
            cumulative = log_forget.cumsum(-1)
            scores = scores + cumulative[:, :, None] - cumulative[:, None, :]
        causal = torch.ones(6, 6, dtype=torch.bool).tril()
        expected = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
        output = block.attn.c_proj((expected @ value).transpose(0, 1).reshape(6, 32))
    torch.testing.assert_close(weights, expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(captured["out"][0], output, atol=1e-10, rtol=0)


def test_path_starts_as_the_reference_initialises_it():
    """fla's ``PaTHAttention``: ``w_proj`` hidden -> 32 -> heads*head_dim without bias, ``bt_proj`` with a bias (0 at
    init, so every beta starts at 2 sigmoid(0) = 1); the forget gate is FoX's module."""
    torch.manual_seed(0)
    model = hf_posenc.PosEncGPT2Model(make_config("gpt2", PATH_FOX, n_embd=64, n_head=4, initializer_range=0.02))
    term = model.h[1].attn.position_term
    assert [layer.weight.shape for layer in term.direction] == [(32, 64), (64, 32)]
    assert all(layer.bias is None for layer in term.direction)
    assert torch.equal(term.strength.bias, torch.zeros(4))
    assert type(term.forget_gate).__name__ == "ForgetGate"
    full = hf_posenc.PosEncGPT2Model(make_config("gpt2", {"type": "path", "w_rank": 0}))
    assert full.h[0].attn.position_term.direction.weight.shape == (32, 32)


def test_path_in_an_encoder_config_says_why_it_is_refused():
    with pytest.raises(ValueError, match="'path' has no encoder form"):
        make_config("bert", "path")
    assert make_config("bert", "path", is_decoder=True).position_encoding["type"] == "path"


def test_path_keeps_each_layers_factors_with_the_cache():
    """One state per layer (w, beta, and log f with the forget gate), after the key-position slots; a second chunk
    applies the cached keys' factors: chunked forwards equal one forward."""
    model = make_model("gpt2", PATH_FOX, attn="eager")
    chunked, full, cache = forward_in_two_chunks(model, random_ids(1, 9), 5)
    assert len(cache.layers) == 2 + 2 + 2
    assert cache.layers[4].keys.shape == (1, 1, 9, 4 * 8 + 4 + 4)
    torch.testing.assert_close(chunked[:, 5:], full[:, 5:], atol=1e-5, rtol=1e-4)


def generate(model, ids, **kwargs):
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_scores=True)
    return model.generate(ids, return_dict_in_generate=True, **settings, **kwargs)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_path_fox_generation_with_a_cache_equals_without(cache):
    model = make_model("gpt2", PATH_FOX, attn="sdpa")
    ids = random_ids(2, 7, seed=5)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0  # left padding
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    cached = generate(model, ids, attention_mask=attention_mask, use_cache=True, **extra)
    uncached = generate(model, ids, attention_mask=attention_mask, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences)
    for a, b in zip(cached.scores, uncached.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("spec", "attn"), [("path", "eager"), (PATH_FOX, "eager"), (FOX_PRO, "eager"), (FOX_PRO, "sdpa")]
)
def test_a_left_padded_row_equals_the_row_alone(spec, attn):
    """A padding token's beta is 0 (its H the identity), its gate reaches no real token, and FoX-Pro's shifts read 0
    before the first real token, as alone."""
    model = make_model("gpt2", spec, attn=attn)
    ids = random_ids(2, 8, seed=6)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :3] = 0
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batch = model(ids, attention_mask=attention_mask, position_ids=positions).logits
        alone = model(ids[:1, 3:]).logits
    torch.testing.assert_close(batch[0, 3:], alone[0], atol=1e-5, rtol=1e-4)


def test_path_fox_eager_equals_sdpa_and_flex_runs_sdpa():
    """Values and gradients; a FlexAttention request runs SDPA (flex is not in the scheme's backends)."""
    ids = random_ids(2, 9)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :2] = 0
    results = {}
    for attn in ("eager", "sdpa", "flex_attention"):
        model = make_model("gpt2", PATH_FOX, attn=attn)
        loss = model(ids, attention_mask=attention_mask, labels=ids).loss
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if "position_term" in name}
        results[attn] = (loss.detach(), grads)
    for attn in ("sdpa", "flex_attention"):
        torch.testing.assert_close(results[attn][0], results["eager"][0], atol=1e-5, rtol=1e-4)
        for name, grad in results["eager"][1].items():
            torch.testing.assert_close(results[attn][1][name], grad, atol=1e-5, rtol=1e-4)


def test_path_in_a_sliding_layer_generates_as_without_cache():
    """The window keeps its keys' factors with them: the product from a visible key to the query stays inside it."""
    layer_types = ["sliding_attention", "full_attention"]
    model = make_model("gpt2", "path", attn="sdpa", sliding_window=4, layer_types=layer_types)
    ids = random_ids(1, 6, seed=7)
    for cache in ({}, {"cache_implementation": "static"}):
        cached = generate(model, ids, use_cache=True, **cache)
        uncached = generate(model, ids, use_cache=False)
        assert torch.equal(cached.sequences, uncached.sequences)
        for a, b in zip(cached.scores, uncached.scores, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_path_in_blocks_of_four_equals_one_block(monkeypatch):
    """A model's logits and gradients with blocks of 4 tokens (products across blocks, checkpointed) = one block."""
    model = make_model("gpt2", PATH_FOX, attn="eager")
    ids = random_ids(2, 9)
    whole = model(ids, labels=ids)
    whole.loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    monkeypatch.setattr(HouseholderTerm, "block_size", 4)
    blocked = model(ids, labels=ids)
    blocked.loss.backward()
    torch.testing.assert_close(blocked.logits, whole.logits, atol=1e-6, rtol=1e-5)
    for p, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, grad, atol=1e-6, rtol=1e-5)


def test_a_cropped_cache_drops_the_factors_of_the_dropped_tokens():
    model = make_model("gpt2", PATH_FOX, attn="eager")
    ids = random_ids(1, 10)
    kept = [0, 1, 2, 3, 4, 8, 9]
    with torch.no_grad():
        full = model(ids[:, kept]).logits
        cache = cache_of(model(ids[:, :8], use_cache=True))
        cache.crop(-3)
        tail = model(ids[:, 8:], **with_cache(cache)).logits
    torch.testing.assert_close(tail, full[:, 5:], atol=1e-5, rtol=1e-4)


def test_the_term_runs_in_float32_under_bf16_autocast():
    """Autocast would run the blocks' products in bf16 (0.09 off at 100 tokens); the term keeps float32."""
    query, key, directions, strengths = (tensor.float() for tensor in random_factors(n=100, d=8, seed=3))
    expected = ut_term(query, key, directions, strengths, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ut_term(query, key, directions, strengths, 64)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
