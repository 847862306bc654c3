"""compat="dilated-attention-pytorch" (issue 14): DilatedAttention and MultiheadDilatedAttention
against a transcription of that library's forward (tests/helpers/dilated_attention_pytorch_reference.py,
float64 oracle; the same transcription in float32 is the same-dtype reference of the tolerance
rule), forward and backward, after load_state_dict(strict=True) of its weights; the shapes
compat mode refuses; that library's argument names (softmax_scale, attention_dropout,
is_causal, op); the warning when its checkpoint is loaded without compat."""
from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

from tests.helpers import dilated_attention_pytorch_reference as dap
from tests.helpers.reference import FLOOR, assert_rule, seeded
from triton_dilated.modules import DAP_CHECKPOINT_WARNING, DilatedAttention, MultiheadDilatedAttention

COMPAT = "dilated-attention-pytorch"

# (B, N, H, D, segment_lengths, dilation_rates): N a multiple of every segment, H of the pattern count
SHAPES = {
    "three-patterns": (1, 32, 3, 8, [8, 16, 32], [1, 2, 4]),
    "two-heads-per-group": (2, 24, 4, 16, [6, 12], [2, 3]),
    "one-pattern": (1, 16, 2, 8, [16], [2]),
}


def _run(fn, q, k, v, g):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    (out * g).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


# values: "shifted" (v around 1: every group's sum over positions is far from 0) takes the
# float32 floor of the tolerance rule; "centred" (v around 0) has sums that nearly cancel (up
# to ~370x here), which amplifies the attention's float32 rounding on both sides of the
# comparison but not equally (the fused kernels round differently from a plain softmax):
# a floor of 1e-4.
VALUES = {"shifted": (1.0, FLOOR[torch.float32]), "centred": (0.0, 1e-4)}


@pytest.mark.parametrize("values", list(VALUES))
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dilated_attention_matches_reference(shape, causal, backend, values, device):
    B, N, H, D, ws, rs = SHAPES[shape]
    shift, floor = VALUES[values]
    q, k, v, g = (seeded((B, N, H, D), torch.float64, s, device) for s in range(4))
    v = v + shift
    ref_module = dap.DilatedAttention(ws, rs)
    oracle = _run(lambda *a: ref_module(*a, is_causal=causal), q, k, v, g)
    same_dtype = _run(lambda *a: ref_module(*a, is_causal=causal), *(x.float() for x in (q, k, v, g)))
    module = DilatedAttention(ws, rs, compat=COMPAT, backend=backend)
    assert module.mode == "head_groups"
    got = _run(lambda *a: module(*a, is_causal=causal), *(x.float() for x in (q, k, v, g)))
    for name, a, o, s, factor in zip(("out", "dq", "dk", "dv"), got, oracle, same_dtype, (2, 3, 3, 3)):
        assert a.dtype == torch.float32
        assert_rule(name, a, o, s, factor=factor, floor=floor)


def test_head_groups_without_compat_is_not_that_library():
    """docs/api.md's claim (Migrating), checked: plain head-group mode differs from that library
    by O(1), and the exact relation is theirs = ours / (num_groups * ours summed over positions)."""
    B, N, H, D, ws, rs = SHAPES["three-patterns"]
    q, k, v = (seeded((B, N, H, D), torch.float32, s) for s in range(3))
    theirs = dap.DilatedAttention(ws, rs)(q.double(), k.double(), v.double())
    ours = DilatedAttention(ws, rs, mode="head_groups", backend="torch")(q, k, v).double()
    assert (ours - theirs).abs().max() > 0.1
    torch.testing.assert_close(ours / (len(ws) * ours.sum(dim=1, keepdim=True)), theirs, rtol=1e-4, atol=1e-5)


def _randomise(module, seed):
    """Every parameter (biases and LayerNorm included) away from its initial value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3 + (1.0 if p.dim() == 1 else 0.0))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layer_norm", [True, False])
def test_multihead_checkpoint_matches_reference(causal, layer_norm):
    """A checkpoint of that library's module loads with strict=True and gives its outputs and
    gradients (inputs and every parameter)."""
    E, H, rates, lengths, N = 32, 4, [1, 2], [8, 16], 32
    ref = dap.MultiheadDilatedAttention(E, H, rates, lengths, layer_norm=layer_norm, dtype=torch.float64)
    _randomise(ref, 0)
    ours = MultiheadDilatedAttention(E, H, rates, lengths, layer_norm=layer_norm, compat=COMPAT, backend="torch")
    ours.load_state_dict(ref.state_dict(), strict=True)
    ref32 = dap.MultiheadDilatedAttention(E, H, rates, lengths, layer_norm=layer_norm)
    ref32.load_state_dict(ref.state_dict(), strict=True)
    x, g = seeded((2, N, E), torch.float64, 1), seeded((2, N, E), torch.float64, 2)

    def run(module, dtype):
        xx = x.detach().to(dtype).requires_grad_()
        out, weights = module(xx, xx, xx, is_causal=causal)
        assert weights is None
        (out * g.to(dtype)).sum().backward()
        grads = [out.detach(), xx.grad] + [p.grad for p in module.parameters()]
        module.zero_grad()
        return grads

    names = ["out", "dx"] + [n for n, _ in ours.named_parameters()]
    assert names[2:] == [n for n, _ in ref.named_parameters()]
    for name, a, o, s in zip(names, run(ours, torch.float32), run(ref, torch.float64), run(ref32, torch.float32)):
        assert_rule(name, a, o, s, factor=2 if name == "out" else 3, floor=FLOOR[torch.float32])


def test_multihead_compile_fullgraph():
    torch._dynamo.reset()
    m = MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], compat=COMPAT, backend="torch")
    x = seeded((1, 16, 32), torch.float32, 0).requires_grad_()
    a, _ = m(x, x, x, is_causal=True)
    b, _ = torch.compile(m, backend="aot_eager", fullgraph=True)(x, x, x, is_causal=True)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ga = torch.autograd.grad(a.square().sum(), [x, *m.parameters()])
    gb = torch.autograd.grad(b.square().sum(), [x, *m.parameters()])
    for u, w in zip(ga, gb):
        torch.testing.assert_close(u, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make, match", [
    (lambda: MultiheadDilatedAttention(24, 3, [1, 2], [8, 16], compat=COMPAT), r"num_heads \(3\) to be a multiple"),
    (lambda: MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], compat=COMPAT, mode="longnet"), "mode"),
    (lambda: MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], compat=COMPAT, scale=0.5), "scale"),
    (lambda: MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], compat=COMPAT, group=object()), "group"),
    (lambda: MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], compat="fkodom"), "^compat must be one of"),
    (lambda: DilatedAttention([8], [1], compat=COMPAT, mode="longnet"), "mode"),
    (lambda: DilatedAttention([8], [1], 0.5, compat=COMPAT), "softmax_scale"),
    (lambda: DilatedAttention([8], [1], compat=COMPAT, scale=0.5), "scale"),
])
def test_compat_refusals_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_compat_refusals_at_forward():
    m = DilatedAttention([8, 16], [1, 2], compat=COMPAT, backend="torch")
    q = torch.randn(1, 16, 3, 8)     # 3 heads over 2 patterns: that library's slices overlap
    with pytest.raises(ValueError, match=r"num_heads \(3\) to be a multiple of the number of patterns \(2\)"):
        m(q, q, q)
    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match="return_lse"):
        m(q, q, q, return_lse=True)
    assert m(q, q, q).shape == q.shape


# ----------------------------------------------------------------------------- argument names

def test_softmax_scale_attention_dropout_is_causal_names():
    q, k, v = (seeded((1, 24, 2, 8), torch.float32, s) for s in range(3))
    ref = DilatedAttention([8, 24], [1, 2], scale=0.3, backend="torch")
    for m in (DilatedAttention([8, 24], [1, 2], 0.3, 0.0, backend="torch"),
              DilatedAttention(segment_lengths=[8, 24], dilation_rates=[1, 2], softmax_scale=0.3,
                               attention_dropout=0.0, backend="torch")):
        assert m.scale == 0.3
        assert torch.equal(m(q, k, v), ref(q, k, v))
        assert torch.equal(m(q, k, v, is_causal=True), ref(q, k, v, causal=True))
        assert torch.equal(m(q, k, v, True), ref(q, k, v, causal=True))
    m = DilatedAttention([8, 24], [1, 2], backend="torch")
    assert not torch.equal(m(q, k, v, is_causal=True), m(q, k, v, is_causal=False))
    with pytest.raises(ValueError, match="scale or softmax_scale"):
        DilatedAttention([8], [1], softmax_scale=0.3, scale=0.3)
    with pytest.raises(ValueError, match="attention_dropout must be 0.0, got 0.1"):
        DilatedAttention([8], [1], attention_dropout=0.1)
    with pytest.raises(TypeError, match="attention_dropout"):
        DilatedAttention([8], [1], attention_dropout="0.1")
    with pytest.raises(TypeError, match="softmax_scale|scale"):
        DilatedAttention([8], [1], softmax_scale="0.3")
    with pytest.raises(ValueError, match="causal or is_causal"):
        m(q, k, v, causal=True, is_causal=True)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        m(q, k, v, is_causal=1)


def test_op_is_accepted_and_ignored():
    """That library's `op` (an xformers kernel choice) in its position or by name: the same
    module; a non-None op says it is ignored."""
    q, k, v = (seeded((1, 24, 2, 8), torch.float32, s) for s in range(3))
    ref = DilatedAttention([8, 24], [1, 2], backend="torch")
    assert torch.equal(DilatedAttention([8, 24], [1, 2], None, 0.0, None, backend="torch")(q, k, v), ref(q, k, v))
    with pytest.warns(UserWarning, match="op='flash' .* is ignored"):
        m = DilatedAttention([8, 24], [1, 2], op="flash", backend="torch")
    assert torch.equal(m(q, k, v), ref(q, k, v))
    MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], 0.0, True, True, 1e-5, 1.0, None, None, None)
    with pytest.warns(UserWarning, match="is ignored"):
        MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], op=object())


# ----------------------------------------------------------------------------- loading its checkpoints

def _saved(module):
    """module.state_dict() as torch.save / torch.load hand it back (with its metadata)."""
    buf = io.BytesIO()
    torch.save(module.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.fixture
def warn_again(monkeypatch):
    """The checkpoint warning is once per process: re-armed for each test."""
    import triton_dilated.modules as modules
    monkeypatch.setattr(modules, "_DAP_CHECKPOINT_WARNED", False)


@pytest.mark.parametrize("mode", [None, "head_groups"])
def test_loading_that_librarys_checkpoint_without_compat_warns_once(mode, warn_again):
    """Its state dict loads with strict=True into a module without compat (the keys match) and
    the outputs change by O(1): loud, once, naming compat; nested models too."""
    E, H, rates, lengths = 32, 4, [1, 2], [8, 16]
    theirs = dap.MultiheadDilatedAttention(E, H, rates, lengths)
    _randomise(theirs, 0)
    ours = nn.Sequential(MultiheadDilatedAttention(E, H, rates, lengths, mode=mode, backend="torch"),
                         MultiheadDilatedAttention(E, H, rates, lengths, mode=mode, backend="torch"))
    with pytest.warns(UserWarning, match=f"{DAP_CHECKPOINT_WARNING}.*compat='dilated-attention-pytorch'") as rec:
        ours.load_state_dict(_saved(nn.Sequential(theirs, dap.MultiheadDilatedAttention(E, H, rates, lengths))),
                             strict=True)
    assert len([w for w in rec if DAP_CHECKPOINT_WARNING in str(w.message)]) == 1
    x = seeded((1, 16, E), torch.float32, 1)
    assert (ours[0](x, x, x)[0] - theirs(x, x, x)[0]).abs().max() > 0.1      # what the warning is about


def test_no_checkpoint_warning_with_compat_or_for_its_own_checkpoints(warn_again):
    E, H, rates, lengths = 32, 4, [1, 2], [8, 16]
    theirs = dap.MultiheadDilatedAttention(E, H, rates, lengths)
    ours = MultiheadDilatedAttention(E, H, rates, lengths, backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MultiheadDilatedAttention(E, H, rates, lengths, compat=COMPAT).load_state_dict(_saved(theirs), strict=True)
        MultiheadDilatedAttention(E, H, rates, lengths).load_state_dict(_saved(ours), strict=True)
        MultiheadDilatedAttention(E, H, rates, lengths).load_state_dict(ours.state_dict(), strict=True)
        # without metadata (a plain dict) the origin is unknown: no warning
        MultiheadDilatedAttention(E, H, rates, lengths).load_state_dict(dict(_saved(theirs)), strict=True)
