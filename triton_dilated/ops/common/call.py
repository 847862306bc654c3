"""One attention call's score rules, validated once at a public door and carried as one
object to the launchers (DESIGN §3): `causal`, the score `scale`, the soft cap and the sink
logits. Every layer under a door takes an `AttentionCall`, never the loose keywords: a new
score feature is a field here, not a keyword threaded through every file.

Soft cap: one convention, FlashAttention's: a float, 0.0 = no cap. The doors also take None
(transformers configs say `attn_logit_softcapping=None`), read here once as 0.0. The Triton
kernels see it as `HAS_SOFTCAP` (compile-time) and the float (run-time, one compile for every
cap); the PyTorch paths through `cap_scores`.

Sinks: a float32 logit per query head joining every row's softmax denominator once. They are
added to the door's merged (out, lse) (`finish`), never inside the kernels or per part.

Window: FlashAttention's `window_size=(left, right)` read once (masks.window_from_size) into a
causal WindowPredicate of left + 1 keys. Dilated attention evaluates it in its kernels and
paths; the block-sparse doors fold it into the layout (layout & layouts.sliding_window).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .lse import add_sinks
from .masks import WindowPredicate, window_from_size
from .validation import check_bool, check_scale


def check_softcap(softcap) -> float:
    """softcap (scores s -> c * tanh(s / c) before the softmax): 0.0 or None (no cap) or a
    positive finite number -> float (0.0: no cap). A bool, a negative number, NaN and inf are
    a ValueError (softcap=True reads as "cap on" but names no cap); other types a TypeError."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool):
        raise ValueError(f"softcap must be a positive finite float (the cap c in c * tanh(s / c)), or 0.0 for no "
                         f"cap, got a bool ({softcap!r})")
    if not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0.0: no cap), got {type(softcap).__name__} ({softcap!r})")
    cap = float(softcap)
    if not (0.0 <= cap < float("inf")):   # NaN fails too
        raise ValueError(f"softcap must be a positive finite float, or 0.0 for no cap, got {softcap!r}")
    return cap


def check_sinks(sinks, num_heads: int, device, *, allow_float64: bool = False):
    """sinks (one learnable logit per query head, joining every row's softmax denominator):
    None or a float32 tensor (Hq,) on q's device (the float64 oracles also take float64)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a float32 tensor of shape (Hq,) = ({num_heads},) or None, got "
                        f"{type(sinks).__name__}")
    if sinks.dtype != torch.float32 and not (allow_float64 and sinks.dtype == torch.float64):
        raise TypeError(f"sinks must be a float32 tensor, got {sinks.dtype}")
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must have shape (Hq,) = ({num_heads},) (one logit per query head), got "
                         f"{tuple(sinks.shape)}")
    if sinks.device != torch.device(device):
        raise ValueError(f"sinks must be on the device of q ({device}), got {sinks.device}")
    return sinks


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionCall:
    """The score rules of one call: validated values (build it with `at_door`, or directly
    from values already checked, e.g. inside a custom op)."""
    causal: bool
    scale: float
    softcap: float = 0.0                      # 0.0: no cap
    sinks: Optional[torch.Tensor] = None      # float32 (Hq,), or None
    window: Optional[WindowPredicate] = None  # a causal sliding window (ops/common/masks.py), or None

    @classmethod
    def at_door(cls, q, *, causal, scale, softcap, sinks, window_size=None) -> "AttentionCall":
        """Validate a door's keywords (q: (B, N, Hq, D), already checked). window_size:
        FlashAttention's (left, right) (masks.window_from_size: a causal window, which makes
        the call causal)."""
        check_bool("causal", causal)
        causal, window = window_from_size(window_size, causal)
        return cls(causal, check_scale(scale, q.shape[-1]), check_softcap(softcap),
                   check_sinks(sinks, q.shape[2], q.device), window)

    @property
    def capped(self) -> bool:
        return self.softcap > 0.0

    def needs_lse(self, return_lse: bool) -> bool:
        """Whether the layers below must return lse: asked for, or needed to add the sinks."""
        return return_lse or self.sinks is not None

    def without_sinks(self) -> "AttentionCall":
        return dataclasses.replace(self, sinks=None)

    def without_window(self) -> "AttentionCall":
        return dataclasses.replace(self, window=None)

    @property
    def window_keys(self) -> int:
        """The window's number of keys for custom-op schemas and kernels (0: no window)."""
        return 0 if self.window is None else self.window.window

    def cap_scores(self, scores):
        """The PyTorch paths' cap, s -> c * tanh(s / c) (no cap: unchanged). Apply it after
        nonfinite_to_nan: tanh would make an infinite score finite; a NaN stays NaN."""
        return torch.tanh(scores / self.softcap) * self.softcap if self.capped else scores

    def cap_scores_(self, scores):
        """The cap in place on a float32 score buffer, for paths with a hand-written backward:
        (capped scores, t = tanh(s / c)), t for the backward's factor d(c tanh(s / c)) / ds =
        1 - t^2 (None without a cap). +-inf scores (an Inf query or key) become NaN first: tanh
        would make them finite, and callers that skip the NaN rule's input scan rely on a NaN
        lse."""
        if not self.capped:
            return scores, None
        t = scores.add_(scores * 0.0).div_(self.softcap).tanh_()
        return t * self.softcap, t

    def kernel_args(self) -> dict:
        """The Triton kernels' soft-cap keywords: HAS_SOFTCAP (compile-time) and the run-time
        float32 cap (None without one: the uncapped kernel compiles as if it were absent)."""
        return dict(HAS_SOFTCAP=self.capped, softcap=self.softcap if self.capped else None)

    def finish(self, res, return_lse: bool):
        """A door's result from the (out, lse) its layers returned: the sinks joined once to
        every row's denominator (device arithmetic, no host sync, differentiable), then out
        alone without return_lse. Where a result is merged from parts (ring steps, patterns),
        call it once on the merged (out, lse), never per part."""
        if self.sinks is not None:
            res = add_sinks(*res, self.sinks)
        return res if return_lse else res[0]
