"""Sequence sharding for ring attention (DESIGN §5). The sequence dimension is 1.

balance="contiguous": rank i holds positions [i*N/P, (i+1)*N/P).
balance="zigzag": the sequence is cut into 2P chunks; rank i holds chunks i and 2P-1-i
(causal load balance: every rank gets an early and a late chunk).
balance=DocumentBalance (documents.document_balance, packed documents): each rank holds the
chunks the planner dealt it (near-even (query, key) pairs for any document lengths).
"""
from __future__ import annotations

import torch

from ..common.validation import check_choice, check_int
from .documents import DocumentBalance

BALANCES = ("contiguous", "zigzag")


def _check(n: int, world_size: int, balance, what: str = "the sequence length"):
    world_size = check_int("world_size", world_size, 1)
    if isinstance(balance, DocumentBalance):
        if (balance.n, balance.world_size) != (n, world_size):
            raise ValueError(f"balance was planned for {balance.n} positions on {balance.world_size} ranks, but "
                             f"{what} is {n} on {world_size} ranks")
        return n // world_size
    check_choice("balance", balance, BALANCES)
    parts = world_size * (2 if balance == "zigzag" else 1)
    if n % parts:
        raise ValueError(f"{what} ({n}) must be a multiple of {parts} for balance={balance!r} "
                         f"with world_size={world_size}")
    return n // parts


def shard_positions(n: int, rank: int, world_size: int, balance: str = "contiguous", device=None) -> torch.Tensor:
    """Global positions (int32, ascending) that `rank` holds of a sequence of length n."""
    size = _check(n, world_size, balance)
    world_size, rank = int(world_size), check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must lie in [0, {world_size}), got {rank}")
    if isinstance(balance, DocumentBalance):
        return balance.positions(rank, device)
    if balance == "contiguous":
        return torch.arange(rank * size, (rank + 1) * size, dtype=torch.int32, device=device)
    first = torch.arange(rank * size, (rank + 1) * size, dtype=torch.int32, device=device)
    second = torch.arange((2 * world_size - 1 - rank) * size, (2 * world_size - rank) * size, dtype=torch.int32,
                          device=device)
    return torch.cat([first, second])


def shard(x: torch.Tensor, rank: int, world_size: int, balance: str = "contiguous") -> torch.Tensor:
    """This rank's part of x (..., sequence on dim 1)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x must have a sequence dimension 1, got shape {tuple(x.shape)}")
    pos = shard_positions(x.shape[1], rank, world_size, balance, device=x.device)
    if balance == "contiguous":
        return x[:, int(pos[0]):int(pos[-1]) + 1] if pos.numel() else x[:, :0]
    return x.index_select(1, pos.long())


def unshard(local_shards, balance: str = "contiguous") -> torch.Tensor:
    """The full tensor from every rank's shard, given in rank order."""
    if not isinstance(local_shards, (list, tuple)) or not local_shards:
        raise ValueError("local_shards must be a non-empty list of tensors in rank order")
    world = len(local_shards)
    n = sum(x.shape[1] for x in local_shards)
    _check(n, world, balance)
    if balance == "contiguous":
        return torch.cat(list(local_shards), dim=1)
    out = torch.empty(local_shards[0].shape[0], n, *local_shards[0].shape[2:], dtype=local_shards[0].dtype,
                      device=local_shards[0].device)
    for rank, x in enumerate(local_shards):
        out.index_copy_(1, shard_positions(n, rank, world, balance, device=x.device).long(), x)
    return out
