"""Portable dilated decoding: few queries (DESIGN §5b) against a long cache, touching only the
keys each query reads.

A query at position p, for pattern (w, r) with its head's offset o, lies in the segment
[s, min(s + w, L)) with s = (p // w) * w (L: the row's valid length). It is active when
(p - s) % r == o, and then reads the run of keys s + o, s + o + r, ... up to the segment's
end (up to p itself when causal). A query's key list is the concatenation of its patterns'
runs (a key two patterns select appears twice: the multiset union of DESIGN §3), about
sum w/r keys whatever the context length. The same runs drive the Triton decode kernel
(decode_kernels.py), computed there from the position.

Two ways to attend on CPU: without gradients, each run is a strided view of k and v (row
stride r) read in place by matrix-vector products, one (query, head) at a time (a gather
would copy every key first: several times slower, measured); with gradients, the key lists
are gathered in one batch (common.decode.attend_key_lists), which autograd differentiates
into one scatter per input instead of one full-size gradient per view.
"""
from __future__ import annotations

import torch

from ..common.decode import (DECODE_STATS, attend_key_lists, mark_nonfinite, needs_grad, nonfinite_to_nan,
                             query_positions)


def pattern_runs(pos, lengths, w: int, r: int, offsets, causal: bool):
    """The run of keys of pattern (w, r) for queries at `pos` (long (B, Nq)) of rows with
    `lengths` (long (B,)), per head offset `offsets` (long (Hq,), -1: the head does not use
    the pattern): (start, count) long (B, Nq, Hq); keys start + r*t for t < count."""
    p = pos[:, :, None]
    o = offsets.view(1, 1, -1)
    seg = p // w * w
    seg_end = torch.minimum(seg + w, lengths.view(-1, 1, 1))
    active = (o >= 0) & ((p - seg) % r == o)
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


def attend_runs(q, k, v, patterns, table, pos, lengths, causal: bool, scale: float):
    """Each (query, head) over its runs, read in place as strided views of k and v: scores of
    every run in float32, one softmax over all of them (the multiset union), out = the sum
    over runs of their weights times their values. Returns (out like q, lse float32 (B, Hq,
    Nq)); a query with no key gets 0 and -inf, one that reads a non-finite query, key or
    value NaN and NaN."""
    B, Nq, Hq, D = q.shape
    group = Hq // k.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    offsets = torch.tensor(table, dtype=torch.long, device=pos.device).reshape(Hq, len(patterns))
    runs = [pattern_runs(pos, lengths, w, r, offsets[:, i], causal) for i, (w, r) in enumerate(patterns)]
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
                                                     for s, e, r in views]) * scale)
                lse = torch.logsumexp(scores, dim=0)
                weights = torch.exp(scores - lse).split([c for _, _, c in mine])
                outs.append(sum(torch.mv(v[b, s:e:r, h // group].to(acc).t(), p) for (s, e, r), p in zip(views, weights)))
                lses.append(lse)
    out, lse = mark_nonfinite(torch.stack(outs), torch.stack(lses))
    return out.reshape(B, Nq, Hq, D).to(q.dtype), lse.reshape(B, Nq, Hq).permute(0, 2, 1).float().contiguous()


def dilated_decode(q, k, v, patterns, table, lengths, *, causal: bool, scale: float):
    """Dilated attention of q (B, Nq, Hq, D), the last Nq positions of each row's lengths[b]
    valid positions, over k, v (B, Nk, Hkv, D). `patterns`: (w, r) pairs; `table`: per query
    head a tuple of offsets (-1: pattern unused). Returns (out like q, lse float32 (B, Hq,
    Nq)), differentiable."""
    lengths = torch.as_tensor(lengths, dtype=torch.long, device=q.device)
    pos = query_positions(lengths, q.shape[1], q.device)
    if not needs_grad(q, k, v) and q.device.type == "cpu":
        # strided views, no gather; a Python step per (row, query, head): for CPUs only
        DECODE_STATS["calls"] += 1
        return attend_runs(q, k, v, patterns, table, pos, lengths, causal, scale)
    key_pos, key_ok = dilated_key_lists(pos, lengths, patterns, table, causal)
    return attend_key_lists(q, k, v, key_pos, key_ok, scale)
