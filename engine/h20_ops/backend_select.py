"""Choosing between the TileLang and the Triton implementation of an op, once per process.

Auto resolution is triton on a GPU that is not an SM90 (the TileLang kernels are built for sm_90a);
on an SM90 it imports the op's TileLang kernel module: only a ModuleNotFoundError for `tilelang`
itself means "TileLang missing" (-> triton); anything else, a ModuleNotFoundError for one of
TileLang's submodules or dependencies included (a partial install), is a broken install and
propagates. Without CUDA, auto is always triton (TileLang kernels only run on an SM90 GPU; Triton runs
under its interpreter). DEEPINFER_SIMULATE_NO_TILELANG=1 installs an import hook before every
resolution and every import of a TileLang module through this module (explicit backends included), so
that from then on every import of tilelang fails as on a node without TileLang. The variable is read
then, not at import time: a process (a DP rank) that sets it after importing the engine gets what it
set. The result and its reason are logged once per process, with the DP rank when
torch.distributed is initialized.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from .. import config
from .platform import triton_interprets

log = logging.getLogger(__name__)

# Every module imported through import_tilelang_module: dropped together with tilelang when blocked.
_TILELANG_KERNEL_MODULES: set[str] = set()


class TileLangUnavailableError(RuntimeError):
    """TileLang was asked for explicitly on a process where it cannot be imported."""


@dataclass(frozen=True)
class Resolution:
    backend: str
    reason: str
    tilelang_missing: str | None  # the ModuleNotFoundError text when auto resolution fell back
    requested: bool = False  # named by the op's override variable (not auto resolution)


def _is_tilelang(name: str | None) -> bool:
    return name is not None and (name == "tilelang" or name.startswith("tilelang."))


class _BlockTileLang(importlib.abc.MetaPathFinder):
    """Makes `import tilelang` (and any submodule) raise ModuleNotFoundError for `tilelang`, as on a
    machine where the package does not exist."""

    def find_spec(self, fullname, path=None, target=None):
        if _is_tilelang(fullname):
            raise ModuleNotFoundError(
                "No module named 'tilelang' (blocked by DEEPINFER_SIMULATE_NO_TILELANG=1)", name="tilelang")
        return None


def install_tilelang_block() -> None:
    """Idempotent; also drops already-imported tilelang and TileLang kernel modules (and their
    attributes on the parent package, which `from package import module` would return) so that later
    imports hit the hook."""
    if not any(isinstance(f, _BlockTileLang) for f in sys.meta_path):
        sys.meta_path.insert(0, _BlockTileLang())
    for name in list(sys.modules):
        if _is_tilelang(name) or name in _TILELANG_KERNEL_MODULES:
            del sys.modules[name]
            parent, _, child = name.rpartition(".")
            if parent in sys.modules and not _is_tilelang(parent):
                sys.modules[parent].__dict__.pop(child, None)


def import_tilelang_module(module: str):
    """Imports a module built on TileLang. TileLang missing: ModuleNotFoundError (name 'tilelang');
    anything else that fails (a missing TileLang submodule or dependency, a bad binary) is a broken
    install: ImportError / the original error."""
    _TILELANG_KERNEL_MODULES.add(module)
    if config.simulate_no_tilelang():
        install_tilelang_block()
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == "tilelang":
            raise
        raise ImportError(f"TileLang module {module} failed to import (a broken TileLang install?): {exc}") from exc


def import_tilelang_module_or_explain(module: str, requested_as: str):
    """import_tilelang_module for a caller that asked for TileLang explicitly (`requested_as`, e.g.
    "backend='tilelang'"): TileLang missing is a TileLangUnavailableError saying so."""
    try:
        return import_tilelang_module(module)
    except ModuleNotFoundError as exc:
        raise TileLangUnavailableError(
            f"{requested_as} but TileLang cannot be imported ({exc}); install the `tilelang` extra (or the "
            "offline bundle, see README) or choose triton") from exc


def dp_rank_suffix() -> str:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return f" [dp rank {dist.get_rank()}/{dist.get_world_size()}]"
    return ""


class BackendSelector:
    """The process-wide backend of one op. `requested` returns the validated value of the op's
    override variable (None: auto); `variable` is its name, for reasons and errors."""

    def __init__(self, op: str, tilelang_module: str, requested: Callable[[], str | None] = lambda: None,
                 variable: str | None = None):
        self.op = op
        self.tilelang_module = tilelang_module
        self.requested = requested
        self.variable = variable
        self._lock = threading.Lock()
        self._resolution: Resolution | None = None
        _TILELANG_KERNEL_MODULES.add(tilelang_module)

    def import_tilelang(self):
        return import_tilelang_module(self.tilelang_module)

    def _resolve(self) -> Resolution:
        if config.simulate_no_tilelang():
            install_tilelang_block()
        requested = self.requested()
        if requested is not None and requested != "tilelang":
            return Resolution(requested, f"{self.variable}={requested}", None, requested=True)
        if requested == "tilelang":
            import_tilelang_module_or_explain(self.tilelang_module, f"{self.variable}=tilelang")
            return Resolution("tilelang", f"{self.variable}=tilelang", None, requested=True)
        if not torch.cuda.is_available():
            reason = ("auto: no CUDA device (Triton interpreter)" if triton_interprets() else
                      "auto: no CUDA device, and TRITON_INTERPRET turns Triton's interpreter off: its kernels "
                      "cannot run")
            return Resolution("triton", reason, None)
        capability = torch.cuda.get_device_capability()
        if capability != (9, 0):
            return Resolution("triton", f"auto: GPU sm_{capability[0]}{capability[1]} is not SM90 (the TileLang "
                                        "kernels are built for sm_90a)", None)
        try:
            self.import_tilelang()
        except ModuleNotFoundError as exc:
            return Resolution("triton", f"auto: TileLang missing ({exc})", str(exc))
        return Resolution("tilelang", "auto: TileLang kernel module imported", None)

    def resolution(self) -> Resolution:
        """The process's resolution (computed and logged once)."""
        with self._lock:
            if self._resolution is None:
                self._resolution = self._resolve()
                log.warning("%s backend: %s (%s)%s", self.op, self._resolution.backend, self._resolution.reason,
                            dp_rank_suffix())
            return self._resolution

    def reset_for_tests(self) -> None:
        with self._lock:
            self._resolution = None
