"""GPU A/B of fused_sample: Triton vs TileLang must draw bit-identical random words and emit identical
tokens (greedy, sampling, rejection sampling; fp32, bf16 and fp32 logits that hold bf16 values, the
engine's case; small and DeepSeek-size vocabularies).
Also reports agreement with the CPU oracle (its exp2 is not the GPU's ex2.approx, so rare
differences are expected there and are reported, not failed) and a timing table.

Usage (needs CUDA and TileLang importable): python scripts/ab_fused_sample.py
Exits 1 on any Triton / TileLang mismatch.
"""

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from engine.h20_ops import sampling as fs  # noqa: E402
from engine.h20_ops.sampling import reference as ref  # noqa: E402
from engine.h20_ops.sampling.reference import DRAW_DRAFT  # noqa: E402
from engine.h20_ops.sampling import triton_kernels as ft  # noqa: E402

failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name} {detail}")
    if not ok:
        failures.append(name)


def tilelang_draws(seeds, positions):
    import tilelang.language as T

    from engine.h20_ops.sampling.tilelang_sm90 import compile_kernel

    n_rows = T.dynamic("n_rows")

    @T.prim_func
    def draws(seeds_: T.Tensor((n_rows,), "int64"), positions_: T.Tensor((n_rows,), "int64"),
              out: T.Tensor((n_rows, 4), "int64")):
        with T.Kernel(n_rows, threads=32) as b:
            T.rng_init(seeds_[b], positions_[b], 0)
            out[b, 0] = T.Cast("int64", T.rng_rand())
            T.rng_init(seeds_[b], positions_[b], 1)
            out[b, 1] = T.Cast("int64", T.rng_rand())
            T.rng_init(seeds_[b], positions_[b], 2)
            out[b, 2] = T.Cast("int64", T.rng_rand())
            T.rng_init(seeds_[b], positions_[b], 3)
            out[b, 3] = T.Cast("int64", T.rng_rand())

    out = torch.full((seeds.numel(), 4), -1, dtype=torch.int64, device="cuda")
    compile_kernel(draws)(seeds, positions, out)
    return out


def params(n, v, g, dev):
    seeds = torch.randint(0, 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    positions = torch.randint(0, 2**34, (n,), generator=g, dtype=torch.int64)
    temperature = 0.3 + 1.4 * torch.rand(n, generator=g)
    temperature[::9] = 0.0
    top_k = torch.randint(1, min(v, 200), (n,), generator=g)
    top_k[1::3] = 0
    top_p = 0.5 + 0.5 * torch.rand(n, generator=g)
    top_p[::4] = 1.0
    return [t.to(dev) for t in (seeds, positions, temperature, top_k, top_p)]


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    dev = "cuda"
    g = torch.Generator().manual_seed(0)

    # 1. the random stream: Triton == TileLang (cuRAND) == numpy, bit for bit
    n = 4096
    seeds = torch.randint(-2**63, 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    positions = torch.randint(0, 2**40, (n,), generator=g, dtype=torch.int64)
    positions[:3] = torch.tensor([0, 2**32 - 1, 2**32])
    seeds, positions = seeds.to(dev), positions.to(dev)
    tri = ft.philox_words(seeds, positions)
    tle = tilelang_draws(seeds, positions)
    npy = np.stack([ref.draw_u32(seeds.cpu().numpy(), positions.cpu().numpy(), d) for d in range(4)], 1)
    check("draws triton == tilelang", torch.equal(tri, tle), f"({n} x 4 words)")
    check("draws triton == numpy oracle", np.array_equal(tri.cpu().numpy(), npy.astype(np.int64)))

    # 2. tokens
    rows = []
    for v, n_req in ((1000, 256), (129280, 64)):
        # (the thresholds are searched over 16-bit keys when every logit is a bf16 value, else 32-bit)
        for label, dtype, values in (("fp32", torch.float32, torch.float32), ("bf16", torch.bfloat16, torch.bfloat16),
                                     ("fp32 of bf16", torch.float32, torch.bfloat16)):
            def logits(*shape):
                return (3.0 * torch.randn(*shape, generator=g)).to(values).to(dtype)

            x = logits(n_req, v).to(dev)
            x[:, ::11] = float("-inf")
            # ties of the row maximum (the first index wins): far apart, 1024 apart (one thread's
            # entries in the TileLang kernel), adjacent; and a row without a finite logit (token 0)
            x[1, 5] = x[1, v - 3] = x[2, 7] = x[2, 7 + 1024 % v] = x[3, 2] = x[3, 3] = 50.0
            x[4] = float("-inf")
            p = params(n_req, v, g, dev)
            tag = f"V={v} {label} N={n_req}"

            a, b = fs.greedy_sample(x, backend="triton"), fs.greedy_sample(x, backend="tilelang")
            check(f"greedy {tag}", torch.equal(a, b) and torch.equal(a, torch.argmax(x.float(), 1)))

            a, b = fs.sample(x, *p, backend="triton"), fs.sample(x, *p, backend="tilelang")
            o = fs.sample(x.cpu(), *[t.cpu() for t in p], backend="ref").to(dev)
            check(f"sample {tag}", torch.equal(a, b), f"(vs oracle: {(a != o).sum().item()} of {n_req} differ)")
            a2 = fs.sample(x, *p, draw=DRAW_DRAFT, backend="triton")
            b2 = fs.sample(x, *p, draw=DRAW_DRAFT, backend="tilelang")
            check(f"sample draft lane {tag}", torch.equal(a2, b2))

            for k in (1, 3):
                target = logits(n_req, k + 1, v).to(dev)
                draft = target[:, :k].float().cpu() + torch.randn(n_req, k, v, generator=g)
                draft = draft.to(values).to(dtype).to(dev)
                draft_tokens = torch.stack([fs.sample(draft[:, j].contiguous(), p[0], p[1] + j, *p[2:], draw=DRAW_DRAFT,
                                                      backend="triton") for j in range(k)], 1)
                ta, aa = fs.rejection_sample(target, draft, draft_tokens, *p, backend="triton")
                tb, ab = fs.rejection_sample(target, draft, draft_tokens, *p, backend="tilelang")
                to, ao = fs.rejection_sample(target.cpu(), draft.cpu(), draft_tokens.cpu(), *[t.cpu() for t in p],
                                             backend="ref")
                check(f"rejection K={k} {tag}", torch.equal(ta, tb) and torch.equal(aa, ab),
                      f"(mean accepted {aa.float().mean().item():.2f}; vs oracle: "
                      f"{(ta.cpu() != to).any(1).sum().item()} of {n_req} rows differ)")
                if v == 129280 and values == torch.bfloat16 and k == 3:
                    for backend in ("triton", "tilelang"):
                        rows.append((f"rejection K=3 {tag}", backend, timed(
                            lambda: fs.rejection_sample(target, draft, draft_tokens, *p, backend=backend))))
            if v == 129280 and values == torch.bfloat16:
                for backend in ("triton", "tilelang"):
                    rows.append((f"greedy {tag}", backend, timed(lambda: fs.greedy_sample(x, backend=backend))))
                    rows.append((f"sample {tag}", backend, timed(lambda: fs.sample(x, *p, backend=backend))))

    print("\n| op | backend | ms / call |\n|---|---|---|")
    for op, backend, ms in rows:
        print(f"| {op} | {backend} | {ms:.3f} |")
    print(f"\n{len(failures)} failure(s)" + (": " + ", ".join(failures) if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
