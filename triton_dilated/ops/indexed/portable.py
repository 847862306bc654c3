"""Portable PyTorch indexed attention: each chunk of queries gathers the key and value rows its
canonical slots list ((B, n, Hkv, topk, D): the query heads of a kv head share them), takes
the scores of every query head against them in float32, masks the unused slots and runs one
explicit softmax per row. Gradients by autograd (the gathers' backward adds into dK, dV).
Nothing of size Nq x Nk is built; a chunk's gathered rows stay under GATHER_BUDGET elements.
"""
from __future__ import annotations

import torch

from ..common.first_order import first_order_inputs, joined_to
from ..common.lse import safe_lse_weights

GATHER_BUDGET = 1 << 24   # float32 elements per chunk: gathered keys and values, scores


def indexed_attention_torch(q, k, v, slots, count, call):
    """Validated q (B, Nq, Hq, Dqk), k (B, Nk, Hkv, Dqk), v (B, Nk, Hkv, Dv), canonical slots
    (B, Nq, G, topk) (indices.canonical_slots; count unused here: unused slots hold -1) and the
    AttentionCall (its sinks are the caller's). Returns (out like q with Dv, lse float32
    (B, Hq, Nq))."""
    del count
    q, k, v = first_order_inputs("indexed_attention (portable backend)", q, k, v)
    B, Nq, Hq, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    T = slots.shape[3]
    group = Hq // Hkv
    acc = torch.promote_types(q.dtype, torch.float32)
    bi = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    hi = torch.arange(Hkv, device=q.device).view(1, 1, Hkv, 1)
    step = max(1, GATHER_BUDGET // max(1, B * Hkv * T * (D + Dv + group)))
    outs, lses = [], []
    for s in range(0, Nq, step):
        e = min(Nq, s + step)
        sl = slots[:, s:e].expand(B, e - s, Hkv, T)
        used = sl >= 0
        idx = sl.clamp(min=0).long()
        kg = k[bi, idx, hi].to(acc)                                              # (B, n, Hkv, T, D)
        vg = v[bi, idx, hi].to(acc).masked_fill(~used.unsqueeze(-1), 0.0)       # (B, n, Hkv, T, Dv)
        qg = q[:, s:e].reshape(B, e - s, Hkv, group, D).to(acc)
        scores = torch.einsum("bnhgd,bnhtd->bnhgt", qg, kg) * call.scale
        scores = call.cap_scores(scores + scores * 0.0)   # +-inf (an infinite q or k) -> NaN, never a dropped key
        scores = scores.masked_fill(~used.unsqueeze(3), float("-inf"))
        p, lse = safe_lse_weights(scores, dim=-1)                                # (B, n, Hkv, group, T)
        out = torch.einsum("bnhgt,bnhtd->bnhgd", p, vg)
        lse = lse + out.sum(-1) * 0.0                   # a NaN or Inf value read: NaN lse too (DESIGN §6)
        outs.append(out.reshape(B, e - s, Hq, Dv))
        lses.append(lse.reshape(B, e - s, Hq))
    if not outs:
        out = q.new_zeros((B, 0, Hq, Dv), dtype=acc)
        return joined_to(out.to(q.dtype), q, k, v), joined_to(q.new_zeros((B, Hq, 0), dtype=torch.float32), q, k, v)
    out = torch.cat(outs, dim=1).to(q.dtype).contiguous()
    lse = torch.cat(lses, dim=1).transpose(1, 2).float()
    return joined_to(out, q, k, v), joined_to(lse, q, k, v)
