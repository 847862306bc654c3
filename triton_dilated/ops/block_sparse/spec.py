"""The block-sparse variant as the tools see it (ops/common/spec.py)."""
from __future__ import annotations

import math

from ..common.spec import DECODE_ODD_STRIDES, DECODE_POINTERS, KernelSpec, VariantSpec
from . import tiles  # noqa: F401  (registers the variant's rows of the default-config tables)

_MODULE = "triton_dilated.ops.block_sparse.kernels"
_STATS = {"ROW_MAX": "fp32", "ROW_SUM": "fp32"}
# block-list strides (in lists): any value, 0 broadcasts
_LAYOUT_STRIDES = frozenset({"stride_cb", "stride_ch"})


def count_pairs(B, N, H, causal, *, layout) -> int:
    """(query, key) pairs a block layout computes at sequence length N: every element of its
    active blocks (clipped to N), only p' <= p when causal; summed over batch and heads."""
    _, _, r, c = layout.pairs()
    bs = layout.block_size
    r, c = r.long().cpu(), c.long().cpu()
    rows = (N - r * bs).clamp(max=bs)
    cols = (N - c * bs).clamp(max=bs)
    if causal:   # diagonal blocks: the lower triangle; blocks above it: nothing
        cnt = (r > c) * rows * cols + (r == c) * (rows * (rows + 1) // 2)
    else:
        cnt = rows * cols
    lb, lh = layout.kv_num_blocks.shape[:2]
    return int(cnt.sum()) * (B // lb) * (H // lh)


def call(q, k, v, *, causal, backend="auto", layout):
    from .interface import block_sparse_attention
    return block_sparse_attention(q, k, v, layout, causal=causal, backend=backend)


class BlockSparseProblem:
    """Random inputs of one shape under a BigBird layout (window 1, one global block, three
    random blocks); forward/backward launch the kernels with a given config."""

    def __init__(self, B, N, H, D, dtype, device, causal, block_size=128):
        import torch

        from ..common.call import AttentionCall
        from .builders import bigbird
        gen = torch.Generator(device=device).manual_seed(0)
        self.q, self.k, self.v, self.do = (torch.randn(B, N, H, D, generator=gen, device=device).to(dtype)
                                           for _ in range(4))
        self.call = AttentionCall(causal, 1.0 / math.sqrt(D))
        bs = min(block_size, max(16, N // 4))
        self.layout = bigbird(N, bs, window=1, num_global_blocks=1, num_random=3, num_heads=H,
                              causal=causal).to(device)
        self.shape = f"B={B} N={N} H={H} D={D} causal={causal} bigbird(window=1,global=1,random=3) block={bs}"
        self._stats = None

    def forward(self, config=None):
        from .kernels import block_sparse_forward
        return block_sparse_forward(self.q, self.k, self.v, self.layout, self.call, config=config)

    def backward(self, config=None):
        from .kernels import block_sparse_backward
        if self._stats is None:
            self._stats = self.forward(None)
        out, row_max, row_sum = self._stats
        return block_sparse_backward(self.do, None, self.q, self.k, self.v, out, row_max, row_sum, self.layout,
                                     self.call, config=config)


SPEC = VariantSpec(
    name="block_sparse",
    op_name="block_sparse_attention",
    kernels=(
        KernelSpec("block_sparse_fwd", _MODULE, "_block_sparse_fwd_kernel", "block_sparse_fwd",
                   pointers={"Q": "act", "K": "act", "V": "act", "O": "act", **_STATS, "KV_BOUNDS": "i32",
                             "KV_INDEX": "i32"}, odd_strides=_LAYOUT_STRIDES),
        KernelSpec("block_sparse_bwd_dq", _MODULE, "_block_sparse_bwd_dq_kernel", "block_sparse_bwd",
                   pointers={"Q": "act", "K": "act", "V": "act", "DO": "act", "DQ": "act", "DELTA": "fp32", **_STATS,
                             "KV_BOUNDS": "i32", "KV_INDEX": "i32"}, odd_strides=_LAYOUT_STRIDES),
        KernelSpec("block_sparse_bwd_dkdv", _MODULE, "_block_sparse_bwd_dkdv_kernel", "block_sparse_bwd",
                   pointers={"Q": "act", "K": "act", "V": "act", "DO": "act", "DK": "act", "DV": "act",
                             "DELTA": "fp32", **_STATS, "Q_BOUNDS": "i32", "Q_INDEX": "i32"},
                   odd_strides=_LAYOUT_STRIDES),
        # decoding (q of 1-16 rows against a long cache); configs: the forward's family
        KernelSpec("block_sparse_decode", "triton_dilated.ops.block_sparse.decode_kernels",
                   "_block_sparse_decode_kernel", "block_sparse_fwd",
                   pointers={"Q": "act", "K": "act", "V": "act", **DECODE_POINTERS, "LENS": "i32", "KV_COUNT": "i32",
                             "KV_INDEX": "i32", "BLOCK_TABLE": "i32", "DESCALES": "fp32"},
                   odd_strides=_LAYOUT_STRIDES | DECODE_ODD_STRIDES),
    ),
    aot_constexprs={"BLOCK_SIZE": 128, "PAGE_SIZE": 0, "KV_FP8": 0},   # 0, 0: a contiguous cache in q's dtype
    problem=BlockSparseProblem,
    pairs=count_pairs,
    call=call,
    baselines=("flex",),
)
