"""The notebooks in notebooks/ execute top to bottom on a CPU (DESIGN §11): run each with
nbclient in a temporary working directory; nothing is written back to the repository."""
from __future__ import annotations

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_three_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_patterns.ipynb", "02_performance.ipynb", "03_ring.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_DILATED_RESULTS", str(ROOT / "perf" / "results"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)      # the notebooks run no kernels
    book = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(book, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()      # raises CellExecutionError on the first failing cell
    outputs = [o for c in book.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    if path.stem in ("01_patterns", "02_performance"):
        assert any("image/png" in o.get("data", {}) for o in outputs), "no figure was drawn"
    assert not list(tmp_path.glob("*.ipynb"))
