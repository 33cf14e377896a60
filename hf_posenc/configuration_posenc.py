"""Configs of the two PosEnc families: ``BertConfig`` / ``GPT2Config`` plus ``position_encoding`` and
``attention_normalizer``, each stored in config.json as a full ``{"type": name, **options}`` dict (a per-layer
``position_encoding``: a list of them)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import transformers
from huggingface_hub.dataclasses import strict
from packaging import version
from transformers import BertConfig, GPT2Config
from transformers.configuration_utils import ALLOWED_ATTN_LAYER_TYPES

from .attention_normalizers import ATTENTION_NORMALIZERS
from .canon_layers import DEFAULT_CANON_KERNEL_SIZE, resolve_canon_options
from .linear_attention import LINEAR_ATTENTION, resolve_linear_attention
from .options import resolve_spec
from .position_encodings import POSITION_ENCODINGS


def without_filled_in_length(value: Any, max_position_embeddings: int) -> Any:
    """``value`` without its ``max_positions`` where that equals ``max_position_embeddings`` and the other options
    leave it unused (``multiplicative`` with ``table="sinusoidal"``): configs saved before such a value was refused
    hold the one filled in here, which had no effect. Any other unused value is left to be refused."""
    if not isinstance(value, Mapping) or value.get("max_positions") != max_position_embeddings:
        return value
    rest = {key: option for key, option in value.items() if key != "max_positions"}
    spec = resolve_spec("position_encoding", rest, POSITION_ENCODINGS)
    return rest if "max_positions" in POSITION_ENCODINGS[spec["type"]].unused_options(spec) else value


def resolve_position_encoding(
    value: Any, max_position_embeddings: int, causal: bool, hidden_size: int
) -> dict[str, Any]:
    """Full spec of a position encoding for an encoder or a decoder (``causal``); a table whose
    ``max_positions`` option is None (``learned``, ``multiplicative``, ``hierarchical``) gets
    ``max_position_embeddings`` rows, unless the other options leave it unused. A scheme with no form for the
    family, or options that do not fit the sizes, raise ``ValueError``."""
    spec = resolve_spec(
        "position_encoding", without_filled_in_length(value, max_position_embeddings), POSITION_ENCODINGS
    )
    scheme = POSITION_ENCODINGS[spec["type"]]
    scheme.check_family(spec, causal)
    scheme.check_sizes(spec, hidden_size, max_position_embeddings)
    if spec.get("max_positions", 0) is None and "max_positions" not in scheme.unused_options(spec):
        spec["max_positions"] = max_position_embeddings
    return spec


def resolve_position_layout(
    value: Any, num_layers: int, max_position_embeddings: int, causal: bool, hidden_size: int
) -> dict[str, Any] | list[dict[str, Any]]:
    """:func:`resolve_position_encoding` of a spec, or of each spec of a per-layer list (one per attention layer).

    An input-side scheme (``learned``, ``sinusoidal``, the absolute family: ``acts_at_input``) acts once at the
    embeddings, so a list holds it only on every layer (the same spec throughout, which is that scheme alone); any
    other list of input-side and attention-side schemes raises ``ValueError``, as does a length other than
    ``num_layers``."""
    if not isinstance(value, (list, tuple)):
        return resolve_position_encoding(value, max_position_embeddings, causal, hidden_size)
    if len(value) != num_layers:
        raise ValueError(
            f"position_encoding as a list gives one spec per attention layer: {num_layers} (num_hidden_layers); got "
            f"{len(value)}."
        )
    specs = [resolve_position_encoding(spec, max_position_embeddings, causal, hidden_size) for spec in value]
    input_side = sorted({spec["type"] for spec in specs if POSITION_ENCODINGS[spec["type"]].acts_at_input()})
    if input_side and any(spec != specs[0] for spec in specs):
        attention_side = sorted(name for name, scheme in POSITION_ENCODINGS.items() if not scheme.acts_at_input())
        raise ValueError(
            f"position_encoding lists {input_side}, which act once on the input embeddings, not per layer; a "
            f"per-layer list holds attention-side schemes ({attention_side}), or the same spec on every layer."
        )
    return specs


def layer_position_specs(value: dict[str, Any] | list[dict[str, Any]], num_layers: int) -> list[dict[str, Any]]:
    """The resolved spec of each attention layer: the list itself, or the one spec on every layer."""
    return list(value) if isinstance(value, list) else [value] * num_layers


def position_length_limit(value: dict[str, Any] | list[dict[str, Any]]) -> int | None:
    """The longest input a resolved position encoding takes (a spec, or one per layer): the smallest
    ``max_length`` of its schemes, None where none has a limit."""
    limits = (POSITION_ENCODINGS[spec["type"]].max_length(spec) for spec in layer_position_specs(value, 1))
    return min((limit for limit in limits if limit is not None), default=None)


def training_length(config) -> int:
    """A config's length of positions, the default length of the position tables: GPT-2's ``n_positions``, else
    ``max_position_embeddings`` (which :class:`PosEncGPT2Config` answers with its schemes' limit)."""
    return config.n_positions if hasattr(config, "n_positions") else config.max_position_embeddings


def layout_name(value: dict[str, Any] | list[dict[str, Any]]) -> str:
    """A resolved position encoding's name for labels: its type, the layers' types joined by ``+`` for a per-layer
    list (``rope+rope+rope+none``), or the one type a list holds on every layer."""
    types = [spec["type"] for spec in (value if isinstance(value, list) else [value])]
    return types[0] if len(set(types)) == 1 else "+".join(types)


def no_rope_layout(value: Any, no_rope_layers: Any, no_rope_layer_interval: Any, num_layers: int) -> list[Any]:
    """Transformers' Llama 4 / SmolLM3 convention as a per-layer list: layer ``i`` runs ``value`` where
    ``no_rope_layers[i]`` is 1 and ``none`` (NoPE) where it is 0; without ``no_rope_layers``, NoPE every
    ``no_rope_layer_interval``-th layer, ``no_rope_layers[i] = int((i + 1) % interval != 0)`` (``Llama4TextConfig``,
    ``SmolLM3Config``)."""
    if isinstance(value, (list, tuple)):
        raise ValueError(
            "no_rope_layers / no_rope_layer_interval place one position_encoding on some layers and 'none' on the "
            f"others; got a per-layer list {value!r} (give a single spec, or the list alone)."
        )
    if no_rope_layers is not None and no_rope_layer_interval is not None:
        raise ValueError("Give no_rope_layers or no_rope_layer_interval, not both.")
    if no_rope_layers is None:
        if isinstance(no_rope_layer_interval, bool) or not isinstance(no_rope_layer_interval, int):
            raise ValueError(f"no_rope_layer_interval must be an int >= 1; got {no_rope_layer_interval!r}.")
        if no_rope_layer_interval < 1:
            raise ValueError(f"no_rope_layer_interval must be an int >= 1; got {no_rope_layer_interval!r}.")
        no_rope_layers = [int((layer + 1) % no_rope_layer_interval != 0) for layer in range(num_layers)]
    if not isinstance(no_rope_layers, (list, tuple)) or any(
        isinstance(flag, bool) or flag not in (0, 1) for flag in no_rope_layers
    ):
        raise ValueError(
            f"no_rope_layers must be a list of 0 (NoPE) and 1 (the position_encoding); got {no_rope_layers!r}."
        )
    if len(no_rope_layers) != num_layers:
        raise ValueError(
            f"no_rope_layers has one flag per attention layer: {num_layers} (num_hidden_layers); got "
            f"{len(no_rope_layers)}."
        )
    return [value if flag else "none" for flag in no_rope_layers]


@dataclass(frozen=True)
class LayoutPreset:
    """A layout of a 2025-26 model: one scheme on the rotary layers and another on every ``interval``-th layer
    (``(layer + 1) % interval == 0``: Transformers' ``no_rope_layer_interval``), and on the rotary layers a local
    attention (``local_attention``: ``"sliding_attention"``, ``"chunked_attention"``, or None for full attention
    everywhere); the every-``interval``-th layers attend to every key. ``layer_types`` follows Gemma 3's
    ``sliding_window_pattern`` (``Gemma3TextConfig``)."""

    description: str
    rope: dict[str, Any]
    nope: dict[str, Any] = field(default_factory=lambda: {"type": "none"})
    local_attention: str | None = None
    interval: int = 4

    @property
    def slides(self) -> bool:
        """Sliding-window layers: the preset needs ``sliding_window``."""
        return self.local_attention == "sliding_attention"

    @property
    def chunks(self) -> bool:
        """Chunked-attention layers: the preset needs ``attention_chunk_size``."""
        return self.local_attention == "chunked_attention"

    def keeps_rope(self, num_layers: int) -> list[bool]:
        return [bool((layer + 1) % self.interval) for layer in range(num_layers)]

    def layer_types(self, num_layers: int) -> list[str] | None:
        """``local_attention`` on the rotary layers and ``full_attention`` on the others; None without a local
        attention (every layer full)."""
        if self.local_attention is None:
            return None
        return [self.local_attention if rope else "full_attention" for rope in self.keeps_rope(num_layers)]


@dataclass(frozen=True)
class HybridPreset:
    """A hybrid's layout: ``"linear_attention"`` layers (the ``linear_attention`` kind, no positions) with an attention
    layer at ``first_attention_layer`` and every ``interval``-th layer after it, each attention layer carrying the
    ``attention`` scheme; ``layer_types`` as the reference config's default builds them."""

    description: str
    attention: dict[str, Any]
    first_attention_layer: int = 3
    interval: int = 4
    local_attention: str = LINEAR_ATTENTION
    slides: bool = False
    chunks: bool = False

    def layer_types(self, num_layers: int) -> list[str]:
        first, interval = self.first_attention_layer, self.interval
        return [
            "full_attention" if layer >= first and (layer - first) % interval == 0 else LINEAR_ATTENTION
            for layer in range(num_layers)
        ]


LAYOUT_PRESETS = {
    "irope": LayoutPreset(
        "Llama 4's iRoPE (Llama4TextConfig): rope with theta 500000 and chunked attention on three layers of four, "
        "none with Llama 4's attention temperature and full attention on every fourth (no_rope_layer_interval 4); "
        "needs attention_chunk_size (Llama 4: 8192)",
        rope={"type": "rope", "theta": 500000.0},
        nope={"type": "none", "attn_temperature_tuning": True},
        local_attention="chunked_attention",
    ),
    "smollm3": LayoutPreset(
        "SmolLM3 (SmolLM3Config): rope with theta 2000000 on three layers of four, none on every fourth",
        rope={"type": "rope", "theta": 2000000.0},
    ),
    "rnope_swa": LayoutPreset(
        "RNoPE-SWA (Yang et al. 2025, 'Rope to Nope and Back Again'): rope with a sliding window on three layers of "
        "four, none with full attention on every fourth; needs sliding_window",
        rope={"type": "rope"},
        local_attention="sliding_attention",
    ),
    "qwen3_next": HybridPreset(
        "Qwen3-Next (Qwen3NextConfig): full attention with partial rope (partial_rotary_factor 0.25, theta 10000) on "
        "every fourth layer (full_attention_interval 4), gated DeltaNet on the other layers, as the reference",
        attention={"type": "rope", "theta": 10000.0, "rotary_fraction": 0.25},
    ),
    "qwen3_5": HybridPreset(
        "Qwen3.5 (Qwen3_5TextConfig): Qwen3-Next's layout, partial rope (0.25, theta 10000) on every fourth layer, "
        "gated DeltaNet on the other layers, as the reference (its checkpoints' multimodal sections are text "
        "positions here)",
        attention={"type": "rope", "theta": 10000.0, "rotary_fraction": 0.25},
    ),
    "olmo_hybrid": HybridPreset(
        "OLMo-Hybrid (OlmoHybridConfig): full attention with rope (theta 10000) on every fourth layer, "
        "gated DeltaNet on the other layers, as the reference",
        attention={"type": "rope", "theta": 10000.0},
    ),
    "kimi_linear": HybridPreset(
        "Kimi Linear (KimiLinearConfig's default layer_types): attention with no positions on layer 4 and every "
        "fourth after it, gated DeltaNet on the other layers (the reference's are KDA and its attention MLA: "
        "neither is in the catalogue)",
        attention={"type": "none"},
        first_attention_layer=4,
    ),
}
"""Layouts of 2025-26 models as one name, each a :class:`LayoutPreset`: :func:`layout_preset` gives their config
values."""


def layout_preset(
    name: str, num_layers: int, sliding_window: int | None = None, attention_chunk_size: int | None = None
) -> dict[str, Any]:
    """The config values of a layout of :data:`LAYOUT_PRESETS` for ``num_layers`` attention layers:
    ``position_encoding`` (a per-layer list: the preset's ``rope`` spec, its ``nope`` spec where
    ``(layer + 1) % interval == 0``), and for a preset with a local attention ``layer_types`` (that attention on
    the rope layers, as ``Llama4TextConfig`` lays out its chunks) with its size, ``sliding_window`` or
    ``attention_chunk_size``; a :class:`HybridPreset` gives its ``attention`` spec (which acts on the attention layers
    only) and ``layer_types`` with its ``"linear_attention"`` layers. ``layer_types`` is checked against Transformers'
    own ``ALLOWED_ATTN_LAYER_TYPES`` before the sizes are checked. Pass them to
    ``PosEncGPT2Config(**layout_preset(...))`` or a decoder ``PosEncBertConfig`` (an encoder has no chunked attention
    and no linear-attention layer)."""
    if name not in LAYOUT_PRESETS:
        raise ValueError(f"Unknown layout {name!r}; valid choices: {sorted(LAYOUT_PRESETS)}.")
    preset = LAYOUT_PRESETS[name]
    if isinstance(preset, HybridPreset) and num_layers <= preset.first_attention_layer:
        raise ValueError(
            f"layout {name!r} puts its first attention layer at layer {preset.first_attention_layer} (from 0), so "
            f"{num_layers} layers would have none; give at least {preset.first_attention_layer + 1} layers."
        )
    if isinstance(preset, HybridPreset):
        values: dict[str, Any] = {"position_encoding": dict(preset.attention)}
    else:
        values = {
            "position_encoding": [dict(preset.rope if rope else preset.nope) for rope in preset.keeps_rope(num_layers)]
        }
    layer_types = preset.layer_types(num_layers)
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(ALLOWED_ATTN_LAYER_TYPES) - {LINEAR_ATTENTION})
        if unknown:
            raise ValueError(
                f"layout {name!r} gives layer types {unknown}; Transformers takes {ALLOWED_ATTN_LAYER_TYPES}."
            )
        values["layer_types"] = layer_types
    if preset.slides and sliding_window is None:
        raise ValueError(f"layout {name!r} slides on its rope layers: give sliding_window (tokens a query sees).")
    if not preset.slides and sliding_window is not None:
        raise ValueError(f"layout {name!r} has no sliding-window layers; sliding_window={sliding_window!r} is unused.")
    if preset.chunks and attention_chunk_size is None:
        raise ValueError(
            f"layout {name!r} has chunked attention on its rope layers: give attention_chunk_size (tokens per chunk; "
            "Llama 4: 8192)."
        )
    if not preset.chunks and attention_chunk_size is not None:
        raise ValueError(
            f"layout {name!r} has no chunked-attention layers; attention_chunk_size={attention_chunk_size!r} is "
            "unused."
        )
    if preset.slides:
        values["sliding_window"] = sliding_window
    if preset.chunks:
        values["attention_chunk_size"] = attention_chunk_size
    return values


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""The layer types of attention layers, the layers a position encoding acts in. Any other type (a PosEnc model's
``"linear_attention"``; in a retrofitted stock hybrid also Mamba, convolution or MLP-only layers) mixes tokens without
positions and keeps its own cache layer."""
LAYER_TYPES = (*ATTENTION_LAYER_TYPES, LINEAR_ATTENTION)
"""Layer types as Transformers spells them (``config.layer_types``, read by ``masking_utils`` and the KV caches): the
attention layers' and ``"linear_attention"`` (a recurrent mixer in place of attention, ``linear_attention.py``)."""


def _check_size(name: str, value: Any, meaning: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be an int >= 1 ({meaning}); got {value!r}.")


def resolve_layer_types(
    layer_types: Any,
    sliding_window: Any,
    num_layers: int,
    attention_chunk_size: Any = None,
    causal: bool = True,
) -> list[str] | None:
    """``layer_types`` checked, one of :data:`LAYER_TYPES` per attention layer: a causal ``sliding_attention`` layer
    sees the ``sliding_window`` tokens up to and including the query (``masking_utils.sliding_window_overlay``: keys
    ``j > i - sliding_window``), a bidirectional one the keys with ``abs(i - j) <= sliding_window``
    (``sliding_window_bidirectional_overlay``); a ``chunked_attention`` layer (decoders only: Transformers has no
    bidirectional chunked mask) sees the keys ``j <= i`` of the query's chunk of ``attention_chunk_size`` tokens,
    ``j // C == i // C`` counted from the first real token (``masking_utils.chunked_overlay``). Without
    ``layer_types`` they are inferred as Transformers' caches infer them: every layer sliding with a
    ``sliding_window``, else every layer chunked with an ``attention_chunk_size`` (as Llama 4's cache does), else
    None (every layer full). Given ``layer_types`` without such layers leave the size unused."""
    _check_size("sliding_window", sliding_window, "tokens a query sees")
    _check_size("attention_chunk_size", attention_chunk_size, "tokens per chunk")
    if layer_types is None:
        if sliding_window is not None:
            layer_types = ["sliding_attention"] * num_layers
        elif attention_chunk_size is not None:
            layer_types = ["chunked_attention"] * num_layers
        else:
            return None
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers:
        raise ValueError(
            f"layer_types gives one type per attention layer: {num_layers} (num_hidden_layers); got {layer_types!r}."
        )
    unknown = sorted({str(kind) for kind in layer_types} - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"Unknown layer_types {unknown}; valid choices: {list(LAYER_TYPES)}.")
    if LINEAR_ATTENTION in layer_types:
        check_linear_attention_support()
    if "sliding_attention" in layer_types and sliding_window is None:
        raise ValueError("layer_types has 'sliding_attention' layers but sliding_window is None; set sliding_window.")
    if "chunked_attention" in layer_types:
        if not causal:
            raise ValueError(
                "layer_types has 'chunked_attention' layers, which are causal (Llama 4's chunked attention: a query "
                "sees the earlier keys of its chunk); an encoder has no chunked attention (Transformers builds no "
                "bidirectional chunked mask). Use 'sliding_attention' for a local encoder layer, or is_decoder=True."
            )
        if attention_chunk_size is None:
            raise ValueError(
                "layer_types has 'chunked_attention' layers but attention_chunk_size is None; set "
                "attention_chunk_size."
            )
    two_windows = {"sliding_attention", "chunked_attention"} <= set(
        layer_types
    ) and sliding_window != attention_chunk_size
    if two_windows and version.parse(transformers.__version__) < PER_LAYER_CACHE_WINDOWS:
        raise ValueError(
            f"Sliding layers (sliding_window={sliding_window}) and chunked layers (attention_chunk_size="
            f"{attention_chunk_size}) of different sizes need Transformers >= {PER_LAYER_CACHE_WINDOWS}: "
            f"{transformers.__version__}'s caches give every windowed layer the chunk size. Give them one size, or "
            "upgrade Transformers."
        )
    return list(layer_types)


LINEAR_CACHE_CALLS = ("get_conv_state", "update_conv_state", "get_recurrent_state", "update_recurrent_state")
"""The ``Cache`` methods a linear-attention layer reads and writes its states with."""


def check_linear_attention_support() -> None:
    """``ValueError`` where the installed Transformers' caches have no linear-attention layer with the calls the
    layers make (``cache_utils``'s ``LinearAttentionLayer`` for the ``"linear_attention"`` layer type, which keeps a
    layer's convolution and recurrent states, read and written through :data:`LINEAR_CACHE_CALLS`; 5.15 has the
    layer but no ``get_conv_state``)."""
    from transformers import cache_utils

    mapping = getattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", {})
    missing = [call for call in LINEAR_CACHE_CALLS if not hasattr(cache_utils.Cache, call)]
    if LINEAR_ATTENTION not in mapping or missing:
        raise ValueError(
            f"layer_types 'linear_attention' keep their convolution and recurrent states in Transformers' "
            f"LinearAttentionLayer cache layers, which Transformers {transformers.__version__} does not have with "
            f"the calls they make (missing: {', '.join(missing) or 'the layer type'}); upgrade Transformers (5.24 "
            "has them)."
        )


def check_linear_layer_positions(
    position_encoding: dict[str, Any] | list[dict[str, Any]], layer_types: list[str] | None
) -> None:
    """A layer that is not an attention layer (``"linear_attention"``; any type outside :data:`ATTENTION_LAYER_TYPES`)
    has no position encoding. A single spec acts on the attention layers only; in a per-layer list such a layer's
    entry must be ``"none"`` or the spec that every attention layer carries (a single spec written out per layer),
    else ``ValueError``: a scheme written on a layer that cannot run it."""
    if not isinstance(position_encoding, list) or layer_types is None:
        return
    if all(kind in ATTENTION_LAYER_TYPES for kind in layer_types):
        return
    attention = attention_layer_specs(position_encoding, layer_types)
    shared = attention[0] if attention and all(spec == attention[0] for spec in attention) else None
    for layer_idx, (spec, kind) in enumerate(zip(position_encoding, layer_types, strict=True)):
        if kind not in ATTENTION_LAYER_TYPES and spec["type"] != "none" and spec != shared:
            raise ValueError(
                f"position_encoding[{layer_idx}] is {spec['type']!r}, but layer {layer_idx} is a {kind!r} layer, "
                "which has no position encoding: give it 'none', or the spec every attention layer carries "
                f"(here {'none shared' if shared is None else repr(shared['type'])})."
            )


def attention_layer_specs(position_encoding: list[Any], layer_types: list[str]) -> list[Any]:
    """The entries of a per-layer ``position_encoding`` on the attention layers (:data:`ATTENTION_LAYER_TYPES`)."""
    return [spec for spec, kind in zip(position_encoding, layer_types, strict=True) if kind in ATTENTION_LAYER_TYPES]


PER_LAYER_CACHE_WINDOWS = version.parse("5.19.0")
"""From this Transformers release its caches size each windowed layer by its own type (``sliding_window`` or
``attention_chunk_size``); before it, one window for all (the chunk size where a model has both)."""


def config_layer_types(config) -> list[str]:
    """The type of each attention layer: ``config.layer_types``, else as Transformers' caches infer it (every layer
    sliding where the config has a ``sliding_window``, as stock Mistral's, else chunked where it has an
    ``attention_chunk_size``, else full)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        layer_type = "full_attention"
        if getattr(config, "sliding_window", None) is not None:
            layer_type = "sliding_attention"
        elif getattr(config, "attention_chunk_size", None) is not None:
            layer_type = "chunked_attention"
        layer_types = [layer_type] * config.num_hidden_layers
    return list(layer_types)


def resolve_config_layout(config, kwargs: dict[str, Any], max_position_embeddings: int, causal: bool) -> None:
    """Resolve ``config.position_encoding`` in place, after expanding Transformers' ``no_rope_layers`` /
    ``no_rope_layer_interval`` (taken out of ``kwargs``: the per-layer list they give is what the config stores), and
    ``config.layer_types`` (:func:`resolve_layer_types`)."""
    no_rope_layers = kwargs.pop("no_rope_layers", None)
    no_rope_layer_interval = kwargs.pop("no_rope_layer_interval", None)
    num_layers = config.num_hidden_layers
    if no_rope_layers is not None or no_rope_layer_interval is not None:
        config.position_encoding = no_rope_layout(
            config.position_encoding, no_rope_layers, no_rope_layer_interval, num_layers
        )
    config.position_encoding = resolve_position_layout(
        config.position_encoding, num_layers, max_position_embeddings, causal, config.hidden_size
    )
    config.layer_types = resolve_layer_types(
        config.layer_types, config.sliding_window, num_layers, config.attention_chunk_size, causal
    )
    check_layer_windows(
        config.position_encoding, config.layer_types, config.sliding_window, config.attention_chunk_size
    )
    check_linear_layer_positions(config.position_encoding, config.layer_types)


def check_layer_windows(
    position_encoding: dict[str, Any] | list[dict[str, Any]],
    layer_types: list[str] | None,
    sliding_window: int | None,
    attention_chunk_size: int | None,
) -> None:
    """Where every attention layer is windowed, a scheme's per-token cache states are kept as the widest window keeps
    its keys (the ``window - 1`` tokens before the current ones, Transformers' windowed caches): ``ValueError`` if a
    scheme reads further back (``PositionEncoding.past_tokens_read``: ``conv``'s ``kernel_size - 1``)."""
    if layer_types is None or "full_attention" in layer_types:
        return
    windows = {"sliding_attention": sliding_window, "chunked_attention": attention_chunk_size}
    widest = max((windows[layer_type] for layer_type in layer_types if layer_type in windows), default=None)
    if widest is None:  # no attention layer: every layer is linear attention
        return
    for spec in layer_position_specs(position_encoding, len(layer_types)):
        reach = POSITION_ENCODINGS[spec["type"]].past_tokens_read(spec)
        if reach > widest - 1:
            raise ValueError(
                f"position_encoding {spec['type']!r} reads the {reach} tokens before each token from the KV cache, "
                f"but every layer is windowed and the widest window ({widest} tokens) keeps {widest - 1}: make a "
                "layer 'full_attention', widen its window, or narrow the scheme (conv: kernel_size <= the window)."
            )


def resolve_attention_shape_options(config) -> None:
    """Check ``use_qk_norm`` (a bool) and ``attn_logit_softcapping`` (None, off, or a finite number > 0, stored as a
    float) in place; ``ValueError`` naming the bad value, and naming a piece of the attention (QK-norm, the output
    norm or gate) that the position encoding builds (``attention_pieces``) and the config or the normalizer too."""
    if not isinstance(config.use_qk_norm, bool):
        raise ValueError(f"use_qk_norm must be True or False; got {config.use_qk_norm!r}.")
    normalizer = config.attention_normalizer
    elsewhere = {
        "qk_norm": ("the config's use_qk_norm=True", config.use_qk_norm),
        "output_gate": (f"the normalizer's output_gate={normalizer['output_gate']!r}", normalizer["output_gate"]),
        "output_norm": ("the normalizer's output_norm=True", normalizer["output_norm"]),
    }
    for spec in layer_position_specs(config.position_encoding, 1):
        for piece in sorted(POSITION_ENCODINGS[spec["type"]].attention_pieces(spec)):
            where, built = elsewhere[piece]
            if built:
                raise ValueError(
                    f"position_encoding {spec['type']!r} builds its own {piece} with these options, and {where} "
                    f"builds another: ask for it once (the scheme's option or {where.split('=')[0]})."
                )
    cap = config.attn_logit_softcapping
    if cap is None:
        return
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(
            f"attn_logit_softcapping must be None (off) or a number > 0, the cap c of c * tanh(scores / c) (Gemma 2: "
            f"50.0); got {cap!r}."
        )
    config.attn_logit_softcapping = float(cap)


def resolve_attention_normalizer(
    value: Any, causal: bool | None = None, num_heads: int | None = None
) -> dict[str, Any]:
    """Full spec of an attention normalizer; for an encoder or a decoder (``causal``; None: a bare spec, no family
    check) a normalizer with no form for the family raises ``ValueError``, and one that cannot run with
    ``num_heads`` attention heads (None: not checked) too."""
    spec = resolve_spec("attention_normalizer", value, ATTENTION_NORMALIZERS)
    if causal is not None:
        ATTENTION_NORMALIZERS[spec["type"]].check_family(spec, causal)
    if num_heads is not None:
        ATTENTION_NORMALIZERS[spec["type"]].check_heads(spec, num_heads)
    return spec


@strict
class PosEncBertConfig(BertConfig):
    r"""
    A [`BertConfig`] whose position encoding and attention normalizer are switches.

    position_encoding (`str`, `dict` or `list`, *optional*, defaults to `"learned"`):
        A name from `hf_posenc.list_position_encodings()`, or `{"type": name, **options}`, or a list of those, one
        per attention layer (attention-side schemes). `no_rope_layers` (a 0/1 flag per layer) or
        `no_rope_layer_interval` (NoPE every n-th layer), as in Llama 4 and SmolLM3, expand a single spec into such
        a list: the spec where the flag is 1, `"none"` where it is 0.
    layer_types (`list[str]`, *optional*):
        `"full_attention"`, `"sliding_attention"` or `"chunked_attention"` per attention layer (in PosEnc GPT-2 also
        `"linear_attention"`: a gated-DeltaNet mixer in place of the layer's attention, see `linear_attention`), as
        Transformers spells them: a causal sliding layer sees the `sliding_window` tokens up to and including the
        query, an encoder's the keys at most `sliding_window` away on either side; a chunked layer (Llama 4's;
        decoders only) sees the keys up to the query in its chunk of `attention_chunk_size` tokens, chunks counted
        from the first real token (Transformers' masks). None: inferred as Transformers' caches do: every layer
        sliding when `sliding_window` is set, else every layer chunked when `attention_chunk_size` is set, else every
        layer full.
    sliding_window (`int`, *optional*):
        The window of the sliding layers, in tokens (the query's own included).
    attention_chunk_size (`int`, *optional*):
        The chunk of the chunked layers, in tokens (Llama 4: 8192); their KV cache keeps a window of that many
        tokens, as Transformers' caches do. Unused when `layer_types` has no chunked layer.
    attention_normalizer (`str` or `dict`, *optional*, defaults to `"softmax"`):
        A name from `hf_posenc.list_attention_normalizers()`, or `{"type": name, **options}`.
    use_qk_norm (`bool`, *optional*, defaults to `False`):
        QK-norm: an RMSNorm of each head's queries and keys (a learned `head_dim` weight each, epsilon
        `layer_norm_eps`) after their projection, before the position encoding acts (Qwen3, OLMo 3, Gemma 3).
    attn_logit_softcapping (`float`, *optional*):
        Gemma 2's soft-cap `c`: the scores (position and content terms included) become `c * tanh(scores / c)`
        before the normalizer. None: off. Computed on eager and FlexAttention (SDPA cannot cap its scores).
    canon_layers (`str`, *optional*):
        Canon layers (Allen-Zhu 2025, arXiv 2512.17351): `h + CausalDepthwiseConv1d(h)` at the chosen insertion
        points of every layer, a string of distinct letters: `"A"` the attention's input, `"B"` the projected q, k
        and v, `"C"` the MLP's input, `"D"` inside the MLP after its up projection (`"ABCD"`: the paper's full set).
        Stored as `"ABCD"`-ordered upper case. None or `""`: off.
    canon_kernel_size (`int`, *optional*, defaults to 4):
        The convolution's width K (the paper's 4): each token mixes in the K - 1 before it.
    linear_attention (`str` or `dict`, *optional*):
        Refused here (None only): a `"linear_attention"` layer is causal and PosEnc BERT has none (see
        `PosEncGPT2Config`).

    ```python
    >>> import hf_posenc, transformers
    >>> config = hf_posenc.PosEncBertConfig(position_encoding={"type": "t5", "num_buckets": 32}, hidden_size=128)
    >>> model = transformers.AutoModelForMaskedLM.from_config(config)
    ```"""

    model_type = "posenc_bert"
    _auto_class = "AutoConfig"
    # tensor parallelism: each rank computes a share of the heads (q, k, v by rows, the output projection by
    # columns) and of the feed-forward width; the attention reads its head count from q and k
    base_model_tp_plan = {
        "encoder.layer.*.attention.self.query": "colwise",
        "encoder.layer.*.attention.self.key": "colwise",
        "encoder.layer.*.attention.self.value": "colwise",
        "encoder.layer.*.attention.output.dense": "rowwise",
        "encoder.layer.*.intermediate.dense": "colwise",
        "encoder.layer.*.output.dense": "rowwise",
    }

    position_encoding: str | dict | list = "learned"
    attention_normalizer: str | dict = "softmax"
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    use_qk_norm: bool = False
    attn_logit_softcapping: float | int | None = None
    canon_layers: str | None = None
    canon_kernel_size: int = DEFAULT_CANON_KERNEL_SIZE
    linear_attention: str | dict | None = None

    def __post_init__(self, **kwargs):
        if self.layer_types is not None and LINEAR_ATTENTION in self.layer_types:
            raise ValueError(
                "PosEnc BERT has no 'linear_attention' layer: the gated delta rule is causal (each token's state "
                "holds the tokens before it only), so an encoder cannot run it, and the BERT decoder "
                "(is_decoder=True) is not built with it; use PosEncGPT2Config for a hybrid decoder."
            )
        resolve_config_layout(self, kwargs, self.max_position_embeddings, causal=self.is_decoder)
        self.linear_attention = resolve_linear_attention(
            self.linear_attention, self.layer_types, self.hidden_size, self.num_attention_heads, self.is_decoder
        )
        self.attention_normalizer = resolve_attention_normalizer(
            self.attention_normalizer, causal=self.is_decoder, num_heads=self.num_attention_heads
        )
        resolve_attention_shape_options(self)
        resolve_canon_options(self, kwargs)
        super().__post_init__(**kwargs)


@strict
class PosEncGPT2Config(GPT2Config):
    r"""
    A [`GPT2Config`] whose position encoding and attention normalizer are switches.

    position_encoding (`str`, `dict` or `list`, *optional*, defaults to `"learned"`):
        A name from `hf_posenc.list_position_encodings()`, or `{"type": name, **options}`, or a list of those, one
        per attention layer (attention-side schemes). `no_rope_layers` (a 0/1 flag per layer) or
        `no_rope_layer_interval` (NoPE every n-th layer), as in Llama 4 and SmolLM3, expand a single spec into such
        a list: the spec where the flag is 1, `"none"` where it is 0.
    layer_types (`list[str]`, *optional*):
        `"full_attention"`, `"sliding_attention"` or `"chunked_attention"` per attention layer (in PosEnc GPT-2 also
        `"linear_attention"`: a gated-DeltaNet mixer in place of the layer's attention, see `linear_attention`), as
        Transformers spells them: a causal sliding layer sees the `sliding_window` tokens up to and including the
        query, an encoder's the keys at most `sliding_window` away on either side; a chunked layer (Llama 4's;
        decoders only) sees the keys up to the query in its chunk of `attention_chunk_size` tokens, chunks counted
        from the first real token (Transformers' masks). None: inferred as Transformers' caches do: every layer
        sliding when `sliding_window` is set, else every layer chunked when `attention_chunk_size` is set, else every
        layer full.
    sliding_window (`int`, *optional*):
        The window of the sliding layers, in tokens (the query's own included).
    attention_chunk_size (`int`, *optional*):
        The chunk of the chunked layers, in tokens (Llama 4: 8192); their KV cache keeps a window of that many
        tokens, as Transformers' caches do. Unused when `layer_types` has no chunked layer.
    attention_normalizer (`str` or `dict`, *optional*, defaults to `"softmax"`):
        A name from `hf_posenc.list_attention_normalizers()`, or `{"type": name, **options}`.
    use_qk_norm (`bool`, *optional*, defaults to `False`):
        QK-norm: an RMSNorm of each head's queries and keys (a learned `head_dim` weight each, epsilon
        `layer_norm_epsilon`) after their projection, before the position encoding acts (Qwen3, OLMo 3, Gemma 3).
    attn_logit_softcapping (`float`, *optional*):
        Gemma 2's soft-cap `c`: the scores (position and content terms included) become `c * tanh(scores / c)`
        before the normalizer. None: off. Computed on eager and FlexAttention (SDPA cannot cap its scores).
    canon_layers (`str`, *optional*):
        Canon layers (Allen-Zhu 2025, arXiv 2512.17351): `h + CausalDepthwiseConv1d(h)` at the chosen insertion
        points of every layer, a string of distinct letters: `"A"` the attention's input, `"B"` the projected q, k
        and v, `"C"` the MLP's input, `"D"` inside the MLP after its up projection (`"ABCD"`: the paper's full set).
        Stored as `"ABCD"`-ordered upper case. None or `""`: off.
    canon_kernel_size (`int`, *optional*, defaults to 4):
        The convolution's width K (the paper's 4): each token mixes in the K - 1 before it.
    linear_attention (`str` or `dict`, *optional*):
        The mixer of the `"linear_attention"` entries of `layer_types` (no position encoding; their convolution and
        recurrent states in the cache): `"gated_deltanet"` (Qwen3-Next's gated DeltaNet) or `{"type":
        "gated_deltanet", **options}` with `num_key_heads`, `num_value_heads`, `key_head_dim`, `value_head_dim`,
        `conv_kernel_size` (Qwen3-Next's `linear_*` fields; defaults: the attention's heads and head size, kernel
        4). None: the default kind where there are such layers; stored as the full spec. Refused without such layers.
    """

    model_type = "posenc_gpt2"
    _auto_class = "AutoConfig"
    # GPT-2 reads max_position_embeddings as n_positions; here it is a property, the schemes' length limit.
    attribute_map = {key: name for key, name in GPT2Config.attribute_map.items() if key != "max_position_embeddings"}
    # tensor parallelism: each rank computes a share of the heads and of the feed-forward width. GPT-2's Conv1D
    # weights are (in, out): c_attn by output columns as three packed parts q|k|v, c_fc by output columns, the
    # output projections by input rows (styles registered by the modeling code)
    base_model_tp_plan = {
        "h.*.attn.c_attn": "conv1d_packed_qkv_colwise",
        "h.*.attn.c_proj": "conv1d_rowwise",
        "h.*.mlp.c_fc": "conv1d_colwise",
        "h.*.mlp.c_proj": "conv1d_rowwise",
    }

    position_encoding: str | dict | list = "learned"
    attention_normalizer: str | dict = "softmax"
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    use_qk_norm: bool = False
    attn_logit_softcapping: float | int | None = None
    canon_layers: str | None = None
    canon_kernel_size: int = DEFAULT_CANON_KERNEL_SIZE
    linear_attention: str | dict | None = None

    @property
    def max_position_embeddings(self) -> int | None:
        """The longest input the model takes, which Transformers' generation reads as the model's maximum length:
        the smallest limit of its schemes (``learned``'s table, ``relative_key``'s distances, ...), None where no
        scheme has one (``rope``, ``t5``, ``alibi``, ...). ``n_positions`` is the training length and the default
        length of the position tables; setting ``max_position_embeddings`` sets it, as in GPT-2."""
        specs = resolve_position_layout(self.position_encoding, self.n_layer, self.n_positions, True, self.n_embd)
        return position_length_limit(specs)

    @max_position_embeddings.setter
    def max_position_embeddings(self, value: int) -> None:
        self.n_positions = value

    def __post_init__(self, **kwargs):
        resolve_config_layout(self, kwargs, self.n_positions, causal=True)
        self.linear_attention = resolve_linear_attention(
            self.linear_attention, self.layer_types, self.n_embd, self.n_head, causal=True
        )
        self.attention_normalizer = resolve_attention_normalizer(
            self.attention_normalizer, causal=True, num_heads=self.n_head
        )
        resolve_attention_shape_options(self)
        resolve_canon_options(self, kwargs)
        if self.canon_layers not in (None, "B") and self.linear_attention is not None:
            raise ValueError(
                f"canon_layers={self.canon_layers!r}: in a hybrid only canon layer B (on the attention layers' q, k "
                "and v) is taken; A, C and D would act on every layer, and 'linear_attention' layers have their own "
                "short convolution (conv_kernel_size). Use canon_layers='B' or None in a hybrid."
            )
        super().__post_init__(**kwargs)
