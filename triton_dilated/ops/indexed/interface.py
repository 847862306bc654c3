"""The training door of indexed (token-level top-k) attention: `indexed_attention` (validation,
backend dispatch), and the autograd Function over the Triton launchers. What the indices mean
(unused slots, causal cut, duplicates) is settled once, in indices.py.

The Triton kernels (kernels.py) are imported only when used: the package runs without triton.
Under torch.compile the door runs through the custom ops `triton_dilated::indexed_fwd/_bwd`
(either path; the canonical slots are torch code before them, traced as they are).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..common.call import AttentionCall
from ..common.first_order import first_order_backward, joined_to
from ..common.lse import lse_from_stats
from ..common.op_support import check_path, empty_stats, fresh, lazy_module, recompute_grads, resolve_path
from ..common.runtime import last_dim_contiguous
from ..common.validation import check_flags
from .indices import canonical_slots, check_inputs, kernel_head_dims, validate_values
from .portable import indexed_attention_torch

_kernels = lazy_module(__package__ + ".kernels")   # imports triton


def check_args(q, k, v, indices, *, causal, scale, softcap, sinks, return_lse, validate):
    """Validation of the indexed doors: the AttentionCall (validate=True also reads the
    indices' values: a host sync)."""
    check_inputs(q, k, v, indices)
    check_flags(return_lse=return_lse, validate=validate)
    call = AttentionCall.at_door(q, causal=causal, scale=scale, softcap=softcap, sinks=sinks)
    if validate:
        validate_values(indices, k.shape[1])
    return call


class _IndexedAttentionFn(torch.autograd.Function):
    """The Triton path: forward (out and the row statistics), dQ and dK/dV kernels."""

    @staticmethod
    def forward(ctx, q, k, v, slots, count, call):
        out, row_max, row_sum = _kernels().indexed_forward(q, k, v, slots, count, call)
        ctx.save_for_backward(q, k, v, out, row_max, row_sum, slots, count)
        ctx.call = call
        return out, lse_from_stats(row_max, row_sum)

    @staticmethod
    @first_order_backward("indexed_attention (Triton path)")
    def backward(ctx, do, dlse):
        q, k, v, out, row_max, row_sum, slots, count = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(out)
        dq, dk, dv = _kernels().indexed_backward(do, dlse, q, k, v, out, row_max, row_sum, slots, count, ctx.call)
        return dq, dk, dv, None, None, None


def indexed_attention(q, k, v, indices, *, causal=False, scale=None, softcap=None, sinks=None, return_lse=False,
                      backend="auto", validate=False):
    """Token-level top-k sparse attention (DeepSeek Sparse Attention; DESIGN §5c): each query
    attends to the keys its row of `indices` lists.

    Args:
        q: (B, Nq, Hq, Dqk); k: (B, Nk, Hkv, Dqk); v: (B, Nk, Hkv, Dv), Dv may differ from Dqk
            (non-absorbed MLA: 192 and 128); Hq % Hkv == 0 (GQA, MQA); float16, bfloat16 or
            float32. Head dims up to 576 (the absorbed-MLA shape; over 256 on the Triton kernels
            from sm80 on, else the portable path).
        indices: int32 (or int64) (B, Nq, Hkv, topk), a row per kv head, or (B, Nq, topk), one
            row for every head (what transformers' DeepseekV32 passes). Key positions; -1 marks
            an unused slot, and so does any value outside [0, Nk) (never read). A key listed
            twice in a row counts once (a row is a set, as transformers' dense-mask folding).
        causal: also drop the slots past the query's position; queries are bottom-right
            aligned: query i sits at position i + Nk - Nq.
        scale: default 1/sqrt(Dqk).
        softcap: a positive float c: scores s -> c * tanh(s / c); 0.0 or None: no cap.
        sinks: None or a float32 (Hq,) tensor (differentiable): a per-head logit joining every
            row's denominator (no value); lse then includes it.
        return_lse: also return lse, float32 (B, Hq, Nq), natural log, differentiable.
        backend: "auto", "triton" or "torch" (DESIGN §7).
        validate: raise a ValueError for a slot that is neither -1 nor in [0, Nk) (reads the
            indices: a host sync). Off by default: such slots are unused.

    Returns out (B, Nq, Hq, Dv) like q (and lse). A row with no used slot gives 0 and lse =
    -inf (with sinks: 0 and its head's sink). The Triton path is deterministic: dK and dV are
    summed per key, without atomics.
    """
    call = check_args(q, k, v, indices, causal=causal, scale=scale, softcap=softcap, sinks=sinks,
                      return_lse=return_lse, validate=validate)
    return call.finish(indexed_call(q, k, v, indices, call, backend=backend), return_lse)


def indexed_call(q, k, v, indices, call, *, backend):
    """(out, lse) of indexed_attention on validated inputs and call (its sinks are the caller's)."""
    B, Nq, Hq, D = q.shape
    Nk = k.shape[1]
    path = resolve_path(backend, str(q.device), (), D, q.dtype)
    if path == "triton" and not kernel_head_dims(q, v):
        if backend == "triton":
            raise ValueError(f"backend='triton': the indexed kernels take head dims over 256 (Dqk = {D}, Dv = "
                             f"{v.shape[-1]}) on sm80 and newer only; use backend='auto' or 'torch' (the portable "
                             f"path)")
        path = "torch"
    if Nk == 0 or indices.shape[-1] == 0 or B * Nq == 0:
        return _no_keys(q, k, v)
    slots, count = canonical_slots(indices, Nq, Nk, call.causal)
    if torch.compiler.is_compiling():
        out, lse, _, _ = _indexed_fwd(q, k, v, slots, count, call.scale, call.softcap, path)
        return out, lse
    if path == "triton":
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        return _IndexedAttentionFn.apply(q, k, v, slots, count, call.without_sinks())
    return indexed_attention_torch(q, k, v, slots, count, call)


def _no_keys(q, k, v):
    """The result where no row can have a key (no key, no slot) or there is no row: out 0, lse
    -inf, still connected to q, k, v for backward (zero gradients)."""
    B, Nq, Hq, _ = q.shape
    out = torch.zeros(B, Nq, Hq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hq, Nq), float("-inf"), dtype=torch.float32, device=q.device)
    return joined_to(out, q, k, v), joined_to(lse, q, k, v)


# ----------------------------------------------------------------------------- custom ops
# What torch.compile traces: the kernels (or the portable path) on canonical slots. The row
# statistics are zero-length on the portable path, whose backward op recomputes its forward.
# Double backward is not supported (the backward op has no autograd formula).

@torch.library.custom_op("triton_dilated::indexed_fwd", mutates_args=())
def _indexed_fwd(q: Tensor, k: Tensor, v: Tensor, slots: Tensor, count: Tensor, scale: float, softcap: float,
                 path: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, row_max, row_sum) on canonical slots (indices.canonical_slots)."""
    check_path(path)
    call = AttentionCall(False, scale, softcap)   # the causal cut is in the slots
    if path == "triton":
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        out, row_max, row_sum = _kernels().indexed_forward(q, k, v, slots, count, call)
        return out, lse_from_stats(row_max, row_sum), row_max, row_sum
    out, lse = indexed_attention_torch(q, k, v, slots, count, call)
    return fresh(out), fresh(lse), empty_stats(q), empty_stats(q)


@_indexed_fwd.register_fake
def _(q, k, v, slots, count, scale, softcap, path):
    B, Nq, Hq, _ = q.shape
    stats = Nq if path == "triton" else 0
    return (q.new_empty((B, Nq, Hq, v.shape[-1])), q.new_empty((B, Hq, Nq), dtype=torch.float32),
            q.new_empty((B, Hq, stats), dtype=torch.float32), q.new_empty((B, Hq, stats), dtype=torch.float32))


@torch.library.custom_op("triton_dilated::indexed_bwd", mutates_args=())
def _indexed_bwd(do: Tensor, dlse: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, row_max: Tensor,
                 row_sum: Tensor, slots: Tensor, count: Tensor, scale: float, softcap: float,
                 path: str) -> Tuple[Tensor, Tensor, Tensor]:
    check_path(path)
    call = AttentionCall(False, scale, softcap)
    if path == "triton":
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        dq, dk, dv = _kernels().indexed_backward(do, dlse, q, k, v, out, row_max, row_sum, slots, count, call)
        return fresh(dq), fresh(dk), fresh(dv)
    return recompute_grads(lambda q_, k_, v_: indexed_attention_torch(q_, k_, v_, slots, count, call), (q, k, v),
                           (do, dlse))


@_indexed_bwd.register_fake
def _(do, dlse, q, k, v, out, row_max, row_sum, slots, count, scale, softcap, path):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _indexed_setup(ctx, inputs, output):
    q, k, v, slots, count, scale, softcap, path = inputs
    out, _, row_max, row_sum = output
    ctx.save_for_backward(q, k, v, out, row_max, row_sum, slots, count)
    ctx.mark_non_differentiable(row_max, row_sum)
    ctx.args = (scale, softcap, path)


def _indexed_backward(ctx, do, dlse, _dmax, _dsum):
    q, k, v, out, row_max, row_sum, slots, count = ctx.saved_tensors
    do = torch.zeros_like(out) if do is None else do
    dlse = torch.zeros(out.shape[0], out.shape[2], out.shape[1], dtype=torch.float32, device=out.device) \
        if dlse is None else dlse
    dq, dk, dv = _indexed_bwd(do, dlse, q, k, v, out, row_max, row_sum, slots, count, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


_indexed_fwd.register_autograd(_indexed_backward, setup_context=_indexed_setup)
