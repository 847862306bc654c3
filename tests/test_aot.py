"""Every Triton kernel compiled ahead of time for sm90 and sm80 (no GPU needed): the CPU
interpreter cannot see compile-only errors (a variable whose type differs between the
branches of a runtime `if` once broke the block-sparse kernels on GPUs only), so CI
compiles each kernel with the config the library picks on those archs, at head dims 64 and
256 (the widest, with its own defaults)."""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from triton_dilated.perf.aot import KERNELS


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return os.path.exists(get_ptxas(90).path) and os.path.exists(get_ptxas(80).path)
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(not _ptxas_available(), reason="triton's NVIDIA backend (ptxas) is not installed")
def test_every_kernel_compiles_for_sm90_and_sm80(tmp_path):
    out = tmp_path / "aot.csv"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "triton_dilated.perf", "aot", "--arch", "90", "80", "--head-dims",
                           "64", "256", "--causal", "yes", "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=900)
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert {(r["arch"], r["kernel"], r["D"]) for r in rows} == {(a, k, d) for a in ("sm90", "sm80") for k in KERNELS
                                                                for d in ("64", "256")}
    failed = [f"{r['arch']} {r['kernel']}: {r['error']}" for r in rows if r["error"]]
    assert not failed, "\n".join(failed)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for r in rows:   # ptxas -v was parsed
        assert int(r["registers"]) > 0 and int(r["shared_bytes"]) > 0
