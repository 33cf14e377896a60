"""The position-encoding catalogue: one class per scheme, written once for both model families.

A scheme plugs into a model through four hooks, each a no-op unless the scheme overrides it:

* ``embed(inputs_embeds, position_ids)``: what it adds to (or combines with) the input embeddings;
* ``transform_qkv(query, key, value, context)``: how it transforms q, k (and v) before the KV cache;
* ``prepare(context)``: the position-only score term, computed once per forward and shared by every layer,
  as a dense tensor ``context.score_bias`` of shape ``(batch or 1, heads, q_len, kv_len)`` or, for
  FlexAttention, as ``context.score_mod``;
* per-layer terms that read the content (Shaw's value term, DeBERTa's c2p/p2c, Transformer-XL's u/v) attach to
  the same context; see ``docs/design.md`` for which hook each scheme of the SPEC uses.

Sources: Su Jianlin, "Transformer position encodings" (kexue.fm/archives/8130), and the papers cited per class.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .options import CatalogueEntry, Option


BACKENDS = ("eager", "sdpa", "flex_attention")


@dataclass(frozen=True)
class AttentionDims:
    """Sizes a scheme needs to build its parameters."""

    hidden_size: int
    num_heads: int
    head_dim: int
    max_positions: int
    causal: bool


@dataclass
class PositionContext:
    """Per-forward position data, built once by the model and shared by every layer.

    Attributes:
        query_positions: ``(batch or 1, q_len)`` positions of the current tokens.
        key_positions: ``(batch or 1, kv_len)`` positions of all keys, cached ones included.
        backend: the attention backend that runs this forward (``"eager"``, ``"sdpa"`` or ``"flex_attention"``).
        score_bias: ``(batch or 1, heads, q_len, kv_len)`` position-only term added to the scores, or None.
        score_mod: the same term as a FlexAttention ``score_mod``, or None.
        tables: scheme-owned tables shared by all layers (rotary cos/sin), or None.
    """

    query_positions: torch.Tensor
    key_positions: torch.Tensor
    backend: str
    score_bias: torch.Tensor | None = None
    score_mod: Callable | None = None
    tables: Any = None


def key_positions_for(query_positions: torch.Tensor, kv_length: int) -> torch.Tensor:
    """Positions of all ``kv_length`` keys: the queries themselves without a cache; with a cache, contiguous
    positions ending at the last query (the cached keys are the tokens right before it)."""
    if kv_length == query_positions.shape[-1]:
        return query_positions
    offsets = torch.arange(kv_length - 1, -1, -1, device=query_positions.device)
    return query_positions[:, -1:] - offsets


class PositionEncoding(CatalogueEntry, nn.Module):
    """Base class of a scheme. Subclasses set ``name``, ``description``, ``options`` and override hooks.

    Class attributes:
        relative: the scheme only sees ``i - j``, so shifting all position ids by a constant changes nothing.
        backends: the attention backends that can run it.
    """

    relative: bool = False
    backends: tuple[str, ...] = BACKENDS

    def __init__(self, spec: dict[str, Any], dims: AttentionDims):
        super().__init__()
        self.spec = spec
        self.dims = dims

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {**super().describe(), "relative": cls.relative}

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.spec.items())

    def embed(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Input side: ``(batch, seq, hidden)`` embeddings combined with ``position_ids`` ``(batch|1, seq)``."""
        return inputs_embeds

    def prepare(self, context: PositionContext) -> None:
        """Fill ``context`` with the tables every layer shares (called once per forward)."""

    def transform_qkv(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context: PositionContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q/k/v side, on ``(batch, heads, seq, head_dim)`` tensors of the current tokens, before the KV cache."""
        return query, key, value


class RelativeScoreBias(PositionEncoding):
    """A scalar bias per head that depends only on ``d = i - j``: ``b_ij = q_i.k_j / sqrt(d_h) + f_h(i - j)``.

    Subclasses define ``bias_table(device)`` (what the formula reads: a parameter, or fixed values computed in
    float32 for each forward so that casting the model never rounds them) and ``distance_bias(distance, head, table)``,
    elementwise and broadcasting, used both to build the dense ``(batch, heads, q_len, kv_len)`` bias (eager, SDPA)
    and inside the FlexAttention ``score_mod``, so the two backends evaluate the same formula.
    """

    relative = True

    def bias_table(self, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def distance_bias(self, distance: torch.Tensor, head: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, context: PositionContext) -> None:
        query_positions, key_positions = context.query_positions, context.key_positions
        table = self.bias_table(query_positions.device)
        if context.backend == "flex_attention":
            query_position, key_position = _position_lookup(query_positions), _position_lookup(key_positions)

            def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
                distance = query_position(batch_idx, q_idx) - key_position(batch_idx, kv_idx)
                return score + self.distance_bias(distance, head_idx, table).to(score.dtype)

            context.score_mod = score_mod
        else:
            distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]
            heads = torch.arange(self.dims.num_heads, device=distance.device)[None, :, None, None]
            context.score_bias = self.distance_bias(distance, heads, table)


def _position_lookup(positions: torch.Tensor) -> Callable:
    """``(batch_idx, idx) -> position`` for a FlexAttention ``score_mod``; ``(1, seq)`` positions serve every row."""
    if positions.shape[0] == 1:
        shared = positions[0]
        return lambda batch_idx, idx: shared[idx]
    return lambda batch_idx, idx: positions[batch_idx, idx]


def t5_relative_bucket(
    distance: torch.Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of the relative distance ``distance = i - j`` (query minus key).

    Half the buckets (per direction, when bidirectional) hold the exact distances ``0 .. n/2 - 1``; the rest split
    ``[n/2, max_distance)`` logarithmically, and larger distances share the last bucket. With 32 buckets and
    ``max_distance=128`` (bidirectional), ``i - j = 0..30`` maps to the table of kexue.fm/archives/8130:
    0..7, then 8,8,8,8, 9,9,9,9, 10 (x8), 11 (x7). Keys to the right of the query (``j > i``) use the upper half.
    Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer".
    """
    if bidirectional:
        num_buckets //= 2
        offset = torch.where(distance < 0, num_buckets, 0)
        magnitude = distance.abs()
    else:
        offset = torch.zeros_like(distance)
        magnitude = distance.clamp(min=0)
    max_exact = num_buckets // 2
    log_ratio = torch.log(magnitude.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + log_ratio * (num_buckets - max_exact)).to(distance.dtype).clamp(max=num_buckets - 1)
    return offset + torch.where(magnitude < max_exact, magnitude, large)


class T5Bias(RelativeScoreBias):
    """T5 bucketed relative bias: ``b_ij += beta_h[bucket(i - j)]``, one table shared by all layers.

    Bidirectional buckets in an encoder, causal (``i - j >= 0`` only) in a decoder. Source: Raffel et al. 2020;
    kexue.fm/archives/8130 "T5式". Parameters: ``relative_attention_bias`` ``(num_buckets, heads)``.
    """

    name = "t5"
    description = "T5 bucketed scalar bias per head (bidirectional in the encoder, causal in the decoder)"
    options = {
        "num_buckets": Option(32, (int,), "number of buckets", lambda v: v >= 4 and v % 2 == 0, "an even int >= 4"),
        "max_distance": Option(128, (int,), "distance of the last bucket", lambda v: v >= 2, "an int >= 2"),
    }

    @classmethod
    def check_spec(cls, spec: dict[str, Any]) -> None:
        # The log buckets span [num_buckets / 2, max_distance) in a decoder (a quarter in an encoder): it must be wide.
        if spec["max_distance"] <= spec["num_buckets"] // 2:
            raise ValueError(
                f"position_encoding 't5': max_distance={spec['max_distance']} must be larger than num_buckets / 2 "
                f"= {spec['num_buckets'] // 2}, where the logarithmic buckets start."
            )

    def __init__(self, spec: dict[str, Any], dims: AttentionDims):
        super().__init__(spec, dims)
        self.relative_attention_bias = nn.Embedding(spec["num_buckets"], dims.num_heads)

    def bias_table(self, device: torch.device) -> torch.Tensor:
        return self.relative_attention_bias.weight

    def distance_bias(self, distance: torch.Tensor, head: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        bucket = t5_relative_bucket(
            distance,
            bidirectional=not self.dims.causal,
            num_buckets=self.spec["num_buckets"],
            max_distance=self.spec["max_distance"],
        )
        return table[bucket, head]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes: ``m_h = 2^(-8h/H)``, h = 1..H, for H a power of two; otherwise the slopes of the nearest
    lower power of two followed by every other slope of the next one (Press et al. 2022, "Train Short, Test Long")."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = [2 ** (-8 * h / closest) for h in range(1, closest + 1)]
    slopes += [2 ** (-8 * h / (2 * closest)) for h in range(1, 2 * (num_heads - closest), 2)]
    return torch.tensor(slopes)


class ALiBi(RelativeScoreBias):
    """ALiBi: ``b_ij += -m_h |i - j|`` with fixed geometric slopes ``m_h`` (:func:`alibi_slopes`).

    Symmetric in an encoder; in a decoder the causal mask leaves only ``j <= i``, i.e. ``-m_h (i - j)``.
    Source: Press et al. 2022. No parameters.
    """

    name = "alibi"
    description = "linear bias -m_h*|i-j| with geometric head slopes (no parameters)"

    def bias_table(self, device: torch.device) -> torch.Tensor:
        return alibi_slopes(self.dims.num_heads).to(device=device, dtype=torch.float32)

    def distance_bias(self, distance: torch.Tensor, head: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return -table[head] * distance.abs()


def rotary_inverse_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    """``theta^(-2i/d)`` for ``i = 0 .. d/2 - 1``, d the rotated dimension."""
    return theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` features of ``x`` ``(batch, heads, seq, head_dim)``.

    Feature ``i`` is paired with ``i + d/2`` (the "rotate half" layout; Su's interleaved pairs ``(2i, 2i+1)`` are the
    same rotation up to a fixed permutation of features): ``(x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos)``.
    ``cos``/``sin`` are ``(batch|1, 1, seq, d/2)``.
    """
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest), dim=-1)


class RoPE(PositionEncoding):
    """Rotary position embedding: ``q_m -> R_m q_m``, ``k_n -> R_n k_n``, so ``<R_m q, R_n k> = <q, R_(n-m) k>``.

    ``R_m`` rotates feature pairs by the angles ``m * theta^(-2i/d)``; ``rotary_fraction`` < 1 rotates only the first
    ``d * rotary_fraction`` features of each head. Source: Su et al. 2021 (RoFormer); kexue.fm/archives/8130 "融合式".
    Keys are rotated before they enter the KV cache, so cached keys keep their positions.
    """

    name = "rope"
    description = "rotary: rotate q and k by position (Su et al. 2021)"
    relative = True
    options = {
        "theta": Option(10000.0, (float, int), "rotation base", lambda v: v > 1, "a number > 1"),
        "rotary_fraction": Option(
            1.0, (float, int), "fraction of each head's features rotated", lambda v: 0 < v <= 1, "0 < x <= 1"
        ),
    }

    def __init__(self, spec: dict[str, Any], dims: AttentionDims):
        super().__init__(spec, dims)
        self.rotary_dim = int(dims.head_dim * spec["rotary_fraction"]) // 2 * 2
        if self.rotary_dim < 2:
            raise ValueError(
                f"rope: rotary_fraction={spec['rotary_fraction']} of head_dim={dims.head_dim} rotates "
                f"{self.rotary_dim} features; it must rotate at least 2 (raise rotary_fraction)."
            )

    def prepare(self, context: PositionContext) -> None:
        # Frequencies in float64, angles in float32, for each forward: a model cast to bf16 keeps exact rotations.
        inv_freq = rotary_inverse_frequencies(self.rotary_dim, self.spec["theta"]).to(context.query_positions.device)
        angles = context.query_positions[:, None, :, None].float() * inv_freq.float()
        context.tables = (angles.cos(), angles.sin())

    def transform_qkv(self, query, key, value, context):
        cos, sin = (t.to(query.dtype) for t in context.tables)
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value


class LearnedAbsolute(PositionEncoding):
    """Trainable absolute table added to the input: ``x_k + p_k`` (BERT, GPT-2). Parameters: ``table``
    ``(max_positions, hidden)``. Positions at or past ``max_positions`` raise a ``ValueError``."""

    name = "learned"
    description = "trainable absolute position table added to the input (BERT/GPT-2 default)"
    options = {
        "max_positions": Option(
            None, (int,), "table length (default: max_position_embeddings)", lambda v: v >= 1, "an int >= 1"
        ),
    }

    def __init__(self, spec: dict[str, Any], dims: AttentionDims):
        super().__init__(spec, dims)
        self.table = nn.Embedding(spec["max_positions"] or dims.max_positions, dims.hidden_size)

    def embed(self, inputs_embeds, position_ids):
        if not torch.compiler.is_compiling():
            limit = self.table.num_embeddings
            if int(position_ids.min()) < 0:
                raise ValueError(f"Position ids must be >= 0 for a learned table; got {int(position_ids.min())}.")
            if int(position_ids.max()) >= limit:
                raise ValueError(
                    f"Position {int(position_ids.max())} is outside the learned position table of {limit} positions "
                    f"(0..{limit - 1}). Use hf_posenc.extend_positions(model, max_positions) to lengthen the table, "
                    "or a scheme without a length limit (rope, t5, alibi, sinusoidal)."
                )
        return inputs_embeds + self.table(position_ids)


def sinusoidal_table(position_ids: torch.Tensor, dim: int, base: float) -> torch.Tensor:
    """Vaswani et al. 2017: ``p_(k,2i) = sin(k / base^(2i/d))``, ``p_(k,2i+1) = cos(k / base^(2i/d))``.

    ``position_ids`` ``(batch, seq)`` -> ``(batch, seq, dim)`` in float32.
    """
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=position_ids.device) / dim)
    angles = position_ids[..., None].float() * inv_freq
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[..., :dim]


class SinusoidalAbsolute(PositionEncoding):
    """Fixed sin/cos table added to the input (Vaswani et al. 2017, "Attention Is All You Need"); no length limit."""

    name = "sinusoidal"
    description = "fixed sin/cos absolute table added to the input (Vaswani et al. 2017)"
    options = {"base": Option(10000.0, (float, int), "wavelength base", lambda v: v > 1, "a number > 1")}

    def embed(self, inputs_embeds, position_ids):
        table = sinusoidal_table(position_ids, self.dims.hidden_size, self.spec["base"])
        return inputs_embeds + table.to(inputs_embeds.dtype)


class NoPosition(PositionEncoding):
    """NoPE: no position information; a decoder still sees order through its causal mask."""

    name = "none"
    description = "no position information (NoPE)"
    relative = True


POSITION_ENCODINGS: dict[str, type[PositionEncoding]] = {
    scheme.name: scheme for scheme in (LearnedAbsolute, SinusoidalAbsolute, NoPosition, RoPE, T5Bias, ALiBi)
}
