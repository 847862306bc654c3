"""`python -m triton_dilated.perf ring`: time and per-rank memory of ring attention against
the world size P (DESIGN §5, §11), beside Ulysses (ulysses_attention over the world) and 2-D
sequence parallelism (Ulysses groups of 2 x a p2p ring, P >= 4) as further "comms".

For each P, P processes are spawned (NCCL, one GPU per rank, where the machine has P GPUs;
gloo on the CPU otherwise), each holding a random shard (B, N/P, H, D) of a sequence of
global length N (strong scaling: N fixed, P grows). Every (variant, comm, mode) is timed on
every rank behind a barrier; a row reports the slowest rank's median and the largest
per-rank peak memory (CUDA allocator peak on a GPU; the process's peak RSS on a CPU, a
coarse upper bound: the resident high-water mark during the measurement above the rank's
size after start-up, which also counts freed memory the allocator keeps resident).

Ring attention is imported lazily (`triton_dilated.ring_attention`): where it cannot be
imported this subcommand says so and measures nothing.
"""
from __future__ import annotations

import json
import math
import os
import resource
import statistics
import tempfile
import time

import torch

from ..ops.common.spec import attention_flops, dense_pairs
from ..ops.dilated.spec import LONGNET_R, LONGNET_W
from ..ops.ring.spec import SPEC as RING_SPEC
from .results import CsvSink, make_row, provenance, sig

COMMS = ("p2p", "allgather")
# sequence-parallel schemes beside the ring's two comms (--comms takes all four): Ulysses over
# the world, and 2-D (USP): Ulysses groups of USP_U consecutive ranks x a p2p ring over them
SCHEMES = COMMS + ("ulysses", "usp")
USP_U = 2
VARIANTS = ("dense", "dilated")


class RingUnavailable(RuntimeError):
    pass


def load_ring():
    """triton_dilated.ring_attention, or RingUnavailable saying why not."""
    try:
        import importlib
        pkg = importlib.import_module("triton_dilated")
        fn = getattr(pkg, "ring_attention")
    except Exception as exc:   # ImportError, AttributeError, or a half-written module
        raise RingUnavailable(f"ring attention is not available in this build: triton_dilated.ring_attention "
                              f"could not be imported ({type(exc).__name__}: {exc})") from exc
    return fn


def _patterns(n):
    ws = tuple(min(w, n) for w in LONGNET_W) if n >= 8192 else (n // 8, n // 4, n // 2)
    rs = LONGNET_R if n >= 8192 else (1, 2, 4)
    return ws, rs


def _rss_mib(field="VmRSS"):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak_rss():
    """Reset the kernel's resident-set high-water mark (Linux >= 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def scheme_skip(comm, world, heads, seqlen, balance):
    """Why a scheme cannot run at this world size (None: it can)."""
    parts = 2 if balance == "zigzag" else 1
    if comm == "ulysses" and heads % world:
        return f"ulysses needs the {heads} heads to split over {world} ranks"
    if comm == "usp":
        if world < 2 * USP_U or world % USP_U:
            return f"usp (Ulysses {USP_U} x ring) needs a world of at least {2 * USP_U}, a multiple of {USP_U}"
        if heads % USP_U:
            return f"usp needs the {heads} heads to split over its {USP_U} Ulysses ranks"
    if seqlen % (world * parts):
        return f"N={seqlen} is not a multiple of {world * parts}"
    return None


def _attention_calls(world, rank, comms):
    """{comm: fn(q, k, v, **kw)}: ring_attention with comm, ulysses_attention, or the 2-D
    grid (every rank creates every group, in the same order)."""
    import torch.distributed as dist

    from triton_dilated import ring_attention, ulysses_attention
    calls = {c: (lambda q, k, v, c=c, **kw: ring_attention(q, k, v, comm=c, **kw)) for c in COMMS if c in comms}
    if "ulysses" in comms:
        calls["ulysses"] = lambda q, k, v, **kw: ulysses_attention(q, k, v, **kw)
    if "usp" in comms and world >= 2 * USP_U and world % USP_U == 0:
        uly = [dist.new_group(list(range(r * USP_U, (r + 1) * USP_U))) for r in range(world // USP_U)]
        rings = [dist.new_group(list(range(u, world, USP_U))) for u in range(USP_U)]
        grid = dict(group=uly[rank // USP_U], ring_group=rings[rank % USP_U])
        calls["usp"] = lambda q, k, v, **kw: ulysses_attention(q, k, v, **grid, **kw)
    return calls


def _ring_worker(rank, world, init_file, spec, out_dir):
    import torch.distributed as dist
    load_ring()
    use_cuda = spec["device"] == "cuda"
    if use_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=__import__("datetime").timedelta(seconds=spec["timeout"]))
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    base_rss = _rss_mib()
    dtype = getattr(torch, spec["dtype"])
    B, N, H, D = spec["B"], spec["N"], spec["H"], spec["D"]
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    mk = lambda: torch.randn(B, N // world, H, D, generator=gen, device=device).to(dtype)  # noqa: E731
    results = []
    calls = _attention_calls(world, rank, spec["comms"])
    try:
        for variant in spec["variants"]:
            kw = dict(causal=spec["causal"], balance=spec["balance"])
            if variant == "dilated":
                ws, rs = _patterns(N)
                kw.update(segment_lengths=list(ws), dilation_rates=list(rs))
            for comm in spec["comms"]:
                if scheme_skip(comm, world, H, N, spec["balance"]):
                    continue
                attention = calls[comm]
                for mode in ("fwd", "fwd_bwd"):
                    q, k, v = (mk().requires_grad_(mode == "fwd_bwd") for _ in range(3))
                    grad = torch.randn_like(q)

                    def call():
                        if mode == "fwd":
                            with torch.no_grad():
                                attention(q, k, v, **kw)
                        else:
                            out = attention(q, k, v, **kw)
                            torch.autograd.grad(out, (q, k, v), grad)
                        if use_cuda:
                            torch.cuda.synchronize()
                    rec = dict(variant=variant, comm=comm, mode=mode)
                    try:
                        for _ in range(spec["warmup"]):
                            call()
                        if use_cuda:
                            torch.cuda.reset_peak_memory_stats()
                        else:
                            _reset_peak_rss()
                        times = []
                        for _ in range(spec["reps"]):        # the same count on every rank (barriers)
                            dist.barrier()
                            t0 = time.perf_counter()
                            call()
                            times.append((time.perf_counter() - t0) * 1e3)
                        rec["ms"] = statistics.median(times)
                        if use_cuda:
                            rec["peak_mem_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
                        else:
                            rec["peak_rss_mib"] = _rss_mib("VmHWM") - base_rss
                    except Exception as exc:   # the ranks may now disagree: later barriers time out
                        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                    results.append(rec)
                    dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def spawn_ranks(worker, world, spec, timeout_s):
    """Run worker(rank, world, init_file, spec, out_dir) on `world` spawned processes (a file
    rendezvous in out_dir); each writes out_dir/rank<r>.json. The per-rank results (or raise).
    perf ring's and perf dcp's worlds."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(worker, args=(world, init_file, spec, tmp), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"world size {world}: no result within {timeout_s:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        out = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                out.append(json.load(f))
        return out


def default_world_sizes(device):
    if device == "cuda":
        return [p for p in (1, 2, 4, 8) if p <= torch.cuda.device_count()]
    return [1, 2, 4]


def run_ring(world_sizes=None, seqlen=None, variants=VARIANTS, comms=SCHEMES, device=None, causal=True,
             balance="zigzag", heads=None, head_dim=None, out=None, timeout_s=300.0, quick=False, log=print):
    """The world-size sweep; returns the rows (streamed to `out` too). Raises RingUnavailable
    when ring attention cannot be imported."""
    load_ring()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda (--device cuda): no CUDA GPU is visible to torch "
                         "(torch.cuda.is_available() is False); --device cpu runs the ring on gloo processes")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device: expected 'cuda' or 'cpu', got {device!r}")
    world_sizes = world_sizes or default_world_sizes(device)
    if device == "cuda" and max(world_sizes) > torch.cuda.device_count():
        raise ValueError(f"world sizes {world_sizes} need that many GPUs; this machine has "
                         f"{torch.cuda.device_count()} (use --device cpu for a gloo sweep)")
    if device == "cuda" and torch.cuda.device_count() == 1:
        log("One GPU: only P = 1 runs on it (NCCL needs a GPU per rank); `--device cpu` sweeps P with gloo.")
    if device == "cpu":
        log(f"CPU (gloo): ranks share {os.cpu_count()} cores, so times beyond that many ranks measure "
            "oversubscription; per-rank memory is the rank's peak resident memory above its start-up size.")
    if device == "cuda":
        N = seqlen or (4096 if quick else 32768)
    else:
        N = seqlen or (1024 if quick else 4096)
    H = heads or (16 if device == "cuda" else 4)
    D = head_dim or (128 if device == "cuda" else 64)
    dtype = "bfloat16" if device == "cuda" else "float32"
    spec = dict(device=device, B=1, N=N, H=H, D=D, dtype=dtype, causal=causal, balance=balance,
                variants=list(variants), comms=list(comms), warmup=1 if device == "cpu" else 3,
                reps=3 if device == "cpu" else 10, timeout=max(60, int(timeout_s)))
    prov = provenance(device)
    rows = []
    with CsvSink(out) as sink:
        for P in world_sizes:
            parts = 2 * P if balance == "zigzag" else P
            if N % parts:
                log(f"P={P}: N={N} is not a multiple of {parts}; skipped")
                continue
            t0 = time.perf_counter()
            try:
                per_rank = spawn_ranks(_ring_worker, P, spec, timeout_s)
            except Exception as exc:
                log(f"P={P}: failed ({type(exc).__name__}: {exc})")
                continue
            for comm in comms:
                why = scheme_skip(comm, P, H, N, balance)
                if why:
                    log(f"P={P} {comm}: skipped ({why})")
            for i, rec in enumerate(per_rank[0]):
                recs = [r[i] for r in per_rank]
                errs = [r["error"] for r in recs if "error" in r]
                label = f"P={P} {rec['variant']} {rec['comm']} {rec['mode']}" + \
                    (" (CPU, gloo)" if device == "cpu" else "")
                if errs:
                    log(f"{label}: skipped ({errs[0]})")
                    continue
                ms = max(r["ms"] for r in recs)
                ws, rs = _patterns(N) if rec["variant"] == "dilated" else ((), ())
                pairs = RING_SPEC.pairs(1, N, H, causal, segment_lengths=ws, dilation_rates=rs)
                fl = attention_flops(pairs, D, backward=rec["mode"] == "fwd_bwd")
                metrics = [("ms", ms), ("tflops", fl / ms / 1e9)]
                for m in ("peak_mem_mib", "peak_rss_mib"):
                    if m in rec:
                        metrics.append((m, max(r[m] for r in recs)))
                provider = {"ulysses": "ulysses", "usp": f"usp_{USP_U}x{P // USP_U}"}.get(rec["comm"],
                                                                                      f"ring_{rec['comm']}")
                base = dict(op="ring_attention", variant=rec["variant"], provider=provider,
                            **{"pass": rec["mode"]}, B=1, N=N, H=H, Hkv=H, D=D, dtype=dtype, causal=causal,
                            attn_mode="longnet" if ws else "", segment_lengths="/".join(map(str, ws)),
                            dilation_rates="/".join(map(str, rs)), layout=f"balance={balance}", world_size=P,
                            density=sig(pairs / dense_pairs(1, H, N, causal)), gflop=sig(fl / 1e9),
                            **prov)
                new = [make_row(**base, metric=m, value=sig(v)) for m, v in metrics]
                sink.write(new)
                rows.extend(new)
                mem = next((v for m, v in metrics if m.startswith("peak")), math.nan)
                log(f"{label}: {ms:.3f} ms, peak {mem:.1f} MiB per rank")
            log(f"P={P} done in {time.perf_counter() - t0:.1f} s")
    return rows


def ring_table(rows) -> str:
    ms = [r for r in rows if r["metric"] == "ms"]
    if not ms:
        return "no ring results"
    mem = {(r["variant"], r["provider"], r["pass"], r["world_size"]): r["value"] for r in rows
           if r["metric"] in ("peak_mem_mib", "peak_rss_mib")}
    cpu = any(r.get("device") == "cpu" for r in ms)
    lines = ["CPU timings: gloo processes sharing the machine's cores, not GPU interconnects"] if cpu else []
    lines.append(f"{'variant':8} {'comm':14} {'pass':8} {'P':>3} {'ms':>10} {'MiB/rank':>9}")
    for r in sorted(ms, key=lambda r: (r["variant"], r["provider"], r["pass"], int(r["world_size"]))):
        m = mem.get((r["variant"], r["provider"], r["pass"], r["world_size"]), math.nan)
        lines.append(f"{r['variant']:8} {r['provider']:14} {r['pass']:8} {r['world_size']:>3} {float(r['value']):>10.3f} "
                     f"{float(m):>9.1f}")
    return "\n".join(lines)


__all__ = ["run_ring", "load_ring", "RingUnavailable", "ring_table"]
