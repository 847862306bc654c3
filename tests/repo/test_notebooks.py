"""The notebooks in notebooks/ execute top to bottom on a CPU (DESIGN §11) and are committed
with their outputs, so their figures show when browsing the repository.

Each test run executes a notebook with nbclient in a temporary working directory (nothing is
written back to the repository) and checks that the committed outputs are the current ones:
every cell that draws has its image, and every cell's printed text is what it prints now.
After changing a notebook, the code it calls or perf/results/, re-execute and commit them:

    ./dev python tests/repo/test_notebooks.py      # rewrites notebooks/*.ipynb with fresh outputs
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import re
import sys
import tempfile

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = pathlib.Path(__file__).resolve().parents[2]   # not tests.helpers.paths: this file also runs as a script
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
REFRESH = "re-execute them: `./dev python tests/repo/test_notebooks.py`, then commit notebooks/"
# the environment the notebooks run in, here and when refreshed (no kernels: no interpreter)
ENV = {"TRITON_DILATED_RESULTS": str(ROOT / "perf" / "results"), "MPLBACKEND": "Agg"}


def execute(path, workdir):
    """The notebook at `path` executed in `workdir` (raises CellExecutionError on the first
    failing cell); the kernel inherits os.environ, which must hold ENV."""
    book = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(book, timeout=120, kernel_name="python3", record_timing=False,
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute()
    return book


def draws(cell):
    return bool(re.search(r"plt\.show\(\)|figure\(", cell.source))   # pyplot or a perf.plot figure


def printed(cell):
    """What a code cell printed to stdout, as one string."""
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def _digest(paths):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def test_the_three_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_patterns.ipynb", "02_performance.ipynb", "03_ring.ipynb"]


def test_pattern_heatmaps_have_axis_labels_and_a_colorbar():
    """Issue 34 item 4: every heatmap of notebook 01 names its axes and has a colorbar saying what
    the colours mean (the causal and per-head block pictures had neither)."""
    book = nbformat.read(ROOT / "notebooks" / "01_patterns.ipynb", as_version=4)
    heatmaps = [c.source for c in book.cells if c.cell_type == "code" and "imshow(" in c.source]
    assert len(heatmaps) == 4
    for src in heatmaps:
        assert "set_xlabel(" in src and "set_ylabel(" in src and "colorbar(" in src, src.splitlines()[0]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_with_its_outputs(path):
    book = nbformat.read(path, as_version=4)
    code = [c for c in book.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), f"{path.name} has cells that never ran: {REFRESH}"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), \
        f"{path.name} was not executed top to bottom in one go: {REFRESH}"
    drawing = [c for c in code if draws(c)]
    assert drawing, f"{path.name} draws nothing"
    for cell in drawing:
        assert any("image/png" in o.get("data", {}) for o in cell.outputs), \
            f"{path.name}: a cell that draws has no committed figure ({cell.source.splitlines()[0]!r}): {REFRESH}"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_and_its_committed_outputs_are_current(path, tmp_path, monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)      # the notebooks run no kernels
    watched = [p for d in ("notebooks", "perf/results") for p in (ROOT / d).iterdir() if p.is_file()]
    before = _digest(watched)
    book = execute(path, tmp_path)
    assert _digest(watched) == before, "executing a notebook changed files in the repository"
    assert not list(tmp_path.iterdir()), "the notebook wrote files"
    code = [c for c in book.cells if c.cell_type == "code"]
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    for cell in code:
        if draws(cell):
            assert any("image/png" in o.get("data", {}) for o in cell.outputs), \
                f"no figure drawn by {cell.source.splitlines()[0]!r}"
    committed = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    for now, then in zip(code, committed):
        assert printed(now) == printed(then), \
            f"{path.name}: the committed output of {now.source.splitlines()[0]!r} is stale: {REFRESH}"


def refresh():
    """Re-execute every notebook and write it back with its outputs."""
    os.environ.update(ENV)
    os.environ.pop("TRITON_INTERPRET", None)
    for path in NOTEBOOKS:
        with tempfile.TemporaryDirectory() as tmp:
            book = execute(path, tmp)
        nbformat.write(book, path)
        print(f"executed {path.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    refresh()
