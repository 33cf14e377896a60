"""GLUE metrics as a local `evaluate` module: load it by path, online or offline.

    metric = evaluate.load("recipes/metrics/glue", "mrpc")
    metric.compute(predictions=[0, 1, 1], references=[0, 1, 0])  # {"accuracy": 0.667, "f1": 0.667}

The metrics per task are GLUE's (Wang et al. 2019, https://gluebenchmark.com, table 1): CoLA Matthews correlation;
MRPC and QQP accuracy and F1 of the positive class; STS-B Pearson and Spearman correlation; SST-2, MNLI (matched and
mismatched), QNLI, RTE, WNLI and HANS accuracy. The formulas are written out here with numpy, so the module needs
nothing else; tests check them against scikit-learn and scipy.
"""

from __future__ import annotations

import datasets
import evaluate
import numpy as np


TASK_METRICS = {
    "cola": ("matthews_correlation",),
    "sst2": ("accuracy",),
    "mrpc": ("accuracy", "f1"),
    "stsb": ("pearson", "spearmanr"),
    "qqp": ("accuracy", "f1"),
    "mnli": ("accuracy",),
    "mnli_matched": ("accuracy",),
    "mnli_mismatched": ("accuracy",),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
    "wnli": ("accuracy",),
    "hans": ("accuracy",),
}

_DESCRIPTION = __doc__

_CITATION = """\
@inproceedings{wang2019glue,
  title={{GLUE}: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding},
  author={Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer and Bowman, Samuel R.},
  booktitle={International Conference on Learning Representations},
  year={2019}
}
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: predicted labels (integers), or scores (floats) for "stsb".
    references: gold labels (integers), or scores (floats) for "stsb".
Returns: a dict with the task's metrics, each a float:
    "accuracy" (fraction correct), "f1" (F1 of label 1), "matthews_correlation" (-1 to 1),
    "pearson" and "spearmanr" (-1 to 1).
"""


def accuracy(predictions: np.ndarray, references: np.ndarray) -> float:
    """Fraction of predictions equal to the reference."""
    return float((predictions == references).mean())


def f1_positive(predictions: np.ndarray, references: np.ndarray) -> float:
    """F1 of label 1: 2 TP / (2 TP + FP + FN); 0 when there is no positive in either."""
    true_positive = np.sum((predictions == 1) & (references == 1))
    false_positive = np.sum((predictions == 1) & (references != 1))
    false_negative = np.sum((predictions != 1) & (references == 1))
    denominator = 2 * true_positive + false_positive + false_negative
    return float(2 * true_positive / denominator) if denominator else 0.0


def matthews_correlation(predictions: np.ndarray, references: np.ndarray) -> float:
    """Matthews correlation, multi-class form (Gorodkin 2004) from the confusion matrix C:
    (c s - sum_k p_k t_k) / sqrt((s^2 - sum_k p_k^2)(s^2 - sum_k t_k^2)), c = trace(C), s = samples, p_k predicted
    and t_k true counts of class k; 0 when a denominator factor is 0. Two classes: (TP TN - FP FN) / sqrt(...).
    """
    classes, encoded = np.unique(np.concatenate([references, predictions]), return_inverse=True)
    true_class, predicted_class = encoded[: len(references)], encoded[len(references) :]
    confusion = np.zeros((len(classes), len(classes)), dtype=np.float64)
    np.add.at(confusion, (true_class, predicted_class), 1)
    correct, samples = np.trace(confusion), confusion.sum()
    predicted_counts, true_counts = confusion.sum(axis=0), confusion.sum(axis=1)
    covariance = correct * samples - predicted_counts @ true_counts
    variance_predicted = samples**2 - predicted_counts @ predicted_counts
    variance_true = samples**2 - true_counts @ true_counts
    if variance_predicted == 0 or variance_true == 0:
        return 0.0
    return float(covariance / np.sqrt(variance_predicted * variance_true))


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation: sum (x - mean x)(y - mean y) / sqrt(sum (x - mean x)^2 sum (y - mean y)^2)."""
    x_centred, y_centred = x - x.mean(), y - y.mean()
    return float((x_centred @ y_centred) / np.sqrt((x_centred @ x_centred) * (y_centred @ y_centred)))


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n, tied values sharing the mean of their ranks."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    run_starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
    run_ends = np.r_[run_starts[1:], len(values)]
    ranks = np.empty(len(values), dtype=np.float64)
    for start, end in zip(run_starts, run_ends, strict=True):
        ranks[order[start:end]] = (start + 1 + end) / 2
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman correlation: the Pearson correlation of the average ranks."""
    return pearson(average_ranks(x), average_ranks(y))


METRIC_FUNCTIONS = {
    "accuracy": accuracy,
    "f1": f1_positive,
    "matthews_correlation": matthews_correlation,
    "pearson": pearson,
    "spearmanr": spearman,
}


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Glue(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        if self.config_name not in TASK_METRICS:
            raise KeyError(f"unknown GLUE config {self.config_name!r}; valid: {sorted(TASK_METRICS)}")
        value_type = "float64" if self.config_name == "stsb" else "int64"
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value(value_type), "references": datasets.Value(value_type)}
            ),
            reference_urls=["https://gluebenchmark.com/tasks"],
        )

    def _compute(self, predictions, references) -> dict[str, float]:
        dtype = np.float64 if self.config_name == "stsb" else np.int64
        predictions, references = np.asarray(predictions, dtype=dtype), np.asarray(references, dtype=dtype)
        return {name: METRIC_FUNCTIONS[name](predictions, references) for name in TASK_METRICS[self.config_name]}
