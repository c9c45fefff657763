"""The engine's decode step on one GPU, one rank: wall time against the GPU time of the kernels it
launches, eager and CUDA-graph replay, and tokens/s; optionally the same for another checkout.

Per batch B (--batches, default 1, 8, 16, 64, 128) and mode (eager: Engine(cuda_graphs=False); graph:
cuda_graphs=True; a checkout whose Engine has no cuda_graphs argument runs its one, eager, path): an Engine
on the tiny checkpoint (engine.model.tiny, that checkout's own), bf16, fp8 KV cache, max_batch_size B,
gets B requests of --prompt-tokens (150) tokens and --new-tokens (17) new tokens: one prefill of all of
them, then N - 1 decode steps of batch B. After a warm-up (compiles, graph captures) of the same calls:
  wall    the engine's decode step as stats() times it (Engine._decode: metadata, the copy, the forward or
          the replay, sampling, bookkeeping, ending with the tokens on the host), median of --repeats
          generate calls: decode_seconds / decode_steps;
  gpu     the kernels (and copies) the decode steps run: torch.profiler's CUDA activities summed over
          generate(N) minus generate(1), per step; `launches` counts them;
  verdict GPU-bound when wall <= 1.5 x gpu.
tokens/s: a fresh engine (max_batch_size 16, max_seq_len 512) generates 16 requests as
scripts/nextn_gpu_check.py makes them (prompts of 150, 7, 1, 62, 300 tokens; --throughput-new-tokens 24):
the first call (compiles and captures included: stats' tokens_per_s, prefill + decode time) and a second.

Every measurement runs in a subprocess whose `engine` is the checkout's: this one, and with
--compare-tree PATH that one too (the lead passes the pre-change tree; the worker uses only its
Engine, Request, generate and stats). Prints the two tables; exit status 1 when a graph row is not
GPU-bound or a run failed.

    PYTHONPATH=. python3 scripts/engine_step_profile.py [--compare-tree /path/to/old] [--batches 1,8,16,64,128]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
GPU_BOUND = 1.5
THROUGHPUT_LENGTHS = [150, 7, 1, 62, 300]  # scripts/nextn_gpu_check.py's


# ----------------------------------------------------------------------------------------------
# worker: runs with the measured checkout's `engine` first on sys.path

def _requests(Request, lengths, new_tokens, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [Request(f"p{i}", torch.randint(2, 258, (n,), generator=g).tolist(), new_tokens)
            for i, n in enumerate(lengths)]


def _engine(Engine, checkpoint, graphs, **kwargs):
    import torch

    if graphs is not None:
        kwargs["cuda_graphs"] = graphs
    return Engine(checkpoint, device="cuda", dtype=torch.bfloat16, kv_cache_dtype="fp8", **kwargs)


def _device_us(prof) -> tuple[float, int]:
    """(sum of the durations of a torch.profiler run's device activities in us -- kernels, copies, sets --
    and their count), user annotations left out."""
    from torch.autograd import DeviceType

    total, count = 0.0, 0
    for event in prof.profiler.kineto_results.events():
        if event.device_type() == DeviceType.CUDA and not event.is_user_annotation():
            total += event.duration_ns() / 1e3
            count += 1
    return total, count


def _gpu_time(engine, requests, torch):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(requests)
        torch.cuda.synchronize()
    return _device_us(prof)


def measure_step(Engine, Request, checkpoint, graphs, batch, prompt_tokens, new_tokens, repeats) -> dict:
    import torch

    engine = _engine(Engine, checkpoint, graphs, max_batch_size=batch, max_seq_len=prompt_tokens + new_tokens + 8)
    full = _requests(Request, [prompt_tokens] * batch, new_tokens, seed=batch)
    prefill_only = _requests(Request, [prompt_tokens] * batch, 1, seed=batch)
    engine.generate(full)
    engine.generate(prefill_only)
    walls = []
    for _ in range(repeats):
        before = engine.stats()
        engine.generate(full)
        after = engine.stats()
        steps = after["decode_steps"] - before["decode_steps"]
        walls.append((after["decode_seconds"] - before["decode_seconds"]) / steps * 1e3)
    steps = new_tokens - 1
    gpu_full, n_full = _gpu_time(engine, full, torch)
    gpu_prefill, n_prefill = _gpu_time(engine, prefill_only, torch)
    stats = engine.stats()
    return {"batch": batch, "wall_ms": statistics.median(walls),
            "gpu_ms": (gpu_full - gpu_prefill) / steps / 1e3, "launches": (n_full - n_prefill) / steps,
            "decode_tokens_per_s": batch / (statistics.median(walls) / 1e3),
            "cuda_graphs": stats.get("cuda_graphs"), "sparse_mla_backend": stats.get("sparse_mla_backend")}


def measure_throughput(Engine, Request, checkpoint, graphs, new_tokens) -> dict:
    engine = _engine(Engine, checkpoint, graphs, max_batch_size=16, max_seq_len=512)
    requests = _requests(Request, [THROUGHPUT_LENGTHS[i % len(THROUGHPUT_LENGTHS)] for i in range(16)], new_tokens,
                         seed=11)
    engine.generate(requests)
    first = engine.stats()
    engine.generate(requests)
    second = engine.stats()
    seconds = lambda s: s["prefill_seconds"] + s["decode_seconds"]  # noqa: E731
    return {"first_tokens_per_s": first["tokens_per_s"],
            "second_tokens_per_s": (second["generated_tokens"] - first["generated_tokens"])
            / (seconds(second) - seconds(first)), "cuda_graphs": second.get("cuda_graphs")}


def worker(args) -> int:
    sys.path.insert(0, str(Path(args.tree).resolve()))
    from engine.model.tiny import default_checkpoint_dir
    from engine.runner import Engine, Request

    has_graphs = "cuda_graphs" in inspect.signature(Engine.__init__).parameters
    modes = [("eager", False), ("graph", True)] if has_graphs else [("eager", None)]
    checkpoint = default_checkpoint_dir()
    out = {"tree": str(args.tree), "steps": [], "throughput": [], "errors": []}
    for label, graphs in modes:
        for batch in args.batches:
            try:
                row = measure_step(Engine, Request, checkpoint, graphs, batch, args.prompt_tokens, args.new_tokens,
                                   args.repeats)
                out["steps"].append({"mode": label, **row})
            except Exception:
                out["errors"].append(f"{label} B={batch}: {traceback.format_exc()}")
        try:
            out["throughput"].append({"mode": label, **measure_throughput(Engine, Request, checkpoint, graphs,
                                                                          args.throughput_new_tokens)})
        except Exception:
            out["errors"].append(f"{label} throughput: {traceback.format_exc()}")
    Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


# ----------------------------------------------------------------------------------------------
# driver

def run_tree(tree: Path, label: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(HERE), "--worker", "--tree", str(tree), "--json", str(out),
               "--batches", ",".join(map(str, args.batches)), "--prompt-tokens", str(args.prompt_tokens),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
               "--throughput-new-tokens", str(args.throughput_new_tokens)]
        # the tree's engine first; the rest of PYTHONPATH (e.g. TileLang's bundle) stays, this checkout does not
        rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *rest]), PYTHONUNBUFFERED="1")
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env)
        print(f"[{label}] {tree}: worker exit {proc.returncode} after {time.perf_counter() - start:.0f} s",
              file=sys.stderr)
        if not out.exists():
            return {"tree": str(tree), "steps": [], "throughput": [],
                    "errors": [f"worker exit {proc.returncode}, no result"]}
        return json.loads(out.read_text())


def report(results: list[tuple[str, dict]]) -> bool:
    ok = True
    print("| tree | backend | mode | B | wall ms/step | GPU kernels ms/step | launches/step | wall / GPU | verdict | "
          "decode tokens/s | graphs captured / replays |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, res in results:
        for row in res["steps"]:
            ratio = row["wall_ms"] / row["gpu_ms"] if row["gpu_ms"] > 0 else float("inf")
            bound = ratio <= GPU_BOUND
            if row["mode"] == "graph" and not bound:
                ok = False
            graphs = row.get("cuda_graphs") or {}
            graph_cell = f"{graphs.get('captured', 0)} / {graphs.get('replays', 0)}" if graphs else "n/a"
            print(f"| {label} | {row.get('sparse_mla_backend')} | {row['mode']} | {row['batch']} | "
                  f"{row['wall_ms']:.3f} | {row['gpu_ms']:.3f} | {row['launches']:.0f} | {ratio:.2f} | "
                  f"{'GPU-bound' if bound else 'host-bound'} | {row['decode_tokens_per_s']:.0f} | {graph_cell} |")
    print()
    print("| tree | mode | tokens/s, 16 requests: first call (compiles and captures) | second call |")
    print("|---|---|---|---|")
    for label, res in results:
        for row in res["throughput"]:
            print(f"| {label} | {row['mode']} | {row['first_tokens_per_s']:.1f} | {row['second_tokens_per_s']:.1f} |")
    for label, res in results:
        for err in res["errors"]:
            ok = False
            print(f"\n[{label}] ERROR {err}")
    print(f"\nverdict: graph rows GPU-bound (wall <= {GPU_BOUND} x GPU time): {'yes' if ok else 'NO'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare-tree", type=Path, help="another checkout to measure the same way (eager)")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8, 16, 64, 128])
    parser.add_argument("--prompt-tokens", type=int, default=150)
    parser.add_argument("--new-tokens", type=int, default=17)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--throughput-new-tokens", type=int, default=24)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.new_tokens < 2:
        parser.error("--new-tokens: at least 2 (one decode step)")
    results = [("new", run_tree(HERE.parents[1], "new", args))]
    if args.compare_tree is not None:
        results.append(("old", run_tree(args.compare_tree.resolve(), "old", args)))
    return 0 if report(results) else 1


if __name__ == "__main__":
    sys.exit(main())
