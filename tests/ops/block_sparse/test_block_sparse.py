"""Block-sparse attention: layouts, builders, and the kernels (interpreter on CPU) and the
portable backend against the float64 oracle."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

from triton_dilated import (BlockLayout, block_sparse_attention, block_sparse_attention_naive, dilated_attention,
                            layouts)
from triton_dilated.ops.block_sparse.naive import element_mask
from tests.conftest import DEVICE
from tests.helpers.reference import check_against_oracle, dense_reference, sdpa_reference, seeded

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def run_case(*, B, N, Hq, Hkv, D, layout, causal, dtype=torch.float32, seed=0, backend="triton"):
    """block_sparse_attention(backend) against the float64 oracle by check_against_oracle;
    the same-dtype reference is dense attention over the layout's element mask."""
    qkv = tuple(seeded(s, dtype, seed + i, DEVICE) for i, s in enumerate([(B, N, Hq, D), (B, N, Hkv, D), (B, N, Hkv, D)]))
    counts = element_mask(layout, N, causal).double()
    return check_against_oracle(
        lambda q, k, v: block_sparse_attention(q, k, v, layout, causal=causal, return_lse=True, backend=backend),
        lambda q, k, v: block_sparse_attention_naive(q, k, v, layout, causal=causal),
        lambda q, k, v: dense_reference(q, k, v, counts), qkv, counts=counts, seed=seed + 7)


@st.composite
def layouts_st(draw):
    bs = draw(st.sampled_from([16, 32, 64]))
    N = draw(st.integers(1, 160))
    nb = math.ceil(N / bs)
    Lb, Lh = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    mask = torch.rand(Lb, Lh, nb, nb, generator=g) < density
    return N, BlockLayout.from_dense(mask, bs)


@given(case=layouts_st(), Hkv=st.integers(1, 2), causal=st.booleans(), dtype=st.sampled_from(DTYPES),
       D=st.sampled_from([8, 12, 16, 32]), backend=st.sampled_from(["triton", "torch"]), seed=st.integers(0, 999))
def test_matches_oracle(case, Hkv, causal, dtype, D, backend, seed):
    """Random per-(batch, head) layouts (or broadcast ones), ragged N, GQA, empty rows."""
    N, layout = case
    Lb, Lh = layout.kv_num_blocks.shape[:2]
    Hq = 2                       # a per-head layout has Lh == 2 == Hq; GQA when Hkv == 1
    run_case(B=Lb, N=N, Hq=Hq, Hkv=Hkv, D=D, layout=layout, causal=causal, dtype=dtype, seed=seed, backend=backend)


@given(case=layouts_st(), Hkv=st.integers(1, 2), causal=st.booleans(), D=st.sampled_from([8, 12, 16, 32]),
       seed=st.integers(0, 999))
def test_portable_bfloat16_matches_oracle(case, Hkv, causal, D, seed):
    """The portable backend in bfloat16 on CPU (the fused CPU kernel; the interpreter's
    bfloat16 dot is what keeps bf16 out of test_matches_oracle there)."""
    N, layout = case
    run_case(B=layout.kv_num_blocks.shape[0], N=N, Hq=2, Hkv=Hkv, D=D, layout=layout, causal=causal,
             dtype=torch.bfloat16, seed=seed, backend="torch")


def test_kernel_tiles_smaller_than_block():
    """Layout block 64 with kernel tiles of 32 (several sub-tiles per block), ragged N."""
    layout = layouts.bigbird(150, 64, window=0, num_global_blocks=1, num_random=1, seed=3, num_heads=2)
    for causal in (False, True):
        run_case(B=1, N=150, Hq=2, Hkv=1, D=16, layout=layout, causal=causal)


@pytest.mark.parametrize("dq_tile, dkdv_tile", [((16, 32), (32, 16)), ((32, 16), (16, 32)), ((32, 32), (64, 16))],
                         ids=["dq16x32-dkdv32x16", "dq32x16-dkdv16x32", "dq32x32-dkdv64x16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_with_its_own_dkdv_tiles(monkeypatch, dq_tile, dkdv_tile, causal):
    """The dK/dV kernel with a config of its own, key tile (BLOCK_M, the M dimension of
    S^T = K Q^T) larger or smaller than its query sub-tile (BLOCK_N), and dQ with another
    (the interpreter's default is 32 x 32 for both): per-head lists under GQA (one dK/dV
    program walks both query heads' lists), a query block with no keys, a key block only
    above the diagonal, ragged N (150 = 2 x 64 + 22), the diagonal's partial sub-tiles."""
    from triton_dilated.ops.block_sparse import kernels
    cfg = lambda m, n: dict(BLOCK_M=m, BLOCK_N=n, num_warps=4, num_stages=1)  # noqa: E731
    picked = {None: cfg(*dq_tile), "block_sparse_bwd_dkdv": cfg(*dkdv_tile)}
    monkeypatch.setattr(kernels, "select_config", lambda family, *a, kernel=None: (
        picked[kernel] if family == "block_sparse_bwd" else cfg(32, 32)))
    mask = torch.tensor([[[1, 0, 1], [1, 1, 0], [0, 0, 0]], [[1, 1, 1], [0, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    layout = BlockLayout.from_dense(mask[None], 64)
    run_case(B=1, N=150, Hq=2, Hkv=1, D=16, layout=layout, causal=causal, seed=5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_all_ones_is_dense_attention(backend, causal):
    """Against torch's scaled_dot_product_attention in float64 (shares no code with the package)."""
    qkv = tuple(seeded((2, 90, 2, 16), torch.float32, s, DEVICE) for s in range(3))
    layout = BlockLayout.from_dense(torch.ones(3, 3, dtype=torch.bool), 32)
    ref = sdpa_reference(causal=causal)
    check_against_oracle(
        lambda q, k, v: block_sparse_attention(q, k, v, layout, causal=causal, return_lse=True, backend=backend),
        ref, ref, qkv, counts=element_mask(layout, 90, causal))


@given(nq=st.integers(1, 9), lb=st.sampled_from([1, 2]), lh=st.sampled_from([1, 3]), seed=st.integers(0, 999),
       density=st.sampled_from([0.0, 0.2, 0.6, 1.0]))
def test_dense_round_trip_and_transpose(nq, lb, lh, seed, density):
    mask = torch.rand(lb, lh, nq, nq, generator=torch.Generator().manual_seed(seed)) < density
    layout = BlockLayout.from_dense(mask, 16)
    assert torch.equal(layout.to_dense(), mask)
    assert torch.equal(BlockLayout(layout.q_num_blocks, layout.q_indices, 16).to_dense(), mask.transpose(-1, -2))
    assert layout.sparsity == pytest.approx(1 - mask.float().mean().item())
    other = BlockLayout.from_dense(torch.rand(1, lh, nq, nq, generator=torch.Generator().manual_seed(seed + 1)) < 0.5, 16)
    assert torch.equal((layout | other).to_dense(), mask | other.to_dense())
    assert torch.equal((layout & other).to_dense(), mask & other.to_dense())
    counts, idx = layout.kv_num_blocks, layout.kv_indices
    assert idx.dtype == torch.int32 and counts.dtype == torch.int32
    for row_c, row_i in zip(counts.reshape(-1).tolist(), idx.reshape(-1, idx.shape[-1]).tolist()):
        assert row_i[:row_c] == sorted(set(row_i[:row_c])) and all(x == 0 for x in row_i[row_c:])


def _direct(nb, rule):
    return torch.tensor([[bool(rule(i, j)) for j in range(nb)] for i in range(nb)])


@pytest.mark.parametrize("causal", [False, True])
def test_builders_match_direct_masks(causal):
    N, bs = 300, 16
    nb = math.ceil(N / bs)
    tri = (lambda i, j: j <= i) if causal else (lambda i, j: True)
    got = layouts.local(N, bs, window=2, causal=causal).to_dense()[0, 0]
    assert torch.equal(got, _direct(nb, lambda i, j: abs(i - j) <= 2 and tri(i, j)))
    got = layouts.global_tokens(N, bs, num_global_blocks=2, causal=causal).to_dense()[0, 0]
    assert torch.equal(got, _direct(nb, lambda i, j: (i < 2 or j < 2) and tri(i, j)))
    assert torch.equal(layouts.causal(N, bs).to_dense()[0, 0], _direct(nb, lambda i, j: j <= i))
    got = layouts.hierarchical(N, bs, window=1, levels=((4, 1), (8, 0)), causal=causal).to_dense()[0, 0]
    want = _direct(nb, lambda i, j: (abs(i - j) <= 1 or (j % 4 == 0 and abs(j - i // 4 * 4) <= 4)
                                     or j == i // 8 * 8) and tri(i, j))
    assert torch.equal(got, want)
    rnd = layouts.random(N, bs, num_random=3, seed=5, num_heads=2, batch=2, causal=causal)
    assert rnd.shape == (2, 2, nb, nb) and int(rnd.kv_num_blocks.max()) <= 3 and int(rnd.kv_num_blocks.min()) >= 1
    assert torch.equal(rnd.to_dense(), layouts.random(N, bs, 3, seed=5, num_heads=2, batch=2, causal=causal).to_dense())
    assert not torch.equal(rnd.to_dense(), layouts.random(N, bs, 3, seed=6, num_heads=2, batch=2, causal=causal).to_dense())
    if causal:
        assert not rnd.to_dense().triu(1).any()
    bb = layouts.bigbird(N, bs, window=1, num_global_blocks=1, num_random=2, seed=5, num_heads=2, causal=causal)
    want = (layouts.local(N, bs, 1, causal).to_dense() | layouts.global_tokens(N, bs, 1, causal).to_dense()
            | layouts.random(N, bs, 2, seed=5, num_heads=2, causal=causal).to_dense())
    assert torch.equal(bb.to_dense(), want)


def test_dilated_builder_matches_direct_mask():
    N, bs, H = 512, 16, 3
    lay = layouts.dilated(N, [64, 256], [1, 32], bs, num_heads=H)
    nb = N // bs
    for h in range(H):
        def rule(i, j, h=h):
            ok = (i // 4 == j // 4)                                     # w=64: 4 blocks, r=1
            seg_i, seg_j = i // 16, j // 16                             # w=256: 16 blocks, r=32 -> 2 blocks
            ok |= seg_i == seg_j and (i % 16) % 2 == h % 2 and (j % 16) % 2 == h % 2
            return ok
        assert torch.equal(lay.to_dense()[0, h], _direct(nb, rule)), h


@pytest.mark.parametrize("causal", [False, True])
def test_dilated_builder_equals_dilated_attention_where_they_coincide(causal):
    """Rate-1 patterns with segments a multiple of the block size: block-sparse over the
    `dilated` builder is dilated_attention."""
    q, k, v = (seeded((1, 128, 2, 16), torch.float32, s, DEVICE) for s in range(3))
    lay = layouts.dilated(128, [64], [1], 32, num_heads=2)
    a = block_sparse_attention(q, k, v, lay, causal=causal, backend="triton")
    b = dilated_attention(q, k, v, [64], [1], causal=causal, backend="triton")
    torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_topk_builder():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 200, 4, 8, generator=g), torch.randn(2, 200, 2, 8, generator=g)
    for causal in (False, True):
        lay = layouts.topk(q, k, top_k=2, block_size=32, causal=causal)
        dense = lay.to_dense()
        nb = 7
        assert dense.shape == (2, 4, nb, nb)
        assert dense.diagonal(dim1=-2, dim2=-1).all()                # the diagonal is always kept
        assert int(lay.kv_num_blocks.max()) <= 3
        if causal:
            assert not dense.triu(1).any()
        # the kept off-diagonal blocks are the best-scoring ones by the pooled dot product
        pad = nb * 32 - 200
        pool = lambda x: torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).unflatten(1, (nb, 32)).sum(2) / \
            torch.tensor([32.0] * (nb - 1) + [32.0 - pad]).view(1, nb, 1, 1)
        s = torch.einsum("bqhd,bkhd->bhqk", pool(q), pool(k).repeat_interleave(2, dim=2))
        if causal:
            s = s.masked_fill(torch.ones(nb, nb, dtype=torch.bool).triu(1), float("-inf"))
        top = s.topk(2, dim=-1).indices
        picked = torch.zeros_like(dense).scatter_(-1, top, True) & (s > float("-inf"))
        assert torch.equal(dense, picked | torch.eye(nb, dtype=torch.bool))


def test_layout_validation():
    with pytest.raises(ValueError, match="block_size"):
        BlockLayout.from_dense(torch.ones(2, 2, dtype=torch.bool), 24)
    with pytest.raises(ValueError, match="block_size"):
        BlockLayout.from_dense(torch.ones(2, 2, dtype=torch.bool), 8)
    with pytest.raises(TypeError, match="block_mask"):
        BlockLayout.from_dense(torch.ones(2, 2), 16)
    with pytest.raises(ValueError, match="block_mask"):
        BlockLayout.from_dense(torch.ones(2, 2, 2, dtype=torch.bool), 16)
    with pytest.raises(ValueError, match="kv_indices"):
        BlockLayout(torch.ones(1, 1, 2, dtype=torch.int32), torch.full((1, 1, 2, 1), 5, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="ascending"):
        BlockLayout(torch.full((1, 1, 2), 2, dtype=torch.int32), torch.tensor([[[[1, 0], [0, 1]]]], dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="kv_num_blocks"):
        BlockLayout(torch.full((1, 1, 2), 3, dtype=torch.int32), torch.zeros(1, 1, 2, 2, dtype=torch.int32), 16)
    with pytest.raises(TypeError, match="kv_indices"):
        BlockLayout(torch.ones(1, 1, 2, dtype=torch.int32), torch.zeros(1, 1, 2, 1), 16)
    q = torch.randn(1, 64, 2, 8)
    lay = layouts.local(64, 16)
    with pytest.raises(ValueError, match="needs 5 x 5"):
        block_sparse_attention(torch.randn(1, 80, 2, 8), torch.randn(1, 80, 2, 8), torch.randn(1, 80, 2, 8), lay)
    with pytest.raises(ValueError, match=r"\(B, H\)"):
        block_sparse_attention(q, q, q, layouts.random(64, 16, 1, num_heads=3))
    with pytest.raises(TypeError, match="layout must be a BlockLayout"):
        block_sparse_attention(q, q, q, torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="share block size"):
        lay | layouts.local(64, 32)
    with pytest.raises(ValueError, match="seq_len"):
        layouts.local(0, 16)


def test_flex_block_mask_round_trip():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    lay = layouts.bigbird(200, 32, window=1, num_global_blocks=1, num_random=1, seed=1, num_heads=2)
    for causal in (False, True):
        bm = lay.to_flex_block_mask(200, causal=causal)
        back = BlockLayout.from_flex_block_mask(bm).to_dense()
        want = lay.to_dense() & (torch.ones(7, 7, dtype=torch.bool).tril() if causal else True)
        assert torch.equal(back, want)
    q, k, v = (seeded((1, 2, 200, 16), torch.float32, s) for s in range(3))
    for causal in (False, True):
        ref = flex.flex_attention(q, k, v, block_mask=lay.to_flex_block_mask(200, causal=causal))
        ours = block_sparse_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), lay, causal=causal,
                                      backend="torch").transpose(1, 2)
        torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
def test_compiled_bf16_block128():
    lay = layouts.bigbird(1000, 128, window=1, num_global_blocks=1, num_random=2, seed=0, num_heads=4)
    for causal in (False, True):
        run_case(B=1, N=1000, Hq=4, Hkv=2, D=128, layout=lay, causal=causal, dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_packed_variable_length_sequences(backend):
    """cu_seqlens: blocks restart at each document; the oracle is per-document calls, the
    element mask block-diagonal (an empty document too)."""
    bounds = [0, 40, 40, 103]
    qkv = tuple(seeded((1, 103, h, 16), torch.float32, s, DEVICE) for s, h in ((0, 2), (1, 1), (2, 1)))
    builder = lambda n: layouts.local(n, 16, 1, causal=True)  # noqa: E731
    counts = torch.zeros(1, 1, 103, 103, dtype=torch.float64)
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            counts[..., s:e, s:e] = element_mask(builder(e - s), e - s, True).double()

    def per_document(q, k, v):
        parts = [block_sparse_attention_naive(q[:, s:e], k[:, s:e], v[:, s:e], builder(e - s), causal=True)
                 for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
        return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 2)
    check_against_oracle(
        lambda q, k, v: block_sparse_attention(q, k, v, builder, causal=True, return_lse=True, backend=backend,
                                               cu_seqlens=bounds),
        per_document, lambda q, k, v: dense_reference(q, k, v, counts), qkv, counts=counts)


@pytest.mark.parametrize("scale", [-0.5, 0.0])
def test_triton_16bit_negative_and_zero_scale(scale):
    """16-bit inputs take the FMA softmax form (ops/common/kernels.py): a negative scale takes
    the row min of q.k for the running max, scale 0 a floored scale2; causal, so both the
    full-block loop and the masked one, forward and backward."""
    layout = BlockLayout.from_dense(torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool), 32)
    N = 90
    qkv = tuple(seeded((1, N, 2, 16), torch.float16, s, DEVICE) for s in range(3))
    counts = element_mask(layout, N, True).double()
    check_against_oracle(
        lambda q, k, v: block_sparse_attention(q, k, v, layout, causal=True, scale=scale, return_lse=True),
        lambda q, k, v: block_sparse_attention_naive(q, k, v, layout, causal=True, scale=scale),
        lambda q, k, v: dense_reference(q, k, v, counts, scale), qkv, counts=counts)
