"""What the benchmark scripts beside this file share: their scheme and normalizer arguments, the model shape they
time and how a result table is given back. Each script runs as ``python benchmarks/<name>.py``, which puts this
folder on ``sys.path``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import hf_posenc
from hf_posenc_recipes.parsers.common import catalogue_name


@dataclass(frozen=True)
class Size:
    hidden: int = 768
    heads: int = 12
    layers: int = 6
    ffn: int = 3072
    vocab: int = 8192


CATALOGUES = {
    "position_encoding": hf_posenc.list_position_encodings(),
    "attention_normalizer": hf_posenc.list_attention_normalizers(),
}


def add_catalogue_argument(parser: argparse.ArgumentParser, flag: str, kind: str, help: str) -> None:
    """``flag``: one or more names of the ``kind`` catalogue (``position_encoding`` or ``attention_normalizer``), each
    with options as ``name:key=value,...``; all of them by default."""
    parser.add_argument(
        flag, nargs="+", type=catalogue_name(kind, options=True), default=list(CATALOGUES[kind]), help=help
    )


def architecture(family: str, size: Size, max_len: int) -> dict:
    """The stock config fields of a benchmarked shape (dropout off), shared by the stock and the PosEnc model: BERT's
    names for ``"bert"``, GPT-2's otherwise."""
    if family == "bert":
        return dict(
            vocab_size=size.vocab,
            hidden_size=size.hidden,
            num_attention_heads=size.heads,
            num_hidden_layers=size.layers,
            intermediate_size=size.ffn,
            max_position_embeddings=max_len,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    return dict(
        vocab_size=size.vocab,
        n_embd=size.hidden,
        n_head=size.heads,
        n_layer=size.layers,
        n_inner=size.ffn,
        n_positions=max_len,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def print_and_write(table: list[str], output: str | None) -> None:
    """Print a result table's lines, and write them to ``output`` when one is named."""
    print("\n".join(table))
    if output:
        with open(output, "w") as handle:
            handle.write("\n".join(table) + "\n")
