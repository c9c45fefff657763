"""The sparse MLA dispatcher: chooses the backend once per process and adapts its conventions.

Backends: `tilelang` (engine.h20_ops.sparse_mla_sm90, base-2 lse), `triton`
(engine.h20_ops.vendor.flashmla_sparse, FlashMLA contract, natural-log lse) and `ref` (the float32
oracle). DEEPINFER_SPARSE_MLA_BACKEND picks one; unset means tilelang if its kernel module
imports, else triton (always triton, under its interpreter, on a machine without CUDA). Only ModuleNotFoundError counts as "TileLang missing": a present but broken
install (any other error) propagates. DEEPINFER_SIMULATE_NO_TILELANG=1 installs an import hook so
that the real auto path runs as on a node without TileLang.

`sparse_mla_fwd` returns (out in q's dtype, lse in base 2) whichever backend ran.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import math
import sys
import threading
from dataclasses import dataclass

import torch

from engine import config
from engine.h20_ops.checks import check_sparse_mla_args

LOG2E = 1.0 / math.log(2.0)  # natural log -> base 2: multiply by log2(e) = 1.4427
TILELANG_KERNEL_MODULE = "engine.h20_ops.sparse_mla_sm90"

log = logging.getLogger(__name__)


class TileLangUnavailableError(RuntimeError):
    """DEEPINFER_SPARSE_MLA_BACKEND=tilelang on a process where TileLang cannot be imported."""


@dataclass(frozen=True)
class Resolution:
    backend: str
    reason: str
    tilelang_missing: str | None  # the ModuleNotFoundError text when auto resolution fell back


class _BlockTileLang(importlib.abc.MetaPathFinder):
    """Makes `import tilelang` (and any submodule) raise ModuleNotFoundError."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "tilelang" or fullname.startswith("tilelang."):
            raise ModuleNotFoundError(
                f"No module named {fullname!r} (blocked by DEEPINFER_SIMULATE_NO_TILELANG=1)", name=fullname)
        return None


_lock = threading.Lock()
_resolution: Resolution | None = None


def install_tilelang_block() -> None:
    """Idempotent; also drops already-imported tilelang modules so that later imports hit the hook."""
    if not any(isinstance(f, _BlockTileLang) for f in sys.meta_path):
        sys.meta_path.insert(0, _BlockTileLang())
    for name in list(sys.modules):
        if name == "tilelang" or name.startswith("tilelang.") or name == TILELANG_KERNEL_MODULE:
            del sys.modules[name]


def _import_tilelang_kernels():
    """Import the TileLang kernel module. Only a ModuleNotFoundError for tilelang itself means
    "TileLang missing"; one for anything else (our own module, tilelang's dependencies) is a broken
    install and is re-raised as ImportError so that no caller mistakes it for absence."""
    try:
        return importlib.import_module(TILELANG_KERNEL_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name == "tilelang" or (exc.name or "").startswith("tilelang."):
            raise
        raise ImportError(f"TileLang kernel module {TILELANG_KERNEL_MODULE} failed to import: {exc}") from exc


def _dp_rank_suffix() -> str:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return f" [dp rank {dist.get_rank()}/{dist.get_world_size()}]"
    return ""


def _resolve() -> Resolution:
    if config.simulate_no_tilelang():
        install_tilelang_block()
    requested = config.sparse_mla_backend()
    if requested == "ref":
        return Resolution("ref", "DEEPINFER_SPARSE_MLA_BACKEND=ref", None)
    if requested == "triton":
        return Resolution("triton", "DEEPINFER_SPARSE_MLA_BACKEND=triton", None)
    if requested == "tilelang":
        try:
            _import_tilelang_kernels()
        except ModuleNotFoundError as exc:
            raise TileLangUnavailableError(
                f"DEEPINFER_SPARSE_MLA_BACKEND=tilelang but TileLang cannot be imported ({exc}); "
                "install the `tilelang` extra (or the offline bundle, see README) or choose triton") from exc
        return Resolution("tilelang", "DEEPINFER_SPARSE_MLA_BACKEND=tilelang", None)
    if not torch.cuda.is_available():
        # TileLang kernels can only run on an SM90 GPU; here Triton runs under its interpreter.
        return Resolution("triton", "auto: no CUDA device (Triton interpreter)", None)
    try:
        _import_tilelang_kernels()
    except ModuleNotFoundError as exc:
        return Resolution("triton", f"auto: TileLang missing ({exc})", str(exc))
    return Resolution("tilelang", "auto: TileLang kernel module imported", None)


def backend_resolution() -> Resolution:
    """The process's resolution (computed and logged once)."""
    global _resolution
    with _lock:
        if _resolution is None:
            _resolution = _resolve()
            log.warning("sparse MLA backend: %s (%s)%s", _resolution.backend, _resolution.reason,
                        _dp_rank_suffix())
        return _resolution


def resolve_backend() -> str:
    return backend_resolution().backend


def reset_resolution_for_tests() -> None:
    global _resolution
    with _lock:
        _resolution = None


def _run_ref(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    from engine.h20_ops.sparse_mla_ref import sparse_mla_prefill_ref

    res = sparse_mla_prefill_ref(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    return res.out.to(q.dtype), res.lse * LOG2E


def _run_triton(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    from engine.h20_ops.vendor.flashmla_sparse import flash_mla_sparse_fwd

    out, _max_logits, lse_natural = flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    return out, lse_natural * LOG2E  # +inf (empty rows) stays +inf


def _run_tilelang(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    return _import_tilelang_kernels().sparse_mla_fwd_sm90(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)


_BACKENDS = {"ref": _run_ref, "triton": _run_triton, "tilelang": _run_tilelang}


def sparse_mla_fwd(q, kv, indices, sm_scale, *, d_v: int = 512, attn_sink=None, topk_length=None,
                   backend: str | None = None):
    """Sparse MLA forward. q [s_q, h_q, d_qk]; kv [s_kv, 1, d_qk]; indices [s_q, topk] (or
    [s_q, 1, topk]) int32, absolute rows of kv, any out-of-range value invalid; attn_sink [h_q] fp32;
    topk_length [s_q] int32. Returns (out [s_q, h_q, d_v] in q's dtype, lse [s_q, h_q] fp32 base 2)."""
    if backend is None:
        backend = resolve_backend()
    elif backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(_BACKENDS)} or None, got {backend!r}")
    _, indices = check_sparse_mla_args(
        q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
        q_dtypes=(torch.bfloat16, torch.float32), limit_shapes=backend != "ref")
    return _BACKENDS[backend](q, kv, indices, float(sm_scale), d_v, attn_sink, topk_length)
