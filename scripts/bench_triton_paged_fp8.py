"""Times the pure-Triton paged fp8 sparse MLA decode kernel (engine/h20_ops/attention/triton_paged_fp8.py) at
FlashMLA's decode configurations, for each launch configuration (block_k, num_warps, num_stages) and split
count, and prints one table. Self-contained (no FlashMLA import); a GPU is required.

Shapes (s_q 2, every entry valid):
  V4 (kv_cache.MODEL1, 584 B/token): B in {2, 64, 74, 128, 148, 256}; cache0 = the sliding window, topk 128
    over 256-token pages (each request's last 128 tokens); cache1 = the compressed cache, extra topk 512
    (h_q <= 64: V4-Flash and its tensor-parallel ranks) or 1024 (h_q 128), or --extra-topk, over 64-token
    pages (distinct random entries of the request's 16384). Any h_q (--heads 8 16 32: a rank's share).
  V3.2 (kv_cache.V32, 656 B/token): B 128, h_q 128, one cache, topk 2048 over 64-token pages.
Timing: the launch (and, with a split, the merge: engine/h20_ops/attention/merge.py `merge_splits`) captured
in a CUDA graph; each replay follows an L2 flush (a 256 MB write) and is timed alone by CUDA events; the
median of --reps replays. TFLOP/s by 2 * n * h_q * entries * (d_qk + 512).
Check: every variant's out and lse against the case's first variant (the comparator of engine.h20_ops.testing,
FlashMLA's decode tolerances; a split's stated floor); a mismatch prints `!` after its time and makes the exit
status 1.

  python scripts/bench_triton_paged_fp8.py                 # every shape, the default config list, splits 1/2/4/8
  python scripts/bench_triton_paged_fp8.py --configs 64,8,2 32,8,3 --splits 1 4 --batches 128
  python scripts/bench_triton_paged_fp8.py --heads 16 32 --configs 64,4,2 32,4,3 --no-v32   # few heads
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from engine.h20_ops import kv_cache  # noqa: E402
from engine.h20_ops import testing as T  # noqa: E402
from engine.h20_ops.attention import merge  # noqa: E402
from engine.h20_ops.attention import triton_paged_fp8 as tpf  # noqa: E402

DEFAULT_CONFIGS = ("64,8,2", "64,8,3", "32,8,2", "32,8,3", "32,8,4")
COMPRESSED_PER_REQUEST = 16384


def filled_cache(layout, num_blocks: int, block_size: int, gen) -> torch.Tensor:
    cache = kv_cache.new_fp8_kv_cache(layout, num_blocks, block_size, "cuda")
    n = num_blocks * block_size
    for first in range(0, n, 1 << 20):
        slots = torch.arange(first, min(n, first + (1 << 20)), device="cuda")
        rows = torch.randn(slots.numel(), 1, layout.d, generator=gen, device="cuda") * 0.1
        kv_cache.quantize_into_cache(cache, slots, rows.bfloat16())
    return cache


def random_distinct(gen, rows: int, pool: int, k: int) -> torch.Tensor:
    return torch.rand(rows, pool, generator=gen, device="cuda").argsort(dim=1)[:, :k].int()


def v4_case(batch: int, h_q: int, extra: int, s_q: int, gen):
    n = batch * s_q
    window, page0, page1 = 128, 256, 64
    cache0 = filled_cache(kv_cache.MODEL1, batch * 2, page0, gen)  # two 256-token pages per request
    first = torch.randint(0, 2 * page0 - window - s_q, (batch,), generator=gen, device="cuda")
    pos = first[:, None, None] + torch.arange(s_q, device="cuda")[None, :, None] + \
        torch.arange(window, device="cuda")[None, None, :]
    idx0 = (torch.arange(batch, device="cuda")[:, None, None] * 2 * page0 + pos).reshape(n, window).int()
    pages1 = COMPRESSED_PER_REQUEST // page1
    cache1 = filled_cache(kv_cache.MODEL1, batch * pages1, page1, gen)
    local = random_distinct(gen, n, COMPRESSED_PER_REQUEST, extra)
    request = torch.arange(n, device="cuda") // s_q
    idx1 = (request[:, None] * COMPRESSED_PER_REQUEST + local).int()
    q = (torch.randn(n, h_q, 512, generator=gen, device="cuda") * 0.1).bfloat16()
    lengths0 = torch.full((batch,), window, dtype=torch.int32, device="cuda")
    lengths1 = torch.full((batch,), extra, dtype=torch.int32, device="cuda")
    return dict(q=q, cache0=cache0, indices0=idx0, lengths0=lengths0, cache1=cache1, indices1=idx1,
                lengths1=lengths1), window + extra


def v32_case(batch: int, h_q: int, topk: int, s_q: int, gen):
    n = batch * s_q
    page = 64
    pages = COMPRESSED_PER_REQUEST // page
    cache0 = filled_cache(kv_cache.V32, batch * pages, page, gen)
    request = torch.arange(n, device="cuda") // s_q
    idx0 = (request[:, None] * COMPRESSED_PER_REQUEST + random_distinct(gen, n, COMPRESSED_PER_REQUEST, topk)).int()
    q = (torch.randn(n, h_q, 576, generator=gen, device="cuda") * 0.1).bfloat16()
    lengths0 = torch.full((batch,), topk, dtype=torch.int32, device="cuda")
    return dict(q=q, cache0=cache0, indices0=idx0, lengths0=lengths0), topk


def time_graph(fn, reps: int, flush: torch.Tensor) -> float:
    """Median ms of a CUDA-graph replay of fn, each after an L2 flush."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), help="block_k,num_warps,num_stages")
    parser.add_argument("--splits", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--batches", nargs="+", type=int, default=[2, 64, 74, 128, 148, 256])
    parser.add_argument("--heads", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--extra-topk", type=int, default=None,
                        help="V4's compressed top-k (default: 512 for h_q <= 64, 1024 for h_q 128)")
    parser.add_argument("--s-q", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--no-v32", action="store_true", help="skip the V3.2 shape")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_triton_paged_fp8.py: needs a CUDA GPU", file=sys.stderr)
        return 1
    configs = [tpf.PagedFp8DecodeConfig(*map(int, c.split(","))) for c in args.configs]
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    cases = []
    for h_q in args.heads:
        extra = args.extra_topk or (512 if h_q <= 64 else 1024)
        for b in args.batches:
            cases.append((f"V4 h{h_q} W128+E{extra}", b, h_q, lambda b=b, h=h_q, e=extra: v4_case(b, h, e, args.s_q, gen)))
    if not args.no_v32:
        cases.append(("V3.2 h128 topk2048", 128, 128, lambda: v32_case(128, 128, 2048, args.s_q, gen)))
    header = f"{'shape':<22}{'B':>5} {'config':>9} " + "".join(f"{'S=' + str(s) + ' ms':>11}" for s in args.splits) + \
        f"{'best ms':>10}{'TFLOP/s':>9}"
    print(header)
    print("-" * len(header))
    ok = True
    for name, b, h_q, build in cases:
        inputs, entries = build()
        first = None  # the case's first result: every other variant is checked against it
        q = inputs["q"]
        n, d_qk = q.shape[0], q.shape[2]
        flops = 2 * n * h_q * entries * (d_qk + 512)
        sm_scale = d_qk ** -0.5
        for config in configs:
            row = f"{name:<22}{b:>5} {config.block_k},{config.num_warps},{config.num_stages:<3}"
            best = float("inf")
            for splits in args.splits:
                def step(splits=splits, config=config):
                    out, lse = tpf.paged_fp8_decode(
                        q, inputs["cache0"], inputs["indices0"], inputs["lengths0"], s_q=args.s_q, sm_scale=sm_scale,
                        cache1=inputs.get("cache1"), indices1=inputs.get("indices1"),
                        lengths1=inputs.get("lengths1"), splits=splits, config=config)
                    if splits > 1:
                        out, lse = merge.merge_splits(out, lse, splits, None, q.dtype)
                    return out, lse
                try:
                    out, lse = step()
                    ms = time_graph(step, args.reps, flush)
                except Exception as e:  # a config that does not compile (shared memory): say so, go on
                    row += f"{'fail':>11}"
                    print(f"# {name} B {b} {config} S {splits}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                    continue
                mark = " "
                if first is None:
                    first = (out, lse)
                else:
                    try:
                        T.assert_close("out", out, first[0], T.out_tolerance(T.DECODE_OUT, out, split=True))
                        T.assert_close("lse", lse, first[1], T.DECODE_LSE)
                    except AssertionError as e:
                        mark, ok = "!", False
                        print(f"# {name} B {b} {config} S {splits}: MISMATCH {e}", file=sys.stderr)
                best = min(best, ms)
                row += f"{ms:>10.4f}{mark}"
            row += f"{best:>10.4f}{flops / best / 1e9:>9.1f}"
            print(row, flush=True)
        del inputs, first
        torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
