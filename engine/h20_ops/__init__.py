"""Hopper (SM90) attention ops: sparse MLA kernels, their dispatcher and the engine's entry points."""

import os

import torch

# Triton decides at @triton.jit decoration time whether a kernel is interpreted, so this must run
# before any kernel module of this package is imported: without CUDA, Triton kernels run under
# Triton's CPU interpreter (slow, exact enough for tests and the CPU end-to-end report).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from . import kv_cache, sampling  # noqa: E402 (after TRITON_INTERPRET: they define Triton kernels)
from .attention import (AttentionOutput, DecodePlan, plan_sparse_decode, sparse_mla_decode,  # noqa: E402
                        sparse_mla_prefill)
from .attention.dispatch import kernel_choices  # noqa: E402
from .attention.reference import RefResult, sparse_mla_decode_ref, sparse_mla_prefill_ref  # noqa: E402

__all__ = ["AttentionOutput", "DecodePlan", "RefResult", "kernel_choices", "kv_cache", "plan_sparse_decode",
           "sampling", "sparse_mla_decode", "sparse_mla_decode_ref", "sparse_mla_prefill", "sparse_mla_prefill_ref"]
