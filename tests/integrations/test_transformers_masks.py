"""transformers integration, issue 33 item 3: padded batches beyond left padding. Right padding
(transformers' model tester's `torch.tril(ones)` masks, and its `test_eager_matches_sdpa_inference`
padded rows), left padding, both in one batch, and 4-d masks equal to the causal (or sliding-
window causal) mask with key padding, against transformers' eager attention on tiny random
Llama, Mistral (sliding window on every layer) and Gemma 2 (soft-capping, interleaved sliding
layers) models, float32. Full layers run one dilated pattern covering the sequence (dense
causal) or the block-sparse "causal" layout, sliding layers the window layout, so the models
equal eager; checked by the tolerance rule against the eager model in float64 (factor 2 on
logits, 3 on gradients, floor 1e-5) at the real tokens (transformers' test compares those only:
what a query on padding gets is not part of either model's contract; ours gives 0 there).
Also: a real dilated schedule (right padding equals each prompt alone), a training step's
gradients, one Triton-interpreter run, no host read per layer, and the refusals."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AttentionInterface, AutoModelForCausalLM  # noqa: E402
from transformers.masking_utils import (AttentionMaskInterface, eager_mask, sdpa_mask,  # noqa: E402
                                        sliding_window_causal_mask_function)

from triton_dilated.integrations import transformers as td_hf  # noqa: E402
from tests.helpers.reference import FLOOR, assert_rule  # noqa: E402
from tests.helpers.transformers_checks import dense_settings  # noqa: E402

VOCAB, WINDOW, N = 64, 8, 20
IMPLS = ("triton_dilated", "triton_block_sparse")
ORACLE = "td_test_eager_f64"


def _eager_f64(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """transformers' eager attention (Gemma 2's: with soft-capping) with the softmax in the
    inputs' dtype: eager's softmax runs in float32, where the float64 mask's min is -inf and a
    row with every key masked (a query on left padding) gives NaN, which then reaches the real
    tokens through the masked keys (NaN + min). The float64 oracle model runs this."""
    groups = query.shape[1] // key.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (key, value))
    scores = query @ k.transpose(2, 3) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[..., :k.shape[2]]
    return (scores.softmax(dim=-1) @ v).transpose(1, 2).contiguous(), None


@pytest.fixture(autouse=True)
def _setup():
    td_hf.register()
    AttentionInterface.register(ORACLE, _eager_f64)
    AttentionMaskInterface.register(ORACLE, eager_mask)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _config(kind, impl=None, backend="torch"):
    """A 2-layer model of the family (hidden 32, 4 query heads of 8, 2 key/value heads, window 8
    where the family has one); with impl, our pattern dict covering every sequence up to 64
    tokens (dense causal). Skips where the installed transformers lacks the family."""
    name = {"llama": "LlamaConfig", "mistral": "MistralConfig", "gemma2": "Gemma2Config"}[kind]
    config_class = getattr(transformers, name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0,
                  attention_dropout=0.0)
    if kind == "mistral":
        cfg = config_class(**common, sliding_window=WINDOW)
    elif kind == "gemma2":
        cfg = config_class(**common, sliding_window=WINDOW, query_pre_attn_scalar=8, attn_logit_softcapping=2.0,
                           final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"])
    else:
        cfg = config_class(**common)
    return dense_settings(cfg, impl, backend, 64)


def _models(kind, impl, backend="torch"):
    """(ours, eager float32, the float64 oracle: eager with its softmax in float64) with the
    same random weights (each its own config: from_config writes the implementation into the
    config it gets)."""
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(_config(kind, impl, backend), attn_implementation=impl).eval()
    assert ours.config._attn_implementation == impl
    eager = AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager").eval()
    eager.load_state_dict(ours.state_dict())
    oracle = AutoModelForCausalLM.from_config(_config(kind), attn_implementation=ORACLE).eval()
    oracle.load_state_dict(ours.state_dict())
    return ours, eager, oracle.double()


def _ids(shape, seed=1):
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _masks(batch=3, n=N):
    """{name: 2-d mask}: transformers' test_eager_matches_sdpa_inference pads the last row of a
    batch, zeroing its last 4 tokens (its padding_side="left" case: right padding, in fact) or
    its first 3 (its "right" case: left padding); one batch with an unpadded row, a right-
    and a left-padded one; the model tester's torch.tril(ones) mask (row b: b + 1 tokens, then
    padding)."""
    masks = {}
    for name, cut in (("right", (slice(-4, None))), ("left", slice(None, 3))):
        m = torch.ones(batch, n, dtype=torch.long)
        m[-1, cut] = 0
        masks[name] = m
    m = torch.ones(batch, n, dtype=torch.long)
    m[1, -5:] = 0
    m[2, :6] = 0
    masks["mixed"] = m
    masks["tril"] = torch.tril(torch.ones(n, n, dtype=torch.long))[[0, 3, 9, n - 1]]
    return masks


def _logits(models, ids, mask):
    with torch.no_grad():
        return [m(ids, attention_mask=mask).logits for m in models]


def _check_real_tokens(what, got, same, oracle, mask):
    real = mask.bool()
    assert_rule(what, got[real].double(), oracle[real], same[real].double(), factor=2, floor=FLOOR[torch.float32])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_padded_batches_give_the_eager_logits(kind, impl):
    """The eager-vs-implementation pattern of transformers' test_eager_matches_sdpa_inference:
    logits at the real tokens equal eager's for right-, left- and mixed-padded batches (an
    unpadded row in each) and the tril mask, by the rule against eager in float64."""
    ours, eager, eager64 = _models(kind, impl)
    for name, mask in _masks().items():
        ids = _ids(tuple(mask.shape), seed=len(name))
        got, same, oracle = _logits((ours, eager, eager64), ids, mask)
        _check_real_tokens(f"{kind} {impl} {name}", got, same, oracle, mask)
        if name == "mixed":   # the unpadded row in full, and the padded rows differ from it (not vacuous)
            torch.testing.assert_close(got[0], same[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_4d_padding_masks_give_the_eager_logits(kind):
    """A caller-made 4-d mask (transformers passes it through unchanged): the causal (Mistral:
    sliding-window causal) mask intersected with key padding, boolean or additive, gives the
    logits of eager fed the same mask, and of our model fed the 2-d mask."""
    ours, eager, eager64 = _models(kind, "triton_dilated")
    mask = _masks()["mixed"]
    ids = _ids(tuple(mask.shape), seed=7)
    fn = {"mistral": sliding_window_causal_mask_function(WINDOW)}.get(kind)
    kw = {"mask_function": fn, "local_size": WINDOW} if fn is not None else {}
    m4 = sdpa_mask(batch_size=3, q_length=N, kv_length=N, attention_mask=mask.bool(), allow_is_causal_skip=False,
                   **kw)
    assert m4.shape == (3, 1, N, N) and m4.dtype == torch.bool
    additive = torch.where(m4, 0.0, torch.finfo(torch.float32).min)
    (from_2d,) = _logits((ours,), ids, mask)
    with torch.no_grad():   # eager adds its mask to the scores: the additive form
        same, oracle = eager(ids, attention_mask=additive).logits, eager64(ids, attention_mask=additive.double()).logits
    for what, m in (("bool", m4), ("additive", additive), ("additive -inf", additive.masked_fill(~m4, -float("inf")))):
        (got,) = _logits((ours,), ids, m)
        _check_real_tokens(f"{kind} 4-d {what}", got, same, oracle, mask)
        torch.testing.assert_close(got, from_2d, rtol=0, atol=0)


def test_right_padding_with_a_dilated_schedule_equals_each_prompt_alone():
    """A real dilated schedule (not dense): a batch of prompts of 13, 8 and 5 tokens, right-
    padded, gives at each row's real tokens the logits of that prompt alone; a 4-d mask of the
    same padding gives the same logits; the padded query rows give 0 at the attention function."""
    cfg = _config("llama")
    cfg.dilated_attention = {"segment_lengths": [4, 8], "dilation_rates": [1, 2], "backend": "torch"}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="triton_dilated").eval()
    lengths = (13, 8, 5)
    ids = _ids((3, 13), seed=8)
    mask = (torch.arange(13)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        m4 = sdpa_mask(batch_size=3, q_length=13, kv_length=13, attention_mask=mask.bool(), allow_is_causal_skip=False)
        torch.testing.assert_close(model(ids, attention_mask=m4).logits, batch, rtol=0, atol=0)
        for b, n in enumerate(lengths):
            torch.testing.assert_close(batch[b, :n], model(ids[b:b + 1, :n]).logits[0], rtol=1e-5, atol=1e-5)
    module = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 13, 8, generator=gen)
    k, v = (torch.randn(3, 2, 13, 8, generator=gen) for _ in range(2))
    out, _ = td_hf.dilated_attention_forward(module, q, k, v, mask.bool())
    assert (out[~mask.bool()] == 0).all() and (out[mask.bool()].abs().sum(-1) > 0).all()


def test_training_step_gradients_with_padding_equal_eager():
    """Gemma 2 (soft-capping, a sliding and a full layer), a mixed-padded batch, loss on the
    real tokens (labels -100 on padding and after it): every parameter's gradient by the rule
    against eager in float64 (factor 3)."""
    ours, eager, eager64 = _models("gemma2", "triton_dilated")
    mask = _masks()["mixed"]
    ids = _ids(tuple(mask.shape), seed=9)
    # the loss on real tokens predicted from real tokens: the label of a row's first token after
    # left padding is predicted from a padding position, whose attention output is eager's mean of
    # the values (every key masked) and our 0: neither model's contract
    seen = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)
    labels = ids.masked_fill((mask == 0) | (seen == 0), -100)
    grads = []
    for model in (ours, eager, eager64):
        model.train()
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[2].keys() and any("q_proj" in n for n in grads[0])
    for name in grads[0]:
        assert_rule(f"d{name}", grads[0][name].double(), grads[2][name], grads[1][name].double(), factor=3,
                    floor=FLOOR[torch.float32])


@pytest.mark.parametrize("impl", IMPLS)
def test_triton_interpreter_with_padding(impl):
    """The Triton kernels (interpreter): Llama, a right- and a left-padded row, 16 tokens."""
    ours, eager, eager64 = _models("llama", impl, backend="triton")
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, -5:] = 0
    mask[1, :3] = 0
    ids = _ids((2, 16), seed=10)
    got, same, oracle = _logits((ours, eager, eager64), ids, mask)
    _check_real_tokens(f"triton {impl}", got, same, oracle, mask)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_masks_make_no_host_sync_per_layer(backend):
    """The mask function reads a right-padded mask once per forward and tags it; a 4-d mask is
    read at the first layer and its padding kept on the tensor: the attention functions then
    read nothing on the host."""
    from tests.helpers.serve_checks import no_host_sync

    cfg = _config("llama", "triton_dilated", backend)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="triton_dilated")
    module = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 4, 8, generator=gen)
    k, v = (torch.randn(2, 2, 12, 8, generator=gen) for _ in range(2))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, -3:] = 0
    mask[1, :2] = 0
    tagged = td_hf.dilated_attention_mask(2, q_length=4, kv_length=12, attention_mask=mask)
    want, _ = td_hf.dilated_attention_forward(module, q, k, v, mask)   # untagged: derived per call
    with torch.no_grad(), no_host_sync():
        got, _ = td_hf.dilated_attention_forward(module, q, k, v, tagged)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    m4 = sdpa_mask(batch_size=2, q_length=4, kv_length=12, q_offset=8, attention_mask=mask, allow_is_causal_skip=False)
    with torch.no_grad():
        first, _ = td_hf.dilated_attention_forward(module, q, k, v, m4)
        with no_host_sync():
            again, _ = td_hf.dilated_attention_forward(module, q, k, v, m4)
    torch.testing.assert_close(first, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_masks_the_kernels_cannot_express_are_refused():
    """A gap inside a row's tokens (generate() after right padding), 4-d masks other than
    causal with padding (random, per-head, additive biases, a full-causal mask on a sliding
    layer), a non-float non-bool 4-d mask: clear errors naming what was passed."""
    ours, _, _ = _models("llama", "triton_dilated")
    ids = _ids((2, 12), seed=11)
    gap = torch.ones(2, 12, dtype=torch.long)
    gap[1, 4:6] = 0
    with pytest.raises(ValueError, match=r"one contiguous run per row.*row 1 .*\[1, 1, 1, 1, 0, 0, 1"):
        ours(ids, attention_mask=gap)
    right = torch.ones(2, 12, dtype=torch.long)
    right[1, -3:] = 0         # the prefill runs; the first decode step's mask has the padding inside the row
    with pytest.raises(ValueError, match=r"one contiguous run per row.*generate\(\) after right padding"):
        ours.generate(ids, attention_mask=right, max_new_tokens=2, do_sample=False, pad_token_id=0)
    causal = sdpa_mask(batch_size=2, q_length=12, kv_length=12, allow_is_causal_skip=False)
    rand = torch.rand(2, 1, 12, 12, generator=torch.Generator().manual_seed(0)) > 0.5
    with pytest.raises(ValueError, match=r"causal mask of the last 12 positions.*\(2, 1, 12, 12\) torch.bool"):
        ours(ids, attention_mask=rand | causal)
    heads = causal.expand(2, 4, 12, 12).clone()
    heads[:, 1, 5, 0] = False
    with pytest.raises(ValueError, match="differs between heads"):
        ours(ids, attention_mask=heads)
    bias = torch.where(causal, 0.0, -torch.inf)
    bias[..., 0] += 0.5                       # an ALiBi-like bias on key 0
    with pytest.raises(ValueError, match="other values \\(a bias\\)"):
        ours(ids, attention_mask=bias)
    with pytest.raises(TypeError, match="boolean or floating.*torch.int64"):
        ours(ids, attention_mask=causal.long())
    with pytest.raises(ValueError, match=r"shape \(B\|1, 1\|heads, q_len, kv_len\)"):
        ours(ids, attention_mask=causal[:, :, :6])
    gemma, _, _ = _models("gemma2", "triton_dilated")
    ids = _ids((1, 16), seed=12)     # past the window of 8: the plain causal mask drops the sliding layer's window
    with pytest.raises(ValueError, match=r"sliding-window causal mask \(8 keys\)"):
        gemma(ids, attention_mask=sdpa_mask(batch_size=1, q_length=16, kv_length=16, allow_is_causal_skip=False))
