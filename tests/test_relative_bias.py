"""T5 and ALiBi score biases against published values and independent implementations."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model, random_ids
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.t5.modeling_t5 import T5Attention

from hf_posenc.score_bias_encodings import alibi_slopes, t5_relative_bucket


# kexue.fm/archives/8130, "T5式": f(i - j) for i - j = 0..30 (32 bidirectional buckets, max_distance 128), as the
# Chinese original prints it: 16..22 -> 10, 23..30 -> 11. (The English rendering in seeds/ shifts the 10/11 boundary
# by one; the original agrees with T5's formula, 8 + floor(2 log2(n / 8)), and with transformers' T5.)
SU_T5_TABLE = [0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 8, 8, 9, 9, 9, 9] + [10] * 7 + [11] * 8


def test_t5_buckets_match_the_table_in_kexue_8130():
    distance = torch.arange(31)
    buckets = t5_relative_bucket(distance, bidirectional=True, num_buckets=32, max_distance=128)
    assert buckets.tolist() == SU_T5_TABLE


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 64), (64, 256)])
def test_t5_buckets_match_transformers_t5(bidirectional, num_buckets, max_distance):
    distance = torch.arange(-300, 301)  # i - j
    options = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    ours = t5_relative_bucket(distance, **options)
    # T5 takes memory_position - query_position = j - i.
    theirs = T5Attention._relative_position_bucket(-distance, **options)
    assert torch.equal(ours, theirs)


def test_t5_causal_buckets_by_hand():
    distance = torch.tensor([-5, 0, 15, 16, 20, 32, 127, 500])
    buckets = t5_relative_bucket(distance, bidirectional=False, num_buckets=32, max_distance=128)
    # future keys -> 0; 0..15 exact; then 16 + floor(16 * log(n/16) / log(8)), capped at 31.
    expected = [0, 0, 15, 16, 16 + math.floor(16 * math.log(20 / 16) / math.log(8)), 21, 31, 31]
    assert buckets.tolist() == expected


def test_alibi_slopes_for_a_power_of_two_are_2_pow_minus_8h_over_H():
    assert alibi_slopes(8).tolist() == [2.0 ** (-h) for h in range(1, 9)]
    assert alibi_slopes(4).tolist() == [2.0 ** (-2 * h) for h in range(1, 5)]


def test_alibi_slopes_for_six_heads_by_hand():
    # Press et al.: the 4-head slopes, then every other slope of the 8-head sequence.
    assert alibi_slopes(6).tolist() == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]


@pytest.mark.parametrize("num_heads", [1, 3, 4, 6, 12, 16])
def test_alibi_slopes_match_transformers_bloom(num_heads):
    mask = torch.ones(1, 2)
    bloom = build_alibi_tensor(mask, num_heads, torch.float32)  # slope_h * position, position 1 in column 1
    torch.testing.assert_close(alibi_slopes(num_heads).float(), bloom[:, 0, 1])


def reference_biased_attention_logits(model, ids, bias_fn):
    """Layer-0 attention weights by the formula: softmax_j(q_i.k_j / sqrt(d) + bias(h, i, j)), built from the
    model's own projections but none of its attention code."""
    layer = model.bert.encoder.layer[0].attention.self
    with torch.no_grad():
        hidden = model.bert.embeddings(model.bert.position_encoding, torch.arange(ids.shape[1])[None], ids)
        heads, head_dim = layer.num_heads, layer.head_dim
        q = layer.query(hidden).view(1, -1, heads, head_dim).transpose(1, 2)[0]
        k = layer.key(hidden).view(1, -1, heads, head_dim).transpose(1, 2)[0]
    n = ids.shape[1]
    weights = torch.zeros(heads, n, n)
    for h in range(heads):
        for i in range(n):
            row = torch.tensor([float(q[h, i] @ k[h, j]) / math.sqrt(head_dim) + bias_fn(h, i, j) for j in range(n)])
            weights[h, i] = torch.softmax(row, dim=0)
    return weights


def test_t5_attention_weights_match_a_hand_written_reference():
    model = make_model("bert", "t5")
    ids = random_ids(1, 6)
    encoding = model.bert.position_encoding
    steps = encoding.relative_attention_steps.weight.detach() * math.sqrt(encoding.dims.head_dim)  # table_scale

    def bias(h, i, j):
        # The stored table holds steps outward from distance 0: sum them up to the bucket, in its direction.
        if i >= j:
            return sum(float(steps[b, h]) for b in range(SU_T5_TABLE[i - j] + 1))
        return float(steps[0, h]) + sum(float(steps[b, h]) for b in range(16, 16 + SU_T5_TABLE[j - i] + 1))

    expected = reference_biased_attention_logits(model, ids, bias)
    with torch.no_grad():
        actual = model(ids, output_attentions=True).attentions[0][0]
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


def test_alibi_attention_weights_match_a_hand_written_reference():
    model = make_model("bert", "alibi")
    ids = random_ids(1, 6)
    slopes = [2.0 ** (-2 * h) for h in range(1, 5)]  # 4 heads

    expected = reference_biased_attention_logits(model, ids, lambda h, i, j: -slopes[h] * abs(i - j))
    with torch.no_grad():
        actual = model(ids, output_attentions=True).attentions[0][0]
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


def test_t5_decoder_bias_ignores_future_buckets():
    """In the decoder the table has no 'key to the right' half: all 32 buckets are for i - j >= 0."""
    model = make_model("gpt2", "t5")
    assert model.transformer.position_encoding.dims.causal
    distance = torch.tensor([0, 16, 100])
    buckets = t5_relative_bucket(distance, bidirectional=False, num_buckets=32, max_distance=128)
    assert buckets.tolist() == [0, 16, 16 + math.floor(16 * math.log(100 / 16) / math.log(8))]
