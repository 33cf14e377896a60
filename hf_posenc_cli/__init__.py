"""The ``hf-posenc`` command: ``hf-posenc <recipe> [flags]``, one recipe of :mod:`hf_posenc` per subcommand.

A package of its own beside ``hf_posenc``: importing ``hf_posenc`` registers its models with Transformers (torch and
transformers loaded), and ``--help`` must answer before that. The flags are parsed here first
(:mod:`hf_posenc_cli.arguments`, standard library only); only then is the recipe's module imported and run.
Under accelerate: ``accelerate launch -m hf_posenc_cli pretrain ...``.
"""

from __future__ import annotations

import importlib
import sys

from .arguments import DESCRIPTIONS, PARSERS


RECIPE_MODULES = {
    "pretrain": "hf_posenc.pretraining",
    "compare": "hf_posenc.compare",
    "extrapolate": "hf_posenc.extrapolation",
    "glue": "hf_posenc.glue",
    "probe": "hf_posenc.probe_grid",
    "retrofit": "hf_posenc.warm_start",
}


def usage() -> str:
    lines = [f"  {name:<12} {what}" for name, what in DESCRIPTIONS.items()]
    return "usage: hf-posenc {" + ",".join(DESCRIPTIONS) + "} [flags]\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> object:
    """Run one recipe; returns what the recipe's ``main`` returns."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage() + "\n`hf-posenc <recipe> --help` lists a recipe's flags and their defaults.")
        raise SystemExit(0 if argv else 2)
    recipe, rest = argv[0], argv[1:]
    if recipe not in PARSERS:
        raise SystemExit(f"hf-posenc: unknown recipe {recipe!r}; valid: {', '.join(PARSERS)}")
    PARSERS[recipe]().parse_args(rest)  # --help and unknown flags answered before torch is imported
    return importlib.import_module(RECIPE_MODULES[recipe]).main(rest)
