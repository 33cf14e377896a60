"""Loss of saved models at 1x, 2x, 4x, 8x their training length (sliding windows scored on the last positions):
``hf-posenc extrapolate`` (``hf_posenc.extrapolation``) as a script; a markdown table, a JSON file and a plot in
``--output_dir``.

    python recipes/extrapolate.py --model_name_or_path out/rope out/alibi out/learned --output_dir out/extrapolation
"""

import sys

from hf_posenc_cli import main


if __name__ == "__main__":
    raise SystemExit(main(["extrapolate", *sys.argv[1:]]))
