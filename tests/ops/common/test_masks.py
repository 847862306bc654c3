"""The element-predicate vocabulary (ops/common/masks.py): each predicate against its literal
definition on every (query, key) pair of small position ranges, and/or composition, the
sliding window against transformers' own mask function and against the Triton twin the
kernels evaluate (ops/common/kernels.py window_keep, under the interpreter), FlashAttention's
window_size=(left, right) conversion, and the ring step's predicates."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from triton_dilated.ops.common import masks
from triton_dilated.ops.common.masks import AllOf, AnyOf, Band, SinkTokens, WindowPredicate, window_from_size
from triton_dilated.ops.ring.mask import MASK_DENSE, StepMask

try:
    import triton
    import triton.language as tl

    from triton_dilated.ops.common.kernels import window_keep

    @triton.jit
    def keep_kernel(out, q0, window, sink_tokens, HAS_SINK_TOKENS: tl.constexpr, M: tl.constexpr,
                    NK: tl.constexpr):
        qp = q0 + tl.arange(0, M)
        kp = tl.arange(0, NK)
        ok = window_keep(qp[:, None], kp[None, :], window, sink_tokens, HAS_SINK_TOKENS)
        tl.store(out + tl.arange(0, M)[:, None] * NK + kp[None, :], ok.to(tl.int8))
except ImportError:   # no triton: the portable backend's tests still run
    keep_kernel = None

N = 40
Q = torch.arange(-3, N)[:, None]   # a query before position 0 too (chunked prefill's left edge)
K = torch.arange(N)[None, :]


def every_pair(rule):
    """bool (len(Q), N): rule(p, p') evaluated one pair at a time, in Python integers."""
    return torch.tensor([[bool(rule(int(p), int(kp))) for kp in K[0]] for p in Q[:, 0]])


def test_causal_and_documents():
    assert torch.equal(masks.causal(Q, K), every_pair(lambda p, kp: kp <= p))
    q_doc, k_doc = Q // 7, K // 7
    assert torch.equal(masks.same_document(Q, K, q_doc, k_doc), every_pair(lambda p, kp: p // 7 == kp // 7))
    with pytest.raises(ValueError, match="same_document needs the documents' ids"):
        masks.same_document(Q, K)


@given(left=st.one_of(st.none(), st.integers(0, 50)), right=st.one_of(st.none(), st.integers(0, 50)))
def test_band(left, right):
    lo = 10 ** 9 if left is None else left
    hi = 10 ** 9 if right is None else right
    got = Band(left, right)(Q, K)
    assert got.shape == (Q.shape[0], N)
    assert torch.equal(got, every_pair(lambda p, kp: p - lo <= kp <= p + hi))


@given(window=st.integers(1, 60), sinks=st.integers(0, 60))
def test_window_predicate_is_its_definition(window, sinks):
    pred = WindowPredicate(window, sinks)
    want = every_pair(lambda p, kp: kp <= p and (kp > p - window or kp < sinks))
    assert torch.equal(pred(Q, K), want)
    # the same mask spelled in the vocabulary's parts, composed by & and |
    parts = masks.causal & (Band(window - 1, 0) | SinkTokens(sinks))
    assert torch.equal(parts(Q, K), want)
    assert pred == (window, sinks) and hash(pred) == hash((window, sinks))   # a layout's tuple


def test_window_predicate_equals_transformers():
    mu = pytest.importorskip("transformers.masking_utils")
    for window in (1, 3, 16):
        fn = mu.sliding_window_causal_mask_function(window)
        t = torch.tensor
        want = torch.tensor([[bool(fn(t(0), t(0), t(p), t(kp))) for kp in range(N)] for p in range(N)])
        assert torch.equal(WindowPredicate(window)(Q[3:], K), want), window


def test_composition():
    a, b, c = masks.causal, Band(3, 3), SinkTokens(2)
    assert torch.equal((a & b)(Q, K), a(Q, K) & b(Q, K))
    assert torch.equal((a | b)(Q, K), a(Q, K) | b(Q, K))
    assert torch.equal((a & (b | c))(Q, K), a(Q, K) & (b(Q, K) | c(Q, K)))
    assert isinstance(a & b, AllOf) and isinstance(a | b, AnyOf)
    assert (a & b) == (masks.causal & Band(3, 3)) and repr(a & (b | c)) == "(causal & (Band(left=3, right=3) | SinkTokens(2)))"
    with pytest.raises(TypeError, match="combines with predicates only"):
        a & torch.ones(3, dtype=torch.bool)


@pytest.mark.parametrize("bad, err, match", [
    (dict(window=0), ValueError, "window must be"), (dict(window=True), TypeError, "window must be an int"),
    (dict(window=4, sink_tokens=-1), ValueError, "sink_tokens must be"),
    (dict(window=2 ** 31), ValueError, "window must be below 2"),
])
def test_window_predicate_refuses(bad, err, match):
    with pytest.raises(err, match=match):
        WindowPredicate(**bad)


def test_window_keep_twin_in_triton():
    """The kernels' window_keep (a @triton.jit function) keeps exactly the pairs the predicate
    keeps, with and without sink tokens (one compile for every value: run-time ints)."""
    if keep_kernel is None:
        pytest.skip("needs triton")
    M, NK = 64, 64
    for window, sinks in ((1, 0), (5, 0), (9, 3), (70, 2)):
        out = torch.empty(M, NK, dtype=torch.int8)
        keep_kernel[(1,)](out, -3, window, sinks, HAS_SINK_TOKENS=sinks > 0, M=M, NK=NK)
        qp, kp = torch.arange(-3, M - 3)[:, None], torch.arange(NK)[None, :]
        assert torch.equal(out.bool(), WindowPredicate(window, sinks)(qp, kp)), (window, sinks)


@pytest.mark.parametrize("size, causal, want", [
    (None, False, (False, None)), ((-1, -1), False, (False, None)), ((-1, -1), True, (True, None)),
    ((-1, 0), False, (True, None)), ((7, 0), False, (True, WindowPredicate(8))),
    ((7, 5), True, (True, WindowPredicate(8))), ((0, 0), True, (True, WindowPredicate(1))),
    ((7, -1), True, (True, WindowPredicate(8))), ([3, 0], True, (True, WindowPredicate(4))),
])
def test_window_from_size(size, causal, want):
    assert window_from_size(size, causal) == want


def test_window_from_size_is_flash_attention_band():
    """FlashAttention: query i sees keys [i - left, i + right] (right 0 under causal)."""
    for left in (0, 1, 6):
        _, pred = window_from_size((left, 0), False)
        assert torch.equal(pred(Q, K), every_pair(lambda p, kp: p - left <= kp <= p)), left


@pytest.mark.parametrize("size, causal, err, match", [
    ((4, 2), False, ValueError, "reaches 2 later keys"), ((4, -1), False, ValueError, "reaches every later key"),
    ((-1, 3), False, ValueError, "only causal windows"), ((-2, 0), True, ValueError, "window_size's left must be -1"),
    ((4,), True, TypeError, "window_size must be a pair"), (4, True, TypeError, "window_size must be a pair"),
    ((4.0, 0), True, TypeError, "window_size must be a pair"), ((True, 0), True, TypeError, "pair of ints"),
])
def test_window_from_size_refuses(size, causal, err, match):
    with pytest.raises(err, match=match):
        window_from_size(size, causal)


def test_ring_step_predicates():
    """A ring step's element predicates: causal, and the same document with packed documents."""
    for causal in (False, True):
        for documents in (False, True):
            pred = StepMask(MASK_DENSE, causal, "cpu").predicate(documents=documents)
            if not causal and not documents:
                assert pred is None
                continue
            docs = (Q // 9, K // 9) if documents else ()
            want = torch.ones(Q.shape[0], N, dtype=torch.bool)
            if causal:
                want &= masks.causal(Q, K)
            if documents:
                want &= Q // 9 == K // 9
            assert torch.equal(pred(Q, K, *docs), want), (causal, documents)
