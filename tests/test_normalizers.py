"""Attention normalizers (kexue.fm/archives/9105) against their formulas on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model, random_ids

from hf_posenc.attention_normalizers import ATTENTION_NORMALIZERS
from hf_posenc.position_interface import AttentionDims


DIMS = AttentionDims(hidden_size=8, num_heads=2, head_dim=4, max_positions=16, causal=False)


NO_INPUTS = {"visible": None, "row_has_key": None}  # softmax and l2 read only the scores


def normalizer(name):
    return ATTENTION_NORMALIZERS[name]({"type": name}, DIMS)


def reference(name, row):
    """a_j by the formula, one row of python floats, in float64."""
    exp = [math.exp(b) for b in row]
    if name == "softmax":
        return [e / sum(exp) for e in exp]
    return [e / math.sqrt(sum(x * x for x in exp)) for e in exp]


@pytest.mark.parametrize("name", ["softmax", "l2"])
def test_matches_the_formula(name):
    scores = torch.randn(2, 2, 3, 5, dtype=torch.float64)
    weights = normalizer(name)(scores, NO_INPUTS)
    for index in torch.cartesian_prod(torch.arange(2), torch.arange(2), torch.arange(3)).tolist():
        expected = reference(name, scores[tuple(index)].tolist())
        torch.testing.assert_close(weights[tuple(index)], torch.tensor(expected, dtype=torch.float64))


def test_softmax_rows_sum_to_one():
    weights = normalizer("softmax")(torch.randn(3, 2, 4, 6), NO_INPUTS)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 2, 4))


def test_l2_rows_have_unit_norm_and_free_sum():
    weights = normalizer("l2")(torch.randn(3, 2, 4, 6), NO_INPUTS)
    torch.testing.assert_close(weights.norm(dim=-1), torch.ones(3, 2, 4))
    assert (weights.sum(-1) > 1.0 + 1e-3).all()  # l1 sum is in [1, sqrt(n)]


@pytest.mark.parametrize("name", ["softmax", "l2"])
def test_large_scores_stay_finite_and_correct(name):
    scores = torch.tensor([[[[1000.0, 999.0, -1000.0]]]])
    weights = normalizer(name)(scores, NO_INPUTS)
    shifted = reference(name, [0.0, -1.0, -2000.0])  # both formulas are invariant to a shift of the row
    torch.testing.assert_close(weights[0, 0, 0], torch.tensor(shifted, dtype=torch.float32))


@pytest.mark.parametrize("name", ["softmax", "l2"])
def test_masked_keys_weigh_exactly_zero(name):
    """Masked keys reach a normalizer as finfo.min (the attention composition's contract) and get weight 0."""
    scores = torch.randn(1, 2, 2, 4)
    visible = torch.tensor([[True, False, True, False], [True, True, True, True]])
    weights = normalizer(name)(scores.masked_fill(~visible, torch.finfo(scores.dtype).min), NO_INPUTS)
    assert torch.equal(weights[..., 0, 1], torch.zeros(1, 2))
    assert torch.equal(weights[..., 0, 3], torch.zeros(1, 2))
    expected = reference(name, scores[0, 0, 0, [0, 2]].tolist())
    torch.testing.assert_close(weights[0, 0, 0, [0, 2]], torch.tensor(expected, dtype=torch.float32))


def test_l2_model_weights_have_unit_row_norm():
    model = make_model("bert", "t5", "l2")
    with torch.no_grad():
        attentions = model(random_ids(1, 6), output_attentions=True).attentions
    for layer in attentions:
        torch.testing.assert_close(layer.norm(dim=-1), torch.ones_like(layer[..., 0]))


def test_l2_shrinks_the_value_and_output_init(family):
    """F: with l2 the W_V, W_O init std is scaled by max_positions^(-1/4) (max_positions = 40 here)."""
    big = dict(hidden_size=256, num_attention_heads=4) if family == "bert" else dict(n_embd=256, n_head=4)
    l2 = make_model(family, "learned", "l2", initializer_range=0.02, **big)
    scale = 40**-0.25
    if family == "bert":
        attention = l2.bert.encoder.layer[0].attention
        value, output = attention.self.value.weight, attention.output.dense.weight
        expected_value_std, expected_output_std = 0.02 * scale, 0.02 * scale
        query = attention.self.query.weight
    else:
        attention = l2.transformer.h[0].attn
        value, output = attention.c_attn.weight[:, 512:], attention.c_proj.weight
        expected_value_std, expected_output_std = 0.02 * scale, 0.02 / math.sqrt(4) * scale
        query = attention.c_attn.weight[:, :256]
    assert value.std().item() == pytest.approx(expected_value_std, rel=0.05)
    assert output.std().item() == pytest.approx(expected_output_std, rel=0.05)
    assert query.std().item() == pytest.approx(0.02, rel=0.05)
