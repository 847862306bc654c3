"""Kernel launch configs (DESIGN §8): the default-config rule and the tuned tables.

A config is {BLOCK_M, BLOCK_N, num_warps, num_stages}, chosen per *config family* (one per
launcher: "dilated_fwd", "dilated_bwd", "block_sparse_fwd", ..., named in each variant's
spec.py), dtype, padded head dim and sequence bucket:

* under the interpreter: INTERPRETER_CONFIG, always;
* on a GPU: the entry of `triton_dilated/configs/<arch>.json` (data only, written by
  `python -m triton_dilated.perf tune`) for config_key(dtype, head dim, bucket), or the
  nearest tuned bucket;
* else `default_config`: the generic rule below with each variant's own rows (its
  `tiles.py`, registered through `register_tiles` when the variant's spec is imported: the
  tiles chosen from ahead-of-time register/spill analyses, whose CSVs are under perf/aot/),
  shrunk until a shared-memory estimate fits the arch.

Nothing here names a variant: a fourth variant brings its rows in its own tiles.py.
"""
from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass, field
from importlib import resources

import torch

from .hardware import Arch, device_arch, fake_arch, padded_head_dim

# Exactly one configuration under TRITON_INTERPRET=1: small tiles keep the interpreter
# (~10 ms per program x key-block step) fast enough for tests.
INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
CONFIG_FIELDS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


def make_config(block_m: int, block_n: int, warps: int, stages: int, **switches) -> dict:
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages, **switches}


@dataclass(frozen=True)
class Switch:
    """A kernel variant a config can select: an extra constexpr key beside CONFIG_FIELDS.
    values[0] is used where a config does not name the switch; `requires` names the Arch
    fact the variant needs ("tma"): archs without it do not have the variant (their
    launchers use values[0])."""
    values: tuple
    requires: str | None = None

    def available(self, arch: Arch | None) -> bool:
        """Whether `arch` (None: the interpreter) has this variant."""
        return self.requires is None or (arch is not None and bool(getattr(arch, self.requires)))


# The band of a padded head dim in the per-arch tables: 64, 128 or 256.
def head_dim_band(head_dim_padded: int) -> int:
    return 64 if head_dim_padded <= 64 else 128 if head_dim_padded <= 128 else 256


@dataclass
class Tiles:
    """One variant's rows of the default-config tables (16-bit inputs unless said), keyed by
    config family or kernel (its AOT name). "Hopper": archs with warpgroup MMAs
    (hardware.ARCH_TABLE's warpgroup_mma: sm90's wgmma, sm100's tcgen05); every other arch
    takes the per-warp tiles.

    switches: family -> {name: Switch}, kernel variants a config selects (perf tune and the
        GPU check's config A/B time them)
    hopper_fwd: family -> config, a Hopper forward at D <= 128 other than 64x64 w4
    narrow_fwd: family -> config, a forward before Hopper at D <= 64 other than 64x64 w4
    bwd: (Hopper?, D <= 64?) -> {family: config}, the backward (its dQ kernel's) tiles
    wide, hopper_wide: family -> config at D = 256
    kernels: kernel -> {(Hopper?, band): config}, a kernel whose tiles are not its family's
        (dK/dV: keys x queries; decode: one query row against BLOCK_N keys)
    per_arch: "mid_smem" (sm86, sm89, sm120) | "cdna" (AMD) | "fma" (sm70, sm75) | "tcgen05"
        (sm100) -> {(kernel or family, band): config}, where the rule's tile spills there
    float32: family -> config, float32 inputs (three tf32 products a dot) other than 32x32 w4
    tuned_kernels: kernel -> family, kernels a tuned table may hold entries of their own for
    fma_spilling: {(family, band)} whose default tiles spill on the FMA archs (auto takes the
        portable path there)"""
    switches: dict = field(default_factory=dict)
    hopper_fwd: dict = field(default_factory=dict)
    narrow_fwd: dict = field(default_factory=dict)
    bwd: dict = field(default_factory=dict)
    wide: dict = field(default_factory=dict)
    hopper_wide: dict = field(default_factory=dict)
    kernels: dict = field(default_factory=dict)
    per_arch: dict = field(default_factory=dict)
    float32: dict = field(default_factory=dict)
    tuned_kernels: dict = field(default_factory=dict)
    fma_spilling: frozenset = frozenset()


# The registered variants' rows, merged (register_tiles); read by the rule below.
VARIANT_SWITCHES: dict = {}
HOPPER_FWD_DEFAULTS: dict = {}
NARROW_HEAD_FWD_DEFAULTS: dict = {}
BWD_DEFAULTS: dict = {(hopper, narrow): {} for hopper in (True, False) for narrow in (True, False)}
WIDE_HEAD_DEFAULTS: dict = {}
HOPPER_WIDE_HEAD_DEFAULTS: dict = {}
KERNEL_DEFAULTS: dict = {}
ARCH_DEFAULTS: dict = {"mid_smem": {}, "cdna": {}, "fma": {}, "tcgen05": {}}
FLOAT32_DEFAULTS: dict = {}
TUNED_KERNELS: dict = {}
FMA_SPILLING: set = set()
FAMILIES: set = set()   # every registered config family (tuned-table validation)


def register_tiles(families, tiles: Tiles) -> None:
    """Add a variant's config families and its rows of the default-config tables (its
    tiles.py calls this when the variant's spec is imported)."""
    FAMILIES.update(families)
    VARIANT_SWITCHES.update(tiles.switches)
    HOPPER_FWD_DEFAULTS.update(tiles.hopper_fwd)
    NARROW_HEAD_FWD_DEFAULTS.update(tiles.narrow_fwd)
    for key, rows in tiles.bwd.items():
        BWD_DEFAULTS[key].update(rows)
    WIDE_HEAD_DEFAULTS.update(tiles.wide)
    HOPPER_WIDE_HEAD_DEFAULTS.update(tiles.hopper_wide)
    KERNEL_DEFAULTS.update(tiles.kernels)
    for kind, rows in tiles.per_arch.items():
        ARCH_DEFAULTS[kind].update(rows)
    FLOAT32_DEFAULTS.update(tiles.float32)
    TUNED_KERNELS.update(tiles.tuned_kernels)
    FMA_SPILLING.update(tiles.fma_spilling)


# The decode kernels (one query row against BLOCK_N keys of its key list: vector-matrix
# work) take 64-key tiles with 4 warps and 3 stages unless a variant says otherwise; the
# split-K merge of every decode kernel is registered here.
DECODE_TILE = make_config(16, 64, 4, 3)


def decode_tiles(overrides=None) -> dict:
    """{(Hopper?, band): config} of a decode kernel: DECODE_TILE, but `overrides` (a dict of
    the same keys)."""
    rows = {(hopper, band): dict(DECODE_TILE) for hopper in (True, False) for band in (64, 128, 256)}
    rows.update(overrides or {})
    return rows


register_tiles((), Tiles(kernels={"decode_merge": decode_tiles()}))


def switch_value(family: str, config: dict, name: str) -> int:
    """The value of variant switch `name` that `config` selects (its default when absent)."""
    switch = VARIANT_SWITCHES[family][name]
    value = config.get(name, switch.values[0])
    if isinstance(value, bool) or not isinstance(value, int) or value not in switch.values:
        raise ValueError(f"config[{name!r}] of {family}: expected one of {list(switch.values)}, got {value!r}")
    return value


def switch_alternatives(family: str, config: dict, arch: Arch | None) -> list:
    """`config` with one switch of the family set to each of its other values, for the
    switches `arch` has (None or the interpreter: those that need no hardware fact)."""
    out = []
    for name, switch in VARIANT_SWITCHES.get(family, {}).items():
        if not switch.available(arch):
            continue
        current = switch_value(family, config, name)
        out += [{**config, name: v} for v in switch.values if v != current]
    return out


def config_label(config: dict) -> str:
    """"64x64 w4 s3", with the switches a config names: "64x64 w4 s3 FLAT_LOOP=0"."""
    extra = "".join(f" {k}={v}" for k, v in config.items() if k not in CONFIG_FIELDS)
    return f"{config['BLOCK_M']}x{config['BLOCK_N']} w{config['num_warps']} s{config['num_stages']}{extra}"


def _arch_defaults(arch: Arch) -> dict:
    """The per-arch rows that replace the rule's where it spills: mid_smem (sm86, sm89,
    sm120: no warpgroup MMAs, async copies, under 160 KiB of shared memory), cdna (AMD), fma
    (archs where Triton's dots are FMA loops: sm70, sm75), tcgen05 (sm100), else none."""
    if arch.vendor == "amd":
        return ARCH_DEFAULTS["cdna"]
    if arch.mma == "fma":
        return ARCH_DEFAULTS["fma"]
    if arch.mma == "tcgen05":
        return ARCH_DEFAULTS["tcgen05"]
    mid_smem = not arch.warpgroup_mma and arch.async_copy and arch.shared_memory < 160 * 1024
    return ARCH_DEFAULTS["mid_smem"] if mid_smem else {}


def is_backward(family: str) -> bool:
    return family.endswith("_bwd")


def shared_memory_estimate(family: str, config: dict, head_dim_padded: int, element_size: int) -> int:
    """Rough shared memory of a launch, in bytes: forward, the q tile plus the pipelined k, v
    tiles; backward, the pipelined q, dO tiles, the k, v tiles and a float32 score tile."""
    stages = max(1, config["num_stages"] - 1)
    m, n, d = config["BLOCK_M"], config["BLOCK_N"], head_dim_padded
    if element_size == 4:   # float32 dots are three tf32 products: split operands, about twice the space
        element_size = 8
    if not is_backward(family):
        return (m + stages * 2 * n) * d * element_size
    return (stages * 2 * m + 2 * n) * d * element_size + m * n * 4


def config_fits(family: str, config: dict, head_dim_padded: int, arch: Arch, dtype: torch.dtype) -> bool:
    """Whether the shared-memory estimate of `config` fits one block of `arch`. Before
    Ampere (no async copies) Triton lays operands out differently: the ahead-of-time compile
    for sm75/sm70 needs up to about twice the estimate."""
    factor = 2 if arch.vendor == "nvidia" and not arch.async_copy else 1
    element_size = torch.tensor([], dtype=dtype).element_size()
    limit = arch.shared_memory or 48 * 1024
    return factor * shared_memory_estimate(family, config, head_dim_padded, element_size) <= limit


def default_config(family: str, head_dim_padded: int, arch: Arch, dtype: torch.dtype = torch.bfloat16,
                   kernel: str | None = None) -> dict:
    """The config used where configs/<arch>.json has no tuned entry (the rule with the
    registered variants' rows, Tiles): 16-bit inputs, first a per-arch row (mid_smem, cdna,
    fma, tcgen05), then the kernel's own row (KERNEL_DEFAULTS); float32 inputs, FLOAT32_DEFAULTS
    or 32x32 w4 s2; D > 128, (HOPPER_)WIDE_HEAD_DEFAULTS; backward, BWD_DEFAULTS; forward, the
    Hopper or narrow-head rows, else 64x64 tiles with 4 warps up to D = 64 and 8 up to D =
    128. Then fewer stages, then smaller tiles, until the shared-memory estimate fits."""
    big_smem = arch.shared_memory >= 160 * 1024
    hopper = arch.warpgroup_mma
    band = head_dim_band(head_dim_padded)
    own = KERNEL_DEFAULTS.get(kernel, {}).get((hopper, band))
    mid = _arch_defaults(arch).get((kernel, band) if kernel in KERNEL_DEFAULTS else (family, band))
    if mid and dtype != torch.float32:
        cfg = dict(mid)
    elif own is not None and dtype != torch.float32:
        cfg = dict(own)
    elif dtype == torch.float32:
        # three tf32 products per dot need about twice the registers and shared memory
        cfg = dict(FLOAT32_DEFAULTS.get(family, make_config(32, 32, 4, 2)))
    elif head_dim_padded > 128 and family in WIDE_HEAD_DEFAULTS:
        cfg = dict((HOPPER_WIDE_HEAD_DEFAULTS if hopper else WIDE_HEAD_DEFAULTS)[family])
    elif is_backward(family):
        cfg = dict(BWD_DEFAULTS[(hopper, head_dim_padded <= 64)].get(family, make_config(64, 32, 4, 2)))
    elif hopper:
        cfg = dict(HOPPER_FWD_DEFAULTS.get(family, make_config(64, 64, 4, 3 if big_smem else 2)))
    elif head_dim_padded <= 64 and family in NARROW_HEAD_FWD_DEFAULTS:
        cfg = dict(NARROW_HEAD_FWD_DEFAULTS[family])
    else:
        cfg = make_config(64, 64, 4 if head_dim_padded <= 64 else 8, 3 if big_smem else 2)
    while not config_fits(family, cfg, head_dim_padded, arch, dtype):
        if cfg["num_stages"] > 1:
            cfg["num_stages"] -= 1
        elif max(cfg["BLOCK_M"], cfg["BLOCK_N"]) > 16:
            cfg["BLOCK_M" if cfg["BLOCK_M"] >= cfg["BLOCK_N"] else "BLOCK_N"] //= 2
            cfg["num_warps"] = 4   # smaller tiles than chosen: 8 warps would sit idle
        else:
            break
    return cfg


def seq_bucket(n: int) -> int:
    """Sequence-length bucket: the next power of two, at least 1024, at most 1M."""
    b = 1024
    while b < n and b < (1 << 20):
        b *= 2
    return b


def config_key(dtype: torch.dtype, head_dim_padded: int, seqlen: int) -> str:
    """The key of a tuned entry in configs/<arch>.json: "<dtype>/d<padded D>/n<bucket>"."""
    return f"{str(dtype).removeprefix('torch.')}/d{head_dim_padded}/n{seq_bucket(seqlen)}"


# What a tuned entry may hold (checked once per file, when it is loaded): tiles of 16-256
# (tl.dot's minimum; `perf tune` proposes at most 128), warps and stages Triton accepts.
TILE_RANGE = (16, 256)
WARPS = (1, 2, 4, 8, 16)
STAGES = range(1, 9)
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def entry_problems(family: str, key: str, config, arch_name: str) -> list[str]:
    """Why a tuned entry (kernels[family][key] = config) cannot be used, as messages ([] when
    it can): an unknown family or malformed key "<dtype>/d<D>/n<bucket>", a config that is not
    a dict of ints with exactly CONFIG_FIELDS and the family's switches, tiles that are not
    powers of two in TILE_RANGE, warps or stages Triton would refuse, a switch value the
    family does not have, or (for a known arch) a shared-memory estimate over the arch's."""
    known = FAMILIES | set(TUNED_KERNELS)
    if family not in known:
        return [f"unknown kernel family {family!r} (known: {', '.join(sorted(known))})"]
    parts = key.split("/") if isinstance(key, str) else []
    ok_key = (len(parts) == 3 and parts[0] in _DTYPES and parts[1][:1] == "d" and parts[1][1:].isdigit()
              and parts[2][:1] == "n" and parts[2][1:].isdigit())
    if not ok_key:
        return [f"key {key!r} is not \"<dtype>/d<head dim>/n<bucket>\" (e.g. \"bfloat16/d128/n8192\")"]
    if not isinstance(config, dict):
        return [f"must be an object of {', '.join(CONFIG_FIELDS)}, got {type(config).__name__}"]
    switches = {} if family in TUNED_KERNELS else VARIANT_SWITCHES.get(family, {})
    problems = [f"unknown key {name!r}" for name in config if name not in CONFIG_FIELDS and name not in switches]
    problems += [f"missing {name}" for name in CONFIG_FIELDS if name not in config]
    for name, value in config.items():
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{name} must be an int, got {value!r}")
    if problems:
        return problems
    lo, hi = TILE_RANGE
    for name in ("BLOCK_M", "BLOCK_N"):
        v = config[name]
        if not (lo <= v <= hi and v & (v - 1) == 0):
            problems.append(f"{name} must be a power of two in [{lo}, {hi}], got {v}")
    if config["num_warps"] not in WARPS:
        problems.append(f"num_warps must be one of {list(WARPS)}, got {config['num_warps']}")
    if config["num_stages"] not in STAGES:
        problems.append(f"num_stages must be in [{STAGES.start}, {STAGES.stop - 1}], got {config['num_stages']}")
    for name, switch in switches.items():
        if name in config and config[name] not in switch.values:
            problems.append(f"{name} must be one of {list(switch.values)}, got {config[name]}")
    if problems:
        return problems
    try:
        arch = fake_arch(arch_name)
    except ValueError:
        return []   # an arch the table does not know: no limit to check against
    head_dim, dtype = int(parts[1][1:]), _DTYPES[parts[0]]
    if not config_fits(TUNED_KERNELS.get(family, family), config, head_dim, arch, dtype):
        problems.append(f"needs more shared memory than {arch_name}'s {arch.shared_memory // 1024} KiB per block "
                        f"(estimate)")
    return problems


def validate_table(table, source: str, arch_name: str) -> dict:
    """The usable part of a parsed tuned table: entries with problems are dropped, all of them
    reported in one warning naming `source`, each entry's key and reason. Dropping, not
    raising: tuned entries only make kernels faster (the defaults are always correct and
    checked by `perf aot`), so a damaged file must neither stop the kernels nor run a config
    that gives garbage (BLOCK_M = 0 ran and returned NaN) or sends `auto` to the portable path
    (4096-wide tiles); the warning says what to fix. `perf tune` writes files that pass."""
    problems = []
    if not isinstance(table, dict) or not isinstance(table.get("kernels", {}), dict):
        problems.append(f"must be an object with a \"kernels\" object, got {type(table).__name__}"
                        + (f" with \"kernels\" a {type(table.get('kernels')).__name__}" if isinstance(table, dict)
                           else ""))
        table = {}
    kept = {}
    for family, entries in table.get("kernels", {}).items():
        if not isinstance(entries, dict):
            problems.append(f"kernels[{family!r}] must be an object of entries, got {type(entries).__name__}")
            continue
        for key, config in entries.items():
            bad = entry_problems(family, key, config, arch_name)
            if bad:
                problems.append(f"kernels[{family!r}][{key!r}]: " + "; ".join(bad))
            else:
                kept.setdefault(family, {})[key] = config
    if problems:
        warnings.warn(f"tuned configs {source}: ignoring {len(problems)} unusable part(s) (the default configs serve "
                      f"them): " + " | ".join(problems), UserWarning, stacklevel=3)
    return {**table, "kernels": kept}


def tuned_table_path(arch_name: str):
    """The package's configs/<arch>.json (a Traversable; it may not exist)."""
    return resources.files("triton_dilated.configs").joinpath(f"{arch_name}.json")


@functools.lru_cache(maxsize=None)
def load_arch_table(arch_name: str) -> dict:
    """The parsed and validated configs/<arch>.json ({} when there is none; validate_table
    drops, with one warning naming the file, what cannot be used)."""
    path = tuned_table_path(arch_name)
    try:
        text = path.read_text()
    except (FileNotFoundError, ModuleNotFoundError):
        return {}
    try:
        table = json.loads(text)
    except json.JSONDecodeError as exc:
        warnings.warn(f"tuned configs {path}: not valid JSON ({exc}); ignoring the file (the default configs serve "
                      f"every kernel). `python -m triton_dilated.perf tune` rewrites it.", UserWarning, stacklevel=2)
        return {}
    return validate_table(table, str(path), arch_name)


def tuned_entry(family: str, dtype: torch.dtype, head_dim_padded: int, seqlen: int, arch_name: str):
    """(config, source) from configs/<arch>.json: the exact bucket ("<arch>.json"), else the
    nearest tuned bucket of the same dtype and head dim ("<arch>.json nearest bucket"), else
    (None, "fallback")."""
    table = load_arch_table(arch_name).get("kernels", {}).get(family, {})
    key = config_key(dtype, head_dim_padded, seqlen)
    if key in table:
        return dict(table[key]), f"{arch_name}.json"
    prefix = key.rsplit("/", 1)[0] + "/n"
    near = sorted((abs(int(k.rsplit("n", 1)[1]).bit_length() - seq_bucket(seqlen).bit_length()), k)
                  for k in table if k.startswith(prefix))
    if near:
        return dict(table[near[0][1]]), f"{arch_name}.json nearest bucket"
    return None, "fallback"


def select_config(family: str, dtype: torch.dtype, head_dim_padded: int, seqlen: int,
                  device: torch.device, kernel: str | None = None) -> dict:
    """The launch config: one fixed config off-GPU (the interpreter); on a GPU, the tuned
    entry of configs/<arch>.json (one for every kernel of the family), else default_config.
    A kernel with a KERNEL_DEFAULTS entry (the dilated, block-sparse and ring step dK/dV, the
    decode kernels) keeps its own default: `perf tune` times each family's first kernel, so a
    tuned family entry says nothing about them; a dK/dV kernel takes an entry under its own
    name (TUNED_KERNELS) where the table has one."""
    if device.type != "cuda":
        return dict(INTERPRETER_CONFIG)
    arch = device_arch(device)
    if kernel in TUNED_KERNELS:
        cfg, _ = tuned_entry(kernel, dtype, head_dim_padded, seqlen, arch.name)
        if cfg is not None:
            return cfg
    if kernel in KERNEL_DEFAULTS:
        return default_config(family, head_dim_padded, arch, dtype, kernel)
    cfg, _ = tuned_entry(family, dtype, head_dim_padded, seqlen, arch.name)
    return cfg if cfg is not None else default_config(family, head_dim_padded, arch, dtype, kernel)


def kernels_spill_free(families, head_dim: int, device: torch.device) -> bool:
    """Whether the default tiles of `families` compile without register spills for this head
    dim on this GPU (what backend="auto" asks before taking the Triton kernels). False only
    on archs without tensor-core dots in Triton (sm70, sm75), for FMA_SPILLING. Off-GPU: True."""
    if device.type != "cuda":
        return True
    arch = device_arch(device)
    padded = padded_head_dim(head_dim)
    band = head_dim_band(padded)
    return not (arch.mma == "fma" and any((f, band) in FMA_SPILLING for f in families))


def kernels_fit(families, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the Triton kernels of `families` can run this problem on this GPU: a config of
    each fits shared memory (no tile fits a Turing block for the backward at D = 256), and
    the GPU has TF32 tensor cores for float32 (Ampere on; before, the kernels' float32 dots
    are slow FMA loops with tiles that do not fit). Off-GPU: True."""
    if device.type != "cuda":
        return True
    padded = padded_head_dim(head_dim)
    arch = device_arch(device)
    if dtype == torch.float32 and not arch.tf32:
        return False
    return all(config_fits(f, select_config(f, dtype, padded, 1024, device), padded, arch, dtype) for f in families)
