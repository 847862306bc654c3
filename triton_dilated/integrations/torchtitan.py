"""torchtitan integration: an inner-attention module with torchtitan's call contract
(`pip install triton_dilated[torchtitan]`; the module itself needs only torch; tested with
torchtitan 0.3.0's context-parallel sharding on gloo CPU worlds).

torchtitan's attention blocks (GQAttention and friends) project q, k, v, apply RoPE and call
`inner_attention(q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None,
enable_gqa=False, is_causal=True)`, which returns (B, L, N, H): our (B, N, H, D) layout. With
context parallelism, torchtitan shards each batch over the "cp" mesh dimension first
(`prepare_context_parallel_input` / `cp_shard`, by default with the "headtail" load balancer:
rank i holds sequence chunks i and 2P - 1 - i of 2P, which is balance="zigzag" here) and each
rank's model sees its shard (positions for RoPE sharded alike). Its SDPA path then wraps the
local q, k, v as DTensors Shard(1) on the cp mesh (`apply_cp_to_forward`), its flex path
all-gathers k and v (local queries against keys on global positions).

`InnerAttention` takes either: DTensors (what the SDPA wrapper hands: returned as a DTensor,
the wrapper calls .to_local()), or local shards with `cp_mesh=` given (no wrapper needed:
torchtitan 0.3's apply_cp_to_forward picks its wrapper by isinstance and refuses other
modules), or, without a mesh, the whole sequence (no context parallelism). The sequence-parallel
calls go to `sequence_parallel_attention` (ring or Ulysses over the cp mesh).
"""
from __future__ import annotations

import torch

from ..ops.block_sparse import block_sparse_attention
from ..ops.dilated import dilated_attention
from ..ops.ring.dtensor import sequence_parallel_attention

LOAD_BALANCERS = {"headtail": "zigzag", None: "contiguous"}


class InnerAttention(torch.nn.Module):
    """torchtitan inner attention over triton_dilated: dense, dilated (segment_lengths,
    dilation_rates, mode, offsets) or block-sparse (layout over the full sequence).

    cp_mesh: the context-parallel DeviceMesh (1-D; or 2-D ring x Ulysses) when the inputs are
    local shards; scheme: "ring" or "ulysses" (None: the mesh dimension's name, see
    sequence_parallel_attention); load_balancer: torchtitan's
    parallelism.context_parallel_load_balancer, "headtail" (its default; zigzag shards) or
    None (contiguous shards); comm: as in ring_attention / ulysses_attention; backend: of
    the local calls (Ulysses and no mesh; the ring's steps pick their own).
    """

    def __init__(self, *, segment_lengths=None, dilation_rates=None, layout=None, mode="longnet", offsets="modulo",
                 cp_mesh=None, scheme=None, load_balancer="headtail", comm="p2p", backend="auto"):
        super().__init__()
        if load_balancer not in LOAD_BALANCERS:
            raise ValueError(f"load_balancer must be 'headtail' or None (torchtitan's ptrr balancer reorders by a "
                             f"block mask, which these patterns do not take), got {load_balancer!r}")
        self.pattern = dict(segment_lengths=segment_lengths, dilation_rates=dilation_rates, layout=layout)
        self.mode, self.offsets, self.cp_mesh, self.scheme = mode, offsets, cp_mesh, scheme
        self.balance, self.comm, self.backend = LOAD_BALANCERS[load_balancer], comm, backend

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, is_causal=True,
                **kwargs):
        if attention_masks is not None:
            raise ValueError("InnerAttention takes no attention_masks (the pattern is its own; causal via "
                             "is_causal); build the model without flex/varlen masks")
        q, k, v = q_BLNH, k_BLNH, v_BLNH
        kw = dict(causal=is_causal, scale=scale)
        seg, rates, layout = (self.pattern[n] for n in ("segment_lengths", "dilation_rates", "layout"))
        if type(q).__name__ == "DTensor" or self.cp_mesh is not None:
            extra = dict(comm=self.comm)
            if self.backend != "auto":   # the local call's (ulysses_attention's); the ring has its own
                extra.update(backend=self.backend)
            mesh = None if type(q).__name__ == "DTensor" else self.cp_mesh
            if seg is not None or rates is not None:
                kw.update(segment_lengths=seg, dilation_rates=rates, mode=self.mode, offsets=self.offsets)
            return sequence_parallel_attention(q, k, v, mesh=mesh, scheme=self.scheme, layout=layout,
                                               balance=self.balance, **kw, **extra)
        if layout is not None:
            return block_sparse_attention(q, k, v, layout, backend=self.backend, **kw)
        if seg is None and rates is None:    # dense: one pattern whose segment is the whole sequence
            seg, rates = [q.shape[1]], [1]
        return dilated_attention(q, k, v, seg, rates, mode=self.mode, offsets=self.offsets, backend=self.backend, **kw)
