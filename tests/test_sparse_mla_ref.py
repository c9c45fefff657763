"""The oracle against an independent float64 brute-force loop, and its input validation.

Inputs: testing.normal_inputs (FlashMLA's distribution); the float32 oracle must equal the float64 loop
to EXACT_FP32 (testing.assert_close, the one comparator).
"""

import math

import pytest
import torch

from engine.h20_ops.attention.reference import sparse_mla_decode_ref, sparse_mla_prefill_ref
from engine.h20_ops.testing import EXACT_FP32, INT32_MAX as INT_MAX, INT32_MIN as INT_MIN, assert_close, normal_inputs


def brute_force(q, kv, indices, sm_scale, d_v, sink=None, topk_length=None):
    """Per row, per head, per entry: plain python loops in float64."""
    s_q, h_q, _ = q.shape
    s_kv = kv.shape[0]
    q64, kv64 = q.double(), kv[:, 0, :].double()
    out = torch.zeros(s_q, h_q, d_v, dtype=torch.float64)
    lse = torch.empty(s_q, h_q, dtype=torch.float64)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float64)
    for i in range(s_q):
        chosen = [int(idx) for j, idx in enumerate(indices[i].tolist())
                  if 0 <= idx < s_kv and (topk_length is None or j < int(topk_length[i]))]
        for h in range(h_q):
            if not chosen:
                lse[i, h], max_logits[i, h] = math.inf, -math.inf
                continue
            scores = [float(q64[i, h] @ kv64[r]) * sm_scale for r in chosen]
            m = max(scores)
            denom = sum(math.exp(s - m) for s in scores)
            lse[i, h], max_logits[i, h] = m + math.log(denom), m
            for s, r in zip(scores, chosen):
                out[i, h] += math.exp(s - m) / denom * kv64[r, :d_v]
            if sink is not None:
                s_h = float(sink[h])
                if s_h == math.inf:
                    out[i, h] = 0.0
                elif s_h != -math.inf:
                    out[i, h] *= 1.0 / (1.0 + math.exp(s_h - lse[i, h]))
    return out, max_logits, lse


def assert_matches(res, expected):
    out, max_logits, lse = expected
    assert_close("out", res.out, out, EXACT_FP32)
    assert_close("lse", res.lse, lse, EXACT_FP32)
    assert_close("max_logits", res.max_logits, max_logits, EXACT_FP32)


def make_inputs(s_q, h_q, d_qk, s_kv, topk, gen, dtype=torch.bfloat16):
    q = normal_inputs(gen, s_q, h_q, d_qk).to(dtype)
    kv = normal_inputs(gen, s_kv, 1, d_qk).to(dtype)
    idx = torch.randint(0, s_kv, (s_q, topk), generator=gen, dtype=torch.int32)
    return q, kv, idx


@pytest.mark.parametrize("h_q,d_qk", [(64, 512), (128, 576)])
@pytest.mark.parametrize("filler", [-1, INT_MIN, -123456, "s_kv", INT_MAX])
def test_invalid_fillers_and_nan_rows(h_q, d_qk, filler):
    gen = torch.Generator().manual_seed(h_q + d_qk)
    s_q, s_kv, topk = 5, 40, 24
    q, kv, idx = make_inputs(s_q, h_q, d_qk, s_kv, topk, gen)
    fill = s_kv if filler == "s_kv" else filler
    invalid = torch.rand(s_q, topk, generator=gen) < 0.4
    idx[invalid] = fill
    idx[3] = fill  # an empty row
    used = set(idx[(idx >= 0) & (idx < s_kv)].tolist())
    unused = [r for r in range(s_kv) if r not in used]
    assert unused
    kv[unused] = float("nan")  # NaN in unselected rows must never reach the output
    sm_scale = d_qk ** -0.5
    res = sparse_mla_prefill_ref(q, kv, idx, sm_scale)
    assert_matches(res, brute_force(q, kv, idx, sm_scale, 512))
    assert not res.out.isnan().any()
    assert torch.all(res.out[3] == 0) and torch.all(res.lse[3] == math.inf)
    assert torch.all(res.max_logits[3] == -math.inf)


def test_duplicates_count_per_occurrence_and_topk_beyond_s_kv():
    gen = torch.Generator().manual_seed(1)
    s_q, s_kv, topk = 4, 8, 40  # topk > s_kv: duplicates are unavoidable
    q, kv, idx = make_inputs(s_q, 64, 512, s_kv, topk, gen)
    idx[:, ::3] = -1
    res = sparse_mla_prefill_ref(q, kv, idx, 0.05)
    assert_matches(res, brute_force(q, kv, idx, 0.05, 512))
    # A row that lists one key twice weights it twice: not equal to listing it once.
    single = sparse_mla_prefill_ref(q[:1], kv, torch.tensor([[0, 1]], dtype=torch.int32), 0.05)
    double = sparse_mla_prefill_ref(q[:1], kv, torch.tensor([[0, 0, 1]], dtype=torch.int32), 0.05)
    assert not torch.allclose(single.out, double.out)


def test_sink_values_and_lse_unchanged():
    gen = torch.Generator().manual_seed(2)
    q, kv, idx = make_inputs(3, 64, 512, 32, 16, gen)
    sink = torch.randn(64, generator=gen) * 3
    sink[::3] = math.inf
    sink[1::3] = -math.inf
    res = sparse_mla_prefill_ref(q, kv, idx, 0.04, attn_sink=sink)
    assert_matches(res, brute_force(q, kv, idx, 0.04, 512, sink=sink))
    no_sink = sparse_mla_prefill_ref(q, kv, idx, 0.04)
    assert torch.equal(res.lse, no_sink.lse)
    assert torch.all(res.out[:, ::3] == 0)
    assert torch.equal(res.out[:, 1::3], no_sink.out[:, 1::3])


def test_topk_length_zero_and_partial_with_3d_indices():
    gen = torch.Generator().manual_seed(3)
    q, kv, idx = make_inputs(4, 128, 576, 64, 20, gen)
    lengths = torch.tensor([0, 1, 7, 20], dtype=torch.int32)
    sink = torch.randn(128, generator=gen)
    res = sparse_mla_prefill_ref(q, kv, idx[:, None, :], 576 ** -0.5, attn_sink=sink, topk_length=lengths)
    assert_matches(res, brute_force(q, kv, idx, 576 ** -0.5, 512, sink=sink, topk_length=lengths))
    assert torch.all(res.out[0] == 0) and torch.all(res.lse[0] == math.inf)


def test_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(4)
    q_pad = normal_inputs(gen, 6, 3, 80, 600).bfloat16()
    kv_pad = normal_inputs(gen, 50, 2, 700).bfloat16()
    idx_pad = torch.randint(-3, 50, (6, 2, 40), generator=gen, dtype=torch.int32)
    q, kv, idx = q_pad[:, 1, :64, :512], kv_pad[:, 1:2, 100:612], idx_pad[:, 0, ::2]
    assert not (q.is_contiguous() or kv.is_contiguous() or idx.is_contiguous())
    res = sparse_mla_prefill_ref(q, kv, idx, 0.05)
    assert_matches(res, brute_force(q, kv, idx, 0.05, 512))


def test_decode_union_of_two_caches_is_one_softmax():
    """Decode over flat caches: slot ids of a main cache and of an extra cache, attended in one softmax
    (the sink once), equal to one prefill problem over the two caches' rows concatenated."""
    gen = torch.Generator().manual_seed(5)
    b, s_q, h, d, n0, n1 = 3, 2, 64, 512, 40, 30
    q = normal_inputs(gen, b, s_q, h, d).bfloat16()
    kv = normal_inputs(gen, n0, 1, d).bfloat16()
    extra = normal_inputs(gen, n1, 1, d).bfloat16()
    idx = torch.randint(-2, n0 + 2, (b, s_q, 10), generator=gen, dtype=torch.int32)
    eidx = torch.randint(-2, n1 + 2, (b, s_q, 6), generator=gen, dtype=torch.int32)
    eidx[1] = -1  # request 1: extra cache all invalid -> contributes nothing
    lengths = torch.tensor([10, 4, 0], dtype=torch.int32)
    elengths = torch.tensor([6, 6, 3], dtype=torch.int32)
    sink = torch.randn(h, generator=gen)
    res = sparse_mla_decode_ref(q, kv, idx, 0.05, attn_sink=sink, topk_length=lengths,
                                extra_kv=extra, extra_indices=eidx, extra_topk_length=elengths)
    assert res.out.shape == (b, s_q, h, 512) and res.lse.shape == (b, s_q, h)
    cat_kv = torch.cat([kv, extra])
    for r in range(b):
        main = torch.where((idx[r] >= 0) & (idx[r] < n0) & (torch.arange(10) < lengths[r]), idx[r], -1)
        ext = torch.where((eidx[r] >= 0) & (eidx[r] < n1) & (torch.arange(6) < elengths[r]), eidx[r] + n0, -1)
        expected = brute_force(q[r], cat_kv, torch.cat([main, ext], dim=1), 0.05, 512, sink=sink)
        assert_close("out", res.out[r], expected[0], EXACT_FP32)
        assert_close("lse", res.lse[r], expected[2], EXACT_FP32)
    only_main = sparse_mla_decode_ref(q[1:2], kv, idx[1:2], 0.05, attn_sink=sink, topk_length=lengths[1:2])
    assert_close("out", res.out[1], only_main.out[0], EXACT_FP32)


@pytest.mark.parametrize("case,exc,match", [
    (dict(q=torch.zeros(2, 64, 512)), ValueError, "^q: expected 4 dims"),
    (dict(q=torch.zeros(0, 1, 64, 512)), ValueError, "^q: expected at least one request"),
    (dict(kv=torch.zeros(10, 512)), ValueError, "^kv: expected 3 dims"),
    (dict(kv=torch.zeros(10, 1, 256)), ValueError, r"^kv: expected shape \[n_slots, 1, 512\]"),
    (dict(kv=torch.zeros(10, 1, 512, dtype=torch.float64)), TypeError, "^kv: expected dtype"),
    (dict(indices=torch.zeros(2, 1, 4, dtype=torch.int64)), TypeError, "^indices: expected dtype"),
    (dict(indices=torch.zeros(3, 1, 4, dtype=torch.int32)), ValueError, r"^indices: expected shape \[2, 1, topk>=1\]"),
    (dict(topk_length=torch.zeros(3, dtype=torch.int32)), ValueError, "^topk_length: expected shape"),
    (dict(extra_kv=torch.zeros(5, 1, 512)), ValueError, "^extra_kv and extra_indices: pass both or neither"),
    (dict(extra_indices=torch.zeros(2, 1, 3, dtype=torch.int32)), ValueError, "^extra_kv and extra_indices"),
    (dict(extra_topk_length=torch.zeros(2, dtype=torch.int32)), ValueError, "^extra_topk_length: given without"),
    (dict(extra_kv=torch.zeros(5, 1, 256), extra_indices=torch.zeros(2, 1, 3, dtype=torch.int32)), ValueError,
     r"^extra_kv: expected shape \[n_slots, 1, 512\]"),
    (dict(extra_kv=torch.zeros(5, 1, 512), extra_indices=torch.zeros(2, 1, 0, dtype=torch.int32)), ValueError,
     "^extra_indices: expected shape"),
    (dict(attn_sink=torch.zeros(32)), ValueError, r"^attn_sink: expected shape \[64\]"),
])
def test_decode_bad_input_names_the_argument(case, exc, match):
    args = dict(q=torch.zeros(2, 1, 64, 512), kv=torch.zeros(10, 1, 512), indices=torch.zeros(2, 1, 4, dtype=torch.int32),
                sm_scale=0.1)
    args.update(case)
    with pytest.raises(exc, match=match):
        sparse_mla_decode_ref(**args)


@pytest.mark.parametrize("case,exc,name", [
    (dict(q=torch.zeros(2, 64, 512, dtype=torch.int32)), TypeError, "q"),
    (dict(kv=torch.zeros(10, 2, 512).bfloat16()), ValueError, "kv"),
    (dict(kv=torch.zeros(10, 1, 256).bfloat16()), ValueError, "kv"),
    (dict(indices=torch.zeros(2, 4, dtype=torch.int64)), TypeError, "indices"),
    (dict(indices=torch.zeros(3, 4, dtype=torch.int32)), ValueError, "indices"),
    (dict(indices=torch.zeros(2, 2, 4, dtype=torch.int32)), ValueError, "indices"),
    (dict(attn_sink=torch.zeros(32)), ValueError, "attn_sink"),
    (dict(attn_sink=torch.zeros(64, dtype=torch.float64)), TypeError, "attn_sink"),
    (dict(topk_length=torch.zeros(3, dtype=torch.int32)), ValueError, "topk_length"),
    (dict(topk_length=torch.zeros(2, dtype=torch.int64)), TypeError, "topk_length"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale"),
    (dict(sm_scale="0.1"), TypeError, "sm_scale"),
    (dict(q="not a tensor"), TypeError, "q"),
])
def test_bad_input_names_the_argument(case, exc, name):
    args = dict(q=torch.zeros(2, 64, 512).bfloat16(), kv=torch.zeros(10, 1, 512).bfloat16(),
                indices=torch.zeros(2, 4, dtype=torch.int32), sm_scale=0.1, attn_sink=None, topk_length=None)
    args.update(case)
    with pytest.raises(exc, match=rf"^{name}\b"):
        sparse_mla_prefill_ref(**args)


@pytest.mark.gpu
def test_device_mismatch_is_reported():
    with pytest.raises(ValueError, match="^kv"):
        sparse_mla_prefill_ref(torch.zeros(2, 64, 512).bfloat16(), torch.zeros(10, 1, 512).bfloat16().cuda(),
                               torch.zeros(2, 4, dtype=torch.int32), 0.1)


def test_nan_in_a_valid_row_stays_nan_and_empty_rows_stay_zero():
    """Only an empty row (nothing valid) is defined as out 0: a NaN that reaches a valid row's scores
    must come out as NaN, as from every kernel, not be masked into a finite answer."""
    g = torch.Generator().manual_seed(5)
    q = normal_inputs(g, 3, 64, 512)
    kv = normal_inputs(g, 10, 1, 512)
    idx = torch.randint(0, 10, (3, 4), generator=g, dtype=torch.int32)
    idx[2] = -1  # empty
    q[0, 5, 7] = float("nan")
    res = sparse_mla_prefill_ref(q, kv, idx, 0.05)
    assert res.out[0, 5].isnan().all() and res.lse[0, 5].isnan()
    assert not res.out[0, :5].isnan().any() and not res.out[1].isnan().any()
    assert (res.out[2] == 0).all() and (res.lse[2] == float("inf")).all()
