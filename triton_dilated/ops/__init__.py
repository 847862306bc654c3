"""The variants (one folder each) and their specs, which the tools (perf aot, tune, bench)
read instead of tables of their own."""
from .block_sparse.spec import SPEC as BLOCK_SPARSE_SPEC
from .dilated.spec import SPEC as DILATED_SPEC
from .indexed.spec import SPEC as INDEXED_SPEC
from .ring.spec import SPEC as RING_STEP_SPEC

SPECS = (DILATED_SPEC, BLOCK_SPARSE_SPEC, RING_STEP_SPEC, INDEXED_SPEC)


def kernel_specs():
    """{kernel name: KernelSpec} over every variant, in spec order."""
    return {k.name: k for spec in SPECS for k in spec.kernels}
