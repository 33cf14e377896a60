"""Absolute and input-side schemes: formulas against independent computations, limits and errors."""

from __future__ import annotations

import cmath
import json
import math
import subprocess
import sys

import pytest
import torch
import transformers
from conftest import make_config, make_model, random_ids

import hf_posenc
from hf_posenc import absolute_encodings
from hf_posenc.absolute_encodings import sinusoidal_table
from hf_posenc.attention_normalizers import ATTENTION_NORMALIZERS
from hf_posenc.position_encodings import POSITION_ENCODINGS
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


# The schemes of the survey's other absolute forms: recurrent, FLOATER, multiplicative, hierarchical, Complex Order,
# conv. Each is checked against a computation written here independently.

NEW_SCHEMES = ["recurrent", "floater", "multiplicative", "hierarchical", "complex_order", "conv"]


def scheme_module(family: str, spec, **overrides):
    return make_model(family, spec, **overrides).base_model.position_encoding


@pytest.mark.parametrize("cell", ["gru", "tanh"])
def test_recurrent_table_and_gradients_equal_a_python_loop_of_torch_cells(cell):
    """p_(k+1) = f(p_k), f = torch's own GRUCell / RNNCell fed a zero input (their input weights do nothing);
    the hand-written backward through time against autograd through that loop."""
    encoding = scheme_module("gpt2", {"type": "recurrent", "cell": cell})
    hidden = 32
    reference = torch.nn.GRUCell(1, hidden) if cell == "gru" else torch.nn.RNNCell(1, hidden, nonlinearity="tanh")
    with torch.no_grad():
        reference.weight_hh.copy_(encoding.transition.weight)
        reference.bias_hh.copy_(encoding.transition.bias)
        reference.bias_ih.zero_()
    initial = encoding.initial.detach().clone().requires_grad_()
    p, rows = initial[None], [initial[None]]
    for _ in range(11):
        p = reference(torch.zeros(1, 1), p)
        rows.append(p)
    expected = torch.cat(rows)
    x = torch.randn(2, 4, hidden)
    positions = torch.tensor([[0, 3, 11, 5], [1, 2, 3, 4]])
    table = encoding.generate_table(12)
    torch.testing.assert_close(table, expected)
    torch.testing.assert_close(encoding.embed(EmbeddingInputs(x, positions)), x + expected[positions])
    weights = torch.randn(12, hidden)
    (table * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(encoding.initial.grad, initial.grad)
    torch.testing.assert_close(encoding.transition.weight.grad, reference.weight_hh.grad)
    torch.testing.assert_close(encoding.transition.bias.grad, reference.bias_hh.grad)


class ReplayedLoop(absolute_encodings.CapturedLoop):
    """A CUDA graph's semantics on the CPU: captured once into fixed output tensors, each replay recomputes the
    function from the kept inputs and writes those same tensors (as a graph's kernels rewrite its memory)."""

    replays = 0

    def capture(self, function):
        self.function = function
        return function(*self.inputs)

    def replay(self):
        ReplayedLoop.replays += 1
        for kept, fresh in zip(self.outputs, self.function(*self.inputs), strict=True):
            kept.copy_(fresh)


def replay_loops_as_graphs(monkeypatch) -> None:
    """``run_loop`` as on CUDA, with :class:`ReplayedLoop` for the graph and an empty cache of captured loops."""
    monkeypatch.setattr(absolute_encodings, "captures_loops", lambda tensor: True)
    monkeypatch.setattr(absolute_encodings, "CapturedLoop", ReplayedLoop)
    monkeypatch.setattr(absolute_encodings, "CAPTURED_LOOPS", {})


@pytest.mark.parametrize("cell", ["gru", "tanh"])
def test_recurrent_loop_replayed_as_a_captured_graph_gives_the_loops_numbers(cell, monkeypatch):
    """The CUDA path (``run_loop``: the forward and the backward each captured once per length, then replayed into
    the same memory) with a CPU stand-in for the graph: two tables of two lengths each generated twice, from two
    different ``p_0`` before one backward, equal the uncaptured loop's exactly, table and gradients (the outputs
    are copied out of the graph's memory, so a later replay overwrites nothing autograd kept); one capture per
    function and length, at most ``CAPTURED_LOOPS_KEPT`` kept."""
    encoding = scheme_module("gpt2", {"type": "recurrent", "cell": cell})
    weight, bias = encoding.transition.weight, encoding.transition.bias
    starts = [encoding.initial.detach() + shift for shift in (0.0, 0.3)]
    results = {}
    for captured in (False, True):
        if captured:
            replay_loops_as_graphs(monkeypatch)
        inputs = [start.clone().requires_grad_() for start in starts]
        tables = [
            absolute_encodings.UnrolledRecurrence.apply(start, weight, bias, length, cell)
            for length in (9, 12)
            for start in inputs
        ]
        sum((table * torch.linspace(-1, 1, table.numel()).view_as(table)).sum() for table in tables).backward()
        results[captured] = [*tables, *(start.grad for start in inputs), weight.grad.clone(), bias.grad.clone()]
        weight.grad = bias.grad = None
    for got, want in zip(results[True], results[False], strict=True):
        assert torch.equal(got, want)
    assert len(absolute_encodings.CAPTURED_LOOPS) == 4  # rows and gradients at 9 and 12 tokens
    assert ReplayedLoop.replays >= 8
    monkeypatch.setattr(absolute_encodings, "CAPTURED_LOOPS_KEPT", 2)
    for length in (5, 6, 7):
        absolute_encodings.UnrolledRecurrence.apply(starts[0], weight.detach(), bias.detach(), length, cell)
    assert [key[1] for key in absolute_encodings.CAPTURED_LOOPS] == [(("cell", cell), ("length", 6))] + [
        (("cell", cell), ("length", 7))
    ]


def test_loops_are_captured_on_real_cuda_tensors_only():
    assert not absolute_encodings.captures_loops(torch.zeros(1))
    with torch._subclasses.FakeTensorMode():
        assert not absolute_encodings.captures_loops(torch.empty(1, device="cuda"))


def rotation_generator_by_hand(frequencies: list[float]) -> torch.Tensor:
    """Omega with d/dt (sin w t, cos w t) = (w cos w t, -w sin w t) on each feature pair."""
    generator = torch.zeros(2 * len(frequencies), 2 * len(frequencies))
    for i, omega in enumerate(frequencies):
        generator[2 * i, 2 * i + 1], generator[2 * i + 1, 2 * i] = omega, -omega
    return generator


@pytest.mark.parametrize("method", ["dopri5", "rk4"])
def test_sinusoidal_table_is_a_solution_of_floater_with_linear_dynamics(method):
    """kexue.fm/archives/8130: the sin/cos table is a special solution of FLOATER (with ``g = 0`` the rotating
    frame's state stays ``p(0)``, whatever the method)."""
    spec = {"type": "floater", "dynamics": "linear", "method": method, "rtol": 1e-7, "atol": 1e-9, "step_size": 0.05}
    encoding = scheme_module("bert", spec)
    with torch.no_grad():
        encoding.frequencies.copy_(torch.tensor([10000 ** (-2 * i / 32) for i in range(16)]))
        encoding.initial.copy_(torch.tensor([0.0, 1.0] * 16))
    table = encoding.generate_table(30)
    expected = torch.tensor(
        [[f(k / 10000 ** (2 * (d // 2) / 32)) for d, f in enumerate([math.sin, math.cos] * 16)] for k in range(30)]
    )
    torch.testing.assert_close(table, expected, atol=1e-5, rtol=0)


def test_floater_equals_a_direct_solve_of_its_ode():
    """The scheme solves in the rotating frame; solving dp/dt = Omega p + W_2 tanh(W_1 [p; t] + b_1) + b_2 as it
    stands (torchdiffeq, tight tolerances) gives the same table."""
    from torchdiffeq import odeint

    spec = {"type": "floater", "rtol": 1e-7, "atol": 1e-9}
    encoding = scheme_module("gpt2", spec)
    with torch.no_grad():
        encoding.outer.weight.mul_(0.3)
    omega = rotation_generator_by_hand(encoding.frequencies.tolist())
    inner, outer = encoding.inner, encoding.outer

    def h(t, p):
        return omega @ p + outer(torch.tanh(inner(torch.cat((p, t.reshape(1))))))

    with torch.no_grad():
        direct = odeint(h, encoding.initial.clone(), torch.arange(12.0), rtol=1e-9, atol=1e-10, method="dopri5")
        torch.testing.assert_close(encoding.generate_table(12), direct, atol=1e-4, rtol=1e-4)


def rotating_frame_table_by_torchdiffeq(parameters: dict, length: int, method: str, step_size: float):
    """FLOATER's table by torchdiffeq's own fixed-grid solver in the rotating frame written with matrices:
    ``dq/dt = exp(-Omega t) g(exp(Omega t) q, t)``, ``p(k) = exp(Omega k) q(k)``, ``exp`` by
    ``torch.linalg.matrix_exp`` of ``Omega`` built from the frequencies (differentiable in them)."""
    from torchdiffeq import odeint

    frequencies = parameters["frequencies"]
    pairs = torch.arange(len(frequencies))
    generator = frequencies.new_zeros(2 * len(frequencies), 2 * len(frequencies)).index_put(
        (torch.cat((2 * pairs, 2 * pairs + 1)), torch.cat((2 * pairs + 1, 2 * pairs))),
        torch.cat((frequencies, -frequencies)),
    )

    def g(p, t):
        inner = torch.tanh(parameters["inner.weight"] @ torch.cat((p, t.reshape(1))) + parameters["inner.bias"])
        return parameters["outer.weight"] @ inner + parameters["outer.bias"]

    def dynamics(t, q):
        return torch.linalg.matrix_exp(-generator * t) @ g(torch.linalg.matrix_exp(generator * t) @ q, t)

    times = torch.arange(float(length), dtype=frequencies.dtype)
    rotating = odeint(dynamics, parameters["initial"], times, method=method, options={"step_size": step_size})
    return torch.stack([torch.linalg.matrix_exp(generator * t) @ q for t, q in zip(times, rotating, strict=True)])


@pytest.mark.parametrize(("method", "step_size"), [("rk4", 1.0), ("rk4", 0.25), ("midpoint", 0.5), ("euler", 1.0)])
def test_floater_fixed_step_solve_equals_torchdiffeqs_table_and_gradients(method, step_size):
    """The fixed-step path (its own loop, the backward one step at a time) against torchdiffeq's solver of the same
    method and step, autograd through it, in float64: the table and the gradient of every parameter."""
    encoding = scheme_module("gpt2", {"type": "floater", "method": method, "step_size": step_size}).train()
    with torch.no_grad():
        encoding.outer.weight.normal_(std=0.3)
        encoding.outer.bias.normal_(std=0.1)
        encoding.inner.bias.normal_(std=0.1)
    parameters = {name: p.detach().double().requires_grad_() for name, p in encoding.named_parameters()}
    expected = rotating_frame_table_by_torchdiffeq(parameters, 10, method, step_size)
    table = encoding.generate_table(10)
    torch.testing.assert_close(table, expected.float(), atol=2e-5, rtol=1e-5)
    weights = torch.randn(10, 32)
    (table * weights).sum().backward()
    (expected * weights.double()).sum().backward()
    for name, p in encoding.named_parameters():  # float32 sums of terms up to ~100 (the frequencies' grow with t)
        expected_grad = parameters[name].grad.float()
        torch.testing.assert_close(p.grad, expected_grad, atol=1e-5 * expected_grad.abs().max(), rtol=1e-4, msg=name)


def test_floater_fixed_step_loops_replayed_as_captured_graphs_give_the_loops_numbers(monkeypatch):
    """The CUDA path of the fixed-step solve (forward and backward loops each captured once per length, then
    replayed into the same memory) with the CPU stand-in for a graph: three tables, two of one length, before one
    backward, equal the uncaptured loops' exactly, tables and every gradient."""
    encoding = scheme_module("gpt2", {"type": "floater", "method": "rk4", "step_size": 0.5}).train()
    with torch.no_grad():
        encoding.outer.weight.normal_(std=0.3)
    results = {}
    for captured in (False, True):
        if captured:
            replay_loops_as_graphs(monkeypatch)
        encoding.zero_grad(set_to_none=True)
        tables = [encoding.generate_table(length) for length in (7, 9, 7)]
        sum((table * torch.linspace(-1, 1, table.numel()).view_as(table)).sum() for table in tables).backward()
        results[captured] = [*tables, *(p.grad.clone() for p in encoding.parameters())]
    for got, want in zip(results[True], results[False], strict=True):
        assert torch.equal(got, want)
    assert len(absolute_encodings.CAPTURED_LOOPS) == 4  # states and gradients at 7 and 9 positions


def test_floater_starts_as_the_sinusoidal_table():
    spec = {"type": "floater", "rtol": 1e-6, "atol": 1e-7}
    model = transformers.AutoModel.from_config(make_config("gpt2", spec))  # not perturbed
    table = model.position_encoding.generate_table(20)
    torch.testing.assert_close(table, sinusoidal_table(torch.arange(20)[None], 32, 10000.0)[0], atol=1e-4, rtol=0)


def test_floater_gradients_flow_through_the_solver():
    encoding = scheme_module("gpt2", "floater").train()
    encoding.generate_table(15).square().sum().backward()
    for name in ("initial", "frequencies", "inner.weight", "outer.weight"):
        assert encoding.get_parameter(name).grad.abs().sum() > 0, name


def test_floater_without_torchdiffeq_names_the_package(monkeypatch):
    encoding = scheme_module("gpt2", "floater")
    monkeypatch.setitem(sys.modules, "torchdiffeq", None)
    with pytest.raises(ImportError, match=r"torchdiffeq.*pip install torchdiffeq"):
        encoding.generate_table(5)


@pytest.mark.parametrize("scheme", ["recurrent", "floater"])
def test_generated_table_is_cached_in_eval_until_weights_change_or_a_longer_input(scheme, monkeypatch):
    encoding = scheme_module("gpt2", scheme)
    lengths = []
    original = type(encoding).generate_table

    def counting(self, length):
        lengths.append(length)
        return original(self, length)

    monkeypatch.setattr(type(encoding), "generate_table", counting)
    x = torch.zeros(1, 6, 32)
    with torch.no_grad():
        first = encoding.embed(EmbeddingInputs(x, torch.arange(6)[None]))
        again = encoding.embed(EmbeddingInputs(x[:, :3], torch.arange(3)[None]))
        assert lengths == [6]
        torch.testing.assert_close(again, first[:, :3])
        encoding.embed(EmbeddingInputs(x, torch.arange(2, 8)[None]))  # longer
        assert lengths == [6, 8]
        encoding.initial.add_(1.0)  # an in-place update, as an optimizer step does
        changed = encoding.embed(EmbeddingInputs(x, torch.arange(6)[None]))
        assert lengths == [6, 8, 6]
        assert not torch.equal(changed, first)
    encoding.embed(EmbeddingInputs(x, torch.arange(6)[None]))  # gradients on: never cached
    encoding.train()
    with torch.no_grad():
        encoding.embed(EmbeddingInputs(x, torch.arange(6)[None]))
    assert lengths == [6, 8, 6, 6, 6]


@pytest.mark.parametrize("update", ["fused_adamw", "data_add"])
@pytest.mark.parametrize("scheme", ["recurrent", "floater"])
def test_generated_table_follows_updates_that_skip_the_version_counter(scheme, update):
    """Fused AdamW (Trainer's default) and ``p.data`` writes leave ``p._version`` alone: evaluate, update, evaluate
    must equal a fresh model with the updated weights."""
    model, ids = make_model("gpt2", scheme), random_ids(2, 12)
    parameters = list(model.base_model.position_encoding.parameters())
    versions = [p._version for p in parameters]
    with torch.no_grad():
        before = model(ids).logits
    if update == "fused_adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        model.train()
        for _ in range(5):
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
    else:
        for p in parameters:
            p.data.add_(0.1)
    assert [p._version for p in parameters] == versions  # the counter did not move: the case to catch
    fresh = make_model("gpt2", scheme, seed=1)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        after, expected = model(ids).logits, fresh(ids).logits
    assert (after - before).abs().max() > 1e-2
    torch.testing.assert_close(after, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("table", ["learned", "sinusoidal"])
def test_multiplicative_is_x_times_p(family, table):
    encoding = scheme_module(family, {"type": "multiplicative", "table": table})
    x = torch.randn(2, 3, 32)
    positions = torch.tensor([[0, 1, 7], [39, 2, 2]])
    if table == "learned":
        p = encoding.table.weight[positions]
    else:
        p = 1 + torch.tensor(
            [
                [[f(k / 10000 ** (2 * (d // 2) / 32)) for d, f in enumerate([math.sin, math.cos] * 16)] for k in row]
                for row in positions.tolist()
            ]
        )
    torch.testing.assert_close(encoding.embed(EmbeddingInputs(x, positions)), x * p)


def test_multiplicative_learned_table_starts_near_one():
    model = transformers.AutoModel.from_config(make_config("bert", "multiplicative"))  # not perturbed
    weight = model.position_encoding.table.weight
    assert abs(weight.mean().item() - 1.0) < 0.05 and abs(weight.std().item() - 0.2) < 0.05  # initializer_range 0.2


def test_hierarchical_equals_the_table_below_n_and_the_7947_formula_above(family):
    encoding = scheme_module(family, {"type": "hierarchical", "max_positions": 5, "alpha": 0.3})
    p = encoding.table.weight.detach()
    x = torch.randn(1, 8, 32)
    positions = torch.tensor([[0, 4, 5, 7, 13, 20, 24, 9]])
    expected = []
    for k in positions[0].tolist():
        if k < 5:
            expected.append(p[k])
        else:
            i, j = divmod(k, 5)
            u_i, u_j = (p[i] - 0.3 * p[0]) / 0.7, (p[j] - 0.3 * p[0]) / 0.7
            expected.append(0.3 * u_i + 0.7 * u_j)
    out = encoding.embed(EmbeddingInputs(x, positions))
    assert torch.equal(out[0, :2], x[0, :2] + p[[0, 4]])  # trained rows bit-exact
    torch.testing.assert_close(out, x + torch.stack(expected)[None])


def test_hierarchical_scheme_and_extend_positions_share_one_formula():
    from hf_posenc.position_extension import hierarchical_table

    encoding = scheme_module("gpt2", {"type": "hierarchical", "max_positions": 6})
    table = hierarchical_table(encoding.table.weight.detach(), 36, alpha=0.4)
    x = torch.zeros(1, 36, 32)
    assert torch.equal(encoding.embed(EmbeddingInputs(x, torch.arange(36)[None]))[0], table)


def test_hierarchical_past_n_squared_raises(family):
    model = make_model(family, {"type": "hierarchical", "max_positions": 4})
    with pytest.raises(ValueError, match=r"Position 16 is outside the hierarchical position table of 16 positions"):
        model(random_ids(1, 3), position_ids=torch.tensor([[0, 1, 16]]))


def test_multiplicative_learned_past_its_table_raises(family):
    model = make_model(family, "multiplicative")
    with pytest.raises(ValueError, match=r"Position 40 is outside the multiplicative position table of 40 positions"):
        model(random_ids(1, 41))


def test_complex_order_equals_the_formula_with_python_complex_numbers():
    """Word j at position k: r_j e^{i(omega_j k + theta_j)}, r and theta the polar form of its embedding's
    [real ; imaginary] halves, omega its frequencies."""
    encoding = scheme_module("gpt2", "complex_order")
    ids = torch.tensor([[5, 9, 5]])
    positions = torch.tensor([[0, 3, 17]])
    x = torch.randn(1, 3, 32)
    out = encoding.embed(EmbeddingInputs(x, positions, input_ids=ids))
    for s in range(3):
        for d in range(16):
            position_zero = complex(x[0, s, d].item(), x[0, s, 16 + d].item())
            r, theta = abs(position_zero), cmath.phase(position_zero)
            omega, k = encoding.frequencies[ids[0, s], d].item(), positions[0, s].item()
            value = r * cmath.exp(1j * (omega * k + theta))
            assert out[0, s, d].item() == pytest.approx(value.real, abs=1e-5)
            assert out[0, s, 16 + d].item() == pytest.approx(value.imag, abs=1e-5)


def test_complex_order_needs_token_ids(family):
    model = make_model(family, "complex_order")
    with pytest.raises(
        ValueError, match=r"'complex_order' reads each token's frequencies by its id and needs input_ids"
    ):
        model(inputs_embeds=torch.randn(1, 4, 32))


@pytest.mark.parametrize("scheme", ["complex_order", "floater"])
def test_odd_hidden_size_is_refused_when_the_config_is_built(scheme):
    with pytest.raises(ValueError, match=rf"{scheme} needs an even hidden_size.*got 33"):
        make_config("gpt2", scheme, n_embd=33, n_head=3)
    with pytest.raises(ValueError, match=rf"{scheme} needs an even hidden_size.*got 33"):
        make_config("bert", scheme, hidden_size=33, num_attention_heads=3)


def test_multiplicative_refuses_max_positions_with_the_sinusoidal_table():
    with pytest.raises(ValueError, match=r"option 'max_positions'=64 has no effect here: table='sinusoidal' has no"):
        make_config("gpt2", {"type": "multiplicative", "table": "sinusoidal", "max_positions": 64})
    config = make_config("gpt2", {"type": "multiplicative", "table": "sinusoidal"})
    assert config.position_encoding["max_positions"] is None
    assert make_config("gpt2", config.position_encoding).position_encoding == config.position_encoding  # reloads
    assert make_config("gpt2", "multiplicative").position_encoding["max_positions"] == 40


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_multiplicative_sinusoidal_config_saved_with_the_filled_in_length_loads(tmp_path, family):
    """Configs saved before the refusal hold ``max_positions`` = the model's length (40 here), filled in though it
    had no effect: they load, without it; a different value is still refused."""
    make_config(family, "learned").save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["position_encoding"] = {
        "type": "multiplicative",
        "table": "sinusoidal",
        "max_positions": 40,
        "base": 10000.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(saved))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert config.position_encoding == {
        "type": "multiplicative",
        "table": "sinusoidal",
        "max_positions": None,
        "base": 10000.0,
    }
    transformers.AutoModel.from_config(config)
    saved["position_encoding"]["max_positions"] = 64
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"option 'max_positions'=64 has no effect here"):
        transformers.AutoConfig.from_pretrained(tmp_path)


FLOAT_OPTIONS = [
    (catalogue, name, key)
    for catalogue, listing in (
        ("position_encoding", hf_posenc.list_position_encodings()),
        ("attention_normalizer", hf_posenc.list_attention_normalizers()),
    )
    for name in listing
    for key, option in (POSITION_ENCODINGS if catalogue == "position_encoding" else ATTENTION_NORMALIZERS)[
        name
    ].options.items()
    if float in option.types
]


@pytest.mark.parametrize(("catalogue", "name", "key"), FLOAT_OPTIONS)
def test_every_float_option_takes_an_int(catalogue, name, key):
    """Ints such as ``atol=0`` are numbers like any other: a float option checks an int's range, never its type,
    and stores it as a float."""
    option = (POSITION_ENCODINGS if catalogue == "position_encoding" else ATTENTION_NORMALIZERS)[name].options[key]
    for value in [0, 1, 2, 100] + ([round(option.default)] if option.default is not None else []):
        if option.check is None or option.check(value):
            stored = option.validate(name, key, value)
            assert stored == value and isinstance(stored, float)
        else:
            with pytest.raises(ValueError, match=rf"option '{key}'={value} is out of range"):
                option.validate(name, key, value)


@pytest.mark.parametrize("key", ["rtol", "atol", "step_size"])
def test_floater_tolerances_take_ints(key):
    config = make_config("gpt2", {"type": "floater", key: 1})
    assert config.position_encoding[key] == 1.0


def test_resize_token_embeddings_resizes_complex_order_frequencies(family, tmp_path):
    model = make_model(family, "complex_order")
    encoding = model.base_model.position_encoding
    old = encoding.frequencies.detach().clone()
    model.resize_token_embeddings(70)
    assert encoding.frequencies.shape == (70, 16)
    assert torch.equal(encoding.frequencies[:61], old)  # trained rows kept
    torch.testing.assert_close(encoding.frequencies[65], 10000.0 ** (-torch.arange(0, 32, 2) / 32))  # new: init
    output = model.get_output_embeddings()
    assert output.weight.shape[0] == 70 and output.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([[3, 69, 65, 4]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 4, 70)
    model.save_pretrained(tmp_path)
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    reloaded = auto.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, logits)
    model.resize_token_embeddings(50)
    assert encoding.frequencies.shape == (50, 16) and torch.equal(encoding.frequencies, old[:50])


def convolution_by_hand(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, left: int) -> torch.Tensor:
    """out[t, c] = bias[c] + sum_m weight[c, 0, m] x[t - left + m, c], zero outside the sequence."""
    seq, channels = x.shape
    out = torch.zeros(seq, channels)
    for t in range(seq):
        for c in range(channels):
            total = bias[c].item()
            for m in range(weight.shape[-1]):
                source = t - left + m
                if 0 <= source < seq:
                    total += weight[c, 0, m].item() * x[source, c].item()
            out[t, c] = total
    return out


@pytest.mark.parametrize(("family", "left"), [("bert", 1), ("gpt2", 3)])
def test_conv_equals_a_hand_computed_convolution(family, left):
    encoding = scheme_module(family, {"type": "conv", "kernel_size": 4})
    x = torch.randn(1, 5, 32)
    expected = x[0] + convolution_by_hand(x[0], encoding.conv.weight, encoding.conv.bias, left)
    torch.testing.assert_close(encoding.embed(EmbeddingInputs(x, torch.arange(5)[None]))[0], expected)


def test_conv_zeroes_padding_before_convolving():
    encoding = scheme_module("bert", {"type": "conv", "kernel_size": 3})
    x = torch.randn(1, 5, 32)
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    out = encoding.embed(EmbeddingInputs(x, torch.arange(5)[None], attention_mask=mask))
    alone = encoding.embed(EmbeddingInputs(x[:, :3], torch.arange(3)[None]))
    torch.testing.assert_close(out[:, :3], alone)


def test_causal_conv_never_reads_a_later_token():
    model = make_model("gpt2", {"type": "conv", "kernel_size": 5})
    ids = random_ids(1, 9)
    changed = ids.clone()
    changed[0, 5] = (ids[0, 5] + 1) % 61
    with torch.no_grad():
        before, after = model(ids).logits, model(changed).logits
    assert torch.equal(before[:, :5], after[:, :5])
    assert (before[:, 5] - after[:, 5]).abs().max() > 1e-3


CONSTANT_INPUT_SPECS = {
    "recurrent": "recurrent",
    "floater": "floater",
    "multiplicative": "multiplicative",
    "hierarchical": "hierarchical",
    "complex_order": "complex_order",
    "conv": {"type": "conv", "kernel_size": 7},  # position leaks from the padding: kernel_size - 1 tokens deep
}


@pytest.mark.parametrize("scheme", NEW_SCHEMES)
def test_constant_input_gives_different_hidden_states_at_different_positions(family, scheme):
    model = make_model(family, CONSTANT_INPUT_SPECS[scheme])
    ids = torch.full((1, 6), 7)
    with torch.no_grad():
        hidden = model.base_model(ids).last_hidden_state[0]
    distances = torch.cdist(hidden, hidden)
    off_diagonal = distances[~torch.eye(6, dtype=torch.bool)]
    assert off_diagonal.min() > 1e-3, distances


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"type": "recurrent", "cell": "lstm"}, r"option 'cell'='lstm' is out of range; valid: gru, tanh"),
        ({"type": "floater", "method": "rk45"}, r"option 'method'='rk45' is out of range; valid: dopri5"),
        ({"type": "floater", "step_size": 0.3}, r"option 'step_size'=0.3 is out of range; valid: 1/m for an integer"),
        (
            {"type": "multiplicative", "table": "rope"},
            r"option 'table'='rope' is out of range; valid: 'learned' or 'sinusoidal'",
        ),
        ({"type": "hierarchical", "alpha": 1.0}, r"option 'alpha'=1.0 is out of range; valid: a number in \(0, 1\)"),
        ({"type": "conv", "kernel_size": 1}, r"option 'kernel_size'=1 is out of range; valid: an int >= 2"),
    ],
)
def test_bad_options_of_the_new_schemes_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        hf_posenc.PosEncGPT2Config(position_encoding=spec)


def test_table_length_defaults_are_written_into_the_config():
    config = hf_posenc.PosEncBertConfig(position_encoding="hierarchical", max_position_embeddings=64)
    assert config.position_encoding == {"type": "hierarchical", "max_positions": 64, "alpha": 0.4}


@pytest.mark.parametrize("scheme", ["conv", "floater"])
def test_remote_code_needs_torchdiffeq_only_for_floater(scheme, tmp_path):
    """absolute_encodings.py is copied with every saved model: without torchdiffeq (and without hf_posenc) a saved
    model of another scheme loads and runs, and a floater model loads and names the package when it runs."""
    from test_remote_code import LOAD_WITHOUT_HF_POSENC

    model = make_model("gpt2", scheme)
    model.save_pretrained(tmp_path)
    ids = random_ids(1, 5)
    torch.save(ids, tmp_path / "ids.pt")
    script = 'import sys\nsys.modules["torchdiffeq"] = None\n' + LOAD_WITHOUT_HF_POSENC
    command = [sys.executable, "-c", script, str(tmp_path), "AutoModelForCausalLM"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    if scheme == "floater":
        assert result.returncode != 0
        assert "pip install torchdiffeq" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(torch.load(tmp_path / "AutoModelForCausalLM.pt"), expected, atol=1e-5, rtol=1e-4)
