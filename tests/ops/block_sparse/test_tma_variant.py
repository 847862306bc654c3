"""The block-sparse forward's TMA variant (config key "TMA": 1; issue 12): K and V key blocks
through tensor descriptors instead of pointer loads. Under the interpreter (and on sm90) it
must match the float64 oracle and give the same bits as the pointer path (TMA = 0): causal
and not, GQA, ragged N, several block sizes and tiles, float32 and float16. Inputs TMA
cannot read (misaligned strides or base, a broadcast head) and GPUs before sm90 fall back
to the pointer path, with the same result; a bad value of the switch is a ValueError."""
from __future__ import annotations

import types

import pytest
import torch

from tests.conftest import DEVICE
from tests.helpers.reference import check_against_oracle, dense_reference, seeded
from triton_dilated import BlockLayout, block_sparse_attention_naive, layouts
from triton_dilated.ops.common.call import AttentionCall
from triton_dilated.ops.common.configs import INTERPRETER_CONFIG
from triton_dilated.ops.block_sparse import kernels
from triton_dilated.ops.block_sparse.naive import element_mask
from triton_dilated.ops.common.hardware import device_arch, fake_arch
from triton_dilated.ops.common.lse import lse_from_stats


def _tma_expected(device) -> bool:
    """Whether the launcher can take the TMA path here: off-GPU (the interpreter) or an arch
    with TMA."""
    dev = torch.device(device)
    return dev.type != "cuda" or device_arch(dev).tma


@pytest.fixture
def descriptors(monkeypatch):
    """Counts the launcher's descriptor builds: proof that TMA = 1 took the TMA path."""
    built = []
    real = kernels._kv_descriptors

    def spy(k, v, block_n, block_d):
        built.append((block_n, block_d))
        return real(k, v, block_n, block_d)
    monkeypatch.setattr(kernels, "_kv_descriptors", spy)
    return built


def _forward(q, k, v, layout, causal, cfg):
    return kernels.block_sparse_forward(q, k, v, layout, AttentionCall(causal, q.shape[-1] ** -0.5), config=cfg)


def _check(q, k, v, layout, causal, cfg):
    """TMA = 1 against the float64 oracle (the tolerance rule, out and lse), and bit for bit
    against TMA = 0 (out, row max, row sum)."""
    N = q.shape[1]
    counts = element_mask(layout, N, causal).double()

    def tma(q, k, v):
        out, row_max, row_sum = _forward(q, k, v, layout, causal, {**cfg, "TMA": 1})
        return out, lse_from_stats(row_max, row_sum)
    check_against_oracle(tma, lambda q, k, v: block_sparse_attention_naive(q, k, v, layout, causal=causal),
                         lambda q, k, v: dense_reference(q, k, v, counts), (q, k, v), grads=False, counts=counts)
    with_tma = _forward(q, k, v, layout, causal, {**cfg, "TMA": 1})
    pointers = _forward(q, k, v, layout, causal, {**cfg, "TMA": 0})
    for name, a, b in zip(("out", "row_max", "row_sum"), with_tma, pointers):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name}: {m}")


def _qkv(B, N, Hq, Hkv, D, dtype, seed=0):
    return tuple(seeded(s, dtype, seed + i, DEVICE) for i, s in enumerate([(B, N, Hq, D), (B, N, Hkv, D),
                                                                              (B, N, Hkv, D)]))


CASES = [  # (N, block size, Hq, Hkv, D, BLOCK_M, BLOCK_N): ragged N everywhere, GQA where Hkv < Hq
    (150, 64, 2, 1, 16, 32, 32),     # two sub-tiles per block
    (100, 32, 2, 2, 32, 32, 32),     # one sub-tile per block
    (70, 16, 2, 1, 16, 16, 16),      # small blocks
    (130, 64, 1, 1, 32, 32, 64),     # BLOCK_N > BLOCK_M: causal sub-tiles end past the tile's last row
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "N{}-bs{}-h{}x{}-d{}-{}x{}".format(*c))
def test_tma_matches_oracle_and_pointer_path(case, causal, dtype, descriptors):
    N, bs, Hq, Hkv, D, bm, bn = case
    nb = -(-N // bs)
    mask = torch.rand(1, Hq, nb, nb, generator=torch.Generator().manual_seed(N)) < 0.6
    mask[..., 0] = True                                   # a key block in every row (and empty ones below)
    mask[0, 0, -1, :] = False                             # the last query block of head 0: no key at all
    layout = BlockLayout.from_dense(mask, bs).to(DEVICE)
    cfg = dict(INTERPRETER_CONFIG, BLOCK_M=bm, BLOCK_N=bn)
    _check(*_qkv(1, N, Hq, Hkv, D, dtype), layout, causal, cfg)
    assert len(descriptors) == (2 if _tma_expected(DEVICE) else 0)   # the oracle run and the bitwise one
    if descriptors:
        assert descriptors[0] == (min(bn, bs), 16 if D <= 16 else 32)


def test_tma_bigbird_two_batches(descriptors):
    """A shared BigBird layout (broadcast over batch and heads), B = 2: the descriptors'
    batch coordinate, and rows past N never read from the next batch."""
    layout = layouts.bigbird(96, 32, window=1, num_global_blocks=1, num_random=1, seed=1, num_heads=2).to(DEVICE)
    for causal in (False, True):
        _check(*_qkv(2, 96, 2, 1, 16, torch.float32, seed=5), layout, causal, dict(INTERPRETER_CONFIG))


def test_causal_tile_ignores_nan_value_past_its_last_row():
    """BLOCK_N = 64 > BLOCK_M = 32 (block 64, causal): the first query tile's only sub-tile
    holds keys 32..63, after its last row. A NaN value there must not reach rows 0..31 (P = 0
    times NaN is NaN): the TMA path zeroes those value rows as the pointer path's masked load
    does. Rows from 40 on read the NaN (rows 32..39 share their tile: the documented spread
    of test_nan_semantics, the same on both paths)."""
    q, k, v = _qkv(1, 64, 1, 1, 16, torch.float32, seed=3)
    v[0, 40, 0, 5] = float("nan")
    layout = BlockLayout.from_dense(torch.ones(1, 1, dtype=torch.bool), 64).to(DEVICE)
    cfg = dict(INTERPRETER_CONFIG, BLOCK_M=32, BLOCK_N=64)
    out, _, _ = _forward(q, k, v, layout, True, {**cfg, "TMA": 1})
    assert torch.isfinite(out[0, :32]).all()
    assert torch.isnan(out[0, 40:]).any(-1).all()
    ref, _, _ = _forward(q, k, v, layout, True, {**cfg, "TMA": 0})
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


def _misaligned_kv(B, N, H, D, dtype):
    """(label, k, v) pairs TMA cannot read: rows of an odd byte length, a base off 16 bytes,
    a head broadcast by expand (stride 0)."""
    k, v = _qkv(B, N, H, H, D, dtype, seed=11)[1:]
    wide = seeded((B, N, H, D + 1), dtype, 12, DEVICE)
    yield "row stride", wide[..., :D], wide[..., 1:]      # D + 1 elements per row
    flat = seeded((B * N * H * D + 1,), dtype, 13, DEVICE)
    yield "base offset", flat[1:].view(B, N, H, D), v     # storage offset of one element
    yield "broadcast head", k[:, :, :1].expand(B, N, H, D), v[:, :, :1].expand(B, N, H, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_misaligned_inputs_fall_back_to_pointer_loads(dtype, descriptors):
    """TMA needs a 16-byte aligned base and strides (unit stride on D): otherwise the launcher
    uses TMA = 0 silently, with the same result (and the oracle's)."""
    B, N, H, D = 1, 72, 2, 16
    q = _qkv(B, N, H, H, D, dtype)[0]
    layout = layouts.bigbird(N, 32, window=1, num_global_blocks=1, num_random=0, num_heads=H).to(DEVICE)
    for label, k, v in _misaligned_kv(B, N, H, D, dtype):
        assert not (kernels.tma_usable(k, 32, 16) and kernels.tma_usable(v, 32, 16)), label
        _check(q, k, v, layout, True, dict(INTERPRETER_CONFIG))
        assert descriptors == [], label


def test_aligned_strided_view_takes_tma(descriptors):
    """A non-contiguous view whose strides are 16-byte multiples (the first 16 of 32 head
    dims, float32: row stride 256 B) is read through descriptors, columns past D left out."""
    wide = _qkv(1, 80, 2, 2, 32, torch.float32, seed=21)
    q, k, v = (x[..., :16] for x in wide)
    assert not k.is_contiguous() and kernels.tma_usable(k, 32, 16)
    layout = layouts.bigbird(80, 32, window=1, num_global_blocks=1, num_random=0, num_heads=2).to(DEVICE)
    _check(q.contiguous(), k, v, layout, False, dict(INTERPRETER_CONFIG))
    assert len(descriptors) == (2 if _tma_expected(DEVICE) else 0)


def _fake_cuda_tensor(t):
    """t's layout, as a tensor on cuda:0 would report it (no GPU needed)."""
    return types.SimpleNamespace(device=torch.device("cuda", 0), element_size=t.element_size,
                                 data_ptr=lambda: 0, stride=t.stride)


@pytest.mark.parametrize("arch,usable", [("sm80", False), ("sm89", False), ("sm90", True), ("sm100", True),
                                         ("sm120", True), ("gfx942", False), ("gfx950", False)])
def test_tma_only_where_the_arch_has_it(monkeypatch, arch, usable):
    """TMA where the architecture table says the arch has it (Hopper on, consumer Blackwell
    too); elsewhere, AMD included (PyTorch on ROCm reports an MI300X as capability (9, 4)),
    the launcher uses the pointer path."""
    monkeypatch.setattr(kernels, "device_arch", lambda device: fake_arch(arch))
    t = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    assert kernels.tma_usable(_fake_cuda_tensor(t), 64, 64) is usable


def test_tma_usable_rules():
    t = torch.zeros(2, 64, 2, 64, dtype=torch.bfloat16)
    assert kernels.tma_usable(t, 64, 64)
    assert not kernels.tma_usable(t, 512, 64)                                  # boxes of at most 256 rows
    assert not kernels.tma_usable(torch.zeros(1, 64, 1, 12, dtype=torch.float16), 32, 16)   # 24-byte rows
    assert kernels.tma_usable(torch.zeros(1, 64, 1, 8, dtype=torch.float16), 32, 16)        # 16-byte rows
    assert not kernels.tma_usable(t.transpose(1, 3), 64, 64)                   # D not the unit stride


@pytest.mark.parametrize("value", [2, -1, "1", 1.0, True, None, "yes"])
def test_bad_tma_switch_is_a_value_error(value):
    q, k, v = _qkv(1, 32, 1, 1, 16, torch.float32)
    layout = BlockLayout.from_dense(torch.ones(1, 1, dtype=torch.bool), 32).to(DEVICE)
    with pytest.raises(ValueError, match=r"config\['TMA'\] of block_sparse_fwd: expected one of \[0, 1\], got "
                       + repr(value).replace(".", r"\.")):
        _forward(q, k, v, layout, False, dict(INTERPRETER_CONFIG, TMA=value))


# WARP_SPEC (issue 20 item 4): the full-block loop as tl.range(..., warp_specialize=True), on
# the descriptor loads (Triton partitions only those). The interpreter runs it as a plain loop
# (what the compiler makes of it is checked by `perf aot`: tests/perf/test_aot.py).

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES[:2] + CASES[3:], ids=lambda c: "N{}-bs{}-h{}x{}-d{}-{}x{}".format(*c))
def test_warp_spec_matches_oracle_and_pointer_path(case, causal, descriptors):
    """WARP_SPEC = 1 (with TMA = 0 in the config) reads K and V through descriptors, matches
    the float64 oracle and gives the pointer path's bits; WARP_SPEC = 0 is the TMA = 0 path."""
    N, bs, Hq, Hkv, D, bm, bn = case
    nb = -(-N // bs)
    mask = torch.rand(1, Hq, nb, nb, generator=torch.Generator().manual_seed(N + 1)) < 0.6
    mask[..., 0] = True
    layout = BlockLayout.from_dense(mask, bs).to(DEVICE)
    q, k, v = _qkv(1, N, Hq, Hkv, D, torch.float16, seed=7)
    cfg = dict(INTERPRETER_CONFIG, BLOCK_M=bm, BLOCK_N=bn)
    counts = element_mask(layout, N, causal).double()

    def warp_spec(q, k, v):
        out, row_max, row_sum = _forward(q, k, v, layout, causal, {**cfg, "WARP_SPEC": 1})
        return out, lse_from_stats(row_max, row_sum)
    check_against_oracle(warp_spec, lambda q, k, v: block_sparse_attention_naive(q, k, v, layout, causal=causal),
                         lambda q, k, v: dense_reference(q, k, v, counts), (q, k, v), grads=False, counts=counts)
    ws_on = _forward(q, k, v, layout, causal, {**cfg, "WARP_SPEC": 1})
    assert len(descriptors) == (2 if _tma_expected(DEVICE) else 0)
    ws_off = _forward(q, k, v, layout, causal, {**cfg, "WARP_SPEC": 0})
    assert len(descriptors) == (2 if _tma_expected(DEVICE) else 0)   # WARP_SPEC = 0, TMA = 0: pointer loads
    for name, a, b in zip(("out", "row_max", "row_sum"), ws_on, ws_off):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("arch", ["sm80", "sm90", "sm100", "sm120", "gfx942", "gfx950"])
def test_warp_spec_switch_only_where_triton_partitions(arch):
    """The switch exists on the archs whose table row says Triton warp-specializes there
    (sm100): there the GPU check's config A/B and `perf tune` time it; elsewhere they do not
    propose it (and the launcher ignores it)."""
    from triton_dilated.ops.common import configs
    fake = fake_arch(arch)
    assert configs.VARIANT_SWITCHES["block_sparse_fwd"]["WARP_SPEC"].available(fake) is (arch == "sm100")
    default = configs.default_config("block_sparse_fwd", 128, fake, torch.bfloat16)
    proposed = [c for c in configs.switch_alternatives("block_sparse_fwd", default, fake) if c.get("WARP_SPEC")]
    assert proposed == ([{**default, "WARP_SPEC": 1}] if arch == "sm100" else [])


@pytest.mark.parametrize("value", [2, "1", True, None])
def test_bad_warp_spec_switch_is_a_value_error(value):
    q, k, v = _qkv(1, 32, 1, 1, 16, torch.float32)
    layout = BlockLayout.from_dense(torch.ones(1, 1, dtype=torch.bool), 32).to(DEVICE)
    with pytest.raises(ValueError, match=r"config\['WARP_SPEC'\] of block_sparse_fwd: expected one of \[0, 1\], got "
                       + repr(value)):
        _forward(q, k, v, layout, False, dict(INTERPRETER_CONFIG, WARP_SPEC=value))
