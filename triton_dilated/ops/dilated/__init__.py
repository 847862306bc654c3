"""Dilated attention (LongNet): interface (public function, autograd, custom ops), kernels
(Triton), portable (PyTorch), naive (float64 oracle), patterns and plan (host side)."""
from .cache import DilatedKVCache
from .serve import dilated_attention_with_kvcache
from .interface import dilated_attention, dilated_attention_op
from .paged_cache import PagedDilatedKVCache
from .naive import dilated_attention_naive, dilated_multiplicity

__all__ = ["DilatedKVCache", "PagedDilatedKVCache", "dilated_attention", "dilated_attention_op", "dilated_attention_with_kvcache", "dilated_attention_naive", "dilated_multiplicity"]
