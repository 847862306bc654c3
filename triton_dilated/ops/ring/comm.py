"""Ring communication over torch.distributed (gloo on CPUs, NCCL on GPUs).

`RingComm.shift(tensors, recv_shapes)` posts, with batch_isend_irecv, the sends of
`tensors` to the next rank and the receives of the previous rank's tensors (whose shapes
the caller knows), and returns a `Transfer`: the caller computes on the current shard while
the next one is in flight (double buffering), then `transfer.wait()` hands over the
received tensors. RingComm also keeps the peak of key/value bytes a schedule reports as
held (`note_held`), which the tests use to check the O(N/P) memory bound.

`RingComm.agree(signature)` checks, with one small all-gather before any transfer, that
every rank called with the same shapes, dtype, flags, patterns and layout: ranks that
disagree would otherwise exchange buffers of different sizes (gloo aborts the process, or
a rank computes on receive buffers never written) or silently compute different functions.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

COMMS = ("p2p", "allgather")


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _by_value(name, signatures) -> str:
    """'ranks 0, 2: x, rank 1: y': the ranks grouped by their value of one entry."""
    groups: dict[str, list[int]] = {}
    for rank, sig in enumerate(signatures):
        groups.setdefault(repr(sig[name]), []).append(rank)
    return ", ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {value}"
                     for value, rs in groups.items())


class Transfer:
    """Tensors in flight from the previous rank: `wait()` returns them once they arrived."""

    def __init__(self, tensors, requests):
        self.tensors, self._requests = list(tensors), list(requests)

    @property
    def nbytes(self) -> int:
        return nbytes(self.tensors)

    def wait(self):
        for req in self._requests:
            req.wait()
        self._requests = []
        return self.tensors


def _mesh_group(group, who: str):
    """A 1-D DeviceMesh stands for its process group (group= and ring_group= take either)."""
    from torch.distributed.device_mesh import DeviceMesh
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"{who}: a DeviceMesh given as a group must have one dimension, got "
                             f"{group.ndim} ({group.mesh_dim_names}): pass mesh[name], or a 2-D mesh to "
                             f"sequence_parallel_attention(..., mesh=)")
        return group.get_group()
    return group


class RingComm:
    def __init__(self, group=None, who: str = "ring_attention"):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{who} needs an initialised torch.distributed process group: call "
                               "torch.distributed.init_process_group(...) first (or pass group=)")
        group = _mesh_group(group, who)
        self.group, self.who = group, who
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # batch_isend_irecv takes global ranks
        to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        self.next = to_global((self.rank + 1) % self.world)
        self.prev = to_global((self.rank - 1) % self.world)
        self.max_bytes_held = 0

    def _collective_device(self, device) -> torch.device:
        """Where a small tensor for a collective must live: CUDA for NCCL (the inputs' GPU,
        else the current one), the CPU otherwise."""
        backend = str(dist.get_backend(self.group))
        if "nccl" in backend and "gloo" not in backend:
            return device if device is not None and device.type == "cuda" else \
                torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def agree(self, signature, error=None, device=None) -> None:
        """Raise the same ValueError on every rank unless all ranks pass an equal
        `signature` (a dict name -> value with a stable repr) and none had an `error` (an
        exception from checking its own arguments, re-raised on that rank; the others
        name it). One all-gather of one int64 per entry (on `device` under NCCL); a
        second, of the readable values, only when they differ."""
        exc = self.disagreement(signature, error, device)
        if exc is not None:
            raise exc

    def disagreement(self, signature, error=None, device=None):
        """agree's verdict without raising: None, or the exception every rank raises (a
        caller checking over two groups combines the verdicts before raising)."""
        if self.world == 1:
            return error
        names = list(signature)
        digest = [int.from_bytes(hashlib.blake2b(repr(signature[n]).encode(), digest_size=8).digest(), "little",
                                 signed=True) for n in names]
        mine = torch.tensor([0 if error is None else 1] + ([0] * len(names) if error is not None else digest),
                            dtype=torch.int64, device=self._collective_device(device))
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine, group=self.group)
        table = torch.stack(rows).cpu()
        if not table[:, 0].any() and bool((table == table[0]).all()):
            return None
        values = [None] * self.world
        dist.all_gather_object(values, (None if error is None else f"{type(error).__name__}: {error}", signature),
                               group=self.group)
        failed = [(r, e) for r, (e, _) in enumerate(values) if e is not None]
        if failed:
            if error is not None:
                return error
            return ValueError(f"{self.who}: " + "; ".join(f"rank {r} rejected its arguments ({e})" for r, e in failed)
                              + "; every rank stops here")
        differ = [n for n in names if len({repr(v[n]) for _, v in values}) > 1]
        return ValueError(f"{self.who}: the ranks of the group disagree on " + ", ".join(differ)
                          + " (every rank must pass the same shapes, dtype, device type, flags, patterns and layout): "
                          + "; ".join(f"{n}: {_by_value(n, [v for _, v in values])}" for n in differ))

    def note_held(self, nbytes_now: int) -> None:
        """Record how many key/value bytes the schedule holds at this point."""
        self.max_bytes_held = max(self.max_bytes_held, nbytes_now)

    def shift(self, tensors, recv_shapes) -> Transfer:
        """Send `tensors` to the next rank and receive tensors of `recv_shapes` (same dtypes)
        from the previous one. With one rank the ring is the identity (gloo cannot send to
        itself)."""
        if self.world == 1:
            return Transfer(tensors, [])
        received = [torch.empty(shape, dtype=t.dtype, device=t.device) for t, shape in zip(tensors, recv_shapes)]
        ops = []
        for t, r in zip(tensors, received):
            ops.append(dist.P2POp(dist.isend, t.contiguous(), self.next, self.group))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group))
        return Transfer(received, dist.batch_isend_irecv(ops))

    def all_to_all(self, x):
        """x (world, ...): x[j] goes to rank j; returns y (world, ...) with y[i] = rank i's
        x[this rank]. One all_to_all_single (gloo and NCCL both have it); the identity
        for one rank."""
        if self.world == 1:
            return x
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=self.group)
        return out

    def all_gather_seq(self, x, sizes):
        """Every rank's x (dim 1 of length sizes[rank]) in rank order. Padded to the
        largest size for the collective (gloo wants equal shapes), trimmed after."""
        top = max(sizes)
        padded = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, top - x.shape[1])) if x.shape[1] < top else x
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        return [p[:, :s] for p, s in zip(parts, sizes)]

    def reduce_to_owners(self, parts):
        """parts[i]: this rank's contribution to rank i's tensor; returns the sum over ranks
        of what belongs to this rank (reduce-scatter; gloo lacks it: all_reduce + slice)."""
        flat = torch.cat([p.reshape(-1) for p in parts])
        if dist.get_backend(self.group) == "nccl" and all(p.numel() == parts[0].numel() for p in parts):
            out = torch.empty_like(parts[self.rank].reshape(-1))
            dist.reduce_scatter_tensor(out, flat, group=self.group)
            return out.view_as(parts[self.rank])
        dist.all_reduce(flat, group=self.group)
        start = sum(p.numel() for p in parts[:self.rank])
        return flat[start:start + parts[self.rank].numel()].view_as(parts[self.rank])
