"""Length extrapolation: the loss of trained models at 1x, 2x, 4x, 8x the length they were trained on.

Each length L is measured with sliding windows, as Press et al. (2022, "Train Short, Test Long", ALiBi) do: windows
of L tokens moved ``stride`` tokens at a time (``stride`` = the training length by default), each scored only on its
last ``stride`` positions, so every scored token sits at positions ``L - stride .. L - 1`` with at least
``L - stride`` tokens of context. At 1x the windows are the training blocks themselves. A decoder is scored on
next-token prediction; an encoder on 15 % of those last positions, masked (fixed draw). A model that cannot run at
a length (a ``learned`` table shorter than the window) gets the reason in the table instead of a number::

    hf-posenc extrapolate --model_name_or_path out/rope out/alibi out/learned --output_dir out/extrapolation
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from hf_posenc_recipes import long_context
from hf_posenc_recipes.cli import run_recipe
from hf_posenc_recipes.common import checked_input, progress_bar_off, recipe_accelerator, torch_threads
from hf_posenc_recipes.parsers.common import DEFAULT_FACTORS
from hf_posenc_recipes.parsers.extrapolate import extrapolate_parser
from hf_posenc_recipes.pretrain import IGNORE_INDEX, batch_generator, embedded_corpus_file, token_losses
from hf_posenc_recipes.reporting import (
    format_cell,
    is_decoder,
    mean_and_spread,
    model_label,
    summary_cell,
    training_recipe,
    unique_labels,
)


def window_starts(num_tokens: int, window: int, stride: int) -> list[int]:
    """Start of every full window of ``window`` tokens moved by ``stride`` over ``num_tokens`` tokens."""
    return list(range(0, num_tokens - window + 1, stride))


def training_length(model_dir: str | Path, config: transformers.PretrainedConfig) -> int:
    """The block size a model was trained on: from the recipe's ``training_args.json``, else its position limit."""
    arguments = Path(model_dir) / "training_args.json"
    if arguments.is_file():
        return int(json.loads(arguments.read_text())["block_size"])
    for name in ("n_positions", "max_position_embeddings"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise ValueError(f"{model_dir}: no training_args.json and no position limit in its config; give --train_length.")


@torch.no_grad()
def sliding_window_loss(
    model: transformers.PreTrainedModel,
    ids: torch.Tensor,
    window: int,
    stride: int,
    batch_size: int = 8,
    mask_token_id: int | None = None,
    seed: int = 0,
    accelerator: Accelerator | None = None,
) -> float:
    """Mean loss (nats per scored token) on the last ``stride`` positions of every window of ``window`` tokens.

    ``ids``: the evaluation text, ``(num_tokens,)``. Decoders score the next token at each of those positions;
    encoders (``mask_token_id`` given) score 15 % of them, replaced by the mask token with a fixed draw. With an
    ``accelerator`` of several processes each scores its share of the windows and all return the same mean.
    """
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in 1..window={window}, got {stride}")
    starts = window_starts(len(ids), window, stride)
    if not starts:
        raise ValueError(f"The evaluation text has {len(ids)} tokens, fewer than one window of {window}.")
    device = next(model.parameters()).device
    batches = range(0, len(starts), batch_size)
    if accelerator is not None:  # each process scores its share of the windows; the sums are added up below
        batches = batches[accelerator.process_index :: accelerator.num_processes]
    main_process = accelerator is None or accelerator.is_local_main_process
    total, count, error = 0.0, 0, None
    try:
        for first in tqdm(batches, desc=f"windows of {window}", disable=progress_bar_off(main_process), leave=False):
            blocks = torch.stack([ids[s : s + window] for s in starts[first : first + batch_size]])
            if mask_token_id is None:
                labels = blocks
                inputs = blocks
            else:
                chosen = torch.zeros_like(blocks, dtype=torch.bool)
                draw = torch.rand(blocks.shape[0], stride, generator=batch_generator(seed, window, first)) < 0.15
                chosen[:, window - stride :] = draw
                labels = blocks.masked_fill(~chosen, IGNORE_INDEX)
                inputs = blocks.masked_fill(chosen, mask_token_id)
            task = "clm" if mask_token_id is None else "mlm"
            logits = model(input_ids=inputs.to(device)).logits
            losses, _ = token_losses(logits, labels.to(device), task)
            last = losses[:, -min(stride, losses.shape[1]) :]
            scored = ~last.isnan()
            total += last[scored].double().sum().item()
            count += int(scored.sum())
    except ValueError as raised:  # e.g. a learned table shorter than the window; every process must hear of it
        error = raised
    if accelerator is not None and accelerator.num_processes > 1:
        messages = [message for message in gather_object([None if error is None else str(error)]) if message]
        if messages:
            raise ValueError(messages[0])
        sums = torch.tensor([total, count], dtype=torch.float64, device=accelerator.device)
        total, count = accelerator.reduce(sums, "sum").tolist()
    elif error is not None:
        raise error
    return total / count


def extrapolation_row(
    model: transformers.PreTrainedModel,
    ids: torch.Tensor,
    train_length: int,
    factors: tuple[int, ...] = DEFAULT_FACTORS,
    batch_size: int = 8,
    mask_token_id: int | None = None,
    seed: int = 0,
    accelerator: Accelerator | None = None,
) -> dict[str, float | str]:
    """``{"1x": loss, "2x": loss or the reason it cannot run, ...}`` for one model (the windows split over the
    ``accelerator``'s processes)."""
    row: dict[str, float | str] = {}
    for factor in factors:
        window = factor * train_length
        try:
            row[f"{factor}x"] = sliding_window_loss(
                model, ids, window, train_length, batch_size, mask_token_id, seed, accelerator
            )
        except ValueError as error:  # e.g. a learned table shorter than the window: the model says why
            row[f"{factor}x"] = str(error).split(". ")[0].rstrip(".")
    return row


def summarize_models(rows: list[dict[str, Any]], factors: tuple[int, ...]) -> list[dict[str, Any]]:
    """One row per experiment (label and :func:`training_recipe`): each length and the ratio as
    :func:`mean_and_spread` over its models (the seeds it was trained with) and their masking draws (``--seeds``)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["label"], row["recipe"]), []).append(row)
    summary = []
    for (label, _), models in groups.items():
        draws = [draw for model in models for draw in model["draws"].values()]
        ratios = [
            draw[f"{factors[-1]}x"] / draw[f"{factors[0]}x"]
            if isinstance(draw[f"{factors[-1]}x"], float) and isinstance(draw[f"{factors[0]}x"], float)
            else None
            for draw in draws
        ]
        summary.append({
            "label": label, "models": [model["model"] for model in models], "values": len(draws),
            **{f"{f}x": mean_and_spread([draw[f"{f}x"] for draw in draws]) for f in factors},
            "ratio": mean_and_spread(ratios),
        })  # fmt: skip
    return summary


def markdown_table(summary: list[dict[str, Any]], factors: tuple[int, ...]) -> str:
    """One row per experiment: loss at each length and the ratio of the longest to the training length, the mean ±
    the sample standard deviation where it has several models (seeds) or masking draws."""
    last = f"{factors[-1]}x"
    header = ["model", "scheme", *[f"{f}x" for f in factors], f"{last} / {factors[0]}x"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes = []
    for row in summary:
        models = (
            row["models"][0] if len(row["models"]) == 1 else f"{len(row['models'])} models ({row['models'][0]}, ...)"
        )
        cells = [models, row["label"], *[summary_cell(row[f"{f}x"]) for f in factors], summary_cell(row["ratio"], 2)]
        lines.append("| " + " | ".join(cells) + " |")
        notes += [f"n/a: {models} at {f}x: {row[f'{f}x']}." for f in factors if isinstance(row[f"{f}x"], str)]
    if any(row["values"] > 1 for row in summary):
        notes.append("Mean ± sample standard deviation over each experiment's models (its seeds) and masking draws.")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def plot_rows(summary: list[dict[str, Any]], factors: tuple[int, ...], path: Path, title: str) -> None:
    """Loss against the length factor (log scale), one line per experiment, labelled ``row["label"]`` (its scheme and
    normalizer), with error bars of one standard deviation where it has several values; lengths a model cannot run
    are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for row in summary:
        points = [(f, row[f"{f}x"]) for f in factors if isinstance(row[f"{f}x"], dict)]
        if points and row["values"] > 1:
            means, spread = [p["mean"] for _, p in points], [p["std"] for _, p in points]
            axes.errorbar([f for f, _ in points], means, yerr=spread, marker="o", capsize=3, label=row["label"])
        elif points:
            axes.plot([f for f, _ in points], [p["mean"] for _, p in points], marker="o", label=row["label"])
    axes.set_xscale("log", base=2)
    axes.set_xticks(list(factors), [f"{f}x" for f in factors])
    axes.set_xlabel("evaluation length / training length")
    axes.set_ylabel("loss (nats per token) on the last positions")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def evaluation_ids(
    tokenizer, text_file: Path | None, held_out_percentage: int | None, max_tokens: int | None
) -> torch.Tensor:
    """The evaluation text as token ids: the first ``held_out_percentage`` % of the lines of ``text_file`` (the split
    the pretraining recipe holds out for validation), or all of it when that is None; the embedded corpus when
    ``text_file`` is None. At most ``max_tokens`` tokens."""
    lines = Path(text_file or embedded_corpus_file()).read_text().splitlines(keepends=True)
    text = "".join(lines if held_out_percentage is None else lines[: len(lines) * held_out_percentage // 100])
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    return ids[:max_tokens] if max_tokens else ids


def checked_model(
    parser: argparse.ArgumentParser, args: argparse.Namespace, name: str
) -> tuple[transformers.PretrainedConfig, transformers.PreTrainedTokenizerBase, int]:
    """A model's config, tokenizer and training length, read before any model is scored: a bad one stops the recipe
    with one line naming it, not after the good ones have been scored."""
    remote = {"trust_remote_code": args.trust_remote_code}
    config = checked_input(
        parser, "--model_name_or_path", name, partial(transformers.AutoConfig.from_pretrained, **remote), weights=True
    )
    flag = "--tokenizer_name" if args.tokenizer_name else "--model_name_or_path"
    load_tokenizer = partial(transformers.AutoTokenizer.from_pretrained, **remote)
    tokenizer = checked_input(parser, flag, args.tokenizer_name or name, load_tokenizer)
    if not is_decoder(config) and tokenizer.mask_token_id is None:
        parser.error(f"{flag} {args.tokenizer_name or name}: no mask token, which scoring the encoder {name} needs")
    try:
        return config, tokenizer, args.train_length or training_length(name, config)
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = extrapolate_parser()
    args = parser.parse_args(argv)
    if args.eval_file is not None and not args.eval_file.is_file():
        parser.error(f"--eval_file {args.eval_file} does not exist")
    if any(factor < 1 for factor in args.factors):
        parser.error(f"--factors must be >= 1, got {args.factors}")
    if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds must not repeat a seed, got {args.seeds}")
    args.factors = tuple(sorted(set(args.factors)))
    models = [(name, *checked_model(parser, args, name)) for name in args.model_name_or_path]
    long_context.check_extrapolate_task(parser, args, models)
    with torch_threads(args.threads):
        if args.task != "lm":
            return long_context.score_task_models(args, models)
        return score_models(args, models)


def score_models(args: argparse.Namespace, models: list[tuple]) -> list[dict[str, Any]]:
    """Score every model of ``models`` (name, config, tokenizer, training length) at each length; write the report."""
    accelerator = recipe_accelerator(args)
    rows = []
    for name, config, tokenizer, train_length in models:
        decoder = is_decoder(config)
        auto_class = transformers.AutoModelForCausalLM if decoder else transformers.AutoModelForMaskedLM
        model = auto_class.from_pretrained(name, config=config, trust_remote_code=args.trust_remote_code)
        model = model.to(accelerator.device).eval()
        held_out = None if args.eval_file is not None else args.validation_split_percentage
        ids = evaluation_ids(tokenizer, args.eval_file, held_out, args.max_eval_tokens)
        mask_token_id = None if decoder else tokenizer.mask_token_id
        seeds = [args.seed] if decoder or args.seeds is None else args.seeds  # a decoder's score draws nothing
        draws = {
            str(seed): extrapolation_row(
                model,
                ids,
                train_length,
                args.factors,
                args.per_device_eval_batch_size,
                mask_token_id,
                seed,
                accelerator,
            )  # fmt: skip
            for seed in seeds
        }
        row = {f"{f}x": mean_and_spread([draw[f"{f}x"] for draw in draws.values()]) for f in args.factors}
        row = {key: value["mean"] if isinstance(value, dict) else value for key, value in row.items()}
        label = model_label(name, config)
        rows.append({
            "model": str(name), "label": label, "train_length": train_length, **row, "draws": draws,
            "recipe": training_recipe(name),
        })  # fmt: skip
        if decoder:
            rows[-1]["loss_by_position"] = long_context.position_row(
                model, ids, train_length, args.factors[-1], args.position_bins, args.per_device_eval_batch_size
            )
        accelerator.print(f"{name} ({label}): " + ", ".join(f"{k} {format_cell(v)}" for k, v in row.items()))
    summary = summarize_models(rows, args.factors)
    labels = unique_labels([entry["label"] for entry in summary], [entry["models"][0] for entry in summary])
    for entry, label in zip(summary, labels, strict=True):
        entry["label"] = label
    if accelerator.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        table = markdown_table(summary, args.factors) + long_context.position_table(rows, args.factors[-1])
        (args.output_dir / "extrapolation.md").write_text(table)
        document = {"rows": rows, "summary": summary}
        (args.output_dir / "extrapolation.json").write_text(json.dumps(document, indent=2))
        long_context.plot_positions(rows, args.factors[-1], args.output_dir / "extrapolation_positions.png")
        plot_rows(summary, args.factors, args.output_dir / "extrapolation.png", "Length extrapolation")
        print(table)
    accelerator.wait_for_everyone()
    return rows


if __name__ == "__main__":  # python recipes/extrapolate.py ..., accelerate launch recipes/extrapolate.py ...
    raise SystemExit(run_recipe("extrapolate", sys.argv[1:], main))
