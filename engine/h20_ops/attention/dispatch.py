"""The sparse MLA dispatcher: chooses the backend once per process and adapts its conventions.

Backends: `tilelang` (engine.h20_ops.attention.tilelang_sm90, base-2 lse), `triton`
(engine.h20_ops.vendor.flashmla_sparse, FlashMLA contract, natural-log lse) and `ref` (the float32
oracle). DEEPINFER_SPARSE_MLA_BACKEND picks one; unset means auto (engine.h20_ops.backend_select:
tilelang if its kernel module imports, else triton; triton without CUDA).

`sparse_mla_fwd` returns (out in q's dtype, lse in base 2) whichever backend ran; q is bf16 (or fp32
with `triton` and `ref`).
"""

from __future__ import annotations

import math

import torch

from ... import config
from ..backend_select import BackendSelector, TileLangUnavailableError  # noqa: F401 (re-export)
from ..backend_select import import_tilelang_module_or_explain
from ..checks import check_sparse_mla_args

LOG2E = 1.0 / math.log(2.0)  # natural log -> base 2: multiply by log2(e) = 1.4427
TILELANG_KERNEL_MODULE = f"{__package__}.tilelang_sm90"  # relative: the kernel repo renames the package
TILELANG_PAGED_FP8_MODULE = f"{__package__}.tilelang_sm90_paged_fp8"

_selector = BackendSelector("sparse MLA", TILELANG_KERNEL_MODULE, config.sparse_mla_backend,
                            config.SPARSE_MLA_BACKEND.name)
backend_resolution = _selector.resolution
reset_resolution_for_tests = _selector.reset_for_tests


def resolve_backend() -> str:
    return backend_resolution().backend


def _run_ref(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    from .reference import sparse_mla_prefill_ref

    res = sparse_mla_prefill_ref(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    return res.out.to(q.dtype), res.lse * LOG2E


def _run_triton(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    from ..vendor.flashmla_sparse import flash_mla_sparse_fwd

    out, _max_logits, lse_natural = flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    return out, lse_natural * LOG2E  # +inf (empty rows) stays +inf


def _run_tilelang(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    module = import_tilelang_module_or_explain(TILELANG_KERNEL_MODULE, "sparse MLA backend 'tilelang'")
    return module.sparse_mla_fwd_sm90(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)


_BACKENDS = {"ref": _run_ref, "triton": _run_triton, "tilelang": _run_tilelang}
_Q_DTYPES = {"ref": (torch.bfloat16, torch.float32), "triton": (torch.bfloat16, torch.float32),
             "tilelang": (torch.bfloat16,)}  # the TileLang kernels are built for bf16 only
_Q_DTYPE_NOTES = {"tilelang": "the tilelang backend's kernels are bf16 only; DEEPINFER_SPARSE_MLA_BACKEND=triton "
                              "runs float32"}


def _backend(backend: str | None) -> str:
    """An explicit backend, validated, or the process's resolution."""
    if backend is None:
        return resolve_backend()
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(_BACKENDS)} or None, got {backend!r}")
    return backend


def sparse_mla_fwd(q, kv, indices, sm_scale, *, d_v: int = 512, attn_sink=None, topk_length=None,
                   backend: str | None = None, arg_names: dict[str, str] | None = None):
    """Sparse MLA forward. q [s_q, h_q, d_qk]; kv [s_kv, 1, d_qk]; indices [s_q, topk] (or
    [s_q, 1, topk]) int32, absolute rows of kv, any out-of-range value invalid; attn_sink [h_q] fp32;
    topk_length [s_q] int32. Returns (out [s_q, h_q, d_v] in q's dtype, lse [s_q, h_q] fp32 base 2).
    arg_names: an entry point's names for these arguments, used in the errors of the checks."""
    backend = _backend(backend)
    _, indices = check_sparse_mla_args(
        q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
        q_dtypes=_Q_DTYPES[backend], q_dtype_note=_Q_DTYPE_NOTES.get(backend), limit_shapes=backend != "ref",
        names=arg_names)
    return _BACKENDS[backend](q, kv, indices, float(sm_scale), d_v, attn_sink, topk_length)


def paged_fp8_supported(backend: str | None = None) -> bool:
    """Whether the backend has a kernel reading paged fp8 MODEL1 caches directly (TileLang only: the
    others attend over rows that kv_cache.gather_dequant wrote into a bf16 buffer first)."""
    return _backend(backend) == "tilelang"


def sparse_mla_paged_fp8_fwd(q, cache0, cache1, slot_indices, sm_scale, *, attn_sink=None, topk_length=None,
                             backend: str | None = None, cache_names: tuple[str, str] = ("cache0", "cache1")):
    """Sparse MLA forward over two paged fp8 MODEL1 caches (engine.h20_ops.attention.tilelang_sm90_paged_fp8).
    q [s_q, h_q, 512] bf16; cache0, cache1 (or None) [num_blocks, block_size, 1, 584] uint8;
    slot_indices [s_q, topk] int32: s < n_slots0 is cache0's slot s, n_slots0 <= s < n_slots0 + n_slots1
    cache1's slot s - n_slots0, anything else invalid. Returns (out [s_q, h_q, 512] bf16, lse base 2).
    cache_names: an entry point's names for cache0 and cache1, used in the errors of the checks."""
    backend = _backend(backend)
    if not paged_fp8_supported(backend):
        raise ValueError(f"backend: the paged fp8 kernel exists for tilelang only, got {backend!r} "
                         "(gather the rows with kv_cache.gather_dequant and call sparse_mla_fwd)")
    module = import_tilelang_module_or_explain(TILELANG_PAGED_FP8_MODULE, "sparse MLA backend 'tilelang'")
    return module.sparse_mla_fwd_sm90_paged_fp8(q, cache0, cache1, slot_indices, float(sm_scale),
                                                attn_sink=attn_sink, topk_length=topk_length, cache_names=cache_names)
