"""The attention-normalizer catalogue: how raw scores ``b_ij`` become attention weights ``a_ij``.

Source: Su Jianlin, "A hidden flaw of relative position encodings" (kexue.fm/archives/9105, "F" below). With softmax
every row of weights sums to 1, so n identical tokens under a relative-only scheme give n identical outputs; every
other normalizer here (and the Toeplitz gate, an option of each) lets the row sums vary with the position, except
``ssmax``, a softmax of rescaled scores (equal scores stay equal).

A normalizer sees scores whose masked keys (padding, causal) are already ``finfo.min``, and must give them a weight
of exactly 0; the attention composition guarantees every row it sees has a visible key, and sets rows without one
to 0 itself. Weights are computed in at least float32 whatever the model dtype.

Initialisation (F: "with the standard Attention + FFN block, l2 needs a smaller initial variance of W_V, W_O").
At init the scores are near 0, so the weights of a row of ``n`` keys are near uniform and the output is
``(sum_j a_j) v`` for equal values (``||a||_2 std(v)`` for independent ones). Softmax gives ``sum_j a_j = 1``
(``||a||_2 = 1/sqrt(n)``); a normalizer whose output is ``r(n)`` times softmax's scales W_V and W_O each by
``r(n)^(-1/2)``, with ``n = max_positions`` (the longest row), so the attention output at full length starts at
softmax's scale. ``value_init_scale()`` gives that factor per normalizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest, BlockMask
from transformers import initialization as init

from .options import (
    ALONG_THE_SEQUENCE,
    NOT_SLICED_BY_RANK,
    RING_ATTENTION_ONLY,
    ULYSSES_KERNEL_ONLY,
    CatalogueEntry,
    Option,
)
from .position_interface import BACKENDS, AttentionDims, AttentionInputs, ForwardFacts, HeadSharded


OUTPUT_GATES = ("elementwise", "headwise")

GATE_OPTIONS = {
    "output_gate": Option(
        None,
        (str,),
        'gated attention, Y * sigmoid(X W_g) on each head\'s output: "elementwise" or "headwise"; None: no gate',
        lambda v: v in OUTPUT_GATES,
        '"elementwise" or "headwise"',
    ),
    "toeplitz_gate": Option(False, (bool,), "multiply the weights by a trainable Toeplitz gate g_h(clip(i - j))"),
    "toeplitz_max_distance": Option(
        128, (int,), "k of clip(i - j, -k, k) in the Toeplitz gate", lambda v: v >= 1, "an int >= 1"
    ),
}


class AttentionNormalizer(HeadSharded, CatalogueEntry, nn.Module):
    """Base class: ``forward(scores, attention_inputs) -> weights``, one module per attention layer.

    Subclasses write ``normalize`` (the formula). ``forward`` computes it in at least float32 and applies the option
    every normalizer takes, the Toeplitz gate (Luo et al. 2022, "Your Transformer May Not be as Powerful as You
    Expect"; F): ``a_ij <- a_ij c_ij`` with ``c_ij = g_h(clip(i - j, -k, k))`` (``clip(i - j, 0, k)`` in a
    decoder, where later keys are masked), ``k = toeplitz_max_distance``, ``g`` trainable per attention layer and per
    head, initialised to 1 so that a fresh gated model equals the ungated one. ``i`` and ``j`` are the position ids
    of the query and the key (cached keys keep theirs), so the gate is relative: shifting every position changes
    nothing. Parameter: ``toeplitz_gate`` ``(heads, 2k + 1)`` (encoder) or ``(heads, k + 1)`` (decoder), index
    ``k + d`` (encoder) or ``d`` (decoder) for the distance ``d``.

    And the option ``output_gate``, gated attention (Qiu et al., "Gated Attention for Large Language Models:
    Non-linearity, Sparsity, and Attention-Sink-Free", NeurIPS 2025, arXiv 2505.06708; Qwen3-Next): ``Y' = Y *
    sigmoid(X W_g)`` on each head's output ``Y`` before the output projection, ``X`` the layer's input.
    ``"elementwise"``: ``W_g`` ``(heads * head_dim, hidden)``, one gate per output feature; ``"headwise"``: ``(heads,
    hidden)``, one per head. The gate acts on the attention output, so every backend keeps its kernel
    (:meth:`attention_output`). Transformers' ``Qwen3NextAttention`` computes the elementwise gate inside ``q_proj``
    (``2 * head_dim`` rows per head, the second ``head_dim`` the gate of that head's output); here it is a projection
    of its own, ``output_gate`` (an ``nn.Linear`` without bias, as ``q_proj`` with ``attention_bias=False``), whose
    row ``h * head_dim + e`` is that ``q_proj`` row ``2 h head_dim + head_dim + e``, initialised as that ``q_proj``
    (and the paper's code, qiuzh20/gated_attention): ``N(0, initializer_range)``.

    ``layer_idx``: the attention layer (0-based) the normalizer serves, for formulas that depend on the depth
    (``differential``'s ``lambda_init``); a normalizer built on its own is layer 0.

    Args of ``forward``:
        scores: ``(batch, heads, q_len, kv_len)`` scores ``b_ij``, ``finfo.min`` on masked keys; every row has at
            least one visible key.
        attention_inputs: the per-forward :data:`AttentionInputs` (``"visible"`` keys, query and key positions).

    Class attributes:
        backends: attention backends that can compute it without materialising the weights (the gate narrows it
            to eager, see ``supported_backends``).
        flex_needs_lse: FlexAttention computes it from its log-sum-exp output (``flex_output``: every normalizer but
            softmax; softmax with a sink, ``needs_lse_on_flex``), which compiled FlexAttention on CPU does not return
            (torch 2.13), so on CPU it runs SDPA where it can (ssmax, a sink), else eager.
        value_parts: how many attentions with the same weights, on the values ``split_values`` gives, the layer's
            output combines (``attention_output``): 1, or 2 for ``differential``. With attention dropout in training
            such a normalizer runs eager, where the parts share one dropout mask.
        sdpa_in_query_chunks: no SDPA kernel computes it, and ``"sdpa"`` in ``backends`` means the attention runs the
            eager composition a chunk of queries at a time, each chunk checkpointed (``posenc_attention``'s
            ``attention_in_query_chunks``): only ``(batch, heads, chunk, kv_len)`` weights exist at a time and the
            backward recomputes them (stick_breaking).
        families: ``"encoder"`` and/or ``"decoder"``: where the normalizer has a form, checked when the config is
            built (``check_family``, as for the schemes); ``family_reason`` says why it lacks the other.
        pairs_head_halves: head ``h`` works with head ``h + heads / 2`` (differential): under tensor parallelism
            each rank holds a share of each half of the heads (q, k and v ``packed_colwise``), not a contiguous share.
    """

    options = GATE_OPTIONS
    backends: tuple[str, ...] = ("eager",)
    flex_needs_lse: bool = False
    value_parts: int = 1
    sdpa_in_query_chunks: bool = False
    pairs_head_halves: bool = False
    kind = "attention_normalizer"

    def __init_subclass__(cls, **kwargs):
        """Every normalizer takes the gate options beside its own."""
        super().__init_subclass__(**kwargs)
        cls.options = {**cls.options, **GATE_OPTIONS}

    def __init__(self, spec: dict[str, Any], dims: AttentionDims, layer_idx: int = 0):
        super().__init__()
        self.spec = spec
        self.dims = dims
        self.layer_idx = layer_idx
        self.max_distance = spec["toeplitz_max_distance"]
        if spec["toeplitz_gate"]:
            width = self.max_distance + 1 if dims.causal else 2 * self.max_distance + 1
            self.toeplitz_gate = nn.Parameter(torch.ones(dims.num_heads, width))
        else:
            self.toeplitz_gate = None
        if spec["output_gate"] is None:
            self.output_gate = None
        else:
            gates = dims.num_heads * (dims.head_dim if spec["output_gate"] == "elementwise" else 1)
            self.output_gate = nn.Linear(dims.hidden_size, gates, bias=False)

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {**super().describe(), "families": list(cls.families)}

    @classmethod
    def check_heads(cls, spec: dict[str, Any], num_heads: int) -> None:
        """Raise ``ValueError`` if the normalizer cannot run with ``num_heads`` attention heads; run when the config
        is built, and again when the model is."""

    @classmethod
    def parallelism_refusal(cls, spec: dict[str, Any], parallelism: str) -> str | None:
        """The gates first: the Toeplitz gate has a row per head and reads the weights at each query's distance to
        each key (under tensor parallelism each rank reads its heads' rows, as it reads the output gate's)."""
        refusal = super().parallelism_refusal(spec, parallelism)
        if spec["toeplitz_gate"] and parallelism == "sequence":
            return f"its Toeplitz gate: {NOT_SLICED_BY_RANK}"
        if spec["toeplitz_gate"] and parallelism == "context":
            return f"its Toeplitz gate reads the weights; {RING_ATTENTION_ONLY}"
        return refusal

    @classmethod
    def supported_backends(cls, spec: dict[str, Any]) -> tuple[str, ...]:
        """The backends that can run the normalizer with these options: the gate needs the weights (eager)."""
        return ("eager",) if spec["toeplitz_gate"] else cls.backends

    @classmethod
    def backend_refusals(cls, spec: dict[str, Any], facts: ForwardFacts) -> dict[str, str]:
        """The backends this normalizer refuses for a forward with ``facts`` (:class:`ForwardFacts`),
        each with the reason as a sentence: those its options do not run on (:meth:`supported_backends`: a weight
        no SDPA kernel computes, the Toeplitz gate's read of the weights); SDPA's fused kernel with a logit soft-cap,
        which it cannot apply to the scores it computes inside (the chunked composition of ``sdpa_in_query_chunks``
        caps them), and with attention dropout when the values are split in parts (one call per part would draw a
        dropout mask per part; eager shares one)."""
        supported = cls.supported_backends(spec)
        refusals = {}
        for backend in BACKENDS:
            if backend not in supported:
                what = "its Toeplitz gate reads the weights" if spec["toeplitz_gate"] else "no such kernel computes it"
                refusals[backend] = f"{cls.name} does not run on {backend} ({what})"
        if "sdpa" not in refusals and facts.logit_softcapping is not None and not cls.sdpa_in_query_chunks:
            refusals["sdpa"] = (
                "attn_logit_softcapping caps the scores before the normalizer; SDPA's kernel computes its scores "
                "inside and cannot cap them"
            )
        if "sdpa" not in refusals and facts.attention_dropout and cls.value_parts > 1:
            refusals["sdpa"] = "one SDPA call per value part would draw a dropout mask per part (eager shares one)"
        return refusals

    @classmethod
    def needs_lse_on_flex(cls, spec: dict[str, Any]) -> bool:
        """Whether ``flex_output`` reads FlexAttention's log-sum-exp with these options (``flex_needs_lse``)."""
        return cls.flex_needs_lse

    @classmethod
    def weights_are_softmax(cls, spec: dict[str, Any]) -> bool:
        """Whether the weights are ``softmax(b)`` of the scores as they are, which a scheme's value term reads on SDPA
        and FlexAttention (from SDPA's softmax, or the softmax's log-sum-exp); any other normalizer's value term runs
        eager."""
        return False

    def init_weights(self, initializer_range: float) -> None:
        """The normalizer's own parameters, through ``transformers.initialization`` (loaded weights are kept): the
        Toeplitz gate at 1, so that a fresh gated model equals the ungated one; the output gate's projection
        ``N(0, initializer_range)``, as Qwen3-Next's ``q_proj`` that holds it there."""
        if self.toeplitz_gate is not None:
            init.ones_(self.toeplitz_gate)
        if self.output_gate is not None:
            init.normal_(self.output_gate.weight, mean=0.0, std=initializer_range)

    def value_init_scale(self) -> float:
        """Factor on the initial std of W_V and W_O (1: the family's usual init); see the module docstring."""
        return 1.0

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.spec.items())

    def forward(self, scores: torch.Tensor, attention_inputs: AttentionInputs) -> torch.Tensor:
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        weights = self.normalize(scores, attention_inputs)
        if self.toeplitz_gate is not None:
            weights = weights * self.gate_values(
                attention_inputs["query_positions"], attention_inputs["key_positions"]
            )
        return weights

    def normalize(self, scores: torch.Tensor, attention_inputs: AttentionInputs) -> torch.Tensor:
        raise NotImplementedError

    def split_values(self, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The values ``(batch, kv_heads, kv_len, head_dim)`` the weights are applied to, one attention each
        (``value_parts`` of them): the value as it is."""
        return (value,)

    def combine_outputs(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """The heads' output ``(batch, heads, q_len, head_dim)`` from the attention of each of ``split_values``:
        the one output as it is."""
        return outputs[0]

    def output_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """The weights ``output_attentions`` returns, from the eager weights: as they are."""
        return weights

    def attention_output(self, outputs: list[torch.Tensor], hidden_states: torch.Tensor | None) -> torch.Tensor:
        """What the output projection reads, ``(batch, heads, q_len, head_dim)``: ``combine_outputs``, then the
        output gate ``sigmoid(X W_g)`` from the layer's input ``hidden_states`` ``(batch, q_len, hidden)``."""
        output = self.combine_outputs(outputs)
        if self.output_gate is None:
            return output
        if hidden_states is None:
            raise ValueError("output_gate reads the layer's input: pass hidden_states to positional_attention.")
        batch, _, q_len, _ = output.shape
        gate = torch.sigmoid(self.output_gate(hidden_states.to(self.output_gate.weight.dtype)))
        gate = gate.view(batch, q_len, self.model_num_heads, -1)  # this rank's heads under tensor parallelism:
        gate = self.heads_read(gate, dim=2).transpose(1, 2)  # (batch, heads, q_len, head_dim or 1)
        return output * gate.to(output.dtype)

    def gate_values(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """``c_ij`` ``(batch|1, heads, q_len, kv_len)`` from positions ``(batch|1, q_len)``, ``(batch|1, kv_len)``."""
        distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]
        if self.dims.causal:
            index = distance.clamp(0, self.max_distance)
        else:
            index = distance.clamp(-self.max_distance, self.max_distance) + self.max_distance
        heads = torch.arange(self.dims.num_heads, device=index.device)[None, :, None, None]
        return self.heads_read(self.toeplitz_gate)[heads, index]

    def flex_output(
        self,
        attend: Callable,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        score_mod: Callable | None,
        block_mask: BlockMask | None,
        scale: float,
    ) -> torch.Tensor:
        """The attention output ``(batch, heads, q_len, head_dim)`` on FlexAttention, for normalizers with
        ``"flex_attention"`` in ``backends``: softmax as it is.

        ``attend(query, key, value, score_mod=, block_mask=, scale=, pass_name=, **flex_kwargs)`` is FlexAttention
        through the kernel layer's compile cache (``posenc_attention.flex_attend``); ``pass_name`` names the pass
        when a normalizer makes several, each of which gets its own compiled function. ``score_mod`` is the scheme's
        position-only term or None; ``block_mask`` the mask or None (nothing masked)."""
        return attend(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale)

    def sdpa_arguments(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        attention_inputs: AttentionInputs,
        causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q, k, v and SDPA's ``attn_mask`` (None, boolean, or additive with every score term folded in) such that
        SDPA's softmax gives this normalizer's output, for normalizers with ``"sdpa"`` in ``backends``: softmax as
        they are. ``causal``: whether the layer is causal, which a None mask leaves to SDPA
        (:func:`implicit_last_keys`)."""
        return query, key, value, attn_mask


def implicit_last_keys(causal: bool, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """The last key each query sees when a layer gets no mask, ``(q_len,)``: key ``j`` is visible from query ``i``
    when ``j <= last_i``. A missing mask means what it means to Transformers, which builds it: ``masking_utils``
    leaves a causal mask out only where SDPA's ``is_causal`` is right (``_ignore_causal_mask_sdpa``: no padding and
    ``q_len == 1`` or ``q_len == kv_len``, or a prefill into an empty cache, whose ``kv_len`` is a static cache's
    ``max_cache_len`` and whose slots past the prompt are unwritten), and its SDPA integration runs ``is_causal``
    for a query of several tokens, which is top-left aligned (``last_i = i``), and no mask for a single one (every
    key). A bidirectional layer without a mask sees every key."""
    if causal and q_len > 1:
        return torch.arange(q_len, device=device)
    return torch.full((q_len,), kv_len - 1, device=device)


def implicit_visible(causal: bool, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``visible`` ``(q_len, kv_len)`` (boolean) of a layer with no mask (:func:`implicit_last_keys`)."""
    return torch.arange(kv_len, device=device) <= implicit_last_keys(causal, q_len, kv_len, device)[:, None]


def additive_mask(
    attn_mask: torch.Tensor | None, causal: bool, query: torch.Tensor, key: torch.Tensor
) -> torch.Tensor:
    """SDPA's ``attn_mask`` (None: no mask, :func:`implicit_last_keys`; boolean; or already additive) as an additive
    float mask in the query's dtype: ``finfo.min`` where a key is hidden, 0 elsewhere."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        return attn_mask
    if attn_mask is None:
        attn_mask = implicit_visible(causal, query.shape[-2], key.shape[-2], query.device)
    zeros = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
    return zeros.masked_fill(~attn_mask, torch.finfo(query.dtype).min)


def visible_key_counts(
    attention_inputs: AttentionInputs, q_len: int, kv_len: int, causal: bool, device: torch.device
) -> torch.Tensor:
    """``n_i``, the keys query ``i`` may see, ``(batch|1, 1, q_len, 1)`` float32, at least 1 (a row with no visible
    key is zeroed by the composition): from ``visible`` (eager, SDPA with a mask), else the keys up to
    :func:`implicit_last_keys` (no mask)."""
    visible = attention_inputs.get("visible")
    if visible is not None:
        return visible.sum(dim=-1, keepdim=True).clamp(min=1).to(torch.float32)
    counts = implicit_last_keys(causal, q_len, kv_len, device).to(torch.float32) + 1
    return counts[None, None, :, None]


def flex_pass(
    attend,
    query,
    key,
    value,
    score_mod,
    block_mask,
    scale,
    transform: Callable | None = None,
    pass_name: str | None = None,
):
    """One FlexAttention pass on the transformed scores ``s = t(b)`` (``b``: the scores with the scheme's
    ``score_mod``; ``t``: ``transform``, elementwise, or the identity): ``softmax(s) V`` and
    ``lse_i = log sum_j e^(s_ij)`` over the visible keys. A row where every ``s`` is ``-inf`` or no key is visible
    gets output 0 and ``lse = -inf`` (FlexAttention's rule for such rows). ``pass_name`` names the pass's compiled
    function (default: the transform's name, or ``"softmax"``)."""
    pass_score_mod = score_mod
    if transform is not None:

        def pass_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
            if score_mod is not None:
                score = score_mod(score, batch_idx, head_idx, q_idx, kv_idx)
            return transform(score)

    kwargs = dict(score_mod=pass_score_mod, block_mask=block_mask, scale=scale)
    kwargs["pass_name"] = pass_name or ("softmax" if transform is None else transform.__name__)
    output, aux = attend(query, key, value, return_aux=AuxRequest(lse=True), **kwargs)
    return output, aux.lse


LSE_ONLY_VALUE_WIDTH = 16
"""The value width of a pass read for its log-sum-exp only: the narrowest value head the Triton FlexAttention kernel
takes, so that such a pass makes no ``P V`` worth the name and, its value being a constant, no ``dV``."""


def lse_pass(attend, query, key, value, score_mod, block_mask, scale, transform: Callable) -> torch.Tensor:
    """``lse_i = log sum_j e^(t(b_ij))`` over the visible keys, as :func:`flex_pass`, from a pass on a zero value of
    :data:`LSE_ONLY_VALUE_WIDTH` (the value heads' count kept, for grouped-query attention): the log-sum-exp does not
    depend on the values, so it equals the full pass's, gradients included, at a fraction of its cost."""
    zeros = value.new_zeros(*value.shape[:-1], LSE_ONLY_VALUE_WIDTH)
    return flex_pass(attend, query, key, zeros, score_mod, block_mask, scale, transform)[1]


def stacked_flex_passes(attend, query, key, value, score_mod, block_mask, scale, transform: Callable, parts: int):
    """``parts`` passes of :func:`flex_pass` that share q, k and v, in one FlexAttention call: each query head is
    repeated ``parts`` times (stacked head ``s`` is head ``s // parts``, part ``s % parts``) over the same keys and
    values (grouped-query attention, ``parts`` times as many query heads per key head), the scheme's ``score_mod``
    sees the head ``s // parts``, and ``transform(score, part)`` gives each part its scores. Returns each part's
    output and log-sum-exp, as separate passes would. A ``BlockMask`` with one head per query head (Transformers'
    masks have one for all) would need repeating: then the parts run as separate passes."""
    if block_mask is not None and block_mask.kv_num_blocks.shape[1] != 1:
        return [
            flex_pass(
                attend,
                query,
                key,
                value,
                score_mod,
                block_mask,
                scale,
                partial(transform, part=part),
                pass_name=f"{transform.__name__}_{part}",
            )
            for part in range(parts)
        ]

    def stacked_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        if score_mod is not None:
            score = score_mod(score, batch_idx, head_idx // parts, q_idx, kv_idx)
        return transform(score, head_idx % parts)

    stacked = query.repeat_interleave(parts, dim=1)
    output, aux = attend(
        stacked,
        key,
        value,
        score_mod=stacked_score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=True,
        return_aux=AuxRequest(lse=True),
        pass_name=transform.__name__,
    )
    return [(output[:, part::parts], aux.lse[:, part::parts]) for part in range(parts)]


def _visible_key_count_lse(attend, query: torch.Tensor, key: torch.Tensor, block_mask: BlockMask | None):
    """``log n_i``, ``n_i`` the number of keys query ``i`` may see, ``(batch, heads|1, q_len)``: the log-sum-exp of
    a FlexAttention pass of zero scores under the mask (``-inf`` where no key is visible), on zero q, k, v of width 16
    and the mask's own head count (1 for Transformers' masks), so that it costs a fraction of a pass."""
    if block_mask is None:
        return torch.full(query.shape[:-1], key.shape[-2], dtype=torch.float32, device=query.device).log()
    heads = block_mask.kv_num_blocks.shape[1]
    # Three distinct tensors: an aliased key and value would be another compiled graph.
    zeros = [tensor.new_zeros(tensor.shape[0], heads, tensor.shape[2], 16) for tensor in (query, key, key)]
    kwargs = dict(score_mod=None, block_mask=block_mask, scale=1.0, pass_name="visible_keys")
    return attend(*zeros, return_aux=AuxRequest(lse=True), **kwargs)[1].lse


def _double(score: torch.Tensor) -> torch.Tensor:
    """``2 b``: ``lse(2b) = log sum_j e^(2 b_ij)``, the squared l2 norm of ``e^b`` in log space."""
    return 2 * score


def _log_where(condition: torch.Tensor, log_value: Callable, value: torch.Tensor, safe: float) -> torch.Tensor:
    """``log_value(value)`` where ``condition``, ``-inf`` elsewhere; ``log_value`` only ever sees values where it is
    finite (``safe`` elsewhere), so the gradient there is 0, whatever arrives (never ``0 * inf``)."""
    return torch.where(condition, log_value(torch.where(condition, value, safe)), -math.inf)


def _log_relu_squared(score: torch.Tensor) -> torch.Tensor:
    """``log relu(b)^2 = 2 log b`` for ``b > 0``, ``-inf`` (weight 0) for ``b <= 0``."""
    return _log_where(score > 0, lambda b: 2 * torch.log(b), score, 1.0)


def _log_swish_part(score: torch.Tensor, part: int | torch.Tensor) -> torch.Tensor:
    """``log |swish(b)| = log |b| + log sigmoid(b)`` where ``b`` has the part's sign (part 0: ``b > 0``, where swish
    > 0; part 1: ``b < 0``, where swish < 0), ``-inf`` elsewhere; exact where float32 ``swish`` itself underflows
    (``b`` below about -100). ``part`` may be a tensor (a stacked head's part, :func:`stacked_flex_passes`)."""
    in_part = score * (1 - 2 * part) > 0
    return _log_where(in_part, lambda b: torch.log(b.abs()) + nn.functional.logsigmoid(b), score, 1.0)


def _log_swish_squared(score: torch.Tensor) -> torch.Tensor:
    """``log swish(b)^2 = 2 (log |b| + log sigmoid(b))``, ``-inf`` at ``b = 0``."""
    return _log_where(score != 0, lambda b: 2 * (torch.log(b.abs()) + nn.functional.logsigmoid(b)), score, 1.0)


def _row_factor(log_factor: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(log_factor)`` as ``(batch, heads, q_len, 1)``, 0 on rows with no visible key (``lse = -inf``); the
    infinities are replaced before ``exp`` so that no NaN reaches the gradients."""
    has_key = torch.isfinite(lse)
    factor = torch.exp(torch.where(has_key, log_factor, 0.0))
    return torch.where(has_key, factor, 0.0)[..., None]


def _valid_sink(value: Any) -> bool:
    return value == "learned" or (not isinstance(value, str) and math.isfinite(value))


class Softmax(AttentionNormalizer):
    """``a_ij = e^(b_ij) / sum_j e^(b_ij)``: rows sum to 1 (the l1 normalisation behind the flaw in F).

    Option ``sink``: a logit ``c_h`` every row also normalises over, with no value attached, ``a_ij = e^(b_ij) /
    (e^(c_h) + sum_j e^(b_ij))``, so rows sum to ``1 - sigmoid(c_h - lse_i) < 1`` (``lse_i = log sum_j e^(b_ij)``):
    ``"learned"``, one trainable logit per head and layer, as gpt-oss's attention sinks (OpenAI 2025; Transformers'
    ``GptOssAttention.sinks``, initialised ``N(0, initializer_range)`` as Transformers' ``GptOssPreTrainedModel``
    does); or a number, a fixed logit (``0.0``: Miller's softmax-plus-one, "Attention is off by one", 2023).
    Eager appends the sink as a column to the scores; SDPA appends it as a key of zeros with a zero value whose
    logit the additive mask holds (one ``(batch|1, heads, q, k + 1)`` mask per layer, differentiated into a learned
    sink); FlexAttention from its log-sum-exp, ``O = softmax(b) V sigmoid(lse - c_h)``. W_V, W_O init unchanged.
    """

    name = "softmax"
    parallel_refusals = {}
    description = (
        "e^b / sum_j e^b (rows sum to 1); sink: e^b / (e^c + sum_j e^b), c learned per head or fixed (rows sum "
        "to less than 1); W_V, W_O init unchanged"
    )
    options = {
        "sink": Option(
            None,
            (str, float, int),
            'a logit in every row\'s denominator with no value: "learned" (per head and layer, gpt-oss) or a number '
            "(0.0: softmax-plus-one); None: no sink",
            _valid_sink,
            '"learned" or a finite number',
        ),
    }
    backends = BACKENDS

    def __init__(self, spec: dict[str, Any], dims: AttentionDims, layer_idx: int = 0):
        super().__init__(spec, dims, layer_idx)
        learned = spec["sink"] == "learned"
        self.sink = nn.Parameter(torch.zeros(dims.num_heads)) if learned else None
        self.fixed_sink = None if learned or spec["sink"] is None else float(spec["sink"])

    @classmethod
    def needs_lse_on_flex(cls, spec: dict[str, Any]) -> bool:
        return spec["sink"] is not None

    @classmethod
    def weights_are_softmax(cls, spec: dict[str, Any]) -> bool:
        return spec["sink"] is None and not spec["toeplitz_gate"]

    def init_weights(self, initializer_range: float) -> None:
        super().init_weights(initializer_range)
        if self.sink is not None:
            init.normal_(self.sink, mean=0.0, std=initializer_range)

    @classmethod
    def parallelism_refusal(cls, spec: dict[str, Any], parallelism: str) -> str | None:
        """Plain softmax runs under every parallelism; its sink, a logit per head appended to every row, under tensor
        parallelism too (each rank reads its heads' logits), not under the others."""
        if spec["sink"] is None or parallelism == "tensor":
            return super().parallelism_refusal(spec, parallelism)
        if parallelism == "context":
            return f"its sink is a column of every row's normalisation; {RING_ATTENTION_ONLY}"
        return f"its sink: {NOT_SLICED_BY_RANK}"

    def sink_logits(self, device: torch.device) -> torch.Tensor | None:
        """``c_h`` ``(heads,)`` in float32 (this rank's heads under tensor parallelism), or None without a sink."""
        if self.sink is not None:
            sink = self.heads_read(self.sink)
            return sink.to(torch.promote_types(sink.dtype, torch.float32))
        if self.fixed_sink is not None:
            return torch.full((self.dims.num_heads,), self.fixed_sink, device=device)
        return None

    def normalize(self, scores, attention_inputs):
        sink = self.sink_logits(scores.device)
        if sink is None:
            return torch.softmax(scores, dim=-1)
        column = sink.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]

    def flex_output(self, attend, query, key, value, score_mod, block_mask, scale):
        sink = self.sink_logits(query.device)
        if sink is None:
            return attend(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale)
        output, lse = flex_pass(attend, query, key, value, score_mod, block_mask, scale)
        has_key = torch.isfinite(lse)
        kept = torch.sigmoid(torch.where(has_key, lse, 0.0) - sink[:, None])  # the mass the sink leaves the keys
        return output * torch.where(has_key, kept, 0.0)[..., None].to(output.dtype)

    def sdpa_arguments(self, query, key, value, attn_mask, attention_inputs, causal):
        sink = self.sink_logits(query.device)
        if sink is None:
            return query, key, value, attn_mask
        batch, heads, q_len, _ = query.shape
        mask = additive_mask(attn_mask, causal, query, key)
        mask = mask.expand(mask.shape[0] if mask.dim() == 4 else 1, heads, q_len, key.shape[-2])
        column = sink.to(mask.dtype)[None, :, None, None].expand(mask.shape[0], heads, q_len, 1)
        # the zero key and value per key/value head (grouped-query attention keeps fewer of them)
        key = torch.cat([key, key.new_zeros(*key.shape[:2], 1, key.shape[-1])], dim=-2)
        value = torch.cat([value, value.new_zeros(*value.shape[:2], 1, value.shape[-1])], dim=-2)
        return query, key, value, torch.cat([mask, column], dim=-1)


class L2(AttentionNormalizer):
    """``a_ij = e^(b_ij) / sqrt(sum_j e^(2 b_ij))``: each row has unit l2 norm, its sum is free in ``[1, sqrt(n)]``
    (F, "new normalisation").

    Computed as ``e^(b - m) / ||e^(b - m)||_2`` with ``m`` the row max, the same ratio without overflow, for any
    finite scores. Init: a uniform row of ``n`` keys sums to ``sqrt(n)`` (softmax: 1), so W_V and W_O are scaled by
    ``max_positions^(-1/4)``. FlexAttention (where it returns the log-sum-exp): ``O = softmax(b) V
    exp(lse(b) - lse(2b) / 2)``, ``lse(2b)`` from a pass on a narrow zero value (:func:`lse_pass`).
    """

    name = "l2"
    parallel_refusals = {"context": f"l2 is not softmax; {RING_ATTENTION_ONLY}", "sequence": ULYSSES_KERNEL_ONLY}
    description = "e^b / sqrt(sum_j e^(2b)) (rows have unit l2 norm); W_V, W_O init x max_positions^(-1/4)"
    backends = ("eager", "flex_attention")
    flex_needs_lse = True

    def value_init_scale(self) -> float:
        return self.dims.max_positions**-0.25

    def normalize(self, scores, attention_inputs):
        # The row max is a constant shift the ratio does not see (its gradient is 0): detached, so that autograd does
        # not keep the (q, k) scores for it. Masked keys: exp(min - max) = 0 exactly.
        exp = torch.exp(scores - scores.amax(dim=-1, keepdim=True).detach())
        return exp / torch.linalg.vector_norm(exp, dim=-1, keepdim=True)  # >= 1: the row max contributes e^0

    def flex_output(self, attend, query, key, value, score_mod, block_mask, scale):
        output, lse = flex_pass(attend, query, key, value, score_mod, block_mask, scale)
        lse_double = lse_pass(attend, query, key, value, score_mod, block_mask, scale, _double)
        return output * _row_factor(lse - lse_double / 2, lse).to(output.dtype)


EXP_RANGE = "the largest visible score of a row must stay below log(finfo.max): 88.72 in float32, 709.78 in float64"


class Exp(AttentionNormalizer):
    """``a_ij = e^(b_ij)``, no denominator (F, "drop the denominator"): the row sum is free.

    Range: ``e^b`` overflows float32 (the eager weights' dtype for float32, bfloat16 and float16 models) above
    ``b = 88.72``; an eager forward whose scores reach it raises ``OverflowError`` naming the value (outside
    ``torch.compile``, where the check would break the graph, and on FlexAttention, where it would sync the host once
    per layer: there the overflow shows as inf). Nothing is clipped. An eager float16 model casts the weights to
    float16 before the value product, whose largest finite value is e^11.09; FlexAttention applies ``e^lse`` in
    float32.
    Init: near-zero scores give weights near 1, a row of ``n`` keys sums to ``n`` (softmax: 1), so W_V and W_O are
    scaled by ``max_positions^(-1/2)``. FlexAttention (where it returns the log-sum-exp): ``O = softmax(b) V
    exp(lse(b))``.
    """

    name = "exp"
    parallel_refusals = {"context": f"exp is not softmax; {RING_ATTENTION_ONLY}", "sequence": ULYSSES_KERNEL_ONLY}
    description = (
        "e^b, no denominator (raises OverflowError past b = 88.7 in float32); W_V, W_O init x max_positions^(-1/2)"
    )
    backends = ("eager", "flex_attention")
    flex_needs_lse = True

    def value_init_scale(self) -> float:
        return self.dims.max_positions**-0.5

    def normalize(self, scores, attention_inputs):
        if not torch.compiler.is_compiling():
            _check_exp_range(scores, scores.dtype)
        return torch.exp(scores)  # masked keys: exp(finfo.min) = 0 exactly

    def flex_output(self, attend, query, key, value, score_mod, block_mask, scale):
        output, lse = flex_pass(attend, query, key, value, score_mod, block_mask, scale)
        # e^lse applied in at least float32, so a float16 output overflows only where O itself passes 65504, not where
        # e^lse does (lse > 11.09); no range check here: it would sync the host once per layer (an overflow shows inf)
        wide = torch.promote_types(output.dtype, torch.float32)
        return (output.to(wide) * _row_factor(lse, lse).to(wide)).to(output.dtype)


def _check_exp_range(values: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise ``OverflowError`` if ``e^x`` of the largest of ``values`` (scores or row log-sum-exps) is not finite in
    ``dtype``."""
    largest = values.max().item()
    if largest > math.log(torch.finfo(dtype).max):
        raise OverflowError(
            f"attention_normalizer 'exp': a score of {largest:.4g} gives e^b = inf in {dtype}; {EXP_RANGE}. Use a "
            "smaller initialisation or learning rate, or the 'l2' normalizer (the same weights up to a per-row scale)."
        )


class ReLU2(AttentionNormalizer):
    """``a_ij = relu(b_ij)^2 / n_i``, ``n_i`` the number of keys query ``i`` may see (Hua et al. 2022, GAU; F, "drop
    the denominator").

    ``n_i`` counts the visible keys of the row (padding and, in a decoder, causality excluded; ``kv_len`` when
    nothing is masked). Masked keys have ``b = finfo.min``, so ``relu`` gives them exactly 0. Init: near-zero scores
    give rows summing to ``E[relu(b)^2] <= Var(b)``, below softmax's 1, so F's smaller W_V/W_O init does not apply:
    factor 1. FlexAttention (where it returns the log-sum-exp), after attention-gym's activation mods: with
    ``s = 2 log relu(b)`` (``-inf`` for ``b <= 0``), ``softmax(s)_ij = relu(b_ij)^2 / sum_j relu(b_ij)^2``, so
    ``O = softmax(s) V exp(lse(s) - log n_i)``, ``log n_i`` from a pass of zero scores on zero q, k of width 16 under
    the mask (a row with no positive score has ``lse = -inf`` and output 0). Exact, gradients included: the weight
    and its derivative are both 0 at ``b = 0``.
    """

    name = "relu2"
    parallel_refusals = {"context": f"relu2 is not softmax; {RING_ATTENTION_ONLY}", "sequence": ULYSSES_KERNEL_ONLY}
    description = "relu(b)^2 / n, n the visible keys of the row (GAU); W_V, W_O init unchanged"
    backends = ("eager", "flex_attention")
    flex_needs_lse = True

    def normalize(self, scores, attention_inputs):
        visible = attention_inputs["visible"]
        if visible is None:
            count = scores.shape[-1]
        else:  # a row with no visible key attends everywhere and is zeroed by the composition: count it as 1
            count = visible.sum(dim=-1, keepdim=True).clamp(min=1).to(scores.dtype)
        return torch.relu(scores).square() / count

    def flex_output(self, attend, query, key, value, score_mod, block_mask, scale):
        output, lse = flex_pass(attend, query, key, value, score_mod, block_mask, scale, _log_relu_squared)
        count_lse = _visible_key_count_lse(attend, query, key, block_mask)
        return output * _row_factor(lse - count_lse, lse).to(output.dtype)


class SwishL2(AttentionNormalizer):
    """``a_ij = swish(b_ij) / sqrt(sum_j swish(b_ij)^2)``, ``swish(b) = b sigmoid(b)`` (F, "swish + l2"): unit l2
    norm, signed weights.

    Masked keys: ``swish(finfo.min) = 0`` exactly. Range: ``swish(b)`` underflows to 0 for ``b`` below about -100 in
    float32 (and loses precision below about -87); a row whose swish values are all 0 gets weights 0 (never 0/0).
    Init: like ``l2`` the row has unit l2 norm (sum up to ``sqrt(n)`` for equal scores), so W_V and W_O are scaled by
    ``max_positions^(-1/4)``. FlexAttention (where it returns the log-sum-exp): three passes on the log of the
    weight's magnitude, ``s+ = log swish(b)`` where ``b > 0``, ``s- = log(-swish(b))`` where ``b < 0``
    (``log |b| + log sigmoid(b)``, ``-inf`` elsewhere) and ``s2 = 2 log |swish(b)|``:
    ``O = softmax(s+) V exp(lse(s+) - lse(s2)/2) - softmax(s-) V exp(lse(s-) - lse(s2)/2)``, combined in at least
    float32; the first two in one call (:func:`stacked_flex_passes`), ``lse(s2)`` on a narrow zero value
    (:func:`lse_pass`). The values equal eager's; the gradient differs only at a score of exactly 0 (or so close to
    it that ``e^s`` underflows, about 1e-38 of the row's weights in float32), where eager's ``d swish / d b = 1/2``
    reaches the weight and the log form gives 0: a weight that crosses zero has no logarithm there.
    """

    name = "swish_l2"
    parallel_refusals = {"context": f"swish_l2 is not softmax; {RING_ATTENTION_ONLY}", "sequence": ULYSSES_KERNEL_ONLY}
    description = "swish(b) / sqrt(sum_j swish(b)^2) (signed, unit l2 norm); W_V, W_O init x max_positions^(-1/4)"
    backends = ("eager", "flex_attention")
    flex_needs_lse = True

    def value_init_scale(self) -> float:
        return self.dims.max_positions**-0.25

    def normalize(self, scores, attention_inputs):
        swish = nn.functional.silu(scores)
        norm = torch.linalg.vector_norm(swish, dim=-1, keepdim=True)
        return swish / torch.where(norm > 0, norm, 1.0)

    def flex_output(self, attend, query, key, value, score_mod, block_mask, scale):
        parts = stacked_flex_passes(attend, query, key, value, score_mod, block_mask, scale, _log_swish_part, 2)
        (positive, lse_positive), (negative, lse_negative) = parts
        half_norm = lse_pass(attend, query, key, value, score_mod, block_mask, scale, _log_swish_squared) / 2
        dtype = torch.promote_types(positive.dtype, torch.float32)  # the difference of two parts: at least float32
        output = positive.to(dtype) * _row_factor(lse_positive - half_norm, lse_positive)
        output = output - negative.to(dtype) * _row_factor(lse_negative - half_norm, lse_negative)
        return output.to(positive.dtype)


def _finite(value: Any) -> bool:
    return math.isfinite(value)


class Sigmoid(AttentionNormalizer):
    """``a_ij = sigmoid(b_ij + beta)``, no row normalisation (Ramapuram et al., "Theory, Analysis, and Best Practices
    for Sigmoid Self-Attention", ICLR 2025, arXiv 2409.04431).

    The paper's bias is ``beta = -log n`` with ``n`` the sequence length the model is trained at; here ``n`` is the
    config's ``max_position_embeddings`` (option ``bias``, None, the default) or ``bias`` gives ``beta`` itself
    (e.g. ``-log`` of a shorter training length). A row of ``n_i`` keys sums to anything in ``(0, n_i)``. Masked keys:
    ``sigmoid(finfo.min + beta) = 0`` exactly. Init: near-zero scores give rows summing to ``n sigmoid(beta)``, which
    is ``n / (n + 1) < 1`` with the default ``beta`` (softmax: 1), so W_V and W_O keep the usual init (factor 1); a
    ``bias`` that makes ``n sigmoid(beta) > 1`` scales them by ``(n sigmoid(beta))^(-1/2)``. FlexAttention (where it
    returns the log-sum-exp), the log-offset form of attention-gym's activation mods: with ``s = log sigmoid(b +
    beta)``, ``O = softmax(s) V exp(lse(s))``, one pass.
    """

    name = "sigmoid"
    parallel_refusals = {"context": f"sigmoid is not softmax; {RING_ATTENTION_ONLY}", "sequence": ULYSSES_KERNEL_ONLY}
    description = "sigmoid(b + beta), beta = -log(max_position_embeddings) or option bias (no row normalisation)"
    options = {
        "bias": Option(
            None, (float, int), "beta in sigmoid(b + beta); None: -log(max_position_embeddings)", _finite, "finite"
        ),
    }
    backends = ("eager", "flex_attention")
    flex_needs_lse = True

    def __init__(self, spec: dict[str, Any], dims: AttentionDims, layer_idx: int = 0):
        super().__init__(spec, dims, layer_idx)
        self.logit_bias = -math.log(dims.max_positions) if spec["bias"] is None else spec["bias"]

    def value_init_scale(self) -> float:
        row_sum = self.dims.max_positions / (1.0 + math.exp(-self.logit_bias))
        return row_sum**-0.5 if row_sum > 1.0 else 1.0

    def normalize(self, scores, attention_inputs):
        return torch.sigmoid(scores + self.logit_bias)

    def flex_output(self, attend, query, key, value, score_mod, block_mask, scale):
        logit_bias = self.logit_bias

        def log_sigmoid(score):
            return nn.functional.logsigmoid(score + logit_bias)

        output, lse = flex_pass(attend, query, key, value, score_mod, block_mask, scale, log_sigmoid)
        return output * _row_factor(lse, lse).to(output.dtype)


class ScalableSoftmax(AttentionNormalizer):
    """Scalable-Softmax, ``a_ij = softmax_j(s_h log(n_i) b_ij)`` (Nakanishi, "Scalable-Softmax Is Superior for
    Attention", 2025, arXiv 2501.19399): ``s_h`` a learned scalar per head and layer, ``n_i`` the number of keys
    query ``i`` sees (a decoder's query ``i`` sees ``i + 1``; cached keys count, padding and other masked keys do not).

    The factor multiplies the whole score, position terms included (the formula's ``z_i``). ``s_h`` starts at
    ``initial_scale`` (0.43, the value of the paper's Figure 1 and of the unofficial implementation
    gdevos/Scalable-Softmax; the paper's text does not state its init). Rows sum to 1 (softmax's law, so with identical
    tokens it cannot locate positions: equal scores times any factor stay equal); W_V, W_O init unchanged. A row that
    sees one key has ``log n_i = 0`` and gives that key weight 1. Llama 4's attention temperature tuning (Transformers'
    ``Llama4TextAttention``) is a relative: it multiplies the queries of its NoPE layers by ``1 + 0.1
    log(1 + floor((p_i + 1) / 8192))``, a fixed function of the query's position ``p_i`` (not of the keys it sees,
    not learned, 1 below 8192 tokens) that leaves the scores' scale unchanged at training lengths, where SSMax rescales
    every row by its own ``log n_i`` from the start.

    SDPA: the queries times ``s_h log n_i``, and an additive mask's finite entries (position biases, content terms)
    times the same factor. FlexAttention (where it returns the log-sum-exp, for ``log n_i``: a pass of zero scores
    on zero q, k of width 16 under the mask, as relu2): without a ``score_mod`` the factor is folded into q; with one,
    the ``score_mod`` is multiplied by a ``(batch, heads, q)`` table read at the query (no scalar read per score).
    """

    name = "ssmax"
    parallel_refusals = {
        "context": f"ssmax scales by log n, n the keys a rank sees; {RING_ATTENTION_ONLY}",
        "sequence": ULYSSES_KERNEL_ONLY,
    }
    description = (
        "softmax(s_h log(n_i) b), s_h learned per head and layer, n_i the keys row i sees; W_V, W_O init unchanged"
    )
    options = {
        "initial_scale": Option(0.43, (float, int), "the initial value of s_h", _finite, "finite"),
    }
    backends = BACKENDS
    flex_needs_lse = True

    def __init__(self, spec: dict[str, Any], dims: AttentionDims, layer_idx: int = 0):
        super().__init__(spec, dims, layer_idx)
        self.scale = nn.Parameter(torch.full((dims.num_heads,), float(spec["initial_scale"])))

    def init_weights(self, initializer_range: float) -> None:
        super().init_weights(initializer_range)
        init.constant_(self.scale, float(self.spec["initial_scale"]))

    def row_factors(self, log_counts: torch.Tensor) -> torch.Tensor:
        """``s_h log n_i`` ``(batch|1, heads, q_len, 1)`` from ``log n_i`` ``(batch|1, 1, q_len, 1)``, in at least
        float32."""
        dtype = torch.promote_types(log_counts.dtype, torch.float32)
        return self.heads_read(self.scale).to(dtype)[:, None, None] * log_counts.to(dtype)

    def normalize(self, scores, attention_inputs):
        counts = visible_key_counts(attention_inputs, *scores.shape[-2:], self.dims.causal, scores.device)
        scaled = scores * self.row_factors(counts.to(scores.dtype).log())
        visible = attention_inputs.get("visible")
        if visible is not None:  # the factor may be 0 (one key) or negative: masked keys are masked again
            scaled = scaled.masked_fill(~visible, torch.finfo(scaled.dtype).min)
        return torch.softmax(scaled, dim=-1)

    def sdpa_arguments(self, query, key, value, attn_mask, attention_inputs, causal):
        counts = visible_key_counts(attention_inputs, query.shape[-2], key.shape[-2], causal, query.device)
        factors = self.row_factors(counts.log())
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            masked = attn_mask <= torch.finfo(attn_mask.dtype).min / 2
            attn_mask = torch.where(masked, attn_mask, attn_mask * factors.to(attn_mask.dtype))
        return query * factors.to(query.dtype), key, value, attn_mask

    def flex_output(self, attend, query, key, value, score_mod, block_mask, scale):
        log_counts = _visible_key_count_lse(attend, query, key, block_mask)
        log_counts = torch.where(torch.isfinite(log_counts), log_counts, 0.0)  # rows with no key: output 0 anyway
        # (batch, heads, q_len), a tensor of its own: FlexAttention gives a captured view no gradient
        table = self.row_factors(log_counts[..., None]).squeeze(-1).expand(*query.shape[:-1]).clone()
        if score_mod is None:
            return attend(query * table[..., None].to(query.dtype), key, value, block_mask=block_mask, scale=scale)

        def scaled_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
            return score_mod(score, batch_idx, head_idx, q_idx, kv_idx) * table[batch_idx, head_idx, q_idx]

        return attend(query, key, value, score_mod=scaled_score_mod, block_mask=block_mask, scale=scale)


def _log_positive_expm1(score: torch.Tensor) -> torch.Tensor:
    """``log(e^b - 1) = b + log(1 - e^(-b))`` for ``b > 0``, ``-inf`` elsewhere (softpick's numerator)."""
    return _log_where(score > 0, lambda b: b + torch.log(-torch.expm1(-b)), score, 1.0)


def _log_abs_expm1(score: torch.Tensor) -> torch.Tensor:
    """``log |e^b - 1| = relu(b) + log(1 - e^(-|b|))``, ``-inf`` at ``b = 0`` (softpick's denominator)."""
    return _log_where(score != 0, lambda b: torch.relu(b) + torch.log(-torch.expm1(-b.abs())), score, 1.0)


def _positive(value: Any) -> bool:
    return math.isfinite(value) and value > 0


def _shifted_expm1(scores: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``e^(-m) (e^b - 1)`` for ``m >= max(0, b)``, in ``[-1, 1]``, to the precision of ``expm1``: ``e^(b - m) (1 -
    e^(-b))`` for ``b > 0``, ``e^(-m) (e^b - 1)`` for ``b <= 0`` (the difference ``e^(b - m) - e^(-m)`` loses every
    digit of a score near 0, where FlexAttention's log form keeps them). Each branch sees the scores clamped to its
    side, so neither overflows and no ``0 * inf`` reaches the gradient."""
    positive, negative = scores.clamp(min=0), scores.clamp(max=0)
    return -torch.exp(positive - shift) * torch.expm1(-positive) + torch.exp(-shift) * torch.expm1(negative)


class Softpick(AttentionNormalizer):
    """``a_ij = relu(e^(b_ij) - 1) / (sum_j |e^(b_ij) - 1| + eps)`` over the visible keys (Zuhri, Fuadi, Aji,
    "Softpick: No Attention Sink, No Massive Activations with Rectified Softmax", 2025, arXiv 2504.20966): rows sum
    to less than 1, and to 0 when no score is positive.

    ``eps`` (option, default 1e-8) is the reference's (``zaydzuhri/softpick-attention``: ``softpick(x, eps=1e-8)`` in
    ``naive_softpick_attn.py``; its Triton kernel, ``flash_softpick_attn.py``, hardcodes 1e-6: set ``eps=1e-6`` to
    match that). It decides the weights of rows whose scores are all near 0: with ``sum_j |e^b - 1|`` near ``eps``
    (scores around 1e-9) a row sums to well below what the ratio without it gives, and a row of exact zeros gives 0.
    The reference adds ``eps`` to the sum shifted by the row max ``m`` (``e^(-m) sum_j |e^b - 1|``), so its ``eps``
    stands for ``eps e^m`` here; the two are equal as ``m`` goes to 0, where ``eps`` matters, and otherwise differ by
    less than ``eps`` relative in any weight (the sum is at least ``e^m - 1``). Added to the unshifted sum, it is the
    same on every backend: FlexAttention has no row max on CPU.

    Computed in the paper's shifted form, numerator and denominator times ``e^(-m)``: ``relu(e^(b - m) - e^(-m)) /
    (sum_j |e^(b - m) - e^(-m)| + eps e^(-m))``, here with ``m = max(0, max_j b_ij)`` (the paper: the row max, whose
    ``e^(-m)`` overflows for a row of scores below -88), so nothing exceeds 1, each ``e^(b - m) - e^(-m)`` through
    ``expm1`` (:func:`_shifted_expm1`; the reference's difference rounds scores near 0 away in float32). Masked keys
    are left out of both sums (the reference zeroes the non-finite ones). Init: near-zero scores give ``relu(b) /
    sum |b|``, rows summing to at most 1, so W_V and W_O keep the usual init. FlexAttention (where it returns the
    log-sum-exp), two passes of the log-offset form: ``s+ = log(e^b - 1)`` where ``b > 0`` (``-inf`` elsewhere) and
    ``s| = log |e^b - 1|``, ``O = softmax(s+) V exp(lse(s+) - log(e^lse(s|) + eps))`` (``lse(s|)`` on a narrow zero
    value, :func:`lse_pass`); the gradient at a score of exactly 0 is 0 on both paths.
    """

    name = "softpick"
    parallel_refusals = {"context": f"softpick is not softmax; {RING_ATTENTION_ONLY}", "sequence": ULYSSES_KERNEL_ONLY}
    description = (
        "relu(e^b - 1) / (sum_j |e^b - 1| + eps) (rows sum to less than 1, may be all 0); W_V, W_O init unchanged"
    )
    options = {
        "eps": Option(
            1e-8,
            (float, int),
            "added to the denominator (the reference's softpick(); its Triton kernel uses 1e-6)",
            _positive,
            "a finite number > 0",
        ),
    }
    backends = ("eager", "flex_attention")
    flex_needs_lse = True

    def normalize(self, scores, attention_inputs):
        shift = scores.amax(dim=-1, keepdim=True).clamp(min=0).detach()  # the ratio does not see it
        centred = _shifted_expm1(scores, shift)
        visible = attention_inputs.get("visible")
        if visible is not None:
            centred = centred.masked_fill(~visible, 0.0)
        total = centred.abs().sum(dim=-1, keepdim=True) + self.spec["eps"] * torch.exp(-shift)
        return torch.relu(centred) / total

    def flex_output(self, attend, query, key, value, score_mod, block_mask, scale):
        output, lse_positive = flex_pass(attend, query, key, value, score_mod, block_mask, scale, _log_positive_expm1)
        lse_total = lse_pass(attend, query, key, value, score_mod, block_mask, scale, _log_abs_expm1)
        log_denominator = torch.logaddexp(lse_total, torch.full_like(lse_total, math.log(self.spec["eps"])))
        return output * _row_factor(lse_positive - log_denominator, lse_positive).to(output.dtype)


class StickBreaking(AttentionNormalizer):
    """``a_ij = sigmoid(b_ij) prod_{j<k<i} (1 - sigmoid(b_ik))`` over the keys before the query (Tan, Shen, Yang,
    Courville, Panda, "Scaling Stick-Breaking Attention", ICLR 2025, arXiv 2410.17980): the nearest key takes its
    share ``sigmoid(b)`` of a unit stick, the next one its share of what is left, and so on outward; rows sum to
    ``1 - prod_j (1 - sigmoid(b_ij)) < 1``, and a row with no earlier key gives 0. Causal by construction: decoders
    only.

    In log space, as the reference (``shawntan/stickbreaking-attention``, ``sb_ref.py`` and its Triton kernels):
    ``log a_ij = logsigmoid(b_ij) + sum_{j<k<i} logsigmoid(-b_ik)``, the sum a reverse cumulative sum along the keys
    in at least float32. Keys: those the mask shows that sit at an earlier position than the query (its position
    id; cached keys keep theirs); the query's own key is left out, as in the reference (``attend_current=False``,
    its default and its decoding path), unless ``attend_current``. A masked key (padding, a static cache's unused
    slot) weighs exactly 0 and is absent from the product (a factor 1, ``log 1 = 0``), so a row alone equals the
    row in a left-padded batch.

    No position encoding is needed (the paper uses none): the order of the keys is in the product. The reference
    model also adds ``(1 - sum_j a_ij)`` times a learned per-head vector to the output and a per-head GroupNorm
    (``SBAttention`` of IBM's dolomite-engine); those are model choices outside the normalizer, not made here.
    W_V and W_O keep the family's init (factor 1), as the reference's: at init ``sigmoid(b) ~ 1/2``, so a row sums
    to about 1. Backends: eager, and ``sdpa`` meaning its chunked path (``sdpa_in_query_chunks``), whose memory
    grows like ``chunk x kv_len`` rather than ``q_len x kv_len`` per layer kept for the backward.
    """

    name = "stick_breaking"
    parallel_refusals = {
        "context": f"stick-breaking runs along the keys: {ALONG_THE_SEQUENCE}",
        "sequence": ULYSSES_KERNEL_ONLY,
    }
    description = (
        "sigmoid(b_ij) prod_{j<k<i} (1 - sigmoid(b_ik)), nearest earlier keys first (rows sum to < 1); decoder only"
    )
    options = {
        "attend_current": Option(
            False, (bool,), "the query's own key takes the first share of the stick (the reference's default: no)"
        )
    }
    backends = ("eager", "sdpa")
    sdpa_in_query_chunks = True
    families = ("decoder",)
    family_reason = "causal by construction: each key's weight is what the keys between it and the query leave"

    def normalize(self, scores, attention_inputs):
        query_positions = attention_inputs["query_positions"][:, None, :, None]
        key_positions = attention_inputs["key_positions"][:, None, None, :]
        keys = key_positions <= query_positions if self.spec["attend_current"] else key_positions < query_positions
        if attention_inputs["visible"] is not None:
            keys = keys & attention_inputs["visible"]
        # Masked keys break no stick: log(1 - sigmoid(b)) is replaced by 0 there (and never evaluated at finfo.min).
        log_remains = torch.where(keys, nn.functional.logsigmoid(-scores), 0.0)
        # sum_{k > j} log(1 - sigmoid(b_ik)): summed from the query outward, then shifted one key to exclude k = j.
        after = log_remains.flip(-1).cumsum(-1).flip(-1)
        after = nn.functional.pad(after[..., 1:], (0, 1))
        # log sigmoid(b) = b + log(1 - sigmoid(b)): one logsigmoid for both (an error of at most eps |b| in the log)
        log_weights = torch.where(keys, scores + log_remains + after, -math.inf)
        return torch.exp(log_weights)


def differential_lambda_init(layer_idx: int) -> float:
    """``lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1))``, ``l`` the 1-based layer of the paper, i.e. the 0-based
    ``layer_idx`` for ``l - 1`` (Transformers' ``diffllama.lambda_init_fn`` and the paper's code take it so)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


class Differential(AttentionNormalizer):
    """Differential attention (Ye et al., "Differential Transformer", ICLR 2025, arXiv 2410.05258), as Transformers'
    ``DiffLlamaAttention``: the heads form pairs, head ``p`` and head ``p + heads / 2``, whose softmax weights
    ``A1``, ``A2`` are subtracted, ``(A1 - lambda A2) [V1, V2]``, on a value twice a head wide (the pair's two
    value heads side by side); each pair's output gets an RMS norm without affine weights over its ``2 head_dim``
    features (the paper's GroupNorm) and the factor ``(1 - lambda_init)``, then fills the two heads' slots of the
    output projection. ``lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init``, one
    scalar per layer from four learned ``head_dim`` vectors, ``lambda_init`` from the layer's depth
    (:func:`differential_lambda_init`).

    As diffllama: two softmax attentions sharing q and k, one on the first half of the value heads and one on the
    second (each repeated to every query head: ``split_values``), on every backend (SDPA's and FlexAttention's
    kernels, no weights materialised), then ``combine_outputs``. Eager computes the weights once and applies them
    to both halves; ``output_attentions`` gives the differential weights ``A1 - lambda A2``, ``(batch, heads / 2,
    q_len, kv_len)``. diffllama refuses attention dropout (the paper defines none); here dropout drops the softmax
    weights once for both halves, so training with it runs eager. Init as diffllama: ``lambda_*`` ``N(0,
    lambda_std)`` (its ``lambda_std_dev``), W_V and W_O the family's (factor 1). Needs an even number of heads (and
    of key/value heads).
    """

    name = "differential"
    parallel_refusals = {
        "context": f"differential is two softmaxes subtracted; {RING_ATTENTION_ONLY}",
        "sequence": ULYSSES_KERNEL_ONLY,
    }
    description = (
        "(softmax(Q1 K1^T) - lambda softmax(Q2 K2^T)) [V1, V2] over head pairs, per-pair RMS norm x (1 - lambda_init)"
        " (Ye et al. 2025, diffllama); W_V, W_O init unchanged"
    )
    options = {
        "lambda_std": Option(
            0.1,
            (float, int),
            "std of the N(0, std) init of lambda_q1, lambda_k1, lambda_q2, lambda_k2 (diffllama's lambda_std_dev)",
            lambda v: math.isfinite(v) and v >= 0,
            "a finite number >= 0",
        ),
        "norm_eps": Option(
            1e-5, (float, int), "eps of the per-pair RMS norm (diffllama's rms_norm_eps)", lambda v: v > 0, "> 0"
        ),
    }
    backends = BACKENDS
    value_parts = 2
    pairs_head_halves = True

    def __init__(self, spec: dict[str, Any], dims: AttentionDims, layer_idx: int = 0):
        super().__init__(spec, dims, layer_idx)
        self.check_heads(spec, dims.num_heads)
        self.lambda_init = differential_lambda_init(layer_idx)
        std = float(spec["lambda_std"])
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.normal(0.0, std, size=(dims.head_dim,))) for _ in range(4)
        )

    @classmethod
    def check_heads(cls, spec: dict[str, Any], num_heads: int) -> None:
        if num_heads % 2:
            raise ValueError(
                f"attention_normalizer 'differential' pairs the attention heads: num_attention_heads must be even, "
                f"got {num_heads}."
            )

    @classmethod
    def weights_are_softmax(cls, spec: dict[str, Any]) -> bool:
        return not spec["toeplitz_gate"]

    def init_weights(self, initializer_range: float) -> None:
        super().init_weights(initializer_range)
        for parameter in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            init.normal_(parameter, mean=0.0, std=float(self.spec["lambda_std"]))

    def differential_lambda(self) -> torch.Tensor:
        """``lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init``, 0-d, float32 or
        wider."""
        dtype = torch.promote_types(self.lambda_q1.dtype, torch.float32)
        lambda_q1, lambda_k1, lambda_q2, lambda_k2 = (
            self.read_by_all_heads(vector).to(dtype)
            for vector in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2)
        )
        first = torch.exp((lambda_q1 * lambda_k1).sum())
        second = torch.exp((lambda_q2 * lambda_k2).sum())
        return first - second + self.lambda_init

    def normalize(self, scores, attention_inputs):
        return torch.softmax(scores, dim=-1)

    def split_values(self, value):
        if value.shape[1] % 2:
            raise ValueError(
                "attention_normalizer 'differential' splits the key/value heads in two halves: their number must be "
                f"even, got {value.shape[1]}."
            )
        return tuple(half.repeat(1, 2, 1, 1) for half in torch.chunk(value, 2, dim=1))

    def combine_outputs(self, outputs):
        output = torch.cat(outputs, dim=-1)  # (batch, heads, q_len, 2 head_dim): each head on [V1, V2]
        first, second = output.to(torch.promote_types(output.dtype, torch.float32)).chunk(2, dim=1)
        pairs = first - self.differential_lambda() * second
        pairs = (1 - self.lambda_init) * nn.functional.rms_norm(pairs, pairs.shape[-1:], eps=self.spec["norm_eps"])
        # pair p's 2 head_dim features fill heads 2p and 2p + 1 of the output projection's input (diffllama's order)
        batch, num_pairs, q_len, width = pairs.shape
        pairs = pairs.view(batch, num_pairs, q_len, 2, width // 2).transpose(2, 3)
        return pairs.reshape(batch, 2 * num_pairs, q_len, width // 2).to(output.dtype)

    def output_weights(self, weights):
        first, second = weights.chunk(2, dim=1)
        return first - self.differential_lambda().to(weights.dtype) * second


ATTENTION_NORMALIZERS: dict[str, type[AttentionNormalizer]] = {
    normalizer.name: normalizer
    for normalizer in (
        Softmax,
        L2,
        Exp,
        ReLU2,
        SwishL2,
        Sigmoid,
        ScalableSoftmax,
        Softpick,
        StickBreaking,
        Differential,
    )
}
