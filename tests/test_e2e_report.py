"""The data-parallel server (engine.serve_dp) and the end-to-end report (scripts/e2e_report.py).

- The issue's CI command end to end (real engine, 8 ranks over gloo, Triton under its interpreter,
  transformers' oracle), asserting on the JSON it writes.
- serve_dp with a tiny fake engine (no model): results gathered from every rank, round-robin shares,
  the environment reaching the ranks; a rank that raises is reported with its exception text and a
  ModuleNotFoundError is counted; a hung rank and a crashed rank are reported and nothing waits past
  the deadline.
- The sampled report in process: --temperature 0.8 --compare with the attention backend pinned
  (2 ranks, NextN on): both runs agree token by token, sampled answers are not failed against the
  greedy oracle, every rank samples the control prompt alike.
- Report building on synthetic records: oracle agreement, failures, Markdown table, compare (and
  its required mode); sampling flag validation.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import serve_dp
from engine.serve_dp import CONTROL_REQUEST_ID, DPJob, DPResult, RankRecord, prompt_request_id

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("e2e_report", ROOT / "scripts" / "e2e_report.py")
e2e_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e_report)

VOCAB = 16


# ------------------------------------------------------------------------------- the CI command

@pytest.mark.parametrize("nextn", ["0", "1"])
def test_ci_command_report_json(tmp_path, nextn):
    """Issue 6 item 6: exit 0, triton x8, no ModuleNotFoundError, no fallbacks, 8/8, oracle tokens;
    and issue 7: the same with NextN speculative decoding on (Triton sampling), tokens still equal."""
    out = tmp_path / "report.json"
    kernels = "ref" if nextn == "0" else "triton"  # with NextN: Triton sampling (and ops) under the interpreter
    env = {**os.environ, "PYTHON": sys.executable, "DEEPINFER_SIMULATE_NO_TILELANG": "1", "DEEPINFER_KERNELS": kernels,
           "DEEPINFER_OPS_STRICT": "1", "DEEPINFER_USE_NEXTN_DECODE": nextn}
    env.pop("DEEPINFER_SPARSE_MLA_BACKEND", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "h20_e2e_report.sh"), "--prompts", "8",
                           "--max-new-tokens", "4", "--json", str(out), "--timeout", "840"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=960)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["schema"] == e2e_report.SCHEMA
    assert report["exit_code"] == 0 and report["ok"] and report["failures"] == []
    (run,) = report["runs"]
    assert run["backend_summary"] == "triton x8"
    assert all(r["backend"] == "triton" and r["backend_reason"].startswith("auto") for r in run["ranks"])
    assert run["module_not_found_failures"] == 0
    assert run["op_fallbacks"] == {} and all(r["op_fallbacks"] == {} for r in run["ranks"])
    assert run["control"]["agreeing"] == 8 and run["control"]["ranks"] == 8
    assert run["control"]["output_ids"] == report["oracle"]["control"]["output_ids"]
    assert len(run["prompts"]) == 8
    for p, o in zip(run["prompts"], report["oracle"]["prompts"]):
        assert p["rank"] == p["index"] % 8
        assert p["output_ids"] == o["output_ids"] and len(o["output_ids"]) == 4
        assert p["oracle"]["tokens_equal"] and p["oracle"]["max_logits_diff"] < 1e-2
    assert max(p["prompt_tokens"] for p in run["prompts"]) > 128  # one prompt leaves the sliding window
    assert all(r["ok"] and r["tokens_per_s"] > 0 and r["generated_tokens"] == 4 * (1 + 1) for r in run["ranks"])
    assert report["settings"]["environ"]["DEEPINFER_KERNELS"] == kernels
    if nextn == "1":
        assert run["nextn"]["enabled"] and run["nextn"]["num_speculative_tokens"] == 1
        assert run["nextn"]["sampling_backend"] == "triton x8"
        assert run["nextn"]["drafted"] > 0 and 0 <= run["nextn"]["accepted"] <= run["nextn"]["drafted"]
        assert "| NextN speculative decoding (DEEPINFER_USE_NEXTN_DECODE) | on, k=1;" in proc.stdout
    else:
        assert run["nextn"] == {"enabled": False}
    # the Markdown table on stdout carries the same verdicts
    assert "| sparse MLA backend per rank | triton x8 |" in proc.stdout
    assert "| DP ranks agreeing (control prompt) | 8/8 |" in proc.stdout
    assert "| exit code | 0 |" in proc.stdout
    assert str(out.resolve()) in proc.stdout
    assert "[e2e" in proc.stderr and "oracle" in proc.stderr


def test_ci_command_report_json_hub_source(tmp_path):
    """Issue 31: the report once with DEEPINFER_KERNEL_SOURCE=hub, the kernels built from this checkout and
    loaded from an offline cache through a lock (HF_HUB_OFFLINE=1): the hub source on every rank with the
    same commit and digest, every op from the hub, no fallbacks, tokens equal to the oracle. Small (2 ranks,
    2 prompts, 2 tokens): the other CI runs cover the engine; this one covers where its kernels come from."""
    pytest.importorskip("kernels", reason="needs the kernels package (pyproject's test / hf-kernels extras)")
    repo, cache, lock = tmp_path / "kernel_repo", tmp_path / "kernel_cache", tmp_path / "kernels.lock"
    for script, args in (("build_kernel_repo.py", [str(repo)]),
                         ("kernel_offline_cache.py", [str(repo), "--lock", str(lock), "--cache", str(cache)])):
        subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], check=True, capture_output=True)
    commit = json.loads(lock.read_text())[0]["lock"]["commit"]
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHON": sys.executable, "DEEPINFER_SIMULATE_NO_TILELANG": "1", "DEEPINFER_KERNELS": "ref",
           "DEEPINFER_OPS_STRICT": "1", "DEEPINFER_USE_NEXTN_DECODE": "0", "HF_HUB_OFFLINE": "1",
           "KERNELS_CACHE": str(cache), "DEEPINFER_KERNEL_SOURCE": "hub",
           "DEEPINFER_KERNEL_REPO": "deepinfer/sparse-mla@v1", "DEEPINFER_KERNEL_LOCK": str(lock)}
    for var in ("DEEPINFER_SPARSE_MLA_BACKEND", "DEEPINFER_KERNEL_MAPPING"):
        env.pop(var, None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "h20_e2e_report.sh"), "--ranks", "2", "--prompts", "2",
                           "--max-new-tokens", "2", "--json", str(out), "--timeout", "600"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=720)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["exit_code"] == 0 and report["ok"] and report["failures"] == []
    (run,) = report["runs"]
    digest = hashlib.sha256((repo / "build" / "torch-cpu" / "metadata.json").read_bytes()).hexdigest()
    assert run["kernel_source"] == {"summary": "hub x2", "fallbacks": {}, "kernels": [
        {"repo": "deepinfer/sparse-mla@v1", "commit": commit, "variant": "torch-cpu", "digest": digest}]}
    for r in run["ranks"]:
        ks = r["kernel_source"]
        assert ks["source"] == "hub" and ks["strict"] and ks["commit"] == commit and ks["digest"] == digest
        assert set(ks["ops"].values()) == {"hub"} and ks["fallbacks"] == {} and ks["problem"] is None
        assert r["op_fallbacks"] == {} and r["backend"] == "triton"
    assert run["op_fallbacks"] == {} and run["module_not_found_failures"] == 0
    assert run["control"]["agreeing"] == 2 and run["control"]["output_ids"] == report["oracle"]["control"]["output_ids"]
    for p, o in zip(run["prompts"], report["oracle"]["prompts"]):
        assert p["output_ids"] == o["output_ids"] and len(o["output_ids"]) == 2 and p["oracle"]["tokens_equal"]
    assert report["settings"]["environ"]["DEEPINFER_KERNEL_SOURCE"] == "hub"
    assert f"| kernel source per rank (DEEPINFER_KERNEL_SOURCE) | hub x2 (deepinfer/sparse-mla@v1 commit " \
           f"{commit[:12]} torch-cpu digest {digest[:12]}) |" in proc.stdout


# ------------------------------------------------------------------------------- fake workload

@dataclass
class FakeCompletion:
    request_id: str
    output_ids: list[int]
    step_logits: torch.Tensor


def fake_tokens(prompt: list[int], n: int, salt: int = 0) -> list[int]:
    return [(sum(prompt) * 7 + k * 3 + salt) % VOCAB for k in range(n)]


class FakeEngine:
    """Deterministic answers from the prompt; `misbehave` picks what this rank does."""

    def __init__(self, misbehave: str | None, salt: int):
        self.misbehave = misbehave
        self.salt = salt

    def generate(self, requests):
        if self.misbehave == "raise":
            raise RuntimeError(f"boom on rank {torch.distributed.get_rank()}")
        if self.misbehave == "module":
            try:
                import deepinfer_no_such_module  # noqa: F401
            except ModuleNotFoundError as exc:
                raise RuntimeError("a kernel module failed to load") from exc
        if self.misbehave == "hang":
            time.sleep(3600)
        if self.misbehave == "crash":
            os._exit(7)
        out = []
        for r in requests:
            ids = fake_tokens(r.prompt_ids, r.max_new_tokens, self.salt)
            out.append(FakeCompletion(r.request_id, ids, torch.nn.functional.one_hot(torch.tensor(ids), VOCAB).float()))
        return out

    def stats(self):
        return {"fake": True, "salt_from_env": os.environ.get("DEEPINFER_TEST_SALT")}


@dataclass(frozen=True)
class FakeFactory:
    misbehave_by_rank: tuple[tuple[int, str], ...] = ()

    def __call__(self, device):
        rank = torch.distributed.get_rank()
        salt = int(os.environ.get("DEEPINFER_TEST_SALT", "0"))
        return FakeEngine(dict(self.misbehave_by_rank).get(rank), salt)


PROMPTS = tuple(tuple(range(i + 1, i + 4)) for i in range(6))
CONTROL = (5, 9, 2)


def fake_job(ranks=3, misbehave=(), timeout_s=60.0, environ=()):
    return DPJob(FakeFactory(tuple(misbehave)), PROMPTS, CONTROL, 5, ranks=ranks, timeout_s=timeout_s,
                 environ=tuple(environ))


def test_serve_gathers_every_rank_round_robin():
    result = serve_dp.serve(fake_job(ranks=3, environ=[("DEEPINFER_TEST_SALT", "4")]))
    assert result.ok and result.gathered and result.dist_backend == "gloo" and result.notes == []
    assert [r.rank for r in result.records] == [0, 1, 2]
    for rec in result.records:
        assert rec.prompt_indices == list(range(rec.rank, len(PROMPTS), 3))
        assert sorted(rec.completions) == sorted([CONTROL_REQUEST_ID] + [prompt_request_id(i) for i in rec.prompt_indices])
        for i in rec.prompt_indices:
            c = rec.completions[prompt_request_id(i)]
            assert c["output_ids"] == fake_tokens(list(PROMPTS[i]), 5, salt=4)  # environ reached the rank
            assert isinstance(c["step_logits"], np.ndarray) and c["step_logits"].shape == (5, VOCAB)
        assert rec.engine_stats == {"fake": True, "salt_from_env": "4"}
        assert rec.backend == "triton" or rec.backend == "tilelang"  # resolved in the rank
        assert rec.generated_tokens == 5 * (1 + len(rec.prompt_indices)) and rec.tokens_per_s > 0
        assert rec.device == "cpu" and rec.stage == "done" and rec.error is None
    assert serve_dp.control_agreement(result.records) == (3, fake_tokens(list(CONTROL), 5, salt=4))


def test_raising_ranks_are_reported_and_fail_the_report():
    result = serve_dp.serve(fake_job(ranks=3, misbehave=[(1, "raise"), (2, "module")]))
    assert result.gathered  # exceptions are records, the gather still completes
    ok, boom, mnf = result.records
    assert ok.ok and not boom.ok and not mnf.ok
    assert boom.error["type"] == "RuntimeError" and boom.error["message"] == "boom on rank 1"
    assert "boom on rank 1" in boom.error["traceback"] and boom.stage == "serve"
    assert boom.module_not_found_failures == 0
    assert mnf.module_not_found_failures == 1 and "deepinfer_no_such_module" in mnf.error["traceback"]
    run = e2e_report.evaluate_run("fake", {}, result, [list(p) for p in PROMPTS], fake_oracle(), True, str)
    assert not run["ok"] and run["module_not_found_failures"] == 1
    assert run["control"]["agreeing"] == 1 and run["control"]["ranks"] == 3
    text = "\n".join(run["failures"])
    assert "rank 1 failed at stage serve: RuntimeError: boom on rank 1" in text
    assert "1 rank(s) hit a ModuleNotFoundError" in text and "1/3" in text
    assert "prompt 1: no completion (rank 1)" in text and "prompt 5: no completion (rank 2)" in text


def test_hung_and_crashed_ranks_do_not_hang_the_run():
    start = time.time()
    result = serve_dp.serve(fake_job(ranks=4, misbehave=[(1, "hang"), (3, "crash")], timeout_s=25.0))
    elapsed = time.time() - start
    assert elapsed < 25.0 + serve_dp.VERDICT_WAIT_S + 10, elapsed
    assert not result.gathered and any("[1, 3]" in n for n in result.notes)
    r0, hung, r2, crashed = result.records
    assert r0.ok and r2.ok and r0.completions and r2.completions  # present ranks still report
    assert hung.error["type"] == "NoResult" and "killed by the watchdog" in hung.error["message"]
    assert crashed.error["type"] == "NoResult" and "exited with code 7" in crashed.error["message"]


def _send_large_message(conn) -> None:
    conn.send(("record", b"x" * (64 << 20)))  # blocks once the pipe is full: nobody reads yet


def test_a_rank_killed_in_the_middle_of_a_message_does_not_block_the_launcher():
    """The watchdog may kill a rank while it sends its record: the launcher's reads end (the rank's
    pipe closes with it) and the partial message is dropped instead of waited for."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    pipes = serve_dp._ResultPipes(ctx, 1)
    proc = ctx.Process(target=_send_large_message, args=(pipes.writer(0),))
    proc.start()
    pipes.started()
    reader = pipes._pairs[0][0]
    assert reader.poll(120)  # the message has started; 64 MB do not fit the pipe, so the send blocks
    time.sleep(0.5)
    assert proc.is_alive()
    proc.kill()
    proc.join()
    got = []
    start = time.time()
    while pipes.receive(0.1, got.append):
        pass
    assert time.time() - start < 10 and got == [] and not pipes.open


def test_ranks_failing_before_the_group_report_their_own_errors():
    """Every rank fails before init_process_group (a bad DEEPINFER_* value): no gather is possible, but
    each rank's record still arrives with its own error, not a watchdog's "no result"."""
    start = time.time()
    result = serve_dp.serve(fake_job(ranks=2, environ=[("DEEPINFER_KERNELS", "bogus")], timeout_s=60.0))
    assert time.time() - start < 45  # nothing waits for the deadline
    assert not result.gathered and any("could not join the process group" in n for n in result.notes)
    for rec in result.records:
        assert not rec.ok and rec.error["type"] == "ConfigError", rec.error
        assert "DEEPINFER_KERNELS='bogus'" in rec.error["message"]


@pytest.mark.parametrize("timeout_s", [0.0, float("inf"), float("nan")])
def test_dp_job_timeout_must_be_finite_and_positive(timeout_s):
    with pytest.raises(ValueError, match="^timeout_s: expected a number of seconds"):
        fake_job(timeout_s=timeout_s)


def fake_oracle(salt=0):
    return [(fake_tokens(list(p), 5, salt), np.eye(VOCAB, dtype=np.float32)[fake_tokens(list(p), 5, salt)])
            for p in PROMPTS + (CONTROL,)]


# ------------------------------------------------------------------------------- report building

def synthetic_result(ranks=4, wrong_prompt=None, backends=None, fallbacks=None, tilelang_missing=None) -> DPResult:
    records = []
    for r in range(ranks):
        rec = RankRecord(rank=r, device="cpu", ok=True, stage="done", backend=(backends or {}).get(r, "triton"),
                         backend_reason="auto: TileLang missing (x)", op_fallbacks=(fallbacks or {}).get(r, {}),
                         tilelang_missing=tilelang_missing,
                         prompt_indices=serve_dp.round_robin(len(PROMPTS), ranks)[r], generated_tokens=10,
                         serve_seconds=2.0, tokens_per_s=5.0)
        for rid, prompt in [(CONTROL_REQUEST_ID, CONTROL)] + [(prompt_request_id(i), PROMPTS[i]) for i in rec.prompt_indices]:
            ids = fake_tokens(list(prompt), 5)
            logits = np.eye(VOCAB, dtype=np.float32)[ids]
            if rid == prompt_request_id(wrong_prompt if wrong_prompt is not None else -1):
                ids = ids[:2] + [(ids[2] + 1) % VOCAB] + ids[3:]
                logits = logits.copy()
                logits[2] += 0.25
                logits[3:] += 100.0  # after the divergence: not comparable, must not count
            rec.completions[rid] = {"output_ids": ids, "step_logits": logits}
        records.append(rec)
    return DPResult(records, "gloo", "CPU ranks", True, [], 3.0)


def test_oracle_agreement_counts_only_comparable_steps():
    a = e2e_report.oracle_agreement([1, 2, 3, 4], np.array([[0.0], [0.5], [0.1], [99.0]]),
                                    [1, 2, 9, 4], np.zeros((4, 1)))
    assert a == {"tokens_equal": False, "shared_prefix": 2, "steps": 4, "max_logits_diff": 0.5}
    b = e2e_report.oracle_agreement([7, 7], np.ones((2, 3)), [7, 7], np.ones((2, 3)) * 1.5)
    assert b["tokens_equal"] and b["shared_prefix"] == 2 and b["max_logits_diff"] == 0.5


def test_evaluate_run_fp32_mismatch_fails_bf16_only_reports():
    prompts = [list(p) for p in PROMPTS]
    good = e2e_report.evaluate_run("x", {}, synthetic_result(), prompts, fake_oracle(), True, str)
    assert good["ok"] and good["failures"] == [] and good["backend_summary"] == "triton x4"
    assert good["control"]["agreeing"] == 4 and all(p["oracle"]["tokens_equal"] for p in good["prompts"])
    assert [p["rank"] for p in good["prompts"]] == [0, 1, 2, 3, 0, 1]

    bad = e2e_report.evaluate_run("x", {}, synthetic_result(wrong_prompt=5), prompts, fake_oracle(), True, str)
    assert not bad["ok"] and bad["failures"] == ["prompt 5: tokens differ from the oracle after 2 of 5"]
    assert bad["prompts"][5]["oracle"]["max_logits_diff"] == pytest.approx(0.25)

    bf16 = e2e_report.evaluate_run("x", {}, synthetic_result(wrong_prompt=5), prompts, fake_oracle(), False, str)
    assert bf16["ok"] and bf16["prompts"][5]["oracle"]["shared_prefix"] == 2


def test_backend_fallbacks_and_control_disagreement():
    result = synthetic_result(backends={1: "tilelang", 2: "tilelang"}, fallbacks={0: {"rms_norm": 3}, 3: {"rms_norm": 1, "rope": 2}})
    result.records[3].completions[CONTROL_REQUEST_ID]["output_ids"] = [0, 0, 0, 0, 0]
    run = e2e_report.evaluate_run("x", {}, result, [list(p) for p in PROMPTS], fake_oracle(), True, str)
    assert run["backend_summary"] == "tilelang x2, triton x2"
    assert run["op_fallbacks"] == {"rms_norm": 4, "rope": 2}
    assert run["control"]["agreeing"] == 3 and "DP ranks agreeing on the control prompt: 3/4" in run["failures"]


def test_markdown_and_compare():
    prompts = [list(p) for p in PROMPTS]
    a = e2e_report.evaluate_run("TileLang blocked", {}, synthetic_result(tilelang_missing="No module named 'tilelang'"),
                                prompts, fake_oracle(), True,
                                lambda ids: "a|b\n" + str(ids[:1]))
    b = e2e_report.evaluate_run("TileLang present", {}, synthetic_result(wrong_prompt=1), prompts, fake_oracle(), True,
                                lambda ids: "x")
    report = {"exit_code": 1, "failures": a["failures"] + b["failures"], "runs": [a, b], "json_path": "/tmp/r.json",
              "compare": e2e_report.compare_runs(a, b, required=False),
              "settings": {"ranks": 4, "dtype": "float32", "kv_cache": "auto", "device": "cpu",
                           "sampling": e2e_report.sampling_settings(e2e_report.SamplingParams(), len(PROMPTS))}}
    cmp_rows = report["compare"]["prompts"]
    assert [c["shared_prefix"] for c in cmp_rows] == [5, 2, 5, 5, 5, 5]
    assert [c["tokens_equal"] for c in cmp_rows] == [True, False, True, True, True, True]
    md = e2e_report.render_markdown(report)
    assert "| | TileLang blocked | TileLang present |" in md
    assert "| exit code | 1 | 1 |" in md
    assert "| sparse MLA backend per rank | triton x4 | triton x4 |" in md
    assert "| ranks whose auto backend fell back to triton (TileLang missing) | 4 | 0 |" in md
    assert "| DP ranks agreeing (control prompt) | 4/4 | 4/4 |" in md
    assert "| kernels served by the default backend (op fallbacks) | none | none |" in md
    assert "| tokens/s per rank | r0 5, r1 5, r2 5, r3 5 | r0 5, r1 5, r2 5, r3 5 |" in md
    assert "a\\|b\\n" in md  # decoded text is escaped, one table row per prompt
    row1 = next(line for line in md.splitlines() if line.startswith("| 1 | 1 |"))
    assert "DIFFERENT (2/5" in row1 and row1.endswith("| 2/5 |")
    assert "Failures:" in md and "- prompt 1: tokens differ from the oracle after 2 of 5" in md
    assert "| sampling | greedy | greedy |" in md
    assert "Token identity between the runs: reported, not required" in md and "Sampled decoding" not in md
    assert report["compare"]["failures"] == []
    assert md.rstrip().endswith("JSON: /tmp/r.json")
    required = e2e_report.compare_runs(a, b, required=True)
    assert required["failures"] == ["prompt 1: tokens differ between the runs"]
    assert e2e_report.compare_runs(a, a, required=True)["failures"] == []


def test_sampling_flags_are_validated_and_seeded_per_prompt(capsys):
    args = e2e_report.parse_args(["--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--seed", "7",
                                  "--prompts", "3"])
    assert args.sampling == e2e_report.SamplingParams(0.8, 5, 0.9, 7)
    assert serve_dp.request_sampling(args.sampling, 2).seed == 9
    assert e2e_report.sampling_settings(args.sampling, 3)["seeds"] == "prompt i: 7 + i; control prompt: 10"
    assert e2e_report.parse_args([]).sampling.greedy
    for argv, flag in ((["--temperature", "-1"], "--temperature"), (["--top-p", "0"], "--top-p"),
                       (["--top-k", "-2"], "--top-k"), (["--seed", str(2**63 - 2), "--prompts", "4"], "--seed")):
        with pytest.raises(SystemExit):
            e2e_report.parse_args(argv)
        assert f"error: {flag}: expected" in capsys.readouterr().err
    with pytest.raises(TypeError, match="sampling: expected a SamplingParams"):
        DPJob(FakeFactory(), PROMPTS, CONTROL, 5, sampling={"temperature": 0.8})
    for argv, message in ((["--top-k", "5"], "--top-k / --top-p / --seed: they apply to sampled decoding only"),
                          (["--seed", "3"], "add --temperature > 0"),
                          (["--timeout", "inf"], "--timeout: expected seconds in (0, 1e7)"),
                          (["--timeout", "nan"], "--timeout: expected seconds")):
        with pytest.raises(SystemExit):
            e2e_report.parse_args(argv)
        assert message in capsys.readouterr().err


def test_dpjob_refuses_a_bad_environ():
    """environ is applied in each rank before its record exists: a bad one is refused by DPJob, not left to
    crash every rank with the error on stderr only."""
    for environ in ((("DEEPINFER_FLAG", 1),), (("BAD=NAME", "1"),), (("", "1"),), {"DEEPINFER_FLAG": "1"},
                    (("DEEPINFER_FLAG", "a\0b"),)):
        with pytest.raises(ValueError, match="^environ: expected a tuple of"):
            DPJob(FakeFactory(), PROMPTS, CONTROL, 5, environ=environ)
    DPJob(FakeFactory(), PROMPTS, CONTROL, 5, environ=(("DEEPINFER_FLAG", "1"),))


def test_dpjob_refuses_forced_tokens_of_the_wrong_shape():
    for forced in (((1, 2, 3, 4, 5),), tuple((1, 2, 3, 4) for _ in PROMPTS)):
        with pytest.raises(ValueError, match=r"^forced: expected one tuple of max_new_tokens = 5 tokens per prompt"):
            DPJob(FakeFactory(), PROMPTS, CONTROL, 5, forced=forced)
    DPJob(FakeFactory(), PROMPTS, CONTROL, 5, forced=tuple((1, 2, 3, 4, 5) for _ in PROMPTS))


def test_short_answers_fail_every_mode():
    """The engine ignores EOS, so every answer has max_new_tokens tokens; a rank that returns fewer
    fails the run also where tokens are not compared with the oracle (bf16, sampled)."""
    result = synthetic_result()
    for rec in result.records:
        for done in rec.completions.values():
            done["output_ids"] = done["output_ids"][:1]
            done["step_logits"] = done["step_logits"][:1]
    run = e2e_report.evaluate_run("short", {}, result, [list(p) for p in PROMPTS], fake_oracle(), False, str)
    assert not run["ok"]
    assert "prompt 0: 1 tokens, expected 5" in run["failures"] and "control prompt: 1 tokens, expected 5" in run["failures"]


def test_launcher_script_passes_its_flags_to_the_report_not_to_the_setup(tmp_path):
    """h20_e2e_report.sh on a fresh machine sources python_env.sh, which takes the extras to install as
    its first argument: the report's flags must not become pip extras. Stubs stand in for python3
    (without torch) and the venv's python (records its arguments)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("h20_e2e_report.sh", "python_env.sh"):
        (repo / "scripts" / name).write_text((ROOT / "scripts" / name).read_text())
    calls = tmp_path / "calls.txt"
    venv_bin = repo / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    stub_bin = tmp_path / "bin"
    stub_bin.mkdir()
    (stub_bin / "python3").write_text("#!/bin/sh\nexit 1\n")  # a python3 without the project's packages
    for stub in (venv_bin / "python", stub_bin / "python3"):
        stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["PATH"] = f"{stub_bin}:{env['PATH']}"
    proc = subprocess.run(["bash", str(repo / "scripts" / "h20_e2e_report.sh"), "--prompts", "8"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = calls.read_text().splitlines()
    assert f"-m pip install -q -e {repo}[hf,interpreter]" in lines
    assert lines[-1] == "scripts/e2e_report.py --prompts 8"


def test_sampled_compare_report_agrees_token_by_token(tmp_path, monkeypatch, capsys):
    """Issue 7's sampled compare at CI scale: DEEPINFER_SPARSE_MLA_BACKEND pinned, so the runs may
    differ only in the sampler's backend and must agree token by token (the comparison is required);
    NextN drafts and rejection sampling at temperature 0.8 / top-p 0.9; 2 ranks, 2 prompts, 3 tokens."""
    for name, value in (("DEEPINFER_SPARSE_MLA_BACKEND", "ref"), ("DEEPINFER_KERNELS", "ref"),
                        ("DEEPINFER_OPS_STRICT", "1"), ("DEEPINFER_USE_NEXTN_DECODE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DEEPINFER_SIMULATE_NO_TILELANG", raising=False)
    out = tmp_path / "sampled.json"
    code = e2e_report.main(["--ranks", "2", "--prompts", "2", "--max-new-tokens", "3", "--compare", "--temperature",
                            "0.8", "--top-p", "0.9", "--seed", "1", "--json", str(out), "--timeout", "300"])
    stdout = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert code == 0 and report["ok"], report["failures"]
    assert report["settings"]["sampling"] == {"temperature": 0.8, "top_k": 0, "top_p": 0.9, "seed": 1, "greedy": False,
                                              "seeds": "prompt i: 1 + i; control prompt: 3"}
    cmp = report["compare"]
    assert cmp["required"] and cmp["failures"] == []
    assert all(p["tokens_equal"] and p["steps"] == 3 for p in cmp["prompts"]) and cmp["control"]["tokens_equal"]
    for run in report["runs"]:
        assert run["ok"] and run["control"]["agreeing"] == 2
        assert run["sampling_backend"] == "ref x2" and run["nextn"]["enabled"] and run["nextn"]["drafted"] > 0
    oracle = [p["output_ids"] for p in report["oracle"]["prompts"]] + [report["oracle"]["control"]["output_ids"]]
    answers = [p["output_ids"] for p in report["runs"][0]["prompts"]] + [report["runs"][0]["control"]["output_ids"]]
    assert answers != oracle, "temperature 0.8 must sample (fixed seeds: a fixed outcome)"
    assert "| sampling | temperature 0.8, top-k off, top-p 0.9; seeds prompt i: 1 + i; control prompt: 3; " \
           "sampler ref x2 |" in stdout
    assert "Token identity between the runs: required" in stdout and "Sampled decoding: the oracle is greedy" in stdout


def _bf16_report(tmp_path, name, monkeypatch, capsys):
    monkeypatch.setenv("DEEPINFER_SIMULATE_NO_TILELANG", "1")  # the CI default: Triton under its interpreter
    monkeypatch.setenv("DEEPINFER_KERNELS", "ref")
    monkeypatch.setenv("DEEPINFER_OPS_STRICT", "1")
    for var in ("DEEPINFER_SPARSE_MLA_BACKEND", "DEEPINFER_USE_NEXTN_DECODE"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / f"{name}.json"
    code = e2e_report.main(["--dtype", "bfloat16", "--ranks", "1", "--prompts", "1", "--max-new-tokens", "3",
                            "--json", str(out), "--timeout", "300"])
    return code, json.loads(out.read_text()), capsys.readouterr().out


def test_bf16_gate_passes_the_shipped_kernels_and_fails_a_sink_applied_twice(tmp_path, monkeypatch, capsys):
    """Issue 34: the bf16 report's gate at CI scale (1 rank, 1 prompt, 3 tokens; the Triton kernel under
    its interpreter). The engine's teacher-forced logits against the float32 oracle stay within 2x
    transformers' bf16 floor with the shipped kernels; with the sink applied twice in every launch
    (tests/broken_kernels.py, installed in the rank) the gate fails the report, and nothing else does."""
    import functools

    import broken_kernels

    code, report, stdout = _bf16_report(tmp_path, "shipped", monkeypatch, capsys)
    assert code == 0 and report["ok"], report["failures"]
    refs = report["bf16_gate"]
    assert refs["factor"] == e2e_report.GATE_FACTOR == 2.0 and "float32" in refs["oracle"]
    (ref_prompt,) = refs["prompts"]
    assert len(ref_prompt["output_ids"]) == 3 and ref_prompt["floor"]["max"] > 0
    (run,) = report["runs"]
    gate = run["bf16_gate"]
    assert gate["ok"] and gate["failures"] == [] and run["backend_summary"] == "triton x1"
    (row,) = gate["prompts"]
    assert row["floor"] == ref_prompt["floor"] and row["steps"] == 3 and 0 <= row["argmax_agreeing_steps"] <= 3
    assert gate["pooled"]["floor"] == refs["floor_pooled"]
    assert all(0 < r <= 2.0 for r in gate["pooled"]["ratio"].values())
    assert "| bf16 gate: teacher-forced logits vs the float32 oracle, engine / transformers' bf16 floor | pass: max" \
        in stdout and "bf16 gate (as configured): engine / floor" in stdout

    monkeypatch.setattr(e2e_report.serve_dp, "EngineFactory",
                        functools.partial(broken_kernels.BrokenKernelEngineFactory, breakage="sink_applied_twice"))
    code, report, stdout = _bf16_report(tmp_path, "broken", monkeypatch, capsys)
    (run,) = report["runs"]
    assert code == 1 and not report["ok"] and not run["bf16_gate"]["ok"]
    assert run["control"]["agreeing"] == 1 and run["ranks"][0]["ok"]
    assert [f for f in report["failures"] if "bf16 gate" not in f] == []
    assert max(run["bf16_gate"]["pooled"]["ratio"].values()) > 2.0
    assert "| bf16 gate: teacher-forced logits vs the float32 oracle, engine / transformers' bf16 floor | FAIL:" in stdout
