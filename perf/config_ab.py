"""gpu_check.sh stage 4: launch-config A/B of the dilated kernels at the key shape (LongNet
schedule, N = 32K, bf16, B = 1, H = 16, D = 128; causal and not). Every candidate config of
the forward (and, separately, of the backward: the dQ and dK/dV kernels share one config)
is compiled, checked against the library's default config on the same inputs, and timed
with the others in interleaved rounds, so each ratio to the default is a paired one.

Defaults of the candidate lists: the forward's sm90 default (128x64, 8 warps, 3 stages: 128-row
tiles, where the planner takes tile stride 6, two residue classes per tile, 41% fewer K/V
bytes from L2 than 64-row tiles by `perf plan`, 17% more computed pairs) against 64-row tiles
(64x64 with 4 warps, the earlier default; with 8 warps, which computes S twice on Hopper; 2
stages); the backward's dQ default (128x64 w8 s2) against 64-row dQ tiles (64x64 and 64x32
with 4 warps, the earlier ones) and 32x32. A backward candidate runs the dK/dV kernel with
its tiles too, while the default row runs it with its own default (KERNEL_DEFAULTS): read
the dQ share from the breakdown stage. Each
family's default is also timed with every other value of its kernel variant switches
(configs.VARIANT_SWITCHES: the dilated FLAT_LOOP), and the block-sparse forward at the same
length (BigBird layout, block 128) with its TMA switch, where the GPU has TMA, and its
WARP_SPEC switch (the full-block loop warp-specialized, on TMA loads) where Triton
warp-specializes (hardware.ARCH_TABLE: sm100).
Rows (results.COLUMNS) to --out as each (causal, pass) finishes:
op "config_ab:<family>", metric ms and ratio_vs_default (default ms / candidate ms, paired
rounds: > 1 means faster than the default), the config in `config`.

    python perf/config_ab.py --out OUT/config_ab.csv
    TRITON_INTERPRET=1 python perf/config_ab.py --seqlen 128 --heads 1 --head-dim 16 --dtype float32 \\
        --quick --fwd-configs 32,32,4,1 16,16,4,1 --bwd-configs 32,32,4,1 --out /tmp/c.csv   # CPU dry run
"""
from __future__ import annotations

import statistics

import torch

from triton_dilated.ops.common.configs import config_label, make_config, select_config, switch_alternatives
from triton_dilated.ops.common.hardware import device_arch, padded_head_dim
from triton_dilated.ops.block_sparse.spec import BlockSparseProblem
from triton_dilated.ops.dilated.spec import DilatedProblem
from triton_dilated.perf.cli import CAUSAL, shape_parser
from triton_dilated.perf.results import CsvSink, make_row, provenance, sig
from triton_dilated.perf.timing import Timing, interleaved, paired_ratio, spread_pct
from triton_dilated.perf.tune import _agrees

FWD = ["64,64,4,3", "64,64,8,3", "64,64,4,2", "128,64,8,3"]
BWD = ["32,32,4,2", "64,64,4,2", "64,32,4,2", "128,32,8,2"]


def parse_config(text: str) -> dict:
    """"M,N,W,S" with optional variant switches after it: "64,64,4,3,FLAT_LOOP=0"."""
    parts = text.split(",")
    try:
        m, n, w, s = (int(x) for x in parts[:4])
        switches = {k: int(v) for k, v in (p.split("=", 1) for p in parts[4:])}
    except ValueError:
        raise SystemExit(f"config_ab: a config is BLOCK_M,BLOCK_N,num_warps,num_stages (four integers), then "
                         f"optional NAME=VALUE switches, got {text!r}") from None
    return make_config(m, n, w, s, **switches)


label = config_label


def ab_rows(prob, family, configs, timing, device, base, fields) -> list:
    """Compile, check and time `configs` (and the default) for one family on one problem."""
    run = (lambda cfg: prob.backward(cfg)) if family.endswith("_bwd") else (lambda cfg: prob.forward(cfg))
    default = select_config(family, prob.q.dtype, padded_head_dim(prob.q.shape[-1]), prob.q.shape[1],
                            prob.q.device)
    arch = device_arch(prob.q.device) if prob.q.is_cuda else None
    ref = run(None)
    calls, notes = {"default": lambda: run(None)}, {}
    for cfg in list(configs) + switch_alternatives(family, default, arch):
        name = label(cfg)
        if cfg == default:
            continue   # timed as "default"
        try:
            if not _agrees(ref, run(cfg)):
                print(f"  {family} {name}: result differs from the default config's: not timed")
                continue
        except Exception as exc:  # noqa: BLE001  (out of shared memory, compile errors: reported)
            print(f"  {family} {name}: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:150] if str(exc) else ''})")
            continue
        calls[name] = lambda cfg=cfg: run(cfg)
        notes[name] = cfg
    times = interleaved(calls, device, timing)
    rows = []
    passname = "bwd" if family.endswith("_bwd") else "fwd"
    for name, t in times.items():
        cfg = notes.get(name, default)
        config = " ".join(f"{k}={v}" for k, v in cfg.items()) + (" (the default)" if name == "default" else "")
        sp = spread_pct(t)
        common = dict(base, **fields, op=f"config_ab:{family}", provider="triton", config=config, rounds=len(t),
                      **{"pass": passname})
        rows.append(make_row(**common, metric="ms", value=sig(statistics.median(t)),
                             spread_pct="" if sp != sp else round(sp, 2)))
        if name != "default":
            ratio, rs = paired_ratio(times["default"], t)
            rows.append(make_row(**common, metric="ratio_vs_default", value=sig(ratio),
                                 spread_pct="" if rs != rs else round(rs, 2)))
        print(f"  {family:12} {name + (' = ' + label(default) if name == 'default' else ''):28} "
              f"{statistics.median(t):9.3f} ms" + (f"  x{paired_ratio(times['default'], t)[0]:.2f} vs default"
                                                   if name != "default" else ""))
    return rows


def main() -> int:
    p = shape_parser(__doc__, 32768)
    p.add_argument("--fwd-configs", nargs="*", default=FWD, metavar="M,N,W,S", help="default: %(default)s")
    p.add_argument("--bwd-configs", nargs="*", default=BWD, metavar="M,N,W,S", help="default: %(default)s")
    p.add_argument("--quick", action="store_true", help="one timed round per call (dry runs; default: off)")
    p.add_argument("--no-block-sparse", dest="block_sparse", action="store_false",
                   help="skip the block-sparse forward's variant A/B (default: run it)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    timing = (Timing(warmup=1, budget_s=0.0, min_reps=1, max_reps=1, max_s=0.0) if args.quick
              else Timing.for_device(device))
    fwd, bwd = [parse_config(c) for c in args.fwd_configs], [parse_config(c) for c in args.bwd_configs]
    base = provenance(device)
    n = 0
    with CsvSink(args.out) as sink:
        for causal in CAUSAL[args.causal]:
            prob = DilatedProblem(1, args.seqlen, args.heads, args.head_dim, dtype, device, causal)
            ws, rs = zip(*prob.patterns)
            fields = dict(variant="longnet", B=1, N=args.seqlen, H=args.heads, Hkv=args.heads, D=args.head_dim,
                          dtype=args.dtype, causal=causal, attn_mode="longnet", layout=prob.shape,
                          segment_lengths="/".join(map(str, ws)), dilation_rates="/".join(map(str, rs)))
            print(f"\n{prob.shape}")
            for family, configs in (("dilated_fwd", fwd), ("dilated_bwd", bwd)):
                if configs:
                    rows = ab_rows(prob, family, configs, timing, device, base, fields)
                    sink.write(rows)
                    n += len(rows)
            del prob
            if device == "cuda":
                torch.cuda.empty_cache()
            if args.block_sparse:   # the block-sparse forward's default against its switches
                prob = BlockSparseProblem(1, args.seqlen, args.heads, args.head_dim, dtype, device, causal)
                fields = dict(variant="block_sparse", B=1, N=args.seqlen, H=args.heads, Hkv=args.heads,
                              D=args.head_dim, dtype=args.dtype, causal=causal, layout=prob.shape)
                print(f"\n{prob.shape}")
                rows = ab_rows(prob, "block_sparse_fwd", [], timing, device, base, fields)
                sink.write(rows)
                n += len(rows)
                del prob
    print(f"\nwrote {n} rows to {args.out}")
    return 0 if n else 1


if __name__ == "__main__":
    raise SystemExit(main())
