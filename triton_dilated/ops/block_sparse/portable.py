"""Portable PyTorch block-sparse attention: for each query block, its active key blocks are
gathered into one batch and attended to under a keep-mask, lse included (PyTorch's fused
CPU kernel on CPU, an explicit float32 softmax elsewhere: ops.common.lse).
Query blocks go in chunks so the gathered keys stay under a memory budget; nothing of size
N x N is built."""
from __future__ import annotations

import torch

from ..common.lse import attention_with_lse

GATHER_BUDGET = 1 << 25   # elements of gathered keys per chunk


def block_sparse_attention_torch(q, k, v, layout, *, causal: bool, scale: float, compute_dtype=None):
    """Validated inputs; returns (out like q, lse float32 (B, Hq, N))."""
    B, N, Hq, D = q.shape
    Hkv = k.shape[2]
    bs, nb = layout.block_size, layout.n_q_blocks
    compute = compute_dtype or q.dtype
    pad = nb * bs - N
    as_blocks = lambda x: torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).unflatten(1, (nb, bs))  # noqa: E731
    qb, kb, vb = as_blocks(q), as_blocks(k), as_blocks(v)            # (B, nb, bs, H, D)
    counts = layout.kv_num_blocks.to(q.device).expand(B, Hq, nb)
    index = layout.kv_indices.to(q.device).long().expand(B, Hq, nb, -1)
    width = index.shape[-1]
    kv_head = torch.arange(Hq, device=q.device) // (Hq // Hkv)
    pos = torch.arange(nb * bs, device=q.device).view(nb, bs)
    chunk = max(1, GATHER_BUDGET // max(1, B * Hq * width * bs * D))

    outs, lses = [], []
    for start in range(0, nb, chunk):
        rows = slice(start, min(nb, start + chunk))
        idx = index[:, :, rows]                                        # (B, Hq, C, W)
        bi = torch.arange(B, device=q.device).view(B, 1, 1, 1)
        hi = kv_head.view(1, Hq, 1, 1)
        # gathered keys/values: (B, Hq, C, W, bs, D) -> (B, Hq, C, W*bs, D)
        kg = kb[bi, idx, :, hi].flatten(3, 4).to(compute)
        vg = vb[bi, idx, :, hi].flatten(3, 4).to(compute)
        qc = qb[:, rows].permute(0, 3, 1, 2, 4).to(compute)             # (B, Hq, C, bs, D)
        kpos = pos[idx].flatten(3, 4)                                   # (B, Hq, C, W*bs)
        slot_ok = (torch.arange(width, device=q.device) < counts[:, :, rows, None]).repeat_interleave(bs, dim=-1)
        keep = (slot_ok & (kpos < N)).unsqueeze(-2)                     # (B, Hq, C, 1, W*bs)
        if causal:
            keep = keep & (kpos.unsqueeze(-2) <= pos[rows].view(1, 1, -1, bs, 1))
        C = qc.shape[2]
        heads_x_blocks = lambda x: x.reshape(B, Hq * C, *x.shape[3:])  # noqa: E731  (4-D for the op)
        o, lse = attention_with_lse(heads_x_blocks(qc), heads_x_blocks(kg), heads_x_blocks(vg), False, scale,
                                    keep=heads_x_blocks(keep.expand(B, Hq, C, -1, -1)))
        outs.append(o.reshape(B, Hq, C, bs, D))
        lses.append(lse.reshape(B, Hq, C, bs))
    out = torch.cat(outs, dim=2).flatten(2, 3)[:, :, :N]                # (B, Hq, N, D)
    lse = torch.cat(lses, dim=2).flatten(2, 3)[:, :, :N]
    return out.transpose(1, 2).to(q.dtype).contiguous(), lse.float()
