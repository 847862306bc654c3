"""Input validation of the public `dilated_attention` (DESIGN §2, §5a, §7).

Every rejected input raises TypeError (wrong kind of object) or ValueError (right kind,
wrong value) with a message naming the offending argument. Plus the edge cases that must
be *accepted*: empty batch, empty sequence, non-contiguous last dimension, D = 256.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from triton_dilated import dilated_attention
from triton_dilated.ops.common import runtime


def _t(*shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float32)
    if not (dtype.is_floating_point or dtype.is_complex):
        x = x * 4  # integer / bool tensors: not all zeros
    return x.to(dtype).to(device)


def _qkv(B=1, N=8, Hq=2, Hkv=1, D=8, dtype=torch.float32):
    return _t(B, N, Hq, D, dtype=dtype, seed=1), _t(B, N, Hkv, D, dtype=dtype, seed=2), \
        _t(B, N, Hkv, D, dtype=dtype, seed=3)


def _call(q=None, k=None, v=None, segment_lengths=(4, 8), dilation_rates=(1, 2), **kw):
    dq, dk, dv = _qkv()
    q = dq if q is None else q
    k = dk if k is None else k
    v = dv if v is None else v
    kw.setdefault("backend", "torch")
    return dilated_attention(q, k, v, segment_lengths, dilation_rates, **kw)


# (id, thunk, exception type, regex that must name the argument)
REJECTED = [
    # ---- ranks
    ("q-rank3", lambda: _call(q=_t(1, 8, 8)), ValueError, r"^q must have 4 dimensions"),
    ("q-rank5", lambda: _call(q=_t(1, 8, 2, 8, 1)), ValueError, r"^q must have 4 dimensions"),
    ("k-rank3", lambda: _call(k=_t(1, 8, 8)), ValueError, r"^k must have 4 dimensions"),
    ("v-rank2", lambda: _call(v=_t(8, 8)), ValueError, r"^v must have 4 dimensions"),
    # ---- shapes
    ("batch-mismatch", lambda: _call(k=_t(2, 8, 1, 8), v=_t(2, 8, 1, 8)), ValueError,
     r"^k and v must have the batch size of q \(1\), got 2"),
    ("seq-mismatch", lambda: _call(k=_t(1, 6, 1, 8), v=_t(1, 6, 1, 8)), ValueError,
     r"^q must not be longer than k and v .* got Nq = 8 > Nk = 6"),
    ("headdim-mismatch", lambda: _call(k=_t(1, 8, 1, 16), v=_t(1, 8, 1, 16)), ValueError,
     r"^k and v must have the head dim of q \(8\), got 16"),
    ("hq-not-multiple", lambda: _call(q=_t(1, 8, 3, 8), k=_t(1, 8, 2, 8), v=_t(1, 8, 2, 8)), ValueError,
     r"query heads \(3\) must be a positive multiple of key/value heads \(2\)"),
    ("hkv-zero", lambda: _call(k=_t(1, 8, 0, 8), v=_t(1, 8, 0, 8)), ValueError,
     r"query heads \(2\) must be a positive multiple of key/value heads \(0\)"),
    ("k-v-heads-differ", lambda: _call(q=_t(1, 8, 2, 8), k=_t(1, 8, 1, 8), v=_t(1, 8, 2, 8)), ValueError,
     r"^k and v must have the same shape"),
    ("k-v-seq-differ", lambda: _call(v=_t(1, 6, 1, 8)), ValueError, r"^k and v must have the same shape"),
    ("headdim-257", lambda: _call(*_qkv(D=257)), ValueError, r"^head dim must be in \[1, 256\], got 257"),
    ("headdim-512", lambda: _call(*_qkv(D=512)), ValueError, r"^head dim must be in \[1, 256\], got 512"),
    # ---- dtypes
    ("dtype-mismatch-k", lambda: _call(k=_t(1, 8, 1, 8, dtype=torch.float16)), TypeError,
     r"^q, k and v must share one dtype, got q=torch.float32, k=torch.float16"),
    ("dtype-mismatch-v", lambda: _call(v=_t(1, 8, 1, 8, dtype=torch.bfloat16)), TypeError,
     r"^q, k and v must share one dtype.*v=torch.bfloat16"),
    ("dtype-int32", lambda: _call(*_qkv(dtype=torch.int32)), TypeError, r"^q must have one of the dtypes .*int32"),
    ("dtype-int64", lambda: _call(*_qkv(dtype=torch.int64)), TypeError, r"^q must have one of the dtypes .*int64"),
    ("dtype-bool", lambda: _call(*_qkv(dtype=torch.bool)), TypeError, r"^q must have one of the dtypes .*bool"),
    ("dtype-float64", lambda: _call(*_qkv(dtype=torch.float64)), TypeError, r"^q must have one of the dtypes .*float64"),
    ("dtype-complex64", lambda: _call(*_qkv(dtype=torch.complex64)), TypeError,
     r"^q must have one of the dtypes .*complex64"),
    ("dtype-k-int", lambda: _call(k=_t(1, 8, 1, 8, dtype=torch.int32)), TypeError,
     r"^k must have one of the dtypes .*int32"),
    ("dtype-v-float64", lambda: _call(v=_t(1, 8, 1, 8, dtype=torch.float64)), TypeError,
     r"^v must have one of the dtypes .*float64"),
    # ---- devices
    ("device-k-meta", lambda: _call(k=_t(1, 8, 1, 8, device="meta")), ValueError,
     r"^q, k and v must be on one device.*k=meta"),
    ("device-v-meta", lambda: _call(v=_t(1, 8, 1, 8, device="meta")), ValueError,
     r"^q, k and v must be on one device.*v=meta"),
    # ---- not tensors
    ("q-list", lambda: _call(q=_t(1, 8, 2, 8).tolist()), TypeError, r"^q must be a torch.Tensor, got list"),
    ("k-numpy", lambda: _call(k=_t(1, 8, 1, 8).numpy()), TypeError, r"^k must be a torch.Tensor, got ndarray"),
    ("v-numpy", lambda: _call(v=_t(1, 8, 1, 8).numpy()), TypeError, r"^v must be a torch.Tensor, got ndarray"),
    ("q-none", lambda: dilated_attention(None, *_qkv()[1:], [4], [1]), TypeError,
     r"^q must be a torch.Tensor, got NoneType"),
    # ---- pattern lists
    ("len-mismatch", lambda: _call(segment_lengths=[4, 8], dilation_rates=[1]), ValueError,
     r"^segment_lengths and dilation_rates must have the same length, got 2 and 1"),
    ("len-mismatch-2", lambda: _call(segment_lengths=[4], dilation_rates=[1, 2, 4]), ValueError,
     r"^segment_lengths and dilation_rates must have the same length, got 1 and 3"),
    ("empty-both", lambda: _call(segment_lengths=[], dilation_rates=[]), ValueError,
     r"^segment_lengths must not be empty"),
    ("empty-rates", lambda: _call(segment_lengths=[4], dilation_rates=()), ValueError,
     r"^dilation_rates must not be empty"),
    ("w-float", lambda: _call(segment_lengths=[4.0, 8]), TypeError, r"^segment_lengths must hold ints, got 4.0"),
    ("w-float-frac", lambda: _call(segment_lengths=[4, 7.5]), TypeError, r"^segment_lengths must hold ints"),
    ("w-str-item", lambda: _call(segment_lengths=["4", 8]), TypeError, r"^segment_lengths must hold ints, got '4'"),
    ("w-bool-item", lambda: _call(segment_lengths=[True, 8]), TypeError, r"^segment_lengths must hold ints, got a bool"),
    ("w-str", lambda: _call(segment_lengths="48", dilation_rates=[1, 2]), TypeError,
     r"^segment_lengths must be a list or tuple"),
    ("w-int", lambda: _call(segment_lengths=8, dilation_rates=[1]), TypeError,
     r"^segment_lengths must be a list or tuple"),
    ("w-none", lambda: _call(segment_lengths=None), TypeError, r"^segment_lengths must be a list or tuple"),
    ("w-zero", lambda: _call(segment_lengths=[0, 8]), ValueError, r"^segment_lengths must hold positive ints, got 0"),
    ("w-negative", lambda: _call(segment_lengths=[4, -8]), ValueError,
     r"^segment_lengths must hold positive ints, got -8"),
    ("r-float", lambda: _call(dilation_rates=[1, 2.0]), TypeError, r"^dilation_rates must hold ints, got 2.0"),
    ("r-str-item", lambda: _call(dilation_rates=[1, "2"]), TypeError, r"^dilation_rates must hold ints, got '2'"),
    ("r-bool-item", lambda: _call(dilation_rates=[True, 2]), TypeError, r"^dilation_rates must hold ints, got a bool"),
    ("r-str", lambda: _call(dilation_rates="12"), TypeError, r"^dilation_rates must be a list or tuple"),
    ("r-zero", lambda: _call(dilation_rates=[1, 0]), ValueError, r"^dilation_rates must hold positive ints, got 0"),
    ("r-negative", lambda: _call(dilation_rates=[-1, 2]), ValueError,
     r"^dilation_rates must hold positive ints, got -1"),
    ("r-above-w", lambda: _call(segment_lengths=[4, 8], dilation_rates=[1, 16]), ValueError,
     r"^dilation_rates\[1\] = 16 is larger than segment_lengths\[1\] = 8: .*look swapped"),
    ("lists-swapped", lambda: _call(segment_lengths=[1, 2], dilation_rates=[4, 8]), ValueError,
     r"^dilation_rates\[0\] = 4 is larger than segment_lengths\[0\] = 1: .*look swapped"),
    ("w-float-tensor", lambda: _call(segment_lengths=torch.tensor([4.0, 8.0])), TypeError,
     r"^segment_lengths must hold ints, got a tensor of torch.float32"),
    # ---- string choices
    ("mode-unknown", lambda: _call(mode="dense"), ValueError, r"^mode must be one of .*got 'dense'"),
    ("mode-case", lambda: _call(mode="LongNet"), ValueError, r"^mode must be one of"),
    ("mode-none", lambda: _call(mode=None), ValueError, r"^mode must be one of"),
    ("offsets-unknown", lambda: _call(offsets="random"), ValueError, r"^offsets must be one of .*got 'random'"),
    ("offsets-unknown-head-groups", lambda: _call(mode="head_groups", offsets="strided"), ValueError,
     r"^offsets must be one of"),
    ("backend-unknown", lambda: _call(backend="cuda"), ValueError, r"^backend must be one of .*got 'cuda'"),
    ("backend-case", lambda: _call(backend="Torch"), ValueError, r"^backend must be one of"),
    ("backend-none", lambda: _call(backend=None), ValueError, r"^backend must be one of"),
    # ---- flags
    ("causal-int", lambda: _call(causal=1), TypeError, r"^causal must be a bool, got int"),
    ("causal-str", lambda: _call(causal="true"), TypeError, r"^causal must be a bool, got str"),
    ("causal-none", lambda: _call(causal=None), TypeError, r"^causal must be a bool, got NoneType"),
    ("return_lse-int", lambda: _call(return_lse=1), TypeError, r"^return_lse must be a bool, got int"),
    ("return_lse-str", lambda: _call(return_lse="yes"), TypeError, r"^return_lse must be a bool, got str"),
    ("return_lse-none", lambda: _call(return_lse=None), TypeError, r"^return_lse must be a bool, got NoneType"),
    # ---- scale
    ("scale-str", lambda: _call(scale="0.5"), TypeError, r"^scale must be a float or None, got str"),
    ("scale-bool", lambda: _call(scale=True), TypeError, r"^scale must be a float or None, got bool"),
    ("scale-list", lambda: _call(scale=[0.5]), TypeError, r"^scale must be a float or None, got list"),
    ("scale-tensor", lambda: _call(scale=torch.tensor(0.5)), TypeError, r"^scale must be a float or None, got Tensor"),
    ("scale-nan", lambda: _call(scale=float("nan")), ValueError, r"^scale must be finite"),
    ("scale-inf", lambda: _call(scale=float("inf")), ValueError, r"^scale must be finite"),
]


@pytest.mark.parametrize("thunk, exc, match", [pytest.param(t, e, m, id=i) for i, t, e, m in REJECTED])
def test_rejected_input(thunk, exc, match):
    with pytest.raises(exc, match=match):
        thunk()


def test_default_call_is_accepted():
    """The defaults every rejected case perturbs are themselves valid (so each rejection
    above is caused by the one perturbed argument)."""
    out = _call()
    assert out.shape == (1, 8, 2, 8)
    assert torch.isfinite(out).all()


def test_backend_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not runtime.interpreter_enabled()
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"backend='triton' needs a CUDA tensor"):
        dilated_attention(q, k, v, [4, 8], [1, 2], backend="triton")
    # ... while "auto" falls back to the portable path and gives its result
    out = dilated_attention(q, k, v, [4, 8], [1, 2], backend="auto")
    ref = dilated_attention(q, k, v, [4, 8], [1, 2], backend="torch")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_interpreter_set_after_import():
    """The kernel files are imported at the first Triton call, and triton reads
    TRITON_INTERPRET when it defines them: set after `import triton_dilated` but before that
    call, the interpreter runs the kernels; set after the kernels were defined (here: loaded
    without it), "auto" takes the portable path and "triton" says what to do, instead of
    triton's "0 active drivers"."""
    before_first_call = ("import os, torch, triton_dilated as td\n"
                         "os.environ['TRITON_INTERPRET'] = '1'\n"
                         "q = torch.randn(1, 8, 2, 8)\n"
                         "out = td.dilated_attention(q, q, q, [4, 8], [1, 2], backend='triton')\n"
                         "ref = td.dilated_attention(q, q, q, [4, 8], [1, 2], backend='torch')\n"
                         "assert (out - ref).abs().max() < 1e-5\n"
                         "print('interpreted')\n")
    after_kernels_loaded = ("import os, torch, triton_dilated as td\n"
                            "import triton_dilated.ops.dilated.kernels\n"
                            "os.environ['TRITON_INTERPRET'] = '1'\n"
                            "q = torch.randn(1, 8, 2, 8)\n"
                            "assert td.dilated_attention(q, q, q, [4, 8], [1, 2]).shape == q.shape\n"
                            "try:\n"
                            "    td.dilated_attention(q, q, q, [4, 8], [1, 2], backend='triton')\n"
                            "except ValueError as e:\n"
                            "    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for code, expected in ((before_first_call, "interpreted"),
                           (after_kernels_loaded, "set it before importing triton_dilated")):
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert expected in proc.stdout, proc.stdout


def test_pattern_lists_accept_tuples_numpy_ints_arrays_ranges_and_tensors():
    q, k, v = _qkv(N=12)
    ref = dilated_attention(q, k, v, [4, 8], [1, 2], backend="torch")
    for w, r in [((4, 8), (1, 2)), ([np.int64(4), np.int32(8)], (np.int64(1), 2)),
                 (torch.tensor([4, 8]), torch.tensor([1, 2])), (np.array([4, 8]), np.array([1, 2])),
                 (range(4, 9, 4), range(1, 3))]:
        out = dilated_attention(q, k, v, w, r, backend="torch")
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_head_dim_256_is_accepted():
    q, k, v = _qkv(N=4, D=256)
    out, lse = dilated_attention(q, k, v, [4], [1], backend="torch", return_lse=True)
    assert out.shape == (1, 4, 2, 256) and lse.shape == (1, 2, 4)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


# ----------------------------------------------------------------------------- empty inputs

@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
@pytest.mark.parametrize("B, N", [(0, 8), (2, 0), (0, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_empty_batch_or_sequence(backend, B, N, dtype):
    q, k, v = _qkv(B=B, N=N, Hq=4, Hkv=2, D=8, dtype=dtype)
    out = dilated_attention(q, k, v, [4, 8], [1, 2], causal=True, backend=backend)
    assert out.shape == (B, N, 4, 8) and out.dtype == dtype and out.device == q.device
    assert out.is_contiguous()
    out, lse = dilated_attention(q, k, v, [4, 8], [1, 2], return_lse=True, backend=backend)
    assert out.shape == (B, N, 4, 8) and out.dtype == dtype
    assert lse.shape == (B, 4, N) and lse.dtype == torch.float32


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("variant", ["dilated", "block_sparse"])
@pytest.mark.parametrize("nq", [4, 17], ids=["decode", "chunked-prefill"])
def test_empty_batch_with_queries_shorter_than_keys(backend, variant, nq):
    """Issue 19 item 3: B = 0 with q shorter than k (decoding or chunked prefill shapes,
    through the serve doors) gave IndexError (an empty float index tensor). Empty out and
    lse, and empty gradients."""
    from triton_dilated import block_sparse_attention_with_kvcache, dilated_attention_with_kvcache, layouts
    q = _t(0, nq, 2, 8, seed=1).requires_grad_(True)
    k, v = (_t(0, 64, 2, 8, seed=s).requires_grad_(True) for s in (2, 3))
    kw = dict(causal=True, backend=backend, return_lse=True,
              cache_seqlens=torch.zeros(0, dtype=torch.int32, device=q.device))
    if variant == "dilated":
        out, lse = dilated_attention_with_kvcache(q, k, v, segment_lengths=[16, 32], dilation_rates=[1, 2], **kw)
    else:
        out, lse = block_sparse_attention_with_kvcache(q, k, v, layout=layouts.local(64, 16, 1, causal=True), **kw)
    assert out.shape == (0, nq, 2, 8) and lse.shape == (0, 2, nq) and lse.dtype == torch.float32
    (out.sum() + lse.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


# ----------------------------------------------------------------------------- strides

def _noncontig(B, N, H, D, seed):
    """A (B, N, H, D) tensor whose last dimension is not contiguous (stride H)."""
    x = _t(B, N, D, H, seed=seed).transpose(-1, -2)
    assert x.shape == (B, N, H, D) and x.stride(-1) != 1
    return x


def _strided_heads(B, N, H, D, seed):
    """Contiguous last dimension, but every other head of a bigger tensor."""
    x = _t(B, N, 2 * H, D, seed=seed)[:, :, ::2]
    assert x.stride(-1) == 1 and not x.is_contiguous()
    return x


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("make", [_noncontig, _strided_heads], ids=["last-dim", "heads"])
def test_non_contiguous_inputs(backend, make):
    B, N, Hq, Hkv, D = 1, 24, 4, 2, 12
    q, k, v = make(B, N, Hq, D, 1), make(B, N, Hkv, D, 2), make(B, N, Hkv, D, 3)
    g = _t(B, N, Hq, D, seed=4)
    gl = _t(B, Hq, N, seed=5)
    kw = dict(causal=True, return_lse=True, backend=backend)

    def run(q, k, v):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out, lse = dilated_attention(q, k, v, [8, 16], [1, 2], **kw)
        ((out * g).sum() + (lse * gl).sum()).backward()
        return out, lse, q.grad, k.grad, v.grad

    got = run(q, k, v)
    ref = run(q.contiguous(), k.contiguous(), v.contiguous())
    assert got[0].is_contiguous() and got[0].shape == (B, N, Hq, D)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
