"""Shared pieces of the variants' torch.library custom ops (each variant's interface.py
defines its own ops; these helpers keep them short).

The ops take `path`, the backend resolved once ("triton" or "torch"), so their fake
(meta) implementations do not depend on the environment. On the portable path the
backward op recomputes the portable forward with autograd recording and differentiates it
(`recompute_grads`): one extra portable forward of compute and no portable autograd graph
kept alive between forward and backward (activation-checkpoint style).
"""
from __future__ import annotations

import functools
import importlib

import torch
from torch import Tensor

from .runtime import resolve_backend

PATHS = ("triton", "torch")


def lazy_module(name: str):
    """A function that returns the module `name`, importing it on its first call: the kernel
    files import triton, so they load on the first Triton call, never on `import triton_dilated`."""
    return functools.cache(lambda: importlib.import_module(name))


def check_path(path: str) -> None:
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")


def resolve_path(backend: str, device: str, families=(), head_dim=0, dtype: torch.dtype = torch.float16) -> str:
    """resolve_backend, evaluated once at trace time under torch.compile (it reads the
    environment, whether triton imports and the GPU's config tables: facts that do not change
    in a process), so eager and compiled calls take the same path. `head_dim`: q.shape[-1];
    the path depends on it only through its padded size, which is found by comparisons: under
    dynamic shapes a symbolic head dim then turns into guards and a plain int, which a
    constant function can take (the symbol itself cannot be passed)."""
    padded = 0 if not head_dim else next((p for p in (16, 32, 64, 128) if head_dim <= p), 256)
    return _constant_path(backend, device, tuple(families), padded, dtype)


def _constant_path(backend: str, device: str, families: tuple, head_dim: int, dtype: torch.dtype) -> str:
    return resolve_backend(backend, torch.device(device), families, head_dim, dtype)


# = torch.compiler.assume_constant_result(_constant_path), which only sets this flag but
# imports torch._dynamo (~3 s) to do it: dynamo calls it at trace time with constant
# arguments instead of tracing into it (the config tables are read with importlib.resources,
# which dynamo cannot trace). Should the flag ever stop working, dynamo traces it.
_constant_path._dynamo_marked_constant = True


def empty_stats(q: Tensor) -> Tensor:
    """A zero-length (B, Hq, 0) float32 output: what the op returns for an output the caller
    did not ask for (row statistics on the portable path, lse without return_lse)."""
    return q.new_empty((q.shape[0], q.shape[2], 0), dtype=torch.float32)


def fresh(x: Tensor) -> Tensor:
    """A contiguous tensor that is not a view of anything the op received."""
    return x.contiguous() if x._base is None else x.clone(memory_format=torch.contiguous_format)


def recompute_grads(fn, inputs, cotangents):
    """Gradients of the portable forward `fn` at `inputs` for `cotangents`, by recomputing
    it with autograd recording. Inside a custom op's implementation the autograd dispatch
    keys are switched off (the op is below autograd); this switches them back on for the
    recomputation only, as torch.utils.checkpoint does for its own recomputation.
    (torch.func.vjp would also work here, but its wrapper tensors break under
    TorchDispatchModes such as FlopCounterMode.)"""
    keys = torch._C.DispatchKey
    with torch._C._SetExcludeDispatchKeyGuard(keys.AutogradFunctionality, False), \
            torch._C._SetExcludeDispatchKeyGuard(keys.ADInplaceOrView, False), torch.enable_grad():
        leaves = [x.detach().requires_grad_(True) for x in inputs]
        outs = fn(*leaves)
        grads = torch.autograd.grad(outs, leaves, cotangents, allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else fresh(g) for g, x in zip(grads, leaves))
