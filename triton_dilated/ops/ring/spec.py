"""The ring-local-block step as the tools see it (ops/common/spec.py)."""
from __future__ import annotations

import math

from ..common.spec import KernelSpec, VariantSpec, dense_pairs
from . import tiles  # noqa: F401  (registers the variant's rows of the default-config tables)
from .mask import MASK_DILATED

_MODULE = "triton_dilated.ops.ring.step_kernels"
# positions, the mask descriptor (ring/mask.py), the tile lists, packed documents' ids
_TABLES = {"Q_POS": "i32", "K_POS": "i32", "MASK": "i32", "TILES": "i32", "Q_DOC": "i32", "K_DOC": "i32"}


def count_pairs(B, N, H, causal, *, segment_lengths=None, dilation_rates=None, layout=None, mode="longnet",
                offsets="modulo") -> int:
    """(query, key) pairs ring_attention computes over the global sequence: dilated patterns,
    a block layout, or dense, as its arguments choose (summed over ranks, batch and heads)."""
    if segment_lengths:
        from ..dilated.spec import count_pairs as dilated
        return dilated(B, N, H, causal, segment_lengths=segment_lengths, dilation_rates=dilation_rates, mode=mode,
                       offsets=offsets)
    if layout is not None:
        from ..block_sparse.spec import count_pairs as blocks
        return blocks(B, N, H, causal, layout=layout)
    return dense_pairs(B, H, N, causal)


class RingStepProblem:
    """One ring step on one device: the local queries against a shard of the same length
    under a dilated mask (the LongNet schedule at this N), forward and backward."""

    def __init__(self, B, N, H, D, dtype, device, causal):
        import torch

        from ..common.call import AttentionCall
        from ..dilated.patterns import head_offsets
        from ..dilated.spec import longnet_patterns
        from .mask import StepMask
        gen = torch.Generator(device=device).manual_seed(0)
        self.q, self.k, self.v, self.do = (torch.randn(B, N, H, D, generator=gen, device=device).to(dtype)
                                           for _ in range(4))
        self.call = AttentionCall(causal, 1.0 / math.sqrt(D))
        patterns = longnet_patterns(N)
        self.mask = StepMask(MASK_DILATED, causal, device, patterns=patterns,
                             table=head_offsets(H, patterns, "longnet", "modulo"))
        self.pos = torch.arange(N, dtype=torch.int32, device=device)
        self.shape = f"B={B} N={N} H={H} D={D} causal={causal} ring step, dilated mask"

    def _state(self):
        import torch
        B, N, H, D = self.q.shape
        out = torch.zeros(B, N, H, D, dtype=torch.float32, device=self.q.device)
        lse = torch.full((B, H, N), float("-inf"), dtype=torch.float32, device=self.q.device)
        return out, lse

    def forward(self, config=None):
        from .step_kernels import step_forward
        out, lse = self._state()
        step_forward(self.q, self.k, self.v, self.pos, self.pos, out, lse, self.mask, self.call, config=config)
        return out, lse

    def backward(self, config=None):
        import torch

        from ..common.lse import softmax_delta
        from .step_kernels import step_backward
        out, lse = self.forward(None)
        delta = softmax_delta(self.do, out.to(self.q.dtype))
        grads = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (self.q, self.k, self.v)]
        step_backward(self.q, self.k, self.v, self.do, lse, delta, self.pos, self.pos, *grads, self.mask,
                      self.call, config=config)
        return grads


SPEC = VariantSpec(
    name="ring_step",
    op_name="ring_attention",
    kernels=(
        KernelSpec("ring_step_fwd", _MODULE, "_ring_step_fwd_kernel", "ring_step_fwd",
                   pointers={"Q": "act", "K": "act", "V": "act", "OUT": "fp32", "LSE": "fp32", **_TABLES}),
        KernelSpec("ring_step_bwd_dq", _MODULE, "_ring_step_bwd_dq_kernel", "ring_step_bwd",
                   pointers={"Q": "act", "K": "act", "V": "act", "DO": "act", "LSE": "fp32", "DELTA": "fp32",
                             "DQ": "fp32", **_TABLES}),
        KernelSpec("ring_step_bwd_dkdv", _MODULE, "_ring_step_bwd_dkdv_kernel", "ring_step_bwd",
                   pointers={"Q": "act", "K": "act", "V": "act", "DO": "act", "LSE": "fp32", "DELTA": "fp32",
                             "DK": "fp32", "DV": "fp32", **_TABLES}),
        # the per-step lists of active tiles the three kernels above walk (compiled with the
        # forward's tiles; the backward builds its lists with its own)
        KernelSpec("ring_step_lists", _MODULE, "_ring_tile_lists_kernel", "ring_step_fwd",
                   pointers=_TABLES),
    ),
    aot_constexprs={"NUM_PATTERNS": 3, "MASK_KIND": MASK_DILATED, "BY_KEY": False, "DOCS": False},
    problem=RingStepProblem,
    pairs=count_pairs,
)
