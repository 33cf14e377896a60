"""``convert``: a stock Transformers BERT, RoBERTa or GPT-2 model -> the matching PosEnc model, weights kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForNextSentencePrediction,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertLMHeadModel,
    BertModel,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    GPT2Model,
    PreTrainedModel,
    RobertaForMaskedLM,
    RobertaForQuestionAnswering,
    RobertaForSequenceClassification,
    RobertaForTokenClassification,
    RobertaModel,
)

from .configuration_posenc import PosEncBertConfig, PosEncGPT2Config
from .modeling_posenc_bert import (
    PosEncBertForMaskedLM,
    PosEncBertForMultipleChoice,
    PosEncBertForNextSentencePrediction,
    PosEncBertForPreTraining,
    PosEncBertForQuestionAnswering,
    PosEncBertForSequenceClassification,
    PosEncBertForTokenClassification,
    PosEncBertLMHeadModel,
    PosEncBertModel,
)
from .modeling_posenc_gpt2 import PosEncGPT2ForSequenceClassification, PosEncGPT2LMHeadModel, PosEncGPT2Model
from .retrofit import load_stock_model


BERT_POSITIONS = "embeddings.position_embeddings.weight"

STOCK_TO_POSENC: dict[type, tuple[type, type, str]] = {
    # stock class: (PosEnc class, PosEnc config class, name of the stock position table's parameter)
    BertModel: (PosEncBertModel, PosEncBertConfig, BERT_POSITIONS),
    BertForMaskedLM: (PosEncBertForMaskedLM, PosEncBertConfig, BERT_POSITIONS),
    BertForSequenceClassification: (
        PosEncBertForSequenceClassification,
        PosEncBertConfig,
        BERT_POSITIONS,
    ),
    BertForTokenClassification: (
        PosEncBertForTokenClassification,
        PosEncBertConfig,
        BERT_POSITIONS,
    ),
    BertForQuestionAnswering: (
        PosEncBertForQuestionAnswering,
        PosEncBertConfig,
        BERT_POSITIONS,
    ),
    BertForPreTraining: (PosEncBertForPreTraining, PosEncBertConfig, BERT_POSITIONS),
    BertLMHeadModel: (PosEncBertLMHeadModel, PosEncBertConfig, BERT_POSITIONS),
    BertForNextSentencePrediction: (
        PosEncBertForNextSentencePrediction,
        PosEncBertConfig,
        BERT_POSITIONS,
    ),
    BertForMultipleChoice: (PosEncBertForMultipleChoice, PosEncBertConfig, BERT_POSITIONS),
    GPT2Model: (PosEncGPT2Model, PosEncGPT2Config, "wpe.weight"),
    GPT2LMHeadModel: (PosEncGPT2LMHeadModel, PosEncGPT2Config, "wpe.weight"),
    GPT2ForSequenceClassification: (PosEncGPT2ForSequenceClassification, PosEncGPT2Config, "wpe.weight"),
    RobertaModel: (PosEncBertModel, PosEncBertConfig, BERT_POSITIONS),
    RobertaForMaskedLM: (PosEncBertForMaskedLM, PosEncBertConfig, BERT_POSITIONS),
    RobertaForSequenceClassification: (
        PosEncBertForSequenceClassification,
        PosEncBertConfig,
        BERT_POSITIONS,
    ),
    RobertaForTokenClassification: (
        PosEncBertForTokenClassification,
        PosEncBertConfig,
        BERT_POSITIONS,
    ),
    RobertaForQuestionAnswering: (
        PosEncBertForQuestionAnswering,
        PosEncBertConfig,
        BERT_POSITIONS,
    ),
}

# RoBERTa's parameter names -> PosEnc BERT's (prefixes). Its classification head (dense, tanh, out_proj on the first
# token) is BERT's pooler + classifier; its LM head (dense, gelu, LayerNorm, decoder) is BERT's prediction head.
ROBERTA_RENAMES = (
    ("roberta.", "bert."),
    ("lm_head.dense.", "cls.predictions.transform.dense."),
    ("lm_head.layer_norm.", "cls.predictions.transform.LayerNorm."),
    ("lm_head.decoder.", "cls.predictions.decoder."),
    ("lm_head.bias", "cls.predictions.bias"),
    ("classifier.dense.", "bert.pooler.dense."),
    ("classifier.out_proj.", "classifier."),
)

LEARNED_TABLE = "position_encoding.table.weight"


def convert(
    model: PreTrainedModel | str | Path,
    position_encoding: str | dict[str, Any] = "learned",
    attention_normalizer: str | dict[str, Any] = "softmax",
) -> PreTrainedModel:
    """Build the PosEnc model matching a stock ``model`` (or a folder or Hub id of one, loaded with the class its
    config names) and copy every weight into it.

    With ``learned`` the stock position table becomes the scheme's table, and the result computes what the stock
    model computes. RoBERTa numbers real tokens from ``padding_idx + 1``: its table keeps the rows from there on, so
    PosEnc position ``k`` is RoBERTa's ``padding_idx + 1 + k`` (the same outputs for unpadded and right-padded inputs;
    with left padding pass ``position_ids`` counting real tokens, as RoBERTa does). With any other scheme the stock
    table is dropped and the scheme's own parameters (if any, per-layer ones too) start from their init, as do the
    normalizer's (a Toeplitz gate starts at 1, so a gated softmax computes what the stock model computes). The stock
    model is left unchanged.
    """
    if isinstance(model, (str, Path)):
        model = load_stock_model(model)
    entry = STOCK_TO_POSENC.get(type(model))
    if entry is None:
        supported = ", ".join(cls.__name__ for cls in STOCK_TO_POSENC)
        raise ValueError(f"convert() takes a stock {supported}; got {type(model).__name__}.")
    posenc_class, config_class, stock_table = entry
    is_roberta = model.config.model_type == "roberta"
    if is_roberta and isinstance(model, RobertaForMaskedLM) and model.config.hidden_act != "gelu":
        raise ValueError(
            f"RoBERTa's LM head applies gelu; PosEnc BERT's applies hidden_act ({model.config.hidden_act!r}), so "
            "this RobertaForMaskedLM has no PosEnc equivalent."
        )
    offset = model.config.pad_token_id + 1 if is_roberta else 0
    config_dict = {k: v for k, v in model.config.to_dict().items() if k not in ("model_type", "architectures")}
    config_dict.update(position_encoding=position_encoding, attention_normalizer=attention_normalizer)
    config_dict["max_position_embeddings"] = model.config.max_position_embeddings - offset
    config = config_class.from_dict(config_dict)
    config._attn_implementation = model.config._attn_implementation

    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(stock_table):
            if config.position_encoding["type"] != "learned":
                continue
            name, tensor = name[: -len(stock_table)] + LEARNED_TABLE, tensor[offset:]
        for stock_prefix, posenc_prefix in ROBERTA_RENAMES if is_roberta else ():
            if name.startswith(stock_prefix):
                name = posenc_prefix + name[len(stock_prefix) :]
        state[name] = tensor

    with torch.device(model.device):
        converted = posenc_class(config).to(model.dtype)
    missing, unexpected = converted.load_state_dict(state, strict=False)
    # The scheme's own parameters, shared (position_encoding) or per layer (position_term), and the normalizers' (a
    # Toeplitz gate, at 1) start from their init.
    missing = [
        name
        for name in missing
        if ".position_encoding." not in f".{name}" and ".position_term." not in name and ".normalizer." not in name
    ]
    if missing or unexpected:
        raise ValueError(f"convert(): weights did not line up; missing {missing}, unexpected {unexpected}.")
    return converted.train(model.training)
