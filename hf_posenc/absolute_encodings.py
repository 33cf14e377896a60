"""Absolute and input-side position encodings: the position enters through the ``embed`` hook only.

Sources: Su Jianlin, "Transformer position encodings" (kexue.fm/archives/8130), and the papers cited per class.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init

from .options import ALONG_THE_SEQUENCE, UNDECLARED_PARALLELISM, Option
from .position_interface import EmbeddingInputs, PositionEncoding


def check_table_positions(position_ids: torch.Tensor, limit: int, kind: str, ways_past: str) -> None:
    """Raise ``ValueError`` on a negative position, or one at or past the ``limit`` of a ``kind`` table, naming
    ``ways_past`` the limit."""
    if torch.compiler.is_compiling():
        return
    if int(position_ids.min()) < 0:
        raise ValueError(f"Position ids must be >= 0 for a {kind} table; got {int(position_ids.min())}.")
    if int(position_ids.max()) >= limit:
        raise ValueError(
            f"Position {int(position_ids.max())} is outside the {kind} position table of {limit} positions "
            f"(0..{limit - 1}). {ways_past}"
        )


def check_even_hidden_size(scheme: str, hidden_size: int, why: str) -> None:
    """Raise ``ValueError`` for an odd ``hidden_size`` of a scheme that pairs features (``why``)."""
    if hidden_size % 2:
        raise ValueError(f"{scheme} needs an even hidden_size ({why}); got {hidden_size}.")


EXTEND_OR_SWITCH = (
    "Use hf_posenc.extend_positions(model, max_positions) to lengthen the table, or a scheme without a length limit "
    "(rope, t5, alibi, sinusoidal)."
)


class LearnedAbsolute(PositionEncoding):
    """Trainable absolute table added to the input: ``x_k + p_k`` (BERT, GPT-2). Parameters: ``table``
    ``(max_positions, hidden)``. Positions at or past ``max_positions`` raise a ``ValueError``."""

    name = "learned"
    parallel_refusals = {}
    description = "trainable absolute position table added to the input (BERT/GPT-2 default)"
    options = {
        "max_positions": Option.int_at_least(None, "table length (default: max_position_embeddings)", 1),
    }

    @classmethod
    def max_length(cls, spec):
        return spec["max_positions"]

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        self.table = nn.Embedding(spec["max_positions"] or dims.max_positions, dims.input_size)

    def embed(self, inputs: EmbeddingInputs) -> torch.Tensor:
        position_ids = inputs.position_ids
        check_table_positions(position_ids, self.table.num_embeddings, "learned", EXTEND_OR_SWITCH)
        return inputs.inputs_embeds + self.table(position_ids)


def sinusoidal_table(position_ids: torch.Tensor, dim: int, base: float) -> torch.Tensor:
    """Vaswani et al. 2017: ``p_(k,2i) = sin(k / base^(2i/d))``, ``p_(k,2i+1) = cos(k / base^(2i/d))``.

    ``position_ids`` ``(batch, seq)`` -> ``(batch, seq, dim)`` in float32.
    """
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=position_ids.device) / dim)
    angles = position_ids[..., None].float() * inv_freq
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[..., :dim]


class SinusoidalAbsolute(PositionEncoding):
    """Fixed sin/cos table added to the input (Vaswani et al. 2017, "Attention Is All You Need"); no length limit."""

    name = "sinusoidal"
    parallel_refusals = {}
    description = "fixed sin/cos absolute table added to the input (Vaswani et al. 2017)"
    options = {"base": Option(10000.0, (float, int), "wavelength base", lambda v: v > 1, "a number > 1")}

    def embed(self, inputs: EmbeddingInputs) -> torch.Tensor:
        table = sinusoidal_table(inputs.position_ids, self.dims.input_size, self.spec["base"])
        return inputs.inputs_embeds + table.to(inputs.inputs_embeds.dtype)


def attention_temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama 4's query temperature at ``positions`` (any shape): ``1 + attn_scale * log(floor((pos + 1) /
    floor_scale) + 1)`` (``Llama4TextAttention``, from Nakanishi 2025, arXiv 2501.19399), in float32; 1 below
    position ``floor_scale - 1``."""
    return 1.0 + attn_scale * torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale))


class NoPosition(PositionEncoding):
    """NoPE: no position information; a decoder still sees order through its causal mask.

    With ``attn_temperature_tuning`` the queries are scaled by :func:`attention_temperature` of their position, as
    Llama 4 does on its NoPE layers (defaults ``floor_scale`` 8192, ``attn_scale`` 0.1, Llama 4's), so that
    attention stays sharp over long contexts. Llama 4 reads the cache position ``past + arange(seq)``; here the
    query's position id, which equals it on the model's default positions and counts real tokens only under left
    padding (as every scheme here does). Off by default: ``none`` is NoPE, shift-invariant."""

    name = "none"
    parallel_refusals = {}
    description = "no position information (NoPE); optionally Llama 4's query temperature"
    relative = True
    relative_unless = "attn_temperature_tuning"
    options = {
        "attn_temperature_tuning": Option(
            False, (bool,), "scale queries by 1 + attn_scale log(floor((pos + 1) / floor_scale) + 1) (Llama 4)"
        ),
        "floor_scale": Option(8192.0, (float, int), "positions per temperature step", lambda v: v > 0, "a number > 0"),
        "attn_scale": Option(0.1, (float, int), "strength of the temperature", lambda v: v >= 0, "a number >= 0"),
    }

    @classmethod
    def is_relative(cls, spec):
        """Shift-invariant unless ``attn_temperature_tuning`` (the temperature reads the query's position)."""
        return not spec["attn_temperature_tuning"]

    def transform_qkv(self, query, key, value, tables):
        if not self.spec["attn_temperature_tuning"]:
            return query, key, value
        return query * tables["query_temperature"].to(query.dtype), key, value

    def prepare(self, query_positions, key_positions, backend, consecutive=False):
        if not self.spec["attn_temperature_tuning"]:
            return {}
        scale = attention_temperature(query_positions, self.spec["floor_scale"], self.spec["attn_scale"])
        return {"query_temperature": scale[:, None, :, None]}


class MultiplicativeAbsolute(PositionEncoding):
    """Multiplicative absolute positions: ``x_k * p_k`` (elementwise) instead of ``x_k + p_k`` (kexue.fm/archives/8130
    "乘性", after zhuanlan.zhihu.com/p/183234823).

    ``table="learned"``: ``p`` is a trainable ``(max_positions, hidden)`` table initialised
    ``N(1, initializer_range)``, so that ``x * p`` starts near ``x`` and keeps the embedding scale; positions past
    its length raise.
    ``table="sinusoidal"``: ``p_k = 1 + PE_k`` with ``PE`` the fixed sin/cos table (:func:`sinusoidal_table`), a gain
    around 1 that zeroes no component (``PE`` alone would zero every sin component at position 0).
    """

    name = "multiplicative"
    parallel_refusals = {"context": UNDECLARED_PARALLELISM, "sequence": UNDECLARED_PARALLELISM}
    description = "x_k * p_k (elementwise) instead of x_k + p_k; p learned (init near 1) or 1 + sin/cos"
    options = {
        "table": Option.one_of("learned", "'learned' or 'sinusoidal'", ("learned", "sinusoidal")),
        "max_positions": Option.int_at_least(None, "learned table length (default: max_position_embeddings)", 1),
        "base": Option(
            10000.0, (float, int), "wavelength base of the sinusoidal table", lambda v: v > 1, "a number > 1"
        ),
    }

    @classmethod
    def unused_options(cls, spec):
        if spec["table"] == "sinusoidal":
            return {"max_positions": "table='sinusoidal' has no length limit (max_positions sizes the learned table)"}
        return {}

    @classmethod
    def max_length(cls, spec):
        return spec["max_positions"] if spec["table"] == "learned" else None

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        if spec["table"] == "learned":
            self.table = nn.Embedding(spec["max_positions"] or dims.max_positions, dims.input_size)

    def init_weights(self, std: float) -> None:
        if self.spec["table"] == "learned":
            init.normal_(self.table.weight, mean=1.0, std=std)

    def position_gains(self, position_ids: torch.Tensor) -> torch.Tensor:
        """``p_k`` for ``position_ids`` ``(batch, seq)`` -> ``(batch, seq, hidden)``."""
        if self.spec["table"] == "sinusoidal":
            return 1 + sinusoidal_table(position_ids, self.dims.input_size, self.spec["base"])
        check_table_positions(position_ids, self.table.num_embeddings, "multiplicative", EXTEND_OR_SWITCH)
        return self.table(position_ids)

    def embed(self, inputs: EmbeddingInputs) -> torch.Tensor:
        return inputs.inputs_embeds * self.position_gains(inputs.position_ids).to(inputs.inputs_embeds.dtype)


def hierarchical_positions(table: torch.Tensor, position_ids: torch.Tensor, alpha: float) -> torch.Tensor:
    """Hierarchical decomposition (Su, kexue.fm/archives/7947), 0-indexed: with ``n`` trained rows ``p``,
    ``u_i = (p_i - alpha p_0) / (1 - alpha)`` and ``q_(i n + j) = alpha u_i + (1 - alpha) u_j``.

    Positions below ``n`` read ``p`` itself (bit-exact; equal by the formula); positions reach up to ``n^2 - 1``.
    ``table`` ``(n, hidden)``, ``position_ids`` any shape of ints in ``[0, n^2)`` -> ``(*position_ids.shape, hidden)``.
    The one implementation behind the ``hierarchical`` scheme and ``extend_positions(method="hierarchical")``.
    """
    n = table.shape[0]
    basis = (table - alpha * table[:1]) / (1 - alpha)
    decomposed = alpha * basis[position_ids // n] + (1 - alpha) * basis[position_ids % n]
    trained = table[position_ids.clamp(max=n - 1)]
    return torch.where((position_ids < n)[..., None], trained, decomposed)


class HierarchicalAbsolute(PositionEncoding):
    """A learned table of ``n`` rows added to the input, read at any position below ``n^2`` by the hierarchical
    decomposition of kexue.fm/archives/7947 (:func:`hierarchical_positions`): positions below ``n`` give exactly
    the learned rows, so it trains as ``learned`` does and reads ``n^2`` positions. Parameters: ``table``
    ``(max_positions, hidden)``, initialised ``N(0, initializer_range)`` like BERT's table."""

    name = "hierarchical"
    parallel_refusals = {"context": UNDECLARED_PARALLELISM, "sequence": UNDECLARED_PARALLELISM}
    description = "learned table read past its length n (up to n^2) by hierarchical decomposition (kexue 7947)"
    options = {
        "max_positions": Option.int_at_least(None, "learned rows n (default: max_position_embeddings)", 2),
        "alpha": Option(0.4, (float, int), "weight of the high digit", lambda v: 0 < v < 1, "a number in (0, 1)"),
    }

    @classmethod
    def max_length(cls, spec):
        return None if spec["max_positions"] is None else spec["max_positions"] ** 2

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        self.table = nn.Embedding(spec["max_positions"] or dims.max_positions, dims.input_size)

    def embed(self, inputs: EmbeddingInputs) -> torch.Tensor:
        n = self.table.num_embeddings
        ways_past = f"It reads n^2 positions for n = {n} learned rows: set a larger max_positions, or use a scheme "
        check_table_positions(inputs.position_ids, n * n, "hierarchical", ways_past + "without a length limit.")
        return inputs.inputs_embeds + hierarchical_positions(
            self.table.weight, inputs.position_ids, self.spec["alpha"]
        )


def complex_order_embeddings(
    embeddings: torch.Tensor, frequencies: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """Complex Order at position ``k``: ``r e^{i(omega k + theta)} = (r e^{i theta}) e^{i omega k}``.

    ``embeddings`` ``(batch, seq, 2 D)`` hold each token's complex vector at position 0, ``r e^{i theta}``, as
    ``[real ; imaginary]`` halves ``[a ; b]``; ``frequencies`` ``(batch, seq, D)`` its ``omega``; ``position_ids``
    ``(batch|1, seq)``. Returns ``[a cos(omega k) - b sin(omega k) ; a sin(omega k) + b cos(omega k)]``, the real and
    imaginary parts at position ``k``, ``(batch, seq, 2 D)``.
    """
    real, imaginary = embeddings.float().chunk(2, dim=-1)
    angles = frequencies.float() * position_ids[..., None].float()
    cos, sin = angles.cos(), angles.sin()
    rotated = torch.cat((real * cos - imaginary * sin, real * sin + imaginary * cos), dim=-1)
    return rotated.to(embeddings.dtype)


class ComplexOrder(PositionEncoding):
    """Complex Order (Wang et al. ICLR 2020, "Encoding word order in complex embeddings"): word ``j`` at position
    ``k`` is ``r_j e^{i(omega_j k + theta_j)}`` in ``C^D``, ``D = hidden_size / 2`` (:func:`complex_order_embeddings`).

    Realised in the real-valued model: the first ``D`` features are the real parts, the last ``D`` the imaginary
    parts. The model's own token embedding is the word's complex vector at position 0, ``r_j e^{i theta_j}`` in that
    ``[real ; imaginary]`` layout, so amplitude ``r_j`` and phase ``theta_j`` are its polar coordinates (one per
    complex feature) and tied output embeddings keep working; the scheme adds the per-word frequencies
    ``frequencies`` ``(vocab_size, D)``, resized with the token embedding (``resize_token_tables``) and initialised
    to the sinusoidal frequencies ``10000^(-2d / hidden)`` for every word (so it starts as a sinusoidal rotation of
    each word vector). In BERT the hook's input is word + token-type embedding: the token type is part of the
    position-0 vector. Needs the token ids; the paper's complex-valued layers are not built (the layers are real).
    """

    name = "complex_order"
    parallel_refusals = {"context": UNDECLARED_PARALLELISM, "sequence": UNDECLARED_PARALLELISM}
    description = "Complex Order: per-word amplitude, frequency, phase; r*e^{i(omega*k+theta)} as real and imaginary"
    base = 10000.0

    @classmethod
    def check_sizes(cls, spec, hidden_size, max_position_embeddings):
        check_even_hidden_size("complex_order", hidden_size, "real and imaginary halves")

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        self.check_sizes(spec, dims.input_size, dims.max_positions)
        self.frequencies = nn.Parameter(torch.empty(dims.vocab_size, dims.input_size // 2))

    def initial_frequencies(self, num_tokens: int) -> torch.Tensor:
        exponents = torch.arange(0, self.dims.input_size, 2, dtype=torch.float32) / self.dims.input_size
        return (self.base**-exponents).expand(num_tokens, -1)

    def init_weights(self, std: float) -> None:
        init.copy_(self.frequencies, self.initial_frequencies(self.frequencies.shape[0]))

    def resize_token_tables(self, num_tokens: int) -> None:
        old = self.frequencies
        if num_tokens == old.shape[0]:
            return
        new = self.initial_frequencies(num_tokens).to(device=old.device, dtype=old.dtype).clone()
        kept = min(num_tokens, old.shape[0])
        new[:kept] = old.detach()[:kept]
        self.frequencies = nn.Parameter(new, requires_grad=old.requires_grad)

    def embed(self, inputs: EmbeddingInputs) -> torch.Tensor:
        if inputs.input_ids is None:
            raise ValueError(
                "position_encoding 'complex_order' reads each token's frequencies by its id and needs input_ids; "
                "the model got inputs_embeds only."
            )
        frequencies = self.frequencies[inputs.input_ids]
        return complex_order_embeddings(inputs.inputs_embeds, frequencies, inputs.position_ids)


def padding_keep(attention_mask: torch.Tensor | None, seq_len: int, past_length) -> torch.Tensor | None:
    """``(batch, seq)`` booleans, False on the padding tokens among the current ``seq_len`` ones, or None.

    A 2-D mask covers the cached and current tokens (its last ``seq_len`` columns are the current ones). A 4-D mask
    (boolean, True = visible, or additive float) has no padding flag: a token that no query may attend counts as
    padding; its current tokens are the key columns ``past_length .. past_length + seq_len - 1``.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        return attention_mask[:, -seq_len:].bool()
    if attention_mask.dtype == torch.bool:
        visible = attention_mask
    else:
        visible = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    columns = past_length + torch.arange(seq_len, device=attention_mask.device)
    return visible.any(dim=-2)[:, 0, columns]


class ConvAbsolute(PositionEncoding):
    """Position from zero padding: ``x + DWConv(x)``, a depthwise convolution over the sequence with zero padding
    (Islam et al. ICLR 2020, "How Much Position Information Do Convolutional Neural Networks Encode?"; the residual
    form is Chu et al. 2023's conditional position encoding). The zeros beyond each end tell a token how far the
    boundary is, up to ``kernel_size - 1`` tokens away; the position ids are not read.

    Encoder: ``(kernel_size - 1) // 2`` zeros on the left, the rest on the right. Decoder: ``kernel_size - 1`` zeros
    on the left only, so token ``t`` reads tokens ``t - kernel_size + 1 .. t``. Padding tokens (2-D mask, or tokens no
    query attends in a 4-D mask) are zeroed before the convolution, so a padded row equals the row alone. With a KV
    cache, every token's (zeroed) input is kept as the per-token cache state ``"conv_inputs"``; a decoding step reads
    the ``kernel_size - 1`` tokens before its own (by the cached length, so a static cache's unwritten rows are never
    read, less the tokens a window evicted: where every layer is windowed the state is kept as the widest window
    keeps its keys, which must hold them: ``check_layer_windows``) and convolves without padding. Parameters:
    ``conv`` (``hidden`` channels, one group each), initialised as Transformers initialises a convolution
    (``N(0, initializer_range)``, zero bias).
    """

    name = "conv"
    parallel_refusals = {
        "context": f"its convolution: {ALONG_THE_SEQUENCE}",
        "sequence": f"its convolution: {ALONG_THE_SEQUENCE}",
    }
    description = "x + depthwise convolution with zero padding: position leaks from the padding (causal in a decoder)"
    options = {"kernel_size": Option.int_at_least(3, "convolution width", 2)}
    cache_states = ("conv_inputs",)

    @classmethod
    def past_tokens_read(cls, spec):
        return spec["kernel_size"] - 1

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        hidden, width = dims.input_size, spec["kernel_size"]
        self.conv = nn.Conv1d(hidden, hidden, width, groups=hidden)
        left = width - 1 if dims.causal else (width - 1) // 2
        self.padding = (left, width - 1 - left)

    def convolve(self, window: torch.Tensor) -> torch.Tensor:
        """``(batch, length + kernel_size - 1, hidden)`` -> ``(batch, length, hidden)``, no padding."""
        return self.conv(window.transpose(1, 2)).transpose(1, 2)

    def embed(self, inputs: EmbeddingInputs) -> torch.Tensor:
        x = inputs.inputs_embeds
        seq_len, width = x.shape[1], self.spec["kernel_size"]
        past_length = inputs.cache.cache.get_seq_length() if inputs.cache is not None else 0
        keep = padding_keep(inputs.attention_mask, seq_len, past_length)
        if keep is not None:
            x = x * keep[..., None].to(x.dtype)
        if inputs.cache is None:
            return inputs.inputs_embeds + self.convolve(F.pad(x, (0, 0, *self.padding)))
        kept_from = inputs.cache.kept_from(inputs.cache.state_slot("conv_inputs", self), seq_len)
        stored = inputs.cache.append_state("conv_inputs", x, self)
        tokens = past_length + torch.arange(1 - width, seq_len, device=x.device)
        window = stored[:, (tokens - kept_from).clamp(min=0)] * (tokens >= 0)[None, :, None].to(x.dtype)
        return inputs.inputs_embeds + self.convolve(window)


def fresh_float32(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in float32 in newly allocated memory. The sequential schemes multiply matrices by single vectors,
    and CPU matrix-vector kernels round differently with the data's alignment: a loaded (memory-mapped) weight would
    give other last bits than the one saved, breaking the exact save/load round trip."""
    return weight.float().clone()


class GeneratedTable(PositionEncoding):
    """Base of the schemes whose table is generated in sequence (a recurrence, an ODE) rather than stored: each
    forward generates rows ``0 .. L - 1`` once, ``L`` the largest position id + 1, and adds ``table[position]``.

    In eval with gradients off (``generate``, pipelines) the table is kept with a copy of the parameters it was
    generated from, and reused while every parameter still equals its copy (same dtype, device and values) and no
    longer input arrives. The values are compared, not a version counter: fused optimizers
    (``torch.optim.AdamW(fused=True)``, Transformers' ``Trainer`` default) and ``p.data`` writes change a parameter
    without bumping ``p._version``. The comparison reads each weight once, about ``1 / L`` of generating the table.
    It is never kept while gradients are recorded, so no autograd graph outlives its forward.
    Subclasses define :meth:`generate_table`.
    """

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        self.cached_table: tuple[tuple[torch.Tensor, ...], torch.Tensor] | None = None

    def generate_table(self, length: int) -> torch.Tensor:
        """Rows ``p_0 .. p_(length - 1)`` in float32, ``(length, hidden)``."""
        raise NotImplementedError

    def cache_is_current(self, length: int) -> bool:
        """The kept table has ``length`` rows or more and was generated from the parameters' current values."""
        if self.cached_table is None or len(self.cached_table[1]) < length:
            return False
        generated_from, parameters = self.cached_table[0], tuple(self.parameters())
        return len(generated_from) == len(parameters) and all(
            kept.dtype == p.dtype and kept.device == p.device and kept.shape == p.shape and torch.equal(kept, p)
            for kept, p in zip(generated_from, parameters, strict=True)
        )

    def generate_float32_table(self, length: int) -> torch.Tensor:
        """:meth:`generate_table` with autocast off: the recurrence or solver runs in float32 under bf16 autocast
        too (autocast would run its matrix products in bf16 against float32 states)."""
        with torch.autocast(next(self.parameters()).device.type, enabled=False):
            return self.generate_table(length)

    def position_table(self, length: int) -> torch.Tensor:
        if self.training or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return self.generate_float32_table(length)
        if not self.cache_is_current(length):
            parameters = tuple(p.detach().clone() for p in self.parameters())
            self.cached_table = (parameters, self.generate_float32_table(length))
        return self.cached_table[1][:length]

    def table_length(self, position_ids: torch.Tensor) -> int:
        """The largest position + 1; under ``torch.compile``, where the data cannot size a tensor,
        ``max_position_embeddings`` (the index of a position past it fails its bounds check)."""
        if torch.compiler.is_compiling():
            return self.dims.max_positions
        if int(position_ids.min()) < 0:
            raise ValueError(f"Position ids must be >= 0 for {self.name!r}; got {int(position_ids.min())}.")
        return int(position_ids.max()) + 1

    def embed(self, inputs: EmbeddingInputs) -> torch.Tensor:
        table = self.position_table(self.table_length(inputs.position_ids))
        return inputs.inputs_embeds + table[inputs.position_ids].to(inputs.inputs_embeds.dtype)


RECURRENT_CELLS = ("gru", "tanh")


def recurrence_rows(initial, weight, bias, length: int, cell: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``p_0 .. p_(L-1)`` of ``p_(k+1) = f(W p_k + b)`` (:class:`RecurrentAbsolute`'s cells), ``(L, hidden)``, and
    the GRU's gates per step (what the backward reads; empty for ``tanh``)."""
    rows, gates = [initial], []
    for _ in range(length - 1):
        pre = F.linear(rows[-1], weight, bias)
        if cell == "tanh":
            rows.append(torch.tanh(pre))
            continue
        reset_pre, update_pre, candidate_pre = pre.chunk(3)
        reset, update = reset_pre.sigmoid(), update_pre.sigmoid()
        candidate = torch.tanh(reset * candidate_pre)
        gates.append(torch.cat((reset, update, candidate, candidate_pre)))
        rows.append(torch.lerp(candidate, rows[-1], update))
    table = torch.stack(rows)
    return table, torch.stack(gates) if gates else table[:0]


def recurrence_gradients(grad_table, weight, table, gates, cell: str) -> tuple[torch.Tensor, ...]:
    """Backpropagation through time of :func:`recurrence_rows`: the gradients of ``p_0``, ``W`` and ``b``."""
    pre_grads = grad_table.new_zeros(table.shape[0] - 1, weight.shape[0])
    carry = torch.zeros_like(table[0])  # dLoss/dp_k through the later steps
    for k in range(table.shape[0] - 1, 0, -1):
        grad = grad_table[k] + carry
        if cell == "tanh":
            pre_grads[k - 1] = grad * (1 - table[k].square())
            carry = weight.T @ pre_grads[k - 1]
            continue
        reset, update, candidate, candidate_pre = gates[k - 1].chunk(4)
        grad_candidate = grad * (1 - update) * (1 - candidate.square())
        grad_reset = grad_candidate * candidate_pre * reset * (1 - reset)
        grad_update = grad * (table[k - 1] - candidate) * update * (1 - update)
        pre_grads[k - 1] = torch.cat((grad_reset, grad_update, grad_candidate * reset))
        carry = grad * update + weight.T @ pre_grads[k - 1]
    return grad_table[0] + carry, pre_grads.T @ table[:-1], pre_grads.sum(0)


class CapturedLoop:
    """A function of fixed-shape CUDA tensors recorded once as a CUDA graph and replayed: an unrolled loop of
    thousands of small kernels becomes one launch from the host, the same kernels on the GPU (so the numbers are the
    uncaptured loop's). Each call copies its inputs into the graph's own, replays, and returns copies of the outputs,
    so nothing a caller keeps (autograd's saved tensors included) is overwritten by a later call. Captured as
    torch's CUDA-graph notes prescribe: a warm-up run on a side stream first."""

    def __init__(self, function: Callable[..., tuple[torch.Tensor, ...]], inputs: tuple[torch.Tensor, ...]):
        self.inputs = tuple(tensor.clone() for tensor in inputs)
        self.outputs = self.capture(function)

    def capture(self, function) -> tuple[torch.Tensor, ...]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            function(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):  # the backward's: autograd's thread
            return function(*self.inputs)

    def replay(self) -> None:
        self.graph.replay()

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for kept, tensor in zip(self.inputs, inputs, strict=True):
            kept.copy_(tensor)
        self.replay()
        return tuple(output.clone() for output in self.outputs)


CAPTURED_LOOPS: dict[tuple, CapturedLoop] = {}
"""The captured loops by (function, settings, device, shapes), the :data:`CAPTURED_LOOPS_KEPT` latest: a graph
keeps its own memory pool, so a run whose lengths change every batch keeps a few, not one per length."""
CAPTURED_LOOPS_KEPT = 4


def captures_loops(tensor: torch.Tensor) -> bool:
    """Whether :func:`run_loop` replays a CUDA graph for ``tensor``'s loop: a real CUDA tensor (not a fake one, as
    ``torch.compile`` traces), outside a capture and a compile."""
    return (
        tensor.device.type == "cuda"
        and not isinstance(tensor, torch._subclasses.FakeTensor)
        and not torch.compiler.is_compiling()
        and not torch.cuda.is_current_stream_capturing()
    )


def run_loop(function, inputs: tuple[torch.Tensor, ...], **settings) -> tuple[torch.Tensor, ...]:
    """``function(*inputs, **settings)``: on CUDA through a :class:`CapturedLoop` per settings (the length) and
    input shapes, elsewhere as is."""
    if not captures_loops(inputs[0]):
        return function(*inputs, **settings)
    shapes = tuple((tuple(tensor.shape), tensor.dtype) for tensor in inputs)
    key = (function.__name__, tuple(sorted(settings.items())), inputs[0].device, shapes)
    loop = CAPTURED_LOOPS.pop(key, None)
    if loop is None:
        loop = CapturedLoop(partial(function, **settings), inputs)
        while len(CAPTURED_LOOPS) >= CAPTURED_LOOPS_KEPT:
            CAPTURED_LOOPS.pop(next(iter(CAPTURED_LOOPS)))
    CAPTURED_LOOPS[key] = loop  # the most recent last
    return loop(*inputs)


class UnrolledRecurrence(torch.autograd.Function):
    """``p_0 .. p_(L-1)`` of ``p_(k+1) = f(W p_k + b)`` (:class:`RecurrentAbsolute`'s cells), ``(L, hidden)``, with
    a hand-written backward through time. Autograd would record about ten small nodes per step and add an outer
    product into ``W``'s gradient at every step, which on a CPU (worst with several threads) costs far more than the
    forward; here ``dW`` is one matrix product of the per-step pre-activation gradients and the states. On CUDA
    the unrolled forward and backward are each replayed as a CUDA graph captured once per length
    (:func:`run_loop`): one launch from the host instead of about 8 (forward) and 15 (backward) per step."""

    @staticmethod
    def forward(ctx, initial, weight, bias, length: int, cell: str):
        table, gates = run_loop(recurrence_rows, (initial, weight, bias), length=length, cell=cell)
        ctx.cell = cell
        ctx.save_for_backward(weight, table, gates)
        return table

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_table):
        weight, table, gates = ctx.saved_tensors
        grad_table = grad_table.contiguous()
        grads = run_loop(recurrence_gradients, (grad_table, weight, table, gates), cell=ctx.cell)
        return *grads, None, None


class RecurrentAbsolute(GeneratedTable):
    """Recurrent absolute positions (kexue.fm/archives/8130 "递归式"): a learned ``p_0`` and ``p_(k+1) = f(p_k)``,
    added to the input; unrolled once per forward (:class:`GeneratedTable`, :class:`UnrolledRecurrence`).

    ``cell="tanh"``: ``f(p) = tanh(W p + b)`` (an Elman cell with no input). ``cell="gru"``: a GRU cell with no
    input, ``[a_r; a_z; a_n] = W p + b``, ``r = sigma(a_r)``, ``z = sigma(a_z)``, ``f(p) = (1 - z) tanh(r a_n) + z p``
    (``torch.nn.GRUCell`` with a zero input and zero input bias). Parameters: ``initial`` ``p_0`` ``(hidden,)``,
    ``transition`` (``W``, ``b``: ``(3 hidden | hidden, hidden)``). Initialised as Keras initialises recurrent
    cells: ``W`` orthogonal (per gate), ``b = 0``; ``p_0 ~ N(0, initializer_range)`` like a learned table.
    """

    name = "recurrent"
    parallel_refusals = {"context": UNDECLARED_PARALLELISM, "sequence": UNDECLARED_PARALLELISM}
    description = "p_{k+1} = f(p_k) from a learned p_0, f a small recurrent cell (GRU or tanh), added to the input"
    options = {"cell": Option("gru", (str,), "recurrent cell", lambda v: v in RECURRENT_CELLS, "gru, tanh")}

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        hidden = dims.input_size
        self.initial = nn.Parameter(torch.empty(hidden))
        self.transition = nn.Linear(hidden, 3 * hidden if spec["cell"] == "gru" else hidden)

    def init_weights(self, std: float) -> None:
        init.normal_(self.initial, std=std)
        gates = self.transition.weight.shape[0] // self.dims.input_size
        orthogonal = [
            nn.init.orthogonal_(torch.empty(self.dims.input_size, self.dims.input_size)) for _ in range(gates)
        ]
        init.copy_(self.transition.weight, torch.cat(orthogonal))
        init.zeros_(self.transition.bias)

    def generate_table(self, length: int) -> torch.Tensor:
        weight, bias = fresh_float32(self.transition.weight), self.transition.bias.float()
        return UnrolledRecurrence.apply(self.initial.float(), weight, bias, length, self.spec["cell"])


FLOATER_ADAPTIVE_METHODS = ("dopri5", "dopri8", "bosh3", "adaptive_heun")
FLOATER_FIXED_STEP_METHODS = ("rk4", "midpoint", "euler")


def rotate_pairs(p: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """``exp(Omega t) p`` for the pairs ``(x, y) = (p_2i, p_2i+1)``, ``angles = omega_i t``:
    ``(x cos + y sin, -x sin + y cos)``, the flow of ``dx/dt = omega_i y``, ``dy/dt = -omega_i x``, which carries
    ``(0, 1)`` to ``(sin omega_i t, cos omega_i t)``. ``p`` ``(..., 2 n)``, ``angles`` ``(..., n)``."""
    x, y = p[..., 0::2], p[..., 1::2]
    cos, sin = angles.cos(), angles.sin()
    return torch.stack((x * cos + y * sin, y * cos - x * sin), dim=-1).flatten(-2)


def floater_dynamics(
    t: torch.Tensor,
    q: torch.Tensor,
    frequencies: torch.Tensor,
    inner_weight: torch.Tensor,
    inner_bias: torch.Tensor,
    outer_weight: torch.Tensor,
    outer_bias: torch.Tensor,
) -> torch.Tensor:
    """FLOATER's ``dq/dt = exp(-Omega t) g(exp(Omega t) q, t)`` in the frame rotating with ``Omega``,
    ``g(p, t) = W_2 tanh(W_1 [p; t] + b_1) + b_2``; ``t`` a scalar tensor, ``q`` ``(hidden,)``."""
    angles = frequencies * t
    p = rotate_pairs(q, angles)
    hidden = torch.tanh(F.linear(torch.cat((p, t.reshape(1))), inner_weight, inner_bias))
    return rotate_pairs(F.linear(hidden, outer_weight, outer_bias), -angles)


def fixed_step(
    method: str, t0: torch.Tensor, t1: torch.Tensor, q: torch.Tensor, weights: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """One step of torchdiffeq's fixed-grid solvers from ``t0`` to ``t1``, written as torchdiffeq writes them
    (``torchdiffeq/_impl/fixed_grid.py``, ``rk_common.rk4_alt_step_func``), so the numbers are its own: ``euler``;
    ``midpoint``; ``rk4``, the 3/8 rule ``(k1 + 3 (k2 + k3) + k4) dt / 8``."""
    dt = t1 - t0
    k1 = floater_dynamics(t0, q, *weights)
    if method == "euler":
        return q + dt * k1
    if method == "midpoint":
        half_dt = 0.5 * dt
        return q + dt * floater_dynamics(t0 + half_dt, q + k1 * half_dt, *weights)
    k2 = floater_dynamics(t0 + dt * (1 / 3), q + dt * k1 * (1 / 3), *weights)
    k3 = floater_dynamics(t0 + dt * (2 / 3), q + dt * (k2 - k1 * (1 / 3)), *weights)
    k4 = floater_dynamics(t1, q + dt * (k1 - k2 + k3), *weights)
    return q + (k1 + 3 * (k2 + k3) + k4) * dt * 0.125


def fixed_step_grid(length: int, substeps: int, device: torch.device) -> torch.Tensor:
    """The solver's times: ``substeps`` steps per position, ``t = 0 .. length - 1``, the last exactly
    ``length - 1`` (torchdiffeq's ``_grid_constructor_from_step_size``)."""
    grid = torch.arange((length - 1) * substeps + 1, dtype=torch.float32, device=device) * (1 / substeps)
    grid[-1] = length - 1
    return grid


def fixed_step_states(
    initial: torch.Tensor, *weights: torch.Tensor, length: int, method: str, substeps: int
) -> tuple[torch.Tensor]:
    """The rotating-frame state at every time of :func:`fixed_step_grid`, ``((length - 1) substeps + 1, hidden)``
    (the rows at the positions are every ``substeps``-th)."""
    grid = fixed_step_grid(length, substeps, initial.device)
    states = [initial]
    for step in range(len(grid) - 1):
        states.append(fixed_step(method, grid[step], grid[step + 1], states[-1], weights))
    return (torch.stack(states),)


def fixed_step_gradients(
    grad_rows: torch.Tensor, states: torch.Tensor, *weights: torch.Tensor, method: str, substeps: int
) -> tuple[torch.Tensor, ...]:
    """Backpropagation through :func:`fixed_step_states`: each step recomputed from its saved state and
    differentiated alone (autograd on one step, in reverse), the gradient of the rows at the positions added as the
    carry reaches them. Returns the gradients of ``initial`` and of each weight."""
    grid = fixed_step_grid(len(grad_rows), substeps, states.device)
    carry = torch.zeros_like(states[0])
    weight_grads = [torch.zeros_like(weight) for weight in weights]
    leaves = [weight.detach().requires_grad_() for weight in weights]
    for step in range(len(grid) - 2, -1, -1):
        if (step + 1) % substeps == 0:
            carry = carry + grad_rows[(step + 1) // substeps]
        state = states[step].detach().requires_grad_()
        with torch.enable_grad():
            following = fixed_step(method, grid[step], grid[step + 1], state, tuple(leaves))
            carry, *step_grads = torch.autograd.grad(following, (state, *leaves), carry)
        for total, grad in zip(weight_grads, step_grads, strict=True):
            total.add_(grad)
    return carry + grad_rows[0], *weight_grads


class FixedStepSolve(torch.autograd.Function):
    """FLOATER's rotating-frame solve on a fixed grid, ``(length, hidden)`` rows at the positions, with a
    backward that recomputes one step at a time (:func:`fixed_step_gradients`). Neither loop synchronises with the
    host (the grid is built on the device from Python numbers), so on CUDA each is replayed as a CUDA graph captured
    once per length (:func:`run_loop`): one launch instead of thousands, the same kernels."""

    @staticmethod
    def forward(ctx, initial, *weights_and_settings):
        *weights, length, method, substeps = weights_and_settings
        (states,) = run_loop(fixed_step_states, (initial, *weights), length=length, method=method, substeps=substeps)
        ctx.method, ctx.substeps = method, substeps
        ctx.save_for_backward(states, *weights)
        return states[::substeps]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows):
        states, *weights = ctx.saved_tensors
        grads = run_loop(
            fixed_step_gradients, (grad_rows.contiguous(), states, *weights), method=ctx.method, substeps=ctx.substeps
        )
        return *grads, None, None, None


def import_odeint():
    """``torchdiffeq.odeint``, imported only where ``floater`` runs (it is an optional dependency)."""
    try:
        from torchdiffeq import odeint
    except ImportError as error:
        raise ImportError(
            "position_encoding 'floater' solves its ODE with the torchdiffeq package, which is not installed: "
            "pip install torchdiffeq (or pip install 'hf_posenc[floater]')."
        ) from error
    return odeint


class Floater(GeneratedTable):
    """FLOATER (Liu et al. ICML 2020, "Learning to Encode Position for Transformer with Continuous Dynamical Model"):
    ``dp/dt = h(p(t), t)``, ``p(0)`` learned, the table ``p_k = p(k)`` read at the integer positions and added to
    the input (kexue.fm/archives/8130 "递归式"). Solved over ``t = 0 .. L - 1`` (``L`` the largest position + 1)
    once per forward, gradients through the solver's steps (:class:`GeneratedTable` caches it in eval): adaptive
    methods (the default ``dopri5``) with torchdiffeq's ``odeint``; fixed-step methods (``rk4``, ``midpoint``,
    ``euler``, ``step_size = 1/m``) with torchdiffeq's own step formulas in :class:`FixedStepSolve`, which never
    waits on the host, so on CUDA its loops are replayed as CUDA graphs (the form for GPU training; adaptive step
    control synchronises with the host at every step). The paper also injects ``p`` in every layer; here it enters
    at the input only.

    ``h(p, t) = Omega p + g(p, t)``: ``Omega`` rotates each feature pair ``(p_2i, p_2i+1)`` at a learned frequency
    ``omega_i`` (:func:`rotate_pairs`), so the sin/cos table is the solution with ``g = 0`` (its special solution,
    kexue.fm/archives/8130); ``dynamics="mlp"``: ``g = W_2 tanh(W_1 [p; t] + b_1) + b_2`` (``width`` hidden units),
    ``dynamics="linear"``: ``g = 0``. The solver runs in the frame that rotates with ``Omega`` (an integrating
    factor): ``q = exp(-Omega t) p`` obeys ``dq/dt = exp(-Omega t) g(exp(Omega t) q, t)``, and ``p(k) =
    exp(Omega k) q(k)`` exactly, so its steps follow ``g`` alone rather than the fastest rotation (about one radian
    per position: hundreds of steps over a long input). Initialised as that special solution: ``p(0) = PE(0)``
    (``[0, 1, 0, 1, ...]``), ``omega_i = 10000^(-2i / hidden)``, ``W_2 = 0``, ``b_2 = 0``; ``W_1``
    ``N(0, initializer_range)``. Parameters: ``initial`` ``(hidden,)``, ``frequencies`` ``(hidden / 2,)``, and for
    ``mlp`` ``inner`` / ``outer`` (``W_1``, ``W_2``). Needs an even ``hidden_size``, and for an adaptive method
    the torchdiffeq package (imported only when the table is solved).
    """

    name = "floater"
    parallel_refusals = {"context": UNDECLARED_PARALLELISM, "sequence": UNDECLARED_PARALLELISM}
    description = "FLOATER: dp/dt = h(p, t) solved at integer positions with torchdiffeq, added to the input"
    options = {
        "dynamics": Option.one_of("mlp", "h: 'mlp' (rotation + MLP) or 'linear' (rotation)", ("mlp", "linear")),
        "width": Option.int_at_least(32, "hidden units of the MLP dynamics", 1),
        "method": Option(
            "dopri5",
            (str,),
            "torchdiffeq solver",
            lambda v: v in FLOATER_ADAPTIVE_METHODS + FLOATER_FIXED_STEP_METHODS,
            ", ".join(FLOATER_ADAPTIVE_METHODS + FLOATER_FIXED_STEP_METHODS),
        ),
        "rtol": Option(1e-3, (float, int), "relative tolerance (adaptive methods)", lambda v: v > 0, "a number > 0"),
        "atol": Option(1e-4, (float, int), "absolute tolerance (adaptive methods)", lambda v: v > 0, "a number > 0"),
        "step_size": Option(
            1.0,
            (float, int),
            "step (fixed-step methods): 1/m, m steps per position, so that the grid lands on every position",
            lambda v: 0 < v <= 1 and abs(1 / v - round(1 / v)) < 1e-6,
            "1/m for an integer m >= 1 (1, 0.5, 0.25, 0.1, ...)",
        ),
    }

    @classmethod
    def check_sizes(cls, spec, hidden_size, max_position_embeddings):
        check_even_hidden_size("floater", hidden_size, "sin/cos pairs")

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        self.check_sizes(spec, dims.input_size, dims.max_positions)
        hidden = dims.input_size
        self.initial = nn.Parameter(torch.empty(hidden))
        self.frequencies = nn.Parameter(torch.empty(hidden // 2))
        if spec["dynamics"] == "mlp":
            self.inner = nn.Linear(hidden + 1, spec["width"])
            self.outer = nn.Linear(spec["width"], hidden)

    def init_weights(self, std: float) -> None:
        hidden = self.dims.input_size
        init.copy_(self.initial, sinusoidal_table(torch.zeros(1, 1, dtype=torch.long), hidden, 10000.0)[0, 0])
        init.copy_(self.frequencies, 10000.0 ** (-torch.arange(0, hidden, 2, dtype=torch.float32) / hidden))
        if self.spec["dynamics"] == "mlp":
            init.zeros_(self.outer.weight)
            init.zeros_(self.outer.bias)

    def dynamics_weights(self) -> tuple[torch.Tensor, ...]:
        """What :func:`floater_dynamics` reads after ``t`` and ``q``, in float32, prepared once per solve."""
        return (
            self.frequencies.float(),
            fresh_float32(self.inner.weight),
            self.inner.bias.float(),
            fresh_float32(self.outer.weight),
            self.outer.bias.float(),
        )

    def rotating_states(self, length: int) -> torch.Tensor:
        """``q(0) .. q(length - 1)``, ``(length, hidden)``: with ``dynamics="linear"`` (``g = 0``) ``q`` stays
        ``p(0)``; a fixed-step method runs :class:`FixedStepSolve`; an adaptive one torchdiffeq's ``odeint``."""
        initial, method = self.initial.float(), self.spec["method"]
        if self.spec["dynamics"] == "linear" or length == 1:
            return initial.expand(length, -1)
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                "position_encoding 'floater' cannot be traced by torch.compile(fullgraph=True): its solve is a loop "
                "of one step per position or more (torchdiffeq's adaptive methods choose theirs on the host; the "
                "fixed-step backward differentiates one step at a time). Compile with fullgraph=False (the solve "
                "then runs uncompiled between graphs)."
            )
        if method in FLOATER_FIXED_STEP_METHODS:
            substeps = round(1 / self.spec["step_size"])
            return FixedStepSolve.apply(initial, *self.dynamics_weights(), length, method, substeps)
        odeint, weights = import_odeint(), self.dynamics_weights()
        times = torch.arange(length, dtype=torch.float32, device=initial.device)
        return odeint(
            lambda t, q: floater_dynamics(t, q, *weights),
            initial,
            times,
            method=method,
            rtol=self.spec["rtol"],
            atol=self.spec["atol"],
        )

    def generate_table(self, length: int) -> torch.Tensor:
        times = torch.arange(length, dtype=torch.float32, device=self.initial.device)
        return rotate_pairs(self.rotating_states(length), self.frequencies.float() * times[:, None])
