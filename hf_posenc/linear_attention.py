"""Linear-attention layers of hybrid models: a ``"linear_attention"`` entry of ``config.layer_types`` replaces that
block's attention by a recurrent token mixer whose state lives in the KV cache (Transformers' own
``LinearAttentionLayer`` of ``cache_utils``: a convolution state and a recurrent state per layer).

The one kind now, ``gated_deltanet``, is the gated DeltaNet mixer exactly as Transformers' Qwen3-Next defines it
(``transformers/models/qwen3_next/modeling_qwen3_next.py``, ``Qwen3NextGatedDeltaNet``; Yang et al. 2025, "Gated Delta
Networks", arXiv 2412.06464): for a token ``t``

    q, k, v, z = in_proj_qkvz(x_t);  b, a = in_proj_ba(x_t)
    q, k, v    = SiLU(CausalDepthwiseConv1d(q | k | v))          (kernel ``conv_kernel_size``, no bias)
    q, k       = l2norm(q), l2norm(k);  q = q / sqrt(key_head_dim)
    beta_t     = sigmoid(b);  g_t = -exp(A_log) * softplus(a + dt_bias)
    S_t        = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T        (the gated delta rule)
    o_t        = S_t^T q_t;  y_t = out_proj(RMSNorm(o_t) * SiLU(z_t))

per value head (a key head serves ``num_value_heads / num_key_heads`` value heads). A prefill runs the chunked form of
the rule (:func:`chunk_gated_delta_rule`), a one-token decoding step the recurrent one
(:func:`recurrent_gated_delta_rule`); both are this library's torch code, written after Transformers' functions of
the same names, so a saved model loads as remote code with only transformers and torch. On CUDA with fla-core
installed, :func:`gated_delta_rule` runs each form by fla's kernel as Qwen3-Next does (``chunk_gated_delta_rule``,
``fused_recurrent_gated_delta_rule``; ``fla_kernels.fla_gated_delta_rule``); the torch rules stay the reference and
run any input those kernels do not take (warned once per reason). The short convolution stays on torch (Qwen3-Next's
``causal_conv1d`` kernels are not used). Padding tokens are zeroed before the projections (Qwen3-Next's
``apply_mask_to_padding_states``): with no bias they add nothing to the states, so a left-padded row equals the row
alone.

A second kind (Mamba2, KDA) is one more :class:`LinearAttentionKind` subclass in :data:`LINEAR_ATTENTIONS`: its
options, its module, and the same cache calls (``update_conv_state`` / ``update_recurrent_state``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init

from .absolute_encodings import padding_keep
from .fla_kernels import fla_gated_delta_rule
from .options import ALONG_THE_SEQUENCE, CatalogueEntry, Option, resolve_spec


LINEAR_ATTENTION = "linear_attention"
"""The layer type, as Transformers spells it (``config.layer_types``, read by its caches)."""


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` along ``dim`` (Transformers' Qwen3-Next ``l2norm``, as flash-linear-attention)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _heads_first(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, l2: bool
) -> tuple[torch.Tensor, ...]:
    """Grouped heads repeated, every input as float32 ``(batch, heads, seq, ...)``, q and k l2-normalised (``l2``),
    q scaled by ``1 / sqrt(key_head_dim)``."""
    num_k_heads, num_v_heads = key.shape[2], value.shape[2]
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    query, key, value, beta, g = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, g)
    )
    if l2:
        query, key = l2norm(query), l2norm(key)
    return query * query.shape[-1] ** -0.5, key, value, g, beta


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule ``S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T``,
    ``o_t = S_t^T q_t``, computed chunk by chunk (WY / UT transform within a chunk, a scan over chunks): Transformers'
    ``torch_chunk_gated_delta_rule`` (Qwen3-Next), float32 inside.

    Shapes: q, k ``(batch, seq, key_heads, key_head_dim)``, v ``(batch, seq, value_heads, value_head_dim)``, g (log
    decay, <= 0) and beta ``(batch, seq, value_heads)``, state ``(batch, value_heads, key_head_dim, value_head_dim)``.
    Returns the output ``(batch, seq, value_heads, value_head_dim)`` in q's dtype and the final state (or None)."""
    dtype = query.dtype
    batch, seq_len, _, k_dim = key.shape
    num_v_heads, v_dim = value.shape[-2:]
    query, key, value, g, beta = _heads_first(query, key, value, g, beta, use_qk_l2norm)
    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    num_chunks = (seq_len + pad) // chunk_size
    v_beta, k_beta = value * beta[..., None], key * beta[..., None]
    query, key, k_beta, v_beta = (
        x.reshape(x.shape[0], x.shape[1], num_chunks, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    )
    g = g.reshape(g.shape[0], g.shape[1], num_chunks, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum = g.cumsum(dim=3)
    pair_decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ key.transpose(-1, -2)) * pair_decay
    intra = (query @ key.transpose(-1, -2)) * pair_decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    if initial_state is None:
        state = torch.zeros(batch, num_v_heads, k_dim, v_dim, dtype=new_values.dtype, device=new_values.device)
    else:
        state = initial_state.to(new_values)
    query = query * cum.exp()[..., None]
    key = key * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outputs = []
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outputs.append(query[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    output = torch.stack(outputs, dim=2).reshape(batch, num_v_heads, -1, v_dim)[:, :, :seq_len]
    output = output.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    return output, state if output_final_state else None


def recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`chunk_gated_delta_rule` token by token (the decoding step): ``S <- exp(g_t) S``,
    ``S <- S + k_t (beta_t (v_t - S^T k_t))^T``, ``o_t = S^T q_t``; Transformers' ``torch_recurrent_gated_delta_rule``
    (Qwen3-Next). Same shapes and returns."""
    dtype = query.dtype
    batch, seq_len, _, k_dim = key.shape
    num_v_heads, v_dim = value.shape[-2:]
    query, key, value, g, beta = _heads_first(query, key, value, g, beta, use_qk_l2norm)
    if initial_state is None:
        state = torch.zeros(batch, num_v_heads, k_dim, v_dim, dtype=value.dtype, device=value.device)
    else:
        state = initial_state.to(value)
    outputs = []
    for t in range(seq_len):
        state = state * g[:, :, t].exp()[..., None, None]
        delta = (value[:, :, t] - (state * key[:, :, t, :, None]).sum(dim=-2)) * beta[:, :, t, None]
        state = state + key[:, :, t, :, None] * delta[..., None, :]
        outputs.append((state * query[:, :, t, :, None]).sum(dim=-2))
    output = torch.stack(outputs, dim=2).transpose(1, 2).contiguous().to(dtype)
    return output, state if output_final_state else None


def gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rule as a layer runs it (same shapes and returns as :func:`chunk_gated_delta_rule`, q and k l2-normalised):
    a one-token step from a state in the recurrent form, anything else in the chunked form; by fla's kernel for that
    form where :func:`fla_kernels.fla_gated_delta_rule` takes the inputs (CUDA, fla-core installed), else by this
    library's torch code."""
    step = initial_state is not None and query.shape[1] == 1
    fused = fla_gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state, step=step)
    if fused is not None:
        return fused
    rule = recurrent_gated_delta_rule if step else chunk_gated_delta_rule
    return rule(query, key, value, g, beta, initial_state=initial_state, output_final_state=output_final_state)


def recorded_steps(cache, layer_idx: int, seq_len: int) -> int:
    """How many of the current tokens' recurrent states layer ``layer_idx``'s cache records (Transformers 5.25's
    ``get_recurrent_states_to_keep``, set for assisted decoding, whose ``crop`` rolls the state back to one of
    them): 0 without a cache or where the cache records none."""
    if cache is None or not hasattr(cache, "get_recurrent_states_to_keep"):
        return 0
    return min(cache.get_recurrent_states_to_keep(layer_idx) or 0, seq_len)


class GatedRMSNorm(nn.Module):
    """``weight * RMSNorm(x) * SiLU(z)``, normalised in float32 before the gate (Qwen3-Next's
    ``Qwen3NextRMSNormGated``; weight initialised to ones)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        hidden_states = hidden_states * torch.rsqrt(
            hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon
        )
        hidden_states = self.weight * hidden_states.to(dtype)
        return (hidden_states * F.silu(gate.to(torch.float32))).to(dtype)


class LinearAttentionKind(CatalogueEntry):
    """A kind of linear-attention mixer: its options (``config.linear_attention``) and its module. Options whose
    default is None are filled from the model's sizes by :meth:`fill_defaults`."""

    kind = "linear_attention"
    families = ("decoder",)

    @classmethod
    def fill_defaults(cls, spec: dict[str, Any], hidden_size: int, num_heads: int) -> dict[str, Any]:
        return spec

    @classmethod
    def check_sizes(cls, spec: dict[str, Any], hidden_size: int) -> None:
        """``ValueError`` where the options do not fit the model."""

    @classmethod
    def build(cls, spec: dict[str, Any], hidden_size: int, layer_idx: int) -> nn.Module:
        raise NotImplementedError


class GatedDeltaNetKind(LinearAttentionKind):
    name = "gated_deltanet"
    parallel_refusals = {
        "tensor": "no tensor-parallel plan shards its heads (in_proj_qkvz, in_proj_ba, conv1d, out_proj)",
        "context": f"the delta rule's state: {ALONG_THE_SEQUENCE}",
        "sequence": f"the delta rule's state and its convolution: {ALONG_THE_SEQUENCE}",
    }
    description = (
        "Gated DeltaNet as Qwen3-Next defines it (Qwen3NextGatedDeltaNet): short causal convolution with SiLU, "
        "l2-normalised q and k, beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), the gated delta rule, "
        "a gated RMSNorm with z"
    )
    options = {
        "num_key_heads": Option.int_at_least(
            None, "q/k heads (Qwen3-Next's linear_num_key_heads; default: num_attention_heads)", 1
        ),
        "num_value_heads": Option.int_at_least(
            None, "value heads, a multiple of num_key_heads (linear_num_value_heads; default: num_key_heads)", 1
        ),
        "key_head_dim": Option.int_at_least(
            None, "q/k head size (linear_key_head_dim; default: hidden_size // num_attention_heads)", 1
        ),
        "value_head_dim": Option.int_at_least(
            None, "value head size (linear_value_head_dim; default: key_head_dim)", 1
        ),
        "conv_kernel_size": Option.int_at_least(4, "the short convolution's width (linear_conv_kernel_dim)", 2),
    }

    @classmethod
    def fill_defaults(cls, spec: dict[str, Any], hidden_size: int, num_heads: int) -> dict[str, Any]:
        spec = dict(spec)
        if spec["num_key_heads"] is None:
            spec["num_key_heads"] = num_heads
        if spec["num_value_heads"] is None:
            spec["num_value_heads"] = spec["num_key_heads"]
        if spec["key_head_dim"] is None:
            spec["key_head_dim"] = hidden_size // num_heads
        if spec["value_head_dim"] is None:
            spec["value_head_dim"] = spec["key_head_dim"]
        return spec

    @classmethod
    def check_sizes(cls, spec: dict[str, Any], hidden_size: int) -> None:
        if spec["num_value_heads"] % spec["num_key_heads"]:
            raise ValueError(
                f"linear_attention 'gated_deltanet': num_value_heads={spec['num_value_heads']} must be a multiple of "
                f"num_key_heads={spec['num_key_heads']} (each key head serves a group of value heads)."
            )

    @classmethod
    def build(cls, spec: dict[str, Any], hidden_size: int, layer_idx: int) -> nn.Module:
        return GatedDeltaNet(spec, hidden_size, layer_idx)


LINEAR_ATTENTIONS: dict[str, type[LinearAttentionKind]] = {kind.name: kind for kind in (GatedDeltaNetKind,)}
"""Kinds of linear-attention mixer by name (``config.linear_attention["type"]``)."""


def resolve_linear_attention(
    value: Any, layer_types: list[str] | None, hidden_size: int, num_heads: int, causal: bool
) -> dict[str, Any] | None:
    """``config.linear_attention`` as stored: None where ``layer_types`` has no ``"linear_attention"`` layer (a spec
    given there is refused: it would have no effect), else the full spec of :data:`LINEAR_ATTENTIONS` (None or a
    name: its defaults), the sizes filled from the model's. ``ValueError`` names a bad value and the choices."""
    has_layers = layer_types is not None and LINEAR_ATTENTION in layer_types
    if not has_layers:
        if value is not None:
            raise ValueError(
                f"linear_attention={value!r} has no effect: layer_types has no 'linear_attention' layer. Add such "
                "layers to layer_types, or leave linear_attention None."
            )
        return None
    if not causal:
        raise ValueError(
            "layer_types has 'linear_attention' layers, which are causal (the delta rule's state reads the tokens "
            "before each token only, left to right); an encoder has none. Use attention layers in an encoder."
        )
    if all(layer_type == LINEAR_ATTENTION for layer_type in layer_types):
        raise ValueError(
            "layer_types has only 'linear_attention' layers; a hybrid needs at least one attention layer "
            "(Transformers' caches count the cached tokens, which generation and the position encoding read, on "
            "attention layers)."
        )
    spec = resolve_spec("linear_attention", "gated_deltanet" if value is None else value, LINEAR_ATTENTIONS)
    kind = LINEAR_ATTENTIONS[spec["type"]]
    spec = kind.fill_defaults(spec, hidden_size, num_heads)
    kind.check_sizes(spec, hidden_size)
    return spec


def build_linear_attention(config, layer_idx: int) -> nn.Module | None:
    """Layer ``layer_idx``'s linear-attention mixer (``config.linear_attention``'s kind), or None where
    ``config.layer_types`` makes it an attention layer."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or layer_types[layer_idx] != LINEAR_ATTENTION:
        return None
    spec = config.linear_attention
    return LINEAR_ATTENTIONS[spec["type"]].build(spec, config.hidden_size, layer_idx)


def linear_keep(attention_mask: torch.Tensor | None, seq_len: int, past_length) -> torch.Tensor | None:
    """``(batch, seq)`` booleans, False on the current padding tokens, for a linear-attention layer to zero them (as
    Transformers' ``create_recurrent_attention_mask``): None for a one-token step (a generated token is never
    padding) or no mask."""
    if attention_mask is None or seq_len == 1:
        return None
    return padding_keep(attention_mask, seq_len, past_length)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's gated DeltaNet mixer (module docstring), with its parameter names: ``in_proj_qkvz``,
    ``in_proj_ba``, ``conv1d`` (depthwise, no bias), ``dt_bias``, ``A_log``, ``norm`` (gated RMSNorm), ``out_proj``.
    ``forward(hidden_states, keep, cache)``: ``keep`` ``(batch, seq)`` False on padding (zeroed first) or None;
    ``cache`` a Transformers cache whose layer ``layer_idx`` is a ``LinearAttentionLayer``, or None."""

    def __init__(self, spec: dict[str, Any], hidden_size: int, layer_idx: int, eps: float = 1e-6):
        super().__init__()
        self.hidden_size, self.layer_idx = hidden_size, layer_idx
        self.num_k_heads, self.num_v_heads = spec["num_key_heads"], spec["num_value_heads"]
        self.head_k_dim, self.head_v_dim = spec["key_head_dim"], spec["value_head_dim"]
        self.key_dim, self.value_dim = self.head_k_dim * self.num_k_heads, self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = spec["conv_kernel_size"]
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=self.conv_kernel_size,
            groups=self.conv_dim,
            bias=False,
            padding=self.conv_kernel_size - 1,
        )
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * self.num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.head_v_dim, eps=eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def init_weights(self, std: float) -> None:
        """Qwen3-Next's init (``Qwen3NextPreTrainedModel._init_weights`` after Transformers' base
        ``_init_weights``): projections and the convolution ``N(0, std)``, ``dt_bias`` ones,
        ``A_log = log(U(0.01, 16))``, the norm's weight ones."""
        for module in (self.in_proj_qkvz, self.in_proj_ba, self.out_proj, self.conv1d):
            init.normal_(module.weight, mean=0.0, std=std)
        init.ones_(self.dt_bias)
        init.copy_(self.A_log, torch.empty_like(self.A_log).uniform_(0.01, 16).log_())
        init.ones_(self.norm.weight)

    def split_projections(self, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Qwen3-Next's ``fix_query_key_value_ordering``: the projections grouped per key head, ``q|k|v|z`` and
        ``b|a`` within each group -> q, k ``(batch, seq, key_heads, key_head_dim)``, v, z ``(..., value_heads,
        value_head_dim)``, b, a ``(batch, seq, value_heads)``."""
        group = self.num_v_heads // self.num_k_heads
        qkvz = qkvz.view(*qkvz.shape[:-1], self.num_k_heads, 2 * self.head_k_dim + 2 * group * self.head_v_dim)
        ba = ba.view(*ba.shape[:-1], self.num_k_heads, 2 * group)
        sizes = [self.head_k_dim, self.head_k_dim, group * self.head_v_dim, group * self.head_v_dim]
        query, key, value, z = torch.split(qkvz, sizes, dim=3)
        b, a = torch.split(ba, [group, group], dim=3)
        value = value.reshape(*value.shape[:2], -1, self.head_v_dim)
        z = z.reshape(*z.shape[:2], -1, self.head_v_dim)
        return query, key, value, z, b.reshape(*b.shape[:2], -1), a.reshape(*a.shape[:2], -1)

    @staticmethod
    def delta_rule(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor | None,
        keep_state: bool,
        recorded: int,
    ) -> tuple[torch.Tensor, torch.Tensor | list[torch.Tensor] | None]:
        """:func:`gated_delta_rule` over the tokens from ``state`` (the final state where ``keep_state``); the state
        after each of the last ``recorded`` tokens as a list (a cache recording its past for assisted decoding, which
        crops back to one of them), as Qwen3-Next splits its forward: the tokens before them in one call, then one
        call a token."""
        if not recorded:
            return gated_delta_rule(query, key, value, g, beta, initial_state=state, output_final_state=keep_state)
        length = query.shape[1]
        split = length - recorded
        segments = [slice(0, split)] * (split > 0) + [slice(t, t + 1) for t in range(split, length)]
        outputs, states = [], []
        for segment in segments:
            parts = (tensor[:, segment] for tensor in (query, key, value, g, beta))
            output, state = gated_delta_rule(*parts, initial_state=state, output_final_state=True)
            outputs.append(output)
            states.append(state)
        return torch.cat(outputs, dim=1), states[-recorded:]

    def convolve(self, mixed: torch.Tensor, cache) -> torch.Tensor:
        """SiLU of the causal depthwise convolution of ``(batch, conv_dim, seq)``; with a cache, the
        ``conv_kernel_size`` inputs before these are read from (and these written to) the layer's conv state (its
        first use: zeros, the convolution's own padding)."""
        seq_len, weight = mixed.shape[-1], self.conv1d.weight
        if cache is None:
            out = F.conv1d(mixed.to(weight.dtype), weight, padding=self.conv_kernel_size - 1, groups=self.conv_dim)
            return F.silu(out[..., :seq_len]).to(mixed.dtype)
        # the cache prepends the inputs it keeps (a prefill: zeros) and counts the tokens, as get_seq_length reads them
        window = cache.update_conv_state(mixed, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        if window.shape[-1] < seq_len + self.conv_kernel_size - 1:
            window = F.pad(window, (seq_len + self.conv_kernel_size - 1 - window.shape[-1], 0))
        out = F.conv1d(
            window[..., -(seq_len + self.conv_kernel_size - 1) :].to(weight.dtype), weight, groups=self.conv_dim
        )
        return F.silu(out).to(mixed.dtype)

    def forward(self, hidden_states: torch.Tensor, keep: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        if keep is not None:
            hidden_states = (hidden_states * keep[:, :, None]).to(hidden_states.dtype)
        batch, seq_len = hidden_states.shape[:2]
        query, key, value, z, b, a = self.split_projections(
            self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
        )
        mixed = torch.cat([t.reshape(batch, seq_len, -1) for t in (query, key, value)], dim=-1).transpose(1, 2)
        mixed = self.convolve(mixed, cache).transpose(1, 2)
        query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch, seq_len, -1, self.head_k_dim)
        key = key.reshape(batch, seq_len, -1, self.head_k_dim)
        value = value.reshape(batch, seq_len, -1, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        state = cache.get_recurrent_state(self.layer_idx) if cache is not None else None
        recorded = recorded_steps(cache, self.layer_idx, seq_len)
        output, state = self.delta_rule(query, key, value, g, beta, state, cache is not None, recorded)
        if cache is not None:
            cache.update_recurrent_state(state, self.layer_idx)
        output = self.norm(output.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(output.reshape(batch, seq_len, -1))
