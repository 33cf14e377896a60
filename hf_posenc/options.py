"""Typed options of catalogue entries (position encodings and attention normalizers) and their validation.

A config stores a scheme as ``{"type": name, **options}``. :func:`resolve_spec` turns what a user wrote (a name or
such a dict) into the full dict with every default filled in, and raises ``ValueError`` naming the bad key or value
and the valid choices.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


PARALLELISMS = {
    "tensor": "tensor parallelism (each rank computes a share of the heads)",
    "context": "context parallelism (each rank holds a share of the sequence; torch's ring attention)",
    "sequence": "sequence parallelism (Ulysses: each rank embeds a share of the sequence, then attends a share of "
    "the heads over all of it)",
}
"""The parallelisms a catalogue entry answers for (:meth:`CatalogueEntry.parallelism_refusal`): what each splits."""

UNDECLARED_PARALLELISM = "it does not declare that its formula holds when the work is split this way"
RING_ATTENTION_ONLY = (
    "torch's ring attention runs plain SDPA on each block of keys (softmax of q.k, causal or full; no bias, mask or "
    "other term)"
)
ULYSSES_KERNEL_ONLY = "Ulysses wraps a Transformers attention kernel (SDPA, flash), which computes softmax of q.k only"
ALONG_THE_SEQUENCE = "it is computed along the sequence, so a rank holding a share of the sequence computes another"
NOT_SLICED_BY_RANK = "one row per head, built for every head and not sliced by rank"


@dataclass(frozen=True)
class Option:
    """One option of a scheme: its default, accepted types, a range check and a one-line description."""

    default: Any
    types: tuple[type, ...]
    doc: str
    check: Callable[[Any], bool] | None = None
    valid: str = ""

    @classmethod
    def int_at_least(cls, default: int | None, doc: str, minimum: int) -> Option:
        """An int option whose values start at ``minimum``: the check and its words, ``"an int >= minimum"``."""
        return cls(default, (int,), doc, lambda v: v >= minimum, f"an int >= {minimum}")

    @classmethod
    def one_of(cls, default: str, doc: str, choices: tuple[str, ...]) -> Option:
        """A string option taking one of ``choices``: the check and its words, ``"'a', 'b' or 'c'"``."""
        quoted = [repr(choice) for choice in choices]
        words = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
        return cls(default, (str,), doc, lambda v: v in choices, words)

    def validate(self, owner: str, key: str, value: Any) -> Any:
        if value is None and self.default is None:
            return None
        # bool is an int subclass: never accept True for an int option, nor 1 for a bool option.
        type_ok = isinstance(value, self.types) and (bool in self.types or not isinstance(value, bool))
        if not type_ok:
            names = " or ".join(t.__name__ for t in self.types)
            raise ValueError(f"{owner}: option {key!r} must be {names}, got {value!r} ({type(value).__name__}).")
        if self.check is not None and not self.check(value):
            raise ValueError(f"{owner}: option {key!r}={value!r} is out of range; valid: {self.valid}.")
        return (
            float(value)
            if float in self.types and isinstance(value, (int, float)) and not isinstance(value, bool)
            else value
        )


class CatalogueEntry:
    """Mixin for a named, documented scheme with typed options (see :class:`Option`)."""

    name: str = ""
    description: str = ""
    options: Mapping[str, Option] = {}

    backends: tuple[str, ...] = ()
    kind: str = ""
    """The config field that names the entry (``position_encoding``, ``attention_normalizer``), for messages."""
    families: tuple[str, ...] = ("encoder", "decoder")
    family_reason: str = ""
    """Why the entry has no form for a family it leaves out of ``families`` (said by :meth:`check_family`)."""
    parallel_refusals: Mapping[str, str] = dict.fromkeys(PARALLELISMS, UNDECLARED_PARALLELISM)
    """Why the entry cannot run under each parallelism of :data:`PARALLELISMS` it refuses; a parallelism left out runs
    it as one process would. Declared beside each formula; an entry that declares nothing is refused all three."""

    @classmethod
    def check_family(cls, spec: dict[str, Any], causal: bool) -> None:
        """Raise ``ValueError`` if the entry has no form for this family (``causal``: a decoder)."""
        family = "decoder" if causal else "encoder"
        if family not in cls.families:
            reason = f" ({cls.family_reason})" if cls.family_reason else ""
            raise ValueError(
                f"{cls.kind} {spec['type']!r} has no {family} form{reason}; it runs in: {list(cls.families)} "
                "(posenc_gpt2, or PosEncBertConfig(is_decoder=True), for a decoder)."
            )

    @classmethod
    def parallelism_refusal(cls, spec: dict[str, Any], parallelism: str) -> str | None:
        """Why the entry with these options (a resolved spec) cannot run under ``parallelism`` (a key of
        :data:`PARALLELISMS`), or None where it can."""
        if parallelism not in PARALLELISMS:
            raise ValueError(f"Unknown parallelism {parallelism!r}; valid choices: {list(PARALLELISMS)}.")
        return cls.parallel_refusals.get(parallelism)

    @classmethod
    def check_spec(cls, spec: dict[str, Any]) -> None:
        """Constraints between options (each option alone is already valid); raise ``ValueError``."""

    @classmethod
    def unused_options(cls, spec: dict[str, Any]) -> dict[str, str]:
        """Options (default None) that these options leave without effect, with the reason: given a value, they
        are refused rather than ignored."""
        return {}

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {
            "description": cls.description,
            "options": {key: {"default": opt.default, "doc": opt.doc} for key, opt in cls.options.items()},
            "backends": list(cls.backends),
        }


def resolve_spec(kind: str, value: Any, registry: Mapping[str, type[CatalogueEntry]]) -> dict[str, Any]:
    """Return ``{"type": name, **options}`` with defaults filled in; raise ``ValueError`` on anything unknown or bad.

    Args:
        kind: the config field, used in messages (``"position_encoding"``).
        value: a registered name, or a dict with a ``"type"`` key and options.
        registry: name -> entry class.
    """
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{kind} must be a name or a dict {{'type': name, **options}}, got {value!r}; "
            f"valid names: {sorted(registry)}."
        )
    if "type" not in value:
        raise ValueError(f"{kind} dict {dict(value)!r} has no 'type' key; valid types: {sorted(registry)}.")
    name = value["type"]
    if name not in registry:
        raise ValueError(f"Unknown {kind} {name!r}; valid choices: {sorted(registry)}.")
    entry = registry[name]
    unknown = sorted(set(value) - {"type"} - set(entry.options))
    if unknown:
        raise ValueError(
            f"Unknown option(s) {unknown} for {kind} {name!r}; valid options: {sorted(entry.options) or 'none'}."
        )
    spec: dict[str, Any] = {"type": name}
    for key, option in entry.options.items():
        spec[key] = option.validate(f"{kind} {name!r}", key, value.get(key, option.default))
    entry.check_spec(spec)
    for key, reason in entry.unused_options(spec).items():
        if value.get(key) is not None:
            raise ValueError(f"{kind} {name!r}: option {key!r}={value[key]!r} has no effect here: {reason}.")
    return spec
