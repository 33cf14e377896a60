"""``convert``: a stock Transformers BERT, RoBERTa or GPT-2 model -> the matching PosEnc model, weights kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
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

from .configuration_posenc import PosEncBertConfig, PosEncGPT2Config, layout_name
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

POSENC_OF_STOCK_BERT = {
    BertModel: PosEncBertModel,
    BertForMaskedLM: PosEncBertForMaskedLM,
    BertForSequenceClassification: PosEncBertForSequenceClassification,
    BertForTokenClassification: PosEncBertForTokenClassification,
    BertForQuestionAnswering: PosEncBertForQuestionAnswering,
    BertForPreTraining: PosEncBertForPreTraining,
    BertLMHeadModel: PosEncBertLMHeadModel,
    BertForNextSentencePrediction: PosEncBertForNextSentencePrediction,
    BertForMultipleChoice: PosEncBertForMultipleChoice,
    RobertaModel: PosEncBertModel,
    RobertaForMaskedLM: PosEncBertForMaskedLM,
    RobertaForSequenceClassification: PosEncBertForSequenceClassification,
    RobertaForTokenClassification: PosEncBertForTokenClassification,
    RobertaForQuestionAnswering: PosEncBertForQuestionAnswering,
}
POSENC_OF_STOCK_GPT2 = {
    GPT2Model: PosEncGPT2Model,
    GPT2LMHeadModel: PosEncGPT2LMHeadModel,
    GPT2ForSequenceClassification: PosEncGPT2ForSequenceClassification,
}
STOCK_TO_POSENC: dict[type, tuple[type, type, str]] = {
    **{stock: (posenc, PosEncBertConfig, BERT_POSITIONS) for stock, posenc in POSENC_OF_STOCK_BERT.items()},
    **{stock: (posenc, PosEncGPT2Config, "wpe.weight") for stock, posenc in POSENC_OF_STOCK_GPT2.items()},
}
"""Each stock class ``convert`` takes: its PosEnc class, the PosEnc config class and the name of the stock position
table's parameter."""

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

STOCK_DISTANCE_TABLE = "attention.self.distance_embedding.weight"
"""Transformers 4.x's per-layer table of ``relative_key(_query)`` (``BertSelfAttention.distance_embedding``), which
v5 no longer builds: ``from_pretrained`` drops it, so it is read from the checkpoint's files."""

POSENC_DISTANCE_TABLE = "attention.self.position_term.distance_embedding.weight"

RELATIVE_TYPES = {"relative_key": "key", "relative_key_query": "key_query"}
"""4.x ``position_embedding_type`` -> the ``variant`` of the ``relative_key`` scheme."""


def own_position_encoding(config: Any) -> dict[str, Any]:
    """The scheme a stock config's ``position_embedding_type`` (a 4.x BERT-family field, "absolute" when absent)
    names: ``learned``, or ``relative_key`` with the checkpoint's variant and table length (4.x's ``2
    max_position_embeddings - 1`` rows, of the stock ``max_position_embeddings``, RoBERTa's padding offset included);
    ``ValueError`` for another."""
    kind = getattr(config, "position_embedding_type", None) or "absolute"
    if kind == "absolute":
        return {"type": "learned"}
    if kind not in RELATIVE_TYPES:
        raise ValueError(
            f"convert(): position_embedding_type={kind!r} of this {config.model_type} checkpoint has no hf_posenc "
            f"equivalent; convert() reads 'absolute' and {list(RELATIVE_TYPES)} (Transformers 4.x)."
        )
    return {"type": "relative_key", "variant": RELATIVE_TYPES[kind], "max_positions": config.max_position_embeddings}


def checkpoint_tensors(folder: Path, suffix: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder whose name ends with ``suffix``, from its ``*.safetensors`` files, else
    its ``pytorch_model*.bin`` files."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as weights:
            tensors.update({name: weights.get_tensor(name) for name in weights.keys() if name.endswith(suffix)})
    if tensors:
        return tensors
    for path in sorted(folder.glob("pytorch_model*.bin")):
        state = torch.load(path, map_location="cpu", weights_only=True)
        tensors.update({name: tensor for name, tensor in state.items() if name.endswith(suffix)})
    return tensors


def stock_distance_tables(model: PreTrainedModel, folder: Path | None) -> dict[str, torch.Tensor]:
    """The 4.x ``distance_embedding`` of every layer, named as the stock model names that layer's query weight
    (``...attention.self.query.weight`` -> ``...attention.self.distance_embedding.weight``): from the model if it
    holds them, else from its checkpoint folder (its keys with or without the base model's prefix); ``ValueError``
    when a layer has none."""
    state = model.state_dict()
    names = [
        name.removesuffix("attention.self.query.weight") + STOCK_DISTANCE_TABLE
        for name in state
        if name.endswith("attention.self.query.weight")
    ]
    stored = {name: state[name] for name in names if name in state}
    if len(stored) < len(names) and folder is not None:
        found = checkpoint_tensors(folder, STOCK_DISTANCE_TABLE)
        prefix = f"{model.base_model_prefix}."
        for name in names:
            for candidate in (name, name.removeprefix(prefix), prefix + name):
                if candidate in found:
                    stored[name] = found[candidate]
                    break
    missing = [name for name in names if name not in stored]
    if missing:
        where = (
            f"the checkpoint folder {folder} has no {missing[0]!r}"
            if folder is not None
            else "a Transformers v5 model does not hold 4.x's distance_embedding (from_pretrained drops it): pass "
            "convert() the checkpoint folder instead of the loaded model"
        )
        raise ValueError(
            f"convert(): this {model.config.model_type} checkpoint says position_embedding_type="
            f"{model.config.position_embedding_type!r}, whose per-layer distance tables are needed; {where}."
        )
    return stored


def resolve_conversion_scheme(
    requested: str | dict[str, Any] | None, own: dict[str, Any], config_class: type, config_dict: dict[str, Any]
) -> str | dict[str, Any]:
    """The scheme to build: the checkpoint's own (``requested`` None), or the one asked for. A scheme that names the
    checkpoint's own kind must be it: ``learned`` from a relative checkpoint (its absolute table was never used by
    4.x, so it is untrained), or ``relative_key`` with another variant or length, would silently be another model."""
    if requested is None:
        return own
    if own["type"] == "learned":
        return requested
    asked = config_class.from_dict({**config_dict, "position_encoding": requested}).position_encoding
    mine = config_class.from_dict({**config_dict, "position_encoding": own}).position_encoding
    if layout_name(asked) == "learned" or (layout_name(asked) == own["type"] and asked != mine):
        raise ValueError(
            f"convert(): this checkpoint was trained with position_encoding {mine} (Transformers 4.x "
            f"position_embedding_type relative_key(_query), no absolute positions); {asked} would not compute what it "
            "computes. Leave position_encoding unset to keep its own, or name a scheme of another kind to start that "
            "scheme's parameters from their init."
        )
    return requested


def convert(
    model: PreTrainedModel | str | Path,
    position_encoding: str | dict[str, Any] | None = None,
    attention_normalizer: str | dict[str, Any] = "softmax",
) -> PreTrainedModel:
    """Build the PosEnc model matching a stock ``model`` (or a folder or Hub id of one, loaded with the class its
    config names) and copy every weight into it.

    ``position_encoding`` None keeps the checkpoint's own positions: ``learned`` (absolute), or for a Transformers
    4.x BERT-family checkpoint whose config says ``position_embedding_type: relative_key(_query)`` (a type v5
    dropped), the ``relative_key`` scheme with its variant and the per-layer ``distance_embedding`` tables, read from
    the checkpoint folder (v5's ``from_pretrained`` does not load them, so pass the folder, not a loaded model); the
    result computes what 4.x computed. Any other ``position_embedding_type`` raises ``ValueError``.

    With ``learned`` the stock position table becomes the scheme's table, and the result computes what the stock
    model computes. RoBERTa numbers real tokens from ``padding_idx + 1``: its table keeps the rows from there on, so
    PosEnc position ``k`` is RoBERTa's ``padding_idx + 1 + k`` (the same outputs for unpadded and right-padded inputs;
    with left padding pass ``position_ids`` counting real tokens, as RoBERTa does). With any other scheme the stock
    table is dropped and the scheme's own parameters (if any, per-layer ones too) start from their init, as do the
    normalizer's (a Toeplitz gate starts at 1, so a gated softmax computes what the stock model computes). The stock
    model is left unchanged.
    """
    folder = None
    if isinstance(model, (str, Path)):
        folder = Path(model) if Path(model).is_dir() else None
        model = load_stock_model(model)
    entry = STOCK_TO_POSENC.get(type(model))
    if entry is None:
        supported = ", ".join(cls.__name__ for cls in STOCK_TO_POSENC)
        raise ValueError(
            f"convert() takes a stock {supported}; got {type(model).__name__}. For a Llama-family model (Llama, "
            "Mistral, Qwen2) use hf_posenc.retrofit(model, position_encoding=...), which switches the scheme in place "
            "(it also takes BERT-family and GPT-2 models)."
        )
    posenc_class, config_class, stock_table = entry
    is_roberta = model.config.model_type == "roberta"
    if is_roberta and isinstance(model, RobertaForMaskedLM) and model.config.hidden_act != "gelu":
        raise ValueError(
            f"RoBERTa's LM head applies gelu; PosEnc BERT's applies hidden_act ({model.config.hidden_act!r}), so "
            "this RobertaForMaskedLM has no PosEnc equivalent."
        )
    offset = model.config.pad_token_id + 1 if is_roberta else 0
    own = own_position_encoding(model.config)
    dropped = ("model_type", "architectures", "position_embedding_type")  # the last: read into `own`
    config_dict = {k: v for k, v in model.config.to_dict().items() if k not in dropped}
    config_dict.update(attention_normalizer=attention_normalizer)
    config_dict["max_position_embeddings"] = model.config.max_position_embeddings - offset
    config_dict["position_encoding"] = resolve_conversion_scheme(position_encoding, own, config_class, config_dict)
    config = config_class.from_dict(config_dict)
    config._attn_implementation = model.config._attn_implementation

    stock_state = model.state_dict()
    new_scheme = layout_name(config.position_encoding)  # a per-layer layout's: no table of the checkpoint's kind
    keeps_distance_tables = own["type"] == "relative_key" and new_scheme == "relative_key"
    if keeps_distance_tables:
        stock_state.update(stock_distance_tables(model, folder))
    state = {}
    for name, tensor in stock_state.items():
        if name.endswith(STOCK_DISTANCE_TABLE):
            if not keeps_distance_tables:
                continue
            name = name.removesuffix(STOCK_DISTANCE_TABLE) + POSENC_DISTANCE_TABLE
        if name.endswith(stock_table):
            if new_scheme != "learned":
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
    if keeps_distance_tables:  # the checkpoint's own tables: every layer's must have been loaded
        tables = [name for name in converted.state_dict() if name.endswith(POSENC_DISTANCE_TABLE)]
        missing += [name for name in tables if name not in state]
    if missing or unexpected:
        raise ValueError(f"convert(): weights did not line up; missing {missing}, unexpected {unexpected}.")
    return converted.train(model.training)
