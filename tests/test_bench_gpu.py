"""The GPU benchmark's smoke mode on CPU: tiny model and shapes, a few schemes, every row timed or explained."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_benchmark(monkeypatch):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bench_gpu_tiny_on_cpu_times_stock_and_each_scheme_on_the_backend_that_ran(tmp_path, monkeypatch):
    """Each row names the backend the model actually chose during its timed steps: a CPU training step refuses
    FlexAttention, so the explicit flex request shows that it ran SDPA."""
    output = tmp_path / "bench.md"
    argv = ["--device", "cpu", "--tiny", "--families", "gpt2", "--schemes", "alibi", "t5", "--normalizers", "softmax"]
    argv += ["--backends", "sdpa", "flex_attention", "--warmup", "0", "--repeats", "1", "--no-x-transformers"]
    rows = load_benchmark(monkeypatch).main([*argv, "--output", str(output)])
    assert [(row.model, row.requested, row.runs_on) for row in rows] == [
        ("stock", "sdpa", "sdpa"),
        ("alibi", "default", "sdpa"),
        ("alibi", "flex_attention", "sdpa"),
        ("t5", "default", "sdpa"),
        ("t5", "flex_attention", "sdpa"),
    ]
    assert all(row.ms > 0 and not row.error for row in rows)
    table = output.read_text()
    assert "| gpt2 | 2x16 | t5 | default -> sdpa |" in table and "| t5 | flex_attention -> sdpa |" in table
    assert "torch " in table.splitlines()[0]


def test_bench_gpu_compiles_rows_in_worker_processes_and_lists_rows_past_the_time_budget(monkeypatch, capsys):
    """``--compile-jobs``: each row runs a step in a spawned process first, and the rows are still timed; with
    ``--time-budget 0`` no row starts, and each is listed as not run."""
    bench = load_benchmark(monkeypatch)
    monkeypatch.syspath_prepend(str(Path(bench.__file__).parent))  # the spawned workers import bench_gpu by name
    argv = ["--device", "cpu", "--tiny", "--families", "gpt2", "--schemes", "alibi", "--normalizers", "softmax"]
    argv += ["--backends", "--warmup", "0", "--repeats", "1", "--no-x-transformers"]
    rows = bench.main([*argv, "--compile-jobs", "1", "--time-budget", "600"])
    assert [(row.model, row.runs_on) for row in rows] == [("stock", "sdpa"), ("alibi", "sdpa")]
    assert all(row.ms > 0 and not row.error for row in rows)
    assert "precompile: 2 of 2 rows" in capsys.readouterr().out
    late = bench.main([*argv, "--time-budget", "0"])
    assert [(row.model, row.ms, row.error) for row in late] == [
        ("stock", None, "not run: --time-budget spent"),
        ("alibi", None, "not run: --time-budget spent"),
    ]
