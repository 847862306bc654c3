"""The training door of dilated attention: `dilated_attention` (validation, backend
dispatch), the autograd Function over the Triton launchers, and the torch.library custom ops
(`dilated_attention_op`) that torch.compile traces, and what both doors run for queries at
the end of a longer key sequence (DESIGN §5b): the decode step (`decode_table`, its custom
op) and the query-offset path (`padded_call`). Per-row lengths, appends, paged and FP8
caches belong to the serve door (serve.py), the only place `cache_seqlens` exists.

Dispatch: the Triton kernels (kernels.py, imported only when used: the package runs without
triton) or the portable PyTorch path (portable.py); under torch.compile, either path through
the custom ops, so that fullgraph tracing sees one opaque op.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..common.call import AttentionCall
from ..common.masks import WindowPredicate
from ..common.first_order import first_order_backward, needs_grad
from ..common.kvcache import MAX_DECODE_QUERIES, portable_descaled
from ..common.lse import lse_from_stats
from ..common.op_support import check_path, empty_stats, fresh, lazy_module, recompute_grads, resolve_path
from ..common.query_offset import run_with_query_offset
from ..common.runtime import empty_result, last_dim_contiguous, portable_compute_dtype, resolve_backend
from ..common.validation import check_cu_seqlens, check_flags, check_qkv
from .decode import dilated_decode
from .patterns import check_head_slice, check_patterns, fit_patterns, head_table, warn_if_heads_first
from .plan import QueryWindow
from .portable import dilated_attention_torch

CONFIG_FAMILIES = ("dilated_fwd", "dilated_bwd")


_kernels = lazy_module(__package__ + ".kernels")                 # imports triton
_decode_kernels = lazy_module(__package__ + ".decode_kernels")   # imports triton

DECODE_FAMILIES = ("dilated_fwd",)


def check_args(q, k, v, segment_lengths, dilation_rates, causal, scale, mode, offsets, return_lse,
               softcap=0.0, sinks=None, allow_shorter_q=False, head_offset=0, total_heads=None,
               door="dilated_attention", window_size=None, window_with_shorter_q=False):
    """Validation shared by every dilated front door: (patterns fitted to k's length, the
    AttentionCall, (head_offset, total_heads)). window_with_shorter_q: the door takes a window
    with q shorter than k (the serve door: its decode paths and query-offset path cut the key
    lists at the queries' absolute positions)."""
    check_qkv(q, k, v, allow_shorter_q=allow_shorter_q, door=door)
    patterns = check_patterns(segment_lengths, dilation_rates, mode, offsets)
    check_flags(return_lse=return_lse)
    call = AttentionCall.at_door(q, causal=causal, scale=scale, softcap=softcap, sinks=sinks,
                                 window_size=window_size)
    if call.window is not None and k.shape[1] != q.shape[1] and not window_with_shorter_q:
        raise ValueError(f"window_size with q shorter than k ({q.shape[1]} queries, {k.shape[1]} keys) is not "
                         f"supported on {door}: pass queries and keys of one length")
    heads = check_head_slice(head_offset, total_heads, q.shape[2], k.shape[2])
    warn_if_heads_first(patterns, k.shape[1], heads[1])
    patterns = fit_patterns(patterns, k.shape[1], heads[1])   # w >= N is one segment: clamped to N
    return patterns, call, heads


# ----------------------------------------------------------------------------- eager autograd

class _DilatedAttentionFn(torch.autograd.Function):
    """The Triton path: fused forward (out and the row statistics), dQ and dK/dV kernels."""

    @staticmethod
    def forward(ctx, q, k, v, patterns, table, call, doc_bounds=None):
        out, row_max, row_sum = _kernels().dilated_forward(q, k, v, patterns, table, call, doc_bounds=doc_bounds)
        ctx.save_for_backward(q, k, v, out, row_max, row_sum)
        ctx.args = (patterns, table, call, doc_bounds)
        return out, lse_from_stats(row_max, row_sum)

    @staticmethod
    @first_order_backward("dilated_attention (Triton path)")
    def backward(ctx, do, dlse):
        q, k, v, out, row_max, row_sum = ctx.saved_tensors
        patterns, table, call, doc_bounds = ctx.args
        if do is None:
            do = torch.zeros_like(out)
        dq, dk, dv = _kernels().dilated_backward(do, dlse, q, k, v, out, row_max, row_sum, patterns, table, call,
                                                 doc_bounds=doc_bounds)
        return dq, dk, dv, None, None, None, None


# ----------------------------------------------------------------------------- public

def dilated_attention(q, k, v, segment_lengths, dilation_rates, *, causal=False, scale=None,
                      mode="longnet", offsets="modulo", return_lse=False, backend="auto", cu_seqlens=None,
                      head_offset=0, total_heads=None, softcap=0.0, sinks=None, window_size=None):
    """LongNet dilated attention (arXiv 2307.02486 §2.2-2.4), exact, forward and backward.

    Args:
        q: (B, N, Hq, D); k, v: (B, N, Hkv, D) with Hq % Hkv == 0 (GQA/MQA). float16,
            bfloat16 or float32; any strides with a contiguous last dimension (others are
            copied once). q may be shorter, (B, Nq, Hq, D) with Nq <= N: the last Nq positions
            (query i at N - Nq + i, flash-attn's bottom-right convention; every key row
            valid); each row equals that row of the full-sequence call. Up to 16 rows read
            only their keys (the decode kernel; gradients on the Triton path: the training
            kernels); longer chunks compute the forward and dQ of the chunk's rows only on
            the Triton backend. Per-row cache lengths, appends, paged or FP8 caches:
            dilated_attention_with_kvcache.
        segment_lengths, dilation_rates: one (w, r) per pattern. N % w != 0, w % r != 0
            and w >= N are all legal; the last segment may be shorter.
        causal: each query attends only to keys at or before its position.
        scale: score scale, default 1/sqrt(D).
        mode: "longnet" (every head uses every pattern; patterns mixed by their softmax
            denominators, i.e. one softmax over the multiset union of their keys) or
            "head_groups" (heads split into one contiguous group per pattern).
        offsets: per-head offset of pattern i, "modulo" (j % r_i) or "blocked"
            (j // ceil(Hq / r_i)); longnet mode only.
        return_lse: also return lse, float32 (B, Hq, N), natural log, differentiable.
        backend: "auto" (Triton on CUDA, or on CPU under TRITON_INTERPRET=1; else the
            portable PyTorch path), "triton" or "torch".
        cu_seqlens: packed variable-length sequences: with B == 1, the documents
            [cu_seqlens[i], cu_seqlens[i+1]) of the sequence (0 first, N last, ascending).
            Segments restart at each document and no query sees another document: the
            result equals separate calls per document.
        head_offset, total_heads: q's heads are the query heads [head_offset, head_offset +
            Hq) of a call with total_heads query heads (default: q's own); the per-head
            offsets and head groups follow the global index, so the result equals that head
            slice of the full call (Ulysses sequence parallelism computes one per rank).
            With GQA both must be multiples of Hq // Hkv.
        softcap: a positive float c: every scaled score s becomes c * tanh(s / c) before the
            softmax (Gemma 2), gradients through the cap; 0.0 (or None): no cap.
        sinks: None, or a float32 tensor (Hq,) (differentiable): a per-head logit that joins
            every row's softmax denominator once (the joint denominator of all patterns)
            and contributes no value (gpt-oss). lse then includes it: a row without keys
            gets 0 and lse = its head's sink.
        window_size: FlashAttention's (left, right), -1 for an unbounded side (None: (-1,
            -1)): each pattern's keys cut to p - left <= p' <= p + right. Causal windows
            only: right = 0, or causal=True (which sets right to 0, as FlashAttention does);
            (left, 0) computes causal attention whatever `causal` says. q and k of one length.

    Returns:
        out (B, N, Hq, D) like q, contiguous; with return_lse, (out, lse). A query with no
        key in any of its patterns gets 0 and lse = -inf.
    """
    patterns, call, heads = check_args(q, k, v, segment_lengths, dilation_rates, causal, scale, mode, offsets,
                                       return_lse, softcap, sinks, allow_shorter_q=True, head_offset=head_offset,
                                       total_heads=total_heads, window_size=window_size)
    B, N, Hq, D = q.shape
    path = resolve_path(backend, str(q.device), CONFIG_FAMILIES, D, q.dtype)
    if k.shape[1] != N:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens (packed documents) cannot be combined with q shorter than k, v")
        res = queries_at_the_end(q, k, v, patterns, call, mode=mode, offsets=offsets, backend=backend, path=path,
                                 heads=heads)
        return call.finish(res, return_lse)
    doc_bounds = check_cu_seqlens(cu_seqlens, B, N)
    # under torch.compile: the custom op (either path). It traces without a graph break; the
    # portable path's data-dependent choice of CPU kernel would break fullgraph tracing.
    if torch.compiler.is_compiling() and doc_bounds is None:
        return dilated_attention_op(q, k, v, segment_lengths, dilation_rates, causal=causal, scale=call.scale,
                                    mode=mode, offsets=offsets, return_lse=return_lse, backend=backend,
                                    head_offset=heads[0], total_heads=heads[1], softcap=softcap, sinks=sinks,
                                    window_size=window_size)
    if B == 0 or N == 0:
        return call.finish(empty_result(q, k, v, True), return_lse)
    table = head_table(Hq, patterns, mode, offsets, *heads)
    res = dilated_attention_table(q, k, v, patterns, table, call, need_lse=call.needs_lse(return_lse), backend=path,
                                  doc_bounds=doc_bounds)
    return call.finish(res, return_lse)


def dilated_attention_table(q, k, v, patterns, table, call, *, need_lse=True, backend="auto", doc_bounds=None):
    """dilated_attention on validated inputs with an explicit (patterns, per-head offset
    table), the AttentionCall (its sinks are the caller's) and optional documents; returns
    (out, lse) (lse None when the portable path was not asked for it)."""
    if resolve_backend(backend, q.device) == "triton":
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        return _DilatedAttentionFn.apply(q, k, v, patterns, table, call.without_sinks(), doc_bounds)
    compute_dtype = portable_compute_dtype(q.dtype, q.device)

    def run(q_, k_, v_):
        return dilated_attention_torch(q_, k_, v_, patterns, table, call, need_lse=need_lse,
                                       compute_dtype=compute_dtype)

    if doc_bounds is None:
        return run(q, k, v)
    parts = [run(q[:, s:e], k[:, s:e], v[:, s:e]) for s, e in zip(doc_bounds[:-1], doc_bounds[1:]) if e > s]
    out = torch.cat([p[0] for p in parts], dim=1)
    return out, (torch.cat([p[1] for p in parts], dim=2) if need_lse else None)


def queries_at_the_end(q, k, v, patterns, call, *, mode, offsets, backend, path, heads):
    """(out, lse) of q (B, Nq, Hq, D), the last Nq positions of k, v (B, Nk, Hkv, D) with every
    key row valid (DESIGN §5b). Up to 16 queries decode (the Triton decode kernel; the portable
    decode, which on CPU tensors without gradients reads the runs in place); under
    torch.compile the decode custom op; gradients on the Triton path and longer chunks take
    the query-offset path (padded_call). The lengths are known on the host: no read."""
    B, Nq, Hq, _ = q.shape
    Nk = k.shape[1]
    if B == 0:
        return empty_result(q, k, v, True)
    decodes = Nq <= MAX_DECODE_QUERIES and not (path == "triton" and needs_grad(q, k, v))
    if decodes:
        lengths = torch.full((B,), Nk, dtype=torch.int32, device=q.device)
        if torch.compiler.is_compiling():
            return _dilated_decode(q, k, v, lengths, None, [w for w, _ in patterns], [r for _, r in patterns],
                                   call.causal, call.scale, mode, offsets, heads[0], heads[1], path, None, None,
                                   call.softcap)
        table = head_table(Hq, patterns, mode, offsets, *heads)
        host_loop = path == "torch" and q.device.type == "cpu" and not needs_grad(q, k, v)
        return decode_table(q, k, v, patterns, table, lengths, call, path=path, host_loop=host_loop)

    def chunk(qq, kk, vv, batch_rows, n, first_row):
        return padded_call(qq, kk, vv, first_row, patterns, call, mode=mode, offsets=offsets, backend=backend,
                           heads=heads)

    return run_with_query_offset(chunk, q, k, v, [Nk] * B, causal=call.causal)


def decode_table(q, k, v, patterns, table, lengths, call, *, path, host_loop=False, block_table=None,
                 k_descale=None, v_descale=None, leftpad=None):
    """(out, lse) of the last Nq positions of each row's lengths[b] (an integer tensor (B,) on
    q's device) valid rows of k, v (page pools with block_table; float8_e4m3fn with
    k_descale, v_descale): the Triton decode kernel or the portable decode (host_loop: its
    strided-view CPU variant, which reads the lengths on the host; contiguous caches only).
    call: the AttentionCall (its sinks are the caller's). leftpad: None or int32 (B,), each
    row's first key (cache_leftpad; lengths still end the rows)."""
    if path == "torch":
        return portable_descaled(lambda q_: dilated_decode(q_, k, v, patterns, table, lengths, call,
                                                           host_loop=host_loop, block_table=block_table,
                                                           leftpad=leftpad),
                                 q, k_descale, v_descale, k.shape[2])
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    return _decode_kernels().dilated_decode_forward(q, k, v, patterns, table, lengths, call, block_table=block_table,
                                                    k_descale=k_descale, v_descale=v_descale, leftpad=leftpad)


def padded_call(q, k, v, first_query_row, patterns, call, *, mode, offsets, backend, heads=(0, None)):
    """(out, lse) of the full-sequence call on q padded with first_query_row zero rows in
    front (common/query_offset.py), of which only the rows from first_query_row on are kept.
    The Triton path plans only the work those rows need (plan.QueryWindow): forward and dQ
    cost the chunk, not the sequence; dK/dV skip the key tiles no kept row reads. The
    portable path runs the full call."""
    B, N, Hq, D = q.shape
    if not (B and N):
        return empty_result(q, k, v, True)
    path = resolve_backend(backend, q.device, CONFIG_FAMILIES, D, q.dtype)
    patterns = fit_patterns(patterns, N, heads[1] or Hq)
    return dilated_attention_table(q, k, v, patterns, head_table(Hq, patterns, mode, offsets, *heads), call,
                                   backend=path,
                                   doc_bounds=QueryWindow(None, first_query_row) if path == "triton" else None)


# Patterns travel as two int lists plus `mode` and `offsets` (the offset table is rebuilt,
# cached); the lengths are the rows valid after the append (the append happens outside the
# op, as plain index_put_ that torch.compile functionalises). No autograd formula: inference.

@torch.library.custom_op("triton_dilated::dilated_decode", mutates_args=())
def _dilated_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, block_table: Optional[Tensor],
                    segment_lengths: List[int], dilation_rates: List[int], causal: bool, scale: float, mode: str,
                    offsets: str, head_offset: int, total_heads: int, path: str, k_descale: Optional[Tensor] = None,
                    v_descale: Optional[Tensor] = None, softcap: float = 0.0,
                    cache_leftpad: Optional[Tensor] = None, window: int = 0) -> Tuple[Tensor, Tensor]:
    """(out, lse) of the decode step: out (B, Nq, Hq, D) like q, lse float32 (B, Hq, Nq).
    softcap 0.0: no cap; window 0: no sliding window."""
    check_path(path)
    patterns = tuple(zip((int(w) for w in segment_lengths), (int(r) for r in dilation_rates)))
    table = head_table(q.shape[2], patterns, mode, offsets, head_offset, total_heads)
    return decode_table(q, k_cache, v_cache, patterns, table, lengths, _op_call(causal, scale, softcap, window),
                        path=path, block_table=block_table, k_descale=k_descale, v_descale=v_descale,
                        leftpad=cache_leftpad)


@_dilated_decode.register_fake
def _(q, k_cache, v_cache, lengths, block_table, segment_lengths, dilation_rates, causal, scale, mode, offsets,
      head_offset, total_heads, path, k_descale=None, v_descale=None, softcap=0.0, cache_leftpad=None, window=0):
    B, Nq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Nq), dtype=torch.float32)


# ----------------------------------------------------------------------------- custom ops
# Patterns travel as two int lists plus the `mode` and `offsets` strings (the per-head offset
# table is rebuilt inside the op, cached). Outputs the caller did not ask for come back with
# a zero-length last dimension (the portable lse without return_lse; the row statistics on
# the portable path). Double backward is not supported (the backward op has no autograd
# formula).

def _patterns_table(num_heads, segment_lengths, dilation_rates, mode, offsets, head_offset=0, total_heads=-1):
    """total_heads -1: q's head count (the op schema has no Optional default for ints)."""
    patterns = tuple(zip((int(w) for w in segment_lengths), (int(r) for r in dilation_rates)))
    total = num_heads if total_heads < 0 else total_heads
    return patterns, head_table(num_heads, patterns, mode, offsets, head_offset, total)


def _op_call(causal, scale, softcap, window):
    """The AttentionCall of a custom op's plain values (checked at the door)."""
    return AttentionCall(causal, scale, softcap, window=WindowPredicate(window) if window else None)


@torch.library.custom_op("triton_dilated::dilated_fwd", mutates_args=())
def _dilated_fwd(q: Tensor, k: Tensor, v: Tensor, segment_lengths: List[int], dilation_rates: List[int],
                 causal: bool, scale: float, mode: str, offsets: str, need_lse: bool,
                 path: str, head_offset: int = 0, total_heads: int = -1,
                 softcap: float = 0.0, window: int = 0) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, row_max, row_sum). softcap 0.0: no cap; window 0: no sliding window."""
    check_path(path)
    patterns, table = _patterns_table(q.shape[2], segment_lengths, dilation_rates, mode, offsets, head_offset,
                                      total_heads)
    call = _op_call(causal, scale, softcap, window)
    if path == "triton":
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        out, row_max, row_sum = _kernels().dilated_forward(q, k, v, patterns, table, call)
        return out, lse_from_stats(row_max, row_sum), row_max, row_sum
    out, lse = dilated_attention_torch(q, k, v, patterns, table, call, need_lse=need_lse,
                                       compute_dtype=portable_compute_dtype(q.dtype, q.device))
    if lse is None:
        lse = empty_stats(q)
    return fresh(out), fresh(lse), empty_stats(q), empty_stats(q)


@_dilated_fwd.register_fake
def _(q, k, v, segment_lengths, dilation_rates, causal, scale, mode, offsets, need_lse, path, head_offset=0,
      total_heads=-1, softcap=0.0, window=0):
    B, N, Hq, D = q.shape
    out = q.new_empty((B, N, Hq, D))
    stats = N if path == "triton" else 0
    lse = q.new_empty((B, Hq, N if (need_lse or path == "triton") else 0), dtype=torch.float32)
    return out, lse, q.new_empty((B, Hq, stats), dtype=torch.float32), q.new_empty((B, Hq, stats), dtype=torch.float32)


@torch.library.custom_op("triton_dilated::dilated_bwd", mutates_args=())
def _dilated_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                 row_max: Tensor, row_sum: Tensor, segment_lengths: List[int], dilation_rates: List[int],
                 causal: bool, scale: float, mode: str, offsets: str, path: str, head_offset: int = 0,
                 total_heads: int = -1, softcap: float = 0.0, window: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), contiguous. dlse: None, or float32 (B, Hq, N)."""
    check_path(path)
    patterns, table = _patterns_table(q.shape[2], segment_lengths, dilation_rates, mode, offsets, head_offset,
                                      total_heads)
    call = _op_call(causal, scale, softcap, window)
    if path == "triton":
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        dq, dk, dv = _kernels().dilated_backward(do, dlse, q, k, v, out, row_max, row_sum, patterns, table, call)
        return fresh(dq), fresh(dk), fresh(dv)
    compute = portable_compute_dtype(q.dtype, q.device)
    with_lse = dlse is not None

    def fwd(q_, k_, v_):
        o, lse = dilated_attention_torch(q_, k_, v_, patterns, table, call, need_lse=with_lse, compute_dtype=compute)
        return (o, lse) if with_lse else (o,)

    return recompute_grads(fwd, (q, k, v), (do, dlse) if with_lse else (do,))


@_dilated_bwd.register_fake
def _(do, dlse, q, k, v, out, row_max, row_sum, segment_lengths, dilation_rates, causal, scale, mode, offsets,
      path, head_offset=0, total_heads=-1, softcap=0.0, window=0):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _dilated_setup(ctx, inputs, output):
    q, k, v, segment_lengths, dilation_rates, causal, scale, mode, offsets, need_lse, path, *rest = inputs
    heads, softcap, window = rest[:2], (rest[2] if len(rest) > 2 else 0.0), (rest[3] if len(rest) > 3 else 0)
    out, lse, row_max, row_sum = output
    ctx.save_for_backward(q, k, v, out, row_max, row_sum)
    ctx.mark_non_differentiable(row_max, row_sum)
    ctx.args = (list(segment_lengths), list(dilation_rates), causal, scale, mode, offsets, path, *heads)
    ctx.softcap, ctx.window = softcap, window
    ctx.n_inputs = len(inputs)   # the trailing defaults may be left out
    ctx.lse_len = lse.shape[-1]
    ctx.need_lse = need_lse


def _dilated_backward(ctx, do, dlse, _dmax, _dsum):
    q, k, v, out, row_max, row_sum = ctx.saved_tensors
    segment_lengths, dilation_rates, causal, scale, mode, offsets, path, *heads = ctx.args
    if do is None:
        do = torch.zeros_like(out)
    if dlse is not None and (not ctx.need_lse or ctx.lse_len == 0):
        dlse = None   # the caller never saw lse: its gradient is the materialised zero
    dq, dk, dv = _dilated_bwd(do, dlse, q, k, v, out, row_max, row_sum, segment_lengths, dilation_rates,
                              causal, scale, mode, offsets, path, *heads, softcap=ctx.softcap, window=ctx.window)
    return (dq, dk, dv) + (None,) * (ctx.n_inputs - 3)


_dilated_fwd.register_autograd(_dilated_backward, setup_context=_dilated_setup)


def dilated_attention_op(q, k, v, segment_lengths, dilation_rates, *, causal=False, scale=None, mode="longnet",
                         offsets="modulo", return_lse=False, backend="auto", head_offset=0, total_heads=None,
                         softcap=0.0, sinks=None, window_size=None):
    """`dilated_attention` through the `triton_dilated::dilated_fwd/_bwd` custom ops: the
    same arguments, results and numerics, and traceable by `torch.compile(fullgraph=True)`
    forward and backward (the sinks join outside the op, in traceable tensor code)."""
    patterns, call, heads = check_args(q, k, v, segment_lengths, dilation_rates, causal, scale, mode, offsets,
                                       return_lse, softcap, sinks, head_offset=head_offset, total_heads=total_heads,
                                       door="dilated_attention_op", window_size=window_size)
    path = resolve_path(backend, str(q.device), CONFIG_FAMILIES, q.shape[-1], q.dtype)
    if q.shape[0] == 0 or q.shape[1] == 0:
        out, lse = empty_result(q, k, v, True)
    else:
        out, lse, _, _ = _dilated_fwd(q, k, v, [w for w, _ in patterns], [r for _, r in patterns], call.causal,
                                      call.scale, mode, offsets, call.needs_lse(return_lse), path, heads[0], heads[1],
                                      call.softcap, call.window_keys)
    return call.finish((out, lse), return_lse)
