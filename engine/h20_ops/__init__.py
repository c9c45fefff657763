"""Hopper (SM90) attention ops: sparse MLA kernels, their dispatcher and the engine's entry points."""

import os

import torch

# Triton decides at @triton.jit decoration time whether a kernel is interpreted, so this must run
# before any kernel module of this package is imported: without CUDA, Triton kernels run under
# Triton's CPU interpreter (slow, exact enough for tests and the CPU end-to-end report).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
