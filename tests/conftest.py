"""Test set-up: Triton's interpreter on before anything imports triton, hypothesis profiles.

On a machine with a CUDA GPU, set TRITON_DILATED_TEST_DEVICE=cuda to run the same tests
with compiled kernels (perf/gpu_check.sh does); the interpreter is then left off.
"""
import os

DEVICE = os.environ.get("TRITON_DILATED_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when kernels are decorated: set it first

import importlib  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

# The package loads its kernel files at the first Triton call, and triton fixes interpreted
# or compiled when a kernel is defined. Define them all now, under the setting above, so a
# test that sets TRITON_INTERPRET=0 for a while cannot decide it for the tests after it.
for _module in ("ops.common.kernels", "ops.common.decode_kernels", "ops.dilated.kernels",
                "ops.dilated.decode_kernels", "ops.block_sparse.kernels", "ops.block_sparse.decode_kernels",
                "ops.ring.step_kernels", "ops.indexed.kernels"):
    try:
        importlib.import_module("triton_dilated." + _module)
    except ImportError:      # no triton: the portable backend's tests still run
        break

# ci: derandomized (a failure reproduces exactly), no shrinking (the interpreter makes
# each example cost seconds; the failing example is printed as generated).
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=20, print_blob=True,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate],
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def device():
    return torch.device(DEVICE)


# The oldest triton whose interpreter runs the kernels (docs/DESIGN.md; older ones fail inside
# it, e.g. 3.6's "only 0-dimensional arrays can be converted to Python scalars").
INTERPRETER_MIN_TRITON = (3, 7)


def triton_version():
    """(major, minor) of the installed triton, or None without one (or an unreadable version)."""
    try:
        import triton
    except ImportError:
        return None
    match = re.match(r"(\d+)\.(\d+)", getattr(triton, "__version__", ""))
    return (int(match[1]), int(match[2])) if match else None


# The quick subset (`./dev quick`, `pytest -m quick`): each variant's float64-oracle test once, on the
# Triton kernels (the interpreter here) and the portable path, chosen for time (under 5 minutes on the
# 2-core machine; README: Tests). tests/repo/test_dev.py checks that every id still names a test.
QUICK = (
    # dilated attention (training door): a ragged tail with dilation on the kernels, the scaled-down
    # LongNet schedule in float16 on the portable path
    "tests/ops/dilated/test_dilated.py::test_matches_oracle_examples[triton-ragged-tail-dilated-fp32-causal]",
    "tests/ops/dilated/test_dilated.py::test_matches_oracle_examples[torch-longnet-schedule-scaled-down-fp16-causal]",
    # block-sparse: random per-head layouts, ragged N, GQA, empty rows, both backends (hypothesis)
    "tests/ops/block_sparse/test_block_sparse.py::test_matches_oracle",
    # ring step: the step kernel alone (dilated mask, causal) against the oracle, no processes
    "tests/ops/ring/test_ring.py::test_step_kernel_alone_against_oracle[True-1]",
    # decode (serve path, portable): one query row against the definition, both variants (hypothesis)
    "tests/serve/test_decode.py::test_dilated_decode_matches_the_definition[torch]",
    "tests/serve/test_decode.py::test_block_sparse_decode_matches_the_definition[torch]",
    # with_kvcache (the serve doors): a one-token append, the decode kernels, both variants
    "tests/serve/test_with_kvcache.py::test_with_kvcache_matches_the_oracle[1-dilated-triton]",
    "tests/serve/test_with_kvcache.py::test_with_kvcache_matches_the_oracle[1-block_sparse-triton]",
    # indexed (token-level top-k): random indices, GQA, Dv != Dqk, causal, sinks, softcap, both backends
    "tests/ops/indexed/test_indexed.py::test_matches_oracle[triton]",
    "tests/ops/indexed/test_indexed.py::test_matches_oracle[torch]",
)


@pytest.hookimpl(tryfirst=True)     # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    quick = set(QUICK)
    for item in items:
        if item.nodeid in quick:
            item.add_marker(pytest.mark.quick)
    # gloo: the spawned ranks run the kernels in Triton's interpreter on the CPU, whatever
    # the suite's device (ring_worker and ring_faults_worker set TRITON_INTERPRET=1 there)
    version = triton_version()
    if version is not None and version < INTERPRETER_MIN_TRITON:
        skip_gloo = pytest.mark.skip(
            reason=f"spawns gloo processes that run the kernels in Triton's interpreter, which needs triton >= "
                   f"{'.'.join(map(str, INTERPRETER_MIN_TRITON))} (installed: {'.'.join(map(str, version))})")
        for item in items:
            if item.get_closest_marker("gloo") is not None:
                item.add_marker(skip_gloo)
    if torch.cuda.is_available() and DEVICE == "cuda":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (compiled Triton kernels); run perf/gpu_check.sh there")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def capture_cuda_graph(step):
    """Run `step()` once on a side stream (compiles the kernels, builds cached tables), then
    capture it in a CUDA graph: (graph, the captured call's result)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured
