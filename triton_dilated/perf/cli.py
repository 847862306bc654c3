"""Argument pieces the perf CLI and the GPU-check scripts share."""
from __future__ import annotations

import argparse

CAUSAL = {"both": (False, True), "yes": (True,), "no": (False,)}   # --causal -> the causal values to run
DTYPES = ("float16", "bfloat16", "float32")


def add_causal(p: argparse.ArgumentParser) -> None:
    p.add_argument("--causal", choices=tuple(CAUSAL), default="both", help="default: %(default)s")


def shape_parser(doc: str, seqlen: int, *, causal: bool = True) -> argparse.ArgumentParser:
    """A script's parser with --out, --seqlen, --heads, --head-dim, --dtype (and --causal)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="CSV to write")
    p.add_argument("--seqlen", type=int, default=seqlen, help="default: %(default)s")
    p.add_argument("--heads", type=int, default=16, help="default: %(default)s")
    p.add_argument("--head-dim", type=int, default=128, help="default: %(default)s")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="default: %(default)s")
    if causal:
        add_causal(p)
    return p
