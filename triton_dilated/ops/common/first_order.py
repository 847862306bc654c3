"""Double backward on paths whose backward is a fused kernel: a clear error, never a
silently dropped term (DESIGN §6).

With create_graph=True, autograd records the backward of each Function so that its
gradients can be differentiated again. A backward made of kernel launches records
nothing: the gradients it returns would look like constants to a second backward, whose
result would then silently lack the attention's second-order term. `first_order_only`
wraps such a backward: it runs without recording, and under create_graph=True its
gradients get a node that raises when a second backward reaches it. A first-order use of
create_graph=True (the gradients never differentiated again) still works.
"""
from __future__ import annotations

import functools

import torch


class _NoSecondDerivative(torch.autograd.Function):
    """(grads, anchors) -> detached aliases of grads; its backward raises. The anchors (the
    Function's inputs and incoming gradients) connect this node to the graph, so that a
    second backward asked only for, say, q's gradient still reaches it."""

    @staticmethod
    def forward(ctx, message, n_grads, *tensors):
        ctx.message = message
        return tuple(g.detach() for g in tensors[:n_grads])

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(ctx.message)


def first_order_only(what: str):
    """Decorator for the backward of a torch.autograd.Function computed by kernels.
    `what` names the path in the error, e.g. "dilated_attention (Triton path)"."""
    message = (f"{what}: double backward is not supported. Gradients computed with create_graph=True were "
               "differentiated again, but this path computes its gradients with its own kernels, which have no "
               "derivative of their own: the attention's second-order term would be silently dropped. Use "
               "first-order gradients only through this path.")

    def wrap(backward):
        @functools.wraps(backward)
        def run(ctx, *grad_outputs):
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            if not torch.is_grad_enabled():   # an ordinary backward: create_graph=False
                return grads
            tensors = [g for g in grads if isinstance(g, torch.Tensor)]
            anchors = [t for t in (*grad_outputs, *ctx.saved_tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not tensors or not anchors:   # nothing here can be differentiated again
                return grads
            marked = iter(_NoSecondDerivative.apply(message, len(tensors), *tensors, *anchors))
            return tuple(next(marked) if isinstance(g, torch.Tensor) else g for g in grads)
        return run
    return wrap
