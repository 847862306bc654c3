"""Soft-capping (softcap=: scores s -> c * tanh(s / c)) and learnable attention sinks (sinks=: a
logit per query head joining every row's denominator, no value) on dilated and block-sparse
attention, both backends, against the float64 oracles (issue 23 items 1-2).

Every comparison applies tests/helpers/reference.py's tolerance rule to out, lse and the gradients of
a loss through both (dq, dk, dv and, with sinks, d sinks); the same-dtype reference is dense
attention over the case's multiplicities with the cap and the sinks (reference.dense_reference),
which is also the independent float64 definition the oracles are checked against.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from triton_dilated import (BlockLayout, BlockSparseAttention, DilatedAttention, block_sparse_attention,
                            block_sparse_attention_naive, block_sparse_attention_op, dilated_attention,
                            dilated_attention_naive, dilated_attention_op, layouts)
from triton_dilated.ops.block_sparse.naive import element_mask
from triton_dilated.ops.dilated.naive import dilated_multiplicity
from triton_dilated.ops.dilated.patterns import head_offsets
from triton_dilated.ops.dilated.plan import build_items, key_unit_triples, query_unit_triples
from tests.conftest import DEVICE
from tests.helpers.reference import (FLOOR, _run, assert_rule, assert_rule_all, block_sparse_serve, dense_reference,
                                     dilated_serve, finite, max_err, seeded)

BACKENDS = ["triton", "torch"]
# the interpreter gets bfloat16 tl.dot wrong (DESIGN §10): bfloat16 kernels on a GPU only
DTYPES = {"triton": [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []),
          "torch": [torch.float32, torch.float16, torch.bfloat16]}


def make_qkv(B, N, Hq, Hkv, D, dtype, seed, q_scale=1.0):
    """Seeded q, k, v; q_scale > 1 makes |scores| >> softcap (the cap bites)."""
    q = seeded((B, N, Hq, D), torch.float64, seed) * q_scale
    k = seeded((B, N, Hkv, D), torch.float64, seed + 1)
    v = seeded((B, N, Hkv, D), torch.float64, seed + 2)
    return tuple(x.to(device=DEVICE, dtype=dtype) for x in (q, k, v))


def make_sinks(Hq, seed):
    """float32 sink logits of the size of typical scores (some rows then weigh the sink most)."""
    return seeded((Hq,), torch.float32, seed, DEVICE, scale=2.0)


def compare(fn, oracle, same, qkv, sinks=None, *, seed=0):
    """fn, oracle and same ((q, k, v[, sinks]) -> (out, lse)) on qkv (and sinks) by the
    tolerance rule: out, lse, dq, dk, dv and d sinks of sum(out * g) + sum(lse * gl). The
    oracle gets float64 leaves (sinks too), same the test dtype (sinks float32). Returns
    (got, oracle) results: (out, lse, dq, dk, dv[, dsinks])."""
    dtype = qkv[0].dtype
    inputs = list(qkv) + ([sinks] if sinks is not None else [])
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    leaves64 = [x.detach().double().requires_grad_() for x in inputs]
    same_leaves = [x.detach().clone().requires_grad_() for x in inputs]
    B, N, Hq, D = qkv[0].shape
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(B, N, Hq, D, generator=gen, dtype=torch.float64).to(dtype).double().to(DEVICE)
    gl = torch.randn(B, Hq, N, generator=gen, dtype=torch.float64).float().double().to(DEVICE)
    got, ref, sm = (_run(f, x, g, gl, True) for f, x in ((fn, leaves), (oracle, leaves64), (same, same_leaves)))
    out, lse = got[0], got[1]
    assert out.shape == qkv[0].shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (B, Hq, N) and lse.dtype == torch.float32
    assert_rule_all(got[:5], ref[:5], sm[:5], floor=FLOOR[dtype])
    rows = torch.isneginf(ref[1]).transpose(1, 2)
    assert (out[rows] == 0).all() and (got[2][rows] == 0).all(), "rows without keys: not 0"
    if sinks is not None:
        assert got[5].dtype == torch.float32 and got[5].shape == sinks.shape
        assert_rule("dsinks", got[5], ref[5], sm[5], factor=3, floor=FLOOR[dtype])
    return got, ref


def dilated_fns(ws, rs, counts, backend, **kw):
    """(fn, oracle, same) for dilated attention with keyword arguments kw (softcap, causal,
    mode); with four inputs the fourth is sinks."""
    cap = kw.get("softcap")
    fn = lambda q, k, v, s=None: dilated_attention(q, k, v, ws, rs, return_lse=True, backend=backend,  # noqa: E731
                                                   sinks=s, **kw)
    oracle = lambda q, k, v, s=None: dilated_attention_naive(q, k, v, ws, rs, sinks=s, **kw)  # noqa: E731
    same = lambda q, k, v, s=None: dense_reference(q, k, v, counts, None, cap, s)  # noqa: E731
    return fn, oracle, same


def block_sparse_fns(layout, counts, backend, **kw):
    cap = kw.get("softcap")
    fn = lambda q, k, v, s=None: block_sparse_attention(q, k, v, layout, return_lse=True,  # noqa: E731
                                                        backend=backend, sinks=s, **kw)
    oracle = lambda q, k, v, s=None: block_sparse_attention_naive(q, k, v, layout, sinks=s, **kw)  # noqa: E731
    same = lambda q, k, v, s=None: dense_reference(q, k, v, counts, None, cap, s)  # noqa: E731
    return fn, oracle, same


def check_oracle_is_definition(oracle, counts, qkv, sinks, softcap):
    """The oracle's out, lse and gradients (sinks included) equal the dense definition in
    float64 (reference.dense_reference: shares no code with the oracles' gather and merge)."""
    inputs = list(qkv) + ([sinks] if sinks is not None else [])
    a = [x.detach().double().requires_grad_() for x in inputs]
    b = [x.detach().double().requires_grad_() for x in inputs]
    oa, la = oracle(*a)
    ob, lb = dense_reference(*b[:3], counts, None, softcap, b[3] if sinks is not None else None)
    assert max_err(oa, ob) <= 1e-9 and torch.equal(torch.isinf(la), torch.isinf(lb))
    assert max_err(finite(la), finite(lb)) <= 1e-9
    g = torch.randn_like(oa)
    ga = torch.autograd.grad((oa * g).sum() + finite(la).sum(), a)
    gb = torch.autograd.grad((ob * g).sum() + finite(lb).sum(), b)
    for x, y in zip(ga, gb):
        assert max_err(x, y) <= 1e-9


# ----------------------------------------------------------------------------- properties

CAPS = [None, 0.5, 3.0, 30.0]


@st.composite
def dilated_cases(draw, backend):
    m = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    rs = draw(st.lists(st.integers(1, 3), min_size=m, max_size=m))
    ws = [max(w, r) for w, r in zip(draw(st.lists(st.integers(1, 40), min_size=m, max_size=m)), rs)]
    c = dict(B=1, N=draw(st.integers(1, 48)), Hkv=Hkv, Hq=Hkv * draw(st.integers(1, 2)), D=draw(st.sampled_from([8, 24])),
             ws=ws, rs=rs, mode=draw(st.sampled_from(["longnet", "head_groups"])), causal=draw(st.booleans()),
             dtype=draw(st.sampled_from(DTYPES[backend])), softcap=draw(st.sampled_from(CAPS)),
             sinks=draw(st.booleans()), q_scale=draw(st.sampled_from([1.0, 8.0])), seed=draw(st.integers(0, 9999)))
    assume(c["softcap"] is not None or c["sinks"])
    if backend == "triton" and DEVICE == "cpu":   # the interpreter: ~0.1 s a program
        assume(kernel_tiles(c) <= INTERPRETER_MAX_TILES)
    return c


INTERPRETER_MAX_TILES = 24


def kernel_tiles(c):
    """Query plus key tiles the dilated planner makes for case c (32-row tiles)."""
    pats = tuple(zip(c["ws"], c["rs"]))
    table = head_offsets(c["Hq"], pats, c["mode"], "modulo")
    q_items, _ = build_items(c["N"], query_unit_triples(pats, table), 32, 32, c["causal"])
    k_items, _ = build_items(c["N"], key_unit_triples(pats, table, c["Hkv"]), 32, 32, c["causal"], True)
    return c["B"] * (len(q_items) + len(k_items))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=12)
@given(data=st.data())
def test_dilated_matches_oracle(backend, data):
    """Random patterns (ragged segments, GQA, longnet and head-group mixing, causal), caps
    from biting hard (0.5) to barely (30), sinks or not, scores up to ~8x their usual size."""
    c = data.draw(dilated_cases(backend), label="case")
    qkv = make_qkv(c["B"], c["N"], c["Hq"], c["Hkv"], c["D"], c["dtype"], c["seed"], c["q_scale"])
    sinks = make_sinks(c["Hq"], c["seed"] + 3) if c["sinks"] else None
    kw = dict(causal=c["causal"], mode=c["mode"], softcap=c["softcap"])
    counts = dilated_multiplicity(c["N"], c["ws"], c["rs"], c["Hq"], causal=c["causal"], mode=c["mode"])
    fn, oracle, same = dilated_fns(c["ws"], c["rs"], counts, backend, **kw)
    compare(fn, oracle, same, qkv, sinks, seed=c["seed"])
    check_oracle_is_definition(oracle, counts, qkv, sinks, c["softcap"])


@st.composite
def block_sparse_cases(draw, backend):
    bs = draw(st.sampled_from([16, 32]))
    N = draw(st.integers(1, 80))
    nb = math.ceil(N / bs)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    mask = torch.rand(1, draw(st.sampled_from([1, 2])), nb, nb, generator=g) < draw(st.sampled_from([0.3, 0.7, 1.0]))
    Hkv = draw(st.integers(1, 2))
    return dict(N=N, layout=BlockLayout.from_dense(mask, bs), Hkv=Hkv, causal=draw(st.booleans()),
                dtype=draw(st.sampled_from(DTYPES[backend])), softcap=draw(st.sampled_from(CAPS)),
                sinks=draw(st.booleans()), q_scale=draw(st.sampled_from([1.0, 8.0])), D=draw(st.sampled_from([8, 24])),
                seed=draw(st.integers(0, 9999)))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=16)
@given(data=st.data())
def test_block_sparse_matches_oracle(backend, data):
    """Random layouts (per head or broadcast, empty rows, ragged N), GQA, causal, caps and sinks."""
    c = data.draw(block_sparse_cases(backend), label="case")
    assume(c["softcap"] is not None or c["sinks"])
    Hq = 2
    qkv = make_qkv(1, c["N"], Hq, c["Hkv"], c["D"], c["dtype"], c["seed"], c["q_scale"])
    sinks = make_sinks(Hq, c["seed"] + 3) if c["sinks"] else None
    counts = element_mask(c["layout"], c["N"], c["causal"]).double()
    fn, oracle, same = block_sparse_fns(c["layout"], counts, backend, causal=c["causal"], softcap=c["softcap"])
    compare(fn, oracle, same, qkv, sinks, seed=c["seed"])
    check_oracle_is_definition(oracle, counts, qkv, sinks, c["softcap"])


# ----------------------------------------------------------------------------- the cap's backward

def _straight_through_oracle(q, k, v, ws, rs, softcap, causal):
    """The capped forward with the cap's derivative dropped (what a backward without the
    factor 1 - tanh^2 computes): dense float64 attention over the dilated multiplicities."""
    counts = dilated_multiplicity(q.shape[1], ws, rs, q.shape[2], causal=causal).to(q.device)
    B, N, Hq, D = q.shape
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(Hq // k.shape[2], dim=2)) * D ** -0.5
    s = s + (torch.tanh(s / softcap) * softcap - s).detach()
    s = s.masked_fill(counts[None] == 0, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0) * counts[None]
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(Hq // k.shape[2], dim=2))


@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cap_bites_and_backward_takes_its_derivative(backend, causal, variant):
    """Scores ~10x the cap (q scaled up): the capped softmax differs from the uncapped one,
    and dq, dk match the oracle, which they would not without the factor 1 - tanh^2: the
    gradient of the same forward with that factor dropped is far outside the tolerance."""
    N, H, D, cap = 40, 2, 16, 2.0
    qkv = make_qkv(1, N, H, 1, D, torch.float32, 11, q_scale=6.0)
    ws, rs = [16, 40], [1, 2]
    if variant == "dilated":
        counts = dilated_multiplicity(N, ws, rs, H, causal=causal)
        fns = dilated_fns(ws, rs, counts, backend, causal=causal, softcap=cap)
    else:
        layout = layouts.local(N, 16, 1)
        counts = element_mask(layout, N, causal).double()
        fns = block_sparse_fns(layout, counts, backend, causal=causal, softcap=cap)
    got, ref = compare(*fns, qkv, seed=5)
    s = torch.einsum("bqhd,bkhd->bhqk", qkv[0].double(), qkv[1].double().expand(-1, -1, H, -1)) * D ** -0.5
    assert s.abs().max() > 10 * cap                                     # the cap bites
    plain = dict(causal=causal, softcap=None)
    uncapped = (
        dilated_attention_naive(*(x.double() for x in qkv), ws, rs, **plain) if variant == "dilated"
        else block_sparse_attention_naive(*(x.double() for x in qkv), layout, **plain))[0]
    assert max_err(ref[0], uncapped) > 0.1                              # ... and changes the result
    if variant == "dilated":   # without the factor: far from the oracle, for dq and dk
        gen = torch.Generator().manual_seed(5)
        g = torch.randn(qkv[0].shape, generator=gen, dtype=torch.float64).float().double().to(DEVICE)
        grads = []
        for f, dt in ((fns[0], None), (fns[1], torch.float64),
                      (lambda q, k, v: (_straight_through_oracle(q, k, v, ws, rs, cap, causal), None), torch.float64)):
            leaves = [x.detach().to(dt or x.dtype).requires_grad_() for x in qkv]
            grads.append(torch.autograd.grad((f(*leaves)[0].double() * g).sum(), leaves))
        for name, a, r, w in zip(("dq", "dk"), *grads):
            assert max_err(a, r) <= 1e-4 * max(1.0, r.abs().max().item()), name
            assert max_err(w, r) > 100 * max(max_err(a, r), 1e-6), name


# ----------------------------------------------------------------------------- NaN rule, empty rows

@pytest.mark.parametrize("which", ["k", "q"])
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_inf_score_still_gives_nan(backend, variant, which):
    """DESIGN §6 with the cap: tanh(+-inf) = +-1 is finite, yet a row that reads an Inf key (or
    has an Inf query) must give NaN out and lse, with or without sinks; other rows keep the
    clean run's values."""
    N, H, cap, pos = 40, 2, 2.0, 9
    q, k, v = make_qkv(1, N, H, 1, 8, torch.float32, 3)
    sinks = make_sinks(H, 4)
    if variant == "dilated":
        pairs = dilated_multiplicity(N, [16, 40], [1, 2], H, causal=True) > 0            # (H, N, N)
        run = lambda q, k, v, s: dilated_attention(q, k, v, [16, 40], [1, 2], causal=True, softcap=cap,  # noqa: E731
                                                   sinks=s, backend=backend, return_lse=True)
    else:
        layout = layouts.local(N, 16, 1)
        pairs = element_mask(layout, N, True)[0].expand(H, N, N)
        run = lambda q, k, v, s: block_sparse_attention(q, k, v, layout, causal=True, softcap=cap,  # noqa: E731
                                                        sinks=s, backend=backend, return_lse=True)
    bad_q, bad_k = q.clone(), k.clone()
    if which == "k":
        bad_k[0, pos, 0, 3] = float("inf")
        reads = pairs[:, :, pos]                                                          # (H, N)
    else:
        bad_q[0, pos, 1, 3] = float("-inf")
        reads = torch.zeros(H, N, dtype=torch.bool)
        reads[1, pos] = True
    for s in (None, sinks):
        clean_out, clean_lse = run(q, k, v, s)
        out, lse = run(bad_q, bad_k, v, s)
        rows = reads.T[None].to(out.device)                                               # (1, N, H)
        assert torch.isnan(out).all(-1).eq(rows).all() and torch.isnan(lse).eq(rows.transpose(1, 2)).all()
        assert torch.equal(out[~rows], clean_out[~rows]) and torch.equal(lse[~rows.transpose(1, 2)],
                                                                          clean_lse[~rows.transpose(1, 2)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_on_rows_without_keys(backend):
    """A query block with no key block: out 0 and lse = its head's sink (the denominator holds
    only the sink), dq 0 there, and the sink gets its gradient from those rows too (dlse)."""
    N, H = 48, 2
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1] = False                                               # rows 16..31 have no key
    layout = BlockLayout.from_dense(mask, 16)
    qkv = make_qkv(1, N, H, 1, 8, torch.float32, 5)
    sinks = make_sinks(H, 6)
    counts = element_mask(layout, N, False).double()
    got, ref = compare(*block_sparse_fns(layout, counts, backend, softcap=4.0), qkv, sinks, seed=2)
    out, lse, dq = got[0], got[1], got[2]
    assert (out[:, 16:32] == 0).all() and (dq[:, 16:32] == 0).all()
    assert torch.equal(lse[:, :, 16:32], sinks[None, :, None].expand(1, H, 16))


def test_minus_inf_sinks_change_nothing():
    """A sink of -inf adds exp(-inf) = 0: out and lse are exactly those without sinks, and no
    gradient is NaN (an empty row has lse = -inf on both sides of the combine)."""
    N, H = 24, 2
    mask = torch.tensor([[True, False], [False, False]])
    layout = BlockLayout.from_dense(mask, 16)                     # rows 16..23: no key
    q, k, v = (x.requires_grad_() for x in make_qkv(1, N, H, 1, 8, torch.float32, 7))
    sinks = torch.full((H,), float("-inf"), device=DEVICE, requires_grad=True)
    out, lse = block_sparse_attention(q, k, v, layout, sinks=sinks, return_lse=True, backend="torch")
    ref_out, ref_lse = block_sparse_attention(q, k, v, layout, return_lse=True, backend="torch")
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    grads = torch.autograd.grad(out.sum() + finite(lse).sum(), (q, k, v, sinks))
    assert all(not torch.isnan(g).any() for g in grads) and (grads[3] == 0).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_plus_inf_sinks_take_the_whole_weight(backend):
    """Hardening round 3: sinks=+inf gave NaN in every out and lse element (inf - inf in the
    combine). The limit: the sink takes the whole weight, out 0 and lse +inf for that head
    (rows with keys or without), no NaN anywhere, gradients included; the other heads equal
    a call where that head's sink is finite. Training doors and serve doors, both variants."""
    from triton_dilated import block_sparse_attention_with_kvcache, dilated_attention_with_kvcache
    N, H = 24, 2
    layout = BlockLayout.from_dense(torch.tensor([[True, False], [False, False]]), 16).to(DEVICE)   # 16.. empty
    q, k, v = (x.requires_grad_() for x in make_qkv(1, N, H, 1, 8, torch.float32, 11))
    sinks = torch.tensor([float("inf"), 0.25], device=DEVICE, requires_grad=True)
    finite_sinks = torch.tensor([3.0, 0.25], device=DEVICE)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    calls = {
        "dilated": lambda s: dilated_attention(q, k, v, [8, 24], [1, 2], causal=True, sinks=s, return_lse=True,
                                               backend=backend),
        "block_sparse": lambda s: block_sparse_attention(q, k, v, layout, causal=True, sinks=s, return_lse=True,
                                                         backend=backend),
        "dilated serve": lambda s: dilated_attention_with_kvcache(
            q[:, :2].detach(), k.detach(), v.detach(), cache_seqlens=lens, segment_lengths=[8, 24],
            dilation_rates=[1, 2], sinks=s.detach(), return_lse=True, backend=backend),
        "block_sparse serve": lambda s: block_sparse_attention_with_kvcache(
            q[:, :2].detach(), k.detach(), v.detach(), cache_seqlens=lens, layout=layout, sinks=s.detach(),
            return_lse=True, backend=backend),
    }
    for name, call in calls.items():
        out, lse = call(sinks)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), name
        assert (out[:, :, 0] == 0).all() and (lse[:, 0] == float("inf")).all(), name
        ref_out, ref_lse = call(finite_sinks)
        torch.testing.assert_close(out[:, :, 1], ref_out[:, :, 1], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(lse[:, 1], ref_lse[:, 1], rtol=0, atol=0, msg=name)
        if out.requires_grad:
            grads = torch.autograd.grad(out.sum() + finite(lse).sum(), (q, k, v, sinks))
            assert all(not torch.isnan(g).any() for g in grads), name


# ----------------------------------------------------------------------------- validation

BAD_CAPS = [(True, ValueError), (False, ValueError), (-1.5, ValueError), (-0.001, ValueError),
            (float("nan"), ValueError), (float("inf"), ValueError), ("50", TypeError), (torch.tensor(5.0), TypeError)]


def _all_entry_points(q, k, v, **kw):
    layout = layouts.local(q.shape[1], 16, 1)
    yield lambda: dilated_attention(q, k, v, [8], [1], backend="torch", **kw)
    yield lambda: dilated_attention_naive(q, k, v, [8], [1], **kw)
    yield lambda: dilated_attention_op(q, k, v, [8], [1], backend="torch", **kw)
    yield lambda: block_sparse_attention(q, k, v, layout, backend="torch", **kw)
    yield lambda: block_sparse_attention_naive(q, k, v, layout, **kw)
    yield lambda: block_sparse_attention_op(q, k, v, layout, backend="torch", **kw)


@pytest.mark.parametrize("bad, exc", BAD_CAPS, ids=[repr(b) for b, _ in BAD_CAPS])
def test_softcap_validation(bad, exc):
    qkv = make_qkv(1, 16, 2, 1, 8, torch.float32, 0)
    for call in _all_entry_points(*qkv, softcap=bad):
        with pytest.raises(exc, match="softcap"):
            call()
    for make in (lambda: DilatedAttention([8], [1], softcap=bad), lambda: BlockSparseAttention(layouts.local(16, 16, 1),
                                                                                                 softcap=bad)):
        with pytest.raises(exc, match="softcap"):
            make()



@pytest.mark.parametrize("off", [0.0, 0, None], ids=["0.0", "0", "None"])
def test_softcap_zero_or_none_is_no_cap(off):
    """One convention (FlashAttention's): softcap 0.0 means no cap, and None (a model config's
    attn_logit_softcapping=None) reads as 0.0 at the door: every entry point returns the
    uncapped result bit for bit, and the modules keep 0.0."""
    qkv = make_qkv(1, 16, 2, 1, 8, torch.float32, 0)
    for capped, plain in zip(_all_entry_points(*qkv, softcap=off), _all_entry_points(*qkv)):
        got, ref = capped(), plain()
        got, ref = (got[0], ref[0]) if isinstance(got, tuple) else (got, ref)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    for module in (DilatedAttention([8], [1], softcap=off), BlockSparseAttention(layouts.local(16, 16, 1), softcap=off)):
        assert module.softcap == 0.0 and "softcap" not in repr(module)

BAD_SINKS = [([0.0, 0.0], TypeError, "float32 tensor"), (torch.zeros(2, dtype=torch.float64), TypeError, "float32"),
             (torch.zeros(3), ValueError, r"shape \(Hq,\) = \(2,\)"), (torch.zeros(1, 2), ValueError, "shape")]


@pytest.mark.parametrize("bad, exc, msg", BAD_SINKS, ids=["list", "float64", "wrong-heads", "2-d"])
def test_sinks_validation(bad, exc, msg):
    qkv = make_qkv(1, 16, 2, 1, 8, torch.float32, 0)
    for i, call in enumerate(_all_entry_points(*qkv, sinks=bad)):
        if i in (1, 4) and isinstance(bad, torch.Tensor) and bad.dtype == torch.float64:
            call()      # the float64 oracles take float64 sinks
            continue
        with pytest.raises(exc, match="sinks must.*" + msg):
            call()


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_on_the_decode_and_query_offset_paths(backend):
    """Queries shorter than keys with softcap (and sinks), through the serve doors: the decode
    path (Nq <= 16, forward) and the query-offset path (Nq = 20, chunked prefill: the padded
    full-length call; on the Triton backend its planned query window) give the rows of the
    full-sequence oracle with the same cap and sinks, forward and the gradients of q, k, v and
    the sinks."""
    N, H, cap = 40, 2, 1.5
    q, k, v = make_qkv(1, N, H, 1, 8, torch.float32, 30, q_scale=3.0)
    sinks = make_sinks(H, 31)
    layout = layouts.local(N, 16, 1)
    calls = (lambda q_, k_, v_, s, **a: dilated_serve(q_, k_, v_, [16, 40], [1, 2], **a, sinks=s),
             lambda q_, k_, v_, s, **a: block_sparse_serve(q_, k_, v_, layout, **a, sinks=s))
    oracles = (lambda q_, k_, v_, s: dilated_attention_naive(q_, k_, v_, [16, 40], [1, 2], causal=True, softcap=cap,
                                                             sinks=s),
               lambda q_, k_, v_, s: block_sparse_attention_naive(q_, k_, v_, layout, causal=True, softcap=cap,
                                                                  sinks=s))
    for call, oracle in zip(calls, oracles):
        ref_leaves = [x.double().requires_grad_() for x in (q, k, v, sinks)]
        ref, ref_lse = oracle(*ref_leaves)
        with torch.no_grad():   # the decode path, every key row and a cache holding fewer rows
            out, lse = call(q[:, -1:], k, v, sinks, causal=True, softcap=cap, return_lse=True, backend=backend)
            assert max_err(out, ref[:, -1:]) <= 1e-5 and max_err(lse, ref_lse[..., -1:]) <= 1e-5
            out = call(q[:, -1:], torch.cat([k, k[:, :8]], 1), torch.cat([v, v[:, :8]], 1), sinks, causal=True,
                       softcap=cap, backend=backend, cache_seqlens=torch.tensor([N], dtype=torch.int32, device=DEVICE))
            assert max_err(out, ref[:, -1:]) <= 1e-5
        leaves = [x.clone().requires_grad_() for x in (q[:, -20:], k, v, sinks)]
        out, lse = call(*leaves, causal=True, softcap=cap, return_lse=True, backend=backend)
        assert max_err(out, ref[:, -20:]) <= 1e-5 and max_err(lse, ref_lse[..., -20:]) <= 1e-5
        g = seeded(out.shape, torch.float32, 32, DEVICE)
        got = torch.autograd.grad((out * g).sum() + lse.sum(), leaves)
        want = torch.autograd.grad((ref[:, -20:] * g.double()).sum() + ref_lse[..., -20:].sum(), ref_leaves)
        want = (want[0][:, -20:], *want[1:])
        for a, b in zip(got, want):
            assert max_err(a, b) <= 1e-4 * max(1.0, b.abs().max().item())


def test_modules_need_heads_for_sinks():
    with pytest.raises(ValueError, match="sinks=True needs num_heads"):
        DilatedAttention([8], [1], sinks=True)
    with pytest.raises(ValueError, match="softcap and sinks are not available with compat"):
        DilatedAttention([8], [1], compat="dilated-attention-pytorch", sinks=True, num_heads=2)


# ----------------------------------------------------------------------------- decode, ops, modules

@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_on_the_decode_path(backend):
    """Queries shorter than keys through the serve doors (the decode kernels, Nq <= 16): the
    sinks join each row the same way, so every row equals that row of the full-sequence
    oracle with the sinks."""
    N, H = 40, 2
    q, k, v = make_qkv(1, N, H, 1, 8, torch.float32, 8)
    sinks = make_sinks(H, 9)
    layout = layouts.local(N, 16, 1)
    for nq in (1, 3):
        with torch.no_grad():
            out, lse = dilated_serve(q[:, -nq:], k, v, [16, 40], [1, 2], causal=True, sinks=sinks,
                                     return_lse=True, backend=backend)
            bout, blse = block_sparse_serve(q[:, -nq:], k, v, layout, causal=True, sinks=sinks, return_lse=True,
                                            backend=backend)
        ref, ref_lse = dilated_attention_naive(q, k, v, [16, 40], [1, 2], causal=True, sinks=sinks)
        bref, bref_lse = block_sparse_attention_naive(q, k, v, layout, causal=True, sinks=sinks)
        for a, b in ((out, ref[:, -nq:]), (lse, ref_lse[..., -nq:]), (bout, bref[:, -nq:]),
                     (blse, bref_lse[..., -nq:])):
            assert max_err(a, b) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_ops_take_softcap_and_sinks(backend):
    """dilated_attention_op and block_sparse_attention_op (the torch.compile route) against
    the oracles, forward and gradients, sinks included."""
    N, H = 32, 2
    qkv = make_qkv(1, N, H, 1, 8, torch.float32, 12, q_scale=4.0)
    sinks = make_sinks(H, 13)
    kw = dict(causal=True, softcap=3.0)
    counts = dilated_multiplicity(N, [16], [2], H, causal=True)
    _, oracle, same = dilated_fns([16], [2], counts, backend, **kw)
    op = lambda q, k, v, s: dilated_attention_op(q, k, v, [16], [2], return_lse=True, backend=backend,  # noqa: E731
                                                 sinks=s, **kw)
    compare(op, oracle, same, qkv, sinks, seed=1)
    layout = layouts.local(N, 16, 1)
    counts = element_mask(layout, N, True).double()
    _, oracle, same = block_sparse_fns(layout, counts, backend, **kw)
    op = lambda q, k, v, s: block_sparse_attention_op(q, k, v, layout, return_lse=True,  # noqa: E731
                                                      backend=backend, sinks=s, **kw)
    compare(op, oracle, same, qkv, sinks, seed=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_modules_hold_learnable_sinks(backend):
    """DilatedAttention / BlockSparseAttention(softcap=, sinks=True, num_heads=): a zero-initialised
    float32 nn.Parameter per head in state_dict, the same result as the function with those
    sinks, and a gradient for it (also after the module is cast to float16)."""
    N, H = 32, 2
    q, k, v = make_qkv(1, N, H, 1, 8, torch.float32, 14)
    layout = layouts.local(N, 16, 1)
    for module, fn in (
            (DilatedAttention([16], [1], causal=True, softcap=3.0, sinks=True, num_heads=H, backend=backend),
             lambda s: dilated_attention(q, k, v, [16], [1], causal=True, softcap=3.0, sinks=s, backend=backend)),
            (BlockSparseAttention(layout, causal=True, softcap=3.0, sinks=True, num_heads=H, backend=backend),
             lambda s: block_sparse_attention(q, k, v, layout, causal=True, softcap=3.0, sinks=s, backend=backend))):
        module = module.to(DEVICE)
        assert list(module.state_dict()) == ["sinks"] and module.sinks.dtype == torch.float32
        assert (module.sinks == 0).all() and module.sinks.requires_grad
        with torch.no_grad():
            module.sinks.copy_(make_sinks(H, 15))
        out = module(q, k, v)
        assert torch.equal(out, fn(module.sinks.detach()))
        out.square().sum().backward()
        assert module.sinks.grad is not None and module.sinks.grad.abs().sum() > 0
        module.half()
        assert module(q.half(), k.half(), v.half()).dtype == torch.float16
    plain = DilatedAttention([16], [1])
    assert plain.sinks is None and list(plain.parameters()) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_documents_with_softcap_and_sinks(backend):
    """cu_seqlens: the packed call equals one call per document (cap and sinks per row)."""
    N, H, bounds = 40, 2, [0, 13, 40]
    q, k, v = make_qkv(1, N, H, 1, 8, torch.float32, 16, q_scale=4.0)
    sinks = make_sinks(H, 17)
    kw = dict(causal=True, softcap=2.0, sinks=sinks, return_lse=True, backend=backend)
    out, lse = dilated_attention(q, k, v, [8, 16], [1, 2], cu_seqlens=bounds, **kw)
    bout, blse = block_sparse_attention(q, k, v, lambda n: layouts.local(n, 16, 1), cu_seqlens=bounds, **kw)
    for s, e in zip(bounds[:-1], bounds[1:]):
        ro, rl = dilated_attention(q[:, s:e], k[:, s:e], v[:, s:e], [8, 16], [1, 2], **kw)
        bo, bl = block_sparse_attention(q[:, s:e], k[:, s:e], v[:, s:e], layouts.local(e - s, 16, 1), **kw)
        assert max_err(out[:, s:e], ro) <= 1e-6 and max_err(lse[..., s:e], rl) <= 1e-6
        assert max_err(bout[:, s:e], bo) <= 1e-6 and max_err(blse[..., s:e], bl) <= 1e-6
