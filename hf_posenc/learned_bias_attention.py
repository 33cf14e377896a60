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
"""

from __future__ import annotations

import torch
from torch import nn


def _sum_to_shape(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``grad`` summed over the dimensions where ``shape`` has size 1 (a broadcast batch or head dimension)."""
    dims = [dim for dim, size in enumerate(shape) if size == 1 and grad.shape[dim] != 1]
    return grad.sum(dim=dims, keepdim=True) if dims else grad


class _AttentionWithLearnedBias(torch.autograd.Function):
    @staticmethod
    def forward(query, key, value, bias, scale):
        return nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        query, key, value, bias, scale = inputs
        ctx.save_for_backward(query, key, value, bias, output)
        ctx.scale = scale

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, bias, output = ctx.saved_tensors
        dtype = torch.promote_types(query.dtype, torch.float32)
        query_, key_, value_ = query.to(dtype), key.to(dtype), value.to(dtype)
        grad_output_ = grad_output.to(dtype)
        weights = torch.matmul(query_, key_.transpose(-1, -2)).mul_(ctx.scale).add_(bias)  # (batch, heads, q, kv)
        weights = weights.sub_(weights.logsumexp(-1, keepdim=True)).exp_()
        grad_value = torch.matmul(weights.transpose(-1, -2), grad_output_)
        row_dot = (grad_output_ * output.to(dtype)).sum(-1, keepdim=True)  # rowsum(dO O) = sum_j P_ij dP_ij
        grad_scores = torch.matmul(grad_output_, value_.transpose(-1, -2)).sub_(row_dot).mul_(weights)
        del weights
        grad_query = torch.matmul(grad_scores, key_).mul_(ctx.scale)
        grad_key = torch.matmul(grad_scores.transpose(-1, -2), query_).mul_(ctx.scale)
        grad_bias = _sum_to_shape(grad_scores, bias.shape).to(bias.dtype) if ctx.needs_input_grad[3] else None
        return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype), grad_bias, None


def attention_with_learned_bias(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """``softmax(scale q k^T + bias) v`` for ``(batch, heads, q_len, head_dim)`` q, k, v and a float ``bias``
    ``(batch|1, heads|1, q_len, kv_len)`` that requires grad (``finfo.min`` on masked keys), no dropout: SDPA's
    fused forward, the backward recomputed from q, k, v and the bias (module docstring)."""
    return _AttentionWithLearnedBias.apply(query, key, value, bias, scale)
