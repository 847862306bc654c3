"""Shared test helpers: the comparison with the float64 oracle that every kernel and path
test uses (DESIGN §6), the same-dtype references it needs, and the serve-door calls for
queries at the end of longer keys (dilated_serve, block_sparse_serve: the training doors take
same-length q, k, v only).

Tolerance rule (flash-attention's tests), on the max over a tensor:

    |x - oracle_f64| <= factor * |torch_same_dtype - oracle_f64| + floor * max(1, |oracle_f64|)

factor 2 for outputs and lse, 3 for gradients; floor FLOOR[dtype] (about one unit of the
dtype's last place at 1). The same-dtype reference is plain PyTorch attention in the test
dtype (no upcast) over the same (query, key) multiplicities, so the rule asks a kernel to be
at most a small factor worse than PyTorch in that dtype. `check_against_oracle` applies it
to out, lse and the gradients of a loss that uses both, and checks the rows without keys.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from triton_dilated import block_sparse_attention_with_kvcache, dilated_attention_with_kvcache
from triton_dilated.ops.dilated.naive import dilated_multiplicity as multiplicity  # noqa: F401 (imported from here)

FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
NAMES = ("out", "lse", "dq", "dk", "dv")


def finite(x):
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def seeded(shape, dtype, seed, device="cpu", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def log2_ceil(x):
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def max_err(a, b, mask=None):
    """max |a - b| (over `mask` where given), in float64; 0 for no element."""
    d = (a.double() - b.double()).abs()
    if mask is not None:
        d = d[mask]
    return d.max().item() if d.numel() else 0.0


# ----------------------------------------------------------------------------- serve doors

def full_lengths(q, k):
    """The serve doors' cache_seqlens for every key row of k valid: int32 (B,) on q's device
    holding Nk (what a training-door call with q shorter than k meant before it went to the
    serve doors)."""
    return torch.full((q.shape[0],), k.shape[1], dtype=torch.int32, device=q.device)


def dilated_serve(q, k, v, segment_lengths, dilation_rates, *, cache_seqlens=None, causal=False, **kw):
    """Queries at the end of longer keys (q (B, Nq, ...) against k, v (B, Nk, ...)) through
    dilated_attention_with_kvcache without new rows: row b's queries are the last Nq of its
    L_b = cache_seqlens[b] rows (None: every row, full_lengths). causal defaults to False as
    on the training door (the serve door's default is True)."""
    lengths = full_lengths(q, k) if cache_seqlens is None else cache_seqlens
    return dilated_attention_with_kvcache(q, k, v, cache_seqlens=lengths, segment_lengths=segment_lengths,
                                          dilation_rates=dilation_rates, causal=causal, **kw)


def block_sparse_serve(q, k, v, layout, *, cache_seqlens=None, causal=False, **kw):
    """block_sparse_attention_with_kvcache as dilated_serve: no new rows, L_b =
    cache_seqlens[b] rows (None: every row), causal False unless given."""
    lengths = full_lengths(q, k) if cache_seqlens is None else cache_seqlens
    return block_sparse_attention_with_kvcache(q, k, v, cache_seqlens=lengths, layout=layout, causal=causal, **kw)


# ----------------------------------------------------------------------------- references

def dense_reference(q, k, v, counts, scale=None, softcap=None, sinks=None):
    """Attention with multiplicities `counts` ((B|1, Hq|1, N, Nk) or (Hq, N, Nk); a key
    counted twice has twice the weight) in the dtype of q (no upcast): (out, lse). Rows with
    no key: out 0, lse -inf. Differentiable. With float64 inputs it is the dense definition
    of DESIGN §3/§4 (an independent check of the gather-based oracles). softcap: scores
    s -> softcap * tanh(s / softcap); sinks (Hq,): a logit per head added to every row's
    denominator (exp(sink), no value), in q's dtype."""
    B, N, Hq, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    group = Hq // k.shape[2]
    kk = k.repeat_interleave(group, dim=2)
    vv = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    cnt = counts.to(device=q.device)
    cnt = cnt if cnt.dim() == 4 else cnt[None]
    s = s.masked_fill(cnt == 0, float("-inf"))
    m = s.detach().amax(-1, keepdim=True)
    if sinks is not None:
        sink = sinks.to(s.dtype)[None, :, None, None]
        m = torch.maximum(m, sink.detach())
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m) * cnt.to(s.dtype)
    z = e.sum(-1, keepdim=True)
    if sinks is not None:
        z = z + torch.exp(sink - m)
    z_safe = torch.where(z > 0, z, torch.ones_like(z))
    out = torch.einsum("bhqk,bkhd->bqhd", (e / z_safe).to(q.dtype), vv)
    lse = torch.where(z > 0, m + torch.log(z_safe), torch.full_like(z, float("-inf"))).squeeze(-1)
    return out, lse.float() if q.dtype != torch.float64 else lse


def sdpa_reference(*, causal, scale=None):
    """(q, k, v) -> (out, lse): dense attention through torch's scaled_dot_product_attention
    (GQA by repeating k, v) and a logsumexp of the scores; in the dtype of q (float64 gives
    an oracle that shares no code with the package)."""
    def run(q, k, v):
        group = q.shape[2] // k.shape[2]
        qt = q.transpose(1, 2)
        kt, vt = (x.repeat_interleave(group, dim=2).transpose(1, 2) for x in (k, v))
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale).transpose(1, 2)
        sdt = torch.float64 if q.dtype == torch.float64 else torch.float32   # lse is float32 at most
        s = qt.to(sdt) @ kt.to(sdt).transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if causal:
            n, nk = s.shape[-2:]
            s = s.masked_fill(~torch.ones(n, nk, dtype=torch.bool, device=s.device).tril(), float("-inf"))
        return out, torch.logsumexp(s, dim=-1)
    return run


# ----------------------------------------------------------------------------- the rule

def rule_bound(actual, oracle, same_dtype, *, factor, floor):
    """(err, bound) of the tolerance rule on the entries where the oracle is finite."""
    fin = ~torch.isinf(oracle)
    err = max_err(actual, oracle, fin)
    ref_err = max_err(same_dtype, oracle, fin)
    scale = max(1.0, max_err(oracle, torch.zeros_like(oracle), fin))
    return err, factor * ref_err + floor * scale, ref_err


def assert_rule(name, actual, oracle, same_dtype, *, factor, floor):
    """|actual - oracle| <= factor * |same_dtype - oracle| + floor * max(1, |oracle|) (max
    norms over the finite entries); no NaN; infinities exactly where the oracle has them,
    with the same sign (-inf lse: a row without key)."""
    assert actual.shape == oracle.shape, f"{name}: shape {tuple(actual.shape)}, oracle {tuple(oracle.shape)}"
    assert not torch.isnan(actual).any(), f"{name}: NaN"
    inf_a, inf_o = torch.isinf(actual), torch.isinf(oracle)
    assert torch.equal(inf_a, inf_o), f"{name}: inf pattern differs ({int(inf_a.sum())} vs {int(inf_o.sum())})"
    assert torch.equal(actual[inf_o].double(), oracle[inf_o].double()), f"{name}: an infinity of the other sign"
    err, bound, ref_err = rule_bound(actual, oracle, same_dtype, factor=factor, floor=floor)
    assert err <= bound, f"{name}: |x - oracle| = {err:.3g} > {bound:.3g} (same-dtype ref error {ref_err:.3g})"


def assert_rule_all(got, oracle, same, *, floor, grad_floor=None, what=""):
    """The rule on (out, lse, dq, dk, dv) tuples (entries None are skipped): factor 2 for
    out and lse, 3 for gradients."""
    for i, (name, x, o, s) in enumerate(zip(NAMES, got, oracle, same)):
        if x is not None:
            assert_rule(what + name, x, o, s, factor=2 if i < 2 else 3,
                        floor=floor if i < 2 or grad_floor is None else grad_floor)


def assert_empty_rows(counts, out, lse, grads=None):
    """Rows without keys (DESIGN §3): where `counts` ((B|1, Hq|1, N, Nk) or (Hq, N, Nk))
    gives a query no key, lse is -inf, out and dq are exactly 0 (and lse is finite on every
    other row); a key no query of its group reads gets dk = dv = 0 exactly."""
    B, N, Hq, _ = out.shape
    c = counts if counts.dim() == 4 else counts[None]
    c = c.to(out.device).expand(B, Hq, N, c.shape[-1]) > 0
    empty = ~c.any(-1)                                            # (B, Hq, N)
    assert torch.equal(torch.isneginf(lse), empty), "lse is -inf on other rows than those without keys"
    assert torch.isfinite(lse[~empty]).all()
    rows = empty.transpose(1, 2)                                  # (B, N, Hq)
    assert (out[rows] == 0).all(), "rows without keys must output exactly 0"
    if grads is None:
        return
    dq, dk, dv = grads
    assert (dq[rows] == 0).all(), "rows without keys must get dq exactly 0"
    Hkv = dk.shape[2]
    read = c.any(-2).view(B, Hkv, Hq // Hkv, -1).any(2).transpose(1, 2)   # (B, Nk, Hkv)
    assert (dk[~read] == 0).all() and (dv[~read] == 0).all(), "keys nobody reads must get dk = dv = 0 exactly"


class OracleCheck(NamedTuple):
    got: tuple      # (out, lse, dq, dk, dv) of fn; gradients None with grads=False
    oracle: tuple
    same: tuple
    cotangents: tuple   # (g, gl) float64, the loss sum(out * g) + sum(finite(lse) * gl)


def _run(fn, leaves, g, gl, grads):
    out, lse = fn(*leaves)
    if not grads:
        return out.detach(), lse.detach(), None, None, None
    loss = (out.double() * g).sum() + (finite(lse).double() * gl).sum()
    return (out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves))


def check_against_oracle(fn, oracle, same_dtype, inputs, *, grads=True, counts=None, floor=None, grad_floor=None,
                         seed=0, out_only=None):
    """Run `fn`, `oracle` and `same_dtype` (each (q, k, v) -> (out, lse)) on `inputs` = (q, k, v)
    and assert the tolerance rule on out, lse and (grads=True) the gradients of
    sum(out * g) + sum(lse * gl) (g, gl seeded draws, exact in out's and lse's dtype; -inf
    lse entries left out), so gradients flow through out and through lse.

    fn gets q, k, v as given (strides kept: strided views stay strided), the oracle float64
    copies (its gradients unrounded), same_dtype fresh leaves of the input dtype. Also
    checked: out like q (shape, dtype, contiguous), lse float32 (B, Hq, N), gradients in
    the input dtype, no NaN/Inf except -inf lse where the oracle has it; with `counts`
    (the multiplicity matrix of the case) the rows without keys (assert_empty_rows) for fn
    and the oracle. `out_only`: another path that returns out alone (checked the same way,
    forward only). floor defaults to FLOOR[dtype], grad_floor to floor. Returns the three
    results as an OracleCheck for further checks."""
    q = inputs[0]
    dtype = q.dtype
    leaves = tuple(x.detach().requires_grad_(grads) for x in inputs)
    leaves64 = tuple(x.detach().double().requires_grad_(grads) for x in inputs)
    same_leaves = tuple(x.detach().clone().requires_grad_(grads) for x in inputs)
    B, N, Hq, D = q.shape
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(B, N, Hq, D, generator=gen, dtype=torch.float64).to(dtype).double().to(q.device)
    gl = torch.randn(B, Hq, N, generator=gen, dtype=torch.float64).float().double().to(q.device)

    got = _run(fn, leaves, g, gl, grads)
    ref = _run(oracle, leaves64, g, gl, grads)
    same = _run(same_dtype, same_leaves, g, gl, grads)
    out, lse = got[0], got[1]
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous(), (out.shape, out.dtype, out.stride())
    assert lse.shape == (B, Hq, N) and lse.dtype == torch.float32, (lse.shape, lse.dtype)
    if grads:
        assert all(d.dtype == dtype and d.shape == x.shape for d, x in zip(got[2:], inputs))
    floor = FLOOR[dtype] if floor is None else floor
    assert_rule_all(got, ref, same, floor=floor, grad_floor=grad_floor)
    if counts is not None:
        assert_empty_rows(counts, ref[0], ref[1], ref[2:] if grads else None)
        assert_empty_rows(counts, out, lse, got[2:] if grads else None)
    else:
        rows = torch.isneginf(ref[1]).transpose(1, 2)
        assert (out[rows] == 0).all() and (not grads or (got[2][rows] == 0).all()), "rows without keys: not 0"
    if out_only is not None:
        with torch.no_grad():
            alone = out_only(*leaves)
        assert alone.shape == q.shape and alone.dtype == dtype
        assert_rule("out (out_only path)", alone, ref[0], same[0], factor=2, floor=floor)
        assert (alone[torch.isneginf(ref[1]).transpose(1, 2)] == 0).all()
    return OracleCheck(got, ref, same, (g, gl))
