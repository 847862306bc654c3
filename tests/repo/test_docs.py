"""The snippets of docs/*.md: every ```python block marked runnable runs as written (on this
machine's device: the CPU here), and every other one says why it is not run
(tests/helpers/doc_snippets.py: the marks and how a block runs)."""
from __future__ import annotations

import pytest

from tests.helpers.doc_snippets import DOCS, ROOT, needs, python_blocks, run_snippet

BLOCKS = [(page, block) for page in DOCS for block in python_blocks(page.read_text())]
RUNNABLE = [pytest.param(page, block, id=f"{page.name}:{block['line']}")
            for page, block in BLOCKS if block["mark"] == "runnable"]


def test_every_python_block_of_the_docs_is_marked():
    # DESIGN.md is a copy of the team's contract (shared/DESIGN.md): its blocks are signatures, kept as written
    unmarked = [f"{page.relative_to(ROOT)}:{b['line']}" for page, b in BLOCKS
                if b["mark"] is None and page.name != "DESIGN.md"]
    assert not unmarked, ("mark these blocks `<!-- runnable -->` (tests/repo/test_docs.py runs them) or "
                          f"`<!-- not run: why -->`: {unmarked}")
    assert all(b["arg"] for _, b in BLOCKS if b["mark"] == "not run"), "a `not run` mark says why"
    assert len(RUNNABLE) >= 9          # the pages' runnable snippets today; a lost mark fails here


@pytest.mark.parametrize("page, block", RUNNABLE)
def test_runnable_snippet_runs(page, block, tmp_path):
    torchrun, modules = needs(block["arg"])
    for module, minversion in modules:
        pytest.importorskip(module, minversion=minversion)
    res = run_snippet(block["code"], tmp_path, torchrun=torchrun)
    assert res.returncode == 0, f"{page.relative_to(ROOT)}:{block['line']}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
