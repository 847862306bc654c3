"""triton_dilated: Triton kernels for long-context sparse attention (dilated, block-sparse, ring)."""
from . import layouts
from .modules import BlockSparseAttention, DilatedAttention, MultiheadDilatedAttention
from .ops.block_sparse.layout import BlockLayout
from .ops.block_sparse.naive import block_sparse_attention_naive
from .ops.block_sparse.parallel import block_sparse_attention
from .ops.custom_ops import block_sparse_attention_op, dilated_attention_op
from .ops.dilated.naive import dilated_attention_naive
from .ops.dilated.parallel import dilated_attention
from .ops.ring.ring import ring_attention
from .ops.ring.shard import shard, unshard

__all__ = ["dilated_attention", "dilated_attention_naive", "block_sparse_attention", "block_sparse_attention_naive",
           "BlockLayout", "layouts", "ring_attention", "shard", "unshard", "DilatedAttention",
           "MultiheadDilatedAttention", "BlockSparseAttention", "dilated_attention_op", "block_sparse_attention_op"]
__version__ = "0.1.0"
