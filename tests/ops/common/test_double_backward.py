"""Double backward (DESIGN §6: correct or a clear error, never a silently dropped term).

The Triton paths of dilated_attention and block_sparse_attention (the GPU default; under
the interpreter on a CPU) and ring_attention compute gradients with their own kernels,
which have no derivative of their own. With create_graph=True and a second backward
through those gradients (gradient penalties, MAML), they used to return the first
derivative as if it were a constant, dropping the attention's second-order term. Now the
second backward raises; first-order gradients with create_graph=True are unchanged.
"""
from __future__ import annotations

import re

import pytest
import torch
from tests.conftest import DEVICE
from tests.helpers.ring_faults_worker import run_world

from triton_dilated import block_sparse_attention, dilated_attention, layouts

MESSAGE = "double backward (differentiating gradients taken with create_graph=True) is not supported"


def _triton_call(variant):
    if variant == "dilated":
        return lambda q, k, v: dilated_attention(q, k, v, [16, 64], [1, 2], causal=True, backend="triton")
    lay = layouts.local(64, 16, 1)
    return lambda q, k, v: block_sparse_attention(q, k, v, lay, causal=True, backend="triton")


@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
def test_triton_path_double_backward_raises(variant):
    attn = _triton_call(variant)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    plain = torch.autograd.grad((attn(q, k, v) ** 2).sum(), (q, k, v))
    grads = torch.autograd.grad((attn(q, k, v) ** 2).sum(), (q, k, v), create_graph=True)
    for a, b in zip(plain, grads):          # first order: the same gradients
        assert torch.equal(a, b)
    penalty = sum((x ** 2).sum() for x in grads) + (q ** 3).sum()     # depends on q directly too
    with pytest.raises(RuntimeError, match=re.escape(MESSAGE)) as info:
        torch.autograd.grad(penalty, (q,), retain_graph=True)     # asked for q only: still reached
    assert f"{variant}_attention (Triton path)" in str(info.value)
    with pytest.raises(RuntimeError, match=re.escape(MESSAGE)):
        penalty.backward()


@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
def test_create_graph_without_a_second_backward_still_works(variant):
    """create_graph=True used for another term of the loss: the attention's gradients are
    never differentiated again, so nothing raises and the other term's derivative is right."""
    attn = _triton_call(variant)
    q, k, v = (torch.randn(1, 64, 2, 16).to(DEVICE).requires_grad_() for _ in range(3))
    gq, = torch.autograd.grad((attn(q, k, v) ** 2).sum() + (q ** 3).sum(), (q,), create_graph=True)
    x = torch.randn_like(q, requires_grad=True)
    second, = torch.autograd.grad((x * gq.detach()).sum() + (x ** 2).sum(), (x,))
    assert torch.allclose(second, gq.detach() + 2 * x)


@pytest.fixture(scope="module")
def ring_results():
    return run_world(2, [("p2p", dict(kind="double_backward", comm="p2p")),
                         ("allgather", dict(kind="double_backward", comm="allgather"))])


@pytest.mark.parametrize("comm", ["p2p", "allgather"])
@pytest.mark.gloo
def test_ring_double_backward_raises_on_every_rank(ring_results, comm):
    assert sorted(ring_results) == [0, 1], ring_results
    for rank, (status, payload) in ring_results.items():
        assert status == "ok", (rank, payload)
        diff, error = payload[comm]
        assert diff == 0.0, (rank, diff)       # first-order gradients unchanged by create_graph
        assert error is not None and error.startswith(f"ring_attention: {MESSAGE}"), (rank, error)
