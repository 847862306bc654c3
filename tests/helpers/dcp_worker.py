"""Decode context parallelism (ops/common/context_parallel.py) in spawned gloo worlds: each rank
builds the same global caches (seeded), runs the single-device serve door on a copy and the
sharded door on its shard (page j of every row on rank j % P), and sends back both results, the
float64 definition (rank 0), and whether its shard after the appends equals the shard of the
single-device cache after them. Imported by the spawned children (tests/serve/test_context_parallel.py)."""
from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist

N_CACHE, PAGE = 64, 8            # global capacity, page size (= dcp_page_size)
WS, RS = [8, 16, 64], [1, 2, 4]  # a dilated schedule (every page holds each residue: PAGE >= max r)


def case_inputs(case):
    """q (B, Nq, Hq, D), the new rows k, v (or None), the global caches (B_cache, N_CACHE, Hkv, D),
    cache_seqlens, the sinks (or None), seeded by the case alone (every rank builds the same)."""
    g = torch.Generator().manual_seed(case.get("seed", 0))
    B, Nq, Hq, Hkv, D = case.get("B", 2), case["Nq"], 4, 2, 16
    B_cache = case.get("B_cache", B)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).float()  # noqa: E731
    q, kc, vc = mk(B, Nq, Hq, D), mk(B_cache, N_CACHE, Hkv, D), mk(B_cache, N_CACHE, Hkv, D)
    kn, vn = (mk(B, Nq, Hkv, D), mk(B, Nq, Hkv, D)) if case.get("append") else (None, None)
    seqlens = torch.tensor(case.get("seqlens", [37, 5])[:B], dtype=torch.int32)
    sinks = mk(Hq) if case.get("sinks") else None
    if case.get("half"):   # float16 inputs and caches (the partial outs travel in float16)
        q, kn, vn, kc, vc = (None if x is None else x.half() for x in (q, kn, vn, kc, vc))
    return q, kn, vn, kc, vc, seqlens, sinks


def case_layout(case):
    from triton_dilated import BlockLayout, layouts
    if case["kind"] == "dense":
        nb = N_CACHE // 16
        return BlockLayout.from_dense(torch.ones(nb, nb, dtype=torch.bool), 16)
    return layouts.bigbird(N_CACHE, 16, 1, 1, 1, seed=1, num_heads=4)


def case_indices(case):
    """An indexed case's indices int32 (B, Nq, TOPK): token positions in [-1, N_CACHE) (-1 unused)."""
    g = torch.Generator().manual_seed(100 + case.get("seed", 0))
    return torch.randint(-1, N_CACHE, (case.get("B", 2), case["Nq"], 24), generator=g, dtype=torch.int32)


def door_call(case):
    """(door, its variant keywords) of a case; an indexed door takes its indices bound."""
    from triton_dilated import (block_sparse_attention_with_kvcache, dilated_attention_with_kvcache,
                                indexed_attention_with_kvcache)
    kw = dict(causal=True, softcap=case.get("softcap", 0.0), backend=case.get("backend", "torch"))
    if case["kind"] == "indexed":
        idx = case_indices(case)
        return lambda q, kc, vc, **o: indexed_attention_with_kvcache(q, kc, vc, idx, **o), kw
    if case["kind"] == "dilated":
        window = {} if "window" not in case else dict(window_size=(case["window"], 0))
        return dilated_attention_with_kvcache, dict(kw, segment_lengths=WS, dilation_rates=RS, **window)
    return block_sparse_attention_with_kvcache, dict(kw, layout=case_layout(case))


def oracle_of(case):
    """The float64 oracle of the case's variant on a prefix of n keys (serve_checks.definition's form)."""
    from triton_dilated import block_sparse_attention_naive, dilated_attention_naive
    cap, sinks = case.get("softcap", 0.0), case_inputs(case)[-1]
    if case["kind"] == "indexed":
        return None
    if case["kind"] == "dilated":
        window = None if "window" not in case else (case["window"], 0)
        return lambda q, k, v, n: dilated_attention_naive(q, k, v, WS, RS, causal=True, softcap=cap, sinks=sinks,
                                                          window_size=window)
    lay = case_layout(case)
    return lambda q, k, v, n: block_sparse_attention_naive(q, k, v, lay.prefix(-(-n // lay.block_size)), causal=True,
                                                           softcap=cap, sinks=sinks)


def run_paged_cache(case, rank, world, group):
    """PagedDilatedKVCache(group=) against one device's cache over a run of steps (chunks of 8,
    decode steps, an eviction and a new sequence): the outputs of each step, both caches, and
    the pages each holds at the end."""
    from triton_dilated import PagedDilatedKVCache
    g = torch.Generator().manual_seed(case.get("seed", 0))
    kw = dict(num_pages=40, page_size=4, num_kv_heads=2, head_dim=16, num_layers=2)
    one = PagedDilatedKVCache([8, 16], [1, 2], **kw)
    dcp = PagedDilatedKVCache([8, 16], [1, 2], **kw, group=group)
    outs, outs1 = [], []
    steps = [(["a", "b"], 8), (["a", "b"], 8), (["a"], 3)] + [(["a", "b"], 1)] * 12 + [(["b", "c"], 4)] * 6
    for c in (one, dcp):
        c.admit("a"), c.admit("b")
    for i, (seqs, n) in enumerate(steps):
        if i == 15:
            for c in (one, dcp):
                c.evict("a"), c.admit("c")
        q = torch.randn(len(seqs), n, 4, 16, generator=g)
        kn, vn = torch.randn(2, len(seqs), n, 2, 16, generator=g)
        for c, res in ((one, outs1), (dcp, outs)):
            step = c.begin(seqs, n)
            for layer in range(2):
                res.append(step.attend(q + layer, kn + layer, vn, layer, backend="torch").numpy())
            step.end()
    held = [dcp.pages_held(s) for s in ("b", "c")]
    return dict(outs=outs, outs1=outs1, held=held, held1=[one.pages_held(s) for s in ("b", "c")])


def run_case(case, rank, world, group):
    if case["kind"] == "paged_cache":
        return run_paged_cache(case, rank, world, group)
    from triton_dilated.ops.common.context_parallel import shard_contiguous_cache, shard_paged_cache
    from tests.helpers.serve_checks import definition, no_host_sync, page_pools, unpage
    q, kn, vn, kc, vc, seqlens, sinks = case_inputs(case)
    door, kw = door_call(case)
    kw = dict(kw, sinks=sinks, return_lse=True)
    new = {} if kn is None else dict(k=kn, v=vn)
    idx = None if "batch_idx" not in case else torch.tensor(case["batch_idx"], dtype=torch.int32)
    pad = None if "leftpad" not in case else torch.tensor(case["leftpad"], dtype=torch.int32)
    rot = {}
    if case.get("rotary"):   # FlashAttention's rotary tables (applied to q and the new rows)
        angle = torch.arange(N_CACHE)[:, None] * 0.3 ** torch.arange(4)[None, :]
        rot = dict(rotary_cos=angle.cos(), rotary_sin=angle.sin())
    kw = dict(kw, **rot, **({} if pad is None else dict(cache_leftpad=pad)))
    by_idx = {} if idx is None else dict(cache_batch_idx=idx)
    scales = None
    if case.get("fp8"):   # an FP8 cache: rows quantised with per-head descales, new rows on append
        from triton_dilated.ops.common.kvcache import quantise_fp8
        scales = [c.abs().amax(dim=(0, 1, 3)) / 448 for c in (kc, vc)]
        kc, vc = quantise_fp8(kc, scales[0]), quantise_fp8(vc, scales[1])
        kw = dict(kw, k_descale=scales[0], v_descale=scales[1])
    if case["cache"] == "paged":
        kp, vp, table = page_pools(kc, vc, PAGE, seed=case.get("seed", 0))
        single_k, single_v = kp.clone(), vp.clone()
        out1, lse1 = door(q, single_k, single_v, **new, cache_seqlens=seqlens, block_table=table, **kw)
        local_k, table_l = shard_paged_cache(kp, table, rank, world)
        local_v, _ = shard_paged_cache(vp, table, rank, world)
        sharded = dict(block_table=table_l)
        after = lambda c: shard_paged_cache(c, table, rank, world)[0]  # noqa: E731
        full_k, full_v = unpage(single_k, table), unpage(single_v, table)
    else:
        single_k, single_v = kc.clone(), vc.clone()
        out1, lse1 = door(q, single_k, single_v, **new, cache_seqlens=seqlens, **by_idx, **kw)
        local_k, local_v = (shard_contiguous_cache(c, rank, world, PAGE) for c in (kc, vc))
        sharded = dict(dcp_page_size=PAGE, **by_idx)
        after = lambda c: shard_contiguous_cache(c, rank, world, PAGE)  # noqa: E731
        rows = slice(None) if idx is None else idx.long()
        full_k, full_v = single_k[rows], single_v[rows]
    grp = group
    if case.get("mesh"):
        from torch.distributed.device_mesh import init_device_mesh
        grp = init_device_mesh("cpu", (world,))
    guard = no_host_sync() if case.get("no_sync") else _nothing()
    with guard:
        out, lse = door(q, local_k, local_v, **new, cache_seqlens=seqlens, group=grp, **kw, **sharded)
    res = dict(out=out.numpy(), lse=lse.numpy(), out1=out1.numpy(), lse1=lse1.numpy(),
               appended=all(torch.equal(bits(a), bits(after(b)))
                            for a, b in ((local_k, single_k), (local_v, single_v))))
    if case.get("partial"):   # this rank's own (out, lse) before the merge: rows without a local key
        from triton_dilated.ops.common.context_parallel import contiguous_pool
        pk, pv, tab = contiguous_pool(local_k, local_v, None, rank, world, PAGE, q.shape[0])
        lens_after = seqlens + (0 if kn is None else kn.shape[1])    # the rows are in place now
        po, pl = door(q, pk, pv, cache_seqlens=lens_after, block_table=tab, **dict(kw, sinks=None))
        res.update(part_out=po.numpy(), part_lse=pl.numpy())
    if rank == 0:
        lengths = seqlens + (0 if kn is None else kn.shape[1])
        if scales is not None:   # the keys and values an FP8 cache holds
            full_k, full_v = (c.float() * s.view(1, 1, -1, 1) for c, s in zip((full_k, full_v), scales))
        if pad is not None:   # row b's keys start at cache row pad[b]
            full_k, full_v = (torch.stack([torch.cat([c[b, p:], c[b, :p]]) for b, p in enumerate(pad.tolist())])
                              for c in (full_k, full_v))
            lengths = lengths - pad
        if rot:
            from triton_dilated.ops.common.kvcache import apply_rotary
            q = apply_rotary(q, kn, seqlens, rot["rotary_cos"], rot["rotary_sin"], True, True)[0]
        args = (q.double(), full_k.double(), full_v.double(), lengths.tolist())
        ref_out, ref_lse = indexed_definition(case, *args) if case["kind"] == "indexed" else \
            definition(oracle_of(case), *args)
        res.update(ref_out=ref_out.numpy(), ref_lse=ref_lse.numpy())
    return res


def indexed_definition(case, q, k, v, lengths):
    """The float64 indexed oracle of each row's prefix, the queries last (their indices too)."""
    from triton_dilated import indexed_attention_naive
    idx, sinks = case_indices(case), case_inputs(case)[-1]
    Nq, outs, lses = q.shape[1], [], []
    for b, n in enumerate(lengths):
        qf = torch.cat([q.new_zeros(1, n - Nq, *q.shape[2:]), q[b:b + 1]], dim=1)
        rows = torch.cat([idx.new_full((1, n - Nq, idx.shape[-1]), -1), idx[b:b + 1]], dim=1)
        out, lse = indexed_attention_naive(qf, k[b:b + 1, :n], v[b:b + 1, :n], rows, causal=True,
                                           softcap=case.get("softcap", 0.0), sinks=sinks)
        outs.append(out[:, n - Nq:])
        lses.append(lse[:, :, n - Nq:])
    return torch.cat(outs), torch.cat(lses)


def bits(x):
    """x as bytes (torch.equal has no float8)."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def worker(rank, world, init_file, cases, queue):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        group = dist.new_group(list(range(world)))
        results = []
        for case in cases:
            saved = os.environ.get("TRITON_INTERPRET")
            with torch.no_grad():
                results.append(run_case(case, rank, world, group))
            assert os.environ.get("TRITON_INTERPRET") == saved
        queue.put((rank, "ok", results))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))


def errors_worker(rank, world, init_file, queue):
    """The sharded doors' argument errors on every rank (type and message), in order."""
    try:
        from triton_dilated import dilated_attention_with_kvcache
        from tests.helpers.ring_worker import errors_of
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        group = dist.new_group(list(range(world)))
        q, kc = torch.zeros(1, 1, 2, 8), torch.zeros(1, 64, 2, 8)
        lens = torch.tensor([3], dtype=torch.int32)
        kw = dict(cache_seqlens=lens, segment_lengths=[8], dilation_rates=[1], backend="torch", group=group)
        call = lambda **o: lambda: dilated_attention_with_kvcache(o.pop("q", q), kc, kc, **{**kw, **o})  # noqa: E731
        calls = [call(q=torch.zeros(1, 17, 2, 8)),                               # more than 16 queries
                 call(validate=True),                                           # validate
                 call(q=torch.zeros(1, 1, 2, 8, requires_grad=True)),           # gradients
                 call(group="world"),                                           # not a group
                 call(dcp_page_size=12),                                        # 64 rows not pages of 12
                 call(dcp_page_size=0),                                         # not positive
                 call(block_table=torch.zeros(1, 4, dtype=torch.int32),
                      cache_batch_idx=torch.zeros(1, dtype=torch.int32)),       # both
                 call(sinks=torch.zeros(3)),                                    # sinks of 3 heads
                 call(q=torch.zeros(2, 1, 2, 8)),                               # 2 batch rows, a cache of 1
                 call(k=torch.zeros(1, 1, 2, 8), v=torch.zeros(1, 1, 2, 8)),    # fine: runs
                 lambda: dilated_attention_with_kvcache(torch.zeros(0, 1, 2, 8), kc[:0], kc[:0],
                                                        **{**kw, "cache_seqlens": lens[:0]}),   # B = 0: runs
                 call()]                                                        # fine: runs
        queue.put((rank, "ok", errors_of(calls)))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))
