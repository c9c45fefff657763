"""The engine's attention entry points: packed varlen sparse prefill and batched sparse decode.

Both get their kernel only from the dispatcher (engine.h20_ops.attention.dispatch.sparse_mla_fwd: one
operator, out in q's dtype, lse in BASE 2) and launch it exactly once per call.

Decode adapter. The kernel has no batch axis and takes absolute rows of one kv tensor; each request
has its own window [W rows] (and, for DeepSeek-V4 compressed layers, an extra window [E rows] of
compressed entries, attended in the SAME softmax). Request b's rows become rows b*R .. b*R + W (+E)
of one [rows, 1, D] strided view of the caller's buffer, R = the buffer's per-request row stride:
  - one cache: kv_windows viewed in place (no copy) when its request stride is a whole number of
    rows, e.g. a [B, W, 1, D] tensor or buf[:, :W] of a [B, W+E, 1, D] buffer;
  - two caches: no copy when extra_kv_windows starts right after the window inside the same buffer
    (the engine's layout: kv_windows = buf[:, :W], extra_kv_windows = buf[:, W:]); otherwise the two
    are concatenated once into a new [B, W+E, 1, D] tensor (a documented copy).
Each query gets one index list: its main entries, then its extra entries, shifted to absolute rows
by one Triton launch (_build_rows_kernel). An entry is valid iff 0 <= idx < W (E for extra) and its
position < topk_length[b] (extra_topk_length[b]); every other entry becomes -1 BEFORE shifting, so
an invalid value can never land on another request's row. The kernel therefore needs no topk_length.

Flash-decoding split: when B * s_q * ceil(H / 64) programs leave SPLIT_SMS_PER_PROGRAM SMs each, each
query's index list is cut into S chunks of whole pairs of 64-entry blocks (the kernels' step) that run
as S x more query rows of the same single launch (q rows repeated S times, written by the build
launch: the TileLang kernels read q by TMA and need it dense). One Triton launch
(_merge_splits_kernel) merges the partial (out, lse base 2) by lse and applies the sink once
(_apply_sink); without a split the kernel applies the sink.
Launches per decode call: build rows, attention (+ merge with a split); the Triton backend's
adapter adds one elementwise launch that converts its natural-log lse to base 2. On SM90 the build
and merge launches (and the paged fp8 kernel) use programmatic dependent launch: each waits for the
kernel before it (griddepcontrol.wait) before touching memory, so its launch overlaps that kernel's end.

Paged fp8 decode (decode_attn_sparse_paged_fp8, TileLang backend only): the same entries, but the
kernel reads the rows from the paged fp8 MODEL1 caches itself; the same build launch turns each
query's window-local and extra indices into slot ids of the two caches through the requests' slot
tables (extra ones offset by the first cache's slot count; invalid entries, empty slots and slots
outside a cache become -1), then one kernel launch; the same split and merge.

Numerics: the attention kernel's (bf16 operands, fp32 accumulation); merge and sink in fp32.
Deliberate deviation from FlashMLA's split-KV: the partial outputs come back from the dispatcher in
q's dtype (bf16), so a split result carries one more bf16 rounding of each partial
(|err| <= 2^-9 * sum_i w_i |o_i| with round-to-nearest); the tests allow one bf16 ulp of each partial
and of the result, 2^-8 * (sum_i w_i |o_i| + |o|), which also covers the Triton interpreter's
truncating casts (tests/test_attn_sm90.py, split_rounding_bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..platform import dependent_launch, require_interpretable_numpy, sm_count
from .. import kv_cache
from . import dispatch
from ..checks import (SUPPORTED_HEADS, check_decode_args, check_paged_decode_args, require_scale,
                                   require_tensor)

D_V = 512
HEADS_PER_PROGRAM = 64  # the kernels' head tile
# The SM90 kernels walk a query's entries in pairs of 64-entry blocks, so split chunks are cut in
# whole pairs (a 64-entry chunk costs as much as a 128-entry one).
SPLIT_GRANULE = 128
# The automatic split engages when every program (query row, 64 heads) has at least this many SMs to
# itself, and cuts each list into the fewest chunks that reach the fewest pairs per chunk while all
# chunks fill at most SPLIT_MAX_SM_SHARE of the SMs (more items than that contend for the row loads and
# lose). Measured with CUDA graphs on an H200 (2026-11-30, docs/decode.md, 640 entries per query): the
# buffer path gains from 1 to 8 programs and at 16 breaks even (TileLang) or gains 1.11x (Triton); the
# paged fp8 kernel, whose single item takes longer, gains up to 32 programs and loses from 40 on.
SPLIT_SMS_PER_PROGRAM = 8
PAGED_SPLIT_SMS_PER_PROGRAM = 4
SPLIT_MAX_SM_SHARE = 0.75
_Q_DTYPES = (torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------
# prefill
# ---------------------------------------------------------------------------------------------

# The operator's argument names -> prefill_attn_varlen_sparse's (its errors name its own arguments).
_PREFILL_ARG_NAMES = {"q": "query", "kv": "kv_a_with_mqa", "indices": "index_topk", "sm_scale": "softmax_scale",
                      "topk_length": "index_length"}

def prefill_attn_varlen_sparse(query, kv_a_with_mqa, index_topk, softmax_scale, attn_sink=None,
                               index_length=None):
    """Packed varlen sparse prefill. query [total_q, H, D]; kv_a_with_mqa [total_k, 1, D];
    index_topk [total_q, topk] int32, absolute rows of kv_a_with_mqa; attn_sink [H] fp32 | None;
    index_length [total_q] int32 | None. Returns out [total_q, H, 512] in query's dtype."""
    require_tensor("query", query, dtypes=_Q_DTYPES, ndim=3)
    require_tensor("index_topk", index_topk, dtypes=(torch.int32,), ndim=2)
    if query.size(2) < D_V:
        raise ValueError(f"query: expected D >= {D_V} (the output is the first {D_V} columns of kv_a_with_mqa), "
                         f"got shape {tuple(query.shape)}")
    # The indices carry causality (the indexer only selects positions a query may see), so the
    # kernel runs non-causal: bounding by row index instead would mask valid rows of a packed batch
    # and collapse layers to NaN. The dispatcher checks the rest, naming this function's arguments.
    out, _lse = dispatch.sparse_mla_fwd(query, kv_a_with_mqa, index_topk, softmax_scale, d_v=D_V,
                                          attn_sink=attn_sink, topk_length=index_length,
                                          arg_names=_PREFILL_ARG_NAMES)
    return out


# ---------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------

def decode_attn_sparse(q, kv_windows, indices, softmax_scale, *, attn_sink=None, topk_length=None,
                       extra_kv_windows=None, extra_indices=None, extra_topk_length=None,
                       num_splits: int | None = None):
    """Batched sparse decode over per-request windows (and an optional extra cache), one launch.

    q [B, s_q, H, D]; kv_windows [B, W, 1, D]; indices [B, s_q, topk] int32, window-local;
    attn_sink [H] fp32; topk_length [B] int32; extra_kv_windows [B, E, 1, D] with extra_indices
    [B, s_q, etopk] and extra_topk_length [B]. num_splits: chunks per query's index list
    (None: chosen from the batch size vs the SM count; 1: no split).
    Returns (out [B, s_q, H, 512] in q's dtype, lse [B, s_q, H] fp32 base 2; +inf for empty rows).
    """
    softmax_scale = require_scale("softmax_scale", softmax_scale)
    _check_decode_args(q, kv_windows, indices, attn_sink, topk_length, extra_kv_windows, extra_indices,
                       extra_topk_length)
    kv_rows, request_stride = _flat_kv_rows(kv_windows, extra_kv_windows)

    def build(out_len, q_rows, splits):
        return _build_rows(indices, topk_length, kv_windows.size(1), extra_indices, extra_topk_length,
                           None if extra_kv_windows is None else extra_kv_windows.size(1), out_len,
                           request_stride=request_stride, q_rows=q_rows, splits=splits)

    def launch(q_rows, lists, sink):
        return dispatch.sparse_mla_fwd(q_rows, kv_rows, lists, softmax_scale, d_v=D_V, attn_sink=sink)

    return _launch_decode(q, indices, extra_indices, attn_sink, num_splits, SPLIT_SMS_PER_PROGRAM, build, launch)


def _launch_decode(q, indices, extra_indices, attn_sink, num_splits, sms_per_program, build, launch):
    """What both decode entry points share: the split (num_splits, or chosen from the batch size vs the
    SM count with sms_per_program), the entry lists build(out_len, q_rows, splits) -> ([B * s_q, out_len]
    int32: main entries, extra entries, -1 padding to splits * chunk; with splits > 1 also q_rows
    repeated, [B * s_q * splits, H, D]), and one kernel launch(q_rows, lists, sink) -> (out, lse base 2);
    with a split, chunk c of query i is kernel row i * splits + c, the kernel gets no sink, and one
    merge launch combines the chunks by lse and applies the sink once."""
    batch, s_q, heads, _ = q.shape
    n = batch * s_q
    list_len = indices.size(2) + (0 if extra_indices is None else extra_indices.size(2))
    if num_splits is None:
        splits = _choose_splits(n, heads, list_len, q.device, sms_per_program)
    else:
        splits = _check_splits(num_splits)
    chunk = -(-list_len // splits)
    q_rows = q.flatten(0, 1)  # [n, H, D]; a view whenever q's strides allow
    lists, q_split = build(splits * chunk, q_rows, splits)  # [n, splits * chunk], [n * splits, H, D]
    if splits == 1:
        out, lse = launch(q_rows, lists, attn_sink)
    else:
        out_parts, lse_parts = launch(q_split, lists.view(n * splits, chunk), None)
        out, lse = _merge_splits(out_parts, lse_parts, splits, attn_sink)
    return out.view(batch, s_q, heads, D_V), lse.view(batch, s_q, heads)


def decode_attn_sparse_paged_fp8(q, cache, slots, indices, softmax_scale, *, attn_sink=None, topk_length=None,
                                 extra_cache=None, extra_slots=None, extra_indices=None, extra_topk_length=None,
                                 num_splits: int | None = None):
    """Batched sparse decode reading paged fp8 MODEL1 caches directly (no bf16 window buffer): the
    dispatcher's paged fp8 kernel (TileLang backend only, dispatch.paged_fp8_supported()).

    q [B, s_q, H, 512] bf16; cache [num_blocks, block_size, 1, 584] uint8 (kv_cache.MODEL1); slots [B, W]
    int (request b's window row w is the cache's slot slots[b, w]; < 0: empty); indices [B, s_q, topk]
    int32, window-local (an entry is valid iff 0 <= idx < W, its position < topk_length[b] and its slot is
    a slot of the cache); extra_cache / extra_slots [B, E] / extra_indices [B, s_q, etopk] /
    extra_topk_length [B]: the compressed cache likewise, attended in the same softmax. num_splits: as
    decode_attn_sparse's (the automatic choice splits up to more programs: PAGED_SPLIT_SMS_PER_PROGRAM).
    Launches: one Triton launch turns both index lists into slot ids of the two caches (extra ones offset
    by the first cache's slot count; with a split it also writes the repeated q rows), one kernel launch
    (+ the merge with a split).
    Returns (out [B, s_q, H, 512] bf16, lse [B, s_q, H] fp32 base 2; +inf for empty rows)."""
    softmax_scale = require_scale("softmax_scale", softmax_scale)
    _require_decode_q(q, (torch.bfloat16,))
    if q.size(2) not in SUPPORTED_HEADS or q.size(3) != kv_cache.MODEL1.d:
        raise ValueError(f"q: expected shape [B, s_q, H in {SUPPORTED_HEADS}, {kv_cache.MODEL1.d}] (MODEL1 rows), "
                         f"got {tuple(q.shape)}")
    check_paged_decode_args(q, cache, slots, indices, attn_sink, topk_length, extra_cache, extra_slots,
                            extra_indices, extra_topk_length, bytes_per_token=kv_cache.MODEL1.bytes_per_token)
    has_extra = extra_cache is not None
    n_slots = (cache.size(0) * cache.size(1), extra_cache.size(0) * extra_cache.size(1) if has_extra else 0)

    def build(out_len, q_rows, splits):
        return _build_rows(indices, topk_length, slots.size(1), extra_indices, extra_topk_length,
                           extra_slots.size(1) if has_extra else None, out_len, slots=slots,
                           extra_slots=extra_slots, n_slots=n_slots, q_rows=q_rows, splits=splits)

    def launch(q_rows, lists, sink):
        return dispatch.sparse_mla_paged_fp8_fwd(q_rows, cache, extra_cache, lists, softmax_scale, attn_sink=sink,
                                                   cache_names=("cache", "extra_cache"))

    return _launch_decode(q, indices, extra_indices, attn_sink, num_splits, PAGED_SPLIT_SMS_PER_PROGRAM, build,
                          launch)


def _check_decode_args(q, kv_windows, indices, attn_sink, topk_length, extra_kv_windows, extra_indices,
                       extra_topk_length) -> None:
    _require_decode_q(q, _Q_DTYPES)
    check_decode_args(q, kv_windows, indices, attn_sink, topk_length, extra_kv_windows, extra_indices,
                      extra_topk_length, kv_name="kv_windows", extra_kv_name="extra_kv_windows")
    # The kernel views the windows as rows of one strided tensor: at least one row, contiguous rows.
    for name, kv in (("kv_windows", kv_windows), ("extra_kv_windows", extra_kv_windows)):
        if kv is not None and kv.size(1) < 1:
            raise ValueError(f"{name}: expected at least one row per request, got shape {tuple(kv.shape)}")
        if kv is not None and kv.stride(3) != 1:
            raise ValueError(f"{name}: the last dim must be contiguous, got strides {kv.stride()}")


def _require_decode_q(q, dtypes) -> None:
    require_tensor("q", q, dtypes=dtypes, ndim=4)
    if q.size(0) < 1 or q.size(1) < 1 or q.size(2) < 1:
        raise ValueError(f"q: expected at least one request, one query token and one head, got shape {tuple(q.shape)}")
    if q.size(3) < D_V:
        raise ValueError(f"q: expected D >= {D_V} (the output is the first {D_V} columns of the kv rows), "
                         f"got shape {tuple(q.shape)}")


def _check_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits: expected an int or None, got {type(num_splits).__name__}")
    if num_splits < 1:
        raise ValueError(f"num_splits: expected >= 1, got {num_splits}")
    return num_splits


def _rows_view(base: torch.Tensor, request_stride: int, rows_per_request: int) -> torch.Tensor:
    """[B*stride - (stride - rows_per_request), 1, D] view over base's storage, no copy."""
    total = (base.size(0) - 1) * request_stride + rows_per_request
    return torch.as_strided(base, (total, 1, base.size(3)), (base.stride(1), base.stride(2), 1))


def _request_stride_rows(kv: torch.Tensor, rows_needed: int) -> int | None:
    """kv's per-request stride in rows, when rows are evenly spaced across requests, else None."""
    if kv.size(0) == 1:
        return rows_needed
    row, request = kv.stride(1), kv.stride(0)
    if row < kv.size(3) or request % row != 0 or request // row < rows_needed:
        return None
    return request // row


def _flat_kv_rows(kv_windows: torch.Tensor, extra_kv_windows: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """All requests' rows as one [rows, 1, D] tensor and the per-request row stride R
    (request b's window at rows b*R.., its extra rows at b*R + W..)."""
    width = kv_windows.size(1)
    if extra_kv_windows is None:
        if width == 1:
            # The stride of a size-1 dim carries no layout (torch may leave any value there, even after
            # .contiguous()): request b's one row is stride(0) elements after request b - 1's.
            request, _, *rest = kv_windows.stride()
            kv_windows = kv_windows.as_strided(kv_windows.shape, (request, request, *rest))
        stride = _request_stride_rows(kv_windows, width)
        if stride is None:  # rows not evenly spaced: one copy into a dense [B, W, 1, D]
            kv_windows, stride = kv_windows.contiguous(), width
        return _rows_view(kv_windows, stride, width), stride
    rows = width + extra_kv_windows.size(1)
    if _extra_follows_window(kv_windows, extra_kv_windows):
        stride = _request_stride_rows(kv_windows, rows)
        if stride is not None:
            return _rows_view(kv_windows, stride, rows), stride
    # The caches live in separate buffers: concatenate once (a copy of both windows).
    return _rows_view(torch.cat([kv_windows, extra_kv_windows], dim=1), rows, rows), rows


def _extra_follows_window(kv: torch.Tensor, extra: torch.Tensor) -> bool:
    """extra is the rows right after kv's window in the same buffer, with the same strides."""
    if kv.untyped_storage().data_ptr() != extra.untyped_storage().data_ptr():
        return False
    if kv.stride(0) != extra.stride(0) or kv.stride(1) != extra.stride(1):
        return False
    return extra.data_ptr() == kv.data_ptr() + kv.size(1) * kv.stride(1) * kv.element_size()


@triton.jit
def _list_entries(idx_row, pos, k, length_ptr, b, limit, base, table_row, n_slots,
                  HAS_LENGTH: tl.constexpr, HAS_TABLE: tl.constexpr):
    """Entries pos of one index list of k entries: base + idx (a row of the kv buffer) or, with a slot
    table, base + table_row[idx] (a slot id of a paged cache, valid only if that slot is in [0, n_slots));
    -1 for an invalid entry and for a position outside [0, k)."""
    in_list = (pos >= 0) & (pos < k)
    idx = tl.load(idx_row + pos, mask=in_list, other=-1).to(tl.int64)
    valid = in_list & (idx >= 0) & (idx < limit)
    if HAS_LENGTH:
        valid = valid & (pos < tl.load(length_ptr + b))
    if HAS_TABLE:
        idx = tl.load(table_row + tl.where(valid, idx, 0), mask=valid, other=-1).to(tl.int64)
        valid = valid & (idx >= 0) & (idx < n_slots)
    # invalid -> -1 BEFORE the shift: no filler can become another request's row
    return tl.where(valid, idx + base, -1)


@triton.jit
def _build_rows_kernel(out_ptr, out_len, s_q, request_stride,
                       idx_ptr, idx_stride_b, idx_stride_s, topk, len_ptr, width, table_ptr, table_stride, n_slots,
                       eidx_ptr, eidx_stride_b, eidx_stride_s, etopk, elen_ptr, extra, etable_ptr, etable_stride,
                       en_slots, list_programs, q_ptr, q_stride_row, q_stride_h, q_stride_d, q_split_ptr, q_numel,
                       splits,
                       HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_ELEN: tl.constexpr,
                       HAS_TABLE: tl.constexpr, BLOCK: tl.constexpr, COPY_Q: tl.constexpr, D: tl.constexpr,
                       Q_BLOCK: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """Program (row, j), j < list_programs: positions [j * BLOCK, (j + 1) * BLOCK) of query row's list;
    j >= list_programs (COPY_Q, a split): elements [k * Q_BLOCK, (k + 1) * Q_BLOCK) of q's row, k =
    j - list_programs, copied to the row's splits rows of q_split."""
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
    if HAS_TABLE:  # slot ids: the first cache's as they are, the extra cache's after them
        base = tl.zeros([], tl.int64)
        extra_base = base + n_slots
    else:  # rows of the kv buffer: request b's window at b * R, its extra rows right after
        base = b.to(tl.int64) * request_stride
        extra_base = base + width
    entries = _list_entries(idx_ptr + b.to(tl.int64) * idx_stride_b + s * idx_stride_s, pos, topk, len_ptr, b,
                            width, base, table_ptr + b.to(tl.int64) * table_stride, n_slots, HAS_LEN, HAS_TABLE)
    if HAS_EXTRA:  # main entries, then extra entries, then -1 padding up to splits * chunk
        extra_entries = _list_entries(eidx_ptr + b.to(tl.int64) * eidx_stride_b + s * eidx_stride_s, pos - topk,
                                      etopk, elen_ptr, b, extra, extra_base,
                                      etable_ptr + b.to(tl.int64) * etable_stride, en_slots, HAS_ELEN, HAS_TABLE)
        entries = tl.where(pos < topk, entries, extra_entries)
    tl.store(out_ptr + row.to(tl.int64) * out_len + pos, entries.to(tl.int32), mask=pos < out_len)


def _build_rows(indices, topk_length, width, extra_indices, extra_topk_length, extra, out_len, *,
                request_stride=0, slots=None, extra_slots=None, n_slots=(0, 0), q_rows=None, splits=1):
    """One launch: per query, [main entries | extra entries | -1 padding] as int32 [B * s_q, out_len]:
    absolute rows of the kv buffer (request b's window at b * request_stride, extra rows after it), or
    with slot tables (slots [B, W], extra_slots [B, E]) slot ids of two paged caches of n_slots =
    (n0, n1) slots (extra ones offset by n0; empty slots and slots outside a cache are invalid).
    With splits > 1, the same launch also writes q_rows [B * s_q, H, D] repeated: row i * splits + c
    of a new dense [B * s_q * splits, H, D] is q_rows[i]. Returns (entries, that tensor or None)."""
    batch, s_q, topk = indices.shape
    has_table = slots is not None
    # the kernel reads index rows, lengths and table rows with unit stride (a copy only for exotic strides)
    indices, extra_indices, topk_length, extra_topk_length, slots, extra_slots = (
        None if t is None else (t if t.stride(-1) == 1 else t.contiguous())
        for t in (indices, extra_indices, topk_length, extra_topk_length, slots, extra_slots))
    if has_table and n_slots[0] + n_slots[1] > torch.iinfo(torch.int32).max:
        raise ValueError(f"cache, extra_cache: {n_slots[0]} + {n_slots[1]} slots exceed int32 slot ids")
    if not has_table and (batch - 1) * request_stride + width + (extra or 0) > torch.iinfo(torch.int32).max:
        raise ValueError(f"kv_windows: {batch} requests x {request_stride} rows exceed int32 row indices")
    out = torch.empty((batch * s_q, out_len), dtype=torch.int32, device=indices.device)
    has_extra = extra_indices is not None
    eidx = extra_indices if has_extra else indices
    table = slots if has_table else indices
    etable = extra_slots if has_table and has_extra else table
    block, q_block = 128, 4096
    list_programs = triton.cdiv(out_len, block)
    copy_q = splits > 1
    if copy_q:
        q_split = torch.empty((batch * s_q * splits, *q_rows.shape[1:]), dtype=q_rows.dtype, device=q_rows.device)
        q_numel, q_strides, d = q_rows[0].numel(), q_rows.stride(), q_rows.size(2)
    else:  # placeholders: the kernel's q copy is compiled out
        q_rows, q_split, q_numel, q_strides, d = out, None, 0, (0, 0, 0), 1
    q_programs = triton.cdiv(q_numel, q_block)
    if copy_q and not out.is_cuda:  # the q copy loops over the splits
        require_interpretable_numpy("_build_rows_kernel")
    dependent = dependent_launch(indices.device)
    _build_rows_kernel[(batch * s_q, list_programs + q_programs)](
        out, out_len, s_q, request_stride,
        indices, indices.stride(0), indices.stride(1), topk, indices if topk_length is None else topk_length, width,
        table, table.stride(0), n_slots[0],
        eidx, eidx.stride(0), eidx.stride(1), eidx.size(2),
        indices if extra_topk_length is None else extra_topk_length, extra or 0, etable, etable.stride(0),
        n_slots[1], list_programs, q_rows, *q_strides, out if q_split is None else q_split, q_numel, splits,
        HAS_LEN=topk_length is not None, HAS_EXTRA=has_extra, HAS_ELEN=extra_topk_length is not None,
        HAS_TABLE=has_table, BLOCK=block, COPY_Q=copy_q, D=d, Q_BLOCK=q_block, DEPENDENT_LAUNCH=dependent,
        num_warps=4, launch_pdl=dependent)
    return out, q_split


def _choose_splits(n_rows: int, heads: int, list_len: int, device: torch.device,
                   sms_per_program: int = SPLIT_SMS_PER_PROGRAM) -> int:
    """Split only when every program has at least sms_per_program SMs; then the fewest chunks with the
    fewest SPLIT_GRANULE-entry steps each such that all chunks fit in SPLIT_MAX_SM_SHARE of the SMs."""
    sms = sm_count(device)
    programs = n_rows * -(-heads // HEADS_PER_PROGRAM)
    if programs * sms_per_program > sms:
        return 1
    steps = -(-list_len // SPLIT_GRANULE)
    most = min(steps, int(sms * SPLIT_MAX_SM_SHARE) // programs)
    if most <= 1:
        return 1
    steps_per_chunk = -(-steps // most)
    return -(-steps // steps_per_chunk)


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


def _merge_splits(out_parts: torch.Tensor, lse_parts: torch.Tensor, splits: int, attn_sink: torch.Tensor | None):
    """out_parts [n*S, H, Dv] (chunk c of query i at row i*S + c), lse_parts [n*S, H] base 2 (+inf:
    empty chunk) -> (out [n, H, Dv] in out_parts' dtype, lse [n, H] base 2), merged by lse in fp32,
    the sink applied once. One launch."""
    rows, heads, d_v = out_parts.shape
    if d_v & (d_v - 1) or out_parts.stride(2) != 1:
        raise ValueError(f"out_parts: expected a contiguous power-of-two last dim, got shape "
                         f"{tuple(out_parts.shape)} strides {out_parts.stride()}")
    n = rows // splits
    out = torch.empty((n, heads, d_v), dtype=out_parts.dtype, device=out_parts.device)
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
