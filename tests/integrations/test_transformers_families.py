"""transformers integration, issue 23 item 4: the attention of gpt-oss (learned sinks s_aux,
alternating sliding / full layers), Gemma 2 (logit soft-capping, interleaved sliding layers)
and Mistral (sliding window on every layer), on tiny random models from transformers' own
config classes (no download). Sliding layers run block-sparse attention on
layouts.sliding_window, full layers dilated attention (one pattern covering the sequence:
dense causal) or the block-sparse "causal" layout; so the models equal transformers' eager
implementation. Checked, float32 (the tolerance rule against the eager model in float64: factor
2 on logits, 3 on gradients, floor 1e-5): logits, greedy generate() tokens (DynamicCache,
whose sliding layers keep only the last window - 1 rows), a training step's gradients of every
parameter (the sink logits included); one Triton-interpreter check; the mask functions'
refusals."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, Gemma2Config, GptOssConfig, MistralConfig  # noqa: E402
from transformers.masking_utils import (and_masks, causal_mask_function, chunked_overlay,  # noqa: E402
                                        sliding_window_causal_mask_function)

from triton_dilated.integrations import transformers as td_hf  # noqa: E402
from tests.helpers.reference import FLOOR, assert_rule  # noqa: E402
from tests.helpers.transformers_checks import check_left_padding, dense_settings  # noqa: E402

VOCAB, WINDOW = 64, 8
KINDS = ["gpt_oss", "gemma2", "mistral"]
IMPLS = {"triton_dilated": "dilated_attention", "triton_block_sparse": "block_sparse_attention"}


@pytest.fixture(autouse=True)
def _setup():
    td_hf.register()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _config(kind, impl=None, backend="torch"):
    """A 2-layer model of the family: hidden 32, 4 query heads of 8, 2 key/value heads, window 8;
    with impl, the pattern dict of our attention (covering every sequence up to 128 tokens)."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0,
                  attention_dropout=0.0, sliding_window=WINDOW)
    if kind == "gpt_oss":
        cfg = GptOssConfig(**common, num_local_experts=2, num_experts_per_tok=1, experts_implementation="eager",
                           layer_types=["sliding_attention", "full_attention"])
    elif kind == "gemma2":
        cfg = Gemma2Config(**common, query_pre_attn_scalar=8, attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
                           layer_types=["sliding_attention", "full_attention"])
    else:
        cfg = MistralConfig(**common)
    return dense_settings(cfg, impl, backend, 128)


def _models(kind, impl, backend="torch"):
    """(ours, eager float32, eager float64) with the same random weights; gpt-oss's sink logits
    drawn N(0, 1) (transformers leaves them uninitialised)."""
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(_config(kind, impl, backend), attn_implementation=impl).eval()
    if kind == "gpt_oss":
        with torch.no_grad():
            for layer in ours.model.layers:
                layer.self_attn.sinks.normal_()
    eager = AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager").eval()
    eager.load_state_dict(ours.state_dict())
    eager64 = AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager").eval()
    eager64.load_state_dict(ours.state_dict())
    return ours, eager, eager64.double()


def _ids(shape, seed=1):
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_eager(kind, impl):
    """40 tokens (5 windows): the logits of the eager implementation, by the tolerance rule
    against the eager model in float64."""
    ours, eager, eager64 = _models(kind, impl)
    ids = _ids((2, 40))
    with torch.no_grad():
        got, same, oracle = ours(ids).logits, eager(ids).logits, eager64(ids).logits
    assert_rule(f"{kind} {impl} logits", got.double(), oracle, same.double(), factor=2, floor=FLOOR[torch.float32])


@pytest.mark.parametrize("kind", KINDS)
def test_generate_gives_the_eager_tokens(kind):
    """Greedy generate() of 24 tokens after 8 (past three windows; transformers' DynamicCache,
    whose sliding layers then hold only the last window - 1 rows): the eager model's tokens and
    step logits."""
    ours, eager, _ = _models(kind, "triton_dilated")
    ids = _ids((2, 8), seed=2)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24, do_sample=False,
              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    got, want = ours.generate(ids, **kw), eager.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_training_step_gradients_equal_eager(kind):
    """A training step (next-token cross-entropy, 32 tokens): every parameter's gradient, the
    sink logits' included, by the tolerance rule against the eager model in float64."""
    ours, eager, eager64 = _models(kind, "triton_dilated")
    ids = _ids((2, 32), seed=3)
    grads = []
    for model in (ours, eager, eager64):
        model.train()
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[2].keys()
    sinks = [name for name in grads[0] if name.endswith("self_attn.sinks")]
    assert len(sinks) == (2 if kind == "gpt_oss" else 0)
    for name in grads[0]:
        assert_rule(f"{kind} d{name}", grads[0][name].double(), grads[2][name], grads[1][name].double(), factor=3,
                    floor=FLOOR[torch.float32])
    for name in sinks:
        assert grads[2][name].abs().min() > 0


@pytest.mark.parametrize("kind", ["gpt_oss", "gemma2"])
def test_triton_interpreter(kind):
    """The Triton kernels (interpreter): the window layout's block-sparse kernels on the sliding
    layer, the dilated kernels on the full one, with gpt-oss's sinks or Gemma 2's cap; logits
    and the gradients of the attention parameters (sinks included) against eager float64."""
    ours, eager, eager64 = _models(kind, "triton_dilated", backend="triton")
    ids = _ids((1, 24), seed=4)
    outs = []
    for model in (ours, eager, eager64):
        model.zero_grad()
        logits = model(ids).logits
        (logits.double() * torch.linspace(-1, 1, VOCAB, dtype=torch.float64)).sum().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if "self_attn" in n}))
    assert_rule(f"{kind} logits", outs[0][0].double(), outs[2][0], outs[1][0].double(), factor=2,
                floor=FLOOR[torch.float32])
    for name, g in outs[0][1].items():
        assert_rule(f"{kind} d{name}", g.double(), outs[2][1][name], outs[1][1][name].double(), factor=3,
                    floor=FLOOR[torch.float32])


def test_left_padding_equals_each_row_alone():
    """gpt-oss, a left-padded batch (prompts of 9 and 5 tokens): logits at the real positions and
    greedy tokens (DynamicCache: its sliding layer drops rows, the padding among them, past the
    window) equal those of each prompt alone."""
    ours, _, _ = _models("gpt_oss", "triton_dilated")
    check_left_padding(ours, _ids((1, 9), seed=5), _ids((1, 5), seed=6), 12)


def test_mask_functions_take_sliding_windows_and_refuse_other_overlays():
    """transformers' sliding-window causal mask is recognised (also past the window, where the
    cache dropped rows: kv_offset > 0), on both implementations; other mask functions (chunked
    attention, a wrong window) and a static cache on sliding layers are refused."""
    for fn in (td_hf.dilated_attention_mask, td_hf.block_sparse_attention_mask):
        assert fn(2, 1, WINDOW, q_offset=20, kv_offset=13, mask_function=sliding_window_causal_mask_function(WINDOW),
                  local_size=WINDOW) is None
        for mask_function, local in ((and_masks(causal_mask_function, chunked_overlay(4, torch.zeros(2, dtype=torch.long))),
                                      4),
                                     (sliding_window_causal_mask_function(WINDOW), WINDOW + 1),
                                     (sliding_window_causal_mask_function(WINDOW), None)):
            with pytest.raises(ValueError, match="applies the causal mask"):
                fn(2, 4, 4, mask_function=mask_function, local_size=local)
        with pytest.raises(ValueError, match="static cache"):
            fn(2, 1, 16, q_offset=torch.tensor(3), mask_function=sliding_window_causal_mask_function(WINDOW),
               local_size=WINDOW)
