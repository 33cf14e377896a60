"""benchmarks/drope_recalibration_curve.py: DroPE's runs grouped by recalibration steps, mean ± sample standard
deviation over seeds (a hand computation), the untrained rows once per seed, and the plot written."""

from __future__ import annotations

import json

from conftest import load_benchmark


def write_run(folder, seed: float, steps: int) -> None:
    """A results.json as ``retrofit --drope`` writes it: stock and dropped (the same for a seed), then the two
    trained rows."""
    folder.mkdir(parents=True)
    rows = [
        {"model": "stock", "steps": 0, "1x": 1.5 + seed, "8x": 3.0 + seed},
        {"model": "dropped", "steps": 0, "1x": 3.5 + seed, "8x": 4.0 + seed},
        {"model": "recalibrated", "steps": steps, "1x": 2.0 + seed + 1 / steps, "8x": 2.1 + seed},
        {"model": "continued", "steps": steps, "1x": 1.6 + seed, "8x": 3.1 + seed},
    ]
    (folder / "results.json").write_text(json.dumps(rows))


def test_table_groups_by_steps_and_counts_each_seed_once(monkeypatch, tmp_path):
    curve = load_benchmark(monkeypatch, "drope_recalibration_curve")
    folders = []
    for seed in (0, 1):
        for steps in (30, 150):
            folders.append(tmp_path / f"drope-seed{seed}-{steps}")
            write_run(folders[-1], 0.1 * seed, steps)
    grouped = curve.read_runs(folders)
    text = curve.table(grouped, ["1x", "8x"])
    lines = text.splitlines()
    # stock at 1x: 1.5 and 1.6 (once per seed though two runs each): mean 1.55, sd 0.0707
    assert "| stock | 0 | 1.550 ± 0.071 | 3.050 ± 0.071 | 2 |" in lines
    # recalibrated 30 steps at 1x: 2.0 + 1/30 and 2.1 + 1/30
    assert f"| recalibrated | 30 | {2.05 + 1 / 30:.3f} ± 0.071 | 2.150 ± 0.071 | 2 |" in lines
    assert [line.split(" | ")[0:2] for line in lines[2:]] == [
        ["| stock", "0"], ["| dropped", "0"], ["| recalibrated", "30"], ["| continued", "30"],
        ["| recalibrated", "150"], ["| continued", "150"],
    ]  # fmt: skip
    curve.plot(grouped, ["1x", "8x"], tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0
