"""The indexed variant as the tools see it (ops/common/spec.py): its kernels, a problem factory
(DeepSeek's shape: random top-k rows under a causal cut), the pair counter and the public call.

Not yet in ops.SPECS: registering it adds its kernels to `perf aot`, whose committed CSVs (and
the arch-table tests that read them) need rows compiled for every arch first, and its launch
tiles are tiles.py's rule rather than the config families `perf tune` sweeps.
"""
from __future__ import annotations

from ..common.spec import KernelSpec, VariantSpec

_MODULE = "triton_dilated.ops.indexed.kernels"
_STATS = {"ROW_MAX": "fp32", "ROW_SUM": "fp32"}
_SLOTS = {"SLOTS": "i32", "COUNT": "i32"}


def count_pairs(B, N, H, causal, *, indices) -> int:
    """(query, key) pairs one call computes: the used, distinct slots of each row (indices:
    (B, N, Hkv, topk) or (B, N, topk) for N queries against N keys), times the query heads
    reading each row, summed over batch."""
    from .indices import canonical_slots
    _, count = canonical_slots(indices, N, N, causal)
    return int(count.sum()) * (H // count.shape[2])


def call(q, k, v, *, causal, backend="auto", indices):
    from .interface import indexed_attention
    return indexed_attention(q, k, v, indices, causal=causal, backend=backend)


class IndexedProblem:
    """Random inputs of one shape: each query's top-k (default 2048, DeepSeek's) distinct keys
    drawn among its causal prefix (all keys without causal), shared by the heads; forward and
    backward launch the kernels."""

    def __init__(self, B, N, H, D, dtype, device, causal, topk=2048, head_dim_v=None):
        import torch

        from ..common.call import AttentionCall
        from .indices import canonical_slots
        gen = torch.Generator(device=device).manual_seed(0)
        Dv = head_dim_v or D
        self.q, self.k = (torch.randn(B, N, H, D, generator=gen, device=device).to(dtype) for _ in range(2))
        self.v, self.do = (torch.randn(B, N, H, Dv, generator=gen, device=device).to(dtype) for _ in range(2))
        topk = min(topk, N)
        scores = torch.rand(B, N, N, generator=gen, device=device)
        if causal:
            scores = scores.masked_fill(torch.ones(N, N, dtype=torch.bool, device=device).triu(1), -1.0)
        self.indices = scores.topk(topk, dim=-1).indices.to(torch.int32)
        self.slots, self.count = canonical_slots(self.indices, N, N, causal)
        self.call = AttentionCall(causal, D ** -0.5)
        self.shape = f"B={B} N={N} H={H} D={D} Dv={Dv} causal={causal} topk={topk}"
        self._stats = None

    def forward(self, config=None):
        from .kernels import indexed_forward
        return indexed_forward(self.q, self.k, self.v, self.slots, self.count, self.call)

    def backward(self, config=None):
        from .kernels import indexed_backward
        if self._stats is None:
            self._stats = self.forward()
        out, row_max, row_sum = self._stats
        return indexed_backward(self.do, None, self.q, self.k, self.v, out, row_max, row_sum, self.slots, self.count,
                                self.call)


SPEC = VariantSpec(
    name="indexed",
    op_name="indexed_attention",
    kernels=(
        KernelSpec("indexed_fwd", _MODULE, "_indexed_fwd_kernel", "indexed_fwd",
                   pointers={"Q": "act", "K": "act", "V": "act", "O": "act", **_STATS, **_SLOTS,
                             "BLOCK_TABLE": "i32", "K_DESCALE": "fp32", "V_DESCALE": "fp32"},
                   odd_strides=frozenset({"stride_btb"})),
        KernelSpec("indexed_bwd_dq", _MODULE, "_indexed_bwd_dq_kernel", "indexed_bwd",
                   pointers={"Q": "act", "K": "act", "V": "act", "DO": "act", "DQ": "act", "DELTA": "fp32", **_STATS,
                             **_SLOTS}),
        KernelSpec("indexed_bwd_dkdv", _MODULE, "_indexed_bwd_dkdv_kernel", "indexed_bwd",
                   pointers={"Q": "act", "K": "act", "V": "act", "DO": "act", "DK": "act", "DV": "act",
                             "DELTA": "fp32", **_STATS, "Q_START": "i32", "Q_LIST": "i32"}),
        KernelSpec("indexer_scores", _MODULE, "_indexer_scores_kernel", "indexed_fwd",
                   pointers={"Q": "act", "K": "act", "W": "fp32", "SCORES": "fp32"},
                   odd_strides=frozenset({"stride_wb", "stride_ws", "stride_wh"})),
    ),
    aot_constexprs={"PAGE_SIZE": 0, "PHYSICAL": False, "KV_FP8": 0},
    problem=IndexedProblem,
    pairs=count_pairs,
    call=call,
    baselines=(),
)
