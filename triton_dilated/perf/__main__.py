"""`python -m triton_dilated.perf`: benchmarks, autotuning and plots on this machine.

  python -m triton_dilated.perf [sweep]   the default sweep: dilated and block-sparse against
                                          the baselines (dense SDPA, the portable backend, the
                                          head-group loop, FlexAttention) at the sequence
                                          lengths that fit this machine; GPU: the Triton
                                          kernels, CPU: the portable backend
  python -m triton_dilated.perf tune      autotune the kernel configs, rewrite configs/<arch>.json
  python -m triton_dilated.perf ring      ring, Ulysses, 2-D: time and per-rank memory vs world size
  python -m triton_dilated.perf layouts   time the block-layout builders at N = 1M tokens
  python -m triton_dilated.perf plot      PNG plots from result CSVs
  python -m triton_dilated.perf table     print the summary table of a result CSV
  python -m triton_dilated.perf aot       compile every kernel without a GPU, for the NVIDIA and
                                          AMD archs named by --arch (default sm90 and sm80):
                                          compile errors, registers, spills, shared memory,
                                          wgmma/mma.sync/MFMA, cp.async/TMA, pipeline depth
  python -m triton_dilated.perf plan      the dilated forward's cost model on a CPU: useful vs
                                          computed (query, key) pairs, K/V bytes, and the
                                          roofline bound on an H100
  python -m triton_dilated.perf decode    time per decode step (one query against N cached
                                          tokens): dilated vs dense SDPA, and the bounded
                                          cache's memory, as the context grows; varlen
                                          rows: a mixed batch in one call vs a loop
  python -m triton_dilated.perf dcp       decode context parallelism on gloo (CPU): the sharded
                                          step per world size vs one device, the merge's time

Results are long-format CSV rows (one per op, provider, mode, shape, metric) with provenance
(machine, arch, torch/triton/CUDA versions, git sha, kernel config, UTC timestamp).
`python -m triton_dilated.perf COMMAND -h` lists each command's options.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from ..ops.common.hardware import ARCH_TABLE, arch_facts
from .cli import (CAUSAL, DTYPES, Parser, add_causal, aot_head_dim, block_size, head_dim, non_negative_float,
                  positive_float, positive_int, varlen_mix)

COMMANDS = ("sweep", "tune", "ring", "layouts", "plot", "table", "aot", "plan", "decode", "dcp")


def _parser():
    parser = Parser(prog="python -m triton_dilated.perf", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name, help_text):
        return sub.add_parser(name, help=help_text, description=help_text, formatter_class=argparse.RawDescriptionHelpFormatter)

    p = command("sweep", "the default benchmark sweep (also: no command)")
    p.add_argument("--out", help="CSV to write, its PNGs beside it; one that exists is refused unless --overwrite "
                                 "(default: a new perf/out/sweep-<UTC date>-<time>.csv each run)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out CSV and its PNGs (default: refuse; nothing is timed)")
    p.add_argument("--seqlens", type=positive_int, nargs="+", metavar="N",
                   help="sequence lengths (default: GPU 8192 16384 32768, and 65536 with >= 40 GiB; "
                        "CPU 1024 2048 4096)")
    p.add_argument("--ops", nargs="+", choices=("dilated", "block_sparse", "indexed"),
                   default=["dilated", "block_sparse", "indexed"], help="which ops to time (default: all three)")
    p.add_argument("--providers", nargs="+", metavar="NAME",
                   help="only these providers: triton, portable, head_group_loop, flex, gather, sdpa_dense "
                        "(default: every one that can run the case; without sdpa_dense no speedups)")
    p.add_argument("--quick", action="store_true", help="one small sequence length, causal only (default: off)")
    p.add_argument("--tiny", action="store_true",
                   help="one tiny case per op, N = the first --seqlens or 128 (tests; interpreter-friendly; "
                        "default: off)")
    flex = p.add_mutually_exclusive_group()
    flex.add_argument("--flex", dest="flex", action="store_true", default=None,
                      help="include FlexAttention (default: on a GPU; on a CPU it runs eagerly and densely)")
    flex.add_argument("--no-flex", dest="flex", action="store_false", help="leave FlexAttention out")
    p.add_argument("--budget", type=non_negative_float, metavar="SECONDS",
                   help="seconds of timed calls per (provider, pass), spent in interleaved rounds "
                        "(default: 0.2 on a GPU, 1.5 on a CPU)")
    p.add_argument("--no-plot", action="store_true", help="do not write PNGs next to the CSV (default: write them)")

    p = command("tune", "autotune kernel configs for this GPU's arch")
    p.add_argument("--out-dir", help="write <arch>.json (and tune-<arch>.csv) here (default: rewrite the "
                                     "package's configs/<arch>.json)")
    p.add_argument("--kernels", nargs="+", choices=("dilated_fwd", "dilated_bwd", "block_sparse_fwd",
                                                     "block_sparse_bwd", "ring_step_fwd", "ring_step_bwd"),
                   help="config families to tune (default: every family of every variant)")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, help="default: bfloat16 float16")
    p.add_argument("--head-dims", type=head_dim, nargs="+", metavar="D", help="default: 64 128")
    p.add_argument("--seqlens", type=positive_int, nargs="+", metavar="N",
                   help="tune at these N, one per sequence bucket (default: 4096 16384 65536)")
    p.add_argument("--heads", type=positive_int, help="query heads of the tuning shape (default: 16)")
    p.add_argument("--max-candidates", type=positive_int, metavar="K",
                   help="time at most this many candidates per kernel (default: all that fit the arch)")
    p.add_argument("--no-causal", action="store_true", help="tune the non-causal kernels (default: causal)")

    p = command("ring", "ring, Ulysses and 2-D attention: time and per-rank memory vs world size")
    p.add_argument("--out", default="perf/out/ring.csv", help="CSV to write (default: %(default)s)")
    p.add_argument("--world-sizes", type=positive_int, nargs="+", metavar="P",
                   help="default: 1 2 4 8 up to the GPU count; CPU: 1 2 4")
    p.add_argument("--seqlen", type=positive_int, metavar="N", help="global sequence length (default: GPU 32768, CPU 4096; "
                                                           "--quick: GPU 4096, CPU 1024)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when a GPU is visible, else cpu")
    p.add_argument("--variants", nargs="+", choices=("dense", "dilated"), default=["dense", "dilated"],
                   help="default: %(default)s")
    p.add_argument("--comms", nargs="+", choices=("p2p", "allgather", "ulysses", "usp"),
                   default=["p2p", "allgather", "ulysses", "usp"],
                   help="ring p2p/all-gather, Ulysses (heads over the ranks), usp (2-D: Ulysses groups of 2 x a "
                        "p2p ring, P >= 4) (default: %(default)s)")
    p.add_argument("--balance", choices=("contiguous", "zigzag"), default="zigzag",
                   help="how the sequence is split over ranks (default: %(default)s)")
    p.add_argument("--no-causal", action="store_true", help="non-causal attention (default: causal)")
    p.add_argument("--quick", action="store_true", help="a short sequence (see --seqlen; default: off)")
    p.add_argument("--timeout", type=positive_float, default=300.0, metavar="SECONDS",
                   help="seconds per world size (default: %(default)s)")

    p = command("layouts", "time the block-layout builders")
    p.add_argument("--out", default="perf/out/layouts.csv", help="CSV to write (default: %(default)s)")
    p.add_argument("--seqlen", type=positive_int, default=1 << 20, metavar="N", help="sequence length (default: %(default)s)")
    p.add_argument("--block-size", type=block_size, default=128, help="block size (default: %(default)s)")

    p = command("plot", "PNG plots from result CSVs (sweep, ring and decode rows)")
    p.add_argument("csv", nargs="*", help="result CSVs (default: the committed perf/results/*.csv)")
    p.add_argument("--out-dir", default="perf/out",
                   help="where to write the PNGs, X-<kind>.png for X.csv (default: %(default)s, like every output "
                        "of this CLI; the committed figures are redrawn with --out-dir perf/results)")

    p = command("table", "print the summary table of result CSVs")
    p.add_argument("csv", nargs="+", help="result CSVs (sweep, ring, decode, tune or layouts rows)")

    p = command("aot", "compile every kernel ahead of time for NVIDIA and AMD archs (no GPU needed)")
    p.add_argument("--arch", type=_aot_arch, nargs="+", default=[90, 80], metavar="ARCH",
                   help="NVIDIA compute capabilities (90, or sm90) or AMD architectures (gfx942, gfx950); "
                        "known: " + " ".join(n.removeprefix("sm") for n in ARCH_TABLE) + " (default: 90 80)")
    p.add_argument("--head-dims", type=aot_head_dim, nargs="+", default=[64, 128], metavar="D",
                   help="default: 64 128 (up to 576: the indexed kernels' absorbed-MLA decode shape)")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["bfloat16"], help="default: bfloat16")
    p.add_argument("--kernels", nargs="+", help="kernel names as in the AOT CSV (default: all; experimental variants "
                                                  "such as block_sparse_fwd_tma, and the serve append (append, "
                                                  "append_rotary), only when named)")
    add_causal(p)
    p.add_argument("--configs", nargs="+", metavar="M,N,W,S",
                   help="compile each kernel with each of these configs (BLOCK_M,BLOCK_N,num_warps,num_stages) "
                        "instead of the arch's default (default: the default config)")
    p.add_argument("--jobs", type=positive_int, default=2, help="parallel compiles (default: %(default)s)")
    p.add_argument("--out", default="perf/out/aot.csv", help="CSV to write (default: %(default)s)")
    p.add_argument("--ptx-dir", metavar="DIR",
                   help="also write each kernel's PTX as DIR/sm<arch>/<kernel>-<dtype>-d<D>-c<causal>.ptx "
                        "(with -<M>x<N>w<W>s<S> when several --configs; default: none)")

    p = command("plan", "the dilated forward's cost model (no GPU needed): pairs, planner efficiency, K/V bytes, "
                        "roofline bound on an H100")
    p.add_argument("--seqlen", "-N", type=positive_int, default=32768, metavar="N", help="sequence length (default: %(default)s)")
    p.add_argument("--batch", type=positive_int, default=1, metavar="B", help="default: %(default)s")
    p.add_argument("--heads", type=positive_int, default=16, metavar="H", help="query heads (default: %(default)s)")
    p.add_argument("--kv-heads", type=positive_int, metavar="HKV", help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=head_dim, default=128, metavar="D", help="default: %(default)s")
    p.add_argument("--segment-lengths", type=positive_int, nargs="+", metavar="W",
                   help="the schedule's segment lengths, clipped to N (default: LongNet 2048 4096 8192 16384 32768)")
    p.add_argument("--dilation-rates", type=positive_int, nargs="+", metavar="R",
                   help="the schedule's dilation rates (default: LongNet 1 2 4 6 12)")
    p.add_argument("--mode", choices=("longnet", "head_groups"), default="longnet", help="default: %(default)s")
    p.add_argument("--offsets", choices=("modulo", "blocked"), default="modulo", help="default: %(default)s")
    add_causal(p)
    p.add_argument("--block-m", type=block_size, default=64, help="query rows per tile (default: %(default)s)")
    p.add_argument("--block-n", type=block_size, default=64, help="keys per inner step (default: %(default)s)")

    p = command("decode", "decode-step time vs context (dilated vs dense SDPA) and the bounded cache's memory")
    p.add_argument("--out", default="perf/out/decode.csv", help="CSV to write (default: %(default)s)")
    p.add_argument("--contexts", type=positive_int, nargs="+", metavar="N",
                   help="cached tokens per step (default: GPU 4096 .. 1048576, CPU 4096 .. 131072, powers of two)")
    p.add_argument("--memory-contexts", type=positive_int, nargs="*", metavar="N",
                   help="contexts of the cache-memory rows (default: the timed ones and 1048576; none: no rows)")
    p.add_argument("--providers", nargs="+", choices=("dilated", "dilated_kvcache", "dilated_kvcache_paged",
                                                      "dilated_kvcache_fp8", "dilated_kvcache_paged_fp8",
                                                      "dilated_kvcache_graph", "dilated_bounded", "indexed_kvcache",
                                                      "indexed_gather", "sdpa_dense", "dilated_kvcache_varlen",
                                                      "dilated_kvcache_varlen_loop"),
                   help="default: all (docstring of triton_dilated/perf/decode.py)")
    p.add_argument("--varlen-mix", type=varlen_mix, metavar="COUNT:TOKENS,..",
                   help="the varlen providers' requests: COUNT requests of TOKENS new tokens each (default: 7:1,1:256, "
                        "seven 1-token decodes and one 256-token prefill chunk)")
    p.add_argument("--batch", type=positive_int, nargs="+", default=[1], metavar="B",
                   help="batch sizes, one query per row (e.g. 1 8 64; default: 1)")
    p.add_argument("--page-size", type=positive_int, default=64, help="rows per page of the paged providers (default: 64)")
    p.add_argument("--max-cache-gib", type=positive_float, metavar="GIB",
                   help="skip a (batch, context) whose caches (with the paged and FP8 copies) take more (default: "
                        "half the GPU's memory, 4 on a CPU)")
    p.add_argument("--graph-backend", default="aot_eager",
                   help="torch.compile backend of the CUDA-graph provider (default: %(default)s, which runs the "
                        "append on copies of the caches, a replay that grows with the context; inductor runs it in "
                        "place)")
    p.add_argument("--heads", type=positive_int, default=16, help="query heads (default: %(default)s)")
    p.add_argument("--kv-heads", type=positive_int, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=head_dim, default=128, help="default: %(default)s")
    p.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--budget", type=non_negative_float, metavar="SECONDS", help="seconds of timed rounds per context "
                   "(default: 0.2 on a GPU, 1.5 on a CPU)")
    p.add_argument("--max-call-seconds", type=positive_float, metavar="S",
                   help="stop timing a provider once one call takes longer (default: GPU 30, CPU 20)")

    p = command("dcp", "decode context parallelism on gloo (CPU): the sharded decode step per world size against "
                       "one device, the merge's time and the efficiency")
    p.add_argument("--out", default="perf/out/dcp.csv", help="CSV to write (default: %(default)s)")
    p.add_argument("--worlds", type=positive_int, nargs="+", default=[2, 4], metavar="P",
                   help="world sizes, one gloo process per rank (default: 2 4)")
    p.add_argument("--keys", type=positive_int, default=32768,
                   help="cached tokens per sequence, a multiple of P x --page-size (default: %(default)s)")
    p.add_argument("--batch", type=positive_int, default=4, help="sequences, one query each (default: %(default)s)")
    p.add_argument("--heads", type=positive_int, default=8, help="query heads (default: %(default)s)")
    p.add_argument("--kv-heads", type=positive_int, default=2, help="key/value heads (default: %(default)s)")
    p.add_argument("--head-dim", type=head_dim, default=64, help="default: %(default)s")
    p.add_argument("--page-size", type=positive_int, default=64,
                   help="rows per page of the interleave (dcp_page_size; default: %(default)s)")
    p.add_argument("--runs", type=positive_int, default=7, help="timed rounds per step (default: %(default)s)")
    p.add_argument("--schedules", nargs="+", choices=("dilated", "dense"), default=["dilated", "dense"],
                   help="default: both (docstring of triton_dilated/perf/dcp.py)")
    p.add_argument("--timeout", type=positive_float, default=600.0, metavar="S",
                   help="seconds a world may take (default: %(default)s)")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["sweep"] + argv
    args = _parser().parse_args(argv)
    return {"sweep": _sweep, "tune": _tune, "ring": _ring, "layouts": _layouts, "plot": _plot,
            "table": _table, "aot": _aot, "plan": _plan, "decode": _decode, "dcp": _dcp}[args.command](args)


def _sweep(args) -> int:
    import torch

    from .bench import PROVIDERS, default_sweep, missing_providers, run_sweep, tiny_sweep
    from .results import busy_hint, print_table
    from .timing import Timing
    unknown = [p for p in args.providers or () if p not in PROVIDERS]
    if unknown:
        print(f"sweep: unknown provider{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; "
              f"the providers are {', '.join(PROVIDERS)}", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny and args.seqlens and args.seqlens[0] < 2:
        print(f"sweep: --tiny needs N >= 2 (its dilated case has segments of N/2 and N tokens), got --seqlens "
              f"{args.seqlens[0]}", file=sys.stderr)
        return 2
    if args.tiny:
        cases = [c for c in tiny_sweep(device, (args.seqlens or [128])[0]) if c.op in args.ops]
    else:
        cases = default_sweep(quick=args.quick, seqlens=args.seqlens, ops=args.ops)
    if not cases:
        print("nothing to run")
        return 1
    if args.providers:
        missing = missing_providers(cases, args.providers, flex=args.flex)
        for name, why in missing.items():
            print(f"sweep: no rows for {name!r}: {why}", file=sys.stderr)
        if len(missing) == len(set(args.providers)):
            print("sweep: none of the named providers can run here: nothing to time", file=sys.stderr)
            return 2
    out = args.out or _new_sweep_path()
    taken = [] if args.overwrite else _sweep_outputs(out, plots=not args.no_plot)
    if taken:
        print(f"sweep: {', '.join(taken)} exist{'s' * (len(taken) == 1)} (an earlier run's results): name another "
              f"--out, drop --out for a new perf/out/sweep-<time>.csv, or add --overwrite to replace "
              f"{'it' if len(taken) == 1 else 'them'}", file=sys.stderr)
        return 2
    print(f"writing {out}" + ("" if args.no_plot else " and its PNGs"))
    timing = Timing.for_device(device, args.budget)
    rows = run_sweep(cases, out=out, timing=timing, flex=args.flex, only=args.providers)
    print_table(rows)
    print(f"\nwrote {len(rows)} rows to {out}")
    if device == "cpu":
        print("(CPU run: portable-backend and baseline timings only; Triton kernel timings need a GPU.)")
    if rows and not args.no_plot:
        try:
            from .plot import plot_csv
            for p in plot_csv(out):
                print(f"wrote {p}")
        except Exception as exc:  # plotting is a convenience: never fail the sweep for it
            print(f"plots skipped ({type(exc).__name__}: {exc})")
    hint = busy_hint(rows, threads=torch.get_num_threads())
    if hint:    # last, where it is read
        print(hint)
    return 0 if rows else 1


def _sweep_outputs(csv_path: str, plots: bool) -> list:
    """The files of csv_path's sweep (the CSV, and its PNGs with `plots`) that exist already."""
    from .plot import SWEEP_PLOTS, png_path
    paths = [csv_path] + ([png_path(csv_path, kind) for kind in SWEEP_PLOTS] if plots else [])
    return [p for p in paths if os.path.exists(p)]


def _new_sweep_path(directory: str = os.path.join("perf", "out")) -> str:
    """The default --out: perf/out/sweep-<UTC date>-<time>.csv, with -2, -3, ... where a run of
    the same second left files: every run keeps the earlier ones (perf/compare_runs.py compares
    two)."""
    stem = os.path.join(directory, time.strftime("sweep-%Y%m%d-%H%M%S", time.gmtime()))
    path, n = f"{stem}.csv", 1
    while _sweep_outputs(path, plots=True):
        n += 1
        path = f"{stem}-{n}.csv"
    return path


def _tune(args) -> int:
    import torch

    from .tune import KERNELS, run_tune
    try:
        path, table = run_tune(out_dir=args.out_dir, kernels=args.kernels or KERNELS,
                               dtypes=[getattr(torch, d) for d in args.dtypes] if args.dtypes else None,
                               head_dims=args.head_dims, seqlens=args.seqlens, causal=not args.no_causal,
                               heads=args.heads, max_candidates=args.max_candidates)
    except RuntimeError as exc:
        print(f"tune: {exc}", file=sys.stderr)
        return 2
    n = sum(len(v) for v in table.get("measured", {}).values())
    print(f"wrote {path} ({n} tuned entries)")
    return 0


def _ring(args) -> int:
    from .ring import RingUnavailable, ring_table, run_ring
    try:
        rows = run_ring(world_sizes=args.world_sizes, seqlen=args.seqlen, variants=args.variants, comms=args.comms,
                        device=args.device, causal=not args.no_causal, balance=args.balance, out=args.out,
                        timeout_s=args.timeout, quick=args.quick)
    except RingUnavailable as exc:
        print(f"ring: {exc}. Nothing was measured.", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"ring: {exc}", file=sys.stderr)
        return 2
    print()
    print(ring_table(rows))
    print(f"\nwrote {len(rows)} rows to {args.out}")
    return 0 if rows else 1


def _layouts(args) -> int:
    from .bench import time_layout_builders
    from .results import write_csv
    rows = time_layout_builders(seq_len=args.seqlen, block_size=args.block_size)
    write_csv(rows, args.out)
    for r in rows:
        if r["metric"] == "seconds":
            print(f"{r['provider']:14} N={r['N']:>8} block={r['block_size']}  {r['value']:.3f} s")
    print(f"\nwrote {len(rows)} rows to {args.out}")
    return 0


def _plot(args) -> int:
    from .plot import default_results_dir, plot_csv
    from .results import ResultsFileError
    paths = args.csv
    if not paths:
        results = default_results_dir()
        paths = sorted(os.path.join(results, f) for f in os.listdir(results) if f.endswith(".csv")) \
            if os.path.isdir(results) else []
        if not paths:
            print(f"plot: no CSVs given and none in {results}", file=sys.stderr)
            return 2
    written, failed = [], 0
    for path in paths:
        try:
            new = plot_csv(path, args.out_dir)
        except ResultsFileError as exc:
            print(f"plot: {exc}", file=sys.stderr)
            failed += 1
            continue
        if not new and args.csv:
            print(f"plot: {path}: no sweep, ring or decode rows to plot (layouts and tune CSVs have no plots)",
                  file=sys.stderr)
        for p in new:
            print(f"wrote {p}")
        written += new
    return 2 if failed else (0 if written else 1)


def _table(args) -> int:
    from .dcp import OP as DCP_OP
    from .dcp import dcp_table
    from .decode import OP as DECODE_OP
    from .decode import decode_table
    from .results import BENCH_OPS, ResultsFileError, read_csv, summary_table
    from .ring import ring_table
    try:
        rows = read_csv(args.csv)
    except ResultsFileError as exc:
        print(f"table: {exc}", file=sys.stderr)
        return 2
    ring = [r for r in rows if r["op"] == "ring_attention"]
    bench = [r for r in rows if r["op"] in BENCH_OPS]
    tune = [r for r in rows if str(r["op"]).startswith("tune:")]
    layouts = [r for r in rows if r["op"] == "layout_build"]
    decode = [r for r in rows if r["op"] == DECODE_OP]
    dcp = [r for r in rows if r["op"] == DCP_OP]
    if not (ring or bench or tune or layouts or decode or dcp):
        ops = sorted({str(r["op"]) for r in rows})
        print(f"table: {', '.join(map(str, args.csv))}: no sweep, ring, decode, tune or layout rows"
              + (f" (ops: {', '.join(ops[:6])})" if ops else " (no rows)"), file=sys.stderr)
        return 1
    machines = sorted({r["machine"] for r in rows if r.get("machine")})
    print(f"machine: {', '.join(machines) or 'unknown'}")
    if bench:
        print(summary_table(bench))
    if ring:
        print(ring_table(ring))
    if decode:
        print(decode_table(decode))
    if dcp:
        print(dcp_table(dcp))
    if tune:
        best = {}
        for r in tune:
            k = (r["op"], r["dtype"], r["D"], r["N"])
            if k not in best or r["value"] < best[k]["value"]:
                best[k] = r
        print(f"\n{'tuned kernel':24} {'dtype':9} {'D':>4} {'N':>7} {'ms':>9}  config")
        for k, r in sorted(best.items()):
            print(f"{k[0][5:]:24} {k[1]:9} {k[2]:>4} {k[3]:>7} {r['value']:>9.3f}  {r['config']}")
    if layouts:
        cell = {(r["variant"], r["metric"]): r["value"] for r in layouts}
        print(f"\n{'layout builder':16} {'N':>8} {'block':>5} {'seconds':>8} {'blocks':>9} {'index MiB':>9}")
        for r in layouts:
            if r["metric"] == "seconds":
                v = r["variant"]
                print(f"{v:16} {r['N']:>8} {r['block_size']:>5} {r['value']:>8.3f} "
                      f"{cell.get((v, 'active_blocks'), float('nan')):>9.0f} {cell.get((v, 'index_mib'), float('nan')):>9.1f}")
    return 0


# The targets Triton's compiler (3.9: its LLVM, ptxas and ptxas-blackwell) builds for: the compute
# capabilities of NVIDIA's GPUs and the CDNA archs of its AMD backend. Others pass the architecture
# table's nearest-row rule but crash the compile: sm91, sm99, sm111, sm122, sm999 abort LLVM ("Cannot
# select: intrinsic"), sm88 needs a newer PTX, ptxas refuses sm101 (sm110 since CUDA 13), gfx940/941/999
# fail Triton's passes.
AOT_NVIDIA = (70, 72, 75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121)
AOT_AMD = ("gfx908", "gfx90a", "gfx942", "gfx950")


def _aot_arch(text: str):
    """--arch value -> an NVIDIA compute capability (int) or an AMD name (str); an arch the
    architecture table does not know, or one Triton cannot compile for (AOT_NVIDIA, AOT_AMD), is
    a usage error naming the known ones."""
    name = text.strip().lower()
    name = name if name.startswith(("sm", "gfx")) else f"sm{name}"
    try:
        arch_facts(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    arch = name if name.startswith("gfx") else int(name[2:])
    if arch not in AOT_NVIDIA + AOT_AMD:
        raise argparse.ArgumentTypeError(
            f"Triton cannot compile for {name!r} (no such GPU, or one its compiler does not target): the compute "
            f"capabilities are {' '.join(map(str, AOT_NVIDIA))}, the AMD architectures {' '.join(AOT_AMD)}")
    return arch


def _aot(args) -> int:
    from .aot import KERNELS, NAMED_KERNELS, VARIANTS, AotCrash, arch_summary, run_aot
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("aot: TRITON_INTERPRET=1 replaces the compiled kernels by the interpreter: unset it", file=sys.stderr)
        return 2
    unknown = set(args.kernels or ()) - set(KERNELS) - set(NAMED_KERNELS) - set(VARIANTS)
    if unknown:
        known = ", ".join([*KERNELS, *NAMED_KERNELS, *VARIANTS])
        print(f"aot: unknown kernels {sorted(unknown)}; known: {known}", file=sys.stderr)
        return 2
    configs = None
    if args.configs:
        from ..ops.common.configs import make_config
        try:
            configs = [make_config(*(int(x) for x in c.split(","))) for c in args.configs]
        except (TypeError, ValueError):
            print(f"aot: --configs takes BLOCK_M,BLOCK_N,num_warps,num_stages (four integers, e.g. 64,64,4,3); "
                  f"got {' '.join(args.configs)}", file=sys.stderr)
            return 2
    causal = CAUSAL[args.causal]
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}    # the AOT CSV's spelling
    try:
        rows = run_aot(archs=args.arch, head_dims=args.head_dims, dtypes=[short[d] for d in args.dtypes],
                       causal=causal, kernels=args.kernels, configs=configs, out=args.out, jobs=args.jobs,
                       ptx_dir=args.ptx_dir)
    except AotCrash as exc:
        print(f"aot: {exc}", file=sys.stderr)
        return 1
    failed = [r for r in rows if r["error"]]
    spilled = [r for r in rows if not r["error"] and r["spill_stores"]]
    replicated = [r for r in rows if not r["error"] and r["mma_replicated"]]
    print("\n" + "\n".join(arch_summary(rows)))
    print(f"\n{len(rows)} compiles: {len(failed)} failed, {len(spilled)} spill registers, {len(replicated)} compute "
          f"MMA rows twice (mma_replicated); wrote {args.out}" + (f" and PTX under {args.ptx_dir}" if args.ptx_dir else ""))
    return 1 if failed else 0


def _plan(args) -> int:
    from ..ops.dilated.spec import LONGNET_R, LONGNET_W
    from .cost_model import main_report
    ws = args.segment_lengths or list(LONGNET_W)
    rs = args.dilation_rates or list(LONGNET_R)
    kv = args.kv_heads or args.heads
    problems = []   # single values are checked as they are parsed (cli.py); these are pairs of them
    if args.heads % kv:
        problems.append(f"--heads ({args.heads}) must be a multiple of --kv-heads ({kv})")
    if len(ws) != len(rs):
        problems.append(f"--segment-lengths and --dilation-rates must have one entry per pattern; got {len(ws)} "
                        f"and {len(rs)}")
    if problems:
        print("plan: " + "; ".join(problems), file=sys.stderr)
        return 2
    causal = CAUSAL[args.causal]
    try:
        print(main_report(n=args.seqlen, heads=args.heads, head_dim=args.head_dim, causal_values=causal,
                          kv_heads=kv, batch=args.batch, segment_lengths=ws, dilation_rates=rs, mode=args.mode,
                          offsets=args.offsets, block_m=args.block_m, block_n=args.block_n))
    except ValueError as exc:   # the schedule (check_patterns) or the heads (head_offsets)
        print(f"plan: {exc}", file=sys.stderr)
        return 2
    return 0


def _decode(args) -> int:
    from .decode import main
    return main(args)


def _dcp(args) -> int:
    from .dcp import main
    return main(args)


if __name__ == "__main__":
    sys.exit(main())

