"""The one comparator and the one case generator every kernel test and A/B script uses.

Comparator (FlashMLA's rule): an element passes if |got - ref| < abs OR |got - ref| / (|ref| + 1e-6) <
rel; +inf, -inf and NaN positions must match exactly; the cosine distance 1 - 2 sum(g r) / sum(g^2 + r^2)
over the finite elements (float64) must not exceed `cos`. Tolerances below are FlashMLA's, made for its
input distribution 0.1 * N(0, 1) (+ an offset), which `normal_inputs` draws; every backend is held to
them (docs/contract.md "Tolerances" says where a path needs a stated, wider floor and why; each such
floor is a named Tolerance here). `assert_matches_oracle` applies the right ones to an AttentionOutput.

Case generators, with the traps FlashMLA's tests set:
  prefill_case: q, kv rows and absolute indices (prefill and the vendor kernels' contract): invalid
    fillers (-1, INT_MIN, s_kv, INT_MAX), NaN / +-inf in every kv row no valid entry selects (rows
    selected only past a row's length included), lengths 0, negative and past topk, sinks of +-inf,
    strided q / kv / indices views;
  decode_case: the caches the decode entry point takes (dense rows, or paged fp8 MODEL1 / V3.2 with
    their own page sizes and block strides padded beyond the block), flat slot ids with the fillers
    above, NaN in every cache slot no valid entry selects (NaN e4m3 codes and NaN bf16 RoPE in fp8
    caches), lengths down to 0 (all-invalid rows), sinks of +-inf, a non-contiguous q.
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


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> None:
    """The comparator (module header); raises AssertionError naming `name` and the worst element."""
    got, ref = got.double(), ref.double().to(got.device)
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    for kind, fn in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        mismatch = fn(got) != fn(ref)
        assert not mismatch.any(), f"{name}: {kind} positions differ at {mismatch.nonzero()[:5].tolist()}"
    finite = torch.isfinite(ref)
    g, r = got[finite], ref[finite]
    err = (g - r).abs()
    bad = (err >= tol.abs) & (err / (r.abs() + 1e-6) >= tol.rel)
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {g.numel()} elements out of tolerance (abs {tol.abs} or "
                           f"rel {tol.rel:.3g}); worst abs err {err.max().item():.3g}")
    if tol.cos is not None and g.numel():
        denom = (g * g + r * r).sum()
        cos_dist = (1 - 2 * (g * r).sum() / denom).item() if denom > 0 else 0.0
        assert cos_dist <= tol.cos, f"{name}: cosine distance {cos_dist:.3g} > {tol.cos}"


def assert_matches_oracle(got: AttentionOutput, ref: RefResult, *, decode: bool, split: bool = False,
                          name: str = "") -> None:
    """An entry point's AttentionOutput (out, lse base 2) against the oracle's RefResult (natural lse):
    float32 outputs to EXACT_FP32, others to FlashMLA's decode or prefill tolerances (out_tolerance:
    the interpreter's and a split's stated floors)."""
    prefix = f"{name} " if name else ""
    if got.out.dtype == torch.float32:
        out_tol = lse_tol = EXACT_FP32
    else:
        out_tol = out_tolerance(DECODE_OUT if decode else PREFILL_OUT, got.out, split=split)
        lse_tol = DECODE_LSE if decode else PREFILL_STATS
    assert_close(f"{prefix}out", got.out, ref.out, out_tol)
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


def _length_traps(gen: torch.Generator, rows: int, topk: int) -> torch.Tensor:
    """[rows] int32 lengths in [0, topk], with row 0 empty (0), row 1 negative and the last past topk."""
    lengths = torch.randint(0, topk + 1, (rows,), generator=gen, dtype=torch.int32)
    lengths[0] = 0
    if rows > 2:
        lengths[1] = -255  # negative: empty too (such lengths once hung a kernel)
    if rows > 3:
        lengths[-1] = topk + 5
    return lengths


def _wide_view(t: torch.Tensor, pad: int, device) -> torch.Tensor:
    """t's values as a view of a wider buffer on `device` (last dim padded by `pad`): only the last dim
    stays contiguous (the view is made on the device: moving a view would pack it)."""
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] + pad, dtype=t.dtype)
    wide[..., :t.shape[-1]] = t
    return wide.to(device)[..., :t.shape[-1]]


@dataclass
class PrefillCase:
    q: torch.Tensor  # [s_q, h_q, d_qk]
    kv: torch.Tensor  # [s_kv, 1, d_qk] (NaN / +-inf in the rows no valid entry selects)
    indices: torch.Tensor  # [s_q, topk] int32 absolute rows of kv
    topk_length: torch.Tensor | None  # [s_q] int32
    attn_sink: torch.Tensor | None  # [h_q] fp32
    sm_scale: float

    def kwargs(self) -> dict:
        """attn_sink and topk_length: keyword arguments of sparse_mla_prefill (and the kernels)."""
        return dict(attn_sink=self.attn_sink, topk_length=self.topk_length)

    def oracle(self) -> RefResult:
        return sparse_mla_prefill_ref(self.q, self.kv, self.indices, self.sm_scale, **self.kwargs())


def poison_rows(kv: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of kv [s_kv, 1, d] with NaN (every third +inf, every third -inf) in each row that no valid
    entry of indices [s_q, (1,) topk] (position < topk_length[i] where given) selects."""
    s_kv = kv.size(0)
    idx = indices.reshape(indices.size(0), -1).cpu().long()
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= torch.arange(idx.size(1))[None, :] < topk_length.cpu().long()[:, None]
    selected = torch.zeros(s_kv, dtype=torch.bool)
    selected[idx[valid]] = True
    unselected = (~selected).nonzero().flatten().to(kv.device)
    kv = kv.clone()
    kv[unselected] = float("nan")
    kv[unselected[::3]] = float("inf")
    kv[unselected[1::3]] = float("-inf")
    return kv


def prefill_case(seed: int, *, s_q: int, h_q: int, d_qk: int, s_kv: int, topk: int, n_valid: int | None = None,
                 fillers: tuple[int, ...] | None = None, distinct: bool = True, dtype=torch.bfloat16, device="cpu",
                 lengths: bool = False, sink: bool = False, poison: bool = True, strided: bool = False,
                 scale: float = 0.1) -> PrefillCase:
    """A random prefill case with FlashMLA's traps (module header). n_valid valid entries per row (default
    topk * 0.8, at most s_kv when distinct) at random positions, the rest `fillers` (default all kinds:
    fillers_for(s_kv)); from 4 rows on, row 2 has no valid entry; lengths: _length_traps; strided: q, kv and indices are views of wider buffers
    (row strides stay multiples of 16 elements: the Gluon kernel still takes them); scale: of the
    normal inputs (0.1: FlashMLA's distribution, for which its tolerances are made)."""
    gen = torch.Generator().manual_seed(seed)
    if n_valid is None:
        n_valid = max(1, int(topk * 0.8))
    if distinct:
        n_valid = min(n_valid, s_kv)
    q = normal_inputs(gen, s_q, h_q, d_qk, scale=scale).to(dtype)
    kv = normal_inputs(gen, s_kv, 1, d_qk, scale=scale).to(dtype)
    fillers = fillers or fillers_for(s_kv)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid, fillers, distinct)
    if s_q >= 4:  # a row empty by its indices
        indices[2] = torch.tensor(fillers, dtype=torch.int32)[torch.arange(topk) % len(fillers)]
    topk_length = _length_traps(gen, s_q, topk) if lengths else None
    if poison:
        kv = poison_rows(kv, indices, topk_length)
    attn_sink = sinks(gen, h_q) if sink else None
    if strided:
        q, kv, indices = _wide_view(q, 64, device), _wide_view(kv, 64, device), _wide_view(indices, 16, device)
    else:
        q, kv, indices = q.to(device), kv.to(device), indices.to(device)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return PrefillCase(q, kv, indices, to(topk_length), to(attn_sink), d_qk ** -0.5)


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
    else:
        cache = base.to(device)
    return DecodeCache(cache, rows, n_slots)


def poison_unselected(cache: DecodeCache, indices: torch.Tensor, lengths: torch.Tensor | None) -> None:
    """NaN in every slot of `cache` that no valid entry of indices [B, s_q, topk] (with lengths [B]) selects:
    NaN bf16 rows in a dense cache; e4m3 NaN codes (0x7f) and NaN bf16 RoPE words in a paged fp8 cache."""
    b, s_q, topk = indices.shape
    idx = indices.cpu().long()
    valid = (idx >= 0) & (idx < cache.n_slots)
    if lengths is not None:
        valid &= torch.arange(topk)[None, None, :] < lengths.cpu().long()[:, None, None]
    selected = torch.zeros(cache.n_slots, dtype=torch.bool)
    selected[idx[valid]] = True
    unselected = (~selected).nonzero().flatten()
    cache.rows[unselected] = float("nan")
    c = cache.cache
    if c.dtype not in (torch.uint8, torch.float8_e4m3fn):
        c[unselected.to(c.device)] = float("nan")
        return
    layout = kv_cache.layout_of(c)
    block_size = c.size(1)
    raw = torch.as_strided(c.view(torch.uint8), (c.size(0), block_size * layout.bytes_per_token), (c.stride(0), 1))
    for slot in unselected.tolist():
        block, t = divmod(slot, block_size)
        if layout is kv_cache.MODEL1:  # [448 e4m3 | 64 bf16 RoPE] at t * 576
            start = t * 576
            raw[block, start: start + layout.d_nope] = 0x7F
            raw[block, start + layout.d_nope: start + 576] = 0xFF  # bf16 0xFFFF: NaN
        else:  # V3.2: [512 e4m3 | 4 fp32 scales | 64 bf16 RoPE] at t * 656
            start = t * layout.bytes_per_token
            raw[block, start: start + layout.d_nope] = 0x7F
            raw[block, start + layout.d_nope + 16: start + layout.bytes_per_token] = 0xFF


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
