"""Absolute and input-side position encodings: the position enters through the ``embed`` hook only.

Sources: Su Jianlin, "Transformer position encodings" (kexue.fm/archives/8130), and the papers cited per class.
"""

from __future__ import annotations

import torch
from torch import nn

from .options import Option
from .position_interface import EmbeddingInputs, PositionEncoding


class LearnedAbsolute(PositionEncoding):
    """Trainable absolute table added to the input: ``x_k + p_k`` (BERT, GPT-2). Parameters: ``table``
    ``(max_positions, hidden)``. Positions at or past ``max_positions`` raise a ``ValueError``."""

    name = "learned"
    description = "trainable absolute position table added to the input (BERT/GPT-2 default)"
    options = {
        "max_positions": Option(
            None, (int,), "table length (default: max_position_embeddings)", lambda v: v >= 1, "an int >= 1"
        ),
    }

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        self.table = nn.Embedding(spec["max_positions"] or dims.max_positions, dims.hidden_size)

    def embed(self, inputs: EmbeddingInputs) -> torch.Tensor:
        position_ids = inputs.position_ids
        if not torch.compiler.is_compiling():
            limit = self.table.num_embeddings
            if int(position_ids.min()) < 0:
                raise ValueError(f"Position ids must be >= 0 for a learned table; got {int(position_ids.min())}.")
            if int(position_ids.max()) >= limit:
                raise ValueError(
                    f"Position {int(position_ids.max())} is outside the learned position table of {limit} positions "
                    f"(0..{limit - 1}). Use hf_posenc.extend_positions(model, max_positions) to lengthen the table, "
                    "or a scheme without a length limit (rope, t5, alibi, sinusoidal)."
                )
        return inputs.inputs_embeds + self.table(position_ids)


def sinusoidal_table(position_ids: torch.Tensor, dim: int, base: float) -> torch.Tensor:
    """Vaswani et al. 2017: ``p_(k,2i) = sin(k / base^(2i/d))``, ``p_(k,2i+1) = cos(k / base^(2i/d))``.

    ``position_ids`` ``(batch, seq)`` -> ``(batch, seq, dim)`` in float32.
    """
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=position_ids.device) / dim)
    angles = position_ids[..., None].float() * inv_freq
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[..., :dim]


class SinusoidalAbsolute(PositionEncoding):
    """Fixed sin/cos table added to the input (Vaswani et al. 2017, "Attention Is All You Need"); no length limit."""

    name = "sinusoidal"
    description = "fixed sin/cos absolute table added to the input (Vaswani et al. 2017)"
    options = {"base": Option(10000.0, (float, int), "wavelength base", lambda v: v > 1, "a number > 1")}

    def embed(self, inputs: EmbeddingInputs) -> torch.Tensor:
        table = sinusoidal_table(inputs.position_ids, self.dims.hidden_size, self.spec["base"])
        return inputs.inputs_embeds + table.to(inputs.inputs_embeds.dtype)


class NoPosition(PositionEncoding):
    """NoPE: no position information; a decoder still sees order through its causal mask."""

    name = "none"
    description = "no position information (NoPE)"
    relative = True
