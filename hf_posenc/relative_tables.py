"""Reading per-distance tables per (query, key) pair, without an index gather.

A term that depends on the distance ``i - j`` only needs one value per distance: ``q_len + kv_len - 1`` values
instead of ``q_len * kv_len``. These functions expand such tables into the ``(q_len, kv_len)`` layout the dense
kernels (eager, SDPA) add to the scores, through strided views of the table, so the backward sums each diagonal
instead of scattering every pair's gradient into a few rows (an index gather's backward is an atomic add per pair on
a GPU, all on the same addresses).

Convention: for a query block of ``q_len`` consecutive positions and ``kv_len`` consecutive keys, column ``s`` of a
table holds distance ``i - j = s - (kv_len - 1)`` in local indices (``i`` in ``0 .. q_len - 1``, ``j`` in
``0 .. kv_len - 1``): ``s = 0`` is the farthest key to the right of the first query, ``s = kv_len - 1 + q_len - 1``
the farthest key to the left of the last query. With absolute positions ``i + p`` and ``j + r``, the distance is
``s - (kv_len - 1) + p - r``.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def _sum_diagonals(grad: torch.Tensor) -> torch.Tensor:
    """``(..., q_len, kv_len) -> (..., q_len + kv_len - 1)``: entry ``s`` is the sum of ``grad[..., i, j]`` over
    ``i - j = s - (kv_len - 1)``. Rows reversed and padded by ``q_len`` zeros, then read with a row stride one short
    of the padded width: each diagonal lands in one column, and a plain sum over rows adds it up."""
    q_len, kv_len = grad.shape[-2:]
    width = q_len + kv_len - 1
    padded = F.pad(grad.flip(-2), (0, q_len))  # (..., q_len, kv_len + q_len), contiguous
    flat = padded.reshape(*grad.shape[:-2], q_len * (kv_len + q_len))
    skewed = flat[..., : q_len * width].view(*grad.shape[:-2], q_len, width)
    return skewed.sum(-2).flip(-1)


class _Toeplitz(torch.autograd.Function):
    @staticmethod
    def forward(per_distance: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
        return per_distance.flip(-1).unfold(-1, kv_len, 1).flip(-2).contiguous()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sum_diagonals(grad), None, None


def toeplitz(per_distance: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """``(..., q_len + kv_len - 1) -> (..., q_len, kv_len)``: ``out[..., i, j] = per_distance[..., i - j + kv_len -
    1]`` (the module's column convention), with a backward that sums diagonals (no scatter)."""
    if per_distance.shape[-1] != q_len + kv_len - 1:
        raise ValueError(
            f"a per-distance table for {q_len} queries and {kv_len} keys has {q_len + kv_len - 1} columns; "
            f"got {per_distance.shape[-1]}."
        )
    return _Toeplitz.apply(per_distance, q_len, kv_len)


def skew(rows: torch.Tensor, kv_len: int) -> torch.Tensor:
    """``(..., q_len, q_len + kv_len - 1) -> (..., q_len, kv_len)``: ``out[..., i, j] = rows[..., i, i - j + kv_len -
    1]``, a table read per query row (``q . R_(i - j)``), as in Music Transformer's relative attention (Huang et al.
    2019): the rows reversed and padded by one column, then read with a row stride one longer than the table, so row
    ``i`` starts ``q_len - 1 - i`` columns in. Views only; extra memory O(q_len * columns)."""
    q_len, width = rows.shape[-2:]
    if width != q_len + kv_len - 1:
        raise ValueError(f"rows for {q_len} queries and {kv_len} keys have {q_len + kv_len - 1} columns; got {width}.")
    padded = F.pad(rows.flip(-1), (0, 1))  # (..., q_len, width + 1), contiguous
    flat = padded.reshape(*rows.shape[:-2], q_len * (width + 1))
    shifted = flat[..., q_len - 1 : q_len - 1 + q_len * width].view(*rows.shape[:-2], q_len, width)
    return shifted[..., :kv_len]
