"""Float64 oracle for indexed attention (DESIGN §5c): exact softmax over the keys each query's
indices row lists, built from the dense (query, key) mask (a key listed twice counts once).
O(Nq x Nk) memory: for tests and small inputs."""
from __future__ import annotations

from ..common.call import AttentionCall, check_sinks, check_softcap
from ..common.lse import add_sinks, masked_attention_with_lse
from ..common.validation import check_bool, check_scale
from .indices import check_inputs, dense_mask


def indexed_attention_naive(q, k, v, indices, *, causal=False, scale=None, softcap=0.0, sinks=None):
    """Reference indexed attention in float64: (out (B, Nq, Hq, Dv), lse (B, Hq, Nq)); rows
    with no used slot give 0 and -inf. Differentiable. Arguments as indexed_attention's
    (q, k, v may be float64; sinks float32 or float64)."""
    check_inputs(q, k, v, indices, allow_float64=True)
    check_bool("causal", causal)
    softcap = check_softcap(softcap)
    sinks = check_sinks(sinks, q.shape[2], q.device, allow_float64=True)
    B, Nq, Hq, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    scale = check_scale(scale, D)
    group = Hq // Hkv
    q64 = q.double().transpose(1, 2)
    k64 = k.double().repeat_interleave(group, dim=2).transpose(1, 2)
    v64 = v.double().repeat_interleave(group, dim=2).transpose(1, 2)
    mask = dense_mask(indices, Nq, Nk, Hq, causal)
    out, lse = masked_attention_with_lse(q64, k64, v64, mask, AttentionCall(causal, scale, softcap))
    out = out.transpose(1, 2)
    return (out, lse) if sinks is None else add_sinks(out, lse, sinks.double())
