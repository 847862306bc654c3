"""Drop-in nn.Modules around the attention functions.

* `DilatedAttention`: dilated_attention on (B, N, H, D) q/k/v.
* `MultiheadDilatedAttention`: the constructor arguments, parameter names, initialisation
  and forward convention of dilated-attention-pytorch's `MultiheadDilatedAttention`
  (q/k/v projections, a MAGNETO sub-LayerNorm before out_proj, forward(query, key, value,
  is_causal=False) -> (out, None)), so switching is a change of import; plus GQA
  (`num_kv_heads`), `mode`, `offsets`, and sequence parallelism through
  `triton_dilated.ring_attention` (`group`).
* `BlockSparseAttention`: block_sparse_attention with a fixed BlockLayout or a builder.

Under `torch.compile` the modules call the custom ops (`dilated_attention_op`, `block_sparse_attention_op`)
(traceable with fullgraph=True, forward and backward); in eager mode they call the plain
functions (which keep the portable backend's autograd graph instead of recomputing it).
Both give the same results.

What matches dilated-attention-pytorch (fkodom/dilated-attention-pytorch, checked against
its code) and what does not:
* Its `DilatedAttention` splits the heads into one contiguous group per pattern (group i:
  pattern i, offset i % r_i), attends within the group's dilated rows, then divides each
  group's output by its sum over the whole sequence (`x / x.sum(dim=(1, 2))`: per batch,
  head and channel, over every segment and row) and the total by the number of groups.
  `mode="head_groups"` is the grouping alone, without both divisions, so its outputs are
  not that library's: theirs = ours / (num_groups * ours summed over positions).
  `compat="dilated-attention-pytorch"` (on `DilatedAttention` and
  `MultiheadDilatedAttention`) adds both divisions (the sum in float32): a checkpoint
  trained with that library then gives its outputs and gradients after
  `load_state_dict(strict=True)`, for the shapes it runs: num_heads a multiple of the
  number of patterns and N a multiple of every segment length. Where that library cannot
  run (N % w != 0, w > N), compat mode extends it: head groups with a short last segment,
  then the same two divisions. Loading that library's checkpoint into a
  `MultiheadDilatedAttention` built without compat warns (once per process), since strict
  loading succeeds and only the outputs change; its `op` argument (an xformers kernel
  choice) is accepted and ignored.
* `mode="longnet"` (the default) is the paper's attention instead: every head uses every
  pattern, mixed by their softmax denominators (no sums over the sequence, causal
  attention stays causal).
* That library stores `dropout` (as `attention_dropout`) and `softmax_scale` but applies
  neither: its attention always runs with scale 1/sqrt(D) and no dropout. Here `dropout`
  is applied to the attention output, after the sub-LayerNorm, on the input of out_proj
  (so in training mode with dropout > 0 the outputs differ from that library's, in eval
  mode they do not); the kernels have no attention-probability dropout, so a non-zero
  `attention_dropout` is refused; `softmax_scale` (= `scale`) is applied, and refused in
  compat mode (it would change the outputs that mode exists to reproduce).
* The head dim may be any size up to 256 (no multiple-of-8 / <= 128 limits), and with
  `mode="head_groups"` num_heads need not be a multiple of the number of patterns (groups
  differ by at most one head; every pattern needs at least one head). With uneven heads
  that library's head slices overlap and leave its last heads at zero: compat mode
  refuses such shapes.
"""
from __future__ import annotations

import collections
import math
import numbers
import sys
import warnings
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .ops.block_sparse import BlockLayout, block_sparse_attention, block_sparse_attention_op
from .ops.common.runtime import BACKENDS
from .ops.common.call import check_softcap
from .ops.common.validation import check_bool, check_choice, check_int, check_scale
from .ops.dilated import dilated_attention, dilated_attention_op
from .ops.dilated.patterns import check_patterns
from .ops.ring import ring_attention, ulysses_attention
from .ops.ring.comm import COMMS
from .ops.ring.shard import BALANCES

__all__ = ["DilatedAttention", "MultiheadDilatedAttention", "BlockSparseAttention"]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _check_real(name, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_module_scale(scale):
    return None if scale is None else check_scale(scale, 1)


def _check_backend(backend):
    return check_choice("backend", backend, BACKENDS)


def _sink_parameter(sinks, num_heads, device=None):
    """sinks=True: one learnable sink logit per query head (float32, zero-initialised: a
    sink of 0 first adds exp(0) = 1 to each row's denominator; on `device`); False: None."""
    if not check_bool("sinks", sinks):
        return None
    if num_heads is None:
        raise ValueError("sinks=True needs num_heads (the query heads, one sink logit each)")
    return nn.Parameter(torch.zeros(check_int("num_heads", num_heads, 1), dtype=torch.float32, device=device))


def _sinks_arg(param):
    """The sinks argument of the attention call: the parameter as float32 (a module cast to
    16 bits keeps its sinks usable), or None."""
    return None if param is None else param.float()


COMPAT_DAP = "dilated-attention-pytorch"
COMPATS = (COMPAT_DAP,)


def _check_compat(compat, mode, scale):
    """compat (None or "dilated-attention-pytorch") and the mode it implies -> (compat, mode)."""
    if compat is None:
        return None, "longnet" if mode is None else mode
    check_choice("compat", compat, COMPATS)
    if mode not in (None, "head_groups"):
        raise ValueError(f"compat={compat!r} is head-group attention: mode must be 'head_groups' (or left out), "
                         f"got {mode!r}")
    if scale is not None:
        raise ValueError(f"compat={compat!r} reproduces that library, whose attention always uses the scale "
                         f"1/sqrt(head_dim) (it stores softmax_scale without applying it): leave scale / "
                         f"softmax_scale None, got {scale}")
    return compat, "head_groups"


def _ignore_op(op, where):
    """dilated-attention-pytorch's `op` (an xformers AttentionOp: which xformers kernel computes
    the same attention) is accepted for a drop-in import switch and ignored: the kernels here
    are picked by `backend`. A non-None op says so once."""
    if op is not None:
        warnings.warn(f"{where}: op={op!r} (dilated-attention-pytorch's choice of xformers kernel) is ignored: "
                      f"triton_dilated runs its own kernels (backend='auto', 'triton' or 'torch'); the attention "
                      f"computed does not depend on it", UserWarning, stacklevel=3)


# A state dict saved by dilated-attention-pytorch's MultiheadDilatedAttention has exactly this
# module's keys (strict loading succeeds), so loading it without compat silently changes the
# outputs (by O(1): its normalisation differs). Its module has no `dropout` submodule, ours
# always has one: nn.Module's state-dict metadata (a "version" entry per submodule, kept by
# torch.save) tells them apart. A state dict without metadata (rebuilt as a plain dict,
# safetensors) cannot be told apart and loads silently.
_DAP_CHECKPOINT_WARNED = False
DAP_CHECKPOINT_WARNING = "this state dict was saved by dilated-attention-pytorch's MultiheadDilatedAttention"


def _note_checkpoint_metadata(module, state_dict, prefix, local_metadata, *args):
    """load_state_dict pre-hook (the module and its `dropout`): whether the state dict's metadata
    has an entry for this submodule."""
    module.__dict__["_td_checkpoint_entry"] = "version" in local_metadata


def _warn_on_foreign_checkpoint(module, incompatible_keys):
    """load_state_dict post-hook of MultiheadDilatedAttention: warn (once per process) when a
    checkpoint of dilated-attention-pytorch's module (metadata, but none for `dropout`) was
    loaded without compat."""
    global _DAP_CHECKPOINT_WARNED
    own = module.__dict__.pop("_td_checkpoint_entry", False)
    dropout = module.dropout.__dict__.pop("_td_checkpoint_entry", False)
    if not own or dropout or module.attention.compat is not None or _DAP_CHECKPOINT_WARNED:
        return
    _DAP_CHECKPOINT_WARNED = True
    # point at the user's load_state_dict call, above torch's recursive loader
    level, frame = 1, sys._getframe(0)
    while frame is not None and frame.f_code.co_filename in (__file__, nn.Module.load_state_dict.__code__.co_filename):
        level, frame = level + 1, frame.f_back
    warnings.warn(f"MultiheadDilatedAttention.load_state_dict: {DAP_CHECKPOINT_WARNING} (a module with these keys "
                  f"and no `dropout` submodule), but this module was built without compat: it computes "
                  f"mode={module.attention.mode!r} attention, whose outputs differ from that library's by O(1). "
                  f"Build it with compat={COMPAT_DAP!r} to get that library's outputs (README: Migrating from "
                  f"dilated-attention-pytorch); if the change is deliberate (fine-tuning into LongNet attention), "
                  f"ignore this warning. Warned once per process.", UserWarning, stacklevel=level)


def _check_compat_heads(num_heads, num_patterns, compat):
    if num_heads % num_patterns:
        raise ValueError(f"compat={compat!r} needs num_heads ({num_heads}) to be a multiple of the number of "
                         f"patterns ({num_patterns}): with uneven groups that library's head slices overlap and "
                         f"leave its last heads at zero, which is not reproduced")


# ----------------------------------------------------------------------------- dilated

class DilatedAttention(nn.Module):
    """LongNet dilated attention over (B, N, H, D) tensors (see `dilated_attention`).

    Args:
        segment_lengths, dilation_rates: one (w, r) per pattern (in this order, as for
            `dilated_attention` and dilated-attention-pytorch's `DilatedAttention`).
        softmax_scale: dilated-attention-pytorch's name for `scale` (give one of them).
        attention_dropout: dilated-attention-pytorch's argument, accepted as 0.0 only: the
            kernels have no attention-probability dropout (that library stores it and
            never applies it, so 0.0 reproduces its results).
        causal: the default for forward's `causal`.
        mode: "longnet" (default) or "head_groups"; offsets: "modulo" or "blocked".
        scale: score scale, default 1/sqrt(D).
        backend: "auto", "triton" or "torch".
        op: dilated-attention-pytorch's choice of xformers kernel, accepted (so that switching
            the import keeps working) and ignored with a warning unless None: the kernels
            here are chosen by `backend`, and the attention does not depend on it.
        compat: None, or "dilated-attention-pytorch": that library's outputs (head groups,
            each group's output divided by its sum over the sequence, the total by the
            number of groups; see the module docstring). Implies mode="head_groups" and
            needs Hq a multiple of the number of patterns; no lse. Without it the outputs
            are not that library's (this module has no weights, so nothing warns at load
            time: pass it when switching the import).
        softcap: the score cap c (s -> c * tanh(s / c), see `dilated_attention`); 0.0: none.
        sinks: True: a learnable sink logit per query head (`self.sinks`, an nn.Parameter
            (num_heads,), zero-initialised) joins every row's softmax denominator; needs
            num_heads. False (default): no sinks, and the module has no parameters.
        num_heads: the query heads (with sinks=True; forward's query must have them).
        device: of the sinks parameter.

    forward(query, key, value, causal=None, return_lse=False, *, is_causal=None,
    cu_seqlens=None): query (B, N, Hq, D), key/value (B, N, Hkv, D) with Hq % Hkv == 0;
    returns out like query, or (out, lse). `is_causal` is dilated-attention-pytorch's name
    for `causal`; cu_seqlens: packed documents (B == 1), as for `dilated_attention`.
    """

    def __init__(self, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
                 softmax_scale: Optional[float] = None, attention_dropout: float = 0.0, op=None, *,
                 causal: bool = False, mode: Optional[str] = None, offsets: str = "modulo",
                 scale: Optional[float] = None, backend: str = "auto", compat: Optional[str] = None,
                 softcap: float = 0.0, sinks: bool = False, num_heads: Optional[int] = None,
                 device: Optional[Union[torch.device, str]] = None):
        super().__init__()
        _ignore_op(op, "DilatedAttention")
        if softmax_scale is not None and scale is not None:
            raise ValueError(f"give scale or softmax_scale (the same argument), not both: got scale={scale}, "
                             f"softmax_scale={softmax_scale}")
        scale = _check_module_scale(scale if softmax_scale is None else softmax_scale)
        attention_dropout = _check_real("attention_dropout", attention_dropout)
        if attention_dropout != 0.0:
            raise ValueError(f"attention_dropout must be 0.0, got {attention_dropout}: the kernels have no "
                             f"attention-probability dropout (dilated-attention-pytorch stores attention_dropout "
                             f"but never applies it, so 0.0 reproduces its results)")
        self.compat, mode = _check_compat(compat, mode, scale)
        patterns = check_patterns(segment_lengths, dilation_rates, mode, offsets)
        self.segment_lengths = [w for w, _ in patterns]
        self.dilation_rates = [r for _, r in patterns]
        self.causal = check_bool("causal", causal)
        self.mode, self.offsets = mode, offsets
        self.scale = scale
        self.backend = _check_backend(backend)
        self.softcap = check_softcap(softcap)
        self.sinks = _sink_parameter(sinks, num_heads, device)
        if self.compat is not None and (self.softcap or self.sinks is not None):
            raise ValueError(f"softcap and sinks are not available with compat={self.compat!r} (that library has "
                             f"neither)")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, causal: Optional[bool] = None,
                return_lse: bool = False, *, is_causal: Optional[bool] = None, cu_seqlens: Optional[Tensor] = None):
        if is_causal is not None:
            if causal is not None:
                raise ValueError("give causal or is_causal (the same argument), not both")
            causal = check_bool("is_causal", is_causal)
        causal = self.causal if causal is None else causal
        if self.compat is not None:
            if cu_seqlens is not None:
                raise ValueError(f"cu_seqlens is not available with compat={self.compat!r} (that library's "
                                 f"normalisation sums over the whole sequence, not per document)")
            return self._compat_forward(query, key, value, causal, return_lse)
        extra = {}
        fn = dilated_attention_op if _compiling() else dilated_attention
        if cu_seqlens is not None:   # packed documents: the eager function (its document bounds are read on the host)
            fn, extra = dilated_attention, {"cu_seqlens": cu_seqlens}
        return fn(query, key, value, self.segment_lengths, self.dilation_rates, causal=causal, scale=self.scale,
                  mode=self.mode, offsets=self.offsets, return_lse=return_lse, backend=self.backend,
                  softcap=self.softcap, sinks=_sinks_arg(self.sinks), **extra)

    def _compat_forward(self, query, key, value, causal, return_lse):
        """dilated-attention-pytorch's DilatedAttention: per head group g of m,
        out_g = attention_g / sum over positions of attention_g, then out / m."""
        check_bool("return_lse", return_lse)
        if return_lse:
            raise ValueError(f"return_lse is not available with compat={self.compat!r} (its outputs are no "
                             f"longer a softmax average)")
        if isinstance(query, Tensor) and query.dim() == 4:
            _check_compat_heads(query.shape[2], len(self.segment_lengths), self.compat)
        fn = dilated_attention_op if _compiling() else dilated_attention
        out = fn(query, key, value, self.segment_lengths, self.dilation_rates, causal=causal, scale=None,
                 mode="head_groups", backend=self.backend)
        # The sum over positions (float32) is per (batch, head, channel); rows a group does
        # not use are 0 in `out` and stay 0.
        total = out.sum(dim=1, keepdim=True, dtype=torch.float32)
        return (out.float() / (len(self.segment_lengths) * total)).to(out.dtype)

    def extra_repr(self) -> str:
        compat = f", compat={self.compat!r}" if self.compat is not None else ""
        return (f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}, "
                f"causal={self.causal}, mode={self.mode!r}, offsets={self.offsets!r}, scale={self.scale}, "
                f"backend={self.backend!r}{compat}{_extras_repr(self)}")


class MultiheadDilatedAttention(nn.Module):
    """Multi-head dilated attention with the interface of dilated-attention-pytorch's
    `MultiheadDilatedAttention` (same positional arguments, parameter names and state_dict
    keys when num_kv_heads == num_heads):

        q_proj, k_proj, v_proj -> dilated attention -> norm (sub-LayerNorm, MAGNETO)
        -> dropout -> out_proj

    Args:
        embed_dim, num_heads: embed_dim % num_heads == 0; head_dim = embed_dim // num_heads
            (at most 256).
        dilation_rates, segment_lengths: one (w, r) per pattern (note the order, as in
            dilated-attention-pytorch).
        dropout: dropout probability on the attention output (the input of out_proj); the
            kernels have no attention-probability dropout.
        bias: biases in the four projections.
        layer_norm, layer_norm_eps: the LayerNorm before out_proj.
        gamma_init: xavier-normal gain of v_proj and out_proj (q_proj, k_proj: gain 1);
            biases start at 0.
        device, dtype: of the parameters.
        num_kv_heads: key/value heads (GQA/MQA); k_proj, v_proj map to
            num_kv_heads * head_dim. Default num_heads.
        mode, offsets, scale, backend: as for `dilated_attention` (mode default "longnet").
        op: dilated-attention-pytorch's choice of xformers kernel: accepted and ignored (see
            `DilatedAttention`).
        compat: None, or "dilated-attention-pytorch": that library's outputs (see
            `DilatedAttention` and the module docstring), so that its checkpoints load
            with `load_state_dict(strict=True)` and give its outputs and gradients. Implies
            mode="head_groups"; needs num_heads a multiple of len(dilation_rates), scale
            None and no group. Loading a state dict saved by that library's module into one
            built without compat warns (once per process): the keys match, the outputs do
            not. (Only a state dict with torch's metadata, as torch.save keeps it, shows
            where it came from.)
        group: a torch.distributed process group (e.g. torch.distributed.group.WORLD) for
            sequence parallelism: each rank passes its shard (B, N_local, E) of the
            sequence (see `triton_dilated.shard`) and gets its shard of the output, through
            `triton_dilated.ring_attention` with `comm` and `balance` (eager only: the
            ring is not traced by torch.compile). Default None: one device.
        sequence_parallel: with a group, "ring" (ring_attention, default) or "ulysses"
            (ulysses_attention: heads over the ranks by all-to-all; num_heads a multiple
            of the world size).
        softcap: the score cap c (s -> c * tanh(s / c), Gemma 2's attention cap); 0.0: none.
        sinks: True: a learnable sink logit per query head (`self.attention.sinks`, an
            nn.Parameter (num_heads,), zero-initialised; gpt-oss's sinks) joins every row's
            softmax denominator. Neither with compat (that library has neither).

    forward(query, key, value, is_causal=False, *, cu_seqlens=None) on (B, N, embed_dim)
    tensors (self-attention layout: key and value have the length of query) returns (out,
    None), out (B, N, embed_dim). cu_seqlens: packed documents (B == 1; int32 boundaries
    over the whole sequence, 0 first and N last, as for `dilated_attention`; with a group,
    over the full sequence, as for `ring_attention`): no position attends across a boundary.
    """

    def __init__(self, embed_dim: int, num_heads: int, dilation_rates: Sequence[int], segment_lengths: Sequence[int],
                 dropout: float = 0.0, bias: bool = True, layer_norm: bool = True, layer_norm_eps: float = 1e-5,
                 gamma_init: float = 1.0, device: Optional[Union[torch.device, str]] = None,
                 dtype: Optional[torch.dtype] = None, op=None, *, num_kv_heads: Optional[int] = None,
                 mode: Optional[str] = None, offsets: str = "modulo", scale: Optional[float] = None,
                 backend: str = "auto", group=None, comm: str = "p2p", balance: str = "contiguous",
                 compat: Optional[str] = None, sequence_parallel: str = "ring", softcap: float = 0.0,
                 sinks: bool = False):
        super().__init__()
        _ignore_op(op, "MultiheadDilatedAttention")
        embed_dim = check_int("embed_dim", embed_dim, 1)
        num_heads = check_int("num_heads", num_heads, 1)
        num_kv_heads = num_heads if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads, 1)
        compat, mode = _check_compat(compat, mode, scale)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
        head_dim = embed_dim // num_heads
        if head_dim > 256:
            raise ValueError(f"head_dim (embed_dim / num_heads = {head_dim}) must be <= 256")
        patterns = check_patterns(segment_lengths, dilation_rates, mode, offsets)
        if mode == "head_groups" and num_heads < len(patterns):
            raise ValueError(f"mode='head_groups' needs at least one head per pattern: num_heads ({num_heads}) < "
                             f"len(dilation_rates) ({len(patterns)})")
        if compat is not None:
            _check_compat_heads(num_heads, len(patterns), compat)
            if group is not None:
                raise ValueError(f"compat={compat!r} cannot be combined with group: its normalisation sums each "
                                 f"head's output over the whole sequence, which the ring does not gather")
        dropout = _check_real("dropout", dropout)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        check_bool("bias", bias)
        check_bool("layer_norm", layer_norm)
        layer_norm_eps = _check_real("layer_norm_eps", layer_norm_eps)
        if layer_norm_eps <= 0:
            raise ValueError(f"layer_norm_eps must be > 0, got {layer_norm_eps}")
        gamma_init = _check_real("gamma_init", gamma_init)
        check_choice("comm", comm, COMMS)
        check_choice("balance", balance, BALANCES)
        check_choice("sequence_parallel", sequence_parallel, ("ring", "ulysses"))
        if group is not None:
            if not torch.distributed.is_available():
                raise ValueError("group (sequence parallelism) needs torch.distributed, which this torch build lacks")
            if backend != "auto":
                raise ValueError(f"backend={backend!r} cannot be combined with group: ring_attention picks its "
                                 "own kernels; leave backend='auto'")

        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.layer_norm = layer_norm
        self.gamma_init = gamma_init
        self.group, self.comm, self.balance, self.sequence_parallel = group, comm, balance, sequence_parallel
        factory = dict(device=device, dtype=dtype)
        kv_dim = num_kv_heads * head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.attention = DilatedAttention([w for w, _ in patterns], [r for _, r in patterns], mode=mode,
                                          offsets=offsets, scale=scale, backend=backend, compat=compat,
                                          softcap=softcap, sinks=sinks, num_heads=num_heads,
                                          device=device)
        self.norm: Optional[nn.LayerNorm] = (nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory)
                                             if layer_norm else None)
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self._reset_parameters()
        # loading dilated-attention-pytorch's checkpoint without compat warns (see _warn_on_foreign_checkpoint)
        self._register_load_state_dict_pre_hook(_note_checkpoint_metadata, with_module=True)
        self.dropout._register_load_state_dict_pre_hook(_note_checkpoint_metadata, with_module=True)
        self.register_load_state_dict_post_hook(_warn_on_foreign_checkpoint)

    def _reset_parameters(self):
        # MAGNETO (arXiv 2210.06423, Fig. 2): gain gamma_init on v_proj and out_proj.
        for proj, gain in ((self.q_proj, 1.0), (self.k_proj, 1.0), (self.v_proj, self.gamma_init),
                           (self.out_proj, self.gamma_init)):
            nn.init.xavier_normal_(proj.weight, gain=gain)
            if proj.bias is not None:
                nn.init.constant_(proj.bias, 0)

    def _check_inputs(self, query, key, value):
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 3 or x.shape[-1] != self.embed_dim:
                raise ValueError(f"{name} must be (batch, seq_len, embed_dim={self.embed_dim}), "
                                 f"got shape {tuple(x.shape)}")
        if key.shape != value.shape or key.shape[:2] != query.shape[:2]:
            raise ValueError(f"query, key and value must share (batch, seq_len) (dilated attention aligns query "
                             f"and key positions), got {tuple(query.shape)}, {tuple(key.shape)}, "
                             f"{tuple(value.shape)}")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, is_causal: bool = False, *,
                cu_seqlens: Optional[Tensor] = None):
        self._check_inputs(query, key, value)
        check_bool("is_causal", is_causal)
        q = self.q_proj(query).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(key).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(value).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.group is None:
            x = self.attention(q, k, v, causal=is_causal, cu_seqlens=cu_seqlens)
        else:
            x = self._ring(q, k, v, is_causal, cu_seqlens)
        x = x.flatten(-2)
        # MAGNETO sub-LayerNorm before the output projection (unlike nn.MultiheadAttention)
        if self.norm is not None:
            x = self.norm(x)
        x = self.out_proj(self.dropout(x))
        return x, None

    def _ring(self, q, k, v, is_causal, cu_seqlens):
        att = self.attention
        common = dict(group=self.group, segment_lengths=att.segment_lengths, dilation_rates=att.dilation_rates,
                      causal=is_causal, scale=att.scale, mode=att.mode, offsets=att.offsets, balance=self.balance,
                      cu_seqlens=cu_seqlens, softcap=att.softcap, sinks=_sinks_arg(att.sinks))
        if self.sequence_parallel == "ulysses":
            return ulysses_attention(q, k, v, **common)
        return ring_attention(q, k, v, comm=self.comm, **common)

    def extra_repr(self) -> str:
        extra = f", group={self.group!r}, comm={self.comm!r}, balance={self.balance!r}, " \
            f"sequence_parallel={self.sequence_parallel!r}" if self.group is not None else ""
        if self.attention.compat is not None:
            extra += f", compat={self.attention.compat!r}"
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"dropout={self.dropout.p}{extra}{_extras_repr(self.attention)}")


# ----------------------------------------------------------------------------- block-sparse

BUILDER_INPUTS = ("seq_len", "qk")


class BlockSparseAttention(nn.Module):
    """Block-sparse attention over (B, N, H, D) tensors (see `block_sparse_attention`).

    Args:
        layout: a fixed `BlockLayout` (held as non-persistent buffers, so `.to(device)`
            moves it; it is configuration, not state: state_dict stays empty), or a
            builder callable returning a BlockLayout:
              * builder_input="seq_len" (default): called as `layout(seq_len)` with the
                length of key (q may be shorter: the last positions), once per
                sequence length (the `cache_size` most recently used layouts are kept, per
                (seq_len, device)), e.g.
                `functools.partial(layouts.local, block_size=64, window=2)` or
                `lambda n: layouts.bigbird(n, 64)`.
              * builder_input="qk": called as `layout(q, k)` on every forward, with q, k
                detached (content-adaptive builders), e.g.
                `lambda q, k: layouts.topk(q, k, top_k=4, block_size=64)`.
        causal: the default for forward's `causal`.
        scale: default 1/sqrt(D). backend: "auto", "triton" or "torch".
        cache_size: how many built layouts a seq_len builder keeps (least recently used
            dropped first; 0: rebuild on every call). Default 8.
        softcap: the score cap c (s -> c * tanh(s / c)); 0.0: none.
        sinks: True: a learnable sink logit per query head (`self.sinks`, an nn.Parameter
            (num_heads,), zero-initialised) joins every row's denominator; needs num_heads.

    forward(query, key, value, causal=None, return_lse=False) returns out like query, or
    (out, lse). torch.compile(fullgraph=True) needs a fixed layout (the builders use
    data-dependent shapes); with a builder, build outside the compiled region.
    """

    def __init__(self, layout: Union[BlockLayout, Callable], *, causal: bool = False, scale: Optional[float] = None,
                 backend: str = "auto", builder_input: str = "seq_len", cache_size: int = 8,
                 softcap: float = 0.0, sinks: bool = False, num_heads: Optional[int] = None):
        super().__init__()
        self.softcap = check_softcap(softcap)
        self.sinks = _sink_parameter(sinks, num_heads)
        check_choice("builder_input", builder_input, BUILDER_INPUTS)
        self.cache_size = check_int("cache_size", cache_size, 0)
        self.causal = check_bool("causal", causal)
        self.scale = _check_module_scale(scale)
        self.backend = _check_backend(backend)
        self.builder_input = builder_input
        self.builder: Optional[Callable] = None
        self.block_size: Optional[int] = None
        self._cache: collections.OrderedDict = collections.OrderedDict()   # LRU: oldest first
        if isinstance(layout, BlockLayout):
            if builder_input != "seq_len":
                raise ValueError("builder_input applies to a builder callable, not to a fixed BlockLayout")
            self.block_size = layout.block_size
            self.window = layout.window   # a sliding window's predicate (its flags: buffers too)
            names = ("kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices") + \
                (() if layout.window is None else ("kv_window", "q_window"))
            for name in names:
                self.register_buffer(name, getattr(layout, name), persistent=False)
        elif callable(layout):
            self.builder = layout
        else:
            raise TypeError(f"layout must be a BlockLayout or a callable returning one, got {type(layout).__name__}")

    @property
    def layout(self) -> Optional[BlockLayout]:
        """The fixed layout (None with a builder)."""
        if self.builder is not None:
            return None
        window = getattr(self, "window", None)
        return BlockLayout.from_canonical_lists(self.kv_num_blocks, self.kv_indices, self.q_num_blocks,
                                                self.q_indices, self.block_size, window=window,
                                                kv_window=self.kv_window if window else None,
                                                q_window=self.q_window if window else None)

    def _built(self, q, k) -> BlockLayout:
        if self.builder_input == "qk":
            with torch.no_grad():
                layout = self.builder(q.detach(), k.detach())
        else:
            # the layout covers the whole sequence, k's length: q may be shorter (DESIGN §5b)
            key = (k.shape[1], q.device)
            layout = self._cache.get(key)
            if layout is not None:
                self._cache.move_to_end(key)
                return layout
            layout = self.builder(k.shape[1])
        if not isinstance(layout, BlockLayout):
            raise TypeError(f"the layout builder must return a BlockLayout, got {type(layout).__name__}")
        if layout.kv_indices.device != q.device:
            layout = layout.to(q.device)
        if self.builder_input == "seq_len" and self.cache_size > 0:
            self._cache[key] = layout
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return layout

    def forward(self, query: Tensor, key: Tensor, value: Tensor, causal: Optional[bool] = None,
                return_lse: bool = False):
        causal = self.causal if causal is None else causal
        layout = self.layout if self.builder is None else self._built(query, key)
        fn = block_sparse_attention_op if _compiling() else block_sparse_attention
        return fn(query, key, value, layout, causal=causal, scale=self.scale, return_lse=return_lse,
                  backend=self.backend, softcap=self.softcap, sinks=_sinks_arg(self.sinks))

    def extra_repr(self) -> str:
        src = (f"builder={getattr(self.builder, '__name__', type(self.builder).__name__)}, "
               f"builder_input={self.builder_input!r}" if self.builder is not None
               else f"layout={self.layout!r}")
        return f"{src}, causal={self.causal}, scale={self.scale}, backend={self.backend!r}{_extras_repr(self)}"


def _extras_repr(module) -> str:
    """", softcap=..., sinks=H" where a module has them."""
    cap = f", softcap={module.softcap}" if module.softcap else ""
    return cap + (f", sinks={module.sinks.numel()}" if module.sinks is not None else "")
