"""Block-sparse attention: interface (public function, autograd, custom ops), kernels
(Triton), portable (PyTorch), naive (float64 oracle), layout (BlockLayout) and builders."""
from .serve import block_sparse_attention_with_kvcache
from .interface import block_sparse_attention, block_sparse_attention_op
from .layout import BlockLayout
from .naive import block_sparse_attention_naive

__all__ = ["block_sparse_attention", "block_sparse_attention_op", "block_sparse_attention_with_kvcache", "block_sparse_attention_naive", "BlockLayout"]
