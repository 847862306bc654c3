"""Indexed attention (DESIGN §5c): both backends against the float64 oracle, forward and
backward, over random shapes, dtypes and index rows (unused, out-of-range and repeated slots,
causal cuts, shared and per-head rows, sinks, softcap); the semantics the oracle encodes,
checked independently (duplicates count once, bottom-right causal alignment, empty rows);
determinism; bad input."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.indexed_checks import check_indexed, make_inputs, random_indices
from tests.helpers.paths import ROOT
from triton_dilated import indexed_attention, indexed_attention_naive
from triton_dilated.ops.indexed.indices import canonical_slots, query_lists

BACKENDS = ("triton", "torch")


@st.composite
def cases(draw):
    Hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    Nk = draw(st.integers(1, 48))
    return dict(B=draw(st.integers(1, 2)), Nq=draw(st.integers(1, 12)), Nk=Nk, Hq=Hkv * group, Hkv=Hkv,
                D=draw(st.sampled_from([8, 16, 24, 32])), Dv=draw(st.sampled_from([8, 16, 40])),
                topk=draw(st.integers(1, 40)), shared=draw(st.booleans()), causal=draw(st.booleans()),
                softcap=draw(st.sampled_from([None, None, 3.0])), sinks=draw(st.booleans()),
                dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16])),
                seed=draw(st.integers(0, 10 ** 6)))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=12)
@given(case=cases())
def test_matches_oracle(backend, case):
    c = case
    q, k, v = make_inputs(c["B"], c["Nq"], c["Nk"], c["Hq"], c["Hkv"], c["D"], c["Dv"], c["dtype"], c["seed"])
    idx = random_indices(c["B"], c["Nq"], c["Nk"], None if c["shared"] else c["Hkv"], c["topk"], c["seed"])
    sinks = torch.linspace(-1.0, 2.0, c["Hq"]) if c["sinks"] else None
    check_indexed(q, k, v, idx, causal=c["causal"], softcap=c["softcap"], sinks=sinks, backend=backend,
                  seed=c["seed"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_deepseek_shape_gqa_and_queries_at_the_end(backend, dtype):
    """Dqk 192, Dv 128 (non-absorbed MLA), 4 query heads per kv head, Nq < Nk with causal
    cuts (the indexer's top-k lists future keys for early queries)."""
    B, Nq, Nk, Hq, Hkv = 1, 6, 40, 8, 2
    q, k, v = make_inputs(B, Nq, Nk, Hq, Hkv, 192, 128, dtype, 7)
    idx = random_indices(B, Nq, Nk, Hkv, 24, 7, unused=0.1, out_of_range=0.0)
    check_indexed(q, k, v, idx, causal=True, backend=backend, scale=0.1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_heads_per_kv_head_take_several_head_tiles(backend):
    """MQA with 80 query heads: more than one BLOCK_H tile of heads per kv head."""
    q, k, v = make_inputs(1, 3, 20, 80, 1, 16, 16, torch.float32, 3)
    idx = random_indices(1, 3, 20, None, 10, 3)
    check_indexed(q, k, v, idx, causal=False, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_repeated_index_counts_once(backend):
    """A row is a set of keys: [3, 3, 5] gives what [3, 5, -1] gives (transformers' dense-mask
    folding), not a double weight on key 3 (FlashMLA's gather)."""
    q, k, v = make_inputs(1, 2, 8, 2, 1, 16, 16, torch.float32, 1)
    rep = torch.tensor([[[3, 3, 5, 3], [7, -1, 7, 7]]], dtype=torch.int32)
    once = torch.tensor([[[3, 5, -1, -1], [7, -1, -1, -1]]], dtype=torch.int32)
    a = indexed_attention(q, k, v, rep, return_lse=True, backend=backend)
    b = indexed_attention(q, k, v, once, return_lse=True, backend=backend)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    w = torch.softmax(torch.einsum("d,td->t", q[0, 0, 0], k[0, [3, 5], 0]) * 16 ** -0.5, 0)
    torch.testing.assert_close(a[0][0, 0, 0], w @ v[0, [3, 5], 0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_every_key_listed_is_dense_attention_bottom_right(backend, causal):
    """Every row listing every key (in any order) is dense attention; with causal=True the
    bottom-right causal mask of flash-attn (query i at position i + Nk - Nq): an independent
    check of the causal alignment, through torch's scaled_dot_product_attention."""
    B, Nq, Nk, Hq, Hkv, D = 2, 5, 13, 4, 2, 16
    q, k, v = make_inputs(B, Nq, Nk, Hq, Hkv, D, D, torch.float32, 5)
    idx = torch.stack([torch.randperm(Nk, generator=torch.Generator().manual_seed(i)) for i in range(B * Nq)])
    idx = idx.view(B, Nq, Nk).to(torch.int32)
    out, lse = indexed_attention(q, k, v, idx, causal=causal, return_lse=True, backend=backend)
    mask = torch.ones(Nq, Nk, dtype=torch.bool).tril(Nk - Nq) if causal else None
    kk, vv = (x.repeat_interleave(Hq // Hkv, dim=2).transpose(1, 2) for x in (k, v))
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)
    s = torch.einsum("bqhd,bhkd->bhqk", q, kk) * D ** -0.5
    if causal:
        s = s.masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows_and_queries_before_the_first_key(backend):
    """A row whose slots are all unused (-1, out of range, or in the future under causal; with
    Nq > Nk the first queries sit before position 0) gives 0 and lse -inf, zero gradients;
    with sinks lse = the head's sink."""
    B, Nq, Nk, Hq, Hkv = 1, 6, 4, 2, 1
    q, k, v = make_inputs(B, Nq, Nk, Hq, Hkv, 16, 8, torch.float32, 2)
    idx = torch.tensor([[[-1, -1], [9, -5], [3, 3], [0, 1], [2, -1], [3, 0]]], dtype=torch.int32)
    got, _ = check_indexed(q, k, v, idx, causal=True, backend=backend)
    lse = got[1]
    # query i at position i - 2: rows 0 and 1 list no key in range, row 2 (position 0) only key 3
    assert torch.isneginf(lse[0, :, :3]).all() and torch.isfinite(lse[0, :, 3:]).all()
    sinks = torch.tensor([0.5, -1.0])
    out, lse = indexed_attention(q, k, v, idx, causal=True, sinks=sinks, return_lse=True, backend=backend)
    assert (out[0, :3] == 0).all() and torch.equal(lse[0, :, :3], sinks[:, None].expand(2, 3))
    check_indexed(q, k, v, idx, causal=True, sinks=sinks, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unused_slots_never_read(backend):
    """k and v are views into buffers whose rows around them hold NaN: a slot -1, Nk or beyond
    that read memory would bring NaN into the output (or crash)."""
    B, Nq, Nk, H, D = 1, 4, 6, 2, 16
    kbuf = torch.full((B, Nk + 40, H, D), float("nan"))
    vbuf = torch.full((B, Nk + 40, H, D), float("nan"))
    kbuf[:, 20:20 + Nk] = torch.randn(B, Nk, H, D)
    vbuf[:, 20:20 + Nk] = torch.randn(B, Nk, H, D)
    k, v = kbuf[:, 20:20 + Nk], vbuf[:, 20:20 + Nk]
    q = torch.randn(B, Nq, H, D, requires_grad=True)
    idx = torch.tensor([[[-1, 0, Nk], [-20, 5, Nk + 19], [-2 ** 31, 2 ** 31 - 1, 2], [-1, -1, -1]]],
                       dtype=torch.int32)
    out, lse = indexed_attention(q, k, v, idx, return_lse=True, backend=backend)
    assert not out.isnan().any() and not lse.isnan().any()
    (out.sum() + lse[:, :, :3].sum()).backward()
    assert torch.isfinite(q.grad).all()


OUT_OF_RANGE = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from triton_dilated import indexed_attention
q, k, v = (torch.randn(1, 3, 2, 16, requires_grad=True) for _ in range(3))
idx = torch.tensor([[[-2**31, 2**31 - 1, 1], [3, 1 << 30, -(1 << 30)], [-1, 2, 5000000]]], dtype=torch.int32)
out, lse = indexed_attention(q, k, v, idx, return_lse=True, backend="triton")
(out.sum() + lse.sum()).backward()
assert torch.isfinite(out).all() and torch.isfinite(k.grad).all()
print("OK")
"""


def test_out_of_range_indices_neither_crash_nor_read_in_a_subprocess():
    """The interpreter does not bounds-check: an unmasked wild read would abort the process."""
    proc = subprocess.run([sys.executable, "-c", OUT_OF_RANGE], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-3000:]


def test_triton_backward_is_bitwise_deterministic():
    q, k, v = make_inputs(1, 10, 16, 4, 2, 16, 24, torch.float32, 11)
    idx = random_indices(1, 10, 16, 2, 12, 11)
    runs = []
    for _ in range(2):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse = indexed_attention(*leaves, idx, return_lse=True, backend="triton")
        (out.square().sum() + lse.nan_to_num(0.0, 0.0, 0.0).sum()).backward()
        runs.append([out, lse] + [x.grad for x in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_canonical_slots_and_query_lists():
    """The lists every path reads: used keys once, ascending, first; their inverse by key."""
    idx = torch.tensor([[[5, -1, 2, 5, 9], [0, 0, 0, 1, 3]]], dtype=torch.int32)   # B 1, Nq 2, shared
    slots, count = canonical_slots(idx, 2, 6, causal=True)    # query positions 4, 5
    assert slots.tolist() == [[[[2, -1, -1, -1, -1]], [[0, 1, 3, -1, -1]]]] and count.tolist() == [[[1], [3]]]
    start, queries = query_lists(slots, 6)
    lists = [queries[start[t]:start[t + 1]].tolist() for t in range(6)]
    assert lists == [[1], [1], [0], [1], [], []]   # key 5 is past query 0's position 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_absorbed_mla_head_dims(backend):
    """Dqk 576, Dv 512, one kv head for every query head (the absorbed-MLA shape), forward and
    backward."""
    q, k, v = make_inputs(1, 3, 10, 16, 1, 576, 512, torch.float32, 4)
    idx = random_indices(1, 3, 10, None, 6, 4)
    check_indexed(q, k, v, idx, causal=True, backend=backend, scale=0.05)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_shapes(backend):
    for Nq, Nk, topk in ((0, 5, 3), (3, 0, 2), (3, 5, 0)):
        q, k, v = (torch.randn(1, n, 2, d, requires_grad=True) for n, d in ((Nq, 16), (Nk, 16), (Nk, 8)))
        idx = torch.zeros(1, Nq, topk, dtype=torch.int32)
        out, lse = indexed_attention(q, k, v, idx, return_lse=True, backend=backend)
        assert out.shape == (1, Nq, 2, 8) and lse.shape == (1, 2, Nq) and torch.isneginf(lse).all()
        out.sum().backward()
        assert q.grad.shape == q.shape and (q.grad == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_a_listed_key_reaches_only_its_rows(backend):
    q, k, v = make_inputs(1, 3, 6, 2, 1, 16, 16, torch.float32, 9)
    k = k.clone()
    k[0, 4] = float("nan")
    idx = torch.tensor([[[4, 1], [1, 2], [-1, 3]]], dtype=torch.int32)
    out, lse = indexed_attention(q, k, v, idx, return_lse=True, backend=backend)
    assert out[0, 0].isnan().all() and lse[0, :, 0].isnan().all()
    assert torch.isfinite(out[0, 1:]).all() and torch.isfinite(lse[0, :, 1:]).all()


def test_bad_input_raises_clearly():
    q, k, v = make_inputs(1, 4, 6, 4, 2, 16, 8, torch.float32, 0)
    idx = torch.zeros(1, 4, 2, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="indices must be an int32"):
        indexed_attention(q, k, v, idx.float())
    with pytest.raises(TypeError, match="indices must be an int32 tensor"):
        indexed_attention(q, k, v, [[0]])
    with pytest.raises(ValueError, match="indices must have shape"):
        indexed_attention(q, k, v, idx[:, :3])
    with pytest.raises(ValueError, match="indices must have shape"):
        indexed_attention(q, k, v, torch.zeros(1, 4, 4, 3, dtype=torch.int32))   # Hq rows, not Hkv
    with pytest.raises(ValueError, match="head dim of q"):
        indexed_attention(q, k[..., :8], v, idx)
    with pytest.raises(ValueError, match="v must have the length"):
        indexed_attention(q, k, v[:, :5], idx)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        indexed_attention(q[:, :, :3], k, v, idx)
    with pytest.raises(TypeError, match="share one dtype"):
        indexed_attention(q, k.half(), v, idx)
    with pytest.raises(TypeError, match="causal must be a bool"):
        indexed_attention(q, k, v, idx, causal=1)
    with pytest.raises(ValueError, match="softcap"):
        indexed_attention(q, k, v, idx, softcap=-1.0)
    with pytest.raises(ValueError, match="sinks must have shape"):
        indexed_attention(q, k, v, idx, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="backend must be one of"):
        indexed_attention(q, k, v, idx, backend="cuda")
    for bad in (6, -2, 2 ** 31 - 1):
        wild = idx.clone()
        wild[0, 1, 1, 2] = bad
        with pytest.raises(ValueError, match=r"indices must be -1 \(unused\) or in \[0, Nk\)"):
            indexed_attention(q, k, v, wild, validate=True)
        indexed_attention(q, k, v, wild)   # without validate: an unused slot
    ok = idx.clone()
    ok[0, 0, 0, 0] = -1
    indexed_attention(q, k, v, ok, validate=True)


def test_naive_is_the_oracle_of_a_plain_gather():
    """The oracle against a per-row loop over sets of keys (independent of the dense mask)."""
    q, k, v = make_inputs(2, 4, 9, 4, 2, 8, 12, torch.float64, 8)
    idx = random_indices(2, 4, 9, 2, 6, 8)
    out, lse = indexed_attention_naive(q, k, v, idx, causal=True, scale=0.3)
    for b in range(2):
        for i in range(4):
            for h in range(4):
                keys = sorted({int(t) for t in idx[b, i, h // 2] if 0 <= t < 9 and t <= i + 5})
                if not keys:
                    assert torch.isneginf(lse[b, h, i]) and (out[b, i, h] == 0).all()
                    continue
                s = k[b, keys, h // 2] @ q[b, i, h] * 0.3
                torch.testing.assert_close(out[b, i, h], torch.softmax(s, 0) @ v[b, keys, h // 2])
                torch.testing.assert_close(lse[b, h, i], torch.logsumexp(s, 0))


def test_portable_chunks_change_nothing(monkeypatch):
    """The portable path in chunks of queries (each checkpointed: its backward recomputes its
    gathers) gives the one-chunk result, forward and backward."""
    from triton_dilated.ops.indexed import portable
    q, k, v = make_inputs(2, 9, 20, 4, 2, 16, 8, torch.float32, 12)
    idx = random_indices(2, 9, 20, 2, 7, 12)

    def run():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse = indexed_attention(*leaves, idx, causal=True, return_lse=True, backend="torch")
        (out.square().sum() + lse.nan_to_num(0.0, 0.0, 0.0).sum()).backward()
        return [out, lse] + [x.grad for x in leaves]

    whole = run()
    monkeypatch.setattr(portable, "GATHER_BUDGET", 2 * 2 * 7 * (16 + 8 + 2))   # two queries a chunk
    for a, b in zip(run(), whole):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
