"""``hf-posenc compare``: the main job. Pretrain one small model per position encoding x attention normalizer on
an equal budget, then report for each: loss at the training length, loss at 2x, 4x, 8x that length (sliding
windows, :mod:`hf_posenc_recipes.extrapolate`), the position probe (relative fit error), parameters and tokens/s.
Writes ``compare.md``, ``compare.json`` and ``compare.png`` to ``--output_dir`` and the models under ``models/``.

The recipe is one for every scheme (:mod:`hf_posenc_recipes.pretrain`): the same data (the embedded corpus by
default, as bytes), seed, batches, steps, AdamW with linear warm-up and cosine decay, gradient clipping, and no
weight decay on any embedding table, so that no scheme's position parameters are pulled to zero; each scheme's own
parameters start as its reference initialises them (:func:`hf_posenc_recipes.pretrain.reference_init`). Only the
position encoding and the normalizer differ between runs. Torch runs ``--threads`` threads per process (default 1:
on a shared 2-core CPU the fastest, and a rerun gives the same numbers)::

    hf-posenc compare                    # decoders, 6 schemes, softmax, one thread: 11-19 min on 2 CPU cores
    hf-posenc compare --schemes rope alibi --normalizers softmax l2 --encoders --max_train_steps 2000
    accelerate launch -m hf_posenc_recipes compare ...       # the same on accelerate's devices
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate.utils import broadcast_object_list

import hf_posenc
from hf_posenc_recipes import long_context, pretrain
from hf_posenc_recipes.cli import run_recipe
from hf_posenc_recipes.common import (
    checked_input,
    hub_repository,
    recipe_accelerator,
    torch_threads,
    warn_short_schedule,
)
from hf_posenc_recipes.extrapolate import evaluation_ids, extrapolation_row
from hf_posenc_recipes.parsers.common import check_layout_sizes, layout_sizes, parse_scheme
from hf_posenc_recipes.parsers.compare import DEFAULT_COMPARE_SCHEMES, compare_parser, fill_task_defaults
from hf_posenc_recipes.parsers.pretrain import pretrain_parser
from hf_posenc_recipes.reporting import (
    Run,
    format_cell,
    layers_description,
    mean_and_spread,
    recipe_argv,
    run_folder,
    run_name,
    smoothed_curve,
    summary_cell,
)


TASK_NAMES = {"clm": "decoder (causal LM)", "mlm": "encoder (masked LM)"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = compare_parser()
    args = parser.parse_args(argv)
    fill_task_defaults(args)
    if args.schemes is None:
        args.schemes = [] if args.layouts else list(DEFAULT_COMPARE_SCHEMES)
    for flag, registry in (
        ("schemes", hf_posenc.list_position_encodings()),
        ("normalizers", hf_posenc.list_attention_normalizers()),
    ):
        if "all" in getattr(args, flag):
            setattr(args, flag, list(registry))
    if any(factor < 1 for factor in args.factors):
        parser.error(f"--factors must be >= 1, got {args.factors}")
    args.factors = tuple(sorted(set(args.factors)))
    if args.train_file is not None and not args.train_file.is_file():
        parser.error(f"--train_file {args.train_file} does not exist")
    if args.dataset_name is not None and args.train_file is not None:
        parser.error("give --dataset_name or --train_file, not both")
    if args.dataset_config_name is not None and args.dataset_name is None:
        parser.error("--dataset_config_name needs --dataset_name")
    if args.randomized_positions is not None and args.randomized_positions < args.block_size:
        parser.error(
            f"--randomized_positions {args.randomized_positions} must be >= --block_size {args.block_size}: a block "
            "draws that many distinct positions below it"
        )
    if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds must not repeat a seed, got {args.seeds}")
    check_layout_sizes(parser, args)
    if args.layouts and args.layer_types is not None:
        parser.error(f"--layouts {' '.join(args.layouts)} set their layers' types; drop --layer_types")
    long_context.check_compare_task(parser, args)
    chunked = [name for name in args.layouts if hf_posenc.LAYOUT_PRESETS[name].chunks]
    if chunked and args.encoders:
        parser.error(
            f"--layouts {' '.join(chunked)} have chunked attention, which is causal (no encoder form): drop --encoders"
        )
    if args.tokenizer_name is not None:
        load_tokenizer = partial(pretrain.load_tokenizer, task="mlm" if args.encoders else "clm")
        checked_input(parser, "--tokenizer_name", args.tokenizer_name, load_tokenizer)
    check_run_configs(parser, args)
    warn_short_schedule(parser.prog, args.max_train_steps, args.num_warmup_steps)
    return args


def check_run_configs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Build the model config of every run as its pretraining will (:func:`pretrain.build_config`), before any work:
    a value out of range, options that do not fit together, or a scheme without the family's form stop the comparison
    here, in one line under compare's name, rather than when that run's turn comes."""
    tasks = ["clm", "mlm"] if args.encoders else ["clm"]
    for task, entry, normalizer in itertools.product(tasks, [*args.schemes, *args.layouts], args.normalizers):
        argv = recipe_argv(args, (task, entry, normalizer, args.seed), args.output_dir)
        run_args = pretrain_parser().parse_args(argv)
        pretrain.fill_model_defaults(run_args)
        try:
            pretrain.build_config(run_args, vocab_size=384, pad_token_id=0, eos_token_id=1)
        except ValueError as error:
            parser.error(f"{TASK_NAMES[task]} {entry} + {normalizer}: {' '.join(str(error).split())}")


def position_probe(args: argparse.Namespace, run: Run, accelerator) -> float:
    """The position probe's relative fit error (:func:`hf_posenc.probe`: final mean squared error over the variance of
    the targets; about 1 for a model that cannot tell positions apart) in the task's family, at the run's seed; a
    layout's probe has the run's depth (its per-layer pattern). One small model on one thread: the main process runs
    it and the others receive the result."""
    task, scheme, normalizer, seed = run
    family = "gpt2" if task == "clm" else "bert"
    layout = {"position_encoding": parse_scheme(scheme)}
    if scheme in args.layouts:
        sizes = layout_sizes(scheme, args.sliding_window, args.attention_chunk_size)
        layout = hf_posenc.layout_preset(scheme, args.num_hidden_layers, *sizes)
        layout["num_hidden_layers"] = args.num_hidden_layers
    elif args.layer_types is not None:
        layout.update(layer_types=args.layer_types, num_hidden_layers=args.num_hidden_layers)
    result = [None]
    if accelerator.is_main_process:
        probe = hf_posenc.probe(
            **layout, attention_normalizer=parse_scheme(normalizer), family=family, steps=args.probe_steps, seed=seed,
            progress_bar=sys.stderr.isatty(),
        )  # fmt: skip
        result = [probe["relative_mse"]]
    return broadcast_object_list(result)[0]


SUMMARY_FIELDS = ("eval_loss", "extrapolation", "ratio", "probe", "tokens_per_second", "train_seconds")
"""The figures of a row that :func:`summarize` gives as mean and spread over the seeds."""


def length_ratio(row: dict[str, Any], factors: tuple[int, ...]) -> float | None:
    """Loss at the longest length over loss at the shortest; None when either is missing."""
    first, last = row["extrapolation"].get(f"{factors[0]}x"), row["extrapolation"].get(f"{factors[-1]}x")
    return last / first if isinstance(first, float) and isinstance(last, float) else None


def summarize(rows: list[dict[str, Any]], factors: tuple[int, ...]) -> list[dict[str, Any]]:
    """One row per (task, scheme, normalizer): every figure of :data:`SUMMARY_FIELDS` as :func:`mean_and_spread`
    over its seeds, the seeds, and the mean training curve with its spread."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["scheme"], row["normalizer"]), []).append(row)
    summary = []
    for (task, scheme, normalizer), runs in groups.items():
        figures = {
            "eval_loss": mean_and_spread([run["eval_loss"] for run in runs]),
            "extrapolation": {
                f"{f}x": mean_and_spread([run["extrapolation"].get(f"{f}x") for run in runs]) for f in factors
            },
            "ratio": mean_and_spread([length_ratio(run, factors) for run in runs]),
            "probe": mean_and_spread([run["probe"] for run in runs]),
            "tokens_per_second": mean_and_spread([run["tokens_per_second"] for run in runs]),
            "train_seconds": mean_and_spread([run["train_seconds"] for run in runs]),
        }
        curves = [run["loss_curve"] for run in runs]
        steps = [step for step, _ in curves[0]]
        losses = [[loss for _, loss in curve] for curve in curves if [step for step, _ in curve] == steps]
        summary.append({
            "task": task, "scheme": scheme, "normalizer": normalizer, "seeds": [run["seed"] for run in runs],
            "num_parameters": runs[0]["num_parameters"], **figures,
            "loss_curve": [(step, *(f(column) for f in (statistics.fmean, min, max))) for step, column in
                           zip(steps, zip(*losses, strict=True), strict=True)],
            "messages": {f"{f}x": run["extrapolation"][f"{f}x"] for run in runs for f in factors
                         if isinstance(run["extrapolation"].get(f"{f}x"), str)},
        })  # fmt: skip
    return summary


def compare_table(summary: list[dict[str, Any]], factors: tuple[int, ...]) -> str:
    """The markdown table of one model family, one row per scheme and normalizer (mean ± std over the seeds)."""
    header = ["scheme", "normalizer", "eval loss", *[f"{f}x" for f in factors], f"{factors[-1]}x / 1x"]
    header += ["probe rel. MSE", "parameters", "tokens/s", "train s", "seeds"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 3) + "---|"]
    for row in summary:
        cells = [row["scheme"], row["normalizer"], summary_cell(row["eval_loss"])]
        cells += [summary_cell(row["extrapolation"][f"{f}x"]) for f in factors] + [summary_cell(row["ratio"], 2)]
        cells += [summary_cell(row["probe"]), f"{row['num_parameters']:,}"]
        speed, seconds = row["tokens_per_second"], row["train_seconds"]
        cells += [f"{speed['mean']:,.0f}", f"{seconds['mean']:.0f}", " ".join(str(seed) for seed in row["seeds"])]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    for row in summary:
        if row["messages"]:
            where, message = ", ".join(row["messages"]), next(iter(row["messages"].values()))
            notes.append(f"{row['scheme']} + {row['normalizer']}, n/a at {where}: {message}.")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def plot_comparison(summary: list[dict[str, Any]], rows: list[dict[str, Any]], factors: tuple[int, ...], path: Path):
    """Per family: the training curves (the mean over the seeds, the band between the lowest and the highest seed;
    the held-out loss of each seed as markers), and the held-out loss against the evaluation length (the mean, with
    error bars of one standard deviation over the seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(row["task"] for row in summary))
    figure, axes = plt.subplots(len(tasks), 2, figsize=(12, 4.5 * len(tasks)), squeeze=False)
    for (curves, lengths), task in zip(axes, tasks, strict=True):
        for entry in (entry for entry in summary if entry["task"] == task):
            label = f"{entry['scheme']} + {entry['normalizer']}"
            steps, mean, low, high = zip(*entry["loss_curve"], strict=True)
            (line,) = curves.plot(steps, mean, label=label, linewidth=1, marker="." if len(steps) < 30 else None)
            if len(entry["seeds"]) > 1:
                curves.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
            for row in rows:
                if (row["task"], row["scheme"], row["normalizer"]) == (task, entry["scheme"], entry["normalizer"]):
                    if row["eval_curve"]:
                        points = zip(*row["eval_curve"], strict=True)
                        curves.plot(*points, linestyle="none", marker="o", color=line.get_color())
            points = [(f, entry["extrapolation"][f"{f}x"]) for f in factors]
            points = [(f, figure_) for f, figure_ in points if isinstance(figure_, dict)]
            factors_run, means = [f for f, _ in points], [figure_["mean"] for _, figure_ in points]
            if points and len(entry["seeds"]) > 1:
                spread = [figure_["std"] for _, figure_ in points]
                lengths.errorbar(factors_run, means, yerr=spread, marker="o", capsize=3, label=label)
            elif points:
                lengths.plot(factors_run, means, marker="o", label=label)
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


def eval_curve(log_path: Path) -> list[tuple[int, float]]:
    """``(step, held-out loss)`` of every evaluation in ``train_log.jsonl``."""
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    return [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.task != "lm":
        return long_context.compare_task(args)
    tasks = ["clm", "mlm"] if args.encoders else ["clm"]
    seeds = args.seeds if args.seeds is not None else [args.seed]
    entries = [*args.schemes, *args.layouts]
    runs = [(task, entry, normalizer, seed) for seed in seeds for task in tasks for entry in entries
            for normalizer in args.normalizers]  # fmt: skip
    for run in runs:  # before any work: every Hub target is created (or found); each run uploads its model
        hub_repository(args, f"-{run_name(args, run)}")
    accelerator = recipe_accelerator(args)
    with torch_threads(args.threads) as threads:
        accelerator.print(f"compare: {threads} torch thread(s) per process (--threads)")
        started = time.perf_counter()
        evaluation = evaluation_text_ids(args)
        rows = [compare_run(args, run, evaluation, accelerator) for run in runs]
        if accelerator.is_main_process:
            write_report(args, rows, time.perf_counter() - started, threads)
    accelerator.wait_for_everyone()
    return rows


def evaluation_text_ids(args: argparse.Namespace):
    """A function of a tokenizer giving the held-out text's ids: the held-out 5 % of ``--train_file`` or of the
    embedded corpus, or ``--dataset_name``'s validation split (the held-out 5 % of its train split where it has none,
    as the pretraining recipe splits it); at most ``--max_eval_tokens``."""
    if args.dataset_name is None:
        return lambda tokenizer: evaluation_ids(tokenizer, args.train_file, 5, args.max_eval_tokens)
    data = argparse.Namespace(
        dataset_name=args.dataset_name, dataset_config_name=args.dataset_config_name, train_file=None,
        validation_file=None, validation_split_percentage=5, text_column_name=args.text_column_name,
    )  # fmt: skip
    text = "".join(pretrain.load_text_datasets(data)["validation"][args.text_column_name])

    def ids(tokenizer):
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        return ids[: args.max_eval_tokens] if args.max_eval_tokens else ids

    return ids


def compare_run(args: argparse.Namespace, run: Run, evaluation, accelerator) -> dict[str, Any]:
    """Pretrain one model (``run``: task, scheme, normalizer, seed), score it at every length and probe it: its row,
    also written to ``compare_row.json`` in its folder. With ``--resume`` a folder holding the row of the same recipe
    is read instead."""
    task, scheme, normalizer, seed = run
    model_dir = run_folder(args, run)
    argv = recipe_argv(args, run, model_dir)
    token = argv.index("--hub_token") if "--hub_token" in argv else None
    recipe = argv if token is None else argv[:token] + argv[token + 2 :]  # what the row keeps: no token
    saved = model_dir / "compare_row.json"
    if args.resume and saved.is_file():
        row = json.loads(saved.read_text())
        if row.get("recipe") == recipe:
            accelerator.print(f"{run_name(args, run)}: kept from {saved} (--resume)")
            return row
    run_started = time.perf_counter()
    results = pretrain.main(argv)
    train_seconds = time.perf_counter() - run_started
    auto_class = transformers.AutoModelForCausalLM if task == "clm" else transformers.AutoModelForMaskedLM
    model = auto_class.from_pretrained(model_dir).to(accelerator.device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    mask_token_id = tokenizer.mask_token_id if task == "mlm" else None
    extrapolation = extrapolation_row(
        model, evaluation(tokenizer), args.block_size, args.factors, args.per_device_eval_batch_size, mask_token_id,
        seed, accelerator,
    )  # fmt: skip
    losses = ", ".join(f"{factor} {format_cell(loss)}" for factor, loss in extrapolation.items())
    accelerator.print(f"{run_name(args, run)}: {losses}")
    row = {
        "task": task,
        "scheme": scheme,
        "normalizer": normalizer,
        "seed": seed,
        "eval_loss": results["eval_loss"],
        "eval_accuracy": results["eval_accuracy"],
        "extrapolation": extrapolation,
        "probe": position_probe(args, run, accelerator),
        "num_parameters": results["num_parameters"],
        "tokens_per_second": results["tokens_per_second"],
        "train_seconds": train_seconds,
        "reference_init": results["reference_init"],
        "loss_curve": smoothed_curve(model_dir / "train_log.jsonl"),
        "eval_curve": eval_curve(model_dir / "train_log.jsonl"),
        "recipe": recipe,
    }
    if accelerator.is_main_process:
        saved.write_text(json.dumps(row, indent=1))
    return row


def write_report(args: argparse.Namespace, rows: list[dict[str, Any]], wall_seconds: float, threads: int) -> None:
    """``compare.md``, ``compare.json`` (every seed's row, and the summary) and ``compare.png`` in ``--output_dir``;
    the table printed."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows, args.factors)
    sections = []
    for task in dict.fromkeys(row["task"] for row in summary):
        family_rows = [row for row in summary if row["task"] == task]
        sections.append(f"### {TASK_NAMES[task]}\n\n" + compare_table(family_rows, args.factors))
    seeds = sorted({row["seed"] for row in rows})
    notes = [
        f"{args.max_train_steps} steps x {args.per_device_train_batch_size} blocks of {args.block_size} tokens, "
        f"width {args.hidden_size}, {layers_description(args)}, {args.num_attention_heads} heads; "
        f"training {sum(row['train_seconds'] for row in rows) / 60:.1f} min over the runs (a run kept with --resume "
        f"counts its first training), {wall_seconds / 60:.1f} min this invocation, {threads} torch thread(s) per "
        "process.",
        "eval loss: nats per token on the held-out blocks at the training length; Nx: nats per token on the last "
        f"{args.block_size} positions of sliding windows N times the training length; n/a: the model cannot run "
        "at that length (see compare.json for its message).",
    ]
    if len(seeds) > 1:
        notes.append(
            f"{len(seeds)} seeds ({', '.join(map(str, seeds))}) per model: mean ± sample standard deviation over the "
            "seeds (tokens/s and train s: the mean); every seed's figures are in compare.json (rows)."
        )
    report = "\n".join(sections) + "\n" + "\n".join(f"- {note}" for note in notes) + "\n"
    (args.output_dir / "compare.md").write_text(report)
    arguments = {key: str(value) for key, value in vars(args).items() if key != "hub_token"}
    document = {"arguments": arguments, "wall_seconds": wall_seconds, "rows": rows, "summary": summary}
    (args.output_dir / "compare.json").write_text(json.dumps(document, indent=2))
    plot_comparison(summary, rows, args.factors, args.output_dir / "compare.png")
    print("\n" + report + f"\nwritten: {args.output_dir}/compare.md, compare.json, compare.png")


if __name__ == "__main__":  # python recipes/compare.py ..., accelerate launch recipes/compare.py ...
    raise SystemExit(run_recipe("compare", sys.argv[1:], main))
