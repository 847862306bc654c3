"""Ahead-of-time compile of every Triton kernel for an NVIDIA or AMD arch, with no GPU needed.

The CPU interpreter runs kernels as Python, so it cannot see what only the compiler
rejects (a variable whose type differs between the branches of a runtime `if`, dot
shapes, shared memory) or what ptxas reports (registers, spills). This compiles each
kernel with the config the library would pick on that arch (configs.default_config, or
--configs), runs Triton's own ptxas with -v, and writes one CSV row per compile:
registers, spill stores/loads, shared memory, or the error; and, read off the PTX and the
TTGIR, what the compiler made of the loops (docs/internals.md, "Reading the compiled code"):

* wgmma / mma_sync: tensor-core instructions in the PTX (static count per thread), and the
  wgmma shapes with their counts (m64n64k16:16 ...);
* mma_layouts, mma_replicated: each MMA layout as "v<version>[warps along M, N]n<instr N>"
  and whether one covers more than a float32 tile laid out in it (16 rows per warp along M,
  instr N columns per warp along N): then several warps compute the same elements (8 warps
  on a 64-row wgmma tile: two warpgroups compute the same S);
* tcgen05: datacenter Blackwell's MMA instructions (sm100) in the PTX;
* ws_partitions, setmaxnreg: warp specialization (config WARP_SPEC = 1): the partitions
  beside the default one in the TTGIR's ttg.warp_specialize (load, MMA, ... warp groups) and
  the setmaxnreg instructions that give each its register budget in the PTX (0, 0: none);
* AMD (gfx942, gfx950: Triton's HIP backend, no ptxas): registers = VGPRs, spill columns =
  4 B per VGPR spilled to scratch memory, scratch_bytes = the private segment, sgpr_spills =
  SGPRs kept in VGPR lanes (no memory traffic), mfma = MFMA
  instructions in the AMDGCN, occupancy = waves per SIMD as the compiler reports it,
  shared_bytes = LDS;
* cp_async / cp_async_bulk: asynchronous global->shared copies (cp.async, Ampere on) and
  TMA copies (cp.async.bulk, Hopper); 0 cp_async means the loads go through registers;
* pipeline_depth: shared-memory buffers of the deepest tile the software pipeliner rotates
  its cp.async copies through (TTGIR `local_alloc` of N x tile; 0: the loop is not
  pipelined at all). How many of num_stages become buffers depends on the arch and on the
  consumer (a wgmma reads its operand from shared memory; an mma.sync through registers).

    python -m triton_dilated.perf aot [--arch 90 80] [--head-dims 64 128] [--out CSV] [--ptx-dir DIR]

Needs TRITON_INTERPRET unset (the interpreter replaces the compiled kernels).
"""
from __future__ import annotations

import csv
import os
import re
import subprocess
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from ..ops import SPECS, kernel_specs
from ..ops.common.hardware import ARCH_TABLE, arch_facts, padded_head_dim
from ..ops.common.spec import APPEND_KERNEL

KERNELS = kernel_specs()   # name -> KernelSpec, from the variants' spec.py
VARIANT_OF = {k.name: variant for variant in SPECS for k in variant.kernels}   # kernel name -> VariantSpec
# Kernels of no variant, compiled only when named (--kernels), with their launchers' settings
# (constexprs, warps) instead of a variant's aot_constexprs: the serve doors' append (one warp per
# row; ROTARY_DIM 0: the plain append, as launched without rotary tables). Its CSV rows' tile columns:
# BLOCK_M 1 (one row a program), BLOCK_N 16 (block-table entries checked a step; BLOCK_P before rotary)
NAMED_KERNELS = {APPEND_KERNEL.name: APPEND_KERNEL}
NAMED_LAUNCH = {"append": {"PAGE_SIZE": 0, "KV_FP8": 0, "ROTARY_DIM": 0, "INTERLEAVED": False, "Q_CAUSAL": False,
                           "BLOCK_P": 16, "BLOCK_M": 1, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1,
                           "enable_fp_fusion": False}}   # as AppendLaunch launches it
ALL_KERNELS = {**KERNELS, **NAMED_KERNELS}
# Experimental variants of a kernel, compiled only when named (--kernels): AOT name -> (the
# kernel, the config keys the variant sets). TMA = 1: K and V through tensor descriptors;
# WARP_SPEC = 1 (with TMA): the block-sparse forward's main loop warp-specialized by the compiler;
# PAGE_SIZE: the decode kernels' paged-cache constexpr (0, the contiguous cache, by default).
VARIANTS = {"block_sparse_fwd_tma": ("block_sparse_fwd", {"TMA": 1}),
            "block_sparse_fwd_ws": ("block_sparse_fwd", {"TMA": 1, "WARP_SPEC": 1}),
            "dilated_decode_paged": ("dilated_decode", {"PAGE_SIZE": 16}),
            "block_sparse_decode_paged": ("block_sparse_decode", {"PAGE_SIZE": 16})}
# KV_FP8: the decode kernels on a float8_e4m3fn cache, contiguous and paged: _fp8 (1) K and V as fp8e4nv
# pointers, converted by the hardware (sm89 and newer: Triton has no fp8e4nv before); _fp8_bytes (2) K and V
# as uint8, decoded in the kernel (older GPUs)
VARIANTS.update({f"{name}_{kind}{tail}": (name, {"KV_FP8": mode, **extra})
                 for name in ("dilated_decode", "block_sparse_decode")
                 for kind, mode in (("fp8", 1), ("fp8_bytes", 2))
                 for tail, extra in (("", {}), ("_paged", {"PAGE_SIZE": 16}))})
# softcap= (issue 23): the kernels with the score cap (HAS_SOFTCAP; the cap itself, `softcap`, is a
# run-time float32 argument: one compile serves every cap; the default rows are the uncapped kernels,
# softcap None)
SOFTCAP_AOT = {"HAS_SOFTCAP": True}
VARIANTS.update({f"{name}_softcap": (name, dict(SOFTCAP_AOT))
                 for name in ("dilated_fwd", "dilated_bwd_dq", "dilated_bwd_dkdv", "block_sparse_fwd",
                              "block_sparse_bwd_dq", "ring_step_fwd", "ring_step_bwd_dq", "ring_step_bwd_dkdv",
                              "dilated_decode", "block_sparse_decode")})
# packed documents in the ring (issue 22): the step kernels with the per-pair document compare (DOCS)
VARIANTS.update({f"{name}_docs": (name, {"DOCS": 1})
                 for name in ("ring_step_fwd", "ring_step_bwd_dq", "ring_step_bwd_dkdv", "ring_step_lists")})
# the block-sparse backward launcher runs the capped dK/dV kernel with at most 2 pipeline stages
# (ops/block_sparse/kernels.py, SOFTCAP_DKDV_STAGES); the defaults have 3
VARIANTS["block_sparse_bwd_dkdv_softcap"] = ("block_sparse_bwd_dkdv", {**SOFTCAP_AOT, "num_stages": 2})
# sliding windows (issue 23): the kernels with the window predicate (HAS_WINDOW) and sink tokens
# (HAS_SINK_TOKENS, the larger code); the window and the sink count (gpt-oss: 128 and 4) are run-time
# int32 arguments the kernels do not specialize on, so one compile serves every value. The default
# rows compile the kernels without them (the *_WIN flag pointers are then None). The ring step's
# rows are of a block layout (MASK_KIND 2), so *_layout rows give the same kernels without the
# window to compare with.
WINDOW_AOT = {"HAS_WINDOW": True, "HAS_SINK_TOKENS": True}
WINDOW_POINTERS = {"KV_WIN": "i8"}   # the block-sparse decode kernel's window flags (int8 per list entry)
VARIANTS.update({f"{name}_window": (name, dict(WINDOW_AOT))
                 for name in ("block_sparse_fwd", "block_sparse_bwd_dq", "block_sparse_bwd_dkdv")})
VARIANTS["block_sparse_decode_window"] = ("block_sparse_decode", dict(WINDOW_AOT))
# cache_leftpad= on the serve doors: the decode kernels reading each row's pad (HAS_LEFTPAD)
VARIANTS.update({f"{name}_leftpad": (name, {"HAS_LEFTPAD": True}) for name in ("dilated_decode", "block_sparse_decode")})
# window_size= on dilated attention: the window predicate without sink tokens
VARIANTS.update({f"{name}_window": (name, {"HAS_WINDOW": True})
                 for name in ("dilated_fwd", "dilated_bwd_dq", "dilated_bwd_dkdv")})
# window_size= on the dilated serve door: the decode kernel's runs cut to the window (run-time
# window), with and without cache_leftpad
VARIANTS["dilated_decode_window"] = ("dilated_decode", {"HAS_WINDOW": True})
VARIANTS["dilated_decode_leftpad_window"] = ("dilated_decode", {"HAS_WINDOW": True, "HAS_LEFTPAD": True})
VARIANTS.update({f"{name}_{kind}": (name, {"MASK_KIND": 2, **(WINDOW_AOT if kind == "window" else {})})
                 for name in ("ring_step_fwd", "ring_step_bwd_dq", "ring_step_bwd_dkdv", "ring_step_lists")
                 for kind in ("layout", "window")})
# the ring step's launcher runs a window's dK/dV with 1 pipeline stage above head dim 64
# (step_kernels.py, WINDOW_DKDV_STAGES): *_window_d128 compiles it so (the D = 64 rows keep
# the default stages)
VARIANTS["ring_step_bwd_dkdv_window_d128"] = ("ring_step_bwd_dkdv", {"MASK_KIND": 2, **WINDOW_AOT, "num_stages": 1})
# indexed attention: value heads narrower than the query/key heads (DeepSeek's non-absorbed MLA
# prefill: --head-dims 192 gives (Dqk, Dv) = (192, 128)), and the serve door's forward on absorbed-MLA
# decode ((576, 512): --head-dims 576) over a paged cache of 64-row pages (FlashMLA's), 16-bit or FP8
VARIANTS.update({f"{name}_dv128": (name, {"HEAD_DIM_V": 128})
                 for name in ("indexed_fwd", "indexed_bwd_dq", "indexed_bwd_dkdv")})
# the serve doors' append with FlashAttention's rotary fused (issue 33: k rotated before it is
# stored, the rotated q written by extra programs): 64 rotary features (all of them at D = 64, half
# at D = 128; compile at D >= 64), GPT-NeoX pairs and causal query positions; and GPT-J pairs into
# a paged FP8 cache (rotated, then quantised; the caches as bytes)
VARIANTS["append_rotary"] = ("append", {"ROTARY_DIM": 64, "INTERLEAVED": False, "Q_CAUSAL": True})
VARIANTS["append_rotary_fp8_paged"] = ("append", {"ROTARY_DIM": 64, "INTERLEAVED": True, "Q_CAUSAL": True,
                                                  "KV_FP8": 1, "PAGE_SIZE": 16})
VARIANTS.update({f"indexed_fwd_mla{tail}_paged": ("indexed_fwd", {"HEAD_DIM_V": 512, "PAGE_SIZE": 64, **extra})
                 for tail, extra in (("", {}), ("_fp8", {"KV_FP8": 1}), ("_fp8_bytes", {"KV_FP8": 2}))})
FIELDS = ["arch", "kernel", "dtype", "D", "causal", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "registers",
          "spill_stores", "spill_loads", "shared_bytes", "wgmma", "mma_sync", "cp_async", "cp_async_bulk",
          "pipeline_depth", "mma_replicated", "wgmma_shapes", "mma_layouts", "tcgen05", "ws_partitions", "setmaxnreg",
          "mfma", "scratch_bytes", "sgpr_spills", "occupancy", "compile_s", "error"]
# opt-in shared memory bytes per block, from the architecture table
_SMEM = {int(name[2:]): facts.shared_memory for name, facts in ARCH_TABLE.items() if name.startswith("sm")}
# Triton 3.9 warns once per process when TRITON_DEFAULT_FP_FUSION is unset (its default changes in 3.10): each
# compile worker would print it; run_aot says it once instead
_FP_FUSION_WARNING = r"TRITON_DEFAULT_FP_FUSION is unset"


class AotCrash(RuntimeError):
    """A compile process died (LLVM aborts the process on some errors) instead of reporting an error."""


def fp_fusion_note() -> str:
    """One line on the FP-fusion setting the compiles use where Triton warns that its default
    changes (Triton 3.9 with TRITON_DEFAULT_FP_FUSION unset), else ""."""
    if os.environ.get("TRITON_DEFAULT_FP_FUSION") is not None:
        return ""
    try:
        import triton
        knobs = triton.knobs.language
        if not hasattr(knobs, "default_fp_fusion") or knobs.force_disable_fp_fusion:
            return ""
        on = bool(knobs.default_fp_fusion)
    except Exception:   # an older or newer triton without these knobs: nothing to say
        return ""
    return (f"note: TRITON_DEFAULT_FP_FUSION is unset: compiling with FP fusion {'enabled' if on else 'disabled'}, "
            f"triton {triton.__version__}'s default (Triton 3.10 changes it); set it to 1 or 0 to choose")


def _signature(spec, fn, dtype: str, D: int, causal: bool, cfg: dict, amd: bool = False, mma: str = ""):
    """(signature, constexprs, attrs) for triton.compile, read off the kernel's parameters
    and its KernelSpec (pointer element types, odd strides). Parameters named *_DESC are
    tensor descriptors of (B, H, N, D) views with [1, 1, BLOCK_N, BLOCK_D] boxes where the
    config has TMA = 1, else None (constexpr). `mma`: the arch's ArchFacts.mma (its DOT_MODE)."""
    from ..ops.common.runtime import dot_mode
    tma = cfg.get("TMA", 0)
    constexprs = dict(HEAD_DIM=D, BLOCK_D=padded_head_dim(D), CAUSAL=causal,
                      BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], DOT_MODE=dot_mode(mma),
                      PRECISION=_precision(dtype, amd), TMA=bool(tma), WARP_SPEC=bool(cfg.get("WARP_SPEC", 0)),
                      HAS_SOFTCAP=bool(cfg.get("HAS_SOFTCAP", False)))
    for variant in SPECS:
        if spec in variant.kernels:
            constexprs.update(variant.aot_constexprs)
    for key in ("PAGE_SIZE", "KV_FP8", "ROTARY_DIM", "INTERLEAVED", "Q_CAUSAL"):
        if key in cfg:
            constexprs[key] = cfg[key]
    if "DOCS" in cfg:
        constexprs["DOCS"] = bool(cfg["DOCS"])
    constexprs.update(HAS_WINDOW=bool(cfg.get("HAS_WINDOW", False)),
                      HAS_SINK_TOKENS=bool(cfg.get("HAS_SINK_TOKENS", False)),
                      HAS_LEFTPAD=bool(cfg.get("HAS_LEFTPAD", False)))
    if "MASK_KIND" in cfg:
        constexprs["MASK_KIND"] = cfg["MASK_KIND"]
    # a variant's own tile constexprs (VariantSpec.launch_tiles: BLOCK_H, HEAD_DIM_V, ...) by name
    constexprs.update((key, value) for key, value in cfg.items() if key not in constexprs and key not in FIELDS)
    window = constexprs["HAS_WINDOW"]
    # the run-time feature values: a float32 cap, int32 window and sink counts (do_not_specialize:
    # no divisibility attribute) where their feature is on, else None as the launchers pass them
    features = {"softcap": ("fp32", constexprs["HAS_SOFTCAP"]), "window": ("i32", window),
                "sink_tokens": ("i32", constexprs["HAS_SINK_TOKENS"])}
    sig, given, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        a = p.name
        if p.is_constexpr:
            if a not in constexprs:
                raise ValueError(f"{spec.name}: no value for constexpr {a}")
            sig[a], given[a] = "constexpr", constexprs[a]
        elif a.endswith("_DESC"):
            if tma:
                sig[a] = f"tensordesc<{dtype}[1, 1, {cfg['BLOCK_N']}, {padded_head_dim(D)}]>"
            else:
                sig[a], given[a] = "constexpr", None
        elif a in features:
            ty, on = features[a]
            if on:
                sig[a] = ty
            else:
                sig[a], given[a] = "constexpr", None
        elif a == "LEFTPAD" and "HAS_LEFTPAD" not in (q.name for q in fn.params):
            if cfg.get("HAS_LEFTPAD"):   # a kernel that reads the pad where LEFTPAD is a tensor
                sig[a] = "*i32"
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:                        # None, as its launcher passes it without cache_leftpad
                sig[a], given[a] = "constexpr", None
        elif a in WINDOW_POINTERS and a not in spec.pointers:
            if window:   # the window's flag pointer
                sig[a] = "*" + WINDOW_POINTERS[a]
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:        # None, as the launchers pass it without a window
                sig[a], given[a] = "constexpr", None
        elif a in spec.pointers:
            ty = spec.pointers[a]
            if cfg.get("KV_FP8") and a in ("K_CACHE", "V_CACHE"):   # the append writes an FP8 cache's bytes
                ty = "u8"
            elif cfg.get("KV_FP8") and a in ("K", "V") and "K_CACHE" not in spec.pointers:
                ty = "fp8e4nv" if cfg["KV_FP8"] == 1 else "u8"   # an FP8 cache: fp8e4nv or its bytes (the
                #                                                 append's K, V: new rows in q's dtype)
            sig[a] = "*" + (dtype if ty == "act" else ty)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[a] = "fp32" if a in spec.floats else "i32"
            if a.startswith("stride_") and a not in spec.odd_strides:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, given, attrs


def _precision(dtype: str, amd: bool) -> str:
    """The kernels' PRECISION constexpr, as runtime.kernel_options picks it."""
    from ..ops.common.runtime import dot_precision
    return dot_precision(dtype == "fp32", "amd" if amd else "nvidia")


_PTXAS = re.compile(r"Used (\d+) registers.*?")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
# PTX instructions (an optional predicate "@%p1 " before the opcode)
_WGMMA = re.compile(r"^\s*(?:@!?%\w+\s+)?wgmma\.mma_async\.\S*?\.(m\d+n\d+k\d+)\.", re.M)
_MMA_SYNC = re.compile(r"^\s*(?:@!?%\w+\s+)?mma\.sync\.", re.M)
_CP_ASYNC = re.compile(r"^\s*(?:@!?%\w+\s+)?cp\.async\.c[ag]\.", re.M)        # cp.async.ca / .cg: one copy
_CP_BULK = re.compile(r"^\s*(?:@!?%\w+\s+)?cp\.async\.bulk\.", re.M)          # TMA
_TCGEN05 = re.compile(r"^\s*(?:@!?%\w+\s+)?tcgen05\.mma\b", re.M)             # datacenter Blackwell MMAs
_SETMAXNREG = re.compile(r"^\s*(?:@!?%\w+\s+)?setmaxnreg\.", re.M)             # a warp group's register budget
_WS_PARTITION = re.compile(r"^\s*partition\d+\(", re.M)                        # TTGIR: ttg.warp_specialize regions
# AMDGCN: MFMA instructions and the kernel metadata of the AMD backend
_MFMA = re.compile(r"^\s*v_mfma_", re.M)
_AMD_META = {key: re.compile(rf"\.{key}:\s+(\d+)") for key in
             ("vgpr_count", "vgpr_spill_count", "sgpr_spill_count", "private_segment_fixed_size")}
_AMD_OCCUPANCY = re.compile(r"; Occupancy: (\d+)")
# TTGIR: MMA layouts, the tensors laid out in them, and the pipeliner's multi-buffered tiles
_MMA_LAYOUT = re.compile(r"^(#\w+) = #ttg\.nvidia_mma<\{versionMajor = (\d+).*?warpsPerCTA = \[(\d+), (\d+)\]"
                         r".*?instrShape = \[(\d+), (\d+)", re.M)
_MMA_TENSOR = re.compile(r"tensor<(\d+)x(\d+)xf32, (#\w+)>")
_BUFFERS = re.compile(r"local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x\d+x\d+x")


def ptx_counts(ptx: str, ttgir: str = "") -> dict:
    """The instruction and layout columns of a row (module docstring) from a kernel's PTX and TTGIR."""
    shapes = _WGMMA.findall(ptx)
    by_shape = {sh: shapes.count(sh) for sh in sorted(set(shapes), key=lambda x: [int(v) for v in re.findall(r"\d+", x)])}
    tiles = {}   # MMA layout name -> the float32 2-D tiles laid out in it (accumulators: S, dP, O, dQ ...)
    for m, n, name in _MMA_TENSOR.findall(ttgir):
        if int(m) > 1 and int(n) > 1:
            tiles.setdefault(name, set()).add((int(m), int(n)))
    layouts, replicated = [], False
    for name, version, wm, wn, im, inn in _MMA_LAYOUT.findall(ttgir):
        layouts.append(f"v{version}[{wm},{wn}]n{inn}")
        # the warps of the layout cover (16 x warps along M) x (instr N x warps along N); a
        # smaller tile is computed several times over (each copy by other warps)
        if any(int(wm) * int(im) > m or int(wn) * int(inn) > n for m, n in tiles.get(name, ())):
            replicated = True
    return dict(wgmma=len(shapes), mma_sync=len(_MMA_SYNC.findall(ptx)), cp_async=len(_CP_ASYNC.findall(ptx)),
                tcgen05=len(_TCGEN05.findall(ptx)),
                ws_partitions=len(_WS_PARTITION.findall(ttgir)), setmaxnreg=len(_SETMAXNREG.findall(ptx)),
                cp_async_bulk=len(_CP_BULK.findall(ptx)),
                pipeline_depth=max((int(n) for n in _BUFFERS.findall(ttgir)), default=0),
                mma_replicated=int(replicated),
                wgmma_shapes=" ".join(f"{sh}:{n}" for sh, n in by_shape.items()),
                mma_layouts=" ".join(sorted(set(layouts))))


def ptx_name(row: dict, with_config: bool = False) -> str:
    """<kernel>-<dtype>-d<D>-c<causal>.ptx (with -<M>x<N>w<W>s<S> when several configs are compiled)."""
    tail = f"-{row['BLOCK_M']}x{row['BLOCK_N']}w{row['num_warps']}s{row['num_stages']}" if with_config else ""
    return f"{row['kernel']}-{row['dtype']}-d{row['D']}-c{row['causal']}{tail}.ptx"


def arch_label(arch) -> str:
    """"sm90" for an NVIDIA compute capability (90), the name itself for AMD ("gfx942")."""
    return arch if isinstance(arch, str) else f"sm{arch}"


def _amd_row(row: dict, asm: str, arch: str) -> None:
    """The AMD columns from the AMDGCN the HIP backend made: VGPRs as registers, spilled
    VGPRs (to scratch memory) as spill bytes (4 B each, both columns), the scratch segment,
    SGPRs spilled into VGPR lanes (no memory traffic), MFMA count, occupancy (waves per SIMD)
    as the compiler reports it."""
    meta = {key: int(m.group(1)) if (m := rx.search(asm)) else 0 for key, rx in _AMD_META.items()}
    spilled = 4 * meta["vgpr_spill_count"]
    occupancy = _AMD_OCCUPANCY.search(asm)
    row.update(registers=meta["vgpr_count"], spill_stores=spilled, spill_loads=spilled,
               scratch_bytes=meta["private_segment_fixed_size"], sgpr_spills=meta["sgpr_spill_count"],
               mfma=len(_MFMA.findall(asm)), occupancy=int(occupancy.group(1)) if occupancy else "")
    limit = arch_facts(arch).shared_memory
    if row["shared_bytes"] > limit:
        row["error"] = f"LDS {row['shared_bytes']} B over the {arch} limit {limit} B"


def compile_one(job) -> dict:
    """Compile one (kernel, arch, dtype, D, causal, config[, PTX path]); a CSV row. `arch`: an
    NVIDIA compute capability (90) or an AMD architecture name ("gfx942")."""
    name, arch, dtype, D, causal, cfg, *ptx_path = job
    amd = isinstance(arch, str)
    row = dict.fromkeys(FIELDS, "")
    row.update(arch=arch_label(arch), kernel=name, dtype=dtype, D=D, causal=int(causal))
    row.update((k, v) for k, v in cfg.items() if k in FIELDS)
    # a variant's tile settings (num_stages of the capped backward) as compiled
    row.update((k, v) for k, v in VARIANTS.get(name, (name, {}))[1].items() if k in FIELDS)
    start = time.time()
    warnings.filterwarnings("ignore", message=_FP_FUSION_WARNING)   # run_aot says it once
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        base, extra = VARIANTS.get(name, (name, {}))
        spec, cfg = ALL_KERNELS[base], {**cfg, **extra}
        fn = spec.load()
        if not hasattr(fn, "params"):
            raise RuntimeError("the kernels are interpreted (TRITON_INTERPRET=1): unset it to compile them")
        mma = arch_facts(arch_label(arch)).mma
        sig, constexprs, attrs = _signature(spec, fn, dtype, D, causal, cfg, amd, mma)
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        target = GPUTarget("hip", arch, 64) if amd else GPUTarget("cuda", arch, 32)
        options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
        if "enable_fp_fusion" in cfg:   # a launcher that sets it (NAMED_LAUNCH)
            options["enable_fp_fusion"] = cfg["enable_fp_fusion"]
        compiled = triton.compile(src, target=target, options=options)
        row["shared_bytes"] = compiled.metadata.shared
        if amd:
            row.update(ptx_counts("", compiled.asm.get("ttgir", "")))
            _amd_row(row, compiled.asm["amdgcn"], arch)
            if ptx_path and ptx_path[0]:
                with open(ptx_path[0][:-len(".ptx")] + ".amdgcn", "w") as f:
                    f.write(compiled.asm["amdgcn"])
            row["compile_s"] = round(time.time() - start, 1)
            return row
        from triton.backends.nvidia.compiler import get_ptxas
        row.update(ptx_counts(compiled.asm["ptx"], compiled.asm.get("ttgir", "")))
        if ptx_path and ptx_path[0]:
            with open(ptx_path[0], "w") as f:
                f.write(compiled.asm["ptx"])
        with tempfile.TemporaryDirectory() as tmp:   # ptxas -v on the PTX triton made: registers, spills
            ptx = os.path.join(tmp, "k.ptx")
            with open(ptx, "w") as f:
                f.write(compiled.asm["ptx"])
            gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
            out = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", ptx, "-o",
                                  os.path.join(tmp, "k.cubin")], capture_output=True, text=True, timeout=600)
        log = out.stdout + out.stderr
        regs, spill = _PTXAS.search(log), _SPILL.search(log)
        if out.returncode or not regs:
            raise RuntimeError(f"ptxas failed: {log.strip()[:300]}")
        row.update(registers=int(regs.group(1)), spill_stores=int(spill.group(1)) if spill else 0,
                   spill_loads=int(spill.group(2)) if spill else 0)
        if row["shared_bytes"] > _SMEM.get(arch, 1 << 30):
            row["error"] = f"shared memory {row['shared_bytes']} B over the sm{arch} limit {_SMEM[arch]} B"
    except Exception as exc:  # noqa: BLE001  (the row records it)
        text = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        row["error"] = f"{type(exc).__name__}: {text[-400:]}"   # the cause is at the end of a compile error
    row["compile_s"] = round(time.time() - start, 1)
    return row


def scalar_one_errors(arch: int = 90, dtypes=("bf16", "fp32"), head_dim: int = 128) -> list[str]:
    """Triton's front end (Python AST -> TTIR, no ptxas) over every kernel and variant with
    each integer scalar argument passed as the constexpr 1, as Triton specializes an int
    argument equal to 1 at launch (N = 1, H = 1, a stride of 1). The interpreter never
    specializes, so `N.to(...)` on such an argument passes the CPU tests and fails to compile
    on a GPU ('int' object has no attribute 'to'). All of them at 1 at once covers each alone
    (being a constexpr only takes methods away). Returns "<kernel> <dtype>: <error>" lines."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget

    import torch

    from ..ops.common.configs import make_config
    from ..ops.common.hardware import fake_arch
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": 4, "num_stages": 2})
    errors = []
    for name in [*ALL_KERNELS, *VARIANTS]:
        base, extra = VARIANTS.get(name, (name, {}))
        spec = ALL_KERNELS[base]
        fn = spec.load()
        if not hasattr(fn, "params"):
            raise RuntimeError("the kernels are interpreted (TRITON_INTERPRET=1): unset it to compile them")
        for dtype in dtypes:
            if base in NAMED_KERNELS:
                cfg = {**make_config(64, 32, 4, 2), **NAMED_LAUNCH[base], **extra}
            elif VARIANT_OF[base].launch_tiles is not None:   # the variant's own tile constexprs
                torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
                cfg = {**launch_config(name, head_dim, fake_arch(f"sm{arch}"), torch_dtype), **extra}
            else:
                cfg = {**make_config(64, 32, 4, 2), **extra}
            sig, given, attrs = _signature(spec, fn, dtype, head_dim, True, cfg, False, arch_facts(f"sm{arch}").mma)
            for i, p in enumerate(fn.params):
                if sig.get(p.name) == "i32":
                    sig[p.name], given[p.name] = "constexpr", 1
                    attrs.pop((i,), None)
            src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=given, attrs=attrs)
            context = ir.context()
            ir.load_dialects(context)
            backend.load_dialects(context)
            try:
                src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                            context)
            except Exception as exc:  # noqa: BLE001  (collected, reported by the caller)
                text = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
                errors.append(f"{name} {dtype}: {type(exc).__name__}: {text[-600:]}")
    return errors


def _summary(row: dict) -> str:
    """One compile, for the progress log: registers, spills, shared memory, the MMA family's
    instruction count, pipelining."""
    text = (f"{row['registers']} registers, spills {row['spill_stores']}/{row['spill_loads']} B, "
            f"shared {row['shared_bytes']} B, ")
    if row["arch"].startswith("gfx"):
        return text + (f"mfma {row['mfma']}, scratch {row['scratch_bytes']} B, SGPRs in VGPR lanes "
                       f"{row['sgpr_spills']}, occupancy {row['occupancy']}")
    return text + (f"wgmma {row['wgmma']}{' (replicated tiles)' if row['mma_replicated'] else ''}, "
                   + (f"tcgen05 {row['tcgen05']}, " if row["tcgen05"] else "")
                   + (f"warp-specialized: {row['ws_partitions']} partitions, setmaxnreg {row['setmaxnreg']}, "
                      if row["ws_partitions"] else "")
                   + f"mma.sync {row['mma_sync']}, cp.async {row['cp_async']}, pipeline depth {row['pipeline_depth']}")


def arch_summary(rows) -> list[str]:
    """One line per arch of AOT rows (the README's table): its tensor-core instructions as
    compiled, the most registers, the spilling compiles at D <= 128 and at D = 256 (count,
    worst bytes), and the largest shared memory / LDS against the arch's limit."""
    by_arch = {}
    for r in rows:
        if not r.get("error"):
            by_arch.setdefault(r["arch"], []).append(r)
    lines = ["| arch | compiles | tensor-core instructions | most registers | spills, D <= 128 | spills, D = 256 "
             "| largest shared / LDS (limit) |", "|---|---|---|---|---|---|---|"]
    for arch in sorted(by_arch, key=lambda a: (a.startswith("gfx"), int(a[2:]) if a[2:].isdigit() else 0, a)):
        group = by_arch[arch]
        count = lambda col: sum(int(r.get(col) or 0) > 0 for r in group)    # noqa: E731
        families = [name for name, col in (("tcgen05", "tcgen05"), ("wgmma", "wgmma"), ("mma.sync", "mma_sync"),
                                           ("MFMA", "mfma")) if count(col)]
        mma = ", ".join(families) or "none (FMA loops)"

        def spills(sel):
            bad = [int(r["spill_stores"]) for r in group if sel(int(r["D"])) and int(r.get("spill_stores") or 0)]
            total = sum(sel(int(r["D"])) for r in group)
            return f"{len(bad)} of {total}" + (f" (worst {max(bad)} B)" if bad else "") if total else "-"
        limit = arch_facts(arch).shared_memory
        shared = max(int(r.get("shared_bytes") or 0) for r in group)
        lines.append(f"| {arch} | {len(group)} | {mma} | {max(int(r['registers'] or 0) for r in group)} "
                     f"| {spills(lambda d: d <= 128)} | {spills(lambda d: d > 128)} "
                     f"| {shared / 1024:.0f} KiB ({limit // 1024} KiB) |")
    return lines


def launch_config(name: str, D: int, arch, dtype) -> dict:
    """The launch config of AOT kernel `name` (a kernel or one of VARIANTS) at head dim D on `arch`
    (hardware.Arch, e.g. fake_arch("sm90")) for torch `dtype`: its variant's own tile rule where it
    has one (VariantSpec.launch_tiles), else the config family's default (configs.default_config)."""
    from ..ops.common.configs import default_config
    base, extra = VARIANTS.get(name, (name, {}))
    if base in NAMED_KERNELS:   # its launcher's settings over the family's tiles (which it has none of)
        return {**default_config(NAMED_KERNELS[base].family, padded_head_dim(D), arch, dtype), **NAMED_LAUNCH[base]}
    variant = VARIANT_OF[base]
    if variant.launch_tiles is not None:
        return variant.launch_tiles(base, D, dtype, extra, arch)
    return default_config(KERNELS[base].family, padded_head_dim(D), arch, dtype, kernel=base)


def run_aot(archs=(90, 80), head_dims=(64, 128), dtypes=("bf16",), causal=(False, True), kernels=None,
            configs=None, out=None, jobs=2, log=print, ptx_dir=None) -> list[dict]:
    """Compile every kernel for each arch/dtype/head dim/causal with the default config of
    that arch (or each of `configs`); `kernels` may name VARIANTS too. Returns the rows (also written to `out`); with
    `ptx_dir`, each kernel's PTX goes to ptx_dir/sm<arch>/ptx_name(row)."""
    import torch

    from ..ops.common.hardware import fake_arch
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    work = []
    for arch in archs:
        fake = fake_arch(arch_label(arch))   # the architecture table's facts: the config rules key on them
        for name in kernels or KERNELS:
            for dtype in dtypes:
                for D in head_dims:
                    # a variant takes its kernel's config, as the launcher picks it
                    cfgs = configs or [launch_config(name, D, fake, torch_dtype[dtype])]
                    work += [(name, arch, dtype, D, c, dict(cfg)) for c in causal for cfg in cfgs]
    if ptx_dir:
        for i, (name, arch, dtype, D, c, cfg) in enumerate(work):
            folder = os.path.join(ptx_dir, arch_label(arch))
            os.makedirs(folder, exist_ok=True)
            row = dict(kernel=name, dtype=dtype, D=D, causal=int(c), **cfg)
            work[i] = (name, arch, dtype, D, c, cfg, os.path.join(folder, ptx_name(row, bool(configs and len(configs) > 1))))
    rows = []
    note = fp_fusion_note()
    if note:
        log(note)
    with ProcessPoolExecutor(max(1, jobs)) as pool:
        results = pool.map(compile_one, work)
        for i in range(1, len(work) + 1):
            try:
                row = next(results)
            except BrokenProcessPool:
                name, arch, dtype, D, c, cfg, *_ = work[i - 1]
                raise AotCrash(f"a compile process crashed (the compiler aborted it, printing any error above) at "
                               f"or after [{i}/{len(work)}] {arch_label(arch)} {name} {dtype} D={D} causal={int(c)}; "
                               f"{len(rows)} compiles finished (rerun with --jobs 1 --kernels {name} to isolate "
                               f"it)") from None
            rows.append(row)
            what = row["error"] or _summary(row)
            log(f"[{i}/{len(work)}] {row['arch']} {row['kernel']} {row['dtype']} D={row['D']} causal={row['causal']} "
                f"{row['BLOCK_M']}x{row['BLOCK_N']} w{row['num_warps']} s{row['num_stages']}: {what}")
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", newline="") as f:
            writer = csv.DictWriter(f, FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    return rows
