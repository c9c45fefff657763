#!/usr/bin/env python3
"""Tensor-parallel head counts (issue 33): h_q 8 / 16 / 32 run as they are vs the same call padded to 64 heads.

A rank of a tensor-parallel deployment holds the model's 64 or 128 heads divided by the TP degree. This
script times and checks, on one GPU, each such h_q against the alternative of padding q to 64 heads.
Rows (GPU):
  prefill: s_q 4096, s_kv 8192, bf16 kv, d_qk 512, sink on, topk 512 and 2048;
  decode: FlashMLA's V4 configurations (bench_flash_mla.decode_rows: s_q 2, fp8 MODEL1 caches of 16384
    tokens per request, SWA topk 128 over 256-token pages + extra topk 512 (a V4-Flash rank, h64 / TP) or
    1024 (a V4-Pro rank, h128 / TP) over 64-token pages, b in {2, 64, 74, 128, 148, 256}), eager and
    CUDA-graph replay;
  each at h_q 8, 16 and 32 (--heads).
Variants of a row (one input case, built once):
  native        the engine at h_q on the triton backend (sparse_mla_prefill / plan_sparse_decode +
                sparse_mla_decode, backend='triton': the dispatcher's kernel for h_q, in the `path` column);
  pad64 <b>     the same call with q and the sink padded to 64 heads (zeros), backend b (tilelang where its
                kernels import, triton): the 64-head kernels; the first h_q heads of out / lse are kept;
  flashmla      FlashMLA's own call padded to 64 heads, when the package imports (found as
                bench_flash_mla.py finds it: `import flash_mla` on PYTHONPATH).
Check: native against the padded reference (flashmla's when present, else the first pad64 variant's) with
  the project's comparator and FlashMLA's tolerances (engine.h20_ops.testing); prefill's native result also
  against the float32 oracle on its first 32 query rows. MATCH / MISMATCH in the `check` column.
Timing: bench_flash_mla's (CUDA events around each call after a 256 MB L2 flush, 3 interleaved rounds of
  >= 20 calls per variant, the median of the round medians). `x pad64`: the fastest padded variant's time /
  this variant's (> 1: faster than padding), at the graph time for decode, eager for prefill. TFLOP/s: the
  useful work at h_q (FlashMLA's counting), for every variant.
Exit status: 0; 1 if a row MISMATCHed or a variant failed; 2 without a CUDA GPU.

Usage (H200; FlashMLA optional):
  PYTHONPATH=/tmp/fmla:$PWD python3 scripts/bench_tp_heads.py [--decode-only | --prefill-only] [--quick]
      [--heads 8,16,32]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_flash_mla as base  # noqa: E402  (its timer, FlashMLA loading and V4 rows; puts the repo on sys.path)
from engine.h20_ops import kv_cache, plan_sparse_decode, sparse_mla_decode, sparse_mla_prefill  # noqa: E402
from engine.h20_ops import testing as T  # noqa: E402
from engine.h20_ops.attention import dispatch  # noqa: E402
from engine.h20_ops.attention.reference import sparse_mla_prefill_ref  # noqa: E402

HEADS = (8, 16, 32)
PADDED_HEADS = 64
PAD_BACKENDS = ("tilelang", "triton")
ORACLE_ROWS = 32  # prefill query rows checked against the float32 oracle
LN2 = math.log(2.0)


def decode_rows(heads: tuple[int, ...], quick: bool) -> list[base.DecodeRow]:
    """bench_flash_mla's V4 (MODEL1) decode rows, each at every h_q of `heads` (a rank's share)."""
    rows = []
    for row in base.decode_rows(quick, small=False):
        if row.layout is not kv_cache.MODEL1:
            continue
        for h_q in heads:
            rows.append(dataclasses.replace(row, name=row.name.replace(f"-h{row.h_q}-", f"-h{h_q}(of {row.h_q})-"),
                                            h_q=h_q))
    return rows


def prefill_rows(heads: tuple[int, ...], quick: bool) -> list[base.PrefillRow]:
    topks = (512,) if quick else (512, 2048)
    return [base.PrefillRow(f"h{h_q} topk{topk}", 4096, 8192, h_q, 512, topk, True) for h_q in heads for topk in topks]


def padded(t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
    """t with its head dim `dim` padded to PADDED_HEADS by zeros (a new contiguous tensor)."""
    if t is None:
        return None
    shape = list(t.shape)
    shape[dim] = PADDED_HEADS
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.size(dim)).copy_(t)
    return out


def run_prefill_row(row: base.PrefillRow, pad_backends: list[str], flashmla, timer: base.Timer,
                    device: torch.device) -> dict[str, base.Cell]:
    """Results kept as (out [s_q, h_q, 512], lse natural [s_q, h_q]) of the first h_q heads."""
    case = T.prefill_case(2, s_q=row.s_q, s_kv=row.s_kv, h_q=row.h_q, topk=row.topk, d_qk=row.d_qk, sink=row.sink,
                          poison=False, strided=False, device=device)
    q_pad, sink_pad = padded(case.q, 1), padded(case.attn_sink, 0)
    h_q = row.h_q
    calls = {"native": ("triton", case.q, case.attn_sink)}
    calls.update({f"pad64 {b}": (b, q_pad, sink_pad) for b in pad_backends})
    cells: dict[str, base.Cell] = {}
    for name, (backend, q, sink) in calls.items():
        cell = cells[name] = base.Cell()
        try:
            cell.fn = lambda q=q, sink=sink, backend=backend: sparse_mla_prefill(q, case.kv, case.indices,
                                                                                 case.sm_scale, attn_sink=sink,
                                                                                 backend=backend)
            res = cell.fn()
            cell.result = (res.out[:, :h_q].clone(), res.lse_log2[:, :h_q] * LN2)
            cell.path = dispatch.prefill_kernel(q, case.kv, backend).kernel
            cell.modes["eager"] = (cell.fn, timer.calls_for(cell.fn), [])
        except Exception as exc:  # noqa: BLE001 (a variant's failure is printed in its line, the run goes on)
            base.record_error(cell, exc)
    if flashmla is not None:
        cell = cells["flashmla"] = base.Cell(path="FlashMLA sparse prefill, padded to 64 heads")
        try:
            cell.fn = lambda: flashmla.flash_mla_sparse_fwd(q_pad, case.kv, case.indices, case.sm_scale, 512,
                                                            sink_pad, None)
            out, _max_logits, lse = cell.fn()
            cell.result = (out[:, :h_q].clone(), lse[:, :h_q].clone())
            cell.modes["eager"] = (cell.fn, timer.calls_for(cell.fn), [])
        except Exception as exc:  # noqa: BLE001
            base.record_error(cell, exc)
    native = cells["native"]
    if native.result is not None:
        tolerances = (T.out_tolerance(T.PREFILL_OUT, native.result[0]), T.PREFILL_STATS)
        checks = []
        reference = _reference(cells)
        if reference is not None:
            checks.append(base.compare(f"native vs {reference[0]}", native.result, reference[1], tolerances))
        rows = slice(0, ORACLE_ROWS)
        ref = sparse_mla_prefill_ref(case.q[rows], case.kv, case.indices[rows], case.sm_scale,
                                     attn_sink=case.attn_sink)
        checks.append(base.compare("native vs oracle", (native.result[0][rows], native.result[1][rows]),
                                   (ref.out, ref.lse), tolerances))
        native.check = _summary(checks, (reference[0] if reference else None, f"oracle rows 0-{ORACLE_ROWS - 1}"))
    base.interleaved(cells, timer, "eager")
    return cells


def run_decode_row(row: base.DecodeRow, pad_backends: list[str], flashmla, timer: base.Timer,
                   device: torch.device) -> dict[str, base.Cell]:
    """Results kept as (out [b, s_q, h_q, 512], lse natural [b, s_q, h_q]) of the first h_q heads."""
    case = T.flashmla_decode_case(1, batch=row.batch, s_q=row.s_q, h_q=row.h_q, layout=row.layout, topk=row.topk,
                                  s_kv=row.s_kv, block_size=row.block_size, extra=row.extra, strided_q=False,
                                  oracle_rows=False, device=device)
    q_pad, sink_pad = padded(case.q, 2), padded(case.attn_sink, 0)
    h_q = row.h_q
    kwargs = case.kwargs()
    calls = {"native": ("triton", case.q, kwargs)}
    calls.update({f"pad64 {b}": (b, q_pad, dict(kwargs, attn_sink=sink_pad)) for b in pad_backends})
    extra_cache = None if case.extra is None else case.extra.cache
    extra_topk = 0 if case.extra is None else case.extra_indices.size(2)
    cells: dict[str, base.Cell] = {}
    for name, (backend, q, call_kwargs) in calls.items():
        cell = cells[name] = base.Cell()
        try:
            plan = plan_sparse_decode(case.main.cache, batch=row.batch, s_q=row.s_q, h_q=q.size(2),
                                      topk=case.indices.size(2), q_dtype=q.dtype, extra_cache=extra_cache,
                                      extra_topk=extra_topk, backend=backend)
            out = torch.empty(*q.shape[:3], 512, dtype=q.dtype, device=device)
            cell.fn = lambda q=q, plan=plan, out=out, call_kwargs=call_kwargs: sparse_mla_decode(
                q, case.main.cache, case.indices, case.sm_scale, plan=plan, out=out, **call_kwargs)
            res = cell.fn()
            cell.result = (res.out[:, :, :h_q].clone(), res.lse_log2[:, :, :h_q] * LN2)
            cell.path = f"{plan.path}: {plan.kernel}, {plan.splits} split(s)"
            cell.split = plan.splits > 1
            _add_modes(cell, timer, device)
        except Exception as exc:  # noqa: BLE001
            base.record_error(cell, exc)
    if flashmla is not None:
        cell = cells["flashmla"] = base.Cell(path="FlashMLA sparse fp8 decode, padded to 64 heads")
        try:
            fm_kwargs = dict(T.flashmla_decode_kwargs(case), attn_sink=sink_pad)
            meta, _ = flashmla.get_mla_metadata()
            cell.fn = lambda: flashmla.flash_mla_with_kvcache(q_pad, case.main.cache, None, None, 512, meta, None,
                                                              **fm_kwargs)
            out, lse = cell.fn()  # lse [b, h, s_q]
            cell.result = (out[:, :, :h_q].clone(), lse[:, :h_q].transpose(1, 2).clone())
            _add_modes(cell, timer, device)
        except Exception as exc:  # noqa: BLE001
            base.record_error(cell, exc)
    native = cells["native"]
    reference = _reference(cells)
    if native.result is not None and reference is not None:
        tolerances = (T.out_tolerance(T.DECODE_OUT, native.result[0], split=native.split), T.DECODE_LSE)
        native.check = _summary([base.compare(f"native vs {reference[0]}", native.result, reference[1],
                                              tolerances)], (reference[0],))
    for mode in ("eager", "graph"):
        base.interleaved(cells, timer, mode)
    return cells


def _add_modes(cell: base.Cell, timer: base.Timer, device: torch.device) -> None:
    cell.modes["eager"] = (cell.fn, timer.calls_for(cell.fn), [])
    if device.type == "cuda":
        replay = base.captured(cell.fn, device)
        cell.modes["graph"] = (replay, timer.calls_for(replay), [])


def _reference(cells: dict[str, base.Cell]) -> tuple[str, tuple] | None:
    """(name, result) of the padded result native is checked against: FlashMLA's, else the first pad64's."""
    for name in ["flashmla"] + [n for n in cells if n.startswith("pad64")]:
        if name in cells and cells[name].result is not None:
            return name, cells[name].result
    return None


def _summary(checks: list[str], against: tuple) -> str:
    bad = [c for c in checks if c != "MATCH"]
    return bad[0] if bad else f"MATCH ({', '.join(a for a in against if a)})"


def print_row(row_name: str, h_q: int, cells: dict[str, base.Cell], flops: float, modes: tuple[str, ...]) -> bool:
    """One line per variant; returns False on a mismatch or a failed variant."""
    best_mode = modes[-1]
    padded_times = [base.time_of(c, best_mode) for n, c in cells.items() if n != "native"]
    padded_best = min((t for t in padded_times if t is not None), default=None)
    ok = True
    for name, cell in cells.items():
        times = [base.time_of(cell, mode) for mode in modes]
        mine = times[-1]
        speedup = "-" if padded_best is None or mine is None else f"{padded_best / mine:.2f}x"
        tflops = "-" if mine is None else f"{flops / (mine * 1e-3) / 1e12:.1f}"
        status = cell.check if cell.error is None else f"ERROR {cell.error}"
        ok &= cell.error is None and not status.startswith("MISMATCH")
        cols = [row_name, str(h_q), name, cell.path or "-", *map(base.fmt_ms, times), speedup, tflops, status]
        print("| " + " | ".join(cols) + " |", flush=True)
    return ok


def parse_heads(text: str, parser: argparse.ArgumentParser) -> tuple[int, ...]:
    try:
        heads = tuple(int(h) for h in text.split(",") if h)
    except ValueError:
        heads = ()
    if not heads or any(h not in HEADS for h in heads):
        parser.error(f"--heads: expected a comma-separated subset of {','.join(map(str, HEADS))}, got {text!r}")
    return heads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--decode-only", action="store_true")
    only.add_argument("--prefill-only", action="store_true")
    parser.add_argument("--quick", action="store_true", help="decode b in {2, 128}, prefill topk 512 only")
    parser.add_argument("--heads", default=",".join(map(str, HEADS)),
                        help=f"comma-separated h_q per rank, a subset of {','.join(map(str, HEADS))} (default: all)")
    opts = parser.parse_args()
    heads = parse_heads(opts.heads, parser)
    if not torch.cuda.is_available():
        print("bench_tp_heads.py needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    logging.getLogger("engine").setLevel(logging.ERROR)  # the dispatcher's choices are in the path column
    available, notes, flashmla = base.available_backends(list(base.BACKENDS), device)
    pad_backends = [b for b in PAD_BACKENDS if b in available]
    print(base.header_line())
    for note in notes:
        print("note:", note)
    d_rows = [] if opts.prefill_only else decode_rows(heads, opts.quick)
    p_rows = [] if opts.decode_only else prefill_rows(heads, opts.quick)
    if "tilelang" in pad_backends:  # the padded calls: the base-2 prefill kernel, the paged fp8 MODEL1 kernel
        base.precompile_tilelang({(PADDED_HEADS, 512, False)} if p_rows else set(),
                                 {(PADDED_HEADS, kv_cache.MODEL1.name)} if d_rows else set())
    timer = base.Timer(device)
    ok = True
    start = time.time()
    if d_rows:
        print("\nDecode (ms; x pad64 = the fastest padded variant's graph time / this one's; TFLOP/s at h_q)\n")
        print("| config | h_q | variant | path | eager ms | graph ms | x pad64 | TFLOP/s | check |")
        print("|---|---|---|---|---|---|---|---|---|")
        for row in d_rows:
            cells = run_decode_row(row, pad_backends, flashmla, timer, device)
            ok &= print_row(row.name, row.h_q, cells, row.flops(), ("eager", "graph"))
            del cells
            torch.cuda.empty_cache()
    if p_rows:
        print("\nPrefill (ms; x pad64 = the fastest padded variant's time / this one's; TFLOP/s at h_q)\n")
        print("| shape | h_q | variant | path | ms | x pad64 | TFLOP/s | check |")
        print("|---|---|---|---|---|---|---|---|")
        for row in p_rows:
            cells = run_prefill_row(row, pad_backends, flashmla, timer, device)
            ok &= print_row(row.name, row.h_q, cells, row.flops(), ("eager",))
            del cells
            torch.cuda.empty_cache()
    print(f"\n{'ALL_MATCH' if ok else 'MISMATCH_OR_ERROR'} ({time.time() - start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
