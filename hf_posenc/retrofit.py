"""``retrofit``: switch the position encoding and attention normalizer of a stock Transformers model, in place.

Supported: the BERT family (``Bert*``, ``Roberta*`` and every model of BERT's structure: XLM-RoBERTa(-XL), CamemBERT,
ELECTRA, Data2VecText, ERNIE, BertGeneration, Megatron-BERT, BigBird, ...), ``GPT2*``, the Llama family (``Llama*``,
``Mistral*``, ``Qwen2*``, ``SmolLM3*``; any RoPE scaling hf_posenc's ``rope`` has, sliding windows), ``Qwen3*``, Gemma
3 text (``Gemma3ForCausalLM``, ``Gemma3TextModel``), ``Olmo3*``, ``GptOss*`` and ``ModernBert*``, all heads; ALiBi
decoders with fused q/k/v projections (BLOOM, MPT: :class:`FusedAlibiFamily`, as their own ``alibi``); and any
other causal LM whose attention calls Transformers' attention interface with its rotary module's
``position_embeddings``, or with no positions at all (:class:`InterfaceFamily`: MoE models among them, through the two
seams, the rotary module and an attention function registered with ``AttentionInterface``; their layers in
``base_model.layers`` or another list, a learned position table beside them, OPT's, BioGPT's, GPT-BigCode's, as their
own ``learned``; the attention layers of hybrids, whose linear-attention, Mamba and convolution layers keep their
modules and cache layers; NoPE models; MLA models, their rotary part of each head switched;
``docs/retrofit_coverage.md`` lists every causal LM of the installed Transformers). The model's own layout is kept by
default: its rotary parameters per layer type, NoPE layers, windows (``layer_types``, ``sliding_window``, read by the
masks and caches as the stock model reads them), QK-norm and sinks. The model keeps its class; its modules are
patched:

* the base model gets its own ``forward`` (an instance attribute wrapping the stock one, :func:`retrofit_forward`),
  which does, once per forward, what a PosEnc model does before its layers, then calls the stock ``forward``: resolve
  the position ids (the stock rule: ``past .. past + seq``; RoBERTa counts non-padding tokens after ``padding_idx``;
  given ``position_ids`` count from 0 in every family, where stock RoBERTa reads them as rows of its table, so the
  ones ``generate`` hands over put a retrofitted RoBERTa at the positions of its stock forward), keep key positions
  with the KV cache (:class:`PositionCache`), combine the token embeddings with positions through the scheme's
  ``embed`` hook, and build the :data:`AttentionInputs` with :func:`prepare_attention` (told when the
  positions are the consecutive default ones, so that a relative bias is built once per distance). The stock forward
  then runs on these ``inputs_embeds`` (its own position table is gone: BERT's embeddings module passes them through,
  GPT-2's ``wpe`` adds nothing), and Transformers hands two keyword arguments down to every attention layer: the
  attention inputs and the scheme. Being the ``forward`` itself (with the stock signature), the set-up runs through
  every entry point: ``model(...)``, ``model.forward(...)`` (which skips module hooks), ``torch.compile`` and
  accelerate's hooks, which wrap ``forward``;
* each layer becomes ``Retrofit<Layer>`` (a subclass of its stock class): it passes the attention inputs to its
  checkpointed ``forward`` as positional tensors, so reentrant activation checkpointing recomputes through them;
* each self-attention module becomes ``Retrofit<Attention>``: the stock projections around
  :func:`positional_attention`, the one attention composition; it owns the normalizer and the scheme's per-layer
  :class:`LayerPositionTerm` (``build_attention_normalizer``, ``build_layer_position_term``).

``save_pretrained`` writes the stock weights with the new ones, a config whose ``model_type`` is
``posenc_retrofit_<stock type>`` with ``position_encoding``, ``attention_normalizer`` and ``auto_map``, and
``modeling_retrofit.py``: subclasses of the stock classes whose ``__init__`` re-applies the patch, next to this module
and the hf_posenc modules it imports (single-dot relative imports). So ``AutoModel*.from_pretrained(folder,
trust_remote_code=True)`` loads it back patched, with or without hf_posenc installed; without
``trust_remote_code`` Transformers refuses the unknown model type instead of loading the stock model silently. The
patch also gives the saved type PEFT's default target modules of the stock type (of BERT, GPT-2 or Llama where PEFT
has none for it, e.g. CamemBERT), so LoRA needs no ``target_modules`` (``register_peft_default_targets``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import itertools
import json
import math
import shutil
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from transformers import AttentionInterface, AutoConfig, PretrainedConfig, PreTrainedModel, masking_utils
from transformers.cache_utils import Cache, DynamicCache, StaticCache
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.auto import modeling_auto
from transformers.utils import logging

from .attention_normalizers import AttentionNormalizer
from .configuration_posenc import (
    ATTENTION_LAYER_TYPES,
    attention_layer_specs,
    check_layer_windows,
    check_linear_layer_positions,
    config_layer_types,
    layer_position_specs,
    layout_name,
    resolve_attention_normalizer,
    resolve_position_layout,
)
from .modeling_posenc_common import (
    SEQUENCE_PARALLEL_ATTENTION,
    attention_dims,
    build_attention_normalizer,
    build_query_key_norms,
    pairs_head_halves,
    parallelism_refusals,
    prepare_attention,
    register_peft_default_targets,
    resolve_position_ids,
    shard_heads,
)
from .posenc_attention import positional_attention
from .position_encodings import POSITION_ENCODINGS, build_position_encoding_module
from .position_interface import (
    CACHE_NAME,
    AttentionInputs,
    EmbeddingInputs,
    LayerPositionTerm,
    PositionCache,
    PositionEncoding,
    given_cache,
)
from .rotary_encodings import ROPE_SCALING_OPTIONS, TRANSFORMERS_SCALING_KEYS


logger = logging.get_logger(__name__)

ATTENTION_INPUTS = "posenc_attention_inputs"
POSITION_ENCODING = "posenc_position_encoding"
MODELING_FILE = "modeling_retrofit.py"
AUTO_CLASSES = {
    "AutoModelForCausalLM": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    "AutoModelForMaskedLM": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    "AutoModelForSequenceClassification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    "AutoModelForTokenClassification": modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    "AutoModelForQuestionAnswering": modeling_auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    "AutoModelForMultipleChoice": modeling_auto.MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES,
    "AutoModelForPreTraining": modeling_auto.MODEL_FOR_PRETRAINING_MAPPING_NAMES,
}


# Per-layer pieces: mixed into the stock classes (``Retrofit<Stock>``), so hooks, output capturing and
# ``isinstance`` checks of Transformers keep working.


class RetrofitLayer:
    """Mixin of a stock ``GradientCheckpointingLayer``: the :data:`AttentionInputs` its attention reads reach the
    (checkpointed) ``forward`` flattened into positional arguments, as in :class:`PositionalLayer`. Where a stock
    module above drops keyword arguments (Megatron-BERT's encoder, BLOOM's and MPT's models), they come from its
    attention's stash (:func:`stashed_for_attention`); the ``forward`` stashes what it carries on its attention for
    its own duration (:func:`carried_to_attention`), so a stock layer that drops them too (Nemotron's, StableLM's)
    hands them on, also when activation checkpointing recomputes it in the backward pass, after the retrofitted
    forward's stash is gone."""

    posenc_layer_idx: int
    """The layer's index among the attention layers, set by :func:`patch`: it reads its own attention inputs."""

    def __call__(self, *args, **kwargs):
        attention = self.__dict__.get(LAYER_ATTENTION)
        stash = attention.__dict__.get(STASH) if attention is not None else None
        if ATTENTION_INPUTS in kwargs:
            inputs, rest = kwargs.pop(ATTENTION_INPUTS)[self.posenc_layer_idx], None
        elif stash:  # a stock module above dropped them: its attention's stash has them
            inputs = stash[ATTENTION_INPUTS]
            rest = {name: value for name, value in stash.items() if name != ATTENTION_INPUTS}
        else:
            return super().__call__(*args, **kwargs)
        leaves, spec = tree_flatten(inputs)
        return super().__call__(*args, *leaves, posenc_layout=(len(args), spec, rest), **kwargs)

    def forward(self, *args, posenc_layout=None, **kwargs):
        if posenc_layout is None:  # called without the attention inputs (see __call__)
            return super().forward(*args, **kwargs)
        num_args, spec, rest = posenc_layout
        inputs = tree_unflatten(list(args[num_args:]), spec)
        if rest is None:  # handed down as keyword arguments: the stock layer passes them on, or drops them
            kwargs[ATTENTION_INPUTS] = inputs
            rest = {name: kwargs[name] for name in (POSITION_ENCODING, CACHE_NAME, RETROFIT_CACHE) if name in kwargs}
        with carried_to_attention(self.__dict__.get(LAYER_ATTENTION), {**rest, ATTENTION_INPUTS: inputs}):
            return super().forward(*args[:num_args], **kwargs)


LAYER_ATTENTION = "posenc_attention"
"""A patched attention layer's attribute (not a submodule) holding its attention module (set by :func:`patch`)."""


@contextlib.contextmanager
def carried_to_attention(attention: nn.Module | None, carried: dict[str, Any]) -> Iterator[None]:
    """``carried`` (the layer's attention inputs, the scheme, the cache) stashed on ``attention`` while its layer's
    ``forward`` runs, the previous stash restored afterwards: the attention reads what a stock layer does not hand it
    (:func:`stashed_arguments`). Not while compiling (the keyword path)."""
    if attention is None or torch.compiler.is_compiling():
        yield
        return
    previous = attention.__dict__.get(STASH)
    attention.__dict__[STASH] = carried
    try:
        yield
    finally:
        if previous is None:
            attention.__dict__.pop(STASH, None)
        else:
            attention.__dict__[STASH] = previous


class RetrofitStateLayer:
    """Mixin of a stock hybrid's layer that is not an attention layer (its ``config.layer_types`` entry is not one of
    :data:`ATTENTION_LAYER_TYPES`: linear attention, Mamba, a short convolution, an MLP-only block): its modules stay
    as they are and it reads and writes its own states in the stock model's cache (Transformers'
    ``LinearAttentionLayer`` of its layer type), which the retrofitted forward hands it under :data:`RETROFIT_CACHE`
    while the stock forward runs without one (the attention layers' keys reach the cache through
    :func:`interface_attention` only). The attention inputs and the scheme are not its arguments."""

    def __call__(self, *args, **kwargs):
        kwargs.pop(ATTENTION_INPUTS, None)
        kwargs.pop(POSITION_ENCODING, None)
        cache = kwargs.pop(RETROFIT_CACHE, None)
        if cache is not None:
            kwargs[CACHE_NAME] = cache
            if "use_cache" in kwargs:
                kwargs["use_cache"] = True
        return super().__call__(*args, **kwargs)


class RetrofitLayerBesideState(RetrofitLayer):
    """Mixin of a stock layer holding attention beside a recurrent mixer (:data:`ATTENTION_BESIDE_STATE_TYPES`:
    Falcon-H1's): an attention layer (:class:`RetrofitLayer`) whose recurrent mixer reads and writes its states in the
    cache as the stock layer hands it (:class:`RetrofitStateLayer`'s), while its attention stores its keys through
    :func:`interface_attention` only (:class:`RetrofitAttentionBesideState`)."""

    def __call__(self, *args, **kwargs):
        cache = kwargs.get(RETROFIT_CACHE)
        if cache is not None:
            kwargs[CACHE_NAME] = cache
            if "use_cache" in kwargs:
                kwargs["use_cache"] = True
        return super().__call__(*args, **kwargs)


class RetrofitAttentionBesideState:
    """Mixin of the attention module of a :class:`RetrofitLayerBesideState`: called without the cache its layer
    hands it (the stock module would store its keys before the attention function); :func:`interface_attention`
    gets the cache under :data:`RETROFIT_CACHE` and stores them after the scheme's transform."""

    def __call__(self, *args, **kwargs):
        if kwargs.get(CACHE_NAME) is not None:
            kwargs[CACHE_NAME] = None
        return super().__call__(*args, **kwargs)


class RetrofitIndexer:
    """Mixin of the indexer of an attention layer over selected keys (:data:`SELECTING_ATTENTION_TYPES`): it runs as
    in the stock model, on the stock rotary embedding (its own rotation of its q and k, kept whatever scheme the
    attention runs: it picks the keys, the scheme scores them) and with the KV cache, where it keeps its keys (the
    stock attention module around it is called without the cache: :func:`interface_attention` stores the
    attention's keys)."""

    def forward(self, *args, **kwargs):
        bound = inspect.signature(super().forward).bind(*args, **kwargs)
        arguments = bound.arguments
        rotary = self.__dict__[INDEXER_ROTARY]
        hidden, positions = arguments["hidden_states"], arguments["position_ids"]
        arguments["position_embeddings"] = type(rotary).forward(rotary, hidden, positions)
        stash = self.__dict__[INDEXER_ATTENTION].__dict__.get(STASH) or {}
        arguments[CACHE_NAME] = stash.get(RETROFIT_CACHE)
        return super().forward(*bound.args, **bound.kwargs)


INDEXER_ROTARY, INDEXER_ATTENTION = "posenc_stock_rotary", "posenc_indexed_attention"
"""An indexer's attributes (not submodules) holding the base model's rotary module and its attention module."""


class RetrofitAttention:
    """Mixin of a stock self-attention module: its own q/k/v projections, then :func:`positional_attention` with the
    scheme, the layer's normalizer and position term. Subclasses say how the stock module projects."""

    q_norm: nn.Module | None
    k_norm: nn.Module | None
    """Per-head QK-norm (the model's own, or :class:`QueryKeyRMSNorm` from ``use_qk_norm``), or None; set by
    :func:`patch`."""

    def project_heads(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(batch, seq, hidden)`` -> the stock q, k, v projections as ``(batch, heads, seq, head_dim)``."""
        raise NotImplementedError

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as ``(batch, heads, seq, head_dim)``: the projections, then the QK-norm of each head where the
        layer has one, before the position encoding (``Qwen3Attention``'s order)."""
        query, key, value = self.project_heads(hidden_states)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        return query, key, value

    def project_query_key(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's q and k projections of ``(rows, hidden)`` vectors, ``(heads, rows, head_dim)`` each (keys
        repeated over the query heads they serve under grouped-query attention)."""
        query, key, _ = self.project(states[None])
        return query[0], key[0].repeat_interleave(query.shape[1] // key.shape[1], dim=0)

    def attend(self, hidden_states, kwargs, *, scaling, dropout, causal):
        """The stock layer hands the KV cache down under the installed Transformers' name (:data:`CACHE_NAME`); what
        a stock module above did not hand down comes from the forward's stash (:func:`stashed_arguments`)."""
        kwargs = stashed_arguments(self, kwargs)
        query, key, value = self.project(hidden_states)
        output, weights = positional_attention(
            query,
            key,
            value,
            kwargs[ATTENTION_INPUTS],
            kwargs[POSITION_ENCODING],
            self.normalizer,
            self.position_term,
            scaling=scaling,
            dropout=dropout,
            training=self.training,
            causal=causal,
            cache=kwargs.get(CACHE_NAME),
            layer_idx=self.layer_idx,
            project_query_key=self.project_query_key,
            hidden_states=hidden_states,
        )
        return output.reshape(*hidden_states.shape[:-1], -1), weights


class RetrofitBertSelfAttention(RetrofitAttention):
    """BERT-like self-attention (``query``, ``key``, ``value`` of ``attention_head_size`` heads, scaling
    ``attention_head_size ** -0.5``), also of the models whose copies of it predate the attention interface
    (Megatron-BERT, BigBird's full attention: no ``scaling`` or ``is_causal`` attribute, causal as decoders)."""

    def project_heads(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
        return tuple(layer(hidden_states).view(shape).transpose(1, 2) for layer in (self.query, self.key, self.value))

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        scaling = getattr(self, "scaling", self.attention_head_size**-0.5)
        causal = getattr(self, "is_causal", self.is_decoder)
        return self.attend(hidden_states, kwargs, scaling=scaling, dropout=self.dropout.p, causal=causal)


class RetrofitRoFormerSelfAttention(RetrofitBertSelfAttention):
    """RoFormer's self-attention: BERT's projections, its q and k features read in hf_posenc's rope layout (its
    rotation pairs the features ``(2i, 2i + 1)``: :func:`half_layout_order`, ``"interleaved"``; the same permutation
    of q and k keeps ``q . k``), so its own ``rope`` rotates them as the stock module does."""

    def project_heads(self, hidden_states):
        query, key, value = super().project_heads(hidden_states)
        size = self.attention_head_size
        order = half_layout_order(size, size, "interleaved")
        return query[..., order], key[..., order], value


class RetrofitGPT2Attention(RetrofitAttention):
    def project_heads(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        return tuple(t.view(shape).transpose(1, 2) for t in self.c_attn(hidden_states).split(self.split_size, dim=2))

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        output, weights = self.attend(
            hidden_states, kwargs, scaling=self.scaling, dropout=self.attn_dropout.p, causal=True
        )
        return self.resid_dropout(self.c_proj(output)), weights


class RetrofitLlamaAttention(RetrofitAttention):
    """Llama-like attention (Llama, Mistral, Qwen2/3, SmolLM3, Gemma 3, gpt-oss): ``q_proj``, ``k_proj``, ``v_proj``
    (Qwen3's and Gemma 3's ``q_norm``/``k_norm`` are per head: :meth:`RetrofitAttention.project`). The scaling is
    the module's own (Gemma 3: ``query_pre_attn_scalar ** -0.5``)."""

    def project_heads(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        return tuple(
            layer(hidden_states).view(shape).transpose(1, 2) for layer in (self.q_proj, self.k_proj, self.v_proj)
        )

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        output, weights = self.attend(
            hidden_states, kwargs, scaling=self.scaling, dropout=self.attention_dropout, causal=True
        )
        return self.o_proj(output), weights


class RetrofitGPTNeoSelfAttention(RetrofitLlamaAttention):
    """GPT-Neo's self-attention (one module down, ``attn.attention``): Llama's ``q_proj``, ``k_proj``, ``v_proj``
    (without bias), unscaled scores (its ``_attn`` divides by nothing), ``out_proj`` and ``resid_dropout``; its local
    layers' window is the layer types' (:meth:`GPTNeoFamily.stock_layer_layout`). Its scores in float32 at least, as
    the stock module's, on eager; SDPA and FlexAttention in the model's dtype."""

    @property
    def layer_idx(self) -> int:
        return self.layer_id

    def forward(self, hidden_states, attention_mask=None, layer_past=None, use_cache=False, **kwargs):
        kwargs.pop("output_attentions", None)
        output, weights = self.attend(hidden_states, kwargs, scaling=1.0, dropout=self.attn_dropout.p, causal=True)
        return self.resid_dropout(self.out_proj(output)), weights


class RetrofitOlmo3Attention(RetrofitLlamaAttention):
    """OLMo 3's attention: its ``q_norm``/``k_norm`` are RMSNorms of the whole projections (``num_heads * head_dim``
    features, not per head), applied before the split into heads, as ``Olmo3Attention``."""

    def project(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key, value = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        return tuple(t.view(shape).transpose(1, 2) for t in (query, key, value))


NO_SINK_LOGIT = -1e4
"""The learned sink logit a retrofit gives the attention layers without sinks of a model that has them on others
(MiMo-V2): ``e^-10000`` is 0 in every float format, so those rows sum to 1, as the stock layers' do, and its gradient
is 0; one normalizer serves every layer."""


class SinksInNormalizer:
    """Mixin of an attention module with per-head attention sinks (gpt-oss; through the attention interface, those
    of e.g. Granite SWA and Flint): they are the ``softmax`` normalizer's learned ``sink`` (``e^b / (e^c
    + sum_j e^b)``, as ``eager_attention_forward``'s extra column). The stock parameter is moved into the normalizer
    (``normalizer.sink``); ``sinks`` reads it there (the stock ``_init_weights`` initialises it by that name, the stock
    forward hands it to the attention function, which the retrofit's ignores), an empty tensor under a normalizer
    without a learned sink."""

    @property
    def sinks(self) -> torch.Tensor:
        sink = getattr(self.normalizer, "sink", None)
        return sink if sink is not None else torch.empty(0)


class RetrofitGptOssAttention(SinksInNormalizer, RetrofitLlamaAttention):
    """gpt-oss's attention: Llama's projections, its ``sinks`` in the normalizer (:class:`SinksInNormalizer`)."""


class RetrofitModernBertAttention(RetrofitAttention):
    """ModernBERT's attention: q, k, v from the fused ``Wqkv``, scaling ``head_dim ** -0.5``, bidirectional (local
    layers: the window of ``local_attention`` tokens from the layer types' masks), then ``Wo`` and ``out_drop``."""

    def project_heads(self, hidden_states):
        qkv = self.Wqkv(hidden_states).view(*hidden_states.shape[:-1], 3, -1, self.head_dim)
        return tuple(t.transpose(1, 2) for t in qkv.unbind(dim=-3))

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        output, weights = self.attend(
            hidden_states, kwargs, scaling=self.head_dim**-0.5, dropout=self.attention_dropout, causal=False
        )
        return self.out_drop(self.Wo(output)), weights


class RetrofitFusedAlibiAttention(RetrofitAttention):
    """Attention whose stock module adds an ALiBi bias its base model built (BLOOM's ``query_key_value``, per head
    ``(q, k, v)``, then ``dense`` and the residual; MPT's ``Wqkv``, ``(q, k, v)`` of all heads, clipped by
    ``clip_qkv``, then ``out_proj``): the stock projections around :func:`positional_attention`; the stock bias
    (its ``alibi`` or ``position_bias`` argument) is not read, the scheme's is (the model's own ``alibi``: the same
    slopes, the same scores up to a constant per query, which the softmax drops)."""

    def project_heads(self, hidden_states):
        shape = hidden_states.shape[:-1]
        if hasattr(self, "query_key_value"):  # BLOOM: (heads, 3, head_dim)
            qkv = self.query_key_value(hidden_states).view(*shape, self.num_heads, 3, self.head_dim)
            return tuple(qkv[..., idx, :].transpose(1, 2) for idx in range(3))
        qkv = self.Wqkv(hidden_states)  # MPT: (3, heads, head_dim)
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        return tuple(t.view(*shape, -1, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))

    def forward(self, hidden_states, *args, **kwargs):
        if hasattr(self, "query_key_value"):  # BLOOM: forward(hidden_states, residual, alibi, attention_mask, ...)
            residual = args[0] if args else kwargs.pop("residual")
            kwargs = {k: v for k, v in kwargs.items() if k not in ("alibi", "attention_mask", "layer_past")}
            output, weights = self.attend(
                hidden_states, kwargs, scaling=self.inv_norm_factor, dropout=self.attention_dropout.p, causal=True
            )
            output = nn.functional.dropout(self.dense(output), p=self.hidden_dropout, training=self.training)
            return residual + output, weights
        kwargs = {k: v for k, v in kwargs.items() if k not in ("position_bias", "attention_mask")}
        output, weights = self.attend(
            hidden_states, kwargs, scaling=self.softmax_scale, dropout=self.attn_dropout_p, causal=True
        )
        return self.out_proj(output), weights


class RetrofitBertEmbeddings:
    """Mixin of BERT's embeddings module: the pre-hook has already combined word, token-type and positions (through
    the scheme) and applied this module's LayerNorm and dropout, so the stock forward's call passes them through."""

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, **kwargs):
        return inputs_embeds


class NoStockPositions(nn.Module):
    """Stands in for a stock position table after a retrofit (GPT-2's ``wpe``, OPT's and BioGPT's offset tables,
    GPT-BigCode's ``wpe``): the scheme combined positions with the token embeddings before the stock forward, so the
    stock ``inputs_embeds + table(...)`` adds 0, whatever its arguments (position ids, OPT's attention mask)."""

    def forward(self, *args, **kwargs) -> torch.Tensor:
        tensor = next(arg for arg in (*args, *kwargs.values()) if isinstance(arg, torch.Tensor))
        return torch.zeros((), device=tensor.device)


def table_rows(table: nn.Module) -> torch.Tensor:
    """The rows of a stock absolute position table: an ``nn.Embedding``'s weight, or the one tensor (a parameter or
    buffer) of another table module (:func:`reads_its_rows`)."""
    if isinstance(table, nn.Embedding):
        return table.weight
    return next(itertools.chain(table.parameters(), table.buffers()))


def reads_its_rows(module: nn.Module, width: int) -> bool:
    """Whether ``module`` is a table of absolute positions that the retrofit can keep as its rows: it holds one
    tensor (a parameter or buffer), of shape ``(rows, width)``, and its forward at ``position_ids`` 0 .. n - 1 gives
    the rows from its ``offset`` (0 where it has none) exactly, as XGLM's sinusoidal table does from 2 (its rows are
    read, not recomputed). On a model built without weights (meta) the structure alone is checked."""
    tensors = list(itertools.chain(module.parameters(), module.buffers()))
    offset = getattr(module, "offset", 0)
    if len(tensors) != 1 or tensors[0].dim() != 2 or tensors[0].shape[-1] != width or not isinstance(offset, int):
        return False
    rows = tensors[0].detach()
    if rows.is_meta:  # a model built without weights (a saved retrofit loading): its forward is not run
        return True
    count = min(8, rows.shape[0] - offset)
    if count < 1:
        return False
    try:
        with torch.no_grad():
            out = module(position_ids=torch.arange(count, device=rows.device)[None])
    except Exception:  # a forward of other arguments: not a table read by position ids
        return False
    return (
        isinstance(out, torch.Tensor)
        and out.shape == (1, count, width)
        and torch.equal(out[0].to(rows.dtype), rows[offset : offset + count])
    )


@functools.cache
def retrofit_class(stock_class: type, mixin: type) -> type:
    """``Retrofit<Stock>``: ``mixin`` over the stock class (made once per pair)."""
    return type(f"Retrofit{stock_class.__name__}", (mixin, stock_class), {"__module__": __name__})


@functools.cache
def retrofit_forward(stock_class: type, family: StockFamily) -> Callable:
    """The ``forward`` of a retrofitted base model of ``stock_class`` (made once per pair): :func:`prepare_forward`,
    then the stock ``forward``. It wraps the stock one (``functools.wraps``), so ``inspect.signature`` (Trainer's
    column filter, pipelines) still reads the stock arguments."""
    stock_forward = stock_class.forward
    parameters = list(inspect.signature(stock_forward).parameters.values())[1:]  # without ``self``
    signature = inspect.Signature(parameters)

    @functools.wraps(stock_forward)
    def forward(self, *args, **kwargs):
        call = prepare_forward(family, self, signature.bind(*args, **kwargs).arguments)
        with stashed_for_attention(self, call):
            output = stock_forward(self, **call)
        return family.stock_output(output, call)

    return forward


STASH = "posenc_stash"
"""The attribute under which a retrofitted attention module finds, for the duration of one forward, the keyword
arguments the retrofitted forward hands down (:func:`stashed_for_attention`)."""
ATTENTION_MODULES = "posenc_attention_modules"
"""The base model's attribute holding its patched attention modules by layer index (set by :func:`patch`)."""


@contextlib.contextmanager
def stashed_for_attention(base: nn.Module, call: dict[str, Any]) -> Iterator[None]:
    """Give each patched attention module the arguments the retrofitted forward hands down (its layer's attention
    inputs, the scheme, the cache) for the duration of the stock forward, beside the keyword arguments: a stock layer,
    encoder or attention wrapper that calls the next module with named arguments only (Nemotron's and StableLM's
    decoder layers, Megatron-BERT's encoder) drops them, and the attention reads what it misses here
    (:func:`stashed_arguments`). Not while compiling (the keyword path, which every other model takes); the
    recomputation of activation checkpointing, after this stash is gone, reads what each :class:`RetrofitLayer`
    carries into its checkpointed ``forward`` and stashes on its attention again (:func:`carried_to_attention`)."""
    attentions = base.__dict__.get(ATTENTION_MODULES) or {}
    if not attentions or torch.compiler.is_compiling():
        yield
        return
    shared = {name: call[name] for name in (POSITION_ENCODING, CACHE_NAME, RETROFIT_CACHE) if name in call}
    for idx, attention in attentions.items():
        attention.__dict__[STASH] = {**shared, ATTENTION_INPUTS: call[ATTENTION_INPUTS][idx]}
    try:
        yield
    finally:
        for attention in attentions.values():
            attention.__dict__.pop(STASH, None)


def stashed_arguments(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` completed by what the retrofitted forward stashed on ``module`` (:func:`stashed_for_attention`);
    ``ValueError`` naming the way out where the attention inputs reach it by neither."""
    stash = module.__dict__.get(STASH)
    if stash:
        kwargs = {**stash, **kwargs}
    if ATTENTION_INPUTS not in kwargs:
        raise ValueError(
            f"{type(module).__name__} of a retrofitted model got no attention inputs: a stock module above it drops "
            "keyword arguments, and the retrofitted forward's stash is not read under torch.compile; run it without "
            "torch.compile."
        )
    return kwargs


# Families: where a stock model keeps its layers, attention, embeddings and position table.


@dataclasses.dataclass(frozen=True)
class StockFamily:
    name: str
    attention_classes: tuple[str, ...]
    attention_mixin: type
    peft_model_type: str  # whose PEFT default targets a saved model type of the family gets if its own has none
    qk_norm: str | None = None  # the family's own QK-norm: "head" (Qwen3, Gemma 3), "projection" (OLMo 3), None
    sinks: bool = False  # whether the attention has gpt-oss's per-head ``sinks``

    def layers(self, base: nn.Module) -> list[nn.Module]:
        raise NotImplementedError

    def attention(self, layer: nn.Module) -> nn.Module:
        raise NotImplementedError

    def matches(self, base: nn.Module, class_names: set[str]) -> bool:
        """Whether a stock base model (holding modules of ``class_names``) is of this family: by its attention
        classes."""
        return bool(class_names & set(self.attention_classes))

    def check_model(self, model: PreTrainedModel) -> None:
        """Raise on a module layout of a matched model the patch cannot reproduce."""

    def causal(self, config) -> bool:
        return True

    def attention_dropout(self, config) -> float:
        raise NotImplementedError

    def position_offset(self, base: nn.Module) -> int:
        """Rows of the stock position table before position 0 (RoBERTa: ``padding_idx + 1``)."""
        return 0

    def stock_table(self, base: nn.Module) -> nn.Embedding | None:
        return None

    def stock_layer_layout(self, config) -> tuple[list[str], int | None] | None:
        """The layer types and sliding window of a family whose config names them otherwise than Transformers'
        ``layer_types`` and ``sliding_window`` (GPT-Neo's ``attention_layers``, ``window_size``), which the retrofit
        writes under those names; None where the config's are read as they are."""
        return None

    def embedding_size(self, base: nn.Module) -> int | None:
        """The width of the token embeddings where they are projected to ``hidden_size`` (an input-side scheme acts
        at that width); None where they are ``hidden_size`` wide."""
        return None

    def max_positions(self, config) -> int:
        """The length of a switched scheme's tables, written as ``config.max_position_embeddings`` where the stock
        config names none (:class:`FusedAlibiFamily`)."""
        return config.max_position_embeddings

    def own_scheme(self, config) -> dict[str, Any]:
        """The spec under which the patched model computes what the stock model computes. A Transformers 4.x
        ``position_embedding_type`` other than "absolute" (``relative_key(_query)``, which v5 no longer builds: its
        distance tables were dropped when the model was loaded) has none: ``ValueError``."""
        kind = getattr(config, "position_embedding_type", None) or "absolute"
        if kind != "absolute":
            raise ValueError(
                f"retrofit(): this {config.model_type} model's config says position_embedding_type={kind!r} "
                "(Transformers 4.x), which v5 does not build: the loaded model lacks its distance tables. Use "
                "hf_posenc.convert(<checkpoint folder>), which reads them, or name the scheme to switch to "
                "(position_encoding=...)."
            )
        return {"type": "learned"}

    def own_rotary(self, config) -> list[dict[str, Any] | None] | None:
        """The ``rope`` spec of each layer's own rotary parameters (a NoPE layer's too: those of its layer type; None
        for a layer type without any, Beam's full layers), from which a rotary variant named in a retrofit starts;
        None for a model without rotary embeddings."""
        return None

    def own_normalizer(self, config) -> str | dict[str, Any]:
        """The normalizer under which the patched model computes what the stock model computes: ``softmax``, with
        gpt-oss's learned sinks (``sink="learned"``) where the family has them."""
        return {"type": "softmax", "sink": "learned"} if self.sinks else "softmax"

    def remove_stock_positions(self, base: nn.Module) -> None:
        """Take the input-side positions out of the stock forward (the scheme's ``embed`` replaces them)."""

    def default_positions_are_consecutive(self, base: nn.Module, input_ids: torch.Tensor | None) -> bool:
        """Whether :meth:`default_position_ids` are ``past .. past + seq - 1`` in every row (a static fact, passed
        to :func:`prepare_attention` as ``default_positions``, which lets a relative scheme build its bias once per
        distance)."""
        return True

    def default_position_ids(
        self, base, input_ids, inputs_embeds, past_length: int, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return resolve_position_ids(None, inputs_embeds, past_length)

    def embed(self, base: nn.Module, encoding: PositionEncoding, inputs: EmbeddingInputs, call: dict) -> torch.Tensor:
        return encoding.embed(inputs)

    def patch_attention(self, attention: nn.Module, config, causal: bool) -> list[nn.Module]:
        """Make ``attention`` (given its ``normalizer`` and ``position_term``) run :func:`positional_attention`: its
        class becomes ``Retrofit<Attention>``, gpt-oss's ``sinks`` move into the normalizer, the QK-norm is kept,
        removed or added per ``config.use_qk_norm``; returns the modules it added."""
        weight = next(attention.parameters())
        if self.sinks:  # moved into the normalizer (RetrofitGptOssAttention.sinks reads it there)
            del attention.sinks
        attention.__class__ = retrofit_class(type(attention), self.attention_mixin)
        use_qk_norm = getattr(config, "use_qk_norm", False)
        has_qk_norm = getattr(attention, "q_norm", None) is not None
        if has_qk_norm and not use_qk_norm:
            del attention.q_norm, attention.k_norm
        if not has_qk_norm or not use_qk_norm:
            eps = next(
                getattr(config, name)
                for name in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
                if hasattr(config, name)
            )
            attention.q_norm, attention.k_norm = build_query_key_norms(
                config, attention_dims(config, causal).head_dim, eps
            )
        if attention.q_norm is not None and not has_qk_norm:
            return [attention.q_norm.to(weight.device, weight.dtype), attention.k_norm.to(weight.device, weight.dtype)]
        return []

    def applies_softcapping(self, model: PreTrainedModel) -> bool:
        """Whether the stock attention caps its scores by ``config.attn_logit_softcapping`` (Gemma 3's config has the
        field, its attention passes no softcap)."""
        return False

    def patch_rotary(self, base: nn.Module) -> None:
        """Take the stock rotary embedding out where the stock attention still applies it (the attention-interface
        family); the other families' attention modules no longer read it."""

    def stock_attention_mask(self, config, inputs_embeds, attention_mask, position_ids, cache) -> Any:
        """The ``attention_mask`` the stock forward gets: None, as the masks live in the attention inputs (sparing
        the stock forward building its own)."""
        return None

    def hand_down(self, call: dict[str, Any], cache) -> None:
        """Put the KV cache in the stock forward's arguments: here its attention layers read it (under
        :data:`CACHE_NAME`) and give it to :func:`positional_attention`."""
        call[CACHE_NAME] = cache

    def stock_output(self, output, call: dict[str, Any]):
        """The stock forward's output as the retrofitted model returns it."""
        return output

    def check(self, config) -> None:
        """Raise on a configuration the patched attention cannot reproduce."""
        if getattr(config, "add_cross_attention", False):
            raise ValueError(
                f"retrofit() patches self-attention only; {self.name} models with add_cross_attention=True are not "
                "supported."
            )


class BertFamily(StockFamily):
    """BERT-like models, found by their structure rather than their class names: an embeddings module with
    ``word_embeddings`` and a ``position_embeddings`` table (token-type and task-type tables, a ``LayerNorm`` where it
    has them: BertGeneration has no token types, XLM-RoBERTa-XL and Megatron-BERT no LayerNorm there), the layers in
    ``encoder.layer``, each with ``attention.self`` projecting ``query``, ``key``, ``value`` heads of
    ``attention_head_size`` (BERT, RoBERTa and their copies: ERNIE, RoBERTa-PreLayerNorm, XLM-RoBERTa-XL,
    BertGeneration, Megatron-BERT, BigBird's full attention)."""

    def layers(self, base):
        return list(base.encoder.layer)

    def attention(self, layer):
        return layer.attention.self

    def matches(self, base, class_names):
        embeddings = getattr(base, "embeddings", None)
        layers = getattr(getattr(base, "encoder", None), "layer", None)
        if not isinstance(layers, nn.ModuleList) or not len(layers):
            return False
        if not isinstance(getattr(embeddings, "word_embeddings", None), nn.Embedding):
            return False
        if not isinstance(getattr(embeddings, "position_embeddings", None), nn.Embedding):
            return False
        attention = getattr(getattr(layers[0], "attention", None), "self", None)
        projections = all(isinstance(getattr(attention, name, None), nn.Linear) for name in ("query", "key", "value"))
        return projections and isinstance(getattr(attention, "attention_head_size", None), int)

    def embedding_size(self, base):
        """ELECTRA's ``embedding_size`` and RemBERT's ``input_embedding_size``: embeddings projected to
        ``hidden_size``, to which the position table is added (as an input-side scheme's then is)."""
        width = base.embeddings.word_embeddings.embedding_dim
        return width if width != base.config.hidden_size else None

    def check_model(self, model):
        """A self-attention holding more than BERT's ``query``, ``key``, ``value`` and dropout (ConvBERT's span-based
        convolution), which the patch does not compute; a position table of another width than the word embeddings
        (MobileBERT's, added after their projection), where the retrofit's positions are not added. BigBird's
        block-sparse attention (``attention_type="block_sparse"``; its stock forward switches to full attention on
        short inputs, replacing the modules) is not the full attention the patch computes."""
        config, base = model.config, decoder_base(model)
        attention = self.attention(self.layers(base)[0])
        extra = [name for name, _ in attention.named_children() if name not in ("query", "key", "value", "dropout")]
        name = type(attention).__name__
        if extra:
            raise ValueError(
                f"retrofit(): this {config.model_type} model's self-attention {name} holds {extra} beside query, key "
                "and value (e.g. ConvBERT's span-based convolution); the retrofit computes BERT's attention of q, k "
                "and v."
            )
        table, words = getattr(base.embeddings, "position_embeddings", None), base.embeddings.word_embeddings
        if table is not None and table.embedding_dim != words.embedding_dim:
            raise ValueError(
                f"retrofit(): this {config.model_type} model's position table is {table.embedding_dim} wide beside "
                f"word embeddings of {words.embedding_dim}: it is added after their projection (e.g. MobileBERT's "
                "embedding_transformation), where the retrofit does not add positions."
            )
        kind = getattr(decoder_base(model), "attention_type", "original_full")
        if kind != "original_full":
            raise ValueError(
                f"retrofit(): this {model.config.model_type} model runs attention_type={kind!r} (block-sparse "
                "attention); the retrofit computes full attention: set attention_type='original_full' first "
                "(model.set_attention_type('original_full'))."
            )
        if config.is_decoder:
            self.check_causal(model)

    def check_causal(self, model: PreTrainedModel) -> None:
        """``ValueError`` where the stock decoder, run without an attention mask, lets a token see later ones (the
        first 4 of 8 tokens' outputs change with the last 4: Megatron-BERT and BigBird under Transformers 5.15),
        which the causal retrofit would not reproduce. Skipped on a model built without weights (meta); the modules
        are left as they were."""
        base = decoder_base(model)
        weight = base.embeddings.word_embeddings.weight
        if weight.is_meta:
            return
        ids = (torch.arange(8, device=weight.device) % weight.shape[0])[None]
        modes = {module: module.training for module in base.modules()}
        base.eval()
        try:
            with torch.no_grad():
                whole = base(input_ids=ids, use_cache=False)[0][:, :4].float()
                prefix = base(input_ids=ids[:, :4], use_cache=False)[0].float()
        finally:
            for module, training in modes.items():
                module.training = training
        moved = (whole - prefix).abs().max().item() / max(1.0, prefix.abs().max().item())
        if moved > probe_tolerance(weight.dtype):
            raise ValueError(
                f"retrofit(): this {model.config.model_type} decoder's stock forward lets tokens see later ones "
                f"without an attention mask (outputs change with later tokens by {moved:.2g}, Transformers "
                f"{transformers.__version__}); the retrofit keeps decoders causal, so it would not compute what the "
                "stock model computes."
            )

    def causal(self, config):
        return config.is_decoder

    def attention_dropout(self, config):
        return config.attention_probs_dropout_prob

    def position_offset(self, base):
        # RoBERTa-style embeddings number real tokens from padding_idx + 1.
        is_roberta = hasattr(base.embeddings, "create_position_ids_from_input_ids")
        return base.embeddings.padding_idx + 1 if is_roberta else 0

    def stock_table(self, base):
        return base.embeddings.position_embeddings

    def remove_stock_positions(self, base):
        del base.embeddings.position_embeddings
        base.embeddings.__class__ = retrofit_class(type(base.embeddings), RetrofitBertEmbeddings)

    def default_positions_are_consecutive(self, base, input_ids):
        # RoBERTa numbers the real tokens of each row, so padding breaks the run.
        return input_ids is None or self.position_offset(base) == 0

    def default_position_ids(self, base, input_ids, inputs_embeds, past_length, attention_mask=None):
        if self.default_positions_are_consecutive(base, input_ids):
            return resolve_position_ids(None, inputs_embeds, past_length)
        # RoBERTa: the k-th non-padding token (k = 1, 2, ...) is at position past + k - 1; padding at 0.
        real = (input_ids != base.embeddings.padding_idx).long()
        return ((real.cumsum(-1) + past_length) * real - 1).clamp(min=0)

    def embed(self, base, encoding, inputs, call):
        """The stock embeddings' sum with the scheme's positions: the word embeddings (BigBird's scaled by
        ``sqrt(hidden_size)`` where it rescales them), the token-type table and ERNIE's task-type table where the
        module has them (ids 0 by default), then its ``LayerNorm`` where it has one and its dropout."""
        embeddings = base.embeddings
        combined = inputs.inputs_embeds
        if getattr(embeddings, "rescale_embeddings", False):
            combined = combined * embeddings.hidden_size**0.5
        types = [("token_type_embeddings", "token_type_ids"), ("task_type_embeddings", "task_type_ids")]
        for table_name, ids_name in types:
            ids = call.pop(ids_name, None)
            table = getattr(embeddings, table_name, None)
            if table is None or table_name == "task_type_embeddings" and not getattr(embeddings, "use_task_id", 0):
                continue
            if ids is None:
                ids = torch.zeros(combined.shape[:2], dtype=torch.long, device=inputs.position_ids.device)
            combined = combined + table(ids)
        combined = encoding.embed(dataclasses.replace(inputs, inputs_embeds=combined))
        norm = getattr(embeddings, "LayerNorm", None)
        return embeddings.dropout(norm(combined) if norm is not None else combined)


class RoFormerFamily(BertFamily):
    """RoFormer (Su et al. 2021): BERT's layout without a position table; its encoder hands every self-attention the
    sinusoids of positions ``past .. past + seq - 1`` (``embed_positions``), which rotate q and k in pairs ``(2i, 2i +
    1)`` by ``m 10000^(-2i/d)`` over the whole head: hf_posenc's ``rope`` at ``theta`` 10,000 in the interleaved
    layout (:class:`RetrofitRoFormerSelfAttention`). Its ``rotary_value=True`` (values rotated too) is refused."""

    def matches(self, base, class_names):
        return StockFamily.matches(self, base, class_names)

    def check_model(self, model):
        if model.config.rotary_value:
            raise ValueError(
                f"retrofit(): this {model.config.model_type} model sets rotary_value=True (its values rotate too); "
                "hf_posenc's rotary schemes rotate q and k only."
            )
        super().check_model(model)

    def own_rotary(self, config):
        return [{"type": "rope", "theta": 10000.0, "rotary_fraction": 1.0}] * config.num_hidden_layers

    def own_scheme(self, config):
        return self.own_rotary(config)[0]

    def stock_table(self, base):
        return None

    def remove_stock_positions(self, base):
        base.embeddings.__class__ = retrofit_class(type(base.embeddings), RetrofitBertEmbeddings)


class GPT2Family(StockFamily):
    def layers(self, base):
        return list(base.h)

    def attention(self, layer):
        return layer.attn

    def attention_dropout(self, config):
        return config.attn_pdrop

    def stock_table(self, base):
        return base.wpe

    def remove_stock_positions(self, base):
        base.wpe = NoStockPositions()


class GPTNeoFamily(GPT2Family):
    """GPT-Neo: GPT-2's layout (``h``, a learned ``wpe``), its self-attention one module down (``attn.attention``),
    global and local layers (``config.attention_layers``), a local layer seeing the ``window_size`` latest keys."""

    def attention(self, layer):
        return layer.attn.attention

    def attention_dropout(self, config):
        return config.attention_dropout

    def stock_layer_layout(self, config):
        """``attention_layers`` as Transformers' layer types: ``global`` full, ``local`` sliding over
        ``window_size`` keys (the stock mask hides a key ``window_size`` or more tokens back, as a sliding window
        of that size does)."""
        kinds = ["full_attention" if kind == "global" else "sliding_attention" for kind in config.attention_layers]
        return kinds, config.window_size if "sliding_attention" in kinds else None


class FusedAlibiFamily(StockFamily):
    """Decoders whose base model builds an ALiBi bias and hands it to attention modules of their own (BLOOM, MPT),
    found by their structure: one list of layers among the base model's children, each with one attention child of
    a fused q/k/v projection (``query_key_value`` with ``dense``, ``Wqkv`` with ``out_proj``), and a base ``forward``
    that builds the ``alibi``; no position table. Their own scheme is ``alibi`` (BLOOM's and MPT's slopes are
    Press et al.'s: MPT's only for a power-of-two head count and ``alibi_bias_max`` 8, else refused). BLOOM numbers
    the tokens from the attention mask (the k-th unmasked token of a row at ``k - 1``), as the retrofit's default
    positions then do. Their layers call the attention with named arguments only: the forward's stash carries the
    attention inputs. Their configs name no length; the tables of a switched scheme take MPT's ``max_seq_len``, and
    BLOOM's training length, 2048, where the config has no ``max_position_embeddings``."""

    FUSED = (("query_key_value", "dense"), ("Wqkv", "out_proj"))

    def fused_attention(self, layer: nn.Module) -> nn.Module | None:
        found = [
            child
            for child in layer.children()
            if any(all(isinstance(getattr(child, n, None), nn.Linear) for n in names) for names in self.FUSED)
        ]
        return found[0] if len(found) == 1 else None

    def layer_list(self, base: nn.Module) -> nn.ModuleList | None:
        found = [
            child
            for child in base.children()
            if isinstance(child, nn.ModuleList) and len(child) and self.fused_attention(child[0]) is not None
        ]
        return found[0] if len(found) == 1 else None

    def layers(self, base):
        return list(self.layer_list(base))

    def attention(self, layer):
        return self.fused_attention(layer)

    def matches(self, base, class_names):
        """A base ``forward`` building an ALiBi bias, fused attention modules that do not call the attention
        interface, no rotary module (Falcon, ALiBi or rotary by its config: through the attention interface where
        its attention calls it, else refused)."""
        try:
            builds_alibi = "alibi" in inspect.getsource(type(base).forward)
        except (OSError, TypeError):
            return False
        if not builds_alibi or self.layer_list(base) is None or rotary_modules(base):
            return False
        return not calls_attention_interface(self.attention(self.layers(base)[0]))

    def check_model(self, model):
        config = model.config
        if getattr(config, "pretraining_tp", 1) > 1 and getattr(config, "slow_but_exact", False):
            raise ValueError(
                f"retrofit(): this {config.model_type} model sets pretraining_tp={config.pretraining_tp} with "
                "slow_but_exact=True (its output projection in slices, without its bias); the retrofit applies the "
                "projection as one layer."
            )
        attn_config = getattr(config, "attn_config", None)
        if attn_config is not None:
            heads = config.num_attention_heads
            if not attn_config.alibi or attn_config.alibi_bias_max != 8 or heads & (heads - 1):
                raise ValueError(
                    f"retrofit(): this {config.model_type} model's ALiBi (alibi={attn_config.alibi}, "
                    f"alibi_bias_max={attn_config.alibi_bias_max}, {heads} heads) is not hf_posenc's alibi, whose "
                    "slopes are Press et al.'s: ALiBi on, alibi_bias_max 8 and a power-of-two head count."
                )
            if attn_config.qk_ln or attn_config.attn_uses_sequence_id or attn_config.prefix_lm:
                raise ValueError(
                    f"retrofit(): this {config.model_type} model sets qk_ln, attn_uses_sequence_id or prefix_lm, "
                    "which its stock attention does not compute either."
                )

    def max_positions(self, config):
        return getattr(config, "max_position_embeddings", None) or getattr(config, "max_seq_len", None) or 2048

    def own_scheme(self, config):
        return {"type": "alibi"}

    def attention_dropout(self, config):
        attn_config = getattr(config, "attn_config", None)
        return attn_config.attn_pdrop if attn_config is not None else config.attention_dropout

    def counts_from_mask(self, base: nn.Module) -> bool:
        """BLOOM builds its bias from the attention mask's running count (``build_alibi_tensor``); MPT from the key
        index."""
        return hasattr(base, "build_alibi_tensor")

    def default_positions_are_consecutive(self, base, input_ids):
        return not self.counts_from_mask(base)

    def default_position_ids(self, base, input_ids, inputs_embeds, past_length, attention_mask=None):
        if attention_mask is None or not self.counts_from_mask(base):
            return resolve_position_ids(None, inputs_embeds, past_length)
        # the columns of this call's tokens: Transformers 5.15's generate hands BLOOM a mask padded to a static cache
        mask = attention_mask.long()[:, : past_length + inputs_embeds.shape[1]]
        return ((mask.cumsum(-1) * mask - 1)[:, past_length:]).clamp(min=0)


def rope_spec_of(parameters: dict[str, Any], max_position_embeddings: int, fraction: float = 1.0) -> dict[str, Any]:
    """hf_posenc's ``rope`` spec of a Transformers ``rope_parameters`` dict (one layer type's): ``rope_theta``, the
    ``partial_rotary_factor`` (in the dict, else the config's ``fraction``) and, for a ``rope_type`` other than
    ``default``, the scaling under the same names (:func:`resolve_rope_scaling` reads ``rope_type`` and
    ``original_max_position_embeddings``). A scaling with no ``factor`` takes Transformers' rule,
    ``max_position_embeddings / original_max_position_embeddings``. A ``rope_type`` hf_posenc has not:
    ``ValueError``."""
    kind = parameters.get("rope_type", "default")
    fraction = parameters.get("partial_rotary_factor") or fraction
    spec = {"type": "rope", "theta": float(parameters["rope_theta"]), "rotary_fraction": float(fraction)}
    if kind == "default":
        return spec
    if kind == "proportional":  # Gemma 4's: the whole head's frequencies, the highest fraction of them rotating
        spec.update(rotary_fraction=1.0, kept_frequency_fraction=float(fraction))
        if parameters.get("factor") not in (None, 1, 1.0):
            spec["scaling"] = {"type": "linear", "factor": float(parameters["factor"])}
        return spec
    if kind not in ROPE_SCALING_OPTIONS:
        raise ValueError(
            f"retrofit(): rope_type={kind!r} has no hf_posenc scaling (valid: {list(ROPE_SCALING_OPTIONS)}); name "
            "the scheme to switch to (position_encoding=...)."
        )
    names = {TRANSFORMERS_SCALING_KEYS.get(key, key): value for key, value in parameters.items()}
    scaling = {"type": kind}
    scaling.update(
        {key: value for key, value in names.items() if key in ROPE_SCALING_OPTIONS[kind] and value is not None}
    )
    if scaling.get("factor") is None and names.get("original_max_positions"):
        scaling["factor"] = max_position_embeddings / names["original_max_positions"]
    spec["scaling"] = scaling
    return spec


class LlamaFamily(StockFamily):
    """Llama-like decoders: ``base.layers``, ``layer.self_attn`` with ``q_proj``/``k_proj``/``v_proj``/``o_proj``,
    the rotary parameters in ``config.rope_parameters`` (one dict, or one per layer type: Gemma 3, OLMo 3), the layer
    types and windows in ``config.layer_types`` / ``sliding_window`` (read by the masks and caches as the stock model
    reads them)."""

    def layers(self, base):
        if not hasattr(base, "layers"):  # e.g. Gemma3ForConditionalGeneration: the text model is inside
            raise ValueError(
                f"retrofit() patches a text decoder; {type(base).__name__} holds one inside another model. Load its "
                "text model's class (Gemma 3: Gemma3ForCausalLM.from_pretrained(...) reads the text weights)."
            )
        return list(base.layers)

    def attention(self, layer):
        return layer.self_attn

    def attention_dropout(self, config):
        return config.attention_dropout

    def own_rotary(self, config):
        """The rotary parameters per layer: one ``rope_parameters`` dict for all, or one per layer type (Gemma 3,
        OLMo 3; None for a type without: NoPE)."""
        rope = used_rope_parameters(config)
        fraction = getattr(config, "partial_rotary_factor", None) or 1.0
        layer_types = config_layer_types(config)
        if "rope_theta" in rope:
            return [rope_spec_of(rope, config.max_position_embeddings, fraction)] * len(layer_types)
        return [
            rope_spec_of(rope[kind], config.max_position_embeddings, fraction) if rope.get(kind) else None
            for kind in layer_types
        ]

    def own_scheme(self, config):
        """``rope`` with the model's rotary parameters on every layer; a per-layer list where they differ by layer
        type (Gemma 3's local and global bases, OLMo 3's YaRN on the full layers) or where SmolLM3 leaves a layer
        without (``no_rope_layers[i] == 0``: ``none``)."""
        specs = self.own_rotary(config)
        keeps_rope = getattr(config, "no_rope_layers", None) or [1] * len(specs)
        specs = [spec if keep and spec else {"type": "none"} for spec, keep in zip(specs, keeps_rope, strict=True)]
        return specs[0] if all(spec == specs[0] for spec in specs) else specs

    def check(self, config):
        super().check(config)
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                f"retrofit(): this {config.model_type} model sets use_bidirectional_attention=True (an encoder built "
                "from a decoder, as EmbeddingGemma); retrofit() keeps Llama-like models causal."
            )


class ModernBertFamily(StockFamily):
    """ModernBERT: ``base.layers``, ``layer.attn``, no position table (its embeddings module, run by the stock
    forward on the scheme's ``inputs_embeds``, applies its LayerNorm and dropout), RoPE with a base per layer type
    (global and local, ``config.rope_parameters``) and local layers attending within ``local_attention`` tokens
    (``config.layer_types``, ``sliding_window = local_attention // 2``)."""

    def layers(self, base):
        return list(base.layers)

    def attention(self, layer):
        return layer.attn

    def causal(self, config):
        return False

    def attention_dropout(self, config):
        return config.attention_dropout

    def own_rotary(self, config):
        return [
            rope_spec_of(config.rope_parameters[kind], config.max_position_embeddings)
            for kind in config_layer_types(config)
        ]

    def own_scheme(self, config):
        specs = self.own_rotary(config)
        return specs[0] if all(spec == specs[0] for spec in specs) else specs


RETROFIT_ATTENTION = "posenc_retrofit"
"""The name :func:`interface_attention` is registered under with Transformers' ``AttentionInterface``."""
RETROFIT_CACHE = "posenc_cache"
"""The keyword under which the KV cache reaches :func:`interface_attention` (the stock attention gets none) and the
layers of a hybrid that are not attention layers (:class:`RetrofitStateLayer`)."""


def interface_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function of a decoder retrofitted through Transformers' attention interface: the stock module
    hands over its ``(batch, heads, seq, head_dim)`` q, k, v (projected, QK-normed, not rotated: its rotary embedding
    is the identity) and its scaling; :func:`positional_attention` runs the layer's scheme, normalizer, cache and
    mask from the attention inputs the retrofitted forward built (the stock ``attention_mask`` is not read).
    Where the stock rotation pairs features otherwise than hf_posenc's rope (interleaved: GLM, Cohere), q and k are
    read in the order that makes the pairs the same (``posenc_feature_order``, :func:`half_layout_order`).
    Returns ``(batch, seq, heads, head_dim)`` and the weights (eager), as Transformers' attention functions."""
    kwargs = stashed_arguments(module, kwargs)
    order = getattr(module, "posenc_feature_order", None)
    if order is not None:
        query, key = query[..., order], key[..., order]
    attention_inputs = kwargs[ATTENTION_INPUTS]
    if kwargs.get("indices") is not None:  # the keys an indexer selected (DeepSeek Sparse Attention)
        attention_inputs = with_selected_keys(attention_inputs, kwargs["indices"], query.dtype)
    return positional_attention(
        query,
        key,
        value,
        attention_inputs,
        kwargs[POSITION_ENCODING],
        module.normalizer,
        module.position_term,
        scaling=query.shape[-1] ** -0.5 if scaling is None else scaling,
        dropout=dropout,
        training=module.training,
        causal=True,
        cache=kwargs.get(RETROFIT_CACHE),
        layer_idx=module.layer_idx,
    )


AttentionInterface.register(RETROFIT_ATTENTION, interface_attention)


def with_selected_keys(
    attention_inputs: AttentionInputs, indices: torch.Tensor, dtype: torch.dtype
) -> AttentionInputs:
    """A layer's attention inputs hiding every key its indexer did not select: ``indices`` ``(batch, q_len, top_k)``
    counts the keys as the layer's key positions list them (the indexer scored the same cached keys), and a key is
    visible where it was visible and is selected. Eager and SDPA (the stock modules fold the selection into their mask
    the same way); FlexAttention's block mask is refused."""
    if attention_inputs["backend"] == "flex_attention":
        raise ValueError(
            "retrofit(): attention over the keys an indexer selects (DeepSeek Sparse Attention) runs on eager and "
            "SDPA, whose masks take the selection; got attn_implementation='flex_attention'."
        )
    queries, keys = attention_inputs["query_positions"], attention_inputs["key_positions"]
    visible = attention_inputs["visible"]
    if visible is None:  # a mask SDPA's is_causal stood for
        visible = (keys[:, None, :] <= queries[:, :, None])[:, None]
    kv_len = keys.shape[-1]
    width = max(kv_len, int(indices.max()) + 1)
    selected = torch.zeros(*indices.shape[:2], width, dtype=torch.bool, device=indices.device)
    selected = selected.scatter(-1, indices.long(), True)[:, None, :, :kv_len]
    visible = visible & selected
    row_has_key = visible.any(dim=-1, keepdim=True)
    attend = visible | ~row_has_key
    mask = attention_inputs["mask"]
    if mask is None or mask.dtype == torch.bool:
        mask = attend if attention_inputs["backend"] == "sdpa" else None
    if mask is None:  # eager: an additive mask
        mask = torch.zeros(attend.shape, dtype=torch.promote_types(dtype, torch.float32), device=attend.device)
    if mask.dtype != torch.bool:
        mask = mask.masked_fill(~attend, torch.finfo(mask.dtype).min)
    return {**attention_inputs, "mask": mask, "visible": visible, "row_has_key": row_has_key}


def calls_attention_interface(module: nn.Module) -> bool:
    """Whether ``module``'s ``forward`` calls the function ``ALL_ATTENTION_FUNCTIONS`` returns (read from its source,
    as ``PreTrainedModel._can_set_attn_implementation`` reads it), or it computes BART-style attention in its own
    forward, which :class:`InlineAttention` makes call it (:func:`computes_attention_inline`)."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source or computes_attention_inline(module)


def layer_attentions(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the children of ``layer`` calling the attention interface
    (:func:`calls_attention_interface`) that are its self-attention: not a cross-attention, which the layer's forward
    hands ``encoder_hidden_states`` (TrOCR's ``encoder_attn``, run only with an encoder's states; a retrofitted causal
    LM is called without, and that module stays as it is)."""
    found = [(name, module) for name, module in layer.named_children() if calls_attention_interface(module)]
    if len(found) < 2:
        return found
    try:
        source = inspect.getsource(type(layer).forward)
    except (OSError, TypeError):
        return found
    calls = {name: source.split(f"self.{name}(", 1)[-1].split("\n        )", 1)[0] for name, _ in found}
    return [
        (name, module)
        for name, module in found
        if f"self.{name}(" not in source or "encoder_hidden_states" not in calls[name]
    ]


INLINE_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


def computes_attention_inline(module: nn.Module) -> bool:
    """Whether ``module`` is a BART-style attention computing its softmax in its own forward rather than through the
    attention interface (XGLM's): ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` linear layers, ``num_heads``
    heads of ``head_dim`` and the queries' ``scaling``, a ``forward`` of ``hidden_states`` (``key_value_states`` for
    cross-attention) whose source computes a softmax. That it computes what :class:`InlineAttention` computes is
    checked on the module before anything changes (:func:`inline_attention_as_interface`)."""
    if isinstance(module, InlineAttention) or not all(
        isinstance(getattr(module, name, None), nn.Linear) for name in INLINE_PROJECTIONS
    ):
        return False
    sizes = [getattr(module, name, None) for name in ("num_heads", "head_dim", "scaling")]
    if not all(isinstance(size, (int, float)) and not isinstance(size, bool) for size in sizes):
        return False
    source = inspect.getsource(type(module).forward)
    parameters = inspect.signature(type(module).forward).parameters
    return "hidden_states" in parameters and "key_value_states" in parameters and "softmax(" in source


def inline_eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager attention of :class:`InlineAttention`, as BART-style modules compute it: scaled scores plus the
    additive mask, a softmax (in float32 for float16), dropout; ``(batch, seq, heads, head_dim)`` and the weights."""
    scores = (query * scaling) @ key.transpose(-1, -2)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = scores.softmax(-1, dtype=torch.float32).to(scores.dtype) if scores.dtype == torch.float16 else None
    weights = scores.softmax(-1) if weights is None else weights
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2), weights


class InlineAttention:
    """Mixin of a BART-style self-attention that computes its softmax in its own forward
    (:func:`computes_attention_inline`: XGLM's): the same projections, then the function of
    ``ALL_ATTENTION_FUNCTIONS`` its ``config`` names (eager: :func:`inline_eager_attention`), then ``out_proj``; so
    the retrofit's probes and :func:`interface_attention` reach it as they reach a module calling the attention
    interface. Self-attention only: cross-attention (``key_value_states``) is refused by name."""

    config: PretrainedConfig

    def forward(self, hidden_states, key_value_states=None, attention_mask=None, **kwargs):
        if key_value_states is not None:
            raise ValueError(
                f"retrofit(): a retrofitted {type(self).__name__} is a decoder's self-attention; it takes no "
                "key_value_states (cross-attention)."
            )
        kwargs.pop("output_attentions", None)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key, value = (
            layer(hidden_states).view(shape).transpose(1, 2) for layer in (self.q_proj, self.k_proj, self.v_proj)
        )
        implementation = self.config._attn_implementation
        function = inline_eager_attention if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]
        dropout = self.dropout if isinstance(self.dropout, float) else self.dropout.p
        output, weights = function(
            self, query, key, value, attention_mask, scaling=self.scaling, dropout=dropout if self.training else 0.0,
            **kwargs,
        )  # fmt: skip
        return self.out_proj(output.reshape(*hidden_states.shape[:-1], -1)), weights


@contextlib.contextmanager
def inline_attention_as_interface(
    attentions: list[nn.Module], config: PretrainedConfig, keep: bool = False
) -> Iterator[None]:
    """The modules of ``attentions`` that compute their attention inline (:func:`computes_attention_inline`) as
    :class:`InlineAttention` with a copy of ``config`` (eager), after checking on each that it gives what the stock
    forward gives (random hidden states of 8 positions, a causal additive mask, eval mode): ``ValueError`` naming the
    difference otherwise. Restored afterwards unless ``keep``."""
    inline = [module for module in attentions if computes_attention_inline(module)]
    stock_classes = {module: type(module) for module in inline}
    try:
        for module in inline:
            weight = module.q_proj.weight
            if weight.is_meta:
                stock = None
            else:
                hidden = torch.randn(1, 8, module.q_proj.in_features, generator=torch.Generator().manual_seed(0))
                hidden = hidden.to(weight.device, weight.dtype)
                mask = torch.full((8, 8), torch.finfo(weight.dtype).min, device=weight.device, dtype=weight.dtype)
                mask = mask.triu(1)[None, None]
                modes = {sub: sub.training for sub in module.modules()}
                module.eval()
                with torch.no_grad():
                    stock = module(hidden_states=hidden, attention_mask=mask)[0]
            module.__class__ = retrofit_class(stock_classes[module], InlineAttention)
            module.config = copy.copy(config)
            module.config._attn_implementation_internal = "eager"
            if stock is not None:
                with torch.no_grad():
                    ours = module(hidden_states=hidden, attention_mask=mask)[0]
                for sub, training in modes.items():
                    sub.training = training
                difference = (ours.float() - stock.float()).abs().max().item() / max(1.0, stock.abs().max().item())
                if difference > probe_tolerance(weight.dtype):
                    raise ValueError(
                        f"retrofit(): its attention {stock_classes[module].__name__} computes otherwise than scaled "
                        f"softmax attention of its q_proj, k_proj, v_proj (max difference {difference:.2g}), which "
                        "the retrofit reads."
                    )
        yield
    except BaseException:
        keep = False
        raise
    finally:
        if not keep:
            for module, stock_class in stock_classes.items():
                module.__class__ = stock_class
                module.__dict__.pop("config", None)


CAPTURE_ATTENTION = "posenc_retrofit_capture"
"""The attention function a retrofit's probe of a stock attention module runs for one call."""


def capture_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs
) -> tuple[torch.Tensor, None]:
    """Keep the q and k a stock attention module hands over (``module.posenc_captured``) and its mask
    (``module.posenc_captured_mask``); return zeros of the output's shape ``(batch, seq, heads, value_dim)``."""
    module.posenc_captured = (query, key)
    module.posenc_captured_mask = args[0] if args else kwargs.get("attention_mask")
    module.posenc_value_dim = value.shape[-1]
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


AttentionInterface.register(CAPTURE_ATTENTION, capture_attention)


PLAIN_ATTENTION = "posenc_retrofit_plain"
"""The attention function a retrofit's probe of a NoPE attention module compares the module's own with."""


def plain_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal softmax attention of q, k, v alone (grouped-query heads repeated), ``(batch, seq, heads, value_dim)``:
    what a NoPE attention layer computes, with nothing handed over beside q, k and v read."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(-1, -2) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    weights = scores.float().masked_fill(~causal, float("-inf")).softmax(-1).to(value.dtype)
    return (weights @ value).transpose(1, 2), None


AttentionInterface.register(PLAIN_ATTENTION, plain_attention)


def call_stock_attention(
    attention: nn.Module,
    implementation: str,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> Any:
    """A stock attention module's output for ``hidden_states``, run once in eval mode with the attention function
    registered as ``implementation`` (its config and mode are restored afterwards); ``position_embeddings`` where
    given or where its ``forward`` takes them, ``position_ids`` where it takes them."""
    stock_config, modes = attention.config, {module: module.training for module in attention.modules()}
    attention.config = copy.copy(stock_config)
    attention.config._attn_implementation_internal = implementation
    accepted = inspect.signature(attention.forward).parameters
    extra = {"position_ids": position_ids} if "position_ids" in accepted else {}
    if position_embeddings is not None or "position_embeddings" in accepted:
        extra["position_embeddings"] = position_embeddings
    attention.eval()
    try:
        return attention(hidden_states=hidden_states, attention_mask=attention_mask, **extra)
    finally:
        attention.config = stock_config
        for module, training in modes.items():
            module.training = training


def captured_heads(
    attention: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    position_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The q and k a stock attention module computes from ``hidden_states`` with ``position_embeddings``, and the
    size of its value heads, read by running it once with :func:`capture_attention` (its config and the module are
    restored afterwards)."""
    try:
        call_stock_attention(attention, CAPTURE_ATTENTION, hidden_states, position_embeddings, position_ids)
        return (*attention.posenc_captured, attention.posenc_value_dim)
    finally:
        attention.__dict__.pop("posenc_captured", None)
        attention.__dict__.pop("posenc_value_dim", None)


def probe_tolerance(dtype: torch.dtype) -> float:
    """The difference, relative to the values' largest magnitude (at least 1), that a probe of the stock modules
    accepts: 1e-5 in float32, eight units in the last place in bfloat16 and float16 (the stock rotation's and
    attention's own rounding)."""
    return max(1e-5, 8 * torch.finfo(dtype).eps)


def used_rope_parameters(config) -> dict[str, Any] | None:
    """``config.rope_parameters``, or None where the config turns rotary positions off beside them: a
    ``position_embedding_type`` other than ``"rope"`` (Granite 4's hybrids default to NoPE attention and then build no
    rotary module). A config with ``rotary_dim`` and no ``rope_parameters`` (GPT-J, CodeGen: their rotary module
    builds the default rotation at base 10,000 over the first ``rotary_dim`` features of each head, the whole head
    where it is None) gives those parameters."""
    if hasattr(config, "position_embedding_type") and config.position_embedding_type != "rope":
        return None
    rope = getattr(config, "rope_parameters", None)
    if rope is None and hasattr(config, "rotary_dim"):
        head_dim = config.hidden_size // config.num_attention_heads
        fraction = rotary_fraction_of(head_dim, config.rotary_dim) if config.rotary_dim else 1.0
        return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": fraction}
    return rope


def rotary_modules(base: nn.Module) -> list[nn.Module]:
    """The base model's rotary modules: ``base_model.rotary_emb`` and every other module of its class (Granite SWA
    keeps one per base in ``rotary_embs``, which its forward reads); none for a model without a rotary module."""
    rotary = getattr(base, "rotary_emb", None)
    if not isinstance(rotary, nn.Module):
        return []
    return [rotary, *(module for module in base.modules() if type(module) is type(rotary) and module is not rotary)]


def captured_forward(
    base: nn.Module,
    attentions: dict[int, nn.Module],
    hidden: torch.Tensor,
    positions: torch.Tensor,
    identity_rotary: bool,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The q and k each attention module of ``attentions`` (by layer index) is handed by the stock base model's
    forward on ``hidden`` (inputs_embeds) at ``positions``, in eval mode and without a cache, with every attention
    function replaced by :func:`capture_attention` (the attention outputs are zeros, whatever the rotation) and, with
    ``identity_rotary``, the rotary modules (:func:`rotary_modules`) as :func:`identity_rotary_forward`. The modules
    are left as they were."""
    stock_configs = {idx: attention.config for idx, attention in attentions.items()}
    modes = {module: module.training for module in base.modules()}
    rotaries = rotary_modules(base) if identity_rotary else []
    hooks = [rotary.__dict__.get("forward") for rotary in rotaries]  # accelerate's, kept
    for attention in attentions.values():
        attention.config = copy.copy(attention.config)
        attention.config._attn_implementation_internal = CAPTURE_ATTENTION
    for rotary in rotaries:
        rotary.forward = types.MethodType(identity_rotary_forward, rotary)
    base.eval()
    try:
        with torch.no_grad():
            base(inputs_embeds=hidden, position_ids=positions, use_cache=False)
        for idx, attention in attentions.items():
            check_plain_mask(
                attention.posenc_captured_mask, f"retrofit(): {type(base).__name__} ({base.config.model_type})", idx
            )
        return {idx: attention.posenc_captured for idx, attention in attentions.items()}
    finally:
        for idx, attention in attentions.items():
            attention.config = stock_configs[idx]
            attention.__dict__.pop("posenc_captured", None)
            attention.__dict__.pop("posenc_captured_mask", None)
            attention.__dict__.pop("posenc_value_dim", None)
        for rotary, hook in zip(rotaries, hooks, strict=True):
            rotary.__dict__.pop("forward", None)
            if hook is not None:
                rotary.forward = hook
        for module, training in modes.items():
            module.training = training


def check_plain_mask(mask: Any, prefix: str, layer_idx: int) -> None:
    """``ValueError`` where the mask a stock forward hands attention layer ``layer_idx`` carries more than which keys
    are hidden: an additive mask of values other than 0 and the masked value (Falcon's ALiBi, Doge's dynamic mask of
    the values), which the retrofit, building its own masks, would drop."""
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point():
        return
    hidden = mask <= torch.finfo(mask.dtype).min / 2
    if not bool(((mask == 0) | hidden).all()):
        raise ValueError(
            f"{prefix}: its attention layer {layer_idx} gets an attention mask of values other than 0 and the masked "
            f"value (up to {mask.masked_fill(hidden, 0).abs().max().item():.3g}): a bias in the mask (of positions or "
            "of content), which the retrofit, building its own masks, would drop."
        )


def check_no_other_positions(
    model: PreTrainedModel, attentions: dict[int, nn.Module], hidden: torch.Tensor, positions: torch.Tensor
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``ValueError`` where the keys the stock forward hands an attention layer still change with the positions once
    its rotary modules are the identity (or where it has none): positions reach the attention by another way than
    the rotary modules (a rotary module the retrofit does not find, a position table), which the retrofit would leave
    in place beside the scheme. The queries are not compared: a position-dependent scaling of the queries alone (Beam's
    attention temperature on its NoPE layers, as Llama 4's) stays in the stock forward, the model's own temperature
    beside any scheme. Returns the q and k of the forward at ``positions`` (:func:`captured_forward`)."""
    base = decoder_base(model)
    tolerance = probe_tolerance(hidden.dtype)
    here = captured_forward(base, attentions, hidden, positions, identity_rotary=True)
    there = captured_forward(base, attentions, hidden, positions + 3, identity_rotary=True)
    for idx in attentions:
        key, shifted = here[idx][1].float(), there[idx][1].float()
        moved = (key - shifted).abs().max().item() / max(1.0, key.abs().max().item())
        if moved > tolerance:
            raise ValueError(
                f"retrofit(): {type(model).__name__} ({model.config.model_type}): with its rotary modules as the "
                f"identity, the keys its layer {idx} gets still change with the positions (by {moved:.2g}): "
                "positions reach its attention by another way, which the retrofit would leave beside the scheme."
            )
    return here


def identity_rotary_forward(self, *args, **kwargs) -> tuple[torch.Tensor, ...] | torch.Tensor:
    """A retrofitted decoder's rotary embedding: its own output at position 0 with the scale taken out, ``cos = 1``,
    ``sin = 0`` in the stock shapes and order (GPT-J's and CodeGen's modules return ``(sin, cos)``), so the stock
    attention's rotation leaves q and k as they are (``q cos + rotate_half(q) sin = q``, partial and interleaved
    layouts alike; DeepSeek V3's interleaved rotation puts the even features of each pair before the odd ones, the
    same permutation of q and k, so ``q . k`` is kept) and the scheme acts in :func:`interface_attention`. Complex
    frequencies ``e^{i m theta}`` (DeepSeek V2: ``q * e^{i m theta}`` on the pairs) become 1."""
    call = inspect.signature(type(self).forward).bind(self, *args, **kwargs)
    positions = call.arguments.get("position_ids")
    if positions is not None:
        call.arguments["position_ids"] = torch.zeros_like(positions)
    embeddings = type(self).forward(*call.args, **call.kwargs)
    if isinstance(embeddings, torch.Tensor):
        return torch.ones_like(embeddings)
    if positions is None:  # no positions to read the order from: Transformers' (cos, sin)
        cos, sin = embeddings
        return torch.ones_like(cos), torch.zeros_like(sin)
    return tuple((part != 0).to(part.dtype) for part in embeddings)


def half_layout_order(head_dim: int, rotary_dim: int, layout: str, start: int = 0) -> list[int]:
    """The feature order that reads a head whose rotary features ``start .. start + r - 1`` are in ``layout`` as
    hf_posenc's rope lays it out (the first ``r`` features rotate, pairs ``(i, i + r/2)``): the rotary features first,
    in order for ``"half"``, for ``"interleaved"`` the even ones, then the odd ones (GLM, Cohere: ``0, 2, .., r - 2,
    1, 3, .., r - 1``, so rotating the pairs ``(i, i + r/2)`` of the reordered head rotates the pairs ``(2i, 2i + 1)``
    of the stock one), for ``"swapped"`` the second half, then the first (nanochat's ``rotate_half`` is
    ``cat(x2, -x1)``: it rotates the pairs ``(i, i + r/2)`` by ``-m theta``, which is hf_posenc's rotation of the
    pairs ``(i + r/2, i)``), then the others in order (MLA's no-position part, ``start`` features before its rotary
    part).
    q and k alike: ``q . k`` is unchanged. Plain ints: no tensor that a meta-device build would leave empty."""
    rotary = range(start, start + rotary_dim)
    if layout == "interleaved":
        rotary = [*rotary[::2], *rotary[1::2]]
    elif layout == "swapped":
        rotary = [*rotary[rotary_dim // 2 :], *rotary[: rotary_dim // 2]]
    return [*rotary, *range(start), *range(start + rotary_dim, head_dim)]


def mla_head_sizes(config: PretrainedConfig) -> tuple[int, int] | None:
    """``(qk_nope_head_dim, qk_rope_head_dim)`` of a multi-head latent attention (MLA, DeepSeek V2/V3) config, or
    None: its q and k heads are a no-position part, then a rotary part (the rotated key shared by every head),
    ``torch.cat((q_pass, q_rot), dim=-1)``."""
    sizes = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    return sizes if all(isinstance(size, int) and size > 0 for size in sizes) else None


def rotary_fraction_of(head_dim: int, rotary_dim: int) -> float:
    """The ``rotary_fraction`` whose rotary size ``int(head_dim * fraction)`` (rope's rule, Transformers' own) is
    ``rotary_dim``: ``rotary_dim / head_dim``, or the next float up where that product rounds below it."""
    fraction = rotary_dim / head_dim
    return fraction if int(head_dim * fraction) == rotary_dim else math.nextafter(fraction, 1.0)


class InterfaceFamily(LlamaFamily):
    """Any other causal LM of Transformers whose attention modules call the function of
    ``ALL_ATTENTION_FUNCTIONS`` with the ``position_embeddings`` of its rotary module (MoE models among them: their
    expert layers are not touched). The retrofit goes through those two seams: the rotary module becomes the
    identity (:func:`identity_rotary_forward`) and each attention module calls :func:`interface_attention` (its own
    config copy names it), which runs the scheme's rotation, bias or content term and the normalizer. The stock
    attention keeps computing q, k, v (its QK-norm, its scaling); the KV cache goes to the library's attention
    only. The model's own scheme is ``rope`` with its ``rope_parameters`` per layer type, checked against the stock
    forward's rotation before anything changes (:meth:`probe_rotation`), or ``none`` for a model without a rotary
    module whose modules show NoPE attention (:meth:`probe_nope`). A hybrid's layers of other types than
    :data:`ATTENTION_LAYER_TYPES` keep their modules, masks and cache layers (:class:`RetrofitStateLayer`,
    :meth:`stock_attention_mask`); per-head attention sinks move into the normalizer (:class:`SinksInNormalizer`).
    Multi-head latent attention (MLA: DeepSeek V2/V3, MiniCPM3, GLM-4 MoE Lite) hands over heads of a no-position
    part, then a rotary part (:func:`mla_head_sizes`): its own ``rope`` rotates that part only (``rotary_fraction``,
    the features read rotary part first: :func:`half_layout_order`), so ``none`` drops only its rotation and a
    score-bias scheme adds its bias to every head; the keys reach the cache expanded per head (not as the stock
    latents). What does not fit is refused by name (:meth:`refusal`)."""

    def layer_list(self, base: nn.Module) -> tuple[nn.Module, str] | None:
        """Where the decoder's layers are: ``(owner, name)`` of the one ``ModuleList`` of the base model's children
        or grandchildren whose layers hold a module calling the attention interface (``base.layers``; OPT's
        ``decoder.layers``, GPT-BigCode's ``h``); None where there is no such list or more than one (HRM's two
        stacks)."""
        if isinstance(getattr(base, "layers", None), nn.ModuleList):
            return base, "layers"
        owners = [base, *(child for child in base.children() if not isinstance(child, nn.ModuleList))]
        found = [
            (owner, name)
            for owner in owners
            for name, child in owner.named_children()
            if isinstance(child, nn.ModuleList) and any(layer_attentions(layer) for layer in child)
        ]
        return found[0] if len(found) == 1 else None

    def layers(self, base):
        owner, name = self.layer_list(base)
        return list(getattr(owner, name))

    def attention(self, layer):
        return layer_attentions(layer)[0][1]

    def first_attention(self, base: nn.Module) -> nn.Module:
        """The attention module of the first attention layer (a hybrid's first layer may be another kind)."""
        return self.attention(self.layers(base)[attention_layer_indices(base.config)[0]])

    def absolute_table(self, base: nn.Module) -> tuple[nn.Module, str, nn.Module] | None:
        """``(owner, name, table)`` of the model's own absolute positions where it has no rotary module and the one
        module it holds beside its layers, token embeddings and norms (:meth:`position_modules`) is a table of
        positions added to the token embeddings before the layers: a learned one (an ``nn.Embedding``:
        GPT-BigCode's ``wpe``; OPT's and BioGPT's, whose rows start at their ``offset``, 2) or a module holding one
        table of the token embeddings' width whose forward at ``position_ids`` gives its rows from its ``offset``
        (XGLM's sinusoidal buffer, rows from 2: :func:`reads_its_rows`); else None. The retrofit keeps it as its
        ``learned`` table of those rows."""
        if isinstance(getattr(base, "rotary_emb", None), nn.Module) or self.layer_list(base) is None:
            return None
        found = self.position_modules(base)
        if len(found) != 1:
            return None
        module = found[0][2]
        if isinstance(module, nn.Embedding) or reads_its_rows(module, base.get_input_embeddings().weight.shape[-1]):
            return found[0]
        return None

    def position_offset(self, base):
        table = self.absolute_table(base)
        return getattr(table[2], "offset", 0) if table is not None else 0

    def stock_table(self, base):
        table = self.absolute_table(base)
        return table[2] if table is not None else None

    def remove_stock_positions(self, base):
        table = self.absolute_table(base)
        if table is not None:
            setattr(table[0], table[1], NoStockPositions())

    @contextlib.contextmanager
    def without_stock_table(self, base: nn.Module) -> Iterator[None]:
        """The base model with its absolute table (:meth:`absolute_table`) adding nothing, for the probes; restored
        afterwards."""
        table = self.absolute_table(base)
        if table is None:
            yield
            return
        owner, name, module = table
        setattr(owner, name, NoStockPositions())
        try:
            yield
        finally:
            setattr(owner, name, module)

    def counts_from_mask(self, base: nn.Module) -> bool:
        """Whether the stock forward numbers the tokens from the attention mask (OPT: the k-th unmasked token of a row
        at ``k - 1``, read from its source: ``cumsum``) where it has an absolute table."""
        if self.absolute_table(base) is None:
            return False
        owner = self.layer_list(base)[0]
        return "cumsum(" in inspect.getsource(type(owner).forward)

    def default_positions_are_consecutive(self, base, input_ids):
        return not self.counts_from_mask(base)

    def default_position_ids(self, base, input_ids, inputs_embeds, past_length, attention_mask=None):
        """The stock rule: ``past .. past + seq - 1``; OPT counts the unmasked tokens of each row (padding at 0)."""
        if attention_mask is None or not self.counts_from_mask(base):
            return resolve_position_ids(None, inputs_embeds, past_length)
        mask = attention_mask.long()
        return ((mask.cumsum(-1) * mask - 1)[:, past_length:]).clamp(min=0)

    def has_sinks(self, model: PreTrainedModel) -> bool:
        """Whether attention modules have per-head attention sinks (a ``sinks`` tensor: Granite SWA, Flint; MiMo-V2
        on some layers), which become the ``softmax`` normalizer's learned ``sink`` (:class:`SinksInNormalizer`; a
        layer without has :data:`NO_SINK_LOGIT`)."""
        base = decoder_base(model)
        return any(
            isinstance(getattr(self.attention(self.layers(base)[idx]), "sinks", None), torch.Tensor)
            for idx in attention_layer_indices(model.config)
        )

    def own_rotary(self, config):
        """The rotary parameters per layer (:meth:`LlamaFamily.own_rotary`), rotating MLA's rotary part of each head
        (:meth:`handed_head_dim`); None for a model without any (NoPE attention, checked by :meth:`probe_nope`)."""
        if not used_rope_parameters(config):
            return None
        specs = super().own_rotary(config)
        mla = mla_head_sizes(config)
        if mla is None:
            return specs
        fraction = rotary_fraction_of(sum(mla), mla[1])
        return [dict(spec, rotary_fraction=fraction) if spec else None for spec in specs]

    def handed_head_dim(self, config) -> int | None:
        """The size of the q and k heads the stock attention hands over where it is not the config's ``head_dim``
        and the config says it: MLA's ``qk_nope_head_dim + qk_rope_head_dim`` (its ``head_dim`` is the rotary part);
        None otherwise (a NoPE model's is probed: :meth:`probe_nope`)."""
        mla = mla_head_sizes(config)
        if mla is None or used_rope_parameters(config) is None:
            return None
        return sum(mla) if sum(mla) != getattr(config, "head_dim", None) else None

    def rotary_start(self, config) -> int:
        """The first rotary feature of the q and k heads the stock attention hands over: MLA's
        ``qk_nope_head_dim``, else 0."""
        mla = mla_head_sizes(config)
        return mla[0] if mla is not None and used_rope_parameters(config) else 0

    def own_scheme(self, config):
        return super().own_scheme(config) if self.own_rotary(config) is not None else {"type": "none"}

    def refusal(self, model: PreTrainedModel) -> str | None:
        """Why ``model`` does not fit the seams, or None: the reason names what the library cannot reproduce. A
        hybrid's layers whose ``layer_types`` entry is not an attention type (:data:`ATTENTION_LAYER_TYPES`: linear
        attention, Mamba, a convolution, an MLP-only block) must not call the attention interface: they keep their
        modules and cache layers. A model without a rotary module must hold nothing beside its layers, token
        embeddings and norms but one table it keeps (:meth:`absolute_table`), so that its attention is NoPE, which
        :meth:`probe_nope` checks on the modules."""
        config, base = model.config, decoder_base(model)
        if getattr(config, "is_encoder_decoder", False) or self.layer_list(base) is None:
            return (
                "it is not a decoder with one list of layers (base_model.layers, or another list of the base model "
                "or its decoder) whose attention calls the attention interface"
            )
        no_rotary = "it has no rotary module (base_model.rotary_emb) whose position_embeddings the attention reads"
        rope = used_rope_parameters(config)
        if isinstance(getattr(base, "rotary_emb", None), nn.Module):
            if not isinstance(rope, dict) or not rope:
                return "its config has no rope_parameters"
        elif rope:
            return f"{no_rotary}, yet its config has rope_parameters"
        else:
            others = [type(module).__name__ for _, _, module in self.position_modules(base)]
            if others and self.absolute_table(base) is None:
                return (
                    f"{no_rotary}, and it holds {others} beside its layers, token embeddings and norms (positions "
                    "outside the attention, other than one learned table added to the token embeddings)"
                )
        layer_types = config_layer_types(config)
        attention_layers = attention_layer_indices(config)
        if getattr(config, "use_bidirectional_attention", False):
            return "it sets use_bidirectional_attention=True; the retrofit keeps decoders causal"
        attentions = []
        for idx, layer in enumerate(self.layers(base)):
            found = layer_attentions(layer)
            if idx not in attention_layers:  # kept as it is, with its cache layer: it must not attend
                if found:
                    return (
                        f"its layer {idx} of layer type {layer_types[idx]!r} calls the attention interface "
                        f"({type(found[0][1]).__name__}); the retrofit switches the layers of the types "
                        f"{list(ATTENTION_LAYER_TYPES)} and keeps the others as they are"
                    )
                continue
            if len(found) != 1:
                return f"its layer {idx} has {len(found)} attention modules calling the attention interface (not 1)"
            name, attention = found[0]
            if "hidden_states" not in inspect.signature(type(attention).forward).parameters:
                return (
                    f"its attention {type(attention).__name__} is not called on the layer's hidden_states (it is "
                    "handed its q, k and v inputs apart), which the retrofit's probes run it on"
                )
            if inspect.getsource(type(attention).forward).count("attention_interface(") > 1:
                return (
                    f"its attention {type(attention).__name__} calls the attention function more than once per layer "
                    "(e.g. differential attention: the differential normalizer is hf_posenc's form of it)"
                )
            attentions.append(attention)
        if not attention_layers:
            return f"its layer_types {sorted(set(layer_types))} hold no attention layer"
        own_caches = own_cache_classes(base)
        if own_caches:
            return (
                f"its forward takes a cache of its own class ({', '.join(c.__name__ for c in own_caches)}), which "
                "keeps states outside Transformers' cache layers; the retrofit keeps the attention keys in "
                "Transformers' DynamicCache and StaticCache, beside the other layers' cache layers"
            )
        dims = attention_dims(config, True)
        for attention in attentions:
            if getattr(attention, "layer_idx", None) is None:
                return f"its attention {type(attention).__name__} has no layer_idx"
            head_dim = self.handed_head_dim(config) or dims.head_dim
            if getattr(attention, "head_dim", head_dim) != head_dim:
                return f"its attention's head_dim {attention.head_dim} is not the config's {head_dim}"
        return None

    def position_modules(self, base: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
        """``(owner, name, module)`` of the children of the base model and of the module holding the layers
        (:meth:`layer_list`: OPT's decoder) beside the layers, the token embeddings, the norms (a class named
        ``...Norm...``) and modules holding no tensor: where a model without a rotary module could add positions."""
        embeddings = base.get_input_embeddings()
        owner, layers_name = self.layer_list(base)
        return [
            (parent, name, child)
            for parent in dict.fromkeys((base, owner))
            for name, child in parent.named_children()
            if not (parent is owner and name == layers_name)
            and child is not owner
            and child is not embeddings
            and not isinstance(child, PositionEncoding)  # the retrofit's own scheme, once patched
            and "Norm" not in type(child).__name__
            and any(True for _ in itertools.chain(child.parameters(), child.buffers()))
        ]

    def probe_nope(self, model: PreTrainedModel) -> int | None:
        """Check, on the modules themselves, that the attention of a model without a rotary module is NoPE: each
        attention module, run on random hidden states of 8 positions two of which are equal, hands over equal q and
        k rows for them (no position enters q or k), and its own attention function (eager) gives what causal
        softmax attention of those q, k, v gives (:func:`plain_attention`: no position bias, sink or other term
        beside them), and the q and k the stock forward hands them do not change with the positions
        (:func:`check_no_other_positions`); ``ValueError`` naming the difference otherwise, or where the q, k and v
        heads differ in size.
        Returns that size where it is not the config's ``head_dim`` (Kimi Linear's MLA without positions: its
        ``head_dim`` is the size of the key part it does not rotate), else None. The modules are left as they were;
        skipped on a model built without weights (meta)."""
        config, base = model.config, decoder_base(model)
        parameters = list(base.parameters())
        if parameters[0].is_meta:
            return None
        device, dtype = parameters[0].device, parameters[0].dtype
        tolerance = probe_tolerance(dtype)
        positions = torch.arange(8, device=device)[None]
        hidden = torch.randn(1, 8, config.hidden_size, generator=torch.Generator().manual_seed(0))
        hidden[:, 5] = hidden[:, 2]
        hidden = hidden.to(device, dtype)
        mask = torch.full((8, 8), torch.finfo(dtype).min, device=device, dtype=dtype).triu(1)[None, None]
        prefix = f"retrofit(): {type(model).__name__} ({config.model_type}) has no rotary module"
        sizes = set()
        for idx in attention_layer_indices(config):
            attention = self.attention(self.layers(base)[idx])
            name = type(attention).__name__
            with torch.no_grad():
                query, key, value_dim = captured_heads(attention, hidden, None, positions)
                stock = call_stock_attention(attention, "eager", hidden, None, positions, mask)[0]
                plain = call_stock_attention(attention, PLAIN_ATTENTION, hidden, None, positions, mask)[0]
            sizes.add((query.shape[-1], key.shape[-1], value_dim))
            if len(sizes) > 1 or len(set(next(iter(sizes)))) > 1:
                raise ValueError(
                    f"{prefix}, and its attention layers hand over q, k and v heads of {sorted(sizes)} features: "
                    "the retrofit takes one head size for q, k and v in every layer."
                )
            moved = max(
                (t[:, :, 5] - t[:, :, 2]).float().abs().max().item() / max(1.0, t.float().abs().max().item())
                for t in (query, key)
            )
            if moved > tolerance:
                raise ValueError(
                    f"{prefix}, yet its attention {name} (layer {idx}) gives one input at two positions different q "
                    f"or k (by {moved:.2g}): positions enter them otherwise, which the retrofit does not read."
                )
            difference = (stock.float() - plain.float()).abs().max().item()
            difference /= max(1.0, stock.float().abs().max().item())
            if difference > tolerance:
                raise ValueError(
                    f"{prefix}, yet its attention {name} (layer {idx}) computes otherwise than causal softmax "
                    f"attention of the q, k, v it hands over (max difference {difference:.2g}): a position bias or "
                    "other term the retrofit does not read."
                )
        attentions = {idx: self.attention(self.layers(base)[idx]) for idx in attention_layer_indices(config)}
        check_no_other_positions(model, attentions, hidden, positions)
        size = next(iter(sizes))[0]
        return size if size != attention_dims(config, True).head_dim else None

    def own_layout(
        self, model: PreTrainedModel, own_rotary: list[dict[str, Any] | None] | None
    ) -> tuple[str | None, dict[str, Any] | list[dict[str, Any]], int | None]:
        """The stock rotation's pair layout, the model's own scheme as its modules compute it, and the size of the
        heads they hand over where it is not the config's ``head_dim``: ``rope`` of each layer's parameters,
        ``none`` on a layer that does not rotate (:meth:`probe_rotation`); ``none`` for a model without a rotary
        module (:meth:`probe_nope`). A hybrid's other layers carry what its attention layers share
        (:func:`attention_shared`). Attention modules computing their softmax inline (XGLM's) are probed as
        :class:`InlineAttention` (:func:`inline_attention_as_interface`), restored afterwards."""
        base = decoder_base(model)
        attentions = [self.attention(self.layers(base)[idx]) for idx in attention_layer_indices(model.config)]
        with inline_attention_as_interface(attentions, model.config):
            return self.probed_layout(model, own_rotary)

    def probed_layout(
        self, model: PreTrainedModel, own_rotary: list[dict[str, Any] | None] | None
    ) -> tuple[str | None, dict[str, Any] | list[dict[str, Any]], int | None]:
        """:meth:`own_layout` on modules that all call the attention interface."""
        if own_rotary is None:  # NoPE attention, beside a learned table (OPT, BioGPT, GPT-BigCode) or not
            base = decoder_base(model)
            own = {"type": "learned"} if self.absolute_table(base) is not None else {"type": "none"}
            with self.without_stock_table(base):
                return None, own, self.probe_nope(model)
        layout, nope_layers = self.probe_rotation(model, own_rotary)
        own = [{"type": "none"} if idx in nope_layers else spec for idx, spec in enumerate(own_rotary)]
        own = attention_shared(own, attention_kinds(model.config))
        if isinstance(own, list) and all(spec == own[0] for spec in own):
            own = own[0]
        return layout, own, self.handed_head_dim(model.config)

    def probe_rotation(
        self, model: PreTrainedModel, own_rotary: list[dict[str, Any] | None]
    ) -> tuple[str | None, list[int]]:
        """What each stock attention layer does with the rotary embedding, read from the model itself: the stock base
        model runs on random embeddings of 8 positions with its rotary module and with the identity (``cos = 1, sin =
        0``: :func:`identity_rotary_forward`), every attention function replaced for the call by
        :func:`capture_attention` (so each layer's input is the same in both runs), so each layer gets what the stock
        forward hands it (Lara Mini's full layers get no rotary embedding). Equal q and k mean a layer without
        rotation (EXAONE 4's full layers: NoPE); otherwise hf_posenc's ``rope`` of the layer's own spec must rotate
        the identity's q and k into the stock ones (:func:`probe_tolerance`: 1e-5 in float32), in the pair layout
        ``"half"`` (Llama's ``rotate_half``), ``"interleaved"`` (GLM, Cohere) or ``"swapped"`` (nanochat's rotation by
        ``-m theta``: :func:`half_layout_order`), on the
        rotary part of MLA's heads (:meth:`rotary_start`); complex frequencies (DeepSeek V2) are read alike. Returns
        the layout (None where no layer rotates, or on a model built without weights: meta) and the layers without
        rotation; ``ValueError`` naming the difference for a rotation it cannot describe. The modules are left as
        they were."""
        config, base = model.config, decoder_base(model)
        parameters = list(base.parameters())
        if parameters[0].is_meta:
            return None, []
        device = parameters[0].device
        dims = attention_dims(config, True)
        dims = dataclasses.replace(dims, head_dim=self.handed_head_dim(config) or dims.head_dim)
        start = self.rotary_start(config)
        positions = torch.arange(8, device=device)[None]
        hidden = torch.randn(1, 8, config.hidden_size, generator=torch.Generator().manual_seed(0)).to(device)
        hidden = hidden.to(parameters[0].dtype)
        layer_types = config_layer_types(config)
        attention_layers = attention_layer_indices(config)
        per_type = "rope_theta" not in used_rope_parameters(config)
        with torch.no_grad():
            embeddings = base.rotary_emb(hidden, positions, *([layer_types[attention_layers[0]]] if per_type else []))
        pair = isinstance(embeddings, tuple) and len(embeddings) == 2
        if not (pair or isinstance(embeddings, torch.Tensor) and embeddings.is_complex()):
            raise ValueError(
                f"retrofit(): {type(model).__name__} ({config.model_type}): its rotary module "
                f"{type(base.rotary_emb).__name__} returns {type(embeddings).__name__}, not the (cos, sin) pair or "
                "the complex frequencies the retrofit reads"
            )
        attentions = {idx: self.attention(self.layers(base)[idx]) for idx in attention_layers}
        identity = check_no_other_positions(model, attentions, hidden, positions)
        stock = captured_forward(base, attentions, hidden, positions, identity_rotary=False)
        differences, nope_layers = {"half": 0.0, "interleaved": 0.0, "swapped": 0.0}, []
        for idx in attention_layers:
            spec, rotated, plain = own_rotary[idx], stock[idx], identity[idx]
            if spec is None:  # a layer type without rotary parameters (Beam's full layers): the model rotates none
                nope_layers.append(idx)
                continue
            if all(torch.equal(r, q) for r, q in zip(rotated, plain, strict=True)):
                nope_layers.append(idx)
                continue
            if plain[0].shape[-1] != dims.head_dim:
                raise ValueError(
                    f"retrofit(): {type(model).__name__} ({config.model_type}): layer {idx} hands over heads of "
                    f"{plain[0].shape[-1]} features, not the config's head_dim {dims.head_dim}."
                )
            resolved = resolve_position_layout(
                spec, 1, rotary_size(config.max_position_embeddings, [spec]), True, config.hidden_size
            )
            ours = POSITION_ENCODINGS["rope"](resolved, dims)
            tables = ours.prepare(positions, positions, "eager")
            for layout in differences:
                order = half_layout_order(dims.head_dim, ours.rotary_dim, layout, start)
                with torch.no_grad():
                    actual = ours.transform_qkv(plain[0][..., order], plain[1][..., order], plain[1], tables)
                difference = max(
                    (a.float() - e[..., order].float()).abs().max().item() / max(1.0, e.float().abs().max().item())
                    for a, e in zip(actual[:2], rotated, strict=True)
                )
                differences[layout] = max(differences[layout], difference)
        if len(nope_layers) == len(attention_layers):
            return None, nope_layers
        layout = min(differences, key=differences.get)
        if differences[layout] > probe_tolerance(hidden.dtype):
            raise ValueError(
                f"retrofit(): {type(model).__name__} ({config.model_type}) rotates q and k otherwise than hf_posenc's "
                f"rope with its own parameters ({next(spec for spec in own_rotary if spec)}), in any pair layout: "
                f"max difference {differences[layout]:.2g}, relative to the largest value (a layout or rescaling the "
                "rope spec does not describe)."
            )
        return layout, nope_layers

    def check_request(self, specs: list[dict[str, Any]], normalizer: dict[str, Any], use_qk_norm: bool | None) -> None:
        """``ValueError`` for what the stock attention module does not hand over: a scheme's content term (it reads
        the layer's input and projections), a normalizer's output gate (the layer's input), a QK-norm switch (the
        stock module applies its own)."""
        content = sorted({spec["type"] for spec in specs if POSITION_ENCODINGS[spec["type"]].has_layer_term})
        if content:
            raise ValueError(
                f"retrofit(): position_encoding {content} reads the layer's input and projections, which a decoder "
                f"retrofitted through the attention interface ({self.name}) does not hand to its attention function; "
                "choose a rotary, score-bias or input-side scheme."
            )
        if normalizer.get("output_gate") is not None:
            raise ValueError(
                f"retrofit(): attention_normalizer option output_gate={normalizer['output_gate']!r} gates with the "
                f"layer's input, which a decoder retrofitted through the attention interface ({self.name}) does not "
                "hand to its attention function; use output_gate=None."
            )
        if use_qk_norm is not None:
            raise ValueError(
                f"retrofit(): use_qk_norm={use_qk_norm!r}: a decoder retrofitted through the attention interface "
                f"({self.name}) keeps its own QK-norm or none; leave use_qk_norm=None."
            )

    def patch_attention(self, attention, config, causal):
        """The stock module stays; its own config copy names :data:`RETROFIT_ATTENTION`, so it calls
        :func:`interface_attention` whatever backend the model's config requests (the library's backend choice
        reads that one). One computing its softmax inline becomes :class:`InlineAttention` first."""
        with inline_attention_as_interface([attention], config, keep=True):
            pass
        attention.config = copy.copy(attention.config)
        attention.config._attn_implementation_internal = RETROFIT_ATTENTION
        if isinstance(getattr(attention, "sinks", None), torch.Tensor):  # moved into the normalizer
            del attention.sinks
            attention.__class__ = retrofit_class(type(attention), SinksInNormalizer)
        layout, start = getattr(config, "posenc_rotary_layout", "half"), self.rotary_start(config)
        if layout != "half" or start:
            dims = attention_dims(config, causal)
            fraction = (self.own_rotary(config)[attention.layer_idx] or {}).get("rotary_fraction", 1.0)
            rotary_dim = int(dims.head_dim * fraction) // 2 * 2
            attention.posenc_feature_order = half_layout_order(dims.head_dim, rotary_dim, layout, start)
        return []

    def applies_softcapping(self, model):
        """Gemma 2's attention passes ``softcap=config.attn_logit_softcapping`` to the attention function."""
        attention = self.first_attention(decoder_base(model))
        return "softcap" in inspect.getsource(type(attention).forward)

    def patch_rotary(self, base):
        for rotary in rotary_modules(base):  # none in a NoPE model
            rotary.forward = types.MethodType(identity_rotary_forward, rotary)

    def stock_attention_mask(self, config, inputs_embeds, attention_mask, position_ids, cache):
        """A hybrid's other layers read the stock mask of their layer type (Transformers' ``masking_utils`` mask
        function of the type: the recurrent layers' padding mask), which the stock forward takes as a dict by layer
        type; its attention layers get None (their masks are in the attention inputs). A layer type of several masks
        (``"hybrid"``: its attention's and its Mamba's) has each under the name of its part and None under its own
        (Falcon-H1 reads the parts, ZAYA its own and ``"conv"``); the recurrent padding masks are there under every
        name Transformers gives them. An indexer's layer type (:data:`SELECTING_ATTENTION_TYPES`) has its stock causal
        mask, additive and sized by ``cache`` as the stock forward builds it, which the indexer scores under."""
        kinds = config_layer_types(config)
        if all(kind in ATTENTION_LAYER_TYPES for kind in kinds):
            return None
        functions = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
        recurrent = getattr(masking_utils, "create_recurrent_attention_mask", None)
        parts = {}
        for kind in dict.fromkeys(kinds):
            function = functions.get(kind) if kind not in ATTENTION_LAYER_TYPES else None
            parts.update(function if isinstance(function, dict) else {kind: function})
        parts.update({name: function for name, function in functions.items() if function is recurrent})
        masks = {kind: None for kind in kinds}
        additive = copy.copy(config)  # the mask an indexer adds to its scores (older Transformers' indexers add it)
        additive._attn_implementation_internal = "eager"
        for kind in dict.fromkeys(kinds):
            if kind in SELECTING_ATTENTION_TYPES:
                masks[kind] = masking_utils.create_causal_mask(
                    config=additive,
                    inputs_embeds=inputs_embeds,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    allow_is_causal_skip=False,
                    **{CACHE_NAME: cache},
                )
                parts.pop(kind, None)
        for part, function in parts.items():
            if part not in ATTENTION_LAYER_TYPES and callable(function):
                masks[part] = function(
                    config=config,
                    inputs_embeds=inputs_embeds,
                    attention_mask=attention_mask,
                    cache=None,
                    position_ids=position_ids,
                )
            else:
                masks.setdefault(part, None)
        return masks

    def hand_down(self, call, cache):
        """The stock forward runs without a cache (``use_cache=False``): its attention modules would store k and v
        before the attention function; :func:`interface_attention` gets the cache and :func:`positional_attention`
        stores them after the scheme's transform, as in every family."""
        call[RETROFIT_CACHE] = cache if call["use_cache"] else None
        call.update({CACHE_NAME: None, "use_cache": False})

    def stock_output(self, output, call):
        if call[RETROFIT_CACHE] is not None:
            output["past_key_values"] = call[RETROFIT_CACHE]
        return output

    def attention_dropout(self, config):
        return getattr(config, "attention_dropout", 0.0)

    def check(self, config):
        StockFamily.check(self, config)


INTERFACE_FAMILY = InterfaceFamily(
    "decoders whose attention goes through Transformers' attention interface with a rotary module (MoE included)",
    (),
    RetrofitLlamaAttention,
    "llama",
)


FAMILIES = (
    BertFamily(
        "BERT family (Bert*, Roberta*, XLMRoberta*, Camembert*, Electra*, Data2VecText*)",
        (
            "BertSelfAttention",
            "RobertaSelfAttention",
            "XLMRobertaSelfAttention",
            "CamembertSelfAttention",
            "ElectraSelfAttention",
            "Data2VecTextSelfAttention",
        ),
        RetrofitBertSelfAttention,
        "bert",
    ),
    RoFormerFamily("RoFormer (RoFormer*)", ("RoFormerSelfAttention",), RetrofitRoFormerSelfAttention, "bert"),
    GPT2Family("GPT-2 (GPT2*)", ("GPT2Attention",), RetrofitGPT2Attention, "gpt2"),
    GPTNeoFamily("GPT-Neo (GPTNeo*)", ("GPTNeoSelfAttention",), RetrofitGPTNeoSelfAttention, "gpt_neo"),
    LlamaFamily(
        "Llama family (Llama*, Mistral*, Qwen2*, SmolLM3*)",
        ("LlamaAttention", "MistralAttention", "Qwen2Attention", "SmolLM3Attention"),
        RetrofitLlamaAttention,
        "llama",
    ),
    LlamaFamily("Qwen3 (Qwen3*)", ("Qwen3Attention",), RetrofitLlamaAttention, "llama", qk_norm="head"),
    LlamaFamily(
        "Gemma 3 text (Gemma3ForCausalLM, Gemma3TextModel)",
        ("Gemma3Attention",),
        RetrofitLlamaAttention,
        "llama",
        qk_norm="head",
    ),
    LlamaFamily("OLMo 3 (Olmo3*)", ("Olmo3Attention",), RetrofitOlmo3Attention, "llama", qk_norm="projection"),
    LlamaFamily("gpt-oss (GptOss*)", ("GptOssAttention",), RetrofitGptOssAttention, "llama", sinks=True),
    ModernBertFamily("ModernBERT (ModernBert*)", ("ModernBertAttention",), RetrofitModernBertAttention, "modernbert"),
    FusedAlibiFamily(
        "ALiBi decoders with fused q/k/v projections (BLOOM, MPT)", (), RetrofitFusedAlibiAttention, "bloom"
    ),
)


def decoder_base(model: PreTrainedModel) -> nn.Module:
    """The module that holds a model's layers: ``model.base_model``, or, where the class's ``base_model_prefix``
    names none of its children (Llama 4's text LM: prefix ``language_model``, its decoder at ``model``), that child
    ``model`` when it holds ``layers``; where the base model holds its layers in a ``decoder`` model of its own
    (OPT's ``OPTDecoder``, which the causal LM calls itself), that decoder."""
    base = model.base_model
    inner = getattr(model, "model", None)
    if base is model and isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return inner
    decoder = getattr(base, "decoder", None)
    if not hasattr(base, "layers") and isinstance(decoder, PreTrainedModel) and hasattr(decoder, "layers"):
        return decoder  # OPT's, TrOCR's: the causal LM calls its base model's decoder itself
    return base


def own_cache_classes(base: nn.Module) -> list[type]:
    """The cache classes of its own a base model's ``forward`` names for its cache argument (MiniMax's
    ``MiniMaxCache``): those beside Transformers' ``Cache`` and ``DynamicCache``."""
    parameter = inspect.signature(type(base).forward).parameters.get(CACHE_NAME)
    annotation = parameter.annotation if parameter is not None else None
    named = typing.get_args(annotation) or (annotation,)
    return [
        kind
        for kind in named
        if isinstance(kind, type) and issubclass(kind, Cache) and kind not in (Cache, DynamicCache, StaticCache)
    ]


ATTENTION_BESIDE_STATE_TYPES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}
"""Transformers' layer types of a layer holding attention beside a recurrent mixer (Falcon-H1's Mamba-2 in parallel
with its attention; one cache layer keeps both, ``LinearAttentionAndFullAttentionLayer``), and the type of that
attention: its masks and key positions are those of an attention layer of that type."""


SELECTING_ATTENTION_TYPES = {"indexed_attention": "full_attention", "deepseek_sparse_attention": "full_attention"}
"""Transformers' layer types of attention over the keys an indexer selects (DeepSeek Sparse Attention: DeepSeek V3.2,
GLM-MoE-DSA, HY V4, AXK2: a small scorer with its own rotary q and k picks the top-k keys of each query), and the type
of that attention: its masks and key positions are those of an attention layer of that type, less the keys the
indexer did not pick (:class:`RetrofitIndexer`, :func:`with_selected_keys`)."""


def attention_kinds(config) -> list[str]:
    """The type of each layer as the retrofit switches it: ``config.layer_types`` (:func:`config_layer_types`), a
    layer with attention beside a recurrent mixer (:data:`ATTENTION_BESIDE_STATE_TYPES`) or over the keys an indexer
    selects (:data:`SELECTING_ATTENTION_TYPES`) read as the type of its attention."""
    kinds = {**ATTENTION_BESIDE_STATE_TYPES, **SELECTING_ATTENTION_TYPES}
    return [kinds.get(kind, kind) for kind in config_layer_types(config)]


def attention_layer_indices(config) -> list[int]:
    """The indices of a model's attention layers: those whose type (:func:`attention_kinds`) is one of
    :data:`ATTENTION_LAYER_TYPES` (every layer of a model without hybrid layer types)."""
    return [idx for idx, kind in enumerate(attention_kinds(config)) if kind in ATTENTION_LAYER_TYPES]


def stock_layer_indices(config, layer_types: dict[str, str]) -> list[int]:
    """The layers whose ``config.layer_types`` entry is one of ``layer_types``' keys
    (:data:`ATTENTION_BESIDE_STATE_TYPES`, :data:`SELECTING_ATTENTION_TYPES`)."""
    return [idx for idx, kind in enumerate(config_layer_types(config)) if kind in layer_types]


def attention_shared(
    position_encoding: dict[str, Any] | list[dict[str, Any]], layer_types: list[str]
) -> dict[str, Any] | list[dict[str, Any]]:
    """A per-layer ``position_encoding`` the retrofit wrote out (the model's own, ``layers=``, a rotary variant
    started from each layer's own parameters), with each layer that is not an attention layer given what every
    attention layer carries where they carry the same, else ``none`` (:func:`check_linear_layer_positions`' rule); one
    spec where all layers then agree."""
    if not isinstance(position_encoding, list) or all(kind in ATTENTION_LAYER_TYPES for kind in layer_types):
        return position_encoding
    attention = attention_layer_specs(position_encoding, layer_types)
    shared = attention[0] if all(spec == attention[0] for spec in attention) else {"type": "none"}
    specs = [
        spec if kind in ATTENTION_LAYER_TYPES else shared
        for spec, kind in zip(position_encoding, layer_types, strict=True)
    ]
    return specs[0] if all(spec == specs[0] for spec in specs) else specs


def stock_family(model: nn.Module) -> StockFamily:
    """The family of a stock model, found from its attention modules; a clear error for any other model."""
    supported = "; ".join(family.name for family in FAMILIES)
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"retrofit() takes a Transformers model of: {supported}; got {type(model).__name__}.")
    base = decoder_base(model)
    if hasattr(base, "position_encoding"):
        raise ValueError(
            f"{type(model).__name__} already has a switchable position encoding ({base.position_encoding.spec}); "
            "retrofit() patches a stock model once (PosEnc models switch by config)."
        )
    names = {type(module).__name__ for module in base.modules()}
    for family in FAMILIES:
        if family.matches(base, names):
            family.check_model(model)
            return family
    reason = INTERFACE_FAMILY.refusal(model)
    if reason is None:
        return INTERFACE_FAMILY
    raise ValueError(
        f"retrofit() cannot take {type(model).__name__} ({model.config.model_type}): {reason}. It takes the "
        f"{supported}; and {INTERFACE_FAMILY.name}."
    )


# The per-forward set-up, run by the base model's ``forward`` before the stock one.


def prepare_forward(family: StockFamily, base: PreTrainedModel, call: dict[str, Any]) -> dict[str, Any]:
    """Resolve positions and the cache, embed, build the attention inputs once; return the keyword arguments of the
    stock forward, which then runs on ``inputs_embeds`` with the attention inputs and the scheme as keyword arguments.
    ``call``: the arguments of this call bound to the stock forward's signature."""
    call = dict(call)
    call.update(call.pop("kwargs", {}))
    config = base.config
    for name in ("encoder_hidden_states", "encoder_attention_mask"):
        if call.get(name) is not None:
            raise ValueError(f"A retrofitted {type(base).__name__} has no cross-attention; got {name}.")
    input_ids, inputs_embeds = call.pop("input_ids", None), call.pop("inputs_embeds", None)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Specify exactly one of input_ids or inputs_embeds.")
    if inputs_embeds is None:
        inputs_embeds = base.get_input_embeddings()(input_ids)
    causal = family.causal(config)
    cache = given_cache(call.pop("cache", None), call.pop("past_key_values", None))
    if causal:
        call["use_cache"] = config.use_cache if call.get("use_cache") is None else call["use_cache"]
        if base.training and getattr(family.layers(base)[0], "gradient_checkpointing", False):
            # as Transformers' checkpointed layers drop it (the recomputed forward would store the keys again); the
            # attention-interface family's cache bypasses their keyword arguments
            call["use_cache"] = False
        if call["use_cache"] and cache is None:
            cache = DynamicCache(config=config)
        family.hand_down(call, cache)
    elif cache is not None:
        raise ValueError(f"A retrofitted {type(base).__name__} encoder keeps no KV cache; got {CACHE_NAME}.")
    past_length = cache.get_seq_length() if cache is not None else 0
    default_positions = call.get("position_ids") is None
    if default_positions:
        position_ids = family.default_position_ids(
            base, input_ids, inputs_embeds, past_length, call.get("attention_mask")
        )
    else:
        position_ids = resolve_position_ids(call["position_ids"], inputs_embeds, past_length)
    position_cache = PositionCache(cache, config.num_hidden_layers) if cache is not None else None
    attention_mask = call.pop("attention_mask", None)
    output_attentions = call.get("output_attentions")
    encoding = base.position_encoding
    embedding_inputs = EmbeddingInputs(inputs_embeds, position_ids, input_ids, attention_mask, position_cache)
    hidden_states = family.embed(base, encoding, embedding_inputs, call)
    attention_inputs = prepare_attention(
        base,
        encoding,
        hidden_states,
        attention_mask,
        position_ids,
        causal=causal,
        attention_dropout=family.attention_dropout(config),
        cache=cache,
        position_cache=position_cache,
        output_attentions=config.output_attentions if output_attentions is None else output_attentions,
        default_positions=default_positions and family.default_positions_are_consecutive(base, input_ids),
        layer_types=attention_kinds(config),
    )
    # The masks live in the attention inputs; a hybrid's other layers get theirs.
    stock_mask = family.stock_attention_mask(config, hidden_states, attention_mask, position_ids, cache)
    call.update(inputs_embeds=hidden_states, position_ids=position_ids, attention_mask=stock_mask)
    call.update({ATTENTION_INPUTS: attention_inputs, POSITION_ENCODING: encoding})
    return call


# The patch.


def retrofit(
    model: PreTrainedModel,
    position_encoding: str | dict[str, Any] | list[dict[str, Any]] | None = None,
    attention_normalizer: str | dict[str, Any] | None = None,
    *,
    layers: list[int] | None = None,
    use_qk_norm: bool | None = None,
    **options: Any,
) -> PreTrainedModel:
    """Switch a stock model's position encoding and attention normalizer in place; returns the model.

    Args:
        model: a stock Transformers model of a supported family (see the module docstring), any head, or a path or
            Hub id (loaded with the class its config names).
        position_encoding: a scheme name or ``{"type": name, **options}`` (``hf_posenc.list_position_encodings()``),
            or one per attention layer (a list); None keeps the model's own: ``learned`` (BERT, GPT-2: the stock
            table), ``rope`` with the model's rotary parameters (Llama-like: base, partial rotation and scaling, per
            layer type where they differ, ``none`` on SmolLM3's NoPE layers). With the model's own scheme and
            normalizer the model computes what it did.
        attention_normalizer: a name or ``{"type": name, **options}`` (``hf_posenc.list_attention_normalizers()``);
            None keeps the model's own (``softmax``; gpt-oss: ``softmax`` with its learned sinks).
        layers: the attention layers ``position_encoding`` goes to; the others keep the model's own scheme (None:
            every layer).
        use_qk_norm: per-head RMSNorm of q and k before the position encoding (``q_norm``/``k_norm``, weights 1 at
            first); None keeps the model's own (Qwen3, Gemma 3, OLMo 3 have one; OLMo 3's normalizes the whole
            projection), False removes it.
        **options: options of the position encoding (``retrofit(model, "t5", num_buckets=64)``).

    Every pretrained weight is kept. The stock position table becomes the ``learned`` scheme's table (RoBERTa: its
    rows after ``padding_idx``) and is dropped for any other scheme. New parameters (a T5 bias table, Shaw's relative
    embeddings, a normalizer's gate) get the model family's own init, ``_init_weights``: normal(0,
    ``initializer_range``) for linear and embedding weights, so a position bias starts close to zero and the patched
    model starts from what the stock layers compute without their old positions. A normalizer's smaller W_V/W_O init
    (``value_init_scale``) is for fresh models; pretrained projections are kept. gpt-oss's sinks become the learned
    sink of a normalizer that has one, and are dropped under any other.
    """
    if isinstance(model, (str, Path)):
        # Checked on the model built without weights (meta tensors), so a bad request reads no weight.
        plan_retrofit(stock_skeleton(model), position_encoding, attention_normalizer, layers, use_qk_norm, options)
        model = load_stock_model(model)
    plan = plan_retrofit(model, position_encoding, attention_normalizer, layers, use_qk_norm, options)
    apply_retrofit(model, plan)
    return model


@dataclasses.dataclass(frozen=True)
class RetrofitPlan:
    """What a retrofit writes into the config, every part checked before anything changes."""

    family: StockFamily
    position_encoding: dict[str, Any] | list[dict[str, Any]]
    attention_normalizer: dict[str, Any]
    use_qk_norm: bool
    drops_softcapping: bool
    """Gemma 3's config keeps Gemma 2's ``attn_logit_softcapping``, but its attention passes no softcap."""
    rotary_layout: str | None = None
    """The stock rotation's pair layout (:meth:`InterfaceFamily.probe_rotation`), for the attention-interface family;
    stored as ``config.posenc_rotary_layout``."""
    head_dim: int | None = None
    """The size of the q and k heads the stock attention hands over, where the config's ``head_dim`` says otherwise
    (MLA's, :meth:`InterfaceFamily.handed_head_dim`; a NoPE model's, :meth:`InterfaceFamily.probe_nope`); stored as
    ``config.posenc_head_dim``, which the scheme's sizes read."""
    embedding_size: int | None = None
    """The token embeddings' width where they are projected to ``hidden_size`` (:meth:`StockFamily.embedding_size`:
    ELECTRA, RemBERT); stored as ``config.posenc_embedding_size``, at which input-side schemes act."""
    layer_layout: tuple[list[str], int | None] | None = None
    """The layer types and sliding window of a config that names them otherwise
    (:meth:`StockFamily.stock_layer_layout`: GPT-Neo), written as ``config.layer_types`` and
    ``config.sliding_window``."""
    max_position_embeddings: int | None = None
    """The family's length (:meth:`StockFamily.max_positions`) where the stock config has no
    ``max_position_embeddings`` (BLOOM, MPT), written into it."""


def plan_retrofit(
    model: PreTrainedModel,
    position_encoding: Any,
    attention_normalizer: Any,
    layers: list[int] | None,
    use_qk_norm: bool | None,
    options: dict[str, Any],
) -> RetrofitPlan:
    """The checked request of :func:`retrofit` for ``model``, which it leaves unchanged; ``ValueError`` naming the bad
    value otherwise. The new modules are built once here (and dropped), so an option only a module checks fails
    before the patch too."""
    family = stock_family(model)
    config = model.config
    layout = family.stock_layer_layout(config)
    if layout is not None:  # read as Transformers' names from here on, written by write_plan
        config = copy.copy(config)
        config.layer_types, config.sliding_window = layout
    family.check(config)
    base = decoder_base(model)
    family.layers(base)  # a decoder held inside another model (Gemma 3's multimodal one) is refused here
    offset = family.position_offset(base)
    table = family.stock_table(base)
    causal = family.causal(config)
    num_layers = config.num_hidden_layers
    own = family.own_scheme(config)
    own_rotary = family.own_rotary(config)
    rotary_layout = head_dim = None
    layer_types = attention_kinds(config)
    if family is INTERFACE_FAMILY:  # the own scheme as the stock modules compute it: none where they do not rotate
        rotary_layout, own, head_dim = family.own_layout(model, own_rotary)
    given_per_layer = isinstance(position_encoding, (list, tuple))
    if position_encoding is None:
        position_encoding = own
    if isinstance(position_encoding, str):
        position_encoding = {"type": position_encoding}
    if options:
        if isinstance(position_encoding, (list, tuple)):
            raise ValueError(
                f"retrofit(): options {sorted(options)} go to one scheme; with a per-layer position_encoding give "
                "each layer's options in its dict."
            )
        position_encoding = {**position_encoding, **options}
    if layers is not None:
        position_encoding = layer_switch(own, position_encoding, layers, num_layers)
        others = sorted(set(layers) - set(attention_layer_indices(config)))
        if others:
            raise ValueError(
                f"retrofit(): layers {others} are not attention layers (layer_types "
                f"{[layer_types[idx] for idx in others]}); a switch names attention layers only: "
                f"{attention_layer_indices(config)}."
            )
    if own_rotary is not None:
        position_encoding = from_own_rotary(position_encoding, own_rotary)
    if not given_per_layer:  # what the retrofit wrote out per layer: a hybrid's other layers carry no scheme of theirs
        position_encoding = attention_shared(position_encoding, layer_types)
    max_positions = table_rows(table).shape[0] - offset if table is not None else family.max_positions(config)
    # The stock model runs a scaling whose original length is past max_position_embeddings (Transformers warns):
    # the size check of a PosEnc config's rope does not apply to what the stock config holds.
    size = rotary_size(max_positions, own_rotary) if table is None else max_positions
    embedding_size = family.embedding_size(base)
    spec = resolve_position_layout(position_encoding, num_layers, size, causal, embedding_size or config.hidden_size)
    if isinstance(spec, list) and all(layer_spec == spec[0] for layer_spec in spec):
        spec = spec[0]
    check_linear_layer_positions(spec, layer_types)
    first = layer_position_specs(spec, num_layers)[0]
    if first["type"] == "learned" and table is not None and first["max_positions"] > max_positions:
        raise ValueError(
            f"retrofit(): the stock position table has {max_positions} positions; got max_positions="
            f"{first['max_positions']}. Lengthen it with hf_posenc.extend_positions(model, max_positions) instead."
        )
    check_layer_windows(
        spec,
        layer_types,
        getattr(config, "sliding_window", None),
        getattr(config, "attention_chunk_size", None),
    )
    if attention_normalizer is None:
        attention_normalizer = family.own_normalizer(config)
        if family is INTERFACE_FAMILY and family.has_sinks(model):
            attention_normalizer = {"type": "softmax", "sink": "learned"}
    normalizer = resolve_attention_normalizer(attention_normalizer, causal, config.num_attention_heads)
    if family is INTERFACE_FAMILY:
        family.check_request(layer_position_specs(spec, num_layers), normalizer, use_qk_norm)
        use_qk_norm = getattr(family.first_attention(base), "q_norm", None) is not None
    if use_qk_norm is None:
        use_qk_norm = family.qk_norm is not None
    if not isinstance(use_qk_norm, bool):
        raise ValueError(
            f"retrofit(): use_qk_norm must be True, False or None (the model's own); got {use_qk_norm!r}."
        )
    plan = RetrofitPlan(
        family,
        spec,
        normalizer,
        use_qk_norm,
        getattr(config, "attn_logit_softcapping", None) is not None and not family.applies_softcapping(model),
        rotary_layout,
        head_dim,
        embedding_size,
        layout,
        max_position_embeddings=None if hasattr(config, "max_position_embeddings") else family.max_positions(config),
    )
    trial = copy.copy(config)
    write_plan(trial, plan)
    build_modules(trial, causal)
    return plan


def rotary_size(max_positions: int, own_rotary: list[dict[str, Any] | None] | None) -> int:
    """The length a retrofit checks rotary specs against: ``max_position_embeddings``, or a stock scaling's longer
    original length (Transformers warns and runs it: a tiny config of a model scaled from 8192 positions)."""
    originals = [(spec.get("scaling") or {}).get("original_max_positions") or 0 for spec in own_rotary or [] if spec]
    return max([max_positions, *originals])


def from_own_rotary(
    position_encoding: dict[str, Any] | list[Any], own_rotary: list[dict[str, Any] | None]
) -> dict[str, Any] | list[dict[str, Any]]:
    """A rotary variant named in a retrofit (a scheme with a ``theta``: ``rope``, p-RoPE, ``xpos``, ...) starts from
    the model's own rotary parameters of each layer (``theta``, ``rotary_fraction``, ``scaling`` where the scheme has
    them); the options given override them. Other schemes are left as given."""
    per_layer = isinstance(position_encoding, (list, tuple))
    if per_layer and len(position_encoding) != len(own_rotary):  # resolve_position_layout names the lengths
        return position_encoding
    specs = list(position_encoding) if per_layer else [position_encoding] * len(own_rotary)
    merged = []
    for spec, own in zip(specs, own_rotary, strict=True):
        spec = {"type": spec} if isinstance(spec, str) else spec
        scheme = POSITION_ENCODINGS.get(spec.get("type")) if isinstance(spec, dict) else None
        if own is not None and scheme is not None and "theta" in scheme.options:
            inherited = {key: value for key, value in own.items() if key != "type" and key in scheme.options}
            spec = {**inherited, **spec}
        merged.append(spec)
    return merged if per_layer or any(spec != merged[0] for spec in merged) else merged[0]


def write_plan(config, plan: RetrofitPlan) -> None:
    """Write a checked plan into ``config``."""
    if plan.drops_softcapping:
        config.attn_logit_softcapping = None
    config.position_encoding = plan.position_encoding
    config.attention_normalizer = plan.attention_normalizer
    config.use_qk_norm = plan.use_qk_norm
    if plan.rotary_layout is not None:
        config.posenc_rotary_layout = plan.rotary_layout
    if plan.head_dim is not None:
        config.posenc_head_dim = plan.head_dim
    if plan.embedding_size is not None:
        config.posenc_embedding_size = plan.embedding_size
    if plan.layer_layout is not None:
        config.layer_types, config.sliding_window = plan.layer_layout
    if plan.max_position_embeddings is not None:
        config.max_position_embeddings = plan.max_position_embeddings


def build_modules(config, causal: bool) -> tuple[PositionEncoding, list[AttentionNormalizer], list]:
    """The scheme, and each attention layer's normalizer and position term, of a config holding resolved specs
    (built from them as they are: a retrofit resolved them against the stock config)."""
    dims = attention_dims(config, causal)
    specs = layer_position_specs(config.position_encoding, config.num_hidden_layers)
    encoding = build_position_encoding_module(config.position_encoding, dims)
    normalizers = [build_attention_normalizer(config, causal, idx) for idx in range(config.num_hidden_layers)]
    terms = [POSITION_ENCODINGS[spec["type"]].layer_term(spec, dims, idx) for idx, spec in enumerate(specs)]
    return encoding, normalizers, terms


def apply_retrofit(model: PreTrainedModel, plan: RetrofitPlan) -> None:
    """Write ``plan`` into the config, patch the model and initialise the new modules (the stock position table
    becomes the ``learned`` table, gpt-oss's sinks the learned sink)."""
    family, config, base = plan.family, model.config, decoder_base(model)
    if plan.drops_softcapping:
        logger.warning(
            f"retrofit(): this {config.model_type} model's attention does not apply its config's "
            f"attn_logit_softcapping={config.attn_logit_softcapping}; set to None, as the model computes."
        )
    offset, table = family.position_offset(base), family.stock_table(base)
    first = layer_position_specs(plan.position_encoding, config.num_hidden_layers)[0]
    write_plan(config, plan)
    layers = family.layers(base)
    stock_sinks = {}
    for idx in attention_layer_indices(config):
        sinks = getattr(family.attention(layers[idx]), "sinks", None)
        if isinstance(sinks, torch.Tensor) and sinks.numel():
            stock_sinks[idx] = sinks.detach().clone()
    new_modules = patch(model, family)
    for module in new_modules:
        submodules = list(module.modules())
        for submodule in submodules:
            model._init_weights(submodule)
        for submodule in submodules:  # the scheme's own init after its submodules' family init, as in PosEnc models
            if isinstance(submodule, (PositionEncoding, LayerPositionTerm, AttentionNormalizer)):
                submodule.init_weights(getattr(config, "initializer_range", 0.02))
    with torch.no_grad():
        if first["type"] == "learned" and table is not None:
            base.position_encoding.table.weight.copy_(table_rows(table)[offset : offset + first["max_positions"]])
        for idx in attention_layer_indices(config) if stock_sinks else []:
            sink = getattr(family.attention(layers[idx]).normalizer, "sink", None)
            if sink is not None:
                sink.copy_(stock_sinks[idx] if idx in stock_sinks else torch.full_like(sink, NO_SINK_LOGIT))


def layer_switch(
    own: dict[str, Any] | list[dict[str, Any]], switched: Any, layers: list[int], num_layers: int
) -> list[dict[str, Any]]:
    """The per-layer list of ``switched`` on ``layers`` and the model's ``own`` scheme elsewhere; ``ValueError`` for
    a layer index out of range or a per-layer ``switched``."""
    if isinstance(switched, (list, tuple)):
        raise ValueError("retrofit(): layers= takes one position_encoding (a name or a dict), not a per-layer list.")
    bad = [idx for idx in layers if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < num_layers]
    if bad or not layers:
        raise ValueError(
            f"retrofit(): layers must be a non-empty list of attention layer indices in 0 .. {num_layers - 1}; "
            f"got {layers!r}."
        )
    own_specs = layer_position_specs(own, num_layers)
    return [switched if idx in layers else own_specs[idx] for idx in range(num_layers)]


STOCK_PLAN_SPLITS_HEAD_PAIRS = (
    "its stock plan gives each rank a contiguous share of the heads, and attention_normalizer {!r} pairs head h with "
    "head h + heads / 2, which another rank holds"
)


def check_retrofit_parallelism(model: PreTrainedModel, parallelism: str) -> None:
    """Raise ``ValueError`` with every reason the retrofitted model cannot train under ``parallelism``
    (``modeling_posenc_common.parallelism_refusals``): its scheme's and normalizer's, and Ulysses' (the attention is
    the library's composition). Tensor parallelism keeps the stock plan (Llama's q/k/v by rows, o by columns), and the
    attention reads its head count from q and k; a normalizer that pairs the two halves of the heads is refused
    there (the stock plan gives each rank a contiguous share)."""
    family_refusals = {"sequence": SEQUENCE_PARALLEL_ATTENTION}
    if pairs_head_halves(model.config):
        family_refusals["tensor"] = STOCK_PLAN_SPLITS_HEAD_PAIRS.format(model.config.attention_normalizer["type"])
    reasons = parallelism_refusals(model.config, parallelism, family_refusals)
    if reasons:
        raise ValueError(f"{type(model).__name__} cannot train under {parallelism} parallelism: {'; '.join(reasons)}.")


def refuse_tensor_parallel_plans(model: PreTrainedModel, distributed_config):
    """The stock ``_resolve_parallel_plans``, after refusing a tensor-parallel run the switched scheme or normalizer
    cannot take, by name and before any weight is sharded."""
    if distributed_config.tp_size > 1:
        check_retrofit_parallelism(model, "tensor")
        shard_heads(model)
    return type(model)._resolve_parallel_plans(model, distributed_config)


def patch(model: PreTrainedModel, family: StockFamily) -> list[nn.Module]:
    """Patch ``model`` per ``config.position_encoding``, ``config.attention_normalizer`` (full specs) and
    ``config.use_qk_norm``; return the modules it added. Also what the saved ``modeling_retrofit.py`` calls after
    building the stock model."""
    config, base = model.config, decoder_base(model)
    if (getattr(model, "_tp_size", None) or 1) > 1:  # loaded tensor-parallel: refused before any module changes
        check_retrofit_parallelism(model, "tensor")
    causal = family.causal(config)
    reference = base.get_input_embeddings().weight
    encoding, normalizers, terms = build_modules(config, causal)
    new_modules = [encoding.to(reference.device, reference.dtype)]
    base.position_encoding = encoding
    family.remove_stock_positions(base)
    attention_layers = attention_layer_indices(config)
    layers = family.layers(base)
    beside_state_layers = stock_layer_indices(config, ATTENTION_BESIDE_STATE_TYPES)
    selecting_layers = stock_layer_indices(config, SELECTING_ATTENTION_TYPES)
    for layer_idx, layer in enumerate(layers):
        if layer_idx not in attention_layers:  # a hybrid's other layers keep their modules and cache layers
            layer.__class__ = retrofit_class(type(layer), RetrofitStateLayer)
            continue
        beside_state = layer_idx in beside_state_layers
        layer.__class__ = retrofit_class(type(layer), RetrofitLayerBesideState if beside_state else RetrofitLayer)
        layer.posenc_layer_idx = layer_idx
        attention = family.attention(layer)
        if beside_state:
            attention.__class__ = retrofit_class(type(attention), RetrofitAttentionBesideState)
        if layer_idx in selecting_layers:
            attention.indexer.__class__ = retrofit_class(type(attention.indexer), RetrofitIndexer)
            attention.indexer.__dict__[INDEXER_ROTARY] = base.rotary_emb
            attention.indexer.__dict__[INDEXER_ATTENTION] = attention
        layer.__dict__[LAYER_ATTENTION] = attention  # not a submodule: state dict and module tree unchanged
        weight = next(attention.parameters())
        attention.normalizer = normalizers[layer_idx].to(weight.device, weight.dtype)
        attention.position_term = terms[layer_idx]
        new_modules.append(attention.normalizer)
        if attention.position_term is not None:
            attention.position_term.to(weight.device, weight.dtype)
            new_modules.append(attention.position_term)
        new_modules += family.patch_attention(attention, config, causal)
    family.patch_rotary(base)
    base.__dict__[ATTENTION_MODULES] = {idx: family.attention(layers[idx]) for idx in attention_layers}
    # The base model keeps its class (Transformers keys its output capturing on the class name): its ``forward`` is
    # replaced on the instance, which ``__call__``, accelerate's hooks and ``torch.compile`` all go through.
    base.forward = types.MethodType(retrofit_forward(type(base), family), base)
    for owner in {model, base}:
        owner.save_pretrained = functools.partial(save_retrofitted, owner)
        owner._initialize_weights = types.MethodType(stock_initialize_weights, owner)
        # The attention is the library's composition, on every backend (stock gpt-oss refuses SDPA for its sinks).
        owner._supports_sdpa = owner._supports_flex_attn = True
    model.create_masks_for_generate = keep_attention_mask_for_generate
    if (getattr(model, "_tp_size", None) or 1) > 1:  # loaded tensor-parallel: the scheme keeps this rank's heads
        shard_heads(model)
    # one that will be loaded tensor-parallel (Transformers resolves its plans after building it)
    model._resolve_parallel_plans = functools.partial(refuse_tensor_parallel_plans, model)
    # The saved type gets PEFT's defaults of the stock type (CamemBERT, Data2VecText have none: BERT's, same names).
    stock_type = stock_class_of(type(config)).model_type
    # Where PEFT has none for the stock type: the family's, if the model and its attention have modules of those names.
    names = [name for name, _ in model.named_modules()]
    in_attention = [name for module in base.__dict__[ATTENTION_MODULES].values() for name, _ in module.named_modules()]
    register_peft_default_targets(
        retrofit_model_type(stock_type), (stock_type, family.peft_model_type), names, in_attention
    )
    register_stock_conversions(stock_type)
    return new_modules


def stock_initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
    """A retrofitted model's ``_initialize_weights``: as for the stock model, also where it was loaded as remote
    code. There Transformers skips a module that holds no tensor of its own, which would leave what a stock base
    model's ``_init_weights`` fills in its layers uninitialised (Falcon-H1's non-persistent ``mup_vector``); the
    stock classes' init functions read the loaded flags themselves."""
    type(self)._initialize_weights(self, module, False)


def register_stock_conversions(stock_type: str) -> None:
    """Give the saved type the stock type's checkpoint conversions: Transformers saves MoE experts one by one and
    fuses them on load by a mapping keyed by ``model_type`` (and applies none to remote code unless registered), so
    without it a reloaded retrofitted MoE would miss its experts."""
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:  # a Transformers without load-time conversions loads the saved keys as they are
        return
    mapping = get_checkpoint_conversion_mapping(stock_type)
    if mapping is not None:
        register_checkpoint_conversion_mapping(retrofit_model_type(stock_type), mapping, overwrite=True)


def keep_attention_mask_for_generate(attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """A retrofitted model's ``create_masks_for_generate``, as a PosEnc model's: ``generate`` with a static cache would
    build the 4-D mask (a dict of them per layer type where the config has ``layer_types``, as Qwen2's) in the
    format of the requested backend; the patched forward builds each layer's mask itself, in the format of the
    backend that runs, from the 2-D mask kept here."""
    return attention_mask


def patch_from_config(model: PreTrainedModel) -> None:
    """Re-apply the patch a saved config describes (the saved ``modeling_retrofit.py`` calls it in ``__init__``; the
    weights, new ones included, are then loaded by ``from_pretrained``)."""
    patch(model, stock_family(model))


def stock_config(name_or_path: str | Path) -> PretrainedConfig:
    """The config of a stock model's folder or Hub id; ``ValueError`` for a folder a retrofit saved (read as plain
    JSON, so Transformers' remote-code prompt is not reached)."""
    saved, _ = PretrainedConfig.get_config_dict(name_or_path)
    model_type = saved.get("model_type", "")
    if model_type.startswith(retrofit_model_type("")):
        raise ValueError(
            f"retrofit(): {name_or_path} holds a model already retrofitted ({model_type}: "
            f"{layout_name(saved['position_encoding'])}, {saved['attention_normalizer']['type']}); retrofit() patches "
            "a stock model once. Load it with AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True) (or "
            "its head's Auto class) and switch from the stock checkpoint it came from."
        )
    return AutoConfig.from_pretrained(name_or_path)


def stock_model_class(config: PretrainedConfig) -> type:
    """The class a stock config names (``architectures``), else ``AutoModel``."""
    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    return model_class or transformers.AutoModel


def stock_skeleton(name_or_path: str | Path) -> PreTrainedModel:
    """The stock model of a folder or Hub id built without weights (on the meta device), to check a request on."""
    config = stock_config(name_or_path)
    model_class = stock_model_class(config)
    with torch.device("meta"):
        return model_class.from_config(config) if model_class is transformers.AutoModel else model_class(config)


@contextlib.contextmanager
def stock_classes_built_as_eager(config: PretrainedConfig) -> Iterator[None]:
    """Build the stock classes of a saved retrofit as for eager, then set the backend requested (None: SDPA,
    Transformers' default): their ``__init__`` checks it against the stock attention (gpt-oss refuses SDPA for its
    sinks), which the patch replaces by the library's composition, on every backend."""
    requested = config._attn_implementation
    if requested not in (None, "sdpa", "flex_attention"):
        yield
        return
    config._attn_implementation_internal = "eager"
    try:
        yield
    finally:
        config._attn_implementation_internal = requested or "sdpa"


def load_stock_model(name_or_path: str | Path) -> PreTrainedModel:
    """A model from a folder or Hub id, with the class its config names (``architectures``), else the base model."""
    return stock_model_class(stock_config(name_or_path)).from_pretrained(name_or_path)


# Saving: the stock folder, plus the code that re-applies the patch.

MODELING_TEMPLATE = '''"""{stock_class} retrofitted by hf_posenc.

Position encoding: {position_encoding}; attention normalizer: {attention_normalizer}.

Written by ``hf_posenc.retrofit`` next to the weights and the hf_posenc modules it imports. Each class builds the stock
model, then patches it again from the config; ``AutoModel*.from_pretrained(folder, trust_remote_code=True)`` loads
it, with or without hf_posenc installed.
"""

{imports}

from .retrofit import patch_from_config, stock_classes_built_as_eager


class Retrofit{config_class}({config_class}):
    model_type = "{model_type}"
{model_classes}'''

MODEL_CLASS_TEMPLATE = """

class Retrofit{stock_class}({stock_class}):
    config_class = Retrofit{config_class}
    _supports_sdpa = True  # the attention is hf_posenc's composition, on every backend
    _supports_flex_attn = True

    def __init__(self, config, *args, **kwargs):
        with stock_classes_built_as_eager(config):
            super().__init__(config, *args, **kwargs)
        patch_from_config(self)
"""


def retrofit_model_type(stock_type: str) -> str:
    """The ``model_type`` a retrofitted model of ``stock_type`` is saved under."""
    return f"posenc_retrofit_{stock_type}"


def stock_class_of(cls: type) -> type:
    """The Transformers class under a ``Retrofit<Stock>`` class (itself for a stock class)."""
    return next(c for c in cls.__mro__ if c.__module__.startswith("transformers.models."))


def stock_imports(classes: list[type]) -> str:
    """The import lines of ``modeling_retrofit.py`` for the stock ``classes``: from ``transformers`` where it exports
    them, else from their own module (TrOCR's ``TrOCRDecoder``, the base model its causal LM holds)."""
    by_module: dict[str, set[str]] = {}
    for cls in classes:
        module = "transformers" if getattr(transformers, cls.__name__, None) is cls else cls.__module__
        by_module.setdefault(module, set()).add(cls.__name__)
    return "\n".join(f"from {module} import {', '.join(sorted(names))}" for module, names in sorted(by_module.items()))


def save_retrofitted(model: PreTrainedModel, save_directory, *args, **kwargs) -> None:
    """``save_pretrained`` of a retrofitted model: the stock save, then ``modeling_retrofit.py``, the hf_posenc
    modules it imports and the config's ``model_type`` and ``auto_map`` (see the module docstring)."""
    stock_class_of(type(model)).save_pretrained(model, save_directory, *args, **kwargs)
    if not kwargs.get("is_main_process", True):
        return
    folder = Path(save_directory)
    stock_class = stock_class_of(type(model))
    base_class = stock_class_of(type(decoder_base(model)))
    config_class = stock_class_of(type(model.config))
    stock_type = config_class.model_type
    model_classes = [base_class] + ([stock_class] if stock_class is not base_class else [])
    auto_map = {"AutoConfig": f"modeling_retrofit.Retrofit{config_class.__name__}"}
    auto_map["AutoModel"] = f"modeling_retrofit.Retrofit{base_class.__name__}"
    for auto_name, mapping in AUTO_CLASSES.items():
        names = mapping.get(stock_type, ())
        if stock_class.__name__ in ((names,) if isinstance(names, str) else names):
            auto_map[auto_name] = f"modeling_retrofit.Retrofit{stock_class.__name__}"
    config = model.config
    (folder / MODELING_FILE).write_text(
        MODELING_TEMPLATE.format(
            stock_class=stock_class.__name__,
            position_encoding=config.position_encoding,
            attention_normalizer=config.attention_normalizer,
            imports=stock_imports([config_class, *model_classes]),
            config_class=config_class.__name__,
            model_type=retrofit_model_type(stock_type),
            model_classes="".join(
                MODEL_CLASS_TEMPLATE.format(stock_class=c.__name__, config_class=config_class.__name__)
                for c in model_classes
            ),
        )
    )
    this_file = Path(__file__)
    for needed in [this_file, *get_relative_import_files(this_file)]:
        shutil.copyfile(needed, folder / Path(needed).name)
    config_file = folder / "config.json"
    saved = json.loads(config_file.read_text())
    saved.update(model_type=retrofit_model_type(stock_type), auto_map=auto_map)
    config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
