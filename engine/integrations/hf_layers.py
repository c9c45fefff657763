"""transformers' DeepseekV4ForCausalLM on this project's kernels: the layers of the kernel repository.

The kernel repository's package is a copy of `engine/` under another name whose `layers` module
re-exports this module's classes, so every import here is relative. The classes follow the
`kernels` library's layer rules: a kernel layer (`Name`) is an nn.Module without `__init__` or
members of its own whose stateless `forward` replaces the forward of a module of the model
(kernelize binds it to that module); where it needs parameters in another layout than transformers
keeps them, a companion `NameLayout(nn.Module)` holds them and carries a reference `forward` in
plain torch (what the module computes when it is not kernelized) and the `conversion_mapping`
from checkpoint keys to its parameters.

Layers (transformers 5.21.1, kernels 0.17.2):
- DeepseekV4SparseAttention replaces `DeepseekV4Attention.forward`. transformers' attention is dense
  and masked (every window row and every compressed entry, the indexer's top-k scattered into a
  0/-inf bias); this one gathers what each query attends -- its sliding window (valid entries from
  the model's eager mask, or by position when there is none), the indexer's top-k compressed
  entries (CSA layers) or every causally complete compressed entry (HCA layers) -- and calls the
  sparse MLA kernel on those rows only. The caches stay transformers' (the sliding window layer
  and the compressors' buffers, overlap and entries, through their own methods).
- RMSNormScale / RMSNormScaleLayout replace `DeepseekV4RMSNorm` (class key `^DeepseekV4RMSNorm$`):
  the weight is held as `scale`; the kernel is the project's Triton RMSNorm (engine.ops).
- HyperConnectionNorm / HyperConnectionNormLayout fuse a decoder layer's `attn_hc` and
  `input_layernorm` (fusion key on `model.layers.*.attn_hc` + `model.layers.*.input_layernorm`):
  the layout takes the hyper-connection's parameters under their own names and the norm as its
  submodule `norm`, and returns the normed collapsed stream; the kernel runs the hyper-connection's
  weightless RMSNorm on the project's Triton RMSNorm and its weights, Sinkhorn iterations and
  collapse as engine.ops.hyper_connection (one Triton launch).

Numerics: the layers compute transformers' math in the same order and dtypes; only the attention
kernel (fp32 accumulation, base-2 softmax), the Triton RMSNorm and the hyper-connection kernel (fp32,
their own reduction orders) differ from eager in rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# before transformers: without CUDA, the package sets TRITON_INTERPRET=1, which only takes effect
# if nothing has imported triton yet
from .. import ops
from ..h20_ops import sparse_mla_prefill

from transformers.core_model_loading import WeightRenaming  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb  # noqa: E402

# ----------------------------------------------------------------------------------------------
# sparse attention


def sparse_attention(q: torch.Tensor, rows: torch.Tensor, entries: torch.Tensor, scaling: float,
                     sinks: torch.Tensor) -> torch.Tensor:
    """The one call of the sparse MLA kernel. q [B, S, H, D]; rows [B, N, D], the K = V rows of each
    batch entry; entries [B, S, K] (any integer dtype), row numbers within the same batch entry, -1
    for none; sinks [H]. Returns out [B, S, H, D] in q's dtype (K = V, d_v = D, each head's sink in
    the softmax's denominator)."""
    b, s, h, d = q.shape
    n = rows.shape[1]
    offsets = (torch.arange(b, device=entries.device) * n).view(b, 1, 1)
    flat = torch.where(entries >= 0, entries + offsets, -1).to(torch.int32).reshape(b * s, -1)
    result = sparse_mla_prefill(q.reshape(b * s, h, d), rows.reshape(b * n, 1, d), flat, scaling, d_v=d,
                                attn_sink=sinks.float())
    return result.out.view(b, s, h, d)


def window_entries(attention_mask: torch.Tensor | None, n_rows: int, seq_len: int, window: int,
                   device: torch.device) -> torch.Tensor:
    """[B or 1, S, window] window rows per query, -1 for none. The window rows are the cached rows
    then this call's S rows (n_rows in all); query i is row n_rows - S + i and attends the `window`
    rows ending at itself. With a mask ([B, 1, S, >= n_rows], 0 where attended, transformers' eager
    mask) a row counts only where the mask is 0 (padding, and the mask's own window)."""
    first = n_rows - seq_len - window + 1
    rows = (torch.arange(seq_len, device=device)[:, None] + first
            + torch.arange(window, device=device)[None, :]).unsqueeze(0)  # [1, S, window]
    valid = rows >= 0
    if attention_mask is not None:
        mask = attention_mask[:, 0, :, :n_rows]
        gathered = mask.gather(-1, rows.clamp(min=0).expand(mask.shape[0], -1, -1))
        valid = valid & (gathered == 0)
    return torch.where(valid, rows, -1)


def compressed_entries(compressor: nn.Module, hidden_states: torch.Tensor, past_key_values, layer_idx: int,
                       overlapping: bool) -> torch.Tensor:
    """The compressor's entries so far [B, T, D] (transformers' CSA / HCA compressors, without the
    indexer and the dense block bias): every `compress_rate` source tokens pool into one entry, a
    softmax over the window's gates (plus `position_bias`) weighting the projected rows, then
    `kv_norm` and RoPE at the window's first position. With `overlapping` (CSA) the projections are
    two series of width D: an entry pools its own window's second series and the previous window's
    first series (2 * compress_rate slots; before the first window, weight 0). Tokens that do not
    complete a window wait in the cache's buffer; without a cache they are dropped."""
    cache_layer = past_key_values.layers[layer_idx] if past_key_values is not None else None
    kv = compressor.kv_proj(hidden_states)
    gate = compressor.gate_proj(hidden_states)
    rate = compressor.compress_rate
    if cache_layer is None:
        usable = kv.shape[1] // rate * rate
        kv, gate, start = kv[:, :usable], gate[:, :usable], 0
    else:
        kv, gate, start = cache_layer.store_compression_weights("compressor", kv, gate)
    batch, n_windows = kv.shape[0], kv.shape[1] // rate
    d = compressor.head_dim
    if n_windows == 0:
        pooled = kv.new_zeros((batch, 0, d))
    else:
        kv = kv.view(batch, n_windows, rate, -1)
        gate = gate.view(batch, n_windows, rate, -1) + compressor.position_bias
        if overlapping:
            prior_kv, prior_gate = (None, None) if cache_layer is None else \
                cache_layer.update_overlap_state("compressor", kv, gate, d)
            if prior_kv is None:
                prior_kv = kv.new_zeros((batch, rate, d))
                prior_gate = gate.new_full((batch, rate, d), float("-inf"))
            lead_kv = torch.cat([prior_kv.to(kv.dtype).unsqueeze(1), kv[:, :-1, :, :d]], dim=1)
            lead_gate = torch.cat([prior_gate.to(gate.dtype).unsqueeze(1), gate[:, :-1, :, :d]], dim=1)
            kv = torch.cat([lead_kv, kv[..., d:]], dim=2)
            gate = torch.cat([lead_gate, gate[..., d:]], dim=2)
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        pooled = compressor.kv_norm((kv * weights).sum(dim=2))
        positions = (torch.arange(n_windows, device=pooled.device) * rate + start).unsqueeze(0).expand(batch, -1)
        cos, sin = compressor.rotary_emb(pooled, position_ids=positions, layer_type=compressor.rope_layer_type)
        pooled = apply_rotary_pos_emb(pooled.unsqueeze(1), cos, sin).squeeze(1)
    return pooled if cache_layer is None else cache_layer.update_compressor_states("compressor", pooled)


def sparse_attention_forward(attn: nn.Module, hidden_states: torch.Tensor, position_embeddings,
                             position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                             past_key_values) -> tuple[torch.Tensor, None]:
    """DeepseekV4Attention's forward with the attention on the sparse kernel (see the module doc)."""
    batch, seq_len, _ = hidden_states.shape
    cos, sin = position_embeddings[attn.rope_layer_type]
    q_residual = attn.q_a_norm(attn.q_a_proj(hidden_states))
    q = attn.q_b_proj(q_residual).view(batch, seq_len, -1, attn.head_dim).transpose(1, 2)
    q = apply_rotary_pos_emb(attn.q_b_norm(q), cos, sin)  # [B, H, S, D]
    kv = attn.kv_norm(attn.kv_proj(hidden_states)).view(batch, seq_len, 1, attn.head_dim).transpose(1, 2)
    kv = apply_rotary_pos_emb(kv, cos, sin)  # [B, 1, S, D]
    if past_key_values is not None:
        kv = past_key_values.update(kv, kv, attn.layer_idx)[0]  # the cached window rows, then these
    rows = kv[:, 0]
    n_window_rows = rows.shape[1]
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    entries = [window_entries(mask, n_window_rows, seq_len, attn.sliding_window, rows.device).expand(batch, -1, -1)]
    if attn.compressor is not None:
        csa = attn.layer_type == "compressed_sparse_attention"
        compressed = compressed_entries(attn.compressor, hidden_states, past_key_values, attn.layer_idx, csa)
        if csa:
            picks = attn.compressor.indexer(hidden_states, q_residual, position_ids, past_key_values, attn.layer_idx)
        else:  # HCA attends every entry whose window the query has completed
            complete = (position_ids + 1) // attn.compressor.compress_rate  # [B, S]
            picks = torch.arange(compressed.shape[1], device=rows.device).view(1, 1, -1).expand(batch, seq_len, -1)
            picks = torch.where(picks < complete.unsqueeze(-1), picks, -1)
        entries.append(torch.where(picks >= 0, picks + n_window_rows, -1))
        rows = torch.cat([rows, compressed.to(rows.dtype)], dim=1)
    out = sparse_attention(q.transpose(1, 2), rows, torch.cat(entries, dim=-1), attn.scaling, attn.sinks)
    # V = K carries RoPE on its trailing dims: rotate the output back at the query's position
    out = apply_rotary_pos_emb(out.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = attn.o_a_proj(out.reshape(batch, seq_len, attn.config.o_groups, -1)).flatten(2)
    return attn.o_b_proj(grouped), None


class DeepseekV4SparseAttention(nn.Module):
    """Kernel layer for transformers' DeepseekV4Attention (kernelize binds `forward` to each one)."""

    has_backward = False

    def forward(self, hidden_states, position_embeddings, position_ids, attention_mask, past_key_values=None,
                **kwargs):
        return sparse_attention_forward(self, hidden_states, position_embeddings, position_ids, attention_mask,
                                        past_key_values)


# ----------------------------------------------------------------------------------------------
# RMSNorm with its weight held as `scale`


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek-V4's weighted RMSNorm: fp32 statistics, the product with the weight in fp32, one cast."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


class RMSNormScaleLayout(nn.Module):
    """DeepseekV4RMSNorm (same constructor) with the weight held as `scale`."""

    # transformers' DeepSeek-V4 renames `.norm.` to `.kv_norm.` before these run, which also turns
    # the final norm's `model.norm.weight` into `model.kv_norm.weight`: that key is mapped first.
    # Both renames are idempotent (a second load registers them again) and reverse on save.
    conversion_mapping = [
        WeightRenaming(source_patterns=r"^model\.kv_norm\.weight", target_patterns="model.norm.scale"),
        WeightRenaming(source_patterns=r"norm\.weight", target_patterns="norm.scale"),
    ]

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _rms_norm_reference(hidden_states, self.scale, self.variance_epsilon)


class RMSNormScale(nn.Module):
    """Kernel layer for RMSNormScaleLayout: the project's Triton RMSNorm."""

    has_backward = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(hidden_states, self.scale, self.variance_epsilon)


# ----------------------------------------------------------------------------------------------
# attn_hc + input_layernorm


def _hyper_connection_norm(module: nn.Module, hidden_streams: torch.Tensor, input_norm, hyper_connection):
    """(post, comb, module.norm(collapsed)) of a HyperConnectionNorm(Layout) on the streams [B, S, hc, D]:
    input_norm the weightless RMSNorm of the flattened streams [B * S, hc * D] (fp32), hyper_connection
    ops.hyper_connection's signature (the op, or its ref: transformers' torch code)."""
    batch, seq_len, hc, dim = hidden_streams.shape
    streams = hidden_streams.reshape(batch * seq_len, hc, dim)
    normed = input_norm(streams.reshape(batch * seq_len, hc * dim).float())
    post, comb, collapsed = hyper_connection(streams, F.linear(normed, module.fn.float()), module.scale, module.base,
                                             module.hc_eps, module.hc_sinkhorn_iters)
    return (post.view(batch, seq_len, hc), comb.view(batch, seq_len, hc, hc),
            module.norm(collapsed.view(batch, seq_len, dim)))


class HyperConnectionNormLayout(nn.Module):
    """A decoder layer's `attn_hc` (DeepseekV4HyperConnection) fused with its `input_layernorm`,
    built from the two modules: returns (post, comb, input_layernorm(collapsed)); the decoder layer's
    `input_layernorm` becomes an identity. The hyper-connection's parameters keep their names (`fn`,
    `base`, `scale`: the same keys), its weightless norm stays the submodule `input_norm` (no
    parameters) and the layer norm becomes the submodule `norm` (renamed keys)."""

    conversion_mapping = [
        WeightRenaming(source_patterns=r"\.input_layernorm\.", target_patterns=".attn_hc.norm."),
    ]

    def __init__(self, attn_hc: nn.Module, input_layernorm: nn.Module):
        super().__init__()
        self.hc_mult = attn_hc.hc_mult
        self.hc_sinkhorn_iters = attn_hc.hc_sinkhorn_iters
        self.hc_eps = attn_hc.hc_eps
        self.input_norm = attn_hc.input_norm
        self.fn = attn_hc.fn
        self.base = attn_hc.base
        self.scale = attn_hc.scale
        self.norm = input_layernorm

    def forward(self, hidden_streams: torch.Tensor):
        return _hyper_connection_norm(self, hidden_streams, self.input_norm, ops._hyper_connection_ref)


class HyperConnectionNorm(nn.Module):
    """Kernel layer for HyperConnectionNormLayout: the hyper-connection's weightless RMSNorm on the
    project's Triton RMSNorm, the rest of it on ops.hyper_connection (the `norm` submodule runs its own
    forward, kernelized or not)."""

    has_backward = False

    def forward(self, hidden_streams: torch.Tensor):
        return _hyper_connection_norm(self, hidden_streams, lambda x: ops.rms_norm(x, None, self.input_norm.eps),
                                      ops.hyper_connection)


__all__ = [
    "DeepseekV4SparseAttention",
    "HyperConnectionNorm",
    "HyperConnectionNormLayout",
    "RMSNormScale",
    "RMSNormScaleLayout",
]
