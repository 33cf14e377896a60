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
