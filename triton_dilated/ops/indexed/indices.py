"""What indexed attention does with its `indices` (DESIGN §5c), in one place: the argument
checks, the canonical slot lists every path reads, the inverse lists the dK/dV kernel walks,
and the dense mask the float64 oracle builds.

Semantics (tested in tests/ops/indexed):
* `indices` int32 (or int64) (B, Nq, Hkv, topk), one row per kv head, or (B, Nq, topk), one row
  shared by every head. Query i of head h attends to the keys of row [b, i, h // (Hq // Hkv)].
* A slot is unused when its value is outside [0, Nk) (-1 by convention; any other value too:
  it is never read), and under causal=True when it lies past the query's position. Queries
  are bottom-right aligned: query i sits at position i + Nk - Nq (flash-attn's convention for
  Nq < Nk; with Nq > Nk the first Nq - Nk queries sit before position 0: under causal they see
  nothing, without it they read their slots as any query does).
* A key listed twice in one row counts once: a row is a set of keys, as transformers'
  DeepseekV32 folds indices into a boolean mask (FlashMLA's gather would count it twice).
* A row with no used slot outputs 0 with lse -inf (sinks: 0 and lse = the sink).

Canonical slots (`canonical_slots`): each row's used keys, deduplicated, ascending, first;
-1 after them; and their count. Kernels and the portable path read only these, so duplicates,
causal cuts and out-of-range values are settled once, by device sorts (no host sync).
"""
from __future__ import annotations

import torch

from ..common.validation import MAX_HEAD_DIM, check_qkv_tensors

# The absorbed-MLA shape (DeepSeek's decode: Dqk 576 = 512 latent + 64 RoPE, Dv 512) is the
# widest head the indexed kernels take.
MAX_INDEXED_HEAD_DIM = 576
INDEX_DTYPES = (torch.int32, torch.int64)


def check_inputs(q, k, v, indices, *, allow_float64: bool = False) -> None:
    """Shapes and types of an indexed-attention call: q (B, Nq, Hq, Dqk), k (B, Nk, Hkv, Dqk),
    v (B, Nk, Hkv, Dv), Hq % Hkv == 0, indices int32/int64 (B, Nq, Hkv, topk) or (B, Nq, topk),
    all on one device. No value is read."""
    check_qkv_tensors(q, k, v, allow_float64=allow_float64)
    (B, Nq, Hq, D), (Bk, Nk, Hkv, Dk) = q.shape, k.shape
    if Bk != B or v.shape[0] != B:
        raise ValueError(f"k and v must have the batch size of q ({B}), got k: {Bk}, v: {v.shape[0]}")
    if tuple(v.shape[1:3]) != (Nk, Hkv):
        raise ValueError(f"v must have the length and heads of k ({Nk}, {Hkv}), got {tuple(v.shape[1:3])}")
    if Dk != D:
        raise ValueError(f"k must have the head dim of q ({D}), got {Dk} (v may differ)")
    for name, dim in (("q and k", D), ("v", v.shape[3])):
        if dim < 1 or dim > MAX_INDEXED_HEAD_DIM:
            raise ValueError(f"the head dim of {name} must be in [1, {MAX_INDEXED_HEAD_DIM}], got {dim}")
    if Hq < 1:
        raise ValueError(f"q must have at least one head, got {Hq}")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a positive multiple of key/value heads ({Hkv})")
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be an int32 tensor (B, Nq, Hkv, topk) or (B, Nq, topk), got "
                        f"{type(indices).__name__}")
    if indices.dtype not in INDEX_DTYPES:
        raise TypeError(f"indices must be an int32 (or int64) tensor, got {indices.dtype}")
    if indices.device != q.device:
        raise ValueError(f"indices must be on the device of q ({q.device}), got {indices.device}")
    if indices.dim() == 3:
        ok = tuple(indices.shape[:2]) == (B, Nq)
    elif indices.dim() == 4:
        ok = tuple(indices.shape[:3]) == (B, Nq, Hkv)
    else:
        ok = False
    if not ok:
        raise ValueError(f"indices must have shape (B, Nq, Hkv, topk) = ({B}, {Nq}, {Hkv}, topk) or (B, Nq, topk) = "
                         f"({B}, {Nq}, topk), got {tuple(indices.shape)}")


def kernel_head_dims(q, v) -> bool:
    """Whether the Triton kernels take these head dims: up to 256 everywhere; wider heads (the
    absorbed-MLA shape, Dqk 576 and Dv 512) on GPUs with the shared memory of sm80 and newer
    (the dQ kernel's tiles take about 90 KB there; perf aot, sm80/sm90), else the portable path."""
    if q.shape[-1] <= MAX_HEAD_DIM and v.shape[-1] <= MAX_HEAD_DIM:
        return True
    return q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) >= (8, 0)


def validate_values(indices, Nk: int) -> None:
    """validate=True: every slot is -1 (unused) or in [0, Nk). Reads the values (a host sync)."""
    bad = (indices != -1) & ((indices < 0) | (indices >= Nk))
    if bool(bad.any()):
        where = tuple(int(x) for x in bad.nonzero()[0])
        raise ValueError(f"indices must be -1 (unused) or in [0, Nk) = [0, {Nk}): indices{list(where)} = "
                         f"{int(indices[where])}")


def as_rows(indices) -> torch.Tensor:
    """indices as (B, Nq, G, topk): G = Hkv, or 1 for a row shared by every head (a view)."""
    return indices.unsqueeze(2) if indices.dim() == 3 else indices


def used_slots(indices, Nq: int, Nk: int, causal: bool, lengths=None) -> torch.Tensor:
    """bool like as_rows(indices): the slots that name a key the query may read (in [0, Nk),
    and at or before its position i + Nk - Nq under causal). `lengths` (B,) on the device (the
    serve door): row b holds lengths[b] keys instead of Nk. Duplicates not settled."""
    idx = as_rows(indices)
    n = Nk if lengths is None else lengths.view(-1, 1, 1, 1).long()
    used = (idx >= 0) & (idx < n)
    if causal:
        pos = torch.arange(Nq, device=idx.device).view(1, Nq, 1, 1) + (n - Nq)
        used &= idx <= pos
    return used


def canonical_slots(indices, Nq: int, Nk: int, causal: bool, lengths=None):
    """(slots int32 (B, Nq, G, topk), count int32 (B, Nq, G)), contiguous: each row's used keys
    once each, ascending, in its first `count` slots, -1 after them. Two sorts on the device.
    `lengths`: as used_slots (Nk then bounds every row's length)."""
    idx = as_rows(indices).long()
    key = torch.where(used_slots(indices, Nq, Nk, causal, lengths), idx, Nk)
    key, _ = torch.sort(key, dim=-1)
    repeat = torch.zeros_like(key, dtype=torch.bool)
    repeat[..., 1:] = key[..., 1:] == key[..., :-1]
    key, _ = torch.sort(key.masked_fill(repeat, Nk), dim=-1)
    used = key < Nk
    slots = torch.where(used, key, -1).to(torch.int32).contiguous()
    return slots, used.sum(-1, dtype=torch.int32).contiguous()


def query_lists(slots, Nk: int):
    """The inverse of the canonical slots, for the dK/dV kernel (no atomics): for each (batch
    row b, slot row g, key t), the queries whose row lists t, ascending. Returns (start int32
    (B * G * Nk + 1,), queries int32 (B * Nq * G * topk,)): list (b, g, t) is queries[start[r] :
    start[r + 1]], r = (b * G + g) * Nk + t. A stable sort and a search on the device: no host
    sync, the same lists every run."""
    B, Nq, G, T = slots.shape
    dev = slots.device
    row = (torch.arange(B, device=dev).view(B, 1, 1, 1) * G + torch.arange(G, device=dev).view(1, 1, G, 1)) * Nk
    unused = B * G * Nk
    key = torch.where(slots >= 0, row + slots.long(), unused).flatten()
    key, order = torch.sort(key, stable=True)
    queries = (order // (G * T) % Nq).to(torch.int32)
    start = torch.searchsorted(key, torch.arange(B * G * Nk + 1, device=dev, dtype=key.dtype)).to(torch.int32)
    return start, queries


def dense_mask(indices, Nq: int, Nk: int, num_heads: int, causal: bool) -> torch.Tensor:
    """bool (B, Hq, Nq, Nk): the pairs (query, key) the call computes, a key listed twice set
    once (a scatter into a boolean mask, as transformers' eager path folds indices)."""
    idx = as_rows(indices).long()
    B, _, G, _ = idx.shape
    used = used_slots(indices, Nq, Nk, causal)
    mask = torch.zeros(B, Nq, G, Nk + 1, dtype=torch.bool, device=idx.device)
    mask.scatter_(-1, torch.where(used, idx, Nk), True)
    mask = mask[..., :Nk]
    mask = mask.expand(B, Nq, num_heads, Nk) if G == 1 else mask.repeat_interleave(num_heads // G, dim=2)
    return mask.permute(0, 2, 1, 3)
