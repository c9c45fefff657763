"""fp8 KV cache: byte positions of both layouts, Triton == torch reference byte for byte, round-trip
error within the e4m3 bound, gather-dequant into strided window buffers, bad input."""

import math

import pytest
import torch

import engine.h20_ops  # noqa: F401
from engine.h20_ops import kv_cache as kq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def storage_bytes(cache: torch.Tensor) -> torch.Tensor:
    """Every byte of the cache's storage (padding included) as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=cache.device).set_(cache.untyped_storage())


def expected_exponent(amax: float) -> int:
    """The documented formula in float64 (exact enough away from 2^k boundaries)."""
    return math.ceil(math.log2(max(amax / 448.0, 1e-4)))


def random_rows(n: int, d: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes from 2^-24 to 2^12 per row, so small scales, the 1e-4 floor and e4m3 subnormals occur
    mag = torch.exp2(torch.randint(-24, 12, (n, 1, 1), generator=g).float())
    rows = torch.randn(n, 1, d, generator=g) * mag
    return rows.to(dtype)


def sentinel_cache(layout, num_blocks, block_size) -> torch.Tensor:
    cache = kq.new_fp8_kv_cache(layout, num_blocks, block_size, DEVICE)
    storage_bytes(cache).fill_(0xA5)  # bytes nobody writes must keep this value
    return cache


def test_layout_sizes_and_allocation():
    assert kq.MODEL1.num_tiles == 7 and kq.V32.num_tiles == 4
    assert kq.block_bytes(kq.MODEL1, 64) == 65 * 576  # 64 * 584 = 37376 -> next multiple of 576
    assert kq.block_bytes(kq.MODEL1, 1) == 2 * 576
    assert kq.block_bytes(kq.MODEL1, 72) == 72 * 584  # 42048 = 73 * 576 exactly: no padding
    assert kq.block_bytes(kq.V32, 3) == 3 * 656
    cache = kq.new_fp8_kv_cache(kq.MODEL1, 4, 64, DEVICE)
    assert cache.shape == (4, 64, 1, 584) and cache.stride(0) == 65 * 576 and cache.stride(1) == 584
    assert storage_bytes(cache).numel() == 4 * 65 * 576
    assert kq.layout_of(cache) is kq.MODEL1
    assert kq.layout_of(kq.new_fp8_kv_cache(kq.V32, 2, 3, DEVICE)) is kq.V32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_model1_bytes_at_documented_positions(dtype):
    block_size, num_blocks = 5, 3
    cache = sentinel_cache(kq.MODEL1, num_blocks, block_size)
    slots = torch.tensor([7, 0, 14, 3], dtype=torch.int32)
    kv = random_rows(len(slots), 512, dtype, seed=1)
    kq.quantize_into_cache(cache, slots.to(DEVICE), kv.to(DEVICE))
    raw = storage_bytes(cache).cpu()
    block_stride = kq.block_bytes(kq.MODEL1, block_size)
    touched = torch.zeros_like(raw, dtype=torch.bool)
    for row, slot in enumerate(slots.tolist()):
        base = (slot // block_size) * block_stride
        t = slot % block_size
        x = kv[row, 0].float()
        data = base + t * 576
        scales = base + block_size * 576 + t * 8
        for tile in range(7):
            vals = x[tile * 64:(tile + 1) * 64]
            e = expected_exponent(vals.abs().max().item())
            codes = (vals / 2.0 ** e).to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(raw[data + tile * 64:data + (tile + 1) * 64], codes), (slot, tile)
            assert raw[scales + tile].item() == e + 127, (slot, tile)
        assert raw[scales + 7].item() == 0  # pad byte
        rope = x[448:].to(torch.bfloat16).view(torch.uint8)
        assert torch.equal(raw[data + 448:data + 576], rope)
        touched[data:data + 576] = True
        touched[scales:scales + 8] = True
    assert (raw[~touched] == 0xA5).all()  # other tokens, block padding: untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_v32_bytes_at_documented_positions(dtype):
    block_size, num_blocks = 3, 2
    storage = torch.full((num_blocks, (block_size + 1) * 656), 0xA5, dtype=torch.uint8, device=DEVICE)
    # FlashMLA's own tests pad each V3.2 block by one token: block stride (bs + 1) * 656
    cache = storage[:, :block_size * 656].view(num_blocks, block_size, 1, 656)
    slots = torch.tensor([4, 0, 2], dtype=torch.int64)
    kv = random_rows(len(slots), 576, dtype, seed=2)
    kq.quantize_into_cache(cache, slots.to(DEVICE), kv.to(DEVICE))
    raw = storage.view(-1).cpu()
    touched = torch.zeros_like(raw, dtype=torch.bool)
    for row, slot in enumerate(slots.tolist()):
        tok = (slot // block_size) * (block_size + 1) * 656 + (slot % block_size) * 656
        x = kv[row, 0].float()
        for tile in range(4):
            vals = x[tile * 128:(tile + 1) * 128]
            e = expected_exponent(vals.abs().max().item())
            codes = (vals / 2.0 ** e).to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(raw[tok + tile * 128:tok + (tile + 1) * 128], codes)
            scale = raw[tok + 512 + 4 * tile:tok + 516 + 4 * tile].clone().view(torch.float32).item()
            assert scale == 2.0 ** e
        assert torch.equal(raw[tok + 528:tok + 656], x[512:].to(torch.bfloat16).view(torch.uint8))
        touched[tok:tok + 656] = True
    assert (raw[~touched] == 0xA5).all()


def test_scale_exponents_exact_at_boundaries():
    ks = torch.arange(-20, 20)
    at = 448.0 * torch.exp2(ks.double())
    assert torch.equal(kq.scale_exponents(at.float()), ks.clamp_min(-13).int())
    above = (at.float().view(torch.int32) + 1).view(torch.float32)  # next float above 448 * 2^k
    assert torch.equal(kq.scale_exponents(above), (ks + 1).clamp_min(-13).int())
    below = (at.float().view(torch.int32) - 1).view(torch.float32)
    assert torch.equal(kq.scale_exponents(below), ks.clamp_min(-13).int())
    assert kq.scale_exponents(torch.tensor([0.0, 1e-30, 448e-4])).tolist() == [-13, -13, -13]
    vals = torch.rand(4096) * torch.exp2(torch.randint(-30, 30, (4096,)).float())
    expected = [expected_exponent(v) for v in vals.tolist()]
    assert kq.scale_exponents(vals).tolist() == expected


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (torch.equal takes -0.0 == +0.0; the dequantized sign of zero is checked)."""
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(ints[a.dtype]), b.contiguous().view(ints[b.dtype]))


def tricky_rows(d: int, dtype) -> torch.Tensor:
    rows = random_rows(24, d, dtype, seed=3).float()
    rows[0] = 0.0  # all-zero row: e = -13
    rows[1, 0, :] = -0.0
    rows[2, 0, :64] = 448.0  # amax exactly 448 * 2^0
    # e4m3 round-half-even ties at scale 1: between 1.0 and 1.125 is 1.0625 -> 1.0; 1.1875 -> 1.25;
    # subnormal ties (units of 2^-9): 2.5 * 2^-9 -> 2, 3.5 * 2^-9 -> 4
    rows[3, 0, :8] = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 2.5 / 512, 3.5 / 512, -0.5 / 512, 0.5 / 512])
    rows[4, 0, :] = 1e-7  # below the 1e-4 floor: codes in the subnormal range / zero
    return rows.to(dtype)


@pytest.mark.parametrize("layout", [kq.MODEL1, kq.V32], ids=lambda l: l.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_equals_reference_byte_for_byte(layout, dtype):
    block_size, num_blocks = 4, 8
    kv = tricky_rows(layout.d, dtype).to(DEVICE)
    n = kv.size(0)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(4))[:n].int()
    slots[5], slots[9], slots[11] = -1, num_blocks * block_size, -123456  # empty: skipped
    slots = slots.to(DEVICE)
    ref, tri = sentinel_cache(layout, num_blocks, block_size), sentinel_cache(layout, num_blocks, block_size)
    kq.quantize_into_cache_ref(ref, slots, kv)
    kq.quantize_into_cache(tri, slots, kv)
    assert torch.equal(storage_bytes(ref), storage_bytes(tri))
    changed = (storage_bytes(ref) != 0xA5).sum().item()
    assert changed > (n - 3) * layout.d_nope // 2  # something was written


@pytest.mark.parametrize("layout", [kq.MODEL1, kq.V32], ids=lambda l: l.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_and_gather_into_strided_window(layout, dtype):
    block_size, num_blocks = 3, 6
    capacity = num_blocks * block_size
    kv = tricky_rows(layout.d, dtype)[:capacity].to(DEVICE)
    slots = torch.randperm(capacity, generator=torch.Generator().manual_seed(5)).int().to(DEVICE)
    cache = kq.new_fp8_kv_cache(layout, num_blocks, block_size, DEVICE)
    kq.quantize_into_cache(cache, slots, kv)
    # Read back through a [B, W] slot table with empty entries, into buf[:, 1:1+W] of a NaN buffer.
    batch, width = 3, 7
    table = torch.full((batch, width), -1, dtype=torch.int32)
    table[:, :6] = slots.cpu().view(batch, 6)
    table[1, 6] = capacity  # out of range: empty
    table[2, 6] = torch.iinfo(torch.int32).min
    table = table.to(DEVICE)
    buf = torch.full((batch, width + 3, 1, layout.d), float("nan"), dtype=dtype, device=DEVICE)
    kq.gather_dequant(cache, table, buf[:, 1:1 + width])
    assert torch.isnan(buf[:, 0]).all() and torch.isnan(buf[:, 1 + width:]).all()  # outside: untouched
    got = buf[:, 1:1 + width]
    assert (got[:, 6] == 0).all()  # empty slots -> zero rows
    want = kq.dequantize_from_cache_ref(cache, table, dtype)
    assert same_bits(got, want)
    assert (torch.signbit(got[1 // 6, 1 % 6]) == torch.signbit(kv[1].to(dtype))).all()  # row 1 is -0.0
    # round trip: per tile |err| <= max(|x| * 2^-4, scale * 2^-10); RoPE is bf16 (exact for bf16 input)
    x = kv.float().view(batch, 6, layout.d)
    back = got[:, :6, 0].float()
    nope_x = x[..., :layout.d_nope].reshape(batch, 6, layout.num_tiles, layout.tile)
    scale = torch.exp2(kq.scale_exponents(nope_x.abs().amax(-1)).float())[..., None]
    err = (back[..., :layout.d_nope].reshape_as(nope_x) - nope_x).abs()
    assert (err <= torch.maximum(nope_x.abs() * 2.0 ** -4, scale * 2.0 ** -10)).all()
    assert torch.equal(back[..., layout.d_nope:], x[..., layout.d_nope:].to(torch.bfloat16).float())
    rel = (err.sum() / nope_x.abs().sum()).item()
    assert 1e-3 < rel < 2.0 ** -4  # really quantized, and within the bound on average


def test_float8_cache_dtype_and_1d_flashmla_view():
    cache = kq.new_fp8_kv_cache(kq.MODEL1, 2, 4, DEVICE).view(torch.float8_e4m3fn)  # FlashMLA's dtype
    kv = random_rows(2, 512, torch.bfloat16, seed=6).to(DEVICE)
    slots = torch.tensor([5, 2], dtype=torch.int32, device=DEVICE)
    kq.quantize_into_cache(cache, slots, kv)
    out = torch.empty(1, 2, 1, 512, dtype=torch.bfloat16, device=DEVICE)
    kq.gather_dequant(cache, slots[None], out)
    assert same_bits(out[0], kq.dequantize_from_cache_ref(cache, slots, torch.bfloat16))


def test_bad_inputs_name_the_argument():
    cache = kq.new_fp8_kv_cache(kq.MODEL1, 2, 4, DEVICE)
    kv = torch.randn(2, 1, 512, device=DEVICE)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="cache"):
        kq.quantize_into_cache(torch.zeros(2, 4, 1, 600, dtype=torch.uint8, device=DEVICE), slots, kv)
    with pytest.raises(TypeError, match="cache"):
        kq.quantize_into_cache(cache.view(torch.int8), slots, kv)
    with pytest.raises(TypeError, match="slots"):
        kq.quantize_into_cache(cache, slots.float(), kv)
    with pytest.raises(ValueError, match="kv"):
        kq.quantize_into_cache(cache, slots, torch.randn(2, 1, 576, device=DEVICE))
    with pytest.raises(ValueError, match="kv"):
        kq.quantize_into_cache(cache, slots[:1], kv)
    with pytest.raises(TypeError, match="kv"):
        kq.quantize_into_cache(cache, slots, kv.half())
    with pytest.raises(ValueError, match="out"):
        kq.gather_dequant(cache, slots[None], torch.empty(1, 2, 1, 576, device=DEVICE))
    with pytest.raises(TypeError, match="out"):
        kq.gather_dequant(cache, slots[None], torch.empty(1, 2, 1, 512, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="slots"):
        kq.gather_dequant(cache, slots[None, None], torch.empty(1, 2, 1, 512, device=DEVICE))
    with pytest.raises(ValueError, match="layout"):
        kq.new_fp8_kv_cache("MODEL1", 1, 1, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [kq.MODEL1, kq.V32], ids=lambda l: l.name)
def test_gpu_many_tokens_byte_exact(layout):
    """On the GPU (hardware casts in the torch reference, Triton's integer codec): 8192 tokens."""
    block_size, num_blocks = 64, 160
    n = 8192
    kv = random_rows(n, layout.d, torch.bfloat16, seed=7).cuda()
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(8))[:n].int().cuda()
    ref, tri = (kq.new_fp8_kv_cache(layout, num_blocks, block_size, "cuda") for _ in range(2))
    kq.quantize_into_cache_ref(ref, slots, kv)
    kq.quantize_into_cache(tri, slots, kv)
    assert torch.equal(storage_bytes(ref), storage_bytes(tri))
    table = slots.view(64, n // 64)
    out = torch.empty(64, n // 64, 1, layout.d, dtype=torch.bfloat16, device="cuda")
    kq.gather_dequant(tri, table, out)
    assert same_bits(out, kq.dequantize_from_cache_ref(ref, table, torch.bfloat16))
