"""Batched sparse decode (engine.h20_ops.sparse_mla_decode / plan_sparse_decode) against the float32 oracle.

Every case comes from engine.h20_ops.testing.decode_case (FlashMLA's traps: invalid fillers of every
kind, NaN in every cache slot no valid entry selects, lengths down to 0, sinks +-inf, a strided q, odd
page sizes per cache, padded block strides) and is judged by testing.assert_matches_oracle (FlashMLA's
decode tolerances; float32 paths exact). On the CPU the Triton kernels run under the interpreter:
dense caches take the direct path (one cache) or the gathered path (two), fp8 caches the gathered path;
the paged fp8 path (a TileLang kernel) and the kernels at real sizes are `gpu` tests.
Also here: the decode lists launch (attention/decode_lists.py), the split merge (attention/merge.py),
the plan (reuse, refusal of a plan made for other shapes, the automatic split) and argument errors.
"""

import math

import pytest
import torch

import engine.h20_ops as ops
from engine.h20_ops import kv_cache, testing
from engine.h20_ops.attention import decode, dispatch
from engine.h20_ops.attention.decode_lists import build_decode_lists
from engine.h20_ops.attention.merge import merge_splits
from engine.h20_ops.testing import (INT32_MAX, INT32_MIN, LOG2E, assert_close, assert_matches_oracle, decode_case,
                                    split_rounding_floor)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# name: decode_case arguments. Page sizes 2 / 53 / 61 / 69 are odd on purpose (a slot's block and
# offset are a real division); block_pad pads each block's stride beyond the block (a pool's view).
CASES = {
    "dense one cache": dict(batch=3, s_q=2, h_q=64, topk=24),
    "dense two caches": dict(batch=3, s_q=2, h_q=64, topk=24, extra_topk=20),
    "MODEL1 pages 2 / 53": dict(batch=2, s_q=2, h_q=64, topk=24, extra_topk=20, layout=kv_cache.MODEL1,
                                block_sizes=(2, 53)),
    "V32 pages 61 / 69, padded blocks, h_q 128": dict(batch=2, s_q=1, h_q=128, topk=24, extra_topk=20,
                                                      layout=kv_cache.V32, block_sizes=(61, 69), block_pad=3),
}
# the path on the process's backend (on the CPU: triton); fp8 caches: its paged fp8 kernel
PATHS = {"dense one cache": "direct", "dense two caches": "gathered"}
FP8_CASES = [name for name in CASES if CASES[name].get("layout") is not None]


@pytest.fixture
def launches(monkeypatch):
    """Records the launches of a decode call: the list launch, the gathers, the attention kernel (a prefill
    kernel, the Triton paged fp8 kernel or the TileLang one), the merge."""
    from engine.h20_ops.attention import triton_paged_fp8

    calls = {"lists": [], "gathers": [], "kernel": [], "paged": [], "merge": []}

    def record(module, name, key, keep):
        real = getattr(module, name)

        def recording(*args, **kwargs):
            calls[key].append(keep(*args, **kwargs))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, recording)

    record(decode, "build_decode_lists", "lists", lambda *a, **k: k)
    record(kv_cache, "gather_dequant", "gathers", lambda cache, slots, out: slots.shape)
    record(dispatch, "run_prefill_kernel", "kernel",
           lambda kernel, q, kv, indices, sm_scale, d_v, sink, lengths, *out: dict(kernel=kernel, q=q, kv=kv,
                                                                                   indices=indices, lengths=lengths))
    record(triton_paged_fp8, "paged_fp8_decode", "paged", lambda q, cache, indices, *a, **k: dict(q=q, splits=k["splits"]))
    record(dispatch, "run_paged_fp8_kernel", "paged",
           lambda kernel, q, cache0, cache1, lists, *a, **k: dict(q=q, lists=lists, kernel=kernel))
    record(decode, "merge_splits", "merge", lambda parts, lse, splits, *rest: splits)
    return calls


@pytest.fixture
def triton_process(engine_env):
    """The process's backend pinned to triton: a float32 test on the process's backend (the TileLang kernels
    are bf16 only and refuse float32 q by name, test_prefill's float32 test)."""
    engine_env(DEEPINFER_SPARSE_MLA_BACKEND="triton")


def check(case, plan, res, name: str = "") -> None:
    """res of case.run(plan) against the oracle: testing.assert_matches_oracle, with a split's stated floor
    (testing.split_rounding_floor, computed on the plan's own chunks)."""
    floor = split_rounding_floor(case, plan) if plan.splits > 1 else None
    assert_matches_oracle(res, case.oracle(), decode=True, split=plan.splits > 1, floor=floor, name=name)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_oracle(name, splits, launches):
    """bf16 through the process's backend (on the CPU: the Triton kernels under the interpreter), and the
    launches each path makes: direct (the kernel reads the one cache in place: no list launch without a
    split), gathered (one list launch, one kernel launch over the gathered rows), paged fp8 (the Triton
    kernel reads both caches' lists and cuts a split's chunks itself: one launch); with a split the kernel
    gets q's rows repeated (written by the list launch; the Triton paged kernel repeats them itself) and
    one merge follows."""
    case = decode_case(10 * list(CASES).index(name) + splits, device=DEVICE, **CASES[name])
    plan = case.plan(num_splits=splits)
    assert plan.path == PATHS.get(name, "paged_fp8") and plan.splits == splits
    res = case.run(plan)
    b, s_q, h_q, _ = case.q.shape
    assert isinstance(res, ops.AttentionOutput)
    assert res.out.dtype == torch.bfloat16 and res.out.shape == (b, s_q, h_q, 512)
    assert res.lse_log2.dtype == torch.float32 and res.lse_log2.shape == (b, s_q, h_q)
    check(case, plan, res)
    # request 0 has no valid entry (decode_case's lengths): out 0, lse +inf
    assert bool((res.out[0] == 0).all()) and bool(torch.isposinf(res.lse_log2[0]).all())
    _check_launches(case, plan, launches)


# a tensor-parallel rank's heads (64 or 128 split 2-16 ways), each path once
TP_CASES = {
    "dense one cache, h_q 8": dict(batch=3, s_q=2, h_q=8, topk=24),
    "dense two caches, h_q 16": dict(batch=3, s_q=2, h_q=16, topk=24, extra_topk=20),
    "MODEL1 pages 2 / 53, h_q 32": dict(batch=2, s_q=2, h_q=32, topk=24, extra_topk=20, layout=kv_cache.MODEL1,
                                        block_sizes=(2, 53)),
    "V32 pages 61 / 69, padded blocks, h_q 8": dict(batch=2, s_q=1, h_q=8, topk=24, extra_topk=20,
                                                    layout=kv_cache.V32, block_sizes=(61, 69), block_pad=3),
}


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", list(TP_CASES))
def test_tensor_parallel_head_counts_match_oracle(name, splits):
    """h_q 8, 16, 32 on every path of the process's backend (on the CPU: triton; the prefill kernel's head
    tile of max(16, h_q) rows, the paged fp8 kernel's own), with a split and its merge, every trap."""
    case = decode_case(500 + 10 * list(TP_CASES).index(name) + splits, device=DEVICE, **TP_CASES[name])
    plan = case.plan(num_splits=splits)
    res = case.run(plan)
    b, s_q, h_q, _ = case.q.shape
    assert res.out.shape == (b, s_q, h_q, 512) and res.lse_log2.shape == (b, s_q, h_q)
    check(case, plan, res)


def test_ref_backend_takes_any_head_count():
    """The oracle behind backend='ref' has no kernel tiles: an h_q no kernel takes (12) runs there."""
    case = decode_case(77, batch=2, s_q=1, h_q=12, topk=16, extra_topk=8, layout=kv_cache.MODEL1, device=DEVICE)
    plan = case.plan(num_splits=2, backend="ref")
    check(case, plan, case.run(plan))


@pytest.mark.parametrize("name,splits", [(FP8_CASES[0], 3), (FP8_CASES[1], 1)])
def test_fp8_gathered_path_matches_oracle(monkeypatch, name, splits, launches):
    """fp8 caches on the gathered path (what the TileLang backend takes for caches its paged
    kernel cannot read; here the Triton backend with its paged kernel taken away): one list launch, one
    gather_dequant per cache into one buffer, one prefill kernel launch."""
    monkeypatch.delitem(dispatch.PAGED_FP8_KERNELS, "triton")
    case = decode_case(90 + splits, device=DEVICE, **CASES[name])
    plan = case.plan(num_splits=splits, backend="triton")
    assert plan.path == "gathered"
    check(case, plan, case.run(plan))
    _check_launches(case, plan, launches)


def _check_launches(case, plan, launches):
    b, s_q, h_q, d = case.q.shape
    n, splits = b * s_q, plan.splits
    assert len(launches["kernel"]) + len(launches["paged"]) == 1 and len(launches["merge"]) == (splits > 1)
    if plan.kernel == "triton_paged_fp8":
        assert launches["lists"] == [] and launches["gathers"] == [] and launches["paged"][0]["splits"] == splits
        return
    if plan.path == "paged_fp8":  # the TileLang kernel: one list launch (a split's chunks and q rows), no gathers
        paged = launches["paged"][0]
        assert len(launches["lists"]) == 1 and not launches["lists"][0]["positions"] and launches["gathers"] == []
        assert paged["lists"].shape == (n * splits, plan.chunk) and paged["q"].shape == (n * splits, h_q, d)
        return
    kernel = launches["kernel"][0]
    if plan.path == "direct" and splits == 1:
        assert launches["lists"] == [] and kernel["kv"] is case.main.cache
        assert kernel["indices"].data_ptr() == case.indices.data_ptr()  # the slot ids as they are
        assert torch.equal(kernel["lengths"], case.topk_length.repeat_interleave(s_q))
    else:
        assert len(launches["lists"]) == 1 and kernel["lengths"] is None  # lengths applied by the list launch
        assert launches["lists"][0]["positions"] == (plan.path == "gathered")
        assert kernel["indices"].shape == (n * splits, plan.chunk)
    if plan.path == "gathered":
        assert kernel["kv"].shape == (n * (plan.topk + plan.extra_topk), 1, d)
        fp8 = plan.fp8_layout is not None
        assert launches["gathers"] == ([(n, plan.topk), (n, plan.extra_topk)] if fp8 else [])
    if splits > 1:
        q_split = kernel["q"]
        assert q_split.is_contiguous() and q_split.shape == (n * splits, h_q, d)
        assert torch.equal(q_split, case.q.flatten(0, 1).repeat_interleave(splits, dim=0))


@pytest.mark.parametrize("name,splits", list(zip(CASES, (1, 2, 1, 2))))
def test_float32_is_exact(name, splits):
    """float32 q with dense float32 caches or fp8 caches (dequantized exactly into a float32 buffer) through
    the Triton backend, with and without a split: no bf16 rounding anywhere, so EXACT_FP32."""
    case = decode_case(50 + len(name), dtype=torch.float32, device=DEVICE, **CASES[name])
    plan = case.plan(num_splits=splits, backend="triton")
    res = case.run(plan)
    assert res.out.dtype == torch.float32
    check(case, plan, res)


@pytest.mark.parametrize("name,splits", [("dense two caches", 3), ("MODEL1 pages 2 / 53", 1)])
def test_ref_backend_is_exact(name, splits):
    """The ref backend (the oracle as the attention kernel, torch's reference dequantization for fp8
    caches) through the same lists and merge launches."""
    case = decode_case(70 + splits, dtype=torch.float32, device=DEVICE, **CASES[name])
    plan = case.plan(num_splits=splits, backend="ref")
    assert plan.kernel == "ref"
    check(case, plan, case.run(plan))


def test_automatic_split_engages_for_few_rows(triton_process):
    """num_splits None: one request of 2 query rows on 132 SMs (the CPU's assumed count) x 192 entries ->
    2 chunks of 96 (one pair of 64-entry blocks each); MODEL1 caches of 64-token pages (the engine's),
    padded block strides."""
    case = decode_case(16, batch=1, s_q=2, h_q=64, topk=64, extra_topk=128, dtype=torch.float32, device=DEVICE,
                       layout=kv_cache.MODEL1, block_sizes=(64, 64), block_pad=2)
    plan = case.plan()
    if DEVICE == "cpu":
        assert (plan.splits, plan.chunk) == (2, 96)
    check(case, plan, case.run(plan))


def test_automatic_split_choice():
    cpu = torch.device("cpu")  # 132 SMs assumed off-GPU
    buffer, paged = decode.SPLIT_SMS_PER_PROGRAM["gathered"], decode.SPLIT_SMS_PER_PROGRAM["paged_fp8"]
    assert decode.SPLIT_SMS_PER_PROGRAM["direct"] == buffer
    # 640 entries = 5 pairs of 64-entry blocks: chunks are whole pairs
    assert decode._choose_splits(1, 64, 640, cpu, buffer) == 5
    assert decode._choose_splits(16, 64, 640, cpu, buffer) == 5  # 16 programs x 8 SMs <= 132; 80 chunks <= 99
    assert decode._choose_splits(17, 64, 640, cpu, buffer) == 1
    assert decode._choose_splits(128, 64, 640, cpu, buffer) == 1  # one wave already
    assert decode._choose_splits(1, 128, 640, cpu, buffer) == 5
    assert decode._choose_splits(8, 128, 640, cpu, buffer) == 5  # 16 programs
    assert decode._choose_splits(1, 64, 128, cpu, buffer) == 1  # one pair: nothing to gain
    assert decode._choose_splits(1, 64, 129, cpu, buffer) == 2
    assert decode._choose_splits(19, 64, 640, cpu, paged) == 5  # 95 chunks
    assert decode._choose_splits(20, 64, 640, cpu, paged) == 3  # 100 would not fit 99: 2 pairs per chunk
    assert decode._choose_splits(33, 64, 640, cpu, paged) == 3
    assert decode._choose_splits(34, 64, 640, cpu, paged) == 1  # 34 programs x 4 SMs > 132
    assert decode._choose_splits(12, 128, 640, cpu, paged) == 3  # 24 programs: 99 // 24 = 4 -> 2 pairs -> 3 chunks
    # two programs per SM (the Triton kernel's 16-head tiles): 264 slots, chunks fill at most all of them
    assert decode._choose_splits(4, 16, 640, cpu, 1, 2) == 5
    assert decode._choose_splits(128, 16, 640, cpu, 1, 2) == 2  # 264 // 128 = 2 chunks: B 64, s_q 2
    assert decode._choose_splits(133, 16, 640, cpu, 1, 2) == 1  # 264 // 133 = 1: B 74 stays one wave
    assert decode._choose_splits(265, 16, 640, cpu, 1, 2) == 1  # more programs than slots


def test_few_head_triton_tiles_plan_their_split_by_slots():
    """plan_sparse_decode hands the Triton kernel's programs per SM to the split choice: h_q 16 at 128
    query rows splits in two, h_q 64 (one program per SM) does not."""
    cache = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 2, 64, "cpu")
    for h_q, splits in ((16, 2), (8, 2), (32, 1), (64, 1)):
        plan = decode.plan_sparse_decode(cache, batch=64, s_q=2, h_q=h_q, topk=128, q_dtype=torch.bfloat16,
                                         extra_cache=cache, extra_topk=512, backend="triton")
        assert (plan.kernel, plan.splits) == ("triton_paged_fp8", splits), (h_q, plan)


# ---------------------------------------------------------------------------------------------
# views, empty caches, the plan
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,layout,splits", [(False, None, 1), (True, None, 2), (True, kv_cache.MODEL1, 1)])
def test_decode_takes_views_of_any_stride(extra, layout, splits, triton_process):
    """Dense caches, slot ids, lengths and the sink as views with non-unit strides (a cache: one row of
    each slot of a wider pool, its size-1 dim's stride not the row's; the sink also expanded from one
    value: stride 0), on the direct path (one dense cache, splits 1: the kernel reads the cache and the
    slot ids itself), through the list launch, the gathers and the merge, and on the paged fp8 path (the
    Triton kernel reads the lists, lengths and sink itself: it once read them with unit strides)."""
    args = dict(batch=3, s_q=1, h_q=64, topk=20, layout=layout) | (dict(extra_topk=12) if extra else {})
    case = decode_case(15, dtype=torch.float32, device=DEVICE, block_sizes=(2, 53), **args)
    ref = case.oracle()
    for cache in ((case.main, case.extra) if extra else (case.main,)) if layout is None else ():
        pool = torch.full((cache.n_slots, 3, 512), float("nan"), device=DEVICE)
        pool[:, 1:2] = cache.cache
        cache.cache = pool[:, 1:2]
        assert cache.cache.stride() == (3 * 512, 512, 1)
    names = ("indices", "extra_indices") if extra else ("indices",)
    for name in names:
        value = getattr(case, name)
        setattr(case, name, torch.stack([value, torch.full_like(value, -7)], dim=-1)[..., 0])  # last stride 2
        assert getattr(case, name).stride(2) == 2
    for name in ("topk_length", "extra_topk_length") if extra else ("topk_length",):
        value = getattr(case, name)
        setattr(case, name, torch.stack([value, torch.full_like(value, -7)], dim=1)[:, 0])
        assert getattr(case, name).stride(0) == 2
    case.attn_sink = torch.stack([case.attn_sink, torch.zeros_like(case.attn_sink)], dim=1)[:, 0]
    plan = case.plan(num_splits=splits)
    assert_matches_oracle(case.run(plan), ref, decode=True)  # the oracle on the original tensors (float32: exact)
    case.attn_sink = torch.tensor([0.75], device=DEVICE).expand(64)
    check(case, plan, case.run(plan))


def test_all_invalid_extra_cache_contributes_nothing(triton_process):
    case = decode_case(6, batch=2, s_q=2, h_q=64, topk=16, extra_topk=10, dtype=torch.float32, device=DEVICE)
    case.extra_topk_length = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with_extra = case.run(case.plan(num_splits=1))
    alone = ops.sparse_mla_decode(case.q, case.main.cache, case.indices, case.sm_scale, attn_sink=case.attn_sink,
                                  topk_length=case.topk_length)
    assert_close("out", with_extra.out, alone.out, testing.EXACT_FP32)
    assert_close("lse_log2", with_extra.lse_log2, alone.lse_log2, testing.EXACT_FP32)
    assert_matches_oracle(with_extra, case.oracle(), decode=True)


def test_a_plan_is_reused_across_calls(monkeypatch):
    """One plan per step and layer type: calls with it make no plan of their own, on new data."""
    plan = decode_case(1, batch=2, s_q=1, h_q=64, topk=16, extra_topk=8, device=DEVICE).plan(num_splits=2)

    def no_planning(*args, **kwargs):
        raise AssertionError("sparse_mla_decode made a plan although it was given one")

    monkeypatch.setattr(decode, "plan_sparse_decode", no_planning)
    for seed in (2, 3):
        case = decode_case(seed, batch=2, s_q=1, h_q=64, topk=16, extra_topk=8, device=DEVICE)
        check(case, plan, case.run(plan))


def test_a_plan_made_for_other_shapes_is_refused():
    base = dict(batch=2, s_q=2, h_q=64, topk=8, extra_topk=6)
    case = decode_case(4, device=DEVICE, **base)
    others = {
        "batch": dict(base, batch=3), "s_q": dict(base, s_q=1), "h_q": dict(base, h_q=128),
        "topk": dict(base, topk=9), "extra_topk": dict(base, extra_topk=5),
        "fp8 layout": dict(base, layout=kv_cache.MODEL1),
    }
    for what, args in others.items():
        other = decode_case(5, device=DEVICE, **args)
        with pytest.raises(ValueError, match=r"^plan: made for \(batch, s_q, h_q, topk, extra_topk, fp8 layout\)"):
            case.run(other.plan())
    no_extra = decode_case(5, device=DEVICE, **dict(base, extra_topk=0))
    with pytest.raises(ValueError, match="^plan: made for"):
        no_extra.run(case.plan())
    # a plan records the main cache's kind: an extra cache of another kind is refused by name all the same
    fp8 = decode_case(5, device=DEVICE, **dict(base, layout=kv_cache.MODEL1))
    for main, extra in ((case, fp8), (fp8, case)):
        with pytest.raises(ValueError, match="^extra_cache: expected the same kind of cache as cache"):
            ops.sparse_mla_decode(main.q, main.main.cache, main.indices, main.sm_scale, plan=main.plan(),
                                  extra_cache=extra.extra.cache, extra_indices=main.extra_indices)


# ---------------------------------------------------------------------------------------------
# the decode lists launch
# ---------------------------------------------------------------------------------------------

def _lists_reference(indices, lengths, n0, extra_indices, extra_lengths, n1, list_len, positions):
    """Python loops: per query row its main then extra entries (SLOTS: slot ids, the extra cache's offset
    by n0; POSITIONS: r * L + p), -1 for every invalid entry and for the padding; and the masked slots."""
    batch, s_q, topk = indices.shape
    etopk = 0 if extra_indices is None else extra_indices.size(2)
    width = topk + etopk
    lists, slots = [], []
    for b in range(batch):
        for s in range(s_q):
            r = b * s_q + s
            row, masked = [], []
            for idx, length, n, offset in ((indices, lengths, n0, 0), (extra_indices, extra_lengths, n1, n0)):
                if idx is None:
                    continue
                for j, v in enumerate(idx[b, s].tolist()):
                    ok = 0 <= v < n and (length is None or j < int(length[b]))
                    masked.append(v if ok else -1)
                    row.append(-1 if not ok else (r * width + len(row) if positions else v + offset))
            lists.append(row + [-1] * (list_len - width))
            slots.append(masked)
    return torch.tensor(lists, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32)


@pytest.mark.parametrize("positions", [False, True])
def test_decode_lists_never_turn_a_filler_into_a_slot(positions):
    """Fillers chosen to land on another cache's slot if a list were offset before masking: main
    n0 .. n0 + n1 - 1 (the extra cache's slots in SLOTS mode), extra -1 and -n0 (the main cache's last
    and first slot), INT_MAX (which wraps when offset), INT_MIN; lengths 0, negative and past topk; a
    split: the same launch writes q's (strided) rows repeated."""
    g = torch.Generator().manual_seed(5)
    batch, s_q, topk, etopk, n0, n1, splits = 3, 2, 12, 9, 40, 30, 3
    main_fill = torch.tensor([-1, n0, n0 + 1, n0 + n1 - 1, INT32_MIN, INT32_MAX], dtype=torch.int32)
    extra_fill = torch.tensor([-1, -n0, -n0 + 5, n1, INT32_MAX, INT32_MIN], dtype=torch.int32)

    def mixed(k, n, fill):
        idx = torch.randint(0, n, (batch, s_q, k), generator=g, dtype=torch.int32)
        pick = fill[torch.randint(0, len(fill), idx.shape, generator=g)]
        return torch.where(torch.rand(idx.shape, generator=g) < 0.5, pick, idx)

    indices, extra_indices = mixed(topk, n0, main_fill), mixed(etopk, n1, extra_fill)
    lengths = torch.tensor([topk, 0, 5], dtype=torch.int32)
    extra_lengths = torch.tensor([-3, etopk + 4, 2], dtype=torch.int32)
    q = testing.normal_inputs(g, batch * s_q, 64, 576 + 64)[..., :576]
    chunk = -(-(topk + etopk) // splits)
    lists, slots, q_split = build_decode_lists(
        indices.to(DEVICE), lengths.to(DEVICE), n0, extra_indices.to(DEVICE), extra_lengths.to(DEVICE), n1,
        splits * chunk, positions=positions, q_rows=q.to(DEVICE), splits=splits)
    want_lists, want_slots = _lists_reference(indices, lengths, n0, extra_indices, extra_lengths, n1, splits * chunk,
                                              positions)
    assert torch.equal(lists.cpu(), want_lists)
    assert (slots is None) == (not positions)
    if positions:
        assert torch.equal(slots.cpu(), want_slots)
    assert torch.equal(q_split.cpu(), q.repeat_interleave(splits, dim=0))


def test_decode_lists_of_one_cache_without_lengths():
    g = torch.Generator().manual_seed(6)
    n0 = 17
    indices = testing.random_indices(g, 4, n0, 10, 6, testing.fillers_for(n0)).view(2, 2, 10)
    lists, slots, q_split = build_decode_lists(indices.to(DEVICE), None, n0, None, None, 0, 16, positions=False)
    want, _ = _lists_reference(indices, None, n0, None, None, 0, 16, positions=False)
    assert torch.equal(lists.cpu(), want) and slots is None and q_split is None


# ---------------------------------------------------------------------------------------------
# the split merge
# ---------------------------------------------------------------------------------------------

def test_merge_applies_the_sink_stably_at_extremes():
    """A one-chunk merge is exactly the sink application (in the merge kernel): factor
    1 / (1 + exp(sink - lse)) for |lse|, |sink| up to 2e4, sink -inf -> 1, +inf -> 0, empty rows stay 0."""
    lse_nat = torch.tensor([0.0, 1e4, -1e4, 1e4, -1e4, 50.0, 3.0, math.inf, math.inf, 7.0, 7.0, 2e4, -2e4])
    sink = torch.tensor([0.0, -1e4, 1e4, 1e4, -1e4, 49.0, -math.inf, math.inf, -math.inf, math.inf, 7.0,
                         -2e4, 2e4])
    heads = len(lse_nat)
    empty = torch.isinf(lse_nat)
    out = torch.randn(1, heads, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 2.0
    out[:, empty] = 0.0
    got, lse = merge_splits(out.float().to(DEVICE), (lse_nat * LOG2E)[None].to(DEVICE), 1, sink.to(DEVICE),
                            torch.float32)
    diff = torch.where(empty, torch.full_like(lse_nat, -math.inf), sink - lse_nat).double()
    expected = out[0] * (1.0 / (1.0 + torch.exp(diff)))[:, None]  # float64
    assert_close("out", got[0], expected, testing.FP32_RELATIVE)
    assert_close("lse_log2", lse[0], lse_nat.double() * LOG2E, testing.FP32_RELATIVE)
    got = got[0].cpu()
    assert (got[9] == 0).all() and torch.equal(got[6], out[0, 6].float())  # +inf sink -> 0; -inf: untouched
    assert (got[3] != 0).all() and (got[4] != 0).all()  # |lse|, |sink| = 1e4 at equal values: factor 1/2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_weighs_chunks_by_lse_and_skips_empty_ones(dtype):
    g = torch.Generator().manual_seed(9)
    n, splits, heads, d_v = 3, 4, 11, 32
    lse = torch.randn(n, splits, heads, generator=g) * 30
    lse[0, 1] = math.inf  # an empty chunk
    lse[1] = math.inf  # a query whose chunks are all empty
    lse[2, :, 0] = torch.tensor([1e4, -1e4, 1e4 - 1.0, math.inf])
    parts = torch.randn(n, splits, heads, d_v, generator=g)
    parts[lse == math.inf] = 0.0
    sink = torch.randn(heads, generator=g)
    got, merged = merge_splits(parts.to(dtype).view(n * splits, heads, d_v).to(DEVICE),
                               lse.view(n * splits, heads).to(DEVICE), splits, sink.to(DEVICE), dtype)
    assert got.dtype == dtype and got.shape == (n, heads, d_v) and merged.dtype == torch.float32
    nat = lse.double().masked_fill(lse == math.inf, -math.inf) * math.log(2.0)
    w = torch.softmax(nat, dim=1).nan_to_num(0.0)
    ref_lse = torch.logsumexp(nat, dim=1) * LOG2E
    ref = (w[..., None] * parts.to(dtype).double()).sum(1)
    ref *= torch.sigmoid(ref_lse * math.log(2.0) - sink.double())[..., None]
    ref[1], ref_lse[1] = 0.0, math.inf  # every chunk empty: out 0, lse +inf
    out_tol = testing.FP32_RELATIVE if dtype == torch.float32 else testing.out_tolerance(testing.DECODE_OUT, got)
    assert_close("out", got, ref, out_tol)
    assert_close("lse_log2", merged, ref_lse, testing.FP32_RELATIVE)


def test_merge_keeps_nan_rows_nan():
    """A chunk with a NaN score (NaN lse and out) makes its query's merged lse and out NaN, as the unsplit
    kernels and the oracle give; only a query whose chunks are all empty gets +inf / 0."""
    n, splits, heads, d_v = 4, 3, 2, 16
    lse = torch.zeros(n, splits, heads)
    parts = torch.ones(n, splits, heads, d_v)
    lse[0, 1], parts[0, 1] = math.nan, math.nan  # one NaN chunk among finite ones
    lse[1, :], parts[1, :] = math.nan, math.nan  # every chunk NaN
    lse[2, 0], parts[2, 0] = math.nan, math.nan  # a NaN chunk and two empty ones
    lse[2, 1:], parts[2, 1:] = math.inf, 0.0
    got, merged = merge_splits(parts.view(n * splits, heads, d_v).to(DEVICE), lse.view(n * splits, heads).to(DEVICE),
                               splits, None, torch.float32)
    want_lse = torch.full((n, heads), math.nan)
    want_lse[3] = math.log2(splits)
    want = torch.full((n, heads, d_v), math.nan)
    want[3] = 1.0
    assert_close("out", got, want, testing.FP32_RELATIVE)
    assert_close("lse_log2", merged, want_lse, testing.FP32_RELATIVE)


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------

def test_decode_errors_name_the_argument(triton_process):
    case = decode_case(13, batch=2, s_q=1, h_q=64, topk=4, extra_topk=3, dtype=torch.float32, device=DEVICE)
    q, cache, extra = case.q, case.main.cache, case.extra.cache
    fp8 = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 2, 16, DEVICE)
    good = dict(q=q, cache=cache, indices=case.indices, sm_scale=case.sm_scale, **case.kwargs())
    cases = [
        (TypeError, "^q: expected a torch.Tensor", dict(q=q.tolist())),
        (TypeError, "^q: expected dtype", dict(q=q.half())),
        (ValueError, "^q: expected 4 dims", dict(q=q[0])),
        (ValueError, r"^q: expected shape \[B >= 1, s_q >= 1, h_q in \(8, 16, 32, 64, 128\), d_qk\], got "
                     r"\(2, 1, 12, 512\)", dict(q=q[:, :, :12], attn_sink=None)),
        (ValueError, r"^q: expected shape \[B >= 1, s_q >= 1, h_q in \(8, 16, 32, 64, 128\)",
         dict(q=torch.cat([q] * 4, 2), attn_sink=None)),
        (ValueError, r"^q: expected shape \[B >= 1", dict(q=q[:, :0])),
        (ValueError, "^q: expected d_qk 512 .cache holds MODEL1 rows", dict(q=q[..., :256].bfloat16(), cache=fp8,
                                                                          extra_cache=None, extra_indices=None,
                                                                          extra_topk_length=None)),
        (TypeError, "^cache: expected a torch.Tensor", dict(cache=None)),
        (TypeError, "^cache: expected dtype torch.float32 .q's; dense rows. or torch.uint8",
         dict(cache=cache.bfloat16())),
        (ValueError, r"^cache: expected dense rows \[n_slots >= 1, 1, 512\]", dict(cache=cache[:, :, :256])),
        (ValueError, "^cache: expected a paged fp8 cache", dict(cache=torch.zeros(2, 16, 1, 600, dtype=torch.uint8,
                                                                                 device=DEVICE))),
        (ValueError, "^cache: the last dim must be contiguous", dict(cache=torch.stack([cache, cache], -1)[..., 0])),
        (TypeError, "^indices: expected dtype", dict(indices=case.indices.long())),
        (ValueError, r"^indices: expected shape \[2, 1, topk>=1\]", dict(indices=case.indices[:1])),
        (ValueError, "^indices: expected shape", dict(indices=case.indices[:, :, :0])),
        (TypeError, "^topk_length: expected a torch.Tensor or None", dict(topk_length=[1, 1])),
        (TypeError, "^topk_length: expected dtype", dict(topk_length=case.topk_length.long())),
        (ValueError, r"^topk_length: expected shape \[2\] \(one per request\)", dict(topk_length=case.topk_length[:1])),
        (ValueError, "^extra_cache, extra_indices: pass both or neither", dict(extra_indices=None)),
        (ValueError, "^extra_cache, extra_indices: pass both or neither", dict(extra_cache=None)),
        (ValueError, "^extra_topk_length: given without extra_cache", dict(extra_cache=None, extra_indices=None)),
        (ValueError, "^extra_cache: expected dense rows", dict(extra_cache=extra[..., :256])),
        (ValueError, "^extra_cache: expected the same kind of cache as cache .dense rows., got fp8 MODEL1",
         dict(q=q.bfloat16(), cache=cache.bfloat16(), extra_cache=fp8)),
        (ValueError, "^extra_indices: expected shape", dict(extra_indices=case.extra_indices[:, :, :0])),
        (TypeError, "^extra_indices: expected dtype", dict(extra_indices=case.extra_indices.short())),
        (ValueError, "^extra_topk_length: expected shape", dict(extra_topk_length=case.extra_topk_length[:1])),
        (TypeError, "^attn_sink: expected a torch.Tensor", dict(attn_sink=[0.0] * 64)),
        (ValueError, r"^attn_sink: expected shape \[64\]", dict(attn_sink=case.attn_sink[:3])),
        (TypeError, "^attn_sink: expected dtype", dict(attn_sink=case.attn_sink.double())),
        (TypeError, "^sm_scale: expected a python float", dict(sm_scale="0.1")),
        (ValueError, "^sm_scale: expected a finite positive float", dict(sm_scale=-1.0)),
        (ValueError, "^sm_scale: expected a finite positive float", dict(sm_scale=math.nan)),
    ]
    for error, match, changes in cases:
        args = {**good, **changes}
        with pytest.raises(error, match=match):
            ops.sparse_mla_decode(args.pop("q"), args.pop("cache"), args.pop("indices"), args.pop("sm_scale"), **args)
    ops.sparse_mla_decode(good.pop("q"), good.pop("cache"), good.pop("indices"), good.pop("sm_scale"), **good)


def test_plan_errors_name_the_argument():
    cache = torch.zeros(10, 1, 512, dtype=torch.bfloat16, device=DEVICE)
    good = dict(batch=2, s_q=1, h_q=64, topk=4, q_dtype=torch.bfloat16)
    cases = [
        (ValueError, r"^batch: expected an int >= 1, got 0", dict(batch=0)),
        (ValueError, r"^s_q: expected an int >= 1, got True", dict(s_q=True)),
        (ValueError, r"^h_q: expected an int >= 1", dict(h_q=64.0)),
        (ValueError, r"^topk: expected an int >= 1", dict(topk=0)),
        (ValueError, r"^extra_topk: expected an int >= 0", dict(extra_topk=-1)),
        (ValueError, r"^extra_cache, extra_topk: pass both", dict(extra_topk=3)),
        (ValueError, r"^extra_cache, extra_topk: pass both", dict(extra_cache=cache)),
        (TypeError, r"^num_splits: expected an int or None, got bool", dict(num_splits=True)),
        (TypeError, r"^num_splits: expected an int or None, got float", dict(num_splits=2.0)),
        (ValueError, r"^num_splits: expected >= 1, got 0", dict(num_splits=0)),
        (ValueError, r"^backend: expected one of ref, triton, tilelang or None, got 'cuda'", dict(backend="cuda")),
        (ValueError, r"^h_q: expected h_q in \(8, 16, 32, 64, 128\) \(the triton backend's kernels\), got 12",
         dict(h_q=12, backend="triton")),
        (ValueError, r"^h_q: expected h_q in \(8, 16, 32, 64, 128\)", dict(h_q=256, backend="triton")),
        (ValueError, r"^h_q: expected h_q in \(64, 128\) on the tilelang backend \(backend='tilelang'\), got 16; "
                     r"the triton backend runs h_q in \(8, 16, 32, 64, 128\)", dict(h_q=16, backend="tilelang")),
        (ValueError, r"^extra_cache: expected the same kind of cache as cache \(dense rows\), got fp8 V32",
         dict(extra_cache=kv_cache.new_fp8_kv_cache(kv_cache.V32, 1, 16, DEVICE), extra_topk=2)),
        (ValueError, r"^cache: ", dict(cache=torch.zeros(2, 16, 1, 600, dtype=torch.uint8, device=DEVICE))),
        (TypeError, r"^cache: expected a torch.Tensor", dict(cache="cache")),
    ]
    for error, match, changes in cases:
        args = {**good, **changes}
        with pytest.raises(error, match=match):
            ops.plan_sparse_decode(args.pop("cache", cache), **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's numpy guard: CPU tensors only")
def test_interpreted_kernels_with_runtime_loops_name_the_numpy_they_need(monkeypatch):
    """numpy >= 2.4 breaks triton 3.6's interpreter on runtime loop bounds (a TypeError deep inside it):
    the launches with such loops say so first, naming the kernel and the installed numpy."""
    import numpy

    from engine.h20_ops.vendor.flashmla_sparse import flash_mla_sparse_fwd

    monkeypatch.setattr(numpy, "__version__", "2.5.2")
    with pytest.raises(RuntimeError, match=r"_merge_splits_kernel: .*numpy < 2\.4.*found numpy 2\.5\.2"):
        merge_splits(torch.zeros(4, 64, 512), torch.zeros(4, 64), 2, None, torch.float32)
    idx = torch.zeros(2, 1, 4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"build_decode_lists: .*found numpy 2\.5\.2"):
        build_decode_lists(idx, None, 8, None, None, 0, 8, positions=False, q_rows=torch.zeros(2, 64, 512), splits=2)
    q, kv = torch.zeros(2, 64, 576, dtype=torch.bfloat16), torch.zeros(8, 1, 576, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"flash_mla_sparse_fwd: .*found numpy 2\.5\.2"):
        flash_mla_sparse_fwd(q, kv, idx[:, 0], 0.1, kernel="portable")


# ---------------------------------------------------------------------------------------------
# GPU: the paged fp8 path (TileLang), the kernels at real sizes, CUDA graphs
# ---------------------------------------------------------------------------------------------

def _model_case(seed, batch, s_q, h_q, *, layout=kv_cache.MODEL1, block_sizes=(64, 64), topk=128, extra_topk=512,
                **kwargs):
    """A V4-like decode step: a window list of 128 entries and 512 compressed ones per query row."""
    return decode_case(seed, batch=batch, s_q=s_q, h_q=h_q, topk=topk, extra_topk=extra_topk, layout=layout,
                       block_sizes=block_sizes, device="cuda", **kwargs)


def _tilelang():
    pytest.importorskip("tilelang", reason="the TileLang kernels")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TileLang kernels are built for SM90")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("batch,s_q,h_q,layout,block_sizes,block_pad", [
    (3, 2, 64, kv_cache.MODEL1, (64, 64), 0),
    (40, 1, 128, kv_cache.MODEL1, (64, 2), 2),  # unequal page sizes, padded block strides
    (128, 1, 64, kv_cache.MODEL1, (64, 64), 0),
    (4, 2, 128, kv_cache.V32, (61, 69), 1),  # DeepSeek-V3.2's layout, odd page sizes
])
def test_paged_fp8_matches_oracle(batch, s_q, h_q, layout, block_sizes, block_pad, splits):
    """The paged fp8 path (one list launch, the TileLang kernel reading both fp8 caches, each with its own
    page size) at model sizes, with fillers, NaN codes in unselected slots, lengths, sinks and padded block
    strides."""
    _tilelang()
    case = _model_case(batch * 10 + s_q, batch, s_q, h_q, layout=layout, block_sizes=block_sizes,
                       block_pad=block_pad)
    plan = case.plan(num_splits=splits, backend="tilelang")
    assert plan.path == "paged_fp8" and plan.kernel == "tilelang_sm90_paged_fp8"
    check(case, plan, case.run(plan))


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("batch,s_q,lengths", [(3, 2, True), (40, 1, False)])
def test_paged_fp8_equals_the_gathered_path(monkeypatch, batch, s_q, lengths, splits):
    """The paged fp8 kernel shares the bf16 TileLang kernel's consumers and sees the same rows in the same
    order (main entries, then extra entries) with the same split, so its result must be bit-identical to
    the gathered path's (gather_dequant + tilelang_sm90)."""
    _tilelang()
    case = _model_case(batch, batch, s_q, 64, topk=100, extra_topk=190, lengths=lengths)
    paged = case.run(case.plan(num_splits=splits, backend="tilelang"))
    monkeypatch.setattr(dispatch, "PAGED_FP8_KERNELS", {})
    plan = case.plan(num_splits=splits, backend="tilelang")
    assert (plan.path, plan.kernel) == ("gathered", "tilelang_sm90")
    gathered = case.run(plan)
    assert torch.equal(paged.lse_log2, gathered.lse_log2) and torch.equal(paged.out, gathered.out)


@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [8, 16, 32])
@pytest.mark.parametrize("name,args", [
    ("dense two caches", dict(layout=None)),
    ("MODEL1 pages 256 / 64", dict(block_sizes=(256, 64))),
    ("V32 pages 61 / 69, padded", dict(layout=kv_cache.V32, block_sizes=(61, 69), block_pad=3)),
])
def test_tensor_parallel_head_counts_at_model_sizes_match_oracle(monkeypatch, h_q, name, args):
    """h_q 8, 16, 32 at V4 sizes on the GPU (bf16 tensor-core dots) with the auto-resolved backend, which runs
    them on triton (the TileLang kernels take 64 or 128 heads), split chosen and forced."""
    monkeypatch.delenv("DEEPINFER_SPARSE_MLA_BACKEND", raising=False)
    dispatch.reset_resolution_for_tests()
    for batch, s_q in ((4, 2), (64, 1)):
        case = _model_case(batch * 10 + h_q, batch, s_q, h_q, lengths=True, **args)
        for splits in (None, 3):
            plan = case.plan(num_splits=splits)
            assert plan.backend == "triton", plan
            check(case, plan, case.run(plan), name=f"{name} h_q {h_q} b {batch}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("name,args", [
    ("dense one cache", dict(layout=None, extra_topk=0, topk=640)),
    ("dense two caches", dict(layout=None)),
    ("MODEL1 pages 64 / 2", dict(block_sizes=(64, 2))),
    ("V32 pages 61 / 69, padded", dict(layout=kv_cache.V32, block_sizes=(61, 69), block_pad=3)),
])
def test_decode_at_model_sizes_matches_oracle(backend, name, args):
    """Each backend's paths at real sizes (bf16 over dense caches: Triton's Gluon kernel on SM90, TileLang's
    tilelang_sm90; over fp8 caches each backend's paged fp8 kernel), the automatic split included."""
    if backend == "tilelang":
        _tilelang()
    for batch, s_q, h_q in ((4, 2, 128), (64, 1, 64)):
        case = _model_case(len(name) + batch, batch, s_q, h_q, **args)
        for splits in (1, None):
            plan = case.plan(num_splits=splits, backend=backend)
            fp8 = args.get("layout", kv_cache.MODEL1) is not None
            assert plan.path == ("direct" if name == "dense one cache" else "paged_fp8" if fp8 else "gathered")
            if backend == "triton" and not fp8 and torch.cuda.get_device_capability() == (9, 0):
                assert plan.kernel == "triton_gluon_sm90"
            check(case, plan, case.run(plan), name=f"{name} B={batch} splits={plan.splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,layout", [("triton", None), ("triton", kv_cache.MODEL1), ("tilelang", None),
                                            ("tilelang", kv_cache.MODEL1)])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_replays_in_a_cuda_graph(backend, layout, splits):
    """A serving loop captures the decode step once and replays it with new inputs copied into the same
    tensors: the call must be capturable (no host sync, launches on the capturing stream) and a replay
    must give exactly what an eager call on the new inputs gives (paged fp8 path included)."""
    if backend == "tilelang":
        _tilelang()
    case = _model_case(40 + splits, 4, 2, 64, layout=layout)
    new = _model_case(50 + splits, 4, 2, 64, layout=layout)
    plan = case.plan(num_splits=splits, backend=backend)
    case.run(plan)  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = case.run(plan)
    for name in ("q", "indices", "topk_length", "extra_indices", "extra_topk_length", "attn_sink"):
        getattr(case, name).copy_(getattr(new, name))
    case.main.cache.copy_(new.main.cache)
    case.extra.cache.copy_(new.extra.cache)
    res.out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = new.run(plan)
    assert torch.equal(res.out, eager.out) and torch.equal(res.lse_log2, eager.lse_log2)


@pytest.mark.gpu
@pytest.mark.parametrize("misaligned", ["cache", "extra_cache"])
def test_caches_the_tilelang_paged_kernel_cannot_read_take_the_gathered_path(misaligned):
    """The TileLang paged kernel reads rows by 16-byte cp.async; the fp8 layouts need 4-byte alignment only.
    A cache 4 bytes off a 16-byte boundary is read by the gathered path, with the reason among the
    dispatcher's choices, and the result is the oracle's."""
    _tilelang()
    dispatch.reset_resolution_for_tests()
    case = _model_case(7, 4, 2, 64)
    part = case.main if misaligned == "cache" else case.extra
    raw = torch.zeros(part.cache.untyped_storage().nbytes() + 16, dtype=torch.uint8, device="cuda")
    moved = raw.as_strided(part.cache.shape, part.cache.stride(), 4)  # a valid layout 4 bytes in
    moved.copy_(part.cache)
    part.cache = moved
    plan = case.plan(backend="tilelang")
    assert (plan.path, plan.kernel) == ("gathered", "tilelang_sm90")
    assert any("needs 16-byte aligned cache bases" in c["reason"] for c in ops.kernel_choices())
    check(case, plan, case.run(plan))
