"""`trace_constant`: a cached function that torch.compile calls at trace time instead of tracing.

Dynamo does not honour functools.lru_cache: it traces the wrapped function on every trace and
warns that this may be silently incorrect ("Dynamo detected a call to a
`functools.lru_cache`-wrapped function"). A cached fact of the process (whether triton
imports) may as well be called once by dynamo and kept as a constant: a plain function with
`_dynamo_marked_constant = True` (what torch.compiler.assume_constant_result sets, without
importing torch._dynamo; ops/common/op_support.py's _constant_path does the same). Only for
functions of Python-constant arguments: dynamo cannot pass a tensor or a symbolic size to it
(a cache keyed on shapes is kept off the traced path instead, as patterns.head_table does).
"""
from __future__ import annotations

import functools


def trace_constant(fn):
    """functools.cache of `fn`, as a plain function that dynamo treats as a constant: under
    torch.compile it is called at trace time (arguments must be Python constants there, not
    tensors or symbolic sizes) and its result enters the graph as a constant. `__wrapped__` is
    the uncached function; `cache_info` and `cache_clear` are the cache's."""
    cached = functools.cache(fn)

    @functools.wraps(fn)
    def constant(*args, **kwargs):
        return cached(*args, **kwargs)

    constant.cache_info, constant.cache_clear = cached.cache_info, cached.cache_clear
    constant._dynamo_marked_constant = True
    return constant
