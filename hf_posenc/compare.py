"""``hf-posenc compare``: the main job. Pretrain one small model per position encoding x attention normalizer on
an equal budget, then report for each: loss at the training length, loss at 2x, 4x, 8x that length (sliding
windows, :mod:`hf_posenc.extrapolation`), the position probe (relative fit error), parameters and tokens/s.
Writes ``compare.md``, ``compare.json`` and ``compare.png`` to ``--output_dir`` and the models under ``models/``.

The recipe is one for every scheme (``hf_posenc.pretraining``): the same data (the embedded corpus by default, as
bytes), seed, batches, steps, AdamW with linear warm-up and cosine decay, gradient clipping, and no weight decay on
any embedding table, so that no scheme's position parameters are pulled to zero; each scheme's own parameters start
as its reference initialises them (:func:`hf_posenc.pretraining.reference_init`). Only the position encoding and the
normalizer differ between runs. Torch runs ``--threads`` threads per process (default 1: on a shared 2-core CPU the
fastest, and a rerun gives the same numbers)::

    hf-posenc compare                    # decoders, 6 schemes, softmax, one thread: 11-19 min on 2 CPU cores
    hf-posenc compare --schemes rope alibi --normalizers softmax l2 --encoders --max_train_steps 2000
    accelerate launch -m hf_posenc_cli compare ...       # the same on accelerate's devices
"""

from __future__ import annotations

import argparse
import json
import math
import time
from functools import partial
from pathlib import Path
from typing import Any

import transformers
from accelerate.utils import broadcast_object_list

import hf_posenc
from hf_posenc_cli.arguments import compare_parser

from . import pretraining
from .extrapolation import evaluation_ids, extrapolation_row, format_cell
from .recipe_common import checked_input, hub_repository, recipe_accelerator, torch_threads


TASK_NAMES = {"clm": "decoder (causal LM)", "mlm": "encoder (masked LM)"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = compare_parser()
    args = parser.parse_args(argv)
    for flag, catalogue in (
        ("schemes", hf_posenc.list_position_encodings()),
        ("normalizers", hf_posenc.list_attention_normalizers()),
    ):
        if "all" in getattr(args, flag):
            setattr(args, flag, list(catalogue))
    if any(factor < 1 for factor in args.factors):
        parser.error(f"--factors must be >= 1, got {args.factors}")
    args.factors = tuple(sorted(set(args.factors)))
    if args.train_file is not None and not args.train_file.is_file():
        parser.error(f"--train_file {args.train_file} does not exist")
    if args.tokenizer_name is not None:
        load_tokenizer = partial(pretraining.load_tokenizer, task="mlm" if args.encoders else "clm")
        checked_input(parser, "--tokenizer_name", args.tokenizer_name, load_tokenizer)
    return args


def run_name(task: str, scheme: str, normalizer: str) -> str:
    """One run's folder under ``models/`` and the suffix of its Hub repository."""
    return f"{task}-{scheme}-{normalizer}"


def recipe_argv(args: argparse.Namespace, task: str, scheme: str, normalizer: str, output_dir: Path) -> list[str]:
    """The pretraining command line of one run: everything shared, except the scheme and the normalizer; with
    ``--push_to_hub`` the run uploads to ``<--hub_model_id>-<task>-<scheme>-<normalizer>``."""
    argv = ["--task", task, "--position_encoding", scheme, "--attention_normalizer", normalizer]
    for flag in ("block_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_train_steps"):
        argv += [f"--{flag}", str(getattr(args, flag))]
    for flag in ("num_warmup_steps", "learning_rate", "per_device_train_batch_size", "per_device_eval_batch_size"):
        argv += [f"--{flag}", str(getattr(args, flag))]
    argv += ["--eval_steps", str(args.eval_steps), "--seed", str(args.seed)]
    if args.with_tracking:
        argv += ["--with_tracking", "--report_to", args.report_to]
    if args.train_file is not None:
        argv += ["--train_file", str(args.train_file)]
    if args.tokenizer_name is not None:
        argv += ["--tokenizer_name", args.tokenizer_name]
    if args.push_to_hub:
        prefix = args.hub_model_id or args.output_dir.resolve().name
        argv += ["--push_to_hub", "--hub_model_id", f"{prefix}-{run_name(task, scheme, normalizer)}"]
        argv += ["--hub_token", args.hub_token] if args.hub_token is not None else []
    return [*argv, "--output_dir", str(output_dir)]


def position_probe(task: str, scheme: str, normalizer: str, steps: int, accelerator) -> float:
    """The position probe's relative fit error (:func:`hf_posenc.probe`: final mean squared error over
    the variance of the targets; about 1 for a model that cannot tell positions apart) in the task's family. One
    small model on one thread: the main process runs it and the others receive the result."""
    family = "gpt2" if task == "clm" else "bert"
    result = [None]
    if accelerator.is_main_process:
        probe = hf_posenc.probe(scheme, attention_normalizer=normalizer, family=family, steps=steps, progress_bar=True)
        result = [probe["relative_mse"]]
    return broadcast_object_list(result)[0]


def compare_table(rows: list[dict[str, Any]], factors: tuple[int, ...]) -> str:
    """The markdown table of one model family."""
    header = ["scheme", "normalizer", "eval loss", *[f"{f}x" for f in factors], f"{factors[-1]}x / 1x"]
    header += ["probe rel. MSE"]
    header += ["parameters", "tokens/s", "train s"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    for row in rows:
        first, last = row["extrapolation"].get(f"{factors[0]}x"), row["extrapolation"].get(f"{factors[-1]}x")
        ratio = last / first if isinstance(first, float) and isinstance(last, float) else None
        cells = [row["scheme"], row["normalizer"], format_cell(row["eval_loss"])]
        cells += [format_cell(row["extrapolation"].get(f"{f}x")) for f in factors] + [format_cell(ratio, 2)]
        cells += [format_cell(row["probe"])]
        cells += [f"{row['num_parameters']:,}", f"{row['tokens_per_second']:,.0f}", f"{row['train_seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    for row in rows:
        reasons = {f: row["extrapolation"][f"{f}x"] for f in factors if isinstance(row["extrapolation"][f"{f}x"], str)}
        if reasons:
            where = ", ".join(f"{f}x" for f in reasons)
            notes.append(f"{row['scheme']} + {row['normalizer']}, n/a at {where}: {next(iter(reasons.values()))}.")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def plot_comparison(rows: list[dict[str, Any]], factors: tuple[int, ...], path: Path) -> None:
    """Per family: the training curves (the held-out loss as markers), and the held-out loss against the evaluation
    length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(row["task"] for row in rows))
    figure, axes = plt.subplots(len(tasks), 2, figsize=(12, 4.5 * len(tasks)), squeeze=False)
    for (curves, lengths), task in zip(axes, tasks, strict=True):
        for row in (row for row in rows if row["task"] == task):
            label = f"{row['scheme']} + {row['normalizer']}"
            steps, losses = zip(*row["loss_curve"], strict=True)
            (line,) = curves.plot(steps, losses, label=label, linewidth=1, marker="." if len(steps) < 30 else None)
            if row["eval_curve"]:
                curves.plot(
                    *zip(*row["eval_curve"], strict=True), linestyle="none", marker="o", color=line.get_color()
                )
            points = [(f, row["extrapolation"].get(f"{f}x")) for f in factors]
            points = [(f, loss) for f, loss in points if isinstance(loss, float)]
            if points:
                lengths.plot(*zip(*points, strict=True), marker="o", label=label)
        curves.set_title(f"{TASK_NAMES[task]}: training loss (lines), held-out loss (dots)")
        curves.set_xlabel("optimizer step")
        curves.set_ylabel("loss (nats per token)")
        lengths.set_title(f"{TASK_NAMES[task]}: held-out loss on the last positions")
        lengths.set_xscale("log", base=2)
        lengths.set_xticks(list(factors), [f"{f}x" for f in factors])
        lengths.set_xlabel("evaluation length / training length")
        lengths.set_ylabel("loss (nats per token)")
        for axis in (curves, lengths):
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def smoothed_curve(log_path: Path, points: int = 100) -> list[tuple[int, float]]:
    """The training loss from ``train_log.jsonl``: every step of a run of up to ``points`` steps, else the mean of
    consecutive windows (the last one may be shorter), at most ``points`` of them, so every run length shows its
    whole curve."""
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    every = max(1, math.ceil(len(records) / points))
    windows = [records[i : i + every] for i in range(0, len(records), every)]
    return [(window[-1]["step"], sum(r["loss"] for r in window) / len(window)) for window in windows]


def eval_curve(log_path: Path) -> list[tuple[int, float]]:
    """``(step, held-out loss)`` of every evaluation in ``train_log.jsonl``."""
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    return [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    tasks = ["clm", "mlm"] if args.encoders else ["clm"]
    runs = [(task, scheme, normalizer) for task in tasks for scheme in args.schemes for normalizer in args.normalizers]
    for run in runs:  # before any work: every Hub target is created (or found); each run uploads its model
        hub_repository(args, f"-{run_name(*run)}")
    accelerator = recipe_accelerator(args)
    with torch_threads(args.threads) as threads:
        accelerator.print(f"compare: {threads} torch thread(s) per process (--threads)")
        started = time.perf_counter()
        rows = [compare_run(args, run, accelerator) for run in runs]
        if accelerator.is_main_process:
            write_report(args, rows, time.perf_counter() - started, threads)
    accelerator.wait_for_everyone()
    return rows


def compare_run(args: argparse.Namespace, run: tuple[str, str, str], accelerator) -> dict[str, Any]:
    """Pretrain one model (``run``: task, scheme, normalizer), score it at every length and probe it: its row."""
    task, scheme, normalizer = run
    model_dir = args.output_dir / "models" / run_name(task, scheme, normalizer)
    run_started = time.perf_counter()
    results = pretraining.main(recipe_argv(args, task, scheme, normalizer, model_dir))
    train_seconds = time.perf_counter() - run_started
    auto_class = transformers.AutoModelForCausalLM if task == "clm" else transformers.AutoModelForMaskedLM
    model = auto_class.from_pretrained(model_dir).to(accelerator.device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = evaluation_ids(tokenizer, args.train_file, 5, args.max_eval_tokens)
    mask_token_id = tokenizer.mask_token_id if task == "mlm" else None
    extrapolation = extrapolation_row(
        model, ids, args.block_size, args.factors, args.per_device_eval_batch_size, mask_token_id, args.seed,
        accelerator,
    )  # fmt: skip
    losses = ", ".join(f"{factor} {format_cell(loss)}" for factor, loss in extrapolation.items())
    accelerator.print(f"{task} {scheme} + {normalizer}: {losses}")
    return {
        "task": task,
        "scheme": scheme,
        "normalizer": normalizer,
        "eval_loss": results["eval_loss"],
        "eval_accuracy": results["eval_accuracy"],
        "extrapolation": extrapolation,
        "probe": position_probe(task, scheme, normalizer, args.probe_steps, accelerator),
        "num_parameters": results["num_parameters"],
        "tokens_per_second": results["tokens_per_second"],
        "train_seconds": train_seconds,
        "reference_init": results["reference_init"],
        "loss_curve": smoothed_curve(model_dir / "train_log.jsonl"),
        "eval_curve": eval_curve(model_dir / "train_log.jsonl"),
    }


def write_report(args: argparse.Namespace, rows: list[dict[str, Any]], wall_seconds: float, threads: int) -> None:
    """``compare.md``, ``compare.json`` and ``compare.png`` in ``--output_dir``; the table printed."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    for task in dict.fromkeys(row["task"] for row in rows):
        family_rows = [row for row in rows if row["task"] == task]
        sections.append(f"### {TASK_NAMES[task]}\n\n" + compare_table(family_rows, args.factors))
    notes = [
        f"{args.max_train_steps} steps x {args.per_device_train_batch_size} blocks of {args.block_size} tokens, "
        f"width {args.hidden_size}, {args.num_hidden_layers} layers, {args.num_attention_heads} heads; "
        f"{wall_seconds / 60:.1f} min in all, {threads} torch thread(s) per process.",
        "eval loss: nats per token on the held-out blocks at the training length; Nx: nats per token on the last "
        f"{args.block_size} positions of sliding windows N times the training length; n/a: the model cannot run "
        "at that length (see compare.json for its message).",
    ]
    report = "\n".join(sections) + "\n" + "\n".join(f"- {note}" for note in notes) + "\n"
    (args.output_dir / "compare.md").write_text(report)
    arguments = {key: str(value) for key, value in vars(args).items() if key != "hub_token"}
    summary = {"arguments": arguments, "wall_seconds": wall_seconds, "rows": rows}
    (args.output_dir / "compare.json").write_text(json.dumps(summary, indent=2))
    plot_comparison(rows, args.factors, args.output_dir / "compare.png")
    print("\n" + report + f"\nwritten: {args.output_dir}/compare.md, compare.json, compare.png")
