"""Canon layers: a causal depthwise convolution with a residual at up to four points of every Transformer layer
(Allen-Zhu 2025, "Physics of Language Models: Part 4.1, Architecture Design and the Magic of Canon Layers", arXiv
2512.17351; reference: facebookresearch/PhysicsLM4, ``huggingface/canon_helper.py``).

At each chosen point the ``(batch, seq, channels)`` tensor ``h`` becomes

    ``h'_t = h_t + sum_{w=0}^{K-1} W[c, w] h_{t-K+1+w}``    (``h_s = 0`` for ``s < 0``; no bias, no activation)

per channel ``c``, ``K`` = ``canon_kernel_size``: each token mixes in the ``K - 1`` tokens before it, so positions leak
into a model that has none (NoPE). The reference's defaults: ``canon_residual`` True, ``canon_activation`` False,
``canon_bias`` False, kernel 4; ``W`` initialised as ``nn.Conv1d.reset_parameters`` does (Kaiming-uniform with
``a = sqrt(5)``: ``U(-1/sqrt(K), 1/sqrt(K))``). Padding tokens are zeroed before the convolution (a 2-D mask; a
token no query sees in a 4-D mask), so a real token never reads them and a padded row equals the row alone. Causal in
both families (the paper's formula): in an encoder it is the same left-to-right mixer.

With a KV cache each layer keeps, per point, every token's (zeroed) input as a per-token state with the cache
(:class:`~hf_posenc.position_interface.PositionCache`, in a cache layer of the kind of the attention layer's), and a
step reads the ``K - 1`` stored rows before its tokens, so ``generate`` (dynamic and static caches, beam search,
cropping) gives the uncached numbers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention.flex_attention import BlockMask
from transformers import initialization as init
from transformers.cache_utils import Cache

from .absolute_encodings import padding_keep
from .position_interface import AttentionInputs, LayerPositionTerm, PositionCache


CANON_POINTS = {
    "A": "the attention's input (GPT-2: after ln_1; BERT: the layer's input), before q, k and v are projected",
    "B": "the projected q, k and v together (after QK-norm, before the position encoding and the KV cache)",
    "C": "the MLP's input (GPT-2: after ln_2; BERT: the attention block's output)",
    "D": "inside the MLP, after its up projection, before the activation",
}
"""The paper's insertion points, in the order a layer meets them."""

CANON_FIELDS = ("canon_layers", "canon_kernel_size")
DEFAULT_CANON_KERNEL_SIZE = 4


def resolve_canon_layers(value: Any) -> str | None:
    """``canon_layers`` as stored: None (off; also for ``""``) or the chosen points of :data:`CANON_POINTS` as a
    string in the order ``"ABCD"`` (any order and case accepted). ``ValueError`` names the bad value and the
    choices."""
    if value is None or value == "":
        return None
    letters = value.upper() if isinstance(value, str) else None
    if letters is None or any(letter not in CANON_POINTS for letter in letters) or len(set(letters)) != len(letters):
        raise ValueError(
            "canon_layers must be None or '' (off) or a string of distinct insertion points from "
            f"{list(CANON_POINTS)} (e.g. 'ABCD', the paper's full set, or 'AC'); got {value!r}."
        )
    return "".join(point for point in CANON_POINTS if point in letters)


def resolve_canon_options(config, unknown_fields: dict[str, Any]) -> None:
    """Check and normalise ``config.canon_layers`` and ``config.canon_kernel_size`` in place: ``ValueError`` for a bad
    value, for a kernel size set without canon layers (it would have no effect), for any other config field named
    ``canon*`` in ``unknown_fields`` (a misspelling, or the reference's ``canon_set``, would otherwise pass silently
    as an attribute), and for a windowed layer whose cache keeps fewer than the ``K - 1`` tokens a step reads."""
    misspelt = sorted(name for name in unknown_fields if name.lower().startswith("canon"))
    if misspelt:
        raise ValueError(f"Unknown config field(s) {misspelt}; the canon layers' fields are {list(CANON_FIELDS)}.")
    config.canon_layers = resolve_canon_layers(config.canon_layers)
    size = config.canon_kernel_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 2:
        raise ValueError(f"canon_kernel_size must be an integer >= 2 (the paper's 4); got {size!r}.")
    if config.canon_layers is None and size != DEFAULT_CANON_KERNEL_SIZE:
        raise ValueError(
            f"canon_kernel_size={size} has no effect without canon_layers; set canon_layers (e.g. 'ABCD') or leave "
            f"canon_kernel_size at {DEFAULT_CANON_KERNEL_SIZE}."
        )
    if config.canon_layers is None or config.layer_types is None:
        return
    windows = {"sliding_attention": config.sliding_window, "chunked_attention": config.attention_chunk_size}
    narrowest = min((windows[kind] for kind in config.layer_types if kind in windows), default=None)
    if narrowest is not None and narrowest < size:
        raise ValueError(
            f"canon_kernel_size={size} reads the {size - 1} tokens before each token from the KV cache, which a "
            f"windowed layer's cache keeps only for a window of at least {size} tokens; the narrowest window here has "
            f"{narrowest}."
        )


def position_state_slots(model: nn.Module) -> int:
    """The cache slots after the key positions that the model's position encoding and its layer terms keep their
    per-token states in (``PositionCache.append_state``, ``append_layer_state``): the canon layers' follow them."""
    encoding = model.position_encoding
    num_layers = encoding.dims.num_layers
    scheme_states = max(len(encoding.layer_encoding(layer).cache_states) for layer in range(num_layers))
    term_states = max(
        (len(module.cache_states) for module in model.modules() if isinstance(module, LayerPositionTerm)), default=0
    )
    return max(scheme_states, len(encoding.cache_states)) + num_layers * term_states


def canon_forward_inputs(
    model: nn.Module,
    attention_mask: torch.Tensor | None,
    query_length: int,
    past_length: int | torch.Tensor,
    position_cache: PositionCache | None,
) -> dict[str, Any]:
    """What every canon layer reads per forward, in the layers' :data:`AttentionInputs` as ``"canon"``: ``keep``,
    ``(batch, q_len)`` booleans False on padding (None: no mask), ``past_length`` (the cached tokens) and
    ``first_slot``, the cache slot of the first layer's first point (0 without a cache)."""
    if isinstance(attention_mask, BlockMask):
        raise ValueError(
            "canon_layers zero the padding tokens before their convolution and read them from the attention mask; a "
            "BlockMask does not say which tokens are padding: pass a 2-D or 4-D tensor attention_mask."
        )
    if isinstance(past_length, torch.Tensor):  # a static cache's count, which its first layer's update increments
        past_length = past_length.clone()
    first_slot = 0
    if position_cache is not None:
        first_slot = position_cache.num_key_slots + position_state_slots(model)
    keep = padding_keep(attention_mask, query_length, past_length)
    return {"keep": keep, "past_length": past_length, "first_slot": first_slot}


class CanonLayer(nn.Module):
    """One canon layer: ``h + CausalDepthwiseConv1d(h)`` over ``channels`` channels (module docstring). ``weight`` is
    ``(channels, 1, kernel_size)`` as a depthwise ``nn.Conv1d``'s (the reference's layout): ``weight[c, 0, K - 1]``
    multiplies the current token."""

    def __init__(self, channels: int, kernel_size: int, layer_idx: int, num_layers: int, state_index: int):
        super().__init__()
        self.channels, self.kernel_size = channels, kernel_size
        self.layer_idx, self.num_layers, self.state_index = layer_idx, num_layers, state_index
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))

    def init_weights(self) -> None:
        """``nn.Conv1d``'s default init, as the reference's ``reset_parameters``: ``U(-1/sqrt(fan_in), ...)``,
        ``fan_in = kernel_size`` (one input channel per group)."""
        bound = 1 / math.sqrt(self.kernel_size)
        init.uniform_(self.weight, -bound, bound)

    def extra_repr(self) -> str:
        return f"channels={self.channels}, kernel_size={self.kernel_size}"

    def forward(self, hidden_states: torch.Tensor, attention_inputs: AttentionInputs, cache: Cache | None = None):
        canon = attention_inputs["canon"]
        keep, width = canon["keep"], self.kernel_size
        inputs = hidden_states if keep is None else hidden_states * keep[..., None].to(hidden_states.dtype)
        if cache is None:
            window = F.pad(inputs, (0, 0, width - 1, 0))
        else:
            position_cache = PositionCache(cache, self.num_layers)
            slot, seq_len = canon["first_slot"] + self.state_index, inputs.shape[1]
            kept_from = position_cache.kept_from(slot, seq_len)
            stored = position_cache.append(slot, inputs, like=self.layer_idx)
            tokens = canon["past_length"] + torch.arange(1 - width, seq_len, device=inputs.device)
            window = stored[:, (tokens - kept_from).clamp(min=0)] * (tokens >= 0)[None, :, None].to(inputs.dtype)
        mixed = F.conv1d(window.transpose(1, 2), self.weight, groups=self.channels).transpose(1, 2)
        return hidden_states + mixed


def build_canon_layer(config, point: str, channels: int, layer_idx: int) -> CanonLayer | None:
    """Attention layer ``layer_idx``'s canon layer at insertion point ``point`` over ``channels`` channels, or None
    where ``config.canon_layers`` leaves the point out."""
    config.canon_layers = resolve_canon_layers(getattr(config, "canon_layers", None))
    if config.canon_layers is None or point not in config.canon_layers:
        return None
    points = config.canon_layers
    state_index = layer_idx * len(points) + points.index(point)
    return CanonLayer(channels, config.canon_kernel_size, layer_idx, config.num_hidden_layers, state_index)
