"""The serve doors (issue 21 items 1-2, issue 31 item 3): `dilated_attention_with_kvcache` and
`block_sparse_attention_with_kvcache`, FlashAttention's with_kvcache shape.

* against the float64 oracle (each row's prefix, the queries placed last), with and without
  new k/v rows appended in place, ragged lengths, cache rows past each length poisoned NaN;
  appending then attending equals attending over the cache that holds the rows (no new
  rows, cache_seqlens counting them); rows holding fewer keys than queries;
* no host sync from the call to the kernel launch of a decode step, on both backends: a
  guard that raises on every way of reading a tensor's values on the host (tolist, item,
  bool, int, float, index, numpy, torch.equal, and under a dispatch mode the aten ops
  behind them and the ops with data-dependent output shapes), disarmed only while a Triton
  kernel runs; the guard is shown to fire on the serve door's query-offset route (chunked
  prefill, Nq > 16, and gradients on the Triton path), which reads cache_seqlens;
* torch.compile(fullgraph=True) traces a decode step once and serves three different
  cache_seqlens tensors without a recompile (dynamo's frame counter), equal to eager;
* gradients on both backends (the Triton path through the training kernels);
* argument errors name the argument.
"""
from __future__ import annotations

import pytest
import torch

from triton_dilated import (block_sparse_attention_naive, block_sparse_attention_with_kvcache, dilated_attention_naive,
                            dilated_attention_with_kvcache, layouts)
from triton_dilated.ops.block_sparse import serve as bs_serve
from triton_dilated.ops.common import query_offset
from triton_dilated.ops.dilated import serve as dl_serve
from tests.conftest import DEVICE, capture_cuda_graph
from tests.helpers.reference import seeded
from tests.helpers.serve_checks import (HostSync, check_against_definition, check_forward, definition, no_host_sync,
                                       page_pools as _paged, unpage as _unpage)

BACKENDS = ["torch", "triton"]
WS, RS = [8, 16, 48], [1, 2, 4]


def _dilated(q, kc, vc, k=None, v=None, **kw):
    return dilated_attention_with_kvcache(q, kc, vc, k, v, segment_lengths=WS, dilation_rates=RS, **kw)


def _dilated_oracle(causal):
    return lambda q_, k_, v_, n: dilated_attention_naive(q_, k_, v_, WS, RS, causal=causal)


def _layout(nk, heads=1):
    return (layouts.local(nk, 16, 1, causal=True) | layouts.random(nk, 16, num_random=1, seed=2, num_heads=heads)
            ).to(DEVICE)


def _block_sparse(lay):
    return lambda q, kc, vc, k=None, v=None, **kw: block_sparse_attention_with_kvcache(q, kc, vc, k, v, layout=lay,
                                                                                      **kw)


def _block_sparse_oracle(lay, causal):
    return lambda q_, k_, v_, n: block_sparse_attention_naive(q_, k_, v_, lay.prefix(-(-n // lay.block_size)),
                                                              causal=causal)


def _cache(B, Nk, Hkv, D, lengths, seed):
    """k_cache, v_cache (B, Nk, Hkv, D), slices of a larger buffer (strided), NaN from each
    row's length on (rows the call must neither read nor keep)."""
    kc = seeded((B, Nk + 2, Hkv + 1, D), torch.float32, seed, DEVICE)
    vc = seeded((B, Nk + 2, Hkv + 1, D), torch.float32, seed + 1, DEVICE)
    for b, n in enumerate(lengths):
        kc[b, n:] = float("nan")
        vc[b, n:] = float("nan")
    return kc[:, :Nk, 1:], vc[:, :Nk, 1:]


# ----------------------------------------------------------------------------- against the oracle

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
@pytest.mark.parametrize("append", [0, 1, 3])
def test_with_kvcache_matches_the_oracle(backend, variant, append):
    """B = 2 rows at ragged lengths, GQA, Nq = 3 queries; `append` new rows written at
    cache_seqlens first (the cache then holds them, and nothing else changed)."""
    B, Nk, Hq, Hkv, D, Nq = 2, 64, 4, 2, 8, 3
    before = [37, 50] if append else [41, 64]
    after = [n + append for n in before]
    kc, vc = _cache(B, Nk, Hkv, D, before, seed=10)
    q = seeded((B, Nq, Hq, D), torch.float32, 3, DEVICE)
    k_new = seeded((B, append, Hkv, D), torch.float32, 4, DEVICE) if append else None
    v_new = seeded((B, append, Hkv, D), torch.float32, 5, DEVICE) if append else None
    kc0, vc0 = kc.clone(), vc.clone()
    lens = torch.tensor(before, dtype=torch.int32, device=DEVICE)
    for causal in (True, False):
        kc.copy_(kc0)
        vc.copy_(vc0)
        if variant == "dilated":
            fn, oracle = _dilated, _dilated_oracle(causal)
        else:
            lay = _layout(Nk, heads=Hq)
            fn, oracle = _block_sparse(lay), _block_sparse_oracle(lay, causal)
        out, lse = fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, causal=causal, return_lse=True, backend=backend,
                      validate=True)
        assert torch.equal(lens.cpu(), torch.tensor(before, dtype=torch.int32)), "cache_seqlens is not modified"
        for b in range(B):   # the new rows landed at cache_seqlens; nothing else changed
            want_k, want_v = kc0[b].clone(), vc0[b].clone()
            if append:
                want_k[before[b]:after[b]] = k_new[b]
                want_v[before[b]:after[b]] = v_new[b]
            torch.testing.assert_close(kc[b], want_k, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(vc[b], want_v, rtol=0, atol=0, equal_nan=True)
        check_forward(out, lse, q, kc, vc, after, oracle)
        # the same door without new rows on the cache that now holds them (cache_seqlens
        # counting them) gives the same rows
        held = fn(q, kc, vc, cache_seqlens=lens + append, causal=causal, return_lse=True, backend=backend,
                  validate=True)
        torch.testing.assert_close(held, (out, lse), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
def test_rows_holding_fewer_keys_than_queries(backend, variant):
    """Hardening round 3: a row with L < Nq keys (after the append) puts its first Nq - L
    queries before position 0 (aligned to the bottom right, FlashAttention's rule). Under
    causal they read no key (out 0, lse -inf); without causal (issue 33, DESIGN §5b) each sits
    at position 0 and equals the oracle's query there over the row's L keys (an empty row:
    still 0 and -inf, its NaN row 0 unread); the other queries are the row's positions 0 ..
    L - 1 and equal the oracle over its L keys. Before, the portable dilated path gave errors
    of 0.84 (B = 3) or an IndexError (B = 1) and the Triton kernels read before the row
    (non-causal) and floor/truncate disagreed on p < 0. The same on the query-offset path
    (chunked prefill, Nq > 16: the queries at positions >= 0 run the training kernels, the
    non-causal ones before 0 extra calls at position 0); validate=True accepts these lengths."""
    Nk, Hq, Hkv, D = 32, 4, 2, 8
    for before, append, Nq in (([9, 2, 5], 0, 3), ([2], 0, 3), ([0], 0, 3), ([0, 1, 7], 1, 3), ([0, 4], 0, 1),
                               ([5, 20, 0], 2, 18)):
        B, after = len(before), [n + append for n in before]
        kc, vc = _cache(B, Nk, Hkv, D, before, seed=20)
        q = seeded((B, Nq, Hq, D), torch.float32, 21, DEVICE)
        k_new = seeded((B, append, Hkv, D), torch.float32, 22, DEVICE) if append else None
        v_new = seeded((B, append, Hkv, D), torch.float32, 23, DEVICE) if append else None
        kc0, vc0 = kc.clone(), vc.clone()
        lens = torch.tensor(before, dtype=torch.int32, device=DEVICE)
        for causal in (True, False):
            kc.copy_(kc0)
            vc.copy_(vc0)
            if variant == "dilated":
                fn, oracle = _dilated, _dilated_oracle(causal)
            else:
                lay = _layout(Nk, heads=Hq)
                fn, oracle = _block_sparse(lay), _block_sparse_oracle(lay, causal)
            out, lse = fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, causal=causal, return_lse=True,
                          backend=backend, validate=True)
            want_out, want_lse = definition(oracle, q.double(), kc.double(), vc.double(), after, causal)
            what = f"{variant} {backend} lengths {after} causal={causal}"
            torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5, msg=what)
            torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5, msg=what)
            for b, n in enumerate(after):   # no key (before position 0 under causal, an empty row): 0 and -inf
                early = Nq if n == 0 else max(0, Nq - n) if causal else 0
                assert (out[b, :early] == 0).all() and torch.isneginf(lse[b, :, :early]).all()
                assert torch.isfinite(lse[b, :, early:]).all(), what


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
@pytest.mark.parametrize("Nq, lengths", [(3, [2, 40]), (20, [6, 40])])
def test_noncausal_short_row_matches_the_oracle(backend, variant, Nq, lengths, monkeypatch):
    """Issue 33 (DESIGN §5b for patterns): without causal, the queries of a row holding fewer
    keys than queries sit at position 0, so each equals the oracle's query at position 0 over
    the row's keys. Dilated segment_lengths [4, 8], dilation_rates [1, 2] (heads at both
    residues of the r = 2 pattern), a block-sparse local | random layout of 16-blocks with a
    layout per batch row, a short row beside one of normal length (40 keys, NaN past each
    length): out and lse without gradients (3 rows: the decode route, the Triton decode
    kernel), then out, lse, dq, dk_cache, dv_cache with them (Triton: the query-offset path),
    against the float64 oracle (serve_checks.definition: an oracle call per early query).
    The query-offset path's early queries run 3 sequences a call here (ZERO_ROWS 1), so
    several calls per row."""
    monkeypatch.setattr(query_offset, "ZERO_ROWS", 1)
    Nk, Hq, Hkv, D = 48, 4, 2, 8
    kc, vc = _cache(2, Nk, Hkv, D, lengths, seed=80)
    q = seeded((2, Nq, Hq, D), torch.float32, 81, DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    if variant == "dilated":
        def fn(q_, kc_, vc_, **kw):
            return dilated_attention_with_kvcache(q_, kc_, vc_, segment_lengths=[4, 8], dilation_rates=[1, 2], **kw)

        def oracle(q_, k_, v_, n):
            return dilated_attention_naive(q_, k_, v_, [4, 8], [1, 2], causal=False)
    else:
        lay = (layouts.local(Nk, 16, 1) | layouts.random(Nk, 16, num_random=1, seed=5, num_heads=Hq, batch=2)
               ).to(DEVICE)
        fn = _block_sparse(lay)

        def oracle(q_, k_, v_, n):   # the row's own layout (the rows' lengths differ: n names the row)
            return block_sparse_attention_naive(q_, k_, v_, lay.prefix(-(-n // 16), [lengths.index(n)]), causal=False)
    kw = dict(cache_seqlens=lens, causal=False, return_lse=True, backend=backend)
    with torch.no_grad():
        out, lse = fn(q, kc, vc, **kw)
    check_forward(out, lse, q, kc, vc, lengths, oracle, causal=False)
    assert torch.isfinite(lse).all(), "every query reads a key"
    clean_k, clean_v = kc.nan_to_num(0.0), vc.nan_to_num(0.0)   # finite gradients to compare
    check_against_definition(lambda q_, k_, v_: fn(q_, k_, v_, **kw), oracle, q, clean_k, clean_v, lengths,
                             torch.float32, causal=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
def test_with_kvcache_softcap_and_sinks_match_the_oracle(backend, variant):
    """softcap= and sinks= (issue 23) on a decode step: B = 2 rows at ragged lengths, GQA, Nq = 3
    with one row appended, scores large enough that the cap bites; out and lse against the
    oracle with the same cap and sinks (each row's prefix, the queries last); the same door
    without new rows on the cache holding them gives the same rows; the gradients of q, the
    cache and the sinks equal the oracle's on both backends (the Triton path through the
    training kernels: the decode kernel has no backward)."""
    B, Nk, Hq, Hkv, D, Nq, cap = 2, 48, 4, 2, 8, 3, 1.5
    before = [29, 47]
    after = [n + 1 for n in before]
    kc, vc = _cache(B, Nk, Hkv, D, before, seed=20)
    q = seeded((B, Nq, Hq, D), torch.float32, 21, DEVICE, scale=3.0)
    k_new, v_new = (seeded((B, 1, Hkv, D), torch.float32, s, DEVICE) for s in (22, 23))
    sinks = seeded((Hq,), torch.float32, 24, DEVICE, scale=2.0)
    lens = torch.tensor(before, dtype=torch.int32, device=DEVICE)
    kw = dict(causal=True, softcap=cap, sinks=sinks)
    if variant == "dilated":
        fn = _dilated
        oracle = lambda q_, k_, v_, n, s=sinks: dilated_attention_naive(  # noqa: E731
            q_, k_, v_, WS, RS, **{**kw, "sinks": s})
    else:
        lay = _layout(Nk, heads=Hq)
        fn = _block_sparse(lay)
        oracle = lambda q_, k_, v_, n, s=sinks: block_sparse_attention_naive(  # noqa: E731
            q_, k_, v_, lay.prefix(-(-n // lay.block_size)), **{**kw, "sinks": s})
    with torch.no_grad():
        out, lse = fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, return_lse=True, backend=backend, **kw)
        check_forward(out, lse, q, kc, vc, after, oracle)
        held = fn(q, kc, vc, cache_seqlens=lens + 1, return_lse=True, backend=backend, **kw)
    torch.testing.assert_close(held, (out, lse), rtol=1e-6, atol=1e-6)
    leaves = [x.detach().clone().requires_grad_() for x in (q, kc, vc, sinks)]
    g = seeded((B, Nq, Hq, D), torch.float32, 25, DEVICE)
    out, lse = fn(*leaves[:3], cache_seqlens=lens + 1, return_lse=True, backend=backend,
                  **{**kw, "sinks": leaves[3]})
    got = torch.autograd.grad((out * g).sum() + lse.sum(), leaves)
    ref_leaves = [x.detach().double().clone().requires_grad_() for x in (q, kc, vc, sinks)]
    outs, lses = [], []
    for b, n in enumerate(after):   # the queries last in each row's prefix
        qf = torch.cat([ref_leaves[0].new_zeros((1, n - Nq, Hq, D)), ref_leaves[0][b:b + 1]], dim=1)
        o, l_ = oracle(qf, ref_leaves[1][b:b + 1, :n], ref_leaves[2][b:b + 1, :n], n, ref_leaves[3])
        outs.append(o[:, n - Nq:])
        lses.append(l_[:, :, n - Nq:])
    loss = (torch.cat(outs) * g.double()).sum() + torch.cat(lses).sum()
    want = torch.autograd.grad(loss, ref_leaves)
    for name, a, b in zip(("dq", "dk_cache", "dv_cache", "dsinks"), got, want):
        torch.testing.assert_close(a.double().nan_to_num(), b.nan_to_num(), rtol=1e-4, atol=1e-5, msg=name)
    assert want[3].abs().min() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_layouts_on_the_decode_paths(backend):
    """A sliding-window layout (layouts.sliding_window) with softcap and sinks on the decode
    paths: the serve door on a full cache, and appending the queries' own rows to a cache
    holding the rows before them, equal the oracle's rows (the decode kernels evaluate the
    window predicate in the window blocks)."""
    B, N, Hq, Hkv, D = 1, 48, 2, 1, 8
    q = seeded((B, N, Hq, D), torch.float32, 40, DEVICE)
    k, v = (seeded((B, N, Hkv, D), torch.float32, s, DEVICE) for s in (41, 42))
    sinks = seeded((Hq,), torch.float32, 43, DEVICE)
    lay = layouts.sliding_window(N, 16, 10).to(DEVICE)
    kw = dict(causal=True, softcap=1.5, sinks=sinks, return_lse=True, backend=backend)
    ref, ref_lse = block_sparse_attention_naive(q, k, v, lay, causal=True, softcap=1.5, sinks=sinks)
    with torch.no_grad():
        for nq in (1, 3):
            kc, vc = (torch.cat([x[:, :N - nq], torch.full_like(x[:, N - nq:], float("nan"))], 1) for x in (k, v))
            for out, lse in (block_sparse_attention_with_kvcache(
                                 q[:, -nq:], k, v, cache_seqlens=torch.tensor([N], dtype=torch.int32, device=DEVICE),
                                 layout=lay, **kw),
                             block_sparse_attention_with_kvcache(
                                 q[:, -nq:], kc, vc, k[:, -nq:], v[:, -nq:],
                                 cache_seqlens=torch.tensor([N - nq], dtype=torch.int32, device=DEVICE), layout=lay,
                                 **kw)):
                torch.testing.assert_close(out.double(), ref[:, -nq:], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(lse.double(), ref_lse[..., -nq:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,offsets", [("longnet", "blocked"), ("head_groups", "modulo")])
def test_portable_patterns_path_every_head_layout(mode, offsets):
    """The sync-free portable gather (per pattern, the heads active at the query's residue)
    against the oracle for the other offset rules and head-group mode, 12 heads (every offset
    of r = 6 and uneven groups), one query per row at ragged lengths, fp16."""
    ws, rs = [6, 12, 36, 72], [1, 2, 3, 6]
    lengths = [72, 45]
    kc, vc = _cache(2, 72, 3, 12, lengths, seed=20)
    kc, vc = kc.half(), vc.half()
    q = seeded((2, 1, 12, 12), torch.float16, 7, DEVICE)
    for causal in (True, False):
        out, lse = dilated_attention_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor(lengths, dtype=torch.int32,
                                                                                         device=DEVICE),
                                                  segment_lengths=ws, dilation_rates=rs, causal=causal, mode=mode,
                                                  offsets=offsets, return_lse=True, backend="torch")
        check_forward(out, lse, q, kc, vc, lengths,
                      lambda q_, k_, v_, n: dilated_attention_naive(q_, k_, v_, ws, rs, causal=causal, mode=mode,
                                                                    offsets=offsets))


# ----------------------------------------------------------------------------- no host sync

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
@pytest.mark.parametrize("paged", [False, True])
def test_no_host_sync_between_the_call_and_the_kernel(backend, variant, paged):
    """A decode step with an append (contiguous or paged cache) runs under the guard and equals
    the unguarded call; the same door's query-offset route, which reads cache_seqlens on the
    host (chunked prefill: 17 queries; on the Triton path a decode step with gradients),
    trips the same guard (so the guard would catch a sync added to the decode path)."""
    B, Nk, Hq, Hkv, D = 2, 48, 4, 2, 8
    lens = torch.tensor([20, 33], dtype=torch.int32, device=DEVICE)
    lay = _layout(Nk, heads=Hq)
    fn = _dilated if variant == "dilated" else _block_sparse(lay)
    q = seeded((B, 2, Hq, D), torch.float32, 1, DEVICE)
    k_new, v_new = (seeded((B, 2, Hkv, D), torch.float32, s, DEVICE) for s in (2, 3))
    kc, vc = (seeded((B, Nk, Hkv, D), torch.float32, s, DEVICE) for s in (4, 5))
    table = None
    if paged:
        kc, vc, table = _paged(kc, vc, 16)
    kc2, vc2 = kc.clone(), vc.clone()
    # warm-up: first calls build cached device tables (head sets, pattern tables) from host lists
    fn(q, kc2.clone(), vc2.clone(), k_new, v_new, cache_seqlens=lens, block_table=table, backend=backend)
    with no_host_sync():
        out = fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, block_table=table, backend=backend, return_lse=True)
    want = fn(q, kc2, vc2, k_new, v_new, cache_seqlens=lens, block_table=table, backend=backend, return_lse=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close((kc, vc), (kc2, vc2), rtol=0, atol=0, equal_nan=True)
    # softcap= and sinks= (issue 23) stay sync-free: the cap in the kernel, the sinks joined on the device
    extra = dict(softcap=2.0, sinks=seeded((Hq,), torch.float32, 6, DEVICE))
    fn(q, kc2, vc2, cache_seqlens=lens + 2, block_table=table, backend=backend, **extra)   # warm-up
    with no_host_sync():
        out = fn(q, kc, vc, cache_seqlens=lens + 2, block_table=table, backend=backend, return_lse=True, **extra)
    want = fn(q, kc2, vc2, cache_seqlens=lens + 2, block_table=table, backend=backend, return_lse=True, **extra)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    if paged:
        return
    chunk = seeded((B, 17, Hq, D), torch.float32, 7, DEVICE)
    fn(chunk, kc2, vc2, cache_seqlens=lens + 2, backend=backend)   # runs unguarded
    with pytest.raises(HostSync), no_host_sync():   # the guard fires on a host read: chunked prefill
        fn(chunk, kc, vc, cache_seqlens=lens + 2, backend=backend)
    if backend == "triton":                         # gradients on the Triton path: the same route
        with pytest.raises(HostSync), no_host_sync():
            fn(q.detach().requires_grad_(), kc, vc, cache_seqlens=lens + 2, backend=backend)
    with pytest.raises(HostSync), no_host_sync():   # and so does validate=True
        fn(q, kc, vc, cache_seqlens=lens, backend=backend, validate=True)


# ----------------------------------------------------------------------------- torch.compile

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
@pytest.mark.parametrize("paged", [False, True])
def test_compiled_decode_step_serves_every_length_without_recompiling(backend, variant, paged):
    """torch.compile(fullgraph=True) of a decode step with an append (aot_eager: the real
    functionalised graph, the ops' fake kernels), three cache_seqlens tensors: one frame
    compiled, outputs and caches equal to eager and the oracle; contiguous and paged caches
    (pages of 16); and a step without new rows (cache_seqlens counting the queries) traces
    once too."""
    from torch._dynamo.testing import CompileCounterWithBackend

    B, Nk, Hq, Hkv, D = 2, 48, 4, 2, 8
    lay = _layout(Nk, heads=Hq)
    fn = _dilated if variant == "dilated" else _block_sparse(lay)

    def step(q, kc, vc, k, v, lens, table):
        return fn(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, causal=True, return_lse=True,
                  backend=backend)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    q = seeded((B, 1, Hq, D), torch.float32, 1, DEVICE)
    k_new, v_new = (seeded((B, 1, Hkv, D), torch.float32, s, DEVICE) for s in (2, 3))
    for i, before in enumerate(([5, 30], [17, 9], [46, 0])):
        lens = torch.tensor(before, dtype=torch.int32, device=DEVICE)
        kc, vc = (seeded((B, Nk, Hkv, D), torch.float32, s + i, DEVICE) for s in (4, 5))
        table = None
        if paged:
            kc, vc, table = _paged(kc, vc, 16, seed=i)
        kc2, vc2 = kc.clone(), vc.clone()
        got = compiled(q, kc, vc, k_new, v_new, lens, table)
        want = step(q, kc2, vc2, k_new, v_new, lens, table)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close((kc, vc), (kc2, vc2), rtol=0, atol=0, equal_nan=True)
        if paged:
            kc, vc = _unpage(kc, table), _unpage(vc, table)
        oracle = _dilated_oracle(True) if variant == "dilated" else _block_sparse_oracle(lay, True)
        check_forward(*got, q, kc, vc, [n + 1 for n in before], oracle)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 3 cache_seqlens values"
    if paged:
        return

    def held(q, kc, vc, lens):   # no new rows: cache_seqlens counting the queries (DESIGN §5b)
        return fn(q, kc, vc, cache_seqlens=lens, causal=True, backend=backend)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(held, backend=counter, fullgraph=True)
    for before in ([5, 30], [17, 9]):
        lens = torch.tensor(before, dtype=torch.int32, device=DEVICE) + 1
        torch.testing.assert_close(compiled(q, kc, vc, lens), held(q, kc, vc, lens), rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_slice_of_a_decode_step(backend):
    """head_offset/total_heads (Ulysses) on the serve door, eager and compiled:
    the slice's output equals that slice of the full call (the offsets follow global heads)."""
    B, Nk, Hq, Hkv, D = 2, 48, 4, 2, 8
    q = seeded((B, 1, Hq, D), torch.float32, 1, DEVICE)
    kc, vc = (seeded((B, Nk, Hkv, D), torch.float32, s, DEVICE) for s in (4, 5))
    lens = torch.tensor([30, 47], dtype=torch.int32, device=DEVICE)
    kw = dict(cache_seqlens=lens, causal=True, backend=backend)
    full = _dilated(q, kc, vc, **kw)

    def part(q, kc, vc):
        return _dilated(q[:, :, 2:], kc[:, :, 1:], vc[:, :, 1:], head_offset=2, total_heads=Hq, **kw)

    torch._dynamo.reset()
    for fn in (part, torch.compile(part, backend="aot_eager", fullgraph=True)):
        torch.testing.assert_close(fn(q, kc, vc), full[:, :, 2:], rtol=1e-6, atol=1e-6)
    alone = _dilated(q[:, :, 2:], kc[:, :, 1:], vc[:, :, 1:], **kw)   # without the slice: other offsets
    assert not torch.allclose(alone, full[:, :, 2:], atol=1e-4)


def test_opcheck_decode_ops(device):
    """torch.library.opcheck of both custom ops (fake kernels, schemas) on the portable path."""
    q = seeded((2, 2, 4, 8), torch.float32, 1, device)
    kc, vc = (seeded((2, 40, 2, 8), torch.float32, s, device) for s in (2, 3))
    lens = torch.tensor([40, 23], dtype=torch.int32, device=device)
    pool_k, pool_v, table = _paged(kc, vc, 8)
    lay = layouts.local(40, 16, 1, causal=True).to(device)
    for caches in ((kc, vc, None), (pool_k, pool_v, table)):
        torch.library.opcheck(dl_serve._dilated_decode, (q, *caches[:2], lens, caches[2], WS, RS, True, 0.3,
                                                         "longnet", "modulo", 0, 4, "torch"))
        torch.library.opcheck(bs_serve._block_sparse_decode, (q, *caches[:2], lens, caches[2], lay.kv_num_blocks,
                                                              lay.kv_indices, 16, True, 0.3, "torch"))


# ----------------------------------------------------------------------------- paged cache

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
def test_paged_cache_equals_the_contiguous_cache_bit_for_bit(backend, variant):
    """A paged cache (pages of 16, shuffled, spare NaN pages) with two new rows appended:
    out and lse equal the contiguous cache's bit for bit, the pool holds the appended rows,
    and the result meets the float64 oracle."""
    B, Nk, Hq, Hkv, D, Nq = 2, 64, 4, 2, 8, 2
    before = [37, 21]
    kc, vc = _cache(B, Nk, Hkv, D, before, seed=30)
    kc, vc = kc.contiguous(), vc.contiguous()
    pool_k, pool_v, table = _paged(kc, vc, 16)
    q = seeded((B, Nq, Hq, D), torch.float32, 3, DEVICE)
    k_new, v_new = (seeded((B, 2, Hkv, D), torch.float32, s, DEVICE) for s in (4, 5))
    lens = torch.tensor(before, dtype=torch.int32, device=DEVICE)
    lay = _layout(Nk, heads=Hq)
    fn = _dilated if variant == "dilated" else _block_sparse(lay)
    want = fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, return_lse=True, backend=backend)
    got = fn(q, pool_k, pool_v, k_new, v_new, cache_seqlens=lens, block_table=table, return_lse=True,
             backend=backend, validate=True)
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()
    torch.testing.assert_close((_unpage(pool_k, table), _unpage(pool_v, table)), (kc, vc), rtol=0, atol=0,
                               equal_nan=True)
    oracle = _dilated_oracle(True) if variant == "dilated" else _block_sparse_oracle(lay, True)
    check_forward(*got, q, kc, vc, [n + 2 for n in before], oracle)


# ----------------------------------------------------------------------------- errors

def test_argument_errors():
    q = seeded((2, 1, 4, 8), torch.float32, 1, DEVICE)
    kc, vc = (seeded((2, 32, 2, 8), torch.float32, s, DEVICE) for s in (2, 3))
    lens = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)
    kw = dict(segment_lengths=WS, dilation_rates=RS)
    with pytest.raises(TypeError, match="cache_seqlens must be an int32 tensor of shape"):
        dilated_attention_with_kvcache(q, kc, vc, cache_seqlens=[3, 9], **kw)
    with pytest.raises(TypeError, match="cache_seqlens must be an int32 .* got torch.float32"):
        dilated_attention_with_kvcache(q, kc, vc, cache_seqlens=lens.float(), **kw)
    with pytest.raises(ValueError, match=r"cache_seqlens must have shape \(B,\) = \(2,\), got \(1,\)"):
        dilated_attention_with_kvcache(q, kc, vc, cache_seqlens=lens[:1], **kw)
    with pytest.raises(ValueError, match="k and v must be given together"):
        dilated_attention_with_kvcache(q, kc, vc, kc[:, :1], cache_seqlens=lens, **kw)
    with pytest.raises(ValueError, match=r"k \(new rows\) must have shape \(B, Nnew, Hkv, D\)"):
        dilated_attention_with_kvcache(q, kc, vc, kc[:, :1, :1], vc[:, :1, :1], cache_seqlens=lens, **kw)
    with pytest.raises(ValueError, match="q must hold at least one query row per batch row, got 0"):
        dilated_attention_with_kvcache(q[:, :0], kc, vc, cache_seqlens=lens, **kw)
    with pytest.raises(TypeError, match="block_table must be an int32 tensor"):
        dilated_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=lens[:, None].long(), **kw)
    with pytest.raises(ValueError, match=r"block_table must have shape \(B, max_pages\) = \(2, max_pages >= 1\)"):
        dilated_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=lens[:1, None], **kw)
    table = torch.tensor([[0, 1], [1, 5]], dtype=torch.int32, device=DEVICE)   # pool of 2 pages of 32: capacity 64
    with pytest.raises(ValueError, match=r"block_table\[1\] holds page 5, outside the pool's \[0, 2\)"):
        dilated_attention_with_kvcache(q, kc, vc, cache_seqlens=lens + 30, block_table=table, validate=True, **kw)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 32: with 1 new rows the row holds 33"):
        dilated_attention_with_kvcache(q, kc, vc, kc[:, :1], vc[:, :1], cache_seqlens=lens + 23, validate=True, **kw)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 33: with 0 new rows the row holds 33, which must "
                                         r"lie in \[0, 32\]"):
        dilated_attention_with_kvcache(q, kc, vc, cache_seqlens=lens + 30, validate=True, **kw)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = -1: .* must lie in \[0, 32\] .* cache_seqlens >= 0"):
        dilated_attention_with_kvcache(q, kc, vc, cache_seqlens=lens * 0 - 1, validate=True, **kw)
    # L_b = 0 < Nq is valid: the query lies before position 0 and reads nothing
    out, lse = dilated_attention_with_kvcache(q, kc, vc, cache_seqlens=lens * 0, validate=True, return_lse=True, **kw)
    assert (out == 0).all() and torch.isneginf(lse).all()
    with pytest.raises(TypeError, match="validate must be a bool"):
        dilated_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, validate=1, **kw)
    with pytest.raises(TypeError, match="layout must be a BlockLayout"):
        block_sparse_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, layout=None)
    with pytest.raises(ValueError, match="blocks"):
        block_sparse_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, layout=layouts.local(64, 16, 1))


@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
def test_triton_serve_door_gradients(variant):
    """Gradients through the serve door on the Triton path (the decode kernel has no backward:
    the query-offset path runs the training kernels; it used to refuse them) equal the
    portable decode's (plain autograd, itself checked against the oracle in test_decode and
    test_query_offset): q, k_cache, v_cache, ragged lengths, 1 and 3 queries."""
    B, Nk, Hq, Hkv, D = 2, 48, 4, 2, 8
    lay = _layout(Nk, heads=Hq)
    fn = _dilated if variant == "dilated" else _block_sparse(lay)
    lens = torch.tensor([30, 47], dtype=torch.int32, device=DEVICE)
    kc, vc = (seeded((B, Nk, Hkv, D), torch.float32, s, DEVICE) for s in (48, 49))
    for nq in (1, 3):
        q = seeded((B, nq, Hq, D), torch.float32, 51, DEVICE)
        g = seeded((B, nq, Hq, D), torch.float32, 52, DEVICE)
        grads = []
        for backend in BACKENDS:
            leaves = [x.detach().clone().requires_grad_() for x in (q, kc, vc)]
            out, lse = fn(*leaves, cache_seqlens=lens, causal=True, return_lse=True, backend=backend)
            grads.append((out, lse, *torch.autograd.grad((out * g).sum() + lse.sum(), leaves)))
        portable, triton = grads
        for name, got, want in zip(("out", "lse", "dq", "dk_cache", "dv_cache"), triton, portable):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{variant} nq={nq} {name}")
        for b, n in enumerate(lens.tolist()):   # rows past each length: no gradient
            assert (triton[3][b, n:] == 0).all() and (triton[4][b, n:] == 0).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU (TRITON_DILATED_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_step_captures_in_a_cuda_graph(variant, paged):
    """A decode step with an append (Triton path) captured once in a CUDA graph, replayed for
    three cache_seqlens values written into the captured tensor: out and the cache equal the
    eager call each time (a host sync in the step would fail the capture)."""
    B, Nk, Hq, Hkv, D = 2, 256, 4, 2, 64
    lay = _layout(Nk, heads=Hq)
    fn = _dilated if variant == "dilated" else _block_sparse(lay)
    q = seeded((B, 1, Hq, D), torch.float16, 1, DEVICE)
    k_new, v_new = (seeded((B, 1, Hkv, D), torch.float16, s, DEVICE) for s in (2, 3))
    kc, vc = (seeded((B, Nk, Hkv, D), torch.float16, s, DEVICE) for s in (4, 5))
    table = None
    if paged:
        kc, vc, table = _paged(kc, vc, 16)
    lens = torch.tensor([10, 20], dtype=torch.int32, device=DEVICE)

    def step():
        return fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, block_table=table, backend="triton", return_lse=True)

    graph, captured = capture_cuda_graph(step)
    for before in ([5, 200], [131, 17], [254, 0]):
        lens.copy_(torch.tensor(before, dtype=torch.int32))
        kc_eager, vc_eager = kc.clone(), vc.clone()
        graph.replay()
        want = fn(q, kc_eager, vc_eager, k_new, v_new, cache_seqlens=lens, block_table=table, backend="triton",
                  return_lse=True)
        torch.testing.assert_close(captured, want, rtol=0, atol=0)
        torch.testing.assert_close((kc, vc), (kc_eager, vc_eager), rtol=0, atol=0, equal_nan=True)


_BAD_PAGES = r'''
import os, sys
if sys.argv[1] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
import torch
from triton_dilated import BlockLayout, block_sparse_attention_with_kvcache, dilated_attention_with_kvcache
device = sys.argv[1]
g = torch.Generator().manual_seed(0)
pool_k, pool_v = (torch.randn(10, 4, 2, 8, generator=g).to(device) for _ in range(2))
q = torch.randn(1, 1, 2, 8, generator=g).to(device)
lens = torch.tensor([12], dtype=torch.int32, device=device)
# the keys on pages 3 and 7 (positions 0-3, 8-11); the middle page's keys are not read
keys, values = torch.cat([pool_k[3], pool_k[7]]), torch.cat([pool_v[3], pool_v[7]])
scores = torch.einsum("hd,nhd->hn", q[0, 0].double(), keys.double()) * 8 ** -0.5
want_lse = torch.logsumexp(scores, -1)
want = torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), values.double())
dense = BlockLayout.from_dense(torch.ones(1, 1, dtype=torch.bool), 16).to(device)
calls = {
    "dilated": lambda bt, be: dilated_attention_with_kvcache(
        q, pool_k, pool_v, cache_seqlens=lens, block_table=bt, segment_lengths=[16], dilation_rates=[1],
        return_lse=True, backend=be, validate=False),
    "block_sparse": lambda bt, be: block_sparse_attention_with_kvcache(
        q, pool_k, pool_v, cache_seqlens=lens, block_table=bt, layout=dense, return_lse=True, backend=be,
        validate=False)}
for bad in (1000000, -5):
    bt = torch.tensor([[3, bad, 7]], dtype=torch.int32, device=device)
    for name, call in calls.items():
        for backend in ("triton", "torch"):
            out, lse = call(bt, backend)
            err = max(float((out[0, 0].double() - want).abs().max()), float((lse[0, :, 0].double() - want_lse).abs().max()))
            assert err < 1e-5, (bad, name, backend, err)
# an append at a negative length writes nothing (contiguous and paged); the queries before
# position 0 read nothing
for backend in ("triton", "torch"):
    for paged in (False, True):
        kc, vc = (pool_k.clone(), pool_v.clone()) if paged else (pool_k[:2].clone(), pool_v[:2].clone())
        k0, v0 = kc.clone(), vc.clone()
        bt = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=device) if paged else None
        new = torch.randn(1, 1, 2, 8, generator=g).to(device)
        out, lse = dilated_attention_with_kvcache(
            q, kc[:1] if not paged else kc, vc[:1] if not paged else vc, new, new,
            cache_seqlens=torch.tensor([-2], dtype=torch.int32, device=device), block_table=bt,
            segment_lengths=[16], dilation_rates=[1], return_lse=True, backend=backend, validate=False)
        assert torch.equal(kc, k0) and torch.equal(vc, v0), (backend, paged, "the cache changed")
        assert (out == 0).all() and torch.isneginf(lse).all(), (backend, paged)
print("ok")
'''


def test_page_ids_outside_the_pool_read_nothing():
    """Hardening round 3: a block table holding a page id outside the pool (1000000: signal
    11 in the Triton paged decode; -5: garbage), validate=False, in a fresh process so a crash
    fails the test: the keys on that page are not read (masked) on both variants and backends,
    equal to the attention over the other pages' keys. An append at a negative length writes
    nothing (it wrote into the cache's last row)."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _BAD_PAGES, DEVICE], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.returncode, proc.stdout[-2000:],
                                                                         proc.stderr[-3000:])
