"""TileLang sparse MLA prefill kernel for Hopper (SM90).

Contract: FlashMLA's sparse prefill (docs/contract.md, "Prefill"), in two variants (one compile each):
  q [s_q, h_q, d_qk] bf16, kv [s_kv, 1, d_qk] bf16, indices [s_q, topk] int32 (absolute kv rows),
  attn_sink [h_q] fp32 or None, topk_length [s_q] int32 or None
  -> sparse_mla_fwd_sm90: out [s_q, h_q, 512] bf16, lse [s_q, h_q] fp32 in BASE 2 (the engine's
     convention);
  -> sparse_mla_fwd_sm90_with_max_logits (FlashMLA's flash_mla_sparse_fwd results): out, max_logits
     [s_q, h_q] fp32 (natural scale: max of the valid entries' q.k * sm_scale), lse [s_q, h_q] fp32 in
     NATURAL log. The variant differs in the epilogue only: the running max, kept in the exp2 domain
     (sm_scale * log2(e) folded in), and the base-2 lse are multiplied by ln 2 before they are stored;
     the loop, out and its bits are the base-2 variant's.
  out: a new tensor, or the caller's (contiguous, 16-byte aligned: the kernel stores it by TMA;
  anything else is refused by name, never copied), written in place.
  Entry j of row i is valid iff 0 <= idx < s_kv and j < topk_length[i]; validity is tested
  explicitly in the kernel (a zero-filled key would score 0, not -inf) and an invalid entry's kv row
  is never read. Every access is in range by construction, so TileLang's safe memory access (bounds
  re-tested on every load) is off.
  Empty row: out 0, lse +inf, max_logits -inf. Sink: out *= 1 / (1 + 2^(sink * log2(e) - lse2)) with
  the base-2 lse2, lse and max_logits unchanged. A row that selects a NaN: out and lse NaN (the
  oracle's); its max_logits does not propagate the NaN (the row max is fmax, which skips NaN).

Numerics: bf16 operands, fp32 accumulators (QK^T and PV on wgmma), fp32 online softmax in base 2
(scores scaled by sm_scale * log2(e)); P, taken at the pair's row max, is rounded to bf16 once for
both P V products that use it. Built with --use_fast_math: exp2 / log2 are ex2 / lg2.approx.ftz
(relative error ~2^-22; results below 2^-126 flush to 0), 1 / row sum an approximate reciprocal.

Schedule (persistent: a grid of min(#items, #SMs) CTAs of 384 threads, hand-written warp
specialization; an item is one query row x 64 heads and CTA b serves items b, b + grid, ...).
The top-k list is walked in PAIRS of 64-entry blocks: block 2p goes to shared buffer 0, block 2p + 1
to buffer 1 (an odd last block is paired with an all-invalid one).
  producer warpgroup: per item, its thread 0 loads Q by TMA (one 64 x 64 box per 64 columns,
    signalled on `q_ready`) as soon as both consumers' last S of the previous item is done (`q_free`),
    so Q and the next item's first gathers overlap the previous item's last P V and epilogue; per pair
    all 128 threads load the 128 indices, test validity, and gather the rows with predicated 16-byte
    cp.async (an invalid entry zero-fills its row, source size 0, so kv is never read) half by half
    (columns [0, 256) and [256, d_qk)) in the order the consumers need them, each half signalling its
    own mbarrier (cp.async.mbarrier.arrive);
  consumer c (c = 0, 1): S_c = Q K_c^T for buffer c's block (wgmma), masks invalid entries to -inf;
    both publish their block's row max and take the pair's max (running max, both blocks) from
    shared memory (a named barrier each way); P_c = exp2(S_c - max) in bf16;
    O[:, 256c : 256c + 256] += P_c V_c (P from registers) + P_(1-c) V_(1-c) (the other consumer's P
    through shared memory). Both consumers do the same work, so neither waits long for the other.
    (FlashMLA lets consumer 0 run ahead on its own block's max and rescale its P and O to the pair's
    max afterwards; here the symmetric exchange measured 3-7% faster on the model shapes,
    docs/lab/tilelang.md.) The row sum is split between the consumers and added at the end.
  A buffer half is released (`free`) by the last consumer that reads it.
  Epilogue: each consumer writes its O half into buffer 1's half it was the last reader of (stmatrix)
    and one thread stores it with TMA (row-contiguous bulk stores; 4-byte stores from the fragments
    cost ~40% of the V4-Flash time); that half is released once the store has read it, and the
    producer fills buffer 0 first in the next item while the store drains; the store's global
    writes stay in flight while the CTA starts its next item.
  No wgmma is in flight across a loop back edge: ptxas then serializes every wgmma of the kernel
  (warning C7515; a CPU test runs ptxas on the generated PTX and fails on it or on spills).

Constraints: h_q in {64, 128} (tiled by 64 heads per CTA), d_qk in {512, 576} (V = first 512
columns), any topk >= 1 (the last block is masked by position, nothing is padded on the host).
s_q, s_kv and topk are symbolic and sink / topk_length are runtime switches: one compile per
(h_q, d_qk, variant), cached on disk by TileLang (TILELANG_CACHE_DIR) and memoized per process.

Deviations: bf16 only (fp32 q: TypeError). Inputs whose strides are not dense are made contiguous
on the host (the kernel assumes dense row-major tensors).
"""

import functools
import math
import types

import tilelang
import tilelang.language as T
import torch

from ..platform import cuda_capability, sm_count
from ..checks import TILELANG_HEADS, check_out, check_sparse_mla_args

D_V = 512
HEADS_PER_CTA = 64
BLOCK_TOPK = 64  # top-k entries per pipeline step
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
PASS_CONFIGS = {
    # The warp specialization is written by hand (producer + two consumers with mbarriers).
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    # Safe memory access re-tests bounds the kernel already guarantees (every row, index and query it
    # reads is in range by construction; invalid kv rows are never read) on every cp.async.
    tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True,
}
# Device helpers shared with the paged fp8 kernel.
PRELUDE = r"""
// The consumers' additive mask: 0 for a valid entry, -inf for an invalid one. Stored through this
// helper because a plain shared-memory store in the producer makes TileLang's thread-sync planner put
// producer-wide barriers around it.
template <typename D>
__device__ __forceinline__ void st_mask(D *p, bool valid) {
  *p = valid ? 0.0f : -INFINITY;
}
"""
# exp2 / log2 as single ex2 / lg2.approx.ftz instructions (without it each exp2 carries a range test
# and two multiplies). A compile flag rather than TileLang's fast-math pass config, so that the PTX the
# CPU tests hand to ptxas (kernel._get_ptx) is built the same way as the binary.
COMPILE_FLAGS = ["--use_fast_math"]


# Order in which the producer fills the (buffer, half) slots of a pair: the order the consumers read
# them, except for the first pair of a CTA's second and later items, where buffer 1 is freed last
# (it carried the previous item's O out) and buffer 0 goes first.
GATHER_ORDER = ((0, 0), (1, 1), (0, 1), (1, 0))
GATHER_ORDER_NEXT_ITEM = ((0, 0), (0, 1), (1, 1), (1, 0))

# Named barriers (bar.arrive by one consumer, bar.sync by the other; 256 threads). TileLang's own
# passes use the low ids, so these start at 10.
BAR_MAX0, BAR_MAX1, BAR_P0, BAR_P1, BAR_SUM, BAR_FINAL = 10, 11, 12, 13, 14, 15
BAR_MAX, BAR_P = (BAR_MAX0, BAR_MAX1), (BAR_P0, BAR_P1)  # indexed by the arriving consumer


def consumer_parts(h_q: int, d_qk: int, after_ready=None) -> types.SimpleNamespace:
    """The two consumer warpgroups of a kernel with this module's schedule, whatever fills the ring:
    `fragments()` allocates a consumer's registers (call it inside the consumer's branch); the macros
    `consumer0(ns, r, final, lse)` and `consumer1(ns, r)` walk the CTA's items. `ns` = `ring(...)`
    holds the shared buffers, barriers and kernel arguments they use; `load_q(ns, k, s_i, h0, t)` is the
    producer's Q load, waited for (ns.q_ready, phase = item parity) before an item's first S.
    `item_rows(ns, k)`: the k-th item's (query row, first head).
    after_ready(ns, c, b, half), a T.macro or None: what consumer c does to (buffer b, half) between
    waiting for its ready barrier and the S that reads it (a producer that leaves work to the consumer
    that reads a half first)."""
    d_tail = d_qk - D_V
    head_tiles = h_q // HEADS_PER_CTA
    H, BI, DH = HEADS_PER_CTA, BLOCK_TOPK, D_V // 2
    bf16, f32 = T.bfloat16, T.float32
    NEG_INF = -T.infinity(f32)

    def consumer_fragments():
        """Per-consumer registers: S / P of its block, its 256 output columns, row statistics.
        (A plain helper may allocate; statements must come from T.macros, see reset.)"""
        r = types.SimpleNamespace(
            acc_s=T.alloc_fragment([H, BI], f32),
            acc_p=T.alloc_fragment([H, BI], bf16),
            acc_o=T.alloc_fragment([H, DH], f32),
            out_bf16=T.alloc_fragment([H, DH], bf16),  # the epilogue's O, converted two values at a time
            m_run=T.alloc_fragment([H], f32),  # max over all pairs so far (same in both consumers)
            m_blk=T.alloc_fragment([H], f32),
            m_new=T.alloc_fragment([H], f32),
            m_safe=T.alloc_fragment([H], f32),
            alpha=T.alloc_fragment([H], f32),
            sum_i=T.alloc_fragment([H], f32),
            sumexp=T.alloc_fragment([H], f32),  # this consumer's share of the row sum
        )
        return r

    def item_rows(ns, k):
        """(query row, first head) of the CTA's k-th item."""
        item = ns.bx + k * ns.n_ctas
        return item // head_tiles, item % head_tiles * H

    @T.macro
    def start_item(ns, r, k):
        """Fresh statistics and output; wait for the item's Q."""
        T.fill(r.acc_o, 0)
        T.fill(r.sumexp, 0)
        T.fill(r.m_run, NEG_INF)
        T.barrier_wait(ns.q_ready, k & 1)

    q_chunks = tuple(range(d_qk // 64))  # (a tuple: unrolled at trace time, so the branches below fold)

    @T.macro
    def load_q(ns, k, s_i, h0, t):
        """The CTA's k-th item's Q (query row s_i, heads h0..h0+63) by TMA, one 64 x 64 box per 64
        columns, issued by producer thread 0 and signalled on q_ready; for k > 0 it first waits until
        both consumers' last S of the previous item is done (so the next Q overlaps that item's last
        P V and epilogue). The other producer threads go on to the item's gathers."""
        if t == 0:
            if k > 0:
                T.barrier_wait(ns.q_free, (k - 1) & 1)
            T.mbarrier_arrive_expect_tx(ns.q_ready, H * d_qk * 2)
            for c in q_chunks:
                if c * 64 < DH:
                    dst = T.access_ptr(ns.q_l[0, c * 64], "w", H * 64)
                elif c * 64 < D_V:
                    dst = T.access_ptr(ns.q_r[0, c * 64 - DH], "w", H * 64)
                else:
                    dst = T.access_ptr(ns.q_t[0, c * 64 - D_V], "w", H * 64)
                T.tma_load(ns.q_desc, ns.q_ready[0], dst, c * 64, h0, s_i, 0)

    def ring(*, Q, q_l, q_r, q_t, kv_l, kv_r, k_t, p_smem, valid, max_smem, sum_smem, final_smem, Out, Lse, Sink,
             use_sink, scale2, bx, n_ctas, n_items, topk, MaxLogits=None):
        """Call in the prim_func after its shared buffers: allocates the ring's mbarriers and returns the
        namespace the consumers (and the producer) use. ready_l[b] / ready_r[b]: buffer b's columns
        [0, 256) / [256, d_qk) have arrived (128 arrivals); free_l[b] / free_r[b]: their last reader is
        done (128 arrivals each); q_free: both consumers' last S of an item is done, Q may be replaced;
        q_ready: the item's Q has landed (one arrival and Q's bytes); q_desc: Q's TMA tensor map (Q is
        the kernel's [s_q, h_q, d_qk] argument). left / right: what each
        consumer's P V reads and releases (consumer 0 the left column half of both buffers, consumer 1
        the right half). MaxLogits: None (consumer 0 writes lse in base 2 to Lse), or the kernel's
        [s_q, h_q] fp32 argument: consumer 0 also writes max_logits there and writes lse in natural log
        (FlashMLA's statistics; the epilogue only, the loop is the same)."""
        ready_l = T.alloc_barrier([128, 128])
        ready_r = T.alloc_barrier([128, 128])
        free_l = T.alloc_barrier([128, 128])
        free_r = T.alloc_barrier([128, 128])
        q_free = T.alloc_barrier(256)
        q_ready = T.alloc_barrier(1)
        # Q [s_q, h_q, d_qk] as a TMA tensor map: 64 x 64 boxes (64 heads x 128 bytes), 128-byte swizzle
        # (the layout of q_l / q_r / q_t); arguments: dtype (bf16), rank, address, sizes, byte strides,
        # box, element strides, interleave, swizzle, L2 promotion, out-of-bounds fill.
        q_desc = T.create_tma_descriptor(9, 3, Q.data, d_qk, Q.shape[1], Q.shape[0], 2, d_qk * 2,
                                         Q.shape[1] * d_qk * 2, 64, H, 1, 1, 1, 1, 0, 3, 2, 0)
        left = types.SimpleNamespace(kv=kv_l, free=free_l, valid=valid, max_smem=max_smem, p_smem=p_smem)
        right = types.SimpleNamespace(kv=kv_r, free=free_r, valid=valid, max_smem=max_smem, p_smem=p_smem)
        return types.SimpleNamespace(
            q_l=q_l, q_r=q_r, q_t=q_t, kv_l=kv_l, kv_r=kv_r, k_t=k_t, ready_l=ready_l, ready_r=ready_r,
            free_l=free_l, free_r=free_r, q_free=q_free, q_ready=q_ready, q_desc=q_desc, left=left, right=right,
            sum_smem=sum_smem, final_smem=final_smem, Out=Out, Lse=Lse, MaxLogits=MaxLogits, Sink=Sink,
            use_sink=use_sink, scale2=scale2, bx=bx, n_ctas=n_ctas,
            n_local=T.ceildiv(n_items - bx, n_ctas),  # items of this CTA
            n_pairs=T.ceildiv(topk, 2 * BI))

    @T.macro
    def block_max(r, valid, buf, scale2):
        """Scale to the exp2 domain and mask buffer buf's invalid entries (valid[buf, j] is an additive
        0 / -inf: one FFMA per score), row max -> m_blk."""
        for h, j in T.Parallel(H, BI):
            r.acc_s[h, j] = r.acc_s[h, j] * scale2 + valid[buf, j]
        T.reduce_max(r.acc_s, r.m_blk, dim=1)

    @T.macro
    def exponentiate_and_rescale(r):
        """P = exp2(S - m_new) in place, row sums, and O / sums rescaled from m_run to m_new."""
        for h in T.Parallel(H):
            # -inf until the row meets a valid entry: subtract 0 so exp2 gives 0, not NaN.
            r.m_safe[h] = T.if_then_else(r.m_new[h] == NEG_INF, 0.0, r.m_new[h])
            r.alpha[h] = T.exp2(r.m_run[h] - r.m_safe[h])
        for h, j in T.Parallel(H, BI):
            r.acc_s[h, j] = T.exp2(r.acc_s[h, j] - r.m_safe[h])
        T.reduce_sum(r.acc_s, r.sum_i, dim=1)
        for h in T.Parallel(H):
            r.sumexp[h] = r.sumexp[h] * r.alpha[h] + r.sum_i[h]
        for h, d in T.Parallel(H, DH):
            r.acc_o[h, d] *= r.alpha[h]

    @T.macro
    def softmax_and_pv(r, c, bufs_of_c, scale2, not_last_pair):
        """Consumer c's part of a pair once S_c is in r.acc_s: the pair's row max (each consumer
        publishes its block's max and reads the other's), P_c at that max, O_c += P_c V_c (P from
        registers) + P_(1-c) V_(1-c) (the other consumer's P through shared memory), with V from this
        consumer's column half of each buffer (bufs_of_c.kv[b]), each released once read
        (bufs_of_c.free[b]), except buffer 1's in the last pair: it carries O out (epilogue)."""
        valid, max_smem, p_smem = bufs_of_c.valid, bufs_of_c.max_smem, bufs_of_c.p_smem
        block_max(r, valid, c, scale2)
        for h in T.Parallel(H):
            max_smem[c, h] = r.m_blk[h]
        T.named_barrier_arrive(BAR_MAX[c], 256)
        T.sync_threads(BAR_MAX[1 - c], 256)
        for h in T.Parallel(H):
            r.m_new[h] = T.max(r.m_run[h], T.max(r.m_blk[h], max_smem[1 - c, h]))
        exponentiate_and_rescale(r)
        T.copy(r.m_new, r.m_run)
        T.copy(r.acc_s, r.acc_p)
        T.wgmma_gemm(r.acc_p, bufs_of_c.kv[c], r.acc_o)
        T.copy(r.acc_p, p_smem[c])  # the bf16 P already converted for the P V above
        T.fence_proxy_async()
        T.named_barrier_arrive(BAR_P[c], 256)
        T.sync_threads(BAR_P[1 - c], 256)
        T.wgmma_gemm(p_smem[1 - c], bufs_of_c.kv[1 - c], r.acc_o)
        for pending, b in ((1, c), (0, 1 - c)):  # wgmma groups complete in issue order
            T.wait_wgmma(pending)
            if b == 1:
                if not_last_pair:
                    T.barrier_arrive(bufs_of_c.free[b])
            else:
                T.barrier_arrive(bufs_of_c.free[b])

    @T.macro
    def consumer0(ns, r, final, lse):
        """Consumer 0 (threads 0-127): S of buffer 0's block and O[:, :256], item after item; writes lse
        (and max_logits with ns.MaxLogits)."""
        for k in T.serial(ns.n_local):
            s_i, h0 = item_rows(ns, k)
            start_item(ns, r, k)
            for p in T.serial(ns.n_pairs):
                g = k * ns.n_pairs + p  # pair count of this CTA: the barriers' phase
                # S is issued and waited for inside the iteration: a wgmma in flight across the
                # loop's back edge makes ptxas serialize every wgmma of the kernel (C7515), and a
                # second copy of the S issue before the loop makes it spill the hoisted descriptors.
                T.barrier_wait(ns.ready_l[0], g & 1)
                if after_ready is not None:
                    after_ready(ns, 0, 0, 0)
                T.wgmma_gemm(ns.q_l, ns.kv_l[0], r.acc_s, transpose_B=True, clear_accum=True)
                T.barrier_wait(ns.ready_r[0], g & 1)
                if after_ready is not None:
                    after_ready(ns, 0, 0, 1)
                T.wgmma_gemm(ns.q_r, ns.kv_r[0], r.acc_s, transpose_B=True)
                if d_tail:
                    T.wgmma_gemm(ns.q_t, ns.k_t[0], r.acc_s, transpose_B=True)
                T.wait_wgmma(0)
                if p == ns.n_pairs - 1:
                    T.barrier_arrive(ns.q_free)
                softmax_and_pv(r, 0, ns.left, ns.scale2, p < ns.n_pairs - 1)
            # Row sum = both consumers' shares (same max); consumer 0 writes lse. Empty rows have a sum
            # of exactly 0; a NaN sum (NaN in a selected row) is not empty and stays NaN (the oracle's).
            T.sync_threads(BAR_SUM, 256)
            for h in T.Parallel(H):
                r.sumexp[h] += ns.sum_smem[h]
                lse[h] = T.if_then_else(r.sumexp[h] != 0, T.log2(r.sumexp[h]) + r.m_run[h],
                                        T.infinity(f32))
                final[h] = T.if_then_else(r.sumexp[h] != 0, 1.0 / r.sumexp[h], 0.0)
            if ns.use_sink != 0:
                for h in T.Parallel(H):
                    # Empty rows keep 0: their lse is +inf and a +inf sink would give inf - inf.
                    final[h] = T.if_then_else(
                        r.sumexp[h] != 0, final[h] / (1.0 + T.exp2(ns.Sink[h0 + h] * LOG2E - lse[h])), 0.0)
            if ns.MaxLogits is not None:
                # Natural scale and log: m_run and lse carry sm_scale * log2(e). An empty row's m_run is
                # -inf and its lse +inf, both kept by the multiply. (m_blk is free until the next item.)
                for h in T.Parallel(H):
                    r.m_blk[h] = r.m_run[h] * LN2
                    lse[h] = lse[h] * LN2
                T.copy(r.m_blk, ns.MaxLogits[s_i, h0:h0 + H])
            T.copy(final, ns.final_smem)
            T.copy(lse, ns.Lse[s_i, h0:h0 + H])
            T.named_barrier_arrive(BAR_FINAL, 256)
            for h, d in T.Parallel(H, DH):
                r.acc_o[h, d] *= final[h]
            # O leaves through buffer 1's ns.left half (this consumer was its last reader) by TMA;
            # the producer refills it once the store has read it.
            T.copy(r.acc_o, r.out_bf16)
            T.copy(r.out_bf16, ns.kv_l[1])
            T.copy(ns.kv_l[1], ns.Out[s_i, h0:h0 + H, 0:DH])
            T.barrier_arrive(ns.free_l[1])

    @T.macro
    def consumer1(ns, r):
        """Consumer 1 (threads 128-255): S of buffer 1's block and O[:, 256:], item after item."""
        for k in T.serial(ns.n_local):
            s_i, h0 = item_rows(ns, k)
            start_item(ns, r, k)
            for p in T.serial(ns.n_pairs):
                g = k * ns.n_pairs + p
                T.barrier_wait(ns.ready_r[1], g & 1)
                if after_ready is not None:
                    after_ready(ns, 1, 1, 1)
                T.wgmma_gemm(ns.q_r, ns.kv_r[1], r.acc_s, transpose_B=True, clear_accum=True)
                if d_tail:
                    T.wgmma_gemm(ns.q_t, ns.k_t[1], r.acc_s, transpose_B=True)
                T.barrier_wait(ns.ready_l[1], g & 1)
                if after_ready is not None:
                    after_ready(ns, 1, 1, 0)
                T.wgmma_gemm(ns.q_l, ns.kv_l[1], r.acc_s, transpose_B=True)
                T.wait_wgmma(0)
                if p == ns.n_pairs - 1:
                    T.barrier_arrive(ns.q_free)
                softmax_and_pv(r, 1, ns.right, ns.scale2, p < ns.n_pairs - 1)
            for h in T.Parallel(H):
                ns.sum_smem[h] = r.sumexp[h]
            T.named_barrier_arrive(BAR_SUM, 256)
            T.sync_threads(BAR_FINAL, 256)
            for h, d in T.Parallel(H, DH):
                r.acc_o[h, d] *= ns.final_smem[h]
            T.copy(r.acc_o, r.out_bf16)
            T.copy(r.out_bf16, ns.kv_r[1])  # this consumer was its last reader
            T.copy(ns.kv_r[1], ns.Out[s_i, h0:h0 + H, DH:D_V])
            T.barrier_arrive(ns.free_r[1])

    return types.SimpleNamespace(fragments=consumer_fragments, ring=ring, item_rows=item_rows, load_q=load_q,
                                 consumer0=consumer0, consumer1=consumer1)


def sparse_mla_program(h_q: int, d_qk: int, with_max_logits: bool = False):
    """The TileLang PrimFunc for one (h_q, d_qk); s_q, s_kv and topk are symbolic. with_max_logits:
    the variant with a MaxLogits argument (after Out) that writes max_logits and lse in natural log;
    the default writes lse in base 2 only."""
    if h_q % HEADS_PER_CTA:
        raise ValueError(f"h_q: expected a multiple of {HEADS_PER_CTA}, got {h_q}")
    if d_qk not in (512, 576):
        raise ValueError(f"d_qk: expected 512 or 576, got {d_qk}")
    s_q, s_kv, topk, n_lengths = T.dynamic("s_q, s_kv, topk, n_lengths")
    d_tail = d_qk - D_V
    head_tiles = h_q // HEADS_PER_CTA
    H, BI, DH = HEADS_PER_CTA, BLOCK_TOPK, D_V // 2
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    bufs = (0, 1)
    chunk_groups = tuple(range(d_qk // 64))  # 16-byte chunk t % 8 + 8 c of a row per producer thread
    consumers = consumer_parts(h_q, d_qk)

    rows_per_pass = 16  # 8 threads per kv row
    passes = BI // rows_per_pass

    @T.macro
    def gather_pair(g, order, phase, t, rows):
        """Producer thread t's share of one pair: per (buffer, half) in `order`, wait until the slot is
        free, then predicated 16-byte cp.async of kv rows `rows[b, :]` (-1: invalid, zero-filled and not
        read); the slot's ready barrier completes when this thread's copies (and earlier ones) land."""
        for b, half in order:
            first_half_of_buffer = (b, half) in ((0, 0), (1, 1))
            T.barrier_wait(g.free_r[b] if half else g.free_l[b], phase)
            for r in T.unroll(passes):
                j = r * rows_per_pass + t // 8
                ok = rows[b, r] >= 0
                src = T.max(rows[b, r], 0)  # any in-bounds address; not read when not ok
                if first_half_of_buffer:  # the buffer's previous readers are done with valid[b]
                    if t % 8 == 0:
                        T.evaluate(T.call_extern("handle", "st_mask", T.address_of(g.valid[b, j]), ok))
                for c in chunk_groups:
                    col = c * 64 + t % 8 * 8
                    if half == 0 and c * 64 < DH:
                        T.ptx_cp_async(T.access_ptr(g.kv_l[b][j, col], "w", 8),
                                       T.access_ptr(g.KV[src, col], "r", 8), 8, predicate=ok)
                    elif half == 1 and DH <= c * 64 < D_V:
                        T.ptx_cp_async(T.access_ptr(g.kv_r[b][j, col - DH], "w", 8),
                                       T.access_ptr(g.KV[src, col], "r", 8), 8, predicate=ok)
                    elif half == 1 and c * 64 >= D_V:
                        T.ptx_cp_async(T.access_ptr(g.k_t[b][j, col - D_V], "w", 8),
                                       T.access_ptr(g.KV[src, col], "r", 8), 8, predicate=ok)
            T.cp_async_barrier_noinc(g.ready_r[b] if half else g.ready_l[b])

    @T.macro
    def program(Q, KV, Indices, TopkLength, Sink, Out, MaxLogits, Lse, scale2, use_topk_length, use_sink, n_ctas):
        """The kernel's body; MaxLogits None: lse in base 2 only (see ring)."""
        with T.Kernel(n_ctas, threads=384, prelude=PRELUDE) as bx:
            q_l = T.alloc_shared([H, DH], bf16)
            q_r = T.alloc_shared([H, DH], bf16)
            # Buffer b holds block 2p + b of pair p: columns [0, 256) in kv_l[b], [256, 512) in kv_r[b],
            # the RoPE tail (d_qk 576) in k_t[b].
            kv_l = [T.alloc_shared([BI, DH], bf16) for _ in bufs]
            kv_r = [T.alloc_shared([BI, DH], bf16) for _ in bufs]
            p_1 = T.alloc_shared([H, BI], bf16)
            if d_tail:
                q_t = T.alloc_shared([H, d_tail], bf16)
                k_t = [T.alloc_shared([BI, d_tail], bf16) for _ in bufs]
                # P of buffer 0 lives in buffer 0's tail once S of that block is done (227 KB of shared
                # memory do not hold a separate one); the tail is refilled only after consumer 1 has
                # read P.
                p_0 = k_t[0]
            else:
                p_0 = T.alloc_shared([H, BI], bf16)
            p_smem = (p_0, p_1)
            valid = T.alloc_shared([2, BI], f32)  # per entry of the pair: 0 valid, -inf invalid
            max_smem = T.alloc_shared([2, H], f32)
            sum_smem = T.alloc_shared([H], f32)
            final_smem = T.alloc_shared([H], f32)

            ring = consumers.ring(
                Q=Q, q_l=q_l, q_r=q_r, q_t=q_t if d_tail else None, kv_l=kv_l, kv_r=kv_r, k_t=k_t if d_tail else None,
                p_smem=p_smem, valid=valid, max_smem=max_smem, sum_smem=sum_smem, final_smem=final_smem, Out=Out,
                Lse=Lse, MaxLogits=MaxLogits, Sink=Sink, use_sink=use_sink, scale2=scale2, bx=bx, n_ctas=n_ctas,
                n_items=s_q * head_tiles, topk=topk)
            tx = T.get_thread_binding()

            if tx < 128:
                T.set_max_nreg(216, 1)
                final = T.alloc_fragment([H], f32)
                lse = T.alloc_fragment([H], f32)
                consumers.consumer0(ring, consumers.fragments(), final, lse)
            elif tx < 256:
                T.set_max_nreg(216, 1)
                consumers.consumer1(ring, consumers.fragments())
            else:
                # Producer: loads Q (thread 0, TMA), then per pair gathers the rows of blocks 2p and
                # 2p + 1 into buffers 0 and 1, half by half in the order the consumers need them; an
                # invalid entry (or a position past topk when the last pair has one block) zero-fills
                # its row with a predicated cp.async (source size 0) and never reads kv.
                T.set_max_nreg(72, 0)
                t = tx - 256
                slots = types.SimpleNamespace(free_l=ring.free_l, free_r=ring.free_r, ready_l=ring.ready_l,
                                              ready_r=ring.ready_r, valid=valid, kv_l=kv_l, kv_r=kv_r,
                                              k_t=k_t if d_tail else None, KV=KV)
                limit = T.alloc_var(i32)
                rows = T.alloc_local([2, passes], i32)  # kv row per (buffer, pass), -1 if invalid
                for k in T.serial(ring.n_local):
                    s_i, h0 = consumers.item_rows(ring, k)
                    limit = T.if_then_else(use_topk_length != 0, T.min(topk, TopkLength[s_i]), topk)
                    consumers.load_q(ring, k, s_i, h0, t)
                    for p in T.serial(ring.n_pairs):
                        phase = ((k * ring.n_pairs + p) & 1) ^ 1
                        # Index loads are issued before waiting for the slots, hiding their latency.
                        for b in bufs:
                            for r in T.unroll(passes):
                                pos = (2 * p + b) * BI + r * rows_per_pass + t // 8
                                rows[b, r] = T.if_then_else(pos < limit, Indices[s_i, T.min(pos, topk - 1)], -1)
                                rows[b, r] = T.if_then_else((rows[b, r] >= 0) & (rows[b, r] < s_kv), rows[b, r], -1)
                        if (k > 0) & (p == 0):
                            gather_pair(slots, GATHER_ORDER_NEXT_ITEM, phase, t, rows)
                        else:
                            gather_pair(slots, GATHER_ORDER, phase, t, rows)

    if not with_max_logits:
        @T.prim_func
        def kernel(
            Q: T.Tensor([s_q, h_q, d_qk], bf16),
            KV: T.Tensor([s_kv, d_qk], bf16),
            Indices: T.Tensor([s_q, topk], i32),
            TopkLength: T.Tensor([n_lengths], i32),  # read only when use_topk_length != 0
            Sink: T.Tensor([h_q], f32),  # read only when use_sink != 0
            Out: T.Tensor([s_q, h_q, D_V], bf16),
            Lse: T.Tensor([s_q, h_q], f32),
            scale2: T.float32,  # sm_scale * log2(e)
            use_topk_length: T.int32,
            use_sink: T.int32,
            n_ctas: T.int32,  # grid size (<= s_q * head_tiles); CTA b serves items b, b + n_ctas, ...
        ):
            program(Q, KV, Indices, TopkLength, Sink, Out, None, Lse, scale2, use_topk_length, use_sink, n_ctas)

        return kernel

    @T.prim_func
    def kernel_with_max_logits(
        Q: T.Tensor([s_q, h_q, d_qk], bf16),
        KV: T.Tensor([s_kv, d_qk], bf16),
        Indices: T.Tensor([s_q, topk], i32),
        TopkLength: T.Tensor([n_lengths], i32),  # read only when use_topk_length != 0
        Sink: T.Tensor([h_q], f32),  # read only when use_sink != 0
        Out: T.Tensor([s_q, h_q, D_V], bf16),
        MaxLogits: T.Tensor([s_q, h_q], f32),  # natural scale; Lse in natural log
        Lse: T.Tensor([s_q, h_q], f32),
        scale2: T.float32,  # sm_scale * log2(e)
        use_topk_length: T.int32,
        use_sink: T.int32,
        n_ctas: T.int32,  # grid size (<= s_q * head_tiles); CTA b serves items b, b + n_ctas, ...
    ):
        program(Q, KV, Indices, TopkLength, Sink, Out, MaxLogits, Lse, scale2, use_topk_length, use_sink, n_ctas)

    return kernel_with_max_logits


_DUMMY_TOPK_LENGTH: dict[torch.device, torch.Tensor] = {}
_DUMMY_SINK: dict[tuple[torch.device, int], torch.Tensor] = {}


def lengths_and_sink(device: torch.device, h_q: int, topk_length: torch.Tensor | None,
                     attn_sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' TopkLength and Sink arguments: the caller's tensors (dense), or a cached zero
    tensor that the kernel never reads (its use_topk_length / use_sink switch is 0)."""
    if topk_length is None:
        lengths = _DUMMY_TOPK_LENGTH.get(device)
        if lengths is None:
            lengths = _DUMMY_TOPK_LENGTH[device] = torch.zeros(1, dtype=torch.int32, device=device)
    else:
        lengths = _dense(topk_length)
    if attn_sink is None:
        sink = _DUMMY_SINK.get((device, h_q))
        if sink is None:
            sink = _DUMMY_SINK[(device, h_q)] = torch.zeros(h_q, dtype=torch.float32, device=device)
    else:
        sink = _dense(attn_sink)
    return lengths, sink


@functools.cache
def compiled_kernel(h_q: int, d_qk: int, with_max_logits: bool):
    """Compiled once per process and (h_q, d_qk, variant); TileLang's disk cache (TILELANG_CACHE_DIR)
    makes later processes skip nvcc."""
    return tilelang.compile(sparse_mla_program(h_q, d_qk, with_max_logits), target=SM90_TARGET,
                            pass_configs=PASS_CONFIGS, compile_flags=COMPILE_FLAGS)


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def require_sm90_device(q: torch.Tensor) -> None:
    """The kernels are built for sm_90a (wgmma, setmaxnreg): any other device is a clear error, not a
    launch failure."""
    capability = cuda_capability(q.device)
    if capability is None:
        raise ValueError(f"q: expected a CUDA tensor (the kernel is built for sm_90a), got device {q.device}")
    if capability[0] != 9:
        raise ValueError(f"q: expected a tensor on an SM90 GPU (the kernel is built for sm_90a), got {q.device} with "
                         f"compute capability {capability[0]}.{capability[1]}; use DEEPINFER_SPARSE_MLA_BACKEND=triton")


def _aligned_operand(t: torch.Tensor, name: str) -> torch.Tensor:
    """t made dense; the kernels read q by TMA and kv rows by 16-byte cp.async, both of which need a
    16-byte aligned start (a contiguous view can start anywhere)."""
    t = _dense(t)
    if t.data_ptr() % 16:
        raise ValueError(f"{name}: expected a 16-byte aligned data pointer (read by TMA / 16-byte cp.async), "
                         f"got data_ptr % 16 = {t.data_ptr() % 16}")
    return t


def sparse_mla_fwd_sm90(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                        d_v: int = D_V, attn_sink: torch.Tensor | None = None,
                        topk_length: torch.Tensor | None = None, out: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [s_q, h_q, d_qk] bf16, kv [s_kv, 1, d_qk] bf16, indices [s_q, topk] or [s_q, 1, topk] int32
    -> (out [s_q, h_q, 512] bf16, lse [s_q, h_q] fp32 base 2). out: None, or the caller's contiguous,
    16-byte aligned [s_q, h_q, 512] bf16 buffer, which the kernel writes (by TMA) and which is returned."""
    out, _, lse = _run(False, q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out)
    return out, lse


def sparse_mla_fwd_sm90_with_max_logits(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                                        d_v: int = D_V, attn_sink: torch.Tensor | None = None,
                                        topk_length: torch.Tensor | None = None, out: torch.Tensor | None = None
                                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA's flash_mla_sparse_fwd results from the kernel's with_max_logits variant: arguments as
    sparse_mla_fwd_sm90 -> (out, max_logits [s_q, h_q] fp32 natural scale (-inf for an empty row),
    lse [s_q, h_q] fp32 NATURAL log (+inf for an empty row))."""
    return _run(True, q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out)


def _run(with_max_logits: bool, q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out):
    """One launch of the variant -> (out, max_logits or None, lse)."""
    shape, indices = check_sparse_mla_args(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    if shape.h_q not in TILELANG_HEADS:
        raise ValueError(f"q: expected h_q in {TILELANG_HEADS} ({HEADS_PER_CTA} heads per CTA), got {shape.h_q}")
    if out is not None:
        check_out("out", out, (shape.s_q, shape.h_q, D_V), q.dtype, q.device)
    require_sm90_device(q)
    device = q.device
    if out is None:
        out = torch.empty((shape.s_q, shape.h_q, D_V), dtype=torch.bfloat16, device=device)
    lse = torch.empty((shape.s_q, shape.h_q), dtype=torch.float32, device=device)
    max_logits = torch.empty_like(lse) if with_max_logits else None
    if shape.s_q == 0:
        return out, max_logits, lse
    if shape.s_kv == 0:  # nothing to attend to: every row is empty
        if with_max_logits:
            max_logits.fill_(float("-inf"))
        return out.zero_(), max_logits, lse.fill_(float("inf"))
    lengths, sink = lengths_and_sink(device, shape.h_q, topk_length, attn_sink)
    kernel = compiled_kernel(shape.h_q, shape.d_qk, with_max_logits)
    n_ctas = min(shape.s_q * (shape.h_q // HEADS_PER_CTA), sm_count(device))
    stats = (max_logits, lse) if with_max_logits else (lse,)
    kernel(_aligned_operand(q, "q"), _aligned_operand(kv[:, 0, :], "kv"), _dense(indices), lengths, sink, out, *stats,
           float(sm_scale) * LOG2E, int(topk_length is not None), int(attn_sink is not None), n_ctas)
    return out, max_logits, lse
