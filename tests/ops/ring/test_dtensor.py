"""sequence_parallel_attention (issue 22 item 5): DTensors sharded on the sequence of a 1-D
mesh (ring or Ulysses) or a 2-D mesh (ring x Ulysses, USP), and a batch-sharded (data
parallel) mesh dimension beside a sequence one, on gloo worlds of 2 and 4 spawned
processes. The full result (DTensor.full_tensor of out, lse and the gradients of the
DTensor leaves, through a loss on out and lse) against the float64 oracle of the full
sequence by the tolerance rule; the placements that come back; local shards with mesh=;
and every unsupported placement or argument raising a ValueError/TypeError that names it."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from tests.helpers.dtensor_worker import seq_order, worker
from tests.helpers.reference import FLOOR, assert_rule_all
from tests.helpers.ring_checks import case_references
from tests.helpers.ring_worker import spawn_world

C = dict(B=1, N=48, D=8)
SEQ1, SEQ2 = ["seq"], ["seq", "seq"]
CASES = {
    2: [
        dict(C, kind="dense", Hq=2, Hkv=1, causal=True, mesh=(2,), names=("ring",), placements=SEQ1, shards=2),
        dict(C, kind="dilated", Hq=4, Hkv=2, causal=True, ws=[8, 48], rs=[1, 3], mesh=(2,), names=("ulysses",),
             placements=SEQ1, shards=2, balance="zigzag"),
        dict(C, kind="dilated", Hq=4, Hkv=1, causal=False, ws=[4, 24, 48], rs=[1, 2, 4], offsets="blocked",
             mesh=(2,), names=("cp",), placements=SEQ1, shards=2, scheme="ring", balance="zigzag",
             kw=dict(comm="allgather")),
        dict(C, kind="layout", N=96, Hq=2, Hkv=2, causal=True, bs=16, mesh=(2,), names=("cp",), placements=SEQ1,
             shards=2, scheme="ulysses", kw=dict(backend="torch")),
        dict(C, kind="dilated", Hq=4, Hkv=2, causal=True, ws=[8, 16, 48], rs=[2, 5, 3], mode="head_groups",
             mesh=(2,), names=("ring",), placements=SEQ1, shards=2, local=True),
    ],
    4: [
        dict(C, kind="dilated", Hq=4, Hkv=2, causal=True, ws=[8, 48], rs=[1, 3], mesh=(2, 2),
             names=("ring", "ulysses"), placements=SEQ2, shards=4, balance="zigzag"),
        dict(C, kind="dense", Hq=4, Hkv=1, causal=False, mesh=(2, 2), names=None, placements=SEQ2, shards=4),
        dict(C, kind="dilated", B=2, Hq=2, Hkv=1, causal=True, ws=[8, 24], rs=[1, 2], mesh=(2, 2),
             names=("dp", "cp"), placements=["batch", "seq"], shards=2, scheme="ring"),
        dict(C, kind="dilated", Hq=4, Hkv=4, causal=True, ws=[4, 48], rs=[1, 4], mesh=(4,), names=("ulysses",),
             placements=SEQ1, shards=4, kw=dict(backend="torch")),
        dict(C, kind="dense", Hq=4, Hkv=2, causal=True, mesh=(2, 2), names=("ring", "ulysses"), placements=SEQ2,
             shards=4, local=True),
    ],
}


@pytest.fixture(scope="module", params=[2, 4])
def world_results(request):
    world = request.param
    return world, CASES[world], spawn_world(worker, world, lambda queue: (CASES[world], queue), 400)


def test_dtensor_matches_oracle(world_results):
    world, cases, results = world_results
    assert sorted(results) == list(range(world))
    for rank, (status, payload) in results.items():
        assert status == "ok", payload
    refs = [case_references(case) for case in cases]
    for i, (case, ((oracle, _), (same, _))) in enumerate(zip(cases, refs)):
        order = seq_order(case, case["shards"])
        got0 = results[0][1][i]
        for rank in range(1, world):   # full_tensor gathers the same tensor on every rank
            assert all((results[rank][1][i][n] == got0[n]).all() for n in ("out", "lse", "dq", "dk", "dv"))
        # the DTensor's sequence is in `order` (zigzag: the shards' rows in rank order)
        perm = lambda x, j: x[:, :, order] if j == 1 else x[:, order]  # noqa: E731
        assert_rule_all([torch.from_numpy(got0[n]) for n in ("out", "lse", "dq", "dk", "dv")],
                        [perm(x, j) for j, x in enumerate(oracle)], [perm(x, j) for j, x in enumerate(same)],
                        floor=FLOOR[torch.float32], what=f"world {world} {case}: ")
        want = tuple(Shard(0) if p == "batch" else Shard(1) for p in case["placements"])
        assert got0["placements"] == (repr(want), repr(tuple(Shard(2) if p == Shard(1) else p for p in want)),
                                      repr(want))


def test_unsupported_placements_and_arguments_raise(world_results):
    world, cases, results = world_results
    errs = [payload[-1] for _, payload in results.values()]
    assert all(e == errs[0] for e in errs), errs      # the same error on every rank
    e = errs[0]
    assert all(x is not None for x in e[:11]), e
    assert e[11:] == ([None, None] if world == 2 else []), e     # a 1-D DeviceMesh where a group goes
    assert e[0].startswith("ValueError: q: placement Replicate()") and "expected Shard(1)" in e[0]
    assert e[1].startswith("ValueError: q: placement Shard(dim=2)")
    assert e[2].startswith("ValueError: q: the sequence length 7 does not split evenly")
    assert e[3].startswith("ValueError: k must have q's placements")
    assert e[4].startswith("TypeError: k must be a DTensor like q, got Tensor")
    assert e[5].startswith("TypeError: sequence_parallel_attention takes mesh= (or DTensors), not group=")
    assert e[6].startswith("TypeError: q, k, v must be this rank's local shards") and "got a DTensor" in e[6]
    assert e[7].startswith("TypeError: mesh must be a DeviceMesh") and "got NoneType" in e[7]
    if world == 2:
        assert e[8].startswith("ValueError: scheme: q's device mesh ('cp',) has one sequence-parallel mesh dim")
        assert e[9].startswith("ValueError: scheme:") and "got 'usp'" in e[9]
        assert e[10].startswith("ValueError: scheme must be one of")
    else:
        assert e[8].startswith("ValueError: q's device mesh ('ulysses', 'ring'): the mesh dimension 'ring' must "
                               "come before 'ulysses'")
        assert e[9].startswith("ValueError: ring_attention: a DeviceMesh given as a group must have one dim")
        assert e[10].startswith("ValueError: scheme: mesh ('ring', 'ulysses') has two sequence-parallel")
