"""Softmax attention with a learned additive score term on SDPA, differentiated without SDPA's math fallback.

PyTorch's CPU SDPA kernels (flash, torch 2.13) take a float ``attn_mask`` but do not differentiate it: a mask that
requires grad (a content-position term, or a learned position bias folded into the mask) sends SDPA to its math path,
which keeps the scores, the weights and their copies for the backward, about 3 ``(batch, heads, q_len, kv_len)``
tensors per layer (measured: 212 MiB for one 4-head layer at 2048 tokens, against 17 MiB without the mask's grad).
:func:`attention_with_learned_bias` runs SDPA's fused forward with the mask detached, keeps only q, k, v, the mask
(the one ``(q_len, kv_len)`` tensor the layer has anyway) and the output, and recomputes the weights in the backward
(FlashAttention's backward, Dao et al. 2022, section 3.1, written with dense matmuls):

``P = softmax(scale q k^T + M)``, ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P (dP - rowsum(dO O))``,
``dq = scale dS k``, ``dk = scale dS^T q``, ``dM = dS`` (summed over the dimensions ``M`` broadcasts).

The backward runs in chunks of queries (``relative_tables.chunk_elements`` of ``P`` at a time, a budget that
depends on the device), so besides ``dM`` (the mask's gradient, ``(q_len, kv_len)``-sized by nature) it holds two
chunk-sized tensors, not two ``(q_len, kv_len)`` ones.

With a value term ``o_i += sum_j P_ij T[idx_ij]`` (:class:`~hf_posenc.position_interface.ValueRows`, Shaw's ``R^V``)
the forward needs ``P`` anyway: it computes it a chunk of queries at a time, in at least float32, and gives
``P v + m T`` (``m = sum_rows(P)``, the weights summed per row) instead of SDPA's output; the backward adds the value
term's share: ``dP_ij += dO_i . T[idx_ij]`` and ``dT = sum m^T dO``, with ``O`` the whole output in
``rowsum(dO O)``.
"""

from __future__ import annotations

import torch
from torch import nn

from .position_interface import ValueRows
from .relative_tables import query_chunk_size, read_rows, sum_rows


def _sum_to_shape(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``grad`` summed over the dimensions where ``shape`` has size 1 (a broadcast batch or head dimension)."""
    dims = [dim for dim, size in enumerate(shape) if size == 1 and grad.shape[dim] != 1]
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def _chunk_weights(query: torch.Tensor, key_t: torch.Tensor, bias: torch.Tensor, scale: float, rows: slice):
    """``softmax(scale q k^T + bias)`` of the queries ``rows``, in place on the one chunk-sized tensor."""
    scores = torch.matmul(query[..., rows, :], key_t).mul_(scale)
    return scores.add_(bias[..., rows, :]).softmax(-1)


def _chunk_value_rows(value_rows: ValueRows, rows: slice) -> tuple[torch.Tensor, torch.Tensor | None]:
    return value_rows.index[:, rows], None if value_rows.starts is None else value_rows.starts[:, rows]


class _AttentionWithLearnedBias(torch.autograd.Function):
    @staticmethod
    def forward(query, key, value, bias, scale, table, index, starts):
        if table is None:
            # Detached: CPU SDPA picks its math kernel for a mask that requires grad, even with grad mode off here.
            return nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=bias.detach(), scale=scale)
        # With a value term the weights are needed anyway: each chunk of queries computes them once, and its output
        # P v + (P summed per row) table, rather than SDPA's fused pass plus a second pass for the weights.
        value_rows = ValueRows(table, index, starts)
        dtype = torch.promote_types(query.dtype, torch.float32)
        query_, key_t, value_, table_ = (
            query.to(dtype),
            key.to(dtype).transpose(-1, -2),
            value.to(dtype),
            table.to(dtype),
        )
        output = torch.empty(query.shape[:-1] + value.shape[-1:], dtype=dtype, device=query.device)
        for rows in _query_chunks(query, key):
            weights = _chunk_weights(query_, key_t, bias, scale, rows)
            per_row = sum_rows(weights, *_chunk_value_rows(value_rows, rows), table.shape[0])
            output[..., rows, :] = torch.matmul(weights, value_).add_(torch.matmul(per_row, table_))
        return output.to(query.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        query, key, value, bias, scale, table, index, starts = inputs
        ctx.save_for_backward(query, key, value, bias, output, table, index, starts)
        ctx.scale = scale

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, bias, output, table, index, starts = ctx.saved_tensors
        value_rows = None if table is None else ValueRows(table, index, starts)
        dtype = torch.promote_types(query.dtype, torch.float32)
        query_, key_, value_ = query.to(dtype), key.to(dtype), value.to(dtype)
        key_t, grad_output_ = key_.transpose(-1, -2), grad_output.to(dtype)
        # rowsum(dO O) = sum_j P_ij dP_ij, with O the whole output (the value term included).
        row_dot = (grad_output_ * output.to(dtype)).sum(-1, keepdim=True)
        grad_query = torch.empty_like(query_)
        grad_key, grad_value = torch.zeros_like(key_), torch.zeros_like(value_)
        grad_bias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device) if ctx.needs_input_grad[3] else None
        if value_rows is not None:
            table_ = table.to(dtype)
            grad_table = torch.zeros_like(table_)
            output_rows = torch.matmul(grad_output_, table_.T)  # dO_i . table[r]: (batch, heads, q_len, rows)
        for rows in _query_chunks(query, key):  # only (batch, heads, chunk, kv_len) weights exist at a time
            weights = _chunk_weights(query_, key_t, bias, ctx.scale, rows)
            grad_value += torch.matmul(weights.transpose(-1, -2), grad_output_[..., rows, :])
            grad_scores = torch.matmul(grad_output_[..., rows, :], value_.transpose(-1, -2))
            if value_rows is not None:  # dP_ij also has dO_i . table[index_ij]; dtable[r] = sum_i m_ir dO_i
                chunk_index, chunk_starts = _chunk_value_rows(value_rows, rows)
                grad_scores += read_rows(output_rows[..., rows, :], chunk_index, chunk_starts)
                per_row = sum_rows(weights, chunk_index, chunk_starts, table.shape[0])
                grad_table += torch.matmul(per_row.flatten(0, -2).T, grad_output_[..., rows, :].flatten(0, -2))
            grad_scores = grad_scores.sub_(row_dot[..., rows, :]).mul_(weights)
            del weights
            grad_query[..., rows, :] = torch.matmul(grad_scores, key_).mul_(ctx.scale)
            grad_key += torch.matmul(grad_scores.transpose(-1, -2), query_[..., rows, :]).mul_(ctx.scale)
            if grad_bias is not None:
                grad_bias[..., rows, :] = _sum_to_shape(grad_scores, bias[..., rows, :].shape)
        grad_table = grad_table.to(table.dtype) if value_rows is not None and ctx.needs_input_grad[5] else None
        grads = grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype), grad_bias, None
        return *grads, grad_table, None, None


def _query_chunks(query: torch.Tensor, key: torch.Tensor) -> list[slice]:
    batch, heads, q_len, kv_len = *query.shape[:-1], key.shape[-2]
    chunk = query_chunk_size(batch, heads, kv_len, query.device)
    return [slice(start, start + chunk) for start in range(0, q_len, chunk)]


def attention_with_learned_bias(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    value_rows: ValueRows | None = None,
) -> torch.Tensor:
    """``softmax(scale q k^T + bias) v`` for ``(batch, heads, q_len, head_dim)`` q, k, v and a float ``bias``
    ``(batch|1, heads|1, q_len, kv_len)`` (``finfo.min`` on masked keys), no dropout, plus with ``value_rows`` the
    value term ``sum_j a_ij table[index_ij]`` (Shaw's ``R^V``). Forward: SDPA's fused kernel, or with a value term
    the weights a chunk of queries at a time (they are needed for it). Backward: recomputed from q, k, v and the bias
    in chunks of queries (module docstring)."""
    if value_rows is None:
        return _AttentionWithLearnedBias.apply(query, key, value, bias, scale, None, None, None)
    table, index, starts = value_rows.table, value_rows.index, value_rows.starts
    return _AttentionWithLearnedBias.apply(query, key, value, bias, scale, table, index, starts)
