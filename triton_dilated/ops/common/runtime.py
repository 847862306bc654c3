"""Backend dispatch (DESIGN §7), GPU architecture detection and tuned configs (DESIGN §8)."""
from __future__ import annotations

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
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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


def triton_can_target(device: torch.device) -> bool:
    """Triton compiles for Volta (sm70) and newer; older cards take the portable path."""
    if device.type == "cuda":
        return triton_importable() and torch.cuda.get_device_capability(device) >= (7, 0)
    return device.type == "cpu" and interpreter_enabled() and triton_importable()


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map `backend` to "triton" or "torch" for tensors on `device` (DESIGN §7)."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if triton_can_target(device):
        return "triton"
    if backend == "auto":
        return "torch"
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


def _fallback_config(head_dim_padded: int, arch: Arch) -> dict:
    big_smem = arch.shared_memory >= 160 * 1024
    if head_dim_padded > 128:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2 if big_smem else 1}
    if head_dim_padded > 64:
        return {"BLOCK_M": 128 if big_smem else 64, "BLOCK_N": 64, "num_warps": 8 if big_smem else 4,
                "num_stages": 3 if big_smem else 2}
    return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3 if big_smem else 2}


def seq_bucket(n: int) -> int:
    """Sequence-length bucket: the next power of two, at least 1024, at most 1M."""
    b = 1024
    while b < n and b < (1 << 20):
        b *= 2
    return b


def select_config(kernel: str, dtype: torch.dtype, head_dim_padded: int, seqlen: int,
                  device: torch.device) -> dict:
    """Tuned kernel config: one fixed config under the interpreter; on a GPU, the entry of
    configs/<arch>.json for (kernel, dtype, head dim, sequence bucket), else a default
    sized by head dim and shared memory."""
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
    return _fallback_config(head_dim_padded, arch)


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
