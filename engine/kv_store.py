"""The engine's KV state: paged row stores shared by all requests, and the compressors' per-request state.

A PagedRows store holds one kind of row for a set of layers in fixed-size pages (a slot is
`page * page_size + offset`, FlashMLA's flat slot id). Each request owns a page table mapping its
logical pages (row // page_size) to physical pages. The engine keeps four stores:
  window      every layer's K=V rows of the sliding window; pages that fall entirely out of the
              window are released as decoding advances, so a request holds at most
              (W - 1) // page_size + 2 pages;
  csa / hca   compressed entries of the ratio-4 / ratio-128 layers (one entry per `ratio` tokens);
  indexer     the lightning indexer's compressed keys of the ratio-4 layers (index_head_dim wide).
Row storage: "auto" keeps rows in the model dtype; "fp8" stores window and compressed rows in
DeepSeek-V4's MODEL1 fp8 layout (engine.h20_ops.kv_cache.fp8: 584 B/token per page block, NoPE e4m3
with power-of-two scales, RoPE bf16) and dequantizes on read. Indexer keys stay in the model dtype
(transformers' reference model scores unquantized keys).

Capacity is reserved per request at admission (its worst case over its lifetime), so a running
request never runs out of pages; pages are handed out on demand inside that reservation.
A write to slot -1 writes nothing (a decode step's static-shape writes address -1 where a request has
no row to write: the fp8 quantizer skips it; a store of model-dtype rows sends it to one scratch row
past its slots, which no list addresses).

CompressorStates keeps every running request's compressor state on the device, one row per request
(plus a scratch row for a decode step's padding rows), per (layer, compressor): what transformers'
DeepseekV4CSACache / DeepseekV4HCACache keep per sequence (engine.model.compressor reads and writes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kernel_source import op
from engine.h20_ops import kv_cache

KV_CACHE_DTYPES = ("auto", "fp8")


class CacheCapacityError(RuntimeError):
    """More rows requested than the request's reservation or the store holds."""


class PagedRows:
    """Rows of width `row_dim` for `num_layers` layers in `num_pages` pages of `page_size` rows."""

    def __init__(self, name: str, *, num_layers: int, num_pages: int, page_size: int, row_dim: int,
                 dtype: torch.dtype, device, fp8: bool):
        self.name = name
        self.num_pages = num_pages
        self.page_size = page_size
        self.row_dim = row_dim
        self.dtype = dtype  # rows are returned in this dtype
        self.fp8 = fp8
        self.scratch_slot = None if fp8 else num_pages * page_size  # where a dense store's -1 writes land
        if fp8:
            self.layers = [kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, num_pages, page_size, device)
                           for _ in range(num_layers)]
        else:
            # Never-written slots are never read (invalid attention entries are not dereferenced).
            self.layers = [torch.empty((num_pages * page_size + 1, row_dim), dtype=dtype, device=device)
                           for _ in range(num_layers)]
        self._free = list(range(num_pages - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}  # logical page -> physical page (-1: released)
        self._reserved: dict[str, int] = {}  # pages a request may still take
        self.reserved_total = 0
        # The tables again as rows of one host array (-1 past a table's end), kept in step with them, so
        # that a decode step reads every request's table with one index (page_tables).
        self._array = np.full((8, 16), -1, dtype=np.int64)
        self._array_row: dict[str, int] = {}
        self._free_array_rows = list(range(7, -1, -1))

    # --- capacity -------------------------------------------------------------------------
    def pages_for_rows(self, n_rows: int) -> int:
        return -(-n_rows // self.page_size)

    def available(self) -> int:
        """Pages neither held nor promised to a running request."""
        return len(self._free) - self.reserved_total

    def admit(self, rid: str, max_pages: int) -> None:
        if rid in self._tables:
            raise ValueError(f"rid: request {rid!r} already holds pages in the {self.name} store")
        if max_pages > self.available():
            raise CacheCapacityError(f"{self.name}: request {rid!r} needs {max_pages} pages, "
                                     f"{self.available()} available")
        self._tables[rid] = []
        self._reserved[rid] = max_pages
        self.reserved_total += max_pages
        if not self._free_array_rows:
            n = self._array.shape[0]
            self._array = np.concatenate([self._array, np.full_like(self._array, -1)])
            self._free_array_rows = list(range(2 * n - 1, n - 1, -1))
        self._array_row[rid] = self._free_array_rows.pop()

    def drop(self, rid: str) -> None:
        table = self._tables.pop(rid)
        self._free.extend(p for p in table if p >= 0)
        self.reserved_total -= self._reserved.pop(rid)
        row = self._array_row.pop(rid)
        self._array[row] = -1
        self._free_array_rows.append(row)

    def _set_page(self, rid: str, table: list[int], logical: int, page: int) -> None:
        table[logical] = page
        if logical >= self._array.shape[1]:
            grown = np.full((self._array.shape[0], 2 * (logical + 1)), -1, dtype=np.int64)
            grown[:, : self._array.shape[1]] = self._array
            self._array = grown
        self._array[self._array_row[rid], logical] = page

    def _give_back(self, rid: str, table: list[int], logical: int) -> None:
        """Free one held page; it returns to the request's reservation (which bounds the pages
        held at once, not the pages taken over the request's lifetime)."""
        self._free.append(table[logical])
        self._set_page(rid, table, logical, -1)
        self._reserved[rid] += 1
        self.reserved_total += 1

    def release_rows_before(self, rid: str, row: int) -> None:
        """Give back the pages whose rows all lie before `row` (rows that left the window). A request's
        held pages are one run (prefill backs a tail, decoding appends, this releases from the front), so
        the walk goes back from the last such page to the first one already free (once per step, it
        visits only the pages it frees)."""
        table = self._tables[rid]
        for logical in range(min(row // self.page_size, len(table)) - 1, -1, -1):
            if table[logical] < 0:
                break
            self._give_back(rid, table, logical)

    def truncate(self, rid: str, end_row: int) -> None:
        """Forget rows end_row and later: give back the pages that hold only such rows (speculative
        rows that were rejected). Rows end_row .. the end of its page stay allocated and are
        overwritten when written again."""
        table = self._tables[rid]
        first_dead = -(-end_row // self.page_size)
        for logical in range(first_dead, len(table)):
            if table[logical] >= 0:
                self._give_back(rid, table, logical)
        del table[first_dead:]

    def held_pages(self, rid: str) -> int:
        return sum(p >= 0 for p in self._tables[rid])

    def ensure_rows(self, rid: str, first_row: int, end_row: int) -> None:
        """Back rows first_row .. end_row - 1 with pages (earlier logical pages are not allocated:
        prefill keeps only the tail of a long prompt in the window store); a decode step backs the rows
        it will write before its first layer, so that its slot lists are known up front."""
        table = self._tables[rid]
        for logical in range(first_row // self.page_size, -(-end_row // self.page_size)):
            while len(table) <= logical:
                table.append(-1)
            if table[logical] >= 0:
                continue
            if self._reserved[rid] == 0:
                raise CacheCapacityError(f"{self.name}: request {rid!r} exceeded its page reservation")
            self._reserved[rid] -= 1
            self.reserved_total -= 1
            self._set_page(rid, table, logical, self._free.pop())

    def ensure_rows_of(self, rids: list[str], first_rows: np.ndarray, end_rows: np.ndarray) -> None:
        """ensure_rows(rids[i], first_rows[i], end_rows[i]) for every i, where a range is at most one page
        longer than a page (a decode step's new rows or entries): the requests whose first and last
        page are already held (so every page between: a request holds one run of pages) are found in
        one array lookup; only the others go through ensure_rows."""
        todo = end_rows > first_rows
        if not todo.any():
            return
        first = first_rows // self.page_size
        last = (np.maximum(end_rows, 1) - 1) // self.page_size
        tables = self.page_tables(rids, int(last.max()) + 1)
        held = ((np.take_along_axis(tables, first[:, None], axis=1)[:, 0] >= 0)
                & (np.take_along_axis(tables, last[:, None], axis=1)[:, 0] >= 0))
        for i in np.flatnonzero(todo & ~held).tolist():
            self.ensure_rows(rids[i], int(first_rows[i]), int(end_rows[i]))

    # --- rows ---------------------------------------------------------------------------
    def page_tables(self, rids: list[str], width: int) -> np.ndarray:
        """The requests' page tables as one host array [len(rids), width] int64: logical page -> physical
        page, -1 where a request holds none (released, never backed, or past its table)."""
        rows = [self._array_row[rid] for rid in rids]
        if width <= self._array.shape[1]:
            return self._array[rows, :width]
        tables = np.full((len(rids), width), -1, dtype=np.int64)
        tables[:, : self._array.shape[1]] = self._array[rows]
        return tables

    def slots(self, rid: str, rows: torch.Tensor) -> torch.Tensor:
        """Flat slot ids (CPU int64, rows' shape) of the request's rows, which must be held."""
        table = torch.tensor(self._tables[rid], dtype=torch.int64)
        rows_cpu = rows.to("cpu", torch.int64)
        if rows_cpu.numel() and int(rows_cpu.max()) >= table.numel() * self.page_size:
            raise CacheCapacityError(f"{self.name}: request {rid!r} reads row {int(rows_cpu.max())} never written")
        pages = table[rows_cpu // self.page_size]
        if bool((pages < 0).any()):
            raise CacheCapacityError(f"{self.name}: request {rid!r} reads a released row")
        return pages * self.page_size + rows_cpu % self.page_size

    def write(self, layer: int, rid: str, first_row: int, values: torch.Tensor) -> None:
        """Store values [n, row_dim] as the request's rows first_row .. first_row + n - 1."""
        n = values.size(0)
        if n == 0:
            return
        self.ensure_rows(rid, first_row, first_row + n)
        self.write_at(layer, self.slots(rid, torch.arange(first_row, first_row + n)).to(values.device), values)

    def write_at(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store values [n, row_dim] at slots [n] (on the store's device; held by their requests, or -1:
        not stored)."""
        if self.fp8:
            op("kv_quantize")(self.layers[layer], slots, values.reshape(values.size(0), 1, self.row_dim).contiguous())
        else:
            self.layers[layer][torch.where(slots >= 0, slots, self.scratch_slot)] = values.to(self.dtype)

    def cache(self, layer: int) -> torch.Tensor:
        """The layer's rows as a decode cache (engine.h20_ops.sparse_mla_decode): the paged fp8 tensor
        [num_pages, page_size, 1, 584], or dense rows [num_slots + 1, 1, row_dim] (the last one the
        scratch row); slot ids address both."""
        rows = self.layers[layer]
        return rows if self.fp8 else rows.view(rows.size(0), 1, self.row_dim)

    def gather(self, layer: int, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows at slots [B, W] (-1: empty, gives a zero row) into out [B, W, 1, row_dim]."""
        if self.fp8:
            return op("kv_gather_dequant")(self.layers[layer], slots, out)
        valid = slots >= 0
        rows = self.layers[layer][torch.where(valid, slots, torch.zeros_like(slots))]
        out[:, :, 0, :] = torch.where(valid[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
        return out

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Rows at slots [n] as [n, row_dim] in the store's dtype."""
        device = self.layers[0].device
        out = torch.empty((1, slots.numel(), 1, self.row_dim), dtype=self.dtype, device=device)
        return self.gather(layer, slots.reshape(1, -1).to(device), out)[0, :, 0, :]

    def roundtrip(self, values: torch.Tensor) -> torch.Tensor:
        """What reading values back after a write returns (fp8: quantized then dequantized), without
        storing them: prefill attends to rows it does not keep (window rows already out of the
        window of the prompt's last token)."""
        if not self.fp8 or values.size(0) == 0:
            return values.to(self.dtype)
        n = values.size(0)
        scratch = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, -(-n // self.page_size), self.page_size, values.device)
        slots = torch.arange(n, device=values.device)
        op("kv_quantize")(scratch, slots, values.reshape(n, 1, self.row_dim).contiguous())
        out = torch.empty((1, n, 1, self.row_dim), dtype=self.dtype, device=values.device)
        return op("kv_gather_dequant")(scratch, slots.reshape(1, n), out)[0, :, 0, :]


@dataclass
class CompressorRows:
    """One compressor (or indexer) of one layer, every request's state in one row (row = the request's
    state row), as transformers' DeepseekV4CSACache / DeepseekV4HCACache define it: the source tokens of
    the open window at slot position % ratio (kv and gate [rows, ratio, width], the gate without the
    position bias), and for the overlapping ratio-4 compressors the previous complete window's first
    series (overlap_kv and overlap_gate [rows, ratio, head_dim], the gate with the position bias; kv 0 and
    gate -inf before the first window closes). kv in the model's dtype; the gates in the dtype of gate +
    position bias (float32 where transformers keeps the bias in float32, as DeepSeek-V4 does), so that
    adding the bias later gives what adding it at once gave. The entry count is not kept: it is
    length // ratio."""

    ratio: int
    head_dim: int
    kv: torch.Tensor
    gate: torch.Tensor
    overlap_kv: torch.Tensor | None
    overlap_gate: torch.Tensor | None

    @property
    def overlap(self) -> bool:
        return self.overlap_kv is not None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.kv, self.gate, self.overlap_kv, self.overlap_gate) if t is not None]


class CompressorStates:
    """Device state rows of every compressor of the model, one row per running request plus one scratch
    row (the state row of a decode step's padding rows, never read for a request)."""

    def __init__(self, specs: dict[tuple[int, str], tuple[int, int, bool, torch.dtype]], *, num_rows: int,
                 dtype: torch.dtype, device):
        """specs: (layer, name) -> (ratio, head_dim, overlap, gate dtype); a source token is 2 * head_dim
        wide where the windows overlap, else head_dim; kv rows in `dtype`."""
        self.scratch_row = num_rows
        self.layers: dict[tuple[int, str], CompressorRows] = {}
        for key, (ratio, head_dim, overlap, gate_dtype) in specs.items():
            width = 2 * head_dim if overlap else head_dim
            shape = (num_rows + 1, ratio, width)
            if overlap:
                extra = dict(overlap_kv=torch.zeros((num_rows + 1, ratio, head_dim), dtype=dtype, device=device),
                             overlap_gate=torch.full((num_rows + 1, ratio, head_dim), float("-inf"),
                                                     dtype=gate_dtype, device=device))
            else:
                extra = dict(overlap_kv=None, overlap_gate=None)
            self.layers[key] = CompressorRows(ratio, head_dim, torch.zeros(shape, dtype=dtype, device=device),
                                              torch.zeros(shape, dtype=gate_dtype, device=device), **extra)
        self._free = list(range(num_rows - 1, -1, -1))
        self._rows: dict[str, int] = {}

    def rows(self, layer: int, name: str) -> CompressorRows:
        return self.layers[(layer, name)]

    def admit(self, rid: str) -> int:
        """A state row for the request (held until drop); its contents are set by the request's prefill."""
        if rid in self._rows:
            raise ValueError(f"rid: request {rid!r} already holds a compressor state row")
        if not self._free:
            raise CacheCapacityError(f"compressor states: no free row for request {rid!r} "
                                     f"({self.scratch_row} rows, one per request of a batch)")
        self._rows[rid] = self._free.pop()
        return self._rows[rid]

    def drop(self, rid: str) -> None:
        self._free.append(self._rows.pop(rid))

    def save(self) -> list[torch.Tensor]:
        """A copy of every state tensor (restore puts it back)."""
        return [t.clone() for rows in self.layers.values() for t in rows.tensors()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip((t for rows in self.layers.values() for t in rows.tensors()), saved, strict=True):
            t.copy_(s)

    def describe(self, row: int, length: int) -> dict[tuple[int, str], dict]:
        """Per compressor, the state of the request in `row` after `length` tokens, as transformers keeps
        it: entries (count), buffer (the open window's tokens [length % ratio, width]) and overlap (the
        previous complete window's first series [ratio, head_dim], None before the first)."""
        out = {}
        for key, rows in self.layers.items():
            entries = length // rows.ratio
            overlap = rows.overlap_kv[row].clone() if rows.overlap and entries else None
            out[key] = dict(entries=entries, buffer=rows.kv[row, : length % rows.ratio].clone(), overlap=overlap)
        return out


@dataclass
class RequestState:
    rid: str
    length: int = 0  # tokens whose KV is stored (positions 0 .. length - 1)
    state_row: int | None = None  # its row in the CompressorStates (None: the model has no compressor)
