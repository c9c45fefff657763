"""Single-process engine: greedy decoding of DeepSeek-V4 with continuous batching.

Scheduling: requests wait in arrival order. Each iteration first admits waiting requests while the
batch has room (max_batch_size) and the KV stores can reserve their worst case (prompt +
max_new_tokens); admitted requests are prefilled together in one packed step, which yields their
first token. Otherwise all running requests decode one token in one batched step. A request
finishes after exactly max_new_tokens tokens (EOS does not stop it, as in the oracle) and frees its
pages at once, so the next iteration can admit a waiting request while the others keep decoding.

The model is transformers' DeepseekV4ForCausalLM (weights, MoE, embeddings, head) driven by
engine.model.deepseek_v4 (norms/RoPE through engine.ops, attention through
engine.h20_ops.attn_sm90, KV in engine.kv_cache).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import config, ops
from engine.h20_ops import sparse_mla
from engine.kv_cache import KV_CACHE_DTYPES, PagedRows, RequestState
from engine.model.deepseek_v4 import CSA, HCA, DeepseekV4Runtime, SeqStep, Stores
from engine.model.hf_oracle import load_hf_model

PAGE_SIZE = 64


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int


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
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.output_ids) >= self.request.max_new_tokens


class Engine:
    def __init__(self, checkpoint_dir, *, device="cpu", dtype: torch.dtype = torch.float32,
                 kv_cache_dtype: str = "auto", max_batch_size: int = 8, max_seq_len: int = 4096):
        """checkpoint_dir: HF-format DeepSeek-V4 directory (engine.model.tiny writes one).
        kv_cache_dtype: "auto" (rows in `dtype`) or "fp8" (MODEL1 layout). max_seq_len bounds
        prompt + max_new_tokens of every request and sizes the KV stores."""
        config.validate_all()
        if config.use_nextn_decode():
            raise NotImplementedError("DEEPINFER_USE_NEXTN_DECODE=1: NextN (MTP) speculative decoding is not "
                                      "implemented by this engine; unset it or set it to 0")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype: expected torch.float32 or torch.bfloat16, got {dtype}")
        for name, value in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if not (Path(checkpoint_dir) / "config.json").is_file():
            raise FileNotFoundError(f"checkpoint_dir: no config.json in {checkpoint_dir}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.hf_model = load_hf_model(checkpoint_dir, dtype=dtype, device=self.device)
        cfg = self.hf_model.config
        if kv_cache_dtype == "fp8" and (cfg.head_dim, cfg.qk_rope_head_dim) != (512, 64):
            raise ValueError(f"kv_cache_dtype: fp8 (MODEL1) needs head_dim 512 with 64 RoPE dims, "
                             f"the checkpoint has {cfg.head_dim} / {cfg.qk_rope_head_dim}")
        self.vocab_size = cfg.vocab_size
        self.window = cfg.sliding_window
        self.ratios = {kind: cfg.compress_rates[kind] for kind in (CSA, HCA)}
        self.stores = self._build_stores(cfg)
        self.runtime = DeepseekV4Runtime(self.hf_model, self.stores)
        self._stats = dict(prefill_tokens=0, prefill_seconds=0.0, prefill_steps=0,
                           decode_tokens=0, decode_seconds=0.0, decode_steps=0)

    # -- KV stores --------------------------------------------------------------------------
    def _store_pages(self, max_len: int) -> dict[str, int]:
        """Worst-case pages of one request whose stored length never exceeds max_len."""
        rows = {
            "window": min(-(-max_len // PAGE_SIZE), (self.window - 1) // PAGE_SIZE + 2),
            "csa": -(-(max_len // self.ratios[CSA]) // PAGE_SIZE),
            "hca": -(-(max_len // self.ratios[HCA]) // PAGE_SIZE),
        }
        rows["indexer"] = rows["csa"]
        return rows

    def _build_stores(self, cfg) -> Stores:
        counts = {kind: sum(t == kind for t in cfg.layer_types) for kind in (CSA, HCA)}
        pages = self._store_pages(self.max_seq_len)
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
        return {name: s for name, s in vars(self.stores).items() if s is not None}

    def _fits(self, request: Request) -> bool:
        need = self._store_pages(len(request.prompt_ids) + request.max_new_tokens - 1)
        return all(need[name] <= store.available() for name, store in self._live_stores().items())

    def _admit(self, request: Request) -> _Active:
        need = self._store_pages(len(request.prompt_ids) + request.max_new_tokens - 1)
        for name, store in self._live_stores().items():
            store.admit(request.request_id, need[name])
        return _Active(request, RequestState(request.request_id))

    def _retire_pages(self, active: _Active) -> None:
        for store in self._live_stores().values():
            store.drop(active.request.request_id)

    def _retire(self, active: _Active) -> Completion:
        self._retire_pages(active)
        return Completion(active.request.request_id, active.output_ids, torch.stack(active.logits))

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
            if not r.prompt_ids:
                raise ValueError(f"requests[{i}].prompt_ids: expected at least one token")
            bad = [t for t in r.prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"requests[{i}].prompt_ids: tokens outside [0, {self.vocab_size}): {bad[:5]}")
            if isinstance(r.max_new_tokens, bool) or not isinstance(r.max_new_tokens, int) or r.max_new_tokens < 1:
                raise ValueError(f"requests[{i}].max_new_tokens: expected an int >= 1, got {r.max_new_tokens!r}")
            total = len(r.prompt_ids) + r.max_new_tokens
            if total > self.max_seq_len:
                raise ValueError(f"requests[{i}]: prompt + max_new_tokens = {total} exceeds max_seq_len "
                                 f"{self.max_seq_len}")

    @torch.inference_mode()
    def generate(self, requests: list[Request]) -> list[Completion]:
        """Greedy completions, in the order of `requests`."""
        self._check_requests(requests)
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
                for active in [a for a in running if a.done]:
                    running.remove(active)
                    finished[active.request.request_id] = self._retire(active)
        except BaseException:
            for active in running:  # give their pages back: the engine stays usable after a failure
                self._retire_pages(active)
            raise
        return [finished[r.request_id] for r in requests]

    def _step(self, batch: list[_Active], tokens: list[list[int]], *, prefill: bool) -> None:
        seqs, offset = [], 0
        for active, toks in zip(batch, tokens):
            seqs.append(SeqStep(active.state, active.state.length, len(toks), offset))
            offset += len(toks)
        input_ids = torch.tensor([t for toks in tokens for t in toks], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in seqs]).to(self.device)
        logits = self.runtime.forward(input_ids, positions, seqs, prefill=prefill)
        next_tokens = logits.argmax(dim=-1).tolist()
        window_store = self.stores.window
        for active, seq, row, token in zip(batch, seqs, logits, next_tokens):
            active.state.length += seq.length
            # Rows older than the next query's window are never read again.
            window_store.release_rows_before(active.state.rid, active.state.length - self.window + 1)
            active.output_ids.append(int(token))
            active.logits.append(row.cpu())

    def _prefill(self, batch: list[_Active]) -> None:
        start = time.perf_counter()
        self._step(batch, [a.request.prompt_ids for a in batch], prefill=True)
        self._stats["prefill_seconds"] += time.perf_counter() - start
        self._stats["prefill_tokens"] += sum(len(a.request.prompt_ids) for a in batch)
        self._stats["prefill_steps"] += 1

    def _decode(self, batch: list[_Active]) -> None:
        start = time.perf_counter()
        self._step(batch, [[a.output_ids[-1]] for a in batch], prefill=False)
        self._stats["decode_seconds"] += time.perf_counter() - start
        self._stats["decode_tokens"] += len(batch)
        self._stats["decode_steps"] += 1

    def stats(self) -> dict:
        """Token and time counters since construction, op fallbacks and the sparse MLA backend."""
        return {
            **self._stats,
            "op_fallbacks": ops.fallback_counts(),
            "sparse_mla_backend": sparse_mla.resolve_backend(),
            "kv_cache_dtype": self.kv_cache_dtype,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
        }
