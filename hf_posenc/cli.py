"""``python -m hf_posenc.cli <recipe> ...``: the ``hf-posenc`` command (:mod:`hf_posenc_cli`) under its old module
name; ``hf_posenc_cli`` answers ``--help`` without importing torch, this module (inside ``hf_posenc``) cannot."""

from hf_posenc_cli import main


if __name__ == "__main__":
    raise SystemExit(main())
