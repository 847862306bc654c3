"""Shared test helpers: the same-dtype PyTorch reference and the tolerance rule (DESIGN §6).

Tolerance rule (flash-attention's tests): |kernel - oracle_f64| <= factor * |torch_same_dtype
- oracle_f64| + floor, on the max over the tensor; factor 2 for outputs and lse, 3 for
gradients. The same-dtype reference is dense attention in the test dtype (no upcast) over
the multiplicity matrix of the dilated patterns: C[h, p, p'] = how many of head h's
patterns select the pair (p, p') (a key two patterns select counts twice).
"""
from __future__ import annotations

import math

import torch

from triton_dilated.ops.dilated.patterns import head_offsets


def multiplicity(n, segment_lengths, dilation_rates, num_heads, *, causal, mode="longnet", offsets="modulo"):
    """(Hq, N, N) float64 counts, built directly from DESIGN §3 with dense index arithmetic."""
    patterns = tuple(zip(segment_lengths, dilation_rates))
    table = head_offsets(num_heads, patterns, mode, offsets)
    pos = torch.arange(n)
    c = torch.zeros(num_heads, n, n, dtype=torch.float64)
    for h, row in enumerate(table):
        for (w, r), o in zip(patterns, row):
            if o < 0:
                continue
            seg = pos // w * w
            active = (pos - seg) % r == o
            sel = active[:, None] & active[None, :] & (seg[:, None] == seg[None, :])
            if causal:
                sel &= pos[:, None] >= pos[None, :]
            c[h] += sel.double()
    return c


def dense_reference(q, k, v, counts, scale=None):
    """Attention with multiplicities counts ((B|1, Hq, N, N) or (Hq, N, N)) in the dtype of q
    (no upcast): (out, lse). Rows with no
    key: out 0, lse -inf. Differentiable."""
    B, N, Hq, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    group = Hq // k.shape[2]
    kk = k.repeat_interleave(group, dim=2)
    vv = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    cnt = counts.to(device=q.device)
    cnt = cnt if cnt.dim() == 4 else cnt[None]
    s = s.masked_fill(cnt == 0, float("-inf"))
    m = s.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m) * cnt.to(s.dtype)
    z = e.sum(-1, keepdim=True)
    z_safe = torch.where(z > 0, z, torch.ones_like(z))
    out = torch.einsum("bhqk,bkhd->bqhd", (e / z_safe).to(q.dtype), vv)
    lse = torch.where(z > 0, m + torch.log(z_safe), torch.full_like(z, float("-inf"))).squeeze(-1)
    return out, lse.float() if q.dtype != torch.float64 else lse


def max_err(a, b, finite_mask=None):
    d = (a.double() - b.double()).abs()
    if finite_mask is not None:
        d = d[finite_mask]
    return d.max().item() if d.numel() else 0.0


def assert_rule(name, actual, oracle, same_dtype, *, factor, floor):
    """|actual - oracle| <= factor * |same_dtype - oracle| + floor (max norms); -inf must match."""
    assert not torch.isnan(actual).any(), f"{name}: NaN"
    inf_a, inf_o = torch.isinf(actual), torch.isinf(oracle)
    assert torch.equal(inf_a, inf_o), f"{name}: -inf pattern differs ({inf_a.sum()} vs {inf_o.sum()})"
    fin = ~inf_o
    err = max_err(actual, oracle, fin)
    ref_err = max_err(same_dtype, oracle, fin)
    scale = max(1.0, max_err(oracle, torch.zeros_like(oracle), fin))
    bound = factor * ref_err + floor * scale
    assert err <= bound, f"{name}: |kernel - oracle| = {err:.3g} > {bound:.3g} (same-dtype ref error {ref_err:.3g})"


FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def finite(x):
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def seeded(shape, dtype, seed, device="cpu", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def log2_ceil(x):
    return 1 << max(0, math.ceil(math.log2(max(1, x))))
