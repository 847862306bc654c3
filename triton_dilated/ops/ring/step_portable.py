"""Portable PyTorch ring step (CPU without the interpreter, pre-Volta GPUs): the same
contract as step_kernels.py, computed per block of query rows with an explicit float32
score block (B, Hq, rows, N_shard). The rows are chosen so that the block holds about
SCORE_BLOCK_BYTES: a step's extra memory is a few such blocks (the dilated multiplicity,
float64, is two) plus float32 copies of its K and V, never the (N_local x N_shard) score
matrix of the whole step (0.8-1.3 GiB at N_local = N_shard = 4096, H = 4, measured)."""
from __future__ import annotations

import math

import torch

from ..dilated.naive import pattern_multiplicity
from .mask import MASK_DILATED, MASK_LAYOUT

SCORE_BLOCK_BYTES = 4 << 20
MIN_ROWS = 16          # fewer rows per block would cost more in per-op overhead than it saves


def query_blocks(q, n_keys, block_bytes=None):
    """Slices of query rows, each with a float32 (B, Hq, rows, n_keys) score block of about
    block_bytes (at least MIN_ROWS rows)."""
    B, NQ, Hq, _ = q.shape
    per_row = 4 * max(1, B * Hq * n_keys)   # an empty batch still gets one block
    rows = max(MIN_ROWS, (SCORE_BLOCK_BYTES if block_bytes is None else block_bytes) // per_row)
    return [slice(s, min(NQ, s + rows)) for s in range(0, NQ, rows)]


def pair_log_weight(q_pos, k_pos, mask, num_heads, batch, q_doc=None, k_doc=None):
    """(B|1, Hq|1, Nq, Nk) ln(weight), -inf where a pair does not count; None when every
    pair counts once (dense, not causal). The weight: the dilated multiplicity, or the block
    table's entry (its window blocks: the window predicate per element), times the step's
    element predicates (causal; with q_doc, k_doc, packed documents' ids per row
    (ring/documents.py), the same document)."""
    qp, kp = q_pos.long()[:, None], k_pos.long()[None, :]
    pred = mask.predicate(documents=q_doc is not None)
    ok = None if pred is None else pred(qp, kp, *(() if q_doc is None else (q_doc.long()[:, None],
                                                                           k_doc.long()[None, :])))
    if mask.kind == MASK_DILATED:
        c = pattern_multiplicity(q_pos, k_pos, mask.patterns, mask.table).float()[None]
        ok = c > 0 if ok is None else ok & (c > 0)
        return torch.where(ok, torch.log(c.clamp_min(1.0)), torch.full_like(c, -math.inf))
    if mask.kind == MASK_LAYOUT:
        bs = mask.layout_block
        table = mask.layout[:, :, q_pos.long() // bs][:, :, :, k_pos.long() // bs]
        active = table != 0
        if mask.window is not None:   # 2: a sliding window's block, its predicate per element
            active &= (table != 2) | mask.window(qp, kp)
        ok = active if ok is None else ok & active
    if ok is None:
        return None
    return torch.zeros(ok.shape, dtype=torch.float32, device=ok.device).masked_fill_(~ok, -math.inf)


def _heads(x, G):
    """(B, n, Hkv * G, D) -> float32 (B, Hkv, G * n, D): query head h = hkv * G + g reads key
    head hkv, so one matmul per key head serves its G query heads (no repeated K, V)."""
    B, n, H, D = x.shape
    return x.float().view(B, n, H // G, G, D).permute(0, 2, 3, 1, 4).reshape(B, H // G, G * n, D)


def _unheads(x, G):
    """Inverse of _heads: (B, Hkv, G * n, D) -> (B, n, Hkv * G, D)."""
    B, Hkv, Gn, D = x.shape
    return x.view(B, Hkv, G, Gn // G, D).permute(0, 3, 1, 2, 4).reshape(B, Gn // G, Hkv * G, D)


def _scores(qh, kh, q_pos, k_pos, mask, call, G, q_doc=None, k_doc=None):
    """float32 scores, capped (the call's cap: s -> c * tanh(s / c)), plus ln(weight), (B, Hq, n,
    Nk), from _heads(q rows) and K as (B, Hkv, Nk, D); and tanh(s / c) (None without a cap),
    whose 1 - tanh^2 the backward needs."""
    B, Hkv, Gn, _ = qh.shape
    s = torch.matmul(qh, kh.transpose(-1, -2)).mul_(call.scale).view(B, Hkv * G, Gn // G, kh.shape[2])
    s, t = call.cap_scores_(s)   # +-inf scores -> NaN first (NaN rule)
    log_w = pair_log_weight(q_pos, k_pos, mask, Hkv * G, B, q_doc, k_doc)
    return (s if log_w is None else s.add_(log_w)), t


def _rows_of(q_doc, rows):
    return None if q_doc is None else q_doc[rows]


def step_forward(q, k, v, q_pos, k_pos, out, lse, mask, call, *, q_doc=None, k_doc=None):
    B, G = q.shape[0], q.shape[2] // k.shape[2]
    kh, vh = _heads(k, 1), _heads(v, 1)                                     # (B, Hkv, Nk, D)
    for rows in query_blocks(q, k.shape[1]):
        s, _ = _scores(_heads(q[:, rows], G), kh, q_pos[rows], k_pos, mask, call, G, _rows_of(q_doc, rows),
                       k_doc)                                               # (B, Hq, n, Nk)
        n = s.shape[2]
        lse_step = torch.logsumexp(s, dim=-1)                               # -inf rows stay -inf
        safe = torch.where(torch.isinf(lse_step), torch.zeros_like(lse_step), lse_step)
        p = torch.exp_(s.sub_(safe[..., None]))
        part = _unheads(torch.matmul(p.view(B, -1, G * n, p.shape[-1]), vh), G)      # (B, n, Hq, D)
        run_lse = lse[:, :, rows]
        top = torch.maximum(run_lse, lse_step)
        top_safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        w_run, w_step = torch.exp(run_lse - top_safe), torch.exp(lse_step - top_safe)
        total = w_run + w_step
        total_safe = torch.where(total == 0, torch.ones_like(total), total)
        out_rows = out[:, rows]
        out_rows.copy_((out_rows * w_run.transpose(1, 2)[..., None] + part * w_step.transpose(1, 2)[..., None])
                       / total_safe.transpose(1, 2)[..., None])
        run_lse.copy_(torch.where(total == 0, torch.full_like(total, -math.inf), top_safe + torch.log(total_safe)))


def step_backward(q, k, v, do, lse, delta, q_pos, k_pos, dq, dk, dv, mask, call, *, q_doc=None, k_doc=None):
    B, G = q.shape[0], q.shape[2] // k.shape[2]
    kh, vh = _heads(k, 1), _heads(v, 1)                                     # (B, Hkv, Nk, D)
    dkh, dvh = torch.zeros_like(kh), torch.zeros_like(vh)
    for rows in query_blocks(q, k.shape[1]):
        qh, doh = _heads(q[:, rows], G), _heads(do[:, rows], G)             # (B, Hkv, G n, D)
        s, t = _scores(qh, kh, q_pos[rows], k_pos, mask, call, G, _rows_of(q_doc, rows), k_doc)
        n = s.shape[2]
        row_lse = lse[:, :, rows]
        row = torch.where(torch.isinf(row_lse), torch.full_like(row_lse, math.inf), row_lse)
        p = torch.exp_(s.sub_(row[..., None])).view(B, -1, G * n, s.shape[-1])   # empty rows: exp(-inf) = 0
        dp = torch.matmul(doh, vh.transpose(-1, -2))
        ds = p * dp.sub_(delta[:, :, rows].reshape(B, -1, G * n, 1))
        if t is not None:   # through the cap: d(c * tanh(s / c)) / ds = 1 - tanh^2
            ds.mul_((1.0 - t * t).view(B, -1, G * n, t.shape[-1]))
        dq[:, rows] += _unheads(torch.matmul(ds, kh), G) * call.scale
        dkh.add_(torch.matmul(ds.transpose(-1, -2), qh), alpha=call.scale)
        dvh.add_(torch.matmul(p.transpose(-1, -2), doh))
    dk += dkh.transpose(1, 2)
    dv += dvh.transpose(1, 2)
