"""engine.ops: Triton and ref implementations against transformers' DeepSeek-V4 modules, selection by
DEEPINFER_KERNELS, fallback counting and DEEPINFER_OPS_STRICT."""

import pytest
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4RMSNorm, DeepseekV4UnweightedRMSNorm,
                                                                    apply_rotary_pos_emb)
from triton.runtime.errors import InterpreterError

from engine import ops
from engine.h20_ops import kv_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("DEEPINFER_KERNELS", raising=False)
    monkeypatch.delenv("DEEPINFER_OPS_STRICT", raising=False)
    ops.reset_fallback_counts()
    yield
    ops.reset_fallback_counts()


def _hf_rms_norm(x, weight, eps=1e-6):
    if weight is None:
        return DeepseekV4UnweightedRMSNorm(eps)(x)
    module = DeepseekV4RMSNorm(x.size(-1), eps).to(x.device)
    module.weight.data = weight
    return module(x)


def _hf_rope(x, cos, sin, inverse):
    """transformers' apply_rotary_pos_emb on x [T, H, D] or [T, D] with per-token cos/sin [T, R/2]."""
    sin = -sin if inverse else sin
    if x.dim() == 2:
        return apply_rotary_pos_emb(x[None, None], cos[None], sin[None])[0, 0]
    return apply_rotary_pos_emb(x.transpose(0, 1)[None], cos[None], sin[None])[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("shape", [(37, 64, 512), (5, 1500), (3, 2, 1024)])
def test_rms_norm_matches_transformers(dtype, weighted, shape):
    g = torch.Generator().manual_seed(hash((shape, weighted)) % 2**31)
    # Rows of very different scales: a per-row statistic mixed across rows would show.
    x = (torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[0])[(...,) + (None,) * (len(shape) - 1)])
    x = x.to(dtype).to(DEVICE)
    weight = (torch.randn(shape[-1], generator=g) + 1).to(DEVICE) if weighted else None
    hf = _hf_rms_norm(x, weight)
    if hf.dtype != dtype:
        # transformers 5.17 returned weight * x_normed.to(x.dtype) in float32 (its bf16 DeepSeek-V4
        # cannot run); 5.18+ multiplies in float32 and casts once, the semantics the engine follows.
        xf = x.float()
        hf = (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))).to(dtype)
    expected = hf.float()
    ref = ops._rms_norm_ref(x, weight, 1e-6)
    assert torch.equal(ref.float(), expected), "ref must reproduce transformers bit for bit"
    out = ops.rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    atol = 1e-5 if dtype == torch.float32 else 0.0
    # bf16: two bf16 steps (Triton's interpreter truncates fp32 -> bf16 casts instead of rounding)
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)
    assert ops.fallback_counts() == {}


def test_rms_norm_non_contiguous_input():
    base = torch.randn(12, 2 * 256, device=DEVICE)
    x = base[:, ::2]  # last dim strided
    w = torch.randn(256, device=DEVICE)
    torch.testing.assert_close(ops.rms_norm(x, w), _hf_rms_norm(x.contiguous(), w), atol=1e-5, rtol=1e-5)
    w_strided = torch.randn(256, 2, device=DEVICE)[:, 0]
    torch.testing.assert_close(ops.rms_norm(x, w_strided), _hf_rms_norm(x.contiguous(), w_strided.contiguous()),
                               atol=1e-5, rtol=1e-5)
    assert ops.fallback_counts() == {}


def test_row_offsets_past_2_to_the_31():
    """Rows whose start lies past 2^31 elements (q of 64 heads x 512 from 65536 tokens on): the kernels'
    offsets are 64-bit. The 4 GiB tensor is allocated, never touched beyond the 5 rows used."""
    stride = 2**29
    big = torch.empty(4 * stride + 512, dtype=torch.bfloat16, device=DEVICE)
    x = big.as_strided((5, 512), (stride, 1))
    x.copy_(torch.randn(5, 512))
    w = torch.randn(512, device=DEVICE)
    # bf16 tolerances of the tests above (the interpreter truncates fp32 -> bf16)
    torch.testing.assert_close(ops.rms_norm(x, w).float(), _hf_rms_norm(x.contiguous(), w).float(), atol=0.0,
                               rtol=2 ** -6)
    cos, sin = (f(torch.rand(5, 32, device=DEVICE) * 6).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    torch.testing.assert_close(ops.rope(x, cos, sin).float(), ops._rope_ref(x, cos, sin, False).float(),
                               atol=2 ** -6, rtol=2 ** -7)
    assert ops.fallback_counts() == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(23, 64, 512), (23, 512), (9, 4, 128)])
def test_rope_matches_transformers_and_inverts(dtype, shape):
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    x = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    positions = torch.randint(0, 5000, (shape[0],), generator=g).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    angles = positions[:, None] * inv_freq[None]
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    for inverse in (False, True):
        expected = _hf_rope(x, cos, sin, inverse).float()
        assert torch.equal(ops._rope_ref(x, cos, sin, inverse).float(), expected)
        out = ops.rope(x, cos, sin, inverse=inverse)
        assert out.dtype == dtype and out.shape == x.shape
        assert torch.equal(out[..., :-64], x[..., :-64]), "NoPE dims must be copied unchanged"
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2 ** -6, rtol=2 ** -7)
        torch.testing.assert_close(out.float(), expected, **tol)
    if dtype == torch.float32:
        back = ops.rope(ops.rope(x, cos.float(), sin.float()), cos.float(), sin.float(), inverse=True)
        torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)
    assert ops.fallback_counts() == {}


def test_kernels_ref_never_calls_triton(monkeypatch):
    monkeypatch.setenv("DEEPINFER_KERNELS", "ref")

    def boom(*args):
        raise AssertionError("triton implementation called under DEEPINFER_KERNELS=ref")

    monkeypatch.setattr(ops, "_rms_norm_triton", boom)
    monkeypatch.setattr(ops, "_rope_triton", boom)
    x = torch.randn(4, 8, 128)
    ops.rms_norm(x)
    ops.rope(x, torch.randn(4, 32), torch.randn(4, 32))
    assert ops.fallback_counts() == {}


def _break_triton(monkeypatch):
    """Triton missing, as on a node where it does not import: the one case that falls back."""
    monkeypatch.setattr(ops, "_TRITON_IMPORT_ERROR", "triton not importable (simulated)")


def test_an_error_from_running_triton_propagates_never_a_fallback(monkeypatch):
    """The fallback policy: a missing implementation falls back (counted); a failing one is an error."""
    def failing_launch(*args):
        raise InterpreterError("simulated Triton launch failure")

    monkeypatch.setattr(ops, "_rms_norm_triton", failing_launch)
    with pytest.raises(InterpreterError, match="simulated"):
        ops.rms_norm(torch.randn(3, 4, 128, device=DEVICE))
    assert ops.fallback_counts() == {}


def test_fallback_counted_per_op(monkeypatch):
    _break_triton(monkeypatch)
    x = torch.randn(3, 4, 128, device=DEVICE)
    cos, sin = torch.randn(3, 32, device=DEVICE), torch.randn(3, 32, device=DEVICE)
    out = ops.rms_norm(x)
    torch.testing.assert_close(out, ops._rms_norm_ref(x, None, 1e-6))
    ops.rms_norm(x, torch.ones(128, device=DEVICE))
    ops.rope(x, cos, sin)
    assert ops.fallback_counts() == {"rms_norm": 2, "rope": 1}
    ops.reset_fallback_counts()
    assert ops.fallback_counts() == {}


def test_strict_raises_instead_of_falling_back(monkeypatch):
    _break_triton(monkeypatch)
    monkeypatch.setenv("DEEPINFER_OPS_STRICT", "1")
    with pytest.raises(ops.OpUnavailableError, match="rms_norm.*DEEPINFER_OPS_STRICT"):
        ops.rms_norm(torch.randn(2, 64))
    assert ops.fallback_counts() == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only: Triton needs the interpreter there")
def test_cpu_without_interpreter_is_unavailable(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(2, 64)
    ops.rms_norm(x)
    assert ops.fallback_counts() == {"rms_norm": 1}
    monkeypatch.setenv("DEEPINFER_OPS_STRICT", "1")
    with pytest.raises(ops.OpUnavailableError, match="not on a CUDA device"):
        ops.rms_norm(x)


def test_bad_arguments_name_the_argument():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, torch.ones(32))
    with pytest.raises(TypeError, match="x"):
        ops.rms_norm(torch.ones(4, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="eps"):
        ops.rms_norm(x, eps=0.0)
    with pytest.raises(ValueError, match="cos"):
        ops.rope(x, torch.randn(3, 8), torch.randn(3, 8))
    with pytest.raises(ValueError, match="sin"):
        ops.rope(x, torch.randn(4, 8), torch.randn(4, 4))
    with pytest.raises(ValueError, match="cos"):
        ops.rope(x, torch.randn(4, 40), torch.randn(4, 40))


def test_kv_quant_ops_match_between_implementations(monkeypatch):
    g = torch.Generator().manual_seed(5)
    kv = (torch.randn(10, 1, 512, generator=g) * 3).to(DEVICE)
    slots = torch.tensor([0, 3, 64, 65, 66, 127, 5, 7, 9, -1], device=DEVICE)
    caches, rows = {}, {}
    for impl in ("triton", "ref"):
        monkeypatch.setenv("DEEPINFER_KERNELS", impl)
        cache = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 2, 64, DEVICE)
        ops.kv_quantize(cache, slots, kv)
        out = torch.full((1, 10, 1, 512), float("nan"), device=DEVICE)
        rows[impl] = ops.kv_gather_dequant(cache, slots[None], out)
        caches[impl] = cache
    assert torch.equal(caches["triton"], caches["ref"])
    assert torch.equal(rows["triton"], rows["ref"])
    assert torch.equal(rows["ref"][0, -1], torch.zeros(1, 512, device=DEVICE)), "slot -1 reads as a zero row"
    err = (rows["ref"][0, :-1] - kv[:-1]).abs()
    assert float(err.max()) <= float(kv.abs().max()) / 8, "fp8 round trip beyond e4m3's relative step"
    assert ops.fallback_counts() == {}
