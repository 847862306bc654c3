"""indexed attention's custom ops (interface.py, serve.py): opcheck, torch.compile(fullgraph=True)
of the training door forward + backward against eager on both paths, and of the serve door over
three cache_seqlens values without a recompile."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from tests.helpers.indexed_checks import make_inputs, random_indices
from tests.helpers.reference import seeded
from triton_dilated import indexed_attention, indexed_attention_with_kvcache
from triton_dilated.ops.indexed import interface
from triton_dilated.ops.indexed.indices import canonical_slots

PATHS = ("triton", "torch")


@pytest.mark.parametrize("path", PATHS)
def test_opcheck(path):
    q, k, v = make_inputs(1, 5, 12, 4, 2, 16, 8, torch.float32, 0)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    slots, count = canonical_slots(random_indices(1, 5, 12, 2, 6, 0), 5, 12, True)
    torch.library.opcheck(interface._indexed_fwd, (q, k, v, slots, count, 0.3, 0.0, path))
    out, lse, row_max, row_sum = interface._indexed_fwd(q.detach(), k.detach(), v.detach(), slots, count, 0.3, 0.0,
                                                        path)
    do, dlse = seeded(out.shape, torch.float32, 3), seeded(lse.shape, torch.float32, 4)
    torch.library.opcheck(interface._indexed_bwd, (do, dlse, q.detach(), k.detach(), v.detach(), out, row_max,
                                                   row_sum, slots, count, 0.3, 0.0, path))


@pytest.mark.parametrize("backend", PATHS)
def test_compile_fullgraph_training_door(backend):
    q, k, v = make_inputs(2, 6, 14, 4, 2, 16, 24, torch.float32, 1)
    inputs = tuple(x.requires_grad_() for x in (q, k, v))
    idx = random_indices(2, 6, 14, None, 8, 1)
    sinks = torch.tensor([0.2, -0.1, 0.0, 0.4])

    def fn(q, k, v):
        out, lse = indexed_attention(q, k, v, idx, causal=True, softcap=4.0, sinks=sinks, return_lse=True,
                                     backend=backend)
        return out.square().sum() + torch.where(torch.isinf(lse), 0, lse).sum() * 0.1

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    expected, got = fn(*inputs), compiled(*inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(expected, inputs), torch.autograd.grad(got, inputs)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", PATHS)
@pytest.mark.parametrize("paged", [False, True])
def test_compile_serve_door_without_recompiling(backend, paged):
    B, Nk, Hq, Hkv, D = 2, 32, 4, 1, 16
    q = seeded((B, 1, Hq, D), torch.float32, 1)
    k_new, v_new = seeded((B, 1, Hkv, D), torch.float32, 2), seeded((B, 1, Hkv, 8), torch.float32, 3)
    idx = random_indices(B, 1, Nk, None, 10, 4)

    def step(q, kc, vc, k, v, lens, table):
        return indexed_attention_with_kvcache(q, kc, vc, idx, k, v, cache_seqlens=lens, block_table=table,
                                              return_lse=True, backend=backend)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for i, before in enumerate(([5, 30], [17, 9], [31, 0])):
        lens = torch.tensor(before, dtype=torch.int32)
        kc, vc = seeded((B, Nk, Hkv, D), torch.float32, 5 + i), seeded((B, Nk, Hkv, 8), torch.float32, 6 + i)
        table = None
        if paged:   # pages in reverse order
            kc, vc = kc.view(B * 4, 8, Hkv, D).flip(0).contiguous(), vc.view(B * 4, 8, Hkv, 8).flip(0).contiguous()
            table = torch.arange(B * 4 - 1, -1, -1, dtype=torch.int32).view(B, 4)
        kc2, vc2 = kc.clone(), vc.clone()
        got = compiled(q, kc, vc, k_new, v_new, lens, table)
        want = step(q, kc2, vc2, k_new, v_new, lens, table)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2), "the compiled append wrote the same rows"
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 3 cache_seqlens values"
