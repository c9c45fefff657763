"""Benchmark sparse MLA prefill kernels on one GPU; prints a markdown table.

Backends: `triton` (engine.h20_ops.vendor.flashmla_sparse: on an SM90 GPU its warp-specialized Gluon
kernel), `triton portable` (the same entry point's tl kernel, what other GPUs run), `tilelang`
(engine.h20_ops.attention.tilelang_sm90, when it imports; otherwise a note), and `flaggems`
(FlagGems 5.0.2's single file flag_gems/fused/flashmla_sparse.py, loaded by path from an unpacked
wheel: the flag_gems package itself is never imported, its import has side effects).

TFLOP/s = 2 * s_q * topk * h_q * (d_qk + d_v) / time (masked slots included, as everyone counts),
and "% GEMM" relates that to a torch bf16 8192^3 matmul timed in the same run. Each row also checks
the first rows of the output against the fp32 oracle, so a fast wrong kernel is visible.
Inputs: random, distinct indices per query (top-k of random keys), never zeros.

Usage: python scripts/bench_sparse_mla.py [--flaggems-file .whl/flaggems/flashmla_sparse.py]
       [--sweep] [--shapes v4flash512,v32]
`--sweep` also times several launch configurations of the portable Triton kernel (tuning data,
docs/lab/prefill.md).
Exits nonzero when a kernel fails or its output disagrees with the oracle.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.h20_ops.attention.reference import sparse_mla_prefill_ref  # noqa: E402
from engine.h20_ops.vendor.flashmla_sparse import (  # noqa: E402
    KernelConfig, default_config, flash_mla_sparse_fwd)

CHECK_ROWS = 32  # query rows compared with the oracle per (shape, backend)


@dataclass(frozen=True)
class Shape:
    name: str
    s_q: int
    s_kv: int
    h_q: int
    d_qk: int
    topk: int

    def flops(self) -> float:
        return 2.0 * self.s_q * self.topk * self.h_q * (self.d_qk + 512)


SHAPES = {
    "v4flash512": Shape("V4-Flash topk512", 4096, 8192, 64, 512, 512),
    "v4flash640": Shape("V4-Flash topk640", 4096, 8192, 64, 512, 640),
    "v4pro": Shape("V4-Pro topk1024", 4096, 8192, 128, 512, 1024),
    "v32": Shape("V3.2 d576 topk2048", 4096, 8192, 128, 576, 2048),
    "decode": Shape("decode-like s_q128 topk640", 128, 8192, 64, 512, 640),
    "longctx": Shape("long context s_kv65536", 4096, 65536, 64, 512, 512),
}

# Launch configurations timed by --sweep (block_k, num_warps, num_stages): the default, one more
# stage where shared memory allows it, and 32-entry blocks with a gather prefetched two or three
# blocks ahead (docs/lab/triton_kernel_notes.md). 8 warps keep the [64, 512] fp32 accumulator in registers.
SWEEP_CONFIGS = {
    512: [KernelConfig(64, 8, 2), KernelConfig(32, 8, 3), KernelConfig(32, 8, 4)],
    576: [KernelConfig(64, 8, 2), KernelConfig(64, 8, 3), KernelConfig(32, 8, 3), KernelConfig(32, 8, 4)],
}


def make_inputs(shape: Shape, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(shape.s_q, shape.h_q, shape.d_qk, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(shape.s_kv, 1, shape.d_qk, device="cuda", generator=gen).bfloat16()
    indices = torch.empty(shape.s_q, 1, shape.topk, dtype=torch.int32, device="cuda")
    for start in range(0, shape.s_q, 512):  # distinct per row: top-k of random keys, in chunks
        rows = min(512, shape.s_q - start)
        keys = torch.rand(rows, shape.s_kv, device="cuda", generator=gen)
        indices[start:start + rows, 0] = keys.topk(shape.topk, dim=1).indices.int()
    sink = torch.randn(shape.h_q, device="cuda", generator=gen)
    return q, kv, indices, shape.d_qk ** -0.5, sink


def load_flaggems(path: Path):
    spec = importlib.util.spec_from_file_location("flaggems_flashmla_sparse", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.flash_mla_sparse_fwd


def gemm_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda").bfloat16()
    b = torch.randn(n, n, device="cuda").bfloat16()
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300)
    return 2 * n ** 3 / ms / 1e9


def oracle_error(out: torch.Tensor, q, kv, indices, sm_scale, sink) -> float:
    ref = sparse_mla_prefill_ref(q[:CHECK_ROWS], kv, indices[:CHECK_ROWS], sm_scale, attn_sink=sink)
    return (out[:CHECK_ROWS].float() - ref.out).abs().max().item()


def time_backend(fn, shape: Shape, inputs, gemm: float) -> tuple[str, float, float, float, float]:
    q, kv, indices, sm_scale, sink = inputs
    out = fn(q, kv, indices, sm_scale, 512, sink)[0]
    err = oracle_error(out, q, kv, indices, sm_scale, sink)
    ms = triton.testing.do_bench(lambda: fn(q, kv, indices, sm_scale, 512, sink), warmup=10, rep=100)
    tflops = shape.flops() / ms / 1e9
    return ms, tflops, 100.0 * tflops / gemm, err


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flaggems-file", type=Path, default=Path(".whl/flaggems/flashmla_sparse.py"),
                        help="flag_gems/fused/flashmla_sparse.py unpacked from the flag-gems 5.0.2 wheel")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--sweep", action="store_true", help="also time Triton launch configurations")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_sparse_mla: needs a CUDA GPU", file=sys.stderr)
        return 2

    portable = default_config(torch.bfloat16)
    backends = {"triton": flash_mla_sparse_fwd,
                "triton portable": lambda *args: flash_mla_sparse_fwd(*args, config=portable)}
    notes = []
    try:
        from engine.h20_ops.attention.tilelang_sm90 import sparse_mla_fwd_sm90
        backends["tilelang"] = sparse_mla_fwd_sm90
    except ModuleNotFoundError as exc:
        notes.append(f"tilelang skipped: {exc}")
    except Exception as exc:  # a peer's broken install must not hide this kernel's numbers
        notes.append(f"tilelang skipped, its import failed: {type(exc).__name__}: {exc}")
    if args.flaggems_file.is_file():
        backends["flaggems 5.0.2"] = load_flaggems(args.flaggems_file)
    else:
        notes.append(f"flaggems skipped: {args.flaggems_file} not found")

    props = torch.cuda.get_device_properties(0)
    gemm = gemm_tflops()
    print(f"GPU {props.name}; torch {torch.__version__}; triton {triton.__version__}; "
          f"CUDA {torch.version.cuda}; bf16 GEMM 8192^3: {gemm:.1f} TFLOP/s")
    for note in notes:
        print(f"note: {note}")
    print()
    print("| shape | s_q | s_kv | h_q | d_qk | topk | backend | ms | TFLOP/s | % GEMM | max err vs oracle |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    failures = 0
    sweep_rows = []
    for key in args.shapes.split(","):
        shape = SHAPES[key]
        inputs = make_inputs(shape)
        head = f"| {shape.name} | {shape.s_q} | {shape.s_kv} | {shape.h_q} | {shape.d_qk} | {shape.topk}"
        for name, fn in backends.items():
            try:
                ms, tflops, pct, err = time_backend(fn, shape, inputs, gemm)
            except Exception:
                traceback.print_exc()
                print(f"{head} | {name} | failed | | | |", flush=True)
                failures += name.startswith("triton")
                continue
            bad = name.startswith("triton") and not err < 1e-2
            failures += bad
            print(f"{head} | {name} | {ms:.3f} | {tflops:.1f} | {pct:.1f} | {err:.2e}{' FAIL' if bad else ''} |",
                  flush=True)
        if args.sweep:
            for cfg in SWEEP_CONFIGS[shape.d_qk]:
                def run(q, kv, indices, sm_scale, d_v, sink, cfg=cfg):
                    return flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, sink, config=cfg)
                head_cfg = f"| {shape.name} | {cfg.block_k} | {cfg.num_warps} | {cfg.num_stages} | "
                try:
                    ms, tflops, pct, err = time_backend(run, shape, inputs, gemm)
                    sweep_rows.append(f"{head_cfg}{ms:.3f} | {tflops:.1f} | {err:.2e} |")
                except Exception as exc:
                    sweep_rows.append(f"{head_cfg}failed: {str(exc).splitlines()[0][:80]} | | |")
                print(sweep_rows[-1], flush=True)
        del inputs
        torch.cuda.empty_cache()
    if sweep_rows:
        default = default_config(torch.bfloat16)
        print(f"\nTriton launch sweep (defaults: {default})")
        print("| shape | block_k | num_warps | num_stages | ms | TFLOP/s | max err vs oracle |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(sweep_rows))
    if failures:
        print(f"\n{failures} Triton failure(s)", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
