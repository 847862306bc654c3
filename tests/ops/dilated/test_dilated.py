"""Dilated attention, both backends against the float64 oracle `dilated_attention_naive`:
"triton" (the fused kernels; Triton's interpreter on CPU, compiled on CUDA) and "torch" (the
portable PyTorch path). Every comparison is tests/helpers/reference.py's check_against_oracle: out,
lse and the gradients of a loss through both, by the tolerance rule, and the rows without
keys. The oracle itself is checked against the dense definition of DESIGN §3 (the
multiplicity matrix), and that matrix against a derivation written here independently.
Backend-specific: the planner (Triton), the long sequence and attention_with_lse (portable).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, strategies as st

from triton_dilated.ops.common.call import AttentionCall
from triton_dilated import dilated_attention, dilated_attention_naive
from triton_dilated.ops.dilated.naive import dilated_multiplicity
from triton_dilated.ops.dilated.patterns import head_offsets
from triton_dilated.ops.dilated.plan import build_items, key_unit_triples, query_unit_triples
from tests.conftest import DEVICE
from tests.helpers.reference import (FLOOR, assert_rule, check_against_oracle, dense_reference, dilated_serve, finite,
                                     max_err, sdpa_reference, seeded)

BACKENDS = ["triton", "torch"]
# the interpreter gets bfloat16 tl.dot wrong (DESIGN §10): bfloat16 kernels on a GPU only
DTYPES = {"triton": [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []),
          "torch": [torch.float32, torch.float16, torch.bfloat16]}
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# ----------------------------------------------------------------------------- helpers

def make_qkv(B, N, Hq, Hkv, D, dtype, seed, *, strided=False, q_scale=1.0, k_scale=1.0):
    """Seeded q, k, v on the test device; strided: slices of one packed (B, N, Hq + 2 Hkv, D)
    tensor (non-contiguous, read in place by the kernels)."""
    packed = seeded((B, N, Hq + 2 * Hkv, D), torch.float64, seed)
    packed[:, :, :Hq] *= q_scale
    packed[:, :, Hq:Hq + Hkv] *= k_scale
    packed = packed.to(device=DEVICE, dtype=dtype)
    q, k, v = packed[:, :, :Hq], packed[:, :, Hq:Hq + Hkv], packed[:, :, Hq + Hkv:]
    return (q, k, v) if strided else tuple(x.contiguous() for x in (q, k, v))


def check_dilated(backend, qkv, ws, rs, *, causal=False, mode="longnet", offsets="modulo", scale=None, seed=0,
                  grads=True, grad_floor=None, check_definition=True):
    """dilated_attention(backend) against the oracle by check_against_oracle, the portable
    backend's lse-free path too; and (check_definition) the oracle's out, lse and gradients
    against the dense definition over dilated_multiplicity, in float64."""
    kw = dict(causal=causal, mode=mode, offsets=offsets, scale=scale)
    counts = dilated_multiplicity(qkv[0].shape[1], ws, rs, qkv[0].shape[2], causal=causal, mode=mode, offsets=offsets)
    # return_lse=False is another path on the portable backend (no lse merge where no head mixes)
    out_only = (lambda q, k, v: dilated_attention(q, k, v, ws, rs, backend="torch", **kw)) if backend == "torch" else None
    res = check_against_oracle(
        lambda q, k, v: dilated_attention(q, k, v, ws, rs, return_lse=True, backend=backend, **kw),
        lambda q, k, v: dilated_attention_naive(q, k, v, ws, rs, **kw),
        lambda q, k, v: dense_reference(q, k, v, counts, scale),
        qkv, counts=counts, seed=seed, grads=grads, grad_floor=grad_floor, out_only=out_only)
    if check_definition:
        leaves = [x.detach().double().requires_grad_(grads) for x in qkv]
        d_out, d_lse = dense_reference(*leaves, counts, scale)
        assert max_err(res.oracle[0], d_out) <= 1e-9
        assert torch.equal(torch.isinf(res.oracle[1]), torch.isinf(d_lse))
        assert max_err(finite(res.oracle[1]), finite(d_lse)) <= 1e-9
        if grads:
            g, gl = res.cotangents
            loss = (d_out * g).sum() + (finite(d_lse) * gl).sum()
            for a, b in zip(res.oracle[2:], torch.autograd.grad(loss, leaves)):
                assert max_err(a, b) <= 1e-9
    return res


def independent_offset_table(Hq, ws, rs, mode, offsets):
    """Per query head, per pattern: the offset, or -1 where the head does not use it, written
    from the text of DESIGN §3 independently of the package's head_offsets (which the oracle,
    the kernels and dilated_multiplicity share)."""
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


def independent_multiplicity(N, Hq, ws, rs, mode, offsets, causal):
    """C[h, p, p']: in how many of head h's patterns query p reads key p' (DESIGN §3), from
    independent_offset_table with one pattern and one segment at a time."""
    C = torch.zeros(Hq, N, N, dtype=torch.float64)
    for h, row in enumerate(independent_offset_table(Hq, ws, rs, mode, offsets)):
        for (w, r), o in zip(zip(ws, rs), row):
            if o < 0:
                continue
            for s in range(0, N, w):
                rows = torch.tensor(range(s + o, min(s + w, N), r), dtype=torch.long)
                keep = (rows[:, None] >= rows[None, :]) if causal else torch.ones(len(rows), len(rows), dtype=torch.bool)
                C[h, rows[:, None], rows[None, :]] += keep.double()
    return C


# ----------------------------------------------------------------------------- property

# Triton's interpreter takes ~0.1 s per kernel program (forward and backward), and the number of programs (query and
# key tiles) ranges from 2 to 500+ over the property's domain (small segments at large N):
# under the interpreter a case is kept to INTERPRETER_MAX_TILES (a quarter of the domain is
# over; the LongNet-schedule example has 96), which keeps the test's time predictable.
INTERPRETER_MAX_TILES = 96


def kernel_tiles(c):
    """B * (query tiles + key tiles) the planner makes for case c."""
    pats = tuple(zip(c["ws"], c["rs"]))
    table = head_offsets(c["Hq"], pats, c["mode"], c["offsets"])
    q_items, _ = build_items(c["N"], query_unit_triples(pats, table), 32, 32, c["causal"])
    k_items, _ = build_items(c["N"], key_unit_triples(pats, table, c["Hkv"]), 32, 32, c["causal"], True)
    return c["B"] * (len(q_items) + len(k_items))


@st.composite
def dilated_cases(draw, backend, dtype=None, mode=None, causal=None):
    """Random patterns (w may exceed N or not divide it, r may not divide w; r <= w), GQA, D not a
    power of two, strided or contiguous inputs; dtype, mode and causal drawn unless fixed."""
    m = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.integers(1, 2 if backend == "triton" else 3))
    ws = draw(st.lists(st.integers(1, 100), min_size=m, max_size=m))
    rs = draw(st.lists(st.integers(1, 6), min_size=m, max_size=m))
    c = dict(
        B=draw(st.integers(1, min(2, 4 // Hq) if backend == "triton" else 2)),   # interpreter: B * Hq <= 4
        N=draw(st.integers(1, 96)), Hq=Hq, Hkv=Hkv,
        ws=[max(w, r) for w, r in zip(ws, rs)], rs=rs,    # a rate above its segment length is refused
        D=draw(st.sampled_from([8, 12, 16, 24, 40])),
        mode=mode or draw(st.sampled_from(["longnet", "head_groups"])),
        offsets=draw(st.sampled_from(["modulo", "blocked"])),
        causal=draw(st.booleans()) if causal is None else causal,
        dtype=dtype or draw(st.sampled_from(DTYPES[backend])),
        strided=draw(st.booleans()),
        seed=draw(st.integers(0, 2 ** 31 - 1)))
    if backend == "triton" and DEVICE == "cpu":
        assume(kernel_tiles(c) <= INTERPRETER_MAX_TILES)
    return c


# One property, split into tests that each get the profile's number of examples (and that
# xdist can spread): the portable backend per (dtype, mode, causal); the interpreter costs
# ~1.5 s an example, so the Triton backend draws them all in one test.
PROPERTY_SPLITS = [pytest.param("triton", {}, id="triton")] + [
    pytest.param("torch", dict(dtype=dt, mode=mode, causal=causal),
                 id=f"torch-{DTYPE_IDS[dt]}-{mode}-{'causal' if causal else 'full'}")
    for dt in DTYPES["torch"] for mode in ("longnet", "head_groups") for causal in (False, True)]


@pytest.mark.parametrize("backend, fixed", PROPERTY_SPLITS)
@given(data=st.data())
def test_matches_oracle(backend, fixed, data):
    c = data.draw(dilated_cases(backend, **fixed), label="case")
    qkv = make_qkv(c["B"], c["N"], c["Hq"], c["Hkv"], c["D"], c["dtype"], c["seed"], strided=c["strided"])
    check_dilated(backend, qkv, c["ws"], c["rs"], causal=c["causal"], mode=c["mode"], offsets=c["offsets"],
                  seed=c["seed"] + 1)


def _case(N, ws, rs, Hq=1, Hkv=1, mode="longnet", offsets="modulo", B=1, D=8):
    return dict(B=B, N=N, ws=list(ws), rs=list(rs), Hq=Hq, Hkv=Hkv, D=D, mode=mode, offsets=offsets)


# Fixed corners of the property's domain (each names the rule of DESIGN §3 it probes). The
# costly one first, so that xdist starts it early.
EXAMPLES = {
    # the paper's schedule shape (rates 1, 2, 4, 6, 12; segments doubling) scaled to N = 192,
    # head dim not a power of two, GQA
    "longnet-schedule-scaled-down": _case(192, [12, 24, 48, 96, 192], [1, 2, 4, 6, 12], Hq=4, Hkv=2, D=24),
    "ragged-tail": _case(5, [2], [1]),                        # N % w != 0: a short last segment
    "ragged-tail-dilated": _case(23, [8, 5], [2, 3], Hq=2, Hkv=2),
    "offset-ge-w": _case(4, [6], [6], Hq=6),                  # heads 4, 5: offset >= the one 4-row segment
    "offset-past-last-segment": _case(9, [8], [3], Hq=3),     # head 2: offset 2 past the 1-row tail
    "w-ge-N-w-mod-r": _case(20, [10, 50], [3, 4], Hq=2),      # w >= N, w % r != 0, no ragged tail
    "head-groups-more-patterns-than-heads": _case(16, [4, 8, 16], [1, 2, 4], Hq=2, mode="head_groups"),
    "gqa-blocked": _case(32, [8, 16], [2, 4], Hq=6, Hkv=2, offsets="blocked"),
}


def _example_params():
    """Every corner in float32 and float16, full and causal, on the portable backend; the
    interpreter (~1 s per small case) takes the corners in float32 (not gqa-blocked's six
    heads: the property draws GQA and blocked offsets); the LongNet schedule in every dtype."""
    for name in EXAMPLES:
        schedule = name == "longnet-schedule-scaled-down"
        for backend in BACKENDS:
            for dtype in (DTYPES[backend] if schedule else (torch.float32, torch.float16)):
                for causal in (False, True):
                    if backend == "torch" or schedule or (dtype == torch.float32 and name != "gqa-blocked"):
                        yield pytest.param(backend, name, dtype, causal,
                                           id=f"{backend}-{name}-{DTYPE_IDS[dtype]}-{'causal' if causal else 'full'}")


@pytest.mark.parametrize("backend, name, dtype, causal", list(_example_params()))
def test_matches_oracle_examples(backend, name, dtype, causal):
    c = EXAMPLES[name]
    qkv = make_qkv(c["B"], c["N"], c["Hq"], c["Hkv"], c["D"], dtype, seed=len(name))
    check_dilated(backend, qkv, c["ws"], c["rs"], causal=causal, mode=c["mode"], offsets=c["offsets"])


@given(N=st.integers(1, 96), Hq=st.integers(1, 8), pats=st.lists(st.tuples(st.integers(1, 100), st.integers(1, 6)),
                                                                  min_size=1, max_size=4),
       mode=st.sampled_from(["longnet", "head_groups"]), offsets=st.sampled_from(["modulo", "blocked"]),
       causal=st.booleans())
def test_multiplicity_matches_independent_derivation(N, Hq, pats, mode, offsets, causal):
    """head_offsets and dilated_multiplicity (the offsets the oracle and the kernels use; the
    definition the oracle is checked against) equal the independent derivation above."""
    ws, rs = [max(w, r) for w, r in pats], [r for _, r in pats]   # a rate above its segment length is refused
    pats = list(zip(ws, rs))
    assert [list(row) for row in head_offsets(Hq, tuple(pats), mode, offsets)] == \
        independent_offset_table(Hq, ws, rs, mode, offsets)
    assert torch.equal(dilated_multiplicity(N, ws, rs, Hq, causal=causal, mode=mode, offsets=offsets),
                       independent_multiplicity(N, Hq, ws, rs, mode, offsets, causal))


# ----------------------------------------------------------------------------- special inputs

def _dense_cases():
    """Single pattern (w, r=1) with w >= N or w = N: dense attention. The portable backend
    takes the whole grid; the interpreter a corner of it (GQA; w = N, and w > N)."""
    for causal in (False, True):
        for Hq, Hkv in [(2, 2), (4, 2), (3, 1)]:
            for N, w in [(1, 1), (17, 17), (40, 64), (64, 1000)]:
                for mode, offsets in [("longnet", "modulo"), ("longnet", "blocked"), ("head_groups", "modulo")]:
                    ids = f"{'causal' if causal else 'full'}-H{Hq}-{Hkv}-N{N}-w{w}-{mode}-{offsets}"
                    yield pytest.param("torch", causal, Hq, Hkv, N, w, mode, offsets, id="torch-" + ids)
                    if (Hq, Hkv) == (4, 2) and offsets == "modulo" and (
                            (N, mode, causal) == (17, "longnet", False) or (N, mode, causal) == (64, "head_groups", True)):
                        yield pytest.param("triton", causal, Hq, Hkv, N, w, mode, offsets, id="triton-" + ids)


@pytest.mark.parametrize("backend, causal, Hq, Hkv, N, w, mode, offsets", list(_dense_cases()))
def test_single_full_pattern_is_dense_attention(backend, causal, Hq, Hkv, N, w, mode, offsets):
    """Against torch's scaled_dot_product_attention in float64 (an oracle sharing no code
    with the package); float16 too, and w > N is bitwise the w = N result."""
    B, D = (2, 12) if backend == "torch" else (1, 12)
    for dtype in (torch.float32, torch.float16):
        qkv = make_qkv(B, N, Hq, Hkv, D, dtype, seed=N * 100 + Hq)
        kw = dict(causal=causal, mode=mode, offsets=offsets, backend=backend)
        ref = sdpa_reference(causal=causal)
        res = check_against_oracle(lambda q, k, v: dilated_attention(q, k, v, [w], [1], return_lse=True, **kw),
                                   ref, ref, qkv, grads=dtype == torch.float32,
                                   out_only=lambda q, k, v: dilated_attention(q, k, v, [w], [1], **kw))
        assert torch.equal(dilated_attention(*qkv, [N], [1], **kw), res.got[0])


LARGE_SCORE_PARAMS = [  # the portable backend: all; the interpreter: two corners
    pytest.param(backend, N, causal, mode, id=f"{backend}-N{N}-{mode}-{'causal' if causal else 'full'}")
    for N in (64, 60) for causal in (False, True) for mode in ("longnet", "head_groups") for backend in BACKENDS
    if backend == "torch" or (N, causal, mode) in ((64, False, "longnet"), (60, True, "head_groups"))]


@pytest.mark.parametrize("backend, N, causal, mode", LARGE_SCORE_PARAMS)
def test_large_scores_float32(backend, N, causal, mode):
    """Scores of magnitude 1e3-1e4 in float32: no NaN/Inf, the rule holds. float32 rounds such
    a score by eps32 * |s| ~ 1e-3 whatever the implementation, and the same-dtype reference
    (dense float32) carries that error, so the rule's bound grows with it.
    The kernels' backward recomputes P from the scores (flash-attention's backward): a
    recomputed P, and so the gradients, are only good to eps32 * max|s| (relative), which is
    their gradient floor here. The portable path keeps P for the backward, as the dense
    reference does: floor 1e-5 for it."""
    B, Hq, Hkv, D = 1, 4, 2, 16
    ws, rs = [16, 32, 64], [1, 2, 4]
    qkv = make_qkv(B, N, Hq, Hkv, D, torch.float32, seed=11, q_scale=100.0, k_scale=3.0)
    max_score = torch.einsum("bnhd,bmhd->bhnm", qkv[0].double(), qkv[1].double().repeat_interleave(2, dim=2)).abs().max()
    assert 1e3 <= max_score <= 2e4  # the test is about scores of this size
    grad_floor = 2 * torch.finfo(torch.float32).eps * max_score.item() if backend == "triton" else None
    res = check_dilated(backend, qkv, ws, rs, causal=causal, mode=mode, scale=1.0, grad_floor=grad_floor,
                        check_definition=False)
    assert all(torch.isfinite(x).all() for x in (res.got[0], *res.got[2:]))


EMPTY_ROW_CASES = {  # name: (Hq, Hkv, ws, rs, mode, offsets, N aligned with every w (or < w), N ragged)
    "hg-2pat": (4, 2, (6, 12), (3, 3), "head_groups", "modulo", 24, 30),  # 2/3 of every head's rows empty
    "hg-3pat": (6, 3, (4, 12, 100), (3, 3, 3), "head_groups", "modulo", 24, 30),
    "ln-1pat": (3, 1, (6,), (3,), "longnet", "modulo", 24, 28),
    # offsets 2, 3 lie past the 2-row last segment of N = 26
    "ln-offset-past-tail": (4, 2, (4, 6), (4, 6), "longnet", "modulo", 24, 26),
    "ln-blocked": (4, 4, (4, 9), (4, 5), "longnet", "blocked", 36, 30),
}


# the portable backend: every case, aligned and ragged, full and causal; the interpreter: two
# cheap ones (whole heads without keys: EXAMPLES["offset-ge-w"])
EMPTY_ROW_PARAMS = [
    pytest.param(backend, name, ragged, causal, id=f"{backend}-{name}-{'ragged' if ragged else 'aligned'}-"
                                                   f"{'causal' if causal else 'full'}")
    for name in EMPTY_ROW_CASES for ragged in (False, True) for causal in (False, True) for backend in BACKENDS
    if backend == "torch" or (name, ragged, causal) in (("hg-2pat", False, False), ("ln-1pat", True, True))]


@pytest.mark.parametrize("backend, name, ragged, causal", EMPTY_ROW_PARAMS)
def test_rows_without_keys(backend, name, ragged, causal):
    """Rows no pattern of the head activates: lse -inf, out and dq exactly 0; keys no query of
    the group reads: dk = dv = 0 (check_against_oracle's empty-row checks); and those rows
    are the ones the independent derivation gives."""
    Hq, Hkv, ws, rs, mode, offsets, n_aligned, n_ragged = EMPTY_ROW_CASES[name]
    N = n_ragged if ragged else n_aligned
    assert any(N % w != 0 and N > w for w in ws) == ragged  # a short last segment or not
    active = independent_multiplicity(N, Hq, ws, rs, mode, offsets, False).diagonal(dim1=1, dim2=2) > 0
    assert (~active).any() and active.any()  # the case has both kinds of rows
    qkv = make_qkv(2 if backend == "torch" else 1, N, Hq, Hkv, 8, torch.float32, seed=5)
    res = check_dilated(backend, qkv, list(ws), list(rs), causal=causal, mode=mode, offsets=offsets)
    assert torch.equal(torch.isneginf(res.got[1]).cpu(), ~active.expand(res.got[1].shape))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_long_sequence_no_overflow(backend):
    """float16 with N where the unnormalised sums would overflow float16."""
    check_dilated(backend, make_qkv(1, 384, 1, 1, 16, torch.float16, seed=0), [384], [1], causal=True,
                  check_definition=False)


def test_long_sequence_matches_oracle():
    """Portable backend at N = 3000 (too long for the interpreter), forward. The dense
    same-dtype reference would need N^2 memory: the oracle rounded to float32 stands in for
    it, which leaves the float32 floor, |x - oracle| <= ~1e-5 * max(1, |oracle|)."""
    ws, rs = [512, 1024, 2048], [1, 2, 4]
    qkv = make_qkv(1, 3000, 4, 4, 32, torch.float32, seed=3)
    oracle = lambda q, k, v: dilated_attention_naive(q, k, v, ws, rs, causal=True)  # noqa: E731
    res = check_against_oracle(
        lambda q, k, v: dilated_attention(q, k, v, ws, rs, causal=True, return_lse=True, backend="torch"), oracle,
        lambda q, k, v: tuple(x.float() for x in oracle(q, k, v)), qkv, grads=False,
        out_only=lambda q, k, v: dilated_attention(q, k, v, ws, rs, causal=True, backend="torch"))
    assert torch.isfinite(res.got[1]).all()   # r = 1 pattern: every row has a key


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_backward(backend):
    q, k, v = (seeded((1, 96, 4, 16), torch.float32, s, DEVICE).requires_grad_() for s in range(3))

    def grads():
        out = dilated_attention(q, k, v, [32, 96], [1, 3], causal=True, backend=backend)
        return torch.autograd.grad(out.square().sum(), (q, k, v))
    for a, b in zip(grads(), grads()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dq_tile, dkdv_tile", [((16, 32), (32, 16)), ((32, 16), (16, 32))],
                         ids=["dq16x32-dkdv32x16", "dq32x16-dkdv16x32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_with_its_own_dkdv_tiles(monkeypatch, dq_tile, dkdv_tile, causal):
    """The dK/dV kernel with a config of its own, key tile (BLOCK_M) != query block
    (BLOCK_N), and dQ with another (the interpreter's default is square, 32 x 32 for both):
    the key-side plan and the S^T = K Q^T formulation against the oracle, with GQA, dilated
    rates and masked/unmasked query blocks."""
    from triton_dilated.ops.dilated import kernels
    cfg = lambda m, n: dict(BLOCK_M=m, BLOCK_N=n, num_warps=4, num_stages=1)  # noqa: E731
    picked = {None: cfg(*dq_tile), "dilated_bwd_dkdv": cfg(*dkdv_tile)}
    monkeypatch.setattr(kernels, "select_config", lambda family, *a, kernel=None: (
        picked[kernel] if family == "dilated_bwd" else cfg(32, 32)))
    check_dilated("triton", make_qkv(1, 80, 2, 1, 16, torch.float32, seed=11), [32, 80], [1, 2], causal=causal,
                  check_definition=False)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_variable_length_sequences(backend, causal):
    """cu_seqlens: segments restart at each document; the oracle is per-document calls, the
    multiplicity block-diagonal (an empty document too)."""
    check_packed_documents(backend, causal)


def check_packed_documents(backend, causal):
    bounds = [0, 17, 17, 60, 96]
    ws, rs, Hq = [8, 32], [1, 2], 4
    qkv = make_qkv(1, 96, Hq, 2, 16, torch.float32, seed=0)
    counts = torch.zeros(Hq, 96, 96, dtype=torch.float64)
    for s, e in zip(bounds[:-1], bounds[1:]):
        counts[:, s:e, s:e] = dilated_multiplicity(e - s, ws, rs, Hq, causal=causal)

    def per_document(q, k, v):
        parts = [dilated_attention_naive(q[:, s:e], k[:, s:e], v[:, s:e], ws, rs, causal=causal)
                 for s, e in zip(bounds[:-1], bounds[1:])]
        return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 2)
    cu = torch.tensor(bounds, dtype=torch.int32)
    check_against_oracle(
        lambda q, k, v: dilated_attention(q, k, v, ws, rs, causal=causal, return_lse=True, backend=backend,
                                          cu_seqlens=cu),
        per_document, lambda q, k, v: dense_reference(q, k, v, counts), qkv, counts=counts)


def test_cu_seqlens_validation():
    q = torch.randn(1, 10, 1, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        dilated_attention(q, q, q, [4], [1], cu_seqlens=[0, 5, 9])
    with pytest.raises(ValueError, match="batch size must be 1"):
        dilated_attention(torch.randn(2, 10, 1, 8), torch.randn(2, 10, 1, 8), torch.randn(2, 10, 1, 8), [4], [1],
                          cu_seqlens=[0, 10])
    with pytest.raises(TypeError, match="cu_seqlens"):
        dilated_attention(q, q, q, [4], [1], cu_seqlens=torch.tensor([0.0, 10.0]))


# ----------------------------------------------------------------------------- Triton: the planner

def test_tile_stride_lcm_path_is_exercised():
    """A shape where the planner tiles with T = lcm(rates) > 1 (whole tiles active or idle per
    pattern, unmasked key blocks) is covered against the oracle."""
    ws, rs, N, H = [64, 128], [2, 4], 256, 2
    table = head_offsets(H, tuple(zip(ws, rs)), "longnet", "modulo")
    items, _ = build_items(N, query_unit_triples(tuple(zip(ws, rs)), table), 32, 32, False)
    strides = set(items[:, 3].tolist())
    assert max(strides) > 1 and any(T % r == 0 for T in strides for r in rs) and any(T % r for T in strides for r in rs)
    check_dilated("triton", make_qkv(1, N, H, 1, 16, torch.float32, seed=0), ws, rs, check_definition=False)


def test_planner_covers_every_row_once():
    """Every (head, row) of the sequence lies in exactly one tile, on the query and key side."""
    for N, pats, H, Hkv, mode, off, causal in [
            (100, ((7, 3), (20, 2), (64, 4)), 6, 3, "longnet", "modulo", False),
            (333, ((32, 1), (64, 2), (128, 4), (256, 6)), 4, 2, "longnet", "blocked", True),
            (50, ((8, 3), (100, 2)), 5, 1, "head_groups", "modulo", True)]:
        table = head_offsets(H, pats, mode, off)
        for keys_side, units in ((False, query_unit_triples(pats, table)), (True, key_unit_triples(pats, table, Hkv))):
            items, full = build_items(N, units, 32, 32, causal, keys_side)
            seen = torch.zeros(len(units), N, dtype=torch.int64)
            for first, end, unit, T, doc_start, doc_end in items.tolist():
                assert (doc_start, doc_end) == (0, N)
                rows = torch.arange(first, min(end, first + 32 * T), T)
                assert rows.numel() > 0
                seen[unit, rows] += 1
                for w, _, _ in units[unit]:   # a tile never crosses a segment boundary
                    assert rows.min() // w == rows.max() // w
            assert seen.max() == 1
            # rows not covered are exactly the rows no pattern of the unit uses
            used = torch.zeros(len(units), N, dtype=torch.bool)
            pos = torch.arange(N)
            for u, triples in enumerate(units):
                for w, r, o in triples:
                    used[u] |= (pos - pos // w * w) % r == o
            assert torch.equal(seen.bool() | ~used, torch.ones_like(used)) and (full == bool(seen.all()))


# ----------------------------------------------------------------------------- Triton: the two loop structures

class _LaunchSpy:
    """Stands in for a kernel: records the FLAT_LOOP of each launch, then launches."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append(kwargs["FLAT_LOOP"])
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture(params=[0, 1], ids=["per-pattern-loops", "flat-loop"])
def flat_loop(request, monkeypatch):
    """The forward and dQ kernels with FLAT_LOOP = the param (0: an unmasked and a masked key
    loop per pattern; 1: the unmasked blocks of all patterns in one loop, then the masked
    ones), set by the "FLAT_LOOP" key of the config dict the launchers get; afterwards,
    every forward and dQ launch is checked to have received it."""
    from triton_dilated.ops.dilated import kernels
    pick = kernels.select_config
    monkeypatch.setattr(kernels, "select_config", lambda *a, **kw: dict(pick(*a, **kw), FLAT_LOOP=request.param))
    seen = []
    for name in ("_dilated_fwd_kernel", "_dilated_bwd_dq_kernel"):
        monkeypatch.setattr(kernels, name, _LaunchSpy(getattr(kernels, name), seen))
    yield request.param
    assert len(seen) >= 2 and set(seen) == {request.param}, seen


# (N, ws, rs, Hq, Hkv, mode): tiles where two patterns have unmasked key blocks (one flat loop
# crosses from one pattern's run to the next) and a pattern whose rate does not divide the
# tile stride (masked blocks, rows of the tile inactive); GQA; a head that does not use
# every pattern (head_groups: offset -1)
LOOP_CASES = {
    "two-unmasked-runs-masked-rows": (96, [32, 64, 96], [1, 1, 3], 2, 1, "longnet"),
    "stride-2-tiles": (128, [64, 128, 128], [1, 2, 3], 2, 2, "longnet"),
    "head-groups": (64, [8, 32, 64], [1, 2, 4], 3, 1, "head_groups"),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(LOOP_CASES))
def test_both_loop_structures_match_oracle(flat_loop, name, causal):
    N, ws, rs, Hq, Hkv, mode = LOOP_CASES[name]
    pats = tuple(zip(ws, rs))
    items, _ = build_items(N, query_unit_triples(pats, head_offsets(Hq, pats, mode, "modulo")), 32, 32, causal)
    strides = set(items[:, 3].tolist())
    assert any(T % r for T in strides for r in rs)   # masked rows
    if mode == "longnet" and not causal:   # some tile has two patterns with a full 32-key block each
        assert any(sum(T % r == 0 and w // r >= 32 for w, r in pats) >= 2 for T in strides)
    check_dilated("triton", make_qkv(1, N, Hq, Hkv, 16, torch.float32, seed=N + Hq), ws, rs, causal=causal,
                  mode=mode, check_definition=False)


def test_both_loop_structures_packed_documents(flat_loop):
    check_packed_documents("triton", True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_both_loop_structures_chunked_prefill(flat_loop, causal):
    """Queries shorter than keys with ragged lengths through the serve door (chunked prefill,
    a query window: the plan holds only the tiles of the last Nq rows of each row's keys)
    against the definition."""
    from tests.helpers.serve_checks import check_against_definition as _check
    ws, rs, lengths = [32, 64, 96], [1, 1, 3], [96, 71]
    q = seeded((2, 24, 2, 16), torch.float32, 1, DEVICE)
    k = seeded((2, 96, 1, 16), torch.float32, 2, DEVICE)
    v = seeded((2, 96, 1, 16), torch.float32, 3, DEVICE)
    cache = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    _check(lambda q_, k_, v_: dilated_serve(q_, k_, v_, ws, rs, causal=causal, return_lse=True, backend="triton",
                                            cache_seqlens=cache),
           lambda q_, k_, v_, n: dilated_attention_naive(q_, k_, v_, ws, rs, causal=causal), q, k, v, lengths,
           torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
def test_compiled_bf16_head_dims(D):
    """Compiled kernels at realistic head dims (shared-memory limits, dot shapes)."""
    check_dilated("triton", make_qkv(1, 1024, 4, 2, D, torch.bfloat16, seed=0), [256, 512, 1024], [1, 2, 4],
                  causal=True, check_definition=False)


# ----------------------------------------------------------------------------- portable: attention with lse

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("last_dim_strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_with_lse_both_paths(dtype, last_dim_strided, causal):
    """ops.common.lse.attention_with_lse (the portable path's per-pattern attention): the
    fused CPU kernel (ordinary scores) and the explicit path (scores above FUSED_MAX_SCORE)
    against float64, out, lse and the gradients of a loss that uses both. Same-dtype
    reference: the explicit path in float32 on the rounded inputs; bfloat16 floor 1e-2."""
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

    floor = FLOOR[torch.float32] if dtype == torch.float32 else 1e-2
    for scale, fused in ((D ** -0.5, True), (40.0, False)):   # bound ~ 40 * 6 * 6 > FUSED_MAX_SCORE
        assert lse_mod._use_cpu_flash(q.to(dtype), k.to(dtype), scale) == fused
        masked = lambda a, b, c, s: lse_mod.masked_attention_with_lse(a, b, c, keep, AttentionCall(False, s))  # noqa: E731
        ref = grads(masked, torch.float64, scale)
        got = grads(lambda a, b, c, s: lse_mod.attention_with_lse(a, b, c, AttentionCall(causal, s)), dtype, scale)
        same = grads(masked, torch.float32, scale)
        for i, (name, x, sd, o) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), got, same, ref)):
            assert_rule(f"{name} (fused={fused})", x, o, sd, factor=2 if i < 2 else 3, floor=floor)


@pytest.mark.parametrize("scale", [-0.5, 0.0])
def test_triton_16bit_negative_and_zero_scale(scale):
    """16-bit inputs take the FMA softmax form (ops/common/kernels.py): a negative scale takes
    the row min of q.k for the running max, scale 0 a floored scale2; causal, so both the
    masked and the unmasked tiles, forward and backward."""
    qkv = tuple(seeded((1, 96, 2, 16), torch.float16, s, DEVICE) for s in range(3))
    check_dilated("triton", qkv, [32, 96], [1, 2], causal=True, scale=scale, check_definition=False)
