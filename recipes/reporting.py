"""What compare, extrapolate and the long-context tasks share, below all three: a run's name, folder and pretraining
command line, a model's label and experiment, and the figures of a table (a seed's cell, the mean and spread over
seeds), with the training curve a report draws."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

import transformers

from hf_posenc.configuration_posenc import layout_name
from hf_posenc_recipes.parsers.common import MODEL_FLAGS, TRAINING_FLAGS, layout_sizes, parse_scheme


Run = tuple[str, str, str, int]
"""One model of a comparison: task, scheme (or layout), normalizer, seed."""


def folder_name(text: str) -> str:
    """A scheme or normalizer as a folder and Hub name part: ``softmax:output_gate=elementwise`` ->
    ``softmax-output_gate_elementwise``."""
    return text.replace(":", "-").replace(",", "-").replace("=", "_")


def run_name(args: argparse.Namespace, run: Run) -> str:
    """One run's name: ``<task>-<scheme>-<normalizer>``, and ``-seed<s>`` with ``--seeds`` (its Hub suffix)."""
    task, scheme, normalizer, seed = run
    name = f"{task}-{folder_name(scheme)}-{folder_name(normalizer)}"
    return name + (f"-seed{seed}" if args.seeds is not None else "")


def run_folder(args: argparse.Namespace, run: Run) -> Path:
    """``models/<task>-<scheme>-<normalizer>``, with ``--seeds`` one ``seed_<s>`` folder in it per seed."""
    task, scheme, normalizer, seed = run
    folder = args.output_dir / "models" / f"{task}-{folder_name(scheme)}-{folder_name(normalizer)}"
    return folder / f"seed_{seed}" if args.seeds is not None else folder


def spec_argument(text: str) -> str:
    """The pretraining flag value of ``name`` or ``name:key=value,...``: the name, or the spec as JSON."""
    return json.dumps(parse_scheme(text)) if ":" in text else text


def layers_description(args: argparse.Namespace) -> str:
    """The depth for a report's recipe line, with ``--layer_types`` where given (``4 layers (linear_attention x3,
    full_attention)``) and the canon layers where there are some (``, canon layers B (kernel 3)``)."""
    depth = f"{args.num_hidden_layers} layers"
    if args.layer_types is not None:
        runs = [(kind, len(list(group))) for kind, group in itertools.groupby(args.layer_types)]
        depth += f" ({', '.join(kind if n == 1 else f'{kind} x{n}' for kind, n in runs)})"
    if args.canon_layers:
        depth += f", canon layers {args.canon_layers} (kernel {args.canon_kernel_size or 4})"
    return depth


def recipe_argv(args: argparse.Namespace, run: Run, output_dir: Path) -> list[str]:
    """The pretraining command line of one run: every model and training flag of compare's (its
    :data:`~hf_posenc_recipes.parsers.common.MODEL_FLAGS` and ``TRAINING_FLAGS``, given or at compare's default),
    the scheme (or layout), the normalizer and the run's seed; with ``--push_to_hub`` the run uploads to
    ``<--hub_model_id>-<task>-<scheme>-<normalizer>`` (and ``-seed<s>`` with ``--seeds``)."""
    task, scheme, normalizer, seed = run
    if scheme in args.layouts:
        argv = ["--task", task, "--layout", scheme]
        window, chunk = layout_sizes(scheme, args.sliding_window, args.attention_chunk_size)
        argv += ["--sliding_window", str(window)] if window is not None else []
        argv += ["--attention_chunk_size", str(chunk)] if chunk is not None else []
    else:
        argv = ["--task", task, "--position_encoding", spec_argument(scheme)]
    argv += ["--attention_normalizer", spec_argument(normalizer)]
    for flag in ("block_size", *MODEL_FLAGS, *TRAINING_FLAGS):
        value = seed if flag == "seed" else getattr(args, flag)
        if value is not None:
            argv += [f"--{flag}", *map(str, value)] if isinstance(value, list) else [f"--{flag}", str(value)]
    argv += ["--reference_init", str(args.reference_init).lower(), "--threads", str(args.threads)]
    if args.with_tracking:
        argv += ["--with_tracking", "--report_to", args.report_to]
    if args.train_file is not None:
        argv += ["--train_file", str(args.train_file)]
    if args.dataset_name is not None:
        argv += ["--dataset_name", args.dataset_name, "--text_column_name", args.text_column_name]
        argv += ["--dataset_config_name", args.dataset_config_name] if args.dataset_config_name is not None else []
    if args.tokenizer_name is not None:
        argv += ["--tokenizer_name", args.tokenizer_name]
    if args.push_to_hub:
        prefix = args.hub_model_id or args.output_dir.resolve().name
        argv += ["--push_to_hub", "--hub_model_id", f"{prefix}-{run_name(args, run)}"]
        argv += ["--hub_token", args.hub_token] if args.hub_token is not None else []
    return [*argv, "--output_dir", str(output_dir)]


def smoothed_curve(log_path: Path, points: int = 100) -> list[tuple[int, float]]:
    """The training loss from ``train_log.jsonl``: every step of a run of up to ``points`` steps, else the mean of
    consecutive windows (the last one may be shorter), at most ``points`` of them, so every run length shows its
    whole curve."""
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    every = max(1, math.ceil(len(records) / points))
    windows = [records[i : i + every] for i in range(0, len(records), every)]
    return [(window[-1]["step"], sum(r["loss"] for r in window) / len(window)) for window in windows]


def is_decoder(config: transformers.PretrainedConfig) -> bool:
    """Decoders are scored on the next token, encoders on masked tokens. A decoder: a GPT-2 type, a config that says
    so, or a causal-LM architecture (``...ForCausalLM``, ``...LMHeadModel``: a retrofitted checkpoint's config names
    its stock class)."""
    causal = any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in config.architectures or [])
    return config.model_type in ("posenc_gpt2", "gpt2") or causal or bool(getattr(config, "is_decoder", False))


def model_label(name: str, config: transformers.PretrainedConfig) -> str:
    """``rope + softmax`` for a PosEnc or retrofitted model, ``stock gpt2`` for another: what a plot's legend shows."""
    encoding = getattr(config, "position_encoding", None)
    if encoding is None:
        return f"stock {config.model_type}"
    return f"{layout_name(encoding)} + {config.attention_normalizer['type']}"


def unique_labels(labels: list[str], names: list[str]) -> list[str]:
    """Labels that repeat (two rope models) get the model's folder name added."""
    return [
        f"{label} ({Path(name).name})" if labels.count(label) > 1 else label
        for label, name in zip(labels, names, strict=True)
    ]


TRAINING_DETAILS = (
    "seed", "output_dir", "hub_model_id", "hub_token", "push_to_hub", "resume_from_checkpoint", "checkpointing_steps",
    "with_tracking", "report_to", "preprocessing_num_workers", "overwrite_cache", "threads",
)  # fmt: skip
"""What a model's ``training_args.json`` records that does not make it another experiment: two models whose
arguments differ only here are seeds of one."""


def training_recipe(name: str | Path) -> str:
    """What makes a model one experiment: the pretraining recipe's arguments in its folder (``training_args.json``)
    without :data:`TRAINING_DETAILS`, so the seeds of one ``compare --seeds`` run share it; a model without the file
    (a Hub name, a stock checkpoint) is its own."""
    path = Path(name) / "training_args.json"
    if not path.is_file():
        return f"model {name}"
    arguments = json.loads(path.read_text())
    return json.dumps({key: value for key, value in arguments.items() if key not in TRAINING_DETAILS}, sort_keys=True)


def mean_and_spread(values: list[Any]) -> dict[str, Any] | str | None:
    """``{"mean", "std", "min", "max"}`` of one figure over the seeds (``std``: the sample standard deviation, None
    for one seed); the reason where a seed has one instead of a number (a length the model cannot run); None if
    any is None."""
    reasons = [value for value in values if isinstance(value, str)]
    if reasons:
        return reasons[0]
    if any(value is None for value in values):
        return None
    std = statistics.stdev(values) if len(values) > 1 else None
    return {"mean": statistics.fmean(values), "std": std, "min": min(values), "max": max(values)}


def format_cell(value: float | str | None, digits: int = 3) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return "n/a"
    return f"{value:.{digits}f}"


def summary_cell(figure: dict[str, Any] | str | None, digits: int = 3) -> str:
    """``mean ± std`` (``mean`` for one seed), ``n/a`` for a length a model cannot run."""
    if figure is None:
        return ""
    if isinstance(figure, str):
        return "n/a"
    if figure["std"] is None:
        return f"{figure['mean']:.{digits}f}"
    return f"{figure['mean']:.{digits}f} ± {figure['std']:.{digits}f}"
