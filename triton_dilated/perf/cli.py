"""Argument pieces the perf CLI and the GPU-check scripts share: the parser class, which prints a
usage error as one line, and the `type=` functions that refuse a bad number while the arguments
are parsed, so that every subcommand (and script) applies the same rule with the same message:

    python -m triton_dilated.perf sweep: error: argument --seqlens: must be a positive integer, got '-5'
    (see python -m triton_dilated.perf sweep -h)
"""
from __future__ import annotations

import argparse
import math

CAUSAL = {"both": (False, True), "yes": (True,), "no": (False,)}   # --causal -> the causal values to run
DTYPES = ("float16", "bfloat16", "float32")
MAX_HEAD_DIM = 256   # DESIGN §2: any head dim D <= 256
MAX_INDEXED_HEAD_DIM = 576   # indexed attention's absorbed-MLA shape (ops/indexed/indices.py)


class Parser(argparse.ArgumentParser):
    """argparse with a usage error on one line of stderr (what was wrong, and where -h is),
    exit status 2, no traceback; subparsers are of this class too."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def _number(text: str, kind):
    try:
        value = kind(text)
    except ValueError:
        return None
    return value if kind is int or math.isfinite(value) else None


def positive_int(text: str) -> int:
    """A length, count or size: an integer >= 1."""
    value = _number(text, int)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def head_dim(text: str) -> int:
    """A head dim: an integer in [1, 256]."""
    value = _number(text, int)
    if value is None or not 1 <= value <= MAX_HEAD_DIM:
        raise argparse.ArgumentTypeError(f"must be a head dim, an integer from 1 to {MAX_HEAD_DIM}, got {text!r}")
    return value


def aot_head_dim(text: str) -> int:
    """A head dim to compile: an integer in [1, 576] (above 256: the indexed variant's absorbed-MLA
    decode shape, Dqk 576, the only kernels that take one)."""
    value = _number(text, int)
    if value is None or not 1 <= value <= MAX_INDEXED_HEAD_DIM:
        raise argparse.ArgumentTypeError(f"must be a head dim, an integer from 1 to {MAX_INDEXED_HEAD_DIM}, got "
                                         f"{text!r}")
    return value


def block_size(text: str) -> int:
    """A block or tile size: a power of two >= 16 (DESIGN §4)."""
    value = _number(text, int)
    if value is None or value < 16 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two >= 16, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, GiB)."""
    value = _number(text, float)
    if value is None or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a time budget: 0 times each call once)."""
    value = _number(text, float)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def varlen_mix(text: str) -> tuple:
    """A mixed serving batch (perf decode --varlen-mix): comma-separated COUNT:TOKENS pairs, COUNT
    requests bringing TOKENS new tokens each, both integers >= 1: "7:1,1:256" -> ((7, 1), (1, 256))."""
    try:
        mix = tuple(tuple(int(x) for x in part.split(":")) for part in text.split(","))
    except ValueError:
        mix = ()
    if not mix or any(len(pair) != 2 or min(pair) < 1 for pair in mix):
        raise argparse.ArgumentTypeError(f"must be COUNT:TOKENS pairs, comma-separated, integers >= 1 (e.g. "
                                         f"7:1,1:256), got {text!r}")
    return mix


def add_causal(p: argparse.ArgumentParser) -> None:
    p.add_argument("--causal", choices=tuple(CAUSAL), default="both", help="default: %(default)s")


def shape_parser(doc: str, seqlen: int, *, causal: bool = True) -> argparse.ArgumentParser:
    """A script's parser with --out, --seqlen, --heads, --head-dim, --dtype (and --causal)."""
    p = Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="CSV to write")
    p.add_argument("--seqlen", type=positive_int, default=seqlen, help="default: %(default)s")
    p.add_argument("--heads", type=positive_int, default=16, help="default: %(default)s")
    p.add_argument("--head-dim", type=head_dim, default=128, help="default: %(default)s")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="default: %(default)s")
    if causal:
        add_causal(p)
    return p
