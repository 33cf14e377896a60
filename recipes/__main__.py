"""``python -m hf_posenc_recipes <recipe> ...`` (and ``accelerate launch -m hf_posenc_recipes <recipe> ...``): exits
with the status :func:`hf_posenc_recipes.cli.main` returns."""

from hf_posenc_recipes.cli import main


raise SystemExit(main())
