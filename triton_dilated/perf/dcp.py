"""`python -m triton_dilated.perf dcp`: decode context parallelism (issue 33 item 5) on gloo
worlds on the CPU: the decode step of `dilated_attention_with_kvcache(..., group=)` with every
sequence's cache sharded over P ranks (page j on rank j % P, ops/common/context_parallel.py)
against the same step on one device over the whole cache.

For each world size P, P processes are spawned (gloo, ONE torch thread each, the single-device
step too): every rank builds the same seeded global caches (B, N, Hkv, D), keeps its shard
(shard_contiguous_cache), and per schedule times, behind a barrier each round,
  dcp_sharded  the sharded step (the new token's row appended on the rank owning its page, the
               rank's door over its pages, the all-gather of (out, lse), the merge): the slowest
               rank's median
  dcp_merge    the all-gather + merge alone (gather_merge on the rank's partial result)
  dcp_single   the single-device step over the full cache (rank 0, the others waiting)
and writes rows (op "decode_dcp", world_size = P) with metrics ms, and on dcp_sharded
efficiency = single ms / (P x sharded ms) (1.0: the step scales perfectly with P) and
max_abs_err (the sharded output against the single-device one; 0 up to rounding). Rows are
flagged "CPU/gloo": processes on this machine's cores, not GPUs or an interconnect; with more
ranks than cores the ranks share cores ("oversubscribed") and the sharded time is inflated;
"busy" when other processes took more than a quarter core while the world ran.

The portable backend gathers each query's whole key list and masks the keys of other ranks'
pages, so on a CPU a rank's attention time does not fall with P (the Triton decode kernel
skips the bytes); what these rows show on a CPU is the merge's cost and the step's overhead.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time

import torch

from .results import BUSY_LIMIT_CORES, FLAG_BUSY, CsvSink, _flags, make_row, provenance, sig
from .ring import spawn_ranks
from .timing import OtherLoad

OP = "decode_dcp"
# per schedule: (segment lengths, dilation rates); dense: one segment longer than any cache
SCHEDULES = {"dilated": ([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]), "dense": ([1 << 30], [1])}
PROVIDERS = ("dcp_sharded", "dcp_merge", "dcp_single")


def _median_ms(fn, runs, barrier=None):
    times = []
    for _ in range(runs):
        if barrier:
            barrier()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _worker(rank, world, init_file, spec, out_dir):
    """One rank: {schedule: {sharded, merge, single (rank 0), err (rank 0)}} to out_dir/rank<r>.json."""
    import torch.distributed as dist

    from triton_dilated import dilated_attention_with_kvcache
    from triton_dilated.ops.common.context_parallel import gather_merge, shard_contiguous_cache
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=spec["timeout"]))
    group = dist.new_group(list(range(world)))
    barrier = lambda: dist.barrier(group)  # noqa: E731
    B, N, Hq, Hkv, D, page, runs = (spec[k] for k in ("B", "N", "H", "Hkv", "D", "page_size", "runs"))
    g = torch.Generator().manual_seed(0)     # the same global caches on every rank
    mk = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, kc, vc, k_new, v_new = mk(B, 1, Hq, D), mk(B, N, Hkv, D), mk(B, N, Hkv, D), mk(B, 1, Hkv, D), mk(B, 1, Hkv, D)
    lens = torch.full((B,), N - 1, dtype=torch.int32)   # the new token at row N - 1, the same every call
    kl, vl = (shard_contiguous_cache(c, rank, world, page) for c in (kc, vc))
    results = {}
    try:
        for schedule in spec["schedules"]:
            ws, rs = SCHEDULES[schedule]
            kw = dict(cache_seqlens=lens, segment_lengths=ws, dilation_rates=rs, backend="torch", return_lse=True)
            with torch.no_grad():
                sharded = lambda: dilated_attention_with_kvcache(  # noqa: E731
                    q, kl, vl, k_new, v_new, group=group, dcp_page_size=page, **kw)
                single = lambda: dilated_attention_with_kvcache(q, kc, vc, k_new, v_new, **kw)  # noqa: E731
                out, lse = sharded()   # (out, lse) stand in for the rank's partial: the same shapes and bytes
                rec = dict(sharded=_median_ms(sharded, runs, barrier),
                           merge=_median_ms(lambda: gather_merge(out, lse, group, world), runs, barrier))
                if rank == 0:
                    want, _ = single()
                    rec.update(single=_median_ms(single, runs), err=float((out - want).abs().max()))
                barrier()
            results[schedule] = rec
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def run_dcp(worlds=(2, 4), *, keys=32768, batch=4, heads=8, kv_heads=2, head_dim=64, page_size=64, runs=7,
            schedules=tuple(SCHEDULES), out=None, timeout_s=600.0, quiet=False):
    """The world-size sweep on gloo (see the module docstring); the rows, streamed to `out`."""
    if keys % (max(worlds) * page_size):
        raise ValueError(f"keys ({keys}) must be a multiple of world size x page size (largest world "
                         f"{max(worlds)} x {page_size})")
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    spec = dict(B=batch, N=keys, H=heads, Hkv=kv_heads, D=head_dim, page_size=page_size, runs=runs,
                schedules=list(schedules), timeout=max(60, int(timeout_s)))
    prov = provenance("cpu")
    cores = os.cpu_count() or 1
    rows = []
    with CsvSink(out) as sink:
        for P in worlds:
            t0 = time.perf_counter()
            with OtherLoad(children=True) as load:
                per_rank = spawn_ranks(_worker, P, spec, timeout_s)
            flags = ["CPU/gloo: 1 torch thread per rank"]
            if P > cores:
                flags.append(f"oversubscribed: {P} ranks > {cores} cores")
            if load.cores > BUSY_LIMIT_CORES:
                flags.append(FLAG_BUSY)
            # per rank and step: P x (its out, float32, and its lse) in and out (context_parallel.py)
            nbytes = P * (batch * heads * head_dim * 4 + batch * heads * 4)
            new = []
            for schedule in schedules:
                recs = [r[schedule] for r in per_rank]
                ws, rs = SCHEDULES[schedule]
                sharded, merge, single = max(r["sharded"] for r in recs), max(r["merge"] for r in recs), \
                    recs[0]["single"]
                base = dict(op=OP, variant=schedule, B=batch, N=keys, H=heads, Hkv=kv_heads, D=head_dim,
                            dtype="float32", causal=True, attn_mode="longnet" if schedule != "dense" else "",
                            segment_lengths=" ".join(map(str, ws)) if schedule != "dense" else "",
                            dilation_rates=" ".join(map(str, rs)) if schedule != "dense" else "",
                            layout=f"dcp_page_size={page_size}", world_size=P, rounds=runs,
                            flags=";".join(flags), other_cores=sig(load.cores), **prov)
                new += [make_row(**base, provider="dcp_sharded", metric="ms", value=sig(sharded),
                                 config=f"{nbytes} bytes per rank per step (all-gather)"),
                        make_row(**base, provider="dcp_merge", metric="ms", value=sig(merge)),
                        make_row(**base, provider="dcp_single", metric="ms", value=sig(single),
                                 config="one device, the whole cache (rank 0)"),
                        make_row(**base, provider="dcp_sharded", metric="efficiency", value=sig(single / P / sharded),
                                 config="single ms / (P x sharded ms)"),
                        make_row(**base, provider="dcp_sharded", metric="max_abs_err", value=sig(recs[0]["err"]),
                                 config="vs dcp_single")]
                say(f"P={P} {schedule}: sharded {sharded:.3f} ms, single/P {single / P:.3f} ms, efficiency "
                    f"{single / P / sharded:.2f}, merge {merge:.3f} ms ({';'.join(flags)})")
            sink.write(new)
            rows += new
            say(f"P={P} done in {time.perf_counter() - t0:.1f} s (other processes: {load.cores:.2f} cores)")
    return rows


def dcp_table(rows) -> str:
    """The dcp rows per schedule and world size: sharded, single / P, efficiency, merge, error."""
    val = {(r["variant"], int(r["world_size"]), r["provider"], r["metric"]): r for r in rows}
    lines = ["decode context parallelism, CPU/gloo (processes on this machine's cores, 1 thread per rank; not GPU "
             "or interconnect numbers), median ms per decode step",
             f"{'schedule':9} {'P':>3} {'sharded ms':>11} {'single/P ms':>12} {'efficiency':>10} {'merge ms':>9} "
             f"{'max |err|':>10}  flags"]
    for schedule, P in sorted({k[:2] for k in val}):
        get = lambda p, m: val[(schedule, P, p, m)]["value"]  # noqa: E731
        flags = ";".join(_flags(val[(schedule, P, "dcp_sharded", "ms")]))
        lines.append(f"{schedule:9} {P:>3} {get('dcp_sharded', 'ms'):>11.4g} {get('dcp_single', 'ms') / P:>12.4g} "
                     f"{get('dcp_sharded', 'efficiency'):>10.2f} {get('dcp_merge', 'ms'):>9.3g} "
                     f"{get('dcp_sharded', 'max_abs_err'):>10.3g}  {flags}")
    return "\n".join(lines)


def main(args) -> int:
    """The `dcp` subcommand."""
    if args.heads % args.kv_heads:
        print(f"dcp: --heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})", file=sys.stderr)
        return 2
    try:
        rows = run_dcp(args.worlds, keys=args.keys, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                       head_dim=args.head_dim, page_size=args.page_size, runs=args.runs, schedules=args.schedules,
                       out=args.out, timeout_s=args.timeout)
    except ValueError as exc:
        print(f"dcp: {exc}", file=sys.stderr)
        return 2
    print(dcp_table(rows))
    print(f"\nwrote {len(rows)} rows to {args.out}")
    return 0 if rows else 1
