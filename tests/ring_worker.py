"""Multi-process harness for the ring tests: spawn `world` gloo processes, run many cases
in one process group, send the measured errors back. Imported by the spawned children."""
from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist


def make_inputs(case, device="cpu"):
    g = torch.Generator().manual_seed(case.get("seed", 0))
    B, N, Hq, Hkv, D = case["B"], case["N"], case["Hq"], case["Hkv"], case["D"]
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).float().to(device)  # noqa: E731
    return mk(B, N, Hq, D), mk(B, N, Hkv, D), mk(B, N, Hkv, D), mk(B, N, Hq, D), mk(B, Hq, N)


def reference(case):
    """Full-sequence float64 oracle: out, lse and the gradients of the test loss."""
    from triton_dilated import block_sparse_attention_naive, dilated_attention_naive, layouts
    q, k, v, g, gl = (x.double().requires_grad_(i < 3) for i, x in enumerate(make_inputs(case)))
    kind = case["kind"]
    if kind == "dilated":
        out, lse = dilated_attention_naive(q, k, v, case["ws"], case["rs"], causal=case["causal"],
                                           mode=case.get("mode", "longnet"), offsets=case.get("offsets", "modulo"))
    else:
        if kind == "layout":
            layout = layouts.bigbird(case["N"], case["bs"], 1, 1, 1, seed=1, num_heads=case["Hq"])
        else:   # dense: every block active
            from triton_dilated import BlockLayout
            nb = -(-case["N"] // 16)
            layout = BlockLayout.from_dense(torch.ones(nb, nb, dtype=torch.bool), 16)
        out, lse = block_sparse_attention_naive(q, k, v, layout, causal=case["causal"])
    fin = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    loss = (out * g).sum() + (fin * gl).sum() * case.get("lse_weight", 1.0)
    grads = torch.autograd.grad(loss, (q, k, v))
    return out.detach(), lse.detach(), [x.detach() for x in grads], loss.item()


def run_case(case, rank, world):
    from triton_dilated import layouts, ring_attention, shard
    from triton_dilated.ops.ring import interface as ring_mod
    q, k, v, g, gl = make_inputs(case)
    bal = case.get("balance", "contiguous")
    loc = lambda x: shard(x, rank, world, bal).clone()  # noqa: E731
    ql, kl, vl = (loc(x).requires_grad_() for x in (q, k, v))
    kw = dict(causal=case["causal"], comm=case.get("comm", "p2p"), balance=bal, return_lse=True)
    if case["kind"] == "dilated":
        kw.update(segment_lengths=case["ws"], dilation_rates=case["rs"], mode=case.get("mode", "longnet"),
                  offsets=case.get("offsets", "modulo"))
    elif case["kind"] == "layout":
        kw.update(layout=layouts.bigbird(case["N"], case["bs"], 1, 1, 1, seed=1, num_heads=case["Hq"]))
    out, lse = ring_attention(ql, kl, vl, **kw)
    gll = shard(gl.transpose(1, 2), rank, world, bal).transpose(1, 2)
    fin = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    loss = (out * loc(g)).sum() + (fin * gll).sum() * case.get("lse_weight", 1.0)
    grads = torch.autograd.grad(loss, (ql, kl, vl))
    total = loss.detach().clone()
    dist.all_reduce(total)
    ref_out, ref_lse, ref_grads, ref_loss = reference(case)
    ref_lse_local = shard(ref_lse.transpose(1, 2), rank, world, bal).transpose(1, 2)
    finite = lambda x: torch.where(torch.isinf(x), torch.zeros_like(x), x).double()  # noqa: E731
    errs = {"out": (out.double() - loc(ref_out)).abs().max().item(),
            "lse": (finite(lse) - finite(ref_lse_local)).abs().max().item(),
            "lse_inf_match": bool(torch.equal(torch.isinf(lse), torch.isinf(ref_lse_local))),
            "loss": abs(total.item() - ref_loss),
            "nan": any(torch.isnan(x).any().item() for x in (out, *grads))}
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads):
        errs[name] = (a.double() - loc(b)).abs().max().item()
    errs["max_kv_bytes_held"] = ring_mod.last_stats.get("max_kv_bytes_held", -1)
    return errs


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
