"""gpu_check.sh stage 2: the key rows. Dilated attention with the LongNet schedule at N = 32K
(bf16, B = 1, H = 16, D = 128; causal and not), forward and forward+backward, against dense
SDPA, all in interleaved rounds on shared inputs (perf/timing.py), with the dense baseline
timed under each SDPA backend torch has (FlashAttention, cuDNN, memory-efficient, each forced
with torch.nn.attention.sdpa_kernel) and as torch picks it by default. Which backend the
default ran is read off the profiler (the dispatcher op it called) and written, with torch's
priority order, into the `config` column of the `sdpa_dense` rows.

Rows (results.COLUMNS, readable by `python -m triton_dilated.perf table`) go to --out as each
case finishes: ms, tflops (dense pairs for every SDPA provider, the pattern's pairs for
triton), speedup_vs_dense (paired against the default SDPA) and speedup_vs_best_dense
(paired against the fastest SDPA backend of that pass).

    python perf/gpu_key_rows.py --out OUT/key_rows.csv
    TRITON_INTERPRET=1 python perf/gpu_key_rows.py --seqlen 128 --heads 2 --head-dim 16 \\
        --dtype float32 --quick --out /tmp/k.csv          # CPU dry run (timings mean nothing)
"""
from __future__ import annotations

import contextlib
import statistics

import torch
import torch.nn.functional as F

from triton_dilated.ops.common.spec import attention_flops, dense_pairs
from triton_dilated.ops.dilated.spec import longnet_patterns
from triton_dilated.perf.cli import CAUSAL, shape_parser
from triton_dilated.perf.bench import Case, case_pairs, case_params, main_provider, provider_config
from triton_dilated.perf.results import PASSES, CsvSink, make_row, provenance, sig, summary_table
from triton_dilated.perf.timing import Timing, matmul_peak_tflops, measure_interleaved, paired_ratio, spread_pct

SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
# the dispatcher op SDPA calls for each backend (CPU and CUDA alike); MATH: the composite
SDPA_OPS = {"aten::_scaled_dot_product_cudnn_attention": "CUDNN_ATTENTION",
            "aten::_scaled_dot_product_flash_attention": "FLASH_ATTENTION",
            "aten::_scaled_dot_product_flash_attention_for_cpu": "FLASH_ATTENTION",
            "aten::_scaled_dot_product_efficient_attention": "EFFICIENT_ATTENTION",
            "aten::_scaled_dot_product_attention_math": "MATH"}


def sdpa_call(q, k, v, causal, backend=None):
    """Dense SDPA on (B, N, H, D) inputs, under one forced backend (a SDPBackend name) or torch's pick."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    ctx = sdpa_kernel([getattr(SDPBackend, backend)]) if backend else contextlib.nullcontext()
    with ctx:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal)
    return out.transpose(1, 2)


def backend_of_ops(names) -> str:
    """The SDPA backend that ran, from the profiler's op names (SDPA_OPS); "unknown" if none matches."""
    found = [SDPA_OPS[n] for n in names if n in SDPA_OPS]
    return found[0] if found else "unknown"


def default_sdpa_backend(q, k, v, causal) -> str:
    """Which backend torch's default SDPA runs for these inputs (read off the profiler)."""
    from torch.profiler import profile
    with torch.no_grad(), profile() as prof:
        sdpa_call(q, k, v, causal)
        if q.is_cuda:
            torch.cuda.synchronize()
    return backend_of_ops([e.name for e in prof.events()])


def priority_order() -> str:
    """torch's SDPA backend priority order ("FLASH_ATTENTION > ..."), or "" where it cannot be read."""
    try:
        from torch.nn.attention import SDPBackend
        names = {int(b): b.name for b in SDPBackend.__members__.values()}
        return " > ".join(names.get(int(i), str(i)) for i in torch._C._get_sdp_priority_order())
    except Exception:  # noqa: BLE001  (a private API: the order is a note, not a result)
        return ""


def key_case(n, heads, head_dim, dtype, device, causal) -> Case:
    ws, rs = zip(*longnet_patterns(n))
    return Case("dilated", "longnet", 1, n, heads, head_dim, causal, dtype, device, tuple(ws), tuple(rs))


def case_rows(case, measured, note, base) -> list:
    """Rows of one case: ms and tflops per (provider, pass); the speedups of every non-default
    provider against the default SDPA and against the fastest SDPA backend, both paired."""
    rows = []
    pairs, dense = case_pairs(case), dense_pairs(case.B, case.H, case.N, case.causal)
    fields = dict(op="dilated_attention", variant=case.variant, B=case.B, N=case.N, H=case.H, Hkv=case.kv_heads,
                  D=case.D, dtype=str(case.dtype).removeprefix("torch."), causal=case.causal, attn_mode=case.variant,
                  segment_lengths="/".join(map(str, case.ws)), dilation_rates="/".join(map(str, case.rs)))
    for mode in PASSES:
        sdpa = {name: t for (name, m), t in measured.times.items() if m == mode and name.startswith("sdpa")}
        best = min(sdpa, key=lambda n: statistics.median(sdpa[n])) if sdpa else None
        for (name, m), times in measured.times.items():
            if m != mode:
                continue
            ms, spread = statistics.median(times), spread_pct(times)
            n_pairs = dense if name.startswith("sdpa") else pairs
            tflops = attention_flops(n_pairs, case.D, backward=mode == "fwd_bwd") / ms / 1e9
            sp = "" if spread != spread else round(spread, 2)
            config = provider_config(case, "triton", mode) if name == "triton" else note.get(name, "")
            common = dict(base, **fields, provider=name, config=config, density=sig(n_pairs / dense),
                          rounds=len(times))
            rows += [make_row(**common, **{"pass": mode}, metric="ms", value=sig(ms), spread_pct=sp),
                     make_row(**common, **{"pass": mode}, metric="tflops", value=sig(tflops), spread_pct=sp),
                     make_row(**common, **{"pass": mode}, metric="pct_matmul_peak",
                              value=sig(100 * tflops / base["matmul_peak_tflops"]), spread_pct=sp)]
            for metric, ref in (("speedup_vs_dense", "sdpa_dense"), ("speedup_vs_best_dense", best)):
                if ref and ref != name and (ref, mode) in measured.times:
                    ratio, rs = paired_ratio(measured.times[(ref, mode)], times)
                    extra = {} if metric == "speedup_vs_dense" else {
                        "config": f"against {ref}, the fastest SDPA backend of this pass"}
                    rows.append(make_row(**{**common, **extra}, **{"pass": mode}, metric=metric, value=sig(ratio),
                                         spread_pct="" if rs != rs else round(rs, 2)))
    return rows


def main() -> int:
    p = shape_parser(__doc__, 32768)
    p.add_argument("--quick", action="store_true", help="one timed round per call (dry runs; default: off)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    timing = (Timing(warmup=1, budget_s=0.0, min_reps=1, max_reps=1, max_s=0.0) if args.quick
              else Timing.for_device(device))
    base = dict(provenance(device), matmul_peak_tflops=sig(matmul_peak_tflops(device, dtype)))
    order = priority_order()
    main_name = main_provider(device)
    print(f"{base['machine']}; torch {base['torch']}, triton {base['triton']}; SDPA priority order: {order or '?'}")
    rows = []
    with CsvSink(args.out) as sink:
        for causal in CAUSAL[args.causal]:
            case = key_case(args.seqlen, args.heads, args.head_dim, dtype, device, causal)
            params = case_params(case, on_device=True)
            provs = {main_name: lambda q, k, v, c=case, pr=params: c.spec.call(q, k, v, causal=c.causal,
                                                                              backend="auto", **pr),
                     "sdpa_dense": lambda q, k, v, c=causal: sdpa_call(q, k, v, c)}
            for b in SDPA_BACKENDS:
                provs["sdpa_" + b.split("_")[0].lower()] = lambda q, k, v, c=causal, b=b: sdpa_call(q, k, v, c, b)
            gen = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(1, case.N, case.H, case.D, generator=gen, device=device).to(dtype)
                       for _ in range(3))
            picked = default_sdpa_backend(q, k, v, causal)
            del q, k, v
            note = {"sdpa_dense": f"default SDPA backend: {picked}" + (f" (priority {order})" if order else "")}
            note.update({"sdpa_" + b.split("_")[0].lower(): f"SDPA backend {b} (forced)" for b in SDPA_BACKENDS})
            print(f"\nN={case.N} H={case.H} D={case.D} {args.dtype} causal={causal} "
                  f"w={'/'.join(map(str, case.ws))} r={'/'.join(map(str, case.rs))}: default SDPA runs {picked}")
            measured = measure_interleaved(case, provs, PASSES, timing)
            for (name, mode), msg in sorted(measured.errors.items()):
                print(f"  not timed: {name} {mode}: {msg}")
            new = case_rows(case, measured, note, base)
            sink.write(new)
            rows += new
            for r in new:
                if r["metric"] in ("ms", "speedup_vs_dense", "speedup_vs_best_dense"):
                    print(f"  {r['provider']:15} {r['pass']:7} {r['metric']:22} {r['value']:>10.4g}"
                          + (f"  ({r['config']})" if r["metric"] == "speedup_vs_best_dense" else ""))
            if device == "cuda":
                torch.cuda.empty_cache()
    print()
    print(summary_table([{**r, "flags": [], "value": float(r["value"])} for r in rows]))
    print(f"\nwrote {len(rows)} rows to {args.out}")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
