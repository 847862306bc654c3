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
included), per head and document, over T in {lcm of every subset of rates}.

For the LongNet schedule (rates 1, 2, 4, 6, 12; segments of 2048..32768) T = 12: a chunk of
2048 rows is 12 classes of 170-171 rows, each padded to BLOCK_M; nothing else is wasted.

Item rows (int32): [first_row, chunk_end, unit (head), T, doc_start, doc_end]. Packed
variable-length sequences plan each document on its own (segments restart at its start);
one document is the whole sequence. Items are sorted by descending cost (longest first)
so causal work balances over the GPU.

Queries shorter than keys (DESIGN §5b, chunked prefill): the query-offset path runs the
full-length kernels on q padded with zero rows in front, and only the rows from
`first_query_row` on are kept. The plan then holds only what those rows need:
* query side (forward, dQ): the tiles that hold a row >= first_query_row (a tile that
  straddles it also computes a few padded rows, which are dropped);
* key side (dK/dV): the key tiles that some pattern's segment ending past first_query_row
  holds (a key only gets gradient from queries of its own segment). The dK/dV kernel takes
  the query rows a key tile walks from the segment, not from the plan, so a kept key tile
  still walks the segment's padded rows (dO = 0 there: they add nothing, but they cost).
The launchers receive the window as their doc_bounds argument (a `QueryWindow`), which
reaches build_items unchanged; the plan then does not cover every row (`full` is False),
so the launchers zero-fill out, the row statistics (l = 0: an empty row, P = 0 when
recomputed) and the gradients of the rows and keys no tile covers.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

ITEM_FIELDS = 6


@dataclass(frozen=True)
class QueryWindow:
    """Plan scope for a call whose results are kept only from query row first_query_row on
    (DESIGN §5b). Passed where the launchers take doc_bounds; hashable, so the plan caches
    key on it."""
    doc_bounds: tuple | None
    first_query_row: int


def _ceil_div(a, b):
    return -(-a // b)


def _chunks(lengths, ws):
    """Chunks of every document: the stretches between consecutive multiples of any w
    (and the document's end). lengths: (n_docs,) int64, all > 0. Returns (doc, start,
    end) arrays, document-local positions, documents in order and starts ascending."""
    n_docs = lengths.size
    big = int(lengths.max()) + 1
    keys = []
    for w in sorted(set(ws)):
        count = _ceil_div(lengths, w)                                  # multiples of w below the length
        doc = np.repeat(np.arange(n_docs), count)
        local = (np.arange(doc.size) - np.repeat(np.cumsum(count) - count, count)) * w
        keys.append(doc * big + local)
    key = np.unique(np.concatenate(keys))
    doc, start = key // big, key % big
    last = np.append(doc[1:] != doc[:-1], True)
    end = np.where(last, lengths[doc], np.append(start[1:], 0))
    return doc, start, end


def _tiles(lengths, ws, rs, offsets, T, block: int, block_inner: int, causal: bool, keys_side: bool):
    """Tiles of U units (same patterns ws, rs; offsets (U, m), -1 never occurs) over the
    documents of `lengths`, unit u tiling document d with stride T[u, d].

    Returns (unit, doc, first_row, chunk_end, T, cost) per tile (document-local rows), in
    the order unit, document, chunk, class, tile; and whether every row of every document
    lies in some tile of every unit."""
    doc_c, start, end = _chunks(lengths, ws)
    n_chunks = start.size
    Tc = T[:, doc_c]                                                   # (U, C)
    n_c = lengths[doc_c]
    cls = np.arange(int(T.max()))
    A = start[None, :, None] + cls                                     # (1, C, Tmax): first row of class c
    n_rows = np.where(cls < Tc[..., None], np.maximum(0, _ceil_div(end[None, :, None] - A, Tc[..., None])), 0)
    maybe = np.zeros(n_rows.shape, dtype=bool)
    for i, (w, r) in enumerate(zip(ws, rs)):
        seg = start // w * w
        o = offsets[:, i][:, None, None]
        g = np.gcd(Tc, r)[..., None]
        seg_len = np.minimum(seg + w, n_c) - seg
        maybe |= ((o - (A - seg[None, :, None])) % g == 0) & (o < seg_len[None, :, None])
    keep = (n_rows > 0) & maybe
    full = bool(keep.sum() == (n_rows > 0).sum())
    n_tiles = np.where(keep, _ceil_div(n_rows, block), 0).ravel()
    idx = np.repeat(np.arange(n_tiles.size), n_tiles)
    j = np.arange(idx.size) - np.repeat(np.cumsum(n_tiles) - n_tiles, n_tiles)
    unit, chunk, c = idx // (n_chunks * cls.size), idx // cls.size % n_chunks, idx % cls.size
    doc, Tt, n = doc_c[chunk], Tc[unit, chunk], n_c[chunk]
    first = start[chunk] + c + Tt * block * j
    chunk_end = end[chunk]
    last = first + Tt * (np.minimum(block, _ceil_div(chunk_end - first, Tt)) - 1)
    cost = np.zeros(first.shape, dtype=np.float64)
    for i, (w, r) in enumerate(zip(ws, rs)):
        o = offsets[unit, i]
        seg = start[chunk] // w * w
        n_keys = np.maximum(0, _ceil_div(np.minimum(seg + w, n) - seg - o, r))
        active = (o - (first - seg)) % np.gcd(Tt, r) == 0   # when r | T: every row of the tile is active
        if causal and not keys_side:     # queries see keys up to the tile's last row
            used = np.clip((last - seg - o) // r + 1, 0, n_keys)
        elif causal:                      # keys are seen by queries from the tile's first row
            used = n_keys - np.clip(_ceil_div(first - seg - o, r), 0, n_keys)
        else:
            used = n_keys
        cost += np.where(active, block * _ceil_div(used, block_inner) * block_inner, 0)
    return unit, doc, first, chunk_end, Tt, cost, full


def _candidate_strides(rates, limit: int):
    """1 and the lcm of every subset of rates, up to `limit` (the shortest segment: a
    stride past it leaves one-row tiles and is never best). Built one rate at a time,
    dropping every lcm past the limit at once (adding rates only grows it): at most `limit`
    values per step, so O(len(rates) * limit), not 2^len(rates)."""
    limit = max(int(limit), 1)
    out = {1}
    for r in sorted(set(rates)):
        out |= {t for t in (math.lcm(x, r) for x in out) if t <= limit}
    return sorted(out)


def choose_strides(lengths, ws, rs, offsets, block: int, block_inner: int, causal: bool, keys_side: bool = False):
    """T[u, d]: the tile stride with the fewest computed (row, key) pairs for unit u on
    document d, over T in _candidate_strides(rates, min(length, shortest w)); the smallest
    such T on ties."""
    U, n_docs = offsets.shape[0], lengths.size
    limits = np.maximum(np.minimum(lengths, min(ws)), 1)
    best_T = np.ones((U, n_docs), dtype=np.int64)
    best_cost = np.full((U, n_docs), np.inf)
    for T in _candidate_strides(rs, int(limits.max())):
        docs = np.flatnonzero(limits >= T)
        unit, doc, *_, cost, _ = _tiles(lengths[docs], ws, rs, offsets, np.full((U, docs.size), T),
                                        block, block_inner, causal, keys_side)
        total = np.bincount(unit * docs.size + doc, weights=cost, minlength=U * docs.size).reshape(U, docs.size)
        better = total < best_cost[:, docs]
        best_cost[:, docs] = np.where(better, total, best_cost[:, docs])
        best_T[:, docs] = np.where(better, T, best_T[:, docs])
    return best_T


@functools.lru_cache(maxsize=256)
def build_items(n: int, unit_triples: tuple, block: int, block_inner: int, causal: bool,
                keys_side: bool = False, doc_bounds: tuple | QueryWindow | None = None):
    """Work items for all units over documents doc_bounds = (0, e1, e2, ..., n) (None: one
    document), or over a QueryWindow (its documents, only the work its rows need).
    unit_triples[u] = tuple of (w, r, o). Returns (items int32 (n_items, 6) numpy array,
    full_coverage)."""
    first_query_row = 0
    if isinstance(doc_bounds, QueryWindow):
        doc_bounds, first_query_row = doc_bounds.doc_bounds, doc_bounds.first_query_row
    items, _, full = plan_tiles(n, unit_triples, block, block_inner, causal, keys_side, doc_bounds,
                                first_query_row=first_query_row)
    return items, full


def plan_tiles(n: int, unit_triples: tuple, block: int, block_inner: int, causal: bool,
               keys_side: bool = False, doc_bounds: tuple | None = None, first_query_row: int = 0):
    """(items, cost, full_coverage): build_items' work items with, per item, the (row, key)
    pairs its tile computes (padding included: the planner's cost, which the cost model of
    `perf plan` sums). first_query_row > 0: only the items that rows from it on need (see
    the module docstring); full_coverage is then False when any item was left out.

    Units with the same (w, r) list are planned together, vectorised over units and
    documents (packed training brings new document bounds every step)."""
    bounds = np.asarray(doc_bounds if doc_bounds else (0, n), dtype=np.int64)
    doc_start, lengths = bounds[:-1], np.diff(bounds)
    doc_start, lengths = doc_start[lengths > 0], lengths[lengths > 0]
    groups: dict[tuple, list[int]] = {}
    for u, triples in enumerate(unit_triples):
        groups.setdefault(tuple((w, r) for w, r, _ in triples), []).append(u)
    full = () not in groups
    groups.pop((), None)
    parts, costs = [], []
    if lengths.size:
        for sig, units in groups.items():
            ws, rs = [w for w, _ in sig], [r for _, r in sig]
            offsets = np.array([[o for _, _, o in unit_triples[u]] for u in units], dtype=np.int64)
            T = choose_strides(lengths, ws, rs, offsets, block, block_inner, causal, keys_side)
            unit, doc, first, chunk_end, Tt, cost, covered = _tiles(lengths, ws, rs, offsets, T, block, block_inner,
                                                                    causal, keys_side)
            full &= covered
            s = doc_start[doc]
            parts.append(np.stack([first + s, chunk_end + s, np.asarray(units)[unit], Tt, s, s + lengths[doc]], 1))
            costs.append(cost)
    if not parts:
        return np.zeros((0, ITEM_FIELDS), dtype=np.int32), np.zeros(0), False
    items, cost = np.concatenate(parts), np.concatenate(costs)
    if first_query_row > 0:
        keep = _needed(items, unit_triples, block, keys_side, first_query_row)
        full &= bool(keep.all())
        items, cost = items[keep], cost[keep]
    # longest first; ties in (unit, document, chunk, class, tile) order
    order = np.lexsort((np.arange(items.shape[0]), items[:, 2], -cost))
    return np.ascontiguousarray(items[order].astype(np.int32)), cost[order], full


def _needed(items, unit_triples, block: int, keys_side: bool, first_query_row: int):
    """bool (n_items,): the items that query rows >= first_query_row need. Query side: the
    tile's last row reaches first_query_row. Key side: some pattern of the unit has the tile
    in a segment that ends past first_query_row (queries read only keys of their segment)."""
    first, chunk_end, unit, T, doc_start, doc_end = items.T
    if not keys_side:
        last = first + T * (np.minimum(block, _ceil_div(chunk_end - first, T)) - 1)
        return last >= first_query_row
    keep = np.zeros(first.shape, dtype=bool)
    for u, triples in enumerate(unit_triples):
        mine = unit == u
        for w in {w for w, _, _ in triples}:
            seg = doc_start + (first - doc_start) // w * w
            keep |= mine & (np.minimum(seg + w, doc_end) > first_query_row)
    return keep


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
