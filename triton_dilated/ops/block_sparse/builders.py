"""Layout builders (DESIGN §4). None of them materialises an N x N mask: each writes, per
query block, a short list of candidate key blocks, normalised by BlockLayout.from_rows.
All take the sequence length in tokens and the block size; per-head builders take the
number of heads. `causal=True` drops key blocks after the query block (the kernel still
applies the element-level causal mask on the diagonal block)."""
from __future__ import annotations

import math

import torch

from ..common.masks import WindowPredicate
from ..common.validation import check_bool, check_int
from .layout import BlockLayout, check_block_size


def _num_blocks(seq_len, block_size, causal=False) -> tuple[int, int]:
    """The checked common arguments -> (number of blocks, block_size as an int)."""
    block_size = check_block_size(block_size)
    seq_len = check_int("seq_len", seq_len, 1)
    check_bool("causal", causal)
    return -(-seq_len // block_size), block_size


def _nonneg_int(name, x) -> int:
    return check_int(name, x, 0)


def _levels(levels) -> list[tuple[int, int]]:
    """hierarchical's levels: a sequence of (stride >= 1, reach >= 0) pairs."""
    if not isinstance(levels, (list, tuple)):
        raise TypeError(f"levels must be a list or tuple of (stride, reach) pairs, got {type(levels).__name__}")
    out = []
    for i, level in enumerate(levels):
        if not isinstance(level, (list, tuple)) or len(level) != 2:
            raise TypeError(f"levels[{i}] must be a (stride, reach) pair, got {level!r}")
        out.append((check_int(f"levels[{i}] stride", level[0], 1), check_int(f"levels[{i}] reach", level[1], 0)))
    return out


def _finish(rows, nb, block_size, causal):
    """rows (B|1, H|1, nb, k) candidates, -1 for none; apply causal; build the layout."""
    if causal:
        qb = torch.arange(nb).view(1, 1, nb, 1)
        rows = torch.where(rows <= qb, rows, -1)
    return BlockLayout.from_rows(rows, block_size, nb)


def _global_pairs(nb, g, causal):
    everyone, glob = torch.meshgrid(torch.arange(nb), torch.arange(g), indexing="ij")
    r = torch.cat([everyone.reshape(-1), glob.reshape(-1)])   # all rows read the globals,
    c = torch.cat([glob.reshape(-1), everyone.reshape(-1)])   # the global rows read all
    if causal:
        r, c = r[c <= r], c[c <= r]
    return r, c


def local(seq_len: int, block_size: int = 128, window: int = 1, causal: bool = False) -> BlockLayout:
    """Sliding window: query block i reads key blocks i - window .. i + window."""
    nb, block_size = _num_blocks(seq_len, block_size, causal)
    window = _nonneg_int("window", window)
    offs = torch.arange(-window, (0 if causal else window) + 1)
    rows = torch.arange(nb)[:, None] + offs[None, :]
    rows = torch.where((rows >= 0) & (rows < nb), rows, -1)
    return _finish(rows[None, None], nb, block_size, causal)


def sliding_window(seq_len: int, block_size: int = 128, window: int = 128, sinks: int = 0) -> BlockLayout:
    """Exact sliding-window attention (gpt-oss, Mistral, Gemma sliding layers): query p sees
    key p' iff p - window < p' <= p (the band of `window` keys ending at the query,
    transformers' sliding_window_causal_mask_function), or p' < sinks and p' <= p (the first
    `sinks` tokens always visible: StreamingLLM attention-sink tokens; not the learnable
    sink logits of `sinks=` on the attention functions).

    The layout's blocks are those the band or the sink tokens reach; the blocks wholly inside
    it are computed without an element mask, the ones the band's edge cuts (and the diagonal)
    evaluate the predicate per element (BlockLayout.window, kv_window). Causal by definition:
    call the attention with causal=True (causal=False is a ValueError). Combine with other
    layouts by `|` (their blocks are visible whole) and `&`. Cost per query block: about
    window / block_size + 1 key blocks (+ ceil(sinks / block_size)). A window or sink count past
    seq_len means the same as seq_len and is clamped to it (constant time and memory)."""
    nb, block_size = _num_blocks(seq_len, block_size)
    pred = WindowPredicate(min(check_int("window", window, 1), nb * block_size),
                           min(check_int("sinks", sinks, 0), nb * block_size))
    window, sinks = pred
    bs = block_size
    r = torch.arange(nb)
    band = -(-(window - 1) // bs) + 1          # key blocks a query block's band can touch
    cand = r[:, None] - torch.arange(band)[None, :]
    if sinks:
        cand = torch.cat([cand, torch.arange(min(nb, -(-sinks // bs)))[None, :].expand(nb, -1)], dim=1)
    rr = r[:, None].expand_as(cand)
    lo_q, hi_q = rr * bs, rr * bs + bs - 1      # the query block's (nominal) positions
    lo_k, hi_k = cand * bs, cand * bs + bs - 1
    # active: some pair visible (band: keys (lo_q - window, hi_q]; sinks: keys < sinks, <= hi_q)
    active = (cand >= 0) & (cand <= rr) & ((hi_k > lo_q - window) | (lo_k < sinks))
    # whole: every pair visible: below the diagonal, and no key of the block in the gap of
    # positions that are neither sink tokens nor within the band of the block's last query
    gap_lo, gap_hi = sinks, hi_q - window
    whole = (cand < rr) & ((gap_lo > gap_hi) | (hi_k < gap_lo) | (lo_k > gap_hi))
    rr, cc, flags = rr[active], cand[active], ~whole[active]
    zero = torch.zeros_like(rr)
    return BlockLayout.from_pairs(zero, zero, rr, cc, (1, 1, nb), nb, block_size, window=pred, window_flags=flags)


def causal(seq_len: int, block_size: int = 128) -> BlockLayout:
    """Every key block at or before the query block (dense causal attention)."""
    nb, block_size = _num_blocks(seq_len, block_size)
    r, c = torch.tril_indices(nb, nb)
    zero = torch.zeros_like(r)
    return BlockLayout.from_pairs(zero, zero, r, c, (1, 1, nb), nb, block_size)


def global_tokens(seq_len: int, block_size: int = 128, num_global_blocks: int = 1, causal: bool = False) -> BlockLayout:
    """The first `num_global_blocks` blocks attend to everything and everything attends to
    them (BigBird's global tokens)."""
    nb, block_size = _num_blocks(seq_len, block_size, causal)
    g = min(_nonneg_int("num_global_blocks", num_global_blocks), nb)
    r, c = _global_pairs(nb, g, causal)
    zero = torch.zeros_like(r)
    return BlockLayout.from_pairs(zero, zero, r, c, (1, 1, nb), nb, block_size)


def random(seq_len: int, block_size: int = 128, num_random: int = 2, seed: int = 0, num_heads: int = 1,
           batch: int = 1, causal: bool = False) -> BlockLayout:
    """`num_random` random key blocks per (batch, head, query block), seeded and
    reproducible (BigBird-style; with causal, drawn among the blocks at or before the query
    block). Draws are with replacement, so a row may hold fewer distinct blocks."""
    nb, block_size = _num_blocks(seq_len, block_size, causal)
    k = _nonneg_int("num_random", num_random)
    num_heads, batch = check_int("num_heads", num_heads, 1), check_int("batch", batch, 1)
    gen = torch.Generator().manual_seed(check_int("seed", seed))
    u = torch.rand(batch, num_heads, nb, k, generator=gen, dtype=torch.float64)
    hi = (torch.arange(nb) + 1).view(1, 1, nb, 1) if causal else nb
    rows = (u * hi).long() if k else torch.full((batch, num_heads, nb, 1), -1)
    return _finish(rows, nb, block_size, causal)


def bigbird(seq_len: int, block_size: int = 128, window: int = 1, num_global_blocks: int = 1, num_random: int = 2,
            seed: int = 0, num_heads: int = 1, batch: int = 1, causal: bool = False) -> BlockLayout:
    """BigBird: sliding window | global blocks | random blocks, packed once from their pairs
    (no intermediate layouts: the global rows make those n_blocks wide)."""
    nb, block_size = _num_blocks(seq_len, block_size, causal)
    g = min(_nonneg_int("num_global_blocks", num_global_blocks), nb)
    window = _nonneg_int("window", window)
    num_heads, batch = check_int("num_heads", num_heads, 1), check_int("batch", batch, 1)
    rnd = random(seq_len, block_size, num_random, seed, num_heads, batch, causal)
    offs = torch.arange(-window, (0 if causal else window) + 1)
    win = torch.arange(nb)[:, None] + offs[None, :]
    r_loc = torch.arange(nb)[:, None].expand_as(win)[(win >= 0) & (win < nb)]
    c_loc = win[(win >= 0) & (win < nb)]
    r_glob, c_glob = _global_pairs(nb, g, causal)
    shared_r, shared_c = torch.cat([r_loc, r_glob]), torch.cat([c_loc, c_glob])
    # the shared (local, global) pairs hold for every (batch, head) of the random part
    B, H = batch, num_heads
    bb = torch.arange(B).repeat_interleave(H * shared_r.numel())
    hh = torch.arange(H).repeat_interleave(shared_r.numel()).repeat(B)
    b_r, h_r, r_r, c_r = rnd.pairs()
    cat = lambda x, y: torch.cat([x.long(), y.long()])  # noqa: E731
    return BlockLayout.from_pairs(cat(bb, b_r), cat(hh, h_r), cat(shared_r.repeat(B * H), r_r),
                                  cat(shared_c.repeat(B * H), c_r), (B, H, nb), nb, block_size)


def hierarchical(seq_len: int, block_size: int = 128, window: int = 1, levels=((4, 1), (16, 1)),
                 causal: bool = False) -> BlockLayout:
    """Multi-scale: a fine local window of `window` blocks, then for each (stride, reach) in
    `levels` the key blocks at multiples of `stride` within `reach` strides of the query
    block's stride-aligned position (coarser and coarser context)."""
    nb, block_size = _num_blocks(seq_len, block_size, causal)
    window = _nonneg_int("window", window)
    qb = torch.arange(nb)[:, None]
    win = torch.arange(-window, window + 1)[None, :] + qb
    parts = [torch.where((win >= 0) & (win < nb), win, -1)]
    for stride, reach in _levels(levels):
        base = qb // stride * stride
        cand = base + stride * torch.arange(-reach, reach + 1)[None, :]
        parts.append(torch.where((cand >= 0) & (cand < nb), cand, -1))
    return _finish(torch.cat(parts, dim=1)[None, None], nb, block_size, causal)


def dilated(seq_len: int, segment_lengths, dilation_rates, block_size: int = 128, num_heads: int = 1,
            offsets: str = "modulo", causal: bool = False) -> BlockLayout:
    """LongNet's patterns at block granularity: segment lengths and rates in tokens, both
    multiples of the block size. In each segment of w tokens, every (r / block_size)-th
    block from the head's offset (j % r', or j // ceil(H / r') with offsets="blocked")
    attends to the same blocks of its segment; the patterns are joined (set union)."""
    from ..dilated.patterns import check_patterns, fit_patterns, head_offsets
    nb, block_size = _num_blocks(seq_len, block_size, causal)
    num_heads = check_int("num_heads", num_heads, 1)
    patterns = check_patterns(segment_lengths, dilation_rates, "longnet", offsets)
    for w, r in patterns:
        if w % block_size or r % block_size and r != 1:
            raise ValueError(f"segment_lengths and dilation_rates must be multiples of block_size ({block_size}) "
                             f"(a rate of 1 is also allowed), got w={w}, r={r}")
    # in blocks; a segment of >= nb blocks is one segment (fit_patterns keeps the offsets)
    block_patterns = fit_patterns(tuple((w // block_size, max(1, r // block_size)) for w, r in patterns), nb,
                                  num_heads)
    table = head_offsets(num_heads, block_patterns, "longnet", offsets)
    qb = torch.arange(nb)
    per_head = []
    for row in table:
        parts = []
        for (w, r), o in zip(block_patterns, row):
            seg = qb // w * w
            active = (qb - seg) % r == o
            cand = seg[:, None] + o + r * torch.arange(math.ceil(w / r))[None, :]
            cand = torch.where(active[:, None] & (cand < torch.clamp(seg + w, max=nb)[:, None]), cand, -1)
            parts.append(cand)
        per_head.append(torch.cat(parts, dim=1))
    return _finish(torch.stack(per_head)[None], nb, block_size, causal)


def topk(q: torch.Tensor, k: torch.Tensor, top_k: int, block_size: int = 128, causal: bool = False) -> BlockLayout:
    """Content-adaptive: mean-pool q and k per block, score the (query block, key block)
    pairs by the pooled dot product, keep the `top_k` best key blocks per (batch, head,
    query block); the diagonal block is always kept. q (B, N, Hq, D), k (B, N, Hkv, D)."""
    from ..common.validation import check_qkv
    check_qkv(q, k, k)
    top_k = _nonneg_int("top_k", top_k)
    B, N, Hq, D = q.shape
    nb, block_size = _num_blocks(N, block_size, causal)
    pad = nb * block_size - N

    def pool(x):  # mean over the real tokens of each block
        x = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, pad)).unflatten(1, (nb, block_size))
        n = torch.full((nb,), float(block_size), device=x.device)
        n[-1] = block_size - pad
        return x.sum(2) / n.view(1, nb, 1, 1)

    pq, pk = pool(q), pool(k).repeat_interleave(Hq // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", pq, pk)
    if causal:
        scores = scores.masked_fill(torch.ones(nb, nb, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    kk = min(top_k, nb)
    best = scores.topk(kk, dim=-1).indices if kk else scores.new_zeros(B, Hq, nb, 0, dtype=torch.long)
    if causal:  # rows with fewer than top_k past blocks picked -inf entries: drop them
        best = torch.where(torch.gather(scores, -1, best) > float("-inf"), best, -1)
    diag = torch.arange(nb, device=q.device).view(1, 1, nb, 1).expand(B, Hq, nb, 1)
    return _finish(torch.cat([best, diag], dim=-1).cpu(), nb, block_size, causal)
