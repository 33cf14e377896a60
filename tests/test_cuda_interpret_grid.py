"""The CUDA grid's driver on CPU, without the tool or a GPU: every model of its grid is a valid config that runs, a
results file's cases (dict specs in their names) are read back for a resumed run (listed with no tool, as in a clone,
which has no ``../shared``; a run without it stops naming the path), and ``--gpu``'s case check (run here on the CPU)
passes within tolerance and records what falls outside it, in bf16 with eager's own bf16 error."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import load_benchmark

import hf_posenc


def test_every_model_of_the_grid_builds_and_runs(monkeypatch):
    grid = load_benchmark(monkeypatch, "cuda_interpret_grid")
    models = list(grid.grid_models())
    catalogue = hf_posenc.list_position_encodings()
    assert {scheme for _, scheme, normalizer in models if isinstance(scheme, str) and normalizer == "softmax"} >= set(
        catalogue
    )
    assert {normalizer for _, _, normalizer in models if isinstance(normalizer, str)} >= set(
        hf_posenc.list_attention_normalizers()
    )

    make = grid.with_layouts(grid.tiny_model)
    ids = torch.randint(3, 99, (1, grid.LENGTH))
    for family, scheme, normalizer in models:
        model = make(family, scheme, normalizer, 2, "eager")
        with torch.no_grad():
            logits = model(ids).logits
        assert logits.shape == (1, grid.LENGTH, 99) and torch.isfinite(logits).all(), (family, scheme, normalizer)
    layouts = [model for model in models if isinstance(model[1], dict) and "layout" in model[1]]
    assert [scheme["layout"] for _, scheme, _ in layouts] == list(grid.LAYOUTS)


def test_a_resumed_grid_skips_the_recorded_tasks(monkeypatch, tmp_path, capsys):
    grid = load_benchmark(monkeypatch, "cuda_interpret_grid")
    tasks = grid.tasks((32,), ("float32",))
    gated = next(task for task in tasks if isinstance(task[2], dict) and "output_gate" in task[2])
    train, infer = grid.case_names(gated)
    results = tmp_path / "grid.log"
    results.write_text(
        f"PASS {train}: loss err 0.0e+00 (max |ref| 4.6), 20 grads (5.0 s)\n"
        f"FAIL {infer} @ numbers: logits err 1.0e+00 > 1.0e-04 (max |ref| 1.2) (4.0 s)\n"
    )
    assert grid.recorded_cases(results) == [("PASS", train), ("FAIL", infer)]
    assert grid.summarize(results) == 1
    absent = tmp_path / "cuda_proxy.py"  # as in a clone, which has no ../shared/tools: listing needs no tool
    argv = ["cuda_interpret_grid.py", str(results), "--head-dims", "32", "--dtypes", "float32", "--proxy", str(absent)]
    monkeypatch.setattr(sys, "argv", [*argv, "--list"])
    assert grid.main() == 0
    listed = capsys.readouterr().out.splitlines()
    assert str(gated) not in listed and str(tasks[0]) in listed
    assert listed[-1] == f"{len(tasks) - 1} tasks left"


def test_running_the_grid_without_the_tool_names_the_missing_file(monkeypatch, tmp_path, capsys):
    grid = load_benchmark(monkeypatch, "cuda_interpret_grid")
    absent = tmp_path / "cuda_proxy.py"
    monkeypatch.setattr(sys, "argv", ["cuda_interpret_grid.py", str(tmp_path / "grid.log"), "--proxy", str(absent)])
    with pytest.raises(SystemExit) as exit_info:
        grid.main()
    assert exit_info.value.code == 2
    assert f"--proxy {absent}: no such file" in capsys.readouterr().err
    assert not (tmp_path / "grid.log").exists()


def test_the_device_check_passes_within_tolerance_and_fails_outside_it(monkeypatch):
    grid = load_benchmark(monkeypatch, "cuda_interpret_grid")
    task = ("bert", "t5", "softmax", "default", "float32", 32)
    train, infer = grid.case_names(task)
    assert train.startswith("bert t5+softmax hd32 L32 train") and infer.endswith("infer attn=default float32")
    message = grid.run_case_on_device(task, train=True, device="cpu")
    assert message.startswith("loss err ") and ", worst grad " in message and message.endswith("flex call(s) on cpu")
    monkeypatch.setitem(grid.TOLERANCE, "float32", (-1.0, 0.0))  # nothing is within a negative allowance
    with pytest.raises(grid.OutOfTolerance, match=r"^logits err .* > "):
        grid.run_case_on_device(task, train=False, device="cpu")
    monkeypatch.setitem(grid.TOLERANCE, "bfloat16", (-1.0, 0.0))  # bf16: the eager path's own bf16 error is given
    with pytest.raises(grid.OutOfTolerance, match=r"; eager under the same autocast on cpu: logits err \S+ \| "):
        grid.run_case_on_device((*task[:4], "bfloat16", 32), train=False, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the grid's cases on a CUDA device; none here")
@pytest.mark.parametrize(
    "task",
    [
        ("gpt2", "t5", "softpick", "default", "bfloat16", 32),  # a log-sum-exp normalizer, two flex passes
        ("bert", "shaw", "softmax", "flex_attention", "float32", 16),  # Shaw's value term from flex's log-sum-exp
        ("gpt2", "rope", "differential", "default", "float32", 32),
        ("gpt2", {"layout": "smollm3"}, "softmax", "flex_attention", "bfloat16", 16),  # chunked and NoPE layers
    ],
    ids=["gpt2-t5-softpick-bf16", "bert-shaw-flex-hd16", "gpt2-rope-differential", "gpt2-smollm3-flex-bf16-hd16"],
)
def test_grid_cases_on_cuda_equal_eager(monkeypatch, task):
    """A few of the grid's cases as ``--gpu`` runs them: compiled for CUDA, training and inference, against eager."""
    grid = load_benchmark(monkeypatch, "cuda_interpret_grid")
    for train in (True, False):
        assert " on " in grid.run_case_on_device(task, train=train, device="cuda")
