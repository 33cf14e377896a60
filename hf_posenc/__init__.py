"""hf_posenc: every Transformer position encoding and attention normalizer as a config switch in BERT- and
GPT-2-style Transformers models. Importing the package registers both families with the Auto classes."""

from __future__ import annotations

from typing import Any

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForNextSentencePrediction,
    AutoModelForPreTraining,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from . import modeling_posenc_bert, modeling_posenc_gpt2
from .attention_normalizers import ATTENTION_NORMALIZERS
from .configuration_posenc import LAYOUT_PRESETS, PosEncBertConfig, PosEncGPT2Config, layout_preset
from .conversion import convert
from .modeling_posenc_bert import *  # noqa: F403 (the family's classes, its __all__)
from .modeling_posenc_bert import POSENC_BERT_MODELS
from .modeling_posenc_gpt2 import *  # noqa: F403
from .modeling_posenc_gpt2 import POSENC_GPT2_MODELS
from .position_encodings import POSITION_ENCODINGS
from .position_extension import extend_positions
from .probe import probe
from .retrofit import retrofit


__version__ = "0.1.0"

_AUTO_CLASSES = {
    "AutoModel": AutoModel,
    "AutoModelForCausalLM": AutoModelForCausalLM,
    "AutoModelForMaskedLM": AutoModelForMaskedLM,
    "AutoModelForMultipleChoice": AutoModelForMultipleChoice,
    "AutoModelForNextSentencePrediction": AutoModelForNextSentencePrediction,
    "AutoModelForPreTraining": AutoModelForPreTraining,
    "AutoModelForQuestionAnswering": AutoModelForQuestionAnswering,
    "AutoModelForSequenceClassification": AutoModelForSequenceClassification,
    "AutoModelForTokenClassification": AutoModelForTokenClassification,
}

for _config_class, _model_classes in ((PosEncBertConfig, POSENC_BERT_MODELS), (PosEncGPT2Config, POSENC_GPT2_MODELS)):
    AutoConfig.register(_config_class.model_type, _config_class, exist_ok=True)
    for _model_class in _model_classes:
        _AUTO_CLASSES[_model_class._auto_class].register(_config_class, _model_class, exist_ok=True)


def list_position_encodings() -> dict[str, dict[str, Any]]:
    """``{name: {"description": ..., "options": {option: {"default": ..., "doc": ...}}}}`` of every scheme."""
    return {name: scheme.describe() for name, scheme in POSITION_ENCODINGS.items()}


def list_attention_normalizers() -> dict[str, dict[str, Any]]:
    """``{name: {"description": ..., "options": {...}}}`` of every attention normalizer."""
    return {name: normalizer.describe() for name, normalizer in ATTENTION_NORMALIZERS.items()}


__all__ = [
    "LAYOUT_PRESETS",
    "layout_preset",
    "PosEncBertConfig",
    "PosEncGPT2Config",
    *modeling_posenc_bert.__all__,
    *modeling_posenc_gpt2.__all__,
    "convert",
    "extend_positions",
    "retrofit",
    "list_position_encodings",
    "list_attention_normalizers",
    "probe",
]
