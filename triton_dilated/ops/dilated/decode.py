"""Portable dilated decoding: few queries (DESIGN §5b) against a long cache, touching only the
keys each query reads.

A query at position p, for pattern (w, r) with its head's offset o, lies in the segment
[s, min(s + w, L)) with s = (p // w) * w (L: the row's valid length). It is active when
(p - s) % r == o, and then reads the run of keys s + o, s + o + r, ... up to the segment's
end (up to p itself when causal). A query's key list is the concatenation of its patterns'
runs (a key two patterns select appears twice: the multiset union of DESIGN §3), about
sum w/r keys whatever the context length. The same runs drive the Triton decode kernel
(decode_kernels.py), computed there from the position.

Two ways to attend: `attend_patterns` gathers each pattern's run once per active head and
attends with batched products, with no host sync and shapes fixed by the input shapes (the
inference entry point, dilated_attention_with_kvcache, on every device; differentiable);
`attend_runs` reads each run in place as a strided view of k and v (row stride r), one
(query, head) at a time with Python ints for the slices: a host read of the lengths, so
only for CPU tensors without gradients on the host-synchronising training front door,
where it is 3-5x faster than copying the keys out first (a gather moves every key it reads
once more; LongNet schedule, H = 16, D = 128, 2-core CPU).

A row holding fewer keys than queries (L < Nq) puts its first queries before position 0
(queries aligned to the bottom right, as FlashAttention's KV-cache call). Under causal such
a query reads no key (out 0, lse -inf: FlashAttention's rule). Without causal its position
is clamped at 0 (common.decode.query_positions; DESIGN §5b extended to patterns: a dilated
segment or a layout row is a function of the position, and a position below 0 has none),
so it reads position 0's keys, which at dense settings are all L keys, FlashAttention's
rule. Every path (both variants, portable and Triton, decode and query-offset) follows this.
"""
from __future__ import annotations

import functools

import torch

from ..common import masks
from ..common.decode import (DECODE_STATS, attend_dense, cache_rows, dense_pays, mark_nonfinite, nonfinite_to_nan,
                             page_ok, query_positions, softmax_lse)


def pattern_runs(pos, lengths, w: int, r: int, offsets, causal: bool):
    """The run of keys of pattern (w, r) for queries at `pos` (long (B, Nq)) of rows with
    `lengths` (long (B,)), per head offset `offsets` (long (Hq,), -1: the head does not use
    the pattern): (start, count) long (B, Nq, Hq); keys start + r*t for t < count."""
    p = pos[:, :, None]
    o = offsets.view(1, 1, -1)
    seg = p // w * w
    seg_end = torch.minimum(seg + w, lengths.view(-1, 1, 1))
    active = (o >= 0) & ((p - seg) % r == o) & (p >= 0)   # before the first key: nothing (module docstring)
    count = (seg_end - seg - o + r - 1).div(r, rounding_mode="floor").clamp(min=0)
    if causal:   # an active query is key number (p - s - o) / r of its own run
        count = torch.minimum(count, (p - seg - o).div(r, rounding_mode="floor") + 1)
    return seg + o, torch.where(active, count, torch.zeros_like(count))


def dilated_key_lists(pos, lengths, patterns, table, causal: bool):
    """(key_pos, key_ok), long and bool (B, Nq, Hq, K): every (query, head)'s key list, the
    runs of its patterns one after another, padded to K = sum over patterns of the longest
    run any row can have (ceil(min(w, max length) / r))."""
    device = pos.device
    offsets = torch.tensor(table, dtype=torch.long, device=device).reshape(len(table), len(patterns))
    longest = int(lengths.max())
    key_pos, key_ok = [], []
    for i, (w, r) in enumerate(patterns):
        start, count = pattern_runs(pos, lengths, w, r, offsets[:, i], causal)
        t = torch.arange(-(-min(w, longest) // r), device=device)
        key_ok.append(t < count[..., None])
        key_pos.append(torch.where(key_ok[-1], start[..., None] + r * t, torch.zeros((), dtype=torch.long,
                                                                                      device=device)))
    return torch.cat(key_pos, dim=-1), torch.cat(key_ok, dim=-1)


def run_slots(w: int, r: int, capacity: int, window=None) -> int:
    """The most keys pattern (w, r) lists for one query: its run in a segment of min(w,
    capacity) positions, and with a sliding window (a WindowPredicate) of `window` positions at
    most ceil(window / r) of them."""
    slots = -(-min(w, capacity) // r)
    return slots if window is None else min(slots, -(-window.window // r))


@functools.lru_cache(maxsize=64)
def head_sets(patterns, table, device):
    """Per pattern i, long (r_i, M_i): the query heads whose offset for pattern i is c, for
    each residue c (padded with Hq, a slot that is dropped). Heads with -1 (pattern unused)
    are in no set. On the device, cached (CUDA graphs replay no host-to-device copy)."""
    num_heads = len(table)
    sets = []
    for i, (_, r) in enumerate(patterns):
        members = [[h for h in range(num_heads) if table[h][i] == c] for c in range(r)]
        width = max(1, max(len(m) for m in members))
        sets.append(torch.tensor([m + [num_heads] * (width - len(m)) for m in members], dtype=torch.long,
                                 device=device))
    return tuple(sets)


def attend_patterns(q, k, v, patterns, table, pos, lengths, call, block_table=None, key_offset=None):
    """Each (query, head) over the multiset union of its patterns' runs, with no host sync and
    shapes that depend only on the input shapes (so a CUDA graph or torch.compile can take it).

    A query at p lies in the segment starting at s = p // w * w, at residue c = (p - s) % r:
    for pattern (w, r) only the heads whose offset is c are active, and all of them read the
    same key positions s + c + r*t. So per pattern the keys are gathered once per active
    head (the M_i heads of head_sets), T_i = ceil(min(w, Nk) / r) slots each, not once per
    head of the model. Scores are scattered into a (B, Nq, Hq, sum T_i) tensor (-inf where a
    head is inactive or a slot is padding), one softmax runs over it, and the weights are
    gathered back to the slots to sum the values. Padding slots point at the query's own
    position, which every active head reads anyway (causal or not), so a NaN stored there
    spreads only where the definition spreads it (a query outside its row reads zeros there).
    With block_table, k and v are page pools (common.decode.cache_rows). call: the
    AttentionCall (causal, scale, cap). key_offset: None or long (B,), added to a row's key
    positions to address the cache (cache_leftpad).
    Returns (out like q, lse float32 (B, Hq, Nq)); a query with no key gets 0 and -inf;
    differentiable."""
    B, Nq, Hq, D = q.shape
    Nk = k.shape[1] * (1 if block_table is None else block_table.shape[1])   # the cache's capacity
    group = Hq // k.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    device = q.device
    b_idx = torch.arange(B, device=device).view(B, 1, 1, 1)
    p = pos[:, :, None]                                                   # (B, Nq, 1)
    q_ext = torch.cat([q, q.new_zeros(B, Nq, 1, D)], dim=2).to(acc)       # slot Hq: the dropped padding head
    scores, slots = [], []
    DECODE_STATS["calls"] += 1
    for (w, r), heads_of in zip(patterns, head_sets(patterns, table, device)):
        T = run_slots(w, r, Nk, call.window)
        seg = p // w * w
        c = (p - seg) % r
        first = seg + c                                                   # the run's first key
        count = (torch.minimum(seg + w, lengths.view(B, 1, 1)) - first + r - 1).div(r, rounding_mode="floor")
        if call.causal:   # the query is key number (p - s - c) / r of its own run
            count = torch.minimum(count, (p - first).div(r, rounding_mode="floor") + 1)
        if call.window is not None:   # the run cut from its front to keys > p - window (as the kernel)
            skip = ((p - call.window.window + 1 - first).clamp(min=0) + r - 1).div(r, rounding_mode="floor")
            first, count = first + r * skip, count - skip
        t = torch.arange(T, device=device)
        ok = (t < count) & (p >= 0)                                       # (B, Nq, T)
        kpos = torch.where(ok, first + r * t, p.clamp(min=0))
        if key_offset is not None:   # cache rows (cache_leftpad)
            kpos = kpos + key_offset.view(B, 1, 1)
        heads = heads_of[c.squeeze(-1)]                                   # (B, Nq, M)
        kvh = heads.clamp(max=Hq - 1) // group
        M = heads.shape[-1]
        DECODE_STATS["key_rows"] += B * Nq * M * T
        kg = cache_rows(k, b_idx, kpos[:, :, None, :], kvh[..., None], block_table).to(acc)   # (B, Nq, M, T, D)
        vg = cache_rows(v, b_idx, kpos[:, :, None, :], kvh[..., None], block_table).to(acc)
        # a query outside its row (before position 0 under causal; at 0 in an empty row without
        # it) has no row to point at, a key on a page outside the pool (block_table) is not
        # read: zeros there, and the key masked
        unread = ((p < 0) | (p >= lengths.view(B, 1, 1))).expand(B, Nq, T)
        if block_table is not None:
            fine = page_ok(block_table, b_idx[..., 0], kpos, k.shape[0], k.shape[1])
            ok, unread = ok & fine, unread | ~fine
        kg, vg = kg.masked_fill(unread[:, :, None, :, None], 0), vg.masked_fill(unread[:, :, None, :, None], 0)
        qg = q_ext.gather(2, heads[..., None].expand(B, Nq, M, D))        # (B, Nq, M, D)
        s_ = call.cap_scores(nonfinite_to_nan(torch.matmul(kg, qg[..., None]).squeeze(-1) * call.scale))
        s_ = s_.masked_fill(~ok[:, :, None, :], float("-inf"))
        full = s_.new_full((B, Nq, Hq + 1, T), float("-inf")).scatter(2, heads[..., None].expand(B, Nq, M, T), s_)
        scores.append(full[:, :, :Hq])
        slots.append((heads, vg, T))
    weights, lse = softmax_lse(torch.cat(scores, dim=-1))                 # (B, Nq, Hq, K), (B, Nq, Hq)
    weights = torch.cat([weights, weights.new_zeros(B, Nq, 1, weights.shape[-1])], dim=2)
    out = q_ext.new_zeros(B, Nq, Hq + 1, D)
    first = 0
    for heads, vg, T in slots:
        M = heads.shape[-1]
        wg = weights[..., first:first + T].gather(2, heads[..., None].expand(B, Nq, M, T))   # (B, Nq, M, T)
        part = torch.matmul(wg[..., None, :], vg).squeeze(-2)             # (B, Nq, M, D)
        out = out.scatter_add(2, heads[..., None].expand(B, Nq, M, D), part)
        first += T
    out, lse = mark_nonfinite(out[:, :, :Hq], lse)
    return out.to(q.dtype).contiguous(), lse.permute(0, 2, 1).float().contiguous()


def attend_runs(q, k, v, patterns, table, pos, lengths, call):
    """Each (query, head) over its runs, read in place as strided views of k and v: scores of
    every run in float32, one softmax over all of them (the multiset union), out = the sum
    over runs of their weights times their values (scores capped first, call.cap_scores). Returns
    (out like q, lse float32 (B, Hq, Nq)); a query with no key gets 0 and -inf, one that
    reads a non-finite query, key or value NaN and NaN."""
    B, Nq, Hq, D = q.shape
    group = Hq // k.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    offsets = torch.tensor(table, dtype=torch.long, device=pos.device).reshape(Hq, len(patterns))
    runs = [pattern_runs(pos, lengths, w, r, offsets[:, i], call.causal) for i, (w, r) in enumerate(patterns)]
    starts = torch.stack([st for st, _ in runs], dim=-1).tolist()        # (B, Nq, Hq, m) as lists
    counts = torch.stack([c for _, c in runs], dim=-1).tolist()
    rates = [r for _, r in patterns]
    no_key = (torch.zeros(D, dtype=acc, device=q.device), torch.tensor(float("-inf"), dtype=acc, device=q.device))
    outs, lses = [], []
    for b in range(B):
        for i in range(Nq):
            for h in range(Hq):
                mine = [(st, r, c) for st, r, c in zip(starts[b][i][h], rates, counts[b][i][h]) if c > 0]
                if not mine:
                    outs.append(no_key[0])
                    lses.append(no_key[1])
                    continue
                DECODE_STATS["key_rows"] += sum(c for _, _, c in mine)
                views = [(st, st + r * (c - 1) + 1, r) for st, r, c in mine]
                qv = q[b, i, h].to(acc)
                scores = nonfinite_to_nan(torch.cat([torch.mv(k[b, s:e:r, h // group].to(acc), qv)
                                                     for s, e, r in views]) * call.scale)
                scores = call.cap_scores(scores)
                lse = torch.logsumexp(scores, dim=0)
                weights = torch.exp(scores - lse).split([c for _, _, c in mine])
                outs.append(sum(torch.mv(v[b, s:e:r, h // group].to(acc).t(), p) for (s, e, r), p in zip(views, weights)))
                lses.append(lse)
    out, lse = mark_nonfinite(torch.stack(outs), torch.stack(lses))
    return out.reshape(B, Nq, Hq, D).to(q.dtype), lse.reshape(B, Nq, Hq).permute(0, 2, 1).float().contiguous()


@functools.lru_cache(maxsize=64)
def offset_table(table, device):
    """The per-head offsets as long (Hq, m) on the device, cached (no host-to-device copy per
    call: CUDA graphs replay none)."""
    return torch.tensor(table, dtype=torch.long, device=device).reshape(len(table), -1)


def dense_mask(pos, lengths, patterns, table, causal: bool, capacity: int, num_kv_heads: int, window=None):
    """mask_of(rows) for common.decode.attend_dense: (keep, count), broadcastable to (b, Hkv,
    G, Nq, capacity): whether and how many of its patterns' runs list key j for each (query,
    head) of the batch rows `rows` (attend_patterns' key lists as a mask: key j is in pattern
    (w, r)'s run of the query at p, for the heads whose offset is p's residue c, when j lies in
    p's segment, at residue c of it, below the row's length, and at or before p when causal);
    count (uint8) None for one pattern (no key listed twice). window: None or the call's
    WindowPredicate (keys cut to it). A pattern every head takes part in at residue 0 (r = 1,
    offsets all 0) gives one mask for all heads (size 1 on the head dims), and the checks a
    pattern cannot fail (one segment over the capacity, r = 1) are left out."""
    offsets = offset_table(table, pos.device)
    Hq = offsets.shape[0]
    G = Hq // num_kv_heads
    j = torch.arange(capacity, device=pos.device)
    # a key is in the run of the query at p when both lie in one segment at one residue of it:
    # one id per (segment, residue), compared once (None where every key shares the id: one
    # segment over the capacity and r = 1)
    run_id = [None if w >= capacity and r == 1 else j // w * r + j % w % r for w, r in patterns]
    every_head = [r == 1 and all(t[i] == 0 for t in table) for i, (_, r) in enumerate(patterns)]

    def mask_of(rows):
        p, n = pos[rows], lengths[rows]
        b, Nq = p.shape
        pk = p[..., None]                                                            # (b, Nq, 1)
        # causal: p < n, so j <= p is below the length too; a query before position 0 reads nothing
        base = (masks.causal(pk, j) if causal else j < n.view(b, 1, 1)) & (pk >= 0)  # (b, Nq, N)
        keep = count = None
        for i, (w, r) in enumerate(patterns):
            run = base if run_id[i] is None else base & (run_id[i] == pk // w * r + pk % w % r)
            if window is not None:
                run = run & window(pk, j)
            if every_head[i]:
                hit = run.view(b, 1, 1, Nq, capacity)
            else:   # heads whose offset is the query's residue
                active = offsets[:, i].view(1, Hq, 1) == (p % w % r)[:, None, :]      # (b, Hq, Nq)
                hit = (active[..., None] & run[:, None]).view(b, num_kv_heads, G, Nq, capacity)
            if len(patterns) == 1:
                return hit, None
            keep = hit if keep is None else keep | hit
            count = hit.to(torch.uint8) if count is None else count + hit
        return keep, count

    return mask_of


def dense_route(q, patterns, table, capacity: int, window=None) -> bool:
    """Whether the portable decode takes the dense route (common.decode.dense_pays): the key
    slots attend_patterns would gather per query row, per pattern the heads active at a
    residue times its longest run (run_slots: cut by a sliding window)."""
    slots = sum(heads.shape[1] * run_slots(w, r, capacity, window)
                for (w, r), heads in zip(patterns, head_sets(patterns, table, q.device)))
    return dense_pays(q, slots, capacity)


def dilated_decode(q, k, v, patterns, table, lengths, call, *, host_loop: bool = False, block_table=None,
                   leftpad=None):
    """Dilated attention of q (B, Nq, Hq, D), the last Nq positions of each row's lengths[b]
    (an integer tensor (B,) on q's device) valid positions, over k, v (B, Nk, Hkv, D).
    `patterns`: (w, r) pairs; `table`: per query head a tuple of offsets (-1: pattern unused).
    Returns (out like q, lse float32 (B, Hq, Nq)), differentiable. host_loop: read the runs
    in place as strided views (attend_runs: CPU tensors, no gradient; it reads the lengths
    on the host), else gather them with no host sync (attend_patterns; block_table: k and v
    are page pools). call: the AttentionCall (causal, scale, cap; its sinks are the caller's).
    leftpad: None or an integer tensor (B,) (cache_leftpad): row b's keys start at cache row
    leftpad[b] (clamped at 0), its positions count from there, lengths[b] still ends the row."""
    lengths = lengths.to(device=q.device, dtype=torch.long)
    pad = None if leftpad is None else leftpad.to(device=q.device, dtype=torch.long).clamp(min=0)
    if pad is not None:
        lengths = lengths - pad
    pos = query_positions(lengths, q.shape[1], q.device, call.causal)
    if host_loop and pad is None and call.window is None:
        DECODE_STATS["calls"] += 1
        return attend_runs(q, k, v, patterns, table, pos, lengths, call)
    capacity = k.shape[1] * (1 if block_table is None else block_table.shape[1])
    if dense_route(q, patterns, table, capacity, call.window):   # the key lists cover most of the cache: one product
        return attend_dense(q, k, v, dense_mask(pos, lengths, patterns, table, call.causal, capacity, k.shape[2],
                                                call.window), call, block_table, pad)
    return attend_patterns(q, k, v, patterns, table, pos, lengths, call, block_table, pad)
