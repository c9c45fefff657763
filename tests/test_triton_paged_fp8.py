"""The pure-Triton paged fp8 sparse MLA decode kernel (engine.h20_ops.attention.triton_paged_fp8) against
the float32 oracle.

The oracle's inputs: every slot of both caches dequantized by kv_cache.dequantize_from_cache_ref (in q's
dtype), concatenated (cache0's slots, then cache1's), and one index list per query row into that
concatenation (cache1's ids offset by cache0's slot count; invalid entries and positions past a request's
length -1): sparse_mla_prefill_ref over it is the decode's single softmax over both caches.
Traps (FlashMLA's): invalid fillers -1 / INT_MIN / num_slots / INT_MAX, e4m3 NaN codes, NaN / inf scales and
NaN RoPE in every slot no valid entry selects, a garbage MODEL1 pad byte, padded block strides and an
offset base, non-contiguous q, lengths 0, all-invalid rows, sinks +-inf, odd block sizes differing per cache.
CPU (interpreter): small shapes; @pytest.mark.gpu: the same grid at model sizes, and CUDA-graph replay.
Tolerances and comparator: engine/h20_ops/testing.py (FlashMLA's decode tolerances; the interpreter's
truncating bf16 casts get its stated cosine bound).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from engine.h20_ops import kv_cache
from engine.h20_ops.attention import merge
from engine.h20_ops.attention import triton_paged_fp8 as tpf
from engine.h20_ops.attention.reference import sparse_mla_prefill_ref
from engine.h20_ops.testing import DECODE_LSE, DECODE_OUT, EXACT_FP32, Tolerance, assert_close, out_tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INT_MIN, INT_MAX = -(2 ** 31), 2 ** 31 - 1
LOG2E = 1.0 / math.log(2.0)
BF16_NAN = 0x7FC0


def make_cache(gen: torch.Generator, layout, num_blocks: int, block_size: int, *, pad_bytes: int = 64,
               odd_scales: bool = False) -> torch.Tensor:
    """A filled cache [num_blocks, block_size, 1, bytes] whose blocks lie pad_bytes apart beyond their
    size and whose base is 16 bytes into its storage; rows 0.1 * N(0, 1) + an offset. odd_scales (V32): the
    fp32 scales multiplied by non-powers of two (dequantization then rounds)."""
    block = kv_cache.fp8.block_bytes(layout, block_size) + pad_bytes
    storage = torch.zeros(16 + num_blocks * block, dtype=torch.uint8)
    cache = storage[16:].view(num_blocks, block)[:, :block_size * layout.bytes_per_token]
    cache = cache.view(num_blocks, block_size, 1, layout.bytes_per_token)
    n = num_blocks * block_size
    rows = torch.randn(n, 1, layout.d, generator=gen) * 0.1 + (torch.rand(1, generator=gen) - 0.5) * 0.1
    kv_cache.quantize_into_cache_ref(cache, torch.arange(n), rows)
    if odd_scales:
        assert layout is kv_cache.V32
        raw = storage_bytes(cache)
        where = token_bytes(cache, layout, torch.arange(n))[:, 512:528]
        words = raw[where].contiguous().view(torch.float32)
        words *= 1 + torch.rand(words.shape, generator=gen) * 0.9
        raw[where] = words.view(torch.uint8)
    return cache


def token_bytes(cache: torch.Tensor, layout, slots: torch.Tensor) -> torch.Tensor:
    """Byte addresses (flat indices into cache's storage, [len(slots), 576 or 656]) of the given slots' token data
    (MODEL1: without the scale bytes)."""
    bs = cache.size(1)
    block, t = slots.long() // bs, slots.long() % bs
    width = 576 if layout is kv_cache.MODEL1 else 656
    return (cache.storage_offset() + block * cache.stride(0) + t * width)[:, None] + torch.arange(width)[None, :]


def scale_bytes(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """MODEL1: flat storage indices [len(slots), 8] of the given slots' scale bytes."""
    bs = cache.size(1)
    block, t = slots.long() // bs, slots.long() % bs
    return (cache.storage_offset() + block * cache.stride(0) + bs * 576 + t * 8)[:, None] + torch.arange(8)[None, :]


def storage_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache's whole storage as a flat uint8 tensor (writes go to the cache)."""
    return torch.empty(0, dtype=torch.uint8, device=cache.device).set_(cache.untyped_storage())


def poison(cache: torch.Tensor, layout, used: torch.Tensor) -> None:
    """NaN codes (0x7f / 0xff), inf / NaN scales and NaN RoPE in every slot not in `used` (bool [n_slots]);
    a garbage pad byte (0xff: scale 2^128) in every MODEL1 slot."""
    free = (~used).nonzero().flatten()
    raw = storage_bytes(cache)
    data = token_bytes(cache, layout, free)
    nan_rope = torch.full((64,), BF16_NAN, dtype=torch.int16).view(torch.uint8)
    if layout is kv_cache.MODEL1:
        raw[scale_bytes(cache, torch.arange(used.numel()))[:, 7]] = 0xFF
        raw[data[:, :448]] = 0x7F
        raw[data[::2, :448]] = 0xFF
        raw[data[:, 448:576]] = nan_rope
        raw[scale_bytes(cache, free[1::2])[:, :7]] = 0xFF
    else:
        raw[data[:, :512]] = 0xFF
        raw[data[:, 512:528]] = torch.tensor([float("nan"), float("inf"), 1.0, float("nan")]).view(torch.uint8)
        raw[data[:, 528:656]] = nan_rope


def random_lists(gen: torch.Generator, n: int, topk: int, n_slots: int, n_valid: int,
                 fillers=(-1, INT_MIN, None, INT_MAX)) -> torch.Tensor:
    """[n, topk] int32: n_valid distinct valid slot ids at random positions per row, fillers elsewhere (None:
    n_slots, the first id past the cache)."""
    fill = torch.tensor([n_slots if f is None else f for f in fillers], dtype=torch.int64)
    idx = fill[torch.randint(len(fill), (n, topk), generator=gen)]
    for r in range(n):
        positions = torch.randperm(topk, generator=gen)[:n_valid]
        idx[r, positions] = torch.randperm(n_slots, generator=gen)[:n_valid]
    return idx.to(torch.int32)


def valid_mask(indices: torch.Tensor, n_slots: int, lengths: torch.Tensor | None, s_q: int) -> torch.Tensor:
    valid = (indices >= 0) & (indices < n_slots)
    if lengths is not None:
        pos = torch.arange(indices.size(1))[None, :]
        valid &= pos < lengths.repeat_interleave(s_q)[:, None].long()
    return valid


def used_slots(indices, n_slots, lengths, s_q) -> torch.Tensor:
    used = torch.zeros(n_slots, dtype=torch.bool)
    used[indices[valid_mask(indices, n_slots, lengths, s_q)].long()] = True
    return used


def oracle(q, s_q, sm_scale, caches, lists, sink):
    """caches: [(cache, layout)], lists: [(indices, lengths)] -> (out fp32, lse base 2)."""
    rows, combined, base = [], [], 0
    for (cache, _), (indices, lengths) in zip(caches, lists):
        n_slots = cache.size(0) * cache.size(1)
        rows.append(kv_cache.dequantize_from_cache_ref(cache, torch.arange(n_slots), q.dtype))
        valid = valid_mask(indices, n_slots, lengths, s_q)
        combined.append(torch.where(valid, indices.long() + base, -1))
        base += n_slots
    ref = sparse_mla_prefill_ref(q, torch.cat(rows), torch.cat(combined, dim=1).int(), sm_scale, attn_sink=sink)
    return ref.out, ref.lse * LOG2E


def dev_cache(cache: torch.Tensor, device) -> torch.Tensor:
    """The cache on device with the same strides and base offset (Tensor.to would make it contiguous)."""
    if str(device) == "cpu":
        return cache
    storage = torch.empty(0, dtype=torch.uint8).set_(cache.untyped_storage())
    return storage.to(device).as_strided(cache.shape, cache.stride(), cache.storage_offset())


def build_case(seed, *, layout=kv_cache.MODEL1, batch=2, s_q=2, h_q=64, block_sizes=(61, 53), topks=(24, 40),
               n_valid=(17, 30), lengths=False, sink=False, dtype=torch.bfloat16, q_strided=False,
               odd_scales=False, fillers=(-1, INT_MIN, None, INT_MAX), device=DEVICE):
    """Caches (one per entry of block_sizes), index lists, q and sink on device, and the oracle's result.
    Each cache has rows for every valid entry (+ a few), its unselected slots poisoned."""
    gen = torch.Generator().manual_seed(seed)
    n = batch * s_q
    caches, lists = [], []
    for bs, topk, nv in zip(block_sizes, topks, n_valid):
        num_blocks = -(-(n * nv + 7) // bs) + 1
        cache = make_cache(gen, layout, num_blocks, bs, odd_scales=odd_scales)
        n_slots = num_blocks * bs
        indices = random_lists(gen, n, topk, n_slots, min(nv, topk), fillers)
        length = None
        if lengths:
            length = torch.randint(0, topk + 1, (batch,), generator=gen, dtype=torch.int32)
            length[0] = 0
            length[-1] = topk
        poison(cache, layout, used_slots(indices, n_slots, length, s_q))
        caches.append(dev_cache(cache, device))
        lists.append((indices.to(device), None if length is None else length.to(device)))
    d = layout.d
    q = torch.randn(n, 2 * h_q if q_strided else h_q, d + (64 if q_strided else 0), generator=gen) * 0.1
    q = (q + (torch.rand(1, generator=gen) - 0.5) * 0.1).to(dtype).to(device)
    if q_strided:  # a view: every other head, rows padded by 64
        q = q[:, ::2, :d]
    attn_sink = None
    if sink:
        attn_sink = torch.randn(h_q, generator=gen)
        attn_sink[0::3] = float("inf")
        attn_sink[1::3] = float("-inf")
        attn_sink = attn_sink.to(device)
    ref = oracle(q, s_q, d ** -0.5, caches, lists, attn_sink)
    return dict(q=q, s_q=s_q, caches=caches, lists=lists, attn_sink=attn_sink, sm_scale=d ** -0.5), ref


def oracle(q, s_q, sm_scale, caches, lists, sink):
    """One softmax over both caches' valid entries -> (out fp32, lse base 2)."""
    rows, combined, base = [], [], 0
    for cache, (indices, lengths) in zip(caches, lists):
        n_slots = cache.size(0) * cache.size(1)
        rows.append(kv_cache.dequantize_from_cache_ref(cache, torch.arange(n_slots, device=cache.device), q.dtype))
        valid = valid_mask(indices.cpu(), n_slots, None if lengths is None else lengths.cpu(), s_q)
        combined.append(torch.where(valid, indices.cpu().long() + base, -1))
        base += n_slots
    idx = torch.cat(combined, dim=1).int().to(q.device)
    ref = sparse_mla_prefill_ref(q, torch.cat(rows), idx, sm_scale, attn_sink=sink)
    return ref.out, ref.lse * LOG2E


def launch(case, splits=1, config=None, merged=True):
    """The kernel on a built case (checked by the boundary's check first); with a split, merged."""
    (c0, *rest), ((i0, l0), *rest_lists) = case["caches"], case["lists"]
    c1, (i1, l1) = (rest[0], rest_lists[0]) if rest else (None, (None, None))
    q, s_q, sink = case["q"], case["s_q"], case["attn_sink"]
    tpf.check_paged_fp8_decode_args(q, c0, i0, l0, c1, i1, l1, s_q, case["sm_scale"], sink, splits)
    out, lse = tpf.paged_fp8_decode(q, c0, i0, l0, s_q=s_q, sm_scale=case["sm_scale"], cache1=c1, indices1=i1,
                                    lengths1=l1, attn_sink=sink, splits=splits, config=config)
    n, h_q = q.shape[:2]
    if splits > 1:
        assert out.dtype == torch.float32 and out.shape == (n * splits, h_q, 512) and lse.shape == (n * splits, h_q)
        if merged:
            out, lse = merge.merge_splits(out, lse, splits, sink, q.dtype)
    else:
        assert out.dtype == q.dtype and out.shape == (n, h_q, 512) and lse.shape == (n, h_q)
    assert lse.dtype == torch.float32
    return out, lse


def run_case(seed, *, splits=1, config=None, **kw):
    case, (ref_out, ref_lse) = build_case(seed, **kw)
    out, lse = launch(case, splits, config)
    assert_close("out", out, ref_out, out_tolerance(DECODE_OUT, out))
    assert_close("lse", lse, ref_lse, DECODE_LSE)
    return out.cpu(), lse.cpu(), ref_out.cpu(), ref_lse.cpu()


# ------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("layout", [kv_cache.MODEL1, kv_cache.V32], ids=["MODEL1", "V32"])
@pytest.mark.parametrize("h_q", [64, 128])
def test_matches_oracle(layout, h_q):
    run_case(1 + h_q, layout=layout, h_q=h_q)


@pytest.mark.parametrize("h_q", [8, 16, 32])
def test_small_head_counts(h_q):
    run_case(2 + h_q, h_q=h_q, sink=True, lengths=True)


@pytest.mark.parametrize("filler", [-1, INT_MIN, None, INT_MAX], ids=["-1", "INT_MIN", "num_slots", "INT_MAX"])
def test_each_invalid_filler_is_never_read(filler):
    run_case(3, fillers=(filler,), h_q=16)


@pytest.mark.parametrize("layout", [kv_cache.MODEL1, kv_cache.V32], ids=["MODEL1", "V32"])
def test_all_invalid_rows_and_zero_lengths(layout):
    """Every entry invalid (every slot poisoned): out 0, lse +inf, whatever the sink; and lengths 0."""
    out, lse, _, _ = run_case(4, layout=layout, h_q=16, n_valid=(0, 0), sink=True)
    assert (out == 0).all() and torch.isposinf(lse).all()
    run_case(5, layout=layout, h_q=16, lengths=True, sink=True, splits=3)


def test_one_cache_empty_the_other_not():
    run_case(6, h_q=16, n_valid=(0, 25), lengths=True)
    run_case(7, h_q=16, n_valid=(20, 0), sink=True)


@pytest.mark.parametrize("s_q", [1, 2, 3])
@pytest.mark.parametrize("splits", [1, 3])
def test_lengths_sinks_and_splits(s_q, splits):
    run_case(10 + s_q, s_q=s_q, batch=3, h_q=32, lengths=True, sink=True, splits=splits)


@pytest.mark.parametrize("layout", [kv_cache.MODEL1, kv_cache.V32], ids=["MODEL1", "V32"])
def test_split_into_more_chunks_than_entries(layout):
    """7 chunks of 10 positions over lists of 24 + 40: chunks that straddle the two lists, chunks past a
    request's lengths (empty: +inf partial lse), merged by the engine's merge."""
    run_case(20, layout=layout, h_q=16, lengths=True, sink=True, splits=7)
    case, _ = build_case(21, layout=layout, h_q=16, lengths=True, block_sizes=(61,), topks=(24,), n_valid=(20,))
    out_parts, lse_parts = launch(case, splits=30, merged=False)
    empty = torch.isposinf(lse_parts)
    assert empty.any() and (out_parts[empty] == 0).all()


@pytest.mark.parametrize("block_sizes", [(2, 69), (576, 64), (64, 2), (53, 61)])
@pytest.mark.parametrize("layout", [kv_cache.MODEL1, kv_cache.V32], ids=["MODEL1", "V32"])
def test_odd_block_sizes(layout, block_sizes):
    run_case(30 + block_sizes[0], layout=layout, h_q=16, block_sizes=block_sizes, topks=(20, 28), n_valid=(13, 19))


@pytest.mark.parametrize("layout", [kv_cache.MODEL1, kv_cache.V32], ids=["MODEL1", "V32"])
def test_one_cache_only(layout):
    run_case(40, layout=layout, h_q=64, block_sizes=(53,), topks=(70,), n_valid=(60,), lengths=True, sink=True)


def test_non_contiguous_q():
    run_case(41, h_q=32, q_strided=True, sink=True)
    run_case(42, layout=kv_cache.V32, h_q=64, q_strided=True, splits=3)


def test_v32_fp32_scales_round_once():
    """V3.2 scales that are not powers of two: the rows are fp32 products (rounded once to bf16 by the oracle's
    inputs; the interpreter's fp32 dots keep them unrounded, within the tolerance)."""
    run_case(43, layout=kv_cache.V32, h_q=64, odd_scales=True)


@pytest.mark.parametrize("layout", [kv_cache.MODEL1, kv_cache.V32], ids=["MODEL1", "V32"])
def test_float32_mode_is_exact(layout):
    """fp32 q: fp32 rows (exact dequantization), ieee dots, P fp32: within fp32 rounding of the oracle."""
    case, (ref_out, ref_lse) = build_case(44, layout=layout, h_q=16, dtype=torch.float32, lengths=True, sink=True)
    for splits in (1, 3):
        out, lse = launch(case, splits)
        assert out.dtype == torch.float32
        assert_close("out", out, ref_out, EXACT_FP32)
        assert_close("lse", lse, ref_lse, Tolerance(1e-6, 1e-6))


def test_every_output_element_written(monkeypatch):
    """NaN-filled outputs: everything the launcher returns is written by the kernel (also masked heads)."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    case, (ref_out, ref_lse) = build_case(45, h_q=8, lengths=True)
    monkeypatch.setattr(tpf.torch, "empty", nan_empty)
    for splits in (1, 4):
        out, lse = launch(case, splits, merged=False)
        assert not out.isnan().any() and not lse.isnan().any()


def test_nan_in_a_selected_row_stays_nan():
    """A NaN code in a selected row makes its query rows NaN (not empty), as in the oracle."""
    case, _ = build_case(46, h_q=16, block_sizes=(61,), topks=(24,), n_valid=(17,))
    cache, (indices, _) = case["caches"][0], case["lists"][0]
    slot = int(indices[0][(indices[0] >= 0) & (indices[0] < cache.size(0) * cache.size(1))][0])
    storage_bytes(cache)[token_bytes(cache, kv_cache.MODEL1, torch.tensor([slot]))[0, 5]] = 0x7F
    ref_out, ref_lse = oracle(case["q"], case["s_q"], case["sm_scale"], case["caches"], case["lists"], None)
    out, lse = launch(case)
    assert out[0].isnan().all() and lse[0].isnan().all()
    assert_close("out", out, ref_out, out_tolerance(DECODE_OUT, out))
    assert_close("lse", lse, ref_lse, DECODE_LSE)


def _bad(change: str):
    case, _ = build_case(47, h_q=16, batch=2, s_q=2, lengths=True, sink=True)
    (c0, c1), ((i0, l0), (i1, l1)) = case["caches"], case["lists"]
    args = dict(q=case["q"], cache0=c0, indices0=i0, lengths0=l0, cache1=c1, indices1=i1, lengths1=l1, s_q=2,
                sm_scale=0.1, attn_sink=case["attn_sink"], splits=1)
    dev = case["q"].device  # a bad tensor on another device would meet the device check first
    if change == "q_dtype":
        args["q"] = args["q"].half()
    elif change == "q_d":
        args["q"] = torch.zeros(4, 16, 576, dtype=torch.bfloat16, device=dev)
    elif change == "s_q":
        args["s_q"] = 3
    elif change == "cache0_bytes":
        args["cache0"] = torch.zeros(2, 16, 1, 600, dtype=torch.uint8, device=dev)
    elif change == "cache1_layout":
        args["cache1"] = kv_cache.new_fp8_kv_cache(kv_cache.V32, 2, 16, dev)
    elif change == "cache0_align":
        args["cache0"] = torch.zeros(2 * 16 * 584 + 2, dtype=torch.uint8, device=dev)[2:].view(2, 16, 1, 584)
    elif change == "indices0_rows":
        args["indices0"] = i0[:3]
    elif change == "indices1_dtype":
        args["indices1"] = i1.long()
    elif change == "lengths1_shape":
        args["lengths1"] = torch.zeros(4, dtype=torch.int32, device=dev)
    elif change == "cache1_alone":
        args["indices1"] = None
    elif change == "sink_shape":
        args["attn_sink"] = torch.zeros(8, device=dev)
    elif change == "sm_scale":
        args["sm_scale"] = float("nan")
    elif change == "splits":
        args["splits"] = 0
    return args


@pytest.mark.parametrize("change,error,match", [
    ("q_dtype", TypeError, "q: expected dtype"), ("q_d", ValueError, "q: expected d_qk 512"),
    ("s_q", ValueError, "q: expected shape"), ("cache0_bytes", ValueError, "cache0: expected last dim"),
    ("cache1_layout", ValueError, "cache1: expected cache0's layout"), ("cache0_align", ValueError, "cache0: expected a 4-byte"),
    ("indices0_rows", ValueError, "indices0: expected shape"), ("indices1_dtype", TypeError, "indices1: expected dtype"),
    ("lengths1_shape", ValueError, "lengths1: expected"), ("cache1_alone", ValueError, "cache1, indices1"),
    ("sink_shape", ValueError, "attn_sink: expected shape"), ("sm_scale", ValueError, "sm_scale"),
    ("splits", ValueError, "splits: expected"),
])
def test_bad_input_raises_naming_the_argument(change, error, match):
    with pytest.raises(error, match=match):
        tpf.check_paged_fp8_decode_args(**_bad(change))


# The argument types and attributes Triton's JIT gives a launch with 16-byte aligned tensors and strides.
SM90_COMPILE = r"""
import os, subprocess, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.h20_ops.attention import triton_paged_fp8 as tpf

layout, h_q, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
is_model1 = layout == "MODEL1"
block_h = tpf.heads_per_tile(h_q)
cfg = tpf.default_config(tpf.torch.bfloat16 if dtype == "bf16" else tpf.torch.float32, block_h,
                         tpf.kv_cache.MODEL1 if is_model1 else tpf.kv_cache.V32)
pointers = {"q_ptr": f"*{dtype}", "cache0_ptr": "*u8", "cache1_ptr": "*u8", "idx0_ptr": "*i32", "idx1_ptr": "*i32",
            "len0_ptr": "*i32", "len1_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": f"*{dtype}", "lse_ptr": "*fp32"}
kernel = tpf._paged_fp8_decode_kernel
constexprs = dict(BLOCK_SIZE0=256 if is_model1 else 64, BLOCK_SIZE1=64, IS_MODEL1=is_model1, HAS_CACHE1=True,
                  HAS_LEN0=True, HAS_LEN1=True, HAS_SINK=True, H_TILES=-(-h_q // block_h), BLOCK_H=block_h,
                  BLOCK_K=cfg.block_k, D_ROPE=0 if is_model1 else 64, INTERPRETER=False,
                  ROW_DTYPE=tl.bfloat16 if dtype == "bf16" else tl.float32,
                  INPUT_PRECISION="tf32" if dtype == "bf16" else "ieee", DEPENDENT_LAUNCH=True)
signature, attrs = {}, {}
for i, name in enumerate(kernel.arg_names):
    if name in constexprs:
        signature[name] = "constexpr"
    elif name in pointers:
        signature[name] = pointers[name]
        attrs[(i,)] = [["tt.divisibility", 16]]
    else:
        signature[name] = "fp32" if name == "qk_scale_log2" else "i32"
        if name.startswith(("stride", "block_stride")):
            attrs[(i,)] = [["tt.divisibility", 16]]
compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
ptx = sys.argv[4] + ".ptx"
open(ptx, "w").write(compiled.asm["ptx"])
open(sys.argv[4] + ".ttgir", "w").write(compiled.asm["ttgir"])
print("SHARED", compiled.metadata.shared)
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
report = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", sys.argv[4] + ".cubin"], capture_output=True,
                        text=True, check=True).stderr
print("PTXAS", report.replace(chr(10), " | "))
"""


@pytest.mark.parametrize("layout,h_q,dtype", [("MODEL1", 64, "bf16"), ("V32", 64, "bf16"), ("MODEL1", 16, "bf16")])
def test_sm90_build_fits_without_spills(layout, h_q, dtype, tmp_path):
    """The default configuration compiled for sm_90 on this machine (no GPU needed): it fits the 227 KB of
    shared memory, ptxas does not spill, the bf16 build converts e4m3 by the hardware cast, the bf16 64-head
    Q.K^T is split between the two warpgroups (warpsPerCTA [4, 2]), the row bytes arrive by cp.async, and the
    kernel waits for the previous kernel (programmatic dependent launch)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # a real compile, not the interpreter
    result = subprocess.run([sys.executable, "-c", SM90_COMPILE, layout, str(h_q), dtype, str(tmp_path / "k")],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith(("SHARED", "PTXAS")))
    assert int(lines["SHARED"]) <= 232448, "does not fit the 227 KB of shared memory of an SM90 CTA"
    assert "0 bytes spill stores, 0 bytes spill loads" in lines["PTXAS"], lines["PTXAS"]
    ptx = (tmp_path / "k.ptx").read_text()
    ttgir = (tmp_path / "k.ttgir").read_text()
    assert "griddepcontrol.wait" in ptx
    assert "cp.async" in ptx and "async_copy_global_to_local" in ttgir
    if dtype == "bf16":
        assert "cvt.rn.f16x2.e4m3x2" in ptx
    if dtype == "bf16" and h_q == 64:
        assert "warpsPerCTA = [4, 2], instrShape = [16, 32, 16]" in ttgir  # Q.K^T: 32 of 64 columns per warpgroup


# ------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [kv_cache.MODEL1, kv_cache.V32], ids=["MODEL1", "V32"])
@pytest.mark.parametrize("h_q", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("batch,topks", [(4, (128, 512)), (74, (128, 1024)), (4, (2048,))])
def test_model_sizes_on_gpu(layout, h_q, batch, topks):
    block_sizes = (256, 64)[:len(topks)] if layout is kv_cache.MODEL1 else (64, 61)[:len(topks)]
    n_valid = tuple(t - 9 for t in topks)
    for splits in (1, 3):
        run_case(100 + h_q + batch, layout=layout, batch=batch, s_q=2, h_q=h_q, block_sizes=block_sizes, topks=topks,
                 n_valid=n_valid, lengths=True, sink=True, splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [kv_cache.MODEL1, kv_cache.V32], ids=["MODEL1", "V32"])
def test_traps_on_gpu(layout):
    """The CPU grid's traps on the GPU (hardware e4m3 conversion, bf16 dots)."""
    for filler in (-1, INT_MIN, None, INT_MAX):
        run_case(200, layout=layout, fillers=(filler,), h_q=64)
    out, lse, _, _ = run_case(201, layout=layout, h_q=64, n_valid=(0, 0), sink=True)
    assert (out == 0).all() and torch.isposinf(lse).all()
    for s_q in (1, 3):
        run_case(202, layout=layout, s_q=s_q, batch=3, h_q=128, lengths=True, sink=True, splits=3)
    run_case(203, layout=layout, h_q=64, q_strided=True, sink=True)
    run_case(204, layout=layout, h_q=64, block_sizes=(2, 69), topks=(20, 28), n_valid=(13, 19))
    run_case(205, layout=layout, h_q=16, dtype=torch.float32, lengths=True, sink=True, splits=3)
    if layout is kv_cache.V32:
        run_case(206, layout=layout, h_q=128, odd_scales=True)


@pytest.mark.gpu
@pytest.mark.parametrize("block_k", [32, 64])
def test_other_block_sizes_on_gpu(block_k):
    for stages in (2, 3):
        config = tpf.PagedFp8DecodeConfig(block_k=block_k, num_warps=8, num_stages=stages)
        run_case(300 + block_k, batch=8, h_q=128, block_sizes=(256, 64), topks=(128, 512), n_valid=(120, 500),
                 lengths=True, sink=True, config=config, splits=2)


@pytest.mark.gpu
def test_cuda_graph_replay():
    """Captured once, replayed after the indices and lengths changed in place: the new result."""
    case, _ = build_case(400, batch=4, h_q=64, block_sizes=(256, 64), topks=(128, 512), n_valid=(100, 400),
                         lengths=True, sink=True)
    launch(case, splits=2)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = launch(case, splits=2)
    fresh, (ref_out, ref_lse) = build_case(401, batch=4, h_q=64, block_sizes=(256, 64), topks=(128, 512),
                                           n_valid=(100, 400), lengths=True, sink=True)
    for (dst_i, dst_l), (src_i, src_l) in zip(case["lists"], fresh["lists"]):
        dst_i.copy_(src_i)
        dst_l.copy_(src_l)
    for dst, src in zip(case["caches"], fresh["caches"]):
        assert dst.shape == src.shape
        dst.copy_(src)
    case["q"].copy_(fresh["q"])
    case["attn_sink"].copy_(fresh["attn_sink"])
    graph.replay()
    torch.cuda.synchronize()
    assert_close("out", out, ref_out, out_tolerance(DECODE_OUT, out))
    assert_close("lse", lse, ref_lse, DECODE_LSE)
