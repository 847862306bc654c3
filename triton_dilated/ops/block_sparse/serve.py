"""The serve door of block-sparse attention: `block_sparse_attention_with_kvcache`
(FlashAttention's `flash_attn_with_kvcache` shape), its custom op
`triton_dilated::block_sparse_decode` (what torch.compile traces; interface.py, with
`decode_layout`, the decode step, which the training door runs too). Routes as ops/dilated/serve.py: a decode step with no host sync (the key-list
width is the layout's index-list width); chunked prefill, and gradients on the Triton path,
through the query-offset path, where the query blocks before the chunk get no key block, so
that every kernel does the chunk's work only.
"""
from __future__ import annotations

import functools

import torch

from ..common.context_parallel import DCP_PAGE_SIZE, dcp_attention
from ..common.kvcache import (FP8_DTYPE, append_and_route, batch_rows_table, cache_view, capacity, check_kvcache_args,
                              contiguous_rows, lse_flag, rotary_plan, row_lengths)
from ..common.op_support import resolve_path
from ..common.runtime import empty_result
from ..common.varlen import is_varlen, serve_varlen
from .interface import DECODE_FAMILIES, _block_sparse_decode, check_args, chunk_rows, decode_layout



def block_sparse_attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, layout,
                                        block_table=None, causal=True, scale=None, return_lse=False,
                                        backend="auto", validate=False, k_descale=None, v_descale=None,
                                        softcap=0.0, sinks=None, cache_batch_idx=None, cache_leftpad=None,
                                        return_softmax_lse=None, rotary_cos=None, rotary_sin=None,
                                        rotary_interleaved=True, cu_seqlens_q=None, max_seqlen_q=None,
                                        cu_seqlens_k_new=None,
                                        group=None, dcp_page_size=DCP_PAGE_SIZE):
    """Block-sparse attention of queries at the end of a KV cache: a decode step with no host
    sync, or chunked prefill.

    Args:
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, validate, k_descale,
            v_descale: as `dilated_attention_with_kvcache` (q: the last Nq positions of each
            row's L_b = cache_seqlens[b] + Nnew valid rows, up to 16 on the decode path with
            no host sync, more as chunked prefill; a row with L_b < Nq: without causal its
            first queries sit at position 0 (max(L_b - Nq + i, 0): layout row 0, every key of
            a dense layout), under causal they read no key; k, v appended in place;
            block_table: a paged cache; k_descale, v_descale: an FP8 cache).
        layout: a BlockLayout covering the cache's capacity Nk (ceil(Nk / block_size)
            blocks per side) at absolute positions, laid out for (B|1, Hq|1); keep it on
            q's device (a copy per call otherwise). Each query reads the active blocks of
            its own layout row, cut at L_b (a sliding window's predicate in its window blocks:
            gpt-oss / Mistral sliding layers decode exactly).
        causal (default True), scale, return_lse, backend, softcap, sinks: as
            block_sparse_attention (the sinks join each row's denominator after the kernel).
        cache_batch_idx, cache_leftpad, return_softmax_lse: as `dilated_attention_with_kvcache`
            (FlashAttention's: batch row b reads and writes cache row cache_batch_idx[b] of a
            contiguous cache; row b's keys start at cache row cache_leftpad[b], positions, so
            the layout's blocks, counting from there; FlashAttention's name for return_lse).
        rotary_cos, rotary_sin, rotary_interleaved: as `dilated_attention_with_kvcache`
            (FlashAttention's rotary embedding of q and the new rows k, with its positions;
            fused into the append launch on the Triton path without gradients).
        cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new: varlen queries as
            `dilated_attention_with_kvcache` (FA3's names: q packed (total_q, Hq, D), each
            request's queries at the end of its row's keys, new rows packed by cu_seqlens_k_new;
            out (total_q, Hq, D), lse (Hq, total_q)); the layout's rows are the batch rows.
        group, dcp_page_size: decode context parallelism, as `dilated_attention_with_kvcache`
            (page j of every row on rank j % P; the layout covers the global capacity).

    Returns out (B, Nq, Hq, D) like q, or (out, lse) with lse float32 (B, Hq, Nq); rows with
    no active key: 0 and -inf. Differentiable in eager mode (with gradients on the Triton path
    the training kernels run). Under torch.compile: the custom op
    `triton_dilated::block_sparse_decode` (build the layout outside the compiled region).
    """
    return_lse = lse_flag(return_lse, return_softmax_lse)
    varlen = is_varlen(cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new)
    if group is not None:
        return dcp_attention(block_sparse_attention_with_kvcache, q, k_cache, v_cache, k, v, group=group, varlen=varlen,
                             cache_seqlens=cache_seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx,
                             dcp_page_size=dcp_page_size, sinks=sinks, return_lse=return_lse, validate=validate,
                             who="block_sparse_attention_with_kvcache", layout=layout, causal=causal, scale=scale,
                             backend=backend, k_descale=k_descale, v_descale=v_descale, softcap=softcap,
                             cache_leftpad=cache_leftpad, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                             rotary_interleaved=rotary_interleaved)
    if varlen:
        door = functools.partial(block_sparse_attention_with_kvcache, layout=layout, scale=scale, backend=backend,
                                 k_descale=k_descale, v_descale=v_descale, softcap=softcap, sinks=sinks)
        return serve_varlen(door, q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, cu_seqlens_q=cu_seqlens_q,
                            max_seqlen_q=max_seqlen_q, cu_seqlens_k_new=cu_seqlens_k_new, rotary_cos=rotary_cos,
                            rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, causal=causal,
                            validate=validate, return_lse=return_lse, k_descale=k_descale, v_descale=v_descale)
    block_table = batch_rows_table(q, k_cache, block_table, cache_batch_idx, validate)
    q, k, rotary = rotary_plan(q, k, cache_seqlens, rotary_cos, rotary_sin, rotary_interleaved, causal, validate)
    check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, block_table, validate, k_descale, v_descale,
                       cache_leftpad)
    call = check_args(q, cache_view(k_cache, block_table, q.shape[0], q), cache_view(v_cache, block_table, q.shape[0], q),
                      layout, causal, scale, return_lse, softcap, sinks, allow_shorter_q=True,
                      door="")
    B, Hq = q.shape[0], q.shape[2]
    layout.check_seq_len(capacity(k_cache, block_table))
    layout.check_heads(B, Hq)
    path = resolve_path(backend, str(q.device), DECODE_FAMILIES, q.shape[-1], q.dtype)
    q, lengths, decodes = append_and_route(q, path, k_cache, v_cache, k, v, cache_seqlens, block_table, validate,
                                           k_descale, v_descale, cache_leftpad, rotary)
    if B == 0:
        return call.finish(empty_result(q, *((q, q) if k_cache.dtype == FP8_DTYPE else (k_cache, v_cache)), True),
                           return_lse)
    if layout.kv_indices.device != q.device:
        layout = layout.to(q.device)
    if not decodes:   # chunked prefill: one host read of the lengths
        rows = row_lengths(lengths, cache_leftpad)
        k_rows = contiguous_rows(k_cache, block_table, max(rows), q.dtype, k_descale, cache_leftpad)
        v_rows = contiguous_rows(v_cache, block_table, max(rows), q.dtype, v_descale, cache_leftpad)
        out, lse = chunk_rows(q, k_rows, v_rows, rows, layout, capacity(k_cache, block_table), call,
                              backend=backend)
    elif torch.compiler.is_compiling():
        window = (0, 0, None) if layout.window is None else (*layout.window, layout.kv_window)
        out, lse = _block_sparse_decode(q, k_cache, v_cache, lengths, block_table, layout.kv_num_blocks,
                                        layout.kv_indices, layout.block_size, call.causal, call.scale, path,
                                        k_descale, v_descale, *window, call.softcap, cache_leftpad)
    else:
        out, lse = decode_layout(q, k_cache, v_cache, layout, lengths, call, path=path, block_table=block_table,
                                 k_descale=k_descale, v_descale=v_descale, leftpad=cache_leftpad)
    return call.finish((out, lse), return_lse)


