"""`python -m triton_dilated.perf plot`: PNG plots from result CSVs, and the helpers the
notebooks use (they read only committed CSVs and the pattern builders).

For a sweep CSV `X.csv` it writes X-time.png (median ms vs N per provider), X-speedup.png
(dense SDPA time / provider time vs N: the median of per-round ratios where the CSV has
them), X-tflops.png (effective TFLOP/s, GFLOP/s on a CPU: only the computed (query, key)
pairs count) and X-sparsity.png (speedup over dense vs the fraction of pairs skipped); for a
ring CSV, X-ring.png (time and per-rank memory vs world size); for a `perf decode` CSV,
X-decode.png (time per decode step and cache memory per layer vs the context). Every figure from a CPU run
says in its title that it times the portable PyTorch backend, not the Triton kernels. Log
axes carry plain-number ticks. Figures are drawn with matplotlib's object API and the Agg
canvas (no display needed).
"""
from __future__ import annotations

import glob
import math
import os
from collections import defaultdict

from .results import BENCH_OPS, FLAG_BUSY, PASSES, _flags, on_cpu, read_csv

PROVIDER_ORDER = ["triton", "portable", "head_group_loop", "flex", "sdpa_dense"]
PROVIDER_STYLE = {
    "triton": dict(color="tab:red", marker="o"),
    "portable": dict(color="tab:blue", marker="s"),
    "head_group_loop": dict(color="tab:green", marker="^"),
    "flex": dict(color="tab:purple", marker="D"),
    "sdpa_dense": dict(color="black", marker="x", linestyle="--"),
}
MAIN_PROVIDERS = ("triton", "portable")
# rows flagged FLAG_BUSY (other processes took CPU while they were timed): a red ring around the point
BUSY_MARK = dict(marker="o", s=150, facecolors="none", edgecolors="red", linewidths=1.4, zorder=5)
BUSY_LABEL = "busy: timed while other processes took CPU"


def load(paths=None, results_dir=None):
    """Rows of the given CSVs, or of every CSV in results_dir (default perf/results)."""
    if paths is None:
        results_dir = results_dir or default_results_dir()
        paths = sorted(glob.glob(os.path.join(results_dir, "*.csv")))
    return read_csv(list(paths)) if paths else []


def default_results_dir():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(root, "perf", "results")


def _providers(rows):
    seen = {r["provider"] for r in rows}
    return [p for p in PROVIDER_ORDER if p in seen] + sorted(seen - set(PROVIDER_ORDER))


def panel_keys(rows):
    """(op, variant, causal) combinations with timings, in a stable order."""
    keys = {(r["op"], r["variant"], r["causal"]) for r in rows if r["metric"] == "ms" and r["op"] != "ring_attention"}
    return sorted(keys, key=lambda k: (k[0], k[1], k[2]))


def values(rows, metric, op, variant, causal, mode, provider, by="N"):
    """[(x, value)] sorted by x for one series."""
    pts = [(r[by], r["value"]) for r in rows
           if r["metric"] == metric and r["op"] == op and r["variant"] == variant and r["causal"] == causal
           and r["pass"] == mode and r["provider"] == provider and not math.isnan(r["value"])]
    return sorted(pts)


def busy(rows, metric, op, variant, causal, mode, provider, by="N") -> set:
    """The x values (N) of one series whose `metric` row is flagged FLAG_BUSY."""
    return {r[by] for r in rows
            if r["metric"] == metric and r["op"] == op and r["variant"] == variant and r["causal"] == causal
            and r["pass"] == mode and r["provider"] == provider and FLAG_BUSY in _flags(r)}


def mark_busy(ax, hits) -> None:
    """Ring the points `hits` [(x, y)] of flagged rows; one legend entry per panel."""
    if hits:
        labelled = BUSY_LABEL in ax.get_legend_handles_labels()[1]
        ax.scatter(*zip(*hits), label="_busy" if labelled else BUSY_LABEL, **BUSY_MARK)


def legend(ax, **kwargs):
    """ax.legend with the busy ring's entry last (after the series it marks)."""
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i] == BUSY_LABEL)
    return ax.legend([handles[i] for i in order], [labels[i] for i in order], **kwargs)


def speedups(rows, op, variant, causal, mode, provider):
    """[(N, dense ms / provider ms)]: the paired per-round ratios (speedup_vs_dense rows)
    where the CSV has them, else the ratio of the medians (older files)."""
    paired = values(rows, "speedup_vs_dense", op, variant, causal, mode, provider)
    if paired:
        return paired
    dense = dict(values(rows, "ms", op, variant, causal, mode, "sdpa_dense"))
    return [(n, dense[n] / ms) for n, ms in values(rows, "ms", op, variant, causal, mode, provider)
            if n in dense and ms > 0]


def _title(op, variant, causal, mode):
    """"dilated mode=longnet causal: fwd" (the API's mode) or "block-sparse layout=local: fwd"."""
    short = {"dilated_attention": "dilated", "block_sparse_attention": "block-sparse"}.get(op, op)
    kind = {"dilated_attention": "mode=", "block_sparse_attention": "layout="}.get(op, "")
    return f"{short} {kind}{variant}{' causal' if causal else ''}" + (f": {mode}" if mode else "")


def _machine(rows, dtypes=None):
    """"<machine> (<dtypes>)" and the CPU note: the figure's provenance line. `dtypes`: what
    the parenthesis says instead of the rows' dtypes (a figure mixing rows of two dtypes says
    which is which)."""
    ms = sorted({r.get("machine", "") for r in rows if r.get("machine")})
    dt = dtypes or ", ".join(sorted({r.get("dtype", "") for r in rows if r.get("dtype")}))
    return f"{', '.join(ms)} ({dt})" + (f"\n{backend_note(rows)}" if backend_note(rows) else "")


def count_label(n) -> str:
    """A token count for a tick or note: 512, 4K, 1.5K, 128K, 1M (powers of 1024)."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{round(n / size, 2):g}{unit}"
    return f"{n:g}"


def _plain(y: float) -> str:
    """A log-axis tick as a plain number: 0.05, 2, 500, 10000 (never 1e+04)."""
    return f"{y:.0f}" if y >= 1000 else f"{y:.3g}"


def backend_note(rows) -> str:
    """What a CPU figure times (every CPU figure says it)."""
    if not on_cpu(rows):
        return ""
    if any(r["provider"] == "triton" for r in rows):
        return "CPU: 'triton' is Triton's interpreter, 'portable' the portable PyTorch backend; not GPU kernels"
    return "CPU: the portable PyTorch backend, not the Triton kernels"


def readable_log_axis(axis, suffix=""):
    """Plain-number ticks (1, 2, 5, 10, ... with `suffix`) on a log axis, more of them where
    the data spans less than a few of those; call after plotting."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    lo, hi = sorted(axis.get_view_interval())
    subs = (1.0, 2.0, 5.0)
    ticks = [m * 10 ** e for e in range(math.floor(math.log10(max(lo, 1e-300))), math.ceil(math.log10(hi)) + 1)
             for m in subs if lo <= m * 10 ** e <= hi] if lo > 0 else []
    if len(ticks) < 3:
        subs = tuple(float(i) for i in range(1, 10))
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda y, _: f"{_plain(y)}{suffix}"))
    axis.set_minor_formatter(NullFormatter())


def _grid(n_panels, ncols=2, w=4.6, h=3.3):
    from matplotlib.figure import Figure
    nrows = max(1, math.ceil(n_panels / ncols))
    fig = Figure(figsize=(w * ncols, h * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes


def _log2_x(ax, xs):
    ax.set_xscale("log", base=2)
    if xs:
        ax.set_xticks(sorted(set(xs)))
        ax.set_xticklabels([count_label(x) for x in sorted(set(xs))])
        ax.minorticks_off()


def figure(rows, kind: str):
    """One Figure for kind in {"time", "speedup", "tflops"}: a panel per (op, variant,
    causal, mode), a line per provider, N on the x axis."""
    keys = [(op, var, causal, mode) for op, var, causal in panel_keys(rows) for mode in PASSES]
    keys = [k for k in keys if any(r["pass"] == k[3] and r["op"] == k[0] and r["variant"] == k[1]
                                   and r["causal"] == k[2] and r["metric"] == "ms" for r in rows)]
    fig, axes = _grid(len(keys))
    unit, scale = ("GFLOP/s", 1e3) if on_cpu(rows) else ("TFLOP/s", 1.0)
    label = {"time": "median ms (log)", "speedup": "dense SDPA time / provider time (x)",
             "tflops": f"effective {unit}"}[kind]
    for ax, (op, var, causal, mode) in zip(axes, keys):
        xs, top = [], 0.0
        for p in _providers(rows):
            if kind == "speedup":
                if p == "sdpa_dense":
                    continue
                pts = speedups(rows, op, var, causal, mode, p)
                # the paired ratio's flag, else (older files: a ratio of medians) either median's
                flagged = busy(rows, "speedup_vs_dense", op, var, causal, mode, p) or \
                    busy(rows, "ms", op, var, causal, mode, p) | busy(rows, "ms", op, var, causal, mode, "sdpa_dense")
            else:
                metric = "ms" if kind == "time" else "tflops"
                pts = values(rows, metric, op, var, causal, mode, p)
                flagged = busy(rows, metric, op, var, causal, mode, p)
                if kind == "tflops":
                    pts = [(x, y * scale) for x, y in pts]
            if not pts:
                continue
            xs += [x for x, _ in pts]
            top = max(top, max(y for _, y in pts))
            ax.plot(*zip(*pts), label=p, **PROVIDER_STYLE.get(p, {}))
            mark_busy(ax, [(x, y) for x, y in pts if x in flagged])
        if kind == "tflops":
            _matmul_reference(ax, rows, op, scale, unit, top)
        if kind == "speedup":
            ax.axhline(1.0, color="grey", lw=0.8)
        _log2_x(ax, xs)
        if kind == "time":
            ax.set_yscale("log")
            readable_log_axis(ax.yaxis)
        ax.set_title(_title(op, var, causal, mode), fontsize=10)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(label)
        ax.grid(True, which="major", alpha=0.3)
        legend(ax, fontsize=7)
    title = {"time": "Time (lower is better)", "speedup": "Speedup over dense SDPA (> 1: faster than dense)",
             "tflops": f"Effective {unit} (computed pairs only; higher is better)"}[kind]
    fig.suptitle(f"{title} — {_machine(rows)}", fontsize=11)
    return fig


def _matmul_reference(ax, rows, op, scale, unit, top):
    """The matmul timed in the same run, as a dotted line: a reference, not a bound; where a
    provider's rate exceeds it the panel says so."""
    peaks = [r["matmul_peak_tflops"] for r in rows if r["op"] == op and r["metric"] == "tflops"
             and not math.isnan(r["matmul_peak_tflops"])]
    if not peaks:
        return
    n = 1024 if on_cpu(rows) else 8192
    ref = max(peaks) * scale
    ax.axhline(ref, color="grey", ls=":", lw=1, label=f"{n}x{n} matmul, same run")
    if top > ref:
        ax.text(0.02, 0.97, f"above the matmul line: it is a {n}x{n} matmul timed once\nin this run, "
                "a reference, not the machine's peak", transform=ax.transAxes, va="top", fontsize=6.5,
                color="dimgrey")


def sparsity_figure(rows):
    """Speedup over dense SDPA of the main provider against the fraction of (query, key)
    pairs skipped, one point per shape, one panel per mode."""
    fig, axes = _grid(2)
    main = next((p for p in MAIN_PROVIDERS if any(r["provider"] == p for r in rows)), None)
    for ax, mode in zip(axes, PASSES):
        groups = defaultdict(list)
        for op, var, causal in panel_keys(rows):
            dens = {r["N"]: r["density"] for r in rows if r["op"] == op and r["variant"] == var
                    and r["causal"] == causal and r["pass"] == mode and r["provider"] == main and r["metric"] == "ms"}
            flagged = (busy(rows, "speedup_vs_dense", op, var, causal, mode, main)
                       | busy(rows, "ms", op, var, causal, mode, main)) if main else set()
            for n, s in speedups(rows, op, var, causal, mode, main) if main else []:
                if n in dens and not math.isnan(dens[n]):
                    groups[(op, var, causal)].append((1 - dens[n], s, n, n in flagged))
        for (op, var, causal), pts in sorted(groups.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=_title(op, var, causal, ""))
            mark_busy(ax, [(x, y) for x, y, _, flag in pts if flag])
            for x, y, n, _ in pts:
                ax.annotate(count_label(n), (x, y), fontsize=6, xytext=(2, 2),
                            textcoords="offset points")
        xs = [p[0] for pts in groups.values() for p in pts]
        if xs:
            grid = [min(xs) + (max(xs) - min(xs)) * i / 50 for i in range(51)]
            ax.plot(grid, [1 / (1 - x) for x in grid], color="grey", ls=":", lw=1, label="ideal 1 / (1 - sparsity)")
        ax.set_yscale("log")
        ax.axhline(1.0, color="grey", lw=0.8)
        readable_log_axis(ax.yaxis, "x")
        ax.set_xlabel("sparsity (fraction of pairs skipped vs dense)")
        ax.set_ylabel(f"dense time / {main} time (log; > 1: faster)")
        ax.set_title(f"pass: {mode}", fontsize=10)
        ax.grid(True, alpha=0.3)
        legend(ax, fontsize=7)
    fig.suptitle(f"Speedup vs sparsity — {_machine(rows)}", fontsize=11)
    return fig


def ring_figure(rows):
    """Time and per-rank peak memory against world size, a line per (variant, comm, mode)."""
    rows = [r for r in rows if r["op"] == "ring_attention"]
    fig, axes = _grid(2)
    for ax, metric in zip(axes, ("ms", "mem")):
        series = defaultdict(list)
        for r in rows:
            if (metric == "ms" and r["metric"] == "ms") or (metric == "mem" and r["metric"].startswith("peak_")):
                series[(r["variant"], r["provider"], r["pass"])].append((r["world_size"], r["value"]))
        for (var, prov, mode), pts in sorted(series.items()):
            pts.sort()
            ax.plot(*zip(*pts), marker="o", label=f"{var} {prov} {mode}")
        ax.set_xlabel("world size P")
        ax.set_ylabel("median ms (slowest rank)" if metric == "ms" else "peak MiB per rank")
        ax.set_xscale("log", base=2)
        ps = sorted({r["world_size"] for r in rows})
        if ps:
            ax.set_xticks(ps)
            ax.set_xticklabels([str(p) for p in ps])
            ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    # one legend for both panels (the same series), below them: inside, it covered the points
    entries = {}
    for ax in axes[:2]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncols=min(4, len(entries)),
                   fontsize=7)
    n = sorted({r["N"] for r in rows})
    fig.suptitle(f"Ring attention, N = {', '.join(map(str, n))} — {_machine(rows)}", fontsize=11)
    return fig


DECODE_STYLE = {
    "dilated": dict(color="tab:blue", marker="s", label="dilated, full cache"),
    "dilated_kvcache": dict(color="tab:green", marker="^", label="dilated, with_kvcache (no host sync)"),
    "dilated_kvcache_paged": dict(color="tab:olive", marker="v", label="dilated, with_kvcache, paged"),
    "dilated_kvcache_fp8": dict(color="tab:purple", marker="D", label="dilated, with_kvcache, FP8 cache"),
    "dilated_kvcache_graph": dict(color="tab:red", marker="*", label="dilated, with_kvcache, CUDA graph"),
    "dilated_bounded": dict(color="tab:orange", marker="o", label="dilated, bounded cache (DilatedKVCache)"),
    "sdpa_dense": dict(color="black", marker="x", linestyle="--", label="dense SDPA, full cache"),
    "full_cache": dict(color="black", marker="x", linestyle="--", label="full cache"),
}


def decode_figure(rows):
    """`perf decode` rows: time per decode step against the context, a line per provider, and
    the cache's memory per layer (bounded against full) against the context; the smallest batch
    size's rows (perf decode --batch)."""
    from .decode import OP
    rows = [r for r in rows if r["op"] == OP]
    batches = {int(r["B"]) for r in rows if not (isinstance(r["B"], float) and math.isnan(r["B"])) and r["B"] != ""}
    if len(batches) > 1:
        rows = [r for r in rows if r["B"] == "" or int(r["B"]) == min(batches)]
    fig, axes = _grid(2)
    panels = ((axes[0], "ms", "median ms per decode step (log)", "Time per token (lower is better)"),
              (axes[1], "cache_mib", "KV cache per layer, MiB (log)", "Cache memory per layer (keys + values)"))
    for ax, metric, ylabel, title in panels:
        xs = []
        for prov in DECODE_STYLE:
            pts = sorted((r["N"], r["value"]) for r in rows if r["metric"] == metric and r["provider"] == prov
                         and not math.isnan(r["value"]))
            if pts:
                xs += [x for x, _ in pts]
                ax.plot(*zip(*pts), **DECODE_STYLE[prov])
        if not xs:
            ax.set_visible(False)
            continue
        _log2_x(ax, xs)
        ax.set_yscale("log")
        readable_log_axis(ax.yaxis)
        ax.set_xlabel("context N (cached tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
    shapes = sorted({f"H={r['H']}, D={r['D']}" for r in rows if r["metric"] == "ms"})
    schedules = sorted({"LongNet schedule" if r["variant"] == "longnet" else
                        f"w={r['segment_lengths']}, r={r['dilation_rates']}" for r in rows})
    # the timed rows' dtype and the memory rows' (perf decode measures the cache at bfloat16)
    dtypes = [f"{what} {', '.join(sorted({r['dtype'] for r in rows if r['metric'] == metric and r['dtype']}))}"
              for what, metric in (("timed in", "ms"), ("cache memory in", "cache_mib"))
              if any(r["metric"] == metric and r["dtype"] for r in rows)]
    fig.suptitle(f"Decoding, {'; '.join(schedules)} ({'; '.join(shapes)}) — {_machine(rows, '; '.join(dtypes))}",
                 fontsize=11)
    return fig


SWEEP_PLOTS = ("time", "speedup", "tflops", "sparsity")   # the PNG kinds of a sweep CSV


def png_path(csv_path, kind: str, out_dir=None) -> str:
    """Where plot_csv writes the `kind` figure of `csv_path`: out_dir (default: the CSV's
    folder)/<CSV stem>-<kind>.png."""
    out_dir = out_dir or os.path.dirname(os.path.abspath(csv_path))
    return os.path.join(out_dir, f"{os.path.splitext(os.path.basename(csv_path))[0]}-{kind}.png")


def plot_csv(csv_path, out_dir=None):
    """Write the PNGs for one CSV; returns their paths (none for a CSV without benchmark or
    ring rows: layouts, tune). Raises results.ResultsFileError for a file that is not a
    result CSV."""
    rows = read_csv(csv_path)
    out_dir = out_dir or os.path.dirname(os.path.abspath(csv_path))
    os.makedirs(out_dir, exist_ok=True)
    written = []

    def save(fig, suffix):
        path = png_path(csv_path, suffix, out_dir)
        fig.savefig(path, dpi=100)
        written.append(path)

    if any(r["op"] == "ring_attention" for r in rows):
        save(ring_figure(rows), "ring")
    if any(r["op"] == "decode" for r in rows):
        save(decode_figure(rows), "decode")
    bench = [r for r in rows if r["op"] in BENCH_OPS]
    if bench:
        for kind in SWEEP_PLOTS[:3]:
            save(figure(bench, kind), kind)
        save(sparsity_figure(bench), SWEEP_PLOTS[3])
    return written


def plot_all(csv_paths=None, out_dir=None):
    paths = csv_paths or sorted(glob.glob(os.path.join(default_results_dir(), "*.csv")))
    written = []
    for p in paths:
        written += plot_csv(p, out_dir)
    return written


# ----------------------------------------------------------------------------- patterns

def dilated_multiplicity(n, segment_lengths, dilation_rates, num_heads, *, causal=False, mode="longnet",
                         offsets="modulo"):
    """(H, N, N) int array: how many of head h's patterns select the pair (query p, key p')
    (ops.dilated.naive.dilated_multiplicity as numpy). Small N only."""
    from ..ops.dilated.naive import dilated_multiplicity as counts
    return counts(n, segment_lengths, dilation_rates, num_heads, causal=causal, mode=mode,
                  offsets=offsets).long().numpy()
