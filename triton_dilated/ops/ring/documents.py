"""Packed documents (cu_seqlens) in the ring: what a step sees of them, and the
document-aware balance (no triton: both steps and the planner use it).

A pair (p, p') of global positions counts only when both lie in one document; segments,
residues, layout blocks and causal are evaluated on document positions. The steps get
two per-position arrays (DocPositions): a document id, compared per pair (the predicate
of the Triton step kernel's DOCS path and of the portable step's pair_log_weight), and a
*mask position* that the unchanged dense/dilated/layout mask reads in place of p:

* dense and dilated: p - start(doc), the document-local position (segments restart at
  each document, as in dilated_attention's cu_seqlens);
* block layout: base(doc) * block + p - start(doc), a position in a "virtual" sequence
  where every document begins on a fresh block (its blocks numbered from base(doc)); the
  block table is block-diagonal, one document's own layout per diagonal block, so layout
  blocks restart at each document and no block crosses two. That table already keeps
  documents apart: the layout mask needs no id compare.

DocumentBalance (document_balance): which positions each rank holds, chosen so that the
(query, key) pairs each rank computes are close to even for any document lengths. The
sequence is cut into C = P * k equal chunks (k <= chunks_per_rank, a divisor of N / P);
each chunk's work is the sum over its queries of the keys they attend (per head, as the
mask counts them: dense, dilated multiset or layout, causal or not); chunks are dealt
largest first to the rank with the least work among those still short of k chunks (LPT
with equal cardinality). Every rank holds N / P positions (k chunks), so memory stays
O(N / P); the planner's own pair counts give the balance it reached (`imbalance`, max /
mean).
"""
from __future__ import annotations

import hashlib

import torch

from ..block_sparse.interface import document_layouts
from ..block_sparse.layout import BlockLayout, join_windows
from ..common.validation import check_cu_seqlens, check_int, check_int_list
from ..dilated.patterns import check_patterns, fit_patterns, head_offsets


def bounds_digest(bounds) -> str:
    """A short stable name of a tuple of document bounds (for the rank-agreement check)."""
    h = hashlib.blake2b(repr(tuple(bounds)).encode(), digest_size=8).hexdigest()
    return f"{len(bounds) - 1} documents over {bounds[-1]} positions, digest {h}"


def doc_index(bounds, pos: torch.Tensor) -> torch.Tensor:
    """The document (index into bounds[:-1]) of each position, long. Empty documents share
    their start with the next one: searchsorted(right) lands on the non-empty one."""
    starts = torch.tensor(bounds[:-1], dtype=torch.long, device=pos.device)
    return torch.searchsorted(starts, pos.long(), right=True) - 1


class DocPositions:
    """Per-position document ids and mask positions (module docstring) of one call's
    documents. shift[d]: what is subtracted from p in document d."""

    def __init__(self, bounds, device, block_size=None):
        self.bounds, self.count = tuple(bounds), len(bounds) - 1
        starts = torch.tensor(bounds[:-1], dtype=torch.long)
        if block_size is None:      # dense / dilated: document-local positions, ids compared per pair
            shift = starts
            self.compare_ids = True
        else:                       # layout: virtual positions, documents on blocks of their own
            lengths = torch.tensor(bounds[1:], dtype=torch.long) - starts
            blocks = (lengths + block_size - 1) // block_size
            base = torch.cumsum(blocks, 0) - blocks
            shift = starts - base * block_size
            self.compare_ids = False
        self.shift = shift.to(device)

    def doc_ids(self, pos):
        return doc_index(self.bounds, pos).to(torch.int32)

    def mask_positions(self, pos):
        return (pos.long() - self.shift[doc_index(self.bounds, pos)]).to(torch.int32)


def virtual_layout(per_doc, bounds, heads) -> BlockLayout:
    """The block-diagonal layout of the virtual sequence (module docstring): document d's
    layout (query heads [heads[0], heads[1]) of it) on its diagonal block. One block size.

    Sliding windows: the documents' predicate (join_windows: one for all) and their window
    blocks go along. The band (p - window < p' <= p) depends only on p - p', which virtual
    positions keep within a document; sink tokens (p' < sinks) are positions from a
    document's start, which the virtual sequence moves for every document after the first:
    with two or more documents they are a ValueError rather than a wrong mask."""
    sizes = {lay.block_size for lay in per_doc if lay is not None}
    if len(sizes) > 1:
        raise ValueError(f"the documents' layouts must share one block size in ring_attention, got {sorted(sizes)}")
    bs = sizes.pop() if sizes else 16
    window = None
    for lay in per_doc:
        if lay is not None:
            window = join_windows(window, lay.window, "ring_attention over the documents' layouts")
    if window is not None and window.sink_tokens and sum(lay is not None for lay in per_doc) > 1:
        raise ValueError(f"ring_attention with cu_seqlens and a sliding window with sink tokens "
                         f"({window!r}): the ring's documents cannot place sink tokens per document yet; use "
                         f"sinks=0 in the window, one document, or block_sparse_attention(..., cu_seqlens=) on one "
                         f"device")
    picked = [lay.heads(*heads) if lay is not None else None for lay in per_doc]
    parts = [(lay.to_dense()[:1], lay.window_blocks_dense()[:1]) for lay in picked if lay is not None]   # B == 1
    n_heads = max([p.shape[1] for p, _ in parts], default=1)
    total = sum(p.shape[2] for p, _ in parts)
    table = torch.zeros(1, n_heads, max(total, 1), max(total, 1), dtype=torch.bool)
    flags = torch.zeros_like(table)
    at = 0
    for p, f in parts:
        n = p.shape[2]
        table[:, :, at:at + n, at:at + n] = p.cpu().bool()
        flags[:, :, at:at + n, at:at + n] = f.cpu().bool()
        at += n
    if window is None:
        return BlockLayout.from_dense(table, bs)
    b, h, r, c = table.nonzero(as_tuple=True)
    return BlockLayout.from_pairs(b, h, r, c, table.shape[:3], table.shape[3], bs, window=window,
                                  window_flags=flags[b, h, r, c])


# ----------------------------------------------------------------------------- balance

def position_pairs(bounds, *, causal=False, segment_lengths=None, dilation_rates=None, layout=None,
                   mode="longnet", offsets="modulo", num_heads=1) -> torch.Tensor:
    """int64 (N,): for each query position, the (query, key) pairs it computes summed over
    num_heads heads (a dilated key two patterns select counts twice, as both are computed)."""
    n = bounds[-1]
    pos = torch.arange(n, dtype=torch.long)
    d = doc_index(bounds, pos)
    b = torch.tensor(bounds, dtype=torch.long)
    local, length = pos - b[d], (b[1:] - b[:-1])[d]
    if segment_lengths is not None or dilation_rates is not None:
        patterns = fit_patterns(check_patterns(segment_lengths, dilation_rates, mode, offsets), n, num_heads)
        work = torch.zeros(n, dtype=torch.long)
        triples: dict = {}
        for row in head_offsets(num_heads, patterns, mode, offsets):
            for (w, r), o in zip(patterns, row):
                if o >= 0:
                    triples[(w, r, o)] = triples.get((w, r, o), 0) + 1
        for (w, r, o), heads in triples.items():
            seg0 = local // w * w
            j = local - seg0
            if causal:
                keys = (j - o) // r + 1
            else:
                seg_len = torch.clamp(length - seg0, max=w)
                keys = torch.clamp(seg_len - o + r - 1, min=0) // r
            work += heads * torch.where(j % r == o, keys, 0)
        return work
    if layout is None:
        return num_heads * (local + 1 if causal else length)
    work = torch.zeros(n, dtype=torch.long)
    for lay, (s, e) in zip(document_layouts(layout, bounds), zip(bounds[:-1], bounds[1:])):
        if lay is None:
            continue
        bs = lay.block_size
        dense = lay.to_dense()[0].long()                                   # (H|1, nb, nb), B == 1
        dense = dense.sum(0) * (num_heads if dense.shape[0] == 1 else 1)   # summed over heads
        nb = dense.shape[0]
        blen = torch.clamp((e - s) - torch.arange(nb) * bs, max=bs)        # keys per key block
        loc = torch.arange(e - s)
        qb = loc // bs
        if causal:
            rows = (torch.tril(dense, -1) @ blen)[qb] + dense.diagonal()[qb] * (loc - qb * bs + 1)
        else:
            rows = (dense @ blen)[qb]
        work[s:e] = rows
    return work


class DocumentBalance:
    """Which positions each rank holds (module docstring). Pass it as `balance=` to
    ring_attention, shard and unshard; `pairs` (per rank, the planner's counts) and
    `imbalance` (max / mean) say how even the work is."""

    def __init__(self, bounds, world_size, chunks, pairs):
        self.cu_seqlens, self.world_size = tuple(bounds), world_size
        self.n = bounds[-1]
        self._chunks = chunks                    # per rank: its chunks' start positions, ascending
        self.chunk = self.n // (world_size * len(chunks[0])) if self.n else 0
        self.pairs = pairs
        mean = sum(pairs) / len(pairs)
        self.imbalance = max(pairs) / mean if mean > 0 else 1.0

    def positions(self, rank, device=None) -> torch.Tensor:
        """Global positions (int32, ascending) of `rank`."""
        starts = torch.tensor(self._chunks[rank], dtype=torch.int32)
        pos = (starts[:, None] + torch.arange(self.chunk, dtype=torch.int32)[None, :]).flatten()
        return pos.to(device)

    def __repr__(self):
        h = hashlib.blake2b(repr((self.cu_seqlens, self._chunks)).encode(), digest_size=8).hexdigest()
        return (f"DocumentBalance(world_size={self.world_size}, {len(self.cu_seqlens) - 1} documents over {self.n} "
                f"positions, chunks of {self.chunk}, imbalance {self.imbalance:.3f}, digest {h})")


def document_balance(cu_seqlens, world_size, *, causal=False, segment_lengths=None, dilation_rates=None,
                     layout=None, mode="longnet", offsets="modulo", num_heads=1, chunks_per_rank=16):
    """A DocumentBalance for packed documents on world_size ranks (module docstring): the
    sequence in world_size * k equal chunks (k: the largest divisor of N / world_size up
    to chunks_per_rank), dealt so that the (query, key) pairs per rank are near even for
    the mask the other arguments describe (as ring_attention takes them; num_heads: the
    query heads, which the dilated offsets depend on). The result is exact for any
    balance: the mask arguments only steer the cost model."""
    world_size = check_int("world_size", world_size, 1)
    chunks_per_rank = check_int("chunks_per_rank", chunks_per_rank, 1)
    num_heads = check_int("num_heads", num_heads, 1)
    if cu_seqlens is None:
        raise ValueError("document_balance needs cu_seqlens (the packed documents' bounds), got None")
    values = check_int_list("cu_seqlens", cu_seqlens, minimum=0)
    bounds = check_cu_seqlens(values, 1, values[-1])
    n = bounds[-1]
    if n % world_size:
        raise ValueError(f"the sequence length ({n}) must be a multiple of world_size ({world_size}) for a "
                         f"document balance")
    local = n // world_size
    k = max([c for c in range(1, chunks_per_rank + 1) if local % c == 0], default=1)
    work = position_pairs(bounds, causal=causal, segment_lengths=segment_lengths, dilation_rates=dilation_rates,
                          layout=layout, mode=mode, offsets=offsets, num_heads=num_heads)
    size = local // k if local else 0
    chunk_work = work.view(world_size * k, size).sum(1).tolist() if size else [0] * (world_size * k)
    order = sorted(range(len(chunk_work)), key=lambda i: (-chunk_work[i], i))
    loads, owned = [0] * world_size, [[] for _ in range(world_size)]
    for i in order:   # largest first, to the least loaded rank with room (ties: the lower rank)
        r = min((r for r in range(world_size) if len(owned[r]) < k), key=lambda r: (loads[r], r))
        loads[r] += chunk_work[i]
        owned[r].append(i)
    return DocumentBalance(bounds, world_size, [sorted(c * size for c in chunks) for chunks in owned], loads)

