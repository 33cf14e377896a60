"""The command line of ``hf-posenc compare`` (:mod:`hf_posenc_recipes.compare`), the main job. Standard library
only."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import (
    MODEL_FLAGS,
    MODEL_SIZE_DEFAULTS,
    SHARED_FLAGS,
    TRAINING_FLAGS,
    add_flags,
    add_hub_flags,
    add_layout_flags,
    add_reference_init_flags,
    add_threads_flag,
    add_tracking_flags,
    catalogue_name,
    new_parser,
    output_folder,
)
from .tasks import COPY_DEFAULTS, TASK_TRAINING_DEFAULTS, TASKS, add_task_flags, copy_block_size


DEFAULT_COMPARE_SCHEMES = ["learned", "sinusoidal", "none", "rope", "t5", "alibi"]
LM_DEFAULTS = {
    **{name: SHARED_FLAGS[name]["default"] for name in ("block_size", *TRAINING_FLAGS)},
    **MODEL_SIZE_DEFAULTS,
    "per_device_eval_batch_size": 16,
    "canon_layers": None,
    "canon_kernel_size": None,
}
"""compare's defaults of the pretrain recipe's flags it hands to each run, with ``--task lm``."""
TASK_DEFAULT_FLAGS = tuple(dict.fromkeys(flag for defaults in TASK_TRAINING_DEFAULTS.values() for flag in defaults))
"""The flags whose default depends on ``--task`` (:data:`~.tasks.TASK_TRAINING_DEFAULTS`): None in the parser,
filled by :func:`fill_task_defaults`."""
TASK_DEFAULT_HELPS = {
    "hidden_size": "the width of each model",
    "num_hidden_layers": "the layers of each model",
    "num_attention_heads": "the attention heads of each layer",
}


def task_default(task: str, flag: str) -> int | float | str | None:
    """compare's default of ``flag`` under ``--task task``: the task's own (:data:`~.tasks.TASK_TRAINING_DEFAULTS`),
    else ``--task lm``'s."""
    return TASK_TRAINING_DEFAULTS.get(task, {}).get(flag, LM_DEFAULTS[flag])


def task_default_note(flag: str) -> str:
    """What None means for a flag of :data:`TASK_DEFAULT_FLAGS`, in its help: every task's default."""
    values = {task: default_text(task_default(task, flag)) for task in TASKS}
    others = ", ".join(f"{task} {value}" for task, value in values.items() if task != "lm" and value != values["lm"])
    extra = {
        "canon_layers": "; none: off",
        "block_size": "; copy --copy_layout kazemnejad: 2 x --copy_max_length + 8, its longest row",
    }.get(flag, "")
    return f"when None: {values['lm']}; --task {others}{extra}"


def default_text(value: int | float | str | None) -> str:
    """A default as the help gives it: a number in its shortest form, a string as it is, None as off."""
    if value is None:
        return "off"
    return value if isinstance(value, str) else f"{value:g}"


def fill_task_defaults(args: argparse.Namespace) -> None:
    """Each flag of :data:`TASK_DEFAULT_FLAGS` not given (None) set to its default under ``args.task``;
    ``--canon_layers none`` turns off the canon layers a task's defaults have (and their kernel size, unless
    given); ``--task copy --copy_layout kazemnejad`` trains on its longest row (:func:`~.tasks.copy_block_size`)."""
    given = {flag for flag in TASK_DEFAULT_FLAGS if getattr(args, flag) is not None}
    for flag in TASK_DEFAULT_FLAGS:
        if flag not in given:
            setattr(args, flag, task_default(args.task, flag))
    if args.task == "copy" and args.copy_layout == "kazemnejad" and "block_size" not in given:
        args.block_size = copy_block_size(args.copy_max_length or COPY_DEFAULTS["copy_max_length"])
    if args.canon_layers == "none":
        args.canon_layers = None
        if "canon_kernel_size" not in given:
            args.canon_kernel_size = None


def compare_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "compare",
        """
Pretrain one small model per position encoding x attention normalizer on an equal budget (the pretrain recipe,
the same data, seed, batches, steps and optimiser for every scheme), then report for each: loss at the training
length, at 2x, 4x, 8x that length (sliding windows), the position probe's relative fit error, parameters and
tokens/s. Writes compare.md, compare.json and compare.png to --output_dir and the models under models/.

  hf-posenc compare                # decoders, 6 schemes, softmax, one thread: 11-19 min on 2 CPU cores at load 2-4
  hf-posenc compare --schemes rope alibi --max_train_steps 200 --num_warmup_steps 20 --eval_steps 200 \\
      --probe_steps 100 --max_eval_tokens 4096 --output_dir out/compare-quick    # a quick look: 4 min on 2 busy cores
  hf-posenc compare --schemes rope alibi --normalizers softmax l2 --encoders --max_train_steps 2000
  hf-posenc compare --schemes rope none --layouts smollm3 rnope_swa --sliding_window 32 --num_hidden_layers 4 \\
      --seeds 0 1 2
  hf-posenc compare --schemes rope --layouts irope --attention_chunk_size 32 --num_hidden_layers 4

With --task mqar, copy or passkey each model trains on that task instead (examples drawn from the seed, the loss on
the answers) and the report gives its accuracy at each length (passkey's also by depth of the needle):
  hf-posenc compare --task mqar --output_dir out/mqar        # the 6 default schemes, accuracy at 1x, 2x, 4x, 8x
  hf-posenc compare --task passkey --schemes rope pope fox alibi t5 none --seeds 0 1 2 --output_dir out/passkey
  hf-posenc compare --task copy --copy_layout kazemnejad --output_dir out/copy   # Kazemnejad et al.'s copy, L = 20
""",
    )
    parser.add_argument(
        "--output_dir", type=output_folder, default="compare-output", help="the report, the plot, the models (models/)"
    )
    parser.add_argument(
        "--schemes",
        nargs="+",
        type=catalogue_name("position_encoding", also=("all",), options=True),
        default=None,
        help="position encodings (a name, or name:key=value,... as path:forget_gate=true), or all (when None: "
        f"{' '.join(DEFAULT_COMPARE_SCHEMES)}, or none beside --layouts)",
    )
    parser.add_argument(
        "--normalizers",
        nargs="+",
        type=catalogue_name("attention_normalizer", also=("all",), options=True),
        default=["softmax"],
        help="attention normalizers (a name, or name:key=value,... as softmax:output_gate=elementwise), or all",
    )
    add_layout_flags(parser, "each a run beside the schemes")
    parser.add_argument("--encoders", action="store_true", help="also pretrain masked-LM encoders (posenc_bert)")
    parser.add_argument("--dataset_name", default=None, help="a dataset on the Hub (datasets.load_dataset)")
    parser.add_argument("--dataset_config_name", default=None, help="the configuration of --dataset_name")
    parser.add_argument("--text_column_name", default="text", help="--dataset_name: the column holding the text")
    parser.add_argument("--train_file", type=Path, default=None, help="plain text (when None: the embedded corpus)")
    parser.add_argument("--tokenizer_name", default=None, help="when None: bytes")
    training = parser.add_argument_group("each model and its training (the pretrain recipe's flags)")
    shared = ("block_size", *MODEL_FLAGS, *TRAINING_FLAGS)
    notes = {flag: task_default_note(flag) for flag in TASK_DEFAULT_FLAGS}
    add_flags(
        training, shared, notes, TASK_DEFAULT_HELPS, **{**LM_DEFAULTS, **dict.fromkeys(TASK_DEFAULT_FLAGS, None)}
    )
    add_reference_init_flags(parser, training)
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="train every model once per seed (models/<run>/seed_<s>); the table gives mean ± standard deviation",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs whose folder already holds their result (compare_row.json) from the same recipe: an "
        "interrupted compare, or seeds run by separate processes into one --output_dir",
    )
    add_flags(parser, ("factors", "max_eval_tokens"))
    parser.add_argument("--probe_steps", type=int, default=400, help="training steps of the position probe")
    add_threads_flag(parser)
    add_task_flags(parser, "train each model on the task", training=True)
    add_tracking_flags(parser)
    add_hub_flags(
        parser, "each pretrained model (models/)", "the repositories' prefix: <prefix>-<task>-<scheme>-<normalizer>"
    )
    return parser
