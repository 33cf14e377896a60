"""``"linear_attention"`` layers (``linear_attention.py``): the gated delta rule and the gated DeltaNet mixer against
Transformers' Qwen3-Next (its own torch functions and ``Qwen3NextGatedDeltaNet`` on the same weights, float32),
Qwen3-Next's init; a 3:1 PosEnc GPT-2 hybrid that trains, generates with the cache as without it (dynamic and static,
left padding, beam search), saves and reloads (also as remote code without hf_posenc) and checkpoints its activations;
the config's refusals."""

from __future__ import annotations

import inspect
import math
import subprocess
import sys

import pytest
import torch
import transformers
from conftest import (
    WITHOUT_HF_POSENC,
    assert_generates_with_cache_as_without,
    cache_of,
    enable_activation_checkpointing,
    forward_in_two_chunks,
    generate_kwargs,
    left_padded_prompt,
    make_config,
    make_model,
    random_ids,
)
from transformers import cache_utils
from transformers.models.qwen3_next import modeling_qwen3_next

from hf_posenc.configuration_posenc import layer_position_specs
from hf_posenc.linear_attention import (
    LINEAR_ATTENTIONS,
    GatedDeltaNet,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)


HYBRID = ["linear_attention"] * 3 + ["full_attention"]
SPEC = {"num_key_heads": 2, "num_value_heads": 4, "key_head_dim": 8, "value_head_dim": 6, "conv_kernel_size": 4}
REFERENCE_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


def reference(name: str):
    """Transformers' torch function, without the hub-kernel wrapper (which would run fla where it is installed)."""
    return inspect.unwrap(getattr(modeling_qwen3_next, name))


@pytest.fixture
def torch_reference(monkeypatch):
    """Qwen3-Next's module running Transformers' own torch functions."""
    for name in (*REFERENCE_FUNCTIONS, "causal_conv1d_fn", "causal_conv1d_update"):
        monkeypatch.setattr(modeling_qwen3_next, name, reference(name))


def delta_rule_inputs(batch=2, seq=70, key_heads=2, value_heads=4, k_dim=8, v_dim=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, seq, key_heads, k_dim, generator=generator)
    key = torch.randn(batch, seq, key_heads, k_dim, generator=generator)
    value = torch.randn(batch, seq, value_heads, v_dim, generator=generator)
    g = -torch.rand(batch, seq, value_heads, generator=generator)
    beta = torch.rand(batch, seq, value_heads, generator=generator)
    state = torch.randn(batch, value_heads, k_dim, v_dim, generator=generator)
    return query, key, value, g, beta, state


@pytest.mark.parametrize("chunk_size", [64, 4])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_and_recurrent_rules_equal_qwen3_next_functions(chunk_size, with_state):
    """Outputs and final states of the chunked rule (70 tokens: a partial last chunk) and the recurrent one equal
    Transformers' ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` (grouped value heads, l2
    norm in the kernel, an initial state or none)."""
    query, key, value, g, beta, state = delta_rule_inputs()
    initial = state if with_state else None
    options = dict(initial_state=initial, output_final_state=True)
    ours = chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=chunk_size, **options)
    theirs = reference("torch_chunk_gated_delta_rule")(
        query, key, value, g, beta, chunk_size=chunk_size, use_qk_l2norm_in_kernel=True, **options
    )
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    ours = recurrent_gated_delta_rule(query[:, :9], key[:, :9], value[:, :9], g[:, :9], beta[:, :9], **options)
    theirs = reference("torch_recurrent_gated_delta_rule")(
        query[:, :9], key[:, :9], value[:, :9], g[:, :9], beta[:, :9], use_qk_l2norm_in_kernel=True, **options
    )
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_chunked_rule_equals_the_recurrent_rule():
    """The two forms of the rule compute the same outputs and state (so a prefill and a step agree)."""
    query, key, value, g, beta, state = delta_rule_inputs(seq=20)
    chunked = chunk_gated_delta_rule(query, key, value, g, beta, 8, state, True)
    recurrent = recurrent_gated_delta_rule(query, key, value, g, beta, state, True)
    for a, b in zip(chunked, recurrent, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def qwen3_next_pair(seed=0):
    """Qwen3-Next's ``Qwen3NextGatedDeltaNet`` with random weights, and ours with the same weights copied in."""
    torch.manual_seed(seed)
    config = transformers.Qwen3NextConfig(
        hidden_size=32,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=2,
        linear_num_key_heads=SPEC["num_key_heads"],
        linear_num_value_heads=SPEC["num_value_heads"],
        linear_key_head_dim=SPEC["key_head_dim"],
        linear_value_head_dim=SPEC["value_head_dim"],
        linear_conv_kernel_dim=SPEC["conv_kernel_size"],
    )
    theirs = modeling_qwen3_next.Qwen3NextGatedDeltaNet(config, 0)
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(0.0, 0.3)
    ours = GatedDeltaNet(SPEC, 32, 0)
    ours.load_state_dict(theirs.state_dict())
    return config, theirs, ours


def test_gated_deltanet_equals_qwen3_next_prefill_and_decoding(torch_reference):
    """On the same weights: a 70-token prefill, a padded batch (Qwen3-Next's 2-D padding mask), and a 5-token
    prefill then four one-token steps through each one's cache give Qwen3-Next's outputs."""
    config, theirs, ours = qwen3_next_pair()
    x = torch.randn(2, 70, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-5)
        mask = torch.ones(2, 70, dtype=torch.long)
        mask[1, :3] = 0
        torch.testing.assert_close(ours(x, mask.bool()), theirs(x, attention_mask=mask), atol=1e-6, rtol=1e-5)
        caches = transformers.DynamicCache(config=config), transformers.DynamicCache(config=config)
        outputs = [[module(x[:, :5], cache=cache)] for module, cache in zip((ours, theirs), caches, strict=True)]
        for t in range(5, 9):
            for module, cache, steps in zip((ours, theirs), caches, outputs, strict=True):
                steps.append(module(x[:, t : t + 1], cache=cache))
        ours_steps, theirs_steps = (torch.cat(steps, dim=1) for steps in outputs)
        torch.testing.assert_close(ours_steps, theirs_steps, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ours_steps, ours(x[:, :9]), atol=1e-5, rtol=1e-5)
        for state in ("conv_states", "recurrent_states"):
            torch.testing.assert_close(getattr(caches[0].layers[0], state)[0], getattr(caches[1].layers[0], state)[0])


def test_gated_deltanet_equals_qwen3_next_in_bfloat16(torch_reference):
    """In bfloat16 the mixer rounds where Qwen3-Next's does (the rule in float32 inside, the norm before the gate):
    the same numbers."""
    _, theirs, ours = qwen3_next_pair()
    x = torch.randn(2, 20, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(ours.bfloat16()(x), theirs.bfloat16()(x), atol=0, rtol=0)


def test_hybrid_initialises_its_mixers_as_qwen3_next():
    """Projections and convolution ``N(0, initializer_range)``, ``dt_bias`` ones, ``A_log = log U(0.01, 16)``, the
    gated norm's weight ones (``Qwen3NextPreTrainedModel._init_weights``)."""
    torch.manual_seed(0)
    config = make_config("gpt2", "rope", n_layer=4, layer_types=HYBRID, initializer_range=0.02)
    model = transformers.AutoModelForCausalLM.from_config(config)
    mixer = model.transformer.h[0].linear_attn
    assert isinstance(mixer, GatedDeltaNet) and not hasattr(model.transformer.h[0], "attn")
    assert model.transformer.h[3].linear_attn is None and hasattr(model.transformer.h[3], "attn")
    for weight in (mixer.in_proj_qkvz.weight, mixer.conv1d.weight, mixer.out_proj.weight):
        assert abs(weight.std().item() - 0.02) < 0.004 and abs(weight.mean().item()) < 0.004
    assert torch.equal(mixer.dt_bias, torch.ones(4)) and torch.equal(mixer.norm.weight, torch.ones(8))
    assert bool(((mixer.A_log >= math.log(0.01)) & (mixer.A_log <= math.log(16))).all())


def hybrid(position_encoding="rope", **overrides):
    return make_model("gpt2", position_encoding, n_layer=4, layer_types=HYBRID, **overrides)


def test_hybrid_trains():
    """A few Adam steps on one batch lower the loss, and every mixer parameter gets a gradient."""
    model = hybrid().train()
    ids = random_ids(4, 16)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    mixer = model.transformer.h[1].linear_attn
    assert all(param.grad is not None and param.grad.abs().sum() > 0 for param in mixer.parameters())


@pytest.mark.parametrize("position_encoding", ["rope", "learned", "fox", "none"])
def test_hybrid_forward_in_two_chunks_equals_one(position_encoding):
    """A forward through the cache in two chunks (the second of 4 tokens: a multi-token continuation) gives one
    forward's logits; the linear layers' cache layers are Transformers' ``LinearAttentionLayer``."""
    model = hybrid(position_encoding)
    chunks, full, cache = forward_in_two_chunks(model, random_ids(2, 9), 5)
    torch.testing.assert_close(chunks, full, atol=1e-5, rtol=1e-4)
    assert [type(layer).__name__ for layer in cache.layers[:4]] == ["LinearAttentionLayer"] * 3 + ["DynamicLayer"]


@pytest.mark.parametrize("cache", [{}, {"cache_implementation": "static"}], ids=["dynamic", "static"])
@pytest.mark.parametrize("position_encoding", ["rope", "fox", "conv"])
def test_hybrid_generates_with_the_cache_as_without(position_encoding, cache):
    """Greedy generation of a left-padded batch with a dynamic or static cache gives the tokens and scores of
    generation without a cache; ``fox`` keeps a layer term's per-token state and ``conv`` a scheme's in the
    ``PositionCache`` slots, whose cache layers take the attention layer's kind, not a linear layer's."""
    prompt, attention_mask = left_padded_prompt()
    kwargs = dict(attention_mask=attention_mask, **generate_kwargs())
    model = hybrid(position_encoding)
    cached = model.generate(prompt, use_cache=True, **cache, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    # a cached step runs the recurrent form of the rule, an uncached forward the chunked form: they round apart
    # (about 1e-6 relative in the mixer, 2.5e-5 seen on a logit with conv), so a bound above conftest's 1e-5
    for a, b in zip(cached.scores, uncached.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache", [{}, {"cache_implementation": "static"}], ids=["dynamic", "static"])
def test_hybrid_with_canon_layer_b_generates_with_the_cache_as_without(cache):
    """Canon layer B convolves the attention layer's q, k and v (its states in that layer's ``PositionCache``
    slots) and leaves the linear layers as they are: cached generation equals uncached, and a forward in two chunks
    equals one."""
    model = hybrid("rope", canon_layers="B", canon_kernel_size=3)
    convolved = [block.attn.canon_b is not None for block in model.transformer.h if hasattr(block, "attn")]
    assert convolved == [True] and not hasattr(model.transformer.h[0], "attn")
    prompt, attention_mask = left_padded_prompt()
    kwargs = dict(attention_mask=attention_mask, **generate_kwargs())
    cached = model.generate(prompt, use_cache=True, **cache, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    for a, b in zip(cached.scores, uncached.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    chunks, full, _ = forward_in_two_chunks(model, random_ids(2, 9), 5)
    torch.testing.assert_close(chunks, full, atol=1e-5, rtol=1e-4)


def test_hybrid_left_padded_row_generates_as_the_row_alone():
    """The padded row of a batch generates what it generates alone: the padding adds nothing to the states."""
    model = hybrid()
    prompt, attention_mask = left_padded_prompt()
    batch = model.generate(prompt, attention_mask=attention_mask, **generate_kwargs())
    alone = model.generate(prompt[1:, 2:], attention_mask=attention_mask[1:, 2:], **generate_kwargs())
    assert torch.equal(batch.sequences[1, 2:], alone.sequences[0])
    for a, b in zip(batch.scores, alone.scores, strict=True):
        torch.testing.assert_close(a[1:], b, atol=1e-5, rtol=1e-4)


def test_hybrid_beam_search_with_the_cache_as_without():
    """Beam search reorders the linear layers' states with the keys: the cached search equals the uncached one."""
    model = hybrid()
    prompt, attention_mask = left_padded_prompt()
    kwargs = dict(attention_mask=attention_mask, num_beams=3, num_return_sequences=2, max_new_tokens=6)
    kwargs.update(min_new_tokens=6, do_sample=False)
    cached = model.generate(prompt, use_cache=True, **kwargs)
    assert torch.equal(cached, model.generate(prompt, use_cache=False, **kwargs))


RECORDS_RECURRENT_STATES = hasattr(transformers.DynamicCache, "get_recurrent_states_to_keep")
"""Transformers 5.25 rolls a linear layer's state back for assisted decoding (its cache records the states of the
candidate tokens); earlier versions refuse assisted decoding with a stateful model."""


@pytest.mark.skipif(RECORDS_RECURRENT_STATES, reason="this Transformers rolls the recurrent state back (test below)")
def test_hybrid_refuses_assisted_decoding_as_qwen3_next():
    """The recurrent state cannot be rolled back: generate refuses assisted decoding (the model is stateful)."""
    model = hybrid()
    prompt = random_ids(1, 6, seed=3)
    with pytest.raises(ValueError, match="stateful"):
        model.generate(prompt, assistant_model=hybrid(), max_new_tokens=3)


@pytest.mark.skipif(not RECORDS_RECURRENT_STATES, reason="this Transformers refuses assisted decoding (test above)")
@pytest.mark.parametrize("position_encoding", ["rope", "fox", "conv"])
def test_hybrid_assisted_decoding_equals_greedy_decoding(position_encoding):
    """With an assistant of other weights (candidates rejected, the cache cropped back to a recorded state), assisted
    decoding gives the tokens of greedy decoding without a cache."""
    model = hybrid(position_encoding)
    prompt = random_ids(1, 6, seed=3)
    greedy = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assisted = model.generate(prompt, assistant_model=hybrid(position_encoding, seed=1), **greedy)
    assert torch.equal(assisted, model.generate(prompt, use_cache=False, **greedy))


def test_hybrid_saves_and_reloads(tmp_path):
    """``save_pretrained`` / ``from_pretrained`` keep the mixer's spec and weights: the same logits and cached
    generation."""
    model = hybrid()
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.linear_attention == model.config.linear_attention
    assert loaded.config.layer_types == HYBRID
    ids = random_ids(2, 7)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_hybrid_loads_as_remote_code_without_hf_posenc(tmp_path):
    """The saved folder carries ``linear_attention.py``; loaded with only transformers and torch it gives the same
    logits and generates with the cache as without it."""
    model = hybrid()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "linear_attention.py").is_file()
    ids = random_ids(2, 7)
    torch.save(ids, tmp_path / "ids.pt")
    script = WITHOUT_HF_POSENC + (
        "folder = sys.argv[1]\n"
        "ids = torch.load(folder + '/ids.pt')\n"
        "model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()\n"
        "assert model.__class__.__module__.startswith('transformers_modules.'), model.__class__.__module__\n"
        "with torch.no_grad():\n"
        "    torch.save(model(ids).logits, folder + '/logits.pt')\n"
        "greedy = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)\n"
        "assert torch.equal(model.generate(ids, use_cache=True, **greedy), model.generate(ids, use_cache=False, "
        "**greedy))\n"
    )
    command = [sys.executable, "-c", script, str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), model(ids).logits)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_hybrid_activation_checkpointing_gives_the_same_gradients(use_reentrant):
    """Activation checkpointing recomputes the mixers: the same loss and gradients."""
    ids = random_ids(2, 10)

    def gradients(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = hybrid().train()
        if checkpointing:
            assert enable_activation_checkpointing(model, use_reentrant)
        model(ids, labels=ids).loss.backward()
        return {name: param.grad for name, param in model.named_parameters() if param.grad is not None}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys() and any(".linear_attn." in name for name in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_linear_attention_spec_defaults_and_options():
    """None or the name: Qwen3-Next's kind with the model's heads and head size; options as Qwen3-Next names them."""
    config = make_config("gpt2", "rope", n_layer=4, layer_types=HYBRID)
    assert config.linear_attention == {
        "type": "gated_deltanet",
        "num_key_heads": 4,
        "num_value_heads": 4,
        "key_head_dim": 8,
        "value_head_dim": 8,
        "conv_kernel_size": 4,
    }
    config = make_config(
        "gpt2", "rope", n_layer=4, layer_types=HYBRID, linear_attention={"type": "gated_deltanet", **SPEC}
    )
    assert config.linear_attention == {"type": "gated_deltanet", **SPEC}
    assert list(LINEAR_ATTENTIONS) == ["gated_deltanet"]
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        assert model(random_ids(1, 5)).logits.shape == (1, 5, config.vocab_size)
    assert model.transformer.h[0].linear_attn.in_proj_ba.out_features == 2 * SPEC["num_value_heads"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"linear_attention": "gated_deltanet", "layer_types": None}, "has no effect: layer_types has no"),
        ({"linear_attention": "mamba2"}, r"Unknown linear_attention 'mamba2'; valid choices: \['gated_deltanet'\]"),
        ({"linear_attention": {"type": "gated_deltanet", "heads": 2}}, r"Unknown option\(s\) \['heads'\]"),
        ({"linear_attention": {"type": "gated_deltanet", "num_key_heads": 0}}, "'num_key_heads'=0 is out of range"),
        ({"linear_attention": {"type": "gated_deltanet", "conv_kernel_size": 1}}, "'conv_kernel_size'=1"),
        (
            {"linear_attention": {"type": "gated_deltanet", "num_key_heads": 3, "num_value_heads": 4}},
            "num_value_heads=4 must be a multiple of num_key_heads=3",
        ),
        ({"position_encoding": ["rope"] * 3 + ["none"]}, r"position_encoding\[0\] is 'rope'.*'linear_attention'"),
        ({"position_encoding": ["alibi", "none", "none", "rope"]}, r"position_encoding\[0\] is 'alibi'"),
        ({"no_rope_layer_interval": 4}, r"position_encoding\[0\] is 'rope'"),
        ({"layer_types": ["linear_attention"] * 4}, "at least one attention layer"),
        ({"canon_layers": "AC"}, "only canon layer B"),
        ({"canon_layers": "AB"}, "only canon layer B"),
    ],
)
def test_linear_attention_config_refusals(overrides, message):
    kwargs = {"position_encoding": "rope", "n_layer": 4, "layer_types": HYBRID, **overrides}
    with pytest.raises(ValueError, match=message):
        make_config("gpt2", **kwargs)


@pytest.mark.parametrize("layers", [["none", "none", "none", "rope"], ["rope"] * 4])
def test_linear_layers_take_none_or_the_attention_layers_spec(layers):
    """A linear layer's entry in a per-layer list: ``none``, or the spec every attention layer carries."""
    config = make_config("gpt2", layers, n_layer=4, layer_types=HYBRID)
    assert [spec["type"] for spec in layer_position_specs(config.position_encoding, 4)] == layers
    with torch.no_grad():
        transformers.AutoModelForCausalLM.from_config(config).eval()(random_ids(1, 5))


@pytest.mark.parametrize("is_decoder", [False, True])
def test_bert_refuses_linear_attention_by_name(is_decoder):
    """The delta rule is causal: no encoder form; the BERT decoder is not built with it (GPT-2 is)."""
    with pytest.raises(
        ValueError, match="PosEnc BERT has no 'linear_attention' layer: the gated delta rule is causal"
    ):
        make_config("bert", "rope", is_decoder=is_decoder, layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ValueError, match="linear_attention='gated_deltanet' has no effect"):
        make_config("bert", "rope", is_decoder=is_decoder, linear_attention="gated_deltanet")


def test_cache_keeps_the_states_per_linear_layer():
    """Each linear layer's cache layer holds its conv state ``(batch, conv_dim, kernel)`` and recurrent state
    ``(batch, value_heads, key_head_dim, value_head_dim)``; the attention layer its keys."""
    model = hybrid()
    with torch.no_grad():
        cache = cache_of(model(random_ids(2, 6), use_cache=True))
    for layer in cache.layers[:3]:
        assert layer.conv_states[0].shape == (2, 3 * 32, 4)
        assert layer.recurrent_states[0].shape == (2, 4, 8, 8)
    assert cache.get_seq_length() == 6


@pytest.mark.parametrize("parallelism", ["tensor", "context", "sequence"])
def test_hybrid_refuses_parallelisms_by_name(parallelism):
    """No plan shards the mixer's heads, and its state runs along the whole sequence: each parallelism refused."""
    model = hybrid()
    with pytest.raises(ValueError, match=f"linear_attention 'gated_deltanet' refuses {parallelism}"):
        model.check_parallelism(parallelism)
    assert not model.supports_context_parallel


def test_hybrid_backends_agree():
    """Eager, SDPA and FlexAttention on the attention layer give the same logits on the real tokens of a padded
    batch (the linear layers run the same code on each)."""
    ids = random_ids(2, 10)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 7:] = 0
    logits = {}
    for attn in ("eager", "sdpa", "flex_attention"):
        with torch.no_grad():
            logits[attn] = hybrid(attn=attn)(ids, attention_mask=attention_mask).logits
    visible = attention_mask.bool()
    for attn in ("sdpa", "flex_attention"):
        torch.testing.assert_close(logits[attn][visible], logits["eager"][visible], atol=1e-5, rtol=1e-4)


def test_hybrid_four_d_masks_equal_the_two_d_mask():
    """A 4-D boolean or additive mask tells the linear layers the padding as the 2-D mask does (a token no query
    sees)."""
    model = hybrid()
    ids = random_ids(2, 9)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0
    visible = attention_mask[:, None, None, :].bool() & torch.ones(9, 9, dtype=torch.bool).tril()
    additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = model(ids, attention_mask=attention_mask).logits
        for mask in (visible, additive):
            got = model(ids, attention_mask=mask).logits
            torch.testing.assert_close(got[1, 3:], expected[1, 3:], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-4)


def test_hybrid_bfloat16_matches_float32():
    model = hybrid(attn="sdpa")
    ids = random_ids(2, 8)
    with torch.no_grad():
        reference = model(ids).logits
        low = model.to(torch.bfloat16)(ids).logits
    assert low.dtype == torch.bfloat16
    # the mixer's bf16 rounding is Qwen3-Next's own (test_gated_deltanet_equals_qwen3_next_in_bfloat16); through
    # three of them in these tiny models with large weights (initializer_range 0.2) it reached 0.31 on 0.5% of the
    # logits, so the bound here is wider than the attention models' 0.2
    torch.testing.assert_close(low.float(), reference, atol=0.5, rtol=0.1)


def test_hybrid_compiles_as_one_graph():
    """``torch.compile(fullgraph=True)`` traces the mixers with the attention (no graph break; aot_eager, so the
    test compiles no kernel) and gives the eager numbers on a padded batch."""
    model = hybrid(attn="sdpa")
    ids = random_ids(2, 9)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :3] = 0
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        expected = model(ids, attention_mask=attention_mask).logits
        torch.testing.assert_close(compiled(ids, attention_mask=attention_mask).logits, expected)


@pytest.mark.parametrize("cache", [{}, {"cache_implementation": "static"}], ids=["dynamic", "static"])
def test_hybrid_with_a_sliding_attention_layer_generates_with_the_cache_as_without(cache):
    """Linear layers beside a sliding-window layer (window 3, generation runs past it): the cache keeps the window's
    keys and the linear layers' states apart."""
    model = make_model(
        "gpt2", "rope", n_layer=4, layer_types=["linear_attention"] * 3 + ["sliding_attention"], sliding_window=3
    )
    prompt, attention_mask = left_padded_prompt()
    assert_generates_with_cache_as_without(model, prompt, attention_mask, **cache)


def test_transformers_without_linear_attention_cache_layers_is_refused(monkeypatch):
    """Where the installed Transformers' caches have no ``"linear_attention"`` layer (before its hybrids), the config
    says so by name rather than failing in the first cached forward."""
    mapping = {k: v for k, v in cache_utils.DYNAMIC_LAYER_TYPE_MAPPING.items() if k != "linear_attention"}
    monkeypatch.setattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", mapping)
    with pytest.raises(ValueError, match="LinearAttentionLayer cache layers, which Transformers .* does not have"):
        make_config("gpt2", "rope", n_layer=4, layer_types=HYBRID)


def test_transformers_whose_cache_lacks_a_call_the_layers_make_is_refused(monkeypatch):
    """Transformers 5.15 has the cache layer but no ``Cache.get_conv_state``: refused by name when the config is built,
    not an AttributeError in the first cached forward."""
    monkeypatch.delattr(cache_utils.Cache, "get_conv_state")
    with pytest.raises(ValueError, match="missing: get_conv_state"):
        make_config("gpt2", "rope", n_layer=4, layer_types=HYBRID)
