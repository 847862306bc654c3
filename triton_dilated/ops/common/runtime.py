"""Backend dispatch (DESIGN §7), GPU architecture detection and tuned configs (DESIGN §8)."""
from __future__ import annotations

import contextlib
import functools
import json
import os
from dataclasses import dataclass
from importlib import resources

import torch

BACKENDS = ("auto", "triton", "torch")

# The configuration used under TRITON_INTERPRET=1: exactly one, small tiles keep the
# interpreter (~10 ms per program x key-block step) fast enough for tests.
INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}


def interpreter_enabled() -> bool:
    """True when the Triton kernels run under Triton's interpreter. Triton reads
    TRITON_INTERPRET when a kernel is decorated, i.e. when triton_dilated is imported:
    setting it later does not switch the kernels, so the kernels themselves are asked."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1" and kernels_interpreted()


def kernels_interpreted() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction

        from ..dilated.parallel import _dilated_fwd_kernel
    except Exception:  # noqa: BLE001 - no triton, or called while the package is importing
        return False
    return isinstance(_dilated_fwd_kernel, InterpretedFunction)


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the machine
        return False
    return True


@dataclass(frozen=True)
class Arch:
    name: str               # "sm90", "cpu-interpreter", ...
    capability: tuple        # (major, minor); (0, 0) off-GPU
    shared_memory: int       # bytes per block (opt-in maximum)
    sm_count: int
    device_name: str


@functools.lru_cache(maxsize=None)
def get_arch(device_index: int | None = None) -> Arch:
    """Cached description of the GPU (or of the CPU interpreter when no GPU is used)."""
    if device_index is None or not torch.cuda.is_available():
        return Arch("cpu-interpreter", (0, 0), 0, os.cpu_count() or 1, "cpu")
    props = torch.cuda.get_device_properties(device_index)
    cap = (props.major, props.minor)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    return Arch(f"sm{cap[0]}{cap[1]}", cap, smem, props.multi_processor_count, props.name)


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


def triton_can_target(device: torch.device) -> bool:
    """Triton compiles for Volta (sm70) and newer; older cards take the portable path."""
    if device.type == "cuda":
        return triton_importable() and torch.cuda.get_device_capability(device) >= (7, 0)
    return device.type == "cpu" and interpreter_enabled() and triton_importable()


def resolve_backend(backend: str, device: torch.device, kernels=(), head_dim: int = 0,
                    dtype: torch.dtype = torch.float16) -> str:
    """Map `backend` to "triton" or "torch" for tensors on `device` (DESIGN §7). With
    `kernels`, a GPU where none of their tiles fits shared memory at `head_dim` takes the
    portable path ("auto") or is an error ("triton")."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if triton_can_target(device):
        if kernels and not kernels_fit(kernels, head_dim, dtype, device):
            if backend == "auto":
                return "torch"
            raise ValueError(f"backend='triton': the {'/'.join(kernels)} kernels cannot run head dim {head_dim} in "
                             f"{dtype} on {torch.cuda.get_device_name(device)} (no tile fits its shared memory, or "
                             "float32 without TF32 tensor cores); use backend='auto' or 'torch' (the portable path)")
        return "triton"
    if backend == "auto":
        return "torch"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise ValueError(
            "backend='triton' on a CPU tensor: TRITON_INTERPRET=1 is set, but only after triton_dilated "
            "was imported, and triton reads it when the kernels are defined; set it before importing "
            "triton_dilated (or use backend='auto' or 'torch' for the portable path)")
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


@functools.lru_cache(maxsize=None)
def _load_arch_table(arch_name: str) -> dict:
    try:
        text = resources.files("triton_dilated.configs").joinpath(f"{arch_name}.json").read_text()
    except (FileNotFoundError, ModuleNotFoundError):
        return {}
    return json.loads(text)


def _cfg(block_m: int, block_n: int, warps: int, stages: int) -> dict:
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}


# Untuned backward defaults: (Hopper?, padded head dim <= 64?) -> family -> config. Chosen
# from an ahead-of-time compile of every kernel for sm90 and sm80 (triton 3.9, ptxas -v,
# bf16, num_stages 2, no GPU needed): the largest tile with which both the dQ and the dK/dV
# kernel (they share one config) keep everything in registers, or else the one that spills
# least. dK/dV holds k, v, dk and dv in registers, so it is what forces the smaller tiles.
_BWD_DEFAULTS = {
    (True, True): {"dilated": _cfg(64, 64, 8, 2), "block_sparse": _cfg(64, 64, 8, 2), "ring_step": _cfg(64, 64, 8, 2)},
    (True, False): {"dilated": _cfg(32, 32, 4, 2),   # every candidate spills in dK/dV; this one 24 B
                    "block_sparse": _cfg(64, 32, 4, 2), "ring_step": _cfg(64, 32, 4, 2)},
    (False, True): {"dilated": _cfg(64, 32, 4, 2),   # dK/dV spills 8 B
                    "block_sparse": _cfg(64, 32, 4, 2), "ring_step": _cfg(64, 32, 4, 2)},
    (False, False): {"dilated": _cfg(64, 64, 8, 2), "block_sparse": _cfg(64, 32, 4, 2), "ring_step": _cfg(64, 64, 8, 2)},
}


# 16-bit defaults for head dims over 128 (D = 256), from the same ahead-of-time compile over
# 6-7 candidates on sm90 and sm80 (perf/aot/d256-bf16.csv): 8 warps halve the registers a
# thread needs for its rows of the wide accumulators. Every choice keeps both archs free of
# spills except block-sparse dK/dV on sm80 (484 B; 4-warp tiles spill 5-11 KB there).
_WIDE_HEAD_DEFAULTS = {
    "dilated_fwd": _cfg(64, 32, 8, 2), "block_sparse_fwd": _cfg(64, 32, 8, 2), "ring_step_fwd": _cfg(32, 64, 4, 2),
    "dilated_bwd": _cfg(32, 32, 8, 2), "block_sparse_bwd": _cfg(64, 16, 8, 2), "ring_step_bwd": _cfg(32, 32, 8, 2),
}


def shared_memory_estimate(kernel: str, config: dict, head_dim_padded: int, element_size: int) -> int:
    """Rough shared memory of a launch, in bytes: forward, the q tile plus the pipelined k, v
    tiles; backward, the pipelined q, dO tiles, the k, v tiles and a float32 score tile."""
    stages = max(1, config["num_stages"] - 1)
    m, n, d = config["BLOCK_M"], config["BLOCK_N"], head_dim_padded
    if element_size == 4:   # float32 dots are three tf32 products: split operands, about twice the space
        element_size = 8
    if kernel.endswith("_fwd"):
        return (m + stages * 2 * n) * d * element_size
    return (stages * 2 * m + 2 * n) * d * element_size + m * n * 4


def padded_head_dim(head_dim: int) -> int:
    """The kernels' head-dim tile: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def config_fits(kernel: str, config: dict, head_dim_padded: int, arch: Arch, dtype: torch.dtype) -> bool:
    """Whether the shared-memory estimate of `config` fits one block of `arch`. Before
    Ampere (no async copies) Triton lays operands out differently: the ahead-of-time compile
    for sm75/sm70 needs up to about twice the estimate."""
    factor = 2 if (7, 0) <= arch.capability < (8, 0) else 1
    element_size = torch.tensor([], dtype=dtype).element_size()
    limit = arch.shared_memory or 48 * 1024
    return factor * shared_memory_estimate(kernel, config, head_dim_padded, element_size) <= limit


def kernels_fit(kernels, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the Triton kernels in `kernels` can run this problem on this GPU: a config of
    each fits shared memory (no tile fits a Turing block for the backward at D = 256), and
    the GPU has TF32 tensor cores for float32 (Ampere on; before, the kernels' float32 dots
    are slow FMA loops with tiles that do not fit). Off-GPU: True."""
    if device.type != "cuda":
        return True
    padded = padded_head_dim(head_dim)
    arch = get_arch(device.index if device.index is not None else torch.cuda.current_device())
    if dtype == torch.float32 and arch.capability < (8, 0):
        return False
    return all(config_fits(k, select_config(k, dtype, padded, 1024, device), padded, arch, dtype) for k in kernels)


def default_config(kernel: str, head_dim_padded: int, arch: Arch, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The config used where configs/<arch>.json has no tuned entry. Forward kernels:
    64x64 tiles, 4 warps up to D=64 and 8 up to D=128 (no spills on sm80 or sm90); the
    backward kernels: _BWD_DEFAULTS; D > 128: _WIDE_HEAD_DEFAULTS; float32: small tiles.
    Then fewer stages, then smaller tiles, until the shared-memory estimate fits the arch."""
    big_smem = arch.shared_memory >= 160 * 1024
    backward = kernel.endswith("_bwd")
    if dtype == torch.float32:
        # three tf32 products per dot need about twice the registers and shared memory: every
        # tile spills at D=128 and 64x64 (s3) overflows an H100 block; 32x32 keeps spills
        # moderate (block-sparse backward: 64x32, where 32x32 spills 20 KB)
        cfg = _cfg(64 if kernel == "block_sparse_bwd" else 32, 32, 4, 2)
    elif head_dim_padded > 128:
        cfg = dict(_WIDE_HEAD_DEFAULTS[kernel])
    elif not backward:
        cfg = _cfg(64, 64, 4 if head_dim_padded <= 64 else 8, 3 if big_smem else 2)
    else:
        family = kernel.rsplit("_", 1)[0]
        cfg = dict(_BWD_DEFAULTS[(arch.capability >= (9, 0), head_dim_padded <= 64)][family])
    while not config_fits(kernel, cfg, head_dim_padded, arch, dtype):
        if cfg["num_stages"] > 1:
            cfg["num_stages"] -= 1
        elif max(cfg["BLOCK_M"], cfg["BLOCK_N"]) > 16:
            cfg["BLOCK_M" if cfg["BLOCK_M"] >= cfg["BLOCK_N"] else "BLOCK_N"] //= 2
            cfg["num_warps"] = 4   # smaller tiles than chosen: 8 warps would sit idle
        else:
            break
    return cfg


def seq_bucket(n: int) -> int:
    """Sequence-length bucket: the next power of two, at least 1024, at most 1M."""
    b = 1024
    while b < n and b < (1 << 20):
        b *= 2
    return b


def select_config(kernel: str, dtype: torch.dtype, head_dim_padded: int, seqlen: int,
                  device: torch.device) -> dict:
    """Tuned kernel config: one fixed config under the interpreter; on a GPU, the entry of
    configs/<arch>.json for (kernel, dtype, head dim, sequence bucket) that `perf tune`
    wrote, else default_config."""
    if device.type != "cuda":
        return dict(INTERPRETER_CONFIG)
    arch = get_arch(device.index if device.index is not None else torch.cuda.current_device())
    table = _load_arch_table(arch.name).get("kernels", {}).get(kernel, {})
    key = f"{str(dtype).removeprefix('torch.')}/d{head_dim_padded}/n{seq_bucket(seqlen)}"
    if key in table:
        return dict(table[key])
    # nearest tuned sequence bucket for the same dtype and head dim
    prefix = key.rsplit("/", 1)[0] + "/n"
    near = sorted((abs(int(k.rsplit("n", 1)[1]).bit_length() - seq_bucket(seqlen).bit_length()), k)
                  for k in table if k.startswith(prefix))
    if near:
        return dict(table[near[0][1]])
    return default_config(kernel, head_dim_padded, arch, dtype)


def kernel_options(dtype, device):
    """(DOT_FP32, PRECISION) for the kernels: under the interpreter multiply in float32 (its
    bf16 tl.dot is wrong). float32 inputs use "tf32x3" (three tf32 products: float32-level
    accuracy on tensor cores); "ieee" would mean plain FMA loops and compiles of minutes."""
    return device.type != "cuda", ("tf32x3" if dtype == torch.float32 else "tf32")


def last_dim_contiguous(x):
    """Kernels take any strides but need a unit stride on the head dim: copy only then."""
    return x if x.stride(-1) == 1 else x.contiguous()


def empty_result(q, k, v, return_lse: bool):
    """The result for an empty batch or sequence: empty out (and lse), still connected to
    q, k and v so that backward runs."""
    B, N, Hq, _ = q.shape
    tie = (q.sum() + k.sum() + v.sum()) * 0
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device) + tie
    lse = torch.zeros((B, Hq, N), dtype=torch.float32, device=q.device) + tie.float()
    return (out, lse) if return_lse else out
