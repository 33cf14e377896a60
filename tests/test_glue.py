"""The GLUE recipe (``hf-posenc glue``, recipes/glue.py) and its metric module
(recipes/metrics/glue), on tiny models and fixtures."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import evaluate
import huggingface_hub
import numpy as np
import pytest
import torch
import transformers
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

import hf_posenc
from hf_posenc_recipes import glue


ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "glue"
SST2 = FIXTURES / "sst2"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run ~100x faster on one thread than on two oversubscribed ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_bert_config(vocab_size: int, **overrides) -> dict:
    return dict(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **overrides,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    """A random stock BertModel (no classification head, like a pretrained encoder) and a WordPiece tokenizer."""
    path = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = transformers.BertTokenizer(vocab=str(FIXTURES / "vocab.txt"))
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(**tiny_bert_config(len(tokenizer)))).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def sst2_args(model: Path, output_dir: Path, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", str(model), "--task_name", "sst2", "--output_dir", str(output_dir),
        "--train_file", str(SST2 / "train.tsv"), "--validation_file", str(SST2 / "validation.tsv"),
        "--learning_rate", "3e-3", "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "4", *extra,
    ]  # fmt: skip


def read_tsv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file, delimiter="\t", quoting=csv.QUOTE_NONE))


def pair_rows(seed: int, count: int) -> list[tuple[dict, dict]]:
    """Pairs of fixture sentences (a train sentence with a random other one), for the pair-task tests."""
    rows = read_tsv(SST2 / "train.tsv")
    rng = np.random.default_rng(seed)
    return [(rows[i], rows[j]) for i, j in rng.integers(0, len(rows), size=(count, 2))]


# --- the metric module against scikit-learn and scipy ---


def reference_metrics(config: str, predictions: np.ndarray, references: np.ndarray) -> dict[str, float]:
    """GLUE's metrics per task, computed by scikit-learn and scipy."""
    if config == "cola":
        return {"matthews_correlation": matthews_corrcoef(references, predictions)}
    if config == "stsb":
        return {"pearson": pearsonr(predictions, references)[0], "spearmanr": spearmanr(predictions, references)[0]}
    if config in ("mrpc", "qqp"):
        return {"accuracy": accuracy_score(references, predictions), "f1": f1_score(references, predictions)}
    return {"accuracy": accuracy_score(references, predictions)}


GLUE_METRIC_CONFIGS = [*glue.GLUE_TASKS, "mnli_matched", "mnli_mismatched", "hans"]


@pytest.mark.parametrize("config", GLUE_METRIC_CONFIGS)
def test_metric_module_equals_sklearn_and_scipy(config):
    metric = evaluate.load(str(glue.METRIC_PATH), config, keep_in_memory=True)
    rng = np.random.default_rng(0)
    if config == "stsb":  # scores with ties, as rounded STS-B scores have
        references = np.round(rng.uniform(0, 5, 200), 1)
        predictions = np.round(references + rng.normal(0, 1.0, 200), 1)
    else:
        num_labels = 3 if config.startswith("mnli") else 2
        references = rng.integers(0, num_labels, 200)
        predictions = np.where(rng.random(200) < 0.7, references, rng.integers(0, num_labels, 200))
    computed = metric.compute(predictions=predictions.tolist(), references=references.tolist())
    expected = reference_metrics(config, predictions, references)
    assert computed.keys() == expected.keys()
    for name, value in expected.items():
        assert computed[name] == pytest.approx(value, abs=1e-12), name


def test_metric_functions_match_sklearn_on_multiclass_and_degenerate_inputs():
    spec = importlib.util.spec_from_file_location("glue_metric", glue.METRIC_PATH / "glue.py")
    metric_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(metric_module)
    rng = np.random.default_rng(1)
    references, predictions = rng.integers(0, 3, 100), rng.integers(0, 3, 100)
    assert metric_module.matthews_correlation(predictions, references) == pytest.approx(
        matthews_corrcoef(references, predictions), abs=1e-12
    )
    constant, references = np.ones(10, dtype=np.int64), rng.integers(0, 2, 10)
    assert metric_module.matthews_correlation(constant, references) == matthews_corrcoef(references, constant) == 0.0
    zeros = np.zeros(10, dtype=np.int64)
    assert metric_module.f1_positive(zeros, zeros) == f1_score(zeros, zeros, zero_division=0.0)


def test_metric_module_rejects_unknown_config():
    with pytest.raises(KeyError, match="unknown GLUE config 'sst-2'; valid:"):
        evaluate.load(str(glue.METRIC_PATH), "sst-2", keep_in_memory=True)


# --- the recipe ---


def test_sst2_loss_falls_best_checkpoint_reloads_and_test_predictions_are_written(tiny_bert, tmp_path):
    epochs = ["--num_train_epochs", "12", "--learning_rate", "5e-3"]
    summary = glue.main(sst2_args(tiny_bert, tmp_path, *epochs, "--test_file", str(SST2 / "test.tsv")))
    run = summary["runs"][0]
    losses = [epoch["train_loss"] for epoch in run["epochs"]]
    assert len(losses) == 12 and losses[-1] < 0.5 * losses[0], losses
    accuracies = [epoch["validation_accuracy"] for epoch in run["epochs"]]
    assert run["best"]["validation_accuracy"] == max(accuracies)
    assert run["best"]["epoch"] == accuracies.index(max(accuracies)) + 1  # the first best epoch is kept

    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert model.config.id2label == {0: "negative", 1: "positive"}
    validation = read_tsv(SST2 / "validation.tsv")
    with torch.no_grad():
        inputs = tokenizer([row["sentence"] for row in validation], padding=True, return_tensors="pt")
        predictions = model(**inputs).logits.argmax(-1).numpy()
    labels = np.array([int(row["label"]) for row in validation])
    assert accuracy_score(labels, predictions) == pytest.approx(run["best"]["validation_accuracy"])

    submission = read_tsv(tmp_path / "SST-2.tsv")
    test_rows = read_tsv(SST2 / "test.tsv")
    assert [row["index"] for row in submission] == [row["idx"] for row in test_rows]
    with torch.no_grad():
        inputs = tokenizer([row["sentence"] for row in test_rows], padding=True, return_tensors="pt")
        expected = model(**inputs).logits.argmax(-1).tolist()
    assert [int(row["prediction"]) for row in submission] == expected

    evaluated = glue.main(sst2_args(tmp_path, tmp_path / "evaluated", "--num_train_epochs", "0"))["runs"][0]["best"]
    assert evaluated == {"epoch": 0, "step": 0, "validation_accuracy": run["best"]["validation_accuracy"]}

    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["mean"] == {"validation_accuracy": run["best"]["validation_accuracy"]} and saved["std"] == {
        "validation_accuracy": None
    }
    assert (tmp_path / "results.md").read_text().startswith(f"| {tiny_bert} | stock bert | sst2 | validation_accuracy")


def test_seeds_report_mean_and_std(tiny_bert, tmp_path):
    summary = glue.main(sst2_args(tiny_bert, tmp_path, "--num_train_epochs", "1", "--seeds", "1", "2"))
    accuracies = [run["best"]["validation_accuracy"] for run in summary["runs"]]
    assert summary["seeds"] == [1, 2]
    assert summary["mean"]["validation_accuracy"] == pytest.approx(np.mean(accuracies))
    assert summary["std"]["validation_accuracy"] == pytest.approx(np.std(accuracies, ddof=1))
    for seed in (1, 2):
        transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / f"seed_{seed}")
    assert "± " in summary["markdown"] and "seeds 1, 2" in summary["markdown"]


def test_converted_stock_checkpoint_fine_tunes_and_reloads_as_posenc(tiny_bert, tmp_path):
    summary = glue.main(
        sst2_args(
            tiny_bert, tmp_path, "--max_train_steps", "3", "--position_encoding", "rope", "--num_warmup_steps", "1"
        )
    )
    assert summary["scheme"] == "rope + softmax"
    assert summary["runs"][0]["best"]["step"] == 3
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert isinstance(model, hf_posenc.PosEncBertForSequenceClassification)
    assert model.config.position_encoding["type"] == "rope" and model.config.num_labels == 2


def test_retrofitted_stock_checkpoint_fine_tunes_reloads_and_gets_a_model_card(tiny_bert, tmp_path):
    """``--retrofit alibi --attention_normalizer l2`` patches the stock BERT in place (names and weights kept)."""
    summary = glue.main(
        sst2_args(tiny_bert, tmp_path, "--max_train_steps", "2", "--retrofit", "alibi", "--attention_normalizer", "l2")
    )
    assert summary["scheme"] == "alibi + l2" and summary["runs"][0]["best"]["step"] == 2
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, trust_remote_code=True)
    assert model.config.model_type == "posenc_retrofit_bert" and model.config.position_encoding["type"] == "alibi"
    card = (tmp_path / "README.md").read_text()
    assert "position encoding **alibi** and attention normalizer **l2**" in card
    assert "| `--retrofit` | `alibi` |" in card and "| validation_accuracy |" in card and "sst2" in card


def test_push_to_hub_fails_before_training_when_the_hub_is_unreachable(tiny_bert, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # a closed port
    with pytest.raises(OSError, match=r"--push_to_hub: cannot create or reach the Hub repository 'me/sst2'"):
        glue.main(sst2_args(tiny_bert, tmp_path / "out", "--push_to_hub", "--hub_model_id", "me/sst2"))
    assert not (tmp_path / "out").exists()  # nothing was trained or written


def test_posenc_checkpoint_fine_tunes_with_its_own_scheme(tiny_bert, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_bert)
    config = hf_posenc.PosEncBertConfig(position_encoding="t5", **tiny_bert_config(len(tokenizer)))
    hf_posenc.PosEncBertModel(config).save_pretrained(tmp_path / "t5")
    tokenizer.save_pretrained(tmp_path / "t5")
    summary = glue.main(sst2_args(tmp_path / "t5", tmp_path / "out", "--max_train_steps", "2"))
    assert summary["scheme"] == "t5 + softmax"
    with pytest.raises(ValueError, match="is already a PosEnc model \\(t5 \\+ softmax\\)"):
        glue.main(
            sst2_args(tmp_path / "t5", tmp_path / "out2", "--max_train_steps", "1", "--position_encoding", "rope")
        )


def test_regression_pair_task_stsb_from_json(tiny_bert, tmp_path):
    for split, seed, count in (("train", 0, 24), ("validation", 1, 12)):
        with open(tmp_path / f"{split}.jsonl", "w") as file:
            for first, second in pair_rows(seed, count):
                score = 4.0 if first["label"] == second["label"] else 1.0
                file.write(
                    json.dumps({"sentence1": first["sentence"], "sentence2": second["sentence"], "label": score})
                )
                file.write("\n")
    args = [
        "--model_name_or_path", str(tiny_bert), "--task_name", "stsb", "--output_dir", str(tmp_path / "out"),
        "--train_file", str(tmp_path / "train.jsonl"), "--validation_file", str(tmp_path / "validation.jsonl"),
        "--test_file", str(tmp_path / "validation.jsonl"), "--num_train_epochs", "2", "--learning_rate", "1e-3",
    ]  # fmt: skip
    best = glue.main(args)["runs"][0]["best"]
    assert set(best) == {"epoch", "step", "train_loss", "validation_pearson", "validation_spearmanr"}
    assert all(-1 <= best[name] <= 1 for name in ("validation_pearson", "validation_spearmanr"))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert model.config.num_labels == 1 and model.config.problem_type == "regression"
    submission = read_tsv(tmp_path / "out" / "STS-B.tsv")
    assert len(submission) == 12 and all(len(row["prediction"].split(".")[1]) == 3 for row in submission)


def test_pair_task_mnli_matched_and_mismatched_from_csv_with_label_names(tiny_bert, tmp_path):
    names = ("entailment", "neutral", "contradiction")
    for split, seed, count in (("train", 0, 24), ("matched", 1, 10), ("mismatched", 2, 9)):
        with open(tmp_path / f"{split}.csv", "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["premise", "hypothesis", "label", "idx"])
            for i, (first, second) in enumerate(pair_rows(seed, count)):
                writer.writerow([first["sentence"], second["sentence"], names[i % 3], 100 + i])
    args = [
        "--model_name_or_path", str(tiny_bert), "--task_name", "mnli", "--output_dir", str(tmp_path / "out"),
        "--train_file", str(tmp_path / "train.csv"), "--validation_file", str(tmp_path / "matched.csv"),
        "--validation_mismatched_file", str(tmp_path / "mismatched.csv"), "--test_file", str(tmp_path / "matched.csv"),
        "--test_mismatched_file", str(tmp_path / "mismatched.csv"), "--num_train_epochs", "1",
    ]  # fmt: skip
    best = glue.main(args)["runs"][0]["best"]
    assert {"validation_matched_accuracy", "validation_mismatched_accuracy"} <= set(best)
    matched, mismatched = read_tsv(tmp_path / "out" / "MNLI-m.tsv"), read_tsv(tmp_path / "out" / "MNLI-mm.tsv")
    assert [row["index"] for row in matched] == [str(100 + i) for i in range(10)] and len(mismatched) == 9
    assert {row["prediction"] for row in matched + mismatched} <= set(names)


# --- bad arguments ---


def test_unknown_task_names_the_valid_ones(tiny_bert, tmp_path, capsys):
    with pytest.raises(SystemExit):
        glue.parse_args(["--model_name_or_path", str(tiny_bert), "--task_name", "sst-2", "--output_dir", "x"])
    error = capsys.readouterr().err
    assert "invalid choice: 'sst-2'" in error and "sst2" in error and "mnli" in error


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--position_encoding", "rotary"], "--position_encoding: unknown position_encoding 'rotary'; valid choices"),
        (["--validation_mismatched_file", str(SST2 / "validation.tsv")], "the mismatched files are for mnli only"),
        (["--test_file", str(FIXTURES / "vocab.txt")], "unknown format '.txt'"),
        (["--test_file", "missing.tsv"], "--test_file missing.tsv does not exist"),
        (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps must be at least 1"),
    ],
)
def test_bad_arguments_are_refused_by_name(extra, message, tiny_bert, tmp_path, capsys):
    with pytest.raises(SystemExit):
        glue.parse_args(sst2_args(tiny_bert, tmp_path, *extra))
    assert message in capsys.readouterr().err


def test_train_file_without_validation_file_is_refused(tiny_bert, capsys):
    with pytest.raises(SystemExit):
        glue.parse_args(["--model_name_or_path", str(tiny_bert), "--task_name", "sst2", "--output_dir", "x",
                         "--train_file", str(SST2 / "train.tsv")])  # fmt: skip
    assert "give --train_file and --validation_file together" in capsys.readouterr().err


def test_missing_columns_are_named(tiny_bert, tmp_path):
    with pytest.raises(ValueError, match=r"mrpc train data lacks the columns \['sentence1', 'sentence2'\]; it has "):
        glue.main(sst2_args(tiny_bert, tmp_path, "--task_name", "mrpc"))


def test_labels_outside_the_task_are_named(tiny_bert, tmp_path):
    rows = read_tsv(SST2 / "validation.tsv")
    rows[3]["label"] = "2"
    rows[5]["label"] = "positiv"
    with open(tmp_path / "validation.tsv", "w") as file:
        file.write("sentence\tlabel\n" + "".join(f"{row['sentence']}\t{row['label']}\n" for row in rows))
    args = sst2_args(tiny_bert, tmp_path / "out")
    args[args.index("--validation_file") + 1] = str(tmp_path / "validation.tsv")
    with pytest.raises(ValueError, match=r"sst2 validation data: labels '2', 'positiv' are not labels of this task; "
                                         r"valid: 0 \(negative\), 1 \(positive\)"):  # fmt: skip
        glue.main(args)


def test_checkpoint_head_with_another_label_count_is_refused(tiny_bert, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_bert)
    config = transformers.BertConfig(**tiny_bert_config(len(tokenizer)), num_labels=3)
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "three")
    tokenizer.save_pretrained(tmp_path / "three")
    with pytest.raises(ValueError, match="has a 3-label classification head but sst2 has 2 label"):
        glue.main(sst2_args(tmp_path / "three", tmp_path / "out", "--max_train_steps", "1"))
    summary = glue.main(sst2_args(tmp_path / "three", tmp_path / "out", "--max_train_steps", "1",
                                  "--ignore_mismatched_sizes"))  # fmt: skip
    assert summary["runs"][0]["best"]["step"] == 1


# --- several processes ---


def test_two_cpu_processes_give_the_metrics_of_one(tiny_bert, tmp_path):
    """2 processes x batch 8 (DDP over gloo) = 1 process x batch 16 = 1 process x batch 8 x 2 accumulated steps:
    the same examples per optimizer step, the same gradients, so the same losses and metrics to float rounding."""
    common = [
        "--num_train_epochs",
        "12",
        "--learning_rate",
        "5e-3",
        "--test_file",
        str(SST2 / "test.tsv"),
        "--per_device_eval_batch_size",
        "4",
    ]
    one = glue.main([*sst2_args(tiny_bert, tmp_path / "one", *common), "--per_device_train_batch_size", "16"])
    accumulated = glue.main([*sst2_args(tiny_bert, tmp_path / "acc", *common), "--gradient_accumulation_steps", "2"])
    # torchrun starts the processes (--standalone: on a free port); the recipe joins them as MULTI_CPU over gloo
    # (no ACCELERATE_USE_CPU needed: without it they once ran as two independent copies)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    launch += ["-m", "hf_posenc_recipes", "glue"]
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    env.pop("ACCELERATE_USE_CPU", None)
    completed = subprocess.run(
        [*launch, *sst2_args(tiny_bert, tmp_path / "two", *common)], env=env, capture_output=True, text=True
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.count("| sst2 |") == 1  # the summary line, printed once
    two = json.loads((tmp_path / "two" / "results.json").read_text())

    for other in (accumulated, two):
        for epoch_one, epoch_other in zip(one["runs"][0]["epochs"], other["runs"][0]["epochs"], strict=True):
            assert epoch_other["step"] == epoch_one["step"] == 4 * epoch_one["epoch"]
            assert epoch_other["train_loss"] == pytest.approx(epoch_one["train_loss"], abs=1e-4)
            assert epoch_other["validation_accuracy"] == epoch_one["validation_accuracy"]
    assert one["runs"][0]["epochs"][-1]["train_loss"] < 0.5 * one["runs"][0]["epochs"][0]["train_loss"]  # it learned
    predictions = [read_tsv(tmp_path / name / "SST-2.tsv") for name in ("one", "acc", "two")]
    assert predictions[0] == predictions[1] == predictions[2] and len(predictions[0]) == 16
