"""Where the host's time of the engine's CUDA-graph decode step goes (one GPU, one rank, the tiny model).

Per batch B (--batches, default 1, 16, 64, 128): an Engine (bf16, fp8 KV cache, CUDA graphs) generates B
requests of 150-token prompts, 17 new tokens each, twice to warm up, then three times timed. Printed per
B: the decode step's wall time (stats' decode_seconds per step), the back-to-back replay time of its
graph (50 replays between two CUDA events: the GPU's time per step, the gaps between graph nodes
included) and the host time per step of each runner and runtime method (wall clock inside the method,
summed, per step; nested methods count in their callers too; `synchronize` is the wait for the step
read back). With --unpipelined the same runs again with each decode step read back before the next
is launched (Engine._decode_ids reads the step in flight first), for comparison. A GPU is required.

    PYTHONPATH=. python3 scripts/engine_host_profile.py [--batches 1,16,64,128] [--unpipelined]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from engine.model import decode_graphs, deepseek_v4
from engine.model.tiny import default_checkpoint_dir
from engine.runner import Engine, Request

RUNNER_METHODS = ("_decode", "_take_prepared", "_decode_ids", "_select", "_emitted_tokens", "_release_window_rows",
                  "_prepare_next_decode", "_collect", "_read_back", "_finish_in_flight")
seconds: dict[str, float] = collections.defaultdict(float)


def _timed(owner, name: str) -> None:
    real = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start

    setattr(owner, name, timed)


def _requests(batch: int) -> list[Request]:
    g = torch.Generator().manual_seed(batch)
    return [Request(f"p{i}", torch.randint(2, 258, (150,), generator=g).tolist(), 17) for i in range(batch)]


def profile(batch: int, label: str) -> None:
    engine = Engine(default_checkpoint_dir(), device="cuda", dtype=torch.bfloat16, kv_cache_dtype="fp8",
                    max_batch_size=batch, max_seq_len=200, cuda_graphs=True)
    for _ in range(2):
        engine.generate(_requests(batch))
    seconds.clear()
    before = engine.stats()
    for _ in range(3):
        engine.generate(_requests(batch))
    after = engine.stats()
    steps = after["decode_steps"] - before["decode_steps"]
    wall = (after["decode_seconds"] - before["decode_seconds"]) / steps * 1e3
    (graph,) = [g.graph for g in engine.runtime.graphs._graphs.values()]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(50):  # replays the last step again: it rewrites the same rows, the engine is not used after
        graph.replay()
    end.record()
    end.synchronize()
    parts = " ".join(f"{name} {total / steps * 1e3:.3f}" for name, total in
                     sorted(seconds.items(), key=lambda item: -item[1]))
    print(f"{label} B={batch}: wall {wall:.3f} ms/step, back-to-back replay {start.elapsed_time(end) / 50:.3f} "
          f"ms | host ms/step: {parts}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64,128")
    parser.add_argument("--unpipelined", action="store_true", help="also with each step read back before the next")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("engine_host_profile.py: a CUDA device is required")
    for name in RUNNER_METHODS:
        _timed(Engine, name)
    _timed(deepseek_v4.DeepseekV4Runtime, "decode")
    _timed(decode_graphs.DecodeGraphs, "run")
    _timed(torch.cuda.Event, "synchronize")
    batches = [int(b) for b in args.batches.split(",")]
    for batch in batches:
        profile(batch, "pipelined")
    if args.unpipelined:
        pipelined_ids = Engine._decode_ids

        def read_first(self, batch):
            self._collect()
            return pipelined_ids(self, batch)

        Engine._decode_ids = read_first
        for batch in batches:
            profile(batch, "unpipelined")


if __name__ == "__main__":
    main()
