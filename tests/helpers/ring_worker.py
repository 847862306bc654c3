"""Multi-process harness for the ring tests: spawn `world` gloo processes, run many cases
in one process group, send each rank's results back (the test compares them with the
float64 oracle). Imported by the spawned children."""
from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist


def make_inputs(case, device="cpu"):
    """q, k, v and the cotangents g (of out) and gl (of lse) of the full sequence, float32."""
    g = torch.Generator().manual_seed(case.get("seed", 0))
    B, N, Hq, Hkv, D = case["B"], case["N"], case["Hq"], case["Hkv"], case["D"]
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).float().to(device)  # noqa: E731
    return mk(B, N, Hq, D), mk(B, N, Hkv, D), mk(B, N, Hkv, D), mk(B, N, Hq, D), mk(B, Hq, N)


def case_sinks(case):
    """A case's learnable sink logits, float32 (Hq,) (None without case["sink_logits"]; case["sinks"]
    is a sliding window's sink tokens)."""
    if not case.get("sink_logits"):
        return None
    return torch.randn(case["Hq"], generator=torch.Generator().manual_seed(7), dtype=torch.float64).float()


def case_layout(case, n=None):
    """The BlockLayout of a "layout" case (every block for "dense"); None for "dilated". n: of
    a sequence of that length (a document's) instead of case["N"]."""
    from triton_dilated import BlockLayout, layouts
    n = case["N"] if n is None else n
    if case["kind"] == "layout":
        return layouts.bigbird(n, case["bs"], 1, 1, 1, seed=1, num_heads=case["Hq"])
    if case["kind"] == "window":   # a sliding window (issue 23), with a per-head random layout when "union"
        lay = layouts.sliding_window(n, case["bs"], case["window"], sinks=case["sinks"])
        return lay | layouts.random(n, case["bs"], 1, seed=2, num_heads=case["Hq"]) if case.get("union") \
            else lay
    if case["kind"] == "dense":
        nb = -(-n // 16)
        return BlockLayout.from_dense(torch.ones(nb, nb, dtype=torch.bool), 16)
    return None


def loss_of(out, lse, g, gl, case):
    """The test loss: sum(out * g) + lse_weight * sum(lse * gl) over rows with keys."""
    fin = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return (out * g).sum() + (fin * gl).sum() * case.get("lse_weight", 1.0)


_GRIDS: dict = {}


def grid_groups(world, U, rank):
    """This rank's (Ulysses group, ring group) in a grid of U x (world // U) ranks, Ulysses
    groups of consecutive ranks (rank = r * U + u). Every rank creates every group, in the
    same order, the first time a grid is asked for."""
    if (world, U) not in _GRIDS:
        _GRIDS[(world, U)] = ([dist.new_group(list(range(r * U, (r + 1) * U))) for r in range(world // U)],
                              [dist.new_group(list(range(u, world, U))) for u in range(U)])
    ulysses, rings = _GRIDS[(world, U)]
    return ulysses[rank // U], rings[rank % U]


def run_case(case, rank, world):
    """This rank's ring results (ulysses_attention's with case["fn"] == "ulysses"): out,
    lse, dq, dk, dv of its shard (numpy, so the queue carries them by value), the loss
    summed over ranks, the peak key/value bytes held."""
    from triton_dilated import ring_attention, shard, ulysses_attention
    from triton_dilated.ops.ring import interface as ring_mod
    if "interpret" in case:   # "0": the portable ring step (and local calls) for this case
        saved, os.environ["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET"), case["interpret"]
        try:
            return run_case({k: v for k, v in case.items() if k != "interpret"}, rank, world)
        finally:
            os.environ["TRITON_INTERPRET"] = saved if saved is not None else "1"
    q, k, v, g, gl = make_inputs(case)
    bal = case.get("balance", "contiguous")
    loc = lambda x: shard(x, rank, world, bal).clone()  # noqa: E731
    ql, kl, vl = (loc(x).requires_grad_() for x in (q, k, v))
    kw = dict(causal=case["causal"], comm=case.get("comm", "p2p"), balance=bal, return_lse=True)
    if case["kind"] == "dilated":
        kw.update(segment_lengths=case["ws"], dilation_rates=case["rs"], mode=case.get("mode", "longnet"),
                  offsets=case.get("offsets", "modulo"))
    elif case["kind"] in ("layout", "window"):
        kw.update(layout=case_layout(case))
    if case.get("cu") is not None:   # packed documents: one layout per document
        cu = case["cu"]
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
        if case["kind"] == "layout":
            kw["layout"] = [case_layout(case, e - s) if e > s else None for s, e in zip(cu[:-1], cu[1:])]
        elif case["kind"] == "window":   # a builder, called with each document's length
            kw["layout"] = lambda n: case_layout(case, n)
    sinks = case_sinks(case)
    if sinks is not None:   # the same logits on every rank (a replicated parameter)
        sinks.requires_grad_()
        kw.update(sinks=sinks)
    if case.get("softcap") is not None:
        kw.update(softcap=case["softcap"])
    if case.get("fn") == "ulysses":
        del kw["comm"]
        out, lse = ulysses_attention(ql, kl, vl, backend=case.get("backend", "auto"), **kw)
    elif case.get("fn") == "usp":   # 2-D: shard rank = r * U + u of the grid, as the groups number them
        ulysses, ring = grid_groups(world, case["U"], rank)
        out, lse = ulysses_attention(ql, kl, vl, group=ulysses, ring_group=ring, **kw)
    else:
        out, lse = ring_attention(ql, kl, vl, **kw)
    gll = shard(gl.transpose(1, 2), rank, world, bal).transpose(1, 2)
    loss = loss_of(out, lse, loc(g), gll, case)
    grads = torch.autograd.grad(loss, (ql, kl, vl) + (() if sinks is None else (sinks,)))
    total = loss.detach().clone()
    dist.all_reduce(total)
    res = {name: x.detach().numpy() for name, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads))}
    res["loss"] = total.item()
    if sinks is not None:   # this rank's part of the sinks' gradient
        res["dsinks"] = grads[3].detach().numpy()
    res["max_kv_bytes_held"] = ring_mod.last_stats.get("max_kv_bytes_held", -1)
    return res


def worker(rank, world, init_file, cases, queue, fail_rank=None, timeout_s=60):
    try:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        results = []
        for case in cases:
            if fail_rank == rank:
                raise RuntimeError(f"rank {rank} fails on purpose")
            results.append(run_case(case, rank, world))
        queue.put((rank, "ok", results))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))


def spawn_world(target, world, args_of, join_s, missing_ok=False):
    """Run target(rank, world, init_file, *args_of(queue)) in `world` spawned processes that
    put (rank, status, payload) on the queue; {rank: (status, payload)}. With missing_ok, a
    rank that died or hangs is missing from the result (else queue.Empty is raised); every
    process is joined or killed by join_s."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "rendezvous")
    procs = [ctx.Process(target=target, args=(r, world, init_file, *args_of(queue))) for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + join_s
    try:
        for _ in procs:
            rank, status, payload = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            results[rank] = (status, payload)
    except Exception:   # queue.Empty: some rank died or hangs
        if not missing_ok:
            raise
    finally:
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
    return results


def empty_batch_worker(rank, world, init_file, queue, interpret):
    """ring_attention on B = 0 shards (dense, dilated, block-sparse; p2p and all-gather) with
    the step kernel (interpret "1") or the portable step ("0"): the shapes of out, lse and
    the gradients, or the traceback."""
    try:
        os.environ["TRITON_INTERPRET"] = interpret
        from triton_dilated import layouts, ring_attention
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        shapes = []
        for kw in (dict(), dict(comm="allgather"), dict(segment_lengths=[8, 32], dilation_rates=[1, 2]),
                   dict(layout=layouts.local(16 * world, 16, 1, causal=True))):
            q, k, v = (torch.zeros(0, 16, 2, 8, requires_grad=True) for _ in range(3))
            out, lse = ring_attention(q, k, v, causal=True, return_lse=True, **kw)
            grads = torch.autograd.grad((out.sum() + lse.sum()), (q, k, v), allow_unused=True)
            shapes.append((tuple(out.shape), tuple(lse.shape), [None if g is None else tuple(g.shape) for g in grads]))
        queue.put((rank, "ok", shapes))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))


def errors_of(calls):
    """Each call's ValueError or TypeError as "Type: message", or None where it ran."""
    errors = []
    for call in calls:
        try:
            call()
            errors.append(None)
        except (ValueError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def ulysses_errors_worker(rank, world, init_file, queue, U=None):
    """ulysses_attention with arguments that differ across ranks or that no world size can
    split: the error each rank raised (type and message), in order. With U: on a grid of
    U x (world // U) ranks (2-D), arguments that differ on the last rank only."""
    try:
        from triton_dilated import ulysses_attention
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        x, kv = torch.zeros(1, 8, 4, 8), torch.zeros(1, 8, 2, 8)
        if U is not None:
            ulysses, ring = grid_groups(world, U, rank)
            last = rank == world - 1
            grid = dict(group=ulysses, ring_group=ring)
            calls = [lambda: ulysses_attention(x, kv, kv, causal=last, **grid),
                     lambda: ulysses_attention(x, kv, kv, comm="allgather" if last else "p2p", **grid),
                     lambda: ulysses_attention(x, kv, kv, scale=float("nan") if last else None, **grid),
                     lambda: ulysses_attention(x, kv, kv, **grid)]                          # all agree: runs
        else:
            calls = [lambda: ulysses_attention(x, kv, kv, causal=rank == 1),                 # flags differ
                     lambda: ulysses_attention(x, kv, kv, segment_lengths=[4, 8 + 4 * rank], dilation_rates=[1, 2]),
                     lambda: ulysses_attention(x[:, :, :3], kv[:, :, :1], kv[:, :, :1]),      # 3 heads, 2 ranks
                     lambda: ulysses_attention(x, kv, kv, scale=float("nan") if rank == 0 else None),  # invalid
                     lambda: ulysses_attention(torch.zeros(1, 8, 6, 8), torch.zeros(1, 8, 3, 8),
                                               torch.zeros(1, 8, 3, 8))]                     # kv heads vs world
        queue.put((rank, "ok", errors_of(calls)))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))


def documents_errors_worker(rank, world, init_file, queue):
    """ring_attention / ulysses_attention with packed documents whose arguments differ across
    ranks or are invalid on one: the error each rank raised (type and message), in order."""
    try:
        from triton_dilated import document_balance, ring_attention, ulysses_attention
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        x = torch.zeros(1, 8, 2, 8)
        other = document_balance([0, 3, 16], world)
        calls = [lambda: ring_attention(x, x, x, cu_seqlens=[0, 5 + rank, 16]),              # cu_seqlens differ
                 lambda: ring_attention(x, x, x, cu_seqlens=[0, 5, 17] if rank == 1 else [0, 5, 16]),  # invalid
                 lambda: ring_attention(x, x, x, cu_seqlens=[0, 5, 16], balance=other),       # planned elsewhere
                 lambda: ring_attention(x, x, x, balance=other),                              # a plan, no documents
                 lambda: ulysses_attention(x, x, x, cu_seqlens=[0, 4 + rank, 16]),            # cu_seqlens differ
                 lambda: ulysses_attention(x, x, x, cu_seqlens=[0, 5, 16], balance=other),    # ring's balance only
                 lambda: ring_attention(x, x, x, cu_seqlens=[0, 5, 16])]                      # all agree: runs
        queue.put((rank, "ok", errors_of(calls)))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))
