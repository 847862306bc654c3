"""Element predicates: which (query, key) pairs attend, once for every PyTorch path (the
oracles, the portable training and decode paths, the portable ring step, FlexAttention's
mask_mod). The Triton kernels evaluate the same expressions (ops/common/kernels.py
`window_keep`; causal and same-document tests inline).

A predicate is called on absolute positions (integer tensors that broadcast; queries shorter
than keys and ring shards use global positions), and on packed documents' ids where it needs
them:

    pred(q_pos, k_pos)                  -> bool tensor
    pred(q_pos, k_pos, q_doc, k_doc)    -> bool tensor

and composes with `&` and `|` (attention-gym's and_masks / or_masks):

    causal                      p' <= p
    Band(left, right)           p - left <= p' <= p + right (None: that side unbounded)
    SinkTokens(n)               p' < n (StreamingLLM's attention-sink tokens)
    same_document               doc(p) == doc(p')
    WindowPredicate(w, n)       causal & (Band(w - 1, 0) | SinkTokens(n)): transformers'
                                sliding_window_causal_mask_function(w) (gpt-oss, Mistral,
                                Gemma 2/3 sliding layers) plus n sink tokens

The other two mask vocabularies are block- and pattern-level, not element predicates: block
layouts (ops/block_sparse/layout.py; a layout carrying a WindowPredicate applies it in its
window blocks) and dilated patterns (ops/dilated/patterns.py; a pair's weight is how many
patterns select it, a multiplicity, not a bool).
"""
from __future__ import annotations

from .validation import check_int

INT32_LIMIT = 2 ** 31   # the kernels compare positions, windows and sink counts as int32


class Predicate:
    """An element predicate (module docstring). Subclasses define __call__."""
    __slots__ = ()

    def __call__(self, q_pos, k_pos, q_doc=None, k_doc=None):
        raise NotImplementedError

    def __and__(self, other):
        return AllOf(self, other)

    def __or__(self, other):
        return AnyOf(self, other)


class _Composite(Predicate):
    __slots__ = ("parts",)
    _JOIN = ""

    def __init__(self, *parts):
        for p in parts:
            if not isinstance(p, Predicate):
                raise TypeError(f"a mask predicate combines with predicates only, got {type(p).__name__}")
        self.parts = parts

    def __repr__(self):
        return "(" + f" {self._JOIN} ".join(map(repr, self.parts)) + ")"

    def __eq__(self, other):
        return type(other) is type(self) and other.parts == self.parts

    def __hash__(self):
        return hash((type(self), self.parts))


class AllOf(_Composite):
    """Every part holds (`a & b`)."""
    __slots__ = ()
    _JOIN = "&"

    def __call__(self, q_pos, k_pos, q_doc=None, k_doc=None):
        ok = self.parts[0](q_pos, k_pos, q_doc, k_doc)
        for p in self.parts[1:]:
            ok = ok & p(q_pos, k_pos, q_doc, k_doc)
        return ok


class AnyOf(_Composite):
    """Some part holds (`a | b`)."""
    __slots__ = ()
    _JOIN = "|"

    def __call__(self, q_pos, k_pos, q_doc=None, k_doc=None):
        ok = self.parts[0](q_pos, k_pos, q_doc, k_doc)
        for p in self.parts[1:]:
            ok = ok | p(q_pos, k_pos, q_doc, k_doc)
        return ok


class _Causal(Predicate):
    __slots__ = ()

    def __call__(self, q_pos, k_pos, q_doc=None, k_doc=None):
        return k_pos <= q_pos

    def __repr__(self):
        return "causal"


class _SameDocument(Predicate):
    __slots__ = ()

    def __call__(self, q_pos, k_pos, q_doc=None, k_doc=None):
        if q_doc is None or k_doc is None:
            raise ValueError("same_document needs the documents' ids of the queries and keys (q_doc, k_doc)")
        return q_doc == k_doc

    def __repr__(self):
        return "same_document"


causal = _Causal()
same_document = _SameDocument()


class Band(Predicate):
    """p - left <= p' <= p + right; None leaves that side unbounded (FlashAttention's
    window_size=(left, right), where -1 is None)."""
    __slots__ = ("left", "right")

    def __init__(self, left, right):
        self.left = None if left is None else check_int("left", left, 0)
        self.right = None if right is None else check_int("right", right, 0)

    def __call__(self, q_pos, k_pos, q_doc=None, k_doc=None):
        ok = None
        if self.left is not None:
            ok = k_pos >= q_pos - self.left
        if self.right is not None:
            later = k_pos <= q_pos + self.right
            ok = later if ok is None else ok & later
        return (k_pos <= q_pos) | (k_pos > q_pos) if ok is None else ok   # unbounded: every pair

    def __repr__(self):
        return f"Band(left={self.left}, right={self.right})"

    def __eq__(self, other):
        return type(other) is Band and (other.left, other.right) == (self.left, self.right)

    def __hash__(self):
        return hash((Band, self.left, self.right))


class SinkTokens(Predicate):
    """p' < n: the first n positions, visible from every query (StreamingLLM)."""
    __slots__ = ("n",)

    def __init__(self, n):
        self.n = check_int("sink_tokens", n, 0)

    def __call__(self, q_pos, k_pos, q_doc=None, k_doc=None):
        return k_pos < self.n

    def __repr__(self):
        return f"SinkTokens({self.n})"

    def __eq__(self, other):
        return type(other) is SinkTokens and other.n == self.n

    def __hash__(self):
        return hash((SinkTokens, self.n))


class WindowPredicate(Predicate, tuple):
    """(window, sink_tokens): the sliding window of `window` >= 1 keys ending at the query, plus
    the first `sink_tokens` >= 0 positions, causal (module docstring). A tuple, so layouts and
    custom ops carry it as two ints; both below 2^31 (a window or sink count beyond the
    sequence means the same as the sequence's length: layouts.sliding_window clamps them)."""
    __slots__ = ()

    def __new__(cls, window, sink_tokens=0):
        window = check_int("window", window, 1)
        sink_tokens = check_int("sink_tokens", sink_tokens, 0)
        for name, value in (("window", window), ("sink_tokens", sink_tokens)):
            if value >= INT32_LIMIT:
                raise ValueError(f"{name} must be below 2^31 (positions are int32 in the kernels; any value past the "
                                 f"sequence's length means the same as that length), got {value}")
        return tuple.__new__(cls, (window, sink_tokens))

    @property
    def window(self) -> int:
        return self[0]

    @property
    def sink_tokens(self) -> int:
        return self[1]

    @property
    def predicate(self) -> Predicate:
        """The same mask spelled in the vocabulary's parts."""
        band = Band(self.window - 1, 0)
        return causal & (band | SinkTokens(self.sink_tokens) if self.sink_tokens else band)

    def __call__(self, q_pos, k_pos, q_doc=None, k_doc=None):
        return self.predicate(q_pos, k_pos)

    def __repr__(self):
        return f"WindowPredicate(window={self.window}, sink_tokens={self.sink_tokens})"


def window_from_size(window_size, causal: bool):
    """FlashAttention's window_size=(left, right) (-1: unbounded) at a training door -> (causal,
    WindowPredicate or None). A query sees keys p - left <= p' <= p + right; causal=True sets
    right to 0, as FlashAttention does. The kernels evaluate causal windows only (right = 0),
    the sliding layers of every model that uses one; a window reaching later keys is a
    ValueError. (left, 0) with causal=False is the same mask as with causal=True, and is
    computed as that."""
    if window_size is None:
        return causal, None
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for an unbounded side, got "
                        f"{window_size!r}")
    left, right = window_size
    for name, value in (("left", left), ("right", right)):
        if value < -1 or value >= INT32_LIMIT - 1:
            raise ValueError(f"window_size's {name} must be -1 (unbounded) or in [0, 2^31 - 1), got {value}")
    if causal:
        right = 0
    if right == -1 and left == -1:
        return causal, None
    if right != 0:
        raise ValueError(f"window_size=({left}, {right}) reaches {'every later key' if right < 0 else f'{right} later keys'}"
                         f": only causal windows (right = 0, or causal=True) are supported; a bidirectional window "
                         f"is a block layout (layouts.local) instead")
    return True, (None if left == -1 else WindowPredicate(left + 1))


def check_window_causal(layout, causal: bool, name: str = "layout") -> None:
    """A window layout is causal by definition (transformers' sliding windows are causal; its
    bidirectional variant |p - p'| <= w is a different mask): causal=False is an error rather
    than a silent mix of a causal band with non-causal blocks."""
    pred = getattr(layout, "window", None)
    if pred is not None and not causal:
        raise ValueError(f"{name} carries a sliding window (window={pred.window}, sinks={pred.sink_tokens}), which "
                         f"is causal (keys p - window < p' <= p): pass causal=True, got causal=False")
