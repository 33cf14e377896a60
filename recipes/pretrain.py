"""Pretrain one PosEnc model (causal or masked LM) with accelerate: ``hf_posenc.pretraining`` as a script.

    accelerate launch recipes/pretrain.py --position_encoding alibi --output_dir out/alibi
    python recipes/pretrain.py --help

The recipe lives in the package (``hf_posenc/pretraining.py``) so that ``hf-posenc pretrain`` and
``hf-posenc compare`` run it from any install; this file is the entry point ``accelerate launch`` takes.
"""

from hf_posenc.pretraining import main


if __name__ == "__main__":
    main()
