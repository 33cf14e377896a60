"""The kernel layer beneath the one attention composition: which backend runs a forward, the masks in the form it
takes, and the FlexAttention compile cache.

``choose_route`` reads the facts of one forward (:class:`ForwardFacts`, built once per forward and kind of layer)
and asks the scheme and the normalizer which backends they refuse and why (``backend_refusals``, beside their
formulas), as flash-linear-attention's backends answer ``verify(...) -> (ok, reason)``; the kernels' own limits
(:func:`flex_refusal`) and the combination's (a value term read from softmax weights) are added here. The first
backend of the order (:func:`backend_order`) that nobody refuses runs, and every refusal of a backend tried before
it is a sentence in the log: INFO, or a WARNING where the user's request is overridden or a slower path is taken.

* ``eager``: every scheme and normalizer (weights are materialised);
* ``sdpa``: softmax and the normalizers that are a softmax of transformed scores; a position-only term goes in as a
  dense float mask;
* ``flex_attention``: softmax, and (off CPU) the others from its log-sum-exp; position and layer terms go in as a
  ``score_mod`` (nothing materialised).

Every backend computes the same numbers, so the choice changes speed and memory, never the result.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import types
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers.masking_utils import (
    LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING,
    create_bidirectional_mask,
    create_bidirectional_sliding_window_mask,
)
from transformers.utils import logging

from .attention_normalizers import ATTENTION_NORMALIZERS
from .position_encodings import POSITION_ENCODINGS
from .position_interface import (
    BACKENDS,
    CACHE_NAME,
    AttentionInputs,
    ForwardFacts,
    LayerPositionTerm,
    PositionEncoding,
    flex_compiles_length_sized_tables,
)


logger = logging.get_logger(__name__)

BACKEND_REQUESTS = ("flex_attention", "sdpa", "eager")

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

FLEX_CUDA_FORWARD_OPTIONS: dict[str, Any] = {}
"""The forward's FlexAttention kernel options on CUDA when a ``score_mod``'s tables need gradients: inductor's own
defaults (on an H100 at head_dim 64 in bf16, 128 x 128 tiles, 4 warps, 3 stages). The forward reads the tables and
writes no gradient, so the small tile the backward needs (:data:`FLEX_CUDA_BACKWARD_OPTIONS`) only slowed it: until
the GPU sweep (``benchmarks/flex_kernel_options.py``) measures a tuned set, the defaults (expected, not measured)."""

FLEX_CUDA_BACKWARD_OPTIONS = {
    "bwd_BLOCK_M1": 64,
    "bwd_BLOCK_N1": 64,
    "bwd_BLOCK_M2": 64,
    "bwd_BLOCK_N2": 64,
    "bwd_num_stages": 1,
}
"""The backward's kernel options on CUDA when a ``score_mod``'s tables need gradients: 64 x 64 tiles, one stage.
Measured on an H100 (B 8, H 12, n 2048, head_dim 64, a per-distance float32 table, forward + backward): 25 ms with
torch's defaults, 4.25 ms with 64 x 64 tiles and one stage applied to both passes; with the defaults a float32 table
that needs gradients does not compile, "out of resource: shared memory" (the backward adds the table's gradient)."""

FLEX_CUDA_KERNEL_OPTIONS = {**FLEX_CUDA_FORWARD_OPTIONS, **FLEX_CUDA_BACKWARD_OPTIONS}
"""Both passes' options (``fwd_*`` and ``bwd_*`` names of ``FlexKernelOptions``): each pass is set apart."""

DENSE_BIAS_BUDGET_BYTES = 256 * 2**20
"""On CUDA a position-only bias runs FlexAttention (a ``score_mod`` reading its small table) once SDPA's dense float
bias, one ``(1, heads, q_len, kv_len)`` float32 tensor, would exceed this: 256 MiB is reached at about 2,400 tokens
with 12 heads, and SDPA keeps several copies of it per forward (the folded mask, the kernel's aligned copy) plus a
``(batch, heads, q, k)`` gradient in training (ALiBi at 1 x 8192 on an H200: 3.2 GB per tensor, 5.3x the memory of
no position encoding). Below it SDPA's fused kernel stays (ALiBi at 8 x 2048 on an H100: 40.1 ms against flex's
43.2 ms)."""


@dataclasses.dataclass(frozen=True)
class Route:
    """The backend that runs a forward, the order tried (:func:`backend_order`), why flex was put first on CUDA
    (``preference``, or None) and, per backend, the sentences saying why it was refused (``refusals``)."""

    backend: str
    order: tuple[str, ...]
    preference: str | None
    refusals: dict[str, tuple[str, ...]]


def mask_kind(given_mask: torch.Tensor | BlockMask | None) -> str:
    """The kind of a mask given to the model, as :class:`ForwardFacts` keeps it."""
    if given_mask is None:
        return "none"
    if isinstance(given_mask, BlockMask):
        return "BlockMask"
    return f"{given_mask.dim()}-D tensor"


def flex_returns_lse(device: torch.device) -> bool:
    """Compiled FlexAttention returns the log-sum-exp (``return_aux=AuxRequest(lse=True)``) except on CPU, where
    torch 2.13 raises "torch.compile on CPU only supports inference and `return_lse` is not supported yet"."""
    return device.type != "cpu"


def flex_refusal(facts: ForwardFacts, needs_lse: bool, compiles_on_cpu: bool = True) -> list[str]:
    """Why FlexAttention's kernels cannot run this forward (empty: they can). The rules: no attention dropout; a
    one-token decoding step gains nothing from it and would compile once per cache length; a user's 4-D tensor mask
    runs on eager or SDPA; on CUDA, Triton's lowering refuses heads narrower than :data:`FLEX_CUDA_MIN_HEAD_DIM`;
    compiled FlexAttention on CPU (torch 2.13) has no backward, takes float32, float16 and bfloat16 only, is wrong for
    ``head_dim`` below :data:`FLEX_CPU_MIN_HEAD_DIM`, cannot recompile some schemes' ``score_mod``
    (``compiles_on_cpu``: the scheme's ``flex_compiles_on_cpu``, see :func:`flex_compiles_length_sized_tables`), and
    returns no log-sum-exp, which normalizers with ``flex_needs_lse`` and value terms are computed from
    (``needs_lse``)."""
    reasons = []
    if facts.attention_dropout:
        reasons.append("FlexAttention has no attention dropout")
    if facts.query_length == 1:
        reasons.append("a one-token decoding step runs SDPA (FlexAttention would compile once per cache length)")
    if facts.given_mask == "4-D tensor":
        reasons.append("a 4-D tensor attention_mask runs on eager or SDPA")
    head_dim = facts.head_dim
    if facts.device.type == "cuda" and head_dim is not None and head_dim < FLEX_CUDA_MIN_HEAD_DIM:
        reasons.append(f"Triton's FlexAttention kernels need head_dim >= {FLEX_CUDA_MIN_HEAD_DIM}, not {head_dim}")
    if facts.device.type == "cpu":
        if facts.grad_enabled:
            reasons.append("compiled FlexAttention on CPU has no backward (torch 2.13); use torch.no_grad() for it")
        if facts.dtype not in FLEX_CPU_DTYPES:
            reasons.append(f"compiled FlexAttention on CPU takes float32, float16 and bfloat16, not {facts.dtype}")
        if head_dim is not None and head_dim < FLEX_CPU_MIN_HEAD_DIM:
            reasons.append(
                f"compiled FlexAttention on CPU computes wrong numbers for head_dim {head_dim} < "
                f"{FLEX_CPU_MIN_HEAD_DIM} (torch 2.13)"
            )
    if not compiles_on_cpu and not flex_compiles_length_sized_tables(facts.device):
        reasons.append(
            "compiled FlexAttention on CPU (torch 2.13) emits C++ that does not compile for this scheme's "
            "score_mod once a second length makes the shapes dynamic"
        )
    if needs_lse and not flex_returns_lse(facts.device):
        reasons.append("compiled FlexAttention on CPU returns no log-sum-exp, which this normalizer is computed from")
    return reasons


def flex_preference(scheme_class: type[PositionEncoding], spec: dict[str, Any], facts: ForwardFacts) -> str | None:
    """Why FlexAttention should run this scheme by default on CUDA (SDPA requested), or None. A layer term with a
    ``score_mod`` (shaw, xlnet, deberta, relative_key, fox) would give SDPA a dense ``(batch, heads, q, k)`` term per
    layer; a position-only ``score_mod`` whose table takes gradients spreading them trains in the kernel's backward
    instead of through a dense bias and its gradient (t5, kerple, tupe; measured on an H100, 8 x 2048: the faster
    path); any other position-only ``score_mod`` once the dense bias would exceed :data:`DENSE_BIAS_BUDGET_BYTES`."""
    if scheme_class.has_layer_term and "flex_attention" in scheme_class.supported_backends(spec):
        return "its layer term is a score_mod on FlexAttention, where SDPA takes a dense (batch, heads, q, k) term"
    if scheme_class.score_mod is PositionEncoding.score_mod:
        return None
    if facts.position_bias_needs_grad and facts.bias_spreads_gradients:
        return "its position bias trains in the score_mod's backward, where SDPA takes a dense bias and its gradient"
    if facts.dense_bias_bytes() > DENSE_BIAS_BUDGET_BYTES:
        return (
            f"its dense float bias would take {facts.dense_bias_bytes() / 2**20:.0f} MiB, over the "
            f"{DENSE_BIAS_BUDGET_BYTES // 2**20} MiB budget"
        )
    return None


def backend_order(requested: str, on_cuda: bool, flex_first: bool) -> tuple[str, ...]:
    """The backends to try, in order; the first that nobody refuses runs the forward.

    | request | device | combination | order |
    |---|---|---|---|
    | ``eager`` | any | any | eager |
    | ``flex_attention`` | any | any | flex, sdpa, eager |
    | ``sdpa`` (default) | CUDA | the normalizer refuses SDPA, or :func:`flex_preference` says | flex, sdpa, eager |
    | ``sdpa`` (default) | otherwise | any | sdpa, eager |
    """
    if requested == "eager":
        return ("eager",)
    if requested == "flex_attention" or (on_cuda and flex_first):
        return ("flex_attention", "sdpa", "eager")
    return ("sdpa", "eager")


def choose_route(
    requested: str | None, position_encoding: dict[str, Any], attention_normalizer: dict[str, Any], facts: ForwardFacts
) -> Route:
    """The backend that runs a forward of ``position_encoding`` + ``attention_normalizer`` (full config specs) with
    ``facts``: the first of :func:`backend_order` that the scheme's and the normalizer's ``backend_refusals``, the
    kernels (:func:`flex_refusal`; ``need_weights`` needs eager) and the combination (a value term reads softmax's
    weights) do not refuse. A user's ``BlockMask`` needs FlexAttention (ValueError if it is refused). Each refusal of
    a backend tried before the chosen one is logged (:func:`log_route`)."""
    requested = requested or "sdpa"
    if requested not in BACKEND_REQUESTS:
        raise ValueError(
            f"attn_implementation {requested!r} is not supported by hf_posenc; valid choices: {BACKEND_REQUESTS}."
        )
    scheme_class = POSITION_ENCODINGS[position_encoding["type"]]
    normalizer_class = ATTENTION_NORMALIZERS[attention_normalizer["type"]]
    value_term = scheme_class.has_value_term(position_encoding)
    scheme_refusals = scheme_class.backend_refusals(position_encoding, facts)
    normalizer_refusals = normalizer_class.backend_refusals(attention_normalizer, facts)
    refusals: dict[str, list[str]] = {backend: [] for backend in BACKENDS}
    for answers in (scheme_refusals, normalizer_refusals):
        for backend, reason in answers.items():
            refusals[backend].append(reason)
    if facts.need_weights:
        for backend in ("sdpa", "flex_attention"):
            refusals[backend].append("output_attentions needs the weights, which eager alone materialises")
    if value_term and not normalizer_class.weights_are_softmax(attention_normalizer):
        for backend in ("sdpa", "flex_attention"):
            refusals[backend].append("the value term is computed from softmax weights here (other normalizers: eager)")
    needs_lse = normalizer_class.needs_lse_on_flex(attention_normalizer) or value_term
    refusals["flex_attention"] += flex_refusal(facts, needs_lse, scheme_class.flex_compiles_on_cpu)
    if facts.given_mask == "BlockMask":
        if refusals["flex_attention"]:
            raise ValueError(
                f"A BlockMask attention_mask needs FlexAttention, which cannot run {position_encoding['type']} + "
                f"{attention_normalizer['type']} here ({'; '.join(refusals['flex_attention'])}); pass a 2-D or 4-D "
                "tensor mask instead."
            )
        return Route("flex_attention", ("flex_attention",), None, {})
    preference = flex_preference(scheme_class, position_encoding, facts)
    if preference is None and "sdpa" in normalizer_refusals:
        preference = f"SDPA cannot run it ({normalizer_refusals['sdpa']})"
    order = backend_order(requested, facts.device.type == "cuda", preference is not None)
    backend = next(backend for backend in order if not refusals[backend])
    tried = order[: order.index(backend)]
    route = Route(backend, order, preference, {name: tuple(refusals[name]) for name in tried})
    if not torch.compiler.is_compiling():  # dynamo cannot trace a logger call
        log_route(requested, position_encoding["type"], attention_normalizer["type"], route, facts)
    return route


def choose_backend(
    requested: str | None,
    position_encoding: dict[str, Any],
    attention_normalizer: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    given_mask: torch.Tensor | BlockMask | None = None,
    **facts: Any,
) -> str:
    """:func:`choose_route`'s backend, the facts given one by one (:class:`ForwardFacts`' fields; ``given_mask`` the
    mask itself)."""
    record = ForwardFacts(device, dtype, given_mask=mask_kind(given_mask), **facts)
    return choose_route(requested, position_encoding, attention_normalizer, record).backend


def log_route(requested: str, encoding: str, normalizer: str, route: Route, facts: ForwardFacts) -> None:
    """Say why each backend tried before ``route.backend`` was refused. A WARNING where the request is overridden
    (FlexAttention requested) or, on CUDA, where the path FlexAttention was preferred for is left for a slower one
    (attention dropout gets its own, naming the fix); INFO otherwise."""
    combination = f"hf_posenc: {encoding} + {normalizer}"
    if not route.refusals:
        if route.backend != requested and route.preference is not None:
            _log(logging.INFO, f"{combination} runs on {route.backend} (requested {requested}): {route.preference}.")
        return
    flex_reasons = route.refusals.get("flex_attention", ())
    others = "; ".join(
        f"{backend}: {'; '.join(reasons)}"
        for backend, reasons in route.refusals.items()
        if backend != "flex_attention"
    )
    if requested == "flex_attention":
        then = f" It runs on {route.backend} ({others})." if others else f" It runs on {route.backend}."
        _log(
            logging.WARNING,
            f"{combination} does not run on the requested flex_attention: {'; '.join(flex_reasons)}.{then}",
        )
        return
    if flex_reasons == ("FlexAttention has no attention dropout",) and facts.device.type == "cuda":
        _log(
            logging.WARNING,
            f"{combination} trains on {route.backend} instead of FlexAttention, which has no attention dropout: "
            "slower, and it keeps (batch, heads, q, k) tensors per layer. Set attention_probs_dropout_prob=0 (BERT) "
            "or attn_pdrop=0 (GPT-2), as current pretraining recipes do, to train on FlexAttention.",
        )
        return
    said = "; ".join(f"{backend}: {'; '.join(reasons)}" for backend, reasons in route.refusals.items())
    slower = bool(flex_reasons) and facts.device.type == "cuda" and facts.query_length > 1
    preferred = f", FlexAttention first: {route.preference}" if route.preference else ""
    message = f"{combination} runs on {route.backend} (requested {requested}{preferred}); refused by {said}."
    _log(logging.WARNING if slower else logging.INFO, message)


@cache
def _log(level: int, message: str) -> None:
    """Each routing message once per process."""
    logger.log(level, message)


def position_bias_needs_grad(encoding: PositionEncoding) -> bool:
    """Whether this forward differentiates a position-only score bias: the scheme gives a ``score_mod`` and has
    parameters that require gradients, and gradients are enabled (T5's table, KERPLE's r1 and r2, FIRE's MLP, in
    training; ALiBi's fixed slopes never)."""
    return (
        torch.is_grad_enabled()
        and type(encoding).score_mod is not PositionEncoding.score_mod
        and any(parameter.requires_grad for parameter in encoding.parameters())
    )


def forward_facts(
    encoding: PositionEncoding,
    inputs_embeds: torch.Tensor,
    key_length: int,
    given_mask: torch.Tensor | BlockMask | None,
    need_weights: bool,
    attention_dropout: bool,
    consecutive: bool,
    logit_softcapping: float | None,
) -> ForwardFacts:
    """The :class:`ForwardFacts` of a model's forward for the layers running ``encoding``."""
    return ForwardFacts(
        device=inputs_embeds.device,
        dtype=inputs_embeds.dtype,
        head_dim=encoding.dims.head_dim,
        query_length=inputs_embeds.shape[1],
        key_length=key_length,
        num_heads=encoding.dims.num_heads,
        given_mask=mask_kind(given_mask),
        need_weights=need_weights,
        attention_dropout=attention_dropout,
        consecutive=consecutive,
        position_bias_needs_grad=position_bias_needs_grad(encoding),
        bias_spreads_gradients=encoding.flex_spreads_gradients(consecutive),
        logit_softcapping=logit_softcapping,
    )


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


COMPILE_ISOLATES_RECOMPILES = "isolate_recompiles" in inspect.signature(torch.compile).parameters
"""``torch.compile(..., isolate_recompiles=True)`` (torch >= 2.13) gives a compiled function its own recompile budget.
Older torch (2.11, 2.12) lacks it: :func:`_region_flex_attention` then gives each region a code object of its own,
on which dynamo keys its cache and counts its recompiles."""


FLEX_CPU_COMPILES_SYMBOLIC_SIZES = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"
"""Whether the CPU FlexAttention template compiles with symbolic sizes: torch 2.11's generates C++ that g++ rejects
(``'cur_kvSplitSize7' was not declared in this scope``). Where it cannot, :func:`flex_attend` compiles a static
kernel for each new shape on the CPU (up to torch's recompile limit, then the unfused path, with a warning)."""


def _region_flex_attention(region: str) -> Callable:
    """``flex_attention`` behind a function whose code object belongs to ``region`` alone. Dynamo keeps its compiled
    entries and its recompile count per code object, so two regions never share the recompile limit, as
    ``isolate_recompiles`` does on newer torch (one closure per region would not do: closures of one ``def`` share
    their code object)."""

    def region_flex_attention(*args, **kwargs):
        return flex_attention(*args, **kwargs)

    code = region_flex_attention.__code__
    name = f"flex_attention[{region}]"
    own_code = code.replace(co_name=name)
    return types.FunctionType(
        own_code, region_flex_attention.__globals__, name, None, region_flex_attention.__closure__
    )


@cache
def _compiled_flex_attention(grad_enabled: bool, region: str, dynamic: bool) -> Callable:
    """One compiled FlexAttention per grad mode, ``region`` (a combination and a pass of its normalizer) and
    ``dynamic``, each with its own recompile budget (``isolate_recompiles``; on older torch a code object per
    region, :func:`_region_flex_attention`), so that train/eval switches, several combinations in one process and
    the passes of a normalizer never share torch's recompile limit. ``fullgraph=True`` makes hitting the limit raise
    rather than silently run uncompiled (see :func:`flex_attend`). ``grad_enabled`` only keys the cache. ``dynamic``
    is set explicitly either way: dynamo keeps its automatic dynamic-shape state per code object
    (``torch/_dynamo/pgo.py``), not per region, so with ``dynamic=None`` a region compiled after another had seen two
    lengths would start with symbolic sizes. On older torch the symbolic region's code object is new, so its first
    shape compiles static once more before its sizes turn symbolic (one extra compile a region)."""
    dynamic_shapes = None if dynamic else False
    if COMPILE_ISOLATES_RECOMPILES:
        return torch.compile(flex_attention, fullgraph=True, isolate_recompiles=True, dynamic=dynamic_shapes)
    mode = "train" if grad_enabled else "eval"
    per_region = _region_flex_attention(f"{mode}:{region}:{'dynamic' if dynamic else 'static'}")
    return torch.compile(per_region, fullgraph=True, dynamic=dynamic_shapes)


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
    compiled with symbolic sizes, which every later length reuses (on a CPU whose torch cannot compile those,
    :data:`FLEX_CPU_COMPILES_SYMBOLIC_SIZES`, a static kernel per shape). Inside a ``torch.compile``d model the plain
    function is called and the outer compile fuses it. Should a region still hit torch's recompile limit (shapes
    other than the lengths and batch size changing every call), the call runs FlexAttention's unfused path, which
    materialises every score, and a warning says so: no silent slow path."""
    if torch.compiler.is_compiling():
        return flex_attention(query, key, value, **kwargs)
    name = f"{region}/{pass_name}" if pass_name else region
    grad_enabled = torch.is_grad_enabled()
    shapes = _call_shapes(query, key, value, kwargs)
    dynamic = _FIRST_SHAPES.setdefault((grad_enabled, name), shapes) != shapes
    dynamic = dynamic and (query.device.type != "cpu" or FLEX_CPU_COMPILES_SYMBOLIC_SIZES)
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
    """``kernel_options`` for FlexAttention: :data:`FLEX_CUDA_KERNEL_OPTIONS` (the forward's and the backward's set
    apart) on CUDA when the tables a ``score_mod`` reads need gradients (the scheme's position-only bias in training,
    or a layer's content-term row tables, built from q and k, whenever gradients are on), torch's defaults
    otherwise."""
    layer_tables_need_grad = (
        position_term is not None
        and type(position_term).score_mod is not LayerPositionTerm.score_mod
        and torch.is_grad_enabled()
    )
    if device.type == "cuda" and (position_bias_needs_grad(encoding) or layer_tables_need_grad):
        return {"kernel_options": dict(FLEX_CUDA_KERNEL_OPTIONS)}
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
