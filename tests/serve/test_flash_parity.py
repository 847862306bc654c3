"""The serve doors at FlashAttention's level (issue 33 item 1): `flash_attn_with_kvcache`'s
cache_batch_idx, return_softmax_lse, cache_leftpad and k/v broadcast over the batch (a
zero-stride expand), on both doors and both backends, decode steps and chunked prefill:

* cache_batch_idx: batch row b reads and writes cache row cache_batch_idx[b] of a larger
  cache; equal bit for bit to the door on the gathered rows, the mapped cache rows hold the
  appended rows and the unmapped ones are untouched, and the result meets the float64 oracle;
  no host sync and one compile for several index values;
* cache_leftpad: row b's keys start at cache row cache_leftpad[b] and positions count from
  there (FlashAttention's rule); equal to the door on the rows shifted to the front, the
  appended rows at cache_seqlens[b] (from cache row 0), the float64 oracle on the shifted
  rows; with cache_batch_idx and with a paged cache too; no host sync, one compile;
* argument errors name the argument.
"""
from __future__ import annotations

import pytest
import torch

from triton_dilated import (block_sparse_attention_naive, block_sparse_attention_with_kvcache, dilated_attention_naive,
                            dilated_attention_with_kvcache, layouts)
from tests.conftest import DEVICE
from tests.helpers.reference import seeded
from tests.helpers.serve_checks import check_forward, no_host_sync, page_pools

BACKENDS = ["torch", "triton"]
WS, RS = [8, 16, 48], [1, 2, 4]
NK, HQ, HKV, D = 64, 4, 2, 8


def _layout(nk=NK, heads=HQ):
    return (layouts.local(nk, 16, 1, causal=True) | layouts.random(nk, 16, num_random=1, seed=2, num_heads=heads)
            ).to(DEVICE)


def _door(variant):
    """(fn(q, kc, vc, k, v, **kw), oracle(causal)) of a variant."""
    if variant == "dilated":
        return (lambda q, kc, vc, k=None, v=None, **kw: dilated_attention_with_kvcache(
                    q, kc, vc, k, v, segment_lengths=WS, dilation_rates=RS, **kw),
                lambda causal: lambda q_, k_, v_, n: dilated_attention_naive(q_, k_, v_, WS, RS, causal=causal))
    lay = _layout()
    return (lambda q, kc, vc, k=None, v=None, **kw: block_sparse_attention_with_kvcache(q, kc, vc, k, v, layout=lay,
                                                                                       **kw),
            lambda causal: lambda q_, k_, v_, n: block_sparse_attention_naive(
                q_, k_, v_, lay.prefix(-(-n // lay.block_size)), causal=causal))


def _cache(rows, lengths, seed):
    """k_cache, v_cache (rows, NK, HKV, D), NaN from each row's length on."""
    kc = seeded((rows, NK, HKV, D), torch.float32, seed, DEVICE)
    vc = seeded((rows, NK, HKV, D), torch.float32, seed + 1, DEVICE)
    for r, n in enumerate(lengths):
        kc[r, n:] = float("nan")
        vc[r, n:] = float("nan")
    return kc, vc


def _lens(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# ----------------------------------------------------------------------------- cache_batch_idx

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
@pytest.mark.parametrize("nq, append", [(1, 1), (3, 0), (2, 2), (18, 2)])
def test_cache_batch_idx_reads_and_writes_the_mapped_rows(backend, variant, nq, append):
    """A cache of 5 rows, 3 batch rows mapped to rows [3, 0, 4] (1 and 2 unused, poisoned NaN):
    out and lse (decode steps, and chunked prefill at Nq = 18) equal the door on the gathered
    rows bit for bit, the appended rows land in rows 3, 0, 4 only, and the result meets the
    float64 oracle; return_softmax_lse (FlashAttention's name) returns the lse too."""
    fn, oracle = _door(variant)
    idx = [3, 0, 4]
    before = [30, 41, 21]
    row_lens = [0] * 5
    for i, n in zip(idx, before):
        row_lens[i] = n
    kc, vc = _cache(5, row_lens, seed=40)
    kc[1:3], vc[1:3] = float("nan"), float("nan")
    q = seeded((3, nq, HQ, D), torch.float32, 41, DEVICE)
    k_new = seeded((3, append, HKV, D), torch.float32, 42, DEVICE) if append else None
    v_new = seeded((3, append, HKV, D), torch.float32, 43, DEVICE) if append else None
    lens = _lens(before)
    cbi = _lens(idx)
    gk, gv = kc[idx].clone(), vc[idx].clone()
    k0, v0 = kc.clone(), vc.clone()
    for causal in (True, False):
        kc.copy_(k0)
        vc.copy_(v0)
        gk, gv = k0[idx].clone(), v0[idx].clone()
        got = fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, cache_batch_idx=cbi, causal=causal,
                 return_softmax_lse=True, backend=backend, validate=(nq == 2))
        want = fn(q, gk, gv, k_new, v_new, cache_seqlens=lens, causal=causal, return_lse=True, backend=backend)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (g - w).abs().max()
        torch.testing.assert_close((kc[idx], vc[idx]), (gk, gv), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close((kc[1:3], vc[1:3]), (k0[1:3], v0[1:3]), rtol=0, atol=0, equal_nan=True)
        check_forward(*got, q, gk, gv, [n + append for n in before], oracle(causal))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
def test_cache_batch_idx_without_host_sync_and_compiled_once(backend, variant):
    """A decode step with cache_batch_idx and an append runs under the no-host-sync guard,
    equal to the unguarded call; torch.compile(fullgraph=True) serves three (lengths, indices)
    pairs with one frame, equal to eager; an index outside the cache (validate=False) reads
    and writes nothing: out 0, lse -inf, the cache unchanged."""
    from torch._dynamo.testing import CompileCounterWithBackend

    fn, _ = _door(variant)
    q = seeded((2, 1, HQ, D), torch.float32, 1, DEVICE)
    k_new, v_new = (seeded((2, 1, HKV, D), torch.float32, s, DEVICE) for s in (2, 3))
    kc, vc = (seeded((4, NK, HKV, D), torch.float32, s, DEVICE) for s in (4, 5))
    lens, cbi = _lens([20, 33]), _lens([2, 1])
    kc2, vc2 = kc.clone(), vc.clone()
    fn(q, kc2.clone(), vc2.clone(), k_new, v_new, cache_seqlens=lens, cache_batch_idx=cbi, backend=backend)   # warm-up
    with no_host_sync():
        out = fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, cache_batch_idx=cbi, backend=backend, return_lse=True)
    want = fn(q, kc2, vc2, k_new, v_new, cache_seqlens=lens, cache_batch_idx=cbi, backend=backend, return_lse=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close((kc, vc), (kc2, vc2), rtol=0, atol=0)

    def step(q, kc, vc, k, v, lens, cbi):
        return fn(q, kc, vc, k, v, cache_seqlens=lens, cache_batch_idx=cbi, return_lse=True, backend=backend)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for before, rows in (([5, 30], [0, 3]), ([17, 9], [3, 0]), ([46, 0], [1, 2])):
        kc, vc = (seeded((4, NK, HKV, D), torch.float32, s, DEVICE) for s in (6, 7))
        kc2, vc2 = kc.clone(), vc.clone()
        got = compiled(q, kc, vc, k_new, v_new, _lens(before), _lens(rows))
        torch.testing.assert_close(got, step(q, kc2, vc2, k_new, v_new, _lens(before), _lens(rows)), rtol=1e-6,
                                   atol=1e-6)
        torch.testing.assert_close((kc, vc), (kc2, vc2), rtol=0, atol=0)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 3 cache_batch_idx values"

    k0, v0 = kc.clone(), vc.clone()
    out, lse = fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, cache_batch_idx=_lens([7, -1]), return_lse=True,
                  backend=backend)
    assert (out == 0).all() and torch.isneginf(lse).all()
    assert torch.equal(kc, k0) and torch.equal(vc, v0)


def test_cache_batch_idx_and_return_softmax_lse_errors():
    q = seeded((2, 1, HQ, D), torch.float32, 1, DEVICE)
    kc, vc = (seeded((3, NK, HKV, D), torch.float32, s, DEVICE) for s in (2, 3))
    lens = _lens([3, 9])
    for fn, _ in (_door("dilated"), _door("block_sparse")):
        with pytest.raises(TypeError, match=r"cache_batch_idx must be an int32 tensor \(B,\) = \(2,\)"):
            fn(q, kc, vc, cache_seqlens=lens, cache_batch_idx=lens.long())
        with pytest.raises(TypeError, match="cache_batch_idx must be an int32 tensor .* got list"):
            fn(q, kc, vc, cache_seqlens=lens, cache_batch_idx=[0, 1])
        with pytest.raises(ValueError, match=r"cache_batch_idx must have shape \(B,\) = \(2,\) .* got \(3,\)"):
            fn(q, kc, vc, cache_seqlens=lens, cache_batch_idx=_lens([0, 1, 2]))
        with pytest.raises(ValueError, match=r"cache_batch_idx\[1\] = 3, outside the cache's rows \[0, 3\)"):
            fn(q, kc, vc, cache_seqlens=lens, cache_batch_idx=_lens([0, 3]), validate=True)
        with pytest.raises(ValueError, match="cache_batch_idx maps batch rows .* not both"):
            fn(q, kc, vc, cache_seqlens=lens, cache_batch_idx=_lens([0, 1]), block_table=_lens([[0], [1]]))
        with pytest.raises(ValueError, match=r"must have the batch size of q \(2\), got 3"):
            fn(q, kc, vc, cache_seqlens=lens)        # without the map the cache's batch must be B
        with pytest.raises(TypeError, match="return_softmax_lse must be a bool"):
            fn(q, kc[:2], vc[:2], cache_seqlens=lens, return_softmax_lse=1)
        with pytest.raises(ValueError, match="return_softmax_lse is FlashAttention's name for return_lse"):
            fn(q, kc[:2], vc[:2], cache_seqlens=lens, return_lse=True, return_softmax_lse=False)
        out = fn(q, kc[:2], vc[:2], cache_seqlens=lens, return_lse=True, return_softmax_lse=True)
        assert isinstance(out, tuple) and out[1].shape == (2, HQ, 1)


# ----------------------------------------------------------------------------- cache_leftpad

def _shifted(kc, pads):
    """Each row b of kc moved pads[b] rows to the front, NaN after (the rows a padded row's
    positions 0, 1, ... are)."""
    out = torch.full_like(kc, float("nan"))
    for b, p in enumerate(pads):
        out[b, :kc.shape[1] - p] = kc[b, p:]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
@pytest.mark.parametrize("nq, append, mapped", [(1, 1, False), (3, 0, True), (2, 2, False), (18, 2, True),
                                                (4, 1, "paged")])
def test_cache_leftpad_counts_positions_from_the_pad(backend, variant, nq, append, mapped):
    """3 rows padded by [5, 0, 12] rows (NaN: never read), cache_seqlens [30, 41, 21] from cache
    row 0: out and lse equal the door on the rows shifted to the front (lengths less the
    pads) bit for bit, the new rows land at cache_seqlens, the float64 oracle agrees; with
    cache_batch_idx (rows [2, 0, 3] of 4) and with a paged cache (pages of 16) too; decode
    steps and chunked prefill (Nq = 18)."""
    fn, oracle = _door(variant)
    before, pads = [30, 41, 21], [5, 0, 12 if nq < 12 else 3]
    kc, vc = _cache(3, before, seed=50)
    for b, p in enumerate(pads):
        kc[b, :p], vc[b, :p] = float("nan"), float("nan")
    q = seeded((3, nq, HQ, D), torch.float32, 51, DEVICE)
    k_new = seeded((3, append, HKV, D), torch.float32, 52, DEVICE) if append else None
    v_new = seeded((3, append, HKV, D), torch.float32, 53, DEVICE) if append else None
    lens, leftpad = _lens(before), _lens(pads)
    for causal in (True, False):
        ref_k, ref_v = _shifted(kc, pads), _shifted(vc, pads)
        want = fn(q, ref_k, ref_v, k_new, v_new, cache_seqlens=lens - leftpad, causal=causal, return_lse=True,
                  backend=backend)
        kw = dict(cache_seqlens=lens, cache_leftpad=leftpad, causal=causal, return_lse=True, backend=backend,
                  validate=nq == 2)
        if mapped == "paged":
            pool_k, pool_v, table = page_pools(kc, vc, 16)
            got = fn(q, pool_k, pool_v, k_new, v_new, block_table=table, **kw)
            got_k, got_v = (pool[table.long()].flatten(1, 2) for pool in (pool_k, pool_v))
        elif mapped:
            big_k, big_v = (torch.full((4, *x.shape[1:]), float("nan"), device=DEVICE) for x in (kc, vc))
            big_k[[2, 0, 3]], big_v[[2, 0, 3]] = kc, vc
            got = fn(q, big_k, big_v, k_new, v_new, cache_batch_idx=_lens([2, 0, 3]), **kw)
            got_k, got_v = big_k[[2, 0, 3]], big_v[[2, 0, 3]]
            assert big_k[1].isnan().all()
        else:
            got_k, got_v = kc.clone(), vc.clone()
            got = fn(q, got_k, got_v, k_new, v_new, **kw)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (g - w).abs().max()
        torch.testing.assert_close((_shifted(got_k, pads), _shifted(got_v, pads)), (ref_k, ref_v), rtol=0, atol=0,
                                   equal_nan=True)
        check_forward(*got, q, ref_k, ref_v, [n + append - p for n, p in zip(before, pads)], oracle(causal))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
def test_cache_leftpad_without_host_sync_and_compiled_once(backend, variant):
    """A decode step with cache_leftpad (and an append) runs under the no-host-sync guard, and
    torch.compile(fullgraph=True) serves three (lengths, pads) pairs with one frame, equal to
    eager; a negative pad counts as 0 (validate=False)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    fn, _ = _door(variant)
    q = seeded((2, 2, HQ, D), torch.float32, 1, DEVICE)
    k_new, v_new = (seeded((2, 1, HKV, D), torch.float32, s, DEVICE) for s in (2, 3))
    kc, vc = (seeded((2, NK, HKV, D), torch.float32, s, DEVICE) for s in (4, 5))
    lens, pads = _lens([20, 33]), _lens([3, 30])
    kc2, vc2 = kc.clone(), vc.clone()
    fn(q, kc2.clone(), vc2.clone(), k_new, v_new, cache_seqlens=lens, cache_leftpad=pads, backend=backend)
    with no_host_sync():
        out = fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, cache_leftpad=pads, backend=backend, return_lse=True)
    want = fn(q, kc2, vc2, k_new, v_new, cache_seqlens=lens, cache_leftpad=pads, backend=backend, return_lse=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close((kc, vc), (kc2, vc2), rtol=0, atol=0)
    torch.testing.assert_close(fn(q, kc, vc, cache_seqlens=lens, cache_leftpad=pads * 0 - 4, backend=backend),
                               fn(q, kc, vc, cache_seqlens=lens, backend=backend), rtol=0, atol=0)

    def step(q, kc, vc, k, v, lens, pads):
        return fn(q, kc, vc, k, v, cache_seqlens=lens, cache_leftpad=pads, return_lse=True, backend=backend)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for before, pad in (([5, 30], [0, 7]), ([17, 9], [16, 1]), ([46, 0], [40, 0])):
        kc, vc = (seeded((2, NK, HKV, D), torch.float32, s, DEVICE) for s in (6, 7))
        kc2, vc2 = kc.clone(), vc.clone()
        got = compiled(q, kc, vc, k_new, v_new, _lens(before), _lens(pad))
        torch.testing.assert_close(got, step(q, kc2, vc2, k_new, v_new, _lens(before), _lens(pad)), rtol=1e-6,
                                   atol=1e-6)
        torch.testing.assert_close((kc, vc), (kc2, vc2), rtol=0, atol=0)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 3 cache_leftpad values"


def test_cache_leftpad_errors():
    q = seeded((2, 1, HQ, D), torch.float32, 1, DEVICE)
    kc, vc = (seeded((2, NK, HKV, D), torch.float32, s, DEVICE) for s in (2, 3))
    lens = _lens([3, 9])
    for fn, _ in (_door("dilated"), _door("block_sparse")):
        with pytest.raises(TypeError, match=r"cache_leftpad must be an int32 tensor \(B,\) = \(2,\)"):
            fn(q, kc, vc, cache_seqlens=lens, cache_leftpad=lens.long())
        with pytest.raises(ValueError, match=r"cache_leftpad must have shape \(B,\) = \(2,\) .* got \(1,\)"):
            fn(q, kc, vc, cache_seqlens=lens, cache_leftpad=lens[:1])
        with pytest.raises(ValueError, match=r"cache_leftpad\[1\] = 10 must lie in \[0, cache_seqlens\[1\]\] = "
                                             r"\[0, 9\]"):
            fn(q, kc, vc, cache_seqlens=lens, cache_leftpad=_lens([0, 10]), validate=True)
        with pytest.raises(ValueError, match=r"cache_leftpad\[0\] = -1 must lie in"):
            fn(q, kc, vc, cache_seqlens=lens, cache_leftpad=_lens([-1, 0]), validate=True)


# ----------------------------------------------------------------------------- k, v broadcast over the batch

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
@pytest.mark.parametrize("nq", [2, 18])
def test_new_rows_broadcast_over_the_batch(backend, variant, nq):
    """k, v of one batch row expanded over the batch (stride 0 on the batch dim, as an engine
    appending one shared prompt's rows to several caches): accepted, and the caches and results
    equal those of the materialised copy (a decode step and chunked prefill; with
    cache_batch_idx too)."""
    fn, _ = _door(variant)
    before = [20, 33, 7]
    kc, vc = _cache(3, before, seed=60)
    q = seeded((3, nq, HQ, D), torch.float32, 61, DEVICE)
    k1, v1 = (seeded((1, 3, HKV, D), torch.float32, s, DEVICE) for s in (62, 63))
    k_new, v_new = k1.expand(3, -1, -1, -1), v1.expand(3, -1, -1, -1)
    assert k_new.stride(0) == 0
    for extra in ({}, {"cache_batch_idx": _lens([1, 2, 0])}):
        lens = _lens(before if not extra else [before[i] for i in (1, 2, 0)])
        kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        got = fn(q, kc1, vc1, k_new, v_new, cache_seqlens=lens, return_lse=True, backend=backend, **extra)
        want = fn(q, kc2, vc2, k_new.contiguous(), v_new.contiguous(), cache_seqlens=lens, return_lse=True,
                  backend=backend, **extra)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (g - w).abs().max()
        torch.testing.assert_close((kc1, vc1), (kc2, vc2), rtol=0, atol=0, equal_nan=True)
        for b, n in enumerate(before):
            assert torch.equal(kc1[b, n:n + 3], k1[0])
