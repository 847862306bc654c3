"""FlashAttention's `window_size=(left, right)` on block_sparse_attention: query p sees keys
p - left <= p' <= p + right, intersected with the layout, causal windows only (right = 0, or
causal=True, which sets right to 0 as FlashAttention does).

The definition every check ends at is written here, independently of the package: the
layout's blocks expanded to elements, the causal cut, and the band as FlashAttention's
docstring states it; out, lse, dq, dk, dv against the float64 oracle on that dense mask by the
tolerance rule (tests/helpers/reference.py), and against the sliding-window layout where both
apply."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.conftest import DEVICE
from tests.helpers.reference import check_against_oracle, dense_reference, max_err, seeded
from triton_dilated import block_sparse_attention, layouts

BACKENDS = ["triton", "torch"]
DTYPES = {"triton": [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []),
          "torch": [torch.float32, torch.float16, torch.bfloat16]}


def qkv(N, Hq, Hkv, D, dtype, seed, B=1):
    return tuple(seeded(s, torch.float64, seed + i).to(device=DEVICE, dtype=dtype)
                 for i, s in enumerate(((B, N, Hq, D), (B, N, Hkv, D), (B, N, Hkv, D))))


def band_counts(layout, n, left):
    """(B|1, H|1, N, N) 0/1: the layout's blocks as elements, p' <= p, and p' >= p - left."""
    bs = layout.block_size
    blocks = layout.to_dense().repeat_interleave(bs, -2).repeat_interleave(bs, -1)[..., :n, :n]
    p, kp = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (blocks & (kp <= p) & (kp >= p - left)).double()


def layout_of(kind, n, bs):
    return {"causal": lambda: layouts.causal(n, bs),
            "local": lambda: layouts.local(n, bs, 1, causal=True),
            "random": lambda: layouts.random(n, bs, 1, seed=3, num_heads=2) | layouts.local(n, bs, 0)}[kind]()


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=10)
@given(data=st.data())
def test_window_size_matches_definition(backend, data):
    """Windows inside a block, across blocks and past N; the layout's own blocks cut too; GQA;
    ragged N; causal=True with any right, or causal=False with right = 0."""
    n = data.draw(st.integers(1, 90), label="N")
    bs = data.draw(st.sampled_from([16, 32]), label="block")
    left = data.draw(st.integers(0, n + 3), label="left")
    kind = data.draw(st.sampled_from(["causal", "local", "random"]), label="layout")
    causal = data.draw(st.booleans(), label="causal")
    right = data.draw(st.sampled_from([0, -1, 5]), label="right") if causal else 0
    dtype = data.draw(st.sampled_from(DTYPES[backend]), label="dtype")
    Hkv = data.draw(st.sampled_from([1, 2]), label="Hkv")
    seed = data.draw(st.integers(0, 100), label="seed")
    lay = layout_of(kind, n, bs)
    counts = band_counts(lay, n, left).to(DEVICE)
    fn = lambda q, k, v: block_sparse_attention(q, k, v, lay, causal=causal, window_size=(left, right),  # noqa: E731
                                                return_lse=True, backend=backend)
    oracle = lambda q, k, v: dense_reference(q, k, v, counts)  # noqa: E731
    check_against_oracle(fn, oracle, oracle, qkv(n, 2, Hkv, 16, dtype, seed), counts=counts, seed=seed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_equals_sliding_window_layout(backend):
    """window_size=(w - 1, 0) over a causal layout is the sliding-window layout of w keys."""
    n, bs, w = 77, 16, 21
    q, k, v = qkv(n, 2, 1, 16, torch.float32, 7, B=2)
    a, la = block_sparse_attention(q, k, v, layouts.causal(n, bs), causal=True, window_size=(w - 1, 0),
                                   return_lse=True, backend=backend)
    b, lb = block_sparse_attention(q, k, v, layouts.sliding_window(n, bs, w), causal=True, return_lse=True,
                                   backend=backend)
    assert max_err(a, b) < 1e-6 and max_err(la, lb) < 1e-6
    # FlashAttention's defaults and the unbounded forms mean "no window"
    plain = block_sparse_attention(q, k, v, layouts.causal(n, bs), causal=True, backend=backend)
    for size in (None, (-1, -1), (-1, 0)):
        got = block_sparse_attention(q, k, v, layouts.causal(n, bs), causal=size != (-1, 0), window_size=size,
                                     backend=backend)
        assert torch.equal(got, plain), size


def test_packed_documents():
    """With cu_seqlens the window applies inside each document (a builder per document)."""
    cu = torch.tensor([0, 30, 75], dtype=torch.int32, device=DEVICE)
    q, k, v = qkv(75, 2, 1, 16, torch.float32, 2)
    out = block_sparse_attention(q, k, v, lambda n: layouts.causal(n, 16), causal=True, cu_seqlens=cu,
                                 window_size=(6, 0), backend="torch")
    for s, e in ((0, 30), (30, 75)):
        lay = layouts.causal(e - s, 16)
        want, _ = dense_reference(q[:, s:e].double(), k[:, s:e].double(), v[:, s:e].double(),
                                  band_counts(lay, e - s, 6).to(DEVICE))
        assert max_err(out[:, s:e], want) < 1e-5


@pytest.mark.parametrize("size, causal, err, match", [
    ((4, 2), False, ValueError, "only causal windows"), ((3,), True, TypeError, "window_size must be a pair"),
    ((-3, 0), True, ValueError, "window_size's left must be -1"),
])
def test_refused(size, causal, err, match):
    q, k, v = qkv(32, 2, 1, 16, torch.float32, 0)
    with pytest.raises(err, match=match):
        block_sparse_attention(q, k, v, layouts.causal(32, 16), causal=causal, window_size=size)
