"""Decode context parallelism on gloo (CPU): the sharded decode step of
`dilated_attention_with_kvcache(..., group=)` on P ranks against 1/P of the single-device step
(issue 33 item 5: the efficiency of the sharding and merge). Each rank is a spawned process
with ONE torch thread (the single-device step too), so on a machine with >= P free cores the
ranks run side by side; with fewer cores they share them and the sharded time is inflated.
CPU, portable backend, gloo: not GPU or interconnect numbers.

    python perf/dcp_gloo.py [--worlds 1 2 4] [--runs 7] [--keys 32768]

Prints per world: the sharded step (median ms, max over ranks), the single-device step / P, their
ratio (efficiency: 1.0 = perfect scaling), and the all-gather + merge alone.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEDULES = {"dilated": ([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]), "dense": ([1 << 30], [1])}


def inputs(args):
    g = torch.Generator().manual_seed(0)
    B, N, Hq, Hkv, D = args.batch, args.keys, args.heads, args.heads // 4, 64
    mk = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    lens = torch.full((B,), N - 16, dtype=torch.int32)
    return mk(B, 1, Hq, D), mk(B, N, Hkv, D), mk(B, N, Hkv, D), lens


def timed(fn, runs, barrier=None):
    times = []
    for _ in range(runs):
        if barrier:
            barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def rank_main(rank, world, init_file, args, schedule, queue):
    torch.set_num_threads(1)
    from triton_dilated import dilated_attention_with_kvcache
    from triton_dilated.ops.common.context_parallel import gather_merge, shard_contiguous_cache
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    group = dist.new_group(list(range(world)))
    ws, rs = SCHEDULES[schedule]
    q, kc, vc, lens = inputs(args)
    kl, vl = (shard_contiguous_cache(c, rank, world, 64) for c in (kc, vc))
    kw = dict(cache_seqlens=lens, segment_lengths=ws, dilation_rates=rs, backend="torch", return_lse=True)
    with torch.no_grad():
        step = lambda: dilated_attention_with_kvcache(q, kl, vl, group=group, dcp_page_size=64, **kw)  # noqa: E731
        out, lse = step()
        sharded = timed(step, args.runs, lambda: dist.barrier(group))
        merge = timed(lambda: gather_merge(out, lse, group, world), args.runs, lambda: dist.barrier(group))
        single = timed(lambda: dilated_attention_with_kvcache(q, kc, vc, **kw), args.runs) if rank == 0 else 0.0
    times = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(times, torch.tensor([sharded, merge, single]), group=group)
    if rank == 0:
        queue.put(torch.stack(times).tolist())
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--keys", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    args = ap.parse_args()
    import multiprocessing
    import tempfile
    ctx = multiprocessing.get_context("spawn")
    print(f"CPU ({os.cpu_count()} cores), gloo, portable backend, float32, 1 thread per rank; B={args.batch}, "
          f"Nq=1, Hq={args.heads}, Hkv={args.heads // 4}, D=64, {args.keys} keys, dcp_page_size=64")
    print(f"{'schedule':9} {'P':>2} {'sharded ms':>11} {'single/P ms':>12} {'efficiency':>10} {'gather+merge ms':>16} "
          f"{'bytes/step/rank':>16}")
    for schedule in SCHEDULES:
        for world in args.worlds:
            queue = ctx.Queue()
            init_file = os.path.join(tempfile.mkdtemp(), "rendezvous")
            procs = [ctx.Process(target=rank_main, args=(r, world, init_file, args, schedule, queue))
                     for r in range(world)]
            for p in procs:
                p.start()
            rows = queue.get(timeout=1200)
            for p in procs:
                p.join()
            sharded, merge, single = max(r[0] for r in rows), max(r[1] for r in rows), rows[0][2] / world
            nbytes = world * (args.batch * args.heads * 64 * 4 + args.batch * args.heads * 4)
            print(f"{schedule:9} {world:>2} {sharded:11.2f} {single:12.2f} {single / sharded:10.2f} {merge:16.3f} "
                  f"{nbytes:16d}", flush=True)


if __name__ == "__main__":
    main()
