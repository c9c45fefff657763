"""Sparse MLA decode in pure Triton that reads PAGED fp8 KV caches directly: each selected row is
loaded from the cache as raw bytes and dequantized in registers, with no bf16 staging buffer.

Contract of `paged_fp8_decode(...)` (the launcher; validation of caller input is `check_paged_fp8_decode_args`,
which the public boundary calls; the launcher itself only asserts what the kernel assumes):
  q [n, h_q, d_qk] bf16 or fp32 (last dim contiguous, leading dims strided), n = B * s_q query rows; row r
    belongs to request r // s_q.
  cache0 uint8 (or float8_e4m3fn) [num_blocks0, block_size0, 1, bytes_per_token] in kv_cache.MODEL1 (584 B per
    token, d_qk 512: the 512-wide dequantized row is both K and V) or kv_cache.V32 (656 B, d_qk 576: K = the 512
    dequantized dims + 64 bf16 RoPE, V = the 512 dequantized dims); layouts and block padding in
    kv_cache/fp8.py; any block_size, any block stride (cache0.stride(0), bytes) that does not overlap blocks
    and is 4-byte aligned (16-byte aligned strides and bases give 16-byte loads).
  indices0 [n, topk0] int32 flat slot ids (block * block_size0 + offset); entry j of row r is valid iff
    0 <= id < num_blocks0 * block_size0 and j < lengths0[r // s_q] (lengths0 [B] int32, or None: no limit).
    An invalid entry (any int32) is never dereferenced.
  cache1 / indices1 [n, topk1] / lengths1 [B] (optional, cache1 in the same layout as cache0, with its own
    block size and block count): attended in the SAME softmax as cache0's entries.
  sm_scale > 0; attn_sink [h_q] fp32 or None: out *= 1 / (1 + exp(sink - lse_natural)) (never changes lse;
    sink -inf: no effect; +inf: out 0); a row without a valid entry: out 0, lse +inf whatever the sink.
  splits >= 1: the virtual list [cache0 entries | cache1 entries] (topk0 + topk1 long) is cut into `splits`
    chunks of ceil((topk0 + topk1) / splits) positions (the last ones may be shorter or empty); chunk c of
    row r is one program per head tile.
    splits == 1: returns (out [n, h_q, 512] in q's dtype, lse_log2 [n, h_q] fp32), the sink applied.
    splits > 1: returns (out_parts [n * splits, h_q, 512] fp32, lse_parts [n * splits, h_q] fp32), chunk c of
    row r at row r * splits + c, each normalized over its own chunk (lse +inf, out 0 for a chunk without a
    valid entry), NO sink: the split merge (attention/merge.py `merge_splits`) combines them and applies it.
  h_q: any h_q >= 1. Head tiles of min(64, max(16, next_pow2(h_q))) heads (tl.dot needs M >= 16): h_q 16, 32,
    64 and 128 fill their tiles; h_q 8 runs a 16-row tile with 8 rows masked (no extra memory traffic, half
    the tile's dot work idle). Tested: 8, 16, 32, 64, 128.
  lse in BASE 2 (the engine's convention).

Numerics: e4m3 codes times their scale, fp32 accumulation, online softmax in the exp2 domain with
sm_scale * log2(e) folded into the scores.
  bf16 q: the dequantized rows are bf16 dot operands. MODEL1: e4m3 * 2^(ue8m0 - 127) is exactly a bf16 value
    (any scale byte >= 1; byte 0 reads as scale 0, as kv_cache.dequantize_from_cache_ref does), so the rows are
    exactly the torch reference's. V32 (fp32 scales): dequantized in fp32 and rounded once to bf16 (nearest
    even), as dequantize_from_cache_ref(..., torch.bfloat16). P is rounded to bf16 before P.V (as FlashMLA).
  fp32 q (the engine's float32 validation mode): rows dequantized in fp32, dots with input_precision="ieee",
    P kept fp32.
  On the GPU the e4m3 codes are converted by the hardware cast (float8e4nv -> fp32, exact); under Triton's
  interpreter by integer bit operations (kv_cache.fp8._decode_e4m3: the interpreter's float casts truncate),
  and tl.dot gets fp32 operands (the interpreter multiplies raw bf16 bit patterns, triton issue 11584).

Schedule: one program per (query row, split chunk, head tile) on a 1-D grid (head tiles of a row adjacent:
they read the same cache rows close in time, from L2). The chunk's entries are walked as one compacted list:
its part of cache0's list, then its part of cache1's, positions past a list's length dropped (not visited),
in blocks of BLOCK_K entries with a per-entry choice of the cache (each cache's block size a constexpr; two
loops, one per cache, spilled registers). Per block: the slot ids (loaded one block ahead), block / offset per
slot, the rows' e4m3 bytes as one [BLOCK_K, tiles, tile] uint8 tile, times the per-tile scale (MODEL1: tile 7
is the bf16 RoPE, loaded as [BLOCK_K, 64] and selected in), then Q.K^T and P.V on the same dequantized tile.
The `if block < n_entries` branch around the score mask ends the dot chain Q.K^T -> P.V so that Triton
splits Q.K^T between the two warpgroups (see vendor/flashmla_sparse.py).
Programmatic dependent launch on SM90: the kernel waits for the previous kernel of the stream
(griddepcontrol.wait) before touching memory and lets the next one launch.
CUDA graphs: no host synchronization, outputs allocated by shape only.

Speed (one H200, CUDA-graph replays after an L2 flush, scripts/bench_triton_paged_fp8.py; log
docs/runs/2026-12-02_h200_bench_triton_paged_fp8_tl.log; notes docs/lab/triton_paged_fp8.md): 180-230 TFLOP/s
at B 64 / 128 / 256, 110-195 at B 74 / 148 (a partial second wave of programs). V3.2 B 128 h_q 128 topk 2048:
0.638 ms, 229 TFLOP/s, about 0.56x FlashMLA's published 410 TFLOP/s for that shape; V4 h_q 64, 128 + 512
entries, B 128: 0.114 ms; h_q 16 (the 16-head tile, two programs per SM) 0.099 ms, h_q 32 0.135 ms
(docs/lab/tp_heads.md). Each block costs ~3x its tensor-core time: the
rows go global -> shared (cp.async) -> registers (conversion) -> shared (the wgmma operand) on the single
instruction stream of each program, and the two head tiles of an h_q 128 row load and convert the same rows.

Deliberate deviations: none from the engine's decode contract; FlashMLA's decode treats only -1 as
invalid, this kernel bounds-checks every slot id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import kv_cache
from ..checks import check_sink, require_same_device, require_scale, require_tensor
from ..kv_cache.fp8 import _decode_e4m3
from ..platform import dependent_launch, require_interpretable_numpy, triton_interprets

LOG2E = 1.0 / math.log(2.0)
D_V = 512
_D_V = tl.constexpr(D_V)  # the same, readable inside the kernels
MAX_HEADS_PER_TILE = 64
MIN_HEADS_PER_TILE = 16  # tl.dot's smallest M
_INTERPRET = triton_interprets()  # Triton decided at import (decoration) time, from the same variable


@dataclass(frozen=True)
class PagedFp8DecodeConfig:
    block_k: int  # entries per block (rows loaded and dequantized together)
    num_warps: int
    num_stages: int
    # programs of this configuration one SM runs at once (shared memory, registers): the split planner
    # counts SMs times this as the slots that the chunks of a split may fill (attention/decode.py)
    programs_per_sm: int = 1


def default_config(dtype: torch.dtype, heads_per_tile: int, layout: kv_cache.Fp8KvLayout) -> PagedFp8DecodeConfig:
    """The fastest configuration measured on an H200 (64 heads: docs/runs/2026-12-02_h200_bench_triton_paged_fp8_tl.log;
    16 and 32: docs/runs/2026-12-03_h200_sweep_triton_paged_fp8_few_heads.log, MODEL1):
    64 heads: 64-entry blocks, 8 warps, 3 stages (two row buffers in flight) for MODEL1; V32's RoPE tiles leave
      room for 2 stages only;
    32 heads: 64-entry blocks, 8 warps, 2 stages (3 stages do not fit shared memory; 4 warps spill the
      [32, 512] accumulator: 2.3x slower);
    16 heads (h_q <= 16): 32-entry blocks, 4 warps, 2 stages: ~70 KB of shared memory (MODEL1), so two
      programs share an SM and their row loads overlap (1.5x the 64-entry 4-warp tile at B 128); two per
      SM as measured: 296 programs (B 148, s_q 2) take 1.8x the time of 256 (a second wave).
    float32 (validation mode) uses small blocks so that it fits shared memory."""
    if dtype == torch.float32:
        return PagedFp8DecodeConfig(block_k=16, num_warps=8, num_stages=1)
    if heads_per_tile <= MIN_HEADS_PER_TILE:
        return PagedFp8DecodeConfig(block_k=32, num_warps=4, num_stages=2, programs_per_sm=2)
    if heads_per_tile < MAX_HEADS_PER_TILE:
        return PagedFp8DecodeConfig(block_k=64, num_warps=8, num_stages=2)
    return PagedFp8DecodeConfig(block_k=64, num_warps=8, num_stages=3 if layout is kv_cache.MODEL1 else 2)


def heads_per_tile(h_q: int) -> int:
    return min(MAX_HEADS_PER_TILE, max(MIN_HEADS_PER_TILE, triton.next_power_of_2(h_q)))


@triton.jit
def _round_to_bf16_values(x):
    """fp32 x rounded to the nearest bf16 value (ties to even), in integer ops; NaN and inf stay."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x)


@triton.jit
def _token_offsets(slot, block_stride, BLOCK_SIZE: tl.constexpr, IS_MODEL1: tl.constexpr):
    """Byte offsets in one cache of each slot's token data and of its scales (int64; slot >= 0)."""
    block_base = (slot // BLOCK_SIZE).to(tl.int64) * block_stride
    t = slot % BLOCK_SIZE
    if IS_MODEL1:
        return block_base + t * 576, block_base + BLOCK_SIZE * 576 + t * 8
    token = block_base + t * 656
    return token, token + 512


@triton.jit
def _load_rows(token, scale_row, valid, IS_MODEL1: tl.constexpr, D_ROPE: tl.constexpr, INTERPRETER: tl.constexpr,
               ROW_DTYPE: tl.constexpr):
    """The dequantized rows of BLOCK_K tokens (token / scale_row: uint8 pointers to each token's data and scales;
    rows not `valid` are not read and give zero rows): kv [BLOCK_K, 512] in ROW_DTYPE and rope [BLOCK_K, 64]
    (V32: the K-only RoPE dims; MODEL1: the RoPE dims are inside kv, rope unused)."""
    if IS_MODEL1:
        # [BLOCK_K, 8, 64]: tiles 0..6 are the e4m3 NoPE dims (one ue8m0 scale each), tile 7 the bf16 RoPE dims
        NUM_TILES: tl.constexpr = 8
        TILE: tl.constexpr = 64
    else:
        # [BLOCK_K, 4, 128]: 512 e4m3 dims, one fp32 scale per 128
        NUM_TILES: tl.constexpr = 4
        TILE: tl.constexpr = 128
    tiles = tl.arange(0, NUM_TILES)
    cols = tl.arange(0, TILE)
    row_ok = valid[:, None, None]
    tile_of = tiles[None, :, None]
    offsets = tile_of * TILE + cols[None, None, :]
    if IS_MODEL1:
        is_code = tile_of < 7
        codes = tl.load(token[:, None, None] + offsets, mask=row_ok & is_code, other=0)
        # the 8 scale bytes as two 32-bit words (4-byte loads: the layout guarantees 4-byte alignment only)
        words = scale_row.to(tl.pointer_type(tl.int32))
        low = tl.load(words, mask=valid, other=0)
        high = tl.load(words + 1, mask=valid, other=0)
        word = tl.where(tiles[None, :] < 4, low[:, None], high[:, None])
        scale_byte = (word >> ((tiles[None, :] % 4) * 8)) & 0xFF
        scale = tl.where(tiles[None, :] < 7, (scale_byte << 23).to(tl.float32, bitcast=True), 1.0)  # 2^(b - 127)
    else:
        codes = tl.load(token[:, None, None] + offsets, mask=row_ok, other=0)
        scale = tl.load(scale_row.to(tl.pointer_type(tl.float32))[:, None] + tiles[None, :], mask=valid[:, None],
                        other=0.0)
    if INTERPRETER:
        code = codes.to(tl.int32)
        values = tl.where((code & 0x7F) == 0x7F, float("nan"), _decode_e4m3(code))  # NaN codes read as NaN
    else:
        values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    kv = (values * scale[:, :, None]).to(ROW_DTYPE)
    if IS_MODEL1:
        rope_ptr = (token + 448).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rope_ptr[:, None] + tl.arange(0, TILE)[None, :], mask=valid[:, None], other=0.0)
        kv = tl.where(is_code, kv, rope.to(ROW_DTYPE)[:, None, :])
    else:
        rope_ptr = (token + 528).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rope_ptr[:, None] + tl.arange(0, D_ROPE)[None, :], mask=valid[:, None], other=0.0)
        rope = rope.to(ROW_DTYPE)
    return tl.reshape(kv, [kv.shape[0], NUM_TILES * TILE]), rope


@triton.jit
def _entries(j, n0, n1, idx0_row, first0, idx1_row, first1, HAS_CACHE1: tl.constexpr):
    """Slot ids of the chunk's compacted entries j (cache0's list from position first0 for n0 entries, then
    cache1's from first1 for n1) and whether each is cache1's; -1 past the end."""
    slot = tl.load(idx0_row + first0 + j, mask=j < n0, other=-1)
    in1 = j >= n0
    if HAS_CACHE1:
        slot1 = tl.load(idx1_row + first1 + (j - n0), mask=in1 & (j < n0 + n1), other=-1)
        slot = tl.where(in1, slot1, slot)
    return slot, in1


@triton.jit
def _paged_fp8_decode_kernel(
    q_ptr, stride_q_row, stride_q_h,
    cache0_ptr, block_stride0, n_slots0, idx0_ptr, stride_idx0_row, topk0, len0_ptr,
    cache1_ptr, block_stride1, n_slots1, idx1_ptr, stride_idx1_row, topk1, len1_ptr,
    sink_ptr, out_ptr, lse_ptr,
    s_q, h_q, splits, chunk_len, qk_scale_log2,
    BLOCK_SIZE0: tl.constexpr, BLOCK_SIZE1: tl.constexpr, IS_MODEL1: tl.constexpr, HAS_CACHE1: tl.constexpr,
    HAS_LEN0: tl.constexpr, HAS_LEN1: tl.constexpr, HAS_SINK: tl.constexpr,
    H_TILES: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, D_ROPE: tl.constexpr,
    INTERPRETER: tl.constexpr, ROW_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr,
):
    if DEPENDENT_LAUNCH:  # wait for the previous kernel before touching memory; let the next one launch
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    out_row = pid // H_TILES  # row * splits + chunk (== row without a split)
    row = out_row // splits
    chunk = out_row % splits
    request = row // s_q
    heads = (pid % H_TILES) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_heads = heads < h_q
    cols = tl.arange(0, _D_V)

    q_rows = q_ptr + row.to(tl.int64) * stride_q_row + heads.to(tl.int64)[:, None] * stride_q_h
    q = tl.load(q_rows + cols[None, :], mask=in_heads[:, None], other=0.0).to(ROW_DTYPE)
    if D_ROPE > 0:
        q_rope = tl.load(q_rows + _D_V + tl.arange(0, D_ROPE)[None, :], mask=in_heads[:, None], other=0.0)
        q_rope = q_rope.to(ROW_DTYPE)
    else:
        q_rope = q

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, log2 domain
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, _D_V], tl.float32)
    # This chunk's positions [start, end) of the virtual list [cache0's entries | cache1's entries], less
    # the positions past each list's length: n0 entries of cache0's list from position first0, then n1 of
    # cache1's from first1, walked as one compacted list j in [0, n0 + n1).
    start = chunk * chunk_len
    end = start + chunk_len
    len0 = topk0
    if HAS_LEN0:
        len0 = tl.maximum(tl.minimum(tl.load(len0_ptr + request), topk0), 0)
    first0 = start
    n0 = tl.maximum(tl.minimum(end, len0) - start, 0)
    idx0_row = idx0_ptr + row.to(tl.int64) * stride_idx0_row
    idx1_row = idx0_row
    first1 = 0
    n1 = 0
    if HAS_CACHE1:
        len1 = topk1
        if HAS_LEN1:
            len1 = tl.maximum(tl.minimum(tl.load(len1_ptr + request), topk1), 0)
        first1 = tl.maximum(start - topk0, 0)
        n1 = tl.maximum(tl.minimum(end - topk0, len1) - first1, 0)
        idx1_row = idx1_ptr + row.to(tl.int64) * stride_idx1_row
    n_entries = n0 + n1

    j = tl.arange(0, BLOCK_K)
    slot, in1 = _entries(j, n0, n1, idx0_row, first0, idx1_row, first1, HAS_CACHE1)
    for block in range(0, n_entries, BLOCK_K):
        j = block + tl.arange(0, BLOCK_K)
        if HAS_CACHE1:
            valid = (slot >= 0) & (slot < tl.where(in1, n_slots1, n_slots0))
            safe = tl.where(valid, slot, 0)
            token0, scales0 = _token_offsets(safe, block_stride0, BLOCK_SIZE0, IS_MODEL1)
            token1, scales1 = _token_offsets(safe, block_stride1, BLOCK_SIZE1, IS_MODEL1)
            base = tl.where(in1, cache1_ptr, cache0_ptr)
            token = base + tl.where(in1, token1, token0)
            scale_row = base + tl.where(in1, scales1, scales0)
        else:
            valid = (slot >= 0) & (slot < n_slots0)
            token, scale_row = _token_offsets(tl.where(valid, slot, 0), block_stride0, BLOCK_SIZE0, IS_MODEL1)
            token = cache0_ptr + token
            scale_row = cache0_ptr + scale_row
        kv, kv_rope = _load_rows(token, scale_row, valid, IS_MODEL1, D_ROPE, INTERPRETER, ROW_DTYPE)
        # the next block's slot ids, so that its row addresses never wait on a load issued after this P.V
        slot, in1 = _entries(j + BLOCK_K, n0, n1, idx0_row, first0, idx1_row, first1, HAS_CACHE1)
        scores = tl.dot(q, tl.trans(kv), input_precision=INPUT_PRECISION) * qk_scale_log2
        if D_ROPE > 0:
            # a separate dot added after scaling: accumulating into the first dot would chain them
            scores += tl.dot(q_rope, tl.trans(kv_rope), input_precision=INPUT_PRECISION) * qk_scale_log2
        # Always true inside the loop: it ends the dot chain Q.K^T -> P.V, so that each warpgroup computes
        # half of the Q.K^T columns (vendor/flashmla_sparse.py's kernel explains it).
        if block < n_entries:
            scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid entry yet: avoid -inf - -inf
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(ROW_DTYPE), kv, acc, input_precision=INPUT_PRECISION)
        m = m_new

    # Rows without a valid entry (l == 0) get out 0, lse +inf; the *_safe values keep their discarded
    # branch free of log(0), 1/0 and inf - inf. A NaN row sum (NaN in a selected row) is not empty: it stays
    # NaN, as in the oracle.
    has_valid = l != 0.0
    l_safe = tl.where(has_valid, l, 1.0)
    lse_log2_safe = tl.where(has_valid, m + tl.log2(l_safe), 0.0)
    out_scale = tl.where(has_valid, 1.0 / l_safe, 0.0)
    if HAS_SINK:
        # 1 / (1 + exp(sink - lse)): exact at sink = -inf (factor 1) and +inf (factor 0); empty rows stay 0
        # whatever the sink (a NaN sink included).
        sink_log2 = tl.load(sink_ptr + heads, mask=in_heads, other=0.0) * 1.4426950408889634
        out_scale = tl.where(has_valid, out_scale / (1.0 + tl.exp2(sink_log2 - lse_log2_safe)), 0.0)
    out = acc * out_scale[:, None]
    if INTERPRETER and out_ptr.dtype.element_ty == tl.bfloat16:
        out = _round_to_bf16_values(out)  # the interpreter's cast below truncates; this value casts exactly
    out_heads = out_row.to(tl.int64) * h_q + heads
    tl.store(out_ptr + out_heads[:, None] * _D_V + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=in_heads[:, None])
    tl.store(lse_ptr + out_heads, tl.where(has_valid, lse_log2_safe, float("inf")), mask=in_heads)


def _cache_layout(name: str, cache: torch.Tensor) -> kv_cache.Fp8KvLayout:
    """Validates one paged fp8 cache (shape, dtype, strides, alignment); returns its layout."""
    require_tensor(name, cache, dtypes=(torch.uint8, torch.float8_e4m3fn), ndim=4)
    layout = next((l for l in kv_cache.LAYOUTS if cache.size(-1) == l.bytes_per_token), None)
    if layout is None:
        raise ValueError(f"{name}: expected last dim {' or '.join(str(l.bytes_per_token) for l in kv_cache.LAYOUTS)} "
                         f"(bytes per token of {', '.join(l.name for l in kv_cache.LAYOUTS)}), got shape "
                         f"{tuple(cache.shape)}")
    num_blocks, block_size, heads, bytes_per_token = cache.shape
    if heads != 1 or num_blocks < 1 or block_size < 1:
        raise ValueError(f"{name}: expected shape [num_blocks >= 1, block_size >= 1, 1, {bytes_per_token}], "
                         f"got {tuple(cache.shape)}")
    if cache.stride(3) != 1 or cache.stride(1) != bytes_per_token:
        raise ValueError(f"{name}: expected token stride {bytes_per_token} and a contiguous last dim, "
                         f"got strides {cache.stride()}")
    if num_blocks > 1 and cache.stride(0) < block_size * bytes_per_token:
        raise ValueError(f"{name}: block stride {cache.stride(0)} overlaps blocks of {block_size} tokens")
    if cache.stride(0) % 4 != 0 or cache.data_ptr() % 4 != 0:  # scales and RoPE are read as 4 / 2-byte words
        raise ValueError(f"{name}: expected a 4-byte aligned base and block stride, got strides {cache.stride()}")
    if num_blocks * block_size > torch.iinfo(torch.int32).max:
        raise ValueError(f"{name}: {num_blocks} x {block_size} slots exceed int32 slot ids")
    return layout


def _check_list(idx_name: str, indices, len_name: str, lengths, n: int, batch: int, q: torch.Tensor) -> None:
    require_tensor(idx_name, indices, dtypes=(torch.int32,), ndim=2)
    require_same_device("q", q, **{idx_name: indices, len_name: lengths})
    if indices.size(0) != n or indices.size(1) < 1 or indices.stride(1) != 1:
        raise ValueError(f"{idx_name}: expected shape [{n}, topk >= 1] (one list per query row) with a contiguous "
                         f"last dim, got shape {tuple(indices.shape)} strides {indices.stride()}")
    if lengths is not None:
        require_tensor(len_name, lengths, dtypes=(torch.int32,), ndim=1)
        if lengths.size(0) != batch or lengths.stride(0) != 1:
            raise ValueError(f"{len_name}: expected a contiguous shape [{batch}] (one per request), "
                             f"got {tuple(lengths.shape)}")


def check_paged_fp8_decode_args(q, cache0, indices0, lengths0, cache1, indices1, lengths1, s_q, sm_scale,
                                attn_sink, splits) -> kv_cache.Fp8KvLayout:
    """Validates paged_fp8_decode's arguments (the module header's contract), naming the argument in every
    error; returns the caches' layout."""
    require_tensor("q", q, dtypes=(torch.bfloat16, torch.float32), ndim=3)
    if isinstance(s_q, bool) or not isinstance(s_q, int) or s_q < 1:
        raise ValueError(f"s_q: expected an int >= 1, got {s_q!r}")
    n, h_q, d_qk = q.shape
    if n < 1 or n % s_q or h_q < 1 or q.stride(2) != 1:
        raise ValueError(f"q: expected shape [B * s_q (s_q {s_q}), h_q >= 1, d_qk] with a contiguous last dim, "
                         f"got shape {tuple(q.shape)} strides {q.stride()}")
    layout = _cache_layout("cache0", cache0)
    if d_qk != layout.d:
        raise ValueError(f"q: expected d_qk {layout.d} (cache0's layout {layout.name}), got shape {tuple(q.shape)}")
    require_same_device("q", q, cache0=cache0, cache1=cache1, attn_sink=attn_sink)
    batch = n // s_q
    _check_list("indices0", indices0, "lengths0", lengths0, n, batch, q)
    if (cache1 is None) != (indices1 is None):
        raise ValueError("cache1, indices1: pass both or neither")
    if lengths1 is not None and cache1 is None:
        raise ValueError("lengths1: given without cache1 / indices1")
    if cache1 is not None:
        layout1 = _cache_layout("cache1", cache1)
        if layout1 is not layout:
            raise ValueError(f"cache1: expected cache0's layout {layout.name} ({layout.bytes_per_token} B/token), "
                             f"got {layout1.name}")
        _check_list("indices1", indices1, "lengths1", lengths1, n, batch, q)
    require_scale("sm_scale", sm_scale)
    check_sink(attn_sink, h_q)
    if attn_sink is not None and attn_sink.stride(0) != 1 and h_q > 1:
        raise ValueError(f"attn_sink: expected a contiguous tensor, got strides {attn_sink.stride()}")
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits: expected an int >= 1, got {splits!r}")
    return layout


def paged_fp8_decode(q: torch.Tensor, cache0: torch.Tensor, indices0: torch.Tensor, lengths0: torch.Tensor | None,
                     *, s_q: int, sm_scale: float, cache1: torch.Tensor | None = None,
                     indices1: torch.Tensor | None = None, lengths1: torch.Tensor | None = None,
                     attn_sink: torch.Tensor | None = None, splits: int = 1,
                     config: PagedFp8DecodeConfig | None = None,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel launch (module header: contract). Arguments are assumed valid (check_paged_fp8_decode_args);
    only what the kernel relies on is asserted. Returns (out, lse_log2) with splits == 1, else
    (out_parts fp32, lse_parts). out: a dense [n, h_q, 512] buffer in q's dtype the kernel writes (splits == 1
    only; checked by the boundary)."""
    n, h_q, d_qk = q.shape
    layout = kv_cache.layout_of(cache0)
    assert d_qk == layout.d and q.stride(2) == 1 and n % s_q == 0 and splits >= 1
    assert cache1 is None or kv_cache.layout_of(cache1) is layout
    if _INTERPRET:
        require_interpretable_numpy("_paged_fp8_decode_kernel")
    else:
        assert q.is_cuda, "q: the kernel runs on a CUDA device (or under TRITON_INTERPRET=1)"
    block_h = heads_per_tile(h_q)
    if config is None:
        config = default_config(q.dtype, block_h, layout)
    partial = splits > 1
    out_dtype = torch.float32 if partial else q.dtype
    if out is None:
        out = torch.empty((n * splits, h_q, D_V), dtype=out_dtype, device=q.device)
    else:
        assert not partial and out.shape == (n, h_q, D_V) and out.dtype == q.dtype and out.is_contiguous()
    lse = torch.empty((n * splits, h_q), dtype=torch.float32, device=q.device)
    has_cache1 = cache1 is not None
    topk0 = indices0.size(1)
    topk1 = indices1.size(1) if has_cache1 else 0
    chunk_len = -(-(topk0 + topk1) // splits)
    h_tiles = -(-h_q // block_h)
    # Unused pointer arguments get a valid tensor; the constexpr flags keep them unread.
    c0 = cache0.view(torch.uint8)
    c1 = cache1.view(torch.uint8) if has_cache1 else c0
    i1 = indices1 if has_cache1 else indices0
    dependent = dependent_launch(q.device)
    _paged_fp8_decode_kernel[(n * splits * h_tiles,)](
        q, q.stride(0), q.stride(1),
        c0, c0.stride(0), c0.size(0) * c0.size(1), indices0, indices0.stride(0), topk0,
        indices0 if lengths0 is None else lengths0,
        c1, c1.stride(0), c1.size(0) * c1.size(1), i1, i1.stride(0), topk1,
        indices0 if lengths1 is None else lengths1,
        lse if attn_sink is None else attn_sink, out, lse,
        s_q, h_q, splits, chunk_len, float(sm_scale) * LOG2E,
        BLOCK_SIZE0=c0.size(1), BLOCK_SIZE1=c1.size(1), IS_MODEL1=layout is kv_cache.MODEL1, HAS_CACHE1=has_cache1,
        HAS_LEN0=lengths0 is not None, HAS_LEN1=lengths1 is not None, HAS_SINK=attn_sink is not None and not partial,
        H_TILES=h_tiles, BLOCK_H=block_h, BLOCK_K=config.block_k, D_ROPE=d_qk - D_V,
        INTERPRETER=_INTERPRET, ROW_DTYPE=tl.float32 if (_INTERPRET or q.dtype == torch.float32) else tl.bfloat16,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DEPENDENT_LAUNCH=dependent, num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=dependent,
    )
    return out, lse
