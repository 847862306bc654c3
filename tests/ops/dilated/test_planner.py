"""The dilated kernels' host planner (ops/dilated/plan.py), issue 13 items 5 and 9: the
candidate tile strides are built in polynomial time (32 distinct rates plan in seconds),
and a packed batch (new cu_seqlens every step) is planned in a fixed number of vectorised
passes, not one pass per (head, document, candidate stride). No kernel runs here."""
from __future__ import annotations

import itertools
import math
import random
import time

import numpy as np
import pytest

from triton_dilated.ops.dilated import plan
from triton_dilated.ops.dilated.patterns import head_offsets
from triton_dilated.ops.dilated.plan import build_items, key_unit_triples, query_unit_triples


def _subset_lcms(rates, limit):
    """Every subset's lcm up to limit, by enumeration (the definition; small inputs only)."""
    out = {1}
    for k in range(1, len(rates) + 1):
        for subset in itertools.combinations(rates, k):
            if math.lcm(*subset) <= limit:
                out.add(math.lcm(*subset))
    return sorted(out)


@pytest.mark.parametrize("rates,limit", [((1, 2, 4, 6, 12), 2048), ((3, 5, 7, 10, 14, 15, 21), 500),
                                         ((2, 3, 4, 5, 6, 8, 9, 12, 16, 18, 24), 100), ((7,), 3), ((1,), 0)])
def test_candidate_strides_are_the_subset_lcms(rates, limit):
    assert plan._candidate_strides(rates, limit) == _subset_lcms(sorted(set(rates)), max(limit, 1))


def test_candidate_strides_32_distinct_rates_in_seconds():
    """2^32 subsets: enumerating them took about an hour; the incremental lcm set does not."""
    t = time.perf_counter()
    strides = plan._candidate_strides(range(2, 34), 4096)
    assert time.perf_counter() - t < 5.0
    assert strides[0] == 1 and max(strides) <= 4096 and 2 * 3 * 5 * 7 * 11 in strides


BLOCK = 32


def _check_coverage(n, units, items, full, doc_bounds):
    """Every row a unit uses lies in exactly one tile of that unit (a tile may hold masked
    rows of another residue, never a row twice); tiles stay inside one document and one
    segment of every pattern (segments restart at each document)."""
    seen = np.zeros((len(units), n), dtype=np.int64)
    for first, end, unit, T, d0, d1 in items.tolist():
        assert (d0, d1) in set(zip(doc_bounds[:-1], doc_bounds[1:])) and d0 <= first < end <= d1
        rows = np.arange(first, min(end, first + T * BLOCK), T)
        seen[unit, rows] += 1
        for w, _, _ in units[unit]:
            assert (rows.min() - d0) // w == (rows.max() - d0) // w
    used = np.zeros((len(units), n), dtype=bool)
    for d0, d1 in zip(doc_bounds[:-1], doc_bounds[1:]):
        pos = np.arange(d1 - d0)
        for u, triples in enumerate(units):
            for w, r, o in triples:
                used[u, d0:d1] |= (pos - pos // w * w) % r == o
    assert seen.max() <= 1 and (seen.astype(bool) | ~used).all()
    assert full == bool(seen.all())


@pytest.mark.parametrize("causal,keys_side", [(False, False), (True, True)], ids=["queries", "causal-keys"])
def test_32_distinct_rates_plan_in_seconds(causal, keys_side):
    """Issue 13 item 5: one head signature with 32 distinct rates (the shortest segment, 2048,
    bounds the strides) plans in seconds and covers every row once."""
    rates = tuple(range(1, 33))
    patterns = tuple((2048 * (1 + i % 2), r) for i, r in enumerate(rates))
    n, H = 4096, 2
    table = head_offsets(H, patterns, "longnet", "modulo")
    units = key_unit_triples(patterns, table, 1) if keys_side else query_unit_triples(patterns, table)
    t = time.perf_counter()
    items, full = build_items.__wrapped__(n, units, BLOCK, BLOCK, causal, keys_side)
    assert time.perf_counter() - t < 20.0
    _check_coverage(n, units, items, full, (0, n))


def _random_docs(rng, n, n_docs, empty=False):
    cuts = sorted(rng.sample(range(1, n), n_docs - 1))
    bounds = [0] + cuts + [n]
    if empty:
        bounds.insert(2, bounds[1])
    return tuple(bounds)


CASES = [  # (n, patterns, H, Hkv, mode, offsets)
    (300, ((32, 1), (64, 2), (128, 4)), 4, 2, "longnet", "modulo"),
    (257, ((7, 3), (20, 2), (64, 4)), 6, 3, "longnet", "blocked"),
    (200, ((16, 1), (48, 3), (200, 2)), 5, 1, "head_groups", "modulo"),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("causal", [False, True])
def test_packed_plan_is_the_per_document_plans(case, causal):
    """Planning a packed batch at once gives exactly the items of planning each document
    alone (shifted to its start), for the query and the key side; coverage holds."""
    n, patterns, H, Hkv, mode, offsets = CASES[case]
    table = head_offsets(H, patterns, mode, offsets)
    rng = random.Random(case)
    for keys_side, units in ((False, query_unit_triples(patterns, table)),
                             (True, key_unit_triples(patterns, table, Hkv))):
        for bounds in (_random_docs(rng, n, 5), _random_docs(rng, n, 9, empty=True)):
            items, full = build_items(n, units, BLOCK, BLOCK, causal, keys_side, bounds)
            _check_coverage(n, units, items, full, bounds)
            parts, fulls = [], []
            for d0, d1 in zip(bounds[:-1], bounds[1:]):
                if d1 > d0:
                    one, f = build_items(d1 - d0, units, BLOCK, BLOCK, causal, keys_side)
                    one = one.astype(np.int64)
                    one[:, [0, 1, 4, 5]] += d0
                    parts.append(one)
                    fulls.append(f)
            want = np.concatenate(parts)
            key = lambda a: a[np.lexsort(a.T[::-1])]  # noqa: E731
            assert np.array_equal(key(items.astype(np.int64)), key(want)) and full == all(fulls)


def test_new_cu_seqlens_plan_cost_does_not_grow_with_heads_and_documents(monkeypatch):
    """Issue 13 item 9: a new cu_seqlens every step re-planned every (head, document,
    candidate stride) one numpy pass at a time (~54 ms per call at N = 64K, H = 16, and
    seconds with many documents). The planner now makes one vectorised pass per candidate
    stride and head signature, whatever the number of heads and documents."""
    n, H = 1 << 16, 16
    patterns = ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16))
    table = head_offsets(H, patterns, "longnet", "modulo")
    units = query_unit_triples(patterns, table)
    calls = []
    real = plan._tiles

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)
    monkeypatch.setattr(plan, "_tiles", counting)
    rng = random.Random(0)
    bounds = _random_docs(rng, n, 64)
    t = time.perf_counter()
    items, full = build_items.__wrapped__(n, units, 128, 64, True, False, bounds)
    elapsed = time.perf_counter() - t
    n_candidates = len(plan._candidate_strides([r for _, r in patterns], 2048))
    assert len(calls) == n_candidates + 1      # choosing T (per candidate), then the tiles
    assert elapsed < 2.0, f"{elapsed * 1e3:.0f} ms"
    assert items.shape[0] > 0 and items[:, 4].min() == 0 and items[:, 5].max() == n
