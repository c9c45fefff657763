"""Sparse MLA prefill in pure Triton, implementing FlashMLA's `flash_mla_sparse_fwd` contract.

Two kernels; the caller names the one to run (the dispatcher, engine.h20_ops.attention.dispatch,
chooses by dtype, device and layout before launching, never as a fallback after a failure): the
warp-specialized Gluon kernel of flashmla_sparse_gluon_sm90.py (bf16 on an SM90 GPU with 16-byte
aligned q / kv pointers and row strides that are multiples of 16 elements), and the portable tl
kernel below (float32, other GPUs, Triton's interpreter for the CPU tests, any layout). Both implement the
contract stated here and are tested against the fp32 oracle (tests/test_flashmla_sparse.py; on an SM90
GPU both kernels). On SM90 both use programmatic dependent launch: they wait for the previous kernel of
the stream (griddepcontrol.wait) before touching memory, so their launch overlaps that kernel's end.

Contract (FlashMLA since 2026-01; docs/contract.md):
  flash_mla_sparse_fwd(q [s_q, h_q, d_qk], kv [s_kv, 1, d_qk], indices [s_q, 1, topk] or [s_q, topk]
  int32, sm_scale, d_v=512, attn_sink [h_q] fp32 | None, topk_length [s_q] int32 | None)
  -> (out [s_q, h_q, d_v] in q's dtype, max_logits [s_q, h_q] fp32, lse [s_q, h_q] fp32); the caller may
  pass `out` (contiguous), which the kernel then writes in place.
  Entry j of row i is valid iff 0 <= idx < s_kv and j < topk_length[i]; any other int32 value is a
  filler that is never dereferenced (masked loads; its score is -inf). Duplicates count per occurrence.
  lse is NATURAL log, max_logits in natural scale (sm_scale applied). The sink scales out by
  1 / (1 + exp(sink - lse)) and never changes lse or max_logits (+inf sink -> out 0). A row without a
  valid entry: out 0, max_logits -inf, lse +inf.

Numerics of the portable kernel: one program per (query, head tile); the top-k list is walked in
blocks of BLOCK_K entries; each block of kv rows is gathered once and feeds both Q.K^T and P.V (V = the
first d_v = 512 columns of kv; for d_qk 576 the 64 trailing RoPE columns are a second, small Q.K^T);
each of the two warpgroups computes half of a block's Q.K^T columns, and each block's indices are
loaded one iteration ahead of its gather. tl.dot takes bf16 operands with fp32 accumulators (P is
rounded to bf16 for P.V, as in FlashMLA); the online softmax runs in the exp2 domain with
sm_scale * log2(e) folded into the scores, and lse / max_logits are converted back to natural log at
the end. Speed: docs/performance.md; tuning: docs/lab/prefill.md, docs/lab/triton_kernel_notes.md.

Constraints: h_q 8, 16, 32, 64 or 128, d_qk 512 or 576, d_v 512, h_kv 1, topk >= 1 (any: the last
block is masked, callers pad nothing), any s_q (1-D grid; 64-bit offsets), last dims contiguous (leading
dims may be strided). The Gluon kernel: h_q 64 or 128 only (its `unsupported` names other head counts).
Head tiles of the portable kernel (heads_per_program): 64 heads for h_q 64 and 128 (the configuration
measured on the H200; its sm_90 PTX has the same instructions as before the small tiles were added);
h_q 8, 16, 32 (a tensor-parallel rank's heads) run all heads of a query in one program, a tile of
max(16, h_q) rows (tl.dot needs M >= 16): h_q 8's 8 extra rows re-read head 7 (no masked loads) and are
never stored. The small tiles keep the 64-head tile's launch parameters (block_k 64, 8 warps, 2 stages),
not tuned and not yet timed on a GPU (scripts/bench_tp_heads.py). The top-k list is not split across
programs: s_q x head tiles programs fill the GPU at prefill sizes, and decode's calls are split by the
decode plan (attention/decode.py) before they reach this kernel.

Deliberate deviations from FlashMLA:
  - float32 q/kv are accepted (the engine's float32 validation mode); their dots run with
    input_precision="ieee" (no TF32) and P stays float32, so that mode is exact to fp32 rounding.
  - Under TRITON_INTERPRET=1 (CPU tests) tl.dot gets float32 operands, because the interpreter
    multiplies raw bf16 bit patterns (triton issue 11584); the GPU path keeps bf16 operands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..platform import dependent_launch, require_interpretable_numpy, triton_interprets
from ..checks import check_out, check_sparse_mla_args
from . import flashmla_sparse_gluon_sm90

LOG2E = 1.0 / math.log(2.0)
HEADS_PER_PROGRAM = 64  # the head tile of h_q 64 and 128 (the configuration measured on the H200)
MIN_HEADS_PER_PROGRAM = 16  # tl.dot needs M >= 16
_INTERPRET = triton_interprets()  # Triton decided at import (decoration) time, from the same variable


@triton.jit
def _sparse_mla_fwd_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, topk_length_ptr,
    out_ptr, max_logits_ptr, lse_ptr,
    s_kv, topk, qk_scale_log2,
    stride_q_s, stride_q_h, stride_kv_s, stride_idx_s, stride_sink, stride_topk_length,
    stride_out_s, stride_out_h, stride_ml_s, stride_lse_s,
    H_Q: tl.constexpr, H_TILES: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    D_V: tl.constexpr, D_ROPE: tl.constexpr,
    HAS_SINK: tl.constexpr, HAS_TOPK_LENGTH: tl.constexpr,
    DOT_F32: tl.constexpr, INPUT_PRECISION: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr,
):
    if DEPENDENT_LAUNCH:  # wait for the previous kernel before touching memory; let the next one launch
        gdc_wait()
        gdc_launch_dependents()
    # 1-D grid: s_q may exceed the 65535 limit of grid axes 1/2. The head tiles of one query are
    # neighbours, so they gather the same kv rows close in time (L2 hits).
    pid = tl.program_id(0)
    query = (pid // H_TILES).to(tl.int64)
    heads = ((pid % H_TILES) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)  # x head strides: 64-bit
    if H_Q < BLOCK_H:
        # h_q 8 in a 16-row tile (tl.dot needs M >= 16): the rows past h_q read head h_q - 1 again (in
        # bounds, no masked loads) and are never stored
        read_heads = tl.minimum(heads, H_Q - 1)
        stored = heads < H_Q
        stored_rows = stored[:, None]
    else:  # the tile is full: no clamp, unmasked stores
        read_heads = heads
        stored = None
        stored_rows = None
    cols = tl.arange(0, D_V)

    q_rows = q_ptr + query * stride_q_s + read_heads[:, None] * stride_q_h
    q = tl.load(q_rows + cols[None, :])
    if DOT_F32:
        q = q.to(tl.float32)
    if D_ROPE > 0:
        rope_cols = D_V + tl.arange(0, D_ROPE)
        q_rope = tl.load(q_rows + rope_cols[None, :])
        if DOT_F32:
            q_rope = q_rope.to(tl.float32)

    n_entries = topk
    if HAS_TOPK_LENGTH:
        n_entries = tl.minimum(tl.load(topk_length_ptr + query * stride_topk_length), topk)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, log2 domain
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], tl.float32)
    idx_row = idx_ptr + query * stride_idx_s
    # Each block's indices are loaded one iteration ahead, so the gather's addresses never wait on
    # an index load issued after the previous block's P.V.
    pos = tl.arange(0, BLOCK_K)
    idx = tl.load(idx_row + pos, mask=pos < n_entries, other=-1)
    for start in range(0, n_entries, BLOCK_K):
        pos = start + tl.arange(0, BLOCK_K)
        valid = (pos < n_entries) & (idx >= 0) & (idx < s_kv)
        kv_rows = kv_ptr + idx.to(tl.int64)[:, None] * stride_kv_s
        # Invalid entries are never read: their rows load as 0 and their scores become -inf.
        kv = tl.load(kv_rows + cols[None, :], mask=valid[:, None], other=0.0)
        if DOT_F32:
            kv = kv.to(tl.float32)
        if D_ROPE > 0:
            kv_rope = tl.load(kv_rows + rope_cols[None, :], mask=valid[:, None], other=0.0)
            if DOT_F32:
                kv_rope = kv_rope.to(tl.float32)
        idx = tl.load(idx_row + pos + BLOCK_K, mask=pos + BLOCK_K < n_entries, other=-1)
        scores = tl.dot(q, tl.trans(kv), input_precision=INPUT_PRECISION) * qk_scale_log2
        if D_ROPE > 0:
            # A separate dot added after scaling: accumulating into the first dot would chain them.
            scores += tl.dot(q_rope, tl.trans(kv_rope), input_precision=INPUT_PRECISION) * qk_scale_log2
        # Always true inside the loop. Triton lays out a dot whose result flows into another dot
        # (here Q.K^T into P.V) with all 8 warps along the 64 rows, so BOTH warpgroups would compute
        # the whole 64 x 64 Q.K^T; routing the scores through this branch ends that chain, and each
        # warpgroup computes 32 of the 64 columns (half the wgmma work; tests/test_flashmla_sparse.py
        # checks the layout in an offline sm_90 compile).
        if start < n_entries:
            scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid entry yet: avoid -inf - -inf
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(kv.dtype), kv, acc, input_precision=INPUT_PRECISION)
        m = m_new

    # Rows without a valid entry (l == 0) get out 0, lse +inf; the *_safe values keep their
    # discarded branch free of log(0), 1/0 and inf - inf. A NaN row sum (NaN in a selected row) is
    # not empty: it stays NaN, as in the oracle.
    has_valid = l != 0.0
    l_safe = tl.where(has_valid, l, 1.0)
    lse_log2_safe = tl.where(has_valid, m + tl.log2(l_safe), 0.0)
    lse_log2 = tl.where(has_valid, lse_log2_safe, float("inf"))
    out_scale = tl.where(has_valid, 1.0 / l_safe, 0.0)
    if HAS_SINK:
        # 1 / (1 + exp(sink - lse)): exact at sink = -inf (factor 1) and +inf (factor 0); empty rows
        # stay 0 whatever the sink (a NaN sink included).
        sink_log2 = tl.load(sink_ptr + read_heads * stride_sink) * 1.4426950408889634
        out_scale = tl.where(has_valid, out_scale / (1.0 + tl.exp2(sink_log2 - lse_log2_safe)), 0.0)
    out = acc * out_scale[:, None]
    tl.store(out_ptr + query * stride_out_s + heads[:, None] * stride_out_h + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=stored_rows)
    tl.store(max_logits_ptr + query * stride_ml_s + heads, m * 0.6931471805599453, mask=stored)
    tl.store(lse_ptr + query * stride_lse_s + heads, lse_log2 * 0.6931471805599453, mask=stored)


@dataclass(frozen=True)
class KernelConfig:
    block_k: int  # top-k entries per block (kv rows gathered together)
    num_warps: int
    num_stages: int


def default_config(dtype: torch.dtype) -> KernelConfig:
    """The fastest configuration measured on an H200 (docs/lab/prefill.md). float32 is the validation
    mode: small blocks so that it fits shared memory; its speed does not matter."""
    if dtype == torch.float32:
        return KernelConfig(block_k=16, num_warps=8, num_stages=1)
    return KernelConfig(block_k=64, num_warps=8, num_stages=2)


def heads_per_program(h_q: int) -> int:
    """The portable kernel's head tile: 64 for h_q 64 and 128, else h_q rounded up to a power of two and
    to at least 16 (h_q 8, 16, 32 -> 16, 16, 32: the heads of one query in one program, not padded to 64)."""
    if h_q % HEADS_PER_PROGRAM == 0:
        return HEADS_PER_PROGRAM
    return max(MIN_HEADS_PER_PROGRAM, triton.next_power_of_2(h_q))


KERNELS = ("gluon_sm90", "portable")


def flash_mla_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                         d_v: int = 512, attn_sink: torch.Tensor | None = None,
                         topk_length: torch.Tensor | None = None, *, kernel: str,
                         config: KernelConfig | None = None, out: torch.Tensor | None = None):
    """FlashMLA's sparse prefill forward (see the module header). Returns (out, max_logits, lse);
    lse natural log. kernel: "gluon_sm90" or "portable", as the dispatcher chose it
    (engine.h20_ops.attention.dispatch.prefill_kernel); `config`: the portable kernel's launch
    parameters (benchmarks), default default_config(q.dtype); `out`: a contiguous [s_q, h_q, d_v]
    tensor in q's dtype that the kernel writes (and that is returned), None: a new one."""
    shape, indices = check_sparse_mla_args(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                           q_dtypes=(torch.bfloat16, torch.float32))
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {', '.join(KERNELS)}, got {kernel!r}")
    if not (q.is_cuda or _INTERPRET):
        raise ValueError(f"q: expected a CUDA tensor (or Triton's interpreter: TRITON_INTERPRET=1), "
                         f"got device {q.device}")
    if kernel == "gluon_sm90":
        if config is not None:
            raise ValueError("config: the launch parameters of the portable kernel, given with kernel='gluon_sm90'")
        why = flashmla_sparse_gluon_sm90.unsupported(q, kv)
        if why is not None:
            raise ValueError(f"kernel: 'gluon_sm90' cannot run these tensors: {why}")
    if _INTERPRET:
        require_interpretable_numpy("flash_mla_sparse_fwd")
    s_q, h_q = shape.s_q, shape.h_q
    if out is None:
        out = torch.empty((s_q, h_q, d_v), dtype=q.dtype, device=q.device)
    else:
        check_out("out", out, (s_q, h_q, d_v), q.dtype, q.device)
    max_logits = torch.empty((s_q, h_q), dtype=torch.float32, device=q.device)
    lse = torch.empty((s_q, h_q), dtype=torch.float32, device=q.device)
    if s_q == 0:
        return out, max_logits, lse
    if kernel == "gluon_sm90":
        flashmla_sparse_gluon_sm90.launch(q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits, lse)
        return out, max_logits, lse
    if config is None:
        config = default_config(q.dtype)
    block_h = heads_per_program(h_q)
    h_tiles = -(-h_q // block_h)
    dependent = dependent_launch(q.device)
    # Unused pointer arguments get a valid tensor; the constexpr flags keep them unread.
    sink = attn_sink if attn_sink is not None else lse
    lengths = topk_length if topk_length is not None else indices
    _sparse_mla_fwd_kernel[(s_q * h_tiles,)](
        q, kv, indices, sink, lengths,
        out, max_logits, lse,
        shape.s_kv, shape.topk, float(sm_scale) * LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
        sink.stride(0), lengths.stride(0),
        out.stride(0), out.stride(1), max_logits.stride(0), lse.stride(0),
        H_Q=h_q, H_TILES=h_tiles, BLOCK_H=block_h, BLOCK_K=config.block_k,
        D_V=d_v, D_ROPE=shape.d_qk - d_v,
        HAS_SINK=attn_sink is not None, HAS_TOPK_LENGTH=topk_length is not None,
        DOT_F32=_INTERPRET, INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DEPENDENT_LAUNCH=dependent, num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=dependent,
    )
    return out, max_logits, lse
