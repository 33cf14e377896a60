"""Warm-start new position encodings on a pretrained checkpoint (retrofit, then MLM training): ``hf-posenc retrofit``
(``hf_posenc.warm_start``) as a script (the same exit status and errors), for ``accelerate launch`` and ``torchrun``.

    accelerate launch recipes/retrofit.py --help
"""

import sys

from hf_posenc_cli import main


if __name__ == "__main__":
    raise SystemExit(main(["retrofit", *sys.argv[1:]]))
