"""Result rows of the perf tools (DESIGN §11): the CSV columns, provenance, writing and
reading CSVs, and the summary table.

Rows are long-format, one per (op, provider, pass, shape, metric); every row carries every
column of `COLUMNS` (empty where it does not apply). The columns that keep a reader from
being misled:

  pass         "fwd" (forward, no autograd) or "fwd_bwd" (forward and the backward for dQ, dK,
               dV); tune rows: "fwd"/"bwd". The API's own `mode` ("longnet", "head_groups")
               is `attn_mode` (and `variant`). Files written before the rename call it `mode`:
               read_csv reads either.
  spread_pct   the interquartile range of the timed rounds as % of their median (ms rows and
               the metrics derived from them); for speedup_vs_dense, of the per-round ratios
  rounds       how many timed rounds the median is over
  other_cores  CPU time other processes took while this was timed, in cores (CPU runs)
  flags        ";"-separated: FLAG_SPREAD, FLAG_BWD, FLAG_BUSY (see below): do not read such a
               row without its flag
"""
from __future__ import annotations

import csv
import datetime
import functools
import math
import os
import platform
import re
import subprocess

import torch

COLUMNS = ["op", "variant", "provider", "pass", "B", "N", "H", "Hkv", "D", "dtype", "causal", "attn_mode",
           "segment_lengths", "dilation_rates", "layout", "block_size", "world_size", "density", "gflop",
           "metric", "value", "spread_pct", "rounds", "flags", "other_cores", "config", "matmul_peak_tflops",
           "machine", "arch", "device", "torch", "triton", "cuda", "git_sha", "timestamp"]
# ms (median), tflops (effective: computed pairs only), pct_matmul_peak (% of the matmul
# reference), peak_mem_mib (GPU), speedup_vs_dense (dense SDPA ms / provider ms, per round),
# efficiency (speedup_vs_dense x density: 1.0 = the sparsity fully turned into speed)
METRICS = ("ms", "tflops", "pct_matmul_peak", "peak_mem_mib", "speedup_vs_dense", "efficiency")
PASSES = ("fwd", "fwd_bwd")
REQUIRED = ("op", "provider", "metric", "value")    # and `pass` (or the old `mode`)
BENCH_OPS = ("dilated_attention", "block_sparse_attention", "indexed_attention")

SPREAD_LIMIT_PCT = 10.0    # an IQR above 10% of the median: the rounds disagree
BUSY_LIMIT_CORES = 0.25    # other processes took more than a quarter core while it was timed
FLAG_SPREAD = "spread>10%"
FLAG_BWD = "fwd_bwd<fwd"   # forward+backward measured faster than the forward alone
FLAG_BUSY = "busy"


class ResultsFileError(ValueError):
    """A path that is not a readable result CSV (missing, empty, or of another kind)."""


def sig(x: float, digits: int = 6) -> float:
    """x rounded to `digits` significant digits (CSV values)."""
    return float(f"{x:.{digits}g}")


def make_row(**fields) -> dict:
    if "mode" in fields and "pass" not in fields:    # the old keyword
        fields["pass"] = fields.pop("mode")
    unknown = set(fields) - set(COLUMNS)
    if unknown:
        raise TypeError(f"make_row: unknown columns {sorted(unknown)}; the columns are {COLUMNS}")
    if isinstance(fields.get("flags"), (list, tuple)):
        fields["flags"] = ";".join(fields["flags"])
    return {c: fields.get(c, "") for c in COLUMNS}


# ----------------------------------------------------------------------------- provenance

@functools.lru_cache(maxsize=None)
def git_sha() -> str:
    if os.environ.get("TRITON_DILATED_GIT_SHA"):
        return os.environ["TRITON_DILATED_GIT_SHA"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True,  # noqa: E731
                                        timeout=5).stdout.strip()
        sha = run("rev-parse", "--short", "HEAD")
        if not sha:
            return "unknown"
        dirty = run("status", "--porcelain", "--untracked-files=no", "--", "triton_dilated")
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def _triton_version() -> str:
    from importlib import metadata
    try:
        return metadata.version("triton")     # without importing triton
    except metadata.PackageNotFoundError:
        return "none"


def provenance(device: str | None = None) -> dict:
    """Machine, arch, versions, git sha and a UTC timestamp for every row."""
    from ..ops.common.hardware import get_arch
    from ..ops.common.runtime import resolve_backend
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        arch = get_arch(torch.cuda.current_device())
        machine, arch_name = arch.device_name, arch.name
    else:
        machine = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        interp = resolve_backend("auto", torch.device("cpu")) == "triton"
        arch_name = "cpu-interpreter" if interp else "cpu"
    return dict(machine=machine, arch=arch_name, device=device, torch=torch.__version__, triton=_triton_version(),
                cuda=torch.version.cuda or "", git_sha=git_sha(),
                timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


# ----------------------------------------------------------------------------- CSV

class CsvSink:
    """Writes rows as they come (a sweep cut short by a timeout still leaves its rows)."""

    def __init__(self, path: str | None):
        self.path = path
        self._f = None
        self._w = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._f = open(path, "w", newline="")
            self._w = csv.DictWriter(self._f, fieldnames=COLUMNS)
            self._w.writeheader()
            self._f.flush()

    def write(self, rows):
        if self._w is not None:
            self._w.writerows(rows)
            self._f.flush()

    def close(self):
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def card_name(machine: str) -> str:
    """A file name for the machine that measured: "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3",
    "AMD Instinct MI300X" -> "instinct-mi300x", "cpu (x86_64, 2 cores)" -> "cpu" (as
    perf/results/<card>.csv names the committed runs)."""
    name = str(machine or "").strip().lower()
    if not name or name.startswith("cpu"):
        return "cpu"
    for vendor in ("nvidia ", "amd "):
        if name.startswith(vendor):
            name = name[len(vendor):]
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown-gpu"


def write_csv(rows, path):
    with CsvSink(path) as sink:
        sink.write([make_row(**{k: v for k, v in r.items() if k in COLUMNS or k == "mode"}) for r in rows])


def _float(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def read_csv(paths):
    """Rows of one or more result CSVs as dicts; `value` and the numeric shape columns
    converted (missing columns of older files come back empty; their `mode` is `pass`).
    Raises ResultsFileError for a missing or empty file or a CSV of another kind."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = []
    for p in paths:
        try:
            f = open(p, newline="")
        except FileNotFoundError:
            raise ResultsFileError(f"{p}: no such file") from None
        except OSError as exc:
            raise ResultsFileError(f"{p}: cannot be read ({exc.strerror or exc})") from None
        with f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            if not header:
                raise ResultsFileError(f"{p}: empty, not a result CSV")
            missing = [c for c in REQUIRED if c not in header] + ([] if {"pass", "mode"} & set(header) else ["pass"])
            if missing:
                raise ResultsFileError(f"{p}: not a triton_dilated.perf result CSV (no column {', '.join(missing)}; "
                                       f"its columns: {', '.join(header[:8])}{' ...' if len(header) > 8 else ''})")
            for r in reader:
                row = {c: r.get(c, "") or "" for c in COLUMNS}
                row.update({k: v for k, v in r.items() if k not in row and k is not None})
                if not row["pass"]:
                    row["pass"] = r.get("mode", "") or ""
                for k in ("B", "N", "H", "Hkv", "D", "block_size", "world_size", "rounds"):
                    if row.get(k) not in ("", None):
                        row[k] = int(float(row[k]))
                for k in ("value", "density", "gflop", "matmul_peak_tflops", "spread_pct", "other_cores"):
                    row[k] = _float(row[k])
                row["causal"] = str(row.get("causal")) == "True"
                if not row.get("variant"):
                    row["variant"] = row.get("attn_mode") or row.get("layout") or ""
                row["flags"] = [x for x in str(row.get("flags") or "").split(";") if x]
                row["source"] = os.path.basename(str(p))
                out.append(row)
    return out


# ----------------------------------------------------------------------------- table

SHORT = {"sdpa_dense": "dense", "head_group_loop": "loop"}
PROVIDER_ORDER = ["triton", "portable", "head_group_loop", "flex", "gather", "sdpa_dense"]


def main_provider_of(providers) -> str:
    """The provider the table's rates and speedups are about: triton, else portable."""
    return next((p for p in ("triton", "portable") if p in providers), sorted(providers)[0])


def pattern_label(row) -> str:
    """"mode=longnet" (the API's mode) or "layout=local" (the block layout's name)."""
    if row.get("attn_mode"):
        return f"mode={row['attn_mode']}"
    if row["op"] == "block_sparse_attention" or row.get("layout"):
        return f"layout={row['variant']}"
    return row["variant"]


def _flags(row):
    f = row.get("flags") or []
    return f.split(";") if isinstance(f, str) else list(f)


def on_cpu(rows) -> bool:
    return bool(rows) and all(r.get("device") == "cpu" for r in rows)


def summary_table(rows) -> str:
    """One line per (op, pattern, causal, N, pass): median ms and spread of every provider,
    then the main provider's effective rate, % of the matmul reference, its speedup over
    dense SDPA (from paired rounds where the CSV has them) and the flags; a legend says what
    each column means and which way is better."""
    ms = [r for r in rows if r["metric"] == "ms"]
    if not ms:
        return "no results"
    provs = [p for p in PROVIDER_ORDER if any(r["provider"] == p for r in ms)]
    provs += sorted({r["provider"] for r in ms} - set(provs))
    main = main_provider_of(provs)
    cpu = on_cpu(ms)
    unit, scale = ("GFLOP/s", 1e3) if cpu else ("TFLOP/s", 1.0)
    key = lambda r: (r["op"], pattern_label(r), str(r["causal"]), int(r["N"]), r["pass"])  # noqa: E731
    cell = {(key(r), r["provider"], r["metric"]): r for r in rows}
    groups = sorted({key(r) for r in ms}, key=lambda k: (k[0], k[1], k[2], k[3], PASSES.index(k[4])
                                                         if k[4] in PASSES else 9))
    vs = f"dense/{SHORT.get(main, main)}"
    head = f"{'op':22} {'pattern':17} {'causal':6} {'N':>7} {'pass':7}" + "".join(f" {p[:16]:>16}" for p in provs)
    head += f" | {SHORT.get(main, main) + ' ' + unit:>16} {'%matmul':>7} {vs:>14} {'eff':>5}  flags"
    paired = any(r.get("rounds") not in ("", None) for r in ms)
    title = ("median ms over interleaved rounds, ±: interquartile range in % of the median" if paired else
             f"median ms (a file without interleaved rounds: no spread; {vs} is a ratio of medians)")
    lines = [title, head, "-" * len(head)]
    for g in groups:
        line = f"{g[0]:22} {g[1][:17]:17} {g[2]:6} {g[3]:>7} {g[4]:7}"
        flags = {}
        for p in provs:
            r = cell.get((g, p, "ms"))
            if r is None:
                line += f" {'-':>16}"
                continue
            sp = r.get("spread_pct", float("nan"))
            txt = f"{r['value']:.3f}" + (f" ±{sp:.0f}%" if not math.isnan(_float(sp)) else "")
            line += f" {txt:>16}"
            for f in _flags(r):
                flags.setdefault(f, []).append(SHORT.get(p, p))
        tf, pk = cell.get((g, main, "tflops")), cell.get((g, main, "pct_matmul_peak"))
        line += f" | {tf['value'] * scale:>16.3f} {pk['value']:>7.1f}" if tf and pk else f" | {'-':>16} {'-':>7}"
        sp = cell.get((g, main, "speedup_vs_dense"))
        m, d = cell.get((g, main, "ms")), cell.get((g, "sdpa_dense", "ms"))
        speedup = float("nan")
        if sp is not None:
            s = sp.get("spread_pct", float("nan"))
            speedup = sp["value"]
            txt = f"{speedup:.2f}x" + (f" ±{s:.0f}%" if not math.isnan(_float(s)) else "")
            for f in _flags(sp):
                flags.setdefault(f, []).append(vs)
        elif m and d and m["value"] > 0:   # files without paired ratios: a ratio of medians
            speedup = d["value"] / m["value"]
            txt = f"{speedup:.2f}x"
        else:
            txt = "-"
        # efficiency: the CSV's, else (older files) the speedup shown times the density
        eff = cell.get((g, main, "efficiency"))
        eff = eff["value"] if eff else speedup * _float(m.get("density")) if m else float("nan")
        line += f" {txt:>14} {'-' if math.isnan(eff) else f'{eff:.2f}':>5}  " + "; ".join(
            f if f == FLAG_BUSY else f"{f} {','.join(dict.fromkeys(who))}" for f, who in sorted(flags.items()))
        lines.append(line.rstrip())
    lines += ["", *table_legend(main, unit, cpu, rows)]
    return "\n".join(lines)


def table_legend(main: str, unit: str, cpu: bool, rows) -> list:
    who = SHORT.get(main, main)
    peak = [r["matmul_peak_tflops"] for r in rows if not math.isnan(_float(r.get("matmul_peak_tflops")))]
    size = 1024 if cpu else 8192
    busy = [r["other_cores"] for r in rows if not math.isnan(_float(r.get("other_cores")))]
    lines = [
        "pattern: the API's mode (dilated_attention(mode=...)) or the block layout's name. "
        "pass: fwd = forward only (no autograd), fwd_bwd = forward + backward for dQ, dK, dV.",
        f"{who} {unit}: effective rate, counting only the (query, key) pairs the pattern computes "
        "(4*D FLOP per pair forward, 2.5x that backward); higher is better.",
        f"%matmul: that rate as % of a {size}x{size} matmul timed in the same run"
        + (f" ({max(peak) * (1e3 if cpu else 1):.3g} {unit})" if peak else "")
        + "; a reference, not a bound (over 100 is possible).",
        f"{vs_label(main)}: dense SDPA time / {who} time, the median of per-round ratios where measured in "
        f"paired rounds; > 1: {who} is faster than dense, < 1: slower.",
        "eff: efficiency, that speedup times the density (computed pairs / dense pairs): 1.0 = the sparsity fully "
        "turned into speed, below: time lost to gathers, masks and small tiles.",
        "pattern: indexed attention's topk=K is each query's K listed keys.",
        f"flags: {FLAG_SPREAD} = the rounds' interquartile range exceeds {SPREAD_LIMIT_PCT:.0f}% of the median; "
        f"{FLAG_BWD} = forward+backward timed faster than the forward alone (impossible on a quiet machine); "
        f"{FLAG_BUSY} = other processes took more than {BUSY_LIMIT_CORES} cores while it was timed. "
        "A flagged number is not a measurement of the code alone.",
    ]
    if cpu:
        lines.append("CPU: the portable PyTorch backend (and the baselines), not the Triton kernels"
                     + (f"; other processes took up to {max(busy):.2f} cores during the sweep." if busy else "."))
    return lines


def busy_hint(rows, threads: int | None = None) -> str:
    """One line for a run with rows flagged FLAG_BUSY (other processes took CPU while they were
    timed): what happened and what to do; "" when no row is flagged."""
    key = lambda r: (r["op"], r.get("variant"), str(r.get("causal")), r.get("N"))  # noqa: E731
    cases = {key(r) for r in rows if r.get("metric") == "ms"}
    busy = {key(r) for r in rows if r.get("metric") == "ms" and FLAG_BUSY in _flags(r)}
    if not busy:
        return ""
    load = [_float(r.get("other_cores")) for r in rows]
    load = max((x for x in load if not math.isnan(x)), default=float("nan"))
    ran = ""
    if threads:
        omp = [f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
               if os.environ.get(k)]
        ran = f" (this run: {threads} torch threads on {os.cpu_count()} cores{', ' if omp else ''}{', '.join(omp)})"
    return (f"{FLAG_BUSY}: {len(busy)} of {len(cases)} cases were timed while other processes took CPU"
            + ("" if math.isnan(load) else f" (up to {load:.2f} cores)")
            + ": those numbers measure the contention (often several times slower), not the code. Rerun on a quiet "
            "machine; on a shared one, let idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE, which ./dev perf "
            f"sets unless you chose) or use fewer threads than idle cores (OMP_NUM_THREADS=1){ran}.")


def vs_label(main: str) -> str:
    return f"dense/{SHORT.get(main, main)}"


def print_table(rows):
    print()
    print(summary_table(rows))


__all__ = ["COLUMNS", "METRICS", "PASSES", "ResultsFileError", "sig", "make_row", "git_sha", "provenance",
           "CsvSink", "write_csv", "read_csv", "summary_table", "print_table", "busy_hint", "pattern_label",
           "main_provider_of", "SPREAD_LIMIT_PCT", "BUSY_LIMIT_CORES", "FLAG_SPREAD", "FLAG_BWD", "FLAG_BUSY"]
