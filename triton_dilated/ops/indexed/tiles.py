"""The indexed variant's launch tiles. A forward or dQ program owns one query of one kv head
and BLOCK_H of the query heads that share its indices row (the M dimension of its dots,
padded to 16, tl.dot's minimum), and gathers the listed key rows BLOCK_K indices at a time.
A dK/dV program owns one key and walks the (query, head) rows that read it, BLOCK_R at a
time (vector work: one key row has no dot to feed).

Not yet tuned on a GPU: one rule for every arch, read off ahead-of-time compiles for sm90 and
sm80 (triton 3.9, ptxas -v; bf16 and float32, (Dqk, Dv) = (64, 64), (128, 128), (192, 128),
(576, 512)): smaller gathers for wide heads and float32 (whose tf32x3 dots take three times the
registers) and 8 warps for them, so the [BLOCK_K, BLOCK_D] tiles stay in registers; the dK/dV
kernel's rows at 16 (32 spilled at D = 128). Still spilling there: the float32 dQ at Dqk 192
and the FP8 forward at (576, 512)."""
from __future__ import annotations

import torch

from ..common.hardware import padded_head_dim

INTERPRETER = dict(BLOCK_K=32, BLOCK_R=32, num_warps=4, num_stages=1)
MAX_BLOCK_H = 64


def head_block(group: int) -> int:
    """BLOCK_H: the query heads of one kv head, padded to a power of two in [16, MAX_BLOCK_H]
    (more heads take several programs)."""
    return min(MAX_BLOCK_H, max(16, 1 << (group - 1).bit_length()))


def indexed_tiles(group: int, head_dim: int, head_dim_v: int, dtype, device) -> dict:
    """The launch tiles for q heads per kv head `group`, head dims (Dqk, Dv) and q's dtype on
    `device`."""
    tiles = dict(BLOCK_H=head_block(group))
    if device.type != "cuda":
        return {**tiles, **INTERPRETER}
    widest = max(padded_head_dim(head_dim), padded_head_dim(head_dim_v))
    fp32 = dtype == torch.float32
    block_k = 16 if fp32 or widest > 128 else 32 if widest > 64 else 64
    warps = 8 if (fp32 and widest > 64) or widest > 256 else 4
    return {**tiles, "BLOCK_K": block_k, "BLOCK_R": 16, "num_warps": warps, "num_stages": 2}
