"""Ring attention when things go wrong, and what the CPU ring step costs in memory.

Ranks that disagree (gloo processes, spawned as in test_ring.py, timeouts everywhere):
every rank raises the same ValueError naming what differs and on which ranks, instead of
a process aborted by gloo, a result computed from receive buffers never written, a
silently different function or a hang until the process-group timeout.

The portable ring step (the CPU path without the interpreter): against the float64 oracle
when its query rows are split into many blocks, and its peak memory measured in a fresh
process (resident-set high-water mark): O(N_local) per step, not the (N_local x N_shard)
float32 score matrix the step used to build.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tests.conftest import DEVICE
from tests.helpers.ring_faults_worker import run_world

from triton_dilated.ops.common.call import AttentionCall
from triton_dilated import (
    BlockLayout,
    block_sparse_attention_naive,
    dilated_attention_naive,
    layouts,
)
from triton_dilated.ops.dilated.patterns import head_offsets
from triton_dilated.ops.ring import step_portable
from triton_dilated.ops.ring.mask import MASK_DENSE, MASK_DILATED, MASK_LAYOUT, StepMask

WORLD = 3   # rank 1 differs: the message groups ranks 0 and 2

# name -> what rank 1 passes differently (shape overrides, keyword overrides) and the
# words the message must hold
MISMATCHES = {
    "shard length": (dict(shape=dict(N=72)), ["q shape (B, N_local, Hq, D)", "ranks 0, 2: (1, 16, 2, 8)",
                                               "rank 1: (1, 24, 2, 8)"]),
    "head dim": (dict(shape=dict(D=16)), ["q shape", "rank 1: (1, 16, 2, 16)"]),
    "head count": (dict(shape=dict(Hq=4)), ["q shape", "rank 1: (1, 16, 4, 8)"]),
    "kv heads": (dict(shape=dict(Hkv=2)), ["k/v shape (B, N_local, Hkv, D)", "rank 1: (1, 16, 2, 8)"]),
    "dtype": (dict(shape=dict(dtype="float16")), ["dtype", "ranks 0, 2: 'float32'", "rank 1: 'float16'"]),
    "patterns": (dict(kw=dict(segment_lengths=[8, 48], dilation_rates=[1, 2]),
                      kw1=dict(dilation_rates=[1, 3])),
                 ["segment_lengths/dilation_rates", "((8, 1), (48, 2))", "rank 1: ((8, 1), (48, 3))"]),
    "mode": (dict(kw=dict(segment_lengths=[8, 48], dilation_rates=[1, 2]), kw1=dict(offsets="blocked")),
             ["mode/offsets", "rank 1: ('longnet', 'blocked')"]),
    "causal": (dict(kw1=dict(causal=True)), ["causal", "ranks 0, 2: False", "rank 1: True"]),
    "balance": (dict(kw1=dict(balance="zigzag")), ["balance", "rank 1: 'zigzag'"]),
    "comm": (dict(kw1=dict(comm="allgather")), ["comm", "ranks 0, 2: 'p2p'", "rank 1: 'allgather'"]),
    "scale": (dict(kw1=dict(scale=0.5)), ["scale", "rank 1: 0.5"]),
    "layout": (dict(kw=dict(layout_window=1), kw1=dict(layout_window=0)), ["layout", "BlockLayout (1, 1, 3, 3) blocks of 16"]),
    "backward": (dict(no_grad_on_1=True), ["backward (grad mode, inputs requiring grad)", "rank 1: False"]),
    # hardening round 3: sink logits that differ were not compared (each rank used its own)
    "sinks": (dict(kw=dict(sinks_value=0.0), kw1=dict(sinks_value=5.0)), ["sinks", "2 sink logits, digest"]),
    "sinks (ulysses)": (dict(fn="ulysses", shape_all=dict(Hq=3, Hkv=3), kw=dict(sinks_value=0.0),
                             kw1=dict(sinks_value=5.0)), ["sinks", "3 sink logits, digest", "rank 1:"]),
}


@pytest.fixture(scope="module")
def fault_results():
    scenarios = [(name, spec) for name, (spec, _) in MISMATCHES.items()]
    scenarios.append(("invalid on rank 1", dict(kw1=dict(comm="ring"))))
    scenarios.append(("agreed", dict(kind="agreed")))
    return run_world(WORLD, scenarios)


def per_rank(results, name):
    """Every rank's result of one scenario; fails when a rank aborted (gloo kills a process
    whose receive size differs), hung or raised outside the scenarios."""
    assert sorted(results) == list(range(WORLD)), f"ranks that reported: {sorted(results)}: {results}"
    for rank, (status, payload) in results.items():
        assert status == "ok", (rank, payload)
    return [results[r][1][name] for r in range(WORLD)]


@pytest.mark.parametrize("name", list(MISMATCHES))
@pytest.mark.gloo
def test_disagreeing_ranks_all_raise_the_same_error(fault_results, name):
    got = per_rank(fault_results, name)
    kinds, messages = {g[0] for g in got}, {g[1] for g in got}
    assert kinds == {"ValueError"}, got
    assert len(messages) == 1, got                       # the same words on every rank
    message = messages.pop()
    assert "disagree" in message, message
    for words in MISMATCHES[name][1]:
        assert words in message, (words, message)


@pytest.mark.gloo
def test_invalid_arguments_on_one_rank_stop_every_rank(fault_results):
    """Rank 1's own ValueError there; the others name rank 1 and its error (no hang)."""
    got = per_rank(fault_results, "invalid on rank 1")
    assert got[1][0] == "ValueError" and got[1][1].startswith("comm must be one of"), got
    for r in (0, 2):
        assert got[r][0] == "ValueError", got
        assert "rank 1 rejected its arguments (ValueError: comm must be one of" in got[r][1], got


@pytest.mark.gloo
def test_matching_call_after_the_errors_is_right(fault_results):
    errs = per_rank(fault_results, "agreed")
    assert max(errs) <= 2e-5, errs


# ----------------------------------------------------------------------------- portable step

@pytest.mark.parametrize("kind", [MASK_DENSE, MASK_DILATED, MASK_LAYOUT])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_bytes", [None, 1])   # one block of rows; blocks of MIN_ROWS rows (ragged last)
def test_portable_step_against_oracle(kind, causal, block_bytes, monkeypatch):
    """Shard by shard (any order), merged steps equal the float64 oracle, forward and
    backward (GQA, B = 2), on the test device (the step also serves pre-Volta GPUs)."""
    if block_bytes is not None:
        monkeypatch.setattr(step_portable, "SCORE_BLOCK_BYTES", block_bytes)
    g = torch.Generator().manual_seed(0)
    B, N, Hq, Hkv, D = 2, 72, 4, 2, 16
    dev = torch.device(DEVICE)
    q, k, v, do = (torch.randn(B, N, h, D, generator=g).to(dev) for h in (Hq, Hkv, Hkv, Hq))
    pats, lay = ((8, 1), (24, 2), (72, 3)), layouts.bigbird(N, 16, 1, 1, 1, seed=0, num_heads=Hq)
    mask = StepMask(kind, causal, dev, patterns=pats, table=head_offsets(Hq, pats, "longnet", "modulo"),
                    layout=lay)
    qq, kk, vv = (x.double().requires_grad_() for x in (q, k, v))
    if kind == MASK_DILATED:
        ref, ref_lse = dilated_attention_naive(qq, kk, vv, [w for w, _ in pats], [r for _, r in pats], causal=causal)
    else:
        dense = BlockLayout.from_dense(torch.ones(5, 5, dtype=torch.bool), 16)
        ref, ref_lse = block_sparse_attention_naive(qq, kk, vv, lay if kind == MASK_LAYOUT else dense, causal=causal)
    gq, gk, gv = torch.autograd.grad((ref * do.double()).sum(), (qq, kk, vv))
    pos = torch.arange(N, dtype=torch.int32, device=dev)
    shards = [slice(48, 72), slice(0, 24), slice(24, 48)]
    if block_bytes is not None:
        assert len(step_portable.query_blocks(q, 24)) == 5
    out, lse = torch.zeros(B, N, Hq, D, device=dev), torch.full((B, Hq, N), float("-inf"), device=dev)
    for s in shards:
        step_portable.step_forward(q, k[:, s], v[:, s], pos, pos[s].contiguous(), out, lse, mask, AttentionCall(mask.causal, D ** -0.5))
    delta = (do * out).sum(-1).transpose(1, 2).contiguous()
    dq, dk, dv = (torch.zeros(B, N, h, D, device=dev) for h in (Hq, Hkv, Hkv))
    for s in shards:
        dks, dvs = dk[:, s].clone(), dv[:, s].clone()
        step_portable.step_backward(q, k[:, s], v[:, s], do, lse, delta, pos, pos[s].contiguous(), dq, dks, dvs,
                                    mask, AttentionCall(mask.causal, D ** -0.5))
        dk[:, s], dv[:, s] = dks, dvs
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (lse.double() - ref_lse)[fin].abs().max() <= 2e-5
    for name, a, b in (("out", out, ref), ("dq", dq, gq), ("dk", dk, gk), ("dv", dv, gv)):
        assert (a.double() - b).abs().max() <= 2e-5, name


STEP_MEMORY = textwrap.dedent("""
    import sys, torch
    from triton_dilated.ops.common.call import AttentionCall
    from triton_dilated.ops.dilated.patterns import head_offsets
    from triton_dilated.ops.ring import step_portable as sp
    from triton_dilated.ops.ring.mask import MASK_DENSE, MASK_DILATED, StepMask

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    def peak_above_now(fn):
        # Peak resident memory of fn() above what was resident before it. fn runs once
        # unmeasured first (one-time allocations: allocator arenas, BLAS scratch), then the
        # smaller of two measured calls counts: an O(N^2) temporary shows in every call,
        # a one-off mapping by the C libraries (seen once in CI: exactly 64 MiB) does not.
        fn()
        peaks = []
        for _ in range(2):
            with open("/proc/self/clear_refs", "w") as f:   # resets VmHWM to the current RSS
                f.write("5")
            base = status("VmRSS")
            fn()
            peaks.append(status("VmHWM") - base)
        return min(peaks)

    N, H, D = int(sys.argv[1]), int(sys.argv[2]), 16
    pats = ((N // 4, 1), (N // 2, 2), (N, 4))
    table = head_offsets(H, pats, "longnet", "modulo")

    def step(kind, n, backward):
        mask = StepMask(MASK_DILATED if kind == "dilated" else MASK_DENSE, True, torch.device("cpu"),
                        patterns=pats, table=table)
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(1, n, H, D, generator=g) for _ in range(4))
        pos = torch.arange(n, dtype=torch.int32)
        out, lse = torch.zeros(1, n, H, D), torch.full((1, H, n), float("-inf"))
        sp.step_forward(q, k, v, pos, pos, out, lse, mask, AttentionCall(mask.causal, 0.25))
        if backward:
            delta = (do * out).sum(-1).transpose(1, 2).contiguous()
            grads = [torch.zeros(1, n, H, D) for _ in range(3)]
            return lambda: sp.step_backward(q, k, v, do, lse, delta, pos, pos, *grads, mask,
                                            AttentionCall(mask.causal, 0.25))
        return lambda: sp.step_forward(q, k, v, pos, pos, out, lse, mask, AttentionCall(mask.causal, 0.25))

    step("dilated", 64, True)()          # libraries loaded, allocator warm at a small size
    for kind in ("dense", "dilated"):
        fwd, bwd = step(kind, N, False), step(kind, N, True)
        print(kind, peak_above_now(fwd), peak_above_now(bwd))
""")


def test_portable_step_memory_is_linear_in_the_shard():
    """A causal step of N_local = N_shard = 2048 with H = 8: the full float32 score matrix
    is 128 MiB, and the old step held several such temporaries (and, dilated, a float64
    multiplicity tensor twice that size): 0.4-0.7 GiB. Measured peak resident memory above
    the step's inputs, forward and backward, dense and dilated, must stay under half of one
    such matrix (about 10-25 MiB measured: blocks of SCORE_BLOCK_BYTES)."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the resident-set high-water mark")
    n, heads = 2048, 8
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"     # memory does not depend on it; a shared CPU runs one thread faster
    # glibc: one arena, and blocks of 1 MiB and more mapped and unmapped per allocation, so
    # freed temporaries leave the resident set and each call's peak is its own
    env.update(MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_=str(1 << 20), MALLOC_TRIM_THRESHOLD_=str(1 << 20))
    proc = subprocess.run([sys.executable, "-c", STEP_MEMORY, str(n), str(heads)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    full_scores = heads * n * n * 4
    peaks = {line.split()[0]: [int(x) for x in line.split()[1:]] for line in proc.stdout.splitlines()}
    assert sorted(peaks) == ["dense", "dilated"], proc.stdout
    for kind, (fwd, bwd) in peaks.items():
        assert fwd < full_scores / 2 and bwd < full_scores / 2, (kind, fwd / 2 ** 20, bwd / 2 ** 20)
