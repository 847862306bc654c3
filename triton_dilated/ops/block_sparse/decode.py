"""Portable block-sparse decoding: few queries (DESIGN §5b) against a long cache, touching only
the key blocks of each query's layout row.

A query at position p (clamped at 0 without causal: ops/dilated/decode.py) reads layout
row p // block_size: the keys of its active key blocks that lie below the row's valid length
L (and at or before p when causal; in a sliding window's window blocks, those its predicate
keeps). Cost per query: the row's active blocks times the block size, whatever the context
length. The Triton decode kernel (decode_kernels.py) walks the same blocks.
"""
from __future__ import annotations

import torch

from ..common.decode import attend_dense, attend_key_lists, dense_pays, query_positions
from ..common.masks import causal as causal_pred


def block_key_lists(pos, lengths, layout, num_heads: int, causal: bool):
    """(key_pos, key_ok), long and bool (B, Nq, Hq, W * block_size): the keys of the active
    blocks of each query's layout row, W = the width of the layout's index lists (the most
    blocks any row has: a shape, so no host sync)."""
    device = pos.device
    B, Nq = pos.shape
    bs = layout.block_size
    lb, lh = layout.kv_num_blocks.shape[:2]
    # a query before the first key (pos < 0, causal only: ops/dilated/decode.py) reads nothing
    rows = (pos.clamp(min=0) // bs).view(B, Nq, 1).expand(B, Nq, num_heads)
    bi = torch.arange(B, device=device).view(B, 1, 1) % lb
    hi = torch.arange(num_heads, device=device).view(1, 1, num_heads) % lh
    counts = layout.kv_num_blocks.to(device).long()[bi, hi, rows]                 # (B, Nq, Hq)
    width = max(1, layout.kv_indices.shape[-1])
    blocks = layout.kv_indices.to(device).long()[bi, hi, rows][..., :width]       # (B, Nq, Hq, W)
    key_pos = (blocks[..., None] * bs + torch.arange(bs, device=device)).flatten(-2)
    slot_ok = (torch.arange(width, device=device) < counts[..., None]).repeat_interleave(bs, dim=-1)
    key_ok = slot_ok & (key_pos < lengths.view(B, 1, 1, 1)) & (pos >= 0).view(B, Nq, 1, 1)
    if causal:
        key_ok &= causal_pred(pos.view(B, Nq, 1, 1), key_pos)
    if getattr(layout, "window", None) is not None:   # a sliding window's predicate in its window blocks
        flags = layout.kv_window.to(device)[bi, hi, rows][..., :width].repeat_interleave(bs, dim=-1)
        key_ok &= ~flags | layout.window(pos.view(B, Nq, 1, 1), key_pos)
    return torch.where(key_ok, key_pos, torch.zeros((), dtype=torch.long, device=device)), key_ok


def dense_mask(pos, lengths, layout, num_heads: int, num_kv_heads: int, causal: bool, capacity: int):
    """mask_of(rows) for common.decode.attend_dense: (keep bool (b, Hkv, G, Nq, capacity), or
    (b, 1, 1, Nq, capacity) for a layout shared by the heads, None): whether a (query, head)
    of the batch rows `rows` reads key j (block_key_lists as a mask: the active blocks of the
    query's layout row, below the row's length, at or before the query when causal). Layouts
    without a sliding window (dense_route)."""
    device = pos.device
    bs = layout.block_size
    lb, lh = layout.kv_num_blocks.shape[:2]
    counts_all, index_all = layout.kv_num_blocks.to(device).long(), layout.kv_indices.to(device).long()
    width = max(1, index_all.shape[-1])
    j = torch.arange(capacity, device=device)
    nkb = -(-capacity // bs)

    heads = 1 if lh == 1 else num_heads   # a layout shared by the heads: one mask for all
    key_block = j // bs

    def mask_of(rows):
        p, n = pos[rows], lengths[rows]
        b, Nq = p.shape
        qrow = (p.clamp(min=0) // bs).view(b, 1, Nq)
        bi = torch.arange(pos.shape[0], device=device)[rows].view(b, 1, 1) % lb
        hi = torch.arange(heads, device=device).view(1, heads, 1) % lh
        counts = counts_all[bi, hi, qrow]                                           # (b, heads, Nq)
        blocks = index_all[bi, hi, qrow][..., :width]                               # (b, heads, Nq, W)
        blocks = torch.where(torch.arange(width, device=device) < counts[..., None], blocks.clamp(0, nkb), nkb)
        mask = torch.zeros(b, heads, Nq, nkb + 1, dtype=torch.bool, device=device).scatter_(-1, blocks, True)
        pk = p.view(b, 1, Nq, 1)
        run = causal_pred(pk, j) if causal else (j < n.view(b, 1, 1, 1))            # causal: p < n
        keep = mask[..., key_block] & (run & (pk >= 0))
        if heads == 1:
            return keep.view(b, 1, 1, Nq, capacity), None
        return keep.view(b, num_kv_heads, num_heads // num_kv_heads, Nq, capacity), None

    return mask_of


def dense_route(q, layout, capacity: int) -> bool:
    """Whether the portable decode takes the dense route (common.decode.dense_pays): the key
    slots of every head's list (the layout's index-list width times the block size); not for
    a layout with a sliding window (its predicate stays on the gather path)."""
    if getattr(layout, "window", None) is not None:
        return False
    return dense_pays(q, q.shape[2] * max(1, layout.kv_indices.shape[-1]) * layout.block_size, capacity)


def block_sparse_decode(q, k, v, layout, lengths, call, *, block_table=None, leftpad=None):
    """Block-sparse attention of q (B, Nq, Hq, D), the last Nq positions of each row's
    lengths[b] (an integer tensor (B,)) valid positions, over k, v (B, Nk, Hkv, D), the layout covering Nk (absolute
    positions; with block_table, k and v are page pools). Returns (out like q, lse float32
    (B, Hq, Nq)), differentiable, under the AttentionCall (its sinks are the caller's);
    leftpad (cache_leftpad) as ops/dilated/decode.dilated_decode's."""
    lengths = lengths.to(device=q.device, dtype=torch.long)
    pad = None if leftpad is None else leftpad.to(device=q.device, dtype=torch.long).clamp(min=0)
    if pad is not None:
        lengths = lengths - pad
    pos = query_positions(lengths, q.shape[1], q.device, call.causal)
    capacity = k.shape[1] * (1 if block_table is None else block_table.shape[1])
    if dense_route(q, layout, capacity):   # the key lists cover most of the cache: one product
        return attend_dense(q, k, v, dense_mask(pos, lengths, layout, q.shape[2], k.shape[2], call.causal,
                                                   capacity), call, block_table, pad)
    key_pos, key_ok = block_key_lists(pos, lengths, layout, q.shape[2], call.causal)
    return attend_key_lists(q, k, v, key_pos, key_ok, call, block_table, pad)
