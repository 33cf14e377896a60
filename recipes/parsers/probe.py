"""The command line of ``hf-posenc probe`` (:mod:`hf_posenc_recipes.probe`): a grid of family x scheme x
normalizer variant. Standard library only."""

from __future__ import annotations

import argparse

from hf_posenc_recipes import catalogue

from .common import (
    add_layout_flags,
    add_threads_flag,
    checked,
    hidden_alias,
    new_parser,
    output_folder,
    parse_scheme,
    parse_variant,
    positive_int,
)


DEFAULT_PROBE_VARIANTS = ["softmax", "l2", "exp", "relu2", "swish_l2", "softmax+gate", "softmax+boundary"]


def probe_scheme(text: str) -> str:
    """The flag type of a probe's scheme (:func:`parse_scheme`), checked against the catalogue."""
    checked(catalogue.check_spec, "position_encoding", parse_scheme(text))
    return text


def probe_variant(text: str) -> str:
    """The flag type of a probe's variant (:func:`parse_variant`), checked against the catalogue."""
    checked(lambda: catalogue.check_spec("attention_normalizer", parse_variant(text)[0]))
    return text


def probe_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "probe",
        """
The probe of kexue.fm/archives/9105: n identical tokens in, positions 1..n out, for a grid of model family x
position encoding x normalizer variant. Prints and saves the table of final mean squared errors (probe_table.md,
probe_results.json) and a heat map (probe_heatmap.png). A variant is a normalizer name, optionally with +gate (the
Toeplitz gate), +sink (softmax's learned sink), +output_gate (gated attention, elementwise) and +boundary (boundary
tokens). A scheme is a name, optionally with
options: shaw:use_value=false.
Several processes split the grid.

  hf-posenc probe --families gpt2 --schemes t5 alibi --variants softmax l2 softmax+gate softmax+boundary
""",
    )
    parser.add_argument(
        "--families", nargs="+", default=["bert", "gpt2"], choices=["bert", "gpt2"], help="model families"
    )
    parser.add_argument(
        "--schemes",
        nargs="+",
        type=probe_scheme,
        default=None,
        help="when None: every scheme (shaw with and without V)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        type=probe_variant,
        default=DEFAULT_PROBE_VARIANTS,
        help="normalizers, each optionally +gate, +sink, +output_gate, +boundary",
    )
    add_layout_flags(parser, "rows beside the schemes (alone when --schemes is not given)")
    parser.add_argument(
        "--num_hidden_layers", type=positive_int, default=2, help="the probe model's depth (a layout repeats every 4)"
    )
    parser.add_argument("--length", type=int, default=16, help="n, the number of identical tokens")
    parser.add_argument("--max_train_steps", type=int, default=400, help="full-batch Adam steps per probe")
    parser.add_argument("--learning_rate", type=float, default=1e-3, help="Adam's learning rate")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="one probe per seed; cells give the median")
    parser.add_argument(
        "--output_dir", type=output_folder, default="probe-output", help="the table, the results, the heat map"
    )
    add_threads_flag(parser)
    hidden_alias(parser, "--steps", "max_train_steps", type=int)
    hidden_alias(parser, "--lr", "learning_rate", type=float)
    hidden_alias(parser, "--output-dir", "output_dir", type=output_folder)
    return parser
