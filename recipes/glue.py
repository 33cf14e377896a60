"""``hf-posenc glue``: fine-tune and evaluate a checkpoint (PosEnc or stock, local or Hub) on a GLUE task, with
accelerate.

    hf-posenc glue --model_name_or_path bert-base-uncased --task_name mrpc --output_dir out/mrpc
    accelerate launch -m hf_posenc_recipes glue --model_name_or_path my-t5-bert --task_name mnli --seeds 1 2 3 ...
    hf-posenc glue --model_name_or_path bert-base-uncased --position_encoding rope --task_name rte ...
    hf-posenc glue --model_name_or_path bert-base-uncased --retrofit alibi --attention_normalizer l2 ...
    hf-posenc glue --task_name sst2 --train_file train.tsv --validation_file dev.tsv --test_file test.tsv ...
    torchrun --standalone --nproc_per_node 2 -m hf_posenc_recipes glue ...      # several CPU processes (gloo)

Data: ``nyu-mll/glue`` from the Hub, or local CSV / TSV / JSON files with GLUE's column names (``sentence``,
``sentence1``/``sentence2``, ``question``/``sentence``, ``premise``/``hypothesis``, ... and ``label``, as integers or
the task's label names; test files need no label, and an ``idx`` column numbers their predictions). The model is
evaluated after every epoch with the task's GLUE metrics (``hf_posenc/metrics/glue``, a local ``evaluate`` module);
the best epoch is saved (``save_pretrained`` with the tokenizer and a model card) and predicts the test split into
GLUE's submission file (``SST-2.tsv``, ``MNLI-m.tsv``, ...); ``--num_train_epochs 0`` evaluates the checkpoint as it
is. ``--seeds`` repeats the run per seed and reports mean and standard deviation. Flags follow Transformers'
``run_glue_no_trainer.py``. ``--position_encoding`` / ``--attention_normalizer`` convert a stock checkpoint with
``hf_posenc.convert``; ``--retrofit`` patches one in place with ``hf_posenc.retrofit`` (the other weights kept).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import evaluate
import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import Dataset, DatasetDict, load_dataset
from tqdm.auto import tqdm

import hf_posenc
from hf_posenc.configuration_posenc import layout_name
from hf_posenc_recipes.cli import run_recipe
from hf_posenc_recipes.common import (
    checked_input,
    hub_repository,
    progress_bar_off,
    recipe_accelerator,
    scheme_names,
    torch_threads,
    tracker_config,
    upload_folder,
    warn_short_schedule,
    write_model_card,
)
from hf_posenc_recipes.parsers.glue import glue_parser


METRIC_PATH = Path(__file__).resolve().parent / "metrics" / "glue"


@dataclass(frozen=True)
class GlueTask:
    """What a GLUE task reads, predicts and submits."""

    sentence_keys: tuple[str, ...]
    label_names: tuple[str, ...]  # empty for the regression task STS-B
    submission_file: str  # GLUE's name for the test predictions, without ".tsv"
    submit_label_names: bool = False  # GLUE takes label names for MNLI, QNLI and RTE, label ids for the rest

    @property
    def is_regression(self) -> bool:
        return not self.label_names

    @property
    def num_labels(self) -> int:
        return len(self.label_names) or 1


GLUE_TASKS = {
    "cola": GlueTask(("sentence",), ("unacceptable", "acceptable"), "CoLA"),
    "sst2": GlueTask(("sentence",), ("negative", "positive"), "SST-2"),
    "mrpc": GlueTask(("sentence1", "sentence2"), ("not_equivalent", "equivalent"), "MRPC"),
    "stsb": GlueTask(("sentence1", "sentence2"), (), "STS-B"),
    "qqp": GlueTask(("question1", "question2"), ("not_duplicate", "duplicate"), "QQP"),
    "mnli": GlueTask(("premise", "hypothesis"), ("entailment", "neutral", "contradiction"), "MNLI", True),
    "qnli": GlueTask(("question", "sentence"), ("entailment", "not_entailment"), "QNLI", True),
    "rte": GlueTask(("sentence1", "sentence2"), ("entailment", "not_entailment"), "RTE", True),
    "wnli": GlueTask(("sentence1", "sentence2"), ("not_entailment", "entailment"), "WNLI"),
}


@dataclass(frozen=True)
class EvaluationSet:
    """A validation split, the metric config that scores it, and the test split predicted in its place."""

    validation_split: str
    metric_config: str
    test_split: str
    submission_file: str


def evaluation_sets(task_name: str) -> list[EvaluationSet]:
    """MNLI has a matched and a mismatched set (GLUE reports both); every other task one. The first selects the best
    epoch."""
    task = GLUE_TASKS[task_name]
    if task_name == "mnli":
        return [
            EvaluationSet("validation_matched", "mnli_matched", "test_matched", "MNLI-m"),
            EvaluationSet("validation_mismatched", "mnli_mismatched", "test_mismatched", "MNLI-mm"),
        ]
    return [EvaluationSet("validation", task_name, "test", task.submission_file)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = glue_parser()
    args = parser.parse_args(argv)

    local_files = ("train_file", "validation_file", "validation_mismatched_file", "test_file", "test_mismatched_file")
    for name in local_files:
        path = getattr(args, name)
        if path is not None and not path.is_file():
            parser.error(f"--{name} {path} does not exist")
        if path is not None and path.suffix.lower() not in DATA_FORMATS:
            parser.error(f"--{name} {path}: unknown format {path.suffix!r}; valid: {sorted(DATA_FORMATS)}")
    if (args.train_file is None) != (args.validation_file is None):
        parser.error("give --train_file and --validation_file together, or neither to load nyu-mll/glue")
    if args.train_file is None and (args.test_file or args.validation_mismatched_file or args.test_mismatched_file):
        parser.error("--test_file and the mismatched files go with --train_file and --validation_file")
    if args.task_name != "mnli" and (args.validation_mismatched_file or args.test_mismatched_file):
        parser.error(f"the mismatched files are for mnli only, not {args.task_name}")
    if args.retrofit is not None and args.position_encoding is not None:
        parser.error("give --position_encoding (convert) or --retrofit (patch in place), not both")
    if args.attention_normalizer is not None and args.position_encoding is None and args.retrofit is None:
        parser.error("--attention_normalizer goes with --position_encoding or --retrofit")
    if args.push_to_hub and args.seeds is not None and len(args.seeds) > 1:
        parser.error("--push_to_hub uploads one model: give one seed (--seed), not --seeds")
    for name in ("max_length", "per_device_train_batch_size", "per_device_eval_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.gradient_accumulation_steps < 1:
        parser.error(f"--gradient_accumulation_steps must be at least 1, got {args.gradient_accumulation_steps}")
    if args.num_train_epochs < 0 or (args.max_train_steps is not None and args.max_train_steps < 1):
        parser.error("--num_train_epochs must be >= 0 (0: evaluate only) and --max_train_steps >= 1")
    warn_short_schedule(parser.prog, args.max_train_steps, args.num_warmup_steps)
    remote = {"trust_remote_code": args.trust_remote_code}
    load_config = partial(transformers.AutoConfig.from_pretrained, **remote)
    checked_input(parser, "--model_name_or_path", args.model_name_or_path, load_config, weights=True)
    if args.tokenizer_name is not None:
        load_tokenizer = partial(transformers.AutoTokenizer.from_pretrained, **remote)
        checked_input(parser, "--tokenizer_name", args.tokenizer_name, load_tokenizer)
    return args


DATA_FORMATS = {
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t", "quoting": csv.QUOTE_NONE}),  # GLUE's TSVs hold unbalanced quotes
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
}


def load_local_file(path: Path) -> Dataset:
    builder, options = DATA_FORMATS[path.suffix.lower()]
    if builder == "csv":
        options = {**options, "keep_default_na": False}  # a sentence "NA" or "null" stays text
    return load_dataset(builder, data_files=str(path), split="train", **options)


def load_glue_splits(args: argparse.Namespace) -> DatasetDict:
    """``nyu-mll/glue`` from the Hub, or the local files under the Hub's split names."""
    if args.train_file is None:
        return load_dataset("nyu-mll/glue", args.task_name)
    mnli = args.task_name == "mnli"
    files = {
        "train": args.train_file,
        "validation_matched" if mnli else "validation": args.validation_file,
        "validation_mismatched": args.validation_mismatched_file,
        "test_matched" if mnli else "test": args.test_file,
        "test_mismatched": args.test_mismatched_file,
    }
    return DatasetDict({split: load_local_file(path) for split, path in files.items() if path is not None})


def encode_labels(values: list, task: GlueTask, where: str) -> list[int] | list[float]:
    """Labels as ids (from ids or the task's label names) or, for STS-B, floats; anything else is an error."""
    if task.is_regression:
        try:
            return [float(value) for value in values]
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: STS-B labels are similarity scores (numbers 0-5); {error}") from None
    label_ids = {name: i for i, name in enumerate(task.label_names)} | {i: i for i in range(task.num_labels)}
    label_ids |= {str(i): i for i in range(task.num_labels)}
    bad = sorted({repr(value) for value in values if value not in label_ids})
    if bad:
        valid = ", ".join(f"{i} ({name})" for i, name in enumerate(task.label_names))
        raise ValueError(f"{where}: labels {', '.join(bad[:5])} are not labels of this task; valid: {valid}")
    return [label_ids[value] for value in values]


def check_and_encode(splits: DatasetDict, task_name: str) -> DatasetDict:
    """Check every split has the task's columns and valid labels; labels become ``labels`` (dropped from tests)."""
    task = GLUE_TASKS[task_name]
    checked = {}
    for split, dataset in splits.items():
        required = [*task.sentence_keys] + ([] if split.startswith("test") else ["label"])
        missing = [column for column in required if column not in dataset.column_names]
        if missing:
            raise ValueError(
                f"{task_name} {split} data lacks the columns {missing}; it has {dataset.column_names}, "
                f"{task_name} needs {required}"
            )
        if split.startswith("test"):
            dataset = dataset.remove_columns([c for c in ("label",) if c in dataset.column_names])
        else:
            labels = encode_labels(dataset["label"], task, f"{task_name} {split} data")
            dataset = dataset.remove_columns("label").add_column("labels", labels)
        checked[split] = dataset
    return DatasetDict(checked)


def tokenize_splits(splits: DatasetDict, tokenizer, task_name: str, args: argparse.Namespace) -> DatasetDict:
    keys = GLUE_TASKS[task_name].sentence_keys

    def tokenize(batch):
        padding = "max_length" if args.pad_to_max_length else False
        return tokenizer(*(batch[key] for key in keys), padding=padding, max_length=args.max_length, truncation=True)

    return DatasetDict(
        {
            split: dataset.map(
                tokenize,
                batched=True,
                remove_columns=[c for c in dataset.column_names if c != "labels"],
                desc=f"tokenize {split}",
            )
            for split, dataset in splits.items()
        }
    )


def load_model(args: argparse.Namespace, task_name: str, tokenizer) -> transformers.PreTrainedModel:
    """The checkpoint with a sequence-classification head for the task, converted when a scheme is asked for."""
    task = GLUE_TASKS[task_name]
    remote = {"trust_remote_code": args.trust_remote_code}
    config = transformers.AutoConfig.from_pretrained(args.model_name_or_path, **remote)
    has_head = any(name.endswith("ForSequenceClassification") for name in config.architectures or [])
    if has_head and config.num_labels != task.num_labels and not args.ignore_mismatched_sizes:
        raise ValueError(
            f"{args.model_name_or_path} has a {config.num_labels}-label classification head but {task_name} has "
            f"{task.num_labels} label(s); pass --ignore_mismatched_sizes to start a new head"
        )
    config.num_labels = task.num_labels
    config.problem_type = "regression" if task.is_regression else "single_label_classification"
    if not task.is_regression:
        config.id2label = dict(enumerate(task.label_names))
        config.label2id = {name: i for i, name in enumerate(task.label_names)}
    config.finetuning_task = task_name
    if config.pad_token_id is None:  # GPT-2 style: pool the last non-pad token
        config.pad_token_id = tokenizer.pad_token_id
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path, config=config, ignore_mismatched_sizes=args.ignore_mismatched_sizes, **remote
    )
    if args.position_encoding is None and args.retrofit is None:
        return model
    if config.model_type.startswith("posenc_"):
        raise ValueError(
            f"{args.model_name_or_path} is already a PosEnc model ({layout_name(model.config.position_encoding)} + "
            f"{model.config.attention_normalizer['type']}); --position_encoding / --retrofit / "
            "--attention_normalizer change stock checkpoints"
        )
    normalizer = args.attention_normalizer or "softmax"
    if args.retrofit is not None:
        return hf_posenc.retrofit(model, args.retrofit, normalizer)
    return hf_posenc.convert(model, args.position_encoding, normalizer)


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only, not on biases and norm weights (BERT's recipe)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0},
    ]


@torch.no_grad()
def predict(model, loader, accelerator: Accelerator, is_regression: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Predictions of every example in order (all processes gathered, padding duplicates dropped), and the labels."""
    model.eval()
    predictions, references = [], []
    for batch in loader:
        labels = batch.pop("labels", None)
        logits = model(**batch).logits.float()
        prediction = logits.squeeze(-1) if is_regression else logits.argmax(dim=-1)
        predictions.append(accelerator.gather_for_metrics(prediction))
        if labels is not None:
            references.append(accelerator.gather_for_metrics(labels))
    model.train()
    return torch.cat(predictions).cpu(), torch.cat(references).cpu() if references else None


def score(metrics: dict[str, float]) -> float:
    """GLUE's task score: the mean of the task's metrics (F1 and accuracy, Pearson and Spearman)."""
    return sum(metrics.values()) / len(metrics)


def write_submission(path: Path, indices: list[int], predictions: torch.Tensor, task: GlueTask) -> None:
    """GLUE's submission format: a TSV of ``index<TAB>prediction`` under a header."""
    lines = ["index\tprediction"]
    for index, prediction in zip(indices, predictions.tolist(), strict=True):
        if task.is_regression:
            value = f"{prediction:.3f}"
        else:
            value = task.label_names[prediction] if task.submit_label_names else str(prediction)
        lines.append(f"{index}\t{value}")
    path.write_text("\n".join(lines) + "\n")


def describe_scheme(model: transformers.PreTrainedModel) -> str:
    """``rope + softmax`` for a PosEnc or retrofitted model, ``stock <model_type>`` otherwise."""
    encoding, normalizer = scheme_names(model.config)
    return encoding if encoding.startswith("stock ") else f"{encoding} + {normalizer}"


def train_one_seed(
    args: argparse.Namespace,
    seed: int,
    run_dir: Path,
    splits: DatasetDict,
    test_indices: dict[str, list],
    tokenizer,
    accelerator: Accelerator,
) -> dict:
    """Fine-tune with one seed; evaluate every epoch, save the best epoch, predict the test splits with it."""
    task = GLUE_TASKS[args.task_name]
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
    set_seed(seed)
    model = load_model(args, args.task_name, tokenizer)
    scheme = describe_scheme(model)

    if args.pad_to_max_length:
        collator = transformers.default_data_collator
    else:
        multiple = 8 if accelerator.mixed_precision in ("fp16", "bf16") else None
        collator = transformers.DataCollatorWithPadding(tokenizer, pad_to_multiple_of=multiple)

    def loader(split: str, batch_size: int, shuffle: bool = False) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(seed)  # the same order on 1 or N processes
        return torch.utils.data.DataLoader(
            splits[split], batch_size, shuffle, collate_fn=collator, generator=generator
        )

    sets = [s for s in evaluation_sets(args.task_name) if s.validation_split in splits]
    eval_loaders = [loader(s.validation_split, args.per_device_eval_batch_size) for s in sets]
    metrics = [evaluate.load(str(METRIC_PATH), s.metric_config, keep_in_memory=True) for s in sets]
    train_loader = loader("train", args.per_device_train_batch_size, shuffle=True)

    optimizer = torch.optim.AdamW(optimizer_groups(model, args.weight_decay), lr=args.learning_rate)
    model, optimizer, train_loader, *eval_loaders = accelerator.prepare(model, optimizer, train_loader, *eval_loaders)
    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        max_train_steps, num_epochs = args.num_train_epochs * steps_per_epoch, args.num_train_epochs
    else:
        max_train_steps, num_epochs = args.max_train_steps, math.ceil(args.max_train_steps / steps_per_epoch)
    scheduler = transformers.get_scheduler(  # the prepared scheduler steps once per process per optimizer step
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=max_train_steps * accelerator.num_processes,
    )
    scheduler = accelerator.prepare(scheduler)

    def evaluate_all() -> dict[str, float]:
        results = {}
        for evaluation_set, eval_loader, metric in zip(sets, eval_loaders, metrics, strict=True):
            predictions, references = predict(model, eval_loader, accelerator, task.is_regression)
            computed = metric.compute(predictions=predictions.tolist(), references=references.tolist())
            results |= {f"{evaluation_set.validation_split}_{name}": value for name, value in computed.items()}
        return results

    def selection_score(results: dict[str, float]) -> float:
        prefix = f"{sets[0].validation_split}_"
        return score({name: value for name, value in results.items() if name.startswith(prefix)})

    start = time.perf_counter()
    epochs, best, best_state, completed_steps = [], None, None, 0
    progress = tqdm(
        total=max_train_steps,
        desc=f"{args.task_name} seed {seed}",
        disable=progress_bar_off(accelerator.is_local_main_process),
    )
    model.train()
    for epoch in range(1, num_epochs + 1):
        losses = []
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.detach().float())
            if accelerator.sync_gradients:
                completed_steps += 1
                progress.update()
                progress.set_postfix(loss=f"{loss.item():.4f}")
            if completed_steps >= max_train_steps:
                break
        train_loss = accelerator.gather(torch.stack(losses).mean()).mean().item()
        results = {"epoch": epoch, "step": completed_steps, "train_loss": train_loss, **evaluate_all()}
        epochs.append(results)
        accelerator.print(f"seed {seed} epoch {epoch}: {json.dumps(results)}")
        if args.with_tracking:
            prefix = f"seed_{seed}/" if args.seeds and len(args.seeds) > 1 else ""
            accelerator.log({f"{prefix}{name}": value for name, value in results.items()}, step=completed_steps)
        if best is None or selection_score(results) > selection_score(best):
            best = results
            unwrapped = accelerator.unwrap_model(model)
            best_state = {
                name: tensor.detach().to("cpu", copy=True) for name, tensor in unwrapped.state_dict().items()
            }
            unwrapped.save_pretrained(
                run_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save
            )
            if accelerator.is_main_process:
                tokenizer.save_pretrained(run_dir)
    progress.close()
    if num_epochs == 0:
        best = {"epoch": 0, "step": 0, **evaluate_all()}
    else:
        accelerator.unwrap_model(model).load_state_dict(best_state)

    for evaluation_set in evaluation_sets(args.task_name):
        if evaluation_set.test_split in splits:
            test_loader = accelerator.prepare(loader(evaluation_set.test_split, args.per_device_eval_batch_size))
            predictions, _ = predict(model, test_loader, accelerator, task.is_regression)
            if accelerator.is_main_process:
                path = run_dir / f"{evaluation_set.submission_file}.tsv"
                write_submission(path, test_indices[evaluation_set.test_split], predictions, task)
    accelerator.wait_for_everyone()
    runtime = time.perf_counter() - start
    return {"seed": seed, "scheme": scheme, "runtime_s": runtime, "best": best, "epochs": epochs}


def summarize(args: argparse.Namespace, runs: list[dict]) -> dict:
    """Per-metric mean and sample standard deviation (n - 1) over seeds, and one line of markdown."""
    names = [name for name in runs[0]["best"] if name not in ("epoch", "step", "train_loss")]
    mean = {name: statistics.fmean(run["best"][name] for run in runs) for name in names}
    std = {name: statistics.stdev(run["best"][name] for run in runs) if len(runs) > 1 else None for name in names}
    figures = ", ".join(
        f"{name} {mean[name]:.4f}" + (f" ± {std[name]:.4f}" if std[name] is not None else "") for name in names
    )
    seeds = ", ".join(str(run["seed"]) for run in runs)
    markdown = f"| {args.model_name_or_path} | {runs[0]['scheme']} | {args.task_name} | {figures} | seeds {seeds} |"
    return {
        "task_name": args.task_name,
        "model_name_or_path": str(args.model_name_or_path),
        "scheme": runs[0]["scheme"],
        "seeds": [run["seed"] for run in runs],
        "mean": mean,
        "std": std,
        "markdown": markdown,
        "runs": runs,
    }


def glue_data(args: argparse.Namespace) -> str:
    """The data of a run, in words, for the model card."""
    if args.train_file is None:
        return f"GLUE {args.task_name} (`nyu-mll/glue`, `{args.task_name}`): train split; validation for the scores."
    return (
        f"GLUE {args.task_name} from local files: `{args.train_file.name}`, validation `{args.validation_file.name}`."
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with torch_threads(args.threads):
        return fine_tune(args)


def fine_tune(args: argparse.Namespace) -> dict:
    """Fine-tune and evaluate as ``args`` say."""
    repo_id = hub_repository(args)  # before any work: a Hub target that cannot be reached stops the run here
    accelerator = recipe_accelerator(
        args, gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=args.mixed_precision
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        args.tokenizer_name or args.model_name_or_path, trust_remote_code=args.trust_remote_code
    )
    if tokenizer.pad_token is None:  # GPT-2 style tokenizers
        tokenizer.pad_token = tokenizer.eos_token
    with accelerator.main_process_first():
        raw_splits = check_and_encode(load_glue_splits(args), args.task_name)
        splits = tokenize_splits(raw_splits, tokenizer, args.task_name, args)
    test_indices = {
        split: dataset["idx"] if "idx" in dataset.column_names else list(range(len(dataset)))
        for split, dataset in raw_splits.items()
        if split.startswith("test")
    }
    if args.with_tracking:
        accelerator.init_trackers("hf_posenc_glue", tracker_config(args))

    seeds = args.seeds or [args.seed]
    runs = []
    for seed in seeds:
        run_dir = args.output_dir if len(seeds) == 1 else args.output_dir / f"seed_{seed}"
        runs.append(train_one_seed(args, seed, run_dir, splits, test_indices, tokenizer, accelerator))
    summary = summarize(args, runs)
    if accelerator.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "results.json").write_text(json.dumps(summary, indent=2))
        (args.output_dir / "results.md").write_text(summary["markdown"] + "\n")
        print(summary["markdown"])
        for seed, run in zip(seeds, runs, strict=True):
            run_dir = args.output_dir if len(seeds) == 1 else args.output_dir / f"seed_{seed}"
            if not (run_dir / "config.json").is_file():  # --num_train_epochs 0 evaluates and saves no model
                continue
            config = SimpleNamespace(**json.loads((run_dir / "config.json").read_text()))
            results = {"seed": seed, "scheme": run["scheme"], **run["best"]}
            write_model_card(
                run_dir, config, "glue", args, glue_data(args), results, repo_id, "AutoModelForSequenceClassification"
            )
        if repo_id is not None:
            upload_folder(repo_id, args.output_dir, f"{args.task_name}: best epoch", args.hub_token, blocking=True)
            print(f"uploaded to the Hub: {repo_id}")
    if args.with_tracking:
        accelerator.end_training()
    accelerator.wait_for_everyone()
    return summary


if __name__ == "__main__":  # python recipes/glue.py ..., accelerate launch recipes/glue.py ...
    raise SystemExit(run_recipe("glue", sys.argv[1:], main))
