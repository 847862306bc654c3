"""DeepSeek Sparse Attention's lightning indexer: for each query, the top-k keys by

    score[b, s, t] = sum_h weights[b, s, h] * relu(scale * q_idx[b, s, h] . k_idx[b, t])

(transformers' DeepseekV32Indexer; its module scales the weights by H^-0.5 before, ours takes
them as given). The scores are taken one chunk of queries at a time, float32, and each chunk's
top-k is kept: memory is a chunk of queries times the keys, never the full (B, S, T) scores.
Triton scoring kernel (kernels.py) or its portable twin here; the top-k is torch.topk.
"""
from __future__ import annotations

import torch

from ..common.op_support import lazy_module, resolve_path
from ..common.validation import MAX_HEAD_DIM, SUPPORTED_DTYPES, check_bool, check_int, check_scale

_kernels = lazy_module(__package__ + ".kernels")   # imports triton

SCORE_BUDGET = 1 << 26   # float32 scores of one chunk (256 MB); the portable twin also holds its per-head logits


def check_indexer_args(q_idx, k_idx, weights, top_k):
    for name, x in (("q_idx", q_idx), ("k_idx", k_idx), ("weights", weights)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if q_idx.dim() != 4:
        raise ValueError(f"q_idx must have 4 dimensions (B, S, H, D), got shape {tuple(q_idx.shape)}")
    if k_idx.dim() != 3:
        raise ValueError(f"k_idx must have 3 dimensions (B, T, D) (one key per position, shared by the heads), "
                         f"got shape {tuple(k_idx.shape)}")
    for name, x in (("q_idx", q_idx), ("k_idx", k_idx)):
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if q_idx.dtype != k_idx.dtype:
        raise TypeError(f"q_idx and k_idx must share one dtype, got {q_idx.dtype} and {k_idx.dtype}")
    if not weights.dtype.is_floating_point:
        raise TypeError(f"weights must be a floating-point tensor, got {weights.dtype}")
    B, S, H, D = q_idx.shape
    if k_idx.shape[0] != B or k_idx.shape[2] != D:
        raise ValueError(f"k_idx must have shape (B, T, D) = ({B}, T, {D}), got {tuple(k_idx.shape)}")
    if tuple(weights.shape) != (B, S, H):
        raise ValueError(f"weights must have shape (B, S, H) = ({B}, {S}, {H}), got {tuple(weights.shape)}")
    if not (q_idx.device == k_idx.device == weights.device):
        raise ValueError(f"q_idx, k_idx and weights must be on one device, got {q_idx.device}, {k_idx.device}, "
                         f"{weights.device}")
    if D < 1 or D > MAX_HEAD_DIM:
        raise ValueError(f"the indexer's head dim must be in [1, {MAX_HEAD_DIM}], got {D}")
    return check_int("top_k", top_k, minimum=1)


def indexer_topk(q_idx, k_idx, weights, top_k, *, causal=True, scale=None, return_scores=False, backend="auto",
                 query_chunk=None):
    """The top_k keys of each query by the lightning indexer's score (module docstring).

    Args:
        q_idx: (B, S, H, D) the indexer's queries; k_idx: (B, T, D) its keys (one per position,
            shared by the heads); float16, bfloat16 or float32, one dtype. S <= T is the usual
            case: the queries are the last S positions (query s at s + T - S).
        weights: (B, S, H) per-query head weights (any float dtype; used in float32).
        top_k: how many keys per query.
        causal: only keys at or before the query's position compete.
        scale: default D^-0.5.
        return_scores: also return the selected keys' scores.
        backend: "auto", "triton" or "torch" (the scoring kernel or its portable twin).
        query_chunk: queries per chunk (default: as many as keep a chunk's float32 scores under
            SCORE_BUDGET elements).

    Returns indices int32 (B, S, top_k), by descending score, -1 where a query has fewer than
    top_k keys it may see (early queries under causal; top_k > T): indexed_attention's
    convention. With return_scores also float32 (B, S, top_k) scores, -inf at the -1 slots.
    Equal scores (relu makes exact zeros common) are ordered as torch.topk orders them.
    """
    top_k = check_indexer_args(q_idx, k_idx, weights, top_k)
    check_bool("causal", causal)
    check_bool("return_scores", return_scores)
    B, S, H, D = q_idx.shape
    T = k_idx.shape[1]
    scale = check_scale(scale, D)
    path = resolve_path(backend, str(q_idx.device), (), D, q_idx.dtype)
    if query_chunk is None:
        per_query = B * T * (H if path == "torch" else 1)
        query_chunk = max(1, SCORE_BUDGET // max(1, per_query))
    query_chunk = check_int("query_chunk", query_chunk, minimum=1)
    q = q_idx if q_idx.stride(-1) == 1 else q_idx.contiguous()
    k = k_idx if k_idx.stride(-1) == 1 else k_idx.contiguous()
    w = weights.float()
    indices = torch.full((B, S, top_k), -1, dtype=torch.int32, device=q.device)
    values = torch.full((B, S, top_k), float("-inf"), dtype=torch.float32, device=q.device)
    kept = min(top_k, T)
    for s0 in range(0, S if kept else 0, query_chunk):
        s1 = min(S, s0 + query_chunk)
        first = s0 + T - S   # the position of the chunk's first query
        if path == "triton":
            scores = _kernels().indexer_scores(q[:, s0:s1], k, w[:, s0:s1], first, scale, causal)
        else:
            scores = indexer_scores_torch(q[:, s0:s1], k, w[:, s0:s1], first, scale, causal)
        top, idx = torch.topk(scores, kept, dim=-1)
        values[:, s0:s1, :kept] = top
        indices[:, s0:s1, :kept] = torch.where(top > float("-inf"), idx, -1).to(torch.int32)
    return (indices, values) if return_scores else indices


def indexer_scores_torch(q, k, weights, first_pos: int, scale: float, causal: bool):
    """The scoring kernel's portable twin: float32 (B, S, T) scores of the queries q (B, S, H, D)
    at positions first_pos + s against k (B, T, D), weights float32 (B, S, H)."""
    logits = torch.einsum("bshd,btd->bsht", q.float(), k.float()).mul_(scale).relu_()
    scores = torch.einsum("bsh,bsht->bst", weights, logits)
    if causal:
        S, T = q.shape[1], k.shape[1]
        pos = torch.arange(S, device=q.device) + first_pos
        scores = scores.masked_fill(torch.arange(T, device=q.device)[None, :] > pos[:, None], float("-inf"))
    return scores
