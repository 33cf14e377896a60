"""Pretrain one PosEnc model with accelerate: a causal LM (``posenc_gpt2``) or a masked LM (``posenc_bert``).

The flags follow Transformers' ``run_clm_no_trainer.py`` / ``run_mlm_no_trainer.py``. Devices, mixed precision and
processes come from accelerate (``accelerate config``; DDP, FSDP or DeepSpeed), so the same command runs on one CPU
and on many GPUs::

    hf-posenc pretrain --position_encoding rope --output_dir out/rope          # embedded corpus, bytes
    accelerate launch -m hf_posenc_recipes pretrain --task mlm --position_encoding t5 --attention_normalizer l2 \\
        --dataset_name wikitext --dataset_config_name wikitext-103-raw-v1 --tokenizer_name bert-base-uncased \\
        --hidden_size 512 --num_hidden_layers 8 --num_attention_heads 8 --block_size 512 --max_train_steps 20000 \\
        --checkpointing_steps 1000 --output_dir out/t5-l2 --push_to_hub

Without ``--dataset_name`` or ``--train_file`` the text is the corpus shipped in the package (Jane Austen's *Emma*,
public domain); without ``--tokenizer_name`` the tokens are bytes (:func:`byte_tokenizer`, ByT5's ids). Text is
tokenised and packed into blocks of ``--block_size`` tokens by ``datasets`` (cached). The final model is saved with
``save_pretrained`` (modeling code and tokenizer included), with ``results.json`` and ``train_log.jsonl`` beside it.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import tokenizers
import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedType, set_seed
from tqdm.auto import tqdm
from transformers.convert_slow_tokenizer import bytes_to_unicode

import hf_posenc
from hf_posenc.configuration_posenc import layout_name
from hf_posenc.retrofit import check_retrofit_parallelism, retrofit_model_type
from hf_posenc_recipes.cli import run_recipe
from hf_posenc_recipes.common import (
    checked_input,
    hub_repository,
    progress_bar_off,
    recipe_accelerator,
    torch_threads,
    tracker_config,
    upload_folder,
    warn_short_schedule,
    write_model_card,
)
from hf_posenc_recipes.parsers.pretrain import MODEL_SIZE_DEFAULTS, pretrain_parser


EMBEDDED_CORPUS = Path(__file__).parent / "data" / "emma.txt.xz"
MODEL_TYPE_OF_TASK = {"clm": "posenc_gpt2", "mlm": "posenc_bert"}
IGNORE_INDEX = -100


def embedded_corpus_file() -> Path:
    """The packaged corpus (Jane Austen, *Emma*, 1815; public domain, 0.9 MB), decompressed once into the datasets
    cache so that ``datasets`` caches its tokenisation like any text file."""
    target = Path(datasets.config.HF_DATASETS_CACHE) / "hf_posenc" / "emma.txt"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        partial.write_bytes(lzma.decompress(EMBEDDED_CORPUS.read_bytes()))
        partial.replace(target)  # atomic: concurrent processes never read a half-written file
    return target


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check every argument before any work starts; a bad one exits with a message naming it."""
    parser = pretrain_parser()
    args = parser.parse_args(argv)
    if args.dataset_name is not None and args.train_file is not None:
        parser.error("give --dataset_name or --train_file, not both")
    for flag in ("train_file", "validation_file"):
        path = getattr(args, flag)
        if path is not None and not path.is_file():
            parser.error(f"--{flag} {path} does not exist")
        if path is not None and path.suffix not in (".txt", ".csv", ".json", ".jsonl"):
            parser.error(f"--{flag} {path}: the extension must be .txt, .csv, .json or .jsonl, got {path.suffix!r}")
    positive = ["block_size", "per_device_train_batch_size", "per_device_eval_batch_size"]
    positive += ["gradient_accumulation_steps", "eval_steps", "checkpointing_steps", "max_eval_blocks"]
    for flag in positive:
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag} must be >= 1, got {value}")
    if args.max_train_steps < 0 or args.num_warmup_steps < 0:
        parser.error("--max_train_steps and --num_warmup_steps must be >= 0")
    if args.max_train_steps == 0 and not args.num_train_epochs:
        parser.error("give --max_train_steps > 0 or --num_train_epochs")
    if not 0 < args.validation_split_percentage < 100:
        parser.error(f"--validation_split_percentage must be in 1..99, got {args.validation_split_percentage}")
    if not 0 < args.mlm_probability < 1:
        parser.error(f"--mlm_probability must be in (0, 1), got {args.mlm_probability}")
    if args.learning_rate <= 0:
        parser.error(f"--learning_rate must be > 0, got {args.learning_rate}")
    if args.randomized_positions is not None and args.randomized_positions < args.block_size:
        parser.error(
            f"--randomized_positions {args.randomized_positions} must be >= --block_size {args.block_size}: a block "
            "draws that many distinct positions below it"
        )
    if args.resume_from_checkpoint is not None:
        if not args.resume_from_checkpoint.is_dir():
            parser.error(f"--resume_from_checkpoint {args.resume_from_checkpoint} is not a folder")
        if checkpoint_step(args.resume_from_checkpoint) is None:
            parser.error(f"--resume_from_checkpoint {args.resume_from_checkpoint}: expected a step_<N> folder")
    if args.layout is not None and args.position_encoding is not None:
        parser.error(f"--layout {args.layout} sets the position encoding of every layer; drop --position_encoding")
    if args.layout is not None and args.layer_types is not None:
        parser.error(f"--layout {args.layout} sets the layers' types; drop --layer_types")
    flag_fields = ["position_encoding", "layout", "sliding_window", "attention_chunk_size", "attention_normalizer"]
    flag_fields += list(MODEL_SIZE_DEFAULTS)
    flag_fields += ["intermediate_size"]
    flag_fields += ["dropout", "initializer_range", "canon_layers", "canon_kernel_size", "layer_types"]
    if args.config_name is not None and args.model_name_or_path is not None:
        parser.error("give --model_name_or_path (continue a checkpoint) or --config_name (a new model), not both")
    if args.config_name is not None or args.model_name_or_path is not None:
        source = "--config_name" if args.config_name is not None else "--model_name_or_path"
        given = [f"--{name}" for name in flag_fields if getattr(args, name) is not None]
        if given:
            parser.error(f"{source} fixes the model; drop {' '.join(given)} (or use --config_overrides)")
        name = args.config_name if args.config_name is not None else args.model_name_or_path
        weights = args.model_name_or_path is not None
        checked_input(parser, source, name, lambda _: build_config(args, 384, 0, 1), weights=weights)
    else:
        if args.config_overrides is not None:
            parser.error("--config_overrides needs --config_name or --model_name_or_path")
        fill_model_defaults(args)
        try:  # the config checks names, options, types and ranges; fail now rather than after the data
            build_config(args, vocab_size=384, pad_token_id=0, eos_token_id=1)
        except ValueError as error:
            parser.error(str(error))
    if args.tokenizer_name is not None:
        checked_input(parser, "--tokenizer_name", args.tokenizer_name, partial(load_tokenizer, task=args.task))
    warn_short_schedule(parser.prog, args.max_train_steps, args.num_warmup_steps)
    return args


def fill_model_defaults(args: argparse.Namespace) -> None:
    """The model flags left None (a new model from the flags): the sizes of :data:`MODEL_SIZE_DEFAULTS`, ``learned``
    (without ``--layout``), ``softmax``, dropout 0 and GPT-2's initializer range 0.02."""
    for name, default in MODEL_SIZE_DEFAULTS.items():
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    if args.layout is None:
        args.position_encoding = args.position_encoding or "learned"
    args.attention_normalizer = args.attention_normalizer or "softmax"
    args.dropout = 0.0 if args.dropout is None else args.dropout
    args.initializer_range = 0.02 if args.initializer_range is None else args.initializer_range


def checkpoint_step(folder: Path) -> int | None:
    """The step a ``step_<N>`` checkpoint folder was saved at."""
    prefix, _, number = folder.name.partition("_")
    return int(number) if prefix == "step" and number.isdigit() else None


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Bytes as tokens, with ByT5's ids (Xue et al. 2022, ``ByT5Tokenizer``): 0 ``<pad>``, 1 ``</s>``, 2 ``<unk>``,
    byte ``b`` -> ``b + 3``, then 125 sentinels ``<extra_id_0..124>`` (259..383): 384 ids.

    Unlike ``ByT5Tokenizer``, which appends ``</s>`` to every encoding, it adds no special token (no post-processor):
    a prompt encodes to its bytes alone, so ``generate`` continues the text instead of starting after an end of
    sequence. Built with ``tokenizers``: GPT-2's byte-level pre-tokenizer turns each byte into one character, a BPE
    model without merges maps each character to its byte's id. Saved as ``tokenizer.json``, it loads with
    ``AutoTokenizer`` without hf_posenc."""
    characters = bytes_to_unicode()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{characters[byte]: byte + 3 for byte in range(256)}}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    specials = [tokenizers.AddedToken(token, lstrip=True, rstrip=True, special=True) for token in list(vocab)[:3]]
    sentinels = [f"<extra_id_{index}>" for index in range(125)]
    backend.add_special_tokens(specials + [tokenizers.AddedToken(token, special=True) for token in sentinels])
    named = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, extra_special_tokens=sentinels, **named)


def load_tokenizer(name: str | None, task: str) -> transformers.PreTrainedTokenizerBase:
    """A tokenizer by name or folder, or bytes (:func:`byte_tokenizer`: 3 specials + 256 bytes + 125 sentinels)."""
    tokenizer = byte_tokenizer() if name is None else transformers.AutoTokenizer.from_pretrained(name)
    if task == "mlm" and tokenizer.mask_token is None:
        if name is not None:
            raise ValueError(f"--tokenizer_name {name} has no mask token, which masked LM (--task mlm) needs.")
        tokenizer.mask_token = "<extra_id_0>"  # a sentinel, never produced by text
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_config(args: argparse.Namespace, vocab_size: int, pad_token_id: int, eos_token_id: int):
    """The model config: the checkpoint's (``--model_name_or_path``) or ``--config_name``'s (+ overrides), or the
    flags. ``block_size`` is the position limit."""
    source = args.model_name_or_path or args.config_name
    if source is not None:
        config = transformers.AutoConfig.from_pretrained(source, trust_remote_code=args.trust_remote_code)
        retrofitted = config.model_type.startswith(retrofit_model_type(""))
        if config.model_type != MODEL_TYPE_OF_TASK[args.task] and not retrofitted:
            raise ValueError(
                f"a {config.model_type!r} config; --task {args.task} needs {MODEL_TYPE_OF_TASK[args.task]!r} or a "
                "model saved by hf_posenc.retrofit."
            )
        if args.config_overrides:
            config.update_from_string(args.config_overrides)
        return config
    if args.layout is not None:
        windows = (args.sliding_window, args.attention_chunk_size)
        layout = hf_posenc.layout_preset(args.layout, args.num_hidden_layers, *windows)
    else:
        layout = {"position_encoding": args.position_encoding, "sliding_window": args.sliding_window}
        layout["attention_chunk_size"] = args.attention_chunk_size
        layout["layer_types"] = args.layer_types
    common = dict(
        **layout,
        attention_normalizer=args.attention_normalizer,
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        initializer_range=args.initializer_range,
        canon_layers=args.canon_layers,
    )
    if args.canon_kernel_size is not None:  # without canon layers the config refuses it, by name
        common["canon_kernel_size"] = args.canon_kernel_size
    intermediate_size = args.intermediate_size or 4 * args.hidden_size
    positions = max(args.block_size, args.randomized_positions or 0)  # the largest position id a block can hold
    if args.task == "clm":
        return hf_posenc.PosEncGPT2Config(
            n_embd=args.hidden_size, n_layer=args.num_hidden_layers, n_head=args.num_attention_heads,
            n_inner=intermediate_size, n_positions=positions, bos_token_id=eos_token_id,
            eos_token_id=eos_token_id, resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout,
            **common,
        )  # fmt: skip
    return hf_posenc.PosEncBertConfig(
        hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads, intermediate_size=intermediate_size,
        max_position_embeddings=positions, hidden_dropout_prob=args.dropout,
        attention_probs_dropout_prob=args.dropout, **common,
    )  # fmt: skip


def reference_init(model: transformers.PreTrainedModel) -> list[str]:
    """Initialise what a scheme's reference initialises differently from GPT-2 / BERT (``N(0, initializer_range)``
    for every table), so that each scheme starts as its authors trained it. Returns what was changed.

    * ``sinusoidal`` (Vaswani et al. 2017; tensor2tensor): token embeddings ``N(0, d^-1/2)``. GPT-2's 0.02 leaves the
      fixed table (entries of size ~0.7) eight times louder than ``d^-1/2`` does and the tokens nearly invisible:
      trained with GPT-2's init the model stays on the unigram plateau.

    ``learned`` is GPT-2's / BERT's own init; ``t5`` draws T5's values itself (``T5Bias``, ``init="reference"``);
    ``rope``, ``alibi`` and ``none`` have no parameters.
    """
    scheme = layout_name(model.config.position_encoding)
    std = model.config.hidden_size**-0.5
    changed = []
    with torch.no_grad():
        if scheme == "sinusoidal":
            model.get_input_embeddings().weight.normal_(0.0, std)
            changed.append(f"token embeddings ~ N(0, {std:.4f})")
    return changed


def load_text_datasets(args: argparse.Namespace) -> datasets.DatasetDict:
    """Raw text with ``train`` and ``validation`` splits, as in Transformers' examples: a Hub dataset or local files
    (the embedded corpus by default); without a validation split the first ``--validation_split_percentage`` % of
    train is held out."""
    if args.dataset_name is not None:
        source, kwargs = args.dataset_name, {"name": args.dataset_config_name}
    else:
        data_files = {"train": str(args.train_file or embedded_corpus_file())}
        if args.validation_file is not None:
            data_files["validation"] = str(args.validation_file)
        extension = Path(data_files["train"]).suffix.lstrip(".")
        source = {"txt": "text", "jsonl": "json"}.get(extension, extension)
        kwargs = {"data_files": data_files, **({"keep_linebreaks": True} if source == "text" else {})}
    raw = datasets.load_dataset(source, **kwargs)
    if "validation" not in raw:
        held_out = args.validation_split_percentage
        raw = datasets.DatasetDict(
            train=datasets.load_dataset(source, split=f"train[{held_out}%:]", **kwargs),
            validation=datasets.load_dataset(source, split=f"train[:{held_out}%]", **kwargs),
        )
    if args.text_column_name not in raw["train"].column_names:
        raise ValueError(f"--text_column_name {args.text_column_name!r} is not a column: {raw['train'].column_names}")
    return raw


def tokenize_and_pack(raw: datasets.DatasetDict, tokenizer, args, accelerator: Accelerator) -> datasets.DatasetDict:
    """Tokenise every split and pack the concatenated tokens into blocks of ``block_size`` (the tail is dropped)."""

    def tokenize(batch):
        return {"input_ids": tokenizer(batch[args.text_column_name], add_special_tokens=False)["input_ids"]}

    def pack(batch):
        ids = [token for row in batch["input_ids"] for token in row]
        usable = len(ids) // args.block_size * args.block_size
        return {"input_ids": [ids[i : i + args.block_size] for i in range(0, usable, args.block_size)]}

    with accelerator.main_process_first():  # the main process fills the datasets cache, the others read it
        tokenized = raw.map(
            tokenize,
            batched=True,
            num_proc=args.preprocessing_num_workers,
            remove_columns=raw["train"].column_names,
            load_from_cache_file=not args.overwrite_cache,
            desc="tokenising",
        )
        packed = tokenized.map(
            pack,
            batched=True,
            num_proc=args.preprocessing_num_workers,
            load_from_cache_file=not args.overwrite_cache,
            desc=f"packing into blocks of {args.block_size}",
        )
    if len(packed["train"]) == 0 or len(packed["validation"]) == 0:
        raise ValueError(f"The text is too short for one block of {args.block_size} tokens in train and validation.")
    return packed


def batch_generator(seed: int, *indices: int) -> torch.Generator:
    """A generator for one batch's masking, fixed by the run's seed and the batch's place (step, process, ...), so
    that a resumed run and an uninterrupted one draw the same masks."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, *indices]).generate_state(1)[0]))


def randomized_position_ids(
    generator: torch.Generator, batch_size: int, length: int, max_position: int
) -> torch.Tensor:
    """Randomized positional encodings (Ruoss et al., ACL 2023, "Randomized Positional Encodings Boost Length
    Generalization of Transformers"; google-deepmind/randomized_positional_encodings): ``length`` distinct positions
    drawn uniformly from ``[0, max_position)`` and sorted, one draw for the whole batch as the reference draws one
    per call; ``(batch_size, length)``. A ``ValueError`` names the limit when ``length > max_position``."""
    if length > max_position:
        raise ValueError(
            f"Randomized positions draw {length} distinct positions below {max_position} (--randomized_positions): "
            "the length is longer."
        )
    positions = torch.randperm(max_position, generator=generator)[:length].sort().values
    return positions.expand(batch_size, length)


def model_inputs(
    input_ids: torch.Tensor, task: str, collator, generator: torch.Generator, device: torch.device,
    randomized_positions: int | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Inputs and labels of one batch: labels = inputs for CLM (the model shifts them); BERT's 80/10/10 masking,
    drawn from ``generator`` by ``DataCollatorForLanguageModeling``, for MLM; with ``randomized_positions`` the
    position ids of :func:`randomized_position_ids`, drawn from ``generator`` after the masks."""
    if task == "clm":
        inputs = {"input_ids": input_ids.to(device), "labels": input_ids.to(device)}
    else:
        collator.generator = generator  # the collator draws its masks from this generator when one is set
        masked, labels = collator.torch_mask_tokens(input_ids.clone())
        inputs = {"input_ids": masked.to(device), "labels": labels.to(device)}
    if randomized_positions is not None:
        positions = randomized_position_ids(generator, *input_ids.shape, randomized_positions)
        inputs["position_ids"] = positions.to(device)
    return inputs


def token_losses(logits: torch.Tensor, labels: torch.Tensor, task: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy (nats) and correctness of the scored tokens: every next token for CLM, the masked
    tokens for MLM. Both ``(batch, scored)`` with NaN / False where a position is not scored."""
    if task == "clm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    scored = labels != IGNORE_INDEX
    loss = torch.nn.functional.cross_entropy(
        logits.float().transpose(1, 2), labels.masked_fill(~scored, 0), reduction="none"
    )
    return loss.masked_fill(~scored, float("nan")), (logits.argmax(-1) == labels) & scored


@torch.no_grad()
def evaluate_model(model, loader, accelerator: Accelerator, args, collator) -> dict[str, float]:
    """Mean loss (nats per scored token), perplexity and accuracy on the validation blocks, with fixed masks."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    for index, batch in enumerate(loader):
        generator = batch_generator(args.seed, 2**31, index, accelerator.process_index)
        inputs = model_inputs(
            batch["input_ids"], args.task, collator, generator, accelerator.device, args.randomized_positions
        )
        labels = inputs.pop("labels")
        losses, correct = token_losses(model(**inputs).logits, labels, args.task)
        per_block = torch.stack([losses.nan_to_num().sum(-1), (~losses.isnan()).sum(-1), correct.sum(-1)], -1)
        totals += accelerator.gather_for_metrics(per_block.double()).sum(0).cpu()
    model.train()
    loss = (totals[0] / totals[1]).item()
    accuracy = (totals[2] / totals[1]).item()
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)), "eval_accuracy": accuracy}


def refuse_model_parallelism(accelerator: Accelerator, model: transformers.PreTrainedModel) -> None:
    """Raise ``ValueError`` before any work when accelerate's ``ParallelismConfig`` asks for tensor, context or
    sequence parallelism: the recipe trains data-parallel only (DDP, FSDP2). It builds the model whole (tensor
    parallelism needs one loaded with ``DistributedConfig(tp_size=...)``) and runs no ``maybe_context_parallel``
    (context) nor Ulysses (sequence). The message adds the model's own refusals (``check_parallelism``)."""
    config = accelerator.parallelism_config
    if config is None:
        return
    asked = {"tensor": config.tp_enabled, "context": config.cp_enabled, "sequence": config.sp_enabled}
    for parallelism in (name for name, enabled in asked.items() if enabled):
        check = getattr(model, "check_parallelism", None) or partial(check_retrofit_parallelism, model)
        try:
            check(parallelism)
            model_says = ""
        except ValueError as error:
            model_says = f" The model itself: {error}"
        raise ValueError(
            f"pretrain trains data-parallel only (DDP, FSDP2): {parallelism} parallelism from accelerate's "
            f"ParallelismConfig is refused; set its {parallelism[0]}p_size to 1.{model_says}"
        )


def shard_masked_lm_for_fsdp2(accelerator: Accelerator, model: transformers.PreTrainedModel) -> None:
    """Under accelerate's FSDP2, shard a masked LM before accelerate does: ``fully_shard`` on each module of the
    classes the FSDP config names (``fsdp_transformer_layer_cls_to_wrap``; else the model's ``_no_split_modules``
    that do not hold the input embedding), then on the model, with the config's resharding, offload and mixed
    precision; accelerate then takes the sharded model as it is. Its own wrapping carves the output embedding (BERT's
    ``cls.predictions.decoder``) into a group of its own, while the decoder's bias, held a second time by the head
    (``cls.predictions.bias``), stays with the root, and torch 2.13's FSDP2 refuses a parameter two groups manage at
    the first forward; here the head, its bias and the tied embedding are all in the root's group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if accelerator.distributed_type != DistributedType.FSDP or not accelerator.is_fsdp2:
        return
    plugin = accelerator.state.fsdp_plugin
    plugin.set_auto_wrap_policy(model)  # resolves the class names now: accelerate cannot find them once sharded
    input_embeddings = model.get_input_embeddings()
    names = plugin.transformer_cls_names_to_wrap or model._no_split_modules
    blocks = [
        module
        for module in model.modules()
        if type(module).__name__ in names and not any(child is input_embeddings for child in module.modules())
    ]
    settings = dict(
        offload_policy=plugin.cpu_offload, mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy()
    )
    for block in blocks:
        fully_shard(block, reshard_after_forward=plugin.reshard_after_forward, **settings)
    fully_shard(model, **settings)


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices only: embedding tables (tokens, positions, biases of schemes), norms and
    biases are not decayed, so no scheme's position parameters are pulled towards zero."""
    no_decay = set()
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.LayerNorm)):
            no_decay.update(id(p) for p in module.parameters(recurse=False))
    decay, rest = [], []
    for param in model.parameters():
        if param.requires_grad:
            (rest if id(param) in no_decay or param.ndim < 2 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train one model; returns the final metrics (also written to ``output_dir/results.json``)."""
    args = parse_args(argv)
    with torch_threads(args.threads):
        return train(args)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train one model as ``args`` say."""
    tokenizer = load_tokenizer(args.tokenizer_name or args.model_name_or_path, args.task)
    repo_id = hub_repository(args)  # before any work: a Hub target that cannot be reached stops the run here
    accelerator = recipe_accelerator(
        args,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
    )
    set_seed(args.seed)
    if accelerator.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
    packed = tokenize_and_pack(load_text_datasets(args), tokenizer, args, accelerator)
    config = build_config(args, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    auto_class = transformers.AutoModelForCausalLM if args.task == "clm" else transformers.AutoModelForMaskedLM
    kwargs = {"attn_implementation": args.attn_implementation} if args.attn_implementation else {}
    if args.model_name_or_path is not None:
        model = auto_class.from_pretrained(
            args.model_name_or_path, config=config, trust_remote_code=args.trust_remote_code, **kwargs
        )
    else:
        model = auto_class.from_config(config, **kwargs)
    initialised = reference_init(model) if args.reference_init and args.model_name_or_path is None else []
    num_parameters = sum(p.numel() for p in model.parameters())
    accelerator.print(
        f"{args.task} {config.position_encoding} + {config.attention_normalizer}: {num_parameters:,} parameters; "
        f"{len(packed['train'])} train / {len(packed['validation'])} validation blocks of {args.block_size} tokens"
        + (f"; reference init: {', '.join(initialised)}" if initialised else "")
    )

    collator = (
        transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=args.mlm_probability)
        if args.task == "mlm"
        else None
    )
    columns = packed.with_format("torch", columns=["input_ids"])
    # A generator of its own: a DataLoader iterator draws its worker seed from it, not from the global RNG, so that
    # restarting the iterator on resume leaves dropout's random stream where the checkpoint saved it.
    train_loader = torch.utils.data.DataLoader(
        columns["train"],
        args.per_device_train_batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    validation = columns["validation"]
    if args.max_eval_blocks is not None:
        validation = validation.select(range(min(args.max_eval_blocks, len(validation))))
    eval_loader = torch.utils.data.DataLoader(
        validation, args.per_device_eval_batch_size, generator=torch.Generator().manual_seed(args.seed)
    )
    refuse_model_parallelism(accelerator, model)
    if args.task == "mlm":
        shard_masked_lm_for_fsdp2(accelerator, model)
    optimizer = torch.optim.AdamW(
        optimizer_groups(model, args.weight_decay), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2)
    )
    # Batches stay on the CPU until masked (masks are drawn on the CPU); model_inputs moves them to the device.
    train_loader = accelerator.prepare_data_loader(train_loader, device_placement=False)
    eval_loader = accelerator.prepare_data_loader(eval_loader, device_placement=False)
    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    num_epochs = math.ceil(max_train_steps / steps_per_epoch)
    # The prepared scheduler steps once per process per optimizer step, as in Transformers' no_trainer examples.
    scheduler = transformers.get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=max_train_steps * accelerator.num_processes,
    )
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    completed_steps = 0
    if args.resume_from_checkpoint is not None:
        accelerator.load_state(str(args.resume_from_checkpoint))
        completed_steps = checkpoint_step(args.resume_from_checkpoint)
        accelerator.print(f"resumed from {args.resume_from_checkpoint} at step {completed_steps}")
    tokens_per_step = args.block_size * args.per_device_train_batch_size * args.gradient_accumulation_steps
    tokens_per_step *= accelerator.num_processes
    log_path = args.output_dir / "train_log.jsonl"
    progress = tqdm(
        total=max_train_steps,
        initial=completed_steps,
        desc="training",
        disable=progress_bar_off(accelerator.is_local_main_process),
    )
    train_seconds, step_loss, history, uploads = 0.0, torch.zeros((), dtype=torch.float64), [], []
    if args.with_tracking:
        accelerator.init_trackers("hf_posenc_pretrain", tracker_config(args))
    eval_metrics: dict[str, float] = {}
    model.train()
    for epoch in range(completed_steps // steps_per_epoch, num_epochs):
        train_loader.set_epoch(epoch)
        skip = (completed_steps - epoch * steps_per_epoch) * args.gradient_accumulation_steps
        active_loader = accelerator.skip_first_batches(train_loader, skip) if skip > 0 else train_loader
        started = time.perf_counter()
        for micro_step, batch in enumerate(active_loader, start=skip):
            generator = batch_generator(args.seed, completed_steps, micro_step, accelerator.process_index)
            inputs = model_inputs(
                batch["input_ids"], args.task, collator, generator, accelerator.device, args.randomized_positions
            )
            with accelerator.accumulate(model):
                loss = model(**inputs).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            step_loss += loss.detach().double().cpu() / args.gradient_accumulation_steps
            if not accelerator.sync_gradients:
                continue
            completed_steps += 1
            train_seconds += time.perf_counter() - started
            mean_loss = accelerator.reduce(step_loss.to(accelerator.device), "mean").item()
            step_loss.zero_()
            record = {
                "step": completed_steps,
                "loss": mean_loss,
                "learning_rate": scheduler.get_last_lr()[0],
                "tokens_per_second": tokens_per_step * completed_steps / max(train_seconds, 1e-9),
            }
            history.append(record)
            progress.update()
            progress.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{record['tokens_per_second']:.0f}")
            if completed_steps % args.eval_steps == 0 or completed_steps == max_train_steps:
                eval_metrics = evaluate_model(model, eval_loader, accelerator, args, collator)
                record.update(eval_metrics)
                progress.write(
                    f"step {completed_steps}: eval loss {eval_metrics['eval_loss']:.4f}, perplexity "
                    f"{eval_metrics['perplexity']:.3f}, accuracy {eval_metrics['eval_accuracy']:.4f}"
                )
            if accelerator.is_main_process:
                with log_path.open("a") as log:
                    log.write(json.dumps(record) + "\n")
            if args.with_tracking:
                accelerator.log(record, step=completed_steps)
            if args.checkpointing_steps and completed_steps % args.checkpointing_steps == 0:
                accelerator.save_state(str(args.output_dir / f"step_{completed_steps}"))
                if repo_id is not None and completed_steps < max_train_steps:  # the final upload follows the loop
                    results = run_results(
                        args, config, completed_steps, num_parameters, history, initialised, eval_metrics
                    )
                    save_outputs(args, accelerator, model, tokenizer, results, repo_id)
                    if accelerator.is_main_process:
                        message = f"Training in progress, step {completed_steps}"
                        uploads.append(upload_folder(repo_id, args.output_dir, message, args.hub_token, False))
            started = time.perf_counter()
            if completed_steps >= max_train_steps:
                break
        if completed_steps >= max_train_steps:
            break
    progress.close()

    results = run_results(args, config, completed_steps, num_parameters, history, initialised, eval_metrics)
    save_outputs(args, accelerator, model, tokenizer, results, repo_id)
    if accelerator.is_main_process and repo_id is not None:
        for pending in uploads:
            pending.result()  # a failed checkpoint upload is reported here, before the final one
        upload_folder(repo_id, args.output_dir, f"{completed_steps} steps (final)", args.hub_token, blocking=True)
        accelerator.print(f"uploaded to the Hub: {repo_id}")
    if args.with_tracking:
        accelerator.end_training()
    accelerator.wait_for_everyone()
    return results


def run_results(args, config, steps: int, num_parameters: int, history, initialised, eval_metrics) -> dict[str, Any]:
    """What ``results.json`` and the model card report."""
    return {
        "task": args.task,
        "position_encoding": config.position_encoding,
        "attention_normalizer": config.attention_normalizer,
        "block_size": args.block_size,
        "steps": steps,
        "num_parameters": num_parameters,
        "train_loss": history[-1]["loss"] if history else None,
        # measured over this run's steps only (a resumed run times the steps after the checkpoint)
        "tokens_per_second": history[-1]["tokens_per_second"] if history else None,
        "reference_init": initialised,
        **eval_metrics,
    }


def training_data(args: argparse.Namespace) -> str:
    """The data of a run, in words, for the model card."""
    if args.dataset_name is not None:
        text = f"`{args.dataset_name}`" + (f" (`{args.dataset_config_name}`)" if args.dataset_config_name else "")
    elif args.train_file is not None:
        text = f"The text file `{args.train_file.name}`"
    else:
        text = "The corpus embedded in hf_posenc (Jane Austen, *Emma*, 1815; public domain)"
    tokens = f"tokenizer `{args.tokenizer_name}`" if args.tokenizer_name else "bytes (ByT5's ids)"
    held_out = (
        "its validation split"
        if args.validation_file is not None or args.dataset_name is not None
        else (f"the first {args.validation_split_percentage} % held out")
    )
    return f"{text}, {tokens}, packed into blocks of {args.block_size} tokens; {held_out} for evaluation."


def save_outputs(args, accelerator: Accelerator, model, tokenizer, results: dict[str, Any], repo_id) -> None:
    """The model (``save_pretrained``), its tokenizer, ``training_args.json`` (no Hub token), ``results.json`` and
    the model card, in ``--output_dir``."""
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        args.output_dir,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model),
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        arguments = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
        arguments.pop("hub_token")
        (args.output_dir / "training_args.json").write_text(json.dumps(arguments, indent=2))
        (args.output_dir / "results.json").write_text(json.dumps(results, indent=2))
        auto_class = "AutoModelForCausalLM" if args.task == "clm" else "AutoModelForMaskedLM"
        write_model_card(
            args.output_dir, unwrapped.config, "pretrain", args, training_data(args), results, repo_id, auto_class
        )
    accelerator.wait_for_everyone()


if __name__ == "__main__":  # python recipes/pretrain.py ..., accelerate launch recipes/pretrain.py ...
    raise SystemExit(run_recipe("pretrain", sys.argv[1:], main))
