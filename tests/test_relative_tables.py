"""Per-distance table readers against an index gather (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from hf_posenc.relative_tables import skew, toeplitz


SHAPES = [(1, 1), (1, 5), (4, 1), (3, 7), (6, 6), (9, 4)]


def distance_column(q_len: int, kv_len: int) -> torch.Tensor:
    """Column ``i - j + kv_len - 1`` of every (i, j), by hand."""
    return torch.tensor([[i - j + kv_len - 1 for j in range(kv_len)] for i in range(q_len)])


@pytest.mark.parametrize("q_len, kv_len", SHAPES)
def test_toeplitz_equals_an_index_gather_in_values_and_gradients(q_len, kv_len):
    torch.manual_seed(0)
    table = torch.randn(2, 3, q_len + kv_len - 1, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 3, q_len, kv_len, dtype=torch.float64)
    expanded = toeplitz(table, q_len, kv_len)
    gathered = table[..., distance_column(q_len, kv_len)]
    torch.testing.assert_close(expanded, gathered, rtol=0, atol=0)
    (grad,) = torch.autograd.grad((expanded * upstream).sum(), table)
    (expected,) = torch.autograd.grad((gathered * upstream).sum(), table)
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("q_len, kv_len", SHAPES)
def test_skew_equals_an_index_gather_in_values_and_gradients(q_len, kv_len):
    torch.manual_seed(0)
    rows = torch.randn(2, 3, q_len, q_len + kv_len - 1, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 3, q_len, kv_len, dtype=torch.float64)
    skewed = skew(rows, kv_len)
    index = distance_column(q_len, kv_len).expand(2, 3, q_len, kv_len)
    gathered = rows.gather(-1, index)
    torch.testing.assert_close(skewed, gathered, rtol=0, atol=0)
    (grad,) = torch.autograd.grad((skewed * upstream).sum(), rows)
    (expected,) = torch.autograd.grad((gathered * upstream).sum(), rows)
    torch.testing.assert_close(grad, expected)


def test_a_table_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="has 6 columns; got 5"):
        toeplitz(torch.zeros(5), 3, 4)
    with pytest.raises(ValueError, match="have 6 columns; got 5"):
        skew(torch.zeros(3, 5), 4)
