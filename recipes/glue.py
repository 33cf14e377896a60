"""Fine-tune and evaluate a checkpoint on a GLUE task: ``hf-posenc glue``
(``hf_posenc.glue``) as a script, for ``accelerate launch`` and ``torchrun``.

    accelerate launch recipes/glue.py --help
"""

from hf_posenc.glue import main


if __name__ == "__main__":
    main()
