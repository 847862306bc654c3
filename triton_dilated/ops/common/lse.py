"""Log-sum-exp merge of partial attention results (float32, exact when a side is -inf).

A partial result over a subset of keys is (out_i, lse_i) with out_i normalised by its own
denominator exp(lse_i). The union of disjoint key subsets (or the multiset union, where a
key counted twice contributes twice) has lse = log sum_i exp(lse_i) and
out = sum_i exp(lse_i - lse) out_i. The running max is detached: the result does not
depend on it, and detaching keeps -inf rows free of NaN gradients.
"""
from __future__ import annotations

import torch


def safe_lse_weights(lses: torch.Tensor, dim: int = 0):
    """Return (weights, lse) for lses stacked on `dim`: weights sum to 1 where lse is finite,
    are all zero where every lse is -inf (an empty row), and carry no NaN in any gradient."""
    m = lses.detach().amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(lses - m)
    z = e.sum(dim=dim, keepdim=True)
    nonempty = z > 0
    z_safe = torch.where(nonempty, z, torch.ones_like(z))
    lse = torch.where(nonempty, m + torch.log(z_safe), torch.full_like(z, float("-inf")))
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


def masked_attention_with_lse(q, k, v, mask, scale: float):
    """Explicit attention over the last two dims with a boolean keep-mask, in the dtype of q
    (callers pass float32 or float64). Returns (out, lse); rows with no key: 0 and -inf."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p, lse = safe_lse_weights(s, dim=-1)
    return torch.matmul(p, v), lse


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
        q, k, v, out, lse, bias = ctx.saved_tensors
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
# bound on |score| the explicit path is used.
FUSED_MAX_SCORE = 100.0


def _use_cpu_flash(q, k, scale) -> bool:
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16, torch.float16) \
            or not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return False
    if q.numel() == 0 or k.numel() == 0:
        return False
    with torch.no_grad():   # |q.k| * scale <= scale * max|q| * max|k| (Cauchy-Schwarz)
        bound = abs(scale) * q.float().norm(dim=-1).amax() * k.float().norm(dim=-1).amax()
    return bool(bound <= FUSED_MAX_SCORE)


def attention_with_lse(q, k, v, causal: bool, scale: float, keep=None):
    """Attention on (B, H, L, D) queries and (B, H, S, D) keys/values (any strides) with
    either `causal` or a boolean keep-mask broadcastable to (B, H, L, S). Returns out
    (B, H, L, D) and lse (B, H, L) in float32 (or float64); a row with no key gets 0 and
    -inf. Both are differentiable. On CPU this is PyTorch's fused flash kernel (out in q's
    dtype; several times faster than the explicit path) unless scores may exceed
    FUSED_MAX_SCORE; elsewhere the explicit float32 softmax."""
    if _use_cpu_flash(q, k, scale):
        # the fused op reads rows as if the last dimension were contiguous (wrong results
        # otherwise, measured): copy the rare inputs where it is not
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        if keep is None:
            return _CpuFlashWithLse.apply(q, k, v, None, causal, scale)
        bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, float("-inf"))
        out, lse = _CpuFlashWithLse.apply(q, k, v, bias, False, scale)   # keyless rows: out 0, lse 0
        return out, lse.masked_fill(~keep.any(dim=-1), float("-inf"))
    if keep is None:
        L, S = q.shape[-2], k.shape[-2]
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device)
        if causal:
            keep = keep.tril()
    acc = torch.promote_types(q.dtype, torch.float32)
    return masked_attention_with_lse(q.to(acc), k.to(acc), v.to(acc), keep, scale)


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
