"""The TileLang SM90 sparse MLA kernel (engine.h20_ops.attention.tilelang_sm90).

CPU: every kernel variant ((h_q, d_qk) x base-2 / with_max_logits) lowers and nvcc-compiles for an
explicit sm_90a target (an API break in TileLang or a kernel error fails here), the generated source
keeps the properties the contract relies on, a blocked TileLang makes the module import fail with
ModuleNotFoundError, and bad arguments are rejected by name. GPU (@pytest.mark.gpu): results against
the float32 oracle on adversarial inputs; the with_max_logits variant's out bit for bit the base-2
variant's, its lse that lse times ln 2, its max_logits the oracle's; out= written in place.
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

from engine.h20_ops.attention.reference import sparse_mla_prefill_ref

tilelang = pytest.importorskip("tilelang", reason="tilelang is not installed (pip install '.[tilelang]')")

MODULE = "engine.h20_ops.attention.tilelang_sm90"
VARIANTS = [(64, 512), (128, 512), (64, 576), (128, 576)]  # (h_q, d_qk): V4-Flash, V4-Pro, V3.2
KERNELS = [(h_q, d_qk, with_max_logits) for h_q, d_qk in VARIANTS for with_max_logits in (False, True)]
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
INVALID_FILLERS = (-1, -(2**31), -123456, 2**31 - 1)  # plus s_kv itself, added per case


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


def _padded(t: torch.Tensor) -> torch.Tensor:
    """The same values in a tensor with padding on every dim (only the last dim stays dense)."""
    big = torch.full([n + 3 for n in t.shape[:-1]] + [t.shape[-1] + 8], float("nan") if t.is_floating_point() else 7,
                     dtype=t.dtype, device=t.device)
    view = big[tuple(slice(1, 1 + n) for n in t.shape[:-1])][..., 4:4 + t.shape[-1]]
    view.copy_(t)
    return view


def _case(s_q, s_kv, h_q, d_qk, topk, *, seed, invalid_frac=0.2, dup=False, lengths=False, sink=False,
          strided=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = torch.randn(s_q, h_q, d_qk, generator=g, device=dev).to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, d_qk, generator=g, device=dev).to(torch.bfloat16)
    if topk <= s_kv and not dup:
        idx = torch.argsort(torch.rand(s_q, s_kv, generator=g, device=dev), dim=1)[:, :topk]
    else:
        idx = torch.randint(0, s_kv, (s_q, topk), generator=g, device=dev)
    idx = idx.to(torch.int32)
    fillers = torch.tensor(INVALID_FILLERS + (s_kv,), dtype=torch.int32, device=dev)
    invalid = torch.rand(s_q, topk, generator=g, device=dev) < invalid_frac
    pick = torch.randint(0, fillers.numel(), (s_q, topk), generator=g, device=dev)
    idx = torch.where(invalid, fillers[pick], idx)
    idx[0] = -1  # an empty row
    # kv rows that no entry selects hold NaN: reading one (or weighting it by 0) poisons the output.
    selected = torch.zeros(s_kv, dtype=torch.bool, device=dev)
    ok = (idx >= 0) & (idx < s_kv)
    selected[idx[ok].long()] = True
    kv[~selected] = float("nan")
    topk_length = None
    if lengths:
        topk_length = torch.randint(0, topk + 1, (s_q,), generator=g, device=dev, dtype=torch.int32)
        topk_length[1 % s_q] = 0
        # Entries past topk_length may be valid indices of NaN rows: they must stay unread.
        beyond = torch.arange(topk, device=dev)[None, :] >= topk_length[:, None]
        kv_nan_row = (~selected).nonzero()
        if kv_nan_row.numel():
            idx = torch.where(beyond, kv_nan_row[0, 0].to(torch.int32), idx)
    attn_sink = None
    if sink:
        attn_sink = torch.randn(h_q, generator=g, device=dev) * 2
        attn_sink[: h_q // 3] = float("inf")
        attn_sink[h_q // 3: 2 * h_q // 3] = float("-inf")
        attn_sink = attn_sink[torch.randperm(h_q, generator=g, device=dev)]
    if strided:
        q, kv, idx = _padded(q), _padded(kv), _padded(idx)
    return q, kv, idx, attn_sink, topk_length


def _check_against_oracle(q, kv, idx, attn_sink, topk_length, sm_scale):
    from engine.h20_ops.attention.tilelang_sm90 import sparse_mla_fwd_sm90

    out, lse = sparse_mla_fwd_sm90(q, kv, idx, sm_scale, 512, attn_sink, topk_length)
    ref = sparse_mla_prefill_ref(q, kv, idx, sm_scale, 512, attn_sink, topk_length)
    assert out.dtype == torch.bfloat16 and out.shape == (q.shape[0], q.shape[1], 512)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    ref_lse2 = ref.lse * LOG2E
    empty = torch.isinf(ref_lse2)
    assert torch.equal(torch.isinf(lse), empty), "+inf lse (empty rows) must match exactly"
    assert torch.all(lse[empty] == float("inf"))
    assert torch.all(out[empty[:, :1].expand(-1, q.shape[1])] == 0), "empty rows must output exactly 0"
    assert torch.isfinite(out.float()).all()
    finite = ~empty
    lse_err = (lse[finite] - ref_lse2[finite]).abs()
    lse_tol = torch.maximum(torch.full_like(lse_err, 1e-5), ref_lse2[finite].abs() * (4.01 / 65536))
    assert bool((lse_err <= lse_tol).all()), f"lse max err {lse_err.max().item():.3e}"
    # FlashMLA's element bounds (abs 8e-4 or rel 3.01/128), widened to 2 bf16 ULP of the
    # (row, head) vector's largest entry: with few valid entries P's bf16 rounding (relative 2^-9
    # per term) exceeds the relative bound on entries that cancel to near 0.
    out_err = (out.float() - ref.out).abs()
    vec_max = ref.out.abs().amax(dim=-1, keepdim=True).clamp_min(2.0**-126)
    two_ulps = 2.0 * torch.exp2(torch.floor(torch.log2(vec_max)) - 7)
    out_tol = torch.maximum(torch.maximum(torch.full_like(out_err, 8e-4), ref.out.abs() * (3.01 / 128)), two_ulps)
    assert bool((out_err <= out_tol).all()), f"out max err {out_err.max().item():.3e}"
    a, b = out.double(), ref.out.double()
    norms = (a * a + b * b).sum()
    if norms > 0:  # all rows empty: both are exactly 0, checked above
        cos_dist = 1 - 2 * (a * b).sum() / norms
        assert cos_dist.item() < 2e-5, f"cosine distance {cos_dist.item():.2e}"


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
    inputs = _case(37, s_kv, h_q, d_qk, topk, seed=seed, **extras)
    _check_against_oracle(*inputs, sm_scale=1.0 / math.sqrt(d_qk))


def _check_with_max_logits(q, kv, idx, attn_sink, topk_length, sm_scale):
    """The with_max_logits variant against the base-2 one (same inputs) and the oracle, writing a
    caller's NaN-poisoned out."""
    sm90 = importlib.import_module(MODULE)
    out2, lse2 = sm90.sparse_mla_fwd_sm90(q, kv, idx, sm_scale, 512, attn_sink, topk_length)
    buf = torch.full_like(out2, float("nan"))
    out, max_logits, lse = sm90.sparse_mla_fwd_sm90_with_max_logits(q, kv, idx, sm_scale, 512, attn_sink, topk_length,
                                                                     out=buf)
    assert out is buf
    assert torch.equal(out, out2), "the variants share the loop: out must be the same bits"
    assert lse.dtype == max_logits.dtype == torch.float32 and lse.shape == max_logits.shape == q.shape[:2]
    assert torch.equal(lse, lse2 * LN2), "natural lse = base-2 lse * ln 2 (one fp32 multiply; +inf stays)"
    ref = sparse_mla_prefill_ref(q, kv, idx, sm_scale, 512, attn_sink, topk_length)
    empty = torch.isinf(ref.lse)
    assert torch.equal(max_logits == float("-inf"), empty), "-inf max_logits exactly on the empty rows"
    assert torch.equal(lse == float("inf"), empty)
    finite = ~empty
    err = (max_logits[finite] - ref.max_logits[finite]).abs()
    tol = torch.maximum(torch.full_like(err, 1e-5), ref.max_logits[finite].abs() * (4.01 / 65536))
    assert bool((err <= tol).all()), f"max_logits max err {err.max().item():.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("h_q,d_qk", VARIANTS)
@pytest.mark.parametrize("topk,s_kv,extras", [
    (512, 2048, {}),
    (100, 700, {"lengths": True, "sink": True}),
    (640, 300, {"dup": True, "strided": True}),
])
def test_with_max_logits_variant(h_q, d_qk, topk, s_kv, extras):
    inputs = _case(37, s_kv, h_q, d_qk, topk, seed=hash((h_q, d_qk, topk, 1)) % 2**31, **extras)
    _check_with_max_logits(*inputs, sm_scale=1.0 / math.sqrt(d_qk))


@pytest.mark.gpu
@pytest.mark.parametrize("h_q,d_qk", [(64, 512), (128, 576)])
def test_with_max_logits_variant_serving_several_items(h_q, d_qk):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    s_q = 5 * sms // 2 // (h_q // 64) + 1
    inputs = _case(s_q, 700, h_q, d_qk, 300, seed=h_q + d_qk, dup=True, lengths=True, sink=True)
    _check_with_max_logits(*inputs, sm_scale=1.0 / math.sqrt(d_qk))


@pytest.mark.gpu
def test_out_is_written_in_place_and_degenerate_shapes():
    """out= for the base-2 variant; s_q 0 and s_kv 0 (no launch) fill the caller's buffers too."""
    sm90 = importlib.import_module(MODULE)
    q, kv, idx, sink, lengths = _case(9, 200, 64, 512, 128, seed=6, sink=True, lengths=True)
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
    inputs = _case(s_q, 700, h_q, d_qk, topk, seed=topk + h_q + d_qk, dup=True, lengths=True, sink=True)
    _check_against_oracle(*inputs, sm_scale=1.0 / math.sqrt(d_qk))


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
    q, kv, idx, _, _ = _case(9, 128, 64, 512, 128, seed=3)
    idx.fill_(-1)
    out, lse = importlib.import_module(MODULE).sparse_mla_fwd_sm90(q, kv, idx, 0.05)
    assert torch.all(out == 0) and torch.all(lse == float("inf"))
    q, kv, idx, sink, _ = _case(9, 128, 64, 512, 128, seed=4, invalid_frac=0.0, sink=True)
    zero = torch.zeros(9, dtype=torch.int32, device="cuda")
    out, lse = importlib.import_module(MODULE).sparse_mla_fwd_sm90(q, kv, idx, 0.05, 512, sink, zero)
    assert torch.all(out == 0) and torch.all(lse == float("inf"))


@pytest.mark.gpu
def test_nan_sink_and_nan_rows():
    """A NaN sink leaves empty rows 0 / lse +inf (negative lengths are empty too); a NaN in a row that
    a query selects makes its out and lse NaN, as in the oracle, not an empty row's +inf."""
    q, kv, idx, _, _ = _case(6, 128, 64, 512, 128, seed=5, invalid_frac=0.0)
    sink = torch.randn(64, device="cuda")
    sink[3] = float("nan")
    lengths = torch.tensor([128, 128, 0, -255, -2**31, 128], dtype=torch.int32, device="cuda")
    nan_row = int(idx[1, 0])
    idx[[0, 2, 3, 4, 5]] = torch.where(idx[[0, 2, 3, 4, 5]] == nan_row, -1, idx[[0, 2, 3, 4, 5]])
    kv[nan_row, 0, 9] = float("nan")
    out, lse = importlib.import_module(MODULE).sparse_mla_fwd_sm90(q, kv, idx, 0.05, 512, sink, lengths)
    assert torch.all(out[[0, 2, 3, 4]] == 0) and torch.all(lse[[0, 2, 3, 4]] == float("inf"))  # row 0: _case's empty row
    assert torch.isnan(lse[1]).all() and torch.isnan(out[1].float()).all()
    assert torch.isnan(out[5, 3].float()).all() and torch.isfinite(out[5, :3].float()).all()
    # the with_max_logits variant: the same out (NaN included), lse * ln 2
    out_n, max_logits, lse_n = importlib.import_module(MODULE).sparse_mla_fwd_sm90_with_max_logits(
        q, kv, idx, 0.05, 512, sink, lengths)
    assert torch.equal(out_n.view(torch.int16), out.view(torch.int16))
    assert torch.allclose(lse_n, lse * LN2, rtol=0, atol=0, equal_nan=True)  # exactly, NaN where lse is NaN
    assert torch.all(max_logits[[0, 2, 3, 4]] == float("-inf"))


@pytest.mark.gpu
def test_no_recompile_for_new_lengths():
    sm90 = importlib.import_module(MODULE)
    _check_against_oracle(*_case(5, 200, 64, 512, 64, seed=11), sm_scale=0.04)
    misses = sm90.compiled_kernel.cache_info().misses
    for s_q, s_kv, topk in ((1, 1, 1), (130, 5000, 333), (2, 64, 2048)):
        _check_against_oracle(*_case(s_q, s_kv, 64, 512, topk, seed=s_q), sm_scale=0.04)
    assert sm90.compiled_kernel.cache_info().misses == misses
