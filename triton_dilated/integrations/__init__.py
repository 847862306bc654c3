"""Adapters to other libraries, each behind an optional extra (DESIGN §9):

  triton_dilated.integrations.transformers   `pip install triton_dilated[hf]`: attention
      functions "triton_dilated" and "triton_block_sparse" for transformers models
      (`register()`), and `DilatedCache`, a bounded transformers `Cache`.

Importing this package imports none of them.
"""
