"""Host-side work lists for the fused dilated kernels.

A kernel program owns one *tile*: BLOCK rows `first + T*u` (u < BLOCK, rows < chunk_end)
of one head, inside one *chunk* (a stretch between consecutive segment boundaries of all
the head's patterns, so every pattern sees the tile inside a single segment).

The tile stride T is what keeps tensor-core tiles full. When T is a multiple of a
pattern's rate r, every row of the tile has the same residue mod r, so the pattern is
either active for the whole tile (all rows attend to the same dilated keys
`s + o + r*i`) or for none of it (skipped). With T = lcm(rates) no row is ever masked and
the patterns accumulate into one online softmax: the paper's denominator-weighted mix
(eq. 10) needs no merge step at all. A pattern whose rate does not divide T masks the rows
with another residue, which wastes work; T is picked per head signature by counting the
(row, key) pairs each candidate computes (padding of the last tile and causal diagonal
included), over T in {lcm of every subset of rates}.

For the LongNet schedule (rates 1, 2, 4, 6, 12; segments of 2048..32768) T = 12: a chunk of
2048 rows is 12 classes of 170-171 rows, each padded to BLOCK_M; nothing else is wasted.

Item rows (int32): [first_row, chunk_end, unit (head), T, doc_start, doc_end]. Packed
variable-length sequences plan each document on its own (segments restart at its start);
one document is the whole sequence. Items are sorted by descending cost (longest first)
so causal work balances over the GPU.
"""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np

ITEM_FIELDS = 6


def _chunk_starts_ends(n: int, ws):
    bounds = np.unique(np.concatenate([np.arange(0, n, w) for w in set(ws)] + [np.array([n])]))
    return bounds[:-1], bounds[1:]


def _ceil_div(a, b):
    return -(-a // b)


def _tiles(n: int, triples, T: int, block: int, block_inner: int, causal: bool, keys_side: bool):
    """Tiles of one unit (a query head, or a key/value head for the backward) with stride T.

    triples: (w, r, o) the unit takes part in. Returns (first_row, chunk_end, cost) arrays
    and whether every row of the sequence lies in some tile."""
    starts, ends = _chunk_starts_ends(n, [w for w, _, _ in triples])
    cls = np.arange(T)
    A = starts[:, None] + cls[None, :]                       # first row of class c
    E = np.broadcast_to(ends[:, None], A.shape)
    n_rows = np.maximum(0, _ceil_div(E - A, T))
    maybe = np.zeros(A.shape, dtype=bool)
    for w, r, o in triples:
        seg = (starts // w * w)[:, None]
        g = math.gcd(T, r)
        maybe |= ((o - (A - seg)) % g == 0) & (o < np.minimum(seg + w, n) - seg)
    keep = (n_rows > 0) & maybe
    full_coverage = bool(keep.sum() == (n_rows > 0).sum())
    n_tiles = np.where(keep, _ceil_div(n_rows, block), 0)
    flat_tiles = n_tiles.ravel()
    idx = np.repeat(np.arange(flat_tiles.size), flat_tiles)
    j = np.arange(idx.size) - np.repeat(np.cumsum(flat_tiles) - flat_tiles, flat_tiles)
    first = A.ravel()[idx] + T * block * j
    chunk_end = E.ravel()[idx]
    chunk_start = np.repeat(starts, T)[idx]
    rows_in_tile = np.minimum(block, _ceil_div(chunk_end - first, T))
    last = first + T * (rows_in_tile - 1)
    cost = np.zeros(first.shape, dtype=np.float64)
    for w, r, o in triples:
        seg = chunk_start // w * w
        n_keys = np.maximum(0, _ceil_div(np.minimum(seg + w, n) - seg - o, r))
        if T % r == 0:
            active = (first - seg) % r == o
        else:
            active = (o - (first - seg)) % math.gcd(T, r) == 0
        if causal and not keys_side:     # queries see keys up to the tile's last row
            used = np.clip((last - seg - o) // r + 1, 0, n_keys)
        elif causal:                      # keys are seen by queries from the tile's first row
            used = n_keys - np.clip(_ceil_div(first - seg - o, r), 0, n_keys)
        else:
            used = n_keys
        cost += np.where(active, block * _ceil_div(used, block_inner) * block_inner, 0)
    return first, chunk_end, cost, full_coverage


def _candidate_strides(rates, limit: int):
    """1 and the lcm of every subset of rates, up to `limit` (the shortest segment: a
    stride past it leaves one-row tiles and is never best)."""
    rates = sorted(set(rates))
    out = {1}
    for k in range(1, len(rates) + 1):
        for subset in itertools.combinations(rates, k):
            t = math.lcm(*subset)
            if t <= max(limit, 1):
                out.add(t)
    return sorted(out)


@functools.lru_cache(maxsize=512)
def choose_stride(n: int, triples: tuple, block: int, block_inner: int, causal: bool,
                  keys_side: bool = False) -> int:
    """The tile stride T with the fewest computed (row, key) pairs for this unit."""
    best = None
    for T in _candidate_strides([r for _, r, _ in triples], min(n, *(w for w, _, _ in triples))):
        cost = _tiles(n, triples, T, block, block_inner, causal, keys_side)[2].sum()
        if best is None or cost < best[0]:
            best = (cost, T)
    return best[1]


@functools.lru_cache(maxsize=256)
def build_items(n: int, unit_triples: tuple, block: int, block_inner: int, causal: bool,
                keys_side: bool = False, doc_bounds: tuple | None = None):
    """Work items for all units over documents doc_bounds = (0, e1, e2, ..., n) (None: one
    document). unit_triples[u] = tuple of (w, r, o). Returns (items int32 (n_items, 6)
    numpy array, full_coverage)."""
    docs = list(zip(doc_bounds[:-1], doc_bounds[1:])) if doc_bounds else [(0, n)]
    columns, costs = [], []
    full = True
    for u, triples in enumerate(unit_triples):
        if not triples:
            full = False
            continue
        for start, end in docs:
            if end <= start:
                continue
            length = end - start
            # T depends on the patterns, the causal shape and the length, not the offsets: pick
            # it once per signature, with this unit's offsets standing in for the others.
            T = choose_stride(length, triples, block, block_inner, causal, keys_side)
            first, chunk_end, cost, covered = _tiles(length, triples, T, block, block_inner, causal, keys_side)
            full &= covered
            fill = lambda x: np.full(first.shape, x)  # noqa: E731
            columns.append(np.stack([first + start, chunk_end + start, fill(u), fill(T), fill(start), fill(end)], 1))
            costs.append(cost)
    if not columns:
        return np.zeros((0, ITEM_FIELDS), dtype=np.int32), False
    items = np.concatenate(columns)
    order = np.argsort(-np.concatenate(costs), kind="stable")
    return np.ascontiguousarray(items[order].astype(np.int32)), full


def query_unit_triples(patterns: tuple, table: tuple) -> tuple:
    """Per query head: the (w, r, o) it uses."""
    return tuple(tuple((w, r, o) for (w, r), o in zip(patterns, row) if o >= 0) for row in table)


def key_unit_triples(patterns: tuple, table: tuple, num_kv_heads: int) -> tuple:
    """Per key/value head: the distinct (w, r, o) of its query heads."""
    group = len(table) // num_kv_heads
    units = []
    for g in range(num_kv_heads):
        seen = dict.fromkeys(t for h in range(g * group, (g + 1) * group)
                             for t in query_unit_triples(patterns, (table[h],))[0])
        units.append(tuple(seen))
    return tuple(units)
