"""Triton block-sparse attention kernels and their launchers: forward and dQ walk each query
tile's kv block list, dK/dV walk each key tile's transposed q block list (deterministic, no
atomics). The public function and its autograd are in interface.py.

A program owns BLOCK_M query rows (BLOCK_M divides the layout block size) and, for each
active key block of its layout row, streams the block in BLOCK_N sub-tiles through the
shared online softmax. Element masks run only where they matter: the causal diagonal
block and the ragged last key block (N not a multiple of the block size); key blocks
above the diagonal are skipped when causal. Layouts broadcast over batch and heads by
zero strides. GQA: query head h reads key/value head h // (Hq // Hkv); the dK/dV program
of a key/value head loops over its query heads.

Work: 4*D*(active pairs) forward FLOPs; K/V bytes move once per (query tile, active
block), Q and O once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...configs import select_config
from ..common.hardware import padded_head_dim
from ..common.kernels import dot, finalize, load_key_block, load_row_stats, online_softmax_step, softmax_grad_block
from ..common.lse import softmax_delta
from ..common.runtime import kernel_options, last_dim_contiguous, on_tensor_device


@triton.jit
def _block_sparse_fwd_kernel(
        Q, K, V, O, ROW_MAX, ROW_SUM, KV_COUNT, KV_INDEX,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
        stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh, stride_lb, stride_lh,
        stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
        N, NUM_HEADS, HEAD_GROUP, sm_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    # one flat grid axis, tiles of a head adjacent (a second axis caps batch x heads at 65,535)
    n_tiles = tl.cdiv(N, BLOCK_M)
    tile = tl.program_id(0) % n_tiles
    bh = (tl.program_id(0) // n_tiles).to(tl.int64)   # int64 head: head * head-stride may pass 2^31
    b = bh // NUM_HEADS
    h = bh % NUM_HEADS
    kvh = h // HEAD_GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    qblock = (tile * BLOCK_M) // BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rows64 = rows.to(tl.int64)

    q = tl.load(Q + b * stride_qb + h * stride_qh + rows64[:, None] * stride_qn + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh + d[None, :]
    v_base = V + b * stride_vb + kvh * stride_vh + d[None, :]
    count = tl.load(KV_COUNT + b * stride_cb + h * stride_ch + qblock)
    index_base = KV_INDEX + b * stride_ib + h * stride_ih + qblock.to(tl.int64) * stride_ir
    last_row = tl.minimum(tile * BLOCK_M + BLOCK_M, N) - 1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(0, count):
        kblock = tl.load(index_base + j)
        start = kblock * BLOCK_SIZE
        end = tl.minimum(start + BLOCK_SIZE, N)
        if CAUSAL:
            end = tl.minimum(end, last_row + 1)     # keys after the tile's last row: skipped
        # element masks only on the causal diagonal and the ragged last block
        needs_mask = (start + BLOCK_SIZE > N)
        if CAUSAL:
            needs_mask = needs_mask | (start + BLOCK_SIZE > tile * BLOCK_M)
        for n0 in range(start, end, BLOCK_N):
            if needs_mask:
                k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, n0, 1, 0, end - n0, rows, row_ok,
                                            d_ok, CAUSAL, True, BLOCK_N)
                acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, sm_scale, mask, True, DOT_FP32, PRECISION)
            else:
                k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, n0, 1, 0, end - n0, rows, row_ok,
                                            d_ok, CAUSAL, False, BLOCK_N)
                acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, sm_scale, mask, False, DOT_FP32,
                                                    PRECISION)
    out = finalize(acc, m_i, l_i)
    tl.store(O + b * stride_ob + h * stride_oh + rows64[:, None] * stride_on + d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(ROW_MAX + b * stride_lb + h * stride_lh + rows, m_i, mask=row_ok)
    tl.store(ROW_SUM + b * stride_lb + h * stride_lh + rows, l_i, mask=row_ok)


@triton.jit
def _block_sparse_bwd_dq_kernel(
        Q, K, V, DO, ROW_MAX, ROW_SUM, DELTA, DQ, KV_COUNT, KV_INDEX,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
        stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
        stride_dqb, stride_dqn, stride_dqh, stride_lb, stride_lh,
        stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
        N, NUM_HEADS, HEAD_GROUP, sm_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    # one flat grid axis, tiles of a head adjacent (a second axis caps batch x heads at 65,535)
    n_tiles = tl.cdiv(N, BLOCK_M)
    tile = tl.program_id(0) % n_tiles
    bh = (tl.program_id(0) // n_tiles).to(tl.int64)   # int64 head: head * head-stride may pass 2^31
    b = bh // NUM_HEADS
    h = bh % NUM_HEADS
    kvh = h // HEAD_GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    qblock = (tile * BLOCK_M) // BLOCK_SIZE
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
    count = tl.load(KV_COUNT + b * stride_cb + h * stride_ch + qblock)
    index_base = KV_INDEX + b * stride_ib + h * stride_ih + qblock.to(tl.int64) * stride_ir
    last_row = tl.minimum(tile * BLOCK_M + BLOCK_M, N) - 1

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(0, count):
        kblock = tl.load(index_base + j)
        start = kblock * BLOCK_SIZE
        end = tl.minimum(start + BLOCK_SIZE, N)
        if CAUSAL:
            end = tl.minimum(end, last_row + 1)
        needs_mask = (start + BLOCK_SIZE > N)
        if CAUSAL:
            needs_mask = needs_mask | (start + BLOCK_SIZE > tile * BLOCK_M)
        for n0 in range(start, end, BLOCK_N):
            if needs_mask:
                k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, n0, 1, 0, end - n0, rows, row_ok,
                                            d_ok, CAUSAL, True, BLOCK_N)
                p, ds = softmax_grad_block(q, k, v, do, row_max, row_log2l, delta, sm_scale, mask, True,
                                           DOT_FP32, PRECISION)
            else:
                k, v, mask = load_key_block(k_base, v_base, stride_kn, stride_vn, n0, 1, 0, end - n0, rows, row_ok,
                                            d_ok, CAUSAL, False, BLOCK_N)
                p, ds = softmax_grad_block(q, k, v, do, row_max, row_log2l, delta, sm_scale, mask, False,
                                           DOT_FP32, PRECISION)
            dq += dot(ds.to(k.dtype), k, DOT_FP32, PRECISION)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows64[:, None] * stride_dqn + d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=tile_mask)


@triton.jit
def _block_sparse_bwd_dkdv_kernel(
        Q, K, V, DO, ROW_MAX, ROW_SUM, DELTA, DK, DV, Q_COUNT, Q_INDEX,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
        stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
        stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_lb, stride_lh,
        stride_cb, stride_ch, stride_ib, stride_ih, stride_ir,
        N, NUM_HEADS, NUM_KV_HEADS, HEAD_GROUP, sm_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    # this program: BLOCK_N keys of one key/value head; walks BLOCK_M query sub-tiles
    # one flat grid axis, tiles of a head adjacent (a second axis caps batch x heads at 65,535)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0) % n_tiles
    bh = (tl.program_id(0) // n_tiles).to(tl.int64)   # int64 head: head * head-stride may pass 2^31
    b = bh // NUM_KV_HEADS
    kvh = bh % NUM_KV_HEADS
    keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = keys < N
    kblock = (tile * BLOCK_N) // BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m_off = tl.arange(0, BLOCK_M)
    keys64 = keys.to(tl.int64)
    tile_mask = key_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * stride_kb + kvh * stride_kh + keys64[:, None] * stride_kn + d[None, :], mask=tile_mask, other=0.0)
    v = tl.load(V + b * stride_vb + kvh * stride_vh + keys64[:, None] * stride_vn + d[None, :], mask=tile_mask, other=0.0)
    first_key = tile * BLOCK_N
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for h in range(kvh * HEAD_GROUP, (kvh + 1) * HEAD_GROUP):
        q_base = Q + b * stride_qb + h * stride_qh + d[None, :]
        do_base = DO + b * stride_dob + h * stride_doh + d[None, :]
        stats = b * stride_lb + h * stride_lh
        count = tl.load(Q_COUNT + b * stride_cb + h * stride_ch + kblock)
        index_base = Q_INDEX + b * stride_ib + h * stride_ih + kblock.to(tl.int64) * stride_ir
        for j in range(0, count):
            qblock = tl.load(index_base + j)
            start = qblock * BLOCK_SIZE
            end = tl.minimum(start + BLOCK_SIZE, N)
            if CAUSAL:
                start = tl.maximum(start, (first_key // BLOCK_M) * BLOCK_M)   # queries before the keys: none
            # queries past N load as zero with empty statistics (P = 0): no mask needed for them
            needs_mask = False
            if CAUSAL:
                needs_mask = qblock * BLOCK_SIZE < first_key + BLOCK_N
            for m0 in range(start, end, BLOCK_M):
                qrows = m0 + m_off
                q_ok = qrows < end
                qrows64 = qrows.to(tl.int64)
                qt = tl.load(q_base + qrows64[:, None] * stride_qn, mask=q_ok[:, None] & d_ok[None, :], other=0.0)
                dot_ = tl.load(do_base + qrows64[:, None] * stride_don, mask=q_ok[:, None] & d_ok[None, :], other=0.0)
                row_max, row_log2l = load_row_stats(ROW_MAX, ROW_SUM, stats + qrows, q_ok)
                delta = tl.load(DELTA + stats + qrows, mask=q_ok, other=0.0)
                if needs_mask:
                    mask = keys[None, :] <= qrows[:, None]
                    p, ds = softmax_grad_block(qt, k, v, dot_, row_max, row_log2l, delta, sm_scale, mask, True,
                                               DOT_FP32, PRECISION)
                else:
                    p, ds = softmax_grad_block(qt, k, v, dot_, row_max, row_log2l, delta, sm_scale, q_ok[:, None],
                                               False, DOT_FP32, PRECISION)
                dv += dot(tl.trans(p.to(dot_.dtype)), dot_, DOT_FP32, PRECISION)
                dk += dot(tl.trans(ds.to(qt.dtype)), qt, DOT_FP32, PRECISION)
    tl.store(DK + b * stride_dkb + kvh * stride_dkh + keys64[:, None] * stride_dkn + d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=tile_mask)
    tl.store(DV + b * stride_dvb + kvh * stride_dvh + keys64[:, None] * stride_dvn + d[None, :],
             dv.to(DV.dtype.element_ty), mask=tile_mask)


# ----------------------------------------------------------------------------- launchers

def _layout_args(counts, indices, B, H):
    """Broadcast (B|1, H|1, ...) lists to (B, H, ...) by zero strides."""
    c = counts.expand(B, H, counts.shape[2])
    i = indices.expand(B, H, *indices.shape[2:])
    return c, i, (c.stride(0), c.stride(1), i.stride(0), i.stride(1), i.stride(2))


def _tiles(cfg, block_size):
    bm, bn = min(cfg["BLOCK_M"], block_size), min(cfg["BLOCK_N"], block_size)
    return bm, bn


@on_tensor_device
def block_sparse_forward(q, k, v, layout, *, causal, scale, config=None):
    B, N, Hq, D = q.shape
    Hkv = k.shape[2]
    block_d = padded_head_dim(D)
    cfg = config or select_config("block_sparse_fwd", q.dtype, block_d, N, q.device)
    bm, bn = _tiles(cfg, layout.block_size)
    out = torch.empty(B, N, Hq, D, dtype=q.dtype, device=q.device)
    row_max = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    row_sum = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    counts, index, lay_strides = _layout_args(layout.kv_num_blocks, layout.kv_indices, B, Hq)
    dot_fp32, precision = kernel_options(q.dtype, q.device)
    _block_sparse_fwd_kernel[(triton.cdiv(N, bm) * B * Hq,)](
        q, k, v, out, row_max, row_sum, counts, index,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        row_max.stride(0), row_max.stride(1), *lay_strides,
        N, Hq, Hq // Hkv, scale,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_SIZE=layout.block_size, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn,
        DOT_FP32=dot_fp32, PRECISION=precision, num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2))
    return out, row_max, row_sum


@on_tensor_device
def block_sparse_backward(do, dlse, q, k, v, out, row_max, row_sum, layout, *, causal, scale, config=None):
    B, N, Hq, D = q.shape
    Hkv = k.shape[2]
    block_d = padded_head_dim(D)
    cfg = config or select_config("block_sparse_bwd", q.dtype, block_d, N, q.device)
    bm, bn = _tiles(cfg, layout.block_size)
    do = last_dim_contiguous(do)
    delta = softmax_delta(do, out, dlse)
    dot_fp32, precision = kernel_options(q.dtype, q.device)
    common = dict(HEAD_DIM=D, BLOCK_D=block_d, BLOCK_SIZE=layout.block_size, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn,
                  DOT_FP32=dot_fp32, PRECISION=precision, num_warps=cfg.get("num_warps", 4),
                  num_stages=cfg.get("num_stages", 2))
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
    dq = torch.empty(B, N, Hq, D, dtype=q.dtype, device=q.device)
    counts, index, lay_strides = _layout_args(layout.kv_num_blocks, layout.kv_indices, B, Hq)
    _block_sparse_bwd_dq_kernel[(triton.cdiv(N, bm) * B * Hq,)](
        q, k, v, do, row_max, row_sum, delta, dq, counts, index, *strides,
        dq.stride(0), dq.stride(1), dq.stride(2), row_max.stride(0), row_max.stride(1), *lay_strides,
        N, Hq, Hq // Hkv, scale, **common)
    dk = torch.empty(B, N, Hkv, D, dtype=k.dtype, device=q.device)
    dv = torch.empty(B, N, Hkv, D, dtype=v.dtype, device=q.device)
    counts, index, lay_strides = _layout_args(layout.q_num_blocks, layout.q_indices, B, Hq)
    _block_sparse_bwd_dkdv_kernel[(triton.cdiv(N, bn) * B * Hkv,)](
        q, k, v, do, row_max, row_sum, delta, dk, dv, counts, index, *strides,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        row_max.stride(0), row_max.stride(1), *lay_strides,
        N, Hq, Hkv, Hq // Hkv, scale, **common)
    return dq, dk, dv
