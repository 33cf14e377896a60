"""Fine-tune and evaluate a checkpoint on a GLUE task: ``hf-posenc glue``
(``hf_posenc.glue``) as a script (the same exit status and errors), for ``accelerate launch`` and ``torchrun``.

    accelerate launch recipes/glue.py --help
"""

import sys

from hf_posenc_cli import main


if __name__ == "__main__":
    raise SystemExit(main(["glue", *sys.argv[1:]]))
