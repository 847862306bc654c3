"""Double backward: a clear error, never a silently dropped term (DESIGN §6).

With create_graph=True, autograd records the backward of each Function so that its
gradients can be differentiated again. A backward made of kernel launches records nothing:
its gradients would look like constants to a second backward, whose result would silently
lack the attention's second-order term; a composite portable path fails deep inside
PyTorch instead ("derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward
is not implemented"). Two wrappers give both one error, raised when a second backward
reaches the gradients; a first-order use of create_graph=True still works:

* `first_order_backward(what)`: decorates the backward of an autograd.Function computed by
  kernels (the Triton paths, the ring);
* `first_order_inputs(what, *xs)`: marks the inputs of a composite computation (the portable
  paths), whose own backward then runs as usual.
"""
from __future__ import annotations

import functools

import torch


def _message(what: str) -> str:
    return (f"{what}: double backward (differentiating gradients taken with create_graph=True) is not supported: "
            "this path's gradients have no derivative of their own, so the attention's second-order term would be "
            "dropped. Use first-order gradients only through this path.")


class _Refuse(torch.autograd.Function):
    """(anchors, grads) -> copies of grads whose backward raises. The anchors (the inputs and
    incoming gradients the grads belong to) only connect this node to the graph, so that a
    second backward asked for any of them reaches it rather than reporting it unused."""

    @staticmethod
    def forward(ctx, what, n_anchors, *tensors):
        ctx.what = what
        return tuple(g.detach().clone() for g in tensors[n_anchors:])

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(_message(ctx.what))


def _refused(what, anchors, grads):
    """grads (a sequence with None or non-tensors) with every tensor routed through _Refuse."""
    present = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
    anchors = [a for a in anchors if isinstance(a, torch.Tensor) and a.requires_grad]
    if not present or not anchors:   # nothing here can be differentiated again
        return tuple(grads)
    marked = _Refuse.apply(what, len(anchors), *anchors, *(grads[i] for i in present))
    out = list(grads)
    for i, g in zip(present, marked):
        out[i] = g
    return tuple(out)


def first_order_backward(what: str):
    """Decorator for the backward of an autograd.Function computed by kernels; `what` names
    the path in the error, e.g. "dilated_attention (Triton path)"."""
    def wrap(backward):
        @functools.wraps(backward)
        def run(ctx, *grad_outputs):
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            if not torch.is_grad_enabled():   # an ordinary backward: create_graph=False
                return grads
            return _refused(what, (*grad_outputs, *ctx.saved_tensors), grads)
        return run
    return wrap


class _FirstOrderInputs(torch.autograd.Function):
    """Identity on the inputs of a composite computation; under create_graph=True the
    gradients it passes back go through _Refuse."""

    @staticmethod
    def forward(ctx, what, *xs):
        ctx.what = what
        ctx.save_for_backward(*xs)
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            grads = _refused(ctx.what, ctx.saved_tensors, grads)
        return (None, *grads)


def needs_grad(*tensors) -> bool:
    """Whether autograd records a computation on `tensors` (grad mode on, one requires grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def first_order_inputs(what: str, *xs):
    """xs, marked so that a double backward through the computation that follows raises
    NotImplementedError naming `what`."""
    if needs_grad(*xs):
        return _FirstOrderInputs.apply(what, *xs)
    return xs


def joined_to(result, *inputs):
    """result, joined with a zero gradient to the autograd graph of the inputs that require
    one. A computation that read none of them (no query row has a key: an empty block
    layout, a head slice whose offsets miss a short sequence) would otherwise return a
    tensor that backward() refuses, where the Triton path returns zero gradients."""
    anchors = [x for x in inputs if x.requires_grad]
    if result.requires_grad or not anchors or not torch.is_grad_enabled():
        return result
    return result + sum(x.reshape(-1)[:0].sum() for x in anchors)   # + 0 (an empty sum), keeps result's dtype
