"""The lightning indexer (indexer_topk): its top-k against transformers' DeepseekV32Indexer
formula in float64 (ties aside: the selected scores are compared), both backends; memory
bounded by a chunk of queries; and the DSA recipe end to end (indexer -> indexed_attention)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.reference import seeded
from triton_dilated import indexed_attention, indexer_topk
from triton_dilated.ops.indexed import indexer as indexer_module

BACKENDS = ("triton", "torch")


def reference_scores(q, k, w, causal, scale=None):
    """transformers' formula in float64: (B, S, T), -inf past the query's position."""
    B, S, H, D = q.shape
    T = k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    logits = torch.einsum("bshd,btd->bsht", q.double(), k.double()) * scale
    scores = torch.einsum("bsh,bsht->bst", w.double(), logits.relu())
    if causal:
        pos = torch.arange(S) + T - S
        scores = scores.masked_fill(torch.arange(T)[None, :] > pos[:, None], float("-inf"))
    return scores


def check_topk(idx, vals, ref, top_k, tol):
    """Ties aside: the selected scores are the reference's top-k scores (sorted), each index's
    reference score is its returned score, and -1 marks exactly the slots past the visible keys."""
    B, S, T = ref.shape
    kept = min(top_k, T)
    want, _ = torch.topk(ref, kept, dim=-1)
    assert idx.shape == (B, S, top_k) and idx.dtype == torch.int32 and vals.dtype == torch.float32
    assert (idx[..., kept:] == -1).all() and torch.isneginf(vals[..., kept:]).all()
    idx, vals = idx[..., :kept], vals[..., :kept]
    assert torch.equal(idx == -1, torch.isneginf(want)), "-1 exactly where fewer keys are visible"
    fin = ~torch.isneginf(want)
    torch.testing.assert_close(vals[fin].double(), want[fin], atol=tol, rtol=tol)
    got_ref = ref.gather(-1, idx.clamp(min=0).long())
    torch.testing.assert_close(got_ref[fin], vals[fin].double(), atol=tol, rtol=tol)
    rows = [set(r[r >= 0].tolist()) for r in idx.reshape(-1, kept)]
    assert all(len(r) == int((row >= 0).sum()) for r, row in zip(rows, idx.reshape(-1, kept))), "no repeats"


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=10)
@given(B=st.integers(1, 2), S=st.integers(1, 9), extra=st.integers(0, 30), H=st.sampled_from([1, 3, 4, 20]),
       D=st.sampled_from([16, 32, 24]), top_k=st.integers(1, 40), causal=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 1000))
def test_topk_matches_the_reference(backend, B, S, extra, H, D, top_k, causal, dtype, seed):
    T = S + extra
    q = seeded((B, S, H, D), dtype, seed)
    k = seeded((B, T, D), dtype, seed + 1)
    w = seeded((B, S, H), torch.float32, seed + 2) * H ** -0.5
    idx, vals = indexer_topk(q, k, w, top_k, causal=causal, return_scores=True, backend=backend)
    tol = 1e-5 if dtype == torch.float32 else 1e-2   # bf16 inputs are exact in float32 products
    check_topk(idx, vals, reference_scores(q, k, w, causal), top_k, tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunks_of_queries_bound_memory_and_change_nothing(backend, monkeypatch):
    """Scores exist one chunk of queries at a time (at most SCORE_BUDGET of them), and the result
    does not depend on the chunking."""
    B, S, H, D, T = 2, 12, 4, 16, 40
    q, k = seeded((B, S, H, D), torch.float32, 1), seeded((B, T, D), torch.float32, 2)
    w = seeded((B, S, H), torch.float32, 3)
    whole = indexer_topk(q, k, w, 8, return_scores=True, backend=backend)
    seen = []
    if backend == "torch":
        real = indexer_module.indexer_scores_torch
        monkeypatch.setattr(indexer_module, "indexer_scores_torch",
                            lambda q_, *a: seen.append(q_.shape[1]) or real(q_, *a))
    else:
        kern = indexer_module._kernels()
        real = kern.indexer_scores
        monkeypatch.setattr(kern, "indexer_scores", lambda q_, *a: seen.append(q_.shape[1]) or real(q_, *a))
    monkeypatch.setattr(indexer_module, "SCORE_BUDGET", 5 * B * T * (H if backend == "torch" else 1))
    chunked = indexer_topk(q, k, w, 8, return_scores=True, backend=backend)
    assert seen == [5, 5, 2]
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert torch.equal(indexer_topk(q, k, w, 8, backend=backend, query_chunk=1), whole[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_dsa_recipe_indexer_then_attention(backend):
    """indexer -> indices -> indexed_attention equals attention under transformers' folded mask
    (top-k of the masked scores scattered into a boolean mask, and the causal mask)."""
    B, S, H, Hi, D, Di, top_k = 1, 16, 4, 2, 32, 16, 6
    q, k, v = (seeded((B, S, H, D), torch.float32, i) for i in range(3))
    qi, ki = seeded((B, S, Hi, Di), torch.float32, 4), seeded((B, S, Di), torch.float32, 5)
    w = seeded((B, S, Hi), torch.float32, 6)
    idx = indexer_topk(qi, ki, w, top_k, backend=backend)
    out = indexed_attention(q, k, v, idx, causal=True, backend=backend)
    scores = reference_scores(qi, ki, w, causal=True)
    top = torch.topk(scores, top_k, dim=-1).indices
    mask = torch.zeros(B, S, S, dtype=torch.bool).scatter(-1, top, True) & torch.ones(S, S, dtype=torch.bool).tril()
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    ref = torch.einsum("bhqk,bkhd->bqhd", s.masked_fill(~mask[:, None], float("-inf")).softmax(-1), v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_bad_input():
    q, k, w = torch.randn(1, 4, 2, 16), torch.randn(1, 6, 16), torch.randn(1, 4, 2)
    with pytest.raises(ValueError, match="k_idx must have 3 dimensions"):
        indexer_topk(q, k[:, :, None], w, 2)
    with pytest.raises(ValueError, match="weights must have shape"):
        indexer_topk(q, k, w[:, :, :1], 2)
    with pytest.raises(TypeError, match="share one dtype"):
        indexer_topk(q, k.half(), w, 2)
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        indexer_topk(q, k, w, 0)
    with pytest.raises(TypeError, match="top_k must be an int"):
        indexer_topk(q, k, w, 2.0)
