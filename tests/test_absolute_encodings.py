"""Absolute schemes (learned, sinusoidal, none): formulas, limits and errors."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model, random_ids

from hf_posenc.absolute_encodings import sinusoidal_table
from hf_posenc.position_interface import EmbeddingInputs


def test_sinusoidal_table_by_hand():
    table = sinusoidal_table(torch.tensor([[0, 1, 5]]), dim=4, base=10000.0)[0]
    expected = [
        [0.0, 1.0, 0.0, 1.0],
        [math.sin(1), math.cos(1), math.sin(1 / 100), math.cos(1 / 100)],
        [math.sin(5), math.cos(5), math.sin(5 / 100), math.cos(5 / 100)],
    ]
    torch.testing.assert_close(table, torch.tensor(expected))


def test_sinusoidal_is_added_to_the_input(family):
    model = make_model(family, "sinusoidal")
    encoding = model.base_model.position_encoding
    x = torch.zeros(1, 3, 32)
    out = encoding.embed(EmbeddingInputs(x, torch.tensor([[0, 1, 2]])))
    torch.testing.assert_close(out, sinusoidal_table(torch.tensor([[0, 1, 2]]), 32, 10000.0))


def test_learned_table_is_added_to_the_input(family):
    model = make_model(family, "learned")
    encoding = model.base_model.position_encoding
    x = torch.randn(1, 3, 32)
    positions = torch.tensor([[4, 0, 39]])
    expected = x + encoding.table.weight[positions[0]][None]
    torch.testing.assert_close(encoding.embed(EmbeddingInputs(x, positions)), expected)


def test_learned_table_defaults_to_max_position_embeddings(family):
    model = make_model(family, "learned")
    assert model.config.position_encoding == {"type": "learned", "max_positions": 40}
    assert model.base_model.position_encoding.table.num_embeddings == 40


def test_learned_table_length_option(family):
    model = make_model(family, {"type": "learned", "max_positions": 12})
    assert model.base_model.position_encoding.table.num_embeddings == 12


def test_input_longer_than_the_learned_table_raises(family):
    model = make_model(family, "learned")
    with pytest.raises(ValueError, match=r"Position 40 is outside the learned position table of 40 positions") as err:
        model(random_ids(1, 41))
    assert "extend_positions" in str(err.value)
    assert "rope, t5, alibi, sinusoidal" in str(err.value)


@pytest.mark.parametrize("scheme", ["sinusoidal", "none", "rope", "t5", "alibi"])
def test_schemes_without_a_table_run_past_max_position_embeddings(family, scheme):
    model = make_model(family, scheme)
    with torch.no_grad():
        assert torch.isfinite(model(random_ids(1, 55)).logits).all()


def test_none_adds_nothing_and_encoder_is_permutation_equivariant():
    """NoPE in an encoder: permuting the tokens permutes the outputs."""
    model = make_model("bert", "none")
    ids = random_ids(1, 7)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids).logits[0]
        out_perm = model(ids[:, perm]).logits[0]
    torch.testing.assert_close(out_perm, out[perm], atol=1e-5, rtol=1e-4)


def test_negative_positions_are_named_in_the_error(family):
    model = make_model(family, "learned")
    with pytest.raises(ValueError, match=r"Position ids must be >= 0 for a learned table; got -1"):
        model(random_ids(1, 4), position_ids=torch.tensor([[-1, 0, 1, 2]]))
