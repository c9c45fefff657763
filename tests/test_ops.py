"""engine.ops: Triton and ref implementations against transformers' DeepSeek-V4 modules, selection by
DEEPINFER_KERNELS, fallback counting and DEEPINFER_OPS_STRICT."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4HyperConnection, DeepseekV4RMSNorm,
                                                                    DeepseekV4UnweightedRMSNorm, apply_rotary_pos_emb)
from triton.runtime.errors import InterpreterError

from engine import ops
from engine.h20_ops import kv_cache
from engine.model.deepseek_v4 import DeepseekV4Runtime
from engine.model.tiny import tiny_config

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
    monkeypatch.setattr(ops, "_hyper_connection_triton", boom)
    x = torch.randn(4, 8, 128)
    ops.rms_norm(x)
    ops.rope(x, torch.randn(4, 32), torch.randn(4, 32))
    ops.hyper_connection(torch.randn(4, 4, 64), torch.randn(4, 24), torch.rand(3), torch.randn(24), 1e-6, 20)
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
    ops.hyper_connection(x, torch.randn(3, 24, device=DEVICE), torch.rand(3, device=DEVICE),
                         torch.randn(24, device=DEVICE), 1e-6, 2)
    assert ops.fallback_counts() == {"rms_norm": 2, "rope": 1, "hyper_connection": 1}
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


# ----------------------------------------------------------------------------------------------
# hyper_connection

def _hf_hyper_connection(n, dim, seed, **config):
    """transformers' DeepseekV4HyperConnection for n streams of width dim, random parameters at a scale that
    gives comb logits of a few units (softmax neither flat nor one-hot)."""
    module = DeepseekV4HyperConnection(tiny_config(hc_mult=n, hidden_size=dim, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.fn.copy_(torch.randn(module.fn.shape, generator=g) * 2 / (n * dim) ** 0.5)
        module.base.copy_(torch.randn(module.base.shape, generator=g))
        module.scale.copy_(torch.rand(3, generator=g) * 2 + 0.25)
    return module.to(DEVICE)


def _hc_mixes(module, hidden):
    """The op's mixes input exactly as transformers computes it (its norm, then the fp32 projection)."""
    return F.linear(module.input_norm(hidden.reshape(hidden.size(0), -1).float()), module.fn.float())


def _hc_args(module, hidden):
    return (hidden, _hc_mixes(module, hidden), module.scale.detach(), module.base.detach(), module.hc_eps,
            module.hc_sinkhorn_iters)


def _assert_hc_close(out, expected, dtype):
    post, comb, collapsed = out
    # fp32 weights: the same formulas, exp / sigmoid and the 20 Sinkhorn divisions a few fp32 ulps apart
    torch.testing.assert_close(post, expected[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(comb, expected[1], atol=1e-6, rtol=1e-5)
    if dtype == torch.float32:
        # sums of n unit-scale products in another order; atol for the rows that cancel
        torch.testing.assert_close(collapsed, expected[2], atol=1e-5, rtol=1e-5)
    else:
        # one bf16 step (2^-7 of the value): the interpreter truncates fp32 -> bf16 where torch rounds
        torch.testing.assert_close(collapsed.float(), expected[2].float(), atol=1e-5, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [4, 3])
# 37 x 1500: several row blocks, the last partial, and D in two programs' slices (the second partial)
@pytest.mark.parametrize("tokens, dim", [(1, 256), (37, 1500)])
def test_hyper_connection_matches_transformers(dtype, n, tokens, dim):
    module = _hf_hyper_connection(n, dim, seed=n * 1000 + tokens)
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, n, dim, generator=g).to(dtype).to(DEVICE)
    with torch.no_grad():
        post, comb, collapsed = module(hidden[None])
        expected = post[0], comb[0], collapsed[0]
        args = _hc_args(module, hidden)
        ref = ops._hyper_connection_ref(*args)
        out = ops.hyper_connection(*args)
    for got, want in zip(ref, expected):
        assert got.dtype == want.dtype and torch.equal(got, want), "ref must reproduce transformers bit for bit"
    assert [t.shape for t in out] == [(tokens, n), (tokens, n, n), (tokens, dim)]
    assert [t.dtype for t in out] == [torch.float32, torch.float32, dtype]
    _assert_hc_close(out, expected, dtype)
    assert ops.fallback_counts() == {}


def test_hyper_connection_low_precision_parameters():
    """scale and base in half precision are read as their fp32 values, as transformers' fp32 mixes promote them."""
    module = _hf_hyper_connection(4, 128, seed=7)
    module.base.data = module.base.data.bfloat16()
    module.scale.data = module.scale.data.half()
    hidden = torch.randn(9, 4, 128, generator=torch.Generator().manual_seed(7)).bfloat16().to(DEVICE)
    with torch.no_grad():
        expected = [t[0] for t in module(hidden[None])]
        args = _hc_args(module, hidden)
        assert all(torch.equal(a, b) for a, b in zip(ops._hyper_connection_ref(*args), expected))
        _assert_hc_close(ops.hyper_connection(*args), expected, torch.bfloat16)
    assert ops.fallback_counts() == {}


@pytest.mark.parametrize("iters", [1, 2])
def test_hyper_connection_one_or_two_sinkhorn_iterations_and_zero_eps(iters):
    """hc_eps 0 with a padded stream count (3 of 4): padded entries must stay out of every sum."""
    module = _hf_hyper_connection(3, 128, seed=iters, hc_eps=0.0, hc_sinkhorn_iters=iters)
    hidden = torch.randn(5, 3, 128, generator=torch.Generator().manual_seed(iters)).to(DEVICE)
    with torch.no_grad():
        expected = [t[0] for t in module(hidden[None])]
        args = _hc_args(module, hidden)
        assert args[4:] == (0.0, iters)
        assert all(torch.equal(a, b) for a, b in zip(ops._hyper_connection_ref(*args), expected))
        _assert_hc_close(ops.hyper_connection(*args), expected, torch.float32)
    assert ops.fallback_counts() == {}


def test_hyper_connection_strided_inputs():
    module = _hf_hyper_connection(4, 256, seed=3)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(4, 5, 2 * 256, generator=g).to(DEVICE).transpose(0, 1)[..., ::2]  # every stride odd
    mixes = torch.randn(5, 2 * 24, generator=g).to(DEVICE)[:, 24:]
    base = torch.randn(24, 2, generator=g).to(DEVICE)[:, 1]
    scale = module.scale.detach()
    out = ops.hyper_connection(hidden, mixes, scale, base, 1e-6, 20)
    expected = ops._hyper_connection_ref(hidden.contiguous(), mixes.contiguous(), scale, base.contiguous(), 1e-6, 20)
    _assert_hc_close(out, expected, torch.float32)
    assert ops.fallback_counts() == {}


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_hyper_connection_zero_tokens(impl, monkeypatch):
    monkeypatch.setenv("DEEPINFER_KERNELS", impl)
    hidden = torch.empty(0, 3, 64, dtype=torch.bfloat16, device=DEVICE)
    post, comb, collapsed = ops.hyper_connection(hidden, torch.empty(0, 15, device=DEVICE),
                                                 torch.rand(3, device=DEVICE), torch.randn(15, device=DEVICE), 1e-6, 20)
    assert (post.shape, comb.shape, collapsed.shape) == ((0, 3), (0, 3, 3), (0, 64))
    assert (post.dtype, comb.dtype, collapsed.dtype) == (torch.float32, torch.float32, torch.bfloat16)
    assert ops.fallback_counts() == {}


def test_engine_hyper_connection_under_ref_is_transformers_bit_for_bit(monkeypatch):
    """DEEPINFER_KERNELS=ref: the engine's call site (its rms_norm op, the projection, the op) computes what
    transformers' module does, bit for bit, as the torch code it replaced did."""
    monkeypatch.setenv("DEEPINFER_KERNELS", "ref")
    module = _hf_hyper_connection(4, 256, seed=11)
    hidden = torch.randn(6, 4, 256, generator=torch.Generator().manual_seed(11)).bfloat16().to(DEVICE)
    runtime = SimpleNamespace(eps=module.input_norm.eps)
    with torch.no_grad():
        expected = [t[0] for t in module(hidden[None])]
        got = DeepseekV4Runtime._hyper_connection(runtime, module, hidden)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, expected))


def test_hyper_connection_bad_arguments_name_the_argument():
    hidden, mixes, scale, base = torch.randn(2, 4, 64), torch.randn(2, 24), torch.rand(3), torch.randn(24)
    with pytest.raises(ValueError, match="mixes: expected shape \\[2, 24\\]"):
        ops.hyper_connection(hidden, torch.randn(2, 20), scale, base, 1e-6, 20)
    with pytest.raises(TypeError, match="mixes: expected float32"):
        ops.hyper_connection(hidden, mixes.bfloat16(), scale, base, 1e-6, 20)
    with pytest.raises(TypeError, match="hidden"):
        ops.hyper_connection(hidden.double(), mixes, scale, base, 1e-6, 20)
    with pytest.raises(TypeError, match="hidden"):
        ops.hyper_connection(hidden.int(), mixes, scale, base, 1e-6, 20)
    with pytest.raises(ValueError, match="hidden"):
        ops.hyper_connection(hidden[:, 0], mixes, scale, base, 1e-6, 20)
    with pytest.raises(ValueError, match="scale"):
        ops.hyper_connection(hidden, mixes, torch.rand(2), base, 1e-6, 20)
    with pytest.raises(ValueError, match="base"):
        ops.hyper_connection(hidden, mixes, scale, torch.randn(20), 1e-6, 20)
    with pytest.raises(ValueError, match="base: expected device"):
        ops.hyper_connection(hidden, mixes, scale, base.to("meta"), 1e-6, 20)
    with pytest.raises(ValueError, match="mixes: expected device"):
        ops.hyper_connection(hidden, mixes.to("meta"), scale, base, 1e-6, 20)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        ops.hyper_connection(hidden, mixes, scale, base, 1e-6, 0)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        ops.hyper_connection(hidden, mixes, scale, base, 1e-6, 2.0)
    with pytest.raises(ValueError, match="hc_eps"):
        ops.hyper_connection(hidden, mixes, scale, base, -1e-6, 20)
