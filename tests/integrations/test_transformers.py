"""transformers integration (triton_dilated/integrations/transformers.py, the `hf` extra): a
tiny random Llama with attn_implementation="triton_dilated" / "triton_block_sparse":
logits against sdpa (float64 oracle: the sdpa model in float64), generate() with caches
against generate(use_cache=False), the bounded DilatedCache, training gradients against the
portable path, left padding, clear errors; nothing but the integration imports transformers."""
from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from triton_dilated.integrations import transformers as td_hf  # noqa: E402
from tests.helpers.paths import ROOT  # noqa: E402
from tests.helpers.reference import FLOOR, assert_rule  # noqa: E402
from tests.helpers.transformers_checks import check_left_padding, generate as _generate  # noqa: E402

PACKAGE = ROOT / "triton_dilated"
VOCAB = 64
# the cache argument of forward()/generate(): `cache` from transformers 5.x on, `past_key_values` before
CACHE = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


@pytest.fixture(autouse=True)
def _setup():
    """register(), and one thread: tiny tensors, and OpenMP teams only spin on a shared CPU."""
    td_hf.register()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _config(**attn):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    for key, value in attn.items():
        setattr(cfg, key, value)
    return cfg


def _model(impl, seed=0, **attn):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_config(**attn), attn_implementation=impl).eval()


def _ids(shape, seed=1):
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _generate_logits(model, ids, n, **kw):
    """(tokens, logits of every step (B, n, vocab)) of a greedy generate."""
    out = _generate(model, ids, n, output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits, dim=1)


def _same_generation(got, ref):
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_single_pattern_gives_the_sdpa_logits(backend):
    """One pattern with w >= N and r = 1 is causal attention: the logits of sdpa, under the
    tolerance rule against the sdpa model in float64."""
    N = 64 if backend == "torch" else 24
    model = _model("triton_dilated", dilated_attention={"segment_lengths": [256], "dilation_rates": [1],
                                                       "backend": backend})
    assert model.config._attn_implementation == "triton_dilated"
    sdpa = _model("sdpa")
    sdpa.load_state_dict(model.state_dict())
    ids = _ids((2 if backend == "torch" else 1, N))
    with torch.no_grad():
        got = model(ids).logits
        same = sdpa(ids).logits
        oracle = sdpa.double()(ids).logits
    assert_rule("logits", got.double(), oracle, same.double(), factor=2, floor=FLOOR[torch.float32])


def test_generate_with_caches_gives_the_uncached_tokens():
    """A real dilated schedule: greedy tokens of generate(use_cache=False) (every step a full
    forward), with DynamicCache, and with the bounded DilatedCache past four times the
    longest segment; the bounded cache holds at most the longest segment per layer."""
    spec = {"segment_lengths": [4, 8, 16], "dilation_rates": [1, 2, 4], "backend": "torch"}
    model = _model("triton_dilated", dilated_attention=spec)
    ids = _ids((2, 6))
    n = 4 * 16 + 6
    ref = _generate_logits(model, ids, n, use_cache=False)
    _same_generation(_generate_logits(model, ids, n, **{CACHE: DynamicCache()}), ref)
    cache = td_hf.DilatedCache(model.config)
    _same_generation(_generate_logits(model, ids, n, **{CACHE: cache}), ref)
    assert cache.get_seq_length() == ids.shape[1] + n - 1          # the last token is never fed back
    assert all(layer.rows.length <= 16 for layer in cache.layers)
    assert cache.nbytes <= 2 * 2 * 2 * 16 * 2 * 16 * 4                # layers, k+v, B, rows, Hkv, D, float32
    # the schedule matters: a model with other patterns decodes other tokens
    other = _model("triton_dilated", dilated_attention={**spec, "segment_lengths": [256, 256, 256]})
    assert not torch.equal(_generate(other, ids, n, use_cache=False), ref[0])


def test_beam_search_and_repeated_rows_with_the_bounded_cache():
    """Beam search (reorder_cache) and num_return_sequences (batch_repeat_interleave) with
    DilatedCache give the uncached tokens."""
    model = _model("triton_dilated", dilated_attention={"segment_lengths": [4, 8, 16], "dilation_rates": [1, 2, 4],
                                                       "backend": "torch"})
    ids = _ids((2, 6))
    kw = dict(max_new_tokens=40, min_new_tokens=40, num_beams=3)
    assert torch.equal(_generate(model, ids, 0, use_cache=False, **kw),
                       _generate(model, ids, 0, **{CACHE: td_hf.DilatedCache(model.config)}, **kw))
    outs = []
    for cache in ({"use_cache": False}, {CACHE: td_hf.DilatedCache(model.config)}):
        torch.manual_seed(5)
        outs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, min_new_tokens=30,
                                   do_sample=True, top_k=5, num_return_sequences=2, pad_token_id=0, **cache))
    assert outs[0].shape == (4, 36) and torch.equal(outs[0], outs[1])


def test_generate_triton_path_with_the_bounded_cache():
    spec = {"segment_lengths": [4, 8], "dilation_rates": [1, 2], "backend": "triton"}
    model = _model("triton_dilated", dilated_attention=spec)
    ids = _ids((1, 5))
    _same_generation(_generate_logits(model, ids, 12, **{CACHE: td_hf.DilatedCache(model.config)}),
                     _generate_logits(model, ids, 12, use_cache=False))


def test_backward_matches_the_portable_path():
    """A training step (forward + backward of the LM loss) through the Triton path gives the
    portable path's loss and parameter gradients."""
    spec = {"segment_lengths": [8, 16], "dilation_rates": [1, 2]}
    grads = {}
    for backend in ("torch", "triton"):
        model = _model("triton_dilated", dilated_attention={**spec, "backend": backend}).train()
        ids = _ids((1, 24))
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads[backend] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (loss_t, g_t), (loss_p, g_p) = grads["triton"], grads["torch"]
    torch.testing.assert_close(loss_t, loss_p, rtol=1e-5, atol=1e-6)
    assert g_t.keys() == g_p.keys()
    for name in g_p:
        torch.testing.assert_close(g_t[name], g_p[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for n, g in g_p.items() if "q_proj" in n)


def test_left_padding_equals_each_row_alone():
    """A left-padded batch: logits at the real positions and greedy tokens (DynamicCache) equal
    those of each prompt alone; DilatedCache refuses padded batches."""
    spec = {"segment_lengths": [4, 8], "dilation_rates": [1, 2], "backend": "torch"}
    model = _model("triton_dilated", dilated_attention=spec)
    ids, mask, kw = check_left_padding(model, _ids((1, 9), seed=2), _ids((1, 5), seed=3), 10)
    with pytest.raises(ValueError, match="padded batch"):
        model.generate(ids, attention_mask=mask, **{CACHE: td_hf.DilatedCache(model.config)}, **kw)
    gap = torch.ones_like(ids)
    gap[1, 3:5] = 0       # right padding works (tests/integrations/test_transformers_masks.py), a gap does not
    with pytest.raises(ValueError, match="one contiguous run per row"):
        model(ids, attention_mask=gap)


def test_block_sparse():
    """"triton_block_sparse": the dense `causal` builder gives the sdpa logits; a bigbird
    layout (random blocks) decodes the same tokens with and without the cache (one layout,
    its leading blocks for every length)."""
    causal = _model("triton_block_sparse", block_sparse_attention={"builder": "causal", "block_size": 16})
    sdpa = _model("sdpa")
    sdpa.load_state_dict(causal.state_dict())
    ids = _ids((2, 40))
    with torch.no_grad():
        assert_rule("logits", causal(ids).logits.double(), sdpa.double()(ids).logits, sdpa.float()(ids).logits.double(),
                    factor=2, floor=FLOOR[torch.float32])
    bigbird = _model("triton_block_sparse", block_sparse_attention={
        "builder": "bigbird", "block_size": 16, "window": 0, "num_global_blocks": 0, "num_random": 2, "seed": 3,
        "num_heads": 4,
        "backend": "torch"})
    ids = _ids((1, 20))
    _same_generation(_generate_logits(bigbird, ids, 76), _generate_logits(bigbird, ids, 76, use_cache=False))
    with pytest.raises(ValueError, match="needs the whole sequence"):
        # a bounded cache drops rows, which a block layout on absolute positions cannot take
        bigbird.config.dilated_attention = {"segment_lengths": [16], "dilation_rates": [1]}
        _generate(bigbird, ids, 30, **{CACHE: td_hf.DilatedCache(bigbird.config)})


def test_clear_errors():
    ids = _ids((1, 8))
    with pytest.raises(ValueError, match="config.dilated_attention"):
        _model("triton_dilated")(ids)
    with pytest.raises(ValueError, match="dilation_rates"):
        _model("triton_dilated", dilated_attention={"segment_lengths": [8, 16], "dilation_rates": [1]})(ids)
    with pytest.raises(ValueError, match="takes the keys"):
        _model("triton_dilated", dilated_attention={"segment_lengths": [8], "dilation_rates": [1], "rate": 2})(ids)
    with pytest.raises(ValueError, match="topk is content-adaptive"):
        _model("triton_block_sparse", block_sparse_attention={"builder": "topk"})(ids)
    with pytest.raises(ValueError, match="takes no"):
        _model("triton_block_sparse", block_sparse_attention={"builder": "local", "block_size": 16, "wndow": 1})(ids)
    with pytest.raises(ValueError, match="longer than the block-sparse layout"):
        _model("triton_block_sparse", block_sparse_attention={"builder": "local", "block_size": 16,
                                                             "max_seq_len": 4})(ids)
    model = _model("triton_dilated", dilated_attention={"segment_lengths": [8], "dilation_rates": [1]},
                   attention_dropout=0.1).train()
    with pytest.raises(ValueError, match="no attention dropout"):
        model(ids)
    with pytest.raises(ValueError, match="exactly one"):
        td_hf.DilatedCache()


def test_importing_the_integration_registers_it():
    """A forgotten td_hf.register() does not matter once the module is imported (a fresh
    process: transformers' registry without our names)."""
    code = ("import torch\n"
            "from transformers import AutoModelForCausalLM, LlamaConfig\n"
            "import triton_dilated.integrations.transformers\n"
            "cfg = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, "
            "num_attention_heads=2, max_position_embeddings=64)\n"
            "cfg.dilated_attention = {'segment_lengths': [64], 'dilation_rates': [1]}\n"
            "for impl in ('triton_dilated', 'triton_block_sparse'):\n"
            "    cfg.block_sparse_attention = {'builder': 'local', 'block_size': 16}\n"
            "    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)\n"
            "    print(impl, tuple(model(torch.ones(1, 8, dtype=torch.long)).logits.shape))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE.parent)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["triton_dilated (1, 8, 16)", "triton_block_sparse (1, 8, 16)"]


def test_only_the_integration_imports_transformers():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() == "integrations/transformers.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "transformers"]
    assert not offenders
    code = ("import sys, triton_dilated, triton_dilated.integrations, triton_dilated.perf.decode; "
            "print('transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == "False", proc.stderr[-2000:]


@pytest.mark.parametrize("impl", ["triton_dilated", "triton_block_sparse"])
def test_static_cache_compiled_generate_equals_eager(impl):
    """Issue 21 item 5: generate(cache_implementation="static") with the forward compiled
    fullgraph (aot_eager; generate compiles on a GPU by itself, here it is told to) gives the
    tokens and logits of eager generation with the static cache and with DynamicCache; one
    graph serves every decode step (no recompile, no graph break)."""
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    attn = ({"dilated_attention": {"segment_lengths": [4, 8, 16], "dilation_rates": [1, 2, 4], "backend": "torch"}}
            if impl == "triton_dilated" else
            {"block_sparse_attention": {"builder": "local", "block_size": 16, "window": 1, "backend": "torch"}})
    model = _model(impl, **attn)
    ids = _ids((2, 6))
    ref = _generate_logits(model, ids, 20)
    _same_generation(_generate_logits(model, ids, 20, cache_implementation="static", disable_compile=True), ref)
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True          # generate compiles on accelerators only unless told
    torch._dynamo.reset()
    counters.clear()
    _same_generation(_generate_logits(model, ids, 20, cache_implementation="static", compile_config=config), ref)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], (dict(counters["stats"]),
                                                                                   dict(counters["graph_break"]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_functions_make_no_host_sync_per_layer(backend):
    """The attention functions' decode step reads nothing on the host: with a static cache's
    lengths (what the mask function gives a static cache), and for a padded batch whose mask
    the mask function tagged with its padding groups (each group's queries end its keys: the
    serve door, whose decode step reads no length on either backend)."""
    from tests.helpers.serve_checks import no_host_sync

    model = _model("triton_dilated", dilated_attention={"segment_lengths": [4, 8], "dilation_rates": [1, 2],
                                                       "backend": backend})
    module = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k, v = (torch.randn(2, 2, 12, 16, generator=gen) for _ in range(2))
    lengths = td_hf.dilated_attention_mask(2, q_length=1, kv_length=12, q_offset=torch.tensor(8))
    assert lengths.tolist() == [9, 9]
    want, _ = td_hf.dilated_attention_forward(module, q, k[:, :, :9], v[:, :, :9], None)
    with torch.no_grad(), no_host_sync():
        got, _ = td_hf.dilated_attention_forward(module, q, k, v, lengths)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0
    tagged = td_hf.dilated_attention_mask(2, q_length=1, kv_length=12, attention_mask=mask.bool())
    assert tagged.td_padding is not None
    want, _ = td_hf.dilated_attention_forward(module, q, k, v, mask.bool())      # untagged: computed per call
    with torch.no_grad(), no_host_sync():
        got, _ = td_hf.dilated_attention_forward(module, q, k, v, tagged)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="static cache"):
        td_hf.dilated_attention_mask(2, q_length=1, kv_length=12, q_offset=torch.tensor(8), attention_mask=mask.bool())
