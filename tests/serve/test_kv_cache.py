"""The bounded dilated-attention cache (triton_dilated.DilatedKVCache, ops/dilated/cache.py):
decoding against the rows it keeps gives the rows of the full-sequence attention (float64
oracle, tolerance rule), greedy tokens equal those of decoding against the full cache past
four times the longest segment, and its memory stays bounded by the longest segment."""
from __future__ import annotations

import math

import pytest
import torch

from triton_dilated import DilatedKVCache, dilated_attention, dilated_attention_naive
from triton_dilated.ops.dilated.cache import decode_rows_bound, window_start
from tests.conftest import DEVICE
from tests.helpers.reference import FLOOR, assert_rule, dense_reference, dilated_serve, multiplicity, seeded


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: OpenMP teams only spin on a shared CPU (docs/distributed.md, CPU threads)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


SCHEDULES = [
    ([8, 16, 32], [1, 2, 4]),       # nested (LongNet-like): rows bounded by max(w)
    ([6, 4], [2, 1]),               # not nested: lcm 12
    ([5, 12], [1, 3]),              # lcm 60 > every w
]


@pytest.mark.parametrize("ws", [s[0] for s in SCHEDULES] + [[2048, 4096, 8192, 16384, 32768]])
def test_window_start_rule(ws):
    step = math.lcm(*ws)
    bound = decode_rows_bound(ws)
    stop = min(4 * step + 7, 70000)
    positions = range(0, stop) if stop < 5000 else list(range(0, 200)) + list(range(step - 3, stop, 997))
    prev = 0
    for p in positions:
        s = window_start(p, ws)
        assert s % step == 0 and s <= min(p // w * w for w in ws)   # aligned; no segment of p starts earlier
        assert s >= prev                                             # rows once dropped are never needed again
        assert p + 1 - s <= bound                                    # a decode step's rows
        prev = s
    if all(b % a == 0 for a, b in zip(sorted(ws), sorted(ws)[1:])):
        assert bound == max(ws) and window_start(step * 3 - 1, ws) == step * 2


def _oracle_rows(q, k, v, ws, rs, mode, offsets):
    """(float64 oracle, same-dtype reference) of the full causal sequence."""
    ref, _ = dilated_attention_naive(q.double(), k.double(), v.double(), ws, rs, causal=True, mode=mode,
                                     offsets=offsets)
    counts = multiplicity(q.shape[1], ws, rs, q.shape[2], causal=True, mode=mode, offsets=offsets)
    same, _ = dense_reference(q, k, v, counts)
    return ref, same


def _decode(cache, q, k, v, prefill, backend, layer=0):
    outs = [cache.attend(q[:, :prefill], k[:, :prefill], v[:, :prefill], layer, backend=backend)]
    seen_rows = []
    for t in range(prefill, q.shape[1]):
        outs.append(cache.attend(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], layer, backend=backend))
        seen_rows.append(cache.rows(layer))
    return torch.cat(outs, dim=1), seen_rows


@pytest.mark.filterwarnings("ignore:DilatedKVCache. segment lengths:UserWarning")   # the coprime schedule warns
@pytest.mark.parametrize("ws,rs", SCHEDULES)
@pytest.mark.parametrize("mode,offsets", [("longnet", "modulo"), ("longnet", "blocked"), ("head_groups", "modulo")])
def test_bounded_decoding_equals_full_sequence_portable(ws, rs, mode, offsets):
    """Prefill, then one token at a time to past 4 lcm(w): every row equals the oracle's."""
    B, H, Hkv, D = 2, 4, 2, 8
    T = 4 * math.lcm(*ws) + 5 if math.lcm(*ws) < 40 else 2 * math.lcm(*ws) + 5
    q, k, v = (seeded((B, T, h, D), torch.float32, s, DEVICE) for s, h in ((1, H), (2, Hkv), (3, Hkv)))
    cache = DilatedKVCache(ws, rs, mode=mode, offsets=offsets)
    out, rows = _decode(cache, q, k, v, prefill=7, backend="torch")
    ref, same = _oracle_rows(q, k, v, ws, rs, mode, offsets)
    assert_rule("out", out.double(), ref, same.double(), factor=2, floor=FLOOR[torch.float32])
    assert cache.seq_length() == T and cache.start() == window_start(T, ws) and max(rows) < decode_rows_bound(ws)


def test_bounded_decoding_equals_full_sequence_triton():
    """The Triton path (interpreter on a CPU): a nested and a non-nested schedule, GQA."""
    B, H, Hkv, D = 1, 4, 2, 16
    for ws, rs, T in (([4, 8], [1, 2], 36), ([6, 4], [2, 1], 30)):
        q, k, v = (seeded((B, T, h, D), torch.float32, s, DEVICE) for s, h in ((4, H), (5, Hkv), (6, Hkv)))
        cache = DilatedKVCache(ws, rs)
        out, _ = _decode(cache, q, k, v, prefill=5, backend="triton")
        ref, same = _oracle_rows(q, k, v, ws, rs, "longnet", "modulo")
        assert_rule("out", out.double(), ref, same.double(), factor=2, floor=FLOOR[torch.float32])


class _ToyLM(torch.nn.Module):
    """Embedding, two dilated-attention layers (GQA) with residuals, tied output: enough to
    turn attention outputs into greedy tokens."""

    def __init__(self, vocab=48, dim=32, heads=4, kv_heads=2, layers=2, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.heads, self.kv_heads, self.d = heads, kv_heads, dim // heads
        self.emb = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.d) for _ in range(layers))
        self.pos = torch.nn.Embedding(4096, dim)

    def step(self, tokens, start, attend):
        """Logits of the last position; attend(layer, q, k, v) returns the new rows' output."""
        x = self.emb(tokens) + self.pos(torch.arange(start, start + tokens.shape[1], device=tokens.device))
        B, n, _ = x.shape
        for i, proj in enumerate(self.qkv):
            q, k, v = proj(x).split([self.heads * self.d, self.kv_heads * self.d, self.kv_heads * self.d], dim=-1)
            out = attend(i, q.view(B, n, self.heads, self.d), k.view(B, n, self.kv_heads, self.d),
                         v.view(B, n, self.kv_heads, self.d))
            x = x + out.reshape(B, n, -1)
        return x[:, -1] @ self.emb.weight.T


def _generate(model, prompt, steps, attend, make_state):
    state = make_state()
    tokens = prompt
    logits = model.step(prompt, 0, lambda i, q, k, v: attend(state, i, q, k, v))
    for _ in range(steps):
        nxt = logits.argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
        logits = model.step(nxt, tokens.shape[1] - 1, lambda i, q, k, v: attend(state, i, q, k, v))
    return tokens, state


@torch.no_grad()
def test_bounded_cache_gives_the_full_cache_tokens():
    """Greedy decoding past four times the longest segment: the bounded cache's tokens are the
    full cache's (a toy two-layer LM; LongNet-shaped nested schedule)."""
    ws, rs = [4, 8, 16], [1, 2, 4]
    model = _ToyLM()
    prompt = torch.randint(0, 48, (2, 5), generator=torch.Generator().manual_seed(1))
    steps = 4 * max(ws) + 9

    def full(state, i, q, k, v):   # the queries end the full rows: the serve door (every row valid)
        state[i] = [torch.cat([a, b], dim=1) if a is not None else b for a, b in zip(state[i], (k, v))]
        return dilated_serve(q, *state[i], ws, rs, causal=True, backend="torch")

    def bounded(cache, i, q, k, v):
        return cache.attend(q, k, v, i, backend="torch")

    ref, full_state = _generate(model, prompt, steps, full, lambda: {0: [None, None], 1: [None, None]})
    got, cache = _generate(model, prompt, steps, bounded, lambda: DilatedKVCache(ws, rs))
    assert torch.equal(got, ref)
    assert got.shape[1] == 5 + steps > 4 * max(ws)
    assert all(cache.rows(i) < max(ws) for i in range(2)) and full_state[0][0].shape[1] == got.shape[1]
    assert len({tuple(r.tolist()) for r in got[:, 5:]}) == 2     # the two rows decode different tokens


@torch.no_grad()
def test_memory_bounded_by_the_longest_segment():
    """LongNet's schedule shape (powers of two, rates 1..12), scaled down: during a decode of
    five periods of the longest segment a layer never holds more than max(w) rows, in buffers
    of at most max(w) rows."""
    ws, rs = [16, 32, 64, 128, 256], [1, 2, 4, 6, 12]
    B, Hkv, D = 1, 2, 4
    row_bytes = B * Hkv * D * 4 * 2           # key and value, float32
    cache = DilatedKVCache(ws, rs)
    cache.update(torch.zeros(B, 1000, Hkv, D), torch.zeros(B, 1000, Hkv, D))     # a long prefill, then decoding
    for _ in range(300):
        cache.update(torch.zeros(B, 1, Hkv, D), torch.zeros(B, 1, Hkv, D))
        assert cache.nbytes <= 256 * row_bytes
    cache = DilatedKVCache(ws, rs)
    cache.update(torch.zeros(B, 3, Hkv, D), torch.zeros(B, 3, Hkv, D))
    worst = 0
    for t in range(3, 5 * 256 + 3):
        k_rows, _ = cache.update(torch.full((B, 1, Hkv, D), float(t)), torch.zeros(B, 1, Hkv, D))
        worst = max(worst, k_rows.shape[1])
        first = window_start(t, ws)                # position of the first row returned
        assert k_rows[0, -1, 0, 0] == t and k_rows[0, 0, 0, 0] == (first if first >= 3 else 0)
        assert cache.nbytes <= 256 * row_bytes
    assert worst == 256 and cache.max_decode_rows == 256


@torch.no_grad()
def test_rows_returned_stay_valid():
    cache = DilatedKVCache([4, 8], [1, 2])
    kept = []
    for t in range(40):
        k_rows, v_rows = cache.update(torch.full((1, 1, 1, 2), float(t)), torch.full((1, 1, 1, 2), -float(t)))
        kept.append((k_rows, k_rows.clone(), t))
    for view, copy, t in kept:
        assert torch.equal(view, copy) and view[0, -1, 0, 0] == t


def test_chunked_prefill_with_gradients():
    """With autograd recording the cache concatenates: a prefill in three chunks gives the
    full call's output and gradients."""
    ws, rs = [4, 8], [1, 2]
    q, k, v = (seeded((1, 20, h, 8), torch.float32, s).requires_grad_(True) for s, h in ((1, 2), (2, 1), (3, 1)))
    cache = DilatedKVCache(ws, rs)
    out = torch.cat([cache.attend(q[:, a:b], k[:, a:b], v[:, a:b], backend="torch")
                     for a, b in ((0, 6), (6, 13), (13, 20))], dim=1)
    ref = dilated_attention(q, k, v, ws, rs, causal=True, backend="torch")
    g = seeded(out.shape, torch.float32, 9)
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * g).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("n", [3, 20])
def test_chunked_prefill_with_frozen_keys_and_values(backend, n):
    """Issue 19 item 2: only q requires grad (frozen k/v projections, e.g. LoRA on q). The
    cache wrote the next chunk in place into rows an earlier chunk's graph had saved
    ("modified by an inplace operation" at backward); now attend() hands a graph fresh rows.
    Output and dQ equal the full call's; the rows an earlier chunk got stay unchanged."""
    ws, rs = [64, 128], [1, 2]
    q = seeded((1, 4 * n, 2, 8), torch.float32, 1, DEVICE).requires_grad_(True)
    k, v = (seeded((1, 4 * n, 2, 8), torch.float32, s, DEVICE) for s in (2, 3))
    cache = DilatedKVCache(ws, rs)
    out = torch.cat([cache.attend(q[:, s:s + n], k[:, s:s + n], v[:, s:s + n], backend=backend)
                     for s in range(0, 4 * n, n)], dim=1)
    ref = dilated_attention(q, k, v, ws, rs, causal=True, backend=backend)
    g = seeded(out.shape, torch.float32, 9, DEVICE)
    (dq,), (ref_dq,) = torch.autograd.grad((out * g).sum(), (q,)), torch.autograd.grad((ref * g).sum(), (q,))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dq, ref_dq, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad-enabled"])
def test_update_in_place_also_while_autograd_records(grad):
    """Issue 19 item 2: appends write in place whether or not autograd records (decoding outside
    torch.no_grad copies no kept row per step), and a graph that saved rows handed out earlier
    (a query that requires grad against frozen k, v) still backpropagates to the values it saw."""
    x = torch.zeros(1, 1, 1, 2)
    cache = DilatedKVCache([8], [1])
    q = seeded((1, 1, 1, 2), torch.float32, 1).requires_grad_(True)
    with torch.set_grad_enabled(grad):
        rows = [cache.update(x + t, x + t)[0] for t in range(3)]          # capacity 1, 2, 4: a 4th row fits
        saved = (q * rows[2]).sum()                                        # a graph saves the 3-row view
        last, _ = cache.update(x + 3, x + 3)
    assert last[0, :, 0, 0].tolist() == [0, 1, 2, 3] and rows[2][0, :, 0, 0].tolist() == [0, 1, 2]
    assert last.untyped_storage().data_ptr() == rows[2].untyped_storage().data_ptr()    # no copy
    if grad:
        (dq,) = torch.autograd.grad(saved, q)
        assert dq[0, 0, 0].tolist() == [3.0, 3.0]                          # 0 + 1 + 2: the rows it saw


def test_update_after_inference_mode():
    """Rows written under torch.inference_mode are inference tensors, read-only outside it: the
    next append outside moves them once instead of failing ("Inplace update to inference tensor")."""
    cache = DilatedKVCache([8, 16], [1, 2])
    with torch.inference_mode():
        cache.update(torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4))      # a prefill,
        cache.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))      # a step: capacity 6 > 4 rows
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            k_rows, _ = cache.update(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4))
        assert not k_rows.is_inference() and k_rows[0, :, 0, 0].tolist() == [0] * 4 + [1] * (1 + grad)


def test_chunked_prefill_with_trainable_keys_and_values_triton():
    """k and v requiring grad through the cache on the Triton path (the portable path:
    test_chunked_prefill_with_gradients): the chunks concatenate, gradients reach k and v."""
    ws, rs = [64, 128], [1, 2]
    q, k, v = (seeded((1, 40, h, 8), torch.float32, s, DEVICE).requires_grad_(True)
               for s, h in ((1, 2), (2, 1), (3, 1)))
    cache = DilatedKVCache(ws, rs)
    out = torch.cat([cache.attend(q[:, s:s + 20], k[:, s:s + 20], v[:, s:s + 20], backend="triton")
                     for s in (0, 20)], dim=1)
    ref = dilated_attention(q, k, v, ws, rs, causal=True, backend="triton")
    g = seeded(out.shape, torch.float32, 9, DEVICE)
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * g).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@torch.no_grad()
def test_crop_reorder_reset():
    ws = [4, 8]
    cache = DilatedKVCache(ws, [1, 2])
    cache.update(torch.arange(2 * 13.).view(2, 13, 1, 1), torch.zeros(2, 13, 1, 1))
    assert (cache.seq_length(), cache.start(), cache.rows()) == (13, 8, 5)
    cache.layers[0].crop(3)
    assert (cache.seq_length(), cache.rows()) == (10, 2)
    with pytest.raises(ValueError, match="already dropped"):
        cache.layers[0].crop(3)            # position 7's segment starts at 0 < 8
    cache.layers[0].map_batch(lambda x: x.flip(0))
    k_rows, _ = cache.update(torch.zeros(2, 1, 1, 1), torch.zeros(2, 1, 1, 1))
    assert k_rows[:, :2, 0, 0].tolist() == [[21., 22.], [8., 9.]]
    cache.reset()
    assert cache.seq_length() == 0 and cache.nbytes == 0


def test_clear_errors():
    with pytest.raises(ValueError, match="dilation_rates"):
        DilatedKVCache([4, 8], [1])
    cache = DilatedKVCache([4, 8], [1, 2])
    cache.update(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    with pytest.raises(ValueError, match="must match the cached ones"):
        cache.update(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4))
    with pytest.raises(ValueError, match="same shape"):
        cache.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 2, 2, 4))
    with pytest.raises(ValueError, match="layer_idx"):
        cache.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), layer_idx=-1)


def test_decode_sweep_rows_and_table(tmp_path):
    """`python -m triton_dilated.perf decode` at tiny sizes: every provider timed per context,
    a provider too slow for the per-call limit is reported once and then skipped, memory rows
    of the bounded cache stay at the longest segment while the full cache grows."""
    from triton_dilated.perf import decode, results
    from triton_dilated.perf.__main__ import main
    from triton_dilated.perf.timing import Timing
    out = tmp_path / "decode.csv"
    one = Timing(warmup=0, budget_s=0.0, min_reps=1, max_reps=1, max_s=0.0)
    mix = ((2, 1), (1, 8))   # the varlen providers' batch: 2 decodes and an 8-token chunk (fits N = 64)
    rows = decode.run_decode([64, 128], heads=2, kv_heads=1, head_dim=8, ws=[16, 32], rs=[1, 2], timing=one,
                             out=str(out), memory_contexts=[40, 64, 1000], memory_dtype=torch.float32, device="cpu",
                             quiet=True, varlen_mix=mix)
    written = results.read_csv([str(out)])
    # ms per context and provider; the FP8/paged serving steps' error against the contiguous
    # cache, the indexed gather's against the indexed serve door and the varlen call's against
    # its per-request loop (with the varlen speedup); host time per call of the four serving steps; memory. The CPU host rows time the
    # Triton launch path with the launches stubbed, which needs the kernels defined under the
    # interpreter: so in the CPU suite (conftest sets TRITON_INTERPRET=1 first); a CUDA suite
    # defined them compiled, and the sweep writes no host rows for CPU tensors (stubbed_launches)
    serving = ("dilated_kvcache", "dilated_kvcache_paged", "dilated_kvcache_fp8", "dilated_kvcache_paged_fp8")
    host_serving = serving + ("aten_op",) if DEVICE == "cpu" else ()   # aten_op: the unit, one aten op
    assert len(written) == len(rows) == 2 * len(decode.PROVIDERS) + 2 * 5 + 2 + 2 * len(host_serving) + 3 * 3
    assert {r["provider"] for r in written if r["metric"] == "max_abs_err"} == {
        "dilated_kvcache_paged", "dilated_kvcache_fp8", "dilated_kvcache_paged_fp8", "indexed_gather",
        "dilated_kvcache_varlen"}
    ms = {(r["N"], r["provider"]): r["value"] for r in written if r["metric"] == "ms"}
    assert set(ms) == {(n, p) for n in (64, 128) for p in decode.PROVIDERS}
    # the CUDA-graph step is a skipped row on a CPU; every other provider is timed
    assert all(v > 0 for (n, p), v in ms.items() if p != "dilated_kvcache_graph")
    assert {(r["N"], r["provider"]) for r in written if r["metric"] == "host_ms"} == {
        (n, p) for n in (64, 128) for p in host_serving}
    mem = {(r["N"], r["provider"], r["metric"]): r for r in written if r["metric"].startswith("cache_")}
    row_mib = 1 * 8 * 4 * 2 / 2 ** 20
    assert mem[(1000, "full_cache", "cache_mib")]["value"] == pytest.approx(1000 * row_mib)
    assert mem[(1000, "dilated_bounded", "cache_mib")]["value"] == pytest.approx((999 % 32 + 1) * row_mib)
    assert all(mem[(n, "dilated_bounded", "cache_allocated_mib")]["value"] <= 32 * row_mib + 1e-12
               for n in (40, 64, 1000))
    table = decode.decode_table(rows)
    assert "time per decode step" in table and "KV cache per layer" in table
    # the per-call limit: every provider takes longer than 0 s, so each is reported once, then skipped
    rows = decode.run_decode([64, 128], heads=2, head_dim=8, ws=[16], rs=[1], timing=one, max_call_s=0.0,
                             device="cpu", quiet=True, varlen_mix=mix)
    flags = {(r["N"], r["provider"]): r["flags"] for r in rows if r["metric"] == "ms"}
    assert all("single call" in flags[(64, p)] and "skipped" in flags[(128, p)]   # varlen rows: "mix=...;" first
               for p in decode.PROVIDERS if p != "dilated_kvcache_graph")
    assert all(flags[(n, "dilated_kvcache_graph")] == "skipped: CUDA graphs need a GPU (CPU run)" for n in (64, 128))
    assert "skipped" in decode.decode_table(rows)
    assert main(["decode", "--contexts", "32", "--heads", "2", "--head-dim", "8", "--memory-contexts",
                 "--budget", "0", "--out", str(tmp_path / "cli.csv")]) == 0


def test_cache_edges_refused_or_stated():
    """Issue 19 item 7: float64 rows are refused at update (attend would refuse them later);
    a huge layer index keeps one layer, not 300,001; near-coprime segment lengths warn that
    the cache then bounds nothing."""
    cache = DilatedKVCache([8, 16], [1, 2])
    with pytest.raises(TypeError, match="float16, bfloat16, float32.*got torch.float64"):
        cache.update(torch.zeros(1, 1, 1, 2, dtype=torch.float64), torch.zeros(1, 1, 1, 2, dtype=torch.float64))
    cache = DilatedKVCache([8, 16], [1, 2])
    cache.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), layer_idx=300_000)
    assert len(cache.layers) == 1 and cache.rows(300_000) == 1 and cache.rows(5) == 0
    with pytest.warns(UserWarning, match=r"not nested .* up to 4,192,257 rows"):
        DilatedKVCache([2047, 2048], [1, 2])
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DilatedKVCache([2048, 4096], [1, 2])      # nested: no warning


def test_inplace_edit_after_forward_is_a_clear_error():
    """Issue 19 item 7: an input edited in place after the forward failed at backward with
    PyTorch's "Output 0 of ReshapeAlias is a view ..."; now the message says what happened."""
    x = seeded((1, 64, 2, 8), torch.float32, 1).requires_grad_(True)
    q, k, v = x * 1, x * 2, x * 3
    out = dilated_attention(q, k, v, [16, 32], [1, 2], causal=True, backend="torch")
    k.mul_(2)
    with pytest.raises(RuntimeError, match="q, k or v was modified in place after the forward"):
        out.sum().backward()


def test_attend_refuses_the_heads_first_layout():
    """Issue 24 item 5: q (1, 16, 1, 64) in transformers' (B, H, n, D) layout was read as 16
    tokens of one head. attend() needs q and the new rows to hold the same tokens, and later
    rows must match the cached heads; both errors name the layout."""
    q = torch.zeros(1, 16, 1, 64)          # 16 query heads, one token: heads first
    k = v = torch.zeros(1, 4, 1, 64)       # 4 key/value heads (GQA)
    with pytest.raises(ValueError, match=r"same new tokens.*\(B, H, n, D\) layout\? pass q.transpose\(1, 2\)"):
        DilatedKVCache([64], [1]).attend(q, k, v)
    cache = DilatedKVCache([64], [1])
    cache.attend(torch.zeros(1, 5, 4, 64), torch.zeros(1, 5, 4, 64), torch.zeros(1, 5, 4, 64))   # a prefill, right
    with pytest.raises(ValueError, match=r"\(B, H, n, D\) read heads as tokens"):
        cache.attend(torch.zeros(1, 4, 1, 64), torch.zeros(1, 4, 1, 64), torch.zeros(1, 4, 1, 64))  # heads first


def test_heads_first_layout_with_equal_head_counts():
    """Issue 24 item 5 with Hq == Hkv (no GQA): q and k (1, 16, 1, 64) in transformers' layout
    have equal token counts, and a decode from one token keeps the cached head count (1), so
    neither shape check sees it. A one-head q of several tokens warns; num_heads/num_kv_heads
    make it an error in every case, name the layout, and silence the warning for one-head models."""
    import warnings
    x = torch.zeros(1, 16, 1, 64)
    with pytest.warns(UserWarning, match=r"read as 16 tokens of one head.*\(B, H, n, D\) layout"):
        DilatedKVCache([64], [1]).attend(x, x, x)
    with pytest.raises(ValueError, match=r"Hq = num_heads = 16, got q \(1, 16, 1, 64\).*q.transpose\(1, 2\)"):
        DilatedKVCache([64], [1], num_heads=16).attend(x, x, x)
    with pytest.raises(ValueError, match=r"Hq = num_heads = 16, got q \(1, 16, 8, 64\)"):   # equal chunks of 8
        DilatedKVCache([64], [1], num_heads=16).attend(torch.zeros(1, 16, 8, 64), *[torch.zeros(1, 16, 8, 64)] * 2)
    with pytest.raises(ValueError, match=r"Hkv = num_kv_heads = 4, got k \(1, 4, 1, 64\).*k.transpose\(1, 2\)"):
        DilatedKVCache([64], [1], num_kv_heads=4).update(torch.zeros(1, 4, 1, 64), torch.zeros(1, 4, 1, 64))
    with pytest.raises(ValueError, match="num_heads must be a multiple of num_kv_heads"):
        DilatedKVCache([64], [1], num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="num_heads"):
        DilatedKVCache([64], [1], num_heads=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = DilatedKVCache([8, 16], [1, 2], num_heads=1, num_kv_heads=1)      # a real one-head model
        out = cache.attend(*(seeded((1, 5, 1, 4), torch.float32, s) for s in (1, 2, 3)), backend="torch")
        assert out.shape == (1, 5, 1, 4)
        DilatedKVCache([64], [1]).attend(*[torch.zeros(1, 5, 4, 8)] * 3, backend="torch")   # (B, n, H, D): quiet


def test_refused_attend_leaves_the_cache_unchanged():
    """attend() validates q, the flags, the scale and the backend before it writes the new rows:
    a call dilated_attention refuses (here a float64 q, 3 query heads over 2 key/value heads, a
    bad backend) raises the same error and writes nothing, so a corrected retry appends once."""
    cache = DilatedKVCache([8, 16], [1, 2])
    k = v = torch.zeros(1, 3, 2, 4)
    cache.attend(torch.zeros(1, 3, 2, 4), k, v, backend="torch")
    for q, kw, err in ((torch.zeros(1, 3, 2, 4, dtype=torch.float64), {}, TypeError),
                       (torch.zeros(1, 3, 3, 4), {}, ValueError),
                       (torch.zeros(1, 3, 2, 4), dict(backend="cuda"), ValueError),
                       (torch.zeros(1, 3, 2, 4), dict(causal=1), TypeError)):
        with pytest.raises(err):
            cache.attend(q, k, v, **kw)
        assert cache.seq_length() == cache.rows() == 3
    cache.attend(torch.zeros(1, 3, 2, 4), k, v, backend="torch")
    assert cache.seq_length() == 6
