#!/usr/bin/env python3
"""FlashMLA vs this project's TileLang and Triton paths, through engine.h20_ops.flash_mla, same inputs, one process.

Rows (GPU):
  decode, FlashMLA's V4 configurations (its tests/test_flash_mla_sparse_decoding.py "MODEL1 CONFIG1/2"):
    b in {2, 64, 74, 128, 148, 256}, s_q 2, fp8 MODEL1 caches, 16384 tokens per request in each cache,
    SWA topk 128 over 256-token pages + extra topk 512 (h_q 64) / 1024 (h_q 128) over 64-token pages;
    and the V3.2 one: b 128, h_q 128, s_q 2, topk 2048 over 64-token pages, fp8 656 B. Each eager
    (one Python call per step) and CUDA-graph-captured (replay of one call).
  prefill (s_q 4096, s_kv 8192, bf16 kv): V4-Flash h64 d512 topk 512 and 640, V4-Pro h128 topk 1024
    (sink on), V3.2 h128 d576 topk 2048 (no sink).
Backends (--backends, default all): `flashmla` (the built FlashMLA package on PYTHONPATH, `import
  flash_mla`), `tilelang` and `triton` (engine.h20_ops.flash_mla with DEEPINFER_SPARSE_MLA_BACKEND
  set: the dispatcher picks the path and kernel, shown in the `path` column). Prefill rows also show
  `tilelang-api`: the engine's own sparse_mla_prefill on the TileLang kernel's base-2 variant (no
  max_logits; its lse is compared in natural log): `tilelang` runs the with_max_logits variant, whose
  loop is the same, so the two should time alike. Our flash_mla calls pass out= (as vLLM does).
Inputs: engine.h20_ops.testing's FlashMLA-convention builders (flashmla_decode_case: per-request pages
  placed at random, distinct random tokens per query row, -1 fillers, NaN bytes in unselected slots;
  prefill_case), built once per row and given to every backend.
Timing: CUDA events around each call, a 256 MB L2 flush before each; per backend a warmup, then 3
  rounds interleaved over the backends (FlashMLA, TileLang, Triton, FlashMLA, ...) of >= 20 calls
  each; the median of the round medians. `x FM`: FlashMLA's time / ours (> 1: faster than FlashMLA).
  TFLOP/s: FlashMLA's counting, 2 * b * s_q * h_q * (topk + extra_topk) * (d_qk + 512) (prefill: s_q *
  topk * ...). GB/s (decode): q + out in bf16 plus each distinct token once / graph time.
Check: each of our outputs (out and lse; prefill also max_logits) against FlashMLA's with the project's
  comparator and FlashMLA's tolerances (engine.h20_ops.testing): MATCH / MISMATCH per row. Without
  FlashMLA the rows are timed only ("-").
Robust: a backend that fails on a row prints its error in that row and the run goes on.
Exit status: 0; 1 if any row MISMATCHed or failed.

Usage (H200, about 4 minutes with all backends, TileLang kernels compiled in parallel first):
  PYTHONPATH=/tmp/fmla:$PWD python3 scripts/bench_flash_mla.py [--backends flashmla,tilelang,triton]
      [--decode-only | --prefill-only] [--quick]
  python3 scripts/bench_flash_mla.py --small    (tiny shapes on any device, checks against the float32
      oracle: exercises this script, e.g. on a CPU under Triton's interpreter)
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine.h20_ops  # noqa: E402,F401  (TRITON_INTERPRET on CPU before kernel modules load)
from engine.h20_ops import flash_mla as ours  # noqa: E402
from engine.h20_ops import kv_cache, sparse_mla_prefill  # noqa: E402
from engine.h20_ops import testing as T  # noqa: E402
from engine.h20_ops.attention import dispatch  # noqa: E402

BACKENDS = ("flashmla", "tilelang", "triton")
ROUNDS = 3
MIN_CALLS = 20
ROUND_MS = 40.0  # target time of one round's calls per backend
LN2 = math.log(2.0)


@dataclass(frozen=True)
class DecodeRow:
    name: str
    batch: int
    h_q: int
    layout: kv_cache.Fp8KvLayout
    topk: int
    block_size: int
    s_kv: int
    extra: tuple[int, int, int] | None  # (extra_topk, extra_s_kv, extra_block_size)
    s_q: int = 2

    def flops(self) -> float:
        entries = self.topk + (self.extra[0] if self.extra else 0)
        return 2.0 * self.batch * self.s_q * self.h_q * entries * (self.layout.d + 512)


@dataclass(frozen=True)
class PrefillRow:
    name: str
    s_q: int
    s_kv: int
    h_q: int
    d_qk: int
    topk: int
    sink: bool

    def flops(self) -> float:
        return 2.0 * self.s_q * self.topk * self.h_q * (self.d_qk + 512)


def decode_rows(quick: bool, small: bool) -> list[DecodeRow]:
    if small:
        return [DecodeRow("V4-h64-b2 (small)", 2, 64, kv_cache.MODEL1, 16, 8, 40, (24, 50, 4)),
                DecodeRow("V3.2-b1 (small)", 1, 64, kv_cache.V32, 24, 4, 40, None)]
    batches = (2, 128) if quick else (2, 64, 74, 128, 148, 256)
    rows = [DecodeRow(f"V4-h64-128+512-b{b}", b, 64, kv_cache.MODEL1, 128, 256, 16384, (512, 16384, 64))
            for b in batches]
    rows += [DecodeRow(f"V4-h128-128+1024-b{b}", b, 128, kv_cache.MODEL1, 128, 256, 16384, (1024, 16384, 64))
             for b in batches]
    rows.append(DecodeRow("V3.2-h128-2048-b128", 128, 128, kv_cache.V32, 2048, 64, 32768, None))
    return rows


def prefill_rows(quick: bool, small: bool) -> list[PrefillRow]:
    if small:
        return [PrefillRow("V4-Flash (small)", 4, 256, 64, 512, 64, True)]
    rows = [PrefillRow("V4-Flash h64 topk512", 4096, 8192, 64, 512, 512, True),
            PrefillRow("V4-Flash h64 topk640", 4096, 8192, 64, 512, 640, True),
            PrefillRow("V4-Pro h128 topk1024", 4096, 8192, 128, 512, 1024, True),
            PrefillRow("V3.2 h128 d576 topk2048", 4096, 8192, 128, 576, 2048, False)]
    return rows[:1] if quick else rows


# ---------------------------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------------------------

def use_backend(name: str) -> None:
    """The process's sparse MLA backend from now on (the dispatcher resolves it again)."""
    os.environ["DEEPINFER_SPARSE_MLA_BACKEND"] = name
    dispatch.reset_resolution_for_tests()


def last_choice(op: str) -> str:
    choices = [c["kernel"] for c in dispatch.kernel_choices() if c["op"] == op]
    return choices[-1] if choices else "?"


def available_backends(wanted: list[str], device: torch.device) -> tuple[list[str], list[str], object]:
    """(backends that can run here, notes on the others, the flash_mla module or None)."""
    names, notes, flashmla = [], [], None
    for name in wanted:
        if name == "flashmla":
            if device.type != "cuda":
                notes.append("flashmla: needs a CUDA GPU")
                continue
            try:
                import flash_mla as flashmla  # noqa: F811 (the FlashMLA package, not this project's module)
            except ImportError as exc:
                notes.append(f"flashmla: not importable ({exc}); put the built package on PYTHONPATH")
                continue
        if name == "tilelang":
            if device.type != "cuda":
                notes.append("tilelang: needs a CUDA GPU")
                continue
            try:
                import tilelang  # noqa: F401
            except ImportError as exc:
                notes.append(f"tilelang: not importable ({exc})")
                continue
        names.append(name)
    return names, notes, flashmla


def precompile_tilelang(prefill_variants: set[tuple[int, int, bool]], paged_variants: set[tuple[int, str]]) -> None:
    """Compiles the TileLang kernels the rows need, one process each, in parallel, into TileLang's disk
    cache (this process then loads them): a cold compile takes about a minute per kernel.
    prefill_variants: (h_q, d_qk, with_max_logits) of the prefill kernel; paged_variants: (h_q, layout name) of
    the paged fp8 kernel."""
    jobs = [f"from engine.h20_ops.attention.tilelang_sm90 import compiled_kernel; compiled_kernel({h}, {d}, {m})"
            for h, d, m in sorted(prefill_variants)]
    jobs += [f"from engine.h20_ops.attention.tilelang_sm90_paged_fp8 import compiled_kernel; compiled_kernel({h}, {name!r})"
             for h, name in sorted(paged_variants)]
    start = time.time()
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    procs = [subprocess.Popen([sys.executable, "-c", job], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, env=env) for job in jobs]
    for job, proc in zip(jobs, procs):
        try:
            _, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            err, proc.returncode = "timed out", 1
        if proc.returncode:
            print(f"note: precompiling failed ({job}): {err.strip().splitlines()[-1] if err.strip() else '?'}; "
                  f"the kernel compiles when first used")
    print(f"TileLang kernels precompiled in {time.time() - start:.0f} s ({len(jobs)} in parallel)")


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------

class Timer:
    """Median ms of fn() over calls, each after an L2 flush (CUDA events); wall clock on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def calls_for(self, fn) -> int:
        if self.flush is None:
            return 1
        start = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        est_ms = (time.perf_counter() - start) / 3 * 1e3
        return max(MIN_CALLS, min(500, int(ROUND_MS / max(est_ms, 1e-3))))

    def median_ms(self, fn, calls: int) -> float:
        if self.flush is None:
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
        for s, e in zip(starts, ends):
            self.flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def captured(fn, device: torch.device):
    """fn captured in a CUDA graph (warmed up on a side stream first, as torch asks) -> graph.replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@dataclass
class Cell:
    """One backend on one row."""

    fn: object = None  # the eager call
    backend: str | None = None  # the process's sparse MLA backend while fn runs (None: it names its kernel)
    path: str = ""
    result: tuple | None = None  # what the first call returned
    split: bool = False
    error: str | None = None
    check: str = "-"
    modes: dict = field(default_factory=dict)  # mode -> (callable, calls, [ms per round])


def short_error(exc: BaseException) -> str:
    line = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return line if len(line) < 160 else line[:157] + "..."


def interleaved(cells: dict[str, Cell], timer: Timer, mode: str) -> None:
    """ROUNDS rounds over the backends of one mode; the medians go into cells[..].modes[mode]."""
    live = {name: cell for name, cell in cells.items() if mode in cell.modes and cell.error is None}
    for _ in range(ROUNDS):
        for name, cell in live.items():
            fn, calls, times = cell.modes[mode]
            if cell.backend is not None:  # the entry points resolve the backend per call (eager prefill)
                use_backend(cell.backend)
            try:
                times.append(timer.median_ms(fn, calls))
            except Exception as exc:  # noqa: BLE001 (a row's failure is printed, the run goes on)
                cell.error = short_error(exc)
                break


def time_of(cell: Cell, mode: str) -> float | None:
    if cell.error is not None or mode not in cell.modes or len(cell.modes[mode][2]) < ROUNDS:
        return None
    return statistics.median(cell.modes[mode][2])


# ---------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------

def compare(name: str, got: tuple, want: tuple, tolerances) -> str:
    """got / want: (out, lse natural[, max_logits])."""
    try:
        for label, g, w, tol in zip(("out", "lse", "max_logits"), got, want, tolerances):
            T.assert_close(f"{name} {label}", g, w, tol)
    except AssertionError as exc:
        return f"MISMATCH ({str(exc).splitlines()[0]})"
    return "MATCH"


def record_error(cell: Cell, exc: BaseException) -> None:
    cell.error = short_error(exc)
    if os.environ.get("BENCH_TRACEBACK"):
        traceback.print_exc()


def check_cells(cells: dict[str, Cell], oracle, tolerances) -> None:
    """Each cell of ours against FlashMLA's result, or without it against oracle() when given (None: no
    check); tolerances(cell): one per compared tensor. Results are (out, lse natural[, max_logits])."""
    reference = cells["flashmla"].result if "flashmla" in cells else None
    if reference is None and oracle is not None:
        reference = oracle()
    if reference is None:
        return
    for name, cell in cells.items():
        if name != "flashmla" and cell.result is not None:
            cell.check = compare(name, cell.result, reference[:len(cell.result)], tolerances(cell))


def run_decode_row(row: DecodeRow, backends: list[str], flashmla, timer: Timer, device, small: bool) -> dict:
    case = T.flashmla_decode_case(1, batch=row.batch, s_q=row.s_q, h_q=row.h_q, layout=row.layout, topk=row.topk,
                                  s_kv=row.s_kv, block_size=row.block_size, extra=row.extra, strided_q=False,
                                  oracle_rows=small, device=device)
    kwargs = T.flashmla_decode_kwargs(case)
    cells: dict[str, Cell] = {}
    for name in backends:
        cell = cells[name] = Cell()
        try:
            if name == "flashmla":
                meta, _ = flashmla.get_mla_metadata()
                cell.fn = lambda meta=meta: flashmla.flash_mla_with_kvcache(case.q, case.main.cache, None, None, 512,
                                                                            meta, None, **kwargs)
                cell.path = "FlashMLA sparse fp8 decode"
            else:
                cell.backend = name
                use_backend(name)
                meta, _ = ours.get_mla_metadata()
                out = torch.empty(*case.q.shape[:3], 512, dtype=case.q.dtype, device=device)
                cell.fn = lambda meta=meta, out=out: ours.flash_mla_with_kvcache(case.q, case.main.cache, None, None,
                                                                                 512, meta, **kwargs, out=out)
            result = cell.fn()
            cell.result = tuple(t.clone() for t in result)
            if name != "flashmla":
                cell.path = f"{meta.plan.path}: {meta.plan.kernel}, {meta.plan.splits} split(s)"
                cell.split = meta.plan.splits > 1
            cell.modes["eager"] = (cell.fn, timer.calls_for(cell.fn), [])
            if device.type == "cuda":
                replay = captured(cell.fn, device)
                cell.modes["graph"] = (replay, timer.calls_for(replay), [])
        except Exception as exc:  # noqa: BLE001 (a cell's failure is printed, the run goes on)
            record_error(cell, exc)
    def oracle():
        ref = case.oracle()
        return ref.out, ref.lse.transpose(1, 2)

    check_cells(cells, oracle if small else None,
                lambda cell: (T.out_tolerance(T.DECODE_OUT, cell.result[0], split=cell.split), T.DECODE_LSE))
    for mode in ("eager", "graph"):
        interleaved(cells, timer, mode)
    distinct = int(torch.unique(case.indices).numel()) + (
        int(torch.unique(case.extra_indices).numel()) if case.extra is not None else 0)
    io_bytes = 2.0 * row.batch * row.s_q * row.h_q * (row.layout.d + 512) + distinct * row.layout.bytes_per_token
    return dict(cells=cells, flops=row.flops(), bytes=io_bytes)


def run_prefill_row(row: PrefillRow, backends: list[str], flashmla, timer: Timer, device, small: bool) -> dict:
    """Results are kept as (out, lse natural[, max_logits]) for the comparison."""
    case = T.prefill_case(2, s_q=row.s_q, s_kv=row.s_kv, h_q=row.h_q, topk=row.topk, d_qk=row.d_qk, sink=row.sink,
                          poison=small, strided=False, device=device)
    names = list(backends) + (["tilelang-api"] if "tilelang" in backends else [])
    cells: dict[str, Cell] = {}
    for name in names:
        cell = cells[name] = Cell()
        try:
            if name == "flashmla":
                cell.fn = lambda: flashmla.flash_mla_sparse_fwd(case.q, case.kv, case.indices, case.sm_scale, 512,
                                                                case.attn_sink, None)
                cell.path = "FlashMLA sparse prefill"
            elif name == "tilelang-api":
                cell.backend = "tilelang"
                use_backend("tilelang")
                cell.fn = lambda: sparse_mla_prefill(case.q, case.kv, case.indices, case.sm_scale,
                                                     attn_sink=case.attn_sink)
            else:
                cell.backend = name
                use_backend(name)
                out_buf = torch.empty(row.s_q, row.h_q, 512, dtype=case.q.dtype, device=device)
                cell.fn = lambda out_buf=out_buf: ours.flash_mla_sparse_fwd(case.q, case.kv, case.indices,
                                                                            case.sm_scale, attn_sink=case.attn_sink,
                                                                            out=out_buf)
            result = cell.fn()
            if name == "tilelang-api":
                cell.result = (result.out.clone(), result.lse_log2 * LN2)
            else:  # (out, max_logits, lse) as FlashMLA returns them
                cell.result = (result[0].clone(), result[2].clone(), result[1].clone())
            if name != "flashmla":
                cell.path = f"{'sparse_mla_prefill: ' if name == 'tilelang-api' else ''}{last_choice('prefill')}"
            cell.modes["eager"] = (cell.fn, timer.calls_for(cell.fn), [])
        except Exception as exc:  # noqa: BLE001 (a cell's failure is printed, the run goes on)
            record_error(cell, exc)
    def oracle():
        ref = case.oracle()
        return ref.out, ref.lse, ref.max_logits

    check_cells(cells, oracle if small else None,
                lambda cell: (T.out_tolerance(T.PREFILL_OUT, cell.result[0]), T.PREFILL_STATS, T.PREFILL_STATS))
    interleaved(cells, timer, "eager")
    return dict(cells=cells, flops=row.flops(), bytes=None)


# ---------------------------------------------------------------------------------------------
# table
# ---------------------------------------------------------------------------------------------

def fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else (f"{ms:.4f}" if ms < 1 else f"{ms:.3f}")


def ratio(fm: float | None, mine: float | None, name: str) -> str:
    if name == "flashmla":
        return "1.00x" if fm is not None else "-"
    return "-" if fm is None or mine is None else f"{fm / mine:.2f}x"


def print_rows(row_name: str, res: dict, modes: tuple[str, ...]) -> bool:
    """Prints one row's lines (one per backend); returns False on a mismatch or an error."""
    cells = res["cells"]
    fm = cells.get("flashmla")
    ok = True
    for name, cell in cells.items():
        cols = [row_name, name, cell.path or "-"]
        best = None
        for mode in modes:
            ms = time_of(cell, mode)
            fm_ms = time_of(fm, mode) if fm is not None else None
            cols += [fmt_ms(ms), ratio(fm_ms, ms, name)]
            best = ms if ms is not None else best
        cols.append("-" if best is None else f"{res['flops'] / (best * 1e-3) / 1e12:.1f}")
        if res["bytes"] is not None:
            cols.append("-" if best is None else f"{res['bytes'] / (best * 1e-3) / 1e9:.0f}")
        status = cell.check if cell.error is None else f"ERROR {cell.error}"
        cols.append(status)
        ok &= cell.error is None and not status.startswith("MISMATCH")
        print("| " + " | ".join(cols) + " |", flush=True)
    return ok


def header_line() -> str:
    import triton
    try:
        import tilelang
        tl_version = tilelang.__version__
    except ImportError:
        tl_version = "n/a"
    try:
        import flash_mla as fm
        fm_version = f"{getattr(fm, '__version__', '?')} ({Path(fm.__file__).parent})"
    except ImportError:
        fm_version = "n/a"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} | {gpu} | torch {torch.__version__} "
            f"| triton {triton.__version__} | tilelang {tl_version} | FlashMLA {fm_version}\n"
            f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"comma-separated subset of {','.join(BACKENDS)} (default: all)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--decode-only", action="store_true")
    only.add_argument("--prefill-only", action="store_true")
    parser.add_argument("--quick", action="store_true", help="b in {2, 128} and one prefill shape")
    parser.add_argument("--small", action="store_true", help="tiny shapes on any device, checked against the oracle")
    opts = parser.parse_args()
    wanted = [b for b in opts.backends.split(",") if b]
    unknown = [b for b in wanted if b not in BACKENDS]
    if unknown or not wanted:
        parser.error(f"--backends: expected a comma-separated subset of {','.join(BACKENDS)}, got {opts.backends!r}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not opts.small:
        print("bench_flash_mla.py needs a CUDA GPU (or --small)")
        return 2
    logging.getLogger("engine").setLevel(logging.ERROR)  # the dispatcher's choices are in the path column
    backends, notes, flashmla = available_backends(wanted, device)
    print(header_line())
    for note in notes:
        print("note:", note)
    if not backends:
        return 1
    d_rows = [] if opts.prefill_only else decode_rows(opts.quick, opts.small)
    p_rows = [] if opts.decode_only else prefill_rows(opts.quick, opts.small)
    if "tilelang" in backends:
        # decode's gathered / direct paths run the base-2 variant; flash_mla_sparse_fwd the max_logits one
        precompile_tilelang({(r.h_q, r.layout.d, False) for r in d_rows}
                            | {(r.h_q, r.d_qk, m) for r in p_rows for m in (False, True)},
                            {(r.h_q, r.layout.name) for r in d_rows})
    timer = Timer(device)
    ok = True
    start = time.time()
    if d_rows:
        print("\nDecode (ms; x FM = FlashMLA's time / this one's; TFLOP/s and GB/s at the graph time)\n")
        print("| config | backend | path | eager ms | x FM | graph ms | x FM | TFLOP/s | GB/s | check |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for row in d_rows:
            res = run_decode_row(row, backends, flashmla, timer, device, opts.small)
            ok &= print_rows(row.name, res, ("eager", "graph"))
            del res
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if p_rows:
        print("\nPrefill (ms; x FM = FlashMLA's time / this one's)\n")
        print("| shape | backend | path | ms | x FM | TFLOP/s | check |")
        print("|---|---|---|---|---|---|---|")
        for row in p_rows:
            res = run_prefill_row(row, backends, flashmla, timer, device, opts.small)
            ok &= print_rows(row.name, res, ("eager",))
            del res
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"\n{'ALL_MATCH' if ok else 'MISMATCH_OR_ERROR'} ({time.time() - start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
