"""The pure-Triton sparse MLA kernels (engine.h20_ops.vendor.flashmla_sparse) against the fp32 oracle.

The same matrix runs on CPU (Triton interpreter: the portable kernel) or, when CUDA is present, on the
GPU with bf16 tensor-core dots (on SM90 the Gluon kernel for bf16 with aligned rows, as the dispatcher
chooses; the portable kernel is checked there by its own GPU tests below). The comparator and the
tolerances are engine.h20_ops.testing's (FlashMLA's own, docs/contract.md "Tolerances": out abs 8e-4 or
rel 3.01/128 per element and cosine distance <= 7e-6; lse and max_logits abs 1e-6 or rel 2.01/65536;
+inf/-inf/NaN positions exact), on its input distribution (testing.normal_inputs).
"""

from __future__ import annotations

import pytest
import torch

from engine.h20_ops import testing
from engine.h20_ops.attention import dispatch
from engine.h20_ops.attention.reference import sparse_mla_prefill_ref
from engine.h20_ops.testing import INT32_MAX, INT32_MIN, PREFILL_OUT, PREFILL_STATS, assert_close, poison_rows
from engine.h20_ops.vendor import flashmla_sparse
from engine.h20_ops.vendor.flashmla_sparse import flash_mla_sparse_fwd

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_indices(gen: torch.Generator, s_q: int, s_kv: int, topk: int, n_valid: int,
                   fillers: tuple[int, ...] = (-1,), distinct: bool = True) -> torch.Tensor:
    """[s_q, 1, topk] int32 (testing.random_indices in the kernel's 3-D form)."""
    return testing.random_indices(gen, s_q, s_kv, topk, n_valid, fillers, distinct)[:, None, :]


def make_inputs(seed: int, s_q: int, h_q: int, d_qk: int, s_kv: int, dtype=torch.bfloat16, scale: float = 0.1,
                device: str = "cpu"):
    """q, kv from testing.normal_inputs (FlashMLA's distribution at the default scale), drawn on `device`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = testing.normal_inputs(gen, s_q, h_q, d_qk, scale=scale, device=device).to(dtype)
    kv = testing.normal_inputs(gen, s_kv, 1, d_qk, scale=scale, device=device).to(dtype)
    return gen, q, kv


def kernel_for(q: torch.Tensor, kv: torch.Tensor) -> str:
    """The kernel the dispatcher chooses for (q, kv) on the triton backend, as flash_mla_sparse_fwd names it."""
    return dispatch.prefill_kernel(q, kv, "triton").kernel.removeprefix("triton_")


def run(q, kv, indices, sm_scale, **kwargs):
    """flash_mla_sparse_fwd with the dispatcher's kernel for these tensors."""
    return flash_mla_sparse_fwd(q, kv, indices, sm_scale, kernel=kernel_for(q, kv), **kwargs)


def check_against_oracle(q, kv, indices, sm_scale, attn_sink=None, topk_length=None, out_tol=PREFILL_OUT,
                         rows: torch.Tensor | None = None, config=None):
    """Run the kernel on DEVICE and compare with the oracle (on `rows` of the queries only, if given).
    `config` selects the portable kernel (otherwise the dispatcher's choice: on an SM90 GPU bf16 with
    aligned rows runs the Gluon kernel)."""
    q, kv, indices, attn_sink, topk_length = (None if t is None else t.to(DEVICE)
                                              for t in (q, kv, indices, attn_sink, topk_length))
    kernel = "portable" if config is not None else kernel_for(q, kv)
    out, max_logits, lse = flash_mla_sparse_fwd(q, kv, indices, sm_scale, attn_sink=attn_sink,
                                                topk_length=topk_length, kernel=kernel, config=config)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:2], 512)
    assert max_logits.dtype == torch.float32 and lse.dtype == torch.float32
    if rows is not None:
        rows = rows.to(DEVICE)
        q, indices, out, max_logits, lse = q[rows], indices[rows], out[rows], max_logits[rows], lse[rows]
        topk_length = None if topk_length is None else topk_length[rows]
    ref = sparse_mla_prefill_ref(q, kv, indices, sm_scale, attn_sink=attn_sink, topk_length=topk_length)
    assert_close("out", out, ref.out, testing.out_tolerance(out_tol, out))
    assert_close("max_logits", max_logits, ref.max_logits, PREFILL_STATS)
    assert_close("lse", lse, ref.lse, PREFILL_STATS)
    return out.cpu(), max_logits.cpu(), lse.cpu(), ref


@pytest.mark.parametrize("s_q", [1, 7, 62])
@pytest.mark.parametrize("h_q,d_qk", [(64, 512), (128, 576), (128, 512), (64, 576)])
def test_matches_oracle(s_q, h_q, d_qk):
    s_kv, topk = 300, 100  # topk not a multiple of the kernel's block: the tail block is masked
    gen, q, kv = make_inputs(s_q * 1000 + h_q + d_qk, s_q, h_q, d_qk, s_kv)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=90, fillers=(-1, s_kv, INT32_MAX))
    kv = poison_rows(kv, indices)
    sink = torch.randn(h_q, generator=gen)
    check_against_oracle(q, kv, indices, d_qk ** -0.5, attn_sink=sink)


@pytest.mark.parametrize("h_q,d_qk", [(8, 576), (16, 512), (32, 576)])
def test_tensor_parallel_head_counts(h_q, d_qk):
    """h_q 8, 16, 32 (a tensor-parallel rank's heads) in one program per query: a head tile of max(16, h_q)
    rows, not 64. Fillers of every kind, poisoned unselected rows, topk_length 0 / 1 / past topk, sinks
    +-inf; the rows past h_q of h_q 8's 16-row tile are never stored (the buffer's next row stays NaN)."""
    s_q, s_kv, topk = 5, 90, 70
    gen, q, kv = make_inputs(300 + h_q, s_q, h_q, d_qk, s_kv)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=50, fillers=(-1, s_kv, INT32_MAX, INT32_MIN))
    topk_length = torch.tensor([0, 1, 33, 70, 75], dtype=torch.int32)
    kv = poison_rows(kv, indices, topk_length)
    sink = torch.randn(h_q, generator=gen)
    sink[0::3], sink[1::5] = float("inf"), float("-inf")
    out, _, _, _ = check_against_oracle(q, kv, indices, d_qk ** -0.5, attn_sink=sink, topk_length=topk_length)
    buf = torch.full((s_q + 1, h_q, 512), float("nan"), dtype=q.dtype, device=DEVICE)
    run(q.to(DEVICE), kv.to(DEVICE), indices.to(DEVICE), d_qk ** -0.5, attn_sink=sink.to(DEVICE),
        topk_length=topk_length.to(DEVICE), out=buf[:s_q])
    assert torch.equal(buf[:s_q].cpu(), out) and bool(buf[s_q].isnan().all())


def test_head_tile_per_head_count():
    """64 heads per program for h_q 64 and 128 (the GPU-tuned configuration), h_q's own power of two >= 16
    otherwise."""
    assert [flashmla_sparse.heads_per_program(h) for h in (8, 16, 32, 64, 128)] == [16, 16, 32, 64, 64]


def test_topk_larger_than_s_kv_valid_entries_spread():
    """FlagGems 5.0.2 drops valid entries placed after position ~s_kv here."""
    s_q, h_q, d_qk, s_kv, topk = 16, 64, 576, 128, 512
    gen, q, kv = make_inputs(11, s_q, h_q, d_qk, s_kv)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=100, fillers=(-1, s_kv, 5000))
    assert (indices[:, 0, s_kv:] >= 0).logical_and(indices[:, 0, s_kv:] < s_kv).sum(dim=1).min() > 0
    check_against_oracle(q, kv, indices, 0.07)


@pytest.mark.parametrize("filler", [-1, INT32_MIN, -123456, "s_kv", INT32_MAX])
def test_invalid_fillers_never_read(filler):
    s_q, h_q, d_qk, s_kv, topk = 7, 64, 512, 96, 150
    gen, q, kv = make_inputs(21, s_q, h_q, d_qk, s_kv)
    filler = s_kv if filler == "s_kv" else filler
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=40, fillers=(filler,))
    kv = poison_rows(kv, indices)
    out, _, _, _ = check_against_oracle(q, kv, indices, d_qk ** -0.5)
    assert torch.isfinite(out.float()).all()


def test_duplicate_indices_count_per_occurrence():
    s_q, h_q, d_qk, s_kv, topk = 7, 128, 576, 20, 200
    gen, q, kv = make_inputs(31, s_q, h_q, d_qk, s_kv)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=150, fillers=(-1,), distinct=False)
    out, _, lse, ref = check_against_oracle(q, kv, indices, d_qk ** -0.5)
    # With duplicates, lse differs from the deduplicated one: the test can tell them apart.
    dedup = indices.clone()
    for row in range(s_q):
        seen = set()
        for j in range(topk):
            v = int(dedup[row, 0, j])
            if v in seen:
                dedup[row, 0, j] = -1
            seen.add(v)
    assert (sparse_mla_prefill_ref(q, kv, dedup, d_qk ** -0.5).lse - ref.lse.cpu()).abs().min() > 1e-3


def test_topk_length_including_zero():
    s_q, h_q, d_qk, s_kv, topk = 7, 64, 512, 200, 130
    gen, q, kv = make_inputs(41, s_q, h_q, d_qk, s_kv)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=topk, fillers=(-1,))
    topk_length = torch.tensor([0, 1, 63, 64, -255, 130, 500], dtype=torch.int32)
    # Entries past topk_length are still in range: only the length masks them. Poison what only they select.
    kept = torch.where(torch.arange(topk)[None, :] < topk_length[:, None].long(), indices[:, 0, :], -1)
    kv = poison_rows(kv, kept[:, None, :])
    sink = torch.randn(h_q, generator=gen)
    out, max_logits, lse, _ = check_against_oracle(q, kv, indices, d_qk ** -0.5, attn_sink=sink,
                                                   topk_length=topk_length)
    for row in (0, 4):  # 0 and negative lengths: empty
        assert (out[row].float() == 0).all() and torch.isneginf(max_logits[row]).all()
        assert torch.isposinf(lse[row]).all()


def test_nan_sink_leaves_empty_rows_zero_and_nan_rows_are_not_empty():
    """Empty rows are 0 / lse +inf whatever the sink (a NaN one too); a NaN in a selected kv row makes
    that row's out and lse NaN (as the oracle's), never an "empty" +inf lse that an lse merge would
    silently drop."""
    s_q, h_q, d_qk, s_kv, topk = 4, 64, 512, 64, 16
    gen, q, kv = make_inputs(66, s_q, h_q, d_qk, s_kv)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=12, fillers=(-1,))
    indices[2] = -1  # empty by indices
    topk_length = torch.tensor([topk, topk, topk, 0], dtype=torch.int32)  # row 3 empty by length
    nan_row = int(indices[1, 0, indices[1, 0] >= 0][0])
    indices[0, 0][indices[0, 0] == nan_row] = -1  # only row 1 selects the NaN row
    kv[nan_row, 0, 7] = float("nan")
    sink = torch.randn(h_q, generator=gen)
    sink[5] = float("nan")
    sink[6] = float("inf")
    out, _, lse = (t.cpu() for t in run(q.to(DEVICE), kv.to(DEVICE), indices.to(DEVICE), d_qk ** -0.5,
                                         attn_sink=sink.to(DEVICE), topk_length=topk_length.to(DEVICE)))
    ref = sparse_mla_prefill_ref(q, kv, indices, d_qk ** -0.5, attn_sink=sink, topk_length=topk_length)
    assert (out[2:].float() == 0).all() and torch.isposinf(lse[2:]).all()
    assert torch.isnan(lse[1]).all() and torch.isnan(out[1].float()).all()
    assert_close("out", out, ref.out, testing.out_tolerance(PREFILL_OUT, out))
    assert_close("lse", lse, ref.lse, PREFILL_STATS)


def test_sink_plus_minus_inf_and_finite():
    s_q, h_q, d_qk, s_kv, topk = 7, 128, 512, 256, 128
    gen, q, kv = make_inputs(51, s_q, h_q, d_qk, s_kv)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=120, fillers=(-1, INT32_MIN))
    sink = torch.randn(h_q, generator=gen) * 3
    sink[0::3] = float("inf")
    sink[1::3] = float("-inf")
    out, max_logits, lse, _ = check_against_oracle(q, kv, indices, d_qk ** -0.5, attn_sink=sink)
    assert (out[:, 0::3].float() == 0).all()
    no_sink_out, no_sink_ml, no_sink_lse = run(q.to(DEVICE), kv.to(DEVICE), indices.to(DEVICE), d_qk ** -0.5)
    assert torch.equal(out[:, 1::3], no_sink_out[:, 1::3].cpu())  # -inf sink: no effect at all
    assert torch.equal(lse, no_sink_lse.cpu()) and torch.equal(max_logits, no_sink_ml.cpu())


def test_empty_rows():
    s_q, h_q, d_qk, s_kv, topk = 7, 64, 576, 64, 70
    gen, q, kv = make_inputs(61, s_q, h_q, d_qk, s_kv)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=30, fillers=(-1, s_kv))
    indices[2:5] = torch.tensor([-1, INT32_MIN, s_kv], dtype=torch.int32)[torch.arange(topk) % 3]
    kv = poison_rows(kv, indices)
    sink = torch.randn(h_q, generator=gen)
    sink[::2] = float("inf")
    out, max_logits, lse, _ = check_against_oracle(q, kv, indices, d_qk ** -0.5, attn_sink=sink)
    assert (out[2:5].float() == 0).all()
    assert torch.isneginf(max_logits[2:5]).all() and torch.isposinf(lse[2:5]).all()
    assert torch.isfinite(lse[[0, 1, 5, 6]]).all()


def test_empty_kv():
    gen, q, _ = make_inputs(65, 3, 64, 512, 1)
    kv = torch.empty(0, 1, 512, dtype=torch.bfloat16)
    indices = torch.tensor([-1, 0, 5], dtype=torch.int32).repeat(3, 1, 11)
    out, max_logits, lse, _ = check_against_oracle(q, kv, indices, 0.05)
    assert (out.float() == 0).all() and torch.isposinf(lse).all()


def test_non_contiguous_inputs():
    s_q, h_q, d_qk, s_kv, topk = 7, 128, 576, 150, 90
    gen = torch.Generator().manual_seed(71)
    # the views are taken on DEVICE (moving a view to another device would make it contiguous)
    q = testing.normal_inputs(gen, s_q + 2, h_q + 3, d_qk + 8).bfloat16().to(DEVICE)[1:-1, 2:-1, 4:-4]
    kv = testing.normal_inputs(gen, s_kv + 3, 2, d_qk + 16).bfloat16().to(DEVICE)[2:-1, 1:, 8:-8]
    idx_full = random_indices(gen, s_q + 1, s_kv, topk + 5, n_valid=80, fillers=(-1, s_kv)).to(DEVICE)
    indices = idx_full.expand(s_q + 1, 2, topk + 5)[1:, 1:, 3:-2]
    sink = torch.randn(2 * h_q, generator=gen).to(DEVICE)[::2]
    topk_length = torch.randint(0, topk + 1, (2 * s_q,), generator=gen, dtype=torch.int32).to(DEVICE)[::2]
    assert not (q.is_contiguous() or kv.is_contiguous() or indices.is_contiguous())
    check_against_oracle(q, kv, indices, d_qk ** -0.5, attn_sink=sink, topk_length=topk_length)


def test_two_dim_indices():
    s_q, h_q, d_qk, s_kv, topk = 5, 64, 512, 80, 64
    gen, q, kv = make_inputs(75, s_q, h_q, d_qk, s_kv)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=50)[:, 0, :]
    check_against_oracle(q, kv, indices, d_qk ** -0.5)


def test_every_output_element_written(monkeypatch):
    """Outputs come from torch.empty: make that NaN-filled so an unwritten element would show."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan"))

    monkeypatch.setattr(flashmla_sparse.torch, "empty", poisoned_empty)
    s_q, h_q, d_qk, s_kv, topk = 7, 128, 512, 100, 40
    gen, q, kv = make_inputs(81, s_q, h_q, d_qk, s_kv)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=30)
    indices[3] = -1  # an empty row must be written too
    check_against_oracle(q, kv, indices, d_qk ** -0.5)


def test_float32_mode_is_exact():
    """float32 q/kv (the engine's validation mode): no bf16 rounding anywhere, so much tighter."""
    s_q, h_q, d_qk, s_kv, topk = 7, 64, 576, 200, 100
    gen, q, kv = make_inputs(91, s_q, h_q, d_qk, s_kv, dtype=torch.float32)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=90, fillers=(-1, INT32_MAX))
    kv = poison_rows(kv, indices)
    sink = torch.randn(h_q, generator=gen)
    check_against_oracle(q, kv, indices, d_qk ** -0.5, attn_sink=sink, out_tol=testing.EXACT_FP32)


def test_s_q_zero():
    q = torch.empty(0, 64, 512, dtype=torch.bfloat16, device=DEVICE)
    kv = torch.zeros(4, 1, 512, dtype=torch.bfloat16, device=DEVICE)
    indices = torch.zeros(0, 1, 8, dtype=torch.int32, device=DEVICE)
    out, max_logits, lse = run(q, kv, indices, 0.1)
    assert out.shape == (0, 64, 512) and max_logits.shape == (0, 64) and lse.shape == (0, 64)


def _valid_args():
    _, q, kv = make_inputs(3, 2, 64, 512, 8, device=DEVICE)
    indices = torch.zeros(2, 1, 4, dtype=torch.int32, device=DEVICE)
    return dict(q=q, kv=kv, indices=indices, sm_scale=0.1, kernel="portable")


@pytest.mark.parametrize("change,error,match", [
    (dict(q=lambda a: a["q"].half()), TypeError, "q: expected dtype"),
    (dict(kv=lambda a: a["kv"].float()), TypeError, "kv: expected dtype"),
    (dict(indices=lambda a: a["indices"].long()), TypeError, "indices: expected dtype"),
    (dict(q=lambda a: a["q"][:, :12]), ValueError, r"q: expected h_q in \(8, 16, 32, 64, 128\), got 12"),
    (dict(q=lambda a: torch.zeros(2, 64, 640, dtype=torch.bfloat16, device=DEVICE),
          kv=lambda a: torch.zeros(8, 1, 640, dtype=torch.bfloat16, device=DEVICE)), ValueError, "q: expected d_qk"),
    (dict(kv=lambda a: a["kv"].expand(8, 2, 512)), ValueError, "kv: expected 1 kv head"),
    (dict(kv=lambda a: a["kv"][..., :448]), ValueError, "kv: expected last dim"),
    (dict(indices=lambda a: a["indices"][:1]), ValueError, "indices: expected 2 rows"),
    (dict(indices=lambda a: a["indices"][..., :0]), ValueError, "indices: expected topk >= 1"),
    (dict(sm_scale=lambda a: 0.0), ValueError, "sm_scale"),
    (dict(d_v=lambda a: 256), ValueError, "d_v"),
    (dict(q=lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "q: the last dim"),
    (dict(attn_sink=lambda a: torch.zeros(32, device=DEVICE)), ValueError, "attn_sink: expected shape"),
    (dict(attn_sink=lambda a: torch.zeros(64, device=DEVICE).double()), TypeError, "attn_sink: expected dtype"),
    (dict(topk_length=lambda a: torch.zeros(2, dtype=torch.int64, device=DEVICE)), TypeError,
     "topk_length: expected dtype"),
    (dict(topk_length=lambda a: torch.zeros(3, dtype=torch.int32, device=DEVICE)), ValueError,
     "topk_length: expected shape"),
    (dict(kernel=lambda a: "triton_portable"), ValueError, "kernel: expected one of gluon_sm90, portable"),
    (dict(kernel=lambda a: "gluon_sm90", config=lambda a: flashmla_sparse.default_config(torch.bfloat16)), ValueError,
     "config: the launch parameters of the portable kernel, given with kernel='gluon_sm90'"),
])
def test_bad_input_raises_naming_the_argument(change, error, match):
    args = _valid_args()
    args.update({name: make(args) for name, make in change.items()})
    with pytest.raises(error, match=match):
        flash_mla_sparse_fwd(**args)


def test_the_gluon_kernel_refuses_tensors_it_cannot_run():
    """kernel='gluon_sm90' is refused by name, with the reason, for tensors that kernel cannot run (here:
    Triton's interpreter or CPU tensors, float32, h_q other than 64 or 128), instead of failing inside Triton."""
    args = _valid_args() | dict(kernel="gluon_sm90")
    with pytest.raises(ValueError, match="^kernel: 'gluon_sm90' cannot run these tensors"):
        flash_mla_sparse_fwd(**(args | dict(q=args["q"].float(), kv=args["kv"].float())))
    with pytest.raises(ValueError, match=r"^kernel: 'gluon_sm90' cannot run these tensors: h_q 16: the Gluon kernel "
                                         r"takes 64 or 128 heads \(64 per CTA\)$"):
        flash_mla_sparse_fwd(**(args | dict(q=args["q"][:, :16])))
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"^kernel: 'gluon_sm90' cannot run these tensors: Triton's interpreter"):
            flash_mla_sparse_fwd(**args)
        with pytest.raises(ValueError, match=r"^kernel: 'gluon_sm90' cannot run these tensors"):
            flash_mla_sparse_fwd(**(args | dict(q=args["q"][:0], indices=args["indices"][:0])))


@pytest.mark.gpu
def test_cpu_tensors_rejected_on_gpu_machine():
    args = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in _valid_args().items()}
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        flash_mla_sparse_fwd(**args)


def test_peaked_softmax_inputs():
    """Unit-variance q/kv (a peaked softmax, large outputs): P's bf16 rounding before P.V (GPU)
    shows in the absolute error, so out's floor is testing.PREFILL_OUT_UNIT_VARIANCE here (FlashMLA's
    test data is 10x smaller). Under the interpreter P stays fp32 and this passes with room."""
    s_q, h_q, d_qk, s_kv, topk = 7, 128, 576, 300, 100
    gen, q, kv = make_inputs(95, s_q, h_q, d_qk, s_kv, scale=1.0)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=90, fillers=(-1,))
    check_against_oracle(q, kv, indices, d_qk ** -0.5, out_tol=testing.PREFILL_OUT_UNIT_VARIANCE)


@pytest.mark.gpu
def test_long_s_q_beyond_grid_axis_limit():
    """s_q 70000 > 65535 (the limit of grid axes 1 and 2) with 64-bit offsets in play; the oracle
    checks every 37th query and the last 64."""
    s_q, h_q, d_qk, s_kv, topk = 70000, 128, 512, 1024, 64  # q offsets reach 4.6e9 elements
    gen, q, kv = make_inputs(101, s_q, h_q, d_qk, s_kv, device=DEVICE)
    valid = torch.rand(s_q, topk, generator=gen, device=DEVICE) < 0.8
    random_rows = torch.randint(s_kv, (s_q, topk), generator=gen, device=DEVICE)
    indices = torch.where(valid, random_rows, -1).int()[:, None, :]
    topk_length = torch.randint(0, topk + 1, (s_q,), generator=gen, dtype=torch.int32, device=DEVICE)
    sink = torch.randn(h_q, generator=gen, device=DEVICE)
    rows = torch.cat([torch.arange(0, s_q, 37), torch.arange(s_q - 64, s_q)])
    check_against_oracle(q, kv, indices, d_qk ** -0.5, attn_sink=sink, topk_length=topk_length, rows=rows)


@pytest.mark.gpu
@pytest.mark.parametrize("h_q,d_qk", [(64, 512), (128, 576)])
def test_several_items_per_cta_with_empty_items(h_q, d_qk):
    """The SM90 kernel's grid is persistent (one CTA per SM, each serving many query x head-tile
    items, its buffer phases running on across them): 300 queries with a third of them empty
    (topk_length 0 or negative) between the others, odd block counts, sinks +-inf, NaN in unselected
    rows."""
    s_q, s_kv, topk = 300, 2000, 200
    gen, q, kv = make_inputs(121 + h_q, s_q, h_q, d_qk, s_kv)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=170, fillers=(-1, s_kv, INT32_MIN))
    topk_length = torch.randint(0, topk + 1, (s_q,), generator=gen, dtype=torch.int32)
    topk_length[torch.rand(s_q, generator=gen) < 0.33] = 0
    negative = torch.tensor([-1, -255, -1000, INT32_MIN], dtype=torch.int32)  # empty too (-255 and below once hung)
    topk_length[3::37] = negative[torch.arange(len(topk_length[3::37])) % 4]
    kept = torch.where(torch.arange(topk)[None, :] < topk_length[:, None].long(), indices[:, 0, :], -1)
    kv = poison_rows(kv, kept[:, None, :])
    sink = torch.randn(h_q, generator=gen)
    sink[0::7] = float("inf")
    sink[1::7] = float("-inf")
    check_against_oracle(q, kv, indices, d_qk ** -0.5, attn_sink=sink, topk_length=topk_length)


@pytest.mark.gpu
@pytest.mark.parametrize("h_q,d_qk,topk", [(64, 512, 512), (128, 576, 2048)])
def test_model_shapes_on_gpu(h_q, d_qk, topk):
    s_q, s_kv = 64, 4096
    gen, q, kv = make_inputs(111 + h_q, s_q, h_q, d_qk, s_kv)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=topk - 7, fillers=(-1, s_kv))
    kv = poison_rows(kv, indices)
    check_against_oracle(q, kv, indices, d_qk ** -0.5, attn_sink=torch.randn(h_q, generator=gen))


# The argument types and attributes the JIT gives a launch of either kernel with 16-byte aligned
# tensors (prepended to both offline compile scripts below).
SM90_SIGNATURE = r"""
POINTERS = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32",
            "topk_length_ptr": "*i32", "out_ptr": "*bf16", "max_logits_ptr": "*fp32", "lse_ptr": "*fp32"}


def signature_of(kernel, constexprs):
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = POINTERS[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name == "qk_scale_log2" else "i32"
            if name in ("stride_q_s", "stride_q_h", "stride_kv_s", "stride_out_s", "stride_out_h"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs
"""

SM90_COMPILE = SM90_SIGNATURE + r"""
import re, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.h20_ops.vendor import flashmla_sparse as fs

kernel = fs._sparse_mla_fwd_kernel
d_qk, h_q = int(sys.argv[1]), int(sys.argv[2])
cfg = fs.default_config(torch.bfloat16)
constexprs = dict(H_Q=h_q, H_TILES=1, BLOCK_H=fs.heads_per_program(h_q), BLOCK_K=cfg.block_k, D_V=512, D_ROPE=d_qk - 512, HAS_SINK=True,
                  HAS_TOPK_LENGTH=True, DOT_F32=False, INPUT_PRECISION="tf32", DEPENDENT_LAUNCH=True)
signature, attrs = signature_of(kernel, constexprs)
compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
ttgir = compiled.asm["ttgir"]
layouts = dict(re.findall(r"^(#mma\d*) = .*?warpsPerCTA = \[(\d+, \d+)\]", ttgir, re.M))
qk = [line for line in ttgir.splitlines() if "warp_group_dot " in line and "-> tensor<64x64xf32" in line]
print("QK", sorted({layouts[re.search(r"-> tensor<64x64xf32, (#mma\d*)>", l).group(1)] for l in qk}))
print("SHARED", compiled.metadata.shared)
"""


@pytest.mark.parametrize("d_qk", [512, 576])
def test_qk_is_split_between_warpgroups_in_the_sm90_build(d_qk):
    """The shipped configuration compiled for sm_90 on this machine (no GPU needed): every Q.K^T
    wgmma has 4 warps along the 64 heads and 2 along the 64 entries, i.e. each warpgroup computes
    half of the scores. With [8, 1] both warpgroups would compute all of them (twice the Q.K^T work,
    -20% on the H200); a Triton upgrade or an edit of the loop that brings that back fails here."""
    lines = _sm90_build(d_qk, 64)
    assert lines["QK"] == "['4, 2']", lines
    assert int(lines["SHARED"]) <= 232448, "does not fit the 227 KB of shared memory of an SM90 CTA"


@pytest.mark.parametrize("h_q", [8, 32])
def test_tensor_parallel_head_tiles_build_for_sm90(h_q):
    """The 16-row tile of h_q 8 (8 rows masked) and the 32-row tile of h_q 32 compiled for sm_90 on this
    machine: they build and fit an SM90 CTA's shared memory."""
    lines = _sm90_build(576, h_q)
    assert int(lines["SHARED"]) <= 232448, "does not fit the 227 KB of shared memory of an SM90 CTA"


def _sm90_build(d_qk: int, h_q: int) -> dict[str, str]:
    """The portable kernel compiled for sm_90 (a real compile, not the interpreter) -> its QK / SHARED lines."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", SM90_COMPILE, str(d_qk), str(h_q)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith(("QK", "SHARED")))


SM90_GLUON_COMPILE = SM90_SIGNATURE + r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from engine.h20_ops.vendor import flashmla_sparse_gluon_sm90 as sm90

kernel = sm90.sparse_mla_fwd_sm90_kernel
d_qk = int(sys.argv[1])
constexprs = dict(H_TILES=1, BLOCK_H=sm90.HEADS_PER_CTA, BLOCK_K=sm90.BLOCK_TOPK, D_V=512, D_ROPE=d_qk - 512,
                  HAS_SINK=True, HAS_TOPK_LENGTH=True)
signature, attrs = signature_of(kernel, constexprs)
compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=sm90.NUM_WARPS.value))
open(sys.argv[2], "w").write(compiled.asm["ptx"])
print("SHARED", compiled.metadata.shared)
"""


@pytest.mark.parametrize("d_qk", [512, 576])
def test_gluon_sm90_build_fits_without_spills(d_qk, tmp_path):
    """The Gluon kernel compiled for sm_90 on this machine (no GPU needed): it fits the 227 KB of
    shared memory, ptxas neither spills (hoisted wgmma descriptors did: 137 spill instructions) nor
    serializes the wgmmas (C7515), each consumer computes a whole 64 x 64 block of S (m64n64) and
    its half of O (m64n256): the schedule the header describes; every partition waits for the previous
    kernel (programmatic dependent launch)."""
    import os
    import subprocess
    import sys

    import triton

    env = {**os.environ, "TRITON_INTERPRET": "0"}  # a real compile, not the interpreter
    ptx_path = tmp_path / "kernel.ptx"
    result = subprocess.run([sys.executable, "-c", SM90_GLUON_COMPILE, str(d_qk), str(ptx_path)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split("SHARED ")[1].split()[0]) <= 232448
    ptx = ptx_path.read_text()
    rope_steps = (d_qk - 512) // 16
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16") == 2 * (32 + rope_steps)
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16") == 2 * 2 * 4
    # programmatic dependent launch: each of the three partitions waits for the previous kernel
    assert ptx.count("griddepcontrol.wait;") == 3
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    report = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx_path), "-o", str(tmp_path / "kernel.cubin")],
                            capture_output=True, text=True, check=True).stderr
    assert "C7515" not in report and "C7517" not in report, report
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report


def _on_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture
def gluon_launches(monkeypatch) -> list:
    """The dtypes of q in the Gluon kernel's launches during the test (it still runs)."""
    launches = []
    real_launch = flashmla_sparse.flashmla_sparse_gluon_sm90.launch
    monkeypatch.setattr(flashmla_sparse.flashmla_sparse_gluon_sm90, "launch",
                        lambda *args: launches.append(args[0].dtype) or real_launch(*args))
    return launches


@pytest.mark.gpu
def test_bf16_on_sm90_runs_the_gluon_kernel(gluon_launches):
    """kernel= runs the named kernel; the dispatcher names the Gluon one for bf16 with aligned rows on
    SM90 and the portable one for float32."""
    if not _on_sm90():
        pytest.skip("needs an SM90 GPU")
    args = _valid_args()
    assert kernel_for(args["q"], args["kv"]) == "gluon_sm90"
    assert kernel_for(args["q"].float(), args["kv"].float()) == "portable"
    flash_mla_sparse_fwd(**(args | dict(kernel="gluon_sm90")))
    flash_mla_sparse_fwd(**args)  # the portable kernel
    flash_mla_sparse_fwd(**(args | dict(config=flashmla_sparse.default_config(torch.bfloat16))))
    flash_mla_sparse_fwd(args["q"].float(), args["kv"].float(), args["indices"], 0.1, kernel="portable")
    assert gluon_launches == [torch.bfloat16]


def _placed(t: torch.Tensor, width: int, start: int) -> torch.Tensor:
    """t's values as a view into a wider buffer: last-dim rows `width` elements apart, `start` in."""
    buf = torch.zeros(*t.shape[:-1], width, dtype=t.dtype, device=t.device)
    return buf[..., start:start + t.shape[-1]].copy_(t)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["q_start", "q_head_stride", "kv_row_stride", "aligned_strided"])
def test_rows_16_byte_cp_async_cannot_read_run_the_portable_kernel(layout, gluon_launches):
    """Strided views the contract allows but the Gluon kernel's 16-byte cp.async cannot read (a start
    or a row stride not 16-byte aligned: it would not compile) get the portable kernel, with a correct
    result; an aligned strided view gets the Gluon kernel. The views are made on the GPU (moving a
    strided CPU view there would make it contiguous)."""
    if not _on_sm90():
        pytest.skip("needs an SM90 GPU")
    s_q, h_q, d_qk, s_kv, topk = 5, 64, 576, 300, 100
    _, q, kv = make_inputs(131, s_q, h_q, d_qk, s_kv, device=DEVICE)
    gen = torch.Generator().manual_seed(132)  # random_indices draws on the CPU
    if layout == "q_start":
        q = _placed(q, d_qk + 16, 4)  # starts 8 bytes into its buffer
    elif layout == "q_head_stride":
        q = _placed(q, d_qk + 8, 0)  # q.stride(1) = 584 elements
    elif layout == "kv_row_stride":
        kv = _placed(kv, d_qk + 8, 0)  # kv.stride(0) = 584 elements
    else:
        q, kv = _placed(q, d_qk + 16, 8), _placed(kv, d_qk + 32, 16)
    indices = random_indices(gen, s_q, s_kv, topk, n_valid=90, fillers=(-1, s_kv)).to(DEVICE)
    check_against_oracle(q, kv, indices, d_qk ** -0.5, attn_sink=torch.randn(h_q, generator=gen))
    assert gluon_launches == ([torch.bfloat16] if layout == "aligned_strided" else [])


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["fillers_sink", "topk_length_nan", "non_contiguous"])
def test_portable_kernel_on_gpu(case):
    """The portable tl kernel with bf16 tensor-core dots (what other GPUs run) on the trap cases."""
    config = flashmla_sparse.default_config(torch.bfloat16)
    if case == "fillers_sink":
        gen, q, kv = make_inputs(201, 7, 128, 576, 300)
        indices = random_indices(gen, 7, 300, 100, n_valid=90, fillers=(-1, 300, INT32_MAX, INT32_MIN))
        kv = poison_rows(kv, indices)
        sink = torch.randn(128, generator=gen) * 3
        sink[0::5] = float("inf")
        check_against_oracle(q, kv, indices, 576 ** -0.5, attn_sink=sink, config=config)
    elif case == "topk_length_nan":
        gen, q, kv = make_inputs(202, 7, 64, 512, 200)
        indices = random_indices(gen, 7, 200, 130, n_valid=130)
        topk_length = torch.tensor([0, 1, 63, 64, 65, 130, 500], dtype=torch.int32)
        kept = torch.where(torch.arange(130)[None, :] < topk_length[:, None].long(), indices[:, 0, :], -1)
        kv = poison_rows(kv, kept[:, None, :])
        check_against_oracle(q, kv, indices, 512 ** -0.5, topk_length=topk_length, config=config)
    else:
        gen = torch.Generator().manual_seed(203)
        q = testing.normal_inputs(gen, 9, 131, 584).bfloat16().to(DEVICE)[1:-1, 2:-1, 4:-4]
        kv = testing.normal_inputs(gen, 153, 2, 592).bfloat16().to(DEVICE)[2:-1, 1:, 8:-8]
        indices = random_indices(gen, 8, 150, 95, n_valid=80, fillers=(-1, 150)).to(DEVICE).expand(8, 2, 95)[1:, 1:, 3:-2]
        assert not (q.is_contiguous() or kv.is_contiguous() or indices.is_contiguous())
        check_against_oracle(q, kv, indices, 576 ** -0.5, config=config)
