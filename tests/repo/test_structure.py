"""The package's shape (DESIGN §9), checked: it imports and runs without triton, only the
kernel files import triton, imports run downward (common imports no variant, no variant
imports another's kernel file) and there is no import cycle. And the tests' shape: folders
that mirror the package, shared code in tests/helpers only."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

from tests.helpers.paths import ROOT

PACKAGE = ROOT / "triton_dilated"
TESTS = ROOT / "tests"
KERNEL_FILES = {"ops/common/kernels.py", "ops/dilated/kernels.py", "ops/block_sparse/kernels.py",
                "ops/ring/step_kernels.py", "ops/common/decode_kernels.py", "ops/dilated/decode_kernels.py",
                "ops/block_sparse/decode_kernels.py", "ops/indexed/kernels.py"}
TOOLS = {"perf/aot.py"}   # compiles the kernels: imports triton lazily, inside functions

NO_TRITON = r"""
import sys
sys.modules["triton"] = None          # triton made unimportable
import torch
import triton_dilated as td
from triton_dilated import layouts
q, k, v = (torch.randn(1, 64, 2, 16) for _ in range(3))
out = td.dilated_attention(q, k, v, [16, 32], [1, 2], causal=True)
ref, _ = td.dilated_attention_naive(q, k, v, [16, 32], [1, 2], causal=True)
assert (out.double() - ref).abs().max() < 1e-5
lay = layouts.local(64, 16, 1)
out = td.block_sparse_attention(q, k, v, lay)
ref, _ = td.block_sparse_attention_naive(q, k, v, lay)
assert (out.double() - ref).abs().max() < 1e-5
m = td.MultiheadDilatedAttention(32, 2, [1, 2], [16, 32])
x = torch.randn(1, 64, 32, requires_grad=True)
m(x, x, x, is_causal=True)[0].sum().backward()
assert x.grad is not None
b = td.BlockSparseAttention(lambda n: layouts.local(n, 16, 1))
assert b(q, k, v).shape == q.shape
try:
    td.dilated_attention(q, k, v, [16], [1], backend="triton")
except ValueError as e:
    assert "triton is not installed" in str(e), e
else:
    raise AssertionError("backend='triton' without triton did not raise")
assert not any(name.startswith("triton_dilated") and "kernels" in name for name in sys.modules)
print("OK")
"""


def test_package_runs_without_triton():
    proc = subprocess.run([sys.executable, "-c", NO_TRITON], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-3000:]


def _imports(path: pathlib.Path):
    """(module imported, lineno) for every import in a file, relative ones resolved."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            yield mod, node.lineno
            for alias in node.names:   # `from . import kernels` imports a module
                yield f"{mod}.{alias.name}", node.lineno


def _package_files():
    return sorted(p for p in PACKAGE.rglob("*.py"))


# runtime.triton_importable() imports triton inside a try (the backend dispatch asks whether
# it is there); it must not import the kernel files, which would fix interpreted-or-compiled
AVAILABILITY_PROBE = {("ops/common/runtime.py", "triton"), ("ops/common/runtime.py", "triton.language")}


def test_only_kernel_files_import_triton():
    offenders = []
    for path in _package_files():
        name = path.relative_to(PACKAGE).as_posix()
        if name in KERNEL_FILES or name in TOOLS:
            continue
        for mod, line in _imports(path):
            if (mod == "triton" or mod.startswith("triton.")) and (name, mod) not in AVAILABILITY_PROBE:
                offenders.append(f"{name}:{line} imports {mod}")
    assert not offenders, "\n".join(offenders)


def test_imports_run_downward():
    offenders = []
    variants = ("dilated", "block_sparse", "ring", "indexed")
    for path in _package_files():
        name = path.relative_to(PACKAGE).as_posix()
        for mod, line in _imports(path):
            if not mod.startswith("triton_dilated."):
                continue
            target = mod.split(".")
            if name.startswith("ops/common/") and len(target) > 2 and target[1] == "ops" and target[2] in variants:
                offenders.append(f"{name}:{line}: common imports the variant module {mod}")
            if name.startswith("ops/") and len(target) > 3 and target[1] == "ops" and target[2] in variants:
                own = name.split("/")[1]
                if target[2] != own and target[-1] in ("kernels", "step_kernels"):
                    offenders.append(f"{name}:{line}: imports another variant's kernel file {mod}")
    assert not offenders, "\n".join(offenders)


def test_no_import_cycles():
    graph = {}
    modules = {}
    for path in _package_files():
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        mod = ".".join(rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts)
        modules[mod] = path
    for mod, path in modules.items():
        by_line = {}
        for m, line in _imports(path):
            if m in modules and m != mod:
                by_line.setdefault(line, set()).add(m)
        # `from .pkg import module` names the package only to reach the module (its parent,
        # initialised first in any case): the module is the edge
        graph[mod] = {m for ms in by_line.values() for m in ms if not any(o.startswith(m + ".") for o in ms)}
    # every import counts, function-level ones and a package's __init__ importing its own
    # submodules included (a late import only hides a cycle from the import order)
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


# the tests' folders named after a package folder (beside them: serve/, modules/, repo/, helpers/)
MIRRORED = ("ops/dilated", "ops/block_sparse", "ops/ring", "ops/common", "integrations", "perf")


def test_tests_mirror_the_package_and_share_code_through_helpers_only():
    """Issue 31 item 6: the test modules live in sub-folders (three at least, none at tests/
    itself), those under ops/ and the mirrored ones named after a package folder; every folder
    is a package (modules of the same name in two folders stay distinct); no test module
    imports another: code the tests share lives in tests/helpers, which holds no test module
    and imports none."""
    modules = sorted(TESTS.rglob("test_*.py"))
    folders = {path.parent.relative_to(TESTS).as_posix() for path in modules}
    assert "." not in folders, [path.name for path in modules if path.parent == TESTS]
    assert len(folders) >= 3, folders
    assert not [f for f in folders if f == "helpers" or f.startswith("helpers/")], folders
    for folder in MIRRORED + tuple(f for f in folders if f.startswith("ops/")):
        assert folder in folders and (PACKAGE / folder).is_dir(), f"tests/{folder} mirrors no package folder"
    sources = sorted(TESTS.rglob("*.py"))
    folders_of_code = {d for path in sources for d in [path.parent, *path.parent.parents] if d == TESTS or TESTS in d.parents}
    assert sorted(str(d.relative_to(ROOT)) for d in folders_of_code if not (d / "__init__.py").is_file()) == []
    offenders = []
    for path in sources:
        for mod, line in _imports(path):
            if mod.rsplit(".", 1)[-1].startswith("test_") or \
                    (mod.startswith("tests.") and not mod.startswith(("tests.helpers", "tests.conftest"))):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    assert not offenders, "\n".join(offenders)
