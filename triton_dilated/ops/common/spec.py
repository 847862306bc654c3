"""What the tools (perf aot, tune, bench) need to know about a variant, declared once in the
variant's spec.py: its kernels, their config families, how to compile them ahead of time,
a problem factory (inputs and calls of the launchers for one shape), the public function,
a pair counter (the FLOP count) and the benchmark baselines that compute the same thing.
The tools iterate over `triton_dilated.ops.SPECS`: adding a variant is its folder, its spec
and its tests."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

BWD_FLOP_FACTOR = 2.5        # backward = 2.5x forward (DESIGN §11): forward+backward counts 3.5x

# The decode kernels' result and split-partial pointers (ops/common/decode_kernels.py)
DECODE_POINTERS = {"O": "act", "LSE": "fp32", "PARTS": "fp32", "LEFTPAD": "i32"}   # LEFTPAD: cache_leftpad (B,)
DECODE_ODD_STRIDES = frozenset({"stride_btb"})   # stride_btb: max_pages

# The serve doors' append (ops/common/decode_kernels.py: new k, v rows into the cache, with
# rotary the rotated q too): no variant's kernel, so `perf aot` compiles it only when named
# (perf/aot.py NAMED_KERNELS; the default sweep and its committed CSVs list the variants'
# kernels). The head-dim strides are 1 at run time (Triton specializes them): odd here.
APPEND_POINTERS = {"K_CACHE": "act", "V_CACHE": "act", "K": "act", "V": "act", "LENS": "i32", "BLOCK_TABLE": "i32",
                   "K_DESCALE": "fp32", "V_DESCALE": "fp32", "Q": "act", "Q_ROT": "act", "COS": "act", "SIN": "act"}
APPEND_ODD_STRIDES = frozenset({"stride_btb", "stride_ckd", "stride_cvd", "stride_kd", "stride_vd"})


def dense_pairs(B: int, H: int, N: int, causal: bool) -> int:
    """(query, key) pairs of dense attention over N positions (p' <= p when causal)."""
    return B * H * (N * (N + 1) // 2 if causal else N * N)


def attention_flops(pairs: int, D: int, backward: bool = False) -> float:
    """Forward 4*D per (query, key) pair (QK^T and PV); with the backward 2.5x more."""
    return 4.0 * D * pairs * (1.0 + BWD_FLOP_FACTOR if backward else 1.0)


@dataclass(frozen=True)
class KernelSpec:
    name: str                 # the name in AOT CSVs: "dilated_bwd_dkdv"
    module: str               # where the @triton.jit function lives
    attr: str                 # its attribute name there
    family: str               # its config family: "dilated_bwd" (configs/)
    # every pointer argument and its element type: "act" (the activation dtype), "fp32",
    # "i32", "i8"; the other non-constexpr arguments are int32, but for `floats` (fp32)
    pointers: Mapping[str, str] = field(default_factory=dict)
    floats: frozenset = frozenset({"sm_scale"})
    # stride_* arguments the JIT would not see as multiples of 16 (index tables)
    odd_strides: frozenset = frozenset()

    def load(self):
        """The @triton.jit function (imports the kernel file, hence triton)."""
        import importlib
        return getattr(importlib.import_module(self.module), self.attr)


@dataclass(frozen=True)
class VariantSpec:
    name: str                            # "dilated"
    op_name: str                         # the public function: "dilated_attention"
    kernels: tuple                       # KernelSpec, ...
    aot_constexprs: Mapping[str, object]  # constexprs an AOT compile needs beyond tiles and head dim
    # problem(B, N, H, D, dtype, device, causal) -> an object with .forward(config) and
    # .backward(config) launching the kernels, and .shape (a label)
    problem: Callable
    # pairs(B, N, H, causal, **params) -> int: the (query, key) pairs one call computes,
    # summed over batch and heads (a pair two patterns select counts twice: both are
    # computed); params are the op's pattern arguments, as `call` takes them
    pairs: Callable | None = None
    # call(q, k, v, *, causal, backend, **params) -> out: the public function (benchmarks)
    call: Callable | None = None
    # names of the perf baselines (perf/baselines.py BASELINES) that compute the same attention
    baselines: tuple = ()
    # A variant whose launchers pick tiles by a rule of their own instead of the config families
    # (configs/, `perf tune`): launch_tiles(kernel, head_dim, dtype, extra, arch) -> a kernel's
    # launch config (BLOCK_M, BLOCK_N as the CSVs name the two tile sizes, num_warps, num_stages,
    # and the kernel's own tile constexprs by name) for an AOT compile; extra: the AOT variant's
    # settings
    launch_tiles: Callable | None = None

    def flops(self, B: int, N: int, H: int, D: int, causal: bool, backward: bool = False, **params) -> float:
        """FLOPs of one call (forward, or forward and backward): only the computed pairs count."""
        return attention_flops(self.pairs(B, N, H, causal, **params), D, backward)

    @property
    def families(self) -> tuple:
        """The config families `perf tune` sweeps, forward first (none where the variant has
        its own tile rule)."""
        if self.launch_tiles is not None:
            return ()
        return tuple(dict.fromkeys(k.family for k in self.kernels))


APPEND_KERNEL = KernelSpec("append", "triton_dilated.ops.common.decode_kernels", "_append_rows_kernel", "dilated_fwd",
                           pointers=APPEND_POINTERS, odd_strides=APPEND_ODD_STRIDES)
