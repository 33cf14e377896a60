"""PosEnc BERT: BERT with a pluggable position encoding and attention normalizer.

Laid out like ``transformers.models.bert.modeling_bert`` and with the same parameter names, except that the position
table lives in the scheme (``bert.position_encoding``). With ``learned`` + ``softmax`` it is the stock BERT, every
head of it: the encoder heads, pre-training (MLM + next sentence), and with ``is_decoder=True`` a causal BERT with a
KV cache (``PosEncBertLMHeadModel``, as ``BertLMHeadModel``). The feed-forward blocks, pooler and heads are
Transformers' own BERT modules (the up projection a subclass, for canon layer D where ``config.canon_layers`` asks).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import CrossEntropyLoss
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPoolingAndCrossAttentions,
    CausalLMOutputWithPast,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    NextSentencePredictorOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import PreTrainedModel
from transformers.models.bert.modeling_bert import (
    BertForPreTrainingOutput,
    BertIntermediate,
    BertLMPredictionHead,
    BertOnlyMLMHead,
    BertOnlyNSPHead,
    BertOutput,
    BertPooler,
    BertPreTrainingHeads,
    BertSelfOutput,
)
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .canon_layers import build_canon_layer
from .configuration_posenc import PosEncBertConfig
from .modeling_posenc_common import (
    PACKED_HALVES_STYLE,
    LayerAttentionInputs,
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


class PosEncBertEmbeddings(nn.Module):
    """Word + token-type embeddings, combined with positions by the scheme, then LayerNorm and dropout."""

    def __init__(self, config: PosEncBertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        position_encoding: PositionEncoding,
        position_ids: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_cache: PositionCache | None = None,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids)
        embeddings = position_encoding.embed(
            EmbeddingInputs(embeddings, position_ids, input_ids, attention_mask, position_cache)
        )
        return self.dropout(self.LayerNorm(embeddings))


class PosEncBertSelfAttention(nn.Module):
    """BERT's q/k/v projections around :func:`positional_attention`."""

    def __init__(self, config: PosEncBertConfig, layer_idx: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.q_norm, self.k_norm = build_query_key_norms(config, self.head_dim, config.layer_norm_eps)
        self.normalizer = build_attention_normalizer(config, config.is_decoder, layer_idx)
        self.position_term = build_layer_position_term(config, config.is_decoder, layer_idx)
        self.canon_b = build_canon_layer(config, "B", 3 * config.hidden_size, layer_idx)
        self.is_causal = config.is_decoder
        self.layer_idx = layer_idx

    def heads_query_key(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k of ``(..., hidden)`` vectors as ``(..., heads, head_dim)``, through the QK-norm if there is one."""
        shape = (*states.shape[:-1], -1, self.head_dim)
        query, key = self.query(states).view(shape), self.key(states).view(shape)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        return query, key

    def project_query_key(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's q and k projections of ``(rows, hidden)`` vectors (through the QK-norm if there is one), as
        ``(heads, rows, head_dim)``."""
        query, key = self.heads_query_key(states)
        return query.transpose(-3, -2), key.transpose(-3, -2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_inputs: AttentionInputs,
        position_encoding: PositionEncoding,
        cache: Cache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        query, key = self.heads_query_key(hidden_states)  # (batch, seq, heads, head_dim)
        value = self.value(hidden_states).view(query.shape)
        if self.canon_b is not None:  # canon layer B on q|k|v together
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
            dropout=self.dropout.p,
            training=self.training,
            causal=self.is_causal,
            cache=cache,
            layer_idx=self.layer_idx,
            project_query_key=self.project_query_key,
            hidden_states=hidden_states,
        )
        return output.reshape(*hidden_states.shape[:-1], -1), weights


class PosEncBertAttention(nn.Module):
    """BERT's self-attention block; with ``config.canon_layers`` canon layer A on the attention's input (the
    residual keeps the layer's input, as in the paper's pre-LN layer)."""

    def __init__(self, config: PosEncBertConfig, layer_idx: int):
        super().__init__()
        self.canon_a = build_canon_layer(config, "A", config.hidden_size, layer_idx)
        self.self = PosEncBertSelfAttention(config, layer_idx)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states, attention_inputs, position_encoding, cache=None):
        attention_input = hidden_states
        if self.canon_a is not None:
            attention_input = self.canon_a(hidden_states, attention_inputs, cache)
        attention_output, weights = self.self(attention_input, attention_inputs, position_encoding, cache)
        return self.output(attention_output, hidden_states), weights


class PosEncBertIntermediate(BertIntermediate):
    """Transformers' ``BertIntermediate``, with canon layer D between its up projection and the activation."""

    def __init__(self, config: PosEncBertConfig, layer_idx: int):
        super().__init__(config)
        self.canon_d = build_canon_layer(config, "D", config.intermediate_size, layer_idx)

    def forward(
        self, hidden_states: torch.Tensor, attention_inputs: AttentionInputs | None = None, cache: Cache | None = None
    ) -> torch.Tensor:
        """``attention_inputs`` and ``cache``: what canon layer D reads (unused without it)."""
        hidden_states = self.dense(hidden_states)
        if self.canon_d is not None:
            hidden_states = self.canon_d(hidden_states, attention_inputs, cache)
        return self.intermediate_act_fn(hidden_states)


class PosEncBertLayer(PositionalLayer):
    """BERT's post-LN layer; with ``config.canon_layers`` canon layer C on the MLP's input (the attention block's
    output, which the MLP's residual keeps)."""

    def __init__(self, config: PosEncBertConfig, layer_idx: int):
        super().__init__()
        self.attention = PosEncBertAttention(config, layer_idx)
        self.canon_c = build_canon_layer(config, "C", config.hidden_size, layer_idx)
        self.intermediate = PosEncBertIntermediate(config, layer_idx)
        self.output = BertOutput(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        *attention_leaves,
        attention_spec,
        position_encoding: PositionEncoding,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        attention_inputs = self.attention_inputs(attention_leaves, attention_spec)
        attention_output, _ = self.attention(hidden_states, attention_inputs, position_encoding, cache)
        mlp_input = attention_output
        if self.canon_c is not None:
            mlp_input = self.canon_c(attention_output, attention_inputs, cache)
        return self.output(self.intermediate(mlp_input, attention_inputs, cache), attention_output)


class PosEncBertEncoder(nn.Module):
    def __init__(self, config: PosEncBertConfig):
        super().__init__()
        self.layer = nn.ModuleList([PosEncBertLayer(config, i) for i in range(config.num_hidden_layers)])

    def forward(
        self, hidden_states, attention_inputs: LayerAttentionInputs, position_encoding, cache=None
    ) -> BaseModelOutput:
        for layer, layer_inputs in zip(self.layer, attention_inputs, strict=True):
            hidden_states = layer(hidden_states, layer_inputs, position_encoding=position_encoding, cache=cache)
        return BaseModelOutput(last_hidden_state=hidden_states)


class PosEncBertPreTrainedModel(PosEncPreTrainedMixin, PreTrainedModel):
    config_class = PosEncBertConfig
    config: PosEncBertConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _no_split_modules = ["PosEncBertEmbeddings", "PosEncBertLayer"]
    _skip_keys_device_placement = [CACHE_NAME]
    peft_stock_types = ("bert",)  # LoRA targets as in stock BERT: query, value
    _can_record_outputs = {"hidden_states": PosEncBertLayer, "attentions": PosEncBertSelfAttention}

    def init_parallel_plans(self) -> None:
        """Transformers' plans; with a normalizer that pairs head ``h`` with head ``h + heads / 2`` (differential),
        q, k and v packed (``PACKED_HALVES_STYLE``: the heads as two packed halves, each rank a share of each half, so
        a pair stays on one rank, and its pairs' outputs fill a contiguous share of the output projection's input).
        Per-head parameters stay whole on every rank, each rank reading its heads
        (:func:`~hf_posenc.modeling_posenc_common.shard_heads`)."""
        super().init_parallel_plans()
        if self.base_model is self and pairs_head_halves(self.config):
            for projection in ("query", "key", "value"):
                self._tp_plan[f"encoder.layer.*.attention.self.{projection}"] = PACKED_HALVES_STYLE

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, BertLMPredictionHead):
            init.zeros_(module.bias)
        elif isinstance(module, PosEncBertAttention):
            # Normalizers whose rows do not sum to 1 ask for a smaller W_V/W_O init (kexue.fm/archives/9105).
            std = self.config.initializer_range * module.self.normalizer.value_init_scale()
            init.normal_(module.self.value.weight, mean=0.0, std=std)
            init.normal_(module.output.dense.weight, mean=0.0, std=std)


class PosEncBertModel(PosEncBertPreTrainedModel):
    """The bare PosEnc BERT encoder, or with ``is_decoder=True`` a causal BERT that keeps a KV cache (``use_cache``),
    as ``BertModel``."""

    _auto_class = "AutoModel"

    def __init__(self, config: PosEncBertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        if config.add_cross_attention:
            raise ValueError("PosEncBertModel has no cross-attention: add_cross_attention must be False.")
        self.embeddings = PosEncBertEmbeddings(config)
        self.position_encoding = build_position_encoding(config, causal=config.is_decoder)
        self.encoder = PosEncBertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value
        self.position_encoding.resize_token_tables(value.num_embeddings)

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPoolingAndCrossAttentions:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Specify exactly one of input_ids or inputs_embeds.")
        check_input_ids(input_ids)
        reject_unsupported_inputs(self, kwargs, ("encoder_hidden_states", "encoder_attention_mask"))
        cache = given_cache(cache, past_key_values)
        if cache is not None and not self.config.is_decoder:
            raise ValueError(
                f"{type(self).__name__} is an encoder and keeps no KV cache; got {CACHE_NAME} (a causal BERT with "
                "a cache: PosEncBertConfig(is_decoder=True))."
            )
        use_cache = bool(use_cache) and self.config.is_decoder
        if input_ids is not None:
            self.warn_if_padding_and_no_attention_mask(input_ids, attention_mask)
            inputs_embeds = self.embeddings.word_embeddings(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past_length = cache.get_seq_length() if cache is not None else 0
        default_positions = position_ids is None
        position_ids = resolve_position_ids(position_ids, inputs_embeds, past_length)
        position_cache = None
        if cache is not None:
            position_cache = PositionCache(cache, self.config.num_hidden_layers)
        embedding_output = self.embeddings(
            self.position_encoding,
            position_ids,
            input_ids=input_ids,
            token_type_ids=token_type_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_cache=position_cache,
        )
        attention_inputs = prepare_attention(
            self,
            self.position_encoding,
            embedding_output,
            attention_mask,
            position_ids,
            causal=self.config.is_decoder,
            attention_dropout=self.config.attention_probs_dropout_prob,
            cache=cache,
            position_cache=position_cache,
            output_attentions=kwargs.get("output_attentions", self.config.output_attentions),
            default_positions=default_positions,
            past_length=past_length,
        )
        # As in stock GPT-2: the layers see no cache under activation checkpointing, whose replay would append twice.
        layer_cache = None if self.gradient_checkpointing and self.training else cache
        sequence_output = self.encoder(
            embedding_output, attention_inputs, self.position_encoding, layer_cache
        ).last_hidden_state
        pooled_output = self.pooler(sequence_output) if self.pooler is not None else None
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=sequence_output,
            pooler_output=pooled_output,
            **{CACHE_NAME: cache if use_cache else None},
        )


class PosEncBertForMaskedLM(PosEncBertPreTrainedModel):
    _auto_class = "AutoModelForMaskedLM"
    _tied_weights_keys = {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }

    def __init__(self, config: PosEncBertConfig):
        super().__init__(config)
        self.bert = PosEncBertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.cls.predictions.decoder

    def set_output_embeddings(self, new_embeddings):
        self.cls.predictions.decoder = new_embeddings
        self.cls.predictions.bias = new_embeddings.bias

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        logits = self.cls(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(logits.view(-1, self.config.vocab_size), labels.view(-1))
        return MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class PosEncBertForSequenceClassification(PosEncBertPreTrainedModel):
    _auto_class = "AutoModelForSequenceClassification"

    def __init__(self, config: PosEncBertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = PosEncBertModel(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.pooler_output))
        loss = sequence_classification_loss(self.config, logits, labels) if labels is not None else None
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class PosEncBertForTokenClassification(PosEncBertPreTrainedModel):
    _auto_class = "AutoModelForTokenClassification"

    def __init__(self, config: PosEncBertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = PosEncBertModel(config, add_pooling_layer=False)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> TokenClassifierOutput:
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.last_hidden_state))
        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(logits.view(-1, self.num_labels), labels.view(-1))
        return TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class PosEncBertForQuestionAnswering(PosEncBertPreTrainedModel):
    _auto_class = "AutoModelForQuestionAnswering"

    def __init__(self, config: PosEncBertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = PosEncBertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
        **kwargs,
    ) -> QuestionAnsweringModelOutput:
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).split(1, dim=-1)
        start_logits, end_logits = start_logits.squeeze(-1).contiguous(), end_logits.squeeze(-1).contiguous()
        loss = None
        if start_positions is not None and end_positions is not None:
            ignored_index = start_logits.size(1)
            loss_fct = CrossEntropyLoss(ignore_index=ignored_index)
            start_loss = loss_fct(start_logits, start_positions.clamp(0, ignored_index))
            end_loss = loss_fct(end_logits, end_positions.clamp(0, ignored_index))
            loss = (start_loss + end_loss) / 2
        return QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class PosEncBertForPreTraining(PosEncBertPreTrainedModel):
    """BERT's pre-training heads: masked LM on every token and next-sentence prediction on the pooled ``[CLS]``;
    the loss, when both ``labels`` and ``next_sentence_label`` are given, is the sum of the two, as
    ``BertForPreTraining``."""

    _auto_class = "AutoModelForPreTraining"
    _tied_weights_keys = {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }

    def __init__(self, config: PosEncBertConfig):
        super().__init__(config)
        self.bert = PosEncBertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.cls.predictions.decoder

    def set_output_embeddings(self, new_embeddings):
        self.cls.predictions.decoder = new_embeddings
        self.cls.predictions.bias = new_embeddings.bias

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        next_sentence_label: torch.Tensor | None = None,
        **kwargs,
    ) -> BertForPreTrainingOutput:
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        prediction_logits, seq_relationship_logits = self.cls(outputs.last_hidden_state, outputs.pooler_output)
        loss = None
        if labels is not None and next_sentence_label is not None:
            loss_fct = CrossEntropyLoss()
            masked_lm_loss = loss_fct(prediction_logits.view(-1, self.config.vocab_size), labels.view(-1))
            next_sentence_loss = loss_fct(seq_relationship_logits.view(-1, 2), next_sentence_label.view(-1))
            loss = masked_lm_loss + next_sentence_loss
        return BertForPreTrainingOutput(
            loss=loss,
            prediction_logits=prediction_logits,
            seq_relationship_logits=seq_relationship_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class PosEncBertLMHeadModel(PosEncBertPreTrainedModel, GenerationMixin):
    """A causal BERT with the MLM prediction head as its LM head, as ``BertLMHeadModel``: next-token loss (labels
    shifted inside), ``generate`` with the KV cache. Needs ``PosEncBertConfig(is_decoder=True)``, so that attention
    and a relative scheme take their causal form."""

    _auto_class = "AutoModelForCausalLM"
    _tied_weights_keys = {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }

    def __init__(self, config: PosEncBertConfig):
        if not config.is_decoder:
            raise ValueError(
                "PosEncBertLMHeadModel is a causal LM and needs PosEncBertConfig(is_decoder=True); got "
                "is_decoder=False (a bidirectional encoder would see the tokens it predicts)."
            )
        super().__init__(config)
        self.bert = PosEncBertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.cls.predictions.decoder

    def set_output_embeddings(self, new_embeddings):
        self.cls.predictions.decoder = new_embeddings
        self.cls.predictions.bias = new_embeddings.bias

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        if labels is not None:
            use_cache = False
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            cache=given_cache(cache, past_key_values),
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.cls(outputs.last_hidden_state[:, keep, :])
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


class PosEncBertForNextSentencePrediction(PosEncBertPreTrainedModel):
    """Next-sentence prediction on the pooled ``[CLS]`` (label 0: B continues A, 1: B is random)."""

    _auto_class = "AutoModelForNextSentencePrediction"

    def __init__(self, config: PosEncBertConfig):
        super().__init__(config)
        self.bert = PosEncBertModel(config)
        self.cls = BertOnlyNSPHead(config)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> NextSentencePredictorOutput:
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        logits = self.cls(outputs.pooler_output)
        loss = CrossEntropyLoss()(logits.view(-1, 2), labels.view(-1)) if labels is not None else None
        return NextSentencePredictorOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class PosEncBertForMultipleChoice(PosEncBertPreTrainedModel):
    """Scores each of ``num_choices`` sequences from its pooled ``[CLS]``; inputs are ``(batch, num_choices, seq)``
    (``inputs_embeds``: ``(batch, num_choices, seq, hidden)``), logits ``(batch, num_choices)``."""

    _auto_class = "AutoModelForMultipleChoice"

    def __init__(self, config: PosEncBertConfig):
        super().__init__(config)
        self.bert = PosEncBertModel(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> MultipleChoiceModelOutput:
        choices = input_ids if input_ids is not None else inputs_embeds
        if choices is None or choices.dim() != (3 if input_ids is not None else 4):
            shape = None if choices is None else tuple(choices.shape)
            raise ValueError(
                "PosEncBertForMultipleChoice takes input_ids (batch, num_choices, seq) or inputs_embeds (batch, "
                f"num_choices, seq, hidden); got shape {shape}."
            )
        num_choices = choices.shape[1]

        def flatten_choices(tensor: torch.Tensor | None, trailing: int = 1) -> torch.Tensor | None:
            return None if tensor is None else tensor.reshape(-1, *tensor.shape[-trailing:])

        outputs = self.bert(
            flatten_choices(input_ids),
            attention_mask=flatten_choices(attention_mask),
            token_type_ids=flatten_choices(token_type_ids),
            position_ids=flatten_choices(position_ids),
            inputs_embeds=flatten_choices(inputs_embeds, trailing=2),
            return_dict=True,
            **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.pooler_output)).view(-1, num_choices)
        loss = CrossEntropyLoss()(logits, labels) if labels is not None else None
        return MultipleChoiceModelOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


POSENC_BERT_MODELS = (
    PosEncBertModel,
    PosEncBertForMaskedLM,
    PosEncBertForSequenceClassification,
    PosEncBertForTokenClassification,
    PosEncBertForQuestionAnswering,
    PosEncBertForPreTraining,
    PosEncBertLMHeadModel,
    PosEncBertForNextSentencePrediction,
    PosEncBertForMultipleChoice,
)
PosEncBertPreTrainedModel.family_auto_map = auto_map_for(PosEncBertConfig, POSENC_BERT_MODELS)

__all__ = [
    "PosEncBertModel",
    "PosEncBertForMaskedLM",
    "PosEncBertForSequenceClassification",
    "PosEncBertForTokenClassification",
    "PosEncBertForQuestionAnswering",
    "PosEncBertForPreTraining",
    "PosEncBertLMHeadModel",
    "PosEncBertForNextSentencePrediction",
    "PosEncBertForMultipleChoice",
    "PosEncBertPreTrainedModel",
]
