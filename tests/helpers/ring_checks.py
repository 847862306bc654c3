"""The ring tests' shared checks (run in the test process; the spawned ranks run ring_worker):
a world of gloo processes over many cases, each rank's shard against the full sequence's
float64 oracle, and the ring step kernel alone, shard by shard, on one process."""
from __future__ import annotations

import torch

from triton_dilated.ops.common.call import AttentionCall
from triton_dilated import BlockLayout, block_sparse_attention_naive, dilated_attention_naive, layouts, shard
from triton_dilated.ops.block_sparse.naive import element_mask
from triton_dilated.ops.dilated.naive import dilated_multiplicity
from triton_dilated.ops.dilated.patterns import head_offsets
from triton_dilated.ops.ring.mask import MASK_DENSE, MASK_DILATED, StepMask
from triton_dilated.ops.ring.step_kernels import step_backward, step_forward
from tests.conftest import DEVICE
from tests.helpers.reference import FLOOR, assert_rule, assert_rule_all, dense_reference
from tests.helpers.ring_worker import case_layout, loss_of, make_inputs, spawn_world, worker


def run_world(world, cases, fail_rank=None, timeout_s=60, join_s=400):
    return spawn_world(worker, world, lambda queue: (cases, queue, fail_rank, timeout_s), join_s)


def case_references(case):
    """The full sequence's float64 oracle and float32 same-dtype reference (dense attention
    over the case's multiplicities): (out, lse, dq, dk, dv) and the loss, each."""
    q, k, v, g, gl = make_inputs(case)
    layout = case_layout(case)
    if layout is None:
        kw = dict(causal=case["causal"], mode=case.get("mode", "longnet"), offsets=case.get("offsets", "modulo"))
        oracle = lambda q, k, v: dilated_attention_naive(q, k, v, case["ws"], case["rs"], **kw)  # noqa: E731
        counts = dilated_multiplicity(case["N"], case["ws"], case["rs"], case["Hq"], **kw)
    else:
        oracle = lambda q, k, v: block_sparse_attention_naive(q, k, v, layout, causal=case["causal"])  # noqa: E731
        counts = element_mask(layout, case["N"], case["causal"])
    results = []
    for fn, dt in ((oracle, torch.float64), (lambda q, k, v: dense_reference(q, k, v, counts), torch.float32)):
        leaves = [x.to(dt).requires_grad_() for x in (q, k, v)]
        out, lse = fn(*leaves)
        loss = loss_of(out, lse, g.to(dt), gl.to(dt), case)
        results.append(((out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves)), loss.item()))
    return results


def compare_ranks(world, cases, results, references):
    """test_ring_matches_oracle's comparison with the full-sequence references(case) of
    case_references' form (the packed-document tests give per-document ones)."""
    assert sorted(results) == list(range(world))
    refs = [references(case) for case in cases]
    for rank, (status, payload) in results.items():
        assert status == "ok", payload
        for case, got, ((oracle, loss_oracle), (same, loss_same)) in zip(cases, payload, refs):
            bal = case.get("balance", "contiguous")

            def local(x, i):   # this rank's rows of a full-sequence out/grad (i != 1) or lse (i == 1)
                return shard(x.transpose(1, 2), rank, world, bal).transpose(1, 2) if i == 1 else \
                    shard(x, rank, world, bal)
            assert_rule_all([torch.from_numpy(got[n]) for n in ("out", "lse", "dq", "dk", "dv")],
                            [local(x, i) for i, x in enumerate(oracle)], [local(x, i) for i, x in enumerate(same)],
                            floor=FLOOR[torch.float32], what=f"world {world} rank {rank} {case}: ")
            assert_rule(f"world {world} {case}: loss", torch.tensor(got["loss"]), torch.tensor(loss_oracle),
                        torch.tensor(loss_same), factor=2, floor=FLOOR[torch.float32])


def compare_with_oracle(world_results):
    """test_ring.test_ring_matches_oracle's comparison, on (world, cases, results) of any
    sequence-parallel function whose cases case_references describes (Ulysses, USP)."""
    compare_ranks(*world_results, case_references)


def check_step_kernel_against_oracle(kind, causal, config=None, shards=(slice(48, 72), slice(0, 24), slice(24, 48)),
                                     D=16):
    """The ring-local-block kernels, shard by shard on one process (interpreter on CPU,
    compiled on CUDA): merged steps equal the float64 oracle, forward and backward (the
    backward with `config`, if given, for both its kernels), at head dim D."""
    dev = torch.device(DEVICE)
    g = torch.Generator().manual_seed(0)
    B, N, Hq, Hkv = 1, 72, 4, 2
    q, k, v, do = (torch.randn(B, N, h, D, generator=g).to(dev) for h in (Hq, Hkv, Hkv, Hq))
    pats, lay = ((8, 1), (24, 2), (72, 3)), layouts.bigbird(N, 16, 1, 1, 1, seed=0, num_heads=Hq)
    table = head_offsets(Hq, pats, "longnet", "modulo")
    mask = StepMask(kind, causal, q.device, patterns=pats, table=table, layout=lay)
    if kind == MASK_DILATED:
        ws, rs = [w for w, _ in pats], [r for _, r in pats]
        oracle = lambda q, k, v: dilated_attention_naive(q, k, v, ws, rs, causal=causal)  # noqa: E731
        counts = dilated_multiplicity(N, ws, rs, Hq, causal=causal)
    else:
        if kind == MASK_DENSE:
            lay = BlockLayout.from_dense(torch.ones(5, 5, dtype=torch.bool), 16)
        oracle = lambda q, k, v: block_sparse_attention_naive(q, k, v, lay, causal=causal)  # noqa: E731
        counts = element_mask(lay, N, causal)

    def reference(fn, dt):   # out, lse and the gradients of sum(out * do)
        leaves = [x.to(dt).requires_grad_() for x in (q, k, v)]
        out, lse = fn(*leaves)
        return (out.detach(), lse.detach(), *torch.autograd.grad((out * do.to(dt)).sum(), leaves))
    ref = reference(oracle, torch.float64)
    same = reference(lambda q, k, v: dense_reference(q, k, v, counts), torch.float32)

    got = run_step_shards(step_forward, step_backward, q, k, v, do, mask, shards, config=config)
    assert_rule_all(got, ref, same, floor=FLOOR[torch.float32])


def run_step_shards(step_forward, step_backward, q, k, v, do, mask, shards, softcap=0.0, **backward_kw):
    """The ring step over the key shards `shards` of the whole sequence, in that order, on one
    process: the merged (out, lse), then dq and each shard's dk, dv (gradients of sum(out * do))."""
    (B, N, Hq, D), Hkv, dev = q.shape, k.shape[2], q.device
    pos = torch.arange(N, dtype=torch.int32, device=dev)
    out = torch.zeros(B, N, Hq, D, device=dev)
    lse = torch.full((B, Hq, N), float("-inf"), device=dev)
    call = AttentionCall(mask.causal, D ** -0.5, softcap)
    for s in shards:      # any order
        step_forward(q, k[:, s], v[:, s], pos, pos[s].contiguous(), out, lse, mask, call)
    delta = (do * out).sum(-1).transpose(1, 2).contiguous()
    dq = torch.zeros(B, N, Hq, D, device=dev)
    dk, dv = torch.zeros(B, N, Hkv, D, device=dev), torch.zeros(B, N, Hkv, D, device=dev)
    for s in shards:
        dks, dvs = dk[:, s].clone(), dv[:, s].clone()
        step_backward(q, k[:, s], v[:, s], do, lse, delta, pos, pos[s].contiguous(), dq, dks, dvs, mask, call,
                      **backward_kw)
        dk[:, s], dv[:, s] = dks, dvs
    return out, lse, dq, dk, dv
