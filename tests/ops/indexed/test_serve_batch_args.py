"""indexed_attention_with_kvcache with FlashAttention's batch arguments (issue 33 item 1):
cache_batch_idx (batch row -> cache row), cache_leftpad (positions, so the indices and the
causal cut, count from the pad) and rotary_cos / rotary_sin / rotary_interleaved (q and the new
rows rotated before the append, positions from cache row 0). Each against a float64 reference
written here (dense attention over each query's listed keys), out and lse, the cache written
as expected; compositions, varlen, refusals and no host sync on the decode step."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

from tests.helpers.indexed_checks import random_indices
from tests.helpers.reference import seeded
from tests.helpers.serve_checks import no_host_sync, page_pools, unpage
from triton_dilated import indexed_attention_with_kvcache

BACKENDS = ("triton", "torch")
HQ, HKV, D, DV, CAP, ROT = 4, 2, 16, 24, 40, 8   # GQA 2:1; rotary on the first ROT features
BEFORE = (17, 9)                                   # keys each batch row holds before the call
JUNK = 7.0                                         # pad rows, rows past the length, unnamed cache rows


# ----------------------------------------------------------------------------- the reference

def rotate64(x, pos, cos, sin, interleaved):
    """x (N, H, D) with its first ROT features rotated at positions pos (N,), in float64:
    pairs (2i, 2i+1) when interleaved, else (i, i + ROT / 2) (FlashAttention's rotary)."""
    x = x.double().clone()
    c, s = cos.double()[pos][:, None], sin.double()[pos][:, None]      # (N, 1, ROT / 2)
    half = ROT // 2
    if interleaved:
        x1, x2 = x[..., 0:ROT:2].clone(), x[..., 1:ROT:2].clone()
        x[..., 0:ROT:2], x[..., 1:ROT:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = x[..., :half].clone(), x[..., half:ROT].clone()
        x[..., :half], x[..., half:ROT] = x1 * c - x2 * s, x1 * s + x2 * c
    return x


def reference_row(q, keys, vals, idx, causal):
    """(out (Nq, Hq, Dv), lse (Hq, Nq)) float64 of one batch row: q (Nq, Hq, D), its keys and
    values by position (n, Hkv, D | Dv), idx (Nq, Hkv, topk) or (Nq, topk) token positions;
    query i at position n - Nq + i reads each listed t in [0, n) (t <= its position when
    causal) once; no key: 0 and -inf."""
    Nq, n = q.shape[0], keys.shape[0]
    out = torch.zeros(Nq, HQ, vals.shape[-1], dtype=torch.float64)
    lse = torch.full((HQ, Nq), -math.inf, dtype=torch.float64)
    for i in range(Nq):
        top = n - Nq + i if causal else n - 1
        for h in range(HQ):
            g = h // (HQ // HKV)
            listed = idx[i, g] if idx.dim() == 3 else idx[i]
            used = sorted({int(t) for t in listed if 0 <= int(t) < n and int(t) <= top})
            if not used:
                continue
            s = keys[used, g].double() @ q[i, h].double() / math.sqrt(D)
            lse[h, i] = torch.logsumexp(s, 0)
            out[i, h] = torch.softmax(s, 0) @ vals[used, g].double()
    return out, lse


def check_close(got, ref):
    out, lse = got
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref[1]))
    torch.testing.assert_close(out.double(), ref[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double().nan_to_num(neginf=0), ref[1].nan_to_num(neginf=0), atol=2e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- the cases

def tables(interleaved=True):
    angle = torch.arange(CAP, dtype=torch.float32)[:, None] * (0.3 / (1 + torch.arange(ROT // 2)))
    return dict(rotary_cos=angle.cos(), rotary_sin=angle.sin(), rotary_interleaved=interleaved)


def build(*, batch_idx=False, leftpad=False, rotary=None, paged=False, Nq=1, new=1, seed=0):
    """(the door's arguments, the logical rows: keys and values by position per batch row with
    the new rows unrotated, the expected cache rows: where each row's keys live). Batch row b
    lives in cache row rows[b] (cache_batch_idx) from cache row pads[b] (cache_leftpad)."""
    B = 2
    rows = [2, 0] if batch_idx else [0, 1]
    pads = [5, 2] if leftpad else [0, 0]
    keys = [seeded((BEFORE[b] + new, HKV, D), torch.float32, seed + 10 + b) for b in range(B)]
    vals = [seeded((BEFORE[b] + new, HKV, DV), torch.float32, seed + 20 + b) for b in range(B)]
    k_cache = torch.full((3 if batch_idx else B, CAP, HKV, D), JUNK)
    v_cache = torch.full((3 if batch_idx else B, CAP, HKV, DV), -JUNK)
    for b in range(B):
        k_cache[rows[b], pads[b]:pads[b] + BEFORE[b]] = keys[b][:BEFORE[b]]
        v_cache[rows[b], pads[b]:pads[b] + BEFORE[b]] = vals[b][:BEFORE[b]]
    seqlens = torch.tensor([p + n for p, n in zip(pads, BEFORE)], dtype=torch.int32)
    q = seeded((B, Nq, HQ, D), torch.float32, seed + 1)
    kw = dict(cache_seqlens=seqlens, return_lse=True)
    if batch_idx:
        kw["cache_batch_idx"] = torch.tensor(rows, dtype=torch.int32)
    if leftpad:
        kw["cache_leftpad"] = torch.tensor(pads, dtype=torch.int32)
    if rotary is not None:
        kw.update(tables(rotary == "interleaved"))
    if paged:
        k_cache, _, table = page_pools(k_cache, k_cache, 8, seed=seed)
        v_cache, _, _ = page_pools(v_cache, v_cache, 8, seed=seed)
        kw["block_table"] = table
    new_rows = (torch.stack([x[BEFORE[b]:] for b, x in enumerate(keys)]),
                torch.stack([x[BEFORE[b]:] for b, x in enumerate(vals)])) if new else (None, None)
    return q, k_cache, v_cache, new_rows, kw, (keys, vals, rows, pads)


def expected(q, new, kw, logical, idx, causal):
    """The reference (out (B, Nq, Hq, Dv), lse (B, Hq, Nq)) and each row's new keys as the cache
    should hold them (rotated at their cache rows cache_seqlens[b] + j)."""
    keys, vals, _, _ = logical
    outs, lses, written = [], [], []
    for b in range(q.shape[0]):
        kb, qb, start = keys[b].double(), q[b].double(), int(kw["cache_seqlens"][b])
        if "rotary_cos" in kw:
            cos, sin, inter = kw["rotary_cos"], kw["rotary_sin"], kw["rotary_interleaved"]
            n_new = new.shape[1]
            kb = torch.cat([kb[:-n_new], rotate64(kb[-n_new:], start + torch.arange(n_new), cos, sin, inter)])
            q_pos = start + (torch.arange(q.shape[1]) if causal else torch.zeros(q.shape[1], dtype=torch.long))
            qb = rotate64(qb, q_pos, cos, sin, inter)
        written.append(kb[BEFORE[b]:])
        o, l = reference_row(qb, kb, vals[b], idx[b], causal)
        outs.append(o)
        lses.append(l)
    return (torch.stack(outs), torch.stack(lses)), written


def cache_rows(k_cache, kw):
    """(B_cache, CAP, Hkv, D): the cache rows (a page pool read back through its table)."""
    return unpage(k_cache, kw["block_table"]) if "block_table" in kw else k_cache


CASES = {   # name: build's keywords
    "batch_idx": dict(batch_idx=True),
    "leftpad": dict(leftpad=True, Nq=3, new=3),
    "leftpad-paged": dict(leftpad=True, paged=True, Nq=3, new=0),
    "rotary": dict(rotary="interleaved", Nq=3, new=3),
    "rotary-neox-paged": dict(rotary="neox", paged=True, Nq=2, new=2),
    "leftpad+rotary-paged": dict(leftpad=True, rotary="interleaved", paged=True),
    "all": dict(batch_idx=True, leftpad=True, rotary="neox", Nq=3, new=2),
    "all-decode": dict(batch_idx=True, leftpad=True, rotary="interleaved"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", list(CASES))
def test_against_the_reference(backend, causal, name):
    args = CASES[name]
    seed = sorted(CASES).index(name)
    q, k_cache, v_cache, new, kw, logical = build(seed=seed, **args)
    heads = HKV if seed % 2 else None          # per-kv-head indices, or one list for all heads
    idx = random_indices(2, q.shape[1], BEFORE[0] + 6, heads, 12, seed)
    before = cache_rows(k_cache, kw).clone()
    got = indexed_attention_with_kvcache(q, k_cache, v_cache, idx, *new, causal=causal, backend=backend, **kw)
    ref, written = expected(q, new[0], kw, logical, idx, causal)
    check_close(got, ref)
    # the new rows at cache_seqlens[b] + j of the batch row's cache row, nothing else touched
    after = cache_rows(k_cache, kw)
    rows = logical[2]
    for b in range(2):
        start = int(kw["cache_seqlens"][b])
        torch.testing.assert_close(after[rows[b], start:start + len(written[b])].double(), written[b],
                                   atol=1e-6, rtol=1e-6)
        before[rows[b], start:start + len(written[b])] = after[rows[b], start:start + len(written[b])]
    assert torch.equal(after.nan_to_num(0), before.nan_to_num(0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_leftpad_moves_every_index(backend):
    """cache_leftpad = p is the same call on the cache shifted left by p (index t reads cache row
    p + t): a check independent of the reference."""
    q, k_cache, v_cache, new, kw, _ = build(leftpad=True, Nq=2, new=2)
    idx = random_indices(2, 2, 30, HKV, 10, 3)
    got = indexed_attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), idx, *new, backend=backend, **kw)
    pads = kw.pop("cache_leftpad")
    shifted = [torch.full_like(c, JUNK) for c in (k_cache, v_cache)]
    for c, s in zip((k_cache, v_cache), shifted):
        for b, p in enumerate(pads.tolist()):
            s[b, :CAP - p] = c[b, p:]
    kw["cache_seqlens"] = kw["cache_seqlens"] - pads
    want = indexed_attention_with_kvcache(q, *shifted, idx, *new, backend=backend, **kw)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_gradients_with_leftpad_and_batch_idx():
    """Gradients (the portable path) of q and the contiguous caches under cache_leftpad and
    cache_batch_idx against the float64 reference's."""
    q, k_cache, v_cache, _, kw, (keys, vals, rows, pads) = build(batch_idx=True, leftpad=True, Nq=3, new=0, seed=4)
    idx = random_indices(2, 3, 22, HKV, 12, 4)
    leaves = [x.detach().requires_grad_() for x in (q, k_cache, v_cache)]
    out, lse = indexed_attention_with_kvcache(*leaves, idx, backend="torch", **kw)
    g_out = seeded(out.shape, torch.float64, 7)
    ((out.double() * g_out).sum() + (lse.double().nan_to_num(neginf=0) * 0.5).sum()).backward()
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k_cache, v_cache)]
    total = 0
    for b in range(2):
        r, p, n = rows[b], pads[b], BEFORE[b]
        o, l = reference_row(ref_leaves[0][b], ref_leaves[1][r, p:p + n], ref_leaves[2][r, p:p + n], idx[b], True)
        total = total + (o * g_out[b]).sum() + (l.nan_to_num(neginf=0) * 0.5).sum()
    total.backward()
    for got, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=2e-5, rtol=1e-5)
    assert leaves[1].grad[1].abs().sum() == 0    # the cache row no batch row names


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_composes(backend):
    """Varlen queries (indices packed with q) with cache_batch_idx, cache_leftpad and rotary:
    each request against the reference (its rotary positions cache_seqlens[b] + i)."""
    nq, nk = [1, 3], [2, 1]
    q_pad, k_cache, v_cache, _, kw, (keys, vals, rows, pads) = build(batch_idx=True, leftpad=True,
                                                                     rotary="interleaved", Nq=3, new=2, seed=6)
    q = torch.cat([q_pad[b, :n] for b, n in enumerate(nq)])
    k_new = torch.cat([keys[b][BEFORE[b]:BEFORE[b] + m] for b, m in enumerate(nk)])
    v_new = torch.cat([vals[b][BEFORE[b]:BEFORE[b] + m] for b, m in enumerate(nk)])
    idx = random_indices(sum(nq), 1, 24, HKV, 10, 6)[:, 0]
    cu_q, cu_k = (torch.tensor([0, ns[0], sum(ns)], dtype=torch.int32) for ns in (nq, nk))
    for guard in (contextlib.nullcontext, no_host_sync):
        kc, vc = k_cache.clone(), v_cache.clone()
        with guard():
            out, lse = indexed_attention_with_kvcache(q, kc, vc, idx, k_new, v_new, cu_seqlens_q=cu_q,
                                                      max_seqlen_q=3, cu_seqlens_k_new=cu_k, backend=backend, **kw)
        a = 0
        for b, (n, m) in enumerate(zip(nq, nk)):
            kw_b = dict(kw, cache_seqlens=kw["cache_seqlens"][b:b + 1])
            kb, vb = keys[b][:BEFORE[b] + m], vals[b][:BEFORE[b] + m]
            ref, _ = expected(q[None, a:a + n], k_new[None, :m], kw_b, ([kb], [vb], None, None),
                              idx[None, a:a + n], True)
            check_close((out[a:a + n], lse[:, a:a + n]), (ref[0][0], ref[1][0]))   # lse (Hq, total_q)
            a += n


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_step_makes_no_host_sync(backend):
    """cache_batch_idx, cache_leftpad and rotary on a decode step: no host read."""
    q, k_cache, v_cache, new, kw, _ = build(batch_idx=True, leftpad=True, rotary="interleaved")
    idx = random_indices(2, 1, 24, None, 8, 0)
    want = indexed_attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), idx, *new, backend=backend, **kw)
    with no_host_sync():
        got = indexed_attention_with_kvcache(q, k_cache, v_cache, idx, *new, backend=backend, **kw)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_refusals_name_the_argument():
    q, k_cache, v_cache, new, kw, _ = build(batch_idx=True, leftpad=True, rotary="interleaved")
    idx = random_indices(2, 1, 24, None, 8, 0)
    call = lambda **o: indexed_attention_with_kvcache(q, k_cache, v_cache, idx, *new, **dict(kw, **o))  # noqa: E731
    for name in ("cache_batch_idx", "cache_leftpad"):   # physical_slots: pool rows are physical already
        others = {n: None for n in ("cache_batch_idx", "cache_leftpad") if n != name}
        paged = dict(block_table=torch.zeros(2, 1, dtype=torch.int32)) if name == "cache_leftpad" else {}
        with pytest.raises(ValueError, match=f"{name} must be None with physical_slots=True"):
            call(physical_slots=True, causal=False, **others, **paged)
        with pytest.raises(ValueError, match=f"{name} must be None with physical_slots=True"):
            call(physical_slots=True, causal=False, cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                 max_seqlen_q=1, **others, **paged)
    with pytest.raises(TypeError, match="cache_leftpad must be an int32 tensor"):
        call(cache_leftpad=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"cache_leftpad must have shape \(B,\)"):
        call(cache_leftpad=torch.tensor([1, 2, 3], dtype=torch.int32))
    with pytest.raises(TypeError, match="cache_batch_idx must be an int32 tensor"):
        call(cache_batch_idx=torch.tensor([2.0, 0.0]))
    with pytest.raises(ValueError, match=r"cache_batch_idx must have shape \(B,\)"):
        call(cache_batch_idx=torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_batch_idx maps batch rows .* not both"):
        call(block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_batch_idx\\[0\\] = 5, outside"):
        call(cache_batch_idx=torch.tensor([5, 0], dtype=torch.int32), validate=True)
    with pytest.raises(ValueError, match="cache_leftpad\\[1\\] = 30 must lie in"):
        call(cache_leftpad=torch.tensor([0, 30], dtype=torch.int32), validate=True)
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin hold 4 positions"):
        call(rotary_cos=kw["rotary_cos"][:4], rotary_sin=kw["rotary_sin"][:4], validate=True)
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin rotate the new rows k"):
        indexed_attention_with_kvcache(q, k_cache, v_cache, idx, **kw)
    with pytest.raises(TypeError, match="rotary_interleaved must be"):
        call(rotary_interleaved=1)


@pytest.mark.parametrize("varlen", [False, True])
def test_rotary_refused_on_an_aliased_mla_cache(varlen):
    """v_cache a view of k_cache's first Dv values (absorbed MLA): rotating the new keys would
    change the values, so rotary is refused, naming the arguments; without rotary it runs."""
    k_cache = seeded((1, 24, 1, 576), torch.float32, 2)
    v_cache = k_cache[..., :512]
    q = seeded((1, 1, 16, 576), torch.float32, 1)
    k_new = seeded((1, 1, 1, 576), torch.float32, 3)
    idx = random_indices(1, 1, 20, None, 8, 1)
    angle = torch.arange(CAP, dtype=torch.float32)[:, None] * torch.ones(32)
    kw = dict(cache_seqlens=torch.tensor([19], dtype=torch.int32), rotary_cos=angle.cos(), rotary_sin=angle.sin())
    args = (q, k_cache, v_cache, idx, k_new, k_new[..., :512])
    if varlen:
        args = (q[0], k_cache, v_cache, idx[0], k_new[0], k_new[0, ..., :512])
        cu = torch.tensor([0, 1], dtype=torch.int32)
        kw.update(cu_seqlens_q=cu, max_seqlen_q=1, cu_seqlens_k_new=cu)
    with pytest.raises(ValueError, match="v_cache shares k_cache's storage.*rotary_cos=rotary_sin=None"):
        indexed_attention_with_kvcache(*args, backend="torch", **kw)
    kw.update(rotary_cos=None, rotary_sin=None)
    out = indexed_attention_with_kvcache(*args, backend="torch", **kw)
    assert out.shape[-1] == 512 and torch.isfinite(out).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_without_recompiling(backend):
    """Under torch.compile (fullgraph) with cache_batch_idx, cache_leftpad and rotary: one trace
    for three sets of lengths, pads and cache rows, each equal to the eager call."""
    from torch._dynamo.testing import CompileCounterWithBackend

    q, _, _, new, kw, _ = build(batch_idx=True, leftpad=True, rotary="interleaved")
    idx = random_indices(2, 1, 24, HKV, 8, 2)

    def step(q, kc, vc, k, v, lens, rows, pads):
        return indexed_attention_with_kvcache(q, kc, vc, idx, k, v, cache_seqlens=lens, cache_batch_idx=rows,
                                              cache_leftpad=pads, return_lse=True, backend=backend,
                                              **{n: kw[n] for n in ("rotary_cos", "rotary_sin")})

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    cases = (([22, 11], [2, 0], [5, 2]), ([30, 4], [1, 2], [0, 3]), ([9, 9], [0, 1], [9, 1]))
    for i, (lens, rows, pads) in enumerate(cases):
        kc, vc = seeded((3, CAP, HKV, D), torch.float32, 30 + i), seeded((3, CAP, HKV, DV), torch.float32, 40 + i)
        args = [torch.tensor(x, dtype=torch.int32) for x in (lens, rows, pads)]
        kc2, vc2 = kc.clone(), vc.clone()
        got = compiled(q, kc, vc, *new, *args)
        want = step(q, kc2, vc2, *new, *args)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 3 sets of values"


def test_query_gradient_through_rotary_and_leftpad():
    """dq (the portable path) through the PyTorch rotation of q, with new rows appended under
    cache_leftpad, against the float64 reference's."""
    q, k_cache, v_cache, new, kw, logical = build(leftpad=True, rotary="neox", Nq=2, new=2, seed=8)
    idx = random_indices(2, 2, 24, None, 12, 8)
    leaf = q.detach().requires_grad_()
    out, lse = indexed_attention_with_kvcache(leaf, k_cache, v_cache, idx, *new, backend="torch", **kw)
    g_out = seeded(out.shape, torch.float64, 9)
    ((out.double() * g_out).sum() + lse.double().nan_to_num(neginf=0).sum()).backward()
    ref_leaf = q.detach().double().requires_grad_()
    (ref_out, ref_lse), _ = expected(ref_leaf, new[0], kw, logical, idx, True)
    ((ref_out * g_out).sum() + ref_lse.nan_to_num(neginf=0).sum()).backward()
    assert ref_leaf.grad.abs().sum() > 0
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_return_softmax_lse_and_broadcast_new_rows(backend):
    """return_softmax_lse (FlashAttention's name for return_lse) and new rows broadcast over the
    batch (a zero-stride expand), with cache_leftpad and rotary: against the reference."""
    q, k_cache, v_cache, new, kw, (keys, vals, rows, pads) = build(leftpad=True, rotary="interleaved", seed=9)
    shared = [x[:1].expand(2, -1, -1, -1) for x in new]            # batch row 0's new rows for both
    for b in range(2):
        keys[b][BEFORE[b]:], vals[b][BEFORE[b]:] = new[0][0], new[1][0]
    idx = random_indices(2, 1, 24, HKV, 12, 9)
    kw.pop("return_lse")
    got = indexed_attention_with_kvcache(q, k_cache, v_cache, idx, *shared, return_softmax_lse=True,
                                         backend=backend, **kw)
    ref, _ = expected(q, shared[0], kw, (keys, vals, rows, pads), idx, True)
    check_close(got, ref)
    with pytest.raises(ValueError, match="return_softmax_lse is FlashAttention's name for return_lse"):
        indexed_attention_with_kvcache(q, k_cache, v_cache, idx, *shared, return_lse=True, return_softmax_lse=False,
                                       **kw)
    with pytest.raises(TypeError, match="return_softmax_lse must be a bool"):
        indexed_attention_with_kvcache(q, k_cache, v_cache, idx, *shared, return_softmax_lse=1, **kw)
