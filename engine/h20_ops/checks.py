"""Argument validation shared by the sparse MLA reference, kernels and entry points.

Every check raises TypeError (wrong type/dtype) or ValueError (wrong shape, device, value) with
the argument's name and what was expected, so bad input never reaches a kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# h_q per rank: the model's 64 or 128 heads, or a tensor-parallel rank's share of them (the triton and ref
# backends; the ref backend's oracle takes any h_q)
SUPPORTED_HEADS = (8, 16, 32, 64, 128)
TILELANG_HEADS = (64, 128)  # the TileLang kernels' (64 heads per CTA)
SUPPORTED_D_QK = (512, 576)
SUPPORTED_D_V = (512,)


def require_tensor(name: str, t, *, dtypes: tuple[torch.dtype, ...], ndim: int | tuple[int, ...],
                   dtype_note: str | None = None) -> None:
    """dtype_note: why only these dtypes, appended to the dtype error."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        note = f" ({dtype_note})" if dtype_note else ""
        raise TypeError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}{note}, got {t.dtype}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if t.dim() not in ndims:
        raise ValueError(f"{name}: expected {' or '.join(map(str, ndims))} dims, got shape {tuple(t.shape)}")


def require_same_device(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name}: expected device {ref.device} (same as {ref_name}), got {t.device}")


def require_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.size(-1) > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {t.stride()}")


def check_out(name: str, out, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """A caller's output buffer: a contiguous tensor of exactly `shape` and `dtype` on `device`, its data
    pointer 16-byte aligned (the kernels write it in place; the TileLang kernels store it by TMA, which
    needs that alignment: one rule whichever kernel runs)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (q's), got {out.dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(out.shape)}")
    if out.device != device:
        raise ValueError(f"{name}: expected device {device} (same as q), got {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {out.stride()}")
    if out.data_ptr() % 16:
        raise ValueError(f"{name}: expected a 16-byte aligned data pointer (stored by TMA), got data_ptr % 16 = "
                         f"{out.data_ptr() % 16}")


def require_scale(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a python float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name}: expected a finite positive float, got {value}")
    return value


@dataclass(frozen=True)
class SparseMlaShape:
    s_q: int
    h_q: int
    d_qk: int
    s_kv: int
    topk: int
    d_v: int


def check_sparse_mla_args(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale,
    d_v: int,
    attn_sink: torch.Tensor | None,
    topk_length: torch.Tensor | None,
    *,
    q_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
    q_dtype_note: str | None = None,
    limit_shapes: bool = True,
    names: dict[str, str] | None = None,
) -> tuple[SparseMlaShape, torch.Tensor]:
    """Validate the prefill operator's arguments; returns the shape and indices as [s_q, topk].

    q [s_q, h_q, d_qk]; kv [s_kv, 1, d_qk]; indices [s_q, topk] or [s_q, 1, topk] int32;
    attn_sink [h_q] float32; topk_length [s_q] int32. `q_dtype_note` says why q must have one of
    `q_dtypes` (in the dtype error). `limit_shapes` restricts h_q / d_qk / d_v to
    the model shapes the kernels are built for (the reference accepts any). `names` maps these
    argument names to the caller's (an entry point's errors name its own arguments).
    """
    names = names or {}

    def n(arg: str) -> str:
        return names.get(arg, arg)

    require_tensor(n("q"), q, dtypes=q_dtypes, ndim=3, dtype_note=q_dtype_note)
    require_tensor(n("kv"), kv, dtypes=(q.dtype,), ndim=3)
    require_tensor(n("indices"), indices, dtypes=(torch.int32,), ndim=(2, 3))
    require_same_device(n("q"), q, **{n("kv"): kv, n("indices"): indices, n("attn_sink"): attn_sink,
                                      n("topk_length"): topk_length})
    sm_scale = require_scale(n("sm_scale"), sm_scale)
    s_q, h_q, d_qk = q.shape
    s_kv, h_kv, d_kv = kv.shape
    if h_kv != 1:
        raise ValueError(f"{n('kv')}: expected 1 kv head (shape [s_kv, 1, d_qk]), got shape {tuple(kv.shape)}")
    if d_kv != d_qk:
        raise ValueError(f"{n('kv')}: expected last dim {d_qk} ({n('q')}'s d_qk), got {d_kv}")
    if indices.dim() == 3:
        if indices.size(1) != 1:
            raise ValueError(f"{n('indices')}: expected shape [s_q, topk] or [s_q, 1, topk], "
                             f"got {tuple(indices.shape)}")
        indices = indices[:, 0, :]
    if indices.size(0) != s_q:
        raise ValueError(f"{n('indices')}: expected {s_q} rows ({n('q')}'s s_q), got shape {tuple(indices.shape)}")
    topk = indices.size(1)
    if topk < 1:
        raise ValueError(f"{n('indices')}: expected topk >= 1, got shape {tuple(indices.shape)}")
    if limit_shapes:
        if h_q not in SUPPORTED_HEADS:
            raise ValueError(f"{n('q')}: expected h_q in {SUPPORTED_HEADS}, got {h_q}")
        if d_qk not in SUPPORTED_D_QK:
            raise ValueError(f"{n('q')}: expected d_qk in {SUPPORTED_D_QK}, got {d_qk}")
    if isinstance(d_v, bool) or not isinstance(d_v, int):
        raise TypeError(f"{n('d_v')}: expected an int, got {type(d_v).__name__}")
    if not 1 <= d_v <= d_qk:
        raise ValueError(f"{n('d_v')}: expected 1 <= d_v <= d_qk ({d_qk}), got {d_v}")
    if limit_shapes:
        if d_v not in SUPPORTED_D_V:
            raise ValueError(f"{n('d_v')}: expected one of {SUPPORTED_D_V}, got {d_v}")
        for arg, t in (("q", q), ("kv", kv), ("indices", indices)):
            require_last_dim_contiguous(n(arg), t)
    check_sink(attn_sink, h_q, n("attn_sink"), n("q"))
    if topk_length is not None:
        require_tensor(n("topk_length"), topk_length, dtypes=(torch.int32,), ndim=1)
        if topk_length.size(0) != s_q:
            raise ValueError(f"{n('topk_length')}: expected shape [{s_q}] ({n('q')}'s s_q), "
                             f"got {tuple(topk_length.shape)}")
    return SparseMlaShape(s_q, h_q, d_qk, s_kv, topk, d_v), indices


def check_sink(attn_sink, h_q: int, name: str = "attn_sink", q_name: str = "q") -> None:
    if attn_sink is not None:
        require_tensor(name, attn_sink, dtypes=(torch.float32,), ndim=1)
        if attn_sink.size(0) != h_q:
            raise ValueError(f"{name}: expected shape [{h_q}] ({q_name}'s h_q), got {tuple(attn_sink.shape)}")


@dataclass(frozen=True)
class DecodeCache:
    """What a decode cache is: paged fp8 (`layout`: kv_cache.MODEL1 / V32) or dense rows (layout None)."""

    layout: object | None  # kv_cache.Fp8KvLayout
    n_slots: int
    block_size: int  # 1 for dense rows
    d_qk: int  # the width of its rows (dequantized)


def check_decode_cache(name: str, cache, q: torch.Tensor, layouts) -> DecodeCache:
    """cache: a paged fp8 cache uint8 / float8_e4m3fn [num_blocks, block_size, 1, bytes_per_token] of one of
    `layouts`, or dense rows [n_slots, 1, d] in q's dtype; q [B, s_q, h_q, d] already checked."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cache).__name__}")
    require_same_device("q", q, **{name: cache})
    if cache.dtype in (torch.uint8, torch.float8_e4m3fn):
        by_bytes = {layout.bytes_per_token: layout for layout in layouts}
        if cache.dim() != 4 or cache.size(2) != 1 or cache.size(3) not in by_bytes:
            raise ValueError(f"{name}: expected a paged fp8 cache [num_blocks, block_size, 1, bytes_per_token in "
                             f"{sorted(by_bytes)}] ({', '.join(l.name for l in layouts)}), got shape {tuple(cache.shape)}")
        if cache.size(0) < 1 or cache.size(1) < 1:
            raise ValueError(f"{name}: expected num_blocks >= 1 and block_size >= 1, got shape {tuple(cache.shape)}")
        layout = by_bytes[cache.size(3)]
        # the layout's rules (engine.h20_ops.kv_cache.fp8): whole tokens contiguous, blocks that do not
        # overlap, fp32 scales / bf16 RoPE words 4-byte aligned in every block
        if cache.stride(3) != 1 or cache.stride(1) != layout.bytes_per_token:
            raise ValueError(f"{name}: expected token stride {layout.bytes_per_token} and a contiguous last dim "
                             f"({layout.name}), got strides {cache.stride()}")
        if cache.size(0) > 1 and cache.stride(0) < cache.size(1) * layout.bytes_per_token:
            raise ValueError(f"{name}: block stride {cache.stride(0)} overlaps blocks of {cache.size(1)} tokens "
                             f"({layout.bytes_per_token} B each)")
        if cache.stride(0) % 4 or cache.data_ptr() % 4:
            raise ValueError(f"{name}: expected a 4-byte aligned base and block stride, got data_ptr % 4 = "
                             f"{cache.data_ptr() % 4}, strides {cache.stride()}")
        if q.size(3) != layout.d:
            raise ValueError(f"q: expected d_qk {layout.d} ({name} holds {layout.name} rows), got shape "
                             f"{tuple(q.shape)}")
        return DecodeCache(layout, cache.size(0) * cache.size(1), cache.size(1), layout.d)
    if cache.dtype != q.dtype:
        raise TypeError(f"{name}: expected dtype {q.dtype} (q's; dense rows) or torch.uint8 (a paged fp8 cache), "
                        f"got {cache.dtype}")
    if cache.dim() != 3 or cache.size(1) != 1 or cache.size(2) != q.size(3) or cache.size(0) < 1:
        raise ValueError(f"{name}: expected dense rows [n_slots >= 1, 1, {q.size(3)}], got shape {tuple(cache.shape)}")
    require_last_dim_contiguous(name, cache)
    return DecodeCache(None, cache.size(0), 1, q.size(3))


def check_decode_list(idx_name: str, indices, len_name: str, lengths, q: torch.Tensor) -> int:
    """indices [B, s_q, topk >= 1] int32 and lengths [B] int32 (or None) of a decode call with q
    [B, s_q, h_q, d]; returns topk."""
    b, s_q = q.shape[:2]
    require_tensor(idx_name, indices, dtypes=(torch.int32,), ndim=3)
    require_same_device("q", q, **{idx_name: indices, len_name: lengths})
    if indices.size(0) != b or indices.size(1) != s_q or indices.size(2) < 1:
        raise ValueError(f"{idx_name}: expected shape [{b}, {s_q}, topk>=1], got {tuple(indices.shape)}")
    if lengths is not None:
        require_tensor(len_name, lengths, dtypes=(torch.int32,), ndim=1)
        if lengths.size(0) != b:
            raise ValueError(f"{len_name}: expected shape [{b}] (one per request), got {tuple(lengths.shape)}")
    return indices.size(2)
