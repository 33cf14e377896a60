"""Relative schemes that read the content: the position term depends on q, k (and, for Shaw, enters the values).

Each scheme gives every attention layer a :class:`LayerPositionTerm` (``layer_term``) and computes what all layers
share once per forward in ``prepare``: the relative index tables, fixed sinusoids, shared embeddings. No tensor of
shape ``(q_len, kv_len, head_dim)`` is ever built: a position term is ``q`` times a table of at most a few hundred
rows, ``(batch, heads, q_len, rows)``, then gathered at each pair's row, ``(batch, heads, q_len, kv_len)``.

Sources: Su Jianlin, "Transformer position encodings" (kexue.fm/archives/8130, sections "Classic", "XLNet style",
"T5 style", "DeBERTa style") and the papers and reference implementations cited per class.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init

from .options import RING_ATTENTION_ONLY, ULYSSES_KERNEL_ONLY, Option
from .position_interface import (
    AttentionDims,
    AttentionInputs,
    LayerPositionTerm,
    PositionEncoding,
    QueryKeyProjection,
    ValueRows,
    position_lookup,
    toeplitz_distances,
)
from .relative_tables import (
    flex_query_chunk_size,
    gather_rows,
    in_query_chunks,
    read_rows,
    run_starts,
    skew,
    sorted_gather,
    toeplitz,
)
from .score_bias_encodings import check_log_buckets, t5_relative_bucket


def relative_distances(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """``i - j`` for every query position i ``(batch|1, q_len)`` and key position j ``(batch|1, kv_len)``:
    ``(batch|1, q_len, kv_len)``."""
    return query_positions[:, :, None] - key_positions[:, None, :]


def shaw_sinusoidal_table(max_distance: int, dim: int) -> torch.Tensor:
    """NEZHA's fixed relative table (Wei et al. 2019, eq. in section 3.2): the row of distance ``d = j - i`` in
    ``[-k, k]`` is ``R[d, 2i] = sin(d / 10000^(2i/dim))``, ``R[d, 2i+1] = cos(d / 10000^(2i/dim))``; returns the
    ``(2k + 1, dim)`` float32 table, row ``d + k``. (NEZHA's released code evaluates the sinusoid at ``d + k``
    instead, a fixed rotation of the same table.)"""
    distances = torch.arange(-max_distance, max_distance + 1, dtype=torch.float32)
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = distances[:, None] * inv_freq
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[:, :dim]


def pair_index(tables: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-pair row index ``prepare`` stored as ``name`` and its run starts ``<name>_starts``, stored on
    consecutive positions only (where the index rises along the keys), else None."""
    return tables[name], tables.get(f"{name}_starts")


class ShawTerm(LayerPositionTerm):
    """One layer's Shaw tables ``R^K``, ``R^V`` ``(2k + 1, head_dim)``, shared by the heads (learned), or none
    (sinusoidal: the fixed table comes from ``prepare``)."""

    def __init__(self, spec: dict, dims: AttentionDims):
        super().__init__()
        self.use_value = spec["use_value"]
        self.max_distance = spec["max_distance"]
        rows = 2 * spec["max_distance"] + 1
        self.key_table = self.value_table = None
        if spec["table"] == "learned":
            self.key_table = nn.Embedding(rows, dims.head_dim)
            if self.use_value:
                self.value_table = nn.Embedding(rows, dims.head_dim)

    def tables(self, attention_inputs: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.key_table is None:
            fixed = attention_inputs["position"]["shaw_table"]
            return fixed, fixed
        value_table = None if self.value_table is None else self.read_by_all_heads(self.value_table.weight)
        return self.read_by_all_heads(self.key_table.weight), value_table

    def row_scores(self, query: torch.Tensor, attention_inputs: AttentionInputs, scaling: float) -> torch.Tensor:
        """``q R^K`` scaled, ``(batch, heads, q_len, 2k + 1)``: the scale goes on the small table, not on the
        ``(q_len, kv_len)`` result."""
        key_table, _ = self.tables(attention_inputs)
        return torch.matmul(query, key_table.to(query.dtype).T * scaling)

    def score_term(self, query, key, attention_inputs, scaling, project_query_key):
        index, starts = pair_index(attention_inputs["position"], "shaw_index")
        row_scores = self.row_scores(query, attention_inputs, scaling)

        def chunk_scores(start: int, stop: int) -> torch.Tensor:
            chunk_starts = None if starts is None else starts[:, start:stop]
            return read_rows(row_scores[..., start:stop, :], index[:, start:stop], chunk_starts)

        return in_query_chunks(chunk_scores, (*query.shape[:-1], key.shape[-2]), query.device)

    def score_mod(self, query, key, attention_inputs, scaling, project_query_key):
        row_scores = self.row_scores(query, attention_inputs, scaling)
        query_position = position_lookup(attention_inputs["query_positions"])
        key_position = position_lookup(attention_inputs["key_positions"])
        k = self.max_distance

        def shaw_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
            distance = key_position(batch_idx, kv_idx) - query_position(batch_idx, q_idx)
            row = distance.clamp(-k, k) + k
            return score + row_scores[batch_idx, head_idx, q_idx, row].to(score.dtype)

        return shaw_score_mod

    def value_rows(self, attention_inputs):
        if not self.use_value:
            return None
        _, value_table = self.tables(attention_inputs)
        if attention_inputs["backend"] == "flex_attention":  # rows from the clipped distance, no index
            return ValueRows(value_table, None, None, self.max_distance)
        index, starts = pair_index(attention_inputs["position"], "shaw_index")
        return ValueRows(value_table, index, starts, self.max_distance)


class Shaw(PositionEncoding):
    """Shaw et al. 2018, "Self-Attention with Relative Position Representations" (seed eqs. (4)-(6)):

    ``e_ij = q_i . (k_j + R^K[clip(j - i, -k, k)]) / sqrt(d)``, ``o_i = sum_j a_ij (v_j + R^V[clip(j - i, -k, k)])``

    with ``R^K``, ``R^V`` tables of ``2k + 1`` rows of ``head_dim`` shared by the heads and learned per layer (as
    tensor2tensor's ``dot_product_attention_relative``; init N(0, initializer_range) as Transformers' former BERT
    ``relative_key``), or NEZHA's fixed sinusoids of the clipped distance (``table="sinusoidal"``, no parameters;
    Wei et al. 2019). The key term is ``q R^T`` ``(batch, heads, q_len, 2k + 1)`` read at each pair's row (a gather
    whose backward sums runs of keys on consecutive positions; on flex, inside the ``score_mod``); the value term
    sums the weights per row, ``(batch, heads, q_len, 2k + 1)``, times ``R^V``: on eager from its weights, on SDPA
    inside :func:`~hf_posenc.learned_bias_attention.attention_with_learned_bias`, from the weights recomputed in
    chunks of queries (SDPA returns neither the weights nor their log-sum-exp), on FlexAttention from its
    log-sum-exp (:func:`~hf_posenc.posenc_attention.clipped_value_rows_term`: the ``2k - 1`` keys inside the clip
    one by one, the two clipped tails from the remaining mass; consecutive positions). The seed writes
    ``clip(i - j)``: the same tables, rows reversed.
    """

    name = "shaw"
    parallel_refusals = {
        "context": f"its term reads queries and keys at their distance; {RING_ATTENTION_ONLY}",
        "sequence": ULYSSES_KERNEL_ONLY,
    }
    description = "Shaw et al. 2018: q.R^K and sum_j a_ij R^V of clip(j-i); NEZHA with table='sinusoidal'"
    relative = True
    has_layer_term = True
    backends = ("eager", "sdpa", "flex_attention")
    flex_compiles_on_cpu = False  # reads a length-sized table per pair: see TUPE (torch 2.13's CPU template)
    options = {
        "max_distance": Option.int_at_least(16, "clip distance k (tables of 2k+1 rows)", 1),
        "use_value": Option(True, (bool,), "add the value term sum_j a_ij R^V"),
        "table": Option.one_of(
            "learned", "'learned' (per layer) or 'sinusoidal' (NEZHA, fixed)", ("learned", "sinusoidal")
        ),
    }

    @classmethod
    def has_value_term(cls, spec):
        return spec["use_value"]

    @classmethod
    def layer_term(cls, spec, dims, layer_idx):
        return ShawTerm(spec, dims)

    def prepare(self, query_positions, key_positions, backend, consecutive=False):
        k = self.spec["max_distance"]
        tables = {}
        if self.spec["table"] == "sinusoidal":
            tables["shaw_table"] = shaw_sinusoidal_table(k, self.dims.head_dim).to(query_positions.device)
        if backend == "flex_attention":  # the score_mod computes each pair's row from the positions
            return tables
        if consecutive:  # the same distances in every row: one index serves the batch
            query_positions, key_positions = query_positions[:1], key_positions[:1]
        tables["shaw_index"] = (-relative_distances(query_positions, key_positions)).clamp(-k, k) + k
        if consecutive:  # clip(j - i) rises along the keys: read and summed by runs
            tables["shaw_index_starts"] = run_starts(tables["shaw_index"], 2 * k + 1)
        return tables


def transformer_xl_sinusoids(distances: torch.Tensor, dim: int) -> torch.Tensor:
    """Transformer-XL's ``R_d = [sin(d f), cos(d f)]``, ``f = 10000^(-2i/dim)`` (sines then cosines, as its
    ``PositionalEmbedding``): ``(rows,)`` distances -> ``(rows, dim)`` float32."""
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=distances.device) / dim)
    angles = distances.float()[:, None] * inv_freq
    return torch.cat((angles.sin(), angles.cos()), dim=-1)[:, :dim]


class TransformerXLTerm(LayerPositionTerm):
    """One layer's ``W_{K,R}`` (``position_key``, Transformer-XL's ``r_net``, no bias), ``u`` (``content_bias``,
    ``r_w_bias``) and ``v`` (``position_bias``, ``r_r_bias``), each ``(heads, head_dim)``."""

    def __init__(self, dims: AttentionDims):
        super().__init__()
        self.num_heads, self.head_dim = dims.num_heads, dims.head_dim
        self.position_key = nn.Linear(dims.hidden_size, dims.hidden_size, bias=False)
        self.content_bias = nn.Parameter(torch.zeros(dims.num_heads, dims.head_dim))
        self.position_bias = nn.Parameter(torch.zeros(dims.num_heads, dims.head_dim))

    def init_weights(self, initializer_range):
        # As Transformer-XL's init_weight / Transformers' TransfoXL: N(0, init_std).
        init.normal_(self.content_bias, mean=0.0, std=initializer_range)
        init.normal_(self.position_bias, mean=0.0, std=initializer_range)

    def row_tables(
        self, query: torch.Tensor, key: torch.Tensor, tables: dict[str, torch.Tensor], scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a layer reads per pair: ``q + v`` ``(batch, heads, q_len, head_dim)`` and the scaled, projected
        distance rows ``(heads, head_dim, rows)`` (terms 2 and 4: ``(q_i + v) . W_{K,R} R_{i-j}``), and ``u . k_j``
        scaled, ``(batch, heads, 1, kv_len)`` (term 3, the same for every query). The scale goes on the small factors,
        not on a ``(q_len, kv_len)`` result."""
        sinusoids = tables["xl_sinusoids"].to(self.position_key.weight.dtype)
        rows = self.position_key(sinusoids).view(-1, self.num_heads, self.head_dim)
        rows = self.heads_read(rows, dim=1).transpose(0, 1)  # (heads, rows, d): this rank's under tensor parallelism
        rows = (rows * scaling).transpose(-1, -2).to(query.dtype)
        shifted_query = query + self.heads_read(self.position_bias)[:, None].to(query.dtype)
        content_bias = (self.heads_read(self.content_bias) * scaling)[:, None].to(key.dtype)
        content_scores = torch.matmul(content_bias, key.transpose(-1, -2))  # a matmul, not a view (score_mod's rule)
        return shifted_query, rows, content_scores

    def score_term(self, query, key, attention_inputs, scaling, project_query_key):
        tables = attention_inputs["position"]
        query, rows, content_scores = self.row_tables(query, key, tables, scaling)
        kv_len, index = key.shape[-2], tables.get("xl_index")

        def chunk_scores(start: int, stop: int) -> torch.Tensor:
            if index is not None:  # positions with gaps: each pair's row gathered
                position_scores = gather_rows(torch.matmul(query[..., start:stop, :], rows), index[:, start:stop])
            else:  # contiguous positions: column s of the rows is the distance s - (kv_len - 1) + p - r
                row_scores = torch.matmul(query[..., start:stop, :], rows[..., start : stop + kv_len - 1])
                position_scores = skew(row_scores, kv_len)
            return position_scores + content_scores

        return in_query_chunks(chunk_scores, (*query.shape[:-1], key.shape[-2]), query.device)

    def flex_query_chunk(self, query, key, attention_inputs):
        tables, kv_len = attention_inputs["position"], key.shape[-2]
        if "xl_index" in tables:  # positions with gaps: every distance's row for each query
            rows = tables["xl_sinusoids"].shape[0]
            return flex_query_chunk_size(query, lambda chunk: chunk * rows, attention_inputs["mask"])
        return flex_query_chunk_size(query, lambda chunk: chunk * (chunk + kv_len - 1), attention_inputs["mask"])

    def score_mod(self, query, key, attention_inputs, scaling, project_query_key, queries=slice(None)):
        tables = attention_inputs["position"]
        start, stop, _ = queries.indices(query.shape[-2])
        query, rows, content_scores = self.row_tables(query[..., start:stop, :], key, tables, scaling)
        index, last_key = tables.get("xl_index"), key.shape[-2] - 1
        if index is None:  # contiguous positions: the distances of these queries, columns start .. stop + kv_len - 2
            rows = rows[..., start : stop + last_key]
        else:
            index = index[:, start:stop]
        row_scores = torch.matmul(query, rows)  # (batch, heads, queries, rows): one matmul per layer (or chunk)

        def xlnet_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
            if index is None:  # contiguous positions: the skew's column i - j + kv_len - 1
                row = q_idx - kv_idx + last_key
            else:
                row = index[0 if index.shape[0] == 1 else batch_idx, q_idx, kv_idx]
            term = row_scores[batch_idx, head_idx, q_idx, row] + content_scores[batch_idx, head_idx, 0, kv_idx]
            return score + term.to(score.dtype)

        return xlnet_score_mod


class TransformerXL(PositionEncoding):
    """Transformer-XL relative attention (Dai et al. 2019, eq. of section 3.3; seed eq. (9)), as XLNet uses it:

    ``A_ij = [q_i . k_j + q_i . W_{K,R} R_{i-j} + u . k_j + v . W_{K,R} R_{i-j}] / sqrt(d)``

    ``R_{i-j}`` the sinusoid of the distance, not clipped (``transformer_xl_sinusoids``); ``W_{K,R}``, ``u``, ``v``
    per layer (``untie_r``), no position term on the values. Bidirectional in the encoder, causal in the decoder.
    ``prepare`` builds the sinusoids of every distance the forward has; a layer scores ``(q + v)`` against the
    projected rows, ``(batch, heads, q_len, rows)`` (one matmul), then reads each pair's row. The model's default
    positions (``prepare(..., consecutive=True)``, the training case) have ``rows = q_len + kv_len - 1`` distances,
    sized from the shapes (no host sync), read by :func:`~hf_posenc.relative_tables.skew` (Transformer-XL's relative
    shift, views only, nothing of ``(batch, heads, q_len, rows)`` kept for the backward); other positions (given
    ``position_ids``, cached keys) have ``rows = max(i - j) - min(i - j) + 1`` (one host sync) and an index per pair,
    read by a gather. Reference:
    kimiyoung/transformer-xl ``RelPartialLearnableMultiHeadAttn``.
    """

    name = "xlnet"
    parallel_refusals = {
        "context": f"its term reads queries against relative positions; {RING_ATTENTION_ONLY}",
        "sequence": ULYSSES_KERNEL_ONLY,
    }
    description = "Transformer-XL/XLNet: q.k + q.W_KR R_(i-j) + u.k + v.W_KR R_(i-j), sinusoidal R, u, v per layer"
    relative = True
    has_layer_term = True
    backends = ("eager", "sdpa", "flex_attention")
    flex_compiles_on_cpu = False  # reads a length-sized table per pair: see TUPE (torch 2.13's CPU template)

    @classmethod
    def layer_term(cls, spec, dims, layer_idx):
        return TransformerXLTerm(dims)

    def prepare(self, query_positions, key_positions, backend, consecutive=False):
        if consecutive:
            q_len, kv_len = query_positions.shape[-1], key_positions.shape[-1]
            offset = query_positions[0, 0] - key_positions[0, 0]
            steps = torch.arange(q_len + kv_len - 1, device=query_positions.device) - (kv_len - 1) + offset
            return {"xl_sinusoids": transformer_xl_sinusoids(steps, self.dims.hidden_size)}
        distances = relative_distances(query_positions, key_positions)
        lowest, highest = int(distances.min()), int(distances.max())
        steps = torch.arange(lowest, highest + 1, device=distances.device)
        return {
            "xl_sinusoids": transformer_xl_sinusoids(steps, self.dims.hidden_size),
            "xl_index": distances - lowest,
        }


def deberta_log_bucket(distances: torch.Tensor, position_buckets: int, log_scale: float) -> torch.Tensor:
    """DeBERTa-v2's log-bucketed relative position (He et al. 2021; ``make_log_bucket_position`` of Transformers'
    ``deberta_v2``): distances with ``|d| <= mid = position_buckets / 2`` are kept, larger ones become
    ``sign(d) (mid + ceil(log(|d| / mid) / log_scale (mid - 1)))``, ``log_scale = log((max_relative_positions - 1) /
    mid)`` (:class:`DeBERTaBuckets`). Computed in float32 as the reference does, so the buckets agree at the
    boundaries."""
    mid = position_buckets // 2
    magnitude = distances.abs().clamp(min=mid).float()
    log_bucket = torch.ceil(torch.log(magnitude / mid) / log_scale * (mid - 1)) + mid
    return torch.where(distances.abs() <= mid, distances, (log_bucket * distances.sign()).to(distances.dtype))


class DeBERTaBuckets:
    """DeBERTa's row of the distances ``i - j``: ``clamp(bucket(i - j) + span, 0, 2 span - 1)`` with ``span =
    position_buckets`` (log buckets, :func:`deberta_log_bucket`) or ``max_relative_positions`` (no buckets);
    elementwise, so it also runs inside a FlexAttention ``score_mod``. ``log_scale`` is computed once, in float32 as
    the reference computes it (``torch.log(torch.tensor(...))``), and kept as a Python number: a ``torch.tensor``
    built inside a ``score_mod`` cannot be lowered by inductor."""

    def __init__(self, position_buckets: int, max_relative_positions: int):
        self.position_buckets = position_buckets
        self.span = position_buckets or max_relative_positions
        mid = position_buckets // 2
        # on the CPU: from_pretrained builds the model under the meta device, where .item() has no value to read
        ratio = torch.tensor((max_relative_positions - 1) / mid if mid else 1.0, device="cpu")
        self.log_scale = torch.log(ratio).item()

    def index(self, distances: torch.Tensor) -> torch.Tensor:
        if self.position_buckets > 0:
            distances = deberta_log_bucket(distances, self.position_buckets, self.log_scale)
        return (distances + self.span).clamp(0, 2 * self.span - 1)


def query_and_key_row_terms(
    query: torch.Tensor,
    key: torch.Tensor,
    query_rows: torch.Tensor | None,
    key_rows: torch.Tensor | None,
    index: torch.Tensor,
    query_starts: torch.Tensor | None,
    key_starts: torch.Tensor | None,
) -> torch.Tensor:
    """``q_i . Q[idx(i, j)] + k_j . K[idx(i, j)]``, ``(batch, heads, q_len, kv_len)``: a query term and a key term
    over row tables ``(..., head_dim, rows)`` (either may be None), read at the same per-pair row ``index``
    ``(batch|1, q_len, kv_len)`` of the distance ``i - j`` (DeBERTa's c2p and p2c, BERT's ``relative_key_query``),
    in checkpointed chunks of queries. The query term reads ``(batch, heads, chunk, rows)`` row scores at the index,
    the key term ``(batch, heads, kv_len, rows)`` ones at the transposed index. On consecutive positions the index
    falls along the keys and rises along the queries: ``query_starts`` are the run starts of ``rows - 1 - index``
    (read by :func:`sorted_gather` descending) and ``key_starts`` those of ``index`` transposed; None: gathered. The
    key term's row scores are one matmul per layer, outside the chunks (every chunk reads all of them; its
    backward sums the chunks' gradients into them, and neither read keeps them for the backward)."""
    key_scores = None if key_rows is None else torch.matmul(key, key_rows)  # (batch, heads, kv_len, rows)

    def chunk_scores(start: int, stop: int) -> torch.Tensor:
        score = 0.0
        if query_rows is not None:  # q_i . Q[idx(i, j)]
            row_scores = torch.matmul(query[..., start:stop, :], query_rows)
            if query_starts is None:
                score = gather_rows(row_scores, index[:, start:stop])
            else:  # idx falls along the keys: runs of the reversed index
                chunk_starts = query_starts[:, start:stop]
                score = sorted_gather(row_scores, index[:, start:stop], chunk_starts, descending=True)
        if key_rows is not None:  # k_j . K[idx(i, j)]: rows of keys, read with the transposed index
            key_index = index[:, start:stop].transpose(-1, -2)  # rises along the queries
            chunk_starts = None if key_starts is None else (key_starts - start).clamp(0, stop - start)
            key_term = read_rows(key_scores, key_index, chunk_starts).transpose(-1, -2)
            score = key_term if query_rows is None else score.add_(key_term)  # in place: one chunk-sized sum
        return score

    return in_query_chunks(chunk_scores, (*query.shape[:-1], key.shape[-2]), query.device)


def plus_row_scores(
    score: torch.Tensor,
    query_row_scores: torch.Tensor | None,
    key_row_scores: torch.Tensor | None,
    batch_idx: torch.Tensor,
    head_idx: torch.Tensor,
    q_idx: torch.Tensor,
    kv_idx: torch.Tensor,
    row: torch.Tensor,
) -> torch.Tensor:
    """Inside a ``score_mod``: ``score + q_i . R[row] + k_j . R'[row]``, the query's and the key's scores against
    the pair's row, read from ``(batch, heads, q_len, rows)`` and ``(batch, heads, kv_len, rows)`` tables (None:
    that term is off), in the score's dtype."""
    if query_row_scores is not None:
        score = score + query_row_scores[batch_idx, head_idx, q_idx, row].to(score.dtype)
    if key_row_scores is not None:
        score = score + key_row_scores[batch_idx, head_idx, kv_idx, row].to(score.dtype)
    return score


def windowed_row_terms(
    query: torch.Tensor, key: torch.Tensor, query_rows: torch.Tensor | None, key_rows: torch.Tensor | None
) -> torch.Tensor:
    """``q_i . Q[:, i - j + kv_len - 1] + k_j . K[:, i - j + kv_len - 1]``, ``(batch, heads, q_len, kv_len)``, for
    row tables ``(..., head_dim, q_len + kv_len - 1)`` of the distances of consecutive positions, column ``s`` the
    local distance ``s - (kv_len - 1)`` (:mod:`~hf_posenc.relative_tables`' convention; either table may be None),
    in checkpointed chunks of queries. A chunk of queries ``start .. stop - 1`` reads the columns ``start .. stop +
    kv_len - 2`` only: the query term is :func:`skew` of ``q K`` over them (Transformer-XL's relative shift, views),
    the key term the same skew of ``k K`` with the roles of queries and keys swapped (columns reversed, then
    transposed): no index, no gather, and nothing of the table beyond the chunk's window is multiplied."""
    kv_len = key.shape[-2]

    def chunk_scores(start: int, stop: int) -> torch.Tensor:
        window = slice(start, stop + kv_len - 1)
        score = None
        if query_rows is not None:  # column i - j + kv_len - 1 of query i's row scores
            score = skew(torch.matmul(query[..., start:stop, :], query_rows[..., window]), kv_len)
        if key_rows is not None:  # key j's row scores, reversed: column j - i + chunk - 1, the skew of (kv, chunk)
            key_scores = torch.matmul(key, key_rows[..., window]).flip(-1)
            key_term = skew(key_scores, stop - start).transpose(-1, -2)
            score = key_term if score is None else score + key_term
        return score

    return in_query_chunks(chunk_scores, (*query.shape[:-1], kv_len), query.device)


class DeBERTaTerm(LayerPositionTerm):
    """One layer's position projections of the shared relative embeddings: its own q/k projections
    (``share_att_key``, DeBERTa-v3) or ``pos_key_proj`` (c2p) / ``pos_query_proj`` (p2c), named as in Transformers."""

    def __init__(self, spec: dict, dims: AttentionDims):
        super().__init__()
        self.att_type = spec["att_type"].split("|")
        self.share_att_key = spec["share_att_key"]
        self.buckets = DeBERTaBuckets(spec["position_buckets"], spec["max_relative_positions"])
        self.num_heads, self.head_dim = dims.num_heads, dims.head_dim
        if not self.share_att_key:
            if "c2p" in self.att_type:
                self.pos_key_proj = nn.Linear(dims.hidden_size, dims.hidden_size)
            if "p2c" in self.att_type:
                self.pos_query_proj = nn.Linear(dims.hidden_size, dims.hidden_size)

    def heads(self, states: torch.Tensor) -> torch.Tensor:
        """``(rows, hidden)`` -> ``(heads, rows, head_dim)``, this rank's heads under tensor parallelism."""
        return self.heads_read(states.view(-1, self.num_heads, self.head_dim), dim=1).transpose(0, 1)

    def row_tables(
        self, key: torch.Tensor, embeddings: torch.Tensor, scaling: float, project_query_key: QueryKeyProjection
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The scaled position keys ``K^r`` and position queries ``Q^r`` as ``(heads, head_dim, 2 span)`` tables
        (c2p: a query's row scores are ``q K^r``; p2c: a key's are ``k Q^r``, one matmul each); None for a term
        ``att_type`` leaves out. The scale goes on the (2 span)-row tables, not on a ``(q_len, kv_len)`` result."""
        embeddings = embeddings.to(key.dtype)
        if self.share_att_key:
            position_query, position_key = project_query_key(embeddings)  # (heads, 2 span, head_dim)
        query_rows = key_rows = None
        if "c2p" in self.att_type:
            if not self.share_att_key:
                position_key = self.heads(self.pos_key_proj(embeddings))
            query_rows = position_key.transpose(-1, -2) * scaling
        if "p2c" in self.att_type:
            if not self.share_att_key:
                position_query = self.heads(self.pos_query_proj(embeddings))
            key_rows = position_query.transpose(-1, -2) * scaling
        return query_rows, key_rows

    def score_term(self, query, key, attention_inputs, scaling, project_query_key):
        tables = attention_inputs["position"]
        query_rows, key_rows = self.row_tables(key, tables["deberta_embeddings"], scaling, project_query_key)
        query_starts, key_starts = tables.get("deberta_c2p_starts"), tables.get("deberta_p2c_starts")
        return query_and_key_row_terms(
            query, key, query_rows, key_rows, tables["deberta_index"], query_starts, key_starts
        )

    def score_mod(self, query, key, attention_inputs, scaling, project_query_key):
        tables = attention_inputs["position"]
        query_rows, key_rows = self.row_tables(key, tables["deberta_embeddings"], scaling, project_query_key)
        query_row_scores = None if query_rows is None else torch.matmul(query, query_rows)  # (b, h, q_len, 2 span)
        key_row_scores = None if key_rows is None else torch.matmul(key, key_rows)  # (b, h, kv_len, 2 span)
        query_position = position_lookup(attention_inputs["query_positions"])
        key_position = position_lookup(attention_inputs["key_positions"])
        buckets, row_of_distance, last_key = self.buckets, tables.get("deberta_rows"), key.shape[-2] - 1

        def deberta_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
            if row_of_distance is not None:  # consecutive positions: the row of column i - j + kv_len - 1
                row = row_of_distance[q_idx - kv_idx + last_key]
            else:
                row = buckets.index(query_position(batch_idx, q_idx) - key_position(batch_idx, kv_idx))
            return plus_row_scores(score, query_row_scores, key_row_scores, batch_idx, head_idx, q_idx, kv_idx, row)

        return deberta_score_mod


class DeBERTa(PositionEncoding):
    """DeBERTa disentangled attention (He et al. 2021, "DeBERTa: Decoding-enhanced BERT with Disentangled
    Attention", eq. (4); seed eq. (11)), in its v2/v3 form (Transformers' ``DisentangledSelfAttention``):

    ``A_ij = [q_i . k_j + q_i . K^r[idx(i, j)] + k_j . Q^r[idx(i, j)]] / sqrt(d (1 + number of position terms))``

    ``idx(i, j) = clamp(bucket(i - j) + span, 0, 2 span - 1)`` with ``bucket`` :func:`deberta_log_bucket`
    (``span = position_buckets``, or ``max_relative_positions`` without buckets). ``K^r``, ``Q^r`` are the shared
    relative embeddings ``(2 span, hidden)`` after their LayerNorm (one pair for all layers, computed once per
    forward), projected per layer by that layer's own W_K, W_Q (``share_att_key``) or its ``pos_key_proj`` /
    ``pos_query_proj``. ``att_type`` picks c2p (content -> position) and p2c (position -> content). The p2c term reads
    the same ``idx(i, j)`` as c2p, as the reference implementations do (the paper writes ``delta(j, i)``). Not
    included: dropout on the relative embeddings and the enhanced mask decoder (absolute positions in the last
    layers).
    """

    name = "deberta"
    parallel_refusals = {
        "context": f"its terms read content against relative positions; {RING_ATTENTION_ONLY}",
        "sequence": ULYSSES_KERNEL_ONLY,
    }
    description = "DeBERTa-v2/v3 disentangled attention: c2p + p2c over log-bucketed relative embeddings"
    relative = True
    has_layer_term = True
    backends = ("eager", "sdpa", "flex_attention")
    flex_compiles_on_cpu = False  # reads length-sized tables per pair: see TUPE (torch 2.13's CPU template)
    options = {
        "att_type": Option.one_of("c2p|p2c", "position terms, '|'-separated", ("c2p|p2c", "p2c|c2p", "c2p", "p2c")),
        "position_buckets": Option(
            256,
            (int,),
            "log buckets (0: none, distances clipped)",
            lambda v: v >= 0 and v % 2 == 0,
            "an even int >= 0",
        ),
        "max_relative_positions": Option.int_at_least(512, "distance of the last bucket", 1),
        "share_att_key": Option(True, (bool,), "project the relative embeddings with the layer's own W_Q, W_K"),
    }

    @classmethod
    def check_spec(cls, spec):
        buckets, largest = spec["position_buckets"], spec["max_relative_positions"]
        if buckets > 0 and largest - 1 <= buckets // 2:
            raise ValueError(
                f"position_encoding 'deberta': max_relative_positions={largest} must exceed position_buckets / 2 + 1 "
                f"= {buckets // 2 + 1}, where the logarithmic buckets start (or set position_buckets=0)."
            )

    @classmethod
    def layer_term(cls, spec, dims, layer_idx):
        return DeBERTaTerm(spec, dims)

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        self.buckets = DeBERTaBuckets(spec["position_buckets"], spec["max_relative_positions"])
        self.span = self.buckets.span
        self.content_scale = (1 + len(spec["att_type"].split("|"))) ** -0.5
        self.rel_embeddings = nn.Embedding(2 * self.span, dims.hidden_size)
        self.LayerNorm = nn.LayerNorm(dims.hidden_size, eps=1e-7)  # DeBERTa's layer_norm_eps

    def prepare(self, query_positions, key_positions, backend, consecutive=False):
        """The shared relative embeddings after their LayerNorm and the per-pair row index ``deberta_index``; on
        consecutive positions (one row for the batch) the index comes from ``deberta_rows``, the row of each of the
        ``q_len + kv_len - 1`` distances present (the log bucket computed once per distance, not per pair; in
        :mod:`~hf_posenc.relative_tables`' column order), expanded by :func:`toeplitz`, with the run starts that
        read it by runs (c2p's of the reversed index, p2c's of the transposed one). On flex: ``deberta_rows`` on
        consecutive positions (the ``score_mod`` reads it at ``i - j + kv_len - 1``), else nothing (the
        ``score_mod`` computes each pair's bucket from the positions)."""
        tables = {"deberta_embeddings": self.LayerNorm(self.rel_embeddings.weight)}
        if consecutive:
            tables["deberta_rows"] = self.buckets.index(toeplitz_distances(query_positions, key_positions))
        if backend == "flex_attention":
            return tables
        if consecutive:
            q_len, kv_len = query_positions.shape[-1], key_positions.shape[-1]
            index = toeplitz(tables.pop("deberta_rows"), q_len, kv_len)[None]
        else:
            index = self.buckets.index(relative_distances(query_positions, key_positions))
        tables["deberta_index"] = index
        if consecutive:  # idx(i - j) falls along the keys (c2p reads it reversed) and rises along the queries (p2c)
            rows = 2 * self.span
            tables["deberta_c2p_starts"] = run_starts(rows - 1 - index, rows)
            tables["deberta_p2c_starts"] = run_starts(index.transpose(-1, -2), rows)
        return tables


class TUPE(PositionEncoding):
    """TUPE-R (Ke et al., ICLR 2021, "Rethinking Positional Encoding in Language Pre-training", eq. (7)):

    ``A_ij = (x_i W_Q)(x_j W_K)^T / sqrt(2d) + reset((p_i U_Q)(p_j U_K)^T / sqrt(2d) + b[bucket(i - j)], i, j)``

    The untied positional correlation uses its own absolute table ``p`` (``max_positions`` rows, LayerNorm) and
    projections ``U_Q``, ``U_K`` (per head), computed once per forward and shared by all layers, as is the T5-bucketed
    relative bias ``b`` (bidirectional in the encoder, causal in the decoder); nothing is added to the input. With
    ``cls_untying`` (the encoder's default) the [CLS] token (position 0) is untied from positions: its row (from
    [CLS] to others) and its column (from others to [CLS]) become learned per-head values ``theta_1``, ``theta_2``.
    The reference implementation (guolinke/TUPE ``TransformerSentenceEncoder``) does the same with spare table rows
    and buckets; this is the paper's form. A decoder has no [CLS]: ``cls_untying=True`` there is an error.

    Paths: eager and SDPA add one bias table per forward as ``score_bias`` (``(1, heads, q, k)`` on the model's
    default positions, the bucket bias computed once per distance and expanded by :func:`toeplitz`; per pair
    otherwise). On FlexAttention, on the default positions, both terms share the scale ``1/sqrt(2d)``, so the untied
    term is extra query and key features (:meth:`flex_query_key`): ``[q_i ; p_i U_Q] . [k_j ; p_j U_K] / sqrt(2d)``
    (query and key heads of ``2d``, values of ``d``), the position features of position 0 zeroed under
    ``cls_untying`` (the untied term is then 0 on [CLS]'s row and column); the ``score_mod`` adds the bucket bias
    per distance and the [CLS] values, expanded along the keys (``theta_2``) and the queries (``theta_1``) so that
    their gradients spread. Nothing ``(q, k)``-sized is built. Other positions on flex read the whole bias table per
    pair (``(batch|1, heads, q, k)``). Compiled CPU FlexAttention cannot recompile these ``score_mod`` s (torch
    2.13), so CPU flex requests run SDPA.
    """

    name = "tupe"
    parallel_refusals = {
        "context": f"its position scores are added to the content scores; {RING_ATTENTION_ONLY}",
        "sequence": ULYSSES_KERNEL_ONLY,
    }
    description = "TUPE-R: untied (p_i U_Q)(p_j U_K) shared by all layers + T5-bucketed bias; [CLS] untying"
    backends = ("eager", "sdpa", "flex_attention")
    flex_compiles_on_cpu = False  # the (q, k) untied table's read: C++ compile error at a second length (torch 2.13)
    options = {
        "max_positions": Option.int_at_least(None, "absolute table length (default: max_position_embeddings)", 1),
        "num_buckets": Option(32, (int,), "relative buckets", lambda v: v >= 4 and v % 2 == 0, "an even int >= 4"),
        "max_distance": Option.int_at_least(128, "distance of the last bucket", 2),
        "cls_untying": Option(
            None, (bool,), "learned [CLS] (position 0) correlations (default: on in the encoder, off in the decoder)"
        ),
    }

    @classmethod
    def max_length(cls, spec):
        return spec["max_positions"]  # the rows of its absolute table

    @classmethod
    def check_spec(cls, spec):
        check_log_buckets(cls.name, spec)

    @classmethod
    def check_family(cls, spec, causal):
        super().check_family(spec, causal)
        if causal and spec["cls_untying"]:
            raise ValueError(
                "position_encoding 'tupe': cls_untying=True has no decoder form (a causal model has no [CLS] token "
                "that sees every position); leave it unset or False in a decoder."
            )

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        self.content_scale = 2**-0.5
        self.cls_untying = spec["cls_untying"] if spec["cls_untying"] is not None else not dims.causal
        self.table = nn.Embedding(spec["max_positions"] or dims.max_positions, dims.hidden_size)
        self.LayerNorm = nn.LayerNorm(dims.hidden_size)
        self.query = nn.Linear(dims.hidden_size, dims.hidden_size)
        self.key = nn.Linear(dims.hidden_size, dims.hidden_size)
        self.relative_attention_bias = nn.Embedding(spec["num_buckets"], dims.num_heads)
        if self.cls_untying:
            self.cls_to_others = nn.Parameter(torch.zeros(dims.num_heads))
            self.others_to_cls = nn.Parameter(torch.zeros(dims.num_heads))

    def init_weights(self, initializer_range):
        if self.cls_untying:
            init.normal_(self.cls_to_others, mean=0.0, std=initializer_range)
            init.normal_(self.others_to_cls, mean=0.0, std=initializer_range)

    def projected_positions(self, positions: torch.Tensor, projection: nn.Linear) -> torch.Tensor:
        """``LayerNorm(p[positions]) U``: ``(batch|1, seq)`` -> ``(batch|1, heads, seq, head_dim)``."""
        if not torch.compiler.is_compiling():
            limit = self.table.num_embeddings
            if int(positions.max()) >= limit or int(positions.min()) < 0:
                raise ValueError(
                    f"tupe: positions must be in 0..{limit - 1} (its absolute table has {limit} rows); got "
                    f"{int(positions.min())}..{int(positions.max())}. Set the option max_positions (or "
                    "max_position_embeddings) larger, or use a relative scheme."
                )
        states = projection(self.LayerNorm(self.table(positions)))
        states = states.view(*positions.shape, self.model_num_heads, self.dims.head_dim)
        return self.heads_read(states, dim=-2).transpose(1, 2)

    def untied_term(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """``(p_i U_Q)(p_j U_K)^T / sqrt(2d)``: ``(batch|1, heads, q_len, kv_len)``, one matmul of the projected
        positions."""
        position_query = self.projected_positions(query_positions, self.query) * (2 * self.dims.head_dim) ** -0.5
        position_key = self.projected_positions(key_positions, self.key)
        return torch.matmul(position_query, position_key.transpose(-1, -2))

    def bucket_bias(self, distance: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """``b_h[bucket(i - j)]`` of the distances ``distance`` for the heads ``head``, elementwise, broadcasting
        (T5's buckets: :func:`t5_relative_bucket`)."""
        bucket = t5_relative_bucket(
            distance,
            bidirectional=not self.dims.causal,
            num_buckets=self.spec["num_buckets"],
            max_distance=self.spec["max_distance"],
        )
        return self.heads_read(self.relative_attention_bias.weight, dim=1)[bucket, head]

    def untie_cls(
        self, bias: torch.Tensor, query_position: torch.Tensor, key_position: torch.Tensor, head: torch.Tensor
    ) -> torch.Tensor:
        """``bias`` with [CLS] (position 0) untied, elementwise, broadcasting: ``theta_1`` on its row (itself
        included), ``theta_2`` on its column; ``bias`` unchanged without ``cls_untying``."""
        if not self.cls_untying:
            return bias
        others_to_cls, cls_to_others = self.heads_read(self.others_to_cls), self.heads_read(self.cls_to_others)
        bias = torch.where(key_position == 0, others_to_cls[head].to(bias.dtype), bias)
        return torch.where(query_position == 0, cls_to_others[head].to(bias.dtype), bias)

    def prepare(self, query_positions, key_positions, backend, consecutive=False):
        """Eager and SDPA: the whole bias as one table, once per forward: the untied term (one matmul), plus the
        bucketed bias once per distance on consecutive positions (expanded by :func:`toeplitz`), else per pair, with
        [CLS] untied. Consecutive positions with one query row are the same in every row, so the bias is ``(1, heads,
        q_len, kv_len)``, shared by the batch. FlexAttention on consecutive positions: :meth:`flex_tables`; on other
        positions the same whole table, which :meth:`score_mod` reads per pair (a table read per pair takes its
        gradient at that pair's address, where reading the bucket table or the [CLS] values at the head inside the
        kernel would add one gradient per score onto a few addresses)."""
        if backend == "flex_attention" and consecutive:
            return self.flex_tables(query_positions, key_positions)
        if consecutive and query_positions.shape[0] == 1:
            key_positions = key_positions[:1]
        bias = self.untied_term(query_positions, key_positions)
        heads = torch.arange(self.dims.num_heads, device=query_positions.device)
        if consecutive:
            per_distance = self.bucket_bias(toeplitz_distances(query_positions, key_positions)[None], heads[:, None])
            bias = bias + toeplitz(per_distance, query_positions.shape[-1], key_positions.shape[-1])[None]
        else:
            bias = bias + self.bucket_bias(
                relative_distances(query_positions, key_positions)[:, None], heads[:, None, None]
            )
        query_position, key_position = query_positions[:, None, :, None], key_positions[:, None, None, :]
        bias = self.untie_cls(bias, query_position, key_position, heads[:, None, None])
        return {"tupe_bias" if backend == "flex_attention" else "score_bias": bias}

    def flex_tables(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """FlexAttention's tables on consecutive positions: the position features ``p U_Q``, ``p U_K`` ``(batch|1,
        heads, seq, head_dim)`` (zero at position 0 under ``cls_untying``), the bucket bias per distance ``(heads,
        q_len + kv_len - 1)`` (padded to a multiple of 8 columns, as :class:`RelativeScoreBias`), and under
        ``cls_untying`` ``theta_2`` per key ``(heads, kv_len)`` and ``theta_1`` per query ``(heads, q_len)`` (the
        per-head values repeated: the kernel adds each score's gradient at its key's or query's address)."""
        query_features = self.projected_positions(query_positions, self.query)
        key_features = self.projected_positions(key_positions, self.key)
        heads = torch.arange(self.dims.num_heads, device=query_positions.device)
        per_distance = self.bucket_bias(toeplitz_distances(query_positions, key_positions)[None], heads[:, None])
        tables = {"tupe_per_distance": F.pad(per_distance, (0, -per_distance.shape[-1] % 8))}
        if self.cls_untying:
            query_features = query_features * (query_positions != 0)[:, None, :, None]
            key_features = key_features * (key_positions != 0)[:, None, :, None]
            q_len, kv_len = query_positions.shape[-1], key_positions.shape[-1]
            tables["tupe_cls_per_key"] = self.heads_read(self.others_to_cls)[:, None].repeat(1, kv_len)
            tables["tupe_cls_per_query"] = self.heads_read(self.cls_to_others)[:, None].repeat(1, q_len)
        return {**tables, "tupe_query_features": query_features, "tupe_key_features": key_features}

    def flex_query_key(self, query, key, tables):
        """``[q ; p U_Q]`` and ``[k ; p U_K]`` on consecutive positions (:meth:`flex_tables`), scored with the
        layer's scale ``1/sqrt(2d)``: the content term and the untied term in one dot product. Grouped keys are
        repeated first (the position features are per query head)."""
        if "tupe_query_features" not in tables:
            return query, key
        if key.shape[1] != query.shape[1]:
            key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        query_features, key_features = tables["tupe_query_features"], tables["tupe_key_features"]
        query_features = query_features.expand(query.shape[0], -1, -1, -1).to(query.dtype)
        key_features = key_features.expand(key.shape[0], -1, -1, -1).to(key.dtype)
        return torch.cat((query, query_features), dim=-1), torch.cat((key, key_features), dim=-1)

    def score_mod(self, tables, query_positions, key_positions):
        """Consecutive positions: the bucket bias per distance, [CLS]'s values on its row and column (the untied
        term is in the features, :meth:`flex_query_key`); other positions: the bias of :meth:`prepare` read per
        (query, key)."""
        if "tupe_per_distance" in tables:
            per_distance, last_key = tables["tupe_per_distance"], key_positions.shape[-1] - 1
            per_key, per_query = tables.get("tupe_cls_per_key"), tables.get("tupe_cls_per_query")
            query_position, key_position = position_lookup(query_positions), position_lookup(key_positions)

            def tupe_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
                bias = per_distance[head_idx, q_idx - kv_idx + last_key]
                if per_key is not None:  # reset(., i, j): [CLS]'s row wins over its column, as untie_cls
                    bias = torch.where(key_position(batch_idx, kv_idx) == 0, per_key[head_idx, kv_idx], bias)
                    bias = torch.where(query_position(batch_idx, q_idx) == 0, per_query[head_idx, q_idx], bias)
                return score + bias.to(score.dtype)

            return tupe_score_mod
        bias = tables["tupe_bias"]
        shared = bias.shape[0] == 1  # one layout for the whole batch

        def tupe_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
            return score + bias[0 if shared else batch_idx, head_idx, q_idx, kv_idx].to(score.dtype)

        return tupe_score_mod


class RelativeKeyTerm(LayerPositionTerm):
    """One layer's ``distance_embedding`` ``(2 max_positions - 1, head_dim)``, shared by the heads, row
    ``i - j + max_positions - 1`` for the distance ``i - j`` (Transformers 4.x ``BertSelfAttention``'s name, layout
    and init: an ``nn.Embedding``, N(0, initializer_range))."""

    def __init__(self, spec: dict, dims: AttentionDims):
        super().__init__()
        self.key_query = spec["variant"] == "key_query"
        self.max_positions = spec["max_positions"] or dims.max_positions
        self.distance_embedding = nn.Embedding(2 * self.max_positions - 1, dims.head_dim)

    def row_tables(
        self, query: torch.Tensor, scaling: float, window: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scaled table as ``(head_dim, rows)`` for the query term and, with ``key_query``, the key term: 4.x
        adds both to ``q . k`` before its ``1/sqrt(d)``, so they take the layer's scaling (put on the small table,
        not on a ``(q_len, kv_len)`` result). ``window``: the rows of the distances present, in the order of
        :mod:`~hf_posenc.relative_tables`' columns (an ``index_select`` of the parameter, whose gradient lands in
        those rows); None: every row."""
        table = self.read_by_all_heads(self.distance_embedding.weight)
        if window is not None:
            table = table.index_select(0, window)
        rows = (table * scaling).T.to(query.dtype)
        return rows, rows if self.key_query else None

    def score_term(self, query, key, attention_inputs, scaling, project_query_key):
        tables = attention_inputs["position"]
        window = tables.get("relative_key_window")
        query_rows, key_rows = self.row_tables(query, scaling, window)
        if window is not None:
            return windowed_row_terms(query, key, query_rows, key_rows)
        index = tables["relative_key_index"]
        return query_and_key_row_terms(query, key, query_rows, key_rows, index, None, None)

    def flex_query_chunk(self, query, key, attention_inputs):
        kv_len, windowed = key.shape[-2], "relative_key_window" in attention_inputs["position"]

        def table_elements(chunk: int) -> int:
            rows = chunk + kv_len - 1 if windowed else 2 * self.max_positions - 1  # the chunk's distances, or all
            return (chunk + (kv_len if self.key_query else 0)) * rows  # the query rows, and the key rows

        return flex_query_chunk_size(query, table_elements, attention_inputs["mask"])

    def score_mod(self, query, key, attention_inputs, scaling, project_query_key, queries=slice(None)):
        window = attention_inputs["position"].get("relative_key_window")
        start, stop, _ = queries.indices(query.shape[-2])
        reach, last_key = self.max_positions - 1, key.shape[-2] - 1
        if window is not None:  # the distances of these queries: columns start .. stop + kv_len - 2
            window = window[start : stop + last_key]
        query_rows, key_rows = self.row_tables(query, scaling, window)
        # (batch, heads, queries, rows) and (batch, heads, kv_len, rows): one matmul each per layer (or chunk)
        query_row_scores = torch.matmul(query[..., start:stop, :], query_rows)
        key_row_scores = None if key_rows is None else torch.matmul(key, key_rows)
        query_position = position_lookup(attention_inputs["query_positions"][..., start:stop])
        key_position = position_lookup(attention_inputs["key_positions"])

        def relative_key_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
            if window is not None:  # consecutive positions: the window's column i - j + kv_len - 1
                row = q_idx - kv_idx + last_key
            else:
                distance = query_position(batch_idx, q_idx) - key_position(batch_idx, kv_idx)
                row = distance.clamp(-reach, reach) + reach  # in range for every visible pair (checked in prepare)
            return plus_row_scores(score, query_row_scores, key_row_scores, batch_idx, head_idx, q_idx, kv_idx, row)

        return relative_key_score_mod


class RelativeKey(PositionEncoding):
    """BERT's ``relative_key`` / ``relative_key_query`` (Huang, Liang, Xu, Xiang 2020, "Improve Transformer Models
    with Better Relative Position Embeddings", methods 3 and 4; Transformers 4.x ``BertSelfAttention``, removed in
    v5):

    ``A_ij = [q_i . k_j + q_i . r_(i-j) + k_j . r_(i-j)] / sqrt(d)`` (``variant="key_query"``), without the
    ``k_j . r_(i-j)`` term for ``variant="key"``; ``r_(i-j)`` is row ``i - j + max_positions - 1`` of a learned
    per-layer ``distance_embedding`` of ``2 max_positions - 1`` rows of ``head_dim``, shared by the heads, and both
    terms are added before the ``1/sqrt(d)`` scale. Nothing is added to the input (4.x's embeddings add the absolute
    table only for ``position_embedding_type="absolute"``). Distances are not clipped: a pair farther apart than
    ``max_positions - 1`` raises (4.x fails with an index error there). ``hf_posenc.convert`` turns a 4.x checkpoint
    of either type into this scheme with the same outputs.

    Paths: on consecutive positions (the model's default positions) only the ``q_len + kv_len - 1`` rows of the
    distances present are read (an ``index_select`` of the parameter: the same checkpoints, the gradient in the same
    rows, where a table sized by ``max_position_embeddings`` has up to 4x more), ``q`` and ``k`` against them by
    chunk of queries and each pair's column read by a skew (:func:`windowed_row_terms`); other positions as
    :class:`DeBERTa` (:func:`query_and_key_row_terms`: the whole table, gathered at each pair's row). On flex the
    ``score_mod`` reads ``(batch, heads, q_len|kv_len, rows)`` row tables at one index per score (the window's
    column ``i - j + kv_len - 1`` on consecutive positions).
    """

    name = "relative_key"
    parallel_refusals = {
        "context": f"its term reads queries and keys at their distance; {RING_ATTENTION_ONLY}",
        "sequence": ULYSSES_KERNEL_ONLY,
    }
    description = "BERT 4.x relative_key(_query): q.r_(i-j) (+ k.r_(i-j)) over a learned per-layer distance table"
    relative = True
    has_layer_term = True
    backends = ("eager", "sdpa", "flex_attention")
    flex_compiles_on_cpu = False  # reads length-sized tables per pair: see TUPE (torch 2.13's CPU template)
    options = {
        "variant": Option.one_of(
            "key_query",
            "'key_query' (q.r + k.r, 4.x relative_key_query) or 'key' (q.r, 4.x relative_key)",
            ("key_query", "key"),
        ),
        "max_positions": Option.int_at_least(
            None, "distances up to max_positions - 1, 2 max_positions - 1 rows (default: max_position_embeddings)", 1
        ),
    }

    @classmethod
    def layer_term(cls, spec, dims, layer_idx):
        return RelativeKeyTerm(spec, dims)

    @classmethod
    def max_length(cls, spec):
        return spec["max_positions"]  # distances up to max_positions - 1

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        self.max_positions = spec["max_positions"] or dims.max_positions

    def check_distances(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> None:
        """Raise ``ValueError`` when a query and a key are farther apart than the table reaches (a host sync; under
        ``torch.compile`` an assertion on the device)."""
        reach = self.max_positions - 1
        farthest = torch.maximum(
            query_positions.max() - key_positions.min(), key_positions.max() - query_positions.min()
        )
        if torch.compiler.is_compiling():
            torch._assert_async(farthest <= reach, "relative_key: a distance is beyond max_positions - 1")
            return
        if int(farthest) > reach:
            raise ValueError(
                f"relative_key: a query and a key are {int(farthest)} positions apart; its distance table reaches "
                f"{reach} (max_positions={reach + 1}, 2 max_positions - 1 rows). Use shorter inputs, or a scheme "
                "without a length limit (shaw clips its distances; rope, t5, alibi)."
            )

    def prepare(self, query_positions, key_positions, backend, consecutive=False):
        """On consecutive positions ``relative_key_window``, the table rows of the ``q_len + kv_len - 1`` distances
        present (``toeplitz_distances + max_positions - 1``, every backend); otherwise the per-pair row index
        ``relative_key_index`` (``i - j + max_positions - 1``), or on flex nothing (the score_mod computes each
        pair's row from the positions)."""
        self.check_distances(query_positions, key_positions)
        reach = self.max_positions - 1
        if consecutive:  # in range: check_distances bounds every distance present
            return {"relative_key_window": toeplitz_distances(query_positions, key_positions) + reach}
        if backend == "flex_attention":
            return {}
        return {"relative_key_index": relative_distances(query_positions, key_positions).clamp(-reach, reach) + reach}
