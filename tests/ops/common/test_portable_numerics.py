"""Numerics of the portable backends (issue 13): double backward is a clear error, any
finite scale works with causal (PyTorch's fused CPU kernels return NaN for a scale <= 0
with is_causal), large scores keep memory bounded (the explicit softmax goes in chunks),
and block-sparse rows are gathered by width with the causal mask inside the budget.
Memory tests measure the real peak RSS of a fresh process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.helpers.paths import ROOT
from tests.helpers.reference import FLOOR, assert_rule, dense_reference, multiplicity, seeded
from triton_dilated.ops.common.call import AttentionCall
from triton_dilated import (BlockLayout, DilatedAttention, block_sparse_attention, block_sparse_attention_naive,
                            dilated_attention, dilated_attention_naive, layouts)
from triton_dilated.ops.block_sparse import portable as bs_portable
from triton_dilated.ops.block_sparse.naive import element_mask
from triton_dilated.ops.common import lse as lse_mod

REPO = str(ROOT)


# ----------------------------------------------------------------------------- double backward

DOUBLE_BACKWARD_CASES = {
    "dilated one pattern": lambda q, k, v: dilated_attention(q, k, v, [16], [1], backend="torch"),
    "dilated mixed patterns + lse": lambda q, k, v: dilated_attention(q, k, v, [16, 32], [1, 2], backend="torch",
                                                                      return_lse=True)[1],
    "dilated explicit path": lambda q, k, v: dilated_attention(q, k, v, [16, 32], [1, 2], scale=50.0,
                                                               backend="torch"),
    "dilated head_groups causal": lambda q, k, v: dilated_attention(q, k, v, [16, 32, 64], [1, 2, 3], causal=True,
                                                                    mode="head_groups", backend="torch"),
    "block-sparse": lambda q, k, v: block_sparse_attention(q, k, v, layouts.local(64, 16, 1), backend="torch"),
    "block-sparse causal explicit": lambda q, k, v: block_sparse_attention(q, k, v, layouts.bigbird(64, 16), causal=True,
                                                                           scale=50.0, backend="torch"),
}


@pytest.mark.parametrize("case", list(DOUBLE_BACKWARD_CASES))
def test_double_backward_is_a_clear_error(case):
    """A gradient of a gradient raises NotImplementedError naming the problem (not PyTorch's
    'derivative for aten::..._backward is not implemented' or a view/in-place message), for
    torch.autograd.grad and for .backward(); first-order gradients taken with
    create_graph=True are the ordinary ones."""
    fn = DOUBLE_BACKWARD_CASES[case]
    q = seeded((1, 64, 4, 8), torch.float32, 0).requires_grad_()
    k, v = (seeded((1, 64, 2, 8), torch.float32, s).requires_grad_() for s in (1, 2))
    plain = torch.autograd.grad(fn(q, k, v).square().sum(), (q, k, v))
    first = torch.autograd.grad(fn(q, k, v).square().sum(), (q, k, v), create_graph=True)
    for a, b in zip(first, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="double backward .* is not supported"):
        torch.autograd.grad(first[0].square().sum(), (k,))
    first = torch.autograd.grad(fn(q, k, v).square().sum(), (q,), create_graph=True)
    with pytest.raises(NotImplementedError, match="portable backend"):
        (first[0].square().sum() + q.sum()).backward()


# ----------------------------------------------------------------------------- scale <= 0

@pytest.mark.parametrize("scale", [-0.3, 0.0, -40.0], ids=["negative", "zero", "negative-explicit"])
@pytest.mark.parametrize("ws,rs", [([64], [1]), ([16, 64], [1, 2])], ids=["one-pattern", "mixed"])
@pytest.mark.parametrize("causal", [True, False])
def test_dilated_nonpositive_scale(causal, ws, rs, scale):
    """Any finite scale, causal included (the fused CPU kernels give NaN for scale <= 0 with
    is_causal): out, lse and gradients against the float64 oracle."""
    B, N, Hq, Hkv, D = 1, 64, 4, 2, 16
    q = seeded((B, N, Hq, D), torch.float32, 0).requires_grad_()
    k, v = (seeded((B, N, Hkv, D), torch.float32, s).requires_grad_() for s in (1, 2))
    g = seeded((B, N, Hq, D), torch.float32, 3)

    def results(fn, dt):
        xs = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        out, lse = fn(*xs)
        grads = torch.autograd.grad((out * g.to(dt)).sum() + lse.sum(), xs)
        return [out, lse, *grads]
    got = results(lambda a, b, c: dilated_attention(a, b, c, ws, rs, causal=causal, scale=scale, return_lse=True,
                                                    backend="torch"), torch.float32)
    oracle = results(lambda a, b, c: dilated_attention_naive(a, b, c, ws, rs, causal=causal, scale=scale),
                     torch.float64)
    counts = multiplicity(N, ws, rs, Hq, causal=causal)
    same = results(lambda a, b, c: dense_reference(a, b, c, counts, scale), torch.float32)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert_rule(f"{name} scale={scale}", got[i], oracle[i], same[i], factor=2 if i < 2 else 3,
                    floor=FLOOR[torch.float32])
    assert not any(torch.isnan(x).any() for x in got)


def test_dilated_module_negative_scale_causal():
    """DilatedAttention with a negative scale and causal (the module path)."""
    q, k, v = (seeded((2, 48, 2, 8), torch.float32, s) for s in range(3))
    module = DilatedAttention([16, 48], [1, 3], causal=True, scale=-0.5, backend="torch")
    ref, _ = dilated_attention_naive(q, k, v, [16, 48], [1, 3], causal=True, scale=-0.5)
    out = module(q, k, v)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [-0.3, 0.0])
@pytest.mark.parametrize("causal", [True, False])
def test_block_sparse_nonpositive_scale(causal, scale):
    q, k, v = (seeded((1, 100, 2, 16), torch.float32, s) for s in range(3))
    layout = layouts.bigbird(100, 16, seed=1)
    out, lse = block_sparse_attention(q, k, v, layout, causal=causal, scale=scale, return_lse=True, backend="torch")
    ref, ref_lse = block_sparse_attention_naive(q, k, v, layout, causal=causal, scale=scale)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- explicit path

@pytest.mark.parametrize("mask", ["none", "causal", "keep"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_explicit_path_matches_float64(monkeypatch, dtype, mask):
    """The explicit softmax in many small chunks (rows and batches; causal chunks stop at
    their last key; keyless rows in the keep-mask), at scores of size ~1e3 where it is the
    path taken: out, lse and the gradients of a loss using both, against float64."""
    monkeypatch.setattr(lse_mod, "SCORE_BUDGET", 96)       # chunks of a few rows, one batch each
    B, H, L, D = 2, 3, 37, 16
    q, k, v = (seeded((B, H, L, D), torch.float32, s, scale=3.0) for s in range(3))
    g, gl = seeded((B, H, L, D), torch.float32, 3), seeded((B, H, L), torch.float32, 4)
    keep = torch.ones(L, L, dtype=torch.bool)
    if mask == "causal":
        keep = keep.tril()
    elif mask == "keep":
        keep = seeded((B, 1, L, L), torch.float32, 5) > 0.3
        keep[:, :, 4] = False                               # a row with no key
    scale = 40.0
    assert not lse_mod._use_cpu_flash(q.to(dtype), k.to(dtype), scale)

    def results(fn, dt):
        xs = [x.to(dtype).to(dt).requires_grad_() for x in (q, k, v)]
        out, lse = fn(*xs)
        fin = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        loss = (out.double() * g.double()).sum() + (fin.double() * gl.double()).sum()
        return [out, lse, *torch.autograd.grad(loss, xs)]
    got = results(lambda a, b, c: lse_mod.attention_with_lse(a, b, c, AttentionCall(mask == "causal", scale),
                                                             keep=keep if mask == "keep" else None), dtype)
    masked = lambda a, b, c: lse_mod.masked_attention_with_lse(a, b, c, keep, AttentionCall(False, scale))  # noqa: E731
    oracle = results(masked, torch.float64)
    same = results(masked, torch.float32)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert_rule(name, got[i], oracle[i], same[i], factor=2 if i < 2 else 3, floor=FLOOR[dtype])


def test_large_score_slices_only_leave_the_fused_kernel():
    """One batch slice with an attention-sink row (bound past FUSED_MAX_SCORE): it alone takes
    the explicit path; the result, in batch order, matches float64."""
    B, H, L, D = 2, 3, 40, 16
    q, k, v = (seeded((B, H, L, D), torch.float32, s) for s in range(3))
    q[1, 2, 5] *= 30.0
    k[1, 2, 7] *= 30.0
    large = lse_mod._large_scores(q, k, D ** -0.5)
    assert large.sum() == 1 and large[1, 2]
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = lse_mod.attention_with_lse(*xs, AttentionCall(True, D ** -0.5))
    x64 = [x.double().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = lse_mod.masked_attention_with_lse(*x64, torch.ones(L, L, dtype=torch.bool).tril(),
                                                   AttentionCall(False, D ** -0.5))
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-5, atol=2e-5)
    for a, b in zip(torch.autograd.grad((out * out).sum() + lse.sum(), xs),
                    torch.autograd.grad((ref * ref).sum() + ref_lse.sum(), x64)):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- peak memory

def _peak_rss_mb(body: str) -> dict:
    """Run `body` in a fresh process; it sets `result` (a dict). ru_maxrss is read before
    and after, so the reported growth is the body's peak over the inputs it built first."""
    script = textwrap.dedent("""
        import json, resource, sys, torch
        torch.set_num_threads(1)
        def rss_mb():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        result = {}
    """) + textwrap.dedent(body) + "\nprint(json.dumps(result))\n"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_large_scores_keep_memory_bounded():
    """Issue 13 item 4: one attention-sink row of q and of k at 30x the usual norm sent every
    pattern to an explicit softmax with full L x L score matrices (+460 MB here, +3.3 GB at
    N = 16K). Forward and backward with the sink must peak within 1.5x (+32 MB) of the same
    call without it."""
    growth = {}
    for sink in (False, True):
        growth[sink] = _peak_rss_mb(f"""
            from triton_dilated import dilated_attention
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, 4096, 4, 32, generator=g) for _ in range(3))
            if {sink}:
                q[:, 0] *= 30
                k[:, 0] *= 30
            for x in (q, k, v):
                x.requires_grad_()
            base = rss_mb()
            out = dilated_attention(q, k, v, [1024, 2048, 4096], [1, 2, 4], causal=True, backend="torch")
            out.square().sum().backward()
            result["growth_mb"] = rss_mb() - base
        """)["growth_mb"]
    assert growth[True] <= 1.5 * growth[False] + 32, f"peak RSS growth with sink {growth[True]:.0f} MB, " \
                                                     f"without {growth[False]:.0f} MB"


def test_block_sparse_causal_mask_counts_in_the_gather_budget():
    """Issue 13 item 9: the causal element mask was left out of the gather budget (D = 1,
    N = 64K, window 8: 0.84 GB, ~1000x the inputs). With a 2^20-element budget the peak
    stays a few tens of MB over inputs of 0.75 MB."""
    r = _peak_rss_mb("""
        from triton_dilated import block_sparse_attention, layouts
        from triton_dilated.ops.block_sparse import portable
        portable.GATHER_BUDGET = 1 << 20
        N = 1 << 16
        layout = layouts.local(N, 128, 8, causal=True)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, N, 1, 1, generator=g) for _ in range(3))
        base = rss_mb()
        out = block_sparse_attention(q, k, v, layout, causal=True, backend="torch")
        result["growth_mb"] = rss_mb() - base
        result["finite"] = bool(torch.isfinite(out).all())
    """)
    assert r["finite"] and r["growth_mb"] < 64, f"peak RSS growth {r['growth_mb']:.0f} MB"


# ----------------------------------------------------------------------------- block-sparse rows by width

def test_block_sparse_rows_gathered_by_width(monkeypatch):
    """Issue 13 item 9: every row was padded to the widest row (BigBird's global rows are
    n_blocks wide). Rows are bucketed by width now: the keys the portable path gathers stay
    within 2x of the active blocks (and empty rows cost nothing)."""
    N, bs, H = 1024, 16, 2
    layout = layouts.bigbird(N, bs, num_heads=H, seed=3)
    seen = []
    real = bs_portable.attention_with_lse

    def counting(q, k, v, *args, **kw):
        seen.append(q.shape[:-2].numel() * k.shape[-2])    # query blocks x gathered keys
        return real(q, k, v, *args, **kw)
    monkeypatch.setattr(bs_portable, "attention_with_lse", counting)
    q, k, v = (seeded((1, N, H, 16), torch.float32, s) for s in range(3))
    out = block_sparse_attention(q, k, v, layout, backend="torch")
    active_keys = int(layout.kv_num_blocks.sum()) * bs
    widest = int(layout.kv_num_blocks.max())
    assert widest * bs * layout.n_q_blocks * H > 4 * active_keys      # padding to the widest would be > 4x
    assert sum(seen) <= 2 * active_keys, f"gathered {sum(seen)} key slots for {active_keys} active keys"
    ref, _ = block_sparse_attention_naive(q, k, v, layout)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_buckets_match_oracle(causal):
    """Per-(batch, head) layouts of mixed widths (rows of width 0 too), GQA, ragged N,
    several chunks per bucket: out, lse and gradients against float64."""
    N, bs, B, Hq, Hkv, D = 150, 16, 2, 4, 2, 8
    nb = -(-N // bs)
    g = torch.Generator().manual_seed(7)
    dense = torch.rand(B, Hq, nb, nb, generator=g) < torch.rand(B, Hq, nb, 1, generator=g)
    dense[0, 1, 3] = False                                   # an empty row
    dense[1, 2, 5] = True                                    # a full row
    layout = BlockLayout.from_dense(dense, bs)
    q = seeded((B, N, Hq, D), torch.float32, 0).requires_grad_()
    k, v = (seeded((B, N, Hkv, D), torch.float32, s).requires_grad_() for s in (1, 2))
    old_budget = bs_portable.GATHER_BUDGET
    bs_portable.GATHER_BUDGET = 3 * bs * (2 * D + 2 * bs) * bs   # a few rows per chunk
    try:
        out, lse = block_sparse_attention(q, k, v, layout, causal=causal, return_lse=True, backend="torch")
    finally:
        bs_portable.GATHER_BUDGET = old_budget
    ref, ref_lse = block_sparse_attention_naive(q, k, v, layout, causal=causal)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)
    mask = element_mask(layout, N, causal)
    assert torch.equal(torch.isinf(ref_lse), ~mask.any(-1).expand(B, Hq, N))
    w = seeded((B, N, Hq, D), torch.float32, 9)
    got = torch.autograd.grad((out * w).sum() + torch.where(fin, lse, 0).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w.double()).sum() + torch.where(fin, ref_lse, 0).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- cost of the checks

class _FullScans:
    """Records the elementwise scans (isfinite and its parts, norms, sums) that read more than
    `numel` elements of one tensor, as (op name, numel)."""

    def __init__(self, numel):
        from torch.utils._python_dispatch import TorchDispatchMode

        scans, limit = [], numel

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name in ("isfinite", "abs", "ne", "eq", "linalg_vector_norm", "norm", "sum", "all", "aminmax"):
                    big = [a.numel() for a in args if isinstance(a, torch.Tensor) and a.numel() > limit]
                    if big:
                        scans.append((name, max(big)))
                return func(*args, **(kwargs or {}))

        self.mode, self.scans = Mode(), scans


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
@pytest.mark.parametrize("grad", [False, True])
def test_portable_nan_rule_and_score_bound_cost(mode, grad):
    """Issue 19 item 6: the NaN rule and the score bound took 55% of a head-group forward
    (isfinite over q, k and v: about five passes each; row norms of every pattern's q and k
    rows). Finite inputs now cost one sum over k and one over each job's result (its lse,
    D times smaller, aside); the norms run only when a gradient is needed. The result is
    unchanged (checked against float64)."""
    B, N, H, D = 1, 256, 6, 32
    ws, rs = [64, 128, 256], [1, 2, 4]
    q, k, v = (seeded((B, N, H, D), torch.float32, s).requires_grad_(grad) for s in range(3))
    scans = _FullScans(numel=B * N * H)   # lse-sized and smaller checks are free
    with torch.set_grad_enabled(grad), scans.mode:
        out = dilated_attention(q, k, v, ws, rs, causal=True, mode=mode, backend="torch")
    names = [name for name, _ in scans.scans]
    assert "isfinite" not in names and "abs" not in names, scans.scans
    assert ("linalg_vector_norm" in names) == grad, scans.scans      # the bound only for the backward
    sums = [n for name, n in scans.scans if name == "sum"]
    jobs = len(ws) if mode == "head_groups" else len(ws) * max(rs)   # (pattern, offset) pairs here
    assert sums[0] == k.numel() and len(sums) <= 1 + jobs, scans.scans
    ref, _ = dilated_attention_naive(q.double(), k.double(), v.double(), ws, rs, causal=True, mode=mode)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
