"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path


README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["encoder"].__class__.__name__ == "PosEncBertModel"
    assert namespace["t5"].config.position_encoding["type"] == "t5"
    assert (tmp_path / "my-t5-bert" / "modeling_posenc_bert.py").is_file()
