"""TileLang SM90 sparse MLA decode over paged fp8 KV caches in DeepSeek-V4's "MODEL1" (584 B/token) or
DeepSeek-V3.2's (656 B/token) layout: the kernel reads the fp8 rows itself instead of attending over a
bf16 buffer that kv_cache.gather_dequant wrote first.

Contract: the operator of sparse_mla_sm90 (lse base 2, sink, topk_length, empty rows out 0 / lse +inf,
any invalid filler) with the kv rows read from TWO paged caches of one layout instead of one bf16 tensor:
  MODEL1: q [s_q, h_q, 512] bf16, K = V = the dequantized 512 dims (448 e4m3 NoPE, 64 bf16 RoPE);
  V3.2:   q [s_q, h_q, 576] bf16, K = the dequantized 512 NoPE dims + 64 bf16 RoPE, V = the first 512;
  cache0, cache1 [num_blocks_i, block_size_i, 1, bytes_per_token] uint8 (kv_cache.MODEL1 / kv_cache.V32,
  byte layouts in kv_cache/fp8.py; separate tensors, each with its own num_blocks, block_size (page size)
  and block stride; cache1 may be None); indices [s_q, topk] int32: entry s in [0, n_slots0) is cache0's
  slot s, s in [n_slots0, n_slots0 + n_slots1) cache1's slot s - n_slots0 (n_slots_i = num_blocks_i *
  block_size_i; a slot is block * block_size_i + offset); anything else (or a position past topk_length)
  is invalid: masked, never read. One softmax over both caches' entries. Out [s_q, h_q, 512].

Numerics: as sparse_mla_sm90 (bf16 operands, fp32 accumulators, exp2 online softmax, lse base 2); the rows
are dequantized to bf16 before they enter the wgmmas:
  MODEL1: exactly (e4m3 * 2^(scale - 127) is a bf16 value);
  V3.2: e4m3 * fp32 scale (one per 128 dims, any fp32 value) is computed in fp32 (round to nearest,
    subnormals kept) and rounded to bf16 once: bit for bit kv_cache's torch reference dequantization into
    bf16 (exact for the quantizer's power-of-two scales).
RoPE is copied as stored (bf16).

Schedule: sparse_mla_sm90's consumers (consumer_parts) and ring; a different producer warpgroup, and
the consumers convert. Per pair the producer resolves the 128 entries into a shared row table (token
data offset / 16 with the cache in bit 30; MODEL1 also its scales' offset / 8): each cache has its own
page size, whose block (slot / block_size) takes a multiply and two shifts with per-cache constants
(paged_block_of: floor(2 s m / 2^32) >> sh, m and sh from block_division on the host; a power of two
gives m = 2^31, so the same three instructions; no integer division), the token in the block one
multiply-subtract, and the addresses the cache's own block stride. Then per (buffer, half) as soon as its
slot is free, it cp.asyncs the raw e4m3 bytes of each pair of 16-column groups (32 dims, one scale) into
the first two of that pair's four output chunks of the ring, so that every 32-byte sector of a row
lands in one 32-byte slot of shared memory (the row's scales for the half go into a third chunk: MODEL1
a 4-byte word of ue8m0 bytes, V3.2 the half's two fp32 scales; RoPE straight to its place: MODEL1 the
right half's last 64 columns, V3.2 the K tail buffer k_t), and arrives on the half's ready barrier when
its copies land (cp.async.mbarrier.arrive.noinc). The consumer that reads a half first (in its S)
converts it in place after that barrier, one thread per pair of groups (MODEL1: loads both staged
chunks, then stores all four; V3.2: the same per pair, its two pairs one after the other), then
fence.proxy.async and a barrier of that consumer's 128 threads before the S; the other consumer reads
the half only after the max exchange. So the producer only issues copies, and the conversion runs on
256 threads. Q arrives by TMA on its own barrier (consumer_parts' load_q), waited for before an item's
first S. V3.2 (d_qk 576) keeps P of buffer 0 in that buffer's K tail once its S is done, as
sparse_mla_sm90 does: its shared memory is the 227 KB an SM90 CTA may have, to the byte.
Programmatic dependent launch: a CTA may start while the previous kernel of the stream (the decode
entry point's slot-id launch) finishes; every thread waits for it (cudaGridDependencySynchronize)
before any global access. (TileLang then drops __restrict__ from the parameters: no measurable cost
here; the bf16 kernel of sparse_mla_sm90 lost ~1% on prefill that way and does not do it.)

Constraints: h_q 64 or 128; both caches in one layout; any page size >= 1 per cache; bases and block
strides 16-byte aligned (a stride may exceed the block's bytes; kv_cache.new_fp8_kv_cache's are), at most
16 GiB per cache, n_slots0 + n_slots1 < 2^31. MODEL1: any ue8m0 scale the fp8 quantizer writes (up to
2^120) dequantizes exactly; scales above 2^7 (tiles with |x| > 57344) take a second multiply.

Speed (H200, MODEL1, both caches in 64-token pages, docs/lab/decode.md): with one item per SM, ~15.5 us per
launch + ~5.8 us per pair of blocks (every entry masked: ~11.6 + ~5.1 us); with the rows L2-resident ~4.5
us per pair, against ~3 us for the bf16 kernel's pair and ~2.5-2.9 us for this kernel's consumers alone
(no copies, no conversion): the staged copies and the conversion cost the rest. Staging a sector per
32-byte slot (before: each 16-byte piece in its group's first chunk, the two pieces of a sector 32 bytes
apart) gained 1.10-1.15x at 5 pairs (1.05-1.07x at one); moving the conversion from the producer to the
consumers 1.01-1.13x (batch <= 64). Per-cache page sizes and the V3.2 variant (2026-12-02): not measured
yet (scripts/bench_tilelang_paged_fp8.py times both at FlashMLA's decode configurations).
Prefetching the next pairs' rows into L2, a schedule that loads the next block during the current one
(consumers splitting Q K^T by columns) and, at h_q 128, the two CTAs of a token sharing their
converted rows through a cluster (each loading and converting half: 0.84-0.92x, the handshakes sit
on the S path) did not help.
"""

import functools
import math
import types
from dataclasses import dataclass

import tilelang
import tilelang.language as T
import torch

from ..checks import TILELANG_HEADS
from ..platform import sm_count
from .. import kv_cache
from .tilelang_sm90 import PRELUDE as sm90_prelude
from .tilelang_sm90 import (BLOCK_TOPK, COMPILE_FLAGS, D_V, GATHER_ORDER, GATHER_ORDER_NEXT_ITEM,
                                            HEADS_PER_CTA, LOG2E, SM90_TARGET, _aligned_operand, _dense,
                                            consumer_parts, lengths_and_sink, require_sm90_device)

# Byte offsets as the kernel reads the two layouts (kv_cache.fp8's header has them in full):
MODEL1_DATA_BYTES = 576  # a MODEL1 token's data at block start + t * 576: 448 e4m3 | 64 bf16 RoPE
MODEL1_ROPE = 448
MODEL1_SCALE_BYTES = 8  # its scales at block start + block_size * 576 + t * 8: 7 ue8m0 | pad
V32_SCALES = 512  # a V3.2 token at block start + t * 656: 512 e4m3 | 4 fp32 scales | 64 bf16 RoPE
V32_ROPE = 528
LAYOUTS = {layout.name: layout for layout in (kv_cache.MODEL1, kv_cache.V32)}
DATA16_MASK = (1 << 30) - 1  # row_data16 bits 0..29 = data offset / 16, bit 30 = cache
PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    # Safe memory access would guard every byte of the 16-byte cache loads (it cannot bound the slot
    # addresses) and scalarize them; every access here is in bounds by construction.
    tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True,
}
CONSUMER_NREG, PRODUCER_NREG = 216, 72  # setmaxnreg: 2 * 216 + 72 <= 512

PRELUDE = sm90_prelude + r"""
// 16-byte cp.async global -> shared (L2 only); ok == false: 16 zero bytes are written, nothing is read.
template <typename D, typename S>
__device__ __forceinline__ void fp8_cp16(D *dst, const S *src, bool ok) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
// 4-byte cp.async (the .ca form: .cg takes 16 bytes only); ok == false: 4 zero bytes.
template <typename D, typename S>
__device__ __forceinline__ void fp8_cp4(D *dst, const S *src, bool ok) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 4 : 0) : "memory");
}
// 8-byte cp.async (.ca); ok == false: 8 zero bytes.
template <typename D, typename S>
__device__ __forceinline__ void fp8_cp8(D *dst, const S *src, bool ok) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 8 : 0) : "memory");
}
// Two caches: the source is base0 + off (sel == 0) or base1 + off (sel != 0), one select of the base
// pointer per call (nvcc shares it across a row's calls: same sel).
template <typename D, typename S>
__device__ __forceinline__ void fp8_cp16s(D *dst, const S *base0, const S *base1, int sel, long long off, bool ok) {
  fp8_cp16(dst, (sel ? base1 : base0) + off, ok);
}
template <typename D, typename S>
__device__ __forceinline__ void fp8_cp8s(D *dst, const S *base0, const S *base1, int sel, long long off, bool ok) {
  fp8_cp8(dst, (sel ? base1 : base0) + off, ok);
}
template <typename D, typename S>
__device__ __forceinline__ void fp8_cp4s(D *dst, const S *base0, const S *base1, int sel, long long off, bool ok) {
  fp8_cp4(dst, (sel ? base1 : base0) + off, ok);
}
// The page block of slot s (0 <= s < 2^31) of a cache of block_size d, floor(s / d), as floor(2 s m / 2^32) >> sh
// with sh = ceil(log2 d) and m = ceil(2^(31 + sh) / d) < 2^32 (block_division on the host): exact for every such
// s, since m d - 2^(31 + sh) < d <= 2^sh. A shift, a high multiply and a shift (d a power of two: m = 2^31).
__device__ __forceinline__ int paged_block_of(int s, int m, int sh) {
  return static_cast<int>(__umulhi(static_cast<unsigned>(s) << 1, static_cast<unsigned>(m)) >> sh);
}
// Dequantize 16 staged e4m3 bytes w (already in registers) times 2^(t - 127), t = e & 0xff (the group's
// ue8m0 byte), and store them as bf16: dims [0, 8) -> lo, [8, 16) -> hi (the group's two 16-byte chunks).
// The e4m3 bits placed in a bf16 (b) read as value * 2^-120, subnormals included, so value * 2^(t - 127)
// = b * 2^(t - 7): one exact multiply while 2^(t - 7) is a bf16 (t <= 134: scales up to 2^7); kTwo: a
// second factor, for rows with a larger scale (the fp8 quantizer writes t up to 247, for tiles with |x| > 57344).
template <bool kTwo, typename D>
__device__ __forceinline__ void fp8_cvt_store(const uint4 w, unsigned e, D *lo, D *hi) {
  const unsigned t = e & 0xffu;
  unsigned f0 = t + 120u, f1 = 127u;  // bf16 exponent fields of the factors (f1 = 127: 1.0)
  if (kTwo && t > 134u) {
    f1 = ((t - 7u) >> 1) + 127u;
    f0 -= f1 - 127u;
  }
  const unsigned s0 = (f0 << 7) | (f0 << 23), s1 = (f1 << 7) | (f1 << 23);
  const unsigned in[4] = {w.x, w.y, w.z, w.w};
  unsigned out[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // bytes 2h, 2h + 1 of the word into the high bytes of the two 16-bit lanes
      const unsigned x = __byte_perm(in[i], 0u, h ? 0x3424u : 0x1404u);
      const unsigned b = (x & 0x80008000u) | ((x >> 4) & 0x07f007f0u);
      asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out[2 * i + h]) : "r"(b), "r"(s0));
      if (kTwo) asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out[2 * i + h]) : "r"(out[2 * i + h]), "r"(s1));
    }
  }
  *reinterpret_cast<uint4 *>(lo) = make_uint4(out[0], out[1], out[2], out[3]);
  *reinterpret_cast<uint4 *>(hi) = make_uint4(out[4], out[5], out[6], out[7]);
}
// The staging (see ring_row): a pair of groups (32 dims, one ue8m0 scale) has four output chunks o0..o3
// (dims [0, 8), [8, 16), [16, 24), [24, 32)); its 32 raw e4m3 bytes are staged in o0 (dims 0-15) and o1
// (dims 16-31), so each 32-byte sector of the row lands in one 32-byte slot of shared memory. One
// thread converts a pair: it loads both staged chunks, then stores all four. rot: this lane loads o1
// before o0 and stores o2, o3 before o0, o1 (x, y: the chunks in load order), so that the lanes of a
// quarter warp hit distinct banks in every load and store.
template <bool kTwo, typename D>
__device__ __forceinline__ void fp8_cvt_pair(const uint4 x, const uint4 y, unsigned t, bool rot, D *o0, D *o1, D *o2,
                                             D *o3) {
  fp8_cvt_store<kTwo>(x, t, rot ? o2 : o0, rot ? o3 : o1);
  fp8_cvt_store<kTwo>(y, t, rot ? o0 : o2, rot ? o1 : o3);
}
template <typename D>
__device__ __forceinline__ uint4 fp8_ld16(const D *p) { return *reinterpret_cast<const uint4 *>(p); }
// some byte of the scale word e above 134: bit 7 set and its low 7 bits above 6 (no carry crosses a byte)
__device__ __forceinline__ unsigned fp8_big_scales(unsigned e) {
  return ((e & 0x7f7f7f7fu) + 0x79797979u) & e & 0x80808080u;
}
// Left half of one ring row, pairs a (= lane) and b (= lane + 4): the row's left scale word (scales 0..3)
// at s, their scale bytes at bit shifts sha, shb. Everything staged is loaded first (the scale word
// before the stores that overwrite it), then converted; a word with a scale byte above 134 takes the
// two-factor conversion.
template <typename D>
__device__ __forceinline__ void fp8_cvt_left(const D *s, unsigned sha, unsigned shb, bool rot, D *a0, D *a1, D *a2,
                                             D *a3, D *b0, D *b1, D *b2, D *b3) {
  const unsigned e = *reinterpret_cast<const unsigned *>(s);
  const uint4 ax = fp8_ld16(rot ? a1 : a0), ay = fp8_ld16(rot ? a0 : a1);
  const uint4 bx = fp8_ld16(rot ? b1 : b0), by = fp8_ld16(rot ? b0 : b1);
  if (fp8_big_scales(e) == 0u) {
    fp8_cvt_pair<false>(ax, ay, e >> sha, rot, a0, a1, a2, a3);
    fp8_cvt_pair<false>(bx, by, e >> shb, rot, b0, b1, b2, b3);
  } else {
    fp8_cvt_pair<true>(ax, ay, e >> sha, rot, a0, a1, a2, a3);
    fp8_cvt_pair<true>(bx, by, e >> shb, rot, b0, b1, b2, b3);
  }
}
// Right half of the thread's two ring rows: pair a (= lane) of row 0, pair b (= lane) of row 1 (scale
// words at s0, s1: scales 4..6 and the pad byte; their byte at bit shift sh) and pair c (4 + lane % 2,
// scale byte 2) of row 1 if rot, else of row 0: the six pairs of each row over its four lanes.
template <typename D>
__device__ __forceinline__ void fp8_cvt_right(const D *s0, const D *s1, unsigned sh, bool rot, D *a0, D *a1, D *a2,
                                              D *a3, D *b0, D *b1, D *b2, D *b3, D *c0, D *c1, D *c2, D *c3) {
  const unsigned e0 = *reinterpret_cast<const unsigned *>(s0), e1 = *reinterpret_cast<const unsigned *>(s1);
  const unsigned ec = rot ? e1 : e0;
  const uint4 ax = fp8_ld16(rot ? a1 : a0), ay = fp8_ld16(rot ? a0 : a1);
  const uint4 bx = fp8_ld16(rot ? b1 : b0), by = fp8_ld16(rot ? b0 : b1);
  const uint4 cx = fp8_ld16(rot ? c1 : c0), cy = fp8_ld16(rot ? c0 : c1);
  if ((fp8_big_scales(e0) | fp8_big_scales(e1)) == 0u) {
    fp8_cvt_pair<false>(ax, ay, e0 >> sh, rot, a0, a1, a2, a3);
    fp8_cvt_pair<false>(bx, by, e1 >> sh, rot, b0, b1, b2, b3);
    fp8_cvt_pair<false>(cx, cy, ec >> 16, rot, c0, c1, c2, c3);
  } else {
    fp8_cvt_pair<true>(ax, ay, e0 >> sh, rot, a0, a1, a2, a3);
    fp8_cvt_pair<true>(bx, by, e1 >> sh, rot, b0, b1, b2, b3);
    fp8_cvt_pair<true>(cx, cy, ec >> 16, rot, c0, c1, c2, c3);
  }
}
// V3.2: 16 staged e4m3 bytes w times the fp32 scale s, stored as bf16: dims [0, 8) -> lo, [8, 16) -> hi. Each
// code is widened exactly (e4m3x2 -> f16x2, low byte to the low half; f16 -> f32), multiplied by s in fp32
// (mul.rn.f32: round to nearest, subnormals kept, never fused) and rounded to bf16 once (cvt.rn.bf16x2.f32).
template <typename D>
__device__ __forceinline__ void v32_cvt_store(const uint4 w, float s, D *lo, D *hi) {
  const unsigned in[4] = {w.x, w.y, w.z, w.w};
  unsigned out[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const unsigned short codes = static_cast<unsigned short>(in[i] >> (16 * h));  // dims 4 i + 2 h, + 1
      unsigned halves;
      float a, b;
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(codes));
      asm("{\n.reg .b16 l, u;\nmov.b32 {l, u}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, u;\n}"
          : "=f"(a), "=f"(b) : "r"(halves));
      asm("mul.rn.f32 %0, %0, %1;" : "+f"(a) : "f"(s));
      asm("mul.rn.f32 %0, %0, %1;" : "+f"(b) : "f"(s));
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out[2 * i + h]) : "f"(b), "f"(a));  // a to the low half
    }
  }
  *reinterpret_cast<uint4 *>(lo) = make_uint4(out[0], out[1], out[2], out[3]);
  *reinterpret_cast<uint4 *>(hi) = make_uint4(out[4], out[5], out[6], out[7]);
}
// A pair of groups (32 dims) of a V3.2 row, staged and stored as fp8_cvt_pair's.
template <typename D>
__device__ __forceinline__ void v32_cvt_pair(const uint4 x, const uint4 y, float s, bool rot, D *o0, D *o1, D *o2,
                                             D *o3) {
  v32_cvt_store(x, s, rot ? o2 : o0, rot ? o3 : o1);
  v32_cvt_store(y, s, rot ? o0 : o2, rot ? o1 : o3);
}
// One half (256 dims, 8 pairs) of one V3.2 ring row, pairs a (= lane: the half's first 128 dims) and b (= lane + 4:
// its second 128), the half's two fp32 scales at s (in a's third chunk: loaded before a's stores). Pair b is
// loaded after a is stored (their chunks are disjoint): fewer live registers, no spills.
template <typename D>
__device__ __forceinline__ void v32_cvt_row(const D *s, bool rot, D *a0, D *a1, D *a2, D *a3, D *b0, D *b1, D *b2,
                                            D *b3) {
  const float2 scale = *reinterpret_cast<const float2 *>(s);
  const uint4 ax = fp8_ld16(rot ? a1 : a0), ay = fp8_ld16(rot ? a0 : a1);
  v32_cvt_pair(ax, ay, scale.x, rot, a0, a1, a2, a3);
  const uint4 bx = fp8_ld16(rot ? b1 : b0), by = fp8_ld16(rot ? b0 : b1);
  v32_cvt_pair(bx, by, scale.y, rot, b0, b1, b2, b3);
}
"""


def paged_fp8_program(h_q: int, layout_name: str):
    """The TileLang PrimFunc for one h_q and cache layout ("MODEL1" or "V32"); s_q, topk and the caches'
    sizes are symbolic."""
    if h_q % HEADS_PER_CTA:
        raise ValueError(f"h_q: expected a multiple of {HEADS_PER_CTA}, got {h_q}")
    if layout_name not in LAYOUTS:
        raise ValueError(f"layout_name: expected one of {sorted(LAYOUTS)}, got {layout_name!r}")
    layout = LAYOUTS[layout_name]
    model1 = layout is kv_cache.MODEL1
    d_qk = layout.d
    token16 = (MODEL1_DATA_BYTES if model1 else layout.bytes_per_token) // 16  # token data stride / 16
    s_q, n_bytes, n_bytes1, topk, n_lengths = T.dynamic("s_q, n_bytes, n_bytes1, topk, n_lengths")
    head_tiles = h_q // HEADS_PER_CTA
    H, BI, DH = HEADS_PER_CTA, BLOCK_TOPK, D_V // 2
    bf16, f32, i32, i64 = T.bfloat16, T.float32, T.int32, T.int64
    bufs = (0, 1)

    # ---- producer (the module docstring says how it stages and converts; the macros say what each step does) ----
    rows_per_pass = 32  # 4 threads per ring row
    passes = BI // rows_per_pass
    assert passes == 2  # consumer_convert's MODEL1 right half takes a thread's two rows in one call

    def producer_registers():
        """Producer-thread locals (allocated once; a plain helper may allocate, see consumer_fragments)."""
        return types.SimpleNamespace(
            # (data offset / 16 (-1: invalid), MODEL1: scale offset / 8) of the current row
            row=T.alloc_local([2], i32),
            slot=T.alloc_local([1], i32),
            nxt=T.alloc_local([1], i32),  # the next pair's Indices entry (prefetched one pair ahead)
            sel=T.alloc_local([1], i32),  # index phase: the entry's cache (0 or 1)
            bb16=T.alloc_local([1], i32),  # index phase: that cache's block_bytes16
            bs=T.alloc_local([1], i32),  # index phase: that cache's block_size
        )

    def ring_row(t, r):
        """Ring row of thread t (of the producer, or of the converting consumer) in pass r: 4 lanes per
        row. A pair of groups P (dims 32P..32P+31 of a half) has its output chunks at 16-byte chunks
        4P..4P+3 of the half row: within a 64-column tile at chunks {0..3} (P even) or {4..7} (P odd),
        swizzled by chunk ^ (row % 8). The 8 threads of a quarter warp (rows u, u + 1 before the twist)
        get rows x and x ^ 3 (mod 8): opposite parity and bit 1, which with the lane orders of
        issue_half and fp8_cvt_pair keeps every 16-byte shared access of the quarter warp on distinct
        bank groups."""
        u = t // 4
        return r * rows_per_pass + T.bitwise_xor(u, T.shift_left(T.bitwise_and(u, 1), 1))

    def scale_col(kk):
        """Where lane kk stages a row's scales for its half: in chunk 4 kk + 2 (the output of its pair kk's
        second group, not a staging slot), at byte 4 (kk // 2) (MODEL1: a 4-byte word of ue8m0 bytes) or
        8 (kk // 2) (V3.2: the half's two fp32 scales), so that lanes kk and kk + 2 use other banks."""
        return 32 * kk + 16 + (2 if model1 else 4) * (kk // 2)

    @T.macro
    def issue_half(g, pr, b, half, t):
        """cp.async (no registers, all in flight together) of (buffer b, half)'s bytes for thread t's rows
        (ring_row(t, r)), zero-filled for invalid rows (nothing is read then). Lane kk = t % 4 copies
        16-byte piece kk % 2 of pairs 2q + kk // 2: the two lanes of a 32-byte sector write the two
        chunks of one 32-byte slot (chunks 4P, 4P + 1: the pair's first two output chunks):
          MODEL1 left  (kv_l, NoPE dims 0..255): pairs 0..7 (q = 0..3); the scale word (bytes 0..3) ->
                 scale_col(kk) (the converting lane kk reads it there);
          MODEL1 right (kv_r, dims 256..511): NoPE pairs 0..5 (q = 0..2); RoPE bf16 dims [448 + 8 i, +8),
                 i = kk + 4 q (q ^ 1 in odd-u rows) -> kv_r[j, 192 + 8 i] (tile 3, final place); scale bytes
                 4..7 -> scale_col(kk);
          V3.2 left / right (dims 0..255 / 256..511): pairs 0..7 (q = 0..3); the half's two fp32 scales
                 (scales 0, 1 / 2, 3) -> scale_col(kk); right also RoPE bf16 dims [512 + 8 i, +8) ->
                 k_t[j, 8 i] (final place), i as for MODEL1.
        valid[b, j] is written by lane 0 in the buffer's first-filled half (its
        previous readers are done: they read it before freeing that half)."""
        kk = t % 4
        piece = kk % 2
        for r in T.unroll(passes):
            j = ring_row(t, r)
            pr.row[0] = g.row_data16[b, j]
            if model1:
                pr.row[1] = T.if_then_else(pr.row[0] >= 0, g.row_scale8[b, j], 0)
            if (b, half) in ((0, 0), (1, 1)):
                if kk == 0:
                    # through an extern store: a plain one makes the thread-sync planner put a producer
                    # barrier between issue_half's two instances in fill_pair (it cannot see that they
                    # exclude each other)
                    T.evaluate(T.call_extern("handle", "st_mask", T.address_of(g.valid[b, j]), pr.row[0] >= 0))
            # row_data16 = (data offset / 16) | (cache << 30) for valid rows, -1 for invalid ones (then: cache
            # bit 1, offset 0: an in-bounds address, not read)
            sel = T.bitwise_and(T.shift_right(pr.row[0], 30), 1)
            src = T.Cast(i64, T.bitwise_and(T.max(pr.row[0], 0), DATA16_MASK)) * 16
            b8 = (T.address_of(g.Cache8[0]), T.address_of(g.Cache8_1[0]))
            # (the scales are copied through the e4m3 views too: cp.async moves raw bytes, and one base per
            # row means one 64-bit select per row, shared by all of the row's cp.async)
            kv = g.kv_r[b] if half else g.kv_l[b]
            for q in T.unroll(3 if model1 and half == 1 else 4):
                pair = 2 * q + kk // 2
                T.evaluate(T.call_extern("handle", "fp8_cp16s", T.address_of(kv[j, 32 * pair + 8 * piece]),
                                         *b8, sel, src + DH * half + 32 * pair + 16 * piece, pr.row[0] >= 0))
            if half == 1:
                for q in T.unroll(2):
                    rope = kk + 4 * T.bitwise_xor(q, t // 4 % 2)  # odd u: the other 64 bytes first (other banks)
                    if model1:
                        T.evaluate(T.call_extern("handle", "fp8_cp16s",
                                                 T.address_of(kv[j, MODEL1_ROPE - DH + 8 * rope]),
                                                 *b8, sel, src + MODEL1_ROPE + 16 * rope, pr.row[0] >= 0))
                    else:
                        T.evaluate(T.call_extern("handle", "fp8_cp16s", T.address_of(g.k_t[b][j, 8 * rope]),
                                                 *b8, sel, src + V32_ROPE + 16 * rope, pr.row[0] >= 0))
            if model1:
                T.evaluate(T.call_extern("handle", "fp8_cp4s", T.address_of(kv[j, scale_col(kk)]),
                                         *b8, sel, T.Cast(i64, pr.row[1]) * 8 + 4 * half, pr.row[0] >= 0))
            else:
                T.evaluate(T.call_extern("handle", "fp8_cp8s", T.address_of(kv[j, scale_col(kk)]),
                                         *b8, sel, src + V32_SCALES + 8 * half, pr.row[0] >= 0))

    def chunks(kv, j, pair):
        """The four output chunks of a pair of groups in ring row j of a half (its staging in the first two)."""
        return [T.address_of(kv[j, 32 * pair + 8 * m]) for m in range(4)]

    @T.macro
    def consumer_convert(ns, c, b, half):
        """Consumer c, after (buffer b, half)'s ready barrier: its thread t converts, in place, the pairs
        of its rows ring_row(t, 0), ring_row(t, 1) that lane kk = t % 4 owns: left (and V3.2's right),
        pairs kk and kk + 4 of each row; MODEL1's right, pair kk of each row and pair 4 + kk % 2 of row 1
        (kk >= 2) or row 0. Then fence.proxy.async and a barrier of the consumer's 128 threads before the S
        that reads the half. The other consumer reads the half only after the max exchange. (Any thread
        may convert any pair once the ready barrier completed: every staged byte has landed; each pair has
        one converter.)"""
        t = T.get_thread_binding() % 128
        kk = t % 4
        rot = T.Cast(T.bool, kk // 2)  # lanes 2, 3 take their chunks in the other order (fp8_cvt_pair)
        if not model1:
            for r in T.unroll(passes):
                j = ring_row(t, r)
                T.evaluate(T.call_extern("handle", "v32_cvt_row", T.address_of(
                    (ns.kv_r[b] if half else ns.kv_l[b])[j, scale_col(kk)]), rot,
                    *chunks(ns.kv_r[b] if half else ns.kv_l[b], j, kk),
                    *chunks(ns.kv_r[b] if half else ns.kv_l[b], j, kk + 4)))
        elif half == 0:
            for r in T.unroll(passes):
                j = ring_row(t, r)
                T.evaluate(T.call_extern("handle", "fp8_cvt_left", T.address_of(ns.kv_l[b][j, scale_col(kk)]),
                                         8 * (kk // 2), 8 * (2 + kk // 2), rot,
                                         *chunks(ns.kv_l[b], j, kk), *chunks(ns.kv_l[b], j, kk + 4)))
        else:
            j0, j1 = ring_row(t, 0), ring_row(t, 1)
            T.evaluate(T.call_extern("handle", "fp8_cvt_right", T.address_of(ns.kv_r[b][j0, scale_col(kk)]),
                                     T.address_of(ns.kv_r[b][j1, scale_col(kk)]), 8 * (kk // 2), rot,
                                     *chunks(ns.kv_r[b], j0, kk), *chunks(ns.kv_r[b], j1, kk),
                                     *chunks(ns.kv_r[b], T.if_then_else(kk >= 2, j1, j0), 4 + kk % 2)))
        T.fence_proxy_async()
        T.sync_threads(6 + c, 128)

    def free_of(g, b, half):
        return g.free_r[b] if half else g.free_l[b]

    @T.macro
    def fill_pair(g, pr, order, phase, t):
        """Thread t's share of one pair: per (buffer, half) in `order`, wait until the slot is free,
        cp.async its raw bytes and arrive on the half's ready barrier when they land (the consumer that
        reads the half first converts it)."""
        for b, half in order:
            T.barrier_wait(free_of(g, b, half), phase)
            issue_half(g, pr, b, half, t)
            T.cp_async_barrier_noinc(g.ready_r[b] if half else g.ready_l[b])

    consumers = consumer_parts(h_q, d_qk, after_ready=consumer_convert)

    @T.prim_func
    def kernel(
        Q: T.Tensor([s_q, h_q, d_qk], bf16),
        Cache8: T.Tensor([n_bytes], T.float8_e4m3fn),  # cache 0 (paged, `layout`), flat bytes
        Cache8_1: T.Tensor([n_bytes1], T.float8_e4m3fn),  # cache 1 (the same layout, its own page size)
        Indices: T.Tensor([s_q, topk], i32),  # slot ids
        TopkLength: T.Tensor([n_lengths], i32),  # read only when use_topk_length != 0
        Sink: T.Tensor([h_q], f32),  # read only when use_sink != 0
        Out: T.Tensor([s_q, h_q, D_V], bf16),
        Lse: T.Tensor([s_q, h_q], f32),
        scale2: T.float32,  # sm_scale * log2(e)
        use_topk_length: T.int32,
        use_sink: T.int32,
        n_ctas: T.int32,  # grid size (<= s_q * head_tiles); CTA b serves items b, b + n_ctas, ...
        n_slots0: T.int32,  # cache 0's num_blocks * block_size: slots [0, n_slots0) are cache 0's
        n_slots1: T.int32,  # cache 1's: slots [n_slots0, n_slots0 + n_slots1) are cache 1's (minus n_slots0)
        block_size0: T.int32,  # cache 0's tokens per page block
        block_size1: T.int32,  # cache 1's
        block_magic0: T.int32,  # cache 0's block_division(block_size0): the multiplier (as int32 bits) ...
        block_magic1: T.int32,
        block_shift0: T.int32,  # ... and the shift
        block_shift1: T.int32,
        block_bytes16_0: T.int32,  # cache 0's page block stride in bytes / 16
        block_bytes16_1: T.int32,  # cache 1's
    ):
        with T.Kernel(n_ctas, threads=384, prelude=PRELUDE) as bx:
            q_l = T.alloc_shared([H, DH], bf16)
            q_r = T.alloc_shared([H, DH], bf16)
            # Buffer b holds block 2p + b of pair p: columns [0, 256) in kv_l[b], [256, 512) in kv_r[b], V3.2's
            # RoPE (K columns [512, 576)) in k_t[b].
            kv_l = [T.alloc_shared([BI, DH], bf16) for _ in bufs]
            kv_r = [T.alloc_shared([BI, DH], bf16) for _ in bufs]
            p_1 = T.alloc_shared([H, BI], bf16)
            if model1:
                q_t = k_t = None
                p_0 = T.alloc_shared([H, BI], bf16)
            else:
                q_t = T.alloc_shared([H, d_qk - D_V], bf16)
                k_t = [T.alloc_shared([BI, d_qk - D_V], bf16) for _ in bufs]
                p_0 = k_t[0]  # as in sparse_mla_sm90 at d_qk 576: P of buffer 0 in its tail once S is done
            p_smem = (p_0, p_1)
            valid = T.alloc_shared([2, BI], f32)  # additive mask, as in sparse_mla_sm90
            # producer only: per (buffer, row) of the current pair, the token's data offset / 16 (-1: invalid)
            # and (MODEL1) its scales' offset / 8 (int32: caches up to 16 GB)
            row_data16 = T.alloc_shared([2, BI], i32)
            row_scale8 = T.alloc_shared([2, BI], i32) if model1 else None
            max_smem = T.alloc_shared([2, H], f32)
            sum_smem = T.alloc_shared([H], f32)
            final_smem = T.alloc_shared([H], f32)

            ring = consumers.ring(
                Q=Q, q_l=q_l, q_r=q_r, q_t=q_t, kv_l=kv_l, kv_r=kv_r, k_t=k_t, p_smem=p_smem, valid=valid,
                max_smem=max_smem, sum_smem=sum_smem, final_smem=final_smem, Out=Out, Lse=Lse, Sink=Sink,
                use_sink=use_sink, scale2=scale2, bx=bx, n_ctas=n_ctas, n_items=s_q * head_tiles, topk=topk)
            tx = T.get_thread_binding()
            # Programmatic dependent launch: this CTA may start while the previous kernel of the stream
            # finishes; it waits for that kernel before any global access and lets the next one launch.
            T.pdl_sync()
            T.pdl_trigger()

            if tx < 128:
                T.set_max_nreg(CONSUMER_NREG, 1)
                final = T.alloc_fragment([H], f32)
                lse = T.alloc_fragment([H], f32)
                consumers.consumer0(ring, consumers.fragments(), final, lse)
            elif tx < 256:
                T.set_max_nreg(CONSUMER_NREG, 1)
                consumers.consumer1(ring, consumers.fragments())
            else:
                # Producer: loads Q (thread 0, TMA), then per pair stages the raw fp8 bytes of
                # blocks 2p and 2p + 1 in the ring with cp.async, half by half in the order the consumers
                # need them (see fill_pair); the consumers convert them.
                T.set_max_nreg(PRODUCER_NREG, 0)
                t = tx - 256
                g = types.SimpleNamespace(free_l=ring.free_l, free_r=ring.free_r, ready_l=ring.ready_l,
                                          ready_r=ring.ready_r, valid=valid, kv_l=kv_l, kv_r=kv_r, k_t=k_t,
                                          Cache8=Cache8, Cache8_1=Cache8_1, row_data16=row_data16,
                                          row_scale8=row_scale8)
                pr = producer_registers()
                limit = T.alloc_var(i32)
                for k in T.serial(ring.n_local):
                    s_i, h0 = consumers.item_rows(ring, k)
                    limit = T.if_then_else(use_topk_length != 0, T.min(topk, TopkLength[s_i]), topk)
                    consumers.load_q(ring, k, s_i, h0, t)
                    for p in T.serial(ring.n_pairs):
                        phase = ((k * ring.n_pairs + p) & 1) ^ 1
                        # Index phase: thread t resolves entry t of the pair (row t % 64 of buffer t // 64) to
                        # its token's addresses. The Indices entry was loaded one pair ahead (pr.nxt; the
                        # first pair of an item loads it here). TileLang's thread-sync pass puts
                        # producer-only barriers (128 threads) between these writes and the reads in
                        # issue_half (and before the next pair's writes).
                        pos = 2 * p * BI + t
                        if p == 0:
                            pr.nxt[0] = Indices[s_i, T.min(pos, topk - 1)]
                        pr.slot[0] = T.if_then_else(pos < limit, pr.nxt[0], -1)
                        pr.nxt[0] = Indices[s_i, T.min(pos + 2 * BI, topk - 1)]  # next pair's (clamped)
                        # Entry s < n_slots0 is cache 0's slot s, n_slots0 <= s < n_slots0 + n_slots1 is cache
                        # 1's slot s - n_slots0; anything else (or past the limit) is invalid: slot -1 below.
                        pr.sel[0] = T.if_then_else(pr.slot[0] >= n_slots0, 1, 0)  # cache bit
                        pr.slot[0] = T.if_then_else(
                            (pr.slot[0] >= 0) & (pr.slot[0] < n_slots0 + n_slots1),
                            pr.slot[0] - T.if_then_else(pr.sel[0] != 0, n_slots0, 0), -1)  # slot in its cache
                        pr.bb16[0] = T.if_then_else(pr.sel[0] != 0, block_bytes16_1, block_bytes16_0)
                        pr.bs[0] = T.if_then_else(pr.sel[0] != 0, block_size1, block_size0)
                        # page block (a multiply and shifts, paged_block_of) and token in the block
                        pr.row[0] = T.call_extern(
                            "int32", "paged_block_of", T.max(pr.slot[0], 0),
                            T.if_then_else(pr.sel[0] != 0, block_magic1, block_magic0),
                            T.if_then_else(pr.sel[0] != 0, block_shift1, block_shift0))
                        pr.row[1] = T.max(pr.slot[0], 0) - pr.row[0] * pr.bs[0]
                        # data offset / 16 < 2^30 (caches <= 16 GiB): bit 30 carries the cache
                        row_data16[t // BI, t % BI] = T.if_then_else(
                            pr.slot[0] >= 0,
                            T.bitwise_or(pr.row[0] * pr.bb16[0] + pr.row[1] * token16,
                                         T.shift_left(pr.sel[0], 30)), -1)
                        if model1:
                            # scales at block * block_bytes + block_size * 576 + token * 8 (in the row's cache;
                            # used only when valid)
                            row_scale8[t // BI, t % BI] = (pr.row[0] * pr.bb16[0] * 2
                                                           + pr.bs[0] * (MODEL1_DATA_BYTES // MODEL1_SCALE_BYTES)
                                                           + pr.row[1])
                        if (k > 0) & (p == 0):
                            # buffer 1 may still hold the previous item's O: buffer 0 first
                            fill_pair(g, pr, GATHER_ORDER_NEXT_ITEM, phase, t)
                        else:
                            fill_pair(g, pr, GATHER_ORDER, phase, t)

    return kernel


@functools.cache
def compiled_kernel(h_q: int, layout_name: str):
    """Compiled once per process, h_q and layout ("MODEL1" or "V32"); TileLang's disk cache
    (TILELANG_CACHE_DIR) makes later processes skip nvcc."""
    return tilelang.compile(paged_fp8_program(h_q, layout_name), target=SM90_TARGET, pass_configs=PASS_CONFIGS,
                            compile_flags=COMPILE_FLAGS)


@functools.cache
def block_division(block_size: int) -> tuple[int, int]:
    """(multiplier as int32 bits, shift) with which the kernel's paged_block_of divides a slot s < 2^31 by
    block_size: floor(s / block_size) = floor(2 s m / 2^32) >> shift, m = ceil(2^(31 + shift) / block_size),
    shift = ceil(log2(block_size)) (a power of two 2^k: m = 2^31, shift k)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size < 2 ** 31:
        raise ValueError(f"block_size: expected an int in [1, 2^31), got {block_size!r}")
    shift = (block_size - 1).bit_length()
    magic = -(-(1 << (31 + shift)) // block_size)
    assert magic < 1 << 32
    return magic - (1 << 32) if magic >= 1 << 31 else magic, shift


@dataclass(frozen=True)
class PagedCache:
    """One cache as the kernel takes it: its flat e4m3 view (the block bytes from the first block's start to
    the last block's data; a block's padding past its tokens is never read), layout, slot count, page size
    and block stride / 16."""

    flat: torch.Tensor
    layout: kv_cache.Fp8KvLayout
    n_slots: int
    block_size: int
    block_bytes16: int


def cache_views(cache: torch.Tensor, name: str = "cache") -> PagedCache:
    """The kernel's view of a paged fp8 cache [num_blocks, block_size, 1, bytes_per_token] (uint8, or
    float8_e4m3fn, as from kv_cache.new_fp8_kv_cache) in kv_cache.MODEL1 (584 B) or kv_cache.V32 (656 B).
    Errors name the argument `name`."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise TypeError(f"{name}: expected dtype torch.uint8 (or torch.float8_e4m3fn, the same bytes), "
                        f"got {cache.dtype}")
    by_bytes = {layout.bytes_per_token: layout for layout in LAYOUTS.values()}
    if cache.dim() != 4 or cache.size(2) != 1 or cache.size(3) not in by_bytes:
        raise ValueError(f"{name}: expected shape [num_blocks, block_size, 1, bytes_per_token in {sorted(by_bytes)}] "
                         f"({', '.join(LAYOUTS)}), got {tuple(cache.shape)}")
    layout = by_bytes[cache.size(3)]
    num_blocks, block_size = cache.shape[:2]
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"{name}: expected num_blocks >= 1 and block_size >= 1, got shape {tuple(cache.shape)}")
    if cache.stride(3) != 1 or cache.stride(1) != layout.bytes_per_token:
        raise ValueError(f"{name}: expected token stride {layout.bytes_per_token} and a contiguous last dim, "
                         f"got strides {cache.stride()}")
    if num_blocks > 1 and cache.stride(0) < block_size * layout.bytes_per_token:
        raise ValueError(f"{name}: block stride {cache.stride(0)} overlaps blocks of {block_size} tokens")
    cache_u8 = cache.view(torch.uint8)
    stride0 = cache_u8.stride(0) if num_blocks > 1 else kv_cache.block_bytes(layout, block_size)
    # 16-byte cp.async: every token's data (block * stride0 + t * 576 or t * 656) must be 16-byte aligned.
    if stride0 % 16 != 0 or cache_u8.data_ptr() % 16 != 0:
        raise ValueError(f"{name}: expected a 16-byte aligned base and block stride, got data_ptr % 16 = "
                         f"{cache_u8.data_ptr() % 16}, block stride {stride0} (strides {cache_u8.stride()})")
    n_bytes = (num_blocks - 1) * stride0 + block_size * layout.bytes_per_token
    # the kernel's int32 offsets: data / 16 in 30 bits; MODEL1's scales / 8 (block * stride / 8 + block_size * 72)
    if n_bytes + block_size * MODEL1_DATA_BYTES >= 2 ** 34:
        raise ValueError(f"{name}: {n_bytes} bytes; this kernel addresses at most 16 GiB per cache")
    flat = torch.as_strided(cache_u8, (n_bytes,), (1,)).view(torch.float8_e4m3fn)
    return PagedCache(flat, layout, num_blocks * block_size, block_size, stride0 // 16)


def sparse_mla_fwd_sm90_paged_fp8(q: torch.Tensor, cache0: torch.Tensor, cache1: torch.Tensor | None,
                                       indices: torch.Tensor, sm_scale: float,
                                       attn_sink: torch.Tensor | None = None,
                                       topk_length: torch.Tensor | None = None,
                                       cache_names: tuple[str, str] = ("cache0", "cache1"),
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [s_q, h_q, d_qk] bf16 (d_qk 512 for MODEL1 caches, 576 for V3.2); cache0, cache1 [num_blocks_i,
    block_size_i, 1, bytes_per_token] uint8 in one layout, kv_cache.MODEL1 or kv_cache.V32 (separate tensors,
    any num_blocks, block_size and block stride each; cache1 may be None); indices [s_q, topk] or
    [s_q, 1, topk] int32: entry s in [0, n_slots0) is cache0's slot s, s in [n_slots0, n_slots0 + n_slots1)
    is cache1's slot s - n_slots0 (n_slots_i = num_blocks_i * block_size_i), anything else is invalid (masked,
    never read). One softmax over all of a query's entries. cache_names: the caller's names for cache0 and
    cache1 in the errors of the layout checks.
    -> (out [s_q, h_q, 512] bf16, lse [s_q, h_q] fp32 base 2)."""
    name0, name1 = cache_names
    c0 = cache_views(cache0, name0)
    d_qk = c0.layout.d
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.dim() != 3 or q.size(2) != d_qk:
        raise TypeError(f"q: expected a bf16 tensor [s_q, h_q, {d_qk}] ({name0} holds {c0.layout.name} rows), got "
                        f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    s_q, h_q = q.shape[:2]
    if h_q not in TILELANG_HEADS:
        raise ValueError(f"q: expected h_q in {TILELANG_HEADS} ({HEADS_PER_CTA} heads per CTA), got {h_q}")
    require_sm90_device(q)
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32:
        raise TypeError(f"indices: expected an int32 tensor, got {getattr(indices, 'dtype', type(indices).__name__)}")
    if indices.dim() == 3 and indices.size(1) == 1:
        indices = indices[:, 0, :]
    if indices.dim() != 2 or indices.size(0) != s_q or indices.size(1) < 1:
        raise ValueError(f"indices: expected shape [{s_q}, topk >= 1], got {tuple(indices.shape)}")
    if not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale: expected a finite positive float, got {sm_scale!r}")
    if topk_length is not None and (not isinstance(topk_length, torch.Tensor) or topk_length.dtype != torch.int32
                                    or tuple(topk_length.shape) != (s_q,)):
        raise ValueError(f"topk_length: expected int32 [{s_q}], got {getattr(topk_length, 'dtype', None)} "
                         f"{tuple(getattr(topk_length, 'shape', ()))}")
    if attn_sink is not None and (not isinstance(attn_sink, torch.Tensor) or attn_sink.dtype != torch.float32
                                  or tuple(attn_sink.shape) != (h_q,)):
        raise ValueError(f"attn_sink: expected fp32 [{h_q}], got {getattr(attn_sink, 'dtype', None)} "
                         f"{tuple(getattr(attn_sink, 'shape', ()))}")
    if cache1 is None:
        # one cache: cache 1 = cache 0's view, never selected (no entry maps to it)
        c1 = PagedCache(c0.flat, c0.layout, 0, c0.block_size, c0.block_bytes16)
    else:
        c1 = cache_views(cache1, name1)
        if c1.layout is not c0.layout:
            raise ValueError(f"{name1}: expected the layout of {name0} ({c0.layout.name}), got {c1.layout.name}")
    if c0.n_slots + c1.n_slots >= 2 ** 31:
        raise ValueError(f"{name0}, {name1}: {c0.n_slots} + {c1.n_slots} slots; the int32 indices address < 2^31")
    for name, t in ((name0, cache0), (name1, cache1), ("indices", indices), ("topk_length", topk_length),
                    ("attn_sink", attn_sink)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (same as q), got {t.device}")
    out = torch.empty((s_q, h_q, D_V), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((s_q, h_q), dtype=torch.float32, device=q.device)
    if s_q == 0:
        return out, lse
    device = q.device
    lengths, sink = lengths_and_sink(device, h_q, topk_length, attn_sink)
    kernel = compiled_kernel(h_q, c0.layout.name)
    n_ctas = min(s_q * (h_q // HEADS_PER_CTA), sm_count(device))
    (magic0, shift0), (magic1, shift1) = block_division(c0.block_size), block_division(c1.block_size)
    kernel(_aligned_operand(q, "q"), c0.flat, c1.flat, _dense(indices), lengths, sink, out, lse,
           float(sm_scale) * LOG2E, int(topk_length is not None), int(attn_sink is not None), n_ctas,
           c0.n_slots, c1.n_slots, c0.block_size, c1.block_size, magic0, magic1, shift0, shift1,
           c0.block_bytes16, c1.block_bytes16)
    return out, lse
