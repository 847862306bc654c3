"""`python -m triton_dilated.perf tune`: autotune the kernel configs for this GPU's arch
(DESIGN §8).

For each config family (the variants' spec.py: dilated_fwd, dilated_bwd, block_sparse_fwd,
block_sparse_bwd, ring_step_fwd, ring_step_bwd), dtype, head dim and sequence bucket, every
candidate {BLOCK_M, BLOCK_N, num_warps, num_stages} is timed by calling the launchers with
`config=...`; then the best tile again with each other value of the family's kernel variant
switches (configs.VARIANT_SWITCHES: the dilated FLAT_LOOP, the block-sparse TMA), so one
run settles what the compiled code cannot. A candidate that fails to compile or run (shared
memory, registers) or disagrees with the current default config's result is dropped, and
the fastest of the rest is kept, switches included. The result is written as `configs/<arch>.json` in the
format `configs.select_config` reads:

    {"arch": "sm90", "tuned": true, "kernels": {kernel: {"<dtype>/d<padded D>/n<bucket>": {...}}},
     "measured": {kernel: {key: {"ms": ..., "shape": ..., ...}}}}

Entries that were not tuned in this pass are kept from the existing file. The JSON (and a
CSV of every candidate's time) is rewritten after each kernel, so a run cut short keeps
what it finished. Under TRITON_INTERPRET=1 there is exactly one config
(configs.INTERPRETER_CONFIG), "tuned" on a tiny shape: multi-config tuning needs a GPU.
"""
from __future__ import annotations

import datetime
import json
import os
import time
import warnings
from importlib import resources

import torch

from ..ops.common.configs import (CONFIG_FIELDS, INTERPRETER_CONFIG, config_fits, config_key, default_config,
                                  switch_alternatives, validate_table)
from ..ops.common.configs import make_config as _cfg
from ..ops import SPECS
from ..ops.common.hardware import get_arch, padded_head_dim
from ..ops.common.runtime import interpreter_enabled
from .results import CsvSink, make_row, provenance
from .timing import Timing, median_ms

# config family -> the variant spec whose problem exercises it
FAMILIES = {family: spec for spec in SPECS for family in spec.families}
KERNELS = tuple(FAMILIES)
CONFIG_KEYS = CONFIG_FIELDS


# Candidate lists (a GPU): the usual flash-attention tile shapes; pruned per arch by a
# shared-memory estimate before anything is compiled.
# The arch's default (configs.default_config) always goes first, so a short tune
# (max_candidates) still compares against it.
FWD_CANDIDATES = [_cfg(128, 64, 4, 3), _cfg(128, 64, 8, 3), _cfg(128, 128, 8, 3), _cfg(64, 64, 4, 3),
                  _cfg(64, 64, 8, 3), _cfg(64, 64, 4, 4), _cfg(128, 32, 4, 3), _cfg(64, 128, 4, 3),
                  _cfg(128, 64, 8, 2), _cfg(128, 128, 8, 2), _cfg(64, 32, 4, 2)]
BWD_CANDIDATES = [_cfg(64, 64, 4, 2), _cfg(64, 64, 8, 2), _cfg(64, 64, 4, 3), _cfg(128, 64, 8, 2),
                  _cfg(64, 128, 8, 2), _cfg(128, 128, 8, 2), _cfg(32, 64, 4, 2), _cfg(64, 32, 4, 2),
                  _cfg(128, 64, 4, 2), _cfg(32, 32, 4, 2), _cfg(32, 32, 4, 1)]


def candidates(kernel: str, head_dim_padded: int, dtype: torch.dtype, arch, limit: int | None = None):
    """The candidate list for a kernel, pruned where a rough shared-memory estimate exceeds
    the arch's per-block maximum. Under the interpreter: exactly INTERPRETER_CONFIG."""
    if arch.capability == (0, 0):
        return [dict(INTERPRETER_CONFIG)]
    first = default_config(kernel, head_dim_padded, arch, dtype)
    pool = BWD_CANDIDATES if kernel.endswith("_bwd") else FWD_CANDIDATES
    out = [dict(c) for c in [first] + [c for c in pool if c != first]
           if config_fits(kernel, c, head_dim_padded, arch, dtype)]
    return out[:limit] if limit else out


# ----------------------------------------------------------------------------- problems

def run_problem(problem, family: str, config):
    """Launch the kernels of a config family once on `problem` (the variant spec's
    problem object) with `config` (None: the library's pick)."""
    return problem.backward(config) if family.endswith("_bwd") else problem.forward(config)


def _agrees(ref, got) -> bool:
    """Loose check that a candidate computes the same thing (catches garbage, not rounding)."""
    for a, b in zip(ref, got):
        a, b = a.float(), b.float()
        if not torch.isfinite(b).all():
            return False
        if (a - b).abs().max().item() > 0.05 * max(a.abs().max().item(), 1e-3) + 1e-3:
            return False
    return True


# ----------------------------------------------------------------------------- JSON


def load_table(arch_name: str, out_dir: str | None) -> dict:
    """The current table for this arch: out_dir/<arch>.json if present, else the package's.

    The user's own file (--out) must be whole: one that is not valid JSON, not a table, made
    for another arch or holding entries validate_table would drop is refused (RuntimeError
    naming the file and why; the tune run would otherwise overwrite it, and what it held is
    lost). The package's table is the library's: what cannot be used is left out with one
    warning naming it, and the run rewrites it."""
    own = os.path.join(out_dir, f"{arch_name}.json") if out_dir else None
    path = own if own and os.path.exists(own) else resources.files("triton_dilated.configs").joinpath(
        f"{arch_name}.json")
    strict = path is own

    def refuse(why: str):
        raise RuntimeError(f"tuned configs {path}: {why}; the tune run would overwrite it. Fix or move the file "
                           f"(or choose another --out)")

    try:
        text = path.read_text() if hasattr(path, "read_text") else open(path).read()
    except (FileNotFoundError, ModuleNotFoundError):
        return {}
    try:
        table = json.loads(text)
    except json.JSONDecodeError as exc:
        if strict:
            refuse(f"not valid JSON ({exc})")
        warnings.warn(f"tuned configs {path}: not valid JSON ({exc}); starting a new table", UserWarning, stacklevel=2)
        return {}
    if not strict:
        return validate_table(table, str(path), arch_name)
    if not isinstance(table, dict):
        refuse(f"must be a JSON object (a table), got {type(table).__name__}")
    if table.get("arch", arch_name) != arch_name:
        refuse(f"is the table of {table.get('arch')!r}, not of this GPU's arch {arch_name!r}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = validate_table(table, str(path), arch_name)
    if caught:
        refuse("unusable entries: " + str(caught[0].message).split("serve them): ", 1)[-1])
    return kept


def config_path(arch_name: str, out_dir: str | None) -> str:
    if out_dir:
        return os.path.join(out_dir, f"{arch_name}.json")
    return str(resources.files("triton_dilated.configs").joinpath(f"{arch_name}.json"))


def _write_json(table: dict, path: str):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"   # written whole, then renamed over the table: a reader never sees half a file
    try:
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


table_key = config_key   # the key of an entry in configs/<arch>.json


# ----------------------------------------------------------------------------- the sweep

def run_tune(out_dir=None, kernels=KERNELS, dtypes=None, head_dims=None, seqlens=None, causal=True,
             heads=None, max_candidates=None, csv_path=None, log=print):
    """Tune and write the arch's JSON; returns (path, table). See the module docstring."""
    if torch.cuda.is_available():
        device = "cuda"
        arch = get_arch(torch.cuda.current_device())
        dtypes = dtypes or [torch.bfloat16, torch.float16]
        head_dims = head_dims or [64, 128]
        seqlens = seqlens or [4096, 16384, 65536]
        heads = heads or 16
        timing = Timing(warmup=2, budget_s=0.15, min_reps=5, max_reps=50, max_s=2.0)
    elif interpreter_enabled():
        device = "cpu"
        arch = get_arch(None)
        dtypes = [torch.float32]                  # the interpreter: one config, one tiny shape
        head_dims = head_dims[:1] if head_dims else [16]
        seqlens = seqlens[:1] if seqlens else [64]
        heads = heads or 1
        timing = Timing(warmup=0, budget_s=0.0, min_reps=1, max_reps=1, max_s=0.0)
        log("TRITON_INTERPRET=1 on a CPU: 'tuning' the one interpreter config on a tiny shape "
            "(multi-config autotuning needs a GPU).")
    else:
        raise RuntimeError("tune needs a CUDA GPU (or TRITON_INTERPRET=1 for the one-config interpreter pass)")

    path = config_path(arch.name, out_dir)
    table = load_table(arch.name, out_dir)
    table["arch"] = arch.name
    table["tuned"] = True
    table["note"] = ("Tuned by `python -m triton_dilated.perf tune` on this arch: entries listed under "
                     "'measured' were timed; the others are kept from the previous file.")
    table.setdefault("kernels", {})
    table.setdefault("measured", {})
    prov = provenance(device)
    table["device_name"] = arch.device_name
    csv_path = csv_path or (os.path.join(out_dir, f"tune-{arch.name}.csv") if out_dir else None)
    jobs = [(kernel, dtype, d, n) for kernel in kernels for dtype in dtypes for d in head_dims for n in seqlens]
    log(f"tuning {len(jobs)} (kernel, dtype, head dim, N) entries for {arch.name} ({arch.device_name}) -> {path}")
    problems = {}
    t_start = time.perf_counter()
    with CsvSink(csv_path) as sink:
        for i, (kernel, dtype, d, n) in enumerate(jobs):
            block_d = padded_head_dim(d)
            key = table_key(dtype, block_d, n)
            pkey = (FAMILIES[kernel].name, dtype, d, n)
            if pkey not in problems:
                problems.clear()                 # one problem's tensors at a time
                if device == "cuda":
                    torch.cuda.empty_cache()
                problems[pkey] = FAMILIES[kernel].problem(1, n, heads, d, dtype, device, causal)
            prob = problems[pkey]
            cands = candidates(kernel, block_d, dtype, arch, max_candidates)
            ref = None
            if len(cands) > 1:
                try:    # the reference: the config select_config picks today (the one the tests cover)
                    ref = run_problem(prob, kernel, None)
                except Exception as exc:   # the first candidate that runs becomes the reference
                    log(f"  {kernel} {key}: the default config failed ({type(exc).__name__}); "
                        "comparing candidates with each other")
            results = []

            def try_config(cfg):
                nonlocal ref
                try:
                    got = run_problem(prob, kernel, cfg)
                    if ref is None:
                        ref = got
                    elif not _agrees(ref, got):
                        log(f"  {kernel} {key} {cfg}: result differs from the default config's, dropped")
                        return
                    ms = median_ms(lambda: run_problem(prob, kernel, cfg), device, timing)
                except Exception as exc:     # out of shared memory / registers, compile errors
                    log(f"  {kernel} {key} {cfg}: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})")
                    if device == "cuda":
                        torch.cuda.synchronize()
                    return
                results.append((ms, cfg))
                sink.write([make_row(op=f"tune:{kernel}", variant=FAMILIES[kernel].name, provider="triton",
                                     **{"pass": kernel.rsplit("_", 1)[1]},
                                     B=1, N=n, H=heads, Hkv=heads, D=d, dtype=str(dtype).removeprefix("torch."),
                                     causal=causal, metric="ms", value=round(ms, 6),
                                     config=" ".join(f"{k}={v}" for k, v in cfg.items()), layout=prob.shape,
                                     **prov)])

            for cfg in cands:
                try_config(cfg)
            if results:   # the kernel variants (configs.VARIANT_SWITCHES), timed on the best tile
                best_tile = min(results, key=lambda t: t[0])[1]
                alternatives = switch_alternatives(kernel, best_tile, arch)
                for cfg in alternatives:
                    try_config(cfg)
                cands = cands + alternatives
            if not results:
                log(f"[{i + 1}/{len(jobs)}] {kernel} {key}: no candidate ran; entry left as it was")
                continue
            best_ms, best = min(results, key=lambda t: t[0])
            table["kernels"].setdefault(kernel, {})[key] = {k: int(v) for k, v in best.items()}
            table["measured"].setdefault(kernel, {})[key] = {
                "ms": round(best_ms, 4), "worst_ms": round(max(r[0] for r in results), 4),
                "candidates": len(cands), "ran": len(results), "shape": prob.shape,
                "device": arch.device_name, "torch": prov["torch"], "triton": prov["triton"],
                "git_sha": prov["git_sha"],
                "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
            _write_json(table, path)
            log(f"[{i + 1}/{len(jobs)}] {kernel} {key}: best {best} {best_ms:.3f} ms "
                f"({len(results)}/{len(cands)} ran, {time.perf_counter() - t_start:.0f} s so far)")
    _write_json(table, path)
    return path, table
