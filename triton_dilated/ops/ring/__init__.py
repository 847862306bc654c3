"""Sequence parallelism. Ring attention: interface (ring_attention), schedules (p2p,
allgather), comm (RingComm, Transfer), the ring-local-block step (step_kernels: Triton;
step_portable: PyTorch; mask: what a step computes; documents: packed documents and
document_balance). Ulysses (ulysses_attention: heads over ranks, two all-to-alls).
sequence_parallel_attention (dtensor: DTensors and DeviceMeshes in, the two above
underneath). shard/unshard."""
from .documents import DocumentBalance, document_balance
from .dtensor import sequence_parallel_attention
from .interface import ring_attention
from .shard import shard, unshard
from .ulysses import ulysses_attention

__all__ = ["ring_attention", "ulysses_attention", "sequence_parallel_attention", "shard", "unshard",
           "document_balance", "DocumentBalance"]
