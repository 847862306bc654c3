"""The serve door of dilated attention: `dilated_attention_with_kvcache` (FlashAttention's
`flash_attn_with_kvcache` shape), the one entry point for queries at the end of a longer key
sequence, its custom op `triton_dilated::dilated_decode` (what torch.compile traces) and
`decode_table`, the decode step.

Routes (common/kvcache.serve_route): a decode step (up to 16 queries) reads only the keys
each query attends to (the Triton decode kernel, or the portable decode), with no host sync:
lengths stay a device tensor, every shape comes from the input shapes (the longest key list
from the cache's length), and value checks run only with validate=True. Chunked prefill (more
queries), and gradients on the Triton path, take the query-offset path
(common/query_offset.py): the training kernels on q padded in front, the Triton kernels
planning only the chunk's tiles (plan.QueryWindow: forward and dQ cost the chunk, dK/dV skip
the key tiles no chunk row reads), the portable path a full-length call; it reads the lengths
on the host once.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..common.first_order import needs_grad
from ..common.kvcache import (FP8_DTYPE, MAX_DECODE_QUERIES, cache_view, check_kvcache_args, contiguous_rows,
                              decode_step, portable_descaled, with_sinks)
from ..common.op_support import check_path, lazy_module
from ..common.query_offset import run_with_query_offset
from ..common.runtime import empty_result, last_dim_contiguous, resolve_backend
from .decode import dilated_decode
from .interface import CONFIG_FAMILIES, check_args, dilated_attention, dilated_attention_table
from .patterns import fit_patterns, head_table
from .plan import QueryWindow

_decode_kernels = lazy_module(__package__ + ".decode_kernels")   # imports triton

DECODE_FAMILIES = ("dilated_fwd",)


def decode_table(q, k, v, patterns, table, lengths, *, causal, scale, path, host_loop=False, block_table=None,
                 k_descale=None, v_descale=None, softcap=None):
    """(out, lse) of the last Nq positions of each row's lengths[b] (an integer tensor (B,) on
    q's device) valid rows of k, v (page pools with block_table; float8_e4m3fn with
    k_descale, v_descale): the Triton decode kernel or the portable decode (host_loop: its
    strided-view CPU variant, which reads the lengths on the host; contiguous caches only).
    softcap: None or the cap c (scores s -> c * tanh(s / c))."""
    if path == "torch":
        return portable_descaled(lambda q_: dilated_decode(q_, k, v, patterns, table, lengths, causal=causal,
                                                           scale=scale, host_loop=host_loop, block_table=block_table,
                                                           softcap=softcap),
                                 q, k_descale, v_descale, k.shape[2])
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    return _decode_kernels().dilated_decode_forward(q, k, v, patterns, table, lengths, causal=causal, scale=scale,
                                                    block_table=block_table, k_descale=k_descale, v_descale=v_descale,
                                                    softcap=softcap)


def dilated_attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None,
                                   segment_lengths, dilation_rates, causal=True, scale=None, mode="longnet",
                                   offsets="modulo", return_lse=False, backend="auto", validate=False,
                                   head_offset=0, total_heads=None, k_descale=None, v_descale=None, softcap=None,
                                   sinks=None):
    """Dilated attention of queries at the end of a KV cache: a decode step with no host sync,
    or chunked prefill.

    Args:
        q: (B, Nq, Hq, D), Nq >= 1: the last Nq positions of each row (query i of row b at
            L_b - Nq + i, L_b below; a row with L_b < Nq has its first queries before
            position 0, which read no key: out 0, lse -inf). Up to 16 queries (a decode
            step, a speculative draft) read only their keys, with no host sync; more
            (chunked prefill) read the lengths on the host once and run the training
            kernels on the chunk (Triton: forward and dQ cost the chunk's rows).
        k_cache, v_cache: (B, Nk, Hkv, D), Hq % Hkv == 0, q's dtype and device; Nk (the
            cache's capacity) bounds the key lists, so a static cache costs what its
            schedule reads, not Nk.
        k, v: None, or new rows (B, Nnew, Hkv, D), written into k_cache, v_cache in place at
            rows cache_seqlens[b] .. cache_seqlens[b] + Nnew - 1 before attending (as
            flash_attn_with_kvcache).
        cache_seqlens: int32 tensor (B,) on q's device: valid rows of each cache row before
            the call (FlashAttention's convention: the new rows not counted); the attention
            covers L_b = cache_seqlens[b] + Nnew rows. Not modified.
        block_table: None, or int32 (B, max_pages) on q's device for a paged cache: then
            k_cache, v_cache are page pools (num_pages, page_size, Hkv, D) shared by the
            rows, and position n of row b lives at row n % page_size of page
            block_table[b, n // page_size]; the capacity is max_pages * page_size. The
            result equals that of the same rows in a contiguous cache bit for bit.
        k_descale, v_descale: for an FP8 cache (k_cache, v_cache float8_e4m3fn, q 16- or
            32-bit), float32 tensors (Hkv,) on q's device, FlashAttention-3's names: the key
            (value) row h of a stored row is k_cache[..., h, :] * k_descale[h]. New rows k, v
            (q's dtype) are quantised on append: k / k_descale rounded to nearest-even,
            saturated to +-448 (choose k_descale >= max|k| / 448, e.g. amax / 448 per head
            from a calibration pass). None (the default) for a 16/32-bit cache.
        segment_lengths, dilation_rates, causal, scale, mode, offsets, return_lse, backend,
            head_offset, total_heads, softcap, sinks: as dilated_attention (causal defaults to
            True here; the sinks join each row's denominator after the kernel, on the device).
        validate: check that every L_b lies in [0, Nk] and a paged row's pages in the pool
            (reads the lengths on the host: a device sync; for debugging; chunked prefill
            always checks). Without it values are not checked on a decode step: an append
            outside [0, Nk) writes nothing, a key on a page outside the pool is not read.

    Returns:
        out (B, Nq, Hq, D) like q, or (out, lse) with lse float32 (B, Hq, Nq).
        Differentiable in eager mode (a decode step with gradients on the Triton path takes
        the training kernels: the decode kernel has no backward).

    Under torch.compile it runs as the custom op `triton_dilated::dilated_decode` (either
    backend), so `torch.compile(fullgraph=True)` traces a decode step once for every value
    of cache_seqlens.
    """
    check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, block_table, validate, k_descale, v_descale,
                       softcap=softcap, sinks=sinks)
    B = q.shape[0]
    patterns, scale, heads = check_args(q, cache_view(k_cache, block_table, B, q),
                                        cache_view(v_cache, block_table, B, q),
                                        segment_lengths, dilation_rates, causal, scale, mode, offsets, return_lse,
                                        allow_shorter_q=True, head_offset=head_offset, total_heads=total_heads)
    Hq = q.shape[2]
    path, lengths, decodes = decode_step("dilated_attention_with_kvcache", q, k_cache, v_cache, k, v,
                                         cache_seqlens, block_table, validate, backend, DECODE_FAMILIES, k_descale,
                                         v_descale)
    if B == 0:
        return with_sinks(empty_result(q, *((q, q) if k_cache.dtype == FP8_DTYPE else (k_cache, v_cache)), True),
                          sinks, return_lse)
    cap = float(softcap or 0.0)
    if not decodes:
        rows = [int(n) for n in lengths.tolist()]   # chunked prefill: one host read
        k_rows = contiguous_rows(k_cache, block_table, max(rows), q.dtype, k_descale)
        v_rows = contiguous_rows(v_cache, block_table, max(rows), q.dtype, v_descale)

        def call(qq, kk, vv, batch_rows, n, first_row):
            return padded_call(qq, kk, vv, first_row, patterns, segment_lengths, dilation_rates, causal=causal,
                               scale=scale, mode=mode, offsets=offsets, backend=backend, heads=heads,
                               softcap=softcap)

        out, lse = run_with_query_offset(call, q, k_rows, v_rows, rows)
    elif torch.compiler.is_compiling():
        out, lse = _dilated_decode(q, k_cache, v_cache, lengths, block_table, [w for w, _ in patterns],
                                   [r for _, r in patterns], causal, scale, mode, offsets, *heads, path, k_descale,
                                   v_descale, cap)
    else:
        table = head_table(Hq, patterns, mode, offsets, *heads)
        out, lse = decode_table(q, k_cache, v_cache, patterns, table, lengths, causal=causal, scale=scale, path=path,
                                block_table=block_table, k_descale=k_descale, v_descale=v_descale, softcap=softcap)
    return with_sinks((out, lse), sinks, return_lse)


def attend_rows(q, k_rows, v_rows, segment_lengths, dilation_rates, *, causal, scale, mode, offsets, backend):
    """The last Nq positions of k_rows, v_rows (every row valid: DilatedKVCache's rows) through
    the serve door; a decode step of CPU tensors without gradients on the portable path reads
    the runs in place instead (decode.attend_runs: the lengths are known here, no host read;
    3-5x faster on a CPU than gathering the keys)."""
    B, Nq = q.shape[:2]
    lengths = torch.full((B,), k_rows.shape[1], dtype=torch.int32, device=q.device)
    kw = dict(segment_lengths=segment_lengths, dilation_rates=dilation_rates, causal=causal, scale=scale, mode=mode,
              offsets=offsets, backend=backend)
    if B and q.device.type == "cpu" and Nq <= MAX_DECODE_QUERIES and not needs_grad(q, k_rows, v_rows) and \
            resolve_backend(backend, q.device, DECODE_FAMILIES, q.shape[-1], q.dtype) == "torch":
        patterns, scale, heads = check_args(q, k_rows, v_rows, segment_lengths, dilation_rates, causal, scale, mode,
                                            offsets, False, allow_shorter_q=True)
        table = head_table(q.shape[2], patterns, mode, offsets, *heads)
        return decode_table(q, k_rows, v_rows, patterns, table, lengths, causal=causal, scale=scale, path="torch",
                            host_loop=True)[0]
    return dilated_attention_with_kvcache(q, k_rows, v_rows, cache_seqlens=lengths, **kw)


def padded_call(q, k, v, first_query_row, patterns, segment_lengths, dilation_rates, *, causal, scale, mode,
                offsets, backend, heads=(0, None), softcap=None):
    """(out, lse) of the full-sequence call on q padded with first_query_row zero rows in
    front (common/query_offset.py), of which only the rows from first_query_row on are kept.
    The Triton path plans only the work those rows need (plan.QueryWindow): forward and dQ
    cost the chunk, not the sequence; dK/dV skip the key tiles no kept row reads. The
    portable path runs the full call."""
    B, N, Hq, D = q.shape
    if B and N and resolve_backend(backend, q.device, CONFIG_FAMILIES, D, q.dtype) == "triton":
        patterns = fit_patterns(patterns, N, heads[1] or Hq)
        return dilated_attention_table(q, k, v, patterns, head_table(Hq, patterns, mode, offsets, *heads),
                                       causal=causal, scale=scale, backend="triton",
                                       doc_bounds=QueryWindow(None, first_query_row), softcap=softcap)
    return dilated_attention(q, k, v, segment_lengths, dilation_rates, causal=causal, scale=scale, mode=mode,
                             offsets=offsets, return_lse=True, backend=backend, head_offset=heads[0],
                             total_heads=heads[1], softcap=softcap)


# ----------------------------------------------------------------------------- custom op
# Patterns travel as two int lists plus `mode` and `offsets` (the offset table is rebuilt,
# cached); the lengths are the rows valid after the append (the append happens outside the
# op, as plain index_put_ that torch.compile functionalises). No autograd formula: inference.

@torch.library.custom_op("triton_dilated::dilated_decode", mutates_args=())
def _dilated_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, block_table: Optional[Tensor],
                    segment_lengths: List[int], dilation_rates: List[int], causal: bool, scale: float, mode: str,
                    offsets: str, head_offset: int, total_heads: int, path: str, k_descale: Optional[Tensor] = None,
                    v_descale: Optional[Tensor] = None, softcap: float = 0.0) -> Tuple[Tensor, Tensor]:
    """(out, lse) of the decode step: out (B, Nq, Hq, D) like q, lse float32 (B, Hq, Nq).
    softcap 0.0: no cap."""
    check_path(path)
    patterns = tuple(zip((int(w) for w in segment_lengths), (int(r) for r in dilation_rates)))
    table = head_table(q.shape[2], patterns, mode, offsets, head_offset, total_heads)
    return decode_table(q, k_cache, v_cache, patterns, table, lengths, causal=causal, scale=scale, path=path,
                        block_table=block_table, k_descale=k_descale, v_descale=v_descale, softcap=softcap or None)


@_dilated_decode.register_fake
def _(q, k_cache, v_cache, lengths, block_table, segment_lengths, dilation_rates, causal, scale, mode, offsets,
      head_offset, total_heads, path, k_descale=None, v_descale=None, softcap=0.0):
    B, Nq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Nq), dtype=torch.float32)
