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
from tests.helpers.serve_checks import (check_forward, int32_lengths, nan_past_lengths, no_host_sync, page_pools,
                                        rotary_reference, serve_doors)

BACKENDS = ["torch", "triton"]
WS, RS = [8, 16, 48], [1, 2, 4]
NK, HQ, HKV, D = 64, 4, 2, 8


def _layout(nk=NK, heads=HQ):
    return (layouts.local(nk, 16, 1, causal=True) | layouts.random(nk, 16, num_random=1, seed=2, num_heads=heads)
            ).to(DEVICE)


def _door(variant):
    """(fn(q, kc, vc, k, v, **kw), oracle(causal)) of a variant."""
    return serve_doors(variant, WS, RS, _layout())


def _cache(rows, lengths, seed):
    return nan_past_lengths(rows, lengths, seed, (NK, HKV, D))


def _lens(values):
    return int32_lengths(values)


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


# ----------------------------------------------------------------------------- the portable dense route

DENSE_CASES = {   # (segment_lengths, dilation_rates) covering most of the 64 positions, and a layout
    "dilated dense": ([64], [1]),
    "dilated near-dense": ([16, 64], [1, 2]),
    "block-sparse dense": None,
}


def _dense_door(case):
    if DENSE_CASES[case] is None:
        lay = layouts.local(NK, 16, 4, causal=True).to(DEVICE)
        return (lambda q, kc, vc, k=None, v=None, **kw: block_sparse_attention_with_kvcache(
                    q, kc, vc, k, v, layout=lay, **kw),
                lambda causal: lambda q_, k_, v_, n: block_sparse_attention_naive(
                    q_, k_, v_, lay.prefix(-(-n // lay.block_size)), causal=causal))
    ws, rs = DENSE_CASES[case]
    return (lambda q, kc, vc, k=None, v=None, **kw: dilated_attention_with_kvcache(
                q, kc, vc, k, v, segment_lengths=ws, dilation_rates=rs, **kw),
            lambda causal: lambda q_, k_, v_, n: dilated_attention_naive(q_, k_, v_, ws, rs, causal=causal))


@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_dense_route_equals_the_gather_path(case, monkeypatch):
    """Key lists covering most of the cache take the portable dense route (one einsum over the
    cache, the pattern a multiplicity mask): equal to the gather path (DENSE_SHARE above 1
    forces it) and the float64 oracle, causal or not, with softcap and sinks, under
    cache_leftpad, cache_batch_idx and a paged cache; NaN in rows no query reads (past the
    lengths, in the pads, at residues a dilated query skips) spreads nowhere, a NaN value a
    query reads makes its row NaN, on both routes alike; gradients equal; no host sync."""
    from triton_dilated.ops.common import decode as common_decode

    fn, oracle = _dense_door(case)
    default = common_decode.DENSE_SHARE
    before, pads = [40, 63, 25], [0, 3, 9]
    kc, vc = _cache(3, before, seed=80)
    q = seeded((3, 3, HQ, D), torch.float32, 81, DEVICE)
    k_new, v_new = (seeded((3, 1, HKV, D), torch.float32, s, DEVICE) for s in (82, 83))
    lens, leftpad = _lens(before), _lens(pads)
    sinks = seeded((HQ,), torch.float32, 84, DEVICE)
    calls = {
        "plain": dict(causal=True),
        "not causal, softcap, sinks": dict(causal=False, softcap=3.0, sinks=sinks),
        "leftpad": dict(causal=True, cache_leftpad=leftpad),
        "mapped": dict(causal=True, cache_batch_idx=_lens([2, 0, 1])),
        "paged": dict(causal=True, paged=True),
    }
    for name, kw in calls.items():
        kw = dict(kw)
        paged = kw.pop("paged", False)
        results, stats = [], []
        for share in (default, 2.0):
            monkeypatch.setattr(common_decode, "DENSE_SHARE", share)
            kc1, vc1 = kc.clone(), vc.clone()
            if "cache_leftpad" in kw:   # the pads hold NaN: never read
                for b, p in enumerate(pads):
                    kc1[b, :p], vc1[b, :p] = float("nan"), float("nan")
            if "cache_batch_idx" in kw:
                kc1, vc1 = kc1[[1, 2, 0]], vc1[[1, 2, 0]]
            table = None
            if paged:
                kc1, vc1, table = page_pools(kc1, vc1, 16)
            common_decode.DECODE_STATS["calls"] = common_decode.DECODE_STATS["key_rows"] = 0
            results.append(fn(q, kc1, vc1, k_new, v_new, cache_seqlens=lens, block_table=table, return_lse=True,
                              backend="torch", **kw))
            stats.append(common_decode.DECODE_STATS["key_rows"])
        torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6, msg=name)
        assert stats[0] == 3 * HQ * NK, (name, stats)   # the dense route read every key row once per head
        if name == "plain":
            kc2, vc2 = kc.clone(), vc.clone()
            for b, n in enumerate(before):
                kc2[b, n], vc2[b, n] = k_new[b, 0], v_new[b, 0]
            check_forward(*results[0], q, kc2, vc2, [n + 1 for n in before], oracle(True))

    # the NaN rule: a NaN value at the query's own position (read by every head) and one
    # past the length (read by none)
    kc1, vc1 = kc.clone(), vc.clone()
    vc1[0, 39, 0, 0] = float("nan")
    got = []
    for share in (default, 2.0):
        monkeypatch.setattr(common_decode, "DENSE_SHARE", share)
        got.append(fn(q, kc1, vc1, cache_seqlens=lens, return_lse=True, backend="torch"))
    torch.testing.assert_close(got[0], got[1], rtol=1e-5, atol=1e-6, equal_nan=True)
    assert got[0][0][0, -1].isnan().any() and not got[0][0][1:].isnan().any()

    # gradients
    grads = []
    for share in (default, 2.0):
        monkeypatch.setattr(common_decode, "DENSE_SHARE", share)
        xs = [x.detach().clone().nan_to_num(0.0).requires_grad_() for x in (q, kc, vc)]
        out, lse = fn(*xs, cache_seqlens=lens + 1, return_lse=True, backend="torch")
        grads.append(torch.autograd.grad(out.square().sum() + lse.sum(), xs))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)

    monkeypatch.setattr(common_decode, "DENSE_SHARE", default)
    fn(q, kc.clone(), vc.clone(), k_new, v_new, cache_seqlens=lens, backend="torch")   # warm-up (cached tables)
    with no_host_sync():
        fn(q, kc.clone(), vc.clone(), k_new, v_new, cache_seqlens=lens, cache_leftpad=leftpad, backend="torch")


@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_dense_route_cpu_check_equals_the_careful_path(case, monkeypatch):
    """On a CPU the dense route first attends a row without NaN care (no copy of its values,
    the scores checked, not rewritten) and attends it again with care only when its scores or
    out are not finite (common.decode.host_reads): bit for bit what the careful path (the one a
    GPU takes, no host read) gives, on finite caches and with a non-finite key or value read or
    not: -inf in a read key (which leaves the out finite: the score check catches it), +inf in
    a key and NaN in a value past the length, NaN in a value only the last query reads."""
    from triton_dilated.ops.common import decode as common_decode

    fn, _ = _dense_door(case)
    before = [40, 63, 25]
    kc, vc = (seeded((3, NK, HKV, D), torch.float32, s, DEVICE) for s in (90, 91))   # finite past the lengths
    q = seeded((3, 3, HQ, D), torch.float32, 92, DEVICE)
    lens = _lens(before)
    poisons = {"finite": None, "key -inf, read": ("k", 0, 38, float("-inf")),
               "key +inf past the length": ("k", 1, 63, float("inf")),
               "value NaN at the last position (the first query does not read it)": ("v", 2, 24, float("nan")),
               "value NaN past the length": ("v", 0, 50, float("nan"))}
    careful = []
    real_row = common_decode.dense_row
    monkeypatch.setattr(common_decode, "dense_row", lambda *a, careful: careful_row(real_row, a, careful))

    def careful_row(real, args, flag):
        careful.append(flag)
        return real(*args, careful=flag)

    for name, poison in poisons.items():
        kc1, vc1 = kc.clone(), vc.clone()
        if poison is not None:
            which, b, n, value = poison
            (kc1 if which == "k" else vc1)[b, n, 0, 1] = value
        got = []
        for host in (True, False):
            careful.clear()
            monkeypatch.setattr(common_decode, "host_reads", lambda x, host=host: host)
            got.append(fn(q, kc1, vc1, cache_seqlens=lens, return_lse=True, backend="torch"))
            if not host:
                assert careful == [True] * 3, (name, careful)
            elif poison is None:
                assert careful == [False] * 3, (name, careful)
            else:   # the poisoned row was attended again, the others not
                assert careful.count(True) == 1 and careful.count(False) == 3, (name, careful)
        torch.testing.assert_close(got[0], got[1], rtol=0, atol=0, equal_nan=True)
        out = got[0][0]
        if poison is None or poison[2] >= before[poison[1]]:
            assert not out.isnan().any(), name
        else:   # the poisoned row's last query reads it; the other rows and its first query do not
            b = poison[1]
            assert out[b, -1].isnan().any() and not out[b, 0].isnan().any(), name
            assert not out[[r for r in range(3) if r != b]].isnan().any(), name


# ----------------------------------------------------------------------------- rotary embedding

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("nq", [2, 18])
def test_rotary_embedding_of_q_and_the_appended_k(backend, variant, interleaved, nq):
    """rotary_cos/rotary_sin (rotary_dim 6 of D = 8) rotate the new rows k at their cache rows
    cache_seqlens[b] + j and q at cache_seqlens[b] + i (causal) or all at cache_seqlens[b]
    (not causal), FlashAttention's positions, also under cache_leftpad (rotary positions
    count from cache row 0, as FlashAttention): the cache holds the rotated rows and the result
    equals the door on q and k rotated beforehand (float64 complex reference)."""
    fn, _ = _door(variant)
    before, pads = [20, 33, 7], [0, 5, 2]
    kc, vc = _cache(3, before, seed=70)
    q = seeded((3, nq, HQ, D), torch.float32, 71, DEVICE)
    k_new, v_new = (seeded((3, 2, HKV, D), torch.float32, s, DEVICE) for s in (72, 73))
    angles = torch.arange(NK, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(3) / 3)
    cos, sin = angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)
    lens = _lens(before)
    for causal, leftpad in ((True, None), (False, None), (True, _lens(pads))):
        start = torch.tensor(before)[:, None]
        q_pos = start + (torch.arange(nq) if causal else torch.zeros(nq, dtype=torch.long))
        q_ref = rotary_reference(q, cos, sin, q_pos, interleaved)
        k_ref = rotary_reference(k_new, cos, sin, start + torch.arange(2), interleaved)
        kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        got = fn(q, kc1, vc1, k_new, v_new, cache_seqlens=lens, cache_leftpad=leftpad, causal=causal,
                 rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved, return_lse=True, backend=backend,
                 validate=True)
        want = fn(q_ref, kc2, vc2, k_ref, v_new, cache_seqlens=lens, cache_leftpad=leftpad, causal=causal,
                  return_lse=True, backend=backend)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close((kc1, vc1), (kc2, vc2), rtol=1e-5, atol=1e-6, equal_nan=True)


def test_rotary_errors():
    q = seeded((2, 1, HQ, D), torch.float32, 1, DEVICE)
    kc, vc = (seeded((2, NK, HKV, D), torch.float32, s, DEVICE) for s in (2, 3))
    k_new, v_new = kc[:, :1].clone(), vc[:, :1].clone()
    lens = _lens([3, 9])
    cos = torch.ones(16, 3, device=DEVICE)
    for fn, _ in (_door("dilated"), _door("block_sparse")):
        with pytest.raises(ValueError, match="rotary_cos and rotary_sin must be given together"):
            fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, rotary_cos=cos)
        with pytest.raises(ValueError, match="rotary_cos and rotary_sin rotate the new rows k .* give k and v"):
            fn(q, kc, vc, cache_seqlens=lens, rotary_cos=cos, rotary_sin=cos)
        with pytest.raises(TypeError, match=r"rotary_cos must be a float tensor \(seqlen_ro, rotary_dim / 2\)"):
            fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, rotary_cos=cos.long(), rotary_sin=cos)
        with pytest.raises(ValueError, match=r"rotary_sin must have shape .* 2 <= rotary_dim <= D = 8, got \(16, 5\)"):
            fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, rotary_cos=cos, rotary_sin=torch.ones(16, 5))
        with pytest.raises(ValueError, match="rotary_cos and rotary_sin must have one shape"):
            fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, rotary_cos=cos, rotary_sin=cos[:, :2])
        with pytest.raises(TypeError, match="rotary_interleaved must be a bool"):
            fn(q, kc, vc, k_new, v_new, cache_seqlens=lens, rotary_cos=cos, rotary_sin=cos, rotary_interleaved=1)
        with pytest.raises(ValueError, match="rotary_cos and rotary_sin hold 16 positions, but this call rotates "
                                             "position 17"):
            fn(q, kc, vc, k_new, v_new, cache_seqlens=lens + 8, rotary_cos=cos, rotary_sin=cos, validate=True)
