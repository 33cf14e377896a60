"""Relative schemes computed from the layer's input tokens: the position term of a query and a key depends on the
tokens between them (their gates, their Householder factors, their contextual counts), not on their positions, so
shifting the position ids changes nothing.

Each scheme gives every attention layer a :class:`LayerPositionTerm` (``layer_term``) whose per-token states are
computed from the layer's input in ``layer_tables`` and kept with the KV cache (``cache_states``): FoX's forget gates
(a learned, data-dependent decay of the past) and PaTH's Householder transformations (a learned, data-dependent
rotation of the keys). CoPE counts positions by gates read from ``q . k`` (its term is computed per layer from the
query and the keys, ``score_term``). All three are decoder only: their terms run from a key to a later query.

Sources: the papers and reference implementations cited per class.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from transformers import initialization as init

from .normalizer_interface import head_rms_norm, normed_and_gated_output
from .options import ALONG_THE_SEQUENCE, ULYSSES_KERNEL_ONLY, Option
from .position_interface import AttentionDims, AttentionInputs, LayerPositionTerm, LayerStateStore, PositionEncoding
from .relative_tables import in_query_chunks


FOX_QK_NORM_EPS = 1e-5
"""FoX-Pro's QK-norm epsilon: the reference's ``GroupNorm`` default (its ``norm_eps``, 1e-6, is the output norm's)."""

FOX_PRO_OPTIONS = ("use_qk_norm", "use_output_gate", "use_output_norm", "use_k_shift", "use_v_shift")
"""FoX-Pro's pieces, each an option of ``fox`` (:class:`ForgetGate`)."""

FOX_PRO_PIECES = {"use_qk_norm": "qk_norm", "use_output_gate": "output_gate", "use_output_norm": "output_norm"}
"""FoX's options that build a piece the layer or the normalizer also offers (:meth:`FoX.attention_pieces`)."""


class ForgetGate(LayerPositionTerm):
    """One layer's FoX forget gates: ``forget_gate`` (``nn.Linear(hidden, heads)``, the reference's ``fgate_proj``,
    initialised by the family as the reference's ``_initialize_weights``: weight ``N(0, initializer_range)``, bias
    ``bias_init``, 0 in the reference, so every gate starts near ``sigmoid(0) = 1/2``).

    ``layer_tables`` gives the cumulative log gates of the queries and of the keys, ``(batch, heads, q_len)`` and
    ``(batch, heads, kv_len)`` in at least float32: the keys' ``c = cumsum(log f)`` over every key (cached keys
    first: each key's ``log f`` is kept with the KV cache, as the reference's ``FgateDynamicCache`` does), and the
    queries' ``c`` the same sums read at the current tokens, ``c_last - (log f of the current tokens after the
    query)``, which holds for a dynamic cache and a static one alike (unwritten rows hold 0 and add nothing). Two
    tables, so that a FlexAttention ``score_mod`` reads each at one index.

    FoX-Pro's pieces (options of the reference's ``ForgettingAttentionLayer``, each off by default and initialised as
    there), in the reference's order:

    - ``use_k_shift`` / ``use_v_shift``: data-dependent token shift (the reference's ``ShiftLinear``), per head
      ``k'_t = a_t k_(t-1) + (1 - a_t) k_t``, ``a_t = sigmoid(w_h . x_t)`` (``key_shift``, ``value_shift``:
      ``nn.Linear(hidden, heads)`` without bias, ``N(0, initializer_range)``), on the projected k (v alike),
      ``k_(-1) = 0``; padding is zeroed first, so a left-padded row's first token reads 0, as alone. The projected
      k|v of every token is a per-token state with the cache, ``shift_inputs``, where a step finds the token before
      it (:meth:`shifted_key_value`); the cache keeps the shifted k and v, as the reference's.
    - ``use_qk_norm``: RMSNorm of each head's q and k with a scale per head and feature (the reference's default,
      ``qk_norm_share_param_across_head=False``; ``query_norm``, ``key_norm`` ``(heads * head_dim,)``, 1 at init, eps
      :data:`FOX_QK_NORM_EPS`), after the shifts.
    - ``use_output_norm``, ``use_output_gate``: each head's output RMS-normalised (``output_norm``, 1 at init, eps
      1e-6), then times ``sigmoid(W x)`` (``output_gate``, ``nn.Linear(hidden, heads * head_dim)`` without bias,
      ``N(0, initializer_range)``), before the output projection: the normalizer's ``output_norm`` and
      ``output_gate="elementwise"`` (:func:`normed_and_gated_output`), here per layer of the scheme."""

    def __init__(
        self,
        dims: AttentionDims,
        bias_init: float = 0.0,
        *,
        use_qk_norm: bool = False,
        use_output_gate: bool = False,
        use_output_norm: bool = False,
        use_k_shift: bool = False,
        use_v_shift: bool = False,
    ):
        super().__init__()
        self.dims = dims
        self.forget_gate = nn.Linear(dims.hidden_size, dims.num_heads, bias=True)
        self.bias_init = bias_init
        width = dims.num_heads * dims.head_dim
        self.key_shift = nn.Linear(dims.hidden_size, dims.num_heads, bias=False) if use_k_shift else None
        self.value_shift = nn.Linear(dims.hidden_size, dims.num_heads, bias=False) if use_v_shift else None
        self.query_norm = nn.Parameter(torch.ones(width)) if use_qk_norm else None
        self.key_norm = nn.Parameter(torch.ones(width)) if use_qk_norm else None
        self.output_norm = nn.Parameter(torch.ones(width)) if use_output_norm else None
        self.output_gate = nn.Linear(dims.hidden_size, width, bias=False) if use_output_gate else None
        self.cache_states = ("log_forget", "shift_inputs") if use_k_shift or use_v_shift else ("log_forget",)

    def init_weights(self, initializer_range):
        init.constant_(self.forget_gate.bias, self.bias_init)
        for scale in (self.query_norm, self.key_norm, self.output_norm):
            if scale is not None:
                init.ones_(scale)
        if self.output_gate is not None:
            init.normal_(self.output_gate.weight, mean=0.0, std=initializer_range)

    def layer_tables(self, hidden_states, attention_inputs, store):
        # every head's gate, read at this rank's heads under tensor parallelism (the gradient summed over the ranks)
        logits = self.heads_read(self.forget_gate(hidden_states), dim=-1).transpose(1, 2)  # (batch, heads, q_len)
        log_forget = F.logsigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        # Both tables are results of arithmetic, never views (the score_mod capture rule), whatever the sizes.
        if store is None:
            key_cumulative = log_forget.cumsum(-1)
            query_cumulative = key_cumulative.clone()
        else:
            key_cumulative = store("log_forget", log_forget.transpose(1, 2)).transpose(1, 2).cumsum(-1)
            later = log_forget.sum(-1, keepdim=True) - log_forget.cumsum(-1)
            query_cumulative = key_cumulative[..., -1:] - later
        tables = {"fox_query_cumulative": query_cumulative, "fox_key_cumulative": key_cumulative}
        for name, shift in (("fox_key_shift", self.key_shift), ("fox_value_shift", self.value_shift)):
            if shift is not None:  # a_t, (batch, heads, q_len), in at least float32
                mix = self.heads_read(shift(hidden_states), dim=-1).transpose(1, 2)
                tables[name] = torch.sigmoid(mix.to(torch.promote_types(mix.dtype, torch.float32)))
        return tables

    def transform_qkv(self, query, key, value, attention_inputs, store):
        shifts = self.key_shift is not None or self.value_shift is not None
        if key.shape[1] != query.shape[1] and (shifts or self.query_norm is not None):
            raise ValueError(
                "fox's use_qk_norm, use_k_shift and use_v_shift have a scale or a gate per query head, as the "
                f"reference (which has no grouped-query attention); this layer has {key.shape[1]} key/value heads for "
                f"{query.shape[1]} query heads: leave those options False."
            )
        if shifts:
            key, value = self.shifted_key_value(key, value, attention_inputs, store)
        if self.query_norm is not None:
            query_scale = self.heads_read(self.query_norm.view(self.model_num_heads, -1))
            key_scale = self.heads_read(self.key_norm.view(self.model_num_heads, -1))
            query = head_rms_norm(query, query_scale, FOX_QK_NORM_EPS)
            key = head_rms_norm(key, key_scale, FOX_QK_NORM_EPS)
        return query, key, value

    def shifted_key_value(
        self, key: torch.Tensor, value: torch.Tensor, attention_inputs: AttentionInputs, store: LayerStateStore | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``k'_t = a_t k_(t-1) + (1 - a_t) k_t`` for k and v where shifted, ``(batch, heads, q_len, head_dim)``,
        computed in at least float32 as the reference's ``token_shift`` and cast back. The current tokens' k|v, zeroed
        on padding (a token that does not see itself in ``visible``), are kept through ``store``, whose rows follow
        the layer's keys, so the token before query ``i`` is row ``first_query + i - 1`` (``visible`` gives
        ``first_query``); before the first token, 0."""
        tables = attention_inputs["layer"]
        batch, heads, q_len, head_dim = key.shape
        shifted = [
            (name, states) for name, states in (("fox_key_shift", key), ("fox_value_shift", value)) if name in tables
        ]
        inputs = torch.cat([states for _, states in shifted], dim=-1)  # (batch, heads, q_len, parts * head_dim)
        visible = attention_inputs["visible"]
        first_query = None
        if visible is not None:
            first_query = first_query_index(visible)
            inputs = inputs * tokens_among_queries(visible, first_query, inputs.dtype)[:, None]
        rows = inputs
        if store is not None:
            kept = store("shift_inputs", inputs.transpose(1, 2).flatten(2))  # (batch, kv_len, heads * width)
            rows = kept.view(batch, kept.shape[1], heads, -1).transpose(1, 2)
        if first_query is None:  # no mask: every key is a token, the queries the last ones
            first_query = rows.shape[-2] - q_len
        before = first_query - 1 + torch.arange(q_len, device=key.device)
        previous = rows[..., before.clamp(min=0), :] * (before >= 0)[:, None].to(rows.dtype)
        compute_dtype = torch.promote_types(key.dtype, torch.float32)
        mixed = {}
        for index, (name, states) in enumerate(shifted):
            part = slice(index * head_dim, (index + 1) * head_dim)
            mix = tables[name][..., None]
            current, earlier = inputs[..., part].to(compute_dtype), previous[..., part].to(compute_dtype)
            mixed[name] = (mix * earlier + (1.0 - mix) * current).to(states.dtype)
        return mixed.get("fox_key_shift", key), mixed.get("fox_value_shift", value)

    def transform_output(self, output, hidden_states):
        return normed_and_gated_output(output, hidden_states, self.output_norm, self.output_gate, self)

    def score_term(self, query, key, attention_inputs, scaling, project_query_key):
        tables = attention_inputs["layer"]
        return tables["fox_query_cumulative"][..., :, None] - tables["fox_key_cumulative"][..., None, :]

    def score_mod(self, query, key, attention_inputs, scaling, project_query_key):
        query_cumulative = attention_inputs["layer"]["fox_query_cumulative"]
        key_cumulative = attention_inputs["layer"]["fox_key_cumulative"]

        def forget_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
            bias = query_cumulative[batch_idx, head_idx, q_idx] - key_cumulative[batch_idx, head_idx, kv_idx]
            return score + bias.to(score.dtype)

        return forget_score_mod


class FoX(PositionEncoding):
    """FoX, the Forgetting Transformer (Lin, Nikishin, He, Courville, ICLR 2025, eqs. (5)-(7); reference code
    ``zhixuan-lin/forgetting-transformer``, ``ForgettingAttentionLayer`` with ``fgate_type="full"``), decoder only:

    per head a forget gate from the layer's input, ``f_t = sigmoid(w_h . x_t + b_h)``, and the score bias
    ``D_ij = sum_{l=j+1..i} log f_l = c_i - c_j``, ``c = cumsum(log f)``, added to the scaled ``q_i . k_j`` of the keys
    at or before the query: a learned, data-dependent ALiBi (each token decays everything before it by its gate). The
    paper runs it with no other position encoding; ``{"type": "fox"}`` is such a model. The gates depend on the
    tokens, not on position ids, so shifting the positions changes nothing. Tokens between two others decay them
    whether or not a mask hides them: padding on either side of a row is never between two real tokens, so its gates
    reach no real token and a padded row equals the row alone; a hole inside a 2-D mask decays the keys before it.

    ``gate_bias_init`` is the gates' bias at initialisation, ``b_h``: 0 is the reference's (every gate ~1/2, so a
    key ``n`` tokens back starts ``n ln 2`` nats down, which can hold a small model on a plateau of a recall task);
    a positive bias starts the gates near 1, the decay near none: x-transformers' data-dependent ALiBi starts it at 5,
    fla's Wall attention at 8.

    FoX-Pro (the paper's section 3: QK-norm, output gate, output norm, data-dependent key/value shift) is the options
    named after the reference's flags, off by default as there: ``use_qk_norm`` (the reference's ``qk_norm``; this
    library's name for QK-norm), ``use_output_gate``, ``use_output_norm``, ``use_k_shift``, ``use_v_shift``
    (:class:`ForgetGate`). The config refuses QK-norm, an output gate or an output norm asked for twice, by the
    scheme and by the config's ``use_qk_norm`` or the normalizer's options (:meth:`attention_pieces`).

    Backends: the bias is the difference of two per-token tables (:class:`ForgetGate`): eager and SDPA add it as a
    ``(batch, heads, q_len, kv_len)`` per-layer term, FlexAttention reads the tables in its ``score_mod``; the shifts
    read which tokens are padding from the dense mask, so with them FlexAttention is refused (SDPA runs). An encoder
    form does not exist (the sums run from a key to a later query; a bidirectional decay is not in the paper): an
    encoder config raises ``ValueError``.
    """

    name = "fox"
    parallel_refusals = {
        "context": f"its forget gates are summed along the sequence: {ALONG_THE_SEQUENCE}",
        "sequence": f"its forget gates: {ALONG_THE_SEQUENCE}",
    }
    description = "Forgetting Transformer (decoder): forget gates f = sigmoid(w.x + b), bias sum_{l=j+1..i} log f_l"
    relative = True
    families = ("decoder",)
    has_layer_term = True
    # Compiled CPU FlexAttention (torch 2.13) compiles the score_mod at a first length (equal to eager: 2.7e-6) and
    # emits C++ that does not compile at a second one ("cur_qSplitSize3 was not declared"), as for tupe.
    flex_compiles_on_cpu = False
    options = {
        "gate_bias_init": Option(
            0.0,
            (float, int),
            "the gates' bias b at init, f = sigmoid(w.x + b): 0 the reference's (x-transformers 5, fla's Wall 8)",
            math.isfinite,
            "a finite number",
        ),
        "use_qk_norm": Option(False, (bool,), "FoX-Pro's QK-norm: RMSNorm of each head's q and k, a scale per head"),
        "use_output_gate": Option(False, (bool,), "FoX-Pro's output gate: each head's output times sigmoid(W x)"),
        "use_output_norm": Option(False, (bool,), "FoX-Pro's output norm: RMSNorm of each head's output"),
        "use_k_shift": Option(
            False, (bool,), "FoX-Pro's key shift: k'_t = a_t k_(t-1) + (1 - a_t) k_t, a = sigmoid(w.x)"
        ),
        "use_v_shift": Option(
            False, (bool,), "FoX-Pro's value shift: v'_t = a_t v_(t-1) + (1 - a_t) v_t, a = sigmoid(w.x)"
        ),
    }

    @classmethod
    def attention_pieces(cls, spec):
        return {piece for option, piece in FOX_PRO_PIECES.items() if spec[option]}

    @classmethod
    def supported_backends(cls, spec):
        if spec["use_k_shift"] or spec["use_v_shift"]:
            return tuple(backend for backend in cls.backends if backend != "flex_attention")
        return cls.backends

    @classmethod
    def backend_refusals(cls, spec, facts):
        """:meth:`supported_backends`' refusal of FlexAttention with a shift, with its reason."""
        refusals = super().backend_refusals(spec, facts)
        if spec["use_k_shift"] or spec["use_v_shift"]:
            refusals["flex_attention"] = (
                "its key/value shift zeroes the padding tokens, which it reads from the dense mask (a BlockMask does "
                "not say which tokens are padding)"
            )
        return refusals

    @classmethod
    def check_family(cls, spec, causal):
        if not causal:
            raise ValueError(
                "position_encoding 'fox' has no encoder form: its bias sums the forget gates of the tokens from a key "
                "to a later query (a decay of the past, Lin et al. 2025), so it runs in a decoder only (posenc_gpt2, "
                "or PosEncBertConfig(is_decoder=True))."
            )

    @classmethod
    def layer_term(cls, spec, dims, layer_idx):
        return ForgetGate(dims, spec["gate_bias_init"], **{option: spec[option] for option in FOX_PRO_OPTIONS})


def ut_transform(directions: torch.Tensor, strengths: torch.Tensor) -> torch.Tensor:
    """The UT transform of a block of Householder factors (Joffrain et al. 2006; PaTH eq. (4)): ``T = (I + diag(beta)
    stril(W W^T, -1))^(-1) diag(beta)``, lower triangular ``(..., size, size)``, so that ``H_e ... H_s = I - W^T T W``
    for the rows ``s..e`` of ``W`` ``(..., size, head_dim)`` and ``H_t = I - beta_t w_t w_t^T``."""
    size = directions.shape[-2]
    gram = torch.matmul(directions, directions.transpose(-1, -2)).tril(-1)
    solve_matrix = torch.eye(size, dtype=gram.dtype, device=gram.device) + strengths[..., :, None] * gram
    return torch.linalg.solve_triangular(solve_matrix, torch.diag_embed(strengths), upper=False, unitriangular=True)


def path_householder_term(
    query: torch.Tensor,
    key: torch.Tensor,
    directions: torch.Tensor,
    strengths: torch.Tensor,
    first_query: int,
    block_size: int,
) -> torch.Tensor:
    """PaTH's correction to ``q_i . k_j``: ``q_i^T (H_i ... H_(j+1) - I) k_j`` for ``j <= i`` (0 for ``j > i``),
    ``H_t = I - beta_t w_t w_t^T``, ``(batch, heads, q_len, kv_len)`` in ``directions``' dtype (at least float32),
    unscaled.

    ``directions`` ``w`` ``(batch, heads, kv_len, head_dim)`` (unit vectors) and ``strengths`` ``beta``
    ``(batch, heads, kv_len)`` belong to the keys; query ``i`` is the token at key index ``first_query + i``.
    Blockwise, as the reference's kernel: the keys fall in blocks of ``block_size`` (identity factors in front), each
    with its UT transform ``T`` (:func:`ut_transform`). Within a block the term is ``-((Q W^T) [s <= i]) T ((W K^T)
    [t > j])``. Across blocks each query is carried to its block's start (``u_i = q_i^T H_i ... H_start``), each key
    to its block's end (``v_j = H_end ... H_(j+1) k_j``), and the score ``u_i^T P_(I-1) ... P_(J+1) v_j`` takes one
    block product ``P = I - W^T T W`` a step, nearest block first: ``O(n^2 d)`` flops, no ``(q, k, head_dim)``
    tensor. Autocast is off inside: the solves and products run in float32 under bf16 autocast too."""
    with torch.autocast(query.device.type, enabled=False):  # float32 products under bf16 autocast too
        compute_dtype = directions.dtype
        batch, heads, q_len, _ = query.shape
        kv_len = key.shape[-2]
        pad = (-kv_len) % block_size
        start = first_query + pad
        first_block, last_block = start // block_size, (start + q_len - 1) // block_size
        lead = start - first_block * block_size
        num_keys = (last_block + 1) * block_size  # the blocks after the last query's are never read

        def in_blocks(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.unflatten(-2, (-1, block_size))  # (batch, heads, blocks, block_size, head_dim)

        keys = in_blocks(F.pad(key.to(compute_dtype), (0, 0, pad, 0))[..., :num_keys, :])
        directions = in_blocks(F.pad(directions, (0, 0, pad, 0))[..., :num_keys, :])
        strengths = F.pad(strengths, (pad, 0))[..., :num_keys].unflatten(-1, (-1, block_size))
        tail = num_keys - start - q_len
        queries = in_blocks(F.pad(query.to(compute_dtype), (0, 0, lead, tail)))
        transforms = ut_transform(directions, strengths)
        num_query_blocks, num_blocks = queries.shape[2], last_block + 1

        own = slice(first_block, None)
        reach = torch.matmul(queries, directions[:, :, own].transpose(-1, -2)).tril()  # q_i . w_s, s <= i
        weighted = torch.matmul(reach, transforms[:, :, own])
        projected = torch.matmul(directions[:, :, own], keys[:, :, own].transpose(-1, -2)).tril(-1)  # w_t . k_j, t > j
        carried_queries = queries - torch.matmul(weighted, directions[:, :, own])  # u_i
        key_reach = torch.matmul(keys, directions.transpose(-1, -2)).triu(1)  # k_j . w_t, t > j
        carried_keys = keys - torch.matmul(torch.matmul(key_reach, transforms.transpose(-1, -2)), directions)  # v_j

        # Block (query block a, key block J) at a * num_blocks + J: the pairs at one distance step by num_blocks + 1.
        blocks = [-torch.matmul(weighted, projected)]
        places = [first_block + torch.arange(num_query_blocks, device=query.device) * (num_blocks + 1)]
        for distance in range(1, num_blocks):
            count = num_blocks - max(first_block, distance)  # query blocks with a key block this far before them
            if count <= 0:
                break
            carried_queries = carried_queries[:, :, -count:]
            keys_from = num_blocks - count - distance
            reached = slice(keys_from, keys_from + count)
            scores = torch.matmul(carried_queries, carried_keys[:, :, reached].transpose(-1, -2))
            blocks.append(scores - torch.matmul(queries[:, :, -count:], keys[:, :, reached].transpose(-1, -2)))
            places.append(places[0][-count:] - distance)
            block_directions = directions[:, :, reached]
            through = torch.matmul(carried_queries, block_directions.transpose(-1, -2))
            through = torch.matmul(through, transforms[:, :, reached])
            carried_queries = carried_queries - torch.matmul(through, block_directions)  # u P_J
        term = queries.new_zeros(batch, heads, num_query_blocks * num_blocks, block_size, block_size)
        term = term.index_copy(2, torch.cat(places), torch.cat(blocks, dim=2))
        term = term.view(batch, heads, num_query_blocks, num_blocks, block_size, block_size).transpose(3, 4)
        term = term.reshape(batch, heads, num_query_blocks * block_size, num_keys)[:, :, lead : lead + q_len, pad:]
        return F.pad(term, (0, kv_len - term.shape[-1]))


class HouseholderTerm(LayerPositionTerm):
    """One layer's PaTH parameters: ``direction`` (the reference's ``w_proj``: ``hidden -> rank -> heads * head_dim``,
    two ``nn.Linear`` without bias, or one ``hidden -> heads * head_dim`` with ``w_rank=0``), ``strength``
    (``bt_proj``: ``nn.Linear(hidden, heads)`` with bias, ``beta = 2 sigmoid``), and with ``forget_gate`` a FoX
    :class:`ForgetGate` (the reference's ``g_proj``, the same module). Every ``nn.Linear`` gets the family's init
    (weight ``N(0, initializer_range)``, bias 0: fla's ``_init_weights`` alike), so every ``beta`` starts at 1.

    Per token it keeps one state with the KV cache, ``path_state``: ``w`` (``heads * head_dim``), ``beta`` (``heads``)
    and, with the forget gate, FoX's ``log f`` (``heads``), in float32 (one state, so per-layer layouts with FoX keep
    distinct cache slots)."""

    cache_states = ("path_state",)
    block_size: int = 64  # tokens per block of path_householder_term

    def __init__(self, spec: dict, dims: AttentionDims):
        super().__init__()
        self.num_heads, self.head_dim = dims.num_heads, dims.head_dim
        width = dims.num_heads * dims.head_dim
        rank = spec["w_rank"]
        if rank == 0:
            self.direction = nn.Linear(dims.hidden_size, width, bias=False)
        else:
            self.direction = nn.Sequential(
                nn.Linear(dims.hidden_size, rank, bias=False), nn.Linear(rank, width, bias=False)
            )
        self.strength = nn.Linear(dims.hidden_size, dims.num_heads, bias=True)
        self.forget_gate = ForgetGate(dims) if spec["forget_gate"] else None

    def layer_tables(self, hidden_states, attention_inputs, store):
        compute_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        batch, q_len, _ = hidden_states.shape
        # every head's directions and strengths, read at this rank's heads under tensor parallelism
        directions = self.direction(hidden_states).to(compute_dtype).view(batch, q_len, self.num_heads, -1)
        directions = self.heads_read(directions, dim=2)
        directions = directions * torch.rsqrt(directions.square().sum(-1, keepdim=True) + 1e-6)  # fla's l2_norm
        strengths = 2.0 * torch.sigmoid(self.heads_read(self.strength(hidden_states), dim=-1).to(compute_dtype))
        heads = strengths.shape[-1]  # (batch, q_len, heads)
        states = torch.cat((directions.flatten(-2), strengths), dim=-1)
        width = states.shape[-1]
        tables = {}
        if self.forget_gate is not None:
            # FoX's own tables, its log f kept in the same per-token state (one store call, one cache slot).
            def store_with_path(name, log_forget):
                nonlocal states, key_log_forget
                joined = torch.cat((states, log_forget.to(compute_dtype)), dim=-1)
                joined = joined if store is None else store("path_state", joined)
                states, key_log_forget = joined[..., :width], joined[..., width:]
                return key_log_forget

            key_log_forget = None
            tables = self.forget_gate.layer_tables(hidden_states, attention_inputs, store_with_path)
            # every key's log f as well: fla's kernel (fla_kernels.py) takes the gates, not their sums
            tables["path_log_forget"] = key_log_forget.transpose(1, 2).contiguous()
        elif store is not None:
            states = store("path_state", states)
        kv_len = states.shape[1]
        directions = states[..., : width - heads].reshape(batch, kv_len, heads, -1).transpose(1, 2)
        strengths = states[..., width - heads :].transpose(1, 2)
        return {**tables, "path_directions": directions.contiguous(), "path_strengths": strengths.contiguous()}

    def score_term(self, query, key, attention_inputs, scaling, project_query_key):
        tables = attention_inputs["layer"]
        directions, strengths = tables["path_directions"], tables["path_strengths"]
        visible = attention_inputs["visible"]
        if visible is None:  # no mask: every key is a token, the queries the last ones
            first_query = key.shape[-2] - query.shape[-2]
        else:
            # A key no query sees (padding, a hole in the mask, an unwritten static-cache row) is not a token of
            # the sequence: its H is the identity.
            strengths = strengths * visible.any(dim=-2)
            first_query = first_query_index(visible)
        arguments = (query, key, directions, strengths, first_query, self.block_size)
        if torch.is_grad_enabled():  # keep the inputs, not the blocks' products, for the backward
            term = checkpoint(path_householder_term, *arguments, use_reentrant=False)
        else:
            term = path_householder_term(*arguments)
        term = term * scaling
        if self.forget_gate is not None:
            term = term + self.forget_gate.score_term(query, key, attention_inputs, scaling, project_query_key)
        return term


def first_query_index(visible: torch.Tensor) -> int:
    """The key index of the first query, from a causal ``visible`` ``(batch|1, 1, q_len, kv_len)``: every query sees
    itself last, and the queries are consecutive tokens (the last ones, or a static cache's next rows). Rows that see
    no key (padding) do not count."""
    q_len, kv_len = visible.shape[-2:]
    last_seen = torch.where(visible, torch.arange(kv_len, device=visible.device), -1).amax(-1)
    first = int((last_seen - torch.arange(q_len, device=visible.device)).amax())
    return min(max(first, 0), kv_len - q_len)


def tokens_among_queries(visible: torch.Tensor, first_query: int, dtype: torch.dtype) -> torch.Tensor:
    """``(batch|1, q_len, 1)`` in ``dtype``: 1 where the query token sees itself (a token), 0 on padding, from a causal
    ``visible`` ``(batch|1, 1, q_len, kv_len)`` whose first query is key ``first_query``."""
    own = torch.arange(visible.shape[-2], device=visible.device)
    return visible[:, 0, own, first_query + own][..., None].to(dtype)


class PaTH(PositionEncoding):
    """PaTH, position encoding by accumulated Householder transformations (Yang, Shen, Wen, Tan, Mishra, Ren, Panda,
    Kim, NeurIPS 2025, arXiv 2505.16381; reference code flash-linear-attention ``fla/layers/path_attn.py``,
    ``PaTHAttention``), decoder only:

    ``score_ij = q_i^T H_i H_(i-1) ... H_(j+1) k_j`` (the empty product at ``j = i``), ``H_t = I - beta_t w_t w_t^T``,
    per head, with ``w_t = l2norm(W_w x_t)`` (``W_w`` low rank, ``hidden -> 32 -> heads * head_dim``, no bias) and
    ``beta_t = 2 sigmoid(W_beta x_t + b)`` in ``(0, 2)`` (negative eigenvalues allowed), ``x_t`` the layer's input; the
    score takes the layer's scaling like ``q . k``. As the reference's decoding step (``k <- k - beta (k . w) w`` on
    every cached key for each new token), a key is transformed by the Householder factor of every later token up to
    the query. ``forget_gate=True`` is PaTH-FoX (the paper's best variant; the reference's ``use_forget_gate``): plus
    FoX's bias ``sum_(l=j+1..i) log f_l`` from the same :class:`ForgetGate` as ``fox``.

    Computation, exact, blockwise as the reference's kernel, no ``(q, k, head_dim)`` tensor: with the UT transform of
    each block of 64 tokens, ``T = (I + diag(beta) stril(W W^T, -1))^(-1) diag(beta)`` (lower triangular; ``H_i ...
    H_(j+1) = I - sum_(j<t<=s<=i) w_s T_st w_t^T`` inside a block), the scores are ``Q K^T`` plus an additive
    ``(batch, heads, q, k)`` layer term (:class:`HouseholderTerm`, :func:`path_householder_term`): inside a block
    ``-((Q W^T) [s <= i]) T ((W K^T) [t > j])``, across blocks the queries carried to their block's start and the keys
    to their block's end meet through one block product ``I - W^T T W`` a step, in float32, checkpointed. Cost per head
    and layer: ``O((q + 64) k d)`` flops (``O(n^2 d)`` in training, the reference's order), ``O(q k)`` memory: the
    term, where the reference's fused Triton kernel keeps no ``(n, n)`` tensor (not built here).

    KV cache: each token's ``w``, ``beta`` (and ``log f``) are kept with the cache (``path_state``), and every forward
    applies every key's later factors from them, so cache = no cache exactly, the raw keys stay in the KV cache (the
    reference keeps the transformed keys instead). Padding: a key no query sees (padding on either side, a hole in a
    2-D mask, an unwritten row of a static cache) gets ``beta = 0``, its ``H`` the identity, so a padded row equals the
    row alone (the reference removes padding tokens, ``unpad_input``). The factors depend on the tokens, not on the
    position ids: shifting the positions changes nothing.

    Deviations from the reference: no short convolution on ``w`` (the reference's ``use_w_shortconv=True``, a causal
    depthwise convolution of width 3 before the norm): it reads the two tokens before each key, which a sliding-window
    layer's cache has evicted for its oldest keys; the directions then depend on the token alone. No q/k RMS norm (the
    reference's default ``use_qk_norm=False`` too). Backends: eager and SDPA (the term as a per-layer float mask, on
    CPU ``attention_with_learned_bias``); FlexAttention is not offered (``backends``): the term is a ``(q, k)`` tensor
    per layer, which a ``score_mod`` would only read back, so a flex request runs SDPA (logged).
    """

    name = "path"
    parallel_refusals = {
        "context": f"its Householder products run along the sequence: {ALONG_THE_SEQUENCE}",
        "sequence": f"its Householder products: {ALONG_THE_SEQUENCE}",
    }
    description = "PaTH (decoder): q_i^T H_i...H_(j+1) k_j, H_t = I - beta_t w_t w_t^T from the input; PaTH-FoX option"
    relative = True
    families = ("decoder",)
    has_layer_term = True
    backends = ("eager", "sdpa")
    options = {
        "w_rank": Option.int_at_least(
            32, "rank of the w projection hidden -> rank -> heads*head_dim (the reference's 32); 0: one full matrix", 0
        ),
        "forget_gate": Option(False, (bool,), "PaTH-FoX: add FoX's forget-gate bias sum_(l=j+1..i) log f_l"),
    }

    @classmethod
    def check_family(cls, spec, causal):
        if not causal:
            raise ValueError(
                "position_encoding 'path' has no encoder form: a key is transformed by the Householder factors of "
                "the tokens from it to a later query (Yang et al. 2025), so it runs in a decoder only (posenc_gpt2, "
                "or PosEncBertConfig(is_decoder=True))."
            )

    @classmethod
    def layer_term(cls, spec, dims, layer_idx):
        return HouseholderTerm(spec, dims)


class CoPETerm(LayerPositionTerm):
    """One layer's CoPE position embeddings ``e`` ``(head_dim, max_positions)``, shared by the heads, initialised to
    zero (as the reference's ``pos_emb``). The term is computed ``query_chunk`` queries at a time
    (:func:`in_query_chunks`)."""

    query_chunk: int | None = None  # None: by the device's chunk budget (relative_tables.chunk_elements)

    def __init__(self, spec: dict, dims: AttentionDims):
        super().__init__()
        self.position_embeddings = nn.Parameter(torch.zeros(dims.head_dim, spec["max_positions"]))

    def init_weights(self, initializer_range):
        init.zeros_(self.position_embeddings)

    def score_term(self, query, key, attention_inputs, scaling, project_query_key):
        visible = attention_inputs["visible"]

        def chunk_scores(start: int, stop: int) -> torch.Tensor:
            chunk_visible = None if visible is None else visible[..., start:stop, :]
            return cope_scores(query[..., start:stop, :], key, chunk_visible, embeddings, scaling)

        embeddings = self.read_by_all_heads(self.position_embeddings)

        return in_query_chunks(chunk_scores, (*query.shape[:-1], key.shape[-2]), query.device, self.query_chunk)


def cope_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    visible: torch.Tensor | None,
    position_embeddings: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """CoPE's term ``q_i . e[p_ij]`` ``(batch, heads, q_len, kv_len)`` for queries ``(batch, heads, q_len,
    head_dim)`` (a chunk of them), every key, ``visible`` ``(batch|1, 1, q_len, kv_len)`` or None, and ``e``
    ``(head_dim, max_positions)``; computed in at least float32."""
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    query = query.to(compute_dtype)
    gates = torch.sigmoid(torch.matmul(query * scaling, key.to(compute_dtype).transpose(-1, -2)))
    if visible is not None:
        gates = gates * visible  # masked keys (the future, padding) count nothing
    # p_ij = sum_{t >= j} g_it over visible keys, i.e. t = j..i in a decoder.
    positions = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=position_embeddings.shape[-1] - 1)
    floor = positions.floor()
    fraction, index = positions - floor, floor.long()
    # q.e[p] at every integer p, then linear between floor(p) and floor(p) + 1 (the step past the last is 0).
    integer_scores = torch.matmul(query, position_embeddings.to(compute_dtype))
    steps = nn.functional.pad(integer_scores.diff(dim=-1), (0, 1))
    return integer_scores.gather(-1, index) + fraction * steps.gather(-1, index)


class CoPE(PositionEncoding):
    """CoPE, Contextual Position Encoding (Golovneva et al. 2024, eqs. (3)-(5); reference code in the paper's
    appendix), decoder only:

    ``g_ij = sigmoid(q_i . k_j / sqrt(d))``, ``p_ij = sum_{t=j..i} g_it``, clamped to ``max_positions - 1``,
    ``e[p_ij] = (ceil(p) - p) e[floor(p)] + (p - floor(p)) e[ceil(p)]``, and ``q_i . e[p_ij]`` (unscaled) added to the
    scores. ``e`` ``(head_dim, max_positions)`` per layer, shared by the heads, zero at init. The gates read the
    layer's scaled scores with masked keys (the future, padding, unwritten cache slots) at 0, so cached keys count as
    in one forward. ``q . e`` is computed at the integer positions, ``(batch, heads, q_len, max_positions)``, then
    gathered and interpolated. An encoder form (gates counted on both sides) is not in the paper: an encoder config
    raises ``ValueError``.
    """

    name = "cope"
    parallel_refusals = {
        "context": f"its gates are summed over the keys: {ALONG_THE_SEQUENCE}",
        "sequence": ULYSSES_KERNEL_ONLY,
    }
    description = "CoPE (decoder): gates sigmoid(q_i.k_j), positions p_ij = sum_{t=j..i} g_it, interpolated q.e[p_ij]"
    relative = True
    families = ("decoder",)
    has_layer_term = True
    backends = ("eager", "sdpa")
    options = {
        "max_positions": Option.int_at_least(64, "position embeddings; contextual positions are clamped below it", 2),
    }

    @classmethod
    def layer_term(cls, spec, dims, layer_idx):
        return CoPETerm(spec, dims)
