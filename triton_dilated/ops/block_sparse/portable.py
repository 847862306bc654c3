"""Portable PyTorch block-sparse attention: each (batch, head, query block) row attends to
its active key blocks, gathered into one batch, under a keep-mask (slots past the row's
count, keys past N, when causal later keys, and a sliding window's predicate in its window
blocks), lse included (ops.common.lse: PyTorch's
fused CPU kernel on CPU, a chunked explicit float32 softmax elsewhere).

Rows are bucketed by their number of active blocks (powers of two), and each bucket
gathers only up to its widest row: a layout with a few full rows (BigBird's global blocks)
does not pad every row to N. Each bucket goes in chunks of rows whose gathered keys,
values and mask stay under GATHER_BUDGET elements; rows with no block are not computed
(0 and -inf). Nothing of size N x N is built.
"""
from __future__ import annotations

import torch

from ..common.first_order import first_order_inputs
from ..common.lse import all_finite, attention_with_lse
from ..common.masks import causal as causal_pred

GATHER_BUDGET = 1 << 25   # elements per chunk: gathered keys and values, the (bs x W*bs) mask and bias


def _buckets(counts: torch.Tensor):
    """Flat row ids grouped by width class (counts in (2^(j-1), 2^j]); empty rows left out.
    Yields (row ids, widest count in the class)."""
    nonzero = counts > 0
    cls = torch.zeros_like(counts)
    cls[nonzero] = torch.ceil(torch.log2(counts[nonzero].double())).long()
    for c in torch.unique(cls[nonzero]).tolist():
        rows = torch.nonzero(nonzero & (cls == c)).flatten()
        yield rows, int(counts[rows].max())


def block_sparse_attention_torch(q, k, v, layout, call, *, compute_dtype=None):
    """Validated inputs and the AttentionCall (its sinks are the caller's); returns (out like q,
    lse float32 (B, Hq, N))."""
    q, k, v = first_order_inputs("block_sparse_attention (portable backend)", q, k, v)
    B, N, Hq, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    bs, nb = layout.block_size, layout.n_q_blocks
    nkb = -(-Nk // bs)
    compute = compute_dtype or q.dtype
    device = q.device

    def as_blocks(x, n_blocks):   # (B, n, H, D) -> (B, n_blocks, bs, H, D)
        return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, n_blocks * bs - x.shape[1])).unflatten(1, (n_blocks, bs))
    qb, kb, vb = as_blocks(q, nb), as_blocks(k, nkb), as_blocks(v, nkb)
    counts = layout.kv_num_blocks.to(device).long().expand(B, Hq, nb).reshape(-1)            # (B*Hq*nb,)
    index = layout.kv_indices.to(device).long()
    index = index.expand(B, Hq, nb, index.shape[-1]).reshape(B * Hq * nb, -1)
    window = layout.window   # a sliding window: its predicate on the flagged slots
    if window is not None:
        flags = layout.kv_window.to(device).expand(B, Hq, nb, index.shape[-1]).reshape(B * Hq * nb, -1)
    group = Hq // Hkv
    offs = torch.arange(bs, device=device)
    finite = all_finite(q, k, v)   # else each chunk applies the NaN rule (ops.common.lse)

    ids, outs, lses = [], [], []
    for rows, width in _buckets(counts):
        per_row = width * bs * (2 * D + 2 * bs)        # gathered k and v; mask and bias (or scores) per query
        step = max(1, GATHER_BUDGET // per_row)
        for s in range(0, rows.numel(), step):
            r = rows[s:s + step]
            b, h, blk = r // (Hq * nb), r // nb % Hq, r % nb
            idx = index[r, :width]                                              # (n, W)
            kvh = (h // group)[:, None]
            kg = kb[b[:, None], idx, :, kvh].flatten(1, 2).to(compute)          # (n, W*bs, D)
            vg = vb[b[:, None], idx, :, kvh].flatten(1, 2).to(compute)
            qg = qb[b, blk, :, h].to(compute)                                   # (n, bs, D)
            kpos = (idx[:, :, None] * bs + offs).flatten(1)                    # (n, W*bs)
            slot_ok = torch.arange(width, device=device) < counts[r, None]
            keep = (slot_ok.repeat_interleave(bs, dim=1) & (kpos < Nk)).unsqueeze(1)   # (n, 1, W*bs)
            qpos = (blk[:, None] * bs + offs)[:, :, None]                          # (n, bs, 1)
            if call.causal:
                later_ok = causal_pred(qpos, kpos[:, None, :])                     # (n, bs, W*bs)
                keep = later_ok.logical_and_(keep)
            elif bool(keep.all()):
                keep = None
            if window is not None:
                in_window = flags[r, :width].repeat_interleave(bs, dim=1)[:, None, :]
                win_ok = ~in_window | window(qpos, kpos[:, None, :])
                keep = win_ok if keep is None else win_ok.logical_and_(keep)
            o, lse = attention_with_lse(qg[None], kg[None], vg[None], call, keep=None if keep is None else keep[None],
                                        finite=finite, causal=False)
            ids.append(r)
            outs.append(o[0])
            lses.append(lse[0])
    # one gather puts every computed row in place; empty rows read the appended (0, -inf) row
    acc = torch.promote_types(compute, torch.float32)
    if not ids:   # empty slices of the inputs keep the results differentiable (zero gradients)
        outs = [x[0, :0, :, 0] for x in (qb, kb, vb)]
        lses = [x[0, :0, :, 0, 0] for x in (qb, kb, vb)]
    out_rows = torch.cat([o.to(acc) for o in outs] + [torch.zeros(1, bs, D, dtype=acc, device=device)])
    lse_rows = torch.cat([x.to(acc) for x in lses] + [torch.full((1, bs), float("-inf"), dtype=acc, device=device)])
    where = torch.full((B * Hq * nb,), out_rows.shape[0] - 1, dtype=torch.long, device=device)
    if ids:
        computed = torch.cat(ids)
        where[computed] = torch.arange(computed.numel(), device=device)
    out = out_rows[where].reshape(B, Hq, nb * bs, D)[:, :, :N]
    lse = lse_rows[where].reshape(B, Hq, nb * bs)[:, :, :N]
    return out.transpose(1, 2).to(q.dtype).contiguous(), lse.float()
