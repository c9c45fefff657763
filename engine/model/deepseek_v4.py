"""DeepSeek-V4 forward for the engine: packed prefill and batched decode over the engine's KV state.

Weights and the non-attention blocks come from transformers' DeepseekV4ForCausalLM (loaded from
the HF-format checkpoint): embeddings, MoE (hash-routed and top-k), projections, head. Everything
that is attention or state is the engine's own:
  - norms and RoPE through engine.ops (DEEPINFER_KERNELS picks Triton or torch);
  - K=V rows, compressed entries and indexer keys in the paged stores of engine.kv_cache;
  - compressors (ratio 4 with overlapping windows + lightning indexer, ratio 128) step by step
    with per-request state, as transformers' DeepseekV4CSACache / HCACache define them;
  - attention ONLY through engine.h20_ops.attn_sm90: prefill_attn_varlen_sparse over the packed
    batch, decode_attn_sparse with the sliding window as main cache and compressed entries as the
    extra cache, sinks passed in; inverse RoPE on the output, then the grouped output projection.

Sequence rules (transformers' eager model is the oracle): a query at position p sees window
positions p - W + 1 .. p (W = sliding_window, itself included) and the compressed entries
w < (p + 1) // ratio; a ratio-4 layer attends only to the indexer's top-k among those.
Prefill always starts at position 0 (no chunked prefill, no prefix reuse).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import ops
from engine.h20_ops.attn_sm90 import decode_attn_sparse, prefill_attn_varlen_sparse
from engine.kv_cache import PagedRows, RequestState

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
INDEX_PAD = 64  # prefill index lists are padded with -1 to a multiple of the kernels' top-k block


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
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seqs: list[SeqStep], *, prefill: bool):
        """input_ids, positions [T]; returns logits [len(seqs), vocab] fp32 of each sequence's last token."""
        cfg = self.config
        embeds = self.model.embed_tokens(input_ids)  # [T, hidden]
        dtype = embeds.dtype
        rope = {kind: self._cos_sin(positions, kind, dtype) for kind in ("main", "compress")}
        hidden = embeds.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()  # [T, hc, hidden]
        for layer_idx, layer in enumerate(self.model.layers):
            post, comb, collapsed = self._hyper_connection(layer.attn_hc, hidden)
            x = ops.rms_norm(collapsed, layer.input_layernorm.weight, self.eps)
            attn_out = self._attention(layer_idx, layer.self_attn, x, positions, seqs, rope, prefill)
            hidden = post.to(dtype).unsqueeze(-1) * attn_out.unsqueeze(-2) + torch.matmul(
                comb.to(dtype).transpose(-1, -2), hidden)
            post, comb, collapsed = self._hyper_connection(layer.ffn_hc, hidden)
            x = ops.rms_norm(collapsed, layer.post_attention_layernorm.weight, self.eps)
            mlp_out = layer.mlp(x[None], input_ids=input_ids[None])[0]
            hidden = post.to(dtype).unsqueeze(-1) * mlp_out.unsqueeze(-2) + torch.matmul(
                comb.to(dtype).transpose(-1, -2), hidden)
        last = torch.tensor([s.offset + s.length - 1 for s in seqs], device=hidden.device)
        final = self._hyper_head(self.model.hc_head, hidden[last])
        final = ops.rms_norm(final, self.model.norm.weight, self.eps)
        return self.hf.lm_head(final).float()

    def _hyper_connection(self, hc, hidden: torch.Tensor):
        """transformers' DeepseekV4HyperConnection on [T, hc, hidden] with its norm through engine.ops."""
        n = hc.hc_mult
        flat = ops.rms_norm(hidden.reshape(hidden.size(0), -1).float(), None, self.eps)
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
        flat = ops.rms_norm(hidden.flatten(1).float(), None, self.eps)
        mixes = F.linear(flat, head.hc_fn.float())
        pre = torch.sigmoid(mixes * head.hc_scale.float() + head.hc_base.float()) + head.eps
        return (pre.unsqueeze(-1) * hidden).sum(dim=1).to(hidden.dtype)

    # -- attention ------------------------------------------------------------------------
    def _attention(self, layer_idx, attn, x, positions, seqs, rope, prefill):
        total = x.size(0)
        cos, sin = rope[attn.rope_layer_type]
        q_residual = ops.rms_norm(attn.q_a_proj(x), attn.q_a_norm.weight, self.eps)
        q = attn.q_b_proj(q_residual).view(total, self.heads, self.head_dim)
        q = ops.rope(ops.rms_norm(q, None, self.eps), cos, sin)
        kv = ops.rope(ops.rms_norm(attn.kv_proj(x), attn.kv_norm.weight, self.eps), cos, sin)  # [T, D]

        window = self.stores.window
        for s in seqs:  # keep the rows the next decode steps need: the last W - 1 (+ this one)
            keep = min(s.length, self.window)
            first = s.start + s.length - keep
            window.write(layer_idx, s.state.rid, first, kv[s.offset + s.length - keep: s.offset + s.length])

        entries = selections = None
        if attn.layer_type != SLIDING:
            entries, selections = self._compress(layer_idx, attn, x, q_residual, positions, seqs, prefill)

        if prefill:
            out = self._prefill_attention(layer_idx, attn, q, kv, seqs, entries, selections)
        else:
            out = self._decode_attention(layer_idx, attn, q, seqs, selections)
        out = ops.rope(out, cos, sin, inverse=True)
        grouped = attn.o_a_proj(out.reshape(total, self.config.o_groups, -1)).flatten(1)
        return attn.o_b_proj(grouped)

    def _compressed_store(self, layer_type: str) -> PagedRows:
        return self.stores.csa if layer_type == CSA else self.stores.hca

    def _compress(self, layer_idx, attn, x, q_residual, positions, seqs, prefill):
        """Advance the layer's compressor (and indexer) by this step's tokens; store new entries.

        Returns (entries, selections): per sequence, all its compressed entries so far [n_e, D]
        (prefill only, None in decode) and the entries each new token attends to, [length, k]
        entry ids with -1 for none (HCA: every complete entry; CSA: the indexer's top-k)."""
        comp = attn.compressor
        kind = attn.layer_type
        ratio = self.ratio[kind]
        store = self._compressed_store(kind)
        slot = self.store_slot[layer_idx]
        kv_all, gate_all = comp.kv_proj(x), comp.gate_proj(x)
        entries, selections = [], []
        for s in seqs:
            rows = slice(s.offset, s.offset + s.length)
            state = s.state.compressor(layer_idx, "compressor")
            first_entry = state.entries
            new = self._pool(state, kv_all[rows], gate_all[rows], comp.position_bias, comp.kv_norm.weight,
                             ratio, self.head_dim, overlap=kind == CSA)
            store.write(slot, s.state.rid, first_entry, new)
            n_entries = state.entries
            visible = (positions[rows] + 1) // ratio  # entries w < visible[t] are complete for token t
            if kind == CSA:
                chosen = self._index(layer_idx, comp.indexer, x[rows], q_residual[rows], positions[rows], s,
                                     visible)
            else:
                ids = torch.arange(n_entries, device=x.device)[None, :]
                chosen = torch.where(ids < visible[:, None], ids, -1)
            selections.append(chosen)
            if prefill:  # the workspace needs every entry as stored (fp8: the quantization round trip)
                if first_entry != 0:
                    raise ValueError(f"request {s.state.rid!r}: prefill must start from an empty compressor")
                entries.append(store.roundtrip(new))
        return (entries if prefill else None), selections

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
        pooled = ops.rms_norm(pooled, norm_weight, self.eps)
        window_positions = torch.arange(n_win, device=kv.device) * ratio + first_position
        cos, sin = self._cos_sin(window_positions, "compress", pooled.dtype)
        state.entries += n_win
        return ops.rope(pooled, cos, sin)

    def _index(self, layer_idx, indexer, x, q_residual, positions, s: SeqStep, visible):
        """Lightning indexer for one sequence's new tokens: pool its keys, score every stored key,
        keep the top-k complete entries per token: [length, k] entry ids, -1 where none."""
        state = s.state.compressor(layer_idx, "indexer")
        first_entry = state.entries
        new_keys = self._pool(state, indexer.kv_proj(x), indexer.gate_proj(x), indexer.position_bias,
                              indexer.kv_norm.weight, indexer.compress_rate, indexer.head_dim, overlap=True)
        store = self.stores.indexer
        slot = self.store_slot[layer_idx]
        store.write(slot, s.state.rid, first_entry, new_keys)
        n_keys = state.entries
        if n_keys == 0:
            return torch.zeros((x.size(0), 0), dtype=torch.long, device=x.device)
        keys = store.read(slot, store.slots(s.state.rid, torch.arange(n_keys)))  # [n_keys, index_head_dim]
        cos, sin = self._cos_sin(positions, "compress", x.dtype)
        q = indexer.q_b_proj(q_residual).view(x.size(0), indexer.num_heads, indexer.head_dim)
        q = ops.rope(q, cos, sin)
        scorer = indexer.scorer
        # Same contraction shapes as the reference ([1, S, H, d] @ [1, 1, d, T]) so ties break alike.
        scores = torch.matmul(q[None].float(), keys.t().float()[None, None])
        scores = F.relu(scores) * scorer.softmax_scale
        weights = scorer.weights_proj(x).float()[None] * scorer.weights_scaling
        index_scores = (scores * weights.unsqueeze(-1)).sum(dim=2)[0]  # [S, n_keys]
        future = torch.arange(n_keys, device=x.device)[None, :] >= visible[:, None]
        index_scores = index_scores.masked_fill(future, float("-inf"))
        top = index_scores.topk(min(indexer.index_topk, n_keys), dim=-1).indices
        return torch.where(top < visible[:, None], top, -1)  # picks among -inf scores are not entries

    def _prefill_attention(self, layer_idx, attn, q, kv, seqs, entries, selections):
        """One packed workspace [sum over sequences of (prompt rows + entry rows), 1, D] and one
        index list per token: its window rows, then its selected entry rows, -1 elsewhere."""
        window = self.stores.window
        parts, lists = [], []
        base = 0
        for i, s in enumerate(seqs):
            if s.start != 0:
                raise ValueError(f"seqs[{i}]: prefill must start at position 0, got {s.start}")
            rows = window.roundtrip(kv[s.offset: s.offset + s.length])
            parts.append(rows)
            t = torch.arange(s.length, device=q.device)
            back = torch.arange(self.window - 1, -1, -1, device=q.device)  # distance from the token
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
        width = max(l.size(1) for l in lists)
        width = -(-width // INDEX_PAD) * INDEX_PAD
        index = torch.full((q.size(0), width), -1, dtype=torch.int32, device=q.device)
        for s, l in zip(seqs, lists):
            index[s.offset: s.offset + s.length, : l.size(1)] = l.to(torch.int32)
        workspace = torch.cat(parts).to(q.dtype).unsqueeze(1)
        return prefill_attn_varlen_sparse(q, workspace, index, attn.scaling, attn_sink=attn.sinks.detach())

    def _decode_attention(self, layer_idx, attn, q, seqs, selections):
        """One decode buffer [B, W + E, 1, D]: window rows first (the adapter views the buffer as
        one kv tensor, no copy), then the compressed entries each token attends to."""
        device = q.device
        batch = len(seqs)
        window = self.stores.window
        e_width = max(sel.size(1) for sel in selections) if selections else 0
        buf = torch.empty((batch, self.window + e_width, 1, self.head_dim), dtype=q.dtype, device=device)
        window_slots = torch.full((batch, self.window), -1, dtype=torch.long)
        lengths = []
        for b, s in enumerate(seqs):
            p = s.start
            n = min(p + 1, self.window)
            window_slots[b, :n] = window.slots(s.state.rid, torch.arange(p - n + 1, p + 1))
            lengths.append(n)
        window.gather(layer_idx, window_slots.to(device), buf[:, : self.window])
        indices = torch.arange(self.window, dtype=torch.int32, device=device).expand(batch, 1, -1).contiguous()
        topk_length = torch.tensor(lengths, dtype=torch.int32, device=device)
        extra = {}
        if e_width > 0:
            store = self._compressed_store(attn.layer_type)
            slot = self.store_slot[layer_idx]
            chosen = torch.full((batch, e_width), -1, dtype=torch.long)
            for b, sel in enumerate(selections):
                chosen[b, : sel.size(1)] = sel[0].cpu()
            entry_slots = torch.full((batch, e_width), -1, dtype=torch.long)
            for b, s in enumerate(seqs):
                valid = chosen[b] >= 0
                entry_slots[b, valid] = store.slots(s.state.rid, chosen[b, valid])
            store.gather(slot, entry_slots.to(device), buf[:, self.window:])
            # Buffer row j of request b holds its j-th choice; unchosen positions are -1 (invalid).
            columns = torch.arange(e_width, dtype=torch.long).expand(batch, -1)
            extra = dict(
                extra_kv_windows=buf[:, self.window:],
                extra_indices=torch.where(chosen >= 0, columns, -1).to(torch.int32).to(device)[:, None, :],
            )
        out, _lse = decode_attn_sparse(q[:, None], buf[:, : self.window], indices, attn.scaling,
                                       attn_sink=attn.sinks.detach(), topk_length=topk_length, **extra)
        return out[:, 0]
