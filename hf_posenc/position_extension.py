"""``extend_positions``: lengthen a trained ``learned`` position table (PosEnc, or stock BERT / RoBERTa / GPT-2) so
the model reads longer inputs."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from .absolute_encodings import LearnedAbsolute, hierarchical_positions
from .configuration_posenc import layer_position_specs


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


def stock_position_table(model: PreTrainedModel) -> tuple[nn.Module, str, int] | None:
    """``(owner, attribute, offset)`` of a stock BERT / RoBERTa / GPT-2 position table, or None; ``offset`` is the
    number of rows before position 0 (RoBERTa numbers real tokens from ``padding_idx + 1``)."""
    base = model.base_model
    embeddings = getattr(base, "embeddings", None)
    if isinstance(getattr(embeddings, "position_embeddings", None), nn.Embedding):
        is_roberta = hasattr(embeddings, "create_position_ids_from_input_ids")
        return embeddings, "position_embeddings", embeddings.padding_idx + 1 if is_roberta else 0
    if isinstance(getattr(base, "wpe", None), nn.Embedding):
        return base, "wpe", 0
    return None


def extend_positions(
    model: PreTrainedModel, max_positions: int, method: str = "hierarchical", alpha: float = 0.4
) -> PreTrainedModel:
    """Lengthen the ``learned`` position table of a PosEnc model, or the table of a stock BERT, RoBERTa or GPT-2
    model, in place to ``max_positions`` positions; returns the model.

    ``method="hierarchical"`` keeps every trained position as it was and builds the new ones from them
    (up to ``n^2`` positions); ``"interpolate"`` stretches the trained table over the new length. The config is
    updated (``max_position_embeddings``, and ``position_encoding["max_positions"]`` of a PosEnc model; a RoBERTa
    table keeps its ``padding_idx + 1`` leading rows, so its ``max_position_embeddings`` becomes ``max_positions +
    padding_idx + 1``), so the model saves and reloads at its new length.
    """
    encoding = getattr(model.base_model, "position_encoding", None)
    stock = None if encoding is not None else stock_position_table(model)
    if not isinstance(encoding, LearnedAbsolute) and stock is None:
        found = type(encoding).__name__ if encoding is not None else type(model).__name__
        raise ValueError(
            f"extend_positions lengthens a 'learned' position table; got {found}. It takes PosEnc models with "
            "'learned' and stock BERT, RoBERTa and GPT-2 models; schemes without a table (rope, t5, alibi, "
            "sinusoidal, none) already take any length."
        )
    if method not in EXTENSION_METHODS:
        raise ValueError(f"Unknown method {method!r}; valid choices: {list(EXTENSION_METHODS)}.")
    owner, name, offset = stock if stock is not None else (encoding, "table", 0)
    stock_table = getattr(owner, name)
    table = stock_table.weight.detach()[offset:]
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
    new_table = torch.cat((stock_table.weight.detach()[:offset], new_table))
    setattr(owner, name, nn.Embedding.from_pretrained(new_table, freeze=False, padding_idx=stock_table.padding_idx))
    for buffer in ("position_ids", "token_type_ids"):  # stock BERT/RoBERTa embeddings keep these per position
        if stock is not None and hasattr(owner, buffer):
            values = torch.arange(len(new_table)) if buffer == "position_ids" else torch.zeros(len(new_table))
            setattr(owner, buffer, values.to(table.device, torch.long).expand(1, -1))
    if encoding is not None:
        value = model.config.position_encoding  # a spec, or the same spec on every layer
        specs = [{**spec, "max_positions": max_positions} for spec in layer_position_specs(value, 1)]
        model.config.position_encoding = specs if isinstance(value, list) else specs[0]
    model.config.max_position_embeddings = offset + max_positions
    return model
