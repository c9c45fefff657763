"""Which implementation of each engine op runs: this package's own (native) or a kernel repository's (hub).

The engine calls every routed op through `op(name)` (OPS: the attention entry points, the norms, RoPE,
the fp8 KV-cache write and read, the hyper-connection). The table is resolved once per process, on the
first call, from engine.config.kernel_source_settings():
- DEEPINFER_KERNEL_SOURCE=native (default): engine.h20_ops / engine.ops. `kernels` is never imported.
- hub: the repository DEEPINFER_KERNEL_REPO (a local path, or org/name@revision through
  DEEPINFER_KERNEL_LOCK and the offline cache) is verified and imported by engine.kernel_repo (every
  file of every variant against its metadata.json digest, before the import). Each op is the kernel's
  attribute of the same name, or what DEEPINFER_KERNEL_MAPPING's callable returns for it: the callable
  (package.module:function, imported on resolution) takes the loaded kernel module and returns a mapping
  {op name: callable} over a subset of OPS.
The project's fallback policy: an op falls back only when its hub implementation is missing -- `kernels`
not installed, a repository that cannot be resolved or verified, a kernel without that op. Under
DEEPINFER_OPS_STRICT=1 that raises KernelSourceError; otherwise the native op runs and every such call is
counted per op (fallback_counts(), in the report). Never a fallback: an error raised while importing
the kernel's code or while running an op (they propagate), and a bad mapping (a path that does not
import, not a callable, a result that is not a mapping of op names to callables): KernelSourceError.

report() says per process what runs: source, repository, commit, variant, digest, each op's origin.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

from . import config, kernel_repo
from . import ops as native_ops
from . import h20_ops as native_h20_ops

log = logging.getLogger(__name__)

OPS = ("sparse_mla_prefill", "plan_sparse_decode", "sparse_mla_decode", "rms_norm", "rope", "kv_quantize",
       "kv_gather_dequant", "hyper_connection")
_NATIVE = {"sparse_mla_prefill": native_h20_ops.sparse_mla_prefill,
           "plan_sparse_decode": native_h20_ops.plan_sparse_decode,
           "sparse_mla_decode": native_h20_ops.sparse_mla_decode,
           "rms_norm": native_ops.rms_norm, "rope": native_ops.rope, "kv_quantize": native_ops.kv_quantize,
           "kv_gather_dequant": native_ops.kv_gather_dequant, "hyper_connection": native_ops.hyper_connection}


class KernelSourceError(RuntimeError):
    """A hub kernel cannot be used under DEEPINFER_OPS_STRICT=1, or DEEPINFER_KERNEL_MAPPING is bad."""


@dataclass(frozen=True)
class _Table:
    settings: config.KernelSourceSettings
    impls: dict[str, Callable]
    origins: dict[str, str]  # op -> "native", "hub" or "mapping"
    falling_back: frozenset[str]  # ops that run native because their hub implementation is missing
    kernel: kernel_repo.LoadedKernel | None
    problem: str | None  # why the hub kernel (or an op of it) is not used


_lock = threading.RLock()  # reentrant: a resolution that re-enters raises instead of deadlocking
_table: _Table | None = None
_resolving = False
_fallbacks: Counter[str] = Counter()


def op(name: str) -> Callable:
    """The implementation of engine op `name` in this process. Each lookup that returns a native op standing
    in for a missing hub op is counted (call sites look an op up for each call: `op("rms_norm")(x, ...)`)."""
    table = _table if _table is not None else _resolve()
    impl = table.impls.get(name)
    if impl is None:
        raise ValueError(f"op: {name!r} is not a routed op; expected one of {', '.join(OPS)}")
    if name in table.falling_back:
        with _lock:
            _fallbacks[name] += 1
    return impl


def fallback_counts() -> dict[str, int]:
    """op -> calls served natively because the hub implementation is missing (and "layer <name>" ->
    modules kernelized with this package's layer because the hub kernel is missing: engine.layer_kernels)."""
    with _lock:
        return dict(_fallbacks)


def count_fallback(name: str, n: int = 1) -> None:
    with _lock:
        _fallbacks[name] += n


def loaded_kernel() -> kernel_repo.LoadedKernel | None:
    """The verified hub kernel of this process (None: native source, or it could not be used)."""
    return (_table if _table is not None else _resolve()).kernel


def reset() -> None:
    """Forget the resolved table and the counts (the next op() resolves again: tests)."""
    global _table
    with _lock:
        _table = None
        _fallbacks.clear()


def report() -> dict:
    """What runs in this process (resolves the table if nothing has yet)."""
    table = _table if _table is not None else _resolve()
    s, k = table.settings, table.kernel
    return {"source": s.source, "strict": s.strict, "repo": str(s.repo) if s.repo else None,
            "mapping": ":".join(s.mapping) if s.mapping else None,
            "commit": k.commit if k else None, "variant": k.variant if k else None, "digest": k.digest if k else None,
            "ops": dict(table.origins), "fallbacks": fallback_counts(), "problem": table.problem}


def op_fallback_counts() -> dict[str, int]:
    """engine.ops' Triton -> ref fallbacks (DEEPINFER_KERNELS) of the ops in use: this package's and, under
    the hub source, those of the kernel's own copy of the ops module."""
    counts = Counter(native_ops.fallback_counts())
    k = loaded_kernel()
    kernel_ops = getattr(k.module, "ops", None) if k else None
    if kernel_ops is not None and hasattr(kernel_ops, "fallback_counts"):
        counts.update(kernel_ops.fallback_counts())
    return dict(counts)


def attention_dispatch():
    """The sparse MLA dispatcher behind op("sparse_mla_prefill"): the hub kernel's own copy when that op
    comes from a kernel built from this package (it has h20_ops.attention.dispatch), else this package's."""
    table = _table if _table is not None else _resolve()
    if table.origins["sparse_mla_prefill"] == "hub":
        h20 = getattr(table.kernel.module, "h20_ops", None)
        dispatch = getattr(getattr(h20, "attention", None), "dispatch", None)
        if dispatch is not None:
            return dispatch
    from .h20_ops.attention import dispatch

    return dispatch


def _resolve() -> _Table:
    global _table, _resolving
    with _lock:
        if _table is None:
            if _resolving:  # the same thread, from inside _build: a mapping callable asking for the table
                raise KernelSourceError(f"{config.KERNEL_MAPPING.name}={config.read_text(config.KERNEL_MAPPING)}: "
                                        "the callable used engine.kernel_source while the op table was being resolved")
            _resolving = True
            try:
                _table = _build(config.kernel_source_settings())
            finally:
                _resolving = False
            log.info("kernel source: %s", _describe(_table))
        return _table


def _describe(t: _Table) -> str:
    if t.settings.source == "native":
        return "native"
    where = t.kernel.describe() if t.kernel else f"{t.settings.repo} (not used: {t.problem})"
    fallback = f"; native for {', '.join(sorted(t.falling_back))}" if t.falling_back else ""
    return f"hub {where}{fallback}"


def _missing(settings: config.KernelSourceSettings, what: str) -> None:
    if settings.strict:
        raise KernelSourceError(f"{what}, and DEEPINFER_OPS_STRICT=1")
    log.warning("%s: the native implementation runs (counted per op)", what)


def _build(settings: config.KernelSourceSettings) -> _Table:
    native = {name: "native" for name in OPS}
    if settings.source == "native":
        return _Table(settings, dict(_NATIVE), native, frozenset(), None, None)
    try:
        kernel = kernel_repo.load(settings.repo, settings.lockfile)
    except kernel_repo.KernelRepoError as exc:
        problem = f"kernel repository {settings.repo}: {exc}"
        _missing(settings, problem)
        return _Table(settings, dict(_NATIVE), native, frozenset(OPS), None, problem)
    mapped = _user_mapping(settings, kernel) if settings.mapping else {}
    impls, origins, falling_back, problems = {}, {}, set(), []
    for name in OPS:
        impl = mapped.get(name)
        if impl is not None:
            impls[name], origins[name] = impl, "mapping"
            continue
        impl = getattr(kernel.module, name, None)
        if callable(impl):
            impls[name], origins[name] = impl, "hub"
            continue
        problems.append(name)
        impls[name], origins[name] = _NATIVE[name], "native"
        falling_back.add(name)
    problem = None
    if problems:
        problem = f"kernel {kernel.describe()} has no callable {', '.join(problems)}"
        _missing(settings, problem)
    return _Table(settings, impls, origins, frozenset(falling_back), kernel, problem)


def _user_mapping(settings: config.KernelSourceSettings, kernel: kernel_repo.LoadedKernel) -> dict[str, Callable]:
    module_name, attr_path = settings.mapping
    where = f"{config.KERNEL_MAPPING.name}={module_name}:{attr_path}"
    try:
        target = importlib.import_module(module_name)
    except ImportError as exc:
        raise KernelSourceError(f"{where}: cannot import {module_name}: {exc}") from exc
    for attr in attr_path.split("."):
        if not hasattr(target, attr):
            raise KernelSourceError(f"{where}: {type(target).__name__} {getattr(target, '__name__', target)!r} "
                                    f"has no attribute {attr!r}")
        target = getattr(target, attr)
    if not callable(target):
        raise KernelSourceError(f"{where}: expected a callable, got {type(target).__name__}")
    result = target(kernel.module)
    if not isinstance(result, Mapping):
        raise KernelSourceError(f"{where}: the callable returned {type(result).__name__}; expected a mapping "
                                "{op name: callable}")
    unknown = sorted(str(k) for k in result if k not in OPS)
    if unknown:
        raise KernelSourceError(f"{where}: unknown op name(s) {', '.join(unknown)}; expected some of {', '.join(OPS)}")
    not_callable = sorted(k for k, v in result.items() if not callable(v))
    if not_callable:
        raise KernelSourceError(f"{where}: the value for {', '.join(not_callable)} is not callable")
    return dict(result)
