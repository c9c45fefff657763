"""fp8 paged KV cache: DeepSeek-V4 "MODEL1" and DeepSeek-V3.2 layouts, byte-exact.

A cache is a uint8 (or float8_e4m3fn) tensor [num_blocks, block_size, 1, bytes_per_token], the
shape FlashMLA's fp8 decode takes; its last dim contiguous, its token stride bytes_per_token, its
base and block stride (stride(0), bytes; may exceed block_size * bytes_per_token) 4-byte aligned.
A slot is `block * block_size + offset`.

Layouts (bytes; all little-endian):
  MODEL1 (V4, d 512 = 448 NoPE + 64 RoPE, 584 B/token), per PAGE BLOCK, not per token:
    [0, bs*576)              token t at t*576: [448 e4m3 NoPE | 64 bf16 RoPE = 128 B]
    [bs*576, bs*584)         token t at bs*576 + t*8: [7 ue8m0 scales, one per 64 NoPE dims | 1 pad (0)]
    block size padded up to a multiple of 576 by new_fp8_kv_cache.
    So the [block_size, 584] axes of a MODEL1 cache are a byte view of the block, not token rows.
  V32 (V3.2, d 576 = 512 NoPE + 64 RoPE, 656 B/token), per token at t*656:
    [512 e4m3 NoPE | 4 fp32 scales, one per 128 dims | 64 bf16 RoPE = 128 B]

Numerics: per NoPE tile, scale = 2^e with e = ceil(log2(max(amax / 448, 1e-4))); code = e4m3fn
round-to-nearest-even of x / scale (|x / scale| <= 448, no saturation needed). ue8m0 byte = e + 127.
RoPE is stored as bf16 (fp32 input is rounded to nearest even). Dequantization fp8 * 2^e is exact in
bf16 and fp32, so the dtype of the dequantized rows does not change their values (except at the top
of fp32's range: a tile whose amax lies within an e4m3 rounding step of 2^128 can round to a code
that dequantizes to +-inf).
Deliberate deviation: e is computed exactly from amax's exponent bits instead of libm log2, which
can round log2 of a value just above 2^k down to k (then x / scale could exceed 448).
Inputs must be finite. The quantizer never produces the e4m3 NaN code (0x7f/0xff).

Triton kernels (`quantize_into_cache`, `gather_dequant`) encode and decode e4m3 with integer bit
operations, not casts: Triton's interpreter truncates fp32 -> fp8/bf16 casts instead of rounding,
and integer code is exact everywhere, so Triton == the torch reference byte for byte on CPU and GPU.
Slots outside [0, num_blocks * block_size) (e.g. -1) are empty: never dereferenced; quantize skips
them, gather writes a zero row.
On SM90 gather_dequant uses programmatic dependent launch (it waits for the previous kernel of the
stream before touching memory, so its launch overlaps that kernel's end; engine.h20_ops.dependent_launch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..platform import dependent_launch
from ..checks import require_same_device, require_tensor

FP8_MAX = 448.0
MIN_SCALE_EXP = -13  # ceil(log2(1e-4)): the 1e-4 floor of amax / 448


@dataclass(frozen=True)
class Fp8KvLayout:
    name: str
    d: int  # row width (NoPE + RoPE)
    d_nope: int  # quantized dims
    d_rope: int  # bf16 dims
    tile: int  # NoPE dims per scale
    bytes_per_token: int

    @property
    def num_tiles(self) -> int:
        return self.d_nope // self.tile


MODEL1 = Fp8KvLayout("MODEL1", d=512, d_nope=448, d_rope=64, tile=64, bytes_per_token=584)
V32 = Fp8KvLayout("V32", d=576, d_nope=512, d_rope=64, tile=128, bytes_per_token=656)
LAYOUTS = (MODEL1, V32)
_MODEL1_DATA_BYTES = 576  # per token in the first part of a MODEL1 block
_MODEL1_SCALE_BYTES = 8


def layout_of(cache: torch.Tensor) -> Fp8KvLayout:
    for layout in LAYOUTS:
        if cache.size(-1) == layout.bytes_per_token:
            return layout
    raise ValueError(f"cache: expected last dim {' or '.join(str(l.bytes_per_token) for l in LAYOUTS)} "
                     f"(bytes per token of {', '.join(l.name for l in LAYOUTS)}), got shape {tuple(cache.shape)}")


def block_bytes(layout: Fp8KvLayout, block_size: int) -> int:
    """Bytes one page block occupies in a cache from new_fp8_kv_cache."""
    raw = block_size * layout.bytes_per_token
    if layout is MODEL1:
        return -(-raw // _MODEL1_DATA_BYTES) * _MODEL1_DATA_BYTES
    return raw


def new_fp8_kv_cache(layout: Fp8KvLayout, num_blocks: int, block_size: int, device) -> torch.Tensor:
    """A zeroed cache [num_blocks, block_size, 1, bytes_per_token] uint8 (padded blocks for MODEL1)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(l.name for l in LAYOUTS)}, got {layout!r}")
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks, block_size: expected >= 1, got {num_blocks}, {block_size}")
    storage = torch.zeros((num_blocks, block_bytes(layout, block_size)), dtype=torch.uint8, device=device)
    return storage[:, :block_size * layout.bytes_per_token].view(num_blocks, block_size, 1, layout.bytes_per_token)


def _check_cache(cache) -> tuple[Fp8KvLayout, torch.Tensor]:
    """Returns the layout and the cache as uint8."""
    require_tensor("cache", cache, dtypes=(torch.uint8, torch.float8_e4m3fn), ndim=4)
    layout = layout_of(cache)
    num_blocks, block_size, heads, _ = cache.shape
    if heads != 1:
        raise ValueError(f"cache: expected shape [num_blocks, block_size, 1, bytes], got {tuple(cache.shape)}")
    if cache.stride(3) != 1 or cache.stride(1) != layout.bytes_per_token:
        raise ValueError(f"cache: expected token stride {layout.bytes_per_token} and a contiguous last dim, "
                         f"got strides {cache.stride()}")
    if num_blocks > 1 and cache.stride(0) < block_size * layout.bytes_per_token:
        raise ValueError(f"cache: block stride {cache.stride(0)} overlaps blocks of {block_size} tokens")
    # Scales and RoPE are accessed as fp32 / bf16 words: 4-byte alignment of every block.
    if cache.stride(0) % 4 != 0 or cache.data_ptr() % 4 != 0:
        raise ValueError(f"cache: expected a 4-byte aligned base and block stride, got strides {cache.stride()}")
    return layout, cache.view(torch.uint8)


def _block_rows(cache_u8: torch.Tensor, layout: Fp8KvLayout) -> torch.Tensor:
    """[num_blocks, block_size * bytes_per_token] byte view of each block's bytes."""
    num_blocks, block_size = cache_u8.shape[:2]
    return torch.as_strided(cache_u8, (num_blocks, block_size * layout.bytes_per_token), (cache_u8.stride(0), 1))


def _check_slots(name: str, slots, cache: torch.Tensor, ndim) -> None:
    require_tensor(name, slots, dtypes=(torch.int32, torch.int64), ndim=ndim)
    require_same_device("cache", cache, **{name: slots})


def _check_kv(kv, layout: Fp8KvLayout, n: int, cache: torch.Tensor) -> None:
    require_tensor("kv", kv, dtypes=(torch.bfloat16, torch.float32), ndim=3)
    require_same_device("cache", cache, kv=kv)
    if kv.shape[0] != n or kv.shape[1] != 1 or kv.shape[2] != layout.d:
        raise ValueError(f"kv: expected shape [{n}, 1, {layout.d}] (one row per slot, {layout.name}), "
                         f"got {tuple(kv.shape)}")
    if kv.stride(2) != 1:
        raise ValueError(f"kv: the last dim must be contiguous, got strides {kv.stride()}")


# ---------------------------------------------------------------------------------------------
# torch reference
# ---------------------------------------------------------------------------------------------

def scale_exponents(amax: torch.Tensor) -> torch.Tensor:
    """e = ceil(log2(max(amax / 448, 1e-4))) exactly, from the fp32 bits of amax >= 0 (int32)."""
    bits = amax.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) - 127
    # amax = m * 2^E, m in [1, 2): amax / 448 = (m / 1.75) * 2^(E - 8), and m / 1.75 in (0.5, 1]
    # exactly when m <= 1.75, i.e. mantissa bits <= 0x600000.
    e = exponent - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return e.clamp_min(MIN_SCALE_EXP)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as fp32 for int32 e in [-126, 127], built from the exponent bits (exact on every device;
    exp2 on CUDA may be an approximation)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _token_views(blocks: torch.Tensor, layout: Fp8KvLayout, block_size: int):
    """(nope [nb, bs, d_nope] u8, scales [nb, bs, scale bytes] u8, rope [nb, bs, 2 * d_rope] u8)."""
    nb = blocks.size(0)
    if layout is MODEL1:
        data = blocks[:, :block_size * _MODEL1_DATA_BYTES].view(nb, block_size, _MODEL1_DATA_BYTES)
        scales = blocks[:, block_size * _MODEL1_DATA_BYTES:].view(nb, block_size, _MODEL1_SCALE_BYTES)
        return data[:, :, :layout.d_nope], scales, data[:, :, layout.d_nope:]
    rows = blocks.view(nb, block_size, layout.bytes_per_token)
    scale_end = layout.d_nope + 4 * layout.num_tiles
    return rows[:, :, :layout.d_nope], rows[:, :, layout.d_nope:scale_end], rows[:, :, scale_end:]


def _valid_slot_mask(slots: torch.Tensor, capacity: int) -> torch.Tensor:
    return (slots >= 0) & (slots < capacity)


def quantize_into_cache_ref(cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Quantize kv [n, 1, d] into cache at slots [n] (torch reference). Empty slots are skipped."""
    layout, cache_u8 = _check_cache(cache)
    _check_slots("slots", slots, cache, 1)
    _check_kv(kv, layout, slots.numel(), cache)
    num_blocks, block_size = cache_u8.shape[:2]
    keep = _valid_slot_mask(slots, num_blocks * block_size)
    slots, x = slots[keep].long(), kv[keep][:, 0, :].float()
    n = x.size(0)
    nope = x[:, :layout.d_nope].reshape(n, layout.num_tiles, layout.tile)
    e = scale_exponents(nope.abs().amax(dim=-1))  # [n, tiles]
    inv_scale = pow2(-e)
    codes = (nope * inv_scale[:, :, None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, layout.d_nope)
    rope = x[:, layout.d_nope:].to(torch.bfloat16).contiguous().view(torch.uint8)  # [n, 2 * d_rope]
    if layout is MODEL1:
        scale_bytes = torch.zeros((n, _MODEL1_SCALE_BYTES), dtype=torch.uint8, device=x.device)
        scale_bytes[:, :layout.num_tiles] = (e + 127).to(torch.uint8)
    else:
        scale_bytes = pow2(e).contiguous().view(torch.uint8)  # [n, 4 * tiles]
    nope_v, scales_v, rope_v = _token_views(_block_rows(cache_u8, layout), layout, block_size)
    block, offset = slots // block_size, slots % block_size
    nope_v[block, offset] = codes
    scales_v[block, offset] = scale_bytes
    rope_v[block, offset] = rope


def dequantize_from_cache_ref(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows at slots [*S] as [*S, 1, d] in dtype (torch reference); empty slots give zero rows."""
    layout, cache_u8 = _check_cache(cache)
    _check_slots("slots", slots, cache, (1, 2))
    num_blocks, block_size = cache_u8.shape[:2]
    flat = slots.reshape(-1).long()
    keep = _valid_slot_mask(flat, num_blocks * block_size)
    safe = torch.where(keep, flat, torch.zeros_like(flat))
    nope_v, scales_v, rope_v = _token_views(_block_rows(cache_u8, layout), layout, block_size)
    block, offset = safe // block_size, safe % block_size
    n = flat.numel()
    codes = nope_v[block, offset].contiguous().view(torch.float8_e4m3fn).float()
    if layout is MODEL1:
        scale = pow2(scales_v[block, offset][:, :layout.num_tiles].to(torch.int32) - 127)
    else:
        scale = scales_v[block, offset].contiguous().view(torch.float32)
    nope = (codes.view(n, layout.num_tiles, layout.tile) * scale[:, :, None]).reshape(n, layout.d_nope)
    rope = rope_v[block, offset].contiguous().view(torch.bfloat16).float()
    rows = torch.where(keep[:, None], torch.cat([nope, rope], dim=1), 0.0)
    return rows.to(dtype).view(*slots.shape, 1, layout.d)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _encode_e4m3(v):
    """fp32 (|v| <= 448) -> e4m3fn code (int32 0..255), round to nearest even, in integer ops."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal e4m3 (|v| >= 2^-6): round the fp32 mantissa to 3 bits, rebias the exponent (127 -> 7)
    rounded = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0x7FF00000
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)
    # subnormal e4m3 (|v| < 2^-6): an integer count of 2^-9, rounded half to even
    biased = mag >> 23
    mant = tl.where(biased > 0, (mag & 0x7FFFFF) | 0x800000, mag & 0x7FFFFF)
    shift = tl.minimum(141 - tl.maximum(biased, 1), 31)
    sub = (mant + ((1 << (shift - 1)) - 1) + ((mant >> shift) & 1)) >> shift
    return tl.where(mag < 0x3C800000, sub, normal) | sign


@triton.jit
def _decode_e4m3(code):
    """e4m3fn code (int32 0..255) -> fp32, in integer ops."""
    exp_field = (code >> 3) & 15
    mant = code & 7
    normal = (((exp_field + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exp_field == 0, mant.to(tl.float32) * 0.001953125, normal)
    # The sign as a bit: Triton's -x is 0 - x, which turns code 0x80 (-0) into +0.
    return (value.to(tl.int32, bitcast=True) | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _pow2(e):
    """2^e as fp32 for int32 e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _token_addresses(cache_ptr, block_stride, capacity, slot, BLOCK_SIZE: tl.constexpr, IS_MODEL1: tl.constexpr,
                     D_NOPE: tl.constexpr, TOKEN_BYTES: tl.constexpr):
    """(valid, token_base, scale_base) of slot (int64, scalar or tensor): the byte addresses of the
    token's NoPE codes and of its scales (layouts in the module header). A slot outside the cache is
    not valid and gets slot 0's addresses, which the caller masks."""
    valid = (slot >= 0) & (slot < capacity)
    slot = tl.where(valid, slot, 0)
    block_base = cache_ptr + (slot // BLOCK_SIZE) * block_stride
    t = slot % BLOCK_SIZE
    if IS_MODEL1:
        token_base = block_base + t * 576
        scale_base = block_base + BLOCK_SIZE * 576 + t * 8
    else:
        token_base = block_base + t * TOKEN_BYTES
        scale_base = token_base + D_NOPE
    return valid, token_base, scale_base


@triton.jit
def _quantize_kernel(cache_ptr, block_stride, capacity, slots_ptr, kv_ptr, kv_stride,
                     BLOCK_SIZE: tl.constexpr, IS_MODEL1: tl.constexpr, D_NOPE: tl.constexpr,
                     D_ROPE: tl.constexpr, TILE: tl.constexpr, NUM_TILES: tl.constexpr,
                     TILES_P2: tl.constexpr, TOKEN_BYTES: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    valid, token_base, scale_base = _token_addresses(cache_ptr, block_stride, capacity, slot, BLOCK_SIZE,
                                                     IS_MODEL1, D_NOPE, TOKEN_BYTES)
    tiles = tl.arange(0, TILES_P2)
    cols = tl.arange(0, TILE)
    in_tile = tiles < NUM_TILES
    src = kv_ptr + row.to(tl.int64) * kv_stride
    x = tl.load(src + tiles[:, None] * TILE + cols[None, :], mask=in_tile[:, None], other=0.0).to(tl.float32)
    amax_bits = tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True)
    e = (amax_bits >> 23) - 135 + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.maximum(e, -13)
    codes = _encode_e4m3(x * _pow2(-e)[:, None])
    tl.store(token_base + tiles[:, None] * TILE + cols[None, :], codes.to(tl.uint8),
             mask=in_tile[:, None] & valid)
    if IS_MODEL1:
        # ue8m0 bytes for the 7 tiles, 0 in the pad byte (TILES_P2 == 8)
        tl.store(scale_base + tiles, tl.where(in_tile, e + 127, 0).to(tl.uint8), mask=valid)
        rope_base = token_base + D_NOPE
    else:
        tl.store(scale_base.to(tl.pointer_type(tl.float32)) + tiles, _pow2(e), mask=in_tile & valid)
        rope_base = scale_base + 4 * NUM_TILES
    r = tl.arange(0, D_ROPE)
    rope_bits = tl.load(src + D_NOPE + r).to(tl.float32).to(tl.int32, bitcast=True)
    bf16_bits = (rope_bits + 0x7FFF + ((rope_bits >> 16) & 1)) >> 16  # fp32 -> bf16, nearest even
    tl.store(rope_base.to(tl.pointer_type(tl.int16)) + r, bf16_bits.to(tl.int16), mask=valid)


@triton.jit
def _gather_dequant_kernel(cache_ptr, block_stride, capacity, slots_ptr, slots_stride_b, out_ptr,
                           out_stride_b, out_stride_w, W, n_rows,
                           BLOCK_SIZE: tl.constexpr, IS_MODEL1: tl.constexpr, D_NOPE: tl.constexpr,
                           D_ROPE: tl.constexpr, TILE: tl.constexpr, NUM_TILES: tl.constexpr,
                           TILES_P2: tl.constexpr, TOKEN_BYTES: tl.constexpr, ROWS: tl.constexpr,
                           DEPENDENT_LAUNCH: tl.constexpr):
    if DEPENDENT_LAUNCH:  # wait for the previous kernel before touching memory; let the next one launch
        gdc_wait()
        gdc_launch_dependents()
    # ROWS output rows per program: their slot loads and then their row loads are issued together,
    # so a program waits for two memory latencies per ROWS rows instead of per row.
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_range = row < n_rows
    b = row // W
    w = row % W
    slot = tl.load(slots_ptr + b * slots_stride_b + w, mask=in_range, other=-1).to(tl.int64)
    valid, token_base, scale_base = _token_addresses(cache_ptr, block_stride, capacity, slot, BLOCK_SIZE,
                                                     IS_MODEL1, D_NOPE, TOKEN_BYTES)
    tiles = tl.arange(0, TILES_P2)
    cols = tl.arange(0, TILE)
    in_tile = tiles < NUM_TILES
    code_mask = (in_tile[None, :] & valid[:, None])[:, :, None]
    codes = tl.load(token_base[:, None, None] + tiles[None, :, None] * TILE + cols[None, None, :],
                    mask=code_mask, other=0).to(tl.int32)
    scale_mask = in_tile[None, :] & valid[:, None]
    if IS_MODEL1:
        scale = _pow2(tl.load(scale_base[:, None] + tiles[None, :], mask=scale_mask, other=127).to(tl.int32) - 127)
        rope_base = token_base + D_NOPE
    else:
        scale = tl.load(scale_base.to(tl.pointer_type(tl.float32))[:, None] + tiles[None, :], mask=scale_mask,
                        other=0.0)
        rope_base = scale_base + 4 * NUM_TILES
    nope = _decode_e4m3(codes) * scale[:, :, None]
    r = tl.arange(0, D_ROPE)
    rope = tl.load(rope_base.to(tl.pointer_type(tl.bfloat16))[:, None] + r[None, :], mask=valid[:, None], other=0.0)
    dst = out_ptr + b * out_stride_b + w * out_stride_w
    out_ty = out_ptr.dtype.element_ty
    tl.store(dst[:, None, None] + tiles[None, :, None] * TILE + cols[None, None, :], nope.to(out_ty),
             mask=(in_tile[None, :] & in_range[:, None])[:, :, None])
    tl.store(dst[:, None] + D_NOPE + r[None, :], rope.to(out_ty), mask=in_range[:, None])


def _layout_constexprs(layout: Fp8KvLayout, block_size: int) -> dict:
    return dict(BLOCK_SIZE=block_size, IS_MODEL1=layout is MODEL1, D_NOPE=layout.d_nope, D_ROPE=layout.d_rope,
                TILE=layout.tile, NUM_TILES=layout.num_tiles, TILES_P2=triton.next_power_of_2(layout.num_tiles),
                TOKEN_BYTES=layout.bytes_per_token)


def quantize_into_cache(cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Quantize kv [n, 1, d] (bf16 or fp32) into cache at slots [n] (Triton). Empty slots are skipped."""
    layout, cache_u8 = _check_cache(cache)
    _check_slots("slots", slots, cache, 1)
    _check_kv(kv, layout, slots.numel(), cache)
    num_blocks, block_size = cache_u8.shape[:2]
    if slots.numel() == 0:
        return
    _quantize_kernel[(slots.numel(),)](
        cache_u8, cache_u8.stride(0), num_blocks * block_size, slots.contiguous(), kv, kv.stride(0),
        **_layout_constexprs(layout, block_size), num_warps=2)


def gather_dequant(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Dequantize the rows at slots [B, W] into out [B, W, 1, d] (Triton; out may be a strided view
    such as decode_buf[:, :W]); empty slots give zero rows. One launch. Returns out."""
    layout, cache_u8 = _check_cache(cache)
    _check_slots("slots", slots, cache, 2)
    require_tensor("out", out, dtypes=(torch.bfloat16, torch.float32), ndim=4)
    require_same_device("cache", cache, out=out)
    batch, width = slots.shape
    if tuple(out.shape) != (batch, width, 1, layout.d) or out.stride(3) != 1:
        raise ValueError(f"out: expected shape [{batch}, {width}, 1, {layout.d}] with a contiguous last dim, "
                         f"got shape {tuple(out.shape)} strides {out.stride()}")
    if slots.stride(1) != 1 and width > 1:
        slots = slots.contiguous()
    num_blocks, block_size = cache_u8.shape[:2]
    if batch * width == 0:
        return out
    rows_per_program = 8
    dependent = dependent_launch(out.device)
    _gather_dequant_kernel[(triton.cdiv(batch * width, rows_per_program),)](
        cache_u8, cache_u8.stride(0), num_blocks * block_size, slots, slots.stride(0), out,
        out.stride(0), out.stride(1), width, batch * width, **_layout_constexprs(layout, block_size),
        ROWS=rows_per_program, DEPENDENT_LAUNCH=dependent, num_warps=4, launch_pdl=dependent)
    return out
