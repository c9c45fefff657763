"""The one comparator and the one case generator every kernel test and A/B script uses.

Comparator (FlashMLA's rule): an element passes if |got - ref| < abs OR |got - ref| / (|ref| + 1e-6) <
rel; +inf, -inf and NaN positions must match exactly; the cosine distance 1 - 2 sum(g r) / sum(g^2 + r^2)
over the finite elements (float64) must not exceed `cos`. Tolerances below are FlashMLA's, made for its
input distribution 0.1 * N(0, 1) (+ an offset), which `normal_inputs` draws; every backend is held to
them (docs/contract.md "Tolerances" says where a path needs a stated, wider floor and why; each such
floor is a named Tolerance here). `assert_matches_oracle` applies the right ones to an AttentionOutput.

Case generators, with the traps FlashMLA's tests set (and a few more), all drawn by normal_inputs:
  prefill_case: q, kv rows and absolute indices as FlashMLA's prefill tests build them (prefill, the
    vendor kernels and engine.h20_ops.flash_mla): fillers of every kind (PREFILL_FILLERS and s_kv) at
    random positions, NaN / +-inf in every kv row no valid entry selects (rows selected only past a
    row's length included), lengths 0, negative and past topk, all-invalid rows, duplicates, sinks of
    +-inf, strided q / kv / indices views;
  decode_case: the caches the decode entry point takes (dense rows, or paged fp8 MODEL1 / V3.2 with
    their own page sizes and block strides padded beyond the block), flat slot ids with fillers of
    every kind, NaN in every cache slot no valid entry selects (poison_unselected: NaN e4m3 codes and
    NaN bf16 RoPE in fp8 caches), lengths down to 0 (all-invalid rows), sinks of +-inf, a strided q;
  flashmla_decode_case: a decode case as FlashMLA's sparse decode tests build it (per-request pages of
    paged fp8 caches), for engine.h20_ops.flash_mla and the FlashMLA side-by-side benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kv_cache
from .attention.decode import DecodePlan, plan_sparse_decode, sparse_mla_decode
from .attention.output import AttentionOutput
from .attention.reference import RefResult, sparse_mla_decode_ref, sparse_mla_prefill_ref

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Tolerance:
    abs: float
    rel: float
    cos: float | None = None


PREFILL_OUT = Tolerance(8e-4, 3.01 / 128, 7e-6)
PREFILL_STATS = Tolerance(1e-6, 2.01 / 65536)  # lse and max_logits
DECODE_OUT = Tolerance(1e-3, 2.01 / 128, 5e-6)
DECODE_LSE = Tolerance(1e-6, 8.01 / 65536)
EXACT_FP32 = Tolerance(2e-5, 0.0, 1e-10)  # float32 kernels against the float32 oracle
# float32 arithmetic on values of any magnitude against a float64 computation of the same formula (the
# split merge's lse reaches |2e4|, where one fp32 ulp is 2^-9): EXACT_FP32, or a few fp32 ulps relative.
FP32_RELATIVE = Tolerance(EXACT_FP32.abs, 2.0**-20, EXACT_FP32.cos)
# Unit-variance q / kv (normal_inputs(scale=1.0)): a peaked softmax and outputs ~10x FlashMLA's, where P's
# bf16 rounding before P.V (on a GPU) shows in the absolute error; the relative and cosine bounds stay.
PREFILL_OUT_UNIT_VARIANCE = Tolerance(4e-3, PREFILL_OUT.rel, PREFILL_OUT.cos)
# Triton's interpreter truncates fp32 -> bf16 casts instead of rounding them: twice the rounding error of
# a GPU, which the cosine bound of bf16 outputs must allow for (per element abs / rel bounds still hold).
INTERPRETER_BF16_COS = 1.5e-5


def out_tolerance(tol: Tolerance, out: torch.Tensor, *, split: bool = False) -> Tolerance:
    """tol for an output tensor `out`: bf16 outputs computed by Triton's interpreter (CPU tensors) get
    the cosine bound INTERPRETER_BF16_COS; a split decode (bf16 partials merged: one more bf16 rounding of
    every partial, attention/decode.py's stated deviation) twice the cosine bound."""
    if out.dtype != torch.bfloat16 or tol.cos is None:
        return tol
    cos = max(tol.cos, INTERPRETER_BF16_COS) if not out.is_cuda else tol.cos
    return Tolerance(tol.abs, tol.rel, 2 * cos if split else cos)


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: Tolerance, *,
                 floor: torch.Tensor | None = None) -> None:
    """The comparator (module header); raises AssertionError naming `name` and the worst element.
    floor: a stated per-element rounding bound (shaped like ref, e.g. split_rounding_floor) added to
    tol.abs; the cosine bound becomes at least sum(floor^2) / sum(g^2 + r^2)."""
    got, ref = got.double(), ref.double().to(got.device)
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    for kind, fn in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        mismatch = fn(got) != fn(ref)
        assert not mismatch.any(), f"{name}: {kind} positions differ at {mismatch.nonzero()[:5].tolist()}"
    finite = torch.isfinite(ref)
    g, r = got[finite], ref[finite]
    err = (g - r).abs()
    extra = 0.0 if floor is None else floor.double().to(got.device).expand_as(ref)[finite]
    bad = (err >= tol.abs + extra) & (err / (r.abs() + 1e-6) >= tol.rel)
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {g.numel()} elements out of tolerance (abs {tol.abs}"
                           f"{'' if floor is None else ' + the stated floor'} or rel {tol.rel:.3g}); worst abs err "
                           f"{err.max().item():.3g}")
    if tol.cos is not None and g.numel():
        denom = (g * g + r * r).sum()
        cos_dist = (1 - 2 * (g * r).sum() / denom).item() if denom > 0 else 0.0
        cos_tol = tol.cos if floor is None or denom == 0 else max(tol.cos, ((extra ** 2).sum() / denom).item())
        assert cos_dist <= cos_tol, f"{name}: cosine distance {cos_dist:.3g} > {cos_tol:.3g}"


def assert_matches_oracle(got: AttentionOutput, ref: RefResult, *, decode: bool, split: bool = False,
                          floor: torch.Tensor | None = None, name: str = "") -> None:
    """An entry point's AttentionOutput (out, lse base 2) against the oracle's RefResult (natural lse):
    float32 outputs to EXACT_FP32, others to FlashMLA's decode or prefill tolerances (out_tolerance:
    the interpreter's and a split's stated floors); floor: out's per-element rounding bound
    (split_rounding_floor for a split decode)."""
    prefix = f"{name} " if name else ""
    if got.out.dtype == torch.float32:
        out_tol = lse_tol = EXACT_FP32
    else:
        out_tol = out_tolerance(DECODE_OUT if decode else PREFILL_OUT, got.out, split=split)
        lse_tol = DECODE_LSE if decode else PREFILL_STATS
    assert_close(f"{prefix}out", got.out, ref.out, out_tol, floor=floor)
    assert_close(f"{prefix}lse_log2", got.lse_log2, ref.lse * LOG2E, lse_tol)


def normal_inputs(gen: torch.Generator, *shape: int, scale: float = 0.1, device="cpu") -> torch.Tensor:
    """scale * N(0, 1) + one random offset in +-scale/2: FlashMLA's test distribution (float32), drawn on
    the generator's device and moved to `device`."""
    offset = (torch.rand((), generator=gen, device=gen.device) - 0.5) * scale
    return (torch.randn(*shape, generator=gen, device=gen.device) * scale + offset).to(device)


def random_indices(gen: torch.Generator, rows: int, n_slots: int, topk: int, n_valid: int,
                   fillers: tuple[int, ...] = (-1,), distinct: bool = True) -> torch.Tensor:
    """[rows, topk] int32: per row n_valid (<= n_slots if distinct) valid entries at random positions of
    the list, the other positions a random choice of `fillers`."""
    idx = torch.tensor(fillers, dtype=torch.int64)[torch.randint(len(fillers), (rows, topk), generator=gen)]
    for row in range(rows):
        positions = torch.randperm(topk, generator=gen)[:n_valid]
        values = (torch.randperm(n_slots, generator=gen)[:n_valid] if distinct
                  else torch.randint(n_slots, (positions.numel(),), generator=gen))
        idx[row, positions[: values.numel()]] = values
    return idx.to(torch.int32)


def fillers_for(n_slots: int) -> tuple[int, ...]:
    """Every kind of invalid entry: -1, INT_MIN, one past the last slot, INT_MAX."""
    return (-1, INT32_MIN, n_slots, INT32_MAX)


def sinks(gen: torch.Generator, h_q: int) -> torch.Tensor:
    """[h_q] fp32: about a third +inf, a third -inf, the rest finite."""
    s = torch.randn(h_q, generator=gen)
    pick = torch.randint(3, (h_q,), generator=gen)
    s[pick == 0] = float("inf")
    s[pick == 1] = float("-inf")
    return s


# ---------------------------------------------------------------------------------------------
# prefill cases
# ---------------------------------------------------------------------------------------------

# FlashMLA's prefill fillers: every one is invalid (out of [0, s_kv) or negative); s_kv is added per case
PREFILL_FILLERS = (INT32_MIN, -123456, -1, 114514, 1919810, 2147480000, INT32_MAX)
PREFILL_SM_SCALE = 0.5  # FlashMLA's prefill tests


def _strided_view(t: torch.Tensor, pad: int = 64) -> torch.Tensor:
    """t as a view of a wider buffer on t's device (last dim padded by `pad`): equal values, rows strided.
    With pad a multiple of 16 elements the row strides stay 16-byte aligned (the Gluon kernel takes them)."""
    wide = torch.zeros((*t.shape[:-1], t.size(-1) + pad), dtype=t.dtype, device=t.device)
    wide[..., :t.size(-1)] = t
    return wide[..., :t.size(-1)]


@dataclass
class PrefillCase:
    q: torch.Tensor  # [s_q, h_q, d_qk] (non-contiguous when asked)
    kv: torch.Tensor  # [s_kv, 1, d_qk]; NaN / +-inf in every row no valid entry selects, when poisoned
    indices: torch.Tensor  # [s_q, 1, topk] int32 absolute rows of kv
    topk_length: torch.Tensor | None  # [s_q] int32
    attn_sink: torch.Tensor | None  # [h_q] fp32
    sm_scale: float

    def kwargs(self) -> dict:
        """attn_sink and topk_length: keyword arguments of sparse_mla_prefill (and the kernels)."""
        return dict(attn_sink=self.attn_sink, topk_length=self.topk_length)

    def oracle(self) -> RefResult:
        """RefResult(out [s_q, h_q, 512], max_logits, lse natural) of the float32 oracle on the same inputs."""
        return sparse_mla_prefill_ref(self.q.float(), self.kv.float(), self.indices, self.sm_scale, **self.kwargs())


def poison_rows(kv: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of kv [s_kv, 1, d] with NaN (every third +inf, every third -inf) in each row that no valid
    entry of indices [s_q, (1,) topk] (position < topk_length[i] where given) selects."""
    s_kv = kv.size(0)
    idx = indices.reshape(indices.size(0), -1).to(kv.device).long()
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= torch.arange(idx.size(1), device=kv.device)[None, :] < topk_length.to(kv.device).long()[:, None]
    selected = torch.zeros(s_kv, dtype=torch.bool, device=kv.device)
    selected[idx[valid]] = True
    unselected = (~selected).nonzero().flatten()
    kv = kv.clone()
    kv[unselected] = float("nan")
    kv[unselected[::3]] = float("inf")
    kv[unselected[1::3]] = float("-inf")
    return kv


def prefill_case(seed: int, *, s_q: int, s_kv: int, h_q: int, topk: int, d_qk: int = 512, n_valid: int | None = None,
                 distinct: bool = True, topk_length: bool = False, sink: bool = False, all_invalid: bool = False,
                 poison: bool = True, strided: bool = True, dtype=torch.bfloat16, device="cpu") -> PrefillCase:
    """A prefill case as FlashMLA's prefill tests build it: per row n_valid (default min(topk, s_kv))
    random rows of kv (distinct: without repetition, else duplicates count per occurrence) at random
    positions of the list, the other positions fillers from PREFILL_FILLERS and s_kv (topk > s_kv: "OOB
    top-k"); sinks with +-inf; q, kv and indices views of wider buffers (strided); sm_scale
    PREFILL_SM_SCALE. Beyond FlashMLA's: topk_length random in [0, topk] with row 0 at 0, row 1 negative
    (from 3 rows on) and the last row past topk (from 4 rows on); every kv row no valid entry selects
    poisoned (poison_rows); with all_invalid every third row all fillers (row 0 included). Drawn on
    `device` (large GPU cases)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = normal_inputs(gen, s_q, h_q, d_qk, device=device).to(dtype)
    kv = normal_inputs(gen, s_kv, 1, d_qk, device=device).to(dtype)
    n_valid = min(topk, s_kv if n_valid is None else n_valid)
    if distinct:
        n_valid = min(n_valid, s_kv)
        picks = torch.rand((s_q, s_kv), generator=gen, device=device).topk(n_valid, dim=1).indices
    else:
        picks = torch.randint(s_kv, (s_q, n_valid), generator=gen, device=device)
    fillers = torch.tensor((*PREFILL_FILLERS, s_kv), dtype=torch.int32, device=device)
    idx = fillers[torch.randint(len(fillers), (s_q, topk), generator=gen, device=device)]
    order = torch.rand((s_q, topk), generator=gen, device=device).argsort(dim=1)[:, :n_valid]
    idx.scatter_(1, order, picks.to(torch.int32))
    if all_invalid:
        idx[::3] = fillers[torch.randint(len(fillers), (1,), generator=gen, device=device)]
    lengths = None
    if topk_length:
        lengths = torch.randint(0, topk + 1, (s_q,), generator=gen, device=device, dtype=torch.int32)
        lengths[0] = 0
        if s_q > 2:
            lengths[1] = -255  # negative: empty too (such lengths once hung a kernel)
        if s_q > 3:
            lengths[-1] = topk + 5
    if poison:
        kv = poison_rows(kv, idx, lengths)
    attn_sink = sinks(torch.Generator().manual_seed(seed), h_q).to(device) if sink else None
    indices = idx.view(s_q, 1, topk)
    if strided:
        q, kv, indices = _strided_view(q), _strided_view(kv), _strided_view(indices, pad=16)
    return PrefillCase(q, kv, indices, lengths, attn_sink, PREFILL_SM_SCALE)


# ---------------------------------------------------------------------------------------------
# decode cases
# ---------------------------------------------------------------------------------------------

@dataclass
class DecodeCache:
    """One decode cache: what the entry point takes, and its rows dequantized for the oracle."""

    cache: torch.Tensor  # dense [n_slots, 1, d] or paged fp8 [num_blocks, block_size, 1, bytes]
    rows: torch.Tensor  # [n_slots, 1, d] float32: what slot s holds (NaN where poisoned)
    n_slots: int


def decode_cache(gen: torch.Generator, n_slots_min: int, d: int, *, layout=None, block_size: int = 64,
                 dtype=torch.bfloat16, device="cpu", block_pad: int = 0) -> DecodeCache:
    """A cache of at least n_slots_min slots with random rows: dense rows in `dtype` (layout None) or a
    paged fp8 cache in `layout` (kv_cache.MODEL1 / V32) of `block_size`-token pages whose block stride is
    padded by block_pad * 16 bytes (a view into a larger buffer, as an engine's pool can be)."""
    if layout is None:
        rows = normal_inputs(gen, n_slots_min, 1, d).to(dtype)
        return DecodeCache(rows.to(device), rows.float(), n_slots_min)
    num_blocks = -(-n_slots_min // block_size)
    base = kv_cache.new_fp8_kv_cache(layout, num_blocks, block_size, "cpu")
    if block_pad:
        stride = base.stride(0) + 16 * block_pad
        buf = torch.zeros(num_blocks * stride, dtype=torch.uint8)
        base = torch.as_strided(buf, base.shape, (stride, *base.stride()[1:]))
    n_slots = num_blocks * block_size
    values = normal_inputs(gen, n_slots, 1, layout.d)
    kv_cache.quantize_into_cache_ref(base, torch.arange(n_slots), values)
    rows = kv_cache.dequantize_from_cache_ref(base, torch.arange(n_slots), torch.float32)
    if device != "cpu" and block_pad:  # move the backing buffer, then view: .to() of a view packs it densely
        moved = buf.to(device)
        cache = torch.as_strided(moved, base.shape, base.stride())
    else:  # copy into a cache allocated there: .to() of a view over padded blocks would pack it densely
        cache = kv_cache.new_fp8_kv_cache(layout, num_blocks, block_size, device)
        cache.copy_(base)
    return DecodeCache(cache, rows, n_slots)


def poison_unselected(cache: DecodeCache, indices: torch.Tensor, lengths: torch.Tensor | None) -> None:
    """NaN in every slot of `cache` that no valid entry of indices [B, s_q, topk] (with lengths [B]) selects,
    on the cache's device: NaN rows in a dense cache; in a paged fp8 cache e4m3 NaN codes (0x7f), NaN bf16
    RoPE words and NaN / inf scales (and a garbage pad byte after every MODEL1 token's scales, which no
    reader may take for a scale); NaN rows in `rows` (where kept)."""
    b, s_q, topk = indices.shape
    c = cache.cache
    idx = indices.to(c.device).long()
    valid = (idx >= 0) & (idx < cache.n_slots)
    if lengths is not None:
        valid &= torch.arange(topk, device=c.device)[None, None, :] < lengths.to(c.device).long()[:, None, None]
    selected = torch.zeros(cache.n_slots, dtype=torch.bool, device=c.device)
    selected[idx[valid]] = True
    if cache.rows is not None:
        cache.rows[~selected.to(cache.rows.device)] = float("nan")
    if c.dtype not in (torch.uint8, torch.float8_e4m3fn):
        c[~selected] = float("nan")
        return
    layout = kv_cache.layout_of(c)
    num_blocks, block_size = c.shape[:2]
    raw = torch.as_strided(c.view(torch.uint8), (num_blocks, block_size * layout.bytes_per_token), (c.stride(0), 1))
    unselected = ~selected.view(num_blocks, block_size)
    if layout is kv_cache.MODEL1:  # per token [448 e4m3 | 64 bf16 RoPE] at t * 576, then 8 B per token at
        tokens = raw[:, :block_size * 576].view(num_blocks, block_size, 576)  # bs * 576 + t * 8: 7 ue8m0
        nope, rope = tokens[:, :, :layout.d_nope], tokens[:, :, layout.d_nope:]  # scales, 1 pad byte
        scales = raw[:, block_size * 576:block_size * 584].view(num_blocks, block_size, 8)
        scales[unselected] = 0xFF  # ue8m0 0xFF: NaN (the pad byte too)
        scales[:, :, 7] = 0xFF  # the pad byte of every token, selected ones included: never a scale
    else:  # per token [512 e4m3 | 4 fp32 scales | 64 bf16 RoPE] at t * 656
        tokens = raw.view(num_blocks, block_size, layout.bytes_per_token)
        nope, rope = tokens[:, :, :layout.d_nope], tokens[:, :, layout.d_nope + 4 * layout.num_tiles:]
        bad_scales = torch.tensor([float("nan"), float("inf"), 1.0, float("nan")], device=c.device)
        tokens[:, :, layout.d_nope:layout.d_nope + 4 * layout.num_tiles][unselected] = bad_scales.view(torch.uint8)
    nope[unselected] = 0x7F  # e4m3 NaN
    rope[unselected] = 0xFF  # bf16 0xFFFF: NaN


@dataclass
class DecodeCase:
    q: torch.Tensor  # [B, s_q, h_q, d] (non-contiguous when asked)
    main: DecodeCache
    indices: torch.Tensor  # [B, s_q, topk] int32 slot ids
    topk_length: torch.Tensor | None  # [B] int32
    extra: DecodeCache | None
    extra_indices: torch.Tensor | None
    extra_topk_length: torch.Tensor | None
    attn_sink: torch.Tensor | None
    sm_scale: float

    def kwargs(self) -> dict:
        """Keyword arguments of engine.h20_ops.sparse_mla_decode besides q, cache, indices, sm_scale."""
        return dict(attn_sink=self.attn_sink, topk_length=self.topk_length,
                    extra_cache=None if self.extra is None else self.extra.cache, extra_indices=self.extra_indices,
                    extra_topk_length=self.extra_topk_length)

    def plan(self, num_splits: int | None = None, backend: str | None = None) -> DecodePlan:
        """plan_sparse_decode for this case's shapes and caches."""
        b, s_q, h_q, _ = self.q.shape
        return plan_sparse_decode(self.main.cache, batch=b, s_q=s_q, h_q=h_q, topk=self.indices.size(2),
                                  q_dtype=self.q.dtype, extra_cache=None if self.extra is None else self.extra.cache,
                                  extra_topk=0 if self.extra is None else self.extra_indices.size(2),
                                  num_splits=num_splits, backend=backend)

    def run(self, plan: DecodePlan | None = None) -> AttentionOutput:
        """sparse_mla_decode on this case."""
        return sparse_mla_decode(self.q, self.main.cache, self.indices, self.sm_scale, plan=plan, **self.kwargs())

    def oracle(self) -> RefResult:
        """The float32 reference on the same rows: RefResult(out [B, s_q, h_q, 512], max_logits, lse natural)."""
        to = self.q.device
        return sparse_mla_decode_ref(
            self.q.float(), self.main.rows.to(to), self.indices, self.sm_scale, attn_sink=self.attn_sink,
            topk_length=self.topk_length, extra_kv=None if self.extra is None else self.extra.rows.to(to),
            extra_indices=self.extra_indices, extra_topk_length=self.extra_topk_length)


def decode_case(seed: int, *, batch: int, s_q: int, h_q: int, topk: int, extra_topk: int = 0, d: int = 512,
                layout=None, block_sizes: tuple[int, int] = (64, 64), dtype=torch.bfloat16, device="cpu",
                n_slots: tuple[int, int] | None = None, valid_frac: float = 0.8, lengths: bool = True,
                sink: bool = True, poison: bool = True, strided_q: bool = True, block_pad: int = 0) -> DecodeCase:
    """A random decode case with FlashMLA's traps (module header). layout: None (dense rows in `dtype`) or
    kv_cache.MODEL1 / V32 (then d is the layout's); block_sizes: the two caches' page sizes; n_slots: the
    caches' minimum slot counts (default 2 * topk + 7 and 2 * extra_topk + 5)."""
    gen = torch.Generator().manual_seed(seed)
    if layout is not None:
        d = layout.d
    n_main, n_extra = n_slots or (2 * topk + 7, 2 * extra_topk + 5)
    main = decode_cache(gen, n_main, d, layout=layout, block_size=block_sizes[0], dtype=dtype, device=device,
                        block_pad=block_pad)

    def lists(cache: DecodeCache, k: int):
        n_valid = max(1, int(k * valid_frac))
        idx = random_indices(gen, batch * s_q, cache.n_slots, k, min(n_valid, cache.n_slots),
                             fillers_for(cache.n_slots)).view(batch, s_q, k)
        lens = None
        if lengths:
            lens = torch.randint(0, k + 1, (batch,), generator=gen, dtype=torch.int32)
            lens[0] = 0  # an empty main list
            lens[-1] = k
        return idx, lens

    indices, topk_length = lists(main, topk)
    extra = extra_indices = extra_topk_length = None
    if extra_topk:
        extra = decode_cache(gen, n_extra, d, layout=layout, block_size=block_sizes[1], dtype=dtype, device=device,
                             block_pad=block_pad)
        extra_indices, extra_topk_length = lists(extra, extra_topk)
        if extra_topk_length is not None:
            extra_topk_length[0] = 0  # request 0: no valid entry at all
    if poison:
        poison_unselected(main, indices, topk_length)
        if extra is not None:
            poison_unselected(extra, extra_indices, extra_topk_length)
    q = normal_inputs(gen, batch, s_q, h_q, d).to(dtype)
    if strided_q:  # heads of a wider buffer: q's rows are not contiguous
        wide = torch.zeros(batch, s_q, h_q, d + 64, dtype=dtype)
        wide[..., :d] = q
        q = wide.to(device)[..., :d]
    else:
        q = q.to(device)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return DecodeCase(q, main, to(indices), to(topk_length), extra, to(extra_indices), to(extra_topk_length),
                      to(sinks(gen, h_q)) if sink else None, d ** -0.5)


def split_rounding_floor(case: DecodeCase, plan: DecodePlan) -> torch.Tensor:
    """The per-element bound a split decode adds to its output's error (docs/contract.md "Tolerances"): its
    partial outputs come back in q's dtype, one more rounding each, so |err| <= eps * (sum_c w_c |o_c| + |o|)
    beyond the unsplit result (eps: the dtype's ulp at 1, which also covers the interpreter's truncating
    casts), with partials o_c, weights w_c = softmax_c(lse_c) and o = sum_c w_c o_c from the oracle on the
    plan's very chunks (each query's main then extra entries, cut every plan.chunk). [B, s_q, h_q, 512]."""
    b, s_q, h_q, d = case.q.shape
    n = b * s_q
    device = case.q.device

    def masked(cache, indices, lengths, offset):
        idx = indices.reshape(n, -1).to(device).long()
        valid = (idx >= 0) & (idx < cache.n_slots)
        if lengths is not None:
            valid &= torch.arange(idx.size(1), device=device)[None, :] < lengths.to(device).repeat_interleave(s_q)[:, None]
        return torch.where(valid, idx + offset, -1)

    lists = [masked(case.main, case.indices, case.topk_length, 0)]
    rows = [case.main.rows.to(device)]
    if case.extra is not None:
        lists.append(masked(case.extra, case.extra_indices, case.extra_topk_length, case.main.n_slots))
        rows.append(case.extra.rows.to(device))
    entries = torch.cat(lists, dim=1)
    entries = torch.cat([entries, entries.new_full((n, plan.list_len - entries.size(1)), -1)], dim=1)
    chunks = entries.view(n * plan.splits, plan.chunk).to(torch.int32)
    q_rows = case.q.reshape(n, h_q, d).float().repeat_interleave(plan.splits, dim=0)
    part = sparse_mla_prefill_ref(q_rows, torch.cat(rows), chunks, case.sm_scale)
    lse = part.lse.view(n, plan.splits, h_q).double()
    weights = torch.softmax(lse.masked_fill(lse == float("inf"), float("-inf")), dim=1).nan_to_num(0.0)
    parts = part.out.double().view(n, plan.splits, h_q, -1)
    mixed = (weights[..., None] * parts.abs()).sum(1) + (weights[..., None] * parts).sum(1).abs()
    return (torch.finfo(case.q.dtype).eps * mixed).view(b, s_q, h_q, -1)


# ---------------------------------------------------------------------------------------------
# FlashMLA's published decode test cases (tests/test_flash_mla_sparse_*.py semantics), for
# engine.h20_ops.flash_mla
# ---------------------------------------------------------------------------------------------

DECODE_SM_SCALE_POWER = -0.55  # FlashMLA's decode tests: sm_scale = d_qk ** -0.55


def _paged_scope(gen: torch.Generator, *, batch: int, s_q: int, s_kv: int, topk: int, block_size: int, layout,
                 varlen: bool, zero_seqlen: bool, all_invalid: bool, lengths: bool, fillers: bool, oracle_rows: bool,
                 device):
    """One cache of a FlashMLA decode case: each request's s_kv tokens (varlen: max(N(s_kv, s_kv / 2), s_q);
    zero_seqlen: about half the requests 0) on randomly placed pages of `block_size` tokens, per query
    row min(topk, seqlen) distinct random tokens of its request as flat slot ids (block * block_size +
    offset) at random positions of the list, the others invalid (-1, or with fillers every kind:
    fillers_for); lengths: topk_length random in [0, topk]. -> (DecodeCache, indices, topk_length)."""
    seqlens = torch.full((batch,), s_kv, dtype=torch.int64, device=device)
    if varlen:
        seqlens = (torch.randn(batch, generator=gen, device=device) * (s_kv / 2) + s_kv).long().clamp(min=s_q)
    if zero_seqlen:
        seqlens[torch.rand(batch, generator=gen, device=device) < 0.5] = 0
    align = 4 * block_size
    pages = max(-(-int(seqlens.max()) // align), 1) * align // block_size
    num_blocks = batch * pages
    block_table = torch.randperm(num_blocks, generator=gen, device=device).view(batch, pages)
    cache = kv_cache.new_fp8_kv_cache(layout, num_blocks, block_size, device)
    n_slots = num_blocks * block_size
    quantize = kv_cache.quantize_into_cache if cache.is_cuda else kv_cache.quantize_into_cache_ref
    # slots in chunks of 2^20: one call over a big cache would stage several float32 copies of all of it
    chunks = torch.arange(n_slots, device=device).split(1 << 20)
    for chunk in chunks:
        quantize(cache, chunk, normal_inputs(gen, chunk.numel(), 1, layout.d, device=device))
    rows = None
    if oracle_rows:
        rows = torch.empty((n_slots, 1, layout.d), dtype=torch.float32, device=device)
        for chunk in chunks:
            rows[chunk] = kv_cache.dequantize_from_cache_ref(cache, chunk, torch.float32)

    n_rows, width = batch * s_q, pages * block_size
    row_lens = seqlens.repeat_interleave(s_q)
    keys = torch.rand((n_rows, width), generator=gen, device=device)
    keys[torch.arange(width, device=device)[None, :] >= row_lens[:, None]] = -1.0  # tokens past seqlen last
    pos = keys.topk(min(topk, width), dim=1).indices
    if topk > width:
        pos = torch.cat([pos, torch.full((n_rows, topk - width), width, device=device, dtype=pos.dtype)], dim=1)
    valid = pos < row_lens[:, None]
    request = torch.arange(batch, device=device).repeat_interleave(s_q)[:, None]
    page = block_table[request, (pos // block_size).clamp(max=pages - 1)]
    slots = (page * block_size + pos % block_size).to(torch.int32)
    invalid = torch.full_like(slots, -1)
    if fillers:
        choice = torch.tensor(fillers_for(n_slots), dtype=torch.int32, device=device)
        invalid = choice[torch.randint(len(choice), slots.shape, generator=gen, device=device)]
    if all_invalid:
        valid = torch.zeros_like(valid)
    slots = torch.where(valid, slots, invalid)
    slots = slots.gather(1, torch.rand(slots.shape, generator=gen, device=device).argsort(dim=1))  # shuffle
    indices = slots.view(batch, s_q, topk)
    topk_length = torch.randint(0, topk + 1, (batch,), generator=gen, device=device,
                                dtype=torch.int32) if lengths else None
    return DecodeCache(cache, rows, n_slots), indices, topk_length


def flashmla_decode_case(seed: int, *, batch: int, s_q: int, h_q: int, layout, topk: int, s_kv: int,
                         block_size: int, extra: tuple[int, int, int] | None = None, varlen: bool = True,
                         topk_length: bool = False, extra_topk_length: bool = False, all_invalid: bool = False,
                         zero_seqlen: bool = False, sink: bool = True, fillers: bool = False, strided_q: bool = True,
                         oracle_rows: bool = True, device="cpu") -> DecodeCase:
    """A decode case as FlashMLA's sparse decode tests build it (see _paged_scope), over paged fp8 caches
    of `layout` (kv_cache.MODEL1 / V32): the main cache (topk, s_kv, block_size) and optionally an extra
    one (extra = (extra_topk, extra_s_kv, extra_block_size)); NaN bytes in every slot no valid entry
    selects; q 0.1 N(0, 1) (+ offset) as a view of a wider buffer; sinks with +-inf; sm_scale
    d_qk ** -0.55. The result's kwargs() / oracle() serve sparse_mla_decode; flashmla_decode_kwargs()
    the FlashMLA call. oracle_rows=False: no dequantized rows (benchmarks; no oracle())."""
    gen = torch.Generator(device=device).manual_seed(seed)
    common = dict(batch=batch, s_q=s_q, layout=layout, varlen=varlen, zero_seqlen=zero_seqlen,
                  all_invalid=all_invalid, fillers=fillers, oracle_rows=oracle_rows, device=device)
    main, indices, lengths = _paged_scope(gen, s_kv=s_kv, topk=topk, block_size=block_size, lengths=topk_length,
                                          **common)
    poison_unselected(main, indices, lengths)
    extra_cache = extra_indices = extra_lengths = None
    if extra is not None:
        extra_topk, extra_s_kv, extra_block_size = extra
        extra_cache, extra_indices, extra_lengths = _paged_scope(gen, s_kv=extra_s_kv, topk=extra_topk,
                                                                 block_size=extra_block_size,
                                                                 lengths=extra_topk_length, **common)
        poison_unselected(extra_cache, extra_indices, extra_lengths)
    elif extra_topk_length:
        raise ValueError("extra_topk_length: needs an extra cache (extra=...)")
    q = normal_inputs(gen, batch, s_q, h_q, layout.d, device=device).to(torch.bfloat16)
    if strided_q:
        q = _strided_view(q)
    attn_sink = sinks(torch.Generator().manual_seed(seed), h_q).to(device) if sink else None
    return DecodeCase(q, main, indices, lengths, extra_cache, extra_indices, extra_lengths, attn_sink,
                      layout.d ** DECODE_SM_SCALE_POWER)


def flashmla_decode_kwargs(case: DecodeCase) -> dict:
    """Keyword arguments of FlashMLA's flash_mla_with_kvcache for `case` besides q, k_cache, block_table,
    cache_seqlens, head_dim_v and tile_scheduler_metadata."""
    return dict(softmax_scale=case.sm_scale, causal=False, is_fp8_kvcache=True, indices=case.indices,
                attn_sink=case.attn_sink, extra_k_cache=None if case.extra is None else case.extra.cache,
                extra_indices_in_kvcache=case.extra_indices, topk_length=case.topk_length,
                extra_topk_length=case.extra_topk_length)
