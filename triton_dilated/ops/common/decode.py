"""Decoding (few queries against a long cache, DESIGN §5b): the pieces every variant's decode
path shares. A variant lists, per query row, the key positions the query reads (a multiset:
a key two dilated patterns select is listed twice); `attend_key_lists` gathers exactly those
keys and attends, so the cost per query is the length of its list, not the context length.

Which calls decode: kvcache.serve_route; the query-offset path (query_offset.py: a
full-length call per distinct length) serves the rest.
"""
from __future__ import annotations

import torch

from .first_order import needs_grad

# Up to this many query rows a call takes the decode path (one token, or a speculative-decoding
# draft); longer query blocks (chunked prefill) take the general path.
DECODE_MAX_QUERIES = 16

# Elements of gathered keys per chunk of query rows (as the portable block-sparse path).
GATHER_BUDGET = 1 << 25

# What the portable decode read: key rows (one per key and query head; on the gather path every
# gathered slot, padding included) and calls. Tests read it to check that the cost does not
# grow with the context.
DECODE_STATS = {"key_rows": 0, "calls": 0}


def query_positions(lengths, num_queries: int, device, causal: bool) -> torch.Tensor:
    """long (B, Nq): position of query i of batch row b, lengths[b] - Nq + i (bottom-right).
    A row shorter than its queries (lengths[b] < Nq) puts its first queries before position 0:
    under causal they stay there and read no key (0, lse -inf); without causal they sit at 0
    (DESIGN §5b: every query sees the row's keys; a dilated segment or a layout row is a
    function of the position, so the clamp picks position 0's, all keys at dense settings)."""
    pos = torch.as_tensor(lengths, dtype=torch.long, device=device)[:, None] - num_queries + \
        torch.arange(num_queries, device=device)
    return pos if causal else pos.clamp(min=0)


def gather_rows(x, b, n, h):
    """x[b, n, h] for x (B, N, H, D) and broadcastable long indices: (*index shape, D).
    Without autograd, one index_select over the rows of x's storage (an overlapping
    (span, D) view whose row i starts at element i) reads the same rows 2-3x faster on a CPU
    than advanced indexing with three index tensors; with autograd, plain indexing (the
    view's backward would be storage-sized). No host sync either way."""
    if needs_grad(x) or x.stride(-1) != 1 or x.numel() == 0:
        return x[b, n, h]
    sb, sn, sh = x.stride()[:3]
    B, N, H, D = x.shape
    span = (B - 1) * sb + (N - 1) * sn + (H - 1) * sh + 1
    rows = x.as_strided((span, D), (1, 1), x.storage_offset())
    flat = b * sb + n * sn + h * sh
    return rows.index_select(0, flat.reshape(-1)).view(*flat.shape, D)


def cache_rows(x, b, n, h, block_table=None):
    """Rows of a KV cache as gather_rows reads them: x[b, n, h] for a contiguous cache x
    (B, N, H, D); for a paged cache x (num_pages, page_size, H, D) with block_table int32
    (B, max_pages), position n of row b lives in page block_table[b, n // page_size], row
    n % page_size. A page id outside the pool is clamped into it (page_ok says which keys
    those are: the callers mask them)."""
    if block_table is None:
        return gather_rows(x, b, n, h)
    page_size = x.shape[1]
    return gather_rows(x, block_table[b, n // page_size].long().clamp(0, x.shape[0] - 1), n % page_size, h)


def page_ok(block_table, b, n, num_pages: int, page_size: int):
    """bool, broadcast of b and n: whether position n of row b lies on a page of the pool
    ([0, num_pages)). A scheduler's bad block table (validate=False) must not read outside the
    pool: such keys count as masked, as in the Triton kernels (common/decode_kernels.fold_run)."""
    page = block_table[b, n // page_size]
    return (page >= 0) & (page < num_pages)


def nonfinite_to_nan(scores):
    """Scores with every non-finite value made NaN: a key or query holding Inf can score
    -inf, which would read as "no key" instead of spreading NaN (DESIGN §6)."""
    return scores + scores * 0


def mark_nonfinite(out, lse):
    """DESIGN §6: a row that read a non-finite query, key or value gives NaN out and NaN lse.
    Its scores were made NaN (nonfinite_to_nan), hence its lse; a non-finite value shows in
    its out (weight * Inf is Inf, 0 * Inf or NaN is NaN), which finite inputs never give.
    out (..., D), lse (...)."""
    bad = torch.isnan(lse) | ~torch.isfinite(out).all(dim=-1)
    return out.masked_fill(bad.unsqueeze(-1), float("nan")), lse.masked_fill(bad, float("nan"))


def softmax_lse(scores):
    """(weights, lse) over the last dim: a row with no key (all -inf) gets zero weights and
    lse -inf; a NaN score makes the row's weights and lse NaN (DESIGN §6: lse -inf means only
    "no key"). No NaN gradient from empty rows: the max is detached and the log never sees 0."""
    m = scores.detach().amax(dim=-1, keepdim=True)       # NaN when a score is NaN
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = torch.exp(scores - m)
    z = e.sum(dim=-1, keepdim=True)
    empty = z == 0
    z_safe = torch.where(empty, torch.ones_like(z), z)
    lse = torch.where(empty, torch.full_like(z, float("-inf")), m + torch.log(z_safe))
    return e / z_safe, lse.squeeze(-1)


def attend_key_lists(q, k, v, key_pos, key_ok, call, block_table=None, key_offset=None):
    """Attention of each query row over its own list of keys.

    q: (B, Nq, Hq, D); k, v: (B, Nk, Hkv, D) (any strides); key_pos: long (B, Nq, Hq, K), the
    key positions each (query, head) reads, with key_ok (same shape) False on padding slots;
    with block_table, k and v are page pools (cache_rows); call: the AttentionCall (its scale
    and cap; causality is in key_ok); key_offset: None or long (B,), added to every key position
    of its batch row to address the cache (cache_leftpad: positions count from the pad).
    GQA: query head h reads key/value head h // (Hq // Hkv). Scores, softmax and sums in
    float32. Returns out (B, Nq, Hq, D) like q and lse float32 (B, Hq, Nq); a query with no
    key gets 0 and -inf. Differentiable (a key listed twice gets both gradients)."""
    B, Nq, Hq, D = q.shape
    K = key_pos.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    group = Hq // k.shape[2]
    DECODE_STATS["calls"] += 1
    DECODE_STATS["key_rows"] += key_pos.numel()
    rows = B * Nq * Hq
    b_idx = torch.arange(B, device=q.device).view(B, 1, 1).expand(B, Nq, Hq).reshape(rows, 1)
    h_idx = (torch.arange(Hq, device=q.device) // group).view(1, 1, Hq).expand(B, Nq, Hq).reshape(rows, 1)
    qf = q.reshape(rows, D)
    ok = key_ok.reshape(rows, K)
    # padding slots point at a key the row reads (its first), so whatever a padded position
    # holds (NaN included) spreads nowhere: their scores become -inf, their weights 0
    pos = key_pos.reshape(rows, K)
    if key_offset is not None:
        pos = pos + key_offset[b_idx]
    if block_table is not None:   # keys on pages outside the pool: masked
        ok = ok & page_ok(block_table, b_idx, pos, k.shape[0], k.shape[1])
    pos = torch.where(ok, pos, pos.gather(1, ok.int().argmax(dim=1, keepdim=True)))
    nonempty = ok.any(dim=1, keepdim=True)
    chunk = max(1, GATHER_BUDGET // max(1, K * D))
    outs, lses = [], []
    for s in range(0, rows, chunk):
        e = min(rows, s + chunk)
        kg = cache_rows(k, b_idx[s:e], pos[s:e], h_idx[s:e], block_table).to(acc)     # (R, K, D)
        vg = cache_rows(v, b_idx[s:e], pos[s:e], h_idx[s:e], block_table).to(acc)
        scores = nonfinite_to_nan(torch.bmm(kg, qf[s:e].to(acc).unsqueeze(-1)).squeeze(-1) * call.scale)   # (R, K)
        scores = call.cap_scores(scores)
        weights, lse = softmax_lse(scores.masked_fill(~ok[s:e], float("-inf")))
        out = torch.bmm(weights.unsqueeze(1), vg).squeeze(1)
        # a row with no key read its padding (any position): its output is 0 whatever that held
        outs.append(torch.where(nonempty[s:e], out, torch.zeros((), dtype=acc, device=q.device)))
        lses.append(lse)
    out, lse = mark_nonfinite(torch.cat(outs) if len(outs) > 1 else outs[0],
                              torch.cat(lses) if len(lses) > 1 else lses[0])
    return out.reshape(B, Nq, Hq, D).to(q.dtype), lse.reshape(B, Nq, Hq).permute(0, 2, 1).float().contiguous()


# ----------------------------------------------------------------------------- the dense route

# A portable decode whose key lists cover at least this share of the (query head, key) pairs
# of the cache's capacity takes the dense route (dense_pays): one product over every key
# position, the pattern a mask, instead of gathering each query's list (a copy per query and
# head, about 9x the dense route's time per key read; docs/serving.md has the crossing).
DENSE_SHARE = 0.1
# Most elements of one batch row's (Hq, Nq, capacity) scores; a call whose row needs more
# keeps the gather path (bounded memory).
DENSE_BUDGET = 1 << 26


def dense_rows(q, capacity: int) -> int:
    """0 when one batch row's scores are over DENSE_BUDGET (the dense route then stays off),
    else the batch rows that would fit."""
    B, Nq, Hq, _ = q.shape
    return min(B, DENSE_BUDGET // max(1, Nq * Hq * capacity))


def dense_pays(q, slots: int, capacity: int) -> bool:
    """Whether a portable decode takes the dense route: the key slots its gather path would
    read per query row (over all heads) cover at least DENSE_SHARE of the Hq x capacity
    (query head, key) pairs, and one batch row's scores fit DENSE_BUDGET. Shapes only."""
    return dense_rows(q, capacity) > 0 and slots >= DENSE_SHARE * q.shape[2] * capacity


def host_reads(x) -> bool:
    """Whether the portable decode may read a few values of x on the host: a CPU tensor outside
    torch.compile, where there is no device stream to stop. On a GPU the same read would be a
    host sync. serve_checks.no_host_sync switches this off, so the device path runs under
    its guard."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def cache_block(x, block_table, key_offset, rows: slice, capacity: int):
    """(b, capacity, H, D): positions 0 .. capacity-1 of the batch rows `rows` of a cache x (a
    contiguous cache: a view unless key_offset; a page pool read through block_table, a page
    outside the pool read as page 0 (the caller masks those keys: page_ok), and positions
    shifted by key_offset (long (B,), cache_leftpad) clamped into the cache)."""
    if block_table is None and key_offset is None:
        return x[rows]
    pos = torch.arange(capacity, device=x.device)
    if key_offset is not None:
        pos = (pos + key_offset[rows, None]).clamp(max=capacity - 1)
    if block_table is None:
        return x[torch.arange(x.shape[0], device=x.device)[rows, None], pos.expand(rows.stop - rows.start, -1)]
    page_size = x.shape[1]
    table = block_table[rows]
    pages = table[:, pos // page_size] if pos.dim() == 1 else table.gather(1, pos // page_size)
    return x[pages.long().clamp(0, x.shape[0] - 1), pos % page_size]


def attend_dense(q, k, v, mask_of, call, block_table=None, key_offset=None):
    """Attention of q (B, Nq, Hq, D) over every position 0 .. capacity-1 of k, v (B, Nk, Hkv,
    D), or page pools with block_table, under the mask `mask_of(rows)` for the batch rows
    `rows` (a slice of one row): (keep bool broadcastable to (1, Hkv, G, Nq, capacity) (size 1
    on a head dim: one mask for those heads), whether the (query, head) reads the key; count
    None or integers broadcastable to that shape, how many times: a key two dilated patterns
    list counts twice, the multiset of DESIGN §3, out = sum_j c_j e^s_j v_j / sum_j c_j e^s_j).
    Per batch row, one product of its queries with its keys read in place (the cache's layout
    is BLAS's: no copy), one softmax over the row, one product with its values, float32.

    On a CPU without gradients (host_reads) a row is first attended without NaN care (no copy
    of its values, the scores checked rather than rewritten); only a row whose scores or out
    are not finite (a non-finite key or value anywhere in its cache row, read or not, garbage
    past the length included) is attended again with care (dense_row), as every row is where
    no read is allowed (a GPU). For finite rows both give the same bits: the same products in
    the same order.

    NaN rule (DESIGN §6), as the gather path: a non-finite query element makes its query NaN;
    a cache row whose key or value holds a non-finite element scores NaN (a query that reads
    it gets NaN), its non-finite value elements read as 0 (a nan_to_num copy of the row's
    values: an unread NaN row must not spread through its weight 0); a score the query does
    not read is -inf whatever the key holds. Returns (out like q, lse float32 (B, Hq, Nq));
    differentiable (the gradient path keeps softmax_lse's empty-row care)."""
    B, Nq, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    cap = k.shape[1] * (1 if block_table is None else block_table.shape[1])
    acc = torch.promote_types(q.dtype, torch.float32)
    grad = needs_grad(q, k, v)
    qs = q.to(acc) * call.scale
    qs = (qs + qs * 0).reshape(B, Nq, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Nq, D)
    host = not grad and host_reads(q)
    DECODE_STATS["calls"] += 1
    outs, lses = [], []
    for b in range(B):
        rows = slice(b, b + 1)
        keep, count = mask_of(rows)
        keep = keep[0]                                                      # (Hkv|1, G|1, Nq, capacity)
        if block_table is not None:   # keys on pages outside the pool: not read
            pos = torch.arange(cap, device=q.device)
            if key_offset is not None:
                pos = (pos + key_offset[b]).clamp(max=cap - 1)
            keep = keep & page_ok(block_table, torch.full_like(pos, b), pos, k.shape[0], k.shape[1])
        kb = cache_block(k, block_table, key_offset, rows, cap)[0].to(acc)   # (N, Hkv, D), in place when it can
        vb = cache_block(v, block_table, key_offset, rows, cap)[0].to(acc)
        DECODE_STATS["key_rows"] += cap * Hq
        count = None if count is None else count[0]
        out = None
        if host:
            out, lse, finite = dense_row(qs[b], kb, vb, keep, count, call, careful=False)
            if not (finite and torch.isfinite(out).all()):   # a non-finite key or value row, read or not
                out = None
        if out is None:
            out, lse, _ = dense_row(qs[b], kb, vb, keep, count, call, careful=True)
        outs.append(out.view(Hkv, G, Nq, D).permute(2, 0, 1, 3).reshape(Nq, Hq, D))
        lses.append(lse.reshape(Hq, Nq))
    out, lse = mark_nonfinite(torch.stack(outs), torch.stack(lses).transpose(1, 2))
    return out.to(q.dtype).contiguous(), lse.transpose(1, 2).float().contiguous()


def dense_row(qs, kb, vb, keep, count, call, careful: bool):
    """One batch row of attend_dense: scaled queries qs (Hkv, G*Nq, D) over keys kb and values
    vb (n, Hkv, D) (float32), keep bool broadcastable to (Hkv, G, Nq, n), count None or the
    integer multiplicities (keep's shape: each weight e^s times its count, no log).
    Returns (out (Hkv, G*Nq, D), lse (Hkv, G*Nq), finite): finite None when careful (or with
    gradients), else a bool tensor, whether every score was finite.

    A score of a non-finite key is non-finite (q is finite, or NaN already): made NaN, so a
    query that reads it gets NaN. careful: a value row holding a non-finite element scores NaN
    too and reads as 0 (nan_to_num: an unread one must not spread through its weight 0).
    Without care (only where the caller checks `finite` and the out) keys and values are read
    as they are: no copy, and the scores are checked, not rewritten. With gradients the keys
    go through nan_to_num too (dQ = dS @ K would carry an unread NaN key's NaN through its zero
    score gradient), their rows scoring NaN by the bias."""
    grad = needs_grad(qs, kb, vb)
    bias = None
    if careful or grad:
        bad = ~torch.isfinite(vb.sum(-1) + kb.sum(-1) if grad else vb.sum(-1))   # (n, Hkv)
        bias = torch.where(bad, float("nan"), 0.0).t()[:, None, None]             # (Hkv, 1, 1, n)
        vb = torch.nan_to_num(vb, 0.0, 0.0, 0.0)
    Hkv, GNq, n, Nq = qs.shape[0], qs.shape[1], kb.shape[0], keep.shape[-2]
    shape4 = (Hkv, GNq // Nq, Nq, n)
    if grad:
        scores = call.cap_scores(torch.matmul(qs, torch.nan_to_num(kb, 0.0, 0.0, 0.0).permute(1, 2, 0)))
        if count is not None:
            bias = bias + torch.log(count)
        weights, lse = softmax_lse(torch.where(keep, scores.view(shape4) + bias, float("-inf")).view(Hkv, GNq, n))
        return torch.matmul(weights, vb.transpose(0, 1)), lse, None
    scores = torch.matmul(qs, kb.permute(1, 2, 0)).view(shape4)                    # (Hkv, G, Nq, n)
    if careful:
        scores, finite = nonfinite_to_nan(scores), None
    else:   # one read instead of a rewrite: the caller attends the row again, with care, unless finite
        finite = torch.isfinite(scores.sum())
    scores = call.cap_scores(scores)
    scores = torch.where(keep, scores if bias is None else scores + bias, float("-inf")).view(Hkv, GNq, n)
    if count is None:   # fused row-wise softmax; a row with no key gives softmax's NaN: made 0
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.softmax(scores, dim=-1), vb.transpose(0, 1))
        return torch.where(torch.isneginf(lse)[..., None], 0.0, out), lse, finite
    m = scores.amax(dim=-1, keepdim=True)   # in place: e^(s - m) times the count, normalised after the product
    weights = scores.sub_(torch.where(torch.isneginf(m), 0.0, m)).exp_().view(shape4).mul_(count).view(Hkv, GNq, n)
    z = weights.sum(dim=-1, keepdim=True)
    lse = torch.where(z == 0, float("-inf"), m + torch.log(z)).squeeze(-1)
    return torch.matmul(weights, vb.transpose(0, 1)) / torch.where(z == 0, 1.0, z), lse, finite
