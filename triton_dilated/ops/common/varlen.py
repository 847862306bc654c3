"""Varlen queries on the serve doors (issue 33): FlashAttention-3's `cu_seqlens_q` /
`max_seqlen_q` (and `cu_seqlens_k_new` for packed new rows) on `*_attention_with_kvcache`.

q is packed (total_q, Hq, D): request b brings the rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1
(n_b of them, 0 allowed), aligned to the END of its row's keys (query i of request b at
L_b - n_b + i, causal bottom-right, as FlashAttention's varlen flash_attn_with_kvcache). New
rows k, v are packed the same way by cu_seqlens_k_new (FA3's name), (total_k_new, Hkv, D):
request b appends cu_seqlens_k_new[b+1] - cu_seqlens_k_new[b] rows at cache_seqlens[b] + j.

The route is exact and simple (serve_varlen): the new rows are written into the cache
(write_packed_rows), the packed queries scattered into a (B, max_seqlen_q, Hq, D) batch aligned
to the right (the pad rows in front are computed and dropped), the door called on that batch
(the decode kernel for max_seqlen_q <= 16, the query-offset path beyond), and the rows
gathered back: out (total_q, Hq, D), lse (Hq, total_q) (FA3's varlen lse layout). Every index
is computed on the device from the cu_seqlens tensors; max_seqlen_q, a Python int, fixes every
shape, so a decode step reads no value on the host (validate=True reads and checks them).
"""
from __future__ import annotations

import operator

import torch

from .kvcache import FP8_DTYPE, batch_rows_table, capacity, check_rotary, quantise_fp8, rotate
from .validation import check_bool, check_lengths_tensor


def is_varlen(cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new) -> bool:
    """Whether a serve door's call names varlen queries (any of the three keywords)."""
    return cu_seqlens_q is not None or max_seqlen_q is not None or cu_seqlens_k_new is not None


def check_cu_seqlens_tensor(name: str, cu, batch: int, device) -> None:
    """cu (cu_seqlens_q, cu_seqlens_k_new): an int32 tensor (B + 1,) on q's device (no value read)."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32:
        got = cu.dtype if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise TypeError(f"{name} must be an int32 tensor (B + 1,) = ({batch + 1},) of cumulative row counts, got "
                        f"{got}")
    if tuple(cu.shape) != (batch + 1,):
        raise ValueError(f"{name} must have shape (B + 1,) = ({batch + 1},) (B = cache_seqlens' length), got "
                         f"{tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device ({device}; a copy from elsewhere would wait for the host), "
                         f"got {cu.device}")


def check_cu_values(name: str, cu, total: int, most=None) -> None:
    """validate=True: cu starts at 0, never decreases, ends at `total` (the packed rows), and no
    request brings more than `most` rows (max_seqlen_q). Reads cu on the host."""
    bounds = cu.tolist()
    steps = [b - a for a, b in zip(bounds, bounds[1:])]
    if bounds[0] != 0 or bounds[-1] != total or min(steps, default=0) < 0:
        raise ValueError(f"{name} must start at 0, not decrease and end at the packed row count ({total}), got "
                         f"{bounds}")
    if most is not None and max(steps, default=0) > most:
        raise ValueError(f"max_seqlen_q must be >= every request's query count (FlashAttention's rule), got "
                         f"max_seqlen_q={most} and a request of {max(steps)} rows (cu_seqlens_q={bounds})")


def check_varlen_args(q, k_cache, v_cache, k, v, cache_seqlens, cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new) -> int:
    """Types, shapes and devices of a varlen call (no value read). Returns B."""
    if cu_seqlens_q is None:
        raise ValueError("max_seqlen_q and cu_seqlens_k_new go with cu_seqlens_q (packed varlen queries), got "
                         "cu_seqlens_q=None")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must have 3 dimensions (total_q, Hq, D) with cu_seqlens_q (packed varlen queries), got "
                         f"shape {tuple(q.shape)}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 4-D tensor (B or num_pages, N, Hkv, D), got {got}")
    # B: the requests (cache_seqlens' length; cu_seqlens_q's less one where cache_seqlens is not 1-D)
    B = cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor) and cu_seqlens_q.dim() == 1 else 0
    if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dim() == 1:
        B = cache_seqlens.shape[0]
    check_lengths_tensor(cache_seqlens, B, " on q's device")
    check_cu_seqlens_tensor("cu_seqlens_q", cu_seqlens_q, B, q.device)
    if max_seqlen_q is None or isinstance(max_seqlen_q, (bool, torch.Tensor)):
        raise TypeError(f"max_seqlen_q must be a Python int (the most queries a request brings: it fixes the "
                        f"shapes, a tensor would need a host read), got {type(max_seqlen_q).__name__}")
    try:
        max_q = operator.index(max_seqlen_q)
    except TypeError:
        raise TypeError(f"max_seqlen_q must be a Python int, got {type(max_seqlen_q).__name__}") from None
    if max_q < 0:
        raise ValueError(f"max_seqlen_q must be a non-negative int, got {max_q}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new rows to append) or both be None")
    if k is None:
        if cu_seqlens_k_new is not None:
            raise ValueError("cu_seqlens_k_new packs the new rows k, v: give k and v with it (or leave it None)")
        return B
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{name} (new rows) must have 3 dimensions (total_k_new, Hkv, D) with cu_seqlens_q "
                             f"(packed by cu_seqlens_k_new), got shape {tuple(x.shape)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must hold the same number of new rows, got {k.shape[0]} and {v.shape[0]}")
    if cu_seqlens_k_new is None:
        raise ValueError("packed new rows k, v (total_k_new, Hkv, D) need cu_seqlens_k_new, int32 (B + 1,): the "
                         "rows request b appends (FA3's convention), got None")
    check_cu_seqlens_tensor("cu_seqlens_k_new", cu_seqlens_k_new, B, q.device)
    return B


def packed_index(cu, total: int, width: int = 0):
    """For packed rows t = 0 .. total - 1: (their request b, their index j within it, the
    request's row count n_b), long tensors on cu's device. With width > 0, j is shifted to the
    right end of a row of `width` slots (width - n_b + j; clamped at 0 for a request of more than
    `width` rows, which validate=True refuses)."""
    cu = cu.long()
    t = torch.arange(total, device=cu.device)
    b = torch.searchsorted(cu[1:], t, right=True).clamp(max=cu.shape[0] - 2)
    j = t - cu[b]
    n = cu[1:] - cu[:-1]
    if width:
        j = (width - n[b] + j).clamp(min=0)
    return b, j, n


def write_packed_rows(k_cache, v_cache, k, v, cache_seqlens, cu_seqlens_k_new, block_table=None, k_descale=None,
                      v_descale=None):
    """Write packed new rows k, v (total_k_new, Hkv, D) into the caches in place, request b's
    row j at cache row cache_seqlens[b] + j (through block_table for a page pool), with no
    host sync; into an FP8 cache quantised (kvcache.quantise_fp8). As kvcache.append_rows, a
    request whose rows leave [0, capacity), or a row whose page lies outside the pool, writes
    nothing (its rows write back the values they read). Returns the lengths after the append,
    cache_seqlens + the rows each request brought (int32)."""
    b, j, n = packed_index(cu_seqlens_k_new, k.shape[0])
    lens = (cache_seqlens.long() + n).to(torch.int32)
    if k.shape[0] == 0:
        return lens
    if k_cache.dtype == FP8_DTYPE:
        k, v = quantise_fp8(k, k_descale), quantise_fp8(v, v_descale)
    cap = capacity(k_cache, block_table)
    start = cache_seqlens.long()
    ok = ((start >= 0) & (start + n <= cap))[b]                                # (total_k_new,)
    rows = (torch.where(ok, start[b], 0) + j).clamp(0, cap - 1)
    batch = b
    if block_table is not None:
        num_pages, page_size = k_cache.shape[:2]
        pages = block_table[b, rows // page_size].long()
        ok = ok & (pages >= 0) & (pages < num_pages)
        batch, rows = pages.clamp(0, num_pages - 1), rows % page_size
    keep = ok.view(-1, 1, 1)
    for cache, new in ((k_cache, k), (v_cache, v)):
        bits = cache.view(torch.uint8) if cache.dtype == FP8_DTYPE else cache   # torch.where has no float8
        new = new.view(torch.uint8) if cache.dtype == FP8_DTYPE else new
        bits[batch, rows] = torch.where(keep, new, bits[batch, rows])
    return lens


def rotary_packed(q, k, cache_seqlens, cu_seqlens_q, cu_seqlens_k_new, rotary_cos, rotary_sin, interleaved, causal,
                  validate):
    """FlashAttention's rotary embedding of packed q and k (kvcache.apply_rotary's positions):
    new row j of request b at cache_seqlens[b] + j, query i at cache_seqlens[b] + i when causal,
    at cache_seqlens[b] otherwise; positions past the tables read their last row (validate=True
    refuses them)."""
    check_rotary(q, k, rotary_cos, rotary_sin, interleaved)
    start = cache_seqlens.long()
    bq, iq, _ = packed_index(cu_seqlens_q, q.shape[0])
    bk, jk, _ = packed_index(cu_seqlens_k_new, k.shape[0])
    q_pos = start[bq] + (iq if causal else 0)
    k_pos = start[bk] + jk
    rows = rotary_cos.shape[0]
    if validate:
        top = int(torch.cat([q_pos, k_pos]).max()) if q_pos.numel() + k_pos.numel() else 0
        if top >= rows:
            raise ValueError(f"rotary_cos and rotary_sin hold {rows} positions, but this call rotates position {top} "
                             f"(cache_seqlens + the new rows): seqlen_ro must exceed it")
    q_pos, k_pos = q_pos.clamp(0, rows - 1), k_pos.clamp(0, rows - 1)
    return (rotate(q[None], rotary_cos[q_pos][None], rotary_sin[q_pos][None], interleaved)[0],
            rotate(k[None], rotary_cos[k_pos][None], rotary_sin[k_pos][None], interleaved)[0])


def serve_varlen(door, q, k_cache, v_cache, k, v, *, cache_seqlens, block_table, cache_batch_idx, cache_leftpad,
                 cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new, rotary_cos, rotary_sin, rotary_interleaved, causal,
                 validate, return_lse, k_descale=None, v_descale=None, per_query=()):
    """A serve door's varlen call (the module docstring): `door(q_batch, k_cache, v_cache,
    *per_query batches, cache_seqlens=, block_table=, cache_leftpad=, causal=, validate=,
    return_lse=True)` is the door with its other keywords bound. per_query: (name, packed
    tensor (total_q, ...), fill) of further per-query inputs (the indexed door's indices),
    scattered as q is, their pad rows `fill`. Returns out (total_q, Hq, Dv), or (out, lse
    (Hq, total_q))."""
    B = check_varlen_args(q, k_cache, v_cache, k, v, cache_seqlens, cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new)
    check_bool("validate", validate)
    check_bool("causal", causal)
    check_bool("rotary_interleaved", rotary_interleaved)
    total_q, width = q.shape[0], max(operator.index(max_seqlen_q), 1)
    if validate:
        check_cu_values("cu_seqlens_q", cu_seqlens_q, total_q, operator.index(max_seqlen_q))
        if k is not None:
            check_cu_values("cu_seqlens_k_new", cu_seqlens_k_new, k.shape[0])
    if rotary_cos is not None or rotary_sin is not None:
        if k is None:
            check_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved)   # names the missing k
        q, k = rotary_packed(q, k, cache_seqlens, cu_seqlens_q, cu_seqlens_k_new, rotary_cos, rotary_sin,
                             rotary_interleaved, causal, validate)
    # the door checks the caches against this batch view of q (B, width, Hq, D); a contiguous
    # cache with cache_batch_idx becomes a page pool with a one-page table (as the door does)
    q_batch = q.new_zeros((B, width, *q.shape[1:]))
    table = batch_rows_table(q_batch, k_cache, block_table, cache_batch_idx, validate)
    lens = cache_seqlens
    if k is not None:
        new_dtype = q.dtype if k_cache.dtype == FP8_DTYPE else k_cache.dtype
        if k.dtype != new_dtype or v.dtype != new_dtype or k.shape[1:] != k_cache.shape[2:] or \
                v.shape[1:] != v_cache.shape[2:]:
            raise ValueError(f"k, v (new rows) must have shape (total_k_new, Hkv, D) = (.., "
                             f"{', '.join(map(str, k_cache.shape[2:]))}) like the caches and the cache's dtype "
                             f"(q's for an FP8 cache), got {tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}")
        lens = write_packed_rows(k_cache, v_cache, k, v, cache_seqlens, cu_seqlens_k_new, table, k_descale,
                                 v_descale)
    b, j, _ = packed_index(cu_seqlens_q, total_q, width)
    q_batch = q_batch.index_put((b, j), q)                                      # right-aligned; pad rows 0
    batches = []
    for name, x, fill in per_query:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != total_q:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be packed like q with cu_seqlens_q: ({total_q}, ...), got {got}")
        batches.append(x.new_full((B, width, *x.shape[1:]), fill).index_put((b, j), x))
    out, lse = door(q_batch, k_cache, v_cache, *batches, cache_seqlens=lens, block_table=table,
                    cache_leftpad=cache_leftpad, causal=causal, validate=validate, return_lse=True)
    out = out[b, j]                                                              # (total_q, Hq, D)
    lse = lse.permute(1, 0, 2)[:, b, j]                                         # (Hq, total_q)
    return (out, lse) if return_lse else out
