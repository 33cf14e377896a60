"""Per-layer layouts: ``position_encoding`` as a list of specs (one per attention layer), Transformers' Llama 4 /
SmolLM3 ``no_rope_layers`` convention, and Llama 4's attention temperature on NoPE layers. The behaviours every
combination keeps (cache, padding, backends, checkpointing, save/load, bf16) run on the layouts of
``conftest.LAYOUTS`` in ``test_model_properties.py``."""

from __future__ import annotations

import importlib
import json
import re

import pytest
import torch
import transformers
from conftest import (
    assert_generates_with_cache_as_without,
    enable_activation_checkpointing,
    forward_in_two_chunks,
    left_padded_prompt,
    make_config,
    make_model,
    random_ids,
    with_cache,
)
from packaging import version
from transformers import GPT2Config, GPT2LMHeadModel, Llama4TextConfig, SmolLM3Config
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import hf_posenc
from hf_posenc.absolute_encodings import attention_temperature
from hf_posenc.configuration_posenc import (
    PER_LAYER_CACHE_WINDOWS,
    check_linear_attention_support,
)
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import PositionCache


TEMPERATURE = {"type": "none", "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.5}


def test_a_per_layer_list_is_stored_as_full_specs(tmp_path):
    config = make_config("gpt2", ["rope", {"type": "t5", "num_buckets": 8}])
    config.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())["position_encoding"]
    assert [spec["type"] for spec in stored] == ["rope", "t5"]
    assert stored[0]["theta"] == 10000.0 and stored[1]["num_buckets"] == 8 and stored[1]["max_distance"] == 128
    assert hf_posenc.PosEncGPT2Config.from_pretrained(tmp_path).position_encoding == stored


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (["rope"], r"one spec per attention layer: 2 \(num_hidden_layers\); got 1"),
        (["learned", "rope"], r"\['learned'\], which act once on the input embeddings"),
        (["rope", "sinusoidal"], r"\['sinusoidal'\], which act once on the input embeddings"),
        (["rope", "rotary"], r"Unknown position_encoding 'rotary'"),
    ],
)
def test_a_bad_per_layer_list_is_refused_when_the_config_is_built(family, value, message):
    with pytest.raises(ValueError, match=message):
        make_config(family, value)


def test_an_input_side_scheme_on_every_layer_is_that_scheme():
    model = make_model("gpt2", ["learned", "learned"])
    assert type(model.transformer.position_encoding).__name__ == "LearnedAbsolute"
    assert "transformer.position_encoding.table.weight" in model.state_dict()


def test_layers_with_equal_specs_share_the_scheme_and_its_parameters():
    model = make_model("bert", ["t5", "rope", "t5"], num_hidden_layers=3)
    encoding = model.bert.position_encoding
    assert encoding.layer_encoding(0) is encoding.layer_encoding(2)
    assert [name for name, _ in encoding.named_parameters()] == ["schemes.0.relative_attention_steps.weight"]


@pytest.mark.parametrize(("layers", "interval"), [(8, 4), (6, 2), (5, 3)])
def test_no_rope_layer_interval_places_nope_layers_as_llama4_and_smollm3_do(layers, interval):
    config = make_config("gpt2", "rope", n_layer=layers, no_rope_layer_interval=interval)
    for reference in (
        Llama4TextConfig(num_hidden_layers=layers, no_rope_layer_interval=interval),
        SmolLM3Config(num_hidden_layers=layers, no_rope_layer_interval=interval),
    ):
        uses_rope = [spec["type"] == "rope" for spec in config.position_encoding]
        assert uses_rope == [bool(flag) for flag in reference.no_rope_layers]


LAYERS = {"gpt2": "n_layer", "bert": "num_hidden_layers"}


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_layout_presets_are_the_reference_configs_layouts(family):
    """Each preset against the reference's own config: Llama 4's and SmolLM3's ``no_rope_layers`` and ``rope_theta``
    (Transformers' ``Llama4TextConfig`` / ``SmolLM3Config`` defaults), Llama 4's temperature switched on where it
    drops RoPE; RNoPE-SWA written out (three sliding rope layers, then a full NoPE one)."""
    layers = 8
    llama4, smollm3 = Llama4TextConfig(num_hidden_layers=layers), SmolLM3Config(num_hidden_layers=layers)
    decoder = {"is_decoder": True} if family == "bert" else {}  # chunked attention is causal
    for name, reference in (("irope", llama4), ("smollm3", smollm3)):
        chunk = llama4.attention_chunk_size if name == "irope" else None
        preset = hf_posenc.layout_preset(name, layers, attention_chunk_size=chunk)
        config = make_config(family, **preset, **decoder, **{LAYERS[family]: layers})
        specs = config.position_encoding
        assert [spec["type"] == "rope" for spec in specs] == [bool(flag) for flag in reference.no_rope_layers]
        assert {spec["theta"] for spec in specs if spec["type"] == "rope"} == {reference.rope_parameters["rope_theta"]}
        nope = [spec["attn_temperature_tuning"] for spec in specs if spec["type"] == "none"]
        assert nope == [name == "irope"] * 2
        assert config.sliding_window is None
        assert config.attention_chunk_size == chunk
    # Llama 4's layer_types, which Transformers builds from its NoPE layers: chunked where RoPE is, full elsewhere.
    irope = make_config(
        family, **hf_posenc.layout_preset("irope", 6, attention_chunk_size=16), **decoder, **{LAYERS[family]: 6}
    )
    reference = Llama4TextConfig(num_hidden_layers=6, attention_chunk_size=16)
    assert irope.layer_types == reference.layer_types and "full_attention" in irope.layer_types
    assert irope.attention_chunk_size == reference.attention_chunk_size
    assert (
        make_config(family, **hf_posenc.layout_preset("smollm3", layers), **{LAYERS[family]: layers}).layer_types
        is None
    )
    config = make_config(family, **hf_posenc.layout_preset("rnope_swa", layers, 16), **{LAYERS[family]: layers})
    assert [spec["type"] for spec in config.position_encoding] == ["rope", "rope", "rope", "none"] * 2
    assert config.layer_types == ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + [
        "full_attention"
    ]
    assert config.sliding_window == 16


HYBRID_REFERENCES = {
    "qwen3_next": "Qwen3NextConfig",
    "qwen3_5": "Qwen3_5TextConfig",
    "olmo_hybrid": "OlmoHybridConfig",
    "kimi_linear": "KimiLinearConfig",
}


def linear_attention_support() -> str | None:
    """Why this Transformers cannot build a ``"linear_attention"`` layer, or None where it can."""
    try:
        check_linear_attention_support()
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("name", HYBRID_REFERENCES)
def test_hybrid_presets_are_the_reference_configs_layouts(name):
    """Each hybrid preset against the Transformers config it names, built with its defaults at 8 and 13 layers: the
    same ``layer_types`` (Transformers' own rule: every fourth layer from the fourth, Kimi Linear's from the fifth),
    and the attention layers' positions as the reference's attention applies them (the rotary fraction and theta of
    its ``rope_parameters``; none for Kimi Linear, whose MLA has no rotary module)."""
    reference_class = getattr(transformers, HYBRID_REFERENCES[name], None)
    if reference_class is None:
        pytest.skip(f"Transformers {transformers.__version__} has no {HYBRID_REFERENCES[name]}")
    for layers in (8, 13):
        reference = reference_class(num_hidden_layers=layers)
        preset = hf_posenc.layout_preset(name, layers)
        assert preset["layer_types"] == list(reference.layer_types)
        attention = preset["position_encoding"]
        rope_parameters = getattr(reference, "rope_parameters", None)
        if name == "kimi_linear":
            assert attention == {"type": "none"}
            kimi = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
            assert not hasattr(kimi, "apply_rotary_pos_emb")  # its MLA's rotary slice is never rotated
        else:
            assert attention["theta"] == rope_parameters["rope_theta"]
            assert attention.get("rotary_fraction", 1.0) == rope_parameters.get("partial_rotary_factor", 1.0)
    reason = linear_attention_support()
    if reason is not None:
        with pytest.raises(ValueError, match="LinearAttentionLayer"):
            make_config("gpt2", **hf_posenc.layout_preset(name, 4), n_layer=4)
        return
    model = make_model("gpt2", **hf_posenc.layout_preset(name, 8), n_layer=8)
    assert model.config.linear_attention["type"] == "gated_deltanet"
    mixers = ["attention" if block.linear_attn is None else "linear_attention" for block in model.transformer.h]
    assert mixers == ["attention" if kind == "full_attention" else kind for kind in model.config.layer_types]
    assert torch.isfinite(model(random_ids(2, 9)).logits).all()
    with pytest.raises(ValueError, match="PosEnc BERT has no 'linear_attention' layer"):
        make_config("bert", **hf_posenc.layout_preset(name, 8), num_hidden_layers=8, is_decoder=True)


@pytest.mark.parametrize(
    ("name", "window", "chunk", "message"),
    [
        ("rnope_swa", None, None, "layout 'rnope_swa' slides on its rope layers: give sliding_window"),
        ("smollm3", 16, None, "layout 'smollm3' has no sliding-window layers; sliding_window=16 is unused"),
        (
            "chunked",
            None,
            None,
            "Unknown layout 'chunked'; valid choices: ['irope', 'kimi_linear', 'olmo_hybrid', 'qwen3_5', "
            "'qwen3_next', 'rnope_swa', 'smollm3']",
        ),
        ("irope", None, None, "layout 'irope' has chunked attention on its rope layers: give attention_chunk_size"),
        ("irope", 16, 8, "layout 'irope' has no sliding-window layers; sliding_window=16 is unused"),
        ("rnope_swa", 16, 8, "layout 'rnope_swa' has no chunked-attention layers; attention_chunk_size=8 is unused"),
        ("kimi_linear", None, None, "layout 'kimi_linear' puts its first attention layer at layer 4 (from 0), so 4"),
        ("qwen3_next", 16, None, "layout 'qwen3_next' has no sliding-window layers; sliding_window=16 is unused"),
    ],
)
def test_a_layout_preset_refuses_what_it_cannot_use(name, window, chunk, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        hf_posenc.layout_preset(name, 4, window, chunk)


def test_a_presets_layer_types_follow_gemma3s_pattern():
    """A preset's local attention sits on the layers Gemma 3 slides on with ``sliding_window_pattern`` = the
    preset's interval (``Gemma3TextConfig``: every ``pattern``-th layer full), and a preset's fields say which size
    it needs; a preset without a local attention gives no ``layer_types``."""
    for layers in (4, 6, 9):
        gemma3 = transformers.Gemma3TextConfig(num_hidden_layers=layers, sliding_window_pattern=4).layer_types
        rnope_swa = hf_posenc.LAYOUT_PRESETS["rnope_swa"]
        assert rnope_swa.layer_types(layers) == gemma3
        assert hf_posenc.layout_preset("rnope_swa", layers, sliding_window=8)["layer_types"] == gemma3
        irope = hf_posenc.layout_preset("irope", layers, attention_chunk_size=8)["layer_types"]
        assert irope == [kind.replace("sliding", "chunked") for kind in gemma3]
    assert [(name, preset.slides, preset.chunks) for name, preset in hf_posenc.LAYOUT_PRESETS.items()] == [
        ("irope", False, True), ("smollm3", False, False), ("rnope_swa", True, False), ("qwen3_next", False, False),
        ("qwen3_5", False, False), ("olmo_hybrid", False, False), ("kimi_linear", False, False),
    ]  # fmt: skip
    assert "layer_types" not in hf_posenc.layout_preset("smollm3", 8)


def test_the_probe_takes_a_layouts_depth_and_windows():
    """``probe(num_hidden_layers=, layer_types=, sliding_window=)``: the model it trains has them; with softmax a
    mix of ``rope`` and ``none`` layers sees identical tokens as identical (9105: relative schemes and NoPE under a
    normalised softmax give every position the mean of the same values), sliding windows or not."""
    layout = hf_posenc.layout_preset("rnope_swa", 4, 4)
    result = hf_posenc.probe(**layout, num_hidden_layers=4, steps=20, length=8)
    assert [spec["type"] for spec in result["position_encoding"]] == ["rope", "rope", "rope", "none"]
    assert result["output_spread"] < 1e-4


def test_no_rope_layers_gives_the_spec_where_the_flag_is_1():
    spec = {"type": "rope", "theta": 500000.0}
    config = make_config("bert", spec, num_hidden_layers=3, no_rope_layers=[1, 0, 1])
    assert [layer["type"] for layer in config.position_encoding] == ["rope", "none", "rope"]
    assert config.position_encoding[2]["theta"] == 500000.0
    assert not hasattr(config, "no_rope_layers")  # the list it gives is what the config stores


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"no_rope_layers": [1, 0, 1]}, r"no_rope_layers has one flag per attention layer: 2"),
        ({"no_rope_layers": [1, 2]}, r"no_rope_layers must be a list of 0 \(NoPE\) and 1"),
        ({"no_rope_layer_interval": 0}, r"no_rope_layer_interval must be an int >= 1; got 0"),
        ({"no_rope_layers": [1, 0], "no_rope_layer_interval": 4}, "not both"),
    ],
)
def test_bad_no_rope_layers_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_config("gpt2", "rope", **kwargs)


def test_attention_temperature_is_llama4s_formula():
    """Llama 4 (``Llama4TextAttention``): ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1``."""
    positions = torch.tensor([0, 8190, 8191, 16382, 16383, 100000])
    expected = [1.0, 1.0, 1.0 + 0.1 * torch.log(torch.tensor(2.0)), 1.0 + 0.1 * torch.log(torch.tensor(2.0))]
    expected += [1.0 + 0.1 * torch.log(torch.tensor(3.0)), 1.0 + 0.1 * torch.log(torch.tensor(13.0))]
    torch.testing.assert_close(attention_temperature(positions, 8192.0, 0.1), torch.tensor(expected))


def test_none_defaults_to_nope_and_takes_llama4s_temperature_defaults():
    spec = make_config("gpt2", "none").position_encoding
    assert spec == {"type": "none", "attn_temperature_tuning": False, "floor_scale": 8192.0, "attn_scale": 0.1}
    llama4 = Llama4TextConfig()
    assert (llama4.floor_scale, llama4.attn_scale) == (spec["floor_scale"], spec["attn_scale"])


def hand_gpt2_logits(
    model,
    ids: torch.Tensor,
    positions: torch.Tensor,
    layers: list[dict],
    windows: list[int | None] | None = None,
    chunks: list[int | None] | None = None,
) -> torch.Tensor:
    """GPT-2 written out by hand with each layer's scheme: ``rope`` through Transformers' Llama
    ``apply_rotary_pos_emb`` with ``theta^(-2i/d)`` frequencies, ``none`` with Llama 4's temperature on q; a layer
    with a window sees the keys ``i - window < j <= i``, a layer with chunks of C tokens the keys ``j <= i`` with
    ``j // C == i // C``."""
    base = model.transformer
    hidden = base.wte(ids)
    n, heads = ids.shape[1], model.config.n_head
    head_dim = model.config.n_embd // heads
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    chunks = chunks or [None] * len(layers)
    for block, spec, window, chunk in zip(base.h, layers, windows or [None] * len(layers), chunks, strict=True):
        x = block.ln_1(hidden)
        q, k, v = (t.view(*x.shape[:2], heads, head_dim).transpose(1, 2) for t in block.attn.c_attn(x).split(32, -1))
        if spec["type"] == "rope":
            inverse = spec["theta"] ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
            angles = positions[:, :, None].float() * inverse
            emb = torch.cat([angles, angles], -1)
            q, k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
        elif spec["attn_temperature_tuning"]:
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / spec["floor_scale"])) * spec["attn_scale"] + 1
            q = q * scale[:, None, :, None]
        scores = (q @ k.transpose(-1, -2)) * head_dim**-0.5
        visible = causal if window is None else causal & ~torch.ones(n, n, dtype=torch.bool).tril(-window)
        if chunk is not None:
            visible = visible & (torch.arange(n)[:, None] // chunk == torch.arange(n)[None] // chunk)
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out = (weights @ v).transpose(1, 2).reshape(x.shape)
        hidden = hidden + block.attn.c_proj(out)
        hidden = hidden + block.mlp(block.ln_2(hidden))
    return model.lm_head(base.ln_f(hidden))


def rope_around_temperature(attn: str, window_type: str | None = None, **window):
    """The 3-layer GPT-2 that the hand-written GPT-2 checks: ``rope`` (theta 100), Llama 4's NoPE layer with its
    temperature, ``rope``; with ``window_type``, the two rope layers of that type (``window``: its size)."""
    layers = [{"type": "rope", "theta": 100.0}, TEMPERATURE, {"type": "rope", "theta": 100.0}]
    if window_type is not None:
        window["layer_types"] = [window_type, "full_attention", window_type]
    return make_model("gpt2", layers, attn=attn, n_layer=3, **window)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_each_layer_runs_its_own_scheme_as_a_hand_written_gpt2(attn):
    model = rope_around_temperature(attn)
    ids = random_ids(2, 9)
    positions = torch.arange(9)[None].expand(2, -1) + torch.tensor([[3], [11]])  # the temperature steps inside
    specs = model.config.position_encoding
    with torch.no_grad():
        logits = model(ids, position_ids=positions).logits
        expected = hand_gpt2_logits(model, ids, positions, specs)
        uniform_none = hand_gpt2_logits(model, ids, positions, [specs[1]] * 3)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)
    assert (logits - uniform_none).abs().max() > 1e-2  # the rope layers matter


def test_temperature_makes_none_absolute_and_a_shift_changes_it():
    spec = make_config("gpt2", TEMPERATURE).position_encoding
    assert not POSITION_ENCODINGS["none"].is_relative(spec)
    model = make_model("gpt2", TEMPERATURE)
    ids = random_ids(2, 9)
    with torch.no_grad():
        shifted = model(ids, position_ids=torch.arange(9)[None] + 13).logits
        assert (shifted - model(ids, position_ids=torch.arange(9)[None]).logits).abs().max() > 1e-3


def test_retrofit_takes_a_per_layer_list():
    """A per-layer list gives each layer its scheme; options of one scheme cannot go with it."""
    stock = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=61, n_positions=40))
    patched = hf_posenc.retrofit(stock, ["rope", "none"]).eval()
    assert [spec["type"] for spec in patched.config.position_encoding] == ["rope", "none"]
    with pytest.raises(ValueError, match="options \\['theta'\\] go to one scheme"):
        hf_posenc.retrofit(GPT2LMHeadModel(stock.config), ["rope", "none"], theta=500.0)


def test_convert_gives_a_stock_gpt2_a_per_layer_layout_and_keeps_its_table_on_every_layer():
    stock = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=61, n_positions=40)).eval()
    ids = random_ids(2, 9)
    kept = hf_posenc.convert(stock, ["learned", "learned"]).eval()
    layered = hf_posenc.convert(stock, ["rope", "none"]).eval()
    assert [spec["type"] for spec in layered.config.position_encoding] == ["rope", "none"]
    with torch.no_grad():
        torch.testing.assert_close(kept(ids).logits, stock(ids).logits, atol=1e-5, rtol=1e-4)
        assert torch.isfinite(layered(ids).logits).all()
    longer = hf_posenc.extend_positions(kept, 60)
    assert [spec["max_positions"] for spec in longer.config.position_encoding] == [60, 60]


# Sliding-window layers: ``layer_types`` and ``sliding_window``.

SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layer_types": ["sliding_attention"]}, r"one type per attention layer: 2 \(num_hidden_layers\)"),
        ({"layer_types": ["full_attention", "local"], "sliding_window": 2}, r"Unknown layer_types \['local'\]"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_window is None"),
        ({"sliding_window": 0}, r"sliding_window must be an int >= 1 \(tokens a query sees\); got 0"),
    ],
)
def test_bad_layer_types_are_refused_when_the_config_is_built(family, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_config(family, "rope", **kwargs)


def test_a_sliding_window_alone_makes_every_layer_slide_as_transformers_infers(tmp_path):
    config = make_config("gpt2", "rope", sliding_window=4)
    assert config.layer_types == ["sliding_attention", "sliding_attention"]
    assert make_config("gpt2", "rope").layer_types is None
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["layer_types"] == config.layer_types


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sliding_layers_see_their_window_as_a_hand_written_gpt2(attn):
    """Transformers' causal window (``sliding_window_overlay``): query i sees keys ``i - window < j <= i``."""
    model = rope_around_temperature(attn, "sliding_attention", sliding_window=3)
    ids = random_ids(2, 9)
    positions = torch.arange(9)[None].expand(2, -1)
    with torch.no_grad():
        logits = model(ids).logits
        expected = hand_gpt2_logits(model, ids, positions, model.config.position_encoding, windows=[3, None, 3])
        unwindowed = hand_gpt2_logits(model, ids, positions, model.config.position_encoding)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)
    assert (logits - unwindowed).abs().max() > 1e-2


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_an_encoders_window_equals_the_same_window_given_as_a_four_d_mask(attn):
    """Every layer sliding: the model's window equals its unwindowed twin given the hand-made 4-D mask
    ``abs(i - j) <= window`` (Transformers' ``sliding_window_bidirectional_overlay``), with padding."""
    windowed = make_model("bert", "t5", attn=attn, sliding_window=2)
    plain = make_model("bert", "t5", attn=attn)
    ids = random_ids(2, 9)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 7:] = 0
    distance = torch.arange(9)[:, None] - torch.arange(9)[None]
    four_d = (distance.abs() <= 2)[None, None] & attention_mask.bool()[:, None, None, :]
    with torch.no_grad():
        logits = windowed(ids, attention_mask=attention_mask).logits
        expected = plain(ids, attention_mask=four_d).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)


SLIDING_SCHEMES = ["rope", "t5", "fox", ["alibi", "fox"], ["fox", "rope"]]


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
@pytest.mark.parametrize("scheme", SLIDING_SCHEMES)
def test_generate_past_the_window_with_cache_equals_without(scheme, cache_implementation):
    """A window of 3 tokens, a prompt of 6 and 8 new tokens: the sliding layers' caches evict keys (their key
    positions and FoX's per-layer gates with them), left padding included."""
    model = make_model("gpt2", scheme, attn="sdpa", **SLIDING)
    prompt, attention_mask = left_padded_prompt()
    assert_generates_with_cache_as_without(model, prompt, attention_mask, cache_implementation=cache_implementation)


@pytest.mark.parametrize("scheme", SLIDING_SCHEMES)
def test_a_forward_in_chunks_through_a_sliding_cache_equals_one_forward(scheme):
    model = make_model("gpt2", scheme, attn="eager", **SLIDING)
    chunked, full, cache = forward_in_two_chunks(model, random_ids(2, 12, seed=4), 7)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-4)
    layer_classes = [type(layer).__name__ for layer in cache.layers[:2]]
    assert layer_classes == ["DynamicSlidingWindowLayer", "DynamicLayer"]


# The sliding BlockMask in each family: a score bias and a content term in the encoder, a rotation in the decoder
# (the decoder's score biases on flex: test_chunked_layers_agree_on_eager_sdpa_and_flex).
@pytest.mark.parametrize(("family", "scheme"), [("bert", "t5"), ("bert", "shaw"), ("gpt2", "rope")])
def test_sliding_layers_agree_on_eager_sdpa_and_flex(family, scheme, uncompiled_flex):
    """The flex path (a sliding ``BlockMask`` from ``masking_utils``) with uncompiled FlexAttention, as in
    ``test_flex_path_of_every_combination_equals_eager``; padding included."""
    assert_windowed_layers_agree_on_eager_sdpa_and_flex(family, scheme, SLIDING, uncompiled_flex)


def assert_windowed_layers_agree_on_eager_sdpa_and_flex(family: str, scheme: str, windows: dict, calls: list) -> None:
    """The logits of the visible tokens (the first row right-padded) on sdpa and flex against eager, for models with
    the ``windows`` fields; ``calls``: the block masks the (uncompiled) FlexAttention got, two (a windowed and a full
    ``BlockMask``)."""
    ids = random_ids(2, 10)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 7:] = 0
    logits = {}
    for attn in ("eager", "sdpa", "flex_attention"):
        model = make_model(family, scheme, attn=attn, **windows)
        with torch.no_grad():
            logits[attn] = model(ids, attention_mask=attention_mask).logits
    assert len({id(block_mask) for block_mask in calls}) == 2  # a windowed and a full BlockMask
    visible = attention_mask.bool()
    for attn in ("sdpa", "flex_attention"):
        torch.testing.assert_close(logits[attn][visible], logits["eager"][visible], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_sliding_layers_keep_checkpointing_save_load_and_bf16(family, tmp_path):
    assert_windowed_layers_keep_checkpointing_save_load_and_bf16(family, SLIDING, tmp_path)


def assert_windowed_layers_keep_checkpointing_save_load_and_bf16(family: str, windows: dict, tmp_path) -> None:
    """A ``["t5", "rope"]`` model with the ``windows`` fields: the same gradients with activation checkpointing as
    without, its windows and logits back from ``save_pretrained``, and bf16 logits near float32's."""
    ids = random_ids(2, 8)
    grads = []
    for checkpointing in (False, True):
        model = make_model(family, ["t5", "rope"], attn="sdpa", **windows).train()
        if checkpointing:
            assert enable_activation_checkpointing(model, use_reentrant=True)
        model(ids, labels=ids).loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-4, msg=name)
    model = make_model(family, ["t5", "rope"], attn="sdpa", **windows)
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path).eval()
    assert {key: getattr(reloaded.config, key) for key in windows} == windows
    with torch.no_grad():
        reference = model(ids).logits
        assert torch.equal(reloaded(ids).logits, reference)
        torch.testing.assert_close(model.to(torch.bfloat16)(ids).logits.float(), reference, atol=0.2, rtol=0.05)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_a_layout_with_sliding_layers_compiles_in_one_graph(family):
    """``torch.compile(fullgraph=True)`` (dynamo only, where a graph break shows), forward and backward; the decoder
    builds its cache, with a sliding layer, inside the graph."""
    model = make_model(family, ["t5", "rope"], attn="sdpa", **SLIDING).train()
    ids = random_ids(2, 10)
    torch._dynamo.reset()
    loss = torch.compile(model, fullgraph=True, backend="eager")(ids, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        torch.testing.assert_close(loss.detach(), model(ids, labels=ids).loss, atol=1e-5, rtol=1e-5)


# Chunked-attention layers (Llama 4's): ``layer_types`` ``"chunked_attention"`` and ``attention_chunk_size``.

CHUNKED = {"layer_types": ["chunked_attention", "full_attention"], "attention_chunk_size": 3}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layer_types": ["chunked_attention", "full_attention"]}, "attention_chunk_size is None; set"),
        ({"attention_chunk_size": 0}, r"attention_chunk_size must be an int >= 1 \(tokens per chunk\); got 0"),
        ({"attention_chunk_size": 2.5}, r"attention_chunk_size must be an int >= 1 \(tokens per chunk\); got 2.5"),
        ({"attention_chunk_size": True}, r"attention_chunk_size must be an int >= 1"),
        (
            {"layer_types": ["chunked", "full_attention"], "attention_chunk_size": 2},
            r"Unknown layer_types \['chunked'\]",
        ),
    ],
)
def test_bad_chunked_layers_are_refused_when_the_config_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_config("gpt2", "rope", **kwargs)


@pytest.mark.parametrize("kwargs", [CHUNKED, {"attention_chunk_size": 4}])
def test_an_encoder_refuses_chunked_layers(kwargs):
    """Transformers has no bidirectional chunked mask: an encoder config refuses the layers (a chunk size alone makes
    every layer chunked, as Transformers' caches infer it); a BERT decoder takes them."""
    with pytest.raises(ValueError, match="an encoder has no chunked attention"):
        make_config("bert", "rope", **kwargs)
    assert make_config("bert", "rope", is_decoder=True, **kwargs).layer_types[0] == "chunked_attention"


def test_a_chunk_size_alone_makes_every_layer_chunked_as_transformers_infers(tmp_path):
    config = make_config("gpt2", "rope", attention_chunk_size=4)
    assert config.layer_types == ["chunked_attention", "chunked_attention"]
    assert make_config("gpt2", "rope", sliding_window=2, attention_chunk_size=4).layer_types == [
        "sliding_attention",
        "sliding_attention",
    ]  # Transformers' caches: a sliding_window first
    unused = make_config("gpt2", "rope", layer_types=["full_attention"] * 2, attention_chunk_size=4)
    assert unused.layer_types == ["full_attention"] * 2
    config.save_pretrained(tmp_path)
    reloaded = hf_posenc.PosEncGPT2Config.from_pretrained(tmp_path)
    assert (reloaded.layer_types, reloaded.attention_chunk_size) == (config.layer_types, 4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_chunked_layers_see_their_chunk_as_a_hand_written_gpt2(attn):
    """Transformers' chunked mask (``chunked_overlay``): query i sees keys ``j <= i`` with ``j // C == i // C``."""
    model = rope_around_temperature(attn, "chunked_attention", attention_chunk_size=4)
    ids = random_ids(2, 10)
    positions = torch.arange(10)[None].expand(2, -1)
    specs = model.config.position_encoding
    with torch.no_grad():
        logits = model(ids).logits
        expected = hand_gpt2_logits(model, ids, positions, specs, chunks=[4, None, 4])
        windowed = hand_gpt2_logits(model, ids, positions, specs, windows=[4, None, 4])
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)
    assert (logits - windowed).abs().max() > 1e-2  # a chunk is not a window of the same size
    torch.testing.assert_close(logits[:, :4], windowed[:, :4], atol=1e-5, rtol=1e-4)  # the first chunk is


def test_left_padding_starts_the_chunks_at_the_first_real_token():
    """``masking_utils`` counts chunks from the first real token: a left-padded row gives its real tokens' logits."""
    model = make_model("gpt2", ["rope", "t5"], attn="sdpa", **CHUNKED)
    ids = random_ids(1, 8, seed=5)
    padded = torch.cat([torch.full((1, 2), 3), ids], 1)
    attention_mask = torch.ones_like(padded)
    attention_mask[:, :2] = 0
    with torch.no_grad():
        alone = model(ids).logits
        in_batch = model(padded, attention_mask=attention_mask).logits[:, 2:]
    torch.testing.assert_close(in_batch, alone, atol=1e-5, rtol=1e-4)


CHUNKED_SCHEMES = [["rope", "t5"], ["rope", "fox"], "fox", ["fox", "rope"]]


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
@pytest.mark.parametrize("scheme", CHUNKED_SCHEMES)
def test_generate_past_a_chunk_boundary_with_cache_equals_without(scheme, cache_implementation):
    """Chunks of 3 tokens, a prompt of 5 and 8 new tokens: the chunked layers' caches keep a window of 3 keys as
    Transformers' do (their key positions and FoX's per-layer gates evicted with them), left padding included."""
    model = make_model("gpt2", scheme, attn="sdpa", **CHUNKED)
    prompt, attention_mask = left_padded_prompt(5)
    assert_generates_with_cache_as_without(model, prompt, attention_mask, cache_implementation=cache_implementation)


@pytest.mark.parametrize("cache", ["dynamic", "static", "plain"])
def test_chunked_sliding_and_full_layers_keep_one_key_slot_per_window(cache):
    """A chunked layer (C = 3), a sliding one (w = 5) and a full one, forwarded in pieces through the cache: each
    window keeps its own key positions (slots 0, 1, 2; the scheme's and FoX's states after them), and the logits
    equal one forward. A cache built without the config (``plain``) keeps every key in one slot."""
    types = ["chunked_attention", "sliding_attention", "full_attention"]
    if version.parse(transformers.__version__) < PER_LAYER_CACHE_WINDOWS:  # one window for every cache layer
        with pytest.raises(ValueError, match="of different sizes need Transformers >= 5.19.0"):
            make_config("gpt2", ["rope"] * 3, n_layer=3, layer_types=types, attention_chunk_size=3, sliding_window=5)
        return
    model = make_model(
        "gpt2",
        ["rope", "fox", "t5"],
        attn="eager",
        n_layer=3,
        layer_types=types,
        attention_chunk_size=3,
        sliding_window=5,
    )
    ids = random_ids(2, 13, seed=4)
    built = {
        "dynamic": lambda: transformers.DynamicCache(config=model.config),
        "static": lambda: transformers.StaticCache(config=model.config, max_cache_len=16),
        "plain": transformers.DynamicCache,
    }[cache]()
    with torch.no_grad():
        full = model(ids).logits
        pieces = []
        for start, stop in ((0, 4), (4, 7), (7, 8), (8, 13)):
            pieces.append(model(ids[:, start:stop], **with_cache(built), use_cache=True).logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-4)
    position_cache = PositionCache(built, 3)
    assert position_cache.key_slots() == ([0, 0, 0] if cache == "plain" else [1, 2, 0])
    assert position_cache.num_key_slots == (2 if cache == "plain" else 3)
    if cache == "dynamic":
        kept = [built.layers[3 + slot].keys.shape[-2] for slot in range(3)]
        assert kept == [13, 2, 4]  # full; the chunk's window keeps C - 1, the sliding one w - 1 (Transformers' rule)


@pytest.mark.parametrize(("family", "scheme"), [("gpt2", "t5"), ("gpt2", "rope"), ("bert", "t5")])
def test_chunked_layers_agree_on_eager_sdpa_and_flex(family, scheme, uncompiled_flex):
    """The flex path (a chunked ``BlockMask`` from ``masking_utils``) with uncompiled FlexAttention, padding
    included (right padding; a BERT decoder)."""
    decoder = {"is_decoder": True} if family == "bert" else {}
    assert_windowed_layers_agree_on_eager_sdpa_and_flex(family, scheme, {**CHUNKED, **decoder}, uncompiled_flex)


def test_chunked_layers_keep_checkpointing_save_load_and_compile(tmp_path):
    assert_windowed_layers_keep_checkpointing_save_load_and_bf16("gpt2", CHUNKED, tmp_path)
    ids = random_ids(2, 8)
    model = make_model("gpt2", ["t5", "rope"], attn="sdpa", **CHUNKED).train()
    torch._dynamo.reset()
    loss = torch.compile(model, fullgraph=True, backend="eager")(ids, labels=ids).loss
    with torch.no_grad():
        torch.testing.assert_close(loss.detach(), model(ids, labels=ids).loss, atol=1e-5, rtol=1e-5)
