"""TileLang sparse MLA prefill kernel for Hopper (SM90).

Contract: FlashMLA's sparse prefill (../../../shared/reference/sparse_mla_contract.md) with base-2 lse.
  q [s_q, h_q, d_qk] bf16, kv [s_kv, 1, d_qk] bf16, indices [s_q, topk] int32 (absolute kv rows),
  attn_sink [h_q] fp32 or None, topk_length [s_q] int32 or None
  -> out [s_q, h_q, 512] bf16, lse [s_q, h_q] fp32 in BASE 2 (TileLang's convention).
  Entry j of row i is valid iff 0 <= idx < s_kv and j < topk_length[i]; validity is tested
  explicitly in the kernel (TileLang's safe memory access would turn an out-of-range gather into a
  zero key that scores 0, not -inf) and an invalid entry's kv row is never read.
  Empty row: out 0, lse +inf. Sink: out *= 1 / (1 + 2^(sink * log2(e) - lse)), lse unchanged.

Numerics: bf16 operands, fp32 accumulators (QK^T and PV on wgmma), fp32 online softmax in base 2
(scores scaled by sm_scale * log2(e)); P is rounded to bf16 for the PV product.

Schedule (one CTA = one query row x 64 heads, 384 threads, hand-written warp specialization):
  producer warpgroup: first gathers Q with cp.async (covered by the first k_ready arrival); per
    step reads 64 indices, tests validity, gathers the rows with predicated cp.async (an invalid
    entry zero-fills its row, source size 0, so it never reads kv) into a 2-stage shared ring,
    signals `k_ready[stage]` with cp.async.mbarrier.arrive;
  consumer 0: S = Q K^T (wgmma), masks invalid entries to -inf, online softmax, publishes P (bf16)
    and the rescale factor through shared memory, accumulates O[:, :256] += P V[:, :256];
  consumer 1: accumulates O[:, 256:] += P V[:, 256:] with consumer 0's P and factor.
  A stage is released when both consumers are done with it (`k_free`, 256 arrivals).

Constraints: h_q in {64, 128} (tiled by 64 heads per CTA), d_qk in {512, 576} (V = first 512
columns), any topk >= 1 (the last block is masked by position, nothing is padded on the host).
s_q, s_kv and topk are symbolic and sink / topk_length are runtime switches: one compile per
(h_q, d_qk), cached on disk by TileLang (TILELANG_CACHE_DIR) and memoized per process.

Deviations: bf16 only (fp32 q: TypeError). Inputs whose strides are not dense are made contiguous
on the host (the kernel assumes dense row-major tensors).
"""

import functools
import math

import tilelang
import tilelang.language as T
import torch

from engine.h20_ops.checks import check_sparse_mla_args

D_V = 512
HEADS_PER_CTA = 64
BLOCK_TOPK = 64  # top-k entries per pipeline step
LOG2E = 1.0 / math.log(2.0)
SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
PASS_CONFIGS = {
    # The warp specialization is written by hand (producer + two consumers with mbarriers).
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
}


def sparse_mla_program(h_q: int, d_qk: int):
    """The TileLang PrimFunc for one (h_q, d_qk); s_q, s_kv and topk are symbolic."""
    if h_q % HEADS_PER_CTA:
        raise ValueError(f"h_q: expected a multiple of {HEADS_PER_CTA}, got {h_q}")
    if d_qk not in (512, 576):
        raise ValueError(f"d_qk: expected 512 or 576, got {d_qk}")
    s_q, s_kv, topk, n_lengths = T.dynamic("s_q, s_kv, topk, n_lengths")
    d_tail = d_qk - D_V
    head_tiles = h_q // HEADS_PER_CTA
    H, BI, DH = HEADS_PER_CTA, BLOCK_TOPK, D_V // 2
    # Each producer thread copies 16-byte chunks t % 8 + 8 c of its row, c in chunk_groups.
    chunk_groups = tuple(range(d_qk // 64))
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    stages = (0, 1)

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
    ):
        with T.Kernel(s_q * head_tiles, threads=384) as bx:
            q_l = T.alloc_shared([H, DH], bf16)
            q_r = T.alloc_shared([H, DH], bf16)
            kv_l = [T.alloc_shared([BI, DH], bf16) for _ in stages]
            kv_r = [T.alloc_shared([BI, DH], bf16) for _ in stages]
            if d_tail:
                q_t = T.alloc_shared([H, d_tail], bf16)
                k_t = [T.alloc_shared([BI, d_tail], bf16) for _ in stages]
            valid = T.alloc_shared([2, BI], "bool")
            p_smem = T.alloc_shared([H, BI], bf16)
            alpha_smem = T.alloc_shared([H], f32)
            final_smem = T.alloc_shared([H], f32)

            k_ready = T.alloc_barrier([128, 128])
            k_free = T.alloc_barrier([256, 256])
            p_ready = T.alloc_barrier(128)
            p_free = T.alloc_barrier(128)
            final_ready = T.alloc_barrier(128)

            s_i = bx // head_tiles
            h0 = (bx % head_tiles) * H
            n_blocks = T.ceildiv(topk, BI)
            tx = T.get_thread_binding()

            if tx < 128:
                # Consumer 0: S = Q K^T, online softmax, publishes P and alpha, O[:, :256] += P V.
                T.set_max_nreg(240, 1)
                acc_s = T.alloc_fragment([H, BI], f32)
                acc_o = T.alloc_fragment([H, DH], f32)
                m_i = T.alloc_fragment([H], f32)
                m_prev = T.alloc_fragment([H], f32)
                m_safe = T.alloc_fragment([H], f32)
                alpha = T.alloc_fragment([H], f32)
                sum_i = T.alloc_fragment([H], f32)
                sumexp = T.alloc_fragment([H], f32)
                lse = T.alloc_fragment([H], f32)
                final = T.alloc_fragment([H], f32)
                T.fill(acc_o, 0)
                T.fill(sumexp, 0)
                T.fill(m_i, -T.infinity(f32))
                for pair in T.serial(T.ceildiv(n_blocks, 2)):
                    for st in stages:
                        it = pair * 2 + st
                        if it < n_blocks:
                            T.barrier_wait(k_ready[st], pair & 1)
                            T.fill(acc_s, 0)
                            T.wgmma_gemm(q_l, kv_l[st], acc_s, transpose_B=True)
                            T.wgmma_gemm(q_r, kv_r[st], acc_s, transpose_B=True)
                            if d_tail:
                                T.wgmma_gemm(q_t, k_t[st], acc_s, transpose_B=True)
                            T.wait_wgmma(0)
                            for h, j in T.Parallel(H, BI):
                                acc_s[h, j] = T.if_then_else(valid[st, j], acc_s[h, j] * scale2, -T.infinity(f32))
                            T.copy(m_i, m_prev)
                            T.reduce_max(acc_s, m_i, dim=1, clear=False)
                            for h in T.Parallel(H):
                                # -inf until the row meets a valid entry: subtract 0 so exp2 gives 0, not NaN.
                                m_safe[h] = T.if_then_else(m_i[h] == -T.infinity(f32), 0.0, m_i[h])
                                alpha[h] = T.exp2(m_prev[h] - m_safe[h])
                            for h, j in T.Parallel(H, BI):
                                acc_s[h, j] = T.exp2(acc_s[h, j] - m_safe[h])
                            T.reduce_sum(acc_s, sum_i, dim=1)
                            for h in T.Parallel(H):
                                sumexp[h] = sumexp[h] * alpha[h] + sum_i[h]
                            for h, d in T.Parallel(H, DH):
                                acc_o[h, d] *= alpha[h]
                            # Consumer 1 must be done with the previous P before it is overwritten.
                            T.barrier_wait(p_free, (it & 1) ^ 1)
                            T.copy(alpha, alpha_smem)
                            T.copy(acc_s, p_smem)
                            T.fence_proxy_async()
                            T.barrier_arrive(p_ready)
                            T.gemm(p_smem, kv_l[st], acc_o)
                            T.barrier_arrive(k_free[st])
                for h in T.Parallel(H):
                    lse[h] = T.if_then_else(sumexp[h] > 0, T.log2(sumexp[h]) + m_i[h], T.infinity(f32))
                    final[h] = T.if_then_else(sumexp[h] > 0, 1.0 / sumexp[h], 0.0)
                if use_sink != 0:
                    for h in T.Parallel(H):
                        # Empty rows keep 0: their lse is +inf and a +inf sink would give inf - inf.
                        final[h] = T.if_then_else(
                            sumexp[h] > 0, final[h] / (1.0 + T.exp2(Sink[h0 + h] * LOG2E - lse[h])), 0.0)
                T.copy(final, final_smem)
                T.barrier_arrive(final_ready)
                for h, d in T.Parallel(H, DH):
                    acc_o[h, d] *= final[h]
                T.copy(acc_o, Out[s_i, h0:h0 + H, 0:DH])
                T.copy(lse, Lse[s_i, h0:h0 + H])
            elif tx < 256:
                # Consumer 1: O[:, 256:] += P V with consumer 0's P and rescale factor.
                T.set_max_nreg(168, 1)
                acc_o = T.alloc_fragment([H, DH], f32)
                T.fill(acc_o, 0)
                for pair in T.serial(T.ceildiv(n_blocks, 2)):
                    for st in stages:
                        it = pair * 2 + st
                        if it < n_blocks:
                            T.barrier_wait(p_ready, it & 1)
                            for h, d in T.Parallel(H, DH):
                                acc_o[h, d] *= alpha_smem[h]
                            T.gemm(p_smem, kv_r[st], acc_o)
                            T.barrier_arrive(p_free)
                            T.barrier_arrive(k_free[st])
                T.barrier_wait(final_ready, 0)
                for h, d in T.Parallel(H, DH):
                    acc_o[h, d] *= final_smem[h]
                T.copy(acc_o, Out[s_i, h0:h0 + H, DH:D_V])
            else:
                # Producer: gathers Q, then the valid top-k rows into the 2-stage ring; an invalid
                # entry zero-fills its row (cp.async with source size 0) and never reads kv.
                T.set_max_nreg(80, 0)
                t = tx - 256
                limit = T.alloc_var(i32)
                limit = T.if_then_else(use_topk_length != 0, T.min(topk, TopkLength[s_i]), topk)
                rows_per_pass = 16  # 8 threads per kv row
                passes = BI // rows_per_pass
                rows = T.alloc_local([passes], i32)  # kv row of each entry this thread copies, -1 if invalid
                # Q is gathered like a kv block (the first k_ready arrival covers it too): a plain
                # T.copy by all threads compiled to ~86 serialized 2-byte loads per thread.
                for r in T.unroll(passes):
                    j = r * rows_per_pass + t // 8
                    for c in chunk_groups:
                        col = c * 64 + t % 8 * 8
                        if c * 64 < DH:
                            T.ptx_cp_async(T.access_ptr(q_l[j, col], "w", 8),
                                           T.access_ptr(Q[s_i, h0 + j, col], "r", 8), 8)
                        elif c * 64 < D_V:
                            T.ptx_cp_async(T.access_ptr(q_r[j, col - DH], "w", 8),
                                           T.access_ptr(Q[s_i, h0 + j, col], "r", 8), 8)
                        else:
                            T.ptx_cp_async(T.access_ptr(q_t[j, col - D_V], "w", 8),
                                           T.access_ptr(Q[s_i, h0 + j, col], "r", 8), 8)
                for pair in T.serial(T.ceildiv(n_blocks, 2)):
                    for st in stages:
                        it = pair * 2 + st
                        if it < n_blocks:
                            # Index loads are issued before waiting for the slot, hiding their latency.
                            for r in T.unroll(passes):
                                pos = it * BI + r * rows_per_pass + t // 8
                                rows[r] = T.if_then_else(pos < limit, Indices[s_i, T.min(pos, topk - 1)], -1)
                                rows[r] = T.if_then_else((rows[r] >= 0) & (rows[r] < s_kv), rows[r], -1)
                            T.barrier_wait(k_free[st], (pair & 1) ^ 1)
                            for r in T.unroll(passes):
                                j = r * rows_per_pass + t // 8
                                ok = rows[r] >= 0
                                src = T.max(rows[r], 0)  # any in-bounds address; not read when not ok
                                if t % 8 == 0:
                                    valid[st, j] = ok
                                for c in chunk_groups:  # unrolled at trace time
                                    col = c * 64 + t % 8 * 8
                                    if c * 64 < DH:
                                        T.ptx_cp_async(T.access_ptr(kv_l[st][j, col], "w", 8),
                                                       T.access_ptr(KV[src, col], "r", 8), 8, predicate=ok)
                                    elif c * 64 < D_V:
                                        T.ptx_cp_async(T.access_ptr(kv_r[st][j, col - DH], "w", 8),
                                                       T.access_ptr(KV[src, col], "r", 8), 8, predicate=ok)
                                    else:
                                        T.ptx_cp_async(T.access_ptr(k_t[st][j, col - D_V], "w", 8),
                                                       T.access_ptr(KV[src, col], "r", 8), 8, predicate=ok)
                            T.cp_async_barrier_noinc(k_ready[st])

    return kernel


_DUMMY_TOPK_LENGTH: dict[torch.device, torch.Tensor] = {}
_DUMMY_SINK: dict[tuple[torch.device, int], torch.Tensor] = {}


@functools.cache
def compiled_kernel(h_q: int, d_qk: int):
    """Compiled once per process and (h_q, d_qk); TileLang's disk cache (TILELANG_CACHE_DIR)
    makes later processes skip nvcc."""
    return tilelang.compile(sparse_mla_program(h_q, d_qk),
                            target=SM90_TARGET, pass_configs=PASS_CONFIGS)


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def sparse_mla_fwd_sm90(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                        d_v: int = D_V, attn_sink: torch.Tensor | None = None,
                        topk_length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [s_q, h_q, d_qk] bf16, kv [s_kv, 1, d_qk] bf16, indices [s_q, topk] or [s_q, 1, topk] int32
    -> (out [s_q, h_q, 512] bf16, lse [s_q, h_q] fp32 base 2)."""
    shape, indices = check_sparse_mla_args(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    if q.device.type != "cuda":
        raise ValueError(f"q: expected a CUDA tensor (the kernel is built for sm_90a), got device {q.device}")
    out = torch.empty((shape.s_q, shape.h_q, D_V), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((shape.s_q, shape.h_q), dtype=torch.float32, device=q.device)
    if shape.s_q == 0:
        return out, lse
    if shape.s_kv == 0:  # nothing to attend to: every row is empty
        return out.zero_(), lse.fill_(float("inf"))
    device = q.device
    if topk_length is None:
        lengths = _DUMMY_TOPK_LENGTH.get(device)
        if lengths is None:
            lengths = _DUMMY_TOPK_LENGTH[device] = torch.zeros(1, dtype=torch.int32, device=device)
    else:
        lengths = _dense(topk_length)
    if attn_sink is None:
        sink = _DUMMY_SINK.get((device, shape.h_q))
        if sink is None:
            sink = _DUMMY_SINK[(device, shape.h_q)] = torch.zeros(shape.h_q, dtype=torch.float32, device=device)
    else:
        sink = _dense(attn_sink)
    kernel = compiled_kernel(shape.h_q, shape.d_qk)
    kernel(_dense(q), _dense(kv[:, 0, :]), _dense(indices), lengths, sink, out, lse,
           float(sm_scale) * LOG2E, int(topk_length is not None), int(attn_sink is not None))
    return out, lse
