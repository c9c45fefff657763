"""Merging the chunks of a split decode list: partial outputs combined by their lse, the sink applied once.

A split decode call (attention/decode.py) runs each query's entry list as `splits` chunks, i.e. as
splits x more rows of one attention launch; chunk c of query i is row i * splits + c. One Triton launch
merges them: out = sum_c w_c o_c / sum_c w_c with w_c = 2^(lse_c - max lse), lse = log2(sum_c 2^lse_c),
then out *= 1 / (1 + exp(sink - lse)). Numerics: fp32 (partials read as fp32 whatever their dtype).
An empty chunk (lse +inf) weighs 0; all chunks empty: out 0, lse +inf. A NaN chunk stays NaN.
On SM90 it uses programmatic dependent launch (waits for the attention kernel before touching memory).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..platform import dependent_launch, require_interpretable_numpy


@triton.jit
def _apply_sink(out, lse_base2, sink):
    """out [BLOCK_H, D] * exp(lse) / (exp(lse) + exp(sink)), lse in base 2, in the sigmoid form
    sigmoid(lse * ln2 - sink) evaluated through exp(-|z|) <= 1: no overflow for |lse|, |sink| up to
    1e4 and beyond; sink -inf -> factor 1, +inf -> 0; empty rows (lse +inf) keep factor 1 (out is 0)."""
    empty = lse_base2 == float("inf")
    z = tl.where(empty, 0.0, lse_base2) * 0.6931471805599453 - sink
    small = tl.exp(-tl.abs(z))
    factor = tl.where(z >= 0, 1.0 / (1.0 + small), small / (1.0 + small))
    factor = tl.where(empty, 1.0, factor)
    return out * factor[:, None]


@triton.jit
def _merge_splits_kernel(parts_ptr, parts_stride_row, parts_stride_h, lse_parts_ptr, lse_parts_stride_row,
                         lse_parts_stride_h, sink_ptr, sink_stride, out_ptr, lse_ptr, splits, heads,
                         HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, DV: tl.constexpr,
                         DEPENDENT_LAUNCH: tl.constexpr):
    if DEPENDENT_LAUNCH:  # wait for the attention kernel before touching memory; let the next one launch
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_heads = h < heads
    cols = tl.arange(0, DV)
    first = row.to(tl.int64) * splits
    top = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for c in range(0, splits):
        part_lse = tl.load(lse_parts_ptr + (first + c) * lse_parts_stride_row + h * lse_parts_stride_h,
                           mask=in_heads, other=float("inf"))
        top = tl.maximum(top, tl.where(part_lse == float("inf"), float("-inf"), part_lse))  # empty chunk: -inf
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    for c in range(0, splits):
        part_lse = tl.load(lse_parts_ptr + (first + c) * lse_parts_stride_row + h * lse_parts_stride_h,
                           mask=in_heads, other=float("inf"))
        weight = tl.exp2(tl.where(part_lse == float("inf"), float("-inf"), part_lse) - top)
        part = tl.load(parts_ptr + (first + c) * parts_stride_row + h[:, None] * parts_stride_h + cols[None, :],
                       mask=in_heads[:, None], other=0.0).to(tl.float32)
        total += weight
        acc += weight[:, None] * part
    # total is 0 only when every chunk is empty; NaN (a NaN score in some chunk) stays NaN in lse and out
    lse = tl.where(total != 0, tl.log2(tl.where(total != 0, total, 1.0)) + top, float("inf"))
    acc = acc / tl.where(total != 0, total, 1.0)[:, None]
    if HAS_SINK:
        acc = _apply_sink(acc, lse, tl.load(sink_ptr + h * sink_stride, mask=in_heads, other=0.0))
    tl.store(out_ptr + (row.to(tl.int64) * heads + h[:, None]) * DV + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=in_heads[:, None])
    tl.store(lse_ptr + row.to(tl.int64) * heads + h, lse, mask=in_heads)


def merge_splits(out_parts: torch.Tensor, lse_parts: torch.Tensor, splits: int, attn_sink: torch.Tensor | None,
                 out_dtype: torch.dtype, out: torch.Tensor | None = None):
    """out_parts [n*S, H, Dv] (chunk c of query i at row i*S + c), lse_parts [n*S, H] base 2 (+inf:
    empty chunk) -> (out [n, H, Dv] in out_dtype, lse [n, H] base 2), merged by lse in fp32, the sink
    applied once. One launch. out: a validated contiguous [n, H, Dv] buffer in out_dtype to write, None:
    a new one."""
    rows, heads, d_v = out_parts.shape
    if d_v & (d_v - 1) or out_parts.stride(2) != 1:
        raise ValueError(f"out_parts: expected a contiguous power-of-two last dim, got shape "
                         f"{tuple(out_parts.shape)} strides {out_parts.stride()}")
    n = rows // splits
    if out is None:
        out = torch.empty((n, heads, d_v), dtype=out_dtype, device=out_parts.device)
    lse = torch.empty((n, heads), dtype=torch.float32, device=out_parts.device)
    block_h = 8
    if not out.is_cuda:
        require_interpretable_numpy("_merge_splits_kernel")
    dependent = dependent_launch(out_parts.device)
    _merge_splits_kernel[(n, triton.cdiv(heads, block_h))](
        out_parts, out_parts.stride(0), out_parts.stride(1), lse_parts, lse_parts.stride(0), lse_parts.stride(1),
        lse_parts if attn_sink is None else attn_sink, 0 if attn_sink is None else attn_sink.stride(0), out, lse,
        splits, heads,
        HAS_SINK=attn_sink is not None, BLOCK_H=block_h, DV=d_v, DEPENDENT_LAUNCH=dependent, num_warps=4,
        launch_pdl=dependent)
    return out, lse
