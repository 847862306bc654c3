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
