"""FlashAttention's `window_size=(left, right)` on dilated_attention: each pattern's keys cut to
p - left <= p' <= p (causal windows only: right = 0, or causal=True, which sets right to 0).

The definition every check ends at: the dilated multiplicity of the case (how many of a
head's patterns select each pair; its own test derives it independently) times the causal
band written out here, dense attention over it in float64 (tests/helpers/reference.py); out,
lse, dq, dk, dv by the tolerance rule, both backends, both loop structures of the Triton
kernels, small tiles, packed documents and the custom op."""
from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from tests.conftest import DEVICE
from tests.helpers.reference import check_against_oracle, dense_reference, max_err, seeded
from triton_dilated import dilated_attention, dilated_attention_naive, dilated_attention_op
from triton_dilated.ops.dilated.naive import dilated_multiplicity
from triton_dilated.ops.dilated.patterns import head_offsets
from triton_dilated.ops.dilated.plan import build_items, key_unit_triples, query_unit_triples

BACKENDS = ["triton", "torch"]
DTYPES = {"triton": [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []),
          "torch": [torch.float32, torch.float16, torch.bfloat16]}


def qkv(B, N, Hq, Hkv, D, dtype, seed):
    return tuple(seeded(s, torch.float64, seed + i).to(device=DEVICE, dtype=dtype)
                 for i, s in enumerate(((B, N, Hq, D), (B, N, Hkv, D), (B, N, Hkv, D))))


def windowed_counts(n, ws, rs, Hq, left, mode="longnet"):
    """(Hq, N, N): the causal dilated multiplicity, zero where p' < p - left."""
    p, kp = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return dilated_multiplicity(n, ws, rs, Hq, causal=True, mode=mode) * (kp >= p - left).double()


def tiles(n, ws, rs, Hq, Hkv, B):
    pats = tuple(zip(ws, rs))
    table = head_offsets(Hq, pats, "longnet", "modulo")
    q_items, _ = build_items(n, query_unit_triples(pats, table), 32, 32, True)
    k_items, _ = build_items(n, key_unit_triples(pats, table, Hkv), 32, 32, True, True)
    return B * (len(q_items) + len(k_items))


@st.composite
def cases(draw, backend):
    m = draw(st.integers(1, 3))
    rs = draw(st.lists(st.integers(1, 4), min_size=m, max_size=m))
    ws = [max(w, r) for w, r in zip(draw(st.lists(st.integers(1, 80), min_size=m, max_size=m)), rs)]
    Hkv = draw(st.integers(1, 2))
    c = dict(N=draw(st.integers(1, 90)), ws=ws, rs=rs, Hkv=Hkv, Hq=Hkv * draw(st.integers(1, 2)),
             B=draw(st.integers(1, 2)), D=draw(st.sampled_from([8, 16, 24])),
             dtype=draw(st.sampled_from(DTYPES[backend])), seed=draw(st.integers(0, 1000)),
             causal=draw(st.booleans()))
    c["left"] = draw(st.integers(0, c["N"] + 2))
    c["right"] = draw(st.sampled_from([0, -1, 7])) if c["causal"] else 0
    if backend == "triton" and DEVICE == "cpu":
        assume(tiles(c["N"], c["ws"], c["rs"], c["Hq"], c["Hkv"], c["B"]) <= 64)
    return c


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=12)
@given(data=st.data())
def test_window_size_matches_definition(backend, data):
    c = data.draw(cases(backend), label="case")
    counts = windowed_counts(c["N"], c["ws"], c["rs"], c["Hq"], c["left"]).to(DEVICE)
    size = (c["left"], c["right"])
    fn = lambda q, k, v: dilated_attention(q, k, v, c["ws"], c["rs"], causal=c["causal"], window_size=size,  # noqa: E731
                                           return_lse=True, backend=backend)
    oracle = lambda q, k, v: dense_reference(q, k, v, counts)  # noqa: E731
    check_against_oracle(fn, oracle, oracle, qkv(c["B"], c["N"], c["Hq"], c["Hkv"], c["D"], c["dtype"], c["seed"]),
                         counts=counts, seed=c["seed"])


def test_naive_oracle_is_the_definition():
    """The float64 oracle's window (its own code) against the dense definition."""
    n, ws, rs = 70, [16, 32, 70], [1, 2, 4]
    q, k, v = (x.double() for x in qkv(2, n, 3, 1, 8, torch.float64, 4))
    for left in (0, 3, 9, 40):
        got = dilated_attention_naive(q, k, v, ws, rs, causal=True, window_size=(left, 0))
        want = dense_reference(q, k, v, windowed_counts(n, ws, rs, 3, left).to(DEVICE))
        assert max_err(got[0], want[0]) < 1e-12 and max_err(got[1], want[1]) < 1e-12, left


@pytest.fixture(params=[0, 1], ids=["per-pattern-loops", "flat-loop"])
def small_tiles(request, monkeypatch):
    """16-row tiles (the window's edge crosses many of them), each loop structure."""
    from triton_dilated.ops.dilated import kernels
    monkeypatch.setattr(kernels, "select_config", lambda *a, **kw: dict(BLOCK_M=16, BLOCK_N=16, num_warps=4,
                                                                         num_stages=1, FLAT_LOOP=request.param))
    return request.param


@pytest.mark.parametrize("left", [0, 5, 21, 47])
def test_kernels_small_tiles_both_loops(small_tiles, left):
    n, ws, rs, Hq = 96, [32, 64, 96], [1, 2, 3], 2
    counts = windowed_counts(n, ws, rs, Hq, left).to(DEVICE)
    fn = lambda q, k, v: dilated_attention(q, k, v, ws, rs, window_size=(left, 0), return_lse=True,  # noqa: E731
                                           backend="triton")
    oracle = lambda q, k, v: dense_reference(q, k, v, counts)  # noqa: E731
    check_against_oracle(fn, oracle, oracle, qkv(1, n, Hq, 1, 16, torch.float32, left), counts=counts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_documents_and_custom_op(backend):
    """The window inside each packed document; the custom op equals the door."""
    cu = torch.tensor([0, 33, 80], dtype=torch.int32, device=DEVICE)
    ws, rs = [16, 32], [1, 2]
    q, k, v = qkv(1, 80, 2, 1, 16, torch.float32, 9)
    out = dilated_attention(q, k, v, ws, rs, causal=True, cu_seqlens=cu, window_size=(6, 0), backend=backend)
    for s, e in ((0, 33), (33, 80)):
        counts = windowed_counts(e - s, ws, rs, 2, 6).to(DEVICE)
        want, _ = dense_reference(q[:, s:e].double(), k[:, s:e].double(), v[:, s:e].double(), counts)
        assert max_err(out[:, s:e], want) < 1e-5
    a, la = dilated_attention(q, k, v, ws, rs, window_size=(6, 0), return_lse=True, backend=backend)
    b, lb = dilated_attention_op(q, k, v, ws, rs, window_size=(6, 0), return_lse=True, backend=backend)
    assert torch.equal(a, b) and torch.equal(la, lb)
    wide = dilated_attention(q, k, v, ws, rs, causal=True, window_size=(80, 0), backend=backend)
    plain = dilated_attention(q, k, v, ws, rs, causal=True, backend=backend)
    assert max_err(wide, plain) < 1e-6   # a window past every segment cuts nothing


@pytest.mark.parametrize("size, causal, err, match", [
    ((4, 2), False, ValueError, "only causal windows"), ((3,), True, TypeError, "window_size must be a pair"),
])
def test_refused(size, causal, err, match):
    q, k, v = qkv(1, 32, 2, 1, 16, torch.float32, 0)
    with pytest.raises(err, match=match):
        dilated_attention(q, k, v, [16], [1], causal=causal, window_size=size)
    with pytest.raises(ValueError, match="window_size with q shorter than k"):
        dilated_attention(q[:, -4:], k, v, [16], [1], causal=True, window_size=(5, 0))
