"""aten ops and Triton launches of one serve decode step with and without FlashAttention's
rotary tables (issue 33 item 1: rotary fused into the Triton append), counted, not timed: a
TorchDispatchMode counts the aten ops the door runs outside the kernels (the interpreter's own
tensor traffic while a kernel runs is left out), and the append and decode kernels' launches are
counted by wrapping them. Runs on the CPU under the Triton interpreter (the same Python route a
GPU step takes; the numbers do not depend on the machine).

A decode step: B = 2, one query and one new row, Hq = 8, Hkv = 2, D = 64, a 256-row cache, the
dilated door (segments 64, 128; rates 1, 2) and the block-sparse door (local layout), rotary over
all 64 features (GPT-NeoX pairs), causal. Point PYTHONPATH at an older checkout to count its route.

    TRITON_INTERPRET=1 python perf/rotary_append_ops.py
"""
from __future__ import annotations

import collections
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import triton_dilated  # noqa: E402
from triton_dilated import block_sparse_attention_with_kvcache, dilated_attention_with_kvcache, layouts  # noqa: E402
from triton_dilated.ops.block_sparse import decode_kernels as bs_kernels  # noqa: E402
from triton_dilated.ops.common import decode_kernels as common_kernels  # noqa: E402
from triton_dilated.ops.dilated import decode_kernels as dl_kernels  # noqa: E402

VIEWS = {"alias", "slice", "unsqueeze", "view", "expand", "select", "as_strided", "t", "transpose", "permute"}
ops, launches, inside = collections.Counter(), collections.Counter(), [False]


class CountOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not inside[0]:
            ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class CountLaunches:
    """A kernel whose launches are counted (and whose interpreted run is not counted as ops)."""

    def __init__(self, name, kernel):
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            launches[self.name] += 1
            inside[0] = True
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                inside[0] = False
        return launch


def main() -> None:
    for module, name in ((common_kernels, "_append_rows_kernel"), (common_kernels, "_decode_merge_kernel"),
                         (dl_kernels, "_dilated_decode_kernel"), (bs_kernels, "_block_sparse_decode_kernel")):
        setattr(module, name, CountLaunches(name, getattr(module, name)))
    B, NK, HQ, HKV, D = 2, 256, 8, 2, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 1, HQ, D, generator=g)
    k, v = torch.randn(B, 1, HKV, D, generator=g), torch.randn(B, 1, HKV, D, generator=g)
    angles = torch.arange(NK, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(D // 2) / (D // 2))
    cos, sin = angles.cos().float(), angles.sin().float()
    lens = torch.tensor([100, 180], dtype=torch.int32)
    layout = layouts.local(NK, 32, 2, causal=True)
    doors = {
        "dilated": lambda kc, vc, **kw: dilated_attention_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=lens, segment_lengths=[64, 128], dilation_rates=[1, 2], backend="triton",
            **kw),
        "block_sparse": lambda kc, vc, **kw: block_sparse_attention_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=lens, layout=layout, backend="triton", **kw)}
    print(f"package: {os.path.dirname(triton_dilated.__file__)}")
    for name, door in doors.items():
        for rotary in (False, True):
            kw = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False) if rotary else {}
            kc, vc = torch.randn(B, NK, HKV, D, generator=g), torch.randn(B, NK, HKV, D, generator=g)
            door(kc.clone(), vc.clone(), **kw)   # warm-up: the plans
            ops.clear()
            launches.clear()
            with CountOps():
                door(kc, vc, **kw)
            compute = sum(n for op, n in ops.items() if op not in VIEWS)
            print(f"{name:12s} rotary={rotary!s:5s}: {sum(ops.values()):3d} aten ops ({compute} not views), "
                  f"{sum(launches.values())} Triton launches {dict(launches)}; {dict(sorted(ops.items()))}")


if __name__ == "__main__":
    main()
