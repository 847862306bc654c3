"""Host time of the serve step's launch path (issue 35): the Python from the public call to the
Triton launches, with every launch made a no-op (triton_dilated.perf.decode.stubbed_launches:
the interpreter's run patched, nothing executes), as the calling thread's CPU time, the
least-disturbed of --rounds rounds (perf.decode.thread_cpu_us), next to one small aten op's
host time measured the same way on the same machine (the unit to read them in).

A real decode step's shapes: the LongNet schedule over a 32K context, Hq = Hkv = 16, D = 128,
one token appended, then attended:

* contiguous bf16, batch 1: dilated_attention_with_kvcache(q, k_cache, v_cache, k, v, ...)
* paged FP8, batch 8: the same over float8_e4m3fn page pools (64 rows a page) with descales
* PagedDilatedKVCache, batch 8, FP8 pools: one layer's attend after begin() (the per-layer
  cost of a step), and begin + attend + cancel (a one-layer step; begin's bookkeeping is
  Python over the sequences' pages)

The caches are allocated, not filled (nothing reads them: the launches are stubbed).

    python perf/decode_host_overhead.py [--rounds 15] [--calls 200]
"""
from __future__ import annotations

import argparse

import torch

from triton_dilated import dilated_attention_with_kvcache
from triton_dilated.ops.dilated.paged_cache import PagedDilatedKVCache
from triton_dilated.perf.decode import LONGNET, aten_op_us, stubbed_launches, thread_cpu_us

N, H, D, PAGE = 32768, 16, 128, 64
WS, RS = LONGNET


def _step_inputs(B):
    q = torch.randn(B, 1, H, D, dtype=torch.bfloat16)
    k_new, v_new = torch.randn(B, 1, H, D, dtype=torch.bfloat16), torch.randn(B, 1, H, D, dtype=torch.bfloat16)
    return q, k_new, v_new


def calls():
    """{name: call} of the measured calls (each repeats the same step: same rows written)."""
    out = {}
    q, k_new, v_new = _step_inputs(1)
    kc, vc = (torch.empty(1, N, H, D, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((1,), N - 1, dtype=torch.int32)
    out["contiguous bf16, batch 1"] = lambda: dilated_attention_with_kvcache(
        q, kc, vc, k_new, v_new, cache_seqlens=lens, segment_lengths=WS, dilation_rates=RS)

    B, pages = 8, N // PAGE
    q8, k8, v8 = _step_inputs(B)
    pools = [torch.empty(B * pages, PAGE, H, D, dtype=torch.float8_e4m3fn) for _ in range(2)]
    table = torch.randperm(B * pages).view(B, pages).to(torch.int32)
    descale = torch.full((H,), 0.01)
    lens8 = torch.full((B,), N - 1, dtype=torch.int32)
    out["paged FP8, batch 8"] = lambda: dilated_attention_with_kvcache(
        q8, *pools, k8, v8, cache_seqlens=lens8, block_table=table, segment_lengths=WS, dilation_rates=RS,
        k_descale=descale, v_descale=descale)

    cache = PagedDilatedKVCache(WS, RS, num_pages=B * (pages + 2), page_size=PAGE, num_kv_heads=H, head_dim=D,
                                dtype=torch.float8_e4m3fn, k_descale=descale, v_descale=descale)
    ids = list(range(B))
    for s in ids:
        cache.admit(s)
    cache.begin(ids, N - 1).end()   # every sequence at N - 1 tokens
    steps = [cache.begin(ids, 1)]
    out["PagedDilatedKVCache attend after begin, batch 8"] = lambda: steps[0].attend(q8, k8, v8, 0)

    def whole():
        steps[0].cancel()   # (the step above, once; then each call's own)
        steps[0] = cache.begin(ids, 1)
        steps[0].attend(q8, k8, v8, 0)

    out["PagedDilatedKVCache begin + attend + cancel, batch 8"] = whole
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    with stubbed_launches() as ok:
        if not ok:
            raise SystemExit("the Triton kernels were defined compiled in this process: run without TRITON_INTERPRET=0")
        times = {name: thread_cpu_us(c, args.rounds, args.calls) for name, c in calls().items()}
    unit = aten_op_us()
    print(f"launch path, launches stubbed: thread CPU us per call (least-disturbed of {args.rounds} rounds)")
    print(f"{'call':55} {'us':>8} {'aten ops':>9}")
    for name, us in times.items():
        print(f"{name:55} {us:>8.1f} {us / unit:>9.1f}")
    print(f"{'one aten op (add, 8x16x128 float32)':55} {unit:>8.1f} {1:>9.1f}")


if __name__ == "__main__":
    main()
