"""Shared @triton.jit pieces: the online-softmax step and its backward counterparts.

Scores live in the log2 domain (q.k * scale * log2(e)) so the kernels use exp2; the
running max, the denominators and the accumulators are float32. A row whose keys are all
masked keeps m = -inf; the max is replaced by 0 before it is subtracted so that no
-inf - -inf = NaN appears, and such a row ends with l = 0: output 0, lse = -inf.
"""
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def dot(a, b, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    # DOT_FP32: the interpreter computes bf16 tl.dot wrongly, so it multiplies in float32.
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def online_softmax_step(acc, m_i, l_i, q, k, v, qk_scale_log2, mask,
                        HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Fold one key block (k, v: (BLOCK_N, BLOCK_D)) into the running (acc, m, l) of the
    query tile q (BLOCK_M, BLOCK_D). `mask` (BLOCK_M, BLOCK_N) keeps pairs when HAS_MASK."""
    s = dot(q, tl.trans(k), DOT_FP32, PRECISION) * qk_scale_log2
    if HAS_MASK:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_FP32, PRECISION)
    return acc, m_new, l_i


@triton.jit
def finalize(acc, m_i, l_i):
    """(out float32, lse natural log) of a tile; empty rows give 0 and -inf."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return out, lse


@triton.jit
def softmax_grad_block(q, k, v, do, lse2, delta, qk_scale_log2, mask,
                       HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Recompute P for a (query block, key block) from the saved log2-domain lse and return
    (p, ds), both (BLOCK_M, BLOCK_N) float32, with ds = P * (dO.V - delta), where delta
    already includes the gradient on lse (delta = rowsum(dO*O) - dlse)."""
    s = dot(q, tl.trans(k), DOT_FP32, PRECISION) * qk_scale_log2
    p = tl.math.exp2(s - lse2[:, None])
    if HAS_MASK:
        p = tl.where(mask, p, 0.0)
    dp = dot(do, tl.trans(v), DOT_FP32, PRECISION)
    ds = p * (dp - delta[:, None])
    return p, ds
