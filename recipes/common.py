"""What every recipe shares: the accelerator (processes, trackers), the Hub repository (checked before any work,
uploads at checkpoints) and the model card. Not part of the modeling code (saved models do not carry it)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import datasets
import torch
from accelerate import Accelerator
from huggingface_hub import HfApi, ModelCard, ModelCardData, constants
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from transformers.utils import logging as hf_logging

from hf_posenc.configuration_posenc import layout_name


CHECKPOINT_PATTERNS = ["step_*", "epoch_*", "seed_*"]
"""Folders of ``--output_dir`` that are not the model: accelerate states, per-seed runs; never uploaded."""
WEIGHT_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
Loaded = TypeVar("Loaded")


def is_local_path(name: str) -> bool:
    """A name that can only mean a local file or folder (absolute, ``./``, ``~``, or more than one ``/``), never a
    Hub repository id (``name`` or ``owner/name``)."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or "\\" in name


def checked_input(
    parser: argparse.ArgumentParser, flag: str, name: str, load: Callable[[str], Loaded], weights: bool = False
) -> Loaded:
    """``load(name)`` (a config or a tokenizer) for the value ``name`` of ``flag``: a folder or a Hub name, read
    before any work starts. A folder that does not exist, a model folder without weights (``weights``), or anything
    ``load`` refuses stops the recipe at once, in one line naming the flag and the value."""
    path = Path(name).expanduser()
    if not path.exists() and is_local_path(name):
        parser.error(f"{flag} {name}: no such folder")
    if weights and path.is_dir() and not any((path / file).is_file() for file in WEIGHT_FILES):
        parser.error(f"{flag} {name}: the folder has no weights (none of {', '.join(WEIGHT_FILES)})")
    try:
        return load(str(path) if path.exists() else name)
    except (OSError, ValueError) as error:
        where = "" if path.exists() else "not a local folder; from the Hub: "
        parser.error(f"{flag} {name}: {where}{' '.join(str(error).split())}")


@contextmanager
def torch_threads(count: int) -> Iterator[int]:
    """Run the block with ``count`` torch threads in this process (0: leave torch's default, one per core), then give
    back the number it had; yields the number the block runs with."""
    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def progress_bar_off(main_process: bool) -> bool | None:
    """tqdm's ``disable`` for a recipe's progress bar: off outside the main process, else None, which tqdm reads as
    "shown on a terminal only", so a log redirected to a file holds no progress lines."""
    return None if main_process else True


@contextmanager
def library_progress_bars_on_a_terminal() -> Iterator[None]:
    """Run the block with the progress bars of ``datasets`` (``map``) and Transformers (loading and writing
    weights) shown only when stderr is a terminal, then restore their settings: the command's log redirected to a
    file holds no progress lines."""
    switches = [
        (datasets.is_progress_bar_enabled, datasets.disable_progress_bars, datasets.enable_progress_bars),
        (hf_logging.is_progress_bar_enabled, hf_logging.disable_progress_bar, hf_logging.enable_progress_bar),
    ]
    turned_off = []
    if not sys.stderr.isatty():
        for is_enabled, disable, enable in switches:
            if is_enabled():
                disable()
                turned_off.append(enable)
    try:
        yield
    finally:
        for enable in turned_off:
            enable()


WARNED: set[str] = set()
"""The warnings :func:`warn` has printed in this process."""


def warn(prog: str, message: str) -> None:
    """Print ``<prog>: warning: <message>`` on stderr (the main process of a launch only), once per process: compare
    checks its runs' flags before pretraining them, and each run would say the same again."""
    if message in WARNED or int(os.environ.get("RANK", "0")) != 0:
        return
    WARNED.add(message)
    print(f"{prog}: warning: {message}", file=sys.stderr)


def warn_short_schedule(prog: str, max_train_steps: int | None, num_warmup_steps: int) -> None:
    """Warn when ``--max_train_steps`` does not exceed ``--num_warmup_steps``: the learning rate is still rising when
    the run stops, so it never trains at its peak nor decays."""
    if max_train_steps and max_train_steps <= num_warmup_steps:
        warn(
            prog,
            f"--max_train_steps {max_train_steps} does not exceed --num_warmup_steps {num_warmup_steps}: the learning "
            "rate is still warming up when training stops (no step at its peak, no decay), so the losses are those of "
            "a model barely trained, not of the schedule; give more steps or a shorter --num_warmup_steps.",
        )


def is_multi_cpu_launch() -> bool:
    """Several processes (torchrun, ``accelerate launch --multi_gpu``) on a machine without CUDA: accelerate must be
    told to join them as one multi-CPU run over gloo, or each process runs alone as rank 0 of 1."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()


def recipe_accelerator(args: argparse.Namespace, **kwargs) -> Accelerator:
    """The recipe's ``Accelerator``: multi-CPU under a multi-process launch without CUDA, and accelerate's trackers
    (``--report_to``, logging under ``--output_dir``) when ``--with_tracking`` is given."""
    tracking = getattr(args, "with_tracking", False)
    return Accelerator(
        cpu=is_multi_cpu_launch() or None,
        log_with=args.report_to if tracking else None,
        project_dir=str(args.output_dir) if tracking else None,
        **kwargs,
    )


def tracker_config(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments as trackers take them (numbers, strings, booleans); the Hub token left out."""
    config = {}
    for key, value in vars(args).items():
        if key == "hub_token":
            continue
        if isinstance(value, Path):
            value = str(value)
        config[key] = value if isinstance(value, (int, float, str, bool)) else json.dumps(value, default=str)
    return config


def hub_repository(args: argparse.Namespace, suffix: str = "") -> str | None:
    """With ``--push_to_hub``: create the Hub repository ``--hub_model_id`` (default: the name of ``--output_dir``)
    followed by ``suffix`` (or find it) before any work, and return its id; fail at once, with what to check
    (``OSError``), when the Hub cannot be reached or refuses."""
    if not args.push_to_hub:
        return None
    name = (args.hub_model_id or Path(args.output_dir).resolve().name) + suffix
    try:
        return HfApi(token=args.hub_token).create_repo(name, exist_ok=True).repo_id
    except Exception as error:  # connection refused, bad token, no permission: each is a reason not to start
        raise OSError(
            f"--push_to_hub: cannot create or reach the Hub repository {name!r} at {constants.ENDPOINT} "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no message'}). Check "
            "--hub_model_id, --hub_token (or `hf auth login`) and the network; nothing was trained."
        ) from None


def upload_folder(repo_id: str, folder: Path, message: str, token: str | None, blocking: bool) -> Future | Any:
    """Upload ``folder`` (without checkpoint states) to ``repo_id``; in the background unless ``blocking``, as
    Transformers' ``Trainer`` pushes its checkpoints."""
    return HfApi(token=token).upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        commit_message=message,
        ignore_patterns=CHECKPOINT_PATTERNS,
        run_as_future=not blocking,
    )


def scheme_names(config) -> tuple[str, str]:
    """``(position encoding, normalizer)`` of a PosEnc or retrofitted model's config; a stock model's own scheme
    is described by its model type."""
    encoding = getattr(config, "position_encoding", None)
    normalizer = getattr(config, "attention_normalizer", None)
    if encoding is None:
        return f"stock {config.model_type}", "softmax"
    return layout_name(encoding), normalizer["type"]


def write_model_card(
    folder: Path,
    config,
    recipe: str,
    args: argparse.Namespace,
    data: str,
    results: dict[str, Any],
    repo_id: str | None = None,
    auto_class: str = "AutoModel",
) -> ModelCard:
    """``README.md`` in ``folder``: the scheme and normalizer (with their options), the architecture, the data, every
    flag of the recipe and its results, and how to load the model."""
    encoding, normalizer = scheme_names(config)
    tags = ["hf_posenc", "position-encoding", f"position-encoding-{encoding.replace(' ', '-')}"]
    tags.append(f"attention-normalizer-{normalizer}")
    dataset_name = getattr(args, "dataset_name", None)
    card_data = ModelCardData(
        library_name="transformers",
        tags=tags,
        datasets=[dataset_name] if dataset_name else None,
        base_model=getattr(args, "model_name_or_path", None) if recipe != "pretrain" else None,
    )
    name = repo_id or folder.resolve().name
    location = repo_id or str(folder)  # what from_pretrained reads: the Hub id, else the folder as written
    flags = "\n".join(
        f"| `--{key}` | `{value}` |" for key, value in tracker_config(args).items() if value not in (None, "null")
    )
    metrics = "\n".join(f"| {key} | {_format(value)} |" for key, value in results.items() if _is_scalar(value))
    options = {
        "position_encoding": getattr(config, "position_encoding", None),
        "attention_normalizer": getattr(config, "attention_normalizer", None),
    }
    content = f"""---
{card_data.to_yaml()}
---

# {name}

A `{config.model_type}` model with position encoding **{encoding}** and attention normalizer **{normalizer}**, made
by `hf-posenc {recipe}` (hf_posenc: every Transformer position encoding and attention normalizer as a config
switch).

## Model

- position encoding: `{json.dumps(options["position_encoding"])}`
- attention normalizer: `{json.dumps(options["attention_normalizer"])}`
- model type `{config.model_type}`, architectures {config.architectures}

## Data

{data}

## Training: `hf-posenc {recipe}`

| flag | value |
|---|---|
{flags}

## Results

| metric | value |
|---|---|
{metrics}

## Use

```python
import transformers

model = transformers.{auto_class}.from_pretrained("{location}", trust_remote_code=True)
```

The folder carries its modeling code, so `trust_remote_code=True` loads it where hf_posenc is not installed.
"""
    card = ModelCard(content)
    card.save(folder / "README.md")
    return card


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str)) and not isinstance(value, bool)


def _format(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)
