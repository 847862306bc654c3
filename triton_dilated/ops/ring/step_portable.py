"""Portable PyTorch ring step (CPU without the interpreter, pre-Volta GPUs): the same
contract as step_kernels.py, with an explicit float32 (N_local x N_shard) score matrix per
step."""
from __future__ import annotations

import math

import torch

from ..dilated.naive import pattern_multiplicity
from .mask import MASK_DILATED, MASK_LAYOUT


def pair_log_weight(q_pos, k_pos, mask, num_heads, batch):
    """(B|1, Hq|1, Nq, Nk) ln(weight), -inf where a pair does not count."""
    qp, kp = q_pos.long()[:, None], k_pos.long()[None, :]
    ok = (kp <= qp) if mask.causal else torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool, device=qp.device)
    if mask.kind == MASK_DILATED:
        c = pattern_multiplicity(q_pos, k_pos, mask.patterns, mask.table, causal=mask.causal).float()[None]
        return torch.where(c > 0, torch.log(c.clamp_min(1.0)), torch.full_like(c, -math.inf))
    if mask.kind == MASK_LAYOUT:
        bs = mask.layout_block
        active = mask.layout[:, :, q_pos.long() // bs][:, :, :, k_pos.long() // bs].bool()
        ok = ok & active
    else:
        ok = ok[None, None]
    return torch.where(ok, 0.0, -math.inf)


def _scores(q, k, q_pos, k_pos, mask, scale):
    group = q.shape[2] // k.shape[2]
    kk = k.float().repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * scale
    return s + pair_log_weight(q_pos, k_pos, mask, q.shape[2], q.shape[0]), group


def step_forward(q, k, v, q_pos, k_pos, out, lse, mask, *, scale):
    s, group = _scores(q, k, q_pos, k_pos, mask, scale)
    lse_step = torch.logsumexp(s, dim=-1)                               # -inf rows stay -inf
    safe = torch.where(torch.isinf(lse_step), torch.zeros_like(lse_step), lse_step)
    p = torch.exp(s - safe[..., None])
    part = torch.einsum("bhqk,bkhd->bqhd", p, v.float().repeat_interleave(group, dim=2))
    top = torch.maximum(lse, lse_step)
    top_safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w_run, w_step = torch.exp(lse - top_safe), torch.exp(lse_step - top_safe)
    total = w_run + w_step
    total_safe = torch.where(total == 0, torch.ones_like(total), total)
    out.copy_((out * w_run.transpose(1, 2)[..., None] + part * w_step.transpose(1, 2)[..., None])
              / total_safe.transpose(1, 2)[..., None])
    lse.copy_(torch.where(total == 0, torch.full_like(total, -math.inf), top_safe + torch.log(total_safe)))


def step_backward(q, k, v, do, lse, delta, q_pos, k_pos, dq, dk, dv, mask, *, scale):
    s, group = _scores(q, k, q_pos, k_pos, mask, scale)
    row = torch.where(torch.isinf(lse), torch.full_like(lse, math.inf), lse)
    p = torch.exp(s - row[..., None])                                   # (B, H, Nq, Nk)
    vv = v.float().repeat_interleave(group, dim=2)
    dp = torch.einsum("bqhd,bkhd->bhqk", do.float(), vv)
    ds = p * (dp - delta[..., None])
    dq += torch.einsum("bhqk,bkhd->bqhd", ds, k.float().repeat_interleave(group, dim=2)) * scale
    B, NK, Hkv, D = k.shape
    dk += (torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * scale).view(B, NK, Hkv, group, D).sum(3)
    dv += torch.einsum("bhqk,bqhd->bkhd", p, do.float()).view(B, NK, Hkv, group, D).sum(3)
