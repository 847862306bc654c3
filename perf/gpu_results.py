"""gpu_check.sh, after the stages: every result CSV of the run in one file named after the
card that measured it, ready to commit as perf/results/<card>.csv.

Reads the run's long-format result CSVs (key_rows, kernel_breakdown, config_ab,
block_sparse_vs_flex, decode and any other triton_dilated.perf CSV in OUTDIR), takes the card
from their `machine` column (every row carries it: provenance), and writes OUTDIR/<card>.csv
with the rows of all of them, each with a `stage` column naming the file it came from. Runs
inside the result tables' time limit.

    python perf/gpu_results.py OUTDIR        prints the path it wrote
"""
from __future__ import annotations

import csv
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

STAGE_FILES = ("key_rows.csv", "kernel_breakdown.csv", "config_ab.csv", "block_sparse_vs_flex.csv", "decode.csv",
               "indexed.csv")


def combine(outdir: str) -> str | None:
    from triton_dilated.perf.results import COLUMNS, REQUIRED, card_name
    names = [f for f in STAGE_FILES if os.path.exists(os.path.join(outdir, f))]
    names += sorted(f for f in os.listdir(outdir) if f.endswith(".csv") and f not in names and f != "stages.csv")
    rows, extra, machines = [], [], []
    for name in names:
        with open(os.path.join(outdir, name), newline="") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            if not all(c in header for c in REQUIRED) or "machine" not in header:
                continue                      # not a result CSV (or the combined file of an earlier run)
            for r in reader:
                rows.append(dict(r, stage=name[:-4]))
                machines.append(r.get("machine") or "")
            extra += [c for c in header if c not in COLUMNS and c not in extra]
    if not rows:
        return None
    card = card_name(next((m for m in machines if m and not m.startswith("cpu")), machines[0]))
    path = os.path.join(outdir, f"{card}.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["stage"] + COLUMNS + extra, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python perf/gpu_results.py OUTDIR (the folder gpu_check.sh wrote)", file=sys.stderr)
        return 2
    path = combine(argv[0])
    if path is None:
        print(f"gpu_results: no result CSV with a machine column in {argv[0]}")
        return 1
    card = os.path.basename(path)
    print(f"all result rows: {path} (commit it as perf/results/{card})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
