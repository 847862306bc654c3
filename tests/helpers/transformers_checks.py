"""The transformers tests' shared checks (tests/integrations/): greedy generation and a
left-padded batch against each of its prompts alone. transformers is not imported here: the
test modules skip where it is missing."""
from __future__ import annotations

import torch


def generate(model, ids, n, **kw):
    """Greedy generate() of exactly n new tokens (every position attended)."""
    kw = {"max_new_tokens": n, "min_new_tokens": n, **kw}
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **kw)


def check_left_padding(model, a, b, new_tokens):
    """Prompts a and b (1, n) in one batch, b left-padded to a's length: the logits at the real
    positions and the greedy tokens (DynamicCache) equal those of each prompt alone. Returns
    (ids, mask, generate kwargs) of the batch."""
    pad = a.shape[1] - b.shape[1]
    ids = torch.cat([a, torch.cat([torch.zeros(1, pad, dtype=torch.long), b], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(batch[0], model(a).logits[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch[1, pad:], model(b).logits[0], rtol=1e-5, atol=1e-5)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(out[0], generate(model, a, new_tokens)[0])
    assert torch.equal(out[1, pad:], generate(model, b, new_tokens)[0])
    return ids, mask, kw


def dense_settings(cfg, impl, backend, n):
    """cfg with our implementation `impl` set to dense attention over n positions (dilated: one
    segment of n at rate 1; block-sparse: the causal layout), 16-row blocks for the sliding
    layers' windows: its logits then equal eager's."""
    if impl == "triton_dilated":
        cfg.dilated_attention = {"segment_lengths": [n], "dilation_rates": [1], "backend": backend,
                                 "window_block_size": 16}
    elif impl == "triton_block_sparse":
        cfg.block_sparse_attention = {"builder": "causal", "block_size": 16, "backend": backend,
                                      "window_block_size": 16}
    return cfg
