"""Fused Triton kernels from flash-linear-attention (the optional ``fla-core`` package, ``pip install
'hf_posenc[fla]'``) for the combinations that have one: ``stick_breaking`` (``fla.ops.stickbreaking_attn``,
Tan et al.'s kernel), ``path`` with softmax, with or without its forget gate (``fla.ops.path_attn``, the PaTH
authors' kernel), and ``wall`` with softmax, with or without its scalar gate (``fla.ops.wall_attn``, Tilde
Research's kernel). Each keeps O(n) memory and computes the weights tile by tile, where the library's own path builds
``(batch, heads, q, k)`` tensors in query chunks. And the gated delta rule of the ``gated_deltanet`` linear-attention
layers (:func:`fla_gated_delta_rule`): ``fla.ops.gated_delta_rule``'s chunked kernel for a prefill and its fused
recurrent one for a decoding step, called as Transformers' Qwen3-Next calls them.

Used on CUDA, when ``fla`` and ``triton`` import, for the forwards whose semantics the kernel has: every query sees
exactly the keys at and before it in index order (no padding, no cached keys, positions increasing along the
sequence), no position bias other than the scheme's own, no attention dropout and no logit soft-cap; Wall's kernel
also only where its decays stay within what it represents (:func:`wall_refusal`). Any other forward (and every
forward on another device, traced, or of fake tensors) runs the library's path, which stays the reference; on CUDA
a warning says once per reason why. Checking the mask and the positions reads one boolean from the device per layer
(Wall: one more for its decays, two with gradients at a length not a multiple of 64).
"""

from __future__ import annotations

import importlib
import math
from functools import cache
from types import ModuleType

import torch
from torch._subclasses import FakeTensor
from torch.nn import functional as F
from transformers.utils import logging


logger = logging.get_logger(__name__)

FLA_REQUIREMENT = "fla-core==0.6.0"
FLA_HEAD_DIMS = (16, 32, 64, 128)
"""The head sizes ``fla.ops.path_attn.parallel_path_attn`` takes."""
FLA_DELTA_RULE_MAX_KEY_DIM = 256
"""``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` holds a key head in one tile of at most 256 (its state kernels
assert it, ``fla/ops/common/chunk_delta_h.py``)."""
FLA_WALL_MAX_HEAD_DIM = 256
"""``fla.ops.wall_attn.parallel_wall_attn`` takes any head size up to one tile of 256 (masked to the head)."""
WALL_BLOCK = 64
"""The largest key sub-block of fla's Wall kernel (``BS``, autotuned to 32 or 64; a sub-block starts at a multiple of
its size, so each lies in one block of 64)."""
WALL_CLAMP_NATS = 110 * math.log(2)
"""fla's Wall kernel clamps an in-block key factor ``exp2(R - P_k)`` at ``2^110`` (``R`` the sub-block's first token;
``fla/ops/wall_attn/parallel.py``): a decay of ``110 ln 2`` nats."""
WALL_OVERFLOW_NATS = 127 * math.log(2)
"""The kernel's backward scales the rows past the end of a last, partial sub-block (``P = 0`` there) by
``exp2(0 - R)``: float32 overflows at ``2^128`` and ``0 * inf`` makes every key gradient of the block NaN."""


@cache
def fla_module(name: str) -> ModuleType | None:
    """``fla.ops.<name>``, or None where fla-core (or triton) is not installed."""
    try:
        return importlib.import_module(f"fla.ops.{name}")
    except ImportError:
        return None


def fla_runs_on(device: torch.device) -> bool:
    """Whether fla's kernels are tried on ``device``: CUDA only (they are Triton GPU kernels)."""
    return device.type == "cuda"


@cache
def warn_fla_fallback(combination: str, reason: str) -> None:
    logger.warning(f"hf_posenc: {combination} runs the library's path instead of fla's fused kernel: {reason}.")


def _index_order_refusal(attention_inputs, q_len: int, kv_len: int, own_key: bool, by_position: bool) -> str | None:
    """Why the keys the library gives each query differ from the kernel's (the keys before it in index order, and
    itself with ``own_key``), or None. ``by_position``: the library's keys are also those at an earlier position
    (stick-breaking; PaTH's factors and Wall's decays follow the tokens, not the positions)."""
    if kv_len != q_len:
        return "cached keys (decoding keeps the library's path)"
    mask = attention_inputs["mask"]
    if mask is not None and mask.dtype != torch.bool:
        return "a position bias in the scores"
    query_positions, key_positions = attention_inputs["query_positions"], attention_inputs["key_positions"]
    index = torch.arange(q_len, device=query_positions.device)
    keys = attention_inputs["visible"]
    keys = (index[None, :] <= index[:, None]) if keys is None else keys.reshape(-1, q_len, kv_len)
    if by_position:
        earlier = key_positions[:, None, :] <= query_positions[:, :, None]
        if not own_key:
            earlier = key_positions[:, None, :] < query_positions[:, :, None]
        keys = keys & earlier
    expected = index[None, :] <= index[:, None] if own_key else index[None, :] < index[:, None]
    if not bool((keys == expected).all()):
        return "padding, a custom mask or positions that do not increase along the sequence"
    return None


def wall_block_decays(log_decay: torch.Tensor) -> torch.Tensor:
    """``-sum_(t=s+1..s+63) log g_t`` for each block of :data:`WALL_BLOCK` tokens starting at ``s``: the largest decay
    from a block's first token to a later one in it (``log g <= 0``), ``(batch, blocks, heads, head_dim)``, of every
    token's ``log g`` ``(batch, length, heads, head_dim)``."""
    padded = F.pad(log_decay, (0, 0, 0, 0, 0, -log_decay.shape[1] % WALL_BLOCK))
    return -padded.unflatten(1, (-1, WALL_BLOCK))[:, :, 1:].sum(2)


def wall_refusal(query: torch.Tensor, log_decay: torch.Tensor) -> str | None:
    """Why fla's Wall kernel would give other numbers than the library's path, or None: a key factor past its clamp
    (decays from a sub-block's first token beyond :data:`WALL_CLAMP_NATS`: the pairs in the block lose
    ``exp(decay - 110 ln 2)``); with gradients, float16 (its backward rounds the in-block key factors, up to
    ``2^110``, to the inputs' dtype: float16 overflows past ``2^16``), or a length not a multiple of 64 whose last
    partial sub-block (of 32 or 64) starts after a decay ``-P`` past :data:`WALL_OVERFLOW_NATS` from the first token
    (NaN key gradients)."""
    backward = torch.is_grad_enabled()
    if query.dtype == torch.float16 and backward:
        return "float16 with gradients (the kernel's backward rounds key factors up to 2^110 to float16)"
    if bool((wall_block_decays(log_decay) > WALL_CLAMP_NATS).any()):
        return "decays within 64 tokens past the kernel's clamp of its in-block key factors (2^110)"
    length = log_decay.shape[1]
    if backward and length % WALL_BLOCK:
        last_start = (length - 1) // 32 * 32  # BS = 32's last sub-block, or 64's at a length of 64 n + 32
        if bool((-log_decay[:, : last_start + 1].sum(1) > WALL_OVERFLOW_NATS).any()):
            return (
                "a length not a multiple of 64 after decays past 2^127 (the kernel's backward gives NaN key gradients)"
            )
    return None


def fla_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    values: list[torch.Tensor],
    attention_inputs,
    encoding,
    normalizer,
    position_term,
    scaling: float,
    dropout: float,
    logit_softcapping: float | None,
) -> list[torch.Tensor] | None:
    """The attention outputs ``(batch, heads, q_len, head_dim)``, one per value of ``values`` (the normalizer's
    ``split_values``), by fla's kernel for ``encoding`` + ``normalizer``, or None where the library's path runs:
    off CUDA, a combination with no kernel (silently), or a forward the kernel does not compute (a warning, once per
    reason; see the module). q ``(batch, heads, q_len, head_dim)``, k and v with the same or fewer heads.
    ``dropout``: the attention dropout in effect (0 outside training)."""
    if not fla_runs_on(query.device) or torch.compiler.is_compiling() or isinstance(query, FakeTensor):
        return None  # a fake tensor (a traced or fake-CUDA forward) has no data for a Triton launch
    if normalizer.name == "stick_breaking" and position_term is None:
        kernel, module_name = "stick_breaking", "stickbreaking_attn"
    elif (
        encoding.name in ("path", "wall")
        and normalizer.name == "softmax"
        and normalizer.weights_are_softmax(normalizer.spec)
    ):
        kernel, module_name = encoding.name, f"{encoding.name}_attn"
    else:
        return None
    module = fla_module(module_name)
    own_key = kernel != "stick_breaking" or normalizer.spec["attend_current"]
    if module is None:
        reason = f"fla-core is not installed (pip install {FLA_REQUIREMENT}, or 'hf_posenc[fla]')"
    elif query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        reason = f"{query.dtype} (the kernel computes in float32, float16 or bfloat16)"
    elif dropout > 0:
        reason = "attention dropout"
    elif logit_softcapping is not None:
        reason = "a logit soft-cap"
    elif kernel == "path" and query.shape[-1] not in FLA_HEAD_DIMS:
        reason = f"head_dim {query.shape[-1]} (the kernel takes {', '.join(map(str, FLA_HEAD_DIMS))})"
    elif kernel == "wall" and query.shape[-1] > FLA_WALL_MAX_HEAD_DIM:
        reason = f"head_dim {query.shape[-1]} (the kernel takes at most {FLA_WALL_MAX_HEAD_DIM})"
    else:
        q_len, kv_len = query.shape[-2], key.shape[-2]
        by_position = kernel == "stick_breaking"
        reason = _index_order_refusal(attention_inputs, q_len, kv_len, own_key, by_position=by_position)
        if reason is None and kernel == "wall":
            reason = wall_refusal(query, attention_inputs["layer"]["wall_log_decay"])
    if reason is not None:
        warn_fla_fallback(f"{encoding.name} + {normalizer.name}", reason)
        return None
    query, key = query.transpose(1, 2), key.transpose(1, 2)
    if kernel == "stick_breaking":
        outputs = [
            module.parallel_stickbreaking_attn(
                query, key, value.transpose(1, 2), scale=scaling, attend_current=own_key
            )[0]
            for value in values
        ]
    elif kernel == "wall":
        # s_ij = scale sum_n q_in k_jn exp(P_in - P_jn) + c_i - c_j: fla sums log g and log f itself, and adds the
        # scalar gate's bias unscaled (fla/ops/wall_attn/naive.py)
        tables = attention_inputs["layer"]
        log_decay, log_forget = tables["wall_log_decay"], tables.get("wall_log_forget")
        outputs = [
            module.parallel_wall_attn(query, key, value.transpose(1, 2), log_decay, g_scalar=log_forget, scale=scaling)
            for value in values
        ]
    else:
        tables = attention_inputs["layer"]
        directions = tables["path_directions"].transpose(1, 2)
        strengths = tables["path_strengths"].transpose(1, 2)
        # fla scales the forget gate's bias with the scores, (q^T H k + g_i - g_j) * scale: log f / scale here
        log_forget = tables.get("path_log_forget")
        gates = None if log_forget is None else (log_forget / scaling).transpose(1, 2).contiguous()
        outputs = [
            module.parallel_path_attn(query, key, value.transpose(1, 2), directions, strengths, gates, scale=scaling)[
                0
            ]
            for value in values
        ]
    return [output.transpose(1, 2) for output in outputs]


def fla_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    step: bool,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The gated delta rule by fla's kernels, with the inputs and returns of ``linear_attention``'s torch rules (q, k
    ``(batch, seq, key_heads, key_head_dim)``, v ``(batch, seq, value_heads, value_head_dim)``, g and beta ``(batch,
    seq, value_heads)``, the state ``(batch, value_heads, key_head_dim, value_head_dim)``): ``step`` (a one-token
    decoding step from a state) by ``fused_recurrent_gated_delta_rule``, anything else by ``chunk_gated_delta_rule``,
    each called as Transformers' Qwen3-Next calls it (q and k l2-normalised in the kernel, the scale
    ``1 / sqrt(key_head_dim)``, the initial state from the cache, the final state returned where asked; no
    ``cu_seqlens``). None where the library's torch rule runs: off CUDA, traced or of fake tensors (silently), or an
    input the kernel does not take (a warning, once per reason). Padding needs no refusal: the layer zeroes padding
    tokens before its projections, so both paths see the same inputs."""
    if not fla_runs_on(query.device) or torch.compiler.is_compiling() or isinstance(query, FakeTensor):
        return None  # a fake tensor (a traced or fake-CUDA forward) has no data for a Triton launch
    module = fla_module("gated_delta_rule")
    backward = torch.is_grad_enabled() and any(
        tensor is not None and tensor.requires_grad for tensor in (query, key, value, g, beta, initial_state)
    )
    k_dim, v_dim = key.shape[-1], value.shape[-1]
    if module is None:
        reason = f"fla-core is not installed (pip install {FLA_REQUIREMENT}, or 'hf_posenc[fla]')"
    elif query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        reason = f"{query.dtype} (the kernel computes in float32, float16 or bfloat16)"
    elif step and backward:
        reason = "gradients through a decoding step (fla's fused recurrent kernel has no backward)"
    elif not step and k_dim > FLA_DELTA_RULE_MAX_KEY_DIM:
        reason = f"key_head_dim {k_dim} (the kernel takes at most {FLA_DELTA_RULE_MAX_KEY_DIM})"
    elif not step and backward and query.dtype != torch.float32 and (k_dim % 2 or v_dim % 2):
        reason = (
            f"{query.dtype} with gradients and an odd head size (key {k_dim}, value {v_dim}; fla's backward "
            "takes even ones in 16 bits)"
        )
    else:
        reason = None
    if reason is not None:
        warn_fla_fallback("gated_deltanet " + ("decoding step" if step else "chunked rule"), reason)
        return None
    kernel = module.fused_recurrent_gated_delta_rule if step else module.chunk_gated_delta_rule
    return kernel(
        query,
        key,
        value,
        g=g,
        beta=beta,
        scale=k_dim**-0.5,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=True,
    )
