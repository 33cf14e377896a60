"""The position probe over a grid of family x scheme x normalizer variant: ``hf-posenc probe``
(``hf_posenc.probe_grid``) as a script (the same exit status and errors), for ``accelerate launch`` and ``torchrun``.

    accelerate launch recipes/probe.py --help
"""

import sys

from hf_posenc_cli import main


if __name__ == "__main__":
    raise SystemExit(main(["probe", *sys.argv[1:]]))
