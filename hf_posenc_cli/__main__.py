"""``python -m hf_posenc_cli <recipe> ...`` (and ``accelerate launch -m hf_posenc_cli <recipe> ...``)."""

from hf_posenc_cli import main


main()
