"""What every layer's attention of one decode step reads, built once per step before the first layer.

DeepSeek-V4 decode, per request b with new tokens at positions start_b .. start_b + s_q - 1:
  - query j at position p attends to the window positions max(0, p - W + 1) .. p (itself included) in
    the window store, oldest first: `window_indices` [B, s_q, topk_w] slot ids (-1 past its count);
  - a compressed layer adds entries of its store: entry e is visible to p iff e < (p + 1) // ratio; a
    ratio-128 layer attends to all visible entries (`hca_indices` [B, s_q, E] slot ids), a ratio-4 layer to
    its indexer's top-k among them (entry ids chosen inside the layer, mapped to slots by `csa_slots` through
    the step's entry slot table, on the GPU);
  - the rows this step writes: `window_write_slots` [B * s_q] (every layer writes its new rows there).
The pages these rows and entries need are backed here, before any layer writes them (the stores' page
tables are per request, shared by all layers of a store, so one table serves every layer). Everything is
computed on the host from the page tables and copied to the device ONCE per step; the plans of the three
layer types (engine.h20_ops.plan_sparse_decode) are made here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernel_source import op
from engine.h20_ops import DecodePlan
from engine.model.layer_types import CSA, HCA, SLIDING


@dataclass
class DecodeMetadata:
    batch: int
    s_q: int
    window_write_slots: torch.Tensor  # [B * s_q] int64
    window_indices: torch.Tensor  # [B, s_q, topk_w] int32
    csa_entry_slots: torch.Tensor | None  # [B, E_csa] int64: slot of entry e of request b (-1: none yet)
    csa_topk: int  # width of a ratio-4 layer's extra list (0: no entry visible to any query)
    hca_indices: torch.Tensor | None  # [B, s_q, E_hca] int32
    plans: dict[str, DecodePlan]  # per layer type

    def csa_slots(self, chosen: torch.Tensor) -> torch.Tensor:
        """chosen [B, s_q, csa_topk] entry ids (-1: none) -> slot ids of the csa store, int32 (GPU ops)."""
        table = self.csa_entry_slots[:, None, :].expand(-1, self.s_q, -1)
        slots = torch.gather(table, 2, chosen.clamp(min=0))
        return torch.where(chosen >= 0, slots, -1).to(torch.int32)


def _window(runtime, seqs, s_q: int):
    """Host tensors: the write slots [B * s_q] and the window lists [B, s_q, topk_w]."""
    window = runtime.stores.window
    topk = min(runtime.window, max(s.start + s_q for s in seqs))
    indices = torch.full((len(seqs), s_q, topk), -1, dtype=torch.int64)
    writes = []
    for b, s in enumerate(seqs):
        window.ensure_rows(s.state.rid, s.start, s.start + s_q)
        first = max(0, s.start - runtime.window + 1)  # the oldest position any of its queries reads
        slots = window.slots(s.state.rid, torch.arange(first, s.start + s_q))
        writes.append(slots[s.start - first:])
        for j in range(s_q):
            p = s.start + j
            lo = max(0, p - runtime.window + 1)
            indices[b, j, : p + 1 - lo] = slots[lo - first: p + 1 - first]
    return torch.cat(writes), indices


def _entry_slots(store, ratio: int, seqs, s_q: int) -> torch.Tensor:
    """[B, E] slots of each request's compressed entries after this step (backed now), -1 past its count."""
    counts = [(s.start + s_q) // ratio for s in seqs]
    table = torch.full((len(seqs), max(counts)), -1, dtype=torch.int64)
    for b, (s, n) in enumerate(zip(seqs, counts)):
        if n:
            store.ensure_rows(s.state.rid, 0, n)
            table[b, :n] = store.slots(s.state.rid, torch.arange(n))
    return table


def build_decode_metadata(runtime, seqs) -> DecodeMetadata:
    """The step's metadata for runtime (a DeepseekV4Runtime) and its sequences (SeqStep, each with the same
    number of new tokens)."""
    s_q = seqs[0].length
    if any(s.length != s_q for s in seqs):
        raise ValueError(f"seqs: decode needs the same number of new tokens per sequence, got "
                         f"{[s.length for s in seqs]}")
    batch = len(seqs)
    stores = runtime.stores
    host = {}
    host["writes"], host["window"] = _window(runtime, seqs, s_q)
    positions = torch.tensor([s.start for s in seqs])[:, None] + torch.arange(s_q)[None, :]  # [B, s_q]
    csa_topk = 0
    if stores.csa is not None:
        host["csa"] = _entry_slots(stores.csa, runtime.ratio[CSA], seqs, s_q)
        index_topk = runtime.config.index_topk
        csa_topk = max(min(index_topk, (s.start + s_q) // runtime.ratio[CSA]) for s in seqs)
    if stores.hca is not None:
        table = _entry_slots(stores.hca, runtime.ratio[HCA], seqs, s_q)
        visible = (positions + 1) // runtime.ratio[HCA]  # [B, s_q]
        ids = torch.arange(table.size(1))
        host["hca"] = torch.where(ids[None, None, :] < visible[..., None], table[:, None, :], -1)
    # one host-to-device copy for all of it
    device = stores.window.layers[0].device
    flat = torch.cat([t.reshape(-1) for t in host.values()]).to(device)
    dev = dict(zip(host, flat.split([t.numel() for t in host.values()])))
    dev = {name: part.view(host[name].shape) for name, part in dev.items()}
    window_indices = dev["window"].to(torch.int32)
    hca = dev.get("hca")
    hca_indices = hca.to(torch.int32) if hca is not None and hca.size(2) else None

    dtype = runtime.model.embed_tokens.weight.dtype
    window_cache = stores.window.cache(0)
    common = dict(batch=batch, s_q=s_q, h_q=runtime.heads, topk=window_indices.size(2), q_dtype=dtype)
    plan_sparse_decode = op("plan_sparse_decode")
    plans = {SLIDING: plan_sparse_decode(window_cache, **common)}
    if stores.csa is not None:
        plans[CSA] = (plan_sparse_decode(window_cache, extra_cache=stores.csa.cache(0), extra_topk=csa_topk, **common)
                      if csa_topk else plans[SLIDING])
    if stores.hca is not None:
        plans[HCA] = (plan_sparse_decode(window_cache, extra_cache=stores.hca.cache(0),
                                         extra_topk=hca_indices.size(2), **common)
                      if hca_indices is not None else plans[SLIDING])
    return DecodeMetadata(batch, s_q, dev["writes"], window_indices, dev.get("csa"), csa_topk, hca_indices, plans)
