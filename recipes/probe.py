"""The position probe over a grid of family x scheme x normalizer variant: ``hf-posenc probe``
(``hf_posenc.probe_grid``) as a script, for ``accelerate launch`` and ``torchrun``.

    accelerate launch recipes/probe.py --help
"""

from hf_posenc.probe_grid import main


if __name__ == "__main__":
    main()
