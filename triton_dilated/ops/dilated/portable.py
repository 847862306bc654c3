"""Portable PyTorch dilated attention (the CPU path and the main baseline).

Per pattern (w, r) and per group of heads sharing an offset o, the dilated rows
`s + o + r*i` of every full segment are one strided view of the input,
x[:, :N_full].unflatten(1, (N_full // w, w))[:, :, o::r], plus one view for the short
last segment. Those go through ops.common.lse.attention_with_lse (causal inside the
dilated rows is causal in positions; PyTorch's fused CPU kernel, or a chunked explicit
float32 softmax for large scores), with a differentiable lse when a head mixes patterns
or the caller wants it. Patterns are mixed by a float32 lse merge. Memory is O(N*D) per
pattern plus bounded score chunks, never O(N^2) or O(N*w/r).

The views are taken and written back by two small autograd functions rather than by
plain slicing: autograd's own backward of a slice (and of a write into a slice) builds a
full-size zero tensor per view, so every pattern would cost three full-size fills and
sums per input. Here each input gets one gradient buffer that every view adds into
(fwd+bwd ~15% faster on CPU than the slicing loop of the dilated-attention-pytorch family).

The NaN rule (DESIGN §6) costs one pass over k and one over the results, not an isfinite
scan of every input (see dilated_attention_torch); the score bound of the fused kernel's
backward is computed only when a gradient is needed (ops.common.lse).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..common import masks
from ..common.first_order import first_order_inputs, joined_to, needs_grad
from ..common.lse import all_finite, attention_with_lse, merge_partials


def _head_index(heads: list[int]):
    """A slice when `heads` is an arithmetic progression (a view), else an index tensor."""
    if len(heads) == 1:
        return slice(heads[0], heads[0] + 1)
    step = heads[1] - heads[0]
    if step > 0 and all(b - a == step for a, b in zip(heads, heads[1:])):
        return slice(heads[0], heads[-1] + 1, step)
    return torch.tensor(heads)


class _Rows(NamedTuple):
    """The dilated rows of pattern (w, r) at offset o, for the full segments or for the
    short last one (tail), of some heads, in the (batch, head, row) layout of the attention
    calls: x (B, N, H, ...) -> (B * nseg, Hs, L, ...)."""
    w: int
    r: int
    o: int
    tail: bool
    heads: slice | torch.Tensor

    def _segments(self, n: int):
        """(first row, number of segments, rows per segment) of these rows in a length-n x."""
        n_full = (n // self.w) * self.w
        return (n_full, 1, n - n_full) if self.tail else (0, n_full // self.w, self.w)

    def rows(self, x):
        """All heads of these rows: (B, nseg, L, H, ...), a view. Whole-range slices are skipped."""
        first, nseg, seg = self._segments(x.shape[1])
        y = (x if first == 0 and nseg * seg == x.shape[1] else x[:, first:first + nseg * seg]).unflatten(1, (nseg, seg))
        return y[:, :, self.o::self.r] if self.r > 1 else y

    def view(self, x):
        """x at these rows and heads as (B, nseg, Hs, L, ...): a view, or a copy for an
        irregular head list. A regular one is one as_strided call (the chain of slices it
        replaces costs ~10 small tensor ops per input per job: most of the per-call overhead
        at N = 1K). Slicing is kept where autograd records the view (double backward)."""
        if not isinstance(self.heads, slice):
            return self.rows(x).index_select(3, self.heads.to(x.device)).transpose(2, 3)
        if torch.is_grad_enabled() and x.requires_grad:
            return self.rows(x)[:, :, :, self.heads].transpose(2, 3)
        first, nseg, seg = self._segments(x.shape[1])
        h0, _, step = self.heads.indices(x.shape[2])
        stride = x.stride()
        size = (x.shape[0], nseg, len(range(*self.heads.indices(x.shape[2]))), len(range(self.o, seg, self.r)),
                *x.shape[3:])
        return x.as_strided(size, (stride[0], self.w * stride[1], step * stride[2], self.r * stride[1], *stride[3:]),
                            x.storage_offset() + (first + self.o) * stride[1] + h0 * stride[2])

    def take(self, x):
        """(B * nseg, Hs, L, ...): a view where the batch and segment dims merge, else a copy."""
        return self.view(x).flatten(0, 1)

    def put(self, buf, value):
        """buf[these rows and heads] = value ((B * nseg, Hs, L, ...), any strides)."""
        value = value.unflatten(0, (buf.shape[0], -1))
        if isinstance(self.heads, slice):
            self.view(buf).copy_(value)
        else:
            self.rows(buf)[:, :, :, self.heads.to(buf.device)] = value.transpose(2, 3)

    def add_into(self, buf, value):
        """buf[these rows and heads] += value (repeated heads accumulate)."""
        value = value.unflatten(0, (buf.shape[0], -1))
        if isinstance(self.heads, slice):
            self.view(buf).add_(value)
        else:
            self.rows(buf).index_add_(3, self.heads.to(buf.device), value.transpose(2, 3))


def _row_specs(N: int, w: int, r: int, o: int, heads) -> list[_Rows]:
    """The non-empty row sets of a pattern at offset o: full segments, then the tail."""
    n_full = (N // w) * w
    specs = []
    if n_full > 0 and o < w:
        specs.append(_Rows(w, r, o, False, heads))
    if n_full < N and o < N - n_full:
        specs.append(_Rows(w, r, o, True, heads))
    return specs


@functools.lru_cache(maxsize=256)
def _plan(N: int, patterns: tuple, table: tuple, group: int, merge: bool):
    """One job per (pattern, offset, full segments | tail): (output buffer, query rows, key
    rows). Without mixing, every head writes its one pattern into one shared output (buffer
    0); with mixing, pattern i into buffer i. Cached: planning is Python work of the order
    of a small attention call."""
    jobs = []
    for i, (w, r) in enumerate(patterns):
        by_offset: dict[int, list[int]] = {}
        for h, row in enumerate(table):
            if row[i] >= 0:
                by_offset.setdefault(row[i], []).append(h)
        for o, heads in by_offset.items():
            kv_heads = _head_index([h // group for h in heads])
            for spec in _row_specs(N, w, r, o, _head_index(heads)):
                jobs.append((i if merge else 0, spec, spec._replace(heads=kv_heads)))
    return tuple(jobs)


class _GatherRows(torch.autograd.Function):
    """x -> (spec.take(x) for spec in specs); backward adds every view's gradient into one
    buffer (one fill per input instead of one per view)."""

    @staticmethod
    def forward(ctx, x, specs):
        ctx.specs, ctx.shape = specs, x.shape
        ctx.set_materialize_grads(False)
        return tuple(spec.take(x) for spec in specs)

    @staticmethod
    def backward(ctx, *grads):
        present = [g for g in grads if g is not None]
        if not present:
            return None, None
        buf = present[0].new_zeros(ctx.shape)
        for spec, g in zip(ctx.specs, grads):
            if g is not None:
                spec.add_into(buf, g)
        return buf, None


class _ScatterRows(torch.autograd.Function):
    """Writes parts[i] at specs[i] (specs do not overlap) into the caller's buffer and
    returns it; backward hands each part its view of the gradient. The buffer comes in a
    list so that autograd does not take it for an input: the caller allocates it before
    the attention calls, because allocated after them it tends to land on fresh pages
    (~1 ms of page faults per call at N=2048 on CPU, measured)."""

    @staticmethod
    def forward(ctx, holder, specs, *parts):
        (buf,) = holder
        ctx.specs, ctx.part_dtypes = specs, [p.dtype for p in parts]
        for spec, part in zip(specs, parts):
            spec.put(buf, part.to(buf.dtype))
        return buf

    @staticmethod
    def backward(ctx, grad):
        return (None, None) + tuple(spec.take(grad).to(dt) for spec, dt in zip(ctx.specs, ctx.part_dtypes))


def _gather(x, specs):
    """spec.take(x) for each spec; through _GatherRows only when x needs a gradient."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _GatherRows.apply(x, specs)
    return tuple(spec.take(x) for spec in specs)


def _scatter(buf, specs, parts):
    """buf with parts written at specs, differentiable in the parts when they need it."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
        return _ScatterRows.apply([buf], specs, *parts)
    for spec, part in zip(specs, parts):
        spec.put(buf, part.to(buf.dtype))
    return buf


def _window_band(rows: int, r: int, window, device):
    """bool (rows, rows): the sliding window among one segment's dilated rows (row i at
    position s + o + r*i): key row j kept iff 0 <= r*(i - j) < window, a causal band of
    (window - 1) // r + 1 rows in row space."""
    i = torch.arange(rows, device=device)
    return (masks.causal & masks.Band((window.window - 1) // r, 0))(i[:, None], i[None, :])


def dilated_attention_torch(q, k, v, patterns, table, call, *, need_lse: bool, compute_dtype=None):
    """Portable dilated attention on validated inputs. `patterns`: tuple of (w, r);
    `table`: per query head a tuple of offsets (-1: pattern unused); call: the AttentionCall
    (its sinks are the caller's). Returns (out, lse): out like q (contiguous), lse float32
    (B, Hq, N) or None."""
    B, N, Hq, D = q.shape
    compute_dtype = compute_dtype or q.dtype
    q, k, v = first_order_inputs("dilated_attention (portable backend)", q, k, v)
    merge = max(sum(o >= 0 for o in row) for row in table) > 1  # some head mixes patterns
    want_lse = need_lse or merge
    acc_dtype = torch.promote_types(q.dtype, torch.float32)

    # Without mixing, every head writes its one pattern into one shared output; with
    # mixing, each pattern gets its own float32 (out, lse), merged at the end.
    jobs = _plan(N, tuple(patterns), tuple(table), Hq // k.shape[2], merge)
    q_parts, k_parts, v_parts = (_gather(x, tuple(j[n] for j in jobs)) for x, n in ((q, 1), (k, 2), (v, 2)))
    n_bufs = len(patterns) if merge else 1
    out_bufs = [q.new_zeros((B, N, Hq, D), dtype=acc_dtype if merge else q.dtype) for _ in range(n_bufs)]
    lse_bufs = [q.new_full((B, N, Hq, 1), float("-inf"), dtype=acc_dtype) for _ in range(n_bufs if want_lse else 0)]
    grad = needs_grad(q, k, v)
    cast = (lambda x: x) if compute_dtype == q.dtype else (lambda x: x.to(compute_dtype))  # noqa: E731

    def run(verify: bool):
        """(outs, lses) of all jobs; None when verify finds that q or v was not finite.
        verify=False: each job applies the NaN rule itself (ops.common.lse)."""
        results = []
        for n, (b, spec, _) in enumerate(jobs):
            # (B * nseg, Hs, L, D) each; causal inside the dilated rows is causal in positions
            band = None if call.window is None else _window_band(q_parts[n].shape[-2], spec.r, call.window, q.device)
            out_part, lse_part = attention_with_lse(cast(q_parts[n]), cast(k_parts[n]), cast(v_parts[n]), call,
                                                    keep=band, need_lse=want_lse or verify, finite=verify,
                                                    causal=None if band is None else False)   # band: causal too
            if verify and not all_finite(lse_part, out_part):
                return None
            if lse_part is not None:
                lse_part = lse_part.unsqueeze(-1)
            if grad:
                results.append((out_part, lse_part))
            else:   # into its buffer at once: one job's result alive at a time (its pages reused)
                spec.put(out_bufs[b], out_part.to(out_bufs[b].dtype))
                if want_lse:
                    spec.put(lse_bufs[b], lse_part)
        if not grad:
            return out_bufs, [x.squeeze(-1) for x in lse_bufs]
        outs, lses = [], []
        for b in range(n_bufs):
            mine = [n for n, job in enumerate(jobs) if job[0] == b]
            specs = tuple(jobs[n][1] for n in mine)
            outs.append(_scatter(out_bufs[b], specs, [results[n][0] for n in mine]))
            if want_lse:
                lses.append(_scatter(lse_bufs[b], specs, [results[n][1] for n in mine]).squeeze(-1))
        return outs, lses

    # NaN rule (DESIGN §6) without a pass over every input. With k finite, the jobs run on the
    # fused kernel unchecked and verify their results: every row of a job has a key (causal
    # keeps the diagonal), so a non-finite q row makes all its scores non-finite and its lse
    # NaN or -inf; a non-finite v row read with any weight (0 * Inf is NaN) makes the output
    # non-finite. k is checked first: an Inf key can score -inf and drop out with a finite
    # result. A failed check (or a non-finite k) runs the exact rule, job by job. The checks
    # read each job's results where the fused kernel wrote them (contiguous, still in cache).
    done = run(verify=True) if all_finite(k) else None
    outs, lses = done if done is not None else run(verify=False)
    if merge:
        out, lse = merge_partials(outs, lses)
    else:
        out, lse = outs[0], (lses[0] if want_lse else None)
    out = joined_to(out.to(q.dtype), q, k, v)   # no job at all (a head slice past a short N): zero gradients
    return out, (joined_to(lse.permute(0, 2, 1).contiguous(), q, k, v) if need_lse else None)
