"""FlashAttention's `window_size=(left, right)` on the dilated serve door
(dilated_attention_with_kvcache, issue 33 item 1): a causal sliding window on absolute
positions (from cache_leftpad's pad), query at p reading only its patterns' keys at
p - left .. p.

The definition every check ends at: the float64 oracle dilated_attention_naive(...,
window_size=) on each row's full sequence (the keys from the pad to L_b, the queries placed
last: `serve_checks.definition`), whose window its own test holds to the dense
definition (tests/ops/dilated/test_window_size.py). Decode steps (1 and 4 rows: the decode
kernel and the portable decode) and chunked prefill (20 rows: the query-offset path on the
training kernels), contiguous and paged caches, with cache_leftpad and an append, GQA, both
backends (Triton under the interpreter); the window alone (left = 0: a query reads only its own
key), no host sync on the decode route, one torch.compile frame for every length, the plan key,
PagedDilatedKVCache and varlen queries, and the argument errors. One Triton compile for every
window value: tests/ops/common/test_kernel_signatures.py (the dilated decode scenario)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import DEVICE
from tests.helpers.reference import seeded
from tests.helpers.serve_checks import check_forward, no_host_sync, page_pools, unpage
from triton_dilated import PagedDilatedKVCache, dilated_attention_naive, dilated_attention_with_kvcache

BACKENDS = ["torch", "triton"]
WS, RS = [8, 16, 48], [1, 2, 4]
NK, HQ, HKV, D = 64, 4, 2, 8


def _door(q, kc, vc, k=None, v=None, **kw):
    return dilated_attention_with_kvcache(q, kc, vc, k, v, segment_lengths=WS, dilation_rates=RS, **kw)


def _oracle(left):
    return lambda q_, k_, v_, n: dilated_attention_naive(q_, k_, v_, WS, RS, causal=True, window_size=(left, 0))


def _lens(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _shifted(kc, pads):
    """Each row b of kc moved pads[b] rows to the front (positions count from the pad), NaN after."""
    out = torch.full_like(kc, float("nan"))
    for b, p in enumerate(pads):
        out[b, :kc.shape[1] - p] = kc[b, p:]
    return out


def _cache(lengths, pads, seed):
    """k_cache, v_cache (B, NK, HKV, D): NaN before each row's pad and from its length on (rows
    the call must never read)."""
    kc, vc = (seeded((len(lengths), NK, HKV, D), torch.float32, seed + i, DEVICE) for i in range(2))
    for b, (n, p) in enumerate(zip(lengths, pads)):
        for x in (kc, vc):
            x[b, :p] = float("nan")
            x[b, n:] = float("nan")
    return kc, vc


# ----------------------------------------------------------------------------- against the oracle

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nq", [1, 4, 20])
@pytest.mark.parametrize("paged", [False, True])
def test_window_matches_the_oracle(backend, nq, paged):
    """3 rows padded by [5, 0, 3], cache_seqlens [30, 41, 25] and one new row appended (L_b =
    26, 42, 23 keys from the pad), GQA 4/2: windows of 1, 7, 18 and 201 keys (the last wider
    than any row: the same as no window) against the float64 oracle on each row's sequence;
    the windowed result differs from the unwindowed one (the window cut keys), and the window
    of 201 keys equals window_size=None. Decode steps (1, 4 rows) and chunked prefill (20)."""
    if backend == "triton" and paged and nq == 20:
        pytest.skip("interpreter time: the prefill route's paging is covered on the portable path")
    before, pads = [30, 41, 25], [5, 0, 3]
    kc, vc = _cache(before, pads, seed=70)
    q = seeded((3, nq, HQ, D), torch.float32, 72, DEVICE)
    k_new, v_new = (seeded((3, 1, HKV, D), torch.float32, s, DEVICE) for s in (73, 74))
    table = None
    if paged:
        kc, vc, table = page_pools(kc, vc, 16)
    kw = dict(cache_seqlens=_lens(before), cache_leftpad=_lens(pads), block_table=table, return_lse=True,
              backend=backend)
    # the append rewrites the same rows each call: every call sees one cache
    plain = _door(q, kc, vc, k_new, v_new, **kw)
    ref_k, ref_v = ((unpage(x, table) if paged else x) for x in (kc, vc))
    ref_k, ref_v = _shifted(ref_k, pads), _shifted(ref_v, pads)
    lengths = [n + 1 - p for n, p in zip(before, pads)]
    for left in (0, 6, 17, 200):
        got = _door(q, kc, vc, k_new, v_new, window_size=(left, 0), **kw)
        check_forward(*got, q, ref_k, ref_v, lengths, _oracle(left))
        if left < 17:
            assert not torch.allclose(got[0], plain[0]), "the window cut no key"
    torch.testing.assert_close(got, plain, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nq", [1, 4, 20])
def test_a_window_of_one_key_reads_the_query_own_key(backend, nq):
    """window_size=(0, 0): every query reads only the key at its own position (every head has
    the r = 1 pattern, which lists it), so out is that key's value row exactly, counted from
    the pad (written out here, independently of the oracle)."""
    before, pads = [30, 41, 25], [5, 0, 3]
    kc, vc = _cache(before, pads, seed=80)
    q = seeded((3, nq, HQ, D), torch.float32, 82, DEVICE)
    out = _door(q, kc, vc, cache_seqlens=_lens(before), cache_leftpad=_lens(pads), window_size=(0, 0),
                backend=backend)
    for b, n in enumerate(before):
        want = vc[b, n - nq:n].repeat_interleave(HQ // HKV, dim=1)   # (nq, HQ, D): query i at cache row n - nq + i
        torch.testing.assert_close(out[b], want, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- serving properties

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True])
def test_window_decode_without_host_sync(backend, paged):
    """A windowed decode step (2 rows, an append, cache_leftpad) runs under the no-host-sync
    guard and equals the unguarded call."""
    before, pads = [20, 33], [3, 0]
    kc, vc = _cache(before, pads, seed=90)
    q = seeded((2, 2, HQ, D), torch.float32, 92, DEVICE)
    k_new, v_new = (seeded((2, 2, HKV, D), torch.float32, s, DEVICE) for s in (93, 94))
    table = None
    if paged:
        kc, vc, table = page_pools(kc, vc, 16)
    kw = dict(cache_seqlens=_lens(before), cache_leftpad=_lens(pads), block_table=table, window_size=(9, 0),
              return_lse=True, backend=backend)
    kc2, vc2 = kc.clone(), vc.clone()
    _door(q, kc2.clone(), vc2.clone(), k_new, v_new, **kw)   # warm-up: cached device tables
    with no_host_sync():
        out = _door(q, kc, vc, k_new, v_new, **kw)
    want = _door(q, kc2, vc2, k_new, v_new, **kw)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close((kc, vc), (kc2, vc2), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_window_decode_serves_every_length_once(backend):
    """torch.compile(fullgraph=True, aot_eager) of a windowed decode step (the custom op carries
    the window): one frame for three (lengths, pads), equal to eager and to the oracle."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def step(q, kc, vc, k, v, lens, pads):
        return _door(q, kc, vc, k, v, cache_seqlens=lens, cache_leftpad=pads, window_size=(5, 0), return_lse=True,
                     backend=backend)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    q = seeded((2, 1, HQ, D), torch.float32, 100, DEVICE)
    k_new, v_new = (seeded((2, 1, HKV, D), torch.float32, s, DEVICE) for s in (101, 102))
    for before, pads in (([5, 30], [0, 7]), ([17, 9], [16, 1]), ([46, 20], [4, 0])):
        kc, vc = _cache(before, pads, seed=103)
        kc2, vc2 = kc.clone(), vc.clone()
        got = compiled(q, kc, vc, k_new, v_new, _lens(before), _lens(pads))
        torch.testing.assert_close(got, step(q, kc2, vc2, k_new, v_new, _lens(before), _lens(pads)), rtol=1e-6,
                                   atol=1e-6)
        check_forward(*got, q, _shifted(kc, pads), _shifted(vc, pads), [n + 1 - p for n, p in zip(before, pads)],
                      _oracle(5))
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 3 cache_seqlens values"


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_key_holds_the_window(backend):
    """Calls of one shape alternating windows (and none) each get their own window: the plan
    cache (ServePlan per serve_key) must not hand one window's plan to another."""
    before = [40, 27]
    kc, vc = _cache(before, [0, 0], seed=110)
    q = seeded((2, 1, HQ, D), torch.float32, 112, DEVICE)
    kw = dict(cache_seqlens=_lens(before), return_lse=True, backend=backend)
    windows = {"none": None, "3": (3, 0), "11": [11, 0]}   # a list too (FlashAttention takes either)
    first = {name: _door(q, kc, vc, window_size=w, **kw) for name, w in windows.items()}
    for name in ("3", "none", "11", "3"):
        torch.testing.assert_close(_door(q, kc, vc, window_size=windows[name], **kw), first[name], rtol=0, atol=0)
    assert not torch.allclose(first["3"][0], first["none"][0])
    assert not torch.allclose(first["3"][0], first["11"][0])
    for name, left in (("none", -1), ("3", 3), ("11", 11)):
        check_forward(*first[name], q, kc, vc, before, _oracle(left))


def test_paged_dilated_kv_cache_takes_the_window():
    """PagedDilatedKVCache.attend(window_size=) (the door's keyword): the window only drops
    keys, so the bounded cache (rows from the window start of the next query on) holds every
    key it reads; 3 sequences decoding 70 tokens (past the longest segment: pages freed) equal
    the float64 oracle over each sequence's whole history."""
    page, T = 8, 70
    cache = PagedDilatedKVCache(WS, RS, num_pages=3 * (64 // page + 2), page_size=page, num_kv_heads=HKV,
                                head_dim=D, device=DEVICE)
    q, k, v = (seeded((3, T, h, D), torch.float32, 120 + i, DEVICE) for i, h in enumerate((HQ, HKV, HKV)))
    for s in range(3):
        cache.admit(s)
    outs = []
    for t in range(T):
        outs.append(cache.attend([0, 1, 2], q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], window_size=(12, 0),
                                 backend="torch", return_lse=True))
    out = torch.cat([o[0] for o in outs], dim=1)
    lse = torch.cat([o[1] for o in outs], dim=2)
    check_forward(out, lse, q, k, v, [T] * 3, _oracle(12))


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_queries_take_the_window(backend):
    """Varlen queries (cu_seqlens_q: a 1-row decode, a 3-row draft) with window_size= equal the
    door per request."""
    before = [30, 41]
    kc, vc = _cache(before, [0, 0], seed=130)
    nq = [1, 3]
    q = seeded((sum(nq), HQ, D), torch.float32, 132, DEVICE)
    cu = _lens([0, 1, 4])
    out, lse = _door(q, kc, vc, cache_seqlens=_lens(before), cu_seqlens_q=cu, max_seqlen_q=3, window_size=(7, 0),
                     return_lse=True, backend=backend)
    for b, (a, n) in enumerate(((0, 1), (1, 3))):
        want = _door(q[None, a:a + n], kc[b:b + 1], vc[b:b + 1], cache_seqlens=_lens(before[b:b + 1]),
                     window_size=(7, 0), return_lse=True, backend=backend)
        torch.testing.assert_close((out[None, a:a + n], lse[None, :, a:a + n]), want, rtol=1e-6, atol=1e-6)
        check_forward(*want, q[None, a:a + n], kc[b:b + 1], vc[b:b + 1], [before[b]], _oracle(7))


# ----------------------------------------------------------------------------- errors

def test_window_argument_errors():
    """As on the training door: a window reaching later keys (right > 0, or -1 with a left
    bound, causal=False) is a ValueError naming it; not a pair of ints a TypeError; out of
    range a ValueError. causal=True sets right to 0 (FlashAttention's rule)."""
    kc, vc = _cache([9, 12], [0, 0], seed=140)
    q = seeded((2, 1, HQ, D), torch.float32, 142, DEVICE)
    kw = dict(cache_seqlens=_lens([9, 12]), backend="torch")
    with pytest.raises(ValueError, match=r"window_size=\(4, 2\) reaches 2 later keys: only causal windows"):
        _door(q, kc, vc, window_size=(4, 2), causal=False, **kw)
    with pytest.raises(ValueError, match=r"window_size=\(4, -1\) reaches every later key"):
        _door(q, kc, vc, window_size=(4, -1), causal=False, **kw)
    for bad in (4, (4,), (4.0, 0), (True, 0), "4,0"):
        with pytest.raises(TypeError, match=r"window_size must be a pair of ints \(left, right\)"):
            _door(q, kc, vc, window_size=bad, **kw)
    with pytest.raises(ValueError, match=r"window_size's left must be -1 \(unbounded\) or in \[0, 2\^31 - 1\), got -2"):
        _door(q, kc, vc, window_size=(-2, 0), **kw)
    torch.testing.assert_close(_door(q, kc, vc, window_size=(4, 2), **kw), _door(q, kc, vc, window_size=(4, 0), **kw),
                               rtol=0, atol=0)
