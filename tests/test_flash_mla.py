"""engine.h20_ops.flash_mla against the float32 oracle, with FlashMLA's published test semantics.

FlashMLA's tests/test_flash_mla_sparse_*.py build their cases as engine.h20_ops.testing's
flashmla_decode_case / prefill_case do (paged fp8 caches of every page size they test, per-request
lengths, -1 fillers, NaN bytes in every slot no valid entry selects, all-invalid rows, zero-length
requests, sinks with +-inf, non-contiguous q) and hold results to FlashMLA's tolerances
(testing.DECODE_OUT / DECODE_LSE, PREFILL_OUT / PREFILL_STATS; inf and NaN positions exact).
CPU (CI): a small subset under Triton's interpreter, plus the module's own contract (metadata reuse,
out= in place, lse layout, errors). GPU (`gpu`): the grid, on the triton and tilelang backends, and
CUDA-graph capture.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from engine.h20_ops import flash_mla, kv_cache
from engine.h20_ops import testing as T
from engine.h20_ops.attention import dispatch, triton_paged_fp8
from engine.h20_ops.vendor import flashmla_sparse

MODEL1, V32 = kv_cache.MODEL1, kv_cache.V32
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def use_backend(monkeypatch, backend: str | None) -> None:
    if backend is None:
        monkeypatch.delenv("DEEPINFER_SPARSE_MLA_BACKEND", raising=False)
    else:
        if backend == "tilelang":
            pytest.importorskip("tilelang")
        monkeypatch.setenv("DEEPINFER_SPARSE_MLA_BACKEND", backend)
    dispatch.reset_resolution_for_tests()


def run_decode(case: T.DecodeCase, meta=None, **changes):
    meta = meta if meta is not None else flash_mla.get_mla_metadata()[0]
    kwargs = {**T.flashmla_decode_kwargs(case), **changes}
    return flash_mla.flash_mla_with_kvcache(kwargs.pop("q", case.q), kwargs.pop("k_cache", case.main.cache), None,
                                            None, kwargs.pop("head_dim_v", 512), meta, **kwargs)


def check_decode(case: T.DecodeCase, out: torch.Tensor, lse: torch.Tensor, *, split: bool = False) -> None:
    ref = case.oracle()
    T.assert_close("out", out.float(), ref.out, T.out_tolerance(T.DECODE_OUT, out, split=split))
    T.assert_close("lse", lse, ref.lse.transpose(1, 2), T.DECODE_LSE)


def run_prefill(case: T.PrefillCase, **changes):
    kwargs = dict(attn_sink=case.attn_sink, topk_length=case.topk_length, **changes)
    return flash_mla.flash_mla_sparse_fwd(case.q, case.kv, case.indices, case.sm_scale, **kwargs)


def check_prefill(case: T.PrefillCase, out, max_logits, lse) -> None:
    ref = case.oracle()
    T.assert_close("out", out.float(), ref.out, T.out_tolerance(T.PREFILL_OUT, out))
    T.assert_close("max_logits", max_logits, ref.max_logits, T.PREFILL_STATS)
    T.assert_close("lse", lse, ref.lse, T.PREFILL_STATS)


# ---------------------------------------------------------------------------------------------
# CPU subset (Triton's interpreter): FlashMLA's features, small shapes
# ---------------------------------------------------------------------------------------------

CPU_DECODE_CASES = {
    # FlashMLA's V4 shape: SWA over big pages + an extra cache over other pages, both lengths
    "model1_extra_pages61_53_lengths": dict(batch=3, s_q=3, h_q=64, layout=MODEL1, topk=64, s_kv=100, block_size=61,
                                            extra=(64, 90, 53), topk_length=True, extra_topk_length=True),
    "model1_extra_split": dict(batch=1, s_q=2, h_q=64, layout=MODEL1, topk=64, s_kv=70, block_size=64,
                               extra=(136, 150, 2), extra_topk_length=True),
    "v32_page2_zero_seqlen_fillers": dict(batch=4, s_q=1, h_q=64, layout=V32, topk=64, s_kv=40, block_size=2,
                                          zero_seqlen=True, fillers=True),
    "v32_h128_page69_topk40": dict(batch=2, s_q=2, h_q=128, layout=V32, topk=40, s_kv=30, block_size=69,
                                   topk_length=True, varlen=False),
    "model1_all_invalid": dict(batch=2, s_q=3, h_q=64, layout=MODEL1, topk=64, s_kv=50, block_size=5,
                               extra=(24, 30, 7), all_invalid=True),
    "model1_no_sink_page576": dict(batch=2, s_q=1, h_q=64, layout=MODEL1, topk=48, s_kv=60, block_size=576,
                                   sink=False),
    # a tensor-parallel rank's heads
    "model1_h16_extra_lengths": dict(batch=2, s_q=2, h_q=16, layout=MODEL1, topk=64, s_kv=80, block_size=61,
                                     extra=(64, 90, 53), topk_length=True, extra_topk_length=True),
    "v32_h8_page2_fillers": dict(batch=3, s_q=1, h_q=8, layout=V32, topk=64, s_kv=40, block_size=2,
                                 zero_seqlen=True, fillers=True),
    "model1_h32_all_invalid": dict(batch=2, s_q=2, h_q=32, layout=MODEL1, topk=64, s_kv=50, block_size=5,
                                   extra=(24, 30, 7), all_invalid=True),
}


@pytest.mark.parametrize("name", list(CPU_DECODE_CASES))
def test_decode_matches_oracle(name):
    params = CPU_DECODE_CASES[name]
    case = T.flashmla_decode_case(7, device=DEVICE, **params)
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = run_decode(case, meta)
    check_decode(case, out, lse, split=meta.plan.splits > 1)
    if name == "model1_extra_split":  # the flash-decoding split and its merge through the module
        assert meta.plan.splits > 1


CPU_PREFILL_CASES = {
    "oob_topk_sink_lengths": dict(s_q=4, s_kv=95, h_q=64, topk=128, topk_length=True, sink=True),
    "d576_h128_all_invalid": dict(s_q=3, s_kv=300, h_q=128, topk=64, d_qk=576, all_invalid=True, sink=True),
    "one_row_topk_not_a_multiple": dict(s_q=1, s_kv=200, h_q=64, topk=72),
    # a tensor-parallel rank's heads
    "h8_d576_oob_topk_sink_lengths": dict(s_q=4, s_kv=50, h_q=8, topk=64, d_qk=576, topk_length=True, sink=True),
    "h16_all_invalid": dict(s_q=3, s_kv=90, h_q=16, topk=40, all_invalid=True, sink=True),
    "h32_lengths": dict(s_q=4, s_kv=70, h_q=32, topk=48, topk_length=True),
}


@pytest.mark.parametrize("name", list(CPU_PREFILL_CASES))
def test_prefill_matches_oracle(name):
    case = T.prefill_case(11, device=DEVICE, **CPU_PREFILL_CASES[name])
    check_prefill(case, *run_prefill(case))


def test_prefill_takes_2d_indices():
    case = T.prefill_case(12, s_q=2, s_kv=64, h_q=64, topk=64, device=DEVICE)
    out, max_logits, lse = flash_mla.flash_mla_sparse_fwd(case.q, case.kv, case.indices[:, 0], case.sm_scale)
    check_prefill(case, out, max_logits, lse)


# ---------------------------------------------------------------------------------------------
# the module's contract
# ---------------------------------------------------------------------------------------------

def small_case(seed=3, **changes) -> T.DecodeCase:
    params = dict(batch=2, s_q=2, h_q=64, layout=MODEL1, topk=32, s_kv=40, block_size=7, extra=(24, 30, 5),
                  topk_length=True, extra_topk_length=True)
    return T.flashmla_decode_case(seed, device=DEVICE, **{**params, **changes})


def test_metadata_plan_made_once_and_reused(monkeypatch):
    plans = []
    real = flash_mla.plan_sparse_decode
    monkeypatch.setattr(flash_mla, "plan_sparse_decode", lambda *a, **k: plans.append(real(*a, **k)) or plans[-1])
    case = small_case()
    meta, none = flash_mla.get_mla_metadata(case.topk_length, 1, 1)  # the old interface's arguments: ignored
    assert none is None and not meta.have_initialized
    first = run_decode(case, meta)
    assert meta.have_initialized and len(plans) == 1 and meta.plan is plans[0]
    # a later layer (or step) with the same shapes and other values: the same plan, not a new one
    other = small_case(seed=4)
    again = run_decode(other, meta)
    assert len(plans) == 1 and meta.plan is plans[0]
    check_decode(case, *first)
    check_decode(other, *again)


def test_metadata_refuses_other_shapes():
    case = small_case()
    meta, _ = flash_mla.get_mla_metadata()
    run_decode(case, meta)
    wider = small_case(topk=40)
    with pytest.raises(ValueError, match=r"^tile_scheduler_metadata: .*topk 32 -> 40"):
        run_decode(wider, meta)
    other_pages = small_case(block_size=9)
    with pytest.raises(ValueError, match=r"^tile_scheduler_metadata: .*page_block_size 7 -> 9"):
        run_decode(other_pages, meta)


def test_lse_is_natural_and_laid_out_as_flashmla_returns_it():
    case = small_case(sink=False)
    out, lse = run_decode(case)
    b, s_q, h_q = case.q.shape[:3]
    assert lse.shape == (b, h_q, s_q) and lse.stride() == (s_q * h_q, 1, h_q) and lse.dtype == torch.float32
    assert out.shape == (b, s_q, h_q, 512) and out.dtype == torch.bfloat16
    check_decode(case, out, lse)


@pytest.mark.parametrize("split", [False, True])
def test_decode_out_is_written_in_place(monkeypatch, split):
    """out= is the buffer the last launch writes: the merge's output with a split, the kernel's without;
    no copy (the Triton paged fp8 kernel gets the caller's buffer as its output)."""
    case = small_case(topk=64, extra=(136, 150, 5)) if split else small_case()
    kernel_outs = []
    real = triton_paged_fp8.paged_fp8_decode  # the Triton backend's decode kernel for fp8 caches

    def recording(*args, out=None, **kwargs):
        kernel_outs.append(out)
        return real(*args, out=out, **kwargs)

    monkeypatch.setattr(triton_paged_fp8, "paged_fp8_decode", recording)
    expected, _ = run_decode(case)
    buf = torch.full_like(expected, float("nan"))
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = run_decode(case, meta, out=buf)
    assert (meta.plan.splits > 1) == split
    assert out.data_ptr() == buf.data_ptr() and torch.equal(buf, expected)
    if split:
        assert kernel_outs[-1] is None  # partials go to the merge, which writes buf
    else:
        assert kernel_outs[-1].data_ptr() == buf.data_ptr()
    check_decode(case, out, lse, split=split)


def test_prefill_out_is_written_in_place(monkeypatch):
    case = T.prefill_case(13, s_q=3, s_kv=80, h_q=64, topk=64, sink=True, device=DEVICE)
    expected = run_prefill(case)
    buf = torch.full_like(expected[0], float("nan"))
    kernel_outs = []
    real = flashmla_sparse.flash_mla_sparse_fwd
    monkeypatch.setattr(flashmla_sparse, "flash_mla_sparse_fwd",
                        lambda *a, out=None, **k: kernel_outs.append(out) or real(*a, out=out, **k))
    out, max_logits, lse = run_prefill(case, out=buf)
    assert out is buf and kernel_outs == [buf]
    for got, want in zip((out, max_logits, lse), expected):
        assert torch.equal(got, want)


def test_prefill_runs_the_tilelang_kernel_itself_under_the_tilelang_backend(monkeypatch):
    """max_logits, natural lse and out come from the TileLang kernel's with_max_logits variant, which
    gets the caller's buffer: what it returns is returned (no conversion, copy or second launch)."""
    pytest.importorskip("tilelang")
    from engine.h20_ops.attention import tilelang_sm90

    use_backend(monkeypatch, "tilelang")
    case = T.prefill_case(14, s_q=2, s_kv=64, h_q=64, topk=64, sink=True, topk_length=True, device=DEVICE)
    buf = torch.empty(2, 64, 512, dtype=case.q.dtype, device=case.q.device)
    calls = []

    def kernel(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out=None):
        calls.append((q, kv, attn_sink, topk_length, out))
        return out, torch.full((2, 64), -1.0), torch.full((2, 64), 2.0)

    monkeypatch.setattr(tilelang_sm90, "sparse_mla_fwd_sm90_with_max_logits", kernel)
    out, max_logits, lse = run_prefill(case, out=buf)
    assert len(calls) == 1 and calls[0][0] is case.q and calls[0][2] is case.attn_sink and calls[0][4] is buf
    assert out is buf and torch.all(max_logits == -1.0) and torch.all(lse == 2.0)
    assert dispatch.kernel_choices()[-1]["kernel"] == "tilelang_sm90"
    with pytest.raises(TypeError, match="^q: .*tilelang backend's kernels are bf16 only"):
        flash_mla.flash_mla_sparse_fwd(case.q.float(), case.kv.float(), case.indices, case.sm_scale)


def test_int8_cache_bytes_are_accepted():
    case = small_case()
    expected = run_decode(case)
    got = run_decode(case, k_cache=case.main.cache.view(torch.int8),
                     extra_k_cache=case.extra.cache.view(torch.int8))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_block_table_and_cache_seqlens_are_not_read():
    case = small_case()
    expected = run_decode(case)
    got = flash_mla.flash_mla_with_kvcache(case.q, case.main.cache, torch.zeros(2, 3, dtype=torch.int32),
                                           torch.zeros(2, dtype=torch.int32), 512, flash_mla.get_mla_metadata()[0],
                                           **T.flashmla_decode_kwargs(case))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_cache_with_any_block_stride_the_layout_allows():
    """Blocks 4 bytes apart beyond their data (the layout's alignment), not a multiple of 16."""
    case = small_case(extra=None, extra_topk_length=False)
    cache = case.main.cache
    stride = cache.stride(0) + 4
    buf = torch.zeros(cache.size(0) * stride, dtype=torch.uint8, device=cache.device)
    strided = torch.as_strided(buf, cache.shape, (stride, *cache.stride()[1:]))
    strided.copy_(cache)
    expected = run_decode(case)
    got = run_decode(case, k_cache=strided)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def _bad_calls(case: T.DecodeCase):
    """(changes to a valid call, exception type, argument named at the start of the message)."""
    q, cache, extra = case.q, case.main.cache, case.extra.cache
    backing = torch.zeros(cache.size(0) * cache.stride(0) + 16, dtype=torch.uint8, device=cache.device)
    misaligned = torch.as_strided(backing[2:], cache.shape, cache.stride())
    return [
        (dict(indices=None), NotImplementedError, "indices"),
        (dict(causal=True), ValueError, "causal"),
        (dict(is_fp8_kvcache=False), ValueError, "is_fp8_kvcache"),
        (dict(num_splits=torch.zeros(3, dtype=torch.int32)), ValueError, "num_splits"),
        (dict(head_dim_v=576), ValueError, "head_dim_v"),
        (dict(k_cache=torch.zeros(4, 7, 1, 512, dtype=torch.bfloat16)), TypeError, "k_cache"),
        (dict(k_cache=torch.zeros(4, 7, 1, 585, dtype=torch.uint8)), ValueError, "k_cache"),
        (dict(k_cache=cache[:, :, :, :]), None, None),  # a no-op view stays valid
        (dict(k_cache=misaligned), ValueError, "k_cache"),
        (dict(extra_k_cache=extra[:, :3].transpose(0, 1)), ValueError, "extra_k_cache"),
        (dict(extra_k_cache=None), ValueError, "extra_indices_in_kvcache"),
        (dict(extra_k_cache=None, extra_indices_in_kvcache=None), ValueError, "extra_topk_length"),
        (dict(extra_indices_in_kvcache=case.extra_indices.long()), TypeError, "extra_indices_in_kvcache"),
        (dict(extra_indices_in_kvcache=case.extra_indices[:1]), ValueError, "extra_indices_in_kvcache"),
        (dict(indices=case.indices[..., 0]), ValueError, "indices"),
        (dict(topk_length=case.topk_length[:1]), ValueError, "topk_length"),
        (dict(attn_sink=case.attn_sink.double()), TypeError, "attn_sink"),
        (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
        (dict(q=q[:, :, :12]), ValueError, "q"),
        (dict(q=q.half()), TypeError, "q"),
        (dict(out=torch.empty(2, 2, 64, 512, dtype=torch.float32, device=q.device)), TypeError, "out"),
        (dict(out=torch.empty(2, 2, 64, 256, dtype=q.dtype, device=q.device)), ValueError, "out"),
        (dict(out=torch.empty(2, 64, 2, 512, dtype=q.dtype, device=q.device).transpose(1, 2)), ValueError, "out"),
    ]


def test_bad_decode_inputs_name_the_argument():
    case = small_case()
    for changes, exc, name in _bad_calls(case):
        if exc is None:
            run_decode(case, **changes)
            continue
        with pytest.raises(exc, match=f"^{name}:"):
            run_decode(case, **changes)


def test_bad_metadata_and_mixed_layouts_name_the_argument():
    case = small_case()
    with pytest.raises(TypeError, match="^tile_scheduler_metadata:"):
        flash_mla.flash_mla_with_kvcache(case.q, case.main.cache, None, None, 512, object(),
                                         **T.flashmla_decode_kwargs(case))
    v32 = T.flashmla_decode_case(5, batch=2, s_q=2, h_q=64, layout=V32, topk=24, s_kv=30, block_size=5,
                                 device=DEVICE)
    with pytest.raises(ValueError, match="^extra_k_cache:"):
        run_decode(case, extra_k_cache=v32.main.cache)


def test_bad_prefill_inputs_name_the_argument():
    case = T.prefill_case(15, s_q=2, s_kv=64, h_q=64, topk=64, device=DEVICE)
    bad = [
        (dict(out=torch.empty(2, 64, 256, dtype=case.q.dtype, device=case.q.device)), ValueError, "out"),
        (dict(out=torch.empty(2, 64, 512, dtype=torch.float16, device=case.q.device)), TypeError, "out"),
        (dict(out=torch.empty(2 * 64 * 512 + 8, dtype=case.q.dtype, device=case.q.device)[1:2 * 64 * 512 + 1]
              .view(2, 64, 512)), ValueError, "out"),  # 16-byte alignment (the TileLang kernel's TMA store)
        (dict(indices=case.indices.long()), TypeError, "indices"),
        (dict(q=case.q[:, :12]), ValueError, "q"),
        (dict(d_v=576), ValueError, "d_v"),
        (dict(topk_length=torch.zeros(3, dtype=torch.int32, device=case.q.device)), ValueError, "topk_length"),
    ]
    for changes, exc, name in bad:
        args = {**dict(q=case.q, kv=case.kv, indices=case.indices, sm_scale=case.sm_scale), **changes}
        with pytest.raises(exc, match=f"^{name}:"):
            flash_mla.flash_mla_sparse_fwd(**args)


def test_readme_example_runs():
    """README's "Using this from SGLang or vLLM on Hopper" example, as written there."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Using this from SGLang or vLLM on Hopper", 1)[1].split("\n## ", 1)[0]
    example = section.split("A decode step and a prefill call", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(example, "README.md", "exec"), {})


def test_public_names():
    assert set(flash_mla.__all__) == {"FlashMLASchedMeta", "flash_mla_sparse_fwd", "flash_mla_with_kvcache",
                                      "get_mla_metadata"}


# ---------------------------------------------------------------------------------------------
# GPU: FlashMLA's grid on every backend, CUDA graphs
# ---------------------------------------------------------------------------------------------

# (s_kv, topk, page_block_size) of FlashMLA's decode grid, and of its corner cases
GRID_SCOPES = [(512, 64, 2), (512, 64, 64), (512, 64, 69), (1024, 576, 2), (1024, 576, 61), (2046, 2048, 2),
               (2046, 2048, 64), (2046, 2048, 576)]
CORNER_SCOPES = [(512, 64, 61), (650, 576, 53)]
# FlashMLA's V4 configurations (SWA topk 128 over 256-token pages + extra topk 512 / 1024 over 64-token
# pages), with 2048 tokens per request instead of 16384 (the oracle's memory; the lists are the same)
V4_SCOPES = [((2048, 128, 256), (2048, 512, 64)), ((2048, 128, 256), (2048, 1024, 64))]


def _gpu_decode_grid() -> dict[str, dict]:
    """Every value of each dimension of FlashMLA's decode grid, combined by cycling (not the product)."""
    grid = {}
    cycle = itertools.count()
    for layout, extras in ((V32, (False,)), (MODEL1, (False, True))):
        for with_extra in extras:
            for h_q in (64, 128):
                for j, (s_kv, topk, page) in enumerate(GRID_SCOPES):
                    i = next(cycle)
                    extra = GRID_SCOPES[(j + 1 + i) % len(GRID_SCOPES)] if with_extra else None
                    b, s_q = (4, 74, 321)[i % 3], (1, 2, 3)[(i // 3) % 3]
                    if b == 321 and topk == 2048 and extra is not None and extra[1] == 2048:
                        b = 74  # bounds the oracle's memory (963 rows x 4096 entries)
                    params = dict(batch=b, s_q=s_q, h_q=h_q, layout=layout, topk=topk, s_kv=s_kv, block_size=page,
                                  topk_length=i % 2 == 0, varlen=i % 5 != 0)
                    if extra is not None:
                        params.update(extra=(extra[1], extra[0], extra[2]), extra_topk_length=i % 4 < 2)
                    grid[f"{layout.name}-h{h_q}-b{b}-sq{s_q}-{topk}p{page}" +
                         (f"+{extra[1]}p{extra[2]}" if extra else "")] = params
    for layout in (V32, MODEL1):
        for h_q in (64, 128):
            for (s_kv, topk, page), all_invalid, zero_seqlen, sink in itertools.product(
                    CORNER_SCOPES, (True, False), (True, False), (True, False)):
                if not (all_invalid or zero_seqlen or sink):
                    continue
                i = next(cycle)
                b = (4, 74, 321)[i % 3]
                extra = CORNER_SCOPES[i % 2] if layout is MODEL1 else None
                params = dict(batch=b, s_q=3, h_q=h_q, layout=layout, topk=topk, s_kv=s_kv, block_size=page,
                              all_invalid=all_invalid, zero_seqlen=zero_seqlen, sink=sink, fillers=i % 2 == 0,
                              topk_length=i % 3 == 0)
                if extra is not None:
                    params.update(extra=(extra[1], extra[0], extra[2]), extra_topk_length=i % 3 == 1)
                grid[f"corner-{layout.name}-h{h_q}-b{b}-{topk}p{page}-inv{int(all_invalid)}-zero{int(zero_seqlen)}"
                     f"-sink{int(sink)}"] = params
    for h_q, ((s_kv, topk, page), (es_kv, etopk, epage)) in zip((64, 128), V4_SCOPES):
        for b in (2, 64, 74, 128, 148, 256):
            grid[f"v4-h{h_q}-b{b}"] = dict(batch=b, s_q=2, h_q=h_q, layout=MODEL1, topk=topk, s_kv=s_kv,
                                           block_size=page, extra=(etopk, es_kv, epage), varlen=False)
    # vLLM: every decode token its own request (s_q 1, b in the thousands); MTP: s_q 4
    grid["vllm-h64-b2048-sq1"] = dict(batch=2048, s_q=1, h_q=64, layout=MODEL1, topk=128, s_kv=256, block_size=256,
                                      extra=(512, 2048, 64), topk_length=True, extra_topk_length=True)
    grid["mtp-h128-b64-sq4"] = dict(batch=64, s_q=4, h_q=128, layout=MODEL1, topk=128, s_kv=1024, block_size=256,
                                    extra=(1024, 2048, 64), topk_length=True)
    grid["v32-b128"] = dict(batch=128, s_q=2, h_q=128, layout=V32, topk=2048, s_kv=4096, block_size=64, varlen=False)
    return grid


GPU_DECODE_GRID = _gpu_decode_grid()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("name", list(GPU_DECODE_GRID))
def test_gpu_decode_grid(monkeypatch, backend, name):
    use_backend(monkeypatch, backend)
    case = T.flashmla_decode_case(zlib.crc32(name.encode()), device="cuda", **GPU_DECODE_GRID[name])
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = run_decode(case, meta)
    check_decode(case, out, lse, split=meta.plan.splits > 1)


def _gpu_prefill_grid() -> dict[str, dict]:
    grid = {}
    cycle = itertools.count()
    for d_qk, h_q in itertools.product((512, 576), (64, 128)):
        for s_kv, topk in ((128, 128), (592, 128), (1840, 256), (1592, 384), (1521, 512), (95, 128), (153, 256),
                           (114, 384), (4096, 2048)):
            i = next(cycle)
            s_q = (1, 62, 213)[i % 3]
            grid[f"d{d_qk}-h{h_q}-sq{s_q}-skv{s_kv}-k{topk}"] = dict(
                s_q=s_q, s_kv=s_kv, h_q=h_q, topk=topk, d_qk=d_qk, sink=i % 2 == 0, topk_length=i % 4 < 2)
        for s_q, s_kv, topk in ((1, 128, 128), (1234, 4321, 4096), (300, 32, 2048)):
            grid[f"corner-d{d_qk}-h{h_q}-sq{s_q}-skv{s_kv}-k{topk}"] = dict(
                s_q=s_q, s_kv=s_kv, h_q=h_q, topk=topk, d_qk=d_qk, sink=True, topk_length=True, all_invalid=True)
    return grid


GPU_PREFILL_GRID = _gpu_prefill_grid()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("name", list(GPU_PREFILL_GRID))
def test_gpu_prefill_grid(monkeypatch, backend, name):
    use_backend(monkeypatch, backend)
    case = T.prefill_case(zlib.crc32(name.encode()), device="cuda", **GPU_PREFILL_GRID[name])
    check_prefill(case, *run_prefill(case))
    kernel = dispatch.kernel_choices()[-1]["kernel"]
    assert (kernel == "tilelang_sm90") if backend == "tilelang" else kernel.startswith("triton_"), kernel


@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [8, 16, 32])
def test_gpu_tensor_parallel_head_counts(monkeypatch, h_q):
    """A tensor-parallel rank's heads through the drop-in with the auto-resolved backend (triton for these
    h_q): FlashMLA's V4 decode configurations and prefill at V4 / V3.2 widths."""
    use_backend(monkeypatch, None)
    for i, ((s_kv, topk, page), (es_kv, etopk, epage)) in enumerate(V4_SCOPES):
        for b in (2, 74, 256):
            case = T.flashmla_decode_case(100 * h_q + 10 * i + b, batch=b, s_q=2, h_q=h_q, layout=MODEL1, topk=topk,
                                          s_kv=s_kv, block_size=page, extra=(etopk, es_kv, epage), topk_length=True,
                                          extra_topk_length=True, device="cuda")
            meta, _ = flash_mla.get_mla_metadata()
            out, lse = run_decode(case, meta)
            check_decode(case, out, lse, split=meta.plan.splits > 1)
            assert meta.plan.backend == "triton", meta.plan
    for d_qk, topk in ((512, 512), (576, 2048)):
        case = T.prefill_case(h_q + topk, s_q=213, s_kv=4096, h_q=h_q, topk=topk, d_qk=d_qk, sink=True,
                              topk_length=True, all_invalid=True, device="cuda")
        check_prefill(case, *run_prefill(case))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_gpu_prefill_out_is_written_in_place(monkeypatch, backend):
    """The kernel writes the caller's buffer (poisoned with NaN): the same results as without out=."""
    use_backend(monkeypatch, backend)
    case = T.prefill_case(16, s_q=70, s_kv=700, h_q=128, topk=320, d_qk=576, sink=True, topk_length=True,
                          device="cuda")
    expected = run_prefill(case)
    buf = torch.full_like(expected[0], float("nan"))
    got = run_prefill(case, out=buf)
    assert got[0] is buf
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    check_prefill(case, *got)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("plan_in_capture", [False, True])
def test_gpu_decode_replays_in_a_cuda_graph(monkeypatch, backend, plan_in_capture):
    """A serving loop captures a step once and replays it with new inputs in the same buffers. The
    metadata's plan may even be made during the capture (host work only), as an engine whose metadata
    object is new each step makes it."""
    use_backend(monkeypatch, backend)
    params = dict(batch=4, s_q=2, h_q=64, layout=MODEL1, topk=128, s_kv=512, block_size=256,
                  extra=(512, 1024, 64), topk_length=True, extra_topk_length=True, varlen=False)
    case = T.flashmla_decode_case(21, device="cuda", **params)
    new = T.flashmla_decode_case(22, device="cuda", **params)
    run_decode(case)  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    meta, _ = flash_mla.get_mla_metadata()
    if not plan_in_capture:
        run_decode(case, meta)
    out = torch.empty(4, 2, 64, 512, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = run_decode(case, meta, out=out)
    for mine, theirs in ((case.q, new.q), (case.main.cache, new.main.cache), (case.extra.cache, new.extra.cache),
                         (case.indices, new.indices), (case.extra_indices, new.extra_indices),
                         (case.topk_length, new.topk_length), (case.extra_topk_length, new.extra_topk_length),
                         (case.attn_sink, new.attn_sink)):
        mine.copy_(theirs)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager_out, eager_lse = run_decode(new)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)



@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("pages", [(64, 64), (256, 64)])
def test_gpu_any_block_stride_the_layout_allows(monkeypatch, backend, pages):
    """Caches whose blocks are 4 bytes apart beyond their data (the layout's alignment, not 16), one page
    size for both caches (the paged fp8 kernel's case) and two: the same results as the dense layout."""
    use_backend(monkeypatch, backend)
    case = T.flashmla_decode_case(31, batch=8, s_q=2, h_q=64, layout=MODEL1, topk=128, s_kv=512, block_size=pages[0],
                                  extra=(256, 512, pages[1]), varlen=False, device="cuda")

    def padded(cache):
        stride = cache.stride(0) + 4
        buf = torch.zeros(cache.size(0) * stride, dtype=torch.uint8, device=cache.device)
        view = torch.as_strided(buf, cache.shape, (stride, *cache.stride()[1:]))
        view.copy_(cache)
        return view

    expected = run_decode(case)
    out, lse = run_decode(case, k_cache=padded(case.main.cache), extra_k_cache=padded(case.extra.cache))
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
