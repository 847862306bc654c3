"""ring_attention: one sequence sharded over the ranks of a torch.distributed group.

Each rank keeps its queries; key/value shards travel around the ring (comm="p2p",
batch_isend_irecv, the next transfer posted before the current step computes, at most
two remote shards held: O(N/P) memory) or are all-gathered (comm="allgather", O(N)).
Every step folds the received shard into the running float32 (out, lse) with the
ring-local-block kernel, masks evaluated on global positions. Backward: the key/value
shards travel again, with their dK/dV accumulators, which end at their owners.

Dilated attention (LongNet §3.1): a pattern whose segments lie inside one shard piece
needs no communication: it runs on the local shard with the fused dilated kernel and is
merged by lse with the ring part. For the other patterns only the rows some head uses
(its residue rows) travel.
"""
from __future__ import annotations

import torch

from ..common.lse import merge_partials, softmax_delta
from ..common.runtime import last_dim_contiguous, resolve_backend
from ..common.validation import check_choice, check_flags, check_qkv, check_scale
from ..block_sparse.layout import BlockLayout
from ..dilated.parallel import dilated_attention_table
from ..dilated.patterns import check_patterns, head_offsets
from .comm import RingComm
from .shard import BALANCES, shard_positions
from .step import MASK_DENSE, MASK_DILATED, MASK_LAYOUT, StepMask, step_backward, step_forward
from . import step_torch

COMMS = ("p2p", "allgather")

# Measured by the last forward on this process: the most key/value bytes held at once
# (own shard, the shard in use and the one in flight). Tests guard the O(N/P) bound.
last_stats: dict = {}


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


class _Plan:
    """Per call: this rank's positions, what each rank sends (rows), and the step mask."""

    def __init__(self, comm, n_total, balance, mask: StepMask, device, send_rows=None):
        self.comm, self.mask = comm, mask
        self.world, self.rank = comm.world, comm.rank
        self.positions = [shard_positions(n_total, r, self.world, balance, device=device) for r in range(self.world)]
        # rows of each rank's shard that travel (None: all)
        self.rows = [None if send_rows is None else send_rows(p) for p in self.positions]
        self.sent_pos = [p if rows is None else p[rows] for p, rows in zip(self.positions, self.rows)]

    def payload(self, x):
        rows = self.rows[self.rank]
        return x if rows is None else x.index_select(1, rows)

    def may_count(self, src):
        """False when no pair of (my queries, src's keys) can count: the step is skipped."""
        q_pos, k_pos = self.positions[self.rank], self.sent_pos[src]
        if k_pos.numel() == 0:
            return False
        if self.mask.causal and int(k_pos.min()) > int(q_pos.max()):
            return False
        if self.mask.kind == MASK_LAYOUT:
            bs = self.mask.layout_block
            qb = torch.unique(q_pos.long() // bs)
            kb = torch.unique(k_pos.long() // bs)
            return bool(self.mask.layout[:, :, qb][:, :, :, kb].any())
        return True


def _step_fns(use_triton):
    return (step_forward, step_backward) if use_triton else (step_torch.step_forward, step_torch.step_backward)


class _RingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, scale, use_p2p, use_triton):
        fwd, _ = _step_fns(use_triton)
        B, NQ, Hq, D = q.shape
        out = torch.zeros(B, NQ, Hq, D, dtype=torch.float32, device=q.device)
        lse = torch.full((B, Hq, NQ), float("-inf"), dtype=torch.float32, device=q.device)
        q_pos = plan.positions[plan.rank]
        kv = [plan.payload(k), plan.payload(v)]
        own = _nbytes([k, v])
        held = own
        if use_p2p:
            for step in range(plan.world):
                src = (plan.rank - step) % plan.world
                pending = None
                if step < plan.world - 1:   # post the next transfer before computing this one
                    nxt = (src - 1) % plan.world
                    shape = lambda x: (x.shape[0], plan.sent_pos[nxt].numel(), *x.shape[2:])  # noqa: E731
                    pending = plan.comm.shift(kv, [shape(x) for x in kv])
                held = max(held, own + (_nbytes(kv) if step else 0) + (_nbytes(pending[0]) if pending else 0))
                if plan.may_count(src):
                    fwd(q, kv[0], kv[1], q_pos, plan.sent_pos[src], out, lse, plan.mask, scale=scale)
                if pending is not None:
                    plan.comm.wait(pending[1])
                    kv = pending[0]
        else:
            sizes = [p.numel() for p in plan.sent_pos]
            ks, vs = plan.comm.all_gather_seq(kv[0], sizes), plan.comm.all_gather_seq(kv[1], sizes)
            held = own + _nbytes(ks + vs)
            for src in range(plan.world):
                if plan.may_count(src):
                    fwd(q, ks[src], vs[src], q_pos, plan.sent_pos[src], out, lse, plan.mask, scale=scale)
        last_stats["max_kv_bytes_held"] = held
        out_cast = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out_cast, lse)
        ctx.args = (plan, scale, use_p2p, use_triton)
        return out_cast, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale, use_p2p, use_triton = ctx.args
        _, bwd = _step_fns(use_triton)
        if dout is None:
            dout = torch.zeros_like(out)
        dout = last_dim_contiguous(dout)
        delta = softmax_delta(dout, out, dlse)
        q_pos = plan.positions[plan.rank]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = [plan.payload(k), plan.payload(v)]
        acc_shape = lambda src: (k.shape[0], plan.sent_pos[src].numel(), *k.shape[2:])  # noqa: E731
        if use_p2p:
            # Each step computes into fresh dK/dV blocks while the accumulators of the previous
            # step are still in flight; it then waits for the accumulator of the shard it holds,
            # adds its block and posts it onward (after the last step it reaches the owner).
            acc_in = None   # (received accumulators, requests) of the shard now held
            for step in range(plan.world):
                src = (plan.rank - step) % plan.world
                pending = None
                if step < plan.world - 1:
                    nxt = (src - 1) % plan.world
                    pending = plan.comm.shift(kv, [acc_shape(nxt)] * 2)
                block = None
                if plan.may_count(src):
                    block = [torch.zeros(acc_shape(src), dtype=torch.float32, device=q.device) for _ in range(2)]
                    bwd(q, kv[0], kv[1], dout, lse, delta, q_pos, plan.sent_pos[src], dq, block[0], block[1],
                        plan.mask, scale=scale)
                if acc_in is None:   # step 0: this rank's own shard starts its accumulators here
                    acc = block or [torch.zeros(acc_shape(src), dtype=torch.float32, device=q.device)
                                    for _ in range(2)]
                else:
                    plan.comm.wait(acc_in[1])
                    acc = acc_in[0]
                    if block is not None:
                        acc[0] += block[0]
                        acc[1] += block[1]
                acc_in = plan.comm.shift(acc, [acc_shape((src - 1) % plan.world)] * 2)
                if pending is not None:
                    plan.comm.wait(pending[1])
                    kv = pending[0]
            plan.comm.wait(acc_in[1])
            dk_rows, dv_rows = acc_in[0]
        else:
            sizes = [p.numel() for p in plan.sent_pos]
            ks, vs = plan.comm.all_gather_seq(kv[0], sizes), plan.comm.all_gather_seq(kv[1], sizes)
            dks = [torch.zeros(acc_shape(src), dtype=torch.float32, device=q.device) for src in range(plan.world)]
            dvs = [torch.zeros_like(x) for x in dks]
            for src in range(plan.world):
                if plan.may_count(src):
                    bwd(q, ks[src], vs[src], dout, lse, delta, q_pos, plan.sent_pos[src], dq, dks[src], dvs[src],
                        plan.mask, scale=scale)
            dk_rows, dv_rows = plan.comm.reduce_to_owners(dks), plan.comm.reduce_to_owners(dvs)
        rows = plan.rows[plan.rank]
        if rows is None:
            dk, dv = dk_rows, dv_rows
        else:
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device).index_copy_(1, rows, dk_rows)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device).index_copy_(1, rows, dv_rows)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _dilated_split(patterns, table, n_total, world, balance):
    """Patterns whose every segment lies inside one contiguous piece of every shard (local,
    no communication) and the others (ring)."""
    piece = n_total // (world * (2 if balance == "zigzag" else 1))
    local = [i for i, (w, _) in enumerate(patterns) if world == 1 or (w <= piece and piece % w == 0)]
    ring = [i for i in range(len(patterns)) if i not in local]
    sub = lambda idx: (tuple(patterns[i] for i in idx), tuple(tuple(row[i] for i in idx) for row in table))  # noqa: E731
    return sub(local), sub(ring)


def _residue_rows(patterns, table):
    """send_rows(positions) -> indices of the rows any head uses in some pattern."""
    def rows(pos):
        p = pos.long()
        use = torch.zeros_like(p, dtype=torch.bool)
        for (w, r), column in zip(patterns, zip(*table)):
            offs = sorted({o for o in column if o >= 0})
            res = (p - p // w * w) % r
            for o in offs:
                use |= res == o
        return use.nonzero().flatten()
    return rows


def ring_attention(q, k, v, *, group=None, segment_lengths=None, dilation_rates=None, layout=None, causal=False,
                   scale=None, mode="longnet", offsets="modulo", comm="p2p", balance="contiguous", return_lse=False):
    """Attention over a sequence sharded across the ranks of `group` (DESIGN §5).

    q, k, v: this rank's shard (B, N_local, H, D), as `shard(x, rank, world, balance)`
    returns it. Dense attention by default; dilated with segment_lengths/dilation_rates
    (mode, offsets as in dilated_attention); block-sparse with a BlockLayout over the full
    sequence. comm: "p2p" (ring, O(N/P) memory) or "allgather". Returns this rank's shard
    of the full-sequence result (and its lse, float32 (B, Hq, N_local)).
    """
    check_qkv(q, k, v)
    check_choice("comm", comm, COMMS)
    check_choice("balance", balance, BALANCES)
    check_flags(causal=causal, return_lse=return_lse)
    dilated = segment_lengths is not None or dilation_rates is not None
    if dilated and layout is not None:
        raise ValueError("give either segment_lengths/dilation_rates (dilated) or layout (block-sparse), not both")
    if layout is not None and not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    ring = RingComm(group)
    B, NQ, Hq, D = q.shape
    scale = check_scale(scale, D)
    n_total = NQ * ring.world
    shard_positions(n_total, 0, ring.world, balance)          # checks N is divisible for the balance
    use_triton = resolve_backend("auto", q.device) == "triton"
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))

    parts = []
    if dilated:
        patterns = check_patterns(segment_lengths, dilation_rates, mode, offsets)
        table = head_offsets(Hq, patterns, mode, offsets)
        (loc_p, loc_t), (ring_p, ring_t) = _dilated_split(patterns, table, n_total, ring.world, balance)
        if any(o >= 0 for row in loc_t for o in row):
            parts.append(dilated_attention_table(q, k, v, loc_p, loc_t, causal=causal, scale=scale))
        if any(o >= 0 for row in ring_t for o in row):
            mask = StepMask(MASK_DILATED, causal, q.device, patterns=ring_p, table=ring_t)
            plan = _Plan(ring, n_total, balance, mask, q.device, send_rows=_residue_rows(ring_p, ring_t))
            parts.append(_RingFn.apply(q, k, v, plan, scale, comm == "p2p", use_triton))
    else:
        if layout is not None:
            layout.check_seq_len(n_total)
            layout.check_heads(B, Hq)
            mask = StepMask(MASK_LAYOUT, causal, q.device, layout=layout)
        else:
            mask = StepMask(MASK_DENSE, causal, q.device)
        plan = _Plan(ring, n_total, balance, mask, q.device)
        parts.append(_RingFn.apply(q, k, v, plan, scale, comm == "p2p", use_triton))

    if len(parts) == 1:
        out, lse = parts[0]
    else:   # local patterns and ring patterns: one softmax over both, by their lse
        out, lse = merge_partials([p[0].transpose(1, 2) for p in parts], [p[1] for p in parts])
        out = out.transpose(1, 2).to(q.dtype).contiguous()
    return (out, lse) if return_lse else out
