"""Backend dispatch (DESIGN §7) and the small launch helpers every variant shares.

No triton import here: whether triton is installed, and whether its kernels run under the
interpreter, is asked of ops/common/kernels.py, the shared kernel file, only when needed.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from .configs import kernels_fit, kernels_spill_free
from .constant import trace_constant

BACKENDS = ("auto", "triton", "torch")


@trace_constant     # cached; a constant under torch.compile (constant.py)
def triton_importable() -> bool:
    """Whether triton imports on this machine. Only triton itself: importing the kernel files
    would define their jit functions, fixing interpreted-or-compiled by TRITON_INTERPRET as it
    is now (a later TRITON_INTERPRET=1 would then not switch them)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def kernels_interpreted() -> bool:
    """Whether the kernels were defined under Triton's interpreter. Triton reads
    TRITON_INTERPRET when a kernel is decorated, so the kernels themselves are asked."""
    if not triton_importable():
        return False
    from . import kernels
    return kernels.is_interpreted()


def interpreter_enabled() -> bool:
    """True when the Triton kernels run under Triton's interpreter: TRITON_INTERPRET=1 was
    set before the kernels were defined (setting it later does not switch them)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1" and kernels_interpreted()


def triton_can_target(device: torch.device) -> bool:
    """Triton compiles for Volta (sm70) and newer; older cards take the portable path."""
    if device.type == "cuda":
        return triton_importable() and torch.cuda.get_device_capability(device) >= (7, 0)
    return device.type == "cpu" and interpreter_enabled()


def resolve_backend(backend: str, device: torch.device, families=(), head_dim: int = 0,
                    dtype: torch.dtype = torch.float16) -> str:
    """Map `backend` to "triton" or "torch" for tensors on `device` (DESIGN §7). With
    config `families`, a GPU where none of their tiles fits shared memory at `head_dim`
    takes the portable path ("auto") or is an error ("triton"); one where the default tiles of a
    kernel spill registers (Volta/Turing, the backward at D = 256: configs.kernels_spill_free)
    takes the portable path under "auto"."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if triton_can_target(device):
        if families and not kernels_fit(families, head_dim, dtype, device):
            if backend == "auto":
                return "torch"
            raise ValueError(f"backend='triton': the {'/'.join(families)} kernels cannot run head dim {head_dim} in "
                             f"{dtype} on {torch.cuda.get_device_name(device)} (no tile fits its shared memory, or "
                             "float32 without TF32 tensor cores); use backend='auto' or 'torch' (the portable path)")
        if backend == "auto" and families and not kernels_spill_free(families, head_dim, device):
            return "torch"     # Volta/Turing: the backward at D = 256 spills (configs)
        return "triton"
    if backend == "auto":
        return "torch"
    if not triton_importable():
        raise ValueError("backend='triton': triton is not installed (or does not import) on this machine; "
                         "use backend='auto' or 'torch' for the portable PyTorch path")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise ValueError(
            "backend='triton' on a CPU tensor: TRITON_INTERPRET=1 is set, but only after the Triton kernels "
            "were loaded (by an earlier call), and triton reads it when the kernels are defined; set it before "
            "importing triton_dilated (or use backend='auto' or 'torch' for the portable path)")
    if device.type == "cpu":
        raise ValueError(
            "backend='triton' needs a CUDA tensor, or TRITON_INTERPRET=1 set before triton is "
            "imported to run the kernels on the CPU with Triton's interpreter; got a CPU tensor "
            "without the interpreter (use backend='auto' or 'torch' for the portable path)")
    raise ValueError(f"backend='triton' cannot target device {device} "
                     "(needs a CUDA GPU of compute capability >= 7.0 and triton installed)")


def portable_compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Pascal-class cards (sm6x) run float16 at a tiny fraction of float32 speed: compute
    there in float32 and cast back once."""
    if device.type == "cuda" and dtype == torch.float16 and torch.cuda.get_device_capability(device) < (7, 0):
        return torch.float32
    return dtype


def on_tensor_device(launcher):
    """Run a kernel launcher with its first tensor argument's CUDA device current: Triton launches
    on the current device and stream, which need not be the inputs' (q on cuda:1 while
    cuda:0 is current)."""
    @functools.wraps(launcher)
    def wrapper(*args, **kwargs):
        t = next(a for a in args if isinstance(a, torch.Tensor))
        ctx = torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
        with ctx:
            return launcher(*args, **kwargs)
    return wrapper


_NO_SWITCH = contextlib.nullcontext()


def cuda_device(index):
    """A context with CUDA device `index` current for a launch (None: a CPU tensor, nothing to
    switch; the device already current: nothing either, the common case, at no cost)."""
    if index is None or torch.cuda.current_device() == index:
        return _NO_SWITCH
    return torch.cuda.device(index)


def dot_precision(float32: bool, vendor: str = "nvidia") -> str:
    """The kernels' tl.dot input_precision. float32 inputs use "tf32x3" (three tf32 products:
    float32-level accuracy on tensor cores; "ieee" would mean plain FMA loops and compiles of
    minutes). 16-bit inputs ignore it on NVIDIA ("tf32", as compiled so far); Triton's AMD
    backend accepts only "ieee", "bf16x3" and "bf16x6" (the dispatcher keeps float32 off AMD:
    hardware.ARCH_TABLE tf32)."""
    if vendor == "amd":
        return "ieee"
    return "tf32x3" if float32 else "tf32"


# The kernels' DOT_MODE constexpr (common/kernels.py dot): how tl.dot runs.
DOT_NATIVE = 0   # tl.dot on the inputs as they are
DOT_FP32 = 1     # in float32: the interpreter computes bf16 tl.dot wrongly
DOT_PIECES = 2   # contractions longer than 64 in 64-wide pieces: archs whose Triton dots are FMA loops


def dot_mode(mma: str) -> int:
    """DOT_MODE for an arch whose tensor-core family (ArchFacts.mma) is `mma`: "fma" (sm70,
    sm75) gets DOT_PIECES, the interpreter DOT_FP32, every other arch DOT_NATIVE."""
    if mma == "interpreter":
        return DOT_FP32
    return DOT_PIECES if mma == "fma" else DOT_NATIVE


def kernel_options(dtype, device):
    """(DOT_MODE, PRECISION) for the kernels: dot_mode of the device's arch (under the
    interpreter multiply in float32); PRECISION: dot_precision for the device's vendor."""
    if device.type != "cuda":
        return DOT_FP32, dot_precision(dtype == torch.float32)
    from .hardware import device_arch
    arch = device_arch(device)
    return dot_mode(arch.mma), dot_precision(dtype == torch.float32, arch.vendor)


def window_args(window) -> dict:
    """The kernels' sliding-window keywords for a WindowPredicate (ops/common/masks.py) or
    None: HAS_WINDOW and HAS_SINK_TOKENS, the compile-time features, and `window`,
    `sink_tokens`, run-time int32 values the kernels do not specialize on (one compile for
    every window and sink count: gpt-oss's 128, Mistral's 4096). None where unused."""
    if window is None:
        return dict(HAS_WINDOW=False, window=None, HAS_SINK_TOKENS=False, sink_tokens=None)
    sinks = window.sink_tokens
    return dict(HAS_WINDOW=True, window=window.window, HAS_SINK_TOKENS=sinks > 0, sink_tokens=sinks if sinks else None)


def last_dim_contiguous(x):
    """Kernels take any strides but need a unit stride on the head dim: copy only then."""
    return x if x.stride(-1) == 1 else x.contiguous()


def require_contiguous(launcher: str, name: str, t, shape):
    """The kernels index the buffers a launcher allocates (out, gradients, row statistics)
    from their shapes; one passed in by a caller must be contiguous and of that shape."""
    if tuple(t.shape) != tuple(shape) or not t.is_contiguous():
        raise ValueError(f"{launcher}: {name} must be a contiguous tensor of shape {tuple(shape)} (the kernels index "
                         f"it from its shape), got shape {tuple(t.shape)} with strides {t.stride()}")


def empty_result(q, k, v, return_lse: bool):
    """The result for an empty batch or sequence: empty out (and lse), still connected to
    q, k and v so that backward runs."""
    B, N, Hq, _ = q.shape
    tie = (q.sum() + k.sum() + v.sum()) * 0
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device) + tie
    lse = torch.zeros((B, Hq, N), dtype=torch.float32, device=q.device) + tie.float()
    return (out, lse) if return_lse else out
