"""Workers for tests/integrations/test_engines.py (imported by the spawned gloo processes): a tiny random
Llama with attn_implementation="triton_dilated" trained for a few SGD steps under DeepSpeed
ALST Ulysses (UlyssesSPAttentionHF through integrations.deepspeed.register_ulysses, batches
sharded by DeepSpeed's UlyssesSPDataLoaderAdapter); and the one-process run it must equal."""
from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist

VOCAB, N, STEPS = 64, 32, 2   # STEPS: a multiple of the world size (the adapter takes one sample per rank)
# offsets depend on the global head (modulo rule, r = 4 over 4 heads): a rank holding heads
# 2, 3 computes a different function with head_offset 0, so the losses check it
DILATED = {"segment_lengths": [8, 32], "dilation_rates": [1, 4], "backend": "torch"}


def tiny_llama(kv_heads=2):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from triton_dilated.integrations import transformers as td_hf
    td_hf.register()
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      pad_token_id=0, attention_dropout=0.0)
    cfg.dilated_attention = dict(DILATED)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="triton_dilated", dtype=torch.float32)


def samples(count):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (count, 1, N), generator=g)
    return [dict(input_ids=x, position_ids=torch.arange(N)[None], labels=x.clone()) for x in ids]


def step_loss(model, batch, total_tokens):
    """Summed next-token cross entropy of this batch's tokens over the tokens of the whole
    sequence (shift_labels: DeepSpeed's adapter shifts before sharding)."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), batch["shift_labels"].reshape(-1),
                                             ignore_index=-100, reduction="sum") / total_tokens


def one_process_losses(kv_heads=2):
    """The reference: the same model, samples and SGD steps on the whole sequences."""
    model = tiny_llama(kv_heads).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for s in samples(STEPS):
        labels = torch.nn.functional.pad(s["labels"], (0, 1), value=-100)[:, 1:]
        loss = step_loss(model, {**s, "shift_labels": labels}, N - 1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def deepspeed_worker(rank, world, init_file, queue, kv_heads):
    try:
        os.environ["TRITON_INTERPRET"] = "0"
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        import sys

        import deepspeed
        import deepspeed.comm.torch  # noqa: F401
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (C++, minutes on
        # CI's two cores) that Ulysses does not use; None is its own "not available" path
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo")     # wraps the group above

        from triton_dilated.integrations import deepspeed as td_ds
        model = tiny_llama(kv_heads).train()
        mpu = td_ds.register_ulysses(model, sequence_parallel_size=world, micro_batch_size=1)
        group = mpu.get_sequence_parallel_group()
        # rank r's loader holds samples r, r + world, ...: the adapter runs them in order 0, 1, 2, ...
        mine = samples(STEPS)[rank::world]
        loader = torch.utils.data.DataLoader(mine, batch_size=None)
        batches = UlyssesSPDataLoaderAdapter(loader, sp_rank=rank, sp_group=group, sp_world_size=world,
                                             device=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for _, batch in zip(range(STEPS), batches):
            loss = step_loss(model, batch, N - 1)
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():     # replicated weights: the gradient is the sum over ranks
                dist.all_reduce(p.grad, group=group)
            total = loss.detach().clone()
            dist.all_reduce(total, group=group)
            opt.step()
            losses.append(total.item())
        queue.put((rank, "ok", losses))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))


def torchtitan_case(rank, world, mesh, sharding):
    """InnerAttention under torchtitan's CP contract: the full-sequence call's rows of this
    rank (headtail shards: chunks rank and 2P-1-rank), through local shards with cp_mesh= and
    through DTensors Shard(1) (what apply_cp_to_forward's SDPA branch hands), forward and
    gradients; returns the largest differences."""
    from torch.distributed.tensor import DTensor, Shard

    from triton_dilated import shard
    from triton_dilated.integrations.torchtitan import InnerAttention
    g = torch.Generator().manual_seed(3)
    B, L, Hq, Hkv, D = 1, 32, 4, 2, 8
    full = [torch.randn(B, L, h, D, generator=g, dtype=torch.float64).float() for h in (Hq, Hkv, Hkv, Hq)]
    pattern = dict(segment_lengths=[8, 32], dilation_rates=[1, 4], backend="torch")
    leaves = [x.clone().requires_grad_() for x in full[:3]]
    out = InnerAttention(**pattern)(*leaves, scale=0.3, enable_gqa=True)
    ref = [out.detach(), *torch.autograd.grad((out * full[3]).sum(), leaves)]
    if sharding == "torchtitan":   # torchtitan's own sharding of the batch (headtail balancer)
        from torchtitan.distributed.context_parallel.api import cp_shard
        local, _ = cp_shard(mesh, tuple(x.clone() for x in full), None, "headtail")
    else:                          # its transcription: rank i holds chunks i and 2P-1-i
        local = [shard(x, rank, world, "zigzag") for x in full]
    diffs = {}
    for how in ("cp_mesh", "dtensor"):
        leaves = [x.clone().requires_grad_() for x in local[:3]]
        if how == "cp_mesh":
            mod = InnerAttention(cp_mesh=mesh, scheme="ulysses", **pattern)
            out = mod(*leaves, scale=0.3, enable_gqa=True)
        else:
            mod = InnerAttention(scheme="ring", **{**pattern, "backend": "auto"})
            d = [DTensor.from_local(x, mesh, [Shard(1)], run_check=False) for x in leaves]
            out = mod(*d, scale=0.3, enable_gqa=True).to_local()
        got = [out.detach(), *torch.autograd.grad((out * local[3]).sum(), leaves)]
        diffs[how] = max(float((a - shard(b, rank, world, "zigzag")).abs().max()) for a, b in zip(got, ref))
    return diffs


def torchtitan_worker(rank, world, init_file, queue, sharding):
    try:
        os.environ["TRITON_INTERPRET"] = "0"
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        queue.put((rank, "ok", torchtitan_case(rank, world, mesh, sharding)))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))
