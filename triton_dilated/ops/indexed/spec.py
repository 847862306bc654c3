"""The indexed variant as the tools see it (ops/common/spec.py): its kernels, a problem factory
(DeepSeek's shape: random top-k rows under a causal cut), the pair counter, the public call, its
benchmark baseline (a PyTorch gather) and its launch tiles: tiles.py's rule (per MMA family, not
config families that `perf tune` sweeps; `launch_tiles` gives `perf aot` the launchers' tiles)."""
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


# q heads per kv head in the AOT compiles: DeepSeek V3.2's 128 heads on 8 GPUs (16 per GPU) over the
# one latent kv head of absorbed MLA; the prefill launches differ only in BLOCK_H (16 either way)
AOT_GROUP = 16


def launch_tiles(kernel, head_dim, dtype, extra, arch) -> dict:
    """The tiles the launchers use on GPU arch `arch` (None: the CPU interpreter's) for `kernel`
    at head dim `head_dim`, Dv = extra["HEAD_DIM_V"] (else the same) and extra["GROUP"] (else
    AOT_GROUP) q heads per kv head. BLOCK_M, BLOCK_N name the (rows, keys) tile as the CSVs do:
    (BLOCK_H, BLOCK_K) forward and dQ, (heads, BLOCK_R) dK/dV, (BLOCK_HH, BLOCK_T) the indexer."""
    import torch

    from ..common.hardware import padded_head_dim
    from .tiles import compiled_indexer_tiles, compiled_tiles, indexed_tiles, indexer_tiles
    group = extra.get("GROUP", AOT_GROUP)
    device = torch.device("cpu" if arch is None else "cuda")
    if kernel == "indexer_scores":
        t = indexer_tiles(group, device) if arch is None else compiled_indexer_tiles(group, arch)
        return dict(t, BLOCK_M=t["BLOCK_HH"], BLOCK_N=t["BLOCK_T"])
    head_dim_v = extra.get("HEAD_DIM_V", head_dim)
    t = (indexed_tiles(group, head_dim, head_dim_v, dtype, device) if arch is None
         else compiled_tiles(group, head_dim, head_dim_v, dtype, arch))
    stages = t["forward_stages"] if kernel == "indexed_fwd" else t["num_stages"]
    cfg = dict(num_warps=t["num_warps"], num_stages=stages, HEAD_DIM_V=head_dim_v,
               BLOCK_DV=padded_head_dim(head_dim_v))
    if kernel == "indexed_bwd_dkdv":   # as indexed_backward launches it: the heads tile at most BLOCK_R
        heads = min(t["BLOCK_R"], 1 << (group - 1).bit_length())
        return dict(cfg, BLOCK_H=heads, BLOCK_R=t["BLOCK_R"], BLOCK_M=heads, BLOCK_N=t["BLOCK_R"])
    return dict(cfg, BLOCK_H=t["BLOCK_H"], BLOCK_K=t["BLOCK_K"], BLOCK_M=t["BLOCK_H"], BLOCK_N=t["BLOCK_K"])


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
    baselines=("gather",),
    launch_tiles=launch_tiles,
)
