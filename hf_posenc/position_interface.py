"""The plug-in interface every position encoding implements, written once for both model families.

A scheme is a :class:`PositionEncoding` held by the base model. Each forward the model calls, in order:

* ``embed(inputs)``: the input side (add, multiply, convolve ...), given an :class:`EmbeddingInputs` (embeddings,
  position ids, token ids, the attention mask and the :class:`PositionCache`);
* ``prepare(query_positions, key_positions, backend)``: once per forward, the tensors every layer shares (rotary
  cos/sin, a bias table), as a dict; a position-only score term returned as ``"score_bias"`` is folded into the mask
  once (eager, SDPA), and rebuilt per layer as a FlexAttention ``score_mod`` from the same dict by ``score_mod``;
* in every attention layer: ``transform_qkv`` (before the KV cache), then the layer's own
  :class:`LayerPositionTerm` (from ``layer_term``), which may transform q and every key after the KV cache, add a
  content-dependent term to the scores and a term computed from the attention weights to the output.

Everything a layer reads per forward travels in one dict of tensors (:data:`AttentionInputs`), which the layers
receive flattened into positional tensor arguments, so reentrant activation checkpointing, ``torch.compile`` and
accelerate's device hooks see every tensor. Positions of cached keys are kept with the KV cache
(:class:`PositionCache`), never inferred.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticCache,
    StaticLayer,
    StaticSlidingWindowLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast

from .options import CatalogueEntry
from .relative_tables import toeplitz


BACKENDS = ("eager", "sdpa", "flex_attention")

AttentionInputs = dict[str, Any]
"""What every attention layer reads per forward, built once by the model:

* ``"backend"``: the backend that runs this forward (``"eager"``, ``"sdpa"`` or ``"flex_attention"``);
* ``"mask"``: a ``BlockMask`` (flex), or for eager/SDPA an additive float ``(batch|1, heads|1, q_len, kv_len)`` tensor
  (position bias plus ``finfo.min`` on masked keys) or SDPA's boolean mask, or None when nothing is masked;
* ``"visible"``: boolean ``(batch|1, 1, q_len, kv_len)``, True where a query may attend a key (eager/SDPA), or None;
* ``"row_has_key"``: boolean ``(batch|1, 1, q_len, 1)``, False on query rows that see no key (their output is set to
  0), or None when nothing is masked;
* ``"query_positions"``: ``(batch|1, q_len)``; ``"key_positions"``: ``(batch|1, kv_len)``, cached keys included;
* ``"position"``: the dict of tensors the scheme's ``prepare`` returned;
* ``"logit_softcapping"``: the config's ``attn_logit_softcapping`` (a float; None: off), read by the attention with
  the backend chosen for it;
* ``"layer"`` (inside an attention layer only, for its :class:`LayerPositionTerm`): the dict of tensors that term's
  ``layer_tables`` computed from the layer's input;
* ``"canon"`` (only with ``config.canon_layers``): what the canon layers read, ``canon_layers.canon_forward_inputs``.
"""


@dataclasses.dataclass(frozen=True)
class ForwardFacts:
    """What the backend choice reads about one forward, built once per forward and kind of layer.

    ``device``, ``dtype``: the inputs'; ``head_dim``: the scheme's (None: not known to the caller); ``query_length``
    and ``key_length`` (None: the query's) and ``num_heads`` size the dense bias SDPA would take; ``given_mask``:
    ``"none"``, ``"2-D tensor"``, ``"4-D tensor"`` or ``"BlockMask"`` (``attention_backends.mask_kind``);
    ``need_weights``: ``output_attentions``; ``attention_dropout``: training with a dropout rate > 0;
    ``consecutive``: the model's default positions with no cached key; ``grad_enabled``: gradients are on;
    ``position_bias_needs_grad``: the scheme's position-only ``score_mod`` reads parameters that take gradients
    (``attention_backends.position_bias_needs_grad``),
    ``bias_spreads_gradients``: it reads them where its gradients spread
    (:meth:`PositionEncoding.flex_spreads_gradients`); ``logit_softcapping``: the config's
    ``attn_logit_softcapping``."""

    device: torch.device
    dtype: torch.dtype = torch.float32
    head_dim: int | None = None
    query_length: int = 2
    key_length: int | None = None
    num_heads: int = 1
    given_mask: str = "none"
    need_weights: bool = False
    attention_dropout: bool = False
    consecutive: bool = False
    grad_enabled: bool = dataclasses.field(default_factory=torch.is_grad_enabled)
    position_bias_needs_grad: bool = False
    bias_spreads_gradients: bool = True
    logit_softcapping: float | None = None

    def dense_bias_bytes(self) -> int:
        """The bytes of one ``(1, heads, q_len, kv_len)`` float32 bias, what SDPA takes a position-only bias as."""
        key_length = self.query_length if self.key_length is None else self.key_length
        return 4 * self.num_heads * self.query_length * key_length


@dataclass(frozen=True)
class AttentionDims:
    """Sizes a scheme or normalizer needs to build its parameters."""

    hidden_size: int
    num_heads: int
    head_dim: int
    max_positions: int
    causal: bool
    num_layers: int = 1
    vocab_size: int = 0
    embedding_size: int | None = None
    """The width of the token embeddings where they are projected to ``hidden_size`` (ELECTRA's
    ``embedding_size``, RemBERT's ``input_embedding_size``); None where they are ``hidden_size`` wide."""

    @property
    def input_size(self) -> int:
        """The width of the vectors an input-side scheme adds to or multiplies: the token embeddings'."""
        return self.embedding_size or self.hidden_size


class _SumGradientOverRanks(torch.autograd.Function):
    """Identity in the forward; in the backward the gradient summed over the tensor-parallel ranks."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


@dataclass(frozen=True)
class HeadShare:
    """One rank's heads under tensor parallelism: ``heads``, the model's indices of the heads its q, k and v
    projections hold, in their order; ``num_heads``, the model's; ``group``, the tensor-parallel process group."""

    heads: tuple[int, ...]
    num_heads: int
    group: Any


def rank_heads(num_heads: int, rank: int, size: int, halves: bool = False) -> tuple[int, ...]:
    """The heads rank ``rank`` of ``size`` holds: the contiguous share ``colwise`` q/k/v projections give it, or with
    ``halves`` (``packed_colwise``, two halves of the heads packed in one projection) its share of each half."""
    parts = 2 if halves else 1
    if num_heads % (parts * size):
        halves_of = f", in two halves of {num_heads / 2:g}," if halves else ""
        raise ValueError(
            f"Tensor parallelism: {num_heads} attention heads{halves_of} do not split evenly between {size} ranks."
        )
    per_part = num_heads // parts
    share = per_part // size
    return tuple(part * per_part + rank * share + head for part in range(parts) for head in range(share))


class HeadSharded:
    """What every scheme, layer term and normalizer reads per head under tensor parallelism, where each rank computes
    the heads of :class:`HeadShare` (set by :meth:`shard_heads`, then ``dims.num_heads`` counts those heads, as q and
    k do). Its parameters stay whole on every rank; it reads a per-head one through :meth:`heads_read` (this rank's
    heads) and one every head reads through :meth:`read_by_all_heads`: each rank's gradient, which covers its own
    heads, is then summed over the ranks, so every rank holds the gradient of one process. On one process both
    return the tensor itself."""

    head_share: HeadShare | None = None

    def shard_heads(self, share: HeadShare) -> None:
        """Compute the heads of ``share`` from now on."""
        self.head_share = share
        if hasattr(self, "dims"):
            self.dims = dataclasses.replace(self.dims, num_heads=len(share.heads))

    @property
    def model_num_heads(self) -> int:
        """The model's number of heads, whatever this rank computes."""
        return self.dims.num_heads if self.head_share is None else self.head_share.num_heads

    def read_by_all_heads(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, read inside every head (a table the heads share, the layer's input to a per-head projection):
        under tensor parallelism its gradient is summed over the ranks."""
        if self.head_share is None or not (torch.is_grad_enabled() and tensor.requires_grad):
            return tensor
        return _SumGradientOverRanks.apply(tensor, self.head_share.group)

    def heads_read(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """``tensor`` with one entry per head along ``dim``, at this rank's heads (its gradient summed over the
        ranks, zero at the heads a rank does not hold)."""
        if self.head_share is None:
            return tensor
        index = torch.tensor(self.head_share.heads, device=tensor.device)
        return self.read_by_all_heads(tensor).index_select(dim, index)


CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
"""The installed Transformers' name of the KV cache, as a forward's argument, a layer's keyword and an output's field:
``cache`` from 5.24 on, ``past_key_values`` before. The models take and return it under this name, as the stock models
of the same version do, so ``generate``, gradient checkpointing and ``masking_utils`` find it."""


def given_cache(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The KV cache a model was given under either name. Where Transformers calls it ``cache``, ``past_key_values`` is
    its deprecated spelling and warns as the stock models warn; giving both is an error, not a silent choice."""
    if past_key_values is None:
        return cache
    if cache is not None and cache is not past_key_values:
        raise ValueError("Pass the KV cache once: got both `cache` and `past_key_values`.")
    if CACHE_NAME == "cache":
        warnings.warn(
            "`past_key_values` is deprecated since Transformers 5.24; pass the KV cache as `cache`.",
            FutureWarning,
            stacklevel=3,
        )
    return past_key_values


class PositionCache:
    """Per-token state kept with a Transformers KV cache, in extra cache layers after the model's attention layers.

    The first slots hold the position of every key, one slot per kind of cache layer the attention layers have
    (:func:`cache_layer_kind`): slot 0 the full layers', slot 1, 2, ... each distinct window's (sliding-window and
    chunked layers, in the order of their first layer; layers whose cache layers keep the same keys share one), at
    least two slots (:attr:`num_key_slots`: 0 and 1 as before, when the layers have at most one window). A scheme may
    keep more per-token state in the slots it names in ``PositionEncoding.cache_states`` (slot ``num_key_slots +
    index``), and a layer term in its own (``append_layer_state``). Each is stored as a ``(batch, 1, seq, features)``
    key tensor of a cache layer of the same kind as the attention layer it serves (full or with its window, dynamic
    or static), so beam-search reordering, cropping, batch expansion, a static cache's preallocation and a window's
    eviction apply to it exactly as to that layer's keys and values. Supports ``DynamicCache`` and ``StaticCache``.
    """

    def __init__(self, cache: Cache, num_layers: int):
        if not isinstance(cache, (DynamicCache, StaticCache)):
            raise ValueError(
                f"hf_posenc models keep key positions with the cache and support DynamicCache and StaticCache; "
                f"got {type(cache).__name__}."
            )
        self.cache = cache
        self.num_layers = num_layers

    def is_sliding(self, layer_idx: int) -> bool:
        """Whether attention layer ``layer_idx`` has a sliding-window cache layer (sliding or chunked attention, a
        cache built from the config's ``layer_types``; one built without a config keeps every token in every
        layer)."""
        layers = self.cache.layers
        return layer_idx < len(layers) and bool(getattr(layers[layer_idx], "is_sliding", False))

    def key_slots(self) -> list[int]:
        """The key-position slot of each attention layer: 0 for a full cache layer, ``1 + n`` for the ``n``-th
        distinct windowed kind (:func:`cache_layer_kind`), numbered in layer order."""
        layers, windowed, slots = self.cache.layers, [], []
        for layer_idx in range(self.num_layers):
            kind = cache_layer_kind(layers[layer_idx]) if layer_idx < len(layers) else None
            if kind is None:
                slots.append(0)
                continue
            if kind not in windowed:
                windowed.append(kind)
            slots.append(1 + windowed.index(kind))
        return slots

    @property
    def num_key_slots(self) -> int:
        """Slots that hold key positions (at least 2); the scheme's and the layer terms' states follow them."""
        return max(2, 1 + max(self.key_slots(), default=0))

    def widest_layer(self) -> int:
        """The attention layer whose cache layer keeps the most keys: the first full one, else the widest window.
        Linear-attention layers (their cache layers keep states, not keys) and the placeholders of layers without a
        cache (Transformers' ``DummyLayer``: a stock hybrid's MLP-only layers) are passed over, unless every layer is
        one."""
        layers = self.cache.layers
        attention = [i for i in range(self.num_layers) if i >= len(layers) or keeps_keys(layers[i])]
        kinds = {i: cache_layer_kind(layers[i]) if i < len(layers) else None for i in attention or [0]}
        full = [i for i, kind in kinds.items() if kind is None]
        if full:
            return full[0]
        return max(kinds, key=lambda layer_idx: kinds[layer_idx][1])

    def append(self, slot: int, states: torch.Tensor, like: int | None = None) -> torch.Tensor:
        """Store ``states`` ``(batch, seq, features)`` for the current tokens, in a cache layer of the kind of
        attention layer ``like`` (None: :meth:`widest_layer`); return the slot's states of every cached token the
        layer keeps and the current ones, ``(batch, kv_len, features)``, row ``r`` the token ``kept_from + r``
        (:meth:`kept_from`; a static cache returns its preallocated rows, those not yet written are zeros)."""
        index = self.num_layers + slot
        layers = self.cache.layers
        if self.cache.layer_class_to_replicate is None:
            like = self.widest_layer() if like is None else like
            while len(layers) <= index:
                layers.append(placeholder_cache_layer(layers[like]))
            if not layers[index].is_initialized:  # the slot's first use: a layer of its kind, recording as the cache
                layers[index] = fresh_cache_layer(layers[like])
        stored, _ = self.cache.update(states[:, None], states[:, None, :, :0], index)
        return stored[:, 0]

    def kept_from(self, slot: int, query_length: int) -> int:
        """The token (counted from the cache's first) of row 0 of what :meth:`append` returns for a forward of
        ``query_length`` tokens, asked before it: 0 but where a window has evicted the oldest tokens. The slot's
        cache layer says where its rows start (``get_mask_sizes``, as for the attention mask)."""
        index = self.num_layers + slot
        layers = self.cache.layers
        if index >= len(layers) or not layers[index].is_initialized:
            return 0
        return layers[index].get_mask_sizes(query_length)[1]

    def state_slot(self, name: str, scheme: PositionEncoding) -> int:
        """The slot of the scheme's per-token state ``name`` (one of ``scheme.cache_states``)."""
        return self.num_key_slots + scheme.cache_states.index(name)

    def append_key_positions(self, positions: torch.Tensor, batch_size: int, like: int | None = None) -> torch.Tensor:
        """Store the positions ``(batch|1, seq)`` of the current tokens; return every key's ``(batch, kv_len)`` as
        attention layer ``like`` (None: a full-attention layer) keeps them (its slot of :meth:`key_slots`)."""
        slot = 0 if like is None else self.key_slots()[like]
        return self.append(slot, positions.expand(batch_size, -1)[..., None], like)[..., 0]

    def append_state(self, name: str, states: torch.Tensor, scheme: PositionEncoding) -> torch.Tensor:
        """:meth:`append` for the scheme's per-token state ``name`` (one of ``scheme.cache_states``), kept in a cache
        layer of the kind of :meth:`widest_layer`."""
        return self.append(self.state_slot(name, scheme), states)

    def append_layer_state(
        self, name: str, states: torch.Tensor, scheme: PositionEncoding, term: LayerPositionTerm, layer_idx: int
    ) -> torch.Tensor:
        """:meth:`append` for the per-token state ``name`` (one of ``term.cache_states``) of the layer term of
        attention layer ``layer_idx``, kept as that layer keeps its keys: its slots follow the scheme's own, every
        layer's first state, then every layer's second, and so on (``index * num_layers + layer_idx``), so layers
        whose terms keep different numbers of states never share a slot."""
        index = term.cache_states.index(name)
        slot = self.num_key_slots + len(scheme.cache_states) + index * self.num_layers + layer_idx
        return self.append(slot, states, like=layer_idx)


def is_linear_cache_layer(layer: Any) -> bool:
    """Whether a cache layer is Transformers' linear-attention one (``LinearAttentionLayer``: convolution and
    recurrent states, no keys; absent from Transformers before its hybrids)."""
    return type(layer).__name__ == "LinearAttentionLayer" or hasattr(layer, "recurrent_states")


def keeps_keys(layer: Any) -> bool:
    """Whether a cache layer keeps keys: not a linear-attention layer (:func:`is_linear_cache_layer`) unless it is one
    beside an attention layer (Transformers' ``LinearAttentionAndFullAttentionLayer`` of Falcon-H1's layers, a
    ``DynamicLayer`` or ``StaticLayer`` too), nor the ``DummyLayer`` Transformers places for a layer without a
    cache."""
    if type(layer).__name__ == "DummyLayer":
        return False
    return not is_linear_cache_layer(layer) or isinstance(layer, (DynamicLayer, StaticLayer))


def cache_layer_kind(layer: CacheLayerMixin) -> tuple[str, int] | None:
    """Which keys a cache layer keeps: None for every key (a full layer), else its class and window (a sliding or
    chunked layer: Transformers caches both as a sliding window, ``attention_chunk_size`` tokens for a chunk; a static
    sliding layer's ``max_cache_len`` is its window). Layers of one kind keep the same keys."""
    if not getattr(layer, "is_sliding", False):
        return None
    window = layer.max_cache_len if isinstance(layer, StaticLayer) else layer.sliding_window
    return type(layer).__name__, window


def fresh_cache_layer(template: CacheLayerMixin) -> CacheLayerMixin:
    """An empty cache layer of the kind of ``template``: static or dynamic, with its sliding window (a static sliding
    layer's ``max_cache_len`` is its window already), recording its past if ``template`` does (``generate``'s
    assisted decoding turns recording on before the first forward, so that it can crop a window's rollback)."""
    if isinstance(template, StaticSlidingWindowLayer):
        layer = StaticSlidingWindowLayer(template.max_cache_len, template.max_cache_len)
    elif isinstance(template, StaticLayer):
        layer = StaticLayer(template.max_cache_len)
    elif isinstance(template, DynamicSlidingWindowLayer):
        layer = DynamicSlidingWindowLayer(template.sliding_window)
    else:
        layer = DynamicLayer()
    if getattr(template, "record_past", False):
        layer.activate_past_recording()
    return layer


class PlaceholderDynamicLayer(DynamicLayer):
    """A dynamic cache layer that cropping leaves empty until its first use: Transformers 5.15's
    ``DynamicLayer.crop`` slices its keys even when it holds none (5.24 returns first)."""

    def crop(self, tokens_to_remove: int) -> None:
        if self.is_initialized:
            super().crop(tokens_to_remove)


def placeholder_cache_layer(template: CacheLayerMixin) -> CacheLayerMixin:
    """A cache layer that holds a slot's place until its first use (a slot after it was used first, or a slot no
    layer uses: the full layers' key positions when every layer is windowed): a full one, static if ``template``
    is, which every cache operation (cropping, reordering, batch expansion) leaves empty. An empty sliding one would
    not: Transformers' ``DynamicSlidingWindowLayer.crop`` reads its keys."""
    return StaticLayer(template.max_cache_len) if isinstance(template, StaticLayer) else PlaceholderDynamicLayer()


@dataclass
class EmbeddingInputs:
    """What the ``embed`` hook sees.

    Attributes:
        inputs_embeds: ``(batch, seq, hidden)`` token embeddings (BERT: word + token type).
        position_ids: ``(batch|1, seq)`` positions of the current tokens.
        input_ids: ``(batch, seq)`` token ids, or None when the model was given ``inputs_embeds``.
        attention_mask: the mask given to the model (``(batch, kv_len)`` with 1 on real tokens, a 4-D mask, or None).
        cache: the :class:`PositionCache` of a decoding model, or None.
    """

    inputs_embeds: torch.Tensor
    position_ids: torch.Tensor
    input_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    cache: PositionCache | None = None


QueryKeyProjection = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""An attention layer's own query and key projections applied to other vectors: ``(rows, hidden)`` ->
``((heads, rows, head_dim), (heads, rows, head_dim))``, biases included (DeBERTa's ``share_att_key``)."""


class ValueRows(NamedTuple):
    """A value term ``o_i += sum_j a_ij table[index[i, j]]`` (Shaw's ``R^V``): ``table`` ``(rows, head_dim)``,
    ``index`` ``(batch|1, q_len, kv_len)``; ``starts``: on consecutive positions, where the index rises along the
    keys, its :func:`~hf_posenc.relative_tables.run_starts`, so the weights are summed per row by runs
    (:func:`~hf_posenc.relative_tables.sum_sorted_runs`) rather than scattered; None otherwise.

    ``max_distance`` ``k``: the row of a pair is its clipped distance ``clip(j - i, -k, k) + k`` (Shaw), which lets
    FlexAttention compute the term from its log-sum-exp, on consecutive positions, with no index (``index`` and
    ``starts`` None there); None: rows of another index (eager and SDPA only)."""

    table: torch.Tensor
    index: torch.Tensor | None
    starts: torch.Tensor | None
    max_distance: int | None = None


LayerStateStore = Callable[[str, torch.Tensor], torch.Tensor]
"""Keeps one attention layer's per-token states with the KV cache: ``store(name, states)`` stores the current
tokens' ``(batch, q_len, features)`` state ``name`` (one of the term's ``cache_states``) and returns every key's,
``(batch, kv_len, features)``, cached keys first (:meth:`PositionCache.append_layer_state`; a static cache returns
``max_cache_len`` rows, those not yet written zeros)."""


class LayerPositionTerm(HeadSharded, nn.Module):
    """The per-layer part of a scheme that reads the content (Shaw, Transformer-XL, DeBERTa, CoPE) or the layer's
    input (FoX), owned by each attention layer. It holds that layer's parameters; parameters shared by all layers
    reach it through the per-forward ``attention_inputs["position"]`` tensors that the scheme's ``prepare`` computes
    once, and what it computes from the layer's input through ``attention_inputs["layer"]`` (:meth:`layer_tables`).

    Class attribute ``cache_states``: names of the per-token states each layer keeps with the KV cache (see
    :meth:`layer_tables`)."""

    cache_states: tuple[str, ...] = ()

    def layer_tables(
        self, hidden_states: torch.Tensor, attention_inputs: AttentionInputs, store: LayerStateStore | None
    ) -> dict[str, torch.Tensor]:
        """Tensors computed once per layer and forward from the layer's input ``hidden_states`` ``(batch, q_len,
        hidden)`` (what the layer projects q, k and v from), before the scores; :meth:`score_term`,
        :meth:`score_mod` and :meth:`value_rows` read them as ``attention_inputs["layer"]``. ``store`` keeps
        per-token states of the keys with the KV cache (:data:`LayerStateStore`), None when there is no cache (the
        current tokens are then every key)."""
        return {}

    def score_term(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        attention_inputs: AttentionInputs,
        scaling: float,
        project_query_key: QueryKeyProjection,
    ) -> torch.Tensor | None:
        """A ``(batch, heads, q_len, kv_len)`` term added to the scaled scores, from ``query`` ``(batch, heads,
        q_len, head_dim)`` and ``key`` ``(batch, heads, kv_len, head_dim)`` (cached keys included), or None.

        ``scaling`` is the factor the layer puts on ``q.k`` (``1/sqrt(head_dim)`` times the scheme's
        ``content_scale``), for terms the paper scales alike; ``project_query_key`` the layer's own q/k projections.
        """
        return None

    def score_mod(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        attention_inputs: AttentionInputs,
        scaling: float,
        project_query_key: QueryKeyProjection,
        queries: slice = slice(None),
    ) -> Callable | None:
        """:meth:`score_term` as a FlexAttention ``score_mod`` (flex only; the scheme lists ``"flex_attention"`` in
        its backends): small per-layer tables computed from q and k (``(batch, heads, q_len, rows)`` by one matmul)
        read per (query, key) inside the kernel, nothing ``(q_len, kv_len)``-sized. None: no score term.

        ``queries``: the rows of ``query`` one FlexAttention call scores, ``q_idx`` then counting from the first of
        them. Only a term whose :meth:`flex_query_chunk` gives a size is called with fewer than all of them; it
        builds its tables for those rows alone.

        A tensor the ``score_mod`` captures that needs gradients must be at least 1-d and not a view (a matmul or
        elementwise result, not a slice, transpose or ``[None]`` of one; ``torch.stack`` or ``clone`` make one):
        compiled FlexAttention (torch 2.13) returns no gradient for a captured view, and its reference backward
        cannot return one for a 0-d tensor. ``test_flex_gradients_through_the_compiled_operator_equal_eager``
        checks every scheme's."""
        return None

    def flex_query_chunk(
        self, query: torch.Tensor, key: torch.Tensor, attention_inputs: AttentionInputs
    ) -> int | None:
        """Queries per FlexAttention call, for a term whose :meth:`score_mod` captures tables that grow with
        ``q_len x kv_len`` (a row table per query of the distances it meets): the composition then runs one
        checkpointed call per chunk of queries (``score_mod(..., queries=slice(start, stop))``, the mask's rows of the
        chunk), so only one chunk's tables exist at a time. None (the default): one call for every query."""
        return None

    def transform_qkv(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_inputs: AttentionInputs,
        store: LayerStateStore | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The current tokens' q ``(batch, heads, q_len, head_dim)``, k and v ``(batch, kv_heads, q_len, head_dim)``
        as projected (after the family's QK-norm and canon layer B), before the scheme's ``transform_qkv`` and the KV
        cache, which then keeps what this returns: a mix of each token's k and v with the previous token's (FoX-Pro's
        shifts, which keep their inputs through ``store`` as :meth:`layer_tables` does), a per-head norm. Runs after
        :meth:`layer_tables`, whose dict is ``attention_inputs["layer"]``. Unchanged by default."""
        return query, key, value

    def transform_output(self, output: torch.Tensor, hidden_states: torch.Tensor | None) -> torch.Tensor:
        """The heads' output ``(batch, heads, q_len, head_dim)`` after the normalizer's ``attention_output``, before
        the output projection, from the layer's input ``hidden_states`` ``(batch, q_len, hidden)``: FoX-Pro's output
        norm and gate. Unchanged by default."""
        return output

    def transform_query_key(
        self, query: torch.Tensor, key: torch.Tensor, attention_inputs: AttentionInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's queries ``(batch, heads, q_len, head_dim)`` and every key ``(batch, heads, kv_len, head_dim)``
        (after the KV cache, which keeps the keys as projected, and repeated for the query heads) as the scores read
        them, from ``attention_inputs["layer"]``: a rotation by angles computed from the input (Selective RoPE), on
        every backend. Unchanged by default."""
        return query, key

    def value_rows(self, attention_inputs: AttentionInputs) -> ValueRows | None:
        """The term added to the attention output, ``sum_j a_ij table[index_ij]`` (Shaw's ``R^V``), as a table and a
        per-pair row index, or None. The attention computes it from the weights summed per row, on every backend
        that lists the scheme (eager: from its weights; SDPA: recomputed in chunks of queries; FlexAttention: rows of
        a clipped distance only, from the band of near keys and the log-sum-exp, see ``ValueRows.max_distance``)."""
        return None

    def init_weights(self, initializer_range: float) -> None:
        """Initialise the parameters Transformers' ``_init_weights`` does not know (bare ``nn.Parameter``s; linear,
        embedding and LayerNorm submodules get the family's init). Use ``transformers.initialization``, which leaves
        loaded weights alone."""


def flex_compiles_length_sized_tables(device: torch.device) -> bool:
    """Whether compiled FlexAttention on ``device`` compiles a ``score_mod`` that reads a captured table whose size
    follows the sequence length once a second length makes the shapes dynamic. Not on CPU (torch 2.13): inductor's
    C++ template emits code that does not compile (``cur_kvSplitSize0 was not declared``); Triton has no such limit.
    A scheme whose ``score_mod`` always reads such tables sets ``flex_compiles_on_cpu = False``; the kernel layer
    then runs its CPU flex requests on SDPA."""
    return device.type != "cpu"


def scatter_adds_are_cheap(device: torch.device) -> bool:
    """Whether a gather's backward (``scatter_add`` of every pair's gradient into a few rows) is cheap on ``device``:
    on CPU it is a sequential add; on a GPU it is atomic adds piling onto the same addresses, so a dense bias there is
    differentiated through dense products instead (FIRE's MLP evaluated per pair: ``relu_mlp_of_scalars``)."""
    return device.type == "cpu"


class PositionEncoding(HeadSharded, CatalogueEntry, nn.Module):
    """Base class of a scheme. Subclasses set ``name``, ``description``, ``options`` and override hooks.

    Class attributes:
        relative: with its default options the scheme only sees ``i - j``, so shifting all position ids by a constant
            changes nothing; ``is_relative(spec)`` says it for given options, ``relative_unless`` names the options
            that make a relative scheme absolute.
        families: ``"encoder"`` and/or ``"decoder"``: where the scheme has a form; checked when the config is built.
        backends: the attention backends that can run it (``supported_backends`` may narrow it by option).
        cache_states: names of the per-token states it keeps across decoding steps (see :class:`PositionCache`).
        has_layer_term: ``layer_term`` gives each attention layer a :class:`LayerPositionTerm`.
        flex_compiles_on_cpu: False where compiled FlexAttention on CPU (torch 2.13) cannot compile the scheme's
            ``score_mod`` (the CPU flex request then runs SDPA, logged).

    Instance attribute ``content_scale``: a factor on the layer's ``q.k`` scaling (TUPE's and DeBERTa's
    ``1/sqrt(d (1 + number of position terms))``); 1 for most schemes.
    """

    relative: bool = False
    relative_unless: str = ""
    kind = "position_encoding"
    backends: tuple[str, ...] = BACKENDS
    cache_states: tuple[str, ...] = ()
    flex_compiles_on_cpu: bool = True
    has_layer_term: bool = False
    content_scale: float = 1.0

    def __init__(self, spec: dict[str, Any], dims: AttentionDims):
        super().__init__()
        # a spec written by hand (a test, a benchmark) may leave options out: they take their defaults
        self.spec = {**{key: option.default for key, option in self.options.items()}, **spec}
        self.dims = dims

    def init_weights(self, initializer_range: float) -> None:
        """Initialise the scheme's parameters where its reference implementation does not use Transformers' defaults
        (bare ``nn.Parameter``s; a table with its own scale). Called by the model's ``_init_weights`` after the
        submodules got the family's init; use ``transformers.initialization``, which leaves loaded weights alone."""

    @classmethod
    def describe(cls) -> dict[str, Any]:
        unless = {"relative_unless": cls.relative_unless} if cls.relative_unless else {}
        return {
            **super().describe(),
            "relative": cls.relative,
            **unless,
            "families": list(cls.families),
            "input_side": cls.acts_at_input(),
        }

    @classmethod
    def is_relative(cls, spec: dict[str, Any]) -> bool:
        """Whether the scheme with these options (a resolved spec) is shift-invariant."""
        return cls.relative

    @classmethod
    def check_sizes(cls, spec: dict[str, Any], hidden_size: int, max_position_embeddings: int) -> None:
        """Raise ``ValueError`` if the options do not fit the config's sizes; called when the config is built."""

    @classmethod
    def max_length(cls, spec: dict[str, Any]) -> int | None:
        """The longest input the scheme takes with these options (a resolved spec): positions ``0 .. max_length - 1``
        (a longer input raises ``ValueError``); None: no limit."""
        return None

    @classmethod
    def past_tokens_read(cls, spec: dict[str, Any]) -> int:
        """How many tokens before the current ones the scheme reads from its ``cache_states`` (0: none). Where every
        attention layer is windowed the states are kept in the widest window, which must hold that many."""
        return 0

    @classmethod
    def supported_backends(cls, spec: dict[str, Any]) -> tuple[str, ...]:
        """The backends that can run the scheme with these options."""
        return cls.backends

    @classmethod
    def attention_pieces(cls, spec: dict[str, Any]) -> set[str]:
        """The pieces of the attention layer that the layer term builds with these options: ``"qk_norm"`` (a norm of
        each head's q and k), ``"output_norm"`` and ``"output_gate"`` (of each head's output). The config refuses a
        piece built twice, by the scheme and by the config's ``use_qk_norm`` or the normalizer's option of that name.
        None by default."""
        return set()

    @classmethod
    def has_value_term(cls, spec: dict[str, Any]) -> bool:
        """Whether the layer term adds a term computed from the attention weights
        (:meth:`LayerPositionTerm.value_rows`) with these options. SDPA recomputes those weights, which cannot follow
        its attention dropout: training with attention dropout then runs eager."""
        return False

    @classmethod
    def backend_refusals(cls, spec: dict[str, Any], facts: ForwardFacts) -> dict[str, str]:
        """The backends this scheme refuses for a forward with ``facts`` (:class:`ForwardFacts`), each
        with the reason as a sentence: those its options do not run on (:meth:`supported_backends`); FlexAttention
        where its ``score_mod`` would train parameters read at a few addresses (``facts.position_bias_needs_grad``
        without ``facts.bias_spreads_gradients``, :meth:`flex_spreads_gradients`) or where a value term needs the
        default, consecutive positions its band is read on; SDPA where a value term would read weights SDPA
        recomputes without its attention dropout. The kernels' own limits are the kernel layer's."""
        refusals = {
            backend: f"{cls.name} with these options does not run on {backend}"
            for backend in BACKENDS
            if backend not in cls.supported_backends(spec)
        }
        if "flex_attention" not in refusals and facts.position_bias_needs_grad and not facts.bias_spreads_gradients:
            refusals["flex_attention"] = (
                "training its score_mod with these positions would add one gradient per score onto a few addresses "
                "(parameters read per head, not per distance or token); SDPA with a dense bias trains it"
            )
        value_term = cls.has_value_term(spec)
        if "flex_attention" not in refusals and value_term and not facts.consecutive:
            refusals["flex_attention"] = (
                "the value term on FlexAttention needs the model's default positions and no cached key (given "
                "position_ids or cached keys run SDPA)"
            )
        if "sdpa" not in refusals and value_term and facts.attention_dropout:
            refusals["sdpa"] = (
                "its value term reads the attention weights, which SDPA recomputes without its attention dropout"
            )
        return refusals

    @classmethod
    def layer_term(cls, spec: dict[str, Any], dims: AttentionDims, layer_idx: int) -> LayerPositionTerm | None:
        """The per-layer module of a scheme that reads the content, or None."""
        return None

    @classmethod
    def acts_at_input(cls) -> bool:
        """Whether the scheme acts on the input embeddings (its own ``embed``): once per forward, before the first
        layer, so it cannot be given to some attention layers and not others."""
        return cls.embed is not PositionEncoding.embed

    def layer_encoding(self, layer_idx: int | None) -> PositionEncoding:
        """The scheme attention layer ``layer_idx`` runs: this one, on every layer (a per-layer layout gives each
        layer its own, ``PerLayerPositionEncoding``)."""
        return self

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.spec.items())

    def resize_token_tables(self, num_tokens: int) -> None:
        """Called when the model's token embedding is replaced (``set_input_embeddings``, hence also
        ``resize_token_embeddings``): a scheme with per-token tables resizes them to ``num_tokens`` rows."""

    def embed(self, inputs: EmbeddingInputs) -> torch.Tensor:
        """Input side: the ``(batch, seq, hidden)`` embeddings combined with positions."""
        return inputs.inputs_embeds

    def prepare(
        self, query_positions: torch.Tensor, key_positions: torch.Tensor, backend: str, consecutive: bool = False
    ) -> dict[str, torch.Tensor]:
        """Tensors every layer shares, computed once per forward. A ``"score_bias"`` entry ``(batch|1, heads,
        q_len, kv_len)`` is added to the scores on eager and SDPA (folded into the mask once).

        ``consecutive`` (static, from the model: its default positions and no cached key) promises
        ``query_positions[b, i] - key_positions[b, j] = i - j + query_positions[0, 0] - key_positions[0, 0]`` in
        every row ``b``: distances follow the local indices and every row has the same ones, so a shift-invariant
        term can be computed once per distance and shared by the batch. False promises nothing."""
        return {}

    def score_mod(
        self, tables: dict[str, torch.Tensor], query_positions: torch.Tensor, key_positions: torch.Tensor
    ) -> Callable | None:
        """The position-only score term as a FlexAttention ``score_mod`` built from ``prepare``'s tables, or None.
        Its captured tensors follow the rule of :meth:`LayerPositionTerm.score_mod`."""
        return None

    def flex_query_key(
        self, query: torch.Tensor, key: torch.Tensor, tables: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries and keys FlexAttention scores, from the layer's ``(batch, heads, q_len|kv_len, head_dim)``
        ones (after the KV cache; ``tables``: what ``prepare`` returned): a scheme may append features to both, a
        term ``f(i) . g(j)`` scored at the layer's scale (TUPE's untied term). The values keep their head size.
        Unchanged by default."""
        return query, key

    def flex_spreads_gradients(self, consecutive: bool) -> bool:
        """Whether the ``score_mod`` of a forward with these positions (``consecutive``, as for :meth:`prepare`)
        reads every tensor that takes a gradient at an index that follows the query or the key (a per-distance,
        per-token or per-pair table computed outside the kernel). Triton adds a captured tensor's gradient with one
        atomic add per score: read at the head alone (a per-head scalar, a few bucket rows) those adds pile onto a
        few addresses, about 4 x 10^8 per layer at 8 x 2048 tokens and 12 heads, so the kernel layer trains such a
        ``score_mod`` on SDPA with a dense bias instead (:meth:`backend_refusals`)."""
        return True

    def transform_qkv(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tables: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q/k/v side, on ``(batch, heads, seq, head_dim)`` tensors of the current tokens, before the KV cache."""
        return query, key, value

    def transform_output(self, output: torch.Tensor, tables: dict[str, torch.Tensor]) -> torch.Tensor:
        """The output of one attention, ``(batch, heads, q_len, head_dim)`` at the current tokens (the queries),
        before the normalizer combines and gates its outputs: a scheme whose values carry their positions maps the
        output back to the query's (VO-RoPE). Unchanged by default."""
        return output


class RelativeScoreBias(PositionEncoding):
    """A scalar bias per head that depends only on positions: ``b_ij = q_i.k_j / sqrt(d_h) + f_h(i, j)``.

    Subclasses define ``bias_table(device)`` (what the formula reads, computed once per forward: a parameter, fixed
    values computed in float32 so that casting the model never rounds them, or a dict of such tensors) and the formula
    once, elementwise and broadcasting:

    * a shift-invariant scheme (``relative = True``: T5, ALiBi, KERPLE) writes ``distance_bias(distance, head,
      table)`` of ``distance = i - j``;
    * a scheme that also reads the positions themselves (FIRE) writes ``position_bias(query_position, key_position,
      head, table)`` and sets ``relative = False``.

    Paths (each evaluates that one formula):

    * consecutive positions (``prepare(..., consecutive=True)``, the model's default positions) of a shift-invariant
      scheme: the formula once per distance present, ``(heads, q_len + kv_len - 1)``; eager and SDPA add its
      Toeplitz expansion (:func:`relative_tables.toeplitz`, backward by diagonal sums, no scatter), one
      ``(1, heads, q_len, kv_len)`` bias shared by the batch; FlexAttention's ``score_mod`` reads the table (padded to
      a multiple of 8 columns) at ``i - j + kv_len - 1``;
    * any other positions: the formula per (query, key) pair, ``(batch|1, heads, q_len, kv_len)`` for eager and SDPA
      (:meth:`dense_bias`, which a scheme may evaluate more cheaply, as FIRE does), and inside ``score_mod`` on flex.
    """

    relative = True

    def bias_table(self, device: torch.device) -> torch.Tensor | dict[str, torch.Tensor]:
        raise NotImplementedError

    def distance_bias(
        self, distance: torch.Tensor, head: torch.Tensor, table: torch.Tensor | dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The bias of the integer distances ``distance = i - j`` (query minus key) for the heads ``head``."""
        raise NotImplementedError

    def position_bias(
        self,
        query_position: torch.Tensor,
        key_position: torch.Tensor,
        head: torch.Tensor,
        table: torch.Tensor | dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The bias of every (query, key) position pair, broadcasting; shift-invariant schemes read ``i - j``."""
        return self.distance_bias(query_position - key_position, head, table)

    def dense_bias(
        self, query_positions: torch.Tensor, key_positions: torch.Tensor, table: torch.Tensor | dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``(batch|1, heads, q_len, kv_len)`` bias of arbitrary positions ``(batch|1, q_len)``, ``(batch|1,
        kv_len)``: :meth:`position_bias` per pair."""
        heads = torch.arange(self.dims.num_heads, device=query_positions.device)[None, :, None, None]
        return self.position_bias(query_positions[:, None, :, None], key_positions[:, None, None, :], heads, table)

    def per_distance_bias(
        self, query_positions: torch.Tensor, key_positions: torch.Tensor, table: torch.Tensor | dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``(heads, q_len + kv_len - 1)``: column ``s`` holds the bias of the local distance ``s - (kv_len - 1)``
        (:mod:`relative_tables`' convention) for consecutive positions, i.e. of the distance ``s - (kv_len - 1) +
        query_positions[0, 0] - key_positions[0, 0]``; no host sync."""
        heads = torch.arange(self.dims.num_heads, device=query_positions.device)
        return self.distance_bias(toeplitz_distances(query_positions, key_positions)[None, :], heads[:, None], table)

    def prepare(self, query_positions, key_positions, backend, consecutive=False):
        table = self.bias_table(query_positions.device)
        # where flex cannot recompile a length-sized table (CPU), it reads the fixed-size table per pair instead
        length_sized = backend != "flex_attention" or flex_compiles_length_sized_tables(query_positions.device)
        if consecutive and self.relative and length_sized:
            per_distance = self.per_distance_bias(query_positions, key_positions, table)
            if backend == "flex_attention":
                return {"per_distance_bias": F.pad(per_distance, (0, -per_distance.shape[-1] % 8))}
            q_len, kv_len = query_positions.shape[-1], key_positions.shape[-1]
            return {"score_bias": toeplitz(per_distance, q_len, kv_len)[None]}
        if backend == "flex_attention":
            return {"bias_table": table}
        return {"score_bias": self.dense_bias(query_positions, key_positions, table)}

    def flex_spreads_gradients(self, consecutive):
        """Only the per-distance table (consecutive positions of a shift-invariant scheme) spreads the gradients; the
        per-pair formula reads the parameters at the head (KERPLE's r1, r2, T5's buckets, FIRE's c, L and pieces)."""
        return consecutive and self.relative

    def score_mod(self, tables, query_positions, key_positions):
        if "per_distance_bias" in tables:
            per_distance, last_key = tables["per_distance_bias"], key_positions.shape[-1] - 1

            def per_distance_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
                return score + per_distance[head_idx, q_idx - kv_idx + last_key].to(score.dtype)

            return per_distance_score_mod
        table = tables["bias_table"]
        query_position, key_position = position_lookup(query_positions), position_lookup(key_positions)

        def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
            query, key = query_position(batch_idx, q_idx), key_position(batch_idx, kv_idx)
            return score + self.position_bias(query, key, head_idx, table).to(score.dtype)

        return score_mod


def toeplitz_distances(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """``(q_len + kv_len - 1,)``: the distance ``i - j`` of each column of a per-distance table
    (:mod:`relative_tables`' convention) for consecutive positions ``(batch|1, q_len)``, ``(batch|1, kv_len)``:
    ``s - (kv_len - 1) + query_positions[0, 0] - key_positions[0, 0]``; no host sync."""
    q_len, kv_len = query_positions.shape[-1], key_positions.shape[-1]
    offset = query_positions[0, 0] - key_positions[0, 0]
    return torch.arange(q_len + kv_len - 1, device=query_positions.device) - (kv_len - 1) + offset


def position_lookup(positions: torch.Tensor) -> Callable:
    """``(batch_idx, idx) -> position`` for a FlexAttention ``score_mod``; ``(1, seq)`` positions serve every row."""
    if positions.shape[0] == 1:
        shared = positions[0]
        return lambda batch_idx, idx: shared[idx]
    return lambda batch_idx, idx: positions[batch_idx, idx]
