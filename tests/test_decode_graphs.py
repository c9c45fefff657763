"""The decode step in static shapes, and its CUDA graphs.

CPU: the batched decode formulation of the compressors equals the prefill one in float32
(engine.model.compressor: the same entries up to fp32 rounding, the same state rows bit for bit, over
requests whose windows close at different steps, with a padding row); the decode indexer keeps the same entries as prefill's top-k
where more entries than index_topk are visible (inputs without ties), and breaks exact ties by entry
id whatever the row's padded width; the step's metadata computed on the device equals each request's
slots read from its page tables row by row; padding the batch and the entry tables further changes no token
and no logit beyond fp32 summation order; the shapes a key fixes (padded batch, entry widths) and the
runner's use of graphs (plain steps through runtime.graphs with one buffer per key, NextN steps eager,
stats) with a CPU stand-in that replays a key's step eagerly on its kept buffer.
GPU (marked `gpu`): CUDA graph replay against eager decoding, bf16 with the fp8 cache and float32 with
dense stores, across steps where windows close, pages are released, requests finish and batches
shrink.
"""

import pytest
import torch

from engine.h20_ops.attention import dispatch
from engine.h20_ops.testing import FP32_RELATIVE, assert_close
from engine.kv_store import CompressorStates
from engine.model import compressor, decode_metadata, tiny
from engine.model.decode_metadata import DecodeKey, entry_width, padded_batch
from engine.runner import Engine, Request

LOGITS_ATOL_FP32 = 2e-3  # as tests/test_model_engine.py: fp32 summation order


def _random_prompt(n, seed):
    return torch.randint(2, 258, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


# ------------------------------------------------------------------------------------------
# compressors and indexer: decode formulation == prefill formulation

def _cos_sin(positions):
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 4, 2, dtype=torch.float32) / 4))
    freqs = positions[:, None].float() * inv_freq
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("ratio, overlap", [(4, True), (8, False)])
def test_compressor_decode_steps_equal_prefill(engine_env, ratio, overlap):
    """Requests prefilled with 1, 6 and 13 tokens then decoded 19 tokens each in one batch (plus a padding
    row on the scratch row): every entry equals a prefill of the whole sequence up to float32 rounding (the
    two reduce windows of other batch shapes, and torch's CPU reductions may order the sums differently by
    shape: 1 ulp seen on the CI machine, 2026-12-02), the final state rows bit for bit."""
    engine_env(DEEPINFER_KERNELS="ref")
    head_dim, total_steps = 8, 19
    width = 2 * head_dim if overlap else head_dim
    g = torch.Generator().manual_seed(3)
    prompts = [1, 6, 13]
    lengths = [n + total_steps for n in prompts]
    kv = [torch.randn(n, width, generator=g) for n in lengths]
    gate = [torch.randn(n, width, generator=g) for n in lengths]
    bias = torch.randn(ratio, width, generator=g)
    norm = torch.randn(head_dim, generator=g) * 0.1 + 1
    spec = {(0, "c"): (ratio, head_dim, overlap, torch.float32)}

    reference = CompressorStates(spec, num_rows=3, dtype=torch.float32, device="cpu")
    ref_rows = reference.rows(0, "c")
    expected = [compressor.prefill(ref_rows, b, kv[b], gate[b], bias, norm, 1e-6, _cos_sin) for b in range(3)]

    states = CompressorStates(spec, num_rows=3, dtype=torch.float32, device="cpu")
    rows = states.rows(0, "c")
    got = [[compressor.prefill(rows, b, kv[b][:n], gate[b][:n], bias, norm, 1e-6, _cos_sin)] for b, n in
           enumerate(prompts)]
    state_rows = torch.tensor([0, 1, 2, states.scratch_row])
    for step in range(total_steps):
        positions = torch.tensor([n + step for n in prompts] + [0])
        step_kv = torch.stack([kv[b][n + step] for b, n in enumerate(prompts)] + [torch.randn(width, generator=g)])
        step_gate = torch.stack([gate[b][n + step] for b, n in enumerate(prompts)] + [torch.randn(width, generator=g)])
        entries = compressor.decode_token(rows, state_rows, positions, step_kv, step_gate, bias, norm, 1e-6, _cos_sin)
        for b in range(3):
            if (positions[b] + 1) % ratio == 0:
                got[b].append(entries[b:b + 1])
    for b in range(3):
        entries = torch.cat(got[b])
        assert entries.shape == expected[b].shape
        assert_close(f"request {b} entries", entries, expected[b], FP32_RELATIVE)
        mine, ref = states.describe(b, lengths[b])[(0, "c")], reference.describe(b, lengths[b])[(0, "c")]
        assert torch.equal(mine["buffer"], ref["buffer"]) and mine["entries"] == ref["entries"]
        assert (mine["overlap"] is None) == (ref["overlap"] is None)
        if overlap:
            assert torch.equal(rows.overlap_kv[b], ref_rows.overlap_kv[b])
            assert torch.equal(rows.overlap_gate[b], ref_rows.overlap_gate[b])


class _Scorer:
    """The lightning indexer's scorer (transformers' DeepseekV4IndexerScorer fields) with positive weights."""

    def __init__(self, hidden, heads, head_dim, g):
        self.softmax_scale = head_dim ** -0.5
        self.weights_scaling = heads ** -0.5
        self.weights_proj = torch.nn.Linear(hidden, heads, bias=False)
        with torch.no_grad():
            self.weights_proj.weight.copy_(torch.rand(heads, hidden, generator=g) + 0.1)


def test_indexer_decode_keeps_prefills_top_k_beyond_index_topk():
    """40 visible entries, k = 16: the decode selection over a padded row (width 64, the padding keys zero)
    equals prefill's top-k over exactly the visible keys, entries and order, for two requests at once; the
    scores agree to fp32 rounding. Inputs are positive (no ReLU zeros), so no two scores tie."""
    g = torch.Generator().manual_seed(5)
    heads, d, hidden, k, visible = 4, 16, 32, 16, 40
    scorer = _Scorer(hidden, heads, d, g)
    keys = [torch.rand(visible + 7 * b, d, generator=g) for b in range(2)]  # request 1 has 7 more (unseen) keys
    q = torch.rand(2, 1, heads, d, generator=g)
    x = torch.rand(2, 1, hidden, generator=g)
    expected = []
    for b in range(2):
        scores = compressor.index_scores(scorer, q[b], keys[b].t()[None, None], x[b])[0]  # [1, n]
        future = torch.arange(keys[b].size(0))[None, :] >= visible
        expected.append((scores, scores.masked_fill(future, float("-inf")).topk(k, dim=-1).indices))
    padded = torch.zeros(2, 64, d)
    for b in range(2):
        padded[b, : keys[b].size(0)] = keys[b]
    scores = compressor.index_scores(scorer, q, padded.transpose(1, 2)[:, None], x)  # [2, 1, 64]
    chosen = compressor.decode_top_k(scores, torch.full((2, 1), visible), k)
    for b in range(2):
        ref_scores, ref_top = expected[b]
        torch.testing.assert_close(scores[b, :, :visible], ref_scores[:, :visible], rtol=1e-6, atol=0)
        assert torch.equal(chosen[b], ref_top), f"request {b}: {chosen[b].tolist()} != {ref_top.tolist()}"


def test_decode_top_k_breaks_ties_by_entry_id_whatever_the_width():
    """Scores with many exact zeros (ReLU): the highest first, ties lowest id first, -1 past the visible
    count; the same choice on rows padded to 64 and to 256."""
    g = torch.Generator().manual_seed(6)
    scores = torch.relu(torch.randn(3, 2, 50, generator=g))
    visible = torch.tensor([[50, 50], [10, 11], [0, 3]])
    chosen = {}
    for width in (64, 256):
        row = torch.cat([scores, torch.randn(3, 2, width - 50, generator=g)], dim=-1)  # junk past the visible
        chosen[width] = compressor.decode_top_k(row, visible, 16)
    assert torch.equal(chosen[64], chosen[256])
    for b in range(3):
        for j in range(2):
            n = int(visible[b, j])
            order = sorted(range(n), key=lambda e: (-float(scores[b, j, e]), e))[:16]
            assert chosen[64][b, j].tolist() == order + [-1] * (16 - len(order))


# ------------------------------------------------------------------------------------------
# static shapes

def test_device_metadata_equals_the_page_tables_row_by_row(checkpoint, engine_env):
    """decode_metadata's lists, tables and write slots (computed on the device from the compact page tables
    the host sends) equal each request's slots read row by row from its stores (PagedRows.slots), at
    lengths around page and window boundaries, with unbacked old window pages and s_q 2; padding rows read
    and write nothing; a query whose window row lost its page is refused on the host."""
    from engine.kv_store import CacheCapacityError
    from engine.model.layer_types import CSA, HCA

    engine_env()
    engine = Engine(checkpoint, max_batch_size=8, max_seq_len=700)
    runtime, stores, s_q = engine.runtime, engine.stores, 2
    window = runtime.window
    lengths = [1, 63, 64, 127, 190, 300, 640]  # 7 requests, padded to 8 (190: its window starts at row 63)
    batch = [engine._admit(Request(f"r{i}", [5] * n, 4)) for i, n in enumerate(lengths)]
    for active, n in zip(batch, lengths):
        rid = active.state.rid
        stores.window.ensure_rows(rid, max(0, n - window + 1), n)  # what prefill keeps: the last window
        for store, ratio in ((stores.csa, runtime.ratio[CSA]), (stores.indexer, runtime.ratio[CSA]),
                             (stores.hca, runtime.ratio[HCA])):
            store.ensure_rows(rid, 0, n // ratio)
        active.state.length = n
    seqs = engine._seq_steps(batch, [s_q] * len(batch), lengths)
    inputs = runtime.prepare_decode(seqs)
    meta = runtime.decode_metadata(inputs.host.clone(), inputs)
    assert meta.batch == 8

    def slots(store, rid, rows):
        return store.slots(rid, torch.tensor(rows, dtype=torch.long)).tolist() if rows else []

    def padded(values, width):
        return values + [-1] * (width - len(values))

    ratio_csa, ratio_hca = runtime.ratio[CSA], runtime.ratio[HCA]
    csa_width, hca_width = meta.csa_entry_slots.size(1), meta.hca_indices.size(2)
    for b, (active, n) in enumerate(zip(batch, lengths)):
        rid = active.state.rid
        count_csa, count_hca = (n + s_q) // ratio_csa, (n + s_q) // ratio_hca
        assert meta.csa_entry_slots[b].tolist() == padded(slots(stores.csa, rid, list(range(count_csa))), csa_width)
        assert meta.indexer_entry_slots[b].tolist() == padded(slots(stores.indexer, rid, list(range(count_csa))),
                                                              csa_width)
        hca_table = slots(stores.hca, rid, list(range(count_hca)))
        for j in range(s_q):
            p = n + j
            rows = list(range(max(0, p - window + 1), p + 1))
            assert meta.window_indices[b, j].tolist() == padded(slots(stores.window, rid, rows), window), (n, j)
            assert meta.window_write_slots[b * s_q + j].item() == slots(stores.window, rid, [p])[0]
            assert meta.hca_indices[b, j].tolist() == padded(hca_table[: (p + 1) // ratio_hca], hca_width)
            for name, store, ratio in (("csa", stores.csa, ratio_csa), ("indexer", stores.indexer, ratio_csa),
                                       ("hca", stores.hca, ratio_hca)):
                closes = (p + 1) % ratio == 0
                expected = slots(store, rid, [(p + 1) // ratio - 1])[0] if closes else -1
                assert meta.entry_writes[name][b, j].item() == expected, (name, n, j)
        assert meta.positions.view(-1, s_q)[b].tolist() == [n, n + 1]
    for b in range(len(batch), meta.batch):  # padding rows
        assert (meta.window_indices[b] == -1).all() and (meta.window_write_slots.view(-1, s_q)[b] == -1).all()
        assert (meta.csa_entry_slots[b] == -1).all() and (meta.hca_indices[b] == -1).all()
        assert all((w[b] == -1).all() for w in meta.entry_writes.values())
        assert meta.state_rows[b].item() == engine.compressor_states.scratch_row
    # the window row the longest request's first query reads loses its page: refused before any layer runs
    stores.window.release_rows_before(batch[-1].state.rid, lengths[-1])
    with pytest.raises(CacheCapacityError, match="window: a decode query reads a row whose page was released"):
        runtime.prepare_decode(seqs)


def test_batch_and_entry_width_buckets():
    assert [padded_batch(b, 128) for b in (1, 2, 3, 5, 8, 9, 16, 17, 64, 121, 128)] == \
        [1, 2, 4, 8, 8, 16, 16, 24, 64, 128, 128]
    assert [padded_batch(b, 6) for b in (3, 5, 6)] == [4, 6, 6]  # never above max_batch_size
    assert [entry_width(n) for n in (0, 1, 64, 65, 128, 129, 1000)] == [64, 64, 64, 128, 128, 256, 1024]


# 300 tokens: 75 ratio-4 entries (a 128-wide table), 2 ratio-128 ones; the batch shrinks 3 -> 2 -> 1
REQUESTS = [("long", 300, 3, 2), ("mid", 62, 4, 4), ("one", 1, 0, 5)]
DECODE_STEPS = 4


def _requests():
    return [Request(name, _random_prompt(n, seed) if n > 1 else [0], new) for name, n, seed, new in REQUESTS]


@pytest.fixture(scope="module")
def eager(checkpoint):
    """The eager engine (ref kernels) on REQUESTS: completions and stats."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in (("DEEPINFER_SPARSE_MLA_BACKEND", "ref"), ("DEEPINFER_KERNELS", "ref")):
            mp.setenv(name, value)
        mp.delenv("DEEPINFER_USE_NEXTN_DECODE", raising=False)
        dispatch.reset_resolution_for_tests()
        engine = Engine(checkpoint, max_seq_len=512)
        return engine.generate(_requests()), engine.stats()


def test_padding_changes_no_token_and_no_logit(checkpoint, eager, engine_env, monkeypatch):
    """The same requests with the batch padded to 8 rows and the entry tables to 256 entries: equal tokens,
    logits equal to fp32 summation order (the padded entries are -1, the padding rows read nothing)."""
    from engine.model import deepseek_v4

    engine_env(DEEPINFER_SPARSE_MLA_BACKEND="ref", DEEPINFER_KERNELS="ref")
    monkeypatch.setattr(decode_metadata, "padded_batch", lambda batch, max_batch: max_batch)
    monkeypatch.setattr(decode_metadata, "ENTRY_WIDTH_MIN", 256)
    keys = []
    real_build = decode_metadata.build_decode_inputs

    def recording(runtime, seqs, input_ids):
        inputs = real_build(runtime, seqs, input_ids)
        keys.append(inputs.key)
        return inputs

    monkeypatch.setattr(deepseek_v4, "build_decode_inputs", recording)
    padded = Engine(checkpoint, max_seq_len=512).generate(_requests())
    assert len(keys) == DECODE_STEPS and all(k == DecodeKey(8, 1, 256, 256) for k in keys), keys
    for a, b in zip(eager[0], padded):
        assert a.output_ids == b.output_ids, a.request_id
        diff = float((a.step_logits - b.step_logits).abs().max())
        assert diff < LOGITS_ATOL_FP32, f"{a.request_id}: logits differ by {diff}"


class _EagerReplay:
    """A CPU stand-in for engine.model.decode_graphs.DecodeGraphs: one buffer per key, kept across steps
    (as a graph's static input), the step run eagerly on it."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.buffers = {}
        self.layouts = {}
        self.keys = []
        self.replays = 0

    def run(self, inputs, device_ids=None):
        if inputs.key not in self.buffers:
            self.buffers[inputs.key] = torch.empty_like(inputs.host)
            self.layouts[inputs.key] = inputs.layout
            self.keys.append(inputs.key)
        assert self.layouts[inputs.key] == inputs.layout, "a key must fix the metadata's layout"
        buffer = self.buffers[inputs.key]
        buffer.copy_(inputs.host)
        if device_ids is not None:  # the tokens of the step before, as the runner left them on the device
            inputs.token_ids(buffer).copy_(device_ids)
        self.replays += 1
        return self.runtime.decode_step(buffer, inputs)[0]


def test_plain_decode_steps_replay_per_key_and_nextn_steps_stay_eager(checkpoint, eager, engine_env):
    """Plain decode steps go through runtime.graphs, one buffer per DecodeKey: keys follow the batch as
    requests finish (3 -> 2 -> 1 rows: padded 4, 2, 1) and the ratio-4 table width (128 while the
    300-token prompt runs); tokens and logits equal the eager engine's. With NextN every step verifies
    (speculative, eager): no replay. cuda_graphs=True needs a CUDA device."""
    engine_env(DEEPINFER_SPARSE_MLA_BACKEND="ref", DEEPINFER_KERNELS="ref")
    completions, stats = eager
    assert stats["cuda_graphs"] == {"enabled": False, "captured": 0, "replays": 0}
    engine = Engine(checkpoint, max_seq_len=512)
    engine.runtime.graphs = replay = _EagerReplay(engine.runtime)
    for a, b in zip(completions, engine.generate(_requests())):
        assert a.output_ids == b.output_ids and torch.equal(a.step_logits, b.step_logits), a.request_id
    assert replay.replays == engine.stats()["decode_steps"] == DECODE_STEPS
    assert replay.keys == [DecodeKey(4, 1, 128, 64), DecodeKey(2, 1, 64, 64), DecodeKey(1, 1, 64, 64)]

    engine_env(DEEPINFER_SPARSE_MLA_BACKEND="ref", DEEPINFER_KERNELS="ref", DEEPINFER_USE_NEXTN_DECODE="1")
    engine = Engine(checkpoint, max_seq_len=512)
    engine.runtime.graphs = replay = _EagerReplay(engine.runtime)
    short = [r for r in _requests() if r.request_id != "long"]
    for a, b in zip(completions[1:], engine.generate(short)):
        assert a.output_ids == b.output_ids, a.request_id
    assert replay.replays == 0 and engine.stats()["decode_steps"] > 0
    with pytest.raises(ValueError, match="cuda_graphs: CUDA graphs need a CUDA device"):
        Engine(checkpoint, cuda_graphs=True)


# ------------------------------------------------------------------------------------------
# GPU: graph replay vs eager

GPU_REQUESTS = [("long", 190, 1, 9), ("longer", 300, 3, 5), ("mid", 62, 4, 12), ("short", 7, 2, 3),
                ("one", 1, 5, 7)]


def _gpu_requests():
    return [Request(name, _random_prompt(n, seed) if n > 1 else [0], new) for name, n, seed, new in GPU_REQUESTS]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, kv_cache_dtype, backend", [(torch.bfloat16, "fp8", None),
                                                           (torch.float32, "auto", "triton")])
def test_cuda_graph_replay_matches_eager(checkpoint, engine_env, dtype, kv_cache_dtype, backend):
    """Five requests, max_batch_size 4 (one admitted while the others decode), prompts of 190 and 300 tokens
    (window pages released, ratio-4 windows closing every 4 steps, a 128-wide entry table) and 62 / 7 / 1;
    max_new_tokens 3 .. 12, so the batch shrinks. Graph replay and eager decoding run the same kernels on
    the same shapes: equal tokens, logits equal (a bf16 floor of 2e-2 and fp32 1e-4 allowed, should cuBLAS
    choose another algorithm under capture); every decode step replayed a graph."""
    engine_env(**({} if backend is None else {"DEEPINFER_SPARSE_MLA_BACKEND": backend}))
    runs = {}
    for graphs in (False, True):
        engine = Engine(checkpoint, device="cuda", dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_batch_size=4,
                        max_seq_len=512, cuda_graphs=graphs)
        runs[graphs] = engine.generate(_gpu_requests()), engine.stats()
    (eager, eager_stats), (replayed, stats) = runs[False], runs[True]
    assert eager_stats["cuda_graphs"]["enabled"] is False and stats["cuda_graphs"]["enabled"] is True
    assert stats["cuda_graphs"]["replays"] == stats["decode_steps"] > 0
    assert stats["cuda_graphs"]["captured"] >= 3, stats["cuda_graphs"]  # the batch shrinks: several keys
    floor = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for a, b in zip(eager, replayed):
        assert a.output_ids == b.output_ids, f"{a.request_id}: eager {a.output_ids} != graph {b.output_ids}"
        diff = float((a.step_logits - b.step_logits).abs().max())
        print(f"{a.request_id}: |eager - graph| logits {diff:.3g}")
        assert diff <= floor, f"{a.request_id}: logits differ by {diff}"


@pytest.mark.gpu
def test_cuda_graphs_with_nextn_leave_greedy_tokens_unchanged(checkpoint, engine_env):
    """NextN on (verification steps run eagerly): the same greedy tokens with graphs on as off."""
    engine_env(DEEPINFER_USE_NEXTN_DECODE="1")
    out = {}
    for graphs in (False, True):
        engine = Engine(checkpoint, device="cuda", dtype=torch.bfloat16, kv_cache_dtype="fp8", max_batch_size=4,
                        max_seq_len=512, num_speculative_tokens=2, cuda_graphs=graphs)
        out[graphs] = [c.output_ids for c in engine.generate(_gpu_requests())]
    assert out[True] == out[False]


@pytest.mark.gpu
def test_cuda_graphs_refuse_the_reference_fp8_quantizer(checkpoint, engine_env):
    """DEEPINFER_KERNELS=ref writes the fp8 cache through a boolean mask (a host sync): a graph-capturing
    engine stops at construction, naming the way out; cuda_graphs=False runs."""
    engine_env(DEEPINFER_KERNELS="ref")
    with pytest.raises(ValueError, match=r"cuda_graphs: DEEPINFER_KERNELS=ref .*cuda_graphs=False"):
        Engine(checkpoint, device="cuda", dtype=torch.bfloat16, kv_cache_dtype="fp8")
    engine = Engine(checkpoint, device="cuda", dtype=torch.bfloat16, kv_cache_dtype="fp8", cuda_graphs=False)
    assert engine.stats()["cuda_graphs"]["enabled"] is False
