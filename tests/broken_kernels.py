"""Test-only: deliberately broken sparse MLA kernels, which the fidelity checks (the report's bf16 gate,
scripts/long_context_check.py) must catch, and engine factories that install one in the process that
builds the engine (a DP rank, a long-context run: both are spawned, so they import this module).

A break wraps engine.h20_ops.attention.dispatch.sparse_mla_fwd (every prefill and gathered-decode
launch goes through it) for every backend except `ref`, which stays intact: it is the long-context
check's reference and floor.
  - sink_applied_twice: out *= 1 / (1 + exp(sink - lse)) once more after the kernel;
  - scale_log2e_twice: the softmax scale multiplied by log2(e) once more (the base-2 exponent's factor
    folded in twice): every score 1.44x too large.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import serve_dp
from engine.h20_ops.attention import dispatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import long_context_check  # noqa: E402

LOG2E = 1.0 / math.log(2.0)


def _sink_applied_twice(real):
    def sparse_mla_fwd(q, kv, indices, sm_scale, *, attn_sink=None, **kwargs):
        out, lse_log2 = real(q, kv, indices, sm_scale, attn_sink=attn_sink, **kwargs)
        if attn_sink is None:
            return out, lse_log2
        factor = torch.sigmoid(lse_log2 * math.log(2.0) - attn_sink.float())
        factor = torch.where(torch.isinf(lse_log2), torch.ones_like(factor), factor)
        return (out.float() * factor[..., None]).to(out.dtype), lse_log2
    return sparse_mla_fwd


def _scale_log2e_twice(real):
    def sparse_mla_fwd(q, kv, indices, sm_scale, **kwargs):
        return real(q, kv, indices, sm_scale * LOG2E, **kwargs)
    return sparse_mla_fwd


BREAKS = {"sink_applied_twice": _sink_applied_twice, "scale_log2e_twice": _scale_log2e_twice}


def install(breakage: str) -> None:
    """Wraps dispatch.sparse_mla_fwd with `breakage` for the backends other than ref (once per process)."""
    real = dispatch.sparse_mla_fwd
    if getattr(real, "breakage", None) is not None:
        return
    broken = BREAKS[breakage](real)

    def sparse_mla_fwd(q, kv, indices, sm_scale, *, backend=None, **kwargs):
        run = real if (backend or dispatch.resolve_backend()) == "ref" else broken
        return run(q, kv, indices, sm_scale, backend=backend, **kwargs)

    sparse_mla_fwd.breakage = breakage
    dispatch.sparse_mla_fwd = sparse_mla_fwd


@dataclass(frozen=True)
class BrokenKernelEngineFactory(serve_dp.EngineFactory):
    """serve_dp.EngineFactory whose ranks run a broken kernel."""

    breakage: str = "scale_log2e_twice"

    def __call__(self, device):
        install(self.breakage)
        return super().__call__(device)


@dataclass(frozen=True)
class BrokenKernelEngineBuilder(long_context_check.EngineBuilder):
    """long_context_check.EngineBuilder whose engine runs use a broken kernel (the ref runs stay intact)."""

    breakage: str = "scale_log2e_twice"

    def __call__(self, *args):
        install(self.breakage)
        return super().__call__(*args)
