"""The inference entry points' shared pieces (`*_attention_with_kvcache`, FlashAttention's
`flash_attn_with_kvcache` shape): argument checks that read only shapes, dtypes and devices,
the in-place append of new key/value rows, and the value checks that run only when asked.

Nothing here reads a tensor's values on the host unless `validate=True`: no `.tolist()`,
`.item()`, `bool(tensor)` and no shape computed from values, so a decode step launches without
waiting for the device and can be captured in a CUDA graph or traced once by torch.compile.

Lengths (FlashAttention's convention): `cache_seqlens[b]` rows of k_cache/v_cache are valid
before the call; new rows k, v (B, Nnew, Hkv, D), when given, are written at rows
cache_seqlens[b] .. cache_seqlens[b] + Nnew - 1; the attention then covers
L_b = cache_seqlens[b] + Nnew rows (Nnew = 0 without k, v), with the Nq queries the last Nq
of them (query i at L_b - Nq + i, DESIGN §5b).
"""
from __future__ import annotations

import torch

from .first_order import needs_grad
from .op_support import resolve_path
from .runtime import resolve_backend
from .lse import with_sinks  # noqa: F401 (the inference entry points import it from here)
from .validation import check_bool, check_lengths_tensor, check_sinks, check_softcap

MAX_DECODE_QUERIES = 16   # = decode.DECODE_MAX_QUERIES (the decode paths' limit)


def capacity(k_cache, block_table) -> int:
    """Rows a cache row can hold: Nk, or max_pages * page_size for a paged cache."""
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


def cache_view(k_cache, block_table, batch: int):
    """A (B, capacity, Hkv, D) stand-in for shape checks (check_qkv): the cache itself, or for
    a page pool a zero-stride expand of its first row (no copy)."""
    if block_table is None:
        return k_cache
    return k_cache[:1, :1].expand(batch, capacity(k_cache, block_table), -1, -1)


def check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, block_table, validate, softcap=None,
                       sinks=None) -> None:
    """Shape/dtype/device checks (no value read): q (B, Nq, Hq, D) with 1 <= Nq <= 16;
    k_cache, v_cache (B, Nk, Hkv, D) like q, or with block_table int32 (B, max_pages) on q's
    device page pools (num_pages, page_size, Hkv, D); k, v both or neither, (B, Nnew, Hkv, D)
    with Nnew <= the capacity; cache_seqlens an int32 (or int64) tensor (B,) on q's device;
    softcap None or a positive float, sinks None or float32 (Hq,) on q's device."""
    check_bool("validate", validate)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, N, H, D), got shape {tuple(x.shape)}")
    B, Nq = q.shape[:2]
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
            got = block_table.dtype if isinstance(block_table, torch.Tensor) else type(block_table).__name__
            raise TypeError(f"block_table must be an int32 tensor (B, max_pages), got {got}")
        if block_table.dim() != 2 or block_table.shape[0] != B or block_table.shape[1] < 1:
            raise ValueError(f"block_table must have shape (B, max_pages) = ({B}, max_pages >= 1), got "
                             f"{tuple(block_table.shape)}")
        if block_table.device != q.device:
            raise ValueError(f"block_table must be on q's device ({q.device}), got {block_table.device}")
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache and v_cache (page pools) must have the same shape, got "
                             f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not 1 <= Nq <= MAX_DECODE_QUERIES:
        raise ValueError(f"q must hold 1 to {MAX_DECODE_QUERIES} query rows per batch row (a decode step or a "
                         f"speculative draft), got {Nq}; longer chunks: dilated_attention / "
                         f"block_sparse_attention with cache_seqlens=")
    if (k is None) != (v is None):
        raise ValueError(f"k and v must be given together (new rows to append) or both be None, got "
                         f"k={'None' if k is None else 'a tensor'}, v={'None' if v is None else 'a tensor'}")
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
            want = (B, x.shape[1] if x.dim() == 4 else "Nnew", *k_cache.shape[2:])
            if x.dim() != 4 or x.shape[0] != B or tuple(x.shape[2:]) != tuple(k_cache.shape[2:]):
                raise ValueError(f"{name} (new rows) must have shape (B, Nnew, Hkv, D) = {want} like k_cache, got "
                                 f"{tuple(x.shape)}")
            if x.dtype != k_cache.dtype or x.device != k_cache.device:
                raise TypeError(f"{name} must have k_cache's dtype and device ({k_cache.dtype}, {k_cache.device}), "
                                f"got {x.dtype}, {x.device}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k and v must hold the same number of new rows, got {k.shape[1]} and {v.shape[1]}")
        if k.shape[1] > capacity(k_cache, block_table):
            raise ValueError(f"k holds {k.shape[1]} new rows, more than the cache's {capacity(k_cache, block_table)}")
    check_lengths_tensor(cache_seqlens, B, " on q's device")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens must be on q's device ({q.device}; a copy from elsewhere would wait for "
                         f"the host), got {cache_seqlens.device}")
    check_softcap(softcap)
    check_sinks(sinks, q.shape[2], q.device)


def check_kvcache_values(cache_seqlens, num_new: int, num_queries: int, cache_len: int, block_table=None,
                         num_pages: int = 0) -> None:
    """validate=True: every row's length after the append, cache_seqlens[b] + Nnew, must lie
    in [Nq, capacity] (each query a valid position, no row past the cache), cache_seqlens >= 0,
    and the pages those rows use must be in [0, num_pages). Reads the values on the host (a
    sync: for debugging, not the hot path)."""
    lengths = cache_seqlens.tolist()
    for b, n in enumerate(lengths):
        if n < 0 or not num_queries <= n + num_new <= cache_len:
            raise ValueError(f"cache_seqlens[{b}] = {n}: with {num_new} new rows the row holds {n + num_new}, which "
                             f"must lie in [Nq, Nk] = [{num_queries}, {cache_len}] (every query a valid position, "
                             f"no row past the cache) with cache_seqlens >= 0")
    if block_table is None:
        return
    page_size = cache_len // block_table.shape[1]
    for b, (n, pages) in enumerate(zip(lengths, block_table.tolist())):
        used = pages[:-(-(n + num_new) // page_size)]
        bad = [p for p in used if not 0 <= p < num_pages]
        if bad:
            raise ValueError(f"block_table[{b}] holds page {bad[0]}, outside the pool's [0, {num_pages}) pages, among "
                             f"the {len(used)} pages its {n + num_new} rows use")


def append_rows(k_cache, v_cache, k, v, cache_seqlens, block_table=None):
    """Write k, v (B, Nnew, Hkv, D) into k_cache, v_cache at rows cache_seqlens[b] + j (through
    block_table for a page pool), in place, without a host sync (one index_put_ per cache; rows
    past the cache are an index error, checked by torch on the device). Returns the lengths
    after the append: cache_seqlens + Nnew."""
    if k is None:
        return cache_seqlens
    rows = cache_seqlens.long()[:, None] + torch.arange(k.shape[1], device=k_cache.device)
    batch = torch.arange(k.shape[0], device=k_cache.device)[:, None]
    if block_table is not None:
        page_size = k_cache.shape[1]
        batch, rows = block_table[batch, rows // page_size].long(), rows % page_size
    k_cache[batch, rows] = k
    v_cache[batch, rows] = v
    return cache_seqlens + k.shape[1]


def decode_step(what: str, q, k_cache, v_cache, k, v, cache_seqlens, block_table, validate, backend, families):
    """What both inference entry points do after checking their own arguments: pick the path
    (under torch.compile the requested one, resolved inside the custom op; else resolved
    here), refuse gradients on the Triton path (its decode kernel has no backward), run the
    value checks when asked and append k, v. Returns (path, the lengths after the append)."""
    if torch.compiler.is_compiling():
        path = resolve_path(backend, str(q.device))
    else:
        path = resolve_backend(backend, q.device, families, q.shape[-1], q.dtype)
    if path == "triton" and needs_grad(q, k_cache, v_cache, *(x for x in (k, v) if x is not None)):
        raise ValueError(f"{what}: the Triton decode kernel has no backward; call it under torch.no_grad() "
                         f"(inference), or use {what.removesuffix('_with_kvcache')} for gradients")
    if validate:
        check_kvcache_values(cache_seqlens, 0 if k is None else k.shape[1], q.shape[1],
                             capacity(k_cache, block_table), block_table, k_cache.shape[0])
    return path, append_rows(k_cache, v_cache, k, v, cache_seqlens, block_table)
