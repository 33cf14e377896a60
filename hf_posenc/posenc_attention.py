"""The one attention composition both model families use.

``positional_attention`` takes projected q, k, v and composes, in order: the scheme's q/k/v transform, the KV cache,
the scores with the scheme's position terms (the shared bias folded into the mask, the layer's content term), the
normalizer, the values and the layer's value term. ``choose_backend`` picks what runs it:

* ``eager``: every scheme and normalizer (weights are materialised);
* ``sdpa``: softmax only; a position-only term goes in as a dense float mask;
* ``flex_attention``: softmax, and (off CPU) l2 and exp from its log-sum-exp; a position-only term goes in as a
  ``score_mod`` (nothing materialised). Compiled FlexAttention on CPU is inference only and returns no log-sum-exp,
  so a CPU forward that needs gradients runs SDPA instead, and l2 or exp on CPU run eager.

A combination a backend cannot express falls back to the next one that can (flex -> sdpa -> eager); every backend
computes the same numbers, so a fallback changes speed, never the result.
"""

from __future__ import annotations

import copy
from functools import cache, partial
from typing import Any

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.utils import logging

from .attention_normalizers import ATTENTION_NORMALIZERS, AttentionNormalizer
from .learned_bias_attention import attention_with_learned_bias
from .position_encodings import POSITION_ENCODINGS
from .position_interface import AttentionInputs, LayerPositionTerm, PositionEncoding, QueryKeyProjection


logger = logging.get_logger(__name__)

FLEX_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def choose_backend(
    requested: str | None,
    position_encoding: dict[str, Any],
    attention_normalizer: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    need_weights: bool = False,
    attention_dropout: bool = False,
    query_length: int = 2,
    given_mask: torch.Tensor | BlockMask | None = None,
) -> str:
    """The backend that runs a forward: ``requested`` if it can express the scheme and normalizer with their options
    (``position_encoding``, ``attention_normalizer``: full config specs), else the next of flex -> sdpa -> eager that
    can. ``need_weights`` (``output_attentions``) needs eager; FlexAttention has no attention dropout, so
    ``attention_dropout`` (training with a dropout rate > 0) skips it; a one-token decoding step (``query_length ==
    1``) gains nothing from it and would compile once per cache length, so it runs SDPA; FlexAttention on CPU takes
    float32, float16 and bfloat16 only, and no gradients, and does not return the log-sum-exp that normalizers with
    ``flex_needs_lse`` (l2, exp) are computed from. A user's 4-D tensor mask (``given_mask``) runs on eager or
    SDPA; a user's ``BlockMask`` needs FlexAttention."""
    requested = requested or "sdpa"
    order = ("flex_attention", "sdpa", "eager")
    if requested not in order:
        raise ValueError(f"attn_implementation {requested!r} is not supported by hf_posenc; valid choices: {order}.")
    scheme_backends = POSITION_ENCODINGS[position_encoding["type"]].supported_backends(position_encoding)
    normalizer_class = ATTENTION_NORMALIZERS[attention_normalizer["type"]]
    normalizer_backends = normalizer_class.supported_backends(attention_normalizer)
    flex_possible = not (
        attention_dropout
        or query_length == 1
        or (device.type == "cpu" and (torch.is_grad_enabled() or dtype not in FLEX_CPU_DTYPES))
        or (normalizer_class.flex_needs_lse and not flex_returns_lse(device))
        or isinstance(given_mask, torch.Tensor)
        and given_mask.dim() == 4
    )
    if isinstance(given_mask, BlockMask):
        if not (flex_possible and "flex_attention" in scheme_backends and "flex_attention" in normalizer_backends):
            raise ValueError(
                f"A BlockMask attention_mask needs FlexAttention, which cannot run {position_encoding['type']} + "
                f"{attention_normalizer['type']} here (CPU with gradients, dropout, float64 or a one-token step); "
                "pass a 2-D or 4-D tensor mask instead."
            )
        return "flex_attention"
    for backend in order[order.index(requested) :]:
        if backend != "eager" and need_weights:
            continue
        if backend == "flex_attention" and not flex_possible:
            continue
        if backend in scheme_backends and backend in normalizer_backends:
            if backend != requested:
                _log_fallback(requested, backend, position_encoding["type"], attention_normalizer["type"])
            return backend
    raise AssertionError("eager runs every scheme and normalizer")


def flex_returns_lse(device: torch.device) -> bool:
    """Compiled FlexAttention returns the log-sum-exp (``return_aux=AuxRequest(lse=True)``) except on CPU, where
    torch 2.13 raises "torch.compile on CPU only supports inference and `return_lse` is not supported yet"."""
    return device.type != "cpu"


@cache
def _log_fallback(requested: str, backend: str, encoding: str, normalizer: str) -> None:
    logger.info(f"hf_posenc: {encoding} + {normalizer} runs on {backend} (requested {requested}).")


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
    nothing is masked beyond plain causality. A 4-D mask given by the user comes back as it is."""
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


def build_dense_mask(
    mask: torch.Tensor | None, score_bias: torch.Tensor | None, dtype: torch.dtype, keep_boolean: bool
) -> AttentionInputs:
    """Fold the mask from :func:`build_attention_mask` and the scheme's position bias, once per forward, into the
    ``"mask"``, ``"visible"`` and ``"row_has_key"`` entries of :data:`AttentionInputs` for eager and SDPA.

    ``mask`` is boolean (True = visible) or a user's additive float mask (entries below ``finfo.min / 2``, or
    ``-inf``, are masked; the others are added to the scores, as stock Transformers does). The result is an additive
    float mask with ``finfo(dtype).min`` on masked keys, or, when ``keep_boolean`` and there is nothing to add, SDPA's
    boolean mask. Query rows that see no key attend everywhere (so nothing is NaN); the attention zeroes their output.
    """
    if mask is None:
        additive = None if score_bias is None else score_bias.to(dtype)
        return {"mask": additive, "visible": None, "row_has_key": None}
    additive = None if score_bias is None else score_bias.to(dtype)
    if mask.dtype == torch.bool:
        visible = mask
    else:
        visible = mask > torch.finfo(mask.dtype).min / 2
        user_additive = mask.to(dtype).masked_fill(~visible, 0.0)
        additive = user_additive if additive is None else additive + user_additive
    row_has_key = visible.any(dim=-1, keepdim=True)
    attend = visible | ~row_has_key
    if keep_boolean and additive is None:
        return {"mask": attend, "visible": visible, "row_has_key": row_has_key}
    if additive is None:
        additive = torch.zeros(attend.shape, dtype=dtype, device=attend.device)
    additive = additive.masked_fill(~attend, torch.finfo(dtype).min)
    return {"mask": additive, "visible": visible, "row_has_key": row_has_key}


def _eager(query, key, value, attention_inputs, normalizer, score_term, value_term, scaling, dropout, training):
    compute_dtype = torch.promote_types(query.dtype, torch.float32)  # scores and weights in at least float32
    scores = torch.matmul(query.to(compute_dtype), key.to(compute_dtype).transpose(-1, -2)) * scaling
    score_term = score_term(query, key, attention_inputs) if score_term is not None else None
    if score_term is not None:
        scores = scores + score_term
    if attention_inputs["mask"] is not None:
        scores = scores + attention_inputs["mask"]
    weights = normalizer(scores, attention_inputs)
    if attention_inputs["row_has_key"] is not None:
        weights = weights * attention_inputs["row_has_key"]
    weights = nn.functional.dropout(weights.to(value.dtype), p=dropout, training=training)
    output = torch.matmul(weights, value)
    value_term = value_term(weights, attention_inputs) if value_term is not None else None
    if value_term is not None:
        output = output + value_term
    return output, weights


def _differentiate_mask_outside_sdpa(attn_mask, query, dropout, training) -> bool:
    """A float mask that requires grad (a learned position term) on CPU, without dropout: CPU SDPA kernels do not
    differentiate the mask and would fall back to the math path, so :func:`attention_with_learned_bias` runs SDPA's
    fused forward and its own backward (one ``(q_len, kv_len)`` tensor kept per layer instead of about three)."""
    needs_grad = attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled()
    return needs_grad and query.device.type == "cpu" and not (training and dropout > 0)


def _sdpa(query, key, value, attention_inputs, score_term, scaling, dropout, training, causal):
    attn_mask = attention_inputs["mask"]
    score_term = score_term(query, key, attention_inputs) if score_term is not None else None
    if score_term is not None:
        if attn_mask is None:
            attn_mask = score_term.to(query.dtype)
        elif attn_mask.dtype == torch.bool:
            attn_mask = score_term.to(query.dtype).masked_fill(~attn_mask, torch.finfo(query.dtype).min)
        else:
            attn_mask = attn_mask + score_term.to(attn_mask.dtype)
    if _differentiate_mask_outside_sdpa(attn_mask, query, dropout, training):
        output = attention_with_learned_bias(query, key, value, attn_mask, scaling)
    else:
        output = nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout if training else 0.0,
            scale=scaling,
            is_causal=attn_mask is None and causal and query.shape[-2] > 1,
        )
    if attention_inputs["row_has_key"] is not None:
        output = output * attention_inputs["row_has_key"]
    return output


def positional_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_inputs: AttentionInputs,
    encoding: PositionEncoding,
    normalizer: AttentionNormalizer,
    position_term: LayerPositionTerm | None,
    *,
    scaling: float,
    dropout: float,
    training: bool,
    causal: bool,
    past_key_values=None,
    layer_idx: int | None = None,
    project_query_key: QueryKeyProjection | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``(batch, heads, q_len, head_dim)`` q, k, v with the scheme and normalizer composed in (k and v
    may have fewer heads, a divisor of q's: grouped-query attention, as in Llama; the cache keeps them unrepeated).

    ``attention_inputs`` is the per-forward :data:`AttentionInputs`; ``position_term`` the layer's
    :class:`LayerPositionTerm` or None, ``project_query_key`` the layer's q/k projections it may apply to other
    vectors; ``scaling`` is the layer's factor on ``q.k``, times the scheme's ``content_scale``. Returns the output
    ``(batch, q_len, heads, head_dim)`` and the weights ``(batch, heads, q_len, kv_len)`` (eager only, else None).
    """
    scaling = scaling * encoding.content_scale
    score_term = value_term = None
    if position_term is not None:
        score_term = partial(position_term.score_term, scaling=scaling, project_query_key=project_query_key)
        value_term = position_term.value_term
    tables = attention_inputs["position"]
    query, key, value = encoding.transform_qkv(query, key, value, tables)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, layer_idx)
    if key.shape[1] != query.shape[1]:  # grouped-query attention: key/value head h serves query heads h*g .. h*g+g-1
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    weights = None
    backend = attention_inputs["backend"]
    if backend == "flex_attention":
        score_mod = encoding.score_mod(tables, attention_inputs["query_positions"], attention_inputs["key_positions"])
        output = normalizer.flex_output(
            _compiled_flex_attention(), query, key, value, score_mod, attention_inputs["mask"], scaling
        )
    elif backend == "sdpa":
        output = _sdpa(query, key, value, attention_inputs, score_term, scaling, dropout, training, causal)
    else:
        output, weights = _eager(
            query, key, value, attention_inputs, normalizer, score_term, value_term, scaling, dropout, training
        )
    return output.transpose(1, 2).contiguous(), weights
