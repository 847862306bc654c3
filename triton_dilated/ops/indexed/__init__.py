"""Indexed (token-level top-k) sparse attention, DeepSeek Sparse Attention's attention: interface
(public function, autograd), serve (the KV-cache door), kernels (Triton), portable (PyTorch),
naive (float64 oracle), indices (what the indices mean) and indexer (DeepSeek's lightning
indexer, which picks the indices)."""
from .indexer import indexer_topk
from .interface import indexed_attention
from .naive import indexed_attention_naive
from .serve import indexed_attention_with_kvcache

__all__ = ["indexed_attention", "indexed_attention_naive", "indexer_topk",
           "indexed_attention_with_kvcache"]
