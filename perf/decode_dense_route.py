"""The portable decode at dense and near-dense settings against an einsum over the valid keys
(issue 33 item 2: within 1.5x): B = 5 rows, 16 queries each, 20,000 keys, float32, MHA 6 heads
of 128 (FlashAttention's kvcache test shape), causal, on this CPU; medians of --runs calls in
one process, the einsum and the door interleaved. The near-dense schedule computes another
attention (two dilated patterns) over about as many keys: the einsum is its cost reference.

    python perf/decode_dense_route.py [--runs 5] [--gather] [--threads N]

--gather also times the gather path (the dense route switched off: 10-20 s a call here).
Each line gives the wall-clock medians and the medians of the process's CPU time (less
disturbed by other work on a busy machine; on a quiet one the two agree up to the thread count).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from triton_dilated import block_sparse_attention_with_kvcache, dilated_attention_with_kvcache, layouts
from triton_dilated.ops.common import decode


def einsum_attention(q, k, v, lengths, scale):
    """Causal attention of the last Nq positions over each row's valid keys, in float32
    (one einsum per row: the reference cost)."""
    outs = []
    for b, n in enumerate(lengths):
        s = torch.einsum("qhd,khd->hqk", q[b], k[b, :n]) * scale
        Nq = q.shape[1]
        s = s.masked_fill(torch.arange(n)[None, :] > (n - Nq + torch.arange(Nq))[:, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v[b, :n]))
    return torch.stack(outs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--gather", action="store_true", help="also time the gather path (slow)")
    ap.add_argument("--batch", type=int, default=5)
    ap.add_argument("--keys", type=int, default=20000)
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, N, Nq, H, D = args.batch, args.keys, args.queries, args.heads, args.head_dim
    q = torch.randn(B, Nq, H, D)
    k, v = torch.randn(B, N, H, D), torch.randn(B, N, H, D)
    lens = torch.full((B,), N, dtype=torch.int32)
    scale = D ** -0.5
    cases = {
        "dilated dense (w >= N, r = 1)": lambda: dilated_attention_with_kvcache(
            q, k, v, cache_seqlens=lens, segment_lengths=[32768], dilation_rates=[1]),
        "dilated near-dense ([8192, 32768], [1, 2])": lambda: dilated_attention_with_kvcache(
            q, k, v, cache_seqlens=lens, segment_lengths=[8192, 32768], dilation_rates=[1, 2]),
        "block-sparse dense layout (blocks of 128)": lambda: block_sparse_attention_with_kvcache(
            q, k, v, cache_seqlens=lens, layout=layouts.local(N, 128, -(-N // 128), causal=True)),
    }
    print(f"B={B} Nq={Nq} N={N} H={H} D={D} float32 causal, threads={torch.get_num_threads()}, "
          f"median of {args.runs} (einsum and door interleaved)")
    ref = einsum_attention(q, k, v, [N] * B, scale)
    for name, fn in cases.items():
        if "near" not in name:   # the dense settings compute the einsum's attention
            torch.testing.assert_close(fn(), ref, rtol=2e-4, atol=2e-5)
        times = {(what, clock): [] for what in ("einsum", "door") for clock in ("wall", "cpu")}
        for _ in range(args.runs):
            for what, f in (("einsum", lambda: einsum_attention(q, k, v, [N] * B, scale)), ("door", fn)):
                t0, c0 = time.perf_counter(), time.process_time()
                f()
                times[what, "cpu"].append(time.process_time() - c0)
                times[what, "wall"].append(time.perf_counter() - t0)
        med = {key: statistics.median(t) for key, t in times.items()}
        line = f"{name:45s}" + "".join(
            f"  {clock} einsum {med['einsum', clock]:.3f} s door {med['door', clock]:.3f} s "
            f"ratio {med['door', clock] / med['einsum', clock]:.2f}" for clock in ("wall", "cpu"))
        if args.gather:
            share, decode.DENSE_SHARE = decode.DENSE_SHARE, 2.0
            try:
                t0 = time.perf_counter()
                fn()
                line += f"  (gather path {time.perf_counter() - t0:.2f} s, one call)"
            finally:
                decode.DENSE_SHARE = share
        print(line, flush=True)


if __name__ == "__main__":
    main()
