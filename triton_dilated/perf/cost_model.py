"""A cost model of the fused dilated forward that runs on a CPU (`python -m triton_dilated.perf
plan`): from the shape, the schedule and the tiling it counts

* useful (query, key) pairs: what the patterns define (a key two patterns select counts
  twice: both are computed), and their FLOPs, 4*D per pair;
* computed pairs: what the planner's tiles compute (padding of the last tile of a residue
  class, the causal diagonal of a strided tile, masked rows of patterns whose rate does
  not divide the tile stride); useful / computed = planner efficiency;
* bytes: every (tile, pattern) reads its dilated keys' K and V rows once (from L2 after the
  first reader); Q and O move once; HBM holds at least Q, K, V and O once;

and a roofline bound on an H100 SXM: time >= max(computed FLOPs / tensor-core peak,
K/V bytes / L2 bandwidth, compulsory bytes / HBM bandwidth). Assumed figures (state them
when quoting the bound): 989 TFLOP/s dense bf16/fp16 tensor cores, 3.35 TB/s HBM3, and
5.5 TB/s of L2 bandwidth (public microbenchmarks measure 5.5-7 TB/s; the low end is used).

Tilings compared (the kernel runs the first two, by its BLOCK_M; the others are what the
model says a kernel change would buy):
* "64-row tiles": BLOCK_M = 64 query rows of one residue class of one head (the default
  before Hopper, and on Hopper until this model chose the next);
* "128-row tiles": the same planner at BLOCK_M = 128, the sm90 default: the planner then
  takes tile stride T = lcm/2 (6 for LongNet), two residue classes per tile, so patterns
  whose rate divides T read their keys once for 128 rows; the others mask half the rows
  (lower planner efficiency, about half the K/V reads);
* "2 classes x 64 rows": a CTA of 128 rows holding two residue classes c and c + T/2 of the
  same head; for a pattern whose rate divides T/2 both classes read the same dilated keys,
  so those K/V tiles are loaded once for 128 rows. The K/V saving per pattern is weighted by
  that pattern's share of the useful pairs (an approximation: it ignores how padding
  differs between patterns);
* "GQA group": query heads of one key/value head that have the same offsets for every
  pattern read identical keys; with modulo offsets that happens only for heads equal modulo
  lcm(rates), so it helps only with GQA groups of that size or blocked offsets.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ops.dilated.patterns import check_patterns, head_offsets, pattern_pairs
from ..ops.dilated.plan import plan_tiles, query_unit_triples
from ..ops.dilated.spec import LONGNET_R, LONGNET_W

H100 = {"name": "H100 SXM (assumed)", "tflops": 989.0, "hbm_tbs": 3.35, "l2_tbs": 5.5}
DENSE_TFLOPS = 600.0   # a FlashAttention-3 / cuDNN-class dense forward on an H100 (FA2: ~350)


@dataclass
class PlanCost:
    tiling: str
    block_m: int
    useful_pairs: int
    computed_pairs: float
    kv_bytes: float          # K/V bytes the tiles read (L2 traffic)
    compulsory_bytes: float  # Q, K, V, O once (HBM floor)
    dense_pairs: int
    head_dim: int

    @property
    def efficiency(self) -> float:
        return self.useful_pairs / self.computed_pairs if self.computed_pairs else 0.0

    def bound(self, gpu=H100) -> dict:
        """Roofline bound: time and the limiter, useful TFLOP/s and speedup over dense at the
        tensor-core peak."""
        flops_computed = 4.0 * self.head_dim * self.computed_pairs
        flops_useful = 4.0 * self.head_dim * self.useful_pairs
        times = {"tensor cores": flops_computed / (gpu["tflops"] * 1e12),
                 "L2 bandwidth": self.kv_bytes / (gpu["l2_tbs"] * 1e12),
                 "HBM bandwidth": self.compulsory_bytes / (gpu["hbm_tbs"] * 1e12)}
        limiter = max(times, key=times.get)
        t = times[limiter]
        dense_t = 4.0 * self.head_dim * self.dense_pairs / (DENSE_TFLOPS * 1e12)
        return dict(ms=t * 1e3, limiter=limiter, useful_tflops=flops_useful / t / 1e12,
                    computed_tflops=flops_computed / t / 1e12, x_dense=dense_t / t,
                    times_ms={k: v * 1e3 for k, v in times.items()})


def useful_pairs(n, patterns, table, causal) -> int:
    """Exact (query, key) pairs per batch row, summed over heads and patterns."""
    return pattern_pairs(n, patterns, table, causal)


def computed_pairs(n, patterns, table, causal, block_m, block_n) -> float:
    """Pairs the planner's tiles compute (its own cost function), summed over heads."""
    _, cost, _ = plan_tiles(n, query_unit_triples(patterns, table), block_m, block_n, causal)
    return float(cost.sum())


def _two_class_kv_factor(n, patterns, table, causal, block_m, block_n) -> float:
    """K/V traffic of "2 classes x 64 rows" relative to 64-row tiles (see the module doc)."""
    units = query_unit_triples(patterns, table)
    items, _, _ = plan_tiles(n, units, block_m, block_n, causal)
    stride = dict(zip(items[:, 2].tolist(), items[:, 3].tolist()))   # unit -> its tile stride T
    shares, saved = 0.0, 0.0
    for u, triples in enumerate(units):
        if u not in stride:
            continue
        T = stride[u]
        for w, r, o in triples:
            pairs = useful_pairs(n, ((w, r),), ((o,),), causal)
            shares += pairs
            if T % 2 == 0 and (T // 2) % r == 0:
                saved += pairs / 2
    return 1.0 - saved / shares if shares else 1.0


def plan_costs(n=32768, heads=16, kv_heads=None, head_dim=128, batch=1, segment_lengths=LONGNET_W,
               dilation_rates=LONGNET_R, causal=False, mode="longnet", offsets="modulo", element_bytes=2,
               block_m=64, block_n=64):
    """PlanCost per tiling for one shape (see the module docstring): BLOCK_M-row tiles (the
    kernel's at the default 64), 2*BLOCK_M-row tiles, two residue classes of BLOCK_M rows."""
    kv_heads = kv_heads or heads
    ws = [min(w, n) for w in segment_lengths]
    patterns = check_patterns(ws, dilation_rates, mode, offsets)
    table = head_offsets(heads, patterns, mode, offsets)
    useful = useful_pairs(n, patterns, table, causal) * batch
    dense = batch * heads * (n * (n + 1) // 2 if causal else n * n)
    compulsory = batch * n * (2 * heads + 2 * kv_heads) * head_dim * element_bytes
    row_bytes = 2 * head_dim * element_bytes            # one K row and one V row
    out = []
    default = " (sm90 default)" if block_m == 64 else ""   # configs: the dilated forward's 128-row tiles
    for label, bm in ((f"{block_m}-row tiles", block_m), (f"{2 * block_m}-row tiles{default}", 2 * block_m)):
        comp = computed_pairs(n, patterns, table, causal, bm, block_n) * batch
        out.append(PlanCost(label, bm, useful, comp, comp / bm * row_bytes, compulsory, dense, head_dim))
    base = out[0]
    factor = _two_class_kv_factor(n, patterns, table, causal, block_m, block_n)
    out.append(PlanCost(f"2 classes x {block_m} rows", 2 * block_m, useful, base.computed_pairs,
                        base.kv_bytes * factor, compulsory, dense, head_dim))
    return out


def format_report(costs, gpu=H100, title="") -> str:
    lines = [title] if title else []
    lines.append(f"roofline on {gpu['name']}: {gpu['tflops']:.0f} TFLOP/s dense 16-bit, "
                 f"{gpu['hbm_tbs']} TB/s HBM, {gpu['l2_tbs']} TB/s L2; 'x dense': against dense attention "
                 f"at {DENSE_TFLOPS:.0f} TFLOP/s (FA3/cuDNN class)")
    c0 = costs[0]
    lines.append(f"useful pairs {c0.useful_pairs:.4g} ({c0.useful_pairs / c0.dense_pairs:.3f} of dense; "
                 f"ideal {c0.dense_pairs / c0.useful_pairs:.2f}x fewer FLOPs)")
    lines.append(f"HBM floor: Q, K, V, O once = {c0.compulsory_bytes / 1e9:.3f} GB; 'K/V GB (L2)': the K and V rows "
                 f"the tiles read (each (tile, pattern) reads its keys once, from L2 after the first reader)")
    head = (f"{'tiling':28} {'efficiency':>10} {'computed pairs':>15} {'K/V GB (L2)':>12} {'bound ms':>9} "
            f"{'limiter':>14} {'useful TF/s':>12} {'x dense':>8}")
    lines += [head, "-" * len(head)]
    for c in costs:
        b = c.bound(gpu)
        lines.append(f"{c.tiling:28} {c.efficiency:>10.3f} {c.computed_pairs:>15.4g} {c.kv_bytes / 1e9:>12.2f} "
                     f"{b['ms']:>9.3f} {b['limiter']:>14} {b['useful_tflops']:>12.0f} {b['x_dense']:>7.2f}x")
    return "\n".join(lines)


def main_report(n=32768, heads=16, head_dim=128, causal_values=(False, True), **kw) -> str:
    parts = []
    for causal in causal_values:
        costs = plan_costs(n=n, heads=heads, head_dim=head_dim, causal=causal, **kw)
        kv = kw.get("kv_heads") or heads
        parts.append(format_report(costs, title=f"\nN={n} B={kw.get('batch', 1)} H={heads} Hkv={kv} D={head_dim} "
                                                f"causal={causal} {kw.get('mode', 'longnet')} "
                                                f"w={'/'.join(str(min(w, n)) for w in kw.get('segment_lengths', LONGNET_W))} "
                                                f"r={'/'.join(map(str, kw.get('dilation_rates', LONGNET_R)))} "
                                                f"BLOCK_N={kw.get('block_n', 64)}"))
    return "\n".join(parts)


if __name__ == "__main__":
    print(main_report())
