"""The inference entry point of dilated attention: `dilated_attention_with_kvcache`
(FlashAttention's `flash_attn_with_kvcache` shape), its custom op
`triton_dilated::dilated_decode` (what torch.compile traces) and `decode_table`, the decode
step both it and the training front door (`dilated_attention(..., cache_seqlens=)`) run.

No host sync from the call to the kernel launch, on either backend: lengths stay a device
tensor (the Triton decode kernel loads them; the portable path gathers with them), every
shape comes from the input shapes (the longest key list from the cache's length), and
value checks run only with validate=True (ops/common/kvcache.py).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..common.kvcache import FP8_DTYPE, cache_view, check_kvcache_args, decode_step, portable_descaled, with_sinks
from ..common.op_support import check_path, lazy_module
from ..common.runtime import empty_result, last_dim_contiguous
from ..common.validation import check_flags, check_qkv, check_scale
from .decode import dilated_decode
from .patterns import check_head_slice, check_patterns, fit_patterns, head_table, warn_if_heads_first

_decode_kernels = lazy_module(__package__ + ".decode_kernels")   # imports triton

DECODE_FAMILIES = ("dilated_fwd",)


def check_args(q, k, v, segment_lengths, dilation_rates, causal, scale, mode, offsets, return_lse,
               allow_shorter_q=False, head_offset=0, total_heads=None):
    """Validation shared by every dilated front door: (patterns fitted to k's length, scale,
    (head_offset, total_heads))."""
    check_qkv(q, k, v, allow_shorter_q=allow_shorter_q)
    patterns = check_patterns(segment_lengths, dilation_rates, mode, offsets)
    check_flags(causal=causal, return_lse=return_lse)
    heads = check_head_slice(head_offset, total_heads, q.shape[2], k.shape[2])
    warn_if_heads_first(patterns, k.shape[1], heads[1])
    patterns = fit_patterns(patterns, k.shape[1], heads[1])   # w >= N is one segment: clamped to N
    return patterns, check_scale(scale, q.shape[-1]), heads


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
    """Dilated attention of a decode step against a KV cache, with no host sync (inference).

    Args:
        q: (B, Nq, Hq, D), 1 <= Nq <= 16 (a decode step, a speculative draft): the last Nq
            positions of each row (query i of row b at L_b - Nq + i, L_b below).
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
        validate: check that every L_b lies in [Nq, Nk] (reads the lengths on the host: a
            device sync; for debugging). Without it values are not checked: a length out
            of range reads or writes outside the row (an index error or garbage).

    Returns:
        out (B, Nq, Hq, D) like q, or (out, lse) with lse float32 (B, Hq, Nq). No gradient
        through the Triton path (a ValueError when one is needed); the portable path is
        differentiable in eager mode.

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
    path, lengths = decode_step("dilated_attention_with_kvcache", q, k_cache, v_cache, k, v, cache_seqlens,
                                block_table, validate, backend, DECODE_FAMILIES, k_descale, v_descale)
    if B == 0:
        return with_sinks(empty_result(q, *((q, q) if k_cache.dtype == FP8_DTYPE else (k_cache, v_cache)), True),
                          sinks, return_lse)
    cap = float(softcap or 0.0)
    if torch.compiler.is_compiling():
        out, lse = _dilated_decode(q, k_cache, v_cache, lengths, block_table, [w for w, _ in patterns],
                                   [r for _, r in patterns], causal, scale, mode, offsets, *heads, path, k_descale,
                                   v_descale, cap)
    else:
        table = head_table(Hq, patterns, mode, offsets, *heads)
        out, lse = decode_table(q, k_cache, v_cache, patterns, table, lengths, causal=causal, scale=scale, path=path,
                                block_table=block_table, k_descale=k_descale, v_descale=v_descale, softcap=softcap)
    return with_sinks((out, lse), sinks, return_lse)


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
