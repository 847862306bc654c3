"""Shared pieces of the Triton decode kernels (few queries against a long cache, DESIGN §5b):
the fold of a run of keys into one query's online softmax, the store of a program's result,
the merge of the splits (flash-decoding) and the choice of the number of splits.

A decode program owns one (batch row, query row, query head, split): it walks its share of
the query's key list, a concatenation of runs (start, stride, count) that the variant's
kernel computes from the query's position, with a float32 online softmax over a
(BLOCK_N, BLOCK_D) tile of keys at a time (one query row: a broadcast product and a sum,
no tl.dot). With one split the program writes the output and lse itself; with several it
writes a float32 partial (acc, max, denominator) and `_decode_merge_kernel` combines them
with the max-guarded log-sum-exp (exact when a split is empty). Splits let one token at
batch 1 fill the GPU: the work per program is the key list / splits. The launchers allocate
the output (B, Nq, Hq, D), lse (B, Hq, Nq) and partials (decode_buffers) contiguous: the
kernels index them from their shapes.

FP8 cache (KV_FP8 > 0): keys and values load as float8_e4m3fn and convert to float32
(load_cache); the per-head descales fold into the score scale and the output (kv_descales).

NaN rule (DESIGN §6): padding slots and masked keys load as 0 and score -inf, so a NaN
stored there never spreads; a NaN or Inf in a key or query the row reads makes its score
NaN, one in a value its accumulator, and either makes the denominator, output and lse NaN.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .hardware import device_arch, get_arch, padded_head_dim
from .kernels import LOG2E, tanh
from .runtime import on_tensor_device

MIN_KEYS_PER_SPLIT = 64
MERGE_CHUNK: tl.constexpr = tl.constexpr(16)   # splits the merge kernel reads per step


def fp8_mode(k_cache) -> int:
    """The decode kernels' KV_FP8 constexpr for a cache: 0 (q's dtype), 1 (float8_e4m3fn on an
    NVIDIA GPU of compute capability 8.9 or newer), 2 (float8_e4m3fn decoded from its bytes:
    older GPUs, AMD, the interpreter; load_cache)."""
    if k_cache.dtype != torch.float8_e4m3fn:
        return 0
    return 1 if k_cache.device.type == "cuda" and _hardware_fp8(k_cache.device.index) else 2


@functools.lru_cache(maxsize=None)
def _hardware_fp8(index) -> bool:
    """Whether Triton converts fp8e4nv on this CUDA device (NVIDIA sm89+, compiled kernels)."""
    from .kernels import is_interpreted
    return not torch.version.hip and not is_interpreted() and torch.cuda.get_device_capability(index) >= (8, 9)


def fp8_operands(k, v, mode: int):
    """k, v as the decode kernels take them: viewed as uint8 for KV_FP8 = 2 (no copy)."""
    return (k.view(torch.uint8), v.view(torch.uint8)) if mode == 2 else (k, v)


@triton.jit
def decode_program(Q, K, V, LENS, lens_add, stride_qb, stride_qn, stride_qh, stride_kb, stride_kh, stride_vb,
                   stride_vh, NUM_ROWS, NUM_HEADS, HEAD_GROUP, NUM_SPLITS, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """What a decode program works on: batch row b, query row `row`, head h (also as int64),
    split; the row's length LENS[b] + lens_add (the rows a fused append adds: the serve doors
    pass cache_seqlens and Nnew, no add op per call) and the query's position
    p = length - NUM_ROWS + row; its query
    (float32, (BLOCK_D,)) and the [1, BLOCK_D] bases of its key head's K and V rows: of its
    batch row in a contiguous cache, of the page pool in a paged one (PAGE_SIZE > 0: then
    stride_kb, stride_vb step from page to page; fold_run). Heads vary fastest over the
    programs, so the query heads of a GQA group run side by side."""
    pid = tl.program_id(0)
    h = pid % NUM_HEADS
    split = (pid // NUM_HEADS) % NUM_SPLITS
    row = (pid // (NUM_HEADS * NUM_SPLITS)) % NUM_ROWS
    b = (pid // (NUM_HEADS * NUM_SPLITS * NUM_ROWS)).to(tl.int64)
    h64 = h.to(tl.int64)
    kvh = (h // HEAD_GROUP).to(tl.int64)
    length = tl.load(LENS + b) + lens_add
    p = length - NUM_ROWS + row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + row * stride_qn + h64 * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    if PAGE_SIZE == 0:   # the batch row's keys
        k_base = K + b * stride_kb + kvh * stride_kh + d[None, :]
        v_base = V + b * stride_vb + kvh * stride_vh + d[None, :]
    else:                # the pool's
        k_base = K + kvh * stride_kh + d[None, :]
        v_base = V + kvh * stride_vh + d[None, :]
    return b, row, h, h64, split, length, p, d, d_ok, q, k_base, v_base


@triton.jit
def row_pad(LEFTPAD, b, HAS_LEFTPAD: tl.constexpr):
    """The left padding of batch row b (cache_leftpad[b], kvcache.check_leftpad: its keys start
    at that cache row, and positions count from it), clamped at 0 (a negative pad would read
    before the row); 0 without one. A decode kernel subtracts it from the row's length and
    query position and adds it to a key's position to address the cache (fold_run's start)."""
    if HAS_LEFTPAD:
        return tl.maximum(tl.load(LEFTPAD + b), 0)
    else:
        return 0


@triton.jit
def query_position(p, CAUSAL: tl.constexpr):
    """The position a query at p (length - NUM_ROWS + row, less the pad) reads from: p under
    causal (p < 0, a row shorter than its queries: no key), else max(p, 0) (DESIGN §5b, the
    patterned case: without causal every query of such a row sits at position 0 and reads its
    segment or layout row, all the row's keys at dense settings; common.decode.query_positions)."""
    if CAUSAL:
        return p
    else:
        return tl.maximum(p, 0)


@triton.jit
def load_cache(ptrs, mask, KV_FP8: tl.constexpr):
    """A tile of cache rows as float32. KV_FP8 = 1: float8_e4m3fn rows through the hardware
    conversion (Triton's fp8e4nv: sm89 and newer). 2: the same bytes loaded as uint8 and
    decoded here (older GPUs, which Triton gives no fp8e4nv, and the interpreter, whose
    fp8e4nv conversion reads e4m3fn's NaN, S.1111.111, as +-480): exponent e and mantissa m
    to float32 bits ((e + 120) << 23 | m << 20) for a normal, m * 2^-9 for a subnormal (e = 0),
    NaN for S.1111.111 (DESIGN §6)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if KV_FP8 == 2:
        b = x.to(tl.int32)
        e = (b >> 3) & 15
        m = b & 7
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, (((e + 120) << 23) | (m << 20)).to(tl.float32,
                                                                                                 bitcast=True))
        mag = tl.where((b & 127) == 127, float("nan"), mag)
        return tl.where(b >= 128, -mag, mag)
    return x.to(tl.float32)


@triton.jit
def kv_descales(K_DESCALE, V_DESCALE, h, HEAD_GROUP, sm_scale, KV_FP8: tl.constexpr):
    """(score scale, value scale) of query head h's program: for an FP8 cache sm_scale times
    k_descale and v_descale of its key/value head (float32; the output is acc * v_descale,
    the scores (q . k8) * sm_scale * k_descale: the attention over the dequantised rows with
    one multiply per program instead of one per element); else (sm_scale, 1)."""
    k_scale = sm_scale
    v_scale = sm_scale * 0.0 + 1.0
    if KV_FP8 > 0:
        kvh = (h // HEAD_GROUP).to(tl.int64)
        k_scale = sm_scale * tl.load(K_DESCALE + kvh)
        v_scale = tl.load(V_DESCALE + kvh)
    return k_scale, v_scale


@triton.jit
def fold_run(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, start, stride, t_lo, t_hi, d_ok, sm_scale,
             BT, stride_kp, stride_vp, NUM_PAGES, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
             KV_FP8: tl.constexpr = 0, cap=None, HAS_SOFTCAP: tl.constexpr = False):
    """Fold the keys start + stride*t, t in [t_lo, t_hi), into the running (acc (BLOCK_D,),
    max, denominator) of one query q (BLOCK_D,), all float32. Scores are in natural units;
    exp(s - m) is computed as exp2((s - m) * log2(e)). A max of -inf (nothing seen yet) is
    replaced by 0 before it is subtracted: no -inf - -inf. PAGE_SIZE > 0: a paged cache, key
    position n at row n % PAGE_SIZE of page BT[n // PAGE_SIZE] (BT: the batch row's block
    table; pages stride_kp / stride_vp apart; k_base, v_base without a batch offset); a key
    whose page id lies outside [0, NUM_PAGES) (a scheduler's bad block table, validate=False)
    is not read: it counts as masked. KV_FP8:
    an FP8 cache (load_cache; sm_scale then carries k_descale, kv_descales).
    HAS_SOFTCAP (without it the uncapped kernel compiles unchanged): scores s -> c * tanh(s / c),
    float32 (kernels.tanh, exact form), with `cap` = kernels.softcap_terms(c)."""
    for t0 in range(t_lo, t_hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        ok = t < t_hi
        kpos = start + stride * t.to(tl.int64)   # int64: r * t may pass 2^31 on masked lanes
        tile_ok = ok[:, None] & d_ok[None, :]
        if PAGE_SIZE > 0:
            page = tl.load(BT + kpos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
            ok = ok & (page >= 0) & (page < NUM_PAGES)
            tile_ok = ok[:, None] & d_ok[None, :]
            k_off = page * stride_kp + (kpos % PAGE_SIZE) * stride_kn
            v_off = page * stride_vp + (kpos % PAGE_SIZE) * stride_vn
        else:
            k_off = kpos * stride_kn
            v_off = kpos * stride_vn
        k = load_cache(k_base + k_off[:, None], tile_ok, KV_FP8)
        v = load_cache(v_base + v_off[:, None], tile_ok, KV_FP8)
        # s + s * 0 turns a score of +-Inf (an infinite key or query) into NaN, which then
        # reaches the denominator (a -inf score would read as "no key"); see store_result
        s = tl.sum(k * q[None, :], 1)
        s = (s + s * 0.0) * sm_scale
        if HAS_SOFTCAP:   # tanh keeps a NaN score NaN (NaN rule)
            c, inv_c, _ = cap
            s = tanh(s * inv_c, True) * c
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2((s - m_safe) * LOG2E)
        alpha = tl.math.exp2((m_i - m_safe) * LOG2E)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def partials(PARTS, n_parts, HEAD_DIM: tl.constexpr):
    """(ACC, PART_M, PART_L) in the float32 partials of decode_buffers: n_parts accumulators of
    HEAD_DIM, then n_parts maxima, then n_parts denominators (int64 offsets)."""
    acc = PARTS
    part_m = PARTS + tl.cast(n_parts, tl.int64) * HEAD_DIM
    return acc, part_m, part_m + n_parts


@triton.jit
def store_result(O, LSE, PARTS, b, row, h64, split, acc, m_i, l_i, d, d_ok, NUM_ROWS, NUM_HEADS, NUM_SPLITS,
                 HEAD_DIM: tl.constexpr):
    """One split: the output (normalised, q's dtype; O (B, Nq, Hq, D)) and lse = max +
    ln(denominator), -inf for a query with no key (LSE (B, Hq, Nq)). Several: the float32
    partial of (b, row, h64, split) among the B * Nq * Hq * splits of PARTS (partials; one per
    program). NaN rule (DESIGN §6): a non-finite value the program read left acc non-finite
    (weight * Inf, 0 * Inf, NaN), which finite inputs never do; the denominator is then made
    NaN too, so output and lse are NaN, also after the merge."""
    l_i = l_i + tl.sum(acc * 0.0, 0)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)
        # offsets in the form of stride sums (batch, row, head; the strides of the contiguous buffers):
        # folded into the partial's index instead, sm80's dilated decode at D = 64 spilled 4 B more
        o_off = b * (NUM_ROWS * NUM_HEADS * HEAD_DIM) + row * (NUM_HEADS * HEAD_DIM) + h64 * HEAD_DIM
        tl.store(O + o_off + d, out.to(O.dtype.element_ty), mask=d_ok)
        tl.store(LSE + b * (NUM_HEADS * NUM_ROWS) + h64 * NUM_ROWS + row,
                 tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i))))
    else:
        part = ((b * NUM_ROWS + row) * NUM_HEADS + h64) * NUM_SPLITS + split
        ACC, PART_M, PART_L = partials(PARTS, tl.num_programs(0), HEAD_DIM)
        tl.store(ACC + part * HEAD_DIM + d, acc, mask=d_ok)
        tl.store(PART_M + part, m_i)
        tl.store(PART_L + part, l_i)


@triton.jit
def _decode_merge_kernel(PARTS, O, LSE, NUM_ROWS, NUM_HEADS, NUM_SPLITS, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (batch row, query row, query head): the splits' partials merged in
    float32, MERGE_CHUNK splits at a time: out = sum_j e^(m_j - M) acc_j / sum_j e^(m_j - M) l_j
    with M the largest m_j. Empty splits (m = -inf, l = 0) weigh 0; every split empty: 0
    and lse = -inf."""
    pid = tl.program_id(0)
    h = pid % NUM_HEADS
    row = (pid // NUM_HEADS) % NUM_ROWS
    b = (pid // (NUM_HEADS * NUM_ROWS)).to(tl.int64)
    base = pid.to(tl.int64) * NUM_SPLITS
    ACC, PART_M, PART_L = partials(PARTS, tl.num_programs(0) * NUM_SPLITS, HEAD_DIM)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    j = tl.arange(0, MERGE_CHUNK)
    m_max = tl.full([], float("-inf"), tl.float32)
    for j0 in range(0, NUM_SPLITS, MERGE_CHUNK):
        m = tl.load(PART_M + base + j0 + j, mask=j0 + j < NUM_SPLITS, other=float("-inf"))
        m_max = tl.maximum(m_max, tl.max(m, 0))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    acc = tl.zeros([BLOCK_D], tl.float32)
    l_sum = tl.zeros([], tl.float32)
    for j0 in range(0, NUM_SPLITS, MERGE_CHUNK):
        ok = j0 + j < NUM_SPLITS
        weight = tl.math.exp2((tl.load(PART_M + base + j0 + j, mask=ok, other=float("-inf")) - m_safe) * LOG2E)
        l_sum += tl.sum(weight * tl.load(PART_L + base + j0 + j, mask=ok, other=0.0), 0)
        part = tl.load(ACC + (base + j0 + j)[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None] & d_ok[None, :],
                       other=0.0)
        acc += tl.sum(weight[:, None] * part, 0)
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)
    tl.store(O + pid.to(tl.int64) * HEAD_DIM + d, out.to(O.dtype.element_ty), mask=d_ok)   # (b, row, h): pid
    tl.store(LSE + (b * NUM_HEADS + h) * NUM_ROWS + row,
             tl.where(l_sum == 0.0, float("-inf"), m_safe + tl.log(tl.where(l_sum == 0.0, 1.0, l_sum))))


def num_splits(device: torch.device, programs: int, max_keys: int) -> int:
    """Splits per query so that programs * splits fills the GPU (at least twice its SM count),
    each split keeping at least MIN_KEYS_PER_SPLIT keys of the longest list (max_keys)."""
    sms = device_arch(device).sm_count if device.type == "cuda" else get_arch().sm_count
    want = -(-2 * sms // max(1, programs))
    return max(1, min(want, -(-max_keys // MIN_KEYS_PER_SPLIT)))


def decode_buffers(q, splits: int):
    """(out, lse, parts): the results, (B, Nq, Hq, D) like q and float32 (B, Hq, Nq), and for
    several splits the float32 partials of the B * Nq * Hq * splits programs in one buffer:
    their accumulators (D each), maxima, denominators (partials); one split needs none (empty)."""
    B, Nq, Hq, D = q.shape
    out = torch.empty(B, Nq, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
    parts = torch.empty(B * Nq * Hq * splits * (D + 2) if splits > 1 else 0, dtype=torch.float32, device=q.device)
    return out, lse, parts


@on_tensor_device
def merge_splits(out, lse, parts, splits: int, num_warps: int = 4):
    """Combine the partials of decode_buffers into out and lse (nothing to do for one split)."""
    if splits > 1:
        merge_launch(out, lse, parts, splits, num_warps)
    return out, lse


def merge_launch(out, lse, parts, splits: int, num_warps: int = 4) -> None:
    """merge_splits' launch for several splits, with q's CUDA device already current."""
    B, Nq, Hq, D = out.shape
    _decode_merge_kernel[(B * Nq * Hq,)](parts, out, lse, Nq, Hq, splits, HEAD_DIM=D, BLOCK_D=padded_head_dim(D),
                                         num_warps=num_warps)


# ----------------------------------------------------------------------------- the fused append

@triton.jit
def e4m3_bits(y):
    """float32 y with |y| <= 448 or NaN -> its float8_e4m3fn byte (int32), bit for bit as
    c10's fp8e4m3fn_from_fp32_value (torch's .to(float8_e4m3fn)): round to nearest-even; a
    magnitude below 2^-6 (subnormal) rounds through the float add |y| + 2^14, whose ulp is
    e4m3's subnormal step 2^-9; NaN becomes S.1111.111."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 128
    mag = bits & 0x7FFFFFFF
    sub = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    norm = (mag - (120 << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    out = tl.where(mag < (121 << 23), sub, norm)
    return tl.where(mag >= (1087 << 20), 127, out) | sign


APPEND_PAGES: tl.constexpr = tl.constexpr(16)   # block-table entries the append checks per step


@triton.jit
def rotate_row(x, X, pos, COS, SIN, d, stride_d, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The row x (BLOCK_D,), loaded from X + d * stride_d, with its first ROTARY_DIM features
    rotated by the angle of row `pos` of the tables COS, SIN (contiguous (seqlen_ro,
    ROTARY_DIM / 2)), as float32 in x's dtype (kvcache.rotate, FlashAttention's
    apply_rotary_emb): feature d pairs with d ^ 1 (INTERLEAVED, GPT-J) or d +- ROTARY_DIM / 2
    (GPT-NeoX), the first of a pair x*c - x'*s, the second x*c + x'*s (float addition
    commutes: the same float32 values as the PyTorch route's x1*c - x2*s, x1*s + x2*c); the
    other features unchanged (x itself: no -0.0 + 0.0). The partner is loaded again from X
    (the same row, in cache)."""
    half = ROTARY_DIM // 2
    rot = d < ROTARY_DIM
    if INTERLEAVED:
        i = d // 2
        partner = d ^ 1
        first = (d % 2) == 0
    else:
        i = d % half
        partner = tl.where(d < half, d + half, d - half)
        first = d < half
    c = tl.load(COS + pos * half + i, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(SIN + pos * half + i, mask=rot, other=0.0).to(tl.float32)
    xp = tl.load(X + partner * stride_d, mask=rot, other=0.0).to(tl.float32)
    xs = xp * s
    out = x.to(tl.float32) * c + tl.where(first, -xs, xs)
    return tl.where(rot, out.to(x.dtype), x)


@triton.jit
def _append_rows_kernel(K_CACHE, V_CACHE, K, V, LENS, BLOCK_TABLE, K_DESCALE, V_DESCALE,
                        stride_ckb, stride_ckn, stride_ckh, stride_ckd, stride_cvb, stride_cvn, stride_cvh, stride_cvd,
                        stride_kb, stride_kn, stride_kh, stride_kd, stride_vb, stride_vn, stride_vh, stride_vd,
                        stride_btb,
                        NUM_NEW, NUM_KV_HEADS, CAPACITY, NUM_PAGES,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                        KV_FP8: tl.constexpr,
                        Q=None, Q_ROT=None, COS=None, SIN=None, stride_qb=0, stride_qn=0, stride_qh=0, NUM_Q_HEADS=0,
                        ROT_ROWS=0, ROTARY_DIM: tl.constexpr = 0, INTERLEAVED: tl.constexpr = False,
                        Q_CAUSAL: tl.constexpr = False):
    """Grid (NUM_NEW * NUM_KV_HEADS [+ Nq * NUM_Q_HEADS with rotary], B): batch row b =
    program_id(1). The first NUM_NEW * NUM_KV_HEADS programs of a row, one per (new row j,
    key/value head h): k[b, j, h], v[b, j, h] written at row LENS[b] + j of the cache (through
    the block table for a page pool), into
    an FP8 cache (KV_FP8 > 0: the caches as bytes) quantised as kvcache.quantise_fp8 does:
    x / descale[h] in float32 (div_rn: IEEE division, as torch's), saturated to +-448, a
    non-finite x kept NaN, e4m3_bits. A batch row whose rows do not lie in [0, CAPACITY), or
    (paged) one of whose pages lies outside [0, NUM_PAGES), writes nothing (kvcache.append_rows).

    Rotary (ROTARY_DIM > 0: FlashAttention's rotary_cos / rotary_sin, kvcache.apply_rotary's
    positions, clamped to the tables' ROT_ROWS rows): k's row rotated at position LENS[b] + j
    (rotate_row, cast to k's dtype, then quantised into an FP8 cache: rotate before
    quantising); and the row's other Nq * NUM_Q_HEADS programs, one per (query i, head h),
    write q[b, i, h] (unit stride on the head dim) rotated at LENS[b] + i (Q_CAUSAL) or
    LENS[b] into Q_ROT, contiguous (B, Nq, NUM_Q_HEADS, HEAD_DIM)."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    seqlen = tl.load(LENS + b).to(tl.int64)   # cache_seqlens[b]: the first new row's cache row and rotary position
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    kv_programs = NUM_NEW * NUM_KV_HEADS
    if pid < kv_programs:
        h = (pid % NUM_KV_HEADS).to(tl.int64)
        j = pid // NUM_KV_HEADS
        ok = (seqlen >= 0) & (seqlen + NUM_NEW <= CAPACITY)
        start = tl.where(ok, seqlen, 0)
        row = start + j
        if PAGE_SIZE > 0:   # every page the batch row's new rows use must lie in the pool
            bt = BLOCK_TABLE + b * stride_btb
            last = tl.where(ok, (start + NUM_NEW - 1) // PAGE_SIZE, -1)   # -1: no page checked
            for p0 in range(start // PAGE_SIZE, last + 1, APPEND_PAGES):
                p = p0 + tl.arange(0, APPEND_PAGES)
                page = tl.load(bt + p, mask=p <= last, other=0)
                ok = ok & (tl.sum(((p <= last) & ((page < 0) | (page >= NUM_PAGES))).to(tl.int32), 0) == 0)
            page = tl.load(bt + row // PAGE_SIZE).to(tl.int64)   # in the table: row < NUM_NEW <= CAPACITY when not ok
            dst_k = page * stride_ckb + (row % PAGE_SIZE) * stride_ckn + h * stride_ckh
            dst_v = page * stride_cvb + (row % PAGE_SIZE) * stride_cvn + h * stride_cvh
        else:
            dst_k = b * stride_ckb + row * stride_ckn + h * stride_ckh
            dst_v = b * stride_cvb + row * stride_cvn + h * stride_cvh
        k_row = K + b * stride_kb + j * stride_kn + h * stride_kh
        k = tl.load(k_row + d * stride_kd, mask=d_ok, other=0.0)
        v = tl.load(V + b * stride_vb + j * stride_vn + h * stride_vh + d * stride_vd, mask=d_ok, other=0.0)
        if ROTARY_DIM > 0:
            pos = tl.minimum(tl.maximum(seqlen + j, 0), ROT_ROWS - 1)
            k = rotate_row(k, k_row, pos, COS, SIN, d, stride_kd, ROTARY_DIM, INTERLEAVED)
        if KV_FP8 > 0:
            k, v = k.to(tl.float32), v.to(tl.float32)
            ks = tl.math.div_rn(k, tl.full([BLOCK_D], 1.0, tl.float32) * tl.load(K_DESCALE + h))
            vs = tl.math.div_rn(v, tl.full([BLOCK_D], 1.0, tl.float32) * tl.load(V_DESCALE + h))
            # saturate (NaN stays NaN), then x * 0: NaN exactly where x is not finite
            ks = tl.where(ks != ks, ks, tl.minimum(tl.maximum(ks, -448.0), 448.0)) + k * 0.0
            vs = tl.where(vs != vs, vs, tl.minimum(tl.maximum(vs, -448.0), 448.0)) + v * 0.0
            k, v = e4m3_bits(ks).to(tl.uint8), e4m3_bits(vs).to(tl.uint8)
        write = d < tl.where(ok, HEAD_DIM, 0)   # no element of a row that writes nothing
        tl.store(K_CACHE + dst_k + d * stride_ckd, k, mask=write)
        tl.store(V_CACHE + dst_v + d * stride_cvd, v, mask=write)
    elif ROTARY_DIM > 0:   # a query row's program
        t = pid - kv_programs
        h = (t % NUM_Q_HEADS).to(tl.int64)
        i = t // NUM_Q_HEADS
        q_row = Q + b * stride_qb + i * stride_qn + h * stride_qh
        q = tl.load(q_row + d, mask=d_ok, other=0.0)
        pos = seqlen
        if Q_CAUSAL:   # query i at cache_seqlens[b] + i, else every query at cache_seqlens[b]
            pos += i
        pos = tl.minimum(tl.maximum(pos, 0), ROT_ROWS - 1)
        q = rotate_row(q, q_row, pos, COS, SIN, d, 1, ROTARY_DIM, INTERLEAVED)
        q_programs = tl.num_programs(0) - kv_programs   # Nq * NUM_Q_HEADS
        tl.store(Q_ROT + (b * q_programs + t) * HEAD_DIM + d, q, mask=d_ok)


class AppendLaunch:
    """The Triton append (one launch for keys and values, and with rotary the rotated queries;
    kvcache.append_kv) planned for the shapes of k_cache (a cache, or a page pool with
    block_table) and k (B, Nnew, Hkv, D); `run` launches it with a call's tensors. Its grid's
    second axis is the batch (B <= 65535, CUDA's limit there)."""

    def __init__(self, k_cache, k, block_table=None):
        B, n, Hkv, D = k.shape
        paged = block_table is not None
        self.fp8 = k_cache.dtype == torch.float8_e4m3fn
        self.batch, self.kv_programs = B, n * Hkv
        self.sizes = dict(NUM_NEW=n, NUM_KV_HEADS=Hkv,
                          CAPACITY=k_cache.shape[1] * block_table.shape[1] if paged else k_cache.shape[1],
                          NUM_PAGES=k_cache.shape[0] if paged else 0,
                          HEAD_DIM=D, BLOCK_D=padded_head_dim(D), PAGE_SIZE=k_cache.shape[1] if paged else 0,
                          KV_FP8=int(self.fp8), num_warps=1,
                          # no multiply-add contraction: the rotation's x*c and x'*s are rounded apart, as
                          # on the PyTorch route (the same bits on a GPU; nothing else here contracts)
                          enable_fp_fusion=False)

    def run(self, k_cache, v_cache, k, v, lengths, block_table=None, k_descale=None, v_descale=None, q=None,
            rotary=None):
        """lengths: int32 (B,) contiguous on the caches' device (kvcache.kernel_lengths); any
        strides; an FP8 cache as float8_e4m3fn or already viewed as uint8. Nothing is read on
        the host. rotary (kvcache.Rotary) with q (B, Nq, Hq, D): k rotated before it is
        stored, and q rotated into a new contiguous tensor, returned (else q, unchanged)."""
        rot = {}
        q_programs = 0
        if rotary is not None:
            if q.stride(-1) != 1:   # (the decode kernels take the same copy)
                q = q.contiguous()
            q_rot = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            cos, sin = rotary.cos.contiguous(), rotary.sin.contiguous()   # (no copy for a contiguous table)
            q_programs = q.shape[1] * q.shape[2]
            rot = dict(Q=q, Q_ROT=q_rot, COS=cos, SIN=sin, stride_qb=q.stride(0), stride_qn=q.stride(1),
                       stride_qh=q.stride(2), NUM_Q_HEADS=q.shape[2], ROT_ROWS=cos.shape[0],
                       ROTARY_DIM=2 * cos.shape[1], INTERLEAVED=rotary.interleaved, Q_CAUSAL=rotary.causal)
            q = q_rot
        grid = (self.kv_programs + q_programs, self.batch)
        if not (grid[0] and grid[1]):
            return q
        if self.fp8 and k_cache.dtype != torch.uint8:   # bytes: the kernel encodes e4m3 itself (e4m3_bits)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        bt = lengths if block_table is None else block_table   # not read when contiguous (PAGE_SIZE = 0)
        _append_rows_kernel[grid](
            k_cache, v_cache, k, v, lengths, bt, k_descale if self.fp8 else lengths,
            v_descale if self.fp8 else lengths, *k_cache.stride(), *v_cache.stride(), *k.stride(), *v.stride(),
            bt.stride(0), **self.sizes, **rot)
        return q
