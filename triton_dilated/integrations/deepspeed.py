"""DeepSpeed ALST Ulysses over triton_dilated's transformers attention
(`pip install triton_dilated[deepspeed]`; tested with deepspeed 0.19.8 on gloo CPU worlds).

    from triton_dilated.integrations import deepspeed as td_ds
    model = AutoModelForCausalLM.from_config(config, attn_implementation="triton_dilated")
    mpu = td_ds.register_ulysses(model, sequence_parallel_size=P, micro_batch_size=B)
    # then DeepSpeed's usual ALST recipe: UlyssesSPDataLoaderAdapter shards each batch over
    # the P ranks (input_ids, position_ids, shift_labels), the loss is summed over the ranks

DeepSpeed's `UlyssesSPAttentionHF.register_with_transformers` replaces the attention function
registered under the model's attn_implementation by a wrapper: in every layer an all-to-all
turns each rank's sequence shard of all heads into the whole sequence of H / P heads, the
wrapped function runs there (mask dropped: the causal mask is the function's own), and a
second all-to-all turns the result back (GQA with fewer key/value heads than ranks: each is
repeated, as ulysses_attention does). Rank r of DeepSpeed's sequence-parallel group then holds
query heads [r H / P, (r + 1) H / P); dilated offsets and per-head block layouts follow the
global head index, which DeepSpeed does not hand the function. `register_ulysses` therefore
first registers head-aware versions of "triton_dilated" / "triton_block_sparse" (they read the
rank in DeepSpeed's group, `parallel_state_sp`, and pass head_offset/total_heads), then calls
DeepSpeed's registration, which wraps them. Calling DeepSpeed's registration directly on our
names also works, except that a head slice without its offset is refused with a ValueError
(not computed with the wrong offsets).
"""
from __future__ import annotations

import functools

from . import transformers as td_hf   # the one module that imports transformers

IMPLEMENTATIONS = {td_hf.DILATED: td_hf.dilated_attention_forward,
                   td_hf.BLOCK_SPARSE: td_hf.block_sparse_attention_forward}


def _sp_state():
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    return mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_world_size()


def head_sliced(core):
    """An attention function that runs `core` with the head slice of this rank in DeepSpeed's
    sequence-parallel group when the call holds fewer query heads than the model config."""
    @functools.wraps(core)
    def forward(module, query, key, value, attention_mask, *args, **kwargs):
        total = getattr(td_hf._config_of(module), "num_attention_heads", None)
        local = query.shape[1]
        if isinstance(total, int) and local != total and "head_offset" not in kwargs:
            rank, world = _sp_state()
            if local * world != total:
                raise ValueError(f"DeepSpeed Ulysses handed {local} query heads on a sequence-parallel group of "
                                 f"{world} ranks; the model has {total} ({local} x {world} expected)")
            kwargs.update(head_offset=rank * local, total_heads=total)
        return core(module, query, key, value, attention_mask, *args, **kwargs)
    return forward


def register_ulysses(model_or_path, sequence_parallel_size: int, micro_batch_size: int, *,
                     core_attn_implementation: str = td_hf.DILATED, **kwargs):
    """DeepSpeed ALST Ulysses over "triton_dilated" (or "triton_block_sparse"): registers the
    head-aware attention function under that name, then
    `UlyssesSPAttentionHF.register_with_transformers(model_or_path, core_attn_implementation,
    sequence_parallel_size, micro_batch_size, **kwargs)` (seq_length, seq_length_is_variable,
    disable_in_eval as there). Returns DeepSpeed's mpu (None for sequence_parallel_size 1).
    torch.distributed and deepspeed.comm must be initialised (deepspeed.init_distributed)."""
    if core_attn_implementation not in IMPLEMENTATIONS:
        raise ValueError(f"core_attn_implementation must be one of {sorted(IMPLEMENTATIONS)}, got "
                         f"{core_attn_implementation!r}")
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    td_hf.register()
    td_hf.AttentionInterface.register(core_attn_implementation, head_sliced(IMPLEMENTATIONS[core_attn_implementation]))
    return UlyssesSPAttentionHF.register_with_transformers(model_or_path, core_attn_implementation,
                                                           sequence_parallel_size, micro_batch_size, **kwargs)
