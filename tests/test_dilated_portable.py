"""The portable PyTorch backend (backend="torch") against the float64 oracle
`dilated_attention_naive` (DESIGN §3, §6), and the oracle itself against a dense
definition written here from DESIGN §3 (an N x N matrix counting, for every query, how
many of its patterns select each key: the multiset union).

Tolerances (DESIGN §6, flash-attention style, max-abs over a tensor):
* float32: |x - oracle| <= 1e-5 * max(1, |oracle|) (gradients: 3x that);
* float16: |x - oracle| <= 2 * |ref - oracle| + 1e-3 (gradients:
  3 * |ref - oracle| + 1e-3 * max(1, |oracle|)), where ref is the portable backend run in
  float32 on the float16-rounded inputs, rounded to float16 (the "same-dtype torch
  reference"); the oracle runs on the same float16-rounded inputs, in float64.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from triton_dilated import dilated_attention, dilated_attention_naive

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- helpers

def offset_table(Hq, ws, rs, mode, offsets):
    """Per query head, per pattern: the offset, or -1 where the head does not use it (DESIGN §3)."""
    m = len(ws)
    if mode == "longnet":
        if offsets == "modulo":
            return [[j % r for r in rs] for j in range(Hq)]
        return [[j // math.ceil(Hq / r) for r in rs] for j in range(Hq)]
    table = []
    for i in range(m):
        size = Hq // m + (1 if i < Hq % m else 0)
        table += [[(i % rs[i]) if ii == i else -1 for ii in range(m)]] * size
    return table


def count_matrix(N, Hq, ws, rs, mode, offsets, causal):
    """C[h, p, p']: in how many of head h's patterns query p reads key p'."""
    pos = torch.arange(N)
    C = torch.zeros(Hq, N, N, dtype=torch.float64)
    for h, row in enumerate(offset_table(Hq, ws, rs, mode, offsets)):
        for (w, r), o in zip(zip(ws, rs), row):
            if o < 0:
                continue
            s = (pos // w) * w
            act = (pos - s) % r == o
            sel = act[:, None] & act[None, :] & (s[:, None] == s[None, :])
            if causal:
                sel &= pos[None, :] <= pos[:, None]
            C[h] += sel
    return C


def dense_definition(q, k, v, C, scale, dtype=torch.float64):
    """Softmax over the multiset union of keys, computed densely in `dtype`:
    out (B, N, Hq, D), lse (B, Hq, N); rows without keys give 0 and -inf."""
    G = q.shape[2] // k.shape[2]
    qd = q.to(dtype)
    kd, vd = (x.to(dtype).repeat_interleave(G, dim=2) for x in (k, v))
    s = torch.einsum("bnhd,bmhd->bhnm", qd, kd) * scale
    s = s + torch.where(C > 0, C.log(), torch.full_like(C, NEG_INF)).to(dtype)
    # log-sum-exp by hand so that rows without keys give -inf and no NaN gradient
    m = s.detach().amax(dim=-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    z = e.sum(dim=-1, keepdim=True)
    z_safe = torch.where(z > 0, z, torch.ones_like(z))
    lse = torch.where(z > 0, m + torch.log(z_safe), torch.full_like(z, NEG_INF)).squeeze(-1)
    return torch.einsum("bhnm,bmhd->bnhd", e / z_safe, vd), lse


def max_err(x, ref):
    return (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0


def amax(x):
    return x.double().abs().max().item() if x.numel() else 0.0


def finite_lse(lse):
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def assert_no_nan(**tensors):
    for name, x in tensors.items():
        assert not torch.isnan(x).any(), f"NaN in {name}"
        if name != "lse":
            assert torch.isfinite(x).all(), f"Inf in {name}"
        else:
            assert not torch.isposinf(x).any(), "+Inf in lse"


def run(fn, q, k, v, g, gl, leaf_dtype=None):
    """Forward with lse and backward of (out * g).sum() + (lse_finite * gl).sum().
    Returns out, lse, dq, dk, dv; the gradients are taken with respect to q, k, v cast to
    `leaf_dtype` (float64 for the oracle, so its gradients are not rounded)."""
    q, k, v = (x.detach().to(leaf_dtype or x.dtype).requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v)
    loss = (out.double() * g).sum() + (finite_lse(lse).double() * gl).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    return out.detach(), lse.detach(), dq, dk, dv


def make_inputs(B, N, Hq, Hkv, D, dtype, seed, q_scale=1.0, k_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = (rnd(B, N, Hq, D) * q_scale).to(dtype)
    k = (rnd(B, N, Hkv, D) * k_scale).to(dtype)
    v = rnd(B, N, Hkv, D).to(dtype)
    # cotangents exactly representable in float16 (so every dtype sees the same ones)
    g = rnd(B, N, Hq, D).half().double()
    gl = rnd(B, Hq, N).half().double()
    return q, k, v, g, gl


def check_empty_rows(out, lse, o_lse):
    """Where the oracle has no key (lse -inf) the backend has lse -inf and out exactly 0;
    elsewhere its lse is finite."""
    empty = torch.isneginf(o_lse)
    assert torch.equal(torch.isneginf(lse), empty), "lse is -inf on other rows than the oracle's"
    assert torch.isfinite(lse[~empty]).all()
    rows = empty.transpose(1, 2)  # (B, N, Hq)
    assert (out[rows] == 0).all(), "rows without keys must output exactly 0"


# ----------------------------------------------------------------------------- (a) property

@st.composite
def dilated_cases(draw):
    m = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 2))
    B, N = draw(st.integers(1, 2)), draw(st.integers(1, 80))
    ws = draw(st.lists(st.integers(1, 100), min_size=m, max_size=m))
    rs = draw(st.lists(st.integers(1, 6), min_size=m, max_size=m))
    return dict(
        B=B,
        N=N,
        ws=[max(w, r) for w, r in zip(ws, rs)],    # a rate above its segment length is refused
        rs=rs,
        Hkv=Hkv,
        Hq=Hkv * draw(st.integers(1, 3)),
        D=draw(st.sampled_from([8, 12, 16, 24])),
        offsets=draw(st.sampled_from(["modulo", "blocked"])),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
    )


def check_case(case, dtype):
    """Portable backend vs the float64 oracle (and the oracle vs the dense definition):
    out, lse and the gradients of q, k, v, with the tolerances of the module docstring."""
    B, N, Hq, Hkv, D = case["B"], case["N"], case["Hq"], case["Hkv"], case["D"]
    ws, rs = case["ws"], case["rs"]
    kw = dict(causal=case["causal"], mode=case["mode"], offsets=case["offsets"])
    q, k, v, g, gl = make_inputs(B, N, Hq, Hkv, D, dtype, case["seed"])

    def backend(q, k, v):
        return dilated_attention(q, k, v, ws, rs, return_lse=True, backend="torch", **kw)

    def oracle(q, k, v):
        return dilated_attention_naive(q.double(), k.double(), v.double(), ws, rs, **kw)

    ref = run(oracle, q, k, v, g, gl, torch.float64)
    o_out, o_lse = ref[0], ref[1]
    # the oracle is the definition: cross-check it against the dense multiset softmax
    C = count_matrix(N, Hq, ws, rs, kw["mode"], kw["offsets"], kw["causal"])
    d_out, d_lse = dense_definition(q, k, v, C, D ** -0.5)
    assert max_err(o_out, d_out) <= 1e-9
    assert torch.equal(torch.isneginf(o_lse), torch.isneginf(d_lse))
    assert max_err(finite_lse(o_lse), finite_lse(d_lse)) <= 1e-9

    got = run(backend, q, k, v, g, gl)
    out, lse, dq, dk, dv = got
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (B, Hq, N) and lse.dtype == torch.float32
    assert_no_nan(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    check_empty_rows(out, lse, o_lse)
    assert dq.dtype == dk.dtype == dv.dtype == dtype

    # return_lse=False takes another path (scaled_dot_product_attention where no head mixes)
    out_nolse = dilated_attention(q, k, v, ws, rs, backend="torch", **kw)
    assert_no_nan(out_nolse=out_nolse)

    names = ("out", "lse", "dq", "dk", "dv")
    if dtype == torch.float32:
        for i, (name, x, o) in enumerate(zip(names, got, ref)):
            if name == "lse":
                x, o = finite_lse(x), finite_lse(o)
            tol = (1e-5 if i < 2 else 3e-5) * max(1.0, amax(o))
            assert max_err(x, o) <= tol, f"{name}: err {max_err(x, o):.3g} > {tol:.3g}"
        assert max_err(out_nolse, o_out) <= 1e-5 * max(1.0, amax(o_out))
    else:
        def ref32(q, k, v):
            out, lse = backend(q.float(), k.float(), v.float())
            return out.to(dtype), lse
        same = run(ref32, q, k, v, g, gl)  # gradients come back in dtype (q, k, v are)
        unit = 1e-3 if dtype == torch.float16 else 8e-3   # about one ulp at 1 (bfloat16: 2^-7)
        for i, (name, x, s, o) in enumerate(zip(names, got, same, ref)):
            if name == "lse":
                x, s, o = finite_lse(x), finite_lse(s), finite_lse(o)
            # gradients: 16-bit ulps grow with the magnitude, and a gradient sums several
            # 16-bit contributions (patterns, GQA heads): the floor scales with |oracle|
            floor = unit if i < 2 else unit * max(1.0, amax(o))
            tol = (2 if i < 2 else 3) * max_err(s, o) + floor
            assert max_err(x, o) <= tol, f"{name}: err {max_err(x, o):.3g} > {tol:.3g}"
        assert max_err(out_nolse, o_out) <= 2 * max_err(same[0], o_out) + unit


# mode, causal and dtype are parametrized (not drawn): each combination gets the profile's
# full number of examples.
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ["longnet", "head_groups"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@given(case=dilated_cases())
def test_portable_matches_oracle(dtype, mode, causal, case):
    check_case(dict(case, mode=mode, causal=causal), dtype)


def _case(N, ws, rs, Hq=1, Hkv=1, mode="longnet", offsets="modulo", B=1, D=8, seed=0):
    return dict(B=B, N=N, ws=list(ws), rs=list(rs), Hq=Hq, Hkv=Hkv, D=D, mode=mode, offsets=offsets,
                seed=seed)


# Fixed corners of the property test's domain (each names the rule of DESIGN §3 it probes).
EXAMPLES = {
    "ragged-tail": _case(5, [2], [1]),                        # N % w != 0: a short last segment
    "ragged-tail-dilated": _case(23, [8, 5], [2, 3], Hq=2, Hkv=2),
    "offset-ge-w": _case(4, [6], [6], Hq=6),                  # heads 4, 5: offset >= the one 4-row segment
    "offset-past-last-segment": _case(9, [8], [3], Hq=3),     # head 2: offset 2 past the 1-row tail
    "w-ge-N-w-mod-r": _case(20, [10, 50], [3, 4], Hq=2),      # w >= N, w % r != 0, no ragged tail
    "head-groups-more-patterns-than-heads": _case(16, [4, 8, 16], [1, 2, 4], Hq=2, mode="head_groups"),
    "gqa-blocked": _case(32, [8, 16], [2, 4], Hq=6, Hkv=2, offsets="blocked"),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_portable_matches_oracle_examples(name, dtype, causal):
    check_case(dict(EXAMPLES[name], causal=causal), dtype)


# ----------------------------------------------------------------------------- (b) dense

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hq, Hkv", [(2, 2), (4, 2), (3, 1)])
@pytest.mark.parametrize("N, w", [(1, 1), (17, 17), (40, 64), (64, 1000)])
@pytest.mark.parametrize("mode, offsets", [("longnet", "modulo"), ("longnet", "blocked"),
                                           ("head_groups", "modulo")])
def test_single_full_pattern_is_dense_sdpa(causal, Hq, Hkv, N, w, mode, offsets):
    B, D = 2, 12
    q, k, v, g, gl = make_inputs(B, N, Hq, Hkv, D, torch.float32, seed=N * 100 + Hq)

    def backend(q, k, v):
        return dilated_attention(q, k, v, [w], [1], causal=causal, mode=mode, offsets=offsets,
                                 return_lse=True, backend="torch")

    def dense(q, k, v):
        G = Hq // Hkv
        qt = q.transpose(1, 2)
        kt, vt = (x.repeat_interleave(G, dim=2).transpose(1, 2) for x in (k, v))
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
        s = qt @ kt.transpose(-1, -2) * D ** -0.5
        if causal:
            s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), NEG_INF)
        return out, torch.logsumexp(s, dim=-1)

    got, ref = run(backend, q, k, v, g, gl), run(dense, q, k, v, g, gl)
    for i, (name, x, o) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), got, ref)):
        assert_no_nan(**{name: x})
        tol = (1e-5 if i < 2 else 3e-5) * max(1.0, amax(o))
        assert max_err(x, o) <= tol, f"{name}: err {max_err(x, o):.3g} > {tol:.3g}"
    # the lse-free path (scaled_dot_product_attention inside) too
    out = dilated_attention(q, k, v, [w], [1], causal=causal, mode=mode, offsets=offsets, backend="torch")
    assert max_err(out, ref[0]) <= 1e-5 * max(1.0, amax(ref[0]))


@pytest.mark.parametrize("causal", [False, True])
def test_single_full_pattern_is_dense_sdpa_fp16(causal):
    B, N, Hq, Hkv, D = 2, 48, 4, 2, 16
    q, k, v, _, _ = make_inputs(B, N, Hq, Hkv, D, torch.float16, seed=7)
    out = dilated_attention(q, k, v, [N], [1], causal=causal, backend="torch")
    qt = q.transpose(1, 2)
    kt, vt = (x.repeat_interleave(2, dim=2).transpose(1, 2) for x in (k, v))
    ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
    o64 = F.scaled_dot_product_attention(qt.double(), kt.double(), vt.double(), is_causal=causal).transpose(1, 2)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert max_err(out, o64) <= 2 * max_err(ref, o64) + 1e-3


# ----------------------------------------------------------------------------- (c) long

def test_long_sequence_matches_oracle():
    B, N, H, D = 1, 3000, 4, 32
    ws, rs = (512, 1024, 2048), (1, 2, 4)
    q, k, v, _, _ = make_inputs(B, N, H, H, D, torch.float32, seed=3)
    out, lse = dilated_attention(q, k, v, ws, rs, causal=True, return_lse=True, backend="torch")
    with torch.no_grad():
        o_out, o_lse = dilated_attention_naive(q, k, v, ws, rs, causal=True)
    assert_no_nan(out=out, lse=lse)
    assert torch.isfinite(lse).all() and torch.isfinite(o_lse).all()  # r=1 pattern: every row has a key
    assert max_err(out, o_out) <= 1e-5 * max(1.0, amax(o_out))
    assert max_err(lse, o_lse) <= 1e-5 * max(1.0, amax(o_lse))


# ----------------------------------------------------------------------------- (d) large scores

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ["longnet", "head_groups"])
@pytest.mark.parametrize("N", [64, 60], ids=["aligned", "ragged"])
def test_large_scores_float32(N, causal, mode):
    """Scores of magnitude 1e3-1e4 in float32: no NaN/Inf anywhere, and the oracle matched
    by the DESIGN §6 rule. At this size float32 itself rounds a score by ~1e-4, so the
    same-dtype reference is the dense definition evaluated in float32:
    |x - oracle| <= 2 * |dense_f32 - oracle| + 1e-5 * max(1, |oracle|) (gradients: 3x)."""
    B, Hq, Hkv, D = 1, 4, 2, 16
    ws, rs = (16, 32, 64), (1, 2, 4)
    scale = 1.0
    q, k, v, g, gl = make_inputs(B, N, Hq, Hkv, D, torch.float32, seed=11, q_scale=100.0, k_scale=3.0)
    s = torch.einsum("bnhd,bmhd->bhnm", q.double(), k.double().repeat_interleave(2, dim=2)) * scale
    assert 1e3 <= s.abs().max().item() <= 2e4  # the test is about scores of this size
    kw = dict(causal=causal, mode=mode, scale=scale)
    C = count_matrix(N, Hq, ws, rs, mode, "modulo", causal)

    got = run(lambda q, k, v: dilated_attention(q, k, v, ws, rs, return_lse=True, backend="torch", **kw),
              q, k, v, g, gl)
    ref = run(lambda q, k, v: dilated_attention_naive(q.double(), k.double(), v.double(), ws, rs, **kw),
              q, k, v, g, gl, torch.float64)
    same = run(lambda q, k, v: dense_definition(q, k, v, C, scale, torch.float32), q, k, v, g, gl)
    out, lse = got[0], got[1]
    assert_no_nan(out=out, lse=lse, dq=got[2], dk=got[3], dv=got[4])
    check_empty_rows(out, lse, ref[1])
    for i, (name, x, sd, o) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), got, same, ref)):
        if name == "lse":
            x, sd, o = finite_lse(x), finite_lse(sd), finite_lse(o)
        tol = (2 if i < 2 else 3) * max_err(sd, o) + 1e-5 * max(1.0, amax(o))
        assert max_err(x, o) <= tol, f"{name}: err {max_err(x, o):.3g} > {tol:.3g}"


# ----------------------------------------------------------------------------- (e) empty rows

EMPTY_ROW_CASES = {  # name: (Hq, Hkv, ws, rs, mode, offsets, N aligned with every w (or < w), N ragged)
    "hg-2pat": (4, 2, (6, 12), (3, 3), "head_groups", "modulo", 24, 30),  # 2/3 of every head's rows empty
    "hg-3pat": (6, 3, (4, 12, 100), (3, 3, 3), "head_groups", "modulo", 24, 30),
    "ln-1pat": (3, 1, (6,), (3,), "longnet", "modulo", 24, 28),
    # (was offsets >= w, i.e. r > w, now refused) offsets 2, 3 lie past the 2-row last segment of N = 26
    "ln-offset-past-tail": (4, 2, (4, 6), (4, 6), "longnet", "modulo", 24, 26),
    "ln-blocked": (4, 4, (4, 9), (4, 5), "longnet", "blocked", 36, 30),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ragged", [False, True], ids=["aligned", "ragged"])
@pytest.mark.parametrize("name", list(EMPTY_ROW_CASES))
def test_rows_without_keys(name, ragged, causal):
    Hq, Hkv, ws, rs, mode, offsets, n_aligned, n_ragged = EMPTY_ROW_CASES[name]
    B, N, D = 2, (n_ragged if ragged else n_aligned), 8
    assert any(N % w != 0 and N > w for w in ws) == ragged  # a short last segment or not
    q, k, v, g, gl = make_inputs(B, N, Hq, Hkv, D, torch.float32, seed=5)
    kw = dict(causal=causal, mode=mode, offsets=offsets)

    # from DESIGN §3 directly: row p of head h has a key iff it is active in one of h's patterns
    G = Hq // Hkv
    pos = torch.arange(N)
    active = torch.zeros(Hq, N, dtype=torch.bool)
    for h, row in enumerate(offset_table(Hq, ws, rs, mode, offsets)):
        for (w, r), o in zip(zip(ws, rs), row):
            if o >= 0:
                active[h] |= (pos - (pos // w) * w) % r == o
    key_used = active.view(Hkv, G, N).any(dim=1)  # (Hkv, N): read by some query of the group
    assert (~active).any() and active.any()  # the case has both kinds of rows

    got = run(lambda q, k, v: dilated_attention(q, k, v, ws, rs, return_lse=True, backend="torch", **kw),
              q, k, v, g, gl)
    ref = run(lambda q, k, v: dilated_attention_naive(q.double(), k.double(), v.double(), ws, rs, **kw),
              q, k, v, g, gl, torch.float64)
    out, lse, dq, dk, dv = got
    assert_no_nan(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    empty_q = ~active.T.expand(B, N, Hq)          # (B, N, Hq)
    unused_kv = ~key_used.T.expand(B, N, Hkv)     # (B, N, Hkv)
    assert torch.equal(torch.isneginf(lse), ~active.expand(B, Hq, N))
    assert torch.equal(torch.isneginf(ref[1]), ~active.expand(B, Hq, N))
    assert (out[empty_q] == 0).all()
    assert (dq[empty_q] == 0).all()
    assert (dk[unused_kv] == 0).all() and (dv[unused_kv] == 0).all()
    # and the rows with keys are right
    for i, (name, x, o) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), got, ref)):
        if name == "lse":
            x, o = finite_lse(x), finite_lse(o)
        tol = (1e-5 if i < 2 else 3e-5) * max(1.0, amax(o))
        assert max_err(x, o) <= tol, f"{name}: err {max_err(x, o):.3g} > {tol:.3g}"


# ----------------------------------------------------------------------------- (f) attention with lse

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("last_dim_strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_with_lse_both_paths(dtype, last_dim_strided, causal):
    """ops.common.lse.attention_with_lse (the portable path's per-pattern attention): the
    fused CPU kernel (ordinary scores) and the explicit path (scores above FUSED_MAX_SCORE)
    against float64, out, lse and the gradients of a loss that uses both."""
    from triton_dilated.ops.common import lse as lse_mod
    gen = torch.Generator().manual_seed(3)
    B, H, L, D = 2, 3, 37, 16

    def make(*shape):
        x = torch.randn(*shape, generator=gen)
        return x.transpose(-1, -2).contiguous().transpose(-1, -2) if last_dim_strided else x
    q, k, v = (make(B, H, L, D) for _ in range(3))
    g, gl = torch.randn(B, H, L, D, generator=gen), torch.randn(B, H, L, generator=gen)
    keep = torch.ones(L, L, dtype=torch.bool)
    keep = keep.tril() if causal else keep

    def grads(fn, dt, scale):   # inputs rounded to `dtype` first, then cast to dt
        xs = [x.to(dtype).to(dt).detach().requires_grad_() for x in (q, k, v)]
        out, lse = fn(*xs, scale)
        loss = (out.double() * g.double()).sum() + (lse.double() * gl.double()).sum()
        return [out, lse, *torch.autograd.grad(loss, xs)]

    for scale, fused in ((D ** -0.5, True), (40.0, False)):   # bound ~ 40 * 6 * 6 > FUSED_MAX_SCORE
        assert lse_mod._use_cpu_flash(q.to(dtype), k.to(dtype), scale) == fused
        ref = grads(lambda a, b, c, s: lse_mod.masked_attention_with_lse(a, b, c, keep, s), torch.float64, scale)
        got = grads(lambda a, b, c, s: lse_mod.attention_with_lse(a, b, c, causal, s), dtype, scale)
        same = grads(lambda a, b, c, s: lse_mod.masked_attention_with_lse(a, b, c, keep, s),
                     torch.float32, scale)   # the same-dtype reference: explicit float32 on the rounded inputs
        for i, (name, x, sd, o) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), got, same, ref)):
            tol = (2 if i < 2 else 3) * max_err(sd, o) + (1e-5 if dtype == torch.float32 else 1e-2) * max(1.0, amax(o))
            assert max_err(x, o) <= tol, f"{name} (fused={fused}): err {max_err(x, o):.3g} > {tol:.3g}"
