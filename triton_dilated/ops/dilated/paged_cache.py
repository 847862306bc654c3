"""`PagedDilatedKVCache`: a page pool shared by many sequences, each holding only the pages its
next query can read (the bounded rule of `DilatedKVCache`, cache.py), the allocator a serving
engine would drive around `dilated_attention_with_kvcache(..., block_table=)`.

Per sequence the cache keeps the rows from a base position on: the window start of its next
query (cache.window_start) rounded down to a multiple of lcm(lcm(segment lengths), page_size),
so that the dropped prefix is whole pages and a multiple of every segment length (positions
relative to the base keep every segment and residue: attention over the kept rows equals
attention over the whole sequence). Pages wholly before the base go back to the pool at the
next step. For LongNet's schedules (each w divides the next) and a page size dividing max(w), a
sequence decoding one token a step holds at most max(w) / page_size pages however long it
runs (one more for steps of several tokens).

Host-side bookkeeping (Python ints, the free list) happens once per step in `begin`, which
builds the block table and the lengths on the device; the attention of each layer then runs
with no host sync. FlashInfer's plan/run shape: a step is planned once (the block table, the
lengths, and at its first attend the serve door's plan: argument checks, tables, launch
configuration, ops/dilated/serve.py ServePlan), and each layer's attend then runs that plan on
the layer's pools: the append and decode launches and little else.
"""
from __future__ import annotations

import array
import itertools
import math

import torch

from ..common.context_parallel import resolve_group
from ..common.validation import check_int
from .cache import decode_rows_bound, window_start
from .serve import dilated_attention_with_kvcache, serve_plan
from .patterns import check_patterns

POOL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)


class PagedStep:
    """One decode step of some sequences: the block table int32 (B, pages) and the lengths
    before the step int32 (B,) on the device, for every layer. It holds each sequence's
    admission (a sequence evicted, and maybe admitted again, since `begin` makes the step
    stale: its pages may belong to another sequence now) and is the sequences' only open
    step until `end` or `cancel`."""

    def __init__(self, cache, seq_ids, num_new, block_table, cache_seqlens):
        self.cache, self.seq_ids, self.num_new = cache, list(seq_ids), num_new
        self.block_table, self.cache_seqlens = block_table, cache_seqlens
        self.admissions = [cache.admission[s] for s in self.seq_ids]
        self.evictions = cache.evictions   # unchanged: no sequence evicted since, the step is current
        self.done = False
        self.plan, self.plan_key = None, None   # the serve plan of the layers' attends (attend)

    def _check_current(self, what: str) -> None:
        """Host-side checks only (Python ints): no device sync. (attend checks the admissions
        only when a sequence was evicted since begin: `evictions` counts them.)"""
        if self.done:
            raise ValueError(f"{what}: this PagedStep has ended; call cache.begin for the next step")
        for s, admission in zip(self.seq_ids, self.admissions):
            if self.cache.admission.get(s) != admission:
                raise ValueError(f"{what}: sequence {s!r} was evicted after this step began (its pages may hold "
                                 f"another sequence now); call cache.begin again")

    def attend(self, q, k_new, v_new, layer: int = 0, **kwargs):
        """dilated_attention_with_kvcache of q (B, Nq, Hq, D) for this step's sequences, k_new,
        v_new (B, num_new, Hkv, D) written into the pool of `layer` first. The first attend
        plans the step (the door's ServePlan); later layers with the same q, k_new, v_new
        shapes, dtypes and devices and no keywords run that plan without a check."""
        if self.done or self.cache.evictions != self.evictions:
            self._check_current("PagedStep.attend")
        c = self.cache
        k_pool, v_pool = c.k_pools[layer], c.v_pools[layer]
        k_descale, v_descale = c.layer_descales[layer]
        args = (q, k_pool, v_pool, k_new, v_new, self.cache_seqlens, self.block_table, k_descale, v_descale, None)
        if kwargs or c.group is not None or not (isinstance(q, torch.Tensor) and isinstance(k_new, torch.Tensor)
                                                 and isinstance(v_new, torch.Tensor)):
            group = {} if c.group is None else dict(group=c.group)   # DCP: the door's sharded call
            return dilated_attention_with_kvcache(*args[:5], cache_seqlens=self.cache_seqlens,
                                                  block_table=self.block_table, segment_lengths=c.segment_lengths,
                                                  dilation_rates=c.dilation_rates, causal=True, mode=c.mode,
                                                  offsets=c.offsets, k_descale=k_descale, v_descale=v_descale,
                                                  **group, **kwargs)
        key = (q.shape, q.dtype, q.device, k_new.shape, k_new.dtype, k_new.device, v_new.shape, v_new.dtype,
               v_new.device)
        if key != self.plan_key:
            self.plan = serve_plan(args, c.segment_lengths, c.dilation_rates,
                                   (True, None, c.mode, c.offsets, False, "auto", False, 0, None, 0.0))
            self.plan_key = key
        return self.plan(*args, c.byte_pools[layer])

    def end(self) -> None:
        """The step's tokens are written (every layer): advance the sequences."""
        if not self.done:
            self._check_current("PagedStep.end")
            for s in self.seq_ids:
                self.cache.seen[s] += self.num_new
            self._close()

    def cancel(self) -> None:
        """Drop the step without advancing its sequences (rows it wrote are written again by
        the next step); its pages stay with the sequences."""
        if not self.done:
            self._close()

    def _close(self) -> None:
        for s in self.seq_ids:
            if self.cache.open_steps.get(s) is self:
                del self.cache.open_steps[s]
        self.done = True


class PagedDilatedKVCache:
    """A pool of `num_pages` pages of `page_size` rows (keys and values, per layer) shared by
    sequences that are admitted, decoded in any interleaving and evicted.

        cache = PagedDilatedKVCache([2048, 4096], [1, 2], num_pages=4096, page_size=64, num_kv_heads=8,
                                    head_dim=128, dtype=torch.bfloat16, device="cuda", num_layers=32)
        cache.admit("a"); cache.admit("b")
        step = cache.begin(["a", "b"], 1)               # pages for one new token each, old pages freed
        for layer in range(32):
            out = step.attend(q, k_new, v_new, layer)    # q (2, 1, Hq, D), k_new/v_new (2, 1, Hkv, D)
        step.end()

    `pages_held(seq)`, `free_pages` and `rows_bound` (the most rows a sequence keeps) describe
    the memory. A step needs pages for its new tokens: the pool running out raises.

    One step per sequence at a time: `begin` for a sequence whose step has not ended (or been
    cancelled) raises, and so does a step used after one of its sequences was evicted.

    FP8 pools: dtype=torch.float8_e4m3fn with k_descale, v_descale, float32 (num_kv_heads,)
    (every layer) or (num_layers, num_kv_heads), one scale per layer and key/value head
    (dilated_attention_with_kvcache's meaning: stored value times descale; new rows, given in
    q's dtype, are quantised on append). Half the bytes of a bf16 pool.

    group (a ProcessGroup or 1-D DeviceMesh of P ranks): decode context parallelism
    (ops/common/context_parallel.py): every rank builds this cache with the same arguments
    (num_pages: its own pool) and makes the same calls; logical page j of a sequence lives on
    rank j % P (the dropped prefix is then a multiple of P pages, so a page keeps its rank), and
    a rank takes pool pages for its own pages only (the others -1 in its block table); the
    attends run dilated_attention_with_kvcache(..., group=) and return the whole result on every
    rank. pages_held and free_pages count this rank's pages.
    """

    def __init__(self, segment_lengths, dilation_rates, *, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype=torch.float32, device="cpu", num_layers: int = 1, mode: str = "longnet",
                 offsets: str = "modulo", k_descale=None, v_descale=None, group=None):
        if dtype not in POOL_DTYPES:
            raise TypeError(f"dtype must be one of {', '.join(str(d).removeprefix('torch.') for d in POOL_DTYPES)} "
                            f"(the attention's dtypes, or an FP8 pool), got {dtype}")
        patterns = check_patterns(segment_lengths, dilation_rates, mode, offsets)
        self.segment_lengths = [w for w, _ in patterns]
        self.dilation_rates = [r for _, r in patterns]
        self.mode, self.offsets = mode, offsets
        self.page_size = check_int("page_size", page_size, minimum=1)
        num_pages = check_int("num_pages", num_pages, minimum=1)
        num_layers = check_int("num_layers", num_layers, minimum=1)
        shape = (num_pages, self.page_size, check_int("num_kv_heads", num_kv_heads, minimum=1),
                 check_int("head_dim", head_dim, minimum=1))
        self.k_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.device = self.k_pools[0].device
        self.k_descale, self.v_descale = self._descales(dtype, num_layers, shape[2], k_descale, v_descale)
        # each layer's (k_descale, v_descale) rows, (None, None) for a 16/32-bit pool: no indexing per attend
        self.layer_descales = [(None, None) if self.k_descale is None else (self.k_descale[i], self.v_descale[i])
                               for i in range(num_layers)]
        # an FP8 pool's bytes, which the Triton kernels read and write (ServePlan.decode_step): no view per attend
        self.byte_pools = [None if dtype != torch.float8_e4m3fn else (k.view(torch.uint8), v.view(torch.uint8))
                           for k, v in zip(self.k_pools, self.v_pools)]
        self.group, self.rank, self.world = None, 0, 1
        if group is not None:
            self.group, self.rank, self.world = resolve_group(group, "PagedDilatedKVCache")
        # the dropped prefix: whole pages (P of them under DCP: page j stays on rank j % P) and a
        # multiple of every segment length
        self.step = math.lcm(math.lcm(*self.segment_lengths), self.page_size * self.world)
        self.rows_bound = decode_rows_bound(self.segment_lengths)
        self.free = list(range(num_pages - 1, -1, -1))   # pop() hands out low page ids first
        self.pages: dict = {}    # sequence -> physical pages (an int32 array), logical page j holding rows
        #                          base + j*page_size ...
        self.base: dict = {}     # sequence -> position of its first kept row
        self.seen: dict = {}     # sequence -> tokens written
        self.admission: dict = {}    # sequence -> a number unique to this admission (stale steps)
        self.open_steps: dict = {}   # sequence -> its PagedStep not yet ended
        self._admissions = 0
        self.evictions = 0           # evictions so far (a step begun since is current)

    def _descales(self, dtype, num_layers, num_kv_heads, k_descale, v_descale):
        """(k, v) descales float32 (num_layers, Hkv) on the pools' device for an FP8 pool, else
        (None, None); the entry point checks them further at each call."""
        if dtype != torch.float8_e4m3fn:
            if k_descale is not None or v_descale is not None:
                raise ValueError(f"k_descale and v_descale apply to a float8_e4m3fn pool only, got dtype={dtype}")
            return None, None
        out = []
        for name, x in (("k_descale", k_descale), ("v_descale", v_descale)):
            if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
                got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
                raise TypeError(f"a float8_e4m3fn pool needs {name}: a float32 tensor ({num_kv_heads},) or "
                                f"({num_layers}, {num_kv_heads}), got {got}")
            if tuple(x.shape) not in ((num_kv_heads,), (num_layers, num_kv_heads)):
                raise ValueError(f"{name} must have shape ({num_kv_heads},) or ({num_layers}, {num_kv_heads}) "
                                 f"(num_kv_heads or num_layers x num_kv_heads), got {tuple(x.shape)}")
            out.append(x.to(self.device).expand(num_layers, num_kv_heads).contiguous())
        return out[0], out[1]

    @property
    def free_pages(self) -> int:
        """Pages of the pool that no sequence holds: what `begin` can hand out for new rows
        (num_pages minus every admitted sequence's pages_held). Pages a sequence no longer
        needs (wholly before its next query's window) come back at its next `begin`; an
        evicted sequence's at once."""
        return len(self.free)

    def pages_held(self, seq) -> int:
        """Pages sequence `seq` holds now (its kept rows and the current step's)."""
        return sum(p >= 0 for p in self.pages[seq])

    def __repr__(self) -> str:
        """Host-side state only (no device access): sequences, pages held and free, the pool's
        shape, dtype, device, layers and the schedule."""
        num_pages, page_size, heads, dim = self.k_pools[0].shape
        held = sum(len(p) for p in self.pages.values())
        return (f"PagedDilatedKVCache(sequences={len(self.pages)}, pages_held={held}, free_pages={self.free_pages}, "
                f"num_pages={num_pages}, page_size={page_size}, dtype={self.k_pools[0].dtype}, device={self.device}, "
                f"num_layers={len(self.k_pools)}, num_kv_heads={heads}, head_dim={dim}, "
                f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates})")

    def admit(self, seq) -> None:
        """A new, empty sequence."""
        if seq in self.pages:
            raise ValueError(f"sequence {seq!r} is already admitted")
        self.pages[seq], self.base[seq], self.seen[seq] = array.array("i"), 0, 0
        self._admissions += 1
        self.admission[seq] = self._admissions

    def evict(self, seq) -> None:
        """Drop a sequence; its pages go back to the pool."""
        self._known(seq)
        self.evictions += 1
        self.free += [p for p in reversed(self.pages.pop(seq)) if p >= 0]
        del self.base[seq], self.seen[seq], self.admission[seq]
        self.open_steps.pop(seq, None)   # that step is stale now (PagedStep checks its admissions)

    def _known(self, seq):
        if seq not in self.pages:
            raise ValueError(f"sequence {seq!r} is not admitted (admit it first)")

    def begin(self, seq_ids, num_new: int = 1) -> PagedStep:
        """Bookkeeping for a step that writes `num_new` tokens to each of `seq_ids` (their
        queries: the last of them): return the pages no query of the step can read, take pages
        for the new rows, and build the block table and lengths on the device."""
        num_new = check_int("num_new", num_new, minimum=1)
        seq_ids = list(seq_ids)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids must be distinct, got {seq_ids}")
        for s in seq_ids:
            self._known(s)
            if s in self.open_steps:
                raise ValueError(f"sequence {s!r} has a step in progress: call end() on it (its tokens are written) "
                                 f"or cancel() before the next begin")
        for s in seq_ids:   # the first query of the step sits at seen[s]: nothing before its window is read
            keep_from = window_start(self.seen[s], self.segment_lengths) // self.step * self.step
            drop = (keep_from - self.base[s]) // self.page_size
            if drop > 0:
                self.free += [p for p in reversed(self.pages[s][:drop]) if p >= 0]
                del self.pages[s][:drop]
                self.base[s] += drop * self.page_size
        for s in seq_ids:
            have = len(self.pages[s])
            need = -(-(self.seen[s] + num_new - self.base[s]) // self.page_size) - have
            mine = [(have + i) % self.world == self.rank for i in range(need)]   # DCP: this rank's pages
            if sum(mine) > len(self.free):
                raise ValueError(f"the page pool is exhausted: sequence {s!r} needs {sum(mine)} more pages, "
                                 f"{len(self.free)} are free (evict sequences or build the cache with more num_pages)")
            self.pages[s].extend([self.free.pop() if m else -1 for m in mine])
        width = max(len(self.pages[s]) for s in seq_ids)
        table = array.array("i")   # int32, flat (the pages are int32 arrays too: memcpy), read without a copy
        for s in seq_ids:
            table.extend(self.pages[s])
            table.extend(itertools.repeat(self.pages[s][0], width - len(self.pages[s])))
        lengths = array.array("i", [self.seen[s] - self.base[s] for s in seq_ids])
        block_table = torch.frombuffer(table, dtype=torch.int32).view(len(seq_ids), width).to(self.device)
        lengths = torch.frombuffer(lengths, dtype=torch.int32).to(self.device)
        step = PagedStep(self, seq_ids, num_new, block_table, lengths)
        self.open_steps.update(dict.fromkeys(seq_ids, step))
        return step

    def attend(self, seq_ids, q, k_new, v_new, **kwargs):
        """One step of a one-layer cache: begin, attend, end."""
        step = self.begin(seq_ids, k_new.shape[1])
        try:
            out = step.attend(q, k_new, v_new, 0, **kwargs)
        except BaseException:
            step.cancel()
            raise
        step.end()
        return out
