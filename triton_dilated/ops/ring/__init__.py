"""Ring attention: interface (ring_attention), schedules (p2p, allgather), comm (RingComm,
Transfer), the ring-local-block step (step_kernels: Triton; step_portable: PyTorch; mask:
what a step computes) and shard/unshard."""
from .interface import ring_attention
from .shard import shard, unshard

__all__ = ["ring_attention", "shard", "unshard"]
