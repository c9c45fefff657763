"""DeepSeek-V4 forward for the engine: packed prefill and batched decode over the engine's KV state.

Weights and the non-attention blocks come from transformers' DeepseekV4ForCausalLM (loaded from
the HF-format checkpoint): embeddings, routers and shared experts, projections, head. Everything
that is attention, state or a host sync in transformers' eager model is the engine's own, every op
through engine.kernel_source.op (this package's implementation, or a verified kernel repository's under
DEEPINFER_KERNEL_SOURCE=hub):
  - norms and RoPE (engine.ops: DEEPINFER_KERNELS picks Triton or torch);
  - K=V rows, compressed entries and indexer keys in the paged stores of engine.kv_store;
  - compressors (ratio 4 with overlapping windows + lightning indexer, ratio 128) on device state
    rows (engine.model.compressor: a request's prompt at once in prefill, one token per request of the
    batch in decode), as transformers' DeepseekV4CSACache / HCACache define them;
  - the routed experts computed for every expert and combined by the router's weights (`_moe`):
    transformers' eager experts pick the experts hit by `nonzero()`, a host sync no CUDA graph can
    capture; dense over the experts costs num_experts / num_experts_per_tok times the routed FLOPs,
    nothing for the tiny model's 4 experts, a grouped GEMM's job for a real checkpoint;
  - attention ONLY through engine.h20_ops: sparse_mla_prefill over the packed batch, sparse_mla_decode
    with the sliding-window store as main cache and a compressed store as the extra cache (flat slot
    ids, sinks passed in); inverse RoPE on the output, then the grouped output projection.
Decode (`decode`): the step's metadata (engine.model.decode_metadata) is built on the host once per step
(or ahead of it, during the previous step: `prepare_decode`) in static shapes and copied to the device in
one transfer; `decode_step` then runs the whole model on
the device with GPU ops only (no host sync, no tensor from host data): what a CUDA graph captures
(engine.model.decode_graphs), and what runs eagerly on a CPU or with graphs off.

Sequence rules (transformers' eager model is the oracle): a query at position p sees window
positions p - W + 1 .. p (W = sliding_window, itself included) and the compressed entries
w < (p + 1) // ratio; a ratio-4 layer attends only to the indexer's top-k among those.
Prefill always starts at position 0 (no chunked prefill, no prefix reuse).
Decode takes the same number of new tokens per sequence: 1, or k + 1 when verifying NextN drafts
(sparse_mla_decode with s_q = k + 1); a speculative step journals the compressor state rows so that
`rollback` can drop the rejected tail. NextNRuntime runs the NextN (MTP) drafter layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernel_source import op
from engine.kv_store import CompressorRows, CompressorStates, PagedRows, RequestState
from engine.model import compressor
from engine.model.decode_metadata import (DecodeInputs, DecodeKey, DecodeMetadata, build_decode_inputs,
                                          decode_metadata, plan_decode)
from engine.model.layer_types import CSA, HCA, SLIDING


@dataclass
class SeqStep:
    """One request's share of a step: `length` new tokens at positions start .. start + length - 1,
    rows offset .. offset + length - 1 of the packed batch."""

    state: RequestState
    start: int
    length: int
    offset: int


@dataclass
class Stores:
    window: PagedRows
    csa: PagedRows | None
    hca: PagedRows | None
    indexer: PagedRows | None


@dataclass
class _Journaled:
    """A compressor of a speculative step: its state rows before the step (each tensor at the batch's
    state rows) and the step's source tokens [B, s_q, width]."""

    rows: CompressorRows
    saved: list[torch.Tensor]
    kv: torch.Tensor
    gate: torch.Tensor
    position_bias: torch.Tensor
    store: PagedRows


def compressor_specs(hf_model) -> dict[tuple[int, str], tuple[int, int, bool, torch.dtype]]:
    """(layer, "compressor" | "indexer") -> (ratio, head_dim, overlapping windows, gate dtype) of every
    compressor of transformers' model (engine.kv_store.CompressorStates); the gate dtype is that of
    gate + position bias (the bias is kept in float32 in a bf16 model)."""
    cfg = hf_model.config
    specs = {}
    for layer, (kind, module) in enumerate(zip(cfg.layer_types, hf_model.model.layers)):
        if kind == SLIDING:
            continue
        comp = module.self_attn.compressor
        dtype = comp.kv_proj.weight.dtype
        gate = torch.promote_types(dtype, comp.position_bias.dtype)
        specs[(layer, "compressor")] = (cfg.compress_rates[kind], cfg.head_dim, kind == CSA, gate)
        if kind == CSA:
            indexer = comp.indexer
            specs[(layer, "indexer")] = (cfg.compress_rates[CSA], cfg.index_head_dim, True,
                                         torch.promote_types(dtype, indexer.position_bias.dtype))
    return specs


class DeepseekV4Runtime:
    def __init__(self, hf_model, stores: Stores, *, max_batch: int, compressor_states: CompressorStates | None):
        """max_batch: the most requests of a step (the decode batch is padded up to a bucket that does not
        exceed it); compressor_states: the compressors' state rows (None: a model without compressors)."""
        self.hf = hf_model
        self.config = hf_model.config
        self.model = hf_model.model
        self.stores = stores
        self.max_batch = max_batch
        self.compressor_states = compressor_states
        self.device = stores.window.layers[0].device
        cfg = self.config
        self.eps = cfg.rms_norm_eps
        self.window = cfg.sliding_window
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.ratio = {CSA: cfg.compress_rates[CSA], HCA: cfg.compress_rates[HCA]}
        page_sizes = {name: store.page_size for name, store in vars(stores).items() if store is not None}
        if len(set(page_sizes.values())) != 1:
            raise ValueError(f"stores: the decode metadata needs one page size for every store, got {page_sizes}")
        self.page_size = page_sizes["window"]
        # A speculative step: {"seqs": rid -> (batch row, start), "compressors": [_Journaled]} for rollback.
        self.journal: dict | None = None
        self.graphs = None  # engine.model.decode_graphs.DecodeGraphs when decode steps replay CUDA graphs
        self._plans: dict[DecodeKey, dict] = {}
        # Per layer type, the slot of the layer in its compressed store.
        self.store_slot: dict[int, int] = {}
        for kind in (CSA, HCA):
            for slot, layer in enumerate(i for i, t in enumerate(cfg.layer_types) if t == kind):
                self.store_slot[layer] = slot

    # -- rope -----------------------------------------------------------------------------
    def _cos_sin(self, positions: torch.Tensor, rope_type: str, dtype: torch.dtype):
        """(cos, sin) [n, rope_dim / 2] for positions [n], as transformers computes them (cast to dtype)."""
        probe = torch.empty(0, dtype=dtype, device=positions.device)
        cos, sin = self.model.rotary_emb(probe, position_ids=positions[None], layer_type=rope_type)
        return cos[0], sin[0]

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        return {kind: self._cos_sin(positions, kind, dtype) for kind in ("main", "compress")}

    def _compress_rope(self, dtype: torch.dtype):
        return lambda positions: self._cos_sin(positions, "compress", dtype)

    # -- whole model ----------------------------------------------------------------------
    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids).unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, seqs: list[SeqStep], *,
                all_hidden: bool = False):
        """Packed prefill of new requests (each from position 0): input_ids, positions [T] on the device.
        Returns (logits fp32 of each sequence's last token [len(seqs), vocab], hidden): hidden None, or with
        all_hidden every token's final hidden state [T, hidden] (after the head's hyper-connection
        collapse, before the final norm: what the NextN layer takes)."""
        self.journal = None
        for i, s in enumerate(seqs):
            if s.start != 0:
                raise ValueError(f"seqs[{i}]: prefill must start at position 0, got {s.start}")
        hidden = self._embed(input_ids)
        rope = self.rope_tables(positions, hidden.dtype)
        for layer_idx, layer in enumerate(self.model.layers):
            hidden = self.decoder_layer(layer_idx, layer, hidden, input_ids, rope, positions=positions, seqs=seqs)
        last = torch.tensor([s.offset + s.length - 1 for s in seqs], device=hidden.device)
        return self.head(self.model.hc_head, self.model.norm.weight, hidden, last, False, all_hidden)

    def prepare_decode(self, seqs: list[SeqStep]) -> DecodeInputs:
        """The metadata of a decode step over seqs built ahead of it, before its token ids are known (the
        runner builds step n + 1's while the GPU runs step n); `decode(..., inputs=)` takes it. Backs the
        pages the step writes, as `decode` would. On a GPU its host array is pinned now, off the step's path."""
        inputs = build_decode_inputs(self, seqs, None)
        if self.device.type == "cuda":
            inputs.host = inputs.host.pin_memory()  # the step's copy then pins nothing (pin_memory() of it: itself)
        return inputs

    @torch.no_grad()
    def decode(self, input_ids, seqs: list[SeqStep], *, inputs: DecodeInputs | None = None, all_logits: bool = False,
               all_hidden: bool = False, speculative: bool = False):
        """One decode step: input_ids the B * s_q new token ids, request after request: on the host (a list
        or CPU tensor; they travel in the step's one copy), or an int64 tensor on the runtime's device (the
        tokens the step before chose, not read back: copied into the step's buffer on the device); seqs one
        SeqStep per request (same length s_q); inputs: the step's metadata from prepare_decode(seqs) (None:
        built here). Returns (logits fp32, hidden): each sequence's last token's logits [B, vocab]
        (all_logits: every token's, [B * s_q, vocab]); hidden None, or with all_hidden every token's
        [B * s_q, hidden].
        speculative: journal the compressor states so that `rollback` can drop trailing tokens.
        With CUDA graphs (self.graphs) a plain step (no all_logits / all_hidden / speculative) replays the
        graph of its DecodeKey; every other step runs decode_step eagerly."""
        on_device = torch.is_tensor(input_ids) and input_ids.device == self.device
        n_ids = sum(s.length for s in seqs)
        if on_device and (input_ids.dtype != torch.long or input_ids.shape != (n_ids,)):
            raise ValueError(f"input_ids: expected an int64 tensor of shape [{n_ids}] (B * s_q), got "
                             f"{input_ids.dtype} {tuple(input_ids.shape)}")
        if inputs is None:
            inputs = build_decode_inputs(self, seqs, None if on_device else input_ids)
        elif inputs.batch != len(seqs) or inputs.key.s_q != seqs[0].length:
            raise ValueError(f"inputs: prepared for {inputs.batch} sequences x {inputs.key.s_q} tokens, the step has "
                             f"{len(seqs)} x {seqs[0].length}")
        elif not on_device:
            inputs.set_input_ids(input_ids)
        device_ids = input_ids if on_device else None
        rows = inputs.batch * inputs.key.s_q
        if self.graphs is not None and not (all_logits or all_hidden or speculative):
            self.journal = None
            return self.graphs.run(inputs, device_ids)[: inputs.batch], None
        self.journal = ({"seqs": {s.state.rid: (b, s.start) for b, s in enumerate(seqs)}, "compressors": []}
                        if speculative else None)
        buffer = inputs.host.to(self.device)
        if device_ids is not None:
            inputs.token_ids(buffer).copy_(device_ids)
        logits, hidden = self.decode_step(buffer, inputs, all_logits=all_logits, all_hidden=all_hidden)
        logits = logits[:rows] if all_logits else logits[: inputs.batch]
        return logits, None if hidden is None else hidden[:rows]

    def decode_plans(self, key: DecodeKey) -> dict:
        plans = self._plans.get(key)
        if plans is None:
            plans = self._plans[key] = plan_decode(self, key)
        return plans

    def decode_metadata(self, buffer: torch.Tensor, inputs: DecodeInputs) -> DecodeMetadata:
        """The step's metadata on the device (decode_metadata over this runtime's window, page size, ratios)."""
        return decode_metadata(buffer, inputs, self.decode_plans(inputs.key), window=self.window,
                               page_size=self.page_size, ratios=self.ratio)

    def decode_step(self, buffer: torch.Tensor, inputs: DecodeInputs, *, all_logits: bool = False,
                    all_hidden: bool = False):
        """The decode forward on the device from the step's metadata buffer (inputs.host's values on the
        device): GPU ops only, what a CUDA graph captures. Returns (logits, hidden) over the padded batch:
        [key.batch, vocab] (all_logits: [key.batch * s_q, vocab]), hidden as `decode`."""
        meta = self.decode_metadata(buffer, inputs)
        hidden = self._embed(meta.input_ids)
        rope = self.rope_tables(meta.positions, hidden.dtype)
        for layer_idx, layer in enumerate(self.model.layers):
            hidden = self.decoder_layer(layer_idx, layer, hidden, meta.input_ids, rope, meta=meta)
        last = slice(meta.s_q - 1, None, meta.s_q)  # each request's last row
        return self.head(self.model.hc_head, self.model.norm.weight, hidden, last, all_logits, all_hidden)

    def head(self, hc_head, norm_weight, hidden, last, all_logits: bool, all_hidden: bool):
        """hidden [T, hc, hidden] -> (logits fp32, collapsed hidden or None) as `prefill` / `decode` return
        them, through the shared lm_head; last: the rows of the sequences' last tokens (an index tensor or
        a slice)."""
        if not (all_logits or all_hidden):
            hidden = hidden[last]
        collapsed = self._hyper_head(hc_head, hidden)
        logit_rows = collapsed
        if all_hidden and not all_logits:
            logit_rows = collapsed[last]
        logits = self.hf.lm_head(op("rms_norm")(logit_rows, norm_weight, self.eps)).float()
        return logits, (collapsed if all_hidden else None)

    def decoder_layer(self, layer_idx, layer, hidden, input_ids, rope, *, positions=None, seqs=None,
                      meta: DecodeMetadata | None = None):
        """One DeepSeek-V4 decoder layer on [T, hc, hidden]; layer_idx addresses the KV stores. Prefill:
        positions [T] and seqs; decode: meta, the step's metadata."""
        dtype = hidden.dtype
        post, comb, collapsed = self._hyper_connection(layer.attn_hc, hidden)
        x = op("rms_norm")(collapsed, layer.input_layernorm.weight, self.eps)
        attn_out = self._attention(layer_idx, layer.self_attn, x, rope, positions, seqs, meta)
        hidden = post.to(dtype).unsqueeze(-1) * attn_out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), hidden)
        post, comb, collapsed = self._hyper_connection(layer.ffn_hc, hidden)
        x = op("rms_norm")(collapsed, layer.post_attention_layernorm.weight, self.eps)
        mlp_out = self._moe(layer.mlp, x, input_ids)
        return post.to(dtype).unsqueeze(-1) * mlp_out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), hidden)

    def _moe(self, mlp, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """transformers' DeepseekV4SparseMoeBlock on x [T, hidden] (its router, hash-routed or top-k, and
        shared experts), the routed experts computed for every expert: GPU ops only. The per-token sum over
        its chosen experts, weighted, in router order, as transformers' grouped_mm implementation does."""
        if mlp.is_hash:
            _, weights, chosen = mlp.gate(x, input_ids)
        else:
            _, weights, chosen = mlp.gate(x)
        experts = mlp.experts
        gate_up = torch.matmul(x, experts.gate_up_proj.transpose(1, 2))  # [E, T, 2 * intermediate]
        out = torch.matmul(experts._apply_gate(gate_up), experts.down_proj.transpose(1, 2))  # [E, T, hidden]
        picked = out.transpose(0, 1).gather(1, chosen.unsqueeze(-1).expand(-1, -1, x.size(-1)))  # [T, k, hidden]
        routed = (picked * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        return routed + mlp.shared_experts(x)

    def rollback(self, state: RequestState, keep: int) -> None:
        """After a speculative decode step of n tokens, keep only the first `keep`: every compressor row of
        the request goes back to its state before the step and takes just those tokens again (the entries
        they complete were already stored, identically); pages holding only dropped entries are given
        back. The window rows are the caller's (PagedRows.truncate)."""
        b, start = self.journal["seqs"][state.rid]
        row = torch.tensor([state.state_row], device=self.device)
        positions = torch.arange(start, start + keep, device=self.device)
        for rec in self.journal["compressors"]:
            for tensor, saved in zip(rec.rows.tensors(), rec.saved):
                tensor[state.state_row] = saved[b]
            for j in range(keep):
                compressor.replay_token(rec.rows, row, positions[j:j + 1], rec.kv[b, j:j + 1], rec.gate[b, j:j + 1],
                                        rec.position_bias)
            rec.store.truncate(state.rid, (start + keep) // rec.rows.ratio)

    def _hyper_connection(self, hc, hidden: torch.Tensor):
        """transformers' DeepseekV4HyperConnection on [T, hc, hidden]: its norm through the engine's rms_norm
        op, its projection, then the hyper_connection op (pre / post / comb weights, Sinkhorn, the collapse:
        one Triton launch, or transformers' torch code under DEEPINFER_KERNELS=ref)."""
        flat = op("rms_norm")(hidden.reshape(hidden.size(0), -1).float(), None, self.eps)
        mixes = F.linear(flat, hc.fn.float())
        return op("hyper_connection")(hidden, mixes, hc.scale, hc.base, hc.hc_eps, hc.hc_sinkhorn_iters)

    def _hyper_head(self, head, hidden: torch.Tensor) -> torch.Tensor:
        flat = op("rms_norm")(hidden.flatten(1).float(), None, self.eps)
        mixes = F.linear(flat, head.hc_fn.float())
        pre = torch.sigmoid(mixes * head.hc_scale.float() + head.hc_base.float()) + head.eps
        return (pre.unsqueeze(-1) * hidden).sum(dim=1).to(hidden.dtype)

    # -- attention ------------------------------------------------------------------------
    def _attention(self, layer_idx, attn, x, rope, positions, seqs, meta: DecodeMetadata | None):
        total = x.size(0)
        cos, sin = rope[attn.rope_layer_type]
        q_residual = op("rms_norm")(attn.q_a_proj(x), attn.q_a_norm.weight, self.eps)
        q = attn.q_b_proj(q_residual).view(total, self.heads, self.head_dim)
        q = op("rope")(op("rms_norm")(q, None, self.eps), cos, sin)
        kv = op("rope")(op("rms_norm")(attn.kv_proj(x), attn.kv_norm.weight, self.eps), cos, sin)  # [T, D]

        if meta is None:
            window = self.stores.window
            for s in seqs:  # keep the rows the next decode steps need: the last W - 1 (+ this one)
                keep = min(s.length, self.window)
                first = s.start + s.length - keep
                window.write(layer_idx, s.state.rid, first, kv[s.offset + s.length - keep: s.offset + s.length])
            entries = selections = None
            if attn.layer_type != SLIDING:
                entries, selections = self._compress_prefill(layer_idx, attn, x, q_residual, positions, seqs, rope)
            out = self._prefill_attention(layer_idx, attn, q, kv, seqs, entries, selections)
        else:
            self.stores.window.write_at(layer_idx, meta.window_write_slots, kv)
            extra = {}
            if attn.layer_type != SLIDING:
                chosen = self._compress_decode(layer_idx, attn, x, q_residual, rope, meta)
                store = self._compressed_store(attn.layer_type)
                extra = dict(extra_cache=store.cache(self.store_slot[layer_idx]),
                             extra_indices=meta.csa_slots(chosen) if attn.layer_type == CSA else meta.hca_indices)
            out = self._decode_attention(layer_idx, attn, q, meta, extra)
        out = op("rope")(out, cos, sin, inverse=True)
        grouped = attn.o_a_proj(out.reshape(total, self.config.o_groups, -1)).flatten(1)
        return attn.o_b_proj(grouped)

    def _compressed_store(self, layer_type: str) -> PagedRows:
        return self.stores.csa if layer_type == CSA else self.stores.hca

    def _compress_prefill(self, layer_idx, attn, x, q_residual, positions, seqs, rope):
        """Run the layer's compressor (and indexer) over each new request's prompt; store its entries and
        leave its state rows for decoding. Returns (entries, selections) per sequence: all its
        compressed entries [n_e, D] as stored (fp8: the quantization round trip) and the entries each
        token attends to, [length, k] entry ids with -1 for none (HCA: every complete entry; CSA: the
        indexer's top-k)."""
        comp = attn.compressor
        kind = attn.layer_type
        ratio = self.ratio[kind]
        store = self._compressed_store(kind)
        slot = self.store_slot[layer_idx]
        rows = self.compressor_states.rows(layer_idx, "compressor")
        kv_all, gate_all = comp.kv_proj(x), comp.gate_proj(x)
        entries, selections = [], []
        for s in seqs:
            span = slice(s.offset, s.offset + s.length)
            new = compressor.prefill(rows, s.state.state_row, kv_all[span], gate_all[span], comp.position_bias,
                                     comp.kv_norm.weight, self.eps, self._compress_rope(kv_all.dtype))
            store.write(slot, s.state.rid, 0, new)
            visible = (positions[span] + 1) // ratio  # entries w < visible[t] are complete for token t
            if kind == CSA:
                cos, sin = rope["compress"]
                selections.append(self._index_prefill(layer_idx, comp.indexer, x[span], q_residual[span], s,
                                                      visible, cos[span], sin[span]))
            else:
                ids = torch.arange(new.size(0), device=x.device)[None, :]
                selections.append(torch.where(ids < visible[:, None], ids, -1))
            entries.append(store.roundtrip(new))
        return entries, selections

    def _index_prefill(self, layer_idx, indexer, x, q_residual, s: SeqStep, visible, cos, sin):
        """Lightning indexer over one request's prompt: pool its keys, score every key, keep the top-k
        complete entries per token, as transformers' prefill does: [length, k] entry ids, -1 where none."""
        rows = self.compressor_states.rows(layer_idx, "indexer")
        kv, gate = indexer.kv_proj(x), indexer.gate_proj(x)
        keys = compressor.prefill(rows, s.state.state_row, kv, gate, indexer.position_bias, indexer.kv_norm.weight,
                                  self.eps, self._compress_rope(kv.dtype))
        self.stores.indexer.write(self.store_slot[layer_idx], s.state.rid, 0, keys)
        n_keys = keys.size(0)
        if n_keys == 0:
            return torch.zeros((x.size(0), 0), dtype=torch.long, device=x.device)
        q = op("rope")(indexer.q_b_proj(q_residual).view(x.size(0), indexer.num_heads, indexer.head_dim), cos, sin)
        scores = compressor.index_scores(indexer.scorer, q[None], keys.t()[None, None], x[None])[0]  # [S, n_keys]
        future = torch.arange(n_keys, device=x.device)[None, :] >= visible[:, None]
        top = scores.masked_fill(future, float("-inf")).topk(min(indexer.index_topk, n_keys), dim=-1).indices
        return torch.where(top < visible[:, None], top, -1)  # picks among -inf scores are not entries

    def _compress_decode(self, layer_idx, attn, x, q_residual, rope, meta: DecodeMetadata):
        """Advance the layer's compressor (and indexer) by the step's tokens, storing the entries they
        complete. Returns the indexer's choices [B, s_q, meta.csa_topk] entry ids (-1: none) for CSA, None for
        HCA (the step's metadata lists its entries). GPU ops only."""
        comp = attn.compressor
        store = self._compressed_store(attn.layer_type)
        self._advance_decode(layer_idx, "compressor", comp, x, store, "csa" if attn.layer_type == CSA else "hca",
                             meta)
        if attn.layer_type == HCA:
            return None
        indexer = comp.indexer
        index_store = self.stores.indexer
        self._advance_decode(layer_idx, "indexer", indexer, x, index_store, "indexer", meta)
        batch, s_q = meta.batch, meta.s_q
        entries = meta.indexer_entry_slots
        keys = torch.empty((batch, entries.size(1), 1, indexer.head_dim), dtype=index_store.dtype, device=x.device)
        keys = index_store.gather(self.store_slot[layer_idx], entries, keys)[:, :, 0]  # [B, E, d]; -1: zero rows
        cos, sin = rope["compress"]
        q = op("rope")(indexer.q_b_proj(q_residual).view(x.size(0), indexer.num_heads, indexer.head_dim), cos, sin)
        scores = compressor.index_scores(indexer.scorer, q.view(batch, s_q, *q.shape[1:]),
                                         keys.transpose(1, 2)[:, None], x.view(batch, s_q, -1))  # [B, s_q, E]
        visible = (meta.positions.view(batch, s_q) + 1) // self.ratio[CSA]
        return compressor.decode_top_k(scores, visible, meta.csa_topk)

    def _advance_decode(self, layer_idx, name, module, x, store: PagedRows, writes: str, meta: DecodeMetadata):
        """One compressor (module: transformers' compressor or indexer of the layer) over the step's tokens,
        one token of every request at a time; the entry a token completes goes to its write slot
        (meta.entry_writes[writes]: -1 where none)."""
        rows = self.compressor_states.rows(layer_idx, name)
        batch, s_q = meta.batch, meta.s_q
        kv = module.kv_proj(x).view(batch, s_q, -1)
        gate = module.gate_proj(x).view(batch, s_q, -1)
        if self.journal is not None:
            saved = [t[meta.state_rows].clone() for t in rows.tensors()]
            self.journal["compressors"].append(_Journaled(rows, saved, kv, gate, module.position_bias, store))
        positions = meta.positions.view(batch, s_q)
        slot = self.store_slot[layer_idx]
        cos_sin = self._compress_rope(kv.dtype)
        for j in range(s_q):
            entry = compressor.decode_token(rows, meta.state_rows, positions[:, j], kv[:, j], gate[:, j],
                                            module.position_bias, module.kv_norm.weight, self.eps, cos_sin)
            store.write_at(slot, meta.entry_writes[writes][:, j], entry)

    def _prefill_attention(self, layer_idx, attn, q, kv, seqs, entries, selections):
        """One packed workspace [sum over sequences of (prompt rows + entry rows), 1, D] and one
        index list per token: its window rows, then its selected entry rows, compacted to the front
        with index_length = their count (the kernel walks no further), -1 after."""
        window = self.stores.window
        parts, lists = [], []
        base = 0
        for i, s in enumerate(seqs):
            rows = window.roundtrip(kv[s.offset: s.offset + s.length])
            parts.append(rows)
            t = torch.arange(s.length, device=q.device)
            # distance from the token; a prompt shorter than the window needs only its length
            back = torch.arange(min(self.window, s.length) - 1, -1, -1, device=q.device)
            pos = t[:, None] - back[None, :]  # [L, W]
            window_idx = torch.where(pos >= 0, base + pos, torch.full_like(pos, -1))
            token_lists = [window_idx]
            entry_base = base + s.length
            base = entry_base
            if entries is not None:
                parts.append(entries[i])
                base += entries[i].size(0)
                chosen = selections[i]
                token_lists.append(torch.where(chosen >= 0, entry_base + chosen, -1))
            lists.append(torch.cat(token_lists, dim=1))
        index = torch.full((q.size(0), max(l.size(1) for l in lists)), -1, dtype=torch.long, device=q.device)
        for s, l in zip(seqs, lists):
            index[s.offset: s.offset + s.length, : l.size(1)] = l
        # Valid entries first, in order (a stable sort on invalidity); every token has >= 1 (itself).
        index = index.gather(1, torch.argsort((index < 0).to(torch.int8), dim=1, stable=True))
        index_length = (index >= 0).sum(dim=1)
        index = index[:, : int(index_length.max())].to(torch.int32).contiguous()
        workspace = torch.cat(parts).to(q.dtype).unsqueeze(1)
        return op("sparse_mla_prefill")(q, workspace, index, attn.scaling, attn_sink=attn.sinks.detach(),
                                  topk_length=index_length.to(torch.int32)).out

    def _decode_attention(self, layer_idx, attn, q, meta: DecodeMetadata, extra: dict):
        """The sliding window as main cache, the layer type's compressed store as extra cache (extra: its
        cache and lists, none for a sliding layer), one call over the step's metadata. GPU ops only."""
        q4 = q.view(meta.batch, meta.s_q, *q.shape[1:])
        res = op("sparse_mla_decode")(q4, self.stores.window.cache(layer_idx), meta.window_indices, attn.scaling,
                                plan=meta.plans[attn.layer_type], attn_sink=attn.sinks.detach(), **extra)
        return res.out.flatten(0, 1)


class NextNRuntime:
    """Forward of the NextN (MTP) drafter layer (engine.model.nextn) over its own window store:
    row i takes token i + 1 and the hidden state h_i (the main model's, or its own for chained
    drafts), sits at position i, and predicts token i + 2. Window-only: its state is the window
    rows, so dropping speculative rows is PagedRows.truncate alone. Runs eagerly (no CUDA graph)."""

    def __init__(self, main: DeepseekV4Runtime, layer, window_store: PagedRows):
        self.main = main
        self.layer = layer
        self.runtime = DeepseekV4Runtime(main.hf, Stores(window=window_store, csa=None, hca=None, indexer=None),
                                         max_batch=main.max_batch, compressor_states=None)

    def _streams(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        eps = self.main.eps
        layer = self.layer
        embeds = op("rms_norm")(self.main.model.embed_tokens(input_ids), layer.enorm.weight, eps)
        x = layer.eh_proj(torch.cat([embeds, op("rms_norm")(hidden, layer.hnorm.weight, eps)], dim=-1))
        return x.unsqueeze(1).expand(-1, self.main.config.hc_mult, -1).contiguous()

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, seqs: list[SeqStep]):
        """input_ids, positions [T], hidden [T, hidden] on the device. Returns (logits [T, vocab] fp32, the
        layer's collapsed hidden [T, hidden]) for every row."""
        streams = self._streams(input_ids, hidden)
        rope = self.runtime.rope_tables(positions, streams.dtype)
        streams = self.runtime.decoder_layer(0, self.layer.layer, streams, input_ids, rope, positions=positions,
                                             seqs=seqs)
        return self.runtime.head(self.layer.hc_head, self.layer.norm.weight, streams, None, True, True)

    @torch.no_grad()
    def decode(self, input_ids, hidden: torch.Tensor, seqs: list[SeqStep]):
        """input_ids: the B * s_q token ids on the host, hidden [B * s_q, hidden] on the device. Returns
        (logits [B * s_q, vocab] fp32, the layer's collapsed hidden [B * s_q, hidden])."""
        runtime = self.runtime
        inputs = build_decode_inputs(runtime, seqs, input_ids)
        meta = runtime.decode_metadata(inputs.host.to(runtime.device), inputs)
        rows = inputs.batch * meta.s_q
        hidden = F.pad(hidden, (0, 0, 0, meta.batch * meta.s_q - rows))  # the padding rows read nothing
        streams = self._streams(meta.input_ids, hidden)
        rope = runtime.rope_tables(meta.positions, streams.dtype)
        streams = runtime.decoder_layer(0, self.layer.layer, streams, meta.input_ids, rope, meta=meta)
        logits, collapsed = runtime.head(self.layer.hc_head, self.layer.norm.weight, streams, None, True, True)
        return logits[:rows], collapsed[:rows]
