"""The command lines of every recipe, with Transformers' example-script flags and spelling.

Only the standard library is imported here, so ``hf-posenc <recipe> --help`` answers without loading torch or
transformers (``hf_posenc`` itself registers its models with Transformers on import). Scheme and normalizer names,
their options and the options' types are checked while parsing, against :mod:`hf_posenc_cli.catalogue`, as is an
``--output_dir`` under a file; each recipe module parses with these parsers and checks the rest (files, ranges).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import catalogue


MODEL_SIZE_DEFAULTS = {"hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4}
DEFAULT_FACTORS = (1, 2, 4, 8)
DEFAULT_COMPARE_SCHEMES = ["learned", "sinusoidal", "none", "rope", "t5", "alibi"]
DEFAULT_PROBE_VARIANTS = ["softmax", "l2", "exp", "relu2", "swish_l2", "softmax+gate", "softmax+boundary"]
GLUE_TASK_NAMES = ["cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb", "wnli"]
SCHEDULER_TYPES = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"]

DESCRIPTIONS = {
    "pretrain": "pretrain one model (causal or masked LM) with accelerate",
    "compare": "pretrain one model per scheme on an equal budget and compare them (the main job)",
    "extrapolate": "loss of saved models at 1x, 2x, 4x, 8x their training length",
    "glue": "fine-tune and evaluate a checkpoint on a GLUE task",
    "probe": "the position probe (n identical tokens -> positions 1..n) over a grid of schemes",
    "retrofit": "warm-start new schemes on a pretrained checkpoint: retrofit, then continue MLM training",
}

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


def probe_scheme(text: str) -> str:
    """The flag type of a probe's scheme (:func:`parse_scheme`), checked against the catalogue."""
    checked(catalogue.check_spec, "position_encoding", parse_scheme(text))
    return text


def probe_variant(text: str) -> str:
    """The flag type of a probe's variant (:func:`parse_variant`), checked against the catalogue."""
    checked(lambda: catalogue.check_spec("attention_normalizer", parse_variant(text)[0]))
    return text


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


LAYOUT_SIZES = (
    ("sliding", "--sliding_window", "slide", "the window of a sliding layout"),
    ("chunked", "--attention_chunk_size", "have chunked attention", "the chunk of a chunked-attention layout"),
)
"""The catalogue's layout flags and the size each needs: ``(flag, option, what the layouts do, what the size is)``."""


def layout_sizes(name: str, sliding_window: int | None, attention_chunk_size: int | None) -> tuple:
    """The ``(sliding_window, attention_chunk_size)`` of layout ``name`` (``hf_posenc.layout_preset``'s arguments):
    each size where the catalogue says the layout uses it, else None."""
    entry = catalogue.load_catalogue()["layout"][name]
    return sliding_window if entry["sliding"] else None, attention_chunk_size if entry["chunked"] else None


def check_layout_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--sliding_window`` / ``--attention_chunk_size`` given exactly when a layout of ``--layouts`` needs it (the
    catalogue's ``sliding`` / ``chunked`` flags); a parser error otherwise."""
    entries = catalogue.load_catalogue()["layout"]
    for key, option, verb, meaning in LAYOUT_SIZES:
        using = [name for name in args.layouts if entries[name][key]]
        given = getattr(args, option[2:])
        if using and given is None:
            parser.error(f"--layouts {' '.join(using)} {verb}: give {option}")
        if given is not None and not using:
            owners = ", ".join(name for name, entry in entries.items() if entry[key])
            parser.error(f"{option} is {meaning} ({owners}); no --layouts {verb}")


def new_parser(recipe: str, description: str) -> argparse.ArgumentParser:
    return RecipeParser(
        prog=f"hf-posenc {recipe}",
        description=f"{DESCRIPTIONS[recipe]}.\n\n{description.strip()}\n{MULTI_PROCESS_NOTE}",
        formatter_class=HelpFormatter,
    )


def hidden_alias(parser: argparse.ArgumentParser, flag: str, dest: str, **kwargs) -> None:
    """An old spelling of a flag, still accepted, not listed in ``--help``."""
    parser.add_argument(flag, dest=dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)


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


def pretrain_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "pretrain",
        """
Flags follow Transformers' run_clm_no_trainer.py / run_mlm_no_trainer.py. Without --dataset_name or --train_file
the text is the corpus shipped in the package (Jane Austen's Emma, public domain); without --tokenizer_name the
tokens are bytes. The model comes from --model_name_or_path (continue a checkpoint), --config_name, or the model
flags. The output folder holds the model (save_pretrained: weights, config, modeling code), its tokenizer, a model
card (README.md), results.json, train_log.jsonl and training_args.json.

  hf-posenc pretrain --position_encoding rope --output_dir out/rope
  accelerate launch -m hf_posenc_cli pretrain --task mlm --position_encoding t5 --attention_normalizer l2 \\
      --dataset_name wikitext --dataset_config_name wikitext-103-raw-v1 --tokenizer_name bert-base-uncased \\
      --checkpointing_steps 1000 --output_dir out/t5-l2 --push_to_hub
""",
    )
    parser.add_argument("--task", choices=["clm", "mlm"], default="clm", help="causal or masked LM")
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_name", default=None, help="a dataset on the Hub (datasets.load_dataset)")
    data.add_argument("--dataset_config_name", default=None, help="the configuration of --dataset_name")
    data.add_argument("--train_file", type=Path, default=None, help="a .txt, .csv, .json or .jsonl file")
    data.add_argument(
        "--validation_file", type=Path, default=None, help="held-out text, same formats (when None: split off train)"
    )
    data.add_argument(
        "--validation_split_percentage", type=int, default=5, help="%% of train held out when there is no validation"
    )
    data.add_argument("--text_column_name", default="text", help="the column holding the text")
    data.add_argument("--block_size", type=int, default=64, help="training length: tokens per packed block")
    data.add_argument(
        "--preprocessing_num_workers", type=int, default=None, help="processes tokenising (when None: this one)"
    )
    data.add_argument("--overwrite_cache", action="store_true", help="tokenise again, ignoring the datasets cache")
    model = parser.add_argument_group("model (--model_name_or_path, --config_name, or the flags below)")
    model.add_argument(
        "--model_name_or_path", default=None, help="continue training this posenc checkpoint (folder or Hub name)"
    )
    model.add_argument("--config_name", default=None, help="a posenc config: folder, config.json or Hub name")
    model.add_argument("--config_overrides", default=None, help='applied to --config_name: "n_embd=256,n_layer=4"')
    model.add_argument("--tokenizer_name", default=None, help="default: the checkpoint's tokenizer, else bytes")
    model.add_argument("--trust_remote_code", action="store_true", help="allow code from the checkpoint's folder")
    model.add_argument(
        "--position_encoding",
        type=scheme_spec("position_encoding"),
        default=None,
        help="a name, a JSON dict, or a JSON list of them, one per layer (when None: learned)",
    )
    model.add_argument(
        "--attention_normalizer",
        type=scheme_spec("attention_normalizer"),
        default=None,
        help="a name or a JSON dict (when None: softmax)",
    )
    for name, default in MODEL_SIZE_DEFAULTS.items():
        model.add_argument(f"--{name}", type=int, default=None, help=f"when None: {default}")
    model.add_argument(
        "--layout",
        choices=catalogue.names("layout"),
        default=None,
        help="a 2025-26 layout instead of --position_encoding (hf_posenc.LAYOUT_PRESETS): "
        + "; ".join(f"{name}: {entry['description']}" for name, entry in catalogue.load_catalogue()["layout"].items()),
    )
    model.add_argument(
        "--sliding_window",
        type=positive_int,
        default=None,
        help="tokens a sliding-window layer sees: rnope_swa's rope layers, or, without --layout, every layer",
    )
    model.add_argument(
        "--attention_chunk_size",
        type=positive_int,
        default=None,
        help="tokens per chunk of a chunked-attention layer (Llama 4's, decoders): irope's rope layers, or, without "
        "--layout, every layer",
    )
    model.add_argument("--intermediate_size", type=int, default=None, help="when None: 4 * hidden_size")
    model.add_argument("--dropout", type=float, default=None, help="every dropout probability (when None: 0)")
    model.add_argument("--initializer_range", type=float, default=None, help="std of the weights (when None: 0.02)")
    model.add_argument(
        "--reference_init",
        type=string_to_bool,
        nargs="?",
        const=True,
        default=True,
        help="initialise each scheme's parameters as its reference does (hf_posenc.pretraining.reference_init); "
        "--reference_init false or --no_reference_init: as GPT-2 / BERT do",
    )
    model.add_argument(
        "--no_reference_init",
        action="store_false",
        dest="reference_init",
        default=argparse.SUPPRESS,
        help="the same as --reference_init false",
    )
    hidden_alias(parser, "--no-reference_init", "reference_init", action="store_false")
    model.add_argument(
        "--attn_implementation",
        choices=["eager", "sdpa", "flex_attention"],
        default=None,
        help="the attention backend (when None: Transformers' choice for the scheme)",
    )
    train = parser.add_argument_group("training")
    train.add_argument("--per_device_train_batch_size", type=int, default=32, help="blocks per process and step")
    train.add_argument("--per_device_eval_batch_size", type=int, default=64, help="blocks per process, evaluating")
    train.add_argument("--learning_rate", type=float, default=2e-3, help="AdamW's peak learning rate")
    train.add_argument("--weight_decay", type=float, default=0.1, help="on matrices only (not embeddings, norms)")
    train.add_argument("--adam_beta1", type=float, default=0.9, help="AdamW's beta1")
    train.add_argument("--adam_beta2", type=float, default=0.99, help="AdamW's beta2")
    train.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping (0: none)")
    train.add_argument(
        "--lr_scheduler_type", default="cosine", choices=SCHEDULER_TYPES, help="the schedule after warm-up"
    )
    train.add_argument("--num_warmup_steps", type=int, default=60, help="optimizer steps of linear warm-up")
    train.add_argument("--max_train_steps", type=int, default=600, help="optimizer steps (0: use --num_train_epochs)")
    train.add_argument("--num_train_epochs", type=int, default=None, help="used when --max_train_steps is 0")
    train.add_argument(
        "--gradient_accumulation_steps", type=int, default=1, help="batches accumulated per optimizer step"
    )
    train.add_argument(
        "--mixed_precision", choices=["no", "fp16", "bf16"], default=None, help="when None: accelerate's config"
    )
    train.add_argument("--mlm_probability", type=float, default=0.15, help="--task mlm: the share of tokens masked")
    train.add_argument("--seed", type=int, default=0, help="initialisation, batch order, masks, dropout")
    train.add_argument("--eval_steps", type=int, default=200, help="evaluate every N steps (and at the end)")
    train.add_argument("--max_eval_blocks", type=int, default=None, help="evaluate on the first N blocks only")
    train.add_argument(
        "--checkpointing_steps",
        type=int,
        default=None,
        help="accelerator.save_state every N steps (with --push_to_hub: the model is uploaded at each one)",
    )
    train.add_argument("--resume_from_checkpoint", type=Path, default=None, help="a step_N folder of --output_dir")
    train.add_argument(
        "--output_dir", type=output_folder, default="pretrain-output", help="the model, its tokenizer, logs, results"
    )
    add_tracking_flags(train)
    add_hub_flags(train, "the model, its code and tokenizer")
    return parser


def compare_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "compare",
        """
Pretrain one small model per position encoding x attention normalizer on an equal budget (the pretrain recipe,
the same data, seed, batches, steps and optimiser for every scheme), then report for each: loss at the training
length, at 2x, 4x, 8x that length (sliding windows), the position probe's relative fit error, parameters and
tokens/s. Writes compare.md, compare.json and compare.png to --output_dir and the models under models/.

  hf-posenc compare                # decoders, 6 schemes, softmax, one thread: 11-19 min on 2 CPU cores at load 2-4
  hf-posenc compare --schemes rope alibi --normalizers softmax l2 --encoders --max_train_steps 2000
  hf-posenc compare --schemes rope none --layouts smollm3 rnope_swa --sliding_window 32 --num_hidden_layers 4 \
      --seeds 0 1 2
  hf-posenc compare --schemes rope --layouts irope --attention_chunk_size 32 --num_hidden_layers 4
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
    parser.add_argument("--block_size", type=int, default=64, help="training length in tokens")
    parser.add_argument("--hidden_size", type=int, default=128, help="every model's width")
    parser.add_argument("--num_hidden_layers", type=int, default=3, help="every model's depth")
    parser.add_argument("--num_attention_heads", type=int, default=4, help="attention heads per layer")
    parser.add_argument("--max_train_steps", type=int, default=600, help="optimizer steps per model")
    parser.add_argument("--num_warmup_steps", type=int, default=60, help="optimizer steps of linear warm-up")
    parser.add_argument("--learning_rate", type=float, default=2e-3, help="AdamW's peak learning rate")
    parser.add_argument("--per_device_train_batch_size", type=int, default=32, help="blocks per process and step")
    parser.add_argument("--per_device_eval_batch_size", type=int, default=16, help="held-out blocks and windows")
    parser.add_argument("--eval_steps", type=int, default=200, help="evaluate every N steps (and at the end)")
    parser.add_argument("--seed", type=int, default=0, help="the same seed for every model")
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
    parser.add_argument(
        "--factors", type=int, nargs="+", default=list(DEFAULT_FACTORS), help="evaluation lengths / training length"
    )
    parser.add_argument("--max_eval_tokens", type=int, default=16384, help="held-out tokens for extrapolation")
    parser.add_argument("--probe_steps", type=int, default=400, help="training steps of the position probe")
    parser.add_argument(
        "--threads",
        type=non_negative_int,
        default=1,
        help="torch's threads per process (torch.set_num_threads; 0: torch's default, one per core). On a 2-core CPU "
        "shared with other jobs one thread trained 2.6-4.5x faster than two; a rerun with the same --threads gives "
        "the same numbers, another thread count moves them as another seed would",
    )
    add_tracking_flags(parser)
    add_hub_flags(
        parser, "each pretrained model (models/)", "the repositories' prefix: <prefix>-<task>-<scheme>-<normalizer>"
    )
    return parser


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
standard deviation.
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
    parser.add_argument(
        "--factors", type=int, nargs="+", default=list(DEFAULT_FACTORS), help="evaluation lengths / training length"
    )
    parser.add_argument("--max_eval_tokens", type=int, default=16384, help="evaluate on the first N tokens only")
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8, help="windows per process and batch")
    parser.add_argument("--seed", type=int, default=0, help="the encoders' masking draw")
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
    return parser


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
    add_tracking_flags(parser)
    add_hub_flags(parser, "the best epoch's model")
    return parser


def probe_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "probe",
        """
The probe of kexue.fm/archives/9105: n identical tokens in, positions 1..n out, for a grid of model family x
position encoding x normalizer variant. Prints and saves the table of final mean squared errors (probe_table.md,
probe_results.json) and a heat map (probe_heatmap.png). A variant is a normalizer name, optionally with +gate (the
Toeplitz gate), +sink (softmax's learned sink), +output_gate (gated attention, elementwise) and +boundary (boundary
tokens). A scheme is a name, optionally with
options: shaw:use_value=false.
Several processes split the grid.

  hf-posenc probe --families gpt2 --schemes t5 alibi --variants softmax l2 softmax+gate softmax+boundary
""",
    )
    parser.add_argument(
        "--families", nargs="+", default=["bert", "gpt2"], choices=["bert", "gpt2"], help="model families"
    )
    parser.add_argument(
        "--schemes",
        nargs="+",
        type=probe_scheme,
        default=None,
        help="when None: every scheme (shaw with and without V)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        type=probe_variant,
        default=DEFAULT_PROBE_VARIANTS,
        help="normalizers, each optionally +gate, +sink, +output_gate, +boundary",
    )
    add_layout_flags(parser, "rows beside the schemes (alone when --schemes is not given)")
    parser.add_argument(
        "--num_hidden_layers", type=positive_int, default=2, help="the probe model's depth (a layout repeats every 4)"
    )
    parser.add_argument("--length", type=int, default=16, help="n, the number of identical tokens")
    parser.add_argument("--max_train_steps", type=int, default=400, help="full-batch Adam steps per probe")
    parser.add_argument("--learning_rate", type=float, default=1e-3, help="Adam's learning rate")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="one probe per seed; cells give the median")
    parser.add_argument(
        "--output_dir", type=output_folder, default="probe-output", help="the table, the results, the heat map"
    )
    hidden_alias(parser, "--steps", "max_train_steps", type=int)
    hidden_alias(parser, "--lr", "learning_rate", type=float)
    hidden_alias(parser, "--output-dir", "output_dir", type=output_folder)
    return parser


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
""",
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
    parser.add_argument("--per_device_train_batch_size", type=int, default=8, help="blocks per process and step")
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8, help="blocks per process, evaluating")
    parser.add_argument("--max_train_steps", type=int, default=50, help="MLM steps after the patch")
    parser.add_argument("--head_steps", type=int, default=60, help="steps fitting a missing MLM head (0: none)")
    parser.add_argument("--learning_rate", type=float, default=3e-4, help="AdamW's peak learning rate")
    parser.add_argument("--eval_blocks", type=int, default=32, help="held-out blocks every evaluation uses")
    parser.add_argument("--mlm_probability", type=float, default=0.15, help="the share of tokens masked")
    parser.add_argument("--seed", type=int, default=0, help="masks, batch order, the eval blocks")
    parser.add_argument(
        "--output_dir", type=output_folder, default="retrofit-output", help="the results, the plot, the models"
    )
    parser.add_argument(
        "--save_models",
        action="store_true",
        help="save each retrofitted model (save_pretrained, with its tokenizer and model card) in --output_dir",
    )
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


PARSERS = {
    "pretrain": pretrain_parser,
    "compare": compare_parser,
    "extrapolate": extrapolate_parser,
    "glue": glue_parser,
    "probe": probe_parser,
    "retrofit": retrofit_parser,
}
