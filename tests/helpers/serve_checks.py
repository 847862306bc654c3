"""The serve tests' shared checks (tests/serve/, and the integrations that drive the serve
doors): queries at the end of longer keys against the definition (the float64 oracle on each
row's prefix, the queries placed last), a cache's contiguous rows as shuffled page pools and
back, and a guard that raises on every host read of a tensor's values."""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from triton_dilated import (block_sparse_attention_naive, block_sparse_attention_with_kvcache, dilated_attention_naive,
                            dilated_attention_with_kvcache)
from triton_dilated.ops.block_sparse import decode_kernels as bs_kernels
from triton_dilated.ops.common import decode as common_decode
from triton_dilated.ops.common import decode_kernels as common_kernels
from triton_dilated.ops.dilated import decode_kernels as dl_kernels
from triton_dilated.ops.indexed import kernels as idx_kernels
from tests.conftest import DEVICE
from tests.helpers.reference import FLOOR, assert_rule, seeded


# ----------------------------------------------------------------------------- queries shorter than keys

def definition(oracle, q, k, v, lengths, causal=None):
    """(out, lse) of the last Nq positions of each row's prefix, by the oracle (in q's dtype).
    A row shorter than its queries (n < Nq; then `causal` must be given) puts its first Nq - n
    queries before position 0 (DESIGN §5b): under causal (or in an empty row) they read no
    key, 0 and -inf; without causal each sits at position 0, its own oracle call on the row's
    n keys with the query at row 0 and zero rows after it."""
    B, Nq = q.shape[:2]
    outs, lses = [], []
    for b, n in enumerate(lengths):
        m, out, lse = min(n, Nq), [], []
        if m < Nq:
            if causal is None:
                raise ValueError(f"row {b} holds {n} keys, fewer than its {Nq} queries: say causal= for them")
            early = q[b:b + 1, :Nq - m]
            if causal or n == 0:
                out.append(early * 0)
                lse.append(torch.full((1, q.shape[2], Nq - m), float("-inf"), dtype=q.dtype, device=q.device))
            for i in range(Nq - m if not (causal or n == 0) else 0):
                qf = torch.cat([early[:, i:i + 1], torch.zeros_like(q[b:b + 1, :1]).expand(1, n - 1, -1, -1)], dim=1)
                o, l_ = oracle(qf, k[b:b + 1, :n], v[b:b + 1, :n], n)
                out.append(o[:, :1])
                lse.append(l_[:, :, :1])
        if m:
            qf = torch.cat([torch.zeros_like(q[b:b + 1, :1]).expand(1, n - m, -1, -1), q[b:b + 1, Nq - m:]], dim=1)
            o, l_ = oracle(qf, k[b:b + 1, :n], v[b:b + 1, :n], n)
            out.append(o[:, n - m:])
            lse.append(l_[:, :, n - m:])
        outs.append(torch.cat(out, dim=1))
        lses.append(torch.cat([x.to(lse[-1].dtype) for x in lse], dim=2))
    return torch.cat(outs), torch.cat(lses)


def check_against_definition(fn, oracle, q, k, v, lengths, dtype, causal=None):
    """Forward, lse and gradients of fn against the definition (same-dtype reference: the
    definition computed in the test dtype through the same oracle code; causal: as
    definition's, for rows shorter than the queries)."""
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    out, lse = fn(q, k, v)
    ref_out, ref_lse = definition(oracle, *(x.double() for x in (q, k, v)), lengths, causal)
    same_out, same_lse = definition(oracle, q.float(), k.float(), v.float(), lengths, causal)
    floor = FLOOR[dtype]
    assert_rule("out", out.float(), ref_out, same_out.float(), factor=2, floor=floor)
    assert_rule("lse", lse.float(), ref_lse, same_lse.float(), factor=2, floor=floor)
    g_out = seeded(out.shape, torch.float64, 7, out.device)
    g_lse = seeded(lse.shape, torch.float64, 8, lse.device) * torch.isfinite(ref_lse)
    grads = torch.autograd.grad((out.double() * g_out).sum() + (torch.nan_to_num(lse.double(), neginf=0) * g_lse)
                                .sum(), (q, k, v))
    qd, kd, vd = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ro, rl = definition(oracle, qd, kd, vd, lengths, causal)
    ref_grads = torch.autograd.grad((ro * g_out).sum() + (torch.nan_to_num(rl, neginf=0) * g_lse).sum(), (qd, kd, vd))
    for name, g, r in zip("qkv", grads, ref_grads):
        assert_rule(f"d{name}", g.double(), r, r.float().double(), factor=3, floor=floor * 10)
        # key rows past every length get no gradient
    for b, n in enumerate(lengths):
        assert torch.all(grads[1][b, n:] == 0) and torch.all(grads[2][b, n:] == 0)


def check_forward(out, lse, q, k, v, lengths, oracle, causal=None):
    """out, lse against the definition (float64) with the float32 definition as the same-dtype
    reference; rows without a key exactly 0 (causal: as definition's)."""
    clean = [x.clone() for x in (k, v)]
    for b, n in enumerate(lengths):   # the oracle slices rows [0, n): the NaN rows are never read
        clean[0][b, n:] = 0
        clean[1][b, n:] = 0
    ref_out, ref_lse = definition(oracle, q.double(), clean[0].double(), clean[1].double(), lengths, causal)
    same_out, same_lse = definition(oracle, q.float(), clean[0].float(), clean[1].float(), lengths, causal)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    floor = FLOOR[q.dtype]
    assert_rule("out", out.float(), ref_out, same_out.float(), factor=2, floor=floor)
    assert_rule("lse", lse, ref_lse, same_lse.float(), factor=2, floor=floor)
    empty = torch.isinf(ref_lse).transpose(1, 2)
    assert (out[empty] == 0).all(), "queries without a key must output exactly 0"


# ----------------------------------------------------------------------------- no host sync

class HostSync(RuntimeError):
    pass


_GUARD = {"armed": False}
_SYNC_OPS = ("_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique", "_unique",
             "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave", "item")


class _NoSyncMode(TorchDispatchMode):
    """Raises on the aten ops that read values on the host or size an output from values."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _GUARD["armed"] and func.overloadpacket.__name__ in _SYNC_OPS:
            raise HostSync(f"host sync: aten.{func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))


def _raiser(name, original):
    def method(self, *args, **kwargs):
        if _GUARD["armed"]:
            raise HostSync(f"host sync: Tensor.{name}")
        return original(self, *args, **kwargs)
    return method


class _Disarmed:
    """A Triton kernel whose launch runs with the guard off (the interpreter reads tensors
    on the host to run the kernel; a GPU launch does not)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _GUARD["armed"] = False
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                _GUARD["armed"] = True
        return launch


@contextlib.contextmanager
def no_host_sync():
    """Every host read of a tensor's values raises HostSync while armed. The portable decode's
    reads of CPU tensors (common.decode.host_reads: no device there to stop) are switched off,
    so the path a GPU takes runs under the guard."""
    patches = [(torch.Tensor, name) for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__",
                                                 "numpy")]
    patches += [(mod, name) for mod, name in ((dl_kernels, "_dilated_decode_kernel"),
                                              (bs_kernels, "_block_sparse_decode_kernel"),
                                              (common_kernels, "_decode_merge_kernel"),
                                              (idx_kernels, "_indexed_fwd_kernel"))]
    saved = [(obj, name, getattr(obj, name)) for obj, name in patches]
    equal, host_reads = torch.equal, common_decode.host_reads
    common_decode.host_reads = lambda x: False
    try:
        for obj, name, original in saved:
            setattr(obj, name, _Disarmed(original) if obj is not torch.Tensor else _raiser(name, original))
        torch.equal = _raiser("equal", equal)
        with _NoSyncMode():
            _GUARD["armed"] = True
            yield
    finally:
        _GUARD["armed"] = False
        torch.equal, common_decode.host_reads = equal, host_reads
        for obj, name, original in saved:
            setattr(obj, name, original)


# ----------------------------------------------------------------------------- paged cache

def page_pools(k_cache, v_cache, page_size, spare=3, seed=0):
    """The same rows as page pools (num_pages, page_size, Hkv, D), pages in a shuffled order
    with `spare` NaN pages no row uses, and the block table int32 (B, capacity / page_size)."""
    B, N, Hkv, D = k_cache.shape
    per_row = -(-N // page_size)
    order = torch.randperm(B * per_row + spare, generator=torch.Generator().manual_seed(seed))
    table = order[:B * per_row].view(B, per_row).to(torch.int32).to(k_cache.device)
    pools = []
    for x in (k_cache, v_cache):
        pool = torch.full((B * per_row + spare, page_size, Hkv, D), float("nan"), dtype=x.dtype, device=x.device)
        padded = torch.cat([x, x.new_zeros(B, per_row * page_size - N, Hkv, D)], dim=1)
        pool[table.long().flatten()] = padded.reshape(B * per_row, page_size, Hkv, D)
        pools.append(pool)
    return pools[0], pools[1], table


def unpage(pool, table):
    """(B, capacity, Hkv, D): the rows of each batch row read back through the block table."""
    return pool[table.long()].flatten(1, 2)


# ----------------------------------------------------------------------------- small serve cases

def nan_past_lengths(rows, lengths, seed, shape):
    """k_cache, v_cache (rows, *shape) float32 on the test device, NaN from each row's length on
    (rows a serve call must not read)."""
    kc = seeded((rows, *shape), torch.float32, seed, DEVICE)
    vc = seeded((rows, *shape), torch.float32, seed + 1, DEVICE)
    for r, n in enumerate(lengths):
        kc[r, n:] = float("nan")
        vc[r, n:] = float("nan")
    return kc, vc


def int32_lengths(values):
    """int32 (len(values),) on the test device (cache_seqlens, cache_leftpad, cache_batch_idx)."""
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def rotary_reference(x, cos, sin, positions, interleaved):
    """x (B, N, H, D) rotated at positions (B, N) (clamped to the tables' rows) in float64 as
    complex products: feature pairs (2i, 2i+1) when interleaved, else (i, i + rotary_dim / 2),
    by the angle whose cos and sin are row `positions` of the tables; returned in x's dtype."""
    half = cos.shape[1]
    positions = positions.clamp(0, cos.shape[0] - 1)
    c, s = cos.double()[positions][:, :, None], sin.double()[positions][:, :, None]
    xr = x.double()[..., :2 * half]
    if interleaved:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2]) * torch.complex(c, s)
        rot = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    else:
        z = torch.complex(xr[..., :half], xr[..., half:]) * torch.complex(c, s)
        rot = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([rot, x.double()[..., 2 * half:]], dim=-1).to(x.dtype)


def serve_doors(variant, segment_lengths, dilation_rates, layout):
    """(fn(q, kc, vc, k=None, v=None, **kw), oracle(causal)) of a serve door: the dilated one
    with the schedule given, or the block-sparse one with `layout` (a BlockLayout covering the
    cache); oracle(causal) is the naive training door on a prefix of n keys."""
    ws, rs = segment_lengths, dilation_rates
    if variant == "dilated":
        return (lambda q, kc, vc, k=None, v=None, **kw: dilated_attention_with_kvcache(
                    q, kc, vc, k, v, segment_lengths=ws, dilation_rates=rs, **kw),
                lambda causal: lambda q_, k_, v_, n: dilated_attention_naive(q_, k_, v_, ws, rs, causal=causal))
    return (lambda q, kc, vc, k=None, v=None, **kw: block_sparse_attention_with_kvcache(q, kc, vc, k, v,
                                                                                       layout=layout, **kw),
            lambda causal: lambda q_, k_, v_, n: block_sparse_attention_naive(
                q_, k_, v_, layout.prefix(-(-n // layout.block_size)), causal=causal))
