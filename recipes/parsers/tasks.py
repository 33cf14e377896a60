"""The flags of the long-context tasks (``--task`` and the tasks' settings) that ``compare`` and ``extrapolate``
share, and their range checks. Standard library only."""

from __future__ import annotations

import argparse

from .common import positive_int


TASKS = ("lm", "mqar", "copy", "passkey")
MQAR_LAYOUTS = ("zoology", "visible_answers")
COPY_LAYOUTS = ("fixed", "kazemnejad")
COPY_PROMPT = b"Copy: "
COPY_KAZEMNEJAD_FIXED_TOKENS = len(COPY_PROMPT) + 2
"""The tokens of a ``kazemnejad`` copy row besides the string and its copy: the prompt ``Copy: ``, the separator
and the end-of-sequence token."""
COPY_MAX_SYMBOLS = 221
"""The symbols a ``kazemnejad`` copy string can be drawn from (:data:`hf_posenc_recipes.tasks.COPY_SYMBOLS`): the 93
printable non-space bytes other than the separator ``|``, then the 128 bytes above ASCII."""
COPY_DEFAULTS = {"copy_max_length": 20, "copy_symbols": 100}
"""``--copy_layout kazemnejad``'s defaults: the paper's training lengths 1..20 and its 100 tokens."""
TASK_TRAINING_DEFAULTS: dict[str, dict[str, int | float | str]] = {
    "mqar": {
        "block_size": 32, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "per_device_train_batch_size": 64, "learning_rate": 3e-3, "num_warmup_steps": 100, "max_train_steps": 3000,
        "eval_steps": 100, "canon_layers": "B", "canon_kernel_size": 3,
    },
    "passkey": {
        "block_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "per_device_train_batch_size": 32, "learning_rate": 3e-3, "num_warmup_steps": 100, "max_train_steps": 2000,
        "eval_steps": 100, "canon_layers": "B", "canon_kernel_size": 3,
    },
}  # fmt: skip
"""``compare``'s model and training defaults of each ``--task`` where they differ from ``--task lm``'s (the pretrain
recipe's), each applied only when its flag is not given (docs/benchmarks.md, "Long context"). mqar and passkey train
Zoology's attention baseline: 2 layers of width 64, 2 heads, and a causal depthwise convolution of kernel 3 on q, k
and v (canon layer B; ``--canon_layers none`` removes it). Without the convolution, `rope` and no positions stayed on
mqar's plateau (answering any value of the example) for the whole 3,000-step budget; with it every default scheme
reached 0.99 within 400 steps, and `rope` retrieved passkeys at 128 tokens. Passkey trains at 128 tokens: its
needle, question and 5-digit key take 46 bytes, so its filler is 82 of them (64 %), 210 of 256 at 2x."""
TASK_BLOCK_SIZES = {task: int(TASK_TRAINING_DEFAULTS.get(task, {}).get("block_size", 64)) for task in TASKS}
"""``compare``'s training length of each ``--task`` when ``--block_size`` is not given."""
PASSKEY_NEEDLE_BYTES = len(" The pass key is . ")
PASSKEY_QUESTION_BYTES = len(" The pass key is ")


def copy_block_size(max_length: int) -> int:
    """The training block of ``--copy_layout kazemnejad`` at ``--copy_max_length`` L: its longest row, ``Copy: ``
    (6 bytes), L symbols, the separator, L symbols, the end token: ``2 L + 8``."""
    return 2 * max_length + COPY_KAZEMNEJAD_FIXED_TOKENS


def unit_interval(text: str) -> float:
    """The flag type of a number in [0, 1] (a depth)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def positive_float(text: str) -> float:
    """The flag type of a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


DEFAULT_LR_SWEEP = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
"""``--lr_sweep``'s rates when none is given: Zoology's range, 1e-4 to 1e-2."""


def add_task_flags(parser: argparse.ArgumentParser, what: str, training: bool = False) -> None:
    """``--task`` (``what`` it does with a task) and the settings of the tasks; with ``training``, how a task model
    trains (``--stop_accuracy``, ``--lr_sweep``)."""
    group = parser.add_argument_group("long-context tasks (--task mqar, copy, passkey)")
    group.add_argument(
        "--task",
        choices=TASKS,
        default="lm",
        help=f"lm: language modelling, the loss on held-out text; mqar, copy, passkey: {what}, the accuracy at each "
        "length (hf_posenc_recipes.tasks)",
    )
    group.add_argument(
        "--mqar_pairs", type=positive_int, default=4, help="mqar: key-value pairs per example (Zoology's num_kv_pairs)"
    )
    group.add_argument("--mqar_queries", type=positive_int, default=4, help="mqar: keys asked per example (<= pairs)")
    group.add_argument(
        "--mqar_layout",
        choices=MQAR_LAYOUTS,
        default="zoology",
        help="mqar: zoology (Zoology's multiquery_ar: the answers are labels only, queries placed by a power law, "
        "filler drawn from the keys and values); visible_answers (each query followed by its value in the input, "
        "so later queries see earlier answers; queries placed uniformly; filler from the other bytes)",
    )
    group.add_argument(
        "--mqar_power_a",
        type=positive_float,
        default=0.01,
        help="mqar, zoology layout: the query gaps' power law P(g) ∝ (g + 1) ** (a - 1) (Zoology's power_a; 1: "
        "uniform)",
    )
    group.add_argument("--mqar_key_vocab", type=positive_int, default=32, help="mqar: the bytes keys are drawn from")
    group.add_argument(
        "--mqar_value_vocab", type=positive_int, default=32, help="mqar: the bytes values are drawn from (after keys)"
    )
    group.add_argument(
        "--copy_layout",
        choices=COPY_LAYOUTS,
        default="fixed",
        help="copy: fixed (a string of (block - 1) // 2 letters a-z, the separator |, the string again; scored per "
        "letter); kazemnejad (Kazemnejad et al. 2023's copy task: 'Copy: ', a string of n symbols, the separator |, "
        "the string again, the end-of-sequence token, right-padded; n in 1..--copy_max_length at 1x and in "
        "((f/2) L, f L] at factor f, so 2x is the paper's test set; scored per example, every copied symbol and the "
        "end right)",
    )
    group.add_argument(
        "--copy_max_length",
        type=positive_int,
        default=None,
        help=f"copy, kazemnejad layout: L, the longest training string (when None: "
        f"{COPY_DEFAULTS['copy_max_length']}, the paper's); compare's --block_size, when not given, is the longest "
        "row, 2 L + 8",
    )
    group.add_argument(
        "--copy_symbols",
        type=positive_int,
        default=None,
        help=f"copy, kazemnejad layout: the distinct symbols a string is drawn from (when None: "
        f"{COPY_DEFAULTS['copy_symbols']}, the paper's; at most {COPY_MAX_SYMBOLS}: a-z, A-Z, 0-9, the printable "
        "punctuation but |, then the bytes above ASCII)",
    )
    group.add_argument(
        "--copy_repeat",
        action="store_true",
        help="copy, kazemnejad layout: the paper's rsc variant, one symbol repeated n times (the model must count); "
        "without it cmc, each symbol drawn uniformly",
    )
    group.add_argument("--passkey_digits", type=positive_int, default=5, help="passkey: digits of the key")
    group.add_argument(
        "--passkey_depths",
        type=unit_interval,
        nargs="+",
        default=[0.0, 0.25, 0.5, 0.75, 1.0],
        help="passkey: where the needle is scored, as a fraction of the filler before it (0: first, 1: last)",
    )
    group.add_argument(
        "--task_eval_examples",
        type=positive_int,
        default=128,
        help="examples scored at each length (passkey: at each length and depth), the same for every model; copy's "
        "kazemnejad layout spreads them evenly over the string lengths (a multiple of L weighs each length equally)",
    )
    if not training:
        return
    group.add_argument(
        "--stop_accuracy",
        type=unit_interval,
        default=0.99,
        help="stop training a task model at the first evaluation (every --eval_steps) whose accuracy at the training "
        "length reaches this (Zoology's 0.99); --max_train_steps is the cap: a run ending there is unfinished",
    )
    group.add_argument(
        "--lr_sweep",
        type=positive_float,
        nargs="*",
        default=None,
        help="before each task model, a run of --lr_sweep_steps at each of these learning rates (none given: "
        f"{' '.join(f'{rate:g}' for rate in DEFAULT_LR_SWEEP)}, Zoology's range); the model trains at the rate with "
        "the best accuracy, reported beside it",
    )
    group.add_argument(
        "--lr_sweep_steps", type=positive_int, default=300, help="--lr_sweep: the steps of each trial (at most)"
    )


def check_task_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, length: int | None) -> None:
    """The task's settings against each other and, when the training ``length`` is known, against it in bytes (the
    tokens of ``compare``'s models): a parser error naming the flag."""
    if args.task == "mqar":
        try:
            check_mqar(
                length, args.mqar_pairs, args.mqar_queries, args.mqar_key_vocab, args.mqar_value_vocab,
                args.mqar_layout, args.mqar_power_a,
            )  # fmt: skip
        except ValueError as error:
            parser.error(str(error))
    check_copy_flags(parser, args, length)
    if args.task == "passkey" and length is not None:
        needed = PASSKEY_NEEDLE_BYTES + PASSKEY_QUESTION_BYTES + 2 * args.passkey_digits
        if needed > length:
            parser.error(
                f"--task passkey: the needle, the question and a key of --passkey_digits {args.passkey_digits} take "
                f"{needed} bytes, more than --block_size {length}"
            )


def check_copy_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, length: int | None) -> None:
    """The copy flags against ``--task``, ``--copy_layout`` and the training ``length`` (when known); the
    kazemnejad layout's flags not given set to their defaults (:data:`COPY_DEFAULTS`)."""
    kazemnejad_only = [
        f"--{flag}" for flag in ("copy_max_length", "copy_symbols") if getattr(args, flag) is not None
    ] + (["--copy_repeat"] if args.copy_repeat else [])
    if args.task != "copy":
        given = kazemnejad_only + (["--copy_layout kazemnejad"] if args.copy_layout == "kazemnejad" else [])
        if given:
            parser.error(f"{', '.join(given)}: settings of --task copy, not of --task {args.task}")
        return
    if args.copy_layout == "fixed":
        if kazemnejad_only:
            parser.error(
                f"{', '.join(kazemnejad_only)}: settings of --copy_layout kazemnejad; --copy_layout fixed copies "
                "(block - 1) // 2 letters a-z (give --copy_layout kazemnejad)"
            )
        if length is not None and length < 3:
            parser.error(f"--task copy needs --block_size >= 3 (a letter, the separator, its copy), got {length}")
        return
    for flag, default in COPY_DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, default)
    if args.copy_symbols > COPY_MAX_SYMBOLS:
        parser.error(f"--copy_symbols must be in 1..{COPY_MAX_SYMBOLS}, got {args.copy_symbols}")
    block = copy_block_size(args.copy_max_length)
    if length is not None and length != block:
        parser.error(
            f"--copy_layout kazemnejad at --copy_max_length {args.copy_max_length} trains on rows of 2 x "
            f"{args.copy_max_length} + {COPY_KAZEMNEJAD_FIXED_TOKENS} = {block} tokens (the longest), got "
            f"--block_size {length}: leave --block_size out (it is derived) or change --copy_max_length"
        )


def check_mqar(
    length: int | None, num_pairs: int, num_queries: int, key_vocab: int, value_vocab: int, layout: str,
    power_a: float,
) -> None:  # fmt: skip
    """A ``ValueError`` naming the flag when ``mqar``'s settings cannot make an example of ``length`` tokens (any
    length when None)."""
    if layout not in MQAR_LAYOUTS:
        raise ValueError(f"--mqar_layout must be one of {', '.join(MQAR_LAYOUTS)}, got {layout!r}")
    if power_a <= 0:
        raise ValueError(f"--mqar_power_a must be > 0 (1: uniform), got {power_a}")
    spare = 0 if layout == "zoology" else 1  # visible_answers fills with the bytes above the keys and values
    if key_vocab < 1 or value_vocab < 1 or key_vocab + value_vocab > 256 - spare:
        raise ValueError(
            f"--mqar_key_vocab {key_vocab} and --mqar_value_vocab {value_vocab} must be >= 1 and together at most "
            f"{256 - spare} bytes" + (" (the layout visible_answers fills with the bytes above them)" if spare else "")
        )
    if not 1 <= num_pairs <= min(key_vocab, value_vocab):
        raise ValueError(
            f"--mqar_pairs must be in 1..{min(key_vocab, value_vocab)} (distinct keys of --mqar_key_vocab, values of "
            f"--mqar_value_vocab), got {num_pairs}"
        )
    if not 1 <= num_queries <= num_pairs:
        raise ValueError(f"--mqar_queries must be in 1..{num_pairs} (--mqar_pairs), got {num_queries}")
    if length is not None and 2 * num_pairs + 2 * num_queries > length:
        raise ValueError(
            f"--mqar_pairs {num_pairs} and --mqar_queries {num_queries} take {2 * num_pairs + 2 * num_queries} "
            f"tokens, more than the length {length}"
        )
