"""The sampling oracle: Philox4x32-10 and the three fused_sample ops in numpy, vectorized over rows.

It consumes the same random stream as the kernels (docs/sampling.md has the mapping) and follows
the same integer-weight arithmetic, so on CPU the Triton kernels (interpreter) must agree with it
token for token. It selects thresholds by sorting where the kernels bisect, so the two agree only
if both implement the documented semantics.

Semantics shared with the kernels (docs/sampling.md):
- weight w_i = trunc(exp2((x_i - max x) * log2(e) / T) * 2^32) as int64 (fp32 math, 0 for x_i = -inf);
  every sum is an exact int64 sum, so any summation order gives the same tokens.
- top-k keeps w_i >= the k-th largest weight (k <= 0 or k >= V: off); top-p then keeps w_i >= t*,
  t* the largest threshold whose kept mass S(t) >= p * S(t_k) (p >= 1: off); ties are kept.
- a uniform u = r / 2^32 (r one uint32 draw) picks the first index whose inclusive prefix mass
  exceeds floor(u * W) (W the kept mass). W = 0 (no finite logit) gives token -1.
- temperature <= 0 means greedy: the first index of the maximum logit.
"""

from __future__ import annotations

import numpy as np
import torch

LOG2E = 1.4426950408889634
TWO_POW_32 = 4294967296.0

# The draws of one (seed, position) Philox block (lane = draw id), see docs/sampling.md.
DRAW_SAMPLE = 0  # the token sampled at this position (plain sampling, residual or bonus token)
DRAW_ACCEPT = 1  # the acceptance test of the draft token proposed for this position
DRAW_DRAFT = 2  # the drafter's own sample for this position

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(seed, c0, c1, c2, c3) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 (Salmon et al. 2011) on arrays: key = (seed low 32, seed high 32), counter
    (c0, c1, c2, c3). Returns the four uint32 output words (cuRAND's output.x .. .w)."""
    seed = np.asarray(seed).astype(np.int64).view(np.uint64)
    k0, k1 = seed & _MASK32, seed >> np.uint64(32)
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _MASK32 for c in (c0, c1, c2, c3))
    c0, c1, c2, c3, k0, k1 = np.broadcast_arrays(c0, c1, c2, c3, k0, k1)
    for _ in range(10):
        p0 = _M0 * c0  # products of two 32-bit values: exact in uint64
        p1 = _M1 * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _MASK32,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _MASK32)
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def draw_u32(seeds, positions, draw: int) -> np.ndarray:
    """The uint32 draw `draw` of each (seed, position): Philox key = seed, counter =
    (draw // 4, 0, position low 32, position high 32), lane draw % 4. Equals cuRAND's first
    curand() after curand_init(seed, subsequence=position, offset=draw)."""
    positions = np.asarray(positions).astype(np.int64).view(np.uint64)
    words = philox4x32_10(seeds, np.uint64(draw // 4), np.uint64(0), positions & _MASK32,
                          positions >> np.uint64(32))
    return words[draw % 4]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def sampling_scale(temperature: torch.Tensor) -> torch.Tensor:
    """log2(e) / T in fp32 (0 where T <= 0, i.e. greedy); computed once by torch for every backend."""
    t = temperature.float()
    return torch.where(t > 0, torch.full_like(t, LOG2E) / torch.where(t > 0, t, 1.0), torch.zeros_like(t))


def weights(logits: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int64 weights [N, V] of fp32 logits [N, V] at fp32 scale [N] (see the module docstring)."""
    x = logits.astype(np.float32)
    m = x.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        z = (x - m) * scale.astype(np.float32)[:, None]
        e = np.exp2(z)
        w = np.where(x == -np.inf, np.float32(0), e * np.float32(TWO_POW_32))
    return w.astype(np.int64)


def kept_threshold(w: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """The weight threshold t [N] of top-k then top-p: token i is kept iff w_i >= t."""
    n, v = w.shape
    desc = -np.sort(-w, axis=1)
    k = top_k.astype(np.int64)
    t_k = np.where((k > 0) & (k < v), desc[np.arange(n), np.clip(k - 1, 0, v - 1)], 0)
    kept_desc = np.where(desc >= t_k[:, None], desc, 0)
    mass_k = kept_desc.sum(axis=1)
    need = top_p.astype(np.float32).astype(np.float64) * mass_k.astype(np.float64)
    crossed = np.cumsum(kept_desc, axis=1).astype(np.float64) >= need[:, None]
    t_p = desc[np.arange(n), crossed.argmax(axis=1)]
    return np.where(top_p.astype(np.float32) < 1.0, t_p, t_k)


def pick(mass: np.ndarray, r: np.ndarray) -> np.ndarray:
    """First index whose inclusive prefix of int64 `mass` [N, V] exceeds floor(r / 2^32 * total);
    -1 for rows of zero total."""
    total = mass.sum(axis=1)
    u = r.astype(np.float64) * (1.0 / TWO_POW_32)
    target = np.minimum(np.floor(u * total.astype(np.float64)).astype(np.int64), total - 1)
    token = (np.cumsum(mass, axis=1) > target[:, None]).argmax(axis=1)
    return np.where(total > 0, token, -1)


def _probs(w: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """w / mass in float64 (an IEEE division, as in the kernels); 0 for rows of zero mass."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((mass > 0)[:, None], w.astype(np.float64) / mass.astype(np.float64)[:, None], 0.0)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """First index of each row's maximum logit, int64 [N]."""
    return torch.from_numpy(_np(logits.float()).argmax(axis=1).astype(np.int64)).to(logits.device)


def _sample_rows(x: np.ndarray, scale: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                 r: np.ndarray) -> np.ndarray:
    w = weights(x, scale)
    t = kept_threshold(w, top_k, top_p)
    token = pick(np.where(w >= t[:, None], w, 0), r)
    return np.where(scale > 0, token, x.argmax(axis=1))


def sample(logits, seeds, positions, scales, top_k, top_p, draw: int) -> torch.Tensor:
    """Tokens int64 [N] sampled from logits [N, V]; scales = sampling_scale(temperature)."""
    r = draw_u32(_np(seeds), _np(positions), draw)
    tokens = _sample_rows(_np(logits.float()), _np(scales), _np(top_k), _np(top_p), r)
    return torch.from_numpy(tokens.astype(np.int64)).to(logits.device)


def rejection_sample(target_logits, draft_logits, draft_tokens, seeds, positions, scales, top_k,
                     top_p) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain speculative verification. target_logits [N, K+1, V], draft_logits [N, K, V], draft_tokens
    [N, K]; draft j is proposed for position positions + j. Returns (tokens [N, K+1] int64, -1 after
    the last emitted token; accepted [N] int64, the number of accepted drafts)."""
    tl_ = _np(target_logits.float())
    dl = _np(draft_logits.float())
    dt = _np(draft_tokens).astype(np.int64)
    seeds, pos = _np(seeds), _np(positions).astype(np.int64)
    scale, top_k, top_p = _np(scales), _np(top_k), _np(top_p)
    n, k1, v = tl_.shape
    k = k1 - 1
    greedy = scale <= 0
    tokens = np.full((n, k1), -1, dtype=np.int64)
    accepted = np.zeros(n, dtype=np.int64)
    active = np.ones(n, dtype=bool)
    rows = np.arange(n)
    for j in range(k):
        x = dt[:, j]
        valid = (x >= 0) & (x < v)
        xc = np.clip(x, 0, v - 1)
        wt = weights(tl_[:, j], scale)
        wd = weights(dl[:, j], scale)
        wt = np.where(wt >= kept_threshold(wt, top_k, top_p)[:, None], wt, 0)
        wd = np.where(wd >= kept_threshold(wd, top_k, top_p)[:, None], wd, 0)
        mt, md = wt.sum(axis=1), wd.sum(axis=1)
        r_acc = draw_u32(seeds, pos + j, DRAW_ACCEPT).astype(np.float64)
        lhs = r_acc * np.where(valid, wd[rows, xc], 0).astype(np.float64) * mt.astype(np.float64)
        rhs = np.where(valid, wt[rows, xc], 0).astype(np.float64) * md.astype(np.float64) * TWO_POW_32
        greedy_choice = tl_[:, j].argmax(axis=1)
        accept = np.where(greedy, valid & (x == greedy_choice), lhs < rhs)
        res = _probs(wt, mt) - _probs(wd, md)
        res = np.floor(np.maximum(res, 0.0) * TWO_POW_32).astype(np.int64)
        # p_target == p_draft leaves no residual mass: fall back to the target distribution.
        res = np.where((res.sum(axis=1) > 0)[:, None], res, wt)
        fix = np.where(greedy, greedy_choice, pick(res, draw_u32(seeds, pos + j, DRAW_SAMPLE)))
        now_acc = active & accept
        now_rej = active & ~accept
        tokens[now_acc, j] = x[now_acc]
        tokens[now_rej, j] = fix[now_rej]
        accepted[now_rej] = j
        active &= accept
    bonus = _sample_rows(tl_[:, k], scale, top_k, top_p, draw_u32(seeds, pos + k, DRAW_SAMPLE))
    tokens[active, k] = bonus[active]
    accepted[active] = k
    device = target_logits.device
    return torch.from_numpy(tokens).to(device), torch.from_numpy(accepted).to(device)
