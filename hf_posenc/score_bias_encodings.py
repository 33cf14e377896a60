"""Position-only score biases: a scalar per head and per (query, key) position pair, added to the scores.

Each scheme is a :class:`RelativeScoreBias`: one elementwise formula that serves both the dense bias (eager, SDPA,
built once per forward) and the FlexAttention ``score_mod`` (nothing ``(q, k)``-sized materialised).
Sources: Su Jianlin, "Transformer position encodings" (kexue.fm/archives/8130), and the papers cited per class.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import initialization as init

from .options import NOT_SLICED_BY_RANK, RING_ATTENTION_ONLY, ULYSSES_KERNEL_ONLY, Option
from .position_interface import (
    RelativeScoreBias,
    flex_compiles_length_sized_tables,
    scatter_adds_are_cheap,
    toeplitz_distances,
)
from .relative_tables import chunk_elements


def check_log_buckets(name: str, spec: dict) -> None:
    """T5's buckets (:func:`t5_relative_bucket`): the log buckets span ``[num_buckets / 2, max_distance)`` in a
    decoder (a quarter in an encoder), so ``max_distance`` must pass ``num_buckets / 2``."""
    if spec["max_distance"] <= spec["num_buckets"] // 2:
        raise ValueError(
            f"position_encoding {name!r}: max_distance={spec['max_distance']} must be larger than num_buckets / 2 "
            f"= {spec['num_buckets'] // 2}, where the logarithmic buckets start."
        )


def t5_relative_bucket(
    distance: torch.Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of the relative distance ``distance = i - j`` (query minus key).

    Half the buckets (per direction, when bidirectional) hold the exact distances ``0 .. n/2 - 1``; the rest split
    ``[n/2, max_distance)`` logarithmically, and larger distances share the last bucket. With 32 buckets and
    ``max_distance=128`` (bidirectional), ``i - j = 0..30`` maps to the table of kexue.fm/archives/8130:
    0..7, then 8,8,8,8, 9,9,9,9, 10 (x7), 11 (x8). Keys to the right of the query (``j > i``) use the upper half.
    Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer".
    """
    if bidirectional:
        num_buckets //= 2
        offset = torch.where(distance < 0, num_buckets, 0)
        magnitude = distance.abs()
    else:
        offset = torch.zeros_like(distance)
        magnitude = distance.clamp(min=0)
    max_exact = num_buckets // 2
    log_ratio = torch.log(magnitude.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + log_ratio * (num_buckets - max_exact)).to(distance.dtype).clamp(max=num_buckets - 1)
    return offset + torch.where(magnitude < max_exact, magnitude, large)


def t5_bias_from_steps(steps: torch.Tensor, *, bidirectional: bool) -> torch.Tensor:
    """T5 bias values ``(num_buckets, heads)`` from their steps outward from distance 0: ``beta[k] = sum_{m <= k}
    steps[m]`` along each direction.

    Causal: buckets ``0, 1, ..., n - 1`` are distances in increasing order, so ``beta = cumsum(steps)``. Bidirectional:
    the lower half (``i - j >= 0``) is ``cumsum(steps[:n/2])``; the upper half (keys to the right) starts from bucket
    0 (distance 0): ``beta[n/2 + m] = beta[0] + sum_{m' <= m} steps[n/2 + m']`` (bucket ``n/2``, distance "-0", is
    never looked up; its step is the offset between the two directions).
    """
    if not bidirectional:
        return steps.cumsum(0)
    half = steps.shape[0] // 2
    past = steps[:half].cumsum(0)
    return torch.cat([past, past[:1] + steps[half:].cumsum(0)])


def t5_steps_from_bias(bias: torch.Tensor, *, bidirectional: bool) -> torch.Tensor:
    """The inverse of :func:`t5_bias_from_steps`: a T5 table of bias values ``(num_buckets, heads)`` as steps."""
    first = torch.zeros_like(bias[:1])
    if not bidirectional:
        return torch.diff(bias, dim=0, prepend=first)
    half = bias.shape[0] // 2
    return torch.cat([torch.diff(bias[:half], dim=0, prepend=first), torch.diff(bias[half:], dim=0, prepend=bias[:1])])


OLD_T5_TABLE = "relative_attention_bias.weight"  # t5's table as values / table_scale, saved before the steps


def refuse_old_t5_table(model: nn.Module, unexpected_keys: set[str]) -> None:
    """Raise if a checkpoint holds a ``t5`` table in the old layout (values, not steps) for a :class:`T5Bias` of
    ``model``: ``from_pretrained`` would skip it and draw the steps anew, a silently different model."""
    modules = dict(model.named_modules())
    prefix = f"{model.base_model_prefix}."  # a head's checkpoint loaded into the base model, or the reverse

    def loads_into_t5(key: str) -> bool:
        owner = key.removesuffix("." + OLD_T5_TABLE)
        names = (owner, owner.removeprefix(prefix), prefix + owner)
        return key.endswith("." + OLD_T5_TABLE) and any(isinstance(modules.get(name), T5Bias) for name in names)

    old = sorted(filter(loads_into_t5, unexpected_keys))
    if old:
        raise ValueError(
            f"This checkpoint stores the 't5' table as bias values ({', '.join(old)}), the layout hf_posenc saved "
            "before it stored steps (relative_attention_steps); from_pretrained cannot convert it. Build the model "
            "from its config and load the weights with load_state_dict, which converts the values to steps exactly: "
            "model = cls(AutoConfig.from_pretrained(folder)); "
            "model.load_state_dict(safetensors.torch.load_file(f'{folder}/model.safetensors'), strict=False) "
            "(strict=False: tied output weights are not in the file); then save_pretrained it again."
        )


T5_INITS = ("reference", "decay")


class T5Bias(RelativeScoreBias):
    """T5 bucketed relative bias: ``b_ij += beta_h[bucket(i - j)]``, one table shared by all layers.

    Bidirectional buckets in an encoder, causal (``i - j >= 0`` only) in a decoder. Source: Raffel et al. 2020;
    kexue.fm/archives/8130 "T5式". Parameters: ``relative_attention_steps`` ``(num_buckets, heads)``, the table's
    steps outward from distance 0: ``beta = s * t5_bias_from_steps(relative_attention_steps)`` (each bucket is the
    bucket before it, one step nearer, plus its own step).

    ``s = table_scale`` (default ``sqrt(head_dim)``, as x-transformers): Adam moves every parameter by about the
    learning rate per step whatever its gradient's size, so a table read as it is moves its bias by ``lr`` per step,
    far slower than the attention logits it competes with; read through ``s`` it moves ``s`` times faster
    (``benchmarks/bias_learning_pace.py``: 1.95 -> 1.66 nats/byte after 600 steps).

    Steps, not values, so that a model keeps its bias past its training length: a bucket that training never reaches
    (distances beyond the training length) gets no gradient; stored as a value it would keep its initial value while
    the farthest trained buckets move away from it, stored as a step it keeps the bias of the nearest trained bucket
    plus its initial step.

    Init (option ``init``), drawn as bias values and stored as their steps, so the values are distributed exactly as
    drawn whatever ``s``: the stored steps are ``t5_steps_from_bias(values) / s``.

    * ``"reference"`` (default): Transformers' ``T5PreTrainedModel._init_weights``, ``relative_attention_bias``
      ``~ N(0, initializer_factor * d_model^-1/2)`` with T5's ``initializer_factor = 1``: values ``N(0,
      hidden_size^-1/2)`` (``initializer_range`` is not used, as in T5). The Mesh-TensorFlow code that trained T5
      (and T5X) draws the same table Glorot-uniform over ``(heads, buckets)``, std ``sqrt(2 / (heads + buckets))``;
      both are a small zero-mean table, no locality prior.
    * ``"decay"``: the same draw plus ``-1`` nat per logarithmic bucket (0 up to the exact distances, then -1, -2, ...
      at the logarithmic buckets of each direction), a locality prior T5 does not have. The keys beyond the training
      length share few buckets (the last one takes every distance from ``max_distance`` on); the decay makes the
      attention they take fall geometrically past the last trained bucket. Under ``relu2`` it makes every key past
      the exact distances dead at init (their scores ``q.k + b < 0``).

    A T5 checkpoint's table (bias values) converts as ``t5_steps_from_bias(weight) / s`` (:meth:`store_bias`). A model
    saved by hf_posenc before the steps stored ``values / s`` as ``relative_attention_bias``: ``load_state_dict``
    converts that key to steps exactly; ``from_pretrained`` refuses it (:func:`refuse_old_t5_table`).
    """

    name = "t5"
    parallel_refusals = {
        "context": f"its bias is added to the scores; {RING_ATTENTION_ONLY}",
        "sequence": f"its bucket table: {NOT_SLICED_BY_RANK}; {ULYSSES_KERNEL_ONLY}",
    }
    description = "T5 bucketed scalar bias per head (bidirectional in the encoder, causal in the decoder)"
    options = {
        "num_buckets": Option(32, (int,), "number of buckets", lambda v: v >= 4 and v % 2 == 0, "an even int >= 4"),
        "max_distance": Option.int_at_least(128, "distance of the last bucket", 2),
        "table_scale": Option(
            None, (float, int), "bias = table_scale * table (None: sqrt(head_dim))", lambda v: v > 0, "a number > 0"
        ),
        "init": Option(
            "reference",
            (str,),
            "'reference': T5's N(0, hidden_size^-1/2) bias values; 'decay': the same, -1 nat per logarithmic bucket",
            lambda v: v in T5_INITS,
            " or ".join(map(repr, T5_INITS)),
        ),
    }
    decay_per_bucket = -1.0

    @classmethod
    def check_spec(cls, spec):
        check_log_buckets(cls.name, spec)

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        self.relative_attention_steps = nn.Embedding(spec["num_buckets"], dims.num_heads)
        self.table_scale = spec["table_scale"] or math.sqrt(dims.head_dim)

    def initial_bias(self) -> torch.Tensor:
        """The mean bias value of each bucket at init, ``(num_buckets, 1)``: 0 (``init="reference"``); for
        ``"decay"``, ``-1, -2, ...`` nats at the logarithmic buckets of each direction, 0 at the exact ones."""
        half = self.spec["num_buckets"] // (1 if self.dims.causal else 2)
        if self.spec["init"] == "decay":  # the first logarithmic bucket, half // 2, starts at -1
            per_direction = (torch.arange(half) - half // 2 + 1).clamp(min=0) * self.decay_per_bucket
        else:
            per_direction = torch.zeros(half)
        bias = per_direction if self.dims.causal else torch.cat([per_direction, per_direction])
        return bias[:, None]

    def init_weights(self, initializer_range):
        """T5's values (``N(0, hidden_size^-1/2)``, plus :meth:`initial_bias`), stored as their steps."""
        weight = self.relative_attention_steps.weight
        values = torch.randn(weight.shape) * self.dims.hidden_size**-0.5 + self.initial_bias()
        init.copy_(weight, t5_steps_from_bias(values, bidirectional=not self.dims.causal) / self.table_scale)

    def store_bias(self, values: torch.Tensor) -> None:
        """Write bias values ``(num_buckets, heads)`` (a T5 checkpoint's table, or an init drawn as values)."""
        steps = t5_steps_from_bias(values, bidirectional=not self.dims.causal) / self.table_scale
        with torch.no_grad():
            self.relative_attention_steps.weight.copy_(steps)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """An old table (values / s under ``relative_attention_bias``) is loaded as its steps: the same bias."""
        old_key = prefix + OLD_T5_TABLE
        if old_key in state_dict:
            values = state_dict.pop(old_key)
            state_dict[prefix + "relative_attention_steps.weight"] = t5_steps_from_bias(
                values, bidirectional=not self.dims.causal
            )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def bias_table(self, device):
        steps = self.heads_read(self.relative_attention_steps.weight, dim=1)
        return t5_bias_from_steps(steps, bidirectional=not self.dims.causal) * self.table_scale

    def distance_bias(self, distance, head, table):
        bucket = t5_relative_bucket(
            distance,
            bidirectional=not self.dims.causal,
            num_buckets=self.spec["num_buckets"],
            max_distance=self.spec["max_distance"],
        )
        return table[bucket, head]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes: ``m_h = 2^(-8h/H)``, h = 1..H, for H a power of two; otherwise the slopes of the nearest
    lower power of two followed by every other slope of the next one (Press et al. 2022, "Train Short, Test Long")."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = [2 ** (-8 * h / closest) for h in range(1, closest + 1)]
    slopes += [2 ** (-8 * h / (2 * closest)) for h in range(1, 2 * (num_heads - closest), 2)]
    return torch.tensor(slopes)


class ALiBi(RelativeScoreBias):
    """ALiBi: ``b_ij += -m_h |i - j|`` with fixed geometric slopes ``m_h`` (:func:`alibi_slopes`).

    Symmetric in an encoder; in a decoder the causal mask leaves only ``j <= i``, i.e. ``-m_h (i - j)``.
    Source: Press et al. 2022. No parameters.
    """

    name = "alibi"
    parallel_refusals = {
        "context": f"its bias is added to the scores; {RING_ATTENTION_ONLY}",
        "sequence": f"its slopes: {NOT_SLICED_BY_RANK}; {ULYSSES_KERNEL_ONLY}",
    }
    description = "linear bias -m_h*|i-j| with geometric head slopes (no parameters)"

    def bias_table(self, device):
        """The slopes of the model's heads, read at this rank's heads under tensor parallelism."""
        return self.heads_read(alibi_slopes(self.model_num_heads)).to(device=device, dtype=torch.float32)

    def distance_bias(self, distance, head, table):
        return -table[head] * distance.abs()


def positive_straight_through(value: torch.Tensor, low: float, high: float | None = None) -> torch.Tensor:
    """``value`` clamped to ``[low, high]`` in the forward, with the gradient of the unclamped value: the projection
    KERPLE's code applies to its parameters before each forward, without writing to the parameters."""
    return value + (value.clamp(min=low, max=high) - value).detach()


class KERPLE(RelativeScoreBias):
    """KERPLE: ``b_ij += -r1_h log(1 + r2_h |i - j|)`` (``log``) or ``-r1_h |i - j|^r2_h`` (``power``).

    Conditionally positive definite kernels of the distance, with ``r1, r2 > 0`` learnable per head (and
    ``r2 <= 2`` for ``power``). As in the paper's code (chijames/KERPLE, ``ParallelKerpleLog`` /
    ``ParallelKerplePower``), the values used are clamped to ``r >= 0.01`` (and ``r2 <= 2``); the code writes the
    clamp into the parameters before each forward, here the clamped value is used with the gradient passed straight
    through, so the forward is the same and no parameter is written during a forward. Initialisation as the
    paper's code: ``log``: ``r1 ~ U(0, 2)``, ``r2 ~ U(0, 1)``; ``power``: ``r1 ~ U(0, 1)``, ``r2 ~ U(0, 2)``. These
    per-head scalars act on the bias directly at the scale they start at, so Adam's ``lr``-sized steps are a fixed
    fraction of them: no rescaling needed (compare ``t5``). Causal in a decoder; ``|i - j|`` (symmetric) in an
    encoder. Source: Chi et al., NeurIPS 2022. Parameters: ``r1``, ``r2`` ``(heads,)``.
    """

    name = "kerple"
    parallel_refusals = {
        "context": f"its bias is added to the scores; {RING_ATTENTION_ONLY}",
        "sequence": f"its parameters: {NOT_SLICED_BY_RANK}; {ULYSSES_KERNEL_ONLY}",
    }
    description = "KERPLE kernel bias: -r1*log(1+r2*|i-j|) (log) or -r1*|i-j|^r2 (power), r1, r2 learned per head"
    options = {
        "variant": Option.one_of("log", "kernel", ("log", "power")),
    }
    minimum = 0.01

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        self.r1 = nn.Parameter(torch.empty(dims.num_heads))
        self.r2 = nn.Parameter(torch.empty(dims.num_heads))
        self.init_weights(0.0)

    def init_weights(self, initializer_range):
        r1_high, r2_high = (2.0, 1.0) if self.spec["variant"] == "log" else (1.0, 2.0)
        init.uniform_(self.r1, 0.0, r1_high)
        init.uniform_(self.r2, 0.0, r2_high)

    def bias_table(self, device):
        r2_high = 2.0 if self.spec["variant"] == "power" else None
        # two tensors: FlexAttention cannot differentiate one captured tensor read at two indices per score
        r1 = positive_straight_through(self.heads_read(self.r1), self.minimum)
        return {"r1": r1, "r2": positive_straight_through(self.heads_read(self.r2), self.minimum, r2_high)}

    def distance_bias(self, distance, head, table):
        distance = distance.abs().to(torch.promote_types(table["r1"].dtype, torch.float32))
        r1, r2 = table["r1"][head], table["r2"][head]
        if self.spec["variant"] == "log":
            return -r1 * torch.log1p(r2 * distance)
        return -r1 * distance.pow(r2)


def relu_mlp_pieces(
    weight_in: torch.Tensor, bias_in: torch.Tensor, weight_out: torch.Tensor, bias_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``f(x) = W_out relu(w_in x + b_in) + b_out`` of a scalar ``x`` (``w_in``, ``b_in``: ``(width,)``; ``W_out``
    ``(heads, width)``) as the piecewise-linear function it is: ``f(x) = slope[k] x + intercept[k]`` on piece ``k``
    = the number of breakpoints ``-b_in / w_in`` below ``x``.

    Returns the sorted ``breakpoints`` ``(width,)`` (``+inf`` for a unit with ``w_in = 0``, constant everywhere), and
    ``slope``, ``intercept`` ``(width + 1, heads)``, differentiable in the weights (the set of active units is
    constant on a piece).
    """
    flat = weight_in == 0
    breakpoints = torch.where(flat, torch.inf, -bias_in / torch.where(flat, 1.0, weight_in)).detach()
    sorted_breakpoints, order = breakpoints.sort()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=order.device)
    piece = torch.arange(len(order) + 1, device=order.device)[:, None]
    # Unit u is active on piece k when x > breakpoint (w_in > 0), x < breakpoint (w_in < 0), or always if b_in > 0.
    active = torch.where(weight_in > 0, piece > rank, piece <= rank)
    active = torch.where(flat, bias_in > 0, active).to(weight_out.dtype)
    slope = (active * weight_in) @ weight_out.T
    intercept = (active * bias_in) @ weight_out.T + bias_out
    return sorted_breakpoints, slope, intercept


class _ReluMlpOfScalars(torch.autograd.Function):
    """``f(x) = W_out relu(w_in x + b_in) + b_out`` for every element of ``x``, in chunks of elements, saving only
    ``x`` and the weights: the ``(elements, width)`` hidden layer is never held whole, and every gradient is a dense
    matrix product or sum (no gather, hence no scatter in the backward)."""

    @staticmethod
    def forward(x, weight_in, bias_in, weight_out, bias_out, chunk):
        flat = x.reshape(-1)
        out = torch.empty(weight_out.shape[0], flat.numel(), dtype=x.dtype, device=x.device)
        for start in range(0, flat.numel(), chunk):  # hidden layer (width, chunk): w x + b by one addmm
            hidden = torch.addmm(bias_in[:, None], weight_in[:, None], flat[None, start : start + chunk]).relu_()
            out[:, start : start + chunk] = weight_out @ hidden
        return (out + bias_out[:, None]).view(weight_out.shape[0], *x.shape)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight_in, bias_in, weight_out, _, chunk = inputs
        ctx.save_for_backward(x, weight_in, bias_in, weight_out)
        ctx.chunk = chunk

    @staticmethod
    def backward(ctx, grad):
        x, weight_in, bias_in, weight_out = ctx.saved_tensors
        flat, grad = x.reshape(-1), grad.reshape(weight_out.shape[0], -1)
        grad_x = torch.empty_like(flat)
        grad_weight_in, grad_bias_in = torch.zeros_like(weight_in), torch.zeros_like(bias_in)
        grad_weight_out = torch.zeros_like(weight_out)
        for start in range(0, flat.numel(), ctx.chunk):
            part, part_grad = flat[start : start + ctx.chunk], grad[:, start : start + ctx.chunk]
            before = torch.addmm(bias_in[:, None], weight_in[:, None], part[None])  # (width, chunk)
            grad_weight_out += part_grad @ torch.relu(before).T
            grad_before = (weight_out.T @ part_grad).masked_fill_(before <= 0, 0.0)
            grad_weight_in += grad_before @ part
            grad_bias_in += grad_before.sum(1)
            grad_x[start : start + ctx.chunk] = weight_in @ grad_before
        return grad_x.view(x.shape), grad_weight_in, grad_bias_in, grad_weight_out, grad.sum(-1), None


MLP_CHUNK_SHARE = 128
"""Elements of ``x`` per chunk of :func:`relu_mlp_of_scalars`: the device's chunk budget
(:func:`~hf_posenc.relative_tables.chunk_elements`) over this, so the ``(width, chunk)`` hidden layer and its
gradient take a quarter of it each at the default width 32: ``2^16`` on the CPU (as before), up to ``2^21`` on CUDA
(32 chunks at 1 x 8192 tokens where ``2^16`` made 1,024)."""


def relu_mlp_of_scalars(
    x: torch.Tensor,
    weight_in: torch.Tensor,
    bias_in: torch.Tensor,
    weight_out: torch.Tensor,
    bias_out: torch.Tensor,
    chunk: int | None = None,
) -> torch.Tensor:
    """``(heads, *x.shape)``: ``f_h(x) = sum_u W_out[h, u] relu(w_in[u] x + b_in[u]) + b_out[h]`` for every element
    of ``x`` (``w_in``, ``b_in``: ``(width,)``; ``W_out`` ``(heads, width)``; ``b_out`` ``(heads,)``), in float32 or
    wider whatever autocast says, ``chunk`` elements at a time (memory ``O(chunk * width)`` beyond the output;
    default: the device's chunk budget over :data:`MLP_CHUNK_SHARE`)."""
    chunk = chunk or max(1, chunk_elements(x.device) // MLP_CHUNK_SHARE)
    dtype = torch.promote_types(x.dtype, torch.float32)
    with torch.autocast(x.device.type, enabled=False):
        return _ReluMlpOfScalars.apply(
            x.to(dtype), weight_in.to(dtype), bias_in.to(dtype), weight_out.to(dtype), bias_out.to(dtype), chunk
        )


def piece_index(x: torch.Tensor, breakpoints: torch.Tensor) -> torch.Tensor:
    """The number of sorted ``breakpoints`` below each ``x``: a binary search on a dense tensor; inside a
    FlexAttention ``score_mod``, which sees one element (0-d) and lowers neither ``bucketize`` nor reductions, an
    unrolled count."""
    if x.dim() == 0:
        return sum((x > breakpoints[u]).to(torch.int64) for u in range(len(breakpoints)))
    return torch.bucketize(x, breakpoints)


class FIRE(RelativeScoreBias):
    """FIRE: ``b_ij += f_h(psi(|i - j|) / psi(max(L, i, j)))``, ``psi(x) = log(|c| x + 1)``.

    ``f`` is an MLP ``1 -> mlp_width -> heads`` with ReLU, ``c`` and the threshold ``L = |l| * threshold`` are
    learnable. In a decoder ``max(L, i, j) = max(L, i)`` on every visible key (``j <= i``): the paper's formula. In an
    encoder the same formula is this project's bidirectional form: symmetric in ``i - j``, and normalised by the
    larger of the two positions, so the MLP's input stays in ``[0, 1]`` as in the decoder. Shift-invariant only while
    every position is below ``L`` (so ``relative = False``).

    The MLP of a scalar is piecewise linear (:func:`relu_mlp_pieces`): each forward turns its weights once into
    ``mlp_width + 1`` (slope, intercept) pairs per head, and every ``(i, j)`` looks up its piece, so ``f`` is exact
    and never evaluated per layer or per pair (nothing ``(q, k, width)``-sized, and a lookup in ``score_mod``).
    FlexAttention on consecutive positions reads the formula's parts from tables per distance, per position and per
    query (:meth:`spread_tables`), so it trains there with nothing ``(q, k)``-sized; other positions on flex read
    ``c``, ``L`` and the pieces at the head and train on SDPA (``flex_spreads_gradients``).

    Initialisation as the reference code (Li et al. 2024, appendix; PyTorch's ``nn.Linear`` default for the MLP, which
    Transformers' ``N(0, initializer_range)`` would flatten to nearly zero): ``c = 0.1``, ``l = 1``, ``L`` starting
    at ``threshold`` = 512, ``psi(max(L, i))`` plus ``1e-6``. Source: Li et al., ICLR 2024, "Functional Interpolation
    for Relative Positions Improves Long Context Transformers". Parameters: ``c``, ``threshold_scale``, ``mlp_in``
    ``(width, 2)``, ``mlp_out`` ``(heads, width + 1)`` (the last columns are biases).
    """

    name = "fire"
    parallel_refusals = {
        "context": f"its bias is added to the scores; {RING_ATTENTION_ONLY}",
        "sequence": f"its MLP's output: {NOT_SLICED_BY_RANK}; {ULYSSES_KERNEL_ONLY}",
    }
    description = "FIRE: MLP of log-distance normalised by log(max(L, position)), learned c, L (Li et al. 2024)"
    relative = False
    options = {
        "mlp_width": Option.int_at_least(32, "hidden units of the MLP", 1),
        "threshold": Option(512.0, (float, int), "initial threshold L", lambda v: v > 0, "a number > 0"),
    }
    eps = 1e-6

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        width = spec["mlp_width"]
        self.c = nn.Parameter(torch.empty(()))
        self.threshold_scale = nn.Parameter(torch.empty(()))
        self.mlp_in = nn.Parameter(torch.empty(width, 2))
        self.mlp_out = nn.Parameter(torch.empty(dims.num_heads, width + 1))
        self.init_weights(0.0)

    def init_weights(self, initializer_range):
        init.constant_(self.c, 0.1)
        init.constant_(self.threshold_scale, 1.0)
        init.uniform_(self.mlp_in, -1.0, 1.0)  # nn.Linear(1, width): U(+-1/sqrt(1))
        bound = 1 / math.sqrt(self.spec["mlp_width"])
        init.uniform_(self.mlp_out, -bound, bound)

    def bias_table(self, device):
        breakpoints, slope, intercept = relu_mlp_pieces(*self.mlp_weights())
        c, threshold = self.shared_scalars()
        return {  # (1,)-shaped, not views: LayerPositionTerm.score_mod's rule
            "c": torch.stack((c,)),
            "threshold": torch.stack((threshold,)),
            "breakpoints": breakpoints,
            "slope": slope,
            "intercept": intercept,
        }

    def prepare(self, query_positions, key_positions, backend, consecutive=False):
        """On FlexAttention with consecutive positions (where flex compiles length-sized tables):
        :meth:`spread_tables`; otherwise :class:`RelativeScoreBias`'s paths (the dense bias, or the per-pair formula
        on flex)."""
        device = query_positions.device
        if backend == "flex_attention" and consecutive and flex_compiles_length_sized_tables(device):
            return self.spread_tables(query_positions, key_positions)
        return super().prepare(query_positions, key_positions, backend, consecutive)

    def spread_tables(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """The formula's pieces as tables read at addresses that follow the query or the key, so that the kernel's
        one gradient per score spreads (:meth:`flex_spreads_gradients`), with ``psi(x) = log1p(|c| x)``:

        * ``fire_distance`` ``psi(|i - j|)`` per distance ``(q_len + kv_len - 1,)`` (:mod:`relative_tables`'
          columns);
        * ``fire_query_scale`` ``psi(max(L, i)) + eps`` per query ``(batch|1, q_len)`` and ``fire_key_scale``
          ``psi(max(L, j)) + eps`` per key: ``psi`` increases, so ``psi(max(L, i, j)) = max(psi(max(L, i)),
          psi(max(L, j)))`` (two tables: a score_mod may read a tensor that takes gradients at one index only);
        * ``fire_slope``, ``fire_intercept``: the MLP's pieces (:func:`relu_mlp_pieces`, in float32 whatever autocast
          says) repeated along the queries, ``(heads, q_len, width + 1)``; ``fire_breakpoints`` ``(width,)`` take no
          gradient (the piece is constant between them).

        Nothing ``(q, k)``-sized; the tables read per score are 1-d or 3-d, none 0-d."""
        with torch.autocast(query_positions.device.type, enabled=False):
            breakpoints, slope, intercept = relu_mlp_pieces(*self.mlp_weights())
        c, threshold = self.shared_scalars()
        dtype = torch.promote_types(c.dtype, torch.float32)
        distance = toeplitz_distances(query_positions, key_positions).abs().to(dtype)

        def scale(positions: torch.Tensor) -> torch.Tensor:
            return torch.log1p(c * torch.maximum(positions.to(dtype), threshold)) + self.eps

        q_len = query_positions.shape[-1]
        return {
            "fire_distance": torch.log1p(c * distance),
            "fire_query_scale": scale(query_positions),
            "fire_key_scale": scale(key_positions),
            "fire_breakpoints": breakpoints,
            "fire_slope": slope.T[:, None, :].repeat(1, q_len, 1),
            "fire_intercept": intercept.T[:, None, :].repeat(1, q_len, 1),
        }

    def flex_spreads_gradients(self, consecutive):
        """On consecutive positions every table the score_mod reads takes its gradient at an address that follows the
        query or the key (:meth:`spread_tables`); other positions read ``c``, ``L`` and the pieces at the head."""
        return consecutive

    def score_mod(self, tables, query_positions, key_positions):
        """:meth:`spread_tables` read per score (``x = D[i - j] / max(P_q[i], P_k[j])``, its piece counted against the
        breakpoints, then ``slope x + intercept`` of that piece), or :class:`RelativeScoreBias`'s per-pair formula."""
        if "fire_distance" not in tables:
            return super().score_mod(tables, query_positions, key_positions)
        distance, breakpoints = tables["fire_distance"], tables["fire_breakpoints"]
        query_scale, key_scale = tables["fire_query_scale"], tables["fire_key_scale"]
        slope, intercept, last_key = tables["fire_slope"], tables["fire_intercept"], key_positions.shape[-1] - 1
        query_rows_shared, key_rows_shared = query_scale.shape[0] == 1, key_scale.shape[0] == 1

        def fire_score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
            # read in place (a row of a table that takes gradients would be a view: compiled flex drops its gradient)
            query_normaliser = query_scale[0 if query_rows_shared else batch_idx, q_idx]
            normaliser = torch.maximum(query_normaliser, key_scale[0 if key_rows_shared else batch_idx, kv_idx])
            x = distance[q_idx - kv_idx + last_key] / normaliser
            piece = piece_index(x, breakpoints)
            return score + (slope[head_idx, q_idx, piece] * x + intercept[head_idx, q_idx, piece]).to(score.dtype)

        return fire_score_mod

    def shared_scalars(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``|c|`` and ``L = |l * threshold|``, 0-d, read by every head."""
        threshold = (self.read_by_all_heads(self.threshold_scale) * self.spec["threshold"]).abs()
        return self.read_by_all_heads(self.c).abs(), threshold

    def mlp_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``w_in``, ``b_in`` ``(width,)`` (every head reads them), ``W_out`` ``(heads, width)``, ``b_out``
        ``(heads,)`` (this rank's heads under tensor parallelism)."""
        mlp_in, mlp_out = self.read_by_all_heads(self.mlp_in), self.heads_read(self.mlp_out)
        return mlp_in[:, 0], mlp_in[:, 1], mlp_out[:, :-1], mlp_out[:, -1]

    def normalised_distance(self, query_position, key_position, table):
        """The MLP's input ``psi(|i - j|) / (psi(max(L, i, j)) + eps)``, in float32 or wider, broadcasting."""
        c = table["c"][0]
        dtype = torch.promote_types(c.dtype, torch.float32)
        distance = (query_position - key_position).abs().to(dtype)
        normaliser = torch.maximum(torch.maximum(query_position, key_position).to(dtype), table["threshold"][0])
        return torch.log1p(c * distance) / (torch.log1p(c * normaliser) + self.eps)

    def position_bias(self, query_position, key_position, head, table):
        x = self.normalised_distance(query_position, key_position, table)
        piece = piece_index(x, table["breakpoints"].to(x.dtype))
        return table["slope"][piece, head] * x + table["intercept"][piece, head]

    def dense_bias(self, query_positions, key_positions, table):
        """Where scatters are not cheap (a GPU: :func:`scatter_adds_are_cheap`), the MLP itself on the ``(batch|1,
        q_len, kv_len)`` inputs (:func:`relu_mlp_of_scalars`): a dense backward, where looking up each pair's piece
        would scatter ``q_len * kv_len`` gradients into ``width + 1`` rows. On CPU that scatter is a cheap sequential
        add and the MLP costs ``width`` times more, so the piece lookup (:meth:`position_bias`) stays; both give the
        same numbers."""
        if scatter_adds_are_cheap(query_positions.device):
            return super().dense_bias(query_positions, key_positions, table)
        return self.mlp_bias(query_positions, key_positions, table)

    def mlp_bias(self, query_positions, key_positions, table):
        """``(batch|1, heads, q_len, kv_len)``: the MLP evaluated on every pair's normalised distance."""
        x = self.normalised_distance(query_positions[:, :, None], key_positions[:, None, :], table)
        return relu_mlp_of_scalars(x, *self.mlp_weights()).transpose(0, 1)
