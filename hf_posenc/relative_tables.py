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

A table of rows per query read at a clipped or bucketed distance (Shaw's ``clip(j - i)``, DeBERTa's buckets) has
fewer rows than distances; on increasing key positions its row index is monotonic along the keys, so the keys that
read one row form a run: :func:`sorted_gather` reads it with the index and sums runs in its backward (a cumulative sum
read at :func:`run_starts`), and :func:`sum_sorted_runs` is the same sum forward (the attention weights summed per
row, Shaw's value term). :func:`in_query_chunks` builds a ``(q_len, kv_len)`` term a checkpointed chunk of queries at
a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional as F
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.checkpoint import checkpoint


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


def run_starts(index: torch.Tensor, rows: int) -> torch.Tensor:
    """``(batch|1, q_len, kv_len)`` index into a table of ``rows`` rows, non-decreasing along the keys ->
    ``(batch|1, q_len, rows + 1)``: entry ``r`` is the first key whose index is at least ``r``, so the keys that read
    row ``r`` are the run ``starts[r] .. starts[r + 1] - 1`` (possibly empty). Computed once per forward (a
    ``searchsorted`` per query row) and shared by every layer; what :func:`sorted_gather` and
    :func:`sum_sorted_runs` read instead of scattering."""
    targets = torch.arange(rows + 1, device=index.device, dtype=index.dtype)
    return torch.searchsorted(index.contiguous(), targets.expand(*index.shape[:-1], rows + 1).contiguous())


def _sum_runs(values: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """``out[b, h, i, r] = sum_{j in run r of row i} values[b, h, i, j]``: the difference of a cumulative sum over the
    keys (in at least float32) at the two ends of each run, ``(batch, heads, q_len, rows)``."""
    cumulative = values.cumsum(-1, dtype=torch.promote_types(values.dtype, torch.float32))  # entry j: keys 0..j
    # The keys before a run's first key b sum to cumulative[b - 1], or 0 for b = 0 (no padded copy of the sums).
    before = starts - 1
    expanded = (*values.shape[:-1], starts.shape[-1])
    totals = cumulative.gather(-1, before.clamp(min=0)[:, None].expand(expanded))
    totals = totals.masked_fill_((before < 0)[:, None].expand(expanded), 0.0)
    return totals.diff(dim=-1).to(values.dtype)


class _SortedGather(torch.autograd.Function):
    @staticmethod
    def forward(table: torch.Tensor, index: torch.Tensor, starts: torch.Tensor, descending: bool) -> torch.Tensor:
        return gather_rows(table, index)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, starts, descending = inputs
        ctx.save_for_backward(starts)
        ctx.descending = descending

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (starts,) = ctx.saved_tensors
        grad_table = _sum_runs(grad, starts)
        return grad_table.flip(-1) if ctx.descending else grad_table, None, None, None


class _SumSortedRuns(torch.autograd.Function):
    @staticmethod
    def forward(values: torch.Tensor, index: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        return _sum_runs(values, starts)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, index, _ = inputs
        ctx.save_for_backward(index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return gather_rows(grad, index), None, None


def _check_runs(index: torch.Tensor, starts: torch.Tensor) -> None:
    if index.dim() != 3 or starts.dim() != 3 or index.shape[:2] != starts.shape[:2]:
        raise ValueError(
            f"a pair index (batch|1, q_len, kv_len) and its run starts (batch|1, q_len, rows + 1) share their first "
            f"two sizes; got {tuple(index.shape)} and {tuple(starts.shape)}."
        )


def sorted_gather(
    table: torch.Tensor, index: torch.Tensor, starts: torch.Tensor, descending: bool = False
) -> torch.Tensor:
    """``out[b, h, i, j] = table[b, h, i, index[b, i, j]]``: a table of rows per query ``(batch, heads, q_len,
    rows)`` read at each (query, key) pair's row, for an ``index`` ``(batch|1, q_len, kv_len)`` that is monotonic
    along the keys (a clipped or bucketed distance on increasing key positions): non-decreasing with its
    :func:`run_starts` ``starts``, or non-increasing (``descending``) with the run starts of ``rows - 1 - index``.
    The keys reading one row are then a run, so the backward sums runs (a cumulative sum and a small gather) instead
    of scattering every pair's gradient into a few rows (atomic adds on the same addresses on a GPU). The order is
    not checked (that would read the data): the caller guarantees it."""
    _check_runs(index, starts)
    return _SortedGather.apply(table, index, starts, descending)


def sum_sorted_runs(values: torch.Tensor, index: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """The adjoint of :func:`sorted_gather`: ``out[b, h, i, r] = sum_{j: index[b, i, j] = r} values[b, h, i, j]``,
    ``(batch, heads, q_len, kv_len) -> (batch, heads, q_len, rows)`` (``rows = starts.shape[-1] - 1``), for an index
    non-decreasing along the keys and its :func:`run_starts` (the attention weights summed per relative row, as
    Shaw's value term needs). Dense: a cumulative sum over the keys in at least float32, read at the ends of each
    run; its backward is :func:`sorted_gather`."""
    _check_runs(index, starts)
    return _SumSortedRuns.apply(values, index, starts)


CHUNK_ELEMENTS = 2**23
"""Elements of one chunk tensor on the CPU (and any device but CUDA), e.g. a ``(batch, heads, chunk, kv_len)`` tensor
of :func:`in_query_chunks` (32 MiB in float32): memory is bounded per chunk whatever the length, and blocks this
large go back to the OS when freed (glibc serves allocations of 32 MiB and up by mmap), so the chunks' memory does
not stay resident."""

CUDA_CHUNK_ELEMENTS_CAP = 2**28
"""The most elements of one chunk tensor on CUDA (1 GiB in float32): 2 chunks a layer at 8 x 2048 tokens and 12
heads, where :data:`CHUNK_ELEMENTS` made 49, each a few dozen small kernels and a checkpoint (launch-bound)."""

CUDA_FREE_MEMORY_SHARE = 64
"""On CUDA one chunk tensor takes at most the free memory over this many bytes per element: a sixteenth of it in
float32, as a chunk holds a few such tensors at a time (scores, weights, their gradients)."""


def chunk_elements(device: torch.device) -> int:
    """The budget, in elements, of one chunk tensor of the chunked paths (:func:`in_query_chunks`, the learned-bias
    attention's query chunks, FIRE's MLP): :data:`CHUNK_ELEMENTS` on the CPU, sized for its allocator; on CUDA the
    free memory (``torch.cuda.mem_get_info``; under ``torch.compile`` the device's total memory, a constant) over
    :data:`CUDA_FREE_MEMORY_SHARE`, at most :data:`CUDA_CHUNK_ELEMENTS_CAP` and at least :data:`CHUNK_ELEMENTS`."""
    if device.type != "cuda":
        return CHUNK_ELEMENTS
    if torch.compiler.is_compiling():
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory, _ = torch.cuda.mem_get_info(device)
    return max(CHUNK_ELEMENTS, min(CUDA_CHUNK_ELEMENTS_CAP, memory // CUDA_FREE_MEMORY_SHARE))


def query_chunk_size(batch: int, heads: int, kv_len: int, device: torch.device) -> int:
    """Queries per chunk so that a ``(batch, heads, chunk, kv_len)`` tensor holds at most :func:`chunk_elements`
    elements on ``device`` (at least one query)."""
    return max(1, chunk_elements(device) // (batch * heads * kv_len))


FLEX_BLOCK = 128
"""FlexAttention's default block of queries and of keys (``create_block_mask``'s ``BLOCK_SIZE``), the tiles of a
mask built for a layer that has none, and the unit of a query chunk there."""


def flex_query_chunk_size(
    query: torch.Tensor, table_elements: Callable[[int], int], mask: BlockMask | None
) -> int | None:
    """Queries per FlexAttention call for a ``score_mod`` whose captured tables hold ``batch * heads *
    table_elements(chunk)`` elements for a chunk of ``chunk`` of the ``(batch, heads, q_len, head_dim)`` ``query``
    (a row table of the chunk's distances, say): the most queries, a multiple of the ``mask``'s block of queries
    (:data:`FLEX_BLOCK` without one), whose tables fit :func:`chunk_elements` (at least one block); None when
    every query fits in one call."""
    batch, heads, q_len, _ = query.shape
    block = FLEX_BLOCK if mask is None else mask.BLOCK_SIZE[0]
    budget = chunk_elements(query.device) // (batch * heads)
    if table_elements(q_len) <= budget:
        return None
    chunk = block
    while chunk + block < q_len and table_elements(chunk + block) <= budget:
        chunk += block
    return chunk


def in_query_chunks(
    chunk_term: Callable[[int, int], torch.Tensor],
    scores_shape: tuple[int, ...],
    device: torch.device,
    chunk: int | None = None,
) -> torch.Tensor:
    """A ``(batch, heads, q_len, kv_len)`` (``scores_shape``) score term on ``device`` built from ``chunk_term(start,
    stop)``, its rows ``start .. stop - 1``, ``chunk`` queries at a time (default: as many as fill
    :func:`chunk_elements`). With
    gradients each chunk is checkpointed (its intermediates, the ``(batch, heads, chunk, rows)`` products, gates and
    indices, are recomputed in the backward), so a layer keeps only the term itself: memory grows like
    ``chunk * kv_len``, not like several ``(q_len, kv_len)`` tensors."""
    batch, heads, q_len, kv_len = scores_shape
    chunk = chunk or query_chunk_size(batch, heads, kv_len, device)
    chunks = []
    for start in range(0, q_len, chunk):
        stop = min(start + chunk, q_len)
        if torch.is_grad_enabled():
            chunks.append(checkpoint(chunk_term, start, stop, use_reentrant=False))
        else:
            chunks.append(chunk_term(start, stop))
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-2)


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[b, h, i, j] = table[b, h, i, index[b, i, j]]``: a table of rows per query ``(batch, heads, q_len,
    rows)`` read at each (query, key) pair's row, ``index`` ``(batch|1, q_len, kv_len)`` in any order."""
    batch, heads, q_len, _ = table.shape
    return table.gather(-1, index[:, None].expand(batch, heads, q_len, index.shape[-1]))


def read_rows(table: torch.Tensor, index: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    """:func:`sorted_gather` (a backward by runs) when the index rises along the keys and comes with its
    :func:`run_starts`, else :func:`gather_rows` (whose backward scatters)."""
    return gather_rows(table, index) if starts is None else sorted_gather(table, index, starts)


def sum_rows(values: torch.Tensor, index: torch.Tensor, starts: torch.Tensor | None, rows: int) -> torch.Tensor:
    """The adjoint of :func:`read_rows`: ``out[b, h, i, r] = sum_{j: index[b, i, j] = r} values[b, h, i, j]``,
    ``(batch, heads, q_len, rows)``: by runs (:func:`sum_sorted_runs`) with ``starts``, else scattered."""
    if starts is not None:
        return sum_sorted_runs(values, index, starts)
    batch, heads, q_len, kv_len = values.shape
    expanded = index[:, None].expand(batch, heads, q_len, kv_len)
    return values.new_zeros(batch, heads, q_len, rows).scatter_add(-1, expanded, values)


BAND_BLOCK = 64
"""Queries per block in :func:`band_dot_products` (at least the band's width)."""


def band_dot_products(query: torch.Tensor, key: torch.Tensor, reach: int) -> torch.Tensor:
    """``q_i . k_(i + d)`` for ``|d| <= reach``, in at least float32: ``(..., n, head_dim)`` queries and keys of the
    same length ``n`` -> ``(..., n, 2 reach + 1)``, column ``d + reach``; 0 where ``i + d`` is outside ``0 .. n - 1``.

    One matmul per block of ``c`` queries against its window of ``c + 2 reach`` keys (an overlapping view of the
    zero-padded keys), then each query's band read from the block's scores with a row stride one longer than the
    window (the skew of :func:`skew`): ``O(n (c + 2 reach) head_dim)`` work, never the ``(n, n)`` scores."""
    n = query.shape[-2]
    if key.shape[-2] != n:
        raise ValueError(f"band_dot_products takes queries and keys of one length; got {n} and {key.shape[-2]}.")
    width = 2 * reach + 1
    block = max(width, BAND_BLOCK)
    blocks = -(-n // block)
    window = block + width - 1
    dtype = torch.promote_types(query.dtype, torch.float32)
    queries = F.pad(query.to(dtype), (0, 0, 0, blocks * block - n)).unflatten(-2, (blocks, block))
    keys = F.pad(key.to(dtype), (0, 0, reach, blocks * block - n + reach))
    with torch.autocast(query.device.type, enabled=False):  # in the dtype asked for, as FlexAttention's scores
        scores = torch.matmul(queries, keys.unfold(-2, window, block))  # (..., blocks, block, window)
    padded = F.pad(scores.flatten(-2), (0, block))  # row r of a block starts r columns further in its window
    band = padded.unflatten(-1, (block, window + 1))[..., :width]
    return band.flatten(-3, -2)[..., :n, :]
