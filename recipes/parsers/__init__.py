"""Every recipe's command line, one parser module per recipe beside the flag types and groups they share
(:mod:`hf_posenc_recipes.parsers.common`). Standard library only: ``--help`` and a bad flag are answered before torch
loads."""

from __future__ import annotations

from .compare import compare_parser
from .extrapolate import extrapolate_parser
from .glue import glue_parser
from .pretrain import pretrain_parser
from .probe import probe_parser
from .retrofit import retrofit_parser


PARSERS = {
    "pretrain": pretrain_parser,
    "compare": compare_parser,
    "extrapolate": extrapolate_parser,
    "glue": glue_parser,
    "probe": probe_parser,
    "retrofit": retrofit_parser,
}
"""The parser of each recipe of :data:`hf_posenc_recipes.RECIPES`, by name."""
