"""The sparse MLA dispatcher: every kernel choice of the attention subsystem is made here, visibly.

Choices (each logged once per process with its reason, and listed by `kernel_choices()` for reports):
  - the backend, once per process: DEEPINFER_SPARSE_MLA_BACKEND (tilelang, triton, ref) or auto
    (engine.h20_ops.backend_select: tilelang where its kernel module imports and the GPU is an SM90,
    else triton; triton without CUDA);
  - the prefill kernel of a call: `tilelang_sm90` (attention/tilelang_sm90.py), `triton_gluon_sm90`
    (vendor/flashmla_sparse_gluon_sm90.py: bf16 on SM90 with 16-byte aligned rows), `triton_portable`
    (vendor/flashmla_sparse.py: float32, other GPUs, the CPU interpreter, rows the Gluon kernel cannot
    read) or `ref` (the float32 oracle);
    A prefill call that also returns max_logits and natural-log lse (FlashMLA's flash_mla_sparse_fwd,
    engine.h20_ops.flash_mla) runs the same kernel: each produces both itself (tilelang_sm90 in its
    with_max_logits variant; run_prefill_kernel_with_max_logits);
  - head counts (backend_for_heads): the TileLang kernels take h_q 64 or 128; under auto resolution a
    call of another h_q (8, 16, 32: a tensor-parallel rank's) runs the triton backend, its kernel choice's
    reason starting "h_q 16: the TileLang kernels take 64 or 128 heads -> triton"; tilelang named
    explicitly is refused for it (ValueError naming q / h_q), as nothing runs in place of what was named;
  - the decode path of a call (attention/decode.py): `paged_fp8` (a kernel reads the paged fp8 caches
    itself), `gathered` (the rows of both caches are gathered, dequantized if fp8, into one buffer for the
    prefill kernel) or `direct` (one dense cache: the prefill kernel reads it in place);
  - q dtypes: a call in a dtype no kernel of its backend takes (Q_DTYPES: the TileLang kernels are bf16
    only) is a TypeError when it is planned, naming the way out; no other backend runs in its place.

Conventions adapted here: every backend returns (out in q's dtype, lse fp32 in BASE 2); the Triton
kernels produce natural-log lse (FlashMLA's contract), converted by one multiply. The max_logits calls
return each kernel's (out, max_logits, natural-log lse) unconverted. A caller's `out` (validated:
checks.check_out) is written by the prefill kernels themselves; only the oracle's result is copied.
Arguments reach these functions validated (attention/prefill.py, attention/decode.py: the public boundary).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

import torch

from ... import config
from ..backend_select import BackendSelector, TileLangUnavailableError  # noqa: F401 (re-export)
from ..backend_select import dp_rank_suffix, import_tilelang_module_or_explain
from ..checks import SUPPORTED_HEADS, TILELANG_HEADS
from ..platform import cuda_capability, triton_interprets

log = logging.getLogger(__name__)

LOG2E = 1.0 / math.log(2.0)  # natural log -> base 2: multiply by log2(e) = 1.4427
# relative to this package: the kernel repository imports the engine under another package name
TILELANG_KERNEL_MODULE = f"{__package__}.tilelang_sm90"
TILELANG_PAGED_FP8_MODULE = f"{__package__}.tilelang_sm90_paged_fp8"
BACKENDS = ("ref", "triton", "tilelang")
# q dtypes each backend's kernels are built for (the TileLang kernels: bf16 only)
Q_DTYPES = {"ref": (torch.bfloat16, torch.float32), "triton": (torch.bfloat16, torch.float32),
            "tilelang": (torch.bfloat16,)}
Q_DTYPE_NOTES = {"tilelang": "the tilelang backend's kernels are bf16 only; DEEPINFER_SPARSE_MLA_BACKEND=triton "
                             "runs float32"}

_selector = BackendSelector("sparse MLA", TILELANG_KERNEL_MODULE, config.sparse_mla_backend,
                            config.SPARSE_MLA_BACKEND.name)
backend_resolution = _selector.resolution


def resolve_backend() -> str:
    return backend_resolution().backend


def backend_of(backend: str | None) -> str:
    """An explicit backend, validated, or the process's resolution."""
    if backend is None:
        return resolve_backend()
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)} or None, got {backend!r}")
    return backend


def backend_for_heads(backend: str | None, h_q: int, name: str) -> tuple[str, str | None]:
    """(the backend that runs a call of h_q heads asked to run on `backend` (None: the process's), why it is
    not that backend or None). The TileLang kernels take h_q 64 or 128 only: under auto resolution another
    h_q runs the triton backend, and the choice says why; tilelang named explicitly (backend='tilelang' or
    DEEPINFER_SPARSE_MLA_BACKEND=tilelang) with another h_q is a ValueError naming `name` (q or h_q)."""
    resolved = backend_of(backend)
    if resolved != "tilelang" or h_q in TILELANG_HEADS:
        return resolved, None
    resolution = backend_resolution()
    if backend is not None or resolution.requested:
        asked = f"backend={backend!r}" if backend is not None else resolution.reason
        raise ValueError(f"{name}: expected h_q in {TILELANG_HEADS} on the tilelang backend ({asked}), got {h_q}; "
                         f"the triton backend runs h_q in {SUPPORTED_HEADS}")
    return "triton", f"h_q {h_q}: the TileLang kernels take 64 or 128 heads -> triton"


def _with_note(note: str | None, reason: str) -> str:
    return reason if note is None else f"{note}; {reason}"


@dataclass(frozen=True)
class KernelChoice:
    op: str  # "prefill" or "decode"
    kernel: str  # the prefill kernel, or for decode "<path>: <kernel>"
    reason: str


_choices_lock = threading.Lock()
_choices: dict[KernelChoice, None] = {}  # insertion-ordered set of the choices made in this process


def _record(choice: KernelChoice) -> KernelChoice:
    with _choices_lock:
        if choice not in _choices:
            _choices[choice] = None
            log.warning("sparse MLA %s kernel: %s (%s)%s", choice.op, choice.kernel, choice.reason, dp_rank_suffix())
    return choice


def kernel_choices() -> list[dict[str, str]]:
    """Every distinct choice made in this process, in order: [{op, kernel, reason}]."""
    with _choices_lock:
        return [dict(op=c.op, kernel=c.kernel, reason=c.reason) for c in _choices]


def reset_resolution_for_tests() -> None:
    """Forget the backend resolution and the recorded kernel choices (tests)."""
    _selector.reset_for_tests()
    with _choices_lock:
        _choices.clear()


# ---------------------------------------------------------------------------------------------
# prefill kernels
# ---------------------------------------------------------------------------------------------

def _gluon_unsupported(q: torch.Tensor, kv: torch.Tensor) -> str | None:
    """Why the Gluon SM90 kernel cannot take (q, kv), or None (its requirements live with it:
    vendor/flashmla_sparse_gluon_sm90.unsupported)."""
    from ..vendor.flashmla_sparse_gluon_sm90 import unsupported

    return unsupported(q, kv)


def prefill_kernel(q: torch.Tensor, kv: torch.Tensor, backend: str | None = None) -> KernelChoice:
    """The kernel that runs sparse MLA prefill on (q, kv) with `backend` (None: the process's; an h_q the
    TileLang kernels do not take: backend_for_heads)."""
    backend, note = backend_for_heads(backend, q.shape[1], "q")
    if backend in ("ref", "tilelang"):
        reason = (backend_resolution().reason if backend == resolve_backend() else f"backend={backend!r}")
        return _record(KernelChoice("prefill", "ref" if backend == "ref" else "tilelang_sm90", reason))
    unsupported = _gluon_unsupported(q, kv)
    if unsupported is None:
        return _record(KernelChoice("prefill", "triton_gluon_sm90",
                                    _with_note(note, "bf16 on SM90, 16-byte aligned rows")))
    return _record(KernelChoice("prefill", "triton_portable", _with_note(note, unsupported)))


_TRITON_PREFILL_KERNELS = {"triton_gluon_sm90": "gluon_sm90", "triton_portable": "portable"}


def run_prefill_kernel(kernel: str, q, kv, indices, sm_scale: float, d_v: int, attn_sink, topk_length,
                       out: torch.Tensor | None = None):
    """Runs one prefill kernel on validated arguments -> (out in q's dtype, lse fp32 base 2). out: a
    validated [s_q, h_q, d_v] buffer (checks.check_out) that the kernel writes (the oracle's result is
    copied into it), None: a new one."""
    if kernel == "ref":
        from .reference import sparse_mla_prefill_ref

        res = sparse_mla_prefill_ref(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
        return _into(out, res.out.to(q.dtype)), res.lse * LOG2E
    if kernel == "tilelang_sm90":
        module = import_tilelang_module_or_explain(TILELANG_KERNEL_MODULE, "sparse MLA backend 'tilelang'")
        return module.sparse_mla_fwd_sm90(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out=out)
    from ..vendor.flashmla_sparse import flash_mla_sparse_fwd

    out, _max_logits, lse_natural = flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                                         kernel=_TRITON_PREFILL_KERNELS[kernel], out=out)
    return out, lse_natural * LOG2E  # +inf (empty rows) stays +inf


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """result, or result copied into the caller's buffer `out` (a kernel without an output argument)."""
    return result if out is None else out.copy_(result)


def run_prefill_kernel_with_max_logits(kernel: str, q, kv, indices, sm_scale: float, d_v: int, attn_sink,
                                       topk_length, out: torch.Tensor | None = None):
    """Runs a kernel of prefill_kernel on validated arguments -> (out in q's dtype, max_logits fp32,
    lse fp32 NATURAL log), as the kernel produces them (no conversion, no extra launch); out as in
    run_prefill_kernel."""
    if kernel == "ref":
        from .reference import sparse_mla_prefill_ref

        res = sparse_mla_prefill_ref(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
        return _into(out, res.out.to(q.dtype)), res.max_logits, res.lse
    if kernel == "tilelang_sm90":
        module = import_tilelang_module_or_explain(TILELANG_KERNEL_MODULE, "sparse MLA backend 'tilelang'")
        return module.sparse_mla_fwd_sm90_with_max_logits(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                                          out=out)
    from ..vendor.flashmla_sparse import flash_mla_sparse_fwd

    return flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                kernel=_TRITON_PREFILL_KERNELS[kernel], out=out)


# ---------------------------------------------------------------------------------------------
# decode paths
# ---------------------------------------------------------------------------------------------

# the kernel of each backend that reads paged fp8 caches itself (either layout, each cache's own page size)
PAGED_FP8_KERNELS = {"tilelang": "tilelang_sm90_paged_fp8", "triton": "triton_paged_fp8"}


def decode_path(q_dtype: torch.dtype, device: torch.device, fp8_layout, has_extra: bool,
                backend: str | None = None, *, h_q: int, caches_aligned16: bool = True) -> KernelChoice:
    """The decode path for caches of `fp8_layout` (kv_cache.MODEL1 / V32, or None for dense rows in q's
    dtype) and h_q heads (one the TileLang kernels do not take: backend_for_heads). caches_aligned16: every
    cache's base and block stride are 16-byte aligned (the TileLang paged kernel reads rows by 16-byte
    cp.async; the layouts themselves need 4 bytes)."""
    backend, note = backend_for_heads(backend, h_q, "h_q")
    if q_dtype not in Q_DTYPES[backend]:  # no kernel of the backend takes it: refused when planned, not at launch
        extra = f" ({Q_DTYPE_NOTES[backend]})" if backend in Q_DTYPE_NOTES else ""
        raise TypeError(f"q_dtype: expected {' or '.join(map(str, Q_DTYPES[backend]))} on the {backend} "
                        f"backend{extra}, got {q_dtype}")
    if fp8_layout is None:
        buffer_kernel = _buffer_kernel(q_dtype, device, backend, h_q)
        if not has_extra:
            return _record(KernelChoice("decode", f"direct: {buffer_kernel}",
                                        _with_note(note, "one dense cache, read in place")))
        return _record(KernelChoice("decode", f"gathered: {buffer_kernel}",
                                    _with_note(note, "two dense caches: rows gathered into one buffer")))
    paged = PAGED_FP8_KERNELS.get(backend)
    why = None
    if paged is None:
        why = f"backend {backend} has no paged fp8 kernel"
    elif backend == "tilelang" and not caches_aligned16:
        why = f"{paged} needs 16-byte aligned cache bases and block strides"
    if why is None:
        return _record(KernelChoice("decode", f"paged_fp8: {paged}",
                                    _with_note(note, f"backend {backend}, {fp8_layout.name} fp8 caches")))
    return _record(KernelChoice("decode", f"gathered: {_buffer_kernel(q_dtype, device, backend, h_q)}",
                                _with_note(note, f"fp8 rows dequantized into a buffer: {why}")))


def _buffer_kernel(q_dtype: torch.dtype, device: torch.device, backend: str, h_q: int) -> str:
    """The prefill kernel that attends over a decode buffer or a dense cache (rows 16-byte aligned: the
    engine's caches and buffers are torch allocations of 512- or 576-element rows)."""
    if backend == "ref":
        return "ref"
    if backend == "tilelang":
        return "tilelang_sm90"
    from ..vendor.flashmla_sparse_gluon_sm90 import heads_unsupported

    gluon = (not triton_interprets() and q_dtype == torch.bfloat16 and device.type == "cuda"
             and cuda_capability(device) == (9, 0) and heads_unsupported(h_q) is None)
    return "triton_gluon_sm90" if gluon else "triton_portable"


def run_paged_fp8_kernel(kernel: str, q, cache0, cache1, slot_indices, sm_scale: float, attn_sink, topk_length,
                         cache_names: tuple[str, str], out: torch.Tensor | None = None):
    """One paged fp8 kernel launch on validated arguments -> (out bf16, lse fp32 base 2). out: a validated
    contiguous buffer for the output (the TileLang kernel allocates its own, copied into it), None: a new one."""
    if kernel != "tilelang_sm90_paged_fp8":
        raise ValueError(f"kernel: no paged fp8 kernel named {kernel!r}")
    module = import_tilelang_module_or_explain(TILELANG_PAGED_FP8_MODULE, "sparse MLA backend 'tilelang'")
    kernel_out, lse = module.sparse_mla_fwd_sm90_paged_fp8(q, cache0, cache1, slot_indices, sm_scale,
                                                           attn_sink=attn_sink, topk_length=topk_length,
                                                           cache_names=cache_names)
    return _into(out, kernel_out), lse
