"""The long-context tasks of ``compare --task`` and ``extrapolate --task``: multi-query associative recall (``mqar``),
copying (``copy``) and a passkey hidden in filler text (``passkey``), each drawn from a seed so that every scheme sees
the same examples, and the accuracy that scores them.

Every example is a row of token ids with a row of labels in Transformers' causal-LM convention: ``labels[t]`` is
the answer token the model must give after reading ``input_ids[:t]``, ``IGNORE_INDEX`` where there is none, so
``model(input_ids, labels=labels)`` trains on the answers alone (as Zoology does) and a model is scored on
predicting each answer from the tokens before it. ``copy``, ``passkey`` and ``mqar``'s ``visible_answers`` layout
also write the answer into the input (``labels[t] == input_ids[t]``); Zoology's ``mqar`` layout does not.
``mqar`` and ``copy`` are written in bytes with the byte tokenizer's ids (``byte + 3``,
:func:`hf_posenc_recipes.pretrain.byte_tokenizer`); ``passkey`` is text, encoded by the model's own tokenizer.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_posenc_recipes.parsers.tasks import check_mqar
from hf_posenc_recipes.pretrain import IGNORE_INDEX, batch_generator, embedded_corpus_file, randomized_position_ids


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
    key_vocab: int = 32, value_vocab: int = 32, layout: str = "zoology", power_a: float = 0.01,
) -> TaskBatch:  # fmt: skip
    """Multi-query associative recall (Arora et al. 2023, Zoology's ``multiquery_ar``): ``num_pairs`` key-value pairs
    ``k_1 v_1 k_2 v_2 ...`` open the row, keys distinct bytes of ``[0, key_vocab)``, values distinct bytes of
    ``[key_vocab, key_vocab + value_vocab)``; then ``num_queries`` distinct keys come back at even offsets ``2 g`` of
    the rest of the row, and the model is asked, at each, for its key's value. Scored per answer.

    ``layout="zoology"`` (Zoology's): the gaps ``g`` are drawn without replacement from ``0 .. S - 1`` (``S`` the
    slots after the pairs) with ``P(g) ∝ (g + 1) ** (power_a - 1)`` (a power law: most queries right after the
    pairs; ``power_a=1``: uniform); the answer is a label only (the token after the query is filler), so no query
    sees another's answer; every other position is a byte of the task's vocabulary ``[0, key_vocab + value_vocab)``
    drawn uniformly (Zoology's ``random_non_queries``, which may repeat a key or value). ``layout="visible_answers"``:
    the gaps uniform, each query followed by its value in the input (later queries see earlier answers), the filler
    bytes of ``[key_vocab + value_vocab, 256)``."""
    check_mqar(length, num_pairs, num_queries, key_vocab, value_vocab, layout, power_a)
    context = 2 * num_pairs
    slots = (length - context) // 2
    vocab = key_vocab + value_vocab
    zoology = layout == "zoology"
    low = 0 if zoology else vocab
    rows = torch.randint(low, vocab if zoology else 256, (batch_size, length), generator=generator)
    labels = torch.full((batch_size, length), IGNORE_INDEX, dtype=torch.long)
    weights = torch.arange(1, slots + 1, dtype=torch.float64) ** (power_a - 1) if zoology else torch.ones(slots)
    for row, row_labels in zip(rows, labels, strict=True):
        keys = torch.randperm(key_vocab, generator=generator)[:num_pairs]
        values = key_vocab + torch.randperm(value_vocab, generator=generator)[:num_pairs]
        row[0:context:2], row[1:context:2] = keys, values
        asked = torch.randperm(num_pairs, generator=generator)[:num_queries]
        places = context + 2 * torch.multinomial(weights, num_queries, replacement=False, generator=generator)
        row[places] = keys[asked]
        if not zoology:
            row[places + 1] = values[asked]
        row_labels[places + 1] = values[asked] + BYTE_OFFSET
    return TaskBatch(rows + BYTE_OFFSET, labels)


def mqar_baselines(num_pairs: int, num_queries: int, value_vocab: int, layout: str) -> dict[str, float]:
    """The accuracy of guessers that never bind a key to its value, per answer: ``"a value of the vocabulary"``
    (``1 / value_vocab``) and ``"a value of the example"``: uniform over the example's values, ``1 / num_pairs``;
    under ``visible_answers`` over those not yet shown as an answer, which the ``i``-th query (``i = 0, 1, ...``)
    leaves ``num_pairs - i`` of: ``mean_i 1 / (num_pairs - i)`` (0.521 at 4 pairs, 4 queries)."""
    if layout == "zoology":
        example = 1 / num_pairs
    else:
        example = sum(1 / (num_pairs - index) for index in range(num_queries)) / num_queries
    return {"a value of the vocabulary": 1 / value_vocab, "a value of the example": example}


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
    mqar_key_vocab: int = 32
    mqar_value_vocab: int = 32
    mqar_layout: str = "zoology"
    mqar_power_a: float = 0.01
    passkey_digits: int = 5
    passkey: dict[str, PasskeyText] | None = None

    @classmethod
    def from_flags(cls, args: argparse.Namespace, passkey: dict[str, PasskeyText] | None = None) -> TaskSpec:
        """The task of ``--task`` and its settings' flags."""
        return cls(
            args.task, args.mqar_pairs, args.mqar_queries, args.mqar_key_vocab, args.mqar_value_vocab,
            args.mqar_layout, args.mqar_power_a, args.passkey_digits, passkey,
        )  # fmt: skip

    def batch(
        self, generator: torch.Generator, size: int, length: int, split: str = "train", depth: float | None = None
    ) -> TaskBatch:
        """``size`` examples of ``length`` tokens; passkey's filler from ``split``, its needle at ``depth``."""
        if self.name == "mqar":
            return mqar_batch(
                generator, size, length, self.mqar_pairs, self.mqar_queries, self.mqar_key_vocab,
                self.mqar_value_vocab, self.mqar_layout, self.mqar_power_a,
            )  # fmt: skip
        if self.name == "copy":
            return copy_batch(generator, size, length)
        if self.name == "passkey":
            return passkey_batch(generator, size, length, self.passkey[split], self.passkey_digits, depth)
        raise ValueError(f"unknown task {self.name!r}; valid: {', '.join(TASK_NAMES)}")

    def baselines(self) -> dict[str, float]:
        """The accuracy of guessers that never bind a key to its value (:func:`mqar_baselines`); none for the other
        tasks."""
        if self.name != "mqar":
            return {}
        return mqar_baselines(self.mqar_pairs, self.mqar_queries, self.mqar_value_vocab, self.mqar_layout)

    def settings(self) -> dict[str, Any]:
        """What a task model was trained on, kept in its ``training_args.json``."""
        if self.name == "mqar":
            return {
                "task": "mqar", "pairs": self.mqar_pairs, "queries": self.mqar_queries,
                "key_vocab": self.mqar_key_vocab, "value_vocab": self.mqar_value_vocab, "layout": self.mqar_layout,
                "power_a": self.mqar_power_a,
            }  # fmt: skip
        if self.name == "passkey":
            return {"task": "passkey", "digits": self.passkey_digits}
        return {"task": self.name}

    def passkey_filler(self, length: int) -> tuple[int, int]:
        """``(needle, question and key, filler)`` in tokens of a passkey example of ``length`` tokens (a key of
        ``passkey_digits`` nines: with the byte tokenizer every key takes as many)."""
        encode = self.passkey["eval"].encode
        key = "9" * self.passkey_digits
        fixed = len(encode(PASSKEY_NEEDLE.format(key=key))) + len(encode(PASSKEY_QUESTION)) + len(encode(key))
        return fixed, length - fixed

    def describe(self) -> str:
        """The task and its settings, in words (the report's heading)."""
        if self.name == "mqar":
            where = (
                f"Zoology's layout (answers hidden, queries placed by a power law, a = {self.mqar_power_a:g})"
                if self.mqar_layout == "zoology"
                else "answers visible to later queries, queries placed uniformly"
            )
            return (
                f"mqar: multi-query associative recall, {self.mqar_pairs} key-value pairs, {self.mqar_queries} "
                f"queries, {self.mqar_key_vocab} keys and {self.mqar_value_vocab} values, {where}; accuracy per query"
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
    model, task: TaskSpec, length: int, examples: int, batch_size: int, seed: int, depth: float | None = None,
    randomized_positions: int | None = None,
) -> float:  # fmt: skip
    """The accuracy (:func:`answer_accuracy`) of ``model`` on ``examples`` examples of ``length`` tokens drawn from
    ``seed`` (the same examples for every model and batch size), passkey's needle at ``depth`` of held-out filler;
    with ``randomized_positions`` (a model trained with them) the position ids of
    :func:`~hf_posenc_recipes.pretrain.randomized_position_ids`, one draw for all the examples."""
    device = next(model.parameters()).device
    depth_index = 0 if depth is None else 1 + round(depth * 10**6)
    generator = batch_generator(seed, EVALUATION_STREAM, length, depth_index)
    batch = task.batch(generator, examples, length, "eval", depth)
    inputs = {"input_ids": batch.input_ids}
    if randomized_positions is not None:
        inputs["position_ids"] = randomized_position_ids(generator, examples, length, randomized_positions)
    right = total = 0
    for first in range(0, examples, batch_size):
        logits = model(**{key: value[first : first + batch_size].to(device) for key, value in inputs.items()}).logits
        labels = batch.labels[first : first + batch_size]
        batch_right, batch_total = answer_accuracy(logits.cpu(), labels, batch.per_example)
        right, total = right + batch_right, total + batch_total
    return right / total


def task_row(
    model, task: TaskSpec, train_length: int, factors: Sequence[int], examples: int, batch_size: int, seed: int,
    depths: Sequence[float] = DEFAULT_DEPTHS, randomized_positions: int | None = None,
) -> dict:  # fmt: skip
    """``{"accuracy": {"1x": accuracy or the reason the model cannot run at that length, ...}}`` and for passkey
    ``"by_depth": {"1x": {"0.25": accuracy, ...}, ...}``, where ``"1x"`` is the mean over the depths; with
    ``randomized_positions`` every length draws its position ids (:func:`task_accuracy`)."""
    row: dict = {"accuracy": {}}
    if task.name == "passkey":
        row["by_depth"] = {}
    for factor in factors:
        length = factor * train_length
        try:
            if task.name != "passkey":
                row["accuracy"][f"{factor}x"] = task_accuracy(
                    model, task, length, examples, batch_size, seed, randomized_positions=randomized_positions
                )
                continue
            by_depth = {
                str(depth): task_accuracy(model, task, length, examples, batch_size, seed, depth, randomized_positions)
                for depth in depths
            }
            row["by_depth"][f"{factor}x"] = by_depth
            row["accuracy"][f"{factor}x"] = sum(by_depth.values()) / len(by_depth)
        except ValueError as error:  # e.g. a learned table shorter than the window: the model says why
            row["accuracy"][f"{factor}x"] = str(error).split(". ")[0].rstrip(".")
            if task.name == "passkey":
                row["by_depth"][f"{factor}x"] = row["accuracy"][f"{factor}x"]
    return row
