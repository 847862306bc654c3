"""Indexed (token-level top-k) sparse attention, DeepSeek Sparse Attention's attention: interface
(public function, autograd), kernels (Triton), portable (PyTorch), naive (float64 oracle) and
indices (what the indices mean); indexer (DeepSeek's lightning indexer: the top-k indices)."""
from .indexer import indexer_topk
from .interface import indexed_attention
from .naive import indexed_attention_naive

__all__ = ["indexed_attention", "indexed_attention_naive", "indexer_topk"]
