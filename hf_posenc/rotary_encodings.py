"""Rotary position encodings: q and k are rotated by their positions before the KV cache (``transform_qkv``).

Source: Su Jianlin, "Transformer position encodings" (kexue.fm/archives/8130, "融合式"), and the papers per class.
"""

from __future__ import annotations

import torch

from .options import Option
from .position_interface import PositionEncoding


def rotary_inverse_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    """``theta^(-2i/d)`` for ``i = 0 .. d/2 - 1``, d the rotated dimension."""
    return theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` features of ``x`` ``(batch, heads, seq, head_dim)``.

    Feature ``i`` is paired with ``i + d/2`` (the "rotate half" layout; Su's interleaved pairs ``(2i, 2i+1)`` are the
    same rotation up to a fixed permutation of features): ``(x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos)``.
    ``cos``/``sin`` are ``(batch|1, 1, seq, d/2)``.
    """
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest), dim=-1)


class RoPE(PositionEncoding):
    """Rotary position embedding: ``q_m -> R_m q_m``, ``k_n -> R_n k_n``, so ``<R_m q, R_n k> = <q, R_(n-m) k>``.

    ``R_m`` rotates feature pairs by the angles ``m * theta^(-2i/d)``; ``rotary_fraction`` < 1 rotates only the first
    ``d * rotary_fraction`` features of each head. Source: Su et al. 2021 (RoFormer); kexue.fm/archives/8130 "融合式".
    Keys are rotated before they enter the KV cache, so cached keys keep their positions.
    """

    name = "rope"
    description = "rotary: rotate q and k by position (Su et al. 2021)"
    relative = True
    options = {
        "theta": Option(10000.0, (float, int), "rotation base", lambda v: v > 1, "a number > 1"),
        "rotary_fraction": Option(
            1.0, (float, int), "fraction of each head's features rotated", lambda v: 0 < v <= 1, "0 < x <= 1"
        ),
    }

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        self.rotary_dim = int(dims.head_dim * spec["rotary_fraction"]) // 2 * 2
        if self.rotary_dim < 2:
            raise ValueError(
                f"rope: rotary_fraction={spec['rotary_fraction']} of head_dim={dims.head_dim} rotates "
                f"{self.rotary_dim} features; it must rotate at least 2 (raise rotary_fraction)."
            )

    def prepare(self, query_positions, key_positions, backend):
        # Frequencies in float64, angles in float32, for each forward: a model cast to bf16 keeps exact rotations.
        inv_freq = rotary_inverse_frequencies(self.rotary_dim, self.spec["theta"]).to(query_positions.device)
        angles = query_positions[:, None, :, None].float() * inv_freq.float()
        return {"cos": angles.cos(), "sin": angles.sin()}

    def transform_qkv(self, query, key, value, tables):
        cos, sin = tables["cos"].to(query.dtype), tables["sin"].to(query.dtype)
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value
