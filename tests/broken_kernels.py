"""Test-only: deliberately broken sparse MLA kernels, which the fidelity checks (the report's bf16 gate,
scripts/long_context_check.py) must catch, and engine factories that install one in the process that
builds the engine (a DP rank, a long-context run: both are spawned, so they import this module).

A break wraps the two functions of engine.h20_ops.attention.dispatch that launch every sparse MLA
kernel: run_prefill_kernel (prefill, and decode over dense or gathered rows) and run_paged_fp8_kernel
(decode reading the paged fp8 caches); the oracle (kernel "ref") stays intact: it is the long-context
check's reference and floor.
  - sink_applied_twice: out *= 1 / (1 + exp(sink - lse)) once more after the kernel (in place: the
    caller's output buffer is the result);
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


def _apply_sink_again(out: torch.Tensor, lse_log2: torch.Tensor, attn_sink: torch.Tensor | None) -> None:
    if attn_sink is None:  # a split launch: the merge applies the sink (once)
        return
    factor = torch.sigmoid(lse_log2 * math.log(2.0) - attn_sink.float())
    factor = torch.where(torch.isinf(lse_log2), torch.ones_like(factor), factor)
    out.copy_((out.float() * factor[..., None]).to(out.dtype))


def _broken_prefill(real, breakage: str):
    def run_prefill_kernel(kernel, q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out=None):
        if kernel == "ref":
            return real(kernel, q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out)
        if breakage == "scale_log2e_twice":
            return real(kernel, q, kv, indices, sm_scale * LOG2E, d_v, attn_sink, topk_length, out)
        result, lse_log2 = real(kernel, q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out)
        _apply_sink_again(result, lse_log2, attn_sink)
        return result, lse_log2
    return run_prefill_kernel


def _broken_paged(real, breakage: str):
    def run_paged_fp8_kernel(kernel, q, cache0, cache1, slot_indices, sm_scale, attn_sink, topk_length,
                             cache_names, out=None):
        if breakage == "scale_log2e_twice":
            return real(kernel, q, cache0, cache1, slot_indices, sm_scale * LOG2E, attn_sink, topk_length,
                        cache_names, out)
        result, lse_log2 = real(kernel, q, cache0, cache1, slot_indices, sm_scale, attn_sink, topk_length,
                                cache_names, out)
        _apply_sink_again(result, lse_log2, attn_sink)
        return result, lse_log2
    return run_paged_fp8_kernel


BREAKS = ("sink_applied_twice", "scale_log2e_twice")


def install(breakage: str) -> None:
    """Wraps the dispatcher's kernel launchers with `breakage` (once per process)."""
    if breakage not in BREAKS:
        raise ValueError(f"breakage: expected one of {', '.join(BREAKS)}, got {breakage!r}")
    if getattr(dispatch.run_prefill_kernel, "breakage", None) is not None:
        return
    dispatch.run_prefill_kernel = _broken_prefill(dispatch.run_prefill_kernel, breakage)
    dispatch.run_paged_fp8_kernel = _broken_paged(dispatch.run_paged_fp8_kernel, breakage)
    dispatch.run_prefill_kernel.breakage = breakage


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
