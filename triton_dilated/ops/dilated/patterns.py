"""Which (segment length, dilation rate, offset) triples each head uses (DESIGN §3)."""
from __future__ import annotations

import functools
import math

from ..common.validation import check_choice, check_positive_int_list

MODES = ("longnet", "head_groups")
OFFSETS = ("modulo", "blocked")


def check_patterns(segment_lengths, dilation_rates, mode="longnet", offsets="modulo"):
    """Validate the pattern arguments; return a tuple of (w, r) pairs."""
    ws = check_positive_int_list("segment_lengths", segment_lengths)
    rs = check_positive_int_list("dilation_rates", dilation_rates)
    if len(ws) != len(rs):
        raise ValueError(f"segment_lengths and dilation_rates must have the same length, "
                         f"got {len(ws)} and {len(rs)}")
    check_choice("mode", mode, MODES)
    check_choice("offsets", offsets, OFFSETS)
    return tuple(zip(ws, rs))


@functools.lru_cache(maxsize=256)
def head_offsets(num_heads: int, patterns: tuple, mode: str, offsets: str) -> tuple:
    """Offsets per (query head, pattern): a tuple of num_heads tuples of len(patterns) ints,
    -1 where the head does not use the pattern.

    longnet: every head uses every pattern; offset j % r ("modulo", the paper) or
    j // ceil(H / r) ("blocked", torchscale's head blocking).
    head_groups: heads split into len(patterns) contiguous groups (the first H % m one
    larger); group i uses only pattern i, with offset i % r_i.
    """
    m = len(patterns)
    table = []
    if mode == "longnet":
        for j in range(num_heads):
            if offsets == "modulo":
                table.append(tuple(j % r for _, r in patterns))
            else:
                table.append(tuple(j // math.ceil(num_heads / r) for _, r in patterns))
        return tuple(table)
    base, extra = divmod(num_heads, m)
    for i, (_, r) in enumerate(patterns):
        size = base + (1 if i < extra else 0)
        row = tuple(i % r if ii == i else -1 for ii in range(m))
        table.extend([row] * size)
    return tuple(table)
