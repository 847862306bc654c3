"""Decode context parallelism (DCP) for the serve doors: every sequence's KV cache sharded by
page interleave over the ranks of a process group, each rank attending over its own pages,
one all-gather of the partial (out, lse), and the log-sum-exp merge (lse.merge_partials, the
ring's merge).

Layout (the contract): page j of every sequence (positions [j * page_size, (j + 1) * page_size))
lives on rank j % P. A rank's pool holds its pages only; its block table keeps the width of the
global one (column j is still position page j) with the columns of other ranks' pages pointing
outside the pool (-1), which the serve doors read and write nothing on. So each rank's door sees
the true positions (segments, residues, causality, windows and block layouts are exact),
computes the attention over its keys alone, and a query with no key on that rank gives out 0,
lse -inf, which the merge weights 0. An append lands on the rank owning its page only.
A page of at least max(dilation rate) rows keeps every residue class on every page, so the
dilated key lists spread evenly over the ranks.

A contiguous cache is the special case of a page pool (as kvcache.batch_rows_table does for
cache_batch_idx): rank r's local cache (B_cache, Nk_local, Hkv, D), Nk_local a multiple of
page_size, holds pages r, r + P, r + 2P, .. of each row in order (shard_contiguous_cache),
viewed as a pool of B_cache * Nk_local / page_size pages; the global capacity is P * Nk_local.

Per step each rank sends and receives P * (B*Nq*Hq*D*itemsize + B*Hq*Nq*4) bytes (its out in
q's dtype and its float32 lse, gathered from every rank, itself included): one all-gather,
no host sync (the block tables are built on the device).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .call import check_sinks
from .kvcache import (FP8_DTYPE, MAX_DECODE_QUERIES, check_block_table, check_kvcache_args, check_row_index,
                      quantise_fp8, rotary_inputs)
from .lse import add_sinks, merge_partials
from .validation import check_int

DCP_PAGE_SIZE = 64   # a contiguous cache's interleave (rows per page) when the caller gives none


def resolve_group(group, who: str):
    """(process group, rank, world size) of group= (a ProcessGroup or a 1-D DeviceMesh; the
    default group for torch.distributed's WORLD is not implied: give it)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{who}(group=...) needs an initialised torch.distributed process group: call "
                           f"torch.distributed.init_process_group(...) first")
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:    # pragma: no cover - torch without DeviceMesh
        DeviceMesh = ()
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"{who}: group must be a ProcessGroup or a 1-D DeviceMesh, got a {group.ndim}-D "
                             f"DeviceMesh {group.mesh_dim_names}: pass mesh[name]")
        group = group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{who}: group must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, got "
                        f"{type(group).__name__}")
    return group, dist.get_rank(group), dist.get_world_size(group)


def local_block_table(block_table, rank: int, world: int):
    """This rank's block table from a global one (B, max_pages) whose column j names page j of
    the row in the pool of its owner, rank j % world: the columns of other ranks set to -1 (a
    page outside every pool: read and written nothing). Device arithmetic, no host sync."""
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    return torch.where(cols % world == rank, block_table, -1).to(torch.int32)


def shard_paged_cache(pool, block_table, rank: int, world: int):
    """(local pool, local block table) of `rank` from a single-device page pool (num_pages,
    page_size, Hkv, D) and its block table (B, max_pages): the pages of columns j % world ==
    rank in their first order of use (row by row), copied into a compact pool, and a table of
    the global one's shape naming them (-1 in other ranks' columns). For building shards from
    one device's cache (tests, a migration); reads the table on the host. Page ids outside the
    pool stay outside (-1)."""
    table = block_table.tolist()
    where: dict = {}   # global page id -> local page id
    for row in table:
        for j, p in enumerate(row):
            if j % world == rank and 0 <= p < pool.shape[0]:
                where.setdefault(p, len(where))
    local = pool[torch.tensor(list(where), dtype=torch.long, device=pool.device)]
    mapped = torch.tensor([[where.get(p, -1) if j % world == rank else -1 for j, p in enumerate(row)]
                           for row in table], dtype=torch.int32, device=block_table.device)
    return local.contiguous(), mapped.view(block_table.shape)


def shard_contiguous_cache(cache, rank: int, world: int, page_size: int = DCP_PAGE_SIZE):
    """`rank`'s local cache (B, Nk / world, Hkv, D) of a single-device contiguous cache (B, Nk,
    Hkv, D), Nk a multiple of world * page_size: pages rank, rank + world, .. of every row, in
    order (a copy)."""
    B, Nk = cache.shape[:2]
    if Nk % (world * page_size):
        raise ValueError(f"cache rows Nk = {Nk} must be a multiple of world * page_size = {world} * {page_size}")
    pages = cache.view(B, Nk // page_size, page_size, *cache.shape[2:])[:, rank::world]
    return pages.reshape(B, -1, *cache.shape[2:]).contiguous()


def contiguous_pool(k_cache, v_cache, cache_batch_idx, rank: int, world: int, page_size: int, batch: int):
    """A contiguous local cache (B_cache, Nk_local, Hkv, D) as a page pool (views, so appends
    land in place) and the block table (batch, world * Nk_local / page_size) of the global
    positions: column j -> page (row * Nk_local / page_size + j // world) when j % world ==
    rank, else -1; row = cache_batch_idx[b] (b without it; an index outside [0, B_cache):
    -1, nothing read or written)."""
    B_cache, n_local = k_cache.shape[:2]
    if n_local % page_size:
        raise ValueError(f"with group=, a contiguous cache's rows Nk_local = {n_local} must be a multiple of "
                         f"dcp_page_size = {page_size} (the rank's pages, shard_contiguous_cache)")
    per_row = n_local // page_size
    pools = []
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(0) != n_local * c.stride(1) or c.stride(1) != c.shape[2] * c.stride(2):
            raise ValueError(f"with group=, {name} must be contiguous in its first three dimensions (a page pool "
                             f"view, for the append in place), got strides {tuple(c.stride())}")
        pools.append(c.view(B_cache * per_row, page_size, *c.shape[2:]))
    dev = k_cache.device
    rows = torch.arange(batch, device=dev) if cache_batch_idx is None else cache_batch_idx.long()
    cols = torch.arange(world * per_row, device=dev)
    ok = (rows >= 0) & (rows < B_cache)
    table = rows[:, None] * per_row + cols // world
    table = torch.where((cols % world == rank) & ok[:, None], table, -1)
    return pools[0], pools[1], table.to(torch.int32)


def append_owned(k_pool, v_pool, k, v, cache_seqlens, block_table, k_descale=None, v_descale=None):
    """Write the new rows k, v (B, Nnew, Hkv, D) at positions cache_seqlens[b] + j of a page pool,
    in place, row by row: a new row whose page is outside the pool (another rank's) is skipped
    alone (kvcache.append_rows skips a batch row whole when any of its pages is outside, and a
    step's rows may straddle two ranks' pages); a batch row past the capacity writes nothing.
    No host sync. One index_put_ per cache: a skipped row must still name a target, and two
    writes to one place with different values leave either, so skipped rows rewrite the first
    written row's place with its value (or, when no row is written, their own place with what
    it holds): every place is written one value."""
    if k is None or k.shape[0] * k.shape[1] == 0:
        return
    if k_pool.dtype == FP8_DTYPE:
        k, v = quantise_fp8(k, k_descale), quantise_fp8(v, v_descale)
    B, n = k.shape[:2]
    num_pages, page_size = k_pool.shape[:2]
    cap = block_table.shape[1] * page_size
    start = cache_seqlens.long()
    pos = (start[:, None] + torch.arange(n, device=k.device)).clamp(0, cap - 1)       # (B, n)
    page = block_table.gather(1, pos // page_size).long()
    keep = ((start >= 0) & (start + n <= cap))[:, None] & (page >= 0) & (page < num_pages)
    page, row = page.clamp(0, num_pages - 1).flatten(), (pos % page_size).flatten()
    keep = keep.flatten()
    first = keep.int().argmax().view(1)    # the first written row (0 when none is written); index_select,
    some = keep.any()                      # not [first]: a tensor index would read it on the host
    page = torch.where(keep, page, torch.where(some, page.index_select(0, first), page))
    row = torch.where(keep, row, torch.where(some, row.index_select(0, first), row))
    for pool, new in ((k_pool, k), (v_pool, v)):
        bits = pool.view(torch.uint8) if pool.dtype == FP8_DTYPE else pool   # torch.where has no float8
        new = (new.view(torch.uint8) if pool.dtype == FP8_DTYPE else new).flatten(0, 1)   # (B * n, Hkv, D)
        # what a skipped row writes: the first written row's value, or (none written) its place's own
        src = torch.where(some, new.index_select(0, first), bits[page, row])
        bits[page, row] = torch.where(keep[:, None, None], new, src)


def gather_merge(out, lse, group, world: int):
    """Every rank's (out (B, Nq, Hq, D), lse float32 (B, Hq, Nq)) gathered in ONE all-gather
    (packed as bytes: lse first, so that out's offset is a multiple of its itemsize) and merged
    (merge_partials): (out float32 (B, Nq, Hq, D), lse)."""
    out, lse = out.contiguous(), lse.float().contiguous()
    n_lse = lse.numel() * 4
    mine = torch.cat([lse.view(-1).view(torch.uint8), out.view(-1).view(torch.uint8)])
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    lses = [p[:n_lse].view(torch.float32).view(lse.shape) for p in parts]
    outs = [p[n_lse:].view(out.dtype).view(out.shape).transpose(1, 2) for p in parts]   # (B, Hq, Nq, D)
    merged, lse = merge_partials(outs, lses)
    return merged.transpose(1, 2), lse


def dcp_attention(door, q, k_cache, v_cache, k, v, *, group, cache_seqlens, block_table, cache_batch_idx,
                  dcp_page_size, sinks, return_lse, validate, who, extra=(), check=check_kvcache_args, varlen=False,
                  **kwargs):
    """A serve door's call with group= (see the module docstring): the append of k, v on the
    pages this rank owns (append_owned), this rank's door over its pages (a local block table,
    no append, sinks left out), the all-gather of (out, lse), the merge, and the sinks joined
    once to the merged rows. Forward only; a decode step (<= 16 queries). door(q, k_cache,
    v_cache, *extra, k, v, **keywords) is the door without group; check(q, k_pool, v_pool, k, v,
    cache_seqlens, block_table, validate, k_descale, v_descale, cache_leftpad) its shape checks;
    varlen: whether the call names varlen queries (refused: DCP takes padded batches)."""
    if varlen:
        raise ValueError(f"{who}(group=...) takes padded batches, not varlen queries: cu_seqlens_q, max_seqlen_q and "
                         f"cu_seqlens_k_new must be None with group=")
    pg, rank, world = resolve_group(group, who)
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (q, k_cache, v_cache)):   # the door names it
        batch_idx = {} if cache_batch_idx is None else dict(cache_batch_idx=cache_batch_idx)
        return door(q, k_cache, v_cache, *extra, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                    sinks=sinks, return_lse=return_lse, validate=validate, **batch_idx, **kwargs)
    if q.shape[1] > MAX_DECODE_QUERIES:
        raise ValueError(f"{who}(group=...): decode context parallelism runs decode steps of at most "
                         f"{MAX_DECODE_QUERIES} query rows, got q with {q.shape[1]} (run chunked prefill on one "
                         f"rank's full cache)")
    if validate is not False:
        raise ValueError(f"{who}(group=...): validate must be False (a rank's table points at other ranks' pages "
                         f"outside its pool, which validate=True refuses), got {validate!r}")
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                       for x in (q, k_cache, v_cache, k, v)):
        raise ValueError(f"{who}(group=...) is forward only (the all-gather has no backward): run it under "
                         f"torch.no_grad() or with tensors that do not require grad")
    sinks = check_sinks(sinks, q.shape[2], q.device)
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx maps batch rows to rows of a contiguous cache; a paged cache maps them "
                             "through block_table: give one of them (as FlashAttention), not both")
        check_block_table(block_table, q.shape[0], q.device)
        pool_k, pool_v, table = k_cache, v_cache, local_block_table(block_table, rank, world)
    else:
        check_int("dcp_page_size", dcp_page_size, minimum=1)
        if cache_batch_idx is not None:
            check_row_index("cache_batch_idx", cache_batch_idx, q, "the cache row each batch row reads and writes")
        elif k_cache.shape[0] != q.shape[0] or v_cache.shape[0] != q.shape[0]:
            raise ValueError(f"k_cache and v_cache must hold B = {q.shape[0]} rows (q's batch; or give "
                             f"cache_batch_idx), got {k_cache.shape[0]} and {v_cache.shape[0]}")
        pool_k, pool_v, table = contiguous_pool(k_cache, v_cache, cache_batch_idx, rank, world, dcp_page_size,
                                                q.shape[0])
    # the append here (append_owned: a step's new rows may straddle two ranks' pages), rotary first
    q, k = rotary_inputs(q, k, cache_seqlens, kwargs.pop("rotary_cos", None), kwargs.pop("rotary_sin", None),
                         kwargs.pop("rotary_interleaved", True), kwargs["causal"], False)
    descales = kwargs.get("k_descale"), kwargs.get("v_descale")
    check(q, pool_k, pool_v, k, v, cache_seqlens, table, False, *descales, kwargs.get("cache_leftpad"))
    append_owned(pool_k, pool_v, k, v, cache_seqlens, table, *descales)
    lengths = cache_seqlens if k is None else cache_seqlens + k.shape[1]
    out, lse = door(q, pool_k, pool_v, *extra, cache_seqlens=lengths, block_table=table, return_lse=True,
                    validate=False, **kwargs)
    out, lse = gather_merge(out, lse, pg, world)
    if sinks is not None:      # once, on the merged rows (per rank they would count P times)
        out, lse = add_sinks(out, lse, sinks)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
