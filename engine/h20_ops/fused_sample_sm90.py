"""fused_sample in TileLang for SM90: greedy, temperature/top-k/top-p sampling and chain speculative
rejection sampling, one launch per batch each, one CTA per request row.

Contract: engine.h20_ops.fused_sample (validation, semantics) and docs/sampling.md; it must emit
the same tokens as engine.h20_ops.fused_sample_triton, operation for operation:
- random draws: T.rng_init(seed, position, draw) + T.rng_rand(), i.e. cuRAND Philox4x32-10
  curand_init(seed, subsequence=position, offset=draw): counter (draw // 4, 0, position lo,
  position hi), lane draw % 4 -- the word Triton's tl.philox(seed, draw // 4, 0, pos lo, pos hi)
  returns in lane draw % 4.
- numerics: logits read as fp32; weights int64 = trunc(exp2((x - max) * scale) * 2^32) with exp2
  as ex2.approx.ftz.f32 (fast math, as Triton's tl.exp2); masses are exact int64 sums (reduction
  order is free); acceptance and residual use fp64 products and IEEE divisions in Triton's order.
- thresholds by bisection over the weight range (33 masked passes at most each), the sampled
  index by a chunk scan then a bisection inside the chunk (no scan primitive needed).
Constraints: logits rows contiguous (the wrapper copies otherwise); V < 2^31.
Importing this module raises ModuleNotFoundError when TileLang is missing (the dispatcher's
signal to use Triton).
"""

import functools

import tilelang
import tilelang.language as T
import torch

from engine.h20_ops.fused_sample_ref import DRAW_ACCEPT, DRAW_SAMPLE, TWO_POW_32

THREADS = 256
BLOCK_V = 1024
LOG2_BLOCK_V = 10
BISECT_STEPS = 33  # the weight range [0, 2^32] has 2^32 + 1 values
WEIGHT_END = 4294967297
PASS_CONFIGS = {"tl.enable_fast_math": True}  # exp2f -> ex2.approx.ftz.f32, as Triton's tl.exp2
TILELANG_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _logit(buf, row, idx, n_vocab):
    return T.if_then_else(idx < n_vocab, T.Cast("float32", buf[row, idx]), -T.infinity("float32"))


def _weight(x, row_max, scale):
    # (x - max) * scale then exp2: nothing to contract into an fma, so both compilers round alike.
    w = T.Cast("int64", T.exp2((x - row_max) * scale) * T.float32(TWO_POW_32))
    return T.if_then_else(x == -T.infinity("float32"), T.int64(0), w)


def _prob(w, mass):
    return T.if_then_else(mass > 0, T.Cast("float64", w) / T.Cast("float64", T.max(mass, T.int64(1))),
                          T.float64(0))


def _target(r, mass):
    """min(floor(r / 2^32 * mass), mass - 1), in fp64 (r / 2^32 is exact)."""
    u = T.Cast("float64", r) * T.float64(1.0 / TWO_POW_32)
    return T.min(T.Cast("int64", T.floor(u * T.Cast("float64", mass))), mass - 1)



# Per-thread scalar state lives in small local arrays (every thread holds the same values: they
# come from all-reduces), addressed by these slots.
# int64 slots
HI, MID, TMP, RUN, CHUNK, BASE, LO, KEEP_T, MASS, TOK, ACC, T_T, T_MASS, D_T, D_MASS, RES_MASS, WT_X, WD_X = range(18)
N_INT = 18
# float32 slots
F_MAX, F_BEST, F_TMAX, F_DMAX = range(4)
N_FLOAT = 4
# float64 slots
D_NEED, D_LHS, D_RHS = range(3)
N_DOUBLE = 3


@T.macro
def _row_max(buf, row, n_vocab, xs, red_f, fs, out):
    fs[out] = -T.infinity("float32")
    for c in T.serial(T.ceildiv(n_vocab, BLOCK_V)):
        for i in T.Parallel(BLOCK_V):
            xs[i] = _logit(buf, row, c * BLOCK_V + i, n_vocab)
        T.reduce_max(xs, red_f, dim=0)
        fs[out] = T.max(fs[out], red_f[0])


@T.macro
def _row_argmax(buf, row, n_vocab, xs, ws, red_f, red_i, fs, ints, out):
    """ints[out] = first index of the row maximum (0 for an all -inf row)."""
    fs[F_BEST] = -T.infinity("float32")
    ints[out] = 0
    for c in T.serial(T.ceildiv(n_vocab, BLOCK_V)):
        for i in T.Parallel(BLOCK_V):
            xs[i] = _logit(buf, row, c * BLOCK_V + i, n_vocab)
        T.reduce_max(xs, red_f, dim=0)
        for i in T.Parallel(BLOCK_V):
            ws[i] = T.if_then_else(xs[i] == red_f[0], T.Cast("int64", c * BLOCK_V + i), T.Cast("int64", n_vocab))
        T.reduce_min(ws, red_i, dim=0)
        if red_f[0] > fs[F_BEST]:
            fs[F_BEST] = red_f[0]
            ints[out] = red_i[0]


@T.macro
def _fill_kept(buf, row, n_vocab, row_max, scale, t, c, ws):
    for i in T.Parallel(BLOCK_V):
        ws[i] = T.if_then_else(_weight(_logit(buf, row, c * BLOCK_V + i, n_vocab), row_max, scale) >= t,
                               _weight(_logit(buf, row, c * BLOCK_V + i, n_vocab), row_max, scale), T.int64(0))


@T.macro
def _count_at_least(buf, row, n_vocab, row_max, scale, t, ws, red_i, ints, out):
    ints[out] = 0
    for c in T.serial(T.ceildiv(n_vocab, BLOCK_V)):
        for i in T.Parallel(BLOCK_V):
            ws[i] = T.if_then_else(_weight(_logit(buf, row, c * BLOCK_V + i, n_vocab), row_max, scale) >= t,
                                   T.int64(1), T.int64(0))
        T.reduce_sum(ws, red_i, dim=0)
        ints[out] = ints[out] + red_i[0]


@T.macro
def _mass_at_least(buf, row, n_vocab, row_max, scale, t, ws, red_i, ints, out):
    ints[out] = 0
    for c in T.serial(T.ceildiv(n_vocab, BLOCK_V)):
        _fill_kept(buf, row, n_vocab, row_max, scale, t, c, ws)
        T.reduce_sum(ws, red_i, dim=0)
        ints[out] = ints[out] + red_i[0]


@T.macro
def _kept_threshold(buf, row, n_vocab, row_max, scale, top_k, top_p, ws, red_i, ints, ds, out_t, out_mass):
    """ints[out_t]: tokens with weight >= it survive top-k then top-p; ints[out_mass]: their mass."""
    ints[out_t] = 0
    if top_k > 0:
        if top_k < n_vocab:  # largest t with count(w >= t) >= k
            ints[HI] = WEIGHT_END
            for _ in T.serial(BISECT_STEPS):
                if ints[HI] - ints[out_t] > 1:
                    ints[MID] = ints[out_t] + (ints[HI] - ints[out_t]) // 2
                    _count_at_least(buf, row, n_vocab, row_max, scale, ints[MID], ws, red_i, ints, TMP)
                    if ints[TMP] >= top_k:
                        ints[out_t] = ints[MID]
                    else:
                        ints[HI] = ints[MID]
    _mass_at_least(buf, row, n_vocab, row_max, scale, ints[out_t], ws, red_i, ints, out_mass)
    if top_p < T.float32(1.0):  # largest t with mass(w >= t) >= p * (top-k mass)
        ds[D_NEED] = T.Cast("float64", top_p) * T.Cast("float64", ints[out_mass])
        ints[HI] = WEIGHT_END
        for _ in T.serial(BISECT_STEPS):
            if ints[HI] - ints[out_t] > 1:
                ints[MID] = ints[out_t] + (ints[HI] - ints[out_t]) // 2
                _mass_at_least(buf, row, n_vocab, row_max, scale, ints[MID], ws, red_i, ints, TMP)
                if T.Cast("float64", ints[TMP]) >= ds[D_NEED]:
                    ints[out_t] = ints[MID]
                else:
                    ints[HI] = ints[MID]
        _mass_at_least(buf, row, n_vocab, row_max, scale, ints[out_t], ws, red_i, ints, out_mass)


@T.macro
def _scan_chunk(ws, red_i, c, target, ints):
    """One chunk of a pick's scan: remember the first chunk whose end prefix exceeds target."""
    T.reduce_sum(ws, red_i, dim=0)
    if ints[CHUNK] < 0:
        if ints[RUN] + red_i[0] > target:
            ints[CHUNK] = c
            ints[BASE] = ints[RUN]
    ints[RUN] = ints[RUN] + red_i[0]


@T.macro
def _pick_in_chunk(ws, part, red_i, target, ints, out):
    """ints[out] = chunk * BLOCK_V + smallest i with base + sum(ws[:i + 1]) > target."""
    ints[LO] = -1
    ints[HI] = BLOCK_V - 1
    for _ in T.serial(LOG2_BLOCK_V):
        if ints[HI] - ints[LO] > 1:
            ints[MID] = (ints[LO] + ints[HI]) // 2
            for i in T.Parallel(BLOCK_V):
                part[i] = T.if_then_else(i <= ints[MID], ws[i], T.int64(0))
            T.reduce_sum(part, red_i, dim=0)
            if ints[BASE] + red_i[0] > target:
                ints[HI] = ints[MID]
            else:
                ints[LO] = ints[MID]
    ints[out] = ints[CHUNK] * BLOCK_V + ints[HI]


@T.macro
def _pick_kept(buf, row, n_vocab, row_max, scale, t, mass, r, ws, part, red_i, ints, out):
    """ints[out] = the kept token chosen by draw r (-1 if mass == 0)."""
    ints[out] = -1
    if mass > 0:
        ints[RUN] = 0
        ints[CHUNK] = -1
        for c in T.serial(T.ceildiv(n_vocab, BLOCK_V)):
            _fill_kept(buf, row, n_vocab, row_max, scale, t, c, ws)
            _scan_chunk(ws, red_i, c, _target(r, mass), ints)
        _fill_kept(buf, row, n_vocab, row_max, scale, t, ints[CHUNK], ws)
        _pick_in_chunk(ws, part, red_i, _target(r, mass), ints, out)


@T.macro
def _sample_row(buf, row, n_vocab, scale, top_k, top_p, r, xs, ws, part, red_f, red_i, ints, fs, ds, out):
    """ints[out] = the token sampled from row `row` with draw r (greedy when scale <= 0)."""
    if scale > 0:
        _row_max(buf, row, n_vocab, xs, red_f, fs, F_MAX)
        _kept_threshold(buf, row, n_vocab, fs[F_MAX], scale, top_k, top_p, ws, red_i, ints, ds, KEEP_T, MASS)
        _pick_kept(buf, row, n_vocab, fs[F_MAX], scale, ints[KEEP_T], ints[MASS], r, ws, part, red_i, ints, out)
    else:
        _row_argmax(buf, row, n_vocab, xs, ws, red_f, red_i, fs, ints, out)


@T.macro
def _fill_residual(t_buf, t_row, d_buf, d_row, n_vocab, scale, c, ints, fs, ws):
    """Chunk c of the fixed-point (2^-32) residual max(p_t - p_d, 0)."""
    for i in T.Parallel(BLOCK_V):
        ws[i] = T.Cast("int64", T.floor(T.max(
            _prob(T.if_then_else(
                _weight(_logit(t_buf, t_row, c * BLOCK_V + i, n_vocab), fs[F_TMAX], scale) >= ints[T_T],
                _weight(_logit(t_buf, t_row, c * BLOCK_V + i, n_vocab), fs[F_TMAX], scale), T.int64(0)),
                ints[T_MASS])
            - _prob(T.if_then_else(
                _weight(_logit(d_buf, d_row, c * BLOCK_V + i, n_vocab), fs[F_DMAX], scale) >= ints[D_T],
                _weight(_logit(d_buf, d_row, c * BLOCK_V + i, n_vocab), fs[F_DMAX], scale), T.int64(0)),
                ints[D_MASS]),
            T.float64(0)) * T.float64(TWO_POW_32)))


def _kept_weight_at(buf, row, x, n_vocab, row_max, scale, t):
    """Kept weight of token x (0 if x is not a valid id), computed as in the chunk passes."""
    valid = T.And(x >= 0, x < n_vocab)
    w = _weight(T.Cast("float32", buf[row, T.if_then_else(valid, x, T.int64(0))]), row_max, scale)
    return T.if_then_else(T.And(valid, w >= t), w, T.int64(0))


def _scratch():
    xs = T.alloc_fragment((BLOCK_V,), "float32")
    ws = T.alloc_fragment((BLOCK_V,), "int64")
    part = T.alloc_fragment((BLOCK_V,), "int64")
    red_f = T.alloc_fragment((1,), "float32")
    red_i = T.alloc_fragment((1,), "int64")
    ints = T.alloc_local((N_INT,), "int64")
    fs = T.alloc_local((N_FLOAT,), "float32")
    ds = T.alloc_local((N_DOUBLE,), "float64")
    rs = T.alloc_local((1,), "uint32")
    return xs, ws, part, red_f, red_i, ints, fs, ds, rs


@functools.lru_cache(maxsize=None)
def greedy_kernel(dtype: str):
    n_rows = T.dynamic("n_rows")
    n_vocab = T.dynamic("n_vocab")

    @T.prim_func
    def fused_greedy(logits: T.Tensor((n_rows, n_vocab), dtype), out: T.Tensor((n_rows,), "int64")):
        with T.Kernel(n_rows, threads=THREADS) as b:
            xs, ws, part, red_f, red_i, ints, fs, ds, rs = _scratch()
            _row_argmax(logits, b, n_vocab, xs, ws, red_f, red_i, fs, ints, TOK)
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
            xs, ws, part, red_f, red_i, ints, fs, ds, rs = _scratch()
            T.rng_init(seeds[b], positions[b], draw)
            rs[0] = T.rng_rand()
            _sample_row(logits, b, n_vocab, scales[b], top_ks[b], top_ps[b], rs[0], xs, ws, part, red_f, red_i,
                        ints, fs, ds, TOK)
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
            xs, ws, part, red_f, red_i, ints, fs, ds, rs = _scratch()
            ints[ACC] = -1  # -1: still accepting
            for j in T.serial(n_draft):
                if ints[ACC] < 0:
                    if scales[b] > 0:
                        _row_max(target, b * (n_draft + 1) + j, n_vocab, xs, red_f, fs, F_TMAX)
                        _kept_threshold(target, b * (n_draft + 1) + j, n_vocab, fs[F_TMAX], scales[b], top_ks[b],
                                        top_ps[b], ws, red_i, ints, ds, T_T, T_MASS)
                        _row_max(draft, b * n_draft + j, n_vocab, xs, red_f, fs, F_DMAX)
                        _kept_threshold(draft, b * n_draft + j, n_vocab, fs[F_DMAX], scales[b], top_ks[b],
                                        top_ps[b], ws, red_i, ints, ds, D_T, D_MASS)
                        ints[WT_X] = _kept_weight_at(target, b * (n_draft + 1) + j, draft_tokens[b, j], n_vocab,
                                                     fs[F_TMAX], scales[b], ints[T_T])
                        ints[WD_X] = _kept_weight_at(draft, b * n_draft + j, draft_tokens[b, j], n_vocab,
                                                     fs[F_DMAX], scales[b], ints[D_T])
                        # accept iff u < p_t(x) / p_d(x), u = r / 2^32, cross-multiplied: products only.
                        T.rng_init(seeds[b], positions[b] + j, DRAW_ACCEPT)
                        rs[0] = T.rng_rand()
                        ds[D_LHS] = (T.Cast("float64", rs[0]) * T.Cast("float64", ints[WD_X])
                                     * T.Cast("float64", ints[T_MASS]))
                        ds[D_RHS] = (T.Cast("float64", ints[WT_X]) * T.Cast("float64", ints[D_MASS])
                                     * T.float64(TWO_POW_32))
                        if ds[D_LHS] < ds[D_RHS]:
                            out_tokens[b, j] = draft_tokens[b, j]
                        else:
                            T.rng_init(seeds[b], positions[b] + j, DRAW_SAMPLE)
                            rs[0] = T.rng_rand()
                            ints[RES_MASS] = 0
                            for c in T.serial(T.ceildiv(n_vocab, BLOCK_V)):
                                _fill_residual(target, b * (n_draft + 1) + j, draft, b * n_draft + j, n_vocab,
                                               scales[b], c, ints, fs, ws)
                                T.reduce_sum(ws, red_i, dim=0)
                                ints[RES_MASS] = ints[RES_MASS] + red_i[0]
                            if ints[RES_MASS] > 0:
                                ints[RUN] = 0
                                ints[CHUNK] = -1
                                for c in T.serial(T.ceildiv(n_vocab, BLOCK_V)):
                                    _fill_residual(target, b * (n_draft + 1) + j, draft, b * n_draft + j, n_vocab,
                                                   scales[b], c, ints, fs, ws)
                                    _scan_chunk(ws, red_i, c, _target(rs[0], ints[RES_MASS]), ints)
                                _fill_residual(target, b * (n_draft + 1) + j, draft, b * n_draft + j, n_vocab,
                                               scales[b], ints[CHUNK], ints, fs, ws)
                                _pick_in_chunk(ws, part, red_i, _target(rs[0], ints[RES_MASS]), ints, TOK)
                            else:  # p_t == p_d leaves no residual: sample p_t itself
                                _pick_kept(target, b * (n_draft + 1) + j, n_vocab, fs[F_TMAX], scales[b], ints[T_T],
                                           ints[T_MASS], rs[0], ws, part, red_i, ints, TOK)
                            out_tokens[b, j] = ints[TOK]
                            ints[ACC] = j
                    else:
                        _row_argmax(target, b * (n_draft + 1) + j, n_vocab, xs, ws, red_f, red_i, fs, ints, TOK)
                        out_tokens[b, j] = ints[TOK]
                        if ints[TOK] != draft_tokens[b, j]:
                            ints[ACC] = j
            if ints[ACC] < 0:
                T.rng_init(seeds[b], positions[b] + n_draft, DRAW_SAMPLE)
                rs[0] = T.rng_rand()
                _sample_row(target, b * (n_draft + 1) + n_draft, n_vocab, scales[b], top_ks[b], top_ps[b], rs[0], xs,
                            ws, part, red_f, red_i, ints, fs, ds, TOK)
                out_tokens[b, n_draft] = ints[TOK]
                ints[ACC] = n_draft
            out_accepted[b] = ints[ACC]

    return fused_rejection


def compile_kernel(prim_func, target="auto"):
    """JIT-compile one prim_func (cached by TileLang); target "auto" probes the GPU."""
    return tilelang.compile(prim_func, target=target, pass_configs=PASS_CONFIGS)


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, dtype: str, draw: int | None = None):
    if kind == "greedy":
        return compile_kernel(greedy_kernel(dtype))
    if kind == "sample":
        return compile_kernel(sample_kernel(dtype, draw))
    return compile_kernel(rejection_kernel(dtype))


def _rows(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.is_contiguous() else logits.contiguous()


def greedy(logits: torch.Tensor) -> torch.Tensor:
    out = torch.empty(logits.size(0), dtype=torch.int64, device=logits.device)
    _compiled("greedy", TILELANG_DTYPES[logits.dtype])(_rows(logits), out)
    return out


def sample(logits, seeds, positions, scales, top_k, top_p, draw: int) -> torch.Tensor:
    out = torch.empty(logits.size(0), dtype=torch.int64, device=logits.device)
    _compiled("sample", TILELANG_DTYPES[logits.dtype], draw)(_rows(logits), seeds, positions, scales, top_k, top_p,
                                                            out)
    return out


def rejection_sample(target_logits, draft_logits, draft_tokens, seeds, positions, scales, top_k, top_p):
    n, k1, v = target_logits.shape
    tokens = torch.full((n, k1), -1, dtype=torch.int64, device=target_logits.device)
    accepted = torch.empty(n, dtype=torch.int64, device=target_logits.device)
    _compiled("rejection", TILELANG_DTYPES[target_logits.dtype])(
        _rows(target_logits).view(n * k1, v), _rows(draft_logits).view(n * (k1 - 1), v), draft_tokens, seeds,
        positions, scales, top_k, top_p, tokens, accepted)
    return tokens, accepted
