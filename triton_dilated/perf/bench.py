"""The benchmark sweep of `python -m triton_dilated.perf` (DESIGN §11): cases, providers,
and rows.

A `Case` is one (op, variant, shape); each case is timed for every provider that can run it
(the Triton kernels or the portable backend, dense SDPA, the baselines its variant's spec
names: the head-group loop, FlexAttention) in two passes, "fwd" (no autograd) and "fwd_bwd"
(forward plus the backward for dQ, dK, dV). All of a case's (provider, pass) calls are
timed together, interleaved in rounds (timing.measure_interleaved), so every ratio the sweep
reports (speedup over dense, provider against provider, fwd_bwd against fwd) compares calls
that ran side by side; dense SDPA is timed with every case, never reused. Pair and FLOP
counts come from the variants' specs (ops/<variant>/spec.py). Rows: results.COLUMNS.
"""
from __future__ import annotations

import functools
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from ..ops.common.configs import load_arch_table, select_config, tuned_entry
from ..ops import SPECS
from ..ops.common.hardware import device_arch, padded_head_dim
from ..ops.common.runtime import resolve_backend
from ..ops.common.spec import attention_flops, dense_pairs
from ..ops.dilated.spec import LONGNET_R, LONGNET_W
from .baselines import BASELINES, flex_available, sdpa_dense
from .results import (BUSY_LIMIT_CORES, FLAG_BUSY, FLAG_BWD, FLAG_SPREAD, PASSES, SPREAD_LIMIT_PCT, CsvSink,
                      make_row, print_table, provenance, sig, summary_table)
from .timing import Timing, matmul_peak_tflops, measure_interleaved, paired_ratio, spread_pct

# the benchmarked variants: the specs with a public function to call
BENCH_SPECS = {spec.name: spec for spec in SPECS if spec.call is not None}
OPS = tuple(BENCH_SPECS)
OP_NAMES = {name: spec.op_name for name, spec in BENCH_SPECS.items()}
LATE_PROVIDERS = ("flex",)  # compiled per shape (slow): timed after everything else

CPU_NOTE = ("No CUDA GPU found: timing the portable PyTorch backend against the baselines on the CPU. "
            "These are not Triton kernel timings: those need a GPU (run perf/gpu_check.sh OUTDIR there).")


@dataclass(frozen=True)
class Case:
    op: str                  # "dilated" | "block_sparse" | "indexed"
    variant: str             # dilated: the mode ("longnet", "head_groups"); block-sparse: the layout name;
                             # indexed: "topk=<k>"
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
    topk: int = 0            # indexed: keys per query (random distinct ones of its causal prefix)

    @property
    def kv_heads(self) -> int:
        return self.Hkv or self.H

    @property
    def spec(self):
        """The variant's spec (ops/<variant>/spec.py)."""
        return BENCH_SPECS[self.op]

    @property
    def layout_label(self) -> str:
        if not self.layout:
            return ""
        name, kw = self.layout
        args = ",".join(f"{k}={'/'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in kw)
        return f"{name}({args})"


def case_params(case: Case, on_device: bool = False) -> dict:
    """The op's pattern arguments for this case, as its spec's `call` and `pairs` take them."""
    if case.op == "indexed":
        return {"indices": build_indices(case)}
    if case.layout:
        layout = build_layout(case)
        return {"layout": layout.to(case.device) if on_device else layout}
    return {"segment_lengths": case.ws, "dilation_rates": case.rs, "mode": case.variant}


def case_pairs(case: Case) -> int:
    """(query, key) pairs the case's pattern computes (its spec's counter), summed over batch
    and heads."""
    return case.spec.pairs(case.B, case.N, case.H, case.causal, **case_params(case))


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


@functools.lru_cache(maxsize=8)
def build_indices(case: Case):
    """int32 (B, N, topk) on the case's device: each query's top-k of random scores over its
    causal prefix (all keys without causal), shared by the heads, as DeepSeek's indexer hands
    them over (early queries: -1 past their prefix, as torch.topk of -inf scores would not).
    Built a chunk of queries at a time: scores of (B, 1024, N), not (B, N, N)."""
    gen = torch.Generator(device=case.device).manual_seed(0)
    keys = torch.arange(case.N, device=case.device)
    parts = []
    for start in range(0, case.N, 1024):
        rows = torch.arange(start, min(start + 1024, case.N), device=case.device)
        scores = torch.rand(case.B, len(rows), case.N, generator=gen, device=case.device)
        if case.causal:
            scores = scores.masked_fill(keys[None, :] > rows[:, None], -1.0)
        top = scores.topk(min(case.topk, case.N), dim=-1)
        parts.append(top.indices.masked_fill(top.values < 0, -1).to(torch.int32))
    return torch.cat(parts, dim=1)


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


def _indexed_cases(ns, H, D, dtype, device, topk, B=1):
    return [Case("indexed", f"topk={topk}", B, n, H, D, True, dtype, device, topk=topk) for n in ns]


INDEXED_TOPK = 2048   # DeepSeek V3.2's top-k

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
        if "indexed" in ops:
            cases += _indexed_cases(ns, 16, 128, torch.bfloat16, device, INDEXED_TOPK)
        return cases
    ns = seqlens or ([1024] if quick else [1024, 2048, 4096])
    if "dilated" in ops:
        cases += _dilated_cases(ns, 6, 64, torch.float32, device, (512, 1024, 2048), (1, 2, 4), (512, 1024, 2048),
                                (1, 2, 4), (True,))
    if "block_sparse" in ops:
        bs = 128 if min(ns) >= 512 else 32
        cases += _block_sparse_cases(ns, 6, 64, torch.float32, device, CPU_LAYOUTS, (True,), bs)
    if "indexed" in ops:
        cases += _indexed_cases(ns, 6, 64, torch.float32, device, 256)
    return cases


def tiny_sweep(device="cpu", n=128):
    """One tiny case per op (tests, `--quick` under the interpreter)."""
    return [Case("dilated", "head_groups", 1, n, 2, 16, True, torch.float32, device, (n // 2, n), (1, 2)),
            Case("block_sparse", "local", 1, n, 2, 16, True, torch.float32, device,
                 layout=("local", (("window", 1),)), block_size=32),
            Case("indexed", "topk=32", 1, n, 2, 16, True, torch.float32, device, topk=32)]


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
    if provider == "triton" and case.spec.launch_tiles is not None:   # the variant's own tile rule
        dev = torch.device(case.device)
        kernel = case.spec.kernels[0].name
        cfg = case.spec.launch_tiles(kernel, case.D, case.dtype, {"GROUP": case.H // case.kv_heads},
                                     device_arch(dev) if dev.type == "cuda" else None)
        body = " ".join(f"{k}={v}" for k, v in cfg.items() if k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))
        return f"{kernel}: {body} [{'interpreter' if dev.type != 'cuda' else 'the variant tile rule'}]"
    if provider == "triton":   # the config families of the spec's kernels: forward, then backward
        families = case.spec.families if mode == "fwd_bwd" else case.spec.families[:1]
        return "; ".join(_config_label(k, case) for k in families)
    if provider == "flex":
        return "torch.compile(flex_attention)" if case.device == "cuda" else "flex_attention (eager)"
    return ""


def providers(case: Case, flex: bool | None = None, only=None):
    """{name: fn(q, k, v) -> out} for every provider that can run this case; inputs
    (B, N, H, D). The op itself (through its spec), the portable backend where the main one
    is Triton, the spec's baselines, dense SDPA."""
    spec = case.spec
    params = case_params(case, on_device=True)       # a layout moved once, not inside every timed call
    main = main_provider(case.device)
    backends = {main: "auto", **({"portable": "torch"} if main == "triton" else {})}
    provs = {name: functools.partial(_call_op, spec.call, case.causal, backend, params)
             for name, backend in backends.items()}
    if flex is None:
        flex = case.device == "cuda"
    for name in spec.baselines:
        if name == "flex" and not flex:
            continue
        fn = BASELINES[name](case, params)
        if fn is not None:
            provs[name] = fn
    provs["sdpa_dense"] = lambda q, k, v: sdpa_dense(q, k, v, case.causal)
    if only:
        provs = {k: v for k, v in provs.items() if k in only}
    return provs


PROVIDERS = ("triton", "portable", "head_group_loop", "flex", "gather", "sdpa_dense")   # every name `providers` can return


def missing_providers(cases, named, flex: bool | None = None) -> dict:
    """{provider: why no case of the sweep can time it} for the `named` providers (known
    names) that `providers` returns for none of the cases: the sweep says so instead of
    leaving them out silently."""
    seen = set()
    for case in cases:
        seen |= set(providers(case, flex=flex, only=named))
    device = cases[0].device if cases else "cpu"
    ops = {case.op for case in cases}
    modes = {case.variant for case in cases if case.op == "dilated"}
    why = {}
    for name in named:
        if name in seen:
            continue
        if name == "triton":
            why[name] = ("the Triton kernels run on a CUDA GPU (on a CPU only under Triton's interpreter, "
                         "TRITON_INTERPRET=1, which times Python, not a kernel); here the op's rows are 'portable'"
                         if device != "cuda" else "the Triton kernels do not run on this GPU (see backend='auto')")
        elif name == "flex":
            if "block_sparse" not in ops:
                why[name] = "FlexAttention is a baseline of the block-sparse op only (--ops block_sparse)"
            elif not flex_available():
                why[name] = "FlexAttention is not available in this torch"
            else:
                why[name] = "FlexAttention runs on a CPU only with --flex (eagerly, densely)"
        elif name == "head_group_loop":
            why[name] = ("the head-group loop is a baseline of the dilated op only (--ops dilated)"
                         if "dilated" not in ops else
                         "the head-group loop computes mode=head_groups only, with H a multiple of the patterns, "
                         f"no GQA and N a multiple of every segment length (modes here: {', '.join(sorted(modes))})")
        elif name == "gather":
            why[name] = "the PyTorch gather is a baseline of the indexed op only (--ops indexed)"
        else:
            why[name] = "no case of this sweep runs it"
    return why


def _call_op(call, causal, backend, params, q, k, v):
    return call(q, k, v, causal=causal, backend=backend, **params)


def case_fields(case: Case) -> dict:
    return dict(op=OP_NAMES[case.op], variant=case.variant, B=case.B, N=case.N, H=case.H, Hkv=case.kv_heads,
                D=case.D, dtype=str(case.dtype).removeprefix("torch."), causal=case.causal,
                attn_mode=case.variant if case.op == "dilated" else "",
                segment_lengths="/".join(map(str, case.ws)), dilation_rates="/".join(map(str, case.rs)),
                layout=case.layout_label, block_size=case.block_size if case.layout else "")


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


def _work(cases, flex, only):
    """[(case, {provider: fn}, providers to report)]: one group per case; the late providers
    (FlexAttention: compiled per shape) in a second group per case, paired with dense SDPA
    again, after all the others, by N."""
    first, late = [], []
    for case in cases:
        provs = providers(case, flex=flex, only=only)
        now = {n: f for n, f in provs.items() if n not in LATE_PROVIDERS}
        later = {n: f for n, f in provs.items() if n in LATE_PROVIDERS}
        if now:
            first.append((case, now, set(now)))
        if later:
            dense = {"sdpa_dense": provs["sdpa_dense"]} if "sdpa_dense" in provs else {}
            late.append((case, {**later, **dense}, set(later)))
    return first + sorted(late, key=lambda w: w[0].N)


def group_rows(case: Case, measured, report, peak: float, base: dict) -> list:
    """The rows of one case's interleaved measurement: per (provider, pass) the median ms,
    its effective rate and % of the matmul reference (their spread: the ms rounds'), GPU
    memory, the speedup over dense SDPA from the per-round ratios, and the flags."""
    rows = []
    pairs = case_pairs(case)
    dense = dense_pairs(case.B, case.H, case.N, case.causal)
    busy = not math.isnan(measured.other_cores) and measured.other_cores > BUSY_LIMIT_CORES
    for (name, mode), times in measured.times.items():
        if name not in report:
            continue
        ms, spread = statistics.median(times), spread_pct(times)
        n_pairs = dense if name == "sdpa_dense" else pairs
        fl = attention_flops(n_pairs, case.D, backward=mode == "fwd_bwd")
        flags = [FLAG_BUSY] if busy else []
        fwd = measured.times.get((name, "fwd"))
        if mode == "fwd_bwd" and fwd and ms < statistics.median(fwd):
            flags.append(FLAG_BWD)
        row_base = {**base, **case_fields(case), "provider": name, "pass": mode, "density": sig(n_pairs / dense),
                    "gflop": sig(fl / 1e9), "config": provider_config(case, name, mode), "rounds": len(times),
                    "other_cores": "" if math.isnan(measured.other_cores) else round(measured.other_cores, 3)}
        timed = flags + ([FLAG_SPREAD] if spread > SPREAD_LIMIT_PCT else [])
        sp = "" if math.isnan(spread) else round(spread, 2)
        tflops = fl / ms / 1e9
        metrics = [("ms", ms, sp, timed), ("tflops", tflops, sp, timed),
                   ("pct_matmul_peak", 100 * tflops / peak, sp, timed)]
        mem = measured.mem.get((name, mode), float("nan"))
        if not math.isnan(mem):
            metrics.append(("peak_mem_mib", mem, "", []))
        if name != "sdpa_dense" and ("sdpa_dense", mode) in measured.times:
            ratio, rspread = paired_ratio(measured.times[("sdpa_dense", mode)], times)
            # busy too: pairing cancels drift, not contention that slows one provider more than
            # another (many small parallel ops suffer more from a stolen core than one big call)
            rflags = flags + ([FLAG_SPREAD] if rspread > SPREAD_LIMIT_PCT else [])
            metrics.append(("speedup_vs_dense", ratio, "" if math.isnan(rspread) else round(rspread, 2), rflags))
            # speedup x density: 1.0 when the skipped pairs are all turned into time saved
            metrics.append(("efficiency", ratio * n_pairs / dense, "" if math.isnan(rspread) else round(rspread, 2),
                            rflags))
        rows += [make_row(**row_base, metric=m, value=sig(v), spread_pct=s, flags=f) for m, v, s, f in metrics]
    return rows


def _summary(case, measured, report) -> str:
    parts = []
    for (name, mode), times in measured.times.items():
        if name in report:
            sp = spread_pct(times)
            parts.append(f"{name} {mode} {statistics.median(times):.3f} ms"
                         + ("" if math.isnan(sp) else f" ±{sp:.0f}%"))
    rounds = len(next(iter(measured.times.values()), []))
    load = "" if math.isnan(measured.other_cores) else f", other processes {measured.other_cores:.2f} cores"
    return "; ".join(parts) + f" ({rounds} rounds{load})"


def run_sweep(cases, out=None, timing: Timing | None = None, flex=None, only=None, quiet=False):
    """Time every case's (provider, pass) calls interleaved in rounds; return the rows (and
    stream them to `out`, a CSV path, as they come). FlexAttention runs last (compiling it is
    slow), paired with dense SDPA again, so a cut-short sweep keeps the rest."""
    if not cases:
        return []
    device = cases[0].device
    log = (lambda *a: None) if quiet else print
    if device != "cuda":
        log(CPU_NOTE)
        if hasattr(os, "getloadavg"):
            log(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores "
                "(other work on the machine distorts CPU timings: rows timed while other processes took more "
                f"than {BUSY_LIMIT_CORES} cores are flagged '{FLAG_BUSY}')")
        if main_provider(device) == "triton":
            log("TRITON_INTERPRET=1: the 'triton' rows time Triton's interpreter, not a kernel.")
    prov = provenance(device)
    timing = timing or Timing.for_device(device)
    work = _work(cases, flex, only)
    peaks = {}
    rows = []
    bar = _Progress(len(work), "benchmark") if not quiet else None
    with CsvSink(out) as sink:
        for case, provs, report in work:
            label = f"{case.op} {case.variant} N={case.N} causal={case.causal}"
            measured = measure_interleaved(case, provs, PASSES, timing)
            for (name, mode), msg in measured.errors.items():
                if bar and name in report:
                    bar.write(f"  skipped {label} {name} {mode}: {msg}")
            if not measured.times:
                if bar:
                    bar.step(label, "nothing ran")
                continue
            if (case.device, case.dtype) not in peaks:
                peaks[(case.device, case.dtype)] = matmul_peak_tflops(case.device, case.dtype)
            peak = peaks[(case.device, case.dtype)]
            new = group_rows(case, measured, report, peak, dict(matmul_peak_tflops=sig(peak), **prov))
            sink.write(new)
            rows.extend(new)
            if bar:
                bar.step(label, _summary(case, measured, report))
    if bar:
        bar.close()
    if device != "cuda" and hasattr(os, "getloadavg"):
        log(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return rows


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


__all__ = ["Case", "OPS", "PROVIDERS", "missing_providers", "OP_NAMES", "default_sweep", "tiny_sweep", "run_sweep", "providers", "case_params",
           "case_pairs", "dense_pairs", "build_layout", "main_provider", "time_layout_builders", "summary_table",
           "print_table", "LONGNET_R", "LONGNET_W", "flex_available"]
