"""The README's Python examples: each block runs on its own as a script (offline), prints what its comments say,
and loads without a load report of unexpected or missing weights."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
PRINT_WITH_OUTPUT = re.compile(r"^\s*print\(.*\)  # (.*)$")


def printed_comments(block: str) -> list[str]:
    """What the block's ``print(...)  # output`` lines say they print, in order."""
    return [match.group(1) for match in map(PRINT_WITH_OUTPUT.match, block.splitlines()) if match]


def test_every_print_in_the_readme_shows_its_output_as_a_comment():
    prints = [line for block in BLOCKS for line in block.splitlines() if line.lstrip().startswith("print(")]
    assert prints and all(PRINT_WITH_OUTPUT.match(line) for line in prints), prints


def test_each_readme_python_block_runs_on_its_own_and_prints_its_comments(tmp_path):
    assert len(BLOCKS) >= 4
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    runs = []
    for index, block in enumerate(BLOCKS):  # started together: most of each run is importing torch
        folder = tmp_path / f"block{index}"
        folder.mkdir()
        runs.append(
            subprocess.Popen(
                [sys.executable, "-c", block],
                cwd=folder,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for block, run in zip(BLOCKS, runs, strict=True):
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, f"{block}\n{stderr[-3000:]}"
        assert stdout.splitlines() == printed_comments(block), block
        assert "LOAD REPORT" not in stderr, f"{block}\n{stderr[-3000:]}"
    assert (tmp_path / "block0" / "my-t5-bert" / "modeling_posenc_bert.py").is_file()
