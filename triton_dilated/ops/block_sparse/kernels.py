"""Triton block-sparse attention kernels and their launchers: forward and dQ walk each query
tile's kv block list, dK/dV walk each key tile's transposed q block list (deterministic, no
atomics). The public function and its autograd are in interface.py.

A program owns BLOCK_M query rows (BLOCK_M divides the layout block size) and, for each
active key block of its layout row, streams the block in BLOCK_N sub-tiles through the
shared online softmax. Element masks run only where they matter: the causal diagonal
block and the ragged last key block (N not a multiple of the block size); key blocks
above the diagonal are skipped when causal. The lists are ascending, so the blocks that
need a mask are the end of a query block's key list (the start of a key block's query
list): the launchers count, per list, where the unmasked part ends, and the kernels walk
it as one flat loop of sub-tiles with unconditional loads (software-pipelined: cp.async
into rotating buffers), then the few masked blocks in a second loop. Layouts broadcast over batch and heads by
zero strides. GQA: query head h reads key/value head h // (Hq // Hkv); the dK/dV program
of a key/value head loops over its query heads. The dK/dV program owns BLOCK_M keys instead,
the M dimension of its dots (S^T = K Q^T), and walks BLOCK_N query sub-tiles.

Experimental (issue 12): a forward config with "TMA": 1 reads the K and V sub-tiles through
host-side tensor descriptors (TMA copies on sm90) instead of pointer loads, with the same
loops and the same bits; `perf tune` is to time it against "TMA": 0 (the default). Where
TMA cannot read the inputs (before sm90, misaligned strides or base: tma_usable) the
launcher uses the pointer loads. "WARP_SPEC": 1 (issue 20; archs where Triton
warp-specializes, sm100) also marks the full-block loop tl.range(..., warp_specialize=True)
on those descriptor loads: the compiler splits it into TMA-load, MMA and softmax warp groups
(`perf aot --kernels block_sparse_fwd_ws`: columns ws_partitions, setmaxnreg).

Work: 4*D*(active pairs) forward FLOPs; K/V bytes move once per (query tile, active
block), Q and O once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.configs import VARIANT_SWITCHES, select_config, switch_value
from ..common.hardware import device_arch, padded_head_dim
from ..common.kernels import (bnhd_offset, dot, finalize, load_key_block, load_row_stats, online_softmax_step,
                              program_tile, softcap_terms, softmax_grad_block, transposed_grad_step, window_keep)
from ..common.lse import softmax_delta
from ..common.runtime import (kernel_options, last_dim_contiguous, on_tensor_device, require_contiguous,
                              window_args)
from ..common.masks import check_window_causal


# Q, K, V and dO may come with any strides (unit stride on the head dim): their (batch,
# sequence, head) strides are arguments. O, dQ, dK, dV (B, N, heads, HEAD_DIM) and the row
# statistics ROW_MAX, ROW_SUM, DELTA (B, HQ, N) are contiguous and indexed from their shapes.
# The block lists are contiguous but for their batch and head strides, 0 where one layout serves
# every batch or head: per list (LB, LH, rows) its entries INDEX (LB, LH, rows, WIDTH) and its
# bounds, where its parts end (KV_BOUNDS (LB, LH, rows, 3): full, window, end; Q_BOUNDS
# (LB, LH, rows, 4): skip, full, window, count; _forward_lists, _backward_lists). stride_cb,
# stride_ch: the batch and head strides of a (LB, LH, rows) list, in lists.

@triton.jit
def _window_bounds(bounds, first_row, window):
    """Sliding windows (HAS_WINDOW): where a query block's window entries start in its
    reordered key list (full, masked, then window blocks: _window_key_lists; `bounds`: the
    list's, _key_list), and the first key any row of the tile from first_row on can see in a
    window block (no sink tokens there)."""
    return tl.load(bounds + 1), first_row - window + 1


@triton.jit
def _window_start(start, use_window, lowest, sink_tokens, HAS_SINK_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where to start walking a masked key block: a window block whose keys are not sink
    tokens from the sub-tile of the lowest key the tile's rows see (the keys before it would
    be masked for every row). Aligned to BLOCK_N: starting at the key itself keeps a NaN
    below it from reaching the tile, but made sm80's dQ at D = 64 spill 24 B (perf aot)."""
    skip = use_window
    if HAS_SINK_TOKENS:   # (without sink tokens every start >= 0 passes)
        skip = skip & (start >= sink_tokens)
    return tl.where(skip, tl.maximum(start, (lowest // BLOCK_N) * BLOCK_N), start)


@triton.jit
def _key_list(KV_BOUNDS, KV_INDEX, b, h, qblock, stride_cb, stride_ch, WIDTH):
    """A query block's key-block list: (n_full, n_end, first entry, its bounds). Entries
    [0, n_full) need no element mask, [n_full, n_end) do (the causal diagonal, a short last
    block)."""
    lists = b * stride_cb + h * stride_ch + qblock   # int64 (b, h)
    bounds = KV_BOUNDS + lists * 3
    return tl.load(bounds), tl.load(bounds + 2), KV_INDEX + lists * WIDTH, bounds


@triton.jit
def _tma_key_block(K_DESC, V_DESC, b, kvh, n0, key_end, rows, row_ok, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """load_key_block (r = 1, t0 = 0) through tensor descriptors over (B, Hkv, N, D) views of K
    and V (TMA on sm90): keys n0 .. n0 + BLOCK_N of head kvh. The copy fills rows past N and
    columns past the head dim with zeros, as the pointer path's masked loads do. Inside N, a
    causal diagonal block ends before the sub-tile does (keys after the tile's last row): the
    mask drops their scores, and their v rows are zeroed as the pointer path loads them
    (p = 0 times a NaN/Inf value would be NaN), so both paths give the same bits."""
    at = [b.to(tl.int32), kvh.to(tl.int32), n0, 0]    # descriptor coordinates are int32 (b, kvh < 2^31)
    k = K_DESC.load(at).reshape(BLOCK_N, BLOCK_D)
    v = V_DESC.load(at).reshape(BLOCK_N, BLOCK_D)
    t = tl.arange(0, BLOCK_N)
    if HAS_MASK:
        key_ok = t < key_end
        mask = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            mask = mask & ((n0 + t)[None, :] <= rows[:, None])
            v = tl.where(key_ok[:, None], v, 0.0)
    else:
        mask = row_ok[:, None] & (t >= 0)[None, :]   # (BLOCK_M, BLOCK_N), as load_key_block's
    return k, v, mask


@triton.jit(do_not_specialize=["window", "sink_tokens"])   # one compile for every window and sink count
def _block_sparse_fwd_kernel(
        Q, K, V, K_DESC, V_DESC, O, ROW_MAX, ROW_SUM, KV_BOUNDS, KV_INDEX, stride_cb, stride_ch, WIDTH,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        N, HQ, HEAD_GROUP, sm_scale, softcap,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr, PRECISION: tl.constexpr,
        TMA: tl.constexpr, WARP_SPEC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, window=None,
        sink_tokens=None, HAS_WINDOW: tl.constexpr = False, HAS_SINK_TOKENS: tl.constexpr = False):
    tile, b, h = program_tile(tl.cdiv(N, BLOCK_M), HQ)
    cap = softcap_terms(softcap, HAS_SOFTCAP)
    kvh = h // HEAD_GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    qblock = (tile * BLOCK_M) // BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rows64 = rows.to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + kvh * stride_kh
    V += b * stride_vb + kvh * stride_vh

    q = tl.load(Q + rows64[:, None] * stride_qn + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)                                                               # [BLOCK_M, BLOCK_D]
    k_base = K + d[None, :]
    v_base = V + d[None, :]
    n_full, n_end, index_base, bounds = _key_list(KV_BOUNDS, KV_INDEX, b, h, qblock, stride_cb, stride_ch, WIDTH)
    last_row = tl.minimum(tile * BLOCK_M + BLOCK_M, N) - 1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # the full blocks (no element mask), as one flat loop of BLOCK_N sub-tiles with
    # unconditional loads: the compiler software-pipelines it
    subs = BLOCK_SIZE // BLOCK_N   # sub-tiles of a block
    # WARP_SPEC (with TMA): the compiler splits this loop into TMA-load, MMA and softmax
    # partitions (warp groups with their own register budgets, setmaxnreg)
    for it in tl.range(0, n_full * subs, warp_specialize=WARP_SPEC):
        n0 = tl.load(index_base + it // subs) * BLOCK_SIZE + (it % subs) * BLOCK_N
        if TMA:
            k, v, mask = _tma_key_block(K_DESC, V_DESC, b, kvh, n0, BLOCK_N, rows, row_ok, CAUSAL, False, BLOCK_N,
                                        BLOCK_D)
        else:
            k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, n0, 1, 0, BLOCK_N, rows, row_ok, d_ok,
                                        CAUSAL, False, BLOCK_N)
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, sm_scale, mask, False, DOT_MODE, PRECISION,
                                            cap=cap, HAS_SOFTCAP=HAS_SOFTCAP)
    # then the masked ones (the causal diagonal, the ragged last block): the end of the list;
    # with a sliding window (HAS_WINDOW) the window blocks [n_win, n_end) last, predicate per element
    if HAS_WINDOW:
        n_win, lowest = _window_bounds(bounds, tile * BLOCK_M, window)
    for j in range(n_full, n_end):
        start = tl.load(index_base + j) * BLOCK_SIZE
        end = tl.minimum(start + BLOCK_SIZE, N)
        if CAUSAL:
            end = tl.minimum(end, last_row + 1)     # keys after the tile's last row: skipped
        if HAS_WINDOW:
            start = _window_start(start, j >= n_win, lowest, sink_tokens, HAS_SINK_TOKENS, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            if TMA:
                k, v, mask = _tma_key_block(K_DESC, V_DESC, b, kvh, n0, end - n0, rows, row_ok, CAUSAL, True,
                                            BLOCK_N, BLOCK_D)
            else:
                k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, n0, 1, 0, end - n0, rows, row_ok,
                                            d_ok, CAUSAL, True, BLOCK_N)
            if HAS_WINDOW:
                mask = mask & (window_keep(rows[:, None], (n0 + tl.arange(0, BLOCK_N))[None, :], window,
                                           sink_tokens, HAS_SINK_TOKENS) | (j < n_win))
            acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, sm_scale, mask, True, DOT_MODE, PRECISION,
                                                cap=cap, HAS_SOFTCAP=HAS_SOFTCAP)
    out, row_max, row_sum = finalize(acc, m_i, l_i, q)                                  # [BLOCK_M, BLOCK_D]
    O += (b * N * HQ + h) * HEAD_DIM
    tl.store(O + rows64[:, None] * (HQ * HEAD_DIM) + d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    ROW_MAX += b * N * HQ + h * N
    ROW_SUM += b * N * HQ + h * N
    tl.store(ROW_MAX + rows, row_max, mask=row_ok)
    tl.store(ROW_SUM + rows, row_sum, mask=row_ok)


@triton.jit(do_not_specialize=["window", "sink_tokens"])
def _block_sparse_bwd_dq_kernel(
        Q, K, V, DO, ROW_MAX, ROW_SUM, DELTA, DQ, KV_BOUNDS, KV_INDEX, stride_cb, stride_ch, WIDTH,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_dob, stride_don, stride_doh,
        N, HQ, HEAD_GROUP, sm_scale, softcap,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr, PRECISION: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, window=None, sink_tokens=None, HAS_WINDOW: tl.constexpr = False,
        HAS_SINK_TOKENS: tl.constexpr = False):
    tile, b, h = program_tile(tl.cdiv(N, BLOCK_M), HQ)
    cap = softcap_terms(softcap, HAS_SOFTCAP)
    kvh = h // HEAD_GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    qblock = (tile * BLOCK_M) // BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rows64 = rows.to(tl.int64)
    tile_mask = row_ok[:, None] & d_ok[None, :]                                              # [BLOCK_M, BLOCK_D]
    Q += b * stride_qb + h * stride_qh
    DO += b * stride_dob + h * stride_doh

    q = tl.load(Q + rows64[:, None] * stride_qn + d[None, :], mask=tile_mask, other=0.0)       # [BLOCK_M, BLOCK_D]
    do = tl.load(DO + rows64[:, None] * stride_don + d[None, :], mask=tile_mask, other=0.0)   # [BLOCK_M, BLOCK_D]
    stats = (b * HQ + h) * N   # the head's rows of ROW_MAX, ROW_SUM, DELTA
    row_max, row_log2l = load_row_stats(ROW_MAX, ROW_SUM, stats + rows, row_ok)              # [BLOCK_M]
    delta = tl.load(DELTA + stats + rows, mask=row_ok, other=0.0)                            # [BLOCK_M]
    K += b * stride_kb + kvh * stride_kh
    V += b * stride_vb + kvh * stride_vh
    k_base = K + d[None, :]
    v_base = V + d[None, :]
    n_full, n_end, index_base, bounds = _key_list(KV_BOUNDS, KV_INDEX, b, h, qblock, stride_cb, stride_ch, WIDTH)
    last_row = tl.minimum(tile * BLOCK_M + BLOCK_M, N) - 1

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    subs = BLOCK_SIZE // BLOCK_N   # sub-tiles of a block
    for it in range(0, n_full * subs):   # full blocks: one flat, pipelinable loop
        n0 = tl.load(index_base + it // subs) * BLOCK_SIZE + (it % subs) * BLOCK_N
        k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, n0, 1, 0, BLOCK_N, rows, row_ok, d_ok,
                                    CAUSAL, False, BLOCK_N)
        p, ds = softmax_grad_block(q, k, v, do, row_max, row_log2l, delta, sm_scale, mask, False, DOT_MODE,
                                   PRECISION, cap=cap, HAS_SOFTCAP=HAS_SOFTCAP)          # [BLOCK_M, BLOCK_N]
        dq += dot(ds.to(k.dtype), k, DOT_MODE, PRECISION)
    if HAS_WINDOW:   # the window blocks [n_win, n_end) last (as in the forward)
        n_win, lowest = _window_bounds(bounds, tile * BLOCK_M, window)
    for j in range(n_full, n_end):       # masked blocks: the end of the list
        start = tl.load(index_base + j) * BLOCK_SIZE
        end = tl.minimum(start + BLOCK_SIZE, N)
        if CAUSAL:
            end = tl.minimum(end, last_row + 1)
        if HAS_WINDOW:
            start = _window_start(start, j >= n_win, lowest, sink_tokens, HAS_SINK_TOKENS, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, n0, 1, 0, end - n0, rows, row_ok,
                                        d_ok, CAUSAL, True, BLOCK_N)
            if HAS_WINDOW:
                mask = mask & (window_keep(rows[:, None], (n0 + tl.arange(0, BLOCK_N))[None, :], window,
                                           sink_tokens, HAS_SINK_TOKENS) | (j < n_win))
            p, ds = softmax_grad_block(q, k, v, do, row_max, row_log2l, delta, sm_scale, mask, True, DOT_MODE,
                                       PRECISION, cap=cap, HAS_SOFTCAP=HAS_SOFTCAP)
            dq += dot(ds.to(k.dtype), k, DOT_MODE, PRECISION)
    DQ += bnhd_offset(b, h, N, HQ, HEAD_DIM)
    tl.store(DQ + rows64[:, None] * (HQ * HEAD_DIM) + d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=tile_mask)


@triton.jit
def _dkdv_step(dk, dv, k, v, keys, q_base, do_base, ROW_MAX, ROW_SUM, DELTA, stats, m0, N, stride_qn, stride_don,
               sm_scale, d, d_ok, CAUSAL_MASK: tl.constexpr, BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr,
               PRECISION: tl.constexpr, cap, HAS_SOFTCAP: tl.constexpr, window=0, sink_tokens=0,
               HAS_WINDOW: tl.constexpr = False, HAS_SINK_TOKENS: tl.constexpr = False):
    """Add the query rows [m0, m0 + BLOCK_N) to the key tile's (dk, dv) [BLOCK_M, BLOCK_D].
    Transposed scores: the key tile is the M dimension of every dot (S^T = K Q^T, dV += P^T dO,
    dP^T = V dO^T, dK += dS^T Q), so P^T and dS^T feed the next dots from registers and the
    query statistics broadcast along columns. Queries past N load as zero with empty
    statistics (P = 0); CAUSAL_MASK also drops keys after the query; HAS_WINDOW applies the
    sliding-window predicate (which includes the causal cut) instead."""
    qrows = m0 + tl.arange(0, BLOCK_N)                                                   # [BLOCK_N]
    q_ok = qrows < N
    qrows64 = qrows.to(tl.int64)
    qT = tl.load(q_base + qrows64[None, :] * stride_qn + d[:, None], mask=d_ok[:, None] & q_ok[None, :],
                 other=0.0)                                                              # [BLOCK_D, BLOCK_N]
    do = tl.load(do_base + qrows64[:, None] * stride_don + d[None, :], mask=q_ok[:, None] & d_ok[None, :],
                 other=0.0)                                                              # [BLOCK_N, BLOCK_D]
    rows_st = stats + qrows   # into ROW_MAX, ROW_SUM, DELTA
    row_max, row_log2l = load_row_stats(ROW_MAX, ROW_SUM, rows_st, q_ok)                 # [BLOCK_N]
    delta = tl.load(DELTA + rows_st, mask=q_ok, other=0.0)
    s_t = dot(k, qT, DOT_MODE, PRECISION) * sm_scale                                     # [BLOCK_M, BLOCK_N]
    if HAS_WINDOW:
        s_t = tl.where(window_keep(qrows[None, :], keys[:, None], window, sink_tokens, HAS_SINK_TOKENS), s_t,
                       float("-inf"))
    elif CAUSAL_MASK:
        s_t = tl.where(keys[:, None] <= qrows[None, :], s_t, float("-inf"))
    return transposed_grad_step(dk, dv, s_t, v, qT, do, row_max, row_log2l, delta, DOT_MODE, PRECISION, cap,
                                HAS_SOFTCAP)


@triton.jit(do_not_specialize=["window", "sink_tokens"])
def _block_sparse_bwd_dkdv_kernel(
        Q, K, V, DO, ROW_MAX, ROW_SUM, DELTA, DK, DV, Q_BOUNDS, Q_INDEX,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_dob, stride_don, stride_doh,
        stride_cb, stride_ch, WIDTH,
        N, HKV, HEAD_GROUP, sm_scale, softcap,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr, PRECISION: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, window=None, sink_tokens=None, HAS_WINDOW: tl.constexpr = False,
        HAS_SINK_TOKENS: tl.constexpr = False):
    # this program: BLOCK_M keys of one key/value head (the M dimension of every dot); walks
    # BLOCK_N query sub-tiles
    tile, b, kvh = program_tile(tl.cdiv(N, BLOCK_M), HKV)
    cap = softcap_terms(softcap, HAS_SOFTCAP)
    keys = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    key_ok = keys < N
    kblock = (tile * BLOCK_M) // BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    keys64 = keys.to(tl.int64)
    tile_mask = key_ok[:, None] & d_ok[None, :]                                           # [BLOCK_M, BLOCK_D]
    K += b * stride_kb + kvh * stride_kh
    V += b * stride_vb + kvh * stride_vh
    k = tl.load(K + keys64[:, None] * stride_kn + d[None, :], mask=tile_mask, other=0.0)    # [BLOCK_M, BLOCK_D]
    v = tl.load(V + keys64[:, None] * stride_vn + d[None, :], mask=tile_mask, other=0.0)    # [BLOCK_M, BLOCK_D]
    first_key = tile * BLOCK_M
    subs = BLOCK_SIZE // BLOCK_N   # query sub-tiles of a block
    dk = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    stats = (b * HKV + kvh) * HEAD_GROUP * N   # head h's rows of ROW_MAX, ROW_SUM, DELTA (B, HQ, N)
    for h in range(kvh * HEAD_GROUP, (kvh + 1) * HEAD_GROUP):
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        lists = b * stride_cb + h * stride_ch + kblock   # int64 (b, h)
        bounds = Q_BOUNDS + lists * 4
        n_skip = tl.load(bounds)
        n_full = tl.load(bounds + 1)
        count = tl.load(bounds + 3)
        index_base = Q_INDEX + lists * WIDTH   # this key block's list
        # the causal diagonal (entries [n_skip, n_full): the key block itself, at most one),
        # masked, from the query sub-tile of the first key on; then the full blocks below it,
        # whose loads are unconditional in one flat loop the compiler software-pipelines.
        # Queries past N load as zero with empty statistics (P = 0): no mask needed for them.
        diag_end = tl.where(n_full > n_skip, tl.minimum(kblock * BLOCK_SIZE + BLOCK_SIZE, N), 0)
        for m0 in range((first_key // BLOCK_N) * BLOCK_N, diag_end, BLOCK_N):
            dk, dv = _dkdv_step(dk, dv, k, v, keys, q_base, do_base, ROW_MAX, ROW_SUM, DELTA, stats, m0, N,
                                stride_qn, stride_don, sm_scale, d, d_ok, True, BLOCK_N, DOT_MODE, PRECISION, cap,
                                HAS_SOFTCAP)
        if HAS_WINDOW:   # sliding window: [n_full, n_win) unmasked, [n_win, count) the window blocks
            n_win = tl.load(bounds + 2)
        else:
            n_win = count
        for it in range(n_full * subs, n_win * subs):
            m0 = tl.load(index_base + it // subs) * BLOCK_SIZE + (it % subs) * BLOCK_N
            dk, dv = _dkdv_step(dk, dv, k, v, keys, q_base, do_base, ROW_MAX, ROW_SUM, DELTA, stats, m0, N,
                                stride_qn, stride_don, sm_scale, d, d_ok, False, BLOCK_N, DOT_MODE, PRECISION, cap,
                                HAS_SOFTCAP)
        if HAS_WINDOW:
            # a window block's queries from the tile's first key (earlier ones see none of its
            # keys) to the last one the band reaches (all of them when a key is a sink token)
            last_key = tl.minimum(first_key + BLOCK_M, N) - 1
            reach = last_key + window
            if HAS_SINK_TOKENS:
                reach = tl.where(first_key < sink_tokens, N, reach)
            for j in range(n_win, count):
                q0 = tl.load(index_base + j) * BLOCK_SIZE
                lo = tl.maximum(q0, (first_key // BLOCK_N) * BLOCK_N)
                hi = tl.minimum(tl.minimum(q0 + BLOCK_SIZE, N), reach)
                for m0 in range(lo, hi, BLOCK_N):
                    dk, dv = _dkdv_step(dk, dv, k, v, keys, q_base, do_base, ROW_MAX, ROW_SUM, DELTA, stats, m0,
                                        N, stride_qn, stride_don, sm_scale, d, d_ok, True, BLOCK_N, DOT_MODE,
                                        PRECISION, cap, HAS_SOFTCAP, window, sink_tokens, True, HAS_SINK_TOKENS)
        stats += N   # the next head's rows
    DK += (b * N * HKV + kvh) * HEAD_DIM
    DV += (b * N * HKV + kvh) * HEAD_DIM
    tl.store(DK + keys64[:, None] * (HKV * HEAD_DIM) + d[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
             mask=tile_mask)
    tl.store(DV + keys64[:, None] * (HKV * HEAD_DIM) + d[None, :], dv.to(DV.dtype.element_ty), mask=tile_mask)


# ----------------------------------------------------------------------------- launchers

def _strides(**tensors):
    """stride_<name>b, stride_<name>n, stride_<name>h of (B, N, H, D) tensors, as kernel keywords."""
    return {f"stride_{name}{axis}": t.stride(i) for name, t in tensors.items() for i, axis in enumerate("bnh")}


def _block_lists(indices, bounds, B, H):
    """(INDEX, BOUNDS, keywords) of block lists: the entries (LB, LH, rows, width) and, stacked
    per list into (LB, LH, rows, parts), their bounds ((LB, LH, rows) tensors: where each part of
    a list ends). LB, LH: B and H, or 1 where one layout serves every batch row or head (read
    through a zero stride)."""
    LB, LH, rows, width = indices.shape
    if LB not in (1, B) or LH not in (1, H):
        raise ValueError(f"block lists for {LB} batch rows and {LH} heads cannot serve {B} and {H}")
    bounds = torch.stack([x.to(torch.int32).expand(LB, LH, rows) for x in bounds], -1)   # contiguous
    return indices.contiguous(), bounds, dict(stride_cb=LH * rows if LB > 1 else 0, stride_ch=rows if LH > 1 else 0,
                                              WIDTH=width)


def _list_positions(counts, indices, limits):
    """For each list (ascending block indices, `counts` long), how many of its entries lie
    below each of `limits` (one (rows,) tensor per limit): where that part of the list ends.
    int32, shaped like counts (contiguous)."""
    rows, width = indices.shape[2], indices.shape[3]
    valid = torch.arange(width, device=indices.device) < counts.unsqueeze(-1)
    return [(valid & (indices < lim.view(1, 1, rows, 1))).sum(-1, dtype=torch.int32) for lim in limits]


def _key_lists(layout, N, causal):
    """(full, end) per query block: its key list is [0, full) blocks that need no element
    mask, then [full, end) the masked ones (the causal diagonal, the ragged last block);
    blocks above the diagonal (causal) come after end."""
    n, bs = layout.n_kv_blocks, layout.block_size
    r = torch.arange(layout.n_q_blocks, device=layout.kv_indices.device, dtype=torch.int32)
    full_lim = r if causal else torch.full_like(r, n)
    if N % bs:
        full_lim = full_lim.clamp(max=n - 1)
    limits = (full_lim, r + 1) if causal else (full_lim,)
    out = _list_positions(layout.kv_num_blocks, layout.kv_indices, limits)
    return out[0], (out[1] if causal else layout.kv_num_blocks.contiguous())


def _class_order(counts, indices, classes, n_cols, n_classes):
    """Each list reordered by class, then ascending block index (padding last), and per list
    where each class ends: (reordered indices int32 (like indices), [ends: int32 like counts]
    for the classes 0 .. n_classes - 2). A sort on device: no host sync."""
    width = indices.shape[-1]
    valid = torch.arange(width, device=indices.device) < counts.unsqueeze(-1)
    cls = torch.where(valid, classes, n_classes)
    key, _ = torch.sort(cls.long() * n_cols + indices.long(), dim=-1)
    ends = [(cls <= c).sum(-1, dtype=torch.int32).contiguous() for c in range(n_classes - 1)]
    return (key % n_cols).to(torch.int32).contiguous(), ends


def _window_key_lists(layout, N):
    """Sliding window (causal): each query block's key list reordered as [0, full) blocks
    without an element mask, [full, win) masked ones (the diagonal, the ragged last block),
    [win, end) the window blocks (the predicate per element); blocks above the diagonal after
    end. Returns (index, full, win, end)."""
    n, bs = layout.n_kv_blocks, layout.block_size
    r = torch.arange(layout.n_q_blocks, device=layout.kv_indices.device).view(1, 1, -1, 1)
    c = layout.kv_indices
    plain = torch.where(c < r, 0, torch.where(c == r, 1, 3))   # below, on, above the diagonal
    if N % bs:
        plain = torch.where((c == n - 1) & (plain == 0), 1, plain)
    classes = torch.where(layout.kv_window, 2, plain)
    index, (full, win, end) = _class_order(layout.kv_num_blocks, c, classes, n, 4)
    return index, full, win, end


def _window_query_lists(layout):
    """Sliding window (causal): each key block's query list reordered as [0, skip) blocks
    before it (nothing to do), [skip, full) the diagonal, [full, win) the unmasked blocks after
    it, [win, count) the window blocks. Returns (index, skip, full, win)."""
    c = torch.arange(layout.n_kv_blocks, device=layout.q_indices.device).view(1, 1, -1, 1)
    r = layout.q_indices
    classes = torch.where(layout.q_window, 3, torch.where(r < c, 0, torch.where(r == c, 1, 2)))
    index, (skip, full, win) = _class_order(layout.q_num_blocks, r, classes, layout.n_q_blocks, 4)
    return index, skip, full, win


def _window_meta(layout):
    """The sliding-window keywords (runtime.window_args; other layouts: HAS_WINDOW False, the
    kernels compile unchanged)."""
    return window_args(layout.window)


def _query_lists(layout, causal):
    """(skip, full) per key block: its query list is [0, skip) blocks before the keys
    (causal: nothing to do), [skip, full) the diagonal (masked), then the unmasked rest."""
    c = torch.arange(layout.n_kv_blocks, device=layout.q_indices.device, dtype=torch.int32)
    if not causal:
        zero = torch.zeros_like(layout.q_num_blocks, dtype=torch.int32).contiguous()
        return zero, zero
    return tuple(_list_positions(layout.q_num_blocks, layout.q_indices, (c, c + 1)))


def tma_usable(t, block_n: int, block_d: int) -> bool:
    """Whether K or V (B, N, H, D) can be read through a TMA descriptor with (block_n,
    block_d) boxes: on an arch with TMA (hardware.ARCH_TABLE: sm90, sm100, sm120; never AMD),
    or off-GPU (the interpreter); a
    16-byte aligned base, unit stride on the head dim, and every other stride a positive
    multiple of 16 bytes (a row of an odd head dim, a broadcast (expanded) head or a
    misaligned slice do not qualify); boxes of at most 256 rows and columns. The launcher
    falls back to pointer loads (TMA = 0) otherwise."""
    tma = VARIANT_SWITCHES["block_sparse_fwd"]["TMA"]
    if t.device.type == "cuda" and not tma.available(device_arch(t.device)):
        return False
    size = t.element_size()
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and max(block_n, block_d) <= 256
            and all(s > 0 and s * size % 16 == 0 for s in t.stride()[:-1]))


def _kv_descriptors(k, v, block_n, block_d):
    """Host-side tensor descriptors of K and V as (B, H, N, D) views (a permute, no copy):
    the key block of one head is then a [1, 1, block_n, block_d] box; rows past N and columns
    past D read as zeros."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    return tuple(TensorDescriptor.from_tensor(t.permute(0, 2, 1, 3), [1, 1, block_n, block_d]) for t in (k, v))


def _forward_lists(layout, N, causal, B, Hq):
    """The forward and dQ kernels' key lists as keywords: KV_INDEX (reordered for a sliding
    window), KV_BOUNDS (full, window, end per list: _key_lists, _window_key_lists), their
    strides, and the window's keywords."""
    if layout.window is None:
        full, end = _key_lists(layout, N, causal)
        index, bounds, lists = _block_lists(layout.kv_indices, (full, end, end), B, Hq)
        return dict(KV_INDEX=index, KV_BOUNDS=bounds, **lists)
    check_window_causal(layout, causal)   # the reordered lists assume the causal cut
    index, full, win, end = _window_key_lists(layout, N)
    index, bounds, lists = _block_lists(index, (full, win, end), B, Hq)
    return dict(KV_INDEX=index, KV_BOUNDS=bounds, **lists, **_window_meta(layout))


def _backward_lists(layout, causal, B, Hq):
    """The dK/dV kernel's query lists as keywords: Q_INDEX (reordered for a sliding window),
    Q_BOUNDS (skip, full, window, count per list: _query_lists, _window_query_lists), their
    strides, and the window's keywords."""
    count = layout.q_num_blocks
    if layout.window is None:
        skip, full = _query_lists(layout, causal)
        index, bounds, lists = _block_lists(layout.q_indices, (skip, full, count, count), B, Hq)
        return dict(Q_INDEX=index, Q_BOUNDS=bounds, **lists)
    index, skip, full, win = _window_query_lists(layout)
    index, bounds, lists = _block_lists(index, (skip, full, win, count), B, Hq)
    return dict(Q_INDEX=index, Q_BOUNDS=bounds, **lists, **_window_meta(layout))


def _tiles(cfg, block_size):
    bm, bn = min(cfg["BLOCK_M"], block_size), min(cfg["BLOCK_N"], block_size)
    return bm, bn


@on_tensor_device
def block_sparse_forward(q, k, v, layout, call, *, config=None):
    causal, scale = call.causal, call.scale
    B, N, Hq, D = q.shape
    Hkv = k.shape[2]
    block_d = padded_head_dim(D)
    cfg = config or select_config("block_sparse_fwd", q.dtype, block_d, N, q.device)
    bm, bn = _tiles(cfg, layout.block_size)
    # TMA = 1 where the inputs allow it (tma_usable), else the pointer loads; WARP_SPEC = 1 needs
    # the descriptor loads (and an arch where Triton warp-specializes: elsewhere it is ignored)
    warp_spec = switch_value("block_sparse_fwd", cfg, "WARP_SPEC") and (
        q.device.type != "cuda" or VARIANT_SWITCHES["block_sparse_fwd"]["WARP_SPEC"].available(device_arch(q.device)))
    tma = ((switch_value("block_sparse_fwd", cfg, "TMA") or warp_spec) and tma_usable(k, bn, block_d)
           and tma_usable(v, bn, block_d))
    k_desc, v_desc = _kv_descriptors(k, v, bn, block_d) if tma else (None, None)
    out = torch.empty(B, N, Hq, D, dtype=q.dtype, device=q.device)
    row_max = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    row_sum = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    dot_mode, precision = kernel_options(q.dtype, q.device)
    _block_sparse_fwd_kernel[(triton.cdiv(N, bm) * B * Hq,)](
        Q=q, K=k, V=v, K_DESC=k_desc, V_DESC=v_desc, O=out, ROW_MAX=row_max, ROW_SUM=row_sum,
        **_forward_lists(layout, N, causal, B, Hq),
        **_strides(q=q, k=k, v=v), N=N, HQ=Hq, HEAD_GROUP=Hq // Hkv, sm_scale=scale,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_SIZE=layout.block_size, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn,
        DOT_MODE=dot_mode, PRECISION=precision, TMA=bool(tma), WARP_SPEC=bool(warp_spec and tma),
        **call.kernel_args(), num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 2))
    return out, row_max, row_sum


SOFTCAP_DKDV_STAGES = 2   # at most this many pipeline stages in the dK/dV kernel with softcap


@on_tensor_device
def block_sparse_backward(do, dlse, q, k, v, out, row_max, row_sum, layout, call, *, config=None):
    causal, scale = call.causal, call.scale
    B, N, Hq, D = q.shape
    Hkv = k.shape[2]
    block_d = padded_head_dim(D)
    # one config for both kernels when given (or tuned); untuned, the dK/dV kernel has its own
    cfg = config or select_config("block_sparse_bwd", q.dtype, block_d, N, q.device)
    kv_cfg = config or select_config("block_sparse_bwd", q.dtype, block_d, N, q.device, kernel="block_sparse_bwd_dkdv")
    if call.capped:   # the cap's tanh and derivative take a pipeline stage's registers in dK/dV (perf aot, bf16:
        # with 3 stages sm90 D = 128 spills 36 B, with 2 none)
        kv_cfg = {**kv_cfg, "num_stages": min(kv_cfg.get("num_stages", 2), SOFTCAP_DKDV_STAGES)}
    bm, bn = _tiles(cfg, layout.block_size)
    for name, t in (("row_max", row_max), ("row_sum", row_sum)):
        require_contiguous("block_sparse_backward", name, t, (B, Hq, N))
    do = last_dim_contiguous(do)
    delta = softmax_delta(do, out, dlse)
    dot_mode, precision = kernel_options(q.dtype, q.device)
    common = dict(Q=q, K=k, V=v, DO=do, ROW_MAX=row_max, ROW_SUM=row_sum, DELTA=delta,
                  **_strides(q=q, k=k, v=v, do=do), N=N, HEAD_GROUP=Hq // Hkv, sm_scale=scale,
                  HEAD_DIM=D, BLOCK_D=block_d, BLOCK_SIZE=layout.block_size, CAUSAL=causal,
                  DOT_MODE=dot_mode, PRECISION=precision, **call.kernel_args())
    dq = torch.empty(B, N, Hq, D, dtype=q.dtype, device=q.device)
    _block_sparse_bwd_dq_kernel[(triton.cdiv(N, bm) * B * Hq,)](
        **common, DQ=dq, **_forward_lists(layout, N, causal, B, Hq), HQ=Hq, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2))
    dk = torch.empty(B, N, Hkv, D, dtype=k.dtype, device=q.device)
    dv = torch.empty(B, N, Hkv, D, dtype=v.dtype, device=q.device)
    # key tiles of BLOCK_M keys, walking query sub-tiles of BLOCK_N
    km, qn = _tiles(kv_cfg, layout.block_size)
    _block_sparse_bwd_dkdv_kernel[(triton.cdiv(N, km) * B * Hkv,)](
        **common, DK=dk, DV=dv, **_backward_lists(layout, causal, B, Hq), HKV=Hkv,
        BLOCK_M=km, BLOCK_N=qn, num_warps=kv_cfg.get("num_warps", 4), num_stages=kv_cfg.get("num_stages", 2))
    return dq, dk, dv
