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


def test_bench_gpu_tiny_on_cpu_times_stock_and_each_scheme(tmp_path, monkeypatch):
    output = tmp_path / "bench.md"
    argv = ["--device", "cpu", "--tiny", "--families", "gpt2", "--schemes", "alibi", "t5", "--normalizers", "softmax"]
    argv += ["--backends", "sdpa", "--warmup", "0", "--repeats", "1", "--no-x-transformers", "--output", str(output)]
    rows = load_benchmark(monkeypatch).main(argv)
    assert [(row.model, row.requested, row.runs_on) for row in rows] == [
        ("stock", "sdpa", "sdpa"),
        ("alibi", "default", "sdpa"),
        ("t5", "default", "sdpa"),
    ]
    assert all(row.ms > 0 and not row.error for row in rows)
    table = output.read_text()
    assert "| gpt2 | 2x16 | t5 | default -> sdpa |" in table and "torch " in table.splitlines()[0]
