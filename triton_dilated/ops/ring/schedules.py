"""The two ring schedules, forward and backward, as plain functions over a `RingPlan`.

p2p: key/value shards travel around the ring with batch_isend_irecv; the next transfer is
posted before the current step computes (double buffer), so a rank holds its own shard,
the one in use and the one in flight: O(N/P). Backward: the shards travel again, each with
its dK/dV accumulators, which end at their owners.
allgather: every shard gathered at once (O(N)); backward reduce-scatters dK/dV.

Every step folds one shard into the running float32 (out, lse) with `step.forward` (the
Triton step kernel or the portable step); `plan.may_count(src)` skips steps whose pairs
all have weight 0 (causal shards from the future, empty layout blocks, shards that share
no document with the local queries). With packed documents the steps see the documents'
mask positions and ids (documents.py) in place of the global positions.
"""
from __future__ import annotations

import torch

from .comm import RingComm, nbytes
from .mask import MASK_LAYOUT, StepMask
from .shard import shard_positions


class RingPlan:
    """Per call: this rank's positions, what each rank sends (rows), and the step mask."""

    def __init__(self, comm: RingComm, n_total, balance, mask: StepMask, device, send_rows=None, docs=None):
        self.comm, self.mask = comm, mask
        self.world, self.rank = comm.world, comm.rank
        self.positions = [shard_positions(n_total, r, self.world, balance, device=device) for r in range(self.world)]
        self.docs, self._may = docs, {}
        # what the steps see of a position: itself, or its document's mask position (docs)
        seen = (lambda p: p) if docs is None else docs.mask_positions
        # rows of each rank's shard that travel (None: all)
        self.rows = [None if send_rows is None else send_rows(seen(p)) for p in self.positions]
        self.sent_pos = [p if rows is None else p[rows] for p, rows in zip(self.positions, self.rows)]
        if docs is not None:
            self.q_doc = docs.doc_ids(self.positions[self.rank])
            self.sent_doc = [docs.doc_ids(p) for p in self.sent_pos]
            self._q_seen = seen(self.positions[self.rank])
            self.sent_pos = [seen(p) for p in self.sent_pos]

    @property
    def q_pos(self):
        return self.positions[self.rank] if self.docs is None else self._q_seen

    def step_docs(self, src):
        """The step's document keywords for src's shard: ids to compare (none where the mask
        positions already keep the documents apart, or without documents)."""
        if self.docs is None or not self.docs.compare_ids:
            return {}
        return dict(q_doc=self.q_doc, k_doc=self.sent_doc[src])

    def payload(self, x):
        """The rows of this rank's shard that travel."""
        rows = self.rows[self.rank]
        return x if rows is None else x.index_select(1, rows)

    def shard_shape(self, x, src):
        """Shape of rank src's travelling rows of a tensor shaped like x."""
        return (x.shape[0], self.sent_pos[src].numel(), *x.shape[2:])

    def may_count(self, src):
        """False when no pair of (my queries, src's keys) can count: the step is skipped."""
        if src not in self._may:
            self._may[src] = self._may_count(src)
        return self._may[src]

    def _may_count(self, src):
        q_pos, k_pos = self.q_pos, self.sent_pos[src]
        if k_pos.numel() == 0:
            return False
        if self.docs is not None:
            if not self._documents_meet(src):
                return False
        elif self.mask.causal and int(k_pos.min()) > int(q_pos.max()):
            return False
        if self.mask.kind == MASK_LAYOUT:
            bs = self.mask.layout_block
            qb = torch.unique(q_pos.long() // bs)
            kb = torch.unique(k_pos.long() // bs)
            return bool(self.mask.layout[:, :, qb][:, :, :, kb].any())
        return True

    def _documents_meet(self, src):
        """Whether some document holds one of my queries and one of src's keys (with causal:
        a key at or before the query, in that document's mask positions)."""
        n = self.docs.count
        q_doc, k_doc = self.q_doc.long(), self.sent_doc[src].long()
        q_pos, k_pos = self.q_pos.long(), self.sent_pos[src].long()
        last_q = torch.full((n,), -1, dtype=torch.long, device=q_pos.device).scatter_reduce_(
            0, q_doc, q_pos, "amax")
        first_k = torch.full((n,), 2 ** 62, dtype=torch.long, device=k_pos.device).scatter_reduce_(
            0, k_doc, k_pos, "amin")
        meet = (last_q >= 0) & (first_k < 2 ** 62)
        if self.mask.causal:
            meet &= first_k <= last_q
        return bool(meet.any())

    def scatter_rows(self, x_rows, like):
        """Travelled rows back into a full (float32) shard shaped like `like`."""
        rows = self.rows[self.rank]
        if rows is None:
            return x_rows
        return torch.zeros(like.shape, dtype=torch.float32, device=like.device).index_copy_(1, rows, x_rows)


def p2p_forward(plan: RingPlan, step, q, k, v, out, lse, call):
    comm = plan.comm
    kv = [plan.payload(k), plan.payload(v)]
    own = nbytes([k, v])
    comm.note_held(own)
    for i in range(plan.world):
        src = (plan.rank - i) % plan.world
        incoming = None
        if i < plan.world - 1:   # post the next transfer before computing this one
            nxt = (src - 1) % plan.world
            incoming = comm.shift(kv, [plan.shard_shape(x, nxt) for x in kv])
        comm.note_held(own + (nbytes(kv) if i else 0) + (incoming.nbytes if incoming else 0))
        if plan.may_count(src):
            step.forward(q, kv[0], kv[1], plan.q_pos, plan.sent_pos[src], out, lse, plan.mask, call,
                         **plan.step_docs(src))
        if incoming is not None:
            kv = incoming.wait()


def allgather_forward(plan: RingPlan, step, q, k, v, out, lse, call):
    comm = plan.comm
    sizes = [p.numel() for p in plan.sent_pos]
    ks, vs = comm.all_gather_seq(plan.payload(k), sizes), comm.all_gather_seq(plan.payload(v), sizes)
    comm.note_held(nbytes([k, v]) + nbytes(ks + vs))
    for src in range(plan.world):
        if plan.may_count(src):
            step.forward(q, ks[src], vs[src], plan.q_pos, plan.sent_pos[src], out, lse, plan.mask, call,
                         **plan.step_docs(src))


def p2p_backward(plan: RingPlan, step, q, k, v, dout, lse, delta, dq, call):
    """Returns the travelled rows of dK, dV (float32) that belong to this rank. Each step
    computes into fresh dK/dV blocks while the accumulators of the previous step are still in
    flight; it then waits for the accumulator of the shard it holds, adds its block and
    posts it onward (after the last step it reaches the owner)."""
    comm = plan.comm
    kv = [plan.payload(k), plan.payload(v)]

    def zeros(src):
        return [torch.zeros(plan.shard_shape(k, src), dtype=torch.float32, device=q.device) for _ in range(2)]

    acc_in = None   # the accumulators of the shard now held, in flight
    for i in range(plan.world):
        src = (plan.rank - i) % plan.world
        incoming = None
        if i < plan.world - 1:
            nxt = (src - 1) % plan.world
            incoming = comm.shift(kv, [plan.shard_shape(k, nxt)] * 2)
        block = None
        if plan.may_count(src):
            block = zeros(src)
            step.backward(q, kv[0], kv[1], dout, lse, delta, plan.q_pos, plan.sent_pos[src], dq, block[0], block[1],
                          plan.mask, call, **plan.step_docs(src))
        if acc_in is None:   # step 0: this rank's own shard starts its accumulators here
            acc = block or zeros(src)
        else:
            acc = acc_in.wait()
            if block is not None:
                acc[0] += block[0]
                acc[1] += block[1]
        acc_in = comm.shift(acc, [plan.shard_shape(k, (src - 1) % plan.world)] * 2)
        if incoming is not None:
            kv = incoming.wait()
    return acc_in.wait()


def allgather_backward(plan: RingPlan, step, q, k, v, dout, lse, delta, dq, call):
    comm = plan.comm
    sizes = [p.numel() for p in plan.sent_pos]
    ks, vs = comm.all_gather_seq(plan.payload(k), sizes), comm.all_gather_seq(plan.payload(v), sizes)
    dks = [torch.zeros(plan.shard_shape(k, src), dtype=torch.float32, device=q.device) for src in range(plan.world)]
    dvs = [torch.zeros_like(x) for x in dks]
    for src in range(plan.world):
        if plan.may_count(src):
            step.backward(q, ks[src], vs[src], dout, lse, delta, plan.q_pos, plan.sent_pos[src], dq, dks[src],
                          dvs[src], plan.mask, call, **plan.step_docs(src))
    return comm.reduce_to_owners(dks), comm.reduce_to_owners(dvs)


SCHEDULES = {"p2p": (p2p_forward, p2p_backward), "allgather": (allgather_forward, allgather_backward)}
