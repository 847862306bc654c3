"""Issue 23 items 1 and 2 on sequence parallelism: softcap= and sinks= on ring_attention and
ulysses_attention, gloo worlds of 2 and 3 (spawned), against the float64 oracles with the same
softcap and sinks: every rank's shard of out, lse, dq, dk, dv (through a loss on out and lse),
and the sinks' gradient summed over the ranks (each rank's is its own rows' part, or its own
heads' for Ulysses); dense, dilated (a local pattern and a ring pattern: the sink joins the
merge of both once) and block-sparse, causal, GQA. The ring step alone, on both step backends
(Triton kernels under the interpreter and the portable step), with a cap: merged steps equal
the oracle forward and backward."""
from __future__ import annotations

import pytest
import torch

from triton_dilated import block_sparse_attention_naive, dilated_attention_naive, layouts, shard
from triton_dilated.ops.block_sparse.naive import element_mask
from triton_dilated.ops.dilated.naive import dilated_multiplicity
from triton_dilated.ops.dilated.patterns import head_offsets
from triton_dilated.ops.ring import step_portable
from triton_dilated.ops.ring.mask import MASK_DENSE, MASK_DILATED, MASK_LAYOUT, StepMask
from tests.conftest import DEVICE
from tests.helpers.reference import FLOOR, assert_rule, assert_rule_all, dense_reference
from tests.helpers.ring_checks import run_step_shards, run_world
from tests.helpers.ring_worker import case_layout, case_sinks, loss_of, make_inputs

R = dict(B=1, N=48, D=8, sink_logits=True)
CASES = [
    dict(R, kind="dense", Hq=2, Hkv=1, causal=True, softcap=1.5),
    dict(R, kind="dilated", Hq=4, Hkv=2, causal=True, ws=[8, 48], rs=[1, 3], softcap=2.0),
    dict(R, kind="layout", N=96, Hq=2, Hkv=1, causal=True, bs=16, softcap=1.0, comm="allgather"),
    dict(R, kind="dense", Hq=2, Hkv=2, causal=False, balance="zigzag", sink_logits=False, softcap=0.5),
    dict(R, fn="ulysses", kind="dense", Hq=6, Hkv=6, causal=True, softcap=1.5),
    dict(R, fn="ulysses", kind="dilated", Hq=6, Hkv=6, causal=True, ws=[8, 48], rs=[1, 3], softcap=2.0,
         backend="torch"),
    dict(R, fn="ulysses", kind="layout", N=96, Hq=6, Hkv=3, causal=True, bs=16, backend="torch", softcap=None),
]


def _oracle(case):
    """The full sequence's float64 oracle and float32 same-dtype reference with the case's
    softcap and sinks: ((out, lse, dq, dk, dv, dsinks), loss) each."""
    q, k, v, g, gl = make_inputs(case)
    sinks, cap = case_sinks(case), case.get("softcap")
    layout = case_layout(case)
    if layout is None:
        oracle = lambda q, k, v, s: dilated_attention_naive(  # noqa: E731
            q, k, v, case["ws"], case["rs"], causal=case["causal"], softcap=cap, sinks=s)
        counts = dilated_multiplicity(case["N"], case["ws"], case["rs"], case["Hq"], causal=case["causal"])
    else:
        oracle = lambda q, k, v, s: block_sparse_attention_naive(q, k, v, layout, causal=case["causal"],  # noqa: E731
                                                                 softcap=cap, sinks=s)
        counts = element_mask(layout, case["N"], case["causal"])
    results = []
    for fn, dt in ((oracle, torch.float64),
                   (lambda q, k, v, s: dense_reference(q, k, v, counts, softcap=cap, sinks=s), torch.float32)):
        leaves = [x.to(dt).requires_grad_() for x in (q, k, v)]
        s = None if sinks is None else sinks.to(dt).requires_grad_()
        out, lse = fn(*leaves, s)
        loss = loss_of(out, lse, g.to(dt), gl.to(dt), case)
        grads = torch.autograd.grad(loss, leaves + ([] if s is None else [s]))
        results.append(((out.detach(), lse.detach(), *grads), loss.item()))
    return results


@pytest.fixture(scope="module", params=[2, 3])
def world_results(request):
    world = request.param
    cases = [c for c in CASES if c["N"] % (world * (2 if c.get("balance") == "zigzag" else 1)) == 0
             and (c.get("fn") != "ulysses" or (c["Hq"] % world == 0 and c["Hkv"] % world == 0))]
    return world, cases, run_world(world, cases)


@pytest.mark.gloo
def test_ring_and_ulysses_softcap_sinks_match_oracle(world_results):
    world, cases, results = world_results
    assert sorted(results) == list(range(world))
    assert len(cases) >= 5
    refs = [_oracle(case) for case in cases]
    for i, (case, ((oracle, loss_oracle), (same, loss_same))) in enumerate(zip(cases, refs)):
        bal = case.get("balance", "contiguous")
        what = f"world {world} {case}: "
        for rank, (status, payload) in results.items():
            assert status == "ok", payload
            got = payload[i]

            def local(x, j):   # this rank's rows of a full-sequence out/grad (j != 1) or lse (j == 1)
                return shard(x.transpose(1, 2), rank, world, bal).transpose(1, 2) if j == 1 else \
                    shard(x, rank, world, bal)
            assert_rule_all([torch.from_numpy(got[n]) for n in ("out", "lse", "dq", "dk", "dv")],
                            [local(x, j) for j, x in enumerate(oracle[:5])],
                            [local(x, j) for j, x in enumerate(same[:5])],
                            floor=FLOOR[torch.float32], what=f"{what}rank {rank}: ")
            assert ("dsinks" in got) == case["sink_logits"]
        assert_rule(f"{what}loss", torch.tensor(results[0][1][i]["loss"]), torch.tensor(loss_oracle),
                    torch.tensor(loss_same), factor=2, floor=FLOOR[torch.float32])
        if case["sink_logits"]:   # the ranks' parts of the sinks' gradient sum to the full-sequence gradient
            dsinks = sum(torch.from_numpy(payload[i]["dsinks"]) for _, payload in results.values())
            assert_rule(f"{what}dsinks", dsinks, oracle[5], same[5], factor=3, floor=FLOOR[torch.float32])
            assert dsinks.abs().min() > 0


@pytest.mark.parametrize("kind", [MASK_DENSE, MASK_DILATED, MASK_LAYOUT])
@pytest.mark.parametrize("backend", ["kernel", "portable"])
def test_step_with_softcap_against_oracle(kind, backend):
    """The ring step alone with a cap, shard by shard on one process (the step kernels under
    the interpreter, or the portable step): the merged steps equal the float64 oracle with
    the same cap, forward and backward; causal, GQA."""
    if backend == "kernel":
        from triton_dilated.ops.ring.step_kernels import step_backward, step_forward
    else:
        step_forward, step_backward = step_portable.step_forward, step_portable.step_backward
    dev = torch.device(DEVICE if backend == "kernel" else "cpu")
    g = torch.Generator().manual_seed(3)
    B, N, Hq, Hkv, D, cap = 1, 64, 4, 2, 16, 1.25
    q, k, v, do = (torch.randn(B, N, h, D, generator=g).mul(2.0).to(dev) for h in (Hq, Hkv, Hkv, Hq))
    pats, lay = ((8, 1), (32, 2), (64, 3)), layouts.bigbird(N, 16, 1, 1, 1, seed=0, num_heads=Hq)
    mask = StepMask(kind, True, dev, patterns=pats, table=head_offsets(Hq, pats, "longnet", "modulo"), layout=lay)
    if kind == MASK_DILATED:
        ws, rs = [w for w, _ in pats], [r for _, r in pats]
        oracle = lambda q, k, v: dilated_attention_naive(q, k, v, ws, rs, causal=True, softcap=cap)  # noqa: E731
        counts = dilated_multiplicity(N, ws, rs, Hq, causal=True)
    else:
        if kind == MASK_DENSE:
            lay = layouts.causal(N, 16)
        oracle = lambda q, k, v: block_sparse_attention_naive(q, k, v, lay, causal=True, softcap=cap)  # noqa: E731
        counts = element_mask(lay, N, True)

    def reference(fn, dt):   # out, lse and the gradients of sum(out * do)
        leaves = [x.cpu().to(dt).requires_grad_() for x in (q, k, v)]
        out, lse = fn(*leaves)
        return (out.detach(), lse.detach(), *torch.autograd.grad((out * do.cpu().to(dt)).sum(), leaves))
    ref = reference(oracle, torch.float64)
    same = reference(lambda q, k, v: dense_reference(q, k, v, counts, softcap=cap), torch.float32)

    shards = (slice(32, 64), slice(0, 16), slice(16, 32))
    got = run_step_shards(step_forward, step_backward, q, k, v, do, mask, shards, softcap=cap)
    assert_rule_all([x.cpu() for x in got], ref, same, floor=FLOOR[torch.float32])
