"""Attention entry points: the decode adapter (offsets, invalid entries, no copy, one launch, split and
merge, two caches, sink, base-2 lse) and varlen prefill, against the float32 oracle."""

import math

import pytest
import torch
import triton

import engine.h20_ops  # noqa: F401  (TRITON_INTERPRET on CPU before kernel modules load)
from engine.h20_ops.attention import entry as attn
from engine.h20_ops.attention import dispatch
from engine.h20_ops.attention.reference import sparse_mla_decode_ref, sparse_mla_prefill_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, D = 64, 512
SCALE = D ** -0.5
LOG2E = 1.0 / math.log(2.0)
INT32_MIN, INT32_MAX = torch.iinfo(torch.int32).min, torch.iinfo(torch.int32).max


# ---------------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------------

def _select_backend(monkeypatch, name):
    if name is None:
        monkeypatch.delenv("DEEPINFER_SPARSE_MLA_BACKEND", raising=False)
    else:
        monkeypatch.setenv("DEEPINFER_SPARSE_MLA_BACKEND", name)
    dispatch.reset_resolution_for_tests()


@pytest.fixture
def ref_backend(monkeypatch):
    _select_backend(monkeypatch, "ref")
    yield
    dispatch.reset_resolution_for_tests()


@pytest.fixture
def default_backend(monkeypatch):
    """The real default path (no env var): triton under the interpreter on a CPU-only machine."""
    _select_backend(monkeypatch, None)
    yield
    dispatch.reset_resolution_for_tests()


@pytest.fixture
def dispatcher_calls(monkeypatch):
    """Records every call of the dispatcher's sparse_mla_fwd (the one kernel launch per entry call)."""
    calls = []
    real = dispatch.sparse_mla_fwd

    def recording(q, kv, indices, sm_scale, **kwargs):
        calls.append(dict(q=q, kv=kv, indices=indices.clone(), **kwargs))
        return real(q, kv, indices, sm_scale, **kwargs)

    monkeypatch.setattr(dispatch, "sparse_mla_fwd", recording)
    return calls


@pytest.fixture
def triton_launches(monkeypatch):
    """Counts the triton backend's kernel launches: every Triton kernel of its module (pre-run hooks)
    and the Gluon SM90 kernel (its launch function; bf16 on an SM90 GPU runs that one)."""
    from engine.h20_ops.vendor import flashmla_sparse, flashmla_sparse_gluon_sm90

    launches = []
    real_sm90_launch = flashmla_sparse_gluon_sm90.launch
    monkeypatch.setattr(flashmla_sparse_gluon_sm90, "launch",
                        lambda *args: launches.append("sm90") or real_sm90_launch(*args))
    for name, obj in vars(flashmla_sparse).items():
        while not hasattr(obj, "pre_run_hooks") and isinstance(getattr(obj, "fn", None), triton.runtime.KernelInterface):
            obj = obj.fn  # autotuner / heuristics wrappers
        if hasattr(obj, "pre_run_hooks") and hasattr(obj, "add_pre_run_hook"):
            hook = (lambda *args, _name=name, **kwargs: launches.append(_name))
            monkeypatch.setattr(obj, "pre_run_hooks", [*obj.pre_run_hooks, hook])
    return launches


def fillers(limit: int) -> list[int]:
    return [-1, limit, limit + 3, -limit, INT32_MIN, INT32_MAX, -123456]


def random_local_indices(g, batch, s_q, k, limit, valid_fraction=0.7):
    """Window-local indices with invalid fillers of every kind mixed in."""
    idx = torch.randint(0, limit, (batch, s_q, k), generator=g, dtype=torch.int32)
    fill = torch.tensor(fillers(limit), dtype=torch.int32)
    pick = fill[torch.randint(0, len(fill), (batch, s_q, k), generator=g)]
    keep = torch.rand(batch, s_q, k, generator=g) < valid_fraction
    return torch.where(keep, idx, pick)


def referenced_rows(idx, limit, lengths):
    """[B, limit] bool: rows a valid entry (value in range, position < length) points at."""
    batch, s_q, k = idx.shape
    valid = (idx >= 0) & (idx < limit)
    if lengths is not None:
        valid &= torch.arange(k)[None, None, :] < lengths[:, None, None]
    used = torch.zeros(batch, limit, dtype=torch.bool)
    for b in range(batch):
        used[b, idx[b][valid[b]].long()] = True
    return used


def make_decode_case(seed, batch, s_q, width, extra, topk, etopk, dtype, *, layout="shared", lengths=True):
    """q (strided), window/extra buffers with NaN in every row no valid entry selects, indices with
    fillers, per-request lengths (one request with length 0 when batch > 1)."""
    g = torch.Generator().manual_seed(seed)
    # 0.1 * N(0, 1): FlashMLA's test distribution, for which its tolerances are made (P.V takes P in bf16).
    q_pad = torch.randn(batch, s_q, H, D + 32, generator=g) * 0.1
    q = q_pad[..., :D].to(dtype)  # leading dims strided
    buf = (torch.randn(batch, width + extra, 1, D, generator=g) * 0.1).to(dtype)
    idx = random_local_indices(g, batch, s_q, topk, width)
    case = dict(q=q, indices=idx)
    topk_length = extra_topk_length = None
    if lengths:
        topk_length = torch.randint(0, topk + 1, (batch,), generator=g, dtype=torch.int32)
        topk_length[0] = topk
        if batch > 1:
            topk_length[-1] = 0
        case["topk_length"] = topk_length
    used = torch.zeros(batch, width + extra, dtype=torch.bool)
    used[:, :width] = referenced_rows(idx, width, topk_length)
    if extra:
        eidx = random_local_indices(g, batch, s_q, etopk, extra)
        case["extra_indices"] = eidx
        if lengths:
            extra_topk_length = torch.randint(0, etopk + 1, (batch,), generator=g, dtype=torch.int32)
            extra_topk_length[0] = etopk
            case["extra_topk_length"] = extra_topk_length
        used[:, width:] = referenced_rows(eidx, extra, extra_topk_length)
    buf[~used] = float("nan")  # a leaked invalid entry turns the output into NaN
    buf = buf.to(DEVICE)  # before slicing: the windows must stay views of one device buffer
    if layout == "shared":
        case["kv_windows"] = buf[:, :width]
        if extra:
            case["extra_kv_windows"] = buf[:, width:]
    else:  # two separate buffers
        case["kv_windows"] = buf[:, :width].clone()
        if extra:
            case["extra_kv_windows"] = buf[:, width:].clone()
    case["attn_sink"] = torch.randn(H, generator=g)
    case["attn_sink"][:8] = float("inf")
    case["attn_sink"][8:16] = float("-inf")
    return {k: v.to(DEVICE) for k, v in case.items()}, buf


def oracle(case):
    return sparse_mla_decode_ref(case["q"], case["kv_windows"], case["indices"], SCALE,
                                 attn_sink=case.get("attn_sink"), topk_length=case.get("topk_length"),
                                 extra_kv=case.get("extra_kv_windows"), extra_indices=case.get("extra_indices"),
                                 extra_topk_length=case.get("extra_topk_length"))


def run_decode(case, **kwargs):
    args = dict(case)
    return attn.decode_attn_sparse(args.pop("q"), args.pop("kv_windows"), args.pop("indices"), SCALE,
                                   **args, **kwargs)


def split_rounding_bound(call, splits):
    """Rounding bound r [n, H, Dv] of a split decode: the partial outputs and the merged output are
    each rounded to bf16 (one ulp, 2^-8 relative, also covers the interpreter's truncating casts):
    r = 2^-8 * (sum_i w_i |o_i| + |o|), partials o_i and weights w_i from the oracle run on the very
    rows and index chunks the kernel got. An element may be off by 1e-3 + r; the cosine distance by
    sum r^2 / sum(a^2 + b^2)."""
    part = sparse_mla_prefill_ref(call["q"].float(), call["kv"].float(), call["indices"], SCALE)
    n = part.out.size(0) // splits
    lse = part.lse.view(n, splits, -1).double()
    weights = torch.softmax(lse.masked_fill(lse == math.inf, -math.inf), dim=1).nan_to_num(0.0)
    parts = part.out.double().view(n, splits, *part.out.shape[1:])
    mixed = (weights[..., None] * parts.abs()).sum(1) + (weights[..., None] * parts).sum(1).abs()
    return (2.0 ** -8 * mixed).cpu()


def assert_matches(out, lse, ref, *, exact: bool, bound=None):
    """exact: float32 path (tight); else the decode tolerances (abs 1e-3 or rel 2.01/128, cosine
    distance 5e-6), widened by a split's rounding bound (split_rounding_bound) when given."""
    out, ref_out = out.double().cpu(), ref.out.double().cpu()
    assert not torch.isnan(out).any()
    err = (out - ref_out).abs()
    if exact:
        assert err.max().item() < 2e-5
    else:
        ok = (err < 1e-3) | (err / (ref_out.abs() + 1e-6) < 2.01 / 128)
        energy = (out.square() + ref_out.square()).sum().clamp_min(1e-30)
        cos_limit = 5e-6
        if bound is not None:
            bound = bound.view_as(err).double()
            ok |= err <= 1e-3 + bound
            cos_limit = max(cos_limit, (bound.square().sum() / energy).item())
        assert ok.all(), err.max().item()
        cos = 1 - 2 * (out * ref_out).sum() / energy
        assert cos.item() < cos_limit, (cos.item(), cos_limit)
    lse, ref_lse = lse.double().cpu(), ref.lse.double().cpu() * LOG2E  # engine lse is base 2
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], rtol=8.01 / 65536, atol=1e-5)
    assert (lse[~finite] == float("inf")).all()


def assert_adapter_indices(indices, batch, s_q, request_stride, spans):
    """Every entry the kernel sees is -1 or a row of its own request inside one of spans
    [(offset, rows)], relative to b * request_stride."""
    n = batch * s_q
    per_query = indices.view(n, -1).cpu().long()
    request = torch.arange(n) // s_q
    base = (request * request_stride)[:, None]
    inside = torch.zeros_like(per_query, dtype=torch.bool)
    for offset, rows in spans:
        inside |= (per_query >= base + offset) & (per_query < base + offset + rows)
    assert ((per_query == -1) | inside).all()


# ---------------------------------------------------------------------------------------------
# decode: oracle matches, offsets, no copy, one launch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["window_only", "shared", "separate"])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_oracle_ref_backend(ref_backend, dispatcher_calls, layout, s_q, splits):
    batch, width = 3, 12
    extra = 0 if layout == "window_only" else 20
    case, buf = make_decode_case(10 + s_q, batch, s_q, width, extra, topk=10, etopk=16, dtype=torch.float32,
                                 layout="separate" if layout == "separate" else "shared")
    out, lse = run_decode(case, num_splits=splits)
    assert out.shape == (batch, s_q, H, 512) and lse.shape == (batch, s_q, H)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert_matches(out, lse, oracle(case), exact=True)

    assert len(dispatcher_calls) == 1  # one kernel launch for the whole batch (and all splits)
    call = dispatcher_calls[0]
    assert call.get("topk_length") is None  # lengths were applied by position in the index list
    assert call["indices"].shape[0] == batch * s_q * splits
    if layout == "separate":
        assert call["kv"].untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()  # one concat
    else:  # viewed in place
        assert call["kv"].data_ptr() == buf.data_ptr()
        assert call["kv"].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    # chunks of one query are consecutive kernel rows: regroup per query before checking the offsets
    indices = call["indices"].view(batch * s_q, -1)
    spans = [(0, width)] + ([(width, extra)] if extra else [])
    assert_adapter_indices(indices, batch, s_q, width + extra, spans)


@pytest.mark.parametrize("sink_layout", ["strided", "expanded"])
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_takes_a_sink_view_of_any_stride(ref_backend, sink_layout, splits):
    """The sink as a column of a wider tensor (stride 2) or one value expanded to every head (stride 0):
    the merge of a split reads it by its stride, as the kernels do."""
    case, _ = make_decode_case(31, 2, 1, 16, 0, topk=12, etopk=0, dtype=torch.float32)
    if sink_layout == "strided":
        wide = torch.randn(H, 2, generator=torch.Generator().manual_seed(3)).to(DEVICE)
        case["attn_sink"] = wide[:, 0]
    else:
        case["attn_sink"] = torch.tensor([0.75], device=DEVICE).expand(H)
    assert case["attn_sink"].stride(0) != 1
    out, lse = run_decode(case, num_splits=splits)
    assert_matches(out, lse, oracle(case), exact=True)


def test_decode_window_slice_is_not_copied(ref_backend, dispatcher_calls):
    """A one-cache call on buf[:, :W] of a wider buffer keeps the buffer's request stride."""
    batch, width, extra = 4, 8, 5
    case, buf = make_decode_case(3, batch, 1, width, extra, topk=6, etopk=4, dtype=torch.float32)
    case.pop("extra_kv_windows"), case.pop("extra_indices"), case.pop("extra_topk_length")
    ref = oracle(case)
    out, lse = run_decode(case, num_splits=1)
    assert_matches(out, lse, ref, exact=True)
    call = dispatcher_calls[0]
    assert call["kv"].data_ptr() == buf.data_ptr()
    assert call["kv"].shape == ((batch - 1) * (width + extra) + width, 1, D)
    assert_adapter_indices(call["indices"], batch, 1, width + extra, [(0, width)])


def test_decode_contiguous_windows_are_not_copied(ref_backend, dispatcher_calls):
    batch, width = 3, 9
    case, _ = make_decode_case(4, batch, 2, width, 0, topk=7, etopk=0, dtype=torch.float32)
    windows = case["kv_windows"].contiguous()
    case["kv_windows"] = windows
    out, lse = run_decode(case, num_splits=1)
    assert_matches(out, lse, oracle(case), exact=True)
    assert dispatcher_calls[0]["kv"].data_ptr() == windows.data_ptr()
    assert dispatcher_calls[0]["kv"].shape == (batch * width, 1, D)


def test_decode_one_row_windows_ignore_the_size_one_stride(ref_backend, dispatcher_calls):
    """W = 1 windows viewed out of a position-major ring: torch calls the view contiguous whatever
    its stride(1) (the stride of a size-1 dim), so the rows must be addressed by stride(0); request b
    must read its own row, not request 0's next position."""
    batch, positions = 3, 5
    g = torch.Generator().manual_seed(21)
    ring = (torch.randn(positions, batch, 1, D, generator=g) * 0.1).to(DEVICE)
    windows = ring[:1].permute(1, 0, 2, 3)  # [batch, 1, 1, D], stride(1) = batch * D
    assert windows.is_contiguous() and windows.stride(1) != windows.stride(0)
    case = dict(q=(torch.randn(batch, 1, H, D, generator=g) * 0.1).to(DEVICE), kv_windows=windows,
                indices=torch.zeros(batch, 1, 1, dtype=torch.int32, device=DEVICE))
    out, lse = run_decode(case, num_splits=1)
    assert_matches(out, lse, oracle(case), exact=True)
    assert dispatcher_calls[0]["kv"].data_ptr() == ring.data_ptr()  # still a view, not a copy


def test_decode_strided_indices_and_lengths(ref_backend):
    """Index tensors and lengths that are views with non-unit last strides."""
    case, _ = make_decode_case(15, 3, 2, 10, 12, topk=9, etopk=11, dtype=torch.float32)
    ref = oracle(case)
    for name in ("indices", "extra_indices"):
        case[name] = case[name].transpose(1, 2).contiguous().transpose(1, 2)  # strides (k*s_q, 1, s_q)
        assert case[name].stride(2) != 1
    for name in ("topk_length", "extra_topk_length"):
        case[name] = torch.stack([case[name], torch.full_like(case[name], -7)], dim=1)[:, 0]
        assert case[name].stride(0) == 2
    out, lse = run_decode(case, num_splits=2)
    assert_matches(out, lse, ref, exact=True)


def test_invalid_entries_never_reach_other_requests(ref_backend, dispatcher_calls):
    """Requests 0 and 2 hold only fillers (incl. -1 and W, which shifted naively would be the last
    row of the previous / first row of the next request); the rows around them are huge."""
    batch, width, extra = 3, 6, 4
    g = torch.Generator().manual_seed(5)
    q = torch.randn(batch, 1, H, D, generator=g).to(DEVICE)
    buf = torch.randn(batch, width + extra, 1, D, generator=g).mul(1e4).to(DEVICE)
    fill = torch.tensor(fillers(width) * 2, dtype=torch.int32)
    idx = torch.randint(0, width, (batch, 1, len(fill)), generator=g, dtype=torch.int32)
    idx[0, 0], idx[2, 0] = fill, fill
    efill = torch.tensor(fillers(extra) * 2, dtype=torch.int32)
    eidx = torch.randint(0, extra, (batch, 1, len(efill)), generator=g, dtype=torch.int32)
    eidx[0, 0], eidx[2, 0] = efill, efill
    sink = torch.full((H,), float("inf"))
    sink[::2] = 0.5
    case = dict(q=q, kv_windows=buf[:, :width], indices=idx.to(DEVICE), extra_kv_windows=buf[:, width:],
                extra_indices=eidx.to(DEVICE), attn_sink=sink.to(DEVICE))
    out, lse = run_decode(case, num_splits=1)
    for b in (0, 2):
        assert (out[b] == 0).all() and (lse[b] == float("inf")).all()
    assert torch.isfinite(lse[1]).all() and out[1, 0, 0::2].abs().sum() > 0
    assert (out[1, 0, 1::2] == 0).all()  # +inf sink zeroes a non-empty row
    assert_matches(out, lse, oracle(case), exact=False)
    assert_adapter_indices(dispatcher_calls[0]["indices"], batch, 1, width + extra, [(0, width), (width, extra)])
    assert (dispatcher_calls[0]["indices"].view(batch, -1)[[0, 2]] == -1).all()


def test_all_invalid_extra_cache_contributes_nothing(ref_backend):
    batch, width, extra = 2, 10, 6
    case, _ = make_decode_case(6, batch, 2, width, extra, topk=8, etopk=5, dtype=torch.float32)
    case["extra_topk_length"] = torch.zeros(batch, dtype=torch.int32, device=DEVICE)
    with_extra = run_decode(case, num_splits=1)
    main_only = {k: v for k, v in case.items() if not k.startswith("extra")}
    alone = run_decode(main_only, num_splits=1)
    assert torch.allclose(with_extra[0], alone[0], rtol=0, atol=1e-5)
    assert torch.equal(torch.isinf(with_extra[1]), torch.isinf(alone[1]))
    assert torch.allclose(with_extra[1], alone[1], rtol=1e-6, atol=0)
    assert_matches(*with_extra, oracle(main_only), exact=True)


@pytest.mark.parametrize("batch, s_q", [(1, 1), (3, 2)])
def test_split_gives_the_kernel_repeated_query_rows(ref_backend, dispatcher_calls, batch, s_q):
    case, _ = make_decode_case(7, batch, s_q, 16, 24, topk=16, etopk=24, dtype=torch.float32)
    out, lse = run_decode(case, num_splits=4)
    assert_matches(out, lse, oracle(case), exact=True)
    assert_repeated_q(dispatcher_calls[0]["q"], case["q"], 4)


def test_auto_split_choice():
    cpu = torch.device("cpu")  # 132 SMs assumed off-GPU
    # 640 entries = 5 pairs of 64-entry blocks: chunks are whole pairs
    assert attn._choose_splits(1, 64, 640, cpu) == 5
    assert attn._choose_splits(16, 64, 640, cpu) == 5  # 16 programs x 8 SMs <= 132; 80 chunks <= 99
    assert attn._choose_splits(17, 64, 640, cpu) == 1
    assert attn._choose_splits(128, 64, 640, cpu) == 1  # one wave already
    assert attn._choose_splits(1, 128, 640, cpu) == 5
    assert attn._choose_splits(8, 128, 640, cpu) == 5  # 16 programs
    assert attn._choose_splits(1, 64, 128, cpu) == 1  # one pair: nothing to gain
    assert attn._choose_splits(1, 64, 129, cpu) == 2
    paged = attn.PAGED_SPLIT_SMS_PER_PROGRAM
    assert attn._choose_splits(19, 64, 640, cpu, paged) == 5  # 95 chunks
    assert attn._choose_splits(20, 64, 640, cpu, paged) == 3  # 100 would not fit 99: 2 pairs per chunk
    assert attn._choose_splits(33, 64, 640, cpu, paged) == 3
    assert attn._choose_splits(34, 64, 640, cpu, paged) == 1  # 34 programs x 4 SMs > 132
    assert attn._choose_splits(12, 128, 640, cpu, paged) == 3  # 24 programs: 99 // 24 = 4 -> 2 pairs -> 3 chunks


def test_auto_split_engages_for_one_request(ref_backend, dispatcher_calls):
    case, _ = make_decode_case(16, 1, 2, 64, 128, topk=64, etopk=128, dtype=torch.float32)
    out, lse = run_decode(case)  # num_splits=None: 2 programs on 132 SMs -> 2 chunks of 96 entries (a pair each)
    assert dispatcher_calls[0]["indices"].shape == (2 * 2, 96)
    assert_matches(out, lse, oracle(case), exact=True)


def test_lse_is_base2(ref_backend):
    case, _ = make_decode_case(8, 2, 1, 12, 0, topk=12, etopk=0, dtype=torch.float32, lengths=False)
    _, lse = run_decode(case, num_splits=2)
    ratio = (lse.double() / oracle(case).lse.double()).flatten()
    assert torch.allclose(ratio, torch.full_like(ratio, LOG2E), rtol=1e-5)  # 1.4427, not 1.0 or 0.693


# ---------------------------------------------------------------------------------------------
# sink and merge
# ---------------------------------------------------------------------------------------------

def test_apply_sink_is_stable_at_extremes():
    """_apply_sink runs inside the merge kernel: a one-chunk merge is exactly the sink application."""
    lse_nat = torch.tensor([0.0, 1e4, -1e4, 1e4, -1e4, 50.0, 3.0, math.inf, math.inf, 7.0, 7.0, 2e4, -2e4])
    sink = torch.tensor([0.0, -1e4, 1e4, 1e4, -1e4, 49.0, -math.inf, math.inf, -math.inf, math.inf, 7.0,
                         -2e4, 2e4])
    heads = len(lse_nat)
    empty = torch.isinf(lse_nat)
    out = torch.randn(1, heads, 16, dtype=torch.float64) + 2.0
    out[:, empty] = 0.0
    got, lse = attn._merge_splits(out.float().to(DEVICE), (lse_nat * LOG2E)[None].to(DEVICE), 1, sink.to(DEVICE))
    got, lse = got[0].cpu(), lse[0].cpu()
    # float64 reference: exp(lse) / (exp(lse) + exp(sink)) = 1 / (1 + exp(sink - lse)); empty rows stay 0
    diff = torch.where(empty, torch.full_like(lse_nat, -math.inf), sink - lse_nat).double()
    expected = out[0] * (1.0 / (1.0 + torch.exp(diff)))[:, None]
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), expected, rtol=1e-6, atol=1e-30)
    assert (got[empty] == 0).all() and (got[9] == 0).all()  # empty rows; +inf sink -> 0
    assert torch.equal(got[6], out[0, 6].float())  # -inf sink: untouched
    assert (got[3] != 0).all() and (got[4] != 0).all()  # |lse|, |sink| = 1e4 at equal values: factor 1/2
    assert torch.equal(torch.isinf(lse), empty) and torch.allclose(lse[~empty], (lse_nat * LOG2E)[~empty])


def test_merge_splits_with_empty_chunks_and_bf16():
    g = torch.Generator().manual_seed(9)
    n, splits, heads, d_v = 3, 4, 11, 32
    lse = torch.randn(n, splits, heads, generator=g) * 30
    lse[0, 1] = math.inf  # an empty chunk
    lse[1] = math.inf  # a query whose chunks are all empty
    lse[2, :, 0] = torch.tensor([1e4, -1e4, 1e4 - 1.0, math.inf])
    parts = torch.randn(n, splits, heads, d_v, generator=g)
    parts[lse == math.inf] = 0.0
    sink = torch.randn(heads, generator=g)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2.0 ** -7)):
        got, merged = attn._merge_splits(parts.to(dtype).view(n * splits, heads, d_v).to(DEVICE),
                                         lse.view(n * splits, heads).to(DEVICE), splits, sink.to(DEVICE))
        got, merged = got.cpu().double(), merged.cpu().double()
        assert got.dtype == torch.float64 and got.shape == (n, heads, d_v)
        nat = lse.double().masked_fill(lse == math.inf, -math.inf) * math.log(2.0)
        w = torch.softmax(nat, dim=1).nan_to_num(0.0)
        ref_lse = torch.logsumexp(nat, dim=1) * LOG2E
        ref = (w[..., None] * parts.to(dtype).double()).sum(1)
        ref *= torch.sigmoid(ref_lse * math.log(2.0) - sink.double())[..., None].nan_to_num(1.0)
        assert (got[1] == 0).all() and (merged[1] == math.inf).all()
        ok = [0, 2]
        assert torch.allclose(merged[ok], ref_lse[ok], rtol=1e-6, atol=1e-5)
        assert torch.allclose(got[ok], ref[ok], rtol=tol, atol=tol)


def test_merge_splits_keeps_nan_rows_nan():
    """A chunk with a NaN score (NaN lse and out) makes its query's merged lse and out NaN, as the
    unsplit kernels and the oracle give; only a query whose chunks are all empty gets +inf / 0."""
    n, splits, heads, d_v = 4, 3, 2, 16
    lse = torch.zeros(n, splits, heads)
    parts = torch.ones(n, splits, heads, d_v)
    lse[0, 1], parts[0, 1] = math.nan, math.nan  # one NaN chunk among finite ones
    lse[1, :], parts[1, :] = math.nan, math.nan  # every chunk NaN
    lse[2, 0], parts[2, 0] = math.nan, math.nan  # a NaN chunk and two empty ones
    lse[2, 1:], parts[2, 1:] = math.inf, 0.0
    got, merged = attn._merge_splits(parts.view(n * splits, heads, d_v).to(DEVICE),
                                     lse.view(n * splits, heads).to(DEVICE), splits, None)
    got, merged = got.cpu(), merged.cpu()
    assert merged[:3].isnan().all() and got[:3].isnan().all()
    assert torch.allclose(merged[3], torch.full((heads,), math.log2(splits)), rtol=1e-6, atol=0)
    assert torch.equal(got[3], torch.ones(heads, d_v))


# ---------------------------------------------------------------------------------------------
# prefill
# ---------------------------------------------------------------------------------------------

def make_prefill_case(seed, dtype):
    """Two packed sequences (5 and 7 tokens) with causal absolute indices, fillers, lengths."""
    g = torch.Generator().manual_seed(seed)
    lens = [5, 7]
    total = sum(lens)
    query = (torch.randn(total, H, D, generator=g) * 0.1).to(dtype)
    kv = (torch.randn(total + 3, 1, D, generator=g) * 0.1).to(dtype)
    topk = 8
    idx = torch.full((total, topk), -1, dtype=torch.int32)
    start = 0
    for n in lens:
        for t in range(n):
            visible = torch.arange(start, start + t + 1, dtype=torch.int32)
            pick = visible[torch.randperm(len(visible), generator=g)][:topk]
            idx[start + t, :len(pick)] = pick
            idx[start + t, len(pick):] = torch.tensor(fillers(total + 3), dtype=torch.int32)[:topk - len(pick)]
        start += n
    kv[total:] = float("nan")  # never selected
    length = torch.randint(0, topk + 1, (total,), generator=g, dtype=torch.int32)
    sink = torch.randn(H, generator=g)
    return [t.to(DEVICE) for t in (query, kv, idx, sink, length)]


def test_prefill_matches_oracle_ref_backend(ref_backend, dispatcher_calls):
    query, kv, idx, sink, length = make_prefill_case(11, torch.float32)
    out = attn.prefill_attn_varlen_sparse(query, kv, idx, SCALE, sink, length)
    ref = sparse_mla_prefill_ref(query, kv, idx, SCALE, attn_sink=sink, topk_length=length)
    assert out.shape == (query.size(0), H, 512)
    assert (out.double() - ref.out.double()).abs().max().item() < 2e-5
    assert len(dispatcher_calls) == 1


# ---------------------------------------------------------------------------------------------
# the real default path (Triton; under the interpreter on CPU)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("splits", [1, 2])
def test_decode_default_path(default_backend, dispatcher_calls, triton_launches, splits):
    if DEVICE == "cpu":
        assert dispatch.resolve_backend() == "triton"
    case, buf = make_decode_case(20 + splits, 2, 2, 8, 16, topk=8, etopk=12, dtype=torch.bfloat16)
    out, lse = run_decode(case, num_splits=splits)
    assert out.dtype == torch.bfloat16
    bound = split_rounding_bound(dispatcher_calls[0], splits) if splits > 1 else None
    assert_matches(out, lse, oracle(case), exact=False, bound=bound)
    assert len(dispatcher_calls) == 1 and dispatcher_calls[0]["kv"].data_ptr() == buf.data_ptr()
    if splits > 1:
        assert_repeated_q(dispatcher_calls[0]["q"], case["q"], splits)
    if dispatch.resolve_backend() == "triton":
        assert len(triton_launches) == 1, triton_launches


def assert_repeated_q(kernel_q, q, splits):
    """With a split the kernel gets q's rows repeated (row i * splits + c = q row i), dense: the build
    launch wrote them (no copy launch of its own)."""
    assert kernel_q.is_contiguous() and kernel_q.data_ptr() != q.data_ptr()
    assert torch.equal(kernel_q.cpu(), q.flatten(0, 1).repeat_interleave(splits, dim=0).cpu())


def test_decode_default_path_single_row_split(default_backend, dispatcher_calls, triton_launches):
    """B = s_q = 1 with a split: q's one strided row repeated for the chunks."""
    case, _ = make_decode_case(30, 1, 1, 8, 24, topk=8, etopk=24, dtype=torch.bfloat16)
    out, lse = run_decode(case, num_splits=3)
    assert_repeated_q(dispatcher_calls[0]["q"], case["q"], 3)
    assert_matches(out, lse, oracle(case), exact=False, bound=split_rounding_bound(dispatcher_calls[0], 3))
    if dispatch.resolve_backend() == "triton":
        assert len(triton_launches) == 1


def test_prefill_default_path(default_backend, triton_launches):
    query, kv, idx, sink, length = make_prefill_case(12, torch.bfloat16)
    out = attn.prefill_attn_varlen_sparse(query, kv, idx, SCALE, sink, length)
    ref = sparse_mla_prefill_ref(query, kv, idx, SCALE, attn_sink=sink, topk_length=length)
    err = (out.double() - ref.out.double()).abs().cpu()
    assert ((err < 8e-4) | (err / (ref.out.double().abs().cpu() + 1e-6) < 3.01 / 128)).all()
    if dispatch.resolve_backend() == "triton":
        assert len(triton_launches) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_replays_in_a_cuda_graph(monkeypatch, backend, splits):
    """A serving loop captures the decode step once and replays it with new inputs copied into the
    same buffers: the call must be capturable (no host sync, launches on the capturing stream) and a
    replay must give exactly what an eager call on the new inputs gives."""
    if backend == "tilelang":
        pytest.importorskip("tilelang")
    _select_backend(monkeypatch, backend)
    case, buf = make_decode_case(40 + splits, 4, 2, 64, 128, topk=64, etopk=96, dtype=torch.bfloat16)
    new_case, new_buf = make_decode_case(50 + splits, 4, 2, 64, 128, topk=64, etopk=96, dtype=torch.bfloat16)
    run_decode(case, num_splits=splits)  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run_decode(case, num_splits=splits)
    buf.copy_(new_buf)  # the windows are views of buf
    for name in ("q", "indices", "topk_length", "extra_indices", "extra_topk_length", "attn_sink"):
        case[name].copy_(new_case[name])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager_out, eager_lse = run_decode(new_case, num_splits=splits)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    dispatch.reset_resolution_for_tests()


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------

def test_decode_bad_inputs_name_the_argument(ref_backend):
    case, _ = make_decode_case(13, 2, 1, 6, 4, topk=4, etopk=3, dtype=torch.float32)

    def call(**changes):
        args = {**case, **changes}
        args = {k: v for k, v in args.items() if v is not None}
        num_splits = args.pop("num_splits", 1)
        scale = args.pop("softmax_scale", SCALE)
        return attn.decode_attn_sparse(args.pop("q"), args.pop("kv_windows"), args.pop("indices"), scale,
                                       num_splits=num_splits, **args)

    with pytest.raises(ValueError, match="^q:"):
        call(q=case["q"][0])
    with pytest.raises(TypeError, match="^q:"):
        call(q=case["q"].half())
    with pytest.raises(TypeError, match="^kv_windows:"):
        call(kv_windows=case["kv_windows"].bfloat16())
    with pytest.raises(ValueError, match="^kv_windows:"):
        call(kv_windows=case["kv_windows"][:1])
    with pytest.raises(TypeError, match="^indices:"):
        call(indices=case["indices"].long())
    with pytest.raises(ValueError, match="^indices:"):
        call(indices=case["indices"][:, :, :0])
    with pytest.raises(ValueError, match="^topk_length:"):
        call(topk_length=case["topk_length"][:1])
    with pytest.raises(ValueError, match="extra_kv_windows and extra_indices"):
        call(extra_indices=None, extra_topk_length=None)
    with pytest.raises(ValueError, match="^extra_topk_length:"):
        call(extra_kv_windows=None, extra_indices=None)
    with pytest.raises(ValueError, match="^extra_kv_windows:"):
        call(extra_kv_windows=case["extra_kv_windows"][..., :256])
    with pytest.raises(ValueError, match="^extra_indices:"):
        call(extra_indices=case["extra_indices"][:, :, :0])
    with pytest.raises(ValueError, match="^attn_sink:"):
        call(attn_sink=case["attn_sink"][:3])
    with pytest.raises(ValueError, match="^softmax_scale:"):
        call(softmax_scale=-1.0)
    with pytest.raises(ValueError, match="^num_splits:"):
        call(num_splits=0)
    with pytest.raises(ValueError, match="^q: expected D >= 512"):
        call(q=case["q"][..., :256])
    with pytest.raises(ValueError, match="^q: expected at least one request, one query token and one head"):
        call(q=case["q"][:, :, :0], num_splits=None)  # the automatic split divides by the programs
    with pytest.raises(TypeError, match="^attn_sink: expected a torch.Tensor"):
        call(attn_sink=[0.0] * H)
    with pytest.raises(TypeError, match="^topk_length: expected a torch.Tensor"):
        call(topk_length=[1, 1])


def test_prefill_bad_inputs_name_the_argument(ref_backend):
    query, kv, idx, sink, length = make_prefill_case(14, torch.float32)
    with pytest.raises(TypeError, match="^query:"):
        attn.prefill_attn_varlen_sparse(query.half(), kv, idx, SCALE)
    with pytest.raises(ValueError, match="^kv_a_with_mqa:"):
        attn.prefill_attn_varlen_sparse(query, kv[:, :, :256], idx, SCALE)
    with pytest.raises(ValueError, match="^index_topk:"):
        attn.prefill_attn_varlen_sparse(query, kv, idx[:3], SCALE)
    with pytest.raises(TypeError, match="^index_topk:"):
        attn.prefill_attn_varlen_sparse(query, kv, idx.long(), SCALE)
    with pytest.raises(ValueError, match="^index_length:"):
        attn.prefill_attn_varlen_sparse(query, kv, idx, SCALE, sink, length[:2])
    with pytest.raises(ValueError, match="^attn_sink:"):
        attn.prefill_attn_varlen_sparse(query, kv, idx, SCALE, sink[:2], length)
    with pytest.raises(TypeError, match="^softmax_scale:"):
        attn.prefill_attn_varlen_sparse(query, kv, idx, "0.1")
    with pytest.raises(ValueError, match="^query: expected D >= 512"):
        attn.prefill_attn_varlen_sparse(query[..., :256], kv[..., :256], idx, SCALE)
    with pytest.raises(TypeError, match="^index_length: expected a torch.Tensor"):
        attn.prefill_attn_varlen_sparse(query, kv, idx, SCALE, sink, [4] * query.size(0))


def test_prefill_fp32_query_with_the_tilelang_backend_names_query():
    """The TileLang kernels are bf16-only: the dispatcher's check refuses fp32 for that backend under
    the entry point's name (before any TileLang import)."""
    query, kv, idx, _, _ = make_prefill_case(16, torch.float32)
    with pytest.raises(TypeError, match=r"^query: expected dtype torch.bfloat16 \(the tilelang backend's kernels are "
                                        r"bf16 only; DEEPINFER_SPARSE_MLA_BACKEND=triton runs float32\), got torch.float32"):
        dispatch.sparse_mla_fwd(query, kv, idx, SCALE, backend="tilelang",
                                  arg_names=attn._PREFILL_ARG_NAMES)


@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_prefill_errors_name_the_entry_points_arguments(monkeypatch, backend):
    """Checks the operator makes too (heads, contiguity, device) name prefill_attn_varlen_sparse's own
    arguments, not the operator's q / kv / indices."""
    _select_backend(monkeypatch, backend)
    query, kv, idx, sink, length = make_prefill_case(15, torch.float32)
    wide_idx = torch.stack([idx, idx], dim=-1)[..., 0]  # last dim strided
    if backend == "triton":  # the kernels' shape and layout limits (the reference takes any)
        cases = [
            (ValueError, "^index_topk: the last dim must be contiguous", dict(index_topk=wide_idx)),
            (ValueError, r"^query: expected h_q in \(64, 128\)", dict(query=query[:, :32])),
            (ValueError, "^kv_a_with_mqa: the last dim must be contiguous",
             dict(kv_a_with_mqa=torch.stack([kv, kv], dim=-1)[..., 0])),
            (ValueError, r"^attn_sink: expected shape \[64\] \(query's h_q\)", dict(attn_sink=sink[:3])),
        ]
    else:
        cases = [(ValueError, r"^index_length: expected shape \[12\] \(query's s_q\)",
                  dict(index_length=length[:2]))]
    good = dict(query=query, kv_a_with_mqa=kv, index_topk=idx, softmax_scale=SCALE, attn_sink=sink,
                index_length=length)
    for error, match, changes in cases:
        with pytest.raises(error, match=match):
            attn.prefill_attn_varlen_sparse(**{**good, **changes})
    dispatch.reset_resolution_for_tests()


# ---------------------------------------------------------------------------------------------
# paged fp8 decode: slot-id lists (CPU, Triton interpreter) and the backend requirement
# ---------------------------------------------------------------------------------------------

def _slot_ids_reference(indices, lengths, slots, n0, extra_indices, extra_lengths, extra_slots, n1):
    batch, s_q, topk = indices.shape
    rows = []
    for b in range(batch):
        for s in range(s_q):
            row = []
            for part, (idx, length, table, n, offset) in enumerate((
                    (indices, lengths, slots, n0, 0), (extra_indices, extra_lengths, extra_slots, n1, n0))):
                if idx is None:
                    continue
                for j, v in enumerate(idx[b, s].tolist()):
                    ok = 0 <= v < table.size(1) and (length is None or j < int(length[b]))
                    slot = int(table[b, v]) if ok else -1
                    row.append(slot + offset if ok and 0 <= slot < n else -1)
            rows.append(row)
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("with_extra", [False, True])
def test_paged_slot_ids_keep_invalid_entries_invalid(with_extra):
    g = torch.Generator().manual_seed(5)
    batch, s_q, width, extra, topk, etopk, n0, n1 = 3, 2, 9, 7, 6, 5, 40, 30
    slots = torch.randint(-1, n0 + 3, (batch, width), generator=g)  # some empty, some out of the cache
    extra_slots = torch.randint(-1, n1 + 3, (batch, extra), generator=g)
    indices = torch.tensor(fillers(width) * 8, dtype=torch.int32)[: batch * s_q * topk].view(batch, s_q, topk)
    indices = torch.where(torch.rand(indices.shape, generator=g) < 0.5,
                          torch.randint(0, width, indices.shape, generator=g, dtype=torch.int32), indices)
    extra_indices = torch.randint(-2, extra + 2, (batch, s_q, etopk), generator=g, dtype=torch.int32)
    lengths = torch.tensor([6, 0, 3], dtype=torch.int32)
    extra_lengths = torch.tensor([5, 2, 0], dtype=torch.int32) if with_extra else None
    used = topk + (etopk if with_extra else 0)
    got, no_q = attn._build_rows(
        indices.to(DEVICE), lengths.to(DEVICE), width, extra_indices.to(DEVICE) if with_extra else None,
        extra_lengths.to(DEVICE) if with_extra else None, extra if with_extra else None, used + 3,
        slots=slots.to(DEVICE), extra_slots=extra_slots.to(DEVICE) if with_extra else None,
        n_slots=(n0, n1 if with_extra else 0))
    assert no_q is None  # no split: no repeated q
    assert bool((got[:, used:] == -1).all())  # padding up to splits * chunk
    want = _slot_ids_reference(indices, lengths, slots, n0, extra_indices if with_extra else None, extra_lengths,
                               extra_slots if with_extra else None, n1 if with_extra else 0)
    assert torch.equal(got[:, :used].cpu(), want)


def test_paged_decode_bad_inputs_name_the_argument(ref_backend):
    from engine.h20_ops import kv_cache

    b, s_q = 2, 1
    good = dict(
        q=torch.zeros(b, s_q, H, D, dtype=torch.bfloat16, device=DEVICE),
        cache=kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 2, 16, DEVICE),
        slots=torch.zeros(b, 8, dtype=torch.int64, device=DEVICE),
        indices=torch.zeros(b, s_q, 4, dtype=torch.int32, device=DEVICE),
        extra_cache=kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 3, 16, DEVICE),
        extra_slots=torch.zeros(b, 6, dtype=torch.int32, device=DEVICE),
        extra_indices=torch.zeros(b, s_q, 5, dtype=torch.int32, device=DEVICE),
        topk_length=torch.zeros(b, dtype=torch.int32, device=DEVICE),
        extra_topk_length=torch.zeros(b, dtype=torch.int32, device=DEVICE),
        attn_sink=torch.zeros(H, dtype=torch.float32, device=DEVICE),
    )

    def call(**changes):
        args = {**good, **changes}
        q, cache, slots, indices = (args.pop(k) for k in ("q", "cache", "slots", "indices"))
        return attn.decode_attn_sparse_paged_fp8(q, cache, slots, indices, SCALE, **args)

    cases = [
        (TypeError, "^q:", dict(q=good["q"].float())),
        (ValueError, "^q:", dict(q=good["q"][:, :0])),
        (ValueError, r"^q: expected shape \[B, s_q, H in \(64, 128\), 512\]",
         dict(q=torch.zeros(b, s_q, H, 576, dtype=torch.bfloat16, device=DEVICE))),
        (ValueError, "^q: expected shape", dict(q=good["q"][:, :, :32])),
        (TypeError, "^cache:", dict(cache=good["cache"].view(torch.int8))),
        (ValueError, "^cache:", dict(cache=torch.zeros(2, 16, 1, 656, dtype=torch.uint8, device=DEVICE))),
        (TypeError, "^slots:", dict(slots=good["slots"].float())),
        (ValueError, "^slots:", dict(slots=good["slots"][:1])),
        (ValueError, "^indices:", dict(indices=good["indices"][:, :, :0])),
        (TypeError, "^topk_length:", dict(topk_length=good["topk_length"].long())),
        (ValueError, "^extra_cache, extra_slots, extra_indices:", dict(extra_slots=None)),
        (ValueError, "^extra_topk_length:", dict(extra_cache=None, extra_slots=None, extra_indices=None)),
        (ValueError, "^extra_cache:", dict(extra_cache=good["extra_cache"][:, :, :, :583])),
        (ValueError, "^extra_cache: expected block_size 16",
         dict(extra_cache=kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 3, 32, DEVICE))),
        (ValueError, "^extra_slots:", dict(extra_slots=good["extra_slots"][:, :0])),
        (ValueError, "^extra_indices:", dict(extra_indices=good["extra_indices"][:1])),
        (ValueError, "^extra_topk_length:", dict(extra_topk_length=good["extra_topk_length"][:1])),
        (ValueError, "^attn_sink:", dict(attn_sink=good["attn_sink"][:3])),
        (TypeError, "^softmax_scale:", None),
    ]
    for error, match, changes in cases:
        with pytest.raises(error, match=match):
            if changes is None:
                attn.decode_attn_sparse_paged_fp8(good["q"], good["cache"], good["slots"], good["indices"], "0.1")
            else:
                call(**changes)
    with pytest.raises(ValueError, match="^backend:"):  # valid arguments reach the dispatcher
        call()


def test_paged_fp8_needs_the_tilelang_backend(default_backend):
    if dispatch.resolve_backend() == "tilelang":
        pytest.skip("TileLang resolved: the kernel itself is tested in tests/test_sparse_mla_sm90_paged_fp8.py")
    q = torch.zeros(1, 1, 64, 512, dtype=torch.bfloat16, device=DEVICE)
    from engine.h20_ops import kv_cache
    cache = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 1, 16, DEVICE)
    slots = torch.zeros(1, 4, dtype=torch.int64, device=DEVICE)
    indices = torch.zeros(1, 1, 4, dtype=torch.int32, device=DEVICE)
    assert not dispatch.paged_fp8_supported()
    with pytest.raises(ValueError, match="backend"):
        attn.decode_attn_sparse_paged_fp8(q, cache, slots, indices, SCALE)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("batch,s_q,lengths", [(3, 2, True), (40, 1, False)])
def test_paged_fp8_equals_the_buffer_path(monkeypatch, batch, s_q, lengths, splits):
    """The paged fp8 kernel shares the bf16 kernel's consumers and sees the same rows in the same
    order (window entries, then extra entries), so with the same split its result must be
    bit-identical to gather_dequant + decode_attn_sparse. Fillers, empty slots (never selected, as in
    the engine: the buffer path would attend to their zero rows), lengths and a sink included."""
    pytest.importorskip("tilelang", reason="the paged fp8 kernel is TileLang's")
    from engine.h20_ops import kv_cache

    _select_backend(monkeypatch, "tilelang")
    g = torch.Generator().manual_seed(batch)
    width, extra, topk, etopk, block = 128, 200, 100, 190, 64

    def cache_and_slots(rows):
        num_blocks = -(-(batch * rows + 50) // block)
        cache = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, num_blocks, block, DEVICE)
        kv_cache.quantize_into_cache(cache, torch.arange(num_blocks * block, device=DEVICE),
                                     (torch.randn(num_blocks * block, 1, D, generator=g) * 0.1).to(DEVICE, torch.bfloat16))
        slots = torch.randperm(num_blocks * block, generator=g)[: batch * rows].view(batch, rows)
        slots[-1, rows // 2:] = -1  # a request with a short history
        return cache, slots.to(DEVICE)

    def local(rows, k):
        idx = torch.argsort(torch.rand(batch, s_q, rows, generator=g), dim=-1)[..., :k].int()
        idx[-1] = torch.where(idx[-1] >= rows // 2, -1, idx[-1])  # the empty slots of the last request
        fill = torch.tensor(fillers(rows), dtype=torch.int32)
        pick = fill[torch.randint(0, len(fill), idx.shape, generator=g)]
        return torch.where(torch.rand(idx.shape, generator=g) < 0.2, pick, idx).to(DEVICE)

    (cache, slots), (ecache, eslots) = cache_and_slots(width), cache_and_slots(extra)
    indices, extra_indices = local(width, topk), local(extra, etopk)
    kwargs = dict(attn_sink=(torch.randn(H, generator=g) * 2).to(DEVICE), extra_indices=extra_indices)
    if lengths:
        kwargs["topk_length"] = torch.randint(0, topk + 1, (batch,), generator=g, dtype=torch.int32).to(DEVICE)
        kwargs["extra_topk_length"] = torch.randint(0, etopk + 1, (batch,), generator=g, dtype=torch.int32).to(DEVICE)
        kwargs["topk_length"][0], kwargs["extra_topk_length"][0] = 0, 0  # request 0: no entry at all
    q = (torch.randn(batch, s_q, H, D, generator=g) * 0.1).to(DEVICE, torch.bfloat16)
    buf = torch.full((batch, width + extra, 1, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    kv_cache.gather_dequant(cache, slots, buf[:, :width])
    kv_cache.gather_dequant(ecache, eslots, buf[:, width:])
    want_out, want_lse = attn.decode_attn_sparse(q, buf[:, :width], indices, SCALE, extra_kv_windows=buf[:, width:],
                                                 num_splits=splits, **kwargs)
    out, lse = attn.decode_attn_sparse_paged_fp8(q, cache, slots, indices, SCALE, extra_cache=ecache,
                                                 extra_slots=eslots, num_splits=splits, **kwargs)
    assert torch.equal(lse, want_lse)
    assert torch.equal(out, want_out)
    if lengths:
        assert bool((out[0] == 0).all()) and bool(torch.isinf(lse[0]).all())


@pytest.mark.gpu
def test_paged_fp8_layout_errors_name_the_entry_points_arguments(monkeypatch):
    """The paged kernel's own layout checks (16-byte aligned caches: the fp8 quantizer needs 4 bytes only) name
    decode_attn_sparse_paged_fp8's cache / extra_cache, not the kernel's cache0 / cache1."""
    pytest.importorskip("tilelang", reason="the paged fp8 kernel is TileLang's")
    from engine.h20_ops import kv_cache

    _select_backend(monkeypatch, "tilelang")
    cache = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 2, 16, DEVICE)
    raw = torch.zeros(cache.untyped_storage().nbytes() + 16, dtype=torch.uint8, device=DEVICE)
    misaligned = raw.as_strided(cache.shape, cache.stride(), 4)  # a valid MODEL1 layout 4 bytes in
    q = torch.zeros(1, 1, H, D, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.zeros(1, 4, dtype=torch.int64, device=DEVICE)
    indices = torch.zeros(1, 1, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="^cache: expected a 16-byte aligned"):
        attn.decode_attn_sparse_paged_fp8(q, misaligned, slots, indices, SCALE)
    with pytest.raises(ValueError, match="^extra_cache: expected a 16-byte aligned"):
        attn.decode_attn_sparse_paged_fp8(q, cache, slots, indices, SCALE, extra_cache=misaligned,
                                          extra_slots=slots, extra_indices=indices)
    dispatch.reset_resolution_for_tests()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's numpy guard: CPU tensors only")
def test_interpreted_kernels_with_runtime_loops_name_the_numpy_they_need(monkeypatch):
    """numpy >= 2.4 breaks triton 3.6's interpreter on runtime loop bounds (a TypeError deep inside it):
    the launches with such loops say so first, naming the kernel and the installed numpy."""
    import numpy

    from engine.h20_ops.vendor import flashmla_sparse

    monkeypatch.setattr(numpy, "__version__", "2.5.2")
    parts, lse_parts = torch.zeros(4, 64, 512), torch.zeros(4, 64)
    with pytest.raises(RuntimeError, match=r"_merge_splits_kernel: .*numpy < 2\.4.*found numpy 2\.5\.2"):
        attn._merge_splits(parts, lse_parts, 2, None)
    q, kv = torch.zeros(2, 64, 576, dtype=torch.bfloat16), torch.zeros(8, 1, 576, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"flash_mla_sparse_fwd: .*found numpy 2\.5\.2"):
        flashmla_sparse.flash_mla_sparse_fwd(q, kv, torch.zeros(2, 1, 4, dtype=torch.int32), 0.1)
