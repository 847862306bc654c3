"""The benchmark CLI (`python -m triton_dilated.perf`): sweep rows, FLOP counting, tune JSON,
plots, ring fallback. Tiny shapes: under the interpreter every Triton call costs ~0.1-1 s."""
from __future__ import annotations

import csv
import json
import math

import pytest
import torch

import triton_dilated
from triton_dilated import layouts
from triton_dilated.ops.block_sparse.naive import element_mask
from triton_dilated import configs
from triton_dilated.ops.common import runtime
from triton_dilated.ops.common.hardware import Arch
from triton_dilated.perf import bench, plot
from triton_dilated.perf import ring as perf_ring
from triton_dilated.perf.__main__ import main

ONE_CALL = bench.Timing(warmup=0, budget_s=0.0, min_reps=1, max_reps=1, max_s=0.0)
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
    assert header == bench.COLUMNS
    assert len(written) == len(rows) > 0
    main_prov = bench.main_provider(device.type)
    seen = {(r["op"], r["provider"], r["mode"], r["metric"]) for r in written}
    for op in ("dilated_attention", "block_sparse_attention"):
        for prov in (main_prov, "sdpa_dense"):
            for mode in ("fwd", "fwd_bwd"):
                for metric in ("ms", "tflops", "pct_matmul_peak"):
                    assert (op, prov, mode, metric) in seen
    assert ("dilated_attention", "head_group_loop", "fwd", "ms") in seen
    for r in written:
        for col in ("op", "variant", "provider", "mode", "B", "N", "H", "Hkv", "D", "dtype", "causal", "density",
                    "gflop", "metric", "value", "matmul_peak_tflops") + PROVENANCE:
            assert r[col] != "", (col, r)
        value = float(r["value"])
        assert math.isfinite(value) and value > 0, r
        assert 0 < float(r["density"]) <= 1
        if r["provider"] == "triton":
            assert "BLOCK_M=" in r["config"]
        if r["op"] == "block_sparse_attention":
            assert r["layout"].startswith("local(") and r["block_size"] == "32"
        else:
            assert r["segment_lengths"] == "32/64" and r["dilation_rates"] == "1/2"
    table = bench.summary_table(bench.read_csv(out))
    assert "sdpa_dense" in table and "dilated_attention" in table


def test_flop_counts_match_dense_masks():
    from triton_dilated.perf.plot import dilated_multiplicity
    for mode, causal in (("longnet", False), ("longnet", True), ("head_groups", True)):
        case = bench.Case("dilated", mode, 2, 40, 3, 16, causal, torch.float32, "cpu", (16, 40), (1, 3))
        mult = dilated_multiplicity(40, (16, 40), (1, 3), 3, causal=causal, mode=mode)
        assert bench.dilated_pairs(case) == 2 * int(mult.sum())   # a key two patterns select counts twice
    lay = layouts.bigbird(100, 16, window=1, num_global_blocks=1, num_random=2, num_heads=3, causal=True)
    assert bench.layout_pairs(lay, 2, 3, 100, True) == 2 * int(element_mask(lay, 100, True).sum())
    lay = layouts.local(100, 32, window=1)
    assert bench.layout_pairs(lay, 1, 4, 100, False) == 4 * int(element_mask(lay, 100, False).sum())
    assert bench.dense_pairs(1, 1, 4, True) == 10
    assert bench.flops(10, 8, "fwd_bwd") == 3.5 * bench.flops(10, 8, "fwd") == 3.5 * 320


def test_cli_sweep_table_and_plot(tmp_path, capsys):
    out = tmp_path / "cli.csv"
    rc = main(["--tiny", "--seqlens", "64", "--ops", "block_sparse", "--providers", "portable", "sdpa_dense",
               "--budget", "0", "--no-plot", "--out", str(out)])
    assert rc == 0
    header, rows = _read(out)
    assert header == bench.COLUMNS and {r["provider"] for r in rows} == {"portable", "sdpa_dense"}
    printed = capsys.readouterr().out
    assert "times in ms" in printed
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
            assert set(saved["kernels"][kernel][key]) == set(tune.CONFIG_KEYS)
            assert cfg["ms"] > 0
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
            rows.append(bench.make_row(op="ring_attention", variant="dense", provider="ring_p2p", mode="fwd", B=1,
                                       N=4096, H=4, Hkv=4, D=64, dtype="float32", causal=True, world_size=p,
                                       metric=metric, value=value, machine="test"))
    path = tmp_path / "ring-test.csv"
    bench.write_csv(rows, path)
    assert "ring_p2p" in perf_ring.ring_table(bench.read_csv(path))
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
                    assert cfg == {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


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
    assert runtime.resolve_backend("auto", dev, need, 128, torch.float16) == "triton"
    assert runtime.resolve_backend("auto", dev, need, 64, torch.float32) == "torch"
    with pytest.raises(ValueError, match="backend='triton': .* cannot run head dim 256"):
        runtime.resolve_backend("triton", dev, need, 256, torch.float16)
    arch["now"] = Arch("sm80", (8, 0), 163 * 1024, 108, "fake")
    assert runtime.resolve_backend("auto", dev, need, 256, torch.float16) == "triton"
    assert runtime.resolve_backend("auto", dev, need, 256, torch.float32) == "triton"
