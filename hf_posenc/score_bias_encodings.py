"""Position-only score biases: a scalar per head and per (query, key) position pair, added to the scores.

Each scheme is a :class:`RelativeScoreBias`: one elementwise formula that serves both the dense bias (eager, SDPA,
built once per forward) and the FlexAttention ``score_mod`` (nothing ``(q, k)``-sized materialised).
Sources: Su Jianlin, "Transformer position encodings" (kexue.fm/archives/8130), and the papers cited per class.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .options import Option
from .position_interface import RelativeScoreBias


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
    def check_spec(cls, spec):
        # The log buckets span [num_buckets / 2, max_distance) in a decoder (a quarter in an encoder): it must be wide.
        if spec["max_distance"] <= spec["num_buckets"] // 2:
            raise ValueError(
                f"position_encoding 't5': max_distance={spec['max_distance']} must be larger than num_buckets / 2 "
                f"= {spec['num_buckets'] // 2}, where the logarithmic buckets start."
            )

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        self.relative_attention_bias = nn.Embedding(spec["num_buckets"], dims.num_heads)

    def bias_table(self, device):
        return self.relative_attention_bias.weight

    def position_bias(self, query_position, key_position, head, table):
        bucket = t5_relative_bucket(
            query_position - key_position,
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

    def bias_table(self, device):
        return alibi_slopes(self.dims.num_heads).to(device=device, dtype=torch.float32)

    def position_bias(self, query_position, key_position, head, table):
        return -table[head] * (query_position - key_position).abs()
