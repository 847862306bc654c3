"""Does a sweep agree with a reference sweep of the same cases (issue 14's criterion)? Each
ms and speedup_vs_dense row of RUN is checked against REFERENCE: it agrees when the two
medians differ by at most RUN's reported spread (the interquartile range in % of the
median), else it must carry a flag. Rows that neither agree nor are flagged would mislead;
the exit status is 1 if there are any.

    python perf/compare_runs.py quiet.csv loaded.csv
"""
from __future__ import annotations

import argparse
import math
import sys

from triton_dilated.perf.results import BENCH_OPS, read_csv

METRICS = ("ms", "speedup_vs_dense")


def _key(r):
    return r["op"], r["variant"], r["causal"], r["N"], r["provider"], r["pass"], r["metric"]


def compare(reference, run):
    """[(key, reference value, run value, difference %, spread %, flags, verdict)] with verdict
    "agrees", "flagged" or "MISLEADS"."""
    ref = {_key(r): r for r in reference if r["op"] in BENCH_OPS and r["metric"] in METRICS}
    out = []
    for r in run:
        k = _key(r)
        if k not in ref:
            continue
        a, b = ref[k]["value"], r["value"]
        diff = 100 * abs(b - a) / a if a > 0 else math.inf
        spread = r["spread_pct"] if not math.isnan(r["spread_pct"]) else 0.0
        verdict = "agrees" if diff <= spread else ("flagged" if r["flags"] else "MISLEADS")
        out.append((k, a, b, diff, spread, r["flags"], verdict))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reference", help="the reference sweep's CSV (a quiet machine)")
    p.add_argument("run", help="the sweep to check (e.g. with another job on the machine)")
    p.add_argument("--all", action="store_true", help="print every row, not only those that disagree "
                                                      "(default: off)")
    args = p.parse_args()
    rows = compare(read_csv(args.reference), read_csv(args.run))
    counts = {}
    for (op, var, causal, n, prov, ps, metric), a, b, diff, spread, flags, verdict in rows:
        counts[verdict] = counts.get(verdict, 0) + 1
        if args.all or verdict != "agrees":
            print(f"{op[:12]:12} {var:11} N={n:<6} {prov:15} {ps:7} {metric:16} ref {a:10.3f} run {b:10.3f} "
                  f"diff {diff:5.1f}% spread {spread:5.1f}%  {verdict} {';'.join(flags)}")
    print(", ".join(f"{v}: {counts.get(v, 0)}" for v in ("agrees", "flagged", "MISLEADS")) + f" of {len(rows)} rows")
    return 1 if counts.get("MISLEADS") else 0


if __name__ == "__main__":
    sys.exit(main())
