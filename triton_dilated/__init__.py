"""triton_dilated: Triton kernels for long-context sparse attention."""
from . import layouts
from .ops.block_sparse.layout import BlockLayout
from .ops.block_sparse.naive import block_sparse_attention_naive
from .ops.block_sparse.parallel import block_sparse_attention
from .ops.dilated.naive import dilated_attention_naive
from .ops.dilated.parallel import dilated_attention

__all__ = ["dilated_attention", "dilated_attention_naive", "block_sparse_attention", "block_sparse_attention_naive",
           "BlockLayout", "layouts"]
__version__ = "0.1.0"
from .ops.ring.ring import ring_attention
from .ops.ring.shard import shard, unshard

__all__ += ["ring_attention", "shard", "unshard"]
from .modules import BlockSparseAttention, DilatedAttention, MultiheadDilatedAttention
from .ops.custom_ops import block_sparse_attention_op, dilated_attention_op

__all__ += ["DilatedAttention", "MultiheadDilatedAttention", "BlockSparseAttention", "dilated_attention_op",
            "block_sparse_attention_op"]
