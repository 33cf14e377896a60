"""``python -m hf_posenc_cli <recipe> ...`` (and ``accelerate launch -m hf_posenc_cli <recipe> ...``): exits with
the status :func:`hf_posenc_cli.main` returns."""

from hf_posenc_cli import main


raise SystemExit(main())
