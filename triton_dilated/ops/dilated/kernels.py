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

Loop structure (FLAT_LOOP, the default): an unrolled prologue turns the tile's patterns
into runs (key start, rate, block counts) held in small register vectors; one
software-pipelined loop then walks the unmasked blocks of all patterns and a second the
masked ones, each block's keys found from the loop index and those vectors (no table load,
no pipeline drained per pattern). FLAT_LOOP=0 keeps an unmasked and a masked loop per
pattern. Only the order of the online-softmax steps differs (results equal up to rounding).

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

from ..common.configs import select_config, switch_value
from ..common.hardware import padded_head_dim
from ..common.kernels import (bnhd_offset, dot, finalize, load_key_block, load_row_stats, online_softmax_step,
                              program_tile, softcap_terms, softmax_grad_block, transposed_grad_step, window_keep)
from ..common.lse import softmax_delta
from ..common.runtime import kernel_options, last_dim_contiguous, on_tensor_device, require_contiguous
from .plan import build_items, key_unit_triples, query_unit_triples


# ----------------------------------------------------------------------------- kernels
#
# Q, K, V and dO may come with any strides (unit stride on the head dim): their (batch,
# sequence, head) strides are arguments. O, dQ, dK, dV (B, N, heads, HEAD_DIM) and the row
# statistics ROW_MAX, ROW_SUM, DELTA (B, HQ, N) are contiguous (the launchers allocate them)
# and are indexed from their shapes.

@triton.jit
def _item_tile(ITEMS, NUM_ITEMS, HEAD_GROUP, BLOCK: tl.constexpr):
    """This program's tile: the work item (first row, chunk end, unit = head, tile stride T,
    document [start, end)) of its flat-grid slot and its rows first + T*u, u < BLOCK.
    Returns b, head and its key/value head (int64: head * head-stride overflows int32 for
    long strided inputs), T, doc_start, doc_end, first, rows [BLOCK], rows_ok [BLOCK] and
    last (the last row in the chunk)."""
    item, b, _ = program_tile(NUM_ITEMS, 1)
    base = ITEMS + item * 6
    first, chunk_end, head, T = tl.load(base), tl.load(base + 1), tl.load(base + 2).to(tl.int64), tl.load(base + 3)
    doc_start, doc_end = tl.load(base + 4), tl.load(base + 5)
    kv_head = head // HEAD_GROUP
    rows = first + T * tl.arange(0, BLOCK)
    rows_ok = rows < chunk_end
    last = first + T * (tl.minimum(BLOCK, (chunk_end - first + T - 1) // T) - 1)
    return b, head, kv_head, T, doc_start, doc_end, first, rows, rows_ok, last


@triton.jit
def _segment(first_row, w, doc_start, doc_end):
    """[start, end) of the segment of length w holding first_row; segments restart at each
    document (packed variable-length sequences; one document = the whole sequence)."""
    seg = doc_start + ((first_row - doc_start) // w) * w
    return seg, tl.minimum(seg + w, doc_end)


@triton.jit
def _pattern_span(PAT_W, PAT_R, i, o, first_row, last_row, rows, row_ok, T, doc_start, doc_end, window,
                  CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pattern i, at offset o >= 0 for this head, seen from a query tile: its keys are
    key0 + r*t for t < key_end (causal: up to the tile's last row), and t < full_end (a
    multiple of BLOCK_N) need no element mask; the masked blocks start at mask_start.
    With a sliding window (HAS_WINDOW, causal) every block is masked and they start at the
    first key the tile's first row reaches (p' > first_row - window). Returns key0, r,
    key_end, full_end, mask_start and row_active [BLOCK_M], the tile's rows the pattern
    selects."""
    w = tl.load(PAT_W + i)
    r = tl.load(PAT_R + i)
    seg, seg_end = _segment(first_row, w, doc_start, doc_end)
    row_active = row_ok & ((rows - seg) % r == o)
    # T % r == 0: every row has the residue of the first row (all on or all off)
    uniform_active = ((T % r) == 0) & ((first_row - seg) % r == o)
    uniform_idle = ((T % r) == 0) & ((first_row - seg) % r != o)
    n_keys = tl.maximum((seg_end - seg - o + r - 1) // r, 0)
    key_end = n_keys
    full_end = n_keys
    if CAUSAL:
        key_end = tl.minimum(n_keys, tl.maximum((last_row - seg - o) // r + 1, 0))
        full_end = tl.minimum(n_keys, tl.maximum((first_row - seg - o) // r + 1, 0))
    full_end = tl.where(uniform_active, (full_end // BLOCK_N) * BLOCK_N, 0)
    key_end = tl.where(uniform_idle, 0, key_end)
    mask_start = full_end
    if HAS_WINDOW:   # key seg + o + r*t with t > (first_row - window - seg - o) / r (kept >= 0: no negative division)
        reach = first_row - window - seg - o
        full_end = 0
        mask_start = tl.minimum(tl.where(reach >= 0, reach // r + 1, 0), key_end)
    return seg + o, r, key_end, full_end, mask_start, row_active


@triton.jit
def _runs(PAT_W, PAT_R, PAT_OFF, h, first_row, last_row, rows, row_ok, T, doc_start, doc_end, window,
          NUM_PATTERNS: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """FLAT_LOOP: the key blocks of all the head's patterns, seen from a query tile, as the
    runs of two flat loops: the unmasked blocks [0, full_end) of every pattern, then the
    masked ones [mask_start, key_end) (_pattern_span). Pattern i is slot i of small vectors
    (padded to a power of two): in each loop its run is the blocks j in [start_i, end_i),
    at keys key0_i + r_i*t for t = j*BLOCK_N - shift_i + [0, BLOCK_N), t < key_end_i.
    Returns n_full, full_runs, n_masked, masked_runs; runs = (start, end, shift, key0, r, key_end)."""
    # slots: the next power of two >= NUM_PATTERNS (a tl.arange size), in constexpr arithmetic
    S1: tl.constexpr = (NUM_PATTERNS - 1) | ((NUM_PATTERNS - 1) >> 1)
    S2: tl.constexpr = S1 | (S1 >> 2)
    S3: tl.constexpr = S2 | (S2 >> 4)
    SLOTS: tl.constexpr = (S3 | (S3 >> 8)) + 1
    slot = tl.arange(0, SLOTS)
    zero = tl.zeros([SLOTS], tl.int32)   # unused slots keep start = end = 0: never picked
    full_start, full_stop = zero, zero
    masked_start, masked_stop, masked_shift = zero, zero, zero
    key0s, rs, key_ends = zero, zero + 1, zero
    n_full = 0
    n_masked = 0
    for i in tl.static_range(NUM_PATTERNS):   # unrolled: independent table loads, no loop to drain
        o = tl.load(PAT_OFF + h * NUM_PATTERNS + i)
        key0, r, key_end, full_end, mask_start, _ = _pattern_span(PAT_W, PAT_R, i, o, first_row, last_row, rows,
                                                                  row_ok, T, doc_start, doc_end, window, CAUSAL,
                                                                  HAS_WINDOW, BLOCK_N)
        used = o >= 0   # o < 0: the head does not use pattern i
        here = slot == i
        full_start = tl.where(here, n_full, full_start)
        n_full += tl.where(used, full_end // BLOCK_N, 0)   # full_end: a multiple of BLOCK_N
        full_stop = tl.where(here, n_full, full_stop)
        masked_start = tl.where(here, n_masked, masked_start)
        masked_shift = tl.where(here, n_masked * BLOCK_N - mask_start, masked_shift)
        n_masked += tl.where(used, (key_end - mask_start + BLOCK_N - 1) // BLOCK_N, 0)
        masked_stop = tl.where(here, n_masked, masked_stop)
        key0s = tl.where(here, key0, key0s)
        rs = tl.where(here, r, rs)
        key_ends = tl.where(here, key_end, key_ends)
    full_runs = (full_start, full_stop, full_start * BLOCK_N, key0s, rs, key_ends)
    masked_runs = (masked_start, masked_stop, masked_shift, key0s, rs, key_ends)
    return n_full, full_runs, n_masked, masked_runs


@triton.jit
def _run_at(j, runs, BLOCK_N: tl.constexpr):
    """(key0, r, t0, key_end) of block j of a flat loop (_runs): sums over the one slot whose
    run holds j, so the block's key addresses depend on j and loop-invariant registers only."""
    start, stop, shift, key0s, rs, key_ends = runs
    here = (start <= j) & (j < stop)
    key0 = tl.sum(tl.where(here, key0s, 0), 0)
    r = tl.sum(tl.where(here, rs, 0), 0)
    t0 = j * BLOCK_N - tl.sum(tl.where(here, shift, 0), 0)
    key_end = tl.sum(tl.where(here, key_ends, 0), 0)
    return key0, r, t0, key_end


@triton.jit
def _window_cut(mask, rows, key0, r, t0, window, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """A masked block's mask [BLOCK_M, BLOCK_N] cut to the sliding window (window_keep, no sink
    tokens) of the query rows, for the keys key0 + r*(t0 + [0, BLOCK_N))."""
    if HAS_WINDOW:
        kpos = key0 + r * (t0 + tl.arange(0, BLOCK_N))
        mask = mask & window_keep(rows[:, None], kpos[None, :], window, 0, False)
    return mask


@triton.jit(do_not_specialize=["window"])   # one compile for every window
def _dilated_fwd_kernel(
        Q, K, V, O, ROW_MAX, ROW_SUM, ITEMS, PAT_W, PAT_R, PAT_OFF,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        N, HQ, NUM_ITEMS, HEAD_GROUP, sm_scale, softcap, window,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_PATTERNS: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr, PRECISION: tl.constexpr,
        FLAT_LOOP: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr):
    b, h, kvh, T, doc_start, doc_end, first_row, rows, row_ok, last_row = _item_tile(ITEMS, NUM_ITEMS, HEAD_GROUP,
                                                                                    BLOCK_M)
    cap = softcap_terms(softcap, HAS_SOFTCAP)
    Q += b * stride_qb + h * stride_qh

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rows64 = rows.to(tl.int64)
    tile_mask = row_ok[:, None] & d_ok[None, :]                                          # [BLOCK_M, BLOCK_D]
    q = tl.load(Q + rows64[:, None] * stride_qn + d[None, :], mask=tile_mask, other=0.0)   # [BLOCK_M, BLOCK_D]
    k_base = K + b * stride_kb + kvh * stride_kh + d[None, :]   # [1, BLOCK_D]: row 0 of this head's keys
    v_base = V + b * stride_vb + kvh * stride_vh + d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if FLAT_LOOP:   # the unmasked blocks of all patterns in one loop, then the masked ones
        n_full, full_runs, n_masked, masked_runs = _runs(PAT_W, PAT_R, PAT_OFF, h, first_row, last_row, rows, row_ok,
                                                         T, doc_start, doc_end, window, NUM_PATTERNS, CAUSAL,
                                                         HAS_WINDOW, BLOCK_N)
        for j in range(n_full):
            key0, r, t0, key_end = _run_at(j, full_runs, BLOCK_N)
            k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, key0, r, t0,
                                        key_end, rows, row_ok, d_ok, CAUSAL, False, BLOCK_N)
            acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, sm_scale, mask,
                                                False, DOT_MODE, PRECISION, cap=cap, HAS_SOFTCAP=HAS_SOFTCAP)
        for j in range(n_masked):
            key0, r, t0, key_end = _run_at(j, masked_runs, BLOCK_N)
            row_active = row_ok & ((rows - key0) % r == 0)   # the rows of the block's pattern
            k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, key0, r, t0,
                                        key_end, rows, row_active, d_ok, CAUSAL, True, BLOCK_N)
            mask = _window_cut(mask, rows, key0, r, t0, window, HAS_WINDOW, BLOCK_N)
            acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, sm_scale, mask,
                                                True, DOT_MODE, PRECISION, cap=cap, HAS_SOFTCAP=HAS_SOFTCAP)
    else:   # per pattern: an unmasked and a masked loop each
        for i in range(NUM_PATTERNS):   # not unrolled: pattern parameters are runtime loads
            o = tl.load(PAT_OFF + h * NUM_PATTERNS + i)
            if o >= 0:
                key0, r, key_end, full_end, mask_start, row_active = _pattern_span(
                    PAT_W, PAT_R, i, o, first_row, last_row, rows, row_ok, T, doc_start, doc_end, window, CAUSAL,
                    HAS_WINDOW, BLOCK_N)
                for t0 in range(0, full_end, BLOCK_N):
                    k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, key0, r, t0,
                                                key_end, rows, row_ok, d_ok, CAUSAL, False, BLOCK_N)
                    acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, sm_scale, mask,
                                                        False, DOT_MODE, PRECISION, cap=cap, HAS_SOFTCAP=HAS_SOFTCAP)
                for t0 in range(mask_start, key_end, BLOCK_N):
                    k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, key0, r, t0,
                                                key_end, rows, row_active, d_ok, CAUSAL, True, BLOCK_N)
                    mask = _window_cut(mask, rows, key0, r, t0, window, HAS_WINDOW, BLOCK_N)
                    acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, sm_scale, mask,
                                                        True, DOT_MODE, PRECISION, cap=cap, HAS_SOFTCAP=HAS_SOFTCAP)
    out, row_max, row_sum = finalize(acc, m_i, l_i, q)                                  # [BLOCK_M, BLOCK_D]
    O += (b * N * HQ + h) * HEAD_DIM
    tl.store(O + rows64[:, None] * (HQ * HEAD_DIM) + d[None, :], out.to(O.dtype.element_ty), mask=tile_mask)
    # row statistics (max score, denominator); lse = max + ln(denominator)
    ROW_MAX += b * N * HQ + h * N
    ROW_SUM += b * N * HQ + h * N
    tl.store(ROW_MAX + rows, row_max, mask=row_ok)
    tl.store(ROW_SUM + rows, row_sum, mask=row_ok)


@triton.jit(do_not_specialize=["window"])   # one compile for every window
def _dilated_bwd_dq_kernel(
        Q, K, V, DO, ROW_MAX, ROW_SUM, DELTA, DQ, ITEMS, PAT_W, PAT_R, PAT_OFF,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_dob, stride_don, stride_doh,
        N, HQ, NUM_ITEMS, HEAD_GROUP, sm_scale, softcap, window,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_PATTERNS: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr, PRECISION: tl.constexpr,
        FLAT_LOOP: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr):
    b, h, kvh, T, doc_start, doc_end, first_row, rows, row_ok, last_row = _item_tile(ITEMS, NUM_ITEMS, HEAD_GROUP,
                                                                                    BLOCK_M)
    cap = softcap_terms(softcap, HAS_SOFTCAP)
    Q += b * stride_qb + h * stride_qh
    DO += b * stride_dob + h * stride_doh

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rows64 = rows.to(tl.int64)
    tile_mask = row_ok[:, None] & d_ok[None, :]                                              # [BLOCK_M, BLOCK_D]
    q = tl.load(Q + rows64[:, None] * stride_qn + d[None, :], mask=tile_mask, other=0.0)       # [BLOCK_M, BLOCK_D]
    do = tl.load(DO + rows64[:, None] * stride_don + d[None, :], mask=tile_mask, other=0.0)   # [BLOCK_M, BLOCK_D]
    stats = (b * HQ + h) * N   # the head's rows of ROW_MAX, ROW_SUM, DELTA
    row_max, row_log2l = load_row_stats(ROW_MAX, ROW_SUM, stats + rows, row_ok)              # [BLOCK_M]
    delta = tl.load(DELTA + stats + rows, mask=row_ok, other=0.0)                            # [BLOCK_M]
    k_base = K + b * stride_kb + kvh * stride_kh + d[None, :]
    v_base = V + b * stride_vb + kvh * stride_vh + d[None, :]

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if FLAT_LOOP:   # as the forward: all unmasked blocks in one loop, then the masked ones
        n_full, full_runs, n_masked, masked_runs = _runs(PAT_W, PAT_R, PAT_OFF, h, first_row, last_row, rows, row_ok,
                                                         T, doc_start, doc_end, window, NUM_PATTERNS, CAUSAL,
                                                         HAS_WINDOW, BLOCK_N)
        for j in range(n_full):
            key0, r, t0, key_end = _run_at(j, full_runs, BLOCK_N)
            k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, key0, r, t0,
                                        key_end, rows, row_ok, d_ok, CAUSAL, False, BLOCK_N)
            p, ds = softmax_grad_block(q, k, v, do, row_max, row_log2l, delta, sm_scale, mask,
                                       False, DOT_MODE, PRECISION, cap=cap,
                                       HAS_SOFTCAP=HAS_SOFTCAP)                      # [BLOCK_M, BLOCK_N]
            dq += dot(ds.to(k.dtype), k, DOT_MODE, PRECISION)
        for j in range(n_masked):
            key0, r, t0, key_end = _run_at(j, masked_runs, BLOCK_N)
            row_active = row_ok & ((rows - key0) % r == 0)
            k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, key0, r, t0,
                                        key_end, rows, row_active, d_ok, CAUSAL, True, BLOCK_N)
            mask = _window_cut(mask, rows, key0, r, t0, window, HAS_WINDOW, BLOCK_N)
            p, ds = softmax_grad_block(q, k, v, do, row_max, row_log2l, delta, sm_scale, mask,
                                       True, DOT_MODE, PRECISION, cap=cap, HAS_SOFTCAP=HAS_SOFTCAP)
            dq += dot(ds.to(k.dtype), k, DOT_MODE, PRECISION)
    else:
        for i in range(NUM_PATTERNS):   # not unrolled: pattern parameters are runtime loads
            o = tl.load(PAT_OFF + h * NUM_PATTERNS + i)
            if o >= 0:
                key0, r, key_end, full_end, mask_start, row_active = _pattern_span(
                    PAT_W, PAT_R, i, o, first_row, last_row, rows, row_ok, T, doc_start, doc_end, window, CAUSAL,
                    HAS_WINDOW, BLOCK_N)
                for t0 in range(0, full_end, BLOCK_N):
                    k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, key0, r, t0,
                                                key_end, rows, row_ok, d_ok, CAUSAL, False, BLOCK_N)
                    p, ds = softmax_grad_block(q, k, v, do, row_max, row_log2l, delta, sm_scale, mask,
                                               False, DOT_MODE, PRECISION, cap=cap,
                                       HAS_SOFTCAP=HAS_SOFTCAP)                      # [BLOCK_M, BLOCK_N]
                    dq += dot(ds.to(k.dtype), k, DOT_MODE, PRECISION)
                for t0 in range(mask_start, key_end, BLOCK_N):
                    k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, key0, r, t0,
                                                key_end, rows, row_active, d_ok, CAUSAL, True, BLOCK_N)
                    mask = _window_cut(mask, rows, key0, r, t0, window, HAS_WINDOW, BLOCK_N)
                    p, ds = softmax_grad_block(q, k, v, do, row_max, row_log2l, delta, sm_scale, mask,
                                               True, DOT_MODE, PRECISION, cap=cap, HAS_SOFTCAP=HAS_SOFTCAP)
                    dq += dot(ds.to(k.dtype), k, DOT_MODE, PRECISION)
    DQ += b * N * (HQ * HEAD_DIM) + h * HEAD_DIM
    tl.store(DQ + rows64[:, None] * (HQ * HEAD_DIM) + d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=tile_mask)


@triton.jit(do_not_specialize=["window"])   # one compile for every window
def _dilated_bwd_dkdv_kernel(
        Q, K, V, DO, ROW_MAX, ROW_SUM, DELTA, DK, DV, ITEMS, PAT_W, PAT_R, PAT_OFF,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_dob, stride_don, stride_doh,
        N, HKV, NUM_ITEMS, HEAD_GROUP, sm_scale, softcap, window,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_PATTERNS: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr, PRECISION: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr):
    # BLOCK_M: the key tile this program owns (the M dimension of every dot); BLOCK_N: the
    # query blocks it walks.
    b, kvh, _, T, doc_start, doc_end, first_key, keys, key_ok, last_key = _item_tile(ITEMS, NUM_ITEMS, 1, BLOCK_M)
    cap = softcap_terms(softcap, HAS_SOFTCAP)
    K += b * stride_kb + kvh * stride_kh
    V += b * stride_vb + kvh * stride_vh

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    t_off = tl.arange(0, BLOCK_N)
    keys64 = keys.to(tl.int64)
    tile_mask = key_ok[:, None] & d_ok[None, :]                                             # [BLOCK_M, BLOCK_D]
    k = tl.load(K + keys64[:, None] * stride_kn + d[None, :], mask=tile_mask, other=0.0)      # [BLOCK_M, BLOCK_D]
    v = tl.load(V + keys64[:, None] * stride_vn + d[None, :], mask=tile_mask, other=0.0)      # [BLOCK_M, BLOCK_D]
    dk = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for h in range(kvh * HEAD_GROUP, (kvh + 1) * HEAD_GROUP):
        stats = b * N * (HKV * HEAD_GROUP) + h * N   # into ROW_MAX, ROW_SUM, DELTA
        q_head = Q + b * stride_qb + h * stride_qh
        do_head = DO + b * stride_dob + h * stride_doh
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
                q_begin = (q_begin // BLOCK_N) * BLOCK_N
                # masked blocks up to full_lo, unmasked [full_lo, full_hi), masked tail
                full_lo = tl.where(uniform_active,
                                   q_begin + ((full_begin - q_begin + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, n_q)
                full_lo = tl.minimum(full_lo, n_q)
                full_hi = tl.where(uniform_active, full_lo + ((n_q - full_lo) // BLOCK_N) * BLOCK_N, n_q)
                query0 = seg + o
                q_stop = n_q
                if HAS_WINDOW:   # every block masked, up to the last query the tile's last key reaches
                    reach = last_key + window - 1 - query0
                    q_stop = tl.minimum(n_q, tl.where(reach >= 0, reach // r + 1, 0))
                    full_lo = tl.maximum(q_stop, q_begin)
                    full_hi = full_lo
                for t0 in range(q_begin, full_lo, BLOCK_N):
                    dk, dv = _dkdv_block(dk, dv, k, v, q_head, do_head, ROW_MAX, ROW_SUM, DELTA, stats, t0 + t_off,
                                         query0, r, n_q, keys, key_active, d, d_ok, stride_qn, stride_don,
                                         sm_scale, window, CAUSAL, HAS_WINDOW, True, DOT_MODE, PRECISION, cap,
                                         HAS_SOFTCAP)
                for t0 in range(full_lo, full_hi, BLOCK_N):
                    dk, dv = _dkdv_block(dk, dv, k, v, q_head, do_head, ROW_MAX, ROW_SUM, DELTA, stats, t0 + t_off,
                                         query0, r, n_q, keys, key_active, d, d_ok, stride_qn, stride_don,
                                         sm_scale, window, CAUSAL, HAS_WINDOW, False, DOT_MODE, PRECISION, cap,
                                         HAS_SOFTCAP)
                for t0 in range(full_hi, q_stop, BLOCK_N):
                    dk, dv = _dkdv_block(dk, dv, k, v, q_head, do_head, ROW_MAX, ROW_SUM, DELTA, stats, t0 + t_off,
                                         query0, r, n_q, keys, key_active, d, d_ok, stride_qn, stride_don,
                                         sm_scale, window, CAUSAL, HAS_WINDOW, True, DOT_MODE, PRECISION, cap,
                                         HAS_SOFTCAP)
    DK += bnhd_offset(b, kvh, N, HKV, HEAD_DIM)
    DV += bnhd_offset(b, kvh, N, HKV, HEAD_DIM)
    tl.store(DK + keys64[:, None] * (HKV * HEAD_DIM) + d[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
             mask=tile_mask)
    tl.store(DV + keys64[:, None] * (HKV * HEAD_DIM) + d[None, :], dv.to(DV.dtype.element_ty), mask=tile_mask)


@triton.jit
def _dkdv_block(dk, dv, k, v, q_head, do_head, ROW_MAX, ROW_SUM, DELTA, stats, t, query0, r, n_q, keys, key_active,
                d, d_ok, stride_qn, stride_don, sm_scale, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_MASK: tl.constexpr, DOT_MODE: tl.constexpr, PRECISION: tl.constexpr, cap,
                HAS_SOFTCAP: tl.constexpr):
    """Add one block of dilated queries (positions query0 + r*t) to the key tile's dK, dV
    [BLOCK_M, BLOCK_D]; q_head, do_head point at the head's row 0, stats is the head's
    offset into ROW_MAX, ROW_SUM, DELTA. Transposed scores: the key tile is the M
    dimension of every dot (S^T = K Q^T, dV += P^T dO, dP^T = V dO^T, dK += dS^T Q), so
    P^T and dS^T feed the next dots straight from registers, and the query statistics
    broadcast along columns."""
    qpos = query0 + r * t                                                             # [BLOCK_N]
    q_ok = t < n_q
    qpos64 = qpos.to(tl.int64)
    qT = tl.load(q_head + qpos64[None, :] * stride_qn + d[:, None], mask=d_ok[:, None] & q_ok[None, :],
                 other=0.0)                                                           # [BLOCK_D, BLOCK_N]
    do = tl.load(do_head + qpos64[:, None] * stride_don + d[None, :], mask=q_ok[:, None] & d_ok[None, :],
                 other=0.0)                                                           # [BLOCK_N, BLOCK_D]
    row_max, row_log2l = load_row_stats(ROW_MAX, ROW_SUM, stats + qpos, q_ok)         # [BLOCK_N]
    delta = tl.load(DELTA + stats + qpos, mask=q_ok, other=0.0)
    s_t = dot(k, qT, DOT_MODE, PRECISION) * sm_scale                                  # [BLOCK_M, BLOCK_N]
    if HAS_MASK:
        mask = key_active[:, None] & q_ok[None, :]
        if CAUSAL:
            mask = mask & (keys[:, None] <= qpos[None, :])
        if HAS_WINDOW:
            mask = mask & window_keep(qpos[None, :], keys[:, None], window, 0, False)
        s_t = tl.where(mask, s_t, float("-inf"))
    return transposed_grad_step(dk, dv, s_t, v, qT, do, row_max, row_log2l, delta, DOT_MODE, PRECISION, cap,
                                HAS_SOFTCAP)


# ----------------------------------------------------------------------------- launchers

def _strides(**tensors):
    """stride_<name>b, stride_<name>n, stride_<name>h of (B, N, H, D) tensors, as kernel keywords."""
    return {f"stride_{name}{axis}": t.stride(i) for name, t in tensors.items() for i, axis in enumerate("bnh")}


def _window_args(call):
    """The sliding window's keywords: HAS_WINDOW (compile-time) and its key count (run-time:
    one compile for every window). The dilated kernels take no sink tokens."""
    if call.window is not None and call.window.sink_tokens:
        raise ValueError(f"the dilated kernels take a sliding window without sink tokens, got {call.window}")
    return dict(HAS_WINDOW=call.window is not None, window=call.window_keys or None)


def _launch(cfg):
    """A config's tile constexprs and launch options, as kernel keywords."""
    return dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg.get("num_warps", 4),
                num_stages=cfg.get("num_stages", 2))


@functools.lru_cache(maxsize=128)
def _device_plan(n, patterns, table, num_kv_heads, causal, block, block_inner, keys_side, device, doc_bounds=None):
    """Items and pattern tables as device tensors, cached per shape (and documents)."""
    units = key_unit_triples(patterns, table, num_kv_heads) if keys_side else query_unit_triples(patterns, table)
    items, full = build_items(n, units, block, block_inner, causal, keys_side, doc_bounds)
    as_dev = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return (torch.from_numpy(items).to(device), full, as_dev([w for w, _ in patterns]),
            as_dev([r for _, r in patterns]), as_dev(table).reshape(-1))


@on_tensor_device
def dilated_forward(q, k, v, patterns, table, call, *, config=None, doc_bounds=None):
    """Launch the fused forward. Returns out (like q, contiguous) and the row statistics
    (row_max, row_sum), float32 (B, Hq, N) each; see lse_from_stats. call: the AttentionCall
    (causal, scale; the cap a run-time value of the capped kernel)."""
    causal, scale = call.causal, call.scale
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
    dot_mode, precision = kernel_options(q.dtype, q.device)
    _dilated_fwd_kernel[(items.shape[0] * B,)](
        Q=q, K=k, V=v, O=out, ROW_MAX=row_max, ROW_SUM=row_sum, ITEMS=items, PAT_W=pat_w, PAT_R=pat_r, PAT_OFF=pat_off,
        **_strides(q=q, k=k, v=v), N=N, HQ=Hq, NUM_ITEMS=items.shape[0], HEAD_GROUP=Hq // Hkv, sm_scale=scale,
        HEAD_DIM=D, BLOCK_D=block_d, NUM_PATTERNS=len(patterns), CAUSAL=causal,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], DOT_MODE=dot_mode, PRECISION=precision,
        FLAT_LOOP=switch_value("dilated_fwd", cfg, "FLAT_LOOP"), **call.kernel_args(), **_window_args(call),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2))
    return out, row_max, row_sum


@on_tensor_device
def dilated_backward(do, dlse, q, k, v, out, row_max, row_sum, patterns, table, call, *, config=None,
                     doc_bounds=None):
    """dQ, dK, dV for dO (like out) and an optional dlse (B, Hq, N); call as in the forward."""
    causal, scale = call.causal, call.scale
    B, N, Hq, D = q.shape
    Hkv = k.shape[2]
    block_d = padded_head_dim(D)
    # one config for both kernels when given (or tuned); untuned, the dK/dV kernel has its own
    cfg = config or select_config("dilated_bwd", q.dtype, block_d, N, q.device)
    kv_cfg = config or select_config("dilated_bwd", q.dtype, block_d, N, q.device, kernel="dilated_bwd_dkdv")
    for name, t in (("row_max", row_max), ("row_sum", row_sum)):
        require_contiguous("dilated_backward", name, t, (B, Hq, N))
    do = last_dim_contiguous(do)
    delta = softmax_delta(do, out, dlse)
    dot_mode, precision = kernel_options(q.dtype, q.device)
    common = dict(HEAD_DIM=D, BLOCK_D=block_d, NUM_PATTERNS=len(patterns), CAUSAL=causal, DOT_MODE=dot_mode,
                  PRECISION=precision, **call.kernel_args(), **_window_args(call))
    inputs = dict(Q=q, K=k, V=v, DO=do, ROW_MAX=row_max, ROW_SUM=row_sum, DELTA=delta,
                  **_strides(q=q, k=k, v=v, do=do), N=N, HEAD_GROUP=Hq // Hkv, sm_scale=scale)

    items, full, pat_w, pat_r, pat_off = _device_plan(N, patterns, table, Hkv, causal, cfg["BLOCK_M"],
                                                      cfg["BLOCK_N"], False, q.device, doc_bounds)
    dq = (torch.empty if full else torch.zeros)(B, N, Hq, D, dtype=q.dtype, device=q.device)
    if items.shape[0]:
        _dilated_bwd_dq_kernel[(items.shape[0] * B,)](
            **inputs, DQ=dq, ITEMS=items, PAT_W=pat_w, PAT_R=pat_r, PAT_OFF=pat_off, HQ=Hq,
            NUM_ITEMS=items.shape[0], FLAT_LOOP=switch_value("dilated_bwd", cfg, "FLAT_LOOP"), **common,
            **_launch(cfg))

    # key side: tiles of BLOCK_M keys, walking query blocks of BLOCK_N
    items, full, pat_w, pat_r, pat_off = _device_plan(N, patterns, table, Hkv, causal, kv_cfg["BLOCK_M"],
                                                      kv_cfg["BLOCK_N"], True, q.device, doc_bounds)
    alloc = torch.empty if full else torch.zeros
    dk = alloc(B, N, Hkv, D, dtype=k.dtype, device=q.device)
    dv = alloc(B, N, Hkv, D, dtype=v.dtype, device=q.device)
    if items.shape[0]:
        _dilated_bwd_dkdv_kernel[(items.shape[0] * B,)](
            **inputs, DK=dk, DV=dv, ITEMS=items, PAT_W=pat_w, PAT_R=pat_r, PAT_OFF=pat_off, HKV=Hkv,
            NUM_ITEMS=items.shape[0], **common, **_launch(kv_cfg))
    return dq, dk, dv
