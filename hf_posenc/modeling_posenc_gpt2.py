"""PosEnc GPT-2: GPT-2 with a pluggable position encoding and attention normalizer.

Laid out like ``transformers.models.gpt2.modeling_gpt2`` and with the same parameter names, except that the position
table lives in the scheme (``transformer.position_encoding``). With ``learned`` + ``softmax`` it is the stock GPT-2.
The MLP is Transformers' own ``GPT2MLP`` (with canon layer D inside it where ``config.canon_layers`` asks).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.modeling_utils import PreTrainedModel
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.pytorch_utils import Conv1D
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .canon_layers import build_canon_layer
from .configuration_posenc import PosEncGPT2Config
from .linear_attention import build_linear_attention
from .modeling_posenc_common import (
    CONV1D_PACKED_QKV_HALVES_STYLE,
    PosEncPreTrainedMixin,
    PositionalLayer,
    auto_map_for,
    build_attention_normalizer,
    build_layer_position_term,
    build_position_encoding,
    build_query_key_norms,
    check_input_ids,
    pairs_head_halves,
    prepare_attention,
    reject_unsupported_inputs,
    resolve_position_ids,
    sequence_classification_loss,
)
from .posenc_attention import positional_attention
from .position_interface import (
    CACHE_NAME,
    AttentionInputs,
    EmbeddingInputs,
    PositionCache,
    PositionEncoding,
    given_cache,
)


class PosEncGPT2Attention(nn.Module):
    """GPT-2's fused q/k/v projection (``c_attn``) and output projection (``c_proj``) around
    :func:`positional_attention`. Scores are computed in float32 on the eager path, as ``reorder_and_upcast_attn``
    asks."""

    def __init__(self, config: PosEncGPT2Config, layer_idx: int):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scaling /= float(layer_idx + 1)
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        self.q_norm, self.k_norm = build_query_key_norms(config, self.head_dim, config.layer_norm_epsilon)
        self.normalizer = build_attention_normalizer(config, True, layer_idx)
        self.position_term = build_layer_position_term(config, True, layer_idx)
        self.canon_b = build_canon_layer(config, "B", 3 * self.embed_dim, layer_idx)
        self.layer_idx = layer_idx

    def project(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(..., hidden)`` -> q, k, v as ``(..., heads, head_dim)``, q and k through the QK-norm if there is one."""
        shape = (*states.shape[:-1], -1, self.head_dim)
        # q|k|v in three equal parts: each a share of the heads under tensor parallelism
        query, key, value = (t.view(shape) for t in self.c_attn(states).chunk(3, dim=-1))
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        return query, key, value

    def project_query_key(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's q and k projections of ``(rows, hidden)`` vectors, as ``(heads, rows, head_dim)``."""
        query, key, _ = self.project(states)
        return query.transpose(-3, -2), key.transpose(-3, -2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_inputs: AttentionInputs,
        position_encoding: PositionEncoding,
        cache: Cache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        query, key, value = self.project(hidden_states)
        if self.canon_b is not None:  # canon layer B on q|k|v, as c_attn lays them out
            qkv = self.canon_b(torch.cat([t.flatten(-2) for t in (query, key, value)], -1), attention_inputs, cache)
            query, key, value = (t.view(query.shape) for t in qkv.chunk(3, dim=-1))
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        output, weights = positional_attention(
            query,
            key,
            value,
            attention_inputs,
            position_encoding,
            self.normalizer,
            self.position_term,
            scaling=self.scaling,
            dropout=self.attn_dropout.p,
            training=self.training,
            causal=True,
            cache=cache,
            layer_idx=self.layer_idx,
            project_query_key=self.project_query_key,
            hidden_states=hidden_states,
        )
        output = self.c_proj(output.reshape(*hidden_states.shape[:-1], -1))
        return self.resid_dropout(output), weights


class PosEncGPT2MLP(GPT2MLP):
    """Transformers' ``GPT2MLP``, with canon layer D between its up projection (``c_fc``) and the activation."""

    def __init__(self, intermediate_size: int, config: PosEncGPT2Config, layer_idx: int):
        super().__init__(intermediate_size, config)
        self.canon_d = build_canon_layer(config, "D", intermediate_size, layer_idx)

    def forward(
        self, hidden_states: torch.Tensor, attention_inputs: AttentionInputs | None = None, cache: Cache | None = None
    ) -> torch.Tensor:
        """``attention_inputs`` and ``cache``: what canon layer D reads (unused without it)."""
        hidden_states = self.c_fc(hidden_states)
        if self.canon_d is not None:
            hidden_states = self.canon_d(hidden_states, attention_inputs, cache)
        return self.dropout(self.c_proj(self.act(hidden_states)))


class PosEncGPT2Block(PositionalLayer):
    """GPT-2's pre-LN block; with ``config.canon_layers`` canon layer A on the attention's input (after ``ln_1``)
    and C on the MLP's (after ``ln_2``)."""

    def __init__(self, config: PosEncGPT2Config, layer_idx: int):
        super().__init__()
        inner_dim = config.n_inner if config.n_inner is not None else 4 * config.hidden_size
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.canon_a = build_canon_layer(config, "A", config.hidden_size, layer_idx)
        # a "linear_attention" layer (config.layer_types) mixes tokens with its linear_attn in place of attention
        self.linear_attn = build_linear_attention(config, layer_idx)
        if self.linear_attn is None:
            self.attn = PosEncGPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.canon_c = build_canon_layer(config, "C", config.hidden_size, layer_idx)
        self.mlp = PosEncGPT2MLP(inner_dim, config, layer_idx)

    def forward(
        self,
        hidden_states: torch.Tensor,
        *attention_leaves,
        attention_spec,
        position_encoding: PositionEncoding,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        attention_inputs = self.attention_inputs(attention_leaves, attention_spec)
        attention_input = self.ln_1(hidden_states)
        if self.canon_a is not None:
            attention_input = self.canon_a(attention_input, attention_inputs, cache)
        if self.linear_attn is not None:
            attn_output = self.linear_attn(attention_input, attention_inputs["linear_keep"], cache)
        else:
            attn_output, _ = self.attn(attention_input, attention_inputs, position_encoding, cache)
        hidden_states = hidden_states + attn_output
        mlp_input = self.ln_2(hidden_states)
        if self.canon_c is not None:
            mlp_input = self.canon_c(mlp_input, attention_inputs, cache)
        return hidden_states + self.mlp(mlp_input, attention_inputs, cache)


class PosEncGPT2PreTrainedModel(PosEncPreTrainedMixin, PreTrainedModel):
    config_class = PosEncGPT2Config
    config: PosEncGPT2Config
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _no_split_modules = ["PosEncGPT2Block"]
    _skip_keys_device_placement = [CACHE_NAME]
    peft_stock_types = ("gpt2",)  # LoRA targets as in stock GPT-2: c_attn
    _can_record_outputs = {
        "hidden_states": PosEncGPT2Block,
        "attentions": OutputRecorder(PosEncGPT2Attention, index=1),
    }

    def init_parallel_plans(self) -> None:
        """Transformers' plans; with a normalizer that pairs head ``h`` with head ``h + heads / 2`` (differential),
        ``c_attn`` split as q, k and v each in two packed halves (``CONV1D_PACKED_QKV_HALVES_STYLE``: each rank a
        share of each half, so a pair stays on one rank, and its pairs' outputs fill a contiguous share of
        ``c_proj``'s input)."""
        super().init_parallel_plans()
        if self.base_model is self and pairs_head_halves(self.config):
            self._tp_plan["h.*.attn.c_attn"] = CONV1D_PACKED_QKV_HALVES_STYLE

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, Conv1D):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            init.zeros_(module.bias)
        if isinstance(module, GPT2MLP):
            # GPT-2's scaled init of the residual projections: std / sqrt(2 * n_layer).
            std = self.config.initializer_range / math.sqrt(2 * self.config.n_layer)
            init.normal_(module.c_proj.weight, mean=0.0, std=std)
        elif isinstance(module, PosEncGPT2Attention):
            # Normalizers whose rows do not sum to 1 also ask for a smaller W_V/W_O init (kexue.fm/archives/9105).
            scale = module.normalizer.value_init_scale()
            std = self.config.initializer_range / math.sqrt(2 * self.config.n_layer)
            init.normal_(module.c_proj.weight, mean=0.0, std=std * scale)
            if scale != 1.0 and not getattr(module.c_attn.weight, "_is_hf_initialized", False):
                module.c_attn.weight[:, 2 * module.embed_dim :].normal_(std=self.config.initializer_range * scale)


class PosEncGPT2Model(PosEncGPT2PreTrainedModel):
    """The bare PosEnc GPT-2 decoder."""

    _auto_class = "AutoModel"

    def __init__(self, config: PosEncGPT2Config):
        super().__init__(config)
        if config.add_cross_attention:
            raise ValueError("PosEncGPT2Model has no cross-attention: add_cross_attention must be False.")
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_encoding = build_position_encoding(config, causal=True)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([PosEncGPT2Block(config, i) for i in range(config.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, new_embeddings):
        self.wte = new_embeddings
        self.position_encoding.resize_token_tables(new_embeddings.num_embeddings)

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Specify exactly one of input_ids or inputs_embeds.")
        check_input_ids(input_ids)
        reject_unsupported_inputs(self, kwargs, ("encoder_hidden_states", "encoder_attention_mask"))
        if input_ids is not None:
            self.warn_if_padding_and_no_attention_mask(input_ids, attention_mask)
            inputs_embeds = self.wte(input_ids)
        cache = given_cache(cache, past_key_values)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past_length = cache.get_seq_length() if cache is not None else 0
        default_positions = position_ids is None
        position_ids = resolve_position_ids(position_ids, inputs_embeds, past_length)
        position_cache = None
        if cache is not None:
            position_cache = PositionCache(cache, self.config.num_hidden_layers)

        hidden_states = self.position_encoding.embed(
            EmbeddingInputs(inputs_embeds, position_ids, input_ids, attention_mask, position_cache)
        )
        if token_type_ids is not None:
            hidden_states = hidden_states + self.wte(token_type_ids)
        hidden_states = self.drop(hidden_states)

        attention_inputs = prepare_attention(
            self,
            self.position_encoding,
            inputs_embeds,
            attention_mask,
            position_ids,
            causal=True,
            attention_dropout=self.config.attn_pdrop,
            cache=cache,
            position_cache=position_cache,
            output_attentions=kwargs.get("output_attentions", self.config.output_attentions),
            default_positions=default_positions,
            past_length=past_length,
        )
        # As in stock GPT-2: the layers see no cache under activation checkpointing, whose replay would append twice.
        layer_cache = None if self.gradient_checkpointing and self.training else cache
        for block, layer_inputs in zip(self.h, attention_inputs, strict=True):
            hidden_states = block(
                hidden_states, layer_inputs, position_encoding=self.position_encoding, cache=layer_cache
            )
        return BaseModelOutputWithPast(
            last_hidden_state=self.ln_f(hidden_states), **{CACHE_NAME: cache if use_cache else None}
        )


class PosEncGPT2LMHeadModel(PosEncGPT2PreTrainedModel, GenerationMixin):
    _auto_class = "AutoModelForCausalLM"
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: PosEncGPT2Config):
        super().__init__(config)
        self.transformer = PosEncGPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.loss_type = "ForCausalLM"  # the class name does not say it: Transformers would warn, and dynamo break
        # linear-attention layers keep a recurrent state that cannot be rolled back: generate refuses assisted
        # decoding, as for Transformers' own hybrids (Qwen3-Next)
        self._is_stateful = config.linear_attention is not None
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.transformer(
            input_ids,
            cache=given_cache(cache, past_key_values),
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class PosEncGPT2ForSequenceClassification(PosEncGPT2PreTrainedModel):
    """Classifies from the last non-padding token (right or left padding), like ``GPT2ForSequenceClassification``."""

    _auto_class = "AutoModelForSequenceClassification"

    def __init__(self, config: PosEncGPT2Config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = PosEncGPT2Model(config)
        self.score = nn.Linear(config.n_embd, self.num_labels, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> SequenceClassifierOutputWithPast:
        outputs = self.transformer(
            input_ids,
            cache=given_cache(cache, past_key_values),
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )
        logits = self.score(outputs.last_hidden_state)
        batch_size, seq_length = logits.shape[:2]
        if attention_mask is not None:
            last_token = (torch.arange(seq_length, device=logits.device) * attention_mask.to(logits.device)).argmax(-1)
        elif input_ids is not None and self.config.pad_token_id is not None:
            not_pad = (input_ids != self.config.pad_token_id).to(logits.device)
            last_token = (torch.arange(seq_length, device=logits.device) * not_pad).argmax(-1)
        elif batch_size == 1:
            last_token = torch.tensor([seq_length - 1], device=logits.device)
        else:
            raise ValueError(
                "Batches of more than one sequence need an attention_mask or config.pad_token_id to find each "
                "sequence's last token."
            )
        pooled_logits = logits[torch.arange(batch_size, device=logits.device), last_token]
        loss = sequence_classification_loss(self.config, pooled_logits, labels) if labels is not None else None
        return SequenceClassifierOutputWithPast(
            loss=loss,
            logits=pooled_logits,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


POSENC_GPT2_MODELS = (PosEncGPT2Model, PosEncGPT2LMHeadModel, PosEncGPT2ForSequenceClassification)
PosEncGPT2PreTrainedModel.family_auto_map = auto_map_for(PosEncGPT2Config, POSENC_GPT2_MODELS)

__all__ = [
    "PosEncGPT2Model",
    "PosEncGPT2LMHeadModel",
    "PosEncGPT2ForSequenceClassification",
    "PosEncGPT2PreTrainedModel",
]
