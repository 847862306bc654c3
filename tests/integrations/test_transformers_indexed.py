"""transformers' DeepseekV32 (DeepSeek Sparse Attention) with attn_implementation="triton_indexed":
a tiny random model in float32 runs the indexer's indices through indexed_attention; logits
(with and without left padding), a training step's gradients and greedy generation equal the
eager implementation, which folds the same indices into a dense mask."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV32ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV32", allow_module_level=True)

from transformers import DeepseekV32Config, DeepseekV32ForCausalLM  # noqa: E402

from triton_dilated.integrations import transformers as td_hf  # noqa: E402

CONFIG = dict(vocab_size=97, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=32,
              q_lora_rank=32, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, n_group=1, topk_group=1,
              num_experts_per_tok=2, max_position_embeddings=64, index_topk=5, index_head_dim=32, index_n_heads=2,
              first_k_dense_replace=1, head_dim=16, pad_token_id=0)


def models(backend="auto"):
    """(eager, ours): the same random weights (Dqk 32, Dv 16, top-5 of up to 16 keys)."""
    torch.manual_seed(0)
    eager = DeepseekV32ForCausalLM(DeepseekV32Config(**CONFIG, attn_implementation="eager")).float().eval()
    ours = DeepseekV32ForCausalLM(DeepseekV32Config(**CONFIG, attn_implementation=td_hf.INDEXED)).float().eval()
    ours.config.indexed_attention = {"backend": backend}
    ours.load_state_dict(eager.state_dict())
    return eager, ours


def ids(B=2, S=12, seed=1):
    return torch.randint(1, 97, (B, S), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_logits_and_a_training_step_equal_eager(backend):
    eager, ours = models(backend)
    x = ids()
    for m in (eager, ours):
        m.train()
        m.zero_grad()
        out = m(x, labels=x)
        out.loss.backward()
        m.logits_ = out.logits.detach()
    torch.testing.assert_close(ours.logits_, eager.logits_, atol=2e-5, rtol=1e-5)
    grads = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    seen = 0
    for n, p in ours.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], atol=2e-5, rtol=1e-4, msg=n)
            seen += 1
    assert seen == len(grads) and any("q_b_proj" in n for n in grads)


def test_left_padding_folds_the_mask_into_the_indices():
    eager, ours = models()
    x = ids()
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    x[1, :4] = 0
    with torch.no_grad():
        a = eager(x, attention_mask=mask).logits
        b = ours(x, attention_mask=mask).logits
    torch.testing.assert_close(b[mask.bool()], a[mask.bool()], atol=2e-5, rtol=1e-5)


def test_greedy_generation_equals_eager():
    eager, ours = models()
    x = ids(B=1, S=9, seed=3)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        a = eager.generate(x, **kw)
        b = ours.generate(x, **kw)
    assert torch.equal(a, b), (a, b)


def test_a_model_without_indices_is_refused():
    q = torch.randn(1, 2, 4, 8)

    class Module(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="runs the indices of a DeepSeek Sparse Attention model"):
        td_hf.indexed_attention_forward(Module(), q, q, q, None)
