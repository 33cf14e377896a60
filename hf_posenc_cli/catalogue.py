"""The names and options of every position encoding and attention normalizer, read without torch.

``catalogue.json`` beside this module is a snapshot of hf_posenc's two registries (``POSITION_ENCODINGS``,
``ATTENTION_NORMALIZERS``, the one source of names and options), written by ``python -m hf_posenc_cli.catalogue``;
``tests/test_cli.py`` fails when it differs from them. The command checks flag values against it while parsing, so an
unknown name, an unknown option or an option of the wrong type stops a recipe before torch is imported. Ranges and
constraints between options are checked by the config (:func:`hf_posenc.options.resolve_spec`) once torch is loaded,
still before any work.
"""

from __future__ import annotations

import json
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
    """An :class:`hf_posenc.options.Option` as the catalogue stores it: default, type names, valid range."""
    return {"default": option.default, "types": [kind.__name__ for kind in option.types], "valid": option.valid}


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
