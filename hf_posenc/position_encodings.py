"""The position-encoding catalogue: every scheme by name, from the family modules that define them.

The interface they implement is in ``position_interface.py``; ``docs/design.md`` says which hooks and backends each
scheme uses.
"""

from __future__ import annotations

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
from .content_position_encodings import TUPE, CoPE, DeBERTa, FoX, RelativeKey, Shaw, TransformerXL
from .position_interface import PositionEncoding
from .rotary_encodings import PoPE, RoPE, XPos
from .score_bias_encodings import FIRE, KERPLE, ALiBi, T5Bias


POSITION_ENCODINGS: dict[str, type[PositionEncoding]] = {
    scheme.name: scheme
    for scheme in (LearnedAbsolute, SinusoidalAbsolute, NoPosition, RoPE, T5Bias, ALiBi, KERPLE, FIRE, XPos)
    + (RecurrentAbsolute, Floater, MultiplicativeAbsolute, HierarchicalAbsolute, ComplexOrder, ConvAbsolute)
    + (Shaw, TransformerXL, DeBERTa, TUPE, CoPE, RelativeKey)
    + (PoPE, FoX)
}
