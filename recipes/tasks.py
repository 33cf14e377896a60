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
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_posenc_recipes.parsers.tasks import (
    COPY_DEFAULTS,
    COPY_LAYOUTS,
    COPY_MAX_SYMBOLS,
    COPY_PROMPT,
    check_mqar,
    copy_block_size,
)
from hf_posenc_recipes.pretrain import IGNORE_INDEX, batch_generator, embedded_corpus_file, randomized_position_ids


TASK_NAMES = ("mqar", "copy", "passkey")
BYTE_OFFSET = 3
"""The byte tokenizer's id of byte ``b`` is ``b + BYTE_OFFSET`` (ByT5's ids: 0 pad, 1 eos, 2 unk, then the bytes)."""
COPY_ALPHABET = b"abcdefghijklmnopqrstuvwxyz"
COPY_SEPARATOR = b"|"[0]
COPY_SYMBOLS = (
    string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation.replace("|", "")
).encode() + bytes(range(128, 256))
"""The symbols of ``copy``'s ``kazemnejad`` layout, in the order ``--copy_symbols k`` takes the first ``k`` of: a-z,
A-Z, 0-9, the printable punctuation but the separator ``|``, then the bytes above ASCII (the paper's first 100 tokens
are likewise ASCII characters then other single tokens of T5's vocabulary)."""
END_OF_SEQUENCE = 1
"""The byte tokenizer's end-of-sequence id (ByT5's ``</s>``)."""
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


def copy_kazemnejad_lengths(max_length: int, factor: int) -> tuple[int, int]:
    """The string lengths ``(shortest, longest)`` of ``copy``'s ``kazemnejad`` layout at ``factor`` times the training
    length, L = ``max_length``: ``1 .. L`` at 1x (training and its accuracy), the integers of ``((f / 2) L, f L]``
    at ``f > 1``: 2x is the paper's test set (21..40 at L = 20), 4x 41..80, 8x 81..160."""
    if factor < 1:
        raise ValueError(f"copy: the length factor must be >= 1, got {factor}")
    return (1 if factor == 1 else factor * max_length // 2 + 1), factor * max_length


def copy_kazemnejad_batch(
    generator: torch.Generator, batch_size: int, length: int, max_length: int = 20, symbols: int = 100,
    repeat: bool = False,
) -> TaskBatch:  # fmt: skip
    """Copying in the form of Kazemnejad et al. 2023 (McGill-NLP/length-generalization, decoder-only ``s2s_copy``):
    the prompt ``Copy: ``, a string of ``n`` symbols, the separator ``|``, the string again and the end-of-sequence
    token (:data:`END_OF_SEQUENCE`), right-padded with the pad token (0) to ``length``; the labels are the copy and
    the end token (the answers), the prompt, the string and the padding ignored. Scored per example: right when every
    answer is (:func:`answer_accuracy`). Each symbol is one token, with no spaces between them: the paper writes
    ``"Copy: x1 x2 ... xn [SEP] x1 ... xn"`` but its T5 tokenizer folds each space into the next token (``▁x``), so
    a symbol takes one position and a space none; a byte model spelling the spaces would double every distance and
    make every other answer a free space. The paper's prompt and ``[SEP] `` are a few T5 tokens each; here 6 bytes
    and 1.

    ``symbols``: the first that many of :data:`COPY_SYMBOLS` (the paper's cmc: 100 tokens); each symbol of the
    string drawn uniformly (cmc, "copy multi char"), or with ``repeat`` one symbol drawn uniformly and repeated ``n``
    times (rsc, "repeat single char": the model must count). ``length`` must be a multiple ``f`` of the training
    block ``2 max_length + 8`` (:func:`~hf_posenc_recipes.parsers.tasks.copy_block_size`, the longest row at
    ``n = max_length``); the strings' lengths are :func:`copy_kazemnejad_lengths` ``(max_length, f)``, balanced over
    the batch as the paper's equal bins of each length: row ``i`` has the ``(s + i) mod span``-th length, ``s``
    drawn uniformly."""
    block = copy_block_size(max_length)
    if length < block or length % block:
        raise ValueError(
            f"copy, kazemnejad layout: the length must be a multiple of the training block 2 x {max_length} + 8 = "
            f"{block} (--copy_max_length {max_length}), got {length}"
        )
    if not 1 <= symbols <= COPY_MAX_SYMBOLS:
        raise ValueError(f"copy: --copy_symbols must be in 1..{COPY_MAX_SYMBOLS}, got {symbols}")
    shortest, longest = copy_kazemnejad_lengths(max_length, length // block)
    span = longest - shortest + 1
    start = int(torch.randint(span, (), generator=generator))
    sizes = shortest + (start + torch.arange(batch_size)) % span
    alphabet = byte_ids(COPY_SYMBOLS[:symbols])
    drawn = torch.randint(symbols, (batch_size, 1 if repeat else longest), generator=generator)
    strings = alphabet[drawn.expand(batch_size, longest)]
    prompt = byte_ids(COPY_PROMPT)
    rows = torch.zeros((batch_size, length), dtype=torch.long)
    labels = torch.full((batch_size, length), IGNORE_INDEX, dtype=torch.long)
    separator = torch.tensor([COPY_SEPARATOR + BYTE_OFFSET])
    end = torch.tensor([END_OF_SEQUENCE])
    for row, row_labels, string_ids, size in zip(rows, labels, strings, sizes.tolist(), strict=True):
        text = string_ids[:size]
        answers = torch.cat([text, end])
        example = torch.cat([prompt, text, separator, answers])
        row[: len(example)] = example
        row_labels[len(example) - len(answers) : len(example)] = answers
    return TaskBatch(rows, labels, per_example=True)


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
    copy_layout: str = "fixed"
    copy_max_length: int = COPY_DEFAULTS["copy_max_length"]
    copy_symbols: int = COPY_DEFAULTS["copy_symbols"]
    copy_repeat: bool = False

    @classmethod
    def from_flags(cls, args: argparse.Namespace, passkey: dict[str, PasskeyText] | None = None) -> TaskSpec:
        """The task of ``--task`` and its settings' flags (copy's not given: :data:`COPY_DEFAULTS`)."""
        return cls(
            args.task, args.mqar_pairs, args.mqar_queries, args.mqar_key_vocab, args.mqar_value_vocab,
            args.mqar_layout, args.mqar_power_a, args.passkey_digits, passkey, args.copy_layout,
            args.copy_max_length or COPY_DEFAULTS["copy_max_length"],
            args.copy_symbols or COPY_DEFAULTS["copy_symbols"], args.copy_repeat,
        )  # fmt: skip

    @property
    def kazemnejad(self) -> bool:
        """``copy`` in Kazemnejad et al.'s layout (:func:`copy_kazemnejad_batch`)."""
        return self.name == "copy" and self.copy_layout == "kazemnejad"

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
            if self.copy_layout not in COPY_LAYOUTS:
                raise ValueError(f"--copy_layout must be one of {', '.join(COPY_LAYOUTS)}, got {self.copy_layout!r}")
            if self.kazemnejad:
                return copy_kazemnejad_batch(
                    generator, size, length, self.copy_max_length, self.copy_symbols, self.copy_repeat
                )
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
        if self.kazemnejad:
            return {
                "task": "copy", "layout": "kazemnejad", "max_length": self.copy_max_length,
                "symbols": self.copy_symbols, "repeat": self.copy_repeat,
            }  # fmt: skip
        return {"task": self.name}  # copy's fixed layout: the settings of the runs before --copy_layout

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
        if self.kazemnejad:
            variant = (
                f"one of {self.copy_symbols} symbols repeated n times (rsc)"
                if self.copy_repeat
                else f"n symbols drawn from {self.copy_symbols} (cmc)"
            )
            top = self.copy_max_length
            return (
                f"copy, layout kazemnejad (Kazemnejad et al. 2023): 'Copy: ', {variant}, the separator, the string "
                f"again, the end token; n in 1..{top} at 1x, ((f/2) x {top}, f x {top}] at fx "
                f"(2x: {top + 1}..{2 * top}, the paper's test set); accuracy per example (exact match of the copy and "
                "the end token)"
            )
        if self.name == "copy":
            return (
                "copy, layout fixed: a string of letters, the separator, the string again; accuracy per copied letter"
            )
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
