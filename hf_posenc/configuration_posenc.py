"""Configs of the two PosEnc families: ``BertConfig`` / ``GPT2Config`` plus ``position_encoding`` and
``attention_normalizer``, each stored in config.json as a full ``{"type": name, **options}`` dict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import BertConfig, GPT2Config

from .attention_normalizers import ATTENTION_NORMALIZERS
from .options import resolve_spec
from .position_encodings import POSITION_ENCODINGS


def without_filled_in_length(value: Any, max_position_embeddings: int) -> Any:
    """``value`` without its ``max_positions`` where that equals ``max_position_embeddings`` and the other options
    leave it unused (``multiplicative`` with ``table="sinusoidal"``): configs saved before such a value was refused
    hold the one filled in here, which had no effect. Any other unused value is left to be refused."""
    if not isinstance(value, Mapping) or value.get("max_positions") != max_position_embeddings:
        return value
    rest = {key: option for key, option in value.items() if key != "max_positions"}
    spec = resolve_spec("position_encoding", rest, POSITION_ENCODINGS)
    return rest if "max_positions" in POSITION_ENCODINGS[spec["type"]].unused_options(spec) else value


def resolve_position_encoding(
    value: Any, max_position_embeddings: int, causal: bool, hidden_size: int
) -> dict[str, Any]:
    """Full spec of a position encoding for an encoder or a decoder (``causal``); a table whose
    ``max_positions`` option is None (``learned``, ``multiplicative``, ``hierarchical``) gets
    ``max_position_embeddings`` rows, unless the other options leave it unused. A scheme with no form for the
    family, or options that do not fit the sizes, raise ``ValueError``."""
    spec = resolve_spec(
        "position_encoding", without_filled_in_length(value, max_position_embeddings), POSITION_ENCODINGS
    )
    scheme = POSITION_ENCODINGS[spec["type"]]
    scheme.check_family(spec, causal)
    scheme.check_sizes(spec, hidden_size, max_position_embeddings)
    if spec.get("max_positions", 0) is None and "max_positions" not in scheme.unused_options(spec):
        spec["max_positions"] = max_position_embeddings
    return spec


def resolve_attention_normalizer(value: Any, causal: bool | None = None) -> dict[str, Any]:
    """Full spec of an attention normalizer; for an encoder or a decoder (``causal``; None: a bare spec, no family
    check) a normalizer with no form for the family raises ``ValueError``."""
    spec = resolve_spec("attention_normalizer", value, ATTENTION_NORMALIZERS)
    if causal is not None:
        ATTENTION_NORMALIZERS[spec["type"]].check_family(spec, causal)
    return spec


@strict
class PosEncBertConfig(BertConfig):
    r"""
    A [`BertConfig`] whose position encoding and attention normalizer are switches.

    position_encoding (`str` or `dict`, *optional*, defaults to `"learned"`):
        A name from `hf_posenc.list_position_encodings()`, or `{"type": name, **options}`.
    attention_normalizer (`str` or `dict`, *optional*, defaults to `"softmax"`):
        A name from `hf_posenc.list_attention_normalizers()`, or `{"type": name, **options}`.

    ```python
    >>> import hf_posenc, transformers
    >>> config = hf_posenc.PosEncBertConfig(position_encoding={"type": "t5", "num_buckets": 32}, hidden_size=128)
    >>> model = transformers.AutoModelForMaskedLM.from_config(config)
    ```"""

    model_type = "posenc_bert"
    _auto_class = "AutoConfig"

    position_encoding: str | dict = "learned"
    attention_normalizer: str | dict = "softmax"

    def __post_init__(self, **kwargs):
        self.position_encoding = resolve_position_encoding(
            self.position_encoding, self.max_position_embeddings, causal=self.is_decoder, hidden_size=self.hidden_size
        )
        self.attention_normalizer = resolve_attention_normalizer(self.attention_normalizer, causal=self.is_decoder)
        super().__post_init__(**kwargs)


@strict
class PosEncGPT2Config(GPT2Config):
    r"""
    A [`GPT2Config`] whose position encoding and attention normalizer are switches.

    position_encoding (`str` or `dict`, *optional*, defaults to `"learned"`):
        A name from `hf_posenc.list_position_encodings()`, or `{"type": name, **options}`.
    attention_normalizer (`str` or `dict`, *optional*, defaults to `"softmax"`):
        A name from `hf_posenc.list_attention_normalizers()`, or `{"type": name, **options}`.
    """

    model_type = "posenc_gpt2"
    _auto_class = "AutoConfig"

    position_encoding: str | dict = "learned"
    attention_normalizer: str | dict = "softmax"

    def __post_init__(self, **kwargs):
        self.position_encoding = resolve_position_encoding(
            self.position_encoding, self.n_positions, causal=True, hidden_size=self.n_embd
        )
        self.attention_normalizer = resolve_attention_normalizer(self.attention_normalizer, causal=True)
        super().__post_init__(**kwargs)
