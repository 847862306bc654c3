"""The serve door of indexed attention: `indexed_attention_with_kvcache` (FlashAttention's
`flash_attn_with_kvcache` shape, DESIGN §5b): new rows appended in place, per-row lengths
`cache_seqlens`, contiguous or paged caches, FP8 caches, no host sync.

Indexed attention reads only the keys a query lists, so one path serves decode steps and
chunked prefill alike: the slots are made canonical against each row's length on the device
(indices.canonical_slots with lengths), and the forward kernel (or the portable gather) reads
the listed rows where they live (a page of the pool, float8 rows dequantised). Gradients (a
contiguous cache in q's dtype) take the portable path: the Triton serve path has no backward.
Under torch.compile the read is the custom op `triton_dilated::indexed_serve_fwd` (the append
and the canonical slots are torch code, traced as they are; cache_seqlens is a tensor, so new
lengths do not recompile).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..common.call import AttentionCall
from ..common.context_parallel import DCP_PAGE_SIZE, dcp_attention
from ..common.first_order import joined_to, needs_grad
from ..common.kvcache import (FP8_DTYPE, append_rows, batch_rows_table, cache_view, capacity, check_block_table,
                              check_descales, check_kvcache_values, check_row_index, lse_flag, rotary_inputs)
from ..common.lse import lse_from_stats
from ..common.op_support import check_path, fresh, lazy_module, resolve_path
from ..common.validation import check_bool, check_flags, check_lengths_tensor
from ..common.varlen import is_varlen, serve_varlen
from .indices import canonical_slots, check_inputs, validate_values
from .portable import indexed_attention_torch

_kernels = lazy_module(__package__ + ".kernels")   # imports triton


def check_serve_args(q, k_cache, v_cache, indices, k, v, cache_seqlens, block_table, physical_slots, causal):
    """Shapes, dtypes and devices (no value read): q (B, Nq, Hq, Dqk); k_cache (B, Nk, Hkv, Dqk),
    v_cache (B, Nk, Hkv, Dv) (any strides with a unit last one: v may be a view of k's first Dv
    values), or with block_table int32 (B, pages) page pools (num_pages, page_size, Hkv, D);
    new rows k, v (B, Nnew, Hkv, Dqk | Dv) both or neither; cache_seqlens int32 (B,)."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(x.shape)}")
    B, Nq = q.shape[:2]
    if Nq < 1:
        raise ValueError(f"q must hold at least one query row per batch row, got {Nq}")
    if tuple(k_cache.shape[:3]) != tuple(v_cache.shape[:3]):
        raise ValueError(f"k_cache and v_cache must agree but for the head dim, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if block_table is not None:
        check_block_table(block_table, B, q.device)
    elif k_cache.shape[0] != B:
        raise ValueError(f"k_cache and v_cache must have the batch size of q ({B}), got {k_cache.shape[0]}")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(f"k_cache and v_cache must be on q's device ({q.device}), got {k_cache.device}, "
                         f"{v_cache.device}")
    if k_cache.dtype != FP8_DTYPE and not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache and v_cache must share one dtype (or the caches be float8_e4m3fn), got "
                        f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    check_inputs(q, cache_view(k_cache, block_table, B, q), cache_view(v_cache, block_table, B, q), indices)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new rows to append) or both be None")
    if k is not None:
        new_dtype = q.dtype
        for name, x, cache in (("k", k, k_cache), ("v", v, v_cache)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
            if x.dim() != 4 or x.shape[0] != B or tuple(x.shape[2:]) != tuple(cache.shape[2:]):
                raise ValueError(f"{name} (new rows) must have shape (B, Nnew, Hkv, D) = ({B}, Nnew, "
                                 f"{', '.join(map(str, cache.shape[2:]))}), got {tuple(x.shape)}")
            if x.dtype != new_dtype or x.device != q.device:
                raise TypeError(f"{name} must have q's dtype and device ({new_dtype}, {q.device}), got {x.dtype}, "
                                f"{x.device}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k and v must hold the same number of new rows, got {k.shape[1]} and {v.shape[1]}")
        if k.shape[1] > capacity(k_cache, block_table):
            raise ValueError(f"k holds {k.shape[1]} new rows, more than the cache's {capacity(k_cache, block_table)}")
    check_lengths_tensor(cache_seqlens, B, " on q's device")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens must be on q's device ({q.device}), got {cache_seqlens.device}")
    check_bool("physical_slots", physical_slots)
    if physical_slots and block_table is None:
        raise ValueError("physical_slots=True reads indices as page pool rows (page * page_size + offset): it needs "
                         "a paged cache (block_table)")
    if physical_slots and causal:
        raise ValueError("physical_slots=True: pool rows carry no position, so causal=True cannot cut them; pass "
                         "causal=False with indices that are causal already (as FlashMLA's sparse kernels take them)")


def indexed_attention_with_kvcache(q, k_cache, v_cache, indices, k=None, v=None, *, cache_seqlens, block_table=None,
                                   causal=True, scale=None, softcap=None, sinks=None, return_lse=False,
                                   backend="auto", validate=False, k_descale=None, v_descale=None,
                                   physical_slots=False, cache_batch_idx=None, cache_leftpad=None,
                                   rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                                   return_softmax_lse=None, cu_seqlens_q=None, max_seqlen_q=None, cu_seqlens_k_new=None,
                                   group=None, dcp_page_size=DCP_PAGE_SIZE):
    """Indexed attention of queries at the end of a KV cache, with no host sync.

    Args:
        q: (B, Nq, Hq, Dqk), the last Nq positions of each row's L_b = cache_seqlens[b] + Nnew
            valid rows (query i at L_b - Nq + i); any Nq >= 1 (decode or chunked prefill). The
            indices are explicit, so without causal a query reads its used slots whatever its
            position (one before position 0 of a row with L_b < Nq too, as the patterned
            doors' clamp at 0 and FlashAttention); under causal such a query reads none.
        k_cache, v_cache: (B, Nk, Hkv, Dqk) and (B, Nk, Hkv, Dv) in q's dtype (v may be a view
            of k's first Dv values, the absorbed-MLA cache: Dqk 576, Dv 512, one kv head), or
            page pools (num_pages, page_size, Hkv, D) with block_table int32 (B, max_pages); or
            float8_e4m3fn with float32 k_descale, v_descale (Hkv,) (the stored value times it).
        indices: int32 (B, Nq, Hkv, topk) or (B, Nq, topk): token positions in the sequence;
            -1, a value outside [0, L_b) or (causal) past the query's position is unused. With
            physical_slots=True (a paged cache, causal=False): pool rows page * page_size +
            offset, as FlashMLA takes them (what vLLM and SGLang pass); a value outside the
            pool is unused. Under cache_leftpad, positions count from the pad: index t reads
            cache row cache_leftpad[b] + t, and t outside [0, L_b - cache_leftpad[b]) is unused.
        k, v: new rows (B, Nnew, Hkv, D) in q's dtype, written in place at rows
            cache_seqlens[b] .. + Nnew - 1 (quantised into an FP8 cache) before attending.
        cache_seqlens: int32 (B,) on q's device: the valid rows before the append.
        causal (default True), scale, softcap, sinks, return_lse, backend: as
            indexed_attention.
        validate: check the lengths, pages, descales, pads, rotary positions and indices on
            the host (a sync).
        cache_batch_idx: None, or int32 (B,) on q's device, as `dilated_attention_with_kvcache`
            (FlashAttention's): batch row b reads and writes row cache_batch_idx[b] of a
            contiguous cache (B_cache, Nk, Hkv, D) (the cache seen as a page pool with a
            one-page table: not with block_table). Not with physical_slots.
        cache_leftpad: None, or int32 (B,) on q's device, as `dilated_attention_with_kvcache`
            (FlashAttention's): row b's keys start at cache row cache_leftpad[b]; positions, so
            the indices and the causal cut, count from there (L_b - cache_leftpad[b] keys,
            query i at L_b - cache_leftpad[b] - Nq + i); validate=True checks
            0 <= cache_leftpad[b] <= cache_seqlens[b], without it a negative pad counts as 0.
            Not with physical_slots.
        rotary_cos, rotary_sin, rotary_interleaved: FlashAttention's rotary embedding of q
            and the new rows k (only with k, v), as `dilated_attention_with_kvcache`: new row
            j at position cache_seqlens[b] + j (its cache row, also under cache_leftpad), query
            i at cache_seqlens[b] + i when causal, at cache_seqlens[b] otherwise; applied in
            PyTorch before the append. Refused for a v_cache that shares k_cache's storage
            (the absorbed-MLA cache: rotating k would change v).
        return_softmax_lse: FlashAttention's name for return_lse (both given must agree).
        cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new: varlen queries as
            `dilated_attention_with_kvcache` (FA3's names, common/varlen.py): q packed
            (total_q, Hq, Dqk) and indices packed with it, (total_q, Hkv, topk) or (total_q,
            topk); new rows packed (total_k_new, Hkv, D) by cu_seqlens_k_new; out (total_q, Hq,
            Dv), lse (Hq, total_q).
        group, dcp_page_size: decode context parallelism, as `dilated_attention_with_kvcache`
            (page j of every row on rank j % P; indices stay token positions: a listed key on
            another rank's page is read there). Not with physical_slots (pool rows of one pool).
            cache_batch_idx, cache_leftpad and rotary compose with varlen and with group= as on
            the other doors.

    Returns out (B, Nq, Hq, Dv) like q (and lse float32 (B, Hq, Nq)); rows with no used slot:
    0 and -inf. Differentiable in eager mode through the portable path (contiguous caches).
    """
    return_lse = lse_flag(return_lse, return_softmax_lse)
    varlen = is_varlen(cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new)
    check_batch_args(k_cache, v_cache, physical_slots, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin)
    if group is not None:
        if physical_slots is not False:
            raise ValueError(f"indexed_attention_with_kvcache(group=...): physical_slots must be False (slots name "
                             f"rows of one pool; with group= indices are token positions), got {physical_slots!r}")

        def check(q, k_pool, v_pool, k, v, lens, table, validate, k_descale, v_descale, leftpad):
            check_serve_args(q, k_pool, v_pool, indices, k, v, lens, table, False, causal)
            check_descales(q, k_pool, v_pool, k_descale, v_descale)
            if leftpad is not None:
                check_row_index("cache_leftpad", leftpad, q, "the cache row where each batch row's keys start")
        return dcp_attention(indexed_attention_with_kvcache, q, k_cache, v_cache, k, v, group=group, varlen=varlen,
                             cache_seqlens=cache_seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx,
                             dcp_page_size=dcp_page_size, sinks=sinks, return_lse=return_lse, validate=validate,
                             who="indexed_attention_with_kvcache", extra=(indices,), check=check, causal=causal,
                             scale=scale, softcap=softcap, backend=backend, k_descale=k_descale, v_descale=v_descale,
                             cache_leftpad=cache_leftpad, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                             rotary_interleaved=rotary_interleaved)
    if varlen:
        def door(qb, kc, vc, idx, **kw):
            return indexed_attention_with_kvcache(qb, kc, vc, idx, scale=scale, softcap=softcap, sinks=sinks,
                                                  backend=backend, k_descale=k_descale, v_descale=v_descale,
                                                  physical_slots=physical_slots, **kw)
        return serve_varlen(door, q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, cu_seqlens_q=cu_seqlens_q,
                            max_seqlen_q=max_seqlen_q, cu_seqlens_k_new=cu_seqlens_k_new, rotary_cos=rotary_cos,
                            rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, causal=causal,
                            validate=validate,
                            return_lse=return_lse, k_descale=k_descale, v_descale=v_descale,
                            per_query=(("indices", indices, -1),))
    block_table = batch_rows_table(q, k_cache, block_table, cache_batch_idx, validate)
    q, k = rotary_inputs(q, k, cache_seqlens, rotary_cos, rotary_sin, rotary_interleaved, causal, validate)
    check_serve_args(q, k_cache, v_cache, indices, k, v, cache_seqlens, block_table, physical_slots, causal)
    check_descales(q, k_cache, v_cache, k_descale, v_descale)
    if cache_leftpad is not None:
        check_row_index("cache_leftpad", cache_leftpad, q, "the cache row where each batch row's keys start")
    check_flags(return_lse=return_lse, validate=validate)
    call = AttentionCall.at_door(q, causal=causal, scale=scale, softcap=softcap, sinks=sinks)
    B, Nq, _, D = q.shape
    cap = capacity(k_cache, block_table)
    pool_rows = k_cache.shape[0] * k_cache.shape[1]
    if validate:
        check_kvcache_values(cache_seqlens, 0 if k is None else k.shape[1], cap, block_table, k_cache.shape[0],
                             (k_descale, v_descale), cache_leftpad)
        validate_values(indices, pool_rows if physical_slots else cap)
    path = resolve_path(backend, str(q.device), (), D, q.dtype)
    if path == "triton" and needs_grad(*(x for x in (q, k_cache, v_cache, k, v) if x is not None)):
        path = "torch"   # no backward on the Triton serve path
    lengths = append_rows(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale)
    if cache_leftpad is not None:
        indices = positions_past_pad(indices, cache_leftpad, lengths)
    if B == 0 or indices.shape[-1] == 0:   # no row, or no slot: 0 and -inf
        out = joined_to(q.new_zeros((*q.shape[:3], v_cache.shape[-1])), q)
        return call.finish((out, q.new_full((B, q.shape[2], Nq), float("-inf"), dtype=torch.float32)), return_lse)
    if physical_slots:
        slots, count = canonical_slots(indices, Nq, pool_rows, False)
    else:
        slots, count = canonical_slots(indices, Nq, cap, call.causal, lengths)
    if torch.compiler.is_compiling():
        res = _indexed_serve_fwd(q, k_cache, v_cache, slots, count, block_table, k_descale, v_descale, call.scale,
                                 call.softcap, physical_slots, path)
    else:
        res = serve_read(q, k_cache, v_cache, slots, count, block_table, k_descale, v_descale, call.without_sinks(),
                         physical_slots, path)
    return call.finish(res, return_lse)


def check_batch_args(k_cache, v_cache, physical_slots, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin):
    """The door's refusals of FlashAttention's batch arguments (no value read): cache_batch_idx
    and cache_leftpad name cache rows and positions, which pool rows (physical_slots=True)
    already are; rotary rotates k in place of the append, which would change a v_cache that
    shares k_cache's storage (the absorbed-MLA cache, v a view of k's first Dv values)."""
    if physical_slots is True:
        for name, x in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if x is not None:
                raise ValueError(f"{name} must be None with physical_slots=True (indices are then pool rows, "
                                 f"page * page_size + offset: they name the physical rows already)")
    if (rotary_cos is not None or rotary_sin is not None) and isinstance(k_cache, torch.Tensor) and \
            isinstance(v_cache, torch.Tensor) and not torch.compiler.is_compiling() and \
            k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr():
        raise ValueError("rotary_cos and rotary_sin rotate the new keys k, but v_cache shares k_cache's storage (the "
                         "absorbed-MLA cache, v a view of k): rotating k would change v; rotate q and k yourself "
                         "(only the rope features) and pass rotary_cos=rotary_sin=None")


def positions_past_pad(indices, cache_leftpad, lengths):
    """Indices as token positions counted from each row's pad (cache_leftpad) turned into cache
    rows on the device: t -> cache_leftpad[b] + t for t in [0, lengths[b] - cache_leftpad[b]),
    else -1 (unused); a negative pad counts as 0. The causal cut against the query's cache row
    (lengths[b] - Nq + i) is then the cut at its position counted from the pad."""
    shape = (-1,) + (1,) * (indices.dim() - 1)
    pad = cache_leftpad.clamp(min=0).long().view(shape)
    keys = lengths.long().view(shape) - pad
    used = (indices >= 0) & (indices.long() < keys)
    return torch.where(used, indices.long() + pad, -1).to(torch.int32)


def serve_read(q, k_cache, v_cache, slots, count, block_table, k_descale, v_descale, call, physical, path):
    """(out, lse) of the canonical slots read from the caches (call without sinks)."""
    caches = dict(block_table=block_table, physical=physical, k_descale=k_descale, v_descale=v_descale)
    if path == "triton":
        out, row_max, row_sum = _kernels().indexed_forward(q, k_cache, v_cache, slots, count, call, **caches)
        return out, lse_from_stats(row_max, row_sum)
    return indexed_attention_torch(q, k_cache, v_cache, slots, count, call, **caches)


@torch.library.custom_op("triton_dilated::indexed_serve_fwd", mutates_args=())
def _indexed_serve_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, count: Tensor,
                       block_table: Optional[Tensor], k_descale: Optional[Tensor], v_descale: Optional[Tensor],
                       scale: float, softcap: float, physical: bool, path: str) -> Tuple[Tensor, Tensor]:
    """(out, lse) of the serve door's read (no autograd: gradients run eagerly)."""
    check_path(path)
    out, lse = serve_read(q, k_cache, v_cache, slots, count, block_table, k_descale, v_descale,
                          AttentionCall(False, scale, softcap), physical, path)
    return fresh(out), fresh(lse)


@_indexed_serve_fwd.register_fake
def _(q, k_cache, v_cache, slots, count, block_table, k_descale, v_descale, scale, softcap, physical, path):
    B, Nq, Hq, _ = q.shape
    return q.new_empty((B, Nq, Hq, v_cache.shape[-1])), q.new_empty((B, Hq, Nq), dtype=torch.float32)
