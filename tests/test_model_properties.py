"""The behaviour every scheme x normalizer keeps, in both families."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers
from conftest import (
    COMBOS,
    FAMILIES,
    FOX_PRO,
    REPRESENTATIVE_SCHEMES,
    SCHEMES,
    TINY_LLAMA,
    assert_generates_with_cache_as_without,
    assert_same_generation,
    cache_of,
    combos_in_turn_by_family,
    enable_activation_checkpointing,
    family_combos,
    forward_in_two_chunks,
    generate_kwargs,
    left_padded_prompt,
    make_config,
    make_model,
    normalizer_supports,
    random_ids,
    supports,
    with_cache,
)

from hf_posenc.attention_normalizers import ATTENTION_NORMALIZERS
from hf_posenc.configuration_posenc import layer_position_specs
from hf_posenc.position_encodings import POSITION_ENCODINGS


ATOL = 1e-5
FAMILY_COMBOS = family_combos(COMBOS)
DECODER_COMBOS = [combo for combo in COMBOS if supports("gpt2", combo[0])]
FAMILY_SCHEMES = [(family, scheme) for family in FAMILIES for scheme in SCHEMES if supports(family, scheme)]
# Options that may change whether a scheme is relative, besides every scheme's defaults.
OPTION_VARIANTS = [
    {"type": "rope", "apply_to_value": True},
    {"type": "rope", "scaling": {"type": "dynamic", "factor": 2.0, "original_max_positions": 8}},
    {"type": "rope", "scaling": {"type": "yarn", "factor": 2.0, "original_max_positions": 8}},
    {"type": "rope", "scaling": {"type": "linear", "factor": 2.0}},
    {"type": "rope", "kept_frequency_fraction": 0.5},
    {"type": "rope", "vo_rope": True},
]


def is_relative(family: str, position_encoding) -> bool:
    """The scheme's own flag for these options (``PositionEncoding.is_relative``); a per-layer layout is relative
    when every layer's scheme is."""
    config = make_config(family, position_encoding)
    specs = layer_position_specs(config.position_encoding, config.num_hidden_layers)
    return all(POSITION_ENCODINGS[spec["type"]].is_relative(spec) for spec in specs)


SHIFT_CASES = FAMILY_COMBOS + [(family, spec, "softmax") for family in FAMILIES for spec in OPTION_VARIANTS]
RELATIVE_COMBOS = [case for case in SHIFT_CASES if is_relative(*case[:2])]
ABSOLUTE_VARIANTS = [
    (family, spec) for family in FAMILIES for spec in OPTION_VARIANTS if not is_relative(family, spec)
]


def one_setting_each(cases: list[tuple], settings: list[tuple]) -> list[tuple]:
    """Each case once, with the settings in turn: every case and every setting run (each setting with a spread of
    schemes and normalizers), not their cross product."""
    return [(*case, *settings[index % len(settings)]) for index, case in enumerate(cases)]


def hf_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions as `generate` makes them: count only real tokens, so left padding does not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# Every combination in each family, on one padding side and backend in turn (both sides on both backends).
PADDED_BATCH_CASES = one_setting_each(
    FAMILY_COMBOS, [("left", "sdpa"), ("right", "eager"), ("left", "eager"), ("right", "sdpa")]
)


@pytest.mark.parametrize(("family", "scheme", "normalizer", "padding_side", "attn"), PADDED_BATCH_CASES)
def test_row_alone_equals_row_in_padded_batch(family, scheme, normalizer, padding_side, attn):
    model = make_model(family, scheme, normalizer, attn=attn)
    short, full = random_ids(1, 7, seed=1), random_ids(1, 11, seed=2)
    pad = torch.zeros(1, 4, dtype=torch.long)
    padded = torch.cat([short, pad], 1) if padding_side == "right" else torch.cat([pad, short], 1)
    batch = torch.cat([padded, full])
    mask = (torch.arange(11) < 7) if padding_side == "right" else (torch.arange(11) >= 4)
    attention_mask = torch.stack([mask, torch.ones(11, dtype=torch.bool)]).long()
    with torch.no_grad():
        alone = model(short).logits[0]
        in_batch = model(batch, attention_mask=attention_mask, position_ids=hf_position_ids(attention_mask)).logits
        full_alone = model(full).logits[0]
    torch.testing.assert_close(in_batch[0][mask.bool()], alone, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(in_batch[1], full_alone, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize(("scheme", "normalizer"), DECODER_COMBOS)
def test_generate_with_cache_equals_without_cache(scheme, normalizer):
    model = make_model("gpt2", scheme, normalizer, attn="sdpa")
    prompt = random_ids(2, 6, seed=3)
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :2] = 0  # left padding, as generate expects
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    kwargs.update(output_scores=True, return_dict_in_generate=True)
    with recorded_input_lengths(model) as lengths:
        cached = model.generate(prompt, use_cache=True, **kwargs)
    assert lengths == [6] + [1] * 7  # the prompt, then one new token per step: the cache is used
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert cached.sequences.shape == (2, 14)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(cached.scores), torch.stack(uncached.scores), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize(("scheme", "normalizer"), DECODER_COMBOS)
def test_cached_forward_continues_positions(scheme, normalizer):
    """Feeding a sequence in two chunks through the KV cache gives the logits of one full forward."""
    model = make_model("gpt2", scheme, normalizer, attn="eager")
    chunked, full, _ = forward_in_two_chunks(model, random_ids(2, 12, seed=4), 7)
    torch.testing.assert_close(chunked, full, atol=ATOL, rtol=1e-4)


# Every scheme and layout in each family; every other normalizer with the representative absolute scheme in the
# encoder and the relative one in the decoder (its parameters are saved alike in both), both there if causal-only.
SAVE_CASES = [
    (family, scheme, normalizer)
    for family, scheme, normalizer in FAMILY_COMBOS
    if normalizer == "softmax"
    or not normalizer_supports("bert", normalizer)
    or scheme == REPRESENTATIVE_SCHEMES[family == "gpt2"]
]


@pytest.mark.parametrize(("family", "scheme", "normalizer"), SAVE_CASES)
def test_save_pretrained_round_trip_is_exact(family, scheme, normalizer, tmp_path):
    model = make_model(family, scheme, normalizer)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    reloaded = auto.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(reloaded) is type(model)
    assert reloaded.config.position_encoding == model.config.position_encoding
    assert reloaded.config.attention_normalizer == model.config.attention_normalizer
    ids = random_ids(2, 9)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)


@pytest.mark.parametrize(("family", "scheme", "normalizer"), FAMILY_COMBOS)
def test_eager_sdpa_flex_agree(family, scheme, normalizer):
    ids = random_ids(2, 10)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 7:] = 0
    logits = {}
    for attn in ("eager", "sdpa", "flex_attention"):
        model = make_model(family, scheme, normalizer, attn=attn)
        with torch.no_grad():  # compiled FlexAttention on CPU is inference-only
            logits[attn] = model(ids, attention_mask=attention_mask).logits
    visible = attention_mask.bool()
    for attn in ("sdpa", "flex_attention"):
        torch.testing.assert_close(logits[attn][visible], logits["eager"][visible], atol=ATOL, rtol=1e-4)


def logits_before_and_after_a_shift(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the same ids at positions 0..8 and at 13..21."""
    ids = random_ids(2, 9)
    positions = torch.arange(9)[None]
    with torch.no_grad():
        return model(ids, position_ids=positions).logits, model(ids, position_ids=positions + 13).logits


@pytest.mark.parametrize(("family", "scheme", "normalizer"), RELATIVE_COMBOS)
def test_relative_schemes_are_shift_invariant(family, scheme, normalizer):
    model = make_model(family, scheme, normalizer)
    base, shifted = logits_before_and_after_a_shift(model)
    torch.testing.assert_close(shifted, base, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize(("family", "position_encoding"), ABSOLUTE_VARIANTS)
def test_options_that_make_a_scheme_absolute_are_seen_by_a_shift(family, position_encoding):
    """rope with ``apply_to_value`` or ``dynamic`` scaling is flagged absolute, and a shift does change it."""
    assert [spec for f, spec in ABSOLUTE_VARIANTS if f == family] == OPTION_VARIANTS[:2]
    model = make_model(family, position_encoding)
    base, shifted = logits_before_and_after_a_shift(model)
    assert (shifted - base).abs().max() > 1e-3


@pytest.mark.parametrize("scheme", ["learned", "sinusoidal"])
def test_absolute_schemes_see_the_shift(family, scheme):
    """The control for the test above: absolute schemes must change when positions move."""
    model = make_model(family, scheme)
    base, shifted = logits_before_and_after_a_shift(model)
    assert (shifted - base).abs().max() > 1e-3


# Every combination in each family, on eager and SDPA in turn.
EAGER_OR_SDPA_CASES = one_setting_each(FAMILY_COMBOS, [("sdpa",), ("eager",)])


@pytest.mark.parametrize(("family", "scheme", "normalizer", "attn"), EAGER_OR_SDPA_CASES)
def test_fully_masked_rows_give_no_nan(family, scheme, normalizer, attn):
    """BERT: a row whose mask is all zeros; GPT-2: left padding, whose pad queries see no key."""
    model = make_model(family, scheme, normalizer, attn=attn)
    ids = random_ids(2, 8)
    attention_mask = torch.ones_like(ids)
    if family == "bert":
        attention_mask[0] = 0
    else:
        attention_mask[0, :3] = 0
    model.train()  # gradients must stay finite too
    output = model(ids, attention_mask=attention_mask, labels=ids)
    output.loss.backward()
    assert torch.isfinite(output.logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# Every combination in each family, with the reentrant and the non-reentrant checkpointing in turn.
@pytest.mark.parametrize(
    ("family", "scheme", "normalizer", "use_reentrant"), one_setting_each(FAMILY_COMBOS, [(True,), (False,)])
)
def test_gradient_checkpointing_gives_the_same_gradients(family, scheme, normalizer, use_reentrant):
    """Both activation-checkpointing modes; the reentrant one differentiates only through the tensors a layer gets
    as arguments, so a position bias shared by all layers must reach each layer as one."""
    ids = random_ids(2, 8)
    grads = []
    for checkpointing in (False, True):
        model = make_model(family, scheme, normalizer, attn="sdpa").train()
        if checkpointing:
            assert enable_activation_checkpointing(model, use_reentrant)
        model(ids, labels=ids).loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-4, msg=name)


# Each combination in one family, the encoder and the decoder in turn: the rounding is the scheme's and the
# normalizer's.
@pytest.mark.parametrize(("family", "scheme", "normalizer"), combos_in_turn_by_family(COMBOS))
def test_bfloat16_matches_float32(family, scheme, normalizer):
    model = make_model(family, scheme, normalizer, attn="sdpa")
    ids = random_ids(2, 8)
    with torch.no_grad():
        reference = model(ids).logits
        low = model.to(torch.bfloat16)(ids).logits
    assert low.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: unnormalised weights (exp, relu2) carry its rounding into the logits, where
    # other random draws of these tiny models reached 0.11-0.22 on up to 1% of the logits (exp, relu2 with t5).
    torch.testing.assert_close(low.float(), reference, atol=0.2, rtol=0.05)


@pytest.mark.parametrize("scheme", ["t5", "rope"])
def test_flex_gives_zero_for_a_fully_masked_row_like_eager(scheme):
    ids = random_ids(2, 10)
    attention_mask = torch.ones_like(ids)
    attention_mask[0] = 0
    outputs = {}
    for attn in ("eager", "flex_attention"):
        model = make_model("bert", scheme, attn=attn)
        with torch.no_grad():
            outputs[attn] = model.bert(ids, attention_mask=attention_mask).last_hidden_state
    assert torch.isfinite(outputs["flex_attention"]).all()
    torch.testing.assert_close(outputs["flex_attention"], outputs["eager"], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize(("scheme", "normalizer"), DECODER_COMBOS)
def test_generate_for_a_left_padded_batch_equals_each_row_alone(scheme, normalizer):
    model = make_model("gpt2", scheme, normalizer, attn="sdpa")
    short, long = random_ids(1, 4, seed=5), random_ids(1, 7, seed=6)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    attention_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    together = model.generate(batch, attention_mask=attention_mask, **kwargs)
    assert torch.equal(together[0, 3:], model.generate(short, **kwargs)[0])
    assert torch.equal(together[1], model.generate(long, **kwargs)[0])


@pytest.mark.parametrize(("family", "scheme"), FAMILY_SCHEMES)
def test_one_dimensional_position_ids_serve_every_row(family, scheme):
    model = make_model(family, scheme)
    ids = random_ids(2, 6)
    with torch.no_grad():
        flat = model(ids, position_ids=torch.arange(3, 9)).logits
        batched = model(ids, position_ids=torch.arange(3, 9)[None].expand(2, -1)).logits
    torch.testing.assert_close(flat, batched)
    with pytest.raises(ValueError, match=r"position_ids must be \(batch, seq\) or \(seq,\) with seq = 6"):
        model(ids, position_ids=torch.arange(5))


@pytest.mark.parametrize(("scheme", "kwargs"), [("rope", {}), ("alibi", {"n_head": 6, "n_embd": 48})])
def test_bfloat16_cast_round_trips_exactly(scheme, kwargs, tmp_path):
    """Fixed tables are not buffers a cast would round: a bf16-cast model and its bf16 reload agree bit for bit."""
    model = make_model("gpt2", scheme, **kwargs).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    ids = random_ids(1, 30)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)


def test_flex_attention_on_float64_falls_back_with_the_same_numbers():
    ids = random_ids(2, 8)
    with torch.no_grad():
        flex = make_model("bert", "t5", attn="flex_attention").double()(ids).logits
        eager = make_model("bert", "t5", attn="eager").double()(ids).logits
    torch.testing.assert_close(flex, eager)


@contextlib.contextmanager
def recorded_input_lengths(model):
    """The number of tokens each forward of ``model``'s base model receives, in call order."""
    lengths = []

    def record(module, args, kwargs):
        tokens = kwargs.get("input_ids", args[0] if args else None)
        lengths.append((tokens if tokens is not None else kwargs["inputs_embeds"]).shape[1])

    handle = model.base_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield lengths
    finally:
        handle.remove()


@pytest.mark.parametrize(("scheme", "normalizer"), DECODER_COMBOS)
def test_generate_with_a_gapped_mask_equals_without_cache(scheme, normalizer):
    """A mask with a hole: generate's positions are not contiguous, so cached keys must keep theirs."""
    model = make_model("gpt2", scheme, normalizer, attn="sdpa")
    attention_mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]])
    assert_generates_with_cache_as_without(model, random_ids(2, 8, seed=3), attention_mask)


@pytest.mark.parametrize(("scheme", "normalizer"), DECODER_COMBOS)
def test_chunked_forward_with_non_contiguous_positions_equals_one_forward(scheme, normalizer):
    model = make_model("gpt2", scheme, normalizer, attn="eager")
    ids = random_ids(2, 7, seed=4)
    positions = torch.tensor([[0, 1, 2, 3, 10, 11, 12], [5, 6, 7, 9, 10, 20, 21]])
    with torch.no_grad():
        full = model(ids, position_ids=positions).logits
        first = model(ids[:, :4], position_ids=positions[:, :4], use_cache=True)
        second = model(ids[:, 4:], position_ids=positions[:, 4:], **with_cache(cache_of(first)))
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), full, atol=ATOL, rtol=1e-4)


# The decoder combinations, the fixed sink and the Toeplitz gate (a table read at the cached keys' positions).
STATIC_CACHE_COMBOS = DECODER_COMBOS + [
    (scheme, normalizer)
    for scheme in REPRESENTATIVE_SCHEMES
    for normalizer in ({"type": "softmax", "sink": 0.0}, {"type": "softmax", "toeplitz_gate": True})
]


# Every static-cache combination on one backend in turn: each backend with a spread of schemes and normalizers.
@pytest.mark.parametrize(
    ("scheme", "normalizer", "attn"),
    one_setting_each(STATIC_CACHE_COMBOS, [("flex_attention",), ("sdpa",), ("eager",)]),
)
def test_static_cache_prefill_equals_the_uncached_forward(scheme, normalizer, attn, uncompiled_flex):
    """A prompt prefilled into a static cache longer than it: Transformers builds no mask when nothing is padded
    (SDPA's is_causal, top-left aligned, hides the unwritten slots); every backend must hide them too."""
    model = make_model("gpt2", scheme, normalizer, attn=attn)
    ids = random_ids(2, 6, seed=7)
    with torch.no_grad():
        expected = model(ids).logits
        uncompiled_flex.clear()
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        prefilled = model(ids, **with_cache(cache), use_cache=True).logits
    torch.testing.assert_close(prefilled, expected, atol=ATOL, rtol=1e-4)
    assert bool(uncompiled_flex) == (attn == "flex_attention" and prefills_on_flex(model.config))


def prefills_on_flex(config) -> bool:
    """Whether a layer's scheme and the normalizer list FlexAttention, and no value term sends that layer's cached
    forward to SDPA."""
    normalizer_spec = config.attention_normalizer
    normalizer_backends = set(ATTENTION_NORMALIZERS[normalizer_spec["type"]].supported_backends(normalizer_spec))

    def layer_on_flex(spec: dict) -> bool:
        scheme_class = POSITION_ENCODINGS[spec["type"]]
        listed = set(scheme_class.supported_backends(spec)) & normalizer_backends
        return "flex_attention" in listed and not scheme_class.has_value_term(spec)

    return any(map(layer_on_flex, layer_position_specs(config.position_encoding, config.num_hidden_layers)))


# Every static-cache combination, on one backend and padding in turn (each pair of them with a spread of schemes).
@pytest.mark.parametrize(
    ("scheme", "normalizer", "attn", "padding"),
    one_setting_each(STATIC_CACHE_COMBOS, [("sdpa", "left"), ("eager", "none"), ("sdpa", "none"), ("eager", "left")]),
)
def test_static_cache_generation_equals_dynamic_cache_generation(scheme, normalizer, attn, padding):
    """Without padding the static prefill gets no mask from Transformers (see the prefill test above). A flex
    request decodes (one token a step) on SDPA: its prefill is the test above's."""
    model = make_model("gpt2", scheme, normalizer, attn=attn)
    prompt = random_ids(2, 6, seed=3)
    attention_mask = torch.ones_like(prompt)
    if padding == "left":
        attention_mask[1, :2] = 0
    kwargs = dict(attention_mask=attention_mask, **generate_kwargs())
    with recorded_input_lengths(model) as lengths:
        static = model.generate(prompt, cache_implementation="static", **kwargs)
    assert lengths == [6] + [1] * 7
    assert_same_generation(static, model.generate(prompt, **kwargs))


def four_d_masks(attention_mask: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The boolean ``(batch, 1, q, k)`` mask equal to a 2-D padding mask, and its additive float form."""
    n = attention_mask.shape[1]
    visible = attention_mask.bool()[:, None, None, :].expand(-1, 1, n, n)
    if causal:
        visible = visible & torch.ones(n, n, dtype=torch.bool).tril()
    additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    return visible, additive


@pytest.mark.parametrize(("family", "scheme", "normalizer", "attn"), EAGER_OR_SDPA_CASES)
def test_four_d_boolean_and_additive_masks_equal_the_two_d_mask(family, scheme, normalizer, attn):
    model = make_model(family, scheme, normalizer, attn=attn)
    ids = random_ids(2, 9)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 6:] = 0
    boolean, additive = four_d_masks(attention_mask, causal=family == "gpt2")
    with torch.no_grad():
        expected = model(ids, attention_mask=attention_mask).logits
        for mask in (boolean, additive):
            torch.testing.assert_close(model(ids, attention_mask=mask).logits, expected, atol=ATOL, rtol=1e-4)


# Inductor compiles in few cases: a score bias in the encoder, a rotation in the decoder, each with padding.
@pytest.mark.parametrize(("family", "scheme"), [("bert", "t5"), ("gpt2", "rope")])
def test_compiled_fullgraph_forward_equals_eager_mode(family, scheme):
    model = make_model(family, scheme, attn="sdpa")
    ids = random_ids(2, 9)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :3] = 0
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        expected = model(ids, attention_mask=attention_mask).logits
        torch.testing.assert_close(compiled(ids, attention_mask=attention_mask).logits, expected, atol=ATOL, rtol=1e-4)


# Every layer windowed (the caches evict past the window: keys, positions and a scheme's own states), and a sliding
# layer beside a full one. Windows of 4 tokens; generation runs past them.
EVERY_LAYER_WINDOWED = {"sliding": dict(sliding_window=4), "chunked": dict(attention_chunk_size=4)}
WINDOWED_LAYOUTS = {
    **EVERY_LAYER_WINDOWED,
    "sliding_and_full": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4),
}


# Every decoder combination, with one window kind and cache in turn (each pair of them with a spread of schemes).
@pytest.mark.parametrize(
    ("scheme", "normalizer", "window", "cache_implementation"),
    one_setting_each(
        DECODER_COMBOS, [("sliding", "dynamic"), ("chunked", "static"), ("sliding", "static"), ("chunked", "dynamic")]
    ),
)
def test_every_layer_windowed_generates_past_the_window_with_cache_as_without(
    scheme, normalizer, window, cache_implementation
):
    """No full layer keeps every token: what a scheme keeps with the cache (``conv``'s inputs) lives in a windowed
    cache layer, which evicts its oldest tokens as the attention layers do."""
    model = make_model("gpt2", scheme, normalizer, attn="sdpa", **EVERY_LAYER_WINDOWED[window])
    assert_generates_with_cache_as_without(model, *left_padded_prompt(), cache_implementation=cache_implementation)


def repeating_prompt() -> torch.Tensor:
    """A prompt whose n-grams repeat, so that prompt lookup proposes candidates (some rejected: the cache is
    cropped back past the window)."""
    return torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])


# Every decoder combination, with one windowed layout in turn.
@pytest.mark.parametrize(
    ("scheme", "normalizer", "layout"), one_setting_each(DECODER_COMBOS, [(layout,) for layout in WINDOWED_LAYOUTS])
)
def test_assisted_decoding_with_windowed_layers_equals_greedy_decoding(scheme, normalizer, layout):
    """``generate(prompt_lookup_num_tokens=...)`` records the cache's past before the first forward and crops the
    rejected candidates, past the window; the extra cache layers that keep positions and states must record too."""
    model = make_model("gpt2", scheme, normalizer, attn="sdpa", **WINDOWED_LAYOUTS[layout])
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    greedy = model.generate(repeating_prompt(), **kwargs)
    assert torch.equal(model.generate(repeating_prompt(), prompt_lookup_num_tokens=3, **kwargs), greedy)


# A rotation, a scheme keeping inputs in the cache and one keeping per-layer states, each with another layout.
@pytest.mark.parametrize(("scheme", "layout"), [("rope", "sliding"), ("conv", "chunked"), ("fox", "sliding_and_full")])
def test_decoding_with_an_assistant_model_and_windowed_layers_equals_greedy_decoding(scheme, layout):
    """An assistant model's cache records its past from its creation; both models have windowed layers."""
    model = make_model("gpt2", scheme, attn="sdpa", **WINDOWED_LAYOUTS[layout])
    assistant = make_model("gpt2", scheme, attn="sdpa", seed=1, **WINDOWED_LAYOUTS[layout])
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    greedy = model.generate(repeating_prompt(), **kwargs)
    assert torch.equal(model.generate(repeating_prompt(), assistant_model=assistant, **kwargs), greedy)


def test_stock_mistral_with_a_window_decodes_with_prompt_lookup_as_greedy():
    """The reference behaviour of the two tests above: Transformers' own windowed model."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(**TINY_LLAMA, sliding_window=4)
    model = transformers.MistralForCausalLM(config).eval()
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    greedy = model.generate(repeating_prompt(), **kwargs)
    assert torch.equal(model.generate(repeating_prompt(), prompt_lookup_num_tokens=3, **kwargs), greedy)


def test_a_scheme_reading_past_every_layer_window_is_refused():
    """``conv`` reads ``kernel_size - 1`` tokens back; with every layer windowed its inputs are kept as the widest
    window keeps its keys (``window - 1`` tokens before the current ones)."""
    make_config("gpt2", {"type": "conv", "kernel_size": 4}, sliding_window=4)
    make_config(
        "gpt2",
        {"type": "conv", "kernel_size": 5},
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
    )
    with pytest.raises(ValueError, match=r"'conv' reads the 4 tokens .* the widest window \(4 tokens\) keeps 3"):
        make_config("gpt2", {"type": "conv", "kernel_size": 5}, sliding_window=4)


# The attention-shape options (``use_qk_norm``, ``attn_logit_softcapping``, ``canon_layers``) with a representative
# absolute and relative scheme, a rotation and a content term, and normalizers beyond softmax: the options act on q, k,
# the scores and the layer's inputs, whatever feeds them; both with every layer sliding and a per-layer layout. A cap
# of 1 acts on these models' scores.
ATTENTION_OPTIONS = [
    {"use_qk_norm": True},
    {"attn_logit_softcapping": 1.0},
    {"use_qk_norm": True, "attn_logit_softcapping": 1.0, "sliding_window": 4},
    {"canon_layers": "ABCD"},
]
# FoX-Pro less its own QK-norm, which beside the config's use_qk_norm would be asked for twice (refused).
FOX_PRO_LESS_QK_NORM = {**FOX_PRO, "use_qk_norm": False}
OPTION_COMBOS = [
    (scheme, "softmax") for scheme in [*REPRESENTATIVE_SCHEMES, "rope", "shaw", ["rope", "t5"], FOX_PRO_LESS_QK_NORM]
] + [
    ("t5", "differential"),
    ("t5", "stick_breaking"),
    ("rope", {"type": "softmax", "sink": "learned"}),
]
# Each combination in each family with one set of options in turn (every option with a spread of combinations);
# in the decoder, each combination with every set of options, on a dynamic and a static cache in turn.
FAMILY_OPTION_CASES = one_setting_each(family_combos(OPTION_COMBOS), [(options,) for options in ATTENTION_OPTIONS])
DECODER_OPTION_CASES = one_setting_each(
    [(*combo, options) for combo in OPTION_COMBOS for options in ATTENTION_OPTIONS], [("dynamic",), ("static",)]
)


def option_id(value):
    return "+".join(value) if isinstance(value, dict) and "type" not in value else None


@pytest.mark.parametrize(
    ("scheme", "normalizer", "options", "cache_implementation"), DECODER_OPTION_CASES, ids=option_id
)
def test_attention_options_generate_with_cache_as_without(scheme, normalizer, options, cache_implementation):
    model = make_model("gpt2", scheme, normalizer, attn="sdpa", **options)
    assert_generates_with_cache_as_without(model, *left_padded_prompt(), cache_implementation=cache_implementation)


@pytest.mark.parametrize(("family", "scheme", "normalizer", "options"), FAMILY_OPTION_CASES, ids=option_id)
def test_attention_options_give_the_same_numbers_on_every_backend(family, scheme, normalizer, options):
    ids = random_ids(2, 10)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 7:] = 0
    logits = {}
    for attn in ("eager", "sdpa", "flex_attention"):
        model = make_model(family, scheme, normalizer, attn=attn, **options)
        with torch.no_grad():
            logits[attn] = model(ids, attention_mask=attention_mask).logits
    visible = attention_mask.bool()
    for attn in ("sdpa", "flex_attention"):
        torch.testing.assert_close(logits[attn][visible], logits["eager"][visible], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize(("family", "scheme", "normalizer", "options"), FAMILY_OPTION_CASES, ids=option_id)
def test_attention_options_keep_a_row_alone_equal_to_the_row_in_a_padded_batch(family, scheme, normalizer, options):
    model = make_model(family, scheme, normalizer, attn="sdpa", **options)
    short, full = random_ids(1, 7, seed=1), random_ids(1, 11, seed=2)
    pad = torch.zeros(1, 4, dtype=torch.long)
    padded = torch.cat([short, pad], 1) if family == "bert" else torch.cat([pad, short], 1)
    mask = (torch.arange(11) < 7) if family == "bert" else (torch.arange(11) >= 4)
    attention_mask = torch.stack([mask, torch.ones(11, dtype=torch.bool)]).long()
    with torch.no_grad():
        alone = model(short).logits[0]
        in_batch = model(
            torch.cat([padded, full]), attention_mask=attention_mask, position_ids=hf_position_ids(attention_mask)
        ).logits
    torch.testing.assert_close(in_batch[0][mask], alone, atol=ATOL, rtol=1e-4)
