"""Triton block-sparse decoding (few queries against a long cache, DESIGN §5b) and its launcher.

One program per (batch row, query row, query head, split). The query at position p reads
layout row p // block_size; its key list is the row's active key blocks, each a run of
consecutive keys cut at the row's length (and after p when causal). Split j walks the j-th
equal share of the row's blocks; the splits merge in float32 (ops/common/decode_kernels.py).
A sliding window (HAS_WINDOW) cuts its window blocks to the keys its predicate keeps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.configs import select_config
from ..common.decode_kernels import (decode_buffers, decode_program, fold_run, fp8_mode, fp8_operands,
                                     kv_descales, merge_splits, num_splits, query_position, row_pad, store_result)
from ..common.hardware import padded_head_dim
from ..common.kvcache import kernel_lengths
from ..common.kernels import softcap_terms
from ..common.runtime import on_tensor_device, window_args

CONFIG_FAMILY = "block_sparse_fwd"   # the family; tiles and warps: configs.KERNEL_DEFAULTS (not tuned)


@triton.jit(do_not_specialize=["window", "sink_tokens"])   # one compile for every window and sink count
def _block_sparse_decode_kernel(
        Q, K, V, O, LSE, PARTS, LENS, KV_COUNT, KV_INDEX, BLOCK_TABLE, DESCALES,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_cb, stride_ch, WIDTH, stride_btb, NUM_PAGES,
        NUM_ROWS, NUM_HEADS, HEAD_GROUP, NUM_SPLITS, sm_scale, softcap,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        KV_WIN=None, window=None, sink_tokens=None, HAS_WINDOW: tl.constexpr = False,
        HAS_SINK_TOKENS: tl.constexpr = False, LEFTPAD=None):
    b, row, h, h64, split, length, p, d, d_ok, q, k_base, v_base = decode_program(
        Q, K, V, LENS, 0, stride_qb, stride_qn, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        NUM_ROWS, NUM_HEADS, HEAD_GROUP, NUM_SPLITS, HEAD_DIM, BLOCK_D, PAGE_SIZE)
    pad = row_pad(LEFTPAD, b, LEFTPAD is not None)   # cache_leftpad (None: no pad): positions count from the pad
    length -= pad
    p = query_position(p - pad, CAUSAL)   # without causal clamped at 0

    bt = BLOCK_TABLE + b * stride_btb   # a paged cache's block table row (stride_kb: from page to page)
    # FP8 cache: DESCALES holds k's descales per kv head, then v's
    k_scale, v_scale = kv_descales(DESCALES, DESCALES + NUM_HEADS // HEAD_GROUP, h, HEAD_GROUP, sm_scale, KV_FP8)
    cap = softcap_terms(softcap, HAS_SOFTCAP)
    # a query before the first key (p < 0, causal only: ops/dilated/decode.py) reads nothing; p is clamped
    # before // (which truncates towards zero on a GPU and floors in the interpreter)
    qblock = tl.maximum(p, 0) // BLOCK_SIZE
    lists = b * stride_cb + h64 * stride_ch + qblock   # the row's list (int64: b, h64)
    count = tl.load(KV_COUNT + lists, mask=p >= 0, other=0)
    index_off = lists * WIDTH
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
        if HAS_WINDOW:
            # a window block (flag set): the keys window_keep (ops/common/kernels.py) keeps, as
            # two runs: the sink tokens [start, min(end, sink_tokens)) below the band, then the
            # band [p - window + 1, p]; both cut to the block
            in_window = tl.load(KV_WIN + index_off + j) != 0
            end = tl.where(in_window, tl.minimum(end, p + 1), end)
            lo = tl.where(in_window, tl.maximum(start, p - window + 1), start)
            if HAS_SINK_TOKENS:
                sink_end = tl.where(in_window, tl.minimum(tl.minimum(end, sink_tokens), lo), start)
                acc, m_i, l_i = fold_run(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, start + pad, 1, 0,
                                         sink_end - start, d_ok, k_scale, bt, stride_kb, stride_vb, NUM_PAGES,
                                         BLOCK_N, PAGE_SIZE, KV_FP8, cap, HAS_SOFTCAP)
            start = lo
        acc, m_i, l_i = fold_run(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, start + pad, 1, 0,
                                 end - start,
                                 d_ok, k_scale, bt, stride_kb, stride_vb, NUM_PAGES, BLOCK_N, PAGE_SIZE, KV_FP8,
                                 cap, HAS_SOFTCAP)
    if KV_FP8 > 0:   # the values' descale, once per program (the splits merge linearly in acc)
        acc = acc * v_scale
    store_result(O, LSE, PARTS, b, row, h64, split, acc, m_i, l_i, d, d_ok, NUM_ROWS, NUM_HEADS, NUM_SPLITS,
                 HEAD_DIM)


@on_tensor_device
def block_sparse_decode_forward(q, k, v, layout, lengths, call, *, splits=None, config=None, block_table=None,
                                k_descale=None, v_descale=None, leftpad=None):
    """Block-sparse attention of q (B, Nq, Hq, D), the last Nq positions of each row's
    lengths[b] (int32 (B,) on q's device) valid positions, over k, v (B, Nk, Hkv, D), or with
    block_table (int32 (B, max_pages)) over the page pools k, v (num_pages, page_size, Hkv,
    D); the layout (on q's device) covers the capacity. k, v float8_e4m3fn (an FP8 cache):
    k_descale, v_descale float32 (Hkv,) on q's device; call: the AttentionCall (causal, scale,
    cap); leftpad: None or an integer tensor (B,), each row's first key (cache_leftpad:
    lengths count from cache row 0, positions from the pad). Returns (out like q, lse float32
    (B, Hq, Nq))."""
    causal, scale = call.causal, call.scale
    B, Nq, Hq, D = q.shape
    Hkv = k.shape[2]
    paged = block_table is not None
    cap = k.shape[1] * block_table.shape[1] if paged else k.shape[1]
    bs = layout.block_size
    block_d = padded_head_dim(D)
    cfg = config or select_config(CONFIG_FAMILY, q.dtype, block_d, cap, q.device, kernel="block_sparse_decode")
    # the block lists (LB, LH, rows[, width]), contiguous; LB, LH: B and Hq, or 1 where one
    # layout serves every batch row or head (zero strides)
    counts, index = layout.kv_num_blocks.contiguous(), layout.kv_indices.contiguous()
    LB, LH, rows, width = index.shape
    if LB not in (1, B) or LH not in (1, Hq):
        raise ValueError(f"a layout for {LB} batch rows and {LH} heads cannot serve {B} and {Hq}")
    lists = dict(stride_cb=LH * rows if LB > 1 else 0, stride_ch=rows if LH > 1 else 0, WIDTH=width)
    window = {}
    if getattr(layout, "window", None) is not None:   # the flags read at the index's offsets
        window = dict(KV_WIN=layout.kv_window.contiguous().view(torch.int8), **window_args(layout.window))
    longest = width * bs
    splits = splits or num_splits(q.device, B * Nq * Hq, longest)
    out, lse, parts = decode_buffers(q, splits)
    kv_fp8 = fp8_mode(k)
    k, v = fp8_operands(k, v, kv_fp8)
    lengths = kernel_lengths(lengths, q.device)
    bt = block_table if paged else lengths       # not read when contiguous (PAGE_SIZE = 0)
    _block_sparse_decode_kernel[(B * Nq * Hq * splits,)](
        q, k, v, out, lse, parts, lengths, counts, index, bt,
        lengths if k_descale is None else torch.cat((k_descale.reshape(-1), v_descale.reshape(-1))),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), **lists, stride_btb=bt.stride(0), NUM_PAGES=k.shape[0] if paged else 0,
        NUM_ROWS=Nq, NUM_HEADS=Hq, HEAD_GROUP=Hq // Hkv, NUM_SPLITS=splits, sm_scale=scale,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_SIZE=bs, CAUSAL=causal, BLOCK_N=min(cfg["BLOCK_N"], bs),
        PAGE_SIZE=k.shape[1] if paged else 0, KV_FP8=kv_fp8, **call.kernel_args(), **window,
        LEFTPAD=None if leftpad is None else kernel_lengths(leftpad, q.device),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2))
    return merge_splits(out, lse, parts, splits, num_warps=cfg.get("num_warps", 4))
