"""Engine integrations (issue 22 item 6) on gloo CPU worlds of 2 spawned processes.

DeepSpeed ALST Ulysses (the `deepspeed` extra, not in `dev`: skipped where deepspeed is not
installed; pyproject.toml has the install and test times): a tiny random Llama with
attn_implementation="triton_dilated", its attention wrapped by DeepSpeed's own
UlyssesSPAttentionHF (integrations.deepspeed.register_ulysses), batches sharded by DeepSpeed's
UlyssesSPDataLoaderAdapter, trained with SGD: every step's loss equals the one-process run
(dilated offsets depend on the global head, so a rank computing with the wrong head offset
changes the losses: checked by hand, 4.2288 vs 4.2382 at the first step).

torchtitan (the `torchtitan` extra, not in `dev`: its wheel pulls datasets, wandb and
tensorboard): integrations.torchtitan.InnerAttention under torchtitan's context-parallel
contract, the batch sharded by torchtitan's own cp_shard (headtail balancer) where torchtitan
imports, else by its transcription (rank i holds chunks i and 2P-1-i: shard(..., "zigzag")),
through local shards with cp_mesh= and through DTensors Shard(1) (its SDPA wrapper's call):
each rank's rows and gradients equal those of the full-sequence call."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers.engine_worker import deepspeed_worker, one_process_losses, torchtitan_worker
from tests.helpers.ring_worker import spawn_world


def test_deepspeed_ulysses_trains_like_one_process():
    pytest.importorskip("transformers")
    pytest.importorskip("deepspeed")
    # one key/value head on two ranks: DeepSpeed repeats it (its GQA rule) before the all-to-all
    results = spawn_world(deepspeed_worker, 2, lambda queue: (queue, 1), 400)
    assert sorted(results) == [0, 1]
    assert all(status == "ok" for status, _ in results.values()), results
    ref = one_process_losses(kv_heads=1)
    for _, losses in results.values():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=2e-6, atol=1e-6)


def test_torchtitan_context_parallel_contract():
    real = importlib.util.find_spec("torchtitan") is not None
    results = spawn_world(torchtitan_worker, 2, lambda queue: (queue, "torchtitan" if real else "transcribed"), 400)
    assert sorted(results) == [0, 1]
    assert all(status == "ok" for status, _ in results.values()), results
    for _, diffs in results.values():
        assert set(diffs) == {"cp_mesh", "dtensor"} and max(diffs.values()) < 1e-5, diffs


def test_head_slice_without_offset_is_refused():
    """A transformers attention call holding fewer query heads than the model (heads split
    over ranks) without head_offset raises instead of computing the first heads' pattern."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from triton_dilated.integrations import transformers as td_hf
    cfg = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    cfg.dilated_attention = {"segment_lengths": [8], "dilation_rates": [2], "backend": "torch"}
    module = torch.nn.Module()
    module.config, module.is_causal = cfg, True
    q, kv = torch.randn(1, 2, 8, 8), torch.randn(1, 1, 8, 8)
    with pytest.raises(ValueError, match="holds 2 of the model's 4 query heads"):
        td_hf.dilated_attention_forward(module, q, kv, kv, None)
    for fn in (td_hf.dilated_attention_forward, td_hf.block_sparse_attention_forward):
        if fn is td_hf.block_sparse_attention_forward:
            cfg.block_sparse_attention = {"builder": "local", "block_size": 16, "window": 1, "max_seq_len": 16}
        out, _ = fn(module, q, kv, kv, None, head_offset=2, total_heads=4)
        assert out.shape == (1, 8, 2, 8)


def test_inner_attention_arguments():
    from triton_dilated import dilated_attention
    from triton_dilated.integrations.torchtitan import InnerAttention
    with pytest.raises(ValueError, match="load_balancer must be 'headtail' or None"):
        InnerAttention(load_balancer="ptrr")
    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match="takes no attention_masks"):
        InnerAttention()(q, q, q, attention_masks=object())
    got = InnerAttention(segment_lengths=[8], dilation_rates=[2], backend="torch")(q, q, q, scale=0.5)
    torch.testing.assert_close(got, dilated_attention(q, q, q, [8], [2], causal=True, scale=0.5, backend="torch"))
