"""The command line of ``hf-posenc pretrain`` (:mod:`hf_posenc_recipes.pretrain`), with the flags of Transformers'
``run_clm_no_trainer.py`` / ``run_mlm_no_trainer.py``. Standard library only."""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_posenc_recipes import catalogue

from .common import (
    MODEL_SIZE_DEFAULTS,
    TRAINING_FLAGS,
    add_flags,
    add_hub_flags,
    add_reference_init_flags,
    add_threads_flag,
    add_tracking_flags,
    new_parser,
    output_folder,
    positive_int,
    scheme_spec,
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
    add_flags(data, ("block_size",))
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
    add_flags(model, tuple(MODEL_SIZE_DEFAULTS))
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
    add_flags(model, ("intermediate_size", "dropout", "initializer_range", "canon_layers", "canon_kernel_size"))
    add_flags(model, ("layer_types",))
    add_reference_init_flags(parser, model)
    add_flags(model, ("attn_implementation",))
    train = parser.add_argument_group("training")
    add_flags(train, TRAINING_FLAGS)
    train.add_argument("--num_train_epochs", type=int, default=None, help="used when --max_train_steps is 0")
    train.add_argument(
        "--gradient_accumulation_steps", type=int, default=1, help="batches accumulated per optimizer step"
    )
    train.add_argument(
        "--mixed_precision", choices=["no", "fp16", "bf16"], default=None, help="when None: accelerate's config"
    )
    train.add_argument("--mlm_probability", type=float, default=0.15, help="--task mlm: the share of tokens masked")
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
