"""Sparse MLA prefill: the public entry point (packed varlen prefill is one call over all tokens).

The indices carry causality (DeepSeek's indexer only selects positions a query may see), so the kernels
run non-causal: bounding by row index instead would mask valid rows of a packed batch.
"""

from __future__ import annotations

import torch

from ..checks import check_sparse_mla_args
from . import dispatch
from .output import AttentionOutput


def sparse_mla_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, *,
                       d_v: int = 512, attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                       backend: str | None = None) -> AttentionOutput:
    """Sparse MLA forward over one kv tensor.

    q [s_q, h_q, d_qk] bf16 (fp32 with the triton and ref backends), h_q in checks.SUPPORTED_HEADS (8, 16,
      32, 64, 128; any with the ref backend; the tilelang backend's kernels take 64 or 128: under auto
      resolution another h_q runs the triton backend, backend='tilelang' refuses it), d_qk 512 or 576;
    kv [s_kv, 1, d_qk] in q's dtype (K = kv, V = its first d_v = 512 columns);
    indices [s_q, topk] or [s_q, 1, topk] int32 absolute rows of kv: entry j of row i is valid iff
      0 <= idx < s_kv and j < topk_length[i] (topk_length [s_q] int32 or None); any other value is a
      filler that is never read; duplicates count once per occurrence;
    attn_sink [h_q] fp32: out *= 1 / (1 + exp(sink - lse)) (natural-log lse); lse is not changed.
    Only the last dims must be contiguous. backend: None for the process's (DEEPINFER_SPARSE_MLA_BACKEND).
    Returns AttentionOutput(out [s_q, h_q, d_v] in q's dtype, lse_log2 [s_q, h_q] fp32 base 2); a row
    without a valid entry gets out 0 and lse +inf."""
    resolved = dispatch.backend_of(backend)
    _, indices = check_sparse_mla_args(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                       q_dtypes=dispatch.Q_DTYPES[resolved],
                                       q_dtype_note=dispatch.Q_DTYPE_NOTES.get(resolved),
                                       limit_shapes=resolved != "ref")
    kernel = dispatch.prefill_kernel(q, kv, backend).kernel
    return AttentionOutput(*dispatch.run_prefill_kernel(kernel, q, kv, indices, float(sm_scale), d_v, attn_sink,
                                                        topk_length))
