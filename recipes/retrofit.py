"""Warm-start new position encodings on a pretrained checkpoint (retrofit, then MLM training): ``hf-posenc retrofit``
(``hf_posenc.warm_start``) as a script, for ``accelerate launch`` and ``torchrun``.

    accelerate launch recipes/retrofit.py --help
"""

from hf_posenc.warm_start import main


if __name__ == "__main__":
    main()
