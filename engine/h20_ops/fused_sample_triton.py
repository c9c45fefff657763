"""fused_sample in Triton: greedy, temperature/top-k/top-p sampling and chain speculative rejection
sampling, one launch per batch each, one program per request row.

Contract: engine.h20_ops.fused_sample (which validates arguments); semantics and the random stream
in docs/sampling.md; oracle: engine.h20_ops.fused_sample_ref (must agree token for token).
Numerics: logits (fp32 or bf16) are read as fp32; weights are int64 fixed point (2^32 = the row
maximum) so every mass is an exact integer sum; acceptance and residual probabilities use fp64
products and IEEE divisions only, written so that no multiply-add can be contracted; the same
operations in the same order as the TileLang kernels (fused_sample_sm90) give the same tokens.
Random draws: tl.philox(seed, draw // 4, 0, position lo, position hi), lane draw % 4; equal to
cuRAND's curand_init(seed, position, draw) + curand() (what TileLang's T.rng_* wrap).
Cost: top-k and top-p thresholds are found by bisection over the integer weight range (up to 33
passes over the row each) instead of a sort: simple and order-independent, not fast for large V.
A pass keeps per-lane sums and reduces them once (a reduction per block tripled its time).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.h20_ops import fused_sample_ref

# Under the CPU interpreter every block op is numpy work: a small block keeps tests fast and still
# exercises the multi-block loops.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_V = 64 if _INTERPRETED else 1024
NUM_WARPS = 16  # one program per row; its passes run 1.4x faster than with 8 warps (docs/sampling.md)
WEIGHT_END = tl.constexpr(4294967297)  # 2^32 + 1: one past the largest weight
DRAW_SAMPLE = tl.constexpr(fused_sample_ref.DRAW_SAMPLE)
DRAW_ACCEPT = tl.constexpr(fused_sample_ref.DRAW_ACCEPT)


@triton.jit
def _draw(seed, position, DRAW: tl.constexpr):
    position = position.to(tl.int64)
    zero = tl.full((), 0, tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, zero + DRAW // 4, zero, (position & 0xFFFFFFFF).to(tl.uint32),
                               (position >> 32).to(tl.uint32))
    if DRAW % 4 == 0:
        r = r0
    elif DRAW % 4 == 1:
        r = r1
    elif DRAW % 4 == 2:
        r = r2
    else:
        r = r3
    return r.to(tl.uint32, bitcast=True)


@triton.jit
def _weight(x, row_max, scale):
    # (x - max) * scale then exp2: a subtraction and a product, nothing to contract into an fma.
    e = tl.exp2((x - row_max) * scale)
    w = (e * 4294967296.0).to(tl.int64)
    return tl.where(x == float("-inf"), 0, w)


@triton.jit
def _load(row, offs, V):
    return tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)


@triton.jit
def _row_max(row, V, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = _load(row, offs, V)
    start = BLOCK
    while start < V:
        m = tl.maximum(m, _load(row, start + offs, V))
        start += BLOCK
    return tl.max(m, 0)


@triton.jit
def _row_argmax(row, V, BLOCK: tl.constexpr):
    """First index of the row maximum (index 0 for an all -inf row)."""
    offs = tl.arange(0, BLOCK)
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int64)
    start = 0
    while start < V:
        x = _load(row, start + offs, V)
        bm = tl.max(x, 0)
        bi = tl.min(tl.where(x == bm, start + offs, V), 0).to(tl.int64)
        best_idx = tl.where(bm > best_val, bi, best_idx)
        best_val = tl.maximum(best_val, bm)
        start += BLOCK
    return best_idx


@triton.jit
def _count_at_least(row, V, row_max, scale, t, BLOCK: tl.constexpr):
    # Per-lane sums across blocks, one block reduction per pass (exact int64 sums: any order).
    offs = tl.arange(0, BLOCK)
    n = tl.zeros([BLOCK], tl.int64)
    start = 0
    while start < V:
        w = _weight(_load(row, start + offs, V), row_max, scale)
        n += (w >= t).to(tl.int64)
        start += BLOCK
    return tl.sum(n, 0)


@triton.jit
def _mass_at_least(row, V, row_max, scale, t, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    s = tl.zeros([BLOCK], tl.int64)
    start = 0
    while start < V:
        w = _weight(_load(row, start + offs, V), row_max, scale)
        s += tl.where(w >= t, w, 0)
        start += BLOCK
    return tl.sum(s, 0)


@triton.jit
def _kept_threshold(row, V, row_max, scale, top_k, top_p, BLOCK: tl.constexpr):
    """(t, kept mass): tokens with weight >= t survive top-k then top-p."""
    lo = tl.full((), 0, tl.int64)
    if (top_k > 0) & (top_k < V):  # largest t with count(w >= t) >= k: the k-th largest weight
        hi = tl.full((), WEIGHT_END, tl.int64)
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            if _count_at_least(row, V, row_max, scale, mid, BLOCK) >= top_k:
                lo = mid
            else:
                hi = mid
    mass = _mass_at_least(row, V, row_max, scale, lo, BLOCK)
    if top_p < 1.0:  # largest t with mass(w >= t) >= p * (top-k mass)
        need = top_p.to(tl.float64) * mass.to(tl.float64)
        hi = tl.full((), WEIGHT_END, tl.int64)
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            if _mass_at_least(row, V, row_max, scale, mid, BLOCK).to(tl.float64) >= need:
                lo = mid
            else:
                hi = mid
        mass = _mass_at_least(row, V, row_max, scale, lo, BLOCK)
    return lo, mass


@triton.jit
def _target(r, mass):
    """floor(r / 2^32 * mass), clamped below mass (fp64, exact r / 2^32)."""
    u = r.to(tl.float64) * (1.0 / 4294967296.0)
    t = tl.floor(u * mass.to(tl.float64)).to(tl.int64)
    return tl.minimum(t, mass - 1)


@triton.jit
def _pick_kept(row, V, row_max, scale, t, mass, r, BLOCK: tl.constexpr):
    """First index whose inclusive prefix of kept weights exceeds _target(r, mass); -1 if mass == 0."""
    offs = tl.arange(0, BLOCK)
    target = _target(r, mass)
    running = tl.full((), 0, tl.int64)
    token = tl.full((), V, tl.int64)
    start = 0
    while start < V:
        w = _weight(_load(row, start + offs, V), row_max, scale)
        w = tl.where(w >= t, w, 0)
        hit = (tl.cumsum(w, 0) + running) > target
        token = tl.minimum(token, tl.min(tl.where(hit, start + offs, V), 0).to(tl.int64))
        running += tl.sum(w, 0)
        start += BLOCK
    return tl.where(mass > 0, token, -1)


@triton.jit
def _sample_row(row, V, scale, top_k, top_p, r, BLOCK: tl.constexpr):
    if scale > 0:
        row_max = _row_max(row, V, BLOCK)
        t, mass = _kept_threshold(row, V, row_max, scale, top_k, top_p, BLOCK)
        token = _pick_kept(row, V, row_max, scale, t, mass, r, BLOCK)
    else:
        token = _row_argmax(row, V, BLOCK)
    return token


@triton.jit
def _greedy_kernel(logits, stride_row, out, V, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    tl.store(out + b, _row_argmax(logits + b * stride_row, V, BLOCK))


@triton.jit
def _sample_kernel(logits, stride_row, seeds, positions, scales, top_ks, top_ps, out, V,
                   DRAW: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    r = _draw(tl.load(seeds + b), tl.load(positions + b), DRAW)
    token = _sample_row(logits + b * stride_row, V, tl.load(scales + b), tl.load(top_ks + b),
                        tl.load(top_ps + b), r, BLOCK)
    tl.store(out + b, token)


@triton.jit
def _kept_weight_at(row, x, V, row_max, scale, t):
    """Kept weight of token x (0 if x is not a valid token id), bit-identical to the block passes."""
    valid = (x >= 0) & (x < V)
    w = _weight(tl.load(row + tl.where(valid, x, 0)).to(tl.float32), row_max, scale)
    return tl.where(valid & (w >= t), w, 0)


@triton.jit
def _prob(w, mass):
    return tl.where(mass > 0, w.to(tl.float64) / tl.where(mass > 0, mass, 1).to(tl.float64), 0.0)


@triton.jit
def _pick_residual(t_row, d_row, V, t_max, t_t, t_mass, d_max, d_t, d_mass, scale, r, BLOCK: tl.constexpr):
    """Sample normalize(max(p_t - p_d, 0)) (fixed point 2^-32); p_t itself if that has no mass."""
    offs = tl.arange(0, BLOCK)
    res_lanes = tl.zeros([BLOCK], tl.int64)
    start = 0
    while start < V:
        wt = _weight(_load(t_row, start + offs, V), t_max, scale)
        wd = _weight(_load(d_row, start + offs, V), d_max, scale)
        res = _prob(tl.where(wt >= t_t, wt, 0), t_mass) - _prob(tl.where(wd >= d_t, wd, 0), d_mass)
        res_lanes += tl.floor(tl.maximum(res, 0.0) * 4294967296.0).to(tl.int64)
        start += BLOCK
    res_mass = tl.sum(res_lanes, 0)
    if res_mass > 0:
        target = _target(r, res_mass)
        running = tl.full((), 0, tl.int64)
        token = tl.full((), V, tl.int64)
        start = 0
        while start < V:
            wt = _weight(_load(t_row, start + offs, V), t_max, scale)
            wd = _weight(_load(d_row, start + offs, V), d_max, scale)
            res = _prob(tl.where(wt >= t_t, wt, 0), t_mass) - _prob(tl.where(wd >= d_t, wd, 0), d_mass)
            q = tl.floor(tl.maximum(res, 0.0) * 4294967296.0).to(tl.int64)
            hit = (tl.cumsum(q, 0) + running) > target
            token = tl.minimum(token, tl.min(tl.where(hit, start + offs, V), 0).to(tl.int64))
            running += tl.sum(q, 0)
            start += BLOCK
    else:
        token = _pick_kept(t_row, V, t_max, scale, t_t, t_mass, r, BLOCK)
    return token


@triton.jit
def _rejection_kernel(target_logits, t_stride_b, t_stride_s, draft_logits, d_stride_b, d_stride_s,
                      draft_tokens, dt_stride_b, seeds, positions, scales, top_ks, top_ps, out_tokens,
                      out_accepted, V, K, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds + b)
    pos = tl.load(positions + b)
    scale = tl.load(scales + b)
    top_k = tl.load(top_ks + b)
    top_p = tl.load(top_ps + b)
    out_row = out_tokens + b * (K + 1)
    accepted = tl.full((), -1, tl.int64)  # -1: still accepting
    j = 0
    while (j < K) & (accepted < 0):
        t_row = target_logits + b * t_stride_b + j * t_stride_s
        x = tl.load(draft_tokens + b * dt_stride_b + j).to(tl.int64)
        if scale > 0:
            d_row = draft_logits + b * d_stride_b + j * d_stride_s
            t_max = _row_max(t_row, V, BLOCK)
            t_t, t_mass = _kept_threshold(t_row, V, t_max, scale, top_k, top_p, BLOCK)
            d_max = _row_max(d_row, V, BLOCK)
            d_t, d_mass = _kept_threshold(d_row, V, d_max, scale, top_k, top_p, BLOCK)
            wt_x = _kept_weight_at(t_row, x, V, t_max, scale, t_t)
            wd_x = _kept_weight_at(d_row, x, V, d_max, scale, d_t)
            # accept iff u < p_t(x) / p_d(x), u = r / 2^32, cross-multiplied: products only.
            r_acc = _draw(seed, pos + j, DRAW_ACCEPT)
            lhs = r_acc.to(tl.float64) * wd_x.to(tl.float64) * t_mass.to(tl.float64)
            rhs = wt_x.to(tl.float64) * d_mass.to(tl.float64) * 4294967296.0
            if lhs < rhs:
                tl.store(out_row + j, x)
            else:
                fix = _pick_residual(t_row, d_row, V, t_max, t_t, t_mass, d_max, d_t, d_mass, scale,
                                     _draw(seed, pos + j, DRAW_SAMPLE), BLOCK)
                tl.store(out_row + j, fix)
                accepted = tl.full((), 0, tl.int64) + j
        else:
            best = _row_argmax(t_row, V, BLOCK)
            tl.store(out_row + j, best)
            if best != x:
                accepted = tl.full((), 0, tl.int64) + j
        j += 1
    if accepted < 0:
        bonus_row = target_logits + b * t_stride_b + K * t_stride_s
        bonus = _sample_row(bonus_row, V, scale, top_k, top_p, _draw(seed, pos + K, DRAW_SAMPLE), BLOCK)
        tl.store(out_row + K, bonus)
        accepted = tl.full((), 0, tl.int64) + K
    tl.store(out_accepted + b, accepted)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    n, v = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    _greedy_kernel[(n,)](logits, logits.stride(0), out, v, BLOCK=BLOCK_V, num_warps=NUM_WARPS)
    return out


def sample(logits, seeds, positions, scales, top_k, top_p, draw: int) -> torch.Tensor:
    n, v = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    _sample_kernel[(n,)](logits, logits.stride(0), seeds, positions, scales, top_k, top_p, out, v,
                         DRAW=draw, BLOCK=BLOCK_V, num_warps=NUM_WARPS)
    return out


def rejection_sample(target_logits, draft_logits, draft_tokens, seeds, positions, scales, top_k, top_p):
    n, k1, v = target_logits.shape
    tokens = torch.full((n, k1), -1, dtype=torch.int64, device=target_logits.device)
    accepted = torch.empty(n, dtype=torch.int64, device=target_logits.device)
    _rejection_kernel[(n,)](target_logits, target_logits.stride(0), target_logits.stride(1), draft_logits,
                            draft_logits.stride(0), draft_logits.stride(1), draft_tokens, draft_tokens.stride(0),
                            seeds, positions, scales, top_k, top_p, tokens, accepted, v, k1 - 1,
                            BLOCK=BLOCK_V, num_warps=NUM_WARPS)
    return tokens, accepted


@triton.jit
def _words_kernel(seeds, positions, out):
    b = tl.program_id(0)
    seed = tl.load(seeds + b)
    pos = tl.load(positions + b)
    tl.store(out + b * 4 + 0, _draw(seed, pos, 0).to(tl.int64))
    tl.store(out + b * 4 + 1, _draw(seed, pos, 1).to(tl.int64))
    tl.store(out + b * 4 + 2, _draw(seed, pos, 2).to(tl.int64))
    tl.store(out + b * 4 + 3, _draw(seed, pos, 3).to(tl.int64))


def philox_words(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Draws 0..3 of each request as int64 [N, 4]: the raw stream, to check it against the
    reference and against TileLang's cuRAND bit for bit."""
    out = torch.full((seeds.size(0), 4), -1, dtype=torch.int64, device=seeds.device)
    _words_kernel[(seeds.size(0),)](seeds, positions, out)
    return out

