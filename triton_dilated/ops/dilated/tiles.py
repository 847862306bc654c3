"""The dilated variant's rows of the default-config tables (ops/common/configs.py, Tiles).
Each row was chosen from ahead-of-time compiles (`perf aot --configs`: registers, spills,
wgmma) whose CSVs are under perf/aot/; the file names there say arch, dtype and Triton."""
from __future__ import annotations

from ..common.configs import Switch, Tiles, decode_tiles, make_config, register_tiles

FAMILIES = ("dilated_fwd", "dilated_bwd")

TILES = Tiles(
    # FLAT_LOOP (forward and dQ): 1 walks the key blocks of all a tile's patterns in two flat
    # loops (unmasked, then masked); 0 runs one pair of loops per pattern. The first H100 run's
    # config A/B (perf/results/h100-80gb-hbm3.csv, op config_ab:*) measured 0 faster by
    # 1.04-1.12x at the 128x64 w8 tiles; configs/sm90.json's tiles were not A/B'd with it yet.
    switches={"dilated_fwd": {"FLAT_LOOP": Switch((1, 0))}, "dilated_bwd": {"FLAT_LOOP": Switch((1, 0))}},
    # Hopper forward: 128-row tiles, two warpgroups of 64 rows (the planner then tiles the
    # LongNet schedule with stride 6: fewer K/V bytes from L2; perf/aot/dilated-fwd-128-row-tiles-*.csv)
    hopper_fwd={"dilated_fwd": make_config(128, 64, 8, 3)},
    bwd={(True, True): {"dilated_bwd": make_config(128, 64, 8, 2)},
         (True, False): {"dilated_bwd": make_config(128, 64, 8, 2)},
         (False, True): {"dilated_bwd": make_config(64, 32, 4, 2)},
         (False, False): {"dilated_bwd": make_config(64, 64, 8, 2)}},
    wide={"dilated_fwd": make_config(64, 32, 8, 2), "dilated_bwd": make_config(32, 32, 8, 2)},
    hopper_wide={"dilated_fwd": make_config(128, 32, 8, 2), "dilated_bwd": make_config(128, 16, 8, 2)},
    kernels={
        # dK/dV: BLOCK_M keys (the M dimension of S^T = K Q^T), BLOCK_N query rows
        "dilated_bwd_dkdv": {(True, 64): make_config(64, 32, 4, 2), (True, 128): make_config(128, 32, 8, 2),
                             (True, 256): make_config(32, 32, 8, 2), (False, 64): make_config(32, 32, 4, 2),
                             (False, 128): make_config(64, 64, 8, 1)},
        "dilated_decode": decode_tiles(),
    },
    per_arch={
        "mid_smem": {("dilated_bwd_dkdv", 64): make_config(64, 32, 4, 2)},   # sm120-sm89-sm86-*.csv
        "cdna": {("dilated_fwd", 128): make_config(64, 32, 4, 2), ("dilated_bwd", 128): make_config(32, 64, 4, 2),
                 ("dilated_bwd_dkdv", 128): make_config(64, 16, 4, 2), ("dilated_fwd", 256): make_config(64, 32, 4, 2),
                 ("dilated_bwd", 256): make_config(16, 32, 4, 2),
                 ("dilated_bwd_dkdv", 256): make_config(32, 16, 4, 2)},   # gfx942-gfx950-*.csv
        "fma": {("dilated_fwd", 64): make_config(32, 32, 4, 1), ("dilated_fwd", 128): make_config(16, 32, 8, 1),
                ("dilated_fwd", 256): make_config(16, 16, 8, 1), ("dilated_bwd", 64): make_config(32, 32, 8, 1),
                ("dilated_bwd", 128): make_config(16, 16, 8, 1), ("dilated_bwd", 256): make_config(16, 16, 8, 1),
                ("dilated_bwd_dkdv", 64): make_config(16, 16, 4, 1),
                ("dilated_bwd_dkdv", 128): make_config(16, 16, 8, 1),
                ("dilated_bwd_dkdv", 256): make_config(16, 16, 8, 1)},   # sm75-sm70-*.csv, sm7*-dot-pieces-*.csv
        "tcgen05": {("dilated_bwd_dkdv", 64): make_config(128, 32, 8, 1),
                    ("dilated_bwd_dkdv", 128): make_config(128, 32, 8, 1)},   # sm100-*.csv
    },
    tuned_kernels={"dilated_bwd_dkdv": "dilated_bwd"},
    fma_spilling=frozenset({("dilated_bwd", 256)}),
)

register_tiles(FAMILIES, TILES)
