"""Long context measured as the papers measure it: ``compare --task mqar|copy|passkey`` (train one model per scheme
on a task at the training length, then its accuracy at 1x, 2x, 4x, 8x that length, and passkey's by depth),
``extrapolate --task ...`` (the same accuracy for saved decoders), and ``extrapolate``'s loss at each position of a
long window (FoX, PaTH). The tasks and their metric are :mod:`hf_posenc_recipes.tasks`.

A task model is trained as the pretraining recipe trains one (:mod:`hf_posenc_recipes.pretrain`: the same
config, reference init, AdamW with the same parameter groups, warm-up and schedule, gradient clipping), on batches
drawn afresh at every step from ``(seed, step, process)`` with the loss on the answer tokens alone.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from hf_posenc_recipes import pretrain
from hf_posenc_recipes.common import progress_bar_off, recipe_accelerator, torch_threads, write_model_card
from hf_posenc_recipes.parsers.tasks import DEFAULT_LR_SWEEP, check_copy_flags, check_task_flags, copy_block_size
from hf_posenc_recipes.reporting import (
    folder_name,
    format_cell,
    is_decoder,
    layers_description,
    mean_and_spread,
    model_label,
    recipe_argv,
    run_folder,
    run_name,
    smoothed_curve,
    summary_cell,
    training_recipe,
    unique_labels,
)
from hf_posenc_recipes.tasks import (
    BYTE_OFFSET,
    TaskSpec,
    copy_kazemnejad_lengths,
    passkey_texts,
    task_accuracy,
    task_row,
)


def task_spec(args: argparse.Namespace, tokenizer=None, text_file: Path | None = None) -> TaskSpec:
    """The task of ``--task`` with its settings; passkey's texts (from ``text_file``, else the embedded corpus) in
    ``tokenizer``'s ids (bytes when None)."""
    texts = passkey_texts(tokenizer or pretrain.byte_tokenizer(), text_file) if args.task == "passkey" else None
    return TaskSpec.from_flags(args, texts)


def train_task_model(
    argv: list[str], task: TaskSpec, accelerator: Accelerator, eval_examples: int, stop_accuracy: float = 1.0
) -> dict[str, Any]:
    """Train one decoder on ``task`` with the pretraining recipe's flags ``argv`` (its model, optimiser, schedule,
    seed, ``--output_dir``), saving it there as the recipe does (model, byte tokenizer, ``training_args.json``,
    ``results.json``, ``train_log.jsonl``, model card); returns the results. Every ``--eval_steps`` steps the accuracy
    at the training length on ``eval_examples`` held-out examples is logged; training stops at the first evaluation
    where it reaches ``stop_accuracy`` (Zoology stops at 0.99), ``--max_train_steps`` being the cap: the results'
    ``reached_step`` is that step, None for a run that ends at the cap below it (unfinished)."""
    args = pretrain.parse_args(argv)
    tokenizer = pretrain.byte_tokenizer()
    set_seed(args.seed)
    if accelerator.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
    config = pretrain.build_config(args, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    model = transformers.AutoModelForCausalLM.from_config(config)
    initialised = pretrain.reference_init(model) if args.reference_init else []
    num_parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(
        pretrain.optimizer_groups(model, args.weight_decay),
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
    )
    scheduler = transformers.get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    )
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    log_path = args.output_dir / "train_log.jsonl"
    log_path.unlink(missing_ok=True)
    progress = tqdm(
        total=args.max_train_steps, desc=task.name, disable=progress_bar_off(accelerator.is_local_main_process)
    )
    tokens_per_step = args.block_size * args.per_device_train_batch_size * accelerator.num_processes
    history, train_seconds, accuracy, reached_step = [], 0.0, None, None
    model.train()
    for step in range(1, args.max_train_steps + 1):
        started = time.perf_counter()
        generator = pretrain.batch_generator(args.seed, 0, step, accelerator.process_index)
        batch = task.batch(generator, args.per_device_train_batch_size, args.block_size)
        inputs = {"input_ids": batch.input_ids, "labels": batch.labels}
        if args.randomized_positions is not None:
            inputs["position_ids"] = pretrain.randomized_position_ids(
                generator, *batch.input_ids.shape, args.randomized_positions
            )
        loss = model(**{key: value.to(accelerator.device) for key, value in inputs.items()}).loss
        accelerator.backward(loss)
        if args.max_grad_norm > 0:
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        train_seconds += time.perf_counter() - started
        mean_loss = accelerator.reduce(loss.detach(), "mean").item()
        record = {"step": step, "loss": mean_loss, "tokens_per_second": tokens_per_step * step / train_seconds}
        if step % args.eval_steps == 0 or step == args.max_train_steps:
            model.eval()
            unwrapped = accelerator.unwrap_model(model)
            accuracy = task_accuracy(
                unwrapped, task, args.block_size, eval_examples, args.per_device_eval_batch_size, args.seed,
                randomized_positions=args.randomized_positions,
            )  # fmt: skip
            record["eval_accuracy"] = accuracy
            model.train()
            progress.write(f"step {step}: loss {mean_loss:.4f}, accuracy at the training length {accuracy:.3f}")
        history.append(record)
        progress.update()
        progress.set_postfix(loss=f"{mean_loss:.3f}")
        if accelerator.is_main_process:
            with log_path.open("a") as log:
                log.write(json.dumps(record) + "\n")
        if "eval_accuracy" in record and accuracy >= stop_accuracy:
            reached_step = step
            break
    progress.close()
    model.eval()
    results = {
        "task": task.name, "position_encoding": config.position_encoding,
        "attention_normalizer": config.attention_normalizer, "block_size": args.block_size,
        "steps": history[-1]["step"], "max_train_steps": args.max_train_steps, "stop_accuracy": stop_accuracy,
        "reached_step": reached_step, "learning_rate": args.learning_rate, "num_parameters": num_parameters,
        "train_loss": history[-1]["loss"],
        "tokens_per_second": history[-1]["tokens_per_second"], "eval_accuracy": accuracy,
        "reference_init": initialised,
    }  # fmt: skip
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        unwrapped.save_pretrained(args.output_dir)
        tokenizer.save_pretrained(args.output_dir)
        arguments = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
        arguments.pop("hub_token", None)
        arguments["long_context_task"] = task.settings()
        (args.output_dir / "training_args.json").write_text(json.dumps(arguments, indent=2))
        (args.output_dir / "results.json").write_text(json.dumps(results, indent=2))
        data = f"Examples of {task.describe()}, drawn afresh at each step from the seed, {args.block_size} tokens."
        write_model_card(
            args.output_dir, unwrapped.config, "compare --task", args, data, results, None, "AutoModelForCausalLM"
        )
    accelerator.wait_for_everyone()
    return results


TASK_REFUSED_FLAGS = {
    "encoders": "the tasks are causal (a decoder answers after the question)",
    "dataset_name": "the tasks draw their own examples",
    "tokenizer_name": "the tasks are written in bytes",
    "push_to_hub": "the task models stay in --output_dir (models/)",
    "with_tracking": "the task models log to train_log.jsonl",
}
"""The flags of ``compare`` that ``--task mqar|copy|passkey`` does not take, and why."""


def check_compare_task(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``compare --task``: the flags the tasks do not take, and the task's settings against ``--block_size``."""
    if args.task == "lm":
        for flag in ("lr_sweep", "stop_accuracy"):
            if getattr(args, flag) != parser.get_default(flag):
                parser.error(f"--{flag} trains the task models of --task mqar, copy or passkey; --task lm has none")
        check_copy_flags(parser, args, None)
        return
    for flag, reason in TASK_REFUSED_FLAGS.items():
        if getattr(args, flag):
            parser.error(f"--task {args.task} does not take --{flag}: {reason}")
    if args.train_file is not None and args.task != "passkey":
        parser.error(f"--train_file is passkey's filler text; --task {args.task} draws its own examples")
    check_task_flags(parser, args, args.block_size)
    if args.lr_sweep == []:
        args.lr_sweep = list(DEFAULT_LR_SWEEP)


def compare_task(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``compare --task mqar|copy|passkey``: one decoder per scheme (or layout), normalizer and seed trained on the
    task at ``--block_size``, scored at each ``--factors`` length on the same held-out examples; writes
    ``compare.md``, ``compare.json`` and ``compare.png``. Returns every run's row."""
    accelerator = recipe_accelerator(args)
    with torch_threads(args.threads) as threads:
        accelerator.print(f"compare --task {args.task}: {threads} torch thread(s) per process (--threads)")
        return compare_task_runs(args, accelerator)


def compare_task_runs(args: argparse.Namespace, accelerator: Accelerator) -> list[dict[str, Any]]:

    task = task_spec(args, text_file=args.train_file)
    seeds = args.seeds if args.seeds is not None else [args.seed]
    runs = [("clm", entry, normalizer, seed) for seed in seeds for entry in [*args.schemes, *args.layouts]
            for normalizer in args.normalizers]  # fmt: skip
    started = time.perf_counter()
    rows = []
    for run in runs:
        _, scheme, normalizer, seed = run
        folder = run_folder(args, (args.task, *run[1:]))
        argv = recipe_argv(args, run, folder)
        recipe = [
            *argv,
            "--long_context_task",
            json.dumps(task.settings()),
            "--stop_accuracy",
            str(args.stop_accuracy),
        ]
        recipe += (
            ["--lr_sweep", *map(str, args.lr_sweep), "--lr_sweep_steps", str(args.lr_sweep_steps)]
            if args.lr_sweep
            else []
        )
        saved = folder / "compare_row.json"
        if args.resume and saved.is_file() and json.loads(saved.read_text()).get("recipe") == recipe:
            accelerator.print(f"{run_name(args, (args.task, *run[1:]))}: kept from {saved} (--resume)")
            rows.append(json.loads(saved.read_text()))
            continue
        run_started = time.perf_counter()
        sweep = sweep_learning_rate(args, argv, folder, task, accelerator) if args.lr_sweep else None
        if sweep is not None:
            argv = replace_flags(argv, {"--learning_rate": sweep["kept"]})
        eval_examples = min(args.task_eval_examples, 64)
        results = train_task_model(argv, task, accelerator, eval_examples, args.stop_accuracy)
        train_seconds = time.perf_counter() - run_started
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).to(accelerator.device).eval()
        scores = task_row(
            model, task, args.block_size, args.factors, args.task_eval_examples, args.per_device_eval_batch_size,
            args.seed, args.passkey_depths, args.randomized_positions,
        )  # fmt: skip
        cells = ", ".join(
            f"{factor} {summary_cell(mean_and_spread([value]))}" for factor, value in scores["accuracy"].items()
        )
        finished = "unfinished" if results["reached_step"] is None else f"reached at step {results['reached_step']}"
        accelerator.print(
            f"{args.task}-{folder_name(scheme)}-{folder_name(normalizer)} seed {seed}: {cells}; {args.stop_accuracy} "
            f"{finished} ({results['steps']} of at most {args.max_train_steps} steps, lr {results['learning_rate']:g})"
        )
        log_path = folder / "train_log.jsonl"
        row = {
            "task": args.task, "scheme": scheme, "normalizer": normalizer, "seed": seed, **scores,
            "train_loss": results["train_loss"], "num_parameters": results["num_parameters"],
            "steps": results["steps"], "reached_step": results["reached_step"],
            "learning_rate": results["learning_rate"], "lr_sweep": sweep,
            "tokens_per_second": results["tokens_per_second"], "train_seconds": train_seconds,
            "loss_curve": smoothed_curve(log_path), "eval_curve": accuracy_curve(log_path),
            "recipe": recipe,
        }  # fmt: skip
        if accelerator.is_main_process:
            saved.write_text(json.dumps(row, indent=1))
        rows.append(row)
    if accelerator.is_main_process:
        write_task_report(args, task, rows, time.perf_counter() - started)
    accelerator.wait_for_everyone()
    return rows


def replace_flags(argv: list[str], values: dict[str, Any]) -> list[str]:
    """``argv`` with the value after each flag of ``values`` replaced (every one of them is in ``argv``)."""
    argv = list(argv)
    for flag, value in values.items():
        argv[argv.index(flag) + 1] = str(value)
    return argv


def sweep_learning_rate(
    args: argparse.Namespace, argv: list[str], folder: Path, task: TaskSpec, accelerator: Accelerator
) -> dict[str, Any]:
    """A short run (``--lr_sweep_steps``, the warm-up the same fraction of it as of the full run) at each rate of
    ``--lr_sweep``, as Zoology sweeps its learning rate and keeps the best: ``{"kept": rate, "trials": {rate:
    {"accuracy", "reached_step", "train_loss"}}}``, the rate kept the one with the highest accuracy at the training
    length, then the earliest to reach ``--stop_accuracy``, then the lowest training loss."""
    warmup = round(args.num_warmup_steps * args.lr_sweep_steps / args.max_train_steps)
    trials = {}
    for rate in args.lr_sweep:
        trial = replace_flags(argv, {
            "--learning_rate": rate, "--max_train_steps": args.lr_sweep_steps, "--num_warmup_steps": warmup,
            "--output_dir": folder / "lr_sweep" / f"lr_{rate:g}",
        })  # fmt: skip
        results = train_task_model(trial, task, accelerator, min(args.task_eval_examples, 64), args.stop_accuracy)
        trials[rate] = {key: results[key] for key in ("eval_accuracy", "reached_step", "train_loss")}
        accelerator.print(
            f"lr sweep, {rate:g}: accuracy {results['eval_accuracy']:.3f} after {results['steps']} steps"
        )

    def rank(rate: float) -> tuple:
        trial = trials[rate]
        return (-trial["eval_accuracy"], trial["reached_step"] or math.inf, trial["train_loss"])

    return {"kept": min(trials, key=rank), "trials": {f"{rate:g}": trial for rate, trial in trials.items()}}


def accuracy_summary(runs: list[dict[str, Any]], factors: tuple[int, ...], depths: list[float]) -> dict[str, Any]:
    """The accuracy at each length (and passkey's at each depth) of several rows of one experiment (its seeds, or
    the models of one recipe) as :func:`~hf_posenc_recipes.reporting.mean_and_spread`."""
    summary = {"accuracy": {f"{f}x": mean_and_spread([run["accuracy"][f"{f}x"] for run in runs]) for f in factors}}
    if "by_depth" in runs[0]:
        summary["by_depth"] = {
            f"{f}x": {
                str(depth): mean_and_spread([
                    run["by_depth"][f"{f}x"] if isinstance(run["by_depth"][f"{f}x"], str)
                    else run["by_depth"][f"{f}x"][str(depth)] for run in runs
                ])
                for depth in depths
            }
            for f in factors
        }  # fmt: skip
    return summary


def summarize_tasks(rows: list[dict[str, Any]], factors: tuple[int, ...], depths: list[float]) -> list[dict]:
    """One entry per (scheme, normalizer): :func:`accuracy_summary` over its seeds, the final training loss (mean
    and spread), the mean speed and training time, each seed's learning rate, steps and step it reached
    ``--stop_accuracy`` (None: unfinished) and accuracy curve, and the mean loss curve (the first seed's where the
    seeds stopped at different steps)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["scheme"], row["normalizer"]), []).append(row)
    summary = []
    for (scheme, normalizer), runs in groups.items():
        steps = [step for step, _ in runs[0]["loss_curve"]]
        curves = [[loss for _, loss in run["loss_curve"]] for run in runs]
        summary.append({
            "scheme": scheme, "normalizer": normalizer, "seeds": [run["seed"] for run in runs],
            "num_parameters": runs[0]["num_parameters"], **accuracy_summary(runs, factors, depths),
            "train_loss": mean_and_spread([run["train_loss"] for run in runs]),
            "tokens_per_second": statistics.fmean(run["tokens_per_second"] for run in runs),
            "train_seconds": statistics.fmean(run["train_seconds"] for run in runs),
            "learning_rates": [run["learning_rate"] for run in runs],
            "reached_steps": [run["reached_step"] for run in runs], "steps": [run["steps"] for run in runs],
            "loss_curve": [(step, statistics.fmean(column)) for step, column in
                           zip(steps, zip(*curves, strict=True), strict=True)] if len(set(map(len, curves))) == 1
                          else runs[0]["loss_curve"],
            "eval_curves": [run["eval_curve"] for run in runs],
        })  # fmt: skip
    return summary


def accuracy_curve(log_path: Path) -> list[tuple[int, float]]:
    """``(step, accuracy at the training length)`` of every evaluation in ``train_log.jsonl``."""
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    return [(record["step"], record["eval_accuracy"]) for record in records if "eval_accuracy" in record]


def accuracy_table(
    entries: list[dict[str, Any]], factors: tuple[int, ...], first: list[str], last: tuple[str, ...] = ()
) -> str:
    """A markdown table of accuracy at each length, one row per entry: the ``first`` columns (keys of the entries),
    ``mean ± std`` over the seeds (or models) at each length (``n/a`` where a model cannot run), the ``last``
    columns."""
    header = [*first, *[f"{f}x" for f in factors], *last]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(first) + "---:|" * (len(factors) + len(last))]
    for entry in entries:
        cells = [str(entry[key]) for key in first]
        cells += [summary_cell(entry["accuracy"][f"{f}x"]) for f in factors]
        lines.append("| " + " | ".join(cells + [str(entry[key]) for key in last]) + " |")
    return "\n".join(lines) + "\n"


def depth_table(entries: list[dict[str, Any]], factors: tuple[int, ...], depths: list[float], first: str) -> str:
    """Passkey's accuracy at each depth (rows) and length (columns), for each entry (named by its ``first`` key)."""
    header = ["model", "depth", *[f"{f}x" for f in factors]]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|" + "---:|" * len(factors)]
    for entry in entries:
        for depth in depths:
            cells = [str(entry[first]), f"{depth:g}"]
            for f in factors:
                cell = entry["by_depth"][f"{f}x"]
                cells.append(summary_cell(cell if isinstance(cell, str) else cell[str(depth)]))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_tasks(
    entries: list[dict[str, Any]], factors: tuple[int, ...], depths: list[float], path: Path, title: str,
    curves: bool = True, baselines: dict[str, float] | None = None,
) -> None:  # fmt: skip
    """The accuracy against the length factor (the mean, error bars of one standard deviation over the seeds or
    models), the ``baselines`` (guessers' accuracy, :meth:`TaskSpec.baselines`) as grey horizontal lines, after the
    training loss curves and each seed's accuracy at the training length during training (``curves``); for passkey a
    row of heat maps below, accuracy by depth and length, one per entry. Lengths a model cannot run are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passkey = "by_depth" in entries[0]
    panels = 3 if curves else 1  # the top row: the loss curves, the accuracy curves, the accuracy by length
    rows, columns = (2, max(panels, len(entries))) if passkey else (1, panels)
    figure = plt.figure(figsize=(5.5 * columns, 4.2 * rows), layout="constrained")
    grid = figure.add_gridspec(rows, columns)
    top = [figure.add_subplot(grid[0, i * columns // panels : (i + 1) * columns // panels]) for i in range(panels)]
    accuracy = top[-1]
    for entry in entries:
        points = [(f, entry["accuracy"][f"{f}x"]) for f in factors]
        points = [(f, value) for f, value in points if isinstance(value, dict)]
        means = [value["mean"] for _, value in points]
        spread = [value["std"] or 0.0 for _, value in points]
        accuracy.errorbar([f for f, _ in points], means, yerr=spread, marker="o", capsize=3, label=entry["label"])
    for (name, value), style in zip((baselines or {}).items(), (":", "--", "-."), strict=False):
        accuracy.axhline(value, color="grey", linestyle=style, linewidth=1, label=f"guess {name} ({value:.3f})")
    accuracy.set_xscale("log", base=2)
    accuracy.set_xticks(list(factors), [f"{f}x" for f in factors])
    accuracy.set_ylim(-0.03, 1.03)
    accuracy.set_xlabel("evaluation length / training length")
    accuracy.set_ylabel("accuracy")
    accuracy.set_title(title)
    if curves:
        loss, learning = top[:2]
        for entry in entries:
            steps, losses = zip(*entry["loss_curve"], strict=True)
            (line,) = loss.plot(steps, losses, linewidth=1, label=entry["label"])
            for index, curve in enumerate(entry["eval_curves"]):
                label = entry["label"] if index == 0 else None
                learning.plot(*zip(*curve, strict=True), marker=".", color=line.get_color(), label=label)
        loss.set_xlabel("optimizer step")
        loss.set_ylabel("training loss on the answers (nats)")
        loss.set_title("training loss")
        learning.set_ylim(-0.03, 1.03)
        learning.set_xlabel("optimizer step")
        learning.set_ylabel("accuracy at the training length")
        learning.set_title("accuracy while training (each seed)")
    for axis in top:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    if passkey:
        heat_maps = [figure.add_subplot(grid[1, column]) for column in range(len(entries))]
        for axis, entry in zip(heat_maps, entries, strict=True):
            cells = [entry["by_depth"][f"{f}x"] for f in factors]
            grid_values = [
                [cell[str(d)]["mean"] if isinstance(cell[str(d)], dict) else float("nan") for cell in cells]
                for d in depths
            ]
            image = axis.imshow(grid_values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
            axis.set_xticks(range(len(factors)), [f"{f}x" for f in factors])
            axis.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
            axis.set_xlabel("length")
            axis.set_ylabel("depth of the needle")
            axis.set_title(entry["label"], fontsize=9)
        figure.colorbar(image, ax=heat_maps, label="accuracy")
    figure.savefig(path, dpi=110)
    plt.close(figure)


def baseline_notes(task: TaskSpec) -> list[str]:
    """The report's line on the task's no-binding baselines (:meth:`TaskSpec.baselines`), when it has them."""
    baselines = task.baselines()
    if not baselines:
        return []
    guesses = "; ".join(f"{name}: {value:.3f}" for name, value in baselines.items())
    return [
        f"Without binding keys to values (guessing uniformly, this layout, {task.mqar_layout}): {guesses}; drawn as "
        "grey lines in the plot. An accuracy near them: no binding learnt (yet)."
    ]


def copy_notes(task: TaskSpec, factors: tuple[int, ...]) -> list[str]:
    """The report's line on the string lengths of copy's ``kazemnejad`` layout at each factor, when it is that."""
    if not task.kazemnejad:
        return []
    block = copy_block_size(task.copy_max_length)
    lengths = "; ".join(
        "{}x: {}..{} in rows of {} tokens".format(f, *copy_kazemnejad_lengths(task.copy_max_length, f), f * block)
        for f in factors
    )
    return [
        f"Copy, layout kazemnejad: the string lengths at each factor, each equally often: {lengths}. Right: every "
        "copied symbol and the end token the most likely next token given the true tokens before it, which is greedy "
        "decoding's exact match."
    ]


def write_task_report(args: argparse.Namespace, task: TaskSpec, rows: list[dict[str, Any]], wall_seconds: float):
    """``compare.md`` (the accuracy table, passkey's by depth), ``compare.json`` (every seed's row, the summary) and
    ``compare.png`` in ``--output_dir``; the report printed."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize_tasks(rows, args.factors, args.passkey_depths)
    reached = f"step at {args.stop_accuracy:g}"
    for entry in summary:
        entry["label"] = f"{entry['scheme']} + {entry['normalizer']}"
        entry["train loss"] = summary_cell(entry["train_loss"])
        entry["parameters"] = f"{entry['num_parameters']:,}"
        entry["tokens/s"] = f"{entry['tokens_per_second']:,.0f}"
        entry["train s"] = f"{entry['train_seconds']:.0f}"
        entry["seeds"] = " ".join(str(seed) for seed in entry["seeds"])
        entry["lr"] = " ".join(f"{rate:g}" for rate in entry["learning_rates"])
        entry[reached] = " ".join(
            f"unfinished ({steps})" if step is None else str(step)
            for step, steps in zip(entry["reached_steps"], entry["steps"], strict=True)
        )
    last = ("train loss", reached, "lr", "parameters", "tokens/s", "train s", "seeds")
    report = f"### {task.describe()}\n\n" + accuracy_table(summary, args.factors, ["scheme", "normalizer"], last)
    if task.name == "passkey":
        report += "\n#### passkey by depth\n\n" + depth_table(summary, args.factors, args.passkey_depths, "label")
    seeds = sorted({row["seed"] for row in rows})
    notes = [
        f"At most {args.max_train_steps} steps x {args.per_device_train_batch_size} examples of {args.block_size} "
        f"tokens, width {args.hidden_size}, {layers_description(args)}, {args.num_attention_heads} heads; "
        f"{wall_seconds / 60:.1f} min this invocation.",
        f"{reached}: the step at which the accuracy at the training length on {min(args.task_eval_examples, 64)} "
        f"held-out examples (checked every {args.eval_steps} steps) reached --stop_accuracy {args.stop_accuracy:g} "
        "and training stopped (one figure per seed); unfinished (N): the run ended at the --max_train_steps cap "
        "below it, its accuracy where its training stopped, not a limit of the scheme: its curves are in "
        "compare.png.",
        "lr: the learning rate of each seed's run"
        + (
            f", kept by a sweep of {args.lr_sweep_steps} steps over {' '.join(f'{r:g}' for r in args.lr_sweep)} "
            "(--lr_sweep; every trial in compare.json)"
            if args.lr_sweep
            else " (--learning_rate)"
        )
        + ".",
        f"Nx: accuracy on {args.task_eval_examples} held-out examples of N times the training length"
        + (" at each depth (the mean over the depths in the first table)" if task.name == "passkey" else "")
        + ", the same examples for every model; n/a: the model cannot run at that length (see compare.json).",
    ]
    if len(seeds) > 1:
        notes.append(f"{len(seeds)} seeds ({', '.join(map(str, seeds))}): mean ± sample standard deviation.")
    notes += baseline_notes(task) + copy_notes(task, args.factors)
    if task.name == "passkey":
        fixed, _ = task.passkey_filler(args.block_size)
        lengths = "; ".join(
            f"{f}x {f * args.block_size} tokens, filler {task.passkey_filler(f * args.block_size)[1]} "
            f"({task.passkey_filler(f * args.block_size)[1] / (f * args.block_size):.0%})"
            for f in args.factors
        )
        notes.append(f"Passkey's needle, question and key take {fixed} tokens; the rest is filler: {lengths}.")
    report += "\n" + "\n".join(f"- {note}" for note in notes) + "\n"
    (args.output_dir / "compare.md").write_text(report)
    arguments = {key: str(value) for key, value in vars(args).items() if key != "hub_token"}
    document = {"arguments": arguments, "wall_seconds": wall_seconds, "rows": rows, "summary": summary}
    (args.output_dir / "compare.json").write_text(json.dumps(document, indent=2))
    plot_tasks(
        summary, args.factors, args.passkey_depths, args.output_dir / "compare.png", f"{task.name}: accuracy",
        baselines=task.baselines(),
    )  # fmt: skip
    print("\n" + report + f"\nwritten: {args.output_dir}/compare.md, compare.json, compare.png")


@torch.no_grad()
def loss_by_position(model, ids: torch.Tensor, window: int, batch_size: int = 8) -> torch.Tensor:
    """The mean next-token loss (nats) at each position of a window: ``ids`` (the evaluation text, ``(num_tokens,)``)
    cut into consecutive windows of ``window`` tokens (the tail dropped), the loss of predicting token ``t`` from
    tokens ``0..t-1`` averaged over the windows, for ``t = 1 .. window - 1``: shape ``(window - 1,)``, entry ``t - 1``
    for position ``t``. The curve FoX (Lin et al. 2025) and PaTH (Yang et al. 2025) plot: a model that uses its whole
    context keeps it falling past the training length."""
    windows = len(ids) // window
    if windows == 0:
        raise ValueError(f"The evaluation text has {len(ids)} tokens, fewer than one window of {window}.")
    device = next(model.parameters()).device
    blocks = ids[: windows * window].view(windows, window)
    total = torch.zeros(window - 1, dtype=torch.float64)
    for first in range(0, windows, batch_size):
        batch = blocks[first : first + batch_size].to(device)
        logits = model(input_ids=batch).logits[:, :-1].float()
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
        total += losses.double().sum(0).cpu()
    return total / windows


def binned_positions(losses: torch.Tensor, bins: int) -> list[dict[str, float]]:
    """:func:`loss_by_position`'s curve in ``bins`` consecutive bins of near-equal width (``torch.tensor_split``):
    ``{"first", "last", "loss"}``, the positions (``1 ..``) each covers and the mean loss over them."""
    positions = torch.arange(1, len(losses) + 1)
    return [
        {"first": int(part[0]), "last": int(part[-1]), "loss": float(values.mean())}
        for part, values in zip(positions.tensor_split(bins), losses.tensor_split(bins), strict=True)
        if len(part)
    ]


def position_row(model, ids: torch.Tensor, train_length: int, factor: int, bins: int, batch_size: int):
    """A model's loss by position over a window of ``factor`` times its training length, binned; the reason instead
    when the model cannot run at that length."""
    try:
        return binned_positions(loss_by_position(model, ids, factor * train_length, batch_size), bins)
    except ValueError as error:  # a learned table shorter than the window, a text shorter than one window
        return str(error).split(". ")[0].rstrip(".")


def position_table(rows: list[dict[str, Any]], factor: int) -> str:
    """The markdown table of the binned loss by position: one row per bin, one column per model (``n/a`` with the
    reason below where a model cannot run at that length)."""
    curves = [row for row in rows if "loss_by_position" in row]
    ready = [row for row in curves if isinstance(row["loss_by_position"], list)]
    if not curves:
        return ""
    lines = [
        f"\n### Loss by position (a window of {factor}x the training length)\n",
        "| positions | " + " | ".join(row["label"] for row in curves) + " |",
        "|---|" + "---:|" * len(curves),
    ]
    bins = ready[0]["loss_by_position"] if ready else []
    for index, part in enumerate(bins):
        cells = [
            f"{row['loss_by_position'][index]['loss']:.3f}" if isinstance(row["loss_by_position"], list) else "n/a"
            for row in curves
        ]
        lines.append(f"| {part['first']}-{part['last']} | " + " | ".join(cells) + " |")
    notes = [f"n/a: {row['model']}: {row['loss_by_position']}." for row in curves if row not in ready]
    notes.append(
        "Mean next-token loss (nats) at the positions of each bin, over consecutive windows of the held-out text; "
        "positions count from the window's first token (0), each model's training length is marked in the plot."
    )
    return "\n".join(lines + [""] + notes) + "\n"


def plot_positions(rows: list[dict[str, Any]], factor: int, path: Path) -> None:
    """The binned loss by position (each bin at its middle position), one line per model, its training length as a
    dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        if isinstance(row.get("loss_by_position"), list):
            middles = [(part["first"] + part["last"]) / 2 for part in row["loss_by_position"]]
            (line,) = axes.plot(
                middles, [part["loss"] for part in row["loss_by_position"]], marker=".", label=row["label"]
            )
            axes.axvline(row["train_length"], color=line.get_color(), linestyle=":", linewidth=1)
    axes.set_xlabel("position in the window (dotted: the training length)")
    axes.set_ylabel("next-token loss (nats)")
    axes.set_title(f"Loss by position, windows of {factor}x the training length")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def check_extrapolate_task(parser: argparse.ArgumentParser, args: argparse.Namespace, models: list[tuple]) -> None:
    """``extrapolate --task``: the task's settings, and models it can score (decoders; for mqar and copy, whose
    examples are bytes, a vocabulary holding the byte tokenizer's ids)."""
    if args.task == "lm":
        check_copy_flags(parser, args, None)
        return
    check_task_flags(parser, args, None)
    block = copy_block_size(args.copy_max_length) if args.task == "copy" and args.copy_layout == "kazemnejad" else None
    for name, config, _, train_length in models:
        if not is_decoder(config):
            parser.error(f"--task {args.task}: {name} is an encoder; the tasks score decoders (the answer comes last)")
        if block is not None and train_length != block:
            parser.error(
                f"--task copy --copy_layout kazemnejad at --copy_max_length {args.copy_max_length} scores rows of "
                f"multiples of {block} tokens (2 x {args.copy_max_length} + 8); {name} trained at {train_length}: "
                "give its --copy_max_length ((training length - 8) / 2)"
            )
        if args.task in ("mqar", "copy") and config.vocab_size < 256 + BYTE_OFFSET:
            parser.error(
                f"--task {args.task} is written in the byte tokenizer's ids (byte + {BYTE_OFFSET}); {name} has "
                f"{config.vocab_size} tokens"
            )


def score_task_models(args: argparse.Namespace, models: list[tuple]) -> list[dict[str, Any]]:
    """``extrapolate --task mqar|copy|passkey``: each decoder's accuracy at each length on the same examples (passkey
    in the model's own tokenizer, filler from ``--eval_file`` or the held-out part of the embedded corpus); models
    that differ only in their training seed are one row (mean ± std). Writes ``extrapolation.md``,
    ``extrapolation.json`` and ``extrapolation.png``."""
    accelerator = recipe_accelerator(args)
    rows = []
    for name, config, tokenizer, train_length in models:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            name, config=config, trust_remote_code=args.trust_remote_code
        )
        model = model.to(accelerator.device).eval()
        held_out = 100 if args.eval_file is not None else args.validation_split_percentage
        texts = passkey_texts(tokenizer, args.eval_file, held_out) if args.task == "passkey" else None
        task = TaskSpec.from_flags(args, texts)
        scores = task_row(
            model, task, train_length, args.factors, args.task_eval_examples, args.per_device_eval_batch_size,
            args.seed, args.passkey_depths,
        )  # fmt: skip
        label = model_label(name, config)
        rows.append({
            "model": str(name), "label": label, "train_length": train_length, **scores,
            "recipe": training_recipe(name),
        })  # fmt: skip
        cells = ", ".join(f"{k} {format_cell(v)}" for k, v in scores["accuracy"].items())
        accelerator.print(f"{name} ({label}): {cells}")
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["label"], row["recipe"]), []).append(row)
    summary = []
    for (label, _), members in groups.items():
        models = [member["model"] for member in members]
        summary.append(
            {"label": label, "models": models, **accuracy_summary(members, args.factors, args.passkey_depths)}
        )
    labels = unique_labels([entry["label"] for entry in summary], [entry["models"][0] for entry in summary])
    for entry, label in zip(summary, labels, strict=True):
        entry["label"] = label
        entry["model"] = entry["models"][0] if len(entry["models"]) == 1 else f"{len(entry['models'])} models"
    if accelerator.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        description = TaskSpec.from_flags(args)
        report = f"### {description.describe()}\n\n" + accuracy_table(summary, args.factors, ["model", "label"])
        if args.task == "passkey":
            report += "\n#### passkey by depth\n\n" + depth_table(summary, args.factors, args.passkey_depths, "label")
        report += (
            f"\n- Nx: accuracy on {args.task_eval_examples} examples of N times each model's training length, the "
            "same examples for every model; several models of one recipe (seeds): mean ± sample standard deviation.\n"
        )
        report += "".join(
            f"- {note}\n" for note in baseline_notes(description) + copy_notes(description, args.factors)
        )
        (args.output_dir / "extrapolation.md").write_text(report)
        document = {"task": args.task, "rows": rows, "summary": summary}
        (args.output_dir / "extrapolation.json").write_text(json.dumps(document, indent=2))
        title = f"{args.task}: accuracy"
        plot_tasks(
            summary, args.factors, args.passkey_depths, args.output_dir / "extrapolation.png", title, False,
            description.baselines(),
        )  # fmt: skip
        print(report)
    accelerator.wait_for_everyone()
    return rows
