"""Sparse MLA attention: the float32 reference, the dispatcher, the public entry points and the kernels."""

from .decode import DecodePlan, plan_sparse_decode, sparse_mla_decode
from .output import AttentionOutput
from .prefill import sparse_mla_prefill

__all__ = ["AttentionOutput", "DecodePlan", "plan_sparse_decode", "sparse_mla_decode", "sparse_mla_prefill"]
