"""Pretrain small PosEnc models, one per position encoding x attention normalizer, and compare them.

Trains each combination with the same data, seed and budget (causal or masked LM), then reports the held-out loss at
the training length and at twice that length (length extrapolation; a ``learned`` table cannot go past its length
and reports that instead). Every trained model is saved with ``save_pretrained`` (modeling code included).

    python recipes/pretrain.py                      # embedded default: Emma ch. 1-4, byte-level, CLM, all schemes
    accelerate launch recipes/pretrain.py --task mlm --schemes rope t5 alibi --normalizers softmax l2 \\
        --train-file my_corpus.txt --tokenizer bert-base-uncased --hidden-size 256 --layers 4 --steps 2000

Without ``--tokenizer`` the text is read as bytes (``ByT5Tokenizer``, no vocabulary file needed).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from tqdm.auto import tqdm

import hf_posenc


DEFAULT_CORPUS = Path(__file__).parent / "data" / "emma_chapters_1_4.txt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["clm", "mlm"], default="clm")
    parser.add_argument("--schemes", nargs="+", default=list(hf_posenc.list_position_encodings()))
    parser.add_argument("--normalizers", nargs="+", default=["softmax"])
    parser.add_argument("--train-file", type=Path, default=DEFAULT_CORPUS, help="plain text, one or more lines")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer name or folder (default: bytes)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--eval-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/pretrain"))
    args = parser.parse_args(argv)
    for scheme in args.schemes:
        if scheme not in hf_posenc.list_position_encodings():
            parser.error(f"unknown scheme {scheme!r}; valid: {sorted(hf_posenc.list_position_encodings())}")
    for normalizer in args.normalizers:
        if normalizer not in hf_posenc.list_attention_normalizers():
            parser.error(f"unknown normalizer {normalizer!r}; valid: {sorted(hf_posenc.list_attention_normalizers())}")
    if not args.train_file.is_file():
        parser.error(f"--train-file {args.train_file} does not exist")
    return args


def load_tokenizer(name: str | None, task: str) -> transformers.PreTrainedTokenizerBase:
    tokenizer = transformers.ByT5Tokenizer() if name is None else transformers.AutoTokenizer.from_pretrained(name)
    if task == "mlm" and tokenizer.mask_token is None:
        tokenizer.add_special_tokens({"mask_token": "<mask>"})
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def token_blocks(train_file: Path, tokenizer, block_length: int, eval_fraction: float, seed: int):
    """The corpus cut into contiguous blocks of ``block_length`` tokens, split into train and eval."""
    text = load_dataset("text", data_files=str(train_file), split="train")

    def tokenize_and_chunk(batch):
        ids = [token for line in tokenizer(batch["text"], add_special_tokens=False)["input_ids"] for token in line]
        usable = len(ids) // block_length * block_length
        return {"input_ids": [ids[i : i + block_length] for i in range(0, usable, block_length)]}

    blocks = text.map(tokenize_and_chunk, batched=True, batch_size=2000, remove_columns=["text"])
    return blocks.train_test_split(test_size=eval_fraction, seed=seed)


def build_model(args, tokenizer, scheme: str, normalizer: str) -> transformers.PreTrainedModel:
    common = dict(position_encoding=scheme, attention_normalizer=normalizer, vocab_size=len(tokenizer))
    if args.task == "clm":
        config = hf_posenc.PosEncGPT2Config(
            n_embd=args.hidden_size, n_layer=args.layers, n_head=args.heads, n_positions=args.seq_len,
            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, **common,
        )  # fmt: skip
        return transformers.AutoModelForCausalLM.from_config(config)
    config = hf_posenc.PosEncBertConfig(
        hidden_size=args.hidden_size, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden_size, max_position_embeddings=args.seq_len,
        pad_token_id=tokenizer.pad_token_id, **common,
    )  # fmt: skip
    return transformers.AutoModelForMaskedLM.from_config(config)


@torch.no_grad()
def evaluate(model, loader, accelerator) -> float:
    model.eval()
    losses = []
    for batch in loader:
        losses.append(accelerator.gather_for_metrics(model(**batch).loss.repeat(len(batch["input_ids"]))))
    model.train()
    return torch.cat(losses).mean().item()


def train_one(args, tokenizer, splits, scheme: str, normalizer: str, accelerator: Accelerator) -> dict:
    set_seed(args.seed)
    model = build_model(args, tokenizer, scheme, normalizer)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=args.task == "mlm")
    train_blocks = splits["train"].map(
        lambda b: {"input_ids": [ids[i : i + args.seq_len] for ids in b["input_ids"] for i in (0, args.seq_len)]},
        batched=True,
    )
    loader = torch.utils.data.DataLoader(train_blocks, args.batch_size, shuffle=True, collate_fn=collator)
    eval_short = splits["test"].map(
        lambda b: {"input_ids": [ids[: args.seq_len] for ids in b["input_ids"]]}, batched=True
    )
    eval_loaders = {
        "eval_loss": torch.utils.data.DataLoader(eval_short, args.batch_size, collate_fn=collator),
        "eval_loss_2x": torch.utils.data.DataLoader(splits["test"], args.batch_size, collate_fn=collator),
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, args.steps // 10, args.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    eval_loaders = {name: accelerator.prepare(eval_loader) for name, eval_loader in eval_loaders.items()}

    step, progress = 0, tqdm(total=args.steps, desc=f"{scheme}+{normalizer}", disable=not accelerator.is_main_process)
    model.train()
    while step < args.steps:
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            progress.update()
            progress.set_postfix(loss=f"{loss.item():.3f}")
            if step == args.steps:
                break
    progress.close()

    result = {"scheme": scheme, "normalizer": normalizer, "train_loss": loss.item()}
    for name, eval_loader in eval_loaders.items():
        try:
            result[name] = evaluate(model, eval_loader, accelerator)
        except ValueError as error:  # a learned table cannot go past its length
            result[name] = None
            result[f"{name}_error"] = str(error).split(".")[0]
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(args.output_dir / f"{args.task}-{scheme}-{normalizer}")
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    accelerator = Accelerator()
    tokenizer = load_tokenizer(args.tokenizer, args.task)
    splits = token_blocks(args.train_file, tokenizer, 2 * args.seq_len, args.eval_fraction, args.seed)
    accelerator.print(
        f"{args.task}: {len(splits['train'])} train / {len(splits['test'])} eval blocks of {2 * args.seq_len} tokens"
    )
    results = [
        train_one(args, tokenizer, splits, scheme, normalizer, accelerator)
        for scheme in args.schemes
        for normalizer in args.normalizers
    ]
    if accelerator.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "results.json").write_text(json.dumps(results, indent=2))
        print(f"\n{'scheme':<12}{'normalizer':<12}{'eval loss':>10}{'ppl':>9}{'loss @2x':>10}")
        for r in results:
            at_2x = f"{r['eval_loss_2x']:>10.3f}" if r["eval_loss_2x"] is not None else f"{'n/a':>10}"
            ppl = math.exp(r["eval_loss"])
            print(f"{r['scheme']:<12}{r['normalizer']:<12}{r['eval_loss']:>10.3f}{ppl:>9.2f}{at_2x}")
        print(f"\nresults: {args.output_dir / 'results.json'}; models: {args.output_dir}/{args.task}-<scheme>-<norm>")
    return results


if __name__ == "__main__":
    main()
