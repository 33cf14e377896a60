"""The one attention composition both model families use.

``positional_attention`` takes projected q, k, v and composes, in order: the scheme's q/k/v transform, the KV cache,
the scores with the scheme's position term, the normalizer, and the values. ``choose_backend`` picks what runs it:

* ``eager``: every scheme and normalizer (weights are materialised);
* ``sdpa``: softmax only; a position-only term goes in as a dense float mask;
* ``flex_attention``: softmax only; a position-only term goes in as a ``score_mod`` (nothing materialised). Compiled
  FlexAttention on CPU is inference only, so a CPU forward that needs gradients runs SDPA instead.

A combination a backend cannot express falls back to the next one that can (flex -> sdpa -> eager); every backend
computes the same numbers, so a fallback changes speed, never the result.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.utils import logging

from .attention_normalizers import AttentionNormalizer
from .position_encodings import PositionContext, PositionEncoding, key_positions_for


logger = logging.get_logger(__name__)

FLEX_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def choose_backend(
    requested: str | None,
    encoding: PositionEncoding,
    normalizer: type[AttentionNormalizer],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    need_weights: bool = False,
    attention_dropout: bool = False,
    query_length: int = 2,
) -> str:
    """The backend that runs a forward: ``requested`` if it can express the scheme and normalizer, else the next
    of flex -> sdpa -> eager that can. ``need_weights`` (``output_attentions``) needs eager; FlexAttention has no
    attention dropout, so ``attention_dropout`` (training with a dropout rate > 0) skips it; a one-token decoding
    step (``query_length == 1``) gains nothing from it and would compile once per cache length, so it runs SDPA;
    FlexAttention on CPU takes float32, float16 and bfloat16 only."""
    requested = requested or "sdpa"
    order = ("flex_attention", "sdpa", "eager")
    if requested not in order:
        raise ValueError(f"attn_implementation {requested!r} is not supported by hf_posenc; valid choices: {order}.")
    for backend in order[order.index(requested) :]:
        if backend != "eager" and need_weights:
            continue
        if backend == "flex_attention" and (
            attention_dropout
            or query_length == 1
            or (device.type == "cpu" and (torch.is_grad_enabled() or dtype not in FLEX_CPU_DTYPES))
        ):
            continue
        if backend in encoding.backends and backend in normalizer.backends:
            if backend != requested:
                _log_fallback(requested, backend, encoding.name, normalizer.name)
            return backend
    raise AssertionError("eager runs every scheme and normalizer")


@cache
def _log_fallback(requested: str, backend: str, encoding: str, normalizer: str) -> None:
    logger.info(f"hf_posenc: {encoding} + {normalizer} runs on {backend} (requested {requested}).")


def build_position_context(
    encoding: PositionEncoding, position_ids: torch.Tensor, kv_length: int, backend: str
) -> PositionContext:
    """Compute once per forward what every layer shares: positions and the scheme's tables or score term."""
    context = PositionContext(
        query_positions=position_ids,
        key_positions=key_positions_for(position_ids, kv_length),
        backend=backend,
    )
    encoding.prepare(context)
    return context


def build_attention_mask(
    config,
    backend: str,
    causal: bool,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values=None,
    position_ids: torch.Tensor | None = None,
    allow_skip: bool = False,
):
    """The mask in the form ``backend`` takes, through ``transformers.masking_utils``: a ``BlockMask`` for flex, a
    boolean ``(batch, 1, q_len, kv_len)`` tensor (True = visible) for eager and sdpa, or None when ``allow_skip`` and
    nothing is masked beyond plain causality."""
    mask_format = "flex_attention" if backend == "flex_attention" else "sdpa"
    if config._attn_implementation != mask_format:
        config = copy.copy(config)
        config._attn_implementation_internal = mask_format
    if causal:
        return create_causal_mask(
            config=config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
            allow_is_causal_skip=allow_skip,
        )
    return create_bidirectional_mask(
        config=config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        allow_is_bidirectional_skip=allow_skip,
    )


@cache
def _compiled_flex_attention():
    return torch.compile(flex_attention, dynamic=False)


@dataclass
class DenseMask:
    """What eager and SDPA add to the scores, built once per forward and shared by every layer.

    Attributes:
        additive: ``(batch|1, heads|1, q_len, kv_len)``: the position bias plus ``finfo.min`` on masked keys (so their
            ``e^b`` is exactly 0), or None when there is neither.
        visible: boolean ``(batch|1, 1, q_len, kv_len)`` (True = may attend) for SDPA's boolean path, used only when
            there is no position bias; else None.
        row_has_key: ``(batch|1, 1, q_len, 1)``, False on query rows that see no key: those rows attend everywhere
            (so nothing is NaN) and their weights and output are set to 0. None when every row sees a key.
    """

    additive: torch.Tensor | None
    visible: torch.Tensor | None
    row_has_key: torch.Tensor | None


def build_dense_mask(
    visible: torch.Tensor | None, score_bias: torch.Tensor | None, dtype: torch.dtype, keep_boolean: bool
) -> DenseMask:
    """Fold the boolean mask from :func:`build_attention_mask` and the scheme's position bias into one
    :class:`DenseMask` (``keep_boolean``: keep a boolean mask when there is no bias, as SDPA prefers)."""
    row_has_key = None
    if visible is not None:
        row_has_key = visible.any(dim=-1, keepdim=True)
        if bool(row_has_key.all()):
            row_has_key = None
        else:
            visible = visible | ~row_has_key
    if keep_boolean and score_bias is None:
        return DenseMask(additive=None, visible=visible, row_has_key=row_has_key)
    additive = None if score_bias is None else score_bias.to(dtype)
    if visible is not None:
        floor = torch.finfo(dtype).min
        if additive is None:
            additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        additive = additive.masked_fill(~visible, floor)
    return DenseMask(additive=additive, visible=None, row_has_key=row_has_key)


def _eager(query, key, value, mask: DenseMask, normalizer, scaling, dropout, training):
    compute_dtype = torch.promote_types(query.dtype, torch.float32)  # scores and weights in at least float32
    scores = torch.matmul(query.to(compute_dtype), key.to(compute_dtype).transpose(-1, -2)) * scaling
    if mask.additive is not None:
        scores = scores + mask.additive
    weights = normalizer(scores)
    if mask.row_has_key is not None:
        weights = weights * mask.row_has_key
    weights = nn.functional.dropout(weights.to(value.dtype), p=dropout, training=training)
    return torch.matmul(weights, value), weights


def _sdpa(query, key, value, mask: DenseMask, scaling, dropout, training, causal):
    attn_mask = mask.additive if mask.additive is not None else mask.visible
    output = nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout if training else 0.0,
        scale=scaling,
        is_causal=attn_mask is None and causal and query.shape[-2] > 1,
    )
    if mask.row_has_key is not None:
        output = output * mask.row_has_key
    return output


def positional_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    context: PositionContext,
    encoding: PositionEncoding,
    normalizer: AttentionNormalizer,
    *,
    scaling: float,
    dropout: float,
    training: bool,
    causal: bool,
    past_key_values=None,
    layer_idx: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``(batch, heads, q_len, head_dim)`` q, k, v with the scheme and normalizer composed in.

    ``attention_mask`` is a ``BlockMask`` (or None) for flex, a :class:`DenseMask` otherwise. Returns the output
    ``(batch, q_len, heads, head_dim)`` and the weights ``(batch, heads, q_len, kv_len)`` (eager only, else None).
    """
    query, key, value = encoding.transform_qkv(query, key, value, context)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, layer_idx)
    weights = None
    if context.backend == "flex_attention":
        block_mask = attention_mask if isinstance(attention_mask, BlockMask) else None
        output = _compiled_flex_attention()(
            query, key, value, score_mod=context.score_mod, block_mask=block_mask, scale=scaling
        )
    elif context.backend == "sdpa":
        output = _sdpa(query, key, value, attention_mask, scaling, dropout, training, causal)
    else:
        output, weights = _eager(query, key, value, attention_mask, normalizer, scaling, dropout, training)
    return output.transpose(1, 2).contiguous(), weights
