"""BlockLayout: which (query block, key block) pairs attention computes (DESIGN §4).

FlexAttention's BlockMask convention, broadcast over batch and heads:
  kv_num_blocks  int32 (B|1, H|1, n_q_blocks)
  kv_indices     int32 (B|1, H|1, n_q_blocks, max_kv_blocks), ascending per row, zero
                 padding after the count
and the transposed lists q_num_blocks / q_indices (per key block, the query blocks that
read it) for the dK/dV backward, built once at construction. One block size serves
queries and keys. A layout knows its block counts, not N: at call time
ceil(N / block_size) must equal them.

Everything here works on index lists, in memory proportional to the number of active
blocks; only to_dense() / from_dense() touch an n_blocks x n_blocks mask.
"""
from __future__ import annotations

import math

import torch


def check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    return block_size


def normalise_rows(idx: torch.Tensor, n_cols: int):
    """Row lists with -1 (or any out-of-range value) for empty slots and possible
    duplicates -> canonical (counts int32 (..., rows), indices int32 (..., rows, width)):
    ascending, unique, zero padding, width >= 1."""
    big = n_cols
    idx = idx.long()
    key = torch.where((idx >= 0) & (idx < n_cols), idx, torch.full_like(idx, big))
    key = key.sort(dim=-1).values
    dup = torch.zeros_like(key, dtype=torch.bool)
    dup[..., 1:] = key[..., 1:] == key[..., :-1]
    key = torch.where(dup, torch.full_like(key, big), key).sort(dim=-1).values
    counts = (key < big).sum(-1)
    width = max(1, int(counts.max()) if counts.numel() else 1)
    key = key[..., :width]
    if key.shape[-1] < width:
        key = torch.nn.functional.pad(key, (0, width - key.shape[-1]), value=big)
    indices = torch.where(key < big, key, torch.zeros_like(key))
    return counts.to(torch.int32).contiguous(), indices.to(torch.int32).contiguous()


def valid_slots(counts: torch.Tensor, width: int) -> torch.Tensor:
    return torch.arange(width, device=counts.device) < counts.unsqueeze(-1)


def dense_from_lists(counts, indices, n_cols) -> torch.Tensor:
    valid = valid_slots(counts, indices.shape[-1])
    dense = torch.zeros(*counts.shape, n_cols + 1, dtype=torch.bool, device=indices.device)
    idx = torch.where(valid, indices.long(), torch.full_like(indices, n_cols).long())
    dense.scatter_(-1, idx, True)   # empty slots land in a spare last column, dropped
    return dense[..., :n_cols]


def transpose_lists(counts, indices, n_cols):
    """Row lists (B, H, rows, w) -> column lists (B, H, n_cols, w'): for each column, the
    rows that list it, ascending. O(active) memory."""
    B, H, rows, width = indices.shape
    valid = valid_slots(counts, width)
    b, h, r, slot = valid.nonzero(as_tuple=True)
    c = indices[b, h, r, slot].long()
    group = (b * H + h) * n_cols + c                     # (b, h, column) id
    order = torch.argsort(group * rows + r)               # by column, then ascending row
    group, r = group[order], r[order]
    per = torch.bincount(group, minlength=B * H * n_cols)
    width_t = max(1, int(per.max()) if per.numel() else 1)
    start = torch.cumsum(per, 0) - per
    pos = torch.arange(group.numel(), device=indices.device) - start[group]
    out = torch.zeros(B * H * n_cols, width_t, dtype=torch.int32, device=indices.device)
    out[group, pos] = r.to(torch.int32)
    return per.reshape(B, H, n_cols).to(torch.int32).contiguous(), out.reshape(B, H, n_cols, width_t).contiguous()


class BlockLayout:
    """Block-sparse attention layout. Build with `BlockLayout.from_dense(mask, block_size)`
    or a builder from `triton_dilated.layouts`; combine with `|` and `&`."""

    def __init__(self, kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor, block_size: int = 128,
                 n_kv_blocks: int | None = None):
        self.block_size = check_block_size(block_size)
        for name, t in (("kv_num_blocks", kv_num_blocks), ("kv_indices", kv_indices)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{name} must hold int32 (or int64) indices, got {t.dtype}")
        if kv_num_blocks.dim() != 3:
            raise ValueError(f"kv_num_blocks must be (B|1, H|1, n_q_blocks), got shape {tuple(kv_num_blocks.shape)}")
        if kv_indices.dim() != 4 or kv_indices.shape[:3] != kv_num_blocks.shape:
            raise ValueError(f"kv_indices must be (B|1, H|1, n_q_blocks, max_kv_blocks) matching kv_num_blocks "
                             f"{tuple(kv_num_blocks.shape)}, got shape {tuple(kv_indices.shape)}")
        n_q = kv_num_blocks.shape[2]
        n_kv = n_q if n_kv_blocks is None else int(n_kv_blocks)
        width = kv_indices.shape[3]
        if kv_num_blocks.numel() and (int(kv_num_blocks.min()) < 0 or int(kv_num_blocks.max()) > min(width, n_kv)):
            raise ValueError(f"kv_num_blocks must lie in [0, {min(width, n_kv)}], got values in "
                             f"[{int(kv_num_blocks.min())}, {int(kv_num_blocks.max())}]")
        valid = valid_slots(kv_num_blocks, width)
        if valid.any():
            used = kv_indices[valid]
            if int(used.min()) < 0 or int(used.max()) >= n_kv:
                raise ValueError(f"kv_indices must lie in [0, {n_kv}) within the counts, got values in "
                                 f"[{int(used.min())}, {int(used.max())}]")
            steps = kv_indices[..., 1:] - kv_indices[..., :-1]
            if (steps[valid[..., 1:]] <= 0).any():
                raise ValueError("kv_indices must be strictly ascending within each row's count")
        self.kv_num_blocks = kv_num_blocks.to(torch.int32).contiguous()
        self.kv_indices = torch.where(valid, kv_indices, torch.zeros_like(kv_indices)).to(torch.int32).contiguous()
        self.n_q_blocks, self.n_kv_blocks = n_q, n_kv
        self.q_num_blocks, self.q_indices = transpose_lists(self.kv_num_blocks, self.kv_indices, n_kv)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_rows(cls, rows: torch.Tensor, block_size: int, n_kv_blocks: int | None = None) -> "BlockLayout":
        """From per-row candidate lists (B|1, H|1, n_q_blocks, k) with -1 for "none";
        duplicates and order do not matter."""
        n_kv = rows.shape[2] if n_kv_blocks is None else n_kv_blocks
        counts, indices = normalise_rows(rows, n_kv)
        return cls(counts, indices, block_size, n_kv_blocks=n_kv)

    @classmethod
    def from_dense(cls, block_mask: torch.Tensor, block_size: int = 128) -> "BlockLayout":
        """block_mask: bool (n_q_blocks, n_kv_blocks) or (B|1, H|1, n_q_blocks, n_kv_blocks)."""
        if not isinstance(block_mask, torch.Tensor):
            raise TypeError(f"block_mask must be a torch.Tensor, got {type(block_mask).__name__}")
        if block_mask.dtype != torch.bool:
            raise TypeError(f"block_mask must be a bool tensor, got {block_mask.dtype}")
        if block_mask.dim() == 2:
            block_mask = block_mask[None, None]
        if block_mask.dim() != 4:
            raise ValueError(f"block_mask must be (n_q_blocks, n_kv_blocks) or (B|1, H|1, n_q_blocks, n_kv_blocks), "
                             f"got shape {tuple(block_mask.shape)}")
        n_kv = block_mask.shape[-1]
        cols = torch.arange(n_kv, device=block_mask.device)
        return cls.from_rows(torch.where(block_mask, cols, -1), block_size, n_kv)

    def to_dense(self) -> torch.Tensor:
        """bool (B|1, H|1, n_q_blocks, n_kv_blocks)."""
        return dense_from_lists(self.kv_num_blocks, self.kv_indices, self.n_kv_blocks)

    # ------------------------------------------------------------------ properties
    @property
    def shape(self):
        return (*self.kv_num_blocks.shape, self.n_kv_blocks)

    @property
    def num_active(self) -> int:
        return int(self.kv_num_blocks.sum())

    @property
    def sparsity(self) -> float:
        """Fraction of (query block, key block) pairs that are not computed."""
        total = self.kv_num_blocks.numel() * self.n_kv_blocks
        return 1.0 - self.num_active / total if total else 0.0

    def full_blocks(self, seq_len: int, causal: bool):
        """The active blocks that need no element mask for this N and causal flag, as
        (counts, indices): below the diagonal when causal, and not the ragged last key block
        (FlexAttention's "full" lists)."""
        return self._split(seq_len, causal)[0]

    def _split(self, seq_len: int, causal: bool):
        """((full counts, indices), (partial counts, indices)); causal drops blocks above
        the diagonal."""
        row = torch.arange(self.n_q_blocks, device=self.kv_indices.device)[:, None]
        valid = valid_slots(self.kv_num_blocks, self.kv_indices.shape[-1])
        kb = self.kv_indices
        free = valid & ((kb < row) if causal else torch.ones_like(valid))
        if seq_len % self.block_size:
            free &= kb != self.n_kv_blocks - 1
        partial = valid & ~free & ((kb <= row) if causal else torch.ones_like(valid))
        pick = lambda m: normalise_rows(torch.where(m, kb, -1), self.n_kv_blocks)  # noqa: E731
        return pick(free), pick(partial)

    def check_seq_len(self, seq_len: int, name: str = "layout") -> None:
        need = math.ceil(seq_len / self.block_size)
        if self.n_q_blocks != need or self.n_kv_blocks != need:
            raise ValueError(f"{name} has {self.n_q_blocks} x {self.n_kv_blocks} blocks of {self.block_size}, but a "
                             f"sequence of {seq_len} needs {need} x {need}")

    def check_heads(self, batch: int, heads: int, name: str = "layout") -> None:
        b, h = self.kv_num_blocks.shape[:2]
        if b not in (1, batch) or h not in (1, heads):
            raise ValueError(f"{name} is laid out for (B, H) = ({b}, {h}), which does not broadcast to "
                             f"the call's ({batch}, {heads}); use 1 or the exact size")

    def to(self, device) -> "BlockLayout":
        out = object.__new__(BlockLayout)
        out.__dict__.update({k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})
        return out

    # ------------------------------------------------------------------ algebra
    def _check_compatible(self, other):
        if other.block_size != self.block_size or other.n_kv_blocks != self.n_kv_blocks \
                or other.n_q_blocks != self.n_q_blocks:
            raise ValueError(f"layouts must share block size and block counts, got {self.block_size}/"
                             f"{self.n_q_blocks}x{self.n_kv_blocks} and {other.block_size}/"
                             f"{other.n_q_blocks}x{other.n_kv_blocks}")

    def _rows(self):
        return torch.where(valid_slots(self.kv_num_blocks, self.kv_indices.shape[-1]), self.kv_indices.long(), -1)

    def __or__(self, other):
        if not isinstance(other, BlockLayout):
            return NotImplemented
        self._check_compatible(other)
        a, b = torch.broadcast_tensors(self._rows()[..., :1], other._rows()[..., :1])
        shape = a.shape[:-1]
        rows = torch.cat([self._rows().expand(*shape, -1), other._rows().expand(*shape, -1)], dim=-1)
        return BlockLayout.from_rows(rows, self.block_size, self.n_kv_blocks)

    def __and__(self, other):
        if not isinstance(other, BlockLayout):
            return NotImplemented
        self._check_compatible(other)
        mine, theirs = self._rows(), other._rows()
        keep = (mine.unsqueeze(-1) == theirs.unsqueeze(-2)).any(-1) & (mine >= 0)
        return BlockLayout.from_rows(torch.where(keep, mine, -1), self.block_size, self.n_kv_blocks)

    def __repr__(self):
        return f"BlockLayout(shape={self.shape}, block_size={self.block_size}, sparsity={self.sparsity:.3f})"

    # ------------------------------------------------------------------ FlexAttention
    def to_flex_block_mask(self, seq_len: int | None = None, causal: bool = False):
        """A torch FlexAttention BlockMask computing the same attention (needs a torch
        with torch.nn.attention.flex_attention)."""
        from torch.nn.attention.flex_attention import BlockMask
        seq_len = seq_len or self.n_q_blocks * self.block_size
        self.check_seq_len(seq_len)
        bs = self.block_size
        dense = self.to_dense()
        (full_counts, full_idx), (partial_counts, partial_idx) = self._split(seq_len, causal)
        # FlexAttention reads the number of key blocks from the index width: pad to it
        widen = lambda x: torch.nn.functional.pad(x, (0, self.n_kv_blocks - x.shape[-1]))  # noqa: E731
        full_idx, partial_idx = widen(full_idx), widen(partial_idx)

        def mask_mod(b, h, q_idx, kv_idx):
            ok = dense[b % dense.shape[0], h % dense.shape[1], q_idx // bs, kv_idx // bs]
            ok = ok & (kv_idx < seq_len)
            return ok & (q_idx >= kv_idx) if causal else ok

        return BlockMask.from_kv_blocks(partial_counts, partial_idx, full_counts, full_idx,
                                        BLOCK_SIZE=bs, mask_mod=mask_mod, seq_lengths=(seq_len, seq_len))

    @classmethod
    def from_flex_block_mask(cls, block_mask) -> "BlockLayout":
        """The blocks a FlexAttention BlockMask visits (partial and full) as a layout."""
        size = block_mask.BLOCK_SIZE
        q_bs, kv_bs = size if isinstance(size, tuple) else (size, size)
        if q_bs != kv_bs:
            raise ValueError(f"block_mask must use one block size for queries and keys, got {size}")
        n_kv = block_mask.kv_indices.shape[-1]
        rows = [torch.where(valid_slots(block_mask.kv_num_blocks, n_kv), block_mask.kv_indices.long(), -1)]
        if block_mask.full_kv_num_blocks is not None:
            full = block_mask.full_kv_indices
            rows.append(torch.where(valid_slots(block_mask.full_kv_num_blocks, full.shape[-1]), full.long(), -1))
        return cls.from_rows(torch.cat(rows, dim=-1), int(q_bs), n_kv)
