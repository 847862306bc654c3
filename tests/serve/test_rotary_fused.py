"""Rotary fused into the Triton append (issue 33 item 1): on the Triton path without gradients
the serve doors' rotary_cos / rotary_sin rotate the appended k inside the append kernel and the
same launch writes the rotated q (decode_kernels._append_rows_kernel, rotate_row); the PyTorch
rotation (kvcache.rotate) does not run. Checked under the Triton interpreter:

* the fused route equals the PyTorch route (the door on q, k rotated by kvcache.apply_rotary)
  bit for bit: out, lse and the cache after the append, paged and contiguous, an FP8 cache
  (rotated, then quantised), cache_leftpad, GQA, interleaved and GPT-NeoX pairs, rotary_dim < D,
  causal or not, a decode step and chunked prefill, float32 and float16;
* the appended rows against a float64 rotation written in the test, and out / lse against the
  float64 oracle on the reference-rotated inputs;
* the append launcher alone: strided q, k broadcast over the batch (stride 0), positions past
  the tables (their last row), a negative length (no row written), a bfloat16 table;
* no host sync, one torch.compile(fullgraph=True) frame for several cache_seqlens (the custom
  op triton_dilated::append_rotary), gradients (the PyTorch route, recorded by autograd).
"""
from __future__ import annotations

import pytest
import torch

from triton_dilated import layouts
from triton_dilated.ops.common import kvcache
from triton_dilated.ops.common.decode_kernels import AppendLaunch
from tests.conftest import DEVICE
from tests.helpers.reference import FLOOR, seeded
from tests.helpers.serve_checks import (check_forward, int32_lengths, nan_past_lengths, no_host_sync, page_pools,
                                        rotary_reference, serve_doors, unpage)

FP8 = torch.float8_e4m3fn
WS, RS = [8, 16, 48], [1, 2, 4]
NK, HQ, HKV, D = 64, 4, 2, 8


def _door(variant):
    """(fn(q, kc, vc, k, v, **kw), oracle(causal)) of a variant (small dilated schedule, or a
    local + random block layout of 16-row blocks)."""
    lay = layouts.local(NK, 16, 1, causal=True) | layouts.random(NK, 16, num_random=1, seed=2, num_heads=HQ)
    lay = lay.to(DEVICE)
    return serve_doors(variant, WS, RS, lay)


def _cache(rows, lengths, seed):
    return nan_past_lengths(rows, lengths, seed, (NK, HKV, D))


def _tables(rotary_dim, rows=NK, dtype=torch.float32):
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(rotary_dim // 2) /
                                                                            (rotary_dim // 2))
    return angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)


@pytest.fixture
def pytorch_rotation_refused(monkeypatch):
    """kvcache.rotate (the PyTorch route) raises while set: a call that passes took the fused one.
    `allow()` puts it back (for the reference calls)."""
    original = kvcache.rotate

    def refuse(*args, **kwargs):
        raise AssertionError("the PyTorch rotation ran on the fused route")

    class Switch:
        def refuse(self):
            monkeypatch.setattr(kvcache, "rotate", refuse)

        def allow(self):
            monkeypatch.setattr(kvcache, "rotate", original)
    return Switch()


# case: (nq, interleaved, rotary_dim, causal, paged, leftpad, fp8, dtype)
CASES = {
    "decode-interleaved-full": (1, True, D, True, False, False, False, torch.float32),
    "paged-neox-partial-draft": (3, False, 6, True, True, False, False, torch.float32),
    "leftpad-noncausal-interleaved-partial": (2, True, 6, False, False, True, False, torch.float32),
    "fp8-paged-neox": (2, False, D, True, True, False, True, torch.float32),
    "fp8-leftpad-interleaved-partial": (1, True, 4, True, False, True, True, torch.float32),
    "prefill-18-neox-partial": (18, False, 6, True, False, False, False, torch.float32),
    "float16-paged-interleaved": (2, True, 6, False, True, False, False, torch.float16),
}


@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_rotary_equals_the_pytorch_route(variant, case, pytorch_rotation_refused):
    """Three batch rows (GQA 4/2 heads, D = 8), two new rows each: the fused call's out, lse and
    caches equal those of the door on q, k rotated by apply_rotary beforehand, bit for bit,
    with the PyTorch rotation refused during the fused call; the appended rows equal a float64
    rotation (complex products) to the dtype's rounding (or, FP8, the quantised reference
    the float64 rotation to e4m3's rounding); without leftpad and FP8, out and lse meet the float64 oracle."""
    nq, interleaved, rotary_dim, causal, paged, leftpad, fp8, dtype = CASES[case]
    fn, oracle = _door(variant)
    before, pads = [20, 33, 17], [0, 5, 2]   # every row holds >= 18 keys (the oracle places 18 queries)
    kc, vc = (x.to(dtype) for x in _cache(3, before, seed=80))
    q = seeded((3, nq, HQ, D), dtype, 81, DEVICE)
    k_new, v_new = (seeded((3, 2, HKV, D), dtype, s, DEVICE) for s in (82, 83))
    cos, sin = _tables(rotary_dim)
    lens = int32_lengths(before)
    kw = dict(cache_seqlens=lens, causal=causal, return_lse=True, backend="triton",
              cache_leftpad=int32_lengths(pads) if leftpad else None)
    if fp8:
        descale = torch.tensor([0.02, 0.03], device=DEVICE)
        kc, vc = (x.div(descale[:, None]).to(FP8) for x in (kc, vc))
        kw.update(k_descale=descale, v_descale=descale * 1.5)
    table = None
    if paged:
        kc, vc, table = page_pools(kc, vc, 16, seed=84)
        kw.update(block_table=table)
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()

    pytorch_rotation_refused.refuse()
    got = fn(q, kc1, vc1, k_new, v_new, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved, **kw)
    pytorch_rotation_refused.allow()
    q_rot, k_rot = kvcache.apply_rotary(q, k_new, lens, cos, sin, interleaved, causal)
    want = fn(q_rot, kc2, vc2, k_rot, v_new, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    bits = (lambda x: x.view(torch.uint8)) if fp8 else (lambda x: x)
    torch.testing.assert_close((bits(kc1), bits(vc1)), (bits(kc2), bits(vc2)), rtol=0, atol=0, equal_nan=True)

    # independent of apply_rotary: the rows the append wrote, and the attention over them
    start = torch.tensor(before)[:, None]
    k_ref = rotary_reference(k_new.double(), cos, sin, start + torch.arange(2), interleaved).to(DEVICE)
    rows = unpage(kc1, table) if paged else kc1
    written = torch.stack([rows[b, n:n + 2] for b, n in enumerate(before)])
    if fp8:   # e4m3 rounding: relative 2^-4 for normals, absolute 2^-10 below 2^-6
        torch.testing.assert_close(written.double(), k_ref / descale.double()[:, None], rtol=2 ** -4, atol=2 ** -10)
    else:
        torch.testing.assert_close(written.double(), k_ref, rtol=0, atol=4 * FLOOR[dtype])
    if not (leftpad or fp8):
        q_pos = start + (torch.arange(nq) if causal else torch.zeros(nq, dtype=torch.long))
        q_ref = rotary_reference(q.double(), cos, sin, q_pos, interleaved).to(DEVICE, dtype)
        v_rows = unpage(vc1, table) if paged else vc1
        check_forward(got[0], got[1], q_ref, rows.to(dtype), v_rows.to(dtype), [n + 2 for n in before],
                      oracle(causal))


@pytest.mark.parametrize("interleaved", [True, False])
def test_append_launch_rotates_strided_and_broadcast_rows(interleaved, pytorch_rotation_refused):
    """AppendLaunch alone against apply_rotary + append_rows, bit for bit, and its q against a
    float64 rotation: q a strided view
    (rows of a wider tensor), k and v broadcast over the batch (stride 0), rotary_dim 6 of 8
    from bfloat16 tables of 24 rows (positions past them read the last row), a batch row with a
    negative length (writes nothing; its queries rotate at position 0, as apply_rotary
    clamps), non-causal query positions; q is not modified and the rotated q is contiguous."""
    B, nq = 4, 3
    q_wide = seeded((B, nq, HQ + 2, D), torch.float32, 90, DEVICE)
    q = q_wide[:, :, 1:HQ + 1]
    k_new, v_new = (seeded((1, 2, HKV, D), torch.float32, s, DEVICE).expand(B, -1, -1, -1) for s in (91, 92))
    kc, vc = (seeded((B, NK, HKV, D), torch.float32, s, DEVICE) for s in (93, 94))
    lens = int32_lengths([3, 22, -2, 30])
    cos, sin = (x.to(torch.bfloat16) for x in _tables(6, rows=24))
    for causal in (True, False):
        rotary = kvcache.Rotary(cos, sin, interleaved, causal)
        kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        q_before = q.clone()
        pytorch_rotation_refused.refuse()
        q_rot = AppendLaunch(kc1, k_new).run(kc1, vc1, k_new, v_new, kvcache.kernel_lengths(lens, DEVICE), q=q,
                                             rotary=rotary)
        pytorch_rotation_refused.allow()
        q_want, k_want = kvcache.apply_rotary(q, k_new, lens, cos, sin, interleaved, causal)
        kvcache.append_rows(kc2, vc2, k_want, v_new, lens)
        assert q_rot.is_contiguous() and torch.equal(q, q_before)
        torch.testing.assert_close(q_rot, q_want, rtol=0, atol=0)
        q_pos = lens.long().cpu()[:, None] + (torch.arange(nq) if causal else torch.zeros(nq, dtype=torch.long))
        torch.testing.assert_close(q_rot.double(), rotary_reference(q, cos, sin, q_pos, interleaved)
                                   .double().to(DEVICE), rtol=0, atol=1e-5)   # float64 rotation, clamped rows
        torch.testing.assert_close((kc1, vc1), (kc2, vc2), rtol=0, atol=0)
        assert torch.equal(kc1[2], kc[2])   # the negative length wrote nothing
        assert not torch.equal(q_rot[3], q[3])   # position 30 clamps to the table's last row, 23: rotated


@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
def test_fused_rotary_without_host_sync_and_compiled_once(variant, pytorch_rotation_refused):
    """A decode step with rotary (and cache_leftpad) on the Triton path runs under the
    no-host-sync guard, equal to the unguarded call and to the PyTorch route; torch.compile(fullgraph=True) serves three
    cache_seqlens with one frame (the append as the custom op triton_dilated::append_rotary),
    equal to eager; the PyTorch rotation never runs."""
    from torch._dynamo.testing import CompileCounterWithBackend

    fn, _ = _door(variant)
    q = seeded((2, 1, HQ, D), torch.float32, 1, DEVICE)
    k_new, v_new = (seeded((2, 1, HKV, D), torch.float32, s, DEVICE) for s in (2, 3))
    kc, vc = (seeded((2, NK, HKV, D), torch.float32, s, DEVICE) for s in (4, 5))
    cos, sin = _tables(6)
    lens, pads = int32_lengths([20, 33]), int32_lengths([3, 0])
    pytorch_rotation_refused.refuse()

    def step(q, kc, vc, k, v, lens):
        return fn(q, kc, vc, k, v, cache_seqlens=lens, cache_leftpad=pads, rotary_cos=cos, rotary_sin=sin,
                  rotary_interleaved=False, return_lse=True, backend="triton")

    kc2, vc2 = kc.clone(), vc.clone()
    step(q, kc2.clone(), vc2.clone(), k_new, v_new, lens)   # warm-up (plans)
    with no_host_sync():
        out = step(q, kc, vc, k_new, v_new, lens)
    torch.testing.assert_close(out, step(q, kc2, vc2, k_new, v_new, lens), rtol=0, atol=0)
    torch.testing.assert_close((kc, vc), (kc2, vc2), rtol=0, atol=0)
    pytorch_rotation_refused.allow()   # and the PyTorch route's result
    q_rot, k_rot = kvcache.apply_rotary(q, k_new, lens, cos, sin, False, True)
    kc3, vc3 = (seeded((2, NK, HKV, D), torch.float32, s, DEVICE) for s in (4, 5))
    want = fn(q_rot, kc3, vc3, k_rot, v_new, cache_seqlens=lens, cache_leftpad=pads, return_lse=True, backend="triton")
    torch.testing.assert_close((out, kc, vc), (want, kc3, vc3), rtol=0, atol=0)
    pytorch_rotation_refused.refuse()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for before in ([5, 30], [17, 9], [46, 0]):
        kc, vc = (seeded((2, NK, HKV, D), torch.float32, s, DEVICE) for s in (6, 7))
        kc2, vc2 = kc.clone(), vc.clone()
        got = compiled(q, kc, vc, k_new, v_new, int32_lengths(before))
        torch.testing.assert_close(got, step(q, kc2, vc2, k_new, v_new, int32_lengths(before)), rtol=0, atol=0)
        torch.testing.assert_close((kc, vc), (kc2, vc2), rtol=0, atol=0)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 3 cache_seqlens values"


def test_rotary_with_gradients_takes_the_pytorch_route():
    """With q requiring grad the Triton path rotates in PyTorch (autograd records it): out and
    dq equal the portable path's (whose rotation is the same PyTorch code) to float32 rounding."""
    fn, _ = _door("dilated")
    before = [20, 33]
    q0 = seeded((2, 2, HQ, D), torch.float32, 11, DEVICE)
    k_new, v_new = (seeded((2, 2, HKV, D), torch.float32, s, DEVICE) for s in (12, 13))
    kc, vc = (seeded((2, NK, HKV, D), torch.float32, s, DEVICE) for s in (14, 15))
    cos, sin = _tables(6)
    results = []
    for backend in ("triton", "torch"):
        q = q0.clone().requires_grad_(True)
        out = fn(q, kc.clone(), vc.clone(), k_new, v_new, cache_seqlens=int32_lengths(before), rotary_cos=cos,
                 rotary_sin=sin, backend=backend)
        (dq,) = torch.autograd.grad((out * seeded(out.shape, torch.float32, 16, DEVICE)).sum(), q)
        results.append((out.detach(), dq))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)
    assert results[0][1].abs().sum() > 0
