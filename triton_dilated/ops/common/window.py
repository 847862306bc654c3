"""The sliding-window element predicate (issue 23 item 3), once for every PyTorch path: the
block-sparse oracle, the portable training and decode paths and the portable ring step. The
Triton kernels evaluate the same expression (ops/common/kernels.py `window_keep`).

Query at position p sees key p' iff

    p' <= p  and  (p' > p - window  or  p' < sink_tokens)

the causal band of `window` keys ending at the query itself, exactly transformers'
`sliding_window_causal_mask_function(window)` (kv_idx > q_idx - window, kv_idx <= q_idx:
gpt-oss, Mistral, Gemma 2/3 sliding layers), plus the first `sink_tokens` positions
(StreamingLLM's attention-sink tokens; causal too). Positions are absolute (queries shorter
than keys, ring shards: global positions).

A BlockLayout carries the predicate as (window, sink_tokens) beside its block table and flags,
per active block, whether the predicate applies there ("window blocks", cut by the band's edge)
or the whole block is visible (inside the band, or a block another layout of a union makes
fully visible); see BlockLayout.window_blocks.
"""
from __future__ import annotations

from .validation import check_int


class WindowPredicate(tuple):
    """(window, sink_tokens): window >= 1 keys of the causal band, sink_tokens >= 0, both below
    2^31 (the kernels compare them with int32 positions; a window or sink count beyond the
    sequence means the same as the sequence's length: layouts.sliding_window clamps them)."""
    __slots__ = ()

    def __new__(cls, window, sink_tokens=0):
        window = check_int("window", window, 1)
        sink_tokens = check_int("sinks", sink_tokens, 0)
        for name, value in (("window", window), ("sinks", sink_tokens)):
            if value >= 2 ** 31:
                raise ValueError(f"{name} must be below 2^31 (positions are int32 in the kernels; any value past the "
                                 f"sequence's length means the same as that length), got {value}")
        return super().__new__(cls, (window, sink_tokens))

    @property
    def window(self) -> int:
        return self[0]

    @property
    def sink_tokens(self) -> int:
        return self[1]

    def keep(self, q_pos, k_pos):
        return window_keep(q_pos, k_pos, self.window, self.sink_tokens)

    def __repr__(self):
        return f"WindowPredicate(window={self.window}, sinks={self.sink_tokens})"


def window_keep(q_pos, k_pos, window: int, sink_tokens: int = 0):
    """bool, broadcast of q_pos and k_pos (integer tensors of absolute positions): whether the
    query at q_pos sees the key at k_pos under the sliding-window predicate."""
    return (k_pos <= q_pos) & ((k_pos > q_pos - window) | (k_pos < sink_tokens))


def check_window_causal(layout, causal: bool, name: str = "layout") -> None:
    """A window layout is causal by definition (transformers' sliding windows are causal; its
    bidirectional variant |p - p'| <= w is a different mask): causal=False is an error rather
    than a silent mix of a causal band with non-causal blocks."""
    pred = getattr(layout, "window", None)
    if pred is not None and not causal:
        raise ValueError(f"{name} carries a sliding window (window={pred.window}, sinks={pred.sink_tokens}), which "
                         f"is causal (keys p - window < p' <= p): pass causal=True, got causal=False")
