"""ulysses_attention: sequence parallelism by heads (DeepSpeed Ulysses, arXiv 2309.14509).

Each rank holds a sequence shard of every head. One all-to-all turns that into the whole
sequence of Hq / P heads, the rank runs one local fused call on it (dense, dilated or
block-sparse, with `head_offset` so that dilated offsets and head groups follow the global
head index), and a second all-to-all turns the result back into the rank's sequence shard.
Both all-to-alls are permutations of the entries across ranks, so each one's backward is
the other (the adjoint of a permutation is its inverse): autograd-aware, forward and
backward, one all_to_all_single each (gloo has it, as NCCL does).

GQA with fewer key/value heads than ranks: each key/value head is repeated P / Hkv times
before the all-to-all (DeepSpeed ALST's rule), so rank r receives the key/value head its
query heads read; the gradients of the copies are summed by the repeat's backward. This
needs P % Hkv == 0 (otherwise some rank's query heads would read two key/value heads).

2-D (USP, yunchang's LongContextAttention): with a `ring_group` of R ranks the local call
is ring_attention over that group on the Ulysses group's part of the sequence. A grid of U
x R ranks holds the sequence as one sharding over U * R: the rank at Ulysses index u and
ring index r holds shard(x, r * U + u, U * R, balance). For zigzag that is the right
thing twice: the U shards of a Ulysses group, joined by unshard(..., balance) after the
all-to-all, are exactly zigzag shard r of R (chunks rU..rU+U-1 and their mirrors), which
is what the ring's zigzag balance takes.
"""
from __future__ import annotations

import torch

from ..block_sparse.interface import block_sparse_attention
from ..common.runtime import empty_result
from ..common.validation import check_choice
from ..dilated.interface import dilated_attention
from .comm import RingComm
from .documents import bounds_digest
from .interface import _documents_fingerprint, _layout_fingerprint, check_documents, check_sequence_parallel_args, \
    ring_attention, sinks_fingerprint
from .shard import BALANCES, shard, unshard


def seq_to_heads(x, comm: RingComm, balance: str = "contiguous"):
    """(B, N/P, H, ...) sequence shards -> (B, N, H/P, ...): this rank's heads
    [rank * H/P, (rank + 1) * H/P) over the whole sequence (positions in order)."""
    P = comm.world
    parts = x.unflatten(2, (P, x.shape[2] // P)).movedim(2, 0)        # (P, B, N/P, H/P, ...): part j to rank j
    return unshard(list(comm.all_to_all(parts)), balance)            # part i: rank i's positions


def heads_to_seq(y, comm: RingComm, balance: str = "contiguous"):
    """The inverse of seq_to_heads: (B, N, H/P, ...) -> (B, N/P, H, ...)."""
    P = comm.world
    parts = torch.stack([shard(y, j, P, balance) for j in range(P)])  # (P, B, N/P, H/P, ...): rank j's positions
    return comm.all_to_all(parts).movedim(0, 2).flatten(2, 3)          # part i: rank i's heads


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, balance):
        ctx.args = (comm, balance)
        return seq_to_heads(x, comm, balance)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad, *ctx.args), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, comm, balance):
        ctx.args = (comm, balance)
        return heads_to_seq(y, comm, balance)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad, *ctx.args), None, None


SIGNATURE = ("q shape (B, N_local, Hq, D)", "k/v shape (B, N_local, Hkv, D)", "dtype", "device type", "causal",
             "scale", "balance", "segment_lengths/dilation_rates", "mode/offsets", "layout", "backend",
             "backward (grad mode, inputs requiring grad)", "ring (world size, comm)", "cu_seqlens", "softcap",
             "sinks")


def check_ulysses_heads(num_heads: int, num_kv_heads: int, world: int) -> int:
    """How often each key/value head is repeated before the all-to-all (1: none); a
    ValueError where the heads do not split over `world` ranks."""
    if num_heads % world:
        raise ValueError(f"ulysses_attention splits the query heads over the ranks: q's {num_heads} heads must be "
                         f"a multiple of the world size {world}")
    if num_kv_heads >= world:
        if num_kv_heads % world:
            raise ValueError(f"ulysses_attention: k/v's {num_kv_heads} heads must be a multiple of the world size "
                             f"{world} (or divide it: then each is repeated, as DeepSpeed ALST does)")
        return 1
    if world % num_kv_heads:
        raise ValueError(f"ulysses_attention: with fewer key/value heads ({num_kv_heads}) than ranks ({world}) each "
                         f"is repeated world // Hkv times, which needs the world size to be a multiple of Hkv")
    return world // num_kv_heads


def ulysses_attention(q, k, v, *, group=None, segment_lengths=None, dilation_rates=None, layout=None, causal=False,
                      scale=None, mode="longnet", offsets="modulo", balance="contiguous", return_lse=False,
                      backend="auto", ring_group=None, comm="p2p", cu_seqlens=None, softcap=0.0, sinks=None):
    """Attention over a sequence sharded across the ranks of `group`, by heads (Ulysses).

    q, k, v: this rank's sequence shard (B, N_local, H, D), as `shard(x, rank, world,
    balance)` gives it (DTensors: sequence_parallel_attention; group, ring_group: process
    groups or 1-D DeviceMeshes). Hq must be a multiple of the world size P; Hkv a multiple of P, or
    a divisor of it (each key/value head is then repeated P / Hkv times, DeepSpeed ALST's
    rule). Dense attention by default; dilated with segment_lengths/dilation_rates (mode,
    offsets as in dilated_attention); block-sparse with a BlockLayout over the full
    sequence. backend: of the local call, as in dilated_attention. Returns this rank's
    shard of the full-sequence result (and its lse, float32 (B, Hq, N_local)).

    2-D sequence parallel (USP): with ring_group (R ranks; `group` then has U), the
    Ulysses group's heads go around a ring (ring_attention with `comm`; its step kernels,
    not `backend`). The rank at Ulysses index u, ring index r holds shard(x, r * U + u,
    U * R, balance); balance="zigzag" balances the ring's causal work.

    cu_seqlens: packed documents on the global sequence (B == 1), the same on every rank:
    the local call takes them (dilated_attention's / block_sparse_attention's cu_seqlens;
    with ring_group, ring_attention's), so each rank's rows equal the single-GPU call's.
    layout may then be per document, as in block_sparse_attention. balance stays
    "contiguous" or "zigzag" here (a DocumentBalance is ring_attention's).

    softcap: c > 0, scores s -> c * tanh(s / c); 0.0 (or None): no cap (as dilated_attention). sinks: None
    or a float32 (Hq,) tensor of every query head's sink logit (differentiable), the same on
    every rank; each rank joins its own heads' sinks to its local call (once per row, after
    the ring with ring_group). A rank's gradient for sinks holds its heads' full-sequence
    gradient (zeros elsewhere): the sum over the ranks (DDP's all-reduce) is the gradient.

    Memory per rank: the whole sequence of Hq / P heads (the same O(N H / P) as the
    shards). Every rank must pass the same shapes, dtype, flags, scale, patterns and layout:
    one small all-gather checks it first, and where ranks differ (or one rank's arguments
    are invalid) every rank raises the same ValueError.
    """
    ucomm = RingComm(group, who="ulysses_attention")
    rcomm = RingComm(ring_group, who="ulysses_attention (ring group)") if ring_group is not None else None
    ring_world = rcomm.world if rcomm is not None else 1
    signature, error = dict.fromkeys(SIGNATURE), None
    try:
        dilated, call, n_total, patterns, _ = check_sequence_parallel_args(
            q, k, v, ucomm.world * ring_world, causal=causal, scale=scale, return_lse=return_lse, comm=comm,
            balance=balance, segment_lengths=segment_lengths, dilation_rates=dilation_rates, mode=mode,
            offsets=offsets, layout=layout, cu_seqlens=cu_seqlens, softcap=softcap, sinks=sinks)
        check_choice("balance", balance, BALANCES)
        bounds, per_doc = check_documents(cu_seqlens, layout, balance, q.shape[0], n_total, q.shape[2])
        check_choice("backend", backend, ("auto", "triton", "torch"))
        Hq = q.shape[2]
        repeat = check_ulysses_heads(Hq, k.shape[2], ucomm.world)
        signature = dict(zip(SIGNATURE, (
            tuple(q.shape), tuple(k.shape), str(q.dtype).removeprefix("torch."), q.device.type, call.causal,
            call.scale, balance, patterns, (mode, offsets) if dilated else None,
            None if layout is None else _layout_fingerprint(layout) if per_doc is None else
            _documents_fingerprint(per_doc), backend,
            torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)),
            (ring_world, comm) if rcomm is not None else None, None if bounds is None else bounds_digest(bounds),
            call.softcap, sinks_fingerprint(call.sinks))))
    except (TypeError, ValueError) as exc:
        error = exc
    device = q.device if isinstance(q, torch.Tensor) else None
    verdict = ucomm.disagreement(signature, error, device)
    if rcomm is not None:   # every Ulysses group's verdict reaches every rank of the grid through the rings
        told = None if verdict is None else f"{type(verdict).__name__}: {verdict}"
        across = rcomm.disagreement({"the Ulysses group's check": told, **signature}, None, device)
        verdict = across if across is not None else verdict
    if verdict is not None:
        raise verdict
    if q.shape[0] == 0 or q.shape[1] == 0:   # every rank agreed on these shapes: nothing to send
        return call.finish(empty_result(q, k, v, True), return_lse)

    if repeat > 1:
        k, v = (x.repeat_interleave(repeat, dim=2) for x in (k, v))
    qh, kh, vh = (_SeqToHeads.apply(x, ucomm, balance) for x in (q, k, v))
    heads = Hq // ucomm.world
    first = ucomm.rank * heads
    extra = dict(scale=call.scale, softcap=call.softcap,
                 sinks=None if call.sinks is None else call.sinks[first:first + heads])
    if rcomm is not None:
        res = ring_attention(qh, kh, vh, group=ring_group, segment_lengths=segment_lengths,
                             dilation_rates=dilation_rates, layout=layout if per_doc is None else per_doc,
                             causal=causal, mode=mode, offsets=offsets, comm=comm, balance=balance,
                             return_lse=return_lse, head_offset=first, total_heads=Hq, cu_seqlens=bounds, **extra)
    elif dilated:
        res = dilated_attention(qh, kh, vh, segment_lengths, dilation_rates, causal=causal, mode=mode,
                                offsets=offsets, return_lse=return_lse, backend=backend, head_offset=first,
                                total_heads=Hq, cu_seqlens=bounds, **extra)
    elif layout is not None:
        mine = layout.heads(first, first + heads) if per_doc is None else \
            [lay if lay is None else lay.heads(first, first + heads) for lay in per_doc]
        res = block_sparse_attention(qh, kh, vh, mine, causal=causal, return_lse=return_lse,
                                     backend=backend, cu_seqlens=bounds, **extra)
    else:   # dense: one pattern whose segment is the whole sequence (each document's, with cu_seqlens)
        res = dilated_attention(qh, kh, vh, [n_total], [1], causal=causal, return_lse=return_lse,
                                backend=backend, cu_seqlens=bounds, **extra)
    out, lse = res if return_lse else (res, None)
    out = _HeadsToSeq.apply(out, ucomm, balance)
    if not return_lse:
        return out
    return out, _HeadsToSeq.apply(lse.transpose(1, 2), ucomm, balance).transpose(1, 2).contiguous()
