"""The ``hf-posenc`` console command: ``hf-posenc compare | pretrain | extrapolate [flags]``.

``compare`` is the main job (:mod:`hf_posenc.compare`); ``pretrain`` trains one model (:mod:`hf_posenc.pretraining`);
``extrapolate`` measures saved models past their training length (:mod:`hf_posenc.extrapolation`). Each takes
``--help``. Under accelerate: ``accelerate launch -m hf_posenc.cli pretrain ...``.
"""

from __future__ import annotations

import sys


COMMANDS = {
    "compare": "pretrain one model per scheme on an equal budget and compare them",
    "pretrain": "pretrain one model (causal or masked LM) with accelerate",
    "extrapolate": "loss of saved models at 1x, 2x, 4x, 8x their training length",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hf-posenc {" + ",".join(COMMANDS) + "} [flags]\n")
        print("\n".join(f"  {name:<12} {what}" for name, what in COMMANDS.items()))
        raise SystemExit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        raise SystemExit(f"hf-posenc: unknown command {command!r}; valid: {', '.join(COMMANDS)}")
    if command == "compare":
        from .compare import main as run
    elif command == "pretrain":
        from .pretraining import main as run
    else:
        from .extrapolation import main as run
    run(rest)


if __name__ == "__main__":
    main()
