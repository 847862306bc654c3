"""The serve door of dilated attention: `dilated_attention_with_kvcache` (FlashAttention's
`flash_attn_with_kvcache` shape), the one entry point for queries at the end of a longer key
sequence, its custom op `triton_dilated::dilated_decode` (what torch.compile traces) and
`decode_table`, the decode step.

Routes (common/kvcache.serve_route): a decode step (up to 16 queries) reads only the keys
each query attends to (the Triton decode kernel, or the portable decode), with no host sync:
lengths stay a device tensor, every shape comes from the input shapes (the longest key list
from the cache's length), and value checks run only with validate=True. Chunked prefill (more
queries), and gradients on the Triton path, take the query-offset path
(common/query_offset.py): the training kernels on q padded in front, the Triton kernels
planning only the chunk's tiles (plan.QueryWindow: forward and dQ cost the chunk, dK/dV skip
the key tiles no chunk row reads), the portable path a full-length call; it reads the lengths
on the host once.

Per call (issue 35): `serve_plan` finds the call's ServePlan by its key (kvcache.serve_key) or
builds it, checking the arguments; a decode step on the Triton path then runs one append launch
and the planned decode launch (ServePlan.decode_step).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..common.kvcache import (FP8_DTYPE, MAX_DECODE_QUERIES, PlanCache, append_and_route, batch_rows_table, cache_view,
                              capacity, check_kvcache_args, contiguous_rows, kernel_lengths, lse_flag, plan_append,
                              rotary_plan, row_lengths, serve_key)
from ..common.context_parallel import DCP_PAGE_SIZE, dcp_attention
from ..common.masks import window_from_size
from ..common.op_support import lazy_module, resolve_path
from ..common.query_offset import run_with_query_offset
from ..common.runtime import empty_result
from ..common.varlen import is_varlen, serve_varlen
from .interface import DECODE_FAMILIES, _dilated_decode, check_args, decode_table, padded_call
from .patterns import head_table, warn_if_heads_first

_decode_kernels = lazy_module(__package__ + ".decode_kernels")   # imports triton


def dilated_attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None,
                                   segment_lengths, dilation_rates, causal=True, scale=None, mode="longnet",
                                   offsets="modulo", return_lse=False, backend="auto", validate=False,
                                   head_offset=0, total_heads=None, k_descale=None, v_descale=None, softcap=0.0,
                                   sinks=None, cache_batch_idx=None, cache_leftpad=None, return_softmax_lse=None,
                                   rotary_cos=None, rotary_sin=None, rotary_interleaved=True, cu_seqlens_q=None,
                                   max_seqlen_q=None, cu_seqlens_k_new=None,
                                   group=None, dcp_page_size=DCP_PAGE_SIZE, window_size=None):
    """Dilated attention of queries at the end of a KV cache: a decode step with no host sync,
    or chunked prefill.

    Args:
        q: (B, Nq, Hq, D), Nq >= 1: the last Nq positions of each row (query i of row b at
            L_b - Nq + i, L_b below). A row with L_b < Nq has its first queries before
            position 0: under causal they read no key (out 0, lse -inf); without causal their
            position is clamped at 0 (query i at max(L_b - Nq + i, 0)), so they read position
            0's keys, every key at dense settings (FlashAttention's rule; DESIGN §5b extended
            to patterns, whose key sets are functions of the position). Up to 16 queries (a
            decode step, a speculative draft) read only their keys, with no host sync; more
            (chunked prefill) read the lengths on the host once and run the training
            kernels on the chunk (Triton: forward and dQ cost the chunk's rows).
        k_cache, v_cache: (B, Nk, Hkv, D), Hq % Hkv == 0, q's dtype and device; Nk (the
            cache's capacity) bounds the key lists, so a static cache costs what its
            schedule reads, not Nk.
        k, v: None, or new rows (B, Nnew, Hkv, D), written into k_cache, v_cache in place at
            rows cache_seqlens[b] .. cache_seqlens[b] + Nnew - 1 before attending (as
            flash_attn_with_kvcache).
        cache_seqlens: int32 tensor (B,) on q's device: valid rows of each cache row before
            the call (FlashAttention's convention: the new rows not counted); the attention
            covers L_b = cache_seqlens[b] + Nnew rows. Not modified.
        block_table: None, or int32 (B, max_pages) on q's device for a paged cache: then
            k_cache, v_cache are page pools (num_pages, page_size, Hkv, D) shared by the
            rows, and position n of row b lives at row n % page_size of page
            block_table[b, n // page_size]; the capacity is max_pages * page_size. The
            result equals that of the same rows in a contiguous cache bit for bit.
        k_descale, v_descale: for an FP8 cache (k_cache, v_cache float8_e4m3fn, q 16- or
            32-bit), float32 tensors (Hkv,) on q's device, FlashAttention-3's names: the key
            (value) row h of a stored row is k_cache[..., h, :] * k_descale[h]. New rows k, v
            (q's dtype) are quantised on append: k / k_descale rounded to nearest-even,
            saturated to +-448 (choose k_descale >= max|k| / 448, e.g. amax / 448 per head
            from a calibration pass). None (the default) for a 16/32-bit cache.
        segment_lengths, dilation_rates, causal, scale, mode, offsets, return_lse, backend,
            head_offset, total_heads, softcap, sinks: as dilated_attention (causal defaults to
            True here; the sinks join each row's denominator after the kernel, on the device).
        validate: check that every L_b lies in [0, Nk] and a paged row's pages in the pool
            (reads the lengths on the host: a device sync; for debugging; chunked prefill
            always checks). Without it values are not checked on a decode step: an append
            outside [0, Nk) writes nothing, a key on a page outside the pool is not read.
        cache_batch_idx: None, or int32 (B,) on q's device (FlashAttention's): batch row b
            reads and writes row cache_batch_idx[b] of a contiguous cache (B_cache, Nk, Hkv,
            D), any B_cache; cache_seqlens, k, v, q stay indexed by b. An index outside
            [0, B_cache) reads and writes nothing (out 0, lse -inf; validate=True refuses it);
            two batch rows with one index both read it, and an append from either may land.
            Not with block_table (a paged cache maps rows there), as FlashAttention.
        cache_leftpad: None, or int32 (B,) on q's device (FlashAttention's): the first
            cache_leftpad[b] rows of cache row b are padding; its keys start at that row and
            positions (segments, residues, causality) count from it: the row holds
            L_b = cache_seqlens[b] + Nnew - cache_leftpad[b] keys, query i at L_b - Nq + i of
            them. cache_seqlens still counts from cache row 0 (new rows land at
            cache_seqlens[b], as FlashAttention). validate=True checks
            0 <= cache_leftpad[b] <= cache_seqlens[b]; without it a negative pad counts as 0.
            Also with block_table (FlashAttention refuses that pair): positions count from
            the pad in the row's paged positions.
        return_softmax_lse: FlashAttention's name for return_lse (either; both must agree).
        rotary_cos, rotary_sin, rotary_interleaved: FlashAttention's rotary embedding of q
            and the new rows k (only with k, v): float tables (seqlen_ro, rotary_dim / 2) on
            q's device, rotary_dim <= D even; new row j of batch row b rotated at position
            cache_seqlens[b] + j (its cache row, also under cache_leftpad, as FlashAttention),
            query i at cache_seqlens[b] + i when causal, every query at cache_seqlens[b]
            otherwise; pairs (2i, 2i+1) when rotary_interleaved (the default, as
            FlashAttention), else (i, i + rotary_dim / 2); float32, cast back, before an FP8
            cache quantises. On the Triton path without gradients fused into the append
            launch (it rotates k as it stores it and writes the rotated q; one compile per
            (rotary_dim, interleaved, causal)); otherwise (portable path, gradients, decode
            context parallelism, varlen) in PyTorch before the append, differentiable; the
            same float32 values either way. validate=True checks seqlen_ro covers every
            position (else the last row is read).
        cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new: varlen queries (FlashAttention-3's names;
            common/varlen.py): q packed (total_q, Hq, D), request b bringing the rows
            cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 (int32 (B + 1,) on q's device; n_b rows, 0
            allowed), aligned to the end of its row's keys (query i at L_b - n_b + i, causal
            bottom-right); max_seqlen_q a Python int >= every n_b (it fixes the shapes: no host
            sync; <= 16 takes the decode kernel, more the query-offset path). New rows k, v are
            packed too, (total_k_new, Hkv, D), request b's rows given by cu_seqlens_k_new (int32
            (B + 1,), FA3's convention, required with k): appended at cache_seqlens[b] + j, so
            L_b = cache_seqlens[b] + its new rows (- cache_leftpad[b]). Rotary positions as
            above per request. Returns out (total_q, Hq, D) and lse (Hq, total_q) (FA3's varlen
            layout). validate=True checks cu_seqlens (start 0, not decreasing, ending at the
            packed row counts) and max_seqlen_q.
        window_size: FlashAttention's (left, right), -1 for an unbounded side (None: no
            window): a causal sliding window on absolute positions, query at position p
            reading only the keys of its patterns at p - left .. p (under cache_leftpad,
            positions count from the pad). right > 0 (or -1 with left set) is refused, as on
            the training door (ops/common/masks.window_from_size: causal windows only; a
            window makes the call causal). The window only drops keys, so the decode kernel
            reads fewer of them; it is a run-time value there (one compile for every window)
            and part of the plan key. The result equals the last rows of
            dilated_attention(..., window_size=) over the row's keys.
        group, dcp_page_size: decode context parallelism (ops/common/context_parallel.py,
            docs/api.md): group a ProcessGroup or 1-D DeviceMesh of P ranks whose caches hold
            page j of every row on rank j % P: block_table then names, in column j, the page in
            its owner's pool (other ranks' columns are ignored; context_parallel.
            local_block_table, shard_paged_cache); a contiguous k_cache, v_cache is this rank's
            (B_cache, Nk_local, Hkv, D) shard of pages of dcp_page_size rows (default 64, a
            multiple of the largest dilation rate balances the key lists; shard_contiguous_cache),
            global capacity P * Nk_local. Each rank attends over its pages, one all-gather of
            (out, lse) merges them (sinks joined once, after). Every rank gets the whole result.
            Forward only, decode steps (Nq <= 16), validate=False; no host sync.

    Returns:
        out (B, Nq, Hq, D) like q, or (out, lse) with lse float32 (B, Hq, Nq) (varlen: out
        (total_q, Hq, D), lse (Hq, total_q)).
        Differentiable in eager mode (a decode step with gradients on the Triton path takes
        the training kernels: the decode kernel has no backward).

    Under torch.compile it runs as the custom ops `triton_dilated::append_kv` (in place) and
    `triton_dilated::dilated_decode` (either backend), so `torch.compile(fullgraph=True)` traces
    a decode step once for every value of cache_seqlens.

    Host time: what depends only on the schedule, the shapes, dtypes and devices and the
    keywords (the argument checks, the pattern and offset tables, the launch configuration) is
    checked and planned once per key (ServePlan, cached); a call then builds its key, appends
    (the Triton path: one fused kernel, rotary included) and launches.
    """
    return_lse = lse_flag(return_lse, return_softmax_lse)
    varlen = is_varlen(cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new)
    if window_size is not None and isinstance(causal, bool):
        # a window is causal (masks.window_from_size; its errors raised here): rotary and the
        # routes below see causal=True, as FlashAttention's local attention rotates each query
        # at its own position
        causal = window_from_size(window_size, causal)[0]
    if group is not None:
        return dcp_attention(dilated_attention_with_kvcache, q, k_cache, v_cache, k, v, group=group, varlen=varlen,
                             cache_seqlens=cache_seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx,
                             dcp_page_size=dcp_page_size, sinks=sinks, return_lse=return_lse, validate=validate,
                             who="dilated_attention_with_kvcache", segment_lengths=segment_lengths,
                             dilation_rates=dilation_rates, causal=causal, scale=scale, mode=mode, offsets=offsets,
                             backend=backend, head_offset=head_offset, total_heads=total_heads, k_descale=k_descale,
                             v_descale=v_descale, softcap=softcap, cache_leftpad=cache_leftpad, rotary_cos=rotary_cos,
                             rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, window_size=window_size)
    if varlen:
        door = functools.partial(dilated_attention_with_kvcache, segment_lengths=segment_lengths,
                                 dilation_rates=dilation_rates, scale=scale, mode=mode, offsets=offsets,
                                 backend=backend, head_offset=head_offset, total_heads=total_heads,
                                 k_descale=k_descale, v_descale=v_descale, softcap=softcap, sinks=sinks,
                                 window_size=window_size)
        return serve_varlen(door, q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, cu_seqlens_q=cu_seqlens_q,
                            max_seqlen_q=max_seqlen_q, cu_seqlens_k_new=cu_seqlens_k_new, rotary_cos=rotary_cos,
                            rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, causal=causal,
                            validate=validate, return_lse=return_lse, k_descale=k_descale, v_descale=v_descale)
    block_table = batch_rows_table(q, k_cache, block_table, cache_batch_idx, validate)
    q, k, rotary = rotary_plan(q, k, cache_seqlens, rotary_cos, rotary_sin, rotary_interleaved, causal, validate)
    args = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale, sinks)
    scalars = (causal, scale, mode, offsets, return_lse, backend, validate, head_offset, total_heads, softcap)
    return serve_plan(args, segment_lengths, dilation_rates, scalars, cache_leftpad, window_size)(
        *args, cache_leftpad=cache_leftpad, rotary=rotary)


def serve_plan(args, segment_lengths, dilation_rates, scalars, cache_leftpad=None, window_size=None) -> "ServePlan":
    """The ServePlan of a dilated_attention_with_kvcache call (args: its tensors, q to sinks;
    scalars: causal to softcap, in the door's order; cache_leftpad and window_size apart): from
    the cache when the call has a key, else built (and the arguments checked) for this call
    alone (under torch.compile: checked as traced). The window joins the key as a list (() for
    None: a pair of any other type has no key and is checked per call)."""
    key = None
    if not torch.compiler.is_compiling() and isinstance(args[0], torch.Tensor):
        window = () if window_size is None else window_size
        key = serve_key((*args, cache_leftpad), (segment_lengths, dilation_rates, window), scalars)
    build = lambda: ServePlan(*args, segment_lengths, dilation_rates, *scalars, cache_leftpad,  # noqa: E731
                              window_size)
    return build() if key is None else _PLANS.get(key, build)


_PLANS = PlanCache()


class ServePlan:
    """Everything a dilated serve call needs that depends only on its key (kvcache.serve_key:
    the schedule, keywords, and the shapes, dtypes and devices of its tensors): the checked
    patterns, AttentionCall and head slice, the path, the offset table and, on the Triton
    path, the decode launch (DecodeLaunch, planned at the first decode). Built by checking the
    arguments of a first call; `__call__` runs a call with the same key."""

    def __init__(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale, sinks,
                 segment_lengths, dilation_rates, causal, scale, mode, offsets, return_lse, backend, validate,
                 head_offset, total_heads, softcap, cache_leftpad=None, window_size=None):
        check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, block_table, validate, k_descale, v_descale,
                           cache_leftpad)
        B, Nq, Hq, D = q.shape
        self.patterns, call, self.heads = check_args(q, cache_view(k_cache, block_table, B, q),
                                                     cache_view(v_cache, block_table, B, q),
                                                     segment_lengths, dilation_rates, causal, scale, mode, offsets,
                                                     return_lse, softcap, sinks, allow_shorter_q=True,
                                                     head_offset=head_offset, total_heads=total_heads,
                                                     window_size=window_size, window_with_shorter_q=True)
        self.call = call.without_sinks()   # a call's sinks join at its end (finish)
        self.path = resolve_path(backend, str(q.device), DECODE_FAMILIES, D, q.dtype)
        self.mode, self.offsets, self.backend, self.return_lse, self.validate = mode, offsets, backend, return_lse, \
            validate
        self.num_new = 0 if k is None else k.shape[1]
        self.capacity = capacity(k_cache, block_table)
        self.fp8 = k_cache.dtype == FP8_DTYPE
        # the heads-first warning (patterns.warn_if_heads_first: check_args gave it to this first
        # call) is given to every later call with this key too
        self.heads_first = self.heads[1] > self.capacity > 0 and all(w >= self.capacity for w, _ in self.patterns)
        self.fresh = True
        self.table = None if torch.compiler.is_compiling() else head_table(Hq, self.patterns, mode, offsets,
                                                                           *self.heads)
        # decode_step: a decode step (serve_route) on the Triton path, values unchecked (gradients: per call)
        self.fast = self.path == "triton" and B > 0 and Nq <= MAX_DECODE_QUERIES and not validate
        self.append = self.launch = None

    def decode_step(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale, call,
                    byte_caches=None, leftpad=None, rotary=None):
        """(out, lse) of a decode step on the Triton path without gradients: the append (one
        kernel) and the decode launch, planned at the first step. One length tensor serves both
        kernels: the append writes at cache_seqlens, the decode reads cache_seqlens + Nnew rows
        (lens_add: no add op). byte_caches: an FP8 cache's (k, v) viewed as uint8, kept by their
        owner (PagedDilatedKVCache), which both kernels take without a view per call. leftpad:
        cache_leftpad (the decode kernel subtracts it from the lengths). rotary (kvcache.Rotary):
        the append launch also rotates k and writes the rotated q the decode reads."""
        lens = kernel_lengths(cache_seqlens, q.device)
        if self.launch is None:
            self.launch = _decode_kernels().DecodeLaunch(q, k_cache, self.patterns, self.table, call,
                                                        max_pages=0 if block_table is None else block_table.shape[1])
            self.append = None if k is None else plan_append(k_cache, k, block_table)
        if byte_caches is not None:
            k_cache, v_cache = byte_caches if self.launch.kv_fp8 == 2 else (k_cache, v_cache)
        else:
            byte_caches = (k_cache, v_cache)
        if k is not None:   # (the Triton path without gradients: append_kv's Triton append)
            q = self.append.run(*byte_caches, k, v, lens, block_table, k_descale, v_descale, q, rotary)
        return self.launch.run(q, k_cache, v_cache, lens, self.num_new, block_table, k_descale, v_descale,
                               None if leftpad is None else kernel_lengths(leftpad, q.device))

    def __call__(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale, sinks,
                 byte_caches=None, cache_leftpad=None, rotary=None):
        """The call (its tensors as the door takes them; byte_caches: decode_step's; rotary: the
        door's kvcache.Rotary, applied with the append)."""
        if self.heads_first and not self.fresh:
            warn_if_heads_first(self.patterns, self.capacity, self.heads[1])
        self.fresh = False
        call = self.call if sinks is None else dataclasses.replace(self.call, sinks=sinks)
        compiling = torch.compiler.is_compiling()
        if self.fast and not compiling and not (torch.is_grad_enabled() and (
                q.requires_grad or k_cache.requires_grad or v_cache.requires_grad or
                k is not None and (k.requires_grad or v.requires_grad))):
            return call.finish(self.decode_step(q, k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale,
                                                v_descale, call, byte_caches, cache_leftpad, rotary), self.return_lse)
        q, lengths, decodes = append_and_route(q, self.path, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                               self.validate, k_descale, v_descale, cache_leftpad, rotary)
        if q.shape[0] == 0:
            return call.finish(empty_result(q, *((q, q) if self.fp8 else (k_cache, v_cache)), True), self.return_lse)
        patterns, mode, offsets, heads = self.patterns, self.mode, self.offsets, self.heads
        if not decodes:
            rows = row_lengths(lengths, cache_leftpad)   # chunked prefill: one host read
            k_rows = contiguous_rows(k_cache, block_table, max(rows), q.dtype, k_descale, cache_leftpad)
            v_rows = contiguous_rows(v_cache, block_table, max(rows), q.dtype, v_descale, cache_leftpad)

            def chunk(qq, kk, vv, batch_rows, n, first_row):
                return padded_call(qq, kk, vv, first_row, patterns, call, mode=mode, offsets=offsets,
                                   backend=self.backend, heads=heads)

            out, lse = run_with_query_offset(chunk, q, k_rows, v_rows, rows, causal=call.causal)
        elif compiling:
            out, lse = _dilated_decode(q, k_cache, v_cache, lengths, block_table, [w for w, _ in patterns],
                                       [r for _, r in patterns], call.causal, call.scale, mode, offsets, *heads,
                                       self.path, k_descale, v_descale, call.softcap, cache_leftpad,
                                       call.window_keys)
        else:
            out, lse = decode_table(q, k_cache, v_cache, patterns, self.table, lengths, call, path=self.path,
                                    block_table=block_table, k_descale=k_descale, v_descale=v_descale,
                                    leftpad=cache_leftpad)
        return call.finish((out, lse), self.return_lse)
