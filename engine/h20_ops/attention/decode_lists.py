"""The entry lists a decode launch reads, built on the GPU in one Triton launch per call.

A decode call (attention/decode.py) hands each query row r = b * s_q + j a main list (slot ids of the
main cache, indices[b, j], valid iff 0 <= id < n_slots0 and position < topk_length[b]) and optionally an
extra list (slot ids of the extra cache, likewise with extra_topk_length). The attention kernels take ONE
list per row, padded with -1 to `splits * chunk` entries, so this launch writes, per row:
  SLOTS mode (paged fp8 kernel; one dense cache read in place): main slot | extra slot + n_slots0 | -1;
  POSITIONS mode (rows gathered into a buffer of L = topk + etopk rows per query row): r * L + p for a
    valid entry at position p, -1 otherwise; and the masked slot ids [n, L] (-1: invalid) the gathers read.
Every invalid entry becomes -1 BEFORE any offset is added, so no filler can land on a valid row.
With a split (splits > 1) the same launch also writes the query rows repeated: row r * splits + c of a
new dense [n * splits, h_q, d] is q[r] (the TileLang kernels read q by TMA and need it dense).
On SM90 it uses programmatic dependent launch: it waits for the previous kernel before touching memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..platform import dependent_launch, require_interpretable_numpy

INT32_MAX = torch.iinfo(torch.int32).max


@triton.jit
def _entries(idx_row, pos, k, length_ptr, b, n_slots, HAS_LENGTH: tl.constexpr):
    """(slot id, valid) of positions pos of one list of k entries into a cache of n_slots slots."""
    in_list = (pos >= 0) & (pos < k)
    slot = tl.load(idx_row + pos, mask=in_list, other=-1)
    valid = in_list & (slot >= 0) & (slot < n_slots)
    if HAS_LENGTH:
        valid = valid & (pos < tl.load(length_ptr + b))
    return slot, valid


@triton.jit
def _decode_lists_kernel(list_ptr, list_len, slots_ptr, s_q,
                         idx_ptr, idx_stride_b, idx_stride_s, topk, len_ptr, n_slots0,
                         eidx_ptr, eidx_stride_b, eidx_stride_s, etopk, elen_ptr, n_slots1,
                         list_programs, q_ptr, q_stride_row, q_stride_h, q_stride_d, q_split_ptr, q_numel, splits,
                         HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_ELEN: tl.constexpr,
                         POSITIONS: tl.constexpr, BLOCK: tl.constexpr, COPY_Q: tl.constexpr, D: tl.constexpr,
                         Q_BLOCK: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """Program (row, j), j < list_programs: positions [j * BLOCK, (j + 1) * BLOCK) of the row's list;
    j >= list_programs (COPY_Q, a split): elements [k * Q_BLOCK, (k + 1) * Q_BLOCK) of q's row, k =
    j - list_programs, copied to the row's `splits` rows of q_split."""
    if DEPENDENT_LAUNCH:  # wait for the previous kernel before touching memory; let the attention kernel launch
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    if COPY_Q:
        if tl.program_id(1) >= list_programs:
            e = (tl.program_id(1) - list_programs) * Q_BLOCK + tl.arange(0, Q_BLOCK)
            in_row = e < q_numel
            values = tl.load(q_ptr + row.to(tl.int64) * q_stride_row + (e // D) * q_stride_h + (e % D) * q_stride_d,
                             mask=in_row)
            for c in range(0, splits):
                tl.store(q_split_ptr + (row.to(tl.int64) * splits + c) * q_numel + e, values, mask=in_row)
            return
    b = row // s_q
    s = row % s_q
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot, valid = _entries(idx_ptr + b.to(tl.int64) * idx_stride_b + s * idx_stride_s, pos, topk, len_ptr, b,
                           n_slots0, HAS_LEN)
    offset = tl.zeros([BLOCK], tl.int32)
    width = topk
    if HAS_EXTRA:  # main entries, then extra entries, then -1 padding up to splits * chunk
        extra_slot, extra_valid = _entries(eidx_ptr + b.to(tl.int64) * eidx_stride_b + s * eidx_stride_s,
                                           pos - topk, etopk, elen_ptr, b, n_slots1, HAS_ELEN)
        is_main = pos < topk
        slot = tl.where(is_main, slot, extra_slot)
        valid = tl.where(is_main, valid, extra_valid)
        offset = tl.where(is_main, 0, n_slots0)
        width = topk + etopk
    if POSITIONS:
        entries = tl.where(valid, row * width + pos, -1)
        tl.store(slots_ptr + row.to(tl.int64) * width + pos, tl.where(valid, slot, -1), mask=pos < width)
    else:
        entries = tl.where(valid, slot + offset, -1)  # invalid -> -1 BEFORE the offset: no filler moves
    tl.store(list_ptr + row.to(tl.int64) * list_len + pos, entries, mask=pos < list_len)


def build_decode_lists(indices: torch.Tensor, topk_length, n_slots0: int, extra_indices, extra_topk_length,
                       n_slots1: int, list_len: int, *, positions: bool, q_rows: torch.Tensor | None = None,
                       splits: int = 1):
    """One launch (see the module header). indices [B, s_q, topk] / extra_indices [B, s_q, etopk] int32 slot
    ids, lengths [B] int32 or None (validated by the caller). Returns (lists [B * s_q, list_len] int32,
    masked slots [B * s_q, topk + etopk] int32 (POSITIONS mode) or None, q_split [B * s_q * splits, h_q, d]
    or None)."""
    batch, s_q, topk = indices.shape
    n = batch * s_q
    has_extra = extra_indices is not None
    etopk = extra_indices.size(2) if has_extra else 0
    width = topk + etopk
    if positions and n * width > INT32_MAX:
        raise ValueError(f"indices: {n} query rows x {width} entries exceed int32 buffer rows")
    if not positions and n_slots0 + n_slots1 > INT32_MAX:
        raise ValueError(f"cache, extra_cache: {n_slots0} + {n_slots1} slots exceed int32 slot ids")
    # the kernel reads index rows and lengths with unit stride (a copy only for exotic strides)
    indices, extra_indices, topk_length, extra_topk_length = (
        None if t is None else (t if t.stride(-1) == 1 else t.contiguous())
        for t in (indices, extra_indices, topk_length, extra_topk_length))
    device = indices.device
    lists = torch.empty((n, list_len), dtype=torch.int32, device=device)
    slots = torch.empty((n, width), dtype=torch.int32, device=device) if positions else None
    eidx = extra_indices if has_extra else indices
    block, q_block = 128, 4096
    list_programs = triton.cdiv(max(list_len, width), block)
    copy_q = splits > 1
    if copy_q:
        q_split = torch.empty((n * splits, *q_rows.shape[1:]), dtype=q_rows.dtype, device=device)
        q_numel, q_strides, d = q_rows[0].numel(), q_rows.stride(), q_rows.size(2)
    else:  # placeholders: the kernel's q copy is compiled out
        q_rows, q_split, q_numel, q_strides, d = lists, None, 0, (0, 0, 0), 1
    q_programs = triton.cdiv(q_numel, q_block)
    if copy_q and not lists.is_cuda:  # the q copy loops over the splits
        require_interpretable_numpy("build_decode_lists")
    dependent = dependent_launch(device)
    _decode_lists_kernel[(n, list_programs + q_programs)](
        lists, list_len, lists if slots is None else slots, s_q,
        indices, indices.stride(0), indices.stride(1), topk, indices if topk_length is None else topk_length,
        n_slots0, eidx, eidx.stride(0), eidx.stride(1), etopk,
        indices if extra_topk_length is None else extra_topk_length, n_slots1,
        list_programs, q_rows, *q_strides, lists if q_split is None else q_split, q_numel, splits,
        HAS_LEN=topk_length is not None, HAS_EXTRA=has_extra, HAS_ELEN=extra_topk_length is not None,
        POSITIONS=positions, BLOCK=block, COPY_Q=copy_q, D=d, Q_BLOCK=q_block, DEPENDENT_LAUNCH=dependent,
        num_warps=4, launch_pdl=dependent)
    return lists, slots, q_split
