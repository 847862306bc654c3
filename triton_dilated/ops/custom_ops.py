"""torch.library custom ops for dilated and block-sparse attention, so that
`torch.compile(fullgraph=True)` traces them (forward and backward) without graph breaks.

Public wrappers (same arguments and results as the plain functions):

    dilated_attention_op(q, k, v, segment_lengths, dilation_rates, *, causal=False, scale=None,
                         mode="longnet", offsets="modulo", return_lse=False, backend="auto")
    block_sparse_attention_op(q, k, v, layout, *, causal=False, scale=None, return_lse=False,
                              backend="auto")

The wrappers validate in Python (dynamo traces that: plain isinstance/shape checks) and
resolve the backend once, then call one forward op; its autograd formula calls one
backward op. Four ops, all opaque to the compiler and described to it by fake
(meta) implementations:

    triton_dilated::dilated_fwd / dilated_bwd
    triton_dilated::block_sparse_fwd / block_sparse_bwd

Op arguments are op-compatible: patterns travel as two int lists plus the `mode` and
`offsets` strings (the per-head offset table is rebuilt inside the op, cached); a
BlockLayout travels as its four int32 tensors (kv_num_blocks, kv_indices, q_num_blocks,
q_indices) and its block size. `path` is the resolved backend, "triton" or "torch", so
the fake implementations do not depend on the environment.

* path "triton": the launchers (dilated_forward / dilated_backward,
  block_sparse_forward / block_sparse_backward). The forward returns the row statistics
  (max, denominator) the backward kernels need, next to out and lse.
* path "torch": the portable functions. The backward recomputes the portable forward
  with autograd recording and differentiates it (_recompute_grads): one extra portable
  forward of compute, and no portable autograd graph kept alive between forward and
  backward (activation-checkpoint style).

Outputs the caller did not ask for are returned with a zero-length last dimension
(the portable dilated lse without return_lse; the row statistics on the portable path).

Double backward is not supported (the backward op has no autograd formula).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .block_sparse.layout import BlockLayout
from .block_sparse.parallel import block_sparse_backward, block_sparse_forward
from .block_sparse.torch_impl import block_sparse_attention_torch
from .common.lse import lse_from_stats
from .common.runtime import empty_result, last_dim_contiguous, portable_compute_dtype, resolve_backend
from .common.validation import check_flags, check_qkv, check_scale
from .dilated.parallel import dilated_backward, dilated_forward
from .dilated.patterns import check_patterns, head_offsets
from .dilated.torch_impl import dilated_attention_torch

__all__ = ["dilated_attention_op", "block_sparse_attention_op", "layout_from_tensors"]

_PATHS = ("triton", "torch")


def _check_path(path: str) -> None:
    if path not in _PATHS:
        raise ValueError(f"path must be one of {_PATHS}, got {path!r}")


def _resolve_path(backend: str, device: str) -> str:
    """resolve_backend, evaluated once at trace time under torch.compile (it reads the
    environment and asks whether triton imports: facts that do not change in a process)."""
    return resolve_backend(backend, torch.device(device))


# = torch.compiler.assume_constant_result(_resolve_path), which only sets this flag but
# imports torch._dynamo (~3 s) to do it. Should the flag ever stop working, dynamo traces
# resolve_backend instead (it can; it only warns about the lru_cache inside).
_resolve_path._dynamo_marked_constant = True


def _empty_stats(q: Tensor) -> Tensor:
    return q.new_empty((q.shape[0], q.shape[2], 0), dtype=torch.float32)


def _fresh(x: Tensor) -> Tensor:
    """A contiguous tensor that is not a view of anything the op received."""
    return x.contiguous() if x._base is None else x.clone(memory_format=torch.contiguous_format)


def _recompute_grads(fn, inputs, cotangents):
    """Gradients of the portable forward `fn` at `inputs` for `cotangents`, by recomputing
    it with autograd recording. Inside a custom op's implementation the autograd dispatch
    keys are switched off (the op is below autograd); this switches them back on for the
    recomputation only, as torch.utils.checkpoint does for its own recomputation.
    (torch.func.vjp would also work here, but its wrapper tensors break under
    TorchDispatchModes such as FlopCounterMode.)"""
    keys = torch._C.DispatchKey
    with torch._C._SetExcludeDispatchKeyGuard(keys.AutogradFunctionality, False), \
            torch._C._SetExcludeDispatchKeyGuard(keys.ADInplaceOrView, False), torch.enable_grad():
        leaves = [x.detach().requires_grad_(True) for x in inputs]
        outs = fn(*leaves)
        grads = torch.autograd.grad(outs, leaves, cotangents, allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else _fresh(g) for g, x in zip(grads, leaves))


# ----------------------------------------------------------------------------- dilated

def _patterns_table(num_heads, segment_lengths, dilation_rates, mode, offsets):
    patterns = tuple(zip((int(w) for w in segment_lengths), (int(r) for r in dilation_rates)))
    return patterns, head_offsets(num_heads, patterns, mode, offsets)


@torch.library.custom_op("triton_dilated::dilated_fwd", mutates_args=())
def _dilated_fwd(q: Tensor, k: Tensor, v: Tensor, segment_lengths: List[int], dilation_rates: List[int],
                 causal: bool, scale: float, mode: str, offsets: str, need_lse: bool,
                 path: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, row_max, row_sum); see the module docstring for the zero-length outputs."""
    _check_path(path)
    patterns, table = _patterns_table(q.shape[2], segment_lengths, dilation_rates, mode, offsets)
    if path == "triton":
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        out, row_max, row_sum = dilated_forward(q, k, v, patterns, table, causal=causal, scale=scale)
        return out, lse_from_stats(row_max, row_sum), row_max, row_sum
    out, lse = dilated_attention_torch(q, k, v, patterns, table, causal=causal, scale=scale, need_lse=need_lse,
                                       compute_dtype=portable_compute_dtype(q.dtype, q.device))
    if lse is None:
        lse = _empty_stats(q)
    return _fresh(out), _fresh(lse), _empty_stats(q), _empty_stats(q)


@_dilated_fwd.register_fake
def _(q, k, v, segment_lengths, dilation_rates, causal, scale, mode, offsets, need_lse, path):
    B, N, Hq, D = q.shape
    out = q.new_empty((B, N, Hq, D))
    stats = N if path == "triton" else 0
    lse = q.new_empty((B, Hq, N if (need_lse or path == "triton") else 0), dtype=torch.float32)
    return out, lse, q.new_empty((B, Hq, stats), dtype=torch.float32), q.new_empty((B, Hq, stats), dtype=torch.float32)


@torch.library.custom_op("triton_dilated::dilated_bwd", mutates_args=())
def _dilated_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                 row_max: Tensor, row_sum: Tensor, segment_lengths: List[int], dilation_rates: List[int],
                 causal: bool, scale: float, mode: str, offsets: str, path: str) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), contiguous. dlse: None, or float32 (B, Hq, N)."""
    _check_path(path)
    patterns, table = _patterns_table(q.shape[2], segment_lengths, dilation_rates, mode, offsets)
    if path == "triton":
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        dq, dk, dv = dilated_backward(do, dlse, q, k, v, out, row_max, row_sum, patterns, table,
                                      causal=causal, scale=scale)
        return _fresh(dq), _fresh(dk), _fresh(dv)
    compute = portable_compute_dtype(q.dtype, q.device)
    with_lse = dlse is not None

    def fwd(q_, k_, v_):
        o, lse = dilated_attention_torch(q_, k_, v_, patterns, table, causal=causal, scale=scale,
                                         need_lse=with_lse, compute_dtype=compute)
        return (o, lse) if with_lse else (o,)

    return _recompute_grads(fwd, (q, k, v), (do, dlse) if with_lse else (do,))


@_dilated_bwd.register_fake
def _(do, dlse, q, k, v, out, row_max, row_sum, segment_lengths, dilation_rates, causal, scale, mode, offsets,
      path):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _dilated_setup(ctx, inputs, output):
    q, k, v, segment_lengths, dilation_rates, causal, scale, mode, offsets, need_lse, path = inputs
    out, lse, row_max, row_sum = output
    ctx.save_for_backward(q, k, v, out, row_max, row_sum)
    ctx.mark_non_differentiable(row_max, row_sum)
    ctx.args = (list(segment_lengths), list(dilation_rates), causal, scale, mode, offsets, path)
    ctx.lse_len = lse.shape[-1]
    ctx.need_lse = need_lse


def _dilated_backward(ctx, do, dlse, _dmax, _dsum):
    q, k, v, out, row_max, row_sum = ctx.saved_tensors
    segment_lengths, dilation_rates, causal, scale, mode, offsets, path = ctx.args
    if do is None:
        do = torch.zeros_like(out)
    if dlse is not None and (not ctx.need_lse or ctx.lse_len == 0):
        dlse = None   # the caller never saw lse: its gradient is the materialised zero
    dq, dk, dv = _dilated_bwd(do, dlse, q, k, v, out, row_max, row_sum, segment_lengths, dilation_rates,
                              causal, scale, mode, offsets, path)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_dilated_fwd.register_autograd(_dilated_backward, setup_context=_dilated_setup)


def dilated_attention_op(q, k, v, segment_lengths, dilation_rates, *, causal=False, scale=None, mode="longnet",
                         offsets="modulo", return_lse=False, backend="auto"):
    """`triton_dilated.dilated_attention` through the `triton_dilated::dilated_fwd/_bwd`
    custom ops: the same arguments, results and numerics, and traceable by
    `torch.compile(fullgraph=True)` forward and backward. See dilated_attention for the
    arguments."""
    check_qkv(q, k, v)
    patterns = check_patterns(segment_lengths, dilation_rates, mode, offsets)
    check_flags(causal=causal, return_lse=return_lse)
    B, N, Hq, D = q.shape
    scale = check_scale(scale, D)
    path = _resolve_path(backend, str(q.device))
    if B == 0 or N == 0:
        return empty_result(q, k, v, return_lse)
    out, lse, _, _ = _dilated_fwd(q, k, v, [w for w, _ in patterns], [r for _, r in patterns], causal, scale,
                                  mode, offsets, return_lse, path)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- block-sparse

def layout_from_tensors(kv_num_blocks: Tensor, kv_indices: Tensor, q_num_blocks: Tensor, q_indices: Tensor,
                        block_size: int) -> BlockLayout:
    """A BlockLayout around already-canonical lists (the four tensors of an existing
    layout), without validation or re-transposition: O(1)."""
    layout = object.__new__(BlockLayout)
    layout.block_size = int(block_size)
    layout.kv_num_blocks, layout.kv_indices = kv_num_blocks, kv_indices
    layout.q_num_blocks, layout.q_indices = q_num_blocks, q_indices
    layout.n_q_blocks, layout.n_kv_blocks = kv_num_blocks.shape[2], q_num_blocks.shape[2]
    return layout


@torch.library.custom_op("triton_dilated::block_sparse_fwd", mutates_args=())
def _block_sparse_fwd(q: Tensor, k: Tensor, v: Tensor, kv_num_blocks: Tensor, kv_indices: Tensor,
                      q_num_blocks: Tensor, q_indices: Tensor, block_size: int, causal: bool, scale: float,
                      need_lse: bool, path: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, row_max, row_sum); row statistics are zero-length on the portable path.
    lse is always computed (both paths get it for free); need_lse only tells the autograd
    formula whether the caller saw it."""
    _check_path(path)
    layout = layout_from_tensors(kv_num_blocks, kv_indices, q_num_blocks, q_indices, block_size)
    if path == "triton":
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        out, row_max, row_sum = block_sparse_forward(q, k, v, layout, causal=causal, scale=scale)
        return out, lse_from_stats(row_max, row_sum), row_max, row_sum
    out, lse = block_sparse_attention_torch(q, k, v, layout, causal=causal, scale=scale,
                                            compute_dtype=portable_compute_dtype(q.dtype, q.device))
    return _fresh(out), _fresh(lse), _empty_stats(q), _empty_stats(q)


@_block_sparse_fwd.register_fake
def _(q, k, v, kv_num_blocks, kv_indices, q_num_blocks, q_indices, block_size, causal, scale, need_lse, path):
    B, N, Hq, D = q.shape
    stats = N if path == "triton" else 0
    return (q.new_empty((B, N, Hq, D)), q.new_empty((B, Hq, N), dtype=torch.float32),
            q.new_empty((B, Hq, stats), dtype=torch.float32), q.new_empty((B, Hq, stats), dtype=torch.float32))


@torch.library.custom_op("triton_dilated::block_sparse_bwd", mutates_args=())
def _block_sparse_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                      row_max: Tensor, row_sum: Tensor, kv_num_blocks: Tensor, kv_indices: Tensor,
                      q_num_blocks: Tensor, q_indices: Tensor, block_size: int, causal: bool, scale: float,
                      path: str) -> Tuple[Tensor, Tensor, Tensor]:
    _check_path(path)
    layout = layout_from_tensors(kv_num_blocks, kv_indices, q_num_blocks, q_indices, block_size)
    if path == "triton":
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        dq, dk, dv = block_sparse_backward(do, dlse, q, k, v, out, row_max, row_sum, layout, causal=causal,
                                           scale=scale)
        return _fresh(dq), _fresh(dk), _fresh(dv)
    compute = portable_compute_dtype(q.dtype, q.device)
    with_lse = dlse is not None

    def fwd(q_, k_, v_):
        o, lse = block_sparse_attention_torch(q_, k_, v_, layout, causal=causal, scale=scale, compute_dtype=compute)
        return (o, lse) if with_lse else (o,)

    return _recompute_grads(fwd, (q, k, v), (do, dlse) if with_lse else (do,))


@_block_sparse_bwd.register_fake
def _(do, dlse, q, k, v, out, row_max, row_sum, kv_num_blocks, kv_indices, q_num_blocks, q_indices, block_size,
      causal, scale, path):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _block_sparse_setup(ctx, inputs, output):
    q, k, v, kv_num_blocks, kv_indices, q_num_blocks, q_indices, block_size, causal, scale, need_lse, path = inputs
    out, _, row_max, row_sum = output
    ctx.need_lse = need_lse
    ctx.save_for_backward(q, k, v, out, row_max, row_sum, kv_num_blocks, kv_indices, q_num_blocks, q_indices)
    ctx.mark_non_differentiable(row_max, row_sum)
    ctx.args = (block_size, causal, scale, path)


def _block_sparse_backward(ctx, do, dlse, _dmax, _dsum):
    q, k, v, out, row_max, row_sum, kv_num_blocks, kv_indices, q_num_blocks, q_indices = ctx.saved_tensors
    block_size, causal, scale, path = ctx.args
    if do is None:
        do = torch.zeros_like(out)
    if not ctx.need_lse:
        dlse = None   # the caller never saw lse: its gradient is the materialised zero
    dq, dk, dv = _block_sparse_bwd(do, dlse, q, k, v, out, row_max, row_sum, kv_num_blocks, kv_indices,
                                   q_num_blocks, q_indices, block_size, causal, scale, path)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_block_sparse_fwd.register_autograd(_block_sparse_backward, setup_context=_block_sparse_setup)


def block_sparse_attention_op(q, k, v, layout, *, causal=False, scale=None, return_lse=False, backend="auto"):
    """`triton_dilated.block_sparse_attention` through the `triton_dilated::block_sparse_fwd/_bwd`
    custom ops: same arguments and results, traceable by `torch.compile(fullgraph=True)`.
    Build the layout outside the compiled region (builders use data-dependent shapes)."""
    check_qkv(q, k, v)
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    check_flags(causal=causal, return_lse=return_lse)
    B, N, Hq, D = q.shape
    scale = check_scale(scale, D)
    path = _resolve_path(backend, str(q.device))
    if B == 0 or N == 0:
        return empty_result(q, k, v, return_lse)
    layout.check_seq_len(N)
    layout.check_heads(B, Hq)
    lists = [x.to(q.device) for x in (layout.kv_num_blocks, layout.kv_indices, layout.q_num_blocks, layout.q_indices)]
    out, lse, _, _ = _block_sparse_fwd(q, k, v, *lists, layout.block_size, causal, scale, return_lse, path)
    return (out, lse) if return_lse else out
