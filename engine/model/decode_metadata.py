"""What every layer of one decode step reads: built once per step (page tables on the host, lists on the
device), in static shapes.

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
The runner builds a step's metadata while the GPU runs the step before it (token ids left out: the
tokens that step chose stay on the device and are copied into the step's buffer there,
DecodeInputs.token_ids; host ids go in by DecodeInputs.set_input_ids), so the build is off the step's path.
The host (`build_decode_inputs`, numpy, vectorized over the batch) backs the pages and writes ONE int64
array of compact inputs: token ids, each request's start, state rows, the window store's pages from the
page of the first row the step reads ([B, window_pages]) and each compressed store's page table ([B,
width / page size]), copied to the device in one transfer (DecodeInputs.host). `decode_metadata` turns it
into the lists, tables and write slots above with GPU ops inside the step (in a graph: from its static
input buffer): the host's work and the copy stay a few pages per request, not W + the entry widths.
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

    def token_ids(self, buffer: torch.Tensor) -> torch.Tensor:
        """The step's token ids (batch * s_q, request after request) in `buffer` (host's layout on the device):
        where a step whose tokens are still on the device writes them, after the buffer's copy."""
        return buffer[: self.batch * self.key.s_q]


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


def window_pages(window: int, s_q: int, page_size: int) -> int:
    """Pages of the window store a request's decode step reads or writes, at most: its queries' rows
    first_row .. start + s_q - 1 span W + s_q - 1 rows, from any offset in a page."""
    return (window + s_q - 2) // page_size + 2


def _window_table(runtime, rids, starts: np.ndarray, s_q: int):
    """(first_page [B], pages [B, window_pages]): the window store's pages from the page of the first row any
    query of the step reads (the written rows backed first); raises where a read row has no page."""
    store, w = runtime.stores.window, runtime.window
    store.ensure_rows_of(rids, starts, starts + s_q)
    ps = store.page_size
    first_page = np.maximum(0, starts - w + 1) // ps
    last_page = (starts + s_q - 1) // ps
    n = window_pages(w, s_q, ps)
    tables = store.page_tables(rids, int(first_page.max()) + n)
    pages = np.take_along_axis(tables, first_page[:, None] + np.arange(n), axis=1)
    needed = np.arange(n) <= (last_page - first_page)[:, None]
    if bool((needed & (pages < 0)).any()):
        raise CacheCapacityError("window: a decode query reads a row whose page was released or never backed")
    return first_page, pages


def _entry_pages(store, rids, before: np.ndarray, counts: np.ndarray, width: int) -> np.ndarray:
    """[B, pages of `width` entries]: each request's page table of the store; the entries this step
    completes (before .. counts - 1; the earlier ones are held) are backed now."""
    store.ensure_rows_of(rids, before, counts)
    return store.page_tables(rids, -(-width // store.page_size))


def _token_ids(input_ids, batch: int, s_q: int) -> np.ndarray:
    ids = np.asarray(input_ids, dtype=np.int64)
    if ids.shape != (batch * s_q,):
        raise ValueError(f"input_ids: expected {batch * s_q} token ids ({batch} sequences x {s_q}), got shape "
                         f"{ids.shape}")
    return ids


def build_decode_inputs(runtime, seqs, input_ids) -> DecodeInputs:
    """The step's metadata on the host for runtime (a DeepseekV4Runtime), its sequences (SeqStep, each with
    the same number of new tokens) and their token ids (B * s_q, request after request; None: zeros, for
    metadata built ahead of its step, the ids set later by DecodeInputs.set_input_ids or on the device)."""
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
    parts = {"input_ids": _padded(ids.reshape(batch, s_q), padded, 0), "starts": _padded(starts, padded, 0)}
    if runtime.compressor_states is not None:
        rows = np.array([s.state.state_row for s in seqs], dtype=np.int64)
        parts["state_rows"] = _padded(rows, padded, runtime.compressor_states.scratch_row)
    first_page, pages = _window_table(runtime, rids, starts, s_q)
    parts["window_first_page"] = _padded(first_page, padded, 0)
    parts["window_pages"] = _padded(pages, padded, -1)
    widths = {}
    for name, kind in (("csa", CSA), ("indexer", CSA), ("hca", HCA)):
        store = getattr(stores, name)
        if store is None:
            continue
        ratio = runtime.ratio[kind]
        counts = (starts + s_q) // ratio
        widths[kind] = entry_width(int(counts.max()))
        parts[f"{name}_pages"] = _padded(_entry_pages(store, rids, starts // ratio, counts, widths[kind]), padded, -1)
    host = torch.from_numpy(np.concatenate([a.reshape(-1) for a in parts.values()]))
    layout = tuple((name, a.shape) for name, a in parts.items())
    return DecodeInputs(DecodeKey(padded, s_q, widths.get(CSA, 0), widths.get(HCA, 0)), batch, host, layout)


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


def _slots(pages: torch.Tensor, ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slot ids of ids [B, ...] (>= 0; a request's rows or entries, counted from its table's first page)
    through its pages [B, n]; -1 where the page is unbacked (ids past the table read its last page)."""
    local = (ids // page_size).clamp(max=pages.size(1) - 1)
    page = torch.gather(pages, 1, local.reshape(ids.size(0), -1)).view(ids.shape)
    return torch.where(page >= 0, page * page_size + ids % page_size, -1)


def decode_metadata(buffer: torch.Tensor, inputs: DecodeInputs, plans: dict[str, DecodePlan], *, window: int,
                    page_size: int, ratios: dict[str, int]) -> DecodeMetadata:
    """The step's metadata on the device from `buffer` (inputs.host's values there): the slot lists and
    tables computed from the page tables with GPU ops only, so that a CUDA graph captures them with the
    step. window, page_size (every store's) and ratios (per compressed layer type): the runtime's."""
    views, offset = {}, 0
    for name, shape in inputs.layout:
        n = prod(shape)
        views[name] = buffer[offset: offset + n].view(shape)
        offset += n
    batch, s_q = inputs.key.batch, inputs.key.s_q
    device = buffer.device
    positions = views["starts"][:, None] + torch.arange(s_q, device=device)  # [B, s_q]
    # window: query p reads rows max(0, p - W + 1) .. p, oldest first; rows counted from the table's first page
    first_row = views["window_first_page"][:, None, None] * page_size
    rows = (positions - window + 1).clamp(min=0)[..., None] + torch.arange(window, device=device)  # [B, s_q, W]
    pages = views["window_pages"]
    window_lists = torch.where(rows <= positions[..., None], _slots(pages, rows - first_row, page_size), -1)
    window_writes = _slots(pages, positions - first_row[:, :, 0], page_size)
    entry_slots, entry_writes = {}, {}
    for name, kind in (("csa", CSA), ("indexer", CSA), ("hca", HCA)):
        if f"{name}_pages" not in views:
            continue
        width = inputs.key.csa_width if kind == CSA else inputs.key.hca_width
        ratio = ratios[kind]
        entries = torch.arange(width, device=device).expand(batch, -1)
        counts = (views["starts"] + s_q) // ratio
        table = torch.where(entries < counts[:, None], _slots(views[f"{name}_pages"], entries, page_size), -1)
        entry_slots[name] = table  # [B, width]: slot of entry e, -1 past the request's count
        completes = (positions + 1) % ratio == 0  # the token at p closes entry (p + 1) / ratio - 1
        closed = torch.gather(table, 1, ((positions + 1) // ratio - 1).clamp(min=0))
        entry_writes[name] = torch.where(completes, closed, -1)
    hca = None
    if "hca" in entry_slots:
        visible = (positions + 1) // ratios[HCA]
        entries = torch.arange(inputs.key.hca_width, device=device)
        hca = torch.where(entries < visible[..., None], entry_slots["hca"][:, None, :], -1).to(torch.int32)
    return DecodeMetadata(
        key=inputs.key, input_ids=views["input_ids"].view(-1), positions=positions.reshape(-1),
        state_rows=views.get("state_rows"), window_write_slots=window_writes.reshape(-1),
        window_indices=window_lists.to(torch.int32), csa_entry_slots=entry_slots.get("csa"),
        indexer_entry_slots=entry_slots.get("indexer"), hca_indices=hca, entry_writes=entry_writes, plans=plans)
