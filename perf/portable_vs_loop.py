"""The portable backend against the head-group loop of the dilated-attention-pytorch family
on the same work (mode="head_groups"), as a paired ratio: both run in every round, in a
shuffled order, so machine drift and position effects cancel (timing.interleaved, as the
sweep times every case). Medians over the rounds; ± the interquartile range of the ratios.

"checks" times, in the same rounds, what the portable forward spends on the NaN rule of
DESIGN §6 beyond the loop's work: the finiteness pass over k and the verification of the
results (a pass over an output-sized tensor, an upper bound: the jobs' results together
are at most that), as a share of the portable call.

    python perf/portable_vs_loop.py --seqlens 2048 4096 --rounds 30
"""
from __future__ import annotations

import argparse
import math
import statistics

import torch

from triton_dilated import dilated_attention
from triton_dilated.ops.common.lse import all_finite
from triton_dilated.perf.baselines import head_group_loop
from triton_dilated.perf.timing import Timing, attention_call, attention_inputs, interleaved, paired_ratio


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096], help="default: %(default)s")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds (default: %(default)s)")
    p.add_argument("--heads", type=int, default=6, help="default: %(default)s")
    p.add_argument("--head-dim", type=int, default=64, help="default: %(default)s")
    args = p.parse_args()
    ws, rs = (512, 1024, 2048), (1, 2, 4)
    print(f"B=1 H={args.heads} D={args.head_dim} float32 causal, w={ws} r={rs}, {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads")
    rounds = Timing(warmup=1, budget_s=0.0, min_reps=args.rounds, max_reps=args.rounds, max_s=math.inf)
    providers = {
        "portable": lambda q, k, v: dilated_attention(q, k, v, ws, rs, causal=True, mode="head_groups",
                                                      backend="torch"),
        "loop": lambda q, k, v: head_group_loop(q, k, v, ws, rs, causal=True),
    }
    for n in args.seqlens:
        shape = argparse.Namespace(B=1, N=n, H=args.heads, kv_heads=args.heads, D=args.head_dim, device="cpu",
                                   dtype=torch.float32)
        for mode in ("fwd", "fwd_bwd"):
            inputs, _ = attention_inputs(shape, mode)
            calls = {name: attention_call(fn, inputs, mode) for name, fn in providers.items()}
            k, out = inputs[1].detach(), torch.randn_like(inputs[0].detach())
            calls["checks"] = lambda: all_finite(k) and all_finite(out)
            times = interleaved(calls, "cpu", rounds)
            med = {name: statistics.median(t) for name, t in times.items()}
            ratio, spread = paired_ratio(times["portable"], times["loop"])
            share, _ = paired_ratio(times["checks"], times["portable"])
            print(f"N={n:6d} {mode:8s} portable {med['portable']:8.1f} ms   loop {med['loop']:8.1f} ms   "
                  f"portable/loop {ratio:.3f} (±{spread:.1f}%)   checks {med['checks']:.2f} ms = "
                  f"{100 * share:.1f}% of portable")


if __name__ == "__main__":
    main()
