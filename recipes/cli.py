"""The ``hf-posenc`` command, the recipes' front door: ``hf-posenc <recipe> [flags]`` runs ``recipes/<recipe>.py``.

Three ways in, one code path (:func:`run_recipe`): the console command, ``python -m hf_posenc_recipes <recipe>``
(and ``accelerate launch -m hf_posenc_recipes <recipe>``), and the recipe file as a script (``python
recipes/pretrain.py``, ``accelerate launch recipes/pretrain.py``), the way Transformers' example scripts run. The
library, ``hf_posenc``, never imports this package: importing it registers its models with Transformers (torch and
transformers loaded), and ``hf-posenc <recipe> --help`` must answer before that. The flags are parsed here first
(:mod:`hf_posenc_recipes.parsers`, standard library only); only then is the recipe's module imported and run.

Exit status: 0 when the recipe succeeds; 2 for a bad flag (argparse: ``hf-posenc <recipe>: error: <message>``);
1 for a user error met while running, one line, ``hf-posenc <recipe>: error: <message>``. User errors are
``ValueError`` (a bad value: a scheme's option, a text too short for one block, a tokenizer without a mask token)
and ``OSError`` (a file, folder or Hub repository that cannot be read or written, the Hub unreachable;
``FileNotFoundError`` and Transformers' "not a valid model identifier" are ``OSError``). Any other exception is a bug
and keeps its traceback (exit 1). ``HF_POSENC_TRACEBACK=1`` shows the traceback of a user error too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from hf_posenc_recipes.parsers import PARSERS
from hf_posenc_recipes.registry import RECIPES


USER_ERRORS = (ValueError, OSError)
"""What a recipe raises for bad input (see the module's docstring): reported in one line, without a traceback."""


def usage() -> str:
    lines = [f"  {name:<12} {recipe.description}" for name, recipe in RECIPES.items()]
    return "usage: hf-posenc {" + ",".join(RECIPES) + "} [flags]\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run one recipe; returns the exit status (0: done). The recipe's results are in its ``--output_dir``; a
    caller wanting them as objects calls the recipe module's ``main`` (``hf_posenc_recipes.pretrain.main``)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage() + "\n`hf-posenc <recipe> --help` lists a recipe's flags and their defaults.")
        raise SystemExit(0 if argv else 2)
    recipe, rest = argv[0], argv[1:]
    if recipe not in PARSERS:
        print(f"hf-posenc: error: unknown recipe {recipe!r}; valid: {', '.join(PARSERS)}", file=sys.stderr)
        raise SystemExit(2)
    return run_recipe(recipe, rest)


def run_recipe(recipe: str, argv: list[str], recipe_main: Callable[[list[str]], Any] | None = None) -> int:
    """Parse ``argv`` with the recipe's parser (``--help`` and a bad flag end here, before torch is imported), then
    run the recipe's ``main`` (its module's, imported now, unless the running script passes its own) and return
    the exit status, a user error reported in one line."""
    PARSERS[recipe]().parse_args(argv)
    try:
        recipe_main = recipe_main or RECIPES[recipe].load().main
        from hf_posenc_recipes.common import library_progress_bars_on_a_terminal

        with library_progress_bars_on_a_terminal():
            recipe_main(argv)
    except USER_ERRORS as error:
        if os.environ.get("HF_POSENC_TRACEBACK") == "1":
            raise
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"hf-posenc {recipe}: error: {message}", file=sys.stderr)
        return 1
    finally:
        leave_process_group()
    return 0


def leave_process_group() -> None:
    """Destroy the process group a multi-process launch joined, as accelerate's ``end_training`` does: left to the
    interpreter's exit, gloo's threads can abort a finished process ("terminate called without an active
    exception", exit -6)."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()
