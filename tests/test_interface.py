"""The plug-in interface itself (docs/design.md): cached key positions under beam search and cropping, per-forward
inputs that device hooks can move, family checks at config time, options that decide the backend, and what the
``embed`` hook sees. Schemes defined here exist only to exercise the mechanism."""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import send_to_device
from conftest import FOX_PRO, cache_of, make_config, make_model, random_ids, with_cache
from transformers.cache_utils import DynamicCache, StaticCache

import hf_posenc
from hf_posenc.attention_normalizers import ATTENTION_NORMALIZERS, Softmax
from hf_posenc.modeling_posenc_common import prepare_attention
from hf_posenc.options import Option
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import EmbeddingInputs, LayerPositionTerm, PositionCache, PositionEncoding


ATOL = 1e-5


@pytest.mark.parametrize("scheme", ["t5", "alibi", "fox", FOX_PRO, "path"])
def test_beam_search_with_cache_equals_without_cache(scheme):
    """Beam search reorders the cache every step: the cached key positions (and FoX's per-layer gates, FoX-Pro's
    shift inputs) must follow their keys."""
    model = make_model("gpt2", scheme, attn="sdpa")
    prompt = random_ids(2, 8, seed=3)
    attention_mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]])
    kwargs = dict(attention_mask=attention_mask, num_beams=3, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    cached = model.generate(prompt, use_cache=True, **kwargs)
    assert torch.equal(cached, model.generate(prompt, use_cache=False, **kwargs))


def test_cropped_cache_continues_from_the_kept_positions():
    model = make_model("gpt2", "t5", attn="eager")
    ids = random_ids(1, 10)
    positions = torch.tensor([[0, 1, 2, 3, 4, 20, 21, 22, 23, 24]])
    with torch.no_grad():
        full = model(ids[:, [0, 1, 2, 3, 4, 8, 9]], position_ids=positions[:, [0, 1, 2, 3, 4, 8, 9]]).logits
        cache = cache_of(model(ids[:, :8], position_ids=positions[:, :8], use_cache=True))
        cache.crop(-3)  # drop the tokens at positions 20, 21, 22
        assert cache.get_seq_length() == 5
        tail = model(ids[:, 8:], position_ids=positions[:, 8:], **with_cache(cache)).logits
    torch.testing.assert_close(tail, full[:, 5:], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_everything_passed_between_layers_moves_with_send_to_device(family):
    model = make_model(family, "t5", attn="eager")
    ids = random_ids(2, 6)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 4:] = 0
    embeds = model.get_input_embeddings()(ids)
    inputs = prepare_attention(
        model.base_model,
        model.base_model.position_encoding,
        embeds,
        attention_mask,
        torch.arange(6)[None],
        causal=family == "gpt2",
        attention_dropout=0.0,
    )
    tensors = [v for v in torch.utils._pytree.tree_leaves(inputs) if isinstance(v, torch.Tensor)]
    assert len(tensors) >= 5  # mask, visible, row_has_key, query and key positions
    moved = send_to_device(inputs, "meta")
    moved_tensors = [v for v in torch.utils._pytree.tree_leaves(moved) if isinstance(v, torch.Tensor)]
    assert len(moved_tensors) == len(tensors) and all(t.device.type == "meta" for t in moved_tensors)


class DecoderOnlyScheme(PositionEncoding):
    name = "decoder_only_for_test"
    description = "test double"
    families = ("decoder",)


def test_a_decoder_only_scheme_is_refused_when_the_encoder_config_is_built(monkeypatch):
    monkeypatch.setitem(POSITION_ENCODINGS, DecoderOnlyScheme.name, DecoderOnlyScheme)
    with pytest.raises(ValueError, match=r"'decoder_only_for_test' has no encoder form; it runs in: \['decoder'\]"):
        make_config("bert", DecoderOnlyScheme.name)
    assert make_config("gpt2", DecoderOnlyScheme.name).position_encoding["type"] == DecoderOnlyScheme.name
    config = make_config("bert", DecoderOnlyScheme.name, is_decoder=True)
    assert config.position_encoding["type"] == DecoderOnlyScheme.name
    config.is_decoder = False  # changed after the config was built: refused when the model is built
    with pytest.raises(ValueError, match="has no encoder form"):
        hf_posenc.PosEncBertModel(config)


class GatedSoftmax(Softmax):
    """Softmax with an option that only eager can run (as the Toeplitz gate of every normalizer)."""

    name = "gated_softmax_for_test"
    options = {**Softmax.options, "gate": Option(False, (bool,), "an eager-only option")}

    @classmethod
    def supported_backends(cls, spec):
        return ("eager",) if spec["gate"] else cls.backends


@pytest.mark.parametrize(("gate", "backend"), [(False, "sdpa"), (True, "eager")])
def test_a_normalizer_option_decides_the_backend(monkeypatch, gate, backend):
    monkeypatch.setitem(ATTENTION_NORMALIZERS, GatedSoftmax.name, GatedSoftmax)
    model = make_model("gpt2", "t5", {"type": GatedSoftmax.name, "gate": gate}, attn="sdpa")
    inputs = prepare_attention(
        model.transformer,
        model.transformer.position_encoding,
        model.transformer.wte(random_ids(1, 4)),
        None,
        torch.arange(4)[None],
        causal=True,
        attention_dropout=0.0,
    )
    assert [layer_inputs["backend"] for layer_inputs in inputs] == [backend] * model.config.n_layer


class RunningMeanScheme(PositionEncoding):
    """Adds to each token the mean of the visible inputs up to it (token id 3 counts double): reads the attention
    mask and the token ids, and keeps every input in the cache for the next step."""

    name = "running_mean_for_test"
    description = "test double"
    families = ("decoder",)
    cache_states = ("inputs",)

    def embed(self, inputs: EmbeddingInputs) -> torch.Tensor:
        x = inputs.inputs_embeds
        weight = (1.0 + (inputs.input_ids == 3).float())[..., None]
        q_len = x.shape[1]
        mask = inputs.attention_mask[:, -q_len:, None] if inputs.attention_mask is not None else 1.0
        state = torch.cat([x * weight * mask, mask * torch.ones_like(x[..., :1])], -1)
        if inputs.cache is not None:
            state = inputs.cache.append_state("inputs", state, self)
        running = state.cumsum(1)[:, -q_len:]
        return x + running[..., :-1] / running[..., -1:].clamp(min=1)


def test_embed_sees_ids_mask_and_keeps_state_in_the_cache(monkeypatch):
    monkeypatch.setitem(POSITION_ENCODINGS, RunningMeanScheme.name, RunningMeanScheme)
    model = make_model("gpt2", RunningMeanScheme.name, attn="eager")
    ids = random_ids(2, 9)
    ids[:, 2] = 3
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :2] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=attention_mask).logits
        first = model(ids[:, :5], attention_mask=attention_mask[:, :5], use_cache=True)
        second = model(ids[:, 5:], attention_mask=attention_mask, **with_cache(cache_of(first)))
        embeds = model.transformer.wte(ids)
        doubled = model.transformer.position_encoding.embed(EmbeddingInputs(embeds, torch.arange(9)[None], ids))
        single = model.transformer.position_encoding.embed(EmbeddingInputs(embeds, torch.arange(9)[None], ids + 1))
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), full, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(doubled[:, 2] - single[:, 2], embeds[:, 2] / 3)  # one extra copy in a mean of 3


@pytest.mark.parametrize("static", [False, True])
def test_layer_states_have_their_own_cache_slots_after_the_schemes(static):
    """``PositionCache.append_layer_state``: slot 0 the key positions (slot 1 those of sliding-window layers, unused
    here), then the scheme's states, then the layers' term states (two per layer here), every layer's first state,
    then every layer's second (so terms keeping different numbers of states never share a slot), every slot appended
    to as the keys are and read back whole."""
    scheme = RunningMeanScheme({"type": RunningMeanScheme.name}, None)
    term = LayerPositionTerm()
    term.cache_states = ("first", "second")
    cache = StaticCache(make_config("gpt2"), max_cache_len=5) if static else DynamicCache()
    position_cache = PositionCache(cache, num_layers=2)
    for step, length in enumerate((3, 1)):
        position_cache.append_key_positions(torch.arange(length)[None], 1)
        position_cache.append_state("inputs", torch.full((1, length, 1), -1.0), scheme)
        for layer in range(2):
            for index, name in enumerate(term.cache_states):
                value = torch.full((1, length, 2), 10.0 * layer + index + step / 10)
                stored = position_cache.append_layer_state(name, value, scheme, term, layer)
    assert len(cache.layers) == 2 + 3 + 2 * 2
    for layer in range(2):
        for index in range(2):
            keys = cache.layers[5 + 2 * index + layer].keys[0, 0]
            expected = torch.tensor([10.0 * layer + index] * 3 + [10.0 * layer + index + 0.1] + [0.0] * static)
            torch.testing.assert_close(keys, expected[:, None].expand(-1, 2))
    assert stored.shape == (1, 5 if static else 4, 2)
