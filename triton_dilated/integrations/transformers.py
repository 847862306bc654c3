"""transformers integration (`pip install triton_dilated[hf]`): dilated and block-sparse
attention as transformers attention functions, and a bounded cache for generation.

    from triton_dilated.integrations import transformers as td_hf
    td_hf.register()
    config.dilated_attention = {"segment_lengths": [2048, 4096], "dilation_rates": [1, 2]}
    model = AutoModelForCausalLM.from_config(config, attn_implementation="triton_dilated")
    out = model.generate(ids, cache=td_hf.DilatedCache(model.config), max_new_tokens=64)

`register()` adds "triton_dilated" and "triton_block_sparse" to transformers'
`AttentionInterface` (and a padding-mask function of the same names to its
`AttentionMaskInterface`); importing this module calls it, so a forgotten `register()` cannot
break `from_config` (transformers' own error, "attn_implementation=... is not supported",
means this module was not imported). The patterns come from the model config:

    config.dilated_attention = {"segment_lengths": [...], "dilation_rates": [...],
                                "mode": "longnet", "offsets": "modulo"}      # mode, offsets optional
    config.block_sparse_attention = {"builder": "bigbird", "block_size": 128, ...}

the second naming a `triton_dilated.layouts` builder (local, dilated, global_tokens, random,
bigbird, hierarchical, causal) and its keyword arguments; the layout is built once for
`max_seq_len` (default config.max_position_embeddings) and its leading blocks serve every
shorter sequence, so training, prefill and each decode step see the same blocks. Either dict
may also hold "backend" ("auto", "triton", "torch"). A model without the dict fails at its
first forward with a message naming it (transformers gives an attention function no hook at
`from_config`). One pattern covering every sequence, {"segment_lengths":
[max_position_embeddings], "dilation_rates": [1]}, is causal dense attention (sdpa's logits);
several patterns mix their attention by design (LongNet).

Supported: causal self-attention of decoder-only LMs (`module.is_causal`), training (forward
and backward), prefill, `generate()` with transformers' DynamicCache, with `DilatedCache` or
with a static cache (whose decode steps run the `*_with_kvcache` entry points with the
cache's length as a device tensor: a compiled forward traces once), GQA/MQA. The attention
functions read nothing on the host per layer; the mask functions read the padding mask once
per forward. Padded batches work with full caches when each row's real tokens are one
contiguous run: left padding (batched `generate`) attends each row as its own sequence from its
first real token, so its result equals the unpadded one; right padding (training batches,
transformers' model tester's tril masks) needs no cut, causal attention never reaching a later
key; both may meet in one batch. A query on a padding position gets attention output 0 (eager
gives the mean of all values for a row with every key masked, and attention over the row's
real keys for a query on right padding; transformers' own eager-vs-sdpa test compares the real
tokens only). With `DilatedCache` padding is refused (the cache drops rows at positions counted
from the batch's start, which are not segment boundaries of a padded row).
A 4-d mask (B|1, 1|H, q_len, kv_len) made by the caller (transformers hands it to the attention
unchanged), boolean or additive (0 and the dtype's min or -inf), is accepted when it is exactly
the layer's causal (sliding layers: sliding-window causal) mask with key padding as above; it
is read on the host at the first layer and its padding kept on the tensor for the others.

gpt-oss, Gemma 2, Mistral (issue 23): a layer whose module passes `sliding_window=w` runs
block_sparse_attention on `layouts.sliding_window(n, block_size, w)` (exact: keys
p - w < p' <= p; block size `window_block_size` in the config dict, default 64), the other
layers the configured dilated patterns or block layout; the modules' `softcap` (Gemma 2) and
`s_aux` sink logits (gpt-oss) pass through as softcap= and sinks=. The mask functions accept
transformers' sliding-window causal mask (also from a sliding cache that dropped rows: a window
is translation-invariant) and refuse it with a static cache.
DeepSeek Sparse Attention (transformers' DeepseekV32): attn_implementation="triton_indexed" runs
indexed_attention on the `indices` the model's indexer hands its attention, with the model's
mask folded into them (its mask function is transformers' sdpa_mask, which the indexer scores
against); config.indexed_attention = {"backend": ...} is optional.

Refused with a clear error (no mask is ignored): attention dropout > 0, non-causal modules,
packed sequences (flash-attn's cu_seq_lens) and other mask overlays, a padding mask with a gap
inside a row's tokens (generate() after right padding), any other 4-d mask (documents, prefix
LM, arbitrary patterns, per-head masks, additive biases: the kernels take no element mask).
`output_attentions` gives None for the weights.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from .. import layouts
from ..ops.block_sparse import block_sparse_attention, block_sparse_attention_with_kvcache
from ..ops.dilated import dilated_attention, dilated_attention_with_kvcache
from ..ops.dilated.cache import KeptRows, quiet_heads_warning
from ..ops.dilated.patterns import check_patterns
from ..ops.indexed import indexed_attention

DILATED = "triton_dilated"
BLOCK_SPARSE = "triton_block_sparse"
INDEXED = "triton_indexed"
BUILDERS = ("local", "dilated", "global_tokens", "random", "bigbird", "hierarchical", "causal")
_DILATED_KEYS = ("segment_lengths", "dilation_rates", "mode", "offsets", "backend", "window_block_size")
_UNSUPPORTED = {"cu_seq_lens_q": "packed sequences (cu_seq_lens)", "cu_seq_lens_k": "packed sequences (cu_seq_lens)",
                "position_bias": "position biases"}
WINDOW_BLOCK_SIZE = 64   # the sliding layers' block size by default (gpt-oss's window of 128: 3 blocks a row)


def register() -> None:
    """Register "triton_dilated", "triton_block_sparse" and "triton_indexed" with transformers
    (attention functions and their mask functions). Idempotent; importing this module calls it."""
    AttentionInterface.register(DILATED, dilated_attention_forward)
    AttentionInterface.register(BLOCK_SPARSE, block_sparse_attention_forward)
    AttentionMaskInterface.register(DILATED, dilated_attention_mask)
    AttentionMaskInterface.register(BLOCK_SPARSE, block_sparse_attention_mask)
    AttentionInterface.register(INDEXED, indexed_attention_forward)
    AttentionMaskInterface.register(INDEXED, sdpa_mask)   # the DSA indexer scores against the model's mask


# ----------------------------------------------------------------------------- config

def _config_dict(config, attr, impl, example):
    spec = getattr(config, attr, None)
    if spec is None:
        raise ValueError(f'attn_implementation="{impl}" reads its pattern from config.{attr}, e.g. '
                         f"config.{attr} = {example}; this config has none")
    if not isinstance(spec, dict):
        raise TypeError(f"config.{attr} must be a dict, got {type(spec).__name__}")
    return spec


def dilated_spec(config) -> dict:
    """config.dilated_attention, checked, with its defaults filled in."""
    spec = _config_dict(config, "dilated_attention", DILATED,
                        '{"segment_lengths": [2048, 4096], "dilation_rates": [1, 2]}')
    unknown = sorted(set(spec) - set(_DILATED_KEYS))
    if unknown or "segment_lengths" not in spec or "dilation_rates" not in spec:
        raise ValueError(f"config.dilated_attention takes the keys {list(_DILATED_KEYS)} (segment_lengths and "
                         f"dilation_rates required), got {sorted(spec)}")
    out = {"mode": "longnet", "offsets": "modulo", "backend": "auto", **spec}
    patterns = check_patterns(out["segment_lengths"], out["dilation_rates"], out["mode"], out["offsets"])
    out["segment_lengths"] = [w for w, _ in patterns]
    out["dilation_rates"] = [r for _, r in patterns]
    return out


def block_sparse_spec(config) -> tuple[str, int, str]:
    """(canonical JSON of config.block_sparse_attention, max_seq_len, backend), checked."""
    spec = _config_dict(config, "block_sparse_attention", BLOCK_SPARSE, '{"builder": "bigbird", "block_size": 128}')
    builder = spec.get("builder")
    if builder not in BUILDERS:
        extra = " (topk is content-adaptive: it needs q and k, not a config)" if builder == "topk" else ""
        raise ValueError(f"config.block_sparse_attention['builder'] must be one of {list(BUILDERS)}, got "
                         f"{builder!r}{extra}")
    max_len = spec.get("max_seq_len", getattr(config, "max_position_embeddings", None))
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise ValueError("config.block_sparse_attention needs 'max_seq_len' (the longest sequence its layout covers) "
                         f"when the config has no max_position_embeddings; got {max_len!r}")
    backend = spec.get("backend", "auto")
    kwargs = {k: v for k, v in spec.items() if k not in ("builder", "max_seq_len", "backend", "window_block_size")}
    return json.dumps({"builder": builder, **kwargs}, sort_keys=True), max_len, backend


@functools.lru_cache(maxsize=16)
def _full_layout(spec_json: str, max_len: int):
    spec = json.loads(spec_json)
    builder = getattr(layouts, spec.pop("builder"))
    params = inspect.signature(builder).parameters
    if "causal" in params and "causal" not in spec:
        spec["causal"] = True     # causal LMs: no blocks above the diagonal
    unknown = sorted(set(spec) - set(params))
    if unknown:
        raise ValueError(f"config.block_sparse_attention: layouts.{builder.__name__} takes no {unknown}; its "
                         f"arguments are {[p for p in params if p != 'seq_len']}")
    return builder(max_len, **spec)


@functools.lru_cache(maxsize=256)
def _layout(spec_json: str, max_len: int, seq_len: int, device: str):
    """The layout of the first seq_len tokens (the leading blocks of the max_len layout)."""
    if seq_len > max_len:
        raise ValueError(f"a sequence of {seq_len} tokens is longer than the block-sparse layout "
                         f"({max_len} tokens: config.block_sparse_attention['max_seq_len'] or "
                         f"config.max_position_embeddings)")
    full = _full_layout(spec_json, max_len)
    n_blocks = -(-seq_len // full.block_size)
    lay = full if n_blocks == full.n_q_blocks else full.prefix(n_blocks)
    return lay.to(torch.device(device))


def window_options(config, attr: str) -> tuple[int, str]:
    """(block size, backend) of the sliding-window layers, from config.<attr> when the model
    has it ("window_block_size", default WINDOW_BLOCK_SIZE; "backend"); a model whose layers
    all slide (Mistral) needs no pattern dict."""
    spec = getattr(config, attr, None) or {}
    if not isinstance(spec, dict):
        raise TypeError(f"config.{attr} must be a dict, got {type(spec).__name__}")
    block = spec.get("window_block_size", WINDOW_BLOCK_SIZE)
    if not isinstance(block, int) or isinstance(block, bool) or block < 16 or block & (block - 1):
        raise ValueError(f"config.{attr}['window_block_size'] must be a power of two >= 16, got {block!r}")
    return block, spec.get("backend", "auto")


@functools.lru_cache(maxsize=64)
def _window_layout(seq_len: int, block_size: int, window: int, device: str):
    """layouts.sliding_window over seq_len keys: keys p - window < p' <= p, exactly the
    model's sliding mask (transformers' sliding_window_causal_mask_function)."""
    return layouts.sliding_window(seq_len, block_size, window).to(torch.device(device))


# ----------------------------------------------------------------------------- attention functions

def _config_of(module):
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError("the attention module has no .config: the patterns are read from the model config")
    return config


def _model_extras(impl, kwargs):
    """What the model's attention module passed beyond q, k, v: (sliding window or None for a
    full layer, softcap or None (Gemma 2), sink logits float32 (Hq,) or None (gpt-oss's s_aux,
    kept in the model's dtype: cast here, its gradient flows back to the parameter))."""
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"{impl}: sliding_window must be a positive int or None, got {window!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1:
            raise ValueError(f"{impl}: s_aux (attention sinks) must be a tensor (num_heads,), got "
                             f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
        sinks = sinks.float()
    return window, softcap, sinks


def _sliding_call(module, window, scaling, extra, attr):
    """call(q, k, v, lengths) of a sliding layer: block-sparse attention on the window layout of
    the keys it gets. The window is translation-invariant, so the keys may start anywhere (a
    sliding cache keeps only the last window - 1 rows): positions count from the first key."""
    block, backend = window_options(_config_of(module), attr)

    def call(q, k, v, lengths):
        lay = _window_layout(k.shape[1], block, window, str(k.device))
        lens = _serve_lengths(q, k, lengths)
        if lens is None:
            return block_sparse_attention(q, k, v, lay, causal=True, scale=scaling, backend=backend, **extra)
        # decode steps and chunks: the serve door (a decode step without host sync)
        return block_sparse_attention_with_kvcache(q, k, v, cache_seqlens=lens, layout=lay, causal=True,
                                                   scale=scaling, backend=backend, **extra)
    return call


def _check_call(impl, module, attention_mask, dropout, is_causal, kwargs):
    if dropout:
        raise ValueError(f"{impl} has no attention dropout: set config.attention_dropout = 0.0 (got {dropout})")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        raise ValueError(f"{impl} supports causal self-attention (decoder-only language models) only; this "
                         f"module ({type(module).__name__}) is not causal")
    for key, what in _UNSUPPORTED.items():
        if kwargs.get(key) is not None:
            raise ValueError(f"{impl} does not support {what} (the model passed {key})")
    if attention_mask is None:
        return
    lengths = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 1 and \
        attention_mask.dtype == torch.int32       # a static cache's valid rows (_padding_mask)
    if not isinstance(attention_mask, torch.Tensor) or (attention_mask.dim() not in (2, 4) and not lengths):
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise ValueError(f"{impl} takes a 2-d padding mask (B, kv_len), a 4-d mask (B, 1, q_len, kv_len) of "
                         f"causal attention with padding, or None; got {shape}")


def _run(impl, call, module, query, key, value, attention_mask, dropout, is_causal, kwargs):
    """transformers' (B, H, N, D) tensors -> call(q, k, v, lengths) on (B, N, H, D) views ->
    (B, Nq, H, D). The mask is what the mask functions below returned: None, an int32 (B,)
    of valid rows (a static cache) or a 2-d padding mask (tagged with its padding groups), or
    a caller's 4-d mask (transformers passes it through), turned into its padding mask."""
    _check_call(impl, module, attention_mask, dropout, is_causal, kwargs)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    if attention_mask is None:
        return call(q, k, v, None)
    if attention_mask.dim() == 1:
        return call(q, k, v, attention_mask)
    if attention_mask.dim() == 4:
        attention_mask = _padding_of_4d(impl, attention_mask, q.shape[0], q.shape[1], k.shape[1],
                                        kwargs.get("sliding_window"))
    return _padded(impl, call, q, k, v, attention_mask)


def _padding_of_4d(impl, mask, B, Nq, Nk, window):
    """The tagged 2-d padding mask (B, Nk) of a 4-d mask (B|1, 1|H, Nq, Nk) that is exactly the
    layer's causal mask (keys p' <= p; with the layer's sliding window also p' > p - window) of
    queries at the last Nq positions, intersected with a key padding mask: what transformers
    builds for a padded batch (boolean, True = attend, or additive, 0 = attend and the dtype's
    min or -inf = masked), which such a mask reaches us unchanged when the caller made it. Any
    other 4-d mask is a ValueError (the kernels take no element mask). Reads the mask on the
    host; the result is kept on the mask tensor (per window and mask version), so the layers
    after the first reuse it."""
    if mask.dim() != 4 or mask.shape[0] not in (1, B) or tuple(mask.shape[2:]) != (Nq, Nk):
        raise ValueError(f"{impl}: a 4-d attention mask must have shape (B|1, 1|heads, q_len, kv_len) = "
                         f"({B}|1, ..., {Nq}, {Nk}), got {tuple(mask.shape)}")
    try:
        version = mask._version
    except RuntimeError:      # an inference-mode tensor keeps no version counter
        version = None
    key = (window, B, Nq, Nk, str(mask.device), version)
    kept = getattr(mask, "_td_padding_of", None)
    if kept is not None and key in kept:
        return kept[key]
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        keep = mask == 0
        if not (keep | (mask <= torch.finfo(mask.dtype).min)).all():
            raise ValueError(f"{impl}: an additive 4-d attention mask may hold only 0 (attend) and the dtype's min "
                             f"or -inf (masked); this one ({mask.dtype}) holds other values (a bias), which the "
                             f"kernels cannot add")
    else:
        raise TypeError(f"{impl}: a 4-d attention mask must be boolean or floating (additive), got {mask.dtype}")
    if not (keep == keep[:, :1]).all():
        raise ValueError(f"{impl}: the 4-d attention mask differs between heads (shape {tuple(mask.shape)}); only "
                         f"masks shared by every head are supported")
    keep = keep[:, 0].expand(B, Nq, Nk)
    padding = keep.any(dim=1)                                   # a real key is seen by some query
    pos_q = torch.arange(Nk - Nq, Nk, device=mask.device)[:, None]
    pos_k = torch.arange(Nk, device=mask.device)[None, :]
    band = pos_k <= pos_q
    if window is not None:
        band = band & (pos_k > pos_q - window)
    want = band[None] & padding[:, None, :]
    if not torch.equal(keep, want):
        what = f"sliding-window causal mask ({window} keys)" if window is not None else "causal mask"
        raise ValueError(f"{impl} takes a 4-d attention mask only when it is the layer's {what} of the last {Nq} "
                         f"positions intersected with key padding (what transformers builds for a padded batch); "
                         f"the mask passed, {tuple(mask.shape)} {mask.dtype}, differs from that at "
                         f"{int((keep != want).sum())} (query, key) pairs. Other masks (packed documents, prefix "
                         f"LM, arbitrary patterns) are not supported: pass the 2-d padding mask instead")
    padding.td_padding = _padding_groups(impl, padding)
    if kept is None:
        kept = {}
        mask._td_padding_of = kept
    kept[key] = padding
    return padding


def _padding_groups(impl, mask):
    """(groups, inverse, right) of a 2-d padding mask (B, kv_len) whose real tokens are one
    contiguous run per row (left padding, right padding, or both): {left pad: (rows, index
    tensor)}; the permutation back to batch order (None for one group); whether any row has
    padding after its run (query rows there are zeroed). Reads the mask on the host: the mask
    functions call it once per forward (and tag the mask with the result), so that the
    attention function of each layer does not."""
    mask = mask.to(dtype=torch.bool)
    B, Nk = mask.shape
    pads = mask.int().argmax(dim=1) * mask.any(dim=1)       # leading zeros (0 for an all-padding row)
    real = mask.sum(dim=1)
    pos = torch.arange(Nk, device=mask.device)[None, :]
    run = (pos >= pads[:, None]) & (pos < (pads + real)[:, None])
    if not torch.equal(mask, run):
        bad = int((mask != run).any(dim=1).nonzero()[0, 0])
        row = mask[bad].int().tolist()
        raise ValueError(f"{impl} takes padding masks whose real tokens are one contiguous run per row (left and/or "
                         f"right padding); row {bad} of attention_mask is {row if Nk <= 32 else row[:32] + ['...']}, "
                         f"a gap inside the run (e.g. generate() after right padding: pad on the left for "
                         f"generation, tokenizer.padding_side = 'left')")
    groups: dict[int, list[int]] = {}
    for b, pad in enumerate(pads.tolist()):
        groups.setdefault(pad, []).append(b)
    index = {pad: (rows, torch.tensor(rows, device=mask.device)) for pad, rows in groups.items()}
    order = [b for rows in groups.values() for b in rows]
    inverse = None
    if len(groups) > 1:
        inverse = torch.empty(B, dtype=torch.long, device=mask.device)
        inverse[torch.tensor(order, device=mask.device)] = torch.arange(B, device=mask.device)
    right = bool(((pads + real) < Nk).any())
    return index, inverse, right


def _padded(impl, call, q, k, v, mask):
    """Each batch row attended from its first real key on, as its own sequence (rows grouped by
    left-padding length). Padding after a row's real tokens (right padding) needs no cut: the
    attention is causal, so no real query reaches a later key. Query rows on padding positions
    (either side) give 0."""
    B, Nq, H, D = q.shape
    Nk = k.shape[1]
    if tuple(mask.shape) != (B, Nk):
        raise ValueError(f"{impl}: the padding mask has shape {tuple(mask.shape)}, the keys (B, kv_len) = ({B}, {Nk})")
    groups, inverse, right = getattr(mask, "td_padding", None) or _padding_groups(impl, mask.to(k.device))
    if list(groups) == [0]:
        out = call(q, k, v, None)
    else:
        parts = []
        for pad, (rows, index) in groups.items():
            nq = min(Nq, Nk - pad)
            zeros = q.new_zeros((len(rows), Nq - nq, H, D))
            if nq > 0:
                out = call(q.index_select(0, index)[:, Nq - nq:], k.index_select(0, index)[:, pad:],
                           v.index_select(0, index)[:, pad:], None)
                parts.append(torch.cat([zeros, out], dim=1) if nq < Nq else out)
            else:
                parts.append(zeros)
        out = torch.cat(parts).index_select(0, inverse) if inverse is not None else parts[0]
    if right:   # the queries on right padding saw their run and the padding before them: zero them
        out = torch.where(mask[:, Nk - Nq:, None, None].to(device=out.device, dtype=torch.bool), out, 0.0)
    return out


def _head_slice(impl, module, query, kwargs) -> tuple[int, int | None]:
    """(head_offset, total_heads) of a call: from the keywords head_offset/total_heads (a
    caller running on a head slice passes them: integrations.deepspeed's Ulysses), else the
    full head set. A call holding fewer query heads than the model config without them is
    refused: dilated offsets and per-head layouts follow the global head index, which the
    slice alone does not tell."""
    offset, total = kwargs.pop("head_offset", None), kwargs.pop("total_heads", None)
    if offset is not None:
        return offset, total
    config_heads = getattr(_config_of(module), "num_attention_heads", None)
    if isinstance(config_heads, int) and query.shape[1] != config_heads:
        raise ValueError(f"{impl}: the call holds {query.shape[1]} of the model's {config_heads} query heads (heads "
                         f"split over ranks: sequence parallelism by heads or tensor parallelism), and the pattern "
                         f"depends on the global head index: pass head_offset= (and total_heads=); for DeepSpeed "
                         f"Ulysses use triton_dilated.integrations.deepspeed.register_ulysses")
    return 0, None


def _extras_and_heads(impl, module, query, kwargs):
    """(sliding window or None, dict(softcap, sinks) for the call's heads, head_offset,
    total_heads) of an attention call: the model's extras (_model_extras) and its head slice
    (_head_slice); on a head slice, the sink logits of its heads only."""
    window, softcap, sinks = _model_extras(impl, kwargs)
    head_offset, total_heads = _head_slice(impl, module, query, kwargs)
    if sinks is not None and total_heads is not None:
        sinks = sinks[head_offset:head_offset + query.shape[1]]
    return window, dict(softcap=softcap, sinks=sinks), head_offset, total_heads


def _serve_lengths(q, k, lengths):
    """The serve doors' cache_seqlens of a call whose queries end a longer key sequence (a
    static cache's lengths, or every key row valid), or None when q and k hold the same
    positions (the training doors)."""
    if lengths is not None:
        return lengths
    if q.shape[1] == k.shape[1]:
        return None
    return torch.full((k.shape[0],), k.shape[1], dtype=torch.int32, device=k.device)


def dilated_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                              is_causal=None, **kwargs):
    """transformers attention function "triton_dilated": query (B, H, Nq, D), key/value
    (B, Hkv, Nk, D), the queries the last Nq positions; returns ((B, Nq, H, D), None). Full
    layers run dilated attention with config.dilated_attention's patterns; sliding layers (the
    model passes sliding_window) block-sparse attention on layouts.sliding_window; both take
    the model's softcap and attention sinks (s_aux). Keywords head_offset/total_heads: the
    call holds query heads [head_offset, head_offset + H) of total_heads (a head slice, as
    under DeepSpeed Ulysses: integrations.deepspeed)."""
    window, extra, head_offset, total_heads = _extras_and_heads(DILATED, module, query, kwargs)
    if window is not None:
        call = _sliding_call(module, window, scaling, extra, "dilated_attention")
        return _run(DILATED, call, module, query, key, value, attention_mask, dropout, is_causal, kwargs), None
    spec = dilated_spec(_config_of(module))
    pattern = dict(segment_lengths=spec["segment_lengths"], dilation_rates=spec["dilation_rates"], causal=True,
                   scale=scaling, mode=spec["mode"], offsets=spec["offsets"], backend=spec["backend"],
                   head_offset=head_offset, total_heads=total_heads, **extra)

    def call(q, k, v, lengths):
        lens = _serve_lengths(q, k, lengths)
        quiet = quiet_heads_warning(q.shape[2], k.shape[1]) if q.shape[2] > k.shape[1] else contextlib.nullcontext()
        with quiet:
            if lens is None:
                return dilated_attention(q, k, v, **pattern)
            return dilated_attention_with_kvcache(q, k, v, cache_seqlens=lens, **pattern)   # decode: no host sync

    return _run(DILATED, call, module, query, key, value, attention_mask, dropout, is_causal, kwargs), None


def _module_layout(module, seq_len: int, device):
    """(layout for seq_len keys on device, backend) of the module's config. Eager calls build it
    (the config's JSON, the builder) and keep it on the module; traced calls (torch.compile:
    neither JSON nor the builders trace) read it from there, so an eager forward of the same
    cache length (generate's prefill) must come first."""
    key = (seq_len, str(device))
    kept = module.__dict__.setdefault("_td_block_sparse_layouts", {}) if not torch.compiler.is_compiling() else \
        module.__dict__.get("_td_block_sparse_layouts", {})
    if torch.compiler.is_compiling():
        if key not in kept:
            raise ValueError(f"{BLOCK_SPARSE} under torch.compile: no layout for {seq_len} keys was built yet; run one "
                             f"eager forward with this cache length first (generate's prefill does)")
        return kept[key]
    spec_json, max_len, backend = block_sparse_spec(_config_of(module))
    kept[key] = (_layout(spec_json, max_len, seq_len, key[1]), backend)
    return kept[key]


def block_sparse_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                   is_causal=None, **kwargs):
    """transformers attention function "triton_block_sparse" (shapes as dilated_attention_forward):
    full layers on config.block_sparse_attention's layout, sliding layers on
    layouts.sliding_window; both with the model's softcap and sinks."""
    window, extra, first, total = _extras_and_heads(BLOCK_SPARSE, module, query, kwargs)
    if window is not None:
        call = _sliding_call(module, window, scaling, extra, "block_sparse_attention")
        return _run(BLOCK_SPARSE, call, module, query, key, value, attention_mask, dropout, is_causal, kwargs), None

    def call(q, k, v, lengths):
        lay, backend = _module_layout(module, k.shape[1], k.device)
        if total is not None:   # a head slice: its rows of a per-head layout (one head row: itself)
            lay = lay.heads(first, first + q.shape[2])
        lens = _serve_lengths(q, k, lengths)
        if lens is None:
            return block_sparse_attention(q, k, v, lay, causal=True, scale=scaling, backend=backend, **extra)
        return block_sparse_attention_with_kvcache(q, k, v, cache_seqlens=lens, layout=lay, causal=True,
                                                   scale=scaling, backend=backend, **extra)   # decode: no host sync

    return _run(BLOCK_SPARSE, call, module, query, key, value, attention_mask, dropout, is_causal, kwargs), None


def indexed_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, indices=None,
                              softcap=None, **kwargs):
    """"triton_indexed": DeepSeek Sparse Attention models (transformers' DeepseekV32) hand their
    attention the indexer's top-k `indices` (B, S, topk); this runs indexed_attention on them
    (Dqk 192, Dv 128 as the model's non-absorbed MLA gives them). The model's boolean (or additive)
    mask (B, 1, S, T) is folded into the indices: a slot whose key the mask hides (a future key the
    top-k picked for an early query, padding) is unused, as eager's dense-mask folding drops it."""
    if indices is None:
        raise ValueError(f"{INDEXED} runs the indices of a DeepSeek Sparse Attention model (transformers' "
                         f"DeepseekV32 passes indices=); {type(module).__name__} passed none")
    if dropout:
        raise ValueError(f"{INDEXED} has no attention dropout: set config.attention_dropout = 0.0 (got {dropout})")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    B, S, T = q.shape[0], q.shape[1], k.shape[1]
    causal = True
    if isinstance(attention_mask, torch.Tensor):
        keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask > torch.finfo(
            attention_mask.dtype).min
        keep = keep[:, 0].expand(B, S, T)
        seen = keep.gather(-1, indices.clamp(min=0).long().view(B, S, -1))
        indices = torch.where(seen, indices.view(B, S, -1), -1)
        causal = False   # the mask holds the causal cut (and any padding)
    backend = (getattr(getattr(module, "config", None), "indexed_attention", None) or {}).get("backend", "auto")
    out = indexed_attention(q, k, v, indices, causal=causal, scale=scaling, softcap=softcap, backend=backend)
    return out, None


# ----------------------------------------------------------------------------- mask functions

def _mask_window(impl, mask_function, local_size):
    """None for transformers' causal mask function; the window w for its sliding-window causal
    mask (keys p - w < p' <= p: the sliding layers, which the attention functions run on the
    window layout), recognised by evaluating the mask function on probe positions around
    the band's edges (its closure has no name to compare); any other mask function (packed
    sequences, overlays, chunked attention) is a ValueError."""
    if mask_function is causal_mask_function:
        return None
    name = getattr(mask_function, "__name__", type(mask_function).__name__)
    if isinstance(local_size, int) and not isinstance(local_size, bool) and local_size >= 1:
        w = local_size
        q_idx = torch.tensor([0, 1, w - 1, w, w + 1, 2 * w + 1])
        kv_idx = torch.unique((q_idx[:, None] + torch.tensor([-w - 1, -w, -w + 1, -1, 0, 1])).clamp_min(0))
        want = (kv_idx[None, :] <= q_idx[:, None]) & (kv_idx[None, :] > q_idx[:, None] - w)
        try:
            got = mask_function(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q_idx[:, None],
                                kv_idx[None, :])
            same = torch.equal(torch.as_tensor(got).cpu().expand_as(want).to(torch.bool), want)
        except (IndexError, RuntimeError, TypeError):   # an overlay that reads tensors of its own
            same = False
        if same:
            return w
    raise ValueError(f"{impl} applies the causal mask, transformers' sliding-window causal mask and left padding "
                     f"only; the model asked for the mask function {name} (packed sequences or another overlay)")


def _padding_mask(impl, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, device,
                  local_size=None):
    """What the attention functions take: None (no padding, a cache of exactly the rows seen),
    an int32 (B,) tensor of valid rows (a static cache, whose keys are its whole capacity:
    transformers passes its length as a device tensor q_offset), or the 2-d boolean padding
    mask (left and/or right) of the key rows the attention sees, tagged with its padding groups (like
    flash-attention's mask function). Called once per forward, outside the layers: the one
    host read it may make (is the batch padded?) is not repeated per layer, and none is made
    for a static cache without an attention mask."""
    sliding = _mask_window(impl, mask_function, local_size) is not None
    if attention_mask is not None and attention_mask.dim() != 2:
        return attention_mask          # our own output fed back (generate builds the mask first) or 4-d: refused later
    static = isinstance(q_offset, torch.Tensor)
    if sliding and static:
        raise ValueError(f"{impl}: sliding-window layers with a static cache (a rolling buffer) are not supported; "
                         f"use DynamicCache")
    if attention_mask is not None and not bool(attention_mask.all()):
        if static:
            raise ValueError(f"{impl}: a padded batch (attention_mask with zeros) with a static cache is not "
                             f"supported; use DynamicCache for padded batches")
        if kv_offset > 0 and not sliding:   # a window is translation-invariant: a row may start anywhere
            raise ValueError(f"{impl}: a padded batch (attention_mask with zeros) with a cache that dropped its first "
                             f"{kv_offset} rows (DilatedCache): it drops rows at positions counted from the batch "
                             f"start, which are not segment boundaries of a padded row. Use DynamicCache or unpadded "
                             f"batches")
        mask = attention_mask[:, -kv_length:]
        mask.td_padding = _padding_groups(impl, mask)
        return mask
    if static:
        return (q_offset.to(torch.int32) + q_length).reshape(1).expand(batch_size).clone()
    if q_offset + q_length - kv_offset < kv_length:   # a static cache before its first write: q_offset is 0
        return torch.full((batch_size,), q_offset + q_length, dtype=torch.int32, device=device)
    return None


def dilated_attention_mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0,
                           mask_function=causal_mask_function, attention_mask=None, **kwargs):
    """AttentionMaskInterface entry of "triton_dilated"."""
    return _padding_mask(DILATED, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                         kwargs.get("device"), kwargs.get("local_size"))


def block_sparse_attention_mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0,
                                mask_function=causal_mask_function, attention_mask=None, **kwargs):
    """AttentionMaskInterface entry of "triton_block_sparse": the layout is laid on absolute
    positions, so the cache must hold every row (but for sliding-window layers, whose window is
    translation-invariant: transformers' sliding caches keep the last window - 1 rows)."""
    if kv_offset > 0 and _mask_window(BLOCK_SPARSE, mask_function, kwargs.get("local_size")) is None:
        raise ValueError(f"{BLOCK_SPARSE} needs the whole sequence in the cache (block layouts use absolute "
                         f"positions), got a cache that dropped its first {kv_offset} rows (DilatedCache or a "
                         f"sliding-window cache); use DynamicCache")
    return _padding_mask(BLOCK_SPARSE, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                         attention_mask, kwargs.get("device"), kwargs.get("local_size"))


# ----------------------------------------------------------------------------- the bounded cache

def _position_ids(kwargs):
    """position_ids if the model passed them to Cache.update (directly or in its kwargs dict)."""
    for source in (kwargs, kwargs.get("kwargs"), kwargs.get("cache_kwargs")):
        if isinstance(source, dict) and isinstance(source.get("position_ids"), torch.Tensor):
            return source["position_ids"]
    return None


class DilatedCacheLayer(DynamicLayer):
    """One layer of DilatedCache: the kept rows of `triton_dilated.ops.dilated.cache.KeptRows`
    (rows from the window start on), exposed as transformers' (B, H, N, D) `keys`/`values`."""

    is_sliding = False
    is_croppable = False     # dropped rows cannot come back: crop() works inside the kept window only

    def __init__(self, segment_lengths, **kwargs):
        super().__init__()
        self.rows = KeptRows(segment_lengths)

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        self._sync()

    def _sync(self):
        r = self.rows
        if r.k is None:
            self.keys = self.values = None if not self.is_initialized else torch.tensor([], dtype=self.dtype,
                                                                                        device=self.device)
        else:
            self.keys, self.values = r.k[:, :r.length].transpose(1, 2), r.v[:, :r.length].transpose(1, 2)

    def _check_positions(self, position_ids, n):
        """Rows are dropped at multiples of lcm(segment lengths) counted from the batch start:
        right only when every row's tokens sit at positions 0, 1, ... (no left padding)."""
        if position_ids is None or position_ids.dim() != 2 or (n == 1 and self.rows.seen > 0):
            return     # decode steps follow a checked prefill; skip the host sync there
        want = torch.arange(self.rows.seen, self.rows.seen + n, device=position_ids.device)
        if not torch.equal(position_ids, want.expand_as(position_ids)):
            raise ValueError(f"DilatedCache cannot take a padded batch: it needs every batch row at positions "
                             f"{self.rows.seen}..{self.rows.seen + n - 1} (no left padding, no custom position_ids), "
                             f"got position_ids {position_ids[:, :4].tolist()}...; use DynamicCache for padded batches")

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_positions(_position_ids(kwargs), key_states.shape[-2])
        k, v = self.rows.append(key_states.transpose(1, 2), value_states.transpose(1, 2))
        self._sync()
        return k.transpose(1, 2), v.transpose(1, 2)

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):     # transformers 4.x passes cache_position
            query_length = query_length.shape[0]
        return self.rows.length + query_length, self.rows.start

    def get_seq_length(self) -> int:
        return self.rows.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.rows.reset()
        self.keys = self.values = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"DilatedCache.crop takes a negative count (tokens to remove), got {tokens_to_remove}")
        self.rows.crop(-tokens_to_remove)
        self._sync()

    def _map_batch(self, fn):
        self.rows.map_batch(fn)
        self._sync()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda x: x[indices])

    def offload(self):
        self.rows.to("cpu")
        self._sync()

    def prefetch(self):
        if self.is_initialized:
            self.rows.to(self.device)
            self._sync()


class DilatedCache(Cache):
    """A transformers `Cache` for models using "triton_dilated" that keeps only the rows a later
    query can read (`triton_dilated.DilatedKVCache`'s rule): at most the longest segment's rows
    per layer for LongNet's schedules, however long the generation. Tokens equal those of
    decoding with the full cache.

        cache = DilatedCache(model.config)     # patterns from config.dilated_attention
        model.generate(ids, cache=cache, max_new_tokens=...)

    Batches must be unpadded (all rows at positions 0, 1, ...): a padded batch raises.
    `nbytes` is the memory of the kept key and value rows, all layers.
    """

    def __init__(self, config=None, *, segment_lengths=None, num_layers=None):
        if (config is None) == (segment_lengths is None):
            raise ValueError("DilatedCache takes a model config (with config.dilated_attention) or segment_lengths, "
                             "exactly one of them")
        if config is not None:
            text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            segment_lengths = dilated_spec(text)["segment_lengths"]
            num_layers = num_layers if num_layers is not None else getattr(text, "num_hidden_layers", None)
        else:
            segment_lengths = [w for w, _ in check_patterns(segment_lengths, [1] * len(segment_lengths))]
        self.segment_lengths = list(segment_lengths)
        if num_layers is not None:
            super().__init__(layers=[DilatedCacheLayer(self.segment_lengths) for _ in range(num_layers)])
        else:
            super().__init__(layer_class_to_replicate=functools.partial(DilatedCacheLayer, self.segment_lengths))

    @property
    def nbytes(self) -> int:
        return sum(layer.rows.nbytes for layer in self.layers)


# Registered on import: the module exists to provide these names, and a user who imported it but
# forgot register() would otherwise get transformers' generic "not supported" error.
register()
