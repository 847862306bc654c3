"""`python -m triton_dilated.perf decode`: the time of one decode step (one new query against
a cache of N tokens) for dilated attention against dense SDPA, as the context grows, and the
memory of the bounded cache (DilatedKVCache) against the full cache.

Providers, all on one cache per (batch size, context) (transformers' layout (B, Hkv, N, D)):
  dilated          dilated_attention_with_kvcache(q, k, v, cache_seqlens=N) over the full
                   cache, nothing appended (a DynamicCache decode step through the integration)
  dilated_kvcache  a serving decode step: dilated_attention_with_kvcache(q, k_cache, v_cache,
                   k_new, v_new, cache_seqlens=N - 1) over the same cache, the new token's row
                   appended in place, then attended (the inference entry point, no host sync)
  dilated_kvcache_paged      the same over a page pool (--page-size rows a page, a shuffled
                   block table; a copy of the cache in pages)
  dilated_kvcache_fp8, dilated_kvcache_paged_fp8   the same on a float8_e4m3fn cache (the
                   cache quantised with per-head descales amax / 448); their metric
                   max_abs_err is the largest |out - dilated_kvcache's out| (the paged
                   providers': 0 expected against their contiguous twin)
  dilated_kvcache_graph      dilated_kvcache's step compiled (torch.compile fullgraph,
                   --graph-backend) and captured in a CUDA graph, replay timed (GPU only: a
                   skipped row on a CPU)
  dilated_bounded  the same over the rows a DilatedKVCache keeps at this context
  indexed_kvcache  indexed attention's serving step: indexed_attention_with_kvcache(q, k_cache,
                   v_cache, indices, k_new, v_new, cache_seqlens=N - 1), each query's INDEXED_TOPK
                   (DeepSeek's 2048) random distinct positions of the N (all N when fewer), shared
                   by the heads, as the indexer hands them over
  indexed_gather   the same attention as PyTorch code would write it (perf/baselines.py
                   gather_indexed: the listed rows gathered, then softmax); its max_abs_err is
                   against indexed_kvcache
  sdpa_dense       scaled_dot_product_attention over the full cache (one query: no mask)
  dilated_kvcache_varlen       a mixed serving batch in ONE call: packed varlen queries
                   (cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new) of --varlen-mix requests
                   (default 7:1,1:256: seven 1-token decodes and one 256-token prefill chunk),
                   each request's new rows appended to its cache row (N - n_b rows before, N
                   after), then attended; rows: B = the requests, flags "mix=7:1,1:256"
  dilated_kvcache_varlen_loop  the same requests through the door one at a time (q (1, n_b,
                   Hq, D) each, its cache row a view of the same cache): the loop an engine
                   without varlen runs. max_abs_err of the varlen provider is against it (0 up
                   to rounding expected); speedup_vs_loop: loop ms / varlen ms, per round

Host time per call (metric host_ms, Python + launches): on a GPU, HOST_CALLS calls queued
back to back (host_ms); on a CPU, for the dilated_kvcache providers, the Python from the call
to the kernel launches with every launch stubbed out (the Triton path's launch path; Triton
only decides interpreted or compiled when the kernels are defined, so this needs them
undefined or interpreted: flag "CPU"), as the thread's CPU time, the least-disturbed of
CPU_HOST_ROUNDS rounds, next to provider aten_op: one small aten op's host time measured the
same way (the unit to read them in).

A query at position t reads about sum(w / r) keys whatever N (4,267 for the LongNet schedule),
so a decode path that reads only those keys has a flat time per token; dense decoding grows
linearly. Memory rows (metric cache_mib, one layer, keys and values) are measured by feeding
the tokens through a DilatedKVCache in chunks (no attention), at bfloat16 by default.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import torch

from ..ops.common.kvcache import FP8_MAX, quantise_fp8
from ..ops.dilated import dilated_attention_with_kvcache
from ..ops.dilated.cache import DilatedKVCache, quiet_heads_warning
from .results import CsvSink, _flags, make_row, provenance, sig
from .timing import OtherLoad, Timing, interleaved, paired_ratio, spread_pct

LONGNET = ([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 6, 12])
PROVIDERS = ("dilated", "dilated_kvcache", "dilated_kvcache_paged", "dilated_kvcache_fp8",
             "dilated_kvcache_paged_fp8", "dilated_kvcache_graph", "dilated_bounded", "indexed_kvcache", "indexed_gather",
             "sdpa_dense", "dilated_kvcache_varlen", "dilated_kvcache_varlen_loop")
VARLEN = ("dilated_kvcache_varlen", "dilated_kvcache_varlen_loop")
VARLEN_MIX = ((7, 1), (1, 256))   # (requests, new tokens each): 7 decodes, 1 prefill chunk of 256
INDEXED = ("indexed_kvcache", "indexed_gather")
INDEXED_TOPK = 2048
# the serving-step providers: (paged, fp8)
KVCACHE = {"dilated_kvcache": (False, False), "dilated_kvcache_paged": (True, False),
           "dilated_kvcache_fp8": (False, True), "dilated_kvcache_paged_fp8": (True, True)}
HOST_CALLS = 20   # calls queued back to back for the host time (metric host_ms, GPU)
CPU_HOST_CALLS = 40    # calls per round for the CPU launch path (host_ms, launches stubbed)
CPU_HOST_ROUNDS = 15   # rounds: the least-disturbed one counts
PAGE_SIZE = 64
OP = "decode"


def default_contexts(device: str):
    """4K to 1M on a GPU, 4K to 128K on a CPU (powers of two)."""
    top = 1 << 20 if device == "cuda" else 1 << 17
    return [1 << i for i in range(12, top.bit_length())]


def _dtype(name):
    return getattr(torch, name)


def _paged(x, table, page_size):
    """x (B, N, Hkv, D) as a page pool (B * pages, page_size, Hkv, D): page j of row b at
    table[b, j] (a copy; the last page zero-padded)."""
    B, N, H, D = x.shape
    pages = table.shape[1]
    pool = x.new_zeros(B * pages, page_size, H, D)
    ordered = torch.cat([x, x.new_zeros(B, pages * page_size - N, H, D)], dim=1) if pages * page_size > N else x
    pool[table.long().flatten()] = ordered.reshape(B * pages, page_size, H, D)
    return pool


def kvcache_steps(q, kq, vq, ws, rs, providers, page_size=PAGE_SIZE, gen=None):
    """{provider: step()} for the requested dilated_kvcache providers: each one decode step
    (the token at row N - 1 appended, then attended; the same row every call, so repeated
    calls do the same work), returning its output. kq, vq (B, N, Hkv, D)."""
    B, N, Hkv, D = kq.shape
    lens = torch.full((B,), N - 1, dtype=torch.int32, device=q.device)
    k_new, v_new = kq[:, -1:].clone(), vq[:, -1:].clone()
    kw = dict(segment_lengths=ws, dilation_rates=rs)
    steps, table, fp8 = {}, None, None
    for name, (paged, low) in KVCACHE.items():
        if name not in providers and not (name == "dilated_kvcache" and "dilated_kvcache_graph" in providers):
            continue
        k, v, extra = kq, vq, {}
        if low:
            if fp8 is None:   # per key/value head amax / 448: no value saturates
                descales = [(x.float().abs().amax(dim=(0, 1, 3)) / FP8_MAX).clamp(min=1e-12) for x in (kq, vq)]
                fp8 = (quantise_fp8(kq, descales[0]), quantise_fp8(vq, descales[1]), *descales)
            k, v = fp8[:2]
            extra = dict(k_descale=fp8[2], v_descale=fp8[3])
        if paged:
            if table is None:
                pages = -(-N // page_size)
                table = torch.randperm(B * pages, generator=gen, device="cpu").view(B, pages).to(torch.int32)
                table = table.to(q.device)
            k, v = _paged(k, table, page_size), _paged(v, table, page_size)
            extra["block_table"] = table

        def step(k=k, v=v, extra=extra):
            with torch.no_grad():
                return dilated_attention_with_kvcache(q, k, v, k_new, v_new, cache_seqlens=lens, **extra, **kw)
        steps[name] = step
    return steps


def indexed_steps(q, kq, vq, providers, gen=None, topk=INDEXED_TOPK):
    """{provider: step()} for the requested indexed providers: one decode step of indexed
    attention over topk random distinct positions of the N cached ones (indices (B, 1, topk)
    shared by the heads), the serve door (the row N - 1 appended, then attended) and the
    PyTorch gather of the same rows."""
    from ..ops.indexed import indexed_attention_with_kvcache
    from .baselines import gather_indexed
    wanted = [p for p in INDEXED if p in providers]
    if not wanted:
        return {}
    B, N = kq.shape[:2]
    order = torch.rand(B, N, generator=gen, device="cpu").argsort(dim=1)
    indices = order[:, :min(topk, N)].sort(dim=1).values.to(torch.int32).unsqueeze(1).to(q.device)
    lens = torch.full((B,), N - 1, dtype=torch.int32, device=q.device)
    k_new, v_new = kq[:, -1:].clone(), vq[:, -1:].clone()

    def serve():
        with torch.no_grad():
            return indexed_attention_with_kvcache(q, kq, vq, indices, k_new, v_new, cache_seqlens=lens)

    def gather():
        with torch.no_grad():
            return gather_indexed(q, kq, vq, indices, causal=True)
    return {p: {"indexed_kvcache": serve, "indexed_gather": gather}[p] for p in wanted}


def mix_label(mix) -> str:
    """A --varlen-mix as text: ((7, 1), (1, 256)) -> "7:1,1:256"."""
    return ",".join(f"{count}:{tokens}" for count, tokens in mix)


def varlen_steps(q, k_cache, v_cache, k_new, v_new, counts, ws, rs):
    """{provider: step()} of a mixed serving batch: request b brings counts[b] new tokens
    (packed q (total, Hq, D), k_new, v_new (total, Hkv, D)) after N - counts[b] cached rows
    (k_cache, v_cache (B, N, Hkv, D)). dilated_kvcache_varlen: one varlen call; _loop: the door
    once per request, on views of the same cache rows. Both append the same rows at the same
    places (repeated calls do the same work) and return the packed out (total, Hq, D)."""
    B, N = k_cache.shape[:2]
    dev = q.device
    lens = torch.tensor([N - n for n in counts], dtype=torch.int32, device=dev)
    bounds = [0]
    for n in counts:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    kw = dict(segment_lengths=ws, dilation_rates=rs)
    # the loop's per-request inputs, sliced once (an engine holds them per request)
    each = [(q[a:z].unsqueeze(0), k_cache[b:b + 1], v_cache[b:b + 1], k_new[a:z].unsqueeze(0),
             v_new[a:z].unsqueeze(0), lens[b:b + 1]) for b, (a, z) in enumerate(zip(bounds, bounds[1:]))]

    def varlen():
        with torch.no_grad():
            return dilated_attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                                  cu_seqlens_q=cu, max_seqlen_q=max(counts), cu_seqlens_k_new=cu,
                                                  **kw)

    def loop():
        with torch.no_grad():
            return torch.cat([dilated_attention_with_kvcache(qb, kb, vb, knb, vnb, cache_seqlens=lb, **kw)[0]
                              for qb, kb, vb, knb, vnb, lb in each])
    return {"dilated_kvcache_varlen": varlen, "dilated_kvcache_varlen_loop": loop}


def varlen_rows(n, mix, *, heads, kv_heads, head_dim, dtype, ws, rs, device, timing, gen, max_cache_gib, common,
                say, max_call_s=math.inf, dropped=""):
    """The rows of the varlen providers at context N (every request's row holds N keys after its
    append): ms of both (interleaved rounds), the varlen call's max_abs_err against the loop and
    its speedup_vs_loop (the per-round ratio). A mix whose longest request does not fit under N,
    or whose caches pass max_cache_gib, or `dropped` (why a shorter context stopped the timing),
    gives skipped rows; a first call over max_call_s gives single-call ms rows, flagged "single
    call (too slow to time)", and no timed rounds (run_decode then skips longer contexts)."""
    counts = [tokens for count, tokens in mix for _ in range(count)]
    B, total = len(counts), sum(counts)
    flags = f"mix={mix_label(mix)}"
    itemsize = torch.empty((), dtype=dtype).element_size()
    dname = str(dtype).removeprefix("torch.")
    row = lambda p, metric, value, **kw: make_row(**common, B=B, provider=p, N=n, dtype=dname,  # noqa: E731
                                                  metric=metric, value=value, **{"flags": flags, **kw})
    need = 2 * B * n * kv_heads * head_dim * itemsize
    why = dropped or (f"the mix's longest request ({max(counts)} tokens) does not fit under N" if max(counts) >= n
                      else f"caches of {need / 2 ** 30:.1f} GiB > max_cache_gib {max_cache_gib:g}"
                      if need > max_cache_gib * 2 ** 30 else "")
    if why:
        say(f"varlen {flags} N={n}: skipped ({why})")
        return [row(p, "ms", "", flags=f"{flags};skipped: {why}") for p in VARLEN]
    mk = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=dtype)  # noqa: E731
    k_cache, v_cache = mk(B, n, kv_heads, head_dim), mk(B, n, kv_heads, head_dim)
    q, k_new, v_new = mk(total, heads, head_dim), mk(total, kv_heads, head_dim), mk(total, kv_heads, head_dim)
    calls = varlen_steps(q, k_cache, v_cache, k_new, v_new, counts, ws, rs)
    outs, first = {}, {}
    for p, call in calls.items():   # untimed: the first call compiles kernels (Triton) or warms caches
        t0 = time.perf_counter()
        outs[p] = call()
        if device == "cuda":
            torch.cuda.synchronize()
        first[p] = time.perf_counter() - t0
    err = (outs["dilated_kvcache_varlen"].float() - outs["dilated_kvcache_varlen_loop"].float()).abs().max()
    err_row = row("dilated_kvcache_varlen", "max_abs_err", sig(float(err)),
                  config=f"vs dilated_kvcache_varlen_loop ({dname} cache)")
    if max(first.values()) > max_call_s:
        say(f"varlen {flags} N={n}: a first call took {max(first.values()):.1f} s > {max_call_s:g} s; not timed")
        return [row(p, "ms", sig(t * 1e3), rounds=1, flags=f"{flags};single call (too slow to time)")
                for p, t in first.items()] + [err_row]
    with OtherLoad() as load:
        times = interleaved(calls, device, timing)
    rows = [row(p, "ms", sig(sorted(t)[len(t) // 2]), spread_pct=sig(spread_pct(t)), rounds=len(t),
                other_cores=sig(load.cores), config=f"{total} new tokens in {B} requests") for p, t in times.items()]
    ratio, spread = paired_ratio(times["dilated_kvcache_varlen_loop"], times["dilated_kvcache_varlen"])
    rows.append(row("dilated_kvcache_varlen", "speedup_vs_loop", sig(ratio), spread_pct=sig(spread),
                    rounds=len(times["dilated_kvcache_varlen"]), other_cores=sig(load.cores)))
    rows.append(err_row)
    for r in rows:
        say(f"varlen {flags} B={B:>3} N={n:>8} {r['provider']:28} {r['value']:>12} {r['metric']}")
    return rows


def graph_step(step, backend="aot_eager"):
    """replay(): `step` compiled with torch.compile(fullgraph=True) and captured once in a CUDA
    graph (warmed up on a side stream first, as torch.cuda.graphs asks). A host sync in the
    step would make the capture fail."""
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            compiled()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled()
    return graph.replay


def _calls(q, k_full, v_full, bounded_rows, ws, rs, heads, kv_heads, providers=PROVIDERS, page_size=PAGE_SIZE,
           gen=None, graph_backend="aot_eager"):
    """{provider: no-argument call}, each one decode step for the query q (B, 1, Hq, D)."""
    kq, vq = k_full.transpose(1, 2), v_full.transpose(1, 2)      # (B, N, Hkv, D) views of the cache
    q_sdpa = q.transpose(1, 2)
    gqa = {"enable_gqa": True} if heads != kv_heads else {}

    def dilated(k, v):
        lens = torch.full((k.shape[0],), k.shape[1], dtype=torch.int32, device=k.device)

        def call():
            with torch.no_grad(), quiet_heads_warning(heads, k.shape[1]):
                dilated_attention_with_kvcache(q, k, v, cache_seqlens=lens, segment_lengths=ws, dilation_rates=rs,
                                               causal=True)
        return call

    def sdpa():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q_sdpa, k_full, v_full, **gqa)

    calls = {"dilated": dilated(kq, vq), "sdpa_dense": sdpa}
    if "dilated_bounded" in providers:
        calls["dilated_bounded"] = dilated(*bounded_rows())
    calls.update(kvcache_steps(q, kq, vq, ws, rs, providers, page_size, gen))
    calls.update(indexed_steps(q, kq, vq, providers, gen))
    if "dilated_kvcache_graph" in providers and q.device.type == "cuda":
        calls["dilated_kvcache_graph"] = graph_step(calls["dilated_kvcache"], graph_backend)
    return {p: c for p, c in calls.items() if p in providers}


@contextlib.contextmanager
def stubbed_launches():
    """Every Triton launch made a no-op (the interpreter's InterpretedFunction.run patched, so
    nothing executes: the decode kernel, the split merge, the append), and the Triton path
    chosen for CPU tensors (TRITON_INTERPRET=1 while inside): what is left of a call is its
    Python up to the launches, what a GPU's host spends before its queue gets the kernels.
    Yields False (and changes nothing) when the kernels were already defined compiled, which
    TRITON_INTERPRET cannot switch any more."""
    saved_env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    from ..ops.common.runtime import interpreter_enabled
    if not interpreter_enabled():   # (no triton, or kernels defined compiled)
        _restore_env(saved_env)
        yield False
        return
    from ..ops.common.kernels import interpreted_launches_stubbed
    try:
        with interpreted_launches_stubbed():
            yield True
    finally:
        _restore_env(saved_env)


def _restore_env(value):
    if value is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = value


def thread_cpu_us(call, rounds: int = CPU_HOST_ROUNDS, calls: int = CPU_HOST_CALLS) -> float:
    """µs of the calling thread's CPU time per call of `call` (time.thread_time: what other jobs
    on a shared machine cannot add by descheduling it), the least-disturbed of `rounds` rounds
    of `calls` calls, after a warm-up (plans, tables)."""
    for _ in range(3):
        call()
    best = math.inf
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(calls):
            call()
        best = min(best, (time.thread_time() - t0) / calls)
    return best * 1e6


def aten_op_us() -> float:
    """The host time of one small aten op on this machine (an add of two (8, 16, 128) float32
    tensors, thread_cpu_us): the unit the launch-path rows compare with."""
    x = torch.zeros(8, 16, 128)
    return thread_cpu_us(lambda: torch.add(x, x))


def cpu_host_ms(call, calls: int = CPU_HOST_CALLS) -> float | None:
    """CPU: the launch path of `call` (stubbed_launches), thread CPU ms per call (thread_cpu_us),
    or None where the Triton path cannot be taken."""
    with stubbed_launches() as ok:
        if not ok:
            return None
        return thread_cpu_us(call, calls=calls) / 1e3


def host_ms(call, device) -> float:
    """Host time per call (Python and launches), GPU: HOST_CALLS calls queued back to back
    after a synchronize, timed until the last returns (the queue absorbs the kernels), then
    drained. A call that synchronises (reads a device value on the host) shows here as its
    kernel time."""
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(HOST_CALLS):
        call()
    host = (time.perf_counter() - t0) / HOST_CALLS
    torch.cuda.synchronize(device)
    return host * 1e3


def _bounded_rows(k_full, v_full, ws, rs):
    """The rows a DilatedKVCache returns for the decode step of the last token: the cache fed
    the first N - 1 rows (it keeps the tail it needs), then the last one. (B, m, Hkv, D) each."""
    cache = DilatedKVCache(ws, rs)
    k, v = k_full.transpose(1, 2), v_full.transpose(1, 2)
    if k.shape[1] > 1:
        cache.update(k[:, :-1], v[:, :-1])
    return cache.update(k[:, -1:], v[:, -1:])


def cache_memory(contexts, *, heads=16, head_dim=128, dtype=torch.bfloat16, ws=LONGNET[0], rs=LONGNET[1],
                 chunk=1 << 16, device="cpu"):
    """[(N, rows the decode step of token N reads, their bytes, bytes of the buffers holding
    them, full-cache bytes)], one layer, B = 1: a DilatedKVCache fed N - 1 tokens in chunks,
    then one decode step (contexts ascending, one cache). The buffers are those the step reads
    (after it the cache may drop them all, at a segment boundary); they hold up to twice the
    rows while growing (doubling), never more than the most rows a decode step reads."""
    out = []
    cache = DilatedKVCache(ws, rs)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    for n in sorted(set(contexts)):
        while cache.seq_length() < n - 1:
            x = torch.zeros(1, min(chunk, n - 1 - cache.seq_length()), heads, head_dim, dtype=dtype, device=device)
            cache.update(x, x)
        x = torch.zeros(1, 1, heads, head_dim, dtype=dtype, device=device)
        k_rows, v_rows = cache.update(x, x)
        held = k_rows.untyped_storage().nbytes() + v_rows.untyped_storage().nbytes()
        row = heads * head_dim * itemsize * 2
        out.append((n, k_rows.shape[1], k_rows.shape[1] * row, held, n * row))
    return out


def cache_bytes(B: int, n: int, kv_heads: int, head_dim: int, itemsize: int, providers) -> int:
    """Bytes of the caches one (B, N) point holds: the cache itself, a paged copy, the FP8
    copy and its paged copy, as the providers need them."""
    one = B * n * kv_heads * head_dim * 2   # keys and values, one byte each
    total = one * itemsize
    total += one * itemsize if "dilated_kvcache_paged" in providers else 0
    total += one if {"dilated_kvcache_fp8", "dilated_kvcache_paged_fp8"} & set(providers) else 0
    total += one if "dilated_kvcache_paged_fp8" in providers else 0
    return total


def default_max_cache_gib(device: str) -> float:
    """Half the GPU's memory, 4 GiB on a CPU (a shared machine)."""
    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory / 2 ** 31
    return 4.0


def run_decode(contexts=None, *, heads=16, kv_heads=None, head_dim=128, dtype=None, providers=PROVIDERS,
               ws=LONGNET[0], rs=LONGNET[1], timing=None, max_call_s=None, out=None, memory_contexts=None,
               memory_dtype=torch.bfloat16, device=None, quiet=False, batches=(1,), page_size=PAGE_SIZE,
               max_cache_gib=None, graph_backend="aot_eager", varlen_mix=VARLEN_MIX):
    """Time the decode providers at each batch size and context; rows in the project's long
    CSV format (metric "ms": median per step; "host_ms": host time per call; "max_abs_err":
    the FP8 and paged providers against dilated_kvcache, the varlen call against its loop;
    "speedup_vs_loop": the varlen rows; "cache_mib": per layer). The varlen providers run once
    per context on the requests of varlen_mix ((count, new tokens) pairs; B = the requests,
    not `batches`). A provider
    whose single call takes longer than max_call_s is not timed at that context or any longer
    one (per batch size); a (B, N) whose caches pass max_cache_gib is skipped."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    contexts = sorted(contexts or default_contexts(device))
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    dname = str(dtype).removeprefix("torch.")
    kv_heads = kv_heads or heads
    timing = timing or Timing.for_device(device)
    max_call_s = max_call_s if max_call_s is not None else (30.0 if device == "cuda" else 20.0)
    max_cache_gib = max_cache_gib if max_cache_gib is not None else default_max_cache_gib(device)
    providers = [p for p in PROVIDERS if p in providers]
    prov = provenance(device)
    common = dict(op=OP, variant="longnet" if [list(ws), list(rs)] == [list(x) for x in LONGNET] else "custom",
                  H=heads, Hkv=kv_heads, D=head_dim, causal=True, attn_mode="longnet",
                  segment_lengths=" ".join(map(str, ws)), dilation_rates=" ".join(map(str, rs)), **prov)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    varlen = [p for p in providers if p in VARLEN]
    providers = [p for p in providers if p not in VARLEN]
    with CsvSink(out) as sink:
        for B in sorted(batches) if providers else ():
            dropped = {}
            for n in contexts:
                new = []

                def row(p, metric, value, **kw):
                    cache_dtype = "float8_e4m3fn" if p.endswith("_fp8") else dname
                    flags = kw.pop("flags", "")
                    if "paged" in p:
                        flags = ";".join(x for x in (flags, f"page_size={page_size}") if x)
                    pattern = dict(common)
                    if p in INDEXED:   # not the dilated schedule: each query's top-k positions
                        pattern.update(variant=f"topk={INDEXED_TOPK}", attn_mode="", segment_lengths="",
                                       dilation_rates="")
                    new.append(make_row(**pattern, B=B, provider=p, N=n, dtype=cache_dtype, metric=metric,
                                        value=value, flags=flags, **kw))

                need = cache_bytes(B, n, kv_heads, head_dim, torch.empty((), dtype=dtype).element_size(), providers)
                if need > max_cache_gib * 2 ** 30:
                    for p in providers:
                        row(p, "ms", "", flags=f"skipped: caches of {need / 2 ** 30:.1f} GiB > max_cache_gib "
                                              f"{max_cache_gib:g}")
                    sink.write(new)
                    rows += new
                    say(f"B={B} N={n}: skipped (caches {need / 2 ** 30:.1f} GiB > {max_cache_gib:g} GiB)")
                    continue
                k_full = torch.randn(B, kv_heads, n, head_dim, generator=gen, device=device, dtype=dtype)
                v_full = torch.randn(B, kv_heads, n, head_dim, generator=gen, device=device, dtype=dtype)
                q = torch.randn(B, 1, heads, head_dim, generator=gen, device=device, dtype=dtype)
                calls = _calls(q, k_full, v_full, lambda: _bounded_rows(k_full, v_full, ws, rs), ws, rs, heads,
                               kv_heads, [p for p in providers if p not in dropped], page_size, cpu_gen,
                               graph_backend)
                if "dilated_kvcache_graph" in providers and device != "cuda":
                    row("dilated_kvcache_graph", "ms", "", flags="skipped: CUDA graphs need a GPU (CPU run)")
                for p in providers:
                    if p in dropped:
                        row(p, "ms", "", flags=f"skipped: {dropped[p]}")
                reference = calls["dilated_kvcache"]() if "dilated_kvcache" in calls else None
                indexed_reference = calls["indexed_kvcache"]() if "indexed_kvcache" in calls else None
                for p in list(calls):
                    if n == contexts[0]:   # untimed: the first call compiles kernels (Triton) or warms caches
                        calls[p]()
                        if device == "cuda":
                            torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    got = calls[p]()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    first = time.perf_counter() - t0
                    if p in KVCACHE and p != "dilated_kvcache" and reference is not None:
                        row(p, "max_abs_err", sig(float((got.float() - reference.float()).abs().max())),
                            config=f"vs dilated_kvcache ({dname} cache)")
                    if p == "indexed_gather" and indexed_reference is not None:
                        row(p, "max_abs_err", sig(float((got.float() - indexed_reference.float()).abs().max())),
                            config=f"vs indexed_kvcache ({dname} cache)")
                    if first > max_call_s:
                        dropped[p] = f"one call took {first:.1f} s > {max_call_s:g} s at N={n}"
                        say(f"  {p}: {dropped[p]}; not timed from here on")
                        row(p, "ms", sig(first * 1e3), rounds=1, flags="single call (too slow to time)")
                        del calls[p]
                if calls:
                    with OtherLoad() as load:
                        times = interleaved(calls, device, timing)
                    for p, t in times.items():
                        t_sorted = sorted(t)
                        row(p, "ms", sig(t_sorted[len(t) // 2]), spread_pct=sig(spread_pct(t)), rounds=len(t),
                            other_cores=sig(load.cores))
                    stubbed = False
                    for p, c in calls.items():
                        if device == "cuda":   # queued calls: the host's share
                            row(p, "host_ms", sig(host_ms(c, device)), rounds=HOST_CALLS)
                        elif p in KVCACHE:     # CPU: the launch path, launches stubbed
                            ms = cpu_host_ms(c)
                            if ms is not None:
                                stubbed = True
                                row(p, "host_ms", sig(ms), rounds=CPU_HOST_ROUNDS,
                                    flags="CPU: Python up to the launch, launches stubbed; thread CPU time")
                    if stubbed:   # the unit: one aten op's host time on this machine
                        row("aten_op", "host_ms", sig(aten_op_us() / 1e3), rounds=CPU_HOST_ROUNDS,
                            flags="CPU: one aten op (add, 8x16x128 float32); thread CPU time")
                for r in new:
                    unit = {"ms": "ms", "host_ms": "ms host", "max_abs_err": "max |err|"}[r["metric"]]
                    say(f"B={B:>3} N={n:>8} {r['provider']:26} {r['value'] if r['value'] != '' else '-':>12} {unit}  "
                        f"{r['flags']}")
                sink.write(new)
                rows += new
                del k_full, v_full, calls, reference, indexed_reference
        varlen_dropped = ""
        for n in contexts if varlen else ():
            # both providers whichever is asked for: the rows compare them
            new = varlen_rows(n, varlen_mix, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, ws=ws,
                              rs=rs, device=device, timing=timing, gen=gen, max_cache_gib=max_cache_gib,
                              common=common, say=say, max_call_s=max_call_s, dropped=varlen_dropped)
            if any("single call" in r["flags"] for r in new):
                varlen_dropped = f"a call took longer than {max_call_s:g} s at N={n}"
            sink.write(new)
            rows += new
        if memory_contexts:
            for n, step_rows, live, held, full in cache_memory(memory_contexts, heads=kv_heads, head_dim=head_dim,
                                                                   dtype=memory_dtype, ws=ws, rs=rs):
                mem = [make_row(**common, B=1, provider=p, N=n, dtype=str(memory_dtype).removeprefix("torch."),
                                metric=m, value=sig(b / 2 ** 20), config=f"rows={r}")
                       for p, m, b, r in (("dilated_bounded", "cache_mib", live, step_rows),
                                          ("dilated_bounded", "cache_allocated_mib", held, step_rows),
                                          ("full_cache", "cache_mib", full, n))]
                sink.write(mem)
                rows += mem
    return rows


def _missing(v) -> bool:
    """A skipped timing: "" in fresh rows, NaN in rows read back from a CSV."""
    return v is None or v == "" or (isinstance(v, float) and math.isnan(v))


def decode_table(rows) -> str:
    """ms per step by batch size, context and provider, each provider's ratio to its first
    context; the host time per call; the FP8/paged errors; the cache memory rows (fresh rows,
    or rows read back from a CSV: `perf table`)."""
    batch = lambda r: int(r["B"]) if not _missing(r.get("B")) else 1  # noqa: E731
    varlen = [r for r in rows if r["provider"] in VARLEN]
    rows = [r for r in rows if r["provider"] not in VARLEN]
    ms = {(batch(r), r["N"], r["provider"]): r["value"] for r in rows if r["metric"] == "ms"}
    host = {(batch(r), r["N"], r["provider"]): (r["value"], str(r.get("flags") or "")) for r in rows
            if r["metric"] == "host_ms"}
    err = {(batch(r), r["N"], r["provider"]): r["value"] for r in rows if r["metric"] == "max_abs_err"}
    provs = [p for p in PROVIDERS if any(p == k[2] for k in ms)]
    lines = []
    cpu = any(str(r.get("device")) == "cpu" for r in rows)
    for B in sorted({k[0] for k in ms}):
        ns = sorted({k[1] for k in ms if k[0] == B})
        head = f"{'context':>9} " + " ".join(f"{p + ' ms':>30} {'x first':>7}" for p in provs)
        lines += [f"time per decode step (one query per row), median, batch {B}{' (CPU)' if cpu else ''}", head]
        first = {p: next((ms[(B, n, p)] for n in ns if not _missing(ms.get((B, n, p)))), None) for p in provs}
        for n in ns:
            cells = []
            for p in provs:
                v = ms.get((B, n, p))
                if _missing(v):
                    cells.append(f"{'skipped':>30} {'':>7}")
                else:
                    ratio = v / first[p] if first[p] else math.nan
                    cells.append(f"{v:>30.4g} {ratio:>7.2f}")
            lines.append(f"{n:>9} " + " ".join(cells))
        lines.append("")
    if host:
        hp = [p for p in provs + ["aten_op"] if any(k[2] == p for k in host)]
        how = "CPU: Python up to the launch, launches stubbed" if any("CPU" in f for _, f in host.values()) else \
            f"{HOST_CALLS} calls queued"
        lines += [f"host time per call (Python + launches; {how}), ms",
                  f"{'batch':>5} {'context':>9} " + " ".join(f"{p + ' host':>30}" for p in hp)]
        for B, n in sorted({k[:2] for k in host}):
            lines.append(f"{B:>5} {n:>9} " + " ".join(f"{host[(B, n, p)][0]:>30.4g}"
                                                      if not _missing(host.get((B, n, p), ("",))[0])
                                                      else f"{'-':>30}" for p in hp))
        lines.append("")
    if err:
        ep = [p for p in provs if any(k[2] == p for k in err)]
        lines += ["max |out - reference out| (against dilated_kvcache: paged: 0 expected; fp8: the quantisation error; "
                  "indexed_gather against indexed_kvcache)",
                  f"{'batch':>5} {'context':>9} " + " ".join(f"{p:>30}" for p in ep)]
        for B, n in sorted({k[:2] for k in err}):
            lines.append(f"{B:>5} {n:>9} " + " ".join(f"{err[(B, n, p)]:>30.4g}" if (B, n, p) in err
                                                      else f"{'-':>30}" for p in ep))
        lines.append("")
    if varlen:
        lines += varlen_table(varlen) + [""]
    mem = {(r["N"], r["provider"], r["metric"]): r for r in rows if r["metric"].startswith("cache_")}
    if mem:
        lines += ["KV cache per layer (keys + values) at the decode step of token N, MiB",
                  f"{'context':>9} {'bounded rows':>12} {'bounded MiB':>12} {'allocated':>10} {'full MiB':>10} "
                  f"{'full/bounded':>12}"]
        for n in sorted({k[0] for k in mem}):
            b, a = mem.get((n, "dilated_bounded", "cache_mib")), mem.get((n, "dilated_bounded", "cache_allocated_mib"))
            f = mem.get((n, "full_cache", "cache_mib"))
            if b is None or a is None or f is None:
                continue
            lines.append(f"{n:>9} {str(b['config']).removeprefix('rows='):>12} {b['value']:>12.4g} {a['value']:>10.4g} "
                         f"{f['value']:>10.4g} {f['value'] / b['value']:>12.1f}")
    return "\n".join(lines).rstrip("\n")


def varlen_table(rows) -> list:
    """The varlen rows' lines: per mix and context, the one-call and per-request-loop ms, their
    paired ratio and the varlen call's max_abs_err against the loop (fresh rows or rows read
    back from a CSV, whose flags are a list)."""
    mix = lambda r: next(iter(_flags(r)), "")  # noqa: E731
    val = {(mix(r), r["N"], r["provider"], r["metric"]): r["value"] for r in rows}
    lines = ["mixed serving batch (varlen: one call; loop: the door once per request), median ms",
             f"{'mix':>16} {'B':>4} {'context':>9} {'varlen ms':>12} {'loop ms':>12} {'loop/varlen':>11} "
             f"{'max |err|':>10}"]
    fmt = lambda v, w, f: f"{'-':>{w}}" if _missing(v) else f"{v:>{w}{f}}"  # noqa: E731
    for m, n in sorted({(mix(r), r["N"]) for r in rows}):
        B = next(int(r["B"]) for r in rows if mix(r) == m and r["N"] == n)
        get = lambda p, metric: val.get((m, n, p, metric))  # noqa: E731
        lines.append(f"{m.removeprefix('mix='):>16} {B:>4} {n:>9} "
                     f"{fmt(get('dilated_kvcache_varlen', 'ms'), 12, '.4g')} "
                     f"{fmt(get('dilated_kvcache_varlen_loop', 'ms'), 12, '.4g')} "
                     f"{fmt(get('dilated_kvcache_varlen', 'speedup_vs_loop'), 11, '.2f')} "
                     f"{fmt(get('dilated_kvcache_varlen', 'max_abs_err'), 10, '.3g')}")
    return lines


def main(args) -> int:
    """The `decode` subcommand."""
    kv = args.kv_heads or args.heads
    if args.heads % kv:
        print(f"decode: --heads ({args.heads}) must be a multiple of --kv-heads ({kv})", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    contexts = args.contexts or default_contexts(device)
    memory = args.memory_contexts if args.memory_contexts is not None else sorted(set(contexts) | {1 << 20})
    timing = Timing.for_device(device, args.budget)
    rows = run_decode(contexts, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                      dtype=_dtype(args.dtype) if args.dtype else None, providers=args.providers or PROVIDERS,
                      timing=timing, max_call_s=args.max_call_seconds, out=args.out, memory_contexts=memory,
                      batches=args.batch, page_size=args.page_size, max_cache_gib=args.max_cache_gib,
                      graph_backend=args.graph_backend, varlen_mix=args.varlen_mix or VARLEN_MIX)
    print(decode_table(rows))
    print(f"\nwrote {len(rows)} rows to {args.out}")
    if device == "cpu":
        print("(CPU run: the portable backend; kernel timings need a GPU. Host rows: the Triton path's Python up "
              "to the launch, launches stubbed; CUDA-graph rows need a GPU.)")
    return 0 if rows else 1
