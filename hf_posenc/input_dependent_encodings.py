"""Relative schemes whose per-channel decay or rotation of ``q . k`` is computed from the layer's input, decoder only:
Wall attention (a per-channel, data-dependent decay inside ``q . k``, generalising FoX's per-head gate) and Selective
RoPE (rotation angles summed from the input instead of counted from the positions).

Each gives every attention layer a :class:`LayerPositionTerm` whose per-token states are computed from the layer's
input in ``layer_tables`` and kept with the KV cache (``cache_states``: Wall's log decays, Selective RoPE's
projected inputs and angle increments), as FoX and PaTH (``data_dependent_encodings.py``). Wall adds a ``(batch,
heads, q, k)`` term to the scores (``score_term``, PaTH's form), Selective RoPE rotates the queries and every key
after the cache (``transform_query_key``). Both depend on the tokens between a key and a query, not on position ids:
shifting the positions changes nothing.

Sources: the papers and reference implementations cited per class.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from transformers import initialization as init

from .data_dependent_encodings import ForgetGate, first_query_index, tokens_among_queries
from .options import ALONG_THE_SEQUENCE, Option
from .position_interface import AttentionDims, AttentionInputs, LayerPositionTerm, PositionEncoding


def decayed_scores_among(query: torch.Tensor, key: torch.Tensor, cumulative: torch.Tensor) -> torch.Tensor:
    """``s_ij = sum_n q_in k_jn exp(P_in - P_jn)`` for ``j <= i``, 0 for ``j > i``: ``(..., m, m)``, for the queries
    and keys ``(..., m, d)`` of the same ``m`` tokens and their cumulative log decays ``P`` ``(..., m, d)``
    (non-increasing along the tokens).

    Exact and overflow-free: every pair ``j < i`` meets through one anchor token ``t`` with ``j < t <= i``, ``s_ij =
    (q_i exp(P_i - P_t)) . (k_j exp(P_t - P_j))``, both factors at most 1. The tokens are split in halves, recursively
    (``m`` padded to a power of two, ``P`` repeated at the end): the later half's queries against the earlier half's
    keys with the later half's first token as anchor, one batched matmul a level, ``log2 m`` levels, the diagonal
    ``q_i . k_i``. ``O(m^2 d)`` flops, no ``(m, m, d)`` tensor."""
    length = query.shape[-2]
    size = 1 << max(length - 1, 0).bit_length()
    pad = (0, 0, 0, size - length)
    query, key = F.pad(query, pad), F.pad(key, pad)
    cumulative = F.pad(cumulative, pad, mode="replicate") if size > length else cumulative
    scores = torch.diag_embed((query * key).sum(-1))
    half = size // 2
    while half >= 1:
        blocks = size // (2 * half)
        queries = query.unflatten(-2, (blocks, 2, half))[..., 1, :, :]
        keys = key.unflatten(-2, (blocks, 2, half))[..., 0, :, :]
        decays = cumulative.unflatten(-2, (blocks, 2, half))
        anchor = decays[..., 1, :1, :]  # the later half's first token
        later = queries * torch.exp(decays[..., 1, :, :] - anchor)
        earlier = keys * torch.exp(anchor - decays[..., 0, :, :])
        corners = torch.matmul(later, earlier.transpose(-1, -2))  # (..., blocks, half, half)
        pairs = scores.unflatten(-1, (blocks, 2 * half)).unflatten(-3, (blocks, 2 * half))
        pairs.diagonal(dim1=-4, dim2=-2)[..., half:, :half, :] += corners.movedim(-3, -1)
        half //= 2
    return scores[..., :length, :length]


def wall_decay_term(
    query: torch.Tensor, key: torch.Tensor, cumulative: torch.Tensor, first_query: int, block_size: int
) -> torch.Tensor:
    """Wall's correction to ``q_i . k_j``: ``sum_n q_in k_jn (exp(P_in - P_jn) - 1)`` for the keys ``j`` at or before
    query ``i`` (0 elsewhere), ``(batch, heads, q_len, kv_len)``, unscaled, in ``cumulative``'s dtype (at least
    float32, autocast off inside).

    ``cumulative`` ``P`` ``(batch, heads, kv_len, head_dim)``: the keys' cumulative log decays; query ``i`` is the
    token at key index ``first_query + i``. The queries go ``block_size`` at a time (the reference's kernel tiles its
    queries alike): the keys before a block meet it through the block's first query as anchor (one matmul, both
    factors at most 1), the block's own tokens through :func:`decayed_scores_among`."""
    with torch.autocast(query.device.type, enabled=False):
        compute_dtype = cumulative.dtype
        query, key = query.to(compute_dtype), key.to(compute_dtype)
        q_len, kv_len = query.shape[-2], key.shape[-2]
        rows = []
        for start in range(0, q_len, block_size):
            stop = min(start + block_size, q_len)
            begin, end = first_query + start, first_query + stop  # the block's tokens among the keys
            block, decays = query[..., start:stop, :], cumulative[..., begin:end, :]
            pieces = []
            if begin > 0:
                anchor = decays[..., :1, :]
                earlier = key[..., :begin, :] * torch.exp(anchor - cumulative[..., :begin, :])
                pieces.append(torch.matmul(block * torch.exp(decays - anchor), earlier.transpose(-1, -2)))
            pieces.append(decayed_scores_among(block, key[..., begin:end, :], decays))
            rows.append(F.pad(torch.cat(pieces, dim=-1), (0, kv_len - end)))
        plain = torch.matmul(query, key.transpose(-1, -2))
        keys_seen = torch.arange(kv_len, device=query.device) <= first_query + torch.arange(
            q_len, device=query.device
        ).unsqueeze(-1)
        return torch.where(keys_seen, torch.cat(rows, dim=-2) - plain, 0.0)


class WallTerm(LayerPositionTerm):
    """One layer's Wall gates: ``g_proj`` (``nn.Linear(hidden, heads * head_dim)``, the reference's per-channel
    log-decay projection) and, with ``use_scalar_gate``, a FoX :class:`ForgetGate` (the reference's ``gs_proj``).
    Initialised as the reference's ``_init_weights``: weights ``N(0, initializer_range)`` (the family's), biases
    ``gate_init_bias`` (8: ``log sigmoid(8) = -3.4e-4``, near-plain attention at init).

    Per token it keeps one state with the KV cache, ``wall_state``: ``log g`` (``heads * head_dim``) and, with the
    scalar gate, FoX's ``log f`` (``heads``), in float32. Its tables give every key's ``P = cumsum(log g)`` and, for
    fla's Wall kernel (``fla_kernels.py``, which sums the gates itself), every key's ``log g`` ``(batch, kv_len,
    heads, head_dim)`` and ``log f`` ``(batch, kv_len, heads)``."""

    cache_states = ("wall_state",)
    block_size: int = 64  # queries per block of wall_decay_term

    def __init__(self, spec: dict, dims: AttentionDims):
        super().__init__()
        self.num_heads, self.head_dim = dims.num_heads, dims.head_dim
        self.gate_init_bias = spec["gate_init_bias"]
        self.g_proj = nn.Linear(dims.hidden_size, dims.num_heads * dims.head_dim, bias=True)
        self.forget_gate = ForgetGate(dims) if spec["use_scalar_gate"] else None

    def init_weights(self, initializer_range: float) -> None:
        init.constant_(self.g_proj.bias, self.gate_init_bias)
        if self.forget_gate is not None:
            init.constant_(self.forget_gate.forget_gate.bias, self.gate_init_bias)

    def layer_tables(self, hidden_states, attention_inputs, store):
        compute_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        batch, q_len, _ = hidden_states.shape
        # every head's gates, read at this rank's heads under tensor parallelism
        log_decay = F.logsigmoid(self.g_proj(hidden_states).to(compute_dtype)).view(batch, q_len, self.num_heads, -1)
        states = self.heads_read(log_decay, dim=2).flatten(-2)
        width = states.shape[-1]
        tables = {}
        if self.forget_gate is not None:
            # FoX's own tables, its log f kept in the same per-token state (one store call, one cache slot)
            def store_with_wall(name: str, log_forget: torch.Tensor) -> torch.Tensor:
                nonlocal states, key_log_forget
                joined = torch.cat((states, log_forget.to(compute_dtype)), dim=-1)
                joined = joined if store is None else store("wall_state", joined)
                states, key_log_forget = joined[..., :width], joined[..., width:]
                return key_log_forget

            key_log_forget = None
            tables = self.forget_gate.layer_tables(hidden_states, attention_inputs, store_with_wall)
            tables["wall_log_forget"] = key_log_forget  # every key's log f, (batch, kv_len, heads)
        elif store is not None:
            states = store("wall_state", states)
        kv_len = states.shape[1]
        key_log_decay = states.reshape(batch, kv_len, -1, self.head_dim)
        cumulative = key_log_decay.transpose(1, 2).cumsum(-2)
        return {**tables, "wall_log_decay": key_log_decay, "wall_cumulative": cumulative.contiguous()}

    def score_term(self, query, key, attention_inputs, scaling, project_query_key):
        cumulative = attention_inputs["layer"]["wall_cumulative"]
        visible = attention_inputs["visible"]
        first_query = key.shape[-2] - query.shape[-2] if visible is None else first_query_index(visible)
        arguments = (query, key, cumulative, first_query, self.block_size)
        if torch.is_grad_enabled():  # keep the inputs, not the levels' products, for the backward
            term = checkpoint(wall_decay_term, *arguments, use_reentrant=False)
        else:
            term = wall_decay_term(*arguments)
        term = term * scaling
        if self.forget_gate is not None:
            term = term + self.forget_gate.score_term(query, key, attention_inputs, scaling, project_query_key)
        return term


class Wall(PositionEncoding):
    """Wall attention (Tilde Research, Averbuch and Pai; reference code flash-linear-attention
    ``fla/layers/wall_attn.py``, ``WallAttention``, eager oracle ``fla/ops/wall_attn/naive.py``), decoder only:

    ``s_ij = scale sum_n q_in k_jn exp(P_in - P_jn)`` for ``j <= i``, ``P = cumsum(log g)`` along the tokens,
    ``log g_t = log sigmoid(W_g x_t + b_g)`` per head and channel (``x_t`` the layer's input): every channel of a key
    decays by the gates of the tokens after it up to the query, a per-channel FoX inside ``q . k`` (the reference works
    in base 2, ``exp2((P_i - P_j) / ln 2)``: the same number). ``use_scalar_gate`` adds FoX's per-head bias
    ``sum_(l=j+1..i) log f_l`` (the reference's FoX-style scalar gate; the same :class:`ForgetGate` as ``fox``). The
    score takes the layer's scaling like ``q . k``. Tokens between two others decay them whether or not a mask hides
    them, as in ``fox``: padding on either side of a row is never between two real tokens, so a padded row equals the
    row alone.

    Computation (:class:`WallTerm`, :func:`wall_decay_term`): exact, ``q . k`` plus a ``(batch, heads, q, k)`` term
    per layer in float32, checkpointed; each pair meets through an anchor token between them, as the reference's
    kernel anchors a block (``q exp(P_q - R)``, ``k exp(R - P_k)``, both at most 1), here recursively down to single
    tokens, so no exponent is clamped (the reference's kernel clamps its in-block key factor at ``2^110``); queries in
    blocks of 64, ``O(n^2 d)`` flops. The raw
    keys stay in the KV cache and each token's ``log g`` is kept beside them (``wall_state``), so cache = no cache
    (the reference's decode cache keeps rescaled keys instead). Backends: eager and SDPA (the term as a per-layer float
    mask, on CPU ``attention_with_learned_bias``); FlexAttention is not offered (the term is a ``(q, k)`` tensor, which
    a ``score_mod`` could only read back), so a flex request runs SDPA (logged). With softmax on CUDA, where fla-core
    is installed, SDPA's forwards that fla's fused Wall kernel computes run it instead (``fla_kernels.py``: each
    token's ``log g`` and ``log f`` as its gates; no padding or cached keys, and decays within 64 tokens short of
    its clamp).
    The reference's ``qk_norm``, ``use_output_gate`` and ``window_size`` are the config's ``use_qk_norm``, the
    normalizer's ``output_gate`` and ``layer_types`` / ``sliding_window`` here.
    """

    name = "wall"
    parallel_refusals = {
        "context": f"its decays are summed along the sequence: {ALONG_THE_SEQUENCE}",
        "sequence": f"its decays: {ALONG_THE_SEQUENCE}",
    }
    description = "Wall attention (decoder): q_i . (exp(P_i - P_j) * k_j), P = cumsum(log sigmoid(W_g x)) per channel"
    relative = True
    families = ("decoder",)
    has_layer_term = True
    backends = ("eager", "sdpa")
    options = {
        "use_scalar_gate": Option(False, (bool,), "add FoX's per-head scalar log-decay gate (the reference's option)"),
        "gate_init_bias": Option(
            8.0, (int, float), "initial bias of the gate projections: log sigmoid(8) ~ 0, near-plain attention at init"
        ),
    }

    @classmethod
    def check_family(cls, spec, causal):
        if not causal:
            raise ValueError(
                "position_encoding 'wall' has no encoder form: a key's channels decay by the gates of the tokens from "
                "it to a later query (Wall attention, fla layers/wall_attn.py), so it runs in a decoder only "
                "(posenc_gpt2, or PosEncBertConfig(is_decoder=True))."
            )

    @classmethod
    def layer_term(cls, spec, dims, layer_idx):
        return WallTerm(spec, dims)


SELECTIVE_ANGLES = ("selective", "mamba3")


def rotary_temperature(head_dim: int, temp_theta: float, temp_max: float) -> torch.Tensor:
    """Selective RoPE's per-frequency scale of the angles (the reference's ``rotary_temperature`` of type
    ``"rope"``): ``temp_max / temp_theta^(2m / head_dim)``, ``m = 0 .. head_dim / 2 - 1``, in float64."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    return temp_max / temp_theta**exponents


def rotate_half_split(states: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """``[x_0 cos - x_1 sin, x_0 sin + x_1 cos]`` of the halves ``x_0, x_1`` of ``states`` ``(..., head_dim)`` by
    ``angles`` ``(..., head_dim / 2)``, in ``angles``' dtype."""
    first, second = states.to(angles.dtype).chunk(2, dim=-1)
    cos, sin = torch.cos(angles), torch.sin(angles)
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class SelectiveRotation(LayerPositionTerm):
    """One layer's Selective RoPE parameters: ``phi_proj`` (the reference's low-rank ``nn.Linear(hidden,
    phi_proj_rank)``, ``nn.Linear(phi_proj_rank, heads * head_dim / 2)``, no biases; weights ``N(0,
    initializer_range)``, the family's init as the reference's ``_init_weights``), ``phi_conv_weight`` (the
    reference's ``ShortConvolution``: a causal depthwise convolution of width ``d_conv`` without bias, ``(heads *
    head_dim / 2, 1, d_conv)``, ``N(0, initializer_range)`` as the reference's ``nn.Conv1d`` init; absent with
    ``skip_conv``), ``phi_bias`` (``use_bias``, zeros) and ``phase_gate_proj`` (``use_gate``, ``nn.Linear(hidden,
    heads)``), ``temperature`` (``temp_grad``, its formula at init).

    Per token it keeps two states with the KV cache: ``selective_rope_inputs``, the projected ``phi`` before the
    convolution (``heads * head_dim / 2``), which the convolution of the next tokens reads, and
    ``selective_rope_increments``, its angle increments ``conv(phi)_t`` (bias and gate applied), computed when the
    token is current, so the angles of every kept key are exact where a window has evicted the tokens before it."""

    cache_states = ("selective_rope_inputs", "selective_rope_increments")

    def __init__(self, spec: dict, dims: AttentionDims):
        super().__init__()
        if dims.head_dim % 2:
            raise ValueError(
                f"position_encoding 'selective_rope' rotates pairs of features: the head size must be even, got "
                f"{dims.head_dim}."
            )
        self.dims, self.head_dim = dims, dims.head_dim
        self.skip_conv, self.use_bias, self.use_gate = spec["skip_conv"], spec["use_bias"], spec["use_gate"]
        width = dims.num_heads * dims.head_dim // 2
        self.phi_proj = nn.Sequential(
            nn.Linear(dims.hidden_size, spec["phi_proj_rank"], bias=False),
            nn.Linear(spec["phi_proj_rank"], width, bias=False),
        )
        if not self.skip_conv:
            self.phi_conv_weight = nn.Parameter(torch.empty(width, 1, spec["d_conv"]))
        if self.use_bias:
            self.phi_bias = nn.Parameter(torch.zeros(dims.num_heads, dims.head_dim // 2))
        if self.use_gate:
            self.phase_gate_proj = nn.Linear(dims.hidden_size, dims.num_heads, bias=True)
        self.temp_theta, self.temp_max = spec["temp_theta"], spec["temp_max"]
        if spec["temp_grad"]:  # the reference's temperature parameter, trained
            self.temperature = nn.Parameter(torch.empty(dims.head_dim // 2))

    def init_weights(self, initializer_range: float) -> None:
        if not self.skip_conv:
            init.normal_(self.phi_conv_weight, mean=0.0, std=initializer_range)
        if hasattr(self, "temperature"):
            init.copy_(self.temperature, rotary_temperature(self.head_dim, self.temp_theta, self.temp_max))
        if self.use_bias:
            init.zeros_(self.phi_bias)

    def layer_tables(self, hidden_states, attention_inputs, store):
        compute_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        batch, q_len, _ = hidden_states.shape
        visible = attention_inputs["visible"]
        # the input l2-normalised per head's slice of the hidden features (the reference's l2_norm, eps 1e-6)
        heads_input = hidden_states.to(compute_dtype).view(batch, q_len, self.model_num_heads, -1)
        normed = (heads_input * torch.rsqrt(heads_input.square().sum(-1, keepdim=True) + 1e-6)).flatten(-2)
        normed = normed.to(hidden_states.dtype)
        # every head's angles (and gates), read at this rank's heads under tensor parallelism
        phi = self.phi_proj(normed).to(compute_dtype).view(batch, q_len, self.model_num_heads, -1)
        phi = self.heads_read(phi, dim=2).flatten(-2)  # (batch, q_len, heads * head_dim / 2)
        # a token that does not see itself (padding) has phi = 0 and adds no angle
        first_query = 0 if visible is None else first_query_index(visible)
        if visible is not None:
            is_token = tokens_among_queries(visible, first_query, compute_dtype)  # (batch|1, q_len, 1)
            phi = phi * is_token
        inputs = phi if store is None else store("selective_rope_inputs", phi)
        if visible is None:
            first_query = inputs.shape[1] - q_len
        # the convolution of the current tokens reads the d_conv - 1 inputs before them (cached, or zeros)
        reach = 1 if self.skip_conv else self.phi_conv_weight.shape[-1] - 1
        window = inputs[:, max(first_query - reach, 0) : first_query + q_len].transpose(1, 2)
        window = F.pad(window, (reach - min(first_query, reach), 0))
        if self.skip_conv:  # the reference's first difference, summed back below: phi~_t = phi_t
            increments = window.diff(dim=-1)
        else:
            weight = self.phi_conv_weight.view(self.model_num_heads, -1, *self.phi_conv_weight.shape[1:])
            weight = self.heads_read(weight, dim=0).flatten(0, 1).to(compute_dtype)
            increments = F.conv1d(window, weight, groups=weight.shape[0])
        increments = increments.transpose(1, 2).reshape(batch, q_len, -1, self.head_dim // 2)
        if self.use_bias:
            increments = increments + torch.exp(self.heads_read(self.phi_bias, dim=0).to(compute_dtype))
        if self.use_gate:
            gate = torch.sigmoid(self.heads_read(self.phase_gate_proj(normed), dim=-1).to(compute_dtype))
            increments = increments * gate[..., None]
        increments = increments.flatten(-2)
        if visible is not None:
            increments = increments * is_token
        if store is not None:  # every kept key's increments, each computed when its token was current
            increments = store("selective_rope_increments", increments)
        if hasattr(self, "temperature"):
            temperature = self.read_by_all_heads(self.temperature)
        else:
            temperature = rotary_temperature(self.head_dim, self.temp_theta, self.temp_max)
        angles = increments.unflatten(-1, (-1, self.head_dim // 2)).cumsum(1)
        angles = (angles * temperature.to(device=angles.device, dtype=compute_dtype)).transpose(1, 2)
        return {
            "selective_rope_key_angles": angles.contiguous(),
            "selective_rope_query_angles": angles[:, :, first_query : first_query + q_len].contiguous(),
        }

    def transform_query_key(self, query, key, attention_inputs: AttentionInputs):
        tables = attention_inputs["layer"]
        rotated_query = rotate_half_split(query, tables["selective_rope_query_angles"]).to(query.dtype)
        rotated_key = rotate_half_split(key, tables["selective_rope_key_angles"]).to(key.dtype)
        return rotated_query, rotated_key


def rotate_pairs(states: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """The first ``2 A`` features of ``states`` ``(..., head_dim)`` turned in adjacent pairs ``(x_2m, x_2m+1) ->
    (x_2m cos - x_2m+1 sin, x_2m sin + x_2m+1 cos)`` by ``angles`` ``(..., A)``, the rest unchanged, in ``angles``'
    dtype (Mamba-3's ``rotate_pairwise`` layout)."""
    width = 2 * angles.shape[-1]
    pairs = states[..., :width].to(angles.dtype).unflatten(-1, (-1, 2))
    first, second = pairs[..., 0], pairs[..., 1]
    cos, sin = torch.cos(angles), torch.sin(angles)
    turned = torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1).flatten(-2)
    return torch.cat((turned, states[..., width:].to(angles.dtype)), dim=-1)


def mamba3_rotary_angles(head_dim: int, rope_fraction: float) -> int:
    """How many angles Mamba-3 turns per head: ``floor(head_dim * rope_fraction)``, made even, halved (its
    ``num_rope_angles``)."""
    split = int(head_dim * rope_fraction)
    return (split - split % 2) // 2


class Mamba3Rotation(LayerPositionTerm):
    """One layer's Mamba-3 angles (Mamba-3, Dao AI Lab and Goombalab 2026; reference ``state-spaces/mamba``
    ``mamba_ssm/modules/mamba3.py``, ``Mamba3``, its SISO path): ``angle_proj``
    (``nn.Linear(hidden, A)``, no bias, the in-projection's angle slice, one set for every head), ``dt_proj``
    (``nn.Linear(hidden, heads)``, no bias, its ``dd_dt`` slice) and ``dt_bias`` (per head, ``softplus^-1`` of a step
    drawn log-uniformly in ``[dt_min, dt_max]``, floored at ``dt_init_floor``, as the reference initialises it).

    Per token it keeps one state with the KV cache, ``mamba3_angle_increments``: ``pi tanh(angle_proj x_t)
    softplus(dt_proj x_t + dt_bias)`` per head and angle, float32, 0 on padding."""

    cache_states = ("mamba3_angle_increments",)

    def __init__(self, spec: dict, dims: AttentionDims):
        super().__init__()
        self.dims = dims
        self.num_angles = mamba3_rotary_angles(dims.head_dim, spec["rope_fraction"])
        if self.num_angles == 0:
            raise ValueError(
                f"position_encoding 'selective_rope' with angles='mamba3' turns floor(head_dim * rope_fraction / 2) "
                f"pairs: none for head size {dims.head_dim} and rope_fraction {spec['rope_fraction']}."
            )
        self.dt_range = (spec["dt_min"], spec["dt_max"], spec["dt_init_floor"])
        self.angle_proj = nn.Linear(dims.hidden_size, self.num_angles, bias=False)
        self.dt_proj = nn.Linear(dims.hidden_size, dims.num_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(dims.num_heads))

    def init_weights(self, initializer_range: float) -> None:
        dt_min, dt_max, dt_init_floor = self.dt_range
        log_span = math.log(dt_max) - math.log(dt_min)
        dt = torch.exp(torch.rand(self.dt_bias.shape) * log_span + math.log(dt_min)).clamp(min=dt_init_floor)
        init.copy_(self.dt_bias, dt + torch.log(-torch.expm1(-dt)))

    def layer_tables(self, hidden_states, attention_inputs, store):
        compute_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        q_len = hidden_states.shape[1]
        visible = attention_inputs["visible"]
        step = self.heads_read(self.dt_proj(hidden_states).to(compute_dtype), dim=-1)
        step = F.softplus(step + self.heads_read(self.dt_bias, dim=0).to(compute_dtype))  # (batch, q_len, heads)
        angles = math.pi * torch.tanh(self.read_by_all_heads(self.angle_proj(hidden_states).to(compute_dtype)))
        increments = (step[..., None] * angles[:, :, None, :]).flatten(-2)  # (batch, q_len, heads * angles)
        first_query = 0 if visible is None else first_query_index(visible)
        if visible is not None:  # padding adds no angle
            increments = increments * tokens_among_queries(visible, first_query, compute_dtype)
        if store is not None:
            increments = store("mamba3_angle_increments", increments)
        if visible is None:
            first_query = increments.shape[1] - q_len
        angles = increments.unflatten(-1, (-1, self.num_angles)).cumsum(1).transpose(1, 2)  # inclusive sums
        return {
            "mamba3_key_angles": angles.contiguous(),
            "mamba3_query_angles": angles[:, :, first_query : first_query + q_len].contiguous(),
        }

    def transform_query_key(self, query, key, attention_inputs: AttentionInputs):
        tables = attention_inputs["layer"]
        rotated_query = rotate_pairs(query, tables["mamba3_query_angles"]).to(query.dtype)
        rotated_key = rotate_pairs(key, tables["mamba3_key_angles"]).to(key.dtype)
        return rotated_query, rotated_key


class SelectiveRoPE(PositionEncoding):
    """Selective RoPE (Movahedi, Carstensen, Afzal, Hutter, Orvieto, Cevher, ICLR 2026, arXiv 2511.17388; reference
    code ``timurcarstensen/selective-rope``, ``modules/rotary.py`` ``SelectiveRoPE`` as its softmax ``Attention``
    applies it), decoder only:

    per head and frequency ``m`` an angle summed from the input, ``phi~_t = sum_(s<=t) conv(phi)_s``, ``phi_t =
    W_2 W_1 l2norm(x_t)`` (``x_t`` the layer's input, normalised per head's slice, ``W_1`` of rank ``phi_proj_rank``),
    ``conv`` causal and depthwise of width ``d_conv`` (``skip_conv``: none, ``phi~_t = phi_t``), plus ``exp(b)`` per
    token with ``use_bias``, times a per-head ``sigmoid`` phase gate with ``use_gate``; q and k rotated as RoPE's
    halves by ``theta_tm = temp_max temp_theta^(-2m/d) phi~_tm``, so ``q_i . k_j`` turns by ``theta_i - theta_j``, the
    sum of the tokens' angles between them: a learned, input-dependent RoPE (``use_bias`` with a zero projection is
    RoPE of base ``temp_theta``). Defaults are the reference class's (``temp_type="rope"``, ``temp_theta`` 500000,
    rank 16, ``d_conv`` 4, fixed temperature; ``temp_grad`` trains it, one per frequency and layer, as the
    reference's parameter).

    Computation (:class:`SelectiveRotation`): the raw keys stay in the KV cache and each token's ``phi`` and angle
    increment beside them (two states, each computed when its token is current); every forward sums the kept
    increments and rotates the queries and every key after the cache (``transform_query_key``, float32), so cache = no
    cache, with windowed layers too (where every layer is windowed the widest window must keep the ``d_conv - 1``
    tokens the convolution reads), and shifting the positions changes nothing. A token that does not see itself
    (padding) has ``phi = 0`` and no increment, so a padded row equals the row alone. Backends: eager and SDPA (q and k
    are rotated before the kernel, nothing is added to the scores: SDPA's causal kernel, no float mask); FlexAttention
    would run the same rotated q and k, but is not offered (not checked on CUDA here), so a flex request runs SDPA.
    Not built: the reference's ``temp_type="rfa"``, ``phi_parametrization="full-rank"``, ``conv_act``,
    the low-rank and GLA phase gates, its Triton kernels.

    ``angles="mamba3"``: Mamba-3's data-dependent rotary angles (reference ``state-spaces/mamba``
    ``mamba_ssm/modules/mamba3.py`` and ``ops/triton/mamba3/angle_dt.py``, the SISO layout) on q and k: ``theta_thm =
    pi sum_(s<=t) softplus(W_dt x_s + b_dt)_h tanh(W_theta x_s)_m`` (inclusive sums; the kernel's ``mod 2 pi`` only
    bounds the float), ``W_theta`` shared by the heads, the step ``softplus(.)`` per head (its ``b_dt`` drawn as the
    reference draws ``dt_bias``), turning adjacent pairs ``(x_2m, x_2m+1)`` of the first ``2 floor(head_dim
    rope_fraction / 2)`` features (:class:`Mamba3Rotation`); there the rotation turns Mamba's B and C, here k and q,
    and the step also sets Mamba's decay, which attention has no place for. Its options ``rope_fraction``, ``dt_min``,
    ``dt_max``, ``dt_init_floor``; the other variant's options are refused with a value other than their default."""

    name = "selective_rope"
    parallel_refusals = {
        "context": f"its angles are summed along the sequence: {ALONG_THE_SEQUENCE}",
        "sequence": f"its angles: {ALONG_THE_SEQUENCE}",
    }
    description = (
        "Selective RoPE (decoder): q, k rotated by temp_m * cumsum(conv(W l2norm(x))), angles summed from the input; "
        "angles='mamba3': by pi * cumsum(softplus(W_dt x + b) * tanh(W x)), Mamba-3's"
    )
    relative = True
    families = ("decoder",)
    has_layer_term = True
    backends = ("eager", "sdpa")
    options = {
        "angles": Option.one_of(
            "selective",
            "selective: Selective RoPE's (conv, temperature); mamba3: Mamba-3's (step times pi tanh)",
            SELECTIVE_ANGLES,
        ),
        "phi_proj_rank": Option.int_at_least(16, "rank of the angle projection hidden -> rank -> heads*head_dim/2", 1),
        "skip_conv": Option(False, (bool,), "no causal convolution of the projected angles (phi~_t = phi_t)"),
        "d_conv": Option.int_at_least(4, "width of the causal depthwise convolution of the projected angles", 1),
        "temp_theta": Option(
            500000.0,
            (int, float),
            "base of the per-frequency temperature temp_max / temp_theta^(2m/d)",
            lambda v: v >= 1,
            ">= 1",
        ),
        "temp_max": Option(1.0, (int, float), "the largest temperature (frequency 0)", lambda v: v > 0, "> 0"),
        "temp_grad": Option(False, (bool,), "train the per-frequency temperature (starts at its formula)"),
        "use_bias": Option(
            False, (bool,), "add exp(b) to every token's angles (b learned per head and frequency, 0 at init)"
        ),
        "use_gate": Option(False, (bool,), "scale every token's angles by a per-head sigmoid phase gate of the input"),
        "rope_fraction": Option(
            0.5,
            (int, float),
            "mamba3: the fraction of each head's features turned (the reference's kernels take 0.5 or 1)",
            lambda v: 0 < v <= 1,
            "0 < x <= 1",
        ),
        "dt_min": Option(1e-3, (int, float), "mamba3: the smallest initial step", lambda v: v > 0, "> 0"),
        "dt_max": Option(0.1, (int, float), "mamba3: the largest initial step", lambda v: v > 0, "> 0"),
        "dt_init_floor": Option(1e-4, (int, float), "mamba3: the initial steps' floor", lambda v: v > 0, "> 0"),
    }
    mamba3_options = ("rope_fraction", "dt_min", "dt_max", "dt_init_floor")

    @classmethod
    def check_spec(cls, spec):
        mamba3 = spec["angles"] == "mamba3"
        for key, option in cls.options.items():
            if key != "angles" and (key in cls.mamba3_options) != mamba3 and spec[key] != option.default:
                raise ValueError(
                    f"position_encoding 'selective_rope': option {key!r}={spec[key]!r} has no effect with "
                    f"angles={spec['angles']!r} (it is an option of angles="
                    f"{'selective' if mamba3 else 'mamba3'!r})."
                )
        if spec["dt_min"] > spec["dt_max"]:
            raise ValueError(
                f"position_encoding 'selective_rope': dt_min {spec['dt_min']} must be at most dt_max {spec['dt_max']}."
            )

    @classmethod
    def check_family(cls, spec, causal):
        if not causal:
            raise ValueError(
                "position_encoding 'selective_rope' has no encoder form: its angles are summed over the tokens from a "
                "key to a later query (Selective RoPE, arXiv 2511.17388), so it runs in a decoder only (posenc_gpt2, "
                "or PosEncBertConfig(is_decoder=True))."
            )

    @classmethod
    def past_tokens_read(cls, spec):
        if spec["angles"] == "mamba3":
            return 0
        return 1 if spec["skip_conv"] else spec["d_conv"] - 1

    @classmethod
    def layer_term(cls, spec, dims, layer_idx):
        return Mamba3Rotation(spec, dims) if spec["angles"] == "mamba3" else SelectiveRotation(spec, dims)
