"""The indexed variant's launch tiles. A forward or dQ program owns one query of one kv head
and BLOCK_H of the query heads that share its indices row (the M dimension of its dots,
padded to 16, tl.dot's minimum), and gathers the listed key rows BLOCK_K indices at a time.
A dK/dV program owns one key and walks the (query, head) rows that read it, BLOCK_R at a
time (vector work: one key row has no dot to feed).

Not yet tuned on a GPU (no `perf aot` rows): one rule for every arch, smaller gathers for
wide heads so the [BLOCK_K, BLOCK_D] tiles stay in registers."""
from __future__ import annotations

from ..common.hardware import padded_head_dim

INTERPRETER = dict(BLOCK_K=32, BLOCK_R=32, num_warps=4, num_stages=1)
MAX_BLOCK_H = 64


def head_block(group: int) -> int:
    """BLOCK_H: the query heads of one kv head, padded to a power of two in [16, MAX_BLOCK_H]
    (more heads take several programs)."""
    return min(MAX_BLOCK_H, max(16, 1 << (group - 1).bit_length()))


def indexed_tiles(group: int, head_dim: int, head_dim_v: int, device) -> dict:
    """The launch tiles for q heads per kv head `group` and head dims (Dqk, Dv) on `device`."""
    tiles = dict(BLOCK_H=head_block(group))
    if device.type != "cuda":
        return {**tiles, **INTERPRETER}
    widest = max(padded_head_dim(head_dim), padded_head_dim(head_dim_v))
    block_k = 64 if widest <= 64 else 32 if widest <= 128 else 16
    return {**tiles, "BLOCK_K": block_k, "BLOCK_R": 64 if widest <= 128 else 32, "num_warps": 4,
            "num_stages": 2}
