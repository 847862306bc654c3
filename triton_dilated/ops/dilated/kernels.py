"""Fused Triton dilated attention kernels and their launchers: one forward launch for all
patterns; backward in a dQ and a dK/dV kernel, no atomics. The public function, its
autograd and custom ops are in interface.py.

Design (the arithmetic behind it)
---------------------------------
Pattern (w, r) with offset o gives each head N/r active queries with about w/r keys:
N*w/r^2 (query, key) pairs and 4*D*N*w/r^2 forward FLOPs. For the LongNet schedule
w = (2048, ..., 32768), r = (1, 2, 4, 6, 12) that is 4,267 keys per query against 32,768
for dense attention at N = 32K, an ideal 7.7x.

A program owns a tile of BLOCK_M query rows `first + T*u` of one head inside one chunk
(no segment boundary of any of the head's patterns crosses it); see plan.py. T, the tile
stride, is a multiple of the rates wherever that pays, so for each pattern the whole tile
is active or inactive together and every active pattern reads the *same* dilated keys
`s + o + r*i` (a strided view, row stride r*stride_n: loads stay coalesced per row). The
patterns then accumulate into one online softmax, which is exactly the paper's
denominator-weighted mix (the softmax over the multiset union of the patterns' keys):
no per-pattern partial, no scratch, no merge pass; O is written once.

Bytes: Q and O move once (2*N*H*D*b), K/V once per (tile, pattern) that reads them. FLOPs
computed / FLOPs of the pattern = planner efficiency: 0.89 (BLOCK_M 64) for the LongNet
schedule non-causal at N = 32K, about 0.70 causal (the diagonal of a strided tile spans
T*BLOCK_M positions). Inside a pattern, key blocks that need no mask (all keys valid,
and before the tile's first row when causal) run without any element mask.

Backward: dQ mirrors the forward tiling (P recomputed from the saved row max and
denominator). dK/dV: a
program owns a key tile of one key/value head (same planner, key side) and loops over
the query heads of its GQA group and their patterns; the queries that read a key are the
same residue rows of the same segment, so dK/dV are summed in registers and written
once: deterministic, no atomics. A gradient on lse enters through
delta = rowsum(dO * O) - dlse.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...configs import select_config
from ..common.hardware import padded_head_dim
from ..common.kernels import dot, finalize, load_key_block, load_row_stats, online_softmax_step, softmax_grad_block
from ..common.lse import softmax_delta
from ..common.runtime import kernel_options, last_dim_contiguous, on_tensor_device
from .plan import build_items, key_unit_triples, query_unit_triples


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _key_range(first_row, last_row, seg, seg_end, r, o, uniform_active, CAUSAL: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """For a query tile: keys s + o + r*t, t < key_end (causal: up to the last row);
    t < full_end need no element mask (multiple of BLOCK_N)."""
    n_keys = tl.maximum((seg_end - seg - o + r - 1) // r, 0)
    key_end = n_keys
    full_end = n_keys
    if CAUSAL:
        key_end = tl.minimum(n_keys, tl.maximum((last_row - seg - o) // r + 1, 0))
        full_end = tl.minimum(n_keys, tl.maximum((first_row - seg - o) // r + 1, 0))
    full_end = tl.where(uniform_active, (full_end // BLOCK_N) * BLOCK_N, 0)
    return key_end, full_end


@triton.jit
def _load_item(ITEMS, item):
    """Work item: first row, chunk end, unit (head), tile stride, document [start, end)."""
    base = ITEMS + item * 6
    # the head is int64: head * head-stride overflows int32 for long strided inputs
    return (tl.load(base), tl.load(base + 1), tl.load(base + 2).to(tl.int64), tl.load(base + 3), tl.load(base + 4),
            tl.load(base + 5))


@triton.jit
def _segment(first_row, w, doc_start, doc_end):
    """[start, end) of the segment of length w holding first_row; segments restart at each
    document (packed variable-length sequences; one document = the whole sequence)."""
    seg = doc_start + ((first_row - doc_start) // w) * w
    return seg, tl.minimum(seg + w, doc_end)


@triton.jit
def _dilated_fwd_kernel(
        Q, K, V, O, ROW_MAX, ROW_SUM, ITEMS, PAT_W, PAT_R, PAT_OFF,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
        stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh, stride_lb, stride_lh,
        NUM_ITEMS, HEAD_GROUP, sm_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_PATTERNS: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    item = tl.program_id(0) % NUM_ITEMS   # one flat grid axis over (batch, item): a second caps at 65,535
    b = (tl.program_id(0) // NUM_ITEMS).to(tl.int64)
    first_row, chunk_end, h, T, doc_start, doc_end = _load_item(ITEMS, item)
    kvh = h // HEAD_GROUP

    u = tl.arange(0, BLOCK_M)
    rows = first_row + T * u
    row_ok = rows < chunk_end
    last_row = first_row + T * (tl.minimum(BLOCK_M, (chunk_end - first_row + T - 1) // T) - 1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q = tl.load(Q + b * stride_qb + h * stride_qh + rows.to(tl.int64)[:, None] * stride_qn + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh + d[None, :]
    v_base = V + b * stride_vb + kvh * stride_vh + d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for i in range(NUM_PATTERNS):   # not unrolled: pattern parameters are runtime loads
        o = tl.load(PAT_OFF + h * NUM_PATTERNS + i)
        if o >= 0:
            w = tl.load(PAT_W + i)
            r = tl.load(PAT_R + i)
            seg, seg_end = _segment(first_row, w, doc_start, doc_end)
            row_active = row_ok & ((rows - seg) % r == o)
            # T % r == 0: every row has the residue of the first row (all on or all off)
            uniform_active = ((T % r) == 0) & ((first_row - seg) % r == o)
            uniform_idle = ((T % r) == 0) & ((first_row - seg) % r != o)
            key_end, full_end = _key_range(first_row, last_row, seg, seg_end, r, o, uniform_active,
                                           CAUSAL, BLOCK_N)
            key_end = tl.where(uniform_idle, 0, key_end)
            key0 = seg + o
            for t0 in range(0, full_end, BLOCK_N):
                k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, key0, r, t0, key_end, rows, row_ok,
                                        d_ok, CAUSAL, False, BLOCK_N)
                acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, sm_scale, mask,
                                                    False, DOT_FP32, PRECISION)
            for t0 in range(full_end, key_end, BLOCK_N):
                k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, key0, r, t0, key_end, rows, row_active,
                                        d_ok, CAUSAL, True, BLOCK_N)
                acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, sm_scale, mask,
                                                    True, DOT_FP32, PRECISION)
    out = finalize(acc, m_i, l_i)
    tl.store(O + b * stride_ob + h * stride_oh + rows.to(tl.int64)[:, None] * stride_on + d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    # row statistics (max score, denominator); lse = max + ln(denominator)
    tl.store(ROW_MAX + b * stride_lb + h * stride_lh + rows, m_i, mask=row_ok)
    tl.store(ROW_SUM + b * stride_lb + h * stride_lh + rows, l_i, mask=row_ok)


@triton.jit
def _dilated_bwd_dq_kernel(
        Q, K, V, DO, ROW_MAX, ROW_SUM, DELTA, DQ, ITEMS, PAT_W, PAT_R, PAT_OFF,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
        stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
        stride_dqb, stride_dqn, stride_dqh, stride_lb, stride_lh,
        NUM_ITEMS, HEAD_GROUP, sm_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_PATTERNS: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    item = tl.program_id(0) % NUM_ITEMS   # one flat grid axis over (batch, item): a second caps at 65,535
    b = (tl.program_id(0) // NUM_ITEMS).to(tl.int64)
    first_row, chunk_end, h, T, doc_start, doc_end = _load_item(ITEMS, item)
    kvh = h // HEAD_GROUP

    u = tl.arange(0, BLOCK_M)
    rows = first_row + T * u
    row_ok = rows < chunk_end
    last_row = first_row + T * (tl.minimum(BLOCK_M, (chunk_end - first_row + T - 1) // T) - 1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rows64 = rows.to(tl.int64)
    tile_mask = row_ok[:, None] & d_ok[None, :]

    q = tl.load(Q + b * stride_qb + h * stride_qh + rows64[:, None] * stride_qn + d[None, :], mask=tile_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows64[:, None] * stride_don + d[None, :], mask=tile_mask, other=0.0)
    row_max, row_log2l = load_row_stats(ROW_MAX, ROW_SUM, b * stride_lb + h * stride_lh + rows, row_ok)
    delta = tl.load(DELTA + b * stride_lb + h * stride_lh + rows, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh + d[None, :]
    v_base = V + b * stride_vb + kvh * stride_vh + d[None, :]

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for i in range(NUM_PATTERNS):   # not unrolled: pattern parameters are runtime loads
        o = tl.load(PAT_OFF + h * NUM_PATTERNS + i)
        if o >= 0:
            w = tl.load(PAT_W + i)
            r = tl.load(PAT_R + i)
            seg, seg_end = _segment(first_row, w, doc_start, doc_end)
            row_active = row_ok & ((rows - seg) % r == o)
            uniform_active = ((T % r) == 0) & ((first_row - seg) % r == o)
            uniform_idle = ((T % r) == 0) & ((first_row - seg) % r != o)
            key_end, full_end = _key_range(first_row, last_row, seg, seg_end, r, o, uniform_active,
                                           CAUSAL, BLOCK_N)
            key_end = tl.where(uniform_idle, 0, key_end)
            key0 = seg + o
            for t0 in range(0, full_end, BLOCK_N):
                k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, key0, r, t0, key_end, rows, row_ok,
                                        d_ok, CAUSAL, False, BLOCK_N)
                p, ds = softmax_grad_block(q, k, v, do, row_max, row_log2l, delta, sm_scale, mask,
                                           False, DOT_FP32, PRECISION)
                dq += dot(ds.to(k.dtype), k, DOT_FP32, PRECISION)
            for t0 in range(full_end, key_end, BLOCK_N):
                k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, key0, r, t0, key_end, rows, row_active,
                                        d_ok, CAUSAL, True, BLOCK_N)
                p, ds = softmax_grad_block(q, k, v, do, row_max, row_log2l, delta, sm_scale, mask,
                                           True, DOT_FP32, PRECISION)
                dq += dot(ds.to(k.dtype), k, DOT_FP32, PRECISION)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows64[:, None] * stride_dqn + d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=tile_mask)


@triton.jit
def _dilated_bwd_dkdv_kernel(
        Q, K, V, DO, ROW_MAX, ROW_SUM, DELTA, DK, DV, ITEMS, PAT_W, PAT_R, PAT_OFF,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
        stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
        stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_lb, stride_lh,
        NUM_ITEMS, HEAD_GROUP, sm_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_PATTERNS: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    # BLOCK_N: the key tile this program owns; BLOCK_M: the query blocks it walks.
    item = tl.program_id(0) % NUM_ITEMS   # one flat grid axis over (batch, item): a second caps at 65,535
    b = (tl.program_id(0) // NUM_ITEMS).to(tl.int64)
    first_key, chunk_end, kvh, T, doc_start, doc_end = _load_item(ITEMS, item)

    u = tl.arange(0, BLOCK_N)
    keys = first_key + T * u
    key_ok = keys < chunk_end
    last_key = first_key + T * (tl.minimum(BLOCK_N, (chunk_end - first_key + T - 1) // T) - 1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    t_off = tl.arange(0, BLOCK_M)
    keys64 = keys.to(tl.int64)
    tile_mask = key_ok[:, None] & d_ok[None, :]

    k = tl.load(K + b * stride_kb + kvh * stride_kh + keys64[:, None] * stride_kn + d[None, :], mask=tile_mask, other=0.0)
    v = tl.load(V + b * stride_vb + kvh * stride_vh + keys64[:, None] * stride_vn + d[None, :], mask=tile_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for h in range(kvh * HEAD_GROUP, (kvh + 1) * HEAD_GROUP):
        q_base = Q + b * stride_qb + h * stride_qh + d[None, :]
        do_base = DO + b * stride_dob + h * stride_doh + d[None, :]
        stats_off = b * stride_lb + h * stride_lh
        for i in range(NUM_PATTERNS):   # not unrolled: pattern parameters are runtime loads
            o = tl.load(PAT_OFF + h * NUM_PATTERNS + i)
            if o >= 0:
                w = tl.load(PAT_W + i)
                r = tl.load(PAT_R + i)
                seg, seg_end = _segment(first_key, w, doc_start, doc_end)
                key_active = key_ok & ((keys - seg) % r == o)
                uniform_active = ((T % r) == 0) & ((first_key - seg) % r == o)
                uniform_idle = ((T % r) == 0) & ((first_key - seg) % r != o)
                n_q = tl.maximum((seg_end - seg - o + r - 1) // r, 0)
                n_q = tl.where(uniform_idle, 0, n_q)
                # queries s + o + r*t; causal: from the first key on, and without a mask
                # once past the last key of the tile.
                q_begin = 0
                full_begin = 0
                if CAUSAL:
                    q_begin = tl.minimum(tl.maximum((first_key - seg - o + r - 1) // r, 0), n_q)
                    full_begin = tl.minimum(tl.maximum((last_key - seg - o + r - 1) // r, 0), n_q)
                q_begin = (q_begin // BLOCK_M) * BLOCK_M
                # masked blocks up to full_lo, unmasked [full_lo, full_hi), masked tail
                full_lo = tl.where(uniform_active, q_begin + ((full_begin - q_begin + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, n_q)
                full_lo = tl.minimum(full_lo, n_q)
                full_hi = tl.where(uniform_active, full_lo + ((n_q - full_lo) // BLOCK_M) * BLOCK_M, n_q)
                query0 = seg + o
                for t0 in range(q_begin, full_lo, BLOCK_M):
                    dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, ROW_MAX, ROW_SUM, DELTA, stats_off, t0 + t_off,
                                         query0, r, n_q, keys, key_active, d_ok, stride_qn, stride_don,
                                         sm_scale, CAUSAL, True, DOT_FP32, PRECISION)
                for t0 in range(full_lo, full_hi, BLOCK_M):
                    dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, ROW_MAX, ROW_SUM, DELTA, stats_off, t0 + t_off,
                                         query0, r, n_q, keys, key_active, d_ok, stride_qn, stride_don,
                                         sm_scale, CAUSAL, False, DOT_FP32, PRECISION)
                for t0 in range(full_hi, n_q, BLOCK_M):
                    dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, ROW_MAX, ROW_SUM, DELTA, stats_off, t0 + t_off,
                                         query0, r, n_q, keys, key_active, d_ok, stride_qn, stride_don,
                                         sm_scale, CAUSAL, True, DOT_FP32, PRECISION)
    tl.store(DK + b * stride_dkb + kvh * stride_dkh + keys64[:, None] * stride_dkn + d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=tile_mask)
    tl.store(DV + b * stride_dvb + kvh * stride_dvh + keys64[:, None] * stride_dvn + d[None, :],
             dv.to(DV.dtype.element_ty), mask=tile_mask)


@triton.jit
def _dkdv_block(dk, dv, k, v, q_base, do_base, ROW_MAX, ROW_SUM, DELTA, stats_off, t, query0, r, n_q, keys, key_active,
                d_ok, stride_qn, stride_don, sm_scale, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Add one block of dilated queries (positions query0 + r*t) to the key tile's dK, dV."""
    qpos = query0 + r * t
    q_ok = t < n_q
    qpos64 = qpos.to(tl.int64)
    q = tl.load(q_base + qpos64[:, None] * stride_qn, mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(do_base + qpos64[:, None] * stride_don, mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    row_max, row_log2l = load_row_stats(ROW_MAX, ROW_SUM, stats_off + qpos, q_ok)
    delta = tl.load(DELTA + stats_off + qpos, mask=q_ok, other=0.0)
    mask = q_ok[:, None] & key_active[None, :]
    if CAUSAL:
        mask = mask & (keys[None, :] <= qpos[:, None])
    p, ds = softmax_grad_block(q, k, v, do, row_max, row_log2l, delta, sm_scale, mask, HAS_MASK,
                               DOT_FP32, PRECISION)
    dv += dot(tl.trans(p.to(do.dtype)), do, DOT_FP32, PRECISION)
    dk += dot(tl.trans(ds.to(q.dtype)), q, DOT_FP32, PRECISION)
    return dk, dv


# ----------------------------------------------------------------------------- launchers

@functools.lru_cache(maxsize=128)
def _device_plan(n, patterns, table, num_kv_heads, causal, block, block_inner, keys_side, device, doc_bounds=None):
    """Items and pattern tables as device tensors, cached per shape (and documents)."""
    units = key_unit_triples(patterns, table, num_kv_heads) if keys_side else query_unit_triples(patterns, table)
    items, full = build_items(n, units, block, block_inner, causal, keys_side, doc_bounds)
    as_dev = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return (torch.from_numpy(items).to(device), full, as_dev([w for w, _ in patterns]),
            as_dev([r for _, r in patterns]), as_dev(table).reshape(-1))


@on_tensor_device
def dilated_forward(q, k, v, patterns, table, *, causal, scale, config=None, doc_bounds=None):
    """Launch the fused forward. Returns out (like q, contiguous) and the row statistics
    (row_max, row_sum), float32 (B, Hq, N) each; see lse_from_stats."""
    B, N, Hq, D = q.shape
    Hkv = k.shape[2]
    block_d = padded_head_dim(D)
    cfg = config or select_config("dilated_fwd", q.dtype, block_d, N, q.device)
    items, full, pat_w, pat_r, pat_off = _device_plan(N, patterns, table, Hkv, causal, cfg["BLOCK_M"],
                                                      cfg["BLOCK_N"], False, q.device, doc_bounds)
    alloc = torch.empty if full else torch.zeros   # rows no tile covers: 0 output, l = 0
    out = alloc(B, N, Hq, D, dtype=q.dtype, device=q.device)
    row_max = alloc(B, Hq, N, dtype=torch.float32, device=q.device)
    row_sum = alloc(B, Hq, N, dtype=torch.float32, device=q.device)
    if items.shape[0] == 0:
        return out, row_max, row_sum
    dot_fp32, precision = kernel_options(q.dtype, q.device)
    _dilated_fwd_kernel[(items.shape[0] * B,)](
        q, k, v, out, row_max, row_sum, items, pat_w, pat_r, pat_off,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        row_max.stride(0), row_max.stride(1),
        items.shape[0], Hq // Hkv, scale,
        HEAD_DIM=D, BLOCK_D=block_d, NUM_PATTERNS=len(patterns), CAUSAL=causal,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], DOT_FP32=dot_fp32, PRECISION=precision,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2))
    return out, row_max, row_sum


@on_tensor_device
def dilated_backward(do, dlse, q, k, v, out, row_max, row_sum, patterns, table, *, causal, scale,
                     config=None, doc_bounds=None):
    """dQ, dK, dV for dO (like out) and an optional dlse (B, Hq, N)."""
    B, N, Hq, D = q.shape
    Hkv = k.shape[2]
    block_d = padded_head_dim(D)
    cfg = config or select_config("dilated_bwd", q.dtype, block_d, N, q.device)
    do = last_dim_contiguous(do)
    delta = softmax_delta(do, out, dlse)
    dot_fp32, precision = kernel_options(q.dtype, q.device)
    common = dict(HEAD_DIM=D, BLOCK_D=block_d, NUM_PATTERNS=len(patterns), CAUSAL=causal,
                  BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], DOT_FP32=dot_fp32, PRECISION=precision,
                  num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2))
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))

    items, full, pat_w, pat_r, pat_off = _device_plan(N, patterns, table, Hkv, causal, cfg["BLOCK_M"],
                                                      cfg["BLOCK_N"], False, q.device, doc_bounds)
    dq = (torch.empty if full else torch.zeros)(B, N, Hq, D, dtype=q.dtype, device=q.device)
    if items.shape[0]:
        _dilated_bwd_dq_kernel[(items.shape[0] * B,)](
            q, k, v, do, row_max, row_sum, delta, dq, items, pat_w, pat_r, pat_off, *strides,
            dq.stride(0), dq.stride(1), dq.stride(2), row_max.stride(0), row_max.stride(1),
            items.shape[0], Hq // Hkv, scale, **common)

    # key side: tiles of BLOCK_N keys, walking query blocks of BLOCK_M
    items, full, pat_w, pat_r, pat_off = _device_plan(N, patterns, table, Hkv, causal, cfg["BLOCK_N"],
                                                      cfg["BLOCK_M"], True, q.device, doc_bounds)
    alloc = torch.empty if full else torch.zeros
    dk = alloc(B, N, Hkv, D, dtype=k.dtype, device=q.device)
    dv = alloc(B, N, Hkv, D, dtype=v.dtype, device=q.device)
    if items.shape[0]:
        _dilated_bwd_dkdv_kernel[(items.shape[0] * B,)](
            q, k, v, do, row_max, row_sum, delta, dk, dv, items, pat_w, pat_r, pat_off, *strides,
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            row_max.stride(0), row_max.stride(1),
            items.shape[0], Hq // Hkv, scale, **common)
    return dq, dk, dv
