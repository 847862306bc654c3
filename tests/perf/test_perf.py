"""The benchmark CLI (`python -m triton_dilated.perf`): sweep rows, FLOP counting, tune JSON,
plots, ring fallback; paired timing, spread and flags; readable tables and figures; clear
errors. Tiny shapes: under the interpreter every Triton call costs ~0.1-1 s."""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
import torch

import triton_dilated
from triton_dilated import layouts
from triton_dilated.ops.block_sparse.naive import element_mask
from triton_dilated.ops.common import configs
from triton_dilated.ops.common import runtime
from triton_dilated.ops.common.hardware import Arch
from triton_dilated.ops import SPECS
from triton_dilated.ops.common.spec import attention_flops, dense_pairs
from triton_dilated.perf import bench, cli, plot, results, timing
from triton_dilated.perf import ring as perf_ring
from triton_dilated.perf.__main__ import DTYPES, _parser, main
from tests.conftest import DEVICE
from tests.helpers.paths import ROOT

ONE_CALL = timing.Timing(warmup=0, budget_s=0.0, min_reps=1, max_reps=1, max_s=0.0)
PROVENANCE = ("machine", "arch", "device", "torch", "triton", "git_sha", "timestamp")


def _read(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_tiny_sweep_writes_every_column(tmp_path, device):
    out = tmp_path / "sweep.csv"
    cases = bench.tiny_sweep(device.type, n=64)
    rows = bench.run_sweep(cases, out=str(out), timing=ONE_CALL, flex=False, quiet=True)
    header, written = _read(out)
    assert header == results.COLUMNS
    assert len(written) == len(rows) > 0
    main_prov = bench.main_provider(device.type)
    seen = {(r["op"], r["provider"], r["pass"], r["metric"]) for r in written}
    for op in ("dilated_attention", "block_sparse_attention", "indexed_attention"):
        for prov in (main_prov, "sdpa_dense"):
            for mode in ("fwd", "fwd_bwd"):
                for metric in ("ms", "tflops", "pct_matmul_peak"):
                    assert (op, prov, mode, metric) in seen
            assert (op, main_prov, "fwd_bwd", "speedup_vs_dense") in seen
            assert (op, main_prov, "fwd_bwd", "efficiency") in seen
    assert ("dilated_attention", "head_group_loop", "fwd", "ms") in seen
    assert ("indexed_attention", "gather", "fwd_bwd", "ms") in seen
    by_key = {(r["op"], r["provider"], r["pass"], r["metric"]): r for r in written}
    for op in ("dilated_attention", "block_sparse_attention", "indexed_attention"):   # efficiency = speedup x density
        speedup, eff = by_key[(op, main_prov, "fwd", "speedup_vs_dense")], by_key[(op, main_prov, "fwd", "efficiency")]
        assert float(eff["value"]) == pytest.approx(float(speedup["value"]) * float(speedup["density"]), rel=1e-4)
    for r in written:
        for col in ("op", "variant", "provider", "pass", "B", "N", "H", "Hkv", "D", "dtype", "causal", "density",
                    "gflop", "metric", "value", "matmul_peak_tflops", "rounds") + PROVENANCE:
            assert r[col] != "", (col, r)
        value = float(r["value"])
        assert math.isfinite(value) and value > 0, r
        assert 0 < float(r["density"]) <= 1
        if r["provider"] == "triton":
            assert "BLOCK_M=" in r["config"]
        if r["op"] == "block_sparse_attention":
            assert r["layout"].startswith("local(") and r["block_size"] == "32"
        elif r["op"] == "indexed_attention":   # 32 keys per query of 64: about half the causal pairs
            assert r["variant"] == "topk=32" and not r["segment_lengths"] and not r["layout"]
            if r["provider"] != "sdpa_dense":
                assert float(r["density"]) == pytest.approx((32 * 33 / 2 + 32 * 32) / (64 * 65 / 2))
        else:
            assert r["segment_lengths"] == "32/64" and r["dilation_rates"] == "1/2"
    table = results.summary_table(results.read_csv(out))
    assert "sdpa_dense" in table and "dilated_attention" in table


def test_flop_counts_come_from_the_specs_and_match_dense_masks():
    from triton_dilated.perf.plot import dilated_multiplicity
    specs = {s.name: s for s in SPECS}
    for mode, causal in (("longnet", False), ("longnet", True), ("head_groups", True)):
        case = bench.Case("dilated", mode, 2, 40, 3, 16, causal, torch.float32, "cpu", (16, 40), (1, 3))
        mult = dilated_multiplicity(40, (16, 40), (1, 3), 3, causal=causal, mode=mode)
        assert bench.case_pairs(case) == 2 * int(mult.sum())   # a key two patterns select counts twice
        kw = dict(segment_lengths=(16, 40), dilation_rates=(1, 3))
        assert specs["ring_step"].pairs(2, 40, 3, causal, mode=mode, **kw) == 2 * int(mult.sum())
        assert specs["dilated"].flops(2, 40, 3, 16, causal, backward=True, mode=mode, **kw) \
            == 3.5 * 4 * 16 * 2 * int(mult.sum())
    lay = layouts.bigbird(100, 16, window=1, num_global_blocks=1, num_random=2, num_heads=3, causal=True)
    assert specs["block_sparse"].pairs(2, 100, 3, True, layout=lay) == 2 * int(element_mask(lay, 100, True).sum())
    assert specs["ring_step"].pairs(2, 100, 3, True, layout=lay) == 2 * int(element_mask(lay, 100, True).sum())
    lay = layouts.local(100, 32, window=1)
    assert specs["block_sparse"].pairs(1, 100, 4, False, layout=lay) == 4 * int(element_mask(lay, 100, False).sum())
    case = bench.Case("block_sparse", "local", 1, 100, 4, 16, False, torch.float32, "cpu",
                      layout=("local", (("window", 1),)), block_size=32)
    assert bench.case_pairs(case) == 4 * int(element_mask(lay, 100, False).sum())
    assert dense_pairs(1, 1, 4, True) == 10 == specs["ring_step"].pairs(1, 4, 1, True)
    assert attention_flops(10, 8, backward=True) == 3.5 * attention_flops(10, 8) == 3.5 * 320
    # every benchmarked variant has the spec fields the sweep uses instead of branches of its own
    assert set(bench.OPS) == {"dilated", "block_sparse", "indexed"}
    for name in bench.OPS:
        assert specs[name].pairs and specs[name].call and specs[name].baselines


def test_cli_sweep_table_and_plot(tmp_path, capsys):
    out = tmp_path / "cli.csv"
    rc = main(["--tiny", "--seqlens", "64", "--ops", "block_sparse", "--providers", "portable", "sdpa_dense",
               "--budget", "0", "--no-plot", "--out", str(out)])
    assert rc == 0
    header, rows = _read(out)
    assert header == results.COLUMNS and {r["provider"] for r in rows} == {"portable", "sdpa_dense"}
    printed = capsys.readouterr().out
    assert "median ms over interleaved rounds" in printed and "dense/portable" in printed
    pngs = tmp_path / "pngs"
    assert main(["plot", str(out), "--out-dir", str(pngs)]) == 0
    for kind in ("time", "speedup", "tflops", "sparsity"):
        assert (pngs / f"cli-{kind}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["table", str(out)]) == 0
    assert "portable" in capsys.readouterr().out


@pytest.mark.skipif(not (torch.cuda.is_available() or runtime.interpreter_enabled()),
                    reason="tune needs a GPU or the interpreter")
def test_tune_writes_a_table_select_config_reads(tmp_path, monkeypatch, capsys):
    from triton_dilated.perf import tune
    kw = {} if not torch.cuda.is_available() else dict(dtypes=[torch.float16], head_dims=[64], seqlens=[1024],
                                                        max_candidates=2, heads=2)
    path, table = tune.run_tune(out_dir=str(tmp_path), **kw)
    with open(path) as f:
        saved = json.load(f)
    assert saved == table and saved["tuned"] is True and saved["arch"] == table["arch"]
    assert set(saved["kernels"]) >= set(tune.KERNELS)
    for kernel in tune.KERNELS:
        for key, cfg in saved["measured"][kernel].items():
            entry = set(saved["kernels"][kernel][key])   # the tile, and any variant switch that won
            assert set(tune.CONFIG_KEYS) <= entry <= set(tune.CONFIG_KEYS) | set(configs.VARIANT_SWITCHES.get(kernel, ()))
            assert cfg["ms"] > 0
    # the variant switches were timed on the best tile (the interpreter's: those without a
    # minimum arch, the dilated FLAT_LOOP)
    with open(tmp_path / f"tune-{saved['arch']}.csv") as f:
        timed = [r["config"] for r in csv.DictReader(f) if r["op"] in ("tune:dilated_fwd", "tune:dilated_bwd")]
    assert any("FLAT_LOOP=0" in c for c in timed) and any("FLAT_LOOP" not in c for c in timed), timed
    # select_config (as on a GPU of this arch) finds the tuned entries
    arch_name = saved["arch"]
    fake = Arch(arch_name, (9, 0), 228 * 1024, 132, "fake")
    monkeypatch.setattr(configs, "device_arch", lambda device: fake)
    monkeypatch.setattr(configs, "load_arch_table", lambda name: saved if name == arch_name else {})
    dtype, d, n = (torch.float32, 16, 64) if not torch.cuda.is_available() else (torch.float16, 64, 1024)
    for kernel in tune.KERNELS:
        got = configs.select_config(kernel, dtype, d, n, torch.device("cuda", 0))
        assert got == saved["kernels"][kernel][tune.table_key(dtype, d, n)]
    if not torch.cuda.is_available():   # the interpreter "tunes" exactly its one config
        assert got == configs.INTERPRETER_CONFIG
    assert (tmp_path / f"tune-{arch_name}.csv").exists()


def test_tune_without_gpu_or_interpreter_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("triton_dilated.perf.tune.interpreter_enabled", lambda: False)
    assert main(["tune", "--out-dir", "/nonexistent"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_ring_says_when_unavailable(monkeypatch, capsys, tmp_path):
    monkeypatch.delattr(triton_dilated, "ring_attention", raising=False)
    with pytest.raises(perf_ring.RingUnavailable):
        perf_ring.load_ring()
    assert main(["ring", "--out", str(tmp_path / "ring.csv")]) == 2
    err = capsys.readouterr().err
    assert "ring attention is not available" in err and "Nothing was measured" in err
    assert not (tmp_path / "ring.csv").exists()


def test_ring_table_and_plot_from_rows(tmp_path):
    rows = []
    for p, ms, mem in ((1, 10.0, 400.0), (2, 6.0, 210.0), (4, 4.0, 110.0)):
        for metric, value in (("ms", ms), ("peak_mem_mib", mem)):
            rows.append(results.make_row(op="ring_attention", variant="dense", provider="ring_p2p", mode="fwd", B=1,
                                       N=4096, H=4, Hkv=4, D=64, dtype="float32", causal=True, world_size=p,
                                       metric=metric, value=value, machine="test"))
    assert rows[0]["pass"] == "fwd"      # make_row still takes the old keyword
    path = tmp_path / "ring-test.csv"
    results.write_csv(rows, path)
    assert "ring_p2p" in perf_ring.ring_table(results.read_csv(path))
    assert [p.rsplit("/", 1)[-1] for p in plot.plot_csv(str(path))] == ["ring-test-ring.png"]


def test_flex_baseline_matches(device):
    if not bench.flex_available():
        pytest.skip("this torch has no FlexAttention")
    if device.type == "cuda":
        pytest.skip("compiled Flex is covered by the GPU sweep (compiling it here costs minutes)")
    from triton_dilated import block_sparse_attention
    from triton_dilated.perf.baselines import flex_block_sparse
    lay = layouts.local(80, 32, window=1, causal=True)
    fn = flex_block_sparse(lay, 80, True, device, compiled=False)
    q, k, v = (torch.randn(1, 80, 2, 16) for _ in range(3))
    ref = block_sparse_attention(q, k, v, lay, causal=True, backend="torch")
    torch.testing.assert_close(fn(q, k, v), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("capability, smem_kib", [((9, 0), 227), ((8, 0), 163), ((8, 6), 99), ((7, 5), 64),
                                                  ((7, 0), 96)], ids=["sm90", "sm80", "sm86", "sm75", "sm70"])
def test_default_configs_fit_the_arch(capability, smem_kib):
    """Untuned defaults (no entry in configs/<arch>.json): every kernel family, dtype and head
    dim gets power-of-two tiles of 16..128 whose (conservative) shared-memory estimate fits
    the arch (twice the estimate before Ampere), so tune's pruning keeps it as its first
    candidate; where nothing fits, the smallest tile (float32 D=256 backward on 99 KiB cards:
    the real compile needs 96 KiB, `perf aot --arch 86`; before Ampere, float32 D=256 and
    D=256 backward on a 64 KiB Turing block, where the dispatcher takes the portable path)."""
    from triton_dilated.perf import tune
    arch = Arch("sm%d%d" % capability, capability, smem_kib * 1024, 100, "fake")
    kernels = ("dilated_fwd", "dilated_bwd", "block_sparse_fwd", "block_sparse_bwd", "ring_step_fwd", "ring_step_bwd")
    for kernel in kernels:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for d in (16, 32, 64, 128, 256):
                cfg = configs.default_config(kernel, d, arch, dtype)
                assert set(cfg) == set(tune.CONFIG_KEYS), (kernel, d, cfg)
                for tile in (cfg["BLOCK_M"], cfg["BLOCK_N"]):
                    assert 16 <= tile <= 128 and tile & (tile - 1) == 0, (kernel, d, cfg)
                if configs.config_fits(kernel, cfg, d, arch, dtype):
                    assert tune.candidates(kernel, d, dtype, arch)[0] == cfg
                else:   # float32 before Ampere (the dispatcher takes the portable path there);
                    # D=256 backward: float32 on <= 99 KiB cards, 16-bit on sm75
                    pre_ampere, bwd = capability < (8, 0), kernel.endswith("_bwd")
                    assert (dtype == torch.float32 and pre_ampere
                            or d == 256 and bwd and (dtype == torch.float32 and smem_kib <= 99
                                                     or capability == (7, 5))), (kernel, dtype, d, cfg)
                    # the smallest tile (8 warps: sm70/sm75's D = 256 default, the fma rows of configs.ARCH_DEFAULTS)
                    assert cfg in ({"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": w, "num_stages": 1} for w in (4, 8))


def test_select_config_without_tuned_entries_uses_the_default(monkeypatch):
    arch = Arch("sm90", (9, 0), 227 * 1024, 132, "fake")
    monkeypatch.setattr(configs, "device_arch", lambda device: arch)
    monkeypatch.setattr(configs, "load_arch_table", lambda name: {"arch": "sm90", "tuned": False, "kernels": {}})
    for kernel in ("dilated_bwd", "block_sparse_fwd", "ring_step_bwd"):
        got = configs.select_config(kernel, torch.bfloat16, 128, 8192, torch.device("cuda", 0))
        assert got == configs.default_config(kernel, 128, arch, torch.bfloat16)


def test_dispatch_takes_the_portable_path_where_no_tile_fits(monkeypatch):
    """A GPU where the kernels cannot run the problem (D=256 backward on a 64 KiB Turing
    block; float32 without TF32 tensor cores): "auto" takes the portable path, "triton" is
    a clear error; an sm80 takes the kernels. (Faked GPUs: the logic, not a launch.)"""
    dev = torch.device("cuda", 0)
    arch = {"now": None}
    monkeypatch.setattr(runtime, "triton_can_target", lambda device: True)
    monkeypatch.setattr(configs, "device_arch", lambda device: arch["now"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    need = ("dilated_fwd", "dilated_bwd")
    arch["now"] = Arch("sm75", (7, 5), 64 * 1024, 40, "fake")
    assert runtime.resolve_backend("auto", dev, need, 256, torch.float16) == "torch"
    # D = 128 fits, and no Turing default spills there (the dots in pieces: configs.FMA_SPILLING)
    assert runtime.resolve_backend("auto", dev, need, 128, torch.float16) == "triton"
    assert runtime.resolve_backend("triton", dev, need, 128, torch.float16) == "triton"
    assert runtime.resolve_backend("auto", dev, need, 64, torch.float16) == "triton"
    assert runtime.resolve_backend("auto", dev, need, 64, torch.float32) == "torch"
    with pytest.raises(ValueError, match="backend='triton': .* cannot run head dim 256"):
        runtime.resolve_backend("triton", dev, need, 256, torch.float16)
    arch["now"] = Arch("sm80", (8, 0), 163 * 1024, 108, "fake")
    assert runtime.resolve_backend("auto", dev, need, 256, torch.float16) == "triton"
    assert runtime.resolve_backend("auto", dev, need, 256, torch.float32) == "triton"


# ----------------------------------------------------------------------------- paired timing (issue 14)

class _FakeClock:
    """time.perf_counter for the timing module: calls advance it by what they "cost"."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_interleaved_rounds_pair_the_calls_and_cancel_drift(monkeypatch):
    """Every round runs every call once (shuffled order); a ratio from paired rounds stays
    at the true 2.0 while the machine slows down 1% per call, where two medians measured
    one after the other (the old sweep's way) are off by a third."""
    clock = _FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    calls = {"n": 0}
    order = []

    def work(name, cost):
        def fn():
            calls["n"] += 1
            clock.now += cost * 1.01 ** calls["n"]      # drift: each call 1% slower than the last
            order.append(name)
        return fn

    t = timing.Timing(warmup=0, budget_s=0.0, min_reps=30, max_reps=30, max_s=1e9)
    times = timing.interleaved({"slow": work("slow", 2.0), "fast": work("fast", 1.0)}, "cpu", t)
    assert len(times["slow"]) == len(times["fast"]) == 30
    assert all(sorted(order[i:i + 2]) == ["fast", "slow"] for i in range(0, 60, 2))   # one of each per round
    assert order[0::2] != ["slow"] * 30 and order[0::2] != ["fast"] * 30                # shuffled
    ratio, spread = timing.paired_ratio(times["slow"], times["fast"])
    assert abs(ratio - 2.0) < 0.03 and spread < 2
    calls["n"] = 0
    sequential = timing.median_ms(work("slow", 2.0), "cpu", t) / timing.median_ms(work("fast", 1.0), "cpu", t)
    assert abs(sequential - 2.0) > 0.5


def test_spread_is_the_interquartile_range_in_percent():
    assert timing.spread_pct([10, 10, 10, 10, 10]) == 0
    assert timing.spread_pct([8, 9, 10, 11, 12]) == pytest.approx(20.0)
    assert math.isnan(timing.spread_pct([1, 2, 3]))    # too few rounds to say


def _measured(fwd, fwd_bwd, dense_fwd, dense_bwd, other_cores=0.0):
    return timing.Measured(times={("portable", "fwd"): fwd, ("portable", "fwd_bwd"): fwd_bwd,
                                  ("sdpa_dense", "fwd"): dense_fwd, ("sdpa_dense", "fwd_bwd"): dense_bwd},
                           mem={}, errors={}, other_cores=other_cores)


def test_rows_carry_spread_and_flags():
    case = bench.tiny_sweep("cpu", 64)[0]
    base = dict(matmul_peak_tflops=0.1, machine="test", device="cpu")
    steady = [10.0, 10.1, 9.9, 10.0, 10.05]
    noisy = [10.0, 14.0, 7.0, 12.0, 8.0]
    rows = bench.group_rows(case, _measured(steady, [30.0] * 5, [20.0] * 5, [60.0] * 5), {"portable", "sdpa_dense"},
                            0.1, base)
    cell = {(r["provider"], r["pass"], r["metric"]): r for r in rows}
    assert cell[("portable", "fwd", "ms")]["value"] == 10.0 and cell[("portable", "fwd", "ms")]["rounds"] == 5
    assert cell[("portable", "fwd", "ms")]["spread_pct"] == pytest.approx(0.5)   # (10.05 - 10) / 10
    assert cell[("portable", "fwd", "speedup_vs_dense")]["value"] == pytest.approx(2.0, rel=0.01)
    assert ("sdpa_dense", "fwd", "speedup_vs_dense") not in cell
    assert not any(r["flags"] for r in rows)
    # fwd_bwd faster than fwd, a wide spread, another process busy: each flagged where it applies
    rows = bench.group_rows(case, _measured(noisy, [9.0] * 5, [20.0] * 5, [60.0] * 5, other_cores=1.0),
                            {"portable", "sdpa_dense"}, 0.1, base)
    cell = {(r["provider"], r["pass"], r["metric"]): r["flags"].split(";") for r in rows}
    assert results.FLAG_SPREAD in cell[("portable", "fwd", "ms")]
    assert results.FLAG_SPREAD in cell[("portable", "fwd", "speedup_vs_dense")]
    assert results.FLAG_BWD in cell[("portable", "fwd_bwd", "ms")]
    assert results.FLAG_BWD in cell[("portable", "fwd_bwd", "speedup_vs_dense")]
    assert results.FLAG_BWD not in cell[("sdpa_dense", "fwd_bwd", "ms")]
    assert all(results.FLAG_BUSY in cell[(p, m, "ms")] for p in ("portable", "sdpa_dense") for m in ("fwd", "fwd_bwd"))
    assert results.FLAG_BUSY in cell[("portable", "fwd", "speedup_vs_dense")]
    assert results.FLAG_SPREAD not in cell[("sdpa_dense", "fwd", "ms")]


def test_sweep_times_dense_with_every_case_never_reuses_it(monkeypatch):
    """Two cases of one shape: dense SDPA is timed in each case's own rounds (the old sweep
    timed it once and printed the reused value as new)."""
    seen = []
    real = timing.measure_interleaved

    def spy(shape, fns, modes, t=None):
        seen.append((shape.variant, sorted(fns)))
        return real(shape, fns, modes, t)

    monkeypatch.setattr(bench, "measure_interleaved", spy)
    cases = [bench.Case("dilated", v, 1, 64, 2, 16, True, torch.float32, "cpu", (32, 64), (1, 2))
             for v in ("longnet", "head_groups")]
    rows = bench.run_sweep(cases, timing=ONE_CALL, flex=False, only=["portable", "sdpa_dense"], quiet=True)
    assert seen == [("longnet", ["portable", "sdpa_dense"]), ("head_groups", ["portable", "sdpa_dense"])]
    assert len([r for r in rows if r["provider"] == "sdpa_dense" and r["metric"] == "ms"]) == 4


def test_other_load_sees_a_busy_process():
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    try:
        time.sleep(0.2)
        with timing.OtherLoad() as load:
            time.sleep(1.0)
    finally:
        busy.wait()
    assert load.cores > 0.3     # the child's core (and anyone else's): never our own sleeping time


def test_other_load_counts_waited_children_as_own_when_asked():
    """perf dcp's worlds: OtherLoad(children=True) counts the CPU time of the child processes
    waited for inside the block (the spawned ranks) as its own, not as other load: a child
    burning 0.5 s of CPU shows as 0.5 s more other load to the plain OtherLoad, whatever the
    machine's other load (the two measure the same /proc/stat interval)."""
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    burn = "import time\nwhile time.process_time() < 0.5: pass"
    with timing.OtherLoad() as plain:
        with timing.OtherLoad(children=True) as own:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", burn], check=True)
            wall = time.perf_counter() - t0
    child_s = (plain.cores - own.cores) * wall
    assert 0.45 < child_s < 0.8, child_s    # 0.5 s of the loop and the interpreter's start-up


# ----------------------------------------------------------------------------- readable output (issue 14)

def _bench_row(provider, mode, metric, value, spread="", flags="", variant="longnet", n=1024, device="cpu"):
    return results.make_row(op="dilated_attention", variant=variant, provider=provider, mode=mode, B=1, N=n, H=6,
                            Hkv=6, D=64, dtype="float32", causal=True, attn_mode=variant, metric=metric, value=value,
                            spread_pct=spread, flags=flags, rounds=9, matmul_peak_tflops=0.1, machine="test",
                            device=device)


def _example_rows():
    return [_bench_row("portable", "fwd", "ms", 20.0, 3.0), _bench_row("portable", "fwd", "tflops", 0.05, 3.0),
            _bench_row("portable", "fwd", "pct_matmul_peak", 50.0, 3.0),
            _bench_row("portable", "fwd", "speedup_vs_dense", 2.0, 4.0),
            _bench_row("portable", "fwd", "efficiency", 0.5, 4.0),
            _bench_row("sdpa_dense", "fwd", "ms", 40.0, 2.0),
            _bench_row("portable", "fwd_bwd", "ms", 15.0, 25.0, "fwd_bwd<fwd;spread>10%"),
            _bench_row("portable", "fwd_bwd", "tflops", 0.2, 25.0), _bench_row("portable", "fwd_bwd", "pct_matmul_peak",
                                                                               200.0, 25.0),
            _bench_row("portable", "fwd_bwd", "speedup_vs_dense", 8.0, 30.0, "fwd_bwd<fwd;spread>10%"),
            _bench_row("sdpa_dense", "fwd_bwd", "ms", 120.0, 2.0, "busy")]


def test_summary_table_checked_example(tmp_path):
    path = tmp_path / "example.csv"
    results.write_csv(_example_rows(), path)
    lines = results.summary_table(results.read_csv(path)).splitlines()
    assert lines[0] == "median ms over interleaved rounds, ±: interquartile range in % of the median"
    assert lines[1].split() == ["op", "pattern", "causal", "N", "pass", "portable", "sdpa_dense", "|", "portable",
                                "GFLOP/s", "%matmul", "dense/portable", "eff", "flags"]
    assert lines[3].split() == ["dilated_attention", "mode=longnet", "True", "1024", "fwd", "20.000", "±3%",
                                "40.000", "±2%", "|", "50.000", "50.0", "2.00x", "±4%", "0.50"]
    # no efficiency row and no density: "-"
    assert lines[4].split("|")[1].split() == ["200.000", "200.0", "8.00x", "±30%", "-", "busy;", "fwd_bwd<fwd",
                                              "portable,dense/portable;", "spread>10%", "portable,dense/portable"]
    legend = "\n".join(lines[6:])
    assert "pass: fwd = forward only" in legend
    assert "%matmul: that rate as % of a 1024x1024 matmul timed in the same run (100 GFLOP/s); a reference, " \
           "not a bound" in legend
    assert "dense/portable: dense SDPA time / portable time" in legend and "> 1: portable is faster than dense" in legend
    assert "CPU: the portable PyTorch backend" in legend


def test_old_csv_without_pass_or_spread_still_reads():
    """perf/results/cpu.csv predates the `pass` column (it says `mode`) and the spread."""
    rows = results.read_csv(ROOT / "perf" / "results" / "cpu.csv")
    assert rows and {r["pass"] for r in rows} == {"fwd", "fwd_bwd"}
    assert all(math.isnan(r["spread_pct"]) and r["flags"] == [] for r in rows)
    table = results.summary_table([r for r in rows if r["op"] in results.BENCH_OPS])
    line = next(x for x in table.splitlines() if "mode=head_groups" in x and " 4096 fwd " in x)
    assert "±" not in line    # a ratio of medians, no spread to show
    speedup, eff = line.split()[-2:]   # the efficiency column: that ratio times the row's density
    row = next(r for r in rows if r["variant"] == "head_groups" and r["N"] == 4096 and r["pass"] == "fwd"
               and r["provider"] == "portable" and r["metric"] == "ms" and str(r["causal"]) == "True")
    assert speedup.endswith("x") and float(eff) == pytest.approx(float(speedup[:-1]) * row["density"], abs=0.01)


def _draw(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig).draw()
    return fig


def test_cpu_figures_say_portable_backend_use_readable_log_ticks_and_comment_the_matmul_line():
    rows = []
    for n, f in ((1024, 1.0), (2048, 3.0), (4096, 9.0)):
        for r in _example_rows():
            r = dict(r, N=n)
            if r["metric"] == "ms":
                r["value"] *= f
            rows.append(r)
    rows = [dict(r, flags=r["flags"].split(";") if r["flags"] else [], causal=True) for r in rows]
    for r in rows:
        for k in ("value", "matmul_peak_tflops", "density", "spread_pct"):
            r[k] = float(r[k]) if r[k] != "" else float("nan")
    figs = {kind: _draw(plot.figure(rows, kind)) for kind in ("time", "speedup", "tflops")}
    figs["sparsity"] = _draw(plot.sparsity_figure([dict(r, density=0.5) for r in rows]))
    for kind, fig in figs.items():
        assert "portable PyTorch backend" in fig._suptitle.get_text(), kind
    ax = figs["time"].axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert len(labels) >= 2 and all("$" not in x and "10^" not in x for x in labels), labels
    assert all(float(x) > 0 for x in labels)
    assert "GFLOP/s" in figs["tflops"].axes[0].get_ylabel()
    texts = [t.get_text() for ax in figs["tflops"].axes for t in ax.texts]
    assert any("a reference, not the machine's peak" in t for t in texts)   # fwd_bwd: 200 > the 100 GFLOP/s line


def test_figures_ring_the_points_of_busy_rows(tmp_path):
    """Issue 34 item 2: the table shows the busy flag; the figures ring those points in red with
    a legend entry (time, speedup, TFLOP/s and sparsity figures), and only those."""
    case = bench.tiny_sweep("cpu", 64)[0]
    base = dict(matmul_peak_tflops=0.1, machine="test", device="cpu")
    rows = []
    for n, cores in ((1024, 0.0), (2048, 0.99)):     # N = 2048 timed while another process took a core
        c = dataclasses.replace(case, N=n)
        rows += bench.group_rows(c, _measured([10.0] * 5, [30.0] * 5, [20.0] * 5, [60.0] * 5, other_cores=cores),
                                 {"portable", "sdpa_dense"}, 0.1, base)
    results.write_csv(rows, tmp_path / "busy.csv")
    rows = results.read_csv(tmp_path / "busy.csv")
    assert {r["N"] for r in rows if results.FLAG_BUSY in r["flags"]} == {2048}
    figs = {kind: _draw(plot.figure(rows, kind)) for kind in ("time", "speedup", "tflops")}
    figs["sparsity"] = _draw(plot.sparsity_figure(rows))
    for kind, fig in figs.items():
        for ax in (a for a in fig.axes if a.get_visible()):
            rings = [c for c in ax.collections if c.get_label() in (plot.BUSY_LABEL, "_busy")]
            lines = {tuple(map(tuple, line.get_xydata())) for line in ax.get_lines()}
            ringed = {tuple(xy) for c in rings for xy in c.get_offsets()}
            # every busy point is a point of a line, at N = 2048 (sparsity: its one point per series)
            assert ringed and all(any(xy in pts for pts in lines) for xy in ringed), (kind, ringed)
            if kind != "sparsity":
                assert {x for x, _ in ringed} == {2048}, (kind, ringed)
            assert ax.get_legend_handles_labels()[1].count(plot.BUSY_LABEL) == 1, kind


def test_sweeps_keep_earlier_results(tmp_path, monkeypatch, capsys):
    """Issue 34 item 2: every sweep wrote perf/out/sweep.csv and its PNGs over the last run's.
    Without --out each run writes a new perf/out/sweep-<UTC date>-<time>.csv (-2, ... within one
    second) and says where first; an --out that exists (the CSV or a PNG) is refused before
    anything is timed unless --overwrite."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "run_sweep", lambda cases, out, **k: results.write_csv(rows, out) or rows)
    rows = [_bench_row("portable", "fwd", "ms", 20.0, 3.0), _bench_row("sdpa_dense", "fwd", "ms", 40.0, 2.0)]
    argv = ["--tiny", "--budget", "0", "--no-plot"]
    assert main(argv) == 0 and main(argv) == 0
    first, second = sorted((tmp_path / "perf" / "out").iterdir())
    assert re.fullmatch(r"sweep-\d{8}-\d{6}(-2)?\.csv", first.name) and second.name != first.name
    printed = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("writing perf/out/sweep-") for line in printed) == 2
    assert sum(line.startswith("wrote 2 rows to perf/out/sweep-") for line in printed) == 2
    before = first.read_text()
    assert main([*argv, "--out", str(first)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"sweep: {first} exists (an earlier run's results)" in err and "--overwrite" in err
    assert first.read_text() == before
    png = tmp_path / "plots-time.png"          # a PNG of the name counts too (unless --no-plot)
    png.write_bytes(b"x")
    assert main(["--tiny", "--budget", "0", "--out", str(tmp_path / "plots.csv")]) == 2
    assert f"{png} exists" in capsys.readouterr().err and not (tmp_path / "plots.csv").exists()
    assert main([*argv, "--out", str(first), "--overwrite"]) == 0
    assert f"wrote 2 rows to {first}" in capsys.readouterr().out


# ----------------------------------------------------------------------------- CLI errors and help (issue 14)

def test_table_and_plot_reject_missing_and_foreign_csvs(tmp_path, capsys):
    foreign = ROOT / "perf" / "aot" / "defaults-bf16.csv"     # an AOT CSV: another kind
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    for path, says in ((tmp_path / "missing.csv", "no such file"), (foreign, "not a triton_dilated.perf result CSV"),
                       (empty, "empty")):
        for cmd in (["table", str(path)], ["plot", str(path), "--out-dir", str(tmp_path)]):
            assert main(cmd) == 2, cmd
            err = capsys.readouterr().err
            assert says in err and "Traceback" not in err, (cmd, err)
    layouts_csv = ROOT / "perf" / "results" / "cpu-layouts.csv"     # a result CSV without plots
    assert main(["plot", str(layouts_csv), "--out-dir", str(tmp_path)]) == 1
    assert "no sweep, ring or decode rows to plot" in capsys.readouterr().err
    assert main(["table", str(layouts_csv)]) == 0
    assert "layout builder" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_ring_on_cuda_without_a_gpu_says_so(capsys, tmp_path):
    assert main(["ring", "--device", "cuda", "--out", str(tmp_path / "ring.csv")]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU is visible" in err and "--device cpu" in err and "Traceback" not in err
    assert not (tmp_path / "ring.csv").exists()


def test_every_option_has_help_with_its_default_and_one_dtype_spelling():
    import argparse
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            assert a.help, (name, a.dest)
            takes_value = a.nargs != 0 and a.option_strings
            if takes_value:
                assert "default" in a.help, (name, a.option_strings, a.help)
            if a.dest in ("dtype", "dtypes"):
                assert tuple(a.choices) == DTYPES, (name, a.choices)
    assert set(DTYPES) == {"float16", "bfloat16", "float32"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU exit; on a GPU the script runs for minutes")
def test_gpu_check_without_a_gpu_stops_at_once(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}")
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "perf" / "gpu_check.sh"), str(out)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode != 0
    assert "no CUDA GPU visible to torch" in proc.stderr and "nothing was run" in proc.stderr
    assert time.monotonic() - t0 < 60 and not out.exists()


# ----------------------------------------------------------------------------- plan (the cost model, issue 12)

def test_plan_costs_checked_example():
    """One dense pattern (w = N = 128, r = 1), H = 1, D = 64, 64-row tiles, bf16: every pair is
    useful and computed once (efficiency 1); the tiles read K and V 128/64 = 2 times (2 x 128
    rows x 256 B = 65,536 B from L2); Q, K, V, O once = 65,536 B from HBM, which at 3.35 TB/s
    is the bound (4 x 64 x 16,384 FLOP at 989 TFLOP/s and 65,536 B at 5.5 TB/s take less)."""
    from triton_dilated.perf.cost_model import plan_costs
    c = plan_costs(n=128, heads=1, head_dim=64, segment_lengths=(128,), dilation_rates=(1,), causal=False)[0]
    assert (c.useful_pairs, c.computed_pairs, c.efficiency) == (128 * 128, 128 * 128, 1.0)
    assert c.kv_bytes == 65536 and c.compulsory_bytes == 65536
    b = c.bound()
    assert b["limiter"] == "HBM bandwidth"
    assert b["ms"] == pytest.approx(65536 / 3.35e12 * 1e3)
    assert b["times_ms"]["tensor cores"] == pytest.approx(4 * 64 * 128 * 128 / 989e12 * 1e3)
    assert b["times_ms"]["L2 bandwidth"] == pytest.approx(65536 / 5.5e12 * 1e3)
    # 128-row tiles read K and V once per tile: half the L2 bytes
    assert plan_costs(n=128, heads=1, head_dim=64, segment_lengths=(128,), dilation_rates=(1,))[1].kv_bytes == 32768


def test_plan_cli_prints_pairs_efficiency_bytes_and_bound(capsys):
    """`perf plan` at a small LongNet shape: the useful pairs it prints are the dilated spec's
    own count, the computed pairs are at least as many (efficiency <= 1), and the assumed
    H100 figures (tensor cores, HBM, L2) are stated."""
    from triton_dilated.ops.dilated.spec import LONGNET_R, LONGNET_W, count_pairs
    assert main(["plan", "--seqlen", "4096", "--heads", "4", "--head-dim", "64", "--causal", "no"]) == 0
    out = capsys.readouterr().out
    assert "989 TFLOP/s" in out and "3.35 TB/s HBM" in out and "5.5 TB/s L2" in out
    pairs = count_pairs(1, 4096, 4, False, segment_lengths=[min(w, 4096) for w in LONGNET_W],
                        dilation_rates=LONGNET_R)
    assert f"useful pairs {pairs:.4g}" in out
    rows = {}
    for label in ("64-row tiles", "128-row tiles (sm90 default)"):
        line = next(x for x in out.splitlines() if x.startswith(label + " "))
        rows[label] = efficiency, computed, kv_gb, ms = [float(x) for x in line[len(label):].split()[:4]]
        assert 0.5 < efficiency <= 1.0 and computed >= pairs
        assert ms > 0 and kv_gb > 0
    # 128-row tiles (two residue classes each) read fewer K/V bytes for more computed pairs
    assert rows["128-row tiles (sm90 default)"][2] < rows["64-row tiles"][2]
    assert rows["128-row tiles (sm90 default)"][1] >= rows["64-row tiles"][1]
    assert "2 classes x 64 rows" in out


@pytest.mark.parametrize("args, message", [
    (["--heads", "4", "--kv-heads", "3"], "--heads (4) must be a multiple of --kv-heads (3)"),
    (["--segment-lengths", "1024", "2048", "--dilation-rates", "1"], "one entry per pattern; got 2 and 1"),
    (["--segment-lengths", "1024", "--dilation-rates", "3000"], "dilation_rates[0] = 3000 is larger than"),
], ids=["kv-heads", "lengths", "rate"])
def test_plan_cli_rejects_bad_arguments(args, message, capsys):
    """Pairs of values that do not go together (single values: the parser refuses them, next test)."""
    assert main(["plan", "--seqlen", "4096", *args]) == 2
    assert message in capsys.readouterr().err


# the parser's value types (perf/cli.py) and values each refuses
BAD_VALUES = {cli.positive_int: ["0", "-5", "1.5", "abc"], cli.head_dim: ["0", "257"], cli.block_size: ["8", "48"],
              cli.positive_float: ["0", "-1", "nan", "inf"], cli.non_negative_float: ["-1", "nan", "inf"],
              cli.aot_head_dim: ["0", "577"], cli.varlen_mix: ["0:1", "7:1,1", "a:b", "1:-2", "7:1,"]}


def test_every_numeric_option_refuses_a_bad_value_in_one_line(capsys):
    """Issue 34 item 1: `sweep --seqlens -5` (a ValueError traceback), `decode --contexts 0`
    (IndexError), `--budget -1` (accepted): every number of every subcommand is checked as it
    is parsed, by one of cli.py's types (none is a plain int or float, which take anything),
    and a bad one is one line on stderr naming the option, what it takes and what came, exit 2."""
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    checked = set()
    for name, p in sub.choices.items():
        for a in p._actions:
            assert a.type not in (int, float), f"{name} {a.option_strings}: type={a.type.__name__} takes any value"
            for bad in BAD_VALUES.get(a.type, ()):
                with pytest.raises(SystemExit) as exc:
                    main([name, a.option_strings[0], bad])
                err = capsys.readouterr().err
                assert exc.value.code == 2
                assert err.count("\n") == 1 and "Traceback" not in err, err
                assert f"perf {name}: error: argument {'/'.join(a.option_strings)}: must be " in err, err
                assert f"got {bad!r}" in err and f"(see python -m triton_dilated.perf {name} -h)" in err, err
                checked.add((name, a.dest))
    assert {("sweep", "seqlens"), ("sweep", "budget"), ("decode", "contexts"), ("decode", "budget"), ("tune", "heads"),
            ("ring", "world_sizes"), ("ring", "timeout"), ("layouts", "block_size"), ("aot", "jobs"),
            ("aot", "head_dims"), ("plan", "block_m"), ("plan", "dilation_rates"), ("decode", "max_cache_gib"),
            ("decode", "page_size"), ("decode", "memory_contexts")} <= checked


@pytest.mark.parametrize("args", [["sweep", "--seqlens", "-5"], ["decode", "--contexts", "0"], ["aot", "--arch", "999"],
                                  ["--budget", "-1"]], ids=["seqlens", "contexts", "arch", "budget"])
def test_cli_refuses_the_issue_values_without_a_traceback(args):
    """The four commands of issue 34 item 1 as a user types them: one line on stderr, exit 2."""
    proc = subprocess.run([sys.executable, "-m", "triton_dilated.perf", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"argument {args[-2]}: " in proc.stderr and proc.stdout == ""


def test_sweep_and_decode_refuse_values_that_do_not_go_together(capsys, tmp_path):
    """A tiny sweep at N = 1 (segments of 0 tokens: ZeroDivisionError) and decode heads that
    are no multiple of the kv heads (a ValueError traceback from the attention call)."""
    assert main(["--tiny", "--seqlens", "1", "--no-plot", "--out", str(tmp_path / "s.csv")]) == 2
    assert "sweep: --tiny needs N >= 2" in capsys.readouterr().err
    assert main(["decode", "--heads", "3", "--kv-heads", "2", "--contexts", "16", "--out",
                 str(tmp_path / "d.csv")]) == 2
    assert capsys.readouterr().err == "decode: --heads (3) must be a multiple of --kv-heads (2)\n"
    assert not list(tmp_path.iterdir())


def test_a_tuned_family_entry_leaves_kernels_with_their_own_default(monkeypatch):
    """perf tune times a family's first kernel; the dK/dV and decode kernels keep their
    KERNEL_DEFAULTS entry (a spill-free tile of their own) whatever the family's tuned entry
    (a table with family entries only; a dK/dV entry of its own: test_tuned_configs)."""
    fake = Arch("sm90", (9, 0), 227 * 1024, 132, "fake H100")
    tuned = configs.make_config(32, 32, 4, 1)
    monkeypatch.setattr(configs, "device_arch", lambda device: fake)
    monkeypatch.setattr(configs, "tuned_entry", lambda name, *args: (None, "fallback") if name in configs.TUNED_KERNELS
                        else (dict(tuned), "sm90.json"))
    cuda = torch.device("cuda")
    assert configs.select_config("dilated_bwd", torch.bfloat16, 128, 32768, cuda) == tuned
    for family, kernel in (("dilated_bwd", "dilated_bwd_dkdv"), ("block_sparse_bwd", "block_sparse_bwd_dkdv"),
                           ("ring_step_bwd", "ring_step_bwd_dkdv"), ("dilated_fwd", "dilated_decode"),
                           ("block_sparse_fwd", "block_sparse_decode")):
        own = configs.default_config(family, 128, fake, torch.bfloat16, kernel)
        assert own != tuned
        assert configs.select_config(family, torch.bfloat16, 128, 32768, cuda, kernel=kernel) == own


def test_decode_sweep_labels_the_longnet_schedule():
    from triton_dilated.perf import decode as perf_decode
    one = timing.Timing(warmup=0, budget_s=0.0, min_reps=1, max_reps=1)
    rows = perf_decode.run_decode([64], providers=["sdpa_dense"], heads=2, head_dim=8, device="cpu",
                                  memory_contexts=[], quiet=True, timing=one)
    assert rows and {r["variant"] for r in rows} == {"longnet"}
    rows = perf_decode.run_decode([64], providers=["sdpa_dense"], heads=2, head_dim=8, ws=[16], rs=[1],
                                  device="cpu", memory_contexts=[], quiet=True, timing=one)
    assert {r["variant"] for r in rows} == {"custom"}


def test_decode_sweep_times_the_inference_entry_point_and_prints_host_rows():
    """The dilated_kvcache provider (dilated_attention_with_kvcache) runs in the sweep; host_ms
    rows (written on a GPU) get their own table."""
    from triton_dilated.perf import decode as perf_decode
    one = timing.Timing(warmup=0, budget_s=0.0, min_reps=1, max_reps=1)
    rows = perf_decode.run_decode([64], providers=["dilated", "dilated_kvcache"], heads=2, head_dim=8, ws=[16, 32],
                                  rs=[1, 2], device="cpu", memory_contexts=[], quiet=True, timing=one)
    assert {r["provider"] for r in rows if r["metric"] == "ms" and r["value"] != ""} == {"dilated", "dilated_kvcache"}
    host = [dict(r, metric="host_ms", value=0.05) for r in rows]
    table = perf_decode.decode_table(rows + host)
    assert "host time per call" in table and "dilated_kvcache host" in table


def test_decode_sweep_times_indexed_attention_against_its_gather():
    """Issue 32 item 5: the indexed serve door's decode step (each query's top-k random
    positions) next to the PyTorch gather of the same rows and dense SDPA; the gather agrees
    with the door (max_abs_err) and the rows name the top-k, not the dilated schedule."""
    from triton_dilated.perf import decode as perf_decode
    one = timing.Timing(warmup=0, budget_s=0.0, min_reps=1, max_reps=1)
    provs = ["indexed_kvcache", "indexed_gather", "sdpa_dense"]
    rows = perf_decode.run_decode([64, 4096], providers=provs, heads=4, kv_heads=2, head_dim=8, device="cpu",
                                  memory_contexts=[], quiet=True, timing=one, batches=[2])
    timed = {(r["N"], r["provider"]) for r in rows if r["metric"] == "ms" and r["value"] != ""}
    assert timed == {(n, p) for n in (64, 4096) for p in provs}
    err = [r for r in rows if r["metric"] == "max_abs_err"]
    assert [(r["N"], r["provider"]) for r in err] == [(64, "indexed_gather"), (4096, "indexed_gather")]
    assert all(r["value"] < 1e-5 for r in err)
    assert {r["variant"] for r in rows if r["provider"] in provs[:2]} == {"topk=2048"}
    assert {r["segment_lengths"] for r in rows if r["provider"] in provs[:2]} == {""}
    # 2048 of 3000 keys: the door attends to the listed ones only, not to every key as dense SDPA
    q, k, v = torch.randn(1, 1, 2, 8), torch.randn(1, 3000, 2, 8), torch.randn(1, 3000, 2, 8)
    calls = perf_decode.indexed_steps(q, k, v, provs)
    assert set(calls) == {"indexed_kvcache", "indexed_gather"}
    out = calls["indexed_kvcache"]()
    assert (out - calls["indexed_gather"]()).abs().max() < 1e-5
    dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert (out - dense.transpose(1, 2)).abs().max() > 1e-3
    assert "indexed_gather against indexed_kvcache" in perf_decode.decode_table(rows)


def test_decode_sweep_batches_paged_fp8_graph_and_host_rows():
    """Issue 21 item 6: batch sizes, the paged and FP8 serving-step providers (paged equal to
    contiguous, FP8 within its error), the CUDA-graph provider (a skipped row on a CPU), the
    CPU host rows (launch path, launches stubbed), a (B, N) over the memory cap skipped; and
    the table prints them per batch size."""
    from triton_dilated.perf import decode as perf_decode
    one = timing.Timing(warmup=0, budget_s=0.0, min_reps=1, max_reps=1)
    provs = ["dilated_kvcache", "dilated_kvcache_paged", "dilated_kvcache_fp8", "dilated_kvcache_paged_fp8",
             "dilated_kvcache_graph"]
    rows = perf_decode.run_decode([64, 128], providers=provs, heads=2, head_dim=8, ws=[16, 32], rs=[1, 2],
                                  device="cpu", memory_contexts=[], quiet=True, timing=one, batches=[1, 3],
                                  page_size=16, max_cache_gib=3 * 128 * 2 * 8 * 2 * (4 + 4 + 1 + 1) / 2 ** 30 * 0.99)
    timed = {(r["B"], r["N"], r["provider"]) for r in rows if r["metric"] == "ms" and r["value"] != ""}
    assert timed == {(b, n, p) for b in (1, 3) for n in (64, 128) for p in provs[:4]} - {
        (3, 128, p) for p in provs[:4]}
    skipped = {(r["B"], r["N"], r["provider"]): r["flags"] for r in rows if r["metric"] == "ms" and r["value"] == ""}
    assert all(f.startswith("skipped: CUDA graphs need a GPU") for (b, n, p), f in skipped.items() if
               p == "dilated_kvcache_graph" and (b, n) != (3, 128))
    assert all("max_cache_gib" in f for (b, n, p), f in skipped.items() if (b, n) == (3, 128))
    err = {(r["B"], r["N"], r["provider"]): r["value"] for r in rows if r["metric"] == "max_abs_err"}
    assert len(err) == 9 and all(v == 0 for (b, n, p), v in err.items() if p == "dilated_kvcache_paged")
    assert all(0 < v < 0.1 for (b, n, p), v in err.items() if p.endswith("fp8"))
    assert {r["dtype"] for r in rows if r["provider"].endswith("fp8")} == {"float8_e4m3fn"}
    # the CPU host rows (3 (B, N) x (4 serving steps + the aten-op unit)) stub the Triton
    # launches, which needs the kernels defined under the interpreter: the CPU suite's
    # (conftest); a CUDA suite defined them compiled, and the sweep then writes none for CPU
    # tensors (stubbed_launches)
    stubbed = DEVICE == "cpu"
    host = [r for r in rows if r["metric"] == "host_ms"]
    assert len(host) == (15 if stubbed else 0) and all(r["value"] > 0 and r["flags"].startswith("CPU") for r in host)
    assert sum(r["provider"] == "aten_op" for r in host) == (3 if stubbed else 0)
    table = perf_decode.decode_table(rows)
    assert "batch 3 (CPU)" in table and "fp8: the quantisation error" in table
    assert ("launches stubbed" in table) == stubbed


def test_decode_sweep_times_a_varlen_batch_against_the_per_request_loop(tmp_path):
    """Issue 33 item 5: the varlen providers (one call on a mixed batch of decodes and a chunk
    of more than 16 queries, the query-offset route; the same requests one by one) write ms rows
    labelled with the mix, the speedup and a max_abs_err ~0; a context the longest request does
    not fit under is a skipped row. Both steps equal the float64 oracle on the appended cache."""
    from triton_dilated import dilated_attention_naive
    from triton_dilated.perf import decode as perf_decode
    one = timing.Timing(warmup=0, budget_s=0.0, min_reps=1, max_reps=1)
    ws, rs, mix = [16, 32], [1, 2], ((2, 1), (1, 20))
    rows = perf_decode.run_decode([16, 64], providers=["dilated_kvcache_varlen"], heads=2, head_dim=8, ws=ws, rs=rs,
                                  device="cpu", memory_contexts=[], quiet=True, timing=one, varlen_mix=mix)
    got = {(r["N"], r["provider"], r["metric"]): r for r in rows}
    assert {r["B"] for r in rows} == {3} and {r["flags"].split(";")[0] for r in rows} == {"mix=2:1,1:20"}
    assert set(got) == {(16, p, "ms") for p in perf_decode.VARLEN} | {(64, p, "ms") for p in perf_decode.VARLEN} | {
        (64, "dilated_kvcache_varlen", m) for m in ("speedup_vs_loop", "max_abs_err")}
    assert all(got[(16, p, "ms")]["value"] == "" and "does not fit" in got[(16, p, "ms")]["flags"]
               for p in perf_decode.VARLEN)
    assert all(got[(64, p, "ms")]["value"] > 0 and got[(64, p, "ms")]["rounds"] == 1 for p in perf_decode.VARLEN)
    assert got[(64, "dilated_kvcache_varlen", "speedup_vs_loop")]["value"] > 0
    assert got[(64, "dilated_kvcache_varlen", "max_abs_err")]["value"] < 1e-5
    table = perf_decode.decode_table(rows)
    assert "mixed serving batch" in table and "2:1,1:20" in table and "batch 3" not in table
    csv_path = tmp_path / "varlen.csv"    # read back (flags become lists): the same table
    results.write_csv(rows, csv_path)
    assert perf_decode.decode_table(results.read_csv(csv_path)) == table
    # a first call over max_call_s: single-call rows at that context, longer ones skipped
    slow = perf_decode.run_decode([64, 128], providers=["dilated_kvcache_varlen_loop"], heads=2, head_dim=8, ws=ws,
                                  rs=rs, device="cpu", memory_contexts=[], quiet=True, timing=one, varlen_mix=mix,
                                  max_call_s=1e-9)
    ms = {(r["N"], r["provider"]): r for r in slow if r["metric"] == "ms"}
    assert all(ms[(64, p)]["value"] > 0 and "single call" in ms[(64, p)]["flags"] for p in perf_decode.VARLEN)
    assert all(ms[(128, p)]["value"] == "" and "a call took longer" in ms[(128, p)]["flags"]
               for p in perf_decode.VARLEN)
    # the steps against the oracle: request b's queries at the end of its row's N keys
    g = torch.Generator().manual_seed(0)
    counts, n = [1, 1, 20], 40
    kc, vc = torch.randn(3, n, 1, 8, generator=g), torch.randn(3, n, 1, 8, generator=g)
    q, kn, vn = torch.randn(22, 2, 8, generator=g), torch.randn(22, 1, 8, generator=g), torch.randn(22, 1, 8, generator=g)
    steps = perf_decode.varlen_steps(q, kc, vc, kn, vn, counts, ws, rs)
    for name in ("dilated_kvcache_varlen_loop", "dilated_kvcache_varlen"):
        out = steps[name]()
        assert out.shape == (22, 2, 8)
        for b, (a, z) in enumerate(((0, 1), (1, 2), (2, 22))):
            assert torch.equal(kc[b, n - counts[b]:], kn[a:z]) and torch.equal(vc[b, n - counts[b]:], vn[a:z])
            q_row = torch.zeros(1, n, 2, 8, dtype=torch.float64)   # the oracle takes Nq = Nk: zeros in front
            q_row[0, n - counts[b]:] = q[a:z].double()
            want, _ = dilated_attention_naive(q_row, kc[b:b + 1].double(), vc[b:b + 1].double(), ws, rs, causal=True)
            torch.testing.assert_close(out[a:z].double(), want[0, n - counts[b]:], atol=1e-5, rtol=1e-5)


def test_perf_dcp_times_a_gloo_world_of_two_against_one_device(tmp_path, capsys):
    """Issue 33 item 5: `perf dcp` spawns a gloo world of 2 at a tiny shape and writes, per
    schedule, the sharded step, the merge, the single-device step (ms), the efficiency
    (single / (P x sharded)) and the sharded output's max_abs_err against one device (~0),
    labelled CPU/gloo; `perf table` reads them back. A cache that does not split into the
    world's pages is refused before anything is spawned."""
    from triton_dilated.perf import dcp
    out = tmp_path / "dcp.csv"
    assert main(["dcp", "--worlds", "2", "--keys", "256", "--batch", "2", "--heads", "4", "--kv-heads", "2",
                 "--head-dim", "16", "--page-size", "16", "--runs", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "decode context parallelism, CPU/gloo" in printed and "wrote 10 rows" in printed
    rows = results.read_csv(out)
    got = {(r["variant"], r["provider"], r["metric"]): r for r in rows}
    assert set(got) == {(s, p, "ms") for s in dcp.SCHEDULES for p in dcp.PROVIDERS} | {
        (s, "dcp_sharded", m) for s in dcp.SCHEDULES for m in ("efficiency", "max_abs_err")}
    assert {(r["op"], r["world_size"], r["N"], r["B"]) for r in rows} == {("decode_dcp", 2, 256, 2)}
    assert all("CPU/gloo" in ";".join(results._flags(r)) for r in rows)
    for s in dcp.SCHEDULES:
        ms = {p: got[(s, p, "ms")]["value"] for p in dcp.PROVIDERS}
        assert all(v > 0 for v in ms.values())
        assert got[(s, "dcp_sharded", "efficiency")]["value"] == pytest.approx(
            ms["dcp_single"] / 2 / ms["dcp_sharded"], rel=1e-4)
        assert got[(s, "dcp_sharded", "max_abs_err")]["value"] < 1e-5
    assert main(["table", str(out)]) == 0
    assert "dilated     2" in capsys.readouterr().out
    assert main(["dcp", "--worlds", "4", "--keys", "96", "--page-size", "16", "--out", str(tmp_path / "no.csv")]) == 2
    assert "keys (96) must be a multiple of world size x page size" in capsys.readouterr().err
    assert not (tmp_path / "no.csv").exists()


# ----------------------------------------------------------------------------- CLI rough edges (issue 24)

def test_sweep_names_an_unknown_provider_and_lists_the_known_ones(tmp_path, capsys):
    out = tmp_path / "s.csv"
    assert main(["--tiny", "--providers", "foo", "sdpa_dense", "--budget", "0", "--no-plot", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown provider 'foo'" in err and "triton, portable, head_group_loop, flex, gather, sdpa_dense" in err
    assert not out.exists()


def test_sweep_says_why_a_named_provider_has_no_rows(tmp_path, capsys, monkeypatch):
    # no Triton rows: a CPU without the interpreter, or a GPU the kernels cannot target
    monkeypatch.setattr(bench, "main_provider", lambda device: "portable")
    out = tmp_path / "s.csv"
    assert main(["--tiny", "--providers", "triton", "--budget", "0", "--no-plot", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    # the sweep runs on the GPU where torch sees one (perf/__main__._sweep), and says so
    why = "do not run on this GPU" if torch.cuda.is_available() else "CUDA GPU"
    assert "no rows for 'triton'" in err and why in err and "nothing to time" in err
    # one of two named providers missing: it says why, and times the other
    assert main(["--tiny", "--ops", "dilated", "--providers", "flex", "sdpa_dense", "--budget", "0", "--no-plot",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "no rows for 'flex'" in err and "block-sparse op only" in err
    assert {r["provider"] for r in _read(out)[1]} == {"sdpa_dense"}


def test_busy_rows_end_with_one_line_saying_what_to_do(capsys, monkeypatch, tmp_path):
    case = bench.tiny_sweep("cpu", 64)[0]
    base = dict(matmul_peak_tflops=0.1, machine="test", device="cpu")
    quiet = bench.group_rows(case, _measured([10.0] * 5, [30.0] * 5, [20.0] * 5, [60.0] * 5), {"portable"}, 0.1, base)
    busy = bench.group_rows(case, _measured([10.0] * 5, [30.0] * 5, [20.0] * 5, [60.0] * 5, other_cores=0.99),
                            {"portable"}, 0.1, base)
    assert results.busy_hint(quiet) == ""
    hint = results.busy_hint(busy, threads=2)
    assert hint.startswith("busy: 1 of 1 cases") and "0.99 cores" in hint and "OMP_NUM_THREADS=1" in hint
    assert "\n" not in hint and "2 torch threads" in hint and "OMP_WAIT_POLICY=PASSIVE" in hint
    monkeypatch.setattr(bench, "run_sweep", lambda *a, **k: busy)
    assert main(["--tiny", "--budget", "0", "--no-plot", "--out", str(tmp_path / "s.csv")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line for line in printed if "OMP_NUM_THREADS=1" in line] == [printed[-1]]


def test_aot_rejects_an_unknown_arch_in_one_line(capsys):
    """The help lists the architecture table's archs; an unknown one is one usage line naming them."""
    from triton_dilated.ops.common.hardware import ARCH_TABLE
    arch_help = next(a.help for a in _aot_parser()._actions if "--arch" in a.option_strings)
    assert "known: " + " ".join(n.removeprefix("sm") for n in ARCH_TABLE) in arch_help
    with pytest.raises(SystemExit) as exc:
        main(["aot", "--arch", "12"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown GPU architecture 'sm12'" in err and "sm90" in err and "gfx942" in err
    assert sum("unknown GPU architecture" in line for line in err.splitlines()) == 1


def _aot_parser():
    import argparse
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["aot"]


def _crash(job):
    os._exit(3)     # what an LLVM abort does to a compile worker


def test_aot_says_which_compile_crashed_its_process(monkeypatch):
    from triton_dilated.perf import aot
    monkeypatch.setattr(aot, "compile_one", _crash)
    with pytest.raises(aot.AotCrash, match=r"a compile process crashed .* sm80 dilated_fwd"):
        aot.run_aot(archs=[80], head_dims=[64], causal=[True], kernels=["dilated_fwd"], jobs=1, log=lambda *a: None)


def test_table_and_plot_read_the_decode_csv(tmp_path, capsys):
    decode_csv = ROOT / "perf" / "results" / "decode-cpu.csv"
    assert main(["table", str(decode_csv)]) == 0
    out = capsys.readouterr().out
    assert "time per decode step" in out and "KV cache per layer" in out and "131072" in out
    assert main(["plot", str(decode_csv), "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "decode-cpu-decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_and_ring_figures_say_what_they_show_and_keep_legends_off_the_points():
    """Issue 34 item 4: the decode figure's title said "(bfloat16, float32)" for float32 timings
    and a bfloat16 cache, its axis read 1024K for 1M; the ring figure's legends sat on its points."""
    rows = results.read_csv(ROOT / "perf" / "results" / "decode-cpu.csv")
    fig = _draw(plot.decode_figure(rows))
    assert "(timed in float32; cache memory in bfloat16)" in fig._suptitle.get_text()
    ticks = [t.get_text() for t in fig.axes[1].get_xticklabels()]
    assert ticks[-3:] == ["64K", "128K", "1M"], ticks
    assert all("e+" not in t.get_text() for ax in fig.axes for t in ax.get_yticklabels())     # 10000, not 1e+04
    assert [plot.count_label(n) for n in (512, 1024, 1536, 98304, 1 << 20, 3 << 19)] == \
        ["512", "1K", "1.5K", "96K", "1M", "1.5M"]
    fig = _draw(plot.ring_figure(results.read_csv(ROOT / "perf" / "results" / "ring-cpu.csv")))
    assert all(ax.get_legend() is None for ax in fig.axes)
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert len(labels) == len(set(labels)) == 8 and "dense ring_p2p fwd_bwd" in labels
    box = legend.get_window_extent()
    assert all(box.y1 <= ax.get_tightbbox().y0 + 1 for ax in fig.axes), "the legend overlaps a panel"


def test_plot_without_arguments_leaves_the_committed_results_alone(tmp_path, monkeypatch, capsys):
    """No arguments: the committed CSVs are plotted into perf/out/ under the working directory,
    not over the committed PNGs next to them."""
    committed = ROOT / "perf" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in committed.iterdir()}
    monkeypatch.chdir(tmp_path)
    assert main(["plot"]) == 0
    written = [line.removeprefix("wrote ") for line in capsys.readouterr().out.splitlines()]
    assert written and all(pathlib.Path(p).resolve().parent == tmp_path / "perf" / "out" for p in written)
    assert "ring-cpu-ring.png" in {pathlib.Path(p).name for p in written}
    assert {p.name: p.stat().st_mtime_ns for p in committed.iterdir()} == before


def test_ring_schemes_say_when_they_cannot_run():
    """perf ring's Ulysses and 2-D rows: which world sizes each scheme takes; CPU tables say
    what their timings are."""
    skip = perf_ring.scheme_skip
    assert skip("ulysses", 4, 4, 4096, "zigzag") is None and skip("usp", 4, 4, 4096, "zigzag") is None
    assert "heads to split over 3 ranks" in skip("ulysses", 3, 4, 4096, "contiguous")
    assert "at least 4" in skip("usp", 2, 4, 4096, "zigzag") and "multiple of 2" in skip("usp", 5, 10, 4000, "zigzag")
    assert "split over its 2 Ulysses ranks" in skip("usp", 4, 3, 4096, "zigzag")
    assert "not a multiple of 8" in skip("p2p", 4, 4, 100, "zigzag")
    row = results.make_row(op="ring_attention", variant="dense", provider="usp_2x2", mode="fwd", world_size=4,
                           metric="ms", value=1.0, device="cpu")
    assert perf_ring.ring_table([row]).startswith("CPU timings: gloo processes")
