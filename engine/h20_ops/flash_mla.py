"""FlashMLA's sparse attention interface on this project's kernels: the drop-in for SGLang and vLLM on Hopper.

An engine that imports FlashMLA's interface (`flash_mla`, `sgl_kernel.flash_mla`, vLLM's
`vllm.v1.attention.ops.flashmla`) imports this module instead and keeps its calls: the same names,
arguments, results and conventions for the sparse paths DeepSeek-V3.2 and V4 use. Every kernel choice
is the dispatcher's (engine.h20_ops.attention.dispatch, logged once per process): this module does not
know which kernel runs.

flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, out=None)
  -> (out [s_q, h_q, d_v] in q's dtype, max_logits [s_q, h_q] fp32, lse [s_q, h_q] fp32 NATURAL log):
  sparse prefill, FlashMLA's current contract: entry j of row i is valid iff 0 <= indices[i, j] < s_kv
  and j < topk_length[i]; a row without a valid entry gets out 0, max_logits -inf, lse +inf; the sink
  scales out by 1 / (1 + exp(sink - lse)) and changes neither lse nor max_logits. The dispatcher's
  prefill kernel runs it (tilelang_sm90 in its with_max_logits variant, or a Triton kernel), which
  produces max_logits and natural-log lse itself and writes `out` in place: one launch, no conversion
  or copy. `out` must be contiguous with a 16-byte aligned data pointer (the TileLang kernel stores it
  by TMA; the rule is the same on every backend), else ValueError naming out.
get_mla_metadata(*args, **kwargs) -> (FlashMLASchedMeta, None): an empty metadata object (the arguments
  of FlashMLA's old interface are accepted and ignored, as FlashMLA does).
flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                       num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                       attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                       extra_topk_length=None, out=None)
  -> (out [b, s_q, h_q, 512] in q's dtype, lse [b, h_q, s_q] fp32 NATURAL log, the sink not in it):
  FlashMLA's SPARSE decode (engine.h20_ops.sparse_mla_decode underneath): q [b, s_q, h_q, d_qk];
  k_cache a paged fp8 cache [num_blocks, page_block_size, 1, bytes] in the V4 "MODEL1" (584 B, d_qk
  512) or the V3.2 (656 B, d_qk 576) layout, uint8 / int8 / float8_e4m3fn; indices [b, s_q, topk] int32
  flat slot ids (physical block * page_block_size + offset); extra_k_cache (same layout, its own page
  size) + extra_indices_in_kvcache [b, s_q, extra_topk] attended in the same softmax, the sink applied
  once; topk_length / extra_topk_length [b] int32 per request. block_table and cache_seqlens are not
  read on this path (FlashMLA ignores them there too). `out`, when given, is written in place (it must
  be contiguous) and returned.
  The metadata object: the first call that takes it records the call's shapes and makes their
  DecodePlan (the dispatcher's path and kernel, the split: engine.h20_ops.plan_sparse_decode), host
  work only (nothing launched: safe during CUDA-graph capture); every later call with it reuses that
  plan and must have the same shapes (batch, s_q, h_q, d_qk, q's dtype and device, cache layout,
  page_block_size, topk, and the extra cache's page size and topk), else ValueError naming
  tile_scheduler_metadata: one object per layer type per step, as in FlashMLA. The plan does not depend
  on the values of topk_length / extra_topk_length, so unlike FlashMLA's metadata the object stays
  valid across steps whose shapes are equal. The lse conversion (base 2 -> natural, [b, s_q, h_q] ->
  [b, h_q, s_q]) is one elementwise multiply of the small lse tensor in place plus a transposed view
  (FlashMLA's own lse has these strides).

Deliberate deviations (supersets of what FlashMLA accepts):
  - decode: every slot id outside [0, num_blocks * page_block_size) is invalid (FlashMLA: only -1), as
    in prefill; invalid entries are never read;
  - any topk and extra topk >= 1 (FlashMLA: multiples of 64 in decode, of 128 in prefill), any
    page_block_size, any block stride the layout allows (token stride = bytes per token, blocks not
    overlapping, 4-byte aligned), any b and s_q;
  - prefill indices may also be [s_q, topk]; float32 q with the triton and ref backends;
  - h_q 8, 16 and 32 (a tensor-parallel rank's heads; callers of FlashMLA pad them to 64) in both
    functions, run by the Triton kernels (the dispatcher's rule: docs/api.md "Head counts").
Not supported, each a clear error (FlashMLA kills the process on some malformed inputs instead):
  dense decode (indices None: NotImplementedError); causal=True, is_fp8_kvcache=False, a cache of
  another dtype, num_splits other than None or head_dim_v other than 512 on the sparse path (FlashMLA
  refuses these too: ValueError / TypeError); every malformed argument raises naming it.
Numerics: the kernels' (bf16 operands, fp32 accumulation); lse conversions in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import dispatch
from .attention.decode import D_V, DecodePlan, plan_sparse_decode, require_heads, sparse_mla_decode
from .checks import check_decode_cache, check_out, check_sparse_mla_args, require_tensor
from .kv_cache import LAYOUTS

__all__ = ["FlashMLASchedMeta", "flash_mla_sparse_fwd", "flash_mla_with_kvcache", "get_mla_metadata"]

LN2 = math.log(2.0)  # base 2 -> natural log
FP8_CACHE_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn)
# sparse_mla_decode's argument names -> FlashMLA's, for its error messages
DECODE_ARG_NAMES = {"cache": "k_cache", "extra_cache": "extra_k_cache", "extra_indices": "extra_indices_in_kvcache",
                    "sm_scale": "softmax_scale", "plan": "tile_scheduler_metadata"}


def flash_mla_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                         attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                         out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill (module header): q [s_q, h_q, d_qk] bf16, h_q 8, 16, 32, 64 or 128, d_qk 512 or 576;
    kv [s_kv, 1, d_qk]; indices [s_q, 1, topk] (or [s_q, topk]) int32; attn_sink [h_q] fp32; topk_length
    [s_q] int32; out [s_q, h_q, d_v] contiguous (16-byte aligned) in q's dtype or None.
    -> (out, max_logits, lse natural)."""
    backend = dispatch.backend_of(None)
    shape, indices = check_sparse_mla_args(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                           q_dtypes=dispatch.Q_DTYPES[backend],
                                           q_dtype_note=dispatch.Q_DTYPE_NOTES.get(backend),
                                           limit_shapes=backend != "ref")
    if out is not None:
        check_out("out", out, (shape.s_q, shape.h_q, d_v), q.dtype, q.device)
    kernel = dispatch.prefill_kernel(q, kv).kernel
    return dispatch.run_prefill_kernel_with_max_logits(kernel, q, kv, indices, float(sm_scale), d_v, attn_sink,
                                                       topk_length, out)


@dataclass(frozen=True)
class DecodeShapes:
    """What a metadata object's plan was made for (module header)."""

    batch: int
    s_q: int
    h_q: int
    d_qk: int
    q_dtype: torch.dtype
    device: torch.device
    bytes_per_token: int
    page_block_size: int
    topk: int
    extra_page_block_size: int | None
    extra_topk: int | None


@dataclass
class FlashMLASchedMeta:
    """get_mla_metadata's object: empty until the first flash_mla_with_kvcache call that takes it, which
    stores its shapes (`config`) and the DecodePlan made for them (`plan`); later calls reuse the plan."""

    config: DecodeShapes | None = None
    plan: DecodePlan | None = None

    @property
    def have_initialized(self) -> bool:
        return self.plan is not None


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    """A new, empty metadata object, and None (FlashMLA's return shape). Arguments are ignored."""
    return FlashMLASchedMeta(), None


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None,
                           cache_seqlens: torch.Tensor | None, head_dim_v: int,
                           tile_scheduler_metadata: FlashMLASchedMeta, num_splits: None = None,
                           softmax_scale: float | None = None, causal: bool = False, is_fp8_kvcache: bool = False,
                           indices: torch.Tensor | None = None, attn_sink: torch.Tensor | None = None,
                           extra_k_cache: torch.Tensor | None = None,
                           extra_indices_in_kvcache: torch.Tensor | None = None,
                           topk_length: torch.Tensor | None = None, extra_topk_length: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode over paged fp8 caches (module header) -> (out [b, s_q, h_q, 512], lse [b, h_q, s_q]
    natural log). block_table and cache_seqlens are not read (the slot ids carry the paging)."""
    meta = tile_scheduler_metadata
    if not isinstance(meta, FlashMLASchedMeta):
        raise TypeError(f"tile_scheduler_metadata: expected the FlashMLASchedMeta of this module's "
                        f"get_mla_metadata(), got {type(meta).__name__}")
    if num_splits is not None:
        raise ValueError(f"num_splits: must be None (a placeholder of FlashMLA's old interface; the split is "
                         f"the plan's), got {type(num_splits).__name__}")
    if indices is None:
        raise NotImplementedError("indices: None asks for FlashMLA's dense decode (block_table + cache_seqlens), "
                                  "which this module does not implement; it implements the sparse decode "
                                  "(indices = flat slot ids)")
    if causal:
        raise ValueError("causal: must be False on the sparse path (the indices carry causality), got True")
    if not is_fp8_kvcache:
        raise ValueError("is_fp8_kvcache: must be True on the sparse path, which reads paged fp8 caches only "
                         "(as FlashMLA's); dense rows: engine.h20_ops.sparse_mla_decode")
    if isinstance(head_dim_v, bool) or head_dim_v != D_V:
        raise ValueError(f"head_dim_v: expected {D_V}, got {head_dim_v!r}")
    _require_ndim("q", q, 4)
    _require_ndim("indices", indices, 3)
    k_cache = _fp8_bytes("k_cache", k_cache)
    if extra_k_cache is not None:
        extra_k_cache = _fp8_bytes("extra_k_cache", extra_k_cache)
        if extra_indices_in_kvcache is None:
            raise ValueError("extra_indices_in_kvcache: required with extra_k_cache")
        _require_ndim("extra_indices_in_kvcache", extra_indices_in_kvcache, 3)
        if extra_k_cache.size(3) != k_cache.size(3):
            raise ValueError(f"extra_k_cache: expected k_cache's layout ({k_cache.size(3)} bytes per token), got "
                             f"shape {tuple(extra_k_cache.shape)}")
    elif extra_indices_in_kvcache is not None:
        raise ValueError("extra_indices_in_kvcache: given without extra_k_cache")
    if softmax_scale is None:
        softmax_scale = q.size(3) ** -0.5
    shapes = DecodeShapes(*q.shape, q.dtype, q.device, k_cache.size(3), k_cache.size(1), indices.size(2),
                          None if extra_k_cache is None else extra_k_cache.size(1),
                          None if extra_k_cache is None else extra_indices_in_kvcache.size(2))
    plan = meta.plan
    if plan is None:
        plan = _plan(q, k_cache, indices, extra_k_cache, extra_indices_in_kvcache)
    elif shapes != meta.config:
        differ = ", ".join(f"{f} {getattr(meta.config, f)} -> {getattr(shapes, f)}"
                           for f in DecodeShapes.__dataclass_fields__ if getattr(meta.config, f) != getattr(shapes, f))
        raise ValueError(f"tile_scheduler_metadata: its plan was made for other shapes ({differ}); use one "
                         f"get_mla_metadata() object per layer type and set of shapes")
    result = sparse_mla_decode(q, k_cache, indices, softmax_scale, plan=plan, attn_sink=attn_sink,
                               topk_length=topk_length, extra_cache=extra_k_cache,
                               extra_indices=extra_indices_in_kvcache, extra_topk_length=extra_topk_length, out=out,
                               names=DECODE_ARG_NAMES)
    if meta.plan is None:  # kept once a call with it has passed validation
        meta.plan, meta.config = plan, shapes
    return result.out, result.lse_log2.mul_(LN2).transpose(1, 2)  # the lse tensor is this call's own


def _plan(q, k_cache, indices, extra_k_cache, extra_indices) -> DecodePlan:
    """The plan of a metadata object's first call, q's heads and its caches validated first (errors in
    FlashMLA's names)."""
    backend = require_heads("q", q.size(2), None)
    require_tensor("q", q, dtypes=dispatch.Q_DTYPES[backend], ndim=4, dtype_note=dispatch.Q_DTYPE_NOTES.get(backend))
    check_decode_cache("k_cache", k_cache, q, LAYOUTS)
    extra_topk = 0
    if extra_k_cache is not None:
        check_decode_cache("extra_k_cache", extra_k_cache, q, LAYOUTS)
        extra_topk = extra_indices.size(2)
    return plan_sparse_decode(k_cache, batch=q.size(0), s_q=q.size(1), h_q=q.size(2), topk=indices.size(2),
                              q_dtype=q.dtype, extra_cache=extra_k_cache, extra_topk=extra_topk)


def _require_ndim(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")


def _fp8_bytes(name: str, cache) -> torch.Tensor:
    """A paged fp8 cache as the decode entry point takes it (int8 bytes viewed as uint8)."""
    _require_ndim(name, cache, 4)
    if cache.dtype not in FP8_CACHE_DTYPES:
        raise TypeError(f"{name}: expected a paged fp8 cache (dtype uint8, int8 or float8_e4m3fn: the bytes of "
                        f"MODEL1 584 B / V3.2 656 B tokens), got {cache.dtype}")
    if cache.size(3) not in (layout.bytes_per_token for layout in LAYOUTS):
        sizes = " or ".join(f"{layout.bytes_per_token} ({layout.name})" for layout in LAYOUTS)
        raise ValueError(f"{name}: expected shape [num_blocks, page_block_size, 1, bytes per token: {sizes}], "
                         f"got {tuple(cache.shape)}")
    return cache.view(torch.uint8) if cache.dtype == torch.int8 else cache
