"""The variant's spec (what perf aot, tune and bench read): the pair count is the dense mask's,
and the problem factory's launches compute the oracle's attention."""
from __future__ import annotations

import torch

from tests.helpers.indexed_checks import random_indices
from triton_dilated import indexed_attention_naive
from triton_dilated.ops.indexed.indices import dense_mask
from triton_dilated.ops.indexed.spec import SPEC, IndexedProblem


def test_pairs_are_the_dense_masks():
    for rows, causal in ((None, True), (2, False), (2, True)):
        idx = random_indices(2, 20, 20, rows, 9, 3)
        assert SPEC.pairs(2, 20, 4, causal, indices=idx) == int(dense_mask(idx, 20, 20, 4, causal).sum())
    assert SPEC.flops(2, 20, 4, 16, True, indices=idx) == 4 * 16 * int(dense_mask(idx, 20, 20, 4, True).sum())


def test_problem_launches_compute_the_attention():
    p = IndexedProblem(1, 24, 2, 16, torch.float32, torch.device("cpu"), True, topk=6, head_dim_v=8)
    out, row_max, row_sum = p.forward()
    ref, _ = indexed_attention_naive(p.q, p.k, p.v, p.indices, causal=True)
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
    dq, dk, dv = p.backward()
    assert dq.shape == p.q.shape and dk.shape == p.k.shape and dv.shape == p.v.shape
    assert SPEC.call(p.q, p.k, p.v, causal=True, indices=p.indices).shape == (1, 24, 2, 8)
    assert [k.name for k in SPEC.kernels] == ["indexed_fwd", "indexed_bwd_dq", "indexed_bwd_dkdv", "indexer_scores"]
    assert all(callable(k.load()) or hasattr(k.load(), "fn") for k in SPEC.kernels)
