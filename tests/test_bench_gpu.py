"""The GPU benchmark's smoke mode on CPU: tiny model and shapes, a few schemes, every row timed or explained."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_benchmark

from hf_posenc import attention_backends
from hf_posenc.attention_backends import choose_route
from hf_posenc.configuration_posenc import resolve_attention_normalizer
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import ForwardFacts


def test_bench_gpu_tiny_on_cpu_times_stock_and_each_scheme_on_the_backend_that_ran(tmp_path, monkeypatch):
    """Each row names the backend the model actually chose during its timed steps: a CPU training step refuses
    FlexAttention, so the explicit flex request shows that it ran SDPA."""
    output = tmp_path / "bench.md"
    argv = ["--device", "cpu", "--tiny", "--families", "gpt2", "--schemes", "alibi", "t5", "--normalizers", "softmax"]
    argv += ["--backends", "sdpa", "flex_attention", "--warmup", "0", "--repeats", "1", "--no-x-transformers"]
    rows = load_benchmark(monkeypatch, "bench_gpu").main([*argv, "--output", str(output)])
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
    bench = load_benchmark(monkeypatch, "bench_gpu")
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


def test_the_old_routing_is_selectable_row_by_row_and_restored(monkeypatch):
    """``--routings new old``: each default row also runs on the routing before the routing table (layer terms and
    dense biases on SDPA on CUDA, the single 64 x 64 one-stage tile); the library's routing is back afterwards."""
    bench = load_benchmark(monkeypatch, "bench_gpu")
    args = bench.argparse.Namespace(
        families=["gpt2"], schemes=["shaw"], normalizers=["softmax"], backends=[], routings=["new", "old"]
    )
    planned = bench.plans(args, [(8, 2048)], have_x=False)
    assert [(plan.model, plan.requested) for plan in planned] == [
        ("stock", "default"),
        ("shaw", "default"),
        ("shaw (old routing)", "default"),
    ]
    only_old = bench.plans(bench.argparse.Namespace(**{**vars(args), "routings": ["old"]}), [(1, 8192)], False)
    assert [plan.model for plan in only_old] == ["stock", "shaw (old routing)"]
    facts = ForwardFacts(torch.device("cuda"), torch.bfloat16, 64, 2048, num_heads=12, consecutive=True)
    shaw = {"type": "shaw", **{key: option.default for key, option in POSITION_ENCODINGS["shaw"].options.items()}}
    softmax = resolve_attention_normalizer("softmax")
    with bench.routing("old"):
        assert choose_route("sdpa", shaw, softmax, facts).backend == "sdpa"
        assert attention_backends.FLEX_CUDA_KERNEL_OPTIONS == {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1}
    assert choose_route("sdpa", shaw, softmax, facts).backend == "flex_attention"
    assert "bwd_num_stages" in attention_backends.FLEX_CUDA_KERNEL_OPTIONS
    with pytest.raises(ValueError, match="routing 'older'; valid: \\['new', 'old'\\]"), bench.routing("older"):
        pass


def test_the_kernel_option_sweep_lists_its_sets_and_dry_runs_on_cpu(monkeypatch, capsys):
    """6-8 option sets, the library's and the previous one among them, every name a FlexKernelOptions name (checked
    with the fwd_/bwd_ prefixes), the per-distance score_mod equal to eager attention with the table added."""
    sweep = load_benchmark(monkeypatch, "flex_kernel_options")
    sweep.main(["--list"])
    listed = capsys.readouterr().out.splitlines()
    assert 6 <= len(listed) <= 8 and listed[0].startswith("library: ")
    assert any(line.startswith("previous (64x64, 1 stage, both passes): ") for line in listed)
    sweep.main(["--dry-run"])
    assert "dry run: option names valid" in capsys.readouterr().out
    with pytest.raises(ValueError, match="kernel option 'fwd_BLOCK_Q' is not a FlexKernelOptions name"):
        sweep.check_option_names({"fwd_BLOCK_Q": 64})


ISSUE_ROWS = {
    "bert": ["shaw", "xlnet", "deberta", "relative_key", "recurrent", "floater", "t5", "kerple", "tupe", "fire"]
    + ["alibi", "learned + swish_l2", "learned + softpick", "learned + sigmoid", "learned + l2"],
    "gpt2": ["cope", "path", "fox", "learned + stick_breaking"],
}
CHANGED_BY_ROUTING = ["shaw", "xlnet", "deberta", "relative_key", "alibi", "fire", "t5", "kerple", "tupe"]


def test_run_on_gpu_dry_run_lists_every_row_of_the_table_at_both_shapes_and_both_routings(tmp_path):
    """``DRY_RUN=1 bash benchmarks/run_on_gpu.sh`` prints its commands and the rows they plan, runs nothing: every row
    of the GPU-speed table in both families (GPT-2 only for the decoder-only ones) at 8 x 2048 and 1 x 8192 on the
    new routing, the rows the routing changed also on the old one, stock beside them, and the sweep's sets."""
    root = Path(__file__).resolve().parents[1]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # the script calls python3
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "DRY_RUN": "1", "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", "benchmarks/run_on_gpu.sh"], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = set(done.stdout.splitlines())
    for shape in ("8x2048", "1x8192"):
        for family in ("bert", "gpt2"):
            assert f"{family} {shape} stock default" in rows
            for model in ISSUE_ROWS["bert"] + (ISSUE_ROWS["gpt2"] if family == "gpt2" else []):
                assert f"{family} {shape} {model} default" in rows, (family, shape, model)
            for model in CHANGED_BY_ROUTING + (["fox"] if family == "gpt2" else []):
                assert f"{family} {shape} {model} (old routing) default" in rows, (family, shape, model)
    assert any(line.startswith("library: ") for line in rows)
    assert not (tmp_path / "out").exists()  # nothing ran
