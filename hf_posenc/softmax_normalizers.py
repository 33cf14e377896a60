"""The softmax family: ``softmax`` itself (optionally with a sink), ``ssmax`` (Scalable-Softmax: the scores of a row of
n keys times ``s log n`` first), ``softpick`` (rectified, ``relu(e^b - 1) / sum |e^b - 1|``) and ``differential``
(one softmax map minus lambda times another). Each class cites its paper and reference code; what they share with
the other normalizers lives in :mod:`hf_posenc.normalizer_interface`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers import initialization as init

from .normalizer_interface import (
    AttentionNormalizer,
    additive_mask,
    flex_pass,
    is_finite_number,
    log_where,
    lse_pass,
    row_factor,
    visible_key_count_lse,
    visible_key_counts,
)
from .options import (
    NOT_SLICED_BY_RANK,
    RING_ATTENTION_ONLY,
    ULYSSES_KERNEL_ONLY,
    Option,
)
from .position_interface import BACKENDS, AttentionDims


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


def _log_positive_expm1(score: torch.Tensor) -> torch.Tensor:
    """``log(e^b - 1) = b + log(1 - e^(-b))`` for ``b > 0``, ``-inf`` elsewhere (softpick's numerator)."""
    return log_where(score > 0, lambda b: b + torch.log(-torch.expm1(-b)), score, 1.0)


def _log_abs_expm1(score: torch.Tensor) -> torch.Tensor:
    """``log |e^b - 1| = relu(b) + log(1 - e^(-|b|))``, ``-inf`` at ``b = 0`` (softpick's denominator)."""
    return log_where(score != 0, lambda b: torch.relu(b) + torch.log(-torch.expm1(-b.abs())), score, 1.0)


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
        return output * row_factor(lse_positive - log_denominator, lse_positive).to(output.dtype)


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
        "initial_scale": Option(0.43, (float, int), "the initial value of s_h", is_finite_number, "finite"),
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
        log_counts = visible_key_count_lse(attend, query, key, block_mask)
        log_counts = torch.where(torch.isfinite(log_counts), log_counts, 0.0)  # rows with no key: output 0 anyway
        # (batch, heads, q_len), a tensor of its own: FlexAttention gives a captured view no gradient
        table = self.row_factors(log_counts[..., None]).squeeze(-1).expand(*query.shape[:-1]).clone()
        if score_mod is None:
            return attend(query * table[..., None].to(query.dtype), key, value, block_mask=block_mask, scale=scale)

        def scaled_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
            return score_mod(score, batch_idx, head_idx, q_idx, kv_idx) * table[batch_idx, head_idx, q_idx]

        return attend(query, key, value, score_mod=scaled_score_mod, block_mask=block_mask, scale=scale)


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
