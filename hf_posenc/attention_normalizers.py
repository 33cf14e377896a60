"""The attention-normalizer catalogue: how raw scores ``b_ij`` become attention weights ``a_ij``.

Source: Su Jianlin, "A hidden flaw of relative position encodings" (kexue.fm/archives/9105). A normalizer sees scores
whose masked keys (padding, causal) are already ``finfo.min``, and must give them a weight of exactly 0; the attention
composition guarantees every row it sees has a visible key, and sets rows without one to 0 itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .options import CatalogueEntry
from .position_interface import BACKENDS, AttentionDims, AttentionInputs


class AttentionNormalizer(CatalogueEntry, nn.Module):
    """Base class: ``forward(scores, attention_inputs) -> weights``, one module per attention layer.

    Args of ``forward``:
        scores: ``(batch, heads, q_len, kv_len)`` scores ``b_ij`` in at least float32, ``finfo.min`` on masked keys;
            every row has at least one visible key.
        attention_inputs: the per-forward :data:`AttentionInputs` (``"visible"`` keys, query and key positions),
            for normalizers that need more than the scores.

    Class attributes:
        backends: attention backends that can compute it without materialising the weights
            (``supported_backends`` may narrow it by option).
    """

    backends: tuple[str, ...] = ("eager",)

    def __init__(self, spec: dict[str, Any], dims: AttentionDims):
        super().__init__()
        self.spec = spec
        self.dims = dims

    @classmethod
    def supported_backends(cls, spec: dict[str, Any]) -> tuple[str, ...]:
        """The backends that can run the normalizer with these options."""
        return cls.backends

    def value_init_scale(self) -> float:
        """Factor on the initial std of W_V and W_O (1: the family's usual init)."""
        return 1.0

    def forward(self, scores: torch.Tensor, attention_inputs: AttentionInputs) -> torch.Tensor:
        raise NotImplementedError


class Softmax(AttentionNormalizer):
    """``a_ij = e^(b_ij) / sum_j e^(b_ij)``: rows sum to 1 (the l1 normalisation behind the flaw in F)."""

    name = "softmax"
    description = "e^b / sum_j e^b (rows sum to 1)"
    backends = BACKENDS

    def forward(self, scores, attention_inputs):
        return torch.softmax(scores, dim=-1)


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

    def forward(self, scores, attention_inputs):
        exp = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # masked keys: exp(min - max) = 0 exactly
        return exp / exp.square().sum(dim=-1, keepdim=True).sqrt()  # >= 1: the row max contributes e^0


ATTENTION_NORMALIZERS: dict[str, type[AttentionNormalizer]] = {
    normalizer.name: normalizer for normalizer in (Softmax, L2)
}
