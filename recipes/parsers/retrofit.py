"""The command line of ``hf-posenc retrofit`` (:mod:`hf_posenc_recipes.retrofit`). Standard library only."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import (
    add_flags,
    add_hub_flags,
    add_threads_flag,
    add_tracking_flags,
    catalogue_name,
    hidden_alias,
    new_parser,
    output_folder,
)


def retrofit_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "retrofit",
        """
For each scheme (x normalizer) the recipe loads the checkpoint, measures the held-out MLM loss of the stock model
("before"), retrofits it in place (hf_posenc.retrofit) and measures again ("patched"), trains --max_train_steps
steps and measures a last time ("after"). The stock scheme itself (learned for BERT) is the baseline. A checkpoint
without an MLM head first gets its head fitted on the frozen stock encoder (--head_steps), once, shared by every
scheme. Writes results.json and retrofit.png to --output_dir.

  hf-posenc retrofit                                 # the offline MiniLM, Emma ch. 1-4, learned rope alibi t5 ...
  hf-posenc retrofit --model_name_or_path roberta-base --schemes rope t5 --normalizers softmax l2 \\
      --train_file my_corpus.txt --max_train_steps 2000 --max_seq_length 256

With --drope it warm-starts a causal LM instead (DroPE, Sakana AI 2026): the position encoding of every layer (or
of --drope_layers) is dropped to none, optionally with QK-norm added (--qk_norm), the model recalibrated with the
next-token loss for --recalibration_fraction of its pretraining steps (a model `hf-posenc pretrain` wrote: its
training_args.json) or --max_train_steps, and the held-out loss measured at 1x-8x the training length (the extrapolate
measurement) before the drop, right after it and after recalibrating; beside it the same model trained as many
steps with its position encoding kept. Writes results.json and drope.md.

  hf-posenc pretrain --position_encoding rope --output_dir rope-lm
  hf-posenc retrofit --drope --model_name_or_path rope-lm --recalibration_fraction 0.05
  hf-posenc retrofit --drope --model_name_or_path Qwen/Qwen3-0.6B --qk_norm --max_seq_length 1024 \\
      --max_train_steps 200 --train_file my_corpus.txt
""",
    )
    parser.add_argument(
        "--drope",
        action="store_true",
        help="DroPE: drop a causal LM's position encoding to none, recalibrate, report the loss at 1x-8x",
    )
    parser.add_argument(
        "--drope_layers", nargs="+", type=int, default=None, help="with --drope: the layers dropped (default: all)"
    )
    parser.add_argument("--qk_norm", action="store_true", help="with --drope: add per-head QK-norm (use_qk_norm)")
    parser.add_argument(
        "--recalibration_fraction",
        type=float,
        default=None,
        help="with --drope: recalibrate for this fraction of the pretraining steps (training_args.json of a "
        "pretrain folder); None: --max_train_steps",
    )
    add_flags(parser, ("factors",))
    parser.add_argument(
        "--eval_tokens", type=int, default=None, help="with --drope: at most this many held-out tokens scored"
    )
    parser.add_argument(
        "--model_name_or_path", default=None, help="folder or Hub id (when None: the offline MiniLM, if installed)"
    )
    parser.add_argument("--tokenizer_name", default=None, help="when None: the checkpoint's tokenizer")
    parser.add_argument("--trust_remote_code", action="store_true", help="allow code from the checkpoint's folder")
    parser.add_argument(
        "--schemes",
        nargs="+",
        type=catalogue_name("position_encoding"),
        default=None,
        help="when None: learned (baseline) rope alibi t5 ...",
    )
    parser.add_argument(
        "--normalizers",
        nargs="+",
        type=catalogue_name("attention_normalizer"),
        default=["softmax"],
        help="attention normalizers",
    )
    parser.add_argument("--train_file", type=Path, default=None, help="plain text (when None: the embedded Emma)")
    parser.add_argument("--max_seq_length", type=int, default=64, help="tokens per block, [CLS] and [SEP] included")
    training = ("per_device_train_batch_size", "per_device_eval_batch_size", "max_train_steps", "learning_rate")
    add_flags(
        parser, training, per_device_train_batch_size=8, per_device_eval_batch_size=8, max_train_steps=50,
        learning_rate=3e-4,
    )  # fmt: skip
    add_flags(parser, ("seed",))
    parser.add_argument("--head_steps", type=int, default=60, help="steps fitting a missing MLM head (0: none)")
    parser.add_argument("--eval_blocks", type=int, default=32, help="held-out blocks every evaluation uses")
    parser.add_argument("--mlm_probability", type=float, default=0.15, help="the share of tokens masked")
    parser.add_argument(
        "--output_dir", type=output_folder, default="retrofit-output", help="the results, the plot, the models"
    )
    parser.add_argument(
        "--save_models",
        action="store_true",
        help="save each retrofitted model (save_pretrained, with its tokenizer and model card) in --output_dir",
    )
    add_threads_flag(parser)
    add_tracking_flags(parser)
    add_hub_flags(
        parser,
        "each retrofitted model (as --save_models saves it)",
        "the repositories' prefix: <prefix>-<scheme>-<normalizer>",
    )
    for old, dest, kind in (
        ("--model", "model_name_or_path", str), ("--seq-len", "max_seq_length", int),
        ("--steps", "max_train_steps", int),
        ("--head-steps", "head_steps", int), ("--lr", "learning_rate", float), ("--eval-blocks", "eval_blocks", int),
        ("--mlm-probability", "mlm_probability", float), ("--output-dir", "output_dir", output_folder),
        ("--train-file", "train_file", Path),
    ):  # fmt: skip
        hidden_alias(parser, old, dest, type=kind)
    hidden_alias(parser, "--save-models", "save_models", action="store_true")
    return parser
