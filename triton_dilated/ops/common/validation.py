"""Input checks shared by every variant: clear TypeError/ValueError naming the argument."""
from __future__ import annotations

import operator

import numpy as np
import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def check_choice(name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def check_qkv_tensors(q, k, v, *, allow_float64: bool = False) -> None:
    """q, k, v: 4-D tensors (B, N, H, D) of one supported dtype (float64 too with
    allow_float64: the oracles) on one device. Shapes across them are the caller's."""
    dtypes = SUPPORTED_DTYPES + ((torch.float64,) if allow_float64 else ())
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, N, H, D), got shape {tuple(x.shape)}")
        if x.dtype not in dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise TypeError(f"{name} must have one of the dtypes {names}, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q={q.device}, k={k.device}, v={v.device}")


def check_qkv(q, k, v, *, allow_float64: bool = False, allow_shorter_q: bool = False, door: str = "") -> None:
    """Shapes per DESIGN §2: q (B, N, Hq, D), k/v (B, N, Hkv, D), Hq % Hkv == 0.
    The float64 oracles also take float64 (allow_float64); with allow_shorter_q, q may have
    Nq <= N rows, the last Nq positions of the sequence (DESIGN §5b). `door`: the training
    door's name, which the error for different lengths points to its serve door from."""
    check_qkv_tensors(q, k, v, allow_float64=allow_float64)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={tuple(k.shape)}, v={tuple(v.shape)}")
    (B, N, Hq, D), (Bk, Nk, Hkv, Dk) = q.shape, k.shape
    if Bk != B:
        raise ValueError(f"k and v must have the batch size of q ({B}), got {Bk}")
    if allow_shorter_q and Nk < N:
        raise ValueError(f"q must not be longer than k and v (the queries are the last Nq positions of the "
                         f"sequence k and v hold): got Nq = {N} > Nk = {Nk}")
    if not allow_shorter_q and Nk != N:
        serve = (f"; queries at the end of longer keys (a KV cache, chunked prefill): {door}_with_kvcache"
                 if door and Nk > N else "")
        raise ValueError(f"k and v must have the sequence length of q ({N}), got {Nk}{serve}")
    if Dk != D:
        raise ValueError(f"k and v must have the head dim of q ({D}), got {Dk}")
    if D < 1 or D > MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {MAX_HEAD_DIM}], got {D}")
    if Hq < 1:
        raise ValueError(f"q must have at least one head, got {Hq}")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a positive multiple of key/value heads ({Hkv})")


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not (scale == scale and abs(scale) != float("inf")):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _bound_words(minimum) -> str:
    return {1: "positive ", 0: "non-negative "}.get(minimum, "")


def check_int(name: str, value, minimum=None) -> int:
    """A Python or numpy integer (or a 0-d integer tensor) -> int, >= minimum when given.
    Bools are refused (True is not a count). The one vocabulary of every integer argument:
    TypeError "{name} must be an int, got <type>", ValueError "{name} must be a positive
    int" / "a non-negative int" / ">= minimum", "got <value>"."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be an int, got a bool ({value!r})")
    try:
        out = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})") from None
    if minimum is not None and out < minimum:
        words = _bound_words(minimum)
        bound = f"a {words}int" if words else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {out}")
    return out


def check_int_list(name: str, values, minimum=1) -> list[int]:
    """A non-empty sequence of integers >= minimum -> list of int: a list, tuple or range of
    Python/numpy ints, or a 1-D integer numpy array or tensor. Bools and strings are
    refused."""
    words = _bound_words(minimum) or f">= {minimum} "
    if isinstance(values, (torch.Tensor, np.ndarray)):
        is_tensor = isinstance(values, torch.Tensor)
        kind = "a tensor" if is_tensor else "an array"
        if values.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got {kind} of shape {tuple(values.shape)}")
        is_int = (not values.dtype.is_floating_point and not values.dtype.is_complex and values.dtype != torch.bool
                  if is_tensor else np.issubdtype(values.dtype, np.integer))
        if not is_int:
            raise TypeError(f"{name} must hold ints, got {kind} of {values.dtype}")
        values = values.tolist()
    if not isinstance(values, (list, tuple, range)):
        raise TypeError(f"{name} must be a list or tuple of {words}ints (or a range, 1-D numpy array or tensor), "
                        f"got {type(values).__name__}")
    if len(values) == 0:
        raise ValueError(f"{name} must not be empty")
    out = []
    for x in values:
        if isinstance(x, (bool, np.bool_)):
            raise TypeError(f"{name} must hold ints, got a bool ({x!r})")
        try:
            xi = operator.index(x)
        except TypeError:
            raise TypeError(f"{name} must hold ints, got {x!r} ({type(x).__name__})") from None
        if xi < minimum:
            raise ValueError(f"{name} must hold {words}ints, got {xi}")
        out.append(xi)
    return out


def check_positive_int_list(name: str, values) -> list[int]:
    """check_int_list with minimum 1."""
    return check_int_list(name, values, minimum=1)


def check_bool(name: str, value) -> bool:
    """A real bool (causal=1 or return_lse="yes" are errors)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_flags(**flags) -> None:
    """Each keyword must be a real bool."""
    for name, flag in flags.items():
        check_bool(name, flag)


def check_cu_seqlens(cu_seqlens, batch: int, seq_len: int):
    """cu_seqlens (packed variable-length documents) -> a tuple of document bounds
    (0, ..., N), or None."""
    if cu_seqlens is None:
        return None
    bounds = tuple(check_int_list("cu_seqlens", cu_seqlens, minimum=0))
    if batch != 1:
        raise ValueError(f"cu_seqlens packs documents into one sequence: the batch size must be 1, got {batch}")
    if bounds[0] != 0 or bounds[-1] != seq_len or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0, end at the sequence length ({seq_len}) and not decrease, "
                         f"got {list(bounds)}")
    return bounds


def check_lengths_tensor(cache_seqlens, batch: int, device_note: str = "") -> None:
    """cache_seqlens is an int32 (or int64) tensor of shape (batch,): its type, dtype and shape
    only (no value read)."""
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be an int32 tensor of shape (B,) = ({batch},){device_note}, got "
                        f"{type(cache_seqlens).__name__}")
    if cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cache_seqlens must be an int32 (or int64) tensor, got {cache_seqlens.dtype}")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"cache_seqlens must have shape (B,) = ({batch},), got {tuple(cache_seqlens.shape)}")
