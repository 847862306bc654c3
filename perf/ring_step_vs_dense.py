"""Issue 4's one-GPU check: the ring simulated step by step on one device. The ring-local-
block step kernel folds P key/value shards into the running (out, lse) one call at a time
(what a rank does over a ring of P); the reference is one call of the same kernel over all
keys, and dense SDPA (FlashAttention on a GPU) on the same work. Target: P steps cost at
most 5% more than the single call. Medians; every provider measured in the same run.

Then issue 22's one-GPU Ulysses check: ulysses_attention over a world of 1 (a one-process
gloo group: with one rank the all-to-alls move nothing, they are the reshapes and copies
around an identity, and the rank-agreement check returns at once) against the plain local
call it wraps (dilated_attention, LongNet patterns at N), forward and
forward+backward, interleaved rounds: the paired ratio is the Ulysses wrapper's overhead.

    python perf/ring_step_vs_dense.py                 # GPU: N=16384, H=16, D=128, bf16, P=2,4,8
    TRITON_INTERPRET=1 python perf/ring_step_vs_dense.py --seqlen 256 --heads 2 --head-dim 32 \\
        --dtype float32 --worlds 2     # CPU smoke run (interpreter: timings mean nothing)
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch
import torch.nn.functional as F

from triton_dilated.ops.common.call import AttentionCall
from triton_dilated.ops.ring.mask import MASK_DENSE, StepMask
from triton_dilated.ops.ring.step_kernels import step_forward
from triton_dilated.perf.timing import Timing, interleaved, median_ms, paired_ratio


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=16384, help="default: %(default)s")
    p.add_argument("--heads", type=int, default=16, help="default: %(default)s")
    p.add_argument("--head-dim", type=int, default=128, help="default: %(default)s")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="default: %(default)s")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], help="ring sizes P (default: %(default)s)")
    p.add_argument("--ulysses-backend", default="auto", choices=("auto", "triton", "torch"),
                   help="the Ulysses check's local calls (default: %(default)s; the CPU dry run: torch)")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    B, N, H, D = 1, args.seqlen, args.heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, N, H, D, generator=gen).to(dev, dtype) for _ in range(3))
    pos = torch.arange(N, dtype=torch.int32, device=dev)
    scale = D ** -0.5
    timing = Timing.for_device(dev.type)
    print(f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU (interpreter: timings mean nothing)'}; "
          f"B={B} N={N} H={H} D={D} {args.dtype}, forward, median ms")
    print(f"{'causal':>6} {'P':>3} {'P steps':>9} {'one call':>9} {'SDPA':>8} {'steps/one':>10}")
    for causal in (False, True):
        mask = StepMask(MASK_DENSE, causal, dev)

        def steps(world):
            out = torch.zeros(B, N, H, D, device=dev, dtype=torch.float32)
            lse = torch.full((B, H, N), float("-inf"), device=dev)
            for s in torch.arange(N).chunk(world):
                sl = slice(int(s[0]), int(s[-1]) + 1)
                step_forward(q, k[:, sl], v[:, sl], pos, pos[sl], out, lse, mask, AttentionCall(causal, scale))
            return out

        one = median_ms(lambda: steps(1), dev.type, timing)
        sdpa = median_ms(lambda: F.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal, scale=scale), dev.type, timing)
        ref = steps(1)
        for world in args.worlds:
            err = (steps(world) - ref).abs().max().item()
            assert err < 1e-2, f"P={world}: steps differ from one call by {err}"
            t = median_ms(lambda: steps(world), dev.type, timing)
            print(f"{str(causal):>6} {world:>3} {t:9.3f} {one:9.3f} {sdpa:8.3f} {t / one:10.3f}")
    ulysses_overhead(q, k, v, scale, dev, timing, args.ulysses_backend)


def ulysses_overhead(q, k, v, scale, dev, timing, backend):
    """ulysses_attention on a world of 1 against the local call it makes (module docstring)."""
    import os
    import tempfile

    import torch.distributed as dist

    from triton_dilated import dilated_attention, ulysses_attention
    from triton_dilated.ops.dilated.spec import longnet_patterns
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tempfile.mkdtemp(), 'rendezvous')}",
                                rank=0, world_size=1)
    N = q.shape[1]
    print(f"\nUlysses on one device (world 1: the all-to-alls move nothing), causal; paired ratio of interleaved "
          f"rounds [IQR %]")
    print(f"{'pattern':>8} {'pass':>8} {'ulysses':>9} {'local':>9} {'ulysses/local':>14}")
    # the LongNet patterns only (the key stage's kernels, already compiled), a short budget:
    # the stage has 25 s on the GPU
    timing = replace(timing, budget_s=min(timing.budget_s, 0.2), max_reps=min(timing.max_reps, 20), min_reps=3)
    for name, (ws, rs) in (("dilated", tuple(zip(*longnet_patterns(N)))),):
        kw = dict(causal=True, scale=scale, backend=backend)
        for mode in ("fwd", "fwd_bwd"):
            x = [t.detach().requires_grad_(mode == "fwd_bwd") for t in (q, k, v)]
            do = torch.randn_like(q)

            def run(fn):
                def call():
                    if mode == "fwd":
                        with torch.no_grad():
                            fn()
                    else:
                        torch.autograd.grad(fn(), x, do)
                return call
            uly = run(lambda: ulysses_attention(*x, segment_lengths=list(ws), dilation_rates=list(rs), **kw))
            loc = run(lambda: dilated_attention(*x, list(ws), list(rs), **kw))
            with torch.no_grad():
                a, b = ulysses_attention(q, k, v, segment_lengths=list(ws),
                                         dilation_rates=list(rs), **kw), dilated_attention(q, k, v, ws, rs, **kw)
            assert torch.equal(a, b), f"{name}: ulysses over one rank differs from the local call"
            times = interleaved({"ulysses": uly, "local": loc}, dev.type, timing)
            ratio, iqr = paired_ratio(times["ulysses"], times["local"])
            med = {key: sorted(t)[len(t) // 2] for key, t in times.items()}
            print(f"{name:>8} {mode:>8} {med['ulysses']:9.3f} {med['local']:9.3f} {ratio:9.3f} [{iqr:.0f}%]")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
