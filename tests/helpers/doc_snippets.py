"""The pages (README.md, docs/*.md) and their Python snippets: one way to find them and one
way to run them, for tests/repo/test_dev.py (the README's quick start) and tests/repo/test_docs.py
(every snippet of docs/ marked runnable).

A ```python block directly below `<!-- runnable -->` is run as a script, as a reader would
run it: in a fresh interpreter, in an empty directory, with this checkout importable and
without TRITON_INTERPRET (on a CPU the calls take the portable backend, as they do outside
the tests; with TRITON_DILATED_TEST_DEVICE=cuda, the GPU). After a colon the mark may name
what the block needs:

    <!-- runnable: transformers>=5 -->    skipped where that module (at that version) is missing
    <!-- runnable: torchrun -->           run as a world of 1 under torchrun's environment
                                          (RANK, WORLD_SIZE, MASTER_ADDR, ...)

A ```python block that is not run sits below `<!-- not run: why -->`, so every block of a
page says which it is (tests/repo/test_docs.py checks that)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

from tests.helpers.paths import ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

# a fenced python block and the HTML comment right above it, if any
BLOCK = re.compile(r"(?:<!--\s*(?P<mark>runnable|not run)\s*(?::\s*(?P<arg>.*?))?\s*-->\n)?"
                   r"^```python\n(?P<code>.*?)^```", re.DOTALL | re.MULTILINE)


def section(text: str, title: str) -> str:
    """The `## title` section of a page's text, up to the next `## ` heading."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def python_blocks(text: str) -> list[dict]:
    """Every ```python block of `text`: its code, its mark ("runnable", "not run" or None),
    the mark's argument (what it needs, or why not) and its line number."""
    return [dict(code=m["code"], mark=m["mark"], arg=(m["arg"] or "").strip(),
                 line=text.count("\n", 0, m.start("code")) + 1) for m in BLOCK.finditer(text)]


def needs(arg: str) -> tuple[bool, list[tuple[str, str | None]]]:
    """A runnable mark's argument: (torchrun?, [(module, minimum version or None), ...])."""
    words = arg.split()
    modules = [(w.split(">=")[0], w.split(">=")[1] if ">=" in w else None) for w in words if w != "torchrun"]
    return "torchrun" in words, modules


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_snippet(code: str, cwd, *, torchrun: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `code` as a script in a fresh interpreter in `cwd` (see the module docstring)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    if torchrun:       # what `torchrun --nproc_per_node=1` gives its one process
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(cwd), check=False)
