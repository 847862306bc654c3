"""Baselines measured side by side with the kernels (DESIGN §11)."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from einops import rearrange


def sdpa_dense(q, k, v, causal: bool):
    """Dense scaled_dot_product_attention over the whole sequence (FlashAttention on a GPU)."""
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def head_group_loop(q, k, v, segment_lengths, dilation_rates, causal: bool):
    """The dilated-attention-pytorch family's loop: heads split into one group per pattern,
    einops rearrange -> stride -> SDPA -> scatter, per group. N must be a multiple of every
    segment length and H of the number of patterns. Their final `out / num_groups` is left
    out: it is a normalisation bug, not work (DESIGN §3, head_groups)."""
    b, n, h, d = q.shape
    m = len(segment_lengths)
    g = h // m
    out = torch.zeros_like(q)
    for i, (s, r) in enumerate(zip(segment_lengths, dilation_rates)):
        offset = i % r
        hmin, hmax = i * g, (i + 1) * g
        parts = [rearrange(x, "b (n s) h d -> b n s h d", s=s)[:, :, offset::r, hmin:hmax] for x in (q, k, v)]
        qs, ks, vs = (rearrange(x, "b n s h d -> (b n) h s d") for x in parts)
        x = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        x = rearrange(x, "(b n) h s d -> b n s h d", b=b)
        out_view = rearrange(out, "b (n s) h d -> b n s h d", s=s)
        out_view[:, :, offset::r, hmin:hmax] = x
    return out


def gather_indexed(q, k, v, indices, causal: bool, chunk_bytes: int = 1 << 28):
    """Indexed attention as PyTorch code would write it: each query's listed key and value rows
    gathered (torch indexing), scores, softmax, weighted sum, a chunk of queries at a time
    (gathered rows of at most ~chunk_bytes). indices (B, Nq, topk) shared by the heads, -1
    unused, with causal an index past the query's position (bottom-right) dropped; a query
    with no key gives 0. Differentiable (the gathers' backward scatters into dk, dv)."""
    B, N, H, D = q.shape
    Nk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    group, topk = H // Hkv, indices.shape[-1]
    rows = torch.arange(B, device=q.device)[:, None, None]
    chunk = max(1, chunk_bytes // max(1, B * topk * Hkv * (D + Dv) * q.element_size()))
    outs = []
    for s in range(0, N, chunk):
        idx = indices[:, s:s + chunk].long()
        keep = idx >= 0
        if causal:
            keep &= idx <= torch.arange(s, s + idx.shape[1], device=q.device)[:, None] + (Nk - N)
        kk, vv = k[rows, idx.clamp(min=0)], v[rows, idx.clamp(min=0)]            # (B, c, topk, Hkv, D)
        qq = q[:, s:s + chunk].unflatten(2, (Hkv, group))                          # (B, c, Hkv, g, D)
        scores = torch.einsum("bchgd,bcthd->bchgt", qq.float(), kk.float()) * D ** -0.5
        scores = scores.masked_fill(~keep[:, :, None, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1).nan_to_num(0.0)                          # an empty row: 0
        out = torch.einsum("bchgt,bcthe->bchge", p, vv.float())
        outs.append(out.flatten(2, 3).to(q.dtype))
    return torch.cat(outs, dim=1)


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except Exception:
        return False
    return True


_COMPILED_FLEX = None


def _compiled_flex():
    """torch.compile(flex_attention), once per process (each new shape still recompiles)."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention
        for name in ("recompile_limit", "cache_size_limit"):   # one compile per benchmarked shape
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def flex_block_sparse(layout, seq_len: int, causal: bool, device, compiled: bool = True):
    """FlexAttention with the BlockMask equivalent to `layout` (BlockLayout.to_flex_block_mask):
    fn(q, k, v) on (B, N, H, D) inputs, like the other providers. The block mask is built
    once, on the first call (a warm-up call, outside the timed ones). compiled=False runs
    flex_attention eagerly (CPU: it then evaluates the dense score matrix, so it is no
    sparse baseline there)."""
    state = {}

    def fn(q, k, v):
        if not state:   # built on first use, so a torch without it fails one measurement, not the sweep
            from torch.nn.attention.flex_attention import flex_attention
            state["mask"] = layout.to(device).to_flex_block_mask(seq_len, causal=causal)
            state["fa"] = _compiled_flex() if compiled else flex_attention
        block_mask, fa = state["mask"], state["fa"]
        gqa = q.shape[2] != k.shape[2]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
            out = fa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                     **({"enable_gqa": True} if gqa else {}))
        return out.transpose(1, 2)
    return fn


# ----------------------------------------------------------------------------- by name
# The variants' specs name the baselines that compute their attention (VariantSpec.baselines);
# each factory takes the benchmark case (B, N, H, kv_heads, causal, device) and the op's
# pattern arguments and returns fn(q, k, v), or None where the baseline cannot run the case.

def _head_group_loop_for(case, params):
    ws, rs = params.get("segment_lengths"), params.get("dilation_rates")
    if params.get("mode") != "head_groups" or not ws:
        return None     # the loop computes head-group attention only
    if case.H % len(ws) or case.kv_heads != case.H or any(case.N % w for w in ws):
        return None     # it needs H a multiple of the patterns, no GQA, N a multiple of every w
    return lambda q, k, v: head_group_loop(q, k, v, list(ws), list(rs), case.causal)


def _flex_for(case, params):
    if not flex_available():
        return None
    return flex_block_sparse(params["layout"], case.N, case.causal, torch.device(case.device),
                             compiled=case.device == "cuda")


def _gather_for(case, params):
    if "indices" not in params:
        return None
    return lambda q, k, v: gather_indexed(q, k, v, params["indices"], case.causal)


BASELINES = {"head_group_loop": _head_group_loop_for, "flex": _flex_for, "gather": _gather_for}
