"""What the tools (perf aot, tune, bench) need to know about a variant, declared once in the
variant's spec.py: its kernels, their config families, how to compile them ahead of time,
a problem factory (inputs and calls of the launchers for one shape) and a pair counter.
The tools iterate over `triton_dilated.ops.SPECS`: adding a variant is its folder, its spec
and its tests."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping


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

    @property
    def families(self) -> tuple:
        """The config families, forward first."""
        return tuple(dict.fromkeys(k.family for k in self.kernels))
