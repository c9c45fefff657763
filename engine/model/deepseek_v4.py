"""DeepSeek-V4 forward for the engine: packed prefill and batched decode over the engine's KV state.

Weights and the non-attention blocks come from transformers' DeepseekV4ForCausalLM (loaded from
the HF-format checkpoint): embeddings, MoE (hash-routed and top-k), projections, head. Everything
that is attention or state is the engine's own, every op through engine.kernel_source.op (this
package's implementation, or a verified kernel repository's under DEEPINFER_KERNEL_SOURCE=hub):
  - norms and RoPE (engine.ops: DEEPINFER_KERNELS picks Triton or torch);
  - K=V rows, compressed entries and indexer keys in the paged stores of engine.kv_store;
  - compressors (ratio 4 with overlapping windows + lightning indexer, ratio 128) step by step
    with per-request state, as transformers' DeepseekV4CSACache / HCACache define them;
  - attention ONLY through engine.h20_ops: sparse_mla_prefill over the packed batch, sparse_mla_decode
    with the sliding-window store as main cache and a compressed store as the extra cache (flat slot
    ids, sinks passed in); inverse RoPE on the output, then the grouped output projection.
Decode metadata (engine.model.decode_metadata) is built once per decode step, before the first layer,
with one host-to-device copy: window slot lists, compressed-entry slot tables, the plans per layer
type; a layer's attention call only runs GPU ops on it.

Sequence rules (transformers' eager model is the oracle): a query at position p sees window
positions p - W + 1 .. p (W = sliding_window, itself included) and the compressed entries
w < (p + 1) // ratio; a ratio-4 layer attends only to the indexer's top-k among those.
Prefill always starts at position 0 (no chunked prefill, no prefix reuse).
Decode takes the same number of new tokens per sequence: 1, or k + 1 when verifying NextN drafts
(sparse_mla_decode with s_q = k + 1); a speculative forward journals the compressor states so that
`rollback` can drop the rejected tail. NextNRuntime runs the NextN (MTP) drafter layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernel_source import op
from engine.kv_store import PagedRows, RequestState
from engine.model.decode_metadata import DecodeMetadata, build_decode_metadata
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


class DeepseekV4Runtime:
    def __init__(self, hf_model, stores: Stores):
        self.hf = hf_model
        self.config = hf_model.config
        self.model = hf_model.model
        self.stores = stores
        cfg = self.config
        self.eps = cfg.rms_norm_eps
        self.window = cfg.sliding_window
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.ratio = {CSA: cfg.compress_rates[CSA], HCA: cfg.compress_rates[HCA]}
        # Per layer type, the slot of the layer in its compressed store.
        self.journal: dict[str, list] | None = None  # speculative step: compressor states to roll back
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

    # -- whole model ----------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seqs: list[SeqStep], *, prefill: bool,
                all_logits: bool = False, all_hidden: bool = False, speculative: bool = False):
        """input_ids, positions [T]. Returns (logits fp32, hidden): logits of each sequence's last
        token [len(seqs), vocab] (all_logits: of every token, [T, vocab]); hidden None, or with
        all_hidden every token's final hidden state [T, hidden] (after the head's hyper-connection
        collapse, before the final norm: what the NextN layer takes).
        speculative: journal the compressor states so that `rollback` can drop trailing tokens."""
        self.journal = {s.state.rid: [] for s in seqs} if speculative else None
        meta = None if prefill else build_decode_metadata(self, seqs)
        hidden = self.model.embed_tokens(input_ids).unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        rope = self.rope_tables(positions, hidden.dtype)
        for layer_idx, layer in enumerate(self.model.layers):
            hidden = self.decoder_layer(layer_idx, layer, hidden, input_ids, positions, seqs, rope, meta)
        return self.head(self.model.hc_head, self.model.norm.weight, hidden, seqs, all_logits, all_hidden)

    def head(self, hc_head, norm_weight, hidden, seqs, all_logits: bool, all_hidden: bool):
        """hidden [T, hc, hidden] -> (logits fp32, collapsed hidden or None) as `forward` returns them,
        through the shared lm_head."""
        if not (all_logits or all_hidden):
            hidden = hidden[torch.tensor([s.offset + s.length - 1 for s in seqs], device=hidden.device)]
        collapsed = self._hyper_head(hc_head, hidden)
        logit_rows = collapsed
        if all_hidden and not all_logits:
            logit_rows = collapsed[torch.tensor([s.offset + s.length - 1 for s in seqs], device=hidden.device)]
        logits = self.hf.lm_head(op("rms_norm")(logit_rows, norm_weight, self.eps)).float()
        return logits, (collapsed if all_hidden else None)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        return {kind: self._cos_sin(positions, kind, dtype) for kind in ("main", "compress")}

    def decoder_layer(self, layer_idx, layer, hidden, input_ids, positions, seqs, rope, meta: DecodeMetadata | None):
        """One DeepSeek-V4 decoder layer on [T, hc, hidden]; layer_idx addresses the KV stores; meta: the
        step's decode metadata (None: a prefill step)."""
        dtype = hidden.dtype
        post, comb, collapsed = self._hyper_connection(layer.attn_hc, hidden)
        x = op("rms_norm")(collapsed, layer.input_layernorm.weight, self.eps)
        attn_out = self._attention(layer_idx, layer.self_attn, x, positions, seqs, rope, meta)
        hidden = post.to(dtype).unsqueeze(-1) * attn_out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), hidden)
        post, comb, collapsed = self._hyper_connection(layer.ffn_hc, hidden)
        x = op("rms_norm")(collapsed, layer.post_attention_layernorm.weight, self.eps)
        mlp_out = layer.mlp(x[None], input_ids=input_ids[None])[0]
        return post.to(dtype).unsqueeze(-1) * mlp_out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), hidden)

    def rollback(self, state: RequestState, keep: int) -> None:
        """After a speculative forward of n tokens, keep only the first `keep`: every compressor of
        the request goes back to its state before the step and consumes just those tokens again
        (entries they complete were already stored, identically); pages holding only dropped
        entries are given back. The window rows are the caller's (PagedRows.truncate)."""
        for comp_state, saved, kv, gate, pool_args, store in self.journal[state.rid]:
            comp_state.restore(saved)
            self._pool(comp_state, kv[:keep], gate[:keep], *pool_args[:-1], overlap=pool_args[-1])
            store.truncate(state.rid, comp_state.entries)

    def _advance(self, s: SeqStep, layer_idx, name, store, slot, kv, gate, position_bias, norm_weight, ratio,
                 head_dim, overlap):
        """Run one compressor of one sequence over its new tokens and store the new entries
        (journaled in a speculative step). Returns (entries before, entries after, new entries)."""
        state = s.state.compressor(layer_idx, name)
        first_entry = state.entries
        if self.journal is not None:
            self.journal[s.state.rid].append((state, state.snapshot(), kv, gate,
                                              (position_bias, norm_weight, ratio, head_dim, overlap), store))
        new = self._pool(state, kv, gate, position_bias, norm_weight, ratio, head_dim, overlap=overlap)
        store.write(slot, s.state.rid, first_entry, new)
        return first_entry, state.entries, new

    def _hyper_connection(self, hc, hidden: torch.Tensor):
        """transformers' DeepseekV4HyperConnection on [T, hc, hidden] with its norm through engine.ops."""
        n = hc.hc_mult
        flat = op("rms_norm")(hidden.reshape(hidden.size(0), -1).float(), None, self.eps)
        mixes = F.linear(flat, hc.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = hc.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = hc.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + hc.hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_scale + comb_b.view(n, n), dim=-1) + hc.hc_eps
        # Sinkhorn-Knopp towards a doubly-stochastic mixing matrix (columns first, as the reference).
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc.hc_eps)
        for _ in range(hc.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + hc.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + hc.hc_eps)
        collapsed = (pre.unsqueeze(-1) * hidden).sum(dim=1).to(hidden.dtype)
        return post, comb, collapsed

    def _hyper_head(self, head, hidden: torch.Tensor) -> torch.Tensor:
        flat = op("rms_norm")(hidden.flatten(1).float(), None, self.eps)
        mixes = F.linear(flat, head.hc_fn.float())
        pre = torch.sigmoid(mixes * head.hc_scale.float() + head.hc_base.float()) + head.eps
        return (pre.unsqueeze(-1) * hidden).sum(dim=1).to(hidden.dtype)

    # -- attention ------------------------------------------------------------------------
    def _attention(self, layer_idx, attn, x, positions, seqs, rope, meta: DecodeMetadata | None):
        total = x.size(0)
        prefill = meta is None
        cos, sin = rope[attn.rope_layer_type]
        q_residual = op("rms_norm")(attn.q_a_proj(x), attn.q_a_norm.weight, self.eps)
        q = attn.q_b_proj(q_residual).view(total, self.heads, self.head_dim)
        q = op("rope")(op("rms_norm")(q, None, self.eps), cos, sin)
        kv = op("rope")(op("rms_norm")(attn.kv_proj(x), attn.kv_norm.weight, self.eps), cos, sin)  # [T, D]

        window = self.stores.window
        if prefill:
            for s in seqs:  # keep the rows the next decode steps need: the last W - 1 (+ this one)
                keep = min(s.length, self.window)
                first = s.start + s.length - keep
                window.write(layer_idx, s.state.rid, first, kv[s.offset + s.length - keep: s.offset + s.length])
        else:
            window.write_at(layer_idx, meta.window_write_slots, kv)

        entries = selections = None
        if attn.layer_type != SLIDING:
            entries, selections = self._compress(layer_idx, attn, x, q_residual, positions, seqs, meta)

        if prefill:
            out = self._prefill_attention(layer_idx, attn, q, kv, seqs, entries, selections)
        else:
            out = self._decode_attention(layer_idx, attn, q, meta, selections)
        out = op("rope")(out, cos, sin, inverse=True)
        grouped = attn.o_a_proj(out.reshape(total, self.config.o_groups, -1)).flatten(1)
        return attn.o_b_proj(grouped)

    def _compressed_store(self, layer_type: str) -> PagedRows:
        return self.stores.csa if layer_type == CSA else self.stores.hca

    def _compress(self, layer_idx, attn, x, q_residual, positions, seqs, meta: DecodeMetadata | None):
        """Advance the layer's compressor (and indexer) by this step's tokens; store new entries.

        Returns (entries, selections). Prefill (meta None): per sequence all its compressed entries so far
        [n_e, D] and the entries each token attends to, [length, k] entry ids with -1 for none (HCA: every
        complete entry; CSA: the indexer's top-k). Decode: (None, the indexer's choices [B, s_q,
        meta.csa_topk] entry ids for CSA, None for HCA: the step's metadata lists its entries)."""
        prefill = meta is None
        comp = attn.compressor
        kind = attn.layer_type
        ratio = self.ratio[kind]
        store = self._compressed_store(kind)
        slot = self.store_slot[layer_idx]
        kv_all, gate_all = comp.kv_proj(x), comp.gate_proj(x)
        entries, selections = [], []
        chosen = None
        if not prefill and kind == CSA:
            chosen = torch.full((meta.batch, meta.s_q, meta.csa_topk), -1, dtype=torch.long, device=x.device)
        for b, s in enumerate(seqs):
            rows = slice(s.offset, s.offset + s.length)
            first_entry, n_entries, new = self._advance(
                s, layer_idx, "compressor", store, slot, kv_all[rows], gate_all[rows], comp.position_bias,
                comp.kv_norm.weight, ratio, self.head_dim, overlap=kind == CSA)
            visible = (positions[rows] + 1) // ratio  # entries w < visible[t] are complete for token t
            if kind == CSA:
                top = self._index(layer_idx, comp.indexer, x[rows], q_residual[rows], positions[rows], s, visible,
                                  prefill)
                if prefill:
                    selections.append(top)
                else:
                    chosen[b, :, : top.size(1)] = top
            elif prefill:
                ids = torch.arange(n_entries, device=x.device)[None, :]
                selections.append(torch.where(ids < visible[:, None], ids, -1))
            if prefill:  # the workspace needs every entry as stored (fp8: the quantization round trip)
                if first_entry != 0:
                    raise ValueError(f"request {s.state.rid!r}: prefill must start from an empty compressor")
                entries.append(store.roundtrip(new))
        if prefill:
            return entries, selections
        return None, chosen

    def _pool(self, state, kv, gate, position_bias, norm_weight, ratio, head_dim, *, overlap):
        """transformers' compressor step: buffer tokens until windows of `ratio` close, then pool
        each window (softmax gate + position bias; ratio 4 overlaps the previous window's first
        series), RMSNorm, RoPE at the window's first position. Returns the new entries [n, head_dim]."""
        first_position = state.entries * ratio
        if state.buffer_kv is not None and state.buffer_kv.size(0):
            kv = torch.cat([state.buffer_kv, kv])
            gate = torch.cat([state.buffer_gate, gate])
        usable = (kv.size(0) // ratio) * ratio
        state.buffer_kv, state.buffer_gate = kv[usable:], gate[usable:]
        if usable == 0:
            return kv.new_zeros((0, head_dim))
        n_win = usable // ratio
        chunk_kv = kv[:usable].view(n_win, ratio, -1)
        chunk_gate = gate[:usable].view(n_win, ratio, -1) + position_bias
        if overlap:
            # Entry w pools window w-1's first series (dims :head_dim) with window w's second.
            pooled_kv = chunk_kv.new_zeros((n_win, 2 * ratio, head_dim))
            pooled_gate = chunk_gate.new_full((n_win, 2 * ratio, head_dim), float("-inf"))
            pooled_kv[:, ratio:] = chunk_kv[..., head_dim:]
            pooled_gate[:, ratio:] = chunk_gate[..., head_dim:]
            if n_win > 1:
                pooled_kv[1:, :ratio] = chunk_kv[:-1, :, :head_dim]
                pooled_gate[1:, :ratio] = chunk_gate[:-1, :, :head_dim]
            if state.overlap_kv is not None:
                pooled_kv[0, :ratio] = state.overlap_kv.to(pooled_kv.dtype)
                pooled_gate[0, :ratio] = state.overlap_gate.to(pooled_gate.dtype)
            state.overlap_kv = chunk_kv[-1, :, :head_dim].clone()
            state.overlap_gate = chunk_gate[-1, :, :head_dim].clone()
            chunk_kv, chunk_gate = pooled_kv, pooled_gate
        pooled = (chunk_kv * chunk_gate.softmax(dim=1, dtype=torch.float32).to(chunk_kv.dtype)).sum(dim=1)
        pooled = op("rms_norm")(pooled, norm_weight, self.eps)
        window_positions = torch.arange(n_win, device=kv.device) * ratio + first_position
        cos, sin = self._cos_sin(window_positions, "compress", pooled.dtype)
        state.entries += n_win
        return op("rope")(pooled, cos, sin)

    def _index(self, layer_idx, indexer, x, q_residual, positions, s: SeqStep, visible, prefill: bool):
        """Lightning indexer for one sequence's new tokens: pool its keys, score every stored key,
        keep the top-k complete entries per token: [length, k] entry ids, -1 where none."""
        store = self.stores.indexer
        slot = self.store_slot[layer_idx]
        _, n_keys, _ = self._advance(s, layer_idx, "indexer", store, slot, indexer.kv_proj(x), indexer.gate_proj(x),
                                     indexer.position_bias, indexer.kv_norm.weight, indexer.compress_rate,
                                     indexer.head_dim, overlap=True)
        if n_keys == 0:
            return torch.zeros((x.size(0), 0), dtype=torch.long, device=x.device)
        keys = store.read(slot, store.slots(s.state.rid, torch.arange(n_keys)))  # [n_keys, index_head_dim]
        cos, sin = self._cos_sin(positions, "compress", x.dtype)
        q = indexer.q_b_proj(q_residual).view(x.size(0), indexer.num_heads, indexer.head_dim)
        q = op("rope")(q, cos, sin)
        scorer = indexer.scorer
        # Same contraction shapes as the reference ([1, S, H, d] @ [1, 1, d, T]) so ties break alike.
        scores = torch.matmul(q[None].float(), keys.t().float()[None, None])
        scores = F.relu(scores) * scorer.softmax_scale
        weights = scorer.weights_proj(x).float()[None] * scorer.weights_scaling
        index_scores = (scores * weights.unsqueeze(-1)).sum(dim=2)[0]  # [S, n_keys]
        k = min(indexer.index_topk, n_keys)
        if prefill:  # the reference's prefill: one top-k over all keys, the future ones masked
            future = torch.arange(n_keys, device=x.device)[None, :] >= visible[:, None]
            top = index_scores.masked_fill(future, float("-inf")).topk(k, dim=-1).indices
            return torch.where(top < visible[:, None], top, -1)  # picks among -inf scores are not entries
        # Decode: token t ranks exactly its visible keys, as a one-token step does. ReLU makes exact
        # ties (scores of 0) common, and top-k breaks them differently over a longer row, so a
        # verification step (k + 1 tokens, keys that only its later tokens complete) would otherwise
        # choose other entries than plain decoding.
        top = torch.full((x.size(0), k), -1, dtype=torch.long, device=x.device)
        for t in range(x.size(0)):
            n = (s.start + t + 1) // self.ratio[CSA]  # visible[t], from the host-side position: no sync
            if n:  # a [1, n] row, the very call a one-token step makes
                top[t, : min(k, n)] = index_scores[t:t + 1, :n].topk(min(k, n), dim=-1).indices[0]
        return top

    def _prefill_attention(self, layer_idx, attn, q, kv, seqs, entries, selections):
        """One packed workspace [sum over sequences of (prompt rows + entry rows), 1, D] and one
        index list per token: its window rows, then its selected entry rows, compacted to the front
        with index_length = their count (the kernel walks no further), -1 after."""
        window = self.stores.window
        parts, lists = [], []
        base = 0
        for i, s in enumerate(seqs):
            if s.start != 0:
                raise ValueError(f"seqs[{i}]: prefill must start at position 0, got {s.start}")
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

    def _decode_attention(self, layer_idx, attn, q, meta: DecodeMetadata, selections):
        """The sliding window as main cache, the layer type's compressed store as extra cache, one call.
        GPU ops only: the slot lists come from the step's metadata; a ratio-4 layer maps its indexer's
        choices (entry ids, -1 for none) to slots through the step's entry slot table."""
        layer_type = attn.layer_type
        window = self.stores.window
        extra = {}
        extra_indices = None
        if layer_type == CSA and meta.csa_topk:
            extra_indices = meta.csa_slots(selections)
        elif layer_type == HCA:
            extra_indices = meta.hca_indices
        if extra_indices is not None:
            store = self._compressed_store(layer_type)
            extra = dict(extra_cache=store.cache(self.store_slot[layer_idx]), extra_indices=extra_indices)
        q4 = q.view(meta.batch, meta.s_q, *q.shape[1:])
        res = op("sparse_mla_decode")(q4, window.cache(layer_idx), meta.window_indices, attn.scaling,
                                plan=meta.plans[layer_type], attn_sink=attn.sinks.detach(), **extra)
        return res.out.flatten(0, 1)


class NextNRuntime:
    """Forward of the NextN (MTP) drafter layer (engine.model.nextn) over its own window store:
    row i takes token i + 1 and the hidden state h_i (the main model's, or its own for chained
    drafts), sits at position i, and predicts token i + 2. Window-only: its state is the window
    rows, so dropping speculative rows is PagedRows.truncate alone."""

    def __init__(self, main: DeepseekV4Runtime, layer, window_store: PagedRows):
        self.main = main
        self.layer = layer
        self.runtime = DeepseekV4Runtime(main.hf, Stores(window=window_store, csa=None, hca=None, indexer=None))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, seqs: list[SeqStep],
                *, prefill: bool):
        """input_ids, positions [T], hidden [T, hidden]. Returns (logits [T, vocab] fp32, the layer's
        collapsed hidden [T, hidden]) for every row."""
        eps = self.main.eps
        layer = self.layer
        embeds = op("rms_norm")(self.main.model.embed_tokens(input_ids), layer.enorm.weight, eps)
        x = layer.eh_proj(torch.cat([embeds, op("rms_norm")(hidden, layer.hnorm.weight, eps)], dim=-1))
        streams = x.unsqueeze(1).expand(-1, self.main.config.hc_mult, -1).contiguous()
        rope = self.runtime.rope_tables(positions, x.dtype)
        meta = None if prefill else build_decode_metadata(self.runtime, seqs)
        streams = self.runtime.decoder_layer(0, layer.layer, streams, input_ids, positions, seqs, rope, meta)
        return self.runtime.head(layer.hc_head, layer.norm.weight, streams, seqs, True, True)
