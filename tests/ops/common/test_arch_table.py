"""The architecture table (issue 20 item 1): every arch's facts in one place, config rules and
switches keyed on them, ROCm devices recognised as AMD. Faked devices: the logic, not a launch."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from triton_dilated.ops.common import configs
from triton_dilated.ops.common import hardware
from triton_dilated.ops.common.hardware import ARCH_TABLE, Arch, arch_facts, fake_arch
from tests.helpers.paths import ROOT

FAMILIES = ("dilated_fwd", "dilated_bwd", "block_sparse_fwd", "block_sparse_bwd", "ring_step_fwd", "ring_step_bwd")
KERNELS = (None, "dilated_bwd_dkdv", "block_sparse_bwd_dkdv", "ring_step_bwd_dkdv", "dilated_decode",
           "block_sparse_decode")


def test_table_facts():
    for name, facts in ARCH_TABLE.items():
        assert facts.vendor == ("amd" if name.startswith("gfx") else "nvidia"), name
        assert facts.mma in ("mma.sync", "wgmma", "tcgen05", "mfma", "fma"), name
        assert facts.warp_size == (64 if facts.vendor == "amd" else 32), name
        assert 48 * 1024 <= facts.shared_memory <= 228 * 1024, name
    assert [n for n, f in ARCH_TABLE.items() if f.mma in hardware.WARPGROUP_MMA] == ["sm90", "sm100"]
    assert [n for n, f in ARCH_TABLE.items() if f.tma] == ["sm90", "sm100", "sm120"]
    # Triton 3.9 compiles tl.dot to FMA loops before Ampere (perf/aot/sm75-sm70-*.csv: no mma.sync)
    assert [n for n, f in ARCH_TABLE.items() if f.mma == "fma"] == ["sm70", "sm75"]
    assert [n for n, f in ARCH_TABLE.items() if f.warp_specialize] == ["sm100"]


@pytest.mark.parametrize("name, like", [("sm87", "sm86"), ("sm103", "sm100"), ("sm121", "sm120"), ("sm72", "sm70"),
                                        ("gfx90a", "gfx942")])
def test_unknown_minor_versions_take_their_family(name, like):
    assert arch_facts(name) == ARCH_TABLE[like]


def test_unknown_arch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown GPU architecture 'sm12': known are sm70, .*gfx950"):
        fake_arch("sm12")


def _fake_device(monkeypatch, hip, **props):
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(multi_processor_count=304, name="fake", **props))
    hardware.get_arch.cache_clear()


@pytest.fixture
def clear_arch_cache():
    yield
    hardware.get_arch.cache_clear()


def test_rocm_device_is_amd_not_hopper(monkeypatch, clear_arch_cache):
    """PyTorch on ROCm reports an MI300X as capability (9, 4): the arch comes from its
    gcnArchName, so it never takes the Hopper tiles or the TMA switch."""
    _fake_device(monkeypatch, "6.4", major=9, minor=4, gcnArchName="gfx942:sramecc+:xnack-",
                 shared_memory_per_block_optin=64 * 1024)
    arch = hardware.get_arch(0)
    assert (arch.name, arch.vendor, arch.mma, arch.warp_size, arch.tma) == ("gfx942", "amd", "mfma", 64, False)
    assert not arch.warpgroup_mma
    assert not configs.VARIANT_SWITCHES["block_sparse_fwd"]["TMA"].available(arch)
    assert configs.switch_alternatives("block_sparse_fwd", configs.make_config(64, 64, 4, 2), arch) == []


def test_cuda_device_names(monkeypatch, clear_arch_cache):
    _fake_device(monkeypatch, None, major=12, minor=0, shared_memory_per_block_optin=99 * 1024)
    arch = hardware.get_arch(0)
    assert (arch.name, arch.mma, arch.tma, arch.warpgroup_mma) == ("sm120", "mma.sync", True, False)


@pytest.mark.parametrize("name", list(ARCH_TABLE))
def test_default_configs_follow_the_facts(name):
    """The tile rule an arch gets is its MMA family's: warpgroup tiles (128 rows, 8 warps on
    64 rows each) only with warpgroup MMAs (sm90, sm100), the per-warp tiles chosen on sm80
    everywhere else (sm120 and AMD included, whatever their capability), each shrunk to the
    arch's shared memory; on the 99 KiB mma.sync archs, the mid_smem rows (ARCH_DEFAULTS) where the sm80
    tile spills there, on AMD the cdna rows. Every 16-bit default fits it (a smallest tile,
    16x16 with one stage, where none does)."""
    arch = fake_arch(name)
    family_rule = ARCH_TABLE["sm90" if arch.mma in hardware.WARPGROUP_MMA else "sm80"]
    like = Arch("rule", arch.capability, arch.shared_memory, 1, "reference",
                dataclasses.replace(family_rule, vendor=arch.vendor, async_copy=arch.async_copy,
                                    shared_memory=arch.shared_memory))
    for family in FAMILIES:
        for kernel in KERNELS:
            for dtype in (torch.bfloat16, torch.float16):
                for d in (64, 128, 256):
                    cfg = configs.default_config(family, d, arch, dtype, kernel)
                    band = 64 if d <= 64 else 128 if d <= 128 else 256
                    own = kernel if kernel in configs.KERNEL_DEFAULTS else family
                    kind = {"sm86": "mid_smem", "sm89": "mid_smem", "sm120": "mid_smem", "gfx942": "cdna",
                            "gfx950": "cdna", "sm70": "fma", "sm75": "fma", "sm100": "tcgen05"}.get(name)
                    table = configs.ARCH_DEFAULTS[kind] if kind else {}
                    if (own, band) in table:
                        assert cfg == table[(own, band)], (name, family, kernel, d)
                    else:
                        assert cfg == configs.default_config(family, d, like, dtype, kernel), (name, family, kernel, d)
                    smallest = cfg["BLOCK_M"] == cfg["BLOCK_N"] == 16 and cfg["num_stages"] == 1
                    assert configs.config_fits(family, cfg, d, arch, dtype) or smallest, (name, family, kernel, d, cfg)
                    if not arch.warpgroup_mma:
                        assert not (cfg["BLOCK_M"] >= 128 and family.endswith("_fwd") and kernel is None), (name, cfg)


def test_float32_kernels_need_tf32(monkeypatch):
    """kernels_fit: float32 goes to the Triton kernels only on archs with TF32 tensor cores
    (not Volta/Turing; not AMD until its float32 dots are compiled and checked)."""
    dev = torch.device("cuda", 0)
    for name, facts in ARCH_TABLE.items():
        monkeypatch.setattr(configs, "device_arch", lambda device, n=name: fake_arch(n))
        monkeypatch.setattr(configs, "load_arch_table", lambda n: {})
        assert configs.kernels_fit(("dilated_fwd",), 64, torch.float32, dev) == facts.tf32, name


def test_arch_constructor_keeps_its_old_form():
    arch = Arch("sm90", (9, 0), 227 * 1024, 132, "fake")
    assert arch.facts == ARCH_TABLE["sm90"] and arch.warpgroup_mma and arch.tma
    assert Arch("cpu-interpreter", (0, 0), 0, 2, "cpu").mma == "interpreter"


AMD_DEFAULTS_CSV = "perf/aot/gfx942-gfx950-defaults-bf16-fp16-triton39.csv"
# the indexed variant's kernels (tiles.py's rule, not config families), one run on every arch:
# `perf aot --arch 70 75 80 86 89 90 100 120 gfx942 gfx950 --head-dims 64 128 256 --dtypes bfloat16 float16
# --kernels indexed_fwd indexed_bwd_dq indexed_bwd_dkdv indexer_scores`
INDEXED_CSV = "perf/aot/indexed-all-archs-defaults-bf16-fp16-triton39.csv"


def _csv_rows(*paths):
    import csv
    rows = []
    for path in paths:
        with open(ROOT / path) as f:
            rows += list(csv.DictReader(f))
    return rows


def _launched(r, arch, dtype):
    """The launch config (CONFIG_FIELDS) the library picks for row r's kernel on `arch`: the
    family's default (configs.default_config) or the variant's own tile rule (perf.aot.launch_config)."""
    from triton_dilated.perf.aot import launch_config
    cfg = launch_config(r["kernel"], int(r["D"]), arch, dtype)
    return {k: cfg[k] for k in configs.CONFIG_FIELDS}


def _compiled(r):
    return {k: int(r[k]) for k in configs.CONFIG_FIELDS}
NO_DOT_KERNELS = ("dilated_decode", "decode_merge", "block_sparse_decode", "ring_step_lists",   # vector work, no dot
                  "indexed_bwd_dkdv")
INDEXED_KERNELS = ("indexed_fwd", "indexed_bwd_dq", "indexed_bwd_dkdv", "indexer_scores")


@pytest.mark.parametrize("gcn", ["gfx942:sramecc+:xnack-", "gfx950"])
def test_rocm_device_picks_the_compiled_spill_free_config(monkeypatch, clear_arch_cache, gcn):
    """On a fake ROCm device (MI300X: gfx942, 64 KiB LDS; MI355X: gfx950, 160 KiB) the config
    select_config picks for every kernel, 16-bit dtype and head dim <= 128 is the one the
    committed AOT compile of the AMD defaults compiled (perf/aot/, `perf aot --arch gfx942
    gfx950`), and that compile has no VGPR spill, no scratch and fits the arch's LDS."""
    from triton_dilated.perf.aot import KERNELS
    name = gcn.split(":")[0]
    lds = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}[name]
    _fake_device(monkeypatch, "6.4", major=9, minor=4 if name == "gfx942" else 5, gcnArchName=gcn,
                 shared_memory_per_block_optin=lds)
    monkeypatch.setattr(configs, "load_arch_table", lambda arch_name: {})   # no tuned table: the defaults
    rows = [r for r in _csv_rows(AMD_DEFAULTS_CSV, INDEXED_CSV) if r["arch"] == name and int(r["D"]) <= 128]
    seen = set()
    for r in rows:
        spec = KERNELS[r["kernel"]]
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[r["dtype"]]
        if spec.name in INDEXED_KERNELS:
            cfg = _launched(r, fake_arch(name), dtype)
        else:
            cfg = configs.select_config(spec.family, dtype, int(r["D"]), 8192, torch.device("cuda", 0),
                                        kernel=r["kernel"])
        compiled = _compiled(r)
        assert cfg == compiled, (r["kernel"], r["dtype"], r["D"], cfg, compiled)
        assert not r["error"] and int(r["spill_stores"]) == 0 and int(r["scratch_bytes"]) == 0, r
        assert int(r["shared_bytes"]) <= lds, r
        assert int(r["mfma"]) > 0 or r["kernel"] in NO_DOT_KERNELS, r
        seen.add((r["kernel"], r["dtype"], r["D"], r["causal"]))
    assert seen == {(k, dt, d, c) for k in KERNELS for dt in ("bf16", "fp16") for d in ("64", "128") for c in "01"}


# `perf aot --arch 70 75 80 86 89 90 100 120 gfx942 gfx950 --head-dims 64 128 256` (bf16, issue
# 20's command, one run) and its fp16 counterpart (D <= 128; sm70/sm75 also D = 256)
ALL_ARCHS_CSV = "perf/aot/all-archs-defaults-{}-triton39.csv"
DTYPE_LABELS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _all_archs_rows(dtype):
    label = DTYPE_LABELS[dtype]
    rows = _csv_rows(ALL_ARCHS_CSV.format(label))
    assert rows and all(r["dtype"] == label for r in rows)
    return rows + [r for r in _csv_rows(INDEXED_CSV) if r["dtype"] == label]


# The documented D = 256 spills of the defaults, per arch (docs/gpus.md; the lists may only
# shrink). Volta/Turing: the dK/dV kernels (FMA_SPILLING: "auto" takes the portable backward
# at D = 256) and on sm70 the block-sparse forward and dQ; elsewhere 8-612 B in 1-5 kernels.
D256_SPILLS = {"sm75": {"dilated_bwd_dkdv", "block_sparse_bwd_dkdv", "ring_step_bwd_dkdv"},
               "sm70": {"dilated_bwd_dkdv", "block_sparse_bwd_dkdv", "ring_step_bwd_dkdv", "block_sparse_fwd",
                        "block_sparse_bwd_dq"},
               "sm80": {"ring_step_fwd"}, "sm86": {"block_sparse_bwd_dkdv", "ring_step_bwd_dq"},
               "sm89": {"block_sparse_bwd_dkdv", "ring_step_bwd_dq"}, "sm90": {"ring_step_fwd"},
               "sm100": {"block_sparse_fwd", "block_sparse_bwd_dq", "ring_step_fwd"},
               "sm120": {"block_sparse_bwd_dkdv", "ring_step_fwd"}, "gfx942": set(), "gfx950": set()}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["sm75", "sm70"])
def test_volta_turing_defaults_are_the_compiled_ones(name, dtype):
    """On sm70/sm75 Triton 3.9 compiles every dot to FMA loops (no mma.sync in the committed
    compile), with the head-dim contractions in 64-wide pieces (DOT_PIECES): the 16-bit
    default of each kernel is the config compiled there, without spills at D <= 128, causal
    and not; at D = 256 only those of D256_SPILLS spill."""
    from triton_dilated.perf.aot import KERNELS
    arch = fake_arch(name)
    rows = [r for r in _all_archs_rows(dtype) if r["arch"] == name]
    assert {(r["kernel"], r["D"], r["causal"]) for r in rows} == {
        (k, d, c) for k in KERNELS for d in ("64", "128", "256") for c in "01"}
    for r in rows:
        cfg = _launched(r, arch, dtype)
        assert cfg == _compiled(r), (r["kernel"], r["D"], cfg)
        assert not r["error"] and r["mma_sync"] == "0" and int(r["shared_bytes"]) <= arch.shared_memory, r
        if r["D"] != "256" or r["kernel"] not in D256_SPILLS[name]:
            assert r["spill_stores"] == "0", (r["kernel"], r["D"], r["causal"], r["spill_stores"])


SM100_DEFAULTS_CSV = "perf/aot/sm100-defaults-bf16-triton39.csv"


def test_sm100_defaults_are_the_compiled_spill_free_ones(monkeypatch, clear_arch_cache):
    """On a fake B200 (capability 10.0) the bf16 config select_config picks for every kernel
    at D <= 128 is the one the committed sm100 compile used (perf/aot/, causal: the
    spill-prone case), and that compile has no spill, tcgen05 MMAs in every tile kernel (mma.sync in
    the indexed kernels, whose head tiles have 16 rows) and fits 227 KiB (the tcgen05 rows of configs.ARCH_DEFAULTS where the Hopper tiles spilled)."""
    from triton_dilated.perf.aot import KERNELS
    _fake_device(monkeypatch, None, major=10, minor=0, shared_memory_per_block_optin=227 * 1024)
    monkeypatch.setattr(configs, "load_arch_table", lambda arch_name: {})   # no tuned table: the defaults
    rows = [r for r in _csv_rows(SM100_DEFAULTS_CSV, INDEXED_CSV)
            if r["arch"] == "sm100" and r["dtype"] == "bf16" and int(r["D"]) <= 128]
    for r in rows:
        if r["kernel"] in INDEXED_KERNELS:
            cfg = _launched(r, fake_arch("sm100"), torch.bfloat16)
        else:
            cfg = configs.select_config(KERNELS[r["kernel"]].family, torch.bfloat16, int(r["D"]), 8192,
                                        torch.device("cuda", 0), kernel=r["kernel"])
        assert cfg == _compiled(r), (r["kernel"], r["D"], cfg)
        assert not r["error"] and int(r["spill_stores"]) == 0 and int(r["shared_bytes"]) <= 227 * 1024, r
        if r["kernel"] in INDEXED_KERNELS:   # 16-row head tiles: tcgen05 takes 64 rows and more, mma.sync runs them
            assert int(r["mma_sync"]) > 0 or r["kernel"] in NO_DOT_KERNELS, r
        else:
            assert int(r["tcgen05"]) > 0 or r["kernel"] in NO_DOT_KERNELS, r
    assert {(r["kernel"], r["D"]) for r in rows} == {(k, d) for k in KERNELS for d in ("64", "128")}


@pytest.mark.parametrize("name, major, minor, smem", [("sm75", 7, 5, 64 * 1024), ("sm70", 7, 0, 96 * 1024)])
def test_volta_turing_auto_never_runs_a_spilling_default(monkeypatch, clear_arch_cache, name, major, minor, smem):
    """Where the committed compiles spill (the dK/dV kernels at D = 256 on sm70/sm75:
    configs.FMA_SPILLING), backend="auto" takes the portable path for the backward; at
    D <= 128 (no spill since the dots run in pieces) and for the forward alone it keeps the
    Triton kernels; backend="triton" runs them."""
    from triton_dilated.ops.block_sparse.interface import CONFIG_FAMILIES as BS_FAMILIES
    from triton_dilated.ops.common.runtime import resolve_backend
    from triton_dilated.ops.dilated.interface import CONFIG_FAMILIES as DILATED_FAMILIES
    _fake_device(monkeypatch, None, major=major, minor=minor, shared_memory_per_block_optin=smem)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
    cuda = torch.device("cuda", 0)
    assert configs.FMA_SPILLING == {(f, 256) for f in ("dilated_bwd", "block_sparse_bwd", "ring_step_bwd")}
    for families in (DILATED_FAMILIES, BS_FAMILIES, ("ring_step_fwd", "ring_step_bwd")):
        assert resolve_backend("auto", cuda, families, 256, torch.float16) == "torch"
        for D in (64, 128):
            assert resolve_backend("auto", cuda, families, D, torch.float16) == "triton"
            assert resolve_backend("triton", cuda, families, D, torch.float16) == "triton"
    assert resolve_backend("auto", cuda, ("dilated_fwd",), 256, torch.float16) == "triton"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_arch_compiles_its_defaults_without_spills_at_d128(dtype):
    """Issue 20's bar, on the committed compile of every arch in ARCH_TABLE (ALL_ARCHS_CSV: bf16
    from one run of issue 20's command, fp16 from its counterpart at D <= 128; causal and
    not), each row the config default_config picks today: no compile error, no spill at
    D <= 128, shared memory / LDS within the arch's limit, and the arch's tensor-core
    instructions in every tile kernel (none on the FMA archs). D = 256: compiles, and spills
    only in the documented kernels (D256_SPILLS)."""
    from triton_dilated.perf.aot import KERNELS
    seen = set()
    for r in _all_archs_rows(dtype):
        arch = fake_arch(r["arch"])
        cfg = _launched(r, arch, dtype)
        assert cfg == _compiled(r), (r["arch"], r["kernel"], r["D"], cfg)
        assert not r["error"] and int(r["shared_bytes"]) <= arch.shared_memory, r
        seen.add((r["arch"], r["kernel"], r["D"], r["causal"]))
        spills = int(r["spill_stores"] or 0) + int(r["scratch_bytes"] or 0)
        if r["D"] == "256":
            assert not spills or r["kernel"] in D256_SPILLS[r["arch"]], (r["arch"], r["kernel"], r["spill_stores"])
            continue
        assert spills == 0, (r["arch"], r["kernel"], r["D"], r["causal"], r["spill_stores"], r["scratch_bytes"])
        tensor_core = {"fma": None, "mma.sync": ("mma_sync",), "wgmma": ("wgmma", "mma_sync"),
                       "tcgen05": ("tcgen05", "mma_sync"), "mfma": ("mfma",)}[arch.mma]
        if tensor_core is None:
            assert int(r["mma_sync"]) == 0 and int(r["wgmma"]) == 0, r
        elif r["kernel"] not in NO_DOT_KERNELS:
            assert any(int(r[c] or 0) > 0 for c in tensor_core), r
    assert seen >= {(a, k, d, c) for a in ARCH_TABLE for k in KERNELS for d in ("64", "128") for c in "01"}


# `perf aot --arch 70 75 80 86 89 90 100 120 gfx942 gfx950 --head-dims 192 --kernels indexed_fwd_dv128
# indexed_bwd_dq_dv128 indexed_bwd_dkdv_dv128` (DeepSeek's non-absorbed MLA, (Dqk, Dv) = (192, 128)) and
# `--arch 80 86 89 90 100 120 gfx942 gfx950 --head-dims 576 --kernels indexed_fwd_mla_paged
# indexed_fwd_mla_fp8_paged indexed_fwd_mla_fp8_bytes_paged` (absorbed MLA decode, (576, 512), 64-row pages;
# over 256 the door needs sm80 on NVIDIA: indices.kernel_head_dims), bf16, causal, one CSV
INDEXED_MLA_CSV = "perf/aot/indexed-dv128-mla-all-archs-bf16-triton39.csv"


def test_indexed_mla_shapes_compile_without_spills_on_every_arch():
    """The indexed kernels at DeepSeek's shapes, each row the launch config the tile rule picks
    (tiles.compiled_tiles): no spill, shared memory / LDS within the arch's limit; the one error
    is the hardware-FP8 cache (fp8e4nv) before sm89, where the launcher decodes the bytes instead
    (decode_kernels.fp8_mode 2: its row compiles)."""
    rows = _csv_rows(INDEXED_MLA_CSV)
    seen = set()
    for r in rows:
        arch = fake_arch(r["arch"])
        assert _launched(r, arch, torch.bfloat16) == _compiled(r), (r["arch"], r["kernel"])
        seen.add((r["arch"], r["kernel"]))
        if r["error"]:
            assert r["kernel"] == "indexed_fwd_mla_fp8_paged" and r["arch"] in ("sm80", "sm86"), r
            assert "fp8e4nv not supported" in r["error"], r
            continue
        assert int(r["spill_stores"] or 0) == 0 and int(r["scratch_bytes"] or 0) == 0, r
        assert int(r["shared_bytes"]) <= arch.shared_memory, r
    dv128 = {f"indexed_{k}_dv128" for k in ("fwd", "bwd_dq", "bwd_dkdv")}
    mla = {f"indexed_fwd_mla{t}_paged" for t in ("", "_fp8", "_fp8_bytes")}
    assert seen == {(a, k) for a in ARCH_TABLE for k in dv128} | {
        (a, k) for a in ARCH_TABLE if a not in ("sm70", "sm75") for k in mla}
