"""The ring-local-block step kernels and their launchers: this rank's queries against a
key/value shard that came from another rank, with the mask evaluated on *global* positions, merged into the running
float32 (out, lse) in place; and its backward (dQ into a local accumulator, dK/dV into
the accumulators that travel with the shard).

Masks (MASK_KIND): 0 dense; 1 dilated (the weight of a pair is how many of the head's
patterns select it: p, p' in one segment, both with the head's residue; LongNet's
multiset union); 2 block layout (a dense (n_blocks x n_blocks) table looked up per
element). Causal multiplies in p' <= p. Weights enter the softmax as ln(weight) added to
the score (-inf where 0), after the soft cap (SOFTCAP > 0: s -> c * tanh(s / c)); a key tile
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
from ..common.kernels import (LOG2E, dot, finalize, online_softmax_step, program_tile, softmax_grad_block, tanh,
                              window_keep)
from ..common.runtime import kernel_options, on_tensor_device, require_contiguous
from . import mask as step_mask
from .mask import StepMask

# the mask kinds as compile-time constants of the kernels
MASK_DILATED: tl.constexpr = tl.constexpr(step_mask.MASK_DILATED)
MASK_LAYOUT: tl.constexpr = tl.constexpr(step_mask.MASK_LAYOUT)


# Q, K, V, dO and the caller's accumulators OUT, DQ, DK, DV (views allowed, unit stride on
# the head dim) come with their (batch, sequence, head) strides. LSE and DELTA (B, HQ, NQ)
# are contiguous and indexed from their shapes. LAYOUT (LB, LH, n_blocks, LAYOUT_COLS) is
# contiguous but for its batch and head strides (zero where the layout broadcasts).

@triton.jit
def _pair_log_weight(qpos, kpos, q_ok, k_ok, PAT_W, PAT_R, PAT_OFF, LAYOUT, LAYOUT_COLS, layout_block,
                     MASK_KIND: tl.constexpr, NUM_PATTERNS: tl.constexpr, CAUSAL: tl.constexpr,
                     WINDOW: tl.constexpr = 0, SINK_TOKENS: tl.constexpr = 0):
    """ln(weight) of each (query, key) pair, -inf where it does not count, for query and key
    positions (and in-range flags) given as a column and a row: qpos [BLOCK_M, 1], kpos
    [1, BLOCK_N] give [BLOCK_M, BLOCK_N]; qpos [1, BLOCK_N], kpos [BLOCK_M, 1] the transpose
    (the dK/dV kernel's keys x queries). PAT_OFF and LAYOUT point at the head's offsets and
    block table. WINDOW > 0: a block-table entry of 2 is a sliding window's block, where
    window_keep decides per element."""
    ok = q_ok & k_ok
    if CAUSAL:
        ok = ok & (kpos <= qpos)
    if MASK_KIND == MASK_DILATED:
        count = tl.zeros(ok.shape, tl.float32)
        for i in tl.static_range(NUM_PATTERNS):   # unrolled: a nested loop would stop the pipeliner
            o = tl.load(PAT_OFF + i)
            w = tl.load(PAT_W + i)
            r = tl.load(PAT_R + i)
            q_seg = qpos // w
            k_seg = kpos // w
            q_on = (o >= 0) & ((qpos - q_seg * w) % r == o)
            k_on = (o >= 0) & ((kpos - k_seg * w) % r == o)
            hit = (q_seg == k_seg) & q_on & k_on
            count += hit.to(tl.float32)
        ok = ok & (count > 0)
        return tl.where(ok, tl.log(tl.maximum(count, 1.0)), float("-inf"))
    if MASK_KIND == MASK_LAYOUT:
        qb = (qpos // layout_block).to(tl.int64)   # qb * row stride passes 2^31 past ~46K blocks
        kb = (kpos // layout_block).to(tl.int64)
        active = tl.load(LAYOUT + qb * LAYOUT_COLS + kb, mask=ok, other=0)
        ok = ok & (active != 0)
        if WINDOW > 0:
            ok = ok & ((active != 2) | window_keep(qpos, kpos, WINDOW, SINK_TOKENS))
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
        Q_POS, K_POS, PAT_W, PAT_R, PAT_OFF, LAYOUT, COUNT, INDEX, stride_lb, stride_lh, LAYOUT_COLS,
        NQ, NK, LH, layout_block,
        MASK_KIND: tl.constexpr, NUM_PATTERNS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BY_KEY: tl.constexpr, Q_DOC=None, K_DOC=None, DOCS: tl.constexpr = False,
        WINDOW: tl.constexpr = 0, SINK_TOKENS: tl.constexpr = 0):
    """The active tiles of a step: for one query tile (BY_KEY: one key tile) of one (layout
    batch, head) row, the ascending tiles of the other side with a counted pair, written to
    INDEX (LB, LH, tiles, other tiles) with their number in COUNT (LB, LH, tiles)."""
    n_tiles = tl.cdiv(NK, BLOCK_N) if BY_KEY else tl.cdiv(NQ, BLOCK_M)
    n_other = tl.cdiv(NQ, BLOCK_M) if BY_KEY else tl.cdiv(NK, BLOCK_N)
    tile, b, h = program_tile(n_tiles, LH)
    row = (b * LH + h) * n_tiles + tile
    INDEX += row * n_other
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
        log_w = _pair_log_weight(qpos[:, None], kpos[None, :], in_doc, k_ok[None, :], PAT_W, PAT_R,
                                 PAT_OFF + h * NUM_PATTERNS, LAYOUT + b * stride_lb + h * stride_lh, LAYOUT_COLS,
                                 layout_block, MASK_KIND, NUM_PATTERNS, CAUSAL,
                                 WINDOW, SINK_TOKENS)                                    # [BLOCK_M, BLOCK_N]
        active = tl.max(log_w) > float("-inf")
        tl.store(INDEX + count, t, mask=active)
        count += active.to(tl.int32)
    tl.store(COUNT + row, count)


@triton.jit
def _ring_step_fwd_kernel(
        Q, K, V, OUT, LSE, Q_POS, K_POS, PAT_W, PAT_R, PAT_OFF, LAYOUT, TILE_COUNT, TILE_INDEX,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_ob, stride_on, stride_oh, stride_lb, stride_lh, LAYOUT_COLS, stride_tb, stride_th, TILE_WIDTH,
        NQ, NK, HQ, HEAD_GROUP, sm_scale, layout_block,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_KIND: tl.constexpr, NUM_PATTERNS: tl.constexpr,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr,
        PRECISION: tl.constexpr, Q_DOC=None, K_DOC=None, DOCS: tl.constexpr = False,
        WINDOW: tl.constexpr = 0, SINK_TOKENS: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0):
    tile, b, h = program_tile(tl.cdiv(NQ, BLOCK_M), HQ)
    kvh = h // HEAD_GROUP
    Q += b * stride_qb + h * stride_qh
    OUT += b * stride_ob + h * stride_oh
    PAT_OFF += h * NUM_PATTERNS
    LAYOUT += b * stride_lb + h * stride_lh

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
    lists = b * stride_tb + h * stride_th + tile   # this query tile's list of key tiles
    count = tl.load(TILE_COUNT + lists)
    index_base = TILE_INDEX + lists * TILE_WIDTH
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
        log_w = _pair_log_weight(qpos[:, None], kpos[None, :], in_doc, k_ok[None, :], PAT_W, PAT_R, PAT_OFF,
                                 LAYOUT, LAYOUT_COLS, layout_block, MASK_KIND, NUM_PATTERNS,
                                 CAUSAL, WINDOW, SINK_TOKENS)                            # [BLOCK_M, BLOCK_N]
        # K, V addressed here rather than offset before the loop: fewer registers
        cols64 = cols.to(tl.int64)
        k = tl.load(K + b * stride_kb + kvh * stride_kh + cols64[:, None] * stride_kn + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)                       # [BLOCK_N, BLOCK_D]
        v = tl.load(V + b * stride_vb + kvh * stride_vh + cols64[:, None] * stride_vn + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)                       # [BLOCK_N, BLOCK_D]
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, sm_scale, q_ok[:, None], False, DOT_MODE,
                                            PRECISION, log_w, True, SOFTCAP=SOFTCAP)
    # merge (acc / l, lse_step) into the running (out, lse)
    # NaN rule: a NaN lse on either side makes the merged row NaN (w * NaN, log(NaN)); a
    # non-finite part (a NaN or Inf value was read) is found on the merged row, as w_step * part
    # is then non-finite even for w_step = 0: checked there, where acc is no longer live (the
    # check in finalize spilled 24 B more on sm80/sm90 at D = 256)
    part, row_max, row_sum = finalize(acc, m_i, l_i, q, False)                          # [BLOCK_M, BLOCK_D]
    empty = row_sum == 0.0
    lse_step = tl.where(empty, float("-inf"), row_max + tl.log(tl.where(empty, 1.0, row_sum)))
    o_ptrs = OUT + rows64[:, None] * stride_on + d[None, :]
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
        Q, K, V, DO, LSE, DELTA, DQ, Q_POS, K_POS, PAT_W, PAT_R, PAT_OFF, LAYOUT, TILE_COUNT, TILE_INDEX,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_dob, stride_don, stride_doh, stride_dqb, stride_dqn, stride_dqh, stride_lb, stride_lh, LAYOUT_COLS,
        stride_tb, stride_th, TILE_WIDTH,
        NQ, NK, HQ, HEAD_GROUP, sm_scale, layout_block,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_KIND: tl.constexpr, NUM_PATTERNS: tl.constexpr,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr,
        PRECISION: tl.constexpr, Q_DOC=None, K_DOC=None, DOCS: tl.constexpr = False,
        WINDOW: tl.constexpr = 0, SINK_TOKENS: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0):
    tile, b, h = program_tile(tl.cdiv(NQ, BLOCK_M), HQ)
    kvh = h // HEAD_GROUP
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
    lists = b * stride_tb + h * stride_th + tile   # this query tile's list of key tiles
    count = tl.load(TILE_COUNT + lists)
    index_base = TILE_INDEX + lists * TILE_WIDTH
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    t_next = tl.load(index_base, mask=count > 0, other=0)   # read an iteration ahead (as in the forward)
    for j in range(0, count):   # the active key tiles only: a branch-free, pipelined loop
        t = t_next
        t_next = tl.load(index_base + j + 1, mask=j + 1 < count, other=0)
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = cols < NK
        kpos = tl.load(K_POS + cols, mask=k_ok, other=0)                                   # [BLOCK_N]
        in_doc = _same_document(Q_DOC, K_DOC, rows[:, None], cols[None, :], q_ok[:, None], k_ok[None, :], DOCS)
        log_w = _pair_log_weight(qpos[:, None], kpos[None, :], in_doc, k_ok[None, :], PAT_W, PAT_R,
                                 PAT_OFF + h * NUM_PATTERNS, LAYOUT + b * stride_lb + h * stride_lh, LAYOUT_COLS,
                                 layout_block, MASK_KIND, NUM_PATTERNS, CAUSAL,
                                 WINDOW, SINK_TOKENS)                                      # [BLOCK_M, BLOCK_N]
        # K, V addressed here rather than offset before the loop: fewer registers
        cols64 = cols.to(tl.int64)
        k = tl.load(K + b * stride_kb + kvh * stride_kh + cols64[:, None] * stride_kn + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)                         # [BLOCK_N, BLOCK_D]
        v = tl.load(V + b * stride_vb + kvh * stride_vh + cols64[:, None] * stride_vn + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)                         # [BLOCK_N, BLOCK_D]
        p, ds = softmax_grad_block(q, k, v, do, row_max, row_log2l, delta, sm_scale, q_ok[:, None], False,
                                   DOT_MODE, PRECISION, log_w, True, SOFTCAP=SOFTCAP)
        dq += dot(ds.to(k.dtype), k, DOT_MODE, PRECISION)
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + rows64[:, None] * stride_dqn + d[None, :]
    tl.store(dq_ptrs, tl.load(dq_ptrs, mask=tile_mask, other=0.0) + dq * sm_scale, mask=tile_mask)


@triton.jit
def _ring_step_bwd_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV, Q_POS, K_POS, PAT_W, PAT_R, PAT_OFF, LAYOUT, TILE_COUNT, TILE_INDEX,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_dob, stride_don, stride_doh, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
        stride_lb, stride_lh, LAYOUT_COLS, stride_tb, stride_th, TILE_WIDTH,
        NQ, NK, HKV, HEAD_GROUP, sm_scale, layout_block,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_KIND: tl.constexpr, NUM_PATTERNS: tl.constexpr,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr,
        PRECISION: tl.constexpr, Q_DOC=None, K_DOC=None, DOCS: tl.constexpr = False,
        WINDOW: tl.constexpr = 0, SINK_TOKENS: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0):
    # BLOCK_M: the key tile this program owns, the M dimension of every dot (S^T = K Q^T,
    # dV += P^T dO, dP^T = V dO^T, dK += dS^T Q: P^T and dS^T feed the next dot from
    # registers); BLOCK_N: the query tiles it walks (its lists are built with these tiles).
    tile, b, kvh = program_tile(tl.cdiv(NK, BLOCK_M), HKV)
    K += b * stride_kb + kvh * stride_kh
    V += b * stride_vb + kvh * stride_vh
    DK += b * stride_dkb + kvh * stride_dkh
    DV += b * stride_dvb + kvh * stride_dvh

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
    for h in range(kvh * HEAD_GROUP, (kvh + 1) * HEAD_GROUP):
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        stats = (b * HKV * HEAD_GROUP + h) * NQ   # into LSE, DELTA (B, HQ, NQ)
        pat_off = PAT_OFF + h * NUM_PATTERNS
        layout = LAYOUT + b * stride_lb + h * stride_lh
        lists = b * stride_tb + h * stride_th + tile   # this key tile's list of query tiles for head h
        count = tl.load(TILE_COUNT + lists)
        index_base = TILE_INDEX + lists * TILE_WIDTH
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
            log_w = _pair_log_weight(qpos[None, :], kpos[:, None], in_doc, k_ok[:, None], PAT_W, PAT_R,
                                     pat_off, layout, LAYOUT_COLS, layout_block, MASK_KIND, NUM_PATTERNS,
                                     CAUSAL, WINDOW, SINK_TOKENS)                          # [BLOCK_M, BLOCK_N]
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
            if SOFTCAP > 0:   # capped before the weight; dS^T through the cap (times 1 - tanh^2)
                t_t = tanh(s_t * (1.0 / SOFTCAP), qT.dtype == tl.float32)
                s_t = t_t * SOFTCAP
                f_t = (1.0 - t_t * t_t).to(qT.dtype)   # kept in the inputs' dtype (as transposed_grad_step)
            s_t = s_t + log_w
            p_t = tl.math.exp2((s_t - row_max[None, :]) * LOG2E)
            dv += dot(p_t.to(do.dtype), do, DOT_MODE, PRECISION)
            dp_t = dot(v, tl.trans(do), DOT_MODE, PRECISION)                               # [BLOCK_M, BLOCK_N]
            ds_t = p_t * (dp_t - delta[None, :])
            if SOFTCAP > 0:
                ds_t = ds_t * f_t.to(tl.float32)
            dk += dot(ds_t.to(qT.dtype), tl.trans(qT), DOT_MODE, PRECISION)
    # added in place by reductions (red.add): the old values never pass through registers (a
    # load-add-store spilled 48-84 B on sm90 at D = 128). This program alone writes these rows,
    # so each sum is old + new, as a load and store would give, but for float32 reductions in
    # global memory flushing subnormal results (< 1.2e-38) to zero.
    tl.atomic_add(DK + keys64[:, None] * stride_dkn + d[None, :], dk * sm_scale, mask=tile_mask, sem="relaxed")
    tl.atomic_add(DV + keys64[:, None] * stride_dvn + d[None, :], dv, mask=tile_mask, sem="relaxed")


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
    """The mask's tables and constants as kernel keywords; the block table is read through
    zero batch/head strides where it broadcasts."""
    lay = mask.layout.contiguous()
    t = lay.expand(B, H, *lay.shape[2:])
    return dict(PAT_W=mask.pat_w, PAT_R=mask.pat_r, PAT_OFF=mask.pat_off, LAYOUT=lay, stride_lb=t.stride(0),
                stride_lh=t.stride(1), LAYOUT_COLS=lay.shape[3], layout_block=mask.layout_block, **mask.kernel_meta())


def _list_shape(mask: StepMask, Hq):
    """(LB, LH) of the tile lists: what the mask varies over (the dilated offsets differ per
    query head; a block table may have batch and head dimensions)."""
    if mask.kind == step_mask.MASK_DILATED:
        return 1, Hq
    if mask.kind == step_mask.MASK_LAYOUT:
        return tuple(mask.layout.shape[:2])
    return 1, 1


def _doc_args(q_doc, k_doc):
    """Packed documents' ids per query and key row (ring/documents.py) as kernel keywords."""
    return {} if q_doc is None else dict(Q_DOC=q_doc, K_DOC=k_doc, DOCS=True)


def _tile_lists(q_pos, k_pos, mask: StepMask, B, Hq, block_m, block_n, by_key, docs=None):
    """The active tiles of a step as kernel keywords: TILE_COUNT (LB, LH, tiles) and
    TILE_INDEX (LB, LH, tiles, other tiles), per query tile its key tiles with a counted pair
    (by_key: per key tile its query tiles), read through zero strides where they broadcast."""
    NQ, NK = q_pos.shape[0], k_pos.shape[0]
    LB, LH = _list_shape(mask, Hq)
    n_q, n_k = triton.cdiv(NQ, block_m), triton.cdiv(NK, block_n)
    n_tiles, n_other = (n_k, n_q) if by_key else (n_q, n_k)
    count = torch.empty(LB, LH, n_tiles, dtype=torch.int32, device=q_pos.device)
    if mask.kind == step_mask.MASK_DENSE and not mask.causal and not docs:   # every tile
        count.fill_(n_other)
        index = torch.arange(n_other, dtype=torch.int32, device=q_pos.device).expand(LB, LH, n_tiles, n_other)
    else:
        index = torch.empty(LB, LH, n_tiles, n_other, dtype=torch.int32, device=q_pos.device)
        _ring_tile_lists_kernel[(LB * LH * n_tiles,)](
            Q_POS=q_pos, K_POS=k_pos, **_mask_args(mask, LB, LH), COUNT=count, INDEX=index, NQ=NQ, NK=NK, LH=LH,
            BLOCK_M=block_m, BLOCK_N=block_n, BY_KEY=by_key, **(docs or {}))
    c = count.expand(B, Hq, n_tiles)
    return dict(TILE_COUNT=count, TILE_INDEX=index.contiguous(), stride_tb=c.stride(0), stride_th=c.stride(1),
                TILE_WIDTH=n_other)


@on_tensor_device
def step_forward(q, k, v, q_pos, k_pos, out, lse, mask: StepMask, *, scale, config=None, q_doc=None, k_doc=None):
    """Fold the shard (k, v at global positions k_pos) into the running out (fp32, like q)
    and lse (fp32 (B, Hq, Nq), contiguous) of the local queries q at q_pos, in place.
    q_doc, k_doc: packed documents' ids (int32, per row; ring/documents.py): a pair counts
    only within one document (positions are then the documents' mask positions)."""
    B, NQ, Hq, D = q.shape
    NK, Hkv = k.shape[1], k.shape[2]
    require_contiguous("step_forward", "lse", lse, (B, Hq, NQ))
    if NQ == 0 or NK == 0 or B == 0:
        return
    _, cfg, meta = _config(q, "ring_step_fwd", config)
    docs = _doc_args(q_doc, k_doc)
    _ring_step_fwd_kernel[(triton.cdiv(NQ, cfg["BLOCK_M"]) * B * Hq,)](
        Q=q, K=k, V=v, OUT=out, LSE=lse, Q_POS=q_pos, K_POS=k_pos, **_mask_args(mask, B, Hq), **docs,
        **_tile_lists(q_pos, k_pos, mask, B, Hq, cfg["BLOCK_M"], cfg["BLOCK_N"], False, docs),
        **_strides(q=q, k=k, v=v, o=out), NQ=NQ, NK=NK, HQ=Hq, HEAD_GROUP=Hq // Hkv, sm_scale=scale,
        SOFTCAP=float(mask.softcap or 0.0), **meta)


@on_tensor_device
def step_backward(q, k, v, do, lse, delta, q_pos, k_pos, dq, dk, dv, mask: StepMask, *, scale, config=None,
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
    common = dict(Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, Q_POS=q_pos, K_POS=k_pos, **_mask_args(mask, B, Hq),
                  **docs,
                  **_strides(q=q, k=k, v=v, do=do), NQ=NQ, NK=NK, HEAD_GROUP=Hq // Hkv, sm_scale=scale,
                  SOFTCAP=float(mask.softcap or 0.0))
    _ring_step_bwd_dq_kernel[(triton.cdiv(NQ, cfg["BLOCK_M"]) * B * Hq,)](
        **common, **meta, DQ=dq, **_strides(dq=dq), HQ=Hq,
        **_tile_lists(q_pos, k_pos, mask, B, Hq, cfg["BLOCK_M"], cfg["BLOCK_N"], False, docs))
    _ring_step_bwd_dkdv_kernel[(triton.cdiv(NK, kv_cfg["BLOCK_M"]) * B * Hkv,)](
        **common, **kv_meta, DK=dk, DV=dv, **_strides(dk=dk, dv=dv), HKV=Hkv,
        **_tile_lists(q_pos, k_pos, mask, B, Hq, kv_cfg["BLOCK_N"], kv_cfg["BLOCK_M"], True, docs))
