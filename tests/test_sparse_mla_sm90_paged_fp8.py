"""The TileLang SM90 sparse MLA decode kernel over two paged fp8 MODEL1 caches
(engine.h20_ops.attention.tilelang_sm90_paged_fp8).

CPU: both variants (h_q 64, 128) lower and nvcc-compile for sm_90a; ptxas keeps the wgmmas
asynchronous without spills; the producer stages the fp8 bytes with 16-byte cp.async, the consumers
convert them behind their own barriers, and O leaves by TMA; the kernel waits for the previous
kernel before any global access (programmatic dependent launch); bad caches are rejected by name. GPU (@pytest.mark.gpu): against the float32 oracle on the
torch-dequantized rows of both caches (cache 0's rows, then cache 1's: the kernel's indices are
absolute rows of that concatenation), with invalid fillers, lengths, sinks and e4m3 NaN codes in every
slot no valid entry selects; rows with scales above 2^7 (two conversion factors), bit for bit."""

import math
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

from engine.h20_ops import kv_cache
from engine.h20_ops.attention.reference import sparse_mla_prefill_ref

tilelang = pytest.importorskip("tilelang", reason="tilelang is not installed (pip install '.[tilelang]')")

LOG2E = 1.0 / math.log(2.0)
INT_MIN, INT_MAX = -(2 ** 31), 2 ** 31 - 1


@pytest.mark.parametrize("h_q", [64, 128])
def test_kernel_compiles_async_without_spills(h_q):
    from engine.h20_ops.attention import tilelang_sm90_paged_fp8 as fp8

    kernel = fp8.compiled_kernel(h_q)
    src = kernel.get_kernel_source()
    # the conversion: definitions, then one call per consumer and half (left: per row, 2 pairs of groups;
    # right: both rows of the thread, 3 pairs)
    assert "fp8_cp16s(" in src and src.count("fp8_cvt_left(") == 1 + 2 and src.count("fp8_cvt_right(") == 1 + 2
    assert src.count("tma_store(") == 2 and "Out[" not in src
    # cp.async arrivals: each half's in both gather orders (Q arrives by TMA, one box per 64 columns);
    # each consumer converts the halves it reads first behind its own 128-thread barrier (named
    # barriers 6 and 7)
    assert src.count("mbarrier_cp_async_arrive_noinc(") == 2 * 4 and "__launch_bounds__(384, 1)" in src
    assert src.count("tma_load(Q_desc,") == 512 // 64
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


def test_rejects_bad_caches():
    from engine.h20_ops.attention.tilelang_sm90_paged_fp8 import cache_views

    good = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 2, 16, "cpu")
    with pytest.raises(TypeError, match="cache0"):
        cache_views(good.float(), "cache0")
    with pytest.raises(ValueError, match="cache1"):
        cache_views(torch.zeros(2, 16, 1, 656, dtype=torch.uint8), "cache1")
    with pytest.raises(ValueError, match="cache0"):
        cache_views(torch.zeros(2, 16, 1, 585, dtype=torch.uint8)[..., 1:], "cache0")  # not 16-byte aligned
    flat, _, _, n_slots, block_size, _ = cache_views(good, "cache0")
    assert (n_slots, block_size) == (32, 16) and flat.dtype == torch.uint8


# ---------------------------------------------------------------------------------------- GPU


def _nan_fill_unselected(cache, used, block_size):
    """e4m3 NaN codes (0x7f) in the NoPE bytes of every slot of `cache` not in `used` (bool [n_slots])."""
    slots = (~used).nonzero().flatten()
    if slots.numel():
        blocks = cache.view(cache.size(0), -1)
        b, t = slots // block_size, slots % block_size
        blocks[b[:, None], t[:, None] * 576 + torch.arange(448, device=cache.device)[None, :]] = 0x7F


def _case(batch, s_q, h_q, n_win, n_cmp, seed, *, invalid=0.0, lengths=False, sink=False, block_size=64):
    """Two caches of different sizes; per sequence n_win window-like entries of cache 0 shared by its
    queries, per query n_cmp compressed-like entries of cache 1 (offset by n_slots0)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    sizes = (-(-(batch * n_win + 300) // block_size), -(-(batch * s_q * n_cmp + 1000) // block_size) + 3)
    caches = []
    for nb in sizes:
        cache = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, nb, block_size, dev)
        n = nb * block_size
        kv_cache.quantize_into_cache(cache, torch.arange(n, device=dev),
                                     (torch.randn(n, 1, 512, generator=g, device=dev) * 0.1).bfloat16())
        caches.append(cache)
    n0, n1 = (nb * block_size for nb in sizes)
    win = torch.randperm(n0, generator=g, device=dev)[:batch * n_win].view(batch, 1, n_win).int()
    cmp = torch.randperm(n1, generator=g, device=dev)[:batch * s_q * n_cmp].view(batch, s_q, n_cmp).int() + n0
    idx = torch.cat([win.expand(batch, s_q, n_win), cmp], dim=2).reshape(batch * s_q, n_win + n_cmp).contiguous()
    topk = n_win + n_cmp
    idx[:, 0], idx[:, -1] = n0 - 1, n0 + n1 - 1  # both caches' last slots
    if invalid:
        fill = torch.tensor([-1, n0 + n1, INT_MIN, INT_MAX, n0 + n1 + 7], dtype=torch.int32, device=dev)
        pick = torch.rand(idx.shape, generator=g, device=dev) < invalid
        idx = torch.where(pick, fill[torch.randint(0, 5, idx.shape, generator=g, device=dev)], idx)
    topk_length = None
    if lengths:
        topk_length = torch.randint(0, topk + 1, (batch * s_q,), generator=g, device=dev, dtype=torch.int32)
        topk_length[0] = 0
    limit = torch.full((batch * s_q,), topk, device=dev) if topk_length is None else topk_length.long()
    chosen = idx[torch.arange(topk, device=dev)[None, :] < limit[:, None]].long()
    used = torch.zeros(n0 + n1, dtype=torch.bool, device=dev)
    used[chosen[(chosen >= 0) & (chosen < n0 + n1)]] = True
    _nan_fill_unselected(caches[0], used[:n0], block_size)
    _nan_fill_unselected(caches[1], used[n0:], block_size)
    rows = torch.cat([kv_cache.dequantize_from_cache_ref(c, torch.arange(n, device=dev), torch.bfloat16)
                      for c, n in zip(caches, (n0, n1))])
    q = (torch.randn(batch * s_q, h_q, 512, generator=g, device=dev) * 0.1).bfloat16()
    attn_sink = None
    if sink:
        attn_sink = torch.randn(h_q, generator=g, device=dev)
        attn_sink[: h_q // 3] = float("inf")
        attn_sink[h_q // 3: 2 * h_q // 3] = float("-inf")
    return q, caches, rows, idx, attn_sink, topk_length


@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("batch,s_q,n_win,n_cmp,extras", [
    (1, 1, 128, 512, {}),
    (4, 2, 128, 512, {"invalid": 0.2, "lengths": True, "sink": True}),
    (3, 1, 100, 37, {"invalid": 0.2}),  # topk not a multiple of 64
    (1, 2, 1, 0, {}),  # one entry
    (300, 1, 64, 64, {"lengths": True}),  # CTAs serving several items
])
def test_matches_oracle(h_q, batch, s_q, n_win, n_cmp, extras):
    from engine.h20_ops.attention.tilelang_sm90_paged_fp8 import sparse_mla_fwd_sm90_paged_fp8

    q, caches, rows, idx, attn_sink, topk_length = _case(batch, s_q, h_q, n_win, n_cmp, seed=batch + h_q, **extras)
    sm_scale = 512 ** -0.5
    out, lse = sparse_mla_fwd_sm90_paged_fp8(q, caches[0], caches[1], idx, sm_scale, attn_sink=attn_sink,
                                             topk_length=topk_length)
    ref = sparse_mla_prefill_ref(q, rows, idx, sm_scale, attn_sink=attn_sink, topk_length=topk_length)
    ref_lse2 = ref.lse * LOG2E
    empty = torch.isinf(ref_lse2)
    assert torch.equal(torch.isinf(lse), empty)
    assert torch.isfinite(out.float()).all()
    err = (out.float() - ref.out).abs()
    assert bool((err <= torch.maximum(torch.full_like(err, 8e-4), ref.out.abs() * (3.01 / 128))).all()), err.max()
    lse_err = (lse[~empty] - ref_lse2[~empty]).abs()
    assert bool((lse_err <= torch.maximum(torch.full_like(lse_err, 1e-5), ref_lse2[~empty].abs() * 4.01 / 65536)).all())


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
