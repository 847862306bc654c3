"""Float64 oracle for block-sparse attention (DESIGN §4): exact softmax over every key of
the active blocks of a row (and p' <= p when causal), built from the dense element mask.
O(N^2) memory: for tests and small inputs."""
from __future__ import annotations

import torch

from ..common.call import AttentionCall, check_sinks, check_softcap
from ..common.lse import add_sinks, masked_attention_with_lse
from ..common.validation import check_qkv, check_scale
from ..common.masks import check_window_causal
from .layout import BlockLayout


def element_mask(layout: BlockLayout, seq_len: int, causal: bool) -> torch.Tensor:
    """bool (B|1, H|1, N, N): the (query, key) pairs the layout computes (its active blocks,
    p' <= p when causal, and a sliding window's predicate in its window blocks:
    BlockLayout.element_mask)."""
    return layout.element_mask(seq_len, causal)


def block_sparse_attention_naive(q, k, v, layout: BlockLayout, *, causal=False, scale=None, softcap=0.0,
                                 sinks=None):
    """Reference block-sparse attention in float64: (out (B, N, Hq, D), lse (B, Hq, N));
    rows with no key give 0 and -inf. Differentiable. A sliding-window layout's predicate applies
    in its window blocks (causal=True required). softcap: scores s -> softcap *
    tanh(s / softcap) (0.0: no cap); sinks: (Hq,) logits (float32 or float64) joining each row's
    denominator (a row with no key then gets 0 and lse = its sink)."""
    check_qkv(q, k, v, allow_float64=True)
    check_window_causal(layout, causal)
    softcap = check_softcap(softcap)
    sinks = check_sinks(sinks, q.shape[2], q.device, allow_float64=True)
    B, N, Hq, D = q.shape
    layout.check_seq_len(N)
    layout.check_heads(B, Hq)
    scale = check_scale(scale, D)
    group = Hq // k.shape[2]
    q64 = q.double().transpose(1, 2)
    k64 = k.double().repeat_interleave(group, dim=2).transpose(1, 2)
    v64 = v.double().repeat_interleave(group, dim=2).transpose(1, 2)
    mask = element_mask(layout.to(q.device), N, causal)
    out, lse = masked_attention_with_lse(q64, k64, v64, mask, AttentionCall(causal, scale, softcap))
    out = out.transpose(1, 2)
    return (out, lse) if sinks is None else add_sinks(out, lse, sinks.double())
