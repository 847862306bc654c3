"""The training door of block-sparse attention: `block_sparse_attention` (validation,
backend dispatch, packed documents), the autograd Function over the Triton launchers, and the
torch.library custom ops (`block_sparse_attention_op`) that torch.compile traces, and what
both doors run for queries at the end of a longer key sequence (DESIGN §5b): the decode step
(`decode_layout`, its custom op) and the query-offset path (`chunk_rows`). Per-row lengths,
appends, paged and FP8 caches belong to the serve door (serve.py), the only place
`cache_seqlens` exists.

The Triton kernels (kernels.py) are imported only when used: the package runs without
triton. A BlockLayout travels through the custom ops as its four int32 tensors and its
block size.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..common.call import AttentionCall
from ..common.first_order import first_order_backward, needs_grad
from ..common.kvcache import MAX_DECODE_QUERIES, portable_descaled
from ..common.lse import lse_from_stats
from ..common.op_support import check_path, empty_stats, fresh, lazy_module, recompute_grads, resolve_path
from ..common.query_offset import run_with_query_offset
from ..common.runtime import empty_result, last_dim_contiguous, portable_compute_dtype
from ..common.validation import check_cu_seqlens, check_flags, check_qkv
from ..common.masks import WindowPredicate, check_window_causal
from .builders import sliding_window
from .decode import block_sparse_decode
from .layout import BlockLayout
from .portable import block_sparse_attention_torch

CONFIG_FAMILIES = ("block_sparse_fwd", "block_sparse_bwd")


_kernels = lazy_module(__package__ + ".kernels")                 # imports triton
_decode_kernels = lazy_module(__package__ + ".decode_kernels")   # imports triton

DECODE_FAMILIES = ("block_sparse_fwd",)


def check_args(q, k, v, layout, causal, scale, return_lse, softcap=0.0, sinks=None, *, packed=False,
               allow_shorter_q=False, door="block_sparse_attention", window_size=None):
    """Validation shared by the block-sparse doors: the AttentionCall (a window_size's window is
    folded into the layout by with_window)."""
    check_qkv(q, k, v, allow_shorter_q=allow_shorter_q, door=door)
    if not packed and not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    check_flags(return_lse=return_lse)
    call = AttentionCall.at_door(q, causal=causal, scale=scale, softcap=softcap, sinks=sinks,
                                 window_size=window_size)
    if not packed:
        check_window_causal(layout, call.causal)
    return call


# ----------------------------------------------------------------------------- eager autograd

class _BlockSparseAttentionFn(torch.autograd.Function):
    """The Triton path: forward (out and the row statistics), dQ and dK/dV kernels."""

    @staticmethod
    def forward(ctx, q, k, v, layout, call):
        out, row_max, row_sum = _kernels().block_sparse_forward(q, k, v, layout, call)
        ctx.save_for_backward(q, k, v, out, row_max, row_sum)
        ctx.args = (layout, call)
        return out, lse_from_stats(row_max, row_sum)

    @staticmethod
    @first_order_backward("block_sparse_attention (Triton path)")
    def backward(ctx, do, dlse):
        q, k, v, out, row_max, row_sum = ctx.saved_tensors
        layout, call = ctx.args
        if do is None:
            do = torch.zeros_like(out)
        dq, dk, dv = _kernels().block_sparse_backward(do, dlse, q, k, v, out, row_max, row_sum, layout, call)
        return dq, dk, dv, None, None


# ----------------------------------------------------------------------------- public

def block_sparse_attention(q, k, v, layout, *, causal=False, scale=None, return_lse=False, backend="auto",
                           cu_seqlens=None, softcap=0.0, sinks=None, window_size=None):
    """Exact attention over the active blocks of a BlockLayout (DESIGN §4).

    Args:
        q: (B, N, Hq, D); k, v: (B, N, Hkv, D), Hq % Hkv == 0 (GQA); float16/bfloat16/float32.
            q may be shorter, (B, Nq, Hq, D) with Nq <= N: the last Nq positions (query i
            at N - Nq + i; every key row valid); the layout covers the whole sequence. Cost:
            that of the layout rows of the query blocks holding the queries. Per-row cache
            lengths, appends, paged or FP8 caches: block_sparse_attention_with_kvcache.
        layout: a BlockLayout with ceil(N / block_size) blocks per side, laid out for
            (B|1, Hq|1) (query heads). A sliding-window layout (layouts.sliding_window, or a
            union/intersection with one) is exact per element: key p' visible to query p iff
            p - window < p' <= p or p' < its sink tokens, in its window blocks; it needs
            causal=True.
        causal: also require key position <= query position (the diagonal block is masked
            per element).
        scale: default 1/sqrt(D).
        return_lse: also return lse, float32 (B, Hq, N), differentiable.
        backend: "auto", "triton" or "torch" (DESIGN §7).
        cu_seqlens: packed variable-length sequences (B == 1): documents
            [cu_seqlens[i], cu_seqlens[i+1]); blocks restart at each document and no query
            sees another document. `layout` is then one BlockLayout per document (a list),
            or a builder called with each document's length (e.g.
            `lambda n: layouts.local(n, 64, 2)`).
        softcap: a positive float c: scores s -> c * tanh(s / c) before the softmax,
            gradients through the cap; 0.0 (or None): no cap.
        sinks: None, or a float32 tensor (Hq,) (differentiable): a per-head logit joining
            every row's softmax denominator, no value. lse then includes it: a row without
            keys gets 0 and lse = its head's sink.
        window_size: FlashAttention's (left, right), -1 for an unbounded side (None: (-1, -1)):
            query p sees keys p - left <= p' <= p + right, intersected with the layout
            (`layout & layouts.sliding_window(N, block_size, left + 1)`, exact per element).
            Causal windows only: right = 0, or causal=True (which sets right to 0, as
            FlashAttention does); (left, 0) computes causal attention whatever `causal` says.

    Returns out (B, N, Hq, D) like q (and lse). Rows with no active key: 0, lse = -inf.
    """
    call = check_args(q, k, v, layout, causal, scale, return_lse, softcap, sinks, packed=cu_seqlens is not None,
                      allow_shorter_q=True, window_size=window_size)
    layout, call = with_window(layout, call.window), call.without_window()
    B, N, Hq, D = q.shape
    if torch.compiler.is_compiling() and k.shape[1] == N and cu_seqlens is None:
        # the custom op (either path): it traces without a graph break; the portable path's
        # data-dependent choice of CPU kernel would break fullgraph tracing
        return block_sparse_attention_op(q, k, v, layout, causal=call.causal, scale=call.scale, return_lse=return_lse,
                                         backend=backend, softcap=softcap, sinks=sinks)
    return call.finish(block_sparse_call(q, k, v, layout, call, backend=backend, cu_seqlens=cu_seqlens), return_lse)


def with_window(layout, window):
    """layout & the sliding window `window` (a WindowPredicate, or None: layout itself), per
    document for the packed forms (a list of layouts, a builder). Other objects are returned
    as they came, for check_args to name."""
    if window is None:
        return layout
    if isinstance(layout, BlockLayout):
        return layout & sliding_window(layout.n_q_blocks * layout.block_size, layout.block_size, window.window)
    if isinstance(layout, (list, tuple)):
        return [lay if lay is None else with_window(lay, window) for lay in layout]
    if callable(layout):
        return lambda n: with_window(layout(n), window)
    return layout


def block_sparse_call(q, k, v, layout, call, *, backend, cu_seqlens=None):
    """(out, lse) of block_sparse_attention on validated inputs and call (its sinks are the
    caller's): queries at the end of the keys, packed documents, or the full sequence."""
    B, N, Hq, D = q.shape
    if k.shape[1] != N:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens (packed documents) cannot be combined with q shorter than k, v")
        return queries_at_the_end(q, k, v, layout, call, backend=backend,
                                  path=resolve_path(backend, str(q.device), CONFIG_FAMILIES, D, q.dtype))
    if cu_seqlens is not None:
        return _packed(q, k, v, layout, cu_seqlens, call, backend)
    if torch.compiler.is_compiling():
        return block_sparse_attention_op(q, k, v, layout, causal=call.causal, scale=call.scale, return_lse=True,
                                         backend=backend, softcap=call.softcap)
    path = resolve_path(backend, str(q.device), CONFIG_FAMILIES, D, q.dtype)
    if B == 0 or N == 0:
        return empty_result(q, k, v, True)
    layout.check_seq_len(N)
    layout.check_heads(B, Hq)
    layout = layout.to(q.device) if layout.kv_indices.device != q.device else layout
    if path == "triton":
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        return _BlockSparseAttentionFn.apply(q, k, v, layout, call.without_sinks())
    return block_sparse_attention_torch(q, k, v, layout, call, compute_dtype=portable_compute_dtype(q.dtype, q.device))


def document_layouts(layout, bounds):
    """One BlockLayout per document of bounds (None for an empty one): `layout` is a list or
    tuple with one per document, a builder called with each document's length, or one
    BlockLayout for every document. Each is checked against its document's length."""
    docs = list(zip(bounds[:-1], bounds[1:]))
    if isinstance(layout, (list, tuple)):
        if len(layout) != len(docs):
            raise ValueError(f"layout must hold one BlockLayout per document ({len(docs)}), got {len(layout)}")
        per_doc = list(layout)
    elif callable(layout) and not isinstance(layout, BlockLayout):
        per_doc = [layout(e - s) if e > s else None for s, e in docs]
    else:
        per_doc = [layout] * len(docs)
    out = []
    for i, (lay, (s, e)) in enumerate(zip(per_doc, docs)):
        if e == s:
            out.append(None)
            continue
        if not isinstance(lay, BlockLayout):
            raise TypeError(f"layout for document {i} must be a BlockLayout, got {type(lay).__name__}")
        lay.check_seq_len(e - s, name=f"layout for document {i} (length {e - s})")
        out.append(lay)
    return out


def _packed(q, k, v, layout, cu_seqlens, call, backend):
    """(out, lse) of documents one after another, each with its own layout (blocks restart per
    document)."""
    bounds = check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1])
    docs = [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    per_doc = [lay for lay in document_layouts(layout, bounds) if lay is not None]
    for lay in per_doc:
        check_window_causal(lay, call.causal)
    outs = [block_sparse_call(q[:, s:e], k[:, s:e], v[:, s:e], lay, call, backend=backend)
            for lay, (s, e) in zip(per_doc, docs)]
    if not outs:
        return empty_result(q, k, v, True)
    return torch.cat([o for o, _ in outs], dim=1), torch.cat([l for _, l in outs], dim=2)


def queries_at_the_end(q, k, v, layout, call, *, backend, path):
    """(out, lse) of q (B, Nq, Hq, D), the last Nq positions of k, v (B, Nk, Hkv, D) with every
    key row valid (DESIGN §5b), the layout covering Nk. Up to 16 queries decode (under
    torch.compile through the decode custom op); gradients on the Triton path and longer
    chunks take the query-offset path (chunk_rows). The lengths are known on the host."""
    B, Nq = q.shape[:2]
    Nk = k.shape[1]
    layout.check_seq_len(Nk)
    layout.check_heads(B, q.shape[2])
    if B == 0:
        return empty_result(q, k, v, True)
    if layout.kv_indices.device != q.device:
        layout = layout.to(q.device)
    if Nq <= MAX_DECODE_QUERIES and not (path == "triton" and needs_grad(q, k, v)):
        lengths = torch.full((B,), Nk, dtype=torch.int32, device=q.device)
        if torch.compiler.is_compiling():
            window = (0, 0, None) if layout.window is None else (*layout.window, layout.kv_window)
            return _block_sparse_decode(q, k, v, lengths, None, layout.kv_num_blocks, layout.kv_indices,
                                        layout.block_size, call.causal, call.scale, path, None, None, *window,
                                        call.softcap)
        return decode_layout(q, k, v, layout, lengths, call, path=path)
    return chunk_rows(q, k, v, [Nk] * B, layout, Nk, call, backend=backend)


def chunk_rows(q, k, v, rows, layout, capacity: int, call, *, backend):
    """(out, lse) through the query-offset path: per length n (rows: one per batch row, on the
    host), the training door on q padded in front over the first n rows of k, v and the
    layout's first ceil(n / block_size) blocks, the query blocks before the chunk without key
    blocks (their work is skipped). `capacity`: the positions the layout covers."""
    B = q.shape[0]

    def chunk(qq, kk, vv, batch_rows, n, first_row):
        first = first_row // layout.block_size
        if n != capacity or len(batch_rows) != B or first > 0:
            lay = layout.prefix(-(-n // layout.block_size), batch_rows, first_query_block=first)
        else:
            lay = layout
        return block_sparse_call(qq, kk, vv, lay, call, backend=backend)

    return run_with_query_offset(chunk, q, k, v, rows, causal=call.causal)


def decode_layout(q, k, v, layout, lengths, call, *, path, block_table=None, k_descale=None, v_descale=None,
                  leftpad=None):
    """(out, lse) of the last Nq positions of each row's lengths[b] (an integer tensor (B,) on
    q's device) valid rows of k, v (page pools with block_table; float8_e4m3fn with k_descale,
    v_descale), the layout (on q's device) covering the cache's capacity, under call (its
    sinks are the caller's); leftpad: None or int32 (B,), each row's first key (cache_leftpad)."""
    if path == "torch":
        return portable_descaled(lambda q_: block_sparse_decode(q_, k, v, layout, lengths, call,
                                                                block_table=block_table, leftpad=leftpad),
                                 q, k_descale, v_descale, k.shape[2])
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    return _decode_kernels().block_sparse_decode_forward(q, k, v, layout, lengths, call, block_table=block_table,
                                                         k_descale=k_descale, v_descale=v_descale, leftpad=leftpad)


class _RowLists:
    """What the decode paths read of a BlockLayout (inside the custom op: the forward lists
    only, without rebuilding the transposed ones)."""

    def __init__(self, kv_num_blocks, kv_indices, block_size, window=0, sink_tokens=0, kv_window=None):
        self.kv_num_blocks, self.kv_indices, self.block_size = kv_num_blocks, kv_indices, block_size
        self.n_q_blocks = kv_num_blocks.shape[-1]
        self.window = WindowPredicate(window, sink_tokens) if window else None
        self.kv_window = kv_window.bool() if window else None


@torch.library.custom_op("triton_dilated::block_sparse_decode", mutates_args=())
def _block_sparse_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, block_table: Optional[Tensor],
                         kv_num_blocks: Tensor, kv_indices: Tensor, block_size: int, causal: bool, scale: float,
                         path: str, k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None,
                         window: int = 0, sink_tokens: int = 0, kv_window: Optional[Tensor] = None,
                         softcap: float = 0.0, cache_leftpad: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out, lse) of the decode step: out (B, Nq, Hq, D) like q, lse float32 (B, Hq, Nq).
    window 0: no sliding window (else its predicate on the blocks kv_window flags); softcap
    0.0: no cap."""
    check_path(path)
    lists = _RowLists(kv_num_blocks, kv_indices, block_size, window, sink_tokens, kv_window)
    return decode_layout(q, k_cache, v_cache, lists, lengths, AttentionCall(causal, scale, softcap), path=path,
                         block_table=block_table, k_descale=k_descale, v_descale=v_descale, leftpad=cache_leftpad)


@_block_sparse_decode.register_fake
def _(q, k_cache, v_cache, lengths, block_table, kv_num_blocks, kv_indices, block_size, causal, scale, path,
      k_descale=None, v_descale=None, window=0, sink_tokens=0, kv_window=None, softcap=0.0, cache_leftpad=None):
    B, Nq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Nq), dtype=torch.float32)


# ----------------------------------------------------------------------------- custom ops
# lse is always computed (both paths get it for free); need_lse only tells the autograd
# formula whether the caller saw it. Row statistics are zero-length on the portable path.
# Double backward is not supported (the backward op has no autograd formula).

@torch.library.custom_op("triton_dilated::block_sparse_fwd", mutates_args=())
def _block_sparse_fwd(q: Tensor, k: Tensor, v: Tensor, kv_num_blocks: Tensor, kv_indices: Tensor,
                      q_num_blocks: Tensor, q_indices: Tensor, block_size: int, causal: bool, scale: float,
                      need_lse: bool, path: str, softcap: float = 0.0, window: int = 0, sink_tokens: int = 0,
                      kv_window: Optional[Tensor] = None,
                      q_window: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, row_max, row_sum). softcap 0.0: no cap; window 0: no sliding window (else
    its predicate (window, sink_tokens) on the blocks kv_window / q_window flag)."""
    check_path(path)
    layout = _op_layout(kv_num_blocks, kv_indices, q_num_blocks, q_indices, block_size, window, sink_tokens,
                        kv_window, q_window)
    call = AttentionCall(causal, scale, softcap)
    if path == "triton":
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        out, row_max, row_sum = _kernels().block_sparse_forward(q, k, v, layout, call)
        return out, lse_from_stats(row_max, row_sum), row_max, row_sum
    out, lse = block_sparse_attention_torch(q, k, v, layout, call, compute_dtype=portable_compute_dtype(q.dtype,
                                                                                                     q.device))
    return fresh(out), fresh(lse), empty_stats(q), empty_stats(q)


def _op_layout(kv_num_blocks, kv_indices, q_num_blocks, q_indices, block_size, window, sink_tokens, kv_window,
               q_window):
    """The BlockLayout the custom ops' arguments describe (O(1): no validation)."""
    return BlockLayout.from_canonical_lists(kv_num_blocks, kv_indices, q_num_blocks, q_indices, block_size,
                                            window=(window, sink_tokens) if window else None,
                                            kv_window=kv_window, q_window=q_window)


def _op_window_args(layout):
    """(window, sink_tokens, kv_window, q_window) of a layout, as the custom ops take them."""
    if layout.window is None:
        return 0, 0, None, None
    return (*layout.window, *(x.to(layout.kv_indices.device) for x in (layout.kv_window, layout.q_window)))


@_block_sparse_fwd.register_fake
def _(q, k, v, kv_num_blocks, kv_indices, q_num_blocks, q_indices, block_size, causal, scale, need_lse, path,
      softcap=0.0, window=0, sink_tokens=0, kv_window=None, q_window=None):
    B, N, Hq, D = q.shape
    stats = N if path == "triton" else 0
    return (q.new_empty((B, N, Hq, D)), q.new_empty((B, Hq, N), dtype=torch.float32),
            q.new_empty((B, Hq, stats), dtype=torch.float32), q.new_empty((B, Hq, stats), dtype=torch.float32))


@torch.library.custom_op("triton_dilated::block_sparse_bwd", mutates_args=())
def _block_sparse_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                      row_max: Tensor, row_sum: Tensor, kv_num_blocks: Tensor, kv_indices: Tensor,
                      q_num_blocks: Tensor, q_indices: Tensor, block_size: int, causal: bool, scale: float,
                      path: str, softcap: float = 0.0, window: int = 0, sink_tokens: int = 0,
                      kv_window: Optional[Tensor] = None,
                      q_window: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    check_path(path)
    layout = _op_layout(kv_num_blocks, kv_indices, q_num_blocks, q_indices, block_size, window, sink_tokens,
                        kv_window, q_window)
    call = AttentionCall(causal, scale, softcap)
    if path == "triton":
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        dq, dk, dv = _kernels().block_sparse_backward(do, dlse, q, k, v, out, row_max, row_sum, layout, call)
        return fresh(dq), fresh(dk), fresh(dv)
    compute = portable_compute_dtype(q.dtype, q.device)
    with_lse = dlse is not None

    def fwd(q_, k_, v_):
        o, lse = block_sparse_attention_torch(q_, k_, v_, layout, call, compute_dtype=compute)
        return (o, lse) if with_lse else (o,)

    return recompute_grads(fwd, (q, k, v), (do, dlse) if with_lse else (do,))


@_block_sparse_bwd.register_fake
def _(do, dlse, q, k, v, out, row_max, row_sum, kv_num_blocks, kv_indices, q_num_blocks, q_indices, block_size,
      causal, scale, path, softcap=0.0, window=0, sink_tokens=0, kv_window=None, q_window=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _block_sparse_setup(ctx, inputs, output):
    q, k, v, kv_num_blocks, kv_indices, q_num_blocks, q_indices, block_size, causal, scale, need_lse, path, *rest = inputs
    out, _, row_max, row_sum = output
    ctx.need_lse = need_lse
    ctx.save_for_backward(q, k, v, out, row_max, row_sum, kv_num_blocks, kv_indices, q_num_blocks, q_indices)
    ctx.mark_non_differentiable(row_max, row_sum)
    rest = list(rest) + [0.0, 0, 0, None, None][len(rest):]   # softcap, window, sink_tokens, flags (defaults)
    ctx.args = (block_size, causal, scale, path, *rest)
    ctx.n_inputs = len(inputs)   # the defaults may be left out


def _block_sparse_backward(ctx, do, dlse, _dmax, _dsum):
    q, k, v, out, row_max, row_sum, kv_num_blocks, kv_indices, q_num_blocks, q_indices = ctx.saved_tensors
    block_size, causal, scale, path, softcap, *window_args = ctx.args
    if do is None:
        do = torch.zeros_like(out)
    if not ctx.need_lse:
        dlse = None   # the caller never saw lse: its gradient is the materialised zero
    dq, dk, dv = _block_sparse_bwd(do, dlse, q, k, v, out, row_max, row_sum, kv_num_blocks, kv_indices,
                                   q_num_blocks, q_indices, block_size, causal, scale, path, softcap, *window_args)
    return (dq, dk, dv) + (None,) * (ctx.n_inputs - 3)


_block_sparse_fwd.register_autograd(_block_sparse_backward, setup_context=_block_sparse_setup)


def block_sparse_attention_op(q, k, v, layout, *, causal=False, scale=None, return_lse=False, backend="auto",
                              softcap=0.0, sinks=None):
    """`block_sparse_attention` through the `triton_dilated::block_sparse_fwd/_bwd` custom ops:
    same arguments and results, traceable by `torch.compile(fullgraph=True)` (the sinks join
    outside the op, in traceable tensor code). Build the layout outside the compiled region
    (builders use data-dependent shapes)."""
    call = check_args(q, k, v, layout, causal, scale, return_lse, softcap, sinks, door="block_sparse_attention_op")
    B, N, Hq, D = q.shape
    path = resolve_path(backend, str(q.device), CONFIG_FAMILIES, D, q.dtype)
    if B == 0 or N == 0:
        out, lse = empty_result(q, k, v, True)
    else:
        layout.check_seq_len(N)
        layout.check_heads(B, Hq)
        lists = [x.to(q.device) for x in (layout.kv_num_blocks, layout.kv_indices, layout.q_num_blocks,
                                          layout.q_indices)]
        out, lse, _, _ = _block_sparse_fwd(q, k, v, *lists, layout.block_size, call.causal, call.scale,
                                           call.needs_lse(return_lse), path, call.softcap,
                                           *_op_window_args(layout.to(q.device)))
    return call.finish((out, lse), return_lse)
