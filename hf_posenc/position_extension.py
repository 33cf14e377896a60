"""``extend_positions``: lengthen a trained ``learned`` position table so the model reads longer inputs."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from .absolute_encodings import LearnedAbsolute, hierarchical_positions


EXTENSION_METHODS = ("hierarchical", "interpolate")


def hierarchical_table(table: torch.Tensor, max_positions: int, alpha: float = 0.4) -> torch.Tensor:
    """The first ``max_positions`` rows (up to ``n^2``) of the hierarchical decomposition of the ``(n, hidden)``
    ``table`` (kexue.fm/archives/7947; :func:`hierarchical_positions`, shared with the ``hierarchical`` scheme):
    rows below ``n`` come back unchanged."""
    return hierarchical_positions(table, torch.arange(max_positions, device=table.device), alpha)


def interpolated_table(table: torch.Tensor, max_positions: int) -> torch.Tensor:
    """Position interpolation: row ``k`` of the new table is the old table read (linearly) at
    ``k (n - 1) / (max_positions - 1)``, so the first and last rows stay (Chen et al. 2023, "Extending Context
    Window of Large Language Models via Positional Interpolation"). ``(n, hidden)`` -> ``(max_positions, hidden)``.
    """
    stretched = nn.functional.interpolate(table.T[None], size=max_positions, mode="linear", align_corners=True)
    return stretched[0].T


def extend_positions(
    model: PreTrainedModel, max_positions: int, method: str = "hierarchical", alpha: float = 0.4
) -> PreTrainedModel:
    """Lengthen the ``learned`` position table of a PosEnc model in place to ``max_positions`` rows; returns it.

    ``method="hierarchical"`` keeps every trained position as it was and builds the new ones from them
    (up to ``n^2`` positions); ``"interpolate"`` stretches the trained table over the new length. The config is
    updated (``position_encoding["max_positions"]``, ``max_position_embeddings``), so the model saves and reloads
    at its new length.
    """
    encoding = getattr(model.base_model, "position_encoding", None)
    if not isinstance(encoding, LearnedAbsolute):
        found = type(encoding).__name__ if encoding is not None else type(model).__name__
        raise ValueError(
            f"extend_positions lengthens a PosEnc model's 'learned' position table; got {found}. Schemes without a "
            "table (rope, t5, alibi, sinusoidal, none) already take any length."
        )
    if method not in EXTENSION_METHODS:
        raise ValueError(f"Unknown method {method!r}; valid choices: {list(EXTENSION_METHODS)}.")
    table = encoding.table.weight.detach()
    n = table.shape[0]
    if not isinstance(max_positions, int) or max_positions <= n:
        raise ValueError(f"max_positions must be an int larger than the current table ({n}); got {max_positions!r}.")
    if method == "hierarchical":
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1); got {alpha!r}.")
        if max_positions > n * n:
            raise ValueError(f"hierarchical extension reaches at most n^2 = {n * n} positions; got {max_positions}.")
        new_table = hierarchical_table(table, max_positions, alpha)
    else:
        new_table = interpolated_table(table, max_positions)
    encoding.table = nn.Embedding.from_pretrained(new_table, freeze=False).to(table.device)
    model.config.position_encoding = {**model.config.position_encoding, "max_positions": max_positions}
    model.config.max_position_embeddings = max_positions
    return model
