"""The attention-normalizer catalogue: how raw scores ``b_ij`` become attention weights ``a_ij``.

Source: Su Jianlin, "A hidden flaw of relative position encodings" (kexue.fm/archives/9105). Every normalizer gives
masked keys (padding, causal) a weight of exactly 0, and a query row with no visible key all zeros, never NaN.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .options import CatalogueEntry
from .position_encodings import BACKENDS, AttentionDims


def _masked_row_max(scores: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """Row max over visible keys (0 for a row with none), so ``exp(b - max) <= 1`` never overflows."""
    if visible is None:
        return scores.amax(dim=-1, keepdim=True)
    row_max = scores.masked_fill(~visible, float("-inf")).amax(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))


class AttentionNormalizer(CatalogueEntry, nn.Module):
    """Base class: ``forward(scores, visible) -> weights``.

    Args of ``forward``:
        scores: ``(batch, heads, q_len, kv_len)`` raw scores ``b_ij``, in float32.
        visible: boolean ``(batch|1, 1|heads, q_len, kv_len)``, True where a query may attend a key; None = all.

    Class attributes:
        backends: attention backends that can compute it without materialising the weights.
    """

    backends: tuple[str, ...] = ("eager",)

    def __init__(self, spec: dict[str, Any], dims: AttentionDims):
        super().__init__()
        self.spec = spec
        self.dims = dims

    def value_init_scale(self) -> float:
        """Factor on the initial std of W_V and W_O (1: the family's usual init)."""
        return 1.0

    def forward(self, scores: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class Softmax(AttentionNormalizer):
    """``a_ij = e^(b_ij) / sum_j e^(b_ij)``: rows sum to 1 (the l1 normalisation behind the flaw in F)."""

    name = "softmax"
    description = "e^b / sum_j e^b (rows sum to 1)"
    backends = BACKENDS

    def forward(self, scores, visible):
        if visible is None:
            return torch.softmax(scores, dim=-1)
        # exp(min - row max) is exactly 0 for a masked key; a row with no visible key comes out uniform, then 0.
        weights = torch.softmax(scores.masked_fill(~visible, torch.finfo(scores.dtype).min), dim=-1)
        return weights.masked_fill(~visible, 0.0)


class L2(AttentionNormalizer):
    """``a_ij = e^(b_ij) / sqrt(sum_j e^(2 b_ij))``: each row has unit l2 norm, its sum is free (F, eq. "l2").

    Computed as ``e^(b - m) / ||e^(b - m)||_2`` with ``m`` the row max, which is the same ratio without overflow.
    F reports that with the standard Attention + FFN block it needs a smaller initial variance of W_V and W_O: a
    uniform row of ``n`` keys sums to ``sqrt(n)`` instead of 1, so the default init scales both by
    ``max_positions^(-1/4)``, which brings the attention output at full length back to softmax's scale.
    """

    name = "l2"
    description = "e^b / sqrt(sum_j e^(2b)) (rows have unit l2 norm)"

    def value_init_scale(self) -> float:
        return self.dims.max_positions**-0.25

    def forward(self, scores, visible):
        exp = torch.exp(scores - _masked_row_max(scores, visible))
        if visible is not None:
            exp = exp.masked_fill(~visible, 0.0)
        norm = exp.square().sum(dim=-1, keepdim=True).sqrt()
        return exp / norm.clamp(min=torch.finfo(exp.dtype).tiny)


ATTENTION_NORMALIZERS: dict[str, type[AttentionNormalizer]] = {
    normalizer.name: normalizer for normalizer in (Softmax, L2)
}
