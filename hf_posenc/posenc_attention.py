"""The one attention composition both model families use.

``positional_attention`` takes projected q, k, v and composes, in order: the layer term's tables and q/k/v transform,
the scheme's q/k/v transform, the KV cache, the scores with the scheme's position terms (the shared bias folded into
the mask, the layer's content term), the normalizer, the values and the layer's value term, the normalizer's and then
the layer term's transform of the output, on the backend ``attention_backends.choose_route`` picked for the
forward (eager, SDPA, or FlexAttention through ``attention_backends.flex_attend``'s compile cache; a normalizer no
SDPA kernel computes, stick_breaking, runs on the ``sdpa`` branch as the eager composition a checkpointed chunk of
queries at a time). Every backend computes the same numbers, so the choice changes speed, never the result.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.checkpoint import checkpoint

from .attention_backends import (
    _compiled_flex_attention,  # noqa: F401  (tools clear the compile cache through here)
    flex_attend,
    flex_kernel_options,
)
from .fla_kernels import fla_attention
from .learned_bias_attention import attention_with_learned_bias
from .normalizer_interface import AttentionNormalizer, additive_mask, flex_pass, implicit_visible
from .position_interface import (
    AttentionInputs,
    LayerPositionTerm,
    PositionCache,
    PositionEncoding,
    QueryKeyProjection,
    ValueRows,
)
from .relative_tables import FLEX_BLOCK, band_dot_products, in_query_chunks, sum_rows


def value_rows_term(weights: torch.Tensor, value_rows: ValueRows) -> torch.Tensor:
    """``sum_j a_ij table[index_ij] = sum_r (sum_{j: index_ij = r} a_ij) table[r]``: ``(batch, heads, q_len,
    head_dim)``, the weights summed per row first (by runs on consecutive positions, else scattered; no ``(q_len,
    kv_len, head_dim)`` tensor)."""
    table = value_rows.table
    per_row = sum_rows(weights, value_rows.index, value_rows.starts, table.shape[0])
    return torch.matmul(per_row, table.to(per_row.dtype))


def _on_pairs(function: Callable, batch: int, heads: int, q_idx: torch.Tensor, kv_idx: torch.Tensor, *score):
    """A FlexAttention ``mask_mod`` (no ``score``) or ``score_mod`` (``score``: ``(batch, heads, pairs)``) evaluated at
    the pairs ``(q_idx[p], kv_idx[p])`` of every batch row and head, vectorised with ``vmap`` as FlexAttention's own
    unfused path does: ``(batch, heads, pairs)``."""
    over_pairs = (0,) * len(score) + (None, None, 0, 0)
    over_heads = (0,) * len(score) + (None, 0, None, None)
    over_batch = (0,) * len(score) + (0, None, None, None)
    vectorised = torch.vmap(torch.vmap(torch.vmap(function, over_pairs), over_heads), over_batch)
    batch_idx = torch.arange(batch, device=q_idx.device)
    head_idx = torch.arange(heads, device=q_idx.device)
    return vectorised(*score, batch_idx, head_idx, q_idx, kv_idx)


def band_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    score_mod: Callable | None,
    block_mask: BlockMask | None,
    scale: float,
    reach: int,
) -> torch.Tensor:
    """FlexAttention's scores ``s_ij = score_mod(scale q_i . k_j)`` of the pairs ``j = i + d``, ``|d| <= reach``
    (queries and keys of one length): ``(batch, heads, n, 2 reach + 1)``, column ``d + reach``, ``-inf`` where the
    mask hides the key or ``i + d`` is outside the sequence. ``O(n reach)`` scores, in at least float32."""
    batch, heads, n, _ = query.shape
    scores = band_dot_products(query, key, reach) * scale
    q_idx = torch.arange(n, device=query.device)[:, None].expand(n, 2 * reach + 1)
    kv_idx = q_idx + torch.arange(-reach, reach + 1, device=query.device)
    inside = (kv_idx >= 0) & (kv_idx < n)
    pairs = (q_idx.flatten(), kv_idx.clamp(0, n - 1).flatten())
    if score_mod is not None:
        scores = _on_pairs(score_mod, batch, heads, *pairs, scores.flatten(-2)).view_as(scores)
    visible = inside
    if block_mask is not None:
        visible = visible & _on_pairs(block_mask.mask_mod, batch, heads, *pairs).view(batch, heads, n, -1)
    return scores.masked_fill(~visible, float("-inf"))


def _block_lists(num_blocks: torch.Tensor, indices: torch.Tensor, columns: int) -> torch.Tensor:
    """A BlockMask's ordered block lists (``(..., rows)`` counts, ``(..., rows, columns)`` indices) as a dense
    ``(..., rows, columns)`` boolean."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
    dense = torch.zeros(*indices.shape[:-1], columns + 1, dtype=torch.bool, device=indices.device)
    return dense.scatter_(-1, torch.where(listed, indices.long(), columns), True)[..., :columns]


def _ordered_blocks(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense ``(..., rows, columns)`` boolean as BlockMask's ordered lists: counts and indices (listed first)."""
    order = torch.argsort(dense.to(torch.int32), dim=-1, descending=True, stable=True)
    return dense.sum(-1, dtype=torch.int32), order.to(torch.int32)


def left_tail_block_mask(block_mask: BlockMask | None, length: int, reach: int, device: torch.device) -> BlockMask:
    """``block_mask`` (None: every key of ``length``) without its tiles that hold no pair ``j <= i - reach``: a
    tile of queries ``a .. a'`` and keys ``c .. c'`` is kept when ``c <= min(a', length - 1) - reach``. Only whole
    tiles go (the kept ones keep their mask_mod and, full or partial, their kind), so the scores the kernel computes
    are the same: the encoder's left-tail pass of Shaw's value term visits about half the tiles."""
    if block_mask is None:
        q_block = kv_block = FLEX_BLOCK
        blocks = -(-length // FLEX_BLOCK)
        full = torch.ones(1, 1, blocks, blocks, dtype=torch.bool, device=device)
        partial, mask_mod = torch.zeros_like(full), None
    else:
        q_block, kv_block = block_mask.BLOCK_SIZE
        blocks = block_mask.kv_indices.shape[-1]
        partial = _block_lists(block_mask.kv_num_blocks, block_mask.kv_indices, blocks)
        full = torch.zeros_like(partial)
        if block_mask.full_kv_num_blocks is not None:
            full = _block_lists(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, blocks)
        mask_mod = block_mask.mask_mod
    last_query = ((torch.arange(partial.shape[-2], device=device) + 1) * q_block - 1).clamp(max=length - 1)
    first_key = torch.arange(partial.shape[-1], device=device) * kv_block
    holds_tail = first_key[None, :] <= last_query[:, None] - reach
    return BlockMask.from_kv_blocks(
        *_ordered_blocks(partial & holds_tail),
        *_ordered_blocks(full & holds_tail),
        BLOCK_SIZE=(q_block, kv_block),
        mask_mod=mask_mod,
        seq_lengths=(length, length),
    )


def queries_from(score_mod: Callable | None, start: int, like: torch.Tensor) -> Callable | None:
    """``score_mod`` for a chunk of queries starting at ``start``: it reads query ``start + q_idx`` (the start a
    captured tensor on ``like``'s device, so that every chunk runs one compiled kernel)."""
    if score_mod is None:
        return None
    offset = like.new_full((), start, dtype=torch.int32)

    def chunk_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        return score_mod(score, batch_idx, head_idx, q_idx + offset, kv_idx)

    return chunk_score_mod


def query_chunk_block_mask(block_mask: BlockMask | None, start: int, stop: int) -> BlockMask | None:
    """The queries ``start .. stop - 1`` of ``block_mask`` (``start`` a multiple of its block of queries) as a mask
    of their own: its tiles' rows of those blocks, and a ``mask_mod`` that reads query ``start + q_idx``. None: every
    key (None)."""
    if block_mask is None:
        return None
    q_block, kv_block = block_mask.BLOCK_SIZE
    if start % q_block:
        raise ValueError(f"A query chunk starts on a block of the mask: {start} is not a multiple of {q_block}.")
    rows = slice(start // q_block, -(-stop // q_block))
    full = (None, None)
    if block_mask.full_kv_num_blocks is not None:
        full = (block_mask.full_kv_num_blocks[..., rows], block_mask.full_kv_indices[..., rows, :])
    mask_mod = block_mask.mask_mod
    if mask_mod is not None:
        offset = block_mask.kv_num_blocks.new_full((), start, dtype=torch.int32)

        def chunk_mask_mod(batch_idx, head_idx, q_idx, kv_idx):
            return block_mask.mask_mod(batch_idx, head_idx, q_idx + offset, kv_idx)

        mask_mod = chunk_mask_mod
    return BlockMask.from_kv_blocks(
        block_mask.kv_num_blocks[..., rows],
        block_mask.kv_indices[..., rows, :],
        *full,
        BLOCK_SIZE=(q_block, kv_block),
        mask_mod=mask_mod,
        seq_lengths=(stop - start, block_mask.seq_lengths[1]),
    )


def flex_in_query_chunks(
    chunk_outputs: Callable[[int, int], tuple[torch.Tensor, ...]], q_len: int, chunk: int | None
) -> list[torch.Tensor]:
    """The ``(batch, heads, q_len, head_dim)`` outputs ``chunk_outputs(start, stop)`` gives for the queries ``start
    .. stop - 1``: from one call (``chunk`` None), or ``chunk`` queries at a time, each call checkpointed with
    gradients (its tables and FlexAttention's saved tensors recomputed in the backward, so one chunk's exist at a
    time), joined along the queries."""
    if chunk is None:
        return list(chunk_outputs(0, q_len))
    pieces = []
    for start in range(0, q_len, chunk):
        stop = min(start + chunk, q_len)
        if torch.is_grad_enabled():  # FlexAttention draws no random numbers (no dropout): no RNG state to keep
            pieces.append(checkpoint(chunk_outputs, start, stop, use_reentrant=False, preserve_rng_state=False))
        else:
            pieces.append(chunk_outputs(start, stop))
    return [torch.cat(parts, dim=-2) for parts in zip(*pieces, strict=True)]


def clipped_value_rows_term(
    attend: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Callable | None,
    block_mask: BlockMask | None,
    scale: float,
    lse: torch.Tensor,
    value_rows: ValueRows,
    causal: bool,
) -> torch.Tensor:
    """``sum_j a_ij R[clip(j - i, -k, k) + k]`` on FlexAttention (``R``: ``value_rows.table``, ``k``:
    ``value_rows.max_distance``), from the softmax's log-sum-exp ``lse`` ``(batch, heads, n)``, for queries and keys
    at the same consecutive positions: ``(batch, heads, n, head_dim)``, without the weights matrix.

    A key inside the clip, ``|j - i| < k``, has a row of its own, weighted ``a_ij = exp(s_ij - lse_i)`` from the band
    of scores (:func:`band_scores`). The keys clipped to row 0 (``j <= i - k``) and row ``2k`` share the rest of the
    row's mass, ``1 - sum of the band``: a causal layer (its mask hides every key after the query) gives it all to
    row 0; otherwise a second FlexAttention pass over the keys ``j <= i - k`` (the other keys' scores at
    ``finfo.min``, the tiles of none of them skipped, :func:`left_tail_block_mask`) gives row 0's share,
    ``exp(lse_left_i - lse_i)``, and row ``2k`` the remainder (with ``k >= n`` both tails are empty: no pass). Rows
    that see no key (``lse = -inf``) get 0."""
    k = value_rows.max_distance
    if k is None:
        raise ValueError(
            "A value term on FlexAttention needs rows of a clipped distance (ValueRows.max_distance); a scheme whose "
            "value term has other rows must leave flex_attention out of its supported_backends."
        )
    has_key = torch.isfinite(lse)
    finite_lse = torch.where(has_key, lse, 0.0)[..., None]
    band = torch.exp(band_scores(query, key, score_mod, block_mask, scale, k - 1) - finite_lse)
    rest = has_key.to(band.dtype) - band.sum(-1)
    if causal or k >= query.shape[-2]:
        left, right = rest, torch.zeros_like(rest)
    else:

        def left_tail_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
            if score_mod is not None:
                score = score_mod(score, batch_idx, head_idx, q_idx, kv_idx)
            # finfo.min, not -inf: FlexAttention's unfused path differentiates an all -inf row's log-sum-exp to NaN
            # (the compiled kernel's base-2 scaling makes it -inf, which its masked-row handling covers)
            return torch.where(kv_idx <= q_idx - k, score, torch.finfo(score.dtype).min)

        tail_mask = left_tail_block_mask(block_mask, query.shape[-2], k, query.device)
        _, left_lse = flex_pass(attend, query, key, value, left_tail_score_mod, tail_mask, scale, pass_name="tail")
        left = torch.exp(torch.where(has_key, left_lse, float("-inf")) - finite_lse[..., 0]).to(band.dtype)
        right = rest - left
    per_row = torch.cat((left[..., None], band, right[..., None]), dim=-1)
    return torch.matmul(per_row, value_rows.table.to(per_row.dtype))


def chain_score_mods(first: Callable | None, second: Callable | None) -> Callable | None:
    """One FlexAttention ``score_mod`` adding both terms (the scheme's position-only one, the layer's content one);
    None when neither exists."""
    if first is None or second is None:
        return first or second

    def chained_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        return second(first(score, batch_idx, head_idx, q_idx, kv_idx), batch_idx, head_idx, q_idx, kv_idx)

    return chained_score_mod


class QueryKeyRMSNorm(nn.Module):
    """QK-norm: RMSNorm of each head's query or key features (Qwen3's ``Qwen3RMSNorm`` on ``head_dim``, applied as
    ``Qwen3Attention`` does, after the projection and before the position encoding; OLMo 3, Gemma 3):
    ``x / sqrt(mean(x^2) + eps) * weight``, computed in float32, the ``(head_dim,)`` weight shared by the heads and
    initialised to 1 (Transformers' init of an ``RMSNorm``). ``x``: ``(..., head_dim)``."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def soft_capped_scores(scores: torch.Tensor, cap: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Gemma 2's logit soft-capping, ``b -> c tanh(b / c)`` (``Gemma2Attention``'s ``attn_logit_softcapping``), of
    the scores with their position and content terms; masked keys stay masked: ``mask`` is the mask already applied
    to ``scores``, additive (``finfo.min`` on masked keys) or boolean (True = visible), or None."""
    capped = cap * torch.tanh(scores / cap)
    if mask is None:
        return capped
    hidden = ~mask if mask.dtype == torch.bool else mask <= torch.finfo(mask.dtype).min / 2
    return capped.masked_fill(hidden, torch.finfo(capped.dtype).min)


def soft_cap_score_mod(cap: float) -> Callable:
    """:func:`soft_capped_scores` as a FlexAttention ``score_mod`` (attention-gym's ``generate_tanh_softcap``),
    chained after the scheme's and the layer's terms; the ``BlockMask`` masks apart from it."""

    def soft_cap(score, batch_idx, head_idx, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return soft_cap


def repeat_kv_heads(states: torch.Tensor, query_heads: int) -> torch.Tensor:
    """Grouped-query keys or values ``(batch, kv_heads, seq, head_dim)`` repeated for the query heads they serve."""
    if states.shape[1] == query_heads:
        return states
    return states.repeat_interleave(query_heads // states.shape[1], dim=1)


def _eager(
    query,
    key,
    values,
    attention_inputs,
    normalizer,
    score_term,
    value_rows,
    scaling,
    dropout,
    training,
    logit_softcapping=None,
):
    """The weights materialised, applied to each of ``values`` (``normalizer.split_values``): the outputs and the
    weights. ``logit_softcapping``: the scores capped before the normalizer (:func:`soft_capped_scores`)."""
    compute_dtype = torch.promote_types(query.dtype, torch.float32)  # scores and weights in at least float32
    scores = torch.matmul(query.to(compute_dtype), key.to(compute_dtype).transpose(-1, -2)) * scaling
    score_term = score_term(query, key, attention_inputs) if score_term is not None else None
    if score_term is not None:
        scores = scores + score_term
    if attention_inputs["mask"] is not None:
        scores = scores + attention_inputs["mask"]
    if logit_softcapping is not None:
        scores = soft_capped_scores(scores, logit_softcapping, attention_inputs["mask"])
    weights = normalizer(scores, attention_inputs)
    if attention_inputs["row_has_key"] is not None:
        weights = weights * attention_inputs["row_has_key"]
    weights = nn.functional.dropout(weights.to(values[0].dtype), p=dropout, training=training)
    term = value_rows_term(weights, value_rows) if value_rows is not None else None
    outputs = [torch.matmul(weights, value) for value in values]
    return [output if term is None else output + term for output in outputs], weights


def attention_in_query_chunks(
    query,
    key,
    value,
    attention_inputs,
    normalizer,
    score_term,
    value_rows,
    scaling,
    dropout,
    training,
    causal,
    logit_softcapping=None,
):
    """The ``sdpa`` backend of a normalizer no SDPA kernel computes (``normalizer.sdpa_in_query_chunks``:
    stick_breaking): the eager composition (scores, the mask, the normalizer, dropout, ``P V`` and the value term) a
    chunk of queries at a time (``relative_tables.in_query_chunks``, each chunk checkpointed), so only ``(batch,
    heads, chunk, kv_len)`` scores and weights exist at a time and the backward recomputes them; a layer keeps q, k,
    v, its output and, with a layer term, that ``(q, k)`` term. Every normalizer's weights are a function of its
    row's scores, so the chunks give eager's numbers. The mask is SDPA's (:func:`build_dense_mask`): additive,
    boolean, or None (``normalizer_interface.implicit_last_keys``: SDPA's top-left ``is_causal``, or every key);
    dropout masks are recomputed from the saved RNG state. ``logit_softcapping`` caps the scores as eager does."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    key, value = repeat_kv_heads(key, query.shape[1]), repeat_kv_heads(value, query.shape[1])  # as eager reads them
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    term = score_term(query, key, attention_inputs) if score_term is not None else None
    mask, visible, row_has_key = attention_inputs["mask"], attention_inputs["visible"], attention_inputs["row_has_key"]
    if mask is None:  # what SDPA would see: is_causal (top-left), or every key
        visible = mask = implicit_visible(causal, q_len, kv_len, query.device)[None, None]
    query_positions = attention_inputs["query_positions"]

    def chunk_output(start: int, stop: int) -> torch.Tensor:
        scores = torch.matmul(query[:, :, start:stop].to(compute_dtype), key.to(compute_dtype).transpose(-1, -2))
        scores = scores * scaling
        if term is not None:
            scores = scores + term[:, :, start:stop]
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask[..., start:stop, :], torch.finfo(scores.dtype).min)
        elif mask is not None:
            scores = scores + mask[..., start:stop, :]
        if logit_softcapping is not None:
            scores = soft_capped_scores(scores, logit_softcapping, None if mask is None else mask[..., start:stop, :])
        chunk_inputs = {
            **attention_inputs,
            "query_positions": query_positions[:, start:stop],
            "visible": None if visible is None else visible[..., start:stop, :],
            "row_has_key": None if row_has_key is None else row_has_key[..., start:stop, :],
        }
        weights = normalizer(scores, chunk_inputs)
        if row_has_key is not None:
            weights = weights * row_has_key[..., start:stop, :]
        weights = nn.functional.dropout(weights.to(value.dtype), p=dropout, training=training)
        output = torch.matmul(weights, value)
        if value_rows is not None:
            index, starts = value_rows.index, value_rows.starts
            rows_of_chunk = value_rows._replace(
                index=index[:, start:stop], starts=None if starts is None else starts[:, start:stop]
            )
            output = output + value_rows_term(weights, rows_of_chunk)
        return output

    return in_query_chunks(chunk_output, (query.shape[0], query.shape[1], q_len, kv_len), query.device)


def _differentiate_mask_outside_sdpa(attn_mask, query, dropout, training) -> bool:
    """A float mask that requires grad (a learned position term) on CPU, without dropout: CPU SDPA kernels do not
    differentiate the mask and would fall back to the math path, so :func:`attention_with_learned_bias` runs SDPA's
    fused forward and its own backward (one ``(q_len, kv_len)`` tensor kept per layer instead of about three)."""
    needs_grad = attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled()
    return needs_grad and query.device.type == "cpu" and not (training and dropout > 0)


def _sdpa(query, key, value, attention_inputs, normalizer, score_term, value_rows, scaling, dropout, training, causal):
    attn_mask = attention_inputs["mask"]
    score_term = score_term(query, key, attention_inputs) if score_term is not None else None
    if score_term is not None:
        if attn_mask is None:
            attn_mask = score_term.to(query.dtype)
        elif attn_mask.dtype == torch.bool:
            attn_mask = score_term.to(query.dtype).masked_fill(~attn_mask, torch.finfo(query.dtype).min)
        else:
            attn_mask = attn_mask + score_term.to(attn_mask.dtype)
    query, key, value, attn_mask = normalizer.sdpa_arguments(query, key, value, attn_mask, attention_inputs, causal)
    if value_rows is not None:  # training with attention dropout ran eager (choose_backend)
        bias = additive_mask(attn_mask, causal, query, key)
        output = attention_with_learned_bias(query, key, value, bias, scaling, value_rows)
    elif _differentiate_mask_outside_sdpa(attn_mask, query, dropout, training):
        key, value = repeat_kv_heads(key, query.shape[1]), repeat_kv_heads(value, query.shape[1])
        output = attention_with_learned_bias(query, key, value, attn_mask, scaling)
    else:
        output = nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout if training else 0.0,
            scale=scaling,
            is_causal=attn_mask is None and causal and query.shape[-2] > 1,
            enable_gqa=key.shape[1] != query.shape[1],
        )
    if attention_inputs["row_has_key"] is not None:
        output = output * attention_inputs["row_has_key"]
    return output


def positional_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_inputs: AttentionInputs,
    encoding: PositionEncoding,
    normalizer: AttentionNormalizer,
    position_term: LayerPositionTerm | None,
    *,
    scaling: float,
    dropout: float,
    training: bool,
    causal: bool,
    cache=None,
    layer_idx: int | None = None,
    project_query_key: QueryKeyProjection | None = None,
    hidden_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``(batch, heads, q_len, head_dim)`` q, k, v with the scheme and normalizer composed in (k and v
    may have fewer heads, a divisor of q's: grouped-query attention, as in Llama; the cache keeps them unrepeated).

    ``attention_inputs`` is the layer's per-forward :data:`AttentionInputs`; ``encoding`` the model's position
    encoding, of which the layer runs ``encoding.layer_encoding(layer_idx)``; ``position_term`` the layer's
    :class:`LayerPositionTerm` or None, ``project_query_key`` the layer's q/k projections it may apply to other
    vectors, ``hidden_states`` ``(batch, q_len, hidden)`` the layer's input q, k, v were projected from (for the
    term's ``layer_tables``, whose per-token states are kept in ``cache``, and for the normalizer's output gate);
    ``scaling`` is the layer's factor on ``q.k``, times the scheme's ``content_scale``; the inputs'
    ``"logit_softcapping"`` (the config's ``attn_logit_softcapping``, None: off) caps the scores, position and content
    terms included, before the normalizer (:func:`soft_capped_scores`, on a backend that can: :func:`choose_backend`
    was told the same value). The weights are
    applied to each of the normalizer's ``split_values`` (one attention each, on every backend) and its
    ``attention_output`` combines and gates the outputs. Returns the output ``(batch, q_len, heads, head_dim)`` and
    the weights ``(batch, heads, q_len, kv_len)`` as the normalizer reports them (eager only, else None)."""
    encoding = encoding.layer_encoding(layer_idx)  # the scheme this layer runs (a per-layer layout's own)
    scaling = scaling * encoding.content_scale
    logit_softcapping = attention_inputs.get("logit_softcapping")
    score_term = value_rows = None
    if position_term is not None:
        store = None
        if cache is not None:
            position_cache = PositionCache(cache, encoding.dims.num_layers)
            store = partial(
                position_cache.append_layer_state, scheme=encoding, term=position_term, layer_idx=layer_idx
            )
        layer_tables = position_term.layer_tables(hidden_states, attention_inputs, store)
        attention_inputs = {**attention_inputs, "layer": layer_tables}
        query, key, value = position_term.transform_qkv(query, key, value, attention_inputs, store)
        score_term = partial(position_term.score_term, scaling=scaling, project_query_key=project_query_key)
        value_rows = position_term.value_rows(attention_inputs)
    tables = attention_inputs["position"]
    query, key, value = encoding.transform_qkv(query, key, value, tables)
    if cache is not None:
        key, value = cache.update(key, value, layer_idx)
    backend = attention_inputs["backend"]
    # Grouped-query attention (key/value head h serves query heads h*g .. h*g+g-1): the fused kernels read the shared
    # heads themselves (enable_gqa); eager and the layer terms, which read keys per query head, get them repeated.
    if key.shape[1] != query.shape[1] and (backend == "eager" or position_term is not None):
        key, value = repeat_kv_heads(key, query.shape[1]), repeat_kv_heads(value, query.shape[1])
    if position_term is not None:  # the layer's own q/k transform, on every key (cached ones included)
        query, key = position_term.transform_query_key(query, key, attention_inputs)
    weights = None
    values = normalizer.split_values(value)
    fused = None
    if backend == "sdpa":  # fla's kernel for the combinations that have one, on CUDA when installed
        dropout_in_effect = dropout if training else 0.0
        fused = fla_attention(
            query, key, values, attention_inputs, encoding, normalizer, position_term, scaling, dropout_in_effect,
            logit_softcapping,
        )  # fmt: skip
    if fused is not None:
        outputs = fused
    elif backend == "flex_attention":
        position_mod = encoding.score_mod(
            tables, attention_inputs["query_positions"], attention_inputs["key_positions"]
        )
        flex_query, flex_key = encoding.flex_query_key(query, key, tables)  # a scheme's extra q/k features (TUPE)
        if flex_key.shape[1] != values[0].shape[1]:  # keys repeated for per-query-head features: their values alike
            values = [repeat_kv_heads(v, flex_query.shape[1]) for v in values]
        region = f"{encoding.name}+{normalizer.name}" + ("+softcap" if logit_softcapping is not None else "")
        kernel_options = flex_kernel_options(query.device, encoding, position_term)
        enable_gqa = flex_key.shape[1] != flex_query.shape[1]
        attend = partial(flex_attend, region=region, enable_gqa=enable_gqa, **kernel_options)
        block_mask = attention_inputs["mask"]

        def score_mod_of(queries: slice | None) -> Callable | None:
            """The scores' terms for all queries (None), or for ``queries``, a chunk whose ``q_idx`` counts from its
            first query (the position-only term reads its whole tables at ``q_idx`` shifted back)."""
            score_mod, arguments = position_mod, (query, key, attention_inputs, scaling, project_query_key)
            if queries is not None:
                score_mod = queries_from(score_mod, queries.start, query)
            if position_term is not None:
                layer_mod = position_term.score_mod(*arguments, **({} if queries is None else {"queries": queries}))
                score_mod = chain_score_mods(score_mod, layer_mod)
            if logit_softcapping is not None:
                score_mod = chain_score_mods(score_mod, soft_cap_score_mod(logit_softcapping))
            return score_mod

        if value_rows is not None:  # softmax weights on consecutive positions (choose_backend)
            score_mod = score_mod_of(None)
            passes = [flex_pass(attend, flex_query, flex_key, v, score_mod, block_mask, scaling) for v in values]
            lse = passes[0][1]
            term = clipped_value_rows_term(
                attend, flex_query, flex_key, values[0], score_mod, block_mask, scaling, lse, value_rows, causal
            )
            outputs = [output + term.to(output.dtype) for output, _ in passes]
        else:
            chunk = None if position_term is None else position_term.flex_query_chunk(query, key, attention_inputs)

            def chunk_outputs(start: int, stop: int) -> tuple[torch.Tensor, ...]:
                queries = None if chunk is None else slice(start, stop)
                score_mod = score_mod_of(queries)
                mask = block_mask if chunk is None else query_chunk_block_mask(block_mask, start, stop)
                chunk_query = flex_query[..., start:stop, :]
                return tuple(
                    normalizer.flex_output(attend, chunk_query, flex_key, v, score_mod, mask, scaling) for v in values
                )

            outputs = flex_in_query_chunks(chunk_outputs, query.shape[-2], chunk)
    elif backend == "sdpa":
        attend = _sdpa  # with a logit soft-cap only the chunked composition runs here (choose_backend)
        if normalizer.sdpa_in_query_chunks:
            attend = partial(attention_in_query_chunks, logit_softcapping=logit_softcapping)
        outputs = [
            attend(
                query, key, v, attention_inputs, normalizer, score_term, value_rows, scaling, dropout, training, causal
            )
            for v in values
        ]
    else:
        outputs, weights = _eager(
            query,
            key,
            values,
            attention_inputs,
            normalizer,
            score_term,
            value_rows,
            scaling,
            dropout,
            training,
            logit_softcapping,
        )
        weights = normalizer.output_weights(weights)
    outputs = [encoding.transform_output(output, tables) for output in outputs]
    output = normalizer.attention_output(outputs, hidden_states)
    if position_term is not None:
        output = position_term.transform_output(output, hidden_states)
    return output.transpose(1, 2).contiguous(), weights
