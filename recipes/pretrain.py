"""Pretrain one PosEnc model (causal or masked LM) with accelerate: ``hf-posenc pretrain`` (``hf_posenc.pretraining``)
as a script (the same exit status and errors), for ``accelerate launch`` and ``torchrun``.

    accelerate launch recipes/pretrain.py --position_encoding alibi --output_dir out/alibi
    python recipes/pretrain.py --help
"""

import sys

from hf_posenc_cli import main


if __name__ == "__main__":
    raise SystemExit(main(["pretrain", *sys.argv[1:]]))
