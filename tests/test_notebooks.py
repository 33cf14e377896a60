"""The notebooks' code cells run as written (headless, without Jupyter)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest


NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_code_cells_run(notebook, tmp_path, monkeypatch):
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    cells = json.loads(notebook.read_text())["cells"]
    code = [("".join(cell["source"])) for cell in cells if cell["cell_type"] == "code"]
    assert code
    namespace: dict = {}
    for index, source in enumerate(code):
        exec(compile(source, f"{notebook.name}[{index}]", "exec"), namespace)
    if notebook.name == "quickstart.ipynb":
        assert set(namespace["models"]) == set(namespace["hf_posenc"].list_position_encodings())
        assert namespace["generated"].shape == (1, 10)
