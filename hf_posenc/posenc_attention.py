"""The one attention composition both model families use.

``positional_attention`` takes projected q, k, v and composes, in order: the scheme's q/k/v transform, the KV cache,
the scores with the scheme's position terms (the shared bias folded into the mask, the layer's content term), the
normalizer, the values and the layer's value term. ``choose_backend`` picks what runs it:

* ``eager``: every scheme and normalizer (weights are materialised);
* ``sdpa``: softmax, and the normalizers that are a softmax of transformed scores (ssmax, softmax's sink) through
  their ``sdpa_arguments``; a position-only term goes in as a dense float mask; a normalizer no kernel computes
  (``sdpa_in_query_chunks``: stick_breaking) runs here as the eager composition a checkpointed chunk of queries
  at a time;
* ``flex_attention``: softmax, and (off CPU) the others from its log-sum-exp; a position-only term
  goes in as a ``score_mod`` (nothing materialised). Compiled FlexAttention on CPU is inference only, returns no
  log-sum-exp and is wrong for heads narrower than 24, so there a forward that needs gradients or has such heads
  runs SDPA instead, and the other normalizers run eager.

A combination a backend cannot express falls back to the next one that can (flex -> sdpa -> eager), with its reason
logged; on CUDA a request for SDPA (the default) runs FlexAttention where that is the faster exact path. Every
backend computes the same numbers, so the choice changes speed, never the result. FlexAttention is compiled by
``flex_attend``, which owns the compile cache (one region per grad mode, combination and pass).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch
from torch import nn
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers.masking_utils import (
    LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING,
    create_bidirectional_mask,
    create_bidirectional_sliding_window_mask,
)
from transformers.utils import logging

from .attention_normalizers import (
    ATTENTION_NORMALIZERS,
    AttentionNormalizer,
    additive_mask,
    flex_pass,
    implicit_visible,
)
from .fla_kernels import fla_attention
from .learned_bias_attention import attention_with_learned_bias
from .position_encodings import POSITION_ENCODINGS
from .position_interface import (
    CACHE_NAME,
    AttentionInputs,
    LayerPositionTerm,
    PositionCache,
    PositionEncoding,
    QueryKeyProjection,
    ValueRows,
    flex_compiles_length_sized_tables,
)
from .relative_tables import band_dot_products, in_query_chunks, sum_rows


logger = logging.get_logger(__name__)

FLEX_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLEX_CPU_MIN_HEAD_DIM = 24
"""Compiled FlexAttention on CPU (torch 2.13) is wrong below this head_dim. Inductor's CPU kernel computes q.k^T per
block of keys with a micro-GEMM whose first variant, taken when ``head_dim < 24`` and ``head_dim`` and the key count
of a block are multiples of the CPU's float vector width, always reads and writes 16 keys: with 8 keys left (a key
count of 8 mod 16, on AVX2) it reads past the keys and overwrites the running row maximum, so head_dim 8 or 16 give
errors up to 1.4 or NaN (measured: head_dim 8, 16 with 8, 24, 40, 136 keys; head_dim 4, 12, 20, 24, 32 and 16, 32
keys are right). The width and the key count change per machine and per forward, so the bound is on head_dim."""

FLEX_CUDA_MIN_HEAD_DIM = 16
"""Triton's FlexAttention lowering (torch >= 2.5, ``torch/_inductor/kernel/flex/flex_attention.py``) raises
``NotImplementedError`` for a query, key or value head size below 16 (``tl.dot`` needs 16): on CUDA such heads run
SDPA or eager."""

FLEX_CUDA_KERNEL_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1}
"""FlexAttention's kernel options on CUDA when the position tables need gradients (measured on an H100, B 8, H 12,
n 2048, head_dim 64, a per-distance table, forward + backward: 25 ms with torch's defaults, 4.25 ms with these; with
the defaults a float32 table that needs gradients does not compile, "out of resource: shared memory"). ``BLOCK_M``
and ``BLOCK_N`` set the forward's tiles, ``num_stages`` both passes' pipelining (the backward keeps its default
tiles)."""


def flex_refusal(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None,
    needs_lse: bool,
    attention_dropout: bool,
    query_length: int,
    given_mask: torch.Tensor | BlockMask | None,
    compiles_on_cpu: bool = True,
) -> str | None:
    """Why FlexAttention cannot run this forward, or None if it can. The rules, in order: no attention dropout; a
    one-token decoding step gains nothing from it and would compile once per cache length; a user's 4-D tensor mask
    runs on eager or SDPA; on CUDA, Triton's lowering refuses heads narrower than :data:`FLEX_CUDA_MIN_HEAD_DIM`;
    compiled FlexAttention on CPU (torch 2.13) has no backward, takes float32, float16 and bfloat16 only, is wrong for
    ``head_dim`` below :data:`FLEX_CPU_MIN_HEAD_DIM`, cannot recompile some schemes' ``score_mod``
    (``compiles_on_cpu``: the scheme's ``flex_compiles_on_cpu``, see :func:`flex_compiles_length_sized_tables`), and
    returns no log-sum-exp, which normalizers with ``flex_needs_lse`` are computed from (``needs_lse``). ``head_dim``
    None: not known to the caller (the models always pass it)."""
    if attention_dropout:
        return "FlexAttention has no attention dropout"
    if query_length == 1:
        return "a one-token decoding step runs SDPA (FlexAttention would compile once per cache length)"
    if isinstance(given_mask, torch.Tensor) and given_mask.dim() == 4:
        return "a 4-D tensor attention_mask runs on eager or SDPA"
    if device.type == "cuda" and head_dim is not None and head_dim < FLEX_CUDA_MIN_HEAD_DIM:
        return f"Triton's FlexAttention kernels need head_dim >= {FLEX_CUDA_MIN_HEAD_DIM}, not {head_dim}"
    if device.type == "cpu":
        if torch.is_grad_enabled():
            return "compiled FlexAttention on CPU has no backward (torch 2.13); use torch.no_grad() for it"
        if dtype not in FLEX_CPU_DTYPES:
            return f"compiled FlexAttention on CPU takes float32, float16 and bfloat16, not {dtype}"
        if head_dim is not None and head_dim < FLEX_CPU_MIN_HEAD_DIM:
            return (
                f"compiled FlexAttention on CPU computes wrong numbers for head_dim {head_dim} < "
                f"{FLEX_CPU_MIN_HEAD_DIM} (torch 2.13)"
            )
    if not compiles_on_cpu and not flex_compiles_length_sized_tables(device):
        return (
            "compiled FlexAttention on CPU (torch 2.13) emits C++ that does not compile for this scheme's "
            "score_mod once a second length makes the shapes dynamic"
        )
    if needs_lse and not flex_returns_lse(device):
        return "compiled FlexAttention on CPU returns no log-sum-exp, which this normalizer is computed from"
    return None


def backend_candidates(
    requested: str, device: torch.device, sdpa_runs_normalizer: bool, position_bias_needs_grad: bool
) -> tuple[str, ...]:
    """The backends to try for a forward, in order; the first that can run the combination runs it.
    ``sdpa_runs_normalizer``: SDPA computes the normalizer and the scores it is given (not with a logit soft-cap).

    | request | device | combination | order |
    |---|---|---|---|
    | ``eager`` | any | any | eager |
    | ``flex_attention`` | any | any | flex, sdpa, eager |
    | ``sdpa`` (default) | CUDA | a normalizer SDPA cannot compute (l2, exp, relu2, ...); a soft-cap | flex, eager |
    | ``sdpa`` (default) | CUDA | a position-only bias that needs gradients (t5, kerple, tupe) | flex, sdpa, eager |
    | ``sdpa`` (default) | otherwise | any | sdpa, eager |

    Measured on an H100 (fwd + bwd of BERT-base width, 8 x 2048 tokens): l2 and exp run 1.4-1.7x stock on
    flex against 3.3-7.2x on eager; a learnable bias's gradient is summed into its table by the ``score_mod``'s
    backward instead of through a dense bias (where the table spreads the gradients: :func:`flex_gradient_refusal`);
    a fixed bias (ALiBi) stays on SDPA (40.1 ms against flex's 43.2 ms).
    """
    if requested == "eager":
        return ("eager",)
    if requested == "flex_attention":
        return ("flex_attention", "sdpa", "eager")
    if device.type == "cuda" and not sdpa_runs_normalizer:
        return ("flex_attention", "eager")
    if device.type == "cuda" and position_bias_needs_grad:
        return ("flex_attention", "sdpa", "eager")
    return ("sdpa", "eager")


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
    head_dim: int | None = None,
    position_bias_needs_grad: bool = False,
    consecutive: bool = False,
    gradient_refusal: str | None = None,
    logit_softcapping: float | None = None,
) -> str:
    """The backend that runs a forward: the first of :func:`backend_candidates` (from ``requested``, default SDPA)
    that can express the scheme and normalizer with their options (``position_encoding``, ``attention_normalizer``:
    full config specs) and that :func:`flex_refusal` and, for a scheme with a value term,
    :func:`value_term_flex_refusal` do not rule out. ``need_weights`` (``output_attentions``) needs eager;
    ``attention_dropout`` is training with a dropout rate > 0; ``position_bias_needs_grad`` is
    :func:`position_bias_needs_grad` of the scheme; ``consecutive``: the model's default positions with no cached
    key; ``gradient_refusal``: :func:`flex_gradient_refusal` of the scheme; ``logit_softcapping``: the config's
    ``attn_logit_softcapping`` (SDPA's kernel takes no function of its scores: eager, FlexAttention's ``score_mod``
    and the chunked eager composition of ``sdpa_in_query_chunks`` normalizers cap them). A user's ``BlockMask``
    needs FlexAttention. A request that cannot be honoured is logged with its reason."""
    requested = requested or "sdpa"
    if requested not in BACKEND_REQUESTS:
        raise ValueError(
            f"attn_implementation {requested!r} is not supported by hf_posenc; valid choices: {BACKEND_REQUESTS}."
        )
    scheme_class = POSITION_ENCODINGS[position_encoding["type"]]
    scheme_backends = scheme_class.supported_backends(position_encoding)
    normalizer_class = ATTENTION_NORMALIZERS[attention_normalizer["type"]]
    normalizer_backends = normalizer_class.supported_backends(attention_normalizer)
    value_term = scheme_class.has_value_term(position_encoding)
    softmax_weights = normalizer_class.weights_are_softmax(attention_normalizer)
    flex_listed = "flex_attention" in set(scheme_backends) & set(normalizer_backends)
    refusal_for = partial(
        flex_refusal,
        device,
        dtype,
        head_dim,
        normalizer_class.needs_lse_on_flex(attention_normalizer) or value_term,
        query_length=query_length,
        given_mask=given_mask,
        compiles_on_cpu=scheme_class.flex_compiles_on_cpu,
    )
    refusal = refusal_for(attention_dropout=attention_dropout) or gradient_refusal
    # on CUDA, attention dropout alone keeping a combination off FlexAttention is worth a WARNING (the stock default)
    dropout_keeps_off_flex = (
        attention_dropout and device.type == "cuda" and flex_listed and refusal_for(attention_dropout=False) is None
    )
    if refusal is None and value_term and flex_listed:
        refusal = value_term_flex_refusal(consecutive, softmax_weights)
    if isinstance(given_mask, BlockMask):
        if refusal is not None or not flex_listed:
            raise ValueError(
                f"A BlockMask attention_mask needs FlexAttention, which cannot run {position_encoding['type']} + "
                f"{attention_normalizer['type']} here ({refusal or 'not supported by the combination'}); pass a 2-D "
                "or 4-D tensor mask instead."
            )
        return "flex_attention"
    sdpa_caps = logit_softcapping is None or normalizer_class.sdpa_in_query_chunks
    sdpa_computes = "sdpa" in normalizer_backends and sdpa_caps
    candidates = backend_candidates(requested, device, sdpa_computes, position_bias_needs_grad)
    for backend in candidates:
        if backend != "eager" and need_weights:
            continue
        if backend not in scheme_backends or backend not in normalizer_backends:
            continue
        if backend == "sdpa" and not sdpa_caps:
            if not torch.compiler.is_compiling():
                _log_softcapping_off_sdpa(requested)
            continue
        if backend == "sdpa" and value_term and not softmax_weights:  # the value term reads softmax's weights
            continue
        if backend == "sdpa" and attention_dropout and value_term:
            if not torch.compiler.is_compiling():
                _log_value_term_dropout(position_encoding["type"])
            continue
        if backend == "sdpa" and attention_dropout and normalizer_class.value_parts > 1:
            continue  # one SDPA call per part would draw a dropout mask per part; eager shares one
        if backend == "flex_attention" and refusal is not None:
            if requested == "flex_attention" and not torch.compiler.is_compiling():
                _log_flex_refusal(position_encoding["type"], attention_normalizer["type"], refusal)
            continue
        if torch.compiler.is_compiling():  # dynamo cannot trace a logger call
            return backend
        if backend != requested:
            _log_fallback(requested, backend, position_encoding["type"], attention_normalizer["type"])
        if dropout_keeps_off_flex and "flex_attention" in candidates:
            _warn_attention_dropout(position_encoding["type"], attention_normalizer["type"], backend)
        return backend
    raise AssertionError("eager runs every scheme and normalizer")


BACKEND_REQUESTS = ("flex_attention", "sdpa", "eager")


def value_term_flex_refusal(consecutive: bool, softmax: bool) -> str | None:
    """Why FlexAttention cannot compute a layer's value term (:class:`ValueRows`) in this forward, or None. It reads
    the weights of the keys inside the clip from a band of scores and the log-sum-exp
    (:func:`clipped_value_rows_term`), so the keys must be at the model's default, consecutive positions with no
    cached key (``consecutive``) and the weights softmax's (``softmax``:
    ``AttentionNormalizer.weights_are_softmax``)."""
    if not consecutive:
        return (
            "the value term on FlexAttention needs the model's default positions and no cached key (given "
            "position_ids or cached keys run SDPA)"
        )
    if not softmax:
        return "the value term on FlexAttention is computed from softmax weights"
    return None


def position_bias_needs_grad(encoding: PositionEncoding) -> bool:
    """Whether this forward differentiates a position-only score bias: the scheme gives a ``score_mod`` and has
    parameters that require gradients, and gradients are enabled (T5's table, KERPLE's r1 and r2, FIRE's MLP, in
    training; ALiBi's fixed slopes never)."""
    return (
        torch.is_grad_enabled()
        and type(encoding).score_mod is not PositionEncoding.score_mod
        and any(parameter.requires_grad for parameter in encoding.parameters())
    )


def flex_gradient_refusal(encoding: PositionEncoding, consecutive: bool) -> str | None:
    """Why FlexAttention should not train this scheme's ``score_mod`` in this forward, or None: its parameters take
    gradients and it reads some of them at a few addresses only (:meth:`PositionEncoding.flex_spreads_gradients`),
    where the kernel's backward would add one gradient per score onto the same address."""
    if position_bias_needs_grad(encoding) and not encoding.flex_spreads_gradients(consecutive):
        return (
            "training its score_mod with these positions would add one gradient per score onto a few addresses "
            "(parameters read per head, not per distance or token); SDPA with a dense bias trains it"
        )
    return None


def flex_returns_lse(device: torch.device) -> bool:
    """Compiled FlexAttention returns the log-sum-exp (``return_aux=AuxRequest(lse=True)``) except on CPU, where
    torch 2.13 raises "torch.compile on CPU only supports inference and `return_lse` is not supported yet"."""
    return device.type != "cpu"


@cache
def _log_flex_refusal(encoding: str, normalizer: str, reason: str) -> None:
    logger.warning(f"hf_posenc: {encoding} + {normalizer} does not run on the requested flex_attention: {reason}.")


@cache
def _warn_attention_dropout(encoding: str, normalizer: str, backend: str) -> None:
    logger.warning(
        f"hf_posenc: {encoding} + {normalizer} trains on {backend} instead of FlexAttention, which has no attention "
        "dropout: slower, and it keeps (batch, heads, q, k) tensors per layer. Set attention_probs_dropout_prob=0 "
        "(BERT) or attn_pdrop=0 (GPT-2), as current pretraining recipes do, to train on FlexAttention."
    )


@cache
def _log_value_term_dropout(encoding: str) -> None:
    logger.info(
        f"hf_posenc: {encoding}'s value term reads the attention weights, which SDPA recomputes without its attention "
        "dropout: training with attention dropout runs eager."
    )


@cache
def _log_softcapping_off_sdpa(requested: str) -> None:
    logger.info(
        f"hf_posenc: attn_logit_softcapping caps the scores before the normalizer; SDPA's kernel computes its scores "
        f"inside and cannot cap them, so the attention runs on another backend (requested {requested})."
    )


@cache
def _log_fallback(requested: str, backend: str, encoding: str, normalizer: str) -> None:
    logger.info(f"hf_posenc: {encoding} + {normalizer} runs on {backend} (requested {requested}).")


BIDIRECTIONAL_MASK_FUNCTIONS = {
    "full_attention": create_bidirectional_mask,
    "sliding_attention": create_bidirectional_sliding_window_mask,
}
"""An encoder layer type's mask maker (``masking_utils``); a decoder's is Transformers' own
``LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING`` (full, sliding, chunked). Transformers has no bidirectional chunked mask,
so an encoder config refuses ``chunked_attention`` layers."""


def build_attention_mask(
    config,
    backend: str,
    causal: bool,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache=None,
    position_ids: torch.Tensor | None = None,
    allow_skip: bool = False,
    layer_type: str = "full_attention",
    layer_idx: int | None = None,
):
    """The mask in the form ``backend`` takes, through ``transformers.masking_utils``: a ``BlockMask`` for flex, a
    boolean ``(batch, 1, q_len, kv_len)`` tensor (True = visible) for eager and sdpa, or None when ``allow_skip`` and
    nothing is masked beyond plain causality. ``layer_type`` picks the mask maker as Transformers' models do
    (``LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING``): ``sliding_attention`` the ``config.sliding_window`` tokens up to
    the query (both directions in an encoder), ``chunked_attention`` the earlier keys of the query's chunk of
    ``config.attention_chunk_size`` tokens; with a cache the mask is sized as cache layer ``layer_idx`` (a layer of
    that type; None: Transformers' default) keeps its keys. A 4-D mask given by the user comes back as it is."""
    mask_format = "flex_attention" if backend == "flex_attention" else "sdpa"
    if config._attn_implementation != mask_format:
        config = copy.copy(config)
        config._attn_implementation_internal = mask_format
    if causal:
        sized_as = {} if layer_idx is None else {"layer_idx": layer_idx}
        return LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING[layer_type](
            config=config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{CACHE_NAME: cache},
            **sized_as,
            allow_is_causal_skip=allow_skip,
        )
    if layer_type not in BIDIRECTIONAL_MASK_FUNCTIONS:
        raise ValueError(f"An encoder has no {layer_type!r} layers; valid: {sorted(BIDIRECTIONAL_MASK_FUNCTIONS)}.")
    return BIDIRECTIONAL_MASK_FUNCTIONS[layer_type](
        config=config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        allow_is_bidirectional_skip=allow_skip,
    )


@cache
def _compiled_flex_attention(grad_enabled: bool, region: str, dynamic: bool) -> Callable:
    """One compiled FlexAttention per grad mode, ``region`` (a combination and a pass of its normalizer) and
    ``dynamic``, each with its own recompile budget (``isolate_recompiles``), so that train/eval switches, several
    combinations in one process and the passes of a normalizer never share torch's recompile limit.
    ``fullgraph=True`` makes hitting the limit raise rather than silently run uncompiled (see :func:`flex_attend`).
    ``grad_enabled`` only keys the cache. ``dynamic`` is set explicitly either way: dynamo keeps its automatic
    dynamic-shape state per code object (``torch/_dynamo/pgo.py``), not per region, so with ``dynamic=None`` a region
    compiled after another had seen two lengths would start with symbolic sizes."""
    return torch.compile(flex_attention, fullgraph=True, isolate_recompiles=True, dynamic=None if dynamic else False)


_FIRST_SHAPES: dict[tuple[bool, str], tuple] = {}
"""The shapes of each (grad mode, region)'s first call: those calls run its static kernel."""


def clear_flex_compile_cache() -> None:
    """Forget every compiled region and its first shapes (tests; a benchmark's fresh-process rows)."""
    _compiled_flex_attention.cache_clear()
    _FIRST_SHAPES.clear()


def _call_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any]) -> tuple:
    block_mask = kwargs.get("block_mask")
    mask_shape = None if block_mask is None else tuple(block_mask.shape)
    return query.shape, key.shape, value.shape, mask_shape


def flex_attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, region: str, pass_name: str = "", **kwargs
):
    """FlexAttention through the compile cache: ``flex_attention(query, key, value, **kwargs)`` compiled per grad
    mode and ``region``/``pass_name``. A region's first shapes run a static kernel (fixed-length training keeps the
    fastest kernel, whatever other regions saw); any other shapes (a second length or batch size) run one kernel
    compiled with symbolic sizes, which every later length reuses. Inside a ``torch.compile``d model the plain
    function is called and the outer compile fuses it. Should a region still hit torch's recompile limit (shapes
    other than the lengths and batch size changing every call), the call runs FlexAttention's unfused path, which
    materialises every score, and a warning says so: no silent slow path."""
    if torch.compiler.is_compiling():
        return flex_attention(query, key, value, **kwargs)
    name = f"{region}/{pass_name}" if pass_name else region
    grad_enabled = torch.is_grad_enabled()
    shapes = _call_shapes(query, key, value, kwargs)
    dynamic = _FIRST_SHAPES.setdefault((grad_enabled, name), shapes) != shapes
    try:
        return _compiled_flex_attention(grad_enabled, name, dynamic)(query, key, value, **kwargs)
    except FailOnRecompileLimitHit:
        _warn_unfused_flex(name, grad_enabled)
        return flex_attention(query, key, value, **kwargs)


@cache
def _warn_unfused_flex(region: str, grad_enabled: bool) -> None:
    logger.warning(
        f"hf_posenc: compiled FlexAttention for {region} ({'training' if grad_enabled else 'inference'}) hit torch's "
        f"recompile limit (torch._dynamo.config.recompile_limit = {torch._dynamo.config.recompile_limit}, "
        f"accumulated_recompile_limit = {torch._dynamo.config.accumulated_recompile_limit}); calls "
        "that need a new compilation now run FlexAttention's unfused path, which materialises every score (slow, "
        "O(n^2) memory). TORCH_LOGS=recompiles shows what changed between calls."
    )


def flex_kernel_options(
    device: torch.device, encoding: PositionEncoding, position_term: LayerPositionTerm | None = None
) -> dict[str, Any]:
    """``kernel_options`` for FlexAttention: :data:`FLEX_CUDA_KERNEL_OPTIONS` on CUDA when the tables a ``score_mod``
    reads need gradients (the measured case: the scheme's position-only bias in training, or a layer's content-term
    row tables, built from q and k, whenever gradients are on), torch's defaults otherwise."""
    layer_tables_need_grad = (
        position_term is not None
        and type(position_term).score_mod is not LayerPositionTerm.score_mod
        and torch.is_grad_enabled()
    )
    if device.type == "cuda" and (position_bias_needs_grad(encoding) or layer_tables_need_grad):
        return {"kernel_options": FLEX_CUDA_KERNEL_OPTIONS}
    return {}


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
    if mask.shape[0] > 1 and mask.stride(0) == 0:  # a mask broadcast over the batch stays one row: (1, ...) results
        mask = mask[:1]
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


def value_rows_term(weights: torch.Tensor, value_rows: ValueRows) -> torch.Tensor:
    """``sum_j a_ij table[index_ij] = sum_r (sum_{j: index_ij = r} a_ij) table[r]``: ``(batch, heads, q_len,
    head_dim)``, the weights summed per row first (by runs on consecutive positions, else scattered; no ``(q_len,
    kv_len, head_dim)`` tensor)."""
    table = value_rows.table
    per_row = sum_rows(weights, value_rows.index, value_rows.starts, table.shape[0])
    return torch.matmul(per_row, table.to(per_row.dtype))


def _on_pairs(function: Callable, batch: int, heads: int, q_idx: torch.Tensor, kv_idx: torch.Tensor, *score):
    """A FlexAttention ``mask_mod`` (no ``score``) or ``score_mod`` (``score``: ``(batch, heads, pairs)``) evaluated at
    the pairs ``(q_idx[p], kv_idx[p])`` of every batch row and head, vectorised with ``vmap`` as FlexAttention's own
    unfused path does: ``(batch, heads, pairs)``."""
    over_pairs = (0,) * len(score) + (None, None, 0, 0)
    over_heads = (0,) * len(score) + (None, 0, None, None)
    over_batch = (0,) * len(score) + (0, None, None, None)
    vectorised = torch.vmap(torch.vmap(torch.vmap(function, over_pairs), over_heads), over_batch)
    batch_idx = torch.arange(batch, device=q_idx.device)
    head_idx = torch.arange(heads, device=q_idx.device)
    return vectorised(*score, batch_idx, head_idx, q_idx, kv_idx)


def band_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    score_mod: Callable | None,
    block_mask: BlockMask | None,
    scale: float,
    reach: int,
) -> torch.Tensor:
    """FlexAttention's scores ``s_ij = score_mod(scale q_i . k_j)`` of the pairs ``j = i + d``, ``|d| <= reach``
    (queries and keys of one length): ``(batch, heads, n, 2 reach + 1)``, column ``d + reach``, ``-inf`` where the
    mask hides the key or ``i + d`` is outside the sequence. ``O(n reach)`` scores, in at least float32."""
    batch, heads, n, _ = query.shape
    scores = band_dot_products(query, key, reach) * scale
    q_idx = torch.arange(n, device=query.device)[:, None].expand(n, 2 * reach + 1)
    kv_idx = q_idx + torch.arange(-reach, reach + 1, device=query.device)
    inside = (kv_idx >= 0) & (kv_idx < n)
    pairs = (q_idx.flatten(), kv_idx.clamp(0, n - 1).flatten())
    if score_mod is not None:
        scores = _on_pairs(score_mod, batch, heads, *pairs, scores.flatten(-2)).view_as(scores)
    visible = inside
    if block_mask is not None:
        visible = visible & _on_pairs(block_mask.mask_mod, batch, heads, *pairs).view(batch, heads, n, -1)
    return scores.masked_fill(~visible, float("-inf"))


def _block_lists(num_blocks: torch.Tensor, indices: torch.Tensor, columns: int) -> torch.Tensor:
    """A BlockMask's ordered block lists (``(..., rows)`` counts, ``(..., rows, columns)`` indices) as a dense
    ``(..., rows, columns)`` boolean."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
    dense = torch.zeros(*indices.shape[:-1], columns + 1, dtype=torch.bool, device=indices.device)
    return dense.scatter_(-1, torch.where(listed, indices.long(), columns), True)[..., :columns]


def _ordered_blocks(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense ``(..., rows, columns)`` boolean as BlockMask's ordered lists: counts and indices (listed first)."""
    order = torch.argsort(dense.to(torch.int32), dim=-1, descending=True, stable=True)
    return dense.sum(-1, dtype=torch.int32), order.to(torch.int32)


def left_tail_block_mask(block_mask: BlockMask | None, length: int, reach: int, device: torch.device) -> BlockMask:
    """``block_mask`` (None: every key of ``length``) without its tiles that hold no pair ``j <= i - reach``: a
    tile of queries ``a .. a'`` and keys ``c .. c'`` is kept when ``c <= min(a', length - 1) - reach``. Only whole
    tiles go (the kept ones keep their mask_mod and, full or partial, their kind), so the scores the kernel computes
    are the same: the encoder's left-tail pass of Shaw's value term visits about half the tiles."""
    if block_mask is None:
        q_block = kv_block = 128
        blocks = -(-length // 128)
        full = torch.ones(1, 1, blocks, blocks, dtype=torch.bool, device=device)
        partial, mask_mod = torch.zeros_like(full), None
    else:
        q_block, kv_block = block_mask.BLOCK_SIZE
        blocks = block_mask.kv_indices.shape[-1]
        partial = _block_lists(block_mask.kv_num_blocks, block_mask.kv_indices, blocks)
        full = torch.zeros_like(partial)
        if block_mask.full_kv_num_blocks is not None:
            full = _block_lists(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, blocks)
        mask_mod = block_mask.mask_mod
    last_query = ((torch.arange(partial.shape[-2], device=device) + 1) * q_block - 1).clamp(max=length - 1)
    first_key = torch.arange(partial.shape[-1], device=device) * kv_block
    holds_tail = first_key[None, :] <= last_query[:, None] - reach
    return BlockMask.from_kv_blocks(
        *_ordered_blocks(partial & holds_tail),
        *_ordered_blocks(full & holds_tail),
        BLOCK_SIZE=(q_block, kv_block),
        mask_mod=mask_mod,
        seq_lengths=(length, length),
    )


def clipped_value_rows_term(
    attend: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Callable | None,
    block_mask: BlockMask | None,
    scale: float,
    lse: torch.Tensor,
    value_rows: ValueRows,
    causal: bool,
) -> torch.Tensor:
    """``sum_j a_ij R[clip(j - i, -k, k) + k]`` on FlexAttention (``R``: ``value_rows.table``, ``k``:
    ``value_rows.max_distance``), from the softmax's log-sum-exp ``lse`` ``(batch, heads, n)``, for queries and keys
    at the same consecutive positions: ``(batch, heads, n, head_dim)``, without the weights matrix.

    A key inside the clip, ``|j - i| < k``, has a row of its own, weighted ``a_ij = exp(s_ij - lse_i)`` from the band
    of scores (:func:`band_scores`). The keys clipped to row 0 (``j <= i - k``) and row ``2k`` share the rest of the
    row's mass, ``1 - sum of the band``: a causal layer (its mask hides every key after the query) gives it all to
    row 0; otherwise a second FlexAttention pass over the keys ``j <= i - k`` (the other keys' scores at
    ``finfo.min``, the tiles of none of them skipped, :func:`left_tail_block_mask`) gives row 0's share,
    ``exp(lse_left_i - lse_i)``, and row ``2k`` the remainder (with ``k >= n`` both tails are empty: no pass). Rows
    that see no key (``lse = -inf``) get 0."""
    k = value_rows.max_distance
    if k is None:
        raise ValueError(
            "A value term on FlexAttention needs rows of a clipped distance (ValueRows.max_distance); a scheme whose "
            "value term has other rows must leave flex_attention out of its supported_backends."
        )
    has_key = torch.isfinite(lse)
    finite_lse = torch.where(has_key, lse, 0.0)[..., None]
    band = torch.exp(band_scores(query, key, score_mod, block_mask, scale, k - 1) - finite_lse)
    rest = has_key.to(band.dtype) - band.sum(-1)
    if causal or k >= query.shape[-2]:
        left, right = rest, torch.zeros_like(rest)
    else:

        def left_tail_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
            if score_mod is not None:
                score = score_mod(score, batch_idx, head_idx, q_idx, kv_idx)
            # finfo.min, not -inf: FlexAttention's unfused path differentiates an all -inf row's log-sum-exp to NaN
            # (the compiled kernel's base-2 scaling makes it -inf, which its masked-row handling covers)
            return torch.where(kv_idx <= q_idx - k, score, torch.finfo(score.dtype).min)

        tail_mask = left_tail_block_mask(block_mask, query.shape[-2], k, query.device)
        _, left_lse = flex_pass(attend, query, key, value, left_tail_score_mod, tail_mask, scale, pass_name="tail")
        left = torch.exp(torch.where(has_key, left_lse, float("-inf")) - finite_lse[..., 0]).to(band.dtype)
        right = rest - left
    per_row = torch.cat((left[..., None], band, right[..., None]), dim=-1)
    return torch.matmul(per_row, value_rows.table.to(per_row.dtype))


def chain_score_mods(first: Callable | None, second: Callable | None) -> Callable | None:
    """One FlexAttention ``score_mod`` adding both terms (the scheme's position-only one, the layer's content one);
    None when neither exists."""
    if first is None or second is None:
        return first or second

    def chained_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        return second(first(score, batch_idx, head_idx, q_idx, kv_idx), batch_idx, head_idx, q_idx, kv_idx)

    return chained_score_mod


class QueryKeyRMSNorm(nn.Module):
    """QK-norm: RMSNorm of each head's query or key features (Qwen3's ``Qwen3RMSNorm`` on ``head_dim``, applied as
    ``Qwen3Attention`` does, after the projection and before the position encoding; OLMo 3, Gemma 3):
    ``x / sqrt(mean(x^2) + eps) * weight``, computed in float32, the ``(head_dim,)`` weight shared by the heads and
    initialised to 1 (Transformers' init of an ``RMSNorm``). ``x``: ``(..., head_dim)``."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def soft_capped_scores(scores: torch.Tensor, cap: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Gemma 2's logit soft-capping, ``b -> c tanh(b / c)`` (``Gemma2Attention``'s ``attn_logit_softcapping``), of
    the scores with their position and content terms; masked keys stay masked: ``mask`` is the mask already applied
    to ``scores``, additive (``finfo.min`` on masked keys) or boolean (True = visible), or None."""
    capped = cap * torch.tanh(scores / cap)
    if mask is None:
        return capped
    hidden = ~mask if mask.dtype == torch.bool else mask <= torch.finfo(mask.dtype).min / 2
    return capped.masked_fill(hidden, torch.finfo(capped.dtype).min)


def soft_cap_score_mod(cap: float) -> Callable:
    """:func:`soft_capped_scores` as a FlexAttention ``score_mod`` (attention-gym's ``generate_tanh_softcap``),
    chained after the scheme's and the layer's terms; the ``BlockMask`` masks apart from it."""

    def soft_cap(score, batch_idx, head_idx, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return soft_cap


def repeat_kv_heads(states: torch.Tensor, query_heads: int) -> torch.Tensor:
    """Grouped-query keys or values ``(batch, kv_heads, seq, head_dim)`` repeated for the query heads they serve."""
    if states.shape[1] == query_heads:
        return states
    return states.repeat_interleave(query_heads // states.shape[1], dim=1)


def _eager(
    query,
    key,
    values,
    attention_inputs,
    normalizer,
    score_term,
    value_rows,
    scaling,
    dropout,
    training,
    logit_softcapping=None,
):
    """The weights materialised, applied to each of ``values`` (``normalizer.split_values``): the outputs and the
    weights. ``logit_softcapping``: the scores capped before the normalizer (:func:`soft_capped_scores`)."""
    compute_dtype = torch.promote_types(query.dtype, torch.float32)  # scores and weights in at least float32
    scores = torch.matmul(query.to(compute_dtype), key.to(compute_dtype).transpose(-1, -2)) * scaling
    score_term = score_term(query, key, attention_inputs) if score_term is not None else None
    if score_term is not None:
        scores = scores + score_term
    if attention_inputs["mask"] is not None:
        scores = scores + attention_inputs["mask"]
    if logit_softcapping is not None:
        scores = soft_capped_scores(scores, logit_softcapping, attention_inputs["mask"])
    weights = normalizer(scores, attention_inputs)
    if attention_inputs["row_has_key"] is not None:
        weights = weights * attention_inputs["row_has_key"]
    weights = nn.functional.dropout(weights.to(values[0].dtype), p=dropout, training=training)
    term = value_rows_term(weights, value_rows) if value_rows is not None else None
    outputs = [torch.matmul(weights, value) for value in values]
    return [output if term is None else output + term for output in outputs], weights


def attention_in_query_chunks(
    query,
    key,
    value,
    attention_inputs,
    normalizer,
    score_term,
    value_rows,
    scaling,
    dropout,
    training,
    causal,
    logit_softcapping=None,
):
    """The ``sdpa`` backend of a normalizer no SDPA kernel computes (``normalizer.sdpa_in_query_chunks``:
    stick_breaking): the eager composition (scores, the mask, the normalizer, dropout, ``P V`` and the value term) a
    chunk of queries at a time (``relative_tables.in_query_chunks``, each chunk checkpointed), so only ``(batch,
    heads, chunk, kv_len)`` scores and weights exist at a time and the backward recomputes them; a layer keeps q, k,
    v, its output and, with a layer term, that ``(q, k)`` term. Every normalizer's weights are a function of its
    row's scores, so the chunks give eager's numbers. The mask is SDPA's (:func:`build_dense_mask`): additive,
    boolean, or None (``attention_normalizers.implicit_last_keys``: SDPA's top-left ``is_causal``, or every key);
    dropout masks are recomputed from the saved RNG state. ``logit_softcapping`` caps the scores as eager does."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    key, value = repeat_kv_heads(key, query.shape[1]), repeat_kv_heads(value, query.shape[1])  # as eager reads them
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    term = score_term(query, key, attention_inputs) if score_term is not None else None
    mask, visible, row_has_key = attention_inputs["mask"], attention_inputs["visible"], attention_inputs["row_has_key"]
    if mask is None:  # what SDPA would see: is_causal (top-left), or every key
        visible = mask = implicit_visible(causal, q_len, kv_len, query.device)[None, None]
    query_positions = attention_inputs["query_positions"]

    def chunk_output(start: int, stop: int) -> torch.Tensor:
        scores = torch.matmul(query[:, :, start:stop].to(compute_dtype), key.to(compute_dtype).transpose(-1, -2))
        scores = scores * scaling
        if term is not None:
            scores = scores + term[:, :, start:stop]
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask[..., start:stop, :], torch.finfo(scores.dtype).min)
        elif mask is not None:
            scores = scores + mask[..., start:stop, :]
        if logit_softcapping is not None:
            scores = soft_capped_scores(scores, logit_softcapping, None if mask is None else mask[..., start:stop, :])
        chunk_inputs = {
            **attention_inputs,
            "query_positions": query_positions[:, start:stop],
            "visible": None if visible is None else visible[..., start:stop, :],
            "row_has_key": None if row_has_key is None else row_has_key[..., start:stop, :],
        }
        weights = normalizer(scores, chunk_inputs)
        if row_has_key is not None:
            weights = weights * row_has_key[..., start:stop, :]
        weights = nn.functional.dropout(weights.to(value.dtype), p=dropout, training=training)
        output = torch.matmul(weights, value)
        if value_rows is not None:
            index, starts = value_rows.index, value_rows.starts
            rows_of_chunk = value_rows._replace(
                index=index[:, start:stop], starts=None if starts is None else starts[:, start:stop]
            )
            output = output + value_rows_term(weights, rows_of_chunk)
        return output

    return in_query_chunks(chunk_output, (query.shape[0], query.shape[1], q_len, kv_len), query.device)


def _differentiate_mask_outside_sdpa(attn_mask, query, dropout, training) -> bool:
    """A float mask that requires grad (a learned position term) on CPU, without dropout: CPU SDPA kernels do not
    differentiate the mask and would fall back to the math path, so :func:`attention_with_learned_bias` runs SDPA's
    fused forward and its own backward (one ``(q_len, kv_len)`` tensor kept per layer instead of about three)."""
    needs_grad = attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled()
    return needs_grad and query.device.type == "cpu" and not (training and dropout > 0)


def _sdpa(query, key, value, attention_inputs, normalizer, score_term, value_rows, scaling, dropout, training, causal):
    attn_mask = attention_inputs["mask"]
    score_term = score_term(query, key, attention_inputs) if score_term is not None else None
    if score_term is not None:
        if attn_mask is None:
            attn_mask = score_term.to(query.dtype)
        elif attn_mask.dtype == torch.bool:
            attn_mask = score_term.to(query.dtype).masked_fill(~attn_mask, torch.finfo(query.dtype).min)
        else:
            attn_mask = attn_mask + score_term.to(attn_mask.dtype)
    query, key, value, attn_mask = normalizer.sdpa_arguments(query, key, value, attn_mask, attention_inputs, causal)
    if value_rows is not None:  # training with attention dropout ran eager (choose_backend)
        bias = additive_mask(attn_mask, causal, query, key)
        output = attention_with_learned_bias(query, key, value, bias, scaling, value_rows)
    elif _differentiate_mask_outside_sdpa(attn_mask, query, dropout, training):
        key, value = repeat_kv_heads(key, query.shape[1]), repeat_kv_heads(value, query.shape[1])
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
            enable_gqa=key.shape[1] != query.shape[1],
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
    cache=None,
    layer_idx: int | None = None,
    project_query_key: QueryKeyProjection | None = None,
    hidden_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``(batch, heads, q_len, head_dim)`` q, k, v with the scheme and normalizer composed in (k and v
    may have fewer heads, a divisor of q's: grouped-query attention, as in Llama; the cache keeps them unrepeated).

    ``attention_inputs`` is the layer's per-forward :data:`AttentionInputs`; ``encoding`` the model's position
    encoding, of which the layer runs ``encoding.layer_encoding(layer_idx)``; ``position_term`` the layer's
    :class:`LayerPositionTerm` or None, ``project_query_key`` the layer's q/k projections it may apply to other
    vectors, ``hidden_states`` ``(batch, q_len, hidden)`` the layer's input q, k, v were projected from (for the
    term's ``layer_tables``, whose per-token states are kept in ``cache``, and for the normalizer's output gate);
    ``scaling`` is the layer's factor on ``q.k``, times the scheme's ``content_scale``; the inputs'
    ``"logit_softcapping"`` (the config's ``attn_logit_softcapping``, None: off) caps the scores, position and content
    terms included, before the normalizer (:func:`soft_capped_scores`, on a backend that can: :func:`choose_backend`
    was told the same value). The weights are
    applied to each of the normalizer's ``split_values`` (one attention each, on every backend) and its
    ``attention_output`` combines and gates the outputs. Returns the output ``(batch, q_len, heads, head_dim)`` and
    the weights ``(batch, heads, q_len, kv_len)`` as the normalizer reports them (eager only, else None)."""
    encoding = encoding.layer_encoding(layer_idx)  # the scheme this layer runs (a per-layer layout's own)
    scaling = scaling * encoding.content_scale
    logit_softcapping = attention_inputs.get("logit_softcapping")
    score_term = value_rows = None
    if position_term is not None:
        store = None
        if cache is not None:
            position_cache = PositionCache(cache, encoding.dims.num_layers)
            store = partial(
                position_cache.append_layer_state, scheme=encoding, term=position_term, layer_idx=layer_idx
            )
        layer_tables = position_term.layer_tables(hidden_states, attention_inputs, store)
        attention_inputs = {**attention_inputs, "layer": layer_tables}
        score_term = partial(position_term.score_term, scaling=scaling, project_query_key=project_query_key)
        value_rows = position_term.value_rows(attention_inputs)
    tables = attention_inputs["position"]
    query, key, value = encoding.transform_qkv(query, key, value, tables)
    if cache is not None:
        key, value = cache.update(key, value, layer_idx)
    backend = attention_inputs["backend"]
    # Grouped-query attention (key/value head h serves query heads h*g .. h*g+g-1): the fused kernels read the shared
    # heads themselves (enable_gqa); eager and the layer terms, which read keys per query head, get them repeated.
    if key.shape[1] != query.shape[1] and (backend == "eager" or position_term is not None):
        key, value = repeat_kv_heads(key, query.shape[1]), repeat_kv_heads(value, query.shape[1])
    weights = None
    values = normalizer.split_values(value)
    fused = None
    if backend == "sdpa":  # fla's kernel for the combinations that have one, on CUDA when installed
        dropout_in_effect = dropout if training else 0.0
        fused = fla_attention(
            query, key, values, attention_inputs, encoding, normalizer, position_term, scaling, dropout_in_effect,
            logit_softcapping,
        )  # fmt: skip
    if fused is not None:
        outputs = fused
    elif backend == "flex_attention":
        score_mod = encoding.score_mod(tables, attention_inputs["query_positions"], attention_inputs["key_positions"])
        if position_term is not None:
            layer_mod = position_term.score_mod(query, key, attention_inputs, scaling, project_query_key)
            score_mod = chain_score_mods(score_mod, layer_mod)
        query, key = encoding.flex_query_key(query, key, tables)  # a scheme's extra q/k features (TUPE)
        if key.shape[1] != values[0].shape[1]:  # keys repeated for per-query-head features: their values alike
            values = [repeat_kv_heads(v, query.shape[1]) for v in values]
        if logit_softcapping is not None:
            score_mod = chain_score_mods(score_mod, soft_cap_score_mod(logit_softcapping))
        region = f"{encoding.name}+{normalizer.name}" + ("+softcap" if logit_softcapping is not None else "")
        kernel_options = flex_kernel_options(query.device, encoding, position_term)
        attend = partial(flex_attend, region=region, enable_gqa=key.shape[1] != query.shape[1], **kernel_options)
        block_mask = attention_inputs["mask"]
        if value_rows is None:
            outputs = [normalizer.flex_output(attend, query, key, v, score_mod, block_mask, scaling) for v in values]
        else:  # softmax weights on consecutive positions (choose_backend)
            passes = [flex_pass(attend, query, key, v, score_mod, block_mask, scaling) for v in values]
            lse = passes[0][1]
            term = clipped_value_rows_term(
                attend, query, key, values[0], score_mod, block_mask, scaling, lse, value_rows, causal
            )
            outputs = [output + term.to(output.dtype) for output, _ in passes]
    elif backend == "sdpa":
        attend = _sdpa  # with a logit soft-cap only the chunked composition runs here (choose_backend)
        if normalizer.sdpa_in_query_chunks:
            attend = partial(attention_in_query_chunks, logit_softcapping=logit_softcapping)
        outputs = [
            attend(
                query, key, v, attention_inputs, normalizer, score_term, value_rows, scaling, dropout, training, causal
            )
            for v in values
        ]
    else:
        outputs, weights = _eager(
            query,
            key,
            values,
            attention_inputs,
            normalizer,
            score_term,
            value_rows,
            scaling,
            dropout,
            training,
            logit_softcapping,
        )
        weights = normalizer.output_weights(weights)
    output = normalizer.attention_output(outputs, hidden_states)
    return output.transpose(1, 2).contiguous(), weights
