"""PagedDilatedKVCache (issue 21 item 3): a page pool shared by interleaved sequences, each
holding only the pages its next query can read, against one contiguous DilatedKVCache per
sequence (the bounded cache, itself tested against the float64 oracle), for thousands of
token steps; memory asserted at every step; admission, eviction and errors."""
from __future__ import annotations

import random

import pytest
import torch

from triton_dilated import DilatedKVCache, PagedDilatedKVCache, dilated_attention_naive
from tests.conftest import DEVICE
from tests.helpers.reference import seeded

WS, RS = [16, 32, 64], [1, 2, 4]
H, HKV, D, PAGE = 4, 2, 8, 16


def _token(seed, n=1):
    q = seeded((1, n, H, D), torch.float32, 3 * seed, DEVICE)
    k = seeded((1, n, HKV, D), torch.float32, 3 * seed + 1, DEVICE)
    v = seeded((1, n, HKV, D), torch.float32, 3 * seed + 2, DEVICE)
    return q, k, v


def test_interleaved_sequences_equal_contiguous_caches_in_bounded_memory():
    """8 sequences admitted at different times, each step a random subset decoding one token
    together (over 2,000 token steps, past 4x the longest segment for the oldest), one sequence
    evicted and a new one admitted mid-way: every output equals its own contiguous bounded
    cache's; every sequence holds at most max(w) / page pages (one token a step: its segment's
    rows), reached, and the pool never more than that per sequence; evicted pages are reused."""
    rng = random.Random(0)
    cache = PagedDilatedKVCache(WS, RS, num_pages=8 * (64 // PAGE), page_size=PAGE, num_kv_heads=HKV,
                                head_dim=D, device=DEVICE)
    refs, seed, steps, worst = {}, 0, 0, 0
    max_pages = 64 // PAGE
    for s in range(8):
        cache.admit(s)
        refs[s] = DilatedKVCache(WS, RS)
    active = [0, 1, 2]
    for step in range(600):
        if step in (40, 90, 150, 220, 300):     # staggered admission: different lengths
            active.append(len(active))
        if step == 400:                         # evict one, admit a new one in its pages
            cache.evict(1)
            active.remove(1)
            cache.admit("late")
            refs["late"] = DilatedKVCache(WS, RS)
            active.append("late")
        ids = sorted(rng.sample(active, rng.randint(1, len(active))), key=str)
        toks = [_token(seed + i) for i in range(len(ids))]
        seed += len(ids)
        q, k, v = (torch.cat([t[j] for t in toks]) for j in range(3))
        got = cache.attend(ids, q, k, v, backend="torch", return_lse=True)
        for i, s in enumerate(ids):
            want = refs[s].attend(*toks[i], backend="torch")
            torch.testing.assert_close(got[0][i:i + 1], want, rtol=1e-5, atol=1e-6)
        steps += len(ids)
        held = {s: cache.pages_held(s) for s in cache.pages}
        worst = max(worst, *held.values())
        assert all(n <= max_pages for n in held.values()), held
        assert cache.free_pages + sum(held.values()) == 8 * max_pages
    assert steps > 2000 and max(cache.seen.values()) > 4 * max(WS)
    assert worst == max_pages


def test_paged_cache_matches_the_oracle_with_several_layers_and_tokens():
    """Two layers, two tokens per step (a draft), both backends: each layer's output is the
    float64 oracle's over the sequence's whole history (the interpreter checks the late steps
    only, past the first dropped pages)."""
    for backend in ("torch", "triton"):
        cache = PagedDilatedKVCache(WS, RS, num_pages=24, page_size=PAGE, num_kv_heads=HKV, head_dim=D,
                                    device=DEVICE, num_layers=2)
        cache.admit("a")
        cache.admit("b")
        hist = {(s, layer): [] for s in "ab" for layer in range(2)}
        for t in range(0, 90, 2):
            ids = ["a", "b"] if t % 4 == 0 else ["b"]
            step = cache.begin(ids, 2)
            for layer in range(2):
                toks = [_token(1000 * layer + 10 * t + i, n=2) for i in range(len(ids))]
                q, k, v = (torch.cat([x[j] for x in toks]) for j in range(3))
                if backend == "triton" and t < 70:   # write the rows only (the torch path computes them)
                    step.attend(q, k, v, layer, backend="torch")
                    out = None
                else:
                    out = step.attend(q, k, v, layer, backend=backend)
                for i, s in enumerate(ids):
                    hist[s, layer].append(toks[i][1:])
                    if out is None:
                        continue
                    kk, vv = (torch.cat([h[j] for h in hist[s, layer]], dim=1) for j in range(2))
                    n = kk.shape[1]
                    qf = torch.cat([q.new_zeros(1, n - 2, H, D), toks[i][0]], dim=1)
                    ref, _ = dilated_attention_naive(qf.double(), kk.double(), vv.double(), WS, RS, causal=True)
                    torch.testing.assert_close(out[i:i + 1].double(), ref[:, -2:], rtol=1e-5, atol=1e-5)
            step.end()
        assert cache.seen["b"] == 90 and cache.pages_held("b") <= 64 // PAGE + 1


def test_admission_eviction_and_errors():
    cache = PagedDilatedKVCache(WS, RS, num_pages=3, page_size=PAGE, num_kv_heads=HKV, head_dim=D, device=DEVICE)
    cache.admit("a")
    with pytest.raises(ValueError, match="already admitted"):
        cache.admit("a")
    with pytest.raises(ValueError, match="not admitted"):
        cache.begin(["b"])
    with pytest.raises(ValueError, match="distinct"):
        cache.begin(["a", "a"])
    q, k, v = _token(0, n=1)
    for t in range(48):
        cache.attend(["a"], q, k, v, backend="torch")
    assert cache.pages_held("a") == 3 and cache.free_pages == 0
    cache.admit("b")
    with pytest.raises(ValueError, match="page pool is exhausted"):
        cache.begin(["b"])
    cache.evict("a")
    assert cache.free_pages == 3
    step = cache.begin(["b"])
    step.end()
    with pytest.raises(ValueError, match="has ended"):
        step.attend(q, k, v)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        PagedDilatedKVCache(WS, RS, num_pages=3, page_size=0, num_kv_heads=HKV, head_dim=D)


def test_stale_steps_and_second_begins_are_refused():
    """Hardening round 3: a step kept past evict() wrote into a page that belonged to another
    sequence by then, and two begin()s of one sequence counted its length twice with one row
    written. Now the stale step raises without touching the pool, a second begin raises until
    the first step ends or is cancelled, and a float64 pool is refused."""
    cache = PagedDilatedKVCache(WS, RS, num_pages=4, page_size=PAGE, num_kv_heads=HKV, head_dim=D, device=DEVICE)
    q, k, v = _token(1)
    cache.admit("a")
    stale = cache.begin(["a"])
    cache.evict("a")
    cache.admit("b")
    step = cache.begin(["b"])
    assert step.block_table[0, 0] == stale.block_table[0, 0]    # b holds a's page now
    step.attend(q, k, v, backend="torch")
    step.end()
    before = [p.clone() for p in cache.k_pools + cache.v_pools]
    for call in (lambda: stale.attend(q, 2 * k, 2 * v, backend="torch"), stale.end):
        with pytest.raises(ValueError, match="'a' was evicted after this step began"):
            call()
    assert all(torch.equal(p, b) for p, b in zip(cache.k_pools + cache.v_pools, before))
    cache.admit("a")      # admitted again: the old step stays stale
    with pytest.raises(ValueError, match="was evicted"):
        stale.attend(q, k, v, backend="torch")

    first = cache.begin(["b"])
    with pytest.raises(ValueError, match="'b' has a step in progress"):
        cache.begin(["a", "b"])
    assert cache.seen["b"] == 1
    first.cancel()
    assert cache.seen["b"] == 1
    again = cache.begin(["a", "b"])
    again.attend(torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v]), backend="torch")
    again.end()
    assert cache.seen == {"b": 2, "a": 1}

    with pytest.raises(TypeError, match="dtype must be one of float16, bfloat16, float32, float8_e4m3fn.*float64"):
        PagedDilatedKVCache(WS, RS, num_pages=4, page_size=PAGE, num_kv_heads=HKV, head_dim=D, dtype=torch.float64)


def test_repr_says_sequences_pages_and_pool():
    """Issue 34 item 5: the repr shows the sequences, pages held and free, the pool's page size,
    dtype, device and layers (it was object.__repr__), from host state only."""
    cache = PagedDilatedKVCache(WS, RS, num_pages=6, page_size=PAGE, num_kv_heads=HKV, head_dim=D, device=DEVICE,
                                num_layers=2, dtype=torch.float16)
    assert repr(cache) == (f"PagedDilatedKVCache(sequences=0, pages_held=0, free_pages=6, num_pages=6, "
                           f"page_size={PAGE}, dtype=torch.float16, device={cache.k_pools[0].device}, num_layers=2, "
                           f"num_kv_heads={HKV}, head_dim={D}, segment_lengths={WS}, dilation_rates={RS})")
    cache.admit("a")
    cache.admit("b")
    cache.begin(["a", "b"], PAGE + 1).cancel()      # two pages each
    assert "sequences=2, pages_held=4, free_pages=2, num_pages=6," in repr(cache)
    assert cache.free_pages == 6 - cache.pages_held("a") - cache.pages_held("b")
    assert PagedDilatedKVCache.free_pages.__doc__ and "begin" in PagedDilatedKVCache.free_pages.__doc__
