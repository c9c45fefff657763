"""NextN (MTP) speculative decoding on the GPU: greedy tokens with NextN vs without, acceptance, speed.

For each case (dtype x KV cache x num_speculative_tokens) the embedded tiny checkpoint runs the same
prompts through the engine without NextN and with it (DEEPINFER_USE_NEXTN_DECODE=0 / 1; everything
else from the environment), and one Markdown table row shows: prompts whose tokens are equal, the
shortest shared prefix, the acceptance rate, decode steps and tokens/s of both runs. Exit status 1
when a float32 case with the float32 cache differs in any token (the contract: NextN changes speed,
never greedy tokens), or a case raises. bfloat16 rows are informational (a batch of k + 1 rows may
round differently), and so are fp8-cache rows: the verifier's fp32 summation order can move a stored
value across an e4m3 rounding boundary (one step), which moves later logits by ~1e-4 instead of
~1e-5, enough to part a close choice (docs/lab/e2e.md, "NextN with the fp8 cache").
The tiny checkpoint's NextN layer has random weights, so its acceptance rate is near 0: the rows
measure the verify/draft overhead, not a trained drafter's speed-up.

    PYTHONPATH=. python3 scripts/nextn_gpu_check.py [--device cuda] [--max-new-tokens 24] [--batch 16]

On a GPU with TileLang, the float32 cases need DEEPINFER_SPARSE_MLA_BACKEND=triton (the TileLang sparse
MLA kernels are bf16-only; a float32 Engine on tilelang stops at construction and the case is reported
as raised).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

from engine.model.tiny import default_checkpoint_dir
from engine.runner import Engine, Request

NEXTN_ENV = "DEEPINFER_USE_NEXTN_DECODE"


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def make_requests(batch: int, max_new_tokens: int) -> list[Request]:
    g = torch.Generator().manual_seed(11)
    lengths = [150, 7, 1, 62, 300]  # longer than the 128 window, short, one token, a page boundary
    return [Request(f"p{i}", torch.randint(2, 258, (lengths[i % len(lengths)],), generator=g).tolist(),
                    max_new_tokens) for i in range(batch)]


def run(checkpoint, device, dtype, kv, k, nextn: bool, requests) -> tuple[dict[str, list[int]], dict]:
    os.environ[NEXTN_ENV] = "1" if nextn else "0"
    engine = Engine(checkpoint, device=device, dtype=dtype, kv_cache_dtype=kv, max_batch_size=len(requests),
                    max_seq_len=512, num_speculative_tokens=k)
    engine.generate(requests[:1])  # warm-up (Triton compiles)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    completions = engine.generate(requests)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    stats = engine.stats()
    stats["wall_tokens_per_s"] = sum(len(c.output_ids) for c in completions) / seconds
    return {c.request_id: c.output_ids for c in completions}, stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    checkpoint = default_checkpoint_dir()
    requests = make_requests(args.batch, args.max_new_tokens)
    cases = [(torch.float32, "auto", 1), (torch.float32, "auto", 2), (torch.float32, "fp8", 1),
             (torch.bfloat16, "auto", 1), (torch.bfloat16, "fp8", 1)]
    failed = False
    print("| dtype | kv | k | equal | min prefix | acceptance | steps off / on | tokens/s off / on |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, kv, k in cases:
        name = str(dtype).removeprefix("torch.")
        try:
            off_tokens, off = run(checkpoint, args.device, dtype, kv, k, False, requests)
            on_tokens, on = run(checkpoint, args.device, dtype, kv, k, True, requests)
        except Exception:  # report the case, keep going, fail at the end
            traceback.print_exc()
            print(f"| {name} | {kv} | {k} | ERROR | | | | |")
            failed = True
            continue
        equal = sum(on_tokens[r] == off_tokens[r] for r in off_tokens)
        prefix = min(shared_prefix(on_tokens[r], off_tokens[r]) for r in off_tokens)
        if dtype == torch.float32 and kv != "fp8" and equal != len(off_tokens):
            failed = True
        rate = on["acceptance_rate"]
        print(f"| {name} | {kv} | {k} | {equal}/{len(off_tokens)} | {prefix} | "
              f"{'n/a' if rate is None else f'{rate:.3f}'} | {off['decode_steps']} / {on['decode_steps']} | "
              f"{off['wall_tokens_per_s']:.1f} / {on['wall_tokens_per_s']:.1f} |")
    print("FAIL" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
