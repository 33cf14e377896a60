"""GRAPE, group representational position encoding (Zhang, Chen, Liu, Qin, Yuan, Xu, Gu, Yao, ICLR 2026, arXiv
2512.07805; reference code ``model-architectures/GRAPE``, ``model/llama-mha-grape-*.py``), decoder only.

One catalogue entry, ``grape``, with the reference's three families as ``variant``:

* ``m``, multiplicative (``SO(d)``): q and k rotated in RoPE's planes by learned frequencies, the angle of token
  ``t`` either its position times the frequency (``llama-mha-grape-m-nonctx.py``, ``MSGRAPECommuting``) or, with
  ``contextual``, a phase summed from the layer's input (``llama-mha-grape-m-ctx.py``, ``MSGRAPEContextType1``);
* ``a``, additive (the unipotent lift): ALiBi's distance penalty with a rate gated by the query and / or the key
  (``llama-mha-grape-a-{querykey,query,key}gated.py``);
* ``ap``, the additive path form (``llama-mha-grape-ap-v1.py``): a FoX-like sum of log-sigmoid gates over the tokens
  between key and query, each gate read by the query.

Every variant is a :class:`LayerPositionTerm` of each attention layer (the reference's parameters are per layer):
``m`` rotates the queries and every key after the KV cache (``transform_query_key``; the contextual phases' per-token
increments kept with the cache), ``a`` and ``ap`` add a ``(batch, heads, q, k)`` term to the scaled scores
(``score_term``; ``ap`` keeps each token's rotated positional vector with the cache).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init

from .data_dependent_encodings import first_query_index, tokens_among_queries
from .input_dependent_encodings import rotate_half_split
from .options import ALONG_THE_SEQUENCE, Option
from .position_interface import AttentionDims, AttentionInputs, LayerPositionTerm, PositionEncoding
from .score_bias_encodings import alibi_slopes


GRAPE_VARIANTS = ("m", "a", "ap")
ADDITIVE_GATES = ("query_key", "query", "key")
AP_ROTARY_BASE = 1.0  # the reference's Rotary(p_head_dim, base=1): every pair of p turns by t radians at position t


def softplus_inverse(value: float) -> float:
    """``x`` with ``softplus(x) = value`` (``value > 0``): ``log(expm1(value))``."""
    return math.log(math.expm1(value))


def inverse_frequencies(dim: int, base: float) -> torch.Tensor:
    """RoPE's spectrum ``base^(-2m / dim)``, ``m = 0 .. dim / 2 - 1``, float32 (the reference's ``inv_freq``)."""
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


def rotate_as_reference(states: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """GRAPE's ``apply_rotary_emb``: ``[x_0 cos + x_1 sin, -x_0 sin + x_1 cos]`` of the halves ``x_0, x_1`` of
    ``states`` by ``angles`` ``(..., dim / 2)`` (a turn by ``-angles`` in RoPE's rotate-half convention), in
    ``angles``' dtype."""
    return rotate_half_split(states, -angles)


def check_even_head_dim(dims: AttentionDims) -> None:
    if dims.head_dim % 2:
        raise ValueError(
            f"position_encoding 'grape' variant 'm' rotates pairs of features: the head size must be even, got "
            f"{dims.head_dim}."
        )


class GrapeRotation(LayerPositionTerm):
    """One layer's GRAPE-M (non-contextual, the reference's ``MSGRAPECommuting``): ``log_freq``, the frequencies'
    logarithms times ``log_freq_scale`` (the reference's learning-rate trick: ``freq = exp(log_freq /
    log_freq_scale)``), ``(head_dim / 2,)`` shared by the heads or ``(heads, head_dim / 2)``, at init RoPE's
    log-uniform spectrum of ``base``. Token ``t`` at position ``p_t`` is turned by ``p_t freq_m`` in plane ``m``."""

    frequency_scale_key = "log_freq_scale"

    def __init__(self, spec: dict, dims: AttentionDims):
        super().__init__()
        check_even_head_dim(dims)
        self.dims, self.head_dim, self.base = dims, dims.head_dim, spec["base"]
        self.frequency_scale = spec[self.frequency_scale_key] if self.frequency_scale_key else 1.0
        half = dims.head_dim // 2
        self.log_freq = nn.Parameter(torch.empty((half,) if spec["share_across_heads"] else (dims.num_heads, half)))

    def init_weights(self, initializer_range: float) -> None:
        log_init = inverse_frequencies(self.head_dim, self.base).log() * self.frequency_scale
        init.copy_(self.log_freq, log_init.expand_as(self.log_freq))

    def frequencies(self) -> torch.Tensor:
        """``(heads|1, head_dim / 2)``, at least float32: ``exp(log_freq / frequency_scale)``, at this rank's heads."""
        log_freq = self.log_freq.to(torch.promote_types(self.log_freq.dtype, torch.float32)) / self.frequency_scale
        if log_freq.dim() == 1:
            return torch.exp(self.read_by_all_heads(log_freq))[None]
        return torch.exp(self.heads_read(log_freq, dim=0))

    def angles(self, attention_inputs: AttentionInputs, side: str) -> torch.Tensor:
        """``(batch|1, heads|1, n, head_dim / 2)``, at least float32: the queries' (``side="query"``) or the keys'
        angles."""
        frequencies = self.frequencies()
        positions = attention_inputs[f"{side}_positions"].to(frequencies.dtype)
        return positions[:, None, :, None] * frequencies[:, None, :]

    def transform_query_key(self, query, key, attention_inputs: AttentionInputs):
        rotated_query = rotate_as_reference(query, self.angles(attention_inputs, "query")).to(query.dtype)
        rotated_key = rotate_as_reference(key, self.angles(attention_inputs, "key")).to(key.dtype)
        return rotated_query, rotated_key


class GrapeContextualRotation(GrapeRotation):
    """One layer's contextual GRAPE-M (the reference's ``MSGRAPEContextType1`` and its attention's ``omega_proj``):
    the frequencies as :class:`GrapeRotation`'s, unscaled (the reference stores ``log_freq`` as it is), and
    ``phase_proj`` (``nn.Linear(hidden, 1)``, or ``heads`` with ``per_head_phase``; weight 0, bias
    ``softplus^-1(phase_init)`` as the reference initialises it). Token ``t`` adds ``w_t = sigmoid((W x_t + b) /
    log_freq_scale)`` to the phase, ``Phi_t = sum_(s<t) w_s`` (exclusive), and is turned by ``Phi_t freq_m``.

    Per token it keeps one state with the KV cache, ``grape_phase_increments``: ``w_t``, float32, 0 on padding."""

    cache_states = ("grape_phase_increments",)
    frequency_scale_key = None

    def __init__(self, spec: dict, dims: AttentionDims):
        super().__init__(spec, dims)
        self.phase_scale, self.phase_init = spec["log_freq_scale"], spec["phase_init"]
        self.phase_proj = nn.Linear(dims.hidden_size, dims.num_heads if spec["per_head_phase"] else 1, bias=True)

    def init_weights(self, initializer_range: float) -> None:
        super().init_weights(initializer_range)
        init.zeros_(self.phase_proj.weight)
        init.constant_(self.phase_proj.bias, softplus_inverse(self.phase_init))

    def layer_tables(self, hidden_states, attention_inputs, store):
        compute_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        q_len = hidden_states.shape[1]
        increments = torch.sigmoid(self.phase_proj(hidden_states).to(compute_dtype) / self.phase_scale)
        if increments.shape[-1] > 1:  # one phase per head: this rank's heads
            increments = self.heads_read(increments, dim=-1)
        visible = attention_inputs["visible"]
        first_query = 0 if visible is None else first_query_index(visible)
        if visible is not None:  # padding adds no phase
            increments = increments * tokens_among_queries(visible, first_query, compute_dtype)
        if store is not None:
            increments = store("grape_phase_increments", increments)
        if visible is None:
            first_query = increments.shape[1] - q_len
        phases = (increments.cumsum(1) - increments).transpose(1, 2)  # (batch, heads|1, kv_len), exclusive sums
        return {
            "grape_key_phases": phases.contiguous(),
            "grape_query_phases": phases[:, :, first_query : first_query + q_len].contiguous(),
        }

    def angles(self, attention_inputs: AttentionInputs, side: str) -> torch.Tensor:
        phases = attention_inputs["layer"][f"grape_{side}_phases"]
        return phases[..., None] * self.frequencies()[:, None, :]


class GrapeAdditiveBias(LayerPositionTerm):
    """One layer's GRAPE-A (the reference's ``QueryKeyGatedAdditiveBias`` and its query- and key-gated forms):
    ``omega`` ``(heads,)`` (``softplus(omega)`` starts at ``omega_init``), the gate directions ``query_direction``
    (the reference's ``v``) and ``key_direction`` (``u``), ``(heads, head_dim)``, ``N(0, 1/head_dim)`` at init and
    L2-normalised when read (eps 1e-6); the heads' ALiBi slopes fixed."""

    def __init__(self, spec: dict, dims: AttentionDims):
        super().__init__()
        self.dims, self.omega_init = dims, spec["omega_init"]
        self.omega = nn.Parameter(torch.empty(dims.num_heads))
        gated_by = spec["gate"]
        shape = (dims.num_heads, dims.head_dim)
        self.query_direction = nn.Parameter(torch.empty(shape)) if gated_by in ("query_key", "query") else None
        self.key_direction = nn.Parameter(torch.empty(shape)) if gated_by in ("query_key", "key") else None

    def init_weights(self, initializer_range: float) -> None:
        init.constant_(self.omega, softplus_inverse(self.omega_init))
        for direction in (self.query_direction, self.key_direction):
            if direction is not None:
                init.normal_(direction, mean=0.0, std=1.0 / math.sqrt(self.dims.head_dim))

    def gate(self, states: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """``softplus(d_h . x / sqrt(head_dim))`` of ``states`` ``(batch, heads, n, head_dim)``, ``d`` the unit
        direction: ``(batch, heads, n)``, at least float32."""
        compute_dtype = torch.promote_types(states.dtype, torch.float32)
        unit = F.normalize(self.heads_read(direction, dim=0).to(compute_dtype), dim=-1, eps=1e-6)
        return F.softplus((states.to(compute_dtype) * unit[:, None, :]).sum(-1) / math.sqrt(states.shape[-1]))

    def score_term(self, query, key, attention_inputs, scaling, project_query_key):
        compute_dtype = torch.promote_types(query.dtype, torch.float32)
        query_positions, key_positions = attention_inputs["query_positions"], attention_inputs["key_positions"]
        distance = (query_positions[:, None, :, None] - key_positions[:, None, None, :]).clamp(min=0)
        slopes = self.heads_read(alibi_slopes(self.model_num_heads).to(query.device, compute_dtype), dim=0)
        rate = F.softplus(self.heads_read(self.omega, dim=0).to(compute_dtype)) * slopes  # (heads,)
        gates = torch.zeros((), device=query.device, dtype=compute_dtype)
        if self.query_direction is not None:
            gates = gates + self.gate(query, self.query_direction)[..., None]
        if self.key_direction is not None:
            gates = gates + self.gate(key, self.key_direction)[..., None, :]
        return -distance.to(compute_dtype) * rate[:, None, None] * gates


class GrapePathGates(LayerPositionTerm):
    """One layer's GRAPE-AP (the reference's ``llama-mha-grape-ap-v1.py``, ``p_tie_mode='none'``): ``p_proj``
    (``nn.Linear(hidden, heads * p_head_dim)``, no bias, the family's init as the reference's model init), the heads'
    ALiBi slopes fixed.

    Per token it keeps one state with the KV cache, ``grape_rotated_p``: ``R_t rmsnorm(p_t)``, the token's positional
    vector normalised (no weight) and turned by its position ``t`` (base 1, the reference's rotation), float32."""

    cache_states = ("grape_rotated_p",)

    def __init__(self, spec: dict, dims: AttentionDims):
        super().__init__()
        self.dims, self.p_head_dim = dims, spec["p_head_dim"]
        self.p_proj = nn.Linear(dims.hidden_size, dims.num_heads * self.p_head_dim, bias=False)

    def layer_tables(self, hidden_states, attention_inputs, store):
        compute_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        batch, q_len, _ = hidden_states.shape
        p = self.p_proj(hidden_states).to(compute_dtype).view(batch, q_len, self.model_num_heads, self.p_head_dim)
        p = self.heads_read(p, dim=2)  # (batch, q_len, heads, p_head_dim)
        positions = attention_inputs["query_positions"].to(compute_dtype)  # the current tokens'
        angles = positions[:, :, None, None] * inverse_frequencies(self.p_head_dim, AP_ROTARY_BASE).to(p.device)
        rotated = rotate_as_reference(F.rms_norm(p, (self.p_head_dim,)), angles.to(compute_dtype)).flatten(-2)
        if store is not None:
            rotated = store("grape_rotated_p", rotated)
        rotated = rotated.unflatten(-1, (-1, self.p_head_dim))
        return {"grape_p": p.transpose(1, 2).contiguous(), "grape_rotated_p": rotated.transpose(1, 2).contiguous()}

    def score_term(self, query, key, attention_inputs, scaling, project_query_key):
        tables, visible = attention_inputs["layer"], attention_inputs["visible"]
        p, rotated = tables["grape_p"], tables["grape_rotated_p"]
        q_len, kv_len = p.shape[-2], rotated.shape[-2]
        first_query = kv_len - q_len if visible is None else first_query_index(visible)
        slopes = self.heads_read(alibi_slopes(self.model_num_heads).to(p.device, p.dtype), dim=0)
        # log gate of token t read by query i, for the tokens up to the query itself
        log_gates = F.logsigmoid(torch.matmul(p, rotated.transpose(-1, -2)) / self.p_head_dim) * slopes[:, None, None]
        own = first_query + torch.arange(q_len, device=p.device)
        up_to_query = torch.arange(kv_len, device=p.device) <= own[:, None]
        log_gates = torch.where(up_to_query, log_gates, 0.0)
        # sum over t = j+1 .. i: the suffix sums of the gates, shifted by one key (no difference of large sums)
        suffix = log_gates.flip(-1).cumsum(-1).flip(-1)
        return torch.where(up_to_query, F.pad(suffix[..., 1:], (0, 1)), 0.0)


class Grape(PositionEncoding):
    """GRAPE (Zhang et al., ICLR 2026, arXiv 2512.07805; reference code ``model-architectures/GRAPE``), decoder only,
    three variants (``variant``):

    * ``m`` (GRAPE-M): ``q_i . k_j`` with q and k turned in RoPE's planes, ``R(-theta_t)`` per plane (the reference's
      sign), ``theta_tm = p_t freq_m`` with learned per-layer frequencies ``freq = exp(log_freq / log_freq_scale)``
      started at RoPE's spectrum of ``base`` (fixed frequencies make it RoPE); ``contextual``: ``theta_tm = Phi_t
      freq_m``, ``Phi_t = sum_(s<t) sigmoid((W x_s + b) / log_freq_scale)`` from the layer's input ``x``, W = 0 and
      ``b = softplus^-1(phase_init)`` at init (the reference's code applies ``sigmoid`` to the logits divided by
      ``grape_ctx_omega_scale``, which defaults to ``grape_log_freq_scale`` 16, so every token starts at ``w =
      sigmoid(-0.43) = 0.39``, not at the 1e-3 its comment names; the frequencies are not rescaled there).
    * ``a`` (GRAPE-A): ``b_ij = -(i - j) softplus(omega_h) m_h (softplus(v_h . q_i / sqrt(d)) + softplus(u_h . k_j /
      sqrt(d)))`` with unit ``u_h``, ``v_h`` and ALiBi's slopes ``m_h``; ``gate`` keeps both terms (``query_key``, the
      paper's Eq. add_bias_querykeygated) or one.
    * ``ap`` (GRAPE-AP): ``b_ij = m_h sum_(t=j+1..i) log sigmoid(p_i . R_t rmsnorm(p_t) / d_p)``, ``p = W_p x`` of
      ``p_head_dim`` per head, ``R_t`` RoPE's rotation of base 1 at position ``t`` (the reference's sign): FoX's
      forget-gate sum with each gate read by the query. The key's rotation reads its position while the query's ``p_i``
      is not rotated, so, as in the reference, this variant is not shift invariant.

    ``a`` and ``ap`` add to the scaled scores, as the reference adds them to SDPA's mask. Differences from the
    reference models: their attention applies a learnable RMSNorm to q and k (here the config's ``use_qk_norm``, off
    by default) and the model's init draws every matrix from ``N(0, 0.5 / sqrt(hidden))``, the family's init here;
    their KV-shift and the AP's ``p_tie_mode`` are not built.

    Computation: ``m`` rotates the queries and every key after the KV cache (``transform_query_key``, float32), so the
    cache keeps the keys as projected and a contextual token's increment is kept beside it; ``a`` is computed from q
    and the cached keys and positions, no state; ``ap`` keeps each token's ``R_t rmsnorm(p_t)``, its ``(batch, heads,
    q, k)`` gate matrix summed along the keys by suffix sums in float32. Backends: eager and SDPA (``a``, ``ap``: the
    term as a per-layer float mask, on CPU ``attention_with_learned_bias``; ``m``: q and k rotated before the kernel,
    nothing added); FlexAttention is not offered, so a flex request runs SDPA (logged)."""

    name = "grape"
    parallel_refusals = {
        "context": f"its contextual phases and AP gates are summed along the sequence: {ALONG_THE_SEQUENCE}",
        "sequence": f"its phases and gates: {ALONG_THE_SEQUENCE}",
    }
    description = (
        "GRAPE (decoder): m: RoPE planes with learned frequencies (contextual: phases summed from the input); "
        "a: -(i-j) w_h m_h (softplus(v.q_i) + softplus(u.k_j)); ap: m_h sum_(j<t<=i) log sigmoid(p_i . R_t p_t / d_p)"
    )
    relative = True
    relative_unless = "variant 'ap'"
    families = ("decoder",)
    has_layer_term = True
    backends = ("eager", "sdpa")
    options = {
        "variant": Option.one_of(
            "m", "m: multiplicative (rotations), a: additive (gated ALiBi), ap: additive path", GRAPE_VARIANTS
        ),
        "contextual": Option(
            False, (bool,), "m: angles from phases summed from the input (GRAPE-M ctx), not positions"
        ),
        "base": Option(
            10000.0, (int, float), "m: base of the frequencies' RoPE spectrum at init", lambda v: v > 1, "> 1"
        ),
        "log_freq_scale": Option(
            16.0,
            (int, float),
            "m: freq = exp(log_freq / log_freq_scale) (the reference's lr trick); contextual: divides the phase "
            "gate's "
            "logits instead",
            lambda v: v > 0,
            "> 0",
        ),
        "share_across_heads": Option(True, (bool,), "m: one frequency spectrum for every head (False: one per head)"),
        "per_head_phase": Option(False, (bool,), "m, contextual: one phase per head (False: one per token)"),
        "phase_init": Option(
            1e-3,
            (int, float),
            "m, contextual: the phase gate's bias starts at softplus^-1 of it",
            lambda v: v > 0,
            "> 0",
        ),
        "gate": Option.one_of("query_key", "a: what gates the distance penalty's rate", ADDITIVE_GATES),
        "omega_init": Option(
            1.0, (int, float), "a: softplus(omega), the rate per ALiBi slope, starts at it", lambda v: v > 0, "> 0"
        ),
        "p_head_dim": Option.int_at_least(8, "ap: size of the positional projection per head (even)", 2),
    }
    variant_options = {
        "m": ("base", "log_freq_scale", "share_across_heads"),
        "a": ("gate", "omega_init"),
        "ap": ("p_head_dim",),
    }
    contextual_options = ("per_head_phase", "phase_init")

    @classmethod
    def check_spec(cls, spec):
        variant = spec["variant"]
        read = {"variant", *cls.variant_options[variant]}
        if variant == "m":
            read.add("contextual")
            if spec["contextual"]:
                read.update(cls.contextual_options)
        for key, option in cls.options.items():
            if key not in read and spec[key] != option.default:
                raise ValueError(
                    f"position_encoding 'grape': option {key!r}={spec[key]!r} has no effect with variant {variant!r}"
                    f"{' and contextual=False' if key in cls.contextual_options and variant == 'm' else ''}; "
                    f"variant {variant!r} reads {sorted(read - {'variant'})}."
                )
        if spec["p_head_dim"] % 2:
            raise ValueError(
                f"position_encoding 'grape': option 'p_head_dim' must be even (its pairs are rotated), got "
                f"{spec['p_head_dim']}."
            )

    @classmethod
    def is_relative(cls, spec):
        return spec["variant"] != "ap"

    @classmethod
    def check_family(cls, spec, causal):
        if not causal:
            raise ValueError(
                "position_encoding 'grape' has no encoder form: the reference is a causal LM whose additive variants "
                "sum over the tokens from a key to a later query and whose contextual phases are summed along the "
                "tokens (GRAPE, arXiv 2512.07805), so it runs in a decoder only (posenc_gpt2, or "
                "PosEncBertConfig(is_decoder=True)); for RoPE in an encoder use 'rope'."
            )

    @classmethod
    def layer_term(cls, spec, dims, layer_idx):
        if spec["variant"] == "a":
            return GrapeAdditiveBias(spec, dims)
        if spec["variant"] == "ap":
            return GrapePathGates(spec, dims)
        return GrapeContextualRotation(spec, dims) if spec["contextual"] else GrapeRotation(spec, dims)
