"""Sparse MLA prefill for Hopper (SM90) in Gluon, Triton's lower-level dialect: the bf16 GPU kernel
behind `flashmla_sparse.flash_mla_sparse_fwd`.

Contract: FlashMLA's `flash_mla_sparse_fwd` (docs/contract.md, "Prefill"), as
stated in flashmla_sparse.py's header: natural-log lse, max_logits in natural scale, sink applied to out
only, an invalid entry (idx < 0, idx >= s_kv or position >= topk_length; any int32 filler) is never
read and scores -inf, an empty row gives out 0 / max_logits -inf / lse +inf. The caller validates the
arguments and allocates the outputs.

Numerics: bf16 operands, fp32 accumulators (wgmma); fp32 online softmax in base 2 with
sm_scale * log2(e) folded into the scores, converted back to natural log at the end; P is rounded to
bf16 once, at the row max of its pair of blocks, and feeds both P V products that use it.

Schedule (persistent: a grid of min(#items, #SMs) CTAs; an item is one query x 64 heads and CTA b
serves items b, b + grid, ...; 12 warps in three warp-specialized partitions, synchronized by
mbarriers). The top-k list is walked in pairs of 64-entry blocks: block 2p goes to shared buffer 0,
block 2p + 1 to buffer 1 (positions past topk / topk_length are masked, so an odd last block pairs
with an all-invalid one); the ring's phases run on across items.
  producer (4 warps, 40 registers): per item, Q by cp.async as soon as both consumers did the
    previous item's last S (`q_free`), so Q and the first gathers overlap that item's last P V and
    epilogue; per block its 64 indices, their validity and the rows by predicated 16-byte cp.async
    (an invalid entry zero-fills its row: source size 0), each block signalled by
    cp.async.mbarrier.arrive; a buffer is refilled once both consumers released it.
  consumer c (4 warps each, c = 0, 1): S_c = Q K_c^T for buffer c's block (m64n64 wgmma), invalid
    entries -inf; both publish their block's row max and take the pair's; P_c = exp2(S_c - max);
    O[:, 256c : 256c + 256] += P_c V_c (P from registers) + P_(1-c) V_(1-c) (the other consumer's P
    through shared memory). Each consumer owns half of d_v, so the [64, 512] fp32 O fits registers;
    the row sum is split between them and added at the end. O leaves through each consumer's column
    half of buffer 1 (its last reader) by row-contiguous 16-byte stores; buffer 1 is released after
    that, while the producer already refills buffer 0. An item without entries stores zeros directly.
  With d_qk 576 the RoPE tail of Q and of each buffer is a separate [64, 64] tile (a second small
  wgmma into S), and P_0 lives in buffer 0's tail once S_0 is done: 227 KB of shared memory hold no
  separate P_0.

  Launched with programmatic dependent launch: a CTA may start while the previous kernel of the
  stream finishes; each partition waits for that kernel (griddepcontrol.wait) before its first global
  access and lets the next kernel launch.

Constraints: bf16; h_q 64 or 128 (others: `unsupported` names them; the portable kernel runs h_q 8, 16,
32), d_qk 512 or 576, d_v 512; any topk >= 1 and s_q (64-bit offsets);
last dims contiguous, leading dims strided; SM90 only (wgmma, setmaxnreg).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ..platform import cuda_capability, sm_count, triton_interprets

HEADS_PER_CTA = 64
BLOCK_TOPK = 64
NUM_WARPS = gl.constexpr(4)  # per partition: the default one (consumer 0), consumer 1, the producer
LOG2E = 1.4426950408889634


@gluon.jit
def _wait_for_previous_kernel(x):
    """griddepcontrol.wait (this thread waits until the previous kernel of the stream has completed and
    its writes are visible), then launch_dependents (the next kernel may launch). x: any int scalar,
    the asm's dummy operand."""
    gl.inline_asm_elementwise("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;\n\tmov.u32 $0, $1;",
                              "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _producer(q_ptr, kv_ptr, idx_ptr, topk_length_ptr, n_items, s_kv, topk,
              stride_q_s, stride_q_h, stride_kv_s, stride_idx_s, stride_topk_length,
              q_nope, q_rope, kv_nope, kv_rope, q_ready, q_free, ready, free,
              H_TILES: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, D_V: gl.constexpr,
              D_ROPE: gl.constexpr, HAS_TOPK_LENGTH: gl.constexpr):
    _wait_for_previous_kernel(n_items)
    # 4 warps x [4 rows, 8 threads x 8 columns]: one 16-byte cp.async per thread and 16 x 64 tile.
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows0 = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, tile))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, tile))
    q_dst = q_nope.index(0)
    it = 0  # items served by this CTA so far (the phase of q_ready / q_free)
    g = 0  # pairs gathered by this CTA so far (the phase of the ring)
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        query = (item // H_TILES).to(gl.int64)
        head0 = (item % H_TILES) * BLOCK_H
        n_entries = topk
        if HAS_TOPK_LENGTH:
            n_entries = gl.maximum(gl.minimum(gl.load(topk_length_ptr + query * stride_topk_length), topk), 0)
        idx_row = idx_ptr + query * stride_idx_s
        # Q of this item once both consumers finished the previous item's last S.
        mbarrier.wait(q_free, (it & 1) ^ 1, pred=it > 0)
        q_rows = gl.expand_dims(q_ptr + query * stride_q_s + (head0 + rows0).to(gl.int64) * stride_q_h, 1)
        for c in gl.static_range(D_V // 64):
            async_copy.async_copy_global_to_shared(q_dst.slice(c * 64, 64, dim=1),
                                                   q_rows + gl.expand_dims(c * 64 + cols, 0))
        if D_ROPE > 0:
            async_copy.async_copy_global_to_shared(q_rope, q_rows + gl.expand_dims(D_V + cols, 0))
        async_copy.mbarrier_arrive(q_ready, increment_count=False)
        for pair in range(gl.cdiv(n_entries, 2 * BLOCK_K)):
            for b in gl.static_range(2):
                mbarrier.wait(free.index(b), (g & 1) ^ 1, pred=g > 0)
                pos = (2 * pair + b) * BLOCK_K + rows0
                idx = gl.load(idx_row + pos, mask=pos < n_entries, other=-1)
                valid = gl.expand_dims((pos < n_entries) & (idx >= 0) & (idx < s_kv), 1)
                rows = gl.expand_dims(kv_ptr + idx.to(gl.int64) * stride_kv_s, 1)
                dst = kv_nope.index(b)
                for c in gl.static_range(D_V // 64):
                    async_copy.async_copy_global_to_shared(dst.slice(c * 64, 64, dim=1),
                                                           rows + gl.expand_dims(c * 64 + cols, 0), mask=valid)
                if D_ROPE > 0:
                    async_copy.async_copy_global_to_shared(kv_rope.index(b), rows + gl.expand_dims(D_V + cols, 0),
                                                           mask=valid)
                async_copy.mbarrier_arrive(ready.index(b), increment_count=False)
            g += 1
        it += 1


@gluon.jit
def _consumer(C: gl.constexpr, idx_ptr, sink_ptr, topk_length_ptr, out_ptr, max_logits_ptr, lse_ptr,
              n_items, s_kv, topk, qk_scale_log2, stride_idx_s, stride_topk_length, stride_out_s, stride_out_h,
              stride_ml_s, stride_lse_s, stride_sink, q_nope, q_rope, kv_nope, kv_rope, p_own, p_other, stats,
              q_ready, q_free, ready, free, max_bar, p_bar, sum_bar, H_TILES: gl.constexpr, BLOCK_H: gl.constexpr,
              BLOCK_K: gl.constexpr, D_V: gl.constexpr, D_ROPE: gl.constexpr, HAS_SINK: gl.constexpr,
              HAS_TOPK_LENGTH: gl.constexpr):
    _wait_for_previous_kernel(n_items)
    HALF: gl.constexpr = D_V // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_K, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    head_rows = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, tile))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, tile))
    s_init = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_layout)
    pos0 = C * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_layout))
    it = 0  # as in the producer
    g = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        query = (item // H_TILES).to(gl.int64)
        head0 = (item % H_TILES) * BLOCK_H
        n_entries = topk
        if HAS_TOPK_LENGTH:
            # clamped at 0 (here and in the producer): cdiv rounds toward zero, so a length <= -255 would
            # give a negative pair count and skip the q_free arrive of an item without pairs (a hang)
            n_entries = gl.maximum(gl.minimum(gl.load(topk_length_ptr + query * stride_topk_length), topk), 0)
        idx_row = idx_ptr + query * stride_idx_s
        n_pairs = gl.cdiv(n_entries, 2 * BLOCK_K)
        m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)  # running max (log2 domain)
        l = gl.zeros([BLOCK_H], gl.float32, layout=row_s)  # this consumer's blocks' share of the row sum
        acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)
        mbarrier.wait(q_ready, it & 1)
        for pair in range(n_pairs):
            phase = g & 1
            pos = pair * 2 * BLOCK_K + pos0
            # Loaded before S is issued, used once it is done: the load's latency hides behind S.
            idx = gl.load(idx_row + pos, mask=pos < n_entries, other=-1)
            # An opaque 0 that changes every pair: with constant buffer addresses LLVM hoists the
            # wgmma descriptors of Q and of the block (64 x 64 bit) out of the loop and ptxas spills them.
            zero = gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [g], dtype=gl.int32, is_pure=True,
                                             pack=1)
            mbarrier.wait(ready.index(C), phase)
            kv_own = kv_nope.index(C + zero)
            s = warpgroup_mma(q_nope.index(zero), kv_own.permute((1, 0)), s_init, use_acc=False,
                              is_async=True)
            if D_ROPE > 0:
                s = warpgroup_mma(q_rope, kv_rope.index(C + zero).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
            if pair == n_pairs - 1:
                mbarrier.arrive(q_free)  # the item's last read of Q
            valid = (pos < n_entries) & (idx >= 0) & (idx < s_kv)
            s = s * qk_scale_log2 + gl.expand_dims(gl.where(valid, 0.0, float("-inf")), 0)
            m_blk = gl.max(s, axis=1)
            # The pair's row max: publish this block's, read the other consumer's. Reusing the row
            # next pair is safe: the other consumer reads it before it signals its P, awaited here.
            stats.index(C).store(m_blk)
            gl.thread_barrier()
            mbarrier.arrive(max_bar.index(C))
            mbarrier.wait(max_bar.index(1 - C), phase)
            m_new = gl.maximum(m, gl.maximum(m_blk, stats.index(1 - C).load(row_s)))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid entry yet: no -inf - -inf
            alpha = gl.exp2(m - m_safe)
            p = gl.exp2(s - gl.expand_dims(m_safe, 1))
            l = l * alpha + gl.sum(p, axis=1)
            m = m_new
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_bf16 = p.to(gl.bfloat16)
            acc = warpgroup_mma(gl.convert_layout(p_bf16, p_operand), kv_own.slice(C * HALF, HALF, dim=1), acc,
                                is_async=True)
            p_own.store(p_bf16)
            fence_async_shared()  # generic-proxy stores, read by the other consumer's wgmma (async proxy)
            gl.thread_barrier()
            mbarrier.arrive(p_bar.index(C))
            mbarrier.wait(p_bar.index(1 - C), phase)
            acc = warpgroup_mma(p_other, kv_nope.index(1 - C + zero).slice(C * HALF, HALF, dim=1), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(free.index(0))
            if pair < n_pairs - 1:
                mbarrier.arrive(free.index(1))  # the last pair's buffer 1 carries O out first
            g += 1
        if n_pairs == 0:
            mbarrier.arrive(q_free)

        # The row sum: add the other consumer's share. Rows by item parity: after an item without
        # pairs the other consumer may still be reading the previous item's row.
        stats.index(2 + 2 * (it & 1) + C).store(l)
        gl.thread_barrier()
        mbarrier.arrive(sum_bar.index(C))
        mbarrier.wait(sum_bar.index(1 - C), it & 1)
        l = l + stats.index(3 - C + 2 * (it & 1)).load(row_s)
        # Rows without a valid entry (l == 0) get out 0, lse +inf; the *_safe values keep their
        # discarded branch free of log(0), 1/0 and inf - inf. A NaN row sum (NaN in a selected row) is
        # not empty: it stays NaN, as in the oracle.
        has_valid = l != 0.0
        l_safe = gl.where(has_valid, l, 1.0)
        lse_log2_safe = gl.where(has_valid, m + gl.log2(l_safe), 0.0)
        out_scale = gl.where(has_valid, 1.0 / l_safe, 0.0)
        heads = head0 + gl.arange(0, BLOCK_H, layout=row_s)
        if HAS_SINK:
            # 1 / (1 + exp(sink - lse)): exact at sink = -inf (factor 1) and +inf (factor 0); empty rows
            # stay 0 whatever the sink (a NaN sink included).
            sink_log2 = gl.load(sink_ptr + heads.to(gl.int64) * stride_sink) * 1.4426950408889634
            out_scale = gl.where(has_valid, out_scale / (1.0 + gl.exp2(sink_log2 - lse_log2_safe)), 0.0)
        out = (acc * gl.expand_dims(gl.convert_layout(out_scale, row_o), 1)).to(gl.bfloat16)
        out_rows = gl.expand_dims(out_ptr + query * stride_out_s
                                  + (head0 + head_rows).to(gl.int64) * stride_out_h, 1)
        if n_pairs > 0:
            # O leaves through this consumer's column half of buffer 1 (only this consumer reads that
            # half's V), which is released once O is out; the producer meanwhile refills buffer 0.
            o_smem = kv_nope.index(1).slice(C * HALF, HALF, dim=1)
            o_smem.store(out)
            gl.thread_barrier()
            for c in gl.static_range(HALF // 64):
                gl.store(out_rows + gl.expand_dims(C * HALF + c * 64 + cols, 0),
                         o_smem.slice(c * 64, 64, dim=1).load(tile))
            gl.thread_barrier()
            mbarrier.arrive(free.index(1))
        else:
            zeros = gl.zeros([BLOCK_H, 64], gl.bfloat16, layout=tile)
            for c in gl.static_range(HALF // 64):
                gl.store(out_rows + gl.expand_dims(C * HALF + c * 64 + cols, 0), zeros)
        if C == 0:
            gl.store(max_logits_ptr + query * stride_ml_s + heads, m * 0.6931471805599453)
            gl.store(lse_ptr + query * stride_lse_s + heads,
                     gl.where(has_valid, lse_log2_safe, float("inf")) * 0.6931471805599453)
        it += 1


# warp_specialize passes tensors only: the consumer index reaches _consumer as a constexpr literal.
@gluon.jit
def _consumer_0(idx_ptr, sink_ptr, topk_length_ptr, out_ptr, max_logits_ptr, lse_ptr, n_items, s_kv, topk,
                qk_scale_log2, stride_idx_s, stride_topk_length, stride_out_s, stride_out_h, stride_ml_s,
                stride_lse_s, stride_sink, q_nope, q_rope, kv_nope, kv_rope, p_own, p_other, stats, q_ready,
                q_free, ready, free, max_bar, p_bar, sum_bar, H_TILES: gl.constexpr, BLOCK_H: gl.constexpr,
                BLOCK_K: gl.constexpr, D_V: gl.constexpr, D_ROPE: gl.constexpr, HAS_SINK: gl.constexpr,
                HAS_TOPK_LENGTH: gl.constexpr):
    _consumer(0, idx_ptr, sink_ptr, topk_length_ptr, out_ptr, max_logits_ptr, lse_ptr, n_items, s_kv, topk,
              qk_scale_log2, stride_idx_s, stride_topk_length, stride_out_s, stride_out_h, stride_ml_s,
              stride_lse_s, stride_sink, q_nope, q_rope, kv_nope, kv_rope, p_own, p_other, stats, q_ready,
              q_free, ready, free, max_bar, p_bar, sum_bar, H_TILES, BLOCK_H, BLOCK_K, D_V, D_ROPE, HAS_SINK,
              HAS_TOPK_LENGTH)


@gluon.jit
def _consumer_1(idx_ptr, sink_ptr, topk_length_ptr, out_ptr, max_logits_ptr, lse_ptr, n_items, s_kv, topk,
                qk_scale_log2, stride_idx_s, stride_topk_length, stride_out_s, stride_out_h, stride_ml_s,
                stride_lse_s, stride_sink, q_nope, q_rope, kv_nope, kv_rope, p_own, p_other, stats, q_ready,
                q_free, ready, free, max_bar, p_bar, sum_bar, H_TILES: gl.constexpr, BLOCK_H: gl.constexpr,
                BLOCK_K: gl.constexpr, D_V: gl.constexpr, D_ROPE: gl.constexpr, HAS_SINK: gl.constexpr,
                HAS_TOPK_LENGTH: gl.constexpr):
    _consumer(1, idx_ptr, sink_ptr, topk_length_ptr, out_ptr, max_logits_ptr, lse_ptr, n_items, s_kv, topk,
              qk_scale_log2, stride_idx_s, stride_topk_length, stride_out_s, stride_out_h, stride_ml_s,
              stride_lse_s, stride_sink, q_nope, q_rope, kv_nope, kv_rope, p_own, p_other, stats, q_ready,
              q_free, ready, free, max_bar, p_bar, sum_bar, H_TILES, BLOCK_H, BLOCK_K, D_V, D_ROPE, HAS_SINK,
              HAS_TOPK_LENGTH)


@gluon.jit
def sparse_mla_fwd_sm90_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, topk_length_ptr,
    out_ptr, max_logits_ptr, lse_ptr,
    n_items, s_kv, topk, qk_scale_log2,
    stride_q_s, stride_q_h, stride_kv_s, stride_idx_s, stride_sink, stride_topk_length,
    stride_out_s, stride_out_h, stride_ml_s, stride_lse_s,
    H_TILES: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
    D_V: gl.constexpr, D_ROPE: gl.constexpr,
    HAS_SINK: gl.constexpr, HAS_TOPK_LENGTH: gl.constexpr,
):
    nvmma: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_nope = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_H, D_V], nvmma)  # [1, ...]: see `zero`
    kv_nope = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_K, D_V], nvmma)
    p_1 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_K], nvmma)
    if D_ROPE > 0:
        q_rope = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_ROPE], nvmma)
        kv_rope = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_K, D_ROPE], nvmma)
        # Buffer 0's tail is refilled only after both consumers released buffer 0, i.e. after
        # consumer 1 has read P_0.
        p_0 = kv_rope.index(0)
    else:
        q_rope = q_nope  # unused: the D_ROPE branches are compiled out
        kv_rope = kv_nope
        p_0 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_K], nvmma)
    # rows 0 / 1: each consumer's block row max; rows 2-5: each consumer's share of the row sum, by item parity
    stats = gl.allocate_shared_memory(gl.float32, [6, BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    barrier: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [1], barrier)
    q_free = gl.allocate_shared_memory(gl.int64, [1], barrier)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], barrier)
    free = gl.allocate_shared_memory(gl.int64, [2, 1], barrier)
    max_bar = gl.allocate_shared_memory(gl.int64, [2, 1], barrier)
    p_bar = gl.allocate_shared_memory(gl.int64, [2, 1], barrier)
    sum_bar = gl.allocate_shared_memory(gl.int64, [2, 1], barrier)
    mbarrier.init(q_ready, count=128)  # one cp.async arrival per producer thread
    mbarrier.init(q_free, count=2)  # Gluon arrives from one thread per partition
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=128)
        mbarrier.init(free.index(i), count=2)
        mbarrier.init(max_bar.index(i), count=1)
        mbarrier.init(p_bar.index(i), count=1)
        mbarrier.init(sum_bar.index(i), count=1)

    gl.warp_specialize([
        (_consumer_0, (idx_ptr, sink_ptr, topk_length_ptr, out_ptr, max_logits_ptr, lse_ptr, n_items, s_kv, topk,
                       qk_scale_log2, stride_idx_s, stride_topk_length, stride_out_s, stride_out_h, stride_ml_s,
                       stride_lse_s, stride_sink, q_nope, q_rope, kv_nope, kv_rope, p_0, p_1, stats, q_ready,
                       q_free, ready, free, max_bar, p_bar, sum_bar, H_TILES, BLOCK_H, BLOCK_K, D_V, D_ROPE,
                       HAS_SINK, HAS_TOPK_LENGTH)),
        (_consumer_1, (idx_ptr, sink_ptr, topk_length_ptr, out_ptr, max_logits_ptr, lse_ptr, n_items, s_kv, topk,
                       qk_scale_log2, stride_idx_s, stride_topk_length, stride_out_s, stride_out_h, stride_ml_s,
                       stride_lse_s, stride_sink, q_nope, q_rope, kv_nope, kv_rope, p_1, p_0, stats, q_ready,
                       q_free, ready, free, max_bar, p_bar, sum_bar, H_TILES, BLOCK_H, BLOCK_K, D_V, D_ROPE,
                       HAS_SINK, HAS_TOPK_LENGTH)),
        (_producer, (q_ptr, kv_ptr, idx_ptr, topk_length_ptr, n_items, s_kv, topk,
                     stride_q_s, stride_q_h, stride_kv_s, stride_idx_s, stride_topk_length,
                     q_nope, q_rope, kv_nope, kv_rope, q_ready, q_free, ready, free,
                     H_TILES, BLOCK_H, BLOCK_K, D_V, D_ROPE, HAS_TOPK_LENGTH)),
    ], [NUM_WARPS, NUM_WARPS], [232, 40])


def heads_unsupported(h_q: int) -> str | None:
    """Why this kernel cannot run h_q heads, or None: its CTAs take 64 heads each (h_q 64 or 128)."""
    if h_q % HEADS_PER_CTA:
        return f"h_q {h_q}: the Gluon kernel takes 64 or 128 heads ({HEADS_PER_CTA} per CTA)"
    return None


def unsupported(q: torch.Tensor, kv: torch.Tensor) -> str | None:
    """Why this kernel cannot run on (q, kv), or None: it is built for h_q 64 or 128 (heads_unsupported),
    bf16 on an SM90 GPU, and reads rows by 16-byte cp.async, which needs 16-byte aligned q / kv pointers
    and row strides that are multiples of 16 elements (Triton's JIT specializes on that; without it the
    kernel does not compile)."""
    heads = heads_unsupported(q.shape[1])
    if heads is not None:
        return heads
    if triton_interprets():
        return "Triton's interpreter (no CUDA device)"
    if not q.is_cuda:
        return f"q is on {q.device}, not a CUDA device"
    if q.dtype != torch.bfloat16:
        return f"q is {str(q.dtype).removeprefix('torch.')} (the Gluon kernel is bf16 only)"
    capability = cuda_capability(q.device)
    if capability != (9, 0):
        return f"GPU sm_{capability[0]}{capability[1]} is not SM90"
    strides = (q.stride(0), q.stride(1), kv.stride(0))
    if any(s % 16 for s in strides) or q.data_ptr() % 16 or kv.data_ptr() % 16:
        return (f"q / kv rows not 16-byte aligned (row strides {strides} elements, data_ptr % 16 = "
                f"{q.data_ptr() % 16} / {kv.data_ptr() % 16}; the portable kernel takes them, ~1.5x slower)")
    return None


def launch(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
           attn_sink: torch.Tensor | None, topk_length: torch.Tensor | None,
           out: torch.Tensor, max_logits: torch.Tensor, lse: torch.Tensor) -> None:
    """Run the kernel on validated arguments (flashmla_sparse.flash_mla_sparse_fwd; `unsupported` is None
    for them): q [s_q, h_q, d_qk] bf16, kv [s_kv, 1, d_qk], indices [s_q, topk] int32; writes out [s_q, h_q, 512], max_logits and lse
    [s_q, h_q] (natural log)."""
    s_q, h_q, d_qk = q.shape
    d_v = out.shape[-1]
    h_tiles = h_q // HEADS_PER_CTA
    # Unused pointer arguments get a valid tensor; the constexpr flags keep them unread.
    sink = attn_sink if attn_sink is not None else lse
    lengths = topk_length if topk_length is not None else indices
    n_items = s_q * h_tiles
    grid = min(n_items, sm_count(q.device))
    sparse_mla_fwd_sm90_kernel[(grid,)](
        q, kv, indices, sink, lengths, out, max_logits, lse,
        n_items, kv.shape[0], indices.shape[1], float(sm_scale) * LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), sink.stride(0), lengths.stride(0),
        out.stride(0), out.stride(1), max_logits.stride(0), lse.stride(0),
        H_TILES=h_tiles, BLOCK_H=HEADS_PER_CTA, BLOCK_K=BLOCK_TOPK, D_V=d_v, D_ROPE=d_qk - d_v,
        HAS_SINK=attn_sink is not None, HAS_TOPK_LENGTH=topk_length is not None,
        num_warps=NUM_WARPS.value, launch_pdl=True,
    )
