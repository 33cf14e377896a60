"""``convert``: a stock Transformers BERT or GPT-2 model -> the matching PosEnc model, weights kept."""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    BertForMaskedLM,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    GPT2Model,
    PreTrainedModel,
)

from .configuration_posenc import PosEncBertConfig, PosEncGPT2Config
from .modeling_posenc_bert import (
    PosEncBertForMaskedLM,
    PosEncBertForQuestionAnswering,
    PosEncBertForSequenceClassification,
    PosEncBertForTokenClassification,
    PosEncBertModel,
)
from .modeling_posenc_gpt2 import PosEncGPT2ForSequenceClassification, PosEncGPT2LMHeadModel, PosEncGPT2Model


STOCK_TO_POSENC: dict[type, tuple[type, type, str]] = {
    # stock class: (PosEnc class, PosEnc config class, name of the stock position table's parameter)
    BertModel: (PosEncBertModel, PosEncBertConfig, "embeddings.position_embeddings.weight"),
    BertForMaskedLM: (PosEncBertForMaskedLM, PosEncBertConfig, "embeddings.position_embeddings.weight"),
    BertForSequenceClassification: (
        PosEncBertForSequenceClassification,
        PosEncBertConfig,
        "embeddings.position_embeddings.weight",
    ),
    BertForTokenClassification: (
        PosEncBertForTokenClassification,
        PosEncBertConfig,
        "embeddings.position_embeddings.weight",
    ),
    BertForQuestionAnswering: (
        PosEncBertForQuestionAnswering,
        PosEncBertConfig,
        "embeddings.position_embeddings.weight",
    ),
    GPT2Model: (PosEncGPT2Model, PosEncGPT2Config, "wpe.weight"),
    GPT2LMHeadModel: (PosEncGPT2LMHeadModel, PosEncGPT2Config, "wpe.weight"),
    GPT2ForSequenceClassification: (PosEncGPT2ForSequenceClassification, PosEncGPT2Config, "wpe.weight"),
}

LEARNED_TABLE = "position_encoding.table.weight"


def convert(
    model: PreTrainedModel,
    position_encoding: str | dict[str, Any] = "learned",
    attention_normalizer: str | dict[str, Any] = "softmax",
) -> PreTrainedModel:
    """Build the PosEnc model matching a stock ``model`` and copy every weight into it.

    With ``learned`` the stock position table becomes the scheme's table, and the result computes what the stock
    model computes. With any other scheme the stock table is dropped and the scheme's own parameters (if any) start
    from their init (per-layer ones too). The stock model is left unchanged.
    """
    entry = STOCK_TO_POSENC.get(type(model))
    if entry is None:
        supported = ", ".join(cls.__name__ for cls in STOCK_TO_POSENC)
        raise ValueError(f"convert() takes a stock {supported}; got {type(model).__name__}.")
    posenc_class, config_class, stock_table = entry
    config_dict = {k: v for k, v in model.config.to_dict().items() if k not in ("model_type", "architectures")}
    config_dict.update(position_encoding=position_encoding, attention_normalizer=attention_normalizer)
    config = config_class.from_dict(config_dict)
    config._attn_implementation = model.config._attn_implementation

    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(stock_table):
            if config.position_encoding["type"] != "learned":
                continue
            name = name[: -len(stock_table)] + LEARNED_TABLE
        state[name] = tensor

    with torch.device(model.device):
        converted = posenc_class(config).to(model.dtype)
    missing, unexpected = converted.load_state_dict(state, strict=False)
    # The scheme's own parameters, shared (position_encoding) or per layer (position_term), start from their init.
    missing = [name for name in missing if ".position_encoding." not in f".{name}" and ".position_term." not in name]
    if missing or unexpected:
        raise ValueError(f"convert(): weights did not line up; missing {missing}, unexpected {unexpected}.")
    return converted.train(model.training)
