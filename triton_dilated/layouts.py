"""Block-layout builders: `from triton_dilated import layouts; layouts.bigbird(N, 128)`."""
from .ops.block_sparse.builders import (bigbird, causal, dilated, global_tokens, hierarchical, local, random,
                                        sliding_window, topk)

__all__ = ["local", "dilated", "global_tokens", "random", "bigbird", "hierarchical", "causal", "topk", "sliding_window"]
