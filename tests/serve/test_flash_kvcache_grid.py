"""FlashAttention's `test_flash_attn_kvcache` case grid (flash-attention/tests/test_flash_attn.py,
and FA3's varlen-query cases) ported to our serve doors at DENSE settings (issue 33 item 1):
dilated with segment_lengths=[capacity], dilation_rates=[1] (one segment over the whole row,
rate 1: every key, DESIGN §3) and block-sparse with a full layout are dense attention, so
FlashAttention's reference applies unchanged.

The reference is FlashAttention's `attention_ref` semantics, written here in float64: keys
`[cache_leftpad[b], L_b)` of the cache row after the append (L_b = cache_seqlens[b] + new rows,
counted from cache row 0), causal bottom-right (query i of n sees key c when
c <= L_b - n + i), a row with no key 0 (lse -inf); rotary on q and the new rows k at FA's
positions (cache_seqlens[b] + i, + j). FA's tolerance rule:
`err <= 2 * err(the same reference in float32) + 1e-5`, on out and on the finite lse (the -inf
ones in the same places), and the appended cache rows against the reference's.

Grid: seqlen_q in {1, 3, 17, 40} (17 and 40: the query-offset path), varlen (cu_seqlens_q,
per-request counts in [0, seqlen_q], new rows packed by cu_seqlens_k_new), cache_batch_idx,
cache_leftpad, rotary (interleaved and not), paged / contiguous, new rows appended or not,
MHA / GQA / MQA, causal or not (rows holding fewer keys than queries included: without causal
every query sees the row's keys, issue 33); the combinations FlashAttention refuses are skipped
(rotary without new rows, cache_batch_idx with a paged cache). The full grid on the portable
backend, a subset under the Triton interpreter.
"""
from __future__ import annotations

import contextlib
import itertools
import os

import pytest
import torch

from triton_dilated import (BlockLayout, block_sparse_attention_with_kvcache, dilated_attention_with_kvcache,
                            indexed_attention_with_kvcache)
from tests.conftest import DEVICE
from tests.helpers.serve_checks import no_host_sync, page_pools, unpage

NK, PAGE, B, HQ, D = 64, 16, 3, 6, 16
HKV = {"mha": 6, "gqa": 2, "mqa": 1}
ROTARY_DIM = D // 2           # FlashAttention's rotary_fraction 0.5


def _door(variant):
    if variant == "dilated":
        return lambda *a, **kw: dilated_attention_with_kvcache(*a, segment_lengths=[NK], dilation_rates=[1], **kw)
    full = BlockLayout.from_dense(torch.ones(NK // 16, NK // 16, dtype=torch.bool), 16).to(DEVICE)
    return lambda *a, **kw: block_sparse_attention_with_kvcache(*a, layout=full, **kw)


def _rotate(x, cos, sin, interleaved):
    """FlashAttention's apply_rotary_emb on x (n, H, D) with cos, sin (n, ROTARY_DIM / 2), in x's dtype."""
    c, s = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    xr = x[..., :ROTARY_DIM]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([out, x[..., ROTARY_DIM:]], dim=-1)


def attention_ref(q, k, v, length, pad, causal, left=None):
    """FlashAttention's attention_ref for one request in q's dtype: q (n, Hq, D), k, v (Nk, Hkv,
    D) the cache row after the append; keys [pad, length), causal bottom-right over the
    length - pad keys; left: FlashAttention's local window (left, 0) (construct_local_mask:
    query i sees key c >= its position - left, positions from the pad), None for none.
    Returns (out (n, Hq, D), lse (Hq, n)); a row with no key 0 and -inf."""
    n, group = q.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    col = torch.arange(k.shape[0], device=q.device)
    keep = (col >= pad) & (col < length)
    keep = keep[None].expand(n, -1)
    row = torch.arange(n, device=q.device)[:, None]
    if causal or left is not None:   # a local window (left, 0) ends at the query, causal or not
        keep = keep & (col[None] <= row + length - n)
    if left is not None:
        keep = keep & (col[None] >= row + length - n - left)
    scores = torch.einsum("qhd,khd->hqk", q, torch.where(keep.any(0)[:, None, None], k, 0)) / D ** 0.5
    scores = scores.masked_fill(~keep[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                       # (Hq, n)
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0, lse)[..., None])
    out = torch.einsum("hqk,khd->qhd", p, torch.where(keep.any(0)[:, None, None], v, 0))
    return out, lse


def _flags():
    """(varlen, cache_batch_idx, leftpad, rotary, paged, new_kv, causal) minus FA's refusals."""
    for varlen, batch_idx, leftpad, rotary, paged, new_kv, causal in itertools.product(
            (False, True), (False, True), (False, True), (None, "interleaved", "neox"), (False, True),
            (False, True), (True, False)):
        if rotary and not new_kv or batch_idx and paged:
            continue
        yield varlen, batch_idx, leftpad, rotary, paged, new_kv, causal


def run_case(variant, backend, seqlen_q, mha, varlen, batch_idx, leftpad, rotary, paged, new_kv, causal, seed,
             local=False):
    """One FlashAttention kvcache case: the door's out, lse and cache against attention_ref.
    local: FlashAttention's `local` (window_size=(left, 0), left drawn in [0, NK) as FA draws
    it, right = 0; the dilated door)."""
    g = torch.Generator().manual_seed(seed)
    hkv = HKV[mha]
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)   # noqa: E731
    # per request: queries and new rows (FA: seqlen_new = seqlen_q, or per request in varlen)
    if varlen:
        nq = torch.randint(0, seqlen_q + 1, (B,), generator=g).tolist()
        nq[int(torch.randint(0, B, (1,), generator=g))] = seqlen_q             # max_seqlen_q is reached
        nk = torch.randint(0, seqlen_q + 1, (B,), generator=g).tolist() if new_kv else [0] * B
    else:
        nq, nk = [seqlen_q] * B, [seqlen_q if new_kv else 0] * B
    before = [int(torch.randint(0 if new_kv else 1, NK - n + 1, (1,), generator=g)) for n in nk]
    pads = [int(torch.randint(0, max(b, 1), (1,), generator=g)) for b in before] if leftpad else [0] * B
    rows = [2, 0, 4] if batch_idx else list(range(B))
    kc64, vc64 = rand(5 if batch_idx else B, NK, hkv, D), rand(5 if batch_idx else B, NK, hkv, D)
    left = int(torch.randint(0, NK, (1,), generator=g)) if local else None
    q64 = rand(sum(nq), HQ, D)
    k64, v64 = rand(sum(nk), hkv, D), rand(sum(nk), hkv, D)
    angles = rand(NK + 64, ROTARY_DIM // 2) * 3   # seqlen_ro past every causal query position
    cos64, sin64 = torch.cos(angles), torch.sin(angles)

    # the door (float32)
    kc, vc = kc64.float().to(DEVICE), vc64.float().to(DEVICE)
    kw = dict(causal=causal, return_softmax_lse=True, backend=backend, cache_seqlens=torch.tensor(
        before, dtype=torch.int32, device=DEVICE))
    if batch_idx:
        kw["cache_batch_idx"] = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    if leftpad:
        kw["cache_leftpad"] = torch.tensor(pads, dtype=torch.int32, device=DEVICE)
    if local:
        kw["window_size"] = (left, 0)
    if rotary:
        kw.update(rotary_cos=cos64.float().to(DEVICE), rotary_sin=sin64.float().to(DEVICE),
                  rotary_interleaved=rotary == "interleaved")
    table = None
    if paged:
        kc, vc, table = page_pools(kc, vc, PAGE, seed=seed)
        kw["block_table"] = table
    q, k_new, v_new = (x.float().to(DEVICE) for x in (q64, k64, v64))
    if varlen:
        cu = lambda c: torch.tensor([0, *itertools.accumulate(c)], dtype=torch.int32, device=DEVICE)  # noqa: E731
        kw.update(cu_seqlens_q=cu(nq), max_seqlen_q=seqlen_q)
        if new_kv:
            kw["cu_seqlens_k_new"] = cu(nk)
        out, lse = _door(variant)(q, kc, vc, *((k_new, v_new) if new_kv else ()), **kw)
        outs = [out[a:a + n] for a, n in zip(itertools.accumulate([0] + nq), nq)]
        lses = [lse[:, a:a + n] for a, n in zip(itertools.accumulate([0] + nq), nq)]
    else:
        new = (k_new.view(B, seqlen_q, hkv, D), v_new.view(B, seqlen_q, hkv, D)) if new_kv else ()
        out, lse = _door(variant)(q.view(B, seqlen_q, HQ, D), kc, vc, *new, **kw)
        outs, lses = list(out), list(lse)
    cache_k, cache_v = (unpage(x, table) for x in (kc, vc)) if paged else (kc[rows], vc[rows])

    # the reference in float64 and in float32 (FA's "pt" reference), per request
    for b, (n, m) in enumerate(zip(nq, nk)):
        qa, ka = sum(nq[:b]), sum(nk[:b])
        length = before[b] + m
        refs = []
        for dtype in (torch.float64, torch.float32):
            qb, kb, vb = q64[qa:qa + n].to(dtype), k64[ka:ka + m].to(dtype), v64[ka:ka + m].to(dtype)
            if rotary:
                start = before[b]
                # FlashAttention rotates queries at their positions when causal or local
                q_pos = start + (torch.arange(n) if causal or local else torch.zeros(n, dtype=torch.long))
                k_pos = start + torch.arange(m)
                qb = _rotate(qb, cos64[q_pos], sin64[q_pos], rotary == "interleaved")
                kb = _rotate(kb, cos64[k_pos], sin64[k_pos], rotary == "interleaved")
            krow, vrow = kc64[rows[b]].to(dtype).clone(), vc64[rows[b]].to(dtype).clone()
            krow[before[b]:length], vrow[before[b]:length] = kb, vb
            refs.append((*attention_ref(qb.to(DEVICE), krow.to(DEVICE), vrow.to(DEVICE), length, pads[b], causal,
                                       left),
                         krow, vrow))
        (ref_out, ref_lse, ref_k, ref_v), (pt_out, pt_lse, *_) = refs
        if n:
            _fa_rule("out", outs[b].double(), ref_out, pt_out.double())
            finite = torch.isfinite(ref_lse)
            assert torch.equal(torch.isfinite(lses[b]), finite), "lse: -inf where the reference has none (or not)"
            _fa_rule("lse", lses[b].double()[finite], ref_lse[finite], pt_lse.double()[finite])
            assert (outs[b][~finite.T] == 0).all()
        # the cache row's valid part (the appended rows rotated) as the reference's
        torch.testing.assert_close((cache_k[b, :length].double().cpu(), cache_v[b, :length].double().cpu()),
                                   (ref_k[:length], ref_v[:length]), rtol=0, atol=1e-5)


def _fa_rule(name, got, ref, pt):
    """FlashAttention's tolerance: max|got - ref| <= 2 * max|pt - ref| + 1e-5."""
    if got.numel() == 0:
        return
    err, err_pt = (got - ref).abs().max().item(), (pt - ref).abs().max().item()
    assert err <= 2 * err_pt + 1e-5, f"{name}: error {err:.3g} > 2 x {err_pt:.3g} + 1e-5"


GRID = list(itertools.product(["dilated", "block_sparse"], [1, 3, 17, 40], ["mha", "gqa", "mqa"]))
SHARDS = 8   # each flag combination runs at 24 / 8 = 3 of the (variant, seqlen_q, heads) points
FULL = os.environ.get("TRITON_DILATED_FULL_GRID") == "1"   # every combination at every point (~8x the time)


@pytest.mark.parametrize("variant, seqlen_q, mha", GRID)
def test_flash_kvcache_grid_portable(variant, seqlen_q, mha):
    """The grid on the portable path: the flag combinations (_flags, 96) are spread over the 24
    (variant, seqlen_q, heads) points, each combination at 3 of them (all of them at every point
    with TRITON_DILATED_FULL_GRID=1)."""
    point = GRID.index((variant, seqlen_q, mha))
    for i, flags in enumerate(_flags()):
        if not FULL and i % SHARDS != point % SHARDS:
            continue
        seed = 1000 * seqlen_q + i
        try:
            run_case(variant, "torch", seqlen_q, mha, *flags, seed=seed)
        except AssertionError as e:
            raise AssertionError(f"case {dict(zip(FLAG_NAMES, flags))}, seed {seed}: {e}") from e


FLAG_NAMES = ("varlen", "cache_batch_idx", "leftpad", "rotary", "paged", "new_kv", "causal")
TRITON_CASES = [   # (variant, seqlen_q, mha, flags): decode route and query-offset path, each feature once
    ("dilated", 1, "gqa", (True, False, True, "interleaved", True, True, True)),
    ("block_sparse", 3, "mqa", (True, True, False, "neox", False, True, False)),
    ("dilated", 3, "mha", (False, True, True, None, False, False, True)),
    ("block_sparse", 1, "gqa", (False, False, True, None, True, True, True)),
    ("dilated", 17, "gqa", (True, False, True, "neox", False, True, True)),
    ("block_sparse", 17, "mqa", (False, True, False, "interleaved", False, True, True)),
    # non-causal rows holding fewer keys than queries (issue 33): varlen, leftpad, paged; cache_batch_idx, leftpad
    ("block_sparse", 17, "gqa", (True, False, True, None, True, False, False)),
    ("dilated", 17, "mha", (False, True, True, None, False, False, False)),
]


@pytest.mark.parametrize("variant, seqlen_q, mha, flags", TRITON_CASES)
def test_flash_kvcache_grid_triton(variant, seqlen_q, mha, flags):
    """A subset of the grid on the Triton kernels (the interpreter on CPU)."""
    run_case(variant, "triton", seqlen_q, mha, *flags, seed=7 + seqlen_q)


LOCAL_SEQLEN_Q = [1, 3, 17, 40]


@pytest.mark.parametrize("seqlen_q", LOCAL_SEQLEN_Q)
def test_flash_kvcache_grid_local_window_portable(seqlen_q):
    """FlashAttention's `local` cases (window_size=(left, 0)) on the dilated door, portable
    path: the grid's flag combinations (causal or not: a window (left, 0) is causal either
    way), each at 1 of the 4 seqlen_q points (every one at every point with
    TRITON_DILATED_FULL_GRID=1), GQA."""
    point = LOCAL_SEQLEN_Q.index(seqlen_q)
    for i, flags in enumerate(_flags()):
        if not FULL and i % 4 != point:
            continue
        seed = 5000 + 100 * seqlen_q + i
        try:
            run_case("dilated", "torch", seqlen_q, "gqa", *flags, seed=seed, local=True)
        except AssertionError as e:
            raise AssertionError(f"local case {dict(zip(FLAG_NAMES, flags))}, seed {seed}: {e}") from e


@pytest.mark.parametrize("seqlen_q, mha, flags", [(1, "gqa", (True, False, True, "interleaved", True, True, True)),
                                                  (3, "mqa", (False, True, True, None, False, False, True)),
                                                  (17, "gqa", (False, False, True, "neox", False, True, True))])
def test_flash_kvcache_grid_local_window_triton(seqlen_q, mha, flags):
    """FlashAttention's `local` cases on the dilated door's Triton kernels (the interpreter on
    CPU): the decode kernel (1, 3 rows) and the query-offset path (17)."""
    run_case("dilated", "triton", seqlen_q, mha, *flags, seed=31 + seqlen_q, local=True)


SHORT_ROWS = [2, 40]   # keys per row: fewer than every seqlen_q below, and more


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("variant", ["dilated", "block_sparse", "indexed"])
@pytest.mark.parametrize("seqlen_q", [3, 20])
def test_noncausal_short_row_sees_every_key(variant, seqlen_q, backend):
    """Issue 33: a row holding fewer keys (2) than queries, beside a row holding more (40),
    without causal: FlashAttention (and DESIGN §5b) let every query see all the row's keys.
    The patterned doors at dense settings place such a query at position 0, whose segment or
    layout row holds every key; the indexed door (indices listing every key) reads a query's
    indices whatever its position. Out and lse, then with gradients out, lse and dq, dk_cache,
    dv_cache, against attention_ref in float64; GQA. Routes: 3 rows the decode route (the
    Triton decode kernel without gradients, with no host sync; with them the query-offset
    path, as 20 rows)."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, B = 4, 2, len(SHORT_ROWS)
    kc, vc = (torch.randn(B, NK, hkv, D, generator=g, dtype=torch.float64) for _ in range(2))
    q = torch.randn(B, seqlen_q, hq, D, generator=g, dtype=torch.float64)
    lens = torch.tensor(SHORT_ROWS, dtype=torch.int32, device=DEVICE)
    if variant == "indexed":
        every_key = torch.arange(NK, dtype=torch.int32, device=DEVICE).expand(B, seqlen_q, NK)
        door = lambda *a, **kw: indexed_attention_with_kvcache(*a[:3], every_key, *a[3:], **kw)  # noqa: E731
    else:
        door = _door(variant)
    leaves64 = [x.requires_grad_() for x in (q, kc, vc)]
    refs = [attention_ref(q[b], kc[b], vc[b], n, 0, False) for b, n in enumerate(SHORT_ROWS)]
    ref_out, ref_lse = torch.stack([o for o, _ in refs]), torch.stack([l_ for _, l_ in refs])
    assert torch.isfinite(ref_lse).all()
    leaves = [x.detach().float().to(DEVICE).requires_grad_() for x in leaves64]
    with torch.no_grad(), no_host_sync() if seqlen_q <= 16 else contextlib.nullcontext():   # the decode route
        out, lse = door(*leaves, causal=False, return_lse=True, cache_seqlens=lens, backend=backend)
    torch.testing.assert_close(out.double().cpu(), ref_out.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double().cpu(), ref_lse.detach(), rtol=0, atol=1e-5)

    out, lse = door(*leaves, causal=False, return_lse=True, cache_seqlens=lens, backend=backend)
    torch.testing.assert_close(out.double().cpu(), ref_out.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double().cpu(), ref_lse.detach(), rtol=0, atol=1e-5)
    g_out, g_lse = torch.randn(out.shape, generator=g, dtype=torch.float64), torch.randn(lse.shape, generator=g,
                                                                                         dtype=torch.float64)
    grads = torch.autograd.grad((out.double().cpu() * g_out).sum() + (lse.double().cpu() * g_lse).sum(), leaves)
    want = torch.autograd.grad((ref_out * g_out).sum() + (ref_lse * g_lse).sum(), leaves64)
    for name, got, ref in zip(("dq", "dk_cache", "dv_cache"), grads, want):
        torch.testing.assert_close(got.double().cpu(), ref, rtol=0, atol=1e-4, msg=name)
