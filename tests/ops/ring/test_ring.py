"""Ring attention with several gloo processes (spawned, one file-store rendezvous per
group, timeouts on init and join, many cases per group), the step kernel alone, shards."""
from __future__ import annotations

import time

import pytest
import torch

from triton_dilated import ring_attention, shard, unshard
from triton_dilated.ops.ring.shard import shard_positions
from triton_dilated.ops.ring.mask import MASK_DENSE, MASK_DILATED, MASK_LAYOUT
from tests.helpers.ring_checks import case_references, check_step_kernel_against_oracle, compare_ranks, run_world
from tests.helpers.ring_worker import spawn_world

CASES = [
    dict(kind="dense", B=1, N=48, Hq=2, Hkv=1, D=16, causal=True),
    dict(kind="dense", B=2, N=48, Hq=2, Hkv=2, D=12, causal=False, comm="allgather"),
    dict(kind="dense", B=1, N=48, Hq=2, Hkv=1, D=16, causal=True, balance="zigzag"),
    dict(kind="dense", B=1, N=48, Hq=2, Hkv=1, D=16, causal=True, balance="zigzag", comm="allgather"),
    dict(kind="dilated", B=1, N=48, Hq=4, Hkv=2, D=8, causal=True, ws=[8, 48], rs=[1, 3]),
    dict(kind="dilated", B=1, N=48, Hq=4, Hkv=2, D=8, causal=False, ws=[4, 24, 48], rs=[1, 2, 4], offsets="blocked",
         balance="zigzag"),
    dict(kind="dilated", B=1, N=48, Hq=3, Hkv=1, D=8, causal=True, ws=[8, 48], rs=[2, 5], mode="head_groups",
         comm="allgather"),
    dict(kind="layout", B=1, N=96, Hq=2, Hkv=1, D=8, causal=True, bs=16),
    dict(kind="layout", B=1, N=96, Hq=2, Hkv=2, D=8, causal=False, bs=16, balance="zigzag", comm="allgather"),
]


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def world_results(request):
    world = request.param
    cases = [c for c in CASES if c["N"] % (world * (2 if c.get("balance") == "zigzag" else 1)) == 0]
    return world, cases, run_world(world, cases)


@pytest.mark.gloo
def test_ring_matches_oracle(world_results):
    """Forward, lse and gradients (through a loss that also uses lse) of every rank's shard
    against the float64 oracle's shard, by the tolerance rule; the loss summed over ranks
    against the oracle's, so it does not depend on the world size beyond rounding."""
    compare_ranks(*world_results, case_references)


@pytest.mark.gloo
def test_p2p_memory_falls_with_world_size():
    """Per-rank key/value bytes held at once with comm="p2p": own shard + the one in use +
    the one in flight = 3 N/P rows, so it falls as 1/P at fixed N; the same with packed
    documents spanning the ranks, sharded by their document balance (portable step)."""
    from triton_dilated import document_balance
    case = dict(kind="dense", B=1, N=96, Hq=1, Hkv=1, D=16, causal=False)
    cu = [0, 7, 60, 61, 96]
    held, held_docs = {}, {}
    for world in (1, 2, 4):
        docs = dict(case, causal=True, cu=cu, interpret="0", balance=document_balance(cu, world, causal=True))
        results = run_world(world, [case, docs])
        held[world] = max(payload[0]["max_kv_bytes_held"] for status, payload in results.values())
        held_docs[world] = max(payload[1]["max_kv_bytes_held"] for status, payload in results.values())
    shard_bytes = lambda p: 2 * 96 // p * 16 * 4  # noqa: E731  (k and v, float32)
    for h in (held, held_docs):
        assert h[1] == shard_bytes(1)
        for world in (2, 4):
            assert h[world] <= 3 * shard_bytes(world), h
        assert h[4] < h[2] < 2 * h[1], h


@pytest.mark.gloo
def test_a_failing_rank_does_not_hang_the_others():
    start = time.monotonic()
    results = run_world(3, [CASES[0]], fail_rank=1, timeout_s=10, join_s=120)
    assert time.monotonic() - start < 60   # init and op timeouts are 10 s; 11 s measured
    assert results[1][0] == "error" and "fails on purpose" in results[1][1]
    for rank in (0, 2):   # the others fail (timeout or peer gone) instead of hanging
        assert rank not in results or results[rank][0] == "error"


def test_without_process_group_is_a_clear_error():
    x = torch.randn(1, 8, 1, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(x, x, x)


@pytest.mark.parametrize("balance", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_unshard_round_trip(balance, world):
    x = torch.arange(2 * 24 * 3, dtype=torch.float32).view(2, 24, 3)
    parts = [shard(x, r, world, balance) for r in range(world)]
    assert all(p.shape[1] == 24 // world for p in parts)
    assert torch.equal(unshard(parts, balance), x)
    for r, p in enumerate(parts):
        assert torch.equal(p[0, :, 0], x[0, shard_positions(24, r, world, balance).long(), 0])
    if balance == "zigzag" and world == 2:
        assert shard_positions(24, 0, 2, "zigzag").tolist() == list(range(0, 6)) + list(range(18, 24))


def test_shard_rejects_indivisible_lengths():
    with pytest.raises(ValueError, match="multiple of 4"):
        shard(torch.randn(1, 10, 2), 0, 2, "zigzag")
    with pytest.raises(ValueError, match="balance"):
        shard(torch.randn(1, 10, 2), 0, 2, "striped")


@pytest.mark.parametrize("kind", [MASK_DENSE, MASK_DILATED, MASK_LAYOUT])
@pytest.mark.parametrize("causal", [False, True])
def test_step_kernel_alone_against_oracle(kind, causal):
    check_step_kernel_against_oracle(kind, causal)


# An explicit backward config serves both kernels: dQ walks BLOCK_N-key tiles for each
# BLOCK_M-query tile, dK/dV BLOCK_N-query tiles for each BLOCK_M-key tile (S^T = K Q^T),
# each over lists built with its own tiles. Shards of 40 and 32 keys: ragged key tiles.
@pytest.mark.parametrize("kind", [MASK_DENSE, MASK_DILATED, MASK_LAYOUT])
@pytest.mark.parametrize("tiles", [(16, 32), (64, 16)])
def test_step_backward_with_key_and_query_tiles_that_differ(kind, tiles):
    config = {"BLOCK_M": tiles[0], "BLOCK_N": tiles[1], "num_warps": 4, "num_stages": 1}
    check_step_kernel_against_oracle(kind, True, config, shards=(slice(32, 72), slice(0, 32)))


@pytest.mark.parametrize("interpret", ["0", pytest.param("1", marks=pytest.mark.gloo)],
                         ids=["portable-step", "step-kernel"])
def test_ring_empty_batch(interpret):
    """Issue 19 item 4: B = 0 on every rank gave ZeroDivisionError in the portable step's
    query blocks. Empty out (B, N_local, H, D), lse (B, H, N_local) and gradients, with both
    step backends, dense, dilated and block-sparse, p2p and all-gather."""
    from tests.helpers.ring_worker import empty_batch_worker
    results = spawn_world(empty_batch_worker, 2, lambda queue: (queue, interpret), 300)
    assert sorted(results) == [0, 1]
    for rank, (status, shapes) in results.items():
        assert status == "ok", shapes
        for out, lse, grads in shapes:
            assert out == (0, 16, 2, 8) and lse == (0, 2, 16)
            assert all(g is None or g == (0, 16, 2, 8) for g in grads), grads
