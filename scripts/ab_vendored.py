"""A/B harness (GPU): the Triton sparse MLA kernel vs the TileLang SM90 kernel, both vs the oracle.

Both backends run through the dispatcher (engine.h20_ops.attention.dispatch.sparse_mla_fwd with
backend="triton" / "tilelang"), so each adapter's lse convention (base 2) is part of what is compared.
Per case: max abs difference of out and of finite lse between the two kernels and of each kernel
against the float32 oracle, against a tolerance of 2 bf16 ULP at the reference's scale
(2 * 2^(floor(log2(max |x|)) - 7)); +inf lse (empty rows) must coincide exactly.
Prints a table, then ALL_MATCH or the failing cases; exits 1 on any mismatch. Then times both
kernels on the model shapes (TFLOP/s = 2 * s_q * topk * h_q * (d_qk + d_v) / t).

  python scripts/ab_vendored.py [--no-bench]
If the Triton kernel module is missing, each TileLang result is compared to the oracle only.
"""

import argparse
import importlib.util
import math
import sys

import torch

from engine.h20_ops.attention.dispatch import LOG2E, sparse_mla_fwd
from engine.h20_ops.attention.reference import sparse_mla_prefill_ref

INVALID_FILLERS = (-1, -(2**31), -123456, 2**31 - 1)


def bf16_ulps(x: torch.Tensor, n: float = 2.0) -> float:
    """n bf16 ULPs at the scale of max |x| over finite entries (8 significant bits)."""
    finite = x[torch.isfinite(x)].abs()
    scale = finite.max().item() if finite.numel() else 0.0
    if scale == 0.0:
        return n * 2.0**-133  # smallest bf16 subnormal step
    return n * 2.0 ** (math.floor(math.log2(scale)) - 7)


def make_case(s_q, s_kv, h_q, d_qk, topk, *, seed, dup=False, invalid_frac=0.1, lengths=False, sink=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(s_q, h_q, d_qk, generator=g, device="cuda").to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, d_qk, generator=g, device="cuda").to(torch.bfloat16)
    if dup or topk > s_kv:
        idx = torch.randint(0, s_kv, (s_q, topk), generator=g, device="cuda")
        if dup:  # every row also repeats its first quarter
            quarter = topk // 4
            idx[:, quarter:2 * quarter] = idx[:, :quarter]
    else:
        idx = torch.argsort(torch.rand(s_q, s_kv, generator=g, device="cuda"), dim=1)[:, :topk]
    idx = idx.to(torch.int32)
    fillers = torch.tensor(INVALID_FILLERS + (s_kv,), dtype=torch.int32, device="cuda")
    invalid = torch.rand(s_q, topk, generator=g, device="cuda") < invalid_frac
    idx = torch.where(invalid, fillers[torch.randint(0, fillers.numel(), (s_q, topk), generator=g, device="cuda")], idx)
    selected = torch.zeros(s_kv, dtype=torch.bool, device="cuda")
    ok = (idx >= 0) & (idx < s_kv)
    selected[idx[ok].long()] = True
    kv[~selected] = float("nan")  # unselected rows must never be read
    topk_length = None
    if lengths:
        topk_length = torch.randint(0, topk + 1, (s_q,), generator=g, device="cuda", dtype=torch.int32)
    attn_sink = None
    if sink:
        attn_sink = torch.randn(h_q, generator=g, device="cuda") * 2
        attn_sink[: h_q // 4] = float("inf")
        attn_sink[h_q // 4: h_q // 2] = float("-inf")
    return q, kv, idx, attn_sink, topk_length


CASES = {
    # name: (s_q, s_kv, h_q, d_qk, topk, extras)
    "prefill distinct top-k": (64, 2048, 64, 512, 512, {}),
    "prefill duplicate top-k": (64, 2048, 128, 576, 512, {"dup": True}),
    "decode s_q=1": (1, 4096, 64, 512, 512, {}),
    "odd s_q=7": (7, 2048, 128, 512, 1024, {}),
    "short kv < topk": (32, 200, 64, 576, 512, {}),
    "with topk_length": (48, 2048, 64, 512, 640, {"lengths": True}),
    "with attn_sink": (48, 2048, 128, 512, 512, {"sink": True}),
}


def compare(name, a, b, ref_out, ref_lse2):
    """-> (row dict, ok) for outputs a = (out, lse2) vs b = (out, lse2); tolerances at ref's scale."""
    out_tol, lse_tol = bf16_ulps(ref_out), bf16_ulps(ref_lse2)
    inf_ok = torch.equal(torch.isinf(a[1]), torch.isinf(b[1]))
    finite = torch.isfinite(a[1]) & torch.isfinite(b[1])
    out_diff = (a[0].float() - b[0].float()).abs().max().item()
    lse_diff = (a[1][finite] - b[1][finite]).abs().max().item() if finite.any() else 0.0
    ok = inf_ok and out_diff <= out_tol and lse_diff <= lse_tol and math.isfinite(out_diff)
    return {"pair": name, "out": out_diff, "out_tol": out_tol, "lse": lse_diff, "lse_tol": lse_tol,
            "inf": "same" if inf_ok else "DIFF", "ok": ok}


def run_ab(have_triton: bool) -> list[str]:
    failures = []
    header = f"{'case':26s} {'pair':16s} {'max|d out|':>11s} {'tol':>9s} {'max|d lse|':>11s} {'tol':>9s} {'inf':>5s}  ok"
    print(header)
    print("-" * len(header))
    for i, (name, (s_q, s_kv, h_q, d_qk, topk, extras)) in enumerate(CASES.items()):
        q, kv, idx, sink, lengths = make_case(s_q, s_kv, h_q, d_qk, topk, seed=1234 + i, **extras)
        sm_scale = 1.0 / math.sqrt(d_qk)
        ref = sparse_mla_prefill_ref(q, kv, idx, sm_scale, 512, sink, lengths)
        ref_pair = (ref.out, ref.lse * LOG2E)
        results = {"tilelang": sparse_mla_fwd(q, kv, idx, sm_scale, attn_sink=sink, topk_length=lengths,
                                              backend="tilelang")}
        if have_triton:
            results["triton"] = sparse_mla_fwd(q, kv, idx, sm_scale, attn_sink=sink, topk_length=lengths,
                                               backend="triton")
        rows = [compare(f"{k} vs oracle", v, ref_pair, *ref_pair) for k, v in results.items()]
        if have_triton:
            rows.insert(0, compare("tilelang/triton", results["tilelang"], results["triton"], *ref_pair))
        for row in rows:
            print(f"{name:26s} {row['pair']:16s} {row['out']:11.3e} {row['out_tol']:9.2e} {row['lse']:11.3e} "
                  f"{row['lse_tol']:9.2e} {row['inf']:>5s}  {'yes' if row['ok'] else 'NO'}")
            if not row["ok"]:
                failures.append(f"{name}: {row['pair']}")
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


def run_bench(have_triton: bool) -> None:
    backends = ["tilelang"] + (["triton"] if have_triton else [])
    print(f"\n{'shape (s_q 4096, s_kv 8192)':28s} " + " ".join(f"{b + ' ms':>12s} {b + ' TF/s':>14s}" for b in backends))
    for name, (s_q, s_kv, h_q, d_qk, topk, with_sink) in BENCH.items():
        g = torch.Generator(device="cuda").manual_seed(7)
        q = torch.randn(s_q, h_q, d_qk, generator=g, device="cuda").to(torch.bfloat16)
        kv = torch.randn(s_kv, 1, d_qk, generator=g, device="cuda").to(torch.bfloat16)
        idx = torch.argsort(torch.rand(s_q, s_kv, generator=g, device="cuda"), dim=1)[:, :topk].to(torch.int32)
        sink = torch.randn(h_q, generator=g, device="cuda") if with_sink else None
        flops = 2 * s_q * topk * h_q * (d_qk + 512)
        cells = []
        for b in backends:
            ms = time_ms(lambda: sparse_mla_fwd(q, kv, idx, d_qk**-0.5, attn_sink=sink, backend=b))
            cells.append(f"{ms:12.3f} {flops / ms / 1e9:14.1f}")
        print(f"{name:28s} " + " ".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-bench", action="store_true", help="skip the timing table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("ab_vendored.py needs a CUDA GPU", file=sys.stderr)
        return 2
    have_triton = importlib.util.find_spec("engine.h20_ops.vendor.flashmla_sparse") is not None
    if not have_triton:
        print("engine.h20_ops.vendor.flashmla_sparse is missing: TileLang vs the oracle only")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    failures = run_ab(have_triton)
    print()
    if failures:
        print("MISMATCH: " + "; ".join(failures))
    else:
        print("ALL_MATCH")
    if not args.no_bench:
        run_bench(have_triton)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
