"""The indexed variant's launch tiles. A forward or dQ program owns one query of one kv head
and BLOCK_H of the query heads that share its indices row (the M dimension of its dots,
padded to 16, tl.dot's minimum), and gathers the listed key rows BLOCK_K indices at a time.
A dK/dV program owns one key and walks the (query, head) rows that read it, BLOCK_R at a
time (vector work: one key row has no dot to feed).

Not yet tuned on a GPU: rules read off ahead-of-time compiles (triton 3.9, ptxas -v; perf/aot/indexed-*.csv),
the same on every arch with tensor cores:
* gathers of 32 keys, 16 for float32 (whose tf32x3 dots take three times the registers) and for
  head dims over 128, on 4 warps (8 for float32 over 64 and over 256), so the [BLOCK_K, BLOCK_D]
  tiles stay in registers (64-key gathers spilled 4 B on sm120 at D = 64);
* the dK/dV kernel's rows at 32 (16 spilled 8-12 B on sm90 bf16 at D = 128 and sm80 float32; 32
  compiles without spills for heads tiles 1, 4 and 16, D 64-256, bf16 and float32, sm75-sm120);
* Volta and Turing compile the dots to FMA loops: 16-key gathers on 8 warps there (64 keys at
  D = 64 spilled 436 B on sm70);
* the absorbed-MLA shape (576, 512): a forward of 1 stage (2 spilled 320-1560 B with an FP8 cache
  and overflowed the 99 KiB of sm86/sm89/sm120; 1 fits them without spills, 16-bit or FP8), a dQ
  of 2 (1 spilled and took 112 KiB) and 8 dK/dV rows (16 and 32 spilled on 4 warps or near it);
  on AMD 4 warps (8 spilled 224-276 B on gfx942/gfx950).
Still spilling: the float32 dQ at Dqk 192 (72-128 B on sm80/sm90)."""
from __future__ import annotations

import torch

from ..common.hardware import device_arch, padded_head_dim

INTERPRETER = dict(BLOCK_K=32, BLOCK_R=32, num_warps=4, num_stages=1, forward_stages=1)
MAX_BLOCK_H = 64


def head_block(group: int) -> int:
    """BLOCK_H: the query heads of one kv head, padded to a power of two in [16, MAX_BLOCK_H]
    (more heads take several programs)."""
    return min(MAX_BLOCK_H, max(16, 1 << (group - 1).bit_length()))


def indexed_tiles(group: int, head_dim: int, head_dim_v: int, dtype, device) -> dict:
    """The launch tiles for q heads per kv head `group`, head dims (Dqk, Dv) and q's dtype on
    `device` (the interpreter's on a CPU)."""
    if device.type != "cuda":
        return dict(BLOCK_H=head_block(group), **INTERPRETER)
    return compiled_tiles(group, head_dim, head_dim_v, dtype, device_arch(device))


def compiled_tiles(group: int, head_dim: int, head_dim_v: int, dtype, arch) -> dict:
    """The tiles on GPU arch `arch` (hardware.Arch; perf aot passes a fake one); the forward's
    pipeline depth is forward_stages, the backward's num_stages."""
    widest = max(padded_head_dim(head_dim), padded_head_dim(head_dim_v))
    fp32 = dtype == torch.float32
    wide = widest > 256   # the absorbed-MLA shape (576, 512)
    if arch.mma == "fma":    # Volta/Turing: dots as FMA loops, 16-key gathers on 8 warps stay in registers
        block_k, warps = 16, 8
    else:
        block_k = 16 if fp32 or widest > 128 else 32
        # wide heads on 8 warps, but on AMD (waves of 64: 8 spilled 224-276 B on gfx942/gfx950 there)
        warps = 8 if (fp32 and widest > 64) or (wide and arch.mma != "mfma") else 4
    return dict(BLOCK_H=head_block(group), BLOCK_K=block_k, BLOCK_R=8 if wide else 32, num_warps=warps, num_stages=2,
                forward_stages=1 if wide else 2)


def indexer_tiles(heads: int, device) -> dict:
    """The indexer's scoring tiles for `heads` indexer heads on `device`: BLOCK_HH heads (padded
    to 16, at most 64) per dot, BLOCK_T keys per program."""
    block_hh = min(64, max(16, 1 << (heads - 1).bit_length()))
    if device.type != "cuda":
        return dict(BLOCK_HH=block_hh, BLOCK_T=32, num_warps=4, num_stages=1)
    return compiled_indexer_tiles(heads, device_arch(device))


def compiled_indexer_tiles(heads: int, arch) -> dict:
    """The indexer's tiles on GPU arch `arch`: 64 keys per program on 4 warps; on Volta/Turing
    (FMA loops) 32 keys on 8 warps (64 spilled on sm70 and overflowed sm75's shared memory at D = 256)."""
    block_hh = min(64, max(16, 1 << (heads - 1).bit_length()))
    fma = arch.mma == "fma"
    return dict(BLOCK_HH=block_hh, BLOCK_T=32 if fma else 64, num_warps=8 if fma else 4, num_stages=2)
