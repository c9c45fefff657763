#!/usr/bin/env python3
"""End-to-end report: the embedded tiny DeepSeek-V4 served by N data-parallel ranks (engine.serve_dp),
checked against transformers' eager DeepseekV4ForCausalLM on the same weights (the oracle).

Stages (one progress line each on stderr): checkpoint, oracle, one DP serve per run (two with
--compare: TileLang blocked, then TileLang present), report. The DEEPINFER_* variables of the caller's
environment reach every rank unchanged; --compare overrides only DEEPINFER_SIMULATE_NO_TILELANG per run.
"Present" on a node without TileLang shows what auto resolution does there (triton), as it is.

Sampling (--temperature > 0, with --top-k, --top-p, --seed): every prompt samples, prompt i with seed
seed + i, the control prompt with seed + prompts on every rank. The oracle stays greedy, so sampled
answers are not compared with it token by token: the report shows the shared prefix and the max
logits difference over the steps whose context both share, and fails on neither.

Prints a Markdown table (stdout) and writes the same content as JSON (schema in docs/e2e.md).
Exit code 1 when anything failed: a rank failure, a missing completion, a ModuleNotFoundError in a
rank, DP ranks disagreeing on the control prompt, (float32 greedy only) tokens differing from the
oracle, (bfloat16) the bf16 gate failing, or (--compare with DEEPINFER_SPARSE_MLA_BACKEND
set: the runs then differ only in the sampler's backend) tokens differing between the two runs.
bfloat16 runs report the shared-prefix length and max logits difference against the (bf16) oracle,
not required to agree.

The bf16 gate (bfloat16 runs): transformers in float32 decodes every prompt greedily (the float32
oracle); every rank runs its share once more teacher-forced along those tokens; the engine's max and
mean |logit - float32 oracle logit| over all prompts, steps and logits must each be at most
GATE_FACTOR times the floor: the same figures of transformers' own bf16 forward, teacher-forced
along the same tokens, storing what the engine's cache stores (--kv-cache fp8: the fp8 round trip).
Per-prompt figures are reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# transformers' per-checkpoint "Loading weights" bars (parent and every rank) would drown the progress lines.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import engine.h20_ops  # noqa: E402,F401  (sets TRITON_INTERPRET=1 on CPU-only machines before kernels load)
from engine import config, serve_dp  # noqa: E402
from engine.runner import DEFAULT_MAX_SEQ_LEN, SamplingParams  # noqa: E402

SCHEMA = "deepinfer-e2e-report/1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CONTROL_TEXT = "Control."
# Short prompts keep the CPU run (Triton under its interpreter, where prefill dominates) within minutes. The last one is longer than the 128-token sliding window, so one request
# exercises the window and both compressed caches (ratio 4 with the indexer, ratio 128).
PROMPT_TEXTS = (
    "The quick brown fox",
    "Hopper tensor cores",
    "def add(a, b):",
    "Once upon a time,",
    "1, 1, 2, 3, 5, 8,",
    "Bonjour !",
    "K = V: one vector per token.",
    "Sparse attention keeps a sliding window of recent tokens and a compressed summary of everything "
    "before them; this prompt is longer than the window.",
)
COMPARE_RUNS = (("TileLang blocked", {"DEEPINFER_SIMULATE_NO_TILELANG": "1"}),
                ("TileLang present", {"DEEPINFER_SIMULATE_NO_TILELANG": "0"}))


def progress(message: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def prompt_texts(count: int) -> list[str]:
    return [PROMPT_TEXTS[i] if i < len(PROMPT_TEXTS) else f"Prompt number {i}: {PROMPT_TEXTS[i % len(PROMPT_TEXTS)]}"
            for i in range(count)]


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def oracle_agreement(output_ids: list[int], step_logits: np.ndarray, oracle_ids: list[int],
                     oracle_logits: np.ndarray) -> dict:
    """Tokens equal, shared-prefix length, and the max |logit difference| over the steps whose context
    is the same in both (steps 0..shared_prefix: step k sees the first k generated tokens)."""
    shared = shared_prefix(output_ids, oracle_ids)
    steps = min(shared + 1, len(output_ids), len(oracle_ids))
    diff = float(np.max(np.abs(step_logits[:steps] - oracle_logits[:steps]))) if steps else None
    return {"tokens_equal": output_ids == oracle_ids, "shared_prefix": shared, "steps": len(oracle_ids),
            "max_logits_diff": diff}


def short_text(text: str, limit: int = 28) -> str:
    shown = repr(text)[1:-1]
    return shown if len(shown) <= limit else shown[: limit - 1] + "\u2026"


def backend_summary(ranks: list[dict]) -> str:
    """"triton x8", or "tilelang x6, triton x1, none x1" (none: the rank could not resolve one)."""
    counts = Counter(r["backend"] or "none" for r in ranks)
    return ", ".join(f"{name} x{n}" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def sampler_summary(ranks: list[dict]) -> str | None:
    """fused_sample's backend per rank ("triton x8"), None when no rank used it (greedy without NextN)."""
    stats = [r["engine_stats"] or {} for r in ranks]
    if not any("fused_sample_backend" in st for st in stats):
        return None
    return backend_summary([{"backend": st.get("fused_sample_backend")} for st in stats])


def nextn_summary(ranks: list[dict]) -> dict:
    """NextN (MTP) speculative decoding over the ranks, from each rank's Engine.stats()."""
    stats = [r["engine_stats"] or {} for r in ranks]
    if not any(st.get("nextn_decode") for st in stats):
        return {"enabled": False}
    accepted = sum(st.get("accepted_tokens") or 0 for st in stats)
    drafted = sum(st.get("draft_tokens") or 0 for st in stats)
    return {
        "enabled": True,
        "num_speculative_tokens": next(st.get("num_speculative_tokens") for st in stats if st.get("nextn_decode")),
        "accepted": accepted, "drafted": drafted, "acceptance_rate": accepted / drafted if drafted else None,
        "sampling_backend": backend_summary([{"backend": st.get("fused_sample_backend")} for st in stats]),
        "per_rank": [{"rank": r["rank"], "accepted": st.get("accepted_tokens"), "drafted": st.get("draft_tokens"),
                      "tokens_per_decode_step": st.get("tokens_per_decode_step")} for r, st in zip(ranks, stats)],
    }


def kernel_source_summary(ranks: list[dict]) -> dict:
    """engine.kernel_source per rank: where the ops came from ("hub x8"), the kernels loaded (repository,
    commit, variant, digest: one entry when every rank ran byte-identical kernels) and the hub ops that
    ran natively (fallbacks, summed)."""
    reports = [r["kernel_source"] or {"source": None} for r in ranks]
    fallbacks: Counter = Counter()
    for rep in reports:
        fallbacks.update(rep.get("fallbacks") or {})
    loaded = sorted({(rep["repo"], rep["commit"], rep["variant"], rep["digest"]) for rep in reports
                     if rep.get("digest")}, key=str)
    return {"summary": backend_summary([{"backend": rep.get("source")} for rep in reports]),
            "kernels": [{"repo": repo, "commit": commit, "variant": variant, "digest": digest}
                        for repo, commit, variant, digest in loaded],
            "fallbacks": dict(sorted(fallbacks.items()))}


def _kernel_source_cell(run: dict) -> str:
    ks = run["kernel_source"]
    kernels = "; ".join(f"{k['repo']}{' commit ' + k['commit'][:12] if k['commit'] else ''} {k['variant']} "
                        f"digest {k['digest'][:12]}" for k in ks["kernels"])
    return ks["summary"] + (f" ({kernels})" if kernels else "")


def _nextn_cell(run: dict) -> str:
    n = run["nextn"]
    if not n["enabled"]:
        return "off"
    rate = "n/a" if n["acceptance_rate"] is None else f"{n['acceptance_rate']:.3f}"
    return (f"on, k={n['num_speculative_tokens']}; acceptance {rate} ({n['accepted']}/{n['drafted']}); "
            f"sampling {n['sampling_backend']}")


def evaluate_run(label: str, environ: dict, result: serve_dp.DPResult, prompts: list[list[int]],
                 oracle: list[tuple[list[int], np.ndarray]], strict_oracle: bool, decode) -> dict:
    """The JSON of one DP serve: per-rank state, control agreement, per-prompt answers vs the oracle,
    and the failures that make the report exit nonzero. oracle[-1] is the control prompt's."""
    failures: list[str] = []
    ranks = []
    for rec in result.records:
        ranks.append({
            "rank": rec.rank, "device": rec.device, "ok": rec.ok, "stage": rec.stage, "error": rec.error,
            "backend": rec.backend, "backend_reason": rec.backend_reason, "tilelang_missing": rec.tilelang_missing,
            "module_not_found_failures": rec.module_not_found_failures, "op_fallbacks": rec.op_fallbacks,
            "kernel_source": rec.kernel_source,
            "prompt_indices": rec.prompt_indices, "generated_tokens": rec.generated_tokens,
            "serve_seconds": rec.serve_seconds, "tokens_per_s": rec.tokens_per_s, "engine_stats": rec.engine_stats,
        })
        if not rec.ok:
            err = rec.error or {"type": "?", "message": "failed without an error record"}
            failures.append(f"rank {rec.rank} failed at stage {rec.stage}: {err['type']}: {err['message']}")
    mnf = sum(r["module_not_found_failures"] for r in ranks)
    tilelang_fallbacks = sum(r["tilelang_missing"] is not None for r in ranks)  # auto chose triton: no TileLang
    if mnf:
        failures.append(f"{mnf} rank(s) hit a ModuleNotFoundError")
    fallbacks: Counter = Counter()
    for r in ranks:
        fallbacks.update(r["op_fallbacks"])
    kernel_source = kernel_source_summary(ranks)
    if len(kernel_source["kernels"]) > 1:
        failures.append(f"ranks loaded {len(kernel_source['kernels'])} different kernels (commit, digest)")

    agreeing, control_ids = serve_dp.control_agreement(result.records)
    n = len(result.records)
    if agreeing != n:
        failures.append(f"DP ranks agreeing on the control prompt: {agreeing}/{n}")
    control = {"agreeing": agreeing, "ranks": n, "output_ids": control_ids,
               "text": decode(control_ids) if control_ids is not None else None, "oracle": None}
    if control_ids is not None and len(control_ids) != len(oracle[-1][0]):
        failures.append(f"control prompt: {len(control_ids)} tokens, expected {len(oracle[-1][0])}")
    if control_ids is not None:
        holder = next(r for r in result.records
                      if r.completions.get(serve_dp.CONTROL_REQUEST_ID, {}).get("output_ids") == control_ids)
        control["oracle"] = oracle_agreement(control_ids, holder.completions[serve_dp.CONTROL_REQUEST_ID]["step_logits"],
                                             *oracle[-1])
        if strict_oracle and not control["oracle"]["tokens_equal"]:
            failures.append("control prompt: tokens differ from the oracle")

    owner = {i: r for r, share in enumerate(serve_dp.round_robin(len(prompts), n)) for i in share}
    prompt_rows = []
    for i, prompt in enumerate(prompts):
        rank = owner[i]
        done = result.records[rank].completions.get(serve_dp.prompt_request_id(i))
        row = {"index": i, "rank": rank, "prompt_tokens": len(prompt), "prompt_text": decode(prompt),
               "output_ids": None, "text": None, "oracle": None}
        if done is None:
            failures.append(f"prompt {i}: no completion (rank {rank})")
        else:
            row["output_ids"] = done["output_ids"]
            row["text"] = decode(done["output_ids"])
            if len(done["output_ids"]) != len(oracle[i][0]):  # the engine ignores EOS: always max_new_tokens
                failures.append(f"prompt {i}: {len(done['output_ids'])} tokens, expected {len(oracle[i][0])}")
            row["oracle"] = oracle_agreement(done["output_ids"], done["step_logits"], *oracle[i])
            if strict_oracle and not row["oracle"]["tokens_equal"]:
                failures.append(f"prompt {i}: tokens differ from the oracle after {row['oracle']['shared_prefix']} "
                                f"of {row['oracle']['steps']}")
        prompt_rows.append(row)

    return {
        "label": label, "environ": environ, "ok": not failures, "failures": failures, "nextn": nextn_summary(ranks),
        "sampling_backend": sampler_summary(ranks),
        "dist_backend": result.dist_backend, "dist_backend_reason": result.dist_backend_reason,
        "gathered": result.gathered, "notes": result.notes, "wall_seconds": result.wall_seconds,
        "backend_summary": backend_summary(ranks), "tilelang_fallbacks": tilelang_fallbacks,
        "module_not_found_failures": mnf,
        "op_fallbacks": dict(sorted(fallbacks.items())), "kernel_source": kernel_source, "control": control,
        "ranks": ranks, "prompts": prompt_rows,
    }


def compare_runs(a: dict, b: dict, required: bool) -> dict:
    """Per-prompt token identity between two runs' answers (and the control prompt's); `required`:
    any difference is a failure (the runs differ only in the sampler's backend)."""
    rows = []
    for pa, pb in zip(a["prompts"], b["prompts"]):
        if pa["output_ids"] is None or pb["output_ids"] is None:
            rows.append({"index": pa["index"], "shared_prefix": None, "tokens_equal": False,
                         "steps": len(pa["output_ids"] or pb["output_ids"] or [])})
        else:
            rows.append({"index": pa["index"], "shared_prefix": shared_prefix(pa["output_ids"], pb["output_ids"]),
                         "tokens_equal": pa["output_ids"] == pb["output_ids"], "steps": len(pa["output_ids"])})
    ca, cb = a["control"]["output_ids"], b["control"]["output_ids"]
    control = None if ca is None or cb is None else {"shared_prefix": shared_prefix(ca, cb), "tokens_equal": ca == cb,
                                                      "steps": len(ca)}
    failures = []
    if required:
        failures = [f"prompt {r['index']}: tokens differ between the runs" for r in rows if not r["tokens_equal"]]
        if control is None or not control["tokens_equal"]:
            failures.append("control prompt: tokens differ between the runs")
    return {"labels": [a["label"], b["label"]], "required": required, "prompts": rows, "control": control,
            "failures": failures}


def sampling_settings(sampling: SamplingParams, prompts: int) -> dict:
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            "seed": sampling.seed, "greedy": sampling.greedy,
            "seeds": f"prompt i: {sampling.seed} + i; control prompt: {sampling.seed + prompts}"}


def oracle_tokens_compared(settings: dict) -> bool:
    """Answers must equal the (greedy) oracle's token for token: float32 and greedy decoding."""
    return settings["dtype"] == "float32" and settings["sampling"]["greedy"]


# ---------------------------------------------------------------------------------------- bf16 gate

GATE_FACTOR = 2.0  # engine error / transformers' bf16 floor, over all prompts, for the max and the mean


def bf16_gate_applies(settings: dict) -> bool:
    return settings["dtype"] == "bfloat16"


def logit_error(logits: np.ndarray, reference: np.ndarray) -> dict:
    """max and mean |logits - reference| over all steps and the vocabulary."""
    diff = np.abs(logits.astype(np.float64) - reference.astype(np.float64))
    return {"max": float(diff.max()), "mean": float(diff.mean())}


def _ratios(error: dict, floor: dict) -> dict:
    return {k: error[k] / floor[k] if floor[k] > 0 else (0.0 if error[k] == 0 else math.inf) for k in ("max", "mean")}


def _pooled(errors: list[dict]) -> dict:
    """Over prompts of equal step counts: the largest max, the mean of the means."""
    return {"max": max(e["max"] for e in errors), "mean": float(np.mean([e["mean"] for e in errors]))}


def bf16_gate_references(checkpoint, prompts: list[list[int]], max_new_tokens: int, kv_cache: str,
                         device) -> dict:
    """The gate's references: the float32 oracle (transformers, greedy) and the floor (transformers
    in bfloat16, teacher-forced along the float32 tokens, its cache storing what the engine's does)."""
    from engine.model.hf_oracle import hf_greedy, hf_teacher_forced

    start = time.perf_counter()
    fp32 = hf_greedy(checkpoint, prompts, max_new_tokens, dtype=torch.float32, device=device)
    tokens = [ids for ids, _ in fp32]
    floor = hf_teacher_forced(checkpoint, prompts, tokens, dtype=torch.bfloat16, device=device, kv_cache=kv_cache)
    fp32_logits = [logits.float().numpy() for _, logits in fp32]
    floors = [logit_error(f.float().numpy(), ref) for f, ref in zip(floor, fp32_logits)]
    return {
        "tokens": tokens, "fp32_logits": fp32_logits,
        "json": {"factor": GATE_FACTOR, "oracle": "transformers DeepseekV4ForCausalLM (eager), float32, greedy",
                 "floor": "transformers bfloat16 teacher-forced along the oracle's tokens"
                          + (", its cache storing the fp8 round trip" if kv_cache == "fp8" else ""),
                 "device": str(device), "seconds": time.perf_counter() - start, "floor_pooled": _pooled(floors),
                 "prompts": [{"index": i, "output_ids": ids, "floor": f} for i, (ids, f) in enumerate(zip(tokens, floors))]},
    }


def evaluate_bf16_gate(result: serve_dp.DPResult, refs: dict) -> dict:
    """The engine's teacher-forced logits (each prompt's rank, forced pass) against the float32 oracle,
    per prompt and pooled over the prompts; the gate holds the pooled max and mean against GATE_FACTOR
    times the floor's. Per-prompt ratios are reported, not gated: the tiny random model amplifies
    rounding differences along the steps, and one late step of one prompt can move by several times
    the floor with correct kernels (docs/e2e.md, "The bf16 gate")."""
    n = len(result.records)
    owner = {i: r for r, share in enumerate(serve_dp.round_robin(len(refs["tokens"]), n)) for i in share}
    rows, failures = [], []
    for i, (ids, ref, floor_row) in enumerate(zip(refs["tokens"], refs["fp32_logits"], refs["json"]["prompts"])):
        logits = result.records[owner[i]].forced_logits.get(serve_dp.prompt_request_id(i))
        row = {"index": i, "rank": owner[i], "floor": floor_row["floor"], "engine": None, "ratio": None,
               "argmax_agreeing_steps": None, "steps": len(ids)}
        if logits is None or logits.shape != ref.shape:
            failures.append(f"bf16 gate: prompt {i}: no teacher-forced logits of shape {ref.shape} (rank {owner[i]})")
        else:
            row["engine"] = logit_error(logits, ref)
            row["ratio"] = _ratios(row["engine"], row["floor"])
            row["argmax_agreeing_steps"] = int(np.sum(logits.argmax(axis=-1) == np.asarray(ids)))
        rows.append(row)
    pooled = None
    if not failures:
        engine, floor = _pooled([r["engine"] for r in rows]), refs["json"]["floor_pooled"]
        pooled = {"engine": engine, "floor": floor, "ratio": _ratios(engine, floor)}
        if any(r > GATE_FACTOR for r in pooled["ratio"].values()):
            failures.append(f"bf16 gate: engine |dlogit| vs the float32 oracle, max {engine['max']:.3g} / mean "
                            f"{engine['mean']:.3g} over {len(rows)} prompts; transformers' bf16 floor "
                            f"{floor['max']:.3g} / {floor['mean']:.3g}; ratios {pooled['ratio']['max']:.2f} / "
                            f"{pooled['ratio']['mean']:.2f}, limit {GATE_FACTOR:g}")
    return {"factor": GATE_FACTOR, "ok": not failures, "pooled": pooled, "prompts": rows, "failures": failures}


def add_bf16_gate(run: dict, result: serve_dp.DPResult, refs: dict) -> None:
    run["bf16_gate"] = evaluate_bf16_gate(result, refs)
    run["failures"] += run["bf16_gate"]["failures"]
    run["ok"] = not run["failures"]


def _engine_vs_floor(engine: dict, floor: dict, ratio: dict) -> str:
    return (f"max {engine['max']:.3g} / {floor['max']:.3g} ({ratio['max']:.2f}x), "
            f"mean {engine['mean']:.3g} / {floor['mean']:.3g} ({ratio['mean']:.2f}x)")


def _gate_prompt_cell(row: dict) -> str:
    if row["engine"] is None:
        return "no logits"
    return (_engine_vs_floor(row["engine"], row["floor"], row["ratio"])
            + f"; argmax {row['argmax_agreeing_steps']}/{row['steps']}")


def _gate_summary_cell(run: dict) -> str:
    gate = run.get("bf16_gate")
    if gate is None:
        return "n/a (float32)"
    if gate["pooled"] is None:
        return "FAIL (missing logits)"
    p = gate["pooled"]
    return (f"{'pass' if gate['ok'] else 'FAIL'}: {_engine_vs_floor(p['engine'], p['floor'], p['ratio'])} "
            f"over {len(gate['prompts'])} prompts (limit {gate['factor']:g}x)")


# ---------------------------------------------------------------------------------------- Markdown

def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _fallbacks_cell(fallbacks: dict) -> str:
    return "none" if not fallbacks else ", ".join(f"{op} x{n}" for op, n in fallbacks.items())


def _tokens_per_s_cell(run: dict) -> str:
    return ", ".join(f"r{r['rank']} {r['tokens_per_s']:.3g}" if r["ok"] else f"r{r['rank']} failed"
                     for r in run["ranks"])


def _oracle_cell(agreement: dict | None, strict: bool) -> str:
    if agreement is None:
        return "no answer"
    steps = agreement["steps"]
    diff = agreement["max_logits_diff"]
    diff_text = "n/a" if diff is None else f"{diff:.2e}"
    if strict:
        verdict = "equal" if agreement["tokens_equal"] else "DIFFERENT"
        return f"{verdict} ({agreement['shared_prefix']}/{steps}; max dlogit {diff_text})"
    return f"shared {agreement['shared_prefix']}/{steps}; max dlogit {diff_text}"


def _sampling_cell(report: dict, run: dict) -> str:
    s = report["settings"]["sampling"]
    if s["greedy"]:
        return "greedy"
    top_k = "off" if s["top_k"] == 0 else s["top_k"]
    top_p = "off" if s["top_p"] == 1 else f"{s['top_p']:g}"
    return (f"temperature {s['temperature']:g}, top-k {top_k}, top-p {top_p}; seeds {s['seeds']}; "
            f"sampler {run['sampling_backend']}")


def _oracle_summary(run: dict, strict: bool) -> str:
    rows = [p["oracle"] for p in run["prompts"]]
    if strict:
        return f"{sum(1 for o in rows if o and o['tokens_equal'])}/{len(rows)} prompts tokens equal"
    prefixes = [o["shared_prefix"] for o in rows if o]
    return f"min shared prefix {min(prefixes) if prefixes else 'n/a'}; {len(prefixes)}/{len(rows)} answered"


def render_markdown(report: dict) -> str:
    runs = report["runs"]
    strict = oracle_tokens_compared(report["settings"])
    s = report["settings"]
    lines = [f"## End-to-end report: tiny DeepSeek-V4, {s['ranks']} DP ranks, {s['dtype']}, "
             f"KV cache {s['kv_cache']}, {s['device']}", ""]
    lines += ["| | " + " | ".join(_cell(r["label"]) for r in runs) + " |",
              "|---|" + "---|" * len(runs)]
    summary = [
        ("exit code", lambda r: report["exit_code"]),
        ("sampling", lambda r: _sampling_cell(report, r)),
        ("sparse MLA backend per rank", lambda r: r["backend_summary"]),
        ("ranks whose auto backend fell back to triton (TileLang missing)", lambda r: r["tilelang_fallbacks"]),
        ("ModuleNotFoundError failures", lambda r: r["module_not_found_failures"]),
        ("kernels served by the default backend (op fallbacks)", lambda r: _fallbacks_cell(r["op_fallbacks"])),
        ("kernel source per rank (DEEPINFER_KERNEL_SOURCE)", _kernel_source_cell),
        ("hub ops served natively (kernel source fallbacks)",
         lambda r: _fallbacks_cell(r["kernel_source"]["fallbacks"])),
        ("DP ranks agreeing (control prompt)", lambda r: f"{r['control']['agreeing']}/{r['control']['ranks']}"),
        ("control prompt vs oracle", lambda r: _oracle_cell(r["control"]["oracle"], strict)),
        ("answers vs oracle", lambda r: _oracle_summary(r, strict)),
        ("bf16 gate: teacher-forced logits vs the float32 oracle, engine / transformers' bf16 floor",
         _gate_summary_cell),
        ("tokens/s per rank", _tokens_per_s_cell),
        ("NextN speculative decoding (DEEPINFER_USE_NEXTN_DECODE)", _nextn_cell),
        ("process group", lambda r: r["dist_backend"]),
        ("run status", lambda r: "ok" if r["ok"] else f"FAILED ({len(r['failures'])})"),
    ]
    for name, get in summary:
        lines.append(f"| {name} | " + " | ".join(_cell(get(r)) for r in runs) + " |")

    gated = [r for r in runs if "bf16_gate" in r]
    lines += ["", "| prompt | rank | prompt text | " + " | ".join(
        f"answer ({_cell(r['label'])}) | vs oracle ({_cell(r['label'])})" for r in runs)
        + "".join(f" | bf16 gate ({_cell(r['label'])}): engine / floor" for r in gated)
        + (" | shared prefix between runs |" if report["compare"] else " |")]
    lines.append("|---|---|---|" + "---|---|" * len(runs) + "---|" * len(gated) + ("---|" if report["compare"] else ""))
    for i, base in enumerate(runs[0]["prompts"]):
        cells = [str(i), str(base["rank"]), _cell(short_text(base["prompt_text"]))]
        for r in runs:
            p = r["prompts"][i]
            cells += [_cell(short_text(p["text"])) if p["text"] is not None else "no answer",
                      _cell(_oracle_cell(p["oracle"], strict))]
        cells += [_cell(_gate_prompt_cell(r["bf16_gate"]["prompts"][i])) for r in gated]
        if report["compare"]:
            c = report["compare"]["prompts"][i]
            cells.append("n/a" if c["shared_prefix"] is None else f"{c['shared_prefix']}/{c['steps']}")
        lines.append("| " + " | ".join(cells) + " |")
    if report["compare"] and report["compare"]["control"]:
        c = report["compare"]["control"]
        lines += ["", f"Control prompt, shared prefix between runs: {c['shared_prefix']}/{c['steps']}"]
    if report["compare"]:
        lines += ["", "Token identity between the runs: " + (
            "required (DEEPINFER_SPARSE_MLA_BACKEND is pinned, so the runs differ only in the sampler's backend)"
            if report["compare"]["required"] else
            "reported, not required (the sparse MLA backend follows each run's TileLang availability)")]
    if not s["sampling"]["greedy"]:
        lines += ["", "Sampled decoding: the oracle is greedy, so answers are not compared with it token by token "
                  "(a difference fails nothing); 'vs oracle' gives the shared prefix with its greedy answer and "
                  "the max logits difference over the steps whose context both share."]
    if report["failures"]:
        lines += ["", "Failures:"] + [f"- {_cell(f)}" for f in report["failures"]]
    lines += ["", f"JSON: {report['json_path']}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- main

def parse_args(argv):
    has_cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8, help="data-parallel ranks (default 8)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts spread round-robin over the ranks (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per prompt (default 8)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16" if has_cuda else "float32",
                    help="engine and oracle dtype (default bfloat16 with a GPU, float32 without)")
    ap.add_argument("--kv-cache", choices=("auto", "fp8"), default="auto", help="engine KV cache dtype (default auto)")
    ap.add_argument("--json", type=Path, default=None,
                    help="JSON output path (default ./e2e_out/e2e_report_<time>.json)")
    ap.add_argument("--compare", action="store_true",
                    help="serve twice, TileLang blocked then present, and compare answers token by token")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds for one DP serve before its ranks are killed (default 900)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every prompt (default 0: greedy)")
    ap.add_argument("--top-k", type=int, default=0, help="top-k of every prompt (default 0: off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="top-p of every prompt (default 1: off)")
    ap.add_argument("--seed", type=int, default=0,
                    help="sampling seed: prompt i uses seed + i, the control prompt seed + prompts (default 0)")
    args = ap.parse_args(argv)
    try:
        args.sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
        serve_dp.request_sampling(args.sampling, args.prompts)  # the control prompt's seed is an int64 too
    except (TypeError, ValueError) as exc:
        ap.error(re.sub(r"SamplingParams\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(exc)))
    for name in ("ranks", "prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if not 0 < args.timeout < 1e7:  # DPJob's range (nan and inf included)
        ap.error(f"--timeout: expected seconds in (0, 1e7), got {args.timeout}")
    if args.temperature == 0 and (args.top_k, args.top_p, args.seed) != (0, 1.0, 0):
        ap.error("--top-k / --top-p / --seed: they apply to sampled decoding only; add --temperature > 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        env = config.validate_all()  # a bad DEEPINFER_* value stops here, before any rank starts
    except config.ConfigError as exc:
        print(f"e2e_report: error: {exc}", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = DTYPES[args.dtype]
    json_path = args.json or Path("e2e_out") / f"e2e_report_{time.strftime('%Y%m%d_%H%M%S')}.json"
    report = {
        "schema": SCHEMA, "exit_code": 1, "ok": False, "failures": [], "json_path": str(json_path.resolve()),
        "settings": {"ranks": args.ranks, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                     "dtype": args.dtype, "kv_cache": args.kv_cache, "device": device,
                     "gpus": torch.cuda.device_count() if device == "cuda" else 0, "compare": args.compare,
                     "timeout_s": args.timeout, "environ": env, "checkpoint": None,
                     "torch": torch.__version__, "sampling": sampling_settings(args.sampling, args.prompts)},
        "oracle": None, "bf16_gate": None, "runs": [], "compare": None,
    }
    stage = "checkpoint"
    try:
        from engine.model.hf_oracle import hf_greedy
        from engine.model.tiny import default_checkpoint_dir, load_tokenizer

        t0 = time.perf_counter()
        checkpoint = default_checkpoint_dir()
        report["settings"]["checkpoint"] = str(checkpoint)
        tokenizer = load_tokenizer(checkpoint)
        prompts = [tokenizer.encode(t) for t in prompt_texts(args.prompts)]
        control = tokenizer.encode(CONTROL_TEXT)
        longest = max(map(len, prompts + [control]))
        if longest + args.max_new_tokens > DEFAULT_MAX_SEQ_LEN:
            print(f"e2e_report: error: --max-new-tokens: the longest prompt ({longest} tokens) + {args.max_new_tokens} "
                  f"exceeds the engine's max_seq_len {DEFAULT_MAX_SEQ_LEN}", file=sys.stderr)
            return 2
        progress(f"checkpoint {checkpoint} ({time.perf_counter() - t0:.1f} s); {len(prompts)} prompts "
                 f"({min(map(len, prompts))}..{max(map(len, prompts))} tokens) + 1 control prompt")

        stage = "oracle"
        t0 = time.perf_counter()
        oracle_device = "cuda:0" if device == "cuda" else "cpu"
        oracle_raw = hf_greedy(checkpoint, prompts + [control], args.max_new_tokens, dtype=dtype, device=oracle_device)
        oracle = [(ids, logits.float().numpy()) for ids, logits in oracle_raw]
        report["oracle"] = {"model": "transformers DeepseekV4ForCausalLM (eager)", "dtype": args.dtype,
                            "device": oracle_device, "seconds": time.perf_counter() - t0,
                            "prompts": [{"index": i, "output_ids": ids, "text": tokenizer.decode(ids)}
                                        for i, (ids, _) in enumerate(oracle[:-1])],
                            "control": {"output_ids": oracle[-1][0], "text": tokenizer.decode(oracle[-1][0])}}
        progress(f"oracle: transformers eager, {args.dtype} on {oracle_device}, "
                 f"{len(oracle)} prompts x {args.max_new_tokens} tokens ({report['oracle']['seconds']:.1f} s)")

        gate_refs = None
        if bf16_gate_applies(report["settings"]):
            stage = "bf16 gate references"
            gate_refs = bf16_gate_references(checkpoint, prompts, args.max_new_tokens, args.kv_cache, oracle_device)
            report["bf16_gate"] = gate_refs["json"]
            progress(f"bf16 gate references: transformers float32 greedy + bfloat16 teacher-forced on {oracle_device} "
                     f"({gate_refs['json']['seconds']:.1f} s)")

        factory = serve_dp.EngineFactory(str(checkpoint), dtype, args.kv_cache)
        runs = COMPARE_RUNS if args.compare else (("as configured", {}),)
        for label, environ in runs:
            stage = f"serve ({label})"
            job = serve_dp.DPJob(factory, tuple(map(tuple, prompts)), tuple(control), args.max_new_tokens,
                                 ranks=args.ranks, device_type=device, timeout_s=args.timeout,
                                 environ=tuple(environ.items()), sampling=args.sampling,
                                 forced=None if gate_refs is None else tuple(map(tuple, gate_refs["tokens"])))
            progress(f"serve ({label}): {args.ranks} ranks on {device}, "
                     f"env {environ or 'as given'}, timeout {args.timeout:.0f} s")
            result = serve_dp.serve(job, progress=lambda m, label=label: progress(f"serve ({label}): {m}"))
            run = evaluate_run(label, environ, result, prompts, oracle, oracle_tokens_compared(report["settings"]),
                               tokenizer.decode)
            if gate_refs is not None:
                add_bf16_gate(run, result, gate_refs)
            report["runs"].append(run)
            progress(f"serve ({label}): {'ok' if run['ok'] else 'FAILED'} in {result.wall_seconds:.1f} s; "
                     f"backend {run['backend_summary']}; control {run['control']['agreeing']}/{args.ranks}")
        if args.compare:
            report["compare"] = compare_runs(*report["runs"], required=env[config.SPARSE_MLA_BACKEND.name] is not None)
            report["failures"] += [f"compare: {f}" for f in report["compare"]["failures"]]
    except Exception as exc:
        traceback.print_exc()
        report["failures"].append(f"{stage}: {type(exc).__name__}: {exc}")

    for run in report["runs"]:
        report["failures"] += [f"{run['label']}: {f}" for f in run["failures"]]
    report["ok"] = not report["failures"]
    report["exit_code"] = 0 if report["ok"] else 1
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    if report["runs"]:
        print(render_markdown(report))
    else:
        print("\n".join(["## End-to-end report: no run completed", ""] + [f"- {f}" for f in report["failures"]]
                        + ["", f"JSON: {report['json_path']}"]))
    progress(f"report: exit code {report['exit_code']}; JSON {report['json_path']}")
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
