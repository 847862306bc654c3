"""Triton dilated decoding (few queries against a long cache, DESIGN §5b) and its launcher.

One program per (batch row, query row, query head, split). From the query's position p it
computes, per pattern (w, r) with the head's offset o, the run of keys the query reads
(decode.py: s + o, s + o + r, ... inside the segment, up to p when causal, below the row's
length), and so the key list: the runs one after another, about sum w/r keys whatever the
context length. Split j walks the j-th equal share of that list; the splits merge in
float32 (ops/common/decode_kernels.py). Bytes: each program reads its keys and values
once; query heads of one GQA group sit in adjacent programs, so keys several of them read
(every head reads the r = 1 pattern's) come from L2.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..common.configs import select_config
from ..common.decode_kernels import (decode_program, fold_run, fp8_mode, fp8_operands, kv_descales, merge_launch,
                                     num_splits, query_position, row_pad, store_result)
from ..common.hardware import padded_head_dim
from ..common.kvcache import kernel_lengths
from ..common.kernels import softcap_terms
from ..common.runtime import cuda_device, last_dim_contiguous, on_tensor_device, window_args

CONFIG_FAMILY = "dilated_fwd"   # the family; tiles and warps: configs.KERNEL_DEFAULTS (not tuned)


@triton.jit
def _pattern_run(p, length, w, r, o, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(start, count) of the keys start + r*t, t < count, that the query at p reads through
    pattern (w, r) at offset o (-1: unused); count 0 when the query is inactive, and for a
    query before the first key (p < 0: a causal row shorter than its queries; decode.py),
    whose inactive run is read nowhere (Triton's // and % truncate towards zero on a GPU and
    floor in the interpreter: for p < 0 they disagree, which no result depends on; clamping
    p under causal too makes ptxas spill 4 B on sm80 at D = 64). HAS_WINDOW: the run cut to the causal
    sliding window of `window` keys (window_keep: keys > p - window), from its front."""
    seg = (p // w) * w
    seg_end = tl.minimum(seg + w, length)
    active = (o >= 0) & ((p - seg) % r == o) & (p >= 0)
    count = tl.maximum((seg_end - seg - o + r - 1) // r, 0)
    if CAUSAL:   # an active query is key (p - s - o) / r of its own run
        count = tl.minimum(count, (p - seg - o) // r + 1)
    start = seg + o
    if HAS_WINDOW:   # skip t < ceil((p - window + 1 - start) / r) (kept >= 0: no negative division)
        skip = (tl.maximum(p - window + 1 - start, 0) + r - 1) // r
        start += skip * r
        count = tl.maximum(count - skip, 0)
    return start, tl.where(active, count, 0)


@triton.jit(do_not_specialize=["window"])   # one compile for every window
def _dilated_decode_kernel(
        Q, K, V, O, LSE, PARTS, LENS, lens_add, PAT_W, PAT_R, PAT_OFF, BLOCK_TABLE, K_DESCALE, V_DESCALE,
        stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_btb, NUM_PAGES,
        NUM_ROWS, NUM_HEADS, HEAD_GROUP, NUM_SPLITS, sm_scale, softcap,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_PATTERNS: tl.constexpr, CAUSAL: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        LEFTPAD=None, HAS_LEFTPAD: tl.constexpr = False, window=None, HAS_WINDOW: tl.constexpr = False):
    b, row, h, h64, split, length, p, d, d_ok, q, k_base, v_base = decode_program(
        Q, K, V, LENS, lens_add, stride_qb, stride_qn, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        NUM_ROWS, NUM_HEADS, HEAD_GROUP, NUM_SPLITS, HEAD_DIM, BLOCK_D, PAGE_SIZE)
    pad = row_pad(LEFTPAD, b, HAS_LEFTPAD)   # cache_leftpad: positions count from the pad
    length -= pad
    p = query_position(p - pad, CAUSAL)   # without causal clamped at 0
    bt = BLOCK_TABLE + b * stride_btb   # a paged cache's block table row (stride_kb: from page to page)
    k_scale, v_scale = kv_descales(K_DESCALE, V_DESCALE, h, HEAD_GROUP, sm_scale, KV_FP8)   # FP8 cache: descales
    cap = softcap_terms(softcap, HAS_SOFTCAP)

    total = 0   # the length of the key list
    for i in range(NUM_PATTERNS):   # not unrolled: pattern parameters are runtime loads
        start, count = _pattern_run(p, length, tl.load(PAT_W + i), tl.load(PAT_R + i),
                                    tl.load(PAT_OFF + h * NUM_PATTERNS + i), window, CAUSAL, HAS_WINDOW)
        total += count
    per_split = tl.cdiv(total, NUM_SPLITS)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, total)

    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    first = 0   # index in the key list of the current run's first key
    for i in range(NUM_PATTERNS):
        r = tl.load(PAT_R + i)
        start, count = _pattern_run(p, length, tl.load(PAT_W + i), r, tl.load(PAT_OFF + h * NUM_PATTERNS + i),
                                    window, CAUSAL, HAS_WINDOW)
        # this split's part of the run: keys t in [lo - first, hi - first) of it
        t_lo = tl.maximum(lo - first, 0)
        t_hi = tl.minimum(hi - first, count)
        acc, m_i, l_i = fold_run(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, start + pad, r, t_lo, t_hi,
                                 d_ok, k_scale, bt, stride_kb, stride_vb, NUM_PAGES, BLOCK_N, PAGE_SIZE, KV_FP8,
                                 cap, HAS_SOFTCAP)
        first += count
    if KV_FP8 > 0:   # the values' descale, once per program (the splits merge linearly in acc)
        acc = acc * v_scale
    store_result(O, LSE, PARTS, b, row, h64, split, acc, m_i, l_i, d, d_ok, NUM_ROWS, NUM_HEADS, NUM_SPLITS,
                 HEAD_DIM)


@functools.lru_cache(maxsize=256)
def longest_key_list(patterns, table, max_length: int) -> int:
    """An upper bound on any query's key list: per head, the sum of its patterns' longest runs
    ceil(min(w, max_length) / r); the maximum over heads. Cached: a third of a decode call's
    host time at H = 16 and five patterns."""
    longest = 0
    for row in table:
        longest = max(longest, sum(-(-min(w, max_length) // r) for (w, r), o in zip(patterns, row) if o >= 0))
    return longest


@functools.lru_cache(maxsize=64)
def _pattern_tables(patterns, table, device):
    """PAT_W, PAT_R (int32 (m,)) and PAT_OFF (int32 (Hq * m,)) on the device, cached."""
    as_dev = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return as_dev([w for w, _ in patterns]), as_dev([r for _, r in patterns]), as_dev(table).reshape(-1)


def _window_args(call) -> dict:
    """The decode kernel's sliding-window keywords: HAS_WINDOW (compile-time) and the window's
    key count (run-time, do_not_specialize: one compile for every window); no sink tokens."""
    args = window_args(call.window)
    if args.pop("HAS_SINK_TOKENS"):
        raise ValueError(f"the dilated decode kernel takes a sliding window without sink tokens, got {call.window}")
    del args["sink_tokens"]
    return args


class DecodeLaunch:
    """The decode step's launch planned once for its shapes (the serve door caches it per
    schedule and shapes): config, splits, pattern tables on the device and every
    launch argument that does not change between calls; `run` launches the decode kernel and
    the split merge with the call's tensors."""

    def __init__(self, q, k, patterns, table, call, *, max_pages: int = 0, max_length=None, splits=None,
                 config=None):
        """q, k: tensors of the call's shapes, dtypes and device (k: the cache, or the page pool
        when max_pages, the block table's width, is not 0)."""
        B, Nq, Hq, D = q.shape
        Hkv = k.shape[2]
        paged = max_pages > 0
        self.cuda_index = q.device.index if q.device.type == "cuda" else None
        page_size = k.shape[1] if paged else 0
        cap = page_size * max_pages if paged else k.shape[1]
        block_d = padded_head_dim(D)
        cfg = config or select_config(CONFIG_FAMILY, q.dtype, block_d, cap, q.device, kernel="dilated_decode")
        longest = longest_key_list(patterns, table, max_length or cap)
        self.splits = splits or num_splits(q.device, B * Nq * Hq, longest)
        self.kv_fp8 = fp8_mode(k)
        self.pat_w, self.pat_r, self.pat_off = _pattern_tables(patterns, table, q.device)
        self.out_shape, self.lse_shape = (B, Nq, Hq, D), (B, Hq, Nq)
        self.parts_numel = B * Nq * Hq * self.splits * (D + 2) if self.splits > 1 else 0
        self.grid = (B * Nq * Hq * self.splits,)
        self.num_pages = k.shape[0] if paged else 0
        self.sizes = dict(NUM_ROWS=Nq, NUM_HEADS=Hq, HEAD_GROUP=Hq // Hkv, NUM_SPLITS=self.splits, sm_scale=call.scale,
                          HEAD_DIM=D, BLOCK_D=block_d, NUM_PATTERNS=len(patterns), CAUSAL=call.causal,
                          BLOCK_N=cfg["BLOCK_N"], PAGE_SIZE=page_size, KV_FP8=self.kv_fp8, **call.kernel_args(),
                          **_window_args(call), num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2))
        self.merge_warps = cfg.get("num_warps", 4)

    def run(self, q, k, v, lengths, lens_add=0, block_table=None, k_descale=None, v_descale=None, leftpad=None):
        """(out, lse) for q, k, v of the planned shapes; lengths int32 (B,) contiguous on q's
        device (kvcache.kernel_lengths), lens_add the rows appended since they were counted;
        leftpad: None or int32 (B,) contiguous, each row's first key (cache_leftpad).
        A tensor without a unit stride on the head dim is copied (last_dim_contiguous)."""
        device = q.device
        out = torch.empty(self.out_shape, dtype=q.dtype, device=device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=device)
        parts = torch.empty(self.parts_numel, dtype=torch.float32, device=device) if self.splits > 1 else lse
        if self.kv_fp8 == 2 and k.dtype != torch.uint8:   # (an FP8 cache's owner may pass it as bytes)
            k, v = fp8_operands(k, v, 2)
        bt = lengths if block_table is None else block_table   # not read when contiguous (PAGE_SIZE = 0)
        sq, sk, sv = q.stride(), k.stride(), v.stride()
        if sq[3] != 1 or sk[3] != 1 or sv[3] != 1:
            q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
            sq, sk, sv = q.stride(), k.stride(), v.stride()
        with cuda_device(self.cuda_index):
            _dilated_decode_kernel[self.grid](
                q, k, v, out, lse, parts, lengths, lens_add, self.pat_w, self.pat_r, self.pat_off, bt,
                lengths if k_descale is None else k_descale, lengths if v_descale is None else v_descale,
                sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], bt.stride(0), self.num_pages,
                **self.sizes, LEFTPAD=lengths if leftpad is None else leftpad, HAS_LEFTPAD=leftpad is not None)
            if self.splits > 1:
                merge_launch(out, lse, parts, self.splits, self.merge_warps)
        return out, lse


@on_tensor_device
def dilated_decode_forward(q, k, v, patterns, table, lengths, call, *, max_length=None, splits=None, config=None,
                           block_table=None, k_descale=None, v_descale=None, lens_add: int = 0, leftpad=None):
    """Dilated attention of q (B, Nq, Hq, D), the last Nq positions of each row's lengths[b]
    (+ lens_add; int32 (B,) on q's device) valid positions, over k, v (B, Nk, Hkv, D), or with
    block_table (int32 (B, max_pages)) over the page pools k, v (num_pages, page_size, Hkv, D).
    Returns (out like q, lse float32 (B, Hq, Nq)). `splits`: the number of splits per query
    (default: common.decode_kernels.num_splits); `max_length`: max(lengths) if known (else the
    capacity). k, v float8_e4m3fn (an FP8 cache): k_descale, v_descale float32 (Hkv,) on q's
    device; call: the AttentionCall (causal, scale, cap); leftpad: None or an integer tensor
    (B,), each row's first key (cache_leftpad: lengths count from cache row 0, positions from
    the pad). One DecodeLaunch, planned and run."""
    paged = block_table is not None
    plan = DecodeLaunch(q, k, patterns, table, call, max_pages=block_table.shape[1] if paged else 0,
                        max_length=max_length, splits=splits, config=config)
    return plan.run(q, k, v, kernel_lengths(lengths, q.device), lens_add, block_table, k_descale, v_descale,
                    None if leftpad is None else kernel_lengths(leftpad, q.device))
