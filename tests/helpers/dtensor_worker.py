"""Workers for tests/ops/ring/test_dtensor.py (imported by the spawned gloo processes):
sequence_parallel_attention on DTensors over 1-D and 2-D DeviceMeshes, and its argument
errors."""
from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist

from tests.helpers.ring_worker import case_layout, errors_of, loss_of, make_inputs

_MESHES: dict = {}


def mesh_of(shape, names):
    """One DeviceMesh per (shape, names), created in the same order on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    key = (tuple(shape), names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
    return _MESHES[key]


def placements_of(spec):
    from torch.distributed.tensor import Replicate, Shard
    return [{"seq": Shard(1), "batch": Shard(0), "rep": Replicate(), "heads": Shard(2)}[p] for p in spec]


def seq_order(case, shards):
    """The DTensor's global sequence order: the zigzag shards' rows concatenated in rank
    order (balance="zigzag"), else the sequence itself."""
    from triton_dilated.ops.ring.shard import shard_positions
    N, bal = case["N"], case.get("balance", "contiguous")
    return torch.cat([shard_positions(N, r, shards, bal) for r in range(shards)]).long()


def run_case(case):
    """Full (global-order) out, lse and the gradients of q, k, v, as rank-0 numpy arrays,
    and the placements that came back."""
    from torch.distributed.tensor import distribute_tensor

    from triton_dilated import sequence_parallel_attention
    mesh = mesh_of(case["mesh"], case.get("names"))
    pl = placements_of(case["placements"])
    q, k, v, g, gl = make_inputs(case)
    order = seq_order(case, case["shards"])
    dist_ = lambda x, p=pl: distribute_tensor(x[:, order].contiguous(), mesh, p)  # noqa: E731
    qd, kd, vd = (dist_(x).requires_grad_() for x in (q, k, v))
    kw = dict(causal=case["causal"], balance=case.get("balance", "contiguous"), return_lse=True)
    if case["kind"] == "dilated":
        kw.update(segment_lengths=case["ws"], dilation_rates=case["rs"], mode=case.get("mode", "longnet"),
                  offsets=case.get("offsets", "modulo"))
    elif case["kind"] == "layout":
        kw.update(layout=case_layout(case))
    kw.update(case.get("kw", {}))
    if case.get("local"):   # plain local shards with mesh=: same function, local results
        out_l, lse_l = sequence_parallel_attention(qd.to_local(), kd.to_local(), vd.to_local(), mesh=mesh, **kw)
        from torch.distributed.tensor import DTensor, Shard
        out = DTensor.from_local(out_l, mesh, qd.placements, run_check=False)
        lse = DTensor.from_local(lse_l, mesh, [Shard(2) if p == Shard(1) else p for p in pl], run_check=False)
    else:
        out, lse = sequence_parallel_attention(qd, kd, vd, scheme=case.get("scheme"), **kw)
    gd = dist_(g)
    gld = dist_(gl.transpose(1, 2)).to_local().transpose(1, 2)
    loss = loss_of(out.to_local(), lse.to_local(), gd.to_local(), gld, case)
    grads = torch.autograd.grad(loss, (qd, kd, vd))
    res = {name: x.full_tensor().detach().numpy()
           for name, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads))}
    res["placements"] = (repr(tuple(out.placements)), repr(tuple(lse.placements)),
                         repr(tuple(grads[0].placements)))
    return res


def _same(a, b):
    if not torch.equal(a, b):
        raise ValueError("a DeviceMesh as group gave another result than its process group")


def errors(world):
    """The error each bad call raises (type and message), in order."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from triton_dilated import ring_attention, sequence_parallel_attention, ulysses_attention
    if world == 2:
        mesh, cp = mesh_of((2,), ("ring",)), mesh_of((2,), ("cp",))
    else:
        mesh, cp = mesh_of((2, 2), ("ring", "ulysses")), mesh_of((2, 2), ("ulysses", "ring"))
    seq = [Shard(1)] * mesh.ndim
    x = torch.randn(1, 8, 4, 8)
    d = lambda t, p=seq, m=mesh: distribute_tensor(t, m, p)  # noqa: E731
    q = d(x)
    calls = [
        lambda: sequence_parallel_attention(d(x, [Replicate()] * mesh.ndim), q, q),       # 0 Replicate
        lambda: sequence_parallel_attention(d(x, [Shard(2)] * mesh.ndim), q, q),          # 1 heads sharded
        lambda: sequence_parallel_attention(d(torch.randn(1, 7, 4, 8)), d(torch.randn(1, 7, 4, 8)),
                                            d(torch.randn(1, 7, 4, 8))),                 # 2 uneven shards
        lambda: sequence_parallel_attention(q, d(x, [Replicate()] * mesh.ndim), q),       # 3 k placement
        lambda: sequence_parallel_attention(q, x, q),                                     # 4 k plain
        lambda: sequence_parallel_attention(q, q, q, group=None),                         # 5 group=
        lambda: ring_attention(q, q, q),                                                  # 6 DTensor to ring
        lambda: sequence_parallel_attention(x, x, x),                                     # 7 neither
    ]
    if world == 2:
        calls += [
            lambda: sequence_parallel_attention(d(x, m=cp), d(x, m=cp), d(x, m=cp)),      # 8 unnamed: scheme?
            lambda: sequence_parallel_attention(q, q, q, scheme="usp"),                   # 9 one dim, usp
            lambda: sequence_parallel_attention(q, q, q, scheme="star"),                  # 10 bad scheme
            lambda: _same(ring_attention(x, x, x, group=mesh, causal=True),               # 11 a 1-D mesh as group
                          ring_attention(x, x, x, group=mesh.get_group(), causal=True)),
            lambda: _same(ulysses_attention(x, x, x, group=mesh), ulysses_attention(x, x, x, group=mesh.get_group())),
        ]
    else:
        calls += [
            lambda: sequence_parallel_attention(d(x, m=cp), d(x, m=cp), d(x, m=cp)),      # 8 ulysses first
            lambda: ring_attention(x, x, x, group=mesh),                                  # 9 2-D mesh as group
            lambda: sequence_parallel_attention(x, x, x, mesh=mesh, scheme="ring"),       # 10 two dims, ring
        ]
    return errors_of(calls)


def worker(rank, world, init_file, cases, queue):
    try:
        # the portable ring step (the plumbing is under test here; test_ring and test_ulysses
        # run the step kernels under the interpreter)
        os.environ["TRITON_INTERPRET"] = "0"
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        results = [run_case(case) for case in cases]
        results.append(errors(world))
        queue.put((rank, "ok", results))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))
