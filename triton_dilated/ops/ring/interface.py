"""ring_attention: one sequence sharded over the ranks of a torch.distributed group.

Each rank keeps its queries; key/value shards travel around the ring (comm="p2p") or are
all-gathered (comm="allgather"); schedules.py has both, forward and backward. Every step
folds the received shard into the running float32 (out, lse) with the ring-local-block
step (the Triton kernel of step_kernels.py, imported only when used, or the portable step
of step_portable.py), masks evaluated on global positions.

Dilated attention (LongNet §3.1): a pattern whose segments lie inside one shard piece
needs no communication: it runs on the local shard with the fused dilated kernel and is
merged by lse with the ring part. For the other patterns only the rows some head uses
(its residue rows) travel.

Packed documents (cu_seqlens, documents.py): a pair counts only within one document, and
segments, residues, layout blocks and causal restart at each document start; the steps read
per-position document ids and document positions. Every pattern then goes around the ring
(a segment may cross a shard where a document does), and steps whose shards share no
document (or, causal, only keys after every query of it) are skipped.
"""
from __future__ import annotations

import functools
import hashlib
from typing import Callable, NamedTuple

import torch

from ..block_sparse.layout import BlockLayout, valid_slots
from ..common.call import AttentionCall
from ..common.first_order import first_order_backward
from ..common.lse import merge_partials, softmax_delta
from ..common.runtime import empty_result, last_dim_contiguous, resolve_backend
from ..common.validation import check_choice, check_cu_seqlens, check_flags, check_qkv
from ..common.masks import check_window_causal
from ..dilated.interface import dilated_attention_table
from ..dilated.patterns import check_head_slice, check_patterns, fit_patterns, head_table
from . import step_portable
from .comm import COMMS, RingComm
from .documents import DocPositions, DocumentBalance, bounds_digest, document_layouts, virtual_layout
from .mask import MASK_DENSE, MASK_DILATED, MASK_LAYOUT, StepMask
from .schedules import SCHEDULES, RingPlan
from .shard import BALANCES, shard_positions

# Measured by the last forward on this process: the most key/value bytes held at once
# (own shard, the shard in use and the one in flight). Tests guard the O(N/P) bound.
last_stats: dict = {}


class StepFns(NamedTuple):
    forward: Callable
    backward: Callable


@functools.cache
def _step_fns(use_triton: bool) -> StepFns:
    if use_triton:
        from . import step_kernels   # imports triton
        return StepFns(step_kernels.step_forward, step_kernels.step_backward)
    return StepFns(step_portable.step_forward, step_portable.step_backward)


class _RingFn(torch.autograd.Function):
    """The autograd shell around the schedules: float32 running (out, lse) forward; the
    backward's dQ stays local, dK/dV come back from the ring."""

    @staticmethod
    def forward(ctx, q, k, v, plan, call, comm, use_triton):
        step, (forward, _) = _step_fns(use_triton), SCHEDULES[comm]
        B, NQ, Hq, D = q.shape
        out = torch.zeros(B, NQ, Hq, D, dtype=torch.float32, device=q.device)
        lse = torch.full((B, Hq, NQ), float("-inf"), dtype=torch.float32, device=q.device)
        forward(plan, step, q, k, v, out, lse, call)
        last_stats["max_kv_bytes_held"] = plan.comm.max_bytes_held
        out_cast = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out_cast, lse)
        ctx.args = (plan, call, comm, use_triton)
        return out_cast, lse

    @staticmethod
    @first_order_backward("ring_attention")
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan, call, comm, use_triton = ctx.args
        step, (_, backward) = _step_fns(use_triton), SCHEDULES[comm]
        if dout is None:
            dout = torch.zeros_like(out)
        dout = last_dim_contiguous(dout)
        delta = softmax_delta(dout, out, dlse)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk_rows, dv_rows = backward(plan, step, q, k, v, dout, lse, delta, dq, call)
        dk, dv = plan.scatter_rows(dk_rows, k), plan.scatter_rows(dv_rows, v)
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


# What every rank of the group must agree on (RingComm.agree), in this order.
SIGNATURE = ("q shape (B, N_local, Hq, D)", "k/v shape (B, N_local, Hkv, D)", "dtype", "device type", "causal",
             "scale", "balance", "comm", "segment_lengths/dilation_rates", "mode/offsets", "layout",
             "backward (grad mode, inputs requiring grad)", "heads (head_offset, total_heads)", "cu_seqlens",
             "softcap", "sinks")


def sinks_fingerprint(sinks) -> str | None:
    """None, or the sink logits' count and a digest of their values: ranks whose sinks differ
    would each join their own to their rows (one host read of Hq floats per call)."""
    if sinks is None:
        return None
    h = hashlib.blake2b(sinks.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes(),
                        digest_size=8)
    return f"{sinks.numel()} sink logits, digest {h.hexdigest()}"


def _layout_fingerprint(layout: BlockLayout) -> str:
    """Block size, shape and a digest of the active blocks (canonical lists, O(active blocks)),
    and of a sliding window's predicate and flags."""
    valid = valid_slots(layout.kv_num_blocks, layout.kv_indices.shape[3])
    h = hashlib.blake2b(digest_size=8)
    parts = [layout.kv_num_blocks, layout.kv_indices[valid]]
    if layout.window is not None:
        parts += [torch.tensor(layout.window), layout.kv_window[valid]]
    for t in parts:
        h.update(t.to(device="cpu", dtype=torch.int32).contiguous().numpy().tobytes())
    return f"BlockLayout {tuple(layout.shape)} blocks of {layout.block_size}, digest {h.hexdigest()}"


def check_sequence_parallel_args(q, k, v, shards: int, *, causal, scale, return_lse, comm, balance,
                                 segment_lengths, dilation_rates, mode, offsets, layout, head_offset=0,
                                 total_heads=None, cu_seqlens=None, softcap=0.0, sinks=None):
    """The argument checks of ring_attention and ulysses_attention, run by every rank before
    they agree (q, k, v: this rank's shard of a sequence cut into `shards`). Returns
    (dilated, the AttentionCall, the full length, the fitted patterns or None, (head_offset,
    total_heads)).
    With cu_seqlens the layout (a per-document form) is checked by check_documents."""
    if any(type(x).__name__ == "DTensor" for x in (q, k, v)):
        raise TypeError("q, k, v must be this rank's local shards (torch.Tensor), got a DTensor: pass DTensors to "
                        "sequence_parallel_attention, which takes their mesh and placements")
    check_qkv(q, k, v)
    check_choice("comm", comm, COMMS)
    if not isinstance(balance, DocumentBalance):
        check_choice("balance", balance, BALANCES)
    check_flags(return_lse=return_lse)
    call = AttentionCall.at_door(q, causal=causal, scale=scale, softcap=softcap, sinks=sinks)
    dilated = segment_lengths is not None or dilation_rates is not None
    if dilated and layout is not None:
        raise ValueError("give either segment_lengths/dilation_rates (dilated) or layout (block-sparse), not both")
    if layout is not None and cu_seqlens is None and not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    B, NQ, Hq, D = q.shape
    n_total = NQ * shards
    shard_positions(n_total, 0, shards, balance)          # checks N is divisible for the balance
    heads = check_head_slice(head_offset, total_heads, Hq, k.shape[2])
    patterns = fit_patterns(check_patterns(segment_lengths, dilation_rates, mode, offsets), n_total, heads[1]) \
        if dilated else None
    if layout is not None and cu_seqlens is None:
        layout.check_seq_len(n_total)
        layout.check_heads(B, heads[1])
    if layout is not None:
        for one in (layout if isinstance(layout, (list, tuple)) else [layout]):
            check_window_causal(one, causal)
    return dilated, call, n_total, patterns, heads


def check_documents(cu_seqlens, layout, balance, batch, n_total, total_heads):
    """Packed documents of a sequence-parallel call: (bounds, one BlockLayout per document
    or None each (empty documents; no layout)), or (None, None) without cu_seqlens. A
    DocumentBalance must have been planned for these documents."""
    if cu_seqlens is None:
        if isinstance(balance, DocumentBalance):
            raise ValueError("a DocumentBalance (document_balance) needs the same cu_seqlens in the call, got "
                             "cu_seqlens=None")
        return None, None
    bounds = check_cu_seqlens(cu_seqlens, batch, n_total)
    if isinstance(balance, DocumentBalance) and balance.cu_seqlens != bounds:
        raise ValueError(f"balance was planned for other documents ({bounds_digest(balance.cu_seqlens)}) than "
                         f"cu_seqlens ({bounds_digest(bounds)})")
    per_doc = None
    if layout is not None:
        per_doc = document_layouts(layout, bounds)
        for i, lay in enumerate(per_doc):
            if lay is not None:
                lay.check_heads(batch, total_heads, name=f"layout for document {i}")
    return bounds, per_doc


def _documents_fingerprint(per_doc) -> str:
    """The per-document layouts as one short string (for the rank-agreement check)."""
    h = hashlib.blake2b(digest_size=8)
    for lay in per_doc:
        h.update(b"-" if lay is None else _layout_fingerprint(lay).encode())
    return f"{len(per_doc)} document layouts, digest {h.hexdigest()}"


def ring_attention(q, k, v, *, group=None, segment_lengths=None, dilation_rates=None, layout=None, causal=False,
                   scale=None, mode="longnet", offsets="modulo", comm="p2p", balance="contiguous", return_lse=False,
                   head_offset=0, total_heads=None, cu_seqlens=None, softcap=0.0, sinks=None):
    """Attention over a sequence sharded across the ranks of `group` (DESIGN §5).

    q, k, v: this rank's shard (B, N_local, H, D), as `shard(x, rank, world, balance)`
    returns it (DTensors: sequence_parallel_attention). group: a process group or a 1-D
    DeviceMesh. Dense attention by default; dilated with segment_lengths/dilation_rates
    (mode, offsets as in dilated_attention); block-sparse with a BlockLayout over the full
    sequence. comm: "p2p" (ring, O(N/P) memory) or "allgather". Returns this rank's shard
    of the full-sequence result (and its lse, float32 (B, Hq, N_local)).
    head_offset, total_heads: q holds the query heads [head_offset, head_offset + Hq) of a
    call with total_heads heads (as in dilated_attention; a layout is then laid out for
    total_heads, or one head row); 2-D sequence parallelism (ulysses_attention with
    ring_group) runs the ring on each Ulysses rank's heads.
    cu_seqlens: packed documents on the global sequence (B == 1), the same on every rank,
    as in dilated_attention: [cu_seqlens[i], cu_seqlens[i+1]) is a document; documents may
    span ranks; no query sees another document, and segments, layout blocks and causal
    restart at each document start, so each rank's rows equal those of the single-GPU call
    with the same cu_seqlens (and of per-document calls). layout is then one BlockLayout
    per document (a list), a builder called with each document's length, or one
    BlockLayout for every document (as in block_sparse_attention); all one block size.
    balance: "contiguous", "zigzag", or a DocumentBalance (document_balance(cu_seqlens,
    world, ...)) that deals the positions so that the (query, key) pairs per rank are near
    even for any document lengths; shard and unshard take the same object.
    softcap: c > 0: scores s -> c * tanh(s / c) in every ring step; 0.0 (or None): no cap (as
    dilated_attention). sinks: None or a float32 (Hq,) tensor, one logit per query head of q
    (differentiable), joining every row's denominator once: added after the last ring step
    and the merge of the local patterns, never per step. Pass the same sinks on every rank
    (a replicated parameter): each rank's gradient for it is its own rows' part, and their
    sum over the ranks (what DDP's all-reduce gives) is the full-sequence gradient.

    Every rank must pass the same shapes, dtype, device type, flags, scale, patterns and
    layout: one small all-gather checks it before any transfer, and where ranks differ
    (or one rank's arguments are invalid) every rank raises.
    """
    ring = RingComm(group)
    signature, error = dict.fromkeys(SIGNATURE), None
    try:
        dilated, call, n_total, patterns, heads = check_sequence_parallel_args(
            q, k, v, ring.world, causal=causal, scale=scale, return_lse=return_lse, comm=comm, balance=balance,
            segment_lengths=segment_lengths, dilation_rates=dilation_rates, mode=mode, offsets=offsets,
            layout=layout, head_offset=head_offset, total_heads=total_heads, cu_seqlens=cu_seqlens,
            softcap=softcap, sinks=sinks)
        bounds, per_doc = check_documents(cu_seqlens, layout, balance, q.shape[0], n_total, heads[1])
        signature = dict(zip(SIGNATURE, (
            tuple(q.shape), tuple(k.shape), str(q.dtype).removeprefix("torch."), q.device.type, call.causal,
            call.scale,
            balance, comm, patterns, (mode, offsets) if dilated else None,
            None if layout is None else _layout_fingerprint(layout) if per_doc is None else
            _documents_fingerprint(per_doc),
            torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)), heads,
            None if bounds is None else bounds_digest(bounds), call.softcap, sinks_fingerprint(call.sinks))))
    except (TypeError, ValueError) as exc:
        error = exc
    ring.agree(signature, error, device=q.device if isinstance(q, torch.Tensor) else None)
    if q.shape[0] == 0 or q.shape[1] == 0:   # every rank agreed on these shapes: nothing to send
        return call.finish(empty_result(q, k, v, True), return_lse)

    # the ring-step kernels' families: a GPU where their tiles do not fit (or spill: Volta/Turing
    # above D = 64) runs the portable step
    use_triton = resolve_backend("auto", q.device, ("ring_step_fwd", "ring_step_bwd"), q.shape[-1], q.dtype) == "triton"
    Hq = q.shape[2]
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    parts = []
    if bounds is not None:
        parts.append(_documents_ring(q, k, v, ring, n_total, balance, bounds, per_doc, dilated, patterns, heads,
                                     call, mode=mode, offsets=offsets, comm=comm, use_triton=use_triton))
    elif dilated:
        table = head_table(Hq, patterns, mode, offsets, *heads)
        (loc_p, loc_t), (ring_p, ring_t) = _dilated_split(patterns, table, n_total, ring.world, balance)
        if any(o >= 0 for row in loc_t for o in row):
            parts.append(dilated_attention_table(q, k, v, loc_p, loc_t, call))
        if any(o >= 0 for row in ring_t for o in row):
            mask = StepMask(MASK_DILATED, causal, q.device, patterns=ring_p, table=ring_t)
            plan = RingPlan(ring, n_total, balance, mask, q.device, send_rows=_residue_rows(ring_p, ring_t))
            parts.append(_RingFn.apply(q, k, v, plan, call.without_sinks(), comm, use_triton))
    else:
        if layout is not None:
            mask = StepMask(MASK_LAYOUT, causal, q.device, layout=layout.heads(heads[0], heads[0] + Hq))
        else:
            mask = StepMask(MASK_DENSE, causal, q.device)
        plan = RingPlan(ring, n_total, balance, mask, q.device)
        parts.append(_RingFn.apply(q, k, v, plan, call.without_sinks(), comm, use_triton))

    if len(parts) == 1:
        out, lse = parts[0]
    else:   # local patterns and ring patterns: one softmax over both, by their lse
        out, lse = merge_partials([p[0].transpose(1, 2) for p in parts], [p[1] for p in parts])
        out = out.transpose(1, 2).to(q.dtype).contiguous()
    return call.finish((out, lse), return_lse)   # the sinks once, after every step and part


def _documents_ring(q, k, v, ring, n_total, balance, bounds, per_doc, dilated, patterns, heads, call, *, mode,
                    offsets, comm, use_triton):
    """(out, lse) of ring_attention with packed documents (documents.py). One rank: the
    single-device call with the documents' bounds (the shard is the sequence)."""
    Hq = q.shape[2]
    if dilated:
        table = head_table(Hq, patterns, mode, offsets, *heads)
        if ring.world == 1:
            return dilated_attention_table(q, k, v, patterns, table, call, doc_bounds=bounds)
        mask = StepMask(MASK_DILATED, call.causal, q.device, patterns=patterns, table=table)
        plan = RingPlan(ring, n_total, balance, mask, q.device, send_rows=_residue_rows(patterns, table),
                        docs=DocPositions(bounds, q.device))
    elif per_doc is not None:
        lay = virtual_layout(per_doc, bounds, (heads[0], heads[0] + Hq))
        mask = StepMask(MASK_LAYOUT, call.causal, q.device, layout=lay)
        plan = RingPlan(ring, n_total, balance, mask, q.device, docs=DocPositions(bounds, q.device, lay.block_size))
    else:
        mask = StepMask(MASK_DENSE, call.causal, q.device)
        plan = RingPlan(ring, n_total, balance, mask, q.device, docs=DocPositions(bounds, q.device))
    return _RingFn.apply(q, k, v, plan, call.without_sinks(), comm, use_triton)
