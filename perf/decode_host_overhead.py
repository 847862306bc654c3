"""Host time per decode call of the serve door `dilated_attention_with_kvcache`, without and
with an append.

Two measurements, medians over interleaved rounds of `--calls` calls each:

* "launch path": the Triton path with the kernel launches replaced by no-ops (the Python
  from the public call to the launch: argument checks, tables, buffers), so that a CPU
  measures what a GPU's host would spend before its queue gets the kernel (the launch
  itself, ~10-30 us on a GPU, not included): triton_dilated.perf.decode.stubbed_launches,
  which `perf decode` uses for its CPU host rows too. Nothing is interpreted.
* "portable": the whole call of the portable path at a tiny shape (B=1, one query, H=4,
  D=16, N=256, patterns 16/32/64 x 1/2/4), where Python dominates.
* --serving: the launch path of the serving step (one token appended, then attended) on a
  contiguous, paged, FP8 and paged FP8 cache (perf decode's dilated_kvcache providers), bf16,
  N = 32K, H = 16, D = 128, batch 1 and 8, as wall time and as CPU time (time.process_time:
  what a loaded shared machine cannot inflate by descheduling the process).

    python perf/decode_host_overhead.py --rounds 15 --calls 50 [--serving]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from triton_dilated import dilated_attention_with_kvcache
from triton_dilated.perf.decode import KVCACHE, LONGNET, kvcache_steps, stubbed_launches


def _calls(backend, B, N, H, D, ws, rs):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, 1, H, D, generator=gen)
    k, v = (torch.randn(B, N, H, D, generator=gen) for _ in range(2))
    lens = torch.full((B,), N, dtype=torch.int32)
    k_new, v_new = (torch.randn(B, 1, H, D, generator=gen) for _ in range(2))
    kw = dict(causal=True, backend=backend)
    return {
        "with_kvcache": lambda: dilated_attention_with_kvcache(q, k, v, cache_seqlens=lens, segment_lengths=ws,
                                                               dilation_rates=rs, **kw),
        "with_kvcache + append": lambda: dilated_attention_with_kvcache(q, k, v, k_new, v_new, cache_seqlens=lens - 1,
                                                                        segment_lengths=ws, dilation_rates=rs, **kw),
    }


def _time(calls, rounds, n):
    for c in calls.values():   # warm-up: cached tables, lazy imports
        c()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, c in calls.items():
            t = time.perf_counter()
            for _ in range(n):
                c()
            times[name].append((time.perf_counter() - t) / n * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def serving(rounds, calls):
    """{(batch, provider): (wall us, CPU us)} of the serving step's launch path."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    for B in (1, 8):
        k, v = (torch.randn(B, 16, 32768, 128, generator=gen, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        q = torch.randn(B, 1, 16, 128, generator=gen, dtype=torch.bfloat16)
        steps = kvcache_steps(q, k, v, *LONGNET, list(KVCACHE))
        with stubbed_launches() as ok:
            if not ok:
                raise SystemExit("the Triton kernels were defined compiled in this process")
            for step in steps.values():
                step()
            for name, step in steps.items():
                wall, cpu = [], []
                for _ in range(rounds):
                    t, c = time.perf_counter(), time.process_time()
                    for _ in range(calls):
                        step()
                    wall.append((time.perf_counter() - t) / calls * 1e6)
                    cpu.append((time.process_time() - c) / calls * 1e6)
                out[B, name] = statistics.median(wall), statistics.median(cpu)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--serving", action="store_true", help="the serving step's table instead")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.serving:
        print("serving step (append + attend), launch path, us per call (median of rounds; 1 thread): wall / CPU")
        for (B, name), (wall, cpu) in serving(args.rounds, args.calls).items():
            print(f"batch {B} {name:28} {wall:>10.1f} / {cpu:.1f}")
        return
    with stubbed_launches() as ok:
        if not ok:
            raise SystemExit("the Triton kernels were defined compiled in this process: run without TRITON_INTERPRET=0")
        launch = _time(_calls("triton", 1, 32768, 16, 128, [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 6, 12]),
                       args.rounds, args.calls)
    portable = _time(_calls("torch", 1, 256, 4, 16, [16, 32, 64], [1, 2, 4]), args.rounds, args.calls)
    print("host time per call, us (median of rounds; 1 thread)")
    print(f"{'entry point':30} {'launch path (Triton, no launch)':>32} {'portable, tiny shape':>22}")
    for name in launch:
        print(f"{name:30} {launch[name]:>32.1f} {portable[name]:>22.1f}")


if __name__ == "__main__":
    main()
