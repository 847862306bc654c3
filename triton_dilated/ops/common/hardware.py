"""What the kernels need to know about the machine: the GPU architecture (cached), its facts
from one table (ARCH_TABLE), and the head-dim tile. No triton import: the portable backend
runs without it.

Config rules and kernel switches key on an architecture's facts (its tensor-core family,
shared memory, TMA, ...), never on a compute-capability comparison: consumer Blackwell
(sm120) has a higher capability than Hopper but no warpgroup MMA, and PyTorch on ROCm
reports an MI300X as capability (9, 4).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch

KIB = 1024


@dataclass(frozen=True)
class ArchFacts:
    """What one GPU architecture offers the kernels."""
    vendor: str           # "nvidia" or "amd"
    mma: str              # the tensor-core instructions Triton emits for tl.dot: "mma.sync" (Ampere, Ada,
    #                       consumer Blackwell), "wgmma" (Hopper), "tcgen05" (datacenter Blackwell), "mfma" (CDNA),
    #                       "fma": none, FMA loops (Volta, Turing: Triton 3.9 emits no mma.sync before sm80)
    shared_memory: int    # bytes per block (the opt-in maximum) or LDS bytes per workgroup
    warp_size: int        # threads per warp (NVIDIA) or wavefront (AMD CDNA)
    tma: bool             # the tensor memory accelerator (cp.async.bulk.tensor)
    async_copy: bool      # cp.async global -> shared copies (Ampere on): Triton's software pipelining
    tf32: bool            # float32 dots on tensor cores (the kernels' float32 path needs it)
    example: str = ""     # cards of this architecture, for messages and the README
    warp_specialize: bool = False   # Triton's automatic warp specialization (tl.range(..., warp_specialize=True))
    #                       splits a loop into load/MMA/softmax partitions here: sm100 with Triton 3.9 (sm90:
    #                       the block-sparse forward compiles unpartitioned; it partitions descriptor loads only)


# One row per architecture the library knows; `perf aot` compiles for the NVIDIA rows and the
# AMD rows. Shared memory: CUDA's opt-in maximum per block (sm80: 163 KiB; sm86/89/120: 99 KiB;
# sm90/100: 227 KiB); LDS per workgroup on CDNA (MI300: 64 KiB, MI355: 160 KiB).
ARCH_TABLE = {
    "sm70": ArchFacts("nvidia", "fma", 96 * KIB, 32, False, False, False, "V100"),
    "sm75": ArchFacts("nvidia", "fma", 64 * KIB, 32, False, False, False, "T4, RTX 20"),
    "sm80": ArchFacts("nvidia", "mma.sync", 163 * KIB, 32, False, True, True, "A100, A30"),
    "sm86": ArchFacts("nvidia", "mma.sync", 99 * KIB, 32, False, True, True, "RTX 30, A10, A40"),
    "sm89": ArchFacts("nvidia", "mma.sync", 99 * KIB, 32, False, True, True, "RTX 40, L4, L40S"),
    "sm90": ArchFacts("nvidia", "wgmma", 227 * KIB, 32, True, True, True, "H100, H200, GH200"),
    "sm100": ArchFacts("nvidia", "tcgen05", 227 * KIB, 32, True, True, True, "B200, GB200", warp_specialize=True),
    "sm120": ArchFacts("nvidia", "mma.sync", 99 * KIB, 32, True, True, True, "RTX 50, RTX PRO 6000"),
    "gfx942": ArchFacts("amd", "mfma", 64 * KIB, 64, False, False, False, "MI300X, MI300A, MI325X"),
    "gfx950": ArchFacts("amd", "mfma", 160 * KIB, 64, False, False, False, "MI350X, MI355X"),
}
# The MMA families whose tiles are laid out per warpgroup (4 warps, 64 rows each): the
# 128-row, 8-warp Hopper defaults (the variants' tiles.py) are made for these.
WARPGROUP_MMA = ("wgmma", "tcgen05")
# The interpreter (off-GPU): no hardware limits apply.
INTERPRETER_FACTS = ArchFacts("none", "interpreter", 0, 32, False, False, True)


def arch_facts(name: str, capability: tuple = (0, 0)) -> ArchFacts:
    """The facts of architecture `name` ("sm90", "gfx942"). An NVIDIA name the table lacks
    takes the row of the nearest older architecture of the same major version (sm87 -> sm86;
    sm103 -> sm100; sm121 -> sm120), else the nearest older one; an unknown CDNA "gfx9.."
    takes gfx942's row. Anything else: ValueError naming the known architectures."""
    if name in ARCH_TABLE:
        return ARCH_TABLE[name]
    if name == "cpu-interpreter":
        return INTERPRETER_FACTS
    if name.startswith("sm") and name[2:].isdigit():
        major, minor = capability if capability != (0, 0) else (int(name[2:-1]), int(name[-1]))
        known = sorted((int(n[2:-1]), int(n[-1]), n) for n in ARCH_TABLE if n.startswith("sm"))
        older = [n for a, b, n in known if (a, b) <= (major, minor)]
        same_major = [n for a, b, n in known if a == major and (a, b) <= (major, minor)]
        if same_major or older:
            return ARCH_TABLE[(same_major or older)[-1]]
    if name.startswith("gfx9"):
        return ARCH_TABLE["gfx942"]
    raise ValueError(f"unknown GPU architecture {name!r}: known are {', '.join(ARCH_TABLE)} "
                     f"(and newer NVIDIA minor versions of those)")


@dataclass(frozen=True)
class Arch:
    """One GPU as the kernels see it: its name, capability, shared memory per block, SM
    count, and the facts of its architecture (from ARCH_TABLE by name unless given)."""
    name: str               # "sm90", "gfx942", "cpu-interpreter", ...
    capability: tuple        # (major, minor) as PyTorch reports it; (0, 0) off-GPU
    shared_memory: int       # bytes per block (opt-in maximum)
    sm_count: int
    device_name: str
    facts: ArchFacts = field(default=None, compare=False)

    def __post_init__(self):
        if self.facts is None:
            object.__setattr__(self, "facts", arch_facts(self.name, self.capability))

    vendor = property(lambda self: self.facts.vendor)
    mma = property(lambda self: self.facts.mma)
    warp_size = property(lambda self: self.facts.warp_size)
    tma = property(lambda self: self.facts.tma)
    async_copy = property(lambda self: self.facts.async_copy)
    tf32 = property(lambda self: self.facts.tf32)
    warp_specialize = property(lambda self: self.facts.warp_specialize)
    warpgroup_mma = property(lambda self: self.facts.mma in WARPGROUP_MMA)


def fake_arch(name: str, sm_count: int = 100) -> Arch:
    """An Arch for `name` with its table facts, as if a card of it were present: for the
    ahead-of-time compile and for tests of the config rules (no GPU needed)."""
    facts = arch_facts(name)
    capability = (int(name[2:-1]), int(name[-1])) if name.startswith("sm") else \
        {"gfx942": (9, 4), "gfx950": (9, 5)}.get(name, (9, 0))   # what PyTorch on ROCm reports
    return Arch(name, capability, facts.shared_memory, sm_count, f"{name} (fake: {facts.example or 'no card'})",
                facts)


def _rocm_arch_name(props) -> str:
    """"gfx942" from a ROCm device's gcnArchName ("gfx942:sramecc+:xnack-")."""
    return (getattr(props, "gcnArchName", "") or "gfx").split(":")[0]


@functools.lru_cache(maxsize=None)
def get_arch(device_index: int | None = None) -> Arch:
    """Cached description of the GPU (or of the CPU interpreter when no GPU is used). A ROCm
    device is named by its gcnArchName (torch.version.hip is set), not by the CUDA-style
    capability PyTorch reports for it."""
    if device_index is None or not torch.cuda.is_available():
        return Arch("cpu-interpreter", (0, 0), 0, os.cpu_count() or 1, "cpu")
    props = torch.cuda.get_device_properties(device_index)
    cap = (props.major, props.minor)
    name = _rocm_arch_name(props) if torch.version.hip else f"sm{cap[0]}{cap[1]}"
    try:
        facts = arch_facts(name, cap)
    except ValueError:   # an architecture the table cannot place: the most conservative known row
        facts = ARCH_TABLE["gfx942" if torch.version.hip else "sm75"]
    smem = getattr(props, "shared_memory_per_block_optin", 0) or facts.shared_memory or 48 * KIB
    return Arch(name, cap, smem, props.multi_processor_count, props.name, facts)


def device_arch(device: torch.device) -> Arch:
    """get_arch for a CUDA device (its index, or the current device)."""
    return get_arch(device.index if device.index is not None else torch.cuda.current_device())


def padded_head_dim(head_dim: int) -> int:
    """The kernels' head-dim tile: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (head_dim - 1).bit_length())
