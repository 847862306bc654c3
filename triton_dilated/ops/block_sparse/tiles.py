"""The block-sparse variant's rows of the default-config tables (ops/common/configs.py,
Tiles). Each row was chosen from ahead-of-time compiles (`perf aot --configs`) whose CSVs
are under perf/aot/; the file names there say arch, dtype and Triton."""
from __future__ import annotations

from ..common.configs import Switch, Tiles, decode_tiles, make_config, register_tiles

FAMILIES = ("block_sparse_fwd", "block_sparse_bwd")

TILES = Tiles(
    # TMA (archs with TMA): 1 loads the K/V blocks through tensor descriptors; WARP_SPEC
    # (archs where Triton warp-specializes: sm100): the full-block loop split into TMA-load,
    # MMA and softmax warp groups (implies TMA loads)
    switches={"block_sparse_fwd": {"TMA": Switch((0, 1), requires="tma"),
                                   "WARP_SPEC": Switch((0, 1), requires="warp_specialize")}},
    # branch-free, software-pipelined list walks: 3 stages (perf/aot/pipelining-*.csv)
    bwd={(True, True): {"block_sparse_bwd": make_config(64, 32, 4, 3)},
         (True, False): {"block_sparse_bwd": make_config(128, 32, 8, 3)},
         (False, True): {"block_sparse_bwd": make_config(64, 32, 4, 3)},
         (False, False): {"block_sparse_bwd": make_config(32, 32, 4, 3)}},
    wide={"block_sparse_fwd": make_config(64, 32, 8, 2), "block_sparse_bwd": make_config(64, 16, 8, 2)},
    hopper_wide={"block_sparse_fwd": make_config(128, 32, 8, 2), "block_sparse_bwd": make_config(128, 16, 8, 2)},
    kernels={
        # dK/dV: BLOCK_M keys, BLOCK_N the query sub-tiles of its list walk
        "block_sparse_bwd_dkdv": {(True, 64): make_config(128, 64, 8, 3), (True, 128): make_config(128, 32, 8, 3),
                                  (True, 256): make_config(32, 64, 8, 3), (False, 64): make_config(32, 64, 4, 3),
                                  (False, 128): make_config(64, 64, 8, 3), (False, 256): make_config(32, 64, 8, 2)},
        "block_sparse_decode": decode_tiles({(True, 128): make_config(16, 32, 4, 3)}),
    },
    per_arch={
        "mid_smem": {("block_sparse_bwd", 64): make_config(64, 16, 4, 3)},
        "cdna": {("block_sparse_fwd", 128): make_config(64, 32, 4, 2),
                 ("block_sparse_bwd_dkdv", 128): make_config(64, 16, 4, 2),
                 ("block_sparse_bwd_dkdv", 64): make_config(64, 32, 4, 2),
                 ("block_sparse_fwd", 256): make_config(64, 32, 4, 2),
                 ("block_sparse_bwd", 256): make_config(16, 32, 4, 2),
                 ("block_sparse_bwd_dkdv", 256): make_config(32, 16, 4, 2)},
        "fma": {("block_sparse_fwd", 64): make_config(32, 32, 4, 1), ("block_sparse_fwd", 128): make_config(16, 32, 8, 1),
                ("block_sparse_fwd", 256): make_config(16, 16, 8, 1), ("block_sparse_bwd", 64): make_config(32, 32, 8, 1),
                ("block_sparse_bwd", 128): make_config(16, 16, 8, 1), ("block_sparse_bwd", 256): make_config(16, 16, 8, 1),
                ("block_sparse_bwd_dkdv", 64): make_config(16, 16, 4, 1),
                ("block_sparse_bwd_dkdv", 128): make_config(16, 16, 8, 1),
                ("block_sparse_bwd_dkdv", 256): make_config(16, 16, 8, 1)},
        "tcgen05": {("block_sparse_bwd_dkdv", 64): make_config(128, 32, 8, 1),
                    ("block_sparse_bwd_dkdv", 128): make_config(128, 32, 8, 1),
                    ("block_sparse_fwd", 128): make_config(128, 32, 8, 2),
                    ("block_sparse_decode", 128): make_config(16, 128, 4, 3),
                    ("block_sparse_decode", 256): make_config(16, 32, 4, 2)},
    },
    float32={"block_sparse_bwd": make_config(64, 32, 4, 2)},   # 32x32 spills 20 KB there
    tuned_kernels={"block_sparse_bwd_dkdv": "block_sparse_bwd"},
    fma_spilling=frozenset({("block_sparse_bwd", 256)}),
)

register_tiles(FAMILIES, TILES)
