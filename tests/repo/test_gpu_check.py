"""perf/gpu_check.sh without a GPU: it stops at once with a clear message; `--dry-run` runs
every stage's logic (smoke, key rows, kernel breakdown, config A/B, block-sparse vs Flex,
ring step, tests) at tiny shapes under Triton's interpreter, in the GPU run's order, each
writing its rows; a failed smoke test stops the run. Plus the stage scripts' helpers."""
from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.paths import ROOT

SCRIPT = ROOT / "perf" / "gpu_check.sh"
STAGES = ["smoke", "key", "breakdown", "configs", "flex", "ringstep", "decode", "indexed", "tests"]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "perf" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_DILATED_TEST_DEVICE")}
    env.update({"PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **extra})
    return env


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: the script would run")
def test_without_a_gpu_it_stops_at_once_and_creates_nothing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no CUDA GPU visible to torch" in proc.stderr and "nothing was run" in proc.stderr
    assert "--dry-run" in proc.stderr
    assert not out.exists()


def test_a_failed_smoke_test_stops_the_run(tmp_path):
    """A Python whose smoke test fails (as with no C compiler): exit 3, no later stage ran."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/bash\nif [ "$1" = perf/gpu_smoke.py ]; then echo "FAIL: no C compiler"; exit 1; fi\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], env=_env(PYTHON=str(fake)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "smoke test failed" in proc.stdout and "FAIL: no C compiler" in (out / "env.txt").read_text()
    assert [r["stage"] for r in _rows(out / "stages.csv")] == ["smoke"]
    assert not (out / "key_rows.csv").exists()


def test_dry_run_runs_every_stage_in_order_and_each_writes_its_rows(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], env=_env(), capture_output=True, text=True,
                          timeout=1500)
    log = proc.stdout[-4000:] + proc.stderr[-2000:]
    stages = _rows(out / "stages.csv")
    assert [r["stage"] for r in stages] == STAGES, log
    assert all(r["exit"] == "0" for r in stages), log
    assert proc.returncode == 0, log
    assert "tiny Triton kernel on cpu: correct" in (out / "env.txt").read_text()

    key = _rows(out / "key_rows.csv")
    got = {(r["provider"], r["pass"], r["causal"]) for r in key if r["metric"] == "ms"}
    assert {(p, m, c) for p in ("triton", "sdpa_dense") for m in ("fwd", "fwd_bwd") for c in ("False", "True")} <= got
    picked = {r["config"] for r in key if r["provider"] == "sdpa_dense" and r["metric"] == "ms"}
    assert picked and all(c.startswith("default SDPA backend: ") and "unknown" not in c for c in picked), picked
    assert any(r["provider"] == "triton" and r["metric"] == "speedup_vs_best_dense" for r in key)

    breakdown = {(r["causal"], r["metric"]): float(r["value"]) for r in _rows(out / "kernel_breakdown.csv")}
    for causal in ("False", "True"):
        assert breakdown[(causal, "kernel_ms_delta")] > 0      # softmax_delta found inside its range
        assert breakdown[(causal, "wall_ms")] > 0

    ab = _rows(out / "config_ab.csv")
    assert {r["op"] for r in ab} == {"config_ab:dilated_fwd", "config_ab:dilated_bwd", "config_ab:block_sparse_fwd"}
    assert any(r["metric"] == "ratio_vs_default" and "BLOCK_M=16" in r["config"] for r in ab)
    # the default's variant switches are timed against it (the interpreter has FLAT_LOOP, not TMA)
    assert {r["op"] for r in ab if r["metric"] == "ratio_vs_default" and "FLAT_LOOP=0" in r["config"]} == {
        "config_ab:dilated_fwd", "config_ab:dilated_bwd"}

    flex = _rows(out / "block_sparse_vs_flex.csv")
    assert {"triton", "flex", "sdpa_dense"} <= {r["provider"] for r in flex}
    assert {"local", "bigbird"} == {r["variant"] for r in flex}

    ring = (out / "ring_step_vs_dense.txt").read_text()
    assert "steps/one" in ring and "ulysses/local" in ring
    assert {("dilated", m) for m in ("fwd", "fwd_bwd")} <= {
        tuple(line.split()[:2]) for line in ring.splitlines()}
    decode = _rows(out / "decode.csv")
    timed = {(r["provider"], r["B"]) for r in decode if r["metric"] == "ms" and r["value"]}
    assert {(p, b) for p in ("dilated", "dilated_kvcache", "dilated_kvcache_paged_fp8", "indexed_kvcache", "sdpa_dense")
            for b in ("1", "2")} <= timed
    indexed = _rows(out / "indexed.csv")   # the indexed kernels against the gather and dense, with the efficiency
    assert {(r["provider"], r["pass"]) for r in indexed if r["metric"] == "ms"} == {
        (p, m) for p in ("triton", "gather", "sdpa_dense") for m in ("fwd", "fwd_bwd")}
    assert {r["pass"] for r in indexed if r["metric"] == "efficiency" and r["provider"] == "triton"} == {"fwd", "fwd_bwd"}
    # the CUDA-graph step: a clear skipped row on the CPU; the FP8 error and the CPU host rows
    assert {r["flags"] for r in decode if r["provider"] == "dilated_kvcache_graph"} == {
        "skipped: CUDA graphs need a GPU (CPU run)"}
    assert {r["provider"] for r in decode if r["metric"] == "max_abs_err"} == {"dilated_kvcache_paged_fp8"}
    assert {r["provider"] for r in decode if r["metric"] == "host_ms"} == {"dilated_kvcache",
                                                                         "dilated_kvcache_paged_fp8", "aten_op"}
    assert " passed" in (out / "tests.log").read_text()
    assert "== results ==" in proc.stdout
    # every result row in one file named after the card (the dry run's "machine" is the CPU)
    combined = _rows(out / "cpu.csv")
    assert {r["stage"] for r in combined} == {"key_rows", "kernel_breakdown", "config_ab", "block_sparse_vs_flex",
                                              "decode", "indexed"}
    assert len(combined) == sum(len(_rows(out / f"{s}.csv")) for s in {r["stage"] for r in combined})
    assert "commit it as perf/results/cpu.csv" in proc.stdout


def test_card_names():
    from triton_dilated.perf.results import card_name
    assert card_name("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert card_name("NVIDIA B200") == "b200"
    assert card_name("AMD Instinct MI300X") == "instinct-mi300x"
    assert card_name("cpu (x86_64, 2 cores)") == "cpu"


def test_breakdown_buckets_gpu_kernels_and_the_delta_range():
    """Checked example: 3 iterations; delta is its profiler range's device time, the rest is
    what the named buckets leave of all GPU kernels."""
    kb = _load("kernel_breakdown")
    entries = [  # (name, is GPU kernel, device us, self device us, cpu us)
        ("_dilated_fwd_kernel", True, 3000.0, 3000.0, 0.0),
        ("_dilated_bwd_dq_kernel", True, 6000.0, 6000.0, 0.0),
        ("_dilated_bwd_dkdv_kernel", True, 9000.0, 9000.0, 0.0),
        (kb.DELTA_RANGE, False, 600.0, 0.0, 50.0),
        ("void at::native::reduce_kernel<...>", True, 600.0, 600.0, 0.0),     # the delta einsum's kernel
        ("void at::native::vectorized_elementwise_kernel<...>", True, 300.0, 300.0, 0.0),   # zeroing
        ("aten::einsum", False, 600.0, 0.0, 40.0),
    ]
    ms, names, total = kb.breakdown(entries, iters=3)
    assert ms == pytest.approx({"fwd": 1.0, "dq": 2.0, "dkdv": 3.0, "delta": 0.2, "other": 0.1})
    assert total == pytest.approx(6.3)
    assert names["dq"] == ["_dilated_bwd_dq_kernel"] and names["delta"] == [kb.DELTA_RANGE]


def test_sdpa_backend_is_read_off_the_dispatcher_op():
    kr = _load("gpu_key_rows")
    assert kr.backend_of_ops(["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_cudnn_attention",
                              "cudnn_generated_fort_native_sdpa"]) == "CUDNN_ATTENTION"
    assert kr.backend_of_ops(["aten::_scaled_dot_product_flash_attention", "pytorch_flash::flash_fwd_kernel"]) \
        == "FLASH_ATTENTION"
    assert kr.backend_of_ops(["aten::_scaled_dot_product_efficient_attention"]) == "EFFICIENT_ATTENTION"
    assert kr.backend_of_ops(["aten::matmul", "aten::softmax"]) == "unknown"
    q = torch.randn(1, 64, 2, 16)
    assert kr.default_sdpa_backend(q, q, q, causal=True) in ("FLASH_ATTENTION", "MATH")   # a CPU's choices


def test_smoke_finds_the_compiler_triton_would_use(monkeypatch):
    smoke = _load("gpu_smoke")
    monkeypatch.setenv("CC", "/opt/my-cc")
    assert smoke.c_compiler() == "/opt/my-cc"
    header = smoke.python_header()
    assert header is None or header.endswith("Python.h") and os.path.exists(header)


def test_stage_limits_fit_in_9_minutes_in_the_issue_order():
    """Read off the script: the stages in the order of the most valuable numbers first, and
    the limits (+ 5 s kill grace each, the GPU check before, the tables after) within 540 s."""
    import re
    text = SCRIPT.read_text()
    stages = re.findall(r"^(?:if ! )?stage (\w+) (\d+) ", text, re.M)
    assert [name for name, _ in stages] == STAGES
    grace = int(re.search(r'timeout -k (\d+) "\$limit"', text).group(1))
    gpu_check = sum(map(int, re.search(r'timeout -k (\d+) (\d+) "\$PY" -c "import sys, torch', text).groups()))
    tables = int(re.search(r"timeout -k (\d+) \$\(\( (\d+) \* SCALE", text).group(1)) + \
        int(re.search(r"timeout -k (\d+) \$\(\( (\d+) \* SCALE", text).group(2))
    assert sum(int(limit) + grace for _, limit in stages) + gpu_check + tables <= 540
