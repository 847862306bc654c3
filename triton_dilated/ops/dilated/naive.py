"""Float64 oracle for dilated attention, written literally from DESIGN §3 (LongNet §2.2-2.4).

Per pattern and head: gather the dilated rows of each segment, run dense attention among
them, scatter back; then mix the patterns by their softmax denominators (paper eq. 10),
which is one softmax over the multiset union of the patterns' keys. Slow and simple on
purpose: it is the reference every kernel is tested against, and users may test with it.
"""
from __future__ import annotations

import torch

from ..common import masks
from ..common.call import AttentionCall, check_sinks, check_softcap
from ..common.first_order import joined_to
from ..common.lse import add_sinks, masked_attention_with_lse, merge_partials
from ..common.validation import check_qkv, check_scale
from .patterns import check_head_slice, check_patterns, head_offsets, head_table


def dilated_attention_naive(q, k, v, segment_lengths, dilation_rates, *, causal=False, scale=None,
                            mode="longnet", offsets="modulo", head_offset=0, total_heads=None, softcap=0.0,
                            sinks=None, window_size=None):
    """Reference dilated attention in float64. Returns (out, lse): out (B, N, Hq, D) float64,
    lse (B, Hq, N) float64 (natural log; -inf for a query with no key). Differentiable.
    head_offset, total_heads: q holds the heads [head_offset, head_offset + Hq) of a call
    with total_heads heads (offsets by global head index), as in dilated_attention.
    softcap: scores s -> softcap * tanh(s / softcap) (0.0: no cap). sinks: (Hq,) logits (float32 or
    float64) joining each row's joint denominator once, after the patterns are mixed.
    window_size: FlashAttention's (left, right) (ops/common/masks.py window_from_size): each
    pattern's keys cut by the window's predicate on positions."""
    check_qkv(q, k, v, allow_float64=True)
    causal, window = masks.window_from_size(window_size, causal)
    softcap = check_softcap(softcap)
    sinks = check_sinks(sinks, q.shape[2], q.device, allow_float64=True)
    patterns = check_patterns(segment_lengths, dilation_rates, mode, offsets)
    B, N, Hq, D = q.shape
    Hkv = k.shape[2]
    call = AttentionCall(causal, check_scale(scale, D), softcap)
    table = head_table(Hq, patterns, mode, offsets, *check_head_slice(head_offset, total_heads, Hq, Hkv))
    q64, k64, v64 = q.double(), k.double(), v.double()

    head_outs, head_lses = [], []
    for h in range(Hq):
        kv_head = h // (Hq // Hkv)
        parts_out, parts_lse = [], []
        for (w, r), o in zip(patterns, table[h]):
            if o < 0:
                continue
            out_p = q64.new_zeros(B, N, D)
            lse_p = q64.new_full((B, N), float("-inf"))
            for s in range(0, N, w):
                rows = range(s + o, min(s + w, N), r)   # the dilated rows of this segment
                if len(rows) == 0:
                    continue
                idx = torch.tensor(rows, dtype=torch.long, device=q.device)
                keep = torch.ones(idx.numel(), idx.numel(), dtype=torch.bool, device=q.device)
                if causal:
                    keep = masks.causal(idx[:, None], idx[None, :])
                if window is not None:
                    keep = keep & window(idx[:, None], idx[None, :])
                o_seg, l_seg = masked_attention_with_lse(
                    q64[:, idx, h], k64[:, idx, kv_head], v64[:, idx, kv_head], keep, call)
                out_p = out_p.index_copy(1, idx, o_seg)
                lse_p = lse_p.index_copy(1, idx, l_seg)
            parts_out.append(out_p)
            parts_lse.append(lse_p)
        out_h, lse_h = merge_partials(parts_out, parts_lse) if len(parts_out) > 1 else (parts_out[0], parts_lse[0])
        head_outs.append(out_h.double())
        head_lses.append(lse_h.double())
    # joined: heads that read no key (a head slice past a short N) still take (zero) gradients
    out, lse = joined_to(torch.stack(head_outs, dim=2), q, k, v), joined_to(torch.stack(head_lses, dim=1), q, k, v)
    return (out, lse) if sinks is None else add_sinks(out, lse, sinks.double())


def pattern_multiplicity(q_pos, k_pos, patterns, table, *, causal=False) -> torch.Tensor:
    """(Hq, Nq, Nk) float64: how many of head h's patterns select the pair (query at q_pos[i],
    key at k_pos[j]) (DESIGN §3: a key two patterns select counts twice; 0: not computed).
    Positions are global (long or int tensors); `table` is head_offsets(Hq, patterns, ...)."""
    qp, kp = q_pos.long()[:, None], k_pos.long()[None, :]
    counts = torch.zeros(len(table), qp.shape[0], kp.shape[1], dtype=torch.float64, device=qp.device)
    for h, row in enumerate(table):
        for (w, r), o in zip(patterns, row):
            if o < 0:
                continue
            q_on = (qp - qp // w * w) % r == o
            k_on = (kp - kp // w * w) % r == o
            counts[h] += ((qp // w == kp // w) & q_on & k_on).double()
    if causal:
        counts *= masks.causal(qp, kp).double()
    return counts


def dilated_multiplicity(n, segment_lengths, dilation_rates, num_heads, *, causal=False, mode="longnet",
                         offsets="modulo") -> torch.Tensor:
    """(num_heads, N, N) float64 multiplicity matrix of a sequence of length n: the pairs each
    head's patterns compute and how often (pattern pictures, dense references). O(N^2)."""
    patterns = check_patterns(segment_lengths, dilation_rates, mode, offsets)
    table = head_offsets(num_heads, patterns, mode, offsets)
    pos = torch.arange(n)
    return pattern_multiplicity(pos, pos, patterns, table, causal=causal)
