"""Fused Triton kernels from flash-linear-attention (the optional ``fla-core`` package, ``pip install
'hf_posenc[fla]'``) for the combinations that have one: ``stick_breaking`` (``fla.ops.stickbreaking_attn``,
Tan et al.'s kernel) and ``path`` with softmax, with or without its forget gate (``fla.ops.path_attn``, the PaTH
authors' kernel). Each keeps O(n) memory and computes the weights tile by tile, where the library's own path builds
``(batch, heads, q, k)`` tensors in query chunks.

Used on CUDA, when ``fla`` and ``triton`` import, for the forwards whose semantics the kernel has: every query sees
exactly the keys at and before it in index order (no padding, no cached keys, positions increasing along the
sequence), no position bias other than the scheme's own, no attention dropout and no logit soft-cap. Any other
forward (and every forward on another device, traced, or of fake tensors) runs the library's path, which stays
the reference; on CUDA a warning says once per reason why. Checking the mask and the positions reads one boolean
from the device per layer.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType

import torch
from torch._subclasses import FakeTensor
from transformers.utils import logging


logger = logging.get_logger(__name__)

FLA_REQUIREMENT = "fla-core==0.6.0"
FLA_HEAD_DIMS = (16, 32, 64, 128)
"""The head sizes ``fla.ops.path_attn.parallel_path_attn`` takes."""


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
    (stick-breaking; PaTH's factors follow the tokens, not the positions)."""
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
    elif encoding.name == "path" and normalizer.name == "softmax" and normalizer.weights_are_softmax(normalizer.spec):
        kernel, module_name = "path", "path_attn"
    else:
        return None
    module = fla_module(module_name)
    own_key = kernel == "path" or normalizer.spec["attend_current"]
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
    else:
        q_len, kv_len = query.shape[-2], key.shape[-2]
        reason = _index_order_refusal(attention_inputs, q_len, kv_len, own_key, by_position=kernel != "path")
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
