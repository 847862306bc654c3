"""Ahead-of-time compile of every Triton kernel for an NVIDIA arch, with no GPU needed.

The CPU interpreter runs kernels as Python, so it cannot see what only the compiler
rejects (a variable whose type differs between the branches of a runtime `if`, dot
shapes, shared memory) or what ptxas reports (registers, spills). This compiles each
kernel with the config the library would pick on that arch (runtime.default_config, or
--configs), runs Triton's own ptxas with -v, and writes one CSV row per compile:
registers, spill stores/loads, shared memory, or the error.

    python -m triton_dilated.perf aot [--arch 90 80] [--head-dims 64 128] [--out CSV]

Needs TRITON_INTERPRET unset (the interpreter replaces the compiled kernels).
"""
from __future__ import annotations

import csv
import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

from ..ops.common.runtime import padded_head_dim

# Pointer arguments: float32 statistics and accumulators, int32 tables, the rest the
# activation dtype. Every other non-constexpr argument is an int32 (sm_scale: float32).
_FP32 = {"ROW_MAX", "ROW_SUM", "DELTA", "LSE", "OUT"}
_I32 = {"ITEMS", "PAT_W", "PAT_R", "PAT_OFF", "KV_COUNT", "KV_INDEX", "Q_COUNT", "Q_INDEX", "Q_POS", "K_POS"}
_I8 = {"LAYOUT"}
_RING_FP32 = {"DQ", "DK", "DV"}   # the ring step accumulates dQ, dK, dV in float32
_INTS = {"N", "NQ", "NK", "NUM_HEADS", "NUM_KV_HEADS", "HEAD_GROUP", "NUM_ITEMS"}   # upper-case sizes, not pointers
# strides the JIT would see as multiples of 16 (tensor strides), except layout-table ones
_ODD_STRIDES = {"stride_cb", "stride_ch", "stride_ib", "stride_ih", "stride_ir"}
_RING_ODD_STRIDES = {"stride_lb", "stride_lh", "stride_lr"}

# name: (module, kernel attribute, config family)
KERNELS = {
    "dilated_fwd": ("triton_dilated.ops.dilated.parallel", "_dilated_fwd_kernel", "dilated_fwd"),
    "dilated_bwd_dq": ("triton_dilated.ops.dilated.parallel", "_dilated_bwd_dq_kernel", "dilated_bwd"),
    "dilated_bwd_dkdv": ("triton_dilated.ops.dilated.parallel", "_dilated_bwd_dkdv_kernel", "dilated_bwd"),
    "block_sparse_fwd": ("triton_dilated.ops.block_sparse.parallel", "_block_sparse_fwd_kernel", "block_sparse_fwd"),
    "block_sparse_bwd_dq": ("triton_dilated.ops.block_sparse.parallel", "_block_sparse_bwd_dq_kernel",
                            "block_sparse_bwd"),
    "block_sparse_bwd_dkdv": ("triton_dilated.ops.block_sparse.parallel", "_block_sparse_bwd_dkdv_kernel",
                              "block_sparse_bwd"),
    "ring_step_fwd": ("triton_dilated.ops.ring.step", "_ring_step_fwd_kernel", "ring_step_fwd"),
    "ring_step_bwd_dq": ("triton_dilated.ops.ring.step", "_ring_step_bwd_dq_kernel", "ring_step_bwd"),
    "ring_step_bwd_dkdv": ("triton_dilated.ops.ring.step", "_ring_step_bwd_dkdv_kernel", "ring_step_bwd"),
}
FIELDS = ["arch", "kernel", "dtype", "D", "causal", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "registers",
          "spill_stores", "spill_loads", "shared_bytes", "compile_s", "error"]
_SMEM = {70: 96 * 1024, 75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}   # opt-in bytes per block


def _signature(name, fn, dtype: str, D: int, causal: bool, cfg: dict):
    """(signature, constexprs, attrs) for triton.compile, read off the kernel's parameters."""
    constexprs = dict(HEAD_DIM=D, BLOCK_D=padded_head_dim(D), CAUSAL=causal,
                      BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], DOT_FP32=False,
                      PRECISION="tf32x3" if dtype == "fp32" else "tf32",
                      NUM_PATTERNS=3, BLOCK_SIZE=128, MASK_KIND=1)   # 3 patterns; block 128; ring: dilated mask
    sig, given, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        a = p.name
        if p.is_constexpr:
            if a not in constexprs:
                raise ValueError(f"{name}: no value for constexpr {a}")
            sig[a], given[a] = "constexpr", constexprs[a]
        elif a.isupper() and a not in _INTS:   # a pointer
            ty = ("fp32" if a in _FP32 or (name.startswith("ring") and a in _RING_FP32) else
                  "i32" if a in _I32 else "i8" if a in _I8 else dtype)
            sig[a] = "*" + ty
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[a] = "fp32" if a == "sm_scale" else "i32"
            odd = _ODD_STRIDES | (_RING_ODD_STRIDES if name.startswith("ring") else set())
            if a.startswith("stride_") and a not in odd:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, given, attrs


_PTXAS = re.compile(r"Used (\d+) registers.*?")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_one(job) -> dict:
    """Compile one (kernel, arch, dtype, D, causal, config); a CSV row."""
    name, arch, dtype, D, causal, cfg = job
    row = dict.fromkeys(FIELDS, "")
    row.update(arch=f"sm{arch}", kernel=name, dtype=dtype, D=D, causal=int(causal), **cfg)
    start = time.time()
    try:
        import importlib

        import triton
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas
        module, attr, _ = KERNELS[name]
        fn = getattr(importlib.import_module(module), attr)
        if not hasattr(fn, "params"):
            raise RuntimeError("the kernels are interpreted (TRITON_INTERPRET=1): unset it to compile them")
        sig, constexprs, attrs = _signature(name, fn, dtype, D, causal, cfg)
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
        row["shared_bytes"] = compiled.metadata.shared
        with tempfile.TemporaryDirectory() as tmp:   # ptxas -v on the PTX triton made: registers, spills
            ptx = os.path.join(tmp, "k.ptx")
            with open(ptx, "w") as f:
                f.write(compiled.asm["ptx"])
            gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
            out = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", ptx, "-o",
                                  os.path.join(tmp, "k.cubin")], capture_output=True, text=True, timeout=600)
        log = out.stdout + out.stderr
        regs, spill = _PTXAS.search(log), _SPILL.search(log)
        if out.returncode or not regs:
            raise RuntimeError(f"ptxas failed: {log.strip()[:300]}")
        row.update(registers=int(regs.group(1)), spill_stores=int(spill.group(1)) if spill else 0,
                   spill_loads=int(spill.group(2)) if spill else 0)
        if row["shared_bytes"] > _SMEM.get(arch, 1 << 30):
            row["error"] = f"shared memory {row['shared_bytes']} B over the sm{arch} limit {_SMEM[arch]} B"
    except Exception as exc:  # noqa: BLE001  (the row records it)
        text = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        row["error"] = f"{type(exc).__name__}: {text[-400:]}"   # the cause is at the end of a compile error
    row["compile_s"] = round(time.time() - start, 1)
    return row


def run_aot(archs=(90, 80), head_dims=(64, 128), dtypes=("bf16",), causal=(False, True), kernels=None,
            configs=None, out=None, jobs=2, log=print) -> list[dict]:
    """Compile every kernel for each arch/dtype/head dim/causal with the default config of
    that arch (or each of `configs`). Returns the rows (also written to `out`)."""
    import torch

    from ..ops.common.runtime import Arch, default_config
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    work = []
    for arch in archs:
        fake = Arch(f"sm{arch}", (arch // 10, arch % 10), _SMEM.get(arch, 99 * 1024), 1, f"sm{arch} (ahead of time)")
        for name in kernels or KERNELS:
            family = KERNELS[name][2]
            for dtype in dtypes:
                for D in head_dims:
                    cfgs = configs or [default_config(family, padded_head_dim(D), fake,
                                                      torch_dtype[dtype])]
                    work += [(name, arch, dtype, D, c, dict(cfg)) for c in causal for cfg in cfgs]
    rows = []
    with ProcessPoolExecutor(max(1, jobs)) as pool:
        for i, row in enumerate(pool.map(compile_one, work), 1):
            rows.append(row)
            what = row["error"] or (f"{row['registers']} registers, spills {row['spill_stores']}/"
                                    f"{row['spill_loads']} B, shared {row['shared_bytes']} B")
            log(f"[{i}/{len(work)}] {row['arch']} {row['kernel']} {row['dtype']} D={row['D']} causal={row['causal']} "
                f"{row['BLOCK_M']}x{row['BLOCK_N']} w{row['num_warps']} s{row['num_stages']}: {what}")
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", newline="") as f:
            writer = csv.DictWriter(f, FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    return rows
