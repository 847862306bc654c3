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

from typing import NamedTuple

import torch

from ..common.first_order import first_order_inputs, needs_grad
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
    short last one (tail), of some heads: x (B, N, H, ...) -> (B, nseg, L, Hs, ...)."""
    w: int
    r: int
    o: int
    tail: bool
    heads: slice | torch.Tensor

    def rows(self, x):
        """All heads of these rows: a view. Whole-range slices are skipped (cheaper)."""
        n_full = (x.shape[1] // self.w) * self.w
        if self.tail:
            y = x[:, n_full:].unsqueeze(1)
        else:
            y = (x if n_full == x.shape[1] else x[:, :n_full]).unflatten(1, (n_full // self.w, self.w))
        return y[:, :, self.o::self.r] if self.r > 1 else y

    def take(self, x):
        """x at these rows and heads: a view, or a copy for an irregular head list."""
        if isinstance(self.heads, slice):
            return self.rows(x)[:, :, :, self.heads]
        return self.rows(x).index_select(3, self.heads.to(x.device))

    def add_into(self, buf, value):
        """buf[these rows and heads] += value (repeated heads accumulate)."""
        if isinstance(self.heads, slice):
            self.rows(buf)[:, :, :, self.heads].add_(value)
        else:
            self.rows(buf).index_add_(3, self.heads.to(buf.device), value)

    def put(self, buf, value):
        """buf[these rows and heads] = value."""
        if isinstance(self.heads, slice):
            self.rows(buf)[:, :, :, self.heads] = value
        else:
            self.rows(buf)[:, :, :, self.heads.to(buf.device)] = value


def _row_specs(N: int, w: int, r: int, o: int, heads) -> list[_Rows]:
    """The non-empty row sets of a pattern at offset o: full segments, then the tail."""
    n_full = (N // w) * w
    specs = []
    if n_full > 0 and o < w:
        specs.append(_Rows(w, r, o, False, heads))
    if n_full < N and o < N - n_full:
        specs.append(_Rows(w, r, o, True, heads))
    return specs


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


def _attend(qs, ks, vs, causal: bool, scale: float, need_lse: bool, compute_dtype, finite: bool):
    """qs: (B, nseg, L, Hs, D), ks/vs: (B, nseg, L, Hs, D). Returns out (same layout) and
    lse (B, nseg, L, Hs, 1) or None."""
    B, nseg, L, Hs, D = qs.shape
    to_bhld = lambda x: x.permute(0, 1, 3, 2, 4).reshape(B * nseg, Hs, L, D)  # noqa: E731
    qb, kb, vb = (to_bhld(x).to(compute_dtype) for x in (qs, ks, vs))
    out, lse = attention_with_lse(qb, kb, vb, causal, scale, need_lse=need_lse, finite=finite)
    if need_lse:
        lse = lse.reshape(B, nseg, Hs, L).transpose(2, 3).unsqueeze(-1)
    return out.reshape(B, nseg, Hs, L, D).permute(0, 1, 3, 2, 4), lse


def dilated_attention_torch(q, k, v, patterns, table, *, causal: bool, scale: float,
                            need_lse: bool, compute_dtype=None):
    """Portable dilated attention on validated inputs. `patterns`: tuple of (w, r);
    `table`: per query head a tuple of offsets (-1: pattern unused). Returns (out, lse):
    out like q (contiguous), lse float32 (B, Hq, N) or None."""
    B, N, Hq, D = q.shape
    group = Hq // k.shape[2]
    compute_dtype = compute_dtype or q.dtype
    q, k, v = first_order_inputs("dilated_attention (portable backend)", q, k, v)
    merge = max(sum(o >= 0 for o in row) for row in table) > 1  # some head mixes patterns
    want_lse = need_lse or merge
    acc_dtype = torch.promote_types(q.dtype, torch.float32)

    # One job per (pattern, offset, full segments | tail): query rows and key rows.
    # Without mixing, every head writes its one pattern into one shared output; with
    # mixing, each pattern gets its own float32 (out, lse), merged at the end.
    jobs: list[tuple[int, _Rows, _Rows]] = []
    for i, (w, r) in enumerate(patterns):
        by_offset: dict[int, list[int]] = {}
        for h, row in enumerate(table):
            if row[i] >= 0:
                by_offset.setdefault(row[i], []).append(h)
        for o, heads in by_offset.items():
            kv_heads = _head_index([h // group for h in heads])
            for spec in _row_specs(N, w, r, o, _head_index(heads)):
                jobs.append((i if merge else 0, spec, spec._replace(heads=kv_heads)))
    q_parts, k_parts, v_parts = (_gather(x, tuple(j[n] for j in jobs)) for x, n in ((q, 1), (k, 2), (v, 2)))
    n_bufs = len(patterns) if merge else 1
    out_bufs = [q.new_zeros((B, N, Hq, D), dtype=acc_dtype if merge else q.dtype) for _ in range(n_bufs)]
    lse_bufs = [q.new_full((B, N, Hq, 1), float("-inf"), dtype=acc_dtype) for _ in range(n_bufs if want_lse else 0)]
    grad = needs_grad(q, k, v)

    def run(verify: bool):
        """(outs, lses) of all jobs; None when verify finds that q or v was not finite.
        verify=False: each job applies the NaN rule itself (ops.common.lse)."""
        results = []
        for n, (b, spec, _) in enumerate(jobs):
            out_part, lse_part = _attend(q_parts[n], k_parts[n], v_parts[n], causal, scale, want_lse or verify,
                                         compute_dtype, finite=verify)
            if verify and not all_finite(lse_part, out_part):
                return None
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
    # result. A failed check (or a non-finite k) runs the exact rule, job by job.
    done = run(verify=True) if all_finite(k) else None
    outs, lses = done if done is not None else run(verify=False)
    if merge:
        out, lse = merge_partials(outs, lses)
    else:
        out, lse = outs[0], (lses[0] if want_lse else None)
    out = out.to(q.dtype)
    return out, (lse.permute(0, 2, 1).contiguous() if need_lse else None)
