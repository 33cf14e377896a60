"""Rotary position encodings: q and k are rotated by their positions before the KV cache (``transform_qkv``).

Source: Su Jianlin, "Transformer position encodings" (kexue.fm/archives/8130, "融合式"), and the papers per class.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig
from transformers import initialization as init
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .options import UNDECLARED_PARALLELISM, Option
from .position_interface import PositionEncoding


def rotary_inverse_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    """``theta^(-2i/d)`` for ``i = 0 .. d/2 - 1``, d the rotated dimension."""
    return theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def keep_highest_frequencies(inverse_frequencies: torch.Tensor, kept: int) -> torch.Tensor:
    """p-RoPE's frequencies (Barbero et al. 2024, "Round and Round We Go! What makes Rotary Positional Encodings
    useful?", ``apply_p_rope``; Transformers' ``proportional`` RoPE of Gemma 4): the first ``kept`` of the ``(...,
    d/2)`` inverse frequencies (the highest, ``theta^(-2i/d)`` for ``i < kept``) and 0 for the rest, whose feature
    pairs then turn by the angle 0 at every position (cos 1, sin 0: the identity, exactly)."""
    return F.pad(inverse_frequencies[..., :kept], (0, inverse_frequencies.shape[-1] - kept))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` features of ``x`` ``(batch, heads, seq, head_dim)``.

    Feature ``i`` is paired with ``i + d/2`` (the "rotate half" layout; Su's interleaved pairs ``(2i, 2i+1)`` are the
    same rotation up to a fixed permutation of features): ``(x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos)``.
    ``cos``/``sin`` are ``(batch|1, 1, seq, d/2)``.
    """
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest), dim=-1)


def _factor_option() -> Option:
    return Option(None, (float, int), "how many times longer than the original length", lambda v: v >= 1, ">= 1")


def _original_length_option() -> Option:
    return Option.int_at_least(None, "the length pretrained on (None: max_position_embeddings)", 2)


ROPE_SCALING_OPTIONS: dict[str, dict[str, Option]] = {
    "linear": {"factor": _factor_option()},
    "ntk": {"factor": _factor_option()},
    "dynamic": {"factor": _factor_option(), "original_max_positions": _original_length_option()},
    "yarn": {
        "factor": _factor_option(),
        "original_max_positions": _original_length_option(),
        "beta_fast": Option(32.0, (float, int), "rotations where extrapolation ends", lambda v: v > 0, "> 0"),
        "beta_slow": Option(1.0, (float, int), "rotations where interpolation starts", lambda v: v > 0, "> 0"),
        "mscale": Option(None, (float, int), "attention factor numerator scale (DeepSeek)", lambda v: v > 0, "> 0"),
        "mscale_all_dim": Option(None, (float, int), "attention factor denominator scale", lambda v: v > 0, "> 0"),
        "attention_factor": Option(None, (float, int), "attention factor (None: from factor)", lambda v: v > 0, "> 0"),
        "truncate": Option(True, (bool,), "round the correction range to whole dimensions"),
    },
    "longrope": {
        "factor": _factor_option(),
        "original_max_positions": _original_length_option(),
        "short_factor": Option(None, (list,), "per-frequency divisors up to the original length (d / 2 numbers)"),
        "long_factor": Option(None, (list,), "per-frequency divisors past the original length (d / 2 numbers)"),
        "attention_factor": Option(None, (float, int), "attention factor (None: from factor)", lambda v: v > 0, "> 0"),
    },
    "llama3": {
        "factor": _factor_option(),
        "original_max_positions": _original_length_option(),
        "low_freq_factor": Option(
            1.0, (float, int), "original length / longest wavelength kept", lambda v: v > 0, "> 0"
        ),
        "high_freq_factor": Option(
            4.0, (float, int), "original length / shortest wavelength scaled", lambda v: v > 0, "> 0"
        ),
    },
}


TRANSFORMERS_SCALING_KEYS = {"rope_type": "type", "original_max_position_embeddings": "original_max_positions"}
"""Keys of a Transformers ``rope_parameters`` dict accepted in ``scaling`` for this library's names."""
TRANSFORMERS_SCALING_NAMES = {ours: theirs for theirs, ours in TRANSFORMERS_SCALING_KEYS.items()}


def resolve_rope_scaling(scaling: dict[str, Any]) -> dict[str, Any]:
    """The full ``scaling`` dict of ``rope`` (defaults filled in); ``ValueError`` naming a bad key or value.
    Transformers' names ``rope_type`` and ``original_max_position_embeddings`` are read as ``type`` and
    ``original_max_positions`` (:data:`TRANSFORMERS_SCALING_KEYS`); the resolved dict uses this library's names."""
    scaling = dict(scaling)
    for theirs, ours in TRANSFORMERS_SCALING_KEYS.items():
        if theirs not in scaling:
            continue
        if ours in scaling and scaling[ours] != scaling[theirs]:
            raise ValueError(
                f"position_encoding 'rope': scaling gives {ours}={scaling[ours]!r} and its Transformers name "
                f"{theirs}={scaling[theirs]!r}; give one."
            )
        scaling[ours] = scaling.pop(theirs)
    kind = scaling.get("type")
    if kind not in ROPE_SCALING_OPTIONS:
        raise ValueError(
            f"position_encoding 'rope': scaling type {kind!r} is unknown; valid types: {list(ROPE_SCALING_OPTIONS)}."
        )
    options = ROPE_SCALING_OPTIONS[kind]
    unknown = sorted(set(scaling) - {"type"} - set(options))
    if unknown:
        raise ValueError(
            f"position_encoding 'rope': unknown scaling option(s) {unknown} for {kind!r}; valid: {list(options)}."
        )
    if scaling.get("factor") is None:
        raise ValueError(f"position_encoding 'rope': scaling {kind!r} needs a 'factor' (a number >= 1).")
    owner = f"position_encoding 'rope' scaling {kind!r}"
    resolved = {"type": kind}
    for key, option in options.items():
        resolved[key] = option.validate(owner, key, scaling.get(key, option.default))
    if kind == "llama3" and resolved["high_freq_factor"] <= resolved["low_freq_factor"]:
        raise ValueError(f"{owner}: high_freq_factor must be larger than low_freq_factor, got {resolved}.")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            factors = resolved[key]
            numbers = factors and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in factors)
            if not numbers:
                raise ValueError(f"{owner}: {key} must be a list of numbers (one per frequency); got {factors!r}.")
    if kind == "yarn" and resolved["beta_fast"] < resolved["beta_slow"]:
        raise ValueError(
            f"{owner}: beta_fast={resolved['beta_fast']} must be >= beta_slow={resolved['beta_slow']} (the ramp runs "
            "from the dimensions turning beta_fast times over the original length to those turning beta_slow times)."
        )
    return resolved


TRANSFORMERS_SCALINGS = ("linear", "yarn", "llama3", "longrope")
"""The ``scaling`` types whose frequencies and attention factor Transformers computes
(``modeling_rope_utils.ROPE_INIT_FUNCTIONS``); ``ntk`` (Transformers has no static NTK-aware type) and ``dynamic``
(per token, see :class:`RoPE`) are computed here."""


def transformers_rope_parameters(
    rotary_dim: int, theta: float, scaling: dict[str, Any], original: int, beyond_original: bool = False
) -> tuple[torch.Tensor, float]:
    """``(rotary_dim / 2,)`` inverse frequencies (float64 copies of Transformers' float32 values) and the attention
    factor of a :data:`TRANSFORMERS_SCALINGS` scaling, from ``ROPE_INIT_FUNCTIONS[type]`` for a Llama config of
    ``head_dim = rotary_dim`` with these settings: the numbers stock Llama-family models compute (Transformers 5.15 to
    5.24). ``beyond_original``: longrope's frequencies past the original length (its ``long_factor``)."""
    kind = scaling["type"]
    parameters = {
        TRANSFORMERS_SCALING_NAMES.get(key, key): value
        for key, value in scaling.items()
        if key != "type" and value is not None
    }
    if "original_max_positions" in ROPE_SCALING_OPTIONS[kind]:
        parameters["original_max_position_embeddings"] = original
    config = LlamaConfig(
        hidden_size=rotary_dim,
        num_attention_heads=1,
        head_dim=rotary_dim,
        max_position_embeddings=math.ceil(original * scaling["factor"]),
        rope_parameters={"rope_type": kind, "rope_theta": theta, **parameters},
    )
    seq_len = original + 1 if beyond_original else original
    # On the CPU even inside from_pretrained's meta-device context: Transformers' functions copy to `device`.
    with torch.device("cpu"):
        inverse_frequencies, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
    return inverse_frequencies.double(), float(attention_factor)


def check_longrope_factors(scaling: dict[str, Any], rotary_dim: int) -> None:
    """``ValueError`` unless longrope's ``short_factor`` and ``long_factor`` give one number per frequency."""
    for key in ("short_factor", "long_factor") if scaling["type"] == "longrope" else ():
        if len(scaling[key]) != rotary_dim // 2:
            raise ValueError(
                f"position_encoding 'rope' scaling 'longrope': {key} has {len(scaling[key])} numbers; it needs one "
                f"per rotated frequency, {rotary_dim // 2} (head_dim * rotary_fraction / 2)."
            )


class RoPE(PositionEncoding):
    """Rotary position embedding: ``q_m -> R_m q_m``, ``k_n -> R_n k_n``, so ``<R_m q, R_n k> = <q, R_(n-m) k>``.

    ``R_m`` rotates feature pairs by the angles ``m * theta^(-2i/d)``. Source: Su et al. 2021 (RoFormer);
    kexue.fm/archives/8130 "融合式". Keys are rotated before they enter the KV cache, so cached keys keep their
    positions. Two options rotate only part of each head, differently:

    * ``rotary_fraction`` ``f`` < 1 (GPT-NeoX's ``rotary_pct``, Transformers' ``partial_rotary_factor``): the first
      ``f d`` features are rotated with frequencies spread over them, ``theta^(-2i/(f d))``, from 1 down to about
      ``1/theta``; the other features carry no position;
    * ``kept_frequency_fraction`` ``p`` < 1 (p-RoPE, Barbero et al. 2024, arXiv 2410.06205): every feature pair keeps
      its RoPE frequency of the whole head, ``theta^(-2i/d)``, and only the highest ``floor(p d / 2)`` of them rotate;
      the lowest ones are set to 0, so their pairs turn by the angle 0 (the identity) and carry no position, left as
      semantic channels (:func:`keep_highest_frequencies`, as the paper's ``apply_p_rope`` and Transformers'
      ``proportional`` RoPE of Gemma 4 pick them). ``p = 1`` is RoPE; the paper's ``0-RoPE`` (NoPE) is ``none``.

    The two cannot be combined (``rotary_fraction`` already spreads the whole frequency range over fewer features),
    and p-RoPE takes ``linear`` scaling only (every kept frequency divided by ``factor``, as Gemma's ``apply_rope``
    with a ``rope_proportion``): the other scalings are formulas of the full spectrum that move the lowest
    frequencies most, the very ones p-RoPE removes.

    ``apply_to_value``: values are rotated by their positions too (kexue.fm/archives/8130, "融合式": "if explicit
    absolute positions are still needed, apply it to v as well"), so ``o_i = sum_j a_ij R_j v_j`` carries absolute
    positions and the model is no longer shift-invariant.

    ``vo_rope`` (VO-RoPE, Su Jianlin, kexue.fm/archives/10862; DeepSeek-V4): the values' rotary features are rotated
    by the key's position and each output rotated back by its query's, ``o_i = R_i^T sum_j a_ij R_j v_j =
    sum_j a_ij R_(j-i) v_j``: the value path is relative too, and the model stays shift-invariant. The values are
    rotated before the KV cache (so cached values carry their own positions), the output by
    :meth:`transform_output`; the attention factor of a scaling stays on q and k.

    ``scaling`` = ``{"type": ..., "factor": ..., ...}`` runs inputs longer than the ``original_max_positions`` the
    model was trained on (default ``max_position_embeddings``). Where Transformers has the type (``linear``,
    ``yarn``, ``llama3``, ``longrope``: :data:`TRANSFORMERS_SCALINGS`) its ``modeling_rope_utils.ROPE_INIT_FUNCTIONS``
    computes the frequencies and the attention factor (:func:`transformers_rope_parameters`), so a converted
    Llama-family checkpoint rotates by the same numbers; ``ntk`` and ``dynamic`` are computed here:

    * ``linear`` (position interpolation, Chen et al. 2023): ``theta^(-2i/d) / factor``;
    * ``ntk`` (NTK-aware, bloc97 2023): the base ``theta * factor^(d/(d-2))``;
    * ``dynamic`` (dynamic NTK, emozilla 2023; Transformers' ``dynamic`` computes one base per forward from the
      sequence length, not per token): the base ``theta * (factor L / L0 - (factor - 1))^(d/(d-2))`` with
      ``L0 = original_max_positions`` and, for each token, ``L = max(L0, its position + 1)``: a token is rotated
      with the base of the length it ends (Transformers' cached generation does the same for keys, one step at a
      time). A length shared by the forward (the largest position + 1) would make cache = no cache fail: the cached
      keys and, through them, every later layer's states of earlier tokens were computed with a shorter length.
      Below ``L0`` it is plain RoPE; beyond, scores are no longer a function of ``i - j`` alone;
    * ``yarn`` (Peng et al. 2023): per-dimension ramp between the original and interpolated frequencies, and the
      rotated features of q, k multiplied by the attention factor ``0.1 ln(factor) + 1`` (or DeepSeek's ``mscale``
      ratio; the factor rides on cos and sin, as in Transformers, so with ``rotary_fraction`` < 1 the features that
      carry no position keep their scale);
    * ``llama3`` (Llama 3.1): wavelength-banded interpolation;
    * ``longrope`` (Phi-3, Ding et al. 2024): frequencies divided by ``short_factor`` per frequency, by
      ``long_factor`` past the original length, the rotated features of q and k times ``sqrt(1 + ln(factor) /
      ln(L0))``. Transformers picks the long factors for a whole forward once it is longer than ``L0``; here, as for
      ``dynamic``, each token by its own position (cache = no cache), so beyond ``L0`` it is not shift-invariant.
    """

    name = "rope"
    parallel_refusals = {}
    description = "rotary: rotate q and k by position (Su et al. 2021)"
    relative = True
    relative_unless = "apply_to_value, or scaling of type 'dynamic' or 'longrope'"
    options = {
        "theta": Option(10000.0, (float, int), "rotation base", lambda v: v > 1, "a number > 1"),
        "rotary_fraction": Option(
            1.0, (float, int), "fraction of each head's features rotated", lambda v: 0 < v <= 1, "0 < x <= 1"
        ),
        "kept_frequency_fraction": Option(
            1.0,
            (float, int),
            "p-RoPE: fraction of the highest frequencies kept; the lowest turn by angle 0 (Barbero et al. 2024)",
            lambda v: 0 < v <= 1,
            "0 < x <= 1",
        ),
        "apply_to_value": Option(False, (bool,), "rotate v too (absolute positions in the output)"),
        "vo_rope": Option(
            False, (bool,), "VO-RoPE: rotate v by the key's position and the output back by the query's (relative)"
        ),
        "scaling": Option(
            None, (dict,), "longer inputs: {'type': linear|ntk|dynamic|yarn|llama3|longrope, 'factor': ..., ...}"
        ),
    }

    @classmethod
    def check_spec(cls, spec):
        if spec["scaling"] is not None:
            spec["scaling"] = resolve_rope_scaling(spec["scaling"])
        if spec["vo_rope"] and spec["apply_to_value"]:
            raise ValueError(
                "position_encoding 'rope': vo_rope=True (values rotated by the key's position, the output back by the "
                "query's: relative) and apply_to_value=True (values rotated, the output not: absolute) are two forms "
                "of rotating the values; give one of them."
            )
        if spec["kept_frequency_fraction"] == 1:
            return
        if spec["rotary_fraction"] != 1:
            raise ValueError(
                f"position_encoding 'rope': kept_frequency_fraction={spec['kept_frequency_fraction']} (p-RoPE: the "
                f"highest frequencies of the whole head rotate) and rotary_fraction={spec['rotary_fraction']} (the "
                "first features rotate, with the whole frequency range spread over them) are two ways to rotate part "
                "of a head; give one of them."
            )
        if spec["scaling"] is not None and spec["scaling"]["type"] != "linear":
            raise ValueError(
                f"position_encoding 'rope': scaling {spec['scaling']['type']!r} with kept_frequency_fraction="
                f"{spec['kept_frequency_fraction']}: this scaling is a formula of the full spectrum that moves the "
                "lowest frequencies most, which p-RoPE removes; p-RoPE takes scaling 'linear' only (or none)."
            )

    @classmethod
    def check_sizes(cls, spec, hidden_size, max_position_embeddings):
        original = (spec["scaling"] or {}).get("original_max_positions")
        if original is not None and original > max_position_embeddings:
            raise ValueError(
                f"position_encoding 'rope' scaling {spec['scaling']['type']!r}: original_max_positions={original} is "
                f"beyond max_position_embeddings={max_position_embeddings}; scaling lengthens the original length "
                "(set max_position_embeddings to the length the scaled model runs, or lower original_max_positions)."
            )

    @classmethod
    def is_relative(cls, spec):
        """Shift-invariant unless ``apply_to_value`` (values carry absolute positions) or ``dynamic`` / ``longrope``
        scaling (the frequencies depend on each token's own position past the original length)."""
        scaling = spec["scaling"] or {}
        return not spec["apply_to_value"] and scaling.get("type") not in ("dynamic", "longrope")

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        self.rotary_dim = int(dims.head_dim * spec["rotary_fraction"]) // 2 * 2
        if self.rotary_dim < 2:
            raise ValueError(
                f"rope: rotary_fraction={spec['rotary_fraction']} of head_dim={dims.head_dim} rotates "
                f"{self.rotary_dim} features; it must rotate at least 2 (raise rotary_fraction)."
            )
        # rotary_dim is the whole (even) head when kept_frequency_fraction < 1 (check_spec).
        self.kept_frequencies = int(spec["kept_frequency_fraction"] * self.rotary_dim // 2)
        if self.kept_frequencies < 1:
            raise ValueError(
                f"rope: kept_frequency_fraction={spec['kept_frequency_fraction']} of head_dim={dims.head_dim} keeps "
                "no frequency (floor(p * head_dim / 2) = 0); raise it, or use position_encoding 'none' (NoPE)."
            )
        self.scaling = spec["scaling"]
        self.attention_factor = 1.0
        # Fixed for the model: computed once by Transformers, kept as float64 attributes (not buffers a cast rounds).
        self.scaled_frequencies: tuple[torch.Tensor, ...] = ()
        if self.scaling is not None and self.scaling["type"] in TRANSFORMERS_SCALINGS:
            check_longrope_factors(self.scaling, self.rotary_dim)
            parameters = [
                transformers_rope_parameters(
                    self.rotary_dim, spec["theta"], self.scaling, self.original_max_positions, beyond_original
                )
                for beyond_original in ((False, True) if self.scaling["type"] == "longrope" else (False,))
            ]
            self.scaled_frequencies = tuple(frequencies for frequencies, _ in parameters)
            self.attention_factor = parameters[0][1]

    @property
    def original_max_positions(self) -> int:
        return self.scaling.get("original_max_positions") or self.dims.max_positions

    def inverse_frequencies(self, positions: torch.Tensor) -> torch.Tensor:
        """Float64 inverse frequencies, ``(1, 1, d/2)``, or ``(batch|1, seq, d/2)`` for ``dynamic`` and ``longrope``,
        whose frequencies depend on each token's position (``positions`` ``(batch|1, seq)``)."""
        theta, dim = self.spec["theta"], self.rotary_dim
        kind = None if self.scaling is None else self.scaling["type"]
        device = positions.device
        if kind is None:
            return rotary_inverse_frequencies(dim, theta).to(device)[None, None]
        if kind == "longrope":  # per token: long_factor for a token past the original length, as for dynamic
            short, long = (frequencies.to(device) for frequencies in self.scaled_frequencies)
            return torch.where(positions[..., None] + 1 > self.original_max_positions, long, short)
        if kind in TRANSFORMERS_SCALINGS:
            return self.scaled_frequencies[0].to(device)[None, None]
        factor = self.scaling["factor"]
        if kind == "ntk":
            return rotary_inverse_frequencies(dim, theta * factor ** (dim / (dim - 2))).to(device)[None, None]
        original = self.original_max_positions
        length = (positions[..., None] + 1).clamp(min=original).double()
        base = theta * (factor * length / original - (factor - 1)) ** (dim / (dim - 2))
        return base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)

    def prepare(self, query_positions, key_positions, backend, consecutive=False):
        # Frequencies in float64, angles in float32, for each forward: a model cast to bf16 keeps exact rotations.
        inv_freq = keep_highest_frequencies(self.inverse_frequencies(query_positions), self.kept_frequencies).float()
        angles = (query_positions[..., None].float() * inv_freq)[:, None]
        return {"cos": angles.cos(), "sin": angles.sin()}

    def transform_qkv(self, query, key, value, tables):
        cos, sin = tables["cos"], tables["sin"]
        if self.spec["apply_to_value"] or self.spec["vo_rope"]:
            value = apply_rotary(value, cos.to(value.dtype), sin.to(value.dtype))
        # The attention factor rides on cos and sin, as in Transformers' rotary embeddings: it scales the rotated
        # features only, and with rotary_fraction < 1 the others keep their scale (GPT-NeoX, Phi-3).
        cos, sin = cos * self.attention_factor, sin * self.attention_factor
        query = apply_rotary(query, cos.to(query.dtype), sin.to(query.dtype))
        key = apply_rotary(key, cos.to(key.dtype), sin.to(key.dtype))
        return query, key, value

    def transform_output(self, output, tables):
        if not self.spec["vo_rope"]:
            return output
        return apply_rotary(output, tables["cos"].to(output.dtype), -tables["sin"].to(output.dtype))  # R_i^T o_i


def clamp_with_gradient_at_bounds(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``x.clamp(low, high)`` whose gradient is 1 on ``[low, high]`` bounds included, 0 outside. PoPE's phase bias
    starts at its bound 0 and learns from there in the reference (x-transformers' ``clamp``, written when torch
    passed the gradient at a bound); torch 2.14 passes none there, which would freeze the bias at its start."""
    inside = (x >= low) & (x <= high)
    return torch.where(inside, x, x.clamp(low, high).detach())


def xpos_decay_base(head_dim: int, gamma: float = 0.4) -> torch.Tensor:
    """xPos per-pair decay base ``zeta_i = (2i/d + gamma) / (1 + gamma)``, ``i = 0 .. d/2 - 1`` (Sun et al. 2022)."""
    return (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim + gamma) / (1 + gamma)


class XPos(PositionEncoding):
    """xPos: rotary with an exponential decay, ``q_n -> zeta^(n/s) R_n q_n``, ``k_m -> zeta^(-m/s) R_m k_m``, so the
    score of feature pair ``i`` is ``zeta_i^((n - m)/s)`` times its RoPE score: it depends only on ``n - m`` and
    decays with the distance to past keys (``zeta_i < 1``, :func:`xpos_decay_base`; ``s = scale_base``).

    Decoder only: to the right of the query (``m > n``) the factor grows instead, and a symmetric decay
    ``zeta^|n - m|`` cannot be split into a factor on q and one on k, so an encoder config raises ``ValueError``.
    Keys are scaled by their own absolute position before the KV cache, so each cached key keeps its scale (the
    reference implementation, torchscale, centres positions per forward, which a cache cannot follow). In float32 and
    bfloat16 this spans any practical length; in float16, ``zeta^(-m/s)`` exceeds the range past ``m`` of about
    ``8.8 s`` (4,500 at the default ``s = 512``). Source: Sun et al. 2022, "A Length-Extrapolatable Transformer".
    """

    name = "xpos"
    parallel_refusals = {"context": UNDECLARED_PARALLELISM, "sequence": UNDECLARED_PARALLELISM}
    description = "xPos: rotary with an exponential decay (scale on q, inverse on k), decoder (Sun et al. 2022)"
    relative = True
    families = ("decoder",)
    options = {
        "theta": Option(10000.0, (float, int), "rotation base", lambda v: v > 1, "a number > 1"),
        "scale_base": Option(512.0, (float, int), "decay length s", lambda v: v > 0, "a number > 0"),
    }

    def prepare(self, query_positions, key_positions, backend, consecutive=False):
        dim = self.dims.head_dim
        inv_freq = rotary_inverse_frequencies(dim, self.spec["theta"]).to(query_positions.device)
        angles = query_positions[:, None, :, None].float() * inv_freq.float()
        exponent = query_positions[:, None, :, None].double() / self.spec["scale_base"]
        decay = xpos_decay_base(dim).to(query_positions.device)
        query_scale, key_scale = (decay**exponent).float(), (decay ** (-exponent)).float()
        cos, sin = angles.cos(), angles.sin()
        return {
            "query_cos": cos * query_scale,
            "query_sin": sin * query_scale,
            "key_cos": cos * key_scale,
            "key_sin": sin * key_scale,
        }

    def transform_qkv(self, query, key, value, tables):
        query = apply_rotary(query, tables["query_cos"].to(query.dtype), tables["query_sin"].to(query.dtype))
        key = apply_rotary(key, tables["key_cos"].to(key.dtype), tables["key_sin"].to(key.dtype))
        return query, key, value


def polar_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """PoPE's ``theta_c = theta^(-c/d)``, ``c = 0 .. d - 1``: one frequency per feature (RoPE has one per pair),
    float64."""
    return theta ** (-torch.arange(head_dim, dtype=torch.float64) / head_dim)


def polar_features(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``[softplus(x) cos(phi), softplus(x) sin(phi)]``: each of the ``d`` real features of ``x`` ``(batch, heads,
    seq, d)`` becomes a complex number of magnitude ``softplus(x_c)`` and phase ``phi_c`` (``cos``, ``sin``
    broadcasting to ``x``), written as ``2 d`` real features; computed in at least float32, returned in ``x``'s
    dtype."""
    magnitude = F.softplus(x.to(torch.promote_types(x.dtype, torch.float32)))
    return torch.cat((magnitude * cos, magnitude * sin), dim=-1).to(x.dtype)


class PoPE(PositionEncoding):
    """PoPE, polar coordinate position embeddings (Gopalakrishnan, Csordás, Schmidhuber, Mozer 2025,
    arXiv 2509.10534; x-transformers' ``PolarEmbedding`` and ``apply_polar_pos_emb``): each of the ``d`` features of
    a head is a complex number whose magnitude comes from the content and whose phase from the position only,

        ``q~_tc = softplus(q_tc) e^{i t theta_c}``, ``k~_sc = softplus(k_sc) e^{i (s theta_c + delta_c)}``,
        ``score_ts = Re sum_c q~_tc conj(k~_sc) = sum_c softplus(q_tc) softplus(k_sc) cos((t - s) theta_c - delta_c)``,

    with ``theta_c = theta^(-c/d)``, ``c = 0 .. d - 1`` (:func:`polar_frequencies`; d frequencies, where RoPE has
    d/2) and ``delta`` ``(heads, d)`` a learned key phase bias shared by all layers (``phase_bias``; as
    x-transformers: zeros at init, read clamped to ``[-2 pi, 0]``). ``delta`` is subtracted from the query's phase
    rather than added to the key's, which gives the same scores and keeps one ``delta`` per query head under
    grouped-query attention (keys shared by several query heads). Written in real numbers, q and k of width ``d``
    become ``[m cos, m sin]`` of width ``2 d`` (:func:`polar_features`), so ``q~ . k~`` is the sum above and every
    backend runs it unchanged (v keeps width ``d``; the KV cache stores the transformed keys, so cached keys keep
    their phases). The layer's ``1/sqrt(d)`` scaling stays that of the ``d`` features of the head, as x-transformers
    applies its ``dim_head ** -0.5`` to the polar features. Relative: the score depends on ``t - s`` only.
    """

    name = "pope"
    parallel_refusals = {
        "context": UNDECLARED_PARALLELISM,
        "sequence": UNDECLARED_PARALLELISM,
    }
    description = "PoPE: softplus magnitudes from the content, phases from position, learned key phase bias"
    relative = True
    options = {
        "theta": Option(10000.0, (float, int), "frequency base: theta_c = theta^(-c/d)", lambda v: v > 1, "> 1"),
        "phase_bias": Option(True, (bool,), "learned key phase bias delta per head and frequency, in [-2 pi, 0]"),
    }

    def __init__(self, spec, dims):
        super().__init__(spec, dims)
        self.phase_bias = nn.Parameter(torch.zeros(dims.num_heads, dims.head_dim)) if spec["phase_bias"] else None

    def init_weights(self, initializer_range):
        if self.phase_bias is not None:
            init.zeros_(self.phase_bias)

    def prepare(self, query_positions, key_positions, backend, consecutive=False):
        # Frequencies in float64, phases in float32, each forward: a model cast to bf16 keeps exact phases.
        frequencies = polar_frequencies(self.dims.head_dim, self.spec["theta"]).to(query_positions.device).float()
        phases = (query_positions[..., None].float() * frequencies)[:, None]  # (batch|1, 1, seq, d)
        query_phases = phases
        if self.phase_bias is not None:  # t theta - delta on q: cos((t - s) theta - delta), as delta on k
            phase_bias = clamp_with_gradient_at_bounds(self.heads_read(self.phase_bias).float(), -2 * math.pi, 0.0)
            query_phases = phases - phase_bias[None, :, None, :]
        return {
            "query_cos": query_phases.cos(),
            "query_sin": query_phases.sin(),
            "key_cos": phases.cos(),
            "key_sin": phases.sin(),
        }

    def transform_qkv(self, query, key, value, tables):
        query = polar_features(query, tables["query_cos"], tables["query_sin"])
        key = polar_features(key, tables["key_cos"], tables["key_sin"])
        return query, key, value
