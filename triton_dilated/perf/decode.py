"""`python -m triton_dilated.perf decode`: the time of one decode step (one new query against
a cache of N tokens) for dilated attention against dense SDPA, as the context grows, and the
memory of the bounded cache (DilatedKVCache) against the full cache.

Providers, all on one cache per context (transformers' layout (B, Hkv, N, D)):
  dilated          dilated_attention(q, k, v) over the full cache (the public API: whatever
                   decode path it has; a DynamicCache decode step)
  dilated_kvcache  dilated_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=) over the
                   same cache: the inference entry point, no host sync
  dilated_bounded  the same over the rows a DilatedKVCache keeps at this context
  sdpa_dense       scaled_dot_product_attention over the full cache (one query: no mask)

A query at position t reads about sum(w / r) keys whatever N (4,267 for the LongNet schedule),
so a decode path that reads only those keys has a flat time per token; dense decoding grows
linearly. Memory rows (metric cache_mib, one layer, keys and values) are measured by feeding
the tokens through a DilatedKVCache in chunks (no attention), at bfloat16 by default.
"""
from __future__ import annotations

import math
import sys
import time

import torch

from ..ops.dilated import dilated_attention, dilated_attention_with_kvcache
from ..ops.dilated.cache import DilatedKVCache, quiet_heads_warning
from .results import CsvSink, make_row, provenance, sig
from .timing import OtherLoad, Timing, interleaved, spread_pct

LONGNET = ([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 6, 12])
PROVIDERS = ("dilated", "dilated_kvcache", "dilated_bounded", "sdpa_dense")
HOST_CALLS = 20   # calls queued back to back for the host time (metric host_ms, GPU only)
OP = "decode"


def default_contexts(device: str):
    """4K to 1M on a GPU, 4K to 128K on a CPU (powers of two)."""
    top = 1 << 20 if device == "cuda" else 1 << 17
    return [1 << i for i in range(12, top.bit_length())]


def _dtype(name):
    return getattr(torch, name)


def _calls(q, k_full, v_full, bounded_rows, ws, rs, heads, kv_heads):
    """{provider: no-argument call}, each one decode step for the query q (B, 1, Hq, D)."""
    kq, vq = k_full.transpose(1, 2), v_full.transpose(1, 2)      # (B, N, Hkv, D) views of the cache
    q_sdpa = q.transpose(1, 2)
    gqa = {"enable_gqa": True} if heads != kv_heads else {}

    def dilated(k, v):
        def call():
            with torch.no_grad(), quiet_heads_warning(heads, k.shape[1]):
                dilated_attention(q, k, v, ws, rs, causal=True)
        return call

    def sdpa():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q_sdpa, k_full, v_full, **gqa)

    lens = torch.full((q.shape[0],), kq.shape[1], dtype=torch.int32, device=q.device)

    def kvcache():
        with torch.no_grad():
            dilated_attention_with_kvcache(q, kq, vq, cache_seqlens=lens, segment_lengths=ws, dilation_rates=rs)

    return {"dilated": dilated(kq, vq), "dilated_kvcache": kvcache, "dilated_bounded": dilated(*bounded_rows),
            "sdpa_dense": sdpa}


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


def run_decode(contexts=None, *, heads=16, kv_heads=None, head_dim=128, dtype=None, providers=PROVIDERS,
               ws=LONGNET[0], rs=LONGNET[1], timing=None, max_call_s=None, out=None, memory_contexts=None,
               memory_dtype=torch.bfloat16, device=None, quiet=False):
    """Time the decode providers at each context; rows in the project's long CSV format
    (metric "ms": median per token; "cache_mib": per layer). A provider whose single call
    takes longer than max_call_s is not timed at that context or any longer one."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    contexts = sorted(contexts or default_contexts(device))
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    kv_heads = kv_heads or heads
    timing = timing or Timing.for_device(device)
    max_call_s = max_call_s if max_call_s is not None else (30.0 if device == "cuda" else 20.0)
    prov = provenance(device)
    common = dict(op=OP, variant="longnet" if [list(ws), list(rs)] == [list(x) for x in LONGNET] else "custom",
                  B=1, H=heads, Hkv=kv_heads, D=head_dim, causal=True, attn_mode="longnet",
                  segment_lengths=" ".join(map(str, ws)), dilation_rates=" ".join(map(str, rs)), **prov)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    rows, dropped = [], {}
    gen = torch.Generator(device=device).manual_seed(0)
    with CsvSink(out) as sink:
        for n in contexts:
            k_full = torch.randn(1, kv_heads, n, head_dim, generator=gen, device=device, dtype=dtype)
            v_full = torch.randn(1, kv_heads, n, head_dim, generator=gen, device=device, dtype=dtype)
            q = torch.randn(1, 1, heads, head_dim, generator=gen, device=device, dtype=dtype)
            calls = _calls(q, k_full, v_full, _bounded_rows(k_full, v_full, ws, rs), ws, rs, heads, kv_heads)
            calls = {p: c for p, c in calls.items() if p in providers}
            new = []
            for p in list(calls):
                if p in dropped:
                    new.append(make_row(**common, provider=p, N=n, dtype=str(dtype).removeprefix("torch."),
                                        metric="ms", value="", flags=f"skipped: {dropped[p]}"))
                    del calls[p]
                    continue
                if n == contexts[0]:   # untimed: the first call compiles kernels (Triton) or warms caches
                    calls[p]()
                    if device == "cuda":
                        torch.cuda.synchronize()
                t0 = time.perf_counter()
                calls[p]()
                if device == "cuda":
                    torch.cuda.synchronize()
                first = time.perf_counter() - t0
                if first > max_call_s:
                    dropped[p] = f"one call took {first:.1f} s > {max_call_s:g} s at N={n}"
                    say(f"  {p}: {dropped[p]}; not timed from here on")
                    new.append(make_row(**common, provider=p, N=n, dtype=str(dtype).removeprefix("torch."),
                                        metric="ms", value=sig(first * 1e3), rounds=1,
                                        flags="single call (too slow to time)"))
                    del calls[p]
            if calls:
                with OtherLoad() as load:
                    times = interleaved(calls, device, timing)
                for p, t in times.items():
                    t_sorted = sorted(t)
                    new.append(make_row(**common, provider=p, N=n, dtype=str(dtype).removeprefix("torch."),
                                        metric="ms", value=sig(t_sorted[len(t) // 2]), spread_pct=sig(spread_pct(t)),
                                        rounds=len(t), other_cores=sig(load.cores)))
                if device == "cuda":   # on a CPU every call is synchronous: host time = ms
                    for p, c in calls.items():
                        new.append(make_row(**common, provider=p, N=n, dtype=str(dtype).removeprefix("torch."),
                                            metric="host_ms", value=sig(host_ms(c, device)), rounds=1))
            for r in new:
                unit = "ms" if r["metric"] == "ms" else "ms host"
                say(f"N={n:>8} {r['provider']:16} {r['value'] if r['value'] != '' else '-':>12} {unit}  {r['flags']}")
            sink.write(new)
            rows += new
            del k_full, v_full, calls
        if memory_contexts:
            for n, step_rows, live, held, full in cache_memory(memory_contexts, heads=kv_heads, head_dim=head_dim,
                                                                   dtype=memory_dtype, ws=ws, rs=rs):
                mem = [make_row(**common, provider=p, N=n, dtype=str(memory_dtype).removeprefix("torch."),
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
    """ms per token by context and provider, each provider's ratio to its first context, and
    the cache memory rows (fresh rows, or rows read back from a CSV: `perf table`)."""
    ms = {(r["N"], r["provider"]): r["value"] for r in rows if r["metric"] == "ms"}
    host = {(r["N"], r["provider"]): r["value"] for r in rows if r["metric"] == "host_ms"}
    ns = sorted({n for n, _ in ms})
    provs = [p for p in PROVIDERS if any(p == q for _, q in ms)]
    lines = []
    if ns:
        head = f"{'context':>9} " + " ".join(f"{p + ' ms':>18} {'x first':>7}" for p in provs)
        lines += ["time per decode step (one query), median", head]
        first = {p: next((ms[(n, p)] for n in ns if not _missing(ms.get((n, p)))), None) for p in provs}
        for n in ns:
            cells = []
            for p in provs:
                v = ms.get((n, p))
                if _missing(v):
                    cells.append(f"{'skipped':>18} {'':>7}")
                else:
                    ratio = v / first[p] if first[p] else math.nan
                    cells.append(f"{v:>18.4g} {ratio:>7.2f}")
            lines.append(f"{n:>9} " + " ".join(cells))
    if host:
        hp = [p for p in provs if any((n, p) in host for n in ns)]
        lines += ["", f"host time per call (Python + launches, {HOST_CALLS} calls queued), ms",
                  f"{'context':>9} " + " ".join(f"{p + ' host':>22}" for p in hp)]
        for n in ns:
            lines.append(f"{n:>9} " + " ".join(f"{host[(n, p)]:>22.4g}" if not _missing(host.get((n, p)))
                                                else f"{'-':>22}" for p in hp))
    mem = {(r["N"], r["provider"], r["metric"]): r for r in rows if r["metric"].startswith("cache_")}
    if mem:
        lines += ["", "KV cache per layer (keys + values) at the decode step of token N, MiB",
                  f"{'context':>9} {'bounded rows':>12} {'bounded MiB':>12} {'allocated':>10} {'full MiB':>10} "
                  f"{'full/bounded':>12}"]
        for n in sorted({k[0] for k in mem}):
            b, a = mem.get((n, "dilated_bounded", "cache_mib")), mem.get((n, "dilated_bounded", "cache_allocated_mib"))
            f = mem.get((n, "full_cache", "cache_mib"))
            if b is None or a is None or f is None:
                continue
            lines.append(f"{n:>9} {str(b['config']).removeprefix('rows='):>12} {b['value']:>12.4g} {a['value']:>10.4g} "
                         f"{f['value']:>10.4g} {f['value'] / b['value']:>12.1f}")
    return "\n".join(lines)


def main(args) -> int:
    """The `decode` subcommand."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    contexts = args.contexts or default_contexts(device)
    memory = args.memory_contexts if args.memory_contexts is not None else sorted(set(contexts) | {1 << 20})
    timing = Timing.for_device(device, args.budget)
    rows = run_decode(contexts, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                      dtype=_dtype(args.dtype) if args.dtype else None, providers=args.providers or PROVIDERS,
                      timing=timing, max_call_s=args.max_call_seconds, out=args.out, memory_contexts=memory)
    print(decode_table(rows))
    print(f"\nwrote {len(rows)} rows to {args.out}")
    if device == "cpu":
        print("(CPU run: the portable backend; kernel timings need a GPU.)")
    return 0 if rows else 1
