"""Single-process engine: greedy or sampled decoding of DeepSeek-V4 with continuous batching,
optionally speculative with the checkpoint's NextN (MTP) layer.

Token selection: each Request carries SamplingParams (default greedy). A step with a sampled request
picks the tokens of its whole batch with ONE fused_sample launch (greedy and sampled requests mixed:
temperature 0 rows take the first argmax); an all-greedy step takes fused_sample's greedy kernel with
NextN and torch.argmax without; a sampled token draws from the request's own Philox stream (its seed, the
token's position in its sequence), so it does not depend on the batch it ran in. The mapping of
prefill, decode, draft and verify draws to (seed, position, draw): docs/sampling.md, "In the engine".

Scheduling: requests wait in arrival order. Each iteration first admits waiting requests while the
batch has room (max_batch_size) and the KV stores can reserve their worst case (prompt +
max_new_tokens); admitted requests are prefilled together in one packed step, which yields their
first token. Otherwise all running requests decode one token in one batched step. A request
finishes after exactly max_new_tokens tokens (EOS does not stop it, as in the oracle) and frees its
pages at once, so the next iteration can admit a waiting request while the others keep decoding.
Because requests end only there, the next decode batch is known before a step's tokens are: while the
GPU runs a plain decode step, the host advances the lengths, releases old window rows and builds the
next step's metadata (Engine._prepare_next_decode), then reads the tokens back.

NextN decoding (DEEPINFER_USE_NEXTN_DECODE=1, k = num_speculative_tokens drafts per step):
  - after a request's prefill, the NextN layer runs over the prompt (row i: token i + 1 and the
    main model's hidden state h_i) and drafts k tokens with the request's SamplingParams on the
    stream's draft lane (chained drafts feed its own hidden state back); their logits are kept;
  - a decode step verifies every running request's [last token, k drafts] in ONE main-model
    forward (sparse_mla_decode with s_q = k + 1), then sampling.rejection_sample accepts a
    prefix (sampled: draft x kept with probability min(1, p_target(x) / p_draft(x)); greedy: iff
    it equals the target argmax) and emits the correction token, or a bonus token when all k are
    accepted: 1 .. k + 1 tokens per step;
  - rejected positions leave no state: the main model's compressors are rolled back
    (DeepseekV4Runtime.rollback) and pages holding only rejected rows are given back (window and
    compressed stores, PagedRows.truncate);
  - the NextN layer then runs once over the k + 1 verified rows (those past the accepted ones are
    dropped again) and drafts the next k tokens.
Greedy tokens are therefore the non-speculative engine's (and the oracle's); sampled tokens follow
the target distribution (rejection sampling), not the non-speculative engine's draws. Each emitted
token's step_logits row is the raw verifier logits row it was taken from. stats() adds the
acceptance rate.

The model is transformers' DeepseekV4ForCausalLM (weights, routers, embeddings, head) driven by
engine.model.deepseek_v4 (norms/RoPE through engine.ops, attention through
engine.h20_ops.sparse_mla_prefill / sparse_mla_decode, each op from engine.kernel_source's table;
KV and compressor state in engine.kv_store).

CUDA graphs (cuda_graphs, on by default on a CUDA device): each plain decode step replays the graph of
its static shapes (engine.model.decode_graphs: padded batch, s_q, entry table widths), captured on the
first step of those shapes; NextN steps, prefill and sampling run eagerly. stats()["cuda_graphs"] says
whether graphs ran, how many were captured and replayed.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import config, kernel_source
from engine.h20_ops import sampling
from engine.kv_store import KV_CACHE_DTYPES, CompressorStates, PagedRows, RequestState
from engine.model.decode_graphs import DecodeGraphs
from engine.model.deepseek_v4 import DeepseekV4Runtime, NextNRuntime, SeqStep, Stores, compressor_specs
from engine.model.layer_types import CSA, HCA
from engine.model.hf_oracle import load_hf_model
from engine.model.nextn import load_nextn_layer

PAGE_SIZE = 64
DEFAULT_MAX_SEQ_LEN = 4096
_FP32 = torch.finfo(torch.float32)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (semantics: docs/sampling.md). temperature 0: greedy (first
    argmax; top_k / top_p ignored); top_k 0: off; top_p 1.0: off; seed: the key of the request's
    Philox stream (same seed and prompt, same tokens; requests that should differ need different seeds)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"SamplingParams.{name}: expected a number, got {type(value).__name__}")
        for name in ("top_k", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"SamplingParams.{name}: expected an int, got {type(value).__name__}")
        for name in ("temperature", "top_p"):
            try:
                float(getattr(self, name))
            except OverflowError:  # an int beyond any float: the checks below would raise it bare
                raise ValueError(f"SamplingParams.{name}: expected a finite number, got an int too large for a "
                                 f"float") from None
        # The kernels take log2(e) / temperature in fp32: it must be a normal fp32 value (an infinite
        # one gives NaN weights; a subnormal one reads as 0, i.e. greedy, where fast math flushes it).
        if self.temperature != 0:
            positive = math.isfinite(self.temperature) and self.temperature > 0
            scale = sampling.sampling_scale(torch.tensor([float(self.temperature)])).item() if positive else 0.0
            if not _FP32.tiny <= scale <= _FP32.max:
                hottest = math.log2(math.e) / _FP32.tiny
                raise ValueError(f"SamplingParams.temperature: expected 0 (greedy) or a number whose log2(e) / T "
                                 f"is a normal fp32 (T in about [{_FP32.tiny:.3g}, {hottest:.3g}]), "
                                 f"got {self.temperature!r}")
        if not 0 <= self.top_k < 2**63:
            raise ValueError(f"SamplingParams.top_k: expected an int64 >= 0 (0: off), got {self.top_k!r}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"SamplingParams.top_p: expected a number in (0, 1] (1: off), got {self.top_p!r}")
        if not -2**63 <= self.seed < 2**63:
            raise ValueError(f"SamplingParams.seed: expected an int64, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Request:
    """forced_output_ids (teacher forcing): the max_new_tokens tokens the request emits, in order, in
    place of its own choices; each step's logits are still the engine's, computed on the prompt and
    the forced tokens before it (with NextN a draft is accepted iff it equals the forced token)."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    forced_output_ids: list[int] | None = None


@dataclass
class Completion:
    request_id: str
    output_ids: list[int]
    step_logits: torch.Tensor  # [max_new_tokens, vocab] fp32: the logits each output token was taken from


@dataclass
class _Active:
    request: Request
    state: RequestState
    output_ids: list[int] = field(default_factory=list)
    # output token i's logits: row logit_rows[i] of the host tensor logit_tables[i] (a step's [rows, vocab],
    # shared by its requests: no tensor object per token and step)
    logit_tables: list[torch.Tensor] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # NextN: the k tokens proposed after output_ids
    draft_logits: torch.Tensor | None = None  # [k, vocab] fp32: the NextN logits each draft was taken from
    pending: int = 0  # tokens chosen after output_ids whose read-back is still under way (_InFlight)

    @property
    def emitted(self) -> int:
        return len(self.output_ids) + self.pending

    @property
    def done(self) -> bool:
        return self.emitted >= self.request.max_new_tokens


@dataclass
class _InFlight:
    """A step's tokens and logits rows on their way to the host: the runner launches the next decode step
    (its token ids: `tokens`, on the device) before it reads them."""

    batch: list[_Active]
    tokens: torch.Tensor  # [B] int64 on the device: the tokens the step emits (forced ones put in)
    host_tokens: torch.Tensor  # [B] on the host (CUDA: pinned, filled by an asynchronous copy)
    host_logits: torch.Tensor  # [B, vocab] fp32 on the host (CUDA: pinned staging, reused by later steps)
    copied: torch.cuda.Event | None  # recorded after the copies (None: a CPU step, already on the host)


class Engine:
    def __init__(self, checkpoint_dir, *, device="cpu", dtype: torch.dtype = torch.float32,
                 kv_cache_dtype: str = "auto", max_batch_size: int = 8, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                 num_speculative_tokens: int = 1, cuda_graphs: bool | None = None):
        """checkpoint_dir: HF-format DeepSeek-V4 directory (engine.model.tiny writes one).
        kv_cache_dtype: "auto" (rows in `dtype`) or "fp8" (MODEL1 layout). max_seq_len bounds
        prompt + max_new_tokens of every request and sizes the KV stores.
        num_speculative_tokens: drafts per decode step when DEEPINFER_USE_NEXTN_DECODE=1 (the
        checkpoint must then hold NextN weights); unused otherwise.
        cuda_graphs: replay decode steps as CUDA graphs (None: on a CUDA device, off elsewhere; True needs
        a CUDA device; False: every step eager)."""
        config.validate_all()
        kernel_source.report()  # resolves the op table now: a strict hub source that cannot be used stops here
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype: expected torch.float32 or torch.bfloat16, got {dtype}")
        if dtype == torch.float32 and kernel_source.attention_dispatch().resolve_backend() == "tilelang":
            # Fail here, not in the first forward: the TileLang sparse MLA kernels take bf16 only.
            raise ValueError("dtype: torch.float32 needs a sparse MLA backend that computes in float32 (triton "
                             "or ref), but this process resolved tilelang (bf16-only kernels): use torch.bfloat16, "
                             "or set DEEPINFER_SPARSE_MLA_BACKEND=triton")
        for name, value in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len),
                            ("num_speculative_tokens", num_speculative_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs: expected a bool or None, got {type(cuda_graphs).__name__}")
        if cuda_graphs and torch.device(device).type != "cuda":
            raise ValueError(f"cuda_graphs: CUDA graphs need a CUDA device, got device {device!r} (pass False or "
                             f"None)")
        if not (Path(checkpoint_dir) / "config.json").is_file():
            raise FileNotFoundError(f"checkpoint_dir: no config.json in {checkpoint_dir}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.nextn = config.use_nextn_decode()
        # Rows a request may hold past its last emitted token: the drafts being verified.
        self.spec_tokens = num_speculative_tokens if self.nextn else 0
        # Sampling ops follow DEEPINFER_KERNELS (ref: plain torch/numpy; else the fused_sample dispatcher).
        self.sample_backend = "ref" if config.kernels() == "ref" else None
        self.hf_model = load_hf_model(checkpoint_dir, dtype=dtype, device=self.device)
        cfg = self.hf_model.config
        if kv_cache_dtype == "fp8" and (cfg.head_dim, cfg.qk_rope_head_dim) != (512, 64):
            raise ValueError(f"kv_cache_dtype: fp8 (MODEL1) needs head_dim 512 with 64 RoPE dims, "
                             f"the checkpoint has {cfg.head_dim} / {cfg.qk_rope_head_dim}")
        self.vocab_size = cfg.vocab_size
        self.window = cfg.sliding_window
        self.ratios = {kind: cfg.compress_rates[kind] for kind in (CSA, HCA)}
        self.stores = self._build_stores(cfg)
        specs = compressor_specs(self.hf_model)
        self.compressor_states = (CompressorStates(specs, num_rows=max_batch_size, dtype=dtype, device=self.device)
                                  if specs else None)
        self.runtime = DeepseekV4Runtime(self.hf_model, self.stores, max_batch=max_batch_size,
                                         compressor_states=self.compressor_states)
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and kv_cache_dtype == "fp8" and config.kernels() == "ref":
            # Fail here, not in the first capture: the reference quantizer picks the valid slots by a mask.
            raise ValueError("cuda_graphs: DEEPINFER_KERNELS=ref writes the fp8 cache with the quantizer's torch "
                             "reference, which selects valid slots by a boolean mask (a host sync no CUDA graph "
                             "captures): pass cuda_graphs=False, or use DEEPINFER_KERNELS=triton")
        if self.cuda_graphs:
            self.runtime.graphs = DecodeGraphs(self.runtime)
        self.nextn_window: PagedRows | None = None
        self.nextn_runtime: NextNRuntime | None = None
        if self.nextn:
            layer = load_nextn_layer(checkpoint_dir, cfg, dtype=dtype, device=self.device)
            self.nextn_window = PagedRows(
                "nextn_window", num_layers=1, num_pages=self.stores.window.num_pages, page_size=PAGE_SIZE,
                row_dim=cfg.head_dim, dtype=self.dtype, device=self.device, fp8=kv_cache_dtype == "fp8")
            self.nextn_runtime = NextNRuntime(self.runtime, layer, self.nextn_window)
        self._stats = dict(prefill_tokens=0, prefill_seconds=0.0, prefill_steps=0,
                           decode_tokens=0, decode_seconds=0.0, decode_steps=0, generated_tokens=0)
        self._spec_stats = dict(draft_seconds=0.0, draft_tokens=0, accepted_tokens=0)
        self._sampled = False  # a sampling.sample launch ran (stats() then names its backend)
        self._prepared = None  # (batch, seqs, DecodeInputs): the next decode step's, built ahead
        self._in_flight: _InFlight | None = None  # the last step, not read back yet
        self._staging: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}  # pinned, per logits shape

    # -- KV stores --------------------------------------------------------------------------
    def _store_pages(self, max_len: int) -> dict[str, int]:
        """Worst-case pages of one request whose stored length never exceeds max_len."""
        rows = {
            # held at once: the window of the last verified row, and the rows being verified
            "window": min(-(-max_len // PAGE_SIZE), (self.window - 1 + self.spec_tokens) // PAGE_SIZE + 2),
            "csa": -(-(max_len // self.ratios[CSA]) // PAGE_SIZE),
            "hca": -(-(max_len // self.ratios[HCA]) // PAGE_SIZE),
        }
        rows["indexer"] = rows["csa"]
        return rows

    def _build_stores(self, cfg) -> Stores:
        counts = {kind: sum(t == kind for t in cfg.layer_types) for kind in (CSA, HCA)}
        pages = self._store_pages(self.max_seq_len + self.spec_tokens)
        fp8 = self.kv_cache_dtype == "fp8"

        def store(name, num_layers, row_dim, quantized):
            if num_layers == 0:
                return None
            return PagedRows(name, num_layers=num_layers, num_pages=max(1, pages[name] * self.max_batch_size),
                             page_size=PAGE_SIZE, row_dim=row_dim, dtype=self.dtype, device=self.device,
                             fp8=quantized)

        return Stores(
            window=store("window", cfg.num_hidden_layers, cfg.head_dim, fp8),
            csa=store("csa", counts[CSA], cfg.head_dim, fp8),
            hca=store("hca", counts[HCA], cfg.head_dim, fp8),
            indexer=store("indexer", counts[CSA], cfg.index_head_dim, False),
        )

    def _live_stores(self) -> dict[str, PagedRows]:
        live = {name: s for name, s in vars(self.stores).items() if s is not None}
        if self.nextn_window is not None:
            live["nextn_window"] = self.nextn_window
        return live

    def _needed_pages(self, request: Request) -> dict[str, int]:
        need = self._store_pages(len(request.prompt_ids) + request.max_new_tokens - 1 + self.spec_tokens)
        need["nextn_window"] = need["window"]
        return need

    def _fits(self, request: Request) -> bool:
        need = self._needed_pages(request)
        return all(need[name] <= store.available() for name, store in self._live_stores().items())

    def _admit(self, request: Request) -> _Active:
        need = self._needed_pages(request)
        for name, store in self._live_stores().items():
            store.admit(request.request_id, need[name])
        row = None if self.compressor_states is None else self.compressor_states.admit(request.request_id)
        return _Active(request, RequestState(request.request_id, state_row=row))

    def _retire_pages(self, active: _Active) -> None:
        for store in self._live_stores().values():
            store.drop(active.request.request_id)
        if self.compressor_states is not None:
            self.compressor_states.drop(active.request.request_id)

    def _retire(self, active: _Active) -> Completion:
        self._retire_pages(active)
        logits = torch.stack([t[r] for t, r in zip(active.logit_tables, active.logit_rows)])
        return Completion(active.request.request_id, active.output_ids, logits)

    # -- requests -----------------------------------------------------------------------------
    def _check_requests(self, requests) -> None:
        if not isinstance(requests, list):
            raise TypeError(f"requests: expected a list of Request, got {type(requests).__name__}")
        seen = set()
        for i, r in enumerate(requests):
            if not isinstance(r, Request):
                raise TypeError(f"requests[{i}]: expected a Request, got {type(r).__name__}")
            if r.request_id in seen:
                raise ValueError(f"requests[{i}]: duplicate request_id {r.request_id!r}")
            seen.add(r.request_id)
            if not isinstance(r.prompt_ids, list):
                raise TypeError(f"requests[{i}].prompt_ids: expected a list of ints, "
                                f"got {type(r.prompt_ids).__name__}")
            if not r.prompt_ids:
                raise ValueError(f"requests[{i}].prompt_ids: expected at least one token")
            not_ints = [t for t in r.prompt_ids if isinstance(t, bool) or not isinstance(t, int)]
            if not_ints:
                raise TypeError(f"requests[{i}].prompt_ids: expected Python ints, got "
                                f"{', '.join(sorted({type(t).__name__ for t in not_ints}))}: {not_ints[:5]}")
            bad = [t for t in r.prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"requests[{i}].prompt_ids: tokens outside [0, {self.vocab_size}): {bad[:5]}")
            if isinstance(r.max_new_tokens, bool) or not isinstance(r.max_new_tokens, int) or r.max_new_tokens < 1:
                raise ValueError(f"requests[{i}].max_new_tokens: expected an int >= 1, got {r.max_new_tokens!r}")
            if not isinstance(r.sampling, SamplingParams):
                raise TypeError(f"requests[{i}].sampling: expected a SamplingParams, got {type(r.sampling).__name__}")
            if r.forced_output_ids is not None:
                self._check_forced(i, r)
            total = len(r.prompt_ids) + r.max_new_tokens
            if total > self.max_seq_len:
                raise ValueError(f"requests[{i}]: prompt + max_new_tokens = {total} exceeds max_seq_len "
                                 f"{self.max_seq_len}")

    def _check_forced(self, i: int, r: Request) -> None:
        forced = r.forced_output_ids
        if not isinstance(forced, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in forced):
            raise TypeError(f"requests[{i}].forced_output_ids: expected None or a list of Python ints, got "
                            f"{type(forced).__name__}")
        if len(forced) != r.max_new_tokens:
            raise ValueError(f"requests[{i}].forced_output_ids: expected max_new_tokens = {r.max_new_tokens} "
                             f"tokens, got {len(forced)}")
        bad = [t for t in forced if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"requests[{i}].forced_output_ids: tokens outside [0, {self.vocab_size}): {bad[:5]}")

    @torch.inference_mode()
    def generate(self, requests: list[Request]) -> list[Completion]:
        """Completions (greedy or sampled, per request), in the order of `requests`."""
        self._check_requests(requests)
        self._prepared = None  # metadata prepared in an earlier call points at pages given back since
        self._in_flight = None
        waiting = deque(requests)
        running: list[_Active] = []
        finished: dict[str, Completion] = {}
        try:
            while waiting or running:
                admitted = []
                while waiting and len(running) < self.max_batch_size and self._fits(waiting[0]):
                    admitted.append(self._admit(waiting.popleft()))
                    running.append(admitted[-1])
                if admitted:
                    self._prefill(admitted)
                elif running:
                    self._decode(running)
                else:  # nothing runs and the head request can never fit: the stores are too small for it
                    raise RuntimeError(f"request {waiting[0].request_id!r} does not fit in empty KV stores "
                                       f"(max_seq_len {self.max_seq_len})")
                done = [a for a in running if a.done]
                if done:
                    self._finish_in_flight()
                for active in done:
                    running.remove(active)
                    finished[active.request.request_id] = self._retire(active)
        except BaseException:
            self._in_flight = None
            for active in running:  # give their pages back: the engine stays usable after a failure
                self._retire_pages(active)
            raise
        return [finished[r.request_id] for r in requests]

    @staticmethod
    def _seq_steps(batch: list[_Active], lengths: list[int], starts: list[int]) -> list[SeqStep]:
        seqs, offset = [], 0
        for active, length, start in zip(batch, lengths, starts):
            seqs.append(SeqStep(active.state, start, length, offset))
            offset += length
        return seqs

    def _inputs(self, seqs: list[SeqStep], tokens: list[list[int]]):
        """A prefill's token ids and positions on the device."""
        input_ids = torch.tensor([t for toks in tokens for t in toks], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in seqs]).to(self.device)
        return input_ids, positions

    @staticmethod
    def _host_ids(tokens: list[list[int]]) -> list[int]:
        """A decode step's token ids, request after request, on the host (they travel in the step's copy)."""
        return [t for toks in tokens for t in toks]

    def _sampling_tensors(self, batch: list[_Active], positions: list[int], device) -> dict[str, torch.Tensor]:
        """fused_sample's per-request tensors; positions[b]: the stream position of batch[b]'s draw."""
        params = [a.request.sampling for a in batch]
        return dict(seeds=torch.tensor([p.seed for p in params], dtype=torch.long, device=device),
                    positions=torch.tensor(positions, dtype=torch.long, device=device),
                    temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
                    top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
                    top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device))

    def _emitted_tokens(self, batch: list[_Active], chosen: torch.Tensor) -> torch.Tensor:
        """The tokens a step emits [B] on the device: `chosen`, with each teacher-forced request's forced
        token in its row (one small copy, only when a request of the batch is forced)."""
        forced = [a.request.forced_output_ids for a in batch]
        if all(f is None for f in forced):
            return chosen
        ids = torch.tensor([-1 if f is None else f[a.emitted] for a, f in zip(batch, forced)], dtype=chosen.dtype,
                           device=chosen.device)
        return torch.where(ids >= 0, ids, chosen)

    def _select(self, batch: list[_Active], logits: torch.Tensor, positions: list[int], *,
                draw: int = sampling.DRAW_SAMPLE) -> torch.Tensor:
        """One token per row of logits [B, vocab] (row b: batch[b]) in one launch, left on logits' device
        (reading them back is the caller's sync): sampling.sample when any request samples (its greedy rows
        take the first argmax); an all-greedy batch takes greedy_sample with NextN (the verifier's greedy
        rule) and torch's argmax without."""
        if not all(a.request.sampling.greedy for a in batch):
            self._sampled = True
            return sampling.sample(logits, **self._sampling_tensors(batch, positions, logits.device), draw=draw,
                                   backend=self.sample_backend)
        if self.nextn:
            return sampling.greedy_sample(logits, backend=self.sample_backend)
        return logits.argmax(dim=-1)

    def _release_window_rows(self, active: _Active, *, nextn: bool = True) -> None:
        """Rows older than the next query's window are never read again. nextn=False keeps the NextN
        layer's rows: its pass over the rows just verified still reads the window of the first of them."""
        first_needed = active.state.length - self.window + 1
        self.stores.window.release_rows_before(active.state.rid, first_needed)
        if nextn and self.nextn_window is not None:
            self.nextn_window.release_rows_before(active.state.rid, first_needed)

    def _step(self, batch: list[_Active], tokens, *, prefill: bool) -> None:
        """One prefill (tokens: the prompts) or plain decode step (tokens: each request's last token, host ids
        or the step before's device tensor: _decode_ids). A decode step is read back during the next one:
        once its forward and its token choice are launched, the requests' lengths advance, their old window
        rows are released, the next step's metadata is built (_prepare_next_decode), the step before is read
        back (its tokens and logits, copied during this step's GPU work) and this step's copies are queued
        (_InFlight). The runner reads a decode step's tokens only where it needs them: before a request
        retires, an admission changes the batch or a NextN step. A prefill is read back at once."""
        prepared = None if prefill else self._take_prepared(batch)
        seqs = (self._seq_steps(batch, [len(t) for t in tokens] if prefill else [1] * len(batch),
                                [a.state.length for a in batch]) if prepared is None else prepared[0])
        if prefill:
            input_ids, positions = self._inputs(seqs, tokens)
            logits, hidden = self.runtime.prefill(input_ids, positions, seqs, all_hidden=self.nextn)
        else:
            logits, hidden = self.runtime.decode(tokens, seqs, inputs=None if prepared is None else prepared[1])
        # each request's new token is the one at index start + length of its sequence
        emitted = self._emitted_tokens(batch, self._select(batch, logits, [s.start + s.length for s in seqs]))
        for active, seq in zip(batch, seqs):
            active.state.length += seq.length
            active.pending += 1
            self._release_window_rows(active)
        if not prefill:
            self._prepare_next_decode(batch)
        self._collect()
        self._in_flight = self._read_back(batch, emitted, logits)
        if prefill:
            self._collect()
            if self.nextn:
                start = time.perf_counter()
                self._draft_after_prefill(batch, seqs, hidden)
                self._spec_stats["draft_seconds"] += time.perf_counter() - start

    def _read_back(self, batch: list[_Active], tokens: torch.Tensor, logits: torch.Tensor) -> _InFlight:
        """Queue the copies of a step's tokens and logits rows to the host (on CUDA asynchronous, into pinned
        buffers: the host goes on; the logits' staging buffer is reused, so _collect copies the rows out)."""
        if tokens.device.type != "cuda":
            return _InFlight(batch, tokens, tokens, logits, None)
        staging = self._staging.get(tuple(logits.shape))
        if staging is None:
            staging = self._staging[tuple(logits.shape)] = (
                torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True),
                torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True))
        host_tokens, host_logits = staging
        host_tokens.copy_(tokens, non_blocking=True)
        host_logits.copy_(logits, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return _InFlight(batch, tokens, host_tokens, host_logits, copied)

    def _collect(self) -> None:
        """Read back the step in flight, if any: its tokens and logits rows join its requests' outputs."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return
        rows = step.host_logits
        if step.copied is not None:
            step.copied.synchronize()
            rows = rows.clone()  # the staging buffer takes a later step's rows
        for b, (active, token) in enumerate(zip(step.batch, step.host_tokens.tolist())):
            active.output_ids.append(token)
            active.logit_tables.append(rows)
            active.logit_rows.append(b)
            active.pending -= 1

    def _finish_in_flight(self) -> None:
        """_collect outside a decode step (a request retires): the wait for the last decode step, decode time."""
        start = time.perf_counter()
        self._collect()
        self._stats["decode_seconds"] += time.perf_counter() - start

    def _decode_ids(self, batch: list[_Active]):
        """A decode step's token ids: the step in flight's device tensor when it ran this same batch (nothing
        read back), else each request's last token from the host (reading the step in flight first)."""
        step = self._in_flight
        if step is not None and len(step.batch) == len(batch) and all(a is b for a, b in zip(step.batch, batch)):
            return step.tokens
        self._collect()
        return self._host_ids([[a.output_ids[-1]] for a in batch])

    def _prepare_next_decode(self, batch: list[_Active]) -> None:
        """Build the next decode step's metadata now, while the GPU computes this one, when the batch is
        known to decode again unchanged: no request emits its last token in this step (requests end only
        at max_new_tokens). The tokens that step takes are set when it runs. A batch that changes anyway
        (an admission: a prefill comes first) rebuilds it (_take_prepared)."""
        self._prepared = None
        if not any(a.done for a in batch):
            seqs = self._seq_steps(batch, [1] * len(batch), [a.state.length for a in batch])
            self._prepared = (list(batch), seqs, self.runtime.prepare_decode(seqs))

    def _take_prepared(self, batch: list[_Active]) -> tuple[list[SeqStep], object] | None:
        """(seqs, metadata) that _prepare_next_decode built for exactly this batch (the same requests in the
        same order, none advanced since), or None."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return None
        ahead, seqs, inputs = prepared
        if len(ahead) != len(batch) or any(a is not b or a.state.length != s.start
                                           for a, b, s in zip(ahead, batch, seqs)):
            return None
        return seqs, inputs

    def _prefill(self, batch: list[_Active]) -> None:
        start = time.perf_counter()
        self._step(batch, [a.request.prompt_ids for a in batch], prefill=True)
        self._stats["prefill_seconds"] += time.perf_counter() - start
        self._stats["prefill_tokens"] += sum(len(a.request.prompt_ids) for a in batch)
        self._stats["generated_tokens"] += len(batch)
        self._stats["prefill_steps"] += 1

    def _decode(self, batch: list[_Active]) -> None:
        start = time.perf_counter()
        if self.nextn:  # nothing in flight: a prefill is read back at once, NextN steps at their end
            emitted = self._verify(batch)
        else:
            self._step(batch, self._decode_ids(batch), prefill=False)
            emitted = len(batch)
        self._stats["decode_seconds"] += time.perf_counter() - start
        self._stats["decode_tokens"] += emitted
        self._stats["generated_tokens"] += emitted
        self._stats["decode_steps"] += 1

    # -- NextN speculative decoding -------------------------------------------------------------
    def _draft_after_prefill(self, batch: list[_Active], seqs: list[SeqStep], hidden: torch.Tensor) -> None:
        """NextN over each prompt: row i gets token i + 1 (the prompt shifted, then the first output
        token) and h_i; the last row drafts."""
        todo = [i for i, a in enumerate(batch) if not a.done]
        if not todo:
            return
        batch = [batch[i] for i in todo]
        rows = torch.cat([torch.arange(seqs[i].offset, seqs[i].offset + seqs[i].length) for i in todo])
        nextn_seqs = self._seq_steps(batch, [seqs[i].length for i in todo], [0] * len(batch))
        tokens = [a.request.prompt_ids[1:] + [a.output_ids[-1]] for a in batch]
        input_ids, positions = self._inputs(nextn_seqs, tokens)
        logits, nextn_hidden = self.nextn_runtime.prefill(input_ids, hidden[rows.to(hidden.device)], positions,
                                                          nextn_seqs)
        last = torch.tensor([s.offset + s.length - 1 for s in nextn_seqs], device=logits.device)
        self._draft_chain(batch, logits[last], nextn_hidden[last])

    def _draft_chain(self, batch: list[_Active], logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """Draft k tokens per request: the first from `logits` [B, vocab] (the NextN row of the last
        emitted token), each further one by the NextN layer on the previous draft and its own hidden
        state. Its window rows past the emitted tokens are dropped afterwards (verification rewrites them).
        Draft j of the chain whose first proposal is for position P = length + 1 draws on the draft
        lane at stream position k * P + j: one word per (chain, j), never reused, although a later
        chain proposes again for positions whose drafts were discarded (docs/sampling.md)."""
        k = self.spec_tokens

        def draft(logits: torch.Tensor, j: int) -> list[int]:
            return self._select(batch, logits, [k * (a.state.length + 1) + j for a in batch],
                                draw=sampling.DRAW_DRAFT).tolist()

        drafts, draft_logits = [draft(logits, 0)], [logits]
        for j in range(1, k):
            seqs = self._seq_steps(batch, [1] * len(batch), [a.state.length + j - 1 for a in batch])
            logits, hidden = self.nextn_runtime.decode(list(drafts[-1]), hidden, seqs)
            drafts.append(draft(logits, j))
            draft_logits.append(logits)
        for b, active in enumerate(batch):
            active.drafts = [d[b] for d in drafts]
            active.draft_logits = torch.stack([l[b] for l in draft_logits])
            self.nextn_window.truncate(active.state.rid, active.state.length)

    def _verify(self, batch: list[_Active]) -> int:
        """One speculative decode step for every running request; returns the tokens emitted."""
        k = self.spec_tokens
        starts = [a.state.length for a in batch]
        seqs = self._seq_steps(batch, [k + 1] * len(batch), starts)
        input_ids = self._host_ids([[a.output_ids[-1], *a.drafts] for a in batch])
        logits, hidden = self.runtime.decode(input_ids, seqs, all_logits=True, all_hidden=True, speculative=True)
        target = logits.view(len(batch), k + 1, -1)
        device = target.device
        # draft j is proposed for position start + 1 + j (start: the stored length = the last token's index)
        tokens, accepted = sampling.rejection_sample(
            target, torch.stack([a.draft_logits for a in batch]).to(device),
            torch.tensor([a.drafts for a in batch], dtype=torch.long, device=device),
            **self._sampling_tensors(batch, [s + 1 for s in starts], device), backend=self.sample_backend)
        tokens, accepted = tokens.tolist(), accepted.tolist()
        for b, active in enumerate(batch):
            forced = active.request.forced_output_ids
            if forced is not None:  # accept the drafts that equal the forced tokens; emit the forced ones
                ahead = forced[len(active.output_ids):]
                accepted[b] = next((j for j in range(min(k, len(ahead) - 1)) if active.drafts[j] != ahead[j]),
                                   min(k, len(ahead) - 1))
                tokens[b] = ahead[: accepted[b] + 1]
        target_rows = target.cpu()
        emitted_total = 0
        for b, active in enumerate(batch):
            kept = accepted[b] + 1  # verified rows that stay: the last token and the accepted drafts
            self._spec_stats["draft_tokens"] += k
            self._spec_stats["accepted_tokens"] += accepted[b]
            if kept < k + 1:
                self.runtime.rollback(active.state, kept)
            self.stores.window.truncate(active.state.rid, starts[b] + kept)
            active.state.length = starts[b] + kept
            self._release_window_rows(active, nextn=False)
            emit = tokens[b][:kept][: active.request.max_new_tokens - len(active.output_ids)]
            active.output_ids.extend(emit)
            active.logit_tables.extend([target_rows[b]] * len(emit))
            active.logit_rows.extend(range(len(emit)))
            emitted_total += len(emit)
        self._draft_after_verify(batch, seqs, tokens, accepted, hidden)
        return emitted_total

    def _draft_after_verify(self, batch, seqs, tokens, accepted, hidden) -> None:
        """NextN over the k + 1 verified rows (row j: the token emitted after it, h of the verifier);
        rows past the accepted ones carry filler tokens and are dropped; the row of the last emitted
        token drafts."""
        start = time.perf_counter()
        todo = [b for b, a in enumerate(batch) if not a.done]
        if todo:
            k1 = self.spec_tokens + 1
            active = [batch[b] for b in todo]
            rows = torch.cat([torch.arange(seqs[b].offset, seqs[b].offset + k1) for b in todo])
            nextn_seqs = self._seq_steps(active, [k1] * len(todo), [seqs[b].start for b in todo])
            # rows past the emitted tokens repeat the last one (any token would do: they are dropped)
            inputs = [[tokens[b][min(j, accepted[b])] for j in range(k1)] for b in todo]
            logits, nextn_hidden = self.nextn_runtime.decode(self._host_ids(inputs), hidden[rows.to(hidden.device)],
                                                             nextn_seqs)
            for a in active:  # the drafts below read only the window of the last emitted token
                self._release_window_rows(a)
            last = torch.tensor([s.offset + accepted[b] for s, b in zip(nextn_seqs, todo)], device=logits.device)
            self._draft_chain(active, logits[last], nextn_hidden[last])
        self._spec_stats["draft_seconds"] += time.perf_counter() - start

    def stats(self) -> dict:
        """Token and time counters since construction, op fallbacks, the sparse MLA backend and the kernel
        source (engine.kernel_source.report()); with
        NextN decoding also: drafted / accepted counts, acceptance rate (None before any
        verification), emitted tokens per decode step and draft_seconds (NextN time, already counted
        in prefill_seconds / decode_seconds). fused_sample_backend: with NextN or once a request
        sampled (the sampler's backend). cuda_graphs: enabled, the graphs captured (one per decode step
        shape) and the decode steps that replayed one (NextN verifications run eagerly)."""
        st = self._stats
        seconds = st["prefill_seconds"] + st["decode_seconds"]
        out = {
            **st,
            # generated tokens (each request's first from its prefill) per second of prefill + decode
            "tokens_per_s": st["generated_tokens"] / seconds if seconds else None,
            "decode_tokens_per_s": st["decode_tokens"] / st["decode_seconds"] if st["decode_seconds"] else None,
            "op_fallbacks": kernel_source.op_fallback_counts(),
            "sparse_mla_backend": kernel_source.attention_dispatch().resolve_backend(),
            "sparse_mla_kernels": kernel_source.attention_dispatch().kernel_choices(),
            "kernel_source": kernel_source.report(),
            "kv_cache_dtype": self.kv_cache_dtype,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "nextn_decode": self.nextn,
            "cuda_graphs": {"enabled": self.cuda_graphs,
                            "captured": len(self.runtime.graphs.keys) if self.cuda_graphs else 0,
                            "replays": self.runtime.graphs.replays if self.cuda_graphs else 0},
        }
        if self.nextn or self._sampled:
            out["fused_sample_backend"] = self.sample_backend or sampling.resolve_backend()
        if self.nextn:
            drafted = self._spec_stats["draft_tokens"]
            out.update(self._spec_stats, num_speculative_tokens=self.spec_tokens,
                       acceptance_rate=self._spec_stats["accepted_tokens"] / drafted if drafted else None,
                       tokens_per_decode_step=st["decode_tokens"] / st["decode_steps"] if st["decode_steps"] else None)
        return out
