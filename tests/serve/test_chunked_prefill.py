"""Chunked prefill (DESIGN §5b with Nq past the decode paths) through the serve doors
(`*_attention_with_kvcache`, no new rows): q holds the last Nq positions of each row's L_b
valid keys. The results must be the matching rows of the training door's full-sequence call
and of the float64 oracle, forward and gradients, and the Triton path (and the block-sparse
portable path) must plan only the work those rows need: the planned query tiles / active
query blocks of a chunk are about Nq / L of the full call's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_dilated import (block_sparse_attention, block_sparse_attention_naive, dilated_attention,
                            dilated_attention_naive, layouts)
from triton_dilated.ops.block_sparse import interface as bs_interface
from triton_dilated.ops.dilated.patterns import head_offsets
from triton_dilated.ops.dilated.plan import QueryWindow, build_items, key_unit_triples, plan_tiles, query_unit_triples
from tests.conftest import DEVICE
from tests.helpers.reference import block_sparse_serve, check_against_oracle, dilated_serve, seeded

BACKENDS = ["torch", "triton"]
WS, RS = [48, 128], [1, 2]          # a short last segment of 128 at Nk = 192
DILATED_CASES = [                    # (B, Hq, Hkv, mode, offsets, lengths)
    (2, 2, 1, "longnet", "modulo", [192, 155]),
    (1, 4, 2, "longnet", "blocked", [171]),
    (2, 2, 2, "head_groups", "modulo", [140, 192]),
]


def _definition(oracle, q, k, v, lengths):
    """(out, lse) of the last Nq positions of each row's first L_b positions, by `oracle`
    (q padded with zero rows in front: those rows are dropped)."""
    Nq = q.shape[1]
    outs, lses = [], []
    for b, n in enumerate(lengths):
        qf = torch.cat([q.new_zeros((1, n - Nq, *q.shape[2:])), q[b:b + 1]], dim=1)
        out, lse = oracle(qf, k[b:b + 1, :n], v[b:b + 1, :n], n)
        outs.append(out[:, n - Nq:])
        lses.append(lse[:, :, n - Nq:])
    return torch.cat(outs), torch.cat(lses)


def _full_rows(fn, q, k, v, lengths, prefix_seed):
    """The full-sequence call per batch row on random earlier queries followed by q, with the
    loss on the last Nq rows only: (out, lse, dq, dk, dv) of those rows, for comparison
    with the chunked call under the loss sum(out * g) + sum(lse * gl)."""
    Nq = q.shape[1]
    results = []
    for b, n in enumerate(lengths):
        early = seeded((1, n - Nq, *q.shape[2:]), q.dtype, prefix_seed + b, q.device)
        leaves = [torch.cat([early, q[b:b + 1]], dim=1).requires_grad_(True),
                  k[b:b + 1, :n].clone().requires_grad_(True), v[b:b + 1, :n].clone().requires_grad_(True)]
        out, lse = fn(*leaves)
        results.append((out[:, n - Nq:], lse[:, :, n - Nq:], leaves))
    return results


def _compare_with_full(fn, q, k, v, lengths, cache):
    """The chunked call's out, lse and gradients (fn with cache_seqlens: the serve door) equal
    the full calls' rows (fn with cache_seqlens=None: the training door; dk, dv: the full
    call's gradients of the chunk's loss, padded past L_b with the zeros the chunked call must
    give there)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = fn(*leaves, cache_seqlens=cache)
    g = seeded(out.shape, out.dtype, 11, out.device)
    gl = seeded(lse.shape, torch.float32, 12, out.device)
    dq, dk, dv = torch.autograd.grad((out * g).sum() + (torch.nan_to_num(lse, neginf=0) * gl).sum(), leaves)
    tol = dict(rtol=1e-5, atol=1e-5)
    for b, (o_b, l_b, full_leaves) in enumerate(_full_rows(lambda *x: fn(*x, cache_seqlens=None), q, k, v,
                                                           lengths, 100)):
        n = lengths[b]
        torch.testing.assert_close(out[b:b + 1], o_b, **tol)
        torch.testing.assert_close(lse[b:b + 1], l_b, **tol)
        fq, fk, fv = torch.autograd.grad((o_b * g[b:b + 1]).sum() + (torch.nan_to_num(l_b, neginf=0) *
                                                                    gl[b:b + 1]).sum(), full_leaves)
        torch.testing.assert_close(dq[b:b + 1], fq[:, n - q.shape[1]:], **tol)
        torch.testing.assert_close(dk[b:b + 1, :n], fk, **tol)
        torch.testing.assert_close(dv[b:b + 1, :n], fv, **tol)
        assert torch.all(dk[b, n:] == 0) and torch.all(dv[b, n:] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", DILATED_CASES, ids=lambda c: f"B{c[0]}H{c[1]}kv{c[2]}-{c[3]}-{c[4]}")
def test_dilated_chunk_matches_full_call_and_oracle(backend, causal, case):
    B, Hq, Hkv, mode, offsets, lengths = case
    Nk, Nq, D = 192, 40, 16
    q = seeded((B, Nq, Hq, D), torch.float32, 1, DEVICE)
    k = seeded((B, Nk, Hkv, D), torch.float32, 2, DEVICE)
    v = seeded((B, Nk, Hkv, D), torch.float32, 3, DEVICE)
    kw = dict(causal=causal, mode=mode, offsets=offsets)
    cache = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)

    def fn(q_, k_, v_, cache_seqlens=cache):   # None: the full-sequence call (the training door)
        if cache_seqlens is None:
            return dilated_attention(q_, k_, v_, WS, RS, return_lse=True, backend=backend, **kw)
        return dilated_serve(q_, k_, v_, WS, RS, return_lse=True, backend=backend, cache_seqlens=cache_seqlens, **kw)

    def oracle(q_, k_, v_, n):
        return dilated_attention_naive(q_, k_, v_, WS, RS, **kw)

    check_against_oracle(fn, lambda *x: _definition(oracle, *x, lengths),
                         lambda *x: _definition(oracle, *x, lengths), (q, k, v))
    _compare_with_full(fn, q, k, v, lengths, cache)


def _bs_layout(Nk, bs, B, H):
    return layouts.random(Nk, bs, num_random=2, num_heads=H, batch=B, seed=5) | layouts.local(Nk, bs, 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_block_sparse_chunk_matches_full_call_and_oracle(backend, causal, gqa):
    B, Hq, Nk, Nq, D, bs = 2, 2, 192, 64, 16, 32
    Hkv = 1 if gqa else Hq
    lengths = [192, 150]
    lay = _bs_layout(Nk, bs, 1, Hq)
    q = seeded((B, Nq, Hq, D), torch.float32, 1, DEVICE)
    k = seeded((B, Nk, Hkv, D), torch.float32, 2, DEVICE)
    v = seeded((B, Nk, Hkv, D), torch.float32, 3, DEVICE)
    cache = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)

    def fn(q_, k_, v_, cache_seqlens=cache):   # None: the full-sequence call (the training door)
        n = k_.shape[1]
        lay_n = lay if n == Nk else lay.prefix(-(-n // bs))
        if cache_seqlens is None:
            return block_sparse_attention(q_, k_, v_, lay_n, causal=causal, return_lse=True, backend=backend)
        return block_sparse_serve(q_, k_, v_, lay_n, causal=causal, return_lse=True, backend=backend,
                                  cache_seqlens=cache_seqlens)

    def oracle(q_, k_, v_, n):
        g = q_.shape[2] // k_.shape[2]
        k_, v_ = (x.repeat_interleave(g, dim=2) for x in (k_, v_))
        return block_sparse_attention_naive(q_, k_, v_, lay.prefix(-(-n // bs)), causal=causal)

    check_against_oracle(fn, lambda *x: _definition(oracle, *x, lengths),
                         lambda *x: _definition(oracle, *x, lengths), (q, k, v))
    _compare_with_full(fn, q, k, v, lengths, cache)


# ----------------------------------------------------------------------------- the work shrinks

def _tile_rows(items, block):
    """Per item, the rows its tile holds (first + T*u below the chunk end)."""
    return [np.arange(f, min(e, f + t * block), t) for f, e, _, t, _, _ in items]


@pytest.mark.parametrize("causal", [False, True])
def test_dilated_plan_keeps_only_the_chunk(causal):
    """The query-side plan for a chunk holds exactly the full plan's tiles that hold a kept row
    (so every kept row is computed, by the same tile as in the full call), and costs about
    Nq / N of the full plan; the key side drops the key tiles no kept row reads."""
    N, Nq, Hq, Hkv, block = 1024, 128, 4, 2, 32
    ws, rs = (64, 256, 1024), (1, 2, 4)
    pats = tuple(zip(ws, rs))
    table = head_offsets(Hq, pats, "longnet", "modulo")
    units = query_unit_triples(pats, table)
    first = N - Nq
    full_items, full_cost, full = plan_tiles(N, units, block, block, causal)
    items, cost, covered = plan_tiles(N, units, block, block, causal, first_query_row=first)
    assert full and not covered
    keep = [r.max() >= first for r in _tile_rows(full_items, block)]
    assert sorted(map(tuple, items.tolist())) == sorted(map(tuple, full_items[keep].tolist()))
    for h in range(Hq):   # every kept row of every head lies in some tile
        rows = np.concatenate([r for r, it in zip(_tile_rows(items, block), items) if it[2] == h])
        assert set(range(first, N)) <= set(rows.tolist())
    ratio = cost.sum() / full_cost.sum()
    assert ratio < 2.5 * Nq / N, ratio     # 12.5% of the rows; the full plan's causal work grows to the end
    # key side: with a segment over the whole sequence (w = 1024) every key tile is read by
    # the chunk and kept; without it, the tiles of segments that end before the chunk go
    kunits = key_unit_triples(pats, table, Hkv)
    assert plan_tiles(N, kunits, block, block, causal, True, first_query_row=first)[0].shape[0] == \
        plan_tiles(N, kunits, block, block, causal, True)[0].shape[0]
    pats = pats[:2]
    kunits = key_unit_triples(pats, head_offsets(Hq, pats, "longnet", "modulo"), Hkv)
    kfull, _, _ = plan_tiles(N, kunits, block, block, causal, True)
    kitems, _, _ = plan_tiles(N, kunits, block, block, causal, True, first_query_row=first)
    last_segment = kfull[kfull[:, 0] >= N - 256]
    assert sorted(map(tuple, kitems.tolist())) == sorted(map(tuple, last_segment.tolist()))
    assert kitems.shape[0] == kfull.shape[0] // 4


def test_dilated_chunked_call_launches_the_chunk_plan(monkeypatch):
    """The Triton path of a chunked call plans with the chunk's window: forward and dQ launch
    about Nq / L of the full call's tiles (today's full-length call launched them all)."""
    kernels = pytest.importorskip("triton_dilated.ops.dilated.kernels")
    seen = []

    def spy(n, units, block, inner, causal, keys_side=False, doc_bounds=None):
        items, full = build_items(n, units, block, inner, causal, keys_side, doc_bounds)
        seen.append((keys_side, n, items.shape[0]))
        return items, full

    monkeypatch.setattr(kernels, "build_items", spy)
    kernels._device_plan.cache_clear()
    Nk, Nq, H, D = 256, 32, 1, 16
    q = seeded((1, Nq, H, D), torch.float32, 1, DEVICE).requires_grad_(True)
    k = seeded((1, Nk, H, D), torch.float32, 2, DEVICE).requires_grad_(True)
    v = seeded((1, Nk, H, D), torch.float32, 3, DEVICE).requires_grad_(True)
    dilated_serve(q, k, v, [64], [1], backend="triton").sum().backward()
    chunk = dict((s, c) for s, _, c in seen)
    seen.clear()
    kernels._device_plan.cache_clear()
    qf = seeded((1, Nk, H, D), torch.float32, 1, DEVICE)
    dilated_attention(qf, k, v, [64], [1], backend="triton").sum().backward()
    whole = dict((s, c) for s, _, c in seen)
    kernels._device_plan.cache_clear()
    assert whole[False] == Nk // 32 and chunk[False] == Nq // 32      # query tiles of BLOCK_M = 32
    assert whole[True] == Nk // 32 and chunk[True] == 64 // 32        # key tiles of the last segment only


def _spy_layouts(monkeypatch, backend):
    """Record the layouts the chunked block-sparse call hands to the kernels or the portable
    path."""
    seen = []
    if backend == "triton":
        kernels = bs_interface._kernels()
        fwd = kernels.block_sparse_forward

        def spy(q, k, v, layout, *args, **kw):
            seen.append(layout)
            return fwd(q, k, v, layout, *args, **kw)
        monkeypatch.setattr(kernels, "block_sparse_forward", spy)
    else:
        portable = bs_interface.block_sparse_attention_torch

        def spy(q, k, v, layout, *args, **kw):
            seen.append(layout)
            return portable(q, k, v, layout, *args, **kw)
        monkeypatch.setattr(bs_interface, "block_sparse_attention_torch", spy)
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_sparse_chunked_call_runs_only_the_chunk_blocks(monkeypatch, backend):
    """Query blocks wholly before the chunk get no key block (their programs exit at once, the
    portable path skips them) and the dK/dV lists drop them: the active pairs of the layout
    the kernels see are those of the chunk's query blocks."""
    B, H, Nk, Nq, D, bs = 1, 2, 256, 40, 16, 32
    lay = layouts.causal(Nk, bs) | _bs_layout(Nk, bs, 1, H)
    seen = _spy_layouts(monkeypatch, backend)
    q = seeded((B, Nq, H, D), torch.float32, 1, DEVICE).requires_grad_(True)
    k = seeded((B, Nk, H, D), torch.float32, 2, DEVICE).requires_grad_(True)
    v = seeded((B, Nk, H, D), torch.float32, 3, DEVICE).requires_grad_(True)
    block_sparse_serve(q, k, v, lay, causal=True, backend=backend).sum().backward()
    (used,) = seen
    first = (Nk - Nq) // bs                      # the block holding the first kept row
    counts = used.kv_num_blocks.expand(B, H, -1)
    assert (counts[..., :first] == 0).all()
    assert torch.equal(counts[..., first:], lay.kv_num_blocks.to(counts.device).expand(B, H, -1)[..., first:])
    _, _, qr, _ = used.pairs()
    assert (qr >= first).all()
    # the transposed (dK/dV) lists hold only the chunk's query blocks
    width = used.q_indices.shape[-1]
    valid = torch.arange(width, device=used.q_indices.device) < used.q_num_blocks.unsqueeze(-1)
    assert (used.q_indices[valid] >= first).all()
    assert int(used.q_num_blocks.sum()) == int(counts.sum()) < 0.5 * int(lay.kv_num_blocks.expand(B, H, -1).sum())


def test_window_is_part_of_the_plan_cache_key():
    units = query_unit_triples(((64, 1),), ((0,),))
    whole, full = build_items(256, units, 32, 32, False)
    part, covered = build_items(256, units, 32, 32, False, False, QueryWindow(None, 192))
    assert full and not covered and part.shape[0] == 2 < whole.shape[0] == 8
    again, _ = build_items(256, units, 32, 32, False)
    assert again.shape[0] == 8
