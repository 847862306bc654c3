"""ulysses_attention (issue 22 items 2 and 3) on gloo worlds of 1-4 spawned processes: every
rank's shard of out, lse and the gradients (through a loss on both) against the float64
oracle's shard of the full-sequence call, by the tolerance rule; dense, dilated (both offset
rules, head groups), block-sparse (a per-head layout), causal and not, GQA with more and
fewer key/value heads than ranks, contiguous and zigzag shards, the Triton kernels
(interpreter) and the portable backend; 2-D (Ulysses x ring) on a 2 x 2 grid. The
all-to-alls alone: a round trip, and their adjoint property. Arguments that differ across
ranks: every rank raises."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.ring_checks import compare_with_oracle, run_world
from tests.helpers.ring_worker import spawn_world, ulysses_errors_worker

U = dict(fn="ulysses", B=1, N=48, D=8)
CASES = [
    dict(U, kind="dense", Hq=4, Hkv=2, causal=True),
    dict(U, kind="dense", B=2, Hq=4, Hkv=4, causal=False, balance="zigzag", backend="torch"),
    dict(U, kind="dilated", Hq=4, Hkv=1, causal=True, ws=[8, 48], rs=[1, 3]),   # Hkv < P: repeated
    dict(U, kind="dilated", Hq=4, Hkv=2, causal=False, ws=[4, 24, 48], rs=[1, 2, 4], offsets="blocked",
         balance="zigzag"),
    dict(U, kind="dilated", Hq=6, Hkv=1, causal=True, ws=[8, 16, 48], rs=[2, 5, 3], mode="head_groups"),
    dict(U, kind="dilated", Hq=12, Hkv=6, causal=True, ws=[12, 48], rs=[1, 5], backend="torch", D=4),
    dict(U, kind="layout", N=96, Hq=4, Hkv=2, causal=True, bs=16),              # bigbird, one layout per head
    dict(U, kind="layout", N=96, Hq=4, Hkv=1, causal=False, bs=16, balance="zigzag", backend="torch"),
    dict(U, kind="layout", N=96, Hq=6, Hkv=3, causal=True, bs=16, backend="torch"),
    dict(U, kind="dense", Hq=3, Hkv=1, causal=True, balance="zigzag"),
]


def _splits(case, world):
    """Whether the case's heads and sequence split over `world` ranks."""
    Hq, Hkv = case["Hq"], case["Hkv"]
    kv_ok = Hkv % world == 0 if Hkv >= world else world % Hkv == 0
    return Hq % world == 0 and kv_ok and case["N"] % (world * (2 if case.get("balance") == "zigzag" else 1)) == 0


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def world_results(request):
    world = request.param
    cases = [c for c in CASES if _splits(c, world)]
    assert len(cases) >= 3, (world, cases)
    return world, cases, run_world(world, cases)


@pytest.mark.gloo
def test_ulysses_matches_oracle(world_results):
    """The ring test's comparison (test_ring.test_ring_matches_oracle) on Ulysses results."""
    compare_with_oracle(world_results)


# 2-D (USP) on a 2 x 2 grid: Ulysses groups {0, 1}, {2, 3}, rings {0, 2}, {1, 3} (the ring
# step kernels under the interpreter); every rank's shard is shard(x, rank, 4, balance).
G = dict(fn="usp", U=2, B=1, N=48, D=8)
USP_CASES = [
    dict(G, kind="dense", Hq=4, Hkv=2, causal=True, balance="zigzag"),
    dict(G, kind="dilated", Hq=4, Hkv=1, causal=True, ws=[8, 48], rs=[1, 3], comm="allgather"),
    dict(G, kind="dilated", Hq=4, Hkv=2, causal=False, ws=[4, 24, 48], rs=[1, 2, 4], offsets="blocked",
         balance="zigzag"),
    dict(G, kind="dilated", Hq=6, Hkv=2, causal=True, ws=[8, 16, 48], rs=[2, 5, 3], mode="head_groups"),
    dict(G, kind="layout", N=96, Hq=4, Hkv=2, causal=True, bs=16, balance="zigzag"),
]


@pytest.mark.gloo
def test_usp_2x2_matches_oracle():
    """Against the oracle; and per-rank memory of the ring dimension stays O(N/P): with
    comm="p2p" a rank holds at most 3 key/value shards of the ring (own, in use, in flight)
    of its Ulysses group's heads (N / R rows of max(Hkv, U) / U heads)."""
    results = run_world(4, USP_CASES)
    compare_with_oracle((4, USP_CASES, results))
    U, R = 2, 2
    for i, case in enumerate(USP_CASES):
        if case.get("comm", "p2p") != "p2p":
            continue
        shard_bytes = 2 * case["B"] * (case["N"] // R) * (max(case["Hkv"], U) // U) * case["D"] * 4
        held = [payload[i]["max_kv_bytes_held"] for _, payload in results.values()]
        assert all(0 < h <= 3 * shard_bytes for h in held), (case, held, shard_bytes)


def test_usp_mismatch_on_one_rank_raises_on_every_rank():
    """The last rank of a 2 x 2 grid differs: its Ulysses group finds it, and the rings carry
    that verdict to the other group, so all four ranks raise (none waits in a collective)."""
    results = spawn_world(ulysses_errors_worker, 4, lambda queue: (queue, 2), 300)
    assert sorted(results) == [0, 1, 2, 3]
    assert all(status == "ok" for status, _ in results.values()), results
    errors = [results[r][1] for r in range(4)]
    for what, e in zip(("causal", "ring (world size, comm)", "scale must be finite"), zip(*errors)):
        assert all(x is not None and x.startswith("ValueError") and what in x for x in e), (what, e)
    assert all(e[3] is None for e in errors)


def test_every_case_runs_somewhere():
    assert all(any(_splits(c, w) for w in (2, 3, 4)) for c in CASES)
    assert {w for w in (2, 3, 4) for c in CASES if _splits(c, w) and c["Hkv"] < w} == {2, 3, 4}


def test_mismatched_or_unsplittable_arguments_raise_on_every_rank():
    results = spawn_world(ulysses_errors_worker, 2, lambda queue: (queue,), 300)
    assert sorted(results) == [0, 1]
    (s0, e0), (s1, e1) = results[0], results[1]
    assert s0 == "ok" and s1 == "ok", (e0, e1)
    assert e0[0] == e1[0] and "disagree on causal" in e0[0] and "rank 0: False, rank 1: True" in e0[0]
    assert e0[1] == e1[1] and "disagree on segment_lengths/dilation_rates" in e0[1]
    assert all("multiple of the world size 2" in e[2] for e in (e0, e1))
    assert "scale must be finite" in e0[3] and "rank 0 rejected its arguments (ValueError: scale" in e1[3]
    assert all("k/v's 3 heads must be a multiple of the world size 2" in e[4] for e in (e0, e1))


def _simulate(fn, inputs, balance):
    """fn (seq_to_heads or heads_to_seq) on every rank's input, with the all-to-all done by
    hand: returns every rank's output."""
    world = len(inputs)
    sent = []

    class Comm:
        def __init__(self, rank):
            self.world, self.rank = world, rank

        def all_to_all(self, x):
            sent.append(x)
            return x
    # first pass: record what each rank sends; second: hand rank j part j of every rank
    for rank, x in enumerate(inputs):
        fn(x, Comm(rank), balance)
    outs = []
    for rank, x in enumerate(inputs):
        got = torch.stack([sent[i][rank] for i in range(world)])

        class Recv(Comm):
            def all_to_all(self, _x, got=got):
                return got
        outs.append(fn(x, Recv(rank), balance))
    return outs


@pytest.mark.parametrize("balance", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_all_to_all_round_trip_and_adjoint(world, balance):
    """seq_to_heads gives rank r heads [r H/P, (r+1) H/P) of the whole sequence; heads_to_seq
    undoes it; and <s2h(x), y> = <x, h2s(y)> summed over ranks (each is the other's adjoint,
    which is what the autograd Functions use as backward)."""
    from triton_dilated import shard
    from triton_dilated.ops.ring.ulysses import heads_to_seq, seq_to_heads
    B, N, H, D = 2, 12, 6, 3
    full = torch.randn(B, N, H, D, dtype=torch.float64)
    shards = [shard(full, r, world, balance) for r in range(world)]
    heads = _simulate(seq_to_heads, shards, balance)
    hp = H // world
    for r in range(world):
        assert torch.equal(heads[r], full[:, :, r * hp:(r + 1) * hp])
    back = _simulate(heads_to_seq, heads, balance)
    assert all(torch.equal(a, b) for a, b in zip(back, shards))
    ys = [torch.randn(B, N, hp, D, dtype=torch.float64) for _ in range(world)]
    lhs = sum((a * b).sum() for a, b in zip(heads, ys))
    rhs = sum((a * b).sum() for a, b in zip(shards, _simulate(heads_to_seq, ys, balance)))
    assert abs(lhs - rhs) <= 1e-9 * abs(lhs)


def test_without_process_group_is_a_clear_error():
    from triton_dilated import ulysses_attention
    x = torch.randn(1, 8, 1, 8)
    with pytest.raises(RuntimeError, match="ulysses_attention needs an initialised"):
        ulysses_attention(x, x, x)
