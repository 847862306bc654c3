"""triton_dilated: Triton kernels for long-context sparse attention (dilated, block-sparse, ring,
indexed).

Imports without triton (the portable PyTorch backend then serves every call)."""
from . import layouts
from .modules import BlockSparseAttention, DilatedAttention, MultiheadDilatedAttention
from .ops.block_sparse import (BlockLayout, block_sparse_attention, block_sparse_attention_naive,
                               block_sparse_attention_op, block_sparse_attention_with_kvcache)
from .ops.dilated import (DilatedKVCache, PagedDilatedKVCache, dilated_attention, dilated_attention_naive,
                          dilated_attention_op, dilated_attention_with_kvcache)
from .ops.indexed import (indexed_attention, indexed_attention_naive, indexed_attention_with_kvcache,
                          indexer_topk)
from .ops.ring import document_balance, ring_attention, sequence_parallel_attention, shard, ulysses_attention, unshard

__all__ = ["dilated_attention", "dilated_attention_naive", "block_sparse_attention", "block_sparse_attention_naive",
           "BlockLayout", "layouts", "ring_attention", "ulysses_attention", "sequence_parallel_attention", "shard",
           "unshard", "document_balance", "DilatedAttention",
           "MultiheadDilatedAttention", "BlockSparseAttention", "dilated_attention_op", "block_sparse_attention_op",
           "DilatedKVCache", "PagedDilatedKVCache", "dilated_attention_with_kvcache", "block_sparse_attention_with_kvcache",
           "indexed_attention", "indexed_attention_naive", "indexer_topk", "indexed_attention_with_kvcache"]
__version__ = "0.1.0"
