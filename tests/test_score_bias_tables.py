"""The per-distance paths of the position-only score biases against the per-pair formula (values and gradients):
the Toeplitz-expanded dense bias (eager, SDPA), the FlexAttention ``score_mod`` reading the padded per-distance table,
FIRE's MLP evaluated densely, and what a model builds (one bias shared by the batch)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, perturb_position_parameters, random_ids
from torch.nn.attention.flex_attention import flex_attention

import hf_posenc.modeling_posenc_common as common
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import AttentionDims
from hf_posenc.score_bias_encodings import relu_mlp_of_scalars


SHIFT_INVARIANT = ["t5", "alibi", "kerple"]
HEADS = 3


def scheme(name, causal, **options):
    entry = POSITION_ENCODINGS[name]
    spec = {"type": name, **{k: o.default for k, o in entry.options.items()}, **options}
    dims = AttentionDims(hidden_size=HEADS * 4, num_heads=HEADS, head_dim=4, max_positions=64, causal=causal)
    encoding = entry(spec, dims).double()
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in encoding.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter)).abs_()  # kerple's r1, r2 stay inside the clamp
    return encoding


def by_pair(encoding, query_row, key_row, head):
    """The scheme's formula for each (query, key) pair, one pair at a time: the reference of the table paths."""
    table = encoding.bias_table(torch.device("cpu"))
    return torch.stack(
        [
            torch.stack(
                [
                    torch.stack(
                        [
                            encoding.position_bias(torch.tensor(i), torch.tensor(j), torch.tensor(h), table)
                            for j in key_row.tolist()
                        ]
                    )
                    for i in query_row.tolist()
                ]
            )
            for h in range(head)
        ]
    )


# (query positions, key positions): no cache, a query block after cached keys, positions shifted (left padding).
LAYOUTS = {
    "plain": (torch.arange(6), torch.arange(6)),
    "cache": (torch.arange(5, 8), torch.arange(8)),
    "shifted": (torch.arange(4, 11), torch.arange(4, 11)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", SHIFT_INVARIANT)
def test_per_distance_bias_equals_the_formula_per_pair_in_values_and_gradients(name, causal, layout):
    encoding = scheme(name, causal)
    query_positions, key_positions = (p[None] for p in LAYOUTS[layout])
    bias = encoding.prepare(query_positions, key_positions, "sdpa", consecutive=True)["score_bias"]
    expected = by_pair(encoding, query_positions[0], key_positions[0], HEADS)[None]
    assert bias.shape == expected.shape
    torch.testing.assert_close(bias, expected)
    upstream = torch.randn(expected.shape, dtype=expected.dtype)
    parameters = [p for p in encoding.parameters()]
    if parameters:
        grads = torch.autograd.grad((bias * upstream).sum(), parameters)
        expected_grads = torch.autograd.grad((expected * upstream).sum(), parameters)
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", SHIFT_INVARIANT + ["fire"])
def test_general_positions_equal_the_formula_per_pair(name):
    """Positions that are not consecutive, different per row: the per-pair path, ``(batch, heads, q, k)``."""
    encoding = scheme(name, causal=False, **({"threshold": 6.0} if name == "fire" else {}))
    positions = torch.tensor([[0, 2, 3, 9, 10], [4, 1, 0, 7, 12]])
    bias = encoding.prepare(positions, positions, "sdpa")["score_bias"]
    assert bias.shape == (2, HEADS, 5, 5)
    for row in range(2):
        torch.testing.assert_close(bias[row], by_pair(encoding, positions[row], positions[row], HEADS))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("threshold", [4.0, 512.0])
def test_fire_dense_mlp_equals_its_pieces_per_pair_in_values_and_gradients(causal, threshold):
    """FIRE's dense bias (the MLP, dense backward) = its piecewise lookup per pair, below and past the threshold."""
    encoding = scheme("fire", causal, threshold=threshold, mlp_width=8)
    query_positions, key_positions = torch.arange(3, 9)[None], torch.arange(9)[None]
    bias = encoding.mlp_bias(query_positions, key_positions, encoding.bias_table(torch.device("cpu")))  # off CPU
    heads = torch.arange(HEADS)[None, :, None, None]
    table = encoding.bias_table(torch.device("cpu"))
    expected = encoding.position_bias(query_positions[:, None, :, None], key_positions[:, None, None, :], heads, table)
    torch.testing.assert_close(bias, expected)
    upstream = torch.randn(expected.shape, dtype=expected.dtype)
    parameters = list(encoding.parameters())
    grads = torch.autograd.grad((bias * upstream).sum(), parameters)
    for got, want in zip(grads, torch.autograd.grad((expected * upstream).sum(), parameters), strict=True):
        torch.testing.assert_close(got, want)


def test_relu_mlp_of_scalars_in_chunks_equals_the_mlp_in_values_and_gradients():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 5, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in ((6,), (6,), (3, 6), (3,))]
    weight_in, bias_in, weight_out, bias_out = weights
    reference = torch.einsum("hu,...u->h...", weight_out, torch.relu(x[..., None] * weight_in + bias_in))
    reference = reference + bias_out[:, None, None, None]
    chunked = relu_mlp_of_scalars(x, *weights, chunk=8)  # 70 elements: 9 chunks, the last one short
    torch.testing.assert_close(chunked, reference)
    upstream = torch.randn(reference.shape, dtype=torch.float64)
    inputs = [x, *weights]
    for got, want in zip(
        torch.autograd.grad((chunked * upstream).sum(), inputs),
        torch.autograd.grad((reference * upstream).sum(), inputs),
        strict=True,
    ):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("layout", ["plain", "cache"])
@pytest.mark.parametrize("name", SHIFT_INVARIANT)
def test_flex_score_mod_reading_the_padded_table_equals_eager(name, layout):
    """Uncompiled FlexAttention on CPU with the score_mod reading the per-distance table as ``prepare(...,
    consecutive=True)`` builds it off CPU (padded to a multiple of 8 columns): the scores equal eager softmax with the
    per-pair bias. On CPU ``prepare`` gives flex the fixed-size table (inductor's CPU template cannot recompile a
    length-sized one)."""
    encoding = scheme(name, causal=False)
    query_positions, key_positions = (p[None] for p in LAYOUTS[layout])
    on_cpu = encoding.prepare(query_positions, key_positions, "flex_attention", consecutive=True)
    assert set(on_cpu) == {"bias_table"}
    table = encoding.bias_table(query_positions.device)
    per_distance = encoding.per_distance_bias(query_positions, key_positions, table)
    tables = {"per_distance_bias": torch.nn.functional.pad(per_distance, (0, -per_distance.shape[-1] % 8))}
    score_mod = encoding.score_mod(tables, query_positions, key_positions)
    torch.manual_seed(0)
    q_len, kv_len = query_positions.shape[-1], key_positions.shape[-1]
    query, key, value = (torch.randn(2, HEADS, n, 8, dtype=torch.float64) for n in (q_len, kv_len, kv_len))
    output = flex_attention(query, key, value, score_mod=score_mod)
    bias = by_pair(encoding, query_positions[0], key_positions[0], HEADS)
    weights = torch.softmax(query @ key.transpose(-1, -2) / 8**0.5 + bias, dim=-1)
    torch.testing.assert_close(output, weights @ value)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
@pytest.mark.parametrize("name", SHIFT_INVARIANT)
def test_a_model_with_default_positions_builds_one_bias_for_the_batch(name, family, monkeypatch):
    """Default positions: one ``(1, heads, q, k)`` bias from the per-distance table, and, with nothing padded, a
    ``(1, heads, q, k)`` mask too (not ``(batch, ...)``); the outputs equal those with the same positions given
    (the per-pair path), padded or not."""
    seen = []
    build_dense_mask = common.build_dense_mask

    def recording(mask, score_bias, dtype, keep_boolean):
        inputs = build_dense_mask(mask, score_bias, dtype, keep_boolean)
        seen.append((tuple(score_bias.shape), tuple(inputs["mask"].shape)))
        return inputs

    monkeypatch.setattr(common, "build_dense_mask", recording)
    model = make_model(family, name, attn="sdpa")
    perturb_position_parameters(model)
    ids = random_ids(3, 9)
    heads = model.config.num_attention_heads
    with torch.no_grad():
        default = model(ids).logits
        assert seen == [((1, heads, 9, 9), (1, heads, 9, 9))]
        given = model(ids, position_ids=torch.arange(9).expand(3, 9)).logits
        assert seen[-1][0] == (3, heads, 9, 9)
        torch.testing.assert_close(default, given, atol=1e-5, rtol=1e-5)
        padded = torch.ones_like(ids)
        padded[0, :3] = 0
        for positions in (None, torch.arange(9).expand(3, 9)):
            model(ids, attention_mask=padded, position_ids=positions)
        assert seen[-2][0] == (1, heads, 9, 9)


@pytest.mark.parametrize("name", SHIFT_INVARIANT)
def test_gradients_through_a_model_equal_with_and_without_the_table_path(name):
    """A training step's parameter gradients: default positions (per-distance table, Toeplitz) = the same positions
    given (per-pair formula)."""
    model = make_model("gpt2", name, attn="sdpa")
    perturb_position_parameters(model)
    ids = random_ids(2, 10)
    grads = []
    for positions in (None, torch.arange(10).expand(2, 10)):
        model.zero_grad()
        model(ids, position_ids=positions, labels=ids).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
