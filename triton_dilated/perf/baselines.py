"""Baselines measured side by side with the kernels (DESIGN §11)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange


def sdpa_dense(q, k, v, causal: bool):
    """Dense scaled_dot_product_attention over the whole sequence (FlashAttention on a GPU)."""
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def head_group_loop(q, k, v, segment_lengths, dilation_rates, causal: bool):
    """The dilated-attention-pytorch family's loop: heads split into one group per pattern,
    einops rearrange -> stride -> SDPA -> scatter, per group. N must be a multiple of every
    segment length and H of the number of patterns. Their final `out / num_groups` is left
    out: it is a normalisation bug, not work (DESIGN §3, head_groups)."""
    b, n, h, d = q.shape
    m = len(segment_lengths)
    g = h // m
    out = torch.zeros_like(q)
    for i, (s, r) in enumerate(zip(segment_lengths, dilation_rates)):
        offset = i % r
        hmin, hmax = i * g, (i + 1) * g
        parts = [rearrange(x, "b (n s) h d -> b n s h d", s=s)[:, :, offset::r, hmin:hmax] for x in (q, k, v)]
        qs, ks, vs = (rearrange(x, "b n s h d -> (b n) h s d") for x in parts)
        x = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        x = rearrange(x, "(b n) h s d -> b n s h d", b=b)
        out_view = rearrange(out, "b (n s) h d -> b n s h d", s=s)
        out_view[:, :, offset::r, hmin:hmax] = x
    return out
