"""The ``hf-posenc`` command: ``hf-posenc <recipe> [flags]``, one recipe (:mod:`hf_posenc_cli.recipes`) per
subcommand.

A package of its own beside ``hf_posenc``, which never imports it: importing ``hf_posenc`` registers its models with
Transformers (torch and transformers loaded), and ``--help`` must answer before that. The flags are parsed here first
(:mod:`hf_posenc_cli.parsers`, standard library only); only then is the recipe's module imported and run.
Under accelerate: ``accelerate launch -m hf_posenc_cli pretrain ...``.

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

from .parsers import PARSERS
from .recipes import RECIPES


USER_ERRORS = (ValueError, OSError)
"""What a recipe raises for bad input (see the module's docstring): reported in one line, without a traceback."""


def usage() -> str:
    lines = [f"  {name:<12} {recipe.description}" for name, recipe in RECIPES.items()]
    return "usage: hf-posenc {" + ",".join(RECIPES) + "} [flags]\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run one recipe; returns the exit status (0: done). The recipe's results are in its ``--output_dir``; a
    caller wanting them as objects calls the recipe module's ``main`` (``hf_posenc_cli.recipes.pretrain.main``)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage() + "\n`hf-posenc <recipe> --help` lists a recipe's flags and their defaults.")
        raise SystemExit(0 if argv else 2)
    recipe, rest = argv[0], argv[1:]
    if recipe not in PARSERS:
        print(f"hf-posenc: error: unknown recipe {recipe!r}; valid: {', '.join(PARSERS)}", file=sys.stderr)
        raise SystemExit(2)
    PARSERS[recipe]().parse_args(rest)  # --help and unknown flags answered before torch is imported
    try:
        module = RECIPES[recipe].load()
        from .recipes.common import library_progress_bars_on_a_terminal

        with library_progress_bars_on_a_terminal():
            module.main(rest)
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
