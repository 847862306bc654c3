"""Sweep definitions, timing and CSV/table output for `python -m triton_dilated.perf`."""
from __future__ import annotations

import csv
import datetime
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass

import torch

from ..ops.common.runtime import get_arch, resolve_backend, select_config
from ..ops.dilated.parallel import dilated_attention
from ..ops.dilated.patterns import head_offsets
from .baselines import head_group_loop, sdpa_dense

LONGNET_W = (2048, 4096, 8192, 16384, 32768)
LONGNET_R = (1, 2, 4, 6, 12)


@dataclass(frozen=True)
class Case:
    B: int
    N: int
    H: int
    D: int
    ws: tuple
    rs: tuple
    causal: bool
    mode: str
    dtype: torch.dtype
    device: str


def default_sweep(quick: bool = False, seqlens=None):
    if torch.cuda.is_available():
        ns = seqlens or ([4096] if quick else [8192, 16384, 32768])
        cases = []
        for n in ns:
            ws = tuple(min(w, n) for w in LONGNET_W)
            for causal in (False, True):
                cases.append(Case(1, n, 16, 128, ws, LONGNET_R, causal, "longnet", torch.bfloat16, "cuda"))
        return cases
    # CPU: the portable backend against the baselines; three small LongNet-like patterns
    ns = seqlens or ([1024] if quick else [1024, 2048, 4096])
    cases = []
    for n in ns:
        ws = tuple(min(w, n) for w in (512, 1024, 2048))
        for mode in ("head_groups", "longnet"):
            cases.append(Case(1, n, 6, 64, ws, (1, 2, 4), True, mode, torch.float32, "cpu"))
    return cases


def pair_count(case: Case) -> int:
    """(query, key) pairs the pattern computes, summed over heads and patterns."""
    table = head_offsets(case.H, tuple(zip(case.ws, case.rs)), case.mode, "modulo")
    total = 0
    for row in table:
        for (w, r), o in zip(zip(case.ws, case.rs), row):
            if o < 0:
                continue
            for s in range(0, case.N, w):
                L = len(range(s + o, min(s + w, case.N), r))
                total += L * (L + 1) // 2 if case.causal else L * L
    return total * case.B


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device, warmup=2, reps=None, budget_s=2.0):
    """Median wall time of fn() in ms (GPU: synchronised around each call)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if reps is not None and len(times) >= reps:
            break
        if reps is None and (len(times) >= 5 and time.perf_counter() - start > budget_s or len(times) >= 50):
            break
    return statistics.median(times)


def matmul_peak_tflops(device, dtype):
    """A large matmul measured in the same run: the machine's reachable peak."""
    n = 8192 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = median_ms(lambda: a @ b, device, warmup=2, reps=10 if device == "cuda" else 5)
    return 2 * n ** 3 / ms / 1e9


def _providers(case: Case):
    ws, rs = list(case.ws), list(case.rs)
    kw = dict(causal=case.causal, mode=case.mode)
    main = "triton" if resolve_backend("auto", torch.device(case.device)) == "triton" else "portable"
    provs = {main: lambda q, k, v: dilated_attention(q, k, v, ws, rs, backend="auto", **kw)}
    if main == "triton":
        provs["portable"] = lambda q, k, v: dilated_attention(q, k, v, ws, rs, backend="torch", **kw)
    if case.mode == "head_groups" and case.H % len(ws) == 0 and all(case.N % w == 0 for w in ws):
        provs["head_group_loop"] = lambda q, k, v: head_group_loop(q, k, v, ws, rs, case.causal)
    provs["sdpa_dense"] = lambda q, k, v: sdpa_dense(q, k, v, case.causal)
    return provs


def _provenance():
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5).stdout.strip() or "unknown"
    except Exception:
        sha = "unknown"
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = "none"
    if torch.cuda.is_available():
        arch = get_arch(torch.cuda.current_device())
        machine, arch_name = arch.device_name, arch.name
    else:
        machine, arch_name = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", "cpu"
    return dict(machine=machine, arch=arch_name, torch=torch.__version__, triton=triton_version, git_sha=sha,
                timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def _progress(iterable, total, desc):
    try:
        from tqdm import tqdm
        return tqdm(iterable, total=total, desc=desc)
    except ImportError:
        return iterable


def run_sweep(cases):
    prov = _provenance()
    if not torch.cuda.is_available():
        print("No CUDA GPU found: timing the portable PyTorch backend against the baselines on the CPU. "
              "Triton kernel timings need a GPU (see perf/gpu_check.sh).")
    dtype0, dev0 = cases[0].dtype, cases[0].device
    peak = matmul_peak_tflops(dev0, dtype0)
    rows = []
    work = [(c, name, fn, mode) for c in cases for name, fn in _providers(c).items() for mode in ("fwd", "fwd_bwd")]
    for case, name, fn, mode in _progress(work, len(work), "benchmark"):
        gen = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(case.B, case.N, case.H, case.D, generator=gen).to(case.device, case.dtype)
                   .requires_grad_(mode == "fwd_bwd") for _ in range(3))
        if case.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if mode == "fwd":
            def call():
                with torch.no_grad():
                    fn(q, k, v)
        else:
            def call():
                fn(q, k, v).sum().backward()
        try:
            ms = median_ms(call, case.device)
        except Exception as exc:  # a baseline that cannot run this shape is reported, not fatal
            print(f"  {name} {mode} N={case.N}: skipped ({type(exc).__name__}: {exc})")
            continue
        pairs = pair_count(case) * case.H if name == "sdpa_dense" else pair_count(case)
        if name == "sdpa_dense":
            pairs = case.B * case.H * (case.N * (case.N + 1) // 2 if case.causal else case.N * case.N)
        flops = 4 * case.D * pairs * (3.5 if mode == "fwd_bwd" else 1.0)
        tflops = flops / ms / 1e9
        mem = torch.cuda.max_memory_allocated() / 2 ** 20 if case.device == "cuda" else float("nan")
        cfg = select_config("dilated_fwd", case.dtype, max(16, 1 << (case.D - 1).bit_length()), case.N,
                            torch.device(case.device)) if name == "triton" else {}
        shape = dict(B=case.B, N=case.N, H=case.H, D=case.D, segment_lengths="/".join(map(str, case.ws)),
                     dilation_rates="/".join(map(str, case.rs)), causal=case.causal, attn_mode=case.mode,
                     dtype=str(case.dtype).removeprefix("torch."))
        for metric, value in (("ms", ms), ("tflops", tflops), ("pct_matmul_peak", 100 * tflops / peak),
                              ("peak_mem_mib", mem)):
            rows.append(dict(op="dilated_attention", provider=name, mode=mode, **shape, metric=metric,
                             value=round(value, 4), config="/".join(f"{k}={v}" for k, v in cfg.items()),
                             matmul_peak_tflops=round(peak, 2), **prov))
    return rows


def write_csv(rows, path):
    if not rows:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)


def print_table(rows):
    ms = [r for r in rows if r["metric"] == "ms"]
    if not ms:
        print("no results")
        return
    print(f"\n{'mode':8} {'attn':12} {'N':>6} {'causal':>6} {'provider':16} {'ms':>10} {'TFLOP/s':>8}  vs dense")
    dense = {(r["mode"], r["attn_mode"], r["N"], r["causal"]): r["value"] for r in ms if r["provider"] == "sdpa_dense"}
    tf = {(r["provider"], r["mode"], r["attn_mode"], r["N"], r["causal"]): r["value"] for r in rows if r["metric"] == "tflops"}
    for r in ms:
        key = (r["mode"], r["attn_mode"], r["N"], r["causal"])
        speed = dense.get(key, float("nan")) / r["value"]
        print(f"{r['mode']:8} {r['attn_mode']:12} {r['N']:>6} {str(r['causal']):>6} {r['provider']:16} "
              f"{r['value']:>10.3f} {tf[(r['provider'],) + key]:>8.3f}  {speed:5.2f}x")


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
    prov = _provenance()
    rows = []
    for name, build in _progress(builders.items(), len(builders), "layouts"):
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
            rows.append(dict(op="layout_build", provider=name, N=seq_len, block_size=block_size, metric=metric,
                             value=round(float(value), 4), **prov))
    return rows
