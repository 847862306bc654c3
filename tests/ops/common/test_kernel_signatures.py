"""The kernels' signatures (issue 31 item 5; architecture review 2, section 1(c)): run-time
feature values share one compile, and no @triton.jit function takes more than 45 parameters."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

PACKAGE = ROOT / "triton_dilated"
MAX_PARAMETERS = 45
# constexpr values that compiled every kernel once per value (now HAS_* booleans + run-time values)
VALUE_CONSTEXPRS = {"SOFTCAP", "WINDOW", "SINK_TOKENS"}


def _jit_functions():
    """(file:line name, parameter names) of every @triton.jit function of the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                yield f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}", [a.arg for a in node.args.args]


def test_jit_functions_take_at_most_45_parameters_and_no_feature_values():
    """Parameters counted as the review's appendix A1 counts them: every positional parameter,
    constexprs included. A feature's value is never a constexpr (one compile per value): the
    kernels take HAS_SOFTCAP / HAS_WINDOW / HAS_SINK_TOKENS and the value at run time."""
    functions = dict(_jit_functions())
    assert len(functions) >= 40, sorted(functions)   # the parse found the kernels
    too_many = {name: len(params) for name, params in functions.items() if len(params) > MAX_PARAMETERS}
    assert not too_many, f"more than {MAX_PARAMETERS} parameters: {too_many}"
    valued = {name: sorted(VALUE_CONSTEXPRS & set(params)) for name, params in functions.items()
              if VALUE_CONSTEXPRS & set(params)}
    assert not valued, f"feature values as parameters that compile once per value: {valued}"
    kernels = {name: params for name, params in functions.items() if name.endswith("_kernel")}
    for name, params in kernels.items():   # a launched kernel's run-time value comes with its feature flag
        for value, flag in (("softcap", "HAS_SOFTCAP"), ("window", "HAS_WINDOW"), ("sink_tokens", "HAS_SINK_TOKENS")):
            assert value not in params or flag in params, f"{name}: {value} without {flag}"


# Launches every kernel family twice with CPU tensors, compiled mode (TRITON_INTERPRET unset), with
# JITFunction.run replaced: instead of compiling it records the key Triton's JIT cache files the
# launch under (runtime/jit.py: compute_cache_key of the binder's specialization (each argument's
# type, its integer or alignment specialization, every constexpr's value) and the options), for an
# sm90 target. Prints {scenario: {call: [[kernel, key], ...]}} as JSON.
KEYS = r"""
import json, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime import jit

backend = make_backend(GPUTarget("cuda", 90, 32))
launches = []

def record(self, *args, grid, warmup, **kwargs):
    binder = jit.create_function_from_signature(self.signature, self.params, backend)
    _, specialization, options = binder(*args, **kwargs)
    launches.append([self.fn.__name__, jit.compute_cache_key({}, specialization, options)])

jit.JITFunction.run = record

from triton_dilated.ops.common.call import AttentionCall
from triton_dilated.ops.common.masks import WindowPredicate
from triton_dilated import layouts
from triton_dilated.ops.block_sparse.decode_kernels import block_sparse_decode_forward
from triton_dilated.ops.block_sparse.kernels import block_sparse_backward, block_sparse_forward
from triton_dilated.ops.dilated.decode_kernels import dilated_decode_forward
from triton_dilated.ops.dilated.kernels import dilated_backward, dilated_forward
from triton_dilated.ops.dilated.patterns import head_offsets
from triton_dilated.ops.ring.mask import MASK_DILATED, MASK_LAYOUT, StepMask
from triton_dilated.ops.ring.step_kernels import step_backward, step_forward

B, N, Hq, Hkv, D = 1, 256, 4, 2, 64
torch.manual_seed(0)
q, do = torch.randn(B, N, Hq, D), torch.randn(B, N, Hq, D)
k, v = torch.randn(B, N, Hkv, D), torch.randn(B, N, Hkv, D)
stats = torch.zeros(B, Hq, N)
pats = ((64, 1), (128, 2))
table = head_offsets(Hq, pats, "longnet", "modulo")
lengths = torch.full((B,), N, dtype=torch.int32)
pos = torch.arange(N, dtype=torch.int32)

def calls(softcap, layout, window):
    # one launch of every kernel family: (name, launcher call) for a cap, a block layout and
    # a window (dilated: window_size's WindowPredicate in the call)
    call = AttentionCall(True, 0.125, softcap or 0.0)
    windowed = AttentionCall(True, 0.125, softcap or 0.0, window=window and WindowPredicate(window))

    def ring(kind):
        mask = StepMask(kind, True, "cpu", patterns=pats, table=table, layout=layout)
        acc = [torch.zeros(B, N, h, D) for h in (Hq, Hq, Hkv, Hkv)]
        step_forward(q, k, v, pos, pos, acc[0], stats.clone(), mask, call)
        step_backward(q, k, v, do, stats, stats, pos, pos, acc[1], acc[2], acc[3], mask, call)
    yield "dilated", lambda: (dilated_forward(q, k, v, pats, table, windowed),
                              dilated_backward(do, None, q, k, v, q, stats, stats, pats, table, windowed))
    yield "block_sparse", lambda: (block_sparse_forward(q, k, v, layout, call),
                                   block_sparse_backward(do, None, q, k, v, q, stats, stats, layout, call))
    yield "ring_dilated", lambda: ring(MASK_DILATED)
    yield "ring_layout", lambda: ring(MASK_LAYOUT)
    yield "dilated_decode", lambda: dilated_decode_forward(q[:, :2], k, v, pats, table, lengths, windowed,
                                                           splits=2)
    yield "block_sparse_decode", lambda: block_sparse_decode_forward(q[:, :2], k, v, layout, lengths, call,
                                                                     splits=2)

def keys(softcap, layout, window=None):
    out = {}
    for name, call in calls(softcap, layout, window):
        launches.clear()
        call()
        out[name] = list(launches)
    return out

local = layouts.local(N, 32, 1, causal=True)
print(json.dumps({
    "cap30": keys(30.0, local), "cap50": keys(50.0, local), "uncapped": keys(None, local),
    "window64": keys(None, layouts.sliding_window(N, 32, window=64, sinks=4), 64),
    "window100": keys(None, layouts.sliding_window(N, 32, window=100, sinks=16), 100),
}))
"""


@pytest.fixture(scope="module")
def cache_keys():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", KEYS], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _differences(a, b):
    """The launches whose cache keys differ between two runs of the same calls."""
    return [f"{call}: {ka[0]}\n  {ka[1]}\n  {kb[1]}" for call in a for ka, kb in zip(a[call], b[call]) if ka != kb]


@pytest.mark.parametrize("first, second", [("cap30", "cap50"), ("window64", "window100")],
                         ids=["softcap-30-50", "window-64-100-sinks-4-16"])
def test_feature_values_share_one_compile(cache_keys, first, second):
    """Triton compiles a kernel once per cache key: the specialization its binder derives from
    the launch (each argument's type and integer/alignment specialization, every constexpr's
    value) plus the options. Two caps (Grok's 30, Gemma 2's 50), and two windows with two sink
    counts (64 with 4, 100 with 16: different values, and ones Triton would specialize
    differently, 100 and 4 not being multiples of 16, were they ordinary int arguments; dilated
    attention's window_size windows 64 and 100), give every launch of every kernel family
    (dilated, block-sparse, ring step over dilated and
    layout masks, both decode kernels, forward and backward) the same key, computed by Triton's
    own binder for an sm90 target with no GPU (JITFunction.run replaced by a recorder). With the
    cap, window and sink count as constexpr values (before issue 31) the keys differed."""
    a, b = cache_keys[first], cache_keys[second]
    assert {c: [k[0] for k in v] for c, v in a.items()} == {c: [k[0] for k in v] for c, v in b.items()}
    assert sum(len(v) for v in a.values()) >= 12   # every family launched its kernels
    diff = _differences(a, b)
    assert not diff, "\n".join(diff)


def test_feature_sets_still_compile_apart(cache_keys):
    """The other side: with and without the cap, and with and without a window, the keys differ
    (each feature set is its own compile, the uncapped and unwindowed kernels unchanged)."""
    assert _differences(cache_keys["uncapped"], cache_keys["cap30"])
    assert _differences(cache_keys["uncapped"], cache_keys["window64"])
