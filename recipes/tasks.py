"""The long-context tasks of ``compare --task`` and ``extrapolate --task``: multi-query associative recall (``mqar``),
copying (``copy``) and a passkey hidden in filler text (``passkey``), each drawn from a seed so that every scheme sees
the same examples, and the accuracy that scores them.

Every example is a row of token ids with a row of labels in Transformers' causal-LM convention: ``labels[t]`` is
``input_ids[t]`` where that token is an answer, ``IGNORE_INDEX`` elsewhere, so ``model(input_ids, labels=labels)``
trains on the answers alone (as Zoology does) and a model is scored on predicting each answer token from the tokens
before it. ``mqar`` and ``copy`` are written in bytes with the byte tokenizer's ids (``byte + 3``,
:func:`hf_posenc_recipes.pretrain.byte_tokenizer`); ``passkey`` is text, encoded by the model's own tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_posenc_recipes.parsers.tasks import check_mqar
from hf_posenc_recipes.pretrain import IGNORE_INDEX, batch_generator, embedded_corpus_file


TASK_NAMES = ("mqar", "copy", "passkey")
BYTE_OFFSET = 3
"""The byte tokenizer's id of byte ``b`` is ``b + BYTE_OFFSET`` (ByT5's ids: 0 pad, 1 eos, 2 unk, then the bytes)."""
COPY_ALPHABET = b"abcdefghijklmnopqrstuvwxyz"
COPY_SEPARATOR = b"|"[0]
PASSKEY_NEEDLE = " The pass key is {key}. "
PASSKEY_QUESTION = " The pass key is "
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class TaskBatch:
    """A batch of one task: ``input_ids`` and ``labels`` ``(batch, length)``, the labels ``IGNORE_INDEX`` except at
    the answer tokens; ``per_example``: the task is scored by whole examples (every answer token right), not by
    answer tokens."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    per_example: bool = False


def byte_ids(data: bytes | Sequence[int]) -> torch.Tensor:
    """Bytes as the byte tokenizer's ids."""
    return torch.tensor(list(data), dtype=torch.long) + BYTE_OFFSET


def mqar_batch(
    generator: torch.Generator, batch_size: int, length: int, num_pairs: int = 4, num_queries: int = 4,
    vocab_size: int = 64,
) -> TaskBatch:  # fmt: skip
    """Multi-query associative recall as Zoology's ``multiquery_ar`` writes it (Arora et al. 2023): ``num_pairs``
    key-value pairs ``k_1 v_1 k_2 v_2 ...`` open the row, keys distinct bytes of ``[0, vocab_size / 2)``, values
    distinct bytes of ``[vocab_size / 2, vocab_size)``; then ``num_queries`` of the keys (distinct) come back, each
    at an even offset of the rest of the row drawn uniformly, followed by its value, the answer. Every other position
    holds a byte of ``[vocab_size, 256)`` drawn uniformly (Zoology's ``random_non_queries``, taken outside the keys
    and values so that a key is always a query). Scored per answer."""
    check_mqar(length, num_pairs, num_queries, vocab_size)
    context = 2 * num_pairs
    slots = (length - context) // 2
    half = vocab_size // 2
    rows = torch.randint(vocab_size, 256, (batch_size, length), generator=generator)
    labels = torch.full((batch_size, length), IGNORE_INDEX, dtype=torch.long)
    for row, row_labels in zip(rows, labels, strict=True):
        keys = torch.randperm(half, generator=generator)[:num_pairs]
        values = half + torch.randperm(vocab_size - half, generator=generator)[:num_pairs]
        row[0:context:2], row[1:context:2] = keys, values
        asked = torch.randperm(num_pairs, generator=generator)[:num_queries]
        places = context + 2 * torch.randperm(slots, generator=generator)[:num_queries]
        row[places], row[places + 1] = keys[asked], values[asked]
        row_labels[places + 1] = values[asked] + BYTE_OFFSET
    return TaskBatch(rows + BYTE_OFFSET, labels)


def copy_batch(generator: torch.Generator, batch_size: int, length: int) -> TaskBatch:
    """Copying: a string of ``n = (length - 1) // 2`` letters drawn uniformly from ``a..z``, the separator ``|``, the
    same string again (the answers), and a pad token where ``length`` is even. Scored per copied letter."""
    if length < 3:
        raise ValueError(f"copy: the length must be >= 3 (a letter, the separator, its copy), got {length}")
    size = (length - 1) // 2
    alphabet = byte_ids(COPY_ALPHABET)
    strings = alphabet[torch.randint(len(alphabet), (batch_size, size), generator=generator)]
    separator = torch.full((batch_size, 1), COPY_SEPARATOR + BYTE_OFFSET, dtype=torch.long)
    pad = torch.zeros((batch_size, length - 2 * size - 1), dtype=torch.long)
    rows = torch.cat([strings, separator, strings, pad], dim=1)
    labels = torch.cat([torch.full((batch_size, size + 1), IGNORE_INDEX), strings, pad + IGNORE_INDEX], dim=1)
    return TaskBatch(rows, labels)


@dataclass
class PasskeyText:
    """What a passkey example is made of, as token ids of one tokenizer: ``filler`` (a long text, excerpts of which
    surround the needle), ``encode`` (text -> ids, no special tokens)."""

    filler: torch.Tensor
    encode: Callable[[str], list[int]]


def passkey_batch(
    generator: torch.Generator, batch_size: int, length: int, text: PasskeyText, digits: int = 5,
    depth: float | None = None,
) -> TaskBatch:  # fmt: skip
    """A passkey hidden in filler text, retrieved at the end (Mohtashami & Jaggi 2023, shortened for a byte model):
    an excerpt of ``text.filler`` starting at a uniform offset, with the needle ``" The pass key is 48213. "`` put in
    at ``depth`` (0: before the excerpt, 1: after it; uniform in [0, 1] per example when None), then the question
    ``" The pass key is "`` and the key's ``digits`` digits (the answers, first digit not 0). The excerpt fills the
    row to ``length`` tokens. Scored per example: right when every digit is."""
    if digits < 1:
        raise ValueError(f"passkey: the key needs at least 1 digit, got {digits}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey: the depth must be in [0, 1], got {depth}")
    question = torch.tensor(text.encode(PASSKEY_QUESTION), dtype=torch.long)
    rows, labels = [], []
    for _ in range(batch_size):
        key = str(int(torch.randint(10 ** (digits - 1), 10**digits, (1,), generator=generator)))
        needle = torch.tensor(text.encode(PASSKEY_NEEDLE.format(key=key)), dtype=torch.long)
        answer = torch.tensor(text.encode(key), dtype=torch.long)
        size = length - len(needle) - len(question) - len(answer)
        if size < 0:
            raise ValueError(
                f"passkey: the needle, question and key take {length - size} tokens, more than the length {length}"
            )
        if len(text.filler) < size:
            raise ValueError(f"passkey: the filler text has {len(text.filler)} tokens, fewer than the {size} needed")
        start = int(torch.randint(len(text.filler) - size + 1, (1,), generator=generator))
        excerpt = text.filler[start : start + size]
        where = float(torch.rand((), generator=generator)) if depth is None else depth
        cut = round(where * size)
        rows.append(torch.cat([excerpt[:cut], needle, excerpt[cut:], question, answer]))
        labels.append(torch.cat([torch.full((length - len(answer),), IGNORE_INDEX), answer]))
    return TaskBatch(torch.stack(rows), torch.stack(labels), per_example=True)


def answer_accuracy(logits: torch.Tensor, labels: torch.Tensor, per_example: bool) -> tuple[int, int]:
    """``(right, scored)``: the answers predicted right (the most likely token at the position before each answer
    token, ``logits[:, t - 1].argmax() == labels[:, t]``) and the answers scored. Per answer token, or with
    ``per_example`` per row holding answers, a row right when each of its answer tokens is (under teacher forcing, as
    greedy decoding would give them)."""
    predicted, targets = logits[:, :-1].argmax(-1), labels[:, 1:]
    scored = targets != IGNORE_INDEX
    right = (predicted == targets) & scored
    if not per_example:
        return int(right.sum()), int(scored.sum())
    rows = scored.any(-1)
    return int(((right == scored).all(-1) & rows).sum()), int(rows.sum())


@dataclass
class TaskSpec:
    """One task with its settings (the flags of :mod:`hf_posenc_recipes.parsers.tasks`); ``passkey`` also needs its
    texts, ``{"train": ..., "eval": ...}`` (:func:`passkey_texts`)."""

    name: str
    mqar_pairs: int = 4
    mqar_queries: int = 4
    mqar_vocab: int = 64
    passkey_digits: int = 5
    passkey: dict[str, PasskeyText] | None = None

    def batch(
        self, generator: torch.Generator, size: int, length: int, split: str = "train", depth: float | None = None
    ) -> TaskBatch:
        """``size`` examples of ``length`` tokens; passkey's filler from ``split``, its needle at ``depth``."""
        if self.name == "mqar":
            return mqar_batch(generator, size, length, self.mqar_pairs, self.mqar_queries, self.mqar_vocab)
        if self.name == "copy":
            return copy_batch(generator, size, length)
        if self.name == "passkey":
            return passkey_batch(generator, size, length, self.passkey[split], self.passkey_digits, depth)
        raise ValueError(f"unknown task {self.name!r}; valid: {', '.join(TASK_NAMES)}")

    def describe(self) -> str:
        """The task and its settings, in words (the report's heading)."""
        if self.name == "mqar":
            return (
                f"mqar: multi-query associative recall, {self.mqar_pairs} key-value pairs, {self.mqar_queries} "
                f"queries, {self.mqar_vocab} key and value bytes; accuracy per query"
            )
        if self.name == "copy":
            return "copy: a string of letters, the separator, the string again; accuracy per copied letter"
        return f"passkey: a {self.passkey_digits}-digit key hidden in filler text; accuracy per key (every digit)"


def passkey_texts(tokenizer, text_file: Path | None = None, held_out_percentage: int = 5) -> dict[str, PasskeyText]:
    """Passkey's filler for training (``"train"``: the lines after the first ``held_out_percentage`` %) and for
    scoring (``"eval"``: those first lines, the part the pretraining recipe holds out), from ``text_file`` or the
    embedded corpus, as ``tokenizer``'s ids."""
    lines = Path(text_file or embedded_corpus_file()).read_text().splitlines(keepends=True)
    cut = len(lines) * held_out_percentage // 100

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return {
        split: PasskeyText(torch.tensor(encode("".join(part)), dtype=torch.long), encode)
        for split, part in (("train", lines[cut:]), ("eval", lines[:cut]))
    }


EVALUATION_STREAM = 1
"""The scored examples' draws are :func:`hf_posenc_recipes.pretrain.batch_generator` ``(seed, 1, ...)``, the
training batches' ``(seed, 0, step, process)``: never the same examples."""


@torch.no_grad()
def task_accuracy(
    model, task: TaskSpec, length: int, examples: int, batch_size: int, seed: int, depth: float | None = None
) -> float:
    """The accuracy (:func:`answer_accuracy`) of ``model`` on ``examples`` examples of ``length`` tokens drawn from
    ``seed`` (the same examples for every model and batch size), passkey's needle at ``depth`` of held-out filler."""
    device = next(model.parameters()).device
    depth_index = 0 if depth is None else 1 + round(depth * 10**6)
    batch = task.batch(batch_generator(seed, EVALUATION_STREAM, length, depth_index), examples, length, "eval", depth)
    right = total = 0
    for first in range(0, examples, batch_size):
        logits = model(input_ids=batch.input_ids[first : first + batch_size].to(device)).logits
        labels = batch.labels[first : first + batch_size]
        batch_right, batch_total = answer_accuracy(logits.cpu(), labels, batch.per_example)
        right, total = right + batch_right, total + batch_total
    return right / total


def task_row(
    model, task: TaskSpec, train_length: int, factors: Sequence[int], examples: int, batch_size: int, seed: int,
    depths: Sequence[float] = DEFAULT_DEPTHS,
) -> dict:  # fmt: skip
    """``{"accuracy": {"1x": accuracy or the reason the model cannot run at that length, ...}}`` and for passkey
    ``"by_depth": {"1x": {"0.25": accuracy, ...}, ...}``, where ``"1x"`` is the mean over the depths."""
    row: dict = {"accuracy": {}}
    if task.name == "passkey":
        row["by_depth"] = {}
    for factor in factors:
        length = factor * train_length
        try:
            if task.name != "passkey":
                row["accuracy"][f"{factor}x"] = task_accuracy(model, task, length, examples, batch_size, seed)
                continue
            by_depth = {
                str(depth): task_accuracy(model, task, length, examples, batch_size, seed, depth) for depth in depths
            }
            row["by_depth"][f"{factor}x"] = by_depth
            row["accuracy"][f"{factor}x"] = sum(by_depth.values()) / len(by_depth)
        except ValueError as error:  # e.g. a learned table shorter than the window: the model says why
            row["accuracy"][f"{factor}x"] = str(error).split(". ")[0].rstrip(".")
            if task.name == "passkey":
                row["by_depth"][f"{factor}x"] = row["accuracy"][f"{factor}x"]
    return row
