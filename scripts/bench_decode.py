#!/usr/bin/env python3
"""Decode speed with the fp8 KV cache (GPU): the DeepSeek-V4-Flash decode step of one compressed layer.

Shapes: B in {1, 8, 64, 128}, s_q in {1, 2}, h_q 64, d 512, SWA window W = 128 rows (main cache,
topk 128) + E = 512 compressed rows (extra cache, etopk 512): 640 valid entries per query (--heads and
--extra change h_q and E, e.g. h_q 128 with 2048 entries, the shape of FlashMLA's published sparse fp8
decode figure: b 128, h_q 128, s_q 2, topk 2048, 410 TFLOP/s on an H800). Both
caches are paged MODEL1 fp8 (584 B/token). One step = 2 Triton gather_dequant launches (fp8 rows ->
one bf16 [B, W+E, 1, 512] buffer) + decode_attn_sparse (one kernel launch; with the split, plus the
merge). Each configuration runs without the split (S = 1) and with the automatic split; with the
TileLang backend also as the paged fp8 step (S = "p1", "pS": without / with the split):
decode_attn_sparse_paged_fp8, whose kernel reads the fp8 rows of both caches itself (one slot-id
launch + one kernel launch, + q copy and merge with the split; no buffer).

Columns (times: median of triton.testing.do_bench, L2 flushed before each run):
  gather / attn / kernel / step ms: the gathers; decode_attn_sparse; its kernel launch alone (same
    arguments, no index building or merge); gather + attn, called eagerly from Python. Paged rows:
    gather -, attn = step = decode_attn_sparse_paged_fp8, kernel = its kernel launch alone.
  graph ms: the same step captured once in a CUDA graph and replayed (what a serving loop that
    graph-captures its decode step pays: GPU time without Python and launch overhead).
  TFLOP/s: 2 * B * s_q * (W + E) * h_q * (512 + 512) / graph time (masked slots: none here).
  read GB/s: bytes the step actually reads / graph time: fp8 rows + slot ids (gather), bf16 rows +
    indices + q per program (kernel; q once per split chunk), partial outputs (merge); paged: fp8
    rows per query and CTA of 64 heads + slot ids + q.
  roofline ms: the binding bound of an ideal fused fp8 kernel, max(FLOP / bf16 GEMM rate, bytes /
    HBM bandwidth) with bytes = each request's W + E fp8 rows once + q + out; both rates measured in
    this run (torch bf16 8192^3 GEMM; device-to-device copy of 2 GiB, read + write).
  frac: roofline ms / graph ms (eager frac: roofline ms / step ms).
--pair-sweep (TileLang): instead, the paged fp8 kernel alone (graph replay) at s_q 1 and the largest
  batch, for 1 to 10 pairs of 64-entry blocks, with the rows read and with every entry masked by
  topk_length = 0 (the same work without row reads): the slopes are the cost of a pair with and
  without its loads, the intercepts the cost of a launch besides its pairs (docs/lab/decode.md).
Usage: python scripts/bench_decode.py [--backend triton|tilelang] [--batches 1,8,64,128] [--heads 64|128]
           [--extra 512]   (needs CUDA)
       python scripts/bench_decode.py --pair-sweep [--batches 128]   (needs CUDA and TileLang)
       python scripts/bench_decode.py --small   (tiny shapes on any device: checks this script)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import engine.h20_ops  # noqa: E402,F401
from ab_decode import Case, make_inputs  # noqa: E402
from engine.h20_ops.attention import dispatch  # noqa: E402
from engine.h20_ops.attention.entry import (PAGED_SPLIT_SMS_PER_PROGRAM, _choose_splits, decode_attn_sparse,  # noqa: E402
                                      decode_attn_sparse_paged_fp8)
from engine.h20_ops.kv_cache.fp8 import MODEL1, gather_dequant  # noqa: E402

D = 512
FP8_ROW_READ = 448 + 128 + 7  # bytes of one MODEL1 token a gather reads (NoPE, RoPE, 7 scales)


def timer(fn, device) -> float:
    """Median milliseconds."""
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def device_rates(device, small: bool) -> tuple[float, float]:
    """(HBM bytes/s from a device copy, bf16 GEMM FLOP/s), measured now."""
    n_bytes = (1 << 16) if small else (2 << 30)
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src), device)
    m = 256 if small else 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    gemm_ms = timer(lambda: a @ b, device)
    del src, dst, a, b
    return 2 * n_bytes / (copy_ms * 1e-3), 2 * m ** 3 / (gemm_ms * 1e-3)


def graphed(fn, device):
    """fn captured in one CUDA graph (warmed up on a side stream first, as torch requires); returns
    the replay callable, or None on CPU."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def record_launch(fn, entry="sparse_mla_fwd"):
    """Runs fn once; returns the (args, kwargs) of the one launch of dispatch.<entry> it made."""
    launches = []
    real = getattr(dispatch, entry)

    def recording(*args, **kwargs):
        launches.append((args, kwargs))
        return real(*args, **kwargs)

    setattr(dispatch, entry, recording)
    try:
        fn()
    finally:
        setattr(dispatch, entry, real)
    if len(launches) != 1:
        raise AssertionError(f"expected one kernel launch per decode call, got {len(launches)}")
    return launches[0]


def pair_sweep(device, batch: int) -> None:
    """The paged fp8 kernel at s_q 1: time vs pairs of blocks, rows read vs every entry masked."""
    print(f"paged fp8 kernel alone (graph replay), B {batch}, s_q 1, h_q 64, W 128 + E entries")
    print(f"{'entries':>8s} {'pairs':>5s} {'read ms':>8s} {'masked ms':>9s}")
    for topk, etopk in ((64, 64), (128, 128), (128, 256), (128, 512), (128, 1152)):
        extra = max(512, etopk)
        case = Case(f"b{batch}", batch, 1, 128, extra, topk, etopk, heads=64, sink=True)
        args, _, ((swa_cache, swa_slots), (comp_cache, comp_slots)) = make_inputs(case, seed=3, device=device,
                                                                                  empty_slots=False)
        times = []
        for masked in (False, True):
            zero = torch.zeros(batch, dtype=torch.int32, device=device) if masked else None
            call = {k: v for k, v in args.items() if k not in ("q", "indices", "kv_windows", "extra_kv_windows")}
            k_args, k_kwargs = record_launch(
                lambda: decode_attn_sparse_paged_fp8(args["q"], swa_cache, swa_slots, args["indices"], D ** -0.5,
                                                     extra_cache=comp_cache, extra_slots=comp_slots, num_splits=1,
                                                     **dict(call, topk_length=zero, extra_topk_length=zero)),
                "sparse_mla_paged_fp8_fwd")
            times.append(timer(graphed(lambda: dispatch.sparse_mla_paged_fp8_fwd(*k_args, **k_kwargs), device),
                               device))
        print(f"{topk + etopk:8d} {-(-(topk + etopk) // 128):5d} {times[0]:8.4f} {times[1]:9.4f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("triton", "tilelang", "ref"), default=None,
                        help="DEEPINFER_SPARSE_MLA_BACKEND for this run (default: the auto resolution)")
    parser.add_argument("--small", action="store_true", help="tiny shapes on any device (checks the script)")
    parser.add_argument("--batches", default="1,8,64,128", help="comma-separated batch sizes (default 1,8,64,128)")
    parser.add_argument("--pair-sweep", action="store_true",
                        help="only the paged fp8 kernel's time vs pairs, rows read vs masked (TileLang, CUDA)")
    parser.add_argument("--heads", type=int, choices=(64, 128), default=64, help="h_q (default 64)")
    parser.add_argument("--extra", type=int, default=512,
                        help="E: compressed entries per query besides the 128 window entries (default 512)")
    opts = parser.parse_args()
    try:
        batches = tuple(int(b) for b in opts.batches.split(","))
    except ValueError:
        parser.error(f"--batches: expected comma-separated integers, got {opts.batches!r}")
    if min(batches) < 1:
        parser.error(f"--batches: expected sizes >= 1, got {opts.batches!r}")
    if opts.extra < 1:
        parser.error(f"--extra: expected >= 1, got {opts.extra}")
    if opts.small and opts.extra != 512:
        parser.error("--small: runs W 32 + E 96 (no --extra)")
    if opts.pair_sweep and (opts.heads, opts.extra) != (64, 512):
        parser.error("--pair-sweep: runs at h_q 64 with its own entry counts (no --heads / --extra)")
    if not torch.cuda.is_available() and not opts.small:
        print("bench_decode.py needs a CUDA device (or --small)")
        return 2
    if opts.backend is not None:
        os.environ["DEEPINFER_SPARSE_MLA_BACKEND"] = opts.backend
    dispatch.reset_resolution_for_tests()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    heads = opts.heads
    width, extra = (32, 96) if opts.small else (128, opts.extra)
    batches = (1,) if opts.small else batches
    hbm, gemm = device_rates(device, opts.small)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; backend {dispatch.resolve_backend()}")
    print(f"measured: HBM copy {hbm / 1e9:.0f} GB/s (read+write), bf16 GEMM {gemm / 1e12:.1f} TFLOP/s")
    if opts.pair_sweep:
        if device.type != "cuda" or not dispatch.paged_fp8_supported():
            print("--pair-sweep needs CUDA and the TileLang backend (the paged fp8 kernel)")
            return 2
        pair_sweep(device, max(batches))
        return 0
    print(f"shape: h_q {heads}, d {D}, W {width} + E {extra} (all valid), fp8 {MODEL1.name} caches, block 64")
    header = (f"{'B':>4s} {'s_q':>3s} {'S':>3s} {'gather':>8s} {'attn':>8s} {'kernel':>8s} {'step':>8s} "
              f"{'graph':>8s} {'TFLOP/s':>8s} {'read GB/s':>9s} {'roofline':>8s} {'frac':>6s} {'eager':>6s} "
              f"{'bound':>7s}")
    print(header)
    print("-" * len(header))
    entries = width + extra
    paged = dispatch.paged_fp8_supported() and device.type == "cuda"

    def row(batch, s_q, label, gather_ms, attn_ms, kernel_ms, step_ms, graph_ms, flop, read, roofline_ms, bound):
        gather_col = f"{gather_ms:8.4f}" if gather_ms is not None else f"{'-':>8s}"
        print(f"{batch:4d} {s_q:3d} {label:>3s} {gather_col} {attn_ms:8.4f} {kernel_ms:8.4f} "
              f"{step_ms:8.4f} {graph_ms:8.4f} {flop / graph_ms / 1e9:8.1f} {read / graph_ms / 1e6:9.0f} "
              f"{roofline_ms:8.4f} {roofline_ms / graph_ms:6.1%} {roofline_ms / step_ms:6.1%} {bound:>7s}")

    for batch in batches:
        for s_q in (1, 2):
            case = Case(f"b{batch}", batch, s_q, width, extra, width, extra, heads=heads, sink=True)
            args, buf, caches = make_inputs(case, seed=batch * 10 + s_q, device=device, empty_slots=False)
            (swa_cache, swa_slots), (comp_cache, comp_slots) = caches
            n_rows = batch * s_q

            def gather():
                gather_dequant(swa_cache, swa_slots, buf[:, :width])
                gather_dequant(comp_cache, comp_slots, buf[:, width:])

            gather_ms = timer(gather, device)
            flop = 2 * n_rows * entries * heads * (D + D)
            ideal_bytes = batch * entries * (FP8_ROW_READ + 4) + n_rows * heads * D * 2 * 2
            roofline_ms = max(flop / gemm, ideal_bytes / hbm) * 1e3
            bound = "compute" if flop / gemm >= ideal_bytes / hbm else "memory"
            auto = _choose_splits(n_rows, heads, entries, device)
            for splits in sorted({1, auto}):
                call = dict(args)
                q, kv_windows, indices = call.pop("q"), call.pop("kv_windows"), call.pop("indices")

                def attn():
                    decode_attn_sparse(q, kv_windows, indices, D ** -0.5, num_splits=splits, **call)

                k_args, k_kwargs = record_launch(attn)
                kernel_ms = timer(lambda: dispatch.sparse_mla_fwd(*k_args, **k_kwargs), device)
                attn_ms = timer(attn, device)
                step_ms = timer(lambda: (gather(), attn()), device)
                replay = graphed(lambda: (gather(), attn()), device)
                graph_ms = timer(replay, device) if replay is not None else step_ms
                read = (batch * entries * (FP8_ROW_READ + 4)  # gather
                        + n_rows * entries * (4 + D * 2) * -(-heads // 64)  # kernel: indices + bf16 rows
                        + n_rows * splits * heads * D * 2  # kernel: q per chunk
                        + (n_rows * splits * heads * (D * 2 + 4) if splits > 1 else 0))  # merge
                row(batch, s_q, str(splits), gather_ms, attn_ms, kernel_ms, step_ms, graph_ms, flop, read,
                    roofline_ms, bound)
            if paged:
                for splits in sorted({1, _choose_splits(n_rows, heads, entries, device, PAGED_SPLIT_SMS_PER_PROGRAM)}):
                    call = {k: v for k, v in args.items() if k not in ("q", "indices", "kv_windows", "extra_kv_windows")}

                    def paged_step():
                        decode_attn_sparse_paged_fp8(args["q"], swa_cache, swa_slots, args["indices"], D ** -0.5,
                                                     extra_cache=comp_cache, extra_slots=comp_slots,
                                                     num_splits=splits, **call)

                    k_args, k_kwargs = record_launch(paged_step, "sparse_mla_paged_fp8_fwd")
                    kernel_ms = timer(lambda: dispatch.sparse_mla_paged_fp8_fwd(*k_args, **k_kwargs), device)
                    step_ms = timer(paged_step, device)
                    graph_ms = timer(graphed(paged_step, device), device)
                    read = (n_rows * entries * (FP8_ROW_READ + 4 + 4 + 8) * -(-heads // 64)  # fp8 row, index,
                            # slot table, slot id (per CTA of 64 heads)
                            + n_rows * splits * heads * D * 2  # q per chunk
                            + (n_rows * splits * heads * (D * 2 + 4) if splits > 1 else 0))  # merge
                    row(batch, s_q, f"p{splits}", None, step_ms, kernel_ms, step_ms, graph_ms, flop, read,
                        roofline_ms, bound)
    return 0


if __name__ == "__main__":
    sys.exit(main())
