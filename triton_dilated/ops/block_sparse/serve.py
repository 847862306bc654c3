"""The serve door of block-sparse attention: `block_sparse_attention_with_kvcache`
(FlashAttention's `flash_attn_with_kvcache` shape), its custom op
`triton_dilated::block_sparse_decode` (what torch.compile traces) and `decode_layout`, the
decode step. Routes as ops/dilated/serve.py: a decode step with no host sync (the key-list
width is the layout's index-list width); chunked prefill, and gradients on the Triton path,
through the query-offset path, where the query blocks before the chunk get no key block, so
that every kernel does the chunk's work only.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..common.kvcache import (FP8_DTYPE, cache_view, capacity, check_kvcache_args, contiguous_rows, decode_step,
                              portable_descaled, with_sinks)
from ..common.op_support import check_path, lazy_module
from ..common.query_offset import run_with_query_offset
from ..common.runtime import empty_result, last_dim_contiguous
from ..common.validation import check_flags, check_qkv, check_scale
from ..common.window import WindowPredicate, check_window_causal
from .decode import block_sparse_decode
from .interface import block_sparse_attention
from .layout import BlockLayout

_decode_kernels = lazy_module(__package__ + ".decode_kernels")   # imports triton

DECODE_FAMILIES = ("block_sparse_fwd",)


def decode_layout(q, k, v, layout, lengths, *, causal, scale, path, block_table=None, k_descale=None,
                  v_descale=None, softcap=None):
    """(out, lse) of the last Nq positions of each row's lengths[b] (an integer tensor (B,) on
    q's device) valid rows of k, v (page pools with block_table; float8_e4m3fn with k_descale,
    v_descale), the layout (on q's device) covering the cache's capacity. softcap: None or the
    cap c (scores s -> c * tanh(s / c))."""
    if path == "torch":
        return portable_descaled(lambda q_: block_sparse_decode(q_, k, v, layout, lengths, causal=causal, scale=scale,
                                                                block_table=block_table, softcap=softcap),
                                 q, k_descale, v_descale, k.shape[2])
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    return _decode_kernels().block_sparse_decode_forward(q, k, v, layout, lengths, causal=causal, scale=scale,
                                                         block_table=block_table, k_descale=k_descale,
                                                         v_descale=v_descale, softcap=softcap)


def block_sparse_attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, layout,
                                        block_table=None, causal=True, scale=None, return_lse=False,
                                        backend="auto", validate=False, k_descale=None, v_descale=None,
                                        softcap=None, sinks=None):
    """Block-sparse attention of queries at the end of a KV cache: a decode step with no host
    sync, or chunked prefill.

    Args:
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, validate, k_descale,
            v_descale: as `dilated_attention_with_kvcache` (q: the last Nq positions of each
            row's L_b = cache_seqlens[b] + Nnew valid rows, up to 16 on the decode path with
            no host sync, more as chunked prefill; k, v appended in place; block_table: a
            paged cache; k_descale, v_descale: an FP8 cache).
        layout: a BlockLayout covering the cache's capacity Nk (ceil(Nk / block_size)
            blocks per side) at absolute positions, laid out for (B|1, Hq|1); keep it on
            q's device (a copy per call otherwise). Each query reads the active blocks of
            its own layout row, cut at L_b (a sliding window's predicate in its window blocks:
            gpt-oss / Mistral sliding layers decode exactly).
        causal (default True), scale, return_lse, backend, softcap, sinks: as
            block_sparse_attention (the sinks join each row's denominator after the kernel).

    Returns out (B, Nq, Hq, D) like q, or (out, lse) with lse float32 (B, Hq, Nq); rows with
    no active key: 0 and -inf. Differentiable in eager mode (with gradients on the Triton path
    the training kernels run). Under torch.compile: the custom op
    `triton_dilated::block_sparse_decode` (build the layout outside the compiled region).
    """
    check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, block_table, validate, k_descale, v_descale,
                       softcap=softcap, sinks=sinks)
    check_qkv(q, cache_view(k_cache, block_table, q.shape[0], q), cache_view(v_cache, block_table, q.shape[0], q),
              allow_shorter_q=True)
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    check_flags(causal=causal, return_lse=return_lse)
    check_window_causal(layout, causal)
    scale = check_scale(scale, q.shape[-1])
    B, Hq = q.shape[0], q.shape[2]
    layout.check_seq_len(capacity(k_cache, block_table))
    layout.check_heads(B, Hq)
    path, lengths, decodes = decode_step("block_sparse_attention_with_kvcache", q, k_cache, v_cache, k, v,
                                         cache_seqlens, block_table, validate, backend, DECODE_FAMILIES, k_descale,
                                         v_descale)
    if B == 0:
        return with_sinks(empty_result(q, *((q, q) if k_cache.dtype == FP8_DTYPE else (k_cache, v_cache)), True),
                          sinks, return_lse)
    if layout.kv_indices.device != q.device:
        layout = layout.to(q.device)
    if not decodes:
        out, lse = _prefill(q, k_cache, v_cache, lengths, layout, block_table, k_descale, v_descale, causal=causal,
                            scale=scale, backend=backend, softcap=softcap)
    elif torch.compiler.is_compiling():
        window = (0, 0, None) if layout.window is None else (*layout.window, layout.kv_window)
        out, lse = _block_sparse_decode(q, k_cache, v_cache, lengths, block_table, layout.kv_num_blocks,
                                        layout.kv_indices, layout.block_size, causal, scale, path, k_descale,
                                        v_descale, *window, float(softcap or 0.0))
    else:
        out, lse = decode_layout(q, k_cache, v_cache, layout, lengths, causal=causal, scale=scale, path=path,
                                 block_table=block_table, k_descale=k_descale, v_descale=v_descale, softcap=softcap)
    return with_sinks((out, lse), sinks, return_lse)


def _prefill(q, k_cache, v_cache, lengths, layout, block_table, k_descale, v_descale, *, causal, scale, backend,
             softcap):
    """(out, lse) through the query-offset path (one host read of the lengths): per length n,
    the training door on q padded in front and the layout's first ceil(n / block_size)
    blocks, the query blocks before the chunk without key blocks (their work is skipped)."""
    B, Nk = q.shape[0], capacity(k_cache, block_table)
    rows = [int(n) for n in lengths.tolist()]
    k_rows = contiguous_rows(k_cache, block_table, max(rows), q.dtype, k_descale)
    v_rows = contiguous_rows(v_cache, block_table, max(rows), q.dtype, v_descale)

    def call(qq, kk, vv, batch_rows, n, first_row):
        first = first_row // layout.block_size
        if n != Nk or len(batch_rows) != B or first > 0:
            lay = layout.prefix(-(-n // layout.block_size), batch_rows, first_query_block=first)
        else:
            lay = layout
        return block_sparse_attention(qq, kk, vv, lay, causal=causal, scale=scale, return_lse=True, backend=backend,
                                      softcap=softcap)

    return run_with_query_offset(call, q, k_rows, v_rows, rows)


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
                         softcap: float = 0.0) -> Tuple[Tensor, Tensor]:
    """(out, lse) of the decode step: out (B, Nq, Hq, D) like q, lse float32 (B, Hq, Nq).
    window 0: no sliding window (else its predicate on the blocks kv_window flags); softcap
    0.0: no cap."""
    check_path(path)
    lists = _RowLists(kv_num_blocks, kv_indices, block_size, window, sink_tokens, kv_window)
    return decode_layout(q, k_cache, v_cache, lists, lengths, causal=causal, scale=scale, path=path,
                         block_table=block_table, k_descale=k_descale, v_descale=v_descale, softcap=softcap or None)


@_block_sparse_decode.register_fake
def _(q, k_cache, v_cache, lengths, block_table, kv_num_blocks, kv_indices, block_size, causal, scale, path,
      k_descale=None, v_descale=None, window=0, sink_tokens=0, kv_window=None, softcap=0.0):
    B, Nq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Nq), dtype=torch.float32)
