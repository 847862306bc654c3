"""Decode context parallelism (issue 33 item 4): the serve doors with group= on gloo worlds of 2
and 4 ranks equal the single-device door (within float32 rounding) and the float64 definition,
for dense (a full block layout), dilated and block-sparse attention, paged and contiguous caches,
appends, sinks, softcap, leftpad, rotary, cache_batch_idx, a sliding window, an FP8 cache, decode steps of 1 and 4
queries, the indexed door too; a rank with no key for a query
contributes nothing; appends land on the rank owning their page only; argument errors.
One spawned world per size runs every case (tests/helpers/dcp_worker.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_dilated import dilated_attention_with_kvcache
from triton_dilated.ops.common.context_parallel import (append_owned, contiguous_pool, local_block_table,
                                                        shard_contiguous_cache, shard_paged_cache)
from tests.helpers import dcp_worker
from tests.helpers.reference import FLOOR, assert_rule
from tests.helpers.ring_worker import spawn_world

CASES = [
    dict(kind="dense", cache="paged", Nq=1, append=True),
    dict(kind="dense", cache="contiguous", Nq=4, append=True, sinks=True, softcap=2.0),
    dict(kind="dilated", cache="paged", Nq=1, append=True, sinks=True),
    dict(kind="dilated", cache="paged", Nq=4, append=True, softcap=2.0, seed=1),
    dict(kind="dilated", cache="paged", Nq=4, seqlens=[40, 12], seed=2),                  # no append
    dict(kind="dilated", cache="contiguous", Nq=4, append=True, seqlens=[37, 3], partial=True),
    dict(kind="dilated", cache="contiguous", Nq=1, B_cache=3, batch_idx=[2, 0], append=True, seed=3),
    dict(kind="dilated", cache="contiguous", Nq=4, append=True, leftpad=[5, 2], sinks=True, seed=4),
    dict(kind="dilated", cache="contiguous", Nq=4, append=True, rotary=True, seed=5),
    dict(kind="dilated", cache="paged", Nq=4, append=True, window=9, seed=14),            # window_size=(9, 0)
    dict(kind="dilated", cache="contiguous", Nq=1, append=True, leftpad=[5, 2], window=20, sinks=True, seed=15),
    dict(kind="dilated", cache="contiguous", Nq=1, append=True, mesh=True, no_sync=True, seed=6),
    dict(kind="layout", cache="paged", Nq=4, append=True, sinks=True, softcap=2.0, no_sync=True),
    dict(kind="dilated", cache="contiguous", Nq=4, append=True, fp8=True, seed=12),
    dict(kind="layout", cache="paged", Nq=4, append=True, half=True, sinks=True, seed=13),
    dict(kind="layout", cache="contiguous", Nq=1, append=True, seqlens=[63, 20], seed=7),
    dict(kind="indexed", cache="paged", Nq=4, append=True, sinks=True, softcap=2.0, seed=10, no_sync=True),
    dict(kind="indexed", cache="contiguous", Nq=1, append=True, seed=11),
    dict(kind="indexed", cache="contiguous", Nq=4, append=True, B_cache=3, batch_idx=[2, 0], leftpad=[5, 2],
         rotary=True, seed=16, no_sync=True),                                        # FlashAttention's arguments
    dict(kind="indexed", cache="paged", Nq=1, append=True, leftpad=[3, 1], rotary=True, seed=17),
    dict(kind="paged_cache", cache="paged"),                                             # PagedDilatedKVCache(group=)
    # the Triton interpreter (world 2 only)
    dict(kind="dilated", cache="paged", Nq=1, append=True, B=1, backend="triton", sinks=True, seed=8, no_sync=True),
    dict(kind="layout", cache="contiguous", Nq=4, append=True, B=1, backend="triton", seed=9),            # interpreter
]


def cases_of(world):
    """The cases a world runs: the Triton-interpreter ones (slow) in world 2 only."""
    return [c for c in CASES if world == 2 or c.get("backend") != "triton"]


@pytest.fixture(scope="module", params=[2, 4])
def world_results(request):
    world = request.param
    return world, spawn_world(dcp_worker.worker, world, lambda queue: (cases_of(world), queue), 300)


@pytest.mark.gloo
def test_dcp_equals_one_device(world_results):
    """Every rank's merged (out, lse) equals the single-device door within float32 rounding, is
    the same on every rank bit for bit, and meets the rule against the float64 definition; each
    rank's shard after the appends equals its shard of the single-device cache after them."""
    world, results = world_results
    assert sorted(results) == list(range(world))
    for rank, (status, payload) in results.items():
        assert status == "ok", payload
    first = results[0][1]
    for rank, (_, payload) in results.items():
        assert len(payload) == len(cases_of(world))
        for case, got, got0 in zip(cases_of(world), payload, first):
            what = f"world {world} rank {rank} {case}"
            if case["kind"] == "paged_cache":
                check_paged_cache(what, world, results, got)
                continue
            out, lse = torch.from_numpy(got["out"]), torch.from_numpy(got["lse"])
            out1, lse1 = torch.from_numpy(got["out1"]), torch.from_numpy(got["lse1"])
            # float16: the ranks' partial outs are rounded to float16 before the merge (one more rounding)
            tol = dict(rtol=1e-5, atol=2e-6) if out.dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(out, out1, **tol, msg=lambda m: f"{what}: out {m}")
            torch.testing.assert_close(lse, lse1, rtol=1e-5, atol=2e-6, msg=lambda m: f"{what}: lse {m}")
            assert np.array_equal(got["out"], got0["out"]) and np.array_equal(got["lse"], got0["lse"]), what
            assert got["appended"], f"{what}: the shard after the appends differs"
            if rank == 0:
                ref_out, ref_lse = torch.from_numpy(got["ref_out"]), torch.from_numpy(got["ref_lse"])
                floor = FLOOR[out.dtype]
                assert_rule(f"{what}: out", out.double(), ref_out, out1.double(), factor=2, floor=floor)
                assert_rule(f"{what}: lse", lse.double(), ref_lse, lse1.double(), factor=2, floor=floor)


def check_paged_cache(what, world, results, got):
    """PagedDilatedKVCache(group=): every step's output equals the single-device cache's, and
    the ranks' pages add up to the single-device cache's (each page held once)."""
    assert len(got["outs"]) == len(got["outs1"]) == 42
    for i, (o, o1) in enumerate(zip(got["outs"], got["outs1"])):
        np.testing.assert_allclose(o, o1, rtol=1e-5, atol=2e-6, err_msg=f"{what}: step output {i}")
    i = next(i for i, c in enumerate(cases_of(world)) if c["kind"] == "paged_cache")
    held = np.sum([payload[i]["held"] for _, payload in results.values()], axis=0)
    assert held.tolist() == got["held1"] and min(held) > 0, (what, held, got["held1"])


@pytest.mark.gloo
def test_rank_without_keys_contributes_nothing(world_results):
    """Row 1 of the "partial" case holds 7 keys, all on page 0 (rank 0): every other rank's own
    result for it is out 0, lse -inf (so the merge weights it 0), rank 0's is the whole row."""
    world, results = world_results
    i = next(i for i, c in enumerate(cases_of(world)) if c.get("partial"))
    for rank, (_, payload) in results.items():
        got = payload[i]
        if rank == 0:
            assert np.isfinite(got["part_lse"][1]).all()
            np.testing.assert_allclose(got["part_out"][1], got["out"][1], rtol=1e-5, atol=2e-6)
        else:
            assert np.all(got["part_lse"][1] == -np.inf) and np.all(got["part_out"][1] == 0), rank
            assert np.isfinite(got["part_lse"][0]).any(), rank   # row 0 (40 keys): some on every rank


@pytest.mark.gloo
def test_dcp_argument_errors():
    """Errors name the argument, the expectation and what came, on every rank alike."""
    results = spawn_world(dcp_worker.errors_worker, 2, lambda queue: (queue,), 120)
    assert sorted(results) == [0, 1]
    errors = [payload for status, payload in results.values()]
    for status, payload in results.values():
        assert status == "ok", payload
    assert errors[0] == errors[1]
    expect = ["ValueError: dilated_attention_with_kvcache(group=...): decode context parallelism runs decode steps "
              "of at most 16 query rows, got q with 17",
              "ValueError: dilated_attention_with_kvcache(group=...): validate must be False",
              "ValueError: dilated_attention_with_kvcache(group=...) is forward only",
              "TypeError: dilated_attention_with_kvcache: group must be a torch.distributed ProcessGroup or a 1-D "
              "DeviceMesh, got str",
              "ValueError: with group=, a contiguous cache's rows Nk_local = 64 must be a multiple of dcp_page_size "
              "= 12",
              "ValueError: dcp_page_size must be",
              "ValueError: cache_batch_idx maps batch rows to rows of a contiguous cache",
              "ValueError: sinks must have shape (Hq,) = (2,)",
              "ValueError: k_cache and v_cache must hold B = 2 rows (q's batch; or give cache_batch_idx), got 1 and 1",
              None, None, None]
    assert len(errors[0]) == len(expect)
    for got, want in zip(errors[0], expect):
        assert (got is None) if want is None else (got is not None and got.startswith(want)), (got, want)


def test_group_needs_initialised_distributed():
    q, kc = torch.zeros(1, 1, 2, 8), torch.zeros(1, 32, 2, 8)
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
        dilated_attention_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([3], dtype=torch.int32),
                                       segment_lengths=[8], dilation_rates=[1], group=object())


# ----------------------------------------------------------------------------- the helpers, one process

def test_local_block_table_and_contiguous_pool():
    table = torch.arange(10, dtype=torch.int32).view(2, 5)
    assert local_block_table(table, 1, 2).tolist() == [[-1, 1, -1, 3, -1], [-1, 6, -1, 8, -1]]
    cache = torch.arange(3 * 16, dtype=torch.float32).view(3, 16, 1, 1)     # 3 rows of 4 local pages of 4
    kp, vp, tab = contiguous_pool(cache, cache, torch.tensor([2, 5], dtype=torch.int32), 1, 3, 4, 2)
    assert kp.shape == (12, 4, 1, 1) and kp.data_ptr() == cache.data_ptr()   # a view: appends land in place
    # row 2's page j lives at local page 2 * 4 + j // 3 when j % 3 == 1; cache row 5 does not exist
    assert tab.tolist() == [[-1, 8, -1, -1, 9, -1, -1, 10, -1, -1, 11, -1], [-1] * 12]


def test_shards_partition_the_cache():
    """The shards of every rank hold each page once: contiguous and paged shards back together."""
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 48, 1, 2, generator=g)
    parts = [shard_contiguous_cache(cache, r, 3, 4) for r in range(3)]
    pages = torch.stack([p.view(2, 4, 4, 1, 2) for p in parts], dim=2).reshape(2, 48, 1, 2)
    assert torch.equal(pages, cache)
    pool = torch.randn(7, 4, 1, 2, generator=g)
    table = torch.tensor([[3, 0, 6, -1], [5, 1, 2, 4]], dtype=torch.int32)
    for r in range(2):
        local, tab = shard_paged_cache(pool, table, r, 2)
        for b in range(2):
            for j in range(4):
                if j % 2 != r or table[b, j] < 0:
                    assert tab[b, j] == -1
                else:
                    assert torch.equal(local[tab[b, j]], pool[table[b, j]])


def test_append_owned_writes_own_pages_only():
    """New rows straddling pages of two ranks: each rank writes the rows on its pages, none other;
    a batch row whose pages are all elsewhere writes nothing; rows past the capacity nothing."""
    pool = torch.zeros(4, 4, 1, 1)
    table = torch.tensor([[0, -1, 1, -1], [-1, 2, -1, 3], [-1, 2, -1, 3]], dtype=torch.int32)
    k = torch.arange(1, 3 * 3 + 1, dtype=torch.float32).view(3, 3, 1, 1)
    v = -k
    vpool = torch.zeros_like(pool)
    append_owned(pool, vpool, k, v, torch.tensor([2, 2, 15], dtype=torch.int32), table)
    want = torch.zeros(4, 4)
    want[0, 2:4] = torch.tensor([1.0, 2.0])        # row 0: positions 2, 3 on page 0; position 4 elsewhere
    # row 1: positions 2, 3 on column 0 (elsewhere), position 4 on column 1 = page 2 row 0
    want[2, 0] = 6.0
    assert torch.equal(pool.view(4, 4), want) and torch.equal(vpool.view(4, 4), -want)   # row 2: past the capacity
    none = torch.zeros(4, 4, 1, 1)
    append_owned(none, none.clone(), k[:1], v[:1], torch.tensor([4], dtype=torch.int32), table[1:2] * 0 - 1)
    assert torch.equal(none, torch.zeros(4, 4, 1, 1))
