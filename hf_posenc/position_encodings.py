"""The position-encoding catalogue: every scheme by name, from the family modules that define them.

The interface they implement is in ``position_interface.py``; ``docs/design.md`` says which hooks and backends each
scheme uses.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .absolute_encodings import (
    ComplexOrder,
    ConvAbsolute,
    Floater,
    HierarchicalAbsolute,
    LearnedAbsolute,
    MultiplicativeAbsolute,
    NoPosition,
    RecurrentAbsolute,
    SinusoidalAbsolute,
)
from .content_position_encodings import TUPE, DeBERTa, RelativeKey, Shaw, TransformerXL
from .data_dependent_encodings import CoPE, FoX, PaTH
from .grape_encodings import Grape
from .input_dependent_encodings import SelectiveRoPE, Wall
from .position_interface import AttentionDims, PositionEncoding
from .rotary_encodings import PoPE, RoPE, XPos
from .score_bias_encodings import FIRE, KERPLE, ALiBi, T5Bias


POSITION_ENCODINGS: dict[str, type[PositionEncoding]] = {
    scheme.name: scheme
    for scheme in (LearnedAbsolute, SinusoidalAbsolute, NoPosition, RoPE, T5Bias, ALiBi, KERPLE, FIRE, XPos)
    + (RecurrentAbsolute, Floater, MultiplicativeAbsolute, HierarchicalAbsolute, ComplexOrder, ConvAbsolute)
    + (Shaw, TransformerXL, DeBERTa, TUPE, CoPE, RelativeKey)
    + (PoPE, FoX, PaTH, Wall, SelectiveRoPE, Grape)
}


class PerLayerPositionEncoding(PositionEncoding):
    """A scheme per attention layer (``position_encoding=[spec_0, spec_1, ...]``, one full spec per layer): Llama 4's
    and SmolLM3's RoPE with a NoPE layer every few (``no_rope_layers``), or any other mix of attention-side schemes.

    Each distinct spec is built once, so layers with equal specs share its parameters, as every layer shares a
    uniform layout's (a ``t5`` table, FIRE's MLP; a scheme's per-layer terms stay per layer). A layer asks for its own
    scheme with :meth:`layer_encoding`; the model's set-up (``prepare_attention``) builds each distinct scheme's
    tables, backend and mask once per forward. The config refuses an input-side scheme (``acts_at_input``) that is
    not on every layer, and a layout with the same spec on every layer builds that scheme alone, so ``embed`` here
    passes the input through."""

    name = "per_layer"

    def __init__(self, specs: list[dict[str, Any]], dims: AttentionDims):
        distinct = [spec for index, spec in enumerate(specs) if spec not in specs[:index]]
        super().__init__({"type": self.name, "layers": specs}, dims)
        self.schemes = nn.ModuleList(POSITION_ENCODINGS[spec["type"]](spec, dims) for spec in distinct)
        self.layer_schemes = [distinct.index(spec) for spec in specs]

    def layer_encoding(self, layer_idx: int | None) -> PositionEncoding:
        if layer_idx is None:
            raise ValueError("A per-layer position encoding needs the attention layer's index (layer_idx).")
        return self.schemes[self.layer_schemes[layer_idx]]

    def resize_token_tables(self, num_tokens: int) -> None:
        for scheme in self.schemes:
            scheme.resize_token_tables(num_tokens)

    def extra_repr(self) -> str:
        return f"layer_schemes={self.layer_schemes}"


def build_position_encoding_module(
    specs: dict[str, Any] | list[dict[str, Any]], dims: AttentionDims
) -> PositionEncoding:
    """The model's position encoding from resolved specs: one scheme, or with different specs per layer a
    :class:`PerLayerPositionEncoding` (a list with the same spec on every layer builds that scheme alone, with its
    parameter names)."""
    if isinstance(specs, dict):
        return POSITION_ENCODINGS[specs["type"]](specs, dims)
    if all(spec == specs[0] for spec in specs):
        return POSITION_ENCODINGS[specs[0]["type"]](specs[0], dims)
    return PerLayerPositionEncoding(specs, dims)
