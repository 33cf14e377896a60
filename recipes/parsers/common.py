"""What the recipes' command lines share: the flag types (scheme specs, catalogue names, counts, folders), the groups
of flags several recipes take (layouts, tracking, the Hub), and the parser they are built on.

Only the standard library is imported here and in the recipes' parsers beside it, so ``hf-posenc <recipe> --help``
answers without loading torch or transformers (``hf_posenc`` itself registers its models with Transformers on
import). Scheme and normalizer names, their options and the options' types are checked while parsing, against
:mod:`hf_posenc_recipes.catalogue`, as is an ``--output_dir`` under a file; each recipe module parses with its
parser and checks the rest (files, ranges).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf_posenc_recipes import catalogue
from hf_posenc_recipes.registry import RECIPES


DEFAULT_FACTORS = (1, 2, 4, 8)
SCHEDULER_TYPES = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"]
MODEL_SIZE_DEFAULTS = {"hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4}

MULTI_PROCESS_NOTE = """
Several processes: `accelerate launch --multi_gpu --num_processes 2 ...` on GPUs and on CPUs (on a machine without
CUDA the recipe joins the processes into one multi-CPU run over gloo), or `torchrun --standalone --nproc_per_node 2
...`. (`accelerate launch --cpu --num_processes 2` starts one process: with --cpu, accelerate's launcher starts
several only through MPI, --mpirun_hostfile.)"""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after every flag (every flag has a help string: argparse shows no default without one); the
    description printed as written."""


class RecipeParser(argparse.ArgumentParser):
    """A recipe's parser: a bad flag is reported in one line, ``hf-posenc <recipe>: error: <message>`` (exit 2),
    without argparse's usage block (``--help`` prints it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def scheme_spec(kind: str) -> Callable[[str], str | dict[str, Any] | list[str | dict[str, Any]]]:
    """The flag type of a ``kind`` value (``"position_encoding"``, ``"attention_normalizer"``): a name, or a JSON dict
    ``{"type": name, **options}``, checked against the catalogue (names, options, types) while parsing; a
    ``position_encoding`` may also be a JSON list of them, one per attention layer (the config checks its length)."""
    per_layer = kind == "position_encoding"

    def parse(text: str) -> str | dict[str, Any] | list[str | dict[str, Any]]:
        value = text
        if text.lstrip().startswith("{") or per_layer and text.lstrip().startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as error:
                raise argparse.ArgumentTypeError(
                    f"{text!r} is not valid JSON ({error.msg}, character {error.pos}); give a name or a JSON dict "
                    f'such as \'{{"type": "{catalogue.names(kind)[0]}"}}\''
                    + (" (or a JSON list of them, one per layer)" if per_layer else "")
                ) from None
        for spec in value if isinstance(value, list) else [value]:
            checked(catalogue.check_spec, kind, spec)
        return value

    parse.__name__ = kind
    return parse


def catalogue_name(kind: str, also: tuple[str, ...] = (), options: bool = False) -> Callable[[str], str]:
    """The flag type of one name of ``kind`` (or of ``also``, such as ``all``), checked against the catalogue; with
    ``options``, also ``name:key=value,...`` (:func:`parse_scheme`), its options checked too."""

    def parse(text: str) -> str:
        if options and ":" in text:
            checked(catalogue.check_spec, kind, parse_scheme(text))
        elif text not in also and text not in catalogue.names(kind):
            valid = ", ".join(catalogue.names(kind)) + "".join(f" or {name}" for name in also)
            raise argparse.ArgumentTypeError(f"unknown {kind} {text!r}; valid: {valid}")
        return text

    parse.__name__ = kind
    return parse


def checked(check: Callable[..., None], *args: Any) -> None:
    """``check(*args)``, its ``ValueError`` turned into the parser's error."""
    try:
        check(*args)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).rstrip(".")) from None


def output_folder(text: str) -> Path:
    """An ``--output_dir``: a folder, or a path where one can be made (nothing on the way is a file)."""
    path = Path(text)
    for place in (path, *path.parents):
        if place.exists():
            if not place.is_dir():
                where = "" if place == path else f": {place}"
                raise argparse.ArgumentTypeError(f"{text}{where} is a file, not a folder")
            return path
    return path


def parse_scheme(text: str) -> dict:
    """``name`` or ``name:key=value,key=value`` (values: true/false, numbers, or strings) -> a config dict."""
    name, _, options = text.partition(":")
    spec: dict = {"type": name}
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        spec[key] = {"true": True, "false": False}.get(value.lower(), _number_or_string(value))
    return spec


def _number_or_string(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def parse_variant(text: str) -> tuple[dict, bool]:
    """``normalizer[+gate][+sink][+output_gate][+boundary]`` -> (the normalizer's config dict, boundary tokens);
    ``+gate``: the Toeplitz gate; ``+sink``: softmax's learned sink; ``+output_gate``: gated attention, elementwise."""
    name, *flags = text.split("+")
    unknown = set(flags) - {"gate", "sink", "output_gate", "boundary"}
    if unknown:
        raise ValueError(
            f"variant {text!r}: unknown flag(s) {sorted(unknown)}; valid: '+gate', '+sink', '+output_gate', "
            "'+boundary'."
        )
    if "sink" in flags and name != "softmax":
        raise ValueError(f"variant {text!r}: '+sink' is an option of softmax only.")
    spec = {"type": name, "toeplitz_gate": "gate" in flags}
    if "sink" in flags:
        spec["sink"] = "learned"
    if "output_gate" in flags:
        spec["output_gate"] = "elementwise"
    return spec, "boundary" in flags


def int_at_least(minimum: int) -> Callable[[str], int]:
    """The flag type of an integer of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)  # a count of at least 1
non_negative_int = int_at_least(0)  # a count that may be 0


def string_to_bool(text: str) -> bool:
    """A boolean flag's value, as Transformers' ``HfArgumentParser`` reads it: true/false, yes/no, 1/0."""
    if text.lower() in ("true", "yes", "y", "1"):
        return True
    if text.lower() in ("false", "no", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


LAYOUT_SIZES = {
    "sliding_attention": ("--sliding_window", "slide", "the window of a sliding layout"),
    "chunked_attention": (
        "--attention_chunk_size",
        "have chunked attention",
        "the chunk of a chunked-attention layout",
    ),
}
"""The size flag of each local attention a layout preset may have (the catalogue's ``local_attention``, a
:class:`hf_posenc.configuration_posenc.LayoutPreset` field): ``(flag, what the layouts do, what the size is)``."""


def layout_sizes(name: str, sliding_window: int | None, attention_chunk_size: int | None) -> tuple:
    """The ``(sliding_window, attention_chunk_size)`` of layout ``name`` (``hf_posenc.layout_preset``'s arguments):
    the size of the layout's local attention, None for the other."""
    local = catalogue.load_catalogue()["layout"][name]["local_attention"]
    return (
        sliding_window if local == "sliding_attention" else None,
        attention_chunk_size if local == "chunked_attention" else None,
    )


def check_layout_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--sliding_window`` / ``--attention_chunk_size`` given exactly when a layout of ``--layouts`` needs it (its
    ``local_attention`` in the catalogue); a parser error otherwise."""
    entries = catalogue.load_catalogue()["layout"]
    for local, (option, verb, meaning) in LAYOUT_SIZES.items():
        using = [name for name in args.layouts if entries[name]["local_attention"] == local]
        given = getattr(args, option[2:])
        if using and given is None:
            parser.error(f"--layouts {' '.join(using)} {verb}: give {option}")
        if given is not None and not using:
            owners = ", ".join(name for name, entry in entries.items() if entry["local_attention"] == local)
            parser.error(f"{option} is {meaning} ({owners}); no --layouts {verb}")


def new_parser(recipe: str, description: str) -> argparse.ArgumentParser:
    return RecipeParser(
        prog=f"hf-posenc {recipe}",
        description=f"{RECIPES[recipe].description}.\n\n{description.strip()}\n{MULTI_PROCESS_NOTE}",
        formatter_class=HelpFormatter,
    )


def hidden_alias(parser: argparse.ArgumentParser, flag: str, dest: str, **kwargs) -> None:
    """An old spelling of a flag, still accepted, not listed in ``--help``."""
    parser.add_argument(flag, dest=dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)


THREADS_HELP = (
    "torch's threads per process (torch.set_num_threads; 0: torch's default, one per core). The recipes' models are "
    "small: on a 2-core CPU shared with other jobs one thread trained 2.6-4.5x faster than two, and a rerun with the "
    "same --threads gives the same numbers (another thread count moves them as another seed would). Give 0, or the "
    "cores of a machine of your own, for large models"
)


def add_threads_flag(group) -> None:
    """``--threads``, which every recipe takes (default 1, :data:`THREADS_HELP` says why)."""
    group.add_argument("--threads", type=non_negative_int, default=1, help=THREADS_HELP)


def add_tracking_flags(group) -> None:
    group.add_argument(
        "--with_tracking", action="store_true", help="log metrics through accelerate's trackers (see --report_to)"
    )
    group.add_argument(
        "--report_to",
        default="all",
        help='with --with_tracking: "all" (every installed tracker), or one of "tensorboard", "wandb", "trackio", '
        '"comet_ml", "clearml", "mlflow", "aim", "dvclive", "swanlab"',
    )


def add_hub_flags(group, what: str, repository: str = "the repository") -> None:
    group.add_argument("--push_to_hub", action="store_true", help=f"upload {what} and its model card to the Hub")
    group.add_argument("--hub_model_id", default=None, help=f"{repository} (when None: the name of --output_dir)")
    group.add_argument("--hub_token", default=None, help="when None: the token of `hf auth login`")


def add_layout_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """``--layouts`` (presets of ``hf_posenc.LAYOUT_PRESETS``, their ``role`` in the recipe) and the sizes they take,
    ``--sliding_window`` and ``--attention_chunk_size`` (checked by :func:`check_layout_sizes`)."""
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=catalogue.names("layout"),
        default=[],
        help=f"2025-26 layouts (hf_posenc.LAYOUT_PRESETS), {role}",
    )
    parser.add_argument(
        "--sliding_window", type=positive_int, default=None, help="the window of the --layouts that slide (rnope_swa)"
    )
    parser.add_argument(
        "--attention_chunk_size",
        type=positive_int,
        default=None,
        help="the chunk of the --layouts with chunked attention (irope), in tokens",
    )


SHARED_FLAGS: dict[str, dict[str, Any]] = {
    "block_size": {"type": int, "default": 64, "help": "training length: tokens per block"},
    **{
        name: {"type": int, "default": None, "help": f"when None: {default}, or the config's"}
        for name, default in MODEL_SIZE_DEFAULTS.items()
    },
    "intermediate_size": {"type": int, "default": None, "help": "the MLP's width (when None: 4 * hidden_size)"},
    "dropout": {"type": float, "default": None, "help": "every dropout probability (when None: 0)"},
    "initializer_range": {"type": float, "default": None, "help": "std of the weights (when None: 0.02)"},
    "canon_layers": {
        "type": str,
        "default": None,
        "help": "canon layers (Allen-Zhu, arXiv 2512.17351): causal depthwise convolutions at the paper's "
        "insertion points, a string of A (attention input), B (q, k, v), C (MLP input), D (inside the MLP), e.g. "
        "ABCD; None: off",
    },
    "canon_kernel_size": {
        "type": int,
        "default": None,
        "help": "the canon layers' kernel size (when None: 4; needs --canon_layers)",
    },
    "layer_types": {
        "nargs": "+",
        "choices": ["full_attention", "sliding_attention", "chunked_attention", "linear_attention"],
        "default": None,
        "help": "one per layer, as Transformers' config.layer_types: full_attention, sliding_attention (with "
        "--sliding_window), chunked_attention (with --attention_chunk_size) or linear_attention (a gated-DeltaNet "
        "layer of a hybrid decoder; the scheme acts on the attention layers); when None: full attention everywhere",
    },
    "attn_implementation": {
        "choices": ["eager", "sdpa", "flex_attention"],
        "default": None,
        "help": "the attention backend (when None: Transformers' choice for the scheme)",
    },
    "per_device_train_batch_size": {"type": int, "default": 32, "help": "blocks per process and step"},
    "per_device_eval_batch_size": {"type": int, "default": 64, "help": "blocks per process, evaluating"},
    "learning_rate": {"type": float, "default": 2e-3, "help": "AdamW's peak learning rate"},
    "weight_decay": {"type": float, "default": 0.1, "help": "AdamW's, on matrices only (not embeddings, norms)"},
    "adam_beta1": {"type": float, "default": 0.9, "help": "AdamW's beta1"},
    "adam_beta2": {"type": float, "default": 0.99, "help": "AdamW's beta2"},
    "max_grad_norm": {"type": float, "default": 1.0, "help": "gradient clipping (0: none)"},
    "lr_scheduler_type": {"default": "cosine", "choices": SCHEDULER_TYPES, "help": "the schedule after warm-up"},
    "num_warmup_steps": {"type": int, "default": 60, "help": "optimizer steps of linear warm-up"},
    "max_train_steps": {"type": int, "default": 600, "help": "optimizer steps (pretrain: 0 runs --num_train_epochs)"},
    "eval_steps": {"type": int, "default": 200, "help": "evaluate every N steps (and at the end)"},
    "seed": {"type": int, "default": 0, "help": "initialisation, batch order, masks, dropout"},
    "randomized_positions": {
        "type": int,
        "default": None,
        "help": "randomized positions (Ruoss et al. 2023) up to N: each batch's position ids are a sorted draw of "
        "distinct positions of [0, N), in training and evaluation, instead of 0..n-1 (N >= --block_size; a learned "
        "table gets N rows); None: 0..n-1",
    },
    "factors": {
        "type": int,
        "nargs": "+",
        "default": list(DEFAULT_FACTORS),
        "help": "evaluation lengths / training length",
    },
    "max_eval_tokens": {"type": int, "default": 16384, "help": "held-out tokens for extrapolation"},
}
"""The flags several recipes take, each defined once (type, default, help): :func:`add_flags` adds them to a
parser."""

MODEL_FLAGS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "dropout")
MODEL_FLAGS += ("initializer_range", "canon_layers", "canon_kernel_size", "layer_types", "attn_implementation")
TRAINING_FLAGS = ("per_device_train_batch_size", "per_device_eval_batch_size", "learning_rate", "weight_decay")
TRAINING_FLAGS += ("adam_beta1", "adam_beta2", "max_grad_norm", "lr_scheduler_type", "num_warmup_steps")
TRAINING_FLAGS += ("max_train_steps", "eval_steps", "seed", "randomized_positions")
"""The pretraining recipe's model and training flags (with ``--block_size`` and ``--reference_init``): what
``compare`` takes and hands to every pretraining run it starts."""


def add_flags(
    group, names: tuple[str, ...], notes: dict[str, str] | None = None, helps: dict[str, str] | None = None,
    **defaults: Any,
) -> None:  # fmt: skip
    """The flags ``names`` of :data:`SHARED_FLAGS`, with the recipe's own ``defaults`` where it differs, its
    ``notes`` appended to a flag's help (what a default of None means there) and its ``helps`` in place of one."""
    for name in names:
        kwargs = dict(SHARED_FLAGS[name])
        kwargs["default"] = defaults.get(name, kwargs["default"])
        if helps and name in helps:
            kwargs["help"] = helps[name]
        if notes and name in notes:
            kwargs["help"] = f"{kwargs['help']} ({notes[name]})"
        group.add_argument(f"--{name}", **kwargs)


def add_reference_init_flags(parser: argparse.ArgumentParser, group) -> None:
    """``--reference_init [true|false]`` and ``--no_reference_init`` (and its old spelling)."""
    group.add_argument(
        "--reference_init",
        type=string_to_bool,
        nargs="?",
        const=True,
        default=True,
        help="initialise each scheme's parameters as its reference does "
        "(hf_posenc_recipes.pretrain.reference_init); --reference_init false or --no_reference_init: as "
        "GPT-2 / BERT do",
    )
    group.add_argument(
        "--no_reference_init",
        action="store_false",
        dest="reference_init",
        default=argparse.SUPPRESS,
        help="the same as --reference_init false",
    )
    hidden_alias(parser, "--no-reference_init", "reference_init", action="store_false")
