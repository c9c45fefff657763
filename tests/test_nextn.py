"""NextN (MTP) speculative decoding in the engine (DEEPINFER_USE_NEXTN_DECODE=1).

Reference: the same engine without NextN, whose greedy tokens equal transformers' eager model
(tests/test_model_engine.py). With NextN the greedy tokens must be the same token for token, the
per-step logits the same to fp32 rounding, and every state the non-speculative engine holds at a
given stored length (compressor buffers and entry counts, held pages, window rows, compressed
entries) must be the same after rejected drafts were rolled back.
The tiny checkpoint's NextN layer has random weights, so its own drafts are almost never accepted;
an "oracle drafter" (the real NextN runs, then its drafts are replaced by the reference tokens,
every third one deliberately wrong) makes steps accept 0, 1 or all k drafts (+ the bonus token).
Prompts: 190 tokens (longer than the 128 window; its first window page leaves the window during a
verification, while the NextN pass over the verified rows still reads it; CSA/HCA entries), 62
tokens (its first verified rows straddle a page boundary) and one token, with max_batch_size 2 so
that a request is admitted while others verify.
"""

import json

import pytest
import torch

from engine.h20_ops import sampling
from engine.model import nextn, tiny
from engine.runner import Engine, Request

from conftest import set_engine_env

FP32_LOGITS_ATOL = 2e-3  # as tests/test_model_engine.py: summation-order differences stay ~1e-4
# stored rows: the verifier computes k + 1 rows per matmul, the reference one (fp32 summation order:
# up to ~1.1e-4 seen on the 190-token prompt's rows; a wrong rollback differs by orders more)
STATE_ATOL = 3e-4


def _random_prompt(n, seed):
    return torch.randint(2, 258, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# "mid" verifies rows 62..64 first: a rejected row 64 alone holds a window page that must be given back.
PROMPTS = {"long": (_random_prompt(190, 1), 6), "mid": (_random_prompt(62, 2), 8), "one": ([0], 5)}


def _requests(names=tuple(PROMPTS)):
    return [Request(n, PROMPTS[n][0], PROMPTS[n][1]) for n in names]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def _snapshot(engine, active):
    """Everything the main model keeps for one request, at its current stored length."""
    state = active.state
    rid = state.rid
    stores = engine.stores
    length = state.length
    first = max(0, length - engine.window + 1)
    window_rows = torch.stack([stores.window.read(layer, stores.window.slots(rid, torch.arange(first, length)))
                               for layer in range(len(stores.window.layers))])
    snap = {"window_rows": window_rows,
            "pages": {name: s.held_pages(rid) for name, s in vars(stores).items() if s is not None}}
    for (layer, name), comp in sorted(engine.compressor_states.describe(state.state_row, length).items()):
        store = stores.indexer if name == "indexer" else engine.runtime._compressed_store(
            engine.hf_model.config.layer_types[layer])
        slot = engine.runtime.store_slot[layer]
        snap[f"{layer}.{name}"] = dict(
            entries=comp["entries"], buffer=comp["buffer"], overlap=comp["overlap"],
            rows=store.read(slot, store.slots(rid, torch.arange(comp["entries"]))))
    return snap


def _record_states(engine, monkeypatch):
    """(request id, stored length) -> snapshot, taken whenever a step has settled a request."""
    states = {}
    real = engine._release_window_rows

    def recording(active, **kwargs):
        real(active, **kwargs)
        states[(active.state.rid, active.state.length)] = _snapshot(engine, active)

    monkeypatch.setattr(engine, "_release_window_rows", recording)
    return states


def _assert_same_state(mine, ref, where):
    assert mine["pages"] == ref["pages"], f"{where}: held pages {mine['pages']} != {ref['pages']}"
    assert mine.keys() == ref.keys(), where
    torch.testing.assert_close(mine["window_rows"], ref["window_rows"], atol=STATE_ATOL, rtol=0, msg=where)
    for key in mine.keys() - {"pages", "window_rows"}:
        a, b = mine[key], ref[key]
        assert a["entries"] == b["entries"], f"{where} {key}: {a['entries']} entries != {b['entries']}"
        assert a["buffer"].shape == b["buffer"].shape, f"{where} {key}: compressor buffer shapes differ"
        torch.testing.assert_close(a["buffer"], b["buffer"], atol=STATE_ATOL, rtol=0, msg=f"{where} {key}")
        assert (a["overlap"] is None) == (b["overlap"] is None), f"{where} {key}"
        if a["overlap"] is not None:
            torch.testing.assert_close(a["overlap"], b["overlap"], atol=STATE_ATOL, rtol=0, msg=f"{where} {key}")
        torch.testing.assert_close(a["rows"], b["rows"], atol=STATE_ATOL, rtol=0, msg=f"{where} {key}")


def _all_pages_free(engine):
    for name, store in engine._live_stores().items():
        assert store.available() == store.num_pages, f"{name} store leaked pages"


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The non-speculative engine (ref attention and ops): completions, stats, per-length states."""
    with pytest.MonkeyPatch.context() as mp:
        set_engine_env(mp, DEEPINFER_SPARSE_MLA_BACKEND="ref", DEEPINFER_KERNELS="ref", DEEPINFER_USE_NEXTN_DECODE="0")
        engine = Engine(checkpoint, max_batch_size=2, max_seq_len=256)
        states = _record_states(engine, mp)
        completions = engine.generate(_requests())
        return {c.request_id: c for c in completions}, engine.stats(), states


def _assert_same_completions(completions, reference):
    ref, _, _ = reference
    for c in completions:
        r = ref[c.request_id]
        assert c.output_ids == r.output_ids, f"{c.request_id}: NextN {c.output_ids} != reference {r.output_ids}"
        assert c.step_logits.shape == r.step_logits.shape
        diff = float((c.step_logits - r.step_logits).abs().max())
        assert diff < FP32_LOGITS_ATOL, f"{c.request_id}: per-step logits differ by {diff}"


# ------------------------------------------------------------------------------------------

def test_checkpoint_carries_nextn_weights_that_transformers_ignores(checkpoint):
    from safetensors.torch import load_file

    state = load_file(checkpoint / "model.safetensors")
    mtp = sorted(k for k in state if k.startswith(nextn.PREFIX))
    expected = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "norm.weight", "hc_head.hc_fn",
                "layer.self_attn.kv_proj.weight", "layer.self_attn.sinks", "layer.mlp.gate.weight"}
    assert expected <= {k[len(nextn.PREFIX):] for k in mtp}
    assert not any("compressor" in k for k in mtp), "the NextN layer is window-only"
    cfg = json.loads((checkpoint / "config.json").read_text())
    assert state[nextn.PREFIX + "eh_proj.weight"].shape == (cfg["hidden_size"], 2 * cfg["hidden_size"])
    # The NextN layer is not a copy of a main layer.
    assert not torch.equal(state[nextn.PREFIX + "layer.self_attn.kv_proj.weight"],
                           state["model.layers.0.self_attn.kv_proj.weight"])


def test_nextn_layer_keeps_its_float32_modules_at_checkpoint_precision(checkpoint):
    """In bf16 the float32-kept modules (sinks, hc_head, norms) hold the checkpoint's values exactly,
    not values rounded through bf16; the rest is the checkpoint rounded to bf16."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    state = load_file(checkpoint / "model.safetensors")
    layer = nextn.load_nextn_layer(checkpoint, AutoConfig.from_pretrained(checkpoint), dtype=torch.bfloat16,
                                   device="cpu")
    loaded = dict(layer.state_dict())
    for name in ("layer.self_attn.sinks", "hc_head.hc_fn", "enorm.weight", "hnorm.weight"):
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], state[nextn.PREFIX + name].float()), name
    assert loaded["eh_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(loaded["eh_proj.weight"], state[nextn.PREFIX + "eh_proj.weight"].bfloat16())


def test_reference_matches_the_transformers_oracle(checkpoint, reference):
    """The chain NextN == reference == oracle, in fp32: the reference's link, for these prompts."""
    from engine.model.hf_oracle import hf_greedy

    names = list(PROMPTS)
    results = hf_greedy(checkpoint, [PROMPTS[n][0] for n in names], max(n for _, n in PROMPTS.values()))
    for name, (tokens, logits) in zip(names, results):
        n = PROMPTS[name][1]
        ref = reference[0][name]
        assert ref.output_ids == tokens[:n], f"{name}: engine {ref.output_ids} != oracle {tokens[:n]}"
        assert float((ref.step_logits - logits[:n]).abs().max()) < FP32_LOGITS_ATOL


def test_nextn_greedy_equals_reference_and_reports_acceptance(checkpoint, reference, monkeypatch):
    """The checkpoint's own (random) NextN drafts, k = 1: tokens as without NextN."""
    set_engine_env(monkeypatch, DEEPINFER_SPARSE_MLA_BACKEND="ref", DEEPINFER_KERNELS="ref", DEEPINFER_USE_NEXTN_DECODE="1")
    engine = Engine(checkpoint, max_batch_size=2, max_seq_len=256)
    states = _record_states(engine, monkeypatch)
    _assert_same_completions(engine.generate(_requests()), reference)
    stats = engine.stats()
    ref_stats = reference[1]
    assert "acceptance_rate" not in ref_stats and ref_stats["nextn_decode"] is False
    assert stats["nextn_decode"] is True and stats["num_speculative_tokens"] == 1
    assert stats["fused_sample_backend"] == "ref"  # DEEPINFER_KERNELS=ref
    assert stats["decode_tokens"] == ref_stats["decode_tokens"] == sum(n - 1 for _, n in PROMPTS.values())
    assert 0 <= stats["accepted_tokens"] <= stats["draft_tokens"]
    assert stats["draft_tokens"] > 0 and 0.0 <= stats["acceptance_rate"] <= 1.0
    assert stats["acceptance_rate"] == stats["accepted_tokens"] / stats["draft_tokens"]
    assert stats["tokens_per_s"] > 0 and stats["generated_tokens"] == sum(n for _, n in PROMPTS.values())
    for (rid, length), snap in states.items():
        if (rid, length) in reference[2]:
            _assert_same_state(snap, reference[2][(rid, length)], f"{rid} at length {length}")
    _all_pages_free(engine)


def test_accepted_and_rejected_drafts_leave_the_reference_state(checkpoint, reference, monkeypatch):
    """k = 2 with an oracle drafter: steps accept 0, 1 or 2 drafts (+ bonus); after each step the
    main model's state equals the non-speculative engine's at the same stored length."""
    set_engine_env(monkeypatch, DEEPINFER_SPARSE_MLA_BACKEND="ref", DEEPINFER_KERNELS="ref", DEEPINFER_USE_NEXTN_DECODE="1")
    engine = Engine(checkpoint, max_batch_size=2, max_seq_len=256, num_speculative_tokens=2)
    ref_tokens = {rid: c.output_ids for rid, c in reference[0].items()}
    vocab = engine.vocab_size
    real_chain = engine._draft_chain

    def oracle_drafts(batch, logits, hidden):
        real_chain(batch, logits, hidden)  # the NextN layer still runs and keeps its window
        for active in batch:
            n = len(active.output_ids)
            truth = [ref_tokens[active.request.request_id][n + j] if n + j < active.request.max_new_tokens else 3
                     for j in range(2)]
            active.drafts = [t if (n + j) % 3 != 2 else (t + 1) % vocab for j, t in enumerate(truth)]

    verified = []
    real_verify = engine._verify

    def counting_verify(batch):
        verified.append(len(batch))
        return real_verify(batch)

    monkeypatch.setattr(engine, "_draft_chain", oracle_drafts)
    monkeypatch.setattr(engine, "_verify", counting_verify)
    states = _record_states(engine, monkeypatch)
    _assert_same_completions(engine.generate(_requests()), reference)
    stats = engine.stats()
    assert stats["draft_tokens"] == 2 * sum(verified)
    assert 0.0 < stats["acceptance_rate"] < 1.0, stats
    assert stats["decode_tokens"] == reference[1]["decode_tokens"]
    assert stats["decode_steps"] < reference[1]["decode_steps"], "accepted drafts must save steps"
    compared = [key for key in states if key in reference[2]]
    assert len(compared) >= 8, f"too few common lengths to compare: {compared}"
    for key in compared:
        _assert_same_state(states[key], reference[2][key], f"{key[0]} at length {key[1]}")
    _all_pages_free(engine)


def test_verification_ranks_only_the_index_keys_each_token_sees(checkpoint, monkeypatch):
    """k = 5: a verification step ranks index keys for 6 tokens at once, and the keys that only its
    later tokens complete are masked for the earlier ones. Index scores tie exactly (ReLU: zeros), and
    top-k breaks ties differently over a longer row, so each token must rank exactly its visible keys,
    as plain decoding does: on this 300-token prompt the token at position 312 otherwise chose two
    other tied entries and the logits parted by 0.4."""
    g = torch.Generator().manual_seed(1)
    for n in (190, 255):  # the prompt is this generator's third draw
        torch.randint(2, 258, (n,), generator=g)
    prompt = torch.randint(2, 258, (300,), generator=g).tolist()
    runs = {}
    for nextn in ("0", "1"):
        set_engine_env(monkeypatch, DEEPINFER_SPARSE_MLA_BACKEND="ref", DEEPINFER_KERNELS="ref",
                 DEEPINFER_USE_NEXTN_DECODE=nextn)
        engine = Engine(checkpoint, max_batch_size=1, max_seq_len=512, num_speculative_tokens=5)
        runs[nextn] = engine.generate([Request("a", prompt, 16)])[0]
    assert runs["1"].output_ids == runs["0"].output_ids
    diff = float((runs["1"].step_logits - runs["0"].step_logits).abs().max())
    assert diff < FP32_LOGITS_ATOL, f"per-step logits differ by {diff}"


def test_paged_rows_truncate_and_release_return_pages_to_the_reservation():
    from engine.kv_store import CacheCapacityError, PagedRows

    store = PagedRows("t", num_layers=1, num_pages=4, page_size=4, row_dim=8, dtype=torch.float32,
                      device="cpu", fp8=False)
    store.admit("a", 2)
    rows = torch.randn(8, 8)
    store.write(0, "a", 0, rows)  # rows 0..7: pages 0, 1 (the whole reservation)
    assert store.held_pages("a") == 2 and store.available() == 2
    store.truncate("a", 5)  # rows 5..7 dropped: page 1 still holds row 4
    assert store.held_pages("a") == 2
    store.truncate("a", 4)  # page 1 held only dropped rows
    assert store.held_pages("a") == 1 and store.available() == 2
    store.write(0, "a", 4, rows[:4])  # taken again within the reservation
    with pytest.raises(CacheCapacityError, match="reservation"):
        store.write(0, "a", 8, rows[:1])
    store.release_rows_before("a", 4)  # page 0 left the window: one page may be taken again
    store.write(0, "a", 8, rows[:1])
    torch.testing.assert_close(store.read(0, store.slots("a", torch.arange(4, 9))), torch.cat([rows[:4], rows[:1]]))
    assert store.held_pages("a") == 2
    store.drop("a")
    assert store.available() == store.num_pages


def test_nextn_needs_nextn_weights_and_valid_k(checkpoint, tmp_path, monkeypatch):
    import shutil

    from safetensors.torch import load_file, save_file

    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare)
    state = {k: v for k, v in load_file(checkpoint / "model.safetensors").items() if not k.startswith("mtp.")}
    save_file(state, str(bare / "model.safetensors"), metadata={"format": "pt"})
    set_engine_env(monkeypatch, DEEPINFER_SPARSE_MLA_BACKEND="ref", DEEPINFER_KERNELS="ref", DEEPINFER_USE_NEXTN_DECODE="1")
    with pytest.raises(ValueError, match="checkpoint_dir: .* no NextN"):
        Engine(bare)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Engine(checkpoint, num_speculative_tokens=0)


def test_nextn_triton_default_path(checkpoint, reference, monkeypatch):
    """TileLang blocked: triton sparse MLA and ops (interpreted), Triton rejection sampling, strict."""
    set_engine_env(monkeypatch, DEEPINFER_SIMULATE_NO_TILELANG="1", DEEPINFER_KERNELS="triton", DEEPINFER_OPS_STRICT="1",
             DEEPINFER_USE_NEXTN_DECODE="1")
    engine = Engine(checkpoint, max_batch_size=2)
    completions = engine.generate([Request("mid", PROMPTS["mid"][0], 3), Request("one", [0], 3)])
    for c in completions:
        ref = reference[0][c.request_id]
        assert c.output_ids == ref.output_ids[:3]
        assert float((c.step_logits - ref.step_logits[:3]).abs().max()) < FP32_LOGITS_ATOL
    stats = engine.stats()
    assert stats["sparse_mla_backend"] == "triton" and stats["op_fallbacks"] == {}
    assert stats["fused_sample_backend"] == "triton" and 0.0 <= stats["acceptance_rate"] <= 1.0
    _all_pages_free(engine)


# ------------------------------------------------------------------------------------------
# sampled speculative decoding: drafts from NextN on the draft lane, real rejection sampling

SAMPLED = dict(temperature=0.8, top_p=0.9)
SAMPLED_PROMPT = _random_prompt(5, 3)  # short prompts: the sampled tests' cost is per step


def _sampled(seeds, greedy=False, n=4):
    """Requests "s<seed>" on SAMPLED_PROMPT sampled with each seed (n tokens), then, if `greedy`,
    the greedy "one" of PROMPTS (its reference length)."""
    from engine.runner import SamplingParams

    requests = [Request(f"s{seed}", SAMPLED_PROMPT, n, SamplingParams(**SAMPLED, seed=seed)) for seed in seeds]
    return requests + ([Request("one", PROMPTS["one"][0], PROMPTS["one"][1])] if greedy else [])


def test_nextn_sampled_ref_and_triton_samplers_agree(checkpoint, reference, monkeypatch, launch_batches):
    """fp32, temperature 0.8, top-p 0.9, k = 2 drafts: the Triton sampler (interpreted) drafts, accepts
    and emits exactly the numpy reference sampler's tokens (same logits: torch-reference attention
    and ops in both runs); the greedy request in the same launches keeps the non-speculative greedy
    tokens; each verify step is one rejection_sample launch for the whole batch."""
    set_engine_env(monkeypatch, DEEPINFER_SPARSE_MLA_BACKEND="ref", DEEPINFER_KERNELS="ref", DEEPINFER_USE_NEXTN_DECODE="1")
    engine = Engine(checkpoint, max_batch_size=2, max_seq_len=256, num_speculative_tokens=2)
    requests = lambda: _sampled([31], greedy=True)  # noqa: E731
    launches = launch_batches(sampling, "rejection_sample")
    by_ref = engine.generate(requests())
    assert launches and all(n == 2 for n in launches[:-1]) and launches[-1] in (1, 2), launches
    engine.sample_backend = "triton"
    by_triton = engine.generate(requests())
    for r, t in zip(by_ref, by_triton):
        assert r.output_ids == t.output_ids, f"{r.request_id}: ref sampler {r.output_ids} != triton {t.output_ids}"
    _assert_same_completions(by_triton[1:], reference)  # "one", greedy: the non-speculative tokens
    stats = engine.stats()
    assert stats["fused_sample_backend"] == "triton" and stats["draft_tokens"] > 0
    _all_pages_free(engine)


def test_nextn_sampled_is_deterministic_per_seed_and_greedy_rows_stay_greedy(checkpoint, reference, monkeypatch):
    """Reference sampler, k = 1, one batch: two requests with the same prompt and seed (other batch
    slots) give the same tokens, two with other seeds other tokens (fixed seeds, fp32: a fixed
    outcome; 6 tokens at T 0.8 / top-p 0.9, where this model's top token has probability 0.1-0.9,
    rarely repeat by chance: tests/test_model_engine.py bounds that chance for 8); the greedy
    request of the batch gets the non-speculative greedy tokens."""
    set_engine_env(monkeypatch, DEEPINFER_SPARSE_MLA_BACKEND="ref", DEEPINFER_KERNELS="ref", DEEPINFER_USE_NEXTN_DECODE="1")
    engine = Engine(checkpoint, max_batch_size=5, max_seq_len=256)
    requests = _sampled([41, 42, 43], greedy=True, n=6)
    twin = _sampled([41], n=6)[0]
    twin.request_id = "s41-again"
    out = {c.request_id: c for c in engine.generate(requests[:1] + [twin] + requests[1:])}
    assert out["s41-again"].output_ids == out["s41"].output_ids
    ids = [tuple(out[f"s{seed}"].output_ids) for seed in (41, 42, 43)]
    assert len(set(ids)) == 3, f"seeds 41, 42, 43 must give different tokens: {ids}"
    _assert_same_completions([out["one"]], reference)
    assert engine.stats()["draft_tokens"] > 0
    _all_pages_free(engine)


def test_draft_and_verify_draws_never_share_a_stream_word(checkpoint, monkeypatch):
    """Every random decision of a sampled NextN run (k = 2): (seed, position, draw) of the first
    tokens, of every draft and of every acceptance test, residual and bonus token that decided
    something, collected from the engine's fused_sample calls: none is used twice. Verify steps are
    steered through all outcomes (accept 2 + bonus, accept 1, reject the first), so the next chain
    starts at every offset, including positions whose discarded drafts a naive draft position
    (position + j) would draw again."""
    from engine.h20_ops.sampling.reference import DRAW_ACCEPT, DRAW_DRAFT, DRAW_SAMPLE

    set_engine_env(monkeypatch, DEEPINFER_SPARSE_MLA_BACKEND="ref", DEEPINFER_KERNELS="ref", DEEPINFER_USE_NEXTN_DECODE="1")
    engine = Engine(checkpoint, max_batch_size=2, max_seq_len=256, num_speculative_tokens=2)
    used, outcomes = [], []
    real_sample, real_rejection = sampling.sample, sampling.rejection_sample

    def recording_sample(logits, seeds, positions, temperature, top_k, top_p, *, draw, backend):
        used.extend((s, p, draw) for s, p, t in zip(seeds.tolist(), positions.tolist(), temperature.tolist()) if t > 0)
        return real_sample(logits, seeds, positions, temperature, top_k, top_p, draw=draw, backend=backend)

    def steered_rejection(target, draft_logits, drafts, seeds, positions, temperature, top_k, top_p, *, backend):
        # make drafts 0..m-1 the target's own argmax with the target as draft distribution (sure accepts)
        m = (2, 1, 0)[len(outcomes) % 3]
        draft_logits, drafts = draft_logits.clone(), drafts.clone()
        draft_logits[:, :m] = target[:, :m]
        drafts[:, :m] = target[:, :m].argmax(dim=-1)
        tokens, accepted = real_rejection(target, draft_logits, drafts, seeds, positions, temperature, top_k, top_p,
                                          backend=backend)
        for s, p, a in zip(seeds.tolist(), positions.tolist(), accepted.tolist()):
            used.extend((s, p + j, DRAW_ACCEPT) for j in range(min(a + 1, 2)))  # the tests made, up to a rejection
            used.append((s, p + a, DRAW_SAMPLE))  # the residual token at the rejection, or the bonus at p + k
        outcomes.extend(accepted.tolist())
        return tokens, accepted

    monkeypatch.setattr(sampling, "sample", recording_sample)
    monkeypatch.setattr(sampling, "rejection_sample", steered_rejection)
    engine.generate(_sampled([51], n=10))
    assert {0, 1, 2} <= set(outcomes), outcomes
    assert {d for _, _, d in used} == {DRAW_SAMPLE, DRAW_ACCEPT, DRAW_DRAFT}
    repeated = [key for key in set(used) if used.count(key) > 1]
    assert not repeated, f"stream words used twice: {sorted(repeated)}"
    _all_pages_free(engine)
