"""What the kernels need to know about the machine: the GPU architecture (cached) and the
head-dim tile. No triton import: the portable backend runs without it."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch


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


def device_arch(device: torch.device) -> Arch:
    """get_arch for a CUDA device (its index, or the current device)."""
    return get_arch(device.index if device.index is not None else torch.cuda.current_device())


def padded_head_dim(head_dim: int) -> int:
    """The kernels' head-dim tile: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (head_dim - 1).bit_length())
