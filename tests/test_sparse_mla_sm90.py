"""The TileLang SM90 sparse MLA kernel (engine.h20_ops.attention.tilelang_sm90).

CPU: every kernel variant ((h_q, d_qk) x base-2 / with_max_logits) lowers and nvcc-compiles for an
explicit sm_90a target (an API break in TileLang or a kernel error fails here), the generated source
keeps the properties the contract relies on, a blocked TileLang makes the module import fail with
ModuleNotFoundError, and bad arguments are rejected by name. GPU (@pytest.mark.gpu): results against
the float32 oracle on adversarial inputs (engine.h20_ops.testing.prefill_case), by the one comparator at
FlashMLA's prefill tolerances (testing.assert_matches_oracle / assert_close); the with_max_logits
variant's out bit for bit the base-2 variant's, its lse that lse times ln 2, its max_logits the
oracle's; out= written in place.
"""

import importlib
import importlib.abc
import math
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from engine.h20_ops import AttentionOutput
from engine.h20_ops.testing import PREFILL_STATS, assert_close, assert_matches_oracle, prefill_case

tilelang = pytest.importorskip("tilelang", reason="tilelang is not installed (pip install '.[tilelang]')")

MODULE = "engine.h20_ops.attention.tilelang_sm90"
VARIANTS = [(64, 512), (128, 512), (64, 576), (128, 576)]  # (h_q, d_qk): V4-Flash, V4-Pro, V3.2
KERNELS = [(h_q, d_qk, with_max_logits) for h_q, d_qk in VARIANTS for with_max_logits in (False, True)]
LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("h_q,d_qk,with_max_logits", KERNELS)
def test_kernel_compiles_for_sm90a(h_q, d_qk, with_max_logits):
    from engine.h20_ops.attention import tilelang_sm90 as sm90

    src = sm90.compiled_kernel(h_q, d_qk, with_max_logits).get_kernel_source()
    # The gather zero-fills invalid rows (cp.async with source size 0) instead of reading them:
    # one 16-byte chunk per 64 columns per thread and buffer, once per gather order (a CTA's later
    # items start with buffer 0). Q arrives by TMA, one 64 x 64 box per 64 columns from Q's tensor map
    # (a T.copy of Q by all threads compiled to serialized 2-byte loads, ~40 us per CTA); the only
    # CTA-wide barrier is the one after mbarrier init. The validity mask goes through st_mask (a plain
    # store drew producer-wide barriers).
    assert src.count("cp_async_gs_conditional<16>") == 2 * (2 * d_qk // 64)
    assert "cp_async_gs<16>" not in src
    assert src.count("tma_load(Q_desc,") == d_qk // 64 and "__grid_constant__ const CUtensorMap Q_desc" in src
    assert src.count("__syncthreads()") == 1
    assert src.count("st_mask(") == 1 + 4  # its definition, then one per buffer and gather order
    assert "mbarrier_cp_async_arrive_noinc" in src
    assert "wgmma_ss" in src
    assert "wgmma_rs" in src  # each consumer's own P enters P V from registers
    # O leaves through shared memory by TMA (4-byte stores from the fragments cost ~40% of V4-Flash).
    assert src.count("tma_store(") == 2 and "Out[" not in src
    assert "__launch_bounds__(384, 1)" in src
    # s_q, s_kv and topk are runtime arguments (symbolic), not baked-in constants.
    for name in ("int s_q", "int s_kv", "int topk"):
        assert name in src
    # The with_max_logits variant: consumer 0's epilogue multiplies the running max and the base-2 lse by
    # ln 2 (one vectorized multiply each) and stores max_logits next to lse; nothing else changes.
    assert src.count("MaxLogits[") == int(with_max_logits)
    assert src.count("0x1.62e42fefa39efp-1f") == 2 * int(with_max_logits)  # ln 2 as a float literal
    assert src.count("Lse[") == 1


@pytest.mark.parametrize("h_q,d_qk,with_max_logits", KERNELS)
def test_ptxas_keeps_wgmma_async_without_spills(h_q, d_qk, with_max_logits):
    """A wgmma left in flight across a loop back edge (or a register-hungry change) makes ptxas
    serialize every wgmma of the kernel (warning C7515) or spill: still correct, ~2x slower."""
    from engine.h20_ops.attention import tilelang_sm90 as sm90

    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("ptxas is not on PATH")
    ptx = sm90.compiled_kernel(h_q, d_qk, with_max_logits)._get_ptx()  # TileLang 0.1.15 (pinned) keeps the PTX here
    # Built with --use_fast_math: every exp2 is one ex2.approx.ftz (the accurate path would add a range
    # test and two multiplies to each of the softmax's exp2s).
    assert "ex2.approx.ftz.f32" in ptx and "ex2.approx.f32" not in ptx
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "kernel.cubin")],
                                capture_output=True, text=True, check=True).stderr
    assert "C7515" not in report and "C7517" not in report, report
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report


class _BlockTileLang(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "tilelang" or fullname.startswith("tilelang."):
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked by the test)", name=fullname)
        return None


def test_import_raises_module_not_found_without_tilelang():
    saved = {name: mod for name, mod in sys.modules.items()
             if name == MODULE or name == "tilelang" or name.startswith("tilelang.")}
    blocker = _BlockTileLang()
    for name in saved:
        del sys.modules[name]
    sys.meta_path.insert(0, blocker)
    try:
        with pytest.raises(ModuleNotFoundError) as err:
            importlib.import_module(MODULE)
        assert err.value.name == "tilelang"
    finally:
        sys.meta_path.remove(blocker)
        sys.modules.pop(MODULE, None)
        sys.modules.update(saved)


def _small_inputs(dtype=torch.bfloat16, h_q=64, d_qk=512, device="cpu"):
    q = torch.randn(4, h_q, d_qk, dtype=dtype, device=device)
    kv = torch.randn(32, 1, d_qk, dtype=dtype, device=device)
    idx = torch.randint(0, 32, (4, 8), dtype=torch.int32, device=device)
    return q, kv, idx


def test_rejects_float32_q():
    from engine.h20_ops.attention.tilelang_sm90 import sparse_mla_fwd_sm90

    q, kv, idx = _small_inputs(torch.float32)
    with pytest.raises(TypeError, match="^q: "):
        sparse_mla_fwd_sm90(q, kv, idx, 0.04)


def test_rejects_cpu_tensors():
    from engine.h20_ops.attention.tilelang_sm90 import sparse_mla_fwd_sm90

    q, kv, idx = _small_inputs()
    with pytest.raises(ValueError, match="^q: expected a CUDA tensor"):
        sparse_mla_fwd_sm90(q, kv, idx, 0.04)


def test_rejects_a_gpu_other_than_sm90(monkeypatch):
    """A CUDA device of another architecture (here: claimed 10.0) is a clear error before any launch,
    for the prefill and the paged fp8 kernel alike (wgmma / setmaxnreg code is sm_90a only)."""
    from engine.h20_ops import kv_cache
    from engine.h20_ops.attention import tilelang_sm90
    from engine.h20_ops.attention import tilelang_sm90_paged_fp8

    # the paged module's own view of tilelang_sm90 (another test may have re-imported that module)
    for check in (tilelang_sm90.require_sm90_device, tilelang_sm90_paged_fp8.require_sm90_device):
        monkeypatch.setitem(check.__globals__, "cuda_capability", lambda device: (10, 0))
    q, kv, idx = _small_inputs()
    with pytest.raises(ValueError, match=r"^q: expected a tensor on an SM90 GPU .* 10\.0; use DEEPINFER_SPARSE"):
        tilelang_sm90.sparse_mla_fwd_sm90(q, kv, idx, 0.04)
    cache = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 2, 16, "cpu")
    with pytest.raises(ValueError, match="^q: expected a tensor on an SM90 GPU"):
        tilelang_sm90_paged_fp8.sparse_mla_fwd_sm90_paged_fp8(q, cache, None, idx, 0.04)


@pytest.mark.parametrize("h_q,d_qk,bad", [(32, 512, "q"), (64, 640, "q")])
def test_rejects_unsupported_shapes(h_q, d_qk, bad):
    from engine.h20_ops.attention.tilelang_sm90 import sparse_mla_fwd_sm90

    q, kv, idx = _small_inputs(h_q=h_q, d_qk=d_qk)
    with pytest.raises(ValueError, match=f"^{bad}: "):
        sparse_mla_fwd_sm90(q, kv, idx, 0.04)


@pytest.mark.parametrize("with_max_logits", [False, True])
def test_rejects_a_bad_out(with_max_logits):
    """The caller's out is written by TMA: contiguous, q's dtype and shape, 16-byte aligned, each
    refused by name before any device work (here before the CPU tensors themselves are refused)."""
    sm90 = importlib.import_module(MODULE)
    fn = sm90.sparse_mla_fwd_sm90_with_max_logits if with_max_logits else sm90.sparse_mla_fwd_sm90
    q, kv, idx = _small_inputs()
    backing = torch.empty(4 * 64 * 512 + 8, dtype=torch.bfloat16)
    bad = [
        (torch.empty(4, 64, 256, dtype=torch.bfloat16), ValueError, "out: expected shape"),
        (torch.empty(4, 64, 512, dtype=torch.float16), TypeError, "out: expected dtype"),
        (torch.empty(4, 512, 64, dtype=torch.bfloat16).transpose(1, 2), ValueError, "out: expected a contiguous"),
        (backing[1:1 + 4 * 64 * 512].view(4, 64, 512), ValueError, "out: expected a 16-byte aligned"),
    ]
    for out, exc, message in bad:
        with pytest.raises(exc, match=f"^{message}"):
            fn(q, kv, idx, 0.04, out=out)


# ---------------------------------------------------------------------------------------- GPU


def _case(s_q, s_kv, h_q, d_qk, topk, *, seed, dup=False, lengths=False, sink=False, strided=False, **kwargs):
    """testing.prefill_case on the GPU, a fifth of each list fillers (n_valid); dup: entries drawn with
    repetition (duplicates count per occurrence); every third row all fillers."""
    kwargs = dict(n_valid=max(1, topk * 4 // 5), all_invalid=True) | kwargs
    return prefill_case(seed, s_q=s_q, h_q=h_q, d_qk=d_qk, s_kv=s_kv, topk=topk, distinct=not dup, device="cuda",
                        topk_length=lengths, sink=sink, strided=strided, **kwargs)


def _check_against_oracle(case):
    from engine.h20_ops.attention.tilelang_sm90 import sparse_mla_fwd_sm90

    q = case.q
    out, lse = sparse_mla_fwd_sm90(q, case.kv, case.indices, case.sm_scale, 512, case.attn_sink, case.topk_length)
    assert out.dtype == torch.bfloat16 and out.shape == (q.shape[0], q.shape[1], 512)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    assert_matches_oracle(AttentionOutput(out, lse), case.oracle(), decode=False)
    empty = torch.isinf(lse)
    assert torch.all(out[empty] == 0), "empty rows must output exactly 0"


@pytest.mark.gpu
@pytest.mark.parametrize("h_q,d_qk", VARIANTS)
@pytest.mark.parametrize("topk,s_kv,extras", [
    (512, 2048, {}),
    (100, 700, {"lengths": True}),  # topk not a multiple of 64
    (1, 16, {}),
    (640, 300, {"dup": True, "sink": True}),  # kv shorter than topk, duplicates
    (256, 4096, {"sink": True, "lengths": True, "strided": True}),
])
def test_matches_oracle(h_q, d_qk, topk, s_kv, extras):
    seed = hash((h_q, d_qk, topk, s_kv)) % 2**31
    _check_against_oracle(_case(37, s_kv, h_q, d_qk, topk, seed=seed, **extras))


def _check_with_max_logits(case):
    """The with_max_logits variant against the base-2 one (same inputs) and the oracle, writing a
    caller's NaN-poisoned out."""
    sm90 = importlib.import_module(MODULE)
    q, kv, idx, attn_sink, topk_length, sm_scale = (case.q, case.kv, case.indices, case.attn_sink, case.topk_length,
                                                    case.sm_scale)
    out2, lse2 = sm90.sparse_mla_fwd_sm90(q, kv, idx, sm_scale, 512, attn_sink, topk_length)
    buf = torch.full_like(out2, float("nan"))
    out, max_logits, lse = sm90.sparse_mla_fwd_sm90_with_max_logits(q, kv, idx, sm_scale, 512, attn_sink, topk_length,
                                                                     out=buf)
    assert out is buf
    assert torch.equal(out, out2), "the variants share the loop: out must be the same bits"
    assert lse.dtype == max_logits.dtype == torch.float32 and lse.shape == max_logits.shape == q.shape[:2]
    assert torch.equal(lse, lse2 * LN2), "natural lse = base-2 lse * ln 2 (one fp32 multiply; +inf stays)"
    ref = case.oracle()
    assert_close("max_logits", max_logits, ref.max_logits, PREFILL_STATS)  # -inf exactly on the empty rows
    assert_close("lse", lse, ref.lse, PREFILL_STATS)


@pytest.mark.gpu
@pytest.mark.parametrize("h_q,d_qk", VARIANTS)
@pytest.mark.parametrize("topk,s_kv,extras", [
    (512, 2048, {}),
    (100, 700, {"lengths": True, "sink": True}),
    (640, 300, {"dup": True, "strided": True}),
])
def test_with_max_logits_variant(h_q, d_qk, topk, s_kv, extras):
    _check_with_max_logits(_case(37, s_kv, h_q, d_qk, topk, seed=hash((h_q, d_qk, topk, 1)) % 2**31, **extras))


@pytest.mark.gpu
@pytest.mark.parametrize("h_q,d_qk", [(64, 512), (128, 576)])
def test_with_max_logits_variant_serving_several_items(h_q, d_qk):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    s_q = 5 * sms // 2 // (h_q // 64) + 1
    _check_with_max_logits(_case(s_q, 700, h_q, d_qk, 300, seed=h_q + d_qk, dup=True, lengths=True, sink=True))


@pytest.mark.gpu
def test_out_is_written_in_place_and_degenerate_shapes():
    """out= for the base-2 variant; s_q 0 and s_kv 0 (no launch) fill the caller's buffers too."""
    sm90 = importlib.import_module(MODULE)
    case = _case(9, 200, 64, 512, 128, seed=6, sink=True, lengths=True)
    q, kv, idx, sink, lengths = case.q, case.kv, case.indices, case.attn_sink, case.topk_length
    expected, expected_lse = sm90.sparse_mla_fwd_sm90(q, kv, idx, 0.05, 512, sink, lengths)
    buf = torch.full_like(expected, float("nan"))
    out, lse = sm90.sparse_mla_fwd_sm90(q, kv, idx, 0.05, 512, sink, lengths, out=buf)
    assert out is buf and torch.equal(out, expected) and torch.equal(lse, expected_lse)
    no_kv = kv[:0]
    buf = torch.full_like(expected, float("nan"))
    out, max_logits, lse = sm90.sparse_mla_fwd_sm90_with_max_logits(q, no_kv, idx, 0.05, out=buf)
    assert out is buf and torch.all(out == 0)
    assert torch.all(max_logits == float("-inf")) and torch.all(lse == float("inf"))
    out, max_logits, lse = sm90.sparse_mla_fwd_sm90_with_max_logits(q[:0], kv, idx[:0], 0.05, out=buf[:0])
    assert out.shape == (0, 64, 512) and max_logits.shape == lse.shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("h_q,d_qk", VARIANTS)
@pytest.mark.parametrize("topk", [64, 300])
def test_ctas_serving_several_items(h_q, d_qk, topk):
    # The grid is capped at the SM count: with ~2.5x more items than SMs every CTA serves 2 or 3
    # items (barrier phases carried across items, Q reloaded during the previous item's tail, O
    # leaving through buffer 1 while buffer 0 is refilled).
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    s_q = 5 * sms // 2 // (h_q // 64) + 1
    _check_against_oracle(_case(s_q, 700, h_q, d_qk, topk, seed=topk + h_q + d_qk, dup=True, lengths=True, sink=True))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["q", "kv"])
def test_rejects_misaligned_operands(name):
    """q is read by TMA and kv rows by 16-byte cp.async: a contiguous view starting off a 16-byte
    boundary is refused by name instead of faulting in the kernel."""
    from engine.h20_ops.attention.tilelang_sm90 import sparse_mla_fwd_sm90

    q, kv, idx = _small_inputs(device="cuda")
    t = q if name == "q" else kv
    shifted = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")[1:].view(t.shape)
    shifted.copy_(t)
    args = {"q": q, "kv": kv, name: shifted}
    with pytest.raises(ValueError, match=f"^{name}: expected a 16-byte aligned data pointer"):
        sparse_mla_fwd_sm90(args["q"], args["kv"], idx, 0.04)


@pytest.mark.gpu
def test_all_invalid_and_zero_lengths():
    case = _case(9, 128, 64, 512, 128, seed=3)
    case.indices.fill_(-1)
    out, lse = importlib.import_module(MODULE).sparse_mla_fwd_sm90(case.q, case.kv, case.indices, 0.05)
    assert torch.all(out == 0) and torch.all(lse == float("inf"))
    case = _case(9, 128, 64, 512, 128, seed=4, n_valid=128, sink=True, all_invalid=False)
    zero = torch.zeros(9, dtype=torch.int32, device="cuda")
    out, lse = importlib.import_module(MODULE).sparse_mla_fwd_sm90(case.q, case.kv, case.indices, 0.05, 512,
                                                                   case.attn_sink, zero)
    assert torch.all(out == 0) and torch.all(lse == float("inf"))


@pytest.mark.gpu
def test_nan_sink_and_nan_rows():
    """A NaN sink leaves empty rows 0 / lse +inf (negative lengths are empty too); a NaN in a row that
    a query selects makes its out and lse NaN, as in the oracle, not an empty row's +inf."""
    case = _case(6, 128, 64, 512, 128, seed=5, n_valid=128, poison=False, all_invalid=False)
    q, kv, idx = case.q, case.kv, case.indices[:, 0]
    sink = torch.randn(64, device="cuda")
    sink[3] = float("nan")
    lengths = torch.tensor([128, 128, 0, -255, -2**31, 128], dtype=torch.int32, device="cuda")
    nan_row = int(idx[1, 0])
    idx[[0, 2, 3, 4, 5]] = torch.where(idx[[0, 2, 3, 4, 5]] == nan_row, -1, idx[[0, 2, 3, 4, 5]])
    kv[nan_row, 0, 9] = float("nan")
    out, lse = importlib.import_module(MODULE).sparse_mla_fwd_sm90(q, kv, idx, 0.05, 512, sink, lengths)
    assert torch.all(out[[2, 3, 4]] == 0) and torch.all(lse[[2, 3, 4]] == float("inf"))
    assert torch.isnan(lse[1]).all() and torch.isnan(out[1].float()).all()
    assert torch.isnan(out[5, 3].float()).all() and torch.isfinite(out[5, :3].float()).all()
    # the with_max_logits variant: the same out (NaN included), lse * ln 2
    out_n, max_logits, lse_n = importlib.import_module(MODULE).sparse_mla_fwd_sm90_with_max_logits(
        q, kv, idx, 0.05, 512, sink, lengths)
    assert torch.equal(out_n.view(torch.int16), out.view(torch.int16))
    assert torch.allclose(lse_n, lse * LN2, rtol=0, atol=0, equal_nan=True)  # exactly, NaN where lse is NaN
    assert torch.all(max_logits[[2, 3, 4]] == float("-inf"))


@pytest.mark.gpu
def test_no_recompile_for_new_lengths():
    sm90 = importlib.import_module(MODULE)
    _check_against_oracle(_case(5, 200, 64, 512, 64, seed=11))
    misses = sm90.compiled_kernel.cache_info().misses
    for s_q, s_kv, topk in ((1, 1, 1), (130, 5000, 333), (2, 64, 2048)):
        _check_against_oracle(_case(s_q, s_kv, 64, 512, topk, seed=s_q, dup=topk > s_kv))
    assert sm90.compiled_kernel.cache_info().misses == misses
