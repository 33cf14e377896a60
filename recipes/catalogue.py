"""The names and options of every position encoding and attention normalizer, read without torch.

``catalogue.json`` beside this module is a snapshot of hf_posenc's two registries (``POSITION_ENCODINGS``,
``ATTENTION_NORMALIZERS``, the one source of names and options), written by ``python -m hf_posenc_recipes.catalogue``;
``tests/test_cli.py`` fails when it differs from them. The command checks flag values against it while parsing, so an
unknown name, an unknown option, an option of the wrong type or a number out of its range stops a recipe before torch
is imported. Constraints between options, and the choices of a string option, are checked by the config
(:func:`hf_posenc.options.resolve_spec`) once torch is loaded, still before any work.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any


KINDS = ("position_encoding", "attention_normalizer")
JSON_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "dict": dict}
"""The option types a scheme may declare, by name: every one is a value JSON can hold."""


def build_catalogue() -> dict[str, dict[str, Any]]:
    """``{kind: {name: {"families": [...], "options": {key: {"default", "types", "valid"}}}}}`` from the registries,
    and ``{"layout": {name: {"description", "local_attention"}}}`` from the records of :data:`hf_posenc.LAYOUT_PRESETS`
    (imports hf_posenc, hence torch)."""
    from hf_posenc.attention_normalizers import ATTENTION_NORMALIZERS
    from hf_posenc.configuration_posenc import LAYOUT_PRESETS
    from hf_posenc.position_encodings import POSITION_ENCODINGS

    registries = {"position_encoding": POSITION_ENCODINGS, "attention_normalizer": ATTENTION_NORMALIZERS}
    entries = {
        kind: {
            name: {
                "families": list(entry.families),
                "options": {key: describe_option(option) for key, option in entry.options.items()},
            }
            for name, entry in registries[kind].items()
        }
        for kind in KINDS
    }
    layouts = {
        name: {"description": preset.description, "local_attention": preset.local_attention}
        for name, preset in LAYOUT_PRESETS.items()
    }
    return {**entries, "layout": layouts}


def describe_option(option) -> dict[str, Any]:
    """An :class:`hf_posenc.options.Option` as the catalogue stores it: default, type names, the valid values in
    words and, for a number, as a :func:`number_range` record."""
    types = [kind.__name__ for kind in option.types]
    ranged = option.check is not None and any(kind in types for kind in ("int", "float"))
    return {
        "default": option.default,
        "types": types,
        "valid": option.valid,
        "range": number_range(option.valid) if ranged else None,
    }


NUMBER_PHRASES = (
    (r"(?:an? )?(?:finite )?(?:(even) )?(?:number|int)? ?(>=|>) (-?[\d.]+)", "bound"),
    (r"(-?[\d.]+) (<=|<) x (<=|<) (-?[\d.]+)", "between"),
    (r"a number in ([(\[])(-?[\d.]+), (-?[\d.]+)([)\]])", "interval"),
    (r"(?:a )?finite(?: number)?", "finite"),
    (r"1/m for an integer m >= 1(?: \(.*\))?", "reciprocal"),
)
"""How an option's ``valid`` words give a number's range (each phrase may also say ``finite``)."""


def number_range(valid: str) -> dict[str, Any]:
    """The range of a number option from its ``valid`` words (``"an int >= 1"``, ``"0 < x <= 1"``, ``"a number in
    (0, 1)"``, ``"a finite number > 0"``, ``'"learned" or a finite number'``, ``"1/m for an integer m >= 1"``): any
    of ``minimum``, ``exclusive_minimum``, ``maximum``, ``exclusive_maximum``, ``multiple_of``, ``finite``,
    ``reciprocal_of_integer``. Quoted choices (a
    string's) are left to the config. ``ValueError`` for words no phrase reads: phrase the option's ``valid`` so
    that one does (``tests/test_cli.py`` checks each record against the option's own check)."""
    numbers = [part for part in re.split(r" or ", valid) if not re.fullmatch(r"""(['"]).*\1""", part)]
    if len(numbers) != 1:
        raise ValueError(f"valid {valid!r}: expected one phrase about numbers, found {numbers}.")
    phrase, record = numbers[0], {}
    if "finite" in phrase:
        record["finite"] = True
    for pattern, form in NUMBER_PHRASES:
        match = re.fullmatch(pattern, phrase)
        if match is None:
            continue
        if form == "bound":
            even, sign, bound = match.groups()
            record["minimum" if sign == ">=" else "exclusive_minimum"] = json.loads(bound)
            if even:
                record["multiple_of"] = 2
        elif form == "between":
            low, low_sign, high_sign, high = match.groups()
            record["minimum" if low_sign == "<=" else "exclusive_minimum"] = json.loads(low)
            record["maximum" if high_sign == "<=" else "exclusive_maximum"] = json.loads(high)
        elif form == "reciprocal":
            record.update(exclusive_minimum=0, maximum=1, reciprocal_of_integer=True)
        elif form == "interval":
            opening, low, high, closing = match.groups()
            record["minimum" if opening == "[" else "exclusive_minimum"] = json.loads(low)
            record["maximum" if closing == "]" else "exclusive_maximum"] = json.loads(high)
        return record
    raise ValueError(f"valid {valid!r}: no phrase of NUMBER_PHRASES reads {phrase!r}.")


def in_range(value: Any, record: dict[str, Any] | None) -> bool:
    """Whether a number lies in a :func:`number_range` record (anything else, or no record: True, left to the
    config)."""
    if record is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return True
    if record.get("finite") and not math.isfinite(value):
        return False
    bounds = {
        "minimum": lambda bound: value >= bound,
        "exclusive_minimum": lambda bound: value > bound,
        "maximum": lambda bound: value <= bound,
        "exclusive_maximum": lambda bound: value < bound,
        "multiple_of": lambda step: value % step == 0,
        "reciprocal_of_integer": lambda _: value != 0 and abs(1 / value - round(1 / value)) < 1e-6,
    }
    return all(holds(record[key]) for key, holds in bounds.items() if key in record)


def catalogue_text(catalogue: dict[str, dict[str, Any]]) -> str:
    return json.dumps(catalogue, indent=1) + "\n"


@cache
def load_catalogue() -> dict[str, dict[str, Any]]:
    """The snapshot shipped with the command."""
    return json.loads(resources.files(__package__).joinpath("catalogue.json").read_text())


def names(kind: str) -> list[str]:
    """The registered names of ``kind`` (``"position_encoding"``, ``"attention_normalizer"`` or ``"layout"``, the
    presets of :data:`hf_posenc.LAYOUT_PRESETS`)."""
    return list(load_catalogue()[kind])


def check_spec(kind: str, value: str | dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the bad value and the valid choices if ``value`` (a name, or a dict ``{"type": name,
    **options}``) names no registered entry of ``kind``, or gives an unknown option or one of the wrong type."""
    entries = load_catalogue()[kind]
    spec = {"type": value} if isinstance(value, str) else value
    if not isinstance(spec, dict) or "type" not in spec:
        raise ValueError(
            f"{kind} {value!r}: give a name or a dict {{'type': name, **options}}; valid names: {sorted(entries)}."
        )
    name = spec["type"]
    if name not in entries:
        raise ValueError(f"unknown {kind} {name!r}; valid choices: {sorted(entries)}.")
    options = entries[name]["options"]
    unknown = sorted(set(spec) - {"type"} - set(options))
    if unknown:
        valid = sorted(options) or "none"
        raise ValueError(f"unknown option(s) {unknown} for {kind} {name!r}; valid options: {valid}.")
    for key, given in spec.items():
        if key != "type":
            check_type(f"{kind} {name!r}", key, given, options[key])
            if not in_range(given, options[key]["range"]):
                valid = options[key]["valid"]
                raise ValueError(f"{kind} {name!r}: option {key!r}={given!r} is out of range; valid: {valid}.")


def check_type(owner: str, key: str, value: Any, option: dict[str, Any]) -> None:
    """As :meth:`hf_posenc.options.Option.validate` checks the type: None where the default is None, never a bool for
    a number."""
    if value is None and option["default"] is None:
        return
    types = tuple(JSON_TYPES[name] for name in option["types"])
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        expected = " or ".join(option["types"])
        raise ValueError(f"{owner}: option {key!r} must be {expected}, got {value!r} ({type(value).__name__}).")


if __name__ == "__main__":
    path = Path(__file__).with_name("catalogue.json")
    path.write_text(catalogue_text(build_catalogue()))
    print(f"written: {path}")
