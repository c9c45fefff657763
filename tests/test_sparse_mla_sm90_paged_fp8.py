"""The TileLang SM90 sparse MLA decode kernel over two paged fp8 caches, MODEL1 or V3.2, each cache with
its own page size and block stride (engine.h20_ops.attention.tilelang_sm90_paged_fp8).

CPU: every variant (h_q 64, 128 x MODEL1, V3.2) lowers and nvcc-compiles for sm_90a; ptxas keeps the
wgmmas asynchronous without spills; the producer stages the fp8 bytes with 16-byte cp.async and finds
a slot's page block by a multiply (no integer division), the consumers convert them behind their own
barriers, and O leaves by TMA; the kernel waits for the previous kernel before any global access
(programmatic dependent launch); the block division is exact for every page size and slot; bad caches
and mixed layouts are rejected by name; the dispatcher takes the paged path for V3.2 caches and unequal
page sizes.
GPU (@pytest.mark.gpu): against the float32 oracle on the torch-dequantized rows of both caches (cache 0's
rows, then cache 1's: the kernel's indices are absolute rows of that concatenation) for page-size mixes
of 2 .. 576 tokens and padded block strides, with invalid fillers (-1, INT_MIN, n_slots, INT_MAX), e4m3
NaN codes and NaN RoPE in every slot no valid entry selects, lengths down to 0 (all-invalid rows) and
sinks of +-inf; the same through engine.h20_ops.sparse_mla_decode (with and without a split); rows with
MODEL1 scales above 2^7 (two conversion factors) and V3.2 rows with arbitrary fp32 scales dequantize bit for bit."""

import math
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

from engine.h20_ops import kv_cache, testing
from engine.h20_ops.attention.reference import sparse_mla_prefill_ref

tilelang = pytest.importorskip("tilelang", reason="tilelang is not installed (pip install '.[tilelang]')")

LOG2E = 1.0 / math.log(2.0)
INT_MIN, INT_MAX = -(2 ** 31), 2 ** 31 - 1
LAYOUTS = {"MODEL1": kv_cache.MODEL1, "V32": kv_cache.V32}


@pytest.mark.parametrize("layout_name", ["MODEL1", "V32"])
@pytest.mark.parametrize("h_q", [64, 128])
def test_kernel_compiles_async_without_spills(h_q, layout_name):
    from engine.h20_ops.attention import tilelang_sm90_paged_fp8 as fp8

    kernel = fp8.compiled_kernel(h_q, layout_name)
    src = kernel.get_kernel_source()
    # the conversion: definitions, then one call per consumer and half (MODEL1 left: per row, 2 pairs of groups;
    # right: both rows of the thread, 3 pairs; V3.2: per row and half, 2 pairs)
    n_left, n_right, n_v32 = (2, 2, 0) if layout_name == "MODEL1" else (0, 0, 4)
    assert src.count("fp8_cvt_left(") == 1 + n_left and src.count("fp8_cvt_right(") == 1 + n_right
    assert src.count("v32_cvt_row(") == 1 + n_v32
    assert "fp8_cp16s(" in src and src.count("tma_store(") == 2 and "Out[" not in src
    # a slot's page block by a multiply and shifts (paged_block_of), not an integer division
    assert src.count("paged_block_of(") == 1 + 1 and "/ block_size" not in src
    # cp.async arrivals: each half's in both gather orders (Q arrives by TMA, one box per 64 columns);
    # each consumer converts the halves it reads first behind its own 128-thread barrier (named
    # barriers 6 and 7)
    assert src.count("mbarrier_cp_async_arrive_noinc(") == 2 * 4 and "__launch_bounds__(384, 1)" in src
    assert src.count("__syncthreads()") == 1  # the one before the warpgroups part (any other would hang)
    assert src.count("tma_load(Q_desc,") == LAYOUTS[layout_name].d // 64
    assert src.count("sync_thread_partial(6, 128)") == 2 and src.count("sync_thread_partial(7, 128)") == 2
    # programmatic dependent launch: every thread waits for the previous kernel before its first global
    # access (Q's TMA load, the slot ids, the caches, the outputs)
    body = src[src.index("__global__"):]
    wait = body.index("cudaGridDependencySynchronize();")
    assert body.count("cudaGridDependencySynchronize();") == 1
    assert all(wait < body.index(access) for access in ("tma_load(Q_desc,", "Indices[", "Lse[", "fp8_cp16s("))
    ptx = kernel._get_ptx()
    assert "griddepcontrol.wait" in ptx
    assert "cp.async.cg.shared.global" in ptx
    assert "ex2.approx.ftz.f32" in ptx and "ex2.approx.f32" not in ptx  # built with --use_fast_math
    if layout_name == "V32":
        # e4m3 widened by cvt, scaled by a non-flushing fp32 multiply, rounded to bf16 once
        assert "cvt.rn.f16x2.e4m3x2" in ptx and "mul.rn.f32 " in ptx and "cvt.rn.bf16x2.f32" in ptx
    if shutil.which("ptxas") is None:
        pytest.skip("ptxas not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        run = subprocess.run(["ptxas", "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "C7515" not in run.stderr and "C7517" not in run.stderr, run.stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in run.stderr, run.stderr


def test_block_division_is_exact():
    """The kernel's page-block arithmetic (paged_block_of with block_division's constants), emulated in
    exact integers, equals floor(s / block_size) for every block size 1..1200 and some large ones, at
    every slot around a multiple of the block size, at 0 and at 2^31 - 1."""
    from engine.h20_ops.attention.tilelang_sm90_paged_fp8 import block_division

    sizes = list(range(1, 1201)) + [2 ** k for k in range(11, 31)] + [65535, 65537, 3 ** 19, 2 ** 31 - 1]
    mults = torch.arange(0, 2 ** 31, 2 ** 31 // 4099, dtype=torch.int64)
    for d in sizes:
        magic, shift = block_division(d)
        assert -(2 ** 31) <= magic < 2 ** 31 and 0 <= shift <= 31
        m = magic % 2 ** 32  # the kernel's unsigned view of the int32 argument
        base = torch.cat([mults // d * d, torch.arange(0, min(3 * d, 1200), dtype=torch.int64),
                          torch.tensor([2 ** 31 - 1], dtype=torch.int64)])
        s = torch.cat([base - 1, base, base + 1]).clamp(0, 2 ** 31 - 1)
        # __umulhi(2 s, m) >> shift, with 2 s < 2^32 and m < 2^32 (the product split to stay within int64)
        two_s = 2 * s
        hi = ((two_s * (m >> 16)) + ((two_s * (m & 0xFFFF)) >> 16)) >> 16
        assert torch.equal(hi >> shift, s // d), d
    with pytest.raises(ValueError, match="block_size"):
        block_division(0)


def test_rejects_bad_caches():
    from engine.h20_ops.attention.tilelang_sm90_paged_fp8 import cache_views

    good = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 2, 16, "cpu")
    with pytest.raises(TypeError, match="cache0"):
        cache_views(good.float(), "cache0")
    with pytest.raises(ValueError, match="cache1"):
        cache_views(torch.zeros(2, 16, 1, 640, dtype=torch.uint8), "cache1")
    with pytest.raises(ValueError, match="cache0"):
        cache_views(torch.zeros(2, 16, 1, 585, dtype=torch.uint8)[..., 1:], "cache0")  # not 16-byte aligned
    with pytest.raises(ValueError, match="cache0: expected a 16-byte aligned"):  # 61 * 584 bytes: not 16-aligned
        cache_views(torch.zeros(2, 61, 1, 584, dtype=torch.uint8), "cache0")
    view = cache_views(good, "cache0")
    assert (view.n_slots, view.block_size, view.layout) == (32, 16, kv_cache.MODEL1)
    assert view.flat.dtype == torch.float8_e4m3fn and view.block_bytes16 == good.stride(0) // 16
    # any page size (kv_cache pads MODEL1 blocks to 16-byte multiples) and a block stride larger than the block
    odd = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 3, 61, "cpu")
    assert cache_views(odd, "cache0").block_bytes16 == odd.stride(0) // 16
    buf = torch.zeros(3 * (53 * 656 + 48), dtype=torch.uint8)
    padded = torch.as_strided(buf, (3, 53, 1, 656), (53 * 656 + 48, 656, 656, 1))
    v32 = cache_views(padded, "cache1")
    assert (v32.layout, v32.n_slots, v32.block_bytes16) == (kv_cache.V32, 159, (53 * 656 + 48) // 16)
    assert v32.flat.numel() == 2 * (53 * 656 + 48) + 53 * 656  # up to the last block's data


def test_rejects_mixed_layouts_and_mismatched_q(monkeypatch):
    """Checked before any launch (the device claimed SM90 here, so that the checks after the device's run)."""
    from engine.h20_ops.attention import tilelang_sm90_paged_fp8 as fp8

    monkeypatch.setitem(fp8.require_sm90_device.__globals__, "cuda_capability", lambda device: (9, 0))
    model1 = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 2, 64, "cpu")
    v32 = kv_cache.new_fp8_kv_cache(kv_cache.V32, 3, 2, "cpu")
    idx = torch.zeros(2, 8, dtype=torch.int32)
    q512, q576 = torch.zeros(2, 64, 512, dtype=torch.bfloat16), torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^extra_cache: expected the layout of cache"):
        fp8.sparse_mla_fwd_sm90_paged_fp8(q512, model1, v32, idx, 0.04, cache_names=("cache", "extra_cache"))
    with pytest.raises(TypeError, match=r"^q: expected a bf16 tensor \[s_q, h_q, 576\] \(cache0 holds V32"):
        fp8.sparse_mla_fwd_sm90_paged_fp8(q512, v32, None, idx, 0.04)
    with pytest.raises(TypeError, match=r"^q: expected a bf16 tensor \[s_q, h_q, 512\]"):
        fp8.sparse_mla_fwd_sm90_paged_fp8(q576, model1, None, idx, 0.04)


@pytest.mark.parametrize("layout_name,block_sizes", [("V32", (64, 64)), ("MODEL1", (256, 64)), ("V32", (2, 53))])
def test_dispatcher_takes_the_paged_kernel(layout_name, block_sizes):
    """V3.2 caches and caches of different page sizes go to the paged fp8 kernel (TileLang backend)."""
    from engine.h20_ops import plan_sparse_decode

    layout = LAYOUTS[layout_name]
    cache = kv_cache.new_fp8_kv_cache(layout, 3, block_sizes[0], "cpu")
    extra = kv_cache.new_fp8_kv_cache(layout, 5, block_sizes[1], "cpu")
    plan = plan_sparse_decode(cache, batch=2, s_q=2, h_q=64, topk=16, q_dtype=torch.bfloat16, extra_cache=extra,
                              extra_topk=8, num_splits=1, backend="tilelang")
    assert (plan.path, plan.kernel, plan.fp8_layout) == ("paged_fp8", "tilelang_sm90_paged_fp8", layout_name)


# ---------------------------------------------------------------------------------------- GPU

FILLERS = (-1, INT_MIN, INT_MAX)  # and n0 + n1, n0 + n1 + 7 (the combined slot count and past it)


def _case(seed, layout_name, h_q, rows, topk0, topk1, block_sizes, n_slots, *, invalid=0.0, lengths=False,
          sink=False, block_pad=0):
    """Kernel inputs over cache 0 (block_sizes[0]) and, if topk1, cache 1 (block_sizes[1]), each of at least
    n_slots[i] slots, blocks padded by block_pad * 16 bytes: per row topk0 entries of cache 0, then topk1 of
    cache 1 (offset by n0), both caches' last slots selected; a fraction `invalid` of the entries replaced
    by fillers; topk_length per row (row 0: 0); sinks with +-inf; NaN (e4m3 NaN codes, NaN RoPE) in every
    slot no valid entry selects. Returns (q, cache0, cache1 or None, indices, topk_length, attn_sink,
    oracle rows [n0 + n1, 1, d] float32, n0 + n1)."""
    layout = LAYOUTS[layout_name]
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    caches = [testing.decode_cache(gen, n_slots[0], layout.d, layout=layout, block_size=block_sizes[0], device=dev,
                                   block_pad=block_pad)]
    if topk1:
        caches.append(testing.decode_cache(gen, n_slots[1], layout.d, layout=layout, block_size=block_sizes[1],
                                           device=dev, block_pad=block_pad))
    n0 = caches[0].n_slots
    n_all = n0 + (caches[1].n_slots if topk1 else 0)
    parts = [torch.randint(caches[0].n_slots, (rows, topk0), generator=gen)]
    if topk1:
        parts.append(torch.randint(caches[1].n_slots, (rows, topk1), generator=gen) + n0)
    idx = torch.cat(parts, dim=1)
    topk = topk0 + topk1
    idx[0, 0], idx[-1, -1] = n0 - 1, n_all - 1  # both caches' last slots
    if invalid:
        fill = torch.tensor(FILLERS + (n_all, n_all + 7), dtype=torch.int64)
        pick = torch.rand(idx.shape, generator=gen) < invalid
        idx = torch.where(pick, fill[torch.randint(len(fill), idx.shape, generator=gen)], idx)
    topk_length = None
    if lengths:
        topk_length = torch.randint(0, topk + 1, (rows,), generator=gen, dtype=torch.int32)
        topk_length[0] = 0
    limit = torch.full((rows,), topk) if topk_length is None else topk_length.long()
    testing.poison_unselected(caches[0], idx[:, None, :topk0], limit.clamp(max=topk0))
    if topk1:
        testing.poison_unselected(caches[1], idx[:, None, topk0:] - n0, (limit - topk0).clamp(0, topk1))
    oracle_rows = torch.cat([c.rows for c in caches]).to(dev)
    q = testing.normal_inputs(gen, rows, h_q, layout.d).bfloat16().to(dev)
    attn_sink = testing.sinks(gen, h_q).to(dev) if sink else None
    return (q, caches[0].cache, caches[1].cache if topk1 else None, idx.to(torch.int32).to(dev),
            None if topk_length is None else topk_length.to(dev), attn_sink, oracle_rows, n_all)


def _check_against_oracle(q, oracle_rows, idx, out, lse, attn_sink, topk_length):
    ref = sparse_mla_prefill_ref(q.float(), oracle_rows, idx, q.size(2) ** -0.5, attn_sink=attn_sink,
                                 topk_length=topk_length)
    testing.assert_close("out", out, ref.out, testing.out_tolerance(testing.DECODE_OUT, out))
    testing.assert_close("lse", lse / LOG2E, ref.lse, testing.DECODE_LSE)  # the kernel's lse is base 2


# (rows, topk0, topk1, block_sizes, min slots, options): FlashMLA's V4 page sizes (SWA 256, compressed 64),
# odd and tiny pages, lists not a multiple of 64 long, one entry, one cache, CTAs serving several items
CASES = [
    (1, 128, 512, (64, 64), (300, 1100), {}),
    (8, 128, 512, (256, 64), (2000, 5000), {"invalid": 0.2, "lengths": True, "sink": True, "block_pad": 1}),
    (6, 100, 37, (2, 53), (700, 900), {"invalid": 0.2, "sink": True}),
    (5, 64, 200, (61, 69), (1000, 1500), {"lengths": True, "sink": True, "block_pad": 3}),
    (4, 300, 1, (576, 2), (1200, 40), {"invalid": 0.3}),
    (2, 1, 0, (53, 53), (60, 0), {}),
    (3, 2048, 0, (64, 64), (5000, 0), {"invalid": 0.1, "lengths": True}),
    (300, 64, 64, (64, 256), (2000, 3000), {"lengths": True, "invalid": 0.1}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout_name", ["MODEL1", "V32"])
@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("rows,topk0,topk1,block_sizes,n_slots,extras", CASES)
def test_matches_oracle(layout_name, h_q, rows, topk0, topk1, block_sizes, n_slots, extras):
    from engine.h20_ops.attention.tilelang_sm90_paged_fp8 import sparse_mla_fwd_sm90_paged_fp8

    q, cache0, cache1, idx, topk_length, attn_sink, oracle_rows, _ = _case(
        rows + h_q + topk0, layout_name, h_q, rows, topk0, topk1, block_sizes, n_slots, **extras)
    out, lse = sparse_mla_fwd_sm90_paged_fp8(q, cache0, cache1, idx, q.size(2) ** -0.5, attn_sink=attn_sink,
                                             topk_length=topk_length)
    _check_against_oracle(q, oracle_rows, idx, out, lse, attn_sink, topk_length)


@pytest.mark.gpu
@pytest.mark.parametrize("layout_name", ["MODEL1", "V32"])
@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("block_sizes,num_splits", [((256, 64), 1), ((2, 69), 3), ((576, 53), None)])
def test_decode_entry_point_per_cache_page_sizes(layout_name, h_q, block_sizes, num_splits):
    """engine.h20_ops.sparse_mla_decode takes the paged kernel for both layouts and unequal page sizes
    (flat slot ids of each cache; the decode lists offset the extra ones), with and without a split."""
    from engine.h20_ops import plan_sparse_decode, sparse_mla_decode

    case = testing.decode_case(h_q + block_sizes[0], batch=5, s_q=2, h_q=h_q, topk=128, extra_topk=192,
                               layout=LAYOUTS[layout_name], block_sizes=block_sizes, device="cuda",
                               n_slots=(1500, 2500), block_pad=2)
    plan = plan_sparse_decode(case.main.cache, batch=5, s_q=2, h_q=h_q, topk=128, q_dtype=torch.bfloat16,
                              extra_cache=case.extra.cache, extra_topk=192, num_splits=num_splits,
                              backend="tilelang")
    assert plan.path == "paged_fp8"
    got = sparse_mla_decode(case.q, case.main.cache, case.indices, case.sm_scale, plan=plan, **case.kwargs())
    ref = case.oracle()
    testing.assert_close("out", got.out, ref.out,
                         testing.out_tolerance(testing.DECODE_OUT, got.out, split=plan.splits > 1))
    testing.assert_close("lse", got.lse_log2 / LOG2E, ref.lse, testing.DECODE_LSE)


@pytest.mark.gpu
def test_scales_above_2_to_the_7_dequantize_exactly():
    """the fp8 quantizer writes ue8m0 scale bytes up to 247 (tiles with |x| > 57344 get scales above 2^7), where
    the conversion's single bf16 factor 2^(t - 7) would overflow: such groups take two factors. One entry
    per query (P = 1), so out is that row as gather_dequant / the torch reference dequantize it, bit for
    bit; every 64-dim group of a row has its own magnitude, 2^-10 .. 2^100."""
    from engine.h20_ops.attention.tilelang_sm90_paged_fp8 import sparse_mla_fwd_sm90_paged_fp8

    dev, block_size, n = torch.device("cuda"), 64, 256
    g = torch.Generator(device=dev).manual_seed(7)
    exponents = torch.tensor([-10, 0, 15, 16, 17, 40, 80, 100], device=dev, dtype=torch.float32)
    pick = (torch.arange(n, device=dev)[:, None] + torch.arange(8, device=dev)[None, :]) % 8  # [n, 8 groups]
    magnitude = torch.exp2(exponents[pick]).repeat_interleave(64, dim=1)  # [n, 512]
    kv = (torch.randn(n, 1, 512, generator=g, device=dev) * magnitude[:, None, :]).bfloat16()
    cache = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, n // block_size, block_size, dev)
    kv_cache.quantize_into_cache(cache, torch.arange(n, device=dev), kv)
    scale_bytes = cache.view(n // block_size, -1)[:, block_size * 576:block_size * 584].reshape(n, 8)[:, :7]
    # groups on both sides of 2^7, in rows that take the two-factor conversion (the single-factor rows: the
    # other tests)
    assert int(scale_bytes.max()) > 134 and int(scale_bytes.min()) < 134
    rows = kv_cache.dequantize_from_cache_ref(cache, torch.arange(n, device=dev), torch.bfloat16)
    assert torch.isfinite(rows.float()).all()
    q = (torch.randn(n, 64, 512, generator=g, device=dev) * 0.1).bfloat16()
    idx = torch.arange(n, device=dev, dtype=torch.int32).view(n, 1)
    out, _ = sparse_mla_fwd_sm90_paged_fp8(q, cache, None, idx, 512 ** -0.5)
    assert torch.equal(out, rows[:, 0, :].unsqueeze(1).expand(n, 64, 512))


@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [64, 128])
def test_v32_any_fp32_scale_dequantizes_exactly(h_q):
    """V3.2 scales are fp32, not only the quantizer's powers of two (another writer may store amax / 448):
    the kernel rounds e4m3 * scale to fp32, then to bf16, as the torch reference does. Every e4m3 code but
    NaN, scales with random mantissas over 2^-100 .. 2^100, pages of 53 tokens; one entry per query
    (P = 1), so out is the dequantized row's first 512 dims (V) bit for bit."""
    from engine.h20_ops.attention.tilelang_sm90_paged_fp8 import sparse_mla_fwd_sm90_paged_fp8

    dev, block_size, num_blocks = torch.device("cuda"), 53, 5
    n = block_size * num_blocks
    gen = torch.Generator().manual_seed(11)
    cache = kv_cache.new_fp8_kv_cache(kv_cache.V32, num_blocks, block_size, "cpu")
    kv_cache.quantize_into_cache_ref(cache, torch.arange(n), testing.normal_inputs(gen, n, 1, 576))
    tokens = cache.view(n, 656)  # V3.2 blocks are dense tokens
    codes = torch.randint(0, 254, (n, 512), generator=gen, dtype=torch.int64)
    codes = torch.where(codes >= 0x7F, codes + 1, codes)  # 0..254 without 0x7f (NaN); 0xff (NaN) excluded
    tokens[:, :512] = codes.to(torch.uint8)
    scales = (1 + torch.rand(n, 4, generator=gen)) * torch.exp2(torch.randint(-100, 101, (n, 4), generator=gen).float())
    tokens[:, 512:528] = scales.contiguous().view(torch.uint8)
    rows = kv_cache.dequantize_from_cache_ref(cache, torch.arange(n), torch.bfloat16)  # on the CPU: no flushing
    assert torch.isfinite(rows.float()).all()
    q = (torch.randn(n, h_q, 576, generator=gen) * 0.1).bfloat16().to(dev)
    idx = torch.arange(n, dtype=torch.int32).view(n, 1).to(dev)
    out, lse = sparse_mla_fwd_sm90_paged_fp8(q, cache.to(dev), None, idx, 576 ** -0.5)
    assert torch.equal(out.cpu(), rows[:, 0, :512].unsqueeze(1).expand(n, h_q, 512))
    assert torch.isfinite(lse).all()
