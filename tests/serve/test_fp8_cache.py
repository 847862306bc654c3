"""FP8 KV cache (issue 21 item 4): k_cache, v_cache as float8_e4m3fn with per-(layer, kv-head)
float32 descales (k_descale, v_descale of shape (Hkv,), FlashAttention-3's names), dequantised
in the Triton decode kernels and the portable path.

* the kernels are exact on the cache they are given: out and lse equal the float64 oracle over
  the dequantised rows (fp8 value x descale) within the float32 rule, both variants, both
  backends, contiguous and paged, with new rows quantised on append; a paged fp8 cache equals
  the contiguous one bit for bit;
* the NaN rule on fp8 rows: NaN stored past a row's length never spreads; a NaN a query reads
  gives NaN (the interpreter reads e4m3fn's NaN as 480: load_cache restores it);
* quantisation: round to nearest even, relative error <= 2^-4 (normals), absolute <= 2^-10 x
  descale (subnormals), saturation at +-448, Inf -> NaN;
* the error against the bf16 cache within the stated bound (docs/serving.md, FP8 caches):
  the worst-case bound elementwise, and the measured error under 2^-4 max|v| (a descale
  applied wrongly, or not at all, gives errors of order max|v|);
* PagedDilatedKVCache with fp8 pools; argument errors.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from triton_dilated import (PagedDilatedKVCache, block_sparse_attention_naive, block_sparse_attention_with_kvcache,
                            dilated_attention_naive, dilated_attention_with_kvcache, layouts)
from triton_dilated.ops.block_sparse import decode_kernels as bs_kernels
from triton_dilated.ops.common.kvcache import FP8_MAX, quantise_fp8
from triton_dilated.ops.dilated import decode_kernels as dl_kernels
from tests.conftest import DEVICE, capture_cuda_graph
from tests.helpers.reference import seeded
from tests.helpers.serve_checks import HostSync, check_forward, no_host_sync, page_pools as _paged, unpage as _unpage

FP8 = torch.float8_e4m3fn
U = 2.0 ** -4          # e4m3: 3 mantissa bits, round to nearest: relative error <= 2^-4 for normals
A = 2.0 ** -10         # half the subnormal spacing 2^-9: absolute error <= 2^-10 (times the descale)
WS, RS = [8, 16, 48], [1, 2, 4]
FP8_NAN = 0x7F         # S.1111.111: e4m3fn's NaN


def _amax_descale(x):
    """Per key/value head amax / 448 (no saturation), float32 (Hkv,)."""
    return (x.float().abs().amax(dim=(0, 1, 3)) / FP8_MAX).clamp(min=1e-12)


def _dequant(x8, descale):
    return x8.float() * descale[:, None]


def _fp8_cache(B, Nk, Hkv, D, lengths, seed, scale=1.0):
    """(k8, v8, k_descale, v_descale): random rows quantised with amax descales, NaN (fp8's)
    from each row's length on."""
    k, v = (seeded((B, Nk, Hkv, D), torch.float32, s, DEVICE, scale=scale) for s in (seed, seed + 1))
    kd, vd = _amax_descale(k), _amax_descale(v)
    k8, v8 = quantise_fp8(k, kd), quantise_fp8(v, vd)
    for x in (k8, v8):
        for b, n in enumerate(lengths):
            x.view(torch.uint8)[b, n:] = FP8_NAN
    return k8, v8, kd, vd


def _paged_fp8(k8, v8, page_size):
    """serve_checks.page_pools for fp8 caches (through float32, exact): shuffled pages, spare
    pages NaN."""
    pool_k, pool_v, table = _paged(k8.float(), v8.float(), page_size)
    return pool_k.to(FP8), pool_v.to(FP8), table


def _call(variant, lay):
    if variant == "dilated":
        return lambda q, kc, vc, k=None, v=None, **kw: dilated_attention_with_kvcache(
            q, kc, vc, k, v, segment_lengths=WS, dilation_rates=RS, **kw)
    return lambda q, kc, vc, k=None, v=None, **kw: block_sparse_attention_with_kvcache(q, kc, vc, k, v, layout=lay,
                                                                                      **kw)


def _oracle(variant, lay, causal=True):
    if variant == "dilated":
        return lambda q_, k_, v_, n: dilated_attention_naive(q_, k_, v_, WS, RS, causal=causal)
    return lambda q_, k_, v_, n: block_sparse_attention_naive(q_, k_, v_, lay.prefix(-(-n // lay.block_size)),
                                                              causal=causal)


# ----------------------------------------------------------------------------- exact on the dequantised rows

@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
@pytest.mark.parametrize("Nq", [2, 17], ids=["decode", "chunked-prefill"])
def test_fp8_cache_is_the_attention_over_the_dequantised_rows(backend, variant, Nq):
    """B = 2 ragged rows, GQA, 2 queries (a decode step) or 17 (chunked prefill: the
    query-offset path on the dequantised rows), 2 new rows quantised on append (compared bit
    for bit with quantise_fp8), fp8 NaN past each length: out/lse meet the float64 oracle over
    the dequantised rows; a paged fp8 cache (shuffled pages) gives the same bits."""
    B, Nk, Hq, Hkv, D = 2, 64, 4, 2, 16
    before = [37, 50]
    k8, v8, kd, vd = _fp8_cache(B, Nk, Hkv, D, before, seed=10, scale=3.0)
    q = seeded((B, Nq, Hq, D), torch.float32, 3, DEVICE)
    k_new, v_new = (seeded((B, 2, Hkv, D), torch.float32, s, DEVICE, scale=2.0) for s in (4, 5))
    lens = torch.tensor(before, dtype=torch.int32, device=DEVICE)
    lay = (layouts.local(Nk, 16, 1, causal=True) | layouts.random(Nk, 16, num_random=1, seed=2, num_heads=Hq)
           ).to(DEVICE)
    fn = _call(variant, lay)
    pool_k, pool_v, table = _paged_fp8(k8, v8, 16)
    kc, vc = k8.clone(), v8.clone()
    out, lse = fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, k_descale=kd, v_descale=vd, return_lse=True,
                  backend=backend, validate=True)
    for b, n in enumerate(before):   # the appended rows, quantised with the descales
        assert torch.equal(kc[b, n:n + 2].view(torch.uint8), quantise_fp8(k_new[b], kd).view(torch.uint8))
        assert torch.equal(vc[b, n:n + 2].view(torch.uint8), quantise_fp8(v_new[b], vd).view(torch.uint8))
    check_forward(out, lse, q, _dequant(kc, kd), _dequant(vc, vd), [n + 2 for n in before], _oracle(variant, lay))
    paged = fn(q, pool_k, pool_v, k_new, v_new, cache_seqlens=lens, block_table=table, k_descale=kd, v_descale=vd,
               return_lse=True, backend=backend)
    for g, w in zip(paged, (out, lse)):
        assert torch.equal(g, w), (g - w).abs().max()
    assert torch.equal(_unpage(pool_k.view(torch.uint8), table)[:, :Nk], kc.view(torch.uint8))
    assert torch.equal(_unpage(pool_v.view(torch.uint8), table)[:, :Nk], vc.view(torch.uint8))


@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
def test_fp8_byte_decoder_equals_the_fp8_conversion_on_every_code(monkeypatch, variant):
    """The kernels' two fp8 modes (ops/common/decode_kernels.load_cache): 1, Triton's fp8e4nv
    conversion (sm89+; the interpreter's is right but for NaN), and 2, the uint8 bytes decoded
    in the kernel (older GPUs, the interpreter), give the same bits on a cache holding every
    finite e4m3fn code (254 of 256: +-0, subnormals, normals up to +-448)."""
    B, Nk, Hq, Hkv, D = 1, 64, 2, 1, 8
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = codes.repeat(3)                     # v: every code twice (and 4 more); k: a random draw
    k8 = codes[torch.randperm(len(codes), generator=torch.Generator().manual_seed(0))][:Nk * D].view(1, Nk, 1, D)
    v8 = codes[:Nk * D].view(1, Nk, 1, D)
    k8, v8 = k8.to(DEVICE).view(FP8), v8.to(DEVICE).view(FP8)
    kd = torch.tensor([1e-3], device=DEVICE)   # scores within a few units
    vd = torch.tensor([0.01], device=DEVICE)
    q = seeded((B, 2, Hq, D), torch.float32, 1, DEVICE)
    lay = layouts.local(Nk, 16, 2).to(DEVICE)
    fn = _call(variant, lay)
    module = dl_kernels if variant == "dilated" else bs_kernels
    results = []
    for mode in (1, 2):
        monkeypatch.setattr(module, "fp8_mode", lambda k, mode=mode: mode)
        results.append(fn(q, k8, v8, cache_seqlens=torch.tensor([Nk], dtype=torch.int32, device=DEVICE),
                          k_descale=kd, v_descale=vd, return_lse=True, backend="triton"))
    for a, b in zip(*results):
        assert torch.equal(a, b), (a - b).abs().max()
    check_forward(*results[1], q, _dequant(k8, kd), _dequant(v8, vd), [Nk], _oracle(variant, lay))


@settings(max_examples=12)
@given(data=st.data())
def test_fp8_portable_decode_matches_the_dequantised_oracle(data):
    """Hypothesis over shapes, GQA, causal, query count, q dtype (portable path, cheap)."""
    B = data.draw(st.integers(1, 2))
    Nk = data.draw(st.integers(8, 80))
    Nq = data.draw(st.sampled_from([n for n in (1, 3, 8) if n <= Nk]))
    Hkv = data.draw(st.sampled_from([1, 2]))
    Hq = Hkv * data.draw(st.sampled_from([1, 3]))
    D = data.draw(st.sampled_from([8, 20]))
    causal = data.draw(st.booleans())
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    lengths = [data.draw(st.integers(Nq, Nk)) for _ in range(B)]
    k8, v8, kd, vd = _fp8_cache(B, Nk, Hkv, D, lengths, seed=data.draw(st.integers(0, 99)))
    q = seeded((B, Nq, Hq, D), dtype, 7, DEVICE)
    out, lse = dilated_attention_with_kvcache(q, k8, v8, cache_seqlens=torch.tensor(lengths, dtype=torch.int32,
                                                                                     device=DEVICE),
                                              segment_lengths=WS, dilation_rates=RS, causal=causal, k_descale=kd,
                                              v_descale=vd, return_lse=True, backend="torch")
    check_forward(out, lse, q, _dequant(k8, kd).to(dtype), _dequant(v8, vd).to(dtype), lengths,
                  _oracle("dilated", None, causal))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_nan_a_query_reads_spreads_and_nothing_else(backend):
    """A NaN (fp8 S.1111.111) in a key row the query reads gives NaN out and lse for the heads
    of that key/value head only; NaN rows past the length never spread. Under the interpreter
    this fails without load_cache's NaN restore (it reads the NaN as 480)."""
    B, Nk, Hq, Hkv, D = 1, 32, 4, 2, 8
    k8, v8, kd, vd = _fp8_cache(B, Nk, Hkv, D, [20], seed=1)
    q = seeded((B, 1, Hq, D), torch.float32, 2, DEVICE)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    kw = dict(cache_seqlens=lens, segment_lengths=[32], dilation_rates=[1], k_descale=kd, v_descale=vd,
              return_lse=True, backend=backend)
    out, lse = dilated_attention_with_kvcache(q, k8, v8, **kw)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    k8.view(torch.uint8)[0, 5, 1] = FP8_NAN   # key/value head 1 serves query heads 2, 3
    out, lse = dilated_attention_with_kvcache(q, k8, v8, **kw)
    assert torch.isnan(out[0, 0, 2:]).all() and torch.isnan(lse[0, 2:]).all()
    assert torch.isfinite(out[0, 0, :2]).all() and torch.isfinite(lse[0, :2]).all()


@pytest.mark.parametrize("backend,variant", [("torch", "block_sparse"), ("triton", "dilated")])
def test_fp8_decode_step_compiles_once_for_every_length(backend, variant):
    """torch.compile(fullgraph=True) of an FP8 decode step with an append (the quantisation
    traced with it, the descales through the custom ops), paged, three cache_seqlens: one
    frame, equal to eager (out and the pool's bytes). Each variant, each backend once."""
    from torch._dynamo.testing import CompileCounterWithBackend

    B, Nk, Hq, Hkv, D = 2, 48, 4, 2, 8
    lay = layouts.local(Nk, 16, 1, causal=True).to(DEVICE)
    q = seeded((B, 1, Hq, D), torch.float32, 1, DEVICE)
    k_new, v_new = (seeded((B, 1, Hkv, D), torch.float32, s, DEVICE) for s in (2, 3))
    fn = _call(variant, lay)

    def step(q, kc, vc, k, v, lens, table, kd, vd):
        return fn(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, k_descale=kd, v_descale=vd,
                  return_lse=True, backend=backend)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for i, before in enumerate(([5, 30], [17, 9], [46, 0])):
        k8, v8, kd, vd = _fp8_cache(B, Nk, Hkv, D, [Nk, Nk], seed=20 + i)
        pool_k, pool_v, table = _paged_fp8(k8, v8, 16)
        pk2, pv2 = pool_k.clone(), pool_v.clone()
        lens = torch.tensor(before, dtype=torch.int32, device=DEVICE)
        got = compiled(q, pool_k, pool_v, k_new, v_new, lens, table, kd, vd)
        want = step(q, pk2, pv2, k_new, v_new, lens, table, kd, vd)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(pool_k.view(torch.uint8), pk2.view(torch.uint8))
        assert torch.equal(pool_v.view(torch.uint8), pv2.view(torch.uint8))
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 3 cache_seqlens values"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_decode_step_reads_nothing_on_the_host(backend):
    """The no-host-sync guard of test_with_kvcache around an FP8 step with an append (the
    quantisation included), contiguous and paged, both variants: no host read, same result
    as unguarded; validate=True (which reads the descales) trips it."""
    B, Nk, Hq, Hkv, D = 2, 48, 4, 2, 8
    lay = layouts.local(Nk, 16, 1, causal=True).to(DEVICE)
    q = seeded((B, 1, Hq, D), torch.float32, 1, DEVICE)
    k_new, v_new = (seeded((B, 1, Hkv, D), torch.float32, s, DEVICE) for s in (2, 3))
    lens = torch.tensor([20, 33], dtype=torch.int32, device=DEVICE)
    k8, v8, kd, vd = _fp8_cache(B, Nk, Hkv, D, [Nk, Nk], seed=4)
    pool_k, pool_v, table = _paged_fp8(k8, v8, 16)
    for variant in ("dilated", "block_sparse"):
        fn = _call(variant, lay)
        for kc, vc, tab in ((k8, v8, None), (pool_k, pool_v, table)):
            fn(q, kc.clone(), vc.clone(), k_new, v_new, cache_seqlens=lens, block_table=tab, k_descale=kd,
               v_descale=vd, backend=backend)   # warm-up: cached device tables
            guarded, plain = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
            with no_host_sync():
                got = fn(q, *guarded, k_new, v_new, cache_seqlens=lens, block_table=tab, k_descale=kd, v_descale=vd,
                         backend=backend)
            want = fn(q, *plain, k_new, v_new, cache_seqlens=lens, block_table=tab, k_descale=kd, v_descale=vd,
                      backend=backend)
            assert torch.equal(got, want)
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(guarded, plain))
    with pytest.raises(HostSync), no_host_sync():
        fn(q, k8, v8, cache_seqlens=lens, k_descale=kd, v_descale=vd, backend=backend, validate=True)


# ----------------------------------------------------------------------------- quantisation

def test_quantise_rounds_saturates_and_keeps_nonfinite_as_nan():
    x = torch.linspace(-6, 6, 4001).view(1, -1, 1, 1).expand(1, -1, 2, 1).contiguous()
    d = torch.tensor([1.0, 0.01])
    y = quantise_fp8(x, d).float() * d.view(-1, 1)
    xs = x / d.view(-1, 1)
    small = xs.abs() < 2.0 ** -6                   # subnormals of e4m3
    err = (y - x).abs()
    assert (err[~small & (xs.abs() <= FP8_MAX)] <= U * x.abs()[~small & (xs.abs() <= FP8_MAX)] + 1e-12).all()
    assert (err[small] <= (A * d.view(-1, 1).expand_as(x))[small] + 1e-12).all()
    assert (y[xs > FP8_MAX] == FP8_MAX * d.view(-1, 1).expand_as(x)[xs > FP8_MAX]).all()   # saturated
    assert (err > 0.5 * U * x.abs()).any(), "the bound is reached (not a vacuous check)"
    special = quantise_fp8(torch.tensor([float("inf"), -float("inf"), float("nan"), 1e6, -1e6]).view(1, 5, 1, 1),
                           torch.ones(1)).float().flatten()
    assert torch.isnan(special[:3]).all() and special[3:].tolist() == [FP8_MAX, -FP8_MAX]


# ----------------------------------------------------------------------------- error against the bf16 cache

def _bound_and_error(q, k, v, kd, vd, key_lists, scale, out8, out16):
    """The worst-case bound on |out_fp8 - out_bf16| (docs/serving.md, FP8 caches) for one
    query: q (Hq, D), k, v (N, Hkv, D) the bf16 cache's rows, float64; key_lists[h]: the
    positions head h reads (a multiset). Per element |dk| <= U|k| + A kd, |dv| <= U|v| + A vd,
    so key j's score moves by at most eps_j = scale * sum_d |q_d| (U |k_jd| + A kd), its
    weight p_j by a factor e^(ds_j) / sum_i p_i e^(ds_i), within 1 +- rho_j, and

        |d out_d| <= sum_j p_j rho_j |v_jd| + U max_j |v_jd| + A vd + 2^-8 |out_d| + 1e-5

    (the last terms: both outputs rounded to bf16, 2^-9 each, and float32 sums). Returns
    (bound, error) (Hq, D)."""
    Hq, D = q.shape
    group = Hq // k.shape[1]
    bounds = []
    for h in range(Hq):
        kh, vh = k[key_lists[h], h // group], v[key_lists[h], h // group]          # (K, D)
        s = scale * kh @ q[h]
        p = torch.softmax(s, 0)
        eps = scale * (q[h].abs() * (U * kh.abs() + A * kd[h // group])).sum(-1)    # (K,)
        lo, hi = (p * torch.exp(-eps)).sum(), (p * torch.exp(eps)).sum()
        rho = torch.maximum(torch.exp(eps) / lo - 1, 1 - torch.exp(-eps) / hi)
        out = p @ vh
        bound = (p * rho) @ vh.abs() + U * vh.abs().amax(0) + A * vd[h // group] + 2.0 ** -8 * out.abs() + 1e-5
        bounds.append(bound)
    return torch.stack(bounds), (out8.double() - out16.double()).abs()


def _dilated_key_list(p, n, h, Hq):
    """Positions the query at p (of a row of n valid rows) reads in head h: the oracle's rule,
    DESIGN §3, causal, LongNet modulo offsets, as a multiset."""
    keys = []
    for w, r in zip(WS, RS):
        w = min(w, n)
        s = p // w * w
        o = h % r
        if (p - s) % r == o:
            keys += [j for j in range(s + o, min(s + w, n), r) if j <= p]
    return torch.tensor(keys, dtype=torch.long)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_error_against_the_bf16_cache_within_the_bound(backend):
    """bf16 q and cache against the same cache quantised to fp8 (amax descales, keys of scale 3
    so the descales differ from 1): every element within the worst-case bound, and the largest
    error under 2^-4 max|v| (measured: docs/serving.md)."""
    B, Nk, Hq, Hkv, D = 2, 96 if backend == "torch" else 48, 4, 2, 32
    lengths = [Nk, Nk - 17]
    k, v = (seeded((B, Nk, Hkv, D), torch.bfloat16, s, DEVICE, scale=sc) for s, sc in ((1, 3.0), (2, 1.0)))
    q = seeded((B, 1, Hq, D), torch.bfloat16, 3, DEVICE)
    kd, vd = _amax_descale(k), _amax_descale(v)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    kw = dict(cache_seqlens=lens, segment_lengths=WS, dilation_rates=RS, backend=backend)
    out16 = dilated_attention_with_kvcache(q, k, v, **kw)
    out8 = dilated_attention_with_kvcache(q, quantise_fp8(k, kd), quantise_fp8(v, vd), k_descale=kd, v_descale=vd,
                                          **kw)
    worst = 0.0
    for b, n in enumerate(lengths):
        lists = [_dilated_key_list(n - 1, n, h, Hq) for h in range(Hq)]
        bound, err = _bound_and_error(q[b, 0].double(), k[b].double(), v[b].double(), kd.double(), vd.double(),
                                      lists, D ** -0.5, out8[b, 0], out16[b, 0])
        assert (err <= bound).all(), (err - bound).max()
        worst = max(worst, float(err.max() / v[b].float().abs().max()))
    assert 0 < worst <= U, worst


# ----------------------------------------------------------------------------- the paged cache class

def test_paged_dilated_kv_cache_with_fp8_pools():
    """Two layers (a descale row per layer for keys, one row for all layers for values), two
    interleaved sequences, one token a step over 150 steps (past the longest segment: pages
    returned): each output equals that of a float32 pool fed the dequantised new rows, within
    float32 rounding; the pools hold 1 byte a value; the page bookkeeping is the float32 pool's."""
    H, HKV, D, PAGE = 4, 2, 8, 16
    kd = torch.tensor([[0.01, 0.02], [0.03, 0.015]], device=DEVICE)
    vd = torch.tensor([0.02, 0.01], device=DEVICE)        # one row for every layer
    kw = dict(num_pages=24, page_size=PAGE, num_kv_heads=HKV, head_dim=D, device=DEVICE, num_layers=2)
    c8 = PagedDilatedKVCache(WS, RS, dtype=FP8, k_descale=kd, v_descale=vd, **kw)
    c32 = PagedDilatedKVCache(WS, RS, **kw)
    assert c8.k_pools[0].dtype == FP8 and c8.k_pools[0].element_size() == 1
    for s in "ab":
        c8.admit(s)
        c32.admit(s)
    for t in range(150):
        ids = ["a", "b"] if t % 3 else ["b"]
        s8, s32 = c8.begin(ids), c32.begin(ids)
        for layer in range(2):
            q = seeded((len(ids), 1, H, D), torch.float32, 1000 * layer + t, DEVICE)
            k, v = (seeded((len(ids), 1, HKV, D), torch.float32, 1000 * layer + t + s, DEVICE) for s in (5000, 9000))
            got = s8.attend(q, k, v, layer, backend="torch")
            k_deq = _dequant(quantise_fp8(k, kd[layer]), kd[layer])
            v_deq = _dequant(quantise_fp8(v, vd), vd)
            want = s32.attend(q, k_deq, v_deq, layer, backend="torch")
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        s8.end()
        s32.end()
    assert c8.pages_held("b") <= max(WS) // PAGE and c8.free_pages == c32.free_pages


# ----------------------------------------------------------------------------- errors

def test_fp8_argument_errors():
    q = seeded((2, 1, 4, 8), torch.float32, 1, DEVICE)
    k8, v8, kd, vd = _fp8_cache(2, 32, 2, 8, [32, 32], seed=2)
    lens = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)
    kw = dict(cache_seqlens=lens, segment_lengths=WS, dilation_rates=RS)
    with pytest.raises(ValueError, match="a float8_e4m3fn cache needs k_descale"):
        dilated_attention_with_kvcache(q, k8, v8, v_descale=vd, **kw)
    with pytest.raises(TypeError, match=r"v_descale must be a float32 tensor \(2,\), got torch.float64"):
        dilated_attention_with_kvcache(q, k8, v8, k_descale=kd, v_descale=vd.double(), **kw)
    with pytest.raises(ValueError, match=r"k_descale must have shape \(Hkv,\) = \(2,\), got \(4,\)"):
        dilated_attention_with_kvcache(q, k8, v8, k_descale=kd.repeat(2), v_descale=vd, **kw)
    with pytest.raises(ValueError, match="apply to a float8_e4m3fn cache only"):
        dilated_attention_with_kvcache(q, k8.float(), v8.float(), k_descale=kd, v_descale=vd, **kw)
    with pytest.raises(TypeError, match="k_cache and v_cache must both be float8_e4m3fn or both not"):
        dilated_attention_with_kvcache(q, k8, v8.float(), k_descale=kd, v_descale=vd, **kw)
    with pytest.raises(TypeError, match=r"k must have q's dtype \(an FP8 cache quantises new rows\)"):
        dilated_attention_with_kvcache(q, k8, v8, k8[:, :1], v8[:, :1], k_descale=kd, v_descale=vd, **kw)
    with pytest.raises(ValueError, match=r"must have one shape \(B, .., Hkv, D\) with B = 1"):
        dilated_attention_with_kvcache(q[:1], k8, v8, k_descale=kd, v_descale=vd, **dict(kw, cache_seqlens=lens[:1]))
    with pytest.raises(ValueError, match="k_descale must be finite and positive"):
        dilated_attention_with_kvcache(q, k8, v8, k_descale=kd * 0, v_descale=vd, validate=True, **kw)
    lay = layouts.local(32, 16, 1, causal=True).to(DEVICE)
    with pytest.raises(ValueError, match="a float8_e4m3fn cache needs v_descale"):
        block_sparse_attention_with_kvcache(q, k8, v8, cache_seqlens=lens, layout=lay, k_descale=kd)
    with pytest.raises(TypeError, match="a float8_e4m3fn pool needs k_descale"):
        PagedDilatedKVCache(WS, RS, num_pages=4, page_size=16, num_kv_heads=2, head_dim=8, dtype=FP8)
    with pytest.raises(ValueError, match=r"v_descale must have shape \(2,\) or \(1, 2\)"):
        PagedDilatedKVCache(WS, RS, num_pages=4, page_size=16, num_kv_heads=2, head_dim=8, dtype=FP8, k_descale=kd,
                            v_descale=vd[:1])
    with pytest.raises(ValueError, match="apply to a float8_e4m3fn pool only"):
        PagedDilatedKVCache(WS, RS, num_pages=4, page_size=16, num_kv_heads=2, head_dim=8, k_descale=kd)
    assert math.isclose(FP8_MAX, float(torch.finfo(FP8).max))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU (TRITON_DILATED_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
def test_fp8_decode_step_captures_in_a_cuda_graph(variant):
    """An FP8 paged decode step with an append (Triton path: on sm89+ the fp8e4nv conversion)
    captured once in a CUDA graph, replayed for three cache_seqlens written into the captured
    tensor: out and the pool's bytes equal the eager call each time."""
    B, Nk, Hq, Hkv, D = 2, 256, 4, 2, 64
    lay = layouts.local(Nk, 16, 1, causal=True).to(DEVICE)
    fn = _call(variant, lay)
    q = seeded((B, 1, Hq, D), torch.bfloat16, 1, DEVICE)
    k_new, v_new = (seeded((B, 1, Hkv, D), torch.bfloat16, s, DEVICE) for s in (2, 3))
    k8, v8, kd, vd = _fp8_cache(B, Nk, Hkv, D, [Nk, Nk], seed=4)
    pool_k, pool_v, table = _paged_fp8(k8, v8, 16)
    lens = torch.tensor([10, 20], dtype=torch.int32, device=DEVICE)

    def step(kc=pool_k, vc=pool_v):
        return fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, block_table=table, k_descale=kd, v_descale=vd,
                  backend="triton", return_lse=True)

    graph, captured = capture_cuda_graph(step)
    for before in ([5, 200], [131, 17], [254, 0]):
        lens.copy_(torch.tensor(before, dtype=torch.int32))
        kc_eager, vc_eager = pool_k.clone(), pool_v.clone()
        graph.replay()
        want = step(kc_eager, vc_eager)
        torch.testing.assert_close(captured, want, rtol=0, atol=0)
        assert torch.equal(pool_k.view(torch.uint8), kc_eager.view(torch.uint8))
        assert torch.equal(pool_v.view(torch.uint8), vc_eager.view(torch.uint8))
