"""Normalizers with no softmax: ``l2``, ``exp``, ``relu2``, ``swish_l2``, ``sigmoid``, ``stick_breaking``. A row of
their weights need not sum to 1, which is what lets n identical tokens under a relative-only scheme tell their
positions apart (Su Jianlin, kexue.fm/archives/9105). Papers and reference code are cited per class.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .normalizer_interface import (
    AttentionNormalizer,
    flex_pass,
    is_finite_number,
    log_where,
    lse_pass,
    row_factor,
    stacked_flex_passes,
    visible_key_count_lse,
)
from .options import (
    ALONG_THE_SEQUENCE,
    RING_ATTENTION_ONLY,
    ULYSSES_KERNEL_ONLY,
    Option,
)
from .position_interface import AttentionDims


class UnitL2Rows(AttentionNormalizer):
    """What the normalizers whose rows of weights have unit l2 norm share (``l2``, ``swish_l2``): a uniform row of
    ``n`` keys sums to ``sqrt(n)`` (softmax's to 1), so W_V and W_O start ``max_positions^(-1/4)`` times softmax's
    (F: "l2 needs a smaller initial variance of W_V, W_O"); eager, and FlexAttention from the passes' log-sum-exps.
    Not in the catalogue itself."""

    backends = ("eager", "flex_attention")
    flex_needs_lse = True

    def value_init_scale(self) -> float:
        return self.dims.max_positions**-0.25


def _double(score: torch.Tensor) -> torch.Tensor:
    """``2 b``: ``lse(2b) = log sum_j e^(2 b_ij)``, the squared l2 norm of ``e^b`` in log space."""
    return 2 * score


class L2(UnitL2Rows):
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

    def normalize(self, scores, attention_inputs):
        # The row max is a constant shift the ratio does not see (its gradient is 0): detached, so that autograd does
        # not keep the (q, k) scores for it. Masked keys: exp(min - max) = 0 exactly.
        exp = torch.exp(scores - scores.amax(dim=-1, keepdim=True).detach())
        return exp / torch.linalg.vector_norm(exp, dim=-1, keepdim=True)  # >= 1: the row max contributes e^0

    def flex_output(self, attend, query, key, value, score_mod, block_mask, scale):
        output, lse = flex_pass(attend, query, key, value, score_mod, block_mask, scale)
        lse_double = lse_pass(attend, query, key, value, score_mod, block_mask, scale, _double)
        return output * row_factor(lse - lse_double / 2, lse).to(output.dtype)


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
        return (output.to(wide) * row_factor(lse, lse).to(wide)).to(output.dtype)


def _check_exp_range(values: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise ``OverflowError`` if ``e^x`` of the largest of ``values`` (scores or row log-sum-exps) is not finite in
    ``dtype``."""
    largest = values.max().item()
    if largest > math.log(torch.finfo(dtype).max):
        raise OverflowError(
            f"attention_normalizer 'exp': a score of {largest:.4g} gives e^b = inf in {dtype}; {EXP_RANGE}. Use a "
            "smaller initialisation or learning rate, or the 'l2' normalizer (the same weights up to a per-row scale)."
        )


def _log_relu_squared(score: torch.Tensor) -> torch.Tensor:
    """``log relu(b)^2 = 2 log b`` for ``b > 0``, ``-inf`` (weight 0) for ``b <= 0``."""
    return log_where(score > 0, lambda b: 2 * torch.log(b), score, 1.0)


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
        count_lse = visible_key_count_lse(attend, query, key, block_mask)
        return output * row_factor(lse - count_lse, lse).to(output.dtype)


def _log_swish_part(score: torch.Tensor, part: int | torch.Tensor) -> torch.Tensor:
    """``log |swish(b)| = log |b| + log sigmoid(b)`` where ``b`` has the part's sign (part 0: ``b > 0``, where swish
    > 0; part 1: ``b < 0``, where swish < 0), ``-inf`` elsewhere; exact where float32 ``swish`` itself underflows
    (``b`` below about -100). ``part`` may be a tensor (a stacked head's part, :func:`stacked_flex_passes`)."""
    in_part = score * (1 - 2 * part) > 0
    return log_where(in_part, lambda b: torch.log(b.abs()) + nn.functional.logsigmoid(b), score, 1.0)


def _log_swish_squared(score: torch.Tensor) -> torch.Tensor:
    """``log swish(b)^2 = 2 (log |b| + log sigmoid(b))``, ``-inf`` at ``b = 0``."""
    return log_where(score != 0, lambda b: 2 * (torch.log(b.abs()) + nn.functional.logsigmoid(b)), score, 1.0)


class SwishL2(UnitL2Rows):
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

    def normalize(self, scores, attention_inputs):
        swish = nn.functional.silu(scores)
        norm = torch.linalg.vector_norm(swish, dim=-1, keepdim=True)
        return swish / torch.where(norm > 0, norm, 1.0)

    def flex_output(self, attend, query, key, value, score_mod, block_mask, scale):
        parts = stacked_flex_passes(attend, query, key, value, score_mod, block_mask, scale, _log_swish_part, 2)
        (positive, lse_positive), (negative, lse_negative) = parts
        half_norm = lse_pass(attend, query, key, value, score_mod, block_mask, scale, _log_swish_squared) / 2
        dtype = torch.promote_types(positive.dtype, torch.float32)  # the difference of two parts: at least float32
        output = positive.to(dtype) * row_factor(lse_positive - half_norm, lse_positive)
        output = output - negative.to(dtype) * row_factor(lse_negative - half_norm, lse_negative)
        return output.to(positive.dtype)


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
            None,
            (float, int),
            "beta in sigmoid(b + beta); None: -log(max_position_embeddings)",
            is_finite_number,
            "finite",
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
        return output * row_factor(lse, lse).to(output.dtype)


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
