"""Shared @triton.jit pieces: the online-softmax step and its backward counterparts. With
the variants' kernels.py files, the only module that imports triton.

Two forms of the exponentials, picked by the query's dtype:
* float32 inputs (exact form): scores s = q.k * scale stay in natural units and
  p = exp2((s - max) * log2(e)), so log2(e) multiplies a difference near 0 rather than a
  score: with |s| ~ 1e4 a score is only good to ~1e-3 in float32, and folding log2(e) into
  the scale would add another such rounding (the float32 tolerance is 1e-5).
* 16-bit inputs (FMA form, as FlashAttention): the running max is kept in log2 units
  (max of s * log2(e)) and p = exp2(q.k * (scale * log2(e)) - max2), one FMA per score
  instead of three operations; the max is taken on the raw q.k (its min for a negative
  scale). The extra rounding is far below 16-bit resolution. `finalize` converts the
  max back to natural units, so the saved row statistics mean the same in both forms.
The running max, the denominators and the accumulators are float32. A row whose keys are
all masked keeps m = -inf; the max is replaced by 0 before it is subtracted so that no
-inf - -inf = NaN appears, and such a row ends with l = 0: output 0, lse = -inf.

NaN rule (DESIGN §6): a row that reads a NaN or Inf key, value or query gives NaN output and
NaN lse; other rows are untouched. Scores go through s + s * 0, which turns +-Inf (an
infinite key or query) into NaN: a -inf score would otherwise drop the key as if masked.
`finalize` turns a non-finite accumulator row (a NaN or Inf value was read) into a NaN
denominator, hence NaN output and lse. Not covered: where P has masked zeros (masked tiles,
uncounted pairs of weighted ones), P @ V multiplies them by a NaN or Inf value too (0 * NaN
is NaN) and spreads it to rows of the tile that do not read that value. Zeroing such value
rows needs v in registers for the check, which costs spills on sm90 (block_sparse_fwd
causal 24 B at D = 64, 32 B at D = 128; ring_step_fwd D = 256 from 20 B to 380 B).
"""
import contextlib

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)   # exp(x) = exp2(x * LOG2E)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)      # 1 / LOG2E
MIN_SCALE2: tl.constexpr = tl.constexpr(1.1754943508222875e-38)   # smallest normal float32


def is_interpreted() -> bool:
    """Whether the kernels were defined under Triton's interpreter (TRITON_INTERPRET=1 set
    before import): the jit functions are then interpreted Python."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(dot, InterpretedFunction)


@contextlib.contextmanager
def interpreted_launches_stubbed():
    """Every launch of an interpreted kernel a no-op while inside (InterpretedFunction.run
    patched: nothing executes): perf's measure of a call's host time up to its launches."""
    from triton.runtime.interpreter import InterpretedFunction
    run = InterpretedFunction.run
    InterpretedFunction.run = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        InterpretedFunction.run = run


@triton.jit
def program_tile(n_tiles, num_heads):
    """(tile, b, h) of this program. The grid is one flat axis of B * num_heads * n_tiles
    programs, the tiles of one (batch, head) adjacent: a second grid axis would cap batch x
    heads at 65,535. b and h are int64 (b * batch-stride and h * head-stride can pass
    2^31); num_heads = 1 gives (tile, b, 0)."""
    pid = tl.program_id(0)
    tile = pid % n_tiles
    bh = (pid // n_tiles).to(tl.int64)
    return tile, bh // num_heads, bh % num_heads


@triton.jit
def bnhd_offset(b, h, N, H, D: tl.constexpr):
    """int64 offset of (batch b, head h) in a contiguous (B, N, H, D) tensor; row n is a
    further n * H * D."""
    # N zero-extended (a length, so the same value): the backward kernels also widen N for
    # their row statistics, and sharing that widened N kept it live across the main loop.
    # tl.cast, not N.to: Triton passes an integer argument equal to 1 as a constexpr (N = 1)
    return b * tl.cast(tl.cast(N, tl.uint32), tl.int64) * (H * D) + h * D


@triton.jit
def dot(a, b, DOT_MODE: tl.constexpr, PRECISION: tl.constexpr):
    # DOT_MODE (runtime.dot_mode): 0 tl.dot as it is; 1 in float32 (the interpreter computes
    # bf16 tl.dot wrongly); 2 (sm70, sm75) contractions longer than 64 as a sum of 64-wide
    # pieces. Triton's FMA-loop dot there holds a whole row of a and column of b in each
    # thread's registers: at D = 128 that is 256 values before anything else, and the
    # backward kernels spilled; pieces of 64 end that (perf/aot/sm75-dot-pieces-candidates-fp16-triton39.csv).
    if DOT_MODE == 1:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    elif DOT_MODE == 2 and a.shape[1] > 128:
        a0, a1 = _halves(a)
        b0, b1 = _halves(tl.trans(b))
        out = _dot_halves(a0, tl.trans(b0), PRECISION) + _dot_halves(a1, tl.trans(b1), PRECISION)
    elif DOT_MODE == 2 and a.shape[1] > 64:
        out = _dot_halves(a, b, PRECISION)
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _halves(x):
    """x [M, K] as its even and odd columns, two [M, K / 2]."""
    return tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))


@triton.jit
def _dot_halves(a, b, PRECISION: tl.constexpr):
    """a @ b as two dots over half the contraction each (even and odd k), in float32."""
    a0, a1 = _halves(a)
    b0, b1 = _halves(tl.trans(b))
    return tl.dot(a1, tl.trans(b1), tl.dot(a0, tl.trans(b0), input_precision=PRECISION), input_precision=PRECISION)


@triton.jit
def load_key_block(k_base, v_base, stride_kn, stride_vn, key0, r, t0, key_end, rows, row_active, d_ok,
               CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys at positions key0 + r*t, t in [t0, t0 + BLOCK_N) (r = 1: a contiguous block; r > 1:
    a dilated one), for the query rows `rows`: (k, v, mask). The mask keeps t < key_end,
    active rows and, when causal, key <= query. Without HAS_MASK (the fast path) every key
    is valid and every row active: no masks at all."""
    t = t0 + tl.arange(0, BLOCK_N)
    kpos = key0 + r * t
    kpos64 = kpos.to(tl.int64)
    if HAS_MASK:
        key_ok = t < key_end
        k = tl.load(k_base + kpos64[:, None] * stride_kn, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + kpos64[:, None] * stride_vn, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        mask = row_active[:, None] & key_ok[None, :]
        if CAUSAL:
            mask = mask & (kpos[None, :] <= rows[:, None])
    else:
        k = tl.load(k_base + kpos64[:, None] * stride_kn, mask=d_ok[None, :], other=0.0)
        v = tl.load(v_base + kpos64[:, None] * stride_vn, mask=d_ok[None, :], other=0.0)
        # unused on the fast path, but (BLOCK_M, BLOCK_N) like the masked one: callers pick
        # the path with a runtime `if`, and compiled Triton rejects a variable whose type
        # differs between the branches (the interpreter does not)
        mask = row_active[:, None] & (t >= t0)[None, :]
    return k, v, mask


@triton.jit
def window_keep(q_pos, k_pos, window, sink_tokens, HAS_SINK_TOKENS: tl.constexpr):
    """The sliding-window predicate of ops/common/masks.py (one definition; this is its
    Triton form): key k_pos visible to query q_pos iff k_pos <= q_pos and (k_pos > q_pos -
    window or k_pos < sink_tokens). window, sink_tokens: run-time integers (one compile for
    every window); without HAS_SINK_TOKENS the sink term is not compiled (sink_tokens unread).
    Positions broadcast ([M, 1] against [1, N])."""
    ok = k_pos > q_pos - window
    if HAS_SINK_TOKENS:
        ok = ok | (k_pos < sink_tokens)
    return ok & (k_pos <= q_pos)


@triton.jit
def softcap_terms(softcap, HAS_SOFTCAP: tl.constexpr):
    """The soft cap's factors `cap` = (c, 1 / c, c * log2(e)), float32, computed once per
    program from the run-time cap c (a float32 argument: one compile serves every cap) for
    online_softmax_step, softmax_grad_block, transposed_grad_step and fold_run. 1 / c is one
    correctly rounded division (div_rn) and c * log2(e) is taken in float64, so each is the
    float32 nearest its exact value, the constants a compiled-in cap gave (bit for bit for a
    cap that float32 holds exactly: 30.0, 50.0, any integer below 2^24). Without HAS_SOFTCAP:
    None (softcap may be None then)."""
    cap = None
    if HAS_SOFTCAP:
        c = tl.cast(softcap, tl.float32)
        cap = (c, tl.math.div_rn(1.0, c), tl.cast(tl.cast(c, tl.float64) * LOG2E, tl.float32))
    return cap


@triton.jit
def tanh(x, EXACT: tl.constexpr):
    """tanh of float32 x (tl.math has no tanh; libdevice's does not run in the interpreter):
    t = (1 - e) / (1 + e) with e = exp(-2|x|), sign restored: +-inf -> +-1, NaN -> NaN. Its
    error is absolute, ~1e-7 (1 - e cancels near 0): far below 16-bit resolution. EXACT (the
    float32 kernels): an odd Taylor polynomial below |x| = 0.25 (next term < 1e-8 relative),
    so t is good to a few ulps everywhere (above, 1 - e >= 0.39: no cancellation)."""
    a = tl.abs(x)
    e = tl.math.exp2(a * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    if EXACT:
        a2 = a * a
        small = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * (
            -0.05396825396825397 + a2 * 0.021869488536155203))))
        t = tl.where(a < 0.25, small, t)
    return tl.where(x < 0, -t, t)


@triton.jit
def online_softmax_step(acc, m_i, l_i, q, k, v, sm_scale, mask,
                        HAS_MASK: tl.constexpr, DOT_MODE: tl.constexpr, PRECISION: tl.constexpr,
                        log_weight=0.0, HAS_WEIGHT: tl.constexpr = False, cap=None,
                        HAS_SOFTCAP: tl.constexpr = False):
    """Fold one key block (k, v: (BLOCK_N, BLOCK_D)) into the running (acc, m, l) of the
    query tile q (BLOCK_M, BLOCK_D). `mask` (BLOCK_M, BLOCK_N) keeps pairs when HAS_MASK.
    HAS_WEIGHT: `log_weight` (BLOCK_M, BLOCK_N) is added to the scores: ln of how many
    times a pair counts (a key two dilated patterns select counts twice), -inf for 0.
    HAS_SOFTCAP (without it the uncapped kernel compiles unchanged): scores
    s -> c * tanh(s / c) before the mask and the weight, `cap` = softcap_terms(c).
    m is in natural units for float32 q, in log2 units for 16-bit q (module docstring);
    `finalize` gives the natural row max either way."""
    qk = dot(q, tl.trans(k), DOT_MODE, PRECISION)
    qk = qk + qk * 0.0     # +-Inf (an infinite key or query) -> NaN, never a dropped -inf
    if q.dtype == tl.float32:   # exact form
        s = qk * sm_scale
        if HAS_SOFTCAP:   # tanh keeps a NaN score NaN (NaN rule)
            c, inv_c, _ = cap
            s = tanh(s * inv_c, True) * c
        if HAS_MASK:
            s = tl.where(mask, s, float("-inf"))
        if HAS_WEIGHT:   # where: a NaN score of an uncounted pair must not survive + -inf
            s = tl.where(log_weight > float("-inf"), s + log_weight, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2((s - m_safe[:, None]) * LOG2E)
        alpha = tl.math.exp2((m_i - m_safe) * LOG2E)
    else:   # FMA form, m in log2 units
        scale2 = tl.where(sm_scale == 0, MIN_SCALE2, sm_scale * LOG2E)   # never 0: 0 * -inf is NaN
        if HAS_WEIGHT or HAS_SOFTCAP:   # log2-unit scores x, the max taken on them
            if HAS_SOFTCAP:   # capped in natural units, then to log2 units
                _, inv_c, c_log2 = cap
                x = tanh(qk * (sm_scale * inv_c), False) * c_log2
            else:
                x = qk * scale2
            if HAS_WEIGHT:
                x = x + log_weight * LOG2E
            if HAS_MASK:
                x = tl.where(mask, x, float("-inf"))
            if HAS_WEIGHT:
                x = tl.where(log_weight > float("-inf"), x, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(x - m_safe[:, None])
        else:
            # the max is taken on the raw q.k (one op per row, not per score): max(q.k) * scale2
            # for scale2 > 0, min(q.k) * scale2 for scale2 < 0; masked pairs get the q.k whose
            # log2 score is -inf. Only the reduction sits in the (uniform) branch: the select
            # in it too made sm90 block_sparse_fwd causal spill (12 B at D = 128)
            if HAS_MASK:
                qk = tl.where(mask, qk, tl.where(sm_scale >= 0, float("-inf"), float("inf")))
            if sm_scale >= 0:
                top = tl.max(qk, 1)
            else:
                top = tl.min(qk, 1)
            m_new = tl.maximum(m_i, top * scale2)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk * scale2 - m_safe[:, None])      # one FMA per score
        alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_MODE, PRECISION)
    return acc, m_new, l_i


@triton.jit
def finalize(acc, m_i, l_i, q, NAN_CHECK: tl.constexpr = True):
    """(out, row max, denominator) of a tile from the running (acc, m, l) that
    online_softmax_step left for the query tile q: out = acc / l in float32 (0 for an empty
    row, l = 0), the row max in natural units (m was in log2 units for 16-bit q).
    NaN rule (NAN_CHECK): a non-finite accumulator row (a NaN or Inf value was read; finite
    inputs never give one) makes l NaN, so the output and lse = max + ln(l) are NaN. Without
    it the caller checks its own output (the ring step, after its merge: fewer live registers)."""
    if NAN_CHECK:
        l_i = l_i + tl.sum(acc * 0.0, 1)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if q.dtype != tl.float32:
        m_i = m_i * LN2
    return out, m_i, l_i


@triton.jit
def load_row_stats(M, L, offs, mask):
    """Saved (max, denominator) of query rows, as (max, log2 denominator) for recomputing
    P = exp2((s - max) * log2(e) - log2(l)). Keeping the max apart from log2(l) keeps P exact to a few
    ulps even when scores are ~1e4 (an fp32 lse of that size is only good to ~1e-3).
    Empty rows (l = 0) get max = +inf so that P = 0."""
    m = tl.load(M + offs, mask=mask, other=0.0)
    l = tl.load(L + offs, mask=mask, other=0.0)
    empty = l == 0.0
    return tl.where(empty, float("inf"), m), tl.math.log2(tl.where(empty, 1.0, l))


@triton.jit
def softmax_grad_block(q, k, v, do, row_max, row_log2l, delta, sm_scale, mask,
                       HAS_MASK: tl.constexpr, DOT_MODE: tl.constexpr, PRECISION: tl.constexpr,
                       log_weight=0.0, HAS_WEIGHT: tl.constexpr = False, cap=None,
                       HAS_SOFTCAP: tl.constexpr = False):
    """Recompute P for a (query block, key block) from the saved row statistics and return
    (p, ds), both (BLOCK_M, BLOCK_N) float32, with ds = P * (dO.V - delta), where delta
    already includes the gradient on lse (delta = rowsum(dO*O) - dlse). HAS_WEIGHT, cap,
    HAS_SOFTCAP: as in online_softmax_step; with the cap, ds is the gradient of the uncapped
    scaled score (times 1 - tanh^2, the cap's derivative)."""
    s = dot(q, tl.trans(k), DOT_MODE, PRECISION) * sm_scale
    if HAS_SOFTCAP:
        c, inv_c, _ = cap
        t = tanh(s * inv_c, k.dtype == tl.float32)
        s = t * c
        f = (1.0 - t * t).to(k.dtype)   # the cap's derivative, kept in k's dtype (as transposed_grad_step)
    if HAS_MASK:
        s = tl.where(mask, s, float("-inf"))
    if HAS_WEIGHT:
        s = s + log_weight
    p = tl.math.exp2((s - row_max[:, None]) * LOG2E - row_log2l[:, None])
    dp = dot(do, tl.trans(v), DOT_MODE, PRECISION)
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * f.to(tl.float32)
    return p, ds


@triton.jit
def transposed_grad_step(dk, dv, s_t, v, qT, do, row_max, row_log2l, delta, DOT_MODE: tl.constexpr,
                         PRECISION: tl.constexpr, cap=None, HAS_SOFTCAP: tl.constexpr = False):
    """softmax_grad_block seen from a key tile, added to its (dk, dv) [BLOCK_M, BLOCK_D]: the
    key tile is the M dimension of every dot (S^T = K Q^T, dV += P^T dO, dP^T = V dO^T,
    dK += dS^T Q), so P^T and dS^T feed the next dots from registers and the query
    statistics broadcast along columns. s_t [BLOCK_M, BLOCK_N]: the scaled scores K Q^T with
    -inf where a pair does not count (the caller's mask); qT [BLOCK_D, BLOCK_N], do
    [BLOCK_N, BLOCK_D], v [BLOCK_M, BLOCK_D]. dK comes without the score scale (applied once
    by the caller). HAS_SOFTCAP: s_t is capped here (its -inf stay -inf; `cap` =
    softcap_terms(c)) and dS^T taken through the cap (times 1 - tanh^2)."""
    if HAS_SOFTCAP:
        c, inv_c, _ = cap
        t_t = tanh(s_t * inv_c, qT.dtype == tl.float32)   # -1 where masked: P = 0 there anyway
        s_t = tl.where(s_t == float("-inf"), s_t, t_t * c)
        # the cap's derivative, kept across the dots in the inputs' dtype (16-bit: half the
        # registers; relative error 2^-9 at most, the rounding dS^T gets before its dot anyway)
        f_t = (1.0 - t_t * t_t).to(qT.dtype)
    # P^T from the saved (max, log2 denominator) of each query (load_row_stats)
    p_t = tl.math.exp2((s_t - row_max[None, :]) * LOG2E - row_log2l[None, :])
    dv += dot(p_t.to(do.dtype), do, DOT_MODE, PRECISION)
    dp_t = dot(v, tl.trans(do), DOT_MODE, PRECISION)                                  # [BLOCK_M, BLOCK_N]
    ds_t = p_t * (dp_t - delta[None, :])
    if HAS_SOFTCAP:
        ds_t = ds_t * f_t.to(tl.float32)
    dk += dot(ds_t.to(qT.dtype), tl.trans(qT), DOT_MODE, PRECISION)
    return dk, dv
