"""fused_sample in Triton: greedy, temperature/top-k/top-p sampling and chain speculative rejection
sampling, one launch per batch each, one program per request row.

Contract: engine.h20_ops.sampling.dispatch (which validates arguments); semantics and the random stream
in docs/sampling.md; oracle: engine.h20_ops.sampling.reference (must agree token for token).
Numerics: logits (fp32 or bf16) are read as fp32; weights are int64 fixed point (2^32 = the row
maximum) so every mass is an exact integer sum; acceptance and residual probabilities use fp64
products and IEEE divisions only, written so that no multiply-add can be contracted; the same
operations in the same order as the TileLang kernels (fused_sample_sm90) give the same tokens.
Random draws: tl.philox(seed, draw // 4, 0, position lo, position hi), lane draw % 4; equal to
cuRAND's curand_init(seed, position, draw) + curand() (what TileLang's T.rng_* wrap).
Cost: no sort. The weight is a non-decreasing function of the logit (exp2 is monotone: checked for
ex2.approx on SM90 and numpy's exp2, docs/lab/sampling.md), so the top-k threshold is searched over the
row's logit values, bisecting their ordered fp32 bit patterns (16 bits when every logit is a bf16
value, else 32) with compare-only passes (no exp2), and so is the top-p threshold (a weight pass
per step) when the keys to search span at most 2^30 (always with bf16 values). One
pass over the row then checks that the weight of the logit found brackets the threshold exactly
(count or mass at t and at t + 1); where it does not, a bisection over the integer weight range
(33 steps at most) finds it from the side that failed: tokens never depend on monotonicity. A pass
keeps per-lane sums and reduces them once (a reduction per block tripled its time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..platform import triton_interprets
from . import reference

# Under the CPU interpreter every block op is numpy work: a small block keeps tests fast and still
# exercises the multi-block loops.
BLOCK_V = 64 if triton_interprets() else 1024
NUM_WARPS = 16  # one program per row; its passes run 1.4x faster than with 8 warps (docs/lab/sampling.md)
WEIGHT_END = tl.constexpr(4294967297)  # 2^32 + 1: one past the largest weight
# top-p searches logit keys when they span at most 2^30 (always so with bf16 values): <= 30 mass passes
# and a bracket pass against the weight range's 33 and a final mass pass; a wider span (32-bit keys from
# -inf, or across 0) was measured no faster than bisecting the weights (docs/lab/sampling.md)
KEY_SPAN_SEARCHED = tl.constexpr(1 << 30)
DRAW_SAMPLE = tl.constexpr(reference.DRAW_SAMPLE)
DRAW_ACCEPT = tl.constexpr(reference.DRAW_ACCEPT)


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
def _row_max_and_grain(row, V, BLOCK: tl.constexpr):
    """The row maximum and the key grain: 16 if every logit is a bf16 value (its fp32 bits end in 16
    zeros), else 0."""
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    low = tl.zeros([BLOCK], tl.int32)
    start = 0
    while start < V:
        x = _load(row, start + offs, V)
        m = tl.maximum(m, x)
        low = low | (x.to(tl.int32, bitcast=True) & 0xFFFF)
        start += BLOCK
    return tl.max(m, 0), tl.where(tl.max(low, 0) == 0, 16, 0).to(tl.int64)


@triton.jit
def _key(x, grain):
    """Ordered key of fp32 scalar x: keys compare as the values do (-0 just below +0); >> grain."""
    b = x.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(b >= 0, b + 2147483648, 2147483647 - (b & 0x7FFFFFFF)) >> grain


@triton.jit
def _key_value(k, grain):
    """The fp32 value of key k (inverse of _key for values whose low `grain` bits are 0)."""
    half = tl.full((), 1, tl.int64) << (31 - grain)  # keys >= half are the non-negative values
    bits = tl.where(k >= half, (k - half) << grain, ((half - 1 - k) << grain) | 2147483648)
    return bits.to(tl.int32).to(tl.float32, bitcast=True)


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
def _count_logits_at_least(row, V, c, BLOCK: tl.constexpr):
    # c > -inf: the -inf padding past V is never counted
    offs = tl.arange(0, BLOCK)
    n = tl.zeros([BLOCK], tl.int32)
    start = 0
    while start < V:
        n += (_load(row, start + offs, V) >= c).to(tl.int32)
        start += BLOCK
    return tl.sum(n, 0)


@triton.jit
def _bracket_sums(row, V, row_max, scale, t, BLOCK: tl.constexpr):
    """count(w >= t), count(w >= t + 1), mass(w >= t), mass(w >= t + 1) over the row's V entries."""
    offs = tl.arange(0, BLOCK)
    n0 = tl.zeros([BLOCK], tl.int32)
    n1 = tl.zeros([BLOCK], tl.int32)
    s0 = tl.zeros([BLOCK], tl.int64)
    s1 = tl.zeros([BLOCK], tl.int64)
    start = 0
    while start < V:
        w = _weight(_load(row, start + offs, V), row_max, scale)
        at_t = (w >= t) & (start + offs < V)
        above = w > t
        n0 += at_t.to(tl.int32)
        n1 += above.to(tl.int32)
        s0 += tl.where(at_t, w, 0)
        s1 += tl.where(above, w, 0)
        start += BLOCK
    return tl.sum(n0, 0), tl.sum(n1, 0), tl.sum(s0, 0), tl.sum(s1, 0)


@triton.jit
def _kept_threshold(row, V, row_max, grain, scale, top_k, top_p, BLOCK: tl.constexpr):
    """(t, kept mass): tokens with weight >= t survive top-k then top-p."""
    lo = tl.full((), 0, tl.int64)
    key_lo = _key(tl.full((), float("-inf"), tl.float32), grain)  # every logit is >= -inf
    key_end = _key(row_max, grain) + 1  # no logit is >= this key's value
    if (top_k > 0) & (top_k < V):
        # the k-th largest logit (count(x >= c) >= k): compare-only passes
        key_hi = key_end
        while key_hi - key_lo > 1:
            mid = key_lo + (key_hi - key_lo) // 2
            if _count_logits_at_least(row, V, _key_value(mid, grain), BLOCK) >= top_k:
                key_lo = mid
            else:
                key_hi = mid
        # t_k = the largest t with count(w >= t) >= k: its weight, if the bracket [t, t + 1) holds
        t = _weight(_key_value(key_lo, grain), row_max, scale)
        n_t, n_above, mass, _ = _bracket_sums(row, V, row_max, scale, t, BLOCK)
        hi = tl.full((), WEIGHT_END, tl.int64)
        if n_t >= top_k:
            lo = t
        if n_above < top_k:
            hi = t + 1
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            n_mid, _, _, _ = _bracket_sums(row, V, row_max, scale, mid, BLOCK)
            if n_mid >= top_k:
                lo = mid
            else:
                hi = mid
        if lo != t:
            mass = _mass_at_least(row, V, row_max, scale, lo, BLOCK)
    else:
        mass = _mass_at_least(row, V, row_max, scale, lo, BLOCK)
    if (top_p < 1.0) & (mass > 0):  # (mass 0: no finite logit, token -1 whatever t is)
        # t* = the largest t >= t_k with mass(w >= t) >= p * (top-k mass)
        need = top_p.to(tl.float64) * mass.to(tl.float64)
        t_k = lo
        hi = tl.full((), WEIGHT_END, tl.int64)
        t = tl.full((), -1, tl.int64)  # no candidate: bisect the whole weight range
        mass_t = mass
        if key_end - key_lo <= KEY_SPAN_SEARCHED:
            # over the logits from the k-th largest one up: mass(w >= max(w(c), t_k)) >= need
            key_hi = key_end
            while key_hi - key_lo > 1:
                mid = key_lo + (key_hi - key_lo) // 2
                t_mid = tl.maximum(_weight(_key_value(mid, grain), row_max, scale), t_k)
                if _mass_at_least(row, V, row_max, scale, t_mid, BLOCK).to(tl.float64) >= need:
                    key_lo = mid
                else:
                    key_hi = mid
            t = tl.maximum(_weight(_key_value(key_lo, grain), row_max, scale), t_k)
            _, _, mass_t, mass_above = _bracket_sums(row, V, row_max, scale, t, BLOCK)
            if mass_t.to(tl.float64) >= need:
                lo = t
            if mass_above.to(tl.float64) < need:
                hi = t + 1
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            if _mass_at_least(row, V, row_max, scale, mid, BLOCK).to(tl.float64) >= need:
                lo = mid
            else:
                hi = mid
        if lo == t:
            mass = mass_t
        else:
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
        row_max, grain = _row_max_and_grain(row, V, BLOCK)
        t, mass = _kept_threshold(row, V, row_max, grain, scale, top_k, top_p, BLOCK)
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
    j = tl.full((), 0, tl.int64)  # 64-bit: j * stride passes 2^31 for logits laid out [K+1, N, V]
    while (j < K) & (accepted < 0):
        t_row = target_logits + b * t_stride_b + j * t_stride_s
        x = tl.load(draft_tokens + b * dt_stride_b + j).to(tl.int64)
        if scale > 0:
            d_row = draft_logits + b * d_stride_b + j * d_stride_s
            t_max, t_grain = _row_max_and_grain(t_row, V, BLOCK)
            t_t, t_mass = _kept_threshold(t_row, V, t_max, t_grain, scale, top_k, top_p, BLOCK)
            d_max, d_grain = _row_max_and_grain(d_row, V, BLOCK)
            d_t, d_mass = _kept_threshold(d_row, V, d_max, d_grain, scale, top_k, top_p, BLOCK)
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
        bonus_row = target_logits + b * t_stride_b + (tl.full((), 0, tl.int64) + K) * t_stride_s
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

