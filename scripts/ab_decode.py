#!/usr/bin/env python3
"""A/B check of the decode path with the fp8 KV cache (GPU): Triton vs TileLang vs the float32 oracle.

Each case builds DeepSeek-V4 decode inputs the way the engine does: a paged MODEL1 fp8 SWA cache
and a paged MODEL1 fp8 compressed cache (Triton quantizer), each request's window rows gathered
and dequantized (Triton) into one [B, W+E, 1, 512] bf16 buffer, then one decode_attn_sparse call
per backend, with and without the flash-decoding split. The oracle is sparse_mla_decode_ref on the
same rows dequantized by the torch reference (which must equal the Triton gather bit for bit).
Tolerances are FlashMLA's decode ones: out abs 1e-3 or rel 2.01/128 per element and cosine
distance <= 5e-6; lse (base 2 here) rel 8.01/65536 or abs 1e-6 (x log2 e); inf positions exact.
A split run's partial outputs are rounded to bf16 (the kernel's output dtype) before the merge, and
the merged output again: with r = 2^-8 * (sum_i w_i |o_i| + |o|) (one bf16 ulp per rounding;
partials o_i and weights w_i computed by the oracle on the exact rows and index chunks of that
launch), an element may instead be within 1e-3 + r of the oracle and the cosine distance up to
sum r^2 / sum(a^2 + b^2) when that exceeds 5e-6.

Prints a table and ALL_MATCH, or exits 1. TileLang is skipped with a note when it cannot be imported.
Usage: python scripts/ab_decode.py            (needs CUDA)
       python scripts/ab_decode.py --small    (tiny shapes, any device: checks this script)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

import torch

# FlashMLA's test distribution (0.1 * N(0, 1)), for which its decode tolerances are made: P.V takes P
# in bf16, so unit-variance inputs exceed abs 1e-3 on rounding alone.
INPUT_SCALE = 0.1

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import engine.h20_ops  # noqa: E402,F401  (TRITON_INTERPRET on CPU before kernel modules load)
from engine.h20_ops import kv_cache
from engine.h20_ops.attention import dispatch  # noqa: E402
from engine.h20_ops.attention.entry import (PAGED_SPLIT_SMS_PER_PROGRAM, _choose_splits, decode_attn_sparse,  # noqa: E402
                                      decode_attn_sparse_paged_fp8)
from engine.h20_ops.attention.reference import sparse_mla_decode_ref, sparse_mla_prefill_ref  # noqa: E402

D = 512
LOG2E = 1.0 / math.log(2.0)
BLOCK_SIZE = 64


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    s_q: int
    width: int  # SWA window rows (main cache)
    extra: int  # compressed rows (extra cache); 0: window-only layer
    topk: int
    etopk: int
    heads: int = 64
    lengths: bool = False  # random topk_length / extra_topk_length (some 0)
    fillers: bool = False  # invalid index fillers mixed in
    sink: bool = True
    shared: bool = True  # both windows in one buffer (no copy) vs two buffers (one concat)


def activation_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPU. On CPU (--small) float32: Triton's interpreter truncates fp32 -> bf16 casts
    instead of rounding, which would fail the tolerances for reasons a GPU does not have."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def make_inputs(case: Case, seed: int, device, *, empty_slots: bool):
    """fp8 caches, slot tables, the bf16 window buffer (Triton gather) and decode arguments."""
    g = torch.Generator().manual_seed(seed)
    b, w, e = case.batch, case.width, case.extra

    def paged_rows(rows_per_request: int):
        capacity = b * rows_per_request + BLOCK_SIZE
        num_blocks = -(-capacity // BLOCK_SIZE)
        cache = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, num_blocks, BLOCK_SIZE, device)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:b * rows_per_request].view(b, rows_per_request)
        slots = slots.int()
        if empty_slots and b > 1:
            slots[-1, rows_per_request // 2:] = -1  # a request with a short history
        kv = torch.randn(b * rows_per_request, 1, D, generator=g) * INPUT_SCALE
        kv *= torch.exp2(torch.randint(-1, 2, (b * rows_per_request, 1, 1), generator=g).float())
        kv_cache.quantize_into_cache(cache, slots.view(-1).to(device), kv.to(device, torch.bfloat16))
        return cache, slots.to(device)

    def local_indices(slots: torch.Tensor, k: int, rows: int):
        if k > rows:
            raise ValueError(f"case {case.name}: topk {k} > rows {rows}")
        order = torch.argsort(torch.rand(b, case.s_q, rows, generator=g), dim=-1)[..., :k].int()
        empty = slots.cpu() < 0
        order = torch.where(torch.gather(empty[:, None, :].expand(b, case.s_q, rows), 2, order.long()), -1, order)
        if case.fillers:
            fill = torch.tensor([-1, rows, rows + 7, -2**31, 2**31 - 1], dtype=torch.int32)
            pick = fill[torch.randint(0, len(fill), order.shape, generator=g)]
            order = torch.where(torch.rand(order.shape, generator=g) < 0.2, pick, order)
        return order.to(device)

    swa_cache, swa_slots = paged_rows(w)
    args = dict(indices=local_indices(swa_slots, case.topk, w))
    buf = torch.full((b, w + e, 1, D), float("nan"), dtype=activation_dtype(device), device=device)
    kv_cache.gather_dequant(swa_cache, swa_slots, buf[:, :w])
    caches = [(swa_cache, swa_slots)]
    if e:
        comp_cache, comp_slots = paged_rows(e)
        kv_cache.gather_dequant(comp_cache, comp_slots, buf[:, w:])
        args["extra_indices"] = local_indices(comp_slots, case.etopk, e)
        caches.append((comp_cache, comp_slots))
    if case.shared or not e:
        args["kv_windows"] = buf[:, :w]
        if e:
            args["extra_kv_windows"] = buf[:, w:]
    else:
        args["kv_windows"] = buf[:, :w].clone()
        args["extra_kv_windows"] = buf[:, w:].clone()
    if case.lengths:
        args["topk_length"] = torch.randint(0, case.topk + 1, (b,), generator=g, dtype=torch.int32).to(device)
        if e:
            args["extra_topk_length"] = torch.randint(0, case.etopk + 1, (b,), generator=g, dtype=torch.int32).to(device)
        if b > 1:
            args["topk_length"][0] = 0
    if case.sink:
        sink = torch.randn(case.heads, generator=g)
        sink[: case.heads // 4] = float("inf")
        sink[case.heads // 4: case.heads // 2] = float("-inf")
        args["attn_sink"] = sink.to(device)
    args["q"] = (torch.randn(b, case.s_q, case.heads, D, generator=g) * INPUT_SCALE).to(device, activation_dtype(device))
    return args, buf, caches


def poison_unreferenced_rows(args: dict) -> None:
    """NaN into every window row no valid entry selects (in the tensors the kernels get), so that an
    invalid entry reaching the kernel as another request's row shows up as NaN."""
    pairs = [("kv_windows", "indices", "topk_length")]
    if "extra_kv_windows" in args:
        pairs.append(("extra_kv_windows", "extra_indices", "extra_topk_length"))
    for kv_name, idx_name, len_name in pairs:
        kv, idx, lengths = args[kv_name], args[idx_name], args.get(len_name)
        batch, rows = kv.shape[:2]
        valid = (idx >= 0) & (idx < rows)
        if lengths is not None:
            valid &= torch.arange(idx.size(2), device=idx.device)[None, None, :] < lengths[:, None, None]
        used = torch.zeros(batch, rows + 1, dtype=torch.bool, device=kv.device)
        used.scatter_(1, torch.where(valid, idx, rows).view(batch, -1).long(), True)  # column `rows`: dummy
        kv[~used[:, :rows]] = float("nan")


def reference_rows(caches, width: int, extra: int) -> torch.Tensor:
    """The window buffer as the torch reference dequantizes it (fp32)."""
    parts = [kv_cache.dequantize_from_cache_ref(c, s, torch.float32) for c, s in caches]
    return torch.cat(parts, dim=1)


def split_rounding_bound(q, kv, indices, splits: int) -> torch.Tensor:
    """Rounding bound r [n, H, 512] of a split decode (partials rounded to bf16, the kernel's output
    dtype, then the merged output): r = 2^-8 * (sum_i w_i |o_i| + |o|), partials o_i and weights w_i
    from the oracle run on the very q rows, kv rows and index chunks the kernel got."""
    part = sparse_mla_prefill_ref(q.float(), kv.float(), indices, D ** -0.5)
    n = part.out.size(0) // splits
    lse = part.lse.view(n, splits, -1).double()
    weights = torch.softmax(lse.masked_fill(lse == math.inf, -math.inf), dim=1).nan_to_num(0.0)
    parts = part.out.double().view(n, splits, *part.out.shape[1:])
    mixed = (weights[..., None] * parts.abs()).sum(1) + (weights[..., None] * parts).sum(1).abs()
    return 2.0 ** -8 * mixed


def run_recording_launch(call: dict, splits: int):
    """decode_attn_sparse, also returning the (q, kv, indices) of its one kernel launch."""
    seen = []
    real = dispatch.sparse_mla_fwd

    def recording(q, kv, indices, sm_scale, **kwargs):
        seen.append((q, kv, indices))
        return real(q, kv, indices, sm_scale, **kwargs)

    dispatch.sparse_mla_fwd = recording
    try:
        call = dict(call)
        out, lse = decode_attn_sparse(call.pop("q"), call.pop("kv_windows"), call.pop("indices"), D ** -0.5,
                                      num_splits=splits, **call)
    finally:
        dispatch.sparse_mla_fwd = real
    if len(seen) != 1:
        raise AssertionError(f"expected one kernel launch per decode call, got {len(seen)}")
    return out, lse, seen[0]


def compare(out, lse, ref, bound=None) -> tuple[bool, float, float, float]:
    out, ref_out = out.double(), ref.out.double()
    err = (out - ref_out).abs()
    elem = (err < 1e-3) | (err / (ref_out.abs() + 1e-6) < 2.01 / 128)
    energy = (out.square() + ref_out.square()).sum().clamp_min(1e-30)
    cos_limit = 5e-6
    if bound is not None:  # split: partial outputs were rounded to bf16 before the merge
        bound = bound.view_as(err).double()
        elem |= err <= 1e-3 + bound
        cos_limit = max(cos_limit, (bound.square().sum() / energy).item())
    ok_elem = bool(elem.all()) and not torch.isnan(out).any()
    cos = (1 - 2 * (out * ref_out).sum() / energy).item()
    ref_lse = ref.lse.double() * LOG2E
    lse = lse.double()
    inf_ok = torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and torch.equal(lse == math.inf, ref_lse == math.inf)
    fin = torch.isfinite(ref_lse)
    lse_err = ((lse[fin] - ref_lse[fin]).abs() / ref_lse[fin].abs().clamp_min(1e-30)).max().item() if fin.any() else 0.0
    lse_ok = bool(((lse[fin] - ref_lse[fin]).abs() <= torch.maximum(
        torch.full_like(ref_lse[fin], 1e-6 * LOG2E), ref_lse[fin].abs() * 8.01 / 65536)).all())
    return ok_elem and cos <= cos_limit and inf_ok and lse_ok, err.max().item(), cos, lse_err


def backends_to_run(device: torch.device) -> tuple[list[str], list[str]]:
    names, notes = ["triton"], []
    if device.type != "cuda":
        return names, ["tilelang skipped: its kernel needs a CUDA device"]
    try:
        import importlib
        importlib.import_module(dispatch.TILELANG_KERNEL_MODULE)
        names.append("tilelang")
    except ModuleNotFoundError as exc:
        notes.append(f"tilelang skipped: not importable ({exc})")
    return names, notes


def use_backend(name: str) -> None:
    os.environ["DEEPINFER_SPARSE_MLA_BACKEND"] = name
    dispatch.reset_resolution_for_tests()


def cases(small: bool) -> list[Case]:
    if small:
        return [
            Case("swa_b1", 1, 1, 8, 0, 8, 0),
            Case("two_cache_b2_sq2", 2, 2, 8, 16, 8, 12, lengths=True, fillers=True),
            Case("two_cache_separate", 2, 1, 8, 16, 6, 16, shared=False, fillers=True),
        ]
    return [
        Case("swa_only_b1_sq1", 1, 1, 128, 0, 128, 0),
        Case("two_cache_b1_sq2", 1, 2, 128, 512, 128, 512),
        Case("two_cache_b4_sq2_len", 4, 2, 128, 512, 128, 512, lengths=True, fillers=True),
        Case("two_cache_b74_sq1_len", 74, 1, 128, 512, 128, 384, lengths=True, fillers=True),
        Case("two_cache_b321_sq2", 321, 2, 128, 512, 128, 512),
        Case("two_cache_b74_sq2_separate", 74, 2, 128, 512, 128, 512, shared=False, fillers=True),
        Case("swa_only_b321_sq1_h128", 321, 1, 128, 0, 128, 0, heads=128),
        Case("hca_b4_sq1_all_compressed", 4, 1, 128, 64, 128, 64, lengths=True),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes on any device (checks the script)")
    opts = parser.parse_args()
    if not torch.cuda.is_available() and not opts.small:
        print("ab_decode.py needs a CUDA device (or --small)")
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names, notes = backends_to_run(device)
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}")
    for note in notes:
        print("note:", note)
    header = f"{'case':30s} {'B':>4s} {'s_q':>3s} {'W+E':>8s} {'backend':>8s} {'splits':>6s} " \
             f"{'max_abs':>9s} {'cos_dist':>9s} {'lse_rel':>9s}  status"
    print(header)
    print("-" * len(header))
    all_ok = True
    for i, case in enumerate(cases(opts.small)):
        args, buf, caches = make_inputs(case, seed=100 + i, device=device, empty_slots=True)
        ref_rows = reference_rows(caches, case.width, case.extra)
        gather_ok = torch.equal(buf.float(), ref_rows)
        if not gather_ok:
            print(f"{case.name}: Triton gather != torch dequantization")
            all_ok = False
        poison_unreferenced_rows(args)
        ref = sparse_mla_decode_ref(args["q"].float(), ref_rows[:, :case.width], args["indices"], D ** -0.5,
                                    attn_sink=args.get("attn_sink"), topk_length=args.get("topk_length"),
                                    extra_kv=ref_rows[:, case.width:] if case.extra else None,
                                    extra_indices=args.get("extra_indices"),
                                    extra_topk_length=args.get("extra_topk_length"))
        n_rows = case.batch * case.s_q
        list_len = case.topk + case.etopk
        auto = _choose_splits(n_rows, case.heads, list_len, device)
        for name in names:
            use_backend(name)
            for splits in sorted({1, auto, 3 if opts.small else auto}):
                out, lse, launch = run_recording_launch(args, splits)
                bound = split_rounding_bound(*launch, splits) if splits > 1 else None
                ok, max_abs, cos, lse_rel = compare(out.float(), lse, ref, bound)
                all_ok &= ok
                print(f"{case.name:30s} {case.batch:4d} {case.s_q:3d} {f'{case.width}+{case.extra}':>8s} {name:>8s} "
                      f"{splits:6d} {max_abs:9.2e} {cos:9.2e} {lse_rel:9.2e}  {'ok' if ok else 'MISMATCH'}")
        if "tilelang" in names and device.type == "cuda":
            # The paged fp8 kernel reads both caches itself (no buffer): the same oracle.
            use_backend("tilelang")
            extra = {}
            if case.extra:
                extra = dict(extra_cache=caches[1][0], extra_slots=caches[1][1], extra_indices=args["extra_indices"],
                             extra_topk_length=args.get("extra_topk_length"))
            paged_auto = _choose_splits(n_rows, case.heads, list_len, device, PAGED_SPLIT_SMS_PER_PROGRAM)
            for splits in sorted({1, paged_auto}):
                out, lse = decode_attn_sparse_paged_fp8(args["q"], caches[0][0], caches[0][1], args["indices"],
                                                        D ** -0.5, attn_sink=args.get("attn_sink"),
                                                        topk_length=args.get("topk_length"), num_splits=splits,
                                                        **extra)
                bound = None
                if splits > 1:  # the same chunks as the buffer path's launch with this split
                    bound = split_rounding_bound(*run_recording_launch(args, splits)[2], splits)
                ok, max_abs, cos, lse_rel = compare(out.float(), lse, ref, bound)
                all_ok &= ok
                print(f"{case.name:30s} {case.batch:4d} {case.s_q:3d} {f'{case.width}+{case.extra}':>8s} "
                      f"{'tl-fp8':>8s} {splits:6d} {max_abs:9.2e} {cos:9.2e} {lse_rel:9.2e}  "
                      f"{'ok' if ok else 'MISMATCH'}")
    print("ALL_MATCH" if all_ok else "MISMATCH")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
