"""Argument edges (issue 13 item 8, issue 14's swapped lists and head-first layout): legal
extremes that must run (w >= 2^31, r >= 2^62, numpy integers, numpy arrays and ranges as
lengths) and the one validation vocabulary for integer arguments everywhere:
TypeError "<name> must be an int, got <type>", ValueError "<name> must be a positive int" /
"a non-negative int", "got <value>" (lists: "<name> must hold positive ints, got <value>")."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from tests.helpers.reference import FLOOR, assert_rule, seeded
from triton_dilated import block_sparse_attention, dilated_attention, layouts, shard
from triton_dilated.modules import DilatedAttention, MultiheadDilatedAttention
from triton_dilated.ops.dilated.naive import dilated_attention_naive
from triton_dilated.ops.ring.shard import shard_positions

BIG_W = 2 ** 31          # past int32
HUGE = 2 ** 62           # past what SymInt slicing arithmetic survives (r * rows overflows int64)


def _qkv(B=1, N=12, Hq=4, Hkv=2, D=8, device="cpu"):
    return (seeded((B, N, Hq, D), torch.float32, 1, device), seeded((B, N, Hkv, D), torch.float32, 2, device),
            seeded((B, N, Hkv, D), torch.float32, 3, device))


def _fwd_bwd(fn, q, k, v):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v)
    g = seeded(out.shape, torch.float32, 7, out.device)
    (out * g.to(out.dtype)).sum().backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


# ----------------------------------------------------------------------------- huge w and r

# (segment_lengths, dilation_rates, the same patterns at N = 12 with small numbers, mode)
HUGE_CASES = {
    "w-2^31": ([4, BIG_W], [1, 2], [4, 12], [1, 2], "longnet"),
    "w-r-2^62": ([HUGE], [HUGE], [12], [12], "longnet"),
    # r >= H: every head has offset j (heads 0..3), so all 4 heads stay distinct
    "w-2^62-r-2^40-blocked": ([3, HUGE], [1, 2 ** 40], [3, 12], [1, 12], "longnet"),
    "head-groups-w-2^63": ([6, 2 ** 63 - 1], [2, 2 ** 62], [6, 12], [2, 12], "head_groups"),
}


@pytest.mark.parametrize("case", list(HUGE_CASES))
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)], ids=["H2", "H4-gqa"])
def test_huge_segment_lengths_and_rates(case, backend, causal, heads, device):
    """w >= N is one segment (w is legal at any size); a rate past N leaves one row per
    segment. Both paths run and equal the float64 oracle on the original numbers and the call
    with the same patterns written small."""
    ws, rs, small_ws, small_rs, mode = HUGE_CASES[case]
    offsets = "blocked" if "blocked" in case else "modulo"
    q, k, v = _qkv(Hq=heads[0], Hkv=heads[1], device=device)
    kw = dict(causal=causal, mode=mode, offsets=offsets)
    got = _fwd_bwd(lambda *a: dilated_attention(*a, ws, rs, return_lse=True, backend=backend, **kw), q, k, v)
    small = _fwd_bwd(lambda *a: dilated_attention(*a, small_ws, small_rs, return_lse=True, backend=backend, **kw),
                     q, k, v)
    oracle = _fwd_bwd(lambda *a: dilated_attention_naive(*a, ws, rs, **kw), *(x.double() for x in (q, k, v)))
    for name, a, b, o in zip(("out", "lse", "dq", "dk", "dv"), got, small, oracle):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        assert_rule(name, a, o, b, factor=3, floor=FLOOR[torch.float32])


def test_huge_segment_length_in_module_and_under_compile():
    q, k, v = _qkv()
    ref = dilated_attention(q, k, v, [4, 12], [1, 2], backend="torch")
    m = DilatedAttention([4, HUGE], [1, 2], backend="torch")
    assert torch.equal(m(q, k, v), ref)
    torch._dynamo.reset()
    out = torch.compile(m, backend="aot_eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def _ring_worker(rank, world, init_file, queue):
    try:
        import datetime

        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        from triton_dilated import ring_attention
        x = seeded((1, 16, 2, 8), torch.float32, 0)
        xl = shard(x, rank, world)
        out = ring_attention(xl, xl, xl, group=dist.group.WORLD, segment_lengths=[4, HUGE], dilation_rates=[1, BIG_W],
                             causal=True)
        ref = shard(dilated_attention(x, x, x, [4, 16], [1, 16], causal=True, backend="torch"), rank, world)
        queue.put((rank, float((out - ref).abs().max())))
        dist.destroy_process_group()
    except Exception as e:   # reported to the parent
        queue.put((rank, repr(e)))


def test_huge_segment_length_in_ring_attention(tmp_path):
    """The ring's masks hold w and r as int32: a pattern spanning the ranks with w, r >= 2^31."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    queue, world = ctx.Queue(), 2
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"      # the children run the portable ring step
    try:
        procs = [ctx.Process(target=_ring_worker, args=(r, world, str(tmp_path / "rdv"), queue)) for r in range(world)]
        for p in procs:
            p.start()
    finally:
        os.environ.pop("TRITON_INTERPRET") if saved is None else os.environ.__setitem__("TRITON_INTERPRET", saved)
    try:
        results = dict(queue.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    # Two computations (the portable ring step on shards, merged by lse, against the portable
    # dilated path on the whole sequence, w and r written small), so equal up to rounding, not
    # bitwise: the CPU's BLAS picks kernels and summation orders by shape and ISA (an H100 host
    # gave 2^-24 = 5.96e-08 on rank 0: one float32 ulp in [0.5, 1)). A w or r wrapped in int32
    # changes which keys a query reads: errors of the size of v, far above 1e-6.
    assert sorted(results) == [0, 1] and all(isinstance(e, float) and e <= 1e-6 for e in results.values()), \
        results


def test_huge_segment_length_in_the_dilated_builder():
    small = layouts.dilated(128, [32, 128], [1, 32], block_size=16, num_heads=2)
    big = layouts.dilated(128, [32, 16 * HUGE], [1, 32], block_size=16, num_heads=2)
    assert torch.equal(big.to_dense(), small.to_dense())


# ----------------------------------------------------------------------------- numpy and ranges

def test_numpy_integers_for_block_size_and_seq_len():
    n, b = np.int64(96), np.int32(16)
    for build, kw in ((layouts.local, dict(window=np.int64(1))), (layouts.causal, {}),
                      (layouts.global_tokens, dict(num_global_blocks=np.int64(1))),
                      (layouts.random, dict(num_random=np.int64(1), num_heads=np.int64(2), batch=np.int8(1),
                                            seed=np.int64(3))),
                      (layouts.bigbird, dict(num_heads=np.int64(2))),
                      (layouts.hierarchical, dict(levels=((np.int64(2), np.int64(1)),)))):
        got = build(n, b, **kw)
        ref = build(96, 16, **{key: ((2, 1),) if key == "levels" else int(val) for key, val in kw.items()})
        assert type(got.block_size) is int and got.block_size == 16, build.__name__
        assert torch.equal(got.to_dense(), ref.to_dense()), build.__name__
    got = layouts.dilated(n, np.array([32, 64]), range(1, 17, 15), block_size=b, num_heads=np.int64(2))
    assert torch.equal(got.to_dense(), layouts.dilated(96, [32, 64], [1, 16], block_size=16, num_heads=2).to_dense())
    q = seeded((1, 64, 2, 16), torch.float32, 0)
    assert torch.equal(layouts.topk(q, q, np.int64(2), np.int64(16)).to_dense(),
                       layouts.topk(q, q, 2, 16).to_dense())


@pytest.mark.parametrize("ws, rs", [
    (np.array([4, 12]), np.array([1, 2])),
    (range(4, 13, 8), range(1, 3)),
    (np.array([4, 12], dtype=np.int32), (np.int8(1), np.uint16(2))),
], ids=["numpy-arrays", "ranges", "numpy-int32-array-and-scalars"])
def test_numpy_arrays_and_ranges_as_lengths(ws, rs):
    q, k, v = _qkv()
    ref = dilated_attention(q, k, v, [4, 12], [1, 2], backend="torch")
    assert torch.equal(dilated_attention(q, k, v, ws, rs, backend="torch"), ref)
    assert torch.equal(DilatedAttention(ws, rs, backend="torch")(q, k, v), ref)
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(32, 4, rs, ws, backend="torch")
    assert m.attention.segment_lengths == [4, 12] and m.attention.dilation_rates == [1, 2]


def test_cu_seqlens_accepts_numpy_and_ranges():
    q, k, v = _qkv(N=12)
    ref = dilated_attention(q, k, v, [4], [1], cu_seqlens=[0, 5, 12], backend="torch")
    for bounds in (np.array([0, 5, 12]), (np.int64(0), 5, np.int32(12)), torch.tensor([0, 5, 12])):
        assert torch.equal(dilated_attention(q, k, v, [4], [1], cu_seqlens=bounds, backend="torch"), ref)
    assert torch.equal(dilated_attention(q, k, v, [4], [1], cu_seqlens=range(0, 13, 12), backend="torch"),
                       dilated_attention(q, k, v, [4], [1], backend="torch"))


# ----------------------------------------------------------------------------- swapped lists

@pytest.mark.parametrize("call", [
    lambda q: dilated_attention(q, q, q, [1, 2, 4], [512, 1024, 2048], backend="torch"),
    lambda q: dilated_attention(q, q, q, [8, 4], [2, 8], backend="triton"),
    lambda q: DilatedAttention([1, 2, 4], [512, 1024, 2048]),
    lambda q: MultiheadDilatedAttention(32, 4, [512, 1024], [1, 2]),      # rates first: lengths given as rates
    lambda q: layouts.dilated(64, [16], [32], block_size=16),
], ids=["function", "function-second-pattern", "module", "multihead", "builder"])
def test_rate_above_segment_length_says_the_lists_look_swapped(call):
    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match=r"dilation_rates\[\d\] = \d+ is larger than segment_lengths\[\d\] = \d+"
                                         r".*look swapped"):
        call(q)


def test_rate_equal_to_segment_length_is_legal():
    q, k, v = _qkv(N=8)
    out, lse = dilated_attention(q, k, v, [4], [4], return_lse=True, backend="torch")
    ref, ref_lse = dilated_attention_naive(q, k, v, [4], [4])
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- head-first layout

def test_warns_on_sdpa_layout():
    """(B, H, N, D) tensors passed as (B, N, H, D): 4 "tokens" and 64 "heads", and every
    segment covers the whole "sequence"."""
    q = torch.randn(1, 4, 64, 8)      # really 4 heads of 64 tokens
    with pytest.warns(UserWarning, match=r"q has 64 heads but a sequence length of only 4.*\(B, H, N, D\)"):
        dilated_attention(q, q, q, [2048], [1], backend="torch")
    with pytest.warns(UserWarning, match="transpose"):
        DilatedAttention([2048, 4096], [1, 2], backend="torch")(q, q, q)


@pytest.mark.parametrize("shape, ws", [
    ((1, 64, 4, 8), [2048]),          # the right layout
    ((1, 4, 64, 8), [2, 4]),          # many heads, but a segment shorter than N: deliberate
    ((1, 8, 8, 8), [8]),              # as many heads as tokens
], ids=["bhnd-ok", "short-segment", "heads-equal-tokens"])
def test_no_layout_warning_otherwise(shape, ws):
    q = torch.randn(*shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dilated_attention(q, q, q, ws, [1] * len(ws), backend="torch")


# ----------------------------------------------------------------------------- one vocabulary

def _q():
    return torch.randn(1, 16, 2, 8)


REJECTED = [
    # builders: seq_len, block_size and the counts
    ("local-seq_len-float", lambda: layouts.local(64.0, 16), TypeError, r"^seq_len must be an int, got float"),
    ("local-seq_len-zero", lambda: layouts.local(0, 16), ValueError, r"^seq_len must be a positive int, got 0"),
    ("local-block-float", lambda: layouts.local(64, 16.0), TypeError, r"^block_size must be an int, got float"),
    ("local-block-bool", lambda: layouts.local(64, True), TypeError, r"^block_size must be an int, got a bool"),
    ("local-block-24", lambda: layouts.local(64, np.int64(24)), ValueError, r"^block_size must be a power of two"),
    ("local-window-neg", lambda: layouts.local(64, 16, window=-1), ValueError,
     r"^window must be a non-negative int, got -1"),
    ("local-causal-int", lambda: layouts.local(64, 16, causal=1), TypeError, r"^causal must be a bool, got int"),
    ("hierarchical-window-neg", lambda: layouts.hierarchical(64, 16, window=-1), ValueError,
     r"^window must be a non-negative int, got -1"),
    ("hierarchical-window-float", lambda: layouts.hierarchical(64, 16, window=1.5), TypeError,
     r"^window must be an int, got float"),
    ("hierarchical-stride-zero", lambda: layouts.hierarchical(64, 16, levels=((0, 1),)), ValueError,
     r"^levels\[0\] stride must be a positive int, got 0"),
    ("hierarchical-reach-neg", lambda: layouts.hierarchical(64, 16, levels=((4, 1), (2, -1))), ValueError,
     r"^levels\[1\] reach must be a non-negative int, got -1"),
    ("hierarchical-levels-int", lambda: layouts.hierarchical(64, 16, levels=4), TypeError,
     r"^levels must be a list or tuple of \(stride, reach\) pairs, got int"),
    ("hierarchical-level-triple", lambda: layouts.hierarchical(64, 16, levels=((4, 1, 1),)), TypeError,
     r"^levels\[0\] must be a \(stride, reach\) pair"),
    ("random-heads-zero", lambda: layouts.random(64, 16, num_heads=0), ValueError,
     r"^num_heads must be a positive int, got 0"),
    ("random-batch-neg", lambda: layouts.random(64, 16, batch=-1), ValueError,
     r"^batch must be a positive int, got -1"),
    ("random-num_random-neg", lambda: layouts.random(64, 16, num_random=-2), ValueError,
     r"^num_random must be a non-negative int, got -2"),
    ("random-seed-str", lambda: layouts.random(64, 16, seed="0"), TypeError, r"^seed must be an int, got str"),
    ("bigbird-heads-zero", lambda: layouts.bigbird(64, 16, num_heads=0), ValueError,
     r"^num_heads must be a positive int, got 0"),
    ("bigbird-batch-zero", lambda: layouts.bigbird(64, 16, batch=0), ValueError,
     r"^batch must be a positive int, got 0"),
    ("bigbird-globals-neg", lambda: layouts.bigbird(64, 16, num_global_blocks=-1), ValueError,
     r"^num_global_blocks must be a non-negative int, got -1"),
    ("dilated-heads-zero", lambda: layouts.dilated(64, [32], [16], block_size=16, num_heads=0), ValueError,
     r"^num_heads must be a positive int, got 0"),
    ("global-neg", lambda: layouts.global_tokens(64, 16, num_global_blocks=-1), ValueError,
     r"^num_global_blocks must be a non-negative int, got -1"),
    ("topk-float", lambda: layouts.topk(_q(), _q(), 1.5, 16), TypeError, r"^top_k must be an int, got float"),
    # cu_seqlens
    ("cu-negative", lambda: dilated_attention(_q(), _q(), _q(), [4], [1], cu_seqlens=[-8, 16]), ValueError,
     r"^cu_seqlens must hold non-negative ints, got -8$"),
    ("cu-str", lambda: dilated_attention(_q(), _q(), _q(), [4], [1], cu_seqlens="0,16"), TypeError,
     r"^cu_seqlens must be a list or tuple of non-negative ints .*got str"),
    ("cu-int", lambda: dilated_attention(_q(), _q(), _q(), [4], [1], cu_seqlens=16), TypeError,
     r"^cu_seqlens must be a list or tuple .*got int"),
    ("cu-float-item", lambda: dilated_attention(_q(), _q(), _q(), [4], [1], cu_seqlens=[0, 16.0]), TypeError,
     r"^cu_seqlens must hold ints, got 16.0"),
    ("cu-float-tensor", lambda: dilated_attention(_q(), _q(), _q(), [4], [1], cu_seqlens=torch.tensor([0.0, 16.0])),
     TypeError, r"^cu_seqlens must hold ints, got a tensor of torch.float32"),
    ("cu-2d", lambda: dilated_attention(_q(), _q(), _q(), [4], [1], cu_seqlens=np.array([[0, 16]])), ValueError,
     r"^cu_seqlens must be 1-D, got an array of shape \(1, 2\)"),
    ("cu-block-sparse-negative",
     lambda: block_sparse_attention(_q(), _q(), _q(), lambda n: layouts.local(n, 16), cu_seqlens=[-8, 16]),
     ValueError, r"^cu_seqlens must hold non-negative ints, got -8$"),
    ("cu-block-sparse-str",
     lambda: block_sparse_attention(_q(), _q(), _q(), lambda n: layouts.local(n, 16), cu_seqlens="0"),
     TypeError, r"^cu_seqlens must be a list or tuple"),
    # pattern lists
    ("w-2d-array", lambda: dilated_attention(_q(), _q(), _q(), np.array([[4]]), [1]), ValueError,
     r"^segment_lengths must be 1-D"),
    ("w-float-array", lambda: dilated_attention(_q(), _q(), _q(), np.array([4.0]), [1]), TypeError,
     r"^segment_lengths must hold ints, got an array of float64"),
    ("w-set", lambda: dilated_attention(_q(), _q(), _q(), {4}, [1]), TypeError,
     r"^segment_lengths must be a list or tuple of positive ints .*got set"),
    ("r-bool-array", lambda: dilated_attention(_q(), _q(), _q(), [4], np.array([True])), TypeError,
     r"^dilation_rates must hold ints"),
    # sharding
    ("shard-world-float", lambda: shard(torch.randn(1, 8, 2), 0, 2.0), TypeError,
     r"^world_size must be an int, got float"),
    ("shard-world-zero", lambda: shard(torch.randn(1, 8, 2), 0, 0), ValueError,
     r"^world_size must be a positive int, got 0"),
    ("shard-rank-str", lambda: shard(torch.randn(1, 8, 2), "0", 2), TypeError, r"^rank must be an int, got str"),
    ("shard-rank-neg", lambda: shard(torch.randn(1, 8, 2), -1, 2), ValueError,
     r"^rank must be a non-negative int, got -1"),
    ("shard-rank-past", lambda: shard(torch.randn(1, 8, 2), 2, 2), ValueError, r"^rank must lie in \[0, 2\), got 2"),
    # modules
    ("mhda-heads-float", lambda: MultiheadDilatedAttention(32, 4.0, [1], [8]), TypeError,
     r"^num_heads must be an int, got float"),
    ("mhda-embed-zero", lambda: MultiheadDilatedAttention(0, 4, [1], [8]), ValueError,
     r"^embed_dim must be a positive int, got 0"),
    ("mhda-kv-heads-bool", lambda: MultiheadDilatedAttention(32, 4, [1], [8], num_kv_heads=True), TypeError,
     r"^num_kv_heads must be an int, got a bool"),
]


@pytest.mark.parametrize("thunk, exc, match", [pytest.param(t, e, m, id=i) for i, t, e, m in REJECTED])
def test_rejected_integer_arguments(thunk, exc, match):
    with pytest.raises(exc, match=match):
        thunk()


def test_numpy_integers_for_shard_and_modules():
    x = torch.randn(1, 8, 2)
    assert torch.equal(shard(x, np.int64(1), np.int32(2)), shard(x, 1, 2))
    assert torch.equal(shard_positions(np.int64(8), np.int64(1), np.int64(2)), shard_positions(8, 1, 2))
    m = MultiheadDilatedAttention(np.int64(32), np.int64(4), [1], [8], num_kv_heads=np.int32(2))
    assert (m.embed_dim, m.num_heads, m.num_kv_heads) == (32, 4, 2) and type(m.num_heads) is int
