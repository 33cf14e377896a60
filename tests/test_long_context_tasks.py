"""The long-context tasks (``hf_posenc_recipes.tasks``: mqar, copy, passkey), their accuracy metric, ``compare
--task`` end to end, ``extrapolate``'s task scores and loss by position, and RULER's offline tasks through lm-eval.

Generators are checked against examples built by hand from the format (the answer positions, the filler, the query
format); the metric against an oracle that is right by construction and models that are wrong; the loss by position
against the cross-entropy computed position by position with ``math``."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import hf_posenc
from hf_posenc_recipes import compare, extrapolate, long_context, reporting
from hf_posenc_recipes.parsers.compare import TASK_DEFAULT_FLAGS, compare_parser, default_text
from hf_posenc_recipes.parsers.tasks import PASSKEY_NEEDLE_BYTES, PASSKEY_QUESTION_BYTES, TASK_TRAINING_DEFAULTS
from hf_posenc_recipes.pretrain import IGNORE_INDEX, byte_tokenizer
from hf_posenc_recipes.tasks import (
    BYTE_OFFSET,
    COPY_SYMBOLS,
    END_OF_SEQUENCE,
    PasskeyText,
    TaskSpec,
    answer_accuracy,
    copy_batch,
    copy_kazemnejad_batch,
    copy_kazemnejad_lengths,
    mqar_baselines,
    mqar_batch,
    passkey_batch,
    passkey_texts,
    task_accuracy,
    task_row,
)


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def as_bytes(ids: torch.Tensor) -> list[int]:
    return [int(token) - BYTE_OFFSET for token in ids]


# --- mqar ---


def test_mqar_smallest_example_in_zoologys_layout_hides_its_answers():
    """2 keys, 2 values, 2 pairs, 2 queries, length 8: ``ka va kb vb kx f ky f`` with {ka, kb} = {0, 1},
    {va, vb} = {2, 3}, both query slots asked (the queries are the keys again, in any order); the labels are the
    values at positions 5 and 7, but the input there is filler drawn from the 4 bytes of the task, so it is the answer
    only by chance."""
    batch = mqar_batch(generator(), 256, 8, num_pairs=2, num_queries=2, key_vocab=2, value_vocab=2)
    shown = 0
    for row, labels in zip(batch.input_ids, batch.labels, strict=True):
        ka, va, kb, vb, kx, fx, ky, fy = as_bytes(row)
        assert {ka, kb} == {0, 1} and {va, vb} == {2, 3} and {kx, ky} == {0, 1}
        assert {fx, fy} <= {0, 1, 2, 3}
        pairs = {ka: va, kb: vb}
        expected = [IGNORE_INDEX] * 8
        expected[5], expected[7] = pairs[kx] + BYTE_OFFSET, pairs[ky] + BYTE_OFFSET
        assert labels.tolist() == expected
        shown += (fx == pairs[kx]) + (fy == pairs[ky])
    assert 0.15 < shown / 512 < 0.35  # a uniform filler byte of 4 is the answer a quarter of the time


def test_mqar_zoology_query_gaps_follow_the_power_law():
    """One pair, one query, 10 slots after it: the query's gap g (its offset / 2) has ``P(g) = (g + 1) ** (a - 1) /
    sum_k k ** (a - 1)``, computed here with ``math``; a = 1 is uniform. Frequencies over 4000 rows within 4.5
    standard errors."""
    for power_a in (0.01, 1.0):
        batch = mqar_batch(generator(7), 4000, 22, num_pairs=1, num_queries=1, power_a=power_a)
        gaps = ((batch.labels != IGNORE_INDEX).float().argmax(-1) - 3) // 2
        weights = [k ** (power_a - 1) for k in range(1, 11)]
        for gap in range(10):
            p = weights[gap] / sum(weights)
            assert abs(float((gaps == gap).float().mean()) - p) < 4.5 * math.sqrt(p * (1 - p) / 4000) + 1e-9


def test_mqar_zoology_queries_are_distinct_keys_at_even_offsets_and_the_filler_spans_the_task_vocabulary():
    batch = mqar_batch(generator(1), 64, 40, num_pairs=8, num_queries=5, key_vocab=16, value_vocab=16)
    seen = set()
    for row, labels in zip(batch.input_ids, batch.labels, strict=True):
        data = as_bytes(row)
        keys, values = data[0:16:2], data[1:16:2]
        assert len(set(keys)) == 8 and all(0 <= key < 16 for key in keys)
        assert len(set(values)) == 8 and all(16 <= value < 32 for value in values)
        answers = [place for place in range(40) if labels[place] != IGNORE_INDEX]
        queries = [place - 1 for place in answers]
        assert len(answers) == 5 and all((place - 16) % 2 == 0 for place in queries)
        assert len({data[place] for place in queries}) == 5 and {data[place] for place in queries} <= set(keys)
        pairs = dict(zip(keys, values, strict=True))
        assert [int(labels[place]) - BYTE_OFFSET for place in answers] == [pairs[data[place]] for place in queries]
        seen.update(data[16:])
    assert seen == set(range(32))  # Zoology's filler: any byte of the task's vocabulary


def test_mqar_visible_answers_layout_writes_each_answer_after_its_query():
    """8 pairs, 3 queries, 16 keys and 16 values, length 40: after the 16 context tokens, 3 keys come back at even
    offsets, each followed by its value (the only labels); every other byte is filler, of [32, 256)."""
    batch = mqar_batch(
        generator(1), 32, 40, num_pairs=8, num_queries=3, key_vocab=16, value_vocab=16, layout="visible_answers"
    )
    fillers = set()
    for row, labels in zip(batch.input_ids, batch.labels, strict=True):
        data = as_bytes(row)
        keys, values = data[0:16:2], data[1:16:2]
        pairs = dict(zip(keys, values, strict=True))
        queries = [place for place in range(16, 40) if data[place] < 16]
        assert len(queries) == 3 and len({data[place] for place in queries}) == 3
        assert all((place - 16) % 2 == 0 for place in queries)
        answers = [place + 1 for place in queries]
        assert [data[place] for place in answers] == [pairs[data[place]] for place in queries]
        assert [place for place in range(40) if labels[place] != IGNORE_INDEX] == answers
        assert all(labels[place] == row[place] for place in answers)
        rest = [data[place] for place in range(16, 40) if place not in queries and place not in answers]
        assert all(32 <= byte < 256 for byte in rest)
        fillers.update(rest)
    assert len(fillers) > 150  # drawn over the whole filler range


def test_mqar_no_binding_baselines_against_closed_forms_and_a_simulated_guesser():
    """A guesser that never binds: uniform over the example's values (Zoology's layout: 1/4 at 4 pairs), or over
    those not yet shown as an earlier query's answer (visible answers: (1/4 + 1/3 + 1/2 + 1) / 4 = 25/48); simulated
    on 3 pairs, 2 queries ((1/3 + 1/2) / 2 = 5/12) by reading the rows and drawing its guesses."""
    assert mqar_baselines(4, 4, 32, "zoology") == {"a value of the vocabulary": 1 / 32, "a value of the example": 0.25}
    assert mqar_baselines(4, 4, 32, "visible_answers")["a value of the example"] == pytest.approx(25 / 48)
    assert mqar_baselines(3, 2, 8, "visible_answers")["a value of the example"] == pytest.approx(5 / 12)
    batch = mqar_batch(generator(3), 3000, 16, num_pairs=3, num_queries=2, layout="visible_answers")
    draws, right, total = generator(4), 0, 0
    for row, labels in zip(batch.input_ids.tolist(), batch.labels.tolist(), strict=True):
        shown = set()
        for place in (place for place in range(16) if labels[place] != IGNORE_INDEX):
            candidates = sorted(set(row[1:6:2]) - shown)
            guess = candidates[int(torch.randint(len(candidates), (1,), generator=draws))]
            right, total = right + (guess == labels[place]), total + 1
            shown.add(row[place])
    assert abs(right / total - 5 / 12) < 4 * math.sqrt(5 / 12 * 7 / 12 / total)


def test_mqar_is_the_same_for_the_same_seed_and_refuses_what_cannot_fit():
    first, again = mqar_batch(generator(5), 4, 64), mqar_batch(generator(5), 4, 64)
    assert torch.equal(first.input_ids, again.input_ids) and torch.equal(first.labels, again.labels)
    with pytest.raises(ValueError, match="--mqar_pairs 8 and --mqar_queries 8 take 32 tokens"):
        mqar_batch(generator(), 1, 30, num_pairs=8, num_queries=8)
    with pytest.raises(ValueError, match="together at most 255 bytes"):
        mqar_batch(generator(), 1, 64, key_vocab=128, value_vocab=128, layout="visible_answers")
    with pytest.raises(ValueError, match=r"--mqar_pairs must be in 1..3"):
        mqar_batch(generator(), 1, 64, num_pairs=4, value_vocab=3)
    with pytest.raises(ValueError, match=r"--mqar_queries must be in 1..4"):
        mqar_batch(generator(), 1, 64, num_pairs=4, num_queries=5)
    with pytest.raises(ValueError, match="--mqar_layout must be one of zoology, visible_answers, got 'uniform'"):
        mqar_batch(generator(), 1, 64, layout="uniform")
    with pytest.raises(ValueError, match="--mqar_power_a must be > 0"):
        mqar_batch(generator(), 1, 64, power_a=0.0)


# --- copy ---


@pytest.mark.parametrize("length", [7, 8])
def test_copy_is_a_string_the_separator_and_the_string_again(length):
    """``n = (length - 1) // 2`` letters, ``|``, the same letters (the answers), and a pad where the length is even."""
    batch = copy_batch(generator(2), 8, length)
    size = (length - 1) // 2
    assert batch.input_ids.shape == (8, length)
    for row, labels in zip(batch.input_ids, batch.labels, strict=True):
        text = bytes(as_bytes(row[: 2 * size + 1])).decode()
        letters, separator, copied = text[:size], text[size], text[size + 1 :]
        assert separator == "|" and copied == letters and set(letters) <= set("abcdefghijklmnopqrstuvwxyz")
        assert row[2 * size + 1 :].tolist() == [0] * (length - 2 * size - 1)  # the tokenizer's pad
        assert labels.tolist() == [IGNORE_INDEX] * (size + 1) + row[size + 1 : 2 * size + 1].tolist() + [
            IGNORE_INDEX
        ] * (length - 2 * size - 1)


def test_copy_fixed_layout_is_todays_batch_and_settings():
    """``--copy_layout fixed`` (the default) draws exactly copy_batch's rows and keeps the settings of earlier runs."""
    task = TaskSpec("copy")
    drawn, expected = task.batch(generator(5), 4, 9), copy_batch(generator(5), 4, 9)
    assert torch.equal(drawn.input_ids, expected.input_ids) and torch.equal(drawn.labels, expected.labels)
    assert not drawn.per_example and task.settings() == {"task": "copy"}
    assert "layout fixed" in task.describe()


@pytest.mark.parametrize("repeat", [False, True])
def test_copy_kazemnejad_smallest_rows_by_hand(repeat):
    """One symbol (``a``), L = 1: the block is 2 x 1 + 8 = 10 and the only row at 1x is ``Copy: a|a</s>``; at 2x
    (20 tokens) the strings have length 2: ``Copy: aa|aa</s>`` then 8 pads. The labels: the copy and the end token."""
    for length, expected, size in ((10, b"Copy: a|a", 1), (20, b"Copy: aa|aa", 2)):
        batch = copy_kazemnejad_batch(generator(), 3, length, max_length=1, symbols=1, repeat=repeat)
        row = [b + BYTE_OFFSET for b in expected] + [END_OF_SEQUENCE] + [0] * (length - len(expected) - 1)
        answers = [b + BYTE_OFFSET for b in expected[-size:]] + [END_OF_SEQUENCE]
        labels = [IGNORE_INDEX] * (len(expected) - size) + answers + [IGNORE_INDEX] * (length - len(expected) - 1)
        assert batch.per_example
        assert batch.input_ids.tolist() == [row] * 3 and batch.labels.tolist() == [labels] * 3


def parse_kazemnejad_row(row: torch.Tensor) -> tuple[bytes, bytes, int]:
    """``(string, copy, pads)`` of a kazemnejad row, checking the prompt, the separator and the end token."""
    ids = row.tolist()
    end = ids.index(END_OF_SEQUENCE)
    assert ids[end + 1 :] == [0] * (len(ids) - end - 1)
    text = bytes(b - BYTE_OFFSET for b in ids[:end])
    assert text.startswith(b"Copy: ")
    size = (len(text) - 7) // 2
    assert text[6 + size : 7 + size] == b"|"
    return text[6 : 6 + size], text[7 + size :], len(ids) - end - 1


@pytest.mark.parametrize("repeat", [False, True])
def test_copy_kazemnejad_rows_reconstructed_at_each_factor(repeat):
    """L = 5 (block 18), 7 symbols: at factor f the row holds f x 18 tokens, ``Copy: `` + a string + ``|`` + the same
    string + the end token, the labels exactly the copy and the end; the lengths are 1..5 at 1x, 6..10 at 2x,
    11..20 at 4x, 21..40 at 8x, each equally often over a batch of a multiple of their number; cmc strings draw from
    the first 7 symbols (several per row), rsc rows repeat one symbol."""
    assert [copy_kazemnejad_lengths(20, f) for f in (1, 2, 4, 8)] == [(1, 20), (21, 40), (41, 80), (81, 160)]
    assert copy_kazemnejad_lengths(5, 3) == (8, 15)  # ((3/2) 5, 15]
    symbols = set(COPY_SYMBOLS[:7])
    assert COPY_SYMBOLS[:7] == b"abcdefg" and len(COPY_SYMBOLS) == 221 and b"|"[0] not in COPY_SYMBOLS
    for factor, (shortest, longest) in ((1, (1, 5)), (2, (6, 10)), (4, (11, 20)), (8, (21, 40))):
        span = longest - shortest + 1
        batch = copy_kazemnejad_batch(generator(factor), 3 * span, factor * 18, 5, 7, repeat)
        assert batch.input_ids.shape == (3 * span, factor * 18)
        sizes = []
        for row, labels in zip(batch.input_ids, batch.labels, strict=True):
            string, copied, pads = parse_kazemnejad_row(row)
            assert copied == string and set(string) <= symbols and shortest <= len(string) <= longest
            assert len(set(string)) == 1 if repeat else len(string) < 4 or len(set(string)) > 1
            answers = len(string) + 1
            start = factor * 18 - pads - answers
            assert (labels[start : -pads or None] == row[start : -pads or None]).all()
            assert (labels[:start] == IGNORE_INDEX).all() and (labels[factor * 18 - pads :] == IGNORE_INDEX).all()
            sizes.append(len(string))
        assert sorted(sizes) == sorted(list(range(shortest, longest + 1)) * 3)
    with pytest.raises(ValueError, match="multiple of the training block 2 x 5 \\+ 8 = 18"):
        copy_kazemnejad_batch(generator(), 2, 20, 5, 7)


class CopySolver(torch.nn.Module):
    """Solves kazemnejad copy rows from the tokens before each answer, but only the first ``limit`` symbols of the
    copy: after the separator, the symbol as many places after the prompt (beyond ``limit`` a pad), then the end
    token once the separator's place is reached."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids: torch.Tensor):
        following = torch.zeros_like(input_ids)
        separator = b"|"[0] + BYTE_OFFSET
        for row, ids in enumerate(input_ids.tolist()):
            place = ids.index(separator)
            for t in range(place, len(ids)):
                index = t - place
                source = 6 + index
                if source == place:
                    following[row, t] = END_OF_SEQUENCE
                elif index < self.limit and source < place:
                    following[row, t] = ids[source]
        return argparse.Namespace(logits=torch.nn.functional.one_hot(following, 384).float())


def greedy_exact_match(model, batch) -> list[bool]:
    """Greedy decoding of each row from its prompt (up to the separator): the generated tokens, up to and with the
    first end token, against the row's answers."""
    right = []
    for row, labels in zip(batch.input_ids, batch.labels, strict=True):
        answers = row[labels != IGNORE_INDEX].tolist()
        ids = row[: int((labels != IGNORE_INDEX).nonzero()[0])].tolist()
        generated = []
        while len(generated) < len(row) and (not generated or generated[-1] != END_OF_SEQUENCE):
            token = int(model(torch.tensor([ids + [0]])).logits[0, len(ids) - 1].argmax())
            generated.append(token)
            ids.append(token)
        right.append(generated == answers)
    return right


def test_copy_kazemnejad_exact_match_per_example_by_hand():
    """Per example: a model right on every answer of a row but one gets that row wrong; teacher-forced argmax at
    every answer is greedy decoding's exact match (a solver copying only 3 symbols: right on strings of 1..3 and
    wrong beyond, both ways); scored through task_row at 1x, 2x, 4x."""
    batch = copy_kazemnejad_batch(generator(), 10, 18, 5, 7)
    logits = Peeking(384)(batch.input_ids).logits
    assert answer_accuracy(logits, batch.labels, per_example=True) == (10, 10)
    answer_places = (batch.labels[0] != IGNORE_INDEX).nonzero().flatten()
    for place in answer_places.tolist():  # one answer of row 0 wrong (the end token among them)
        wrong = logits.clone()
        wrong[0, place - 1] = wrong[0, place - 1].roll(1)
        answers = int((batch.labels != IGNORE_INDEX).sum())
        assert answer_accuracy(wrong, batch.labels, per_example=False) == (answers - 1, answers)
        assert answer_accuracy(wrong, batch.labels, per_example=True) == (9, 10)
    solver = CopySolver(limit=3)
    logits = solver(batch.input_ids).logits
    per_row = [answer_accuracy(logits[i : i + 1], batch.labels[i : i + 1], True)[0] == 1 for i in range(10)]
    sizes = [len(parse_kazemnejad_row(row)[0]) for row in batch.input_ids]
    assert per_row == [size <= 3 for size in sizes] == greedy_exact_match(solver, batch)
    assert answer_accuracy(logits, batch.labels, per_example=True) == (6, 10)  # lengths 1..5 twice each: 1-3 right
    task = TaskSpec("copy", copy_layout="kazemnejad", copy_max_length=5, copy_symbols=7)
    assert task_row(CopySolver(5), task, 18, (1, 2, 4), 20, 8, seed=0) == {"accuracy": {"1x": 1.0, "2x": 0.0,
                                                                                        "4x": 0.0}}  # fmt: skip
    assert task_row(CopySolver(100), task, 18, (1, 2, 4), 20, 8, seed=0)["accuracy"] == {"1x": 1.0, "2x": 1.0,
                                                                                       "4x": 1.0}  # fmt: skip


# --- passkey ---


FILLER = "abcdefghijklmnopqrstuvwxyz" * 4


def letters_text() -> PasskeyText:
    return PasskeyText(torch.tensor(list(FILLER.encode())) + BYTE_OFFSET, lambda text: [b + 3 for b in text.encode()])


@pytest.mark.parametrize(("depth", "cut"), [(0.0, 0), (0.5, 5), (1.0, 10)])
def test_passkey_hides_the_needle_at_its_depth_and_asks_at_the_end(depth, cut):
    """Length 56 with a 5-digit key: needle (24 bytes), question (17) and key (5) leave 10 bytes of filler, a
    contiguous excerpt of the text; the needle sits after ``round(depth * 10)`` of them; the key's digits are the
    last 5 tokens and the only labels."""
    length = 56
    batch = passkey_batch(generator(3), 6, length, letters_text(), digits=5, depth=depth)
    assert batch.per_example
    for row, labels in zip(batch.input_ids, batch.labels, strict=True):
        text = bytes(as_bytes(row)).decode()
        key = text[-5:]
        assert key.isdigit() and key[0] != "0"
        needle = f" The pass key is {key}. "
        excerpt = text[:cut] + text[cut + len(needle) : -len(" The pass key is ") - 5]
        assert len(excerpt) == 10 and excerpt in FILLER
        assert text == excerpt[:cut] + needle + excerpt[cut:] + " The pass key is " + key
        assert labels[:-5].tolist() == [IGNORE_INDEX] * (length - 5) and labels[-5:].tolist() == row[-5:].tolist()


def test_passkey_sizes_agree_with_the_parser_and_the_byte_tokenizer():
    """The parser's byte count of needle and question (checked before torch) is the generator's; the byte
    tokenizer's ids of the texts are the bytes + 3, so a byte model's passkey is the text itself."""
    tokenizer = byte_tokenizer()
    texts = passkey_texts(tokenizer)
    length = PASSKEY_NEEDLE_BYTES + PASSKEY_QUESTION_BYTES + 2 * 5
    batch = passkey_batch(generator(), 2, length, texts["eval"], digits=5, depth=0.5)  # no filler at all
    text = tokenizer.decode(batch.input_ids[0])
    assert text.startswith(" The pass key is ") and text.count(text[-5:]) == 2
    with pytest.raises(ValueError, match="more than the length"):
        passkey_batch(generator(), 1, length - 1, texts["eval"])
    assert texts["eval"].encode("The pass key") == [b + 3 for b in b"The pass key"]
    # the held-out filler is the corpus' first 5 % of lines, the training filler the rest: no overlap in the middle
    assert len(texts["train"].filler) > 15 * len(texts["eval"].filler)


def test_passkey_trains_at_a_length_where_filler_is_most_of_the_row():
    """compare's training length when --block_size is not given: 128 for passkey; at 128 the needle (`` The pass key
    is 99999. ``, 24 bytes), the question (17) and the key (5) leave 82 bytes of filler."""
    assert compare.parse_args(["--task", "passkey"]).block_size == 128
    assert compare.parse_args([]).block_size == compare.parse_args(["--task", "copy"]).block_size == 64
    assert compare.parse_args(["--task", "passkey", "--block_size", "96"]).block_size == 96
    task = TaskSpec("passkey", passkey=passkey_texts(byte_tokenizer()))
    assert task.passkey_filler(128) == (24 + 17 + 5, 82)


def test_compare_task_defaults_fill_only_the_flags_not_given_and_the_help_names_them():
    """Each task's model and training defaults (TASK_TRAINING_DEFAULTS) apply where the command line leaves the flag
    out; --task lm keeps the pretrain recipe's; a flag given wins; --help gives every task's default."""
    lm = compare.parse_args([])
    assert (lm.block_size, lm.hidden_size, lm.num_hidden_layers, lm.num_attention_heads) == (64, 128, 3, 4)
    assert (lm.per_device_train_batch_size, lm.learning_rate, lm.num_warmup_steps) == (32, 2e-3, 60)
    assert (lm.max_train_steps, lm.eval_steps) == (600, 200)
    for task, defaults in TASK_TRAINING_DEFAULTS.items():
        args = compare.parse_args(["--task", task])
        assert {flag: getattr(args, flag) for flag in defaults} == defaults
        for flag in set(TASK_DEFAULT_FLAGS) - set(defaults):
            assert getattr(args, flag) == getattr(lm, flag), flag
    given = compare.parse_args(["--task", "mqar", "--hidden_size", "96", "--learning_rate", "1e-3"])
    assert (given.hidden_size, given.learning_rate) == (96, 1e-3)
    assert given.num_hidden_layers == TASK_TRAINING_DEFAULTS["mqar"].get("num_hidden_layers", 3)
    helps = {action.dest: action.help for action in compare_parser()._actions}
    for flag in TASK_DEFAULT_FLAGS:
        values = [
            TASK_TRAINING_DEFAULTS[task][flag]
            for task in TASK_TRAINING_DEFAULTS
            if flag in TASK_TRAINING_DEFAULTS[task]
        ]
        assert f"when None: {default_text(getattr(lm, flag))}; --task " in helps[flag]
        assert all(default_text(value) in helps[flag] for value in values), flag


def test_compare_task_canon_layers_default_and_none_turns_them_off(capsys):
    """mqar and passkey train with canon layer B of kernel 3 unless told otherwise; --canon_layers none removes it
    (and its kernel size) under any task; --task lm has none; a kernel size given with none is refused by name."""
    for task in ("mqar", "passkey"):
        args = compare.parse_args(["--task", task])
        assert (args.canon_layers, args.canon_kernel_size) == ("B", 3)
        off = compare.parse_args(["--task", task, "--canon_layers", "none"])
        assert (off.canon_layers, off.canon_kernel_size) == (None, None)
        other = compare.parse_args(["--task", task, "--canon_layers", "AB", "--canon_kernel_size", "4"])
        assert (other.canon_layers, other.canon_kernel_size) == ("AB", 4)
    lm = compare.parse_args([])
    assert (lm.canon_layers, lm.canon_kernel_size) == (None, None)
    with pytest.raises(SystemExit):
        compare.parse_args(["--task", "mqar", "--canon_layers", "none", "--canon_kernel_size", "3"])
    assert "canon_kernel_size=3 has no effect without canon_layers" in capsys.readouterr().err


# --- the accuracy metric ---


class Peeking(torch.nn.Module):
    """Predicts the token that comes next by reading it (right by construction), or, with ``shift``, that token
    plus ``shift`` (wrong at every position); ``wrong_last``: right except at the last answer of each row."""

    def __init__(self, vocab_size: int, shift: int = 0, wrong_last: torch.Tensor | None = None):
        super().__init__()
        self.vocab_size, self.shift, self.wrong_last = vocab_size, shift, wrong_last
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids: torch.Tensor):
        following = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
        following = (following + self.shift) % self.vocab_size
        if self.wrong_last is not None:
            following = following.clone()
            rows = torch.arange(len(input_ids))
            following[rows, self.wrong_last - 1] = (following[rows, self.wrong_last - 1] + 1) % self.vocab_size
        return argparse.Namespace(logits=torch.nn.functional.one_hot(following, self.vocab_size).float())


class MqarSolver(torch.nn.Module):
    """Answers mqar from the tokens before each answer only: after a key seen among the context's pairs, the value
    that followed it there."""

    def __init__(self, num_pairs: int, vocab_size: int = 384):
        super().__init__()
        self.num_pairs, self.vocab_size = num_pairs, vocab_size
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids: torch.Tensor):
        logits = torch.zeros(*input_ids.shape, self.vocab_size)
        for row, ids in enumerate(input_ids.tolist()):
            pairs = dict(zip(ids[0 : 2 * self.num_pairs : 2], ids[1 : 2 * self.num_pairs : 2], strict=True))
            for place in range(2 * self.num_pairs, len(ids)):
                logits[row, place, pairs.get(ids[place], 0)] = 1.0
        return argparse.Namespace(logits=logits)


def test_accuracy_is_one_for_an_oracle_and_zero_for_a_wrong_model():
    for batch in (
        mqar_batch(generator(), 8, 64, layout="visible_answers"),
        copy_batch(generator(), 8, 33),
        passkey_batch(generator(), 8, 80, letters_text()),
    ):
        assert answer_accuracy(Peeking(384)(batch.input_ids).logits, batch.labels, batch.per_example) == (
            (8, 8) if batch.per_example else (int((batch.labels != IGNORE_INDEX).sum()),) * 2
        )
        right, total = answer_accuracy(Peeking(384, shift=1)(batch.input_ids).logits, batch.labels, batch.per_example)
        assert right == 0 and total > 0


def test_accuracy_per_answer_and_per_example_when_one_answer_per_row_is_wrong():
    """Copy of 4 letters per row, the last letter wrong in every row: 3/4 of the answers, none of the examples."""
    batch = copy_batch(generator(), 5, 9)
    last = torch.full((5,), 8)
    logits = Peeking(384, wrong_last=last)(batch.input_ids).logits
    assert answer_accuracy(logits, batch.labels, per_example=False) == (15, 20)
    assert answer_accuracy(logits, batch.labels, per_example=True) == (0, 5)


def test_task_accuracy_of_a_solver_that_reads_only_the_prefix():
    """A solver of mqar that never sees an answer before predicting it scores 1 at every length, in both layouts; a
    model reading the next input token scores 1 only where the answers are visible (by chance in Zoology's layout),
    one giving the byte after it 0; the rows say n/a with the reason where the model refuses a length."""
    task = TaskSpec("mqar", mqar_pairs=4, mqar_queries=4)
    visible = TaskSpec("mqar", mqar_pairs=4, mqar_queries=4, mqar_layout="visible_answers")
    assert task_accuracy(MqarSolver(4), task, 64, 20, 8, seed=0) == 1.0
    assert task_accuracy(MqarSolver(4), visible, 64, 20, 8, seed=0) == 1.0
    assert task_accuracy(Peeking(384), visible, 64, 20, 8, seed=0) == 1.0
    assert task_accuracy(Peeking(384), task, 64, 64, 8, seed=0) < 0.1
    assert task_accuracy(Peeking(384, shift=1), visible, 64, 20, 8, seed=0) == 0.0
    row = task_row(MqarSolver(4), task, 32, (1, 2, 4), 8, 8, seed=0)
    assert row == {"accuracy": {"1x": 1.0, "2x": 1.0, "4x": 1.0}}


class PositionRecorder(torch.nn.Module):
    """Keeps the position ids of every forward; predicts token 0 everywhere."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))
        self.seen = []

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
        self.seen.append(position_ids)
        return argparse.Namespace(logits=torch.zeros(*input_ids.shape, 384))


def test_a_task_row_with_randomized_positions_draws_them_at_each_length_it_can():
    """Scored with randomized positions up to 100: at 1x (32 tokens) every forward gets sorted distinct ids below
    100, the same draw for every example; at 4x (128 tokens) the row gives the reason instead of a number."""
    model = PositionRecorder()
    row = task_row(model, TaskSpec("copy"), 32, (1, 4), 8, 4, seed=0, randomized_positions=100)
    assert isinstance(row["accuracy"]["1x"], float) and len(model.seen) == 2
    assert torch.equal(model.seen[0], model.seen[1]) and model.seen[0].shape == (4, 32)
    assert (model.seen[0].diff(dim=-1) > 0).all() and model.seen[0].max() < 100
    assert row["accuracy"]["4x"].startswith("Randomized positions draw 128 distinct positions below 100")


def test_passkey_rows_give_each_depth_and_their_mean():
    task = TaskSpec("passkey", passkey={"eval": letters_text()})
    row = task_row(Peeking(384), task, 50, (1, 2), 4, 4, seed=0, depths=(0.0, 1.0))
    assert row["by_depth"] == {"1x": {"0.0": 1.0, "1.0": 1.0}, "2x": {"0.0": 1.0, "1.0": 1.0}}
    assert row["accuracy"] == {"1x": 1.0, "2x": 1.0}


def test_passkey_summary_table_and_plot_over_seeds_with_a_length_a_model_cannot_run(tmp_path):
    """Two seeds of one scheme: the mean ± sample standard deviation at each depth and length; a length the model
    refuses is n/a in the table and left blank in the depth map."""
    rows = [
        {"by_depth": {"1x": {"0.0": 1.0, "1.0": 0.5}, "2x": "Position 127 is outside"}, "accuracy": {"1x": 0.75,
         "2x": "Position 127 is outside"}},
        {"by_depth": {"1x": {"0.0": 0.5, "1.0": 0.5}, "2x": "Position 127 is outside"}, "accuracy": {"1x": 0.5,
         "2x": "Position 127 is outside"}},
    ]  # fmt: skip
    summary = long_context.accuracy_summary(rows, (1, 2), [0.0, 1.0])
    assert summary["accuracy"]["1x"]["mean"] == 0.625 and summary["accuracy"]["2x"] == "Position 127 is outside"
    assert summary["by_depth"]["1x"]["0.0"]["std"] == pytest.approx(math.sqrt(0.125))
    entry = {"label": "learned + softmax", **summary}
    table = long_context.depth_table([entry], (1, 2), [0.0, 1.0], "label")
    assert "| learned + softmax | 0 | 0.750 ± 0.354 | n/a |" in table
    assert "| learned + softmax | 1 | 0.500 ± 0.000 | n/a |" in table
    long_context.plot_tasks([entry], (1, 2), [0.0, 1.0], tmp_path / "passkey.png", "passkey", curves=False)
    assert (tmp_path / "passkey.png").stat().st_size > 5_000


# --- loss by position ---


class PositionModel(torch.nn.Module):
    """Gives the next token the logit ``0.1 t + 0.01 token`` at position ``t`` and every other token 0."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids: torch.Tensor):
        following = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
        positions = torch.arange(input_ids.shape[1], dtype=torch.float32)
        value = 0.1 * positions + 0.01 * following.float()
        logits = torch.zeros(*input_ids.shape, self.vocab_size)
        logits.scatter_(-1, following[..., None], value[..., None])
        return argparse.Namespace(logits=logits)


def test_loss_by_position_against_a_hand_computation():
    """Windows of 8 over 3 windows' worth of text and 2 tokens more (dropped): the loss at position t is the mean
    over the windows of ``log(V - 1 + e^c) - c``, ``c = 0.1 (t - 1) + 0.01 token_t``; bins of positions 1..7 in 3:
    1-3, 4-5, 6-7."""
    vocab_size, window = 11, 8
    ids = torch.tensor([(5 * index + 3) % vocab_size for index in range(3 * window + 2)])
    losses = long_context.loss_by_position(PositionModel(vocab_size), ids, window, batch_size=2)
    expected = []
    for position in range(1, window):
        per_window = []
        for start in range(0, 3 * window, window):
            c = 0.1 * (position - 1) + 0.01 * int(ids[start + position])
            per_window.append(math.log(vocab_size - 1 + math.exp(c)) - c)
        expected.append(sum(per_window) / 3)
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    bins = long_context.binned_positions(losses, 3)
    assert [(part["first"], part["last"]) for part in bins] == [(1, 3), (4, 5), (6, 7)]
    assert [part["loss"] for part in bins] == pytest.approx(
        [sum(expected[0:3]) / 3, sum(expected[3:5]) / 2, sum(expected[5:7]) / 2], rel=1e-6
    )
    with pytest.raises(ValueError, match="fewer than one window of 64"):
        long_context.loss_by_position(PositionModel(vocab_size), ids, 64)


# --- the recipes, end to end ---


TINY = [
    "--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "2", "--block_size", "32",
    "--max_train_steps", "3", "--num_warmup_steps", "1", "--eval_steps", "3", "--per_device_train_batch_size", "4",
    "--task_eval_examples", "4", "--factors", "1", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def mqar_compare(tmp_path_factory) -> Path:
    """``hf-posenc compare --task mqar`` through the installed command on a tiny budget: rope, and learned (which
    cannot run at 2x)."""
    output = tmp_path_factory.mktemp("mqar")
    command = [str(Path(sys.executable).parent / "hf-posenc"), "compare", "--task", "mqar", "--schemes", "rope"]
    command += ["learned", "--mqar_pairs", "3", "--mqar_queries", "2", *TINY, "--output_dir", str(output)]
    command += ["--lr_sweep", "1e-3", "3e-3", "--lr_sweep_steps", "2"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    finished = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return output


def test_compare_mqar_writes_its_table_json_and_plot(mqar_compare):
    table = (mqar_compare / "compare.md").read_text()
    assert table.startswith(
        "### mqar: multi-query associative recall, 3 key-value pairs, 2 queries, 32 keys and 32 values, Zoology's"
    )
    assert "a value of the example: 0.333" in table
    assert "| scheme | normalizer | 1x | 2x | train loss | step at 0.99 | lr |" in table
    assert "| learned | softmax |" in table and "| n/a |" in table and "| unfinished (3) |" in table
    assert "kept by a sweep of 2 steps over 0.001 0.003" in table and "cannot recall" not in table
    document = json.loads((mqar_compare / "compare.json").read_text())
    rows = {row["scheme"]: row for row in document["rows"]}
    assert set(rows) == {"rope", "learned"}
    assert 0.0 <= rows["rope"]["accuracy"]["2x"] <= 1.0 and isinstance(rows["learned"]["accuracy"]["2x"], str)
    sweep = rows["rope"]["lr_sweep"]
    assert set(sweep["trials"]) == {"0.001", "0.003"} and rows["rope"]["learning_rate"] == sweep["kept"]
    assert rows["rope"]["reached_step"] is None and rows["rope"]["steps"] == 3
    trial = json.loads(
        (mqar_compare / "models" / "mqar-rope-softmax" / "lr_sweep" / "lr_0.003" / "results.json").read_text()
    )
    assert trial["steps"] == 2 and trial["learning_rate"] == 0.003
    assert (mqar_compare / "compare.png").stat().st_size > 10_000
    saved = json.loads((mqar_compare / "models" / "mqar-rope-softmax" / "training_args.json").read_text())
    assert saved["block_size"] == 32 and saved["long_context_task"] == {
        "task": "mqar", "pairs": 3, "queries": 2, "key_vocab": 32, "value_vocab": 32, "layout": "zoology",
        "power_a": 0.01,
    }  # fmt: skip


def test_a_task_model_stops_when_it_reaches_the_accuracy_else_ends_unfinished_at_the_cap(tmp_path):
    """With --stop_accuracy 0 the first evaluation (step 2 of --eval_steps 2) stops training; at 1.0 a tiny model
    runs to the cap of 4 steps, unfinished."""
    from accelerate import Accelerator

    task = TaskSpec("mqar", mqar_pairs=2, mqar_queries=2)
    flags = ["--hidden_size", "16", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--block_size", "16"]
    flags += ["--max_train_steps", "4", "--num_warmup_steps", "1", "--eval_steps", "2"]
    flags += ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4"]
    accelerator = Accelerator(cpu=True)
    stopped = long_context.train_task_model([*flags, "--output_dir", str(tmp_path / "a")], task, accelerator, 4, 0.0)
    assert (stopped["steps"], stopped["reached_step"], stopped["max_train_steps"]) == (2, 2, 4)
    capped = long_context.train_task_model([*flags, "--output_dir", str(tmp_path / "b")], task, accelerator, 4, 1.0)
    assert (capped["steps"], capped["reached_step"]) == (4, None)
    log = [json.loads(line) for line in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert [record["step"] for record in log if "eval_accuracy" in record] == [2, 4]


def test_the_lr_sweep_keeps_the_best_accuracy_then_the_earliest_to_reach_it_then_the_lowest_loss(
    monkeypatch, tmp_path
):
    """Three trials (their results made up): 1e-3 reaches 0.5; 3e-3 and 1e-2 both 0.9, 1e-2 reaching the stop accuracy
    at step 200 and 3e-3 never: 1e-2 is kept. Each trial runs --lr_sweep_steps 100 with the full run's warm-up
    fraction (60 of 600 -> 10), in its own folder."""
    made_up = {"0.001": (0.5, None, 1.0), "0.003": (0.9, None, 0.2), "0.01": (0.9, 200, 0.3)}
    seen = []

    def train(argv, task, accelerator, examples, stop):
        seen.append(argv)
        accuracy, reached, loss = made_up[argv[argv.index("--learning_rate") + 1]]
        return {"eval_accuracy": accuracy, "reached_step": reached, "train_loss": loss, "steps": 100}

    monkeypatch.setattr(long_context, "train_task_model", train)
    flags = ["--lr_sweep", "1e-3", "3e-3", "1e-2", "--lr_sweep_steps", "100", "--num_warmup_steps", "60"]
    args = compare.parse_args(["--task", "mqar", *flags, "--max_train_steps", "600"])
    argv = reporting.recipe_argv(args, ("clm", "rope", "softmax", 0), tmp_path)
    accelerator = argparse.Namespace(print=lambda *words: None)
    sweep = long_context.sweep_learning_rate(args, argv, tmp_path, TaskSpec("mqar"), accelerator)
    assert sweep["kept"] == 0.01 and set(sweep["trials"]) == set(made_up)
    for trial in seen:
        assert trial[trial.index("--max_train_steps") + 1] == "100"
        assert trial[trial.index("--num_warmup_steps") + 1] == "10"
    assert {trial[trial.index("--output_dir") + 1] for trial in seen} == {
        str(tmp_path / "lr_sweep" / f"lr_{rate}") for rate in made_up
    }


def test_compare_lr_sweep_without_rates_takes_zoologys_range_and_lm_refuses_it(capsys):
    assert compare.parse_args(["--task", "mqar", "--lr_sweep"]).lr_sweep == [1e-4, 3e-4, 1e-3, 3e-3, 1e-2]
    with pytest.raises(SystemExit):
        compare.parse_args(["--lr_sweep"])
    assert "--lr_sweep trains the task models of --task mqar, copy or passkey" in capsys.readouterr().err


def test_extrapolate_scores_saved_models_on_the_task_and_by_position(mqar_compare, tmp_path):
    """The compare run's models again through ``extrapolate --task mqar`` (the same accuracy: the same examples),
    then through ``extrapolate`` (lm): the loss at each length and the loss by position, the learned table's n/a."""
    models = [str(mqar_compare / "models" / f"mqar-{scheme}-softmax") for scheme in ("rope", "learned")]
    flags = ["--factors", "1", "2", "--task_eval_examples", "4", "--mqar_pairs", "3", "--mqar_queries", "2"]
    rows = extrapolate.main(["--task", "mqar", "--model_name_or_path", *models, *flags, "--output_dir", str(tmp_path)])
    compared = json.loads((mqar_compare / "compare.json").read_text())["rows"]
    assert [row["accuracy"] for row in rows] == [row["accuracy"] for row in compared]
    assert "| model | label | 1x | 2x |" in (tmp_path / "extrapolation.md").read_text()
    lm = tmp_path / "lm"
    rows = extrapolate.main(["--model_name_or_path", *models, "--max_eval_tokens", "2048", "--factors", "1", "2",
                             "--position_bins", "4", "--output_dir", str(lm)])  # fmt: skip
    bins = rows[0]["loss_by_position"]
    assert [(part["first"], part["last"]) for part in bins] == [(1, 16), (17, 32), (33, 48), (49, 63)]
    assert isinstance(rows[1]["loss_by_position"], str)  # learned: 32 positions, the window has 64
    table = (lm / "extrapolation.md").read_text()
    assert "### Loss by position (a window of 2x the training length)" in table and "| 49-63 |" in table
    assert (lm / "extrapolation_positions.png").is_file()


def test_extrapolate_passkey_zero_shot_on_a_retrofitted_stock_decoder(tmp_path):
    """A stock GPT-2 retrofitted with alibi and saved with the byte tokenizer is scored on passkey in its own
    tokenizer, at lengths its position table allows."""
    tokenizer = byte_tokenizer()
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=256)
    model = hf_posenc.retrofit(transformers.GPT2LMHeadModel(config), "alibi")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    rows = extrapolate.main([
        "--task", "passkey", "--model_name_or_path", str(tmp_path / "model"), "--trust_remote_code", "--train_length",
        "64", "--factors",
        "1", "2", "--task_eval_examples", "2", "--passkey_depths", "0", "1", "--output_dir", str(tmp_path / "out"),
    ])  # fmt: skip
    assert set(rows[0]["by_depth"]) == {"1x", "2x"} and set(rows[0]["by_depth"]["2x"]) == {"0.0", "1.0"}
    assert "#### passkey by depth" in (tmp_path / "out" / "extrapolation.md").read_text()


@pytest.fixture(scope="module")
def copy_compare(tmp_path_factory) -> Path:
    """``compare --task copy --copy_layout kazemnejad`` (rsc, L = 4: a block of 16) on a tiny budget: rope, and
    learned (which cannot run at 2x)."""
    output = tmp_path_factory.mktemp("copy")
    flags = ["--task", "copy", "--copy_layout", "kazemnejad", "--copy_max_length", "4", "--copy_symbols", "10"]
    flags += ["--copy_repeat", "--schemes", "rope", "learned", "--hidden_size", "16", "--num_hidden_layers", "1"]
    flags += ["--num_attention_heads", "2", "--max_train_steps", "3", "--num_warmup_steps", "1", "--eval_steps", "3"]
    flags += ["--per_device_train_batch_size", "4", "--task_eval_examples", "8", "--factors", "1", "2"]
    compare.main([*flags, "--output_dir", str(output)])
    return output


def test_compare_copy_kazemnejad_writes_its_report_with_the_layout(copy_compare):
    table = (copy_compare / "compare.md").read_text()
    assert table.startswith("### copy, layout kazemnejad (Kazemnejad et al. 2023): 'Copy: ', one of 10 symbols")
    assert "of 16 tokens" in table and "1x: 1..4 in rows of 16 tokens; 2x: 5..8 in rows of 32 tokens" in table
    assert "greedy decoding's exact match" in table and "| learned | softmax |" in table and "| n/a |" in table
    rows = {row["scheme"]: row for row in json.loads((copy_compare / "compare.json").read_text())["rows"]}
    assert 0.0 <= rows["rope"]["accuracy"]["2x"] <= 1.0 and isinstance(rows["learned"]["accuracy"]["2x"], str)
    saved = json.loads((copy_compare / "models" / "copy-rope-softmax" / "training_args.json").read_text())
    assert saved["block_size"] == 16 and saved["long_context_task"] == {
        "task": "copy", "layout": "kazemnejad", "max_length": 4, "symbols": 10, "repeat": True,
    }  # fmt: skip


def test_extrapolate_copy_kazemnejad_scores_the_compare_models_and_checks_their_length(copy_compare, tmp_path, capsys):
    """The same accuracy through ``extrapolate`` with the layout's flags; a --copy_max_length whose block is not the
    models' training length is refused, naming it."""
    model = str(copy_compare / "models" / "copy-rope-softmax")
    flags = ["--task", "copy", "--copy_layout", "kazemnejad", "--copy_symbols", "10", "--copy_repeat", "--factors"]
    flags += ["1", "2", "--task_eval_examples", "8", "--model_name_or_path", model]
    rows = extrapolate.main([*flags, "--copy_max_length", "4", "--output_dir", str(tmp_path)])
    compared = {row["scheme"]: row for row in json.loads((copy_compare / "compare.json").read_text())["rows"]}
    assert rows[0]["accuracy"] == compared["rope"]["accuracy"]
    assert "layout kazemnejad" in (tmp_path / "extrapolation.md").read_text()
    with pytest.raises(SystemExit):
        extrapolate.main([*flags, "--output_dir", str(tmp_path / "again")])  # L = 20: a block of 48
    assert "scores rows of multiples of 48 tokens" in capsys.readouterr().err


def test_compare_copy_kazemnejad_derives_its_block():
    """The block is the longest training row, 2 L + 8, unless given (then it must be that)."""
    assert compare.parse_args(["--task", "copy", "--copy_layout", "kazemnejad"]).block_size == 48
    args = compare.parse_args(["--task", "copy", "--copy_layout", "kazemnejad", "--copy_max_length", "5"])
    assert (args.block_size, args.copy_max_length, args.copy_symbols, args.copy_repeat) == (18, 5, 100, False)
    assert TaskSpec.from_flags(args).settings()["symbols"] == 100
    given = ["--task", "copy", "--copy_layout", "kazemnejad", "--copy_max_length", "5", "--block_size", "18"]
    assert compare.parse_args(given).block_size == 18


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--task", "copy", "--copy_layout", "kazemnejad", "--block_size", "64"], "2 x 20 + 8 = 48 tokens"),
        (["--task", "copy", "--copy_symbols", "10"], "--copy_symbols: settings of --copy_layout kazemnejad"),
        (["--task", "copy", "--copy_repeat", "--copy_max_length", "5"], "--copy_max_length, --copy_repeat: settings"),
        (["--task", "mqar", "--copy_layout", "kazemnejad"], "settings of --task copy, not of --task mqar"),
        (["--copy_repeat"], "--copy_repeat: settings of --task copy, not of --task lm"),
        (["--task", "copy", "--copy_layout", "kazemnejad", "--copy_symbols", "222"], "must be in 1..221, got 222"),
        (["--task", "copy", "--copy_layout", "nope"], "invalid choice: 'nope' (choose from 'fixed', 'kazemnejad')"),
        (["--task", "mqar", "--encoders"], "--task mqar does not take --encoders"),
        (["--task", "mqar", "--mqar_pairs", "4", "--mqar_queries", "5"], "--mqar_queries must be in 1..4"),
        (["--task", "mqar", "--block_size", "12"], "take 16 tokens, more than the length 12"),
        (["--task", "passkey", "--block_size", "40"], "take 46 bytes, more than --block_size 40"),
        (["--task", "copy", "--randomized_positions", "32"], "--randomized_positions 32 must be >= --block_size 64"),
        (["--task", "copy", "--train_file", str(Path(__file__).parents[1] / "README.md")], "passkey's filler text"),
    ],
)
def test_compare_task_refuses_bad_flags_before_any_work(flags, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        compare.parse_args(flags)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


# --- RULER's offline tasks through lm-eval ---


def test_ruler_niah_single_1_runs_offline_on_a_saved_decoder(tmp_path, monkeypatch):
    """lm-eval's RULER ``niah_single_1`` end to end on a tiny saved PosEnc decoder with the byte tokenizer, offline:
    the task sizes its prompts with the model folder's own tokenizer (``--metadata``'s ``max_seq_lengths``), the
    model answers by greedy generation, and the score at that length is a fraction in [0, 1]."""
    lm_eval = pytest.importorskip("lm_eval", reason="RULER runs through lm-eval: pip install lm-eval wonderwords")
    import nltk
    from lm_eval.tasks import TaskManager

    # prepare_niah asks for nltk's punkt_tab on import; only the essay haystacks (not the six offline tasks) read it
    monkeypatch.setattr(nltk, "download", lambda *args, **kwargs: False)
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    config = hf_posenc.PosEncGPT2Config(
        position_encoding="rope", n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=len(tokenizer),
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    folder = tmp_path / "model"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    ruler = Path(lm_eval.__file__).parent / "tasks" / "ruler"
    metadata = {"max_seq_lengths": [1024], "pretrained": str(folder)}
    results = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(folder), "trust_remote_code": True, "max_length": 2048},
        tasks=["niah_single_1"], task_manager=TaskManager(include_path=str(ruler), include_defaults=False,
                                                          metadata=metadata),
        limit=2, batch_size=1, device="cpu", gen_kwargs="max_gen_toks=8", log_samples=True,
    )  # fmt: skip
    score = results["results"]["niah_single_1"]["1024,none"]
    assert 0.0 <= score <= 1.0
    samples = results["samples"]["niah_single_1"]
    assert len(samples) == 2
    for sample in samples:
        prompt, answer = sample["arguments"][0][0], sample["doc"]["outputs"]
        assert "special magic number" in prompt and answer[0].isdigit() and answer[0] in prompt
        assert len(tokenizer(prompt)["input_ids"]) <= 1024
        assert len(tokenizer(sample["resps"][0][0])["input_ids"]) <= 8
