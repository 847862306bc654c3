"""gpu_check.sh stage 5: block-sparse attention against FlexAttention (torch.compile'd, with the
BlockMask of the same layout) and dense SDPA at N = 16K, ~90% sparsity (bf16, B = 1, H = 16,
D = 128, block 128, non-causal): a local window of 6 blocks each side (density 0.099) and
BigBird (window 1, 1 global block, 8 random blocks: density 0.097). The benchmark sweep's
machinery (perf/bench.py run_sweep): interleaved rounds, FlexAttention timed after the others
(compiling it is slow) and paired with dense SDPA again; rows go to --out as they come.

    python perf/block_sparse_vs_flex.py --out OUT/block_sparse_vs_flex.csv
    TRITON_INTERPRET=1 python perf/block_sparse_vs_flex.py --seqlen 256 --heads 2 --head-dim 16 \\
        --dtype float32 --block-size 32 --quick --out /tmp/f.csv     # CPU dry run (flex runs eagerly)
"""
from __future__ import annotations


import torch

from triton_dilated.perf.cli import shape_parser
from triton_dilated.perf.bench import Case, build_layout, main_provider, run_sweep
from triton_dilated.perf.results import print_table
from triton_dilated.perf.timing import Timing

LAYOUTS = (("local", (("window", 6),)),
           ("bigbird", (("window", 1), ("num_global_blocks", 1), ("num_random", 8))))


def main() -> int:
    p = shape_parser(__doc__, 16384, causal=False)
    p.add_argument("--block-size", type=int, default=128, help="default: %(default)s")
    p.add_argument("--quick", action="store_true", help="one timed round per call (dry runs; default: off)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    cases = [Case("block_sparse", name, 1, args.seqlen, args.heads, args.head_dim, False, dtype, device,
                  layout=(name, kw), block_size=args.block_size) for name, kw in LAYOUTS]
    for c in cases:
        print(f"{c.layout_label}: density {1 - build_layout(c).sparsity:.3f}")
    timing = (Timing(warmup=1, budget_s=0.0, min_reps=1, max_reps=1, max_s=0.0) if args.quick
              else Timing.for_device(device))
    rows = run_sweep(cases, out=args.out, timing=timing, flex=True, only=(main_provider(device), "flex", "sdpa_dense"))
    print_table(rows)
    print(f"\nwrote {len(rows)} rows to {args.out}")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
