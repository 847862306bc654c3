"""A transcription of dilated-attention-pytorch's `DilatedAttention` and
`MultiheadDilatedAttention` (github.com/fkodom/dilated-attention-pytorch,
dilated_attention_pytorch/dilated_attention.py, commit 87cda75), for tests/modules/test_compat.py.

Written from that file, not from triton_dilated: the same head slices, `rearrange`
patterns, offsets and the two normalisations (each group's output divided by its sum over
segments and rows, then the total by the number of groups). The one substitution is
`xformers.ops.memory_efficient_attention` (not installed here): `_memory_efficient_attention`
below is its documented definition, softmax(q k^T / sqrt(d)) v on (b, n, h, d) tensors, with
`LowerTriangularMask` as the causal mask. As in that library, `softmax_scale` and
`attention_dropout` are stored and never used, and `op` is dropped (an xformers choice of
kernel).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
from einops import rearrange
from torch import Tensor, nn


def _memory_efficient_attention(query: Tensor, key: Tensor, value: Tensor, causal: bool) -> Tensor:
    """xformers.ops.memory_efficient_attention(query, key, value, attn_bias=LowerTriangularMask()
    if causal else None) on (b, n, h, d) inputs: scale 1/sqrt(d), softmax over keys."""
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))       # (b, h, n, d)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        n_q, n_k = scores.shape[-2:]
        upper = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(upper, float("-inf"))
    return (scores.softmax(dim=-1) @ v).transpose(1, 2)


class DilatedAttention(nn.Module):
    def __init__(self, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
                 softmax_scale: Optional[float] = None, attention_dropout: float = 0.0):
        super().__init__()
        if len(segment_lengths) != len(dilation_rates):
            raise ValueError("segment_lengths and dilation_rates must have the same length")
        self.segment_lengths = segment_lengths
        self.dilation_rates = dilation_rates
        self.softmax_scale = softmax_scale
        self.dropout_p = attention_dropout

    def forward(self, query: Tensor, key: Tensor, value: Tensor, is_causal: bool = False) -> Tensor:
        b, _, h, _ = query.shape
        out = torch.zeros_like(query)

        num_groups = len(self.dilation_rates)
        group_sizes = [h // num_groups] * num_groups
        for i in range(h % num_groups):
            group_sizes[i] += 1

        for i, (g, r, s) in enumerate(zip(group_sizes, self.dilation_rates, self.segment_lengths)):
            q = rearrange(query, "b (n s) h d -> b n s h d", s=s)
            k = rearrange(key, "b (n s) h d -> b n s h d", s=s)
            v = rearrange(value, "b (n s) h d -> b n s h d", s=s)
            offset = i % r
            hmin = i * g
            hmax = (i + 1) * g
            q = q[:, :, offset::r, hmin:hmax, :]
            k = k[:, :, offset::r, hmin:hmax, :]
            v = v[:, :, offset::r, hmin:hmax, :]
            q = rearrange(q, "b n s h d -> (b n) s h d")
            k = rearrange(k, "b n s h d -> (b n) s h d")
            v = rearrange(v, "b n s h d -> (b n) s h d")

            x = _memory_efficient_attention(q, k, v, is_causal)
            x = rearrange(x, "(b n) s h d -> b n s h d", b=b)
            # normalise each group's output over the sequence (segments n and rows s)
            x = x / x.sum(dim=(1, 2), keepdim=True)

            out = rearrange(out, "b (n s) h d -> b n s h d", s=s)
            out[:, :, offset::r, hmin:hmax, :] += x
            out = rearrange(out, "b n s h d -> b (n s) h d", s=s)

        return out / num_groups


class MultiheadDilatedAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, dilation_rates: Sequence[int], segment_lengths: Sequence[int],
                 dropout: float = 0.0, bias: bool = True, layer_norm: bool = True, layer_norm_eps: float = 1e-5,
                 gamma_init: float = 1.0, device: Optional[Union[torch.device, str]] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.num_heads = num_heads
        self.layer_norm = layer_norm
        self.gamma_init = gamma_init

        if not embed_dim % self.num_heads == 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        num_dilations = len(dilation_rates)
        num_segments = len(segment_lengths)
        if num_dilations != num_segments:
            raise ValueError(f"len(dilation_rates) ({num_dilations}) must be equal to "
                             f"len(segment_lengths) ({num_segments})")
        head_dim = embed_dim // num_heads
        if not head_dim % 8 == 0:
            raise ValueError(f"head_dim (embed_dim / num_heads = {head_dim}) must be divisible by 8")
        if not head_dim <= 128:
            raise ValueError(f"head_dim (embed_dim / num_heads = {head_dim}) must be <= 128")

        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.attention = DilatedAttention(segment_lengths=segment_lengths, dilation_rates=dilation_rates,
                                          attention_dropout=dropout)
        self.norm: Optional[nn.LayerNorm] = None
        if layer_norm:
            self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, device=device, dtype=dtype)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self._reset_parameters()

    def _reset_parameters(self):
        nn.init.xavier_normal_(self.q_proj.weight)
        if self.q_proj.bias is not None:
            nn.init.constant_(self.q_proj.bias, 0)
        nn.init.xavier_normal_(self.k_proj.weight)
        if self.k_proj.bias is not None:
            nn.init.constant_(self.k_proj.bias, 0)
        nn.init.xavier_normal_(self.v_proj.weight, gain=self.gamma_init)
        if self.v_proj.bias is not None:
            nn.init.constant_(self.v_proj.bias, 0)
        nn.init.xavier_normal_(self.out_proj.weight, gain=self.gamma_init)
        if self.out_proj.bias is not None:
            nn.init.constant_(self.out_proj.bias, 0)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, is_causal: bool = False) -> Tuple[Tensor, None]:
        q = self.q_proj(query)
        k = self.k_proj(key)
        v = self.v_proj(value)
        q = rearrange(q, "b n (h d) -> b n h d", h=self.num_heads)
        k = rearrange(k, "b n (h d) -> b n h d", h=self.num_heads)
        v = rearrange(v, "b n (h d) -> b n h d", h=self.num_heads)
        x = self.attention(q, k, v, is_causal=is_causal)
        x = rearrange(x, "b n h d -> b n (h d)")
        if self.layer_norm:
            assert self.norm is not None
            x = self.norm(x)
        x = self.out_proj(x)
        return x, None
