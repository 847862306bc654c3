"""The dilated variant as the tools see it (ops/common/spec.py)."""
from __future__ import annotations

import math

from ..common.spec import DECODE_ODD_STRIDES, DECODE_POINTERS, KernelSpec, VariantSpec
from . import tiles  # noqa: F401  (registers the variant's rows of the default-config tables)

_MODULE = "triton_dilated.ops.dilated.kernels"
_TABLES = {"ITEMS": "i32", "PAT_W": "i32", "PAT_R": "i32", "PAT_OFF": "i32"}
_STATS = {"ROW_MAX": "fp32", "ROW_SUM": "fp32"}

LONGNET_W = (2048, 4096, 8192, 16384, 32768)
LONGNET_R = (1, 2, 4, 6, 12)


def longnet_patterns(n: int):
    """The LongNet schedule clipped to n (from N = 4096 on), else three patterns scaled to n."""
    if n >= 4096:
        return tuple(zip((min(w, n) for w in LONGNET_W), LONGNET_R))
    return ((n // 4, 1), (n // 2, 2), (n, 4))


def count_pairs(B, N, H, causal, *, segment_lengths, dilation_rates, mode="longnet", offsets="modulo") -> int:
    """(query, key) pairs the dilated patterns compute, summed over batch, heads and patterns
    (a key two patterns select counts twice: both are computed)."""
    from .patterns import head_offsets, pattern_pairs
    patterns = tuple(zip(segment_lengths, dilation_rates))
    return B * pattern_pairs(N, patterns, head_offsets(H, patterns, mode, offsets), causal)


def call(q, k, v, *, causal, backend="auto", segment_lengths, dilation_rates, mode="longnet", offsets="modulo"):
    from .interface import dilated_attention
    return dilated_attention(q, k, v, list(segment_lengths), list(dilation_rates), causal=causal, mode=mode,
                             offsets=offsets, backend=backend)


class DilatedProblem:
    """Random inputs of one shape under the LongNet schedule; forward/backward launch the
    kernels with a given config (None: the one the library picks)."""

    def __init__(self, B, N, H, D, dtype, device, causal, patterns=None, mode="longnet", offsets="modulo"):
        import torch

        from ..common.call import AttentionCall
        from .patterns import head_offsets
        gen = torch.Generator(device=device).manual_seed(0)
        self.q, self.k, self.v, self.do = (torch.randn(B, N, H, D, generator=gen, device=device).to(dtype)
                                           for _ in range(4))
        self.call = AttentionCall(causal, 1.0 / math.sqrt(D))
        self.patterns = tuple(patterns or longnet_patterns(N))
        self.table = head_offsets(H, self.patterns, mode, offsets)
        ws, rs = zip(*self.patterns)
        self.shape = (f"B={B} N={N} H={H} D={D} causal={causal} {mode} w={'/'.join(map(str, ws))} "
                      f"r={'/'.join(map(str, rs))}")
        self._stats = None

    def forward(self, config=None):
        from .kernels import dilated_forward
        return dilated_forward(self.q, self.k, self.v, self.patterns, self.table, self.call, config=config)

    def backward(self, config=None):
        from .kernels import dilated_backward
        if self._stats is None:   # the backward's inputs: one forward with the default config
            self._stats = self.forward(None)
        out, row_max, row_sum = self._stats
        return dilated_backward(self.do, None, self.q, self.k, self.v, out, row_max, row_sum, self.patterns,
                                self.table, self.call, config=config)


class DilatedDecodeProblem:
    """One decode step (DESIGN §5b): q (B, Nq, H, D), the last Nq positions of a cache of N
    positions k, v (B, N, kv_heads, D), under the LongNet schedule clipped to N. `decode`
    runs the public function (its decode path: Triton kernel or portable gather), `dense`
    dense SDPA over the same cache (the baseline, reading every key). For the perf decode
    sweep and perf/decode_vs_dense.py."""

    def __init__(self, B, N, H, D, dtype, device, causal=True, num_queries=1, kv_heads=None, patterns=None,
                 mode="longnet", offsets="modulo"):
        import torch

        from .decode import dilated_key_lists
        from .patterns import fit_patterns, head_offsets
        gen = torch.Generator(device=device).manual_seed(0)
        kv_heads = kv_heads or H
        self.q = torch.randn(B, num_queries, H, D, generator=gen, device=device).to(dtype)
        self.k, self.v = (torch.randn(B, N, kv_heads, D, generator=gen, device=device).to(dtype) for _ in range(2))
        self.causal, self.mode, self.offsets = causal, mode, offsets
        self.patterns = tuple(patterns or longnet_patterns(N))
        fitted = fit_patterns(self.patterns, N, H)
        # (query, key) pairs one step computes, summed over batch, queries and heads: the keys
        # the decode path reads (a key two patterns select counts twice)
        _, listed = dilated_key_lists(torch.arange(N - num_queries, N)[None], torch.tensor([N]), fitted,
                                      head_offsets(H, fitted, mode, offsets), causal)
        self.keys_read = B * int(listed.sum())
        ws, rs = zip(*self.patterns)
        self.shape = (f"B={B} N={N} Nq={num_queries} H={H} Hkv={kv_heads} D={D} causal={causal} {mode} "
                      f"w={'/'.join(map(str, ws))} r={'/'.join(map(str, rs))}")

    def decode(self, backend="auto"):
        from .interface import dilated_attention
        return dilated_attention(self.q, self.k, self.v, [w for w, _ in self.patterns],
                                 [r for _, r in self.patterns], causal=self.causal, mode=self.mode,
                                 offsets=self.offsets, backend=backend)

    def dense(self):
        """scaled_dot_product_attention of the queries over the whole cache (bottom-right
        causal: query i sees the first N - Nq + i + 1 keys)."""
        import torch
        import torch.nn.functional as F
        Nq, N = self.q.shape[1], self.k.shape[1]
        mask = None
        if self.causal and Nq > 1:
            mask = torch.arange(N, device=self.q.device)[None, :] <= torch.arange(N - Nq, N, device=self.q.device)[:, None]
        q, k, v = (x.transpose(1, 2) for x in (self.q, self.k, self.v))
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa).transpose(1, 2)


SPEC = VariantSpec(
    name="dilated",
    op_name="dilated_attention",
    kernels=(
        KernelSpec("dilated_fwd", _MODULE, "_dilated_fwd_kernel", "dilated_fwd",
                   pointers={"Q": "act", "K": "act", "V": "act", "O": "act", **_STATS, **_TABLES}),
        KernelSpec("dilated_bwd_dq", _MODULE, "_dilated_bwd_dq_kernel", "dilated_bwd",
                   pointers={"Q": "act", "K": "act", "V": "act", "DO": "act", "DQ": "act", "DELTA": "fp32",
                             **_STATS, **_TABLES}),
        KernelSpec("dilated_bwd_dkdv", _MODULE, "_dilated_bwd_dkdv_kernel", "dilated_bwd",
                   pointers={"Q": "act", "K": "act", "V": "act", "DO": "act", "DK": "act", "DV": "act",
                             "DELTA": "fp32", **_STATS, **_TABLES}),
        # decoding (q of 1-16 rows against a long cache); configs: the forward's family
        KernelSpec("dilated_decode", "triton_dilated.ops.dilated.decode_kernels", "_dilated_decode_kernel",
                   "dilated_fwd", pointers={"Q": "act", "K": "act", "V": "act", **DECODE_POINTERS, "LENS": "i32",
                                            "PAT_W": "i32", "PAT_R": "i32", "PAT_OFF": "i32", "BLOCK_TABLE": "i32",
                                            "K_DESCALE": "fp32", "V_DESCALE": "fp32"},
                   odd_strides=DECODE_ODD_STRIDES),
        # the merge of the decode splits, shared with block-sparse decoding (ops/common)
        KernelSpec("decode_merge", "triton_dilated.ops.common.decode_kernels", "_decode_merge_kernel", "dilated_fwd",
                   pointers=DECODE_POINTERS, odd_strides=DECODE_ODD_STRIDES),
    ),
    # FLAT_LOOP: the launchers' default (configs.VARIANT_SWITCHES); PAGE_SIZE 0, KV_FP8 0: a contiguous
    # cache in q's dtype
    aot_constexprs={"NUM_PATTERNS": 3, "FLAT_LOOP": 1, "PAGE_SIZE": 0, "KV_FP8": 0},
    problem=DilatedProblem,
    pairs=count_pairs,
    call=call,
    baselines=("head_group_loop",),
)
