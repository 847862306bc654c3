"""gpu_check.sh stage 3: where the time of one dilated forward+backward goes, per kernel, from
torch.profiler. LongNet schedule at N = 32K (bf16, B = 1, H = 16, D = 128; causal and not),
the public dilated_attention and autograd, default configs; a few profiled iterations after
a warm-up. Buckets: the forward kernel, the dQ kernel, the dK/dV kernel, delta (the
rowsum(dO * O) that feeds the backward: its einsum kernels, found by wrapping
softmax_delta in a profiler range) and the rest (allocation, zeroing, the device plans'
copies), with the wall time per iteration beside them.

Rows (results.COLUMNS) to --out, per case as it finishes: metric kernel_ms_<bucket> (ms per
iteration; `config` names the kernels in the bucket), kernel_ms_total (all GPU kernels) and
wall_ms (forward+backward, timed without the profiler). Printed: the buckets and the ten
longest kernels.

    python perf/kernel_breakdown.py --out OUT/kernel_breakdown.csv
    TRITON_INTERPRET=1 python perf/kernel_breakdown.py --seqlen 128 --heads 2 --head-dim 16 \\
        --dtype float32 --iters 1 --out /tmp/b.csv     # CPU dry run: no GPU kernels, CPU times
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

from triton_dilated import dilated_attention
from triton_dilated.ops.dilated.spec import longnet_patterns
from triton_dilated.perf.cli import CAUSAL, shape_parser
from triton_dilated.perf.results import CsvSink, make_row, provenance, sig

DELTA_RANGE = "triton_dilated::softmax_delta"
# bucket -> substrings of the kernel (or profiler range) names that belong to it
BUCKETS = {"fwd": ("_dilated_fwd_kernel",), "dq": ("_dilated_bwd_dq_kernel",),
           "dkdv": ("_dilated_bwd_dkdv_kernel",), "delta": (DELTA_RANGE,)}


def bucket_of(name: str) -> str | None:
    """The bucket a kernel or range name belongs to (BUCKETS), or None."""
    for bucket, keys in BUCKETS.items():
        if any(k in name for k in keys):
            return bucket
    return None


def _device_us(evt, self_only=False) -> float:
    """Device (GPU) microseconds of a profiler entry, across torch versions' attribute names."""
    for attr in (("self_device_time_total", "self_cuda_time_total") if self_only
                 else ("device_time_total", "cuda_time_total")):
        if hasattr(evt, attr):
            return float(getattr(evt, attr))
    return 0.0


def breakdown(entries, iters: int) -> tuple[dict, dict, float]:
    """({bucket: ms per iteration}, {bucket: kernel names}, total kernel ms per iteration) from
    profiler entries given as (name, is_gpu_kernel, device_us, self_device_us, cpu_us). GPU:
    kernels by name, delta by its range's device time; other = total - the named buckets. On
    a CPU (no GPU kernels), the ranges' and ops' CPU time instead."""
    gpu = any(is_kernel for _, is_kernel, *_ in entries)
    ms = {b: 0.0 for b in (*BUCKETS, "other")}
    names = {b: [] for b in ms}
    total = 0.0
    for name, is_kernel, dev_us, self_dev_us, cpu_us in entries:
        b = bucket_of(name)
        if gpu:
            if is_kernel:
                total += self_dev_us
            if b is None or (b != "delta" and not is_kernel) or (b == "delta" and is_kernel):
                continue
            ms[b] += dev_us
        else:
            if b is None:
                continue
            ms[b] += cpu_us
        names[b].append(name)
    total = total if gpu else sum(ms.values())
    ms["other"] = max(0.0, total - sum(ms.values()))
    return ({b: v / 1e3 / iters for b, v in ms.items()}, {b: sorted(set(n)) for b, n in names.items()},
            total / 1e3 / iters)


@contextlib.contextmanager
def delta_range():
    """softmax_delta, as the dilated launcher calls it, inside a profiler range (DELTA_RANGE);
    a no-op (and a note) if the launcher no longer calls it by that name."""
    from torch.profiler import record_function
    try:
        import triton_dilated.ops.dilated.kernels as kernels
        original = kernels.softmax_delta
    except (ImportError, AttributeError) as exc:
        print(f"(delta not separated: {type(exc).__name__}: {exc})")
        yield
        return

    def wrapped(*a, **kw):
        with record_function(DELTA_RANGE):
            return original(*a, **kw)
    kernels.softmax_delta = wrapped
    try:
        yield
    finally:
        kernels.softmax_delta = original


def main() -> int:
    p = shape_parser(__doc__, 32768)
    p.add_argument("--iters", type=int, default=3, help="profiled iterations (default: %(default)s)")
    args = p.parse_args()
    from torch.profiler import ProfilerActivity, profile
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    base = provenance(device)
    n, h, d = args.seqlen, args.heads, args.head_dim
    ws, rs = (list(x) for x in zip(*longnet_patterns(n)))
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(1, n, h, d, generator=gen, device=device).to(dtype) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with CsvSink(args.out) as sink:
        for causal in CAUSAL[args.causal]:
            def step():
                out = dilated_attention(q, k, v, ws, rs, causal=causal)
                torch.autograd.grad(out, (q, k, v), do)
            step()   # compiles, plans
            sync()
            walls = []
            for _ in range(max(3, args.iters)):
                t0 = time.perf_counter()
                step()
                sync()
                walls.append((time.perf_counter() - t0) * 1e3)
            with delta_range(), profile(activities=activities) as prof:
                for _ in range(args.iters):
                    step()
                sync()
            entries = [(getattr(e, "key", "") or getattr(e, "name", ""), "cuda" in str(getattr(e, "device_type", "")).lower(), _device_us(e),
                        _device_us(e, self_only=True), float(getattr(e, "cpu_time_total", 0.0)))
                       for e in prof.key_averages()]
            ms, names, total = breakdown(entries, args.iters)
            fields = dict(op="dilated_attention", variant="longnet", provider="triton", B=1, N=n, H=h, Hkv=h, D=d,
                          dtype=args.dtype, causal=causal, attn_mode="longnet", segment_lengths="/".join(map(str, ws)),
                          dilation_rates="/".join(map(str, rs)), rounds=args.iters, **{"pass": "fwd_bwd"}, **base)
            wall = statistics.median(walls)
            rows = [make_row(**fields, metric=f"kernel_ms_{b}", value=sig(v), config=" ".join(names[b])[:300])
                    for b, v in ms.items()]
            rows += [make_row(**fields, metric="kernel_ms_total", value=sig(total),
                              config="all GPU kernels" if device == "cuda" else "CPU: the profiled ranges"),
                     make_row(**fields, metric="wall_ms", value=sig(wall), config="median, no profiler")]
            sink.write(rows)
            unit = "GPU" if device == "cuda" else "CPU (dry run: no GPU kernels)"
            print(f"\nN={n} H={h} D={d} {args.dtype} causal={causal}: fwd+bwd wall {wall:.3f} ms; {unit} ms per "
                  f"iteration: " + ", ".join(f"{b} {v:.3f}" for b, v in ms.items()) + f"; total {total:.3f}")
            longest = sorted((e for e in entries if e[1]), key=lambda e: -e[3])[:10]
            for name, _, _, self_us, _ in longest:
                print(f"  {self_us / 1e3 / args.iters:9.3f} ms  {name[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
