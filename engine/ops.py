"""Non-attention ops of the engine, each with a Triton and a plain-torch (`ref`) implementation.

DEEPINFER_KERNELS (engine.config.kernels()) picks the implementation per call. The project's one
fallback policy (README "Configuration"): an op falls back only when its chosen implementation is
MISSING -- triton not importable, or a tensor Triton cannot reach (a CPU tensor without
TRITON_INTERPRET=1) -- never because running it failed (a compile or launch error, an OOM propagates).
A fallback raises OpUnavailableError under DEEPINFER_OPS_STRICT=1; otherwise the ref implementation
runs and the fallback is counted per op (fallback_counts()) and logged once per op and reason.

Ops (each also named in fallback_counts()):
  rms_norm(x, weight=None, eps) over the last dim. Numerics as DeepSeek-V4 in transformers: fp32
    statistics; weighted: (weight * x_normed) in fp32, cast once; weightless: the factor
    rsqrt(mean(x^2) + eps) is rounded to x's dtype, then multiplied (transformers' unweighted norm).
  rope(x, cos, sin, inverse=False): DeepSeek-V4's interleaved RoPE on the TRAILING 2 * cos.shape[-1]
    dims of each row (pairs (2i, 2i+1) rotated by angle i), leading (NoPE) dims copied; fp32 math,
    result in x's dtype. inverse=True rotates by the negated angle (transformers passes -sin), which
    undoes the rotation carried by V = K on the attention output.
  kv_quantize / kv_gather_dequant: the fp8 KV cache's write and read, from engine.h20_ops.kv_cache.fp8
    (Triton kernels, ref = its torch reference; byte-identical by that module's contract, which
    requires finite inputs: an inf / NaN row is written differently by the two and not checked).
  hyper_connection(hidden, mixes, scale, base, hc_eps, sinkhorn_iters) -> (post, comb, collapsed):
    DeepSeek-V4's hyper-connection after its norm and projection (mixes = F.linear(rms_norm(streams), fn)):
    the pre / post / comb weights, comb's Sinkhorn iterations and the collapse of the n streams by pre.
    ref = transformers' DeepseekV4HyperConnection code (bit for bit); Triton: one launch, fp32 throughout,
    collapsed rounded once to hidden's dtype (equal to ref up to fp32 summation order and that rounding).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

import torch

from . import config
# importing h20_ops sets TRITON_INTERPRET=1 without CUDA
from .h20_ops.platform import require_interpretable_numpy, sm_count, triton_interprets

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError as _exc:  # the ref implementations still work; triton calls count as unavailable
    triton = None
    _TRITON_IMPORT_ERROR = f"triton not importable ({_exc})"
else:
    _TRITON_IMPORT_ERROR = None


class OpUnavailableError(RuntimeError):
    """DEEPINFER_OPS_STRICT=1 and the chosen implementation of an op cannot run."""


_lock = threading.Lock()
_fallbacks: Counter[str] = Counter()
_logged: set[tuple[str, str]] = set()


def fallback_counts() -> dict[str, int]:
    """op name -> number of calls served by ref because the chosen Triton implementation could not run."""
    with _lock:
        return dict(_fallbacks)


def reset_fallback_counts() -> None:
    with _lock:
        _fallbacks.clear()
        _logged.clear()


def _elements_per_program() -> int:
    # The interpreter pays a fixed cost per program, so it gets few large programs; GPUs get
    # register-sized tiles.
    return 1 << 16 if triton_interprets() else 1 << 12


def _triton_unavailable_reason(*tensors: torch.Tensor) -> str | None:
    if _TRITON_IMPORT_ERROR is not None:
        return _TRITON_IMPORT_ERROR
    if not triton_interprets() and not all(t.is_cuda for t in tensors):
        return "tensors are not on a CUDA device and Triton's interpreter is off (TRITON_INTERPRET)"
    return None


def _dispatch(op: str, triton_impl, ref_impl, tensors: tuple[torch.Tensor, ...], *args):
    if config.kernels() == "ref":
        return ref_impl(*args)
    reason = _triton_unavailable_reason(*tensors)
    if reason is None:
        return triton_impl(*args)  # an error from running it is an error, never a fallback
    if config.ops_strict():
        raise OpUnavailableError(f"{op}: the triton implementation cannot run ({reason}) and DEEPINFER_OPS_STRICT=1")
    with _lock:
        _fallbacks[op] += 1
        first = (op, reason) not in _logged
        _logged.add((op, reason))
    if first:
        log.warning("%s: falling back to the torch reference (%s)", op, reason)
    return ref_impl(*args)


def _require_float_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")


# ----------------------------------------------------------------------------------------------
# rms_norm

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of x ([..., n]); weight [n] or None (weightless); same shape/dtype as x."""
    _require_float_tensor("x", x)
    if x.dim() < 1 or x.size(-1) == 0:
        raise ValueError(f"x: expected a non-empty last dim, got shape {tuple(x.shape)}")
    if weight is not None:
        _require_float_tensor("weight", weight)
        if weight.shape != (x.size(-1),):
            raise ValueError(f"weight: expected shape [{x.size(-1)}] (x's last dim), got {tuple(weight.shape)}")
        if weight.device != x.device:
            raise ValueError(f"weight: expected device {x.device} (same as x), got {weight.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps: expected a positive float, got {eps!r}")
    tensors = (x,) if weight is None else (x, weight)
    return _dispatch("rms_norm", _rms_norm_triton, _rms_norm_ref, tensors, x, weight, float(eps))


def _rms_norm_ref(x, weight, eps):
    if weight is None:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, stride_x, stride_out, eps, n_cols: tl.constexpr,
                         HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # 64-bit rows: row * stride passes 2^31 at 64 heads x 512 from 65536 tokens on
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < n_rows
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols[None, :] < n_cols)
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sum_sq += tl.sum(x * x, axis=1)
        inv_rms = 1.0 / tl.sqrt(sum_sq / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols[None, :] < n_cols)
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
                y = (x * inv_rms[:, None]) * w[None, :]
            else:  # the reference rounds the factor to x's dtype before multiplying
                y = x * inv_rms.to(out_ptr.dtype.element_ty).to(tl.float32)[:, None]
            tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm_triton(x, weight, eps):
    n_cols = x.size(-1)
    rows = x.reshape(-1, n_cols)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.size(0), n_cols), dtype=x.dtype, device=x.device)
    if rows.size(0) == 0:
        return out.view(x.shape)
    block_n = min(triton.next_power_of_2(n_cols), 1024)
    block_m = max(1, _elements_per_program() // block_n)
    # the kernel reads the weight densely; never read when HAS_WEIGHT is False
    weight_arg = weight.contiguous() if weight is not None else rows
    grid = (triton.cdiv(rows.size(0), block_m),)
    _rms_norm_kernel[grid](rows, weight_arg, out, rows.size(0), rows.stride(0), out.stride(0), eps, n_cols=n_cols,
                           HAS_WEIGHT=weight is not None, BLOCK_M=block_m, BLOCK_N=block_n)
    return out.view(x.shape)


# ----------------------------------------------------------------------------------------------
# rope

def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE on the trailing 2 * cos.shape[-1] dims. x [T, D] or [T, H, D]; cos, sin
    [T, R/2] (one angle per rotated pair, per token). Returns a new tensor shaped and typed as x."""
    _require_float_tensor("x", x)
    _require_float_tensor("cos", cos)
    _require_float_tensor("sin", sin)
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected [T, D] or [T, H, D], got shape {tuple(x.shape)}")
    if cos.dim() != 2 or cos.size(0) != x.size(0):
        raise ValueError(f"cos: expected shape [{x.size(0)}, R/2] (one row per token of x), got {tuple(cos.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin: expected shape {tuple(cos.shape)} (cos's), got {tuple(sin.shape)}")
    if not 0 < 2 * cos.size(1) <= x.size(-1):
        raise ValueError(f"cos: rotated dims 2 * {cos.size(1)} must be in (0, {x.size(-1)}] (x's last dim)")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.device != x.device:
            raise ValueError(f"{name}: expected device {x.device} (same as x), got {t.device}")
    if not isinstance(inverse, bool):
        raise TypeError(f"inverse: expected bool, got {type(inverse).__name__}")
    return _dispatch("rope", _rope_triton, _rope_ref, (x, cos, sin), x, cos, sin, inverse)


def _rope_ref(x, cos, sin, inverse):
    if inverse:
        sin = -sin
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    rope_dim = cos.size(-1)
    nope, rotated = x[..., :-rope_dim], x[..., -rope_dim:]
    # rotate_half on interleaved pairs: (x0, x1) -> (-x1, x0)
    turned = torch.stack((-rotated[..., 1::2], rotated[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rotated.float() * cos + turned.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


if triton is not None:

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, heads, half,
                     stride_x, stride_out, stride_cos, stride_sin, nope_dim: tl.constexpr, SIN_SIGN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr):
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # 64-bit offsets, as above
        row_mask = rows < n_rows
        tokens = rows // heads
        x_rows = x_ptr + rows[:, None] * stride_x
        out_rows = out_ptr + rows[:, None] * stride_out
        for start in range(0, nope_dim, BLOCK_NOPE):
            cols = start + tl.arange(0, BLOCK_NOPE)
            mask = row_mask[:, None] & (cols[None, :] < nope_dim)
            tl.store(out_rows + cols[None, :], tl.load(x_rows + cols[None, :], mask=mask), mask=mask)
        pairs = tl.arange(0, BLOCK_HALF)
        mask = row_mask[:, None] & (pairs[None, :] < half)
        c = tl.load(cos_ptr + tokens[:, None] * stride_cos + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + tokens[:, None] * stride_sin + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
        s = s * SIN_SIGN
        even = nope_dim + 2 * pairs[None, :]
        x_even = tl.load(x_rows + even, mask=mask, other=0.0).to(tl.float32)
        x_odd = tl.load(x_rows + even + 1, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_rows + even, (x_even * c - x_odd * s).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_rows + even + 1, (x_odd * c + x_even * s).to(out_ptr.dtype.element_ty), mask=mask)


def _rope_triton(x, cos, sin, inverse):
    heads = x.size(1) if x.dim() == 3 else 1
    dim = x.size(-1)
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = torch.empty((rows.size(0), dim), dtype=x.dtype, device=x.device)
    if rows.size(0) == 0:
        return out.view(x.shape)
    half = cos.size(1)
    nope_dim = dim - 2 * half
    block_nope = min(triton.next_power_of_2(max(nope_dim, 1)), 512)
    block_m = max(1, _elements_per_program() // max(block_nope, 2 * triton.next_power_of_2(half)))
    grid = (triton.cdiv(rows.size(0), block_m),)
    _rope_kernel[grid](rows, cos, sin, out, rows.size(0), heads, half,
                       rows.stride(0), out.stride(0), cos.stride(0), sin.stride(0), nope_dim=nope_dim,
                       SIN_SIGN=-1.0 if inverse else 1.0, BLOCK_M=block_m, BLOCK_NOPE=block_nope,
                       BLOCK_HALF=triton.next_power_of_2(half))
    return out.view(x.shape)


# ----------------------------------------------------------------------------------------------
# fp8 KV cache writes and reads (engine.h20_ops.kv_cache.fp8: Triton kernels and their torch reference)

def kv_quantize(cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Quantize kv [n, 1, d] into the fp8 cache at slots [n] (the fp8 quantizer layouts; -1 slots skipped)."""
    from .h20_ops import kv_cache

    _dispatch("kv_quantize", kv_cache.quantize_into_cache, kv_cache.quantize_into_cache_ref,
              (cache, slots, kv), cache, slots, kv)


def kv_gather_dequant(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Dequantize the rows at slots [B, W] of the fp8 cache into out [B, W, 1, d]; returns out."""
    from .h20_ops import kv_cache

    def ref(cache, slots, out):
        out.copy_(kv_cache.dequantize_from_cache_ref(cache, slots, out.dtype))
        return out

    return _dispatch("kv_gather_dequant", kv_cache.gather_dequant, ref, (cache, slots, out), cache, slots, out)


# ----------------------------------------------------------------------------------------------
# hyper_connection

_HC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def hyper_connection(hidden: torch.Tensor, mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                     hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' DeepseekV4HyperConnection after its norm and projection. hidden [T, n, D] (the n
    streams, any strides); mixes [T, 2n + n*n] float32 (F.linear of the normed, flattened streams with fn); scale [3];
    base [2n + n*n]. Returns (post [T, n] fp32, comb [T, n, n] fp32, collapsed [T, D] in hidden's dtype)."""
    for name, t in (("hidden", hidden), ("mixes", mixes), ("scale", scale), ("base", base)):
        _require_float_tensor(name, t)
        if name == "mixes" and t.dtype != torch.float32:
            raise TypeError(f"mixes: expected float32 (the fp32 projection), got {t.dtype}")
        if t.dtype not in _HC_DTYPES:
            raise TypeError(f"{name}: expected float32, bfloat16 or float16, got {t.dtype}")
    if hidden.dim() != 3 or hidden.size(1) == 0 or hidden.size(2) == 0:
        raise ValueError(f"hidden: expected [T, n, D] with n, D > 0, got shape {tuple(hidden.shape)}")
    tokens, n = hidden.shape[:2]
    width = (2 + n) * n
    if mixes.shape != (tokens, width):
        raise ValueError(f"mixes: expected shape [{tokens}, {width}] (T, 2n + n*n for hidden's n = {n}), "
                         f"got {tuple(mixes.shape)}")
    if scale.shape != (3,):
        raise ValueError(f"scale: expected shape [3] (pre, post, comb), got {tuple(scale.shape)}")
    if base.shape != (width,):
        raise ValueError(f"base: expected shape [{width}] (2n + n*n for hidden's n = {n}), got {tuple(base.shape)}")
    for name, t in (("mixes", mixes), ("scale", scale), ("base", base)):
        if t.device != hidden.device:
            raise ValueError(f"{name}: expected device {hidden.device} (same as hidden), got {t.device}")
    if isinstance(hc_eps, bool) or not isinstance(hc_eps, (int, float)) or not 0 <= hc_eps < float("inf"):
        raise ValueError(f"hc_eps: expected a finite float >= 0, got {hc_eps!r}")
    if isinstance(sinkhorn_iters, bool) or not isinstance(sinkhorn_iters, int) or sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters: expected an int >= 1, got {sinkhorn_iters!r}")
    return _dispatch("hyper_connection", _hyper_connection_triton, _hyper_connection_ref,
                     (hidden, mixes, scale, base), hidden, mixes, scale, base, float(hc_eps), sinkhorn_iters)


def _hyper_connection_ref(hidden, mixes, scale, base, hc_eps, sinkhorn_iters):
    n = hidden.size(1)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_scale, post_scale, comb_scale = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    # view(T, ...), not view(-1, ...): the latter refuses T == 0
    comb = torch.softmax(comb_w.view(comb_w.size(0), n, n) * comb_scale + comb_b.view(n, n), dim=-1) + hc_eps
    # Sinkhorn-Knopp towards a doubly-stochastic mixing matrix (columns first, as the reference).
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * hidden).sum(dim=1).to(hidden.dtype)
    return post, comb, collapsed


if triton is not None:

    # The hyper-connection after its projection, in one launch. Program (r, s) takes BLOCK_T rows (tokens):
    # from each row's mixes it computes pre, post and comb (softmax, then the Sinkhorn loop) in fp32
    # registers, as [BLOCK_T, N_P2] and [BLOCK_T, N_P2, N_P2] tiles masked to the n streams; program s == 0
    # writes post and comb. Then it collapses the streams over its slice of D (`chunks` BLOCK_D-wide
    # chunks from column s * chunks * BLOCK_D).
    # Numerics: fp32 throughout (scale and base read as fp32, as transformers' fp32 mixes promote them),
    # products and sums of the collapse in fp32, collapsed rounded once to hidden's dtype; equal to the
    # ref up to exp / sigmoid / division ulps and the order of the sums.
    # Constraints: mixes fp32 with unit last stride, base contiguous (the wrapper copies otherwise);
    # hidden any strides; n is a constexpr (one compile per n), any value: padded streams hold 0 in pre
    # and comb and never enter a max or a sum (their denominators are 1), so hc_eps may be 0. The D
    # split gives a small decode batch more programs than its row blocks; each split recomputes the
    # (cheap) weights.
    @triton.jit
    def _hyper_connection_kernel(hidden_ptr, mixes_ptr, scale_ptr, base_ptr, post_ptr, comb_ptr, out_ptr,
                                 n_rows, dim, stride_ht, stride_hn, stride_hd, stride_mt, stride_scale,
                                 hc_eps, sinkhorn_iters, chunks, n: tl.constexpr, N_P2: tl.constexpr,
                                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # 64-bit row offsets
        row_mask = rows < n_rows
        writes_weights = tl.program_id(1) == 0
        streams = tl.arange(0, N_P2)
        stream_ok = streams < n
        mask2 = row_mask[:, None] & stream_ok[None, :]
        mix_rows = mixes_ptr + rows[:, None] * stride_mt  # [BLOCK_T, 1]
        pre_scale = tl.load(scale_ptr).to(tl.float32)
        post_scale = tl.load(scale_ptr + stride_scale).to(tl.float32)
        comb_scale = tl.load(scale_ptr + 2 * stride_scale).to(tl.float32)

        pre_w = tl.load(mix_rows + streams[None, :], mask=mask2, other=0.0)
        pre_b = tl.load(base_ptr + streams, mask=stream_ok, other=0.0).to(tl.float32)
        pre = tl.where(mask2, tl.sigmoid(pre_w * pre_scale + pre_b[None, :]) + hc_eps, 0.0)
        post_w = tl.load(mix_rows + n + streams[None, :], mask=mask2, other=0.0)
        post_b = tl.load(base_ptr + n + streams, mask=stream_ok, other=0.0).to(tl.float32)
        post = 2 * tl.sigmoid(post_w * post_scale + post_b[None, :])
        tl.store(post_ptr + rows[:, None] * n + streams[None, :], post, mask=mask2 & writes_weights)

        i = streams[None, :, None]
        j = streams[None, None, :]
        valid = (i < n) & (j < n)  # [1, N_P2, N_P2]
        entry = i * n + j
        comb_mask = row_mask[:, None, None] & valid
        logits = tl.load(mix_rows[:, :, None] + 2 * n + entry, mask=comb_mask, other=0.0) * comb_scale
        logits += tl.load(base_ptr + 2 * n + entry, mask=valid, other=0.0).to(tl.float32)
        # -inf beside a real row's entries (exp gives 0); 0 in padded rows, which are zeroed below
        logits = tl.where(valid, logits, tl.where(i < n, float("-inf"), 0.0))
        e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
        e = tl.where(valid, e, 0.0)
        row_ok = stream_ok[None, :]  # [1, N_P2]: row i (axis 1) or column j (axis 2) is a real stream
        comb = tl.where(valid, e / tl.where(row_ok, tl.sum(e, axis=2), 1.0)[:, :, None] + hc_eps, 0.0)
        comb = comb / tl.where(row_ok, tl.sum(comb, axis=1) + hc_eps, 1.0)[:, None, :]
        for _ in range(1, sinkhorn_iters):
            comb = comb / tl.where(row_ok, tl.sum(comb, axis=2) + hc_eps, 1.0)[:, :, None]
            comb = comb / tl.where(row_ok, tl.sum(comb, axis=1) + hc_eps, 1.0)[:, None, :]
        tl.store(comb_ptr + rows[:, None, None] * (n * n) + entry, comb, mask=comb_mask & writes_weights)

        # 64-bit stream and column offsets too: a strided view's strides can be large
        h_rows = hidden_ptr + rows[:, None, None] * stride_ht + streams.to(tl.int64)[None, :, None] * stride_hn
        first = tl.program_id(1) * chunks * BLOCK_D
        for c in range(0, chunks):
            cols = first + c * BLOCK_D + tl.arange(0, BLOCK_D)
            col_ok = cols < dim
            h = tl.load(h_rows + cols.to(tl.int64)[None, None, :] * stride_hd,
                        mask=mask2[:, :, None] & col_ok[None, None, :], other=0.0).to(tl.float32)
            collapsed = tl.sum(pre[:, :, None] * h, axis=1)
            tl.store(out_ptr + rows[:, None] * dim + cols[None, :], collapsed.to(out_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & col_ok[None, :])


def _hyper_connection_triton(hidden, mixes, scale, base, hc_eps, sinkhorn_iters):
    tokens, n, dim = hidden.shape
    post = torch.empty((tokens, n), dtype=torch.float32, device=hidden.device)
    comb = torch.empty((tokens, n, n), dtype=torch.float32, device=hidden.device)
    collapsed = torch.empty((tokens, dim), dtype=hidden.dtype, device=hidden.device)
    if tokens == 0:
        return post, comb, collapsed
    mixes = mixes if mixes.stride(-1) == 1 else mixes.contiguous()
    base = base if base.stride(0) == 1 else base.contiguous()
    n_p2 = max(2, triton.next_power_of_2(n))
    block_d = min(triton.next_power_of_2(dim), 1024 if triton_interprets() else 256)
    block_t = max(1, min(_elements_per_program() // (n_p2 * block_d), triton.next_power_of_2(tokens)))
    row_blocks = triton.cdiv(tokens, block_t)
    all_chunks = triton.cdiv(dim, block_d)
    # D split: about two programs per SM for a small batch (the interpreter's 1024-wide chunks keep it at
    # one or two there)
    splits = max(1, min(all_chunks, 2 * sm_count(hidden.device) // row_blocks))
    chunks = triton.cdiv(all_chunks, splits)
    grid = (row_blocks, triton.cdiv(all_chunks, chunks))
    if triton_interprets():
        require_interpretable_numpy("_hyper_connection_kernel")  # its loops have runtime bounds
    _hyper_connection_kernel[grid](hidden, mixes, scale, base, post, comb, collapsed, tokens, dim,
                                   hidden.stride(0), hidden.stride(1), hidden.stride(2), mixes.stride(0),
                                   scale.stride(0), hc_eps, sinkhorn_iters, chunks, n=n, N_P2=n_p2,
                                   BLOCK_T=block_t, BLOCK_D=block_d)
    return post, comb, collapsed
