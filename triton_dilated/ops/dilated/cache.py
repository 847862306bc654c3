"""A bounded key/value cache for decoding with dilated attention (`DilatedKVCache`).

A query at position p reads, for each pattern (w, r), only keys of its own segment, which
starts at (p // w) * w. Later queries sit at p or after, so no future query reads a row before

    earliest(p) = min over patterns of (p // w) * w.

Dropping a prefix whose length is a multiple of every w (of L = lcm(segment_lengths)) leaves
each later row's segment start and its residue (p - s(p)) % r unchanged relative to the kept
rows, so dilated attention over the kept rows (queries last, DESIGN §5b) is exactly the
attention over the whole cache. The cache keeps the rows from

    window_start(p) = (earliest(p) // L) * L

on, p being the next position to be written. For schedules whose segment lengths each divide
the next (LongNet's powers of two) earliest(p) is the longest segment's start, a multiple of
L = max(w): a decode step sees at most max(w) rows per layer (the longest segment), however
long the generation. Other schedules keep fewer than max(w) + lcm(w) - min(w) rows, which for
near-coprime lengths ([2047, 2048]: lcm 4,192,256) is every row of any realistic context: the
cache then bounds nothing, and DilatedKVCache warns when it is built.

What is not dropped: rows of residues no head reads. In longnet mode with Hq >= max(r) (the
paper's setting, e.g. H = 16 and r <= 12) every residue of every pattern is read by some
query head, so there is nothing to drop; savings exist only for r > Hq, for GQA (a key/value
head serves few residues) and in head_groups mode, and they differ per key/value head. Keeping
them would make the rows non-contiguous, which the attention functions' position convention
(the queries are the last rows of contiguous k, v) cannot express without a per-pattern path.
"""
from __future__ import annotations

import math
import warnings

import torch

from ..common.runtime import resolve_backend
from ..common.validation import SUPPORTED_DTYPES, check_flags, check_int, check_qkv, check_scale
from .interface import dilated_attention
from .patterns import check_patterns


# DilatedKVCache warns when its row bound exceeds this many times the longest segment.
LOOSE_BOUND_FACTOR = 4


def window_start(position: int, segment_lengths) -> int:
    """The first row a query at `position` or later can read, rounded down to a multiple of
    lcm(segment_lengths) (so that dropping the rows before it changes no segment or residue)."""
    earliest = min(position // w * w for w in segment_lengths)
    step = math.lcm(*segment_lengths)
    return earliest // step * step


def decode_rows_bound(segment_lengths) -> int:
    """The most rows a decode step (one new token) sees: max(w) when each segment length
    divides the next, else an upper bound, max(w) + lcm(w) - min(w)."""
    ws = sorted(set(int(w) for w in segment_lengths))
    nested = all(b % a == 0 for a, b in zip(ws, ws[1:]))
    return ws[-1] if nested else ws[-1] + math.lcm(*ws) - ws[0]


class KeptRows:
    """One layer's kept key and value rows, in buffers (B, capacity, H, D): row i holds
    position start + i, rows [0, length) are valid.

    append() writes in place when the buffer has room; the rows it returns are views that later
    appends never overwrite (an append writes only past the rows returned so far; a trim or a
    growth moves the kept rows to a new buffer). The writes go through `buffer.data`, which
    does not share the version counter of the views handed out: a graph that saved such a view
    (an attention over the rows whose q requires grad, e.g. chunked prefill with frozen k/v
    projections) would otherwise fail at backward with "modified by an inplace operation",
    although none of the values it saved changed. When the new rows themselves require grad
    (and autograd records), append() concatenates instead, so that the rows carry the graph
    back to k and v."""

    def __init__(self, segment_lengths):
        self.segment_lengths = tuple(int(w) for w in segment_lengths)
        self.bound = decode_rows_bound(self.segment_lengths)
        self.k = self.v = None
        self.start = 0
        self.length = 0

    @property
    def seen(self) -> int:
        """Tokens written so far (the position of the next one)."""
        return self.start + self.length

    @property
    def nbytes(self) -> int:
        if self.k is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def _check(self, k, v):
        for name, x in (("key", k), ("value", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                raise ValueError(f"{name} rows must be a 4-d tensor (B, N, H, D), got "
                                 f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if k.shape != v.shape:
            raise ValueError(f"key and value rows must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.dtype not in SUPPORTED_DTYPES or v.dtype != k.dtype:   # what the attention will take
            raise TypeError(f"key and value rows must share one of the dtypes float16, bfloat16, float32 (what "
                            f"dilated_attention takes), got {k.dtype} and {v.dtype}")
        if self.k is not None:
            want = (self.k.shape[0], self.k.shape[2], self.k.shape[3])
            got = (k.shape[0], k.shape[2], k.shape[3])
            if got != want or k.dtype != self.k.dtype or k.device != self.k.device:
                raise ValueError(f"new rows must match the cached ones: (B, H, D) = {want}, {self.k.dtype} on "
                                 f"{self.k.device}; got {got}, {k.dtype} on {k.device} (the layout is (B, n, H, D); "
                                 f"rows in transformers' (B, H, n, D) read heads as tokens: pass k.transpose(1, 2))")

    def _alloc(self, like, capacity):
        B, _, H, D = like.shape
        return like.new_empty((B, capacity, H, D))

    def _move_to_new_buffers(self, first, count, capacity):
        """Rows [first, first + count) into fresh buffers of `capacity` rows."""
        k = self._alloc(self.k, capacity)
        v = self._alloc(self.v, capacity)
        k[:, :count] = self.k[:, first:first + count]
        v[:, :count] = self.v[:, first:first + count]
        self.k, self.v, self.length = k, v, count

    def append(self, k, v):
        """Write the new rows (B, n, H, D); return the rows the new queries can read: every
        kept row and the new ones, (B, length, H, D) each. Then drop the rows no later query
        reads."""
        self._check(k, v)
        n = k.shape[1]
        if self.k is None:
            self.k, self.v = self._alloc(k, 0), self._alloc(v, 0)
        need = self.length + n
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad or self.k.requires_grad):
            self.k = torch.cat([self.k[:, :self.length], k], dim=1)
            self.v = torch.cat([self.v[:, :self.length], v], dim=1)
        elif n:
            capacity = self.k.shape[1]
            # buffers written under torch.inference_mode are read-only outside it: move them once
            if need > capacity or (self.k.is_inference() and not torch.is_inference_mode_enabled()):
                self._move_to_new_buffers(0, self.length, max(need, min(2 * capacity, self.bound), capacity))
            # past every row handed out so far: invisible to the version checks of graphs that
            # saved those rows (see the class docstring), and no copy of the kept rows
            self.k.data[:, self.length:need] = k
            self.v.data[:, self.length:need] = v
        self.length = need
        k_rows, v_rows = self.k[:, :need], self.v[:, :need]
        self._trim()
        return k_rows, v_rows

    def _trim(self):
        new_start = window_start(self.seen, self.segment_lengths)
        if new_start > self.start:
            drop = new_start - self.start
            keep = self.length - drop
            # room to grow by doubling, but never past what a decode step needs
            self._move_to_new_buffers(drop, keep, max(keep, min(2 * keep, self.bound), min(64, self.bound)))
            self.start = new_start

    def crop(self, tokens: int):
        """Forget the last `tokens` tokens (speculative decoding's rollback)."""
        tokens = check_int("tokens", tokens, 0)
        if tokens == 0 or self.k is None:
            return
        seen = self.seen - tokens
        if seen < 0 or window_start(seen, self.segment_lengths) < self.start:
            raise ValueError(f"cannot remove {tokens} tokens: the cache holds positions {self.start}..{self.seen - 1} "
                             f"and the rows a query at position {max(seen, 0)} reads from position "
                             f"{window_start(max(seen, 0), self.segment_lengths)} on were already dropped")
        self._move_to_new_buffers(0, self.length - tokens, self.length - tokens)

    def map_batch(self, fn):
        """Apply fn to the batch dimension of the kept rows (beam search reorders, repeats)."""
        if self.k is not None:
            self.k = fn(self.k[:, :self.length]).contiguous()
            self.v = fn(self.v[:, :self.length]).contiguous()

    def to(self, device):
        if self.k is not None:
            self.k, self.v = self.k.to(device), self.v.to(device)

    def reset(self):
        self.k = self.v = None
        self.start = self.length = 0


class DilatedKVCache:
    """A key/value cache for dilated-attention decoding that keeps only the rows a later query
    can read: per layer at most the longest segment's rows for LongNet's schedules (powers of
    two), however long the generation runs. Outputs equal those of decoding against the full
    cache (see the module docstring for the rule and what it does not drop).

    Layout is the library's: k, v (B, n, Hkv, D). Per step and layer::

        cache = DilatedKVCache([2048, 4096], [1, 2])
        out = cache.attend(q, k_new, v_new, layer_idx)     # q (B, n, Hq, D): the new tokens' queries

    or `k_rows, v_rows = cache.update(k_new, v_new, layer_idx)` and any call of
    `dilated_attention(q, k_rows, v_rows, ...)` with the same patterns. The rows returned are
    views, valid after later updates too. For transformers models use
    `triton_dilated.integrations.transformers.DilatedCache` (a transformers `Cache`).

    num_heads, num_kv_heads (optional): the query and key/value head counts. Given, every call
    checks them, which is what tells tensors in transformers' (B, H, n, D) layout from the
    library's (B, n, H, D) in every case. Without them the cache catches that layout where the
    shapes show it: q and k with different token counts (GQA, MQA), new rows whose head count
    differs from the cached rows' (a prefill, then a decode step), and a one-head q of several
    tokens, the shape of a heads-first decode step (q (1, 16, 1, 64)), which warns (pass
    num_heads=1 for a real one-head model). Equal chunks in heads-first layout with Hq == Hkv
    are indistinguishable from a valid call until the token count changes.
    """

    def __init__(self, segment_lengths, dilation_rates, *, mode="longnet", offsets="modulo", num_heads=None,
                 num_kv_heads=None):
        self.num_heads = None if num_heads is None else check_int("num_heads", num_heads, 1)
        self.num_kv_heads = None if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads, 1)
        if self.num_heads is not None and self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads must be a multiple of num_kv_heads (GQA), got {self.num_heads} and "
                             f"{self.num_kv_heads}")
        self.patterns = check_patterns(segment_lengths, dilation_rates, mode, offsets)
        self.segment_lengths = [w for w, _ in self.patterns]
        self.dilation_rates = [r for _, r in self.patterns]
        self.mode, self.offsets = mode, offsets
        self.layers: dict[int, KeptRows] = {}   # by layer index: only the layers written (any indices)
        bound = decode_rows_bound(self.segment_lengths)
        # small non-nested schedules ([6, 4]: 14 rows) stay quiet
        if bound > LOOSE_BOUND_FACTOR * max(self.segment_lengths):
            warnings.warn(f"DilatedKVCache: segment lengths {self.segment_lengths} are not nested (each dividing the "
                          f"next), so rows can only be dropped in steps of their lcm: a layer may keep up to "
                          f"{bound:,} rows (max(w) + lcm(w) - min(w)) instead of max(w) = {max(self.segment_lengths):,}."
                          f" Nested lengths (e.g. powers of two) keep the cache at max(w).", UserWarning, stacklevel=2)

    def _layer(self, layer_idx) -> KeptRows:
        layer_idx = check_int("layer_idx", layer_idx, 0)
        if layer_idx not in self.layers:
            self.layers[layer_idx] = KeptRows(self.segment_lengths)
        return self.layers[layer_idx]

    def update(self, k, v, layer_idx: int = 0):
        """Append the new rows k, v (B, n, Hkv, D) of layer `layer_idx`; return (k_rows, v_rows),
        (B, m, Hkv, D): the rows the new tokens' queries read, the new ones last. Written in
        place (no copy of the kept rows per step), also while autograd records: a graph that
        saved rows returned earlier still backpropagates (KeptRows). New rows that require grad
        are concatenated instead, so that gradients reach them."""
        if self.num_kv_heads is not None and isinstance(k, torch.Tensor) and k.dim() == 4 \
                and k.shape[2] != self.num_kv_heads:
            raise ValueError(f"k and v must be (B, n, Hkv, D) with Hkv = num_kv_heads = {self.num_kv_heads}, got k "
                             f"{tuple(k.shape)}. In transformers' (B, H, n, D) layout? pass k.transpose(1, 2), "
                             f"likewise v")
        return self._layer(layer_idx).append(k, v)

    def attend(self, q, k, v, layer_idx: int = 0, *, causal=True, scale=None, backend="auto"):
        """update(k, v, layer_idx), then dilated attention of q (B, Nq, Hq, D), the queries of
        the last Nq positions, over the rows returned."""
        if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == k.dim() == 4 \
                and q.shape[1] != k.shape[1]:
            raise ValueError(f"q and the new key/value rows must hold the same new tokens: q (B, n, Hq, D), k and v "
                             f"(B, n, Hkv, D) with one n; got q {tuple(q.shape)}, k {tuple(k.shape)}. In "
                             f"transformers' (B, H, n, D) layout? pass q.transpose(1, 2) and likewise k, v")
        if self.num_heads is not None and isinstance(q, torch.Tensor) and q.dim() == 4 \
                and q.shape[2] != self.num_heads:
            raise ValueError(f"q must be (B, n, Hq, D) with Hq = num_heads = {self.num_heads}, got q {tuple(q.shape)}. "
                             f"In transformers' (B, H, n, D) layout? pass q.transpose(1, 2) and likewise k, v")
        # everything dilated_attention would refuse, before the rows are written: a failed call
        # leaves the cache as it was (a retry must not append the tokens twice)
        check_qkv(q, k, v)
        check_flags(causal=causal)
        check_scale(scale, q.shape[-1])
        resolve_backend(backend, q.device)
        k_rows, v_rows = self.update(k, v, layer_idx)     # its errors first: they say more than the warning
        if self.num_heads is None and q.shape[2] == 1 and q.shape[1] > 1:
            warnings.warn(f"DilatedKVCache.attend: q {tuple(q.shape)} is read as {q.shape[1]} tokens of one head "
                          f"(layout (B, n, H, D)). In transformers' (B, H, n, D) layout, a decode step of "
                          f"{q.shape[1]} heads? pass q.transpose(1, 2) and likewise k, v. A one-head model: pass "
                          f"num_heads=1 to DilatedKVCache, which checks the heads and silences this.",
                          UserWarning, stacklevel=2)
        with quiet_heads_warning(q.shape[2], k_rows.shape[1]):
            return dilated_attention(q, k_rows, v_rows, self.segment_lengths, self.dilation_rates, causal=causal,
                                     scale=scale, mode=self.mode, offsets=self.offsets, backend=backend)

    def seq_length(self, layer_idx: int = 0) -> int:
        """Tokens written to layer `layer_idx` (the position of the next one)."""
        return self.layers[layer_idx].seen if layer_idx in self.layers else 0

    def start(self, layer_idx: int = 0) -> int:
        """Position of the first row layer `layer_idx` still holds."""
        return self.layers[layer_idx].start if layer_idx in self.layers else 0

    def rows(self, layer_idx: int = 0) -> int:
        """Rows layer `layer_idx` holds."""
        return self.layers[layer_idx].length if layer_idx in self.layers else 0

    @property
    def max_decode_rows(self) -> int:
        """The most rows a layer holds during a decode step (one new token at a time)."""
        return decode_rows_bound(self.segment_lengths)

    @property
    def nbytes(self) -> int:
        """Bytes of key and value buffers held, all layers."""
        return sum(layer.nbytes for layer in self.layers.values())

    def reset(self):
        for layer in self.layers.values():
            layer.reset()

    def __repr__(self):
        return (f"DilatedKVCache(segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}, "
                f"layers={len(self.layers)}, seen={self.seq_length()}, rows={self.rows()})")


class quiet_heads_warning(warnings.catch_warnings):
    """Silence dilated_attention's "(B, H, N, D) layout?" warning, which fires when a short
    cache (fewer rows than heads) meets patterns that cover it: expected while decoding."""

    def __init__(self, num_heads: int, rows: int):
        super().__init__()
        self.active = num_heads > rows

    def __enter__(self):
        if not self.active:
            return None
        out = super().__enter__()
        warnings.filterwarnings("ignore", message=r"q has \d+ heads but a sequence length", category=UserWarning)
        return out

    def __exit__(self, *exc):
        if self.active:
            super().__exit__(*exc)
