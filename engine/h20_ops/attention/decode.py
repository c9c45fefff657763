"""Batched sparse MLA decode over paged caches: the public entry point and its plan.

`plan_sparse_decode` is made once per engine step and layer type (the dispatcher's path and kernel, the
split); `sparse_mla_decode` runs one layer's attention with it. Conventions are FlashMLA's decode ones:
entries are flat slot ids (block * block_size + offset) of a cache; a main cache and an optional extra
cache (its own page size) are attended in ONE softmax and the sink is applied once.

Paths (engine.h20_ops.attention.dispatch.decode_path chooses):
  paged_fp8  a kernel reads the paged fp8 caches itself: one list launch (attention/decode_lists.py: the
             extra cache's slot ids offset by the main cache's slot count), one kernel launch;
  gathered   both caches' rows (dequantized if fp8) are gathered into a buffer of topk + etopk rows per
             query row, then the prefill kernel attends over it: list launch, one gather per cache, kernel;
  direct     one dense cache: the prefill kernel reads it in place (no list launch without a split).
Flash-decoding split: when the rows leave enough SMs per program, each row's list is cut into `splits`
chunks of whole pairs of 64-entry blocks (the SM90 kernels' step) that run as splits x more rows of the
same launch (the list launch writes the repeated q rows); attention/merge.py combines the partials by
lse and applies the sink once.
out=: the caller's buffer is the output of the launch that writes the result (the merge with a split,
else the attention kernel); a kernel that allocates its own output (the paged fp8 TileLang kernel
today) is copied into it (dispatch.run_paged_fp8_kernel).
Numerics: the attention kernel's (bf16 operands, fp32 accumulation; P rounded to bf16 before P.V); merge
and sink in fp32. Deliberate deviation from FlashMLA's split-KV: partial outputs come back in q's dtype,
so a split result carries one more bf16 rounding of each partial (|err| <= 2^-9 * sum_i w_i |o_i|).
Everything here is capturable in a CUDA graph (no host syncs; a plan fixes every launch's shape).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .. import kv_cache
from ..checks import (SUPPORTED_HEADS, check_decode_cache, check_decode_list, check_out, check_sink, require_scale,
                      require_tensor)
from ..platform import sm_count
from . import dispatch
from .decode_lists import build_decode_lists
from .merge import merge_splits
from .output import AttentionOutput

D_V = 512
HEADS_PER_PROGRAM = 64  # the largest head tile of the kernels (h_q <= 64: one program per query row)
# The SM90 kernels walk a query's entries in pairs of 64-entry blocks, so split chunks are cut in
# whole pairs (a 64-entry chunk costs as much as a 128-entry one).
SPLIT_GRANULE = 128
# The automatic split engages when every program (query row, 64 heads) has at least this many SMs to
# itself, and cuts each list into the fewest chunks that reach the fewest pairs per chunk while all
# chunks fill at most SPLIT_MAX_SM_SHARE of the SMs (more items than that contend for the row loads and
# lose). Measured with CUDA graphs on an H200 (2026-11-30, docs/lab, 640 entries per query): the buffer
# path gains from 1 to 8 programs and at 16 breaks even (TileLang) or gains 1.11x (Triton); the paged
# fp8 kernel, whose single item takes longer, gains up to 32 programs and loses from 40 on.
SPLIT_SMS_PER_PROGRAM = {"paged_fp8": 4, "gathered": 8, "direct": 8}
SPLIT_MAX_SM_SHARE = 0.75
# Kernels whose programs share an SM (the Triton paged fp8 kernel's 16-head tiles: two per SM) count slots,
# SMs x programs per SM, instead: a split engages while every program has a slot, and its chunks fill at
# most all the slots (one wave; a second wave costs more than the split gains). H200, 2026-12-03, h_q 16,
# 640 entries, docs/lab/tp_heads.md: B 64 (128 rows) 2 chunks 0.060 ms vs 0.081 unsplit; B 74 with 2
# chunks (296 programs) 0.103; B 128 unsplit 0.099 vs 0.109 with 2.
LAYOUTS = (kv_cache.MODEL1, kv_cache.V32)


@dataclass(frozen=True)
class DecodePlan:
    """One decode launch sequence: its path and kernel (as the dispatcher chose), the split, and the shapes
    it was made for (sparse_mla_decode checks them)."""

    path: str  # "paged_fp8" | "gathered" | "direct"
    kernel: str  # the attention kernel (dispatch.KernelChoice.kernel after the path)
    splits: int
    chunk: int  # entries per chunk (splits * chunk >= topk + extra_topk)
    batch: int
    s_q: int
    h_q: int
    topk: int
    extra_topk: int
    fp8_layout: str | None  # the caches' fp8 layout name, None for dense rows
    backend: str

    @property
    def list_len(self) -> int:
        return self.splits * self.chunk


def plan_sparse_decode(cache: torch.Tensor, *, batch: int, s_q: int, h_q: int, topk: int, q_dtype: torch.dtype,
                       extra_cache: torch.Tensor | None = None, extra_topk: int = 0, num_splits: int | None = None,
                       backend: str | None = None) -> DecodePlan:
    """The plan of sparse_mla_decode calls with these shapes and caches (see sparse_mla_decode): made once
    per step and layer type, reused by every layer of that type. num_splits: chunks per query's list
    (None: chosen from the rows vs the SM count; 1: no split). backend: None for the process's. h_q: one of
    checks.SUPPORTED_HEADS (any with the ref backend); the tilelang backend's kernels take 64 or 128: under
    auto resolution another h_q runs the triton backend, backend='tilelang' refuses it."""
    for name, value in (("batch", batch), ("s_q", s_q), ("h_q", h_q), ("topk", topk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if isinstance(extra_topk, bool) or not isinstance(extra_topk, int) or extra_topk < 0:
        raise ValueError(f"extra_topk: expected an int >= 0, got {extra_topk!r}")
    if (extra_cache is None) != (extra_topk == 0):
        raise ValueError(f"extra_cache, extra_topk: pass both (extra_topk >= 1) or neither, got extra_topk "
                         f"{extra_topk} with extra_cache {'None' if extra_cache is None else 'given'}")
    requested = backend
    backend = require_heads("h_q", h_q, requested)  # the backend of decode_path's choice
    layout = _cache_kind("cache", cache)
    if extra_cache is not None:
        extra_layout = _cache_kind("extra_cache", extra_cache)
        if extra_layout is not layout:
            raise ValueError(f"extra_cache: expected the same kind of cache as cache ({_kind_name(layout)}), got "
                             f"{_kind_name(extra_layout)}")
    caches = [c for c in (cache, extra_cache) if c is not None]
    aligned16 = all(c.data_ptr() % 16 == 0 and (c.size(0) == 1 or c.stride(0) * c.element_size() % 16 == 0)
                    for c in caches)
    choice = dispatch.decode_path(q_dtype, cache.device, layout, extra_cache is not None, requested, h_q=h_q,
                                  caches_aligned16=aligned16)
    path, kernel = choice.kernel.split(": ")
    list_len = topk + extra_topk
    if num_splits is None:
        per_sm = _programs_per_sm(kernel, q_dtype, h_q, layout)
        splits = _choose_splits(batch * s_q, h_q, list_len, cache.device,
                                SPLIT_SMS_PER_PROGRAM[path] if per_sm == 1 else 1, per_sm)
    else:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int):
            raise TypeError(f"num_splits: expected an int or None, got {type(num_splits).__name__}")
        if num_splits < 1:
            raise ValueError(f"num_splits: expected >= 1, got {num_splits}")
        splits = num_splits
    return DecodePlan(path, kernel, splits, -(-list_len // splits), batch, s_q, h_q, topk, extra_topk,
                      None if layout is None else layout.name, backend)


def require_heads(name: str, h_q: int, backend: str | None) -> str:
    """The backend that runs h_q heads asked of `backend` (None: the process's; dispatch.backend_for_heads);
    an h_q outside checks.SUPPORTED_HEADS on a kernel backend is a ValueError naming `name`."""
    effective, _ = dispatch.backend_for_heads(backend, h_q, name)
    if effective != "ref" and h_q not in SUPPORTED_HEADS:
        raise ValueError(f"{name}: expected h_q in {SUPPORTED_HEADS} (the {effective} backend's kernels), got {h_q}")
    return effective


def sparse_mla_decode(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, sm_scale: float, *,
                      plan: DecodePlan | None = None, attn_sink: torch.Tensor | None = None,
                      topk_length: torch.Tensor | None = None, extra_cache: torch.Tensor | None = None,
                      extra_indices: torch.Tensor | None = None,
                      extra_topk_length: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      names: Mapping[str, str] | None = None) -> AttentionOutput:
    """Batched sparse decode over one or two caches, in one softmax.

    q [B, s_q, h_q, d_qk] bf16 (fp32 with the triton and ref backends); h_q in checks.SUPPORTED_HEADS (8, 16,
      32, 64, 128; any with the ref backend; other than 64 or 128: plan_sparse_decode).
    cache: a paged fp8 cache, uint8 [num_blocks, block_size, 1, bytes_per_token] in kv_cache.MODEL1
      (584 B, d_qk 512) or kv_cache.V32 (656 B, d_qk 576); or dense rows [n_slots, 1, d_qk] in q's dtype.
    indices [B, s_q, topk] int32: flat slot ids of `cache` (block * block_size + offset); entry j of query
      (b, s) is valid iff 0 <= id < n_slots and j < topk_length[b] (topk_length [B] int32 or None);
      invalid entries are never read.
    extra_cache (the same kind as cache, its own page size) with extra_indices [B, s_q, etopk] and
      extra_topk_length [B]: attended in the same softmax.
    attn_sink [h_q] fp32: out *= 1 / (1 + exp(sink - lse)) (natural-log lse), once, over both caches.
    plan: from plan_sparse_decode for these shapes (None: made here, for one-off calls).
    out: a contiguous, 16-byte aligned [B, s_q, h_q, 512] tensor in q's dtype that receives the output
      (the launch that writes the result, the merge's or the kernel's, writes it there), None: a new one.
    names: the caller's names for these arguments in error messages (an adapter such as
      engine.h20_ops.flash_mla: {"cache": "k_cache", ...}).
    Returns AttentionOutput(out [B, s_q, h_q, 512] in q's dtype, lse_log2 [B, s_q, h_q] fp32 base 2);
    a query without a valid entry gets out 0 and lse +inf."""
    names = names or {}

    def n(arg: str) -> str:
        return names.get(arg, arg)

    sm_scale = require_scale(n("sm_scale"), sm_scale)
    backend = plan.backend if plan is not None else dispatch.backend_of(None)
    require_tensor("q", q, dtypes=dispatch.Q_DTYPES[backend], ndim=4, dtype_note=dispatch.Q_DTYPE_NOTES.get(backend))
    batch, s_q, h_q, _ = q.shape
    if batch < 1 or s_q < 1 or (backend != "ref" and h_q not in SUPPORTED_HEADS):
        raise ValueError(f"q: expected shape [B >= 1, s_q >= 1, h_q in {SUPPORTED_HEADS}, d_qk], got {tuple(q.shape)}")
    if plan is None:  # tilelang named explicitly with an h_q its kernels do not take: refused under q's name
        dispatch.backend_for_heads(None, h_q, "q")
    main = check_decode_cache(n("cache"), cache, q, LAYOUTS)
    topk = check_decode_list(n("indices"), indices, n("topk_length"), topk_length, q)
    if (extra_cache is None) != (extra_indices is None):
        raise ValueError(f"{n('extra_cache')}, {n('extra_indices')}: pass both or neither")
    if extra_topk_length is not None and extra_cache is None:
        raise ValueError(f"{n('extra_topk_length')}: given without {n('extra_cache')} / {n('extra_indices')}")
    extra, extra_topk = None, 0
    if extra_cache is not None:
        extra = check_decode_cache(n("extra_cache"), extra_cache, q, LAYOUTS)
        if extra.layout is not main.layout:  # also with a plan, which records the main cache's kind only
            raise ValueError(f"{n('extra_cache')}: expected the same kind of cache as {n('cache')} "
                             f"({_kind_name(main.layout)}), got {_kind_name(extra.layout)}")
        extra_topk = check_decode_list(n("extra_indices"), extra_indices, n("extra_topk_length"), extra_topk_length, q)
    check_sink(attn_sink, h_q, n("attn_sink"))
    if attn_sink is not None and attn_sink.device != q.device:
        raise ValueError(f"{n('attn_sink')}: expected device {q.device} (same as q), got {attn_sink.device}")
    if out is not None:
        check_out(n("out"), out, (batch, s_q, h_q, D_V), q.dtype, q.device)
    if plan is None:
        plan = plan_sparse_decode(cache, batch=batch, s_q=s_q, h_q=h_q, topk=topk, q_dtype=q.dtype,
                                  extra_cache=extra_cache, extra_topk=extra_topk)
    else:
        _check_plan(plan, batch, s_q, h_q, topk, extra_topk, main, n("plan"))

    rows = batch * s_q
    q_rows = q.reshape(rows, h_q, q.size(3))  # a view whenever q's strides allow
    out_rows = None if out is None else out.view(rows, h_q, D_V)
    cache_names = (n("cache"), n("extra_cache"))
    if plan.kernel == "triton_paged_fp8":  # reads both lists itself and cuts the chunks of a split itself
        return _triton_paged_fp8(plan, q_rows, cache, indices, topk_length, extra_cache, extra_indices,
                                 extra_topk_length, sm_scale, attn_sink, out_rows)
    if extra_cache is None and plan.splits == 1 and plan.path != "gathered":
        # one cache, no split: the kernel takes the slot ids as they are (it masks ids outside the cache)
        lengths = None if topk_length is None else topk_length.repeat_interleave(s_q)
        out, lse = _attend(plan, q_rows, cache, None, _unit_stride(indices.reshape(rows, topk)), sm_scale, attn_sink,
                           lengths, out_rows, cache_names)
        return AttentionOutput(out.view(batch, s_q, h_q, D_V), lse.view(batch, s_q, h_q))
    lists, slots, q_split = build_decode_lists(indices, topk_length, main.n_slots, extra_indices, extra_topk_length,
                                               0 if extra is None else extra.n_slots, plan.list_len,
                                               positions=plan.path == "gathered", q_rows=q_rows, splits=plan.splits)
    kernel_q = q_rows if plan.splits == 1 else q_split
    kernel_lists = lists.view(rows * plan.splits, plan.chunk)
    kv = _gather_rows(cache, extra_cache, slots, topk, q.dtype, backend) if plan.path == "gathered" else cache
    if plan.splits == 1:
        out, lse = _attend(plan, kernel_q, kv, extra_cache, kernel_lists, sm_scale, attn_sink, None, out_rows,
                           cache_names)
    else:
        parts, lse_parts = _attend(plan, kernel_q, kv, extra_cache, kernel_lists, sm_scale, None, None, None,
                                   cache_names)
        out, lse = merge_splits(parts, lse_parts, plan.splits, attn_sink, q.dtype, out_rows)
    return AttentionOutput(out.view(batch, s_q, h_q, D_V), lse.view(batch, s_q, h_q))


def _triton_paged_fp8(plan: DecodePlan, q_rows, cache, indices, topk_length, extra_cache, extra_indices,
                      extra_topk_length, sm_scale, attn_sink, out_rows) -> AttentionOutput:
    """The Triton paged fp8 kernel (attention/triton_paged_fp8.py): one launch over both caches' lists (+ the
    merge with a split, its fp32 partials merged in fp32)."""
    from .triton_paged_fp8 import paged_fp8_decode

    rows = plan.batch * plan.s_q
    flat = lambda t: None if t is None else _unit_stride(t.reshape(rows, t.size(2)))  # noqa: E731
    out, lse = paged_fp8_decode(q_rows, cache, flat(indices), _unit_stride(topk_length), s_q=plan.s_q,
                                sm_scale=sm_scale, cache1=extra_cache, indices1=flat(extra_indices),
                                lengths1=_unit_stride(extra_topk_length),
                                attn_sink=_unit_stride(attn_sink) if plan.splits == 1 else None, splits=plan.splits,
                                out=out_rows if plan.splits == 1 else None)
    if plan.splits > 1:
        out, lse = merge_splits(out, lse, plan.splits, attn_sink, q_rows.dtype, out_rows)
    shape = (plan.batch, plan.s_q, plan.h_q)
    return AttentionOutput(out.view(*shape, D_V), lse.view(shape))


def _unit_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """t, or a copy with a unit last stride: the kernels read slot-id lists, lengths and the sink with unit
    stride, the public boundary takes any view (a copy only for exotic strides)."""
    return t if t is None or t.size(-1) <= 1 or t.stride(-1) == 1 else t.contiguous()


def _attend(plan: DecodePlan, q_rows, kv, extra_cache, lists, sm_scale, attn_sink, lengths, out, cache_names):
    """The plan's one attention launch: the paged fp8 kernel over (kv, extra_cache), or the prefill kernel
    the dispatcher chooses for these very tensors over dense rows kv; out: its output buffer or None;
    cache_names: the caller's names of the two caches (the paged kernel's layout errors)."""
    if plan.path == "paged_fp8":
        return dispatch.run_paged_fp8_kernel(plan.kernel, q_rows, kv, extra_cache, lists, sm_scale, attn_sink,
                                             lengths, cache_names=cache_names, out=out)
    kernel = dispatch.prefill_kernel(q_rows, kv, plan.backend).kernel
    return dispatch.run_prefill_kernel(kernel, q_rows, kv, lists, sm_scale, D_V, attn_sink, lengths, out)


def _gather_rows(cache, extra_cache, slots: torch.Tensor, topk: int, dtype: torch.dtype, backend: str) -> torch.Tensor:
    """The rows at masked slots [n, topk + etopk] (main cache's, then the extra cache's; -1: a zero row)
    as one dense [n * (topk + etopk), 1, d] buffer in `dtype`."""
    n, width = slots.shape
    parts = [(cache, slots[:, :topk])] + ([] if extra_cache is None else [(extra_cache, slots[:, topk:])])
    if cache.dtype in (torch.uint8, torch.float8_e4m3fn):
        d = kv_cache.layout_of(cache).d
        buf = torch.empty((n, width, 1, d), dtype=dtype, device=slots.device)
        start = 0
        for part_cache, part_slots in parts:
            view = buf[:, start:start + part_slots.size(1)]
            if backend == "ref":  # the oracle's path: torch's reference dequantization
                view.copy_(kv_cache.dequantize_from_cache_ref(part_cache, part_slots, dtype))
            else:
                kv_cache.gather_dequant(part_cache, part_slots, view)
            start += part_slots.size(1)
        return buf.view(n * width, 1, d)
    # dense rows: an invalid slot reads row 0 (any row: its list entry is -1, the kernel never reads it)
    rows = [part_cache[part_slots.clamp(min=0).long(), 0] for part_cache, part_slots in parts]
    return torch.cat(rows, dim=1).view(n * width, 1, cache.size(2))


def _cache_kind(name: str, cache) -> kv_cache.Fp8KvLayout | None:
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype in (torch.uint8, torch.float8_e4m3fn):
        try:
            return kv_cache.layout_of(cache)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    return None


def _kind_name(layout) -> str:
    return "dense rows" if layout is None else f"fp8 {layout.name}"


def _check_plan(plan: DecodePlan, batch, s_q, h_q, topk, extra_topk, main, name: str) -> None:
    got = (batch, s_q, h_q, topk, extra_topk, None if main.layout is None else main.layout.name)
    want = (plan.batch, plan.s_q, plan.h_q, plan.topk, plan.extra_topk, plan.fp8_layout)
    if got != want:
        fields = "(batch, s_q, h_q, topk, extra_topk, fp8 layout)"
        raise ValueError(f"{name}: made for {fields} = {want}, called with {got}")


def _programs_per_sm(kernel: str, q_dtype: torch.dtype, h_q: int, layout) -> int:
    """Programs of the plan's kernel that one SM runs at once (1 but for the Triton paged fp8 kernel's
    few-head configurations)."""
    if kernel != "triton_paged_fp8":
        return 1
    from .triton_paged_fp8 import default_config, heads_per_tile

    return default_config(q_dtype, heads_per_tile(h_q), layout).programs_per_sm


def _choose_splits(n_rows: int, heads: int, list_len: int, device: torch.device, sms_per_program: int,
                   programs_per_sm: int = 1) -> int:
    """With slots = SMs x programs_per_sm: split only when every program has at least sms_per_program slots;
    then the fewest chunks with the fewest SPLIT_GRANULE-entry steps each such that all chunks fit in
    SPLIT_MAX_SM_SHARE of the SMs (one program per SM) or in the slots (programs sharing an SM)."""
    slots = sm_count(device) * programs_per_sm
    programs = n_rows * -(-heads // HEADS_PER_PROGRAM)
    if programs * sms_per_program > slots:
        return 1
    steps = -(-list_len // SPLIT_GRANULE)
    most = min(steps, int(slots * (SPLIT_MAX_SM_SHARE if programs_per_sm == 1 else 1.0)) // programs)
    if most <= 1:
        return 1
    steps_per_chunk = -(-steps // most)
    return -(-steps // steps_per_chunk)
