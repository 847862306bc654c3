"""The fused Triton dilated kernels (interpreter on CPU, compiled on CUDA) against the
float64 oracle: forward, lse and gradients (also through lse), by the tolerance rule."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from triton_dilated import dilated_attention, dilated_attention_naive
from triton_dilated.ops.dilated.patterns import head_offsets
from triton_dilated.ops.dilated.plan import build_items, query_unit_triples, key_unit_triples
from conftest import DEVICE
from reference import FLOOR, assert_rule, dense_reference, finite, multiplicity, seeded

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def run_case(*, B, N, Hq, Hkv, D, ws, rs, mode="longnet", offsets="modulo", causal=False,
             dtype=torch.float32, strided=True, magnitude=1.0, seed=0, backend="triton", grad_floor=None):
    dev = torch.device(DEVICE)
    packed = seeded((B, N, Hq + 2 * Hkv, D), dtype, seed, dev)
    packed[:, :, :Hq] *= magnitude
    packed.requires_grad_(True)
    if strided:   # q, k, v as slices of one packed tensor: non-contiguous, read in place
        q, k, v = packed[:, :, :Hq], packed[:, :, Hq:Hq + Hkv], packed[:, :, Hq + Hkv:]
    else:
        q, k, v = (x.contiguous() for x in (packed[:, :, :Hq], packed[:, :, Hq:Hq + Hkv], packed[:, :, Hq + Hkv:]))
    kw = dict(causal=causal, mode=mode, offsets=offsets)
    out, lse = dilated_attention(q, k, v, ws, rs, return_lse=True, backend=backend, **kw)
    assert out.dtype == dtype and out.shape == (B, N, Hq, D) and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (B, Hq, N)
    o_ref, l_ref = dilated_attention_naive(q, k, v, ws, rs, **kw)
    counts = multiplicity(N, ws, rs, Hq, causal=causal, mode=mode, offsets=offsets)
    o_same, l_same = dense_reference(q, k, v, counts)

    g = seeded(out.shape, dtype, seed + 1, dev)
    gl = seeded(lse.shape, torch.float32, seed + 2, dev)
    floor = FLOOR[dtype]
    assert_rule("out", out, o_ref, o_same, factor=2, floor=floor)
    assert_rule("lse", lse, l_ref, l_same, factor=2, floor=floor)
    empty = torch.isinf(l_ref).transpose(1, 2)  # (B, N, Hq)
    assert (out[empty] == 0).all(), "rows without keys must output exactly 0"

    def grads(o, l):
        loss = (o.double() * g.double()).sum() + (finite(l).double() * gl.double()).sum()
        return torch.autograd.grad(loss, (q, k, v), retain_graph=True)

    for name, a, ref, same in zip("qkv", grads(out, lse), grads(o_ref, l_ref), grads(o_same, l_same)):
        assert_rule(f"d{name}", a, ref, same, factor=3, floor=grad_floor or floor)
        assert a.dtype == dtype
    return out, lse


patterns_st = st.lists(st.tuples(st.integers(1, 100), st.integers(1, 6)), min_size=1, max_size=3)


@given(
    B=st.integers(1, 2), N=st.integers(1, 96), pats=patterns_st, Hkv=st.integers(1, 2),
    group=st.integers(1, 2), D=st.sampled_from([8, 12, 16, 24, 40]),
    mode=st.sampled_from(["longnet", "head_groups"]), offsets=st.sampled_from(["modulo", "blocked"]),
    causal=st.booleans(), dtype=st.sampled_from(DTYPES), strided=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_oracle(B, N, pats, Hkv, group, D, mode, offsets, causal, dtype, strided, seed):
    if B * Hkv * group > 4:
        B = 1
    ws, rs = [max(w, r) for w, r in pats], [r for _, r in pats]   # a rate above its segment length is refused
    run_case(B=B, N=N, Hq=Hkv * group, Hkv=Hkv, D=D, ws=ws, rs=rs, mode=mode, offsets=offsets,
             causal=causal, dtype=dtype, strided=strided, seed=seed)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_longnet_schedule_scaled_down(causal, dtype):
    """The paper's schedule shape (rates 1, 2, 4, 6, 12; segments doubling), scaled to N=192,
    with head dims that are not powers of two and GQA."""
    run_case(B=1, N=192, Hq=4, Hkv=2, D=24, ws=[12, 24, 48, 96, 192], rs=[1, 2, 4, 6, 12],
             causal=causal, dtype=dtype)


def test_tile_stride_lcm_path_is_exercised():
    """A shape where the planner tiles with T = lcm(rates) > 1 (whole tiles active or idle per
    pattern, unmasked key blocks) is covered against the oracle."""
    ws, rs, N, H = [64, 128], [2, 4], 256, 2
    table = head_offsets(H, tuple(zip(ws, rs)), "longnet", "modulo")
    items, _ = build_items(N, query_unit_triples(tuple(zip(ws, rs)), table), 32, 32, False)
    strides = set(items[:, 3].tolist())
    assert max(strides) > 1 and any(T % r == 0 for T in strides for r in rs) and any(T % r for T in strides for r in rs)
    run_case(B=1, N=N, Hq=H, Hkv=1, D=16, ws=ws, rs=rs)


@pytest.mark.parametrize("causal", [False, True])
def test_single_full_pattern_is_dense_sdpa(causal):
    dev = torch.device(DEVICE)
    q, k, v = (seeded((2, 80, 2, 32), torch.float32, s, dev) for s in range(3))
    out = dilated_attention(q, k, v, [80], [1], causal=causal, backend="triton")
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    out_big_w = dilated_attention(q, k, v, [1000], [1], causal=causal, backend="triton")
    torch.testing.assert_close(out_big_w, out, atol=0, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_large_scores_float32_no_nan(causal):
    """Scores of magnitude 1e3-1e4 in float32. A float32 score that large carries an absolute
    rounding error of eps32 * |s| ~ 1e-4..1e-3 whatever the summation order, and softmax turns
    it into that relative error of P: any float32 implementation's gradients are only good to
    eps32 * max|s| (relative), so that, not 1e-5, is the gradient floor here. Forward and lse
    keep the usual rule."""
    max_score = 100.0 * 16 * 16 ** -0.5 * 4.0   # |q| ~ 100*4, |k| ~ 4 (D = 16): ~1.6e3
    out, lse = run_case(B=1, N=64, Hq=2, Hkv=1, D=16, ws=[16, 64], rs=[1, 2], causal=causal, magnitude=100.0,
                        grad_floor=2 * torch.finfo(torch.float32).eps * max_score)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_rows_without_keys_give_zero_and_neg_inf():
    """head_groups with r = 3: two thirds of each group's rows have no key."""
    out, lse = run_case(B=1, N=48, Hq=2, Hkv=2, D=8, ws=[12, 48], rs=[3, 3], mode="head_groups")
    assert torch.isinf(lse).any()


def test_float16_long_sequence_no_overflow():
    """float16 with N where the unnormalised sums would overflow float16."""
    run_case(B=1, N=384, Hq=1, Hkv=1, D=16, ws=[384], rs=[1], dtype=torch.float16, causal=True)


def test_deterministic_backward():
    dev = torch.device(DEVICE)
    q, k, v = (seeded((1, 96, 4, 16), torch.float32, s, dev).requires_grad_() for s in range(3))
    def grads():
        out = dilated_attention(q, k, v, [32, 96], [1, 3], causal=True, backend="triton")
        return torch.autograd.grad(out.square().sum(), (q, k, v))
    for a, b in zip(grads(), grads()):
        assert torch.equal(a, b)


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


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
def test_compiled_bf16_head_dims(D):
    """Compiled kernels at realistic head dims (shared-memory limits, dot shapes)."""
    run_case(B=1, N=1024, Hq=4, Hkv=2, D=D, ws=[256, 512, 1024], rs=[1, 2, 4], causal=True, dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_variable_length_sequences(backend, causal):
    """cu_seqlens: segments restart at each document; equals per-document oracle calls."""
    dev = torch.device(DEVICE)
    bounds = [0, 17, 17, 60, 96]                # an empty document too
    q, k, v = (seeded((1, 96, h, 16), torch.float32, s, dev).requires_grad_() for s, h in ((0, 4), (1, 2), (2, 2)))
    ws, rs = [8, 32], [1, 2]
    out, lse = dilated_attention(q, k, v, ws, rs, causal=causal, return_lse=True, backend=backend,
                                 cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
    g = seeded(out.shape, torch.float32, 5, dev)
    grads = torch.autograd.grad((out * g).sum() + (finite(lse) * 0.5).sum(), (q, k, v))
    refs, ref_lses = [], []
    for s, e in zip(bounds[:-1], bounds[1:]):
        o, l = dilated_attention_naive(q[:, s:e], k[:, s:e], v[:, s:e], ws, rs, causal=causal)
        refs.append(o)
        ref_lses.append(l)
    ref, ref_lse = torch.cat(refs, 1), torch.cat(ref_lses, 2)
    ref_grads = torch.autograd.grad((ref * g.double()).sum() + (finite(ref_lse) * 0.5).sum(), (q, k, v))
    assert (out - ref).abs().max() <= 2e-5 and torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert (finite(lse) - finite(ref_lse)).abs().max() <= 2e-5
    for a, b in zip(grads, ref_grads):
        assert (a - b).abs().max() <= 3e-5


def test_cu_seqlens_validation():
    q = torch.randn(1, 10, 1, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        dilated_attention(q, q, q, [4], [1], cu_seqlens=[0, 5, 9])
    with pytest.raises(ValueError, match="batch size must be 1"):
        dilated_attention(torch.randn(2, 10, 1, 8), torch.randn(2, 10, 1, 8), torch.randn(2, 10, 1, 8), [4], [1],
                          cu_seqlens=[0, 10])
    with pytest.raises(TypeError, match="cu_seqlens"):
        dilated_attention(q, q, q, [4], [1], cu_seqlens=torch.tensor([0.0, 10.0]))
