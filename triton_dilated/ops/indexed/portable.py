"""Portable PyTorch indexed attention: each chunk of queries gathers the key and value rows its
canonical slots list ((B, n, Hkv, topk, D): the query heads of a kv head share them), takes
the scores of every query head against them in float32, masks the unused slots and runs one
explicit softmax per row. Gradients by autograd (the gathers' backward adds into dK, dV), each
chunk checkpointed: its backward recomputes its gathers, so one chunk's gathered rows (under
GATHER_BUDGET elements) are alive at a time, forward or backward. Nothing of size Nq x Nk is
built.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..common.first_order import first_order_inputs, joined_to, needs_grad
from ..common.lse import safe_lse_weights

GATHER_BUDGET = 1 << 24   # float32 elements per chunk: gathered keys and values, scores


def indexed_attention_torch(q, k, v, slots, count, call, *, block_table=None, physical=False, k_descale=None,
                            v_descale=None):
    """Validated q (B, Nq, Hq, Dqk), k (B, Nk, Hkv, Dqk), v (B, Nk, Hkv, Dv), canonical slots
    (B, Nq, G, topk) (indices.canonical_slots; count unused here: unused slots hold -1) and the
    AttentionCall (its sinks are the caller's). Returns (out like q with Dv, lse float32
    (B, Hq, Nq)). The serve door's caches as kernels.indexed_forward takes them (page pools with
    block_table, or physical pool rows; float8 rows with their descales)."""
    del count
    q, k, v = first_order_inputs("indexed_attention (portable backend)", q, k, v)
    B, Nq, Hq, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    T = slots.shape[3]
    step = max(1, GATHER_BUDGET // max(1, B * Hkv * T * (D + Dv + Hq // Hkv)))
    caches = (block_table, physical, k_descale, v_descale)
    recompute = needs_grad(q, k, v)
    outs, lses = [], []
    for s in range(0, Nq, step):
        sl = slots[:, s:s + step]
        if recompute:   # backward recomputes the chunk's gathers: one chunk's worth alive at a time
            out, lse = checkpoint(_chunk, q[:, s:s + step], k, v, sl, call, caches, use_reentrant=False)
        else:
            out, lse = _chunk(q[:, s:s + step], k, v, sl, call, caches)
        outs.append(out)
        lses.append(lse)
    if not outs:
        out = q.new_zeros((B, 0, Hq, Dv))
        return joined_to(out, q, k, v), joined_to(q.new_zeros((B, Hq, 0), dtype=torch.float32), q, k, v)
    out = torch.cat(outs, dim=1).to(q.dtype).contiguous()
    lse = torch.cat(lses, dim=1).transpose(1, 2).float()
    return joined_to(out, q, k, v), joined_to(lse, q, k, v)


def _chunk(q, k, v, slots, call, caches):
    """(out (B, n, Hq, Dv) float32, lse (B, n, Hq)) of the queries q (B, n, Hq, D) on their slots."""
    B, n, Hq, D = q.shape
    Hkv = k.shape[2]
    T = slots.shape[3]
    acc = torch.promote_types(q.dtype, torch.float32)
    bi = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    hi = torch.arange(Hkv, device=q.device).view(1, 1, Hkv, 1)
    kg, vg, used = _cache_rows(k, v, *caches)(bi, slots.expand(B, n, Hkv, T), hi, acc, q.dtype)  # (B, n, Hkv, T, .)
    vg = vg.masked_fill(~used.unsqueeze(-1), 0.0)
    qg = q.reshape(B, n, Hkv, Hq // Hkv, D).to(acc)
    scores = torch.einsum("bnhgd,bnhtd->bnhgt", qg, kg) * call.scale
    scores = call.cap_scores(scores + scores * 0.0)   # +-inf (an infinite q or k) -> NaN, never a dropped key
    scores = scores.masked_fill(~used.unsqueeze(3), float("-inf"))
    p, lse = safe_lse_weights(scores, dim=-1)                                # (B, n, Hkv, group, T)
    out = torch.einsum("bnhgt,bnhtd->bnhgd", p, vg)
    lse = lse + out.sum(-1) * 0.0                   # a NaN or Inf value read: NaN lse too (DESIGN §6)
    return out.reshape(B, n, Hq, -1), lse.reshape(B, n, Hq)


def _cache_rows(k, v, block_table, physical, k_descale, v_descale):
    """gather(bi, slots, hi, acc, dtype) -> (key rows, value rows in acc, used) of the slots:
    rows of a contiguous k, v, or of page pools through block_table (a page outside the pool
    reads nothing: unused), or the pool rows themselves (physical); float8 rows dequantised and
    rounded to q's dtype (as the kernels read them)."""
    def gather(bi, sl, hi, acc, dtype):
        used = sl >= 0
        idx = sl.clamp(min=0).long()
        if block_table is None and not physical:
            where = (bi, idx)
        else:
            page_size = k.shape[1]
            page = idx // page_size if physical else block_table[bi, idx // page_size].long()
            used = used & (page >= 0) & (page < k.shape[0])
            where = (page.clamp(0, k.shape[0] - 1), idx % page_size)
        kg, vg = k[(*where, hi)], v[(*where, hi)]
        if k_descale is not None:
            kg = (kg.float() * k_descale[hi].unsqueeze(-1)).to(dtype)
            vg = (vg.float() * v_descale[hi].unsqueeze(-1)).to(dtype)
        return kg.to(acc), vg.to(acc), used
    return gather
