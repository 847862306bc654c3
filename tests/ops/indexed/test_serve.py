"""indexed_attention_with_kvcache: each row equals the training door's call on that row's
valid prefix (contiguous, paged and FP8 caches, appends, per-row lengths, decode and chunked
prefill), FlashMLA's physical slots, the absorbed-MLA cache (v a view of k), no host sync,
and value checks under validate=True."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.indexed_checks import make_inputs, random_indices
from tests.helpers.reference import seeded
from tests.helpers.serve_checks import no_host_sync, page_pools
from triton_dilated import indexed_attention, indexed_attention_naive, indexed_attention_with_kvcache
from triton_dilated.ops.common.kvcache import quantise_fp8

BACKENDS = ("triton", "torch")


def serve_case(B=2, Nq=3, Hq=4, Hkv=2, D=16, Dv=24, cap=40, dtype=torch.float32, new=2, fp8=False, page_size=0,
               seed=0):
    """(q, full k, v rows as the cache will hold them, the serve call's arguments, lengths after the
    append). Row b holds cache_seqlens[b] rows before the call and `new` rows are appended."""
    q, k, v = make_inputs(B, Nq, cap, Hq, Hkv, D, Dv, dtype, seed)
    cache_seqlens = torch.tensor([cap - new - 5 * b - 3 for b in range(B)], dtype=torch.int32)
    descales = None
    if fp8:
        descales = (torch.linspace(0.5, 1.5, Hkv), torch.linspace(1.2, 0.7, Hkv))
        k = (quantise_fp8(k, descales[0]).float() * descales[0][:, None]).to(dtype)   # the rows the cache holds
        v = (quantise_fp8(v, descales[1]).float() * descales[1][:, None]).to(dtype)
    new_k = torch.stack([k[b, int(n):int(n) + new] for b, n in enumerate(cache_seqlens)])
    new_v = torch.stack([v[b, int(n):int(n) + new] for b, n in enumerate(cache_seqlens)])
    k_cache, v_cache = k.clone(), v.clone()
    for b, n in enumerate(cache_seqlens.tolist()):   # rows at and after the length hold stale junk
        k_cache[b, n:] = 7.0
        v_cache[b, n:] = -7.0
    if fp8:
        k_cache, v_cache = quantise_fp8(k_cache, descales[0]), quantise_fp8(v_cache, descales[1])
    kw = dict(cache_seqlens=cache_seqlens)
    if fp8:
        kw.update(k_descale=descales[0], v_descale=descales[1])
    if page_size:
        kp, _, table = page_pools(k_cache, k_cache, page_size, seed=seed)
        vp, _, _ = page_pools(v_cache, v_cache, page_size, seed=seed)
        k_cache, v_cache = kp, vp
        kw["block_table"] = table
    return q, k, v, k_cache, v_cache, new_k, new_v, kw, (cache_seqlens + new).tolist()


def training_rows(q, k, v, idx, lengths, *, causal, backend, **kw):
    """Each row b through the training door on its first lengths[b] keys."""
    outs, lses = [], []
    for b, n in enumerate(lengths):
        o, l = indexed_attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], idx[b:b + 1], causal=causal,
                                 return_lse=True, backend=backend, **kw)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def assert_same(got, ref, dtype):
    # bfloat16 outs on both sides (eps 2^-8): a few units in the last place apart (the interpreter
    # truncates bf16 casts; one hypothesis draw here was 0.012 off at 1e-2)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    for x, r in zip(got, ref):
        assert torch.equal(torch.isneginf(x), torch.isneginf(r))
        torch.testing.assert_close(x.nan_to_num(0.0, 0.0, 0.0), r.nan_to_num(0.0, 0.0, 0.0), atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache", ["contiguous", "paged", "fp8", "fp8-paged"])
@pytest.mark.parametrize("Nq,new", [(1, 1), (3, 0), (20, 20)])
def test_serve_rows_equal_the_training_door(backend, cache, Nq, new):
    fp8, page_size = cache.startswith("fp8"), (8 if cache.endswith("paged") else 0)
    dtype = torch.bfloat16 if fp8 else torch.float32
    q, k, v, k_cache, v_cache, new_k, new_v, kw, lengths = serve_case(Nq=Nq, new=new, fp8=fp8, page_size=page_size,
                                                                      dtype=dtype, seed=Nq)
    idx = random_indices(2, Nq, 40, 2, 12, Nq)
    sinks = torch.tensor([0.1, -0.2, 0.3, 0.0])
    got = indexed_attention_with_kvcache(q, k_cache, v_cache, idx, new_k if new else None, new_v if new else None,
                                         causal=True, return_lse=True, backend=backend, sinks=sinks, **kw)
    ref = training_rows(q, k, v, idx, lengths, causal=True, backend=backend, sinks=sinks)
    assert_same(got, ref, dtype)
    if not page_size:   # the append landed in place
        held = k_cache if not fp8 else (k_cache.float() * kw["k_descale"][:, None]).to(dtype)
        for b, n in enumerate(lengths):
            assert torch.equal(held[b, n - new:n], k[b, n - new:n])


@pytest.mark.parametrize("backend", BACKENDS)
def test_physical_slots_equal_positions(backend):
    """FlashMLA's convention (vLLM, SGLang): a slot is a pool row page * page_size + offset."""
    q, k, v, k_cache, v_cache, _, _, kw, lengths = serve_case(Nq=2, new=0, page_size=8, seed=3)
    idx = random_indices(2, 2, 40, 2, 10, 3, out_of_range=0.0)
    pos = torch.arange(2).view(1, 2, 1, 1) + torch.tensor(lengths).view(2, 1, 1, 1) - 2
    idx = torch.where((idx >= 0) & (idx <= pos), idx, -1).to(torch.int32)   # causal already, as FlashMLA takes them
    table = kw["block_table"].long()
    phys = table[torch.arange(2).view(2, 1, 1, 1), idx.clamp(min=0).long() // 8] * 8 + idx.clamp(min=0) % 8
    phys = torch.where(idx >= 0, phys, -1).to(torch.int32)
    by_pos = indexed_attention_with_kvcache(q, k_cache, v_cache, idx, causal=False, return_lse=True, backend=backend,
                                            **kw)
    by_slot = indexed_attention_with_kvcache(q, k_cache, v_cache, phys, causal=False, return_lse=True,
                                             backend=backend, physical_slots=True, **kw)
    assert_same(by_slot, by_pos, torch.float32)
    with pytest.raises(ValueError, match="physical_slots=True"):
        indexed_attention_with_kvcache(q, k_cache, v_cache, phys, physical_slots=True, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_absorbed_mla_cache_v_a_view_of_k(backend):
    """Dqk 576 = 512 latent + 64 RoPE values, Dv 512 read from the same rows (no copy), one kv
    head for every query head: against the float64 oracle."""
    B, Nq, Hq, N = 1, 2, 16, 24
    q = seeded((B, Nq, Hq, 576), torch.float32, 1)
    k_cache = seeded((B, N, 1, 576), torch.float32, 2)
    v_cache = k_cache[..., :512]
    idx = random_indices(B, Nq, N, None, 8, 1)
    lens = torch.tensor([20], dtype=torch.int32)
    out, lse = indexed_attention_with_kvcache(q, k_cache, v_cache, idx, cache_seqlens=lens, causal=True,
                                              return_lse=True, backend=backend, scale=0.05)
    ref = indexed_attention_naive(q, k_cache[:, :20], v_cache[:, :20], idx, causal=True, scale=0.05)
    assert_same((out, lse), (ref[0].float(), ref[1].float()), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache", ["contiguous", "fp8-paged"])
def test_decode_step_makes_no_host_sync(backend, cache):
    fp8, page_size = cache.startswith("fp8"), (8 if cache.endswith("paged") else 0)
    q, k, v, k_cache, v_cache, new_k, new_v, kw, _ = serve_case(Nq=1, new=1, fp8=fp8, page_size=page_size,
                                                                dtype=torch.bfloat16 if fp8 else torch.float32)
    idx = random_indices(2, 1, 40, None, 8, 0)
    with no_host_sync():
        out = indexed_attention_with_kvcache(q, k_cache, v_cache, idx, new_k, new_v, backend=backend, **kw)
    assert out.shape == (2, 1, 4, 24)


def test_gradients_through_a_contiguous_cache():
    """Gradients take the portable path: they equal the training door's."""
    q, k, v, k_cache, v_cache, _, _, kw, lengths = serve_case(Nq=3, new=0, seed=5)
    idx = random_indices(2, 3, 40, 2, 12, 5)
    leaves = [x.detach().requires_grad_() for x in (q, k)]
    out = indexed_attention_with_kvcache(leaves[0], leaves[1], v, idx, **kw)
    out.square().sum().backward()
    ref_leaves = [x.detach().requires_grad_() for x in (q, k)]
    ref, _ = training_rows(ref_leaves[0], ref_leaves[1], v, idx, lengths, causal=True, backend="torch")
    ref.square().sum().backward()
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)


def test_validate_and_bad_input():
    q, k, v, k_cache, v_cache, new_k, new_v, kw, _ = serve_case(Nq=1, new=1)
    idx = random_indices(2, 1, 40, None, 8, 0, out_of_range=0.0)
    over = dict(kw, cache_seqlens=torch.tensor([40, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="no row past the cache"):
        indexed_attention_with_kvcache(q, k_cache, v_cache, idx, new_k, new_v, validate=True, **over)
    wild = idx.clone()
    wild[1, 0, 3] = 40
    with pytest.raises(ValueError, match="indices must be -1"):
        indexed_attention_with_kvcache(q, k_cache, v_cache, wild, validate=True, **kw)
    with pytest.raises(ValueError, match="k and v must be given together"):
        indexed_attention_with_kvcache(q, k_cache, v_cache, idx, new_k, **kw)
    with pytest.raises(ValueError, match="v \\(new rows\\) must have shape"):
        indexed_attention_with_kvcache(q, k_cache, v_cache, idx, new_k, new_k, **kw)
    with pytest.raises(TypeError, match="cache_seqlens must be an int32"):
        indexed_attention_with_kvcache(q, k_cache, v_cache, idx, cache_seqlens=[3, 4])
    with pytest.raises(ValueError, match="physical_slots=True reads indices as page pool rows"):
        indexed_attention_with_kvcache(q, k_cache, v_cache, idx, physical_slots=True, causal=False, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=8)
@given(data=st.data())
def test_serve_rows_random_lengths_and_caches(backend, data):
    """Random per-row lengths (some shorter than the queries: queries before position 0 see
    nothing under causal and read their indices without it), page sizes, FP8, appends, shared
    or per-head rows, causal or not: each row equals the training door on its prefix."""
    B = data.draw(st.integers(1, 3))
    Nq = data.draw(st.sampled_from([1, 2, 5, 17]))
    new = data.draw(st.integers(0, 3))
    page_size = data.draw(st.sampled_from([0, 4, 8]))
    fp8 = data.draw(st.booleans())
    causal = data.draw(st.booleans())
    rows = data.draw(st.sampled_from([None, 2]))
    seed = data.draw(st.integers(0, 1000))
    cap = 32
    before = [data.draw(st.integers(0, cap - new)) for _ in range(B)]
    dtype = torch.bfloat16 if fp8 else torch.float32
    q, k, v = make_inputs(B, Nq, cap, 4, 2, 16, 8, dtype, seed)
    descales = (torch.tensor([0.7, 1.3]), torch.tensor([1.1, 0.9])) if fp8 else None
    if fp8:
        k = (quantise_fp8(k, descales[0]).float() * descales[0][:, None]).to(dtype)
        v = (quantise_fp8(v, descales[1]).float() * descales[1][:, None]).to(dtype)
    lens = torch.tensor(before, dtype=torch.int32)
    new_k = torch.stack([k[b, n:n + new] for b, n in enumerate(before)]) if new else None
    new_v = torch.stack([v[b, n:n + new] for b, n in enumerate(before)]) if new else None
    k_cache, v_cache = k.clone(), v.clone()
    kw = dict(cache_seqlens=lens)
    if fp8:
        k_cache, v_cache = quantise_fp8(k_cache, descales[0]), quantise_fp8(v_cache, descales[1])
        kw.update(k_descale=descales[0], v_descale=descales[1])
    if page_size:
        k_cache, _, table = page_pools(k_cache, k_cache, page_size, seed=seed)
        v_cache, _, _ = page_pools(v_cache, v_cache, page_size, seed=seed)
        kw["block_table"] = table
    idx = random_indices(B, Nq, cap, rows, 7, seed)
    got = indexed_attention_with_kvcache(q, k_cache, v_cache, idx, new_k, new_v, causal=causal, return_lse=True,
                                         backend=backend, **kw)
    ref = training_rows(q, k, v, idx, [n + new for n in before], causal=causal, backend=backend)
    assert_same(got, ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_row_or_no_slot(backend):
    for B, topk in ((0, 4), (2, 0)):
        q = torch.randn(B, 1, 4, 16)
        k_cache, v_cache = torch.randn(B, 8, 2, 16), torch.randn(B, 8, 2, 8)
        idx = torch.zeros(B, 1, topk, dtype=torch.int32)
        lens = torch.full((B,), 3, dtype=torch.int32)
        out, lse = indexed_attention_with_kvcache(q, k_cache, v_cache, idx, cache_seqlens=lens, return_lse=True,
                                                  backend=backend)
        assert out.shape == (B, 1, 4, 8) and (out == 0).all() and torch.isneginf(lse).all()
