"""Decode cost per token against the context length (issue 15 item 2): one query token at
batch 1 at the end of a cache of N positions, the portable decode path of dilated_attention
(it gathers only the keys the token reads: about sum w/r of the LongNet schedule, flat in N
once N passes the longest segment) against dense scaled_dot_product_attention over the same
cache (every key: linear in N). Both timed in interleaved rounds (timing.interleaved);
medians per token, the decode's time per key read (keys/head: the (query, key) pairs of
one head, a key two patterns select counted twice), and each path's time relative to its
own time at the first context. Below N = 32K the schedule's segments are clipped to N, so
fewer keys are read there. On a shared CPU run with OMP_NUM_THREADS=1: small parallel
regions on oversubscribed cores cost milliseconds each (docs/benchmarks.md, CPU threads).

    python perf/decode_vs_dense.py --contexts 4096 16384 65536 131072

On a GPU (--device cuda) the same problem runs the Triton decode kernel instead.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from triton_dilated.ops.dilated.spec import DilatedDecodeProblem
from triton_dilated.perf.timing import Timing, interleaved, paired_ratio


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536, 131072],
                   help="cache lengths N (default: %(default)s)")
    p.add_argument("--heads", type=int, default=16, help="query heads (default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128, help="default: %(default)s")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds (default: %(default)s)")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    backend = "torch" if args.device == "cpu" else "auto"
    timing = Timing(warmup=2, budget_s=0.0, min_reps=args.rounds, max_reps=args.rounds, max_s=60.0)
    print(f"device={args.device} threads={torch.get_num_threads()} {args.dtype}, decode backend={backend}, "
          f"{args.rounds} interleaved rounds")
    print(f"{'N':>7} {'keys/head':>10} {'decode ms':>10} {'ns/key':>7} {'dense ms':>10} {'dense/decode':>13} "
          f"{'decode vs first N':>18} {'dense vs first N':>17}")
    first = None
    for n in args.contexts:
        prob = DilatedDecodeProblem(1, n, args.heads, args.head_dim, dtype, args.device, causal=True,
                                    kv_heads=args.kv_heads)
        times = interleaved({"decode": lambda: prob.decode(backend), "dense": prob.dense}, args.device, timing)
        med = {k: statistics.median(t) for k, t in times.items()}
        ratio, spread = paired_ratio(times["dense"], times["decode"])
        first = first or med
        print(f"{n:>7} {prob.keys_read // args.heads:>10} {med['decode']:>10.3f} "
              f"{1e6 * med['decode'] / prob.keys_read:>7.0f} {med['dense']:>10.3f} "
              f"{ratio:>8.2f} ±{spread:3.0f}% {med['decode'] / first['decode']:>17.2f}x "
              f"{med['dense'] / first['dense']:>16.2f}x", flush=True)


if __name__ == "__main__":
    main()
