"""Pretrain one PosEnc model (causal or masked LM) with accelerate: ``hf-posenc pretrain`` (``hf_posenc.pretraining``)
as a script, for ``accelerate launch`` and ``torchrun``.

    accelerate launch recipes/pretrain.py --position_encoding alibi --output_dir out/alibi
    python recipes/pretrain.py --help
"""

from hf_posenc.pretraining import main


if __name__ == "__main__":
    main()
