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

from ..common.validation import check_int
from ..common import masks
from ..common.masks import WindowPredicate


def check_block_size(block_size) -> int:
    block_size = check_int("block_size", block_size)
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    return block_size


def pack_pairs(b, h, r, c, shape, n_cols, flags=None):
    """Active pairs (batch b, head h, row r, column c; any order, duplicates allowed) ->
    canonical row lists (counts int32 (B, H, R), indices int32 (B, H, R, width)):
    ascending, unique, zero padding, width >= 1. Cost O(pairs log pairs). With `flags`
    (bool per pair): also the flags packed like the indices (False on padding), a duplicated
    pair flagged only if every copy is (a union: fully visible wins over the window)."""
    B, H, R = shape
    device = c.device
    key_all = ((b.long() * H + h.long()) * R + r.long()) * n_cols + c.long()
    if flags is None:
        key = torch.unique(key_all)  # sorted
    else:
        key, inverse = torch.unique(key_all, return_inverse=True)
        flag = torch.ones(key.numel(), dtype=torch.uint8, device=device).scatter_reduce_(
            0, inverse, flags.to(device=device, dtype=torch.uint8), "amin")
    row, col = key // n_cols, key % n_cols
    counts = torch.bincount(row, minlength=B * H * R)
    width = max(1, int(counts.max()) if counts.numel() else 1)
    start = torch.cumsum(counts, 0) - counts
    pos = torch.arange(key.numel(), device=device) - start[row]
    indices = torch.zeros(B * H * R, width, dtype=torch.int32, device=device)
    indices[row, pos] = col.to(torch.int32)
    lists = counts.reshape(B, H, R).to(torch.int32).contiguous(), indices.reshape(B, H, R, width).contiguous()
    if flags is None:
        return lists
    packed = torch.zeros(B * H * R, width, dtype=torch.bool, device=device)
    packed[row, pos] = flag.bool()
    return (*lists, packed.reshape(B, H, R, width))


def list_pairs(counts, indices, flags=None):
    """Row lists -> (b, h, r, c) of their active entries, O(active); with `flags` (bool like
    indices) also each entry's flag."""
    B, H, R, width = indices.shape
    flat = counts.reshape(-1).long()
    row = torch.repeat_interleave(torch.arange(flat.numel(), device=counts.device), flat)
    slot = torch.arange(row.numel(), device=counts.device) - (torch.cumsum(flat, 0) - flat)[row]
    c = indices.reshape(-1, width)[row, slot]
    pairs = row // (H * R), row // R % H, row % R, c
    return pairs if flags is None else (*pairs, flags.reshape(-1, width)[row, slot])


def rows_to_pairs(rows: torch.Tensor, n_cols: int):
    """Candidate lists (B, H, R, k) with -1 (or out-of-range) for none -> pairs."""
    ok = (rows >= 0) & (rows < n_cols)
    b, h, r, slot = ok.nonzero(as_tuple=True)
    return b, h, r, rows[b, h, r, slot]


def valid_slots(counts: torch.Tensor, width: int) -> torch.Tensor:
    return torch.arange(width, device=counts.device) < counts.unsqueeze(-1)


def dense_from_lists(counts, indices, n_cols) -> torch.Tensor:
    b, h, r, c = list_pairs(counts, indices)
    dense = torch.zeros(*counts.shape, n_cols, dtype=torch.bool, device=indices.device)
    dense[b, h, r, c.long()] = True
    return dense


def transpose_lists(counts, indices, n_cols, flags=None):
    """Row lists (B, H, rows, w) -> column lists (B, H, n_cols, w'): for each column, the
    rows that list it, ascending (with `flags`: also the flags, transposed alike)."""
    if flags is None:
        b, h, r, c = list_pairs(counts, indices)
        return pack_pairs(b, h, c, r, (*counts.shape[:2], n_cols), counts.shape[2])
    b, h, r, c, f = list_pairs(counts, indices, flags)
    return pack_pairs(b, h, c, r, (*counts.shape[:2], n_cols), counts.shape[2], f)


def join_windows(a, b, what: str):
    """The window predicate of a combination of two layouts: one of them, or the shared one;
    two different windows cannot be evaluated by one predicate (ValueError)."""
    if a is None or b is None or a == b:
        return b if a is None else a
    raise ValueError(f"{what} of layouts with different sliding windows ({a!r} and {b!r}) is not supported: "
                     f"one predicate (window, sinks) per layout")


class BlockLayout:
    """Block-sparse attention layout. Build with `BlockLayout.from_dense(mask, block_size)`
    or a builder from `triton_dilated.layouts`; combine with `|` and `&`.

    Sliding windows (`layouts.sliding_window`): `window` is then a WindowPredicate (window,
    sink_tokens; ops/common/masks.py) and `kv_window` / `q_window` (bool, like kv_indices /
    q_indices) flag the active blocks where that element predicate applies (blocks cut by the
    band's edge); the other active blocks are visible whole (then only `causal` and N cut
    them). `window` is None and the flags None for every other layout. Combinations: a union
    flags a block only where every layout holding it flags it (a block of the other layout is
    visible whole: the union of the element sets); an intersection flags it where either does;
    two different predicates are a ValueError."""

    def __init__(self, kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor, block_size: int = 128,
                 n_kv_blocks: int | None = None):
        block_size = check_block_size(block_size)
        self._validate(kv_num_blocks, kv_indices, block_size, n_kv_blocks)
        valid = valid_slots(kv_num_blocks, kv_indices.shape[3])
        self._set(kv_num_blocks.to(torch.int32).contiguous(),
                  torch.where(valid, kv_indices, torch.zeros_like(kv_indices)).to(torch.int32).contiguous(),
                  block_size, kv_num_blocks.shape[2] if n_kv_blocks is None else int(n_kv_blocks))

    window = None          # WindowPredicate or None (class defaults: layouts built before windows)
    kv_window = q_window = None

    def _set(self, counts, indices, block_size, n_kv, kv_window=None, window=None):
        self.block_size = block_size
        self.kv_num_blocks, self.kv_indices = counts, indices
        self.n_q_blocks, self.n_kv_blocks = counts.shape[2], n_kv
        if window is None:
            self.q_num_blocks, self.q_indices = transpose_lists(counts, indices, n_kv)
            self.window = self.kv_window = self.q_window = None
        else:
            self.q_num_blocks, self.q_indices, self.q_window = transpose_lists(counts, indices, n_kv, kv_window)
            self.window, self.kv_window = window, kv_window

    @staticmethod
    def _validate(kv_num_blocks, kv_indices, block_size, n_kv_blocks):
        check_block_size(block_size)
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

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pairs(cls, b, h, r, c, shape, n_kv_blocks: int, block_size: int, *, window=None,
                   window_flags=None) -> "BlockLayout":
        """From active (batch, head, query block, key block) pairs; shape = (B|1, H|1,
        n_q_blocks). Order and duplicates do not matter. window: a WindowPredicate (or
        (window, sink_tokens)) evaluated on the pairs flagged by window_flags (bool per pair;
        default all); a duplicated pair is flagged only if every copy is."""
        block_size = check_block_size(block_size)
        layout = object.__new__(cls)
        if window is None:
            counts, indices = pack_pairs(b, h, r, c, shape, n_kv_blocks)   # canonical by construction
            layout._set(counts, indices, block_size, n_kv_blocks)
            return layout
        window = window if isinstance(window, WindowPredicate) else WindowPredicate(*window)
        if window_flags is None:
            window_flags = torch.ones(c.shape, dtype=torch.bool, device=c.device)
        counts, indices, flags = pack_pairs(b, h, r, c, shape, n_kv_blocks, window_flags)
        layout._set(counts, indices, block_size, n_kv_blocks, flags, window)
        return layout

    @classmethod
    def from_canonical_lists(cls, kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor, q_num_blocks: torch.Tensor,
                             q_indices: torch.Tensor, block_size: int, *, window=None, kv_window=None,
                             q_window=None) -> "BlockLayout":
        """Around the four lists of an existing layout (already canonical and transposed), with
        no validation or re-transposition: O(1). The custom ops rebuild layouts this way
        (with a window: its predicate and the two flag tensors too)."""
        layout = object.__new__(cls)
        layout.block_size = int(block_size)
        layout.kv_num_blocks, layout.kv_indices = kv_num_blocks, kv_indices
        layout.q_num_blocks, layout.q_indices = q_num_blocks, q_indices
        layout.n_q_blocks, layout.n_kv_blocks = kv_num_blocks.shape[2], q_num_blocks.shape[2]
        if window is not None:
            layout.window = window if isinstance(window, WindowPredicate) else WindowPredicate(*window)
            layout.kv_window, layout.q_window = kv_window.bool(), q_window.bool()
        return layout

    @classmethod
    def from_rows(cls, rows: torch.Tensor, block_size: int, n_kv_blocks: int | None = None) -> "BlockLayout":
        """From per-row candidate lists (B|1, H|1, n_q_blocks, k) with -1 for "none";
        duplicates and order do not matter."""
        n_kv = rows.shape[2] if n_kv_blocks is None else n_kv_blocks
        return cls.from_pairs(*rows_to_pairs(rows, n_kv), rows.shape[:3], n_kv, block_size)

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
        return cls.from_pairs(*block_mask.nonzero(as_tuple=True), block_mask.shape[:3], block_mask.shape[-1],
                              block_size)

    def to_dense(self) -> torch.Tensor:
        """bool (B|1, H|1, n_q_blocks, n_kv_blocks): the active blocks (with a window, those
        where the predicate applies too: window_blocks_dense)."""
        return dense_from_lists(self.kv_num_blocks, self.kv_indices, self.n_kv_blocks)

    def window_blocks_dense(self) -> torch.Tensor:
        """bool like to_dense(): the active blocks evaluated by the window predicate per element
        (all False without a window)."""
        if self.window is None:
            return torch.zeros(*self.kv_num_blocks.shape, self.n_kv_blocks, dtype=torch.bool,
                               device=self.kv_indices.device)
        b, h, r, c, f = list_pairs(self.kv_num_blocks, self.kv_indices, self.kv_window)
        dense = torch.zeros(*self.kv_num_blocks.shape, self.n_kv_blocks, dtype=torch.bool,
                            device=self.kv_indices.device)
        dense[b[f], h[f], r[f], c[f].long()] = True
        return dense

    def element_mask(self, seq_len: int, causal: bool) -> torch.Tensor:
        """bool (B|1, H|1, N, N): the (query, key) pairs the layout computes at this N and
        causal flag (the window predicate applied in its blocks). O(N^2): tests, oracles."""
        bs, n = self.block_size, seq_len
        expand = lambda x: x.repeat_interleave(bs, dim=-2).repeat_interleave(bs, dim=-1)[..., :n, :n]  # noqa: E731
        mask = expand(self.to_dense())
        pos = torch.arange(seq_len, device=mask.device)
        if causal:
            mask = mask & masks.causal(pos[:, None], pos[None, :])
        if self.window is not None:
            mask = mask & (~expand(self.window_blocks_dense()) | self.window(pos[:, None], pos[None, :]))
        return mask

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
        b, h, r, c, win = self.pairs_with_flags()
        free = (c < r) if causal else torch.ones_like(c, dtype=torch.bool)
        if seq_len % self.block_size:
            free &= c != self.n_kv_blocks - 1
        free &= ~win            # window blocks: masked per element
        # (window blocks never lie above the diagonal)
        partial = ~free & ((c <= r) if causal else torch.ones_like(free))
        pick = lambda m: pack_pairs(b[m], h[m], r[m], c[m], self.kv_num_blocks.shape, self.n_kv_blocks)  # noqa: E731
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

    def heads(self, start: int, stop: int) -> "BlockLayout":
        """The layout of query heads [start, stop) (itself when laid out for one head row,
        which broadcasts): what a rank holding those heads computes (Ulysses)."""
        if self.kv_num_blocks.shape[1] == 1:
            return self
        pick = lambda t: None if t is None else t[:, start:stop].contiguous()  # noqa: E731
        return BlockLayout.from_canonical_lists(pick(self.kv_num_blocks), pick(self.kv_indices),
                                                pick(self.q_num_blocks), pick(self.q_indices), self.block_size,
                                                window=self.window, kv_window=pick(self.kv_window),
                                                q_window=pick(self.q_window))

    def to(self, device) -> "BlockLayout":
        """The same layout with its lists on `device` (traceable by torch.compile: no __dict__)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return BlockLayout.from_canonical_lists(move(self.kv_num_blocks), move(self.kv_indices),
                                                move(self.q_num_blocks), move(self.q_indices), self.block_size,
                                                window=self.window, kv_window=move(self.kv_window),
                                                q_window=move(self.q_window))

    # ------------------------------------------------------------------ algebra
    def _check_compatible(self, other):
        if other.block_size != self.block_size or other.n_kv_blocks != self.n_kv_blocks \
                or other.n_q_blocks != self.n_q_blocks:
            raise ValueError(f"layouts must share block size and block counts, got {self.block_size}/"
                             f"{self.n_q_blocks}x{self.n_kv_blocks} and {other.block_size}/"
                             f"{other.n_q_blocks}x{other.n_kv_blocks}")

    def pairs(self):
        """(b, h, q_block, kv_block) of every active pair."""
        return list_pairs(self.kv_num_blocks, self.kv_indices)

    def pairs_with_flags(self):
        """pairs() and, per pair, whether the window predicate applies there (bool; all False
        without a window)."""
        if self.window is None:
            b, h, r, c = self.pairs()
            return b, h, r, c, torch.zeros(c.shape, dtype=torch.bool, device=c.device)
        return list_pairs(self.kv_num_blocks, self.kv_indices, self.kv_window)

    def broadcast_pairs(self, shape, with_flags: bool = False):
        """pairs() (with_flags: pairs_with_flags()) with batch/head dimensions of size 1
        repeated to `shape` (B, H, n_q)."""
        pairs = self.pairs_with_flags() if with_flags else self.pairs()
        b, h = pairs[:2]
        lb, lh = self.kv_num_blocks.shape[:2]
        rep_b, rep_h = shape[0] // lb, shape[1] // lh
        if rep_b == rep_h == 1:
            return pairs
        bb = (b[:, None, None] * rep_b + torch.arange(rep_b)[None, :, None]).expand(-1, rep_b, rep_h)
        hh = (h[:, None, None] * rep_h + torch.arange(rep_h)[None, None, :]).expand(-1, rep_b, rep_h)
        ex = lambda x: x[:, None, None].expand(-1, rep_b, rep_h).reshape(-1)  # noqa: E731
        return (bb.reshape(-1), hh.reshape(-1), *(ex(x) for x in pairs[2:]))

    def _broadcast_pairs(self, other, with_flags=False):
        shape = torch.broadcast_shapes(self.kv_num_blocks.shape, other.kv_num_blocks.shape)
        return shape, [self.broadcast_pairs(shape, with_flags), other.broadcast_pairs(shape, with_flags)]

    def prefix(self, n_blocks: int, batch_rows=None, first_query_block: int = 0) -> "BlockLayout":
        """The layout of the first n_blocks query and key blocks (a shorter sequence at the same
        absolute positions), for the batch rows `batch_rows` when it has a batch dimension.
        first_query_block > 0: query blocks before it get no key block (empty rows: 0 and
        lse = -inf), for callers that keep only later rows (chunked prefill)."""
        b, h, r, c, win = self.pairs_with_flags()
        lb, lh = self.kv_num_blocks.shape[:2]
        keep = (r < n_blocks) & (c < n_blocks) & (r >= first_query_block)
        shape_b = lb
        if batch_rows is not None and lb > 1:
            rows = torch.as_tensor(batch_rows, dtype=torch.long, device=b.device)
            new_b = torch.full((lb,), -1, dtype=torch.long, device=b.device)
            new_b[rows] = torch.arange(rows.numel(), device=b.device)
            keep &= new_b[b.long()] >= 0
            b = new_b[b.long()]
            shape_b = rows.numel()
        return BlockLayout.from_pairs(b[keep], h[keep], r[keep], c[keep], (shape_b, lh, n_blocks), n_blocks,
                                      self.block_size, window=self.window, window_flags=win[keep])

    def __or__(self, other):
        if not isinstance(other, BlockLayout):
            return NotImplemented
        self._check_compatible(other)
        window = join_windows(self.window, other.window, "the union")
        shape, ((b1, h1, r1, c1, f1), (b2, h2, r2, c2, f2)) = self._broadcast_pairs(other, True)
        cat = lambda x, y: torch.cat([x, y])  # noqa: E731
        # a block either layout holds whole is whole in the union (pack_pairs: flags ANDed)
        return BlockLayout.from_pairs(cat(b1, b2), cat(h1, h2), cat(r1, r2), cat(c1, c2), shape,
                                      self.n_kv_blocks, self.block_size, window=window, window_flags=cat(f1, f2))

    def __and__(self, other):
        if not isinstance(other, BlockLayout):
            return NotImplemented
        self._check_compatible(other)
        window = join_windows(self.window, other.window, "the intersection")
        shape, ((b1, h1, r1, c1, f1), (b2, h2, r2, c2, f2)) = self._broadcast_pairs(other, True)
        key = lambda b, h, r, c: ((b * shape[1] + h) * shape[2] + r) * self.n_kv_blocks + c  # noqa: E731
        k1, k2 = key(b1, h1, r1, c1.long()), key(b2, h2, r2, c2.long())
        keep = torch.isin(k1, k2)
        # the predicate applies where either layout applies it (pairs are unique per layout)
        k2_sorted, order = torch.sort(k2)
        flags = f1[keep] | f2[order][torch.searchsorted(k2_sorted, k1[keep])]
        return BlockLayout.from_pairs(b1[keep], h1[keep], r1[keep], c1[keep], shape, self.n_kv_blocks,
                                      self.block_size, window=window, window_flags=flags)

    def __repr__(self):
        win = "" if self.window is None else f", window={self.window.window}, sinks={self.window.sink_tokens}"
        return f"BlockLayout(shape={self.shape}, block_size={self.block_size}, sparsity={self.sparsity:.3f}{win})"

    # ------------------------------------------------------------------ FlexAttention
    def to_flex_block_mask(self, seq_len: int | None = None, causal: bool = False):
        """A torch FlexAttention BlockMask computing the same attention (needs a torch
        with torch.nn.attention.flex_attention)."""
        from torch.nn.attention.flex_attention import BlockMask
        seq_len = seq_len or self.n_q_blocks * self.block_size
        self.check_seq_len(seq_len)
        bs = self.block_size
        dense = self.to_dense()
        win = self.window_blocks_dense() if self.window is not None else None
        (full_counts, full_idx), (partial_counts, partial_idx) = self._split(seq_len, causal)
        # FlexAttention reads the number of key blocks from the index width: pad to it
        widen = lambda x: torch.nn.functional.pad(x, (0, self.n_kv_blocks - x.shape[-1]))  # noqa: E731
        full_idx, partial_idx = widen(full_idx), widen(partial_idx)

        def mask_mod(b, h, q_idx, kv_idx):
            ok = dense[b % dense.shape[0], h % dense.shape[1], q_idx // bs, kv_idx // bs]
            ok = ok & (kv_idx < seq_len)
            if win is not None:   # the window predicate in its blocks
                in_win = win[b % win.shape[0], h % win.shape[1], q_idx // bs, kv_idx // bs]
                ok = ok & (~in_win | self.window(q_idx, kv_idx))
            return ok & masks.causal(q_idx, kv_idx) if causal else ok

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
        parts = [list_pairs(block_mask.kv_num_blocks, block_mask.kv_indices)]
        if block_mask.full_kv_num_blocks is not None:
            parts.append(list_pairs(block_mask.full_kv_num_blocks, block_mask.full_kv_indices))
        b, h, r, c = (torch.cat(x) for x in zip(*parts))
        return cls.from_pairs(b, h, r, c, block_mask.kv_num_blocks.shape, n_kv, int(q_bs))
