"""Exact sliding windows (issue 23 item 3): `layouts.sliding_window(n, block_size, window,
sinks=0)`, a BlockLayout carrying the element predicate p - window < p' <= p (or p' < sinks,
p' <= p) beside its block table, in the block-sparse Triton kernels (forward, dQ, dK/dV,
decode), the portable paths, the float64 oracle and the ring step.

The independent definition every check ends at: transformers' own
`sliding_window_causal_mask_function` (masking_utils), OR'd with the sink tokens, evaluated on
the dense (N x N) grid, joined with the other layout's dense element mask for unions
(`definition`). The oracle is checked against it (dense_reference in float64), the kernels and
paths against the oracle by the tolerance rule (tests/helpers/reference.py), forward and backward.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.conftest import DEVICE
from tests.helpers.reference import (FLOOR, assert_rule_all, block_sparse_serve, check_against_oracle, dense_reference,
                                     finite, max_err, seeded)
from triton_dilated.ops.common.call import AttentionCall
from triton_dilated import (BlockLayout, block_sparse_attention, block_sparse_attention_naive,
                            block_sparse_attention_op, block_sparse_attention_with_kvcache, layouts)
from triton_dilated.ops.common.masks import WindowPredicate

masking_utils = pytest.importorskip("transformers.masking_utils")

BACKENDS = ["triton", "torch"]
# the interpreter gets bfloat16 tl.dot wrong (DESIGN §10): bfloat16 kernels on a GPU only
DTYPES = {"triton": [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []),
          "torch": [torch.float32, torch.float16, torch.bfloat16]}


def transformers_window(n, window, sinks):
    """bool (N, N): transformers' sliding_window_causal_mask_function(window) on the grid, OR
    the first `sinks` keys (causally)."""
    fn = masking_utils.sliding_window_causal_mask_function(window)
    q, kv = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = fn(0, 0, q, kv)
    return mask | ((kv < sinks) & (kv <= q))


def plain_mask(layout, n, causal):
    """The dense element mask of a layout without a window (blocks expanded, causal cut)."""
    bs = layout.block_size
    m = layout.to_dense().repeat_interleave(bs, -2).repeat_interleave(bs, -1)[..., :n, :n]
    return m & torch.ones(n, n, dtype=torch.bool).tril() if causal else m


def definition(n, bs, window, sinks, other=None, op="|"):
    """(B|1, H|1, N, N): the window's element set, joined (op) with `other`'s (causal)."""
    win = transformers_window(n, window, sinks)[None, None]
    if other is None:
        return win
    o = plain_mask(other, n, True)
    return (win | o) if op == "|" else (win & o)


def make_layout(n, bs, window, sinks, other=None, op="|"):
    lay = layouts.sliding_window(n, bs, window, sinks=sinks)
    if other is not None:
        lay = (lay | other) if op == "|" else (lay & other)
    return lay


# ----------------------------------------------------------------------------- the layout

@pytest.mark.parametrize("bs", [16, 32])
def test_builder_is_transformers_window_exactly(bs):
    """Every (n, window, sinks) on a grid, window below, at and above the block size, sink
    tokens inside and across blocks: the element mask is transformers' (off-by-one included:
    `window` keys counting the query itself); the active blocks are exactly those with a
    visible pair and the blocks run without the predicate exactly those wholly visible."""
    for n, window, sinks in itertools.product([1, 40, 77], [1, 2, bs - 1, bs, bs + 1, 2 * bs + 3, 200],
                                              [0, 1, 4, bs + 3]):
        lay = layouts.sliding_window(n, bs, window, sinks=sinks)
        ref = transformers_window(n, window, sinks)
        assert torch.equal(lay.element_mask(n, True)[0, 0], ref), (n, window, sinks)
        nb = lay.n_q_blocks
        full = transformers_window(nb * bs, window, sinks).view(nb, bs, nb, bs)
        dense, flagged = lay.to_dense()[0, 0], lay.window_blocks_dense()[0, 0]
        assert torch.equal(dense, full.any(3).any(1)), (n, window, sinks)
        assert torch.equal(dense & ~flagged, full.all(3).all(1)), (n, window, sinks)
        # past the padded length a window or sink count is clamped to it (the same mask)
        assert lay.window == WindowPredicate(min(window, nb * bs), min(sinks, nb * bs)), (n, window, sinks)


def test_window_of_one_and_huge_windows():
    """window = 1: each query sees only itself; window >= N: dense causal attention."""
    n = 40
    assert torch.equal(layouts.sliding_window(n, 16, 1).element_mask(n, True)[0, 0], torch.eye(n, dtype=torch.bool))
    big = layouts.sliding_window(n, 16, 10 ** 6)
    assert torch.equal(big.element_mask(n, True)[0, 0], torch.ones(n, n, dtype=torch.bool).tril())
    assert torch.equal(big.to_dense(), layouts.causal(n, 16).to_dense())


@pytest.mark.parametrize("other_kind", ["global", "random", "local", "dense"])
@pytest.mark.parametrize("op", ["|", "&"])
def test_union_and_intersection_are_the_element_sets(other_kind, op):
    """`|`: the union of the element sets (a block of the other layout is visible whole, its
    causal part: the predicate no longer applies there); `&`: their intersection. Per head
    layouts broadcast against the window's (1, 1)."""
    n, bs = 90, 16
    other = {"global": layouts.global_tokens(n, bs, 1, causal=True),
             "random": layouts.random(n, bs, 2, seed=3, num_heads=2),
             "local": layouts.local(n, bs, 1),
             "dense": BlockLayout.from_dense(torch.ones(6, 6, dtype=torch.bool), bs)}[other_kind]
    for window, sinks in ((5, 0), (20, 3), (33, 17)):
        lay = make_layout(n, bs, window, sinks, other, op)
        want = definition(n, bs, window, sinks, other, op)
        got = lay.element_mask(n, True)
        assert torch.equal(*torch.broadcast_tensors(got, want)), (other_kind, op, window, sinks)
        # commutes, and combining with itself changes nothing
        flipped = (other | layouts.sliding_window(n, bs, window, sinks=sinks)) if op == "|" else \
            (other & layouts.sliding_window(n, bs, window, sinks=sinks))
        assert torch.equal(flipped.element_mask(n, True), got)
        assert torch.equal((lay | lay).element_mask(n, True), got)


def test_combining_different_windows_and_non_causal_calls_are_errors():
    n = 64
    a, b = layouts.sliding_window(n, 16, 8), layouts.sliding_window(n, 16, 8, sinks=1)
    for combine in (lambda: a | b, lambda: a & b):
        with pytest.raises(ValueError, match="different sliding windows"):
            combine()
    q = k = v = torch.zeros(1, n, 2, 8)
    calls = [lambda: block_sparse_attention(q, k, v, a, backend="torch"),
             lambda: block_sparse_attention(q, k, v, a | layouts.local(n, 16, 1), backend="triton"),
             lambda: block_sparse_attention_op(q, k, v, a, backend="torch"),
             lambda: block_sparse_attention_naive(q, k, v, a),
             lambda: block_sparse_attention_with_kvcache(q[:, :1], k, v, cache_seqlens=torch.tensor([n]), layout=a,
                                                         causal=False)]
    for call in calls:
        with pytest.raises(ValueError, match="causal=True, got causal=False"):
            call()


@pytest.mark.parametrize("bad, exc, msg", [
    (dict(window=0), ValueError, "window must be"), (dict(window=2.5), TypeError, "window must be an int"),
    (dict(window=True), TypeError, "window must be an int"), (dict(sinks=-1), ValueError, "sinks must be"),
    (dict(sinks="4"), TypeError, "sinks must be an int"), (dict(block_size=24), ValueError, "block_size"),
])
def test_builder_validation(bad, exc, msg):
    kw = dict(seq_len=64, block_size=16, window=8, sinks=0)
    kw.update(bad)
    with pytest.raises(exc, match=msg):
        layouts.sliding_window(**kw)


def test_layout_transforms_keep_the_window():
    """heads() (Ulysses), prefix() (queries shorter than keys), to() and the union with a
    per-head layout keep the predicate and the flags."""
    n, bs = 80, 16
    lay = layouts.sliding_window(n, bs, 20, sinks=2) | layouts.random(n, bs, 1, seed=0, num_heads=4)
    sliced = lay.heads(1, 3)
    assert sliced.window == lay.window
    assert torch.equal(sliced.element_mask(n, True), lay.element_mask(n, True)[:, 1:3])
    pre = lay.prefix(3)
    assert pre.window == lay.window
    assert torch.equal(pre.element_mask(48, True), lay.element_mask(n, True)[..., :48, :48])
    assert torch.equal(lay.to("cpu").element_mask(n, True), lay.element_mask(n, True))


def test_flex_block_mask_and_module_keep_the_window():
    """to_flex_block_mask: its mask_mod is the element mask, its "full" blocks wholly visible;
    BlockSparseAttention with a fixed window layout (buffers) computes the window."""
    from triton_dilated import BlockSparseAttention
    n, bs = 80, 16
    lay = layouts.sliding_window(n, bs, 20, sinks=3) | layouts.global_tokens(n, bs, 1, causal=True)
    bm = lay.to_flex_block_mask(n, causal=True)
    q, kv = torch.arange(n)[:, None], torch.arange(n)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    got = bm.mask_mod(zero, zero, q, kv)
    want = lay.element_mask(n, True)[0, 0]
    assert torch.equal(got, want)
    full = torch.zeros(5, 5, dtype=torch.bool)
    for r in range(5):
        for j in range(int(bm.full_kv_num_blocks[0, 0, r])):
            full[r, int(bm.full_kv_indices[0, 0, r, j])] = True
    blocks = want.view(5, bs, 5, bs)
    assert not full.any() or blocks.all(3).all(1)[full].all()
    module = BlockSparseAttention(lay, causal=True)
    assert module.layout.window == lay.window
    x = seeded((1, n, 2, 8), torch.float32, 0, DEVICE)
    o64, _ = block_sparse_attention_naive(x.double(), x.double(), x.double(), lay, causal=True)
    assert max_err(module(x, x, x), o64) < 1e-5


# ----------------------------------------------------------------------------- attention

@st.composite
def window_cases(draw, backend):
    bs = draw(st.sampled_from([16, 32, 64]))
    N = draw(st.integers(1, 96))
    window = draw(st.sampled_from([1, 3, bs // 2, bs - 1, bs, bs + 5, 2 * bs + 1, 300]))
    sinks = draw(st.sampled_from([0, 1, 4]))
    other = draw(st.sampled_from([None, "global", "random"]))
    Hkv = draw(st.integers(1, 2))
    return dict(N=N, bs=bs, window=window, sinks=sinks, other=other, op=draw(st.sampled_from(["|", "|", "&"])),
                Hkv=Hkv, Hq=Hkv * draw(st.sampled_from([1, 2])), D=draw(st.sampled_from([8, 24])),
                dtype=draw(st.sampled_from(DTYPES[backend])), seed=draw(st.integers(0, 9999)))


def case_layout(c):
    n, bs = c["N"], c["bs"]
    other = {None: None, "global": layouts.global_tokens(n, bs, 1, causal=True),
             "random": layouts.random(n, bs, 2, seed=c["seed"], num_heads=c["Hq"])}[c["other"]]
    return make_layout(n, bs, c["window"], c["sinks"], other, c["op"]), \
        definition(n, bs, c["window"], c["sinks"], other, c["op"])


def qkv_of(c, device=DEVICE):
    B, N, Hq, Hkv, D = 1, c["N"], c["Hq"], c["Hkv"], c["D"]
    return tuple(seeded(s, torch.float64, c["seed"] + i).to(device=device, dtype=c["dtype"])
                 for i, s in enumerate(((B, N, Hq, D), (B, N, Hkv, D), (B, N, Hkv, D))))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=14)
@given(data=st.data())
def test_window_attention_matches_oracle(backend, data):
    """Windows below, at and above the block size (edges inside blocks and inside sub-tiles:
    block 64 runs 32-row tiles), sink tokens 0/1/4, unions and intersections with global and
    per-head random layouts, ragged N, GQA, the dtypes: out, lse, dq, dk, dv against the float64
    oracle, and the oracle against transformers' mask (dense, float64)."""
    c = data.draw(window_cases(backend), label="case")
    lay, counts = case_layout(c)
    qkv = qkv_of(c)
    fn = lambda q, k, v: block_sparse_attention(q, k, v, lay, causal=True, return_lse=True,  # noqa: E731
                                                backend=backend)
    oracle = lambda q, k, v: block_sparse_attention_naive(q, k, v, lay, causal=True)  # noqa: E731
    same = lambda q, k, v: dense_reference(q, k, v, counts.double().to(q.device))  # noqa: E731
    check_against_oracle(fn, oracle, same, qkv, counts=counts.double().to(DEVICE), seed=c["seed"])
    a = [x.detach().double().requires_grad_() for x in qkv]
    oa, la = oracle(*a)
    ob, lb = dense_reference(*[x.detach().double() for x in qkv], counts.double().to(DEVICE))
    assert max_err(oa, ob) <= 1e-9 and max_err(finite(la), finite(lb)) <= 1e-9
    assert torch.equal(torch.isinf(la), torch.isinf(lb))


@pytest.mark.parametrize("config, windows", [
    (dict(BLOCK_M=16, BLOCK_N=16), ((5, 0),)),
    (dict(BLOCK_M=32, BLOCK_N=16), ((70, 3),)),
    (dict(BLOCK_M=16, BLOCK_N=32, TMA=1), ((20, 1),)),
], ids=["16x16", "32x16", "tma"])
def test_kernels_with_small_tiles(config, windows):
    """The Triton kernels directly, with tiles smaller than the block (the window loop's start
    skips the sub-tiles no row of the tile sees; the dK/dV window loop cuts queries at the
    band's reach), and the forward through TMA descriptors: against the oracle."""
    from triton_dilated.ops.block_sparse import kernels
    from triton_dilated.ops.common.lse import lse_from_stats
    n, bs = 100, 64
    cfg = dict(config, num_warps=4, num_stages=1)
    for window, sinks in windows:
        c = dict(N=n, Hq=2, Hkv=1, D=16, dtype=torch.float32, seed=window)
        q, k, v = qkv_of(c)
        # the kernels take the layout's lists on q's device (the public functions move it there)
        lay = (layouts.sliding_window(n, bs, window, sinks=sinks)
               | layouts.global_tokens(n, bs, 1, causal=True)).to(q.device)
        out, m, s = kernels.block_sparse_forward(q, k, v, lay, AttentionCall(True, 0.25), config=cfg)
        ref_q, ref_k, ref_v = (x.double().requires_grad_() for x in (q, k, v))
        o64, l64 = block_sparse_attention_naive(ref_q, ref_k, ref_v, lay, causal=True, scale=0.25)
        assert max_err(out, o64) < 1e-5 and max_err(finite(lse_from_stats(m, s)), finite(l64)) < 1e-5
        do = seeded(out.shape, torch.float32, 7, DEVICE)
        dlse = seeded((1, 2, n), torch.float32, 8, DEVICE)
        bwd_cfg = {key: val for key, val in cfg.items() if key != "TMA"}
        dq, dk, dv = kernels.block_sparse_backward(do, dlse, q, k, v, out, m, s, lay, AttentionCall(True, 0.25),
                                                   config=bwd_cfg)
        g64 = torch.autograd.grad((o64 * do.double()).sum() + (finite(l64) * dlse.double()).sum(),
                                  (ref_q, ref_k, ref_v))
        for got, want in zip((dq, dk, dv), g64):
            assert max_err(got, want) < 2e-5, (window, sinks)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_documents_and_custom_op(backend):
    """cu_seqlens (a window layout per document, from a builder) and the custom op (both
    paths): against the oracle per document."""
    n_docs = [37, 50]
    cu = torch.tensor([0, 37, 87], dtype=torch.int32, device=DEVICE)
    c = dict(N=87, Hq=2, Hkv=1, D=16, dtype=torch.float32, seed=5)
    q, k, v = qkv_of(c)
    out = block_sparse_attention(q, k, v, lambda n: layouts.sliding_window(n, 16, 9, sinks=1), causal=True,
                                 cu_seqlens=cu, backend=backend)
    s = 0
    for n in n_docs:
        o64, _ = block_sparse_attention_naive(q[:, s:s + n], k[:, s:s + n], v[:, s:s + n],
                                              layouts.sliding_window(n, 16, 9, sinks=1), causal=True)
        assert max_err(out[:, s:s + n], o64) < 1e-5
        s += n
    lay = layouts.sliding_window(87, 32, 20, sinks=2) | layouts.local(87, 32, 0)
    qs = q.detach().requires_grad_()
    o, lse = block_sparse_attention_op(qs, k, v, lay, causal=True, return_lse=True, backend=backend)
    q64 = q.detach().double().requires_grad_()
    o64, l64 = block_sparse_attention_naive(q64, k.double(), v.double(), lay, causal=True)
    assert max_err(o, o64) < 1e-5 and max_err(lse, l64) < 1e-5
    (gq,) = torch.autograd.grad(o.sum(), qs)
    (gq64,) = torch.autograd.grad(o64.sum(), q64)
    assert max_err(gq, gq64) < 2e-5


# ----------------------------------------------------------------------------- decode

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_applies_the_window(backend, splits, monkeypatch):
    """block_sparse_attention_with_kvcache (gpt-oss sliding layers decoding): rows of
    different lengths, a few query rows, GQA, windows inside and across blocks, sink tokens,
    a union; the Triton kernel with 1 and 3 splits: each row equals the oracle's row."""
    from triton_dilated.ops.block_sparse import decode_kernels
    monkeypatch.setattr(decode_kernels, "num_splits", lambda *a: splits)
    N, bs = 96, 32
    c = dict(N=N, Hq=4, Hkv=2, D=16, dtype=torch.float32, seed=11)
    q, k, v = qkv_of(c)
    q = torch.cat([q, seeded(q.shape, torch.float32, 3, DEVICE)])
    k = torch.cat([k, seeded(k.shape, torch.float32, 4, DEVICE)])
    v = torch.cat([v, seeded(v.shape, torch.float32, 5, DEVICE)])
    lens = [96, 61]
    cache_seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)   # on q's device, as the entry point asks
    cases = ((5, 0, None), (1, 33, None)) if splits == 1 else \
        ((40, 4, None), (9, 1, layouts.global_tokens(N, bs, 1, causal=True)))
    for window, sinks, other in cases:
        lay = make_layout(N, bs, window, sinks, other)
        nq = 3
        qq = torch.stack([q[b, L - nq:L] for b, L in enumerate(lens)])
        out, lse = block_sparse_attention_with_kvcache(qq, k, v, cache_seqlens=cache_seqlens, layout=lay,
                                                       return_lse=True, backend=backend)
        for b, L in enumerate(lens):
            o64, l64 = block_sparse_attention_naive(q[b:b + 1, :L], k[b:b + 1, :L], v[b:b + 1, :L],
                                                    lay.prefix(math.ceil(L / bs)), causal=True)
            assert max_err(out[b], o64[0, L - nq:]) < 1e-5, (window, sinks, b)
            assert max_err(lse[b], l64[0, :, L - nq:]) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_half_precision_and_gradients(backend):
    """float16 decode against the oracle by the tolerance rule; the portable decode's
    gradients (autograd) and the Triton path's (the serve door's query-offset path: the
    training kernels) against the oracle."""
    N, bs = 70, 16
    lay = layouts.sliding_window(N, bs, 12, sinks=2)
    c = dict(N=N, Hq=2, Hkv=1, D=16, dtype=torch.float16, seed=21)
    q, k, v = qkv_of(c)
    qq = q[:, -2:].contiguous()
    cache_seqlens = torch.tensor([N], dtype=torch.int32, device=DEVICE)   # on q's device, as the entry point asks
    out = block_sparse_attention_with_kvcache(qq, k, v, cache_seqlens=cache_seqlens, layout=lay, backend=backend)
    o64, _ = block_sparse_attention_naive(q.double(), k.double(), v.double(), lay, causal=True)
    assert max_err(out, o64[:, -2:]) < 2e-3
    c["dtype"] = torch.float32
    q, k, v = (x.requires_grad_() for x in qkv_of(c))
    o = block_sparse_serve(q[:, -2:], k, v, lay, causal=True, backend=backend)
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    o64, _ = block_sparse_attention_naive(q64, k64, v64, lay, causal=True)
    g64 = torch.autograd.grad(o64[:, -2:].sum(), (q64, k64, v64))
    for got, want in zip(grads, g64):
        assert max_err(got, want) < 2e-5


# ----------------------------------------------------------------------------- ring

@pytest.mark.parametrize("use_kernel", [True, False], ids=["step-kernel", "portable-step"])
def test_ring_step_alone(use_kernel):
    """The ring-local-block step (Triton kernels, portable step) with a window layout's block
    table (2 = window block): shards in any order, merged, forward and backward, against the
    oracle (and the tile lists skip tiles outside the band: still exact)."""
    from triton_dilated.ops.ring import step_kernels, step_portable
    from triton_dilated.ops.ring.mask import MASK_LAYOUT, StepMask
    step = step_kernels if use_kernel else step_portable
    N, bs = 72, 16
    lay = layouts.sliding_window(N, bs, 21, sinks=3) | layouts.random(N, bs, 1, seed=2, num_heads=2)
    c = dict(N=N, Hq=2, Hkv=1, D=16, dtype=torch.float32, seed=31)
    q, k, v = qkv_of(c)
    do = seeded(q.shape, torch.float32, 9, DEVICE)
    mask = StepMask(MASK_LAYOUT, True, q.device, layout=lay)
    pos = torch.arange(N, dtype=torch.int32, device=q.device)
    shards = (slice(48, 72), slice(0, 30), slice(30, 48))
    out = torch.zeros_like(q)
    lse = torch.full((1, 2, N), float("-inf"), device=q.device)
    for s in shards:
        step.step_forward(q, k[:, s], v[:, s], pos, pos[s].contiguous(), out, lse, mask, AttentionCall(mask.causal, 0.25))
    delta = (do * out).sum(-1).transpose(1, 2).contiguous()
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for s in shards:
        dks, dvs = dk[:, s].clone(), dv[:, s].clone()
        step.step_backward(q, k[:, s], v[:, s], do, lse, delta, pos, pos[s].contiguous(), dq, dks, dvs, mask,
                           AttentionCall(mask.causal, 0.25))
        dk[:, s], dv[:, s] = dks, dvs
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    o64, l64 = block_sparse_attention_naive(*leaves, lay, causal=True, scale=0.25)
    g64 = torch.autograd.grad((o64 * do.double()).sum(), leaves)
    for got, want in zip((out, lse, dq, dk, dv), (o64, l64, *g64)):
        assert max_err(finite(got), finite(want)) < 2e-5


RING_CASES = [
    dict(kind="window", B=1, N=96, Hq=2, Hkv=1, D=8, causal=True, bs=16, window=21, sinks=3),
    dict(kind="window", B=1, N=96, Hq=2, Hkv=2, D=8, causal=True, bs=32, window=7, sinks=1, balance="zigzag",
         comm="allgather", union=True),
    dict(kind="window", B=1, N=64, Hq=2, Hkv=2, D=8, causal=True, bs=16, window=9, sinks=0, fn="ulysses",
         union=True),
]


@pytest.mark.gloo
def test_ring_attention_on_a_world_of_two():
    """ring_attention(layout=sliding_window(...)) on 2 gloo processes (p2p and all-gather,
    contiguous and zigzag shards, a union with a per-head random layout) and ulysses_attention
    (per-head layout slices): every rank's shard of out, lse and the gradients against the
    float64 oracle by the tolerance rule."""
    from tests.helpers.ring_worker import case_layout as ring_case_layout, loss_of, make_inputs, spawn_world, worker
    from triton_dilated import shard
    world = 2
    results = spawn_world(worker, world, lambda queue: (RING_CASES, queue, None, 60), 400)
    assert sorted(results) == [0, 1]
    refs = []
    for case in RING_CASES:
        refs.append([])
        q, k, v, g, gl = make_inputs(case)
        layout = ring_case_layout(case)
        counts = layout.element_mask(case["N"], True)
        for fn, dt in ((lambda q, k, v: block_sparse_attention_naive(q, k, v, layout, causal=True), torch.float64),
                       (lambda q, k, v: dense_reference(q, k, v, counts), torch.float32)):
            leaves = [x.to(dt).requires_grad_() for x in (q, k, v)]
            out, lse = fn(*leaves)
            loss = loss_of(out, lse, g.to(dt), gl.to(dt), case)
            refs[-1].append((out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves)))
    for rank, (status, payload) in results.items():
        assert status == "ok", payload
        for case, got, (oracle, same) in zip(RING_CASES, payload, refs):
            bal = case.get("balance", "contiguous")

            def local(x, i):
                return shard(x.transpose(1, 2), rank, world, bal).transpose(1, 2) if i == 1 else \
                    shard(x, rank, world, bal)
            assert_rule_all([torch.from_numpy(got[n]) for n in ("out", "lse", "dq", "dk", "dv")],
                            [local(x, i) for i, x in enumerate(oracle)], [local(x, i) for i, x in enumerate(same)],
                            floor=FLOOR[torch.float32], what=f"rank {rank} {case}: ")


def test_compiled_decode_step_keeps_the_window():
    """torch.compile(fullgraph=True, aot_eager) of a window decode step (the decode custom op
    takes the window and its flags): equal to eager, one frame for two cache lengths."""
    from torch._dynamo.testing import CompileCounterWithBackend
    N, bs = 64, 16
    lay = layouts.sliding_window(N, bs, 10, sinks=2)
    q = seeded((2, 1, 2, 8), torch.float32, 1, DEVICE)
    kc, vc = (seeded((2, N, 1, 8), torch.float32, s, DEVICE) for s in (2, 3))

    def step(q, kc, vc, lens):
        return block_sparse_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, layout=lay, backend="torch")

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for lens in ([64, 20], [33, 50]):
        lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        torch.testing.assert_close(compiled(q, kc, vc, lens), step(q, kc, vc, lens), rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1


def test_huge_windows_and_sink_counts_are_clamped():
    """Hardening round 3: sliding_window(40, 16, 10**8) took 1 GB and 2 s (10**12: an
    allocation of 500 GB failed), and sink counts >= 2^31 broke the Triton kernels (int32
    positions). A window or sink count past the sequence means the same as its length: the
    builder clamps both (constant time and memory, the same mask), and a WindowPredicate built
    by hand refuses values >= 2^31 by name."""
    import time
    start = time.perf_counter()
    huge = [layouts.sliding_window(40, 16, w, sinks=s) for w, s in ((10 ** 8, 0), (10 ** 12, 2 ** 40), (7, 2 ** 33))]
    assert time.perf_counter() - start < 1.0
    same = [layouts.sliding_window(40, 16, w, sinks=s) for w, s in ((48, 0), (48, 48), (7, 48))]
    for a, b in zip(huge, same):
        assert a.window == b.window and torch.equal(a.element_mask(40, True), b.element_mask(40, True))
    q, k, v = (seeded((1, 40, 2, 8), torch.float32, s, DEVICE) for s in range(3))
    got = block_sparse_attention(q, k, v, huge[2].to(DEVICE), causal=True, backend="triton")
    want = block_sparse_attention(q, k, v, huge[2].to(DEVICE), causal=True, backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for w, s, name in ((2 ** 31, 0, "window"), (5, 2 ** 31, "sink_tokens")):
        with pytest.raises(ValueError, match=f"{name} must be below 2\\^31"):
            WindowPredicate(w, s)
