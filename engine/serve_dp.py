"""Data-parallel serving: N full replicas of the engine, one process per rank, results gathered on rank 0.

Each rank is a torch.multiprocessing "spawn" process in one torch.distributed process group. It builds
its own engine (own weights, own KV cache, own continuous-batching scheduler) and serves its share of
the requests, assigned round-robin by prompt index, plus one control prompt that EVERY rank serves
(identical tokens on every rank is the DP consistency check). Ranks exchange nothing while serving.

Sampling: the job's SamplingParams (None: greedy) reach every rank; prompt i samples with seed
seed + i and the control prompt with seed + len(prompts) on every rank (request_sampling), so
prompts differ from each other while the control prompt stays identical across ranks.

Teacher forcing (DPJob.forced, per prompt): after serving, each rank runs its share once more with
Request.forced_output_ids = forced[i], so that a run's logits can be compared step by step along
given tokens (the report's bf16 gate); that pass is not timed and its tokens are the given ones.

Process group: gloo on CPU. On GPU, rank r runs on cuda:(r % device_count) and the group is NCCL when
every rank owns a GPU; NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so with more ranks
than GPUs (8 ranks on 1 or 2 H200s) the group is gloo: it carries only the result gather, never model
tensors. NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set in
every GPU rank before the group is created.

Failure handling -- nothing waits forever:
- an exception in a rank (engine construction, serving) is caught into that rank's record (type, text,
  traceback); the rank still takes part in the gather, so the failure is reported by rank 0;
- before the gather, every rank marks itself ready in the group's store ("ok", or "no-group" when its
  group init failed); rank 0 waits for all marks up to the run deadline and then publishes a verdict.
  If a rank is absent (hung, crashed) or has no group, a collective would hang, so instead every rank
  that marked itself sends its own record (with its own error) to the launcher, and rank 0 names the
  absent ranks and those without a group;
- the collectives carry a timeout (init_process_group(timeout=...)), and the launcher is a watchdog:
  GRACE_S after the deadline it kills every rank still running and reports each one that gave nothing.

Results reach the launcher through one pipe per rank (a killed rank ends its own pipe and cannot block
the launcher). Records carry step logits as numpy arrays (plain pickles; torch tensors sent between
processes would use shared-memory handles that die with the sending process).
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_connections
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:  # engine.runner loads the model stack; ranks that sample import it on unpickling the job
    from engine.runner import SamplingParams

# The launcher kills ranks this long after the deadline; ranks need part of it to report after
# rank 0's verdict (VERDICT_WAIT_S) and to exit.
GRACE_S = 30.0
VERDICT_WAIT_S = 10.0
GPU_DIST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CONTROL_REQUEST_ID = "control"


@dataclass(frozen=True)
class EngineFactory:
    """Builds the real engine on a rank's device (picklable, so it travels to spawned ranks)."""

    checkpoint_dir: str
    dtype: torch.dtype
    kv_cache_dtype: str
    max_batch_size: int = 8

    def __call__(self, device: torch.device):
        from engine.runner import Engine

        return Engine(self.checkpoint_dir, device=device, dtype=self.dtype,
                      kv_cache_dtype=self.kv_cache_dtype, max_batch_size=self.max_batch_size)


@dataclass(frozen=True)
class DPJob:
    """What every rank serves. `engine_factory(device)` returns an object with the Engine API
    (generate(list[Request]) -> list[Completion]) and must be picklable (module-level)."""

    engine_factory: Callable[[torch.device], Any]
    prompts: tuple[tuple[int, ...], ...]
    control_prompt: tuple[int, ...]
    max_new_tokens: int
    ranks: int = 8
    device_type: str = "cpu"
    timeout_s: float = 600.0
    environ: tuple[tuple[str, str], ...] = ()  # applied in every rank before anything runs
    sampling: SamplingParams | None = None  # None: every request greedy; seeds per request: request_sampling
    forced: tuple[tuple[int, ...], ...] | None = None  # per prompt: the tokens of the teacher-forced pass

    def __post_init__(self):
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"ranks: expected an int >= 1, got {self.ranks!r}")
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type: expected 'cpu' or 'cuda', got {self.device_type!r}")
        if self.device_type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device_type: 'cuda' requested but torch sees no CUDA device")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {self.max_new_tokens!r}")
        if not self.control_prompt or any(len(p) == 0 for p in self.prompts):
            raise ValueError("prompts/control_prompt: every prompt needs at least one token")
        if not 0 < self.timeout_s < 10**7:  # also refuses nan and inf (a timedelta of them overflows in the ranks)
            raise ValueError(f"timeout_s: expected a number of seconds in (0, 1e7), got {self.timeout_s!r}")
        # applied in each rank before its record exists: an error there would only reach the rank's stderr
        if not isinstance(self.environ, tuple) or any(
                not isinstance(pair, tuple) or len(pair) != 2 or not all(isinstance(x, str) for x in pair)
                or not pair[0] or "=" in pair[0] or "\0" in pair[0] + pair[1] for pair in self.environ):
            raise ValueError(f"environ: expected a tuple of (name, value) string pairs (names non-empty, without "
                             f"'=' or NUL), got {self.environ!r}")
        if self.forced is not None and (len(self.forced) != len(self.prompts)
                                        or any(len(f) != self.max_new_tokens for f in self.forced)):
            raise ValueError(f"forced: expected one tuple of max_new_tokens = {self.max_new_tokens} tokens per prompt "
                             f"({len(self.prompts)}), got lengths {[len(f) for f in self.forced]}")
        if self.sampling is not None:
            from engine.runner import SamplingParams

            if not isinstance(self.sampling, SamplingParams):
                raise TypeError(f"sampling: expected a SamplingParams or None, got {type(self.sampling).__name__}")
            request_sampling(self.sampling, len(self.prompts))  # the largest seed must be an int64 too


@dataclass
class RankRecord:
    rank: int
    device: str = ""
    ok: bool = False
    stage: str = "start"  # where the rank was when it stopped: start, init, engine, serve, forced, done
    error: dict | None = None  # {"type", "message", "traceback"}
    module_not_found_failures: int = 0  # 1 when a ModuleNotFoundError is anywhere in the rank's errors
    backend: str | None = None
    backend_reason: str | None = None
    tilelang_missing: str | None = None
    op_fallbacks: dict[str, int] = field(default_factory=dict)
    kernel_source: dict | None = None  # engine.kernel_source.report(): source, commit, digest, fallbacks
    prompt_indices: list[int] = field(default_factory=list)
    completions: dict[str, dict] = field(default_factory=dict)  # request_id -> {output_ids, step_logits}
    forced_logits: dict[str, Any] = field(default_factory=dict)  # request_id -> step logits of the forced pass
    generated_tokens: int = 0
    serve_seconds: float = 0.0
    tokens_per_s: float = 0.0
    engine_stats: dict = field(default_factory=dict)

    def fail(self, exc: BaseException) -> None:
        self.ok = False
        self.error = {"type": type(exc).__name__, "message": str(exc),
                      "traceback": "".join(traceback.format_exception(exc))[-4000:]}
        if has_module_not_found(exc):
            self.module_not_found_failures = 1


@dataclass
class DPResult:
    records: list[RankRecord]  # one per rank, in rank order
    dist_backend: str
    dist_backend_reason: str
    gathered: bool  # True: records arrived through rank 0's gather; False: the failure path
    notes: list[str]
    wall_seconds: float

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.records)


def has_module_not_found(exc: BaseException | None) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ModuleNotFoundError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def round_robin(n_prompts: int, ranks: int) -> list[list[int]]:
    """Prompt indices served by each rank: prompt i goes to rank i % ranks."""
    return [list(range(r, n_prompts, ranks)) for r in range(ranks)]


def prompt_request_id(index: int) -> str:
    return f"prompt-{index}"


def request_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """The params of prompt `index` (the control prompt: index len(prompts)): seed + index."""
    return replace(sampling, seed=sampling.seed + index)


def choose_dist_backend(device_type: str, ranks: int) -> tuple[str, str]:
    if device_type == "cpu":
        return "gloo", "CPU ranks"
    count = torch.cuda.device_count()
    if ranks <= count:
        return "nccl", f"{ranks} ranks on {count} GPUs: one GPU per rank"
    return "gloo", (f"{ranks} ranks share {count} GPU(s); NCCL refuses two ranks on one GPU, so the "
                    "result gather runs over gloo (ranks exchange no model tensors)")


def _rank_device(device_type: str, rank: int) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def _serve_share(record: RankRecord, job: DPJob, device: torch.device) -> None:
    from engine.runner import Request

    record.stage = "engine"
    engine = job.engine_factory(device)
    record.stage = "serve"
    record.prompt_indices = round_robin(len(job.prompts), job.ranks)[record.rank]
    def request(request_id: str, prompt, index: int) -> Request:
        if job.sampling is None:
            return Request(request_id, list(prompt), job.max_new_tokens)
        return Request(request_id, list(prompt), job.max_new_tokens, request_sampling(job.sampling, index))

    control = request(CONTROL_REQUEST_ID, job.control_prompt, len(job.prompts))
    share = [request(prompt_request_id(i), job.prompts[i], i) for i in record.prompt_indices]
    requests = [control, *share]
    start = time.perf_counter()
    # The control prompt runs in a batch of its own on every rank, so its batch (and every GEMM
    # shape) is the same everywhere: the agreement check compares replicas; batch invariance is a
    # separate property the bf16 GEMMs do not have.
    completions = engine.generate([control]) + (engine.generate(share) if share else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    record.serve_seconds = time.perf_counter() - start
    got = sorted(c.request_id for c in completions)
    if got != sorted(r.request_id for r in requests):
        raise RuntimeError(f"engine returned completions for {got}, expected {[r.request_id for r in requests]}")
    for c in completions:
        record.completions[c.request_id] = {
            "output_ids": [int(t) for t in c.output_ids],
            "step_logits": c.step_logits.detach().float().cpu().numpy(),
        }
    record.generated_tokens = sum(len(c.output_ids) for c in completions)
    record.tokens_per_s = record.generated_tokens / record.serve_seconds if record.serve_seconds > 0 else 0.0
    record.engine_stats = _plain(engine.stats())
    if job.forced is not None and share:
        record.stage = "forced"
        forced = engine.generate([Request(prompt_request_id(i), list(job.prompts[i]), job.max_new_tokens,
                                          forced_output_ids=list(job.forced[i])) for i in record.prompt_indices])
        record.forced_logits = {c.request_id: c.step_logits.detach().float().cpu().numpy() for c in forced}
    record.stage = "done"
    record.ok = True


def _plain(value):
    """JSON-able copy of an engine's stats dict."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


def _report_dispatch_state(record: RankRecord) -> None:
    """Kernel source, backend resolution and op fallbacks, also for a rank that failed (what it would
    have used)."""
    try:
        from engine import kernel_source

        record.kernel_source = kernel_source.report()
    except Exception as exc:  # e.g. a strict hub source that cannot be used: the rank's error already says so
        record.kernel_source = {"error": f"{type(exc).__name__}: {exc}"}
        if has_module_not_found(exc):
            record.module_not_found_failures = 1
    try:
        from engine import kernel_source

        res = kernel_source.attention_dispatch().backend_resolution()
        record.backend, record.backend_reason, record.tilelang_missing = res.backend, res.reason, res.tilelang_missing
    except Exception as exc:  # reported, and counted when it is a ModuleNotFoundError
        record.backend_reason = f"resolution failed: {type(exc).__name__}: {exc}"
        if has_module_not_found(exc):
            record.module_not_found_failures = 1
    try:
        from engine.kernel_source import op_fallback_counts

        record.op_fallbacks = {k: int(v) for k, v in op_fallback_counts().items() if v}
    except Exception as exc:
        if record.error is None:
            record.fail(exc)
        elif has_module_not_found(exc):
            record.module_not_found_failures = 1


def _wait_ready(store, ranks: int, deadline: float) -> tuple[list[int], list[int]]:
    """(ranks without a ready mark, ranks whose mark says their group init failed), after waiting for
    every mark up to `deadline`."""
    keys = [f"deepinfer/ready/{r}" for r in range(ranks)]
    while time.time() < deadline and not store.check(keys):
        time.sleep(0.2)
    absent = [r for r, k in enumerate(keys) if not store.check([k])]
    no_group = [r for r, k in enumerate(keys) if r not in absent and store.get(k) != b"ok"]
    return absent, no_group


def _rank_main(rank: int, job: DPJob, store_path: str, backend: str, deadline: float, results) -> None:
    """results: the write end of this rank's pipe to the launcher (_ResultPipes)."""
    import torch.distributed as dist

    os.environ.update(dict(job.environ))
    record = RankRecord(rank=rank)
    store = None
    group_ok = False
    try:
        store = dist.FileStore(store_path, job.ranks)
        device = _rank_device(job.device_type, rank)
        record.device = str(device)
        if device.type == "cuda":
            os.environ.update(GPU_DIST_ENV)
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.ranks))
        from engine import config

        config.validate_all()
        record.stage = "init"
        # Init waits for every rank (gloo connects eagerly): it must give up by the deadline so that
        # the ranks that are present still report before the watchdog fires.
        dist.init_process_group(backend, store=store, rank=rank, world_size=job.ranks,
                                timeout=timedelta(seconds=max(5.0, deadline - time.time())))
        group_ok = True
        _serve_share(record, job, device)
    except Exception as exc:
        record.fail(exc)
    _report_dispatch_state(record)

    gathered = False
    try:
        if store is None:
            raise RuntimeError("the rank could not open the group's store")
        store.set(f"deepinfer/ready/{rank}", "ok" if group_ok else "no-group")
        if rank == 0:
            absent, no_group = _wait_ready(store, job.ranks, deadline)
            verdict = "gather" if not absent and not no_group else \
                f"absent={','.join(map(str, absent))};no-group={','.join(map(str, no_group))}"
            store.set("deepinfer/verdict", verdict)
        else:
            store.set_timeout(timedelta(seconds=max(1.0, deadline + VERDICT_WAIT_S - time.time())))
            store.wait(["deepinfer/verdict"])
        verdict = store.get("deepinfer/verdict").decode()
        if verdict == "gather":
            records = [None] * job.ranks if rank == 0 else None
            dist.gather_object(record, records, dst=0)
            if rank == 0:
                results.send(("gathered", records))
            gathered = True
        elif rank == 0:
            results.send(("no gather", (absent, no_group)))
    except Exception as exc:
        results.send(("note", f"rank {rank}: result exchange failed: {type(exc).__name__}: {exc}"))
    if not gathered:
        results.send(("record", record))
    if group_ok:
        try:
            dist.destroy_process_group()
        except Exception:  # the process exits next; a failed teardown changes no result
            pass


def _missing_record(rank: int, exitcode: int | None, killed_after_s: float | None) -> RankRecord:
    record = RankRecord(rank=rank, stage="unknown")
    if killed_after_s is not None:
        message = f"no result: still running {killed_after_s:.0f} s after start; killed by the watchdog"
    elif exitcode != 0:
        message = f"no result: process exited with code {exitcode}"
    else:
        message = "no result: process exited without reporting"
    record.error = {"type": "NoResult", "message": message, "traceback": ""}
    return record


class _ResultPipes:
    """One pipe per rank from the rank to the launcher. Each rank holds the only write end of its own
    pipe, so a rank that exits, or is killed in the middle of a message, ends its pipe (EOF) and the
    launcher drops that partial message; a queue shared by the ranks would leave the launcher blocked
    forever on the rest of a message that never comes (its own copy of the write end keeps it open)."""

    def __init__(self, ctx, ranks: int):
        self._pairs = [ctx.Pipe(duplex=False) for _ in range(ranks)]
        self._open: list = []  # the read ends of the pipes that have not ended

    def writer(self, rank: int):
        return self._pairs[rank][1]

    def started(self) -> None:
        """Call once every rank has started: closes the launcher's copies of the write ends."""
        for _, writer in self._pairs:
            writer.close()
        self._open = [reader for reader, _ in self._pairs]

    @property
    def open(self) -> bool:
        """Whether some rank's pipe can still deliver a message."""
        return bool(self._open)

    def receive(self, timeout: float, take: Callable[[Any], None]) -> int:
        """Hands every message that arrives within `timeout` to `take`; returns how many pipes were ready.
        A pipe at its end (the rank exited or was killed, also mid-message) is closed."""
        if not self._open:
            time.sleep(timeout)
            return 0
        ready = wait_for_connections(self._open, timeout)
        for conn in ready:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                conn.close()
                self._open.remove(conn)
                continue
            take(message)
        return len(ready)


def serve(job: DPJob, progress: Callable[[str], None] | None = None) -> DPResult:
    """Run `job` on job.ranks spawned ranks; returns one record per rank (never hangs past the
    deadline: job.timeout_s after start plus GRACE_S)."""
    import torch.multiprocessing as mp

    start = time.time()
    deadline = start + job.timeout_s
    backend, backend_reason = choose_dist_backend(job.device_type, job.ranks)
    ctx = mp.get_context("spawn")
    pipes = _ResultPipes(ctx, job.ranks)
    notes: list[str] = []
    by_rank: dict[int, RankRecord] = {}
    gathered = False
    with tempfile.TemporaryDirectory(prefix="deepinfer-dp-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, job, store_path, backend, deadline, pipes.writer(r)),
                             name=f"dp-rank-{r}") for r in range(job.ranks)]
        for p in procs:
            p.start()
        pipes.started()
        if progress:
            progress(f"{job.ranks} ranks started ({backend})")

        absent: set[int] = set()
        verdict_seen = False

        def take(msg) -> None:
            nonlocal gathered, verdict_seen
            kind, payload = msg
            if kind == "gathered":
                gathered = True
                by_rank.update({r.rank: r for r in payload})
            elif kind == "record":
                by_rank.setdefault(payload.rank, payload)
            elif kind == "no gather":
                verdict_seen = True
                absent_ranks, no_group = payload
                absent.update(absent_ranks)
                if absent_ranks:
                    notes.append(f"rank 0 stopped waiting for ranks {absent_ranks} at the deadline; no gather")
                if no_group:
                    notes.append(f"ranks {no_group} could not join the process group (their records say why); "
                                 "no gather")
            else:
                notes.append(payload)

        def done() -> bool:
            if gathered or len(by_rank) == job.ranks:
                return True
            # after rank 0's verdict, every rank that is not absent reports its own record
            return verdict_seen and all(r in by_rank for r in range(job.ranks) if r not in absent)

        # Every pipe ends once its rank has exited, so this also stops when all ranks are gone.
        while not done() and pipes.open and time.time() < deadline + GRACE_S:
            pipes.receive(0.2, take)
        killed_after: dict[int, float] = {}
        for r, p in enumerate(procs):
            # Keep reading while waiting: a rank blocked in sending a large message can then finish.
            wait_until = time.time() + (0.0 if r in absent else max(0.0, min(10.0, deadline + GRACE_S - time.time())))
            while p.is_alive() and time.time() < wait_until:
                pipes.receive(min(0.1, max(0.0, wait_until - time.time())), take)
            if p.is_alive():
                p.kill()
                p.join()
                killed_after[r] = time.time() - start
            p.join()
        while pipes.receive(0.1, take):  # messages sent just before exit; every rank has exited by now
            pass
    records = [by_rank.get(r) or _missing_record(r, procs[r].exitcode, killed_after.get(r)) for r in range(job.ranks)]
    return DPResult(records, backend, backend_reason, gathered, notes, time.time() - start)


def control_agreement(records: list[RankRecord]) -> tuple[int, list[int] | None]:
    """(ranks whose control tokens equal the most common control output, that output). A rank without
    a control completion never agrees; ties go to the output of the lowest rank."""
    outputs = [tuple(r.completions[CONTROL_REQUEST_ID]["output_ids"]) if CONTROL_REQUEST_ID in r.completions else None
               for r in records]
    counts = Counter(o for o in outputs if o is not None)
    if not counts:
        return 0, None
    best = max(counts.values())
    winner = next(o for o in outputs if o is not None and counts[o] == best)
    return best, list(winner)
