"""Portable PyTorch dilated attention (the CPU path and the main baseline).

Per pattern (w, r) and per group of heads sharing an offset o, the dilated rows
`s + o + r*i` of every full segment are one strided view of the input,
x[:, :N_full].unflatten(1, (N_full // w, w))[:, :, o::r], plus one view for the short
last segment. Those go through scaled_dot_product_attention (causal inside the dilated
rows is causal in positions) when a head uses one pattern and no lse is wanted;
otherwise through an explicit float32 path that also returns lse. Patterns are mixed by
a float32 lse merge. Memory is O(N*w/r) per pattern, never O(N^2).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ..common.lse import masked_attention_with_lse, merge_partials


def _head_index(heads: list[int]):
    """A slice when `heads` is an arithmetic progression (a view), else an index tensor."""
    if len(heads) == 1:
        return slice(heads[0], heads[0] + 1)
    step = heads[1] - heads[0]
    if step > 0 and all(b - a == step for a, b in zip(heads, heads[1:])):
        return slice(heads[0], heads[-1] + 1, step)
    return torch.tensor(heads)


def _select_heads(x, index):
    if isinstance(index, slice):
        return x[:, :, :, index]
    return x.index_select(3, index.to(x.device))


def _segment_views(x, w: int, r: int, o: int):
    """Dilated rows of x (B, N, H, D) per segment: (B, nseg, L, H, D) views, the full
    segments then the short last one. A generator: when the caller writes into one view,
    the next is made afterwards (autograd refuses writes through a view that an earlier
    in-place write has made stale)."""
    N = x.shape[1]
    n_full = (N // w) * w
    if n_full > 0 and o < w:
        yield x[:, :n_full].unflatten(1, (n_full // w, w))[:, :, o::r]
    if n_full < N and o < N - n_full:
        yield x[:, n_full:].unsqueeze(1)[:, :, o::r]


def _attend(qs, ks, vs, causal: bool, scale: float, need_lse: bool, compute_dtype):
    """qs: (B, nseg, L, Hs, D), ks/vs: (B, nseg, L, Hs, D). Returns out (same layout) and
    lse (B, nseg, Hs, L) or None."""
    B, nseg, L, Hs, D = qs.shape
    to_bhld = lambda x: x.permute(0, 1, 3, 2, 4).reshape(B * nseg, Hs, L, D)  # noqa: E731
    qb, kb, vb = (to_bhld(x).to(compute_dtype) for x in (qs, ks, vs))
    if need_lse:
        keep = torch.ones(L, L, dtype=torch.bool, device=qs.device)
        if causal:
            keep = keep.tril()
        acc = torch.promote_types(compute_dtype, torch.float32)  # scores and lse in float32
        out, lse = masked_attention_with_lse(qb.to(acc), kb.to(acc), vb.to(acc), keep, scale)
        lse = lse.reshape(B, nseg, Hs, L)
    else:
        out, lse = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=scale), None
    return out.reshape(B, nseg, Hs, L, D).permute(0, 1, 3, 2, 4), lse


def dilated_attention_torch(q, k, v, patterns, table, *, causal: bool, scale: float,
                            need_lse: bool, compute_dtype=None):
    """Portable dilated attention on validated inputs. `patterns`: tuple of (w, r);
    `table`: per query head a tuple of offsets (-1: pattern unused). Returns (out, lse):
    out like q (contiguous), lse float32 (B, Hq, N) or None."""
    B, N, Hq, D = q.shape
    group = Hq // k.shape[2]
    compute_dtype = compute_dtype or q.dtype
    merge = max(sum(o >= 0 for o in row) for row in table) > 1  # some head mixes patterns
    want_lse = need_lse or merge

    acc_dtype = torch.promote_types(q.dtype, torch.float32)

    def new_buffers():
        out = q.new_zeros(B, N, Hq, D, dtype=acc_dtype if merge else q.dtype)
        lse = q.new_full((B, N, Hq), float("-inf"), dtype=acc_dtype) if want_lse else None
        return out, lse

    # Without mixing, every head writes one pattern into one shared buffer; with mixing,
    # each pattern gets its own float32 (out, lse), merged at the end.
    parts = [] if merge else [new_buffers()]
    for i, (w, r) in enumerate(patterns):
        by_offset: dict[int, list[int]] = {}
        for h, row in enumerate(table):
            if row[i] >= 0:
                by_offset.setdefault(row[i], []).append(h)
        if not by_offset:
            continue
        if merge:
            parts.append(new_buffers())
        out_i, lse_i = parts[-1]
        for o, heads in by_offset.items():
            q_idx = _head_index(heads)
            kv_idx = _head_index([h // group for h in heads])
            views = zip(_segment_views(q, w, r, o), _segment_views(k, w, r, o), _segment_views(v, w, r, o),
                        _segment_views(out_i, w, r, o),
                        _segment_views(lse_i.unsqueeze(-1), w, r, o) if want_lse else itertools.repeat(None))
            for qv, kv, vv, ov, lv in views:
                res, lse = _attend(_select_heads(qv, q_idx), _select_heads(kv, kv_idx),
                                   _select_heads(vv, kv_idx), causal, scale, want_lse, compute_dtype)
                _scatter(ov, q_idx, res)
                if want_lse:
                    _scatter(lv, q_idx, lse.transpose(2, 3).unsqueeze(-1))

    if merge:
        out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    else:
        out, lse = parts[0]
    out = out.to(q.dtype)
    return out, (lse.permute(0, 2, 1).contiguous() if need_lse else None)


def _scatter(dst_view, index, value):
    """dst_view[..., index, :] = value (in place on a view of a fresh buffer; autograd-safe)."""
    if isinstance(index, slice):
        dst_view[:, :, :, index] = value.to(dst_view.dtype)
    else:
        dst_view[:, :, :, index.to(dst_view.device)] = value.to(dst_view.dtype)
