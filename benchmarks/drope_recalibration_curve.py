"""DroPE's recalibration curve: the held-out loss of a RoPE decoder dropped to NoPE and recalibrated for a fraction of
its pretraining steps, beside the same decoder trained as many steps more with RoPE, over seeds.

It reads the folders ``hf-posenc retrofit --drope --recalibration_fraction F --output_dir DIR`` wrote (their
``results.json``: the loss at each length factor of the model as pretrained, dropped, recalibrated and continued),
groups them by recalibration steps, and writes a table (mean ± sample standard deviation over the seeds) and a plot of
the loss at each length factor against the steps (``docs/benchmarks.md``, "DroPE at the main job's scale").

    python benchmarks/drope_recalibration_curve.py runs/drope-seed*-f* --output docs/images/drope_curve.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def mean_and_spread(values: list[float]) -> str:
    """``mean ± sample standard deviation`` (the spread 0 for a single value)."""
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {spread:.3f}"


def read_runs(folders: list[Path]) -> dict[tuple[str, int], list[dict]]:
    """Each model's rows (``stock``, ``dropped``, ``recalibrated``, ``continued``) grouped by (model, steps)."""
    grouped: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for folder in folders:
        for row in json.loads((folder / "results.json").read_text()):
            grouped[(row["model"], row["steps"])].append(row)
    return grouped


def table(grouped: dict[tuple[str, int], list[dict]], factors: list[str]) -> str:
    """The markdown table, one line per (model, steps); the rows without training (stock, dropped) once each."""
    lines = [f"| model | steps | {' | '.join(factors)} | seeds |", "|---|---:|" + "---:|" * len(factors) + "---:|"]
    order = {"stock": 0, "dropped": 1, "recalibrated": 2, "continued": 3}
    for model, steps in sorted(grouped, key=lambda key: (key[1], order[key[0]])):
        rows = grouped[(model, steps)]
        if model in ("stock", "dropped"):  # the same model in every run of a seed: count each seed once
            rows = list({json.dumps(row, sort_keys=True): row for row in rows}.values())
        cells = " | ".join(mean_and_spread([row[factor] for row in rows]) for factor in factors)
        lines.append(f"| {model} | {steps} | {cells} | {len(rows)} |")
    return "\n".join(lines) + "\n"


def plot(grouped: dict[tuple[str, int], list[dict]], factors: list[str], output: Path) -> None:
    """The loss at each factor against the recalibration steps: DroPE and RoPE continued, mean with the spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(factors), figsize=(4 * len(factors), 3.4), sharey=True)
    for axis, factor in zip(axes, factors, strict=True):
        for model, label in (
            ("recalibrated", "dropped to NoPE, recalibrated (DroPE)"),
            ("continued", "RoPE, trained on"),
        ):
            steps = sorted(step for name, step in grouped if name == model)
            values = [[row[factor] for row in grouped[(model, step)]] for step in steps]
            means = [statistics.fmean(value) for value in values]
            spreads = [statistics.stdev(value) if len(value) > 1 else 0.0 for value in values]
            axis.errorbar(steps, means, yerr=spreads, marker="o", capsize=3, label=label)
        axis.set_xscale("log")
        axis.set_xticks(steps, [str(step) for step in steps])
        axis.minorticks_off()
        axis.set_title(f"{factor} the training length")
        axis.set_xlabel("steps after pretraining")
    axes[0].set_ylabel("held-out loss (nats/byte)")
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="retrofit --drope output folders (results.json)")
    parser.add_argument("--output", type=Path, default=Path("drope_curve.png"), help="the plot")
    args = parser.parse_args()
    missing = [str(folder) for folder in args.folders if not (folder / "results.json").is_file()]
    if missing:
        parser.error(f"no results.json in {missing}: give the folders hf-posenc retrofit --drope wrote")
    grouped = read_runs(args.folders)
    factors = [key for key in next(iter(grouped.values()))[0] if key.endswith("x")]
    print(table(grouped, factors))
    plot(grouped, factors, args.output)
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
