"""Which (segment length, dilation rate, offset) triples each head uses (DESIGN §3)."""
from __future__ import annotations

import functools
import math
import warnings

import torch

from ..common.validation import check_choice, check_int, check_int_list

MODES = ("longnet", "head_groups")
OFFSETS = ("modulo", "blocked")


def check_patterns(segment_lengths, dilation_rates, mode="longnet", offsets="modulo"):
    """Validate the pattern arguments; return a tuple of (w, r) pairs.

    A rate larger than its segment length would leave every segment one row per head (most
    queries with no key at all): that is what swapped lists give, so it is refused."""
    ws = check_int_list("segment_lengths", segment_lengths)
    rs = check_int_list("dilation_rates", dilation_rates)
    if len(ws) != len(rs):
        raise ValueError(f"segment_lengths and dilation_rates must have the same length, "
                         f"got {len(ws)} and {len(rs)}")
    for i, (w, r) in enumerate(zip(ws, rs)):
        if r > w:
            raise ValueError(f"dilation_rates[{i}] = {r} is larger than segment_lengths[{i}] = {w}: a rate must not "
                             f"exceed its segment length. The two lists look swapped: dilated_attention and "
                             f"DilatedAttention take (segment_lengths, dilation_rates), MultiheadDilatedAttention "
                             f"takes (dilation_rates, segment_lengths)")
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


def check_head_slice(head_offset, total_heads, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """Validate a head slice: q's heads are the query heads [head_offset, head_offset +
    num_heads) of a call with total_heads query heads (None: num_heads). Returns
    (head_offset, total_heads) as ints.

    GQA: local head h reads local key/value head h // g (g = num_heads // num_kv_heads),
    which must hold the full call's key/value head of global head head_offset + h. That
    needs the slice to start on a boundary of g heads and total_heads to be a multiple of g
    (key/value heads replicated to fewer query heads each, as Ulysses does when there are
    fewer key/value heads than ranks, satisfy it; which data sits in each key/value head is
    the caller's part)."""
    head_offset = check_int("head_offset", head_offset, 0)
    total_heads = num_heads if total_heads is None else check_int("total_heads", total_heads, 1)
    if head_offset + num_heads > total_heads:
        raise ValueError(f"head_offset + q's head count must not exceed total_heads: q holds heads "
                         f"[{head_offset}, {head_offset + num_heads}) but total_heads = {total_heads}")
    group = num_heads // max(num_kv_heads, 1)
    if group > 1 and (head_offset % group or total_heads % group):
        raise ValueError(f"head_offset and total_heads must be multiples of q's GQA group size "
                         f"(q heads per key/value head = {num_heads} // {num_kv_heads} = {group}), got "
                         f"head_offset = {head_offset}, total_heads = {total_heads}: the slice would split a group")
    return head_offset, total_heads


def head_table(num_heads: int, patterns: tuple, mode: str, offsets: str, head_offset: int = 0,
               total_heads: int | None = None) -> tuple:
    """head_offsets of the query heads [head_offset, head_offset + num_heads) of a call with
    total_heads heads (validated by check_head_slice): the offsets depend on a head's
    global index (j % r, j // ceil(H / r), its head group)."""
    total = num_heads if total_heads is None else total_heads
    # Under torch.compile the uncached function: dynamo would trace the cache wrapper around it
    # anyway, warning of silent incorrectness; the table is plain Python on the heads and patterns
    # (constants, or a symbolic head count with dynamic shapes), so the traced graph holds none of it.
    offsets_of = head_offsets.__wrapped__ if torch.compiler.is_compiling() else head_offsets
    table = offsets_of(total, patterns, mode, offsets)
    return table if (head_offset, total) == (0, num_heads) else table[head_offset:head_offset + num_heads]


def fit_patterns(patterns: tuple, seq_len: int, num_heads: int) -> tuple:
    """The same patterns with values the kernels can index with, for seq_len tokens and
    num_heads heads. w >= seq_len is one segment over the sequence, so w is clamped to
    seq_len; r is clamped to max(w, num_heads): a rate >= w leaves row o alone in each
    segment either way, and a rate >= num_heads gives every head the same offset
    (j % r = j, j // ceil(H / r) = j, i % r = i), so the offset table does not change."""
    fitted = []
    for w, r in patterns:
        w = min(w, max(seq_len, 1))
        fitted.append((w, min(r, max(w, num_heads))))
    return tuple(fitted)


def warn_if_heads_first(patterns: tuple, seq_len: int, num_heads: int) -> None:
    """q/k/v in scaled_dot_product_attention's (B, H, N, D) layout are read as N = H tokens
    and H = N heads: warn when there are more heads than tokens and every segment covers
    the whole sequence (dense attention over a handful of "tokens")."""
    if num_heads > seq_len > 0 and all(w >= seq_len for w, _ in patterns):
        warnings.warn(f"q has {num_heads} heads but a sequence length of only {seq_len}, and every segment covers the "
                      f"whole sequence: are q, k, v in (B, H, N, D) layout (scaled_dot_product_attention's)? Dilated "
                      f"attention takes (B, N, H, D): pass q.transpose(1, 2) etc.", UserWarning, stacklevel=4)


def pattern_pairs(n: int, patterns: tuple, table: tuple, causal: bool) -> int:
    """(query, key) pairs the patterns compute in one batch row of length n, summed over the
    heads of `table` (head_offsets' rows; offset -1: the head skips that pattern). A key two
    patterns select counts twice: both are computed."""
    per_triple = {}
    total = 0
    for row in table:
        for (w, r), o in zip(patterns, row):
            if o < 0:
                continue
            if (w, r, o) not in per_triple:
                count = 0
                for s in range(0, n, w):
                    length = len(range(s + o, min(s + w, n), r))
                    count += length * (length + 1) // 2 if causal else length * length
                per_triple[(w, r, o)] = count
            total += per_triple[(w, r, o)]
    return total
