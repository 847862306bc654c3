"""Timing for the perf tools (DESIGN §11): how long to time, medians, the matmul reference,
and the paired timing every ratio the sweep reports comes from.

A ratio of two medians measured minutes apart mixes the machine's drift into the ratio.
`interleaved` times several calls in rounds instead, each call once per round in a shuffled
order, so drift and position effects fall on all of them alike; a ratio is then the median
of its per-round ratios, and its spread the interquartile range of those. `OtherLoad`
measures how much CPU other processes took while something was timed.
"""
from __future__ import annotations

import functools
import os
import random
import resource
import statistics
import time
from dataclasses import dataclass, replace

import torch


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


@dataclass
class Timing:
    """How long to time each measurement: `warmup` calls, then repeat until `budget_s` has
    passed with at least `min_reps` calls, or `max_s` has passed (at least one call), or
    `max_reps` calls. Interleaved rounds of k calls get k times the budget and max_s."""
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


def _repeat(fn, device, timing: Timing, per_call: int = 1):
    """Call fn() (after the warm-up) until `timing` says stop; the wall time of each call in ms.
    `per_call` scales the budget and max_s (fn runs that many timed calls itself)."""
    times = []
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        now = time.perf_counter()
        times.append((now - t0) * 1e3)
        elapsed = now - start
        if len(times) >= timing.max_reps or elapsed >= timing.max_s * per_call \
                or (elapsed >= timing.budget_s * per_call and len(times) >= timing.min_reps):
            return times


def median_ms(fn, device, timing: Timing | None = None):
    """Median wall time of fn() in ms (GPU: synchronised around each call)."""
    timing = timing or Timing.for_device(device)
    for _ in range(timing.warmup):
        fn()
    _sync(device)
    return statistics.median(_repeat(fn, device, timing))


def spread_pct(samples) -> float:
    """Interquartile range of the samples as % of their median (nan under 4 samples)."""
    if len(samples) < 4:
        return float("nan")
    q1, med, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return 100.0 * (q3 - q1) / med if med > 0 else float("nan")


def interleaved(calls: dict, device: str, timing: Timing | None = None, seed: int = 0) -> dict:
    """{key: [ms per round]}: every call of `calls` ({key: fn()}) warmed up, then timed once
    per round in a shuffled order, rounds until `timing` says stop (its budget and max_s
    times the number of calls). All lists have the same length: round i of one call ran
    next to round i of the others, so per-round ratios pair them."""
    timing = timing or Timing.for_device(device)
    for fn in calls.values():
        for _ in range(timing.warmup):
            fn()
    _sync(device)
    keys = list(calls)
    times = {k: [] for k in keys}
    rng = random.Random(seed)

    def one_round():
        rng.shuffle(keys)
        for k in keys:
            t0 = time.perf_counter()
            calls[k]()
            _sync(device)
            times[k].append((time.perf_counter() - t0) * 1e3)

    _repeat(one_round, device, timing, per_call=len(keys))
    return times


def paired_ratio(num, den):
    """(median, spread %) of the per-round ratios num[i] / den[i] of two interleaved series."""
    ratios = [a / b for a, b in zip(num, den) if b > 0]
    if not ratios:
        return float("nan"), float("nan")
    return statistics.median(ratios), spread_pct(ratios)


class OtherLoad:
    """CPU time other processes took while the block ran, in cores (Linux: /proc/stat's busy
    time of all CPUs minus this process's own user+system time, over the wall time); nan
    where /proc/stat is missing. A context manager: `with OtherLoad() as load: ...; load.cores`."""

    def __init__(self, children: bool = False):
        self.cores = float("nan")
        self.children = children   # count the waited-for child processes as own (spawned ranks)

    @staticmethod
    def _busy_s():
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal (guest time is inside user); steal
        # (the hypervisor ran someone else) counts as busy: it is contention too
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def _own_s(self):
        who = (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) if self.children else (resource.RUSAGE_SELF,)
        return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, who))

    def __enter__(self):
        self._t0, self._busy0, self._own0 = time.perf_counter(), self._busy_s(), self._own_s()
        return self

    def __exit__(self, *exc):
        busy = self._busy_s()
        wall = time.perf_counter() - self._t0
        if busy is not None and self._busy0 is not None and wall > 0:
            other = (busy - self._busy0) - (self._own_s() - self._own0)
            self.cores = max(0.0, other / wall)


@functools.lru_cache(maxsize=None)
def matmul_peak_tflops(device: str, dtype: torch.dtype) -> float:
    """TFLOP/s of a square matmul (8192 on a GPU, 1024 on a CPU) measured in this run: the
    reference of pct_matmul_peak. A reference, not a bound: attention that keeps its tiles in
    cache can run faster than a plain matmul of this size."""
    n = matmul_reference_size(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = median_ms(lambda: a @ b, device, Timing(warmup=2, budget_s=0.2, min_reps=5, max_reps=20, max_s=2.0))
    return 2 * n ** 3 / ms / 1e9


def matmul_reference_size(device: str) -> int:
    return 8192 if device == "cuda" else 1024


# ----------------------------------------------------------------------------- attention inputs

def random_tensors(shapes, device, dtype, seed=0, requires_grad=False):
    """Seeded standard-normal tensors drawn on `device` (drawing 0.5 GB on the CPU and
    copying would cost more than the benchmark)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(*s, generator=gen, device=device, dtype=torch.float32).to(dtype)
            .requires_grad_(requires_grad) for s in shapes]


def attention_inputs(shape, mode: str):
    """(q, k, v, dO or None) drawn for `shape` (an object with B, N, H, kv_heads, D, device,
    dtype) and their bytes; q, k, v require grad for "fwd_bwd". Providers share them: the
    calls below take gradients with autograd.grad, which leaves .grad alone."""
    q_shape, kv_shape = (shape.B, shape.N, shape.H, shape.D), (shape.B, shape.N, shape.kv_heads, shape.D)
    q, k, v = random_tensors([q_shape, kv_shape, kv_shape], shape.device, shape.dtype,
                             requires_grad=mode == "fwd_bwd")
    grad = torch.randn_like(q) if mode == "fwd_bwd" else None
    tensors = (q, k, v, grad)
    return tensors, sum(t.numel() * t.element_size() for t in tensors if t is not None)


def attention_call(fn, inputs, mode: str):
    """A no-argument call of fn(q, k, v): "fwd" under no_grad, "fwd_bwd" the forward plus the
    backward for dQ, dK, dV."""
    q, k, v, grad = inputs
    if mode == "fwd":
        def call():
            with torch.no_grad():
                fn(q, k, v)
    else:
        def call():
            out = fn(q, k, v)
            torch.autograd.grad(out, (q, k, v), grad)
    return call


def peak_mem_mib(call, input_bytes: int, device: str) -> float:
    """GPU memory one call needs in MiB: its inputs plus the allocator's peak above what was
    allocated before it (other resident tensors do not count); nan on a CPU."""
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before + input_bytes) / 2 ** 20


def measure(shape, fn, mode: str, timing: Timing):
    """(median ms, MiB or nan) of one provider in one mode, timed alone."""
    inputs, nbytes = attention_inputs(shape, mode)
    call = attention_call(fn, inputs, mode)
    return median_ms(call, shape.device, timing), peak_mem_mib(call, nbytes, shape.device)


@dataclass
class Measured:
    """What measure_interleaved found: ms per round of every (provider, mode) that ran (all
    lists of one length: paired), GPU MiB, errors of those that could not run, and the cores
    other processes took meanwhile."""
    times: dict
    mem: dict
    errors: dict
    other_cores: float


def _error_text(exc) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def measure_interleaved(shape, fns: dict, modes, timing: Timing | None = None) -> Measured:
    """Every provider of `fns` ({name: fn(q, k, v)}) in every mode of `modes`, interleaved in
    rounds on shared inputs of `shape`. A (provider, mode) whose warm-up raises is left out
    (its error kept); the others are timed together."""
    device = shape.device
    timing = timing or Timing.for_device(device)
    errors, calls, nbytes = {}, {}, {}
    for mode in modes:
        try:
            inputs, nbytes[mode] = attention_inputs(shape, mode)
        except Exception as exc:   # out of memory for the inputs alone
            errors.update({(name, mode): _error_text(exc) for name in fns})
            continue
        for name, fn in fns.items():
            call = attention_call(fn, inputs, mode)
            try:
                for _ in range(max(1, timing.warmup)):   # at least one call: does it run at all?
                    call()
                _sync(device)
            except Exception as exc:   # a provider that cannot run this shape is reported, not fatal
                errors[(name, mode)] = _error_text(exc)
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                continue
            calls[(name, mode)] = call
    times, other = {}, float("nan")
    if calls:
        with OtherLoad() as load:
            times = interleaved(calls, device, replace(timing, warmup=0))
        other = load.cores
    mem = {key: peak_mem_mib(call, nbytes[key[1]], device) for key, call in calls.items()}
    return Measured(times, mem, errors, other)


__all__ = ["Timing", "median_ms", "spread_pct", "interleaved", "paired_ratio", "OtherLoad", "matmul_peak_tflops",
           "matmul_reference_size", "random_tensors", "attention_inputs", "attention_call", "peak_mem_mib", "measure",
           "Measured", "measure_interleaved"]
