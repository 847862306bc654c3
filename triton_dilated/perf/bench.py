"""Sweep definitions, timing and CSV/table output for `python -m triton_dilated.perf`
(DESIGN §11).

A `Case` is one (op, variant, shape); each case is timed for every provider that can run it
(the Triton kernels or the portable backend, dense SDPA, the head-group loop, FlexAttention)
in two modes, "fwd" (no autograd) and "fwd_bwd" (forward plus the backward for dQ, dK, dV).
Results are long-format rows, one per (op, provider, mode, shape, metric), with provenance;
`COLUMNS` is the fixed column list every row carries.
"""
from __future__ import annotations

import csv
import datetime
import functools
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace

import torch

from ..configs import load_arch_table, select_config, tuned_entry
from ..ops.common.hardware import device_arch, get_arch, padded_head_dim
from ..ops.common.runtime import resolve_backend
from ..ops.dilated.patterns import head_offsets
from ..ops.dilated.spec import LONGNET_R, LONGNET_W
from .baselines import flex_available, flex_block_sparse, head_group_loop, sdpa_dense

OPS = ("dilated", "block_sparse")
OP_NAMES = {"dilated": "dilated_attention", "block_sparse": "block_sparse_attention"}
MODES = ("fwd", "fwd_bwd")
BWD_FLOP_FACTOR = 2.5        # backward = 2.5x forward (DESIGN §11): fwd_bwd counts 3.5x

# every row carries every column (empty where it does not apply)
COLUMNS = ["op", "variant", "provider", "mode", "B", "N", "H", "Hkv", "D", "dtype", "causal", "attn_mode",
           "segment_lengths", "dilation_rates", "layout", "block_size", "world_size", "density", "gflop",
           "metric", "value", "config", "matmul_peak_tflops", "machine", "arch", "device", "torch", "triton",
           "cuda", "git_sha", "timestamp"]
METRICS = ("ms", "tflops", "pct_matmul_peak", "peak_mem_mib")

CPU_NOTE = ("No CUDA GPU found: timing the portable PyTorch backend against the baselines on the CPU. "
            "These are not Triton kernel timings: those need a GPU (run perf/gpu_check.sh OUTDIR there).")


@dataclass(frozen=True)
class Case:
    op: str                  # "dilated" | "block_sparse"
    variant: str             # dilated: the mode ("longnet", "head_groups"); block-sparse: the layout name
    B: int
    N: int
    H: int
    D: int
    causal: bool
    dtype: torch.dtype
    device: str
    ws: tuple = ()           # dilated: segment lengths
    rs: tuple = ()           # dilated: dilation rates
    layout: tuple = ()       # block-sparse: (builder name, ((kwarg, value), ...))
    block_size: int = 128
    Hkv: int = 0             # 0: same as H

    @property
    def kv_heads(self) -> int:
        return self.Hkv or self.H

    @property
    def layout_label(self) -> str:
        if not self.layout:
            return ""
        name, kw = self.layout
        args = ",".join(f"{k}={'/'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in kw)
        return f"{name}({args})"


# ----------------------------------------------------------------------------- sweeps

def _dilated_cases(ns, H, D, dtype, device, ws_full, rs, hg_ws, hg_rs, causals, B=1):
    cases = []
    for n in ns:
        for causal in causals:
            ws = tuple(min(w, n) for w in ws_full)
            cases.append(Case("dilated", "longnet", B, n, H, D, causal, dtype, device, ws, tuple(rs)))
            hws = tuple(min(w, n) for w in hg_ws)
            cases.append(Case("dilated", "head_groups", B, n, H, D, causal, dtype, device, hws, tuple(hg_rs)))
    return cases


def _block_sparse_cases(ns, H, D, dtype, device, layouts_, causals, block_size, B=1):
    return [Case("block_sparse", name, B, n, H, D, causal, dtype, device, layout=(name, kw), block_size=block_size)
            for n in ns for causal in causals for name, kw in layouts_]


GPU_LAYOUTS = (("local", (("window", 4),)),
               ("bigbird", (("window", 1), ("num_global_blocks", 1), ("num_random", 3))))
CPU_LAYOUTS = (("local", (("window", 2),)),
               ("bigbird", (("window", 1), ("num_global_blocks", 1), ("num_random", 2))))


def gpu_seqlens(quick: bool = False):
    """Sequence lengths for the GPU sweep, capped by what the card's memory holds
    comfortably (the portable backend and the head-group loop keep O(N) fp32 partials)."""
    if quick:
        return [4096]
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2 ** 30
    ns = [8192, 16384, 32768]
    if total >= 40:
        ns.append(65536)
    return ns


def default_sweep(quick: bool = False, seqlens=None, ops=OPS, device=None):
    """The default sweep on the machine it finds (DESIGN §11).

    GPU: bfloat16, B=1, H=16, D=128; dilated with the LongNet schedule w=(2048 .. 32768),
    r=(1, 2, 4, 6, 12) (clipped to N), and head_groups with its first four patterns (H=16
    splits into 4 groups, which the head-group loop needs); block-sparse local(window=4) and
    BigBird at block 128; causal and not (block-sparse causal only).
    CPU: float32, B=1, H=6, D=64, patterns w=(512, 1024, 2048), r=(1, 2, 4), causal; block
    layouts at block 128; N = 1024, 2048, 4096 (a few minutes on 2 cores).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cases = []
    if device == "cuda":
        ns = seqlens or gpu_seqlens(quick)
        causals = (True,) if quick else (False, True)
        if "dilated" in ops:
            cases += _dilated_cases(ns, 16, 128, torch.bfloat16, device, LONGNET_W, LONGNET_R, LONGNET_W[:4],
                                    LONGNET_R[:4], causals)
        if "block_sparse" in ops:
            cases += _block_sparse_cases(ns, 16, 128, torch.bfloat16, device, GPU_LAYOUTS, (True,), 128)
        return cases
    ns = seqlens or ([1024] if quick else [1024, 2048, 4096])
    if "dilated" in ops:
        cases += _dilated_cases(ns, 6, 64, torch.float32, device, (512, 1024, 2048), (1, 2, 4), (512, 1024, 2048),
                                (1, 2, 4), (True,))
    if "block_sparse" in ops:
        bs = 128 if min(ns) >= 512 else 32
        cases += _block_sparse_cases(ns, 6, 64, torch.float32, device, CPU_LAYOUTS, (True,), bs)
    return cases


def tiny_sweep(device="cpu", n=128):
    """One tiny case per op (tests, `--quick` under the interpreter)."""
    return [Case("dilated", "head_groups", 1, n, 2, 16, True, torch.float32, device, (n // 2, n), (1, 2)),
            Case("block_sparse", "local", 1, n, 2, 16, True, torch.float32, device,
                 layout=("local", (("window", 1),)), block_size=32)]


# ----------------------------------------------------------------------------- work counts

def dilated_pairs(case: Case) -> int:
    """(query, key) pairs the dilated patterns compute, summed over batch, heads and
    patterns (a key two patterns select counts twice: both are computed)."""
    table = head_offsets(case.H, tuple(zip(case.ws, case.rs)), case.variant, "modulo")
    per_offset = {}
    total = 0
    for row in table:
        for (w, r), o in zip(zip(case.ws, case.rs), row):
            if o < 0:
                continue
            if (w, r, o) not in per_offset:
                count = 0
                for s in range(0, case.N, w):
                    L = len(range(s + o, min(s + w, case.N), r))
                    count += L * (L + 1) // 2 if case.causal else L * L
                per_offset[(w, r, o)] = count
            total += per_offset[(w, r, o)]
    return total * case.B


def layout_pairs(layout, B: int, H: int, N: int, causal: bool) -> int:
    """(query, key) pairs a block layout computes at sequence length N: every element of
    its active blocks (clipped to N), only p' <= p when causal."""
    _, _, r, c = layout.pairs()
    bs = layout.block_size
    r, c = r.long(), c.long()
    rows = (N - r * bs).clamp(max=bs)
    cols = (N - c * bs).clamp(max=bs)
    if causal:
        cnt = torch.where(r > c, rows * cols, torch.where(r == c, rows * (rows + 1) // 2, torch.zeros_like(rows)))
    else:
        cnt = rows * cols
    lb, lh = layout.kv_num_blocks.shape[:2]
    return int(cnt.sum()) * (B // lb) * (H // lh)


def dense_pairs(B: int, H: int, N: int, causal: bool) -> int:
    return B * H * (N * (N + 1) // 2 if causal else N * N)


def flops(pairs: int, D: int, mode: str) -> float:
    """Forward 4*D per (query, key) pair (QK^T and PV); backward 2.5x forward."""
    return 4.0 * D * pairs * (1.0 + BWD_FLOP_FACTOR if mode == "fwd_bwd" else 1.0)


@functools.lru_cache(maxsize=32)
def build_layout(case: Case):
    from .. import layouts
    name, kw = case.layout
    kw = dict(kw)
    fn = getattr(layouts, name)
    if name == "dilated":
        return fn(case.N, kw.pop("segment_lengths"), kw.pop("dilation_rates"), case.block_size, num_heads=case.H,
                  causal=case.causal, **kw)
    if name in ("random", "bigbird"):
        kw.setdefault("num_heads", case.H)
    return fn(case.N, case.block_size, causal=case.causal, **kw)


# ----------------------------------------------------------------------------- timing

def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


@dataclass
class Timing:
    """How long to time each measurement: `warmup` calls, then repeat until `budget_s` has
    passed with at least `min_reps` calls, or `max_s` has passed (at least one call), or
    `max_reps` calls."""
    warmup: int = 2
    budget_s: float = 0.3
    min_reps: int = 5
    max_reps: int = 100
    max_s: float = 3.0

    @classmethod
    def for_device(cls, device: str, budget_s: float | None = None):
        if device == "cuda":
            t = cls(warmup=2, budget_s=0.2, min_reps=5, max_reps=50, max_s=2.0)
        else:
            t = cls(warmup=1, budget_s=1.5, min_reps=5, max_reps=30, max_s=8.0)
        return replace(t, budget_s=budget_s) if budget_s is not None else t


def median_ms(fn, device, timing: Timing | None = None):
    """Median wall time of fn() in ms (GPU: synchronised around each call)."""
    timing = timing or Timing.for_device(device)
    for _ in range(timing.warmup):
        fn()
    _sync(device)
    times = []
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        now = time.perf_counter()
        times.append((now - t0) * 1e3)
        elapsed = now - start
        if len(times) >= timing.max_reps or elapsed >= timing.max_s \
                or (elapsed >= timing.budget_s and len(times) >= timing.min_reps):
            break
    return statistics.median(times)


@functools.lru_cache(maxsize=None)
def matmul_peak_tflops(device: str, dtype: torch.dtype) -> float:
    """A large square matmul measured in this run: the reachable matmul peak of the machine
    for this dtype (the denominator of pct_matmul_peak)."""
    n = 8192 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = median_ms(lambda: a @ b, device, Timing(warmup=2, budget_s=0.2, min_reps=5, max_reps=20, max_s=2.0))
    return 2 * n ** 3 / ms / 1e9


# ----------------------------------------------------------------------------- providers

def main_provider(device: str) -> str:
    """"triton" where the kernels run (a GPU, or the CPU under TRITON_INTERPRET=1), else
    "portable"."""
    return "triton" if resolve_backend("auto", torch.device(device)) == "triton" else "portable"


def _config_label(kernel: str, case: Case) -> str:
    block_d = padded_head_dim(case.D)
    dev = torch.device(case.device)
    cfg = select_config(kernel, case.dtype, block_d, case.N, dev)
    if dev.type != "cuda":
        source = "interpreter"
    else:
        arch = device_arch(dev)
        _, source = tuned_entry(kernel, case.dtype, block_d, case.N, arch.name)
        if source == f"{arch.name}.json":
            source += " tuned" if load_arch_table(arch.name).get("tuned") else " untuned"
    body = " ".join(f"{k}={v}" for k, v in cfg.items())
    return f"{kernel}: {body} [{source}]"


def provider_config(case: Case, provider: str, mode: str) -> str:
    if provider == "triton":
        kernels = [f"{case.op}_fwd"] + ([f"{case.op}_bwd"] if mode == "fwd_bwd" else [])
        return "; ".join(_config_label(k, case) for k in kernels)
    if provider == "flex":
        return "torch.compile(flex_attention)" if case.device == "cuda" else "flex_attention (eager)"
    return ""


def providers(case: Case, flex: bool | None = None, only=None):
    """{name: fn(q, k, v) -> out} for every provider that can run this case; inputs
    (B, N, H, D)."""
    from ..ops.block_sparse import block_sparse_attention
    from ..ops.dilated import dilated_attention
    main = main_provider(case.device)
    provs = {}
    if case.op == "dilated":
        ws, rs = list(case.ws), list(case.rs)
        kw = dict(causal=case.causal, mode=case.variant)
        provs[main] = lambda q, k, v: dilated_attention(q, k, v, ws, rs, backend="auto", **kw)
        if main == "triton":
            provs["portable"] = lambda q, k, v: dilated_attention(q, k, v, ws, rs, backend="torch", **kw)
        if case.variant == "head_groups" and case.H % len(ws) == 0 and case.kv_heads == case.H \
                and all(case.N % w == 0 for w in ws):
            provs["head_group_loop"] = lambda q, k, v: head_group_loop(q, k, v, ws, rs, case.causal)
    else:
        layout = build_layout(case).to(case.device)     # moved once, not inside every timed call
        provs[main] = lambda q, k, v: block_sparse_attention(q, k, v, layout, causal=case.causal, backend="auto")
        if main == "triton":
            provs["portable"] = lambda q, k, v: block_sparse_attention(q, k, v, layout, causal=case.causal,
                                                                       backend="torch")
        if flex is None:
            flex = case.device == "cuda"
        if flex and flex_available():
            provs["flex"] = flex_block_sparse(layout, case.N, case.causal, torch.device(case.device),
                                              compiled=case.device == "cuda")
    provs["sdpa_dense"] = lambda q, k, v: sdpa_dense(q, k, v, case.causal)
    if only:
        provs = {k: v for k, v in provs.items() if k in only}
    return provs


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


def provenance(device: str | None = None) -> dict:
    """Machine, arch, versions, git sha and a UTC timestamp for every row."""
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = "none"
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        arch = get_arch(torch.cuda.current_device())
        machine, arch_name = arch.device_name, arch.name
    else:
        machine = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        arch_name = "cpu-interpreter" if main_provider("cpu") == "triton" else "cpu"
    return dict(machine=machine, arch=arch_name, device=device, torch=torch.__version__, triton=triton_version,
                cuda=torch.version.cuda or "", git_sha=git_sha(),
                timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def case_fields(case: Case) -> dict:
    return dict(op=OP_NAMES[case.op], variant=case.variant, B=case.B, N=case.N, H=case.H, Hkv=case.kv_heads,
                D=case.D, dtype=str(case.dtype).removeprefix("torch."), causal=case.causal,
                attn_mode=case.variant if case.op == "dilated" else "",
                segment_lengths="/".join(map(str, case.ws)), dilation_rates="/".join(map(str, case.rs)),
                layout=case.layout_label, block_size=case.block_size if case.op == "block_sparse" else "")


def sig(x: float, digits: int = 6) -> float:
    """x rounded to `digits` significant digits (CSV values)."""
    return float(f"{x:.{digits}g}")


def make_row(**fields) -> dict:
    return {c: fields.get(c, "") for c in COLUMNS}


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


def write_csv(rows, path):
    with CsvSink(path) as sink:
        sink.write([make_row(**r) for r in rows])


def read_csv(paths):
    """Rows of one or more result CSVs as dicts; `value` and the numeric shape columns
    converted (missing columns of older files come back empty)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = []
    for p in paths:
        with open(p, newline="") as f:
            for r in csv.DictReader(f):
                row = {c: r.get(c, "") for c in COLUMNS}
                row.update({k: v for k, v in r.items() if k not in row})
                for k in ("B", "N", "H", "Hkv", "D", "block_size", "world_size"):
                    if row.get(k) not in ("", None):
                        row[k] = int(float(row[k]))
                for k in ("value", "density", "gflop", "matmul_peak_tflops"):
                    try:
                        row[k] = float(row[k])
                    except (TypeError, ValueError):
                        row[k] = float("nan")
                row["causal"] = str(row.get("causal")) == "True"
                if not row.get("variant"):
                    row["variant"] = row.get("attn_mode") or row.get("layout") or ""
                row["source"] = os.path.basename(str(p))
                out.append(row)
    return out


# ----------------------------------------------------------------------------- the sweep

class _Progress:
    """tqdm bar on a terminal; one line per measurement otherwise (logs)."""

    def __init__(self, total, desc):
        self.bar = None
        self.total, self.i = total, 0
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, label, result):
        self.i += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label[-60:], refresh=False)
            self.bar.update(1)
        else:
            print(f"[{self.i}/{self.total}] {label}: {result}", flush=True)

    def write(self, msg):
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def random_tensors(shapes, device, dtype, seed=0, requires_grad=False):
    """Seeded standard-normal tensors drawn on `device` (drawing 0.5 GB on the CPU and
    copying would cost more than the benchmark)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(*s, generator=gen, device=device, dtype=torch.float32).to(dtype)
            .requires_grad_(requires_grad) for s in shapes]


def _inputs(case: Case, requires_grad: bool):
    q_shape, kv_shape = (case.B, case.N, case.H, case.D), (case.B, case.N, case.kv_heads, case.D)
    return random_tensors([q_shape, kv_shape, kv_shape], case.device, case.dtype, requires_grad=requires_grad)


def measure(case: Case, fn, mode: str, timing: Timing):
    """(median ms, peak MiB or nan) of one provider in one mode."""
    q, k, v = _inputs(case, mode == "fwd_bwd")
    if mode == "fwd":
        def call():
            with torch.no_grad():
                fn(q, k, v)
    else:
        grad = torch.randn_like(q)

        def call():
            out = fn(q, k, v)
            torch.autograd.grad(out, (q, k, v), grad)
    ms = median_ms(call, case.device, timing)
    mem = float("nan")
    if case.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        call()
        torch.cuda.synchronize()
        mem = torch.cuda.max_memory_allocated() / 2 ** 20
    return ms, mem


def run_sweep(cases, out=None, timing: Timing | None = None, flex=None, only=None, quiet=False):
    """Time every (case, provider, mode); return the rows (and stream them to `out`, a CSV
    path, as they come). Dense SDPA is timed once per shape and reused across variants.
    FlexAttention runs last (compiling it is slow), so a cut-short sweep keeps the rest."""
    if not cases:
        return []
    device = cases[0].device
    log = (lambda *a: None) if quiet else print
    if device != "cuda":
        log(CPU_NOTE)
        if hasattr(os, "getloadavg"):
            log(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores "
                "(other work on the machine distorts CPU timings)")
        if main_provider(device) == "triton":
            log("TRITON_INTERPRET=1: the 'triton' rows time Triton's interpreter, not a kernel.")
    prov = provenance(device)
    timing = timing or Timing.for_device(device)
    work = []
    for case in cases:
        for name, fn in providers(case, flex=flex, only=only).items():
            for mode in MODES:
                work.append((case, name, fn, mode))
    flex_last = [w for w in work if w[1] == "flex"]
    work = [w for w in work if w[1] != "flex"] + sorted(flex_last, key=lambda w: w[0].N)
    peaks = {}
    dense_cache = {}
    rows = []
    bar = _Progress(len(work), "benchmark") if not quiet else None
    with CsvSink(out) as sink:
        for case, name, fn, mode in work:
            label = f"{case.op} {case.variant} N={case.N} causal={case.causal} {name} {mode}"
            dense_key = (case.B, case.N, case.H, case.kv_heads, case.D, case.causal, case.dtype, mode)
            try:
                if name == "sdpa_dense" and dense_key in dense_cache:
                    ms, mem = dense_cache[dense_key]
                else:
                    ms, mem = measure(case, fn, mode, timing)
                    if name == "sdpa_dense":
                        dense_cache[dense_key] = (ms, mem)
            except Exception as exc:  # a provider that cannot run this shape is reported, not fatal
                msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                if bar:
                    bar.step(label, f"skipped ({msg})")
                    bar.write(f"  skipped {label}: {msg}")
                if case.device == "cuda":
                    torch.cuda.empty_cache()
                continue
            if (case.device, case.dtype) not in peaks:
                peaks[(case.device, case.dtype)] = matmul_peak_tflops(case.device, case.dtype)
            peak = peaks[(case.device, case.dtype)]
            if name == "sdpa_dense":
                pairs = dense_pairs(case.B, case.H, case.N, case.causal)
            elif case.op == "dilated":
                pairs = dilated_pairs(case)
            else:
                pairs = layout_pairs(build_layout(case), case.B, case.H, case.N, case.causal)
            density = pairs / dense_pairs(case.B, case.H, case.N, case.causal)
            fl = flops(pairs, case.D, mode)
            tflops = fl / ms / 1e9
            metrics = [("ms", ms), ("tflops", tflops), ("pct_matmul_peak", 100 * tflops / peak)]
            if not math.isnan(mem):
                metrics.append(("peak_mem_mib", mem))
            base = dict(case_fields(case), provider=name, mode=mode, density=sig(density),
                        gflop=sig(fl / 1e9), config=provider_config(case, name, mode),
                        matmul_peak_tflops=sig(peak), **prov)
            new = [make_row(**base, metric=m, value=sig(v)) for m, v in metrics]
            sink.write(new)
            rows.extend(new)
            if bar:
                bar.step(label, f"{ms:.3f} ms, {tflops:.3f} TFLOP/s")
    if bar:
        bar.close()
    if device != "cuda" and hasattr(os, "getloadavg"):
        log(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return rows


# ----------------------------------------------------------------------------- table

def _num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def summary_table(rows) -> str:
    """One line per (op, variant, causal, N, mode): ms of every provider, then the main
    provider's TFLOP/s, % of the matmul peak, and its speedup over dense SDPA."""
    ms = [r for r in rows if r["metric"] == "ms"]
    if not ms:
        return "no results"
    order = ["triton", "portable", "head_group_loop", "flex", "sdpa_dense"]
    provs = [p for p in order if any(r["provider"] == p for r in ms)]
    provs += sorted({r["provider"] for r in ms} - set(provs))
    main = next((p for p in ("triton", "portable") if p in provs), provs[0])
    key = lambda r: (r["op"], r["variant"], str(r["causal"]), int(r["N"]), r["mode"])  # noqa: E731
    cell = {(key(r), r["provider"], r["metric"]): _num(r["value"]) for r in rows}
    groups = sorted({key(r) for r in ms}, key=lambda k: (k[0], k[1], k[2], k[3], MODES.index(k[4])
                                                         if k[4] in MODES else 9))
    head = f"{'op':22} {'variant':12} {'causal':6} {'N':>7} {'mode':8}" + "".join(f" {p[:15]:>15}" for p in provs)
    head += f" | {main + ' TFLOP/s':>16} {'%peak':>6} {'vs dense':>8}"
    lines = ["times in ms (median)", head, "-" * len(head)]
    for g in groups:
        line = f"{g[0]:22} {g[1][:12]:12} {g[2]:6} {g[3]:>7} {g[4]:8}"
        for p in provs:
            v = cell.get((g, p, "ms"))
            line += f" {v:>15.3f}" if v is not None else f" {'-':>15}"
        m, d = cell.get((g, main, "ms")), cell.get((g, "sdpa_dense", "ms"))
        tf, pk = cell.get((g, main, "tflops")), cell.get((g, main, "pct_matmul_peak"))
        line += f" | {tf:>16.3f} {pk:>6.1f}" if tf is not None else f" | {'-':>16} {'-':>6}"
        line += f" {d / m:>7.2f}x" if m and d else f" {'-':>8}"
        lines.append(line)
    return "\n".join(lines)


def print_table(rows):
    print()
    print(summary_table(rows))


# ----------------------------------------------------------------------------- layouts

def time_layout_builders(seq_len: int = 1 << 20, block_size: int = 128, reps: int = 3):
    """Median build time and size of each layout builder (topk excluded: it needs q, k)."""
    from .. import layouts
    builders = {
        "local": lambda: layouts.local(seq_len, block_size, window=2),
        "causal_local": lambda: layouts.local(seq_len, block_size, window=2, causal=True),
        "global_tokens": lambda: layouts.global_tokens(seq_len, block_size, num_global_blocks=2),
        "random": lambda: layouts.random(seq_len, block_size, num_random=3, num_heads=8),
        "bigbird": lambda: layouts.bigbird(seq_len, block_size, window=1, num_global_blocks=2, num_random=3),
        "hierarchical": lambda: layouts.hierarchical(seq_len, block_size, window=1, levels=((8, 2), (64, 2))),
        "dilated": lambda: layouts.dilated(seq_len, [2048, 8192, 32768], [1, 512, 2048], block_size, num_heads=8),
    }
    prov = provenance("cpu")
    rows = []
    bar = _Progress(len(builders), "layouts")
    for name, build in builders.items():
        build()   # warm-up (first-call overheads)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            lay = build()
            times.append(time.perf_counter() - t0)
        nbytes = sum(t.numel() * t.element_size() for t in (lay.kv_num_blocks, lay.kv_indices, lay.q_num_blocks,
                                                             lay.q_indices))
        for metric, value in (("seconds", statistics.median(times)), ("active_blocks", lay.num_active),
                              ("index_mib", nbytes / 2 ** 20)):
            rows.append(make_row(op="layout_build", variant=name, provider=name, N=seq_len, block_size=block_size,
                                 density=round(1 - lay.sparsity, 6), metric=metric, value=round(float(value), 4),
                                 **prov))
        bar.step(name, f"{statistics.median(times):.3f} s")
    bar.close()
    return rows


__all__ = ["Case", "COLUMNS", "Timing", "default_sweep", "tiny_sweep", "run_sweep", "summary_table", "print_table",
           "read_csv", "write_csv", "time_layout_builders", "dilated_pairs", "layout_pairs", "dense_pairs", "flops",
           "matmul_peak_tflops", "provenance"]
