"""The command line of ``hf-posenc pretrain`` (:mod:`hf_posenc_recipes.pretrain`), with the flags of Transformers'
``run_clm_no_trainer.py`` / ``run_mlm_no_trainer.py``. Standard library only."""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_posenc_recipes import catalogue

from .common import (
    SCHEDULER_TYPES,
    add_hub_flags,
    add_threads_flag,
    add_tracking_flags,
    hidden_alias,
    new_parser,
    output_folder,
    positive_int,
    scheme_spec,
    string_to_bool,
)


MODEL_SIZE_DEFAULTS = {"hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4}


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
  accelerate launch -m hf_posenc_recipes pretrain --task mlm --position_encoding t5 --attention_normalizer l2 \\
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
        help="initialise each scheme's parameters as its reference does "
        "(hf_posenc_recipes.pretrain.reference_init); --reference_init false or --no_reference_init: as "
        "GPT-2 / BERT do",
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
    add_threads_flag(train)
    add_tracking_flags(train)
    add_hub_flags(train, "the model, its code and tokenizer")
    return parser
