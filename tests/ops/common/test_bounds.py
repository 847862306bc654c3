"""Out-of-bounds canaries for the Triton kernels.

The interpreter does not bounds-check (DESIGN §10): an unmasked read past a tensor's
rows, heads or head dim returns whatever lies there, and on a GPU the same read can fault
or leak garbage. These tests place every input inside a larger buffer filled with NaN
(before and after each of the sequence, head and head-dim axes), so a read outside the
view that reaches the result turns it into NaN. Results must equal, bit for bit, the same
call on contiguous inputs (whose accuracy the oracle tests check). The ring step writes
into caller-owned accumulators, so those are NaN-framed too and the frame must stay NaN
after the call: a write outside the view would overwrite it.
"""
from __future__ import annotations

import pytest
import torch

from triton_dilated.ops.common.call import AttentionCall
from triton_dilated import block_sparse_attention, dilated_attention, layouts
from triton_dilated.ops.dilated.patterns import head_offsets
from triton_dilated.ops.ring.mask import MASK_DENSE, MASK_DILATED, MASK_LAYOUT, StepMask
from triton_dilated.ops.ring.step_kernels import step_backward, step_forward
from tests.conftest import DEVICE
from tests.helpers.reference import seeded

PAD = (3, 1, 8)   # NaN frame on (sequence, head, head dim), before and after


def framed(values: torch.Tensor, fill=float("nan")) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, buffer): a view equal to `values` (B, N, H, D) inside `buffer`, whose frame
    around it on dims 1..3 holds `fill`. The view keeps a contiguous last dimension."""
    B, N, H, D = values.shape
    pn, ph, pd = PAD
    buf = torch.full((B, N + 2 * pn, H + 2 * ph, D + 2 * pd), fill, dtype=values.dtype, device=values.device)
    view = buf[:, pn:pn + N, ph:ph + H, pd:pd + D]
    view.copy_(values)
    return view, buf


def frame_untouched(view: torch.Tensor, buf: torch.Tensor) -> bool:
    """True if every element of buf outside view is still NaN."""
    outside = torch.ones_like(buf, dtype=torch.bool)
    pn, ph, pd = PAD
    outside[:, pn:pn + view.shape[1], ph:ph + view.shape[2], pd:pd + view.shape[3]] = False
    return bool(torch.isnan(buf[outside]).all())


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(True)   # same storage and strides, now a leaf


def forward_backward(fn, q, k, v, do, dlse):
    out, lse = fn(q, k, v)
    grads = torch.autograd.grad((out, lse), (q, k, v), (do, dlse))
    return (out, lse, *grads)


def assert_framed_equals_plain(fn, *, B, N, Hq, Hkv, D, dtype=torch.float32):
    dev = torch.device(DEVICE)
    plain = [seeded(s, dtype, i, dev) for i, s in enumerate([(B, N, Hq, D), (B, N, Hkv, D), (B, N, Hkv, D),
                                                             (B, N, Hq, D)])]
    dlse = seeded((B, Hq, N), torch.float32, 9, dev)
    framed_inputs = [framed(x)[0] for x in plain]
    assert not framed_inputs[0].is_contiguous()
    ref = forward_backward(fn, *(leaf(x) for x in plain[:3]), plain[3], dlse)
    got = forward_backward(fn, *(leaf(x) for x in framed_inputs[:3]), framed_inputs[3], dlse)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert not torch.isnan(a).any(), f"{name}: NaN from a read outside the input views"
        assert torch.equal(a, b), f"{name}: differs from the same call on contiguous inputs"


@pytest.mark.parametrize("causal", [False, True])
def test_dilated_kernels_read_only_inside_their_inputs(causal):
    # N not a multiple of any tile, D = 40 padded to a 64-wide tile, GQA, a short last
    # segment, w % r != 0 and w >= N, so every masked edge is exercised.
    pats = ((48, 1), (96, 5), (256, 4))

    def fn(q, k, v):
        return dilated_attention(q, k, v, [w for w, _ in pats], [r for _, r in pats], causal=causal,
                                 return_lse=True, backend="triton")
    assert_framed_equals_plain(fn, B=1, N=150, Hq=4, Hkv=2, D=40)


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_kernels_read_only_inside_their_inputs(causal):
    N = 150
    lay = layouts.bigbird(N, 32, 1, 1, 1, seed=0, num_heads=4)

    def fn(q, k, v):
        return block_sparse_attention(q, k, v, lay, causal=causal, return_lse=True, backend="triton")
    assert_framed_equals_plain(fn, B=1, N=N, Hq=4, Hkv=2, D=40)


@pytest.mark.parametrize("kind", [MASK_DENSE, MASK_DILATED, MASK_LAYOUT])
def test_ring_step_reads_and_writes_only_inside_its_tensors(kind):
    """One step on a shard of 50 keys against 70 queries, every tensor NaN-framed: the
    running (out, lse) and the dq, dk, dv accumulators match the unframed call exactly and
    their frames stay NaN."""
    dev = torch.device(DEVICE)
    B, NQ, NK, Hq, Hkv, D, causal = 1, 70, 50, 4, 2, 40, True
    pats = ((16, 1), (48, 2), (120, 3))
    lay = layouts.bigbird(120, 16, 1, 1, 1, seed=0, num_heads=Hq)
    mask = StepMask(kind, causal, dev, patterns=pats, table=head_offsets(Hq, pats, "longnet", "modulo"), layout=lay)
    q_pos = torch.arange(50, 120, dtype=torch.int32, device=dev)     # queries after the keys: causal mask bites
    k_pos = torch.arange(40, 90, dtype=torch.int32, device=dev)
    q, do = (seeded((B, NQ, Hq, D), torch.float32, s, dev) for s in (0, 3))
    k, v = (seeded((B, NK, Hkv, D), torch.float32, s, dev) for s in (1, 2))

    def run(frame: bool):
        wrap = (lambda x: framed(x)) if frame else (lambda x: (x.clone(), None))
        # earlier steps left a running state: start from a partial one, not from zeros
        out0 = seeded((B, NQ, Hq, D), torch.float32, 4, dev)
        lse0 = seeded((B, Hq, NQ), torch.float32, 5, dev)
        lse0[:, :, :7] = float("-inf")           # rows no earlier shard reached
        out0[:, :7] = 0
        (qv, _), (kv, _), (vv, _), (dov, _) = (wrap(x) for x in (q, k, v, do))
        (out, out_buf) = wrap(out0)
        lse = lse0.clone()
        step_forward(qv, kv, vv, q_pos, k_pos, out, lse, mask, AttentionCall(mask.causal, D ** -0.5))
        delta = (dov * out).sum(-1).transpose(1, 2).contiguous()
        acc = [wrap(torch.zeros(B, n, h, D, device=dev)) for n, h in ((NQ, Hq), (NK, Hkv), (NK, Hkv))]
        (dq, _), (dk, _), (dv, _) = acc
        step_backward(qv, kv, vv, dov, lse, delta, q_pos, k_pos, dq, dk, dv, mask, AttentionCall(mask.causal, D ** -0.5))
        if frame:
            for name, (t, buf) in zip(("out", "dq", "dk", "dv"), [(out, out_buf)] + acc):
                assert frame_untouched(t, buf), f"{name}: the step wrote outside its view"
        return out, lse, dq, dk, dv

    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), run(True), run(False)):
        assert not torch.isnan(a).any(), f"{name}: NaN from a read outside the input views"
        assert torch.equal(a, b), f"{name}: differs from the same step on contiguous tensors"


def test_ring_layout_lookup_past_int32_offsets():
    """The ring step's block-layout lookup at 46,342 blocks of 16 (N = 741,472): the last
    query block's row of the layout table starts at 46,341 * 46,342 > 2^31 - 1. With int32
    block indices the offset wrapped and the read left the table (a segfault under the
    interpreter, a fault or a wrong mask on a GPU). Against the portable step. Needs a
    2.1 GB int8 table: the dense per-rank layout table is itself O(blocks^2)."""
    from triton_dilated.ops.ring import step_portable as step_torch
    dev = torch.device(DEVICE)
    nb, bs = 46_342, 16
    mask = StepMask(MASK_LAYOUT, False, dev, layout=layouts.local(4 * bs, bs, 1))
    mask.layout = torch.zeros(1, 1, nb, nb, dtype=torch.int8, device=dev)
    mask.layout[0, 0, nb - 1, 0] = 1                      # the last query block sees key block 0
    mask.layout_block = bs
    q_pos = torch.arange((nb - 1) * bs, nb * bs, dtype=torch.int32, device=dev)
    k_pos = torch.arange(0, bs, dtype=torch.int32, device=dev)
    q, k, v = (seeded((1, bs, 1, 32), torch.float32, s, dev) for s in range(3))
    results = []
    for step in (step_forward, step_torch.step_forward):
        out, lse = torch.zeros(1, bs, 1, 32, device=dev), torch.full((1, 1, bs), float("-inf"), device=dev)
        step(q, k, v, q_pos, k_pos, out, lse, mask, AttentionCall(mask.causal, 32 ** -0.5))
        results.append((out, lse))
    (out, lse), (ref_out, ref_lse) = results
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(lse, ref_lse)
    torch.testing.assert_close(out, ref_out)
