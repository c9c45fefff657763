"""What every layer of one decode step reads: built once per step on the host, in static shapes.

DeepSeek-V4 decode, per request b with new tokens at positions start_b .. start_b + s_q - 1:
  - query j at position p attends to the window positions max(0, p - W + 1) .. p (itself included) in
    the window store, oldest first: `window_indices` [B, s_q, W] slot ids, -1 past its count;
  - a compressed layer adds entries of its store: entry e is visible to p iff e < (p + 1) // ratio; a
    ratio-128 layer attends to all visible entries (`hca_indices` [B, s_q, E_hca] slot ids), a ratio-4
    layer to its indexer's top-k among them (entry ids chosen inside the layer, mapped to slots by
    `csa_slots` through the step's entry slot table, on the GPU);
  - the rows this step writes: `window_write_slots` [B * s_q] (every layer writes its new rows there) and
    per compressor store the slot of the entry a token completes (`entry_writes` [B, s_q], -1 where the
    token closes no window);
  - the token ids, positions and compressor state rows of the step.
The pages these rows and entries need are backed here, before any layer writes them (a store's page
tables are per request, shared by its layers, so one table serves every layer).

Static shapes (a CUDA graph is captured per DecodeKey and replayed with the next step's values): the
batch is padded to `padded_batch` (1, 2, 4, 8, then multiples of 8) with rows that read nothing (lists
-1), write nothing (slots -1) and keep their compressor state in the scratch row; the window lists are W
wide; an entry table is padded with -1 to `entry_width` entries (powers of two, at least
ENTRY_WIDTH_MIN: the kernels walk a list's whole width, so the width follows the longest request in
buckets instead of the store's capacity); a ratio-4 layer attends to min(index_topk, width) entries.
The runner builds a step's metadata while the GPU runs the step before it (token ids left out, written
by DecodeInputs.set_input_ids when the step runs), so the build is off the step's path.
Everything is computed on the host from the page tables (numpy, vectorized over the batch) into ONE
int64 array, copied to the device in one transfer (DecodeInputs.host); `decode_metadata` makes the
device views (and the int32 lists) from it, inside the step (in a graph: on its static input buffer).
The plans of the three layer types (engine.h20_ops.plan_sparse_decode) depend on the key alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import NamedTuple

import numpy as np
import torch

from engine.h20_ops import DecodePlan
from engine.kernel_source import op
from engine.kv_store import CacheCapacityError
from engine.model.layer_types import CSA, HCA, SLIDING

ENTRY_WIDTH_MIN = 64


def padded_batch(batch: int, max_batch: int) -> int:
    """The batch a step of `batch` requests runs as: 1, 2, 4, 8, then multiples of 8, at most
    max(batch, max_batch)."""
    bucket = 1 << (batch - 1).bit_length() if batch <= 8 else -(-batch // 8) * 8
    return min(bucket, max(batch, max_batch))


def entry_width(entries: int) -> int:
    """The width of an entry table that holds `entries`: a power of two, at least ENTRY_WIDTH_MIN."""
    return max(ENTRY_WIDTH_MIN, 1 << max(entries - 1, 0).bit_length())


class DecodeKey(NamedTuple):
    """The static shapes of a decode step (one CUDA graph each)."""

    batch: int  # padded
    s_q: int
    csa_width: int  # entry table width of the ratio-4 stores (0: none)
    hca_width: int  # of the ratio-128 store (0: none)


@dataclass
class DecodeInputs:
    """A step's metadata on the host: `host` holds the arrays of `layout` ((name, shape) in order) back to
    back; `batch` requests, padded to key.batch."""

    key: DecodeKey
    batch: int
    host: torch.Tensor  # [n] int64, CPU
    layout: tuple[tuple[str, tuple[int, ...]], ...]

    def set_input_ids(self, input_ids) -> None:
        """Write the step's token ids (batch * s_q, request after request) into `host`: for metadata built
        ahead of its step, before the tokens it takes were known (the layout's first array is the
        [key.batch, s_q] token ids, padding rows last)."""
        ids = _token_ids(input_ids, self.batch, self.key.s_q)
        self.host[: ids.size] = torch.from_numpy(ids)


@dataclass
class DecodeMetadata:
    """A step's metadata on the device (views of one buffer), for batch = key.batch padded rows."""

    key: DecodeKey
    input_ids: torch.Tensor  # [B * s_q] int64
    positions: torch.Tensor  # [B * s_q] int64
    state_rows: torch.Tensor | None  # [B] int64: each row's compressor state row (padding: the scratch row)
    window_write_slots: torch.Tensor  # [B * s_q] int64 (-1: padding)
    window_indices: torch.Tensor  # [B, s_q, W] int32
    csa_entry_slots: torch.Tensor | None  # [B, E_csa] int64: slot of entry e of request b (-1: none)
    indexer_entry_slots: torch.Tensor | None  # [B, E_csa] int64, in the indexer store
    hca_indices: torch.Tensor | None  # [B, s_q, E_hca] int32
    entry_writes: dict[str, torch.Tensor]  # store name -> [B, s_q] int64: slot of the entry token j completes
    plans: dict[str, DecodePlan]  # per layer type

    @property
    def batch(self) -> int:
        return self.key.batch

    @property
    def s_q(self) -> int:
        return self.key.s_q

    @property
    def csa_topk(self) -> int:
        return self.plans[CSA].extra_topk

    def csa_slots(self, chosen: torch.Tensor) -> torch.Tensor:
        """chosen [B, s_q, csa_topk] entry ids (-1: none) -> slot ids of the csa store, int32 (GPU ops)."""
        table = self.csa_entry_slots[:, None, :].expand(-1, self.s_q, -1)
        slots = torch.gather(table, 2, chosen.clamp(min=0))
        return torch.where(chosen >= 0, slots, -1).to(torch.int32)


def _padded(rows: np.ndarray, batch: int, fill: int) -> np.ndarray:
    out = np.full((batch, *rows.shape[1:]), fill, dtype=np.int64)
    out[: rows.shape[0]] = rows
    return out


def _slots(tables: np.ndarray, rows: np.ndarray, page_size: int) -> np.ndarray:
    """Slot ids of rows [B, ...] (rows >= 0) through the page tables [B, n_pages]; -1 where unbacked."""
    flat = rows.reshape(rows.shape[0], -1)
    logical = np.minimum(flat // page_size, tables.shape[1] - 1)
    pages = np.take_along_axis(tables, logical, axis=1)
    return np.where(pages >= 0, pages * page_size + flat % page_size, -1).reshape(rows.shape)


def _window(runtime, rids, starts: np.ndarray, positions: np.ndarray):
    """The write slots [B, s_q] and the window lists [B, s_q, W] (backing the written rows first)."""
    store, w = runtime.stores.window, runtime.window
    store.ensure_rows_of(rids, starts, starts + positions.shape[1])
    tables = store.page_tables(rids, int(positions.max()) // store.page_size + 1)
    first = np.maximum(0, positions - w + 1)
    rows = first[..., None] + np.arange(w)
    valid = rows <= positions[..., None]
    slots = _slots(tables, np.where(valid, rows, 0), store.page_size)
    if bool((valid & (slots < 0)).any()):
        raise CacheCapacityError("window: a decode query reads a row whose page was released or never backed")
    return _slots(tables, positions, store.page_size), np.where(valid, slots, -1)


def _entry_table(store, rids, before: np.ndarray, counts: np.ndarray, width: int) -> np.ndarray:
    """[B, width] slots of each request's entries after this step, -1 past its count; the entries this step
    completes (before .. counts - 1; the earlier ones are held) are backed now."""
    store.ensure_rows_of(rids, before, counts)
    tables = store.page_tables(rids, -(-width // store.page_size))
    ids = np.broadcast_to(np.arange(width), (len(rids), width))
    return np.where(ids < counts[:, None], _slots(tables, ids, store.page_size), -1)


def _entry_writes(table: np.ndarray, positions: np.ndarray, ratio: int) -> np.ndarray:
    """[B, s_q]: the slot of the entry that the token at positions[b, j] completes, -1 where none."""
    completes = (positions + 1) % ratio == 0
    entry = np.maximum((positions + 1) // ratio - 1, 0)
    return np.where(completes, np.take_along_axis(table, entry, axis=1), -1)


def _token_ids(input_ids, batch: int, s_q: int) -> np.ndarray:
    ids = np.asarray(input_ids, dtype=np.int64)
    if ids.shape != (batch * s_q,):
        raise ValueError(f"input_ids: expected {batch * s_q} token ids ({batch} sequences x {s_q}), got shape "
                         f"{ids.shape}")
    return ids


def build_decode_inputs(runtime, seqs, input_ids) -> DecodeInputs:
    """The step's metadata on the host for runtime (a DeepseekV4Runtime), its sequences (SeqStep, each with
    the same number of new tokens) and their token ids (B * s_q, request after request; None: zeros, for
    metadata built ahead of its step, the ids set later by DecodeInputs.set_input_ids)."""
    s_q = seqs[0].length
    if any(s.length != s_q for s in seqs):
        raise ValueError(f"seqs: decode needs the same number of new tokens per sequence, got "
                         f"{[s.length for s in seqs]}")
    batch = len(seqs)
    ids = np.zeros(batch * s_q, dtype=np.int64) if input_ids is None else _token_ids(input_ids, batch, s_q)
    padded = padded_batch(batch, runtime.max_batch)
    stores = runtime.stores
    rids = [s.state.rid for s in seqs]
    starts = np.array([s.start for s in seqs], dtype=np.int64)
    positions = starts[:, None] + np.arange(s_q)  # [B, s_q]
    parts = {"input_ids": _padded(ids.reshape(batch, s_q), padded, 0),
             "positions": _padded(positions, padded, 0)}
    if runtime.compressor_states is not None:
        rows = np.array([s.state.state_row for s in seqs], dtype=np.int64)
        parts["state_rows"] = _padded(rows, padded, runtime.compressor_states.scratch_row)
    writes, lists = _window(runtime, rids, starts, positions)
    parts["window_writes"] = _padded(writes, padded, -1)
    parts["window"] = _padded(lists, padded, -1)
    csa_width = hca_width = 0
    if stores.csa is not None:
        ratio = runtime.ratio[CSA]
        counts = (starts + s_q) // ratio
        csa_width = entry_width(int(counts.max()))
        for name, store in (("csa", stores.csa), ("indexer", stores.indexer)):
            table = _entry_table(store, rids, starts // ratio, counts, csa_width)
            parts[f"{name}_entries"] = _padded(table, padded, -1)
            parts[f"{name}_writes"] = _padded(_entry_writes(table, positions, ratio), padded, -1)
    if stores.hca is not None:
        ratio = runtime.ratio[HCA]
        counts = (starts + s_q) // ratio
        hca_width = entry_width(int(counts.max()))
        table = _entry_table(stores.hca, rids, starts // ratio, counts, hca_width)
        visible = (positions + 1) // ratio
        lists = np.where(np.arange(hca_width) < visible[..., None], table[:, None, :], -1)
        parts["hca"] = _padded(lists, padded, -1)
        parts["hca_writes"] = _padded(_entry_writes(table, positions, ratio), padded, -1)
    host = torch.from_numpy(np.concatenate([a.reshape(-1) for a in parts.values()]))
    layout = tuple((name, a.shape) for name, a in parts.items())
    return DecodeInputs(DecodeKey(padded, s_q, csa_width, hca_width), batch, host, layout)


def plan_decode(runtime, key: DecodeKey) -> dict[str, DecodePlan]:
    """The plans of the three layer types for a step of these shapes."""
    stores = runtime.stores
    window_cache = stores.window.cache(0)
    common = dict(batch=key.batch, s_q=key.s_q, h_q=runtime.heads, topk=runtime.window,
                  q_dtype=runtime.model.embed_tokens.weight.dtype)
    plan_sparse_decode = op("plan_sparse_decode")
    plans = {SLIDING: plan_sparse_decode(window_cache, **common)}
    if stores.csa is not None:
        plans[CSA] = plan_sparse_decode(window_cache, extra_cache=stores.csa.cache(0),
                                        extra_topk=min(runtime.config.index_topk, key.csa_width), **common)
    if stores.hca is not None:
        plans[HCA] = plan_sparse_decode(window_cache, extra_cache=stores.hca.cache(0), extra_topk=key.hca_width,
                                        **common)
    return plans


def decode_metadata(buffer: torch.Tensor, inputs: DecodeInputs, plans: dict[str, DecodePlan]) -> DecodeMetadata:
    """The device views of a step's metadata in `buffer` (inputs.host's values, on the device): GPU ops only,
    so that a CUDA graph captures the int32 conversions with the step."""
    views, offset = {}, 0
    for name, shape in inputs.layout:
        n = prod(shape)
        views[name] = buffer[offset: offset + n].view(shape)
        offset += n
    hca = views.get("hca")
    writes = {name: views[f"{name}_writes"] for name in ("csa", "indexer", "hca") if f"{name}_writes" in views}
    return DecodeMetadata(
        key=inputs.key, input_ids=views["input_ids"].view(-1), positions=views["positions"].view(-1),
        state_rows=views.get("state_rows"), window_write_slots=views["window_writes"].view(-1),
        window_indices=views["window"].to(torch.int32), csa_entry_slots=views.get("csa_entries"),
        indexer_entry_slots=views.get("indexer_entries"), hca_indices=None if hca is None else hca.to(torch.int32),
        entry_writes=writes, plans=plans)
