"""Triton block-sparse decoding (few queries against a long cache, DESIGN §5b) and its launcher.

One program per (batch row, query row, query head, split). The query at position p reads
layout row p // block_size; its key list is the row's active key blocks, each a run of
consecutive keys cut at the row's length (and after p when causal). Split j walks the j-th
equal share of the row's blocks; the splits merge in float32 (ops/common/decode_kernels.py).
A sliding window (WINDOW > 0) cuts its window blocks to the keys its predicate keeps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.configs import select_config
from ..common.decode_kernels import (decode_buffers, decode_program, fold_run, fp8_mode, fp8_operands,
                                     kernel_lengths, kv_descales, merge_splits, num_splits, store_result)
from ..common.hardware import padded_head_dim
from ..common.runtime import on_tensor_device

CONFIG_FAMILY = "block_sparse_fwd"   # the family; tiles and warps: configs.KERNEL_DEFAULTS (not tuned)


@triton.jit
def _block_sparse_decode_kernel(
        Q, K, V, O, LSE, ACC, PART_M, PART_L, LENS, KV_COUNT, KV_INDEX, BLOCK_TABLE, K_DESCALE, V_DESCALE,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
        stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh, stride_lb, stride_lh,
        stride_cb, stride_ch, stride_ib, stride_ih, stride_ir, stride_btb, stride_kp, stride_vp, NUM_PAGES,
        NUM_ROWS, NUM_HEADS, HEAD_GROUP, NUM_SPLITS, sm_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr, KV_WIN=None,
        WINDOW: tl.constexpr = 0, SINK_TOKENS: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0):
    b, row, h, h64, split, length, p, d, d_ok, q, k_base, v_base = decode_program(
        Q, K, V, LENS, stride_qb, stride_qn, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        NUM_ROWS, NUM_HEADS, HEAD_GROUP, NUM_SPLITS, HEAD_DIM, BLOCK_D)

    bt = BLOCK_TABLE + b * stride_btb   # a paged cache's block table row (stride_kb = 0 then)
    k_scale, v_scale = kv_descales(K_DESCALE, V_DESCALE, h, HEAD_GROUP, sm_scale, KV_FP8)   # FP8 cache: descales
    # a query before the first key (p < 0: ops/dilated/decode.py) reads nothing; p is clamped
    # before // (which truncates towards zero on a GPU and floors in the interpreter)
    qblock = tl.maximum(p, 0) // BLOCK_SIZE
    count = tl.load(KV_COUNT + b * stride_cb + h64 * stride_ch + qblock, mask=p >= 0, other=0)
    index_off = b * stride_ib + h64 * stride_ih + qblock.to(tl.int64) * stride_ir
    index_base = KV_INDEX + index_off
    per_split = tl.cdiv(count, NUM_SPLITS)
    j_lo = split * per_split
    j_hi = tl.minimum(j_lo + per_split, count)

    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in range(j_lo, j_hi):
        start = tl.load(index_base + j) * BLOCK_SIZE
        end = tl.minimum(start + BLOCK_SIZE, length)   # blocks past the length: nothing
        if CAUSAL:
            end = tl.minimum(end, p + 1)
        if WINDOW > 0:
            # a window block (flag set): the keys window_keep (ops/common/kernels.py) keeps, as
            # two runs: the sink tokens [start, min(end, SINK_TOKENS)) below the band, then the
            # band [p - WINDOW + 1, p]; both cut to the block
            in_window = tl.load(KV_WIN + index_off + j) != 0
            end = tl.where(in_window, tl.minimum(end, p + 1), end)
            lo = tl.where(in_window, tl.maximum(start, p - WINDOW + 1), start)
            if SINK_TOKENS > 0:
                sink_end = tl.where(in_window, tl.minimum(tl.minimum(end, SINK_TOKENS), lo), start)
                acc, m_i, l_i = fold_run(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, start, 1, 0,
                                         sink_end - start, d_ok, k_scale, bt, stride_kp, stride_vp, NUM_PAGES,
                                         BLOCK_N, PAGE_SIZE, KV_FP8, SOFTCAP)
            start = lo
        acc, m_i, l_i = fold_run(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, start, 1, 0, end - start,
                                 d_ok, k_scale, bt, stride_kp, stride_vp, NUM_PAGES, BLOCK_N, PAGE_SIZE, KV_FP8,
                                 SOFTCAP)
    if KV_FP8 > 0:   # the values' descale, once per program (the splits merge linearly in acc)
        acc = acc * v_scale
    part = ((b * NUM_ROWS + row) * NUM_HEADS + h64) * NUM_SPLITS + split
    store_result(O, LSE, ACC, PART_M, PART_L, b * stride_ob + row * stride_on + h64 * stride_oh,
                 b * stride_lb + h64 * stride_lh + row, part, acc, m_i, l_i, d, d_ok, NUM_SPLITS, HEAD_DIM)


@on_tensor_device
def block_sparse_decode_forward(q, k, v, layout, lengths, *, causal, scale, splits=None, config=None,
                                block_table=None, k_descale=None, v_descale=None, softcap=None):
    """Block-sparse attention of q (B, Nq, Hq, D), the last Nq positions of each row's
    lengths[b] (int32 (B,) on q's device) valid positions, over k, v (B, Nk, Hkv, D), or with
    block_table (int32 (B, max_pages)) over the page pools k, v (num_pages, page_size, Hkv,
    D); the layout (on q's device) covers the capacity. k, v float8_e4m3fn (an FP8 cache):
    k_descale, v_descale float32 (Hkv,) on q's device; softcap: None or the cap c (scores
    s -> c * tanh(s / c)). Returns (out like q, lse float32 (B, Hq, Nq))."""
    B, Nq, Hq, D = q.shape
    Hkv = k.shape[2]
    paged = block_table is not None
    cap = k.shape[1] * block_table.shape[1] if paged else k.shape[1]
    bs = layout.block_size
    block_d = padded_head_dim(D)
    cfg = config or select_config(CONFIG_FAMILY, q.dtype, block_d, cap, q.device, kernel="block_sparse_decode")
    counts = layout.kv_num_blocks.expand(B, Hq, layout.n_q_blocks)   # broadcast dims: zero strides
    index = layout.kv_indices.expand(B, Hq, *layout.kv_indices.shape[2:])
    window = {}
    if getattr(layout, "window", None) is not None:   # the flags read at the index's offsets
        index = layout.kv_indices.contiguous().expand(B, Hq, *layout.kv_indices.shape[2:])
        flags = layout.kv_window.contiguous().view(torch.int8).expand(index.shape)
        window = dict(KV_WIN=flags, WINDOW=layout.window.window, SINK_TOKENS=layout.window.sink_tokens)
    longest = index.shape[-1] * bs
    splits = splits or num_splits(q.device, B * Nq * Hq, longest)
    out, lse, acc, part_m, part_l = decode_buffers(q, splits)
    kv_fp8 = fp8_mode(k)
    k, v = fp8_operands(k, v, kv_fp8)
    lengths = kernel_lengths(lengths, q.device)
    bt = block_table if paged else lengths       # not read when contiguous (PAGE_SIZE = 0)
    _block_sparse_decode_kernel[(B * Nq * Hq * splits,)](
        q, k, v, out, lse, acc, part_m, part_l, lengths, counts, index, bt,
        lengths if k_descale is None else k_descale, lengths if v_descale is None else v_descale,
        q.stride(0), q.stride(1), q.stride(2), 0 if paged else k.stride(0), k.stride(1), k.stride(2),
        0 if paged else v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        counts.stride(0), counts.stride(1), index.stride(0), index.stride(1), index.stride(2),
        bt.stride(0), k.stride(0), v.stride(0), k.shape[0] if paged else 0,
        Nq, Hq, Hq // Hkv, splits, scale,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_SIZE=bs, CAUSAL=causal, BLOCK_N=min(cfg["BLOCK_N"], bs),
        PAGE_SIZE=k.shape[1] if paged else 0, KV_FP8=kv_fp8, SOFTCAP=float(softcap or 0.0), **window,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2))
    return merge_splits(out, lse, acc, part_m, part_l, splits, num_warps=cfg.get("num_warps", 4))
