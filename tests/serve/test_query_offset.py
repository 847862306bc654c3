"""Queries shorter than keys (DESIGN §5b), through the serve doors (dilated_attention_with_kvcache,
block_sparse_attention_with_kvcache, no new rows): q (B, Nq, H, D) against k, v (B, Nk, Hkv, D)
holds the last Nq of row b's L_b = cache_seqlens[b] positions (every key row: L_b = Nk) and
later key rows are ignored; up to 16 queries take the decode paths, more the query-offset
path. The reference is the definition: the float64 oracle on the sequence of row b's first
L_b positions, with the queries placed last, its last Nq rows. The training doors refuse a
shorter q and point to the serve doors."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from triton_dilated import (block_sparse_attention, block_sparse_attention_naive,
                            block_sparse_attention_with_kvcache, dilated_attention, dilated_attention_naive,
                            dilated_attention_with_kvcache, layouts)
from tests.conftest import DEVICE
from tests.helpers.reference import block_sparse_serve, dilated_serve, seeded
from tests.helpers.serve_checks import check_against_definition as _check

BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=8)
@given(data=st.data())
def test_dilated_shorter_queries_match_the_definition(backend, data):
    B = data.draw(st.integers(1, 2))
    Nk = data.draw(st.integers(8, 72))
    Nq = data.draw(st.integers(1, Nk))
    Hkv = data.draw(st.sampled_from([1, 2]))
    Hq = Hkv * data.draw(st.sampled_from([1, 2]))
    D = data.draw(st.sampled_from([8, 12, 16]))
    causal = data.draw(st.booleans())
    mode = data.draw(st.sampled_from(["longnet", "head_groups"]))
    offsets = data.draw(st.sampled_from(["modulo", "blocked"]))
    ws = [data.draw(st.integers(4, 24)), data.draw(st.integers(16, 80))]
    rs = [data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))]
    with_lengths = data.draw(st.booleans())
    lengths = [data.draw(st.integers(Nq, Nk)) for _ in range(B)] if with_lengths else [Nk] * B
    if mode == "head_groups":
        Hq = max(Hq, 2)
        Hkv = 1 if Hq % Hkv else Hkv
    seed = data.draw(st.integers(0, 1000))
    q = seeded((B, Nq, Hq, D), torch.float32, seed, DEVICE)
    k = seeded((B, Nk, Hkv, D), torch.float32, seed + 1, DEVICE)
    v = seeded((B, Nk, Hkv, D), torch.float32, seed + 2, DEVICE)
    kw = dict(causal=causal, mode=mode, offsets=offsets)
    cache = torch.tensor(lengths, dtype=torch.int32, device=DEVICE) if with_lengths else None

    def fn(q_, k_, v_):
        return dilated_serve(q_, k_, v_, ws, rs, return_lse=True, backend=backend, cache_seqlens=cache, **kw)

    def oracle(q_, k_, v_, n):
        return dilated_attention_naive(q_, k_, v_, ws, rs, **kw)

    _check(fn, oracle, q, k, v, lengths, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=6)
@given(data=st.data())
def test_block_sparse_shorter_queries_match_the_definition(backend, data):
    B = data.draw(st.integers(1, 2))
    bs = 16
    Nk = data.draw(st.integers(17, 80))
    Nq = data.draw(st.integers(1, Nk))
    H = data.draw(st.sampled_from([1, 2]))
    causal = data.draw(st.booleans())
    with_lengths = data.draw(st.booleans())
    lengths = [data.draw(st.integers(Nq, Nk)) for _ in range(B)] if with_lengths else [Nk] * B
    seed = data.draw(st.integers(0, 1000))
    nb = -(-Nk // bs)
    per_batch = data.draw(st.booleans())
    lay = layouts.random(Nk, bs, num_random=2, num_heads=H, batch=B if per_batch else 1, seed=seed) \
        | layouts.local(Nk, bs, 0)
    assert lay.n_q_blocks == nb
    q = seeded((B, Nq, H, 16), torch.float32, seed, DEVICE)
    k = seeded((B, Nk, H, 16), torch.float32, seed + 1, DEVICE)
    v = seeded((B, Nk, H, 16), torch.float32, seed + 2, DEVICE)
    cache = torch.tensor(lengths, dtype=torch.int32, device=DEVICE) if with_lengths else None

    def fn(q_, k_, v_):
        return block_sparse_serve(q_, k_, v_, lay, causal=causal, return_lse=True, backend=backend,
                                  cache_seqlens=cache)

    # the definition row by row (a per-batch layout's row b), then the batched call against it
    outs = []
    for b in range(B):
        def sub(x, b=b):
            return x[b:b + 1]
        lay_b = lay.prefix(nb, [b]) if lay.kv_num_blocks.shape[0] > 1 else lay

        def fn_b(q_, k_, v_, lay_b=lay_b, b=b):
            return block_sparse_serve(q_, k_, v_, lay_b, causal=causal, return_lse=True, backend=backend,
                                      cache_seqlens=None if cache is None else cache[b:b + 1])

        def oracle_b(q_, k_, v_, n, lay_b=lay_b):
            return block_sparse_attention_naive(q_, k_, v_, lay_b.prefix(-(-n // bs)), causal=causal)

        _check(fn_b, oracle_b, sub(q), sub(k), sub(v), lengths[b:b + 1], torch.float32)
        outs.append(fn_b(sub(q), sub(k), sub(v))[0])
    # the batched call equals the row-by-row calls
    out, _ = fn(q, k, v)
    torch.testing.assert_close(out, torch.cat(outs), rtol=0, atol=0)


@pytest.mark.parametrize("fn", ["dilated", "block_sparse"])
def test_training_doors_take_shorter_queries_but_no_cache_seqlens(fn):
    """The training doors keep q shorter than k (DESIGN §5b: every key row valid), equal to the
    serve door over full lengths; packed documents with a shorter q and a q longer than k are
    refused; cache_seqlens is the serve doors' only (a TypeError on the training doors)."""
    q, k = seeded((1, 8, 2, 8), torch.float32, 1, DEVICE), seeded((1, 16, 2, 8), torch.float32, 2, DEVICE)
    lay = layouts.local(16, 16, 1).to(DEVICE)

    def call(q_, k_, **kw):
        if fn == "dilated":
            return dilated_attention(q_, k_, k_, [8], [1], **kw)
        return block_sparse_attention(q_, k_, k_, lay, **kw)

    serve = dilated_serve(q, k, k, [8], [1]) if fn == "dilated" else block_sparse_serve(q, k, k, lay)
    torch.testing.assert_close(call(q, k), serve, rtol=0, atol=0)
    with pytest.raises(ValueError, match="cu_seqlens .* cannot be combined with q shorter than k"):
        call(q, k, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="q must not be longer than k and v"):
        call(torch.randn(1, 20, 2, 8, device=DEVICE), k)
    with pytest.raises(TypeError, match="cache_seqlens"):
        call(q, k, cache_seqlens=torch.tensor([16], dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("fn", ["dilated", "block_sparse"])
def test_bad_query_offsets_are_clear_errors(fn):
    """The serve doors' lengths: L_b must lie in [0, Nk] (checked with validate=True, and
    always for chunked prefill, Nq > 16, which reads the lengths anyway); a row with L_b < Nq
    is defined (without causal, as here, its queries before position 0 sit at position 0:
    DESIGN §5b, issue 33)."""
    q, k = torch.randn(1, 8, 2, 8), torch.randn(1, 24, 2, 8)
    lay = layouts.local(24, 16, 1)

    def call(q_, k_, lengths, **kw):
        if fn == "dilated":
            return dilated_attention_with_kvcache(q_, k_, k_, cache_seqlens=lengths, segment_lengths=[8],
                                                  dilation_rates=[1], causal=False, **kw)
        return block_sparse_attention_with_kvcache(q_, k_, k_, cache_seqlens=lengths, layout=lay, causal=False,
                                                   **kw)

    def lens(*n):
        return torch.tensor(n, dtype=torch.int32)

    with pytest.raises(ValueError, match="q must not be longer than k and v"):
        call(torch.randn(1, 25, 2, 8), k, lens(24))
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 25: with 0 new rows the row holds 25, which must lie "
                                         r"in \[0, 24\]"):
        call(q, k, lens(25), validate=True)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = -1: .* must lie in \[0, 24\]"):
        call(q, k, lens(-1), validate=True)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 25: .* must lie in \[0, 24\]"):
        call(torch.randn(1, 17, 2, 8), k, lens(25))   # chunked prefill: checked without validate
    with pytest.raises(TypeError, match="cache_seqlens must be an int32"):
        call(q, k, torch.tensor([9.0]))
    with pytest.raises(TypeError, match="cache_seqlens must be an int32 tensor of shape"):
        call(q, k, [9])
    with pytest.raises(ValueError, match=r"cache_seqlens must have shape \(B,\) = \(1,\)"):
        call(q, k, lens(9, 9))
    with pytest.raises(TypeError, match="cu_seqlens"):
        call(q, k, lens(16), cu_seqlens=torch.tensor([0, 16]))
    for nq in (8, 17):   # L_b = 5 < Nq, decode and chunked prefill: the first Nq - 5 queries sit at position 0
        qq = torch.randn(1, nq, 2, 8)
        out, lse = call(qq, k, lens(5), validate=True, return_lse=True, backend="torch")
        want, want_lse = call(qq[:, nq - 5:], k, lens(5), return_lse=True, backend="torch")
        torch.testing.assert_close((out[:, nq - 5:], lse[:, :, nq - 5:]), (want, want_lse), rtol=1e-5, atol=1e-5)
        for i in range(nq - 5):   # each as the first of 5 queries (at position 0)
            first, first_lse = call(torch.cat([qq[:, i:i + 1], qq[:, nq - 4:]], 1), k, lens(5), return_lse=True,
                                    backend="torch")
            torch.testing.assert_close((out[:, i], lse[:, :, i]), (first[:, 0], first_lse[:, :, 0]), rtol=1e-5,
                                       atol=1e-5)


def test_equal_lengths_unchanged():
    """Nq == Nk with every key row valid through the serve door (chunked prefill, the
    query-offset path with no padding) is exactly the training door's call."""
    q, k, v = (seeded((1, 40, 2, 8), torch.float32, s) for s in range(3))
    a = dilated_attention(q, k, v, [8, 40], [1, 2], causal=True, backend="torch")
    b = dilated_serve(q, k, v, [8, 40], [1, 2], causal=True, backend="torch")
    torch.testing.assert_close(a, b, rtol=0, atol=0)
