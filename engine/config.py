"""Every DEEPINFER_* environment variable is read and validated here, and only here.

Values are read at call time (not import time) so that a process, or a test, that sets a
variable before first use gets what it set. A bad value raises ConfigError naming the variable,
the value and the allowed values.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


class ConfigError(ValueError):
    """A DEEPINFER_* variable holds a value outside its allowed set."""


@dataclass(frozen=True)
class Variable:
    name: str
    allowed: tuple[str, ...]
    default: str | None  # None: unset means "auto" (decided by the reader)
    doc: str


SPARSE_MLA_BACKEND = Variable(
    "DEEPINFER_SPARSE_MLA_BACKEND",
    ("tilelang", "triton", "ref"),
    None,
    "Sparse MLA kernel. Unset: tilelang if its kernel module imports, else triton.",
)
SIMULATE_NO_TILELANG = Variable(
    "DEEPINFER_SIMULATE_NO_TILELANG",
    ("0", "1"),
    "0",
    "1: every import of tilelang raises ModuleNotFoundError in this process.",
)
KERNELS = Variable(
    "DEEPINFER_KERNELS",
    ("triton", "ref"),
    "triton",
    "Implementation of the non-attention ops (norms, RoPE, MoE routing...): "
    "triton kernels, or ref (plain torch).",
)
OPS_STRICT = Variable(
    "DEEPINFER_OPS_STRICT",
    ("0", "1"),
    "0",
    "1: an op whose chosen implementation is unavailable raises instead of falling back to ref.",
)
USE_NEXTN_DECODE = Variable(
    "DEEPINFER_USE_NEXTN_DECODE",
    ("0", "1"),
    "0",
    "1: speculative decoding with the model's NextN (MTP) layer.",
)

KERNEL_SOURCE = Variable(
    "DEEPINFER_KERNEL_SOURCE",
    ("native", "hub"),
    "native",
    "Where the engine's ops come from: native (this package) or hub (the kernel repository "
    "DEEPINFER_KERNEL_REPO, verified before import).",
)

ALL_VARIABLES = (SPARSE_MLA_BACKEND, SIMULATE_NO_TILELANG, KERNELS, OPS_STRICT, USE_NEXTN_DECODE, KERNEL_SOURCE)


@dataclass(frozen=True)
class TextVariable:
    """A variable whose value is free text of one form (a path, a repository reference, a dotted path)."""
    name: str
    form: str  # the accepted form, as error messages state it
    doc: str


KERNEL_REPO = TextVariable(
    "DEEPINFER_KERNEL_REPO",
    "a path (starting with /, ./, ../ or ~) or org/name@revision",
    "The kernel repository of DEEPINFER_KERNEL_SOURCE=hub: a local repository (a directory holding build/), "
    "or org/name@revision resolved through DEEPINFER_KERNEL_LOCK and the offline Hugging Face cache.",
)
KERNEL_LOCK = TextVariable(
    "DEEPINFER_KERNEL_LOCK",
    "a path to a kernels.lock file",
    "The lock file that pins the commit of DEEPINFER_KERNEL_REPO=org/name@revision.",
)
KERNEL_MAPPING = TextVariable(
    "DEEPINFER_KERNEL_MAPPING",
    "package.module:function",
    "A callable taking the loaded kernel module and returning {op name: callable}: the ops it names run "
    "those callables instead of the kernel's functions of the same name.",
)

TEXT_VARIABLES = (KERNEL_REPO, KERNEL_LOCK, KERNEL_MAPPING)

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB_REF = re.compile(rf"({_NAME}/{_NAME})@([A-Za-z0-9][A-Za-z0-9._/-]*)")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED_CALLABLE = re.compile(rf"({_IDENT}(?:\.{_IDENT})*):({_IDENT}(?:\.{_IDENT})*)")


def read(var: Variable, environ: Mapping[str, str] | None = None) -> str | None:
    """The validated value of `var` (stripped, lower-cased), or its default when unset/empty."""
    env = os.environ if environ is None else environ
    raw = env.get(var.name)
    if raw is None or raw.strip() == "":
        return var.default
    value = raw.strip().lower()
    if value not in var.allowed:
        raise ConfigError(
            f"{var.name}={raw!r} is not allowed; expected one of {', '.join(var.allowed)}"
            + (" or unset" if var.default is None else f" (default {var.default})")
        )
    return value


def read_text(var: TextVariable, environ: Mapping[str, str] | None = None) -> str | None:
    """The stripped value of `var` (case kept), or None when unset/empty."""
    env = os.environ if environ is None else environ
    raw = env.get(var.name)
    if raw is None or raw.strip() == "":
        return None
    return raw.strip()


def _bad_text(var: TextVariable, value: str, why: str = "") -> ConfigError:
    return ConfigError(f"{var.name}={value!r} is not allowed; expected {var.form}{why}")


@dataclass(frozen=True)
class LocalKernelRepo:
    """A kernel repository on disk: `path` holds build/<variant>/."""
    path: Path

    def __str__(self) -> str:
        return str(self.path)


@dataclass(frozen=True)
class LockedKernelRepo:
    """org/name@revision: the commit comes from the lock file, the files from the offline cache.
    revision "vN" names the lock's version N dependency; anything else a revision (a branch, a tag
    or the 40-hex commit itself)."""
    repo_id: str
    revision: str

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}"


@dataclass(frozen=True)
class KernelSourceSettings:
    source: str  # "native" or "hub"
    repo: LocalKernelRepo | LockedKernelRepo | None  # set exactly when source is "hub"
    lockfile: Path | None  # set exactly when repo is a LockedKernelRepo
    mapping: tuple[str, str] | None  # (module, attribute) of DEEPINFER_KERNEL_MAPPING
    strict: bool  # DEEPINFER_OPS_STRICT


def kernel_source_settings(environ: Mapping[str, str] | None = None) -> KernelSourceSettings:
    """DEEPINFER_KERNEL_SOURCE with the variables that go with it, validated together: hub needs a
    repository; a locked repository needs a lock file; the repository, lock and mapping variables
    are errors under native (they would be ignored)."""
    source = read(KERNEL_SOURCE, environ)
    texts = {var: read_text(var, environ) for var in TEXT_VARIABLES}
    if source == "native":
        given = [var.name for var, value in texts.items() if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} set, but {KERNEL_SOURCE.name}=native does not use "
                              f"{'it' if len(given) == 1 else 'them'}; set {KERNEL_SOURCE.name}=hub or unset "
                              f"{'it' if len(given) == 1 else 'them'}")
        return KernelSourceSettings("native", None, None, None, strict=ops_strict(environ))
    repo_text = texts[KERNEL_REPO]
    if repo_text is None:
        raise ConfigError(f"{KERNEL_SOURCE.name}=hub needs {KERNEL_REPO.name} ({KERNEL_REPO.form})")
    if repo_text.startswith(("/", "./", "../", "~")):
        repo = LocalKernelRepo(Path(repo_text).expanduser())
    else:
        match = _HUB_REF.fullmatch(repo_text)
        if match is None:
            raise _bad_text(KERNEL_REPO, repo_text, " (a relative path needs ./)")
        repo = LockedKernelRepo(match.group(1), match.group(2))
    lock_text = texts[KERNEL_LOCK]
    if isinstance(repo, LockedKernelRepo) and lock_text is None:
        raise ConfigError(f"{KERNEL_REPO.name}={repo_text!r} needs {KERNEL_LOCK.name} ({KERNEL_LOCK.form})")
    if isinstance(repo, LocalKernelRepo) and lock_text is not None:
        raise ConfigError(f"{KERNEL_LOCK.name} is set, but {KERNEL_REPO.name}={repo_text!r} is a local path "
                          "(a lock pins org/name@revision)")
    mapping_text = texts[KERNEL_MAPPING]
    mapping = None
    if mapping_text is not None:
        match = _DOTTED_CALLABLE.fullmatch(mapping_text)
        if match is None:
            raise _bad_text(KERNEL_MAPPING, mapping_text)
        mapping = (match.group(1), match.group(2))
    return KernelSourceSettings("hub", repo, Path(lock_text).expanduser() if lock_text else None, mapping,
                                strict=ops_strict(environ))


def sparse_mla_backend(environ: Mapping[str, str] | None = None) -> str | None:
    return read(SPARSE_MLA_BACKEND, environ)


def simulate_no_tilelang(environ: Mapping[str, str] | None = None) -> bool:
    return read(SIMULATE_NO_TILELANG, environ) == "1"


def kernels(environ: Mapping[str, str] | None = None) -> str:
    return read(KERNELS, environ)


def ops_strict(environ: Mapping[str, str] | None = None) -> bool:
    return read(OPS_STRICT, environ) == "1"


def use_nextn_decode(environ: Mapping[str, str] | None = None) -> bool:
    return read(USE_NEXTN_DECODE, environ) == "1"


def validate_all(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Validate every variable at once (engine start-up); returns name -> effective value."""
    values = {var.name: read(var, environ) for var in ALL_VARIABLES}
    kernel_source_settings(environ)
    values.update({var.name: read_text(var, environ) for var in TEXT_VARIABLES})
    return values
