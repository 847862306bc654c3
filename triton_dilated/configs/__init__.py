"""Kernel launch configs (DESIGN §8): the default-config rule and the tuned tables, together.

A config is {BLOCK_M, BLOCK_N, num_warps, num_stages}, chosen per *config family* (one per
launcher: "dilated_fwd", "dilated_bwd", "block_sparse_fwd", ..., named in each variant's
spec.py), dtype, padded head dim and sequence bucket:

* under the interpreter: INTERPRETER_CONFIG, always;
* on a GPU: the entry of `configs/<arch>.json` (written by `python -m triton_dilated.perf
  tune`) for config_key(dtype, head dim, bucket), or the nearest tuned bucket;
* else `default_config`: tiles chosen from an ahead-of-time register/spill analysis
  (perf/aot/*.csv), shrunk until a shared-memory estimate fits the arch.

A new family needs no entry here: it gets the generic forward/backward rule.
"""
from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass
from importlib import resources

import torch

from ..ops.common.hardware import Arch, device_arch, fake_arch, padded_head_dim

# Exactly one configuration under TRITON_INTERPRET=1: small tiles keep the interpreter
# (~10 ms per program x key-block step) fast enough for tests.
INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
CONFIG_FIELDS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


def make_config(block_m: int, block_n: int, warps: int, stages: int, **switches) -> dict:
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages, **switches}


@dataclass(frozen=True)
class Switch:
    """A kernel variant a config can select: an extra constexpr key beside CONFIG_FIELDS.
    values[0] is used where a config does not name the switch; `requires` names the Arch
    fact the variant needs ("tma"): archs without it do not have the variant (their
    launchers use values[0])."""
    values: tuple
    requires: str | None = None

    def available(self, arch: Arch | None) -> bool:
        """Whether `arch` (None: the interpreter) has this variant."""
        return self.requires is None or (arch is not None and bool(getattr(arch, self.requires)))


# Variants the compiled code cannot choose between (`perf aot` shows both spill-free and on
# the same instructions; only a GPU can time them): `perf tune` times every value of a
# family's switches on its best tile and keeps the fastest in the tuned entry, and the GPU
# check's config A/B (perf/config_ab.py) times them against the default.
# * FLAT_LOOP (dilated forward and dQ): 1 walks the key blocks of all the tile's patterns in
#   two flat loops (unmasked, then masked); 0 runs one pair of loops per pattern.
# * TMA (block-sparse forward, archs with TMA: sm90, sm100, sm120): 1 loads the K/V blocks
#   through tensor descriptors (cp.async.bulk.tensor); 0 with pointer loads (cp.async).
# * WARP_SPEC (block-sparse forward, archs where Triton warp-specializes: sm100): 1 marks the
#   full-block loop tl.range(..., warp_specialize=True) and reads K/V through tensor
#   descriptors as TMA = 1 does (Triton 3.9 puts only descriptor loads in a load partition: a
#   loop of pointer loads, the dilated forward's strided rows, compiles unpartitioned), so the
#   compiler splits it into TMA-load, MMA and softmax warp groups (setmaxnreg in the PTX).
VARIANT_SWITCHES = {
    "dilated_fwd": {"FLAT_LOOP": Switch((1, 0))},
    "dilated_bwd": {"FLAT_LOOP": Switch((1, 0))},
    "block_sparse_fwd": {"TMA": Switch((0, 1), requires="tma"),
                         "WARP_SPEC": Switch((0, 1), requires="warp_specialize")},
}


def switch_value(family: str, config: dict, name: str) -> int:
    """The value of variant switch `name` that `config` selects (its default when absent)."""
    switch = VARIANT_SWITCHES[family][name]
    value = config.get(name, switch.values[0])
    if isinstance(value, bool) or not isinstance(value, int) or value not in switch.values:
        raise ValueError(f"config[{name!r}] of {family}: expected one of {list(switch.values)}, got {value!r}")
    return value


def switch_alternatives(family: str, config: dict, arch: Arch | None) -> list:
    """`config` with one switch of the family set to each of its other values, for the
    switches `arch` has (None or the interpreter: those that need no hardware fact)."""
    out = []
    for name, switch in VARIANT_SWITCHES.get(family, {}).items():
        if not switch.available(arch):
            continue
        current = switch_value(family, config, name)
        out += [{**config, name: v} for v in switch.values if v != current]
    return out


def config_label(config: dict) -> str:
    """"64x64 w4 s3", with the switches a config names: "64x64 w4 s3 FLAT_LOOP=0"."""
    extra = "".join(f" {k}={v}" for k, v in config.items() if k not in CONFIG_FIELDS)
    return f"{config['BLOCK_M']}x{config['BLOCK_N']} w{config['num_warps']} s{config['num_stages']}{extra}"


# "Hopper" below means an arch with warpgroup MMAs (hardware.WARPGROUP_MMA: sm90's wgmma, and
# sm100's tcgen05, which takes the same tables unchecked); every other arch (mma.sync up to
# consumer Blackwell sm120, AMD's MFMA) takes the per-warp tiles chosen on sm80. With 16-bit
# inputs, warpgroup MMAs (wgmma) give each warpgroup of 4 warps 64 rows, so the defaults keep
# BLOCK_M >= 16 x num_warps. With 8 warps on a 64-row tile Triton lays the MMA over both warpgroups with
# warpsPerCTA = [8, 1] and each computes the whole S: a third of the tensor-core work and
# half the softmax done twice (`perf aot`: column mma_replicated; perf/aot/sm90-*.csv).

# Untuned backward defaults: (Hopper?, padded head dim <= 64?) -> family -> config. Chosen
# from an ahead-of-time compile of every kernel for sm90 and sm80 (ptxas -v, bf16, triton
# 3.6 and 3.9, no GPU needed; perf/aot/*-triton36.csv): the largest tile that keeps the dQ
# kernel in registers (first chosen when the dK/dV kernels shared it; each now has its own in
# KERNEL_DEFAULTS: it holds k, v, dk and dv in registers and needs other tiles). Hopper: dQ on wgmma where a tile allows it without spills (64x32, 4 warps; at
# D = 128, 128x32 (block-sparse) and 128x16 (ring) with 8 warps, whose query tiles lose
# nothing to 128 rows). The dilated, block-sparse and ring step families' configs are their
# dQ kernels'; their dK/dV kernels have their own (KERNEL_DEFAULTS). Dilated dQ on sm90:
# 128-row query tiles like the forward (HOPPER_FWD_DEFAULTS below), 128x64 w8 s2: wgmma, no
# spills, 165-218 registers on triton 3.6 and 3.9.
BWD_DEFAULTS = {
    (True, True): {"dilated_bwd": make_config(128, 64, 8, 2), "block_sparse_bwd": make_config(64, 32, 4, 3),
                   "ring_step_bwd": make_config(64, 32, 4, 3)},
    (True, False): {"dilated_bwd": make_config(128, 64, 8, 2),
                    "block_sparse_bwd": make_config(128, 32, 8, 3), "ring_step_bwd": make_config(128, 16, 8, 3)},
    (False, True): {"dilated_bwd": make_config(64, 32, 4, 2),
                    "block_sparse_bwd": make_config(64, 32, 4, 3), "ring_step_bwd": make_config(32, 32, 4, 3)},
    (False, False): {"dilated_bwd": make_config(64, 64, 8, 2), "block_sparse_bwd": make_config(32, 32, 4, 3),
                     "ring_step_bwd": make_config(64, 64, 8, 3)},
}
# The block-sparse and ring step backward kernels walk lists of active tiles in branch-free,
# software-pipelined loops: 3 stages give the pipeliner two rotating buffers on sm80 (an
# mma.sync reads its operands through registers: num_stages - 1 buffers) and three on sm90.
# Their tiles are the largest without spills at D <= 128 on sm90 and sm80 (`perf aot
# --configs`, triton 3.6 and 3.9). The ring step family's tiles were chosen when its dK/dV
# kernel shared them (it spilled with 32-key tiles on sm90 at D = 128 and 64-row tiles on
# sm80 at D = 64); that kernel now has its own (KERNEL_DEFAULTS), as the block-sparse one.

# Kernels whose untuned 16-bit default differs from their family's (a tuned entry of the
# family serves all its kernels): kernel -> (Hopper?, padded head dim band 64/128/256) ->
# config. The dilated dK/dV kernel's BLOCK_M is its key tile, the M dimension of its dots
# (S^T = K Q^T, dV += P^T dO, dP^T = V dO^T, dK += dS^T Q), BLOCK_N the query blocks it
# walks; it holds k, v, dk, dv (4 x BLOCK_M x D) in registers. From `perf aot --configs`
# over 8-14 candidates (bf16, triton 3.9, causal and not):
# * sm90 D = 64: 64x32 w4, wgmma, 200 registers (64x64 w4: 255, 128x32 w8: 210);
# * sm90 D = 128: 128 keys x 32 queries, 8 warps (two warpgroups of 64 keys), wgmma, 254
#   registers, no spills; every 4-warp wgmma tile spills (64x16: 52 B, 64x32: 28 B,
#   64x64: 380 B) and 8 warps on 64 keys compute S^T twice;
# * sm90 D = 256: every wgmma tile spills 4-5 KB: 32x32 w8 on mma.sync (no spills);
# * sm80 D = 64: 32x32 w4, 158-166 registers (64x16 w4 spills 4 B causal on triton 3.6,
#   64x32 w4 8-32 B); D = 128: 64x64 w8 with one stage (two
#   spill 24 B; 32x32 w4 s2 keeps its cp.async but has a quarter of the tile).
# The block-sparse dK/dV kernel likewise: BLOCK_M keys (the M dimension), BLOCK_N the query
# sub-tiles of its list walk (both divide the layout block size), in pipelined loops (3
# stages). From `perf aot --configs` (bf16, triton 3.9 and 3.6, registers 3.9/3.6):
# * sm90 D = 64: 128x64 w8, wgmma, 242/246 registers (128x128 w8 spills 0.5 KB, 64x64 w4
#   16 B on 3.6; 128x32 w8 and 64x32 w4 also spill nothing, with narrower query tiles);
# * sm90 D = 128: 128x32 w8, wgmma, 253/243 registers (128x64 w8: 172/68 B, 64x32 w4:
#   148/132 B; 128x16 w8 spills nothing, with half the query tile);
# * sm90 D = 256: every wgmma tile spills: 2.6-3.2 KB with 64 keys a warpgroup (dK and dV
#   alone are 256 registers a thread), 124-740 B with 8 warps on 64 keys (which compute
#   S^T twice), 1.7 KB with 16 warps: 32x64 w8 on mma.sync, 237/249 registers, no spills,
#   two buffers;
# * sm80 D = 64: 32x64 w4, 231/246 registers (64x32 w4: 24 B and 128x32 w8: 28 B on 3.6);
#   D = 128: 64x64 w8, 247/246 registers (64x32 w4: 68 B; 128x32 w8: 164 B); D = 256:
#   32x64 w8 with 2 stages (one buffer), 236/241 registers (3 stages: 24 B; 16x32 w4 s3
#   spills nothing but has half the keys).
# The ring step dK/dV kernel has the same transposed dots (BLOCK_M keys x BLOCK_N queries,
# walking its list of active query tiles) and adds into the travelling dK, dV with
# reductions. From `perf aot --configs` over 8-10 candidates per arch and head dim (bf16,
# triton 3.9 and 3.6, causal and not):
# * sm90 D = 64: 128x32 w8 s3, wgmma, 234-236 registers, 3 buffers (64x32 w4: 236-240);
# * sm90 D = 128: 128x32 w8 s2, wgmma, 248-255 registers, no spills (s3: 12-32 B; every
#   4-warp tile spills 20-144 B with triton 3.6; 128x64: 250-470 B);
# * sm90 D = 256: every wgmma tile spills 2 KB (64x16 w4, 128x16 w8): 32x32 w8 s3 on
#   mma.sync, 196-229 registers, no spills, 2 buffers;
# * sm80 D = 64: 128x32 w8 s3 (244 registers, 255 with 3.6; 64x32 w4 spills 24 B with
#   3.6); D = 128: 64x64 w8 s3 (254-255; every 64-key 4-warp tile and 128x32 w8 spill
#   16-830 B); D = 256: 32x32 w8 s3 (190-240, no spills).
# The decode kernels (one query row against BLOCK_N keys of its key list: vector-matrix
# work) take 64-key tiles with 4 warps and 3 stages everywhere: 0 spills on sm80 and sm90 at
# D = 64-256 with triton 3.9, where the forward family's tiles (64x32 w8 at D = 256) spill 8 B
# on sm80. Triton 3.6 spills 8 B in the causal block-sparse decode on sm90 at D = 128 with
# 64-key tiles: 32 keys there (0 spills on both versions; on sm80 32-key tiles spill 8-12 B).
_DECODE = {(hopper, band): make_config(16, 64, 4, 3) for hopper in (True, False) for band in (64, 128, 256)}
KERNEL_DEFAULTS = {
    "dilated_decode": _DECODE, "decode_merge": _DECODE,
    "block_sparse_decode": {**_DECODE, (True, 128): make_config(16, 32, 4, 3)},
    "dilated_bwd_dkdv": {
        (True, 64): make_config(64, 32, 4, 2), (True, 128): make_config(128, 32, 8, 2),
        (True, 256): make_config(32, 32, 8, 2),
        (False, 64): make_config(32, 32, 4, 2), (False, 128): make_config(64, 64, 8, 1),
    },
    "block_sparse_bwd_dkdv": {
        (True, 64): make_config(128, 64, 8, 3), (True, 128): make_config(128, 32, 8, 3),
        (True, 256): make_config(32, 64, 8, 3),
        (False, 64): make_config(32, 64, 4, 3), (False, 128): make_config(64, 64, 8, 3),
        (False, 256): make_config(32, 64, 8, 2),
    },
    "ring_step_bwd_dkdv": {
        (True, 64): make_config(128, 32, 8, 3), (True, 128): make_config(128, 32, 8, 2),
        (True, 256): make_config(32, 32, 8, 3),
        (False, 64): make_config(128, 32, 8, 3), (False, 128): make_config(64, 64, 8, 3),
        (False, 256): make_config(32, 32, 8, 3),
    },
}

# Hopper forward defaults at D <= 128 that differ from 64x64, 4 warps: the ring step kernel
# spills 124-132 B at 64x64 (and duplicates S with 8 warps); 64x32 keeps it in registers.
# The dilated forward (and dQ) on 128-row tiles, two warpgroups of 64 rows:
# The planner then tiles the LongNet schedule with stride T = 6 instead of 12, so a tile holds
# two residue classes (patterns whose rate divides 6 read the same dilated keys for both;
# rates 4 and 12 mask half the rows): `perf plan` at N = 32K, H = 16, D = 128 gives K/V reads
# from L2 of 20.2 -> 11.8 GB (causal 12.6 -> 6.7 GB) for 17% (causal 6%) more computed pairs,
# a roofline bound of 3.67 -> 2.15 ms (causal 2.30 -> 1.22 ms) on an H100 where 64-row tiles
# are L2-bound. 128x64 w8 s3 compiles to wgmma, 3 buffers, no spills, 126-243 registers on
# triton 3.6 and 3.9 at D = 64/128. Unmeasured on a GPU: the GPU check's config A/B times it
# against 64x64 w4 s3, the earlier default.
HOPPER_FWD_DEFAULTS = {"ring_step_fwd": make_config(64, 32, 4, 3), "dilated_fwd": make_config(128, 64, 8, 3)}
# Before Hopper at D <= 64: the ring step forward spills 24 B at 64x64 w4 with triton 3.6
# (0 with 3.9); 64x32 w4 spills nothing on either.
NARROW_HEAD_FWD_DEFAULTS = {"ring_step_fwd": make_config(64, 32, 4, 3)}

# 16-bit defaults for head dims over 128 (D = 256), from the same ahead-of-time compile over
# 6-7 candidates on sm90 and sm80 (perf/aot/d256-bf16.csv): 8 warps halve the registers a
# thread needs for its rows of the wide accumulators. With triton 3.6 on sm80 they spill in
# the ring step forward (92 B), and 8 warps side by side (64 columns) compute the
# 32-column S tiles twice (mma_replicated in perf/aot/sm90-sm80-bf16-after-triton36.csv):
# a 64-column tile spills 0.2-6 KB in dK/dV instead.
WIDE_HEAD_DEFAULTS = {
    "dilated_fwd": make_config(64, 32, 8, 2), "block_sparse_fwd": make_config(64, 32, 8, 2),
    "ring_step_fwd": make_config(32, 64, 4, 2),
    "dilated_bwd": make_config(32, 32, 8, 2), "block_sparse_bwd": make_config(64, 16, 8, 2),
    "ring_step_bwd": make_config(32, 32, 8, 2),
}
# Hopper at D = 256: 64-row tiles with 4 warps or 128-row tiles with 8 (no duplicated S).
# dilated_fwd 128x32 w8 s2: no spills on 3.6 and 3.9 (64x32 w4 s3: 20 B; 128x32 w8 s3: 8 B);
# block-sparse 128-row tiles (one layout block) spill nothing; dilated dQ 128x16 w8: wgmma,
# no spills (64x16 w4: 124 B; its dK/dV: KERNEL_DEFAULTS). The ring step forward and the
# ring backward keep the tiles above: every wgmma tile spills 0.5-4 KB there.
HOPPER_WIDE_HEAD_DEFAULTS = {
    **WIDE_HEAD_DEFAULTS,
    "dilated_fwd": make_config(128, 32, 8, 2), "block_sparse_fwd": make_config(128, 32, 8, 2),
    "block_sparse_bwd": make_config(128, 16, 8, 2), "dilated_bwd": make_config(128, 16, 8, 2),
}

# Per-warp MMA archs with cp.async and at most 99 KiB of shared memory per block (sm86, sm89,
# sm120: hardware.ARCH_TABLE) where the tile chosen on sm80 spills: the spill-free candidate on
# all three (`perf aot --configs`, bf16, triton 3.9, causal and not;
# perf/aot/sm120-sm89-sm86-d64-candidates-bf16-triton39.csv), keyed by (kernel or family, band):
# * dilated dK/dV, D = 64: 32x32 w4 s2 spills 8 B without causal; 64x32 w4 s2: 235-252
#   registers, no spills (two keys tiles' worth of work per program, one buffer);
# * block-sparse dQ (the family's config), D = 64: 64x32 w4 s3 spills 8-12 B; 64x16 w4 s3
#   (128-155 registers, 2 buffers) keeps the 64-row query tile;
# * ring step dQ, D = 64: 32x32 w4 s3 spills 8 B on sm86/sm89; 64x32 w4 s3: 168-188 registers.
MID_SMEM_DEFAULTS = {
    ("dilated_bwd_dkdv", 64): make_config(64, 32, 4, 2),
    ("block_sparse_bwd", 64): make_config(64, 16, 4, 3),
    ("ring_step_bwd", 64): make_config(64, 32, 4, 3),
}


# AMD CDNA (gfx942: MI300, 64 KiB LDS; gfx950: MI355, 160 KiB), 16-bit, D <= 128, where the
# per-warp tile chosen on sm80 spills there: a wavefront is 64 threads and a workgroup of 8
# waves gets at most 256 VGPRs each (4 waves: 512), so these are all 4-warp tiles (`perf aot
# --arch gfx942 gfx950 --configs`, bf16, triton 3.9, causal; perf/aot/gfx942-gfx950-candidates-
# bf16-triton39.csv; VGPRs gfx942/gfx950, 0 spills on both unless said), keyed as MID_SMEM_DEFAULTS:
# * forward (dilated, block-sparse, ring step), D = 128: 64x32 w4 s2, 254/228, 214/187 and
#   260/268 VGPRs (64x64 w8 spilled 108-264 B; 64x64 w4 needs 313-374 VGPRs: occupancy 1);
# * dilated dQ (the family's config), D = 128: 32x64 w4 s2, 365/385 (64x64 w8 spilled 0.5 KB
#   on gfx950; 64x32 w4 spills 4 B on gfx942);
# * ring step dQ, D = 128: 64x32 w4 s2, 406/308 (64x64 w8: 0.9 KB on gfx950);
# * dK/dV (dilated, block-sparse, ring step), D = 128: 64 keys x 16 queries, w4 s2, 340/228,
#   354/234 and 281/227 (64x32 w4 spills 168-348 B on gfx942; 32x32 w4 20-152 B);
# * block-sparse and ring step dK/dV, D = 64: 64x32 w4 s2, 426/366 and 328/287 (the sm80
#   tiles 32x64 w4 and 128x32 w8 spilled 0.2-1.9 KB).
CDNA_DEFAULTS = {
    ("dilated_fwd", 128): make_config(64, 32, 4, 2),
    ("block_sparse_fwd", 128): make_config(64, 32, 4, 2),
    ("ring_step_fwd", 128): make_config(64, 32, 4, 2),
    ("dilated_bwd", 128): make_config(32, 64, 4, 2),
    ("ring_step_bwd", 128): make_config(64, 32, 4, 2),
    ("dilated_bwd_dkdv", 128): make_config(64, 16, 4, 2),
    ("block_sparse_bwd_dkdv", 128): make_config(64, 16, 4, 2),
    ("ring_step_bwd_dkdv", 128): make_config(64, 16, 4, 2),
    ("block_sparse_bwd_dkdv", 64): make_config(64, 32, 4, 2),
    ("ring_step_bwd_dkdv", 64): make_config(64, 32, 4, 2),
    # D = 256 (perf/aot/gfx942-gfx950-d256-candidates-bf16-triton39.csv, causal): 4 warps, as
    # at D = 128 (the 8-warp tiles spilled 12-4904 B in 18 of 26 compiles on the two archs);
    # forward 64x32 (321-386 VGPRs), dQ 16x32 (268-362; 32x32 overflows gfx942's 64 KiB LDS by
    # the estimate), dK/dV 32x16 (272-462; 32x32 spills 0.7-1 KB on gfx942): 0 spills on both
    **{(family, 256): make_config(64, 32, 4, 2) for family in ("dilated_fwd", "block_sparse_fwd", "ring_step_fwd")},
    **{(family, 256): make_config(16, 32, 4, 2) for family in ("dilated_bwd", "block_sparse_bwd", "ring_step_bwd")},
    **{(kernel, 256): make_config(32, 16, 4, 2) for kernel in ("dilated_bwd_dkdv", "block_sparse_bwd_dkdv",
                                                               "ring_step_bwd_dkdv")},
}

# Volta and Turing (sm70, sm75): Triton 3.9 compiles tl.dot there to FMA loops, in float16
# and bfloat16 alike (no mma.sync: perf/aot/sm75-sm70-*.csv), whose operands and accumulators
# sit in registers: the sm80 tiles (64x64 w4) spill 3.4 KB in the forward at D = 64. From
# `perf aot --arch 75 70 --configs` (fp16, causal; perf/aot/sm75-sm70-candidates-fp16-triton39.csv):
# forward 32x32 w4 at D = 64 (221-247 registers), 16x32 w4 at D = 128 (219-254; 32x32 spills
# 1.3 KB); dQ 32x32 w8 at D = 64 (222-244; 32x32 w4 spills 0.4-0.9 KB), 16x32 w8 at D = 128 (the
# least with 4 warps: 268-528 B); dK/dV 16x16 w4 at D = 64. One stage: no cp.async to pipeline.
# D = 128 backward: 16x16 tiles with 8 warps. Before the dots ran in pieces these sat at the
# 255-register edge and spilled 8-124 B in a few of 48 compiles (perf/aot/sm75-sm70-fma-w8-triton39.csv):
# the FMA dot holds a whole row of each operand per thread, 256 values at D = 128. With
# DOT_MODE = DOT_PIECES (runtime.dot_mode: head-dim contractions in 64-wide pieces) they need
# 168-238 registers and none spills (perf/aot/sm75-dot-pieces-candidates-fp16-triton39.csv, 90
# compiles; sm70: perf/aot/sm70-dot-pieces-candidates-bf16-triton39.csv, 96). The pieces cost
# the forward at D = 128 a few registers: 16x32 w4 spilled 4-8 B on sm70, so 16x32 w8 (214-246
# registers, no spill on either arch). At D = 256 16x16 w8 is the least-spilling candidate in
# every kernel: none in the forward and dQ kernels on sm75 (170-176 registers; w4 spills 24-116
# B) and on sm70 but its block-sparse ones (forward 8 B causal, dQ 28-48 B), 4-460 B in the
# dK/dV kernels (w4: 0.8-2 KB). The ring step's dK/dV at D = 64 in bf16 spills 12 B with 4
# warps: 8 warps (128 registers, no spill).
_FMA_FWD = {64: make_config(32, 32, 4, 1), 128: make_config(16, 32, 8, 1), 256: make_config(16, 16, 8, 1)}
_FMA_DQ = {64: make_config(32, 32, 8, 1), 128: make_config(16, 16, 8, 1), 256: make_config(16, 16, 8, 1)}
_FMA_DKDV = {64: make_config(16, 16, 4, 1), 128: make_config(16, 16, 8, 1), 256: make_config(16, 16, 8, 1)}
FMA_DEFAULTS = {
    **{(family, band): cfg for family in ("dilated_fwd", "block_sparse_fwd", "ring_step_fwd")
       for band, cfg in _FMA_FWD.items()},
    **{(family, band): cfg for family in ("dilated_bwd", "block_sparse_bwd", "ring_step_bwd")
       for band, cfg in _FMA_DQ.items()},
    **{(kernel, band): cfg for kernel in ("dilated_bwd_dkdv", "block_sparse_bwd_dkdv", "ring_step_bwd_dkdv")
       for band, cfg in _FMA_DKDV.items()},
    ("ring_step_bwd_dkdv", 64): make_config(16, 16, 8, 1),
}


# Datacenter Blackwell (sm100: tcgen05 MMAs, 227 KiB) where the Hopper tiles it inherits spill
# (perf/aot/sm100-defaults-bf16-triton39.csv: 8 of 26 causal compiles at D <= 128, 8-348 B).
# From `perf aot --arch 100 --configs` (bf16, triton 3.9; perf/aot/sm100-candidates-bf16-triton39.csv):
# * dK/dV (dilated, block-sparse, ring step), D = 64 and 128: 128 keys x 32 queries, w8, one stage,
#   128-254 registers and no spill on all three (with 2 stages every 128x32 and 64x32 tile spills
#   at D = 128: the second buffer of q and dO costs the registers); a GPU run (perf tune) may
#   prefer a pipelined 64x16 tile at D = 64, which also compiles without spills; the ring step's
#   dK/dV at D = 64 takes 64x32 w4 s2 (216-222 registers): 128x32 w8 s1 spills 100 B without causal;
# * block-sparse forward, D = 128: 128x32 w8 s2, 193-211 registers (64x64 w4 s3 spills 36 B
#   causal; 128x64 w8 s2 compiles at 240-255, no headroom);
# * ring step dQ, D = 64: 64x32 w4 s2, 122 registers (s3 spills 8 B causal);
# * block-sparse decode (perf/aot/sm100-block-sparse-decode-candidates-bf16-triton39.csv): the
#   64- and 32-key tiles spill 4-12 B at D = 128 without causal (at 72-96 registers: ptxas
#   keeps a local array, not register pressure), 16x128 w4 s3 does not (134); D = 256:
#   16x32 w4 s2 (94-96 registers; 64 keys spill 8 B).
_TCGEN05_DKDV = make_config(128, 32, 8, 1)
TCGEN05_DEFAULTS = {
    **{(kernel, band): _TCGEN05_DKDV for kernel in ("dilated_bwd_dkdv", "block_sparse_bwd_dkdv", "ring_step_bwd_dkdv")
       for band in (64, 128)},
    ("ring_step_bwd_dkdv", 64): make_config(64, 32, 4, 2),
    ("block_sparse_fwd", 128): make_config(128, 32, 8, 2),
    ("ring_step_bwd", 64): make_config(64, 32, 4, 2),
    ("block_sparse_decode", 128): make_config(16, 128, 4, 3),
    ("block_sparse_decode", 256): make_config(16, 32, 4, 2),
}


def _mid_smem(arch: Arch) -> bool:
    return not arch.warpgroup_mma and arch.async_copy and arch.shared_memory < 160 * 1024


def _arch_defaults(arch: Arch) -> dict:
    """The per-arch table of 16-bit defaults that replace the sm80/sm90 rule's where they
    spill: MID_SMEM_DEFAULTS (sm86, sm89, sm120), CDNA_DEFAULTS (AMD), FMA_DEFAULTS (archs where
    Triton's dots are FMA loops: sm70, sm75), TCGEN05_DEFAULTS (sm100), else none."""
    if arch.vendor == "amd":
        return CDNA_DEFAULTS
    if arch.mma == "fma":
        return FMA_DEFAULTS
    if arch.mma == "tcgen05":
        return TCGEN05_DEFAULTS
    return MID_SMEM_DEFAULTS if _mid_smem(arch) else {}


def is_backward(family: str) -> bool:
    return family.endswith("_bwd")


def shared_memory_estimate(family: str, config: dict, head_dim_padded: int, element_size: int) -> int:
    """Rough shared memory of a launch, in bytes: forward, the q tile plus the pipelined k, v
    tiles; backward, the pipelined q, dO tiles, the k, v tiles and a float32 score tile."""
    stages = max(1, config["num_stages"] - 1)
    m, n, d = config["BLOCK_M"], config["BLOCK_N"], head_dim_padded
    if element_size == 4:   # float32 dots are three tf32 products: split operands, about twice the space
        element_size = 8
    if not is_backward(family):
        return (m + stages * 2 * n) * d * element_size
    return (stages * 2 * m + 2 * n) * d * element_size + m * n * 4


def config_fits(family: str, config: dict, head_dim_padded: int, arch: Arch, dtype: torch.dtype) -> bool:
    """Whether the shared-memory estimate of `config` fits one block of `arch`. Before
    Ampere (no async copies) Triton lays operands out differently: the ahead-of-time compile
    for sm75/sm70 needs up to about twice the estimate."""
    factor = 2 if arch.vendor == "nvidia" and not arch.async_copy else 1
    element_size = torch.tensor([], dtype=dtype).element_size()
    limit = arch.shared_memory or 48 * 1024
    return factor * shared_memory_estimate(family, config, head_dim_padded, element_size) <= limit


def default_config(family: str, head_dim_padded: int, arch: Arch, dtype: torch.dtype = torch.bfloat16,
                   kernel: str | None = None) -> dict:
    """The config used where configs/<arch>.json has no tuned entry. Forward kernels:
    64x64 tiles, 4 warps (Hopper: HOPPER_FWD_DEFAULTS, else 4 warps up to D=64 and 8 up to
    D=128: no spills on sm80); backward kernels: BWD_DEFAULTS; D > 128: (HOPPER_)
    WIDE_HEAD_DEFAULTS; float32: small tiles; `kernel` (its AOT name): KERNEL_DEFAULTS where
    it has an entry; on sm86/sm89/sm120, MID_SMEM_DEFAULTS first, on AMD CDNA_DEFAULTS, on
    sm70/sm75 FMA_DEFAULTS, on sm100 TCGEN05_DEFAULTS. Then fewer stages, then
    smaller tiles, until the shared-memory estimate fits the arch. "Hopper" tiles: archs with
    warpgroup MMAs (Arch.warpgroup_mma), whatever their compute capability."""
    big_smem = arch.shared_memory >= 160 * 1024
    # the 128-row, 8-warp tiles are made for warpgroup MMAs (wgmma, tcgen05); every other
    # family (mma.sync up to consumer Blackwell, AMD's MFMA) takes the per-warp tiles
    hopper = arch.warpgroup_mma
    backward = is_backward(family)
    band = 64 if head_dim_padded <= 64 else 128 if head_dim_padded <= 128 else 256
    own = KERNEL_DEFAULTS.get(kernel, {}).get((hopper, band))
    mid = _arch_defaults(arch).get((kernel, band) if kernel in KERNEL_DEFAULTS else (family, band))
    if mid and dtype != torch.float32:
        cfg = dict(mid)
    elif own is not None and dtype != torch.float32:
        cfg = dict(own)
    elif dtype == torch.float32:
        # three tf32 products per dot need about twice the registers and shared memory: every
        # tile spills at D=128 and 64x64 (s3) overflows an H100 block; 32x32 keeps spills
        # moderate (block-sparse backward: 64x32, where 32x32 spills 20 KB)
        cfg = make_config(64 if family == "block_sparse_bwd" else 32, 32, 4, 2)
    elif head_dim_padded > 128 and family in WIDE_HEAD_DEFAULTS:
        cfg = dict((HOPPER_WIDE_HEAD_DEFAULTS if hopper else WIDE_HEAD_DEFAULTS)[family])
    elif backward:
        by_family = BWD_DEFAULTS[(hopper, head_dim_padded <= 64)]
        cfg = dict(by_family.get(family, make_config(64, 32, 4, 2)))
    elif hopper:
        cfg = dict(HOPPER_FWD_DEFAULTS.get(family, make_config(64, 64, 4, 3 if big_smem else 2)))
    elif head_dim_padded <= 64 and family in NARROW_HEAD_FWD_DEFAULTS:
        cfg = dict(NARROW_HEAD_FWD_DEFAULTS[family])
    else:
        cfg = make_config(64, 64, 4 if head_dim_padded <= 64 else 8, 3 if big_smem else 2)
    while not config_fits(family, cfg, head_dim_padded, arch, dtype):
        if cfg["num_stages"] > 1:
            cfg["num_stages"] -= 1
        elif max(cfg["BLOCK_M"], cfg["BLOCK_N"]) > 16:
            cfg["BLOCK_M" if cfg["BLOCK_M"] >= cfg["BLOCK_N"] else "BLOCK_N"] //= 2
            cfg["num_warps"] = 4   # smaller tiles than chosen: 8 warps would sit idle
        else:
            break
    return cfg


def seq_bucket(n: int) -> int:
    """Sequence-length bucket: the next power of two, at least 1024, at most 1M."""
    b = 1024
    while b < n and b < (1 << 20):
        b *= 2
    return b


def config_key(dtype: torch.dtype, head_dim_padded: int, seqlen: int) -> str:
    """The key of a tuned entry in configs/<arch>.json: "<dtype>/d<padded D>/n<bucket>"."""
    return f"{str(dtype).removeprefix('torch.')}/d{head_dim_padded}/n{seq_bucket(seqlen)}"


# What a tuned entry may hold (checked once per file, when it is loaded): tiles of 16-256
# (tl.dot's minimum; `perf tune` proposes at most 128), warps and stages Triton accepts.
TILE_RANGE = (16, 256)
WARPS = (1, 2, 4, 8, 16)
STAGES = range(1, 9)
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _known_families() -> set:
    from ..ops import SPECS     # imported late: the variants' kernels import this module
    return {family for spec in SPECS for family in spec.families}


# The kernels a tuned table may hold an entry of their own for, beside the families: the
# dK/dV kernels, whose tiles (keys x queries, transposed dots) are not their family's dQ
# tiles, so a family entry leaves them on KERNEL_DEFAULTS. -> the family (its switches,
# none of which they take, and its shared-memory rule).
TUNED_KERNELS = {"dilated_bwd_dkdv": "dilated_bwd", "block_sparse_bwd_dkdv": "block_sparse_bwd",
                 "ring_step_bwd_dkdv": "ring_step_bwd"}


def entry_problems(family: str, key: str, config, arch_name: str) -> list[str]:
    """Why a tuned entry (kernels[family][key] = config) cannot be used, as messages ([] when
    it can): an unknown family or malformed key "<dtype>/d<D>/n<bucket>", a config that is not
    a dict of ints with exactly CONFIG_FIELDS and the family's switches, tiles that are not
    powers of two in TILE_RANGE, warps or stages Triton would refuse, a switch value the
    family does not have, or (for a known arch) a shared-memory estimate over the arch's."""
    known = _known_families() | set(TUNED_KERNELS)
    if family not in known:
        return [f"unknown kernel family {family!r} (known: {', '.join(sorted(known))})"]
    parts = key.split("/") if isinstance(key, str) else []
    ok_key = (len(parts) == 3 and parts[0] in _DTYPES and parts[1][:1] == "d" and parts[1][1:].isdigit()
              and parts[2][:1] == "n" and parts[2][1:].isdigit())
    if not ok_key:
        return [f"key {key!r} is not \"<dtype>/d<head dim>/n<bucket>\" (e.g. \"bfloat16/d128/n8192\")"]
    if not isinstance(config, dict):
        return [f"must be an object of {', '.join(CONFIG_FIELDS)}, got {type(config).__name__}"]
    switches = {} if family in TUNED_KERNELS else VARIANT_SWITCHES.get(family, {})
    problems = [f"unknown key {name!r}" for name in config if name not in CONFIG_FIELDS and name not in switches]
    problems += [f"missing {name}" for name in CONFIG_FIELDS if name not in config]
    for name, value in config.items():
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{name} must be an int, got {value!r}")
    if problems:
        return problems
    lo, hi = TILE_RANGE
    for name in ("BLOCK_M", "BLOCK_N"):
        v = config[name]
        if not (lo <= v <= hi and v & (v - 1) == 0):
            problems.append(f"{name} must be a power of two in [{lo}, {hi}], got {v}")
    if config["num_warps"] not in WARPS:
        problems.append(f"num_warps must be one of {list(WARPS)}, got {config['num_warps']}")
    if config["num_stages"] not in STAGES:
        problems.append(f"num_stages must be in [{STAGES.start}, {STAGES.stop - 1}], got {config['num_stages']}")
    for name, switch in switches.items():
        if name in config and config[name] not in switch.values:
            problems.append(f"{name} must be one of {list(switch.values)}, got {config[name]}")
    if problems:
        return problems
    try:
        arch = fake_arch(arch_name)
    except ValueError:
        return []   # an arch the table does not know: no limit to check against
    head_dim, dtype = int(parts[1][1:]), _DTYPES[parts[0]]
    if not config_fits(TUNED_KERNELS.get(family, family), config, head_dim, arch, dtype):
        problems.append(f"needs more shared memory than {arch_name}'s {arch.shared_memory // 1024} KiB per block "
                        f"(estimate)")
    return problems


def validate_table(table, source: str, arch_name: str) -> dict:
    """The usable part of a parsed tuned table: entries with problems are dropped, all of them
    reported in one warning naming `source`, each entry's key and reason. Dropping, not
    raising: tuned entries only make kernels faster (the defaults are always correct and
    checked by `perf aot`), so a damaged file must neither stop the kernels nor run a config
    that gives garbage (BLOCK_M = 0 ran and returned NaN) or sends `auto` to the portable path
    (4096-wide tiles); the warning says what to fix. `perf tune` writes files that pass."""
    problems = []
    if not isinstance(table, dict) or not isinstance(table.get("kernels", {}), dict):
        problems.append(f"must be an object with a \"kernels\" object, got {type(table).__name__}"
                        + (f" with \"kernels\" a {type(table.get('kernels')).__name__}" if isinstance(table, dict)
                           else ""))
        table = {}
    kept = {}
    for family, entries in table.get("kernels", {}).items():
        if not isinstance(entries, dict):
            problems.append(f"kernels[{family!r}] must be an object of entries, got {type(entries).__name__}")
            continue
        for key, config in entries.items():
            bad = entry_problems(family, key, config, arch_name)
            if bad:
                problems.append(f"kernels[{family!r}][{key!r}]: " + "; ".join(bad))
            else:
                kept.setdefault(family, {})[key] = config
    if problems:
        warnings.warn(f"tuned configs {source}: ignoring {len(problems)} unusable part(s) (the default configs serve "
                      f"them): " + " | ".join(problems), UserWarning, stacklevel=3)
    return {**table, "kernels": kept}


def tuned_table_path(arch_name: str):
    """The package's configs/<arch>.json (a Traversable; it may not exist)."""
    return resources.files("triton_dilated.configs").joinpath(f"{arch_name}.json")


@functools.lru_cache(maxsize=None)
def load_arch_table(arch_name: str) -> dict:
    """The parsed and validated configs/<arch>.json ({} when there is none; validate_table
    drops, with one warning naming the file, what cannot be used)."""
    path = tuned_table_path(arch_name)
    try:
        text = path.read_text()
    except (FileNotFoundError, ModuleNotFoundError):
        return {}
    try:
        table = json.loads(text)
    except json.JSONDecodeError as exc:
        warnings.warn(f"tuned configs {path}: not valid JSON ({exc}); ignoring the file (the default configs serve "
                      f"every kernel). `python -m triton_dilated.perf tune` rewrites it.", UserWarning, stacklevel=2)
        return {}
    return validate_table(table, str(path), arch_name)


def tuned_entry(family: str, dtype: torch.dtype, head_dim_padded: int, seqlen: int, arch_name: str):
    """(config, source) from configs/<arch>.json: the exact bucket ("<arch>.json"), else the
    nearest tuned bucket of the same dtype and head dim ("<arch>.json nearest bucket"), else
    (None, "fallback")."""
    table = load_arch_table(arch_name).get("kernels", {}).get(family, {})
    key = config_key(dtype, head_dim_padded, seqlen)
    if key in table:
        return dict(table[key]), f"{arch_name}.json"
    prefix = key.rsplit("/", 1)[0] + "/n"
    near = sorted((abs(int(k.rsplit("n", 1)[1]).bit_length() - seq_bucket(seqlen).bit_length()), k)
                  for k in table if k.startswith(prefix))
    if near:
        return dict(table[near[0][1]]), f"{arch_name}.json nearest bucket"
    return None, "fallback"


def select_config(family: str, dtype: torch.dtype, head_dim_padded: int, seqlen: int,
                  device: torch.device, kernel: str | None = None) -> dict:
    """The launch config: one fixed config off-GPU (the interpreter); on a GPU, the tuned
    entry of configs/<arch>.json (one for every kernel of the family), else default_config.
    A kernel with a KERNEL_DEFAULTS entry (the dilated, block-sparse and ring step dK/dV, the
    decode kernels) keeps its own default: `perf tune` times each family's first kernel, so a
    tuned family entry says nothing about them; a dK/dV kernel takes an entry under its own
    name (TUNED_KERNELS) where the table has one."""
    if device.type != "cuda":
        return dict(INTERPRETER_CONFIG)
    arch = device_arch(device)
    if kernel in TUNED_KERNELS:
        cfg, _ = tuned_entry(kernel, dtype, head_dim_padded, seqlen, arch.name)
        if cfg is not None:
            return cfg
    if kernel in KERNEL_DEFAULTS:
        return default_config(family, head_dim_padded, arch, dtype, kernel)
    cfg, _ = tuned_entry(family, dtype, head_dim_padded, seqlen, arch.name)
    return cfg if cfg is not None else default_config(family, head_dim_padded, arch, dtype, kernel)


# Volta and Turing (Arch.mma == "fma"): the families whose default tiles spill at a head dim
# band: the backward at D = 256, whose dK/dV kernels spill 4-460 B even with the dots in
# pieces (FMA_DEFAULTS; sm70's block-sparse dQ 28-48 B). "auto" takes the portable path
# there, whose matmuls and SDPA run on the tensor cores Triton 3.9 does not use before sm80;
# backend="triton" still runs the kernels. At D <= 128 no default spills there (the backward
# did at D = 128 before DOT_PIECES).
FMA_SPILLING = {(family, 256) for family in ("dilated_bwd", "block_sparse_bwd", "ring_step_bwd")}


def kernels_spill_free(families, head_dim: int, device: torch.device) -> bool:
    """Whether the default tiles of `families` compile without register spills for this head
    dim on this GPU (what backend="auto" asks before taking the Triton kernels). False only
    on archs without tensor-core dots in Triton (sm70, sm75), for FMA_SPILLING. Off-GPU: True."""
    if device.type != "cuda":
        return True
    arch = device_arch(device)
    padded = padded_head_dim(head_dim)
    band = 64 if padded <= 64 else 128 if padded <= 128 else 256
    return not (arch.mma == "fma" and any((f, band) in FMA_SPILLING for f in families))


def kernels_fit(families, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the Triton kernels of `families` can run this problem on this GPU: a config of
    each fits shared memory (no tile fits a Turing block for the backward at D = 256), and
    the GPU has TF32 tensor cores for float32 (Ampere on; before, the kernels' float32 dots
    are slow FMA loops with tiles that do not fit). Off-GPU: True."""
    if device.type != "cuda":
        return True
    padded = padded_head_dim(head_dim)
    arch = device_arch(device)
    if dtype == torch.float32 and not arch.tf32:
        return False
    return all(config_fits(f, select_config(f, dtype, padded, 1024, device), padded, arch, dtype) for f in families)
