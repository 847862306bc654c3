"""The portable backends' softmax: attention with a differentiable lse (PyTorch's fused CPU
kernel, or a chunked explicit float32 softmax), the oracles' explicit softmax, the NaN rule
of DESIGN §6, the double-backward guard, and the log-sum-exp merge of partial results
(float32, exact when a side is -inf).

A partial result over a subset of keys is (out_i, lse_i) with out_i normalised by its own
denominator exp(lse_i). The union of disjoint key subsets (or the multiset union, where a
key counted twice contributes twice) has lse = log sum_i exp(lse_i) and
out = sum_i exp(lse_i - lse) out_i. The running max is detached: the result does not
depend on it, and detaching keeps -inf rows free of NaN gradients.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .first_order import needs_grad


def safe_lse_weights(lses: torch.Tensor, dim: int = 0):
    """Return (weights, lse) for lses stacked on `dim`: weights sum to 1 where lse is finite,
    are all zero where every lse is -inf (an empty row), and carry no NaN in any gradient.
    A NaN lse (a part that read NaN) makes the row's weights and lse NaN (DESIGN §6). A part
    of +inf (a sink logit of +inf) takes the whole weight, shared with any other +inf part,
    and the lse is +inf: the limit, where inf - inf would give NaN."""
    m = lses.detach().amax(dim=dim, keepdim=True)          # NaN when any part is NaN
    m = m.masked_fill(m == float("-inf"), 0.0)
    top = m == float("inf")
    shifted = torch.where(top, torch.where(lses == float("inf"), 0.0, float("-inf")).to(lses.dtype),
                          lses - m.masked_fill(top, 0.0))
    e = torch.exp(shifted)
    z = e.sum(dim=dim, keepdim=True)
    empty = z == 0                                          # NaN is not empty
    z_safe = z.masked_fill(empty, 1.0)
    lse = (m + torch.log(z_safe)).masked_fill(empty, float("-inf"))
    return e / z_safe, lse.squeeze(dim)


def merge_partials(outs, lses):
    """Merge partial results. outs: sequence of (..., N, D) float tensors, lses: matching
    (..., N). Both may be -inf/zero for rows a part does not cover. Returns (out, lse)
    in float32 (float64 when the inputs are float64)."""
    dtype = torch.promote_types(lses[0].dtype, torch.float32)
    lse_stack = torch.stack([x.to(dtype) for x in lses], dim=0)
    weights, lse = safe_lse_weights(lse_stack, dim=0)
    out = sum(w.unsqueeze(-1) * o.to(dtype) for w, o in zip(weights.unbind(0), outs))
    return out, lse


def add_sinks(out, lse, sinks):
    """(out, lse) of attention without sinks -> the same attention with a sink logit per head
    joining every row's denominator (no value): lse' = log(exp(lse) + exp(sink)),
    out' = out * exp(lse - lse'). Exact, and differentiable in out, lse and sinks: autograd's
    chain rule feeds the attention's backward dO' * w and the matching lse gradient, and gives
    d sink = -sum over rows of exp(sink - lse') * delta' (delta' = rowsum(dO' * O') - dlse').
    out (B, N, H, D), lse (B, H, N), sinks (H,). Computed in float32 (float64 for float64 lse)
    through safe_lse_weights: a row without keys gets out 0 and lse = sink, no NaN in any
    gradient (also with a sink of -inf); a NaN lse stays NaN."""
    acc = torch.promote_types(lse.dtype, torch.float32)
    lse = lse.to(acc)
    sink = sinks.to(device=lse.device, dtype=acc)[None, :, None].expand_as(lse)
    weights, lse = safe_lse_weights(torch.stack([lse, sink]), dim=0)
    out = (out.to(acc) * weights[0].transpose(1, 2).unsqueeze(-1)).to(out.dtype)
    return out, lse


# ----------------------------------------------------------------------------- NaN and Inf
# DESIGN §6: a row that reads a non-finite query, key or value gives NaN out and NaN lse;
# nothing else is touched. A matmul over masked or padded slots would spread them (the
# slot's weight is 0, and 0 * NaN is NaN), so rows and slots holding one are zeroed before
# any arithmetic and the rows that read them are marked NaN afterwards. Finite inputs pay
# one isfinite pass over each input.

def _nonfinite_fix(q, k, v, causal: bool, keep):
    """None when q, k and v are finite; else (q, k, v with every non-finite row zeroed,
    bool (..., L): the query rows that read a non-finite row). A row with no key reads
    nothing (it stays 0 and -inf)."""
    bad_q = ~torch.isfinite(q).all(dim=-1)                                    # (..., L)
    bad_kv = ~(torch.isfinite(k).all(dim=-1) & torch.isfinite(v).all(dim=-1))  # (..., S)
    if not bool(bad_q.any() or bad_kv.any()):
        return None
    L, S = q.shape[-2], k.shape[-2]
    if keep is not None:
        has_key = keep.any(dim=-1)
        reads_bad = (keep & bad_kv.unsqueeze(-2)).any(dim=-1)
    elif causal:     # top-left: row i reads keys 0..i
        has_key = torch.ones(L, dtype=torch.bool, device=q.device)
        seen = bad_kv.cumsum(dim=-1) > 0
        reads_bad = seen[..., torch.arange(L, device=q.device).clamp_max(S - 1)]
    else:
        has_key = torch.ones(L, dtype=torch.bool, device=q.device)
        reads_bad = bad_kv.any(dim=-1, keepdim=True)
    mark = reads_bad | (bad_q & has_key)
    zero_rows = lambda x, bad: x.masked_fill(bad.unsqueeze(-1), 0.0)  # noqa: E731
    return zero_rows(q, bad_q), zero_rows(k, bad_kv), zero_rows(v, bad_kv), mark


def _mark_nan(out, lse, mark):
    out = out.masked_fill(mark.unsqueeze(-1), float("nan"))
    return out, (None if lse is None else lse.masked_fill(mark, float("nan")))


def saved_inputs(ctx):
    """ctx.saved_tensors, with a clear message where an input was modified in place after the
    forward: the portable paths attend over views of q, k, v (no copies), and PyTorch reports
    an edited base of such a view as "Output 0 of ReshapeAlias is a view and its base ... has
    been modified inplace", which names none of the user's tensors."""
    try:
        return ctx.saved_tensors
    except RuntimeError as exc:
        if "modified inplace" not in str(exc) and "modified by an inplace operation" not in str(exc):
            raise
        raise RuntimeError("attention backward (portable backend): q, k or v was modified in place after the forward "
                           "(e.g. k.mul_(2)), and the backward needs the values the forward read; modify a clone "
                           "instead, or call the attention after the edit") from exc


# ----------------------------------------------------------------------------- explicit softmax

def masked_attention_with_lse(q, k, v, mask, call):
    """Explicit attention over the last two dims with a boolean keep-mask (which alone decides
    the pairs), in the dtype of q (callers pass float32 or float64), under the AttentionCall's
    scale and cap (applied before the mask; its sinks are the caller's): the oracles' softmax,
    plain autograd (double backward works). O(L x S) memory.
    Returns (out, lse); rows with no key: 0 and -inf; rows that read a non-finite input: NaN
    and NaN."""
    fix = _nonfinite_fix(q, k, v, False, mask)
    if fix is not None:
        q, k, v, mark = fix
    s = call.cap_scores(torch.matmul(q, k.transpose(-1, -2)) * call.scale)
    s = s.masked_fill(~mask, float("-inf"))
    p, lse = safe_lse_weights(s, dim=-1)
    out = torch.matmul(p, v)
    return _mark_nan(out, lse, mark) if fix is not None else (out, lse)


# Elements of one chunk's score matrix in the explicit path (4 MB in float32): its memory
# is a few of these whatever L and S are.
SCORE_BUDGET = 1 << 20


def _score_chunks(n_batch: int, L: int, S: int):
    """(batch slice, row slice) pairs covering (n_batch, L) with at most ~SCORE_BUDGET
    scores each."""
    rows = max(1, min(L, SCORE_BUDGET // max(1, S)))
    batch = max(1, SCORE_BUDGET // (rows * max(1, S)))
    for b in range(0, n_batch, batch):
        for r in range(0, L, rows):
            yield slice(b, min(n_batch, b + batch)), slice(r, min(L, r + rows))


class _ChunkedAttention(torch.autograd.Function):
    """Attention with a max-subtracted float32 (float64 for float64 inputs) softmax, one
    chunk of query rows at a time, never more than ~SCORE_BUDGET scores alive. The backward
    recomputes each chunk's scores and takes P = exp(s - m) / l from the forward's row max m
    and denominator l (not from lse, whose float32 rounding |lse| * eps would enter P at
    large scores). q: (n, L, D), k, v: (n, S, D); keep: None or bool (n|1, L|1, S).
    Returns out (n, L, D) and lse (n, L) in the accumulation dtype."""

    @staticmethod
    def _scores(q, k, keep, causal, scale, bs, rs, acc, call=None):
        """Scores of the chunk (rows rs of batches bs), capped (call.cap_scores_; call None: no
        cap) and masked; causal chunks stop at their last row's key. Returns (scores, number of
        keys, tanh(s / c) or None): the backward's factor 1 - tanh^2 needs it."""
        keys = min(k.shape[1], rs.stop) if causal else k.shape[1]
        qc, kc = q[bs, rs].to(acc), k[bs, :keys].to(acc)
        s = torch.baddbmm(qc.new_empty(qc.shape[0], qc.shape[1], keys), qc, kc.transpose(1, 2), beta=0.0, alpha=scale)
        t = None
        if call is not None:
            s, t = call.cap_scores_(s)
        if keep is not None:
            kb = bs if keep.shape[0] > 1 else slice(None)
            kr = rs if keep.shape[1] > 1 else slice(None)
            s.masked_fill_(~keep[kb, kr, :keys], float("-inf"))
        if causal and rs.start < keys:   # only the diagonal block holds later keys
            rows = torch.arange(rs.start, rs.stop, device=q.device)[:, None]
            later = torch.arange(rs.start, keys, device=q.device) > rows
            s[:, :, rs.start:].masked_fill_(later, float("-inf"))
        return s, keys, t

    @staticmethod
    def forward(ctx, q, k, v, keep, causal, scale, call=None):
        acc = torch.promote_types(q.dtype, torch.float32)
        n, L, _ = q.shape
        out = torch.empty(n, L, v.shape[-1], dtype=acc, device=q.device)
        row_max = torch.empty(n, L, 1, dtype=acc, device=q.device)
        row_sum = torch.empty(n, L, 1, dtype=acc, device=q.device)
        for bs, rs in _score_chunks(n, L, k.shape[1]):
            s, keys, _ = _ChunkedAttention._scores(q, k, keep, causal, scale, bs, rs, acc, call)
            m = s.amax(dim=-1, keepdim=True)
            m.masked_fill_(m == float("-inf"), 0.0)                       # rows with no key
            p = s.sub_(m).exp_()
            l_ = p.sum(dim=-1, keepdim=True)
            out[bs, rs] = torch.matmul(p, v[bs, :keys].to(acc)).div_(l_.masked_fill(l_ == 0, 1.0))
            row_max[bs, rs], row_sum[bs, rs] = m, l_
        lse = (row_max + torch.log(row_sum)).squeeze(-1)                   # log 0 = -inf: no key
        ctx.save_for_backward(q, k, v, keep, out, row_max, row_sum)
        ctx.causal, ctx.scale, ctx.call = causal, scale, call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, keep, out, row_max, row_sum = saved_inputs(ctx)
        acc = out.dtype
        n, L, _ = q.shape
        dout = torch.zeros_like(out) if dout is None else dout.to(acc)
        delta = (dout * out).sum(dim=-1, keepdim=True)                     # dS = P * (dP - delta)
        if dlse is not None:
            delta = delta - dlse.to(acc).unsqueeze(-1)
        inv_l = 1.0 / row_sum.masked_fill(row_sum == 0, 1.0)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for bs, rs in _score_chunks(n, L, k.shape[1]):
            s, keys, t = _ChunkedAttention._scores(q, k, keep, ctx.causal, ctx.scale, bs, rs, acc, ctx.call)
            p = s.sub_(row_max[bs, rs]).exp_().mul_(inv_l[bs, rs])
            do = dout[bs, rs]
            dv[bs, :keys] += torch.matmul(p.transpose(1, 2), do)
            ds = torch.matmul(do, v[bs, :keys].to(acc).transpose(1, 2)).sub_(delta[bs, rs]).mul_(p)
            if t is not None:   # through the cap: d(c * tanh(s / c)) / ds = 1 - tanh^2
                ds.mul_(1.0 - t * t)
            dq[bs, rs] = torch.matmul(ds, k[bs, :keys].to(acc)).mul_(ctx.scale)
            dk[bs, :keys] += torch.matmul(ds.transpose(1, 2), q[bs, rs].to(acc)).mul_(ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _chunked_attention(q, k, v, causal, scale, keep, call=None):
    """_ChunkedAttention on (..., L, D) inputs and a keep-mask broadcastable to (..., L, S);
    call: the AttentionCall whose cap applies (None: no cap)."""
    batch, L = q.shape[:-2], q.shape[-2]
    flat = lambda x: x.reshape(-1, *x.shape[-2:])  # noqa: E731
    if keep is not None:
        keep = keep.expand(*batch, *keep.shape[-2:])
        keep = keep.reshape(-1, *keep.shape[-2:]) if keep.dim() > 2 else keep.unsqueeze(0)
    out, lse = _ChunkedAttention.apply(flat(q), flat(k), flat(v), keep, causal, scale, call)
    return out.reshape(*batch, L, v.shape[-1]), lse.reshape(*batch, L)


# ----------------------------------------------------------------------------- fused CPU kernel

class _CpuFlashWithLse(torch.autograd.Function):
    """PyTorch's fused CPU flash attention, which also returns lse, made differentiable in
    lse. Its backward takes dS = P * (dP - delta) with delta = rowsum(grad_out * out); an
    lse gradient must enter as delta - dlse. So the backward runs on inputs padded with one
    zero column (scores and P unchanged), grad_out's extra column 1 and out's extra column
    -dlse: delta picks up -dlse, dP does not (v's extra column is 0), and the extra
    columns of the gradients are dropped. `bias`: an additive float mask or None."""

    @staticmethod
    def forward(ctx, q, k, v, bias, causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                             scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, bias)
        ctx.causal, ctx.scale = causal, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, bias = saved_inputs(ctx)
        bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        kw = dict(attn_mask=bias, scale=ctx.scale)
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        if dlse is None:
            dq, dk, dv = bwd(dout, q, k, v, out, lse, 0.0, ctx.causal, **kw)
            return dq, dk, dv, None, None, None

        def pad(x, column=None):
            extra = torch.zeros_like(x[..., :1]) if column is None else column.unsqueeze(-1).to(x.dtype)
            return torch.cat([x, extra], dim=-1)
        dq, dk, dv = bwd(pad(dout, torch.ones_like(dlse)), pad(q), pad(k), pad(v), pad(out, -dlse), lse, 0.0,
                         ctx.causal, **kw)
        return dq[..., :-1], dk[..., :-1], dv[..., :-1], None, None, None


# The fused backward recomputes P = exp(s - lse) from a float32 lse, which is off by
# |lse| * eps32: harmless for ordinary scores, but for scores of size 1e3-1e4 it gives
# gradients several times less exact than a max-subtracted float32 softmax. Above this
# bound on |score| a call that needs gradients takes the chunked explicit path (same memory
# order, slower); a forward-only call keeps the fused kernel.
FUSED_MAX_SCORE = 100.0


def _cpu_flash_available(q, k) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and q.numel() > 0 and k.numel() > 0
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"))


def _large_scores(q, k, scale) -> torch.Tensor:
    """bool over the batch dims of q: some |score| of that slice may exceed FUSED_MAX_SCORE
    (|q.k| * scale <= scale * max|q| * max|k|, Cauchy-Schwarz)."""
    with torch.no_grad():
        bound = abs(scale) * q.float().norm(dim=-1).amax(dim=-1) * k.float().norm(dim=-1).amax(dim=-1)
    return ~(bound <= FUSED_MAX_SCORE)


def _use_cpu_flash(q, k, scale) -> bool:
    """Whether the fused CPU kernel takes all of this call."""
    return _cpu_flash_available(q, k) and not bool(_large_scores(q, k, scale).any())


def _positive_scale(q, scale):
    """(q', scale') with q'.k * scale' == q.k * scale and scale' > 0. PyTorch's fused kernels
    with is_causal=True return NaN for a scale <= 0 (even in float64; a boolean mask does
    not): they only ever see a positive scale."""
    if scale > 0:
        return q, scale
    return (-q, -scale) if scale < 0 else (q * 0.0, 1.0)


def all_finite(*xs) -> bool:
    """Whether every element of xs is finite: callers that split their inputs into many
    attention calls check once and pass finite=True. A finite sum proves every element
    finite (a NaN or Inf term makes the sum NaN or Inf), in one vectorised pass with no
    temporaries (~20x cheaper than isfinite(x).all() on CPU, measured); only a sum that
    overflowed, or a real non-finite element, pays the exact elementwise check."""
    return all(math.isfinite(x.sum().item()) or bool(torch.isfinite(x).all()) for x in xs)


def attention_with_lse(q, k, v, call, keep=None, need_lse: bool = True, finite: bool = False, causal=None):
    """Attention on (B, H, L, D) queries and (B, H, S, D) keys/values (any strides) under the
    AttentionCall `call` (scale, cap; its sinks are the caller's) with either causal (top-left;
    call.causal unless `causal` is given) or a boolean keep-mask broadcastable to (B, H, L, S). Returns
    out (B, H, L, D) and lse (B, H, L) float32 (float64 for float64 inputs; None without
    need_lse); a row with no key gets 0 and -inf, a row that reads a non-finite input NaN
    and NaN. Both are differentiable (once). On CPU this is PyTorch's fused flash kernel
    (out in q's dtype; several times faster), except, when a gradient is needed, for the
    batch slices whose scores may exceed FUSED_MAX_SCORE; without need_lse off the CPU,
    scaled_dot_product_attention; else the chunked explicit float32 softmax. No path holds
    more than ~SCORE_BUDGET scores at once (the caller's keep-mask aside). finite=True: the caller knows q, k, v are finite
    (skips the check). A capped call always takes the chunked explicit path (PyTorch's fused
    kernels have no cap)."""
    causal = call.causal if causal is None else causal
    scale = call.scale
    L, S = q.shape[-2], k.shape[-2]
    if L == 0 or S == 0 or q.shape[:-2].numel() == 0:
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=acc)
        return out, (q.new_full(q.shape[:-1], float("-inf"), dtype=acc) if need_lse else None)
    fix = None if finite else _nonfinite_fix(q, k, v, causal, keep)
    if fix is not None:
        q, k, v, mark = fix
    if call.capped:
        out, lse = _chunked_attention(q, k, v, causal, scale, keep, call)
    else:
        out, lse = _attention(q, k, v, causal, scale, keep, need_lse)
    return _mark_nan(out, lse, mark) if fix is not None else (out, lse)


def _attention(q, k, v, causal, scale, keep, need_lse):
    if _cpu_flash_available(q, k):
        # the score bound guards the fused *backward* only (FUSED_MAX_SCORE): its forward keeps
        # a running max, as exact as the explicit path at any score (measured to 2e4), so a
        # call no gradient flows through skips the bound's two passes over q and k
        if not needs_grad(q, k, v):
            return _cpu_flash(q, k, v, causal, scale, keep, need_lse)
        large = _large_scores(q, k, scale)
        if not bool(large.any()):
            return _cpu_flash(q, k, v, causal, scale, keep, need_lse)
        if not bool(large.all()):   # e.g. one attention-sink row: only its slices go explicit
            return _split_batches(large, q, k, v, causal, scale, keep)
    elif not need_lse and keep is None and q.device.type != "cpu":
        q, scale = _positive_scale(q, scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale), None
    return _chunked_attention(q, k, v, causal, scale, keep)


def _cpu_flash(q, k, v, causal, scale, keep, need_lse):
    q, scale = _positive_scale(q, scale)
    # the fused op reads rows as if the last dimension were contiguous (wrong results
    # otherwise, measured): copy the rare inputs where it is not
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if keep is None:
        if not need_lse:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale), None
        return _flash_with_lse(q, k, v, None, causal, scale)
    bias = torch.where(keep, torch.zeros((), dtype=q.dtype), torch.full((), float("-inf"), dtype=q.dtype))
    out, lse = _flash_with_lse(q, k, v, bias, False, scale)   # keyless rows: out 0, lse 0
    return out, lse.masked_fill(~keep.any(dim=-1), float("-inf"))


def _flash_with_lse(q, k, v, bias, causal, scale):
    """The fused CPU kernel's (out, lse): through _CpuFlashWithLse where a gradient is needed,
    else the op itself (no autograd.Function overhead: ~40 us a call, measured)."""
    if needs_grad(q, k, v):
        return _CpuFlashWithLse.apply(q, k, v, bias, causal, scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                     scale=scale)


def _split_batches(large, q, k, v, causal, scale, keep):
    """The fused kernel on the batch slices with ordinary scores, the chunked explicit path
    on the others; (out, lse) in the accumulation dtype, batch order restored."""
    batch, (L, _), n = q.shape[:-2], q.shape[-2:], large.numel()
    flat = lambda x: x.reshape(n, *x.shape[-2:])  # noqa: E731
    qf, kf, vf = flat(q), flat(k), flat(v)
    keep_f = None if keep is None else flat(keep.expand(*batch, *keep.shape[-2:]))
    acc = torch.promote_types(q.dtype, torch.float32)
    flat_large = large.reshape(n)
    ids, outs, lses = [], [], []
    for sel, explicit in (((~flat_large).nonzero().flatten(), False), (flat_large.nonzero().flatten(), True)):
        qs, ks, vs = qf[sel], kf[sel], vf[sel]
        keep_s = None if keep_f is None else keep_f[sel]
        if explicit:
            o, l_ = _chunked_attention(qs, ks, vs, causal, scale, keep_s)
        else:   # the fused kernel takes (B, H, L, D)
            o, l_ = _cpu_flash(qs[None], ks[None], vs[None], causal, scale, None if keep_s is None else keep_s[None],
                               True)
            o, l_ = o[0], l_[0]
        ids.append(sel)
        outs.append(o.to(acc))
        lses.append(l_.to(acc))
    back = torch.argsort(torch.cat(ids))
    return torch.cat(outs)[back].reshape(*batch, L, v.shape[-1]), torch.cat(lses)[back].reshape(*batch, L)


# ----------------------------------------------------------------------------- double backward

def lse_from_stats(row_max, row_sum):
    """lse = max + ln(denominator) from the kernels' row statistics; -inf for empty rows."""
    empty = row_sum == 0
    lse = row_max + torch.log(torch.where(empty, torch.ones_like(row_sum), row_sum))
    return torch.where(empty, torch.full_like(lse, float("-inf")), lse)


def softmax_delta(do, out, dlse=None, rows_per_chunk: int = 1 << 16):
    """delta = rowsum(dO * O) - dlse, float32 (B, H, N): the lse gradient enters the
    backward as dS = P * (dP - delta). Computed in chunks of rows so the float32 upcasts
    never cost a full copy of O and dO."""
    B, N, H, _ = out.shape
    delta = torch.empty(B, H, N, dtype=torch.float32, device=out.device)
    for s in range(0, N, rows_per_chunk):
        e = min(N, s + rows_per_chunk)
        delta[:, :, s:e] = torch.einsum("bnhd,bnhd->bhn", do[:, s:e].float(), out[:, s:e].float())
    if dlse is not None:
        delta -= dlse.float()
    return delta
