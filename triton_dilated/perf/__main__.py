"""`python -m triton_dilated.perf`: benchmarks on this machine.

  python -m triton_dilated.perf            the default sweep (GPU: Triton kernels; CPU: the
                                           portable backend) against the baselines
  python -m triton_dilated.perf layouts    time the block-layout builders at N = 1M tokens

Prints a table and writes long-format CSV rows (one per op, provider, mode, shape,
metric) with provenance to perf/out/ (or --out).
"""
from __future__ import annotations

import argparse
import sys

from .bench import default_sweep, print_table, run_sweep, time_layout_builders, write_csv


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triton_dilated.perf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="sweep", choices=["sweep", "layouts"])
    parser.add_argument("--out", default=None, help="CSV file to write (default: perf/out/<command>.csv)")
    parser.add_argument("--seqlens", type=int, nargs="*", help="sequence lengths to sweep")
    parser.add_argument("--quick", action="store_true", help="one small shape (smoke test)")
    args = parser.parse_args(argv)
    out = args.out or f"perf/out/{args.command}.csv"
    if args.command == "layouts":
        rows = time_layout_builders(seq_len=(args.seqlens or [1 << 20])[0])
        write_csv(rows, out)
        for r in rows:
            if r["metric"] == "seconds":
                print(f"{r['provider']:14} N={r['N']:>8} block={r['block_size']}  {r['value']:.3f} s")
    else:
        rows = run_sweep(default_sweep(quick=args.quick, seqlens=args.seqlens))
        write_csv(rows, out)
        print_table(rows)
    print(f"\nwrote {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
