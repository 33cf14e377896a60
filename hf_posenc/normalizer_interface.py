"""The attention normalizers' interface: the base class every normalizer subclasses, its output and Toeplitz gates,
and the machinery they share (the implicit causal mask, the additive mask, FlexAttention passes and their
log-sum-exps, row factors).

A normalizer sees scores whose masked keys (padding, causal) are already ``finfo.min``, and must give them a weight
of exactly 0; the attention composition guarantees every row it sees has a visible key, and sets rows without one
to 0 itself. Weights are computed in at least float32 whatever the model dtype. The catalogue is
:data:`hf_posenc.attention_normalizers.ATTENTION_NORMALIZERS`: the softmax family in ``softmax_normalizers.py``, the
others in ``softmax_free_normalizers.py``.
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
    NOT_SLICED_BY_RANK,
    RING_ATTENTION_ONLY,
    CatalogueEntry,
    Option,
)
from .position_interface import BACKENDS, AttentionDims, AttentionInputs, ForwardFacts, HeadSharded


OUTPUT_GATES = ("elementwise", "headwise")
OUTPUT_NORM_EPS = 1e-6
"""The output norm's epsilon: FoX's reference's ``norm_eps``."""


GATE_OPTIONS = {
    "output_gate": Option(
        None,
        (str,),
        'gated attention, Y * sigmoid(X W_g) on each head\'s output: "elementwise" or "headwise"; None: no gate',
        lambda v: v in OUTPUT_GATES,
        '"elementwise" or "headwise"',
    ),
    "output_norm": Option(
        False, (bool,), "RMSNorm of each head's output, a learned scale per feature, before the output gate (FoX-Pro)"
    ),
    "toeplitz_gate": Option(False, (bool,), "multiply the weights by a trainable Toeplitz gate g_h(clip(i - j))"),
    "toeplitz_max_distance": Option.int_at_least(128, "k of clip(i - j, -k, k) in the Toeplitz gate", 1),
}


def head_rms_norm(states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head's features with a scale per head and feature, ``y / sqrt(mean(y^2) + eps) * w_h``, in at
    least float32 and cast back (FoX-Pro's ``GroupNorm(is_rms_norm=True)``, a group per head, Lin et al. 2025;
    ``zhixuan-lin/forgetting-transformer``): ``states`` ``(batch, heads, seq, head_dim)``, ``weight`` ``(heads,
    head_dim)``."""
    compute = states.to(torch.promote_types(states.dtype, torch.float32))
    normed = nn.functional.rms_norm(compute, (states.shape[-1],), eps=eps)
    return (normed * weight[None, :, None, :]).to(states.dtype)


def normed_and_gated_output(
    output: torch.Tensor,
    hidden_states: torch.Tensor | None,
    output_norm: nn.Parameter | None,
    output_gate: nn.Linear | None,
    owner: HeadSharded,
) -> torch.Tensor:
    """The heads' output ``(batch, heads, q_len, head_dim)`` through the output norm (``output_norm``, ``(heads *
    head_dim,)``: :func:`head_rms_norm` with eps :data:`OUTPUT_NORM_EPS`), then the output gate, ``Y * sigmoid(X
    W_g)`` with ``X`` the layer's input ``hidden_states`` ``(batch, q_len, hidden)`` and ``W_g`` ``output_gate``
    (``heads * head_dim`` or ``heads`` rows); either None: left out. ``owner`` (the normalizer or layer term holding
    them) reads the per-head rows at its rank's heads under tensor parallelism."""
    if output_norm is not None:
        head_dim = output.shape[-1]
        scale = owner.heads_read(output_norm.view(owner.model_num_heads, head_dim))
        output = head_rms_norm(output, scale, OUTPUT_NORM_EPS)
    if output_gate is None:
        return output
    if hidden_states is None:
        raise ValueError("output_gate reads the layer's input: pass hidden_states to positional_attention.")
    batch, _, q_len, _ = output.shape
    gate = torch.sigmoid(output_gate(hidden_states.to(output_gate.weight.dtype)))
    gate = gate.view(batch, q_len, owner.model_num_heads, -1)  # this rank's heads under tensor parallelism:
    gate = owner.heads_read(gate, dim=2).transpose(1, 2)  # (batch, heads, q_len, head_dim or 1)
    return output * gate.to(output.dtype)


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

    And the option ``output_norm``, the output normalization of FoX-Pro (Lin et al. 2025, section 3;
    ``zhixuan-lin/forgetting-transformer``'s ``use_output_norm``, a ``GroupRMSNorm`` with a group per head): each
    head's output ``y`` ``(head_dim,)`` becomes ``y / sqrt(mean(y^2) + 1e-6) * w_h``, computed in float32, with
    ``w`` ``(heads * head_dim,)`` trainable (one scale per head and feature, not shared by the heads: 1-D, so the
    recipes do not decay it) and initialised to 1; before the output gate, as in the reference.

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
        self.output_norm = nn.Parameter(torch.ones(dims.num_heads * dims.head_dim)) if spec["output_norm"] else None

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
        ``N(0, initializer_range)``, as Qwen3-Next's ``q_proj`` that holds it there; the output norm's scale at 1."""
        if self.toeplitz_gate is not None:
            init.ones_(self.toeplitz_gate)
        if self.output_norm is not None:
            init.ones_(self.output_norm)
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
        output norm, then the output gate ``sigmoid(X W_g)`` from the layer's input ``hidden_states`` ``(batch,
        q_len, hidden)`` (:func:`normed_and_gated_output`)."""
        return normed_and_gated_output(
            self.combine_outputs(outputs), hidden_states, self.output_norm, self.output_gate, self
        )

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


def visible_key_count_lse(attend, query: torch.Tensor, key: torch.Tensor, block_mask: BlockMask | None):
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


def log_where(condition: torch.Tensor, log_value: Callable, value: torch.Tensor, safe: float) -> torch.Tensor:
    """``log_value(value)`` where ``condition``, ``-inf`` elsewhere; ``log_value`` only ever sees values where it is
    finite (``safe`` elsewhere), so the gradient there is 0, whatever arrives (never ``0 * inf``)."""
    return torch.where(condition, log_value(torch.where(condition, value, safe)), -math.inf)


def row_factor(log_factor: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(log_factor)`` as ``(batch, heads, q_len, 1)``, 0 on rows with no visible key (``lse = -inf``); the
    infinities are replaced before ``exp`` so that no NaN reaches the gradients."""
    has_key = torch.isfinite(lse)
    factor = torch.exp(torch.where(has_key, log_factor, 0.0))
    return torch.where(has_key, factor, 0.0)[..., None]


def is_finite_number(value: Any) -> bool:
    return math.isfinite(value)
