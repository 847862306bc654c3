"""The ring-local-block step kernels and their launchers: this rank's queries against a
key/value shard that came from another rank, with the mask evaluated on *global* positions, merged into the running
float32 (out, lse) in place; and its backward (dQ into a local accumulator, dK/dV into
the accumulators that travel with the shard).

Masks (MASK_KIND): 0 dense; 1 dilated (the weight of a pair is how many of the head's
patterns select it: p, p' in one segment, both with the head's residue; LongNet's
multiset union); 2 block layout (a dense (n_blocks x n_blocks) table looked up per
element). Causal multiplies in p' <= p. Weights enter the softmax as ln(weight) added to
the score (-inf where 0), after the soft cap (HAS_SOFTCAP: s -> c * tanh(s / c)); a key tile
whose weights are all 0 is skipped.

The step's partial (acc / l, its lse) is merged into the running (out, lse) by the
max-guarded log-sum-exp, exact when either side is -inf: one read and one write of the
running state per step, no separate pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.configs import select_config
from ..common.hardware import padded_head_dim
from ..common.kernels import (LOG2E, dot, finalize, online_softmax_step, program_tile, softcap_terms,
                              softmax_grad_block, tanh, window_keep)
from ..common.runtime import kernel_options, on_tensor_device, require_contiguous
from . import mask as step_mask
from .mask import StepMask

# the mask kinds and the mask descriptor's layout (StepMask.descriptor) as compile-time constants
MASK_DILATED: tl.constexpr = tl.constexpr(step_mask.MASK_DILATED)
MASK_LAYOUT: tl.constexpr = tl.constexpr(step_mask.MASK_LAYOUT)
DESC_HEADER: tl.constexpr = tl.constexpr(step_mask.DESC_HEADER)
DESC_LIST_B: tl.constexpr = tl.constexpr(step_mask.DESC_LIST_B)
DESC_LIST_H: tl.constexpr = tl.constexpr(step_mask.DESC_LIST_H)
DESC_TABLE_AT: tl.constexpr = tl.constexpr(step_mask.DESC_TABLE_AT)
DESC_COLS: tl.constexpr = tl.constexpr(step_mask.DESC_COLS)
DESC_BLOCK: tl.constexpr = tl.constexpr(step_mask.DESC_BLOCK)
DESC_WINDOW: tl.constexpr = tl.constexpr(step_mask.DESC_WINDOW)
DESC_SINK_TOKENS: tl.constexpr = tl.constexpr(step_mask.DESC_SINK_TOKENS)


# Q, K, V and dO (views allowed, unit stride on the head dim) come with their (batch, sequence,
# head) strides. The running OUT and the accumulators DQ, DK, DV ((B, rows, heads, HEAD_DIM),
# float32) and LSE, DELTA ((B, HQ, NQ)) are contiguous and indexed from their shapes (the
# launchers hand the kernels a contiguous copy of a view and copy it back). MASK is the mask's
# descriptor (StepMask.descriptor, ring/mask.py): one int32 tensor with a header, the pattern
# tables and the block table's bytes. TILES holds the tile lists (_tile_lists): per (list row,
# tile) the number of active tiles of the other side, then their indices.

@triton.jit
def _list_row(MASK, b, h, MASK_KIND: tl.constexpr):
    """Row of (batch b, head h) in the tile lists and the block table (list rows, LB x LH),
    int64: a dilated mask's lists are per head (1, H), a dense mask's shared (1, 1); a block
    table's broadcast over the batch (LB = 1) or the heads (LH = 1) as the header says."""
    row = h
    if MASK_KIND == MASK_LAYOUT:
        list_b = tl.load(MASK + DESC_LIST_B)
        list_h = tl.load(MASK + DESC_LIST_H)
        row = tl.where(list_b > 1, b, 0) * list_h + tl.where(list_h > 1, h, 0)
    elif MASK_KIND != MASK_DILATED:
        row = h * 0
    return row


@triton.jit
def _mask_of(MASK, row, MASK_KIND: tl.constexpr, NUM_PATTERNS: tl.constexpr, HAS_WINDOW: tl.constexpr,
             HAS_SINK_TOKENS: tl.constexpr):
    """What _pair_log_weight reads of the mask descriptor for list row `row` (_list_row: the
    head, for dilated masks), gathered once per program (per head in dK/dV): (the head's
    pattern offsets, the row's block table (int8), its columns, the block size, the window,
    the sink count), each only where MASK_KIND and the features use it (0 otherwise)."""
    pat_off = MASK
    table = MASK
    cols = 0
    block = 1
    window = 0
    sink_tokens = 0
    if MASK_KIND == MASK_DILATED:
        pat_off = MASK + (DESC_HEADER + 2 * NUM_PATTERNS) + row * NUM_PATTERNS
    if MASK_KIND == MASK_LAYOUT:
        cols = tl.load(MASK + DESC_COLS)
        block = tl.load(MASK + DESC_BLOCK)
        plane = tl.cast(cols, tl.int64) * cols          # LB * LH * cols^2 bytes pass 2^31 past ~46K blocks
        table = (MASK + tl.load(MASK + DESC_TABLE_AT)).to(tl.pointer_type(tl.int8)) + row * plane
        if HAS_WINDOW:
            window = tl.load(MASK + DESC_WINDOW)
        if HAS_SINK_TOKENS:
            sink_tokens = tl.load(MASK + DESC_SINK_TOKENS)
    return pat_off, table, cols, block, window, sink_tokens


@triton.jit
def _pair_log_weight(qpos, kpos, q_ok, k_ok, MASK, m, MASK_KIND: tl.constexpr, NUM_PATTERNS: tl.constexpr,
                     CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr = False, HAS_SINK_TOKENS: tl.constexpr = False):
    """ln(weight) of each (query, key) pair, -inf where it does not count, for query and key
    positions (and in-range flags) given as a column and a row: qpos [BLOCK_M, 1], kpos
    [1, BLOCK_N] give [BLOCK_M, BLOCK_N]; qpos [1, BLOCK_N], kpos [BLOCK_M, 1] the transpose
    (the dK/dV kernel's keys x queries). m: _mask_of for the head (its pattern offsets, its
    block table). HAS_WINDOW: a block-table entry of 2 is a sliding window's block, where
    window_keep decides per element."""
    pat_off, table, cols, block, window, sink_tokens = m
    ok = q_ok & k_ok
    if CAUSAL:
        ok = ok & (kpos <= qpos)
    if MASK_KIND == MASK_DILATED:
        count = tl.zeros(ok.shape, tl.float32)
        for i in tl.static_range(NUM_PATTERNS):   # unrolled: a nested loop would stop the pipeliner
            o = tl.load(pat_off + i)
            w = tl.load(MASK + DESC_HEADER + i)
            r = tl.load(MASK + (DESC_HEADER + NUM_PATTERNS) + i)
            q_seg = qpos // w
            k_seg = kpos // w
            q_on = (o >= 0) & ((qpos - q_seg * w) % r == o)
            k_on = (o >= 0) & ((kpos - k_seg * w) % r == o)
            hit = (q_seg == k_seg) & q_on & k_on
            count += hit.to(tl.float32)
        ok = ok & (count > 0)
        return tl.where(ok, tl.log(tl.maximum(count, 1.0)), float("-inf"))
    if MASK_KIND == MASK_LAYOUT:
        qb = (qpos // block).to(tl.int64)   # qb * row stride passes 2^31 past ~46K blocks
        kb = (kpos // block).to(tl.int64)
        active = tl.load(table + qb * cols + kb, mask=ok, other=0)
        ok = ok & (active != 0)
        if HAS_WINDOW:
            ok = ok & ((active != 2) | window_keep(qpos, kpos, window, sink_tokens, HAS_SINK_TOKENS))
    return tl.where(ok, 0.0, float("-inf"))


@triton.jit
def _tile_positions(POS, tile, n, BLOCK: tl.constexpr):
    """(in range, position) of the BLOCK rows of tile `tile` of a side with n rows."""
    idx = tile * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    return ok, tl.load(POS + idx, mask=ok, other=0)


@triton.jit
def _same_document(Q_DOC, K_DOC, rows, cols, q_ok, k_ok, DOCS: tl.constexpr):
    """q_ok, and with packed documents (DOCS) also "query row and key row lie in one
    document" (their ids in Q_DOC, K_DOC; ring/documents.py): passed to _pair_log_weight as
    the query flags, so a pair across documents has weight 0. rows, cols: a column and a
    row of row indices (or the transpose), broadcast like the positions."""
    ok = q_ok
    if DOCS:   # one return: the compiler types every return alike, constexpr branch or not
        q_doc = tl.load(Q_DOC + rows, mask=q_ok, other=-1)
        k_doc = tl.load(K_DOC + cols, mask=k_ok, other=-2)
        ok = q_ok & (q_doc == k_doc)
    return ok


@triton.jit
def _ring_tile_lists_kernel(
        Q_POS, K_POS, MASK, TILES, NQ, NK,
        MASK_KIND: tl.constexpr, NUM_PATTERNS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BY_KEY: tl.constexpr, Q_DOC=None, K_DOC=None, DOCS: tl.constexpr = False,
        HAS_WINDOW: tl.constexpr = False, HAS_SINK_TOKENS: tl.constexpr = False):
    """The active tiles of a step: for one query tile (BY_KEY: one key tile) of one list row
    (LB x LH, _list_row), the number of tiles of the other side with a counted pair, then those
    tiles ascending: a row of TILES (LB, LH, tiles, 1 + other tiles)."""
    n_tiles = tl.cdiv(NK, BLOCK_N) if BY_KEY else tl.cdiv(NQ, BLOCK_M)
    n_other = tl.cdiv(NQ, BLOCK_M) if BY_KEY else tl.cdiv(NK, BLOCK_N)
    tile, b, h = program_tile(n_tiles, tl.load(MASK + DESC_LIST_H))   # b, h: the list row's (< LB, < LH)
    row = _list_row(MASK, b, h, MASK_KIND)
    m = _mask_of(MASK, row, MASK_KIND, NUM_PATTERNS, HAS_WINDOW, HAS_SINK_TOKENS)
    TILES += (row * n_tiles + tile) * (n_other + 1)
    if BY_KEY:
        k_ok, kpos = _tile_positions(K_POS, tile, NK, BLOCK_N)
    else:
        q_ok, qpos = _tile_positions(Q_POS, tile, NQ, BLOCK_M)
    count = tl.zeros([1], tl.int32).sum(0)   # an int32 scalar
    for t in range(0, n_other):
        if BY_KEY:
            q_ok, qpos = _tile_positions(Q_POS, t, NQ, BLOCK_M)
        else:
            k_ok, kpos = _tile_positions(K_POS, t, NK, BLOCK_N)
        if BY_KEY:
            rows, cols = t * BLOCK_M + tl.arange(0, BLOCK_M), tile * BLOCK_N + tl.arange(0, BLOCK_N)
        else:
            rows, cols = tile * BLOCK_M + tl.arange(0, BLOCK_M), t * BLOCK_N + tl.arange(0, BLOCK_N)
        in_doc = _same_document(Q_DOC, K_DOC, rows[:, None], cols[None, :], q_ok[:, None], k_ok[None, :], DOCS)
        log_w = _pair_log_weight(qpos[:, None], kpos[None, :], in_doc, k_ok[None, :], MASK, m, MASK_KIND,
                                 NUM_PATTERNS, CAUSAL, HAS_WINDOW, HAS_SINK_TOKENS)   # [BLOCK_M, BLOCK_N]
        active = tl.max(log_w) > float("-inf")
        tl.store(TILES + 1 + count, t, mask=active)
        count += active.to(tl.int32)
    tl.store(TILES, count)


@triton.jit
def _ring_step_fwd_kernel(
        Q, K, V, OUT, LSE, Q_POS, K_POS, MASK, TILES,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        NQ, NK, HQ, HEAD_GROUP, sm_scale, softcap,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_KIND: tl.constexpr, NUM_PATTERNS: tl.constexpr,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr,
        PRECISION: tl.constexpr, Q_DOC=None, K_DOC=None, DOCS: tl.constexpr = False,
        HAS_WINDOW: tl.constexpr = False, HAS_SINK_TOKENS: tl.constexpr = False, HAS_SOFTCAP: tl.constexpr = False):
    n_tiles = tl.cdiv(NQ, BLOCK_M)
    tile, b, h = program_tile(n_tiles, HQ)
    kvh = h // HEAD_GROUP
    cap = softcap_terms(softcap, HAS_SOFTCAP)
    row = _list_row(MASK, b, h, MASK_KIND)
    m = _mask_of(MASK, row, MASK_KIND, NUM_PATTERNS, HAS_WINDOW, HAS_SINK_TOKENS)
    Q += b * stride_qb + h * stride_qh
    OUT += (b * NQ * HQ + h) * HEAD_DIM

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q_ok = rows < NQ
    rows64 = rows.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tile_mask = q_ok[:, None] & d_ok[None, :]                                            # [BLOCK_M, BLOCK_D]
    qpos = tl.load(Q_POS + rows, mask=q_ok, other=0)                                     # [BLOCK_M]
    q = tl.load(Q + rows64[:, None] * stride_qn + d[None, :], mask=tile_mask, other=0.0)   # [BLOCK_M, BLOCK_D]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    TILES += (row * n_tiles + tile) * (tl.cdiv(NK, BLOCK_N) + 1)   # this query tile's list of key tiles
    count = tl.load(TILES)
    index_base = TILES + 1
    # only the key tiles with a counted pair (host-built list): no branch in the loop, whose
    # loads the compiler software-pipelines
    # the next tile's index is read an iteration ahead: loads addressed by a load of the same
    # iteration cost the pipeliner a stage (one buffer fewer)
    t_next = tl.load(index_base, mask=count > 0, other=0)
    for j in range(0, count):
        t = t_next
        t_next = tl.load(index_base + j + 1, mask=j + 1 < count, other=0)
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = cols < NK
        kpos = tl.load(K_POS + cols, mask=k_ok, other=0)                                 # [BLOCK_N]
        in_doc = _same_document(Q_DOC, K_DOC, rows[:, None], cols[None, :], q_ok[:, None], k_ok[None, :], DOCS)
        log_w = _pair_log_weight(qpos[:, None], kpos[None, :], in_doc, k_ok[None, :], MASK, m, MASK_KIND,
                                 NUM_PATTERNS, CAUSAL, HAS_WINDOW, HAS_SINK_TOKENS)     # [BLOCK_M, BLOCK_N]
        # K, V addressed here rather than offset before the loop: fewer registers
        cols64 = cols.to(tl.int64)
        k = tl.load(K + b * stride_kb + kvh * stride_kh + cols64[:, None] * stride_kn + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)                       # [BLOCK_N, BLOCK_D]
        v = tl.load(V + b * stride_vb + kvh * stride_vh + cols64[:, None] * stride_vn + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)                       # [BLOCK_N, BLOCK_D]
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, sm_scale, q_ok[:, None], False, DOT_MODE,
                                            PRECISION, log_w, True, cap=cap, HAS_SOFTCAP=HAS_SOFTCAP)
    # merge (acc / l, lse_step) into the running (out, lse)
    # NaN rule: a NaN lse on either side makes the merged row NaN (w * NaN, log(NaN)); a
    # non-finite part (a NaN or Inf value was read) is found on the merged row, as w_step * part
    # is then non-finite even for w_step = 0: checked there, where acc is no longer live (the
    # check in finalize spilled 24 B more on sm80/sm90 at D = 256)
    part, row_max, row_sum = finalize(acc, m_i, l_i, q, False)                          # [BLOCK_M, BLOCK_D]
    empty = row_sum == 0.0
    lse_step = tl.where(empty, float("-inf"), row_max + tl.log(tl.where(empty, 1.0, row_sum)))
    o_ptrs = OUT + rows64[:, None] * (HQ * HEAD_DIM) + d[None, :]
    LSE += (b * HQ + h) * NQ
    lse_run = tl.load(LSE + rows, mask=q_ok, other=float("-inf"))
    out_run = tl.load(o_ptrs, mask=tile_mask, other=0.0)
    top = tl.maximum(lse_run, lse_step)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    w_run = tl.exp(lse_run - top_safe)
    w_step = tl.exp(lse_step - top_safe)
    total = w_run + w_step
    none = total == 0.0
    total_safe = tl.where(none, 1.0, total)
    merged = (out_run * w_run[:, None] + part * w_step[:, None]) / total_safe[:, None]
    bad = tl.sum(merged * 0.0, 1)                  # NaN on a non-finite row, else 0
    tl.store(o_ptrs, merged + bad[:, None], mask=tile_mask)
    tl.store(LSE + rows, tl.where(none, float("-inf"), top_safe + tl.log(total_safe)) + bad, mask=q_ok)


@triton.jit
def _ring_step_bwd_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, Q_POS, K_POS, MASK, TILES,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_dob, stride_don, stride_doh,
        NQ, NK, HQ, HEAD_GROUP, sm_scale, softcap,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_KIND: tl.constexpr, NUM_PATTERNS: tl.constexpr,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr,
        PRECISION: tl.constexpr, Q_DOC=None, K_DOC=None, DOCS: tl.constexpr = False,
        HAS_WINDOW: tl.constexpr = False, HAS_SINK_TOKENS: tl.constexpr = False, HAS_SOFTCAP: tl.constexpr = False):
    n_tiles = tl.cdiv(NQ, BLOCK_M)
    tile, b, h = program_tile(n_tiles, HQ)
    kvh = h // HEAD_GROUP
    cap = softcap_terms(softcap, HAS_SOFTCAP)
    row = _list_row(MASK, b, h, MASK_KIND)
    m = _mask_of(MASK, row, MASK_KIND, NUM_PATTERNS, HAS_WINDOW, HAS_SINK_TOKENS)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q_ok = rows < NQ
    rows64 = rows.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tile_mask = q_ok[:, None] & d_ok[None, :]                                              # [BLOCK_M, BLOCK_D]
    qpos = tl.load(Q_POS + rows, mask=q_ok, other=0)                                       # [BLOCK_M]
    Q += b * stride_qb + h * stride_qh
    DO += b * stride_dob + h * stride_doh
    q = tl.load(Q + rows64[:, None] * stride_qn + d[None, :], mask=tile_mask, other=0.0)     # [BLOCK_M, BLOCK_D]
    do = tl.load(DO + rows64[:, None] * stride_don + d[None, :], mask=tile_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    stats = (b * HQ + h) * NQ   # into LSE, DELTA
    lse = tl.load(LSE + stats + rows, mask=q_ok, other=float("-inf"))
    row_max = tl.where(lse == float("-inf"), float("inf"), lse)   # the global lse: P = w exp(s - lse)
    row_log2l = tl.zeros([BLOCK_M], tl.float32)
    delta = tl.load(DELTA + stats + rows, mask=q_ok, other=0.0)
    TILES += (row * n_tiles + tile) * (tl.cdiv(NK, BLOCK_N) + 1)   # this query tile's list of key tiles
    count = tl.load(TILES)
    index_base = TILES + 1
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    t_next = tl.load(index_base, mask=count > 0, other=0)   # read an iteration ahead (as in the forward)
    for j in range(0, count):   # the active key tiles only: a branch-free, pipelined loop
        t = t_next
        t_next = tl.load(index_base + j + 1, mask=j + 1 < count, other=0)
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = cols < NK
        kpos = tl.load(K_POS + cols, mask=k_ok, other=0)                                   # [BLOCK_N]
        in_doc = _same_document(Q_DOC, K_DOC, rows[:, None], cols[None, :], q_ok[:, None], k_ok[None, :], DOCS)
        log_w = _pair_log_weight(qpos[:, None], kpos[None, :], in_doc, k_ok[None, :], MASK, m, MASK_KIND,
                                 NUM_PATTERNS, CAUSAL, HAS_WINDOW, HAS_SINK_TOKENS)       # [BLOCK_M, BLOCK_N]
        # K, V addressed here rather than offset before the loop: fewer registers
        cols64 = cols.to(tl.int64)
        k = tl.load(K + b * stride_kb + kvh * stride_kh + cols64[:, None] * stride_kn + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)                         # [BLOCK_N, BLOCK_D]
        v = tl.load(V + b * stride_vb + kvh * stride_vh + cols64[:, None] * stride_vn + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)                         # [BLOCK_N, BLOCK_D]
        p, ds = softmax_grad_block(q, k, v, do, row_max, row_log2l, delta, sm_scale, q_ok[:, None], False,
                                   DOT_MODE, PRECISION, log_w, True, cap=cap, HAS_SOFTCAP=HAS_SOFTCAP)
        dq += dot(ds.to(k.dtype), k, DOT_MODE, PRECISION)
    dq_ptrs = DQ + (b * NQ * HQ + h) * HEAD_DIM + rows64[:, None] * (HQ * HEAD_DIM) + d[None, :]
    tl.store(dq_ptrs, tl.load(dq_ptrs, mask=tile_mask, other=0.0) + dq * sm_scale, mask=tile_mask)


@triton.jit
def _ring_step_bwd_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV, Q_POS, K_POS, MASK, TILES,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_dob, stride_don, stride_doh,
        NQ, NK, HKV, HEAD_GROUP, sm_scale, softcap,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_KIND: tl.constexpr, NUM_PATTERNS: tl.constexpr,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr,
        PRECISION: tl.constexpr, Q_DOC=None, K_DOC=None, DOCS: tl.constexpr = False,
        HAS_WINDOW: tl.constexpr = False, HAS_SINK_TOKENS: tl.constexpr = False, HAS_SOFTCAP: tl.constexpr = False):
    # BLOCK_M: the key tile this program owns, the M dimension of every dot (S^T = K Q^T,
    # dV += P^T dO, dP^T = V dO^T, dK += dS^T Q: P^T and dS^T feed the next dot from
    # registers); BLOCK_N: the query tiles it walks (its lists are built with these tiles).
    n_tiles = tl.cdiv(NK, BLOCK_M)
    tile, b, kvh = program_tile(n_tiles, HKV)
    cap = softcap_terms(softcap, HAS_SOFTCAP)
    K += b * stride_kb + kvh * stride_kh
    V += b * stride_vb + kvh * stride_vh
    DK += (b * NK * HKV + kvh) * HEAD_DIM
    DV += (b * NK * HKV + kvh) * HEAD_DIM

    keys = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    k_ok = keys < NK
    keys64 = keys.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tile_mask = k_ok[:, None] & d_ok[None, :]                                              # [BLOCK_M, BLOCK_D]
    kpos = tl.load(K_POS + keys, mask=k_ok, other=0)                                       # [BLOCK_M]
    k_doc = kpos   # the key tile's document ids (DOCS), read once
    if DOCS:
        k_doc = tl.load(K_DOC + keys, mask=k_ok, other=-2)
    k = tl.load(K + keys64[:, None] * stride_kn + d[None, :], mask=tile_mask, other=0.0)     # [BLOCK_M, BLOCK_D]
    v = tl.load(V + keys64[:, None] * stride_vn + d[None, :], mask=tile_mask, other=0.0)     # [BLOCK_M, BLOCK_D]
    dk = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # a block table's header (_mask_of) read per query tile (sliding windows; head dims up to 64)
    # rather than once per head: fewer registers there (perf aot, sm80 and sm90: at D = 64 per
    # head spilled 8-12 B on sm80, at D = 128 per tile 52 B on sm90 without a window)
    MASK_PER_TILE: tl.constexpr = (MASK_KIND == MASK_LAYOUT) & (HAS_WINDOW | (BLOCK_D <= 64))
    # this key tile's lists start at tile_lists + row * list_rows; the two held through the head
    # loop rather than the tile and both list dimensions (sm70's D = 128 default spilled 4 B)
    width = tl.cdiv(NQ, BLOCK_N) + 1
    tile_lists = TILES + tile * width
    list_rows = n_tiles * width
    for h in range(kvh * HEAD_GROUP, (kvh + 1) * HEAD_GROUP):
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        stats = (b * HKV * HEAD_GROUP + h) * NQ   # into LSE, DELTA (B, HQ, NQ)
        row = _list_row(MASK, b, h, MASK_KIND)
        if not MASK_PER_TILE:
            m = _mask_of(MASK, row, MASK_KIND, NUM_PATTERNS, HAS_WINDOW, HAS_SINK_TOKENS)
        lists = tile_lists + row * list_rows   # this key tile's query tiles for head h
        count = tl.load(lists)
        index_base = lists + 1
        t_next = tl.load(index_base, mask=count > 0, other=0)   # read an iteration ahead (as in the forward)
        for j in range(0, count):   # the active query tiles only: a branch-free, pipelined loop
            t = t_next
            t_next = tl.load(index_base + j + 1, mask=j + 1 < count, other=0)
            rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
            q_ok = rows < NQ
            qpos = tl.load(Q_POS + rows, mask=q_ok, other=0)                               # [BLOCK_N]
            in_doc = q_ok[None, :]
            if DOCS:
                in_doc = in_doc & (tl.load(Q_DOC + rows, mask=q_ok, other=-1)[None, :] == k_doc[:, None])
            if MASK_PER_TILE:
                m = _mask_of(MASK, row, MASK_KIND, NUM_PATTERNS, HAS_WINDOW, HAS_SINK_TOKENS)
            log_w = _pair_log_weight(qpos[None, :], kpos[:, None], in_doc, k_ok[:, None], MASK, m, MASK_KIND,
                                     NUM_PATTERNS, CAUSAL, HAS_WINDOW, HAS_SINK_TOKENS)   # [BLOCK_M, BLOCK_N]
            rows64 = rows.to(tl.int64)
            qT = tl.load(q_base + rows64[None, :] * stride_qn + d[:, None], mask=d_ok[:, None] & q_ok[None, :],
                         other=0.0)                                                        # [BLOCK_D, BLOCK_N]
            do = tl.load(do_base + rows64[:, None] * stride_don + d[None, :], mask=q_ok[:, None] & d_ok[None, :],
                         other=0.0)                                                        # [BLOCK_N, BLOCK_D]
            lse = tl.load(LSE + stats + rows, mask=q_ok, other=float("-inf"))
            row_max = tl.where(lse == float("-inf"), float("inf"), lse)   # the global lse: P = w exp(s - lse)
            delta = tl.load(DELTA + stats + rows, mask=q_ok, other=0.0)
            # softmax_grad_block transposed: the query statistics broadcast along columns
            s_t = dot(k, qT, DOT_MODE, PRECISION) * sm_scale                             # [BLOCK_M, BLOCK_N]
            if HAS_SOFTCAP:   # capped before the weight; dS^T through the cap (times 1 - tanh^2)
                c, inv_c, _ = cap
                t_t = tanh(s_t * inv_c, qT.dtype == tl.float32)
                s_t = t_t * c
                f_t = (1.0 - t_t * t_t).to(qT.dtype)   # kept in the inputs' dtype (as transposed_grad_step)
            s_t = s_t + log_w
            p_t = tl.math.exp2((s_t - row_max[None, :]) * LOG2E)
            dv += dot(p_t.to(do.dtype), do, DOT_MODE, PRECISION)
            dp_t = dot(v, tl.trans(do), DOT_MODE, PRECISION)                               # [BLOCK_M, BLOCK_N]
            ds_t = p_t * (dp_t - delta[None, :])
            if HAS_SOFTCAP:
                ds_t = ds_t * f_t.to(tl.float32)
            dk += dot(ds_t.to(qT.dtype), tl.trans(qT), DOT_MODE, PRECISION)
    # added in place by reductions (red.add): the old values never pass through registers (a
    # load-add-store spilled 48-84 B on sm90 at D = 128). This program alone writes these rows,
    # so each sum is old + new, as a load and store would give, but for float32 reductions in
    # global memory flushing subnormal results (< 1.2e-38) to zero.
    tl.atomic_add(DK + keys64[:, None] * (HKV * HEAD_DIM) + d[None, :], dk * sm_scale, mask=tile_mask, sem="relaxed")
    tl.atomic_add(DV + keys64[:, None] * (HKV * HEAD_DIM) + d[None, :], dv, mask=tile_mask, sem="relaxed")


# ----------------------------------------------------------------------------- launchers

def _strides(**tensors):
    """stride_<name>b, stride_<name>n, stride_<name>h of (B, N, H, D) tensors, as kernel keywords."""
    return {f"stride_{name}{axis}": t.stride(i) for name, t in tensors.items() for i, axis in enumerate("bnh")}


# a sliding window's dK/dV above head dim 64: at most this many pipeline stages (perf aot, bf16,
# perf/aot/window-sm90-sm80-bf16-triton39.csv: at D = 128 the window predicate made sm80's 64x64
# w8 s3 spill 48 B and sm90's 128x32 w8 s2 20 B; with 1 stage neither spills)
WINDOW_DKDV_STAGES = 1


def _config(q, name, config=None, kernel=None, window=False):
    D = q.shape[-1]
    block_d = padded_head_dim(D)
    cfg = config or select_config(name, q.dtype, block_d, q.shape[1], q.device, kernel=kernel)
    if window and not config and block_d > 64:
        cfg = {**cfg, "num_stages": min(cfg.get("num_stages", 2), WINDOW_DKDV_STAGES)}
    dot_mode, precision = kernel_options(q.dtype, q.device)
    return block_d, cfg, dict(HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                              DOT_MODE=dot_mode, PRECISION=precision, num_warps=cfg.get("num_warps", 4),
                              num_stages=cfg.get("num_stages", 2))


def _mask_args(mask: StepMask, B, H):
    """The mask as kernel keywords (StepMask.kernel_meta: its descriptor and constexprs); its
    tile lists and block table must vary over batch and heads as the call does or broadcast
    (a dilated mask's offsets: one row per query head, _list_row)."""
    LB, LH = mask.list_shape()
    heads = (H,) if mask.kind == step_mask.MASK_DILATED else (1, H)   # dilated: an offset row per query head
    if LB not in (1, B) or LH not in heads:
        raise ValueError(f"the step mask varies over {LB} batch rows and {LH} heads; the call has {B} and {H} "
                         f"(each must match{'' if len(heads) == 1 else ' or be 1'})")
    return mask.kernel_meta()


def _doc_args(q_doc, k_doc):
    """Packed documents' ids per query and key row (ring/documents.py) as kernel keywords."""
    return {} if q_doc is None else dict(Q_DOC=q_doc, K_DOC=k_doc, DOCS=True)


def _tile_lists(q_pos, k_pos, mask: StepMask, block_m, block_n, by_key, docs=None):
    """The active tiles of a step as the kernels' TILES, int32 (LB, LH, tiles, 1 + other tiles):
    per query tile (by_key: per key tile) the number of tiles of the other side with a counted
    pair, then those tiles ascending; (LB, LH): mask.list_shape, read as broadcast."""
    NQ, NK = q_pos.shape[0], k_pos.shape[0]
    LB, LH = mask.list_shape()
    n_q, n_k = triton.cdiv(NQ, block_m), triton.cdiv(NK, block_n)
    n_tiles, n_other = (n_k, n_q) if by_key else (n_q, n_k)
    if mask.kind == step_mask.MASK_DENSE and not mask.causal and not docs:   # every tile
        row = torch.arange(-1, n_other, dtype=torch.int32, device=q_pos.device)
        row[0] = n_other
        return row.expand(LB, LH, n_tiles, n_other + 1).contiguous()
    tiles = torch.empty(LB, LH, n_tiles, n_other + 1, dtype=torch.int32, device=q_pos.device)
    meta = mask.kernel_meta()
    _ring_tile_lists_kernel[(LB * LH * n_tiles,)](
        Q_POS=q_pos, K_POS=k_pos, TILES=tiles, NQ=NQ, NK=NK, **meta, BLOCK_M=block_m, BLOCK_N=block_n,
        BY_KEY=by_key, **(docs or {}))
    return tiles


def _indexed(launcher, name, t, shape):
    """t as the kernels index it, from its shape (B, rows, heads, D): t itself when contiguous,
    else a contiguous copy that the launcher writes back into t (a caller's view)."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{launcher}: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    return t if t.is_contiguous() else t.contiguous()


@on_tensor_device
def step_forward(q, k, v, q_pos, k_pos, out, lse, mask: StepMask, call, *, config=None, q_doc=None, k_doc=None):
    """Fold the shard (k, v at global positions k_pos) into the running out (fp32, like q)
    and lse (fp32 (B, Hq, Nq), contiguous) of the local queries q at q_pos, in place, with the
    AttentionCall's scale and cap (causality is the mask's). q_doc, k_doc: packed documents' ids (int32, per row; ring/documents.py): a pair counts
    only within one document (positions are then the documents' mask positions)."""
    B, NQ, Hq, D = q.shape
    NK, Hkv = k.shape[1], k.shape[2]
    require_contiguous("step_forward", "lse", lse, (B, Hq, NQ))
    if NQ == 0 or NK == 0 or B == 0:
        return
    _, cfg, meta = _config(q, "ring_step_fwd", config)
    docs = _doc_args(q_doc, k_doc)
    o = _indexed("step_forward", "out", out, q.shape)
    _ring_step_fwd_kernel[(triton.cdiv(NQ, cfg["BLOCK_M"]) * B * Hq,)](
        Q=q, K=k, V=v, OUT=o, LSE=lse, Q_POS=q_pos, K_POS=k_pos, **_mask_args(mask, B, Hq), **docs,
        TILES=_tile_lists(q_pos, k_pos, mask, cfg["BLOCK_M"], cfg["BLOCK_N"], False, docs),
        **_strides(q=q, k=k, v=v), NQ=NQ, NK=NK, HQ=Hq, HEAD_GROUP=Hq // Hkv, sm_scale=call.scale,
        **call.kernel_args(), **meta)
    if o is not out:
        out.copy_(o)


@on_tensor_device
def step_backward(q, k, v, do, lse, delta, q_pos, k_pos, dq, dk, dv, mask: StepMask, call, *, config=None,
                  q_doc=None, k_doc=None):
    """Add this shard's contributions to dq (fp32, local) and dk, dv (fp32, travelling);
    lse and delta (fp32 (B, Hq, Nq)) contiguous. q_doc, k_doc: as in step_forward."""
    B, NQ, Hq, D = q.shape
    NK, Hkv = k.shape[1], k.shape[2]
    for name, t in (("lse", lse), ("delta", delta)):
        require_contiguous("step_backward", name, t, (B, Hq, NQ))
    if NQ == 0 or NK == 0 or B == 0:
        return
    # one config for both kernels when given (or tuned); untuned, the dK/dV kernel has its own.
    # dQ: BLOCK_M query rows x BLOCK_N keys; dK/dV: BLOCK_M keys x BLOCK_N queries
    _, cfg, meta = _config(q, "ring_step_bwd", config)
    _, kv_cfg, kv_meta = _config(q, "ring_step_bwd", config, kernel="ring_step_bwd_dkdv",
                                 window=mask.window is not None)
    docs = _doc_args(q_doc, k_doc)
    acc = [_indexed("step_backward", name, t, shape) for name, t, shape in
           (("dq", dq, q.shape), ("dk", dk, k.shape), ("dv", dv, v.shape))]
    common = dict(Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, Q_POS=q_pos, K_POS=k_pos, **_mask_args(mask, B, Hq),
                  **docs, **_strides(q=q, k=k, v=v, do=do), NQ=NQ, NK=NK, HEAD_GROUP=Hq // Hkv, sm_scale=call.scale,
                  **call.kernel_args())
    _ring_step_bwd_dq_kernel[(triton.cdiv(NQ, cfg["BLOCK_M"]) * B * Hq,)](
        **common, **meta, DQ=acc[0], HQ=Hq,
        TILES=_tile_lists(q_pos, k_pos, mask, cfg["BLOCK_M"], cfg["BLOCK_N"], False, docs))
    _ring_step_bwd_dkdv_kernel[(triton.cdiv(NK, kv_cfg["BLOCK_M"]) * B * Hkv,)](
        **common, **kv_meta, DK=acc[1], DV=acc[2], HKV=Hkv,
        TILES=_tile_lists(q_pos, k_pos, mask, kv_cfg["BLOCK_N"], kv_cfg["BLOCK_M"], True, docs))
    for t, a in zip((dq, dk, dv), acc):
        if a is not t:
            t.copy_(a)
