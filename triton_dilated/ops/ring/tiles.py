"""The ring step's rows of the default-config tables (ops/common/configs.py, Tiles). Each
row was chosen from ahead-of-time compiles (`perf aot --configs`) whose CSVs are under
perf/aot/; the file names there say arch, dtype and Triton."""
from __future__ import annotations

from ..common.configs import Tiles, make_config, register_tiles

FAMILIES = ("ring_step_fwd", "ring_step_bwd")

TILES = Tiles(
    # 64x32 keeps the forward in registers where 64x64 spills (Hopper; before it at D <= 64)
    hopper_fwd={"ring_step_fwd": make_config(64, 32, 4, 3)},
    narrow_fwd={"ring_step_fwd": make_config(64, 32, 4, 3)},
    bwd={(True, True): {"ring_step_bwd": make_config(64, 32, 4, 3)},
         (True, False): {"ring_step_bwd": make_config(128, 16, 8, 3)},
         (False, True): {"ring_step_bwd": make_config(32, 32, 4, 3)},
         (False, False): {"ring_step_bwd": make_config(64, 64, 8, 3)}},
    wide={"ring_step_fwd": make_config(32, 64, 4, 2), "ring_step_bwd": make_config(32, 32, 8, 2)},
    hopper_wide={"ring_step_fwd": make_config(32, 64, 4, 2), "ring_step_bwd": make_config(32, 32, 8, 2)},
    kernels={
        "ring_step_bwd_dkdv": {(True, 64): make_config(128, 32, 8, 3), (True, 128): make_config(128, 32, 8, 2),
                               (True, 256): make_config(32, 32, 8, 3), (False, 64): make_config(128, 32, 8, 3),
                               (False, 128): make_config(64, 64, 8, 3), (False, 256): make_config(32, 32, 8, 3)},
    },
    per_arch={
        "mid_smem": {("ring_step_bwd", 64): make_config(64, 32, 4, 3)},
        "cdna": {("ring_step_fwd", 128): make_config(64, 32, 4, 2), ("ring_step_bwd", 128): make_config(64, 32, 4, 2),
                 ("ring_step_bwd_dkdv", 128): make_config(64, 16, 4, 2),
                 ("ring_step_bwd_dkdv", 64): make_config(64, 32, 4, 2),
                 ("ring_step_fwd", 256): make_config(64, 32, 4, 2), ("ring_step_bwd", 256): make_config(16, 32, 4, 2),
                 ("ring_step_bwd_dkdv", 256): make_config(32, 16, 4, 2)},
        "fma": {("ring_step_fwd", 64): make_config(32, 32, 4, 1), ("ring_step_fwd", 128): make_config(16, 32, 8, 1),
                ("ring_step_fwd", 256): make_config(16, 16, 8, 1), ("ring_step_bwd", 64): make_config(32, 32, 8, 1),
                ("ring_step_bwd", 128): make_config(16, 16, 8, 1), ("ring_step_bwd", 256): make_config(16, 16, 8, 1),
                ("ring_step_bwd_dkdv", 64): make_config(16, 16, 8, 1),
                ("ring_step_bwd_dkdv", 128): make_config(16, 16, 8, 1),
                ("ring_step_bwd_dkdv", 256): make_config(16, 16, 8, 1)},
        "tcgen05": {("ring_step_bwd_dkdv", 64): make_config(64, 32, 4, 2),
                    ("ring_step_bwd_dkdv", 128): make_config(128, 32, 8, 1),
                    ("ring_step_bwd", 64): make_config(64, 32, 4, 2)},
    },
    tuned_kernels={"ring_step_bwd_dkdv": "ring_step_bwd"},
    fma_spilling=frozenset({("ring_step_bwd", 256)}),
)

register_tiles(FAMILIES, TILES)
