"""The decode paths (DESIGN §5b, issue 15 item 2): q of 1-16 rows against a longer cache, through
the serve doors (`*_attention_with_kvcache`, no new rows: reference.dilated_serve,
block_sparse_serve), reads only the keys each query attends to, on the portable path
(ops/*/decode.py) and with the Triton decode kernels (ops/*/decode_kernels.py, the
interpreter on CPU). Every result is
checked against the definition (the float64 oracle on each row's prefix, the queries
placed last: test_query_offset's reference), with key rows past each row's length set to
NaN (they must be ignored), and every call checks which path ran, so that a silent
fallback to the general path cannot pass for the decode path."""
from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

from triton_dilated import BlockLayout, block_sparse_attention_naive, dilated_attention, dilated_attention_naive, layouts
from triton_dilated.ops.block_sparse import decode as bs_decode, interface as bs_interface, serve as bs_serve
from triton_dilated.ops.block_sparse.decode import block_key_lists
from triton_dilated.ops.common import decode as common_decode
from triton_dilated.ops.dilated import decode as dl_decode, interface as dl_interface, serve as dl_serve
from triton_dilated.ops.dilated.decode import dilated_key_lists
from triton_dilated.ops.dilated.naive import pattern_multiplicity
from triton_dilated.ops.dilated.patterns import fit_patterns, head_offsets
from tests.conftest import DEVICE
from tests.helpers.reference import FLOOR, assert_rule, block_sparse_serve, dense_reference, dilated_serve, seeded
from tests.helpers.serve_checks import check_against_definition as _check, check_forward, definition as _definition

BACKENDS = ["torch", "triton"]


# ----------------------------------------------------------------------------- which path ran

@contextlib.contextmanager
def _spy(module, name, seen):
    original = getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(name)
        return original(*args, **kwargs)

    setattr(module, name, spy)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def paths(variant, splits=None):
    """Records the paths a call of `variant` ("dilated" or "block_sparse") takes: "general"
    (the query-offset path), "portable" (decode.py) and in it "runs" (strided views: dilated,
    CPU, no gradient, only through the training door, which knows the lengths on the host),
    "patterns" (dilated, gathered per pattern) or "gather" (block-sparse key lists), either
    also for the dense route (attend_dense: the lists as a mask), or
    "triton" (the decode kernel). `splits` forces the Triton decode kernel's number of
    splits. Both doors run the decode step and the query-offset path of interface.py."""
    serve = dl_interface if variant == "dilated" else bs_interface
    portable = "dilated_decode" if variant == "dilated" else "block_sparse_decode"
    seen = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_spy(serve, "run_with_query_offset", seen))
        if variant == "dilated":   # the serve door's prefill calls it from its own module
            stack.enter_context(_spy(dl_serve, "run_with_query_offset", seen))
        stack.enter_context(_spy(serve, portable, seen))
        if variant == "dilated":
            stack.enter_context(_spy(dl_decode, "attend_runs", seen))
            stack.enter_context(_spy(dl_decode, "attend_patterns", seen))
        else:
            stack.enter_context(_spy(bs_decode, "attend_key_lists", seen))
        # the portable dense route (key lists covering most of the cache, issue 33: the same
        # lists as a mask, one product; tests/serve/test_flash_parity.py checks it against
        # the gather path) counts as the key-list path here
        stack.enter_context(_spy(dl_decode if variant == "dilated" else bs_decode, "attend_dense", seen))
        if DEVICE == "cuda" or _interpreted():
            kernels = serve._decode_kernels()
            if variant == "dilated":   # every dilated decode launch (the serve door's planned one too) runs it
                stack.enter_context(_spy(kernels.DecodeLaunch, "run", seen))
            else:
                stack.enter_context(_spy(kernels, f"{portable}_forward", seen))
            if splits is not None:
                stack.enter_context(_patch(kernels, "num_splits", lambda *a: splits))
                stack.callback(dl_serve._PLANS.clear)   # plans built under the forced splits
                dl_serve._PLANS.clear()                  # (and none built before them)
        yield seen
    names = {"run_with_query_offset": "general", portable: "portable", f"{portable}_forward": "triton",
             "run": "triton", "attend_key_lists": "gather", "attend_runs": "runs", "attend_patterns": "patterns",
             "attend_dense": "patterns" if variant == "dilated" else "gather"}
    seen[:] = [names[n] for n in seen]


@contextlib.contextmanager
def _patch(module, name, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _interpreted():
    from triton_dilated.ops.common.runtime import interpreter_enabled
    return interpreter_enabled()


def expected_paths(backend, variant="dilated", grad=False):
    """The paths a serve-door decode call takes: the portable dilated decode gathers per
    pattern (no host sync, on every device; the strided runs are the training door's only), the
    Triton backend with gradients the query-offset path (the decode kernel has no backward)."""
    if backend == "torch":
        return ["portable", "patterns" if variant == "dilated" else "gather"]
    return ["general"] if grad else ["triton"]


# ----------------------------------------------------------------------------- helpers

def cache_inputs(B, Nq, Nk, Hq, Hkv, D, lengths, seed, dtype=torch.float32, poison=True):
    """q (B, Nq, Hq, D) and k, v (B, Nk, Hkv, D), k and v as slices of a larger cache buffer
    (strided), NaN at and after each row's length (rows the call must ignore)."""
    q = seeded((B, Nq, Hq, D), dtype, seed, DEVICE)
    buf_k = seeded((B, Nk + 3, Hkv + 1, D), dtype, seed + 1, DEVICE)
    buf_v = seeded((B, Nk + 3, Hkv + 1, D), dtype, seed + 2, DEVICE)
    if poison:
        for b, n in enumerate(lengths):
            buf_k[b, n:] = float("nan")
            buf_v[b, n:] = float("nan")
    return q, buf_k[:, :Nk, 1:], buf_v[:, :Nk, 1:]


# ----------------------------------------------------------------------------- dilated

@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=10)
@given(data=st.data())
def test_dilated_decode_matches_the_definition(backend, data):
    B = data.draw(st.integers(1, 2))
    Nk = data.draw(st.integers(4, 96))
    Nq = data.draw(st.sampled_from([n for n in (1, 2, 5, 16) if n <= Nk]))
    Hkv = data.draw(st.sampled_from([1, 2]))
    Hq = Hkv * data.draw(st.sampled_from([1, 2]))
    D = data.draw(st.sampled_from([8, 12, 24]))
    causal = data.draw(st.booleans())
    mode = data.draw(st.sampled_from(["longnet", "head_groups"]))
    offsets = data.draw(st.sampled_from(["modulo", "blocked"]))
    m = data.draw(st.integers(1, 3))
    rs = [data.draw(st.integers(1, 5)) for _ in range(m)]
    ws = [data.draw(st.integers(r, 80)) for r in rs]
    lengths = [data.draw(st.integers(Nq, Nk)) for _ in range(B)]
    ragged = data.draw(st.booleans())
    lengths = lengths if ragged else [Nk] * B
    splits = data.draw(st.sampled_from([None, 2, 3]))
    grad = backend == "torch" and data.draw(st.booleans())   # the portable gather path (forward checked here)
    seed = data.draw(st.integers(0, 1000))
    softcap = data.draw(st.sampled_from([None, 0.75]))   # issue 23: the cap in the decode kernels / gathers
    q, k, v = cache_inputs(B, Nq, Nk, Hq, Hkv, D, lengths, seed)
    kw = dict(causal=causal, mode=mode, offsets=offsets, softcap=softcap)
    cache = torch.tensor(lengths, dtype=torch.int32, device=DEVICE) if ragged else None
    with paths("dilated", splits) as seen:
        out, lse = dilated_serve(q.requires_grad_(grad), k, v, ws, rs, return_lse=True, backend=backend,
                                 cache_seqlens=cache, **kw)
    assert seen == expected_paths(backend, grad=grad)
    check_forward(out.detach(), lse.detach(), q.detach(), k, v, lengths,
                  lambda q_, k_, v_, n: dilated_attention_naive(q_, k_, v_, ws, rs, **kw))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_dilated_decode_longnet_schedule_scaled_down(backend, causal):
    """The paper's schedule shape (rates 1, 2, 4, 6, 12) scaled to a 200-token cache, every
    head and offset, one token per batch row at ragged lengths, several splits (more than
    the merge kernel reads in one step for the non-causal case)."""
    ws, rs = [12, 24, 48, 96, 192], [1, 2, 4, 6, 12]
    lengths = [200, 131]
    q, k, v = cache_inputs(2, 1, 200, 12, 4, 20, lengths, seed=3)   # 12 heads: every offset of r = 12
    cache = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    with paths("dilated", splits=5 if causal else 17) as seen:
        out, lse = dilated_serve(q, k, v, ws, rs, causal=causal, return_lse=True, backend=backend,
                                 cache_seqlens=cache)
    assert seen == expected_paths(backend)
    check_forward(out, lse, q, k, v, lengths,
                  lambda q_, k_, v_, n: dilated_attention_naive(q_, k_, v_, ws, rs, causal=causal))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dilated_decode_gradients(backend):
    """With gradients: the portable decode differentiates through its gather (autograd); the
    Triton decode kernel has no backward, so that backend takes the general path."""
    ws, rs = [8, 32], [1, 3]
    lengths = [40, 29]
    q = seeded((2, 3, 4, 12), torch.float32, 0, DEVICE)
    k = seeded((2, 40, 2, 12), torch.float32, 1, DEVICE)
    v = seeded((2, 40, 2, 12), torch.float32, 2, DEVICE)
    cache = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    for causal in (False, True):
        with paths("dilated") as seen:
            _check(lambda q_, k_, v_: dilated_serve(q_, k_, v_, ws, rs, causal=causal, return_lse=True,
                                                    backend=backend, cache_seqlens=cache),
                   lambda q_, k_, v_, n: dilated_attention_naive(q_, k_, v_, ws, rs, causal=causal),
                   q, k, v, lengths, torch.float32)
        assert seen == expected_paths(backend, grad=True)
    with torch.no_grad(), paths("dilated") as seen:   # no gradient recorded: the decode path again
        dilated_serve(q.requires_grad_(True), k, v, ws, rs, backend=backend, cache_seqlens=cache)
    assert seen == expected_paths(backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_dilated_decode_half_precision(backend, dtype):
    """16-bit inputs: the same-dtype reference is dense attention over the pattern
    multiplicities in that dtype (reference.py), the oracle the same in float64."""
    ws, rs = [16, 64], [1, 4]
    N, Nq, Hq = 70, 4, 4
    q, k, v = cache_inputs(1, Nq, N, Hq, 2, 24, [N], seed=5, dtype=dtype, poison=False)
    for causal in (False, True):
        with paths("dilated") as seen:
            out, lse = dilated_serve(q, k, v, ws, rs, causal=causal, return_lse=True, backend=backend)
        assert seen == expected_paths(backend)
        patterns = fit_patterns(tuple(zip(ws, rs)), N, Hq)
        counts = pattern_multiplicity(torch.arange(N - Nq, N), torch.arange(N), patterns,
                                      head_offsets(Hq, patterns, "longnet", "modulo"), causal=causal)
        ref_out, ref_lse = dense_reference(q.double(), k.double(), v.double(), counts)
        same_out, same_lse = dense_reference(q, k, v, counts)
        assert out.dtype == dtype
        assert_rule("out", out.float(), ref_out, same_out.float(), factor=2, floor=FLOOR[dtype])
        assert_rule("lse", lse, ref_lse, same_lse, factor=2, floor=FLOOR[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_dilated_decode_empty_rows_and_nan(backend):
    """One pattern (8, 4), one head at offset 0: positions with (p % 8) % 4 != 0 read no key
    (0 and lse -inf). A NaN in a key a query does not read (position 0, the portable path's
    padding slot, and the inactive residues) changes nothing; a NaN it reads makes its row
    NaN, and only its row."""
    N = 40
    q = seeded((1, 4, 1, 8), torch.float32, 0, DEVICE)   # positions 36..39: 36 active, the rest empty
    k = seeded((1, N, 1, 8), torch.float32, 1, DEVICE)
    v = seeded((1, N, 1, 8), torch.float32, 2, DEVICE)
    k[0, 0] = v[0, 0] = float("nan")
    k[0, 33] = v[0, 35] = float("nan")       # residues 1 and 3 of segment [32, 40): nobody reads them
    with paths("dilated") as seen:
        out, lse = dilated_serve(q, k, v, [8], [4], return_lse=True, backend=backend)
    assert seen == expected_paths(backend)
    assert torch.isfinite(out).all() and torch.isfinite(lse[0, 0, 0])
    assert (out[0, 1:] == 0).all() and torch.isneginf(lse[0, 0, 1:]).all()
    k[0, 32] = float("nan")                  # read by the query at 36 (residue 0, same segment)
    out, lse = dilated_serve(q, k, v, [8], [4], return_lse=True, backend=backend)
    assert torch.isnan(out[0, 0]).all() and torch.isnan(lse[0, 0, 0])
    assert (out[0, 1:] == 0).all() and torch.isneginf(lse[0, 0, 1:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_longer_query_blocks_take_the_general_path(backend):
    """17 query rows (more than DECODE_MAX_QUERIES: chunked prefill) go through the serve
    door's query-offset path, with the same rows as the decode path gives them one at a time."""
    ws, rs = [8, 32], [1, 2]
    q, k, v = cache_inputs(1, 17, 48, 2, 2, 8, [48], seed=1, poison=False)
    with paths("dilated") as seen:
        out = dilated_serve(q, k, v, ws, rs, causal=True, backend=backend)
    assert seen == ["general"]
    for i in (0, 16):
        n = 48 - 16 + i
        with paths("dilated") as seen:
            row = dilated_serve(q[:, i:i + 1], k[:, :n], v[:, :n], ws, rs, causal=True, backend=backend,
                                cache_seqlens=torch.tensor([n], dtype=torch.int32, device=DEVICE))
        assert seen == expected_paths(backend)
        torch.testing.assert_close(row[:, 0], out[:, i], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- block-sparse

@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=8)
@given(data=st.data())
def test_block_sparse_decode_matches_the_definition(backend, data):
    B = data.draw(st.integers(1, 2))
    bs = 16
    Nk = data.draw(st.integers(17, 96))
    Nq = data.draw(st.sampled_from([n for n in (1, 3, 16) if n <= Nk]))
    Hkv = data.draw(st.sampled_from([1, 2]))
    Hq = Hkv * data.draw(st.sampled_from([1, 2]))
    D = data.draw(st.sampled_from([8, 20]))
    causal = data.draw(st.booleans())
    ragged = data.draw(st.booleans())
    lengths = [data.draw(st.integers(Nq, Nk)) for _ in range(B)] if ragged else [Nk] * B
    splits = data.draw(st.sampled_from([None, 2, 3]))
    seed = data.draw(st.integers(0, 1000))
    softcap = data.draw(st.sampled_from([None, 0.75]))   # issue 23: the cap in the decode kernels / gathers
    nb = -(-Nk // bs)
    per_batch = data.draw(st.booleans())
    per_head = data.draw(st.booleans())
    lay = layouts.random(Nk, bs, num_random=2, num_heads=Hq if per_head else 1, batch=B if per_batch else 1,
                         seed=seed)
    if data.draw(st.booleans()):
        lay = lay | layouts.local(Nk, bs, 0)
    assert lay.n_q_blocks == nb
    q, k, v = cache_inputs(B, Nq, Nk, Hq, Hkv, D, lengths, seed)
    cache = torch.tensor(lengths, dtype=torch.int32, device=DEVICE) if ragged else None
    with paths("block_sparse", splits) as seen:
        out, lse = block_sparse_serve(q, k, v, lay, causal=causal, return_lse=True, backend=backend,
                                      cache_seqlens=cache, softcap=softcap)
    assert seen == expected_paths(backend, "block_sparse")
    for b in range(B):   # the definition row by row (a per-batch layout's row b)
        lay_b = lay.prefix(nb, [b]) if lay.kv_num_blocks.shape[0] > 1 else lay
        check_forward(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1], lengths[b:b + 1],
                      lambda q_, k_, v_, n, lay_b=lay_b: block_sparse_attention_naive(
                          q_, k_, v_, lay_b.prefix(-(-n // bs)), causal=causal, softcap=softcap))


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_sparse_decode_empty_rows_gradients_and_splits(backend):
    """A layout row with no block (its queries: 0 and -inf), a row whose only block lies past
    the row's length, several splits; then gradients (portable decode, or the general path
    for the Triton backend)."""
    bs, N = 16, 64
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[3, :3] = True           # the last row: blocks 0-2
    mask[2, 3] = True            # row 2 reads only block 3 (positions 48..63)
    lay = BlockLayout.from_dense(mask, bs)
    lengths = [64, 40, 50]       # row 0: queries 60..63 (row 3); row 1: 36..39 (row 2, block 3 past 40)
    q, k, v = cache_inputs(3, 4, N, 2, 1, 12, lengths, seed=4)
    cache = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    with paths("block_sparse", splits=20) as seen:
        out, lse = block_sparse_serve(q, k, v, lay, return_lse=True, backend=backend, cache_seqlens=cache)
    assert seen == expected_paths(backend, "block_sparse")
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()
    check_forward(out, lse, q, k, v, lengths,
                  lambda q_, k_, v_, n: block_sparse_attention_naive(q_, k_, v_, lay.prefix(-(-n // bs))))
    q, k, v = cache_inputs(3, 4, N, 2, 1, 12, lengths, seed=4, poison=False)
    with paths("block_sparse") as seen:
        _check(lambda q_, k_, v_: block_sparse_serve(q_, k_, v_, lay, causal=True, return_lse=True,
                                                     backend=backend, cache_seqlens=cache),
               lambda q_, k_, v_, n: block_sparse_attention_naive(q_, k_, v_, lay.prefix(-(-n // bs)), causal=True),
               q, k, v, lengths, torch.float32)
    assert seen == expected_paths(backend, "block_sparse", grad=True)


# ----------------------------------------------------------------------------- cost

def test_decode_cost_does_not_grow_with_the_context():
    """The LongNet schedule scaled down 32x (w = 64..1024, r = 1, 2, 4, 6, 12): one decode
    token reads the same number of key rows at a 4K and a 64K context (at 1K its key lists
    cover over DENSE_SHARE of the cache: the dense route), on both portable
    paths (counted where they read k), against 64x more for dense attention; and the key
    list is exactly the multiset of the definition (pattern multiplicities) at 64K. CPU
    tensors whatever the suite's device: only there does the portable decode take both
    paths (strided runs: the training door, which knows the lengths, no gradient; the
    per-pattern gather: the serve door, with gradients and without)."""
    ws, rs = [64, 128, 256, 512, 1024], [1, 2, 4, 6, 12]
    H, D = 4, 8
    for route, grad in (("train", False), ("serve", False), ("serve", True)):
        rows = {}
        for n in (4096, 65536):
            q = seeded((1, 1, H, D), torch.float32, 0).requires_grad_(grad)
            k = seeded((1, n, H, D), torch.float32, 1)
            v = seeded((1, n, H, D), torch.float32, 2)
            before = dict(common_decode.DECODE_STATS)
            with paths("dilated") as seen:
                if route == "train":
                    dilated_attention(q, k, v, ws, rs, causal=True, backend="torch")
                else:
                    dilated_serve(q, k, v, ws, rs, causal=True, backend="torch")
            assert seen == ["portable", "runs" if route == "train" else "patterns"], (route, grad, seen)
            rows[n] = common_decode.DECODE_STATS["key_rows"] - before["key_rows"]
            assert common_decode.DECODE_STATS["calls"] == before["calls"] + 1
        assert 0 < rows[4096] == rows[65536] <= H * sum(-(-w // r) for w, r in zip(ws, rs))
        assert rows[65536] * 64 < H * 65536   # dense reads every key for every head

    n = 65536
    patterns = fit_patterns(tuple(zip(ws, rs)), n, H)
    table = head_offsets(H, patterns, "longnet", "modulo")
    pos = torch.tensor([[n - 1], [n - 600], [n - 1025]])
    lengths = pos[:, 0] + 1
    for causal in (False, True):
        key_pos, key_ok = dilated_key_lists(pos, torch.tensor([n] * 3) if not causal else lengths, patterns, table,
                                            causal)
        for b in range(3):
            counts = pattern_multiplicity(pos[b], torch.arange(n), patterns, table, causal=causal)[:, 0]  # (H, N)
            for h in range(H):
                listed = torch.bincount(key_pos[b, 0, h][key_ok[b, 0, h]], minlength=n).double()
                assert torch.equal(listed, counts[h]), (causal, b, h)


def test_block_sparse_decode_cost_does_not_grow_with_the_context():
    """A local window layout: one decode token reads the same key rows at 4K and 64K (at 1K
    the window covers over DENSE_SHARE of the cache: the dense route)."""
    rows = {}
    for n in (4096, 65536):
        lay = layouts.local(n, 64, 2)
        q = seeded((1, 1, 2, 8), torch.float32, 0)
        k, v = seeded((1, n, 2, 8), torch.float32, 1), seeded((1, n, 2, 8), torch.float32, 2)
        before = common_decode.DECODE_STATS["key_rows"]
        with paths("block_sparse") as seen:
            block_sparse_serve(q, k, v, lay, causal=True, backend="torch")
        assert seen == ["portable", "gather"]
        rows[n] = common_decode.DECODE_STATS["key_rows"] - before
    # slots: the layout's index-list width (5 blocks: a window of 2 on either side), a shape
    # (no host sync for the widest active row), of which the last row uses 3
    assert rows[4096] == rows[65536] <= 2 * 5 * 64
    pos = torch.tensor([[65536 - 1]])
    key_pos, key_ok = block_key_lists(pos, pos[:, 0] + 1, lay, 2, True)
    assert sorted(key_pos[0, 0, 0][key_ok[0, 0, 0]].tolist()) == list(range(65536 - 3 * 64, 65536))


# ----------------------------------------------------------------------------- NaN and Inf (DESIGN §6)

NAN, INF = float("nan"), float("inf")
NONFINITE = [(w, x) for w in "qkv" for x in (NAN, INF, -INF)]


def check_nan_rule(out, lse, rows, clean_out, clean_lse):
    """NaN out (every element) and NaN lse exactly on `rows` (B, Hq, Nq); every other row
    finite and equal to the run on cleaned inputs."""
    rows_q = rows.transpose(1, 2)                                   # (B, Nq, Hq)
    assert torch.equal(torch.isnan(out).all(dim=-1).cpu(), rows_q)
    assert torch.equal(torch.isnan(lse).cpu(), rows)
    assert torch.isfinite(out[~rows_q]).all()
    torch.testing.assert_close(out[~rows_q], clean_out[~rows_q], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[~rows], clean_lse[~rows], rtol=1e-5, atol=1e-5)


def _poison(q, k, v, which, value, q_at, kv_at):
    q, k, v = q.clone(), k.clone(), v.clone()
    if which == "q":
        q[(0, *q_at, 3)] = value
    else:
        {"k": k, "v": v}[which][(0, *kv_at, 3)] = value
    return q, k, v


def _clean(*xs):
    return tuple(torch.nan_to_num(x, nan=0.5, posinf=0.5, neginf=0.5) for x in xs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which,value", NONFINITE, ids=str)
def test_dilated_decode_nan_rule(backend, causal, which, value):
    """One NaN or +-Inf in q (query row 1, head 2) or in k or v (position 61, kv head 1, read
    by query heads 2 and 3): the decode rows that read it (from the pattern multiplicities)
    are NaN, out and lse; the rest equal the run on cleaned inputs."""
    N, Nq, Hq, Hkv = 64, 3, 4, 2
    ws, rs = [16, 64], [1, 2]
    q0 = seeded((2, Nq, Hq, 16), torch.float32, 0, DEVICE)
    k0, v0 = seeded((2, N, Hkv, 16), torch.float32, 1, DEVICE), seeded((2, N, Hkv, 16), torch.float32, 2, DEVICE)
    q, k, v = _poison(q0, k0, v0, which, value, (1, 2), (61, 1))
    patterns = fit_patterns(tuple(zip(ws, rs)), N, Hq)
    pairs = pattern_multiplicity(torch.arange(N - Nq, N), torch.arange(N), patterns,
                                 head_offsets(Hq, patterns, "longnet", "modulo"), causal=causal) > 0   # (Hq, Nq, N)
    rows = torch.zeros(2, Hq, Nq, dtype=torch.bool)
    if which == "q":
        rows[0, 2, 1] = pairs[2, 1].any()
    else:
        rows[0, 2:4] = pairs[2:4, :, 61]
    assert rows.any()

    def run(*xs):
        return dilated_serve(*xs, ws, rs, causal=causal, return_lse=True, backend=backend)

    with paths("dilated") as seen:
        out, lse = run(q, k, v)
    assert seen == expected_paths(backend)
    check_nan_rule(out, lse, rows, *run(*_clean(q, k, v)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which,value", NONFINITE, ids=str)
def test_block_sparse_decode_nan_rule(backend, which, value):
    """Block size 16, N = 100, causal window of two blocks plus one full row: a NaN or +-Inf
    at position 60 (block 3) reaches the decode rows whose layout row lists block 3."""
    N, Nq, bs = 100, 4, 16
    dense = torch.zeros(7, 7, dtype=torch.bool)
    for i in range(7):
        dense[i, max(0, i - 1):i + 1] = True
    dense[6, 3] = True       # the last row (positions 96..99) also reads block 3
    lay = BlockLayout.from_dense(dense, bs)
    lengths = [100, 70]      # row 0: queries 96..99 (layout row 6); row 1: 66..69 (row 4, reads blocks 3, 4)
    q0 = seeded((2, Nq, 2, 16), torch.float32, 0, DEVICE)
    k0, v0 = seeded((2, N, 1, 16), torch.float32, 1, DEVICE), seeded((2, N, 1, 16), torch.float32, 2, DEVICE)
    q, k, v = _poison(q0, k0, v0, which, value, (1, 0), (60, 0))
    q[1], k[1], v[1] = q[0], k[0], v[0]    # the same element in batch row 1 too
    rows = torch.zeros(2, 2, Nq, dtype=torch.bool)
    if which == "q":
        rows[:, 0, 1] = True
    else:
        rows[:, :, :] = True               # every query of both rows reads block 3 (position 60 < each query)
    cache = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)

    def run(*xs):
        return block_sparse_serve(*xs, lay, causal=True, return_lse=True, backend=backend, cache_seqlens=cache)

    with paths("block_sparse") as seen:
        out, lse = run(q, k, v)
    assert seen == expected_paths(backend, "block_sparse")
    check_nan_rule(out, lse, rows, *run(*_clean(q, k, v)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_double_backward(backend):
    """DESIGN §6, double backward: correct on the portable decode (plain autograd through the
    gather: second-order gradients match the definition's), a clear error on the Triton
    backend (gradients there take the serve door's query-offset path, whose training kernels
    have no second derivative)."""
    ws, rs = [8, 24], [1, 2]
    lengths = [24, 19]
    q = seeded((2, 2, 2, 8), torch.float32, 0, DEVICE)
    k, v = seeded((2, 24, 1, 8), torch.float32, 1, DEVICE), seeded((2, 24, 1, 8), torch.float32, 2, DEVICE)
    cache = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    w_out = seeded(q.shape, torch.float32, 3, DEVICE)

    def second_order(fn, dtype):
        xs = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
        (gq,) = torch.autograd.grad((fn(*xs) * w_out.to(dtype)).sum(), xs[0], create_graph=True)
        return torch.autograd.grad((gq * gq).sum(), xs)

    def decode(q_, k_, v_):
        return dilated_serve(q_, k_, v_, ws, rs, causal=True, backend=backend, cache_seqlens=cache)

    def definition(q_, k_, v_):
        return _definition(lambda a, b, c, n: dilated_attention_naive(a, b, c, ws, rs, causal=True), q_, k_, v_,
                           lengths)[0]

    if backend == "triton":
        with pytest.raises(NotImplementedError, match="double backward"):
            second_order(decode, torch.float32)
        return
    got = second_order(decode, torch.float32)
    ref, same = second_order(definition, torch.float64), second_order(definition, torch.float32)
    for name, g, r, s in zip("qkv", got, ref, same):
        assert_rule(f"d2{name}", g.double(), r, s.double(), factor=3, floor=1e-4)


@pytest.mark.parametrize("num_queries", [1, 3])
def test_decode_problem_for_the_perf_sweep(num_queries):
    """DilatedDecodeProblem (the perf decode sweep's problem): with one pattern covering the
    whole cache its decode equals its dense baseline, and it counts the pairs it reads."""
    from triton_dilated.ops.dilated.spec import DilatedDecodeProblem, longnet_patterns
    prob = DilatedDecodeProblem(2, 64, 4, 8, torch.float32, "cpu", causal=True, num_queries=num_queries,
                                kv_heads=2, patterns=((64, 1),))
    torch.testing.assert_close(prob.decode("torch"), prob.dense(), rtol=1e-5, atol=1e-5)
    assert prob.keys_read == 2 * 4 * sum(64 - num_queries + 1 + i for i in range(num_queries))
    prob = DilatedDecodeProblem(1, 8192, 16, 8, torch.float32, "cpu", num_queries=num_queries)
    assert prob.patterns == longnet_patterns(8192)
    assert prob.keys_read < 16 * num_queries * 8192 // 2


@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
@pytest.mark.parametrize("layout", ["sliced", "expanded"])
def test_decode_strided_cache_seqlens(variant, layout):
    """Issue 19 item 1: an int32 cache_seqlens that is not contiguous (a slice with step 2, a
    stride-0 expand) gives the result of the same lengths made contiguous. The Triton decode
    kernel read LENS + b as if contiguous: a wrong output, or a segfault with a large
    neighbouring value."""
    q = seeded((2, 1, 2, 8), torch.float32, 1, DEVICE)
    k, v = (seeded((2, 64, 2, 8), torch.float32, s, DEVICE) for s in (2, 3))
    if layout == "sliced":   # values [40, 64]; the skipped values would be read past the end
        lens = torch.tensor([40, 7, 64, 100_000_000], dtype=torch.int32, device=DEVICE)[::2]
    else:
        lens = torch.tensor([40], dtype=torch.int32, device=DEVICE).expand(2)
    assert not lens.is_contiguous()
    for backend in BACKENDS:
        with paths(variant) as seen:
            if variant == "dilated":
                run = lambda c: dilated_serve(q, k, v, [16, 32], [1, 2], causal=True, backend=backend,  # noqa
                                              cache_seqlens=c, return_lse=True)
            else:
                lay = layouts.local(64, 16, 1, causal=True)
                run = lambda c: block_sparse_serve(q, k, v, lay, causal=True, backend=backend,  # noqa
                                                   cache_seqlens=c, return_lse=True)
            got = run(lens)
        assert ("triton" if backend == "triton" else "portable") in seen, seen
        want = run(lens.contiguous())
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
