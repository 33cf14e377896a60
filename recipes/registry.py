"""The registry of the recipes (as torchtune's ``_recipe_registry.py``: a record per recipe naming its module).

A recipe module (``hf_posenc_recipes.pretrain``, ...) imports torch, transformers and hf_posenc; this registry and
the parsers (:mod:`hf_posenc_recipes.parsers`) import only the standard library, so that ``--help`` and a bad flag
are answered before torch loads. :meth:`Recipe.load` imports a recipe's module when it is about to run.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Recipe:
    """One recipe: its subcommand ``name``, what it does in one line, and the module whose ``main(argv)`` runs it
    (imported by :meth:`load`, not before)."""

    name: str
    description: str
    module: str

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


RECIPES = {
    recipe.name: recipe
    for recipe in (
        Recipe("pretrain", "pretrain one model (causal or masked LM) with accelerate", "hf_posenc_recipes.pretrain"),
        Recipe(
            "compare",
            "pretrain one model per scheme on an equal budget and compare them (the main job)",
            "hf_posenc_recipes.compare",
        ),
        Recipe(
            "extrapolate",
            "loss of saved models at 1x, 2x, 4x, 8x their training length and by position, or a task's accuracy",
            "hf_posenc_recipes.extrapolate",
        ),
        Recipe("glue", "fine-tune and evaluate a checkpoint on a GLUE task", "hf_posenc_recipes.glue"),
        Recipe(
            "probe",
            "the position probe (n identical tokens -> positions 1..n) over a grid of schemes",
            "hf_posenc_recipes.probe",
        ),
        Recipe(
            "retrofit",
            "warm-start new schemes on a pretrained checkpoint: retrofit, then continue MLM training",
            "hf_posenc_recipes.retrofit",
        ),
    )
}
"""Every recipe by name, in the order ``hf-posenc --help`` lists them."""
