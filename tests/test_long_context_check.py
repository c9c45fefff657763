"""scripts/long_context_check.py at its CPU scale (issue 34): a 250-token prompt and 12 steps, the
engine in bf16 with the bf16 cache (the Triton kernel under its interpreter, TileLang blocked as in
CI), teacher-forced along the engine's own float32 run through the attention oracle, and transformers
in float32. The shipped kernels pass; a broken kernel (tests/broken_kernels.py) fails the check
against the same reference and floor runs.

CI's budget leaves out the fp8 cache here (`--kv-caches auto`): its decode under the interpreter
dequantizes the gathered rows with the Triton kernel (its two runs: ~2 more minutes on the development
machine); `--device cpu` runs both caches by default, the GPU run both at 65500 tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import long_context_check as lc  # noqa: E402

CI_ENV = {"DEEPINFER_SIMULATE_NO_TILELANG": "1", "DEEPINFER_KERNELS": "ref", "DEEPINFER_OPS_STRICT": "1"}


def _ci_env(patch: pytest.MonkeyPatch) -> None:
    for name, value in CI_ENV.items():
        patch.setenv(name, value)
    for name in ("DEEPINFER_SPARSE_MLA_BACKEND", "DEEPINFER_USE_NEXTN_DECODE"):
        patch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_context") / "check.json"
    with pytest.MonkeyPatch.context() as patch:
        _ci_env(patch)
        args = lc.parse_args(["--device", "cpu", "--kv-caches", "auto", "--json", str(out)])
        return args, lc.check(args)


def test_cpu_check_passes_the_shipped_kernels(shipped):
    args, report = shipped
    assert report["exit_code"] == 0 and report["ok"] and report["failures"] == [], report["failures"]
    s = report["settings"]
    assert (s["prompt_tokens"], s["steps"], s["hf_chunk"]) == (250, 12, 64) and s["device"] == "cpu"
    # the trace releases a window page, completes a ratio-128 entry and passes the indexer's top-k, in decode
    t = s["trace"]
    assert t["csa_entries"][0] < t["index_topk"] < t["csa_entries"][1]
    assert t["hca_entries"][1] > t["hca_entries"][0] >= 1
    assert t["window_pages_released"][1] > t["window_pages_released"][0] >= 1
    runs = {r["label"]: r for r in report["runs"]}
    assert list(runs) == ["reference", "floor auto", "kernels auto", "transformers"]
    assert len(report["reference_tokens"]) == 12 and runs["reference"]["backend"] == "ref"
    for cache in args.kv_caches:
        kernel, floor = runs[f"kernels {cache}"], runs[f"floor {cache}"]
        assert kernel["backend"] == "triton" and floor["backend"] == "ref" and kernel["op_fallbacks"] == {}
        assert kernel["ok"] and all(r <= args.factor for r in kernel["ratio"].values())
        assert floor["vs_reference"]["mean"] > 0  # bf16 itself costs something: the floor is not degenerate
        v = kernel["vs_reference"]
        assert len(v["per_step_max"]) == 12 and max(v["per_step_max"]) == v["max"]
        assert kernel["tokens"] == report["reference_tokens"]  # teacher-forced
        assert kernel["decode_tokens_per_s"] > 0 and kernel["peak_memory_bytes"] > 0
    hf = runs["transformers"]
    assert hf["ok"] and hf["vs_reference"]["max"] <= lc.HF_BOUND
    assert hf["vs_reference"]["shared_greedy_prefix"] == 12
    saved = json.loads(Path(report["json_path"]).read_text())
    assert saved["exit_code"] == 0 and all("logits" not in r for r in saved["runs"])
    md = lc.render_markdown(report)
    assert "| kernels auto | bfloat16 | auto | triton |" in md and "Trace, step 0 -> last step: ratio-4 entries 62 -> 65" in md
    assert md.count("| pass |") == 2 and md.rstrip().endswith(report["json_path"])


def test_cpu_check_fails_a_broken_kernel(shipped):
    """A broken kernel's run (tests/broken_kernels.py: the softmax scale's log2(e) applied twice) against
    the shipped check's reference and bf16-cache floor: past 2x the floor, and the check's failures
    name it."""
    import broken_kernels

    args, report = shipped
    runs = {r["label"]: r for r in report["runs"]}
    spec = lc.RunSpec("kernels auto", "kernel", "bfloat16", "auto", None)
    with pytest.MonkeyPatch.context() as patch:
        _ci_env(patch)
        broken = lc.run_spec(spec, report["settings"]["checkpoint"], lc.long_prompt(args.prompt_tokens, args.seed),
                             args.steps, report["reference_tokens"], "cpu", args.hf_chunk,
                             broken_kernels.BrokenKernelEngineBuilder("scale_log2e_twice"))
    assert "error" not in broken and broken["backend"] == "triton"
    failures = lc.evaluate([runs["reference"], runs["floor auto"], broken], args.factor, args.hf_bound)
    assert len(failures) == 1 and failures[0].startswith("kernels auto: |dlogit|") and not broken["ok"]
    assert max(broken["ratio"].values()) > args.factor


def test_arguments_are_validated(capsys):
    for argv, message in ((["--device", "cpu", "--kv-caches", "bf16"], "--kv-caches: expected"),
                          (["--device", "cpu", "--backends", "ref"], "--backends: expected"),
                          (["--device", "cpu", "--steps", "0"], "--steps: expected >= 1"),
                          (["--device", "cpu", "--factor", "0"], "--factor / --hf-bound: expected positive")):
        with pytest.raises(SystemExit):
            lc.parse_args(argv)
        assert message in capsys.readouterr().err
    args = lc.parse_args(["--device", "cpu", "--backends", "tilelang,triton", "--kv-caches", "fp8", "--no-transformers"])
    assert [s.label for s in lc.run_specs(args)] == ["reference", "floor fp8", "tilelang fp8", "triton fp8"]
