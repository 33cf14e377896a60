"""The command line of ``hf-posenc glue`` (:mod:`hf_posenc_recipes.glue`), with the flags of Transformers'
``run_glue_no_trainer.py``. Standard library only."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import (
    SCHEDULER_TYPES,
    add_hub_flags,
    add_threads_flag,
    add_tracking_flags,
    new_parser,
    output_folder,
    scheme_spec,
)


GLUE_TASK_NAMES = ["cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb", "wnli"]


def glue_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "glue",
        """
Data: nyu-mll/glue from the Hub, or local CSV / TSV / JSON files with GLUE's column names. The model is evaluated
after every epoch with the task's GLUE metrics; the best epoch is saved (with its tokenizer and a model card) and
predicts the test split into GLUE's submission file; --num_train_epochs 0 evaluates the checkpoint as it is.
Flags follow Transformers' run_glue_no_trainer.py. --position_encoding / --attention_normalizer convert a stock
BERT, RoBERTa or GPT-2 checkpoint with hf_posenc.convert; --retrofit patches any supported stock model in place
with hf_posenc.retrofit (every other weight kept in both cases).

  hf-posenc glue --model_name_or_path bert-base-uncased --task_name mrpc --output_dir out/mrpc
  hf-posenc glue --model_name_or_path bert-base-uncased --retrofit rope --task_name rte --output_dir out/rte
""",
    )
    parser.add_argument("--model_name_or_path", required=True, help="a checkpoint folder or Hub name")
    parser.add_argument("--tokenizer_name", default=None, help="when None: the checkpoint's tokenizer")
    parser.add_argument("--task_name", required=True, choices=GLUE_TASK_NAMES, help="the GLUE task")
    parser.add_argument("--train_file", type=Path, help="CSV / TSV / JSON with GLUE's columns (default: the Hub)")
    parser.add_argument("--validation_file", type=Path, help="with --train_file; MNLI: the matched set")
    parser.add_argument("--validation_mismatched_file", type=Path, help="MNLI only: the mismatched set")
    parser.add_argument("--test_file", type=Path, help="predicted into GLUE's submission file; MNLI: matched")
    parser.add_argument("--test_mismatched_file", type=Path, help="MNLI only: the mismatched test set")
    parser.add_argument("--max_length", type=int, default=128, help="tokens per example, longer ones truncated")
    parser.add_argument("--pad_to_max_length", action="store_true", help="pad every batch to --max_length")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8, help="examples per process and step")
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8, help="examples per process, evaluating")
    parser.add_argument("--learning_rate", type=float, default=5e-5, help="AdamW's peak learning rate")
    parser.add_argument("--weight_decay", type=float, default=0.0, help="AdamW's, on weights (not biases, norms)")
    parser.add_argument("--num_train_epochs", type=int, default=3, help="passes over train (0: evaluate only)")
    parser.add_argument("--max_train_steps", type=int, help="optimizer steps in all; overrides --num_train_epochs")
    parser.add_argument(
        "--gradient_accumulation_steps", type=int, default=1, help="batches accumulated per optimizer step"
    )
    parser.add_argument(
        "--lr_scheduler_type", default="linear", choices=SCHEDULER_TYPES, help="the schedule after warm-up"
    )
    parser.add_argument("--num_warmup_steps", type=int, default=0, help="optimizer steps of linear warm-up")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], help="when None: accelerate's config")
    parser.add_argument(
        "--output_dir", type=output_folder, required=True, help="the best model, its scores, the submission files"
    )
    parser.add_argument("--seed", type=int, default=42, help="initialisation of the head, batch order, dropout")
    parser.add_argument("--seeds", type=int, nargs="+", help="run once per seed; report mean and std")
    parser.add_argument(
        "--position_encoding",
        type=scheme_spec("position_encoding"),
        help="convert a stock checkpoint to this scheme (a name or a JSON dict)",
    )
    parser.add_argument(
        "--attention_normalizer",
        type=scheme_spec("attention_normalizer"),
        help="with --position_encoding or --retrofit (a name or a JSON dict)",
    )
    parser.add_argument(
        "--retrofit",
        type=scheme_spec("position_encoding"),
        help="retrofit a stock checkpoint to this scheme (hf_posenc.retrofit; a name or a JSON dict)",
    )
    parser.add_argument("--ignore_mismatched_sizes", action="store_true", help="new head where label counts differ")
    parser.add_argument("--trust_remote_code", action="store_true", help="allow code from the checkpoint's folder")
    add_threads_flag(parser)
    add_tracking_flags(parser)
    add_hub_flags(parser, "the best epoch's model")
    return parser
