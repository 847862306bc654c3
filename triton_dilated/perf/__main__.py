"""`python -m triton_dilated.perf`: time dilated_attention against the baselines on this machine.

With no arguments, the default sweep for the machine it finds: on a GPU the Triton kernels,
on a CPU the portable backend (kernel timings need a GPU; the table says so). Prints a
table and writes long-format CSV rows (one per op, provider, mode, shape, metric) with
provenance to perf/out/ (or --out).
"""
from __future__ import annotations

import argparse
import sys

from .bench import default_sweep, run_sweep, write_csv, print_table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triton_dilated.perf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="perf/out/bench.csv", help="CSV file to write (default: %(default)s)")
    parser.add_argument("--seqlens", type=int, nargs="*", help="sequence lengths to sweep")
    parser.add_argument("--quick", action="store_true", help="one small shape (smoke test)")
    args = parser.parse_args(argv)
    cases = default_sweep(quick=args.quick, seqlens=args.seqlens)
    rows = run_sweep(cases)
    write_csv(rows, args.out)
    print_table(rows)
    print(f"\nwrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
