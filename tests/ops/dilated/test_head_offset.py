"""head_offset / total_heads (issue 22 item 1): a call on the query heads [h0, h0 + Hq) of a
call with total_heads heads equals that head slice of the full call, forward and backward,
on both backends, both offset rules and head groups, causal or not, GQA; and the float64
oracle with the same arguments. The oracle's own slice is checked against the slice of its
full call (the definition of the offsets by global head index)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from triton_dilated import dilated_attention, dilated_attention_naive, dilated_attention_op
from triton_dilated.ops.dilated.naive import dilated_multiplicity
from tests.conftest import DEVICE
from tests.helpers.reference import FLOOR, check_against_oracle, dense_reference, dilated_serve, finite, max_err, seeded

SCHEMES = [("longnet", "modulo"), ("longnet", "blocked"), ("head_groups", "modulo")]


def full_and_slices(H, Hkv, group_slices):
    """Every slice [h0, h0 + size) of H heads whose ends fall on GQA group boundaries."""
    g = H // Hkv
    return [(h0, size) for h0 in range(0, H, g) for size in range(g, H - h0 + 1, g)][:group_slices]


def check_slice(backend, N, H, Hkv, D, ws, rs, h0, size, *, causal, mode, offsets, seed=0, full_check=True):
    """The slice call against the oracle (tolerance rule, out, lse and gradients through
    both) and against the same slice of the full call (out, lse, and the gradients of a loss
    on the slice's outputs only)."""
    g = H // Hkv
    q = seeded((1, N, H, D), torch.float32, seed, DEVICE)
    k = seeded((1, N, Hkv, D), torch.float32, seed + 1, DEVICE)
    v = seeded((1, N, Hkv, D), torch.float32, seed + 2, DEVICE)
    hs, ks = slice(h0, h0 + size), slice(h0 // g, (h0 + size) // g)
    kw = dict(causal=causal, mode=mode, offsets=offsets)
    sl = dict(head_offset=h0, total_heads=H)
    counts = dilated_multiplicity(N, ws, rs, H, **kw)[hs]
    inputs = (q[:, :, hs].contiguous(), k[:, :, ks].contiguous(), v[:, :, ks].contiguous())
    res = check_against_oracle(
        lambda q, k, v: dilated_attention(q, k, v, ws, rs, return_lse=True, backend=backend, **kw, **sl),
        lambda q, k, v: dilated_attention_naive(q, k, v, ws, rs, **kw, **sl),
        lambda q, k, v: dense_reference(q, k, v, counts),
        inputs, counts=counts, seed=seed + 3)
    if not full_check:
        return
    # the oracle's slice is the slice of the oracle's full call
    full64 = dilated_attention_naive(q.double(), k.double(), v.double(), ws, rs, **kw)
    assert max_err(res.oracle[0], full64[0][:, :, hs]) <= 1e-12
    assert torch.equal(torch.isinf(res.oracle[1]), torch.isinf(full64[1][:, hs]))
    # the kernel's slice equals the slice of the kernel's full call, gradients included
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = dilated_attention(*leaves, ws, rs, return_lse=True, backend=backend, **kw)
    gout, glse = res.cotangents
    loss = (out[:, :, hs].double() * gout).sum() + (finite(lse[:, hs]).double() * glse).sum()
    dq, dk, dv = torch.autograd.grad(loss, leaves)
    assert (dq[:, :, :h0] == 0).all() and (dq[:, :, h0 + size:] == 0).all()
    got = res.got
    for name, a, b in (("out", got[0], out[:, :, hs]), ("lse", finite(got[1]), finite(lse[:, hs])),
                       ("dq", got[2], dq[:, :, hs]), ("dk", got[3], dk[:, :, ks]), ("dv", got[4], dv[:, :, ks])):
        assert max_err(a, b) <= 1e-5 * max(1.0, b.abs().max().item()), f"{name}: slice differs from the full call"


@pytest.mark.parametrize("mode, offsets", SCHEMES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_slices_equal_the_full_call(mode, offsets, causal):
    """The Triton kernels (interpreter on CPU): H = 4, 2 kv heads, slices [2, 4) and [0, 2)
    of patterns whose offsets differ across the heads (r = 3 > 2 heads per slice)."""
    for h0 in (2, 0) if causal else (2,):
        check_slice("triton", 24, 4, 2, 8, [6, 24], [2, 3], h0, 2, causal=causal, mode=mode, offsets=offsets)


@pytest.mark.parametrize("mode, offsets", SCHEMES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@given(data=st.data())
def test_portable_slices_equal_the_full_call(mode, offsets, causal, data):
    Hkv = data.draw(st.integers(1, 3), label="Hkv")
    H = Hkv * data.draw(st.integers(1, 3), label="group")
    m = data.draw(st.integers(1, 3), label="patterns")
    rs = data.draw(st.lists(st.integers(1, 5), min_size=m, max_size=m), label="rs")
    ws = [max(w, r) for w, r in zip(data.draw(st.lists(st.integers(1, 40), min_size=m, max_size=m), label="ws"), rs)]
    h0, size = data.draw(st.sampled_from(full_and_slices(H, Hkv, 100)), label="slice")
    N = data.draw(st.integers(1, 40), label="N")
    # includes slices in which no query has a key (offsets past a tiny N): zero output, zero gradients
    check_slice("torch", N, H, Hkv, data.draw(st.sampled_from([4, 8]), label="D"), ws, rs, h0, size, causal=causal,
                mode=mode, offsets=offsets, seed=data.draw(st.integers(0, 1000), label="seed"))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_decode_and_custom_op_take_the_slice(backend):
    """The serve door's decode path (one query row) and query-offset path (chunked prefill: 17
    rows, past the decode path's 16), and the custom op, honour the slice too."""
    ws, rs, H = [4, 16], [2, 4], 4
    q, k, v = (seeded((1, 24, h, 8), torch.float32, s, DEVICE) for s, h in ((0, H), (1, 2), (2, 2)))
    kw = dict(causal=True, backend=backend)
    for rows in (1, 17):
        full = dilated_serve(q[:, -rows:], k, v, ws, rs, **kw)
        part = dilated_serve(q[:, -rows:, 2:], k[:, :, 1:], v[:, :, 1:], ws, rs, head_offset=2, total_heads=H, **kw)
        assert max_err(part, full[:, :, 2:]) <= 1e-6, rows
    full = dilated_attention(q, k, v, ws, rs, **kw)
    part = dilated_attention_op(q[:, :, 2:], k[:, :, 1:], v[:, :, 1:], ws, rs, head_offset=2, total_heads=H, **kw)
    assert max_err(part, full[:, :, 2:]) <= 1e-6
    # a slice is not the same call as its heads alone: head 2 has offset 0 of rate 2 alone
    alone = dilated_attention(q[:, :, 2:], k[:, :, 1:], v[:, :, 1:], ws, rs, **kw)
    assert max_err(alone, full[:, :, 2:]) > 1e-2


@pytest.mark.parametrize("fn", [dilated_attention, dilated_attention_naive])
@pytest.mark.parametrize("kw, error, match", [
    (dict(head_offset=-1), ValueError, "head_offset must be a non-negative int, got -1"),
    (dict(head_offset=1.0), TypeError, "head_offset must be an int, got float"),
    (dict(total_heads="8"), TypeError, "total_heads must be an int, got str"),
    (dict(total_heads=0), ValueError, "total_heads must be a positive int, got 0"),
    (dict(head_offset=3, total_heads=4), ValueError, r"q holds heads \[3, 5\) but total_heads = 4"),
    (dict(total_heads=1), ValueError, r"q holds heads \[0, 2\) but total_heads = 1"),
    (dict(head_offset=1, total_heads=4), ValueError, "multiples of q's GQA group size .* = 2"),
    (dict(total_heads=5), ValueError, "multiples of q's GQA group size"),
])
def test_bad_head_slice_is_a_clear_error(fn, kw, error, match):
    q, k = torch.zeros(1, 8, 2, 4), torch.zeros(1, 8, 1, 4)
    with pytest.raises(error, match=match):
        fn(q, k, k, [4], [2], **kw)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_slice_that_reads_no_key_has_zero_gradients(backend):
    """Heads 6, 7 of 8 with r = 8 have offsets 6 and 7, past a 4-token sequence: no query of
    the slice has a key. The result is 0 (lse -inf) and backward gives zero gradients on both
    backends and the oracle (the portable path and the oracle once returned tensors that
    backward() refused)."""
    q, k, v = (seeded((1, 4, 2, 8), torch.float32, s, DEVICE).requires_grad_() for s in range(3))
    kw = dict(head_offset=6, total_heads=8)
    out, lse = dilated_attention(q, k, v, [16], [8], return_lse=True, backend=backend, **kw)
    ref_out, ref_lse = dilated_attention_naive(q, k, v, [16], [8], **kw)
    for o, l in ((out, lse), (ref_out, ref_lse)):
        assert torch.equal(o, torch.zeros_like(o)) and bool(torch.isneginf(l).all())
        grads = torch.autograd.grad(o.sum(), (q, k, v))
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
