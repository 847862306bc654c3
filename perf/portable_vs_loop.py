"""The portable backend against the head-group loop of the dilated-attention-pytorch family
on the same work (mode="head_groups"), as a paired ratio: both run in every round, in a
shuffled order, so machine drift and position effects cancel. Medians over the rounds.

    python perf/portable_vs_loop.py --seqlens 2048 4096 --rounds 30
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from triton_dilated import dilated_attention
from triton_dilated.perf.baselines import head_group_loop


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
    for n in args.seqlens:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, n, args.heads, args.head_dim, generator=gen).requires_grad_() for _ in range(3))
        grad = torch.randn(1, n, args.heads, args.head_dim, generator=gen)
        providers = {
            "portable": lambda: dilated_attention(q, k, v, ws, rs, causal=True, mode="head_groups", backend="torch"),
            "loop": lambda: head_group_loop(q, k, v, ws, rs, causal=True),
        }
        for mode in ("fwd", "fwd_bwd"):
            def once(fn):
                q.grad = k.grad = v.grad = None
                start = time.perf_counter()
                if mode == "fwd":
                    with torch.no_grad():
                        fn()
                else:
                    fn().backward(grad)
                return time.perf_counter() - start

            for fn in providers.values():   # warm-up
                once(fn)
            times = {name: [] for name in providers}
            order = list(providers)
            rng = random.Random(0)
            for _ in range(args.rounds):
                rng.shuffle(order)
                for name in order:
                    times[name].append(once(providers[name]))
            med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            ratio = statistics.median(a / b for a, b in zip(times["portable"], times["loop"]))
            print(f"N={n:6d} {mode:8s} portable {med['portable']:8.1f} ms   loop {med['loop']:8.1f} ms   "
                  f"portable/loop {ratio:.3f}")


if __name__ == "__main__":
    main()
