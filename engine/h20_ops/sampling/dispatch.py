"""fused_sample: token selection from logits on one Philox stream, TileLang or Triton.

Ops (one sampling-kernel launch per batch each, after a few torch elementwise ops that turn the
temperatures into fp32 scales and top_k into int64):
- greedy_sample(logits [N, V]) -> tokens [N] int64 (first index of the maximum).
- sample(logits [N, V], seeds, positions, temperature, top_k, top_p, draw=DRAW_SAMPLE) -> tokens [N]
  int64: temperature + top-k + top-p sampling; temperature <= 0 means greedy for that row. The
  drafter of speculative decoding passes draw=DRAW_DRAFT so that its draws are independent of the
  verifier's.
- rejection_sample(target_logits [N, K+1, V], draft_logits [N, K, V], draft_tokens [N, K], seeds,
  positions, temperature, top_k, top_p) -> (tokens [N, K+1] int64, -1 after the last emitted one;
  accepted [N] int64): chain speculative verification; draft j is proposed for positions + j.
Per-request tensors [N]: seeds int64 (the Philox key), positions int64 (position of the first token
to emit), temperature fp32, top_k int32/int64 (<= 0 or >= V: off), top_p fp32 (>= 1: off).
A sampled row's temperature must make log2(e) / T a normal fp32 (T in about [1.2e-38, 1.2e38]: an
infinite scale gives NaN weights and token -1; a subnormal one reads as greedy where the kernel is
built with fast math) and top_p must not be NaN. Values are not checked here (on a GPU that is a host
sync per call); engine.runner.SamplingParams checks them per request.
Semantics, the random-stream mapping and the test thresholds: docs/sampling.md.

Backends: `tilelang` (engine.h20_ops.sampling.tilelang_sm90), `triton`
(engine.h20_ops.sampling.triton_kernels) and `ref` (engine.h20_ops.sampling.reference, numpy on the CPU);
all consume the same stream and agree token for token. Unset `backend` resolves once per process
as the sparse MLA dispatcher's auto mode does (engine.h20_ops.backend_select).
"""

from __future__ import annotations

import torch

from ..platform import triton_interprets
from ..backend_select import BackendSelector, import_tilelang_module_or_explain
from ..checks import require_last_dim_contiguous, require_same_device, require_tensor
from .reference import DRAW_DRAFT, DRAW_SAMPLE, sampling_scale

TILELANG_KERNEL_MODULE = f"{__package__}.tilelang_sm90"
BACKENDS = ("ref", "triton", "tilelang")
MAX_VOCAB = 2**31 - 2**16  # the kernels' int32 block loops step past V by up to one block
LOGIT_DTYPES = (torch.float32, torch.bfloat16)

_selector = BackendSelector("fused_sample", TILELANG_KERNEL_MODULE)
backend_resolution = _selector.resolution
reset_resolution_for_tests = _selector.reset_for_tests


def resolve_backend() -> str:
    return backend_resolution().backend


def _implementation(backend: str | None, logits_name: str, logits: torch.Tensor):
    """The backend's module, once the logits are on a device it runs on (the kernels would fail with
    a launcher's error instead)."""
    if backend is None:
        backend = resolve_backend()
    elif backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)} or None, got {backend!r}")
    if backend == "ref":
        from . import reference as impl
    elif backend == "triton":
        if not (logits.is_cuda or triton_interprets()):
            raise ValueError(f"{logits_name}: expected a CUDA tensor for the triton backend (or Triton's interpreter: "
                             f"TRITON_INTERPRET=1), got device {logits.device}")
        from . import triton_kernels as impl
    else:
        impl = import_tilelang_module_or_explain(TILELANG_KERNEL_MODULE, "fused_sample backend 'tilelang'")
        if not logits.is_cuda:
            raise ValueError(f"{logits_name}: expected a CUDA tensor for the tilelang backend, "
                             f"got device {logits.device}")
    return impl


def _check_logits(name: str, logits, ndim: int) -> None:
    require_tensor(name, logits, dtypes=LOGIT_DTYPES, ndim=ndim)
    require_last_dim_contiguous(name, logits)
    if logits.size(-1) < 1:
        raise ValueError(f"{name}: expected a vocabulary of at least 1 entry, got shape {tuple(logits.shape)}")
    if logits.size(-1) > MAX_VOCAB:
        raise ValueError(f"{name}: expected a vocabulary of at most 2^31 - 2^16 entries, got {logits.size(-1)}")


def _check_request(name: str, t, n: int, dtypes: tuple[torch.dtype, ...]) -> None:
    require_tensor(name, t, dtypes=dtypes, ndim=1)
    if t.size(0) != n:
        raise ValueError(f"{name}: expected shape [{n}] (one entry per request), got {tuple(t.shape)}")


def _request_tensors(ref_name, ref, seeds, positions, temperature, top_k, top_p):
    """Validate the per-request tensors; returns them contiguous in the kernels' dtypes."""
    n = ref.size(0)
    _check_request("seeds", seeds, n, (torch.int64,))
    _check_request("positions", positions, n, (torch.int64,))
    _check_request("temperature", temperature, n, (torch.float32,))
    _check_request("top_k", top_k, n, (torch.int32, torch.int64))
    _check_request("top_p", top_p, n, (torch.float32,))
    require_same_device(ref_name, ref, seeds=seeds, positions=positions, temperature=temperature, top_k=top_k,
                        top_p=top_p)
    return (seeds.contiguous(), positions.contiguous(), sampling_scale(temperature).contiguous(),
            top_k.to(torch.int64).contiguous(), top_p.contiguous())


def greedy_sample(logits: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """First index of each row's maximum: tokens [N] int64."""
    _check_logits("logits", logits, 2)
    return _implementation(backend, "logits", logits).greedy(logits)


def sample(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor,
           top_k: torch.Tensor, top_p: torch.Tensor, *, draw: int = DRAW_SAMPLE,
           backend: str | None = None) -> torch.Tensor:
    """Temperature + top-k + top-p sampling of one token per row: tokens [N] int64."""
    _check_logits("logits", logits, 2)
    if isinstance(draw, bool) or not isinstance(draw, int) or draw not in (DRAW_SAMPLE, DRAW_DRAFT):
        raise ValueError(f"draw: expected DRAW_SAMPLE ({DRAW_SAMPLE}) or DRAW_DRAFT ({DRAW_DRAFT}), got {draw!r}")
    args = _request_tensors("logits", logits, seeds, positions, temperature, top_k, top_p)
    return _implementation(backend, "logits", logits).sample(logits, *args, draw)


def rejection_sample(target_logits: torch.Tensor, draft_logits: torch.Tensor, draft_tokens: torch.Tensor,
                     seeds: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, *, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain speculative rejection sampling of K drafts: (tokens [N, K+1] int64, accepted [N] int64)."""
    _check_logits("target_logits", target_logits, 3)
    _check_logits("draft_logits", draft_logits, 3)
    n, k1, v = target_logits.shape
    if k1 < 2:
        raise ValueError(f"target_logits: expected K+1 >= 2 rows per request, got shape {tuple(target_logits.shape)}")
    if draft_logits.dtype != target_logits.dtype:
        raise TypeError(f"draft_logits: expected dtype {target_logits.dtype} (as target_logits), "
                        f"got {draft_logits.dtype}")
    if tuple(draft_logits.shape) != (n, k1 - 1, v):
        raise ValueError(f"draft_logits: expected shape {(n, k1 - 1, v)}, got {tuple(draft_logits.shape)}")
    require_tensor("draft_tokens", draft_tokens, dtypes=(torch.int32, torch.int64), ndim=2)
    if tuple(draft_tokens.shape) != (n, k1 - 1):
        raise ValueError(f"draft_tokens: expected shape {(n, k1 - 1)}, got {tuple(draft_tokens.shape)}")
    require_same_device("target_logits", target_logits, draft_logits=draft_logits, draft_tokens=draft_tokens)
    args = _request_tensors("target_logits", target_logits, seeds, positions, temperature, top_k, top_p)
    return _implementation(backend, "target_logits", target_logits).rejection_sample(target_logits, draft_logits,
                                                     draft_tokens.to(torch.int64).contiguous(), *args)
