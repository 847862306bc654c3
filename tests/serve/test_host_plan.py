"""The serve step's host path (issue 35): the plan cache (one plan per key, a new one when any
part of the key changes, the checks still refusing what they refused), the fused append (one
Triton kernel, bit for bit the portable append, nothing written out of range, FP8 included),
PagedDilatedKVCache's plan-once-run-per-layer attends, and the append under torch.compile (one
mutating custom op, no index_put of the cache in the traced graph)."""
from __future__ import annotations

import pytest
import torch

from triton_dilated import PagedDilatedKVCache, dilated_attention_with_kvcache
from triton_dilated.ops.common.kvcache import append_kv, append_rows, quantise_fp8
from triton_dilated.ops.dilated import paged_cache as dl_paged
from triton_dilated.ops.dilated import serve as dl_serve
from tests.conftest import DEVICE
from tests.helpers.reference import seeded

WS, RS = [16, 32], [1, 2]
B, NK, HQ, HKV, D = 2, 48, 4, 2, 8
SCALARS = dict(causal=True, scale=None, mode="longnet", offsets="modulo", return_lse=False, backend="auto",
               validate=False, head_offset=0, total_heads=None, softcap=0.0)


def _interpreted_or_cuda():
    from triton_dilated.ops.common.runtime import interpreter_enabled
    return DEVICE == "cuda" or interpreter_enabled()


def _args(q=None, k_cache=None, block_table=None, k_new=True):
    q = seeded((B, 1, HQ, D), torch.float32, 1, DEVICE) if q is None else q
    kc = seeded((B, NK, HKV, D), torch.float32, 2, DEVICE) if k_cache is None else k_cache
    kn = seeded((B, 1, HKV, D), torch.float32, 3, DEVICE) if k_new else None
    lens = torch.tensor([5, 30], dtype=torch.int32, device=DEVICE)
    return (q, kc, kc.clone(), kn, None if kn is None else kn.clone(), lens, block_table, None, None, None)


def _plan(args, ws=WS, rs=RS, **changes):
    scalars = dict(SCALARS, **changes)
    return dl_serve.serve_plan(args, ws, rs, tuple(scalars.values()))


def test_plan_cache_returns_one_plan_per_key_and_a_new_one_when_any_part_changes():
    args = _args()
    plan = _plan(args)
    assert _plan(args) is plan
    assert _plan(_args()) is plan                       # other tensors of the same shapes, dtypes, device
    assert _plan(args, ws=tuple(WS), rs=tuple(RS)) is plan   # a tuple is the same schedule
    changed = [_plan(args, ws=[16, 16]), _plan(args, rs=[1, 4]), _plan(args, mode="head_groups"),
               _plan(args, offsets="blocked"), _plan(args, causal=False), _plan(args, scale=0.5),
               _plan(args, softcap=2.0), _plan(args, return_lse=True), _plan(args, backend="torch"),
               _plan(args, validate=True), _plan(args, head_offset=2, total_heads=8),
               _plan(_args(q=seeded((B, 2, HQ, D), torch.float32, 1, DEVICE))),
               _plan(_args(k_cache=seeded((B, NK + 16, HKV, D), torch.float32, 2, DEVICE))),
               _plan(_args(k_new=False))]
    assert all(p is not plan for p in changed)
    assert len({id(p) for p in changed}) == len(changed)
    assert _plan(args, causal=False) is changed[4]      # and those are kept too


def test_a_kept_plan_does_not_skip_the_checks_of_equal_values_of_another_type():
    """causal=1 equals True and 16.0 equals 16, but the checks refuse them: the key holds the
    values' types, so a plan kept for the valid call is never used for them."""
    args = _args()
    _plan(args)
    with pytest.raises(TypeError, match="causal must be a bool"):
        _plan(args, causal=1)
    with pytest.raises(TypeError):
        _plan(args, ws=[16.0, 32])
    with pytest.raises(TypeError):
        _plan(args, rs=[True, 2])


def test_serve_door_outputs_equal_with_a_kept_plan():
    """The first call builds the plan, the second runs the kept one: the same output, and the
    same as the uncached door (the training door at the same lengths is tested elsewhere)."""
    q, kc, vc, kn, vn, lens = _args()[:6]
    outs = []
    for _ in range(2):
        k2, v2 = kc.clone(), vc.clone()
        outs.append(dilated_attention_with_kvcache(q, k2, v2, kn, vn, cache_seqlens=lens, segment_lengths=WS,
                                                   dilation_rates=RS, return_lse=True))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def _append_case(dtype, fp8, paged, n):
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(3, n, HKV, D, generator=gen).to(dtype) * 3 for _ in range(2))
    k[0, 0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-6])
    v[1, 0, 1, :4] = torch.tensor([-1e-3, 600.0, -470.0, 2 ** -9 * 1.5])   # saturation, rounding, subnormal
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    if paged:
        kc, vc = (torch.randn(10, 16, HKV, D, generator=gen).to(cache_dtype) for _ in range(2))
        table = torch.randperm(9, generator=gen).view(3, 3).to(torch.int32)
        table[2, 2] = 99   # a page outside the pool: row 2 writes nothing once its rows reach it
    else:
        kc, vc = (torch.randn(3, NK, HKV, D, generator=gen).to(cache_dtype) for _ in range(2))
        table = None
    descales = (torch.rand(HKV, generator=gen) * 0.1 + 0.01, torch.rand(HKV, generator=gen) * 0.1 + 0.01) if fp8 \
        else (None, None)
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return to(kc), to(vc), to(k), to(v), to(table), tuple(to(x) for x in descales)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_append_equals_the_portable_append_and_writes_nothing_out_of_range(fp8, paged):
    """append_kv on the Triton path (one kernel) against append_rows (the portable path's aten
    ops), bit for bit (NaN payloads and FP8 bytes included): valid rows, a row at a negative
    length, a row past the capacity, and (paged) a row reaching a page outside the pool, which
    write nothing; one and three new rows."""
    if not _interpreted_or_cuda():
        pytest.skip("the Triton append needs a GPU or the interpreter")
    for dtype in (torch.float32, torch.float16):
        for n in (1, 3):
            kc, vc, k, v, table, (ks, vs) = _append_case(dtype, fp8, paged, n)
            for lengths in ([0, 5, 33], [-1, 47, 46], [45, 16, 40], [-5, 48, 31]):
                lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
                ref = (kc.clone(), vc.clone())
                append_rows(*ref, k, v, lens, table, ks, vs)
                for path in ("triton", "torch"):
                    got = (kc.clone(), vc.clone())
                    append_kv(path, *got, k, v, lens, table, ks, vs)
                    for a, b in zip(got, ref):
                        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (path, dtype, n, lengths)
                for row, start in enumerate(lengths):   # contiguous, out of range: the row's cache untouched
                    if not paged and not 0 <= start <= NK - n:
                        assert torch.equal(ref[0][row].view(torch.uint8), kc[row].view(torch.uint8))


def test_fp8_quantisation_of_the_fused_append_equals_quantise_fp8():
    """The kernel's e4m3 rounding (e4m3_bits) against torch's .to(float8_e4m3fn) (quantise_fp8)
    over every bf16 magnitude band: normals, subnormals, ties, saturation, NaN and Inf."""
    if not _interpreted_or_cuda():
        pytest.skip("the Triton append needs a GPU or the interpreter")
    grid = torch.cat([torch.linspace(-500, 500, 4001), torch.logspace(-12, -5, 200, base=2),
                      -torch.logspace(-12, -5, 200, base=2), torch.tensor([0.0, -0.0, float("nan"), float("inf"),
                                                                            -float("inf"), 448.0, 464.0, 2 ** -9])])
    rows = grid[: grid.numel() // (HKV * D) * HKV * D].view(-1, 1, HKV, D).to(DEVICE)
    descale = torch.ones(HKV, device=DEVICE)
    kc = torch.zeros(rows.shape[0], 1, HKV, D, device=DEVICE).to(torch.float8_e4m3fn)
    vc = kc.clone()
    lens = torch.zeros(rows.shape[0], dtype=torch.int32, device=DEVICE)
    append_kv("triton", kc, vc, rows, rows, lens, None, descale, descale)
    want = quantise_fp8(rows, descale)
    assert torch.equal(kc.view(torch.uint8), want.view(torch.uint8))


def test_paged_cache_plans_a_step_once_and_runs_it_on_every_layer(monkeypatch):
    """PagedDilatedKVCache: the first attend of a step builds (or finds) the door's plan, the
    other layers run it without a key, a check or a plan; the outputs equal the door's."""
    layers = 3
    cache = PagedDilatedKVCache(WS, RS, num_pages=8, page_size=16, num_kv_heads=HKV, head_dim=D, device=DEVICE,
                                num_layers=layers)
    cache.admit("a")
    cache.admit("b")
    planned = []
    serve_plan = dl_paged.serve_plan
    monkeypatch.setattr(dl_paged, "serve_plan", lambda *a: planned.append(1) or serve_plan(*a))
    built = dl_serve._PLANS.builds
    q = seeded((2, 1, HQ, D), torch.float32, 1, DEVICE)
    for t in range(3):
        step = cache.begin(["a", "b"], 1)
        planned.clear()
        for layer in range(layers):
            k, v = (seeded((2, 1, HKV, D), torch.float32, 10 * t + layer + s, DEVICE) for s in (0, 5))
            pools = (cache.k_pools[layer].clone(), cache.v_pools[layer].clone())
            got = step.attend(q, k, v, layer)
            want = dilated_attention_with_kvcache(q, *pools, k, v, cache_seqlens=step.cache_seqlens,
                                                  block_table=step.block_table, segment_lengths=WS,
                                                  dilation_rates=RS)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            torch.testing.assert_close((cache.k_pools[layer], cache.v_pools[layer]), pools, rtol=0, atol=0)
        assert planned == [1], "one plan per step, at its first attend"
        step.end()
    assert dl_serve._PLANS.builds - built <= 2   # the door's plans: at most one for the step, one for the check


def test_paged_step_still_refuses_a_step_whose_sequence_was_evicted():
    cache = PagedDilatedKVCache(WS, RS, num_pages=8, page_size=16, num_kv_heads=HKV, head_dim=D, device=DEVICE)
    cache.admit("a")
    cache.admit("b")
    step = cache.begin(["a", "b"], 1)
    q = seeded((2, 1, HQ, D), torch.float32, 1, DEVICE)
    k = seeded((2, 1, HKV, D), torch.float32, 2, DEVICE)
    step.attend(q, k, k)
    cache.evict("b")
    with pytest.raises(ValueError, match="was evicted after this step began"):
        step.attend(q, k, k)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiled_append_is_one_mutating_custom_op(backend):
    """Under torch.compile the append traces as triton_dilated::append_kv (mutates k_cache,
    v_cache), not as index_put on the cache. (aot_eager still functionalises it: the op runs on
    clones of the caches, copied back; Inductor's reinplacing runs it in place.)"""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _):
        graphs.append(gm.code)
        return gm

    q, kc, vc, kn, vn, lens = _args()[:6]

    def step(q, kc, vc, kn, vn, lens):
        return dilated_attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, segment_lengths=WS,
                                              dilation_rates=RS, backend=backend)

    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(step, backend=aot_autograd(fw_compiler=keep, keep_inference_input_mutations=True),
                                 fullgraph=True)
        k2, v2 = kc.clone(), vc.clone()
        got = compiled(q, kc, vc, kn, vn, lens)
        want = step(q, k2, v2, kn, vn, lens)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close((kc, vc), (k2, v2), rtol=0, atol=0)
    (code,) = graphs
    assert "triton_dilated.append_kv" in code and "index_put" not in code
