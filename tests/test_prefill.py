"""Sparse MLA prefill (engine.h20_ops.sparse_mla_prefill) against the float32 oracle, per backend.

Cases from engine.h20_ops.testing.prefill_case (invalid fillers of every kind, NaN / +-inf in every kv
row no valid entry selects, lengths 0 / negative / past topk, sinks +-inf, strided views), judged by
testing.assert_matches_oracle (FlashMLA's prefill tolerances; float32 paths exact). The kernels
themselves: tests/test_flashmla_sparse.py (Triton), tests/test_sparse_mla_sm90.py (TileLang).
"""

import pytest
import torch

import engine.h20_ops as ops
from engine.h20_ops.attention import dispatch
from engine.h20_ops.testing import assert_matches_oracle, prefill_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_prefill_matches_oracle(backend, dtype):
    """A packed batch's tokens in one call, every trap at once, 2-D and [s_q, 1, topk] indices."""
    case = prefill_case(11, s_q=9, h_q=64, d_qk=576, s_kv=70, topk=48, n_valid=36, dtype=dtype, device=DEVICE,
                        topk_length=True, all_invalid=True, sink=True)
    ref = case.oracle()
    for indices in (case.indices, case.indices[:, 0]):
        res = ops.sparse_mla_prefill(case.q, case.kv, indices, case.sm_scale, backend=backend, **case.kwargs())
        assert isinstance(res, ops.AttentionOutput)
        assert res.out.dtype == dtype and res.out.shape == (9, 64, 512)
        assert res.lse_log2.dtype == torch.float32 and res.lse_log2.shape == (9, 64)
        assert_matches_oracle(res, ref, decode=False)
    # rows 0 and 3 (fillers only), 1 (a negative length) are empty: out 0, lse +inf
    empty = [0, 1, 3]
    assert bool((res.out[empty] == 0).all()) and bool(torch.isposinf(res.lse_log2[empty]).all())


@pytest.mark.parametrize("h_q,d_qk", [(8, 576), (16, 512), (32, 576)])
@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_tensor_parallel_head_counts_match_oracle(backend, h_q, d_qk):
    """A tensor-parallel rank's share of the heads (64 or 128 split 2-16 ways): h_q 8, 16 and 32 run as they
    are (the portable Triton kernel's head tile of max(16, h_q) rows, not padded to 64), every trap at once."""
    case = prefill_case(200 + h_q, s_q=5, h_q=h_q, d_qk=d_qk, s_kv=60, topk=40, n_valid=30, device=DEVICE,
                        topk_length=True, all_invalid=True, sink=True)
    res = ops.sparse_mla_prefill(case.q, case.kv, case.indices, case.sm_scale, backend=backend, **case.kwargs())
    assert res.out.shape == (5, h_q, 512) and res.lse_log2.shape == (5, h_q)
    assert_matches_oracle(res, case.oracle(), decode=False)


def test_ref_backend_takes_any_head_count():
    """The oracle behind backend='ref' has no kernel tiles: an h_q no kernel takes (12) runs there."""
    case = prefill_case(19, s_q=3, h_q=12, d_qk=512, s_kv=30, topk=16, device=DEVICE, sink=True)
    res = ops.sparse_mla_prefill(case.q, case.kv, case.indices, case.sm_scale, backend="ref", **case.kwargs())
    assert_matches_oracle(res, case.oracle(), decode=False)


def test_tilelang_backend_named_with_other_head_counts_is_refused():
    """backend='tilelang' asks for kernels that take 64 or 128 heads: h_q 16 is refused under q's name with
    both accepted sets (before any TileLang import), not run elsewhere silently."""
    case = prefill_case(18, s_q=2, h_q=16, d_qk=512, s_kv=8, topk=4)
    with pytest.raises(ValueError, match=r"^q: expected h_q in \(64, 128\) on the tilelang backend "
                                         r"\(backend='tilelang'\), got 16; the triton backend runs h_q in "
                                         r"\(8, 16, 32, 64, 128\)$"):
        ops.sparse_mla_prefill(case.q, case.kv, case.indices, case.sm_scale, backend="tilelang")


@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_prefill_of_no_query(backend):
    q = torch.zeros(0, 64, 512, device=DEVICE)
    res = ops.sparse_mla_prefill(q, torch.zeros(4, 1, 512, device=DEVICE),
                                 torch.zeros(0, 8, dtype=torch.int32, device=DEVICE), 0.1, backend=backend)
    assert res.out.shape == (0, 64, 512) and res.lse_log2.shape == (0, 64)


@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_prefill_errors_name_the_argument(backend):
    case = prefill_case(14, s_q=3, h_q=64, d_qk=512, s_kv=16, topk=8, dtype=torch.float32, device=DEVICE,
                        topk_length=True, sink=True)
    q, kv, idx = case.q, case.kv, case.indices[:, 0]
    cases = [
        (TypeError, "^q: expected a torch.Tensor", dict(q=None)),
        (TypeError, "^q: expected dtype", dict(q=q.half())),
        (ValueError, "^q: expected 3 dims", dict(q=q[0])),
        (TypeError, "^kv: expected dtype torch.float32", dict(kv=kv.bfloat16())),
        (ValueError, "^kv: expected 1 kv head", dict(kv=kv.expand(16, 2, 512))),
        (ValueError, r"^kv: expected last dim 512 \(q's d_qk\)", dict(kv=kv[..., :256])),
        (TypeError, "^indices: expected dtype", dict(indices=idx.long())),
        (ValueError, r"^indices: expected 3 rows \(q's s_q\)", dict(indices=idx[:2])),
        (ValueError, "^indices: expected shape", dict(indices=torch.stack([idx, idx], 1))),
        (ValueError, "^indices: expected topk >= 1", dict(indices=idx[:, :0])),
        (TypeError, "^topk_length: expected a torch.Tensor or None", dict(topk_length=[4] * 3)),
        (TypeError, "^topk_length: expected dtype", dict(topk_length=case.topk_length.long())),
        (ValueError, r"^topk_length: expected shape \[3\] \(q's s_q\)", dict(topk_length=case.topk_length[:2])),
        (ValueError, r"^attn_sink: expected shape \[64\] \(q's h_q\)", dict(attn_sink=case.attn_sink[:3])),
        (TypeError, "^attn_sink: expected dtype", dict(attn_sink=case.attn_sink.double())),
        (TypeError, "^sm_scale: expected a python float", dict(sm_scale="0.1")),
        (ValueError, "^sm_scale: expected a finite positive float", dict(sm_scale=0.0)),
        (TypeError, "^d_v: expected an int", dict(d_v=512.0)),
        (ValueError, r"^d_v: expected 1 <= d_v <= d_qk", dict(d_v=600)),
        (ValueError, "^backend: expected one of ref, triton, tilelang or None, got 'cuda'", dict(backend="cuda")),
    ]
    if backend == "triton":  # the kernels' shape and layout limits (the reference takes any)
        cases += [
            (ValueError, r"^q: expected h_q in \(8, 16, 32, 64, 128\), got 12", dict(q=q[:, :12], attn_sink=None)),
            (ValueError, r"^q: expected h_q in \(8, 16, 32, 64, 128\), got 256",
             dict(q=torch.cat([q] * 4, 1), attn_sink=None)),
            (ValueError, r"^q: expected d_qk in \(512, 576\)", dict(q=q[..., :256], kv=kv[..., :256], d_v=256)),
            (ValueError, r"^d_v: expected one of \(512,\)", dict(d_v=256)),
            (ValueError, "^q: the last dim must be contiguous", dict(q=torch.stack([q, q], -1)[..., 0])),
            (ValueError, "^kv: the last dim must be contiguous", dict(kv=torch.stack([kv, kv], -1)[..., 0])),
            (ValueError, "^indices: the last dim must be contiguous", dict(indices=torch.stack([idx, idx], -1)[..., 0])),
        ]
    good = dict(q=q, kv=kv, indices=idx, sm_scale=case.sm_scale, backend=backend, **case.kwargs())
    for error, match, changes in cases:
        args = {**good, **changes}
        with pytest.raises(error, match=match):
            ops.sparse_mla_prefill(args.pop("q"), args.pop("kv"), args.pop("indices"), args.pop("sm_scale"), **args)


def test_prefill_float32_with_the_tilelang_backend_names_q():
    """The TileLang kernels are bf16 only: refused under q's name with the way out, before any TileLang
    import (so also where TileLang is missing)."""
    case = prefill_case(16, s_q=2, h_q=64, d_qk=512, s_kv=8, topk=4, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"^q: expected dtype torch.bfloat16 \(the tilelang backend's kernels are "
                                        r"bf16 only; DEEPINFER_SPARSE_MLA_BACKEND=triton runs float32\), got "
                                        r"torch.float32"):
        ops.sparse_mla_prefill(case.q, case.kv, case.indices, case.sm_scale, backend="tilelang")


# ---------------------------------------------------------------------------------------------
# GPU: each backend's kernel at model sizes, the dispatcher's choice for the tensors at hand
# ---------------------------------------------------------------------------------------------

def _on_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("h_q,d_qk,topk", [(64, 512, 512), (128, 512, 1024), (128, 576, 2048)])
def test_prefill_at_model_sizes_matches_oracle(backend, h_q, d_qk, topk):
    """V4-Flash, V4-Pro and V3.2 shapes, bf16, every trap; on SM90 the triton backend runs the Gluon kernel
    (strided views whose row strides are multiples of 16 elements included)."""
    if backend == "tilelang":
        pytest.importorskip("tilelang")
        if not _on_sm90():
            pytest.skip("the TileLang kernels are built for SM90")
    case = prefill_case(h_q + topk, s_q=300, h_q=h_q, d_qk=d_qk, s_kv=4096, topk=topk, n_valid=topk * 9 // 10,
                        device="cuda", topk_length=True, all_invalid=True, sink=True)
    res = ops.sparse_mla_prefill(case.q, case.kv, case.indices, case.sm_scale, backend=backend, **case.kwargs())
    assert_matches_oracle(res, case.oracle(), decode=False)
    if backend == "triton" and _on_sm90():
        assert dispatch.prefill_kernel(case.q, case.kv, "triton").kernel == "triton_gluon_sm90"


@pytest.mark.gpu
@pytest.mark.parametrize("h_q,d_qk,topk", [(8, 512, 512), (16, 512, 2048), (32, 576, 2048)])
def test_tensor_parallel_head_counts_at_model_sizes_match_oracle(h_q, d_qk, topk):
    """h_q 8, 16, 32 on the GPU (bf16 tensor-core dots, which the CPU interpreter does not run): the portable
    Triton kernel, the dispatcher naming why (the Gluon kernel takes 64 or 128 heads)."""
    dispatch.reset_resolution_for_tests()
    case = prefill_case(h_q + topk, s_q=300, h_q=h_q, d_qk=d_qk, s_kv=4096, topk=topk, n_valid=topk * 9 // 10,
                        device="cuda", topk_length=True, all_invalid=True, sink=True)
    res = ops.sparse_mla_prefill(case.q, case.kv, case.indices, case.sm_scale, backend="triton", **case.kwargs())
    assert_matches_oracle(res, case.oracle(), decode=False)
    choice = dispatch.prefill_kernel(case.q, case.kv, "triton")
    assert choice.kernel == "triton_portable" and f"h_q {h_q}: the Gluon kernel takes 64 or 128" in choice.reason


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["q_start", "q_head_stride", "kv_row_stride", "aligned_strided"])
def test_prefill_rows_16_byte_cp_async_cannot_read_run_the_portable_kernel(layout):
    """Strided views the contract allows but the Gluon kernel's 16-byte cp.async cannot read (a start or a
    row stride not 16-byte aligned: it would not compile) get the portable kernel, with the reason in the
    dispatcher's choices and a correct result; an aligned strided view gets the Gluon kernel."""
    if not _on_sm90():
        pytest.skip("needs an SM90 GPU")
    dispatch.reset_resolution_for_tests()
    case = prefill_case(131, s_q=5, h_q=64, d_qk=576, s_kv=300, topk=100, device="cuda", sink=True)

    def placed(t, width, start):  # t's values in a wider buffer: rows `width` elements apart, `start` in
        buf = torch.zeros(*t.shape[:-1], width, dtype=t.dtype, device=t.device)
        return buf[..., start:start + t.shape[-1]].copy_(t)

    q, kv = case.q, case.kv
    if layout == "q_start":
        q = placed(q, 576 + 16, 4)  # starts 8 bytes into its buffer
    elif layout == "q_head_stride":
        q = placed(q, 576 + 8, 0)  # q.stride(1) = 584 elements
    elif layout == "kv_row_stride":
        kv = placed(kv, 576 + 8, 0)  # kv.stride(0) = 584 elements
    else:
        q, kv = placed(q, 576 + 16, 8), placed(kv, 576 + 32, 16)
    res = ops.sparse_mla_prefill(q, kv, case.indices, case.sm_scale, backend="triton", **case.kwargs())
    assert_matches_oracle(res, case.oracle(), decode=False)
    (choice,) = [c for c in ops.kernel_choices() if c["op"] == "prefill"]
    if layout == "aligned_strided":
        assert choice["kernel"] == "triton_gluon_sm90"
    else:
        assert choice["kernel"] == "triton_portable" and "not 16-byte aligned" in choice["reason"]
