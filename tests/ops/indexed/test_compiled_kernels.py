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
import os, re, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton_dilated.ops.common.hardware import padded_head_dim
from triton_dilated.ops.indexed import kernels as K

POINTERS = {"ROW_MAX": "fp32", "ROW_SUM": "fp32", "DELTA": "fp32", "SCORES": "fp32", "W": "fp32",
            "SLOTS": "i32", "COUNT": "i32", "Q_START": "i32", "Q_LIST": "i32"}

def compile_one(fn, arch, dtype, consts, warps, stages):
    sig, given = {}, {}
    for p in fn.params:
        a = p.name
        if p.is_constexpr:
            sig[a], given[a] = "constexpr", consts[a]
        elif a in ("softcap", "BLOCK_TABLE", "K_DESCALE", "V_DESCALE"):
            sig[a], given[a] = "constexpr", None
        elif a in POINTERS:
            sig[a] = "*" + POINTERS[a]
        elif a in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV"):
            sig[a] = "*" + dtype
        else:
            sig[a] = "fp32" if a == "sm_scale" else "i32"
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=given, attrs={})
    c = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        open(ptx, "w").write(c.asm["ptx"])
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        out = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", ptx, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    spill = re.search(r"(\d+) bytes spill stores", out.stdout + out.stderr)
    assert out.returncode == 0, out.stderr[-500:]
    return int(spill.group(1)) if spill else 0

bad = []
for arch in (90, 80):
    for dtype, (D, Dv) in (("bf16", (128, 128)), ("bf16", (192, 128)), ("fp32", (64, 64))):
        t = K.indexed_tiles(16, D, Dv, torch.float32 if dtype == "fp32" else torch.bfloat16, torch.device("cuda"))
        base = dict(HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=padded_head_dim(D), BLOCK_DV=padded_head_dim(Dv),
                    HAS_SOFTCAP=False, BLOCK_H=t["BLOCK_H"])
        dots = dict(DOT_MODE=0, PRECISION="tf32x3" if dtype == "fp32" else "tf32", BLOCK_K=t["BLOCK_K"])
        jobs = {"fwd": (K._indexed_fwd_kernel, dict(base, **dots, PAGE_SIZE=0, PHYSICAL=False, KV_FP8=0)),
                "dq": (K._indexed_bwd_dq_kernel, dict(base, **dots)),
                "dkdv": (K._indexed_bwd_dkdv_kernel, dict(base, BLOCK_R=t["BLOCK_R"], BLOCK_H=16))}
        if D <= 128:
            jobs["indexer"] = (K._indexer_scores_kernel, dict(HEAD_DIM=D, BLOCK_D=padded_head_dim(D), BLOCK_HH=64,
                                                             BLOCK_T=64, CAUSAL=True, DOT_MODE=0,
                                                             PRECISION=dots["PRECISION"]))
        for name, (fn, consts) in jobs.items():
            spilled = compile_one(fn, arch, dtype, consts, t["num_warps"], t["num_stages"])
            if spilled:
                bad.append(f"{name} sm{arch} {dtype} {D}/{Dv}: {spilled} B spilled")
assert not bad, bad
print("OK")
"""


def test_kernels_compile_for_sm90_and_sm80_without_spills():
    proc = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-3000:]
