"""Multi-process harness for the ring fault tests (ranks that disagree, double backward):
spawn `world` gloo processes, run named scenarios in one process group, send back what
each rank saw. Imported by the spawned children. Timeouts on the rendezvous, on every
collective (the process group's) and on the join, so a scenario that hangs fails."""
from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist

from tests.helpers.ring_worker import spawn_world

BASE = dict(B=1, N=48, Hq=2, Hkv=1, D=8, dtype="float32")


def inputs(rank, world, *, B, N, Hq, Hkv, D, dtype, seed=0, requires_grad=True):
    """This rank's shard of seeded full-sequence q, k, v (B, N, H, D), N global."""
    from triton_dilated import shard
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(B, N, h, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv)]
    return [shard(x, rank, world).to(getattr(torch, dtype)).clone().requires_grad_(requires_grad) for x in full]


def _mismatch(rank, world, spec):
    """ring_attention (ulysses_attention with spec["fn"] == "ulysses") with BASE shapes (and
    spec's "shape_all") and kwargs, except that rank 1 uses spec's overrides. Returns ("ok",
    None) or (exception type name, message). kw "sinks_value": sink logits of that value."""
    from triton_dilated import ring_attention, ulysses_attention
    shape = dict(BASE, **spec.get("shape_all", {}), **(spec.get("shape", {}) if rank == 1 else {}))
    kw = dict(spec.get("kw", {}), **(spec.get("kw1", {}) if rank == 1 else {}))
    sinks_value = kw.pop("sinks_value", None)
    if sinks_value is not None:
        kw["sinks"] = torch.full((shape["Hq"],), float(sinks_value))
    window = kw.pop("layout_window", None)
    if window is not None:   # a local layout: blocks of 16, `window` blocks either side
        from triton_dilated import layouts
        kw["layout"] = layouts.local(BASE["N"], 16, window)
    q, k, v = inputs(rank, world, **shape, requires_grad=not (spec.get("no_grad_on_1") and rank == 1))
    try:
        out = (ulysses_attention if spec.get("fn") == "ulysses" else ring_attention)(q, k, v, **kw)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", tuple(out.shape)


def _agreed_case(rank, world):
    """A matching call after the failed ones: the group is still usable and right."""
    from triton_dilated import dilated_attention_naive, ring_attention, shard
    q, k, v = inputs(rank, world, **BASE)
    out = ring_attention(q, k, v, segment_lengths=[8, 48], dilation_rates=[1, 2], causal=True)
    full = inputs(0, 1, **BASE)
    ref, _ = dilated_attention_naive(*full, [8, 48], [1, 2], causal=True)
    return float((out.double() - shard(ref, rank, world)).abs().max())


def _double_backward(rank, world, comm):
    """First-order gradients with create_graph=True equal the ordinary ones; a second
    backward through them raises on this rank. Returns (max grad difference, error)."""
    from triton_dilated import ring_attention
    q, k, v = inputs(rank, world, **BASE)
    kw = dict(causal=True, comm=comm)
    plain = torch.autograd.grad((ring_attention(q, k, v, **kw) ** 2).sum(), (q, k, v))
    grads = torch.autograd.grad((ring_attention(q, k, v, **kw) ** 2).sum(), (q, k, v), create_graph=True)
    diff = max(float((a - b).abs().max()) for a, b in zip(plain, grads))
    penalty = sum((g ** 2).sum() for g in grads) + (q ** 3).sum()   # depends on q directly too
    try:
        torch.autograd.grad(penalty, (q,))
    except RuntimeError as exc:
        return diff, str(exc)
    return diff, None


def worker(rank, world, init_file, scenarios, queue, timeout_s):
    try:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        results = {}
        for name, spec in scenarios:
            if spec.get("kind") == "agreed":
                results[name] = _agreed_case(rank, world)
            elif spec.get("kind") == "double_backward":
                results[name] = _double_backward(rank, world, spec["comm"])
            else:
                results[name] = _mismatch(rank, world, spec)
        queue.put((rank, "ok", results))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))


def run_world(world, scenarios, timeout_s=20, join_s=180):
    """{rank: ("ok", {scenario: result}) or ("error", traceback)}; a rank that died or hung
    is missing."""
    return spawn_world(worker, world, lambda queue: (scenarios, queue, timeout_s), join_s, missing_ok=True)
