#!/usr/bin/env python3
"""Long-context check: the engine's bf16 decode along one long prompt, step by step, against the
engine's own float32 run through the attention oracle (DEEPINFER_SPARSE_MLA_BACKEND=ref).

Runs, each in a fresh spawned process (its own backend resolution and memory peak), one after another:
  reference          engine, float32, KV rows in float32, backend ref: greedy; its tokens T and logits L
  floor <cache>      engine, bfloat16, the cache, backend ref, teacher-forced along T
  <backend> <cache>  engine, bfloat16, the cache, the kernel backend (--backends), teacher-forced along T
  transformers       transformers' eager model, float32, teacher-forced along T, the prompt fed through
                     its own cache in pieces of --hf-chunk tokens (one eager forward over L tokens holds
                     [64 heads, L, L] float32 scores: ~1 TiB at 65536); --no-transformers skips it
for each cache of --kv-caches (fp8: MODEL1 rows, auto: rows in bf16). Teacher forcing makes every step
comparable: step k of every run sees the prompt and T[:k].

Per run: per-step max |logit - L[k]|, the shared greedy prefix (steps before the first whose argmax
differs from T[k]), the steps whose argmax equals T[k], the peak memory of its process (CUDA: the
allocator's peak; CPU: the process's max RSS), prefill and decode tokens/s.

Bounds (exit 1 past either): a kernel run's max over all steps and mean over all steps and logits of
|dlogit| are each at most --factor (2) times those of the floor run with the same cache (the same
bf16 model with the oracle attention: what bf16 itself costs, kernels aside); transformers' max
|dlogit| is at most --hf-bound (float32 against float32: summation order only).

Default lengths: on a GPU a 65500-token prompt and 64 steps (16375 ratio-4 entries, 511 ratio-128
entries, the 512th completed at step 36; 1021 window pages released); on the CPU (--device cpu) a
250-token prompt and 12 steps, which still releases a window page during decode (window 128, pages
of 64 rows), completes a ratio-128 entry during decode (step 6) and takes the ratio-4 entries past
the indexer's top-k of 64 (62 -> 65, from step 10). The report's "Trace" line gives these counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import multiprocessing  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import engine.h20_ops  # noqa: E402,F401  (sets TRITON_INTERPRET=1 on CPU-only machines before kernels load)
from engine import config  # noqa: E402

SCHEMA = "deepinfer-long-context-check/1"
DEFAULT_LENGTHS = {"cuda": (65500, 64), "cpu": (250, 12)}
DEFAULT_HF_CHUNK = {"cuda": 1024, "cpu": 64}
HF_BOUND = 1e-2
FACTOR = 2.0
BACKENDS = ("tilelang", "triton")
KV_CACHES = ("fp8", "auto")


def progress(message: str) -> None:
    print(f"[long-context {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def long_prompt(length: int, seed: int) -> list[int]:
    """Byte tokens (2 .. 257 in the tiny tokenizer), uniformly random, from a seeded generator."""
    return torch.randint(2, 258, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass(frozen=True)
class EngineBuilder:
    """Builds the engine of one run (picklable: it travels to the run's process)."""

    def __call__(self, checkpoint: str, device: torch.device, dtype: torch.dtype, kv_cache: str, max_seq_len: int):
        from engine.runner import Engine

        return Engine(checkpoint, device=device, dtype=dtype, kv_cache_dtype=kv_cache, max_batch_size=1,
                      max_seq_len=max_seq_len)


@dataclass(frozen=True)
class RunSpec:
    label: str
    kind: str  # "reference", "floor", "kernel", "transformers"
    dtype: str  # "float32" | "bfloat16"
    kv_cache: str  # engine runs: "auto" | "fp8"; transformers: "auto"
    backend: str | None  # DEEPINFER_SPARSE_MLA_BACKEND of the run's process; None: the environment's


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def run_one(spec: RunSpec, checkpoint: str, prompt: list[int], steps: int, forced: list[int] | None, device: str,
            hf_chunk: int, builder) -> dict:
    """One run in this (fresh) process: tokens, logits [steps, vocab] and its figures."""
    if spec.backend is not None:
        os.environ[config.SPARSE_MLA_BACKEND.name] = spec.backend
    dev = torch.device(device)
    dtype = getattr(torch, spec.dtype)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    start = time.perf_counter()
    out = {"backend": spec.backend}
    if spec.kind == "transformers":
        from engine.model.hf_oracle import hf_teacher_forced

        (logits,) = hf_teacher_forced(checkpoint, [prompt], [forced], dtype=dtype, device=dev, prefill_chunk=hf_chunk)
        tokens = list(forced)
        out.update(backend="eager", prefill_tokens_per_s=None, decode_tokens_per_s=None)
    else:
        from engine.h20_ops.attention import dispatch
        from engine.runner import Request

        engine = builder(checkpoint, dev, dtype, spec.kv_cache, len(prompt) + steps)
        (done,) = engine.generate([Request("long", prompt, steps, forced_output_ids=forced)])
        tokens, logits = done.output_ids, done.step_logits
        st = engine.stats()
        out.update(backend=dispatch.resolve_backend(), op_fallbacks=st["op_fallbacks"],
                   prefill_tokens_per_s=st["prefill_tokens"] / st["prefill_seconds"],
                   decode_tokens_per_s=st["decode_tokens_per_s"])
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    out.update(tokens=[int(t) for t in tokens], logits=logits.float().cpu().numpy(),
               seconds=time.perf_counter() - start, peak_memory_bytes=_peak_memory(dev))
    return out


def run_in_fresh_process(spec: RunSpec, *args) -> dict:
    """run_one in a new spawned process; an exception there comes back as {"error": ...}."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        try:
            return pool.submit(run_one, spec, *args).result()
        except Exception as exc:  # the run's own exception, or its process dying (BrokenProcessPool)
            return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}


# ---------------------------------------------------------------------------------------- comparison

def step_errors(logits: np.ndarray, reference: np.ndarray) -> dict:
    diff = np.abs(logits.astype(np.float64) - reference.astype(np.float64))
    return {"per_step_max": [float(x) for x in diff.max(axis=1)], "max": float(diff.max()), "mean": float(diff.mean())}


def greedy_agreement(logits: np.ndarray, tokens: list[int]) -> dict:
    """Teacher-forced along `tokens`: where the run's own argmax equals them. The shared prefix is
    what a free-running greedy decode of the run would share with them."""
    agree = logits.argmax(axis=1) == np.asarray(tokens)
    shared = int(np.argmin(agree)) if not agree.all() else len(tokens)
    return {"shared_greedy_prefix": shared, "argmax_agreeing_steps": int(agree.sum())}


def evaluate(runs: list[dict], factor: float, hf_bound: float) -> list[str]:
    """Fills each run's comparison with the reference and its verdict; returns the failures."""
    failures = [f"{r['label']}: {r['error']}" for r in runs if "error" in r]
    reference = next((r for r in runs if r["kind"] == "reference" and "error" not in r), None)
    if reference is None:
        return failures or ["reference: no result"]
    for r in runs:
        if "error" in r:
            continue
        r["vs_reference"] = {**step_errors(r["logits"], reference["logits"]),
                             **greedy_agreement(r["logits"], reference["tokens"])}
        if r["kind"] == "reference" and not np.isfinite(r["logits"]).all():
            failures.append("reference: non-finite logits")
    floors = {r["kv_cache"]: r for r in runs if r["kind"] == "floor" and "error" not in r}
    for r in runs:
        if "error" in r or r["kind"] not in ("kernel", "transformers"):
            continue
        v = r["vs_reference"]
        if r["kind"] == "transformers":
            r["bound"] = {"max": hf_bound}
            r["ok"] = v["max"] <= hf_bound
            if not r["ok"]:
                failures.append(f"{r['label']}: max |dlogit| {v['max']:.3g} vs the reference, bound {hf_bound:g}")
            continue
        floor = floors.get(r["kv_cache"])
        if floor is None:
            failures.append(f"{r['label']}: no floor run for the {r['kv_cache']} cache")
            r["ok"] = False
            continue
        f = floor["vs_reference"]
        r["bound"] = {"max": factor * f["max"], "mean": factor * f["mean"]}
        r["ratio"] = {k: v[k] / f[k] if f[k] > 0 else float("inf") for k in ("max", "mean")}
        r["ok"] = v["max"] <= r["bound"]["max"] and v["mean"] <= r["bound"]["mean"]
        if not r["ok"]:
            failures.append(f"{r['label']}: |dlogit| max {v['max']:.3g} / mean {v['mean']:.3g} vs the reference, "
                            f"past {factor:g}x the floor's {f['max']:.3g} / {f['mean']:.3g} "
                            f"(ratios {r['ratio']['max']:.2f} / {r['ratio']['mean']:.2f})")
    return failures


# ---------------------------------------------------------------------------------------- report

def _fmt(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def render_markdown(report: dict) -> str:
    s = report["settings"]
    t = s["trace"]
    runs = report["runs"]
    lines = [f"## Long-context check: tiny DeepSeek-V4, prompt {s['prompt_tokens']} tokens + {s['steps']} steps, "
             f"{s['device']}", "",
             "Reference: the engine in float32 through the attention oracle (backend ref), greedy; every other "
             "run teacher-forced along its tokens. Bounds: a kernel run's max and mean |dlogit| <= "
             f"{s['factor']:g}x its cache's floor run (bf16, backend ref); transformers' max <= {s['hf_bound']:g}.",
             "", f"Trace, step 0 -> last step: ratio-4 entries {t['csa_entries'][0]} -> {t['csa_entries'][1]} "
             f"(indexer top-k {t['index_topk']}), ratio-128 entries {t['hca_entries'][0]} -> {t['hca_entries'][1]}, "
             f"window pages released {t['window_pages_released'][0]} -> {t['window_pages_released'][1]}.", ""]
    table = ["| run | dtype | KV cache | backend | max dlogit | mean dlogit | bound (max / mean) | ratio to floor "
             "(max / mean) | shared greedy prefix | argmax agreeing steps | prefill tok/s | decode tok/s | "
             "peak memory | seconds | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if "error" in r:
            table.append(f"| {r['label']} | {r['dtype']} | {r['kv_cache']} | {r['backend'] or 'as configured'} | "
                         + " | ".join(["-"] * 10) + " | FAILED: " + r["error"].replace("|", "\\|")[:200] + " |")
            continue
        v = r["vs_reference"]
        bound = r.get("bound")
        bound_cell = "-" if bound is None else " / ".join(_fmt(bound.get(k)) for k in ("max", "mean") if k in bound)
        ratio = r.get("ratio")
        ratio_cell = "-" if ratio is None else f"{ratio['max']:.2f} / {ratio['mean']:.2f}"
        verdict = {True: "pass", False: "FAIL", None: "-"}[r.get("ok")]
        table.append(f"| {r['label']} | {r['dtype']} | {r['kv_cache']} | {r['backend']} | {_fmt(v['max'])} | "
                     f"{_fmt(v['mean'])} | {bound_cell} | {ratio_cell} | {v['shared_greedy_prefix']}/{s['steps']} | "
                     f"{v['argmax_agreeing_steps']}/{s['steps']} | {_fmt(r.get('prefill_tokens_per_s'), '.4g')} | "
                     f"{_fmt(r.get('decode_tokens_per_s'), '.4g')} | {_gib(r.get('peak_memory_bytes'))} | "
                     f"{r['seconds']:.1f} | {verdict} |")
    shown = [r for r in runs if "error" not in r and r["kind"] != "reference"]
    lines += ["Per-step max |dlogit| against the reference:", "",
              "| step | " + " | ".join(r["label"] for r in shown) + " |", "|---|" + "---|" * len(shown)]
    for k in range(s["steps"]):
        lines.append(f"| {k} | " + " | ".join(_fmt(r["vs_reference"]["per_step_max"][k]) for r in shown) + " |")
    lines += [""] + table
    if report["failures"]:
        lines += ["", "Failures:"] + [f"- {f}" for f in report["failures"]]
    lines += ["", f"exit code {report['exit_code']}; JSON: {report['json_path']}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- main

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (cuda:0) or cpu (default cuda when available)")
    ap.add_argument("--prompt-tokens", type=int, default=None,
                    help="prompt length (default 65500 on cuda, 250 on cpu)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps (default 64 on cuda, 16 on cpu)")
    ap.add_argument("--kv-caches", default=",".join(KV_CACHES),
                    help="comma-separated engine caches of the bf16 runs: fp8, auto (default both)")
    ap.add_argument("--backends", default="",
                    help="comma-separated sparse MLA backends of the kernel runs: tilelang, triton (default: one "
                         "run per cache with the environment's DEEPINFER_SPARSE_MLA_BACKEND, or auto)")
    ap.add_argument("--hf-chunk", type=int, default=None,
                    help="tokens per transformers prefill forward (default 1024 on cuda, 64 on cpu)")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers run")
    ap.add_argument("--factor", type=float, default=FACTOR,
                    help=f"kernel run bound: this times its floor run's max and mean |dlogit| (default {FACTOR:g})")
    ap.add_argument("--hf-bound", type=float, default=HF_BOUND,
                    help=f"transformers' max |dlogit| bound (default {HF_BOUND:g})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    ap.add_argument("--json", type=Path, default=None,
                    help="JSON output path (default ./e2e_out/long_context_<time>.json)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    default_len, default_steps = DEFAULT_LENGTHS[args.device]
    args.prompt_tokens = default_len if args.prompt_tokens is None else args.prompt_tokens
    args.steps = default_steps if args.steps is None else args.steps
    args.hf_chunk = DEFAULT_HF_CHUNK[args.device] if args.hf_chunk is None else args.hf_chunk
    for name in ("prompt_tokens", "steps", "hf_chunk"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    args.kv_caches = [c for c in args.kv_caches.split(",") if c]
    if not args.kv_caches or any(c not in KV_CACHES for c in args.kv_caches):
        ap.error(f"--kv-caches: expected a comma-separated subset of {', '.join(KV_CACHES)}, got {args.kv_caches}")
    args.backends = [b for b in args.backends.split(",") if b] or [None]
    if any(b is not None and b not in BACKENDS for b in args.backends):
        ap.error(f"--backends: expected a comma-separated subset of {', '.join(BACKENDS)}, got {args.backends}")
    if not (args.factor > 0 and args.hf_bound > 0):
        ap.error("--factor / --hf-bound: expected positive numbers")
    return args


def run_specs(args) -> list[RunSpec]:
    specs = [RunSpec("reference", "reference", "float32", "auto", "ref")]
    for cache in args.kv_caches:
        specs.append(RunSpec(f"floor {cache}", "floor", "bfloat16", cache, "ref"))
        specs += [RunSpec(f"{backend or 'kernels'} {cache}", "kernel", "bfloat16", cache, backend)
                  for backend in args.backends]
    if not args.no_transformers:
        specs.append(RunSpec("transformers", "transformers", "float32", "auto", None))
    return specs


def trace_coverage(checkpoint: str, prompt_tokens: int, steps: int) -> dict:
    """What the trace exercises, from the model's config: [at step 0, at the last step] of the ratio-4
    entries a query sees (the indexer keeps index_topk of them), the ratio-128 entries, and the window
    pages wholly older than the query's window (released). Step k's query sits at position
    prompt_tokens - 1 + k."""
    from transformers import DeepseekV4Config

    from engine.runner import PAGE_SIZE

    cfg = DeepseekV4Config.from_pretrained(checkpoint)
    rates = cfg.compress_rates
    first, last = prompt_tokens - 1, prompt_tokens - 2 + steps
    window = cfg.sliding_window

    def span(f):
        return [f(first), f(last)]

    return {"csa_entries": span(lambda p: (p + 1) // rates["compressed_sparse_attention"]),
            "index_topk": cfg.index_topk,
            "hca_entries": span(lambda p: (p + 1) // rates["heavily_compressed_attention"]),
            "window_pages_released": span(lambda p: max(0, p - window + 1) // PAGE_SIZE)}


def run_spec(spec: RunSpec, checkpoint: str, prompt: list[int], steps: int, forced: list[int] | None, device: str,
             hf_chunk: int, builder) -> dict:
    """One run in its own process, labelled with its spec."""
    result = run_in_fresh_process(spec, checkpoint, prompt, steps, forced, device, hf_chunk, builder)
    result.update(label=spec.label, kind=spec.kind, dtype=spec.dtype, kv_cache=spec.kv_cache)
    result.setdefault("backend", spec.backend)
    return result


def check(args, builder=EngineBuilder()) -> dict:
    """Every run, the comparison and the report dict (exit_code 0 or 1); its runs keep their logits
    [steps, vocab] (the JSON file leaves them out). builder(checkpoint, device, dtype, kv_cache,
    max_seq_len) builds each engine run's engine in its process (picklable)."""
    from engine.model.tiny import default_checkpoint_dir

    checkpoint = str(default_checkpoint_dir())
    prompt = long_prompt(args.prompt_tokens, args.seed)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    json_path = args.json or Path("e2e_out") / f"long_context_{time.strftime('%Y%m%d_%H%M%S')}.json"
    settings = {"device": device, "prompt_tokens": args.prompt_tokens, "steps": args.steps, "seed": args.seed,
                "kv_caches": args.kv_caches, "backends": args.backends, "hf_chunk": args.hf_chunk,
                "factor": args.factor, "hf_bound": args.hf_bound, "checkpoint": checkpoint,
                "trace": trace_coverage(checkpoint, args.prompt_tokens, args.steps),
                "environ": config.validate_all(), "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None}
    runs, forced = [], None
    for spec in run_specs(args):
        backend = "eager" if spec.kind == "transformers" else spec.backend or "as configured"
        progress(f"{spec.label}: {spec.dtype}, KV cache {spec.kv_cache}, backend {backend}")
        result = run_spec(spec, checkpoint, prompt, args.steps, forced, device, args.hf_chunk, builder)
        runs.append(result)
        if "error" in result:
            progress(f"{spec.label}: FAILED: {result['error']}")
            if spec.kind == "reference":
                break
            continue
        progress(f"{spec.label}: {result['seconds']:.1f} s, peak memory {_gib(result['peak_memory_bytes'])}")
        if spec.kind == "reference":
            forced = result["tokens"]
    failures = evaluate(runs, args.factor, args.hf_bound)
    report = {"schema": SCHEMA, "exit_code": 1 if failures else 0, "ok": not failures, "failures": failures,
              "json_path": str(json_path.resolve()), "settings": settings, "reference_tokens": forced, "runs": runs}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    without_logits = {**report, "runs": [{k: v for k, v in r.items() if k != "logits"} for r in runs]}
    json_path.write_text(json.dumps(without_logits, indent=2) + "\n")
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        config.validate_all()
    except config.ConfigError as exc:
        print(f"long_context_check: error: {exc}", file=sys.stderr)
        return 2
    report = check(args)
    print(render_markdown(report))
    progress(f"exit code {report['exit_code']}; JSON {report['json_path']}")
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
