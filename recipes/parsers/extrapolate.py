"""The command line of ``hf-posenc extrapolate`` (:mod:`hf_posenc_recipes.extrapolate`). Standard library only."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import (
    add_flags,
    add_threads_flag,
    new_parser,
    output_folder,
    positive_int,
)
from .tasks import add_task_flags


def extrapolate_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "extrapolate",
        """
Each length L is measured with sliding windows (Press et al. 2022): windows of L tokens moved by the training
length, each scored on its last training-length positions. A decoder is scored on the next token, an encoder on 15 %
of those positions, masked (fixed draw). A model that cannot run at a length gets the reason instead of a number.
Writes extrapolation.md, extrapolation.json and extrapolation.png to --output_dir.

  hf-posenc extrapolate --model_name_or_path out/rope out/alibi out/learned --output_dir out/extrapolation
  hf-posenc extrapolate --model_name_or_path compare-output/models/*/seed_* --output_dir out/extrapolation
Models whose training_args.json differ only in the seed (the seeds of one compare --seeds run) are one row: mean ±
standard deviation. A decoder's loss at each position of a window of the longest length (binned) follows the table,
its curve in extrapolation_positions.png.

With --task mqar, copy or passkey each decoder is scored on that task instead: its accuracy at each length
(passkey's also by depth), on the same examples for every model. Passkey is text in the model's own tokenizer, so a
model trained on language (a compare run, a retrofitted checkpoint) is scored zero-shot:
  hf-posenc extrapolate --task mqar --model_name_or_path out/mqar/models/*/ --output_dir out/mqar-again
  hf-posenc extrapolate --task passkey --model_name_or_path compare-output/models/* --output_dir out/passkey-zero-shot
""",
    )
    parser.add_argument("--model_name_or_path", nargs="+", required=True, help="saved models (folders or Hub names)")
    parser.add_argument("--tokenizer_name", default=None, help="when None: each model's own tokenizer")
    parser.add_argument("--trust_remote_code", action="store_true", help="allow code from the models' folders")
    parser.add_argument("--eval_file", type=Path, default=None, help="plain text, all of it (default: see below)")
    parser.add_argument(
        "--validation_split_percentage",
        type=int,
        default=5,
        help="without --eval_file: the held-out first %% of the embedded corpus, as the pretraining recipe splits it",
    )
    parser.add_argument("--train_length", type=int, default=None, help="when None: each model's training block size")
    add_flags(parser, ("factors", "max_eval_tokens", "per_device_eval_batch_size"), per_device_eval_batch_size=8)
    add_flags(parser, ("seed",))
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="score each encoder once per masking draw (a decoder's score draws nothing: once); the table gives the "
        "mean ± standard deviation over the draws and over the models that differ only in their training seed",
    )
    parser.add_argument(
        "--output_dir", type=output_folder, default="extrapolation-output", help="the table, the JSON file, the plot"
    )
    add_threads_flag(parser)
    parser.add_argument(
        "--position_bins",
        type=positive_int,
        default=16,
        help="the bins of the loss by position (over a window of the longest --factors length)",
    )
    add_task_flags(parser, "score each decoder on the task")
    return parser
