"""triton_dilated: Triton kernels for long-context sparse attention."""
from .ops.dilated.naive import dilated_attention_naive
from .ops.dilated.parallel import dilated_attention

__all__ = ["dilated_attention", "dilated_attention_naive"]
__version__ = "0.1.0"
