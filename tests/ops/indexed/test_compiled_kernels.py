"""The indexed kernels compiled ahead of time for sm90 and sm80 (no GPU needed: Triton's own
compiler and ptxas, in a subprocess without the interpreter): what the interpreter cannot see
(types that differ between branches, dot shapes) fails here, and the default tiles do not spill
registers at the common shapes."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

pytest.importorskip("triton")

COMPILE = r"""
import os
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
from triton_dilated.perf.aot import run_aot

KERNELS = ("indexed_fwd", "indexed_bwd_dq", "indexed_bwd_dkdv")
rows = []
for head_dims, dtypes, kernels in (((128,), ("bf16",), KERNELS + ("indexer_scores",)),
                                   ((192,), ("bf16",), tuple(k + "_dv128" for k in KERNELS)),
                                   ((64,), ("fp32",), KERNELS + ("indexer_scores",))):
    rows += run_aot(archs=(90, 80), head_dims=head_dims, dtypes=dtypes, causal=(True,), kernels=kernels,
                    log=lambda *a: None)
bad = [f"{r['kernel']} {r['arch']} {r['dtype']} D={r['D']}: {r['error'] or r['spill_stores'] + ' B spilled'}"
       for r in rows if r["error"] or int(r["spill_stores"])]
assert len(rows) == 2 * 11 and not bad, (len(rows), bad)
print("OK")
"""


def test_kernels_compile_for_sm90_and_sm80_without_spills():
    """(Dqk, Dv) = (128, 128) and (192, 128) in bf16, (64, 64) in float32, with the tiles the
    launchers pick (tiles.compiled_tiles, through perf aot's launch_config)."""
    proc = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-3000:]
