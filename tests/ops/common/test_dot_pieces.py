"""DOT_MODE 2 (runtime.DOT_PIECES, issue 20): on archs whose Triton dots are FMA loops (sm70,
sm75) the kernels contract over the head dim in 64-wide pieces (common/kernels.py dot), which
keeps the backward kernels at D = 128 out of register spills. The pieces are a different
summation order, so every kernel is held against the float64 oracle with them, forward and
backward, at the head dims where they apply (128: two pieces, 256: four), through the
interpreter (float32 inputs: its bfloat16 tl.dot is wrong, DESIGN §10)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from triton_dilated import (block_sparse_attention, block_sparse_attention_naive, dilated_attention,
                            dilated_attention_naive, layouts)
from triton_dilated.ops.block_sparse import kernels as block_sparse_kernels
from triton_dilated.ops.common import runtime
from triton_dilated.ops.common.hardware import ARCH_TABLE
from triton_dilated.ops.common.kernels import dot
from triton_dilated.ops.dilated import kernels as dilated_kernels
from triton_dilated.ops.ring import step_kernels
from triton_dilated.ops.ring.mask import MASK_DILATED, MASK_LAYOUT
from tests.conftest import DEVICE
from tests.helpers.reference import check_against_oracle, dense_reference
from tests.helpers.ring_checks import check_step_kernel_against_oracle


@triton.jit
def _dot_kernel(A, B, C, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, DOT_MODE: tl.constexpr):
    m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(A + m[:, None] * K + k[None, :])
    b = tl.load(B + k[:, None] * N + n[None, :])
    tl.store(C + m[:, None] * N + n[None, :], dot(a, b, DOT_MODE, "ieee"))


@pytest.mark.parametrize("K", [32, 64, 128, 256])
def test_dot_in_pieces_is_the_product(K):
    """dot(a, b) in pieces (even and odd k, twice at K = 256) equals a @ b in float64 to
    float32 rounding, as the one-piece dot does; K <= 64 is one dot either way."""
    g = torch.Generator().manual_seed(K)
    a, b = torch.randn(16, K, generator=g), torch.randn(K, 32, generator=g)
    exact = a.double() @ b.double()
    for mode in (runtime.DOT_NATIVE, runtime.DOT_PIECES):
        c = torch.empty(16, 32, device=DEVICE)
        _dot_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), c, 16, K, 32, mode)
        assert (c.cpu().double() - exact).abs().max() <= 1e-5 * K ** 0.5 * exact.abs().max(), mode


@pytest.fixture
def dot_pieces(monkeypatch):
    """The launchers pass DOT_MODE = DOT_PIECES, as they do on sm70/sm75."""
    for module in (dilated_kernels, block_sparse_kernels, step_kernels):
        options = module.kernel_options
        monkeypatch.setattr(module, "kernel_options",
                            lambda dtype, device, options=options: (runtime.DOT_PIECES, options(dtype, device)[1]))


def test_fma_archs_take_pieces_and_no_other_does():
    assert {name for name, facts in ARCH_TABLE.items() if runtime.dot_mode(facts.mma) == runtime.DOT_PIECES} \
        == {"sm70", "sm75"}
    assert runtime.dot_mode("interpreter") == runtime.DOT_FP32
    assert all(runtime.dot_mode(ARCH_TABLE[a].mma) == runtime.DOT_NATIVE for a in ("sm80", "sm90", "sm100", "gfx942"))


def _qkv(N, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, N, H, D, generator=g).to(DEVICE) for _ in range(3))


@pytest.mark.parametrize("D", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_dilated_in_pieces_matches_oracle(dot_pieces, D, causal):
    ws, rs = [16, 40], [1, 2]
    fn = lambda q, k, v: dilated_attention(q, k, v, ws, rs, causal=causal, return_lse=True,  # noqa: E731
                                           backend="triton")
    oracle = lambda q, k, v: dilated_attention_naive(q, k, v, ws, rs, causal=causal)  # noqa: E731
    from triton_dilated.ops.dilated.naive import dilated_multiplicity
    counts = dilated_multiplicity(40, ws, rs, 2, causal=causal)
    same = lambda q, k, v: dense_reference(q, k, v, counts)  # noqa: E731
    check_against_oracle(fn, oracle, same, _qkv(40, 2, D, D + causal))


@pytest.mark.parametrize("D", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_in_pieces_matches_oracle(dot_pieces, D, causal):
    from triton_dilated.ops.block_sparse.naive import element_mask
    N = 48
    layout = layouts.local(N, 16, 1)
    fn = lambda q, k, v: block_sparse_attention(q, k, v, layout, causal=causal, return_lse=True,  # noqa: E731
                                                backend="triton")
    oracle = lambda q, k, v: block_sparse_attention_naive(q, k, v, layout, causal=causal)  # noqa: E731
    same = lambda q, k, v: dense_reference(q, k, v, element_mask(layout, N, causal))  # noqa: E731
    check_against_oracle(fn, oracle, same, _qkv(N, 2, D, D + causal))


@pytest.mark.parametrize("kind", [MASK_DILATED, MASK_LAYOUT])
@pytest.mark.parametrize("D", [128, 256])
def test_ring_step_in_pieces_matches_oracle(dot_pieces, kind, D):
    check_step_kernel_against_oracle(kind, True, D=D)
