"""The position probe of kexue.fm/archives/9105: can a model map n identical tokens to 1..n?

A small model of the family reads ``length`` copies of one token (optionally between boundary tokens: [CLS] ... [SEP]
in the encoder, a BOS in the decoder) and a linear head regresses each copy's position ``1..n``. Every token looks
the same, so the only source of a difference between the outputs is the position encoding and how attention uses it.
With softmax every attention row sums to 1: under a relative-only scheme n identical values give n identical outputs,
and the best the head can do is predict the mean, a mean squared error equal to the variance of the targets.

Not part of the modeling code (saved models do not carry it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from tqdm.auto import trange
from transformers import AutoModel

from .configuration_posenc import PosEncBertConfig, PosEncGPT2Config, layout_name


FAMILIES = ("bert", "gpt2")
FIT_THRESHOLD = 0.05
"""``fitted`` means a final mean squared error below this fraction of the targets' variance."""
PROBE_TOKEN, FIRST_TOKEN, LAST_TOKEN = 0, 1, 2  # the repeated token; [CLS] or BOS; [SEP]


def probe(
    position_encoding: str | dict[str, Any],
    attention_normalizer: str | dict[str, Any] = "softmax",
    family: str = "gpt2",
    boundary_tokens: bool = False,
    length: int = 16,
    steps: int = 400,
    seed: int = 0,
    learning_rate: float = 1e-3,
    progress_bar: bool = False,
    num_hidden_layers: int = 2,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
) -> dict[str, Any]:
    """Train the probe and return its result.

    Args:
        position_encoding, attention_normalizer: as in the configs (a name or ``{"type": name, **options}``, e.g.
            ``{"type": "softmax", "toeplitz_gate": True}``).
        family: ``"bert"`` (bidirectional encoder) or ``"gpt2"`` (causal decoder).
        boundary_tokens: add [CLS] before and [SEP] after the tokens (``"bert"``), or a BOS before them (``"gpt2"``);
            their outputs are not scored.
        length: n, the number of identical tokens (targets ``1..n``).
        steps: full-batch Adam steps on the standardised targets.
        seed: seeds the model's initialisation (the input is fixed).
        learning_rate: Adam's learning rate.
        progress_bar: show the training steps with tqdm.
        num_hidden_layers, layer_types, sliding_window, attention_chunk_size: the model's depth (2) and its
            sliding-window and chunked-attention layers (a decoder's), as the configs take them (a per-layer
            ``position_encoding`` list has ``num_hidden_layers`` specs).

    It runs on one CPU thread (restored after): the model is tiny, and more threads only wait on each other, badly
    so on a busy machine (a 2-core CPU under load: 86 s with two threads, 1.2 s with one).

    Returns:
        ``{"mse", "target_variance", "relative_mse", "fitted", "output_spread", "predictions", ...}``: the final mean
        squared error on the targets ``1..n``, their variance ``(n^2 - 1) / 12`` (the error of predicting the mean),
        their ratio, ``relative_mse < FIT_THRESHOLD``, ``max - min`` of the n predictions (0 to float rounding when the
        model cannot tell the tokens apart), the predictions, and the arguments.
    """
    if family not in FAMILIES:
        raise ValueError(f"probe: family {family!r} is not one of {FAMILIES}.")
    if length < 2:
        raise ValueError(f"probe: length must be at least 2 (a variance to explain), got {length}.")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layers = {"num_hidden_layers": num_hidden_layers, "layer_types": layer_types, "sliding_window": sliding_window}
        layers["attention_chunk_size"] = attention_chunk_size
        return _train_probe(
            position_encoding, attention_normalizer, family, boundary_tokens, length, steps, seed, learning_rate,
            progress_bar, layers,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def _train_probe(
    position_encoding, attention_normalizer, family, boundary_tokens, length, steps, seed, learning_rate, progress_bar,
    layers,
):  # fmt: skip
    """:func:`probe` with its arguments checked."""
    torch.manual_seed(seed)
    model = AutoModel.from_config(_probe_config(family, position_encoding, attention_normalizer, length + 2, layers))
    head = nn.Linear(model.config.hidden_size, 1)
    input_ids, scored = _probe_inputs(family, boundary_tokens, length)
    targets = torch.arange(1, length + 1, dtype=torch.float32)
    mean, std = targets.mean(), targets.std(unbiased=False)

    def predict() -> torch.Tensor:
        hidden = model(input_ids).last_hidden_state[0, scored]
        return head(hidden)[:, 0] * std + mean

    optimizer = torch.optim.Adam([*model.parameters(), *head.parameters()], lr=learning_rate)
    model.train()
    description = f"probe {layout_name(model.config.position_encoding)} + {model.config.attention_normalizer['type']}"
    for _ in trange(steps, desc=description, disable=not progress_bar, leave=False):
        loss = nn.functional.mse_loss((predict() - mean) / std, (targets - mean) / std)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        predictions = predict()
    mse = nn.functional.mse_loss(predictions, targets).item()
    variance = targets.var(unbiased=False).item()
    return {
        "family": family,
        "position_encoding": model.config.position_encoding,
        "attention_normalizer": model.config.attention_normalizer,
        "boundary_tokens": boundary_tokens,
        "length": length,
        "steps": steps,
        "seed": seed,
        "mse": mse,
        "target_variance": variance,
        "relative_mse": mse / variance,
        "fitted": mse / variance < FIT_THRESHOLD,
        "output_spread": (predictions.max() - predictions.min()).item(),
        "predictions": predictions.tolist(),
    }


def _probe_config(family: str, position_encoding, attention_normalizer, max_positions: int, layers: dict[str, Any]):
    """A small model without dropout: hidden 64, 4 heads, ``layers["num_hidden_layers"]`` layers (2 by default) with
    ``layers``' ``layer_types``, ``sliding_window`` and ``attention_chunk_size``."""
    depth = layers["num_hidden_layers"]
    windows = {key: layers[key] for key in ("layer_types", "sliding_window", "attention_chunk_size")}
    if family == "bert":
        return PosEncBertConfig(
            vocab_size=3,
            hidden_size=64,
            num_hidden_layers=depth,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=max_positions,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            position_encoding=position_encoding,
            attention_normalizer=attention_normalizer,
            **windows,
        )
    return PosEncGPT2Config(
        vocab_size=3,
        n_embd=64,
        n_layer=depth,
        n_head=4,
        n_inner=128,
        n_positions=max_positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=FIRST_TOKEN,
        eos_token_id=LAST_TOKEN,
        position_encoding=position_encoding,
        attention_normalizer=attention_normalizer,
        **windows,
    )


def _probe_inputs(family: str, boundary_tokens: bool, length: int) -> tuple[torch.Tensor, slice]:
    """``(1, seq)`` input ids and the slice of the probe tokens among them."""
    tokens = [PROBE_TOKEN] * length
    if not boundary_tokens:
        return torch.tensor([tokens]), slice(0, length)
    ends = [FIRST_TOKEN], ([LAST_TOKEN] if family == "bert" else [])
    return torch.tensor([ends[0] + tokens + ends[1]]), slice(1, length + 1)
