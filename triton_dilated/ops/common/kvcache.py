"""The serve doors' shared pieces (`*_attention_with_kvcache`, FlashAttention's
`flash_attn_with_kvcache` shape): argument checks that read only shapes, dtypes and devices,
the in-place append of new key/value rows, the value checks that run only when asked, and the
route a call takes (`serve_route`): the decode kernels for a decode step, the query-offset path
(common/query_offset.py) for chunked prefill and for gradients on the Triton path.

A decode step reads no tensor's values on the host unless `validate=True`: no `.tolist()`,
`.item()`, `bool(tensor)` and no shape computed from values, so it launches without waiting
for the device and can be captured in a CUDA graph or traced once by torch.compile. Chunked
prefill (more than MAX_DECODE_QUERIES queries) reads the lengths on the host once.

Lengths (FlashAttention's convention): `cache_seqlens[b]` rows of k_cache/v_cache are valid
before the call; new rows k, v (B, Nnew, Hkv, D), when given, are written at rows
cache_seqlens[b] .. cache_seqlens[b] + Nnew - 1; the attention then covers
L_b = cache_seqlens[b] + Nnew rows (Nnew = 0 without k, v), with the Nq queries the last Nq
of them (query i at L_b - Nq + i, DESIGN §5b).

FP8 cache: k_cache, v_cache of dtype float8_e4m3fn with float32 descales k_descale, v_descale
(Hkv,), FlashAttention-3's names and meaning: the key a row holds is k_cache * k_descale[h]
(per key/value head h; one scale per layer and head). New rows are quantised on append,
k / k_descale rounded to nearest-even and saturated to +-448 (e4m3's largest finite value),
with a non-finite input kept NaN (e4m3fn has no Inf: a saturated Inf would hide it, DESIGN §6).
The decode paths fold the descales into the query (k_descale) and the output (v_descale) in
float32, which is the attention over the dequantised rows.
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .first_order import needs_grad
from .op_support import check_path, lazy_module
from .validation import check_bool, check_lengths_tensor

_kernels = lazy_module(__package__ + ".decode_kernels")   # imports triton

MAX_DECODE_QUERIES = 16   # = decode.DECODE_MAX_QUERIES: longer query blocks are chunked prefill
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0           # e4m3's largest finite value (S.1111.110): quantisation saturates there


def capacity(k_cache, block_table) -> int:
    """Rows a cache row can hold: Nk, or max_pages * page_size for a paged cache."""
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


def cache_view(k_cache, block_table, batch: int, q=None):
    """A (B, capacity, Hkv, D) stand-in for shape checks (check_qkv): the cache itself, or for
    a page pool a zero-stride expand of its first row (no copy); for an FP8 cache a
    zero-stride expand of an empty row in q's dtype (the cache's dtype is checked apart)."""
    if k_cache.dtype == FP8_DTYPE and q is not None:
        return q.new_empty((1, 1, *k_cache.shape[2:])).expand(batch, capacity(k_cache, block_table), -1, -1)
    if block_table is None:
        return k_cache
    return k_cache[:1, :1].expand(batch, capacity(k_cache, block_table), -1, -1)


def check_row_index(name: str, x, q, what: str) -> None:
    """A per-batch-row index tensor (cache_batch_idx, cache_leftpad): int32 (B,) on q's device
    (type, dtype, shape and device only; no value read)."""
    B = q.shape[0]
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int32:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} must be an int32 tensor (B,) = ({B},) on q's device ({what}), got {got}")
    if tuple(x.shape) != (B,):
        raise ValueError(f"{name} must have shape (B,) = ({B},) ({what}), got {tuple(x.shape)}")
    if x.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}; a copy from elsewhere would wait for the "
                         f"host), got {x.device}")


def batch_rows_table(q, k_cache, block_table, cache_batch_idx, validate):
    """The block table a call with cache_batch_idx runs with (FlashAttention's argument: batch
    row b reads and writes row cache_batch_idx[b] of a contiguous cache (B_cache, Nk, Hkv, D)):
    the cache seen as a page pool of B_cache pages of Nk rows and cache_batch_idx as a block
    table of one page per row, (B, 1), a view. Every path then takes the paged route (append,
    decode kernels, portable gather, chunked prefill), which reads and writes exactly those
    rows; an index outside [0, B_cache) reads and writes nothing (a page outside the pool).
    Refused with block_table (a paged cache maps its rows there; FlashAttention refuses both).
    validate=True checks the indices on the host. Without cache_batch_idx: block_table."""
    if cache_batch_idx is None:
        return block_table
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        return block_table   # check_kvcache_args names the argument
    if block_table is not None:
        raise ValueError("cache_batch_idx maps batch rows to rows of a contiguous cache; a paged cache maps them "
                         "through block_table: give one of them (as FlashAttention), not both")
    check_row_index("cache_batch_idx", cache_batch_idx, q, "the cache row each batch row reads and writes")
    if validate or (q.shape[1] > MAX_DECODE_QUERIES and not torch.compiler.is_compiling()):   # as chunked prefill
        for b, i in enumerate(cache_batch_idx.tolist()):
            if not 0 <= i < k_cache.shape[0]:
                raise ValueError(f"cache_batch_idx[{b}] = {i}, outside the cache's rows [0, {k_cache.shape[0]})")
    return cache_batch_idx.view(-1, 1)


def lse_flag(return_lse, return_softmax_lse) -> bool:
    """return_lse, or FlashAttention's name for it, return_softmax_lse (None: not given);
    both given must agree."""
    check_bool("return_lse", return_lse)
    if return_softmax_lse is None:
        return return_lse
    check_bool("return_softmax_lse", return_softmax_lse)
    if return_lse and not return_softmax_lse:
        raise ValueError("return_softmax_lse is FlashAttention's name for return_lse: give one of them, got "
                         "return_lse=True and return_softmax_lse=False")
    return return_softmax_lse


def check_block_table(block_table, B: int, device) -> None:
    """block_table: an int32 tensor (B, max_pages >= 1) on `device` (q's)."""
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
        got = block_table.dtype if isinstance(block_table, torch.Tensor) else type(block_table).__name__
        raise TypeError(f"block_table must be an int32 tensor (B, max_pages), got {got}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.shape[1] < 1:
        raise ValueError(f"block_table must have shape (B, max_pages) = ({B}, max_pages >= 1), got "
                         f"{tuple(block_table.shape)}")
    if block_table.device != device:
        raise ValueError(f"block_table must be on q's device ({device}), got {block_table.device}")


def check_descales(q, k_cache, v_cache, k_descale, v_descale) -> None:
    """An FP8 cache (both caches float8_e4m3fn) needs both descales, float32 (Hkv,) on q's
    device; any other cache takes none."""
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8 != (v_cache.dtype == FP8_DTYPE):
        raise TypeError(f"k_cache and v_cache must both be float8_e4m3fn or both not, got {k_cache.dtype} and "
                        f"{v_cache.dtype}")
    if not fp8:
        if k_descale is not None or v_descale is not None:
            raise ValueError(f"k_descale and v_descale apply to a float8_e4m3fn cache only, got a {k_cache.dtype} "
                             f"cache (leave them None)")
        return
    hkv = k_cache.shape[2]
    for name, x in (("k_descale", k_descale), ("v_descale", v_descale)):
        if x is None:
            raise ValueError(f"a float8_e4m3fn cache needs {name}: a float32 tensor ({hkv},), one scale per key/value "
                             f"head (the stored value times it is the key or value), got None")
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{name} must be a float32 tensor ({hkv},), got {got}")
        if tuple(x.shape) != (hkv,):
            raise ValueError(f"{name} must have shape (Hkv,) = ({hkv},), got {tuple(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {x.device}")


def check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, block_table, validate, k_descale=None,
                       v_descale=None, cache_leftpad=None) -> None:
    """Shape/dtype/device checks (no value read): q (B, Nq, Hq, D) with Nq >= 1;
    k_cache, v_cache (B, Nk, Hkv, D) like q (or float8_e4m3fn with k_descale, v_descale), or
    with block_table int32 (B, max_pages) on q's device page pools (num_pages, page_size, Hkv,
    D); k, v both or neither, (B, Nnew, Hkv, D) with Nnew <= the capacity, in the cache's dtype
    (q's for an FP8 cache: quantised on append); cache_seqlens an int32 (or int64) tensor (B,)
    on q's device; cache_leftpad None or int32 (B,) on q's device."""
    check_bool("validate", validate)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, N, H, D), got shape {tuple(x.shape)}")
    B, Nq = q.shape[:2]
    if block_table is not None:
        check_block_table(block_table, B, q.device)
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache and v_cache (page pools) must have the same shape, got "
                             f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    check_descales(q, k_cache, v_cache, k_descale, v_descale)
    if k_cache.dtype == FP8_DTYPE and (k_cache.shape != v_cache.shape or k_cache.device != q.device or
                                       k_cache.shape[-1] != q.shape[-1] or
                                       block_table is None and k_cache.shape[0] != B):
        # check_qkv sees a stand-in in q's dtype (cache_view): the cache's own shape is checked here
        rows = "B" if block_table is None else "num_pages"
        raise ValueError(f"k_cache and v_cache (float8_e4m3fn) must have one shape ({rows}, .., Hkv, D) with B = "
                         f"{B}, D = {q.shape[-1]}, on q's device ({q.device}), got {tuple(k_cache.shape)} on "
                         f"{k_cache.device} and {tuple(v_cache.shape)} on {v_cache.device}")
    new_dtype = q.dtype if k_cache.dtype == FP8_DTYPE else k_cache.dtype
    if Nq < 1:
        raise ValueError(f"q must hold at least one query row per batch row, got {Nq}")
    if (k is None) != (v is None):
        raise ValueError(f"k and v must be given together (new rows to append) or both be None, got "
                         f"k={'None' if k is None else 'a tensor'}, v={'None' if v is None else 'a tensor'}")
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
            want = (B, x.shape[1] if x.dim() == 4 else "Nnew", *k_cache.shape[2:])
            if x.dim() != 4 or x.shape[0] != B or tuple(x.shape[2:]) != tuple(k_cache.shape[2:]):
                raise ValueError(f"{name} (new rows) must have shape (B, Nnew, Hkv, D) = {want} like k_cache, got "
                                 f"{tuple(x.shape)}")
            if x.dtype != new_dtype or x.device != k_cache.device:
                whose = "q's dtype (an FP8 cache quantises new rows)" if new_dtype != k_cache.dtype else \
                    "k_cache's dtype"
                raise TypeError(f"{name} must have {whose} and k_cache's device ({new_dtype}, {k_cache.device}), "
                                f"got {x.dtype}, {x.device}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k and v must hold the same number of new rows, got {k.shape[1]} and {v.shape[1]}")
        if k.shape[1] > capacity(k_cache, block_table):
            raise ValueError(f"k holds {k.shape[1]} new rows, more than the cache's {capacity(k_cache, block_table)}")
    check_lengths_tensor(cache_seqlens, B, " on q's device")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens must be on q's device ({q.device}; a copy from elsewhere would wait for "
                         f"the host), got {cache_seqlens.device}")
    if cache_leftpad is not None:
        check_row_index("cache_leftpad", cache_leftpad, q, "the cache row where each batch row's keys start")


def check_kvcache_values(cache_seqlens, num_new: int, cache_len: int, block_table=None,
                         num_pages: int = 0, descales=(), cache_leftpad=None) -> None:
    """validate=True: every row's length after the append, cache_seqlens[b] + Nnew, must lie
    in [0, capacity] (no row past the cache; a row shorter than its queries is valid:
    common.decode.query_positions),
    cache_seqlens >= 0,
    the pages those rows use must be in [0, num_pages), FP8 descales finite and positive, and
    cache_leftpad[b] in [0, cache_seqlens[b]] (FlashAttention's rule: the pad lies before the
    row's end).
    Reads the values on the host (a sync: for debugging, not the hot path)."""
    for name, x in zip(("k_descale", "v_descale"), descales):
        if x is not None and not bool(torch.isfinite(x).all() & (x > 0).all()):
            raise ValueError(f"{name} must be finite and positive, got {x.tolist()}")
    lengths = cache_seqlens.tolist()
    for b, n in enumerate(lengths):
        if n < 0 or n + num_new > cache_len:
            raise ValueError(f"cache_seqlens[{b}] = {n}: with {num_new} new rows the row holds {n + num_new}, which "
                             f"must lie in [0, {cache_len}] (no row past the cache) with cache_seqlens >= 0")
    if cache_leftpad is not None:
        for b, (pad, n) in enumerate(zip(cache_leftpad.tolist(), lengths)):
            if not 0 <= pad <= n:
                raise ValueError(f"cache_leftpad[{b}] = {pad} must lie in [0, cache_seqlens[{b}]] = [0, {n}] (the "
                                 f"row's keys start there)")
    if block_table is None:
        return
    page_size = cache_len // block_table.shape[1]
    for b, (n, pages) in enumerate(zip(lengths, block_table.tolist())):
        used = pages[:-(-(n + num_new) // page_size)]
        bad = [p for p in used if not 0 <= p < num_pages]
        if bad:
            raise ValueError(f"block_table[{b}] holds page {bad[0]}, outside the pool's [0, {num_pages}) pages, among "
                             f"the {len(used)} pages its {n + num_new} rows use")


def quantise_fp8(x, descale):
    """x (..., Hkv, D) as float8_e4m3fn rows of a cache with descale (Hkv,): x / descale in
    float32, rounded to nearest-even (relative error <= 2^-4 for |x / descale| >= 2^-6, e4m3's
    smallest normal; absolute <= 2^-10 * descale below it), saturated to +-448. A NaN or Inf
    element becomes NaN (x * 0 is NaN exactly there): e4m3fn has no Inf, and the NaN rule
    (DESIGN §6) must still see it."""
    x = x.float()
    y = (x / descale[:, None]).clamp(-FP8_MAX, FP8_MAX) + x * 0
    return y.to(FP8_DTYPE)


def append_rows(k_cache, v_cache, k, v, cache_seqlens, block_table=None, k_descale=None, v_descale=None):
    """Write k, v (B, Nnew, Hkv, D) into k_cache, v_cache at rows cache_seqlens[b] + j (through
    block_table for a page pool), in place, without a host sync (one index_put_ per cache);
    into an FP8 cache quantised with the descales (quantise_fp8). Returns the lengths after the
    append: cache_seqlens + Nnew.

    A batch row whose rows do not lie in [0, capacity), or (paged) whose pages do not lie in
    the pool, writes nothing (validate=False lets such a row through; an index past the cache
    would stop a CUDA context, a negative one wrote into the cache's last rows): its rows are
    aimed at rows 0.. of the cache (page ids clamped into the pool) and given their own
    values back."""
    if k is None:
        return cache_seqlens
    if k_cache.dtype == FP8_DTYPE:
        k, v = quantise_fp8(k, k_descale), quantise_fp8(v, v_descale)
    n, device = k.shape[1], k_cache.device
    cap = capacity(k_cache, block_table)
    start = cache_seqlens.long()
    ok = (start >= 0) & (start + n <= cap)                                  # (B,)
    rows = (torch.where(ok, start, 0)[:, None] + torch.arange(n, device=device)).clamp(max=cap - 1)
    batch = torch.arange(k.shape[0], device=device)[:, None]
    if block_table is not None:
        num_pages, page_size = k_cache.shape[:2]
        pages = block_table[batch, rows // page_size].long()
        ok = ok & ((pages >= 0) & (pages < num_pages)).all(dim=1)
        batch, rows = pages.clamp(0, num_pages - 1), rows % page_size
    keep = ok.view(-1, 1, 1, 1)
    for cache, new in ((k_cache, k), (v_cache, v)):
        bits = cache.view(torch.uint8) if cache.dtype == FP8_DTYPE else cache   # torch.where has no float8
        new = new.view(torch.uint8) if cache.dtype == FP8_DTYPE else new
        bits[batch, rows] = torch.where(keep, new, bits[batch, rows])
    return cache_seqlens + n


# ----------------------------------------------------------------------------- plans

class PlanCache:
    """Serve plans keyed by what their checks and tables read (serve_key), built at a key's
    first call: a bounded dict, the oldest plan dropped first. `builds` counts the plans built."""

    def __init__(self, size: int = 256):
        self.plans, self.size, self.builds = {}, size, 0

    def get(self, key, build):
        plan = self.plans.get(key)
        if plan is None:
            plan = build()
            if len(self.plans) >= self.size:
                del self.plans[next(iter(self.plans))]
            self.plans[key] = plan
            self.builds += 1
        return plan

    def clear(self) -> None:
        self.plans.clear()


_PLAIN = frozenset((bool, int, float, str, type(None)))   # immutable values a key may hold


def serve_key(tensors, lists, scalars):
    """A serve call's plan key: each tensor's (shape, dtype, device) (what the argument checks
    read of it; None stays None), the integer lists as tuples and the other keywords, with
    every value's type (causal=1 must not find causal=True's plan: its check refuses it). None
    (no plan kept) where a value is not a plain bool, int, float, str or None (a tensor or an
    array could change in place), or a list not a list or tuple; on a CPU tensor the key holds
    TRITON_INTERPRET, which decides the path there. tensors[0] (q) is a tensor."""
    key = [(x.shape, x.dtype, x.device) if isinstance(x, torch.Tensor) else (x if x is None else type(x))
           for x in tensors]
    types = [*map(type, scalars)]
    for x in lists:
        if type(x) not in (list, tuple):
            return None
        key.append(tuple(x))
        types += map(type, x)
    if not _PLAIN.issuperset(types):
        return None
    key += (scalars, tuple(types))
    if key[0][2].type == "cpu":
        key.append(os.environ.get("TRITON_INTERPRET"))
    return tuple(key)


def kernel_lengths(lengths, device) -> torch.Tensor:
    """The per-row lengths as the Triton kernels read them: int32 (B,), contiguous, on `device`.
    The kernels load LENS + b, so a strided or expanded tensor (cache_seqlens[::2], a
    stride-0 expand) would read the wrong rows, or past the tensor."""
    return lengths.to(device=device, dtype=torch.int32).contiguous()


def append_kv(path, k_cache, v_cache, k, v, cache_seqlens, block_table=None, k_descale=None, v_descale=None, q=None,
              rotary=None):
    """Append k, v (None: nothing) at rows cache_seqlens[b] + j of the caches, in place, without
    a host sync, as append_rows (rows out of range write nothing): on the Triton path the
    append kernel (one launch, decode_kernels.AppendLaunch), else append_rows' aten ops, which
    also take any append autograd must record (gradients through the appended rows). Under
    torch.compile the custom op `triton_dilated::append_kv`, which mutates k_cache and v_cache:
    one opaque in-place op in the traced graph (Inductor runs it in place; aot_eager, as it did
    index_put_, on copies of the caches copied back).

    Returns q: with rotary (a Rotary of rotary_plan; it comes with k) q and k rotated first,
    fused into the same launch on the Triton path without gradients (AppendLaunch writes the
    rotated q into a new tensor; under torch.compile the custom op
    `triton_dilated::append_rotary`), else in PyTorch (apply_rotary) before the append."""
    if k is None:
        return q
    if rotary is not None and (path != "triton" or needs_grad(k_cache, v_cache, k, v, q, rotary.cos, rotary.sin)):
        q, k = rotary.apply(q, k, cache_seqlens)   # the PyTorch route: portable, or recorded by autograd
        rotary = None
    if needs_grad(k_cache, v_cache, k, v):
        append_rows(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale)
    elif torch.compiler.is_compiling():
        if rotary is not None:
            return _append_rotary_op(k_cache, v_cache, q, k, v, cache_seqlens, block_table, k_descale, v_descale,
                                     rotary.cos, rotary.sin, rotary.interleaved, rotary.causal)
        _append_kv_op(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale, path)
    elif path == "triton":
        return plan_append(k_cache, k, block_table).run(k_cache, v_cache, k, v,
                                                        kernel_lengths(cache_seqlens, k_cache.device), block_table,
                                                        k_descale, v_descale, q, rotary)
    else:
        append_rows(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale)
    return q


def plan_append(k_cache, k, block_table=None):
    """The Triton append planned for the shapes of k_cache and k (decode_kernels.AppendLaunch:
    `run` launches it; a serve plan keeps one)."""
    return _kernels().AppendLaunch(k_cache, k, block_table)


@torch.library.custom_op("triton_dilated::append_kv", mutates_args=("k_cache", "v_cache"))
def _append_kv_op(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, cache_seqlens: Tensor,
                  block_table: Optional[Tensor], k_descale: Optional[Tensor], v_descale: Optional[Tensor],
                  path: str) -> None:
    """append_kv's eager work, as one op that writes k_cache and v_cache in place."""
    check_path(path)
    append_kv(path, k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale)


@_append_kv_op.register_fake
def _(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale, path):
    return None


@torch.library.custom_op("triton_dilated::append_rotary", mutates_args=("k_cache", "v_cache"))
def _append_rotary_op(k_cache: Tensor, v_cache: Tensor, q: Tensor, k: Tensor, v: Tensor, cache_seqlens: Tensor,
                      block_table: Optional[Tensor], k_descale: Optional[Tensor], v_descale: Optional[Tensor],
                      cos: Tensor, sin: Tensor, interleaved: bool, causal: bool) -> Tensor:
    """append_kv's fused Triton append with rotary, as one op that writes k_cache and v_cache in
    place and returns the rotated q (a new contiguous tensor)."""
    return append_kv("triton", k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale, q,
                     Rotary(cos, sin, interleaved, causal))


@_append_rotary_op.register_fake
def _(k_cache, v_cache, q, k, v, cache_seqlens, block_table, k_descale, v_descale, cos, sin, interleaved, causal):
    return q.new_empty(q.shape)


def append_and_route(q, path, k_cache, v_cache, k, v, cache_seqlens, block_table, validate, k_descale=None,
                     v_descale=None, cache_leftpad=None, rotary=None):
    """What both serve doors do once their arguments are checked and their path picked
    (op_support.resolve_path: the same eager and under torch.compile): run the value checks
    when asked (always for chunked prefill, which reads the lengths anyway) and append k, v
    (quantised into an FP8 cache; with rotary rotated, and q too: append_kv). Returns (q,
    rotated with rotary, the lengths after the append, whether the call decodes:
    serve_route)."""
    decodes = serve_route(q, path, k_cache, v_cache, k, v)
    if validate or not decodes:
        check_kvcache_values(cache_seqlens, 0 if k is None else k.shape[1], capacity(k_cache, block_table),
                             block_table, k_cache.shape[0], (k_descale, v_descale), cache_leftpad)
    q = append_kv(path, k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale, q, rotary)
    return q, (cache_seqlens if k is None else cache_seqlens + k.shape[1]), decodes


def serve_route(q, path, *tensors) -> bool:
    """Whether a serve call takes its decode path (True: the decode kernel, or the portable
    decode, no host sync) or the query-offset path (False): more than MAX_DECODE_QUERIES
    queries (chunked prefill), or gradients on the Triton path (the decode kernel has no
    backward; the training kernels do). Under torch.compile always the decode path (its
    custom op; chunked prefill reads the lengths on the host, which fullgraph cannot trace)."""
    if torch.compiler.is_compiling():
        return True
    if q.shape[1] > MAX_DECODE_QUERIES:
        return False
    return path != "triton" or not needs_grad(q, *(t for t in tensors if t is not None))


def row_lengths(lengths, leftpad=None) -> list:
    """The keys each row holds, on the host (chunked prefill's one read): lengths[b] (rows
    after the append, from cache row 0) less the row's cache_leftpad (clamped at 0)."""
    if leftpad is not None:
        lengths = lengths - leftpad.clamp(min=0).to(lengths.dtype)
    return [int(n) for n in lengths.tolist()]


def contiguous_rows(cache, block_table, rows: int, dtype, descale=None, leftpad=None):
    """(B, rows, Hkv, D) in `dtype`: the first `rows` positions of every cache row, for the
    query-offset path (chunked prefill), which runs the training kernels on contiguous keys.
    A contiguous cache in `dtype` is sliced (a view: gradients reach it); a page pool is
    gathered through block_table; an FP8 cache is dequantised (times its descale). leftpad
    (cache_leftpad, long (B,)): row b's positions start at its cache row leftpad[b] (gathered;
    positions past the cache read its last row, which the lengths leave unread)."""
    if block_table is None and leftpad is None:
        out = cache[:, :rows]
    else:
        cap = capacity(cache, block_table)
        pos = torch.arange(rows, device=cache.device)
        if leftpad is not None:
            pos = (pos + leftpad.long().clamp(min=0)[:, None]).clamp(max=cap - 1)       # (B, rows)
        if block_table is None:
            out = cache[torch.arange(cache.shape[0], device=cache.device)[:, None], pos]
        else:
            page_size = cache.shape[1]
            pages = block_table[:, pos // page_size] if pos.dim() == 1 else block_table.gather(1, pos // page_size)
            out = cache[pages.long(), pos % page_size]
    if cache.dtype == FP8_DTYPE:
        return (out.float() * descale.view(1, 1, -1, 1)).to(dtype)
    return out


def portable_descaled(attend, q, k_descale, v_descale, num_kv_heads: int):
    """(out, lse) of a portable decode `attend(q)` over an FP8 cache: the descales folded in,
    k_descale into the query (scores of the dequantised keys) and v_descale into the output,
    per query head's key/value head, in float32; `attend` reads the cache's rows converted
    to float32. Without descales: attend(q)."""
    if k_descale is None:
        return attend(q)
    group = q.shape[2] // num_kv_heads
    per_head = lambda s: s.repeat_interleave(group).view(1, 1, -1, 1)  # noqa: E731
    out, lse = attend(q.float() * per_head(k_descale))
    return (out * per_head(v_descale)).to(q.dtype), lse


# ----------------------------------------------------------------------------- rotary embedding

def check_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved) -> None:
    """FlashAttention's rotary arguments: rotary_cos, rotary_sin both or neither, float
    tensors (seqlen_ro, rotary_dim / 2) of one shape on q's device with rotary_dim even and
    <= D, only with new rows k, v (FlashAttention rotates the appended k and q); a bool
    rotary_interleaved."""
    check_bool("rotary_interleaved", rotary_interleaved)
    if rotary_cos is None and rotary_sin is None:
        return
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together (or both be None)")
    if k is None:
        raise ValueError("rotary_cos and rotary_sin rotate the new rows k and the queries: give k and v (as "
                         "FlashAttention, which applies them only with new rows; rotate q yourself otherwise)")
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dtype == FP8_DTYPE:
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{name} must be a float tensor (seqlen_ro, rotary_dim / 2), got {got}")
        if x.dim() != 2 or x.shape[0] < 1 or not 1 <= 2 * x.shape[1] <= q.shape[-1]:
            raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2) with seqlen_ro >= 1 and "
                             f"2 <= rotary_dim <= D = {q.shape[-1]}, got {tuple(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {x.device}")
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_cos and rotary_sin must have one shape, got {tuple(rotary_cos.shape)} and "
                         f"{tuple(rotary_sin.shape)}")


def rotate(x, cos, sin, interleaved: bool):
    """x (B, N, H, D) with its first rotary_dim = 2 * cos.shape[-1] features rotated by the
    angles whose cos, sin (B, N, rotary_dim / 2) are given, in float32, cast back to x's dtype:
    pairs (2i, 2i+1) when interleaved (GPT-J), else (i, i + rotary_dim / 2) (GPT-NeoX); the
    other features unchanged (FlashAttention's apply_rotary_emb)."""
    half = cos.shape[-1]
    c, s = cos[:, :, None].float(), sin[:, :, None].float()
    xr = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([out.to(x.dtype), x[..., 2 * half:]], dim=-1)


def check_rotary_positions(q, k, cache_seqlens, rows: int, causal: bool) -> None:
    """validate=True: every rotary position of the call (apply_rotary's) below the tables'
    `rows` (reads the lengths on the host: a sync)."""
    if q.shape[0] == 0:
        return
    top = int(cache_seqlens.max()) + max(k.shape[1], q.shape[1] if causal else 1) - 1
    if top >= rows:
        raise ValueError(f"rotary_cos and rotary_sin hold {rows} positions, but this call rotates position {top} "
                         f"(cache_seqlens + the new rows): seqlen_ro must exceed it")


def apply_rotary(q, k, cache_seqlens, rotary_cos, rotary_sin, interleaved: bool, causal: bool,
                 validate: bool = False):
    """(q, k) rotated as flash_attn_with_kvcache does before its append, on the device with
    no host sync: new row j of batch row b at rotary position cache_seqlens[b] + j (its cache
    row: FlashAttention counts rotary positions from cache row 0 also under cache_leftpad,
    its kernels adding the pad back); query i at cache_seqlens[b] + i when causal, every
    query at cache_seqlens[b] otherwise. Positions past rotary_cos's rows read its last row
    (validate=True refuses them; FlashAttention requires seqlen_ro > the largest position).
    The PyTorch route (several aten ops, a copy of q and k); the fused one is the Triton
    append's (decode_kernels.rotate_row, the same float32 values)."""
    start = cache_seqlens.long()
    Nq = q.shape[1]
    k_pos = start[:, None] + torch.arange(k.shape[1], device=q.device)
    q_pos = start[:, None] + (torch.arange(Nq, device=q.device) if causal else torch.zeros(Nq, dtype=torch.long,
                                                                                            device=q.device))
    rows = rotary_cos.shape[0]
    if validate:
        check_rotary_positions(q, k, cache_seqlens, rows, causal)
    k_pos, q_pos = k_pos.clamp(0, rows - 1), q_pos.clamp(0, rows - 1)
    return (rotate(q, rotary_cos[q_pos], rotary_sin[q_pos], interleaved),
            rotate(k, rotary_cos[k_pos], rotary_sin[k_pos], interleaved))


class Rotary(NamedTuple):
    """A serve call's rotary embedding, checked and not yet applied (rotary_plan): the tables,
    the pair layout and whether queries rotate at their own positions (causal)."""
    cos: Tensor
    sin: Tensor
    interleaved: bool
    causal: bool

    def apply(self, q, k, cache_seqlens):
        """(q, k) rotated in PyTorch (apply_rotary)."""
        return apply_rotary(q, k, cache_seqlens, self.cos, self.sin, self.interleaved, self.causal)


def rotary_plan(q, k, cache_seqlens, rotary_cos, rotary_sin, rotary_interleaved, causal, validate):
    """A serve door's FlashAttention rotary arguments checked (check_rotary; validate=True:
    check_rotary_positions), the rotation left to the append (append_kv): returns (q, k,
    rotary), rotary a Rotary or None (no tables). Where q, k or the tables need gradients they
    are rotated here in PyTorch (rotary None), so every later check sees the rotated tensors'
    autograd; otherwise the Triton path fuses the rotation into its append launch and the
    portable path applies it there. Arguments the door checks later (q, k not 4-D tensors)
    pass through for check_kvcache_args to name."""
    if rotary_cos is None and rotary_sin is None:
        check_bool("rotary_interleaved", rotary_interleaved)
        return q, k, None
    if not (isinstance(q, torch.Tensor) and q.dim() == 4 and (k is None or isinstance(k, torch.Tensor) and
                                                             k.dim() == 4)):
        return q, k, None
    check_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved)
    check_lengths_tensor(cache_seqlens, q.shape[0], " on q's device")
    check_bool("causal", causal)
    check_bool("validate", validate)
    if validate:
        check_rotary_positions(q, k, cache_seqlens, rotary_cos.shape[0], causal)
    rotary = Rotary(rotary_cos, rotary_sin, rotary_interleaved, causal)
    if needs_grad(q, k, rotary_cos, rotary_sin):
        return (*rotary.apply(q, k, cache_seqlens), None)
    return q, k, rotary


def rotary_inputs(q, k, cache_seqlens, rotary_cos, rotary_sin, rotary_interleaved, causal, validate):
    """(q, k) after FlashAttention's rotary arguments, rotated in PyTorch (rotary_plan, then
    Rotary.apply); unchanged without them. For callers that append themselves (decode
    context parallelism)."""
    q, k, rotary = rotary_plan(q, k, cache_seqlens, rotary_cos, rotary_sin, rotary_interleaved, causal, validate)
    return (q, k) if rotary is None else rotary.apply(q, k, cache_seqlens)
