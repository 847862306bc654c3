"""sequence_parallel_attention: the sequence-parallel front door for DTensors and DeviceMeshes.

torch.distributed.tensor describes "this tensor is sharded along the sequence on this mesh
dimension" (FSDP2 / torchtitan-style code). This module reads that description and calls
ring_attention or ulysses_attention (2-D: Ulysses x ring, USP) with the mesh's process
groups on the local shards, then wraps the result with the inputs' placements. The local
shards are what the two functions take anyway, so nothing is copied: DTensor.to_local and
DTensor.from_local are views, and both are differentiable (their backward converts the
gradient between DTensor and local), so gradients flow to DTensor leaves.

Placements (one per mesh dimension): Shard(1) shards the sequence (those dimensions are the
sequence-parallel ones: one, ring or Ulysses; or two, USP); Shard(0) shards the batch (data
parallel: every batch shard is an independent sequence-parallel group). Anything else
(Replicate, Partial, heads or head_dim sharded, strided shards, uneven sequence shards) is a
ValueError naming the argument.

Shard order on a 2-D mesh: DTensor shards one tensor dimension over several mesh dimensions
outer first, so the rank at mesh coordinate (r, u) of an (R, U) mesh holds chunk r * U + u
of the sequence, which is the layout ulysses_attention's ring_group= takes (Ulysses groups
of U consecutive chunks, the ring over them). So the ring dimension must come before the
Ulysses one in the mesh (the usual placement anyway: Ulysses' all-to-alls on the inner,
intra-node dimension).
"""
from __future__ import annotations

from ..common.validation import check_choice
from .interface import ring_attention
from .ulysses import ulysses_attention

SCHEMES = ("ring", "ulysses", "usp")
SEQ_DIM, BATCH_DIM = 1, 0


def _dtensor_types():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    return DTensor, DeviceMesh, Shard


def _dim_name(mesh, i: int) -> str:
    names = mesh.mesh_dim_names
    return f"{names[i]!r}" if names else str(i)


def _sequence_dims(name, x, Shard) -> tuple[list[int], int]:
    """The mesh dimensions that shard x's sequence (Shard(1)) and the number of sequence
    shards; a ValueError for any other placement than Shard(1) or Shard(0)."""
    mesh, seq = x.device_mesh, []
    for i, p in enumerate(x.placements):
        dim = p.dim % x.dim() if type(p) is Shard else None   # a subclass (strided shard) is not plain
        if dim == SEQ_DIM:
            seq.append(i)
        elif dim != BATCH_DIM:
            raise ValueError(f"{name}: placement {p!r} on mesh dimension {_dim_name(mesh, i)} is not supported: "
                             f"expected Shard(1) (the sequence of (B, N, H, D)) or Shard(0) (the batch)")
    if not seq:
        raise ValueError(f"{name}: no mesh dimension shards the sequence (placements {tuple(x.placements)}): "
                         f"expected Shard(1) on one or two mesh dimensions")
    if len(seq) > 2:
        raise ValueError(f"{name}: the sequence is sharded over {len(seq)} mesh dimensions; at most two are "
                         f"supported (ring, or ring x Ulysses)")
    shards = 1
    for i in seq:
        shards *= mesh.size(i)
    if x.shape[SEQ_DIM] % shards:
        raise ValueError(f"{name}: the sequence length {x.shape[SEQ_DIM]} does not split evenly over the "
                         f"{shards} sequence shards of mesh dimensions {', '.join(_dim_name(mesh, i) for i in seq)} "
                         f"(uneven shards are not supported)")
    return seq, shards


def _roles(mesh, dims, scheme, what) -> tuple[str, dict]:
    """(scheme, {"ring": mesh dim, "ulysses": mesh dim}) for the sequence dims `dims` of
    `mesh`: one dim is a ring or a Ulysses group (`scheme`, or the dim's name "ring" /
    "ulysses"); two are USP, ring first (see the module docstring)."""
    if scheme is not None:
        check_choice("scheme", scheme, SCHEMES)
    names = mesh.mesh_dim_names or ()
    if len(dims) == 1:
        named = names[dims[0]] if names and names[dims[0]] in ("ring", "ulysses") else None
        scheme = scheme or named
        if scheme not in ("ring", "ulysses"):
            raise ValueError(f"scheme: {what} has one sequence-parallel mesh dimension ({_dim_name(mesh, dims[0])}): "
                             f"give scheme='ring' or 'ulysses' (or name the mesh dimension so), got {scheme!r}")
        return scheme, {scheme: dims[0]}
    if scheme not in (None, "usp"):
        raise ValueError(f"scheme: {what} has two sequence-parallel mesh dimensions, which is 'usp' "
                         f"(Ulysses x ring), got {scheme!r}")
    ring, uly = dims
    if names and {names[ring], names[uly]} == {"ring", "ulysses"} and names[ring] != "ring":
        raise ValueError(f"{what}: the mesh dimension 'ring' must come before 'ulysses' (the sequence is sharded "
                         f"outer mesh dimension first, and ulysses_attention's 2-D layout has the Ulysses groups "
                         f"inside the ring); got mesh dimensions {names}")
    return "usp", {"ring": ring, "ulysses": uly}


def _contiguous(shape) -> tuple:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def _check_like(name, x, q, DTensor) -> None:
    if not isinstance(x, DTensor):
        raise TypeError(f"{name} must be a DTensor like q, got {type(x).__name__}")
    if x.device_mesh != q.device_mesh:
        raise ValueError(f"{name} must be on q's device mesh {q.device_mesh}, got {x.device_mesh}")
    if tuple(x.placements) != tuple(q.placements):
        raise ValueError(f"{name} must have q's placements {tuple(q.placements)}, got {tuple(x.placements)}")


def sequence_parallel_attention(q, k, v, *, mesh=None, scheme=None, **kwargs):
    """Sequence-parallel attention over a DeviceMesh: DTensors in, DTensors out.

    q, k, v: DTensors (B, N, H, D) of the full sequence on one mesh with equal placements:
    Shard(1) on the sequence-parallel mesh dimension(s), Shard(0) (batch) on any others.
    Or this rank's local shards (plain tensors) with `mesh=` a 1-D or 2-D DeviceMesh of the
    sequence-parallel dimensions only. Returns out (and lse, with return_lse=True) as
    DTensors with q's placements (lse (B, Hq, N): its sequence dim 2 where q's is 1), or
    local tensors for local inputs.

    scheme: "ring" (ring_attention), "ulysses" (ulysses_attention) or "usp" (two mesh
    dimensions: ulysses_attention with ring_group=). None: from the mesh dimension names
    ("ring", "ulysses"); two sequence dimensions are always "usp", the ring dimension
    first (on an unnamed mesh: dimension order (ring, ulysses)). Every other keyword
    argument goes to the chosen function (segment_lengths, dilation_rates, layout, causal,
    scale, comm, balance, return_lse, backend, ...; see ring_attention and ulysses_attention).

    balance="zigzag" with DTensors: each rank's local shard is read as its zigzag shard
    (shard(x, rank, world, "zigzag")), so the DTensor's global sequence is the zigzag order
    (the order torch's context-parallel load balancer arranges); "contiguous" (default):
    the DTensor's sequence is the sequence itself.
    """
    DTensor, DeviceMesh, Shard = _dtensor_types()
    for taken in ("group", "ring_group"):
        if taken in kwargs:
            raise TypeError(f"sequence_parallel_attention takes mesh= (or DTensors), not {taken}=: the process "
                            f"groups come from the mesh (ring_attention and ulysses_attention take groups)")
    is_d = [isinstance(x, DTensor) for x in (q, k, v)]
    if any(is_d):
        if not is_d[0]:
            raise TypeError(f"q must be a DTensor like k and v, got {type(q).__name__}")
        dims, _ = _sequence_dims("q", q, Shard)
        _check_like("k", k, q, DTensor)
        _check_like("v", v, q, DTensor)
        _sequence_dims("k", k, Shard)
        if mesh is not None and mesh != q.device_mesh:
            raise ValueError(f"mesh must be q's device mesh {q.device_mesh} (or None), got {mesh}")
        mesh = q.device_mesh
        what = f"q's device mesh {tuple(mesh.mesh_dim_names or range(mesh.ndim))}"
    else:
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh (with local shards; or pass DTensors), "
                            f"got {type(mesh).__name__}")
        if mesh.ndim not in (1, 2):
            raise ValueError(f"mesh must have 1 (ring or Ulysses) or 2 (ring x Ulysses) dimensions, got "
                             f"{mesh.ndim}: pass the sequence-parallel sub-mesh, e.g. mesh['cp']")
        dims, what = list(range(mesh.ndim)), f"mesh {tuple(mesh.mesh_dim_names or range(mesh.ndim))}"
    scheme, role = _roles(mesh, dims, scheme, what)

    local = [x.to_local() if d else x for x, d in zip((q, k, v), is_d)]
    if scheme == "ring":
        res = ring_attention(*local, group=mesh.get_group(role["ring"]), **kwargs)
    elif scheme == "ulysses":
        res = ulysses_attention(*local, group=mesh.get_group(role["ulysses"]), **kwargs)
    else:
        res = ulysses_attention(*local, group=mesh.get_group(role["ulysses"]),
                                ring_group=mesh.get_group(role["ring"]), **kwargs)
    if not is_d[0]:
        return res
    out, lse = res if kwargs.get("return_lse") else (res, None)
    out = DTensor.from_local(out, mesh, q.placements, run_check=False, shape=q.shape, stride=_contiguous(q.shape))
    if lse is None:
        return out
    B, N, Hq, _ = q.shape
    # lse (B, Hq, N): the sequence is dim 2
    lse_placements = tuple(Shard(2) if p.dim % q.dim() == SEQ_DIM else p for p in q.placements)
    lse = DTensor.from_local(lse, mesh, lse_placements, run_check=False, shape=(B, Hq, N),
                             stride=_contiguous((B, Hq, N)))
    return out, lse
