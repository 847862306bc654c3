"""Every Triton kernel compiled ahead of time for sm90 and sm80 (no GPU needed): the CPU
interpreter cannot see compile-only errors (a variable whose type differs between the
branches of a runtime `if` once broke the block-sparse kernels on GPUs only), so CI
compiles each kernel with the config the library picks on those archs, at head dims 64, 128
and 256 (causal), and checks what the compiler made of it, so a regression fails here:

* sm90 (16-bit): every forward kernel at D <= 128, and the dQ kernels where the defaults
  give them 64-row tiles, run on wgmma with no MMA tile computed twice (BLOCK_M >= 16 x
  num_warps: 8 warps on 64 rows make both warpgroups compute the same S);
* sm90 (16-bit), D = 64 and 128: the dilated backward, dQ and dK/dV (S^T = K Q^T: the key
  tile is the M dimension), and the block-sparse and ring step dK/dV (likewise S^T), run on
  wgmma only, with no register spills;
* no register spills outside the known list below (which may only shrink);
* the dilated forward and dQ kernels (with the default FLAT_LOOP: the key blocks of all
  patterns in one flat loop) stay software-pipelined (cp.async into num_stages rotating
  buffers on sm90, num_stages - 1 on sm80) and spill no register at D <= 128;
* the block-sparse and ring step kernels (forward, dQ, dK/dV) at D <= 128 are
  software-pipelined (cp.async into at least 2 rotating buffers: their loops walk lists of
  active tiles with no load under a runtime `if`) and spill no register.

Not yet true, so not asserted (issue 12): dK/dV on wgmma at D = 256 (every wgmma tile
spills 0.1-5 KB there: the dilated, block-sparse and ring step dK/dV stay on mma.sync); TMA
(cp.async.bulk) in any default config. The experimental TMA variant of the block-sparse
forward (config TMA = 1, AOT name block_sparse_fwd_tma) is compiled on its own: on sm90 its
K/V loads are TMA copies, pipelined, on wgmma, no spills.
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from triton_dilated.perf.aot import KERNELS, ptx_counts

HEAD_DIMS = ("64", "128", "256")
FORWARD = ("dilated_fwd", "block_sparse_fwd", "ring_step_fwd")
LIST_KERNELS = ("block_sparse_fwd", "block_sparse_bwd_dq", "block_sparse_bwd_dkdv", "ring_step_fwd", "ring_step_bwd_dq",
                "ring_step_bwd_dkdv")
# (arch, kernel, D) that spill registers with the default configs today (causal, bf16;
# perf/aot/defaults-bf16-2026-11-26-triton36.csv, -triton39.csv). Triton 3.6 is what the GPU machines
# run; other versions allocate registers differently. Remove an entry when it stops
# spilling; never add one without a reason in the configs.
SPILLS_TRITON_36 = {
    ("sm90", "ring_step_bwd_dq", "256"),       # 32x32 w8: 16 B (3.6 gives it 128 registers)
    ("sm80", "ring_step_fwd", "256"),
    # the ring step's tile-list pre-pass (the dilated mask of a whole tile, once per step) with
    # 8 warps or 32-row tiles (8-12 B)
    ("sm80", "ring_step_lists", "128"), ("sm80", "ring_step_lists", "256"),
}
SPILLS_TRITON_39 = {
    ("sm90", "ring_step_fwd", "256"),
    ("sm80", "ring_step_fwd", "256"),
}


def known_spills() -> set:
    import triton
    version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    return {(3, 6): SPILLS_TRITON_36, (3, 9): SPILLS_TRITON_39}.get(version, SPILLS_TRITON_36 | SPILLS_TRITON_39)

def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return os.path.exists(get_ptxas(90).path) and os.path.exists(get_ptxas(80).path)
    except Exception:  # noqa: BLE001
        return False


needs_ptxas = pytest.mark.skipif(not _ptxas_available(), reason="triton's NVIDIA backend (ptxas) is not installed")


@pytest.fixture(scope="module")
def aot(tmp_path_factory):
    """One AOT run (sm90, sm80; D = 64, 128, 256; causal; default configs): (rows, PTX dir, output)."""
    tmp = tmp_path_factory.mktemp("aot")
    out, ptx = tmp / "aot.csv", tmp / "ptx"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "triton_dilated.perf", "aot", "--arch", "90", "80", "--head-dims",
                           *HEAD_DIMS, "--causal", "yes", "--out", str(out), "--ptx-dir", str(ptx)], env=env,
                          capture_output=True, text=True, timeout=1800)
    with open(out) as f:
        rows = list(csv.DictReader(f))
    return rows, ptx, proc


@needs_ptxas
def test_every_kernel_compiles_for_sm90_and_sm80(aot):
    rows, _, proc = aot
    assert {(r["arch"], r["kernel"], r["D"]) for r in rows} == {(a, k, d) for a in ("sm90", "sm80") for k in KERNELS
                                                                for d in HEAD_DIMS}
    failed = [f"{r['arch']} {r['kernel']} D={r['D']}: {r['error']}" for r in rows if r["error"]]
    assert not failed, "\n".join(failed)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for r in rows:   # ptxas -v was parsed
        assert int(r["registers"]) > 0 and int(r["shared_bytes"]) > 0


@needs_ptxas
def test_ptx_dir_holds_each_kernels_ptx(aot):
    """--ptx-dir: DIR/sm<arch>/<kernel>-<dtype>-d<D>-c<causal>.ptx, and the counts in the CSV
    are those of that PTX."""
    rows, ptx, _ = aot
    for r in rows:
        text = (ptx / r["arch"] / f"{r['kernel']}-bf16-d{r['D']}-c1.ptx").read_text()
        assert f".target sm_{r['arch'][2:]}" in text
        counts = ptx_counts(text)
        assert (counts["wgmma"], counts["mma_sync"], counts["cp_async"]) == \
            (int(r["wgmma"]), int(r["mma_sync"]), int(r["cp_async"])), r["kernel"]


@needs_ptxas
def test_sm90_forward_and_dq_kernels_use_wgmma_on_their_own_rows(aot):
    rows, _, _ = aot
    sm90 = {(r["kernel"], r["D"]): r for r in rows if r["arch"] == "sm90"}
    wgmma_kernels = [(k, d) for k in FORWARD for d in ("64", "128")]
    wgmma_kernels += [(k, "64") for k in ("dilated_bwd_dq", "block_sparse_bwd_dq", "ring_step_bwd_dq")]
    wgmma_kernels += [("block_sparse_bwd_dq", "128"), ("ring_step_bwd_dq", "128"), ("dilated_fwd", "256"),
                      ("block_sparse_fwd", "256"), ("block_sparse_bwd_dq", "256")]
    bad = []
    for key in wgmma_kernels:
        r = sm90[key]
        if not (int(r["wgmma"]) > 0 and int(r["mma_sync"]) == 0 and r["mma_replicated"] == "0"
                and int(r["BLOCK_M"]) >= 16 * int(r["num_warps"])):
            bad.append(f"{key}: {r['BLOCK_M']}x{r['BLOCK_N']} w{r['num_warps']}: wgmma {r['wgmma']}, mma.sync "
                       f"{r['mma_sync']}, replicated {r['mma_replicated']}, layouts {r['mma_layouts']}")
    assert not bad, "\n".join(bad)
    # no MMA tile computed twice by the sm90 defaults at D <= 128, forward or backward
    replicated = [k for k, r in sm90.items() if r["D"] != "256" and r["mma_replicated"] != "0"]
    assert not replicated, replicated


@needs_ptxas
def test_sm90_dilated_backward_on_wgmma_without_spills(aot):
    rows, _, _ = aot
    bad = [f"{r['kernel']} D={r['D']} {r['BLOCK_M']}x{r['BLOCK_N']} w{r['num_warps']}: wgmma {r['wgmma']}, "
           f"mma.sync {r['mma_sync']}, replicated {r['mma_replicated']}, spills {r['spill_stores']} B"
           for r in rows if r["arch"] == "sm90" and r["kernel"] in ("dilated_bwd_dq", "dilated_bwd_dkdv")
           and r["D"] in ("64", "128")
           and not (int(r["wgmma"]) > 0 and int(r["mma_sync"]) == 0 and r["mma_replicated"] == "0"
                    and int(r["spill_stores"]) == 0)]
    assert not bad, "\n".join(bad)


@needs_ptxas
def test_sm90_block_sparse_dkdv_on_wgmma_without_spills(aot):
    """S^T = K Q^T with 128-key tiles on 8 warps: every dK/dV product on wgmma at D <= 128."""
    rows, _, _ = aot
    bad = [f"D={r['D']} {r['BLOCK_M']}x{r['BLOCK_N']} w{r['num_warps']}: wgmma {r['wgmma']}, mma.sync "
           f"{r['mma_sync']}, replicated {r['mma_replicated']}, spills {r['spill_stores']} B"
           for r in rows if r["arch"] == "sm90" and r["kernel"] == "block_sparse_bwd_dkdv" and r["D"] in ("64", "128")
           and not (int(r["wgmma"]) > 0 and int(r["mma_sync"]) == 0 and r["mma_replicated"] == "0"
                    and int(r["spill_stores"]) == 0)]
    assert not bad, "\n".join(bad)
    assert len([r for r in rows if r["arch"] == "sm90" and r["kernel"] == "block_sparse_bwd_dkdv"
                and r["D"] in ("64", "128")]) == 2


@needs_ptxas
def test_sm90_ring_step_dkdv_on_wgmma_without_spills(aot):
    rows, _, _ = aot
    bad = [f"D={r['D']} {r['BLOCK_M']}x{r['BLOCK_N']} w{r['num_warps']} s{r['num_stages']}: wgmma {r['wgmma']}, "
           f"mma.sync {r['mma_sync']}, replicated {r['mma_replicated']}, spills {r['spill_stores']} B, "
           f"cp.async {r['cp_async']}, pipeline depth {r['pipeline_depth']}"
           for r in rows if r["arch"] == "sm90" and r["kernel"] == "ring_step_bwd_dkdv" and r["D"] in ("64", "128")
           and not (int(r["wgmma"]) > 0 and int(r["mma_sync"]) == 0 and r["mma_replicated"] == "0"
                    and int(r["spill_stores"]) == 0 and int(r["cp_async"]) > 0 and int(r["pipeline_depth"]) >= 2)]
    assert not bad, "\n".join(bad)


@needs_ptxas
def test_no_register_spills_beyond_the_known_ones(aot):
    rows, _, _ = aot
    spilled = {(r["arch"], r["kernel"], r["D"]): r["spill_stores"] for r in rows if int(r["spill_stores"])}
    new = {k: v for k, v in spilled.items() if k not in known_spills()}
    assert not new, f"new register spills (bytes stored) with the default configs: {new}"


@needs_ptxas
def test_the_dilated_forward_and_dq_are_software_pipelined(aot):
    rows, _, _ = aot
    for r in rows:
        if r["kernel"] in ("dilated_fwd", "dilated_bwd_dq"):   # sm90 rotates num_stages buffers, sm80 num_stages - 1
            depth = int(r["num_stages"]) - (r["arch"] == "sm80")
            assert int(r["cp_async"]) > 0 and int(r["pipeline_depth"]) >= depth >= 1, (r["arch"], r["kernel"], r["D"])
            if r["D"] != "256":
                assert r["spill_stores"] == "0", (r["arch"], r["kernel"], r["D"], r["spill_stores"])
        assert r["cp_async_bulk"] == "0"   # no TMA yet: a change here wants a look (and this line updated)


@needs_ptxas
def test_block_sparse_and_ring_step_kernels_are_pipelined_without_spills(aot):
    rows, _, _ = aot
    bad = [f"{r['arch']} {r['kernel']} D={r['D']} {r['BLOCK_M']}x{r['BLOCK_N']} w{r['num_warps']} s{r['num_stages']}: "
           f"cp.async {r['cp_async']}, pipeline depth {r['pipeline_depth']}, spills {r['spill_stores']} B"
           for r in rows if r["kernel"] in LIST_KERNELS and r["D"] in ("64", "128")
           and not (int(r["cp_async"]) > 0 and int(r["pipeline_depth"]) >= 2 and int(r["spill_stores"]) == 0)]
    assert not bad, "\n".join(bad)


def test_aot_compiles_the_launchers_flat_loop_default():
    """The AOT compile of the dilated forward and dQ takes FLAT_LOOP from the variant's spec;
    the launchers' default is the switch's in configs.VARIANT_SWITCHES: the same value, so CI
    checks what runs."""
    from triton_dilated.ops.common.configs import VARIANT_SWITCHES
    from triton_dilated.ops.dilated.spec import SPEC
    for family in ("dilated_fwd", "dilated_bwd"):
        assert SPEC.aot_constexprs["FLAT_LOOP"] == VARIANT_SWITCHES[family]["FLAT_LOOP"].values[0]


def test_kernels_compile_with_integer_arguments_equal_to_one():
    """Triton passes an integer argument equal to 1 as a constexpr (N = 1, one head, a
    stride of 1); `N.to(...)` on it compiled in the interpreter and failed on the first GPU
    run (block-sparse dQ and dilated dK/dV with N = 1). Every kernel and variant through
    Triton's front end with all its integer arguments at 1 (no ptxas: seconds)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from triton_dilated.perf.aot import scalar_one_errors\n"
            "errors = scalar_one_errors()\nprint('\\n'.join(errors) or 'all compiled')")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("all compiled"), proc.stdout[-4000:]


@needs_ptxas
def test_block_sparse_forward_tma_variant_on_sm90(tmp_path):
    """block_sparse_fwd_tma (the sm90 default tiles with TMA = 1): K and V arrive by TMA
    (cp.async.bulk; the only cp.async left are the 4-byte block-list entries), through a
    software pipeline of at least 2 buffers, into wgmma with no MMA tile computed twice and
    no register spill, at D = 64, 128 and 256, causal and not."""
    out = tmp_path / "tma.csv"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "triton_dilated.perf", "aot", "--arch", "90", "--head-dims",
                           *HEAD_DIMS, "--kernels", "block_sparse_fwd_tma", "--jobs", "1", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert {(r["D"], r["causal"]) for r in rows} == {(d, c) for d in HEAD_DIMS for c in ("0", "1")}
    bad = [f"D={r['D']} causal={r['causal']} {r['BLOCK_M']}x{r['BLOCK_N']} w{r['num_warps']}: cp.async.bulk "
           f"{r['cp_async_bulk']}, cp.async {r['cp_async']}, depth {r['pipeline_depth']}, wgmma {r['wgmma']}, "
           f"mma.sync {r['mma_sync']}, replicated {r['mma_replicated']}, spills {r['spill_stores']} B {r['error']}"
           for r in rows
           if r["error"] or not (int(r["cp_async_bulk"]) > 0 and int(r["cp_async"]) <= 3
                                 and int(r["pipeline_depth"]) >= 2 and int(r["wgmma"]) > 0 and r["mma_sync"] == "0"
                                 and r["mma_replicated"] == "0" and r["spill_stores"] == "0")]
    assert not bad, "\n".join(bad)


def _spill_report(rows):
    """One line per row that failed to compile or spilled registers ("" when none did)."""
    return "\n".join(f"{r['arch']} {r['kernel']}: {r['registers']} registers, spills {r['spill_stores']} B "
                     f"{r['error']}" for r in rows if r["error"] or r["spill_stores"] != "0")


def _aot_rows(out, *args, timeout=900):
    """Run `python -m triton_dilated.perf aot *args --out out` compiled (TRITON_INTERPRET
    unset); its CSV rows (the run must succeed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "triton_dilated.perf", "aot", *args, "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(out) as f:
        return list(csv.DictReader(f))


@needs_ptxas
def test_paged_decode_variants_compile_without_spills(tmp_path):
    """The decode kernels on a paged cache (PAGE_SIZE = 16: each key's page read from the
    block table) compile for sm90 and sm80 at their launchers' default tiles, D = 128,
    without a register spill (an unaligned page stride had made every load scalar: 255
    registers and spills)."""
    rows = _aot_rows(tmp_path / "paged.csv", "--arch", "90", "80", "--head-dims", "128", "--causal", "yes",
                     "--kernels", "dilated_decode_paged", "block_sparse_decode_paged", "--jobs", "1")
    assert len(rows) == 4
    bad = [f"{r['arch']} {r['kernel']} {r['BLOCK_N']} w{r['num_warps']}: {r['registers']} registers, spills "
           f"{r['spill_stores']} B {r['error']}" for r in rows
           if r["error"] or r["spill_stores"] != "0" or r["BLOCK_M"] != "16"]
    assert not bad, "\n".join(bad)


@needs_ptxas
def test_leftpad_and_window_variants_compile_without_spills(tmp_path):
    """The serve doors' cache_leftpad (HAS_LEFTPAD: each row's pad read in the decode kernels)
    and dilated attention's window_size (HAS_WINDOW in the forward, dQ and dK/dV kernels) compile
    for sm90 and sm80 at D = 128, causal, the launchers' default tiles, without errors; no spill
    but the one recorded (perf/aot/dilated-window-sm90-sm80-bf16-triton39.csv: sm90 dK/dV, 16 B)."""
    rows = _aot_rows(tmp_path / "features.csv", "--arch", "90", "80", "--head-dims", "128", "--causal", "yes",
                     "--kernels", "dilated_decode_leftpad", "block_sparse_decode_leftpad", "dilated_fwd_window",
                     "dilated_bwd_dq_window", "dilated_bwd_dkdv_window", "--jobs", "1")
    assert len(rows) == 10
    errors = [f"{r['arch']} {r['kernel']}: {r['error']}" for r in rows if r["error"]]
    assert not errors, "\n".join(errors)
    spills = {(r["arch"], r["kernel"]) for r in rows if r["spill_stores"] != "0"}
    assert spills <= {("sm90", "dilated_bwd_dkdv_window")}, spills


@needs_ptxas
def test_dilated_decode_window_variants_compile_without_spills(tmp_path):
    """window_size= on the dilated serve door (HAS_WINDOW in the decode kernel: each pattern's
    run cut from its front, the window a run-time int32), with and without cache_leftpad,
    compiles for sm90 and sm80 at D = 128, causal, the launcher's default tiles: no error, no
    spill."""
    rows = _aot_rows(tmp_path / "decode-window.csv", "--arch", "90", "80", "--head-dims", "128", "--causal", "yes",
                     "--kernels", "dilated_decode_window", "dilated_decode_leftpad_window", "--jobs", "1")
    assert len(rows) == 4
    report = _spill_report(rows)
    assert not report, report


@needs_ptxas
def test_fp8_decode_variants_compile_without_spills(tmp_path):
    """The decode kernels on an FP8 cache at D = 128, causal, their launchers' default tiles:
    on sm90 through Triton's fp8e4nv conversion (KV_FP8 = 1), contiguous and paged; on sm80,
    where Triton has no fp8e4nv, from the cache's bytes (KV_FP8 = 2, paged): no register spill
    (perf/aot/decode-fp8-bf16-triton39.csv: 96-128 registers on sm90, 124-125 on sm80)."""
    rows = []
    for arch, kernels in (("90", ["dilated_decode_fp8", "block_sparse_decode_fp8_paged"]),
                          ("80", ["dilated_decode_fp8_bytes_paged", "block_sparse_decode_fp8_bytes_paged"])):
        rows += _aot_rows(tmp_path / f"fp8-{arch}.csv", "--arch", arch, "--head-dims", "128", "--causal", "yes",
                          "--kernels", *kernels)
    assert len(rows) == 4
    report = _spill_report(rows)
    assert not report, report


@needs_ptxas
def test_append_rotary_variants_compile_without_spills(tmp_path):
    """The serve doors' append (a kernel of no variant, compiled when named) plain and with
    FlashAttention's rotary fused (64 rotary features: GPT-NeoX pairs into a contiguous cache,
    GPT-J pairs into a paged FP8 cache, rotated then quantised, the extra programs writing the
    rotated q) compiles for sm90 and sm80 at D = 64 and 128 with its launcher's one warp: no
    error, no spill."""
    rows = _aot_rows(tmp_path / "append.csv", "--arch", "90", "80", "--head-dims", "64", "128", "--causal", "yes",
                     "--kernels", "append", "append_rotary", "append_rotary_fp8_paged", "--jobs", "2")
    assert len(rows) == 12 and {r["num_warps"] for r in rows} == {"1"}
    report = _spill_report(rows)
    assert not report, report


@needs_ptxas
def test_sliding_window_variants_compile_without_spills(tmp_path):
    """The kernels with the sliding-window predicate compiled in (WINDOW 128, 4 sink tokens;
    issue 23) at D = 128, where registers are tightest, sm90 and sm80: the block-sparse
    forward, dQ and dK/dV and the ring step's dK/dV at the stages its launcher runs
    (perf/aot/window-sm90-sm80-bf16-triton39.csv has every row)."""
    kernels = ["block_sparse_fwd_window", "block_sparse_bwd_dq_window", "block_sparse_bwd_dkdv_window",
               "ring_step_bwd_dkdv_window_d128"]
    rows = _aot_rows(tmp_path / "window.csv", "--arch", "90", "80", "--head-dims", "128", "--causal", "yes",
                     "--kernels", *kernels, "--jobs", "2")
    assert len(rows) == 8
    report = _spill_report(rows)
    assert not report, report


@needs_ptxas
def test_volta_turing_backward_at_d128_in_registers(tmp_path):
    """sm70/sm75 (FMA-loop dots): with the head-dim contractions in 64-wide pieces (DOT_PIECES)
    the D = 128 backward defaults fit in registers; the two that spilled most without them
    (sm70 ring-step dK/dV 124 B, sm75 block-sparse dQ 12 B; perf/aot/sm75-sm70-fma-w8-triton39.csv)
    compile without a spill and without a tensor-core instruction."""
    rows = _aot_rows(tmp_path / "fma.csv", "--arch", "70", "75", "--head-dims", "128", "--causal", "no",
                     "--kernels", "ring_step_bwd_dkdv", "block_sparse_bwd_dq", "--jobs", "2")
    assert len(rows) == 4
    bad = [r for r in rows if r["error"] or r["spill_stores"] != "0" or int(r["mma_sync"]) or int(r["wgmma"])]
    assert not bad, bad


@needs_ptxas
def test_block_sparse_forward_warp_specialized_on_sm100(tmp_path):
    """block_sparse_fwd_ws (WARP_SPEC = 1 on the sm100 default tiles, K/V by TMA): Triton
    splits the full-block loop into partitions beside the default one (TTGIR
    ttg.warp_specialize), each warp group with its register budget (setmaxnreg in the PTX),
    on tcgen05 MMAs and TMA copies, with no register spill, at D = 64 and 128 (causal)."""
    rows = _aot_rows(tmp_path / "ws.csv", "--arch", "100", "--head-dims", "64", "128", "--causal", "yes",
                     "--kernels", "block_sparse_fwd_ws")
    assert {r["D"] for r in rows} == {"64", "128"}
    bad = [r for r in rows if r["error"] or not (int(r["ws_partitions"]) >= 2 and int(r["setmaxnreg"]) > 0
                                                 and int(r["tcgen05"]) > 0 and int(r["cp_async_bulk"]) > 0
                                                 and r["spill_stores"] == "0")]
    assert not bad, bad


def test_sm90_16bit_defaults_never_put_8_warps_on_64_rows():
    """The config rule itself (no compile): on sm90 every 16-bit default with 8 warps has
    128-row tiles, and every forward default at D <= 128 has BLOCK_M >= 16 x num_warps."""
    import torch

    from triton_dilated.ops.common.configs import default_config
    from triton_dilated.ops.common.hardware import Arch
    arch = Arch("sm90", (9, 0), 227 * 1024, 132, "fake")
    for family, kernel in (("dilated_fwd", None), ("block_sparse_fwd", None), ("ring_step_fwd", None),
                           ("dilated_bwd", None), ("dilated_bwd", "dilated_bwd_dkdv"), ("block_sparse_bwd", None),
                           ("block_sparse_bwd", "block_sparse_bwd_dkdv"), ("ring_step_bwd", None),
                           ("ring_step_bwd", "ring_step_bwd_dkdv")):
        for d in (16, 32, 64, 128, 256):
            for dtype in (torch.bfloat16, torch.float16):
                cfg = default_config(family, d, arch, dtype, kernel)
                if family.endswith("_fwd") and d <= 128:
                    assert cfg["BLOCK_M"] >= 16 * cfg["num_warps"], (family, d, cfg)
                if cfg["num_warps"] == 8 and d <= 128:
                    assert cfg["BLOCK_M"] == 128, (family, d, cfg)


def test_ptx_counts_checked_example():
    """The PTX/TTGIR reader on a hand-written excerpt: predicated instructions count, the TMA
    copy is not a cp.async, the 3-buffer ring is the pipeline depth, and an 8-warp layout on
    a 64-row tile is flagged as replicated (a 4-warp one on 64 x 128 is not)."""
    ptx = "\n".join([
        "\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 1;",
        "\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 1;",
        "\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 1;",
        "\twgmma.fence.sync.aligned;",
        "\t@%p3 cp.async.cg.shared.global [ %r1 + 0 ], [ %rd3 + 0 ], 0x10, %r2;",
        "\tcp.async.ca.shared.global [ %r1 + 0 ], [ %rd3 + 0 ], 0x4;",
        "\tcp.async.commit_group;",
        "\tcp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd4, {%r5, %r6}], [%r7];",
        "\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};",
        "// mma.sync in a comment does not count",
    ])
    ttgir = "\n".join([
        "#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 32, 16]}>",
        "#mma1 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [16, 128, 16]}>",
        "%0 = ttg.local_alloc : () -> !ttg.memdesc<3x64x128xbf16, #shared, #smem, mutable>",
        "%1 = ttg.local_alloc : () -> !ttg.memdesc<2x64x128xbf16, #shared, #smem, mutable>",
        "%2 = tt.dot %a, %b, %c : tensor<64x64xf32, #mma>",
        "%3 = tt.dot %p, %v, %acc : tensor<64x128xf32, #mma1>",
        "%4 = tt.expand_dims %m : tensor<64x1xf32, #mma>",
    ])
    got = ptx_counts(ptx, ttgir)
    assert got == dict(wgmma=3, mma_sync=1, cp_async=2, cp_async_bulk=1, tcgen05=0, ws_partitions=0, setmaxnreg=0,
                       pipeline_depth=3, mma_replicated=1, wgmma_shapes="m64n64k16:2 m64n128k16:1",
                       mma_layouts="v3[4,1]n128 v3[8,1]n32")
    # warp specialization: the partitions of ttg.warp_specialize, each warp group's setmaxnreg
    ws_ttgir = "%0:3 = ttg.warp_specialize(%a, %b)\n    default {\n    partition0(%x: i32) num_warps(1) {\n" \
               "    partition1(%x: i32) num_warps(4) {\n"
    ws_ptx = "\tsetmaxnreg.dec.sync.aligned.u32 \t88;\n\t@%p1 setmaxnreg.inc.sync.aligned.u32 \t256;\n// setmaxnreg.dec"
    assert (ptx_counts(ws_ptx, ws_ttgir)["ws_partitions"], ptx_counts(ws_ptx, ws_ttgir)["setmaxnreg"]) == (2, 2)
    four_warps = ttgir.replace("warpsPerCTA = [8, 1], instrShape = [16, 32", "warpsPerCTA = [4, 1], instrShape = [16, 64")
    assert ptx_counts(ptx, four_warps)["mma_replicated"] == 0
    assert ptx_counts("", "")["pipeline_depth"] == 0


def test_aot_configs_option_names_what_it_expects(monkeypatch, capsys):
    from triton_dilated.perf.__main__ import main
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["aot", "--configs", "64,64,4"]) == 2
    assert "--configs takes BLOCK_M,BLOCK_N,num_warps,num_stages (four integers, e.g. 64,64,4,3); got 64,64,4" \
        in capsys.readouterr().err


def test_aot_arch_option_knows_the_architecture_table(capsys):
    """--arch takes compute capabilities (90, sm90) and AMD names (gfx942); an arch the table
    does not know is one clear usage error naming the known ones (was: an LLVM error per
    compile and a BrokenProcessPool traceback for --arch 12)."""
    from triton_dilated.perf.__main__ import _aot_arch, main
    assert (_aot_arch("90"), _aot_arch("sm120"), _aot_arch("gfx942"), _aot_arch("87")) == (90, 120, "gfx942", 87)
    with pytest.raises(SystemExit) as exc:
        main(["aot", "--arch", "12"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown GPU architecture 'sm12': known are sm70, sm75, sm80, sm86, sm89, sm90, sm100, sm120, gfx942, gfx950" \
        in err and err.count("\n") == 1


@pytest.mark.parametrize("arch", ["999", "91", "sm122", "101", "gfx940"])
def test_aot_arch_refuses_what_triton_cannot_compile(arch, capsys):
    """Issue 34 item 1: --arch 999 took the nearest row of the table (sm120) and crashed LLVM
    ("Cannot select: intrinsic") in the compile processes. An arch Triton's compiler does not
    target is one usage line listing the ones it does (perf.__main__.AOT_NVIDIA, AOT_AMD)."""
    from triton_dilated.perf.__main__ import AOT_AMD, AOT_NVIDIA, main
    with pytest.raises(SystemExit) as exc:
        main(["aot", "--arch", arch])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    name = arch if arch.startswith(("sm", "gfx")) else f"sm{arch}"
    assert f"Triton cannot compile for {name!r}" in err and " ".join(AOT_AMD) in err
    assert f"capabilities are {' '.join(map(str, AOT_NVIDIA))}," in err


@pytest.fixture(scope="module")
def aot_other_archs(tmp_path_factory):
    """A representative AOT set beyond sm90/sm80 (issue 20): forward, dQ and dK/dV of each
    variant at D = 128, causal, for consumer Blackwell (sm120, mma.sync, 99 KiB), datacenter
    Blackwell (sm100, tcgen05) and MI300 (gfx942, MFMA through Triton's AMD backend)."""
    out = tmp_path_factory.mktemp("aot-archs") / "aot.csv"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    kernels = ["dilated_fwd", "dilated_bwd_dq", "block_sparse_fwd", "ring_step_fwd"]
    proc = subprocess.run([sys.executable, "-m", "triton_dilated.perf", "aot", "--arch", "120", "100", "gfx942",
                           "--head-dims", "128", "--causal", "yes", "--kernels", *kernels, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return list(csv.DictReader(f))


@needs_ptxas
def test_other_archs_compile_on_their_own_instructions(aot_other_archs):
    rows = {r["arch"]: [] for r in aot_other_archs}
    for r in aot_other_archs:
        assert not r["error"], r
        rows[r["arch"]].append(r)
    assert set(rows) == {"sm120", "sm100", "gfx942"}
    for r in rows["sm120"]:   # no warpgroup MMA on consumer Blackwell: the per-warp tiles, in registers
        assert int(r["mma_sync"]) > 0 and int(r["wgmma"]) == 0 and int(r["spill_stores"]) == 0, r
        assert int(r["shared_bytes"]) <= 99 * 1024, r
    assert any(int(r["tcgen05"]) > 0 for r in rows["sm100"]), rows["sm100"]
    for r in rows["gfx942"]:  # MFMA, within MI300's 64 KiB of LDS, no VGPR spilled (the cdna rows of configs.ARCH_DEFAULTS)
        assert int(r["mfma"]) > 0 and int(r["shared_bytes"]) <= 64 * 1024, r
        assert int(r["spill_stores"]) == 0 and int(r["scratch_bytes"]) == 0, r


@needs_ptxas
def test_fp_fusion_default_is_said_at_most_once(aot):
    """Triton 3.9 warns in every compile process while TRITON_DEFAULT_FP_FUSION is unset (twice
    per run with 2 jobs); the run says it once, with the setting the compiles used."""
    _, _, proc = aot
    assert (proc.stdout + proc.stderr).count("TRITON_DEFAULT_FP_FUSION is unset") <= 1
