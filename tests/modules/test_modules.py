"""nn.Modules (triton_dilated.modules): equivalence with the functions, the
dilated-attention-pytorch interface, validation at construction, state_dict round trips,
torch.compile, sequence parallelism through ring_attention, and the example script."""
from __future__ import annotations

import datetime
import importlib.util
import multiprocessing
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

import triton_dilated
from triton_dilated import BlockLayout, block_sparse_attention, dilated_attention, layouts
from triton_dilated.modules import BlockSparseAttention, DilatedAttention, MultiheadDilatedAttention
from tests.helpers.paths import ROOT
from tests.helpers.reference import seeded

FKODOM_KEYS = {"q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
               "norm.weight", "norm.bias", "out_proj.weight", "out_proj.bias"}


def mhda(**kw):
    args = dict(embed_dim=32, num_heads=4, dilation_rates=[1, 2], segment_lengths=[8, 16], backend="torch")
    args.update(kw)
    return MultiheadDilatedAttention(**args)


# ----------------------------------------------------------------------------- DilatedAttention

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dilated_module_matches_function(device, backend):
    q = seeded((1, 24, 2, 8), torch.float32, 0, device)
    k, v = seeded((1, 24, 1, 8), torch.float32, 1, device), seeded((1, 24, 1, 8), torch.float32, 2, device)
    m = DilatedAttention([8, 24], [1, 2], causal=True, offsets="blocked", scale=0.3, backend=backend)
    kw = dict(causal=True, offsets="blocked", scale=0.3, backend=backend)
    assert torch.equal(m(q, k, v), dilated_attention(q, k, v, [8, 24], [1, 2], **kw))
    out, lse = m(q, k, v, causal=False, return_lse=True)
    ref = dilated_attention(q, k, v, [8, 24], [1, 2], **{**kw, "causal": False}, return_lse=True)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    assert list(m.parameters()) == [] and m.state_dict() == {}
    assert "segment_lengths=[8, 24]" in repr(m)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(segment_lengths=[8, 16], dilation_rates=[1]), ValueError, "same length"),
    (dict(segment_lengths=[0], dilation_rates=[1]), ValueError, "positive"),
    (dict(segment_lengths=8, dilation_rates=[1]), TypeError, "list"),
    (dict(segment_lengths=[8], dilation_rates=[1], mode="groups"), ValueError, "mode"),
    (dict(segment_lengths=[8], dilation_rates=[1], offsets="x"), ValueError, "offsets"),
    (dict(segment_lengths=[8], dilation_rates=[1], causal=1), TypeError, "causal"),
    (dict(segment_lengths=[8], dilation_rates=[1], scale="a"), TypeError, "scale"),
    (dict(segment_lengths=[8], dilation_rates=[1], backend="cuda"), ValueError, "backend"),
])
def test_dilated_module_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        DilatedAttention(**kwargs)


# ----------------------------------------------------------------------------- MultiheadDilatedAttention

def test_mhda_computation_gqa(device):
    """forward == projections -> dilated_attention (GQA) -> sub-LayerNorm -> out_proj, and
    (out, None) as dilated-attention-pytorch returns."""
    m = mhda(num_kv_heads=2, device=device)
    assert m.k_proj.weight.shape == (16, 32) and m.v_proj.weight.shape == (16, 32)
    x = seeded((2, 32, 32), torch.float32, 0, device)
    y = seeded((2, 32, 32), torch.float32, 1, device)
    out, weights = m(x, y, y, is_causal=True)
    assert weights is None and out.shape == (2, 32, 32)
    q = m.q_proj(x).unflatten(-1, (4, 8))
    k, v = m.k_proj(y).unflatten(-1, (2, 8)), m.v_proj(y).unflatten(-1, (2, 8))
    att = dilated_attention(q, k, v, [8, 16], [1, 2], causal=True, backend="torch").flatten(-2)
    assert torch.allclose(out, m.out_proj(m.norm(att)), atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mhda_softcap_sinks_and_documents(device, backend):
    """softcap=, sinks= and forward's cu_seqlens= reach dilated_attention: forward ==
    projections -> dilated_attention(softcap, sinks, cu_seqlens) -> sub-LayerNorm -> out_proj,
    the sinks (attention.sinks, (num_heads,) float32) get a gradient, and a packed document's
    rows equal the module on that document alone."""
    m = mhda(num_kv_heads=2, softcap=5.0, sinks=True, backend=backend, device=device)
    with torch.no_grad():
        m.attention.sinks.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    assert m.attention.sinks.shape == (4,) and m.attention.sinks.device.type == torch.device(device).type
    assert "attention.sinks" in m.state_dict() and "softcap=5.0" in repr(m) and "sinks=4" in repr(m)
    x = seeded((1, 40, 32), torch.float32, 0, device) * 4
    cu = torch.tensor([0, 24, 40], dtype=torch.int32, device=device)
    out, _ = m(x, x, x, is_causal=True, cu_seqlens=cu)
    q = m.q_proj(x).unflatten(-1, (4, 8))
    k, v = m.k_proj(x).unflatten(-1, (2, 8)), m.v_proj(x).unflatten(-1, (2, 8))
    att = dilated_attention(q, k, v, [8, 16], [1, 2], causal=True, backend=backend, softcap=5.0,
                            sinks=m.attention.sinks, cu_seqlens=cu).flatten(-2)
    assert torch.allclose(out, m.out_proj(m.norm(att)), atol=1e-5)
    alone, _ = m(x[:, 24:], x[:, 24:], x[:, 24:], is_causal=True)
    assert torch.allclose(out[:, 24:], alone, atol=1e-5)
    out.sum().backward()
    assert m.attention.sinks.grad is not None and m.attention.sinks.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="softcap and sinks are not available with compat"):
        mhda(compat="dilated-attention-pytorch", sinks=True)
    plain = mhda(compat="dilated-attention-pytorch")
    with pytest.raises(ValueError, match="cu_seqlens is not available with compat"):
        plain(x.cpu(), x.cpu(), x.cpu(), cu_seqlens=cu.cpu())


def test_mhda_causal_ignores_future(device):
    m = mhda(device=device).eval()
    x = seeded((1, 32, 32), torch.float32, 0, device)
    x2 = x.clone()
    x2[:, 20:] = seeded((1, 12, 32), torch.float32, 5, device)
    a, _ = m(x, x, x, is_causal=True)
    b, _ = m(x2, x2, x2, is_causal=True)
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-6)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_mhda_dilated_attention_pytorch_interface():
    """The positional order and keyword names of dilated-attention-pytorch's class, its
    state_dict keys, initialisation (xavier normal, gain gamma_init on v/out, zero
    biases) and switches (bias, layer_norm)."""
    m = MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], 0.0, True, True, 1e-5, 1.0, "cpu", torch.float32)
    assert m.attention.dilation_rates == [1, 2] and m.attention.segment_lengths == [8, 16]
    assert set(m.state_dict()) == FKODOM_KEYS
    assert all((p.bias == 0).all() for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj))
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(embed_dim=64, num_heads=4, dilation_rates=[1], segment_lengths=[16], dropout=0.1,
                                  bias=False, layer_norm=False, layer_norm_eps=1e-6, gamma_init=0.0, device=None,
                                  dtype=torch.float64)
    assert m.norm is None and m.q_proj.bias is None and m.q_proj.weight.dtype == torch.float64
    assert set(m.state_dict()) == {"q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight"}
    assert (m.v_proj.weight == 0).all() and (m.out_proj.weight == 0).all()       # gain 0
    std = m.q_proj.weight.std().item()                                            # xavier: sqrt(2 / (64 + 64))
    assert 0.1 < std < 0.15


def test_mhda_state_dict_round_trip(tmp_path):
    torch.manual_seed(0)
    a = mhda(num_kv_heads=2)
    torch.manual_seed(1)
    b = mhda(num_kv_heads=2)
    x = seeded((1, 16, 32), torch.float32, 3)
    assert not torch.allclose(a(x, x, x)[0], b(x, x, x)[0])
    torch.save(a.state_dict(), tmp_path / "m.pt")
    b.load_state_dict(torch.load(tmp_path / "m.pt"))
    assert torch.equal(a(x, x, x)[0], b(x, x, x)[0])
    with pytest.raises(RuntimeError, match="size mismatch"):   # GQA changes the k/v projection shapes
        mhda(num_kv_heads=4).load_state_dict(a.state_dict())


def test_mhda_dropout_on_out_proj_input():
    torch.manual_seed(0)
    m = mhda(dropout=0.5)
    ref = mhda(dropout=0.0)
    ref.load_state_dict(m.state_dict())
    x = seeded((1, 16, 32), torch.float32, 3)
    m.eval()
    assert torch.equal(m(x, x, x)[0], ref(x, x, x)[0])
    m.train()
    torch.manual_seed(5)
    a = m(x, x, x)[0]
    att = m.norm(m.attention(m.q_proj(x).unflatten(-1, (4, 8)), m.k_proj(x).unflatten(-1, (4, 8)),
                             m.v_proj(x).unflatten(-1, (4, 8))).flatten(-2))
    torch.manual_seed(5)
    expected = m.out_proj(nn.functional.dropout(att, 0.5, training=True))
    assert torch.allclose(a, expected, atol=1e-6)
    assert not torch.allclose(a, ref(x, x, x)[0])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(embed_dim=30), ValueError, "divisible by num_heads"),
    (dict(num_heads=0), ValueError, "num_heads"),
    (dict(num_heads=4.0), TypeError, "num_heads"),
    (dict(embed_dim="32"), TypeError, "embed_dim"),
    (dict(num_kv_heads=3), ValueError, "divisible by num_kv_heads"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
    (dict(dilation_rates=[1, 2, 4]), ValueError, "same length"),
    (dict(segment_lengths=[8, -16]), ValueError, "positive"),
    (dict(dilation_rates=(1.5, 2)), TypeError, "ints"),
    (dict(dropout=1.0), ValueError, "dropout"),
    (dict(dropout=-0.1), ValueError, "dropout"),
    (dict(dropout="0.1"), TypeError, "dropout"),
    (dict(dropout=True), TypeError, "dropout"),
    (dict(bias=1), TypeError, "bias"),
    (dict(layer_norm="yes"), TypeError, "layer_norm"),
    (dict(layer_norm_eps=0.0), ValueError, "layer_norm_eps"),
    (dict(gamma_init=float("nan")), ValueError, "gamma_init"),
    (dict(embed_dim=1028, num_heads=2), ValueError, "256"),
    (dict(num_heads=1, mode="head_groups"), ValueError, "head per pattern"),
    (dict(mode="dilated"), ValueError, "mode"),
    (dict(offsets="random"), ValueError, "offsets"),
    (dict(backend="xla"), ValueError, "backend"),
    (dict(comm="nccl"), ValueError, "comm"),
    (dict(balance="striped"), ValueError, "balance"),
    (dict(sequence_parallel="tensor"), ValueError, "sequence_parallel"),
    (dict(group=object(), backend="torch"), ValueError, "group"),
])
def test_mhda_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        mhda(**kwargs)


def test_mhda_forward_validation():
    m = mhda()
    x = torch.randn(1, 16, 32)
    with pytest.raises(ValueError, match="embed_dim=32"):
        m(x[..., :16], x, x)
    with pytest.raises(ValueError, match="embed_dim"):
        m(x[0], x[0], x[0])
    with pytest.raises(ValueError, match="seq_len"):
        m(x, x[:, :8], x[:, :8])
    with pytest.raises(TypeError, match="is_causal"):
        m(x, x, x, is_causal=None)


def test_mhda_group_without_ring_attention(monkeypatch):
    m = mhda(group=object(), backend="auto")
    monkeypatch.delattr(triton_dilated, "ring_attention", raising=False)
    x = torch.randn(1, 16, 32)
    with pytest.raises(RuntimeError, match="ring_attention"):
        m(x, x, x)


# softcap, sinks and packed documents (cu_seqlens over the full sequence) through the ring / Ulysses
EXTRAS = {"plain": ({}, None), "softcap-sinks-docs": (dict(softcap=5.0, sinks=True), [0, 12, 32])}


def _sequence_parallel_worker(rank, world, init_file, queue, scheme, extras):
    try:
        from triton_dilated import shard
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(0)
        kw, cu = EXTRAS[extras]
        m = mhda(num_kv_heads=2, group=dist.group.WORLD, backend="auto", sequence_parallel=scheme, **kw)
        _set_sinks(m)
        x = seeded((1, 32, 32), torch.float32, 1)
        g = seeded((1, 32, 32), torch.float32, 2)
        xl = shard(x, rank, world).clone().requires_grad_()
        cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        out, _ = m(xl, xl, xl, is_causal=True, cu_seqlens=cu)
        (out * shard(g, rank, world)).sum().backward()
        grads = [p.grad.clone() for p in m.parameters()]
        for gr in grads:
            dist.all_reduce(gr)
        as_np = lambda t: t.detach().numpy().copy()  # noqa: E731  (by value: no shared-memory handles)
        queue.put((rank, "ok", (as_np(out), as_np(xl.grad), [as_np(gr) for gr in grads])))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))


def _set_sinks(m):
    if m.attention.sinks is not None:
        with torch.no_grad():
            m.attention.sinks.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))


@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("scheme", ["ring", "ulysses"])
def test_mhda_sequence_parallel_matches_single_device(scheme, extras):
    """group=: two gloo ranks, each with half the sequence, give the single-device result
    (outputs, input gradients, all-reduced parameter gradients, the sinks' included), through
    the ring or Ulysses; also with softcap, sinks and packed documents."""
    world = 2
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "rendezvous")
    procs = [ctx.Process(target=_sequence_parallel_worker, args=(r, world, init_file, queue, scheme, extras))
             for r in range(world)]
    # the children run the portable ring (the ring kernels under the interpreter are
    # tested in test_ring.py; this test is about the module's plumbing)
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = saved
    results, deadline = {}, time.monotonic() + 240
    try:
        for _ in procs:
            rank, status, payload = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            assert status == "ok", payload
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
    torch.manual_seed(0)
    kw, cu = EXTRAS[extras]
    ref = mhda(num_kv_heads=2, **kw)
    _set_sinks(ref)
    x = seeded((1, 32, 32), torch.float32, 1).requires_grad_()
    out, _ = ref(x, x, x, is_causal=True, cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32))
    (out * seeded((1, 32, 32), torch.float32, 2)).sum().backward()
    for rank in range(world):
        sl = slice(rank * 16, (rank + 1) * 16)
        r_out, r_dx, r_grads = results[rank]
        r_out, r_dx, r_grads = torch.from_numpy(r_out), torch.from_numpy(r_dx), [torch.from_numpy(a) for a in r_grads]
        assert torch.allclose(r_out, out[:, sl].detach(), atol=1e-5)
        assert torch.allclose(r_dx, x.grad[:, sl], atol=1e-5)
        for a, p in zip(r_grads, ref.parameters()):
            assert torch.allclose(a, p.grad, atol=1e-4)


def test_mhda_compile_fullgraph():
    """torch.compile(fullgraph=True) of the module (custom ops inside), forward and backward."""
    torch._dynamo.reset()
    m = mhda(num_kv_heads=2)
    x = seeded((2, 32, 32), torch.float32, 0).requires_grad_()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    a, _ = m(x, x, x, is_causal=True)
    b, _ = compiled(x, x, x, is_causal=True)
    assert torch.allclose(a, b, atol=1e-6)
    ga = torch.autograd.grad(a.square().sum(), [x, *m.parameters()])
    gb = torch.autograd.grad(b.square().sum(), [x, *m.parameters()])
    for u, w in zip(ga, gb):
        assert torch.allclose(u, w, atol=1e-5)


# ----------------------------------------------------------------------------- BlockSparseAttention

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_block_sparse_module_fixed_layout(device, backend):
    layout = layouts.local(40, 16, 1)
    m = BlockSparseAttention(layout, causal=True, scale=0.4, backend=backend).to(device)
    q = seeded((1, 40, 2, 8), torch.float32, 0, device)
    k = seeded((1, 40, 1, 8), torch.float32, 1, device)
    expected = block_sparse_attention(q, k, k, layout, causal=True, scale=0.4, backend=backend)
    assert torch.equal(m(q, k, k), expected)
    assert m.state_dict() == {}                       # configuration, not state
    assert m.kv_indices.device == q.device and torch.equal(m.layout.to_dense(), layout.to_dense().to(q.device))
    out, lse = m(q, k, k, causal=False, return_lse=True)
    assert torch.equal(lse, block_sparse_attention(q, k, k, layout, scale=0.4, backend=backend, return_lse=True)[1])


def test_block_sparse_module_builders():
    calls = []

    def by_len(n):
        calls.append(n)
        return layouts.local(n, 16, 1)

    m = BlockSparseAttention(by_len, backend="torch")
    for n in (32, 32, 48):
        q = seeded((1, n, 2, 8), torch.float32, n)
        assert torch.equal(m(q, q, q), block_sparse_attention(q, q, q, layouts.local(n, 16, 1), backend="torch"))
    assert calls == [32, 48]                          # cached per sequence length
    k = seeded((1, 48, 2, 8), torch.float32, 1)
    q = k[:, -5:]                                     # q shorter than k (DESIGN §5b): the layout is k's
    assert torch.equal(m(q, k, k), block_sparse_attention(q, k, k, layouts.local(48, 16, 1), backend="torch"))
    assert calls == [32, 48]

    seen = []

    def by_content(q, k):
        seen.append(q.requires_grad)
        return layouts.topk(q, k, top_k=1, block_size=16, causal=True)

    m = BlockSparseAttention(by_content, causal=True, backend="torch", builder_input="qk")
    q = seeded((1, 48, 2, 8), torch.float32, 0).requires_grad_()
    out = m(q, q, q)
    out.sum().backward()
    expected = block_sparse_attention(q, q, q, layouts.topk(q, q, top_k=1, block_size=16, causal=True), causal=True,
                                      backend="torch")
    assert torch.equal(out, expected) and seen == [False] and q.grad is not None
    m(q, q, q)
    assert len(seen) == 2                             # rebuilt on every call


def test_block_sparse_module_layout_cache_is_bounded():
    """A seq_len builder keeps the cache_size most recently used layouts, not one per length
    forever: an evicted length is rebuilt, a recently used one is not."""
    calls = []

    def by_len(n):
        calls.append(n)
        return layouts.local(n, 16, 1)

    m = BlockSparseAttention(by_len, backend="torch", cache_size=2)
    for n in (16, 32, 16, 48, 16, 32):
        q = seeded((1, n, 1, 8), torch.float32, n)
        assert torch.equal(m(q, q, q), block_sparse_attention(q, q, q, layouts.local(n, 16, 1), backend="torch"))
    # 16 built; 32 built; 16 hit; 48 built, evicts 32 (least recent); 16 hit; 32 rebuilt, evicts 48
    assert calls == [16, 32, 48, 32]
    assert [key[0] for key in m._cache] == [16, 32]
    m = BlockSparseAttention(by_len, backend="torch")
    calls.clear()
    for n in range(16, 16 * 40, 16):
        m(*(seeded((1, n, 1, 8), torch.float32, 0),) * 3)
    assert len(m._cache) == 8 and len(calls) == 39
    m = BlockSparseAttention(by_len, backend="torch", cache_size=0)
    calls.clear()
    q = seeded((1, 32, 1, 8), torch.float32, 0)
    m(q, q, q), m(q, q, q)
    assert calls == [32, 32] and len(m._cache) == 0
    with pytest.raises(ValueError, match="cache_size must be a non-negative int, got -1"):
        BlockSparseAttention(by_len, cache_size=-1)


def test_block_sparse_module_validation():
    with pytest.raises(TypeError, match="BlockLayout or a callable"):
        BlockSparseAttention(torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="builder_input"):
        BlockSparseAttention(layouts.local(32, 16), builder_input="qk")
    with pytest.raises(ValueError, match="builder_input"):
        BlockSparseAttention(lambda n: None, builder_input="q")
    with pytest.raises(ValueError, match="backend"):
        BlockSparseAttention(layouts.local(32, 16), backend="gpu")
    with pytest.raises(TypeError, match="causal"):
        BlockSparseAttention(layouts.local(32, 16), causal="no")
    q = torch.randn(1, 32, 2, 8)
    with pytest.raises(TypeError, match="must return a BlockLayout"):
        BlockSparseAttention(lambda n: torch.ones(2, 2), backend="torch")(q, q, q)
    with pytest.raises(ValueError, match="blocks"):    # layout for another length
        BlockSparseAttention(layouts.local(64, 16), backend="torch")(q, q, q)
    assert isinstance(BlockSparseAttention(lambda n: layouts.local(n, 16)).layout, type(None))
    assert isinstance(BlockSparseAttention(layouts.local(32, 16)).layout, BlockLayout)


def test_block_sparse_module_compile_fullgraph():
    torch._dynamo.reset()
    m = BlockSparseAttention(layouts.local(48, 16, 1, causal=True), causal=True, backend="torch")
    q = seeded((1, 48, 2, 8), torch.float32, 0).requires_grad_()
    a = m(q, q, q)
    b = torch.compile(m, backend="aot_eager", fullgraph=True)(q, q, q)
    assert torch.allclose(a, b, atol=1e-6)
    assert torch.allclose(torch.autograd.grad(a.sum(), q)[0], torch.autograd.grad(b.sum(), q)[0], atol=1e-6)


# ----------------------------------------------------------------------------- example

def test_train_longnet_example_smoke(capsys):
    spec = importlib.util.spec_from_file_location("train_longnet", ROOT / "examples" / "train_longnet.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    threads = torch.get_num_threads()
    try:
        losses = example.main(["--steps", "30", "--batch", "8", "--half", "16", "--dim", "32", "--layers", "1",
                               "--heads", "2", "--kv-heads", "1", "--segment-lengths", "8", "32",
                               "--dilation-rates", "1", "2", "--backend", "torch", "--device", "cpu",
                               "--log-every", "10", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert len(losses) == 30 and all(map(lambda x: x == x, losses))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    assert "copy loss" in capsys.readouterr().out
