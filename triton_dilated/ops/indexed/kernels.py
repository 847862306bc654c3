"""Triton indexed attention kernels and their launchers: the forward and dQ gather each query's
listed key rows, dK/dV walk each key's inverse list (deterministic, no atomics). The public
function and its autograd are in interface.py; the slot lists in indices.py.

Forward and dQ: a program owns one query i of one kv head and BLOCK_H of the query heads
that share its indices row: q is a [BLOCK_H, BLOCK_D] tile (the heads are the M dimension of
the dots), and the program gathers the canonical slots BLOCK_K at a time (their keys as a
[BLOCK_K, BLOCK_D] tile, unused slots masked and never read) through the shared online
softmax. The canonical lists put a row's used keys first, so a program walks ceil(count /
BLOCK_K) tiles, not topk.

dK/dV: a program owns one key t of one kv head and walks the queries whose rows list it
(indices.query_lists: a stable device sort), BLOCK_R (query, head) rows at a time, with P and
dS recomputed from the forward's row statistics. Every key's sums run in one program in a
fixed order: no atomics, the same bits every run. One key row feeds no dot: this is vector
work (a product and a sum per row), memory-bound on the query rows it reads.

The serve door's caches go through the forward kernel's gather: page pools through the
block table (PAGE_SIZE > 0), FlashMLA's physical pool rows (PHYSICAL), float8 rows dequantised
with the per-kv-head descales (KV_FP8). The indexer's scoring kernel is at the end.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.decode_kernels import fp8_mode, fp8_operands, load_cache
from ..common.hardware import padded_head_dim
from ..common.kernels import (LOG2E, dot, finalize, load_row_stats, online_softmax_step, softcap_terms,
                              softmax_grad_block, tanh)
from ..common.lse import softmax_delta
from ..common.runtime import kernel_options, last_dim_contiguous, on_tensor_device, require_contiguous
from .indices import query_lists
from .tiles import indexed_tiles, indexer_tiles


@triton.jit
def _query_program(NQ, HKV, N_HT):
    """(head tile, query i, kv head, batch row) of a forward or dQ program; int64 but the tile."""
    pid = tl.program_id(0)
    ht = pid % N_HT
    rest = (pid // N_HT).to(tl.int64)
    i = rest % NQ
    rest = rest // NQ
    return ht, i, rest % HKV, rest // HKV


@triton.jit
def _gather(K, V, stride_kb, stride_kn, stride_vb, stride_vn, b, slot_row, j0, count, NK, d, d_ok, e, e_ok, BT,
            NUM_PAGES, BLOCK_K: tl.constexpr, PAGE_SIZE: tl.constexpr = 0, PHYSICAL: tl.constexpr = False,
            KV_FP8: tl.constexpr = 0):
    """Slots [j0, j0 + BLOCK_K) of a canonical row: their key rows [BLOCK_K, BLOCK_D], value rows
    [BLOCK_K, BLOCK_DV] and which slots are used. An unused slot (past count, -1 or outside
    [0, NK)) reads nothing and loads zeros: 0 * a NaN value would spread it. K, V: the kv head's
    rows (batch offset not applied). PAGE_SIZE > 0 (the serve door's page pools): position p at
    row p % PAGE_SIZE of page BT[p // PAGE_SIZE] (BT: the batch row's block table; a page
    outside [0, NUM_PAGES) reads nothing), or with PHYSICAL the slot is the pool row itself
    (FlashMLA's page * PAGE_SIZE + offset). KV_FP8 > 0: float8 rows, returned as float32
    (decode_kernels.load_cache)."""
    t = j0 + tl.arange(0, BLOCK_K)
    idx = tl.load(slot_row + t, mask=t < count, other=-1)
    ok = (idx >= 0) & (idx < NK)
    pos = tl.where(ok, idx, 0).to(tl.int64)
    if PAGE_SIZE == 0:
        k_rows = b * stride_kb + pos * stride_kn
        v_rows = b * stride_vb + pos * stride_vn
    else:
        if PHYSICAL:
            page = pos // PAGE_SIZE
        else:
            page = tl.load(BT + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
            ok = ok & (page >= 0) & (page < NUM_PAGES)
            page = tl.where(ok, page, 0)
        k_rows = page * stride_kb + (pos % PAGE_SIZE) * stride_kn
        v_rows = page * stride_vb + (pos % PAGE_SIZE) * stride_vn
    k_mask = ok[:, None] & d_ok[None, :]
    v_mask = ok[:, None] & e_ok[None, :]
    if KV_FP8 > 0:
        k = load_cache(K + k_rows[:, None] + d[None, :], k_mask, KV_FP8)
        v = load_cache(V + v_rows[:, None] + e[None, :], v_mask, KV_FP8)
    else:
        k = tl.load(K + k_rows[:, None] + d[None, :], mask=k_mask, other=0.0)
        v = tl.load(V + v_rows[:, None] + e[None, :], mask=v_mask, other=0.0)
    return k, v, ok


@triton.jit
def _indexed_fwd_kernel(
        Q, K, V, O, ROW_MAX, ROW_SUM, SLOTS, COUNT,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        NQ, NK, HQ, HKV, GROUP, SLOT_ROWS, TOPK, sm_scale, softcap,
        HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, DOT_MODE: tl.constexpr, PRECISION: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, BLOCK_TABLE=None, stride_btb=0, NUM_PAGES=0, K_DESCALE=None, V_DESCALE=None,
        PAGE_SIZE: tl.constexpr = 0, PHYSICAL: tl.constexpr = False, KV_FP8: tl.constexpr = 0):
    ht, i, kvh, b = _query_program(NQ, HKV, tl.cdiv(GROUP, BLOCK_H))
    cap = softcap_terms(softcap, HAS_SOFTCAP)
    hh = ht * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < GROUP
    h = kvh * GROUP + hh                                                                   # [BLOCK_H] int64
    bt = BLOCK_TABLE
    if PAGE_SIZE > 0:
        if not PHYSICAL:
            bt = BLOCK_TABLE + b * stride_btb
    if KV_FP8 > 0:
        k_descale = tl.load(K_DESCALE + kvh)
        v_descale = tl.load(V_DESCALE + kvh)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    e = tl.arange(0, BLOCK_DV)
    e_ok = e < HEAD_DIM_V
    q = tl.load(Q + b * stride_qb + i * stride_qn + h[:, None] * stride_qh + d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)                          # [BLOCK_H, BLOCK_D]
    row = (b * NQ + i) * SLOT_ROWS + kvh % SLOT_ROWS     # SLOT_ROWS: Hkv, or 1 for rows shared by the heads
    slot_row = SLOTS + row * TOPK
    count = tl.load(COUNT + row)
    K += kvh * stride_kh
    V += kvh * stride_vh

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for j0 in range(0, count, BLOCK_K):
        k, v, ok = _gather(K, V, stride_kb, stride_kn, stride_vb, stride_vn, b, slot_row, j0, count, NK, d, d_ok, e,
                           e_ok, bt, NUM_PAGES, BLOCK_K, PAGE_SIZE, PHYSICAL, KV_FP8)
        if KV_FP8 > 0:   # the dequantised rows, rounded to q's dtype as a dequantised cache would be
            k = (k * k_descale).to(Q.dtype.element_ty)
            v = (v * v_descale).to(Q.dtype.element_ty)
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, sm_scale, h_ok[:, None] & ok[None, :], True,
                                            DOT_MODE, PRECISION, cap=cap, HAS_SOFTCAP=HAS_SOFTCAP)
    out, row_max, row_sum = finalize(acc, m_i, l_i, q)                                 # [BLOCK_H, BLOCK_DV]
    tl.store(O + ((b * NQ + i) * HQ + h[:, None]) * HEAD_DIM_V + e[None, :], out.to(O.dtype.element_ty),
             mask=h_ok[:, None] & e_ok[None, :])
    stats = (b * HQ + h) * NQ + i
    tl.store(ROW_MAX + stats, row_max, mask=h_ok)
    tl.store(ROW_SUM + stats, row_sum, mask=h_ok)


@triton.jit
def _indexed_bwd_dq_kernel(
        Q, K, V, DO, ROW_MAX, ROW_SUM, DELTA, DQ, SLOTS, COUNT,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_dob, stride_don, stride_doh,
        NQ, NK, HQ, HKV, GROUP, SLOT_ROWS, TOPK, sm_scale, softcap,
        HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, DOT_MODE: tl.constexpr, PRECISION: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr):
    ht, i, kvh, b = _query_program(NQ, HKV, tl.cdiv(GROUP, BLOCK_H))
    cap = softcap_terms(softcap, HAS_SOFTCAP)
    hh = ht * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < GROUP
    h = kvh * GROUP + hh
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    e = tl.arange(0, BLOCK_DV)
    e_ok = e < HEAD_DIM_V
    q = tl.load(Q + b * stride_qb + i * stride_qn + h[:, None] * stride_qh + d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)                          # [BLOCK_H, BLOCK_D]
    do = tl.load(DO + b * stride_dob + i * stride_don + h[:, None] * stride_doh + e[None, :],
                 mask=h_ok[:, None] & e_ok[None, :], other=0.0)                         # [BLOCK_H, BLOCK_DV]
    stats = (b * HQ + h) * NQ + i
    row_max, row_log2l = load_row_stats(ROW_MAX, ROW_SUM, stats, h_ok)                  # empty rows: P = 0
    delta = tl.load(DELTA + stats, mask=h_ok, other=0.0)
    row = (b * NQ + i) * SLOT_ROWS + kvh % SLOT_ROWS     # SLOT_ROWS: Hkv, or 1 for rows shared by the heads
    slot_row = SLOTS + row * TOPK
    count = tl.load(COUNT + row)
    K += kvh * stride_kh
    V += kvh * stride_vh

    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for j0 in range(0, count, BLOCK_K):
        k, v, ok = _gather(K, V, stride_kb, stride_kn, stride_vb, stride_vn, b, slot_row, j0, count, NK, d, d_ok, e,
                           e_ok, None, 0, BLOCK_K)
        p, ds = softmax_grad_block(q, k, v, do, row_max, row_log2l, delta, sm_scale, h_ok[:, None] & ok[None, :],
                                   True, DOT_MODE, PRECISION, cap=cap, HAS_SOFTCAP=HAS_SOFTCAP)
        dq += dot(ds.to(k.dtype), k, DOT_MODE, PRECISION)
    tl.store(DQ + ((b * NQ + i) * HQ + h[:, None]) * HEAD_DIM + d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])


@triton.jit
def _indexed_bwd_dkdv_kernel(
        Q, K, V, DO, ROW_MAX, ROW_SUM, DELTA, DK, DV, Q_START, Q_LIST,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_dob, stride_don, stride_doh,
        NQ, NK, HQ, HKV, GROUP, SLOT_ROWS, sm_scale, softcap,
        HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    t = pid % NK
    rest = pid // NK
    kvh = rest % HKV
    b = rest // HKV
    cap = softcap_terms(softcap, HAS_SOFTCAP)
    lst = (b * SLOT_ROWS + kvh % SLOT_ROWS) * NK + t        # SLOT_ROWS: Hkv, or 1 for shared rows
    start = tl.load(Q_START + lst)
    end = tl.load(Q_START + lst + 1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    e = tl.arange(0, BLOCK_DV)
    e_ok = e < HEAD_DIM_V
    k = tl.load(K + b * stride_kb + t * stride_kn + kvh * stride_kh + d, mask=d_ok, other=0.0).to(tl.float32)
    v = tl.load(V + b * stride_vb + t * stride_vn + kvh * stride_vh + e, mask=e_ok, other=0.0).to(tl.float32)
    dk = tl.zeros([BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_DV], tl.float32)
    # rows r of a step: query (r // BLOCK_H) of the list, head (r % BLOCK_H) of the head tile
    r = tl.arange(0, BLOCK_R)
    r_q = r // BLOCK_H
    r_h = r % BLOCK_H
    per_step = BLOCK_R // BLOCK_H
    for h0 in range(0, GROUP, BLOCK_H):
        hh = h0 + r_h
        h = kvh * GROUP + hh
        for j0 in range(start, end, per_step):
            j = j0 + r_q
            ok = (j < end) & (hh < GROUP)
            qi = tl.load(Q_LIST + j, mask=j < end, other=0).to(tl.int64)
            qrow = tl.load(Q + b * stride_qb + qi[:, None] * stride_qn + h[:, None] * stride_qh + d[None, :],
                           mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)        # [BLOCK_R, BLOCK_D]
            dorow = tl.load(DO + b * stride_dob + qi[:, None] * stride_don + h[:, None] * stride_doh + e[None, :],
                            mask=ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)      # [BLOCK_R, BLOCK_DV]
            stats = (b * HQ + h) * NQ + qi
            row_max, row_log2l = load_row_stats(ROW_MAX, ROW_SUM, stats, ok)              # masked rows: P = 0
            delta = tl.load(DELTA + stats, mask=ok, other=0.0)
            s = tl.sum(qrow * k[None, :], 1) * sm_scale
            if HAS_SOFTCAP:
                c, inv_c, _ = cap
                th = tanh(s * inv_c, Q.dtype.element_ty == tl.float32)
                s = th * c
            p = tl.math.exp2((s - row_max) * LOG2E - row_log2l)                          # [BLOCK_R]
            dv += tl.sum(p[:, None] * dorow, 0)
            ds = p * (tl.sum(dorow * v[None, :], 1) - delta)
            if HAS_SOFTCAP:
                ds = ds * (1.0 - th * th)
            dk += tl.sum(ds[:, None] * qrow, 0)
    tl.store(DK + ((b * NK + t) * HKV + kvh) * HEAD_DIM + d, (dk * sm_scale).to(DK.dtype.element_ty), mask=d_ok)
    tl.store(DV + ((b * NK + t) * HKV + kvh) * HEAD_DIM_V + e, dv.to(DV.dtype.element_ty), mask=e_ok)


# ----------------------------------------------------------------------------- launchers

def _strides(**tensors):
    """stride_<name>b, stride_<name>n, stride_<name>h of (B, N, H, D) tensors, as kernel keywords."""
    return {f"stride_{name}{axis}": t.stride(i) for name, t in tensors.items() for i, axis in enumerate("bnh")}


def _slot_rows(slots, count):
    """The canonical rows' shape: rows per (batch, query) (Hkv, or 1 shared by the kv heads) and
    their width; the kernels index slots (B, Nq, rows, topk) and count (B, Nq, rows) from it."""
    B, Nq, rows, topk = slots.shape
    require_contiguous("indexed kernels", "slots", slots, (B, Nq, rows, topk))
    require_contiguous("indexed kernels", "count", count, (B, Nq, rows))
    return dict(SLOT_ROWS=rows, TOPK=topk)


def _shape(q, k, v):
    B, Nq, Hq, D = q.shape
    Nk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    return B, Nq, Hq, D, Nk, Hkv, Dv


@on_tensor_device
def indexed_forward(q, k, v, slots, count, call, *, block_table=None, physical=False, k_descale=None, v_descale=None):
    """(out (B, Nq, Hq, Dv) like q, row_max, row_sum float32 (B, Hq, Nq)) on canonical slots
    (indices.canonical_slots) under the AttentionCall (its sinks are the caller's). The serve
    door's caches: k, v page pools (num_pages, page_size, Hkv, D) with block_table (B, pages),
    the slots positions (or with `physical` pool rows page * page_size + offset); float8_e4m3fn
    rows with k_descale, v_descale (Hkv,)."""
    B, Nq, Hq, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    group = Hq // Hkv
    paged = block_table is not None or physical
    num_pages, page_size = (k.shape[0], k.shape[1]) if paged else (0, 0)
    Nk = num_pages * page_size if physical else (block_table.shape[1] * page_size if paged else k.shape[1])
    tiles = indexed_tiles(group, D, Dv, q.dtype, q.device)
    out = torch.empty(B, Nq, Hq, Dv, dtype=q.dtype, device=q.device)
    row_max = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
    row_sum = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
    dot_mode, precision = kernel_options(q.dtype, q.device)
    fp8 = fp8_mode(k)
    strides = _strides(q=q, k=k, v=v)
    k, v = fp8_operands(k, v, fp8)
    serve = {}
    if paged or fp8:
        serve = dict(BLOCK_TABLE=block_table, stride_btb=0 if block_table is None else block_table.stride(0),
                     NUM_PAGES=num_pages, K_DESCALE=k_descale, V_DESCALE=v_descale, PAGE_SIZE=page_size,
                     PHYSICAL=physical, KV_FP8=fp8)
    grid = (B * Nq * Hkv * triton.cdiv(group, tiles["BLOCK_H"]),)
    _indexed_fwd_kernel[grid](
        Q=q, K=k, V=v, O=out, ROW_MAX=row_max, ROW_SUM=row_sum, SLOTS=slots, COUNT=count,
        **strides, **_slot_rows(slots, count), NQ=Nq, NK=Nk, HQ=Hq, HKV=Hkv, GROUP=group,
        sm_scale=call.scale, HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=padded_head_dim(D), BLOCK_DV=padded_head_dim(Dv),
        BLOCK_H=tiles["BLOCK_H"], BLOCK_K=tiles["BLOCK_K"], DOT_MODE=dot_mode, PRECISION=precision,
        **call.kernel_args(), **serve, num_warps=tiles["num_warps"], num_stages=tiles["forward_stages"])
    return out, row_max, row_sum


@on_tensor_device
def indexed_backward(do, dlse, q, k, v, out, row_max, row_sum, slots, count, call):
    """(dq, dk, dv) like q, k, v: dQ per query (the forward's tiling), dK/dV per key over its
    inverse list (indices.query_lists), no atomics."""
    B, Nq, Hq, D, Nk, Hkv, Dv = _shape(q, k, v)
    group = Hq // Hkv
    tiles = indexed_tiles(group, D, Dv, q.dtype, q.device)
    for name, t in (("row_max", row_max), ("row_sum", row_sum)):
        require_contiguous("indexed_backward", name, t, (B, Hq, Nq))
    do = last_dim_contiguous(do)
    delta = softmax_delta(do, out, dlse)
    dot_mode, precision = kernel_options(q.dtype, q.device)
    common = dict(Q=q, K=k, V=v, DO=do, ROW_MAX=row_max, ROW_SUM=row_sum, DELTA=delta,
                  **_strides(q=q, k=k, v=v, do=do), NQ=Nq, NK=Nk, HQ=Hq, HKV=Hkv, GROUP=group, sm_scale=call.scale,
                  HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=padded_head_dim(D), BLOCK_DV=padded_head_dim(Dv),
                  BLOCK_H=tiles["BLOCK_H"], **call.kernel_args(), num_warps=tiles["num_warps"],
                  num_stages=tiles["num_stages"])
    dq = torch.empty(B, Nq, Hq, D, dtype=q.dtype, device=q.device)
    _indexed_bwd_dq_kernel[(B * Nq * Hkv * triton.cdiv(group, tiles["BLOCK_H"]),)](
        **common, DQ=dq, SLOTS=slots, COUNT=count, **_slot_rows(slots, count), BLOCK_K=tiles["BLOCK_K"],
        DOT_MODE=dot_mode, PRECISION=precision)
    start, queries = query_lists(slots, Nk)
    dk = torch.empty(B, Nk, Hkv, D, dtype=k.dtype, device=q.device)
    dv = torch.empty(B, Nk, Hkv, Dv, dtype=v.dtype, device=q.device)
    # no dot here: the head tile needs no padding to 16, and BLOCK_R is a multiple of it
    heads = min(tiles["BLOCK_R"], 1 << (group - 1).bit_length())
    _indexed_bwd_dkdv_kernel[(B * Hkv * Nk,)](
        **{**common, "BLOCK_H": heads}, DK=dk, DV=dv, Q_START=start, Q_LIST=queries, SLOT_ROWS=slots.shape[2],
        BLOCK_R=tiles["BLOCK_R"])
    return dq, dk, dv


# ----------------------------------------------------------------------------- the indexer

@triton.jit
def _indexer_scores_kernel(
        Q, K, W, SCORES, stride_qb, stride_qs, stride_qh, stride_kb, stride_kt, stride_wb, stride_ws, stride_wh,
        S, T, H, FIRST_POS, sm_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HH: tl.constexpr, BLOCK_T: tl.constexpr,
        CAUSAL: tl.constexpr, DOT_MODE: tl.constexpr, PRECISION: tl.constexpr):
    """SCORES[b, s, t] = sum_h W[b, s, h] * relu(sm_scale * Q[b, s, h] . K[b, t]) (DeepSeek's
    lightning indexer) for the BLOCK_T keys of a program, float32, -inf past the query's position
    FIRST_POS + s under CAUSAL. SCORES: contiguous (B, S, T), one chunk of queries."""
    pid = tl.program_id(0)
    n_t = tl.cdiv(T, BLOCK_T)
    tt = pid % n_t
    rest = (pid // n_t).to(tl.int64)
    s = rest % S
    b = rest // S
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    t = tt * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    k = tl.load(K + b * stride_kb + t.to(tl.int64)[:, None] * stride_kt + d[None, :],
                mask=t_ok[:, None] & d_ok[None, :], other=0.0)                           # [BLOCK_T, BLOCK_D]
    score = tl.zeros([BLOCK_T], tl.float32)
    for h0 in range(0, H, BLOCK_HH):
        h = h0 + tl.arange(0, BLOCK_HH)
        h_ok = h < H
        q = tl.load(Q + b * stride_qb + s * stride_qs + h[:, None] * stride_qh + d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)                       # [BLOCK_HH, BLOCK_D]
        w = tl.load(W + b * stride_wb + s * stride_ws + h * stride_wh, mask=h_ok, other=0.0).to(tl.float32)
        logits = tl.maximum(dot(q, tl.trans(k), DOT_MODE, PRECISION) * sm_scale, 0.0)   # [BLOCK_HH, BLOCK_T]
        score += tl.sum(w[:, None] * logits, 0)
    if CAUSAL:
        score = tl.where(t <= FIRST_POS + s, score, float("-inf"))
    tl.store(SCORES + (b * S + s) * T + t, score, mask=t_ok)


@on_tensor_device
def indexer_scores(q, k, weights, first_pos, scale, causal):
    """float32 (B, S, T) indexer scores of queries q (B, S, H, D) at positions first_pos + s
    against keys k (B, T, D), weights (B, S, H)."""
    B, S, H, D = q.shape
    T = k.shape[1]
    scores = torch.empty(B, S, T, dtype=torch.float32, device=q.device)
    tiles = indexer_tiles(H, q.device)
    dot_mode, precision = kernel_options(q.dtype, q.device)
    _indexer_scores_kernel[(B * S * triton.cdiv(T, tiles["BLOCK_T"]),)](
        Q=q, K=k, W=weights, SCORES=scores, stride_qb=q.stride(0), stride_qs=q.stride(1), stride_qh=q.stride(2),
        stride_kb=k.stride(0), stride_kt=k.stride(1), stride_wb=weights.stride(0), stride_ws=weights.stride(1),
        stride_wh=weights.stride(2), S=S, T=T, H=H, FIRST_POS=first_pos, sm_scale=scale, HEAD_DIM=D,
        BLOCK_D=padded_head_dim(D), CAUSAL=causal, DOT_MODE=dot_mode, PRECISION=precision, **tiles)
    return scores
