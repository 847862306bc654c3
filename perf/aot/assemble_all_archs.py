"""Assemble perf/aot/all-archs-defaults-bf16-triton39.csv: for every arch, kernel, D, causal the
compile of the CURRENT default config (configs.default_config on the arch's facts), taken from
the per-arch runs of `perf aot` (Triton 3.9) committed under perf/aot/ (later sources win).
One `perf aot --arch 70 75 80 86 89 90 100 120 gfx942 gfx950 --head-dims 64 128 256` run takes
about two hours on a 2-core machine; the per-arch runs are the same tool, and a recompile of
52 of their rows (sm90, sm80, sm120, gfx942 at D = 128, causal) gave identical registers,
spills and shared memory. tests/test_arch_table.py checks every row against today's defaults.

    PYTHONPATH=. python perf/aot/assemble_all_archs.py"""
import csv
import sys

import torch

from triton_dilated import configs
from triton_dilated.perf.aot import KERNELS, FIELDS, arch_summary
from triton_dilated.ops.common.hardware import ARCH_TABLE, fake_arch
extra = sys.argv[1:]
srcs = ["perf/aot/defaults-bf16-2026-11-26-triton39.csv", "perf/aot/sm120-sm89-sm86-defaults-bf16-triton39.csv",
        "perf/aot/sm100-defaults-bf16-triton39.csv", "perf/aot/gfx942-gfx950-defaults-bf16-fp16-triton39.csv",
        "perf/aot/sm75-sm70-defaults-bf16-triton39.csv", "perf/aot/gfx942-gfx950-d256-defaults-bf16-triton39.csv"] + extra
pick = {}
for f in srcs:
    for r in csv.DictReader(open(f)):
        if r.get("kernel") not in KERNELS or r.get("dtype") != "bf16" or r.get("error"):
            continue
        arch = fake_arch(r["arch"])
        cfg = configs.default_config(KERNELS[r["kernel"]].family, int(r["D"]), arch, torch.bfloat16, r["kernel"])
        if cfg == {k: int(r[k]) for k in configs.CONFIG_FIELDS}:
            pick[(r["arch"], r["kernel"], r["D"], r["causal"])] = {k: r.get(k, "") for k in FIELDS}  # later files win
rows, missing = [], []
for a in ARCH_TABLE:
    for k in KERNELS:
        for D in ("64", "128", "256"):
            for c in "01":
                if (a, k, D, c) in pick:
                    rows.append(pick[(a, k, D, c)])
                elif D != "256":
                    missing.append((a, k, D, c))
print("missing (D<=128):", len(missing), missing[:10])
with open("perf/aot/all-archs-defaults-bf16-triton39.csv", "w", newline="") as f:
    w = csv.DictWriter(f, FIELDS); w.writeheader(); w.writerows(rows)
print("\n".join(arch_summary(rows)))
