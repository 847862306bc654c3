"""Indexed attention's comparison with the float64 oracle (DESIGN §6's rule, tests/helpers/
reference.py), for outputs whose head dim differs from q's (Dv != Dqk) and for the sinks'
gradient; and the random cases the property tests draw."""
from __future__ import annotations

import torch

from tests.helpers.reference import FLOOR, assert_rule, dense_reference, finite, seeded
from triton_dilated import indexed_attention, indexed_attention_naive
from triton_dilated.ops.indexed.indices import dense_mask


def random_indices(B, Nq, Nk, rows, topk, seed, *, unused=0.2, duplicates=0.1, out_of_range=0.1):
    """int32 (B, Nq, rows, topk) (rows None: (B, Nq, topk)) of key positions in [0, Nk), with a
    share of -1 slots, repeated keys and values outside [0, Nk) (including the int32 extremes)."""
    g = torch.Generator().manual_seed(seed)
    shape = (B, Nq, topk) if rows is None else (B, Nq, rows, topk)
    idx = torch.randint(0, max(1, Nk), shape, generator=g)
    u = torch.rand(shape, generator=g)
    idx = torch.where(u < unused, -1, idx)
    wild = torch.tensor([-2, Nk, Nk + 7, -2 ** 31, 2 ** 31 - 1])
    pick = wild[torch.randint(0, len(wild), shape, generator=g)]
    idx = torch.where((u >= unused) & (u < unused + out_of_range), pick, idx)
    if topk > 1:   # copy a slot onto the next one
        dup = torch.rand(shape[:-1] + (topk - 1,), generator=g) < duplicates
        idx[..., 1:] = torch.where(dup, idx[..., :-1], idx[..., 1:])
    return idx.to(torch.int32)


def make_inputs(B, Nq, Nk, Hq, Hkv, D, Dv, dtype, seed, device="cpu"):
    q = seeded((B, Nq, Hq, D), dtype, seed, device)
    k = seeded((B, Nk, Hkv, D), dtype, seed + 1, device)
    v = seeded((B, Nk, Hkv, Dv), dtype, seed + 2, device)
    return q, k, v


def check_indexed(q, k, v, indices, *, causal=False, scale=None, softcap=None, sinks=None, backend="auto",
                  grads=True, seed=0):
    """indexed_attention (backend) against indexed_attention_naive under the tolerance rule:
    out and lse (factor 2), the gradients of sum(out * g) + sum(lse * gl) in q, k, v and the
    sinks (factor 3); rows without a key: out and dq exactly 0, lse -inf (without sinks).
    Returns (got, oracle) as (out, lse, dq, dk, dv[, dsinks])."""
    dtype = q.dtype
    Hq, Nq, Nk = q.shape[2], q.shape[1], k.shape[1]
    mask = dense_mask(indices, Nq, Nk, Hq, causal)

    def leaves(cast, sink_dtype):
        xs = [cast(x).detach().requires_grad_(grads) for x in (q, k, v)]
        if sinks is not None:
            xs.append(sinks.detach().to(sink_dtype).requires_grad_(grads))
        return xs

    got_leaves = leaves(lambda x: x, torch.float32)
    ref_leaves = leaves(lambda x: x.double(), torch.float64)
    same_leaves = leaves(lambda x: x.clone(), torch.float32)
    kw = dict(causal=causal, scale=scale, softcap=softcap)

    def fn(q_, k_, v_, s_=None):
        return indexed_attention(q_, k_, v_, indices, **kw, sinks=s_, return_lse=True, backend=backend)

    def oracle(q_, k_, v_, s_=None):
        return indexed_attention_naive(q_, k_, v_, indices, **kw, sinks=s_)

    def same(q_, k_, v_, s_=None):
        return dense_reference(q_, k_, v_, mask, scale=scale, softcap=softcap, sinks=s_)

    gen = torch.Generator().manual_seed(seed)
    B, Dv = q.shape[0], v.shape[3]
    g = torch.randn(B, Nq, Hq, Dv, generator=gen, dtype=torch.float64).to(dtype).double().to(q.device)
    gl = torch.randn(B, Hq, Nq, generator=gen, dtype=torch.float64).float().double().to(q.device)

    def run(f, xs):
        out, lse = f(*xs)
        if not grads:
            return [out.detach(), lse.detach()]
        loss = (out.double() * g).sum() + (finite(lse).double() * gl).sum()
        return [out.detach(), lse.detach(), *torch.autograd.grad(loss, xs)]

    got, ref, ref_same = run(fn, got_leaves), run(oracle, ref_leaves), run(same, same_leaves)
    out, lse = got[0], got[1]
    assert out.shape == (B, Nq, Hq, Dv) and out.dtype == dtype and out.is_contiguous(), (out.shape, out.dtype)
    assert lse.shape == (B, Hq, Nq) and lse.dtype == torch.float32, (lse.shape, lse.dtype)
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    for i, (name, x, o, s) in enumerate(zip(names, got, ref, ref_same)):
        if i >= 2:
            assert x.dtype == got_leaves[i - 2].dtype and x.shape == got_leaves[i - 2].shape, name
        assert_rule(name, x, o, s, factor=2 if i < 2 else 3, floor=FLOOR[dtype])
    empty = ~mask.any(-1)                                          # (B, Hq, Nq)
    rows = empty.transpose(1, 2)
    assert (out[rows] == 0).all(), "rows without keys must output exactly 0"
    if sinks is None:
        assert torch.equal(torch.isneginf(lse), empty), "lse is -inf exactly on the rows without keys"
    if grads:
        assert (got[2][rows] == 0).all(), "rows without keys must get dq exactly 0"
    return got, ref
