"""fused_sample in TileLang for SM90: greedy, temperature/top-k/top-p sampling and chain speculative
rejection sampling, one launch per batch each, one CTA per request row.

Contract: engine.h20_ops.sampling.dispatch (validation, semantics) and docs/sampling.md; it must emit
the same tokens as engine.h20_ops.sampling.triton_kernels, operation for operation:
- random draws: T.rng_init(seed, position, draw) + T.rng_rand(), i.e. cuRAND Philox4x32-10
  curand_init(seed, subsequence=position, offset=draw): counter (draw // 4, 0, position lo,
  position hi), lane draw % 4 -- the word Triton's tl.philox(seed, draw // 4, 0, pos lo, pos hi)
  returns in lane draw % 4.
- numerics: logits read as fp32; weights int64 = trunc(exp2((x - max) * scale) * 2^32) with exp2
  as ex2.approx.ftz.f32 (fast math, as Triton's tl.exp2); masses are exact int64 sums (reduction
  order is free); acceptance and residual use fp64 products and IEEE divisions in Triton's order.
- thresholds as fused_sample_triton finds them: top-k by bisection over the row's ordered logit bit
  patterns (16 bits when every logit is a bf16 value, else 32; compare-only passes), top-p likewise
  when the keys span at most 2^30 (a weight pass per step), each checked by one pass that the
  weight found brackets the threshold exactly; bisection over the weight range (33 steps at most)
  from the side that failed, or for top-p over a wider key span from the start; a pass
  keeps per-thread sums and reduces them once. The sampled index by a chunk scan then a bisection
  inside the chunk (no scan primitive needed).
Constraints: logits rows contiguous (the wrapper copies otherwise); V <= fused_sample.MAX_VOCAB.
Deliberate deviations from TileLang defaults: fast math (for the exp2 above; it also flushes fp32
subnormals, so logits that differ only below 1.2e-38 may break a greedy tie unlike Triton) and no automatic
safe-memory guards (all loads are guarded by hand; the guards made lowering take minutes). T.rng_*
include curand_kernel.h: curand_include_flags() finds it in pip's CUDA wheels if the toolkit lacks it.
No `from __future__ import annotations` here: TileLang evaluates the kernels' annotations.
Importing this module raises ModuleNotFoundError when TileLang is missing (the dispatcher's
signal to use Triton).
"""

import functools
import glob
import os
import sys

import tilelang
import tilelang.language as T
import torch

from .reference import DRAW_ACCEPT, DRAW_SAMPLE, TWO_POW_32

THREADS = 1024  # one CTA per row; its passes run 1.8x faster than with 256 threads (docs/lab/sampling.md)
BLOCK_V = 1024
LOG2_BLOCK_V = 10
BISECT_STEPS = 33  # the weight range [0, 2^32] has 2^32 + 1 values
KEY_STEPS = 32  # ordered fp32 keys (fewer run when the grain is 16)
KEY_SPAN_SEARCHED = 1 << 30  # top-p searches logit keys up to this span (fused_sample_triton says why)
WEIGHT_END = 4294967297
PASS_CONFIGS = {
    "tl.enable_fast_math": True,  # exp2f -> ex2.approx.ftz.f32, as Triton's tl.exp2
    # Every load is guarded explicitly (vocabulary mask, clamped draft ids, valid rows); the automatic
    # guards only add conditions that make TileLang's simplifier take minutes on the rejection kernel.
    "tl.disable_safe_memory_legalize": True,
}
TILELANG_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _logit(t_buf, t_row, d_buf, d_row, side, idx, n_vocab):
    """Logit idx of the target row (side 0) or the draft row (side 1); -inf past the vocabulary."""
    x = T.if_then_else(side == 0, T.Cast("float32", t_buf[t_row, idx]), T.Cast("float32", d_buf[d_row, idx]))
    return T.if_then_else(idx < n_vocab, x, -T.infinity("float32"))


def _weight(x, row_max, scale):
    # (x - max) * scale then exp2: nothing to contract into an fma, so both compilers round alike.
    w = T.Cast("int64", T.exp2((x - row_max) * scale) * T.float32(TWO_POW_32))
    return T.if_then_else(x == -T.infinity("float32"), T.int64(0), w)


def _key(x, grain):
    """Ordered key of fp32 x (keys compare as the values do, -0 just below +0), shifted right by grain."""
    b = T.Cast("int64", T.reinterpret(x, "int32"))
    return T.if_then_else(b >= 0, b + T.int64(2**31), T.int64(2**31 - 1) - (b & T.int64(0x7FFFFFFF))) >> grain


def _key_value(k, grain):
    """The fp32 value of key k (inverse of _key for values whose low `grain` bits are 0)."""
    half = T.int64(1) << (T.int64(31) - grain)  # keys >= half are the non-negative values
    bits = T.if_then_else(k >= half, (k - half) << grain, ((half - 1 - k) << grain) | T.int64(2**31))
    return T.reinterpret(T.Cast("int32", bits), "float32")


def _prob(w, mass):
    return T.if_then_else(mass > 0, T.Cast("float64", w) / T.Cast("float64", T.max(mass, T.int64(1))),
                          T.float64(0))


def _target(r, mass):
    """min(floor(r / 2^32 * mass), mass - 1), in fp64 (r / 2^32 is exact)."""
    u = T.Cast("float64", r) * T.float64(1.0 / TWO_POW_32)
    return T.min(T.Cast("int64", T.floor(u * T.Cast("float64", mass))), mass - 1)




# Per-thread scalar state lives in small local arrays (every thread holds the same values: they
# come from all-reduces), addressed by these slots; "+ side" selects target (0) or draft (1).
(LO, HI, MID, P_MASS, P_CNT, N_ABOVE, M_ABOVE, KEEP_T, _KEEP_T_DRAFT, MASS, _MASS_DRAFT, MODE, RUN, CHUNK, BASE,
 TOK, ACC, WX, _WX_DRAFT, T_ROW, D_ROW, GRAIN, KEY_LO, KEY_HI, KEY_END, T_CAND, T_K) = range(27)
N_INT = 27
F_MAX, _F_MAX_DRAFT, F_CAND = range(3)
N_FLOAT = 3
D_NEED, D_LHS, D_RHS = range(3)
N_DOUBLE = 3


@T.macro
def _row_max(t_buf, t_row, d_buf, d_row, side, n_vocab, xs, part, red_f, red_i, fs, ints):
    """fs[F_MAX + side] = the row maximum; ints[GRAIN] = 16 if every logit is a bf16 value (its fp32 bits
    end in 16 zeros), else 0. Each thread keeps its lanes' max and OR across chunks; one reduction each."""
    for i in T.Parallel(BLOCK_V):
        xs[i] = -T.infinity("float32")
        part[i] = T.int64(0)
    for c in T.serial(T.ceildiv(n_vocab, BLOCK_V)):
        for i in T.Parallel(BLOCK_V):
            x = _logit(t_buf, t_row, d_buf, d_row, side, c * BLOCK_V + i, n_vocab)
            xs[i] = T.max(xs[i], x)
            part[i] = part[i] | T.Cast("int64", T.reinterpret(x, "int32") & 0xFFFF)
    T.reduce_max(xs, red_f, dim=0)
    fs[F_MAX + side] = red_f[0]
    T.reduce_max(part, red_i, dim=0)
    ints[GRAIN] = T.if_then_else(red_i[0] == 0, T.int64(16), T.int64(0))


@T.macro
def _row_argmax(t_buf, t_row, n_vocab, xs, ws, red_f, red_i, fs, ints):
    """ints[TOK] = first index of the target row's maximum (0 for an all -inf row). Each lane keeps its
    maximum and the first index where it met it (lanes visit increasing indices); two block reductions
    at the end pick the smallest such index among the lanes holding the row maximum."""
    for i in T.Parallel(BLOCK_V):
        xs[i] = -T.infinity("float32")
        ws[i] = T.Cast("int64", n_vocab)
    for c in T.serial(T.ceildiv(n_vocab, BLOCK_V)):
        for i in T.Parallel(BLOCK_V):
            x = _logit(t_buf, t_row, t_buf, t_row, 0, c * BLOCK_V + i, n_vocab)
            ws[i] = T.if_then_else(x > xs[i], T.Cast("int64", c * BLOCK_V + i), ws[i])
            xs[i] = T.max(xs[i], x)
    T.reduce_max(xs, red_f, dim=0)
    for i in T.Parallel(BLOCK_V):
        ws[i] = T.if_then_else(xs[i] == red_f[0], ws[i], T.Cast("int64", n_vocab))
    T.reduce_min(ws, red_i, dim=0)
    ints[TOK] = T.if_then_else(red_i[0] < n_vocab, red_i[0], T.int64(0))


@T.macro
def _count_logits_pass(t_buf, t_row, d_buf, d_row, side, n_vocab, part, red_c, ints, fs):
    """ints[P_CNT] = count(x >= fs[F_CAND]); F_CAND > -inf, so the -inf padding is never counted."""
    for i in T.Parallel(BLOCK_V):
        part[i] = T.int64(0)
    for c in T.serial(T.ceildiv(n_vocab, BLOCK_V)):
        for i in T.Parallel(BLOCK_V):
            part[i] = part[i] + T.if_then_else(
                _logit(t_buf, t_row, d_buf, d_row, side, c * BLOCK_V + i, n_vocab) >= fs[F_CAND], T.int64(1),
                T.int64(0))
    T.reduce_sum(part, red_c, dim=0)
    ints[P_CNT] = red_c[0]


@T.macro
def _mass_pass(t_buf, t_row, d_buf, d_row, side, n_vocab, scale, t, ws, red_i, ints, fs):
    """ints[P_MASS] = mass(w >= t)."""
    for i in T.Parallel(BLOCK_V):
        ws[i] = T.int64(0)
    for c in T.serial(T.ceildiv(n_vocab, BLOCK_V)):
        for i in T.Parallel(BLOCK_V):
            w = _weight(_logit(t_buf, t_row, d_buf, d_row, side, c * BLOCK_V + i, n_vocab), fs[F_MAX + side], scale)
            ws[i] = ws[i] + T.if_then_else(w >= t, w, T.int64(0))
    T.reduce_sum(ws, red_i, dim=0)
    ints[P_MASS] = red_i[0]


@T.macro
def _bracket_pass(t_buf, t_row, d_buf, d_row, side, n_vocab, scale, t, ws, part, ws2, part2, red_i, ints, fs):
    """ints[P_CNT], ints[N_ABOVE], ints[P_MASS], ints[M_ABOVE] = count(w >= t), count(w >= t + 1),
    mass(w >= t), mass(w >= t + 1) over the row's n_vocab entries."""
    for i in T.Parallel(BLOCK_V):
        ws[i] = T.int64(0)
        part[i] = T.int64(0)
        ws2[i] = T.int64(0)
        part2[i] = T.int64(0)
    for c in T.serial(T.ceildiv(n_vocab, BLOCK_V)):
        for i in T.Parallel(BLOCK_V):
            w = _weight(_logit(t_buf, t_row, d_buf, d_row, side, c * BLOCK_V + i, n_vocab), fs[F_MAX + side], scale)
            at_t = T.And(w >= t, c * BLOCK_V + i < n_vocab)
            part[i] = part[i] + T.if_then_else(at_t, T.int64(1), T.int64(0))
            part2[i] = part2[i] + T.if_then_else(w > t, T.int64(1), T.int64(0))
            ws[i] = ws[i] + T.if_then_else(at_t, w, T.int64(0))
            ws2[i] = ws2[i] + T.if_then_else(w > t, w, T.int64(0))
    T.reduce_sum(part, red_i, dim=0)
    ints[P_CNT] = red_i[0]
    T.reduce_sum(part2, red_i, dim=0)
    ints[N_ABOVE] = red_i[0]
    T.reduce_sum(ws, red_i, dim=0)
    ints[P_MASS] = red_i[0]
    T.reduce_sum(ws2, red_i, dim=0)
    ints[M_ABOVE] = red_i[0]


@T.macro
def _thresholds(t_buf, t_row, d_buf, d_row, side, n_vocab, scale, top_k, top_p, ws, part, ws2, part2, red_i, red_c,
                ints, ds, fs):
    """ints[KEEP_T + side] / ints[MASS + side]: weight threshold of top-k then top-p and the kept mass,
    step for step as fused_sample_triton._kept_threshold: top-k over the ordered logits by compare-only
    passes, top-p over them by mass passes (mass(w >= max(w(c), t_k)) >= p * top-k mass), each checked
    by a bracket pass and repaired by bisection over the weights if the check fails."""
    ints[LO] = 0
    ints[KEY_LO] = _key(-T.infinity("float32"), ints[GRAIN])  # every logit is >= -inf
    ints[KEY_END] = _key(fs[F_MAX + side], ints[GRAIN]) + 1  # no logit is >= this key's value
    if T.And(top_k > 0, top_k < n_vocab):
        ints[KEY_HI] = ints[KEY_END]
        for _ in T.serial(KEY_STEPS):
            if ints[KEY_HI] - ints[KEY_LO] > 1:
                ints[MID] = ints[KEY_LO] + (ints[KEY_HI] - ints[KEY_LO]) // 2
                fs[F_CAND] = _key_value(ints[MID], ints[GRAIN])
                _count_logits_pass(t_buf, t_row, d_buf, d_row, side, n_vocab, part, red_c, ints, fs)
                if ints[P_CNT] >= top_k:
                    ints[KEY_LO] = ints[MID]
                else:
                    ints[KEY_HI] = ints[MID]
        ints[T_CAND] = _weight(_key_value(ints[KEY_LO], ints[GRAIN]), fs[F_MAX + side], scale)
        _bracket_pass(t_buf, t_row, d_buf, d_row, side, n_vocab, scale, ints[T_CAND], ws, part, ws2, part2, red_i,
                      ints, fs)
        ints[MASS + side] = ints[P_MASS]
        ints[HI] = WEIGHT_END
        if ints[P_CNT] >= top_k:
            ints[LO] = ints[T_CAND]
        if ints[N_ABOVE] < top_k:
            ints[HI] = ints[T_CAND] + 1
        for _ in T.serial(BISECT_STEPS):
            if ints[HI] - ints[LO] > 1:
                ints[MID] = ints[LO] + (ints[HI] - ints[LO]) // 2
                _bracket_pass(t_buf, t_row, d_buf, d_row, side, n_vocab, scale, ints[MID], ws, part, ws2, part2,
                              red_i, ints, fs)
                if ints[P_CNT] >= top_k:
                    ints[LO] = ints[MID]
                else:
                    ints[HI] = ints[MID]
        if ints[LO] != ints[T_CAND]:
            _mass_pass(t_buf, t_row, d_buf, d_row, side, n_vocab, scale, ints[LO], ws, red_i, ints, fs)
            ints[MASS + side] = ints[P_MASS]
    else:
        _mass_pass(t_buf, t_row, d_buf, d_row, side, n_vocab, scale, ints[LO], ws, red_i, ints, fs)
        ints[MASS + side] = ints[P_MASS]
    if T.And(top_p < T.float32(1.0), ints[MASS + side] > 0):  # (mass 0: no finite logit, token -1 anyway)
        ds[D_NEED] = T.Cast("float64", top_p) * T.Cast("float64", ints[MASS + side])
        ints[T_K] = ints[LO]
        ints[HI] = WEIGHT_END
        ints[T_CAND] = -1  # no candidate: bisect the whole weight range
        if ints[KEY_END] - ints[KEY_LO] <= KEY_SPAN_SEARCHED:  # (as fused_sample_triton)
            ints[KEY_HI] = ints[KEY_END]
            for _ in T.serial(KEY_STEPS):
                if ints[KEY_HI] - ints[KEY_LO] > 1:
                    ints[MID] = ints[KEY_LO] + (ints[KEY_HI] - ints[KEY_LO]) // 2
                    ints[T_CAND] = T.max(_weight(_key_value(ints[MID], ints[GRAIN]), fs[F_MAX + side], scale),
                                         ints[T_K])
                    _mass_pass(t_buf, t_row, d_buf, d_row, side, n_vocab, scale, ints[T_CAND], ws, red_i, ints, fs)
                    if T.Cast("float64", ints[P_MASS]) >= ds[D_NEED]:
                        ints[KEY_LO] = ints[MID]
                    else:
                        ints[KEY_HI] = ints[MID]
            ints[T_CAND] = T.max(_weight(_key_value(ints[KEY_LO], ints[GRAIN]), fs[F_MAX + side], scale), ints[T_K])
            _bracket_pass(t_buf, t_row, d_buf, d_row, side, n_vocab, scale, ints[T_CAND], ws, part, ws2, part2,
                          red_i, ints, fs)
            ints[MASS + side] = ints[P_MASS]
            if T.Cast("float64", ints[P_MASS]) >= ds[D_NEED]:
                ints[LO] = ints[T_CAND]
            if T.Cast("float64", ints[M_ABOVE]) < ds[D_NEED]:
                ints[HI] = ints[T_CAND] + 1
        for _ in T.serial(BISECT_STEPS):
            if ints[HI] - ints[LO] > 1:
                ints[MID] = ints[LO] + (ints[HI] - ints[LO]) // 2
                _mass_pass(t_buf, t_row, d_buf, d_row, side, n_vocab, scale, ints[MID], ws, red_i, ints, fs)
                if T.Cast("float64", ints[P_MASS]) >= ds[D_NEED]:
                    ints[LO] = ints[MID]
                else:
                    ints[HI] = ints[MID]
        if ints[LO] != ints[T_CAND]:
            _mass_pass(t_buf, t_row, d_buf, d_row, side, n_vocab, scale, ints[LO], ws, red_i, ints, fs)
            ints[MASS + side] = ints[P_MASS]
    ints[KEEP_T + side] = ints[LO]


@T.macro
def _fill_values(t_buf, t_row, d_buf, d_row, n_vocab, scale, c, ints, fs, ws):
    """Chunk c of the pick distribution: mode 0 kept target weights; mode 1 the fixed-point (2^-32)
    residual max(p_t - p_d, 0)."""
    for i in T.Parallel(BLOCK_V):
        wt = _weight(_logit(t_buf, t_row, d_buf, d_row, 0, c * BLOCK_V + i, n_vocab), fs[F_MAX], scale)
        kt = T.if_then_else(wt >= ints[KEEP_T], wt, T.int64(0))
        wd = _weight(_logit(t_buf, t_row, d_buf, d_row, 1, c * BLOCK_V + i, n_vocab), fs[F_MAX + 1], scale)
        kd = T.if_then_else(wd >= ints[KEEP_T + 1], wd, T.int64(0))
        res = _prob(kt, ints[MASS]) - _prob(kd, ints[MASS + 1])
        ws[i] = T.if_then_else(ints[MODE] == 1,
                               T.Cast("int64", T.floor(T.max(res, T.float64(0)) * T.float64(TWO_POW_32))), kt)


@T.macro
def _pick(t_buf, t_row, d_buf, d_row, n_vocab, scale, r, ws, part, red_i, ints, fs):
    """ints[TOK] = first index whose prefix of the ints[MODE] distribution exceeds _target(r, mass);
    a residual without mass falls back to the kept target weights; -1 if nothing has mass."""
    for i in T.Parallel(BLOCK_V):
        part[i] = T.int64(0)
    for c in T.serial(T.ceildiv(n_vocab, BLOCK_V)):
        _fill_values(t_buf, t_row, d_buf, d_row, n_vocab, scale, c, ints, fs, ws)
        for i in T.Parallel(BLOCK_V):
            part[i] = part[i] + ws[i]
    T.reduce_sum(part, red_i, dim=0)
    ints[P_MASS] = red_i[0]
    if ints[P_MASS] == 0:
        ints[MODE] = 0
        ints[P_MASS] = ints[MASS]
    ints[TOK] = -1
    if ints[P_MASS] > 0:
        ints[RUN] = 0
        ints[CHUNK] = -1
        for c in T.serial(T.ceildiv(n_vocab, BLOCK_V)):
            _fill_values(t_buf, t_row, d_buf, d_row, n_vocab, scale, c, ints, fs, ws)
            T.reduce_sum(ws, red_i, dim=0)
            if ints[CHUNK] < 0:
                if ints[RUN] + red_i[0] > _target(r, ints[P_MASS]):
                    ints[CHUNK] = c
                    ints[BASE] = ints[RUN]
            ints[RUN] = ints[RUN] + red_i[0]
        # inside the chunk: smallest i with base + sum(ws[:i + 1]) > target, by bisection on i
        _fill_values(t_buf, t_row, d_buf, d_row, n_vocab, scale, ints[CHUNK], ints, fs, ws)
        ints[LO] = -1
        ints[HI] = BLOCK_V - 1
        for _ in T.serial(LOG2_BLOCK_V):
            if ints[HI] - ints[LO] > 1:
                ints[MID] = (ints[LO] + ints[HI]) // 2
                for i in T.Parallel(BLOCK_V):
                    part[i] = T.if_then_else(i <= ints[MID], ws[i], T.int64(0))
                T.reduce_sum(part, red_i, dim=0)
                if ints[BASE] + red_i[0] > _target(r, ints[P_MASS]):
                    ints[HI] = ints[MID]
                else:
                    ints[LO] = ints[MID]
        ints[TOK] = ints[CHUNK] * BLOCK_V + ints[HI]


def _kept_weight_at(buf, row, x, n_vocab, row_max, scale, t):
    """Kept weight of token x (0 if x is not a valid id), computed as in the chunk passes."""
    valid = T.And(x >= 0, x < n_vocab)
    w = _weight(T.Cast("float32", buf[row, T.if_then_else(valid, x, T.int64(0))]), row_max, scale)
    return T.if_then_else(T.And(valid, w >= t), w, T.int64(0))


def _scratch():
    return (T.alloc_fragment((BLOCK_V,), "float32"), T.alloc_fragment((BLOCK_V,), "int64"),
            T.alloc_fragment((BLOCK_V,), "int64"), T.alloc_fragment((BLOCK_V,), "int64"),
            T.alloc_fragment((BLOCK_V,), "int64"), T.alloc_fragment((1,), "float32"),
            T.alloc_fragment((1,), "int64"), T.alloc_fragment((1,), "int64"), T.alloc_local((N_INT,), "int64"),
            T.alloc_local((N_FLOAT,), "float32"), T.alloc_local((N_DOUBLE,), "float64"),
            T.alloc_local((1,), "uint32"))


@functools.lru_cache(maxsize=None)
def greedy_kernel(dtype: str):
    n_rows = T.dynamic("n_rows")
    n_vocab = T.dynamic("n_vocab")

    @T.prim_func
    def fused_greedy(logits: T.Tensor((n_rows, n_vocab), dtype), out: T.Tensor((n_rows,), "int64")):
        with T.Kernel(n_rows, threads=THREADS) as b:
            xs, ws, part, ws2, part2, red_f, red_i, red_c, ints, fs, ds, rs = _scratch()
            _row_argmax(logits, b, n_vocab, xs, ws, red_f, red_i, fs, ints)
            out[b] = ints[TOK]

    return fused_greedy


@functools.lru_cache(maxsize=None)
def sample_kernel(dtype: str, draw: int):
    n_rows = T.dynamic("n_rows")
    n_vocab = T.dynamic("n_vocab")

    @T.prim_func
    def fused_sample(logits: T.Tensor((n_rows, n_vocab), dtype), seeds: T.Tensor((n_rows,), "int64"),
                     positions: T.Tensor((n_rows,), "int64"), scales: T.Tensor((n_rows,), "float32"),
                     top_ks: T.Tensor((n_rows,), "int64"), top_ps: T.Tensor((n_rows,), "float32"),
                     out: T.Tensor((n_rows,), "int64")):
        with T.Kernel(n_rows, threads=THREADS) as b:
            xs, ws, part, ws2, part2, red_f, red_i, red_c, ints, fs, ds, rs = _scratch()
            if scales[b] > 0:
                T.rng_init(seeds[b], positions[b], draw)
                rs[0] = T.rng_rand()
                _row_max(logits, b, logits, b, 0, n_vocab, xs, part, red_f, red_i, fs, ints)
                _thresholds(logits, b, logits, b, 0, n_vocab, scales[b], top_ks[b], top_ps[b], ws, part, ws2, part2,
                            red_i, red_c, ints, ds, fs)
                ints[MODE] = 0
                _pick(logits, b, logits, b, n_vocab, scales[b], rs[0], ws, part, red_i, ints, fs)
            else:
                _row_argmax(logits, b, n_vocab, xs, ws, red_f, red_i, fs, ints)
            out[b] = ints[TOK]

    return fused_sample


@functools.lru_cache(maxsize=None)
def rejection_kernel(dtype: str):
    n_rows = T.dynamic("n_rows")
    n_draft = T.dynamic("n_draft")
    n_vocab = T.dynamic("n_vocab")
    n_target_rows = T.dynamic("n_target_rows")
    n_draft_rows = T.dynamic("n_draft_rows")

    @T.prim_func
    def fused_rejection(target: T.Tensor((n_target_rows, n_vocab), dtype),
                        draft: T.Tensor((n_draft_rows, n_vocab), dtype),
                        draft_tokens: T.Tensor((n_rows, n_draft), "int64"), seeds: T.Tensor((n_rows,), "int64"),
                        positions: T.Tensor((n_rows,), "int64"), scales: T.Tensor((n_rows,), "float32"),
                        top_ks: T.Tensor((n_rows,), "int64"), top_ps: T.Tensor((n_rows,), "float32"),
                        out_tokens: T.Tensor((n_rows, n_draft + 1), "int64"),
                        out_accepted: T.Tensor((n_rows,), "int64")):
        with T.Kernel(n_rows, threads=THREADS) as b:
            xs, ws, part, ws2, part2, red_f, red_i, red_c, ints, fs, ds, rs = _scratch()
            ints[ACC] = -1  # -1: still accepting
            # Step j < n_draft verifies draft j; step n_draft draws the bonus token.
            for j in T.serial(n_draft + 1):
                if ints[ACC] < 0:
                    # Row numbers live in registers: data-dependent indices keep TileLang's index
                    # analysis (and so the compile time) small.
                    ints[T_ROW] = b * (n_draft + 1) + j
                    ints[D_ROW] = b * n_draft + T.min(j, n_draft - 1)
                    if scales[b] > 0:
                        for side in T.serial(T.if_then_else(j < n_draft, 2, 1)):
                            _row_max(target, ints[T_ROW], draft, ints[D_ROW], side, n_vocab, xs, part, red_f, red_i,
                                     fs, ints)
                            _thresholds(target, ints[T_ROW], draft, ints[D_ROW], side, n_vocab, scales[b], top_ks[b],
                                        top_ps[b], ws, part, ws2, part2, red_i, red_c, ints, ds, fs)
                        ints[MODE] = 0
                        if j < n_draft:
                            ints[WX] = _kept_weight_at(target, ints[T_ROW], draft_tokens[b, j], n_vocab, fs[F_MAX],
                                                       scales[b], ints[KEEP_T])
                            ints[WX + 1] = _kept_weight_at(draft, ints[D_ROW], draft_tokens[b, j], n_vocab,
                                                           fs[F_MAX + 1], scales[b], ints[KEEP_T + 1])
                            # accept iff u < p_t(x) / p_d(x), u = r / 2^32, cross-multiplied: products only.
                            T.rng_init(seeds[b], positions[b] + j, DRAW_ACCEPT)
                            rs[0] = T.rng_rand()
                            ds[D_LHS] = (T.Cast("float64", rs[0]) * T.Cast("float64", ints[WX + 1])
                                         * T.Cast("float64", ints[MASS]))
                            ds[D_RHS] = (T.Cast("float64", ints[WX]) * T.Cast("float64", ints[MASS + 1])
                                         * T.float64(TWO_POW_32))
                            ints[MODE] = 1
                            if ds[D_LHS] < ds[D_RHS]:
                                out_tokens[b, j] = draft_tokens[b, j]
                                ints[MODE] = 2  # accepted: nothing to draw
                        if ints[MODE] < 2:  # a rejection (residual) or the bonus token (kept target)
                            T.rng_init(seeds[b], positions[b] + j, DRAW_SAMPLE)
                            rs[0] = T.rng_rand()
                            _pick(target, ints[T_ROW], draft, ints[D_ROW], n_vocab, scales[b], rs[0], ws, part, red_i,
                                  ints, fs)
                            out_tokens[b, j] = ints[TOK]
                            ints[ACC] = j
                    else:
                        _row_argmax(target, ints[T_ROW], n_vocab, xs, ws, red_f, red_i, fs, ints)
                        out_tokens[b, j] = ints[TOK]
                        if j == n_draft:
                            ints[ACC] = j
                        elif ints[TOK] != draft_tokens[b, j]:
                            ints[ACC] = j
            out_accepted[b] = ints[ACC]

    return fused_rejection


@functools.lru_cache(maxsize=None)
def curand_include_flags() -> tuple[str, ...]:
    """nvcc -I flag for curand_kernel.h (T.rng_* include it) when the CUDA toolkit lacks it: pip's
    CUDA wheels (a dependency of CUDA torch) ship it under site-packages/nvidia/*/include."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    if os.path.exists(os.path.join(cuda_home, "include", "curand_kernel.h")):
        return ()
    for entry in sys.path:
        for header in sorted(glob.glob(os.path.join(entry, "nvidia", "*", "include", "curand_kernel.h"))):
            return (f"-I{os.path.dirname(header)}",)
    return ()


def compile_kernel(prim_func, target="auto"):
    """JIT-compile one prim_func (TileLang caches it on disk); target "auto" probes the GPU."""
    return tilelang.compile(prim_func, target=target, pass_configs=PASS_CONFIGS,
                            compile_flags=list(curand_include_flags()))


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, dtype: str, draw: int = DRAW_SAMPLE):
    if kind == "greedy":
        return compile_kernel(greedy_kernel(dtype))
    if kind == "sample":
        return compile_kernel(sample_kernel(dtype, draw))
    return compile_kernel(rejection_kernel(dtype))


def _rows(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.is_contiguous() else logits.contiguous()


# An empty batch returns before the launch: a grid of 0 CTAs is an invalid CUDA launch (Triton skips it).
def greedy(logits: torch.Tensor) -> torch.Tensor:
    out = torch.empty(logits.size(0), dtype=torch.int64, device=logits.device)
    if out.numel():
        _compiled("greedy", TILELANG_DTYPES[logits.dtype])(_rows(logits), out)
    return out


def sample(logits, seeds, positions, scales, top_k, top_p, draw: int) -> torch.Tensor:
    out = torch.empty(logits.size(0), dtype=torch.int64, device=logits.device)
    if out.numel():
        _compiled("sample", TILELANG_DTYPES[logits.dtype], draw)(_rows(logits), seeds, positions, scales, top_k,
                                                                top_p, out)
    return out


def rejection_sample(target_logits, draft_logits, draft_tokens, seeds, positions, scales, top_k, top_p):
    n, k1, v = target_logits.shape
    tokens = torch.full((n, k1), -1, dtype=torch.int64, device=target_logits.device)
    accepted = torch.empty(n, dtype=torch.int64, device=target_logits.device)
    if n == 0:
        return tokens, accepted
    _compiled("rejection", TILELANG_DTYPES[target_logits.dtype])(
        _rows(target_logits).view(n * k1, v), _rows(draft_logits).view(n * (k1 - 1), v), draft_tokens, seeds,
        positions, scales, top_k, top_p, tokens, accepted)
    return tokens, accepted
