"""A/B harness (GPU): the Triton sparse MLA prefill kernel vs the TileLang SM90 kernel, both vs the oracle.

Both backends run through the public entry point (engine.h20_ops.sparse_mla_prefill with
backend="triton" / "tilelang"; on an SM90 the triton backend runs the Gluon kernel), so each adapter's
lse convention (base 2) is part of what is compared. Inputs: engine.h20_ops.testing.prefill_case
(FlashMLA's distribution and traps: fillers of every kind, NaN / +-inf in unselected kv rows, lengths,
sinks +-inf, strided views). Judge: testing's one comparator at FlashMLA's prefill tolerances, each
kernel against the float32 oracle (testing.assert_matches_oracle) and the two kernels against each other
(the same bounds, the Triton result as reference). Prints a table, then ALL_MATCH or the failing cases;
exits 1 on any mismatch. Then times both kernels on the model shapes
(TFLOP/s = 2 * s_q * topk * h_q * (d_qk + d_v) / t).

  python scripts/ab_vendored.py [--no-bench]
Without TileLang, the Triton results are compared to the oracle only.
"""

import argparse
import sys

import torch

from engine.h20_ops import AttentionOutput, sparse_mla_prefill
from engine.h20_ops.attention.dispatch import prefill_kernel
from engine.h20_ops.backend_select import import_tilelang_module
from engine.h20_ops.testing import (LOG2E, PREFILL_OUT, PREFILL_STATS, assert_close, assert_matches_oracle,
                                    normal_inputs, out_tolerance, prefill_case)

DEVICE = "cuda"

CASES = {
    # name: prefill_case arguments (a tenth of each list fillers where topk <= s_kv)
    "prefill distinct top-k": dict(s_q=64, s_kv=2048, h_q=64, d_qk=512, topk=512, n_valid=460),
    "prefill duplicate top-k": dict(s_q=64, s_kv=2048, h_q=128, d_qk=576, topk=512, n_valid=460, distinct=False),
    "decode s_q=1": dict(s_q=1, s_kv=4096, h_q=64, d_qk=512, topk=512, n_valid=460),
    "odd s_q=7": dict(s_q=7, s_kv=2048, h_q=128, d_qk=512, topk=1024, n_valid=920),
    "short kv < topk": dict(s_q=32, s_kv=200, h_q=64, d_qk=576, topk=512),
    "with topk_length": dict(s_q=48, s_kv=2048, h_q=64, d_qk=512, topk=640, n_valid=576, topk_length=True),
    "with attn_sink": dict(s_q=48, s_kv=2048, h_q=128, d_qk=512, topk=512, n_valid=460, sink=True),
    "every trap": dict(s_q=300, s_kv=4096, h_q=128, d_qk=576, topk=2048, n_valid=1800, topk_length=True, sink=True,
                       all_invalid=True),
}


def verdict(check) -> str:
    """'ok' or the comparator's message."""
    try:
        check()
        return "ok"
    except AssertionError as exc:
        return str(exc).splitlines()[0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(a) & torch.isfinite(b)
    return (a.float() - b.float())[finite].abs().max().item() if finite.any() else 0.0


def run_ab(backends: list[str]) -> list[str]:
    failures = []
    header = f"{'case':24s} {'pair':20s} {'max|d out|':>11s} {'max|d lse|':>11s}  verdict"
    print(header)
    print("-" * len(header))
    for i, (name, args) in enumerate(CASES.items()):
        case = prefill_case(1234 + i, device=DEVICE, **args)
        ref = case.oracle()
        ref_pair = AttentionOutput(ref.out, ref.lse * LOG2E)
        results = {b: sparse_mla_prefill(case.q, case.kv, case.indices, case.sm_scale, backend=b, **case.kwargs())
                   for b in backends}
        rows = [(f"{b} vs oracle", res, ref_pair, lambda res=res: assert_matches_oracle(res, ref, decode=False))
                for b, res in results.items()]
        if len(results) == 2:
            a, b = results["tilelang"], results["triton"]

            def pair_check(a=a, b=b):
                assert_close("out", a.out, b.out, out_tolerance(PREFILL_OUT, a.out))
                assert_close("lse_log2", a.lse_log2, b.lse_log2, PREFILL_STATS)

            rows.insert(0, ("tilelang vs triton", a, b, pair_check))
        for pair, got, want, check in rows:
            result = verdict(check)
            print(f"{name:24s} {pair:20s} {max_diff(got.out, want.out):11.3e} "
                  f"{max_diff(got.lse_log2, want.lse_log2):11.3e}  {result}")
            if result != "ok":
                failures.append(f"{name}: {pair}: {result}")
        kernel = prefill_kernel(case.q, case.kv, "triton")
        print(f"{'':24s} (triton backend's kernel: {kernel.kernel}: {kernel.reason})")
    return failures


def time_ms(fn, iters=20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


BENCH = {
    # name: (s_q, s_kv, h_q, d_qk, topk, sink)
    "V4-Flash h64 d512 topk512": (4096, 8192, 64, 512, 512, True),
    "V4-Flash h64 d512 topk640": (4096, 8192, 64, 512, 640, True),
    "V4-Pro h128 d512 topk1024": (4096, 8192, 128, 512, 1024, True),
    "V3.2 h128 d576 topk2048": (4096, 8192, 128, 576, 2048, False),
}


def run_bench(backends: list[str]) -> None:
    print(f"\n{'shape (s_q 4096, s_kv 8192)':28s} " + " ".join(f"{b + ' ms':>12s} {b + ' TF/s':>14s}" for b in backends))
    for name, (s_q, s_kv, h_q, d_qk, topk, with_sink) in BENCH.items():
        g = torch.Generator(device="cuda").manual_seed(7)
        q = normal_inputs(g, s_q, h_q, d_qk, device="cuda").to(torch.bfloat16)
        kv = normal_inputs(g, s_kv, 1, d_qk, device="cuda").to(torch.bfloat16)
        idx = torch.argsort(torch.rand(s_q, s_kv, generator=g, device="cuda"), dim=1)[:, :topk].to(torch.int32)
        sink = torch.randn(h_q, generator=g, device="cuda") if with_sink else None
        flops = 2 * s_q * topk * h_q * (d_qk + 512)
        cells = []
        for b in backends:
            ms = time_ms(lambda: sparse_mla_prefill(q, kv, idx, d_qk**-0.5, attn_sink=sink, backend=b))
            cells.append(f"{ms:12.3f} {flops / ms / 1e9:14.1f}")
        print(f"{name:28s} " + " ".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-bench", action="store_true", help="skip the timing table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("ab_vendored.py needs a CUDA GPU", file=sys.stderr)
        return 2
    backends = ["triton"]
    try:
        import_tilelang_module("engine.h20_ops.attention.tilelang_sm90")
        backends.insert(0, "tilelang")
    except ModuleNotFoundError as exc:
        print(f"TileLang missing ({exc}): Triton vs the oracle only")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    failures = run_ab(backends)
    print()
    if failures:
        print("MISMATCH: " + "; ".join(failures))
    else:
        print("ALL_MATCH")
    if not args.no_bench:
        run_bench(backends)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
