"""Every DEEPINFER_* environment variable is read and validated here, and only here.

Values are read at call time (not import time) so that a process, or a test, that sets a
variable before first use gets what it set. A bad value raises ConfigError naming the variable,
the value and the allowed values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
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

ALL_VARIABLES = (SPARSE_MLA_BACKEND, SIMULATE_NO_TILELANG, KERNELS, OPS_STRICT, USE_NEXTN_DECODE)


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
    return {var.name: read(var, environ) for var in ALL_VARIABLES}
