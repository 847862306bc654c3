"""Ring attention across processes: one sequence sharded over the ranks, checked against
the single-device result on every rank.

  # GPUs (NCCL), one process per GPU:
  ./dev torchrun --nproc_per_node=8 examples/ring_demo.py --seq-len 65536
  # CPU-only machine (gloo; the portable step, or the Triton interpreter with TRITON_INTERPRET=1):
  ./dev torchrun --nproc_per_node=4 examples/ring_demo.py --seq-len 4096 --heads 4

(the commands of docs/distributed.md; `./dev torchrun` is torchrun in the project's
environment, plain `torchrun` in your own). Each rank prints its forward+backward time and
the largest difference from the single-device result, dense causal and dilated causal
(segments 1024, 4096, 16384 clipped to the sequence, rates 1, 2, 4).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from triton_dilated import dilated_attention, ring_attention, shard


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=8192, help="global sequence length (default: %(default)s)")
    ap.add_argument("--heads", type=int, default=8, help="heads (default: %(default)s)")
    ap.add_argument("--head-dim", type=int, default=64, help="default: %(default)s")
    ap.add_argument("--balance", default="zigzag", choices=["contiguous", "zigzag"],
                    help="how the sequence is split over ranks (default: %(default)s)")
    ap.add_argument("--comm", default="p2p", choices=["p2p", "allgather"], help="default: %(default)s")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32

    g = torch.Generator().manual_seed(0)   # every rank builds the same full sequence, keeps its shard
    full = [torch.randn(1, args.seq_len, args.heads, args.head_dim, generator=g).to(device, dtype) for _ in range(3)]
    q, k, v = (shard(x, rank, world, args.balance).contiguous().requires_grad_() for x in full)
    ws = [min(w, args.seq_len) for w in (1024, 4096, 16384)]
    rs = [1, 2, 4]

    for name, kw in (("dense causal", {}), ("dilated causal", dict(segment_lengths=ws, dilation_rates=rs))):
        dist.barrier()
        t0 = time.perf_counter()
        out = ring_attention(q, k, v, causal=True, comm=args.comm, balance=args.balance, **kw)
        out.float().square().mean().backward()
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        # the same attention on one device, for this rank's shard
        if name == "dense causal":
            ref = torch.nn.functional.scaled_dot_product_attention(
                *(x.transpose(1, 2) for x in full), is_causal=True).transpose(1, 2)
        else:
            ref = dilated_attention(*full, ws, rs, causal=True)
        err = (out.float() - shard(ref, rank, world, args.balance).float()).abs().max().item()
        mem = f"{torch.cuda.max_memory_allocated(device) / 2 ** 20:.0f} MiB" if cuda else "n/a (CPU)"
        print(f"[rank {rank}/{world}] {name}: fwd+bwd {ms:.1f} ms, max |ring - single device| = {err:.2e}, "
              f"peak GPU memory {mem}")
        q.grad = k.grad = v.grad = None
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
