"""Per-distance table readers against an index gather (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from hf_posenc.relative_tables import band_dot_products, run_starts, skew, sorted_gather, sum_sorted_runs, toeplitz


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


def clipped_index(q_len: int, kv_len: int, clip: int, query_start: int = 0) -> torch.Tensor:
    """Shaw's row ``clip(j - i, -k, k) + k`` of every (i, j), by hand: rises along the keys, with runs at both ends
    and rows no key reads when the clip is wide."""
    rows = [[max(-clip, min(clip, j - i - query_start)) + clip for j in range(kv_len)] for i in range(q_len)]
    return torch.tensor(rows)[None]


INDEXES = [
    clipped_index(3, 7, 2),
    clipped_index(5, 5, 1, query_start=2),
    clipped_index(4, 3, 6),
    clipped_index(1, 9, 3),
]


@pytest.mark.parametrize("index", INDEXES)
def test_sorted_gather_equals_an_index_gather_in_values_and_gradients(index):
    """The backward sums runs of keys (a cumulative sum) instead of scattering: same gradients as ``gather``,
    including rows that no key reads and runs at the clipped ends."""
    torch.manual_seed(0)
    rows = int(index.max()) + 3  # rows past the index: their gradient is 0
    table = torch.randn(2, 3, index.shape[1], rows, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 3, *index.shape[1:], dtype=torch.float64)
    gathered = table.gather(-1, index[:, None].expand(2, 3, *index.shape[1:]))
    read = sorted_gather(table, index, run_starts(index, rows))
    torch.testing.assert_close(read, gathered, rtol=0, atol=0)
    (grad,) = torch.autograd.grad((read * upstream).sum(), table)
    (expected,) = torch.autograd.grad((gathered * upstream).sum(), table)
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("index", INDEXES)
def test_sum_sorted_runs_equals_a_scatter_add_in_values_and_gradients(index):
    torch.manual_seed(0)
    rows = int(index.max()) + 2
    values = torch.randn(2, 3, *index.shape[1:], dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 3, index.shape[1], rows, dtype=torch.float64)
    expected = torch.zeros(2, 3, index.shape[1], rows, dtype=torch.float64)
    expected = expected.scatter_add(-1, index[:, None].expand(2, 3, *index.shape[1:]), values)
    summed = sum_sorted_runs(values, index, run_starts(index, rows))
    torch.testing.assert_close(summed, expected)
    (grad,) = torch.autograd.grad((summed * upstream).sum(), values)
    (expected_grad,) = torch.autograd.grad((expected * upstream).sum(), values)
    torch.testing.assert_close(grad, expected_grad)


def test_sum_sorted_runs_of_bfloat16_weights_sums_in_float32():
    """2048 weights of 1/2048 in bfloat16: a bfloat16 running sum would stall far below 1 (its spacing near 1 is
    2^-7); the runs are summed in float32, so the one row every key reads holds 1."""
    weights = torch.full((1, 1, 1, 2048), 1 / 2048, dtype=torch.bfloat16)
    index = torch.zeros(1, 1, 2048, dtype=torch.long)
    summed = sum_sorted_runs(weights, index, run_starts(index, 1))
    assert summed.dtype == torch.bfloat16 and summed.item() == 1.0


@pytest.mark.parametrize("index", INDEXES)
def test_sorted_gather_of_a_falling_index_equals_an_index_gather_in_values_and_gradients(index):
    """An index that falls along the keys (DeBERTa's c2p row of ``i - j``), given with the run starts of the
    reversed index: values and gradients as ``gather``."""
    torch.manual_seed(0)
    rows = int(index.max()) + 3
    falling = index.flip(-1)
    table = torch.randn(2, 3, index.shape[1], rows, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 3, *index.shape[1:], dtype=torch.float64)
    gathered = table.gather(-1, falling[:, None].expand(2, 3, *index.shape[1:]))
    read = sorted_gather(table, falling, run_starts(rows - 1 - falling, rows), descending=True)
    torch.testing.assert_close(read, gathered, rtol=0, atol=0)
    (grad,) = torch.autograd.grad((read * upstream).sum(), table)
    (expected,) = torch.autograd.grad((gathered * upstream).sum(), table)
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("n, reach", [(1, 0), (5, 3), (70, 2), (130, 16), (64, 40)])
def test_band_dot_products_equal_the_band_of_the_scores_in_values_and_gradients(n, reach):
    """``q_i . k_(i + d)`` for ``|d| <= reach`` against the full score matrix read by hand, 0 outside the sequence;
    one block, several blocks with a ragged last one, a band wider than the sequence."""
    torch.manual_seed(0)
    query, key = (torch.randn(2, 3, n, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    scores = query @ key.transpose(-1, -2)
    expected = torch.zeros(2, 3, n, 2 * reach + 1, dtype=torch.float64)
    for i in range(n):
        for d in range(-reach, reach + 1):
            if 0 <= i + d < n:
                expected[..., i, d + reach] = scores[..., i, i + d]
    band = band_dot_products(query, key, reach)
    torch.testing.assert_close(band, expected)
    upstream = torch.randn_like(expected)
    grads = torch.autograd.grad((band * upstream).sum(), (query, key))
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (query, key))
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad)


def test_chunk_budget_is_the_cpu_constant_on_cpu_and_follows_free_memory_on_cuda(monkeypatch):
    from hf_posenc import relative_tables

    assert relative_tables.chunk_elements(torch.device("cpu")) == 2**23
    assert relative_tables.query_chunk_size(8, 12, 2048, torch.device("cpu")) == 2**23 // (8 * 12 * 2048)  # 42
    cuda = torch.device("cuda", 0)
    for free, expected in [(80 * 2**30, 2**28), (4 * 2**30, 2**26), (2**20, 2**23)]:  # capped, a 64th, the floor
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 80 * 2**30))
        assert relative_tables.chunk_elements(cuda) == expected
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 * 2**30, 80 * 2**30))
    assert relative_tables.query_chunk_size(8, 12, 2048, cuda) == 2**28 // (8 * 12 * 2048)  # 1,365: 2 chunks


def test_flex_query_chunk_is_the_most_whole_blocks_whose_tables_fit(monkeypatch):
    """An xlnet-like row table of ``chunk * (chunk + kv_len - 1)`` elements per batch row and head, 8 x 12 heads x
    2048 queries: on an idle 80 GB GPU (budget 2^28) the whole ``2048 x 4095`` table does not fit 2^28 / 96 = 2,796,202
    elements, 896 queries do (896 x 2943 = 2,636,928) and 1,024 do not (1024 x 3071 = 3,144,704); at 512 queries
    the whole table fits (None); a table beyond the budget at one block still gets one block."""
    from torch.nn.attention.flex_attention import create_block_mask

    from hf_posenc import relative_tables

    monkeypatch.setattr(relative_tables, "chunk_elements", lambda device: 2**28)  # an idle 80 GB GPU's
    query = torch.empty(8, 12, 2048, 64, device="meta")
    assert relative_tables.flex_query_chunk_size(query, lambda chunk: chunk * (chunk + 2047), None) == 896
    assert (
        relative_tables.flex_query_chunk_size(query[..., :512, :], lambda chunk: chunk * (chunk + 511), None) is None
    )
    assert relative_tables.flex_query_chunk_size(query, lambda chunk: 2**40, None) == 128
    monkeypatch.undo()
    mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    table = lambda chunk: chunk * 300  # noqa: E731
    monkeypatch.setattr(relative_tables, "CHUNK_ELEMENTS", 2 * 3 * 200 * 300)  # 200 queries: 3 blocks of 64
    assert relative_tables.flex_query_chunk_size(torch.empty(2, 3, 256, 8), table, mask) == 192


def test_fire_mlp_chunk_follows_the_device_budget(monkeypatch):
    from hf_posenc import score_bias_encodings

    seen, original = [], score_bias_encodings._ReluMlpOfScalars

    class Recording(original):
        @staticmethod
        def forward(x, weight_in, bias_in, weight_out, bias_out, chunk):
            seen.append(chunk)
            return original.forward(x, weight_in, bias_in, weight_out, bias_out, chunk)

    monkeypatch.setattr(score_bias_encodings, "_ReluMlpOfScalars", Recording)
    weights = torch.randn(4), torch.randn(4), torch.randn(2, 4), torch.randn(2)
    score_bias_encodings.relu_mlp_of_scalars(torch.rand(10), *weights)
    assert seen == [2**16]  # 2^23 / 128: the CPU chunk as before
