"""DeepSeek-V4's compressors and lightning indexer on the engine's device state rows.

A compressor turns every `ratio` source tokens (a window) into one compressed entry: the window's kv
rows weighted by a softmax over their gates plus a learned position bias, RMSNorm, RoPE at the
window's first position. The overlapping ratio-4 compressors (the compressed-sparse layers' compressor
and indexer) produce 2 * head_dim per token, two series: entry w pools window w - 1's first series
with window w's second one (2 * ratio rows; before window 0 there is none: kv 0, gate -inf, weight 0).
Semantics as transformers' DeepseekV4HCACompressor / DeepseekV4CSACompressor / DeepseekV4Indexer with
their caches. The state between calls (engine.kv_store.CompressorRows, one row per request): the open
window's tokens at slot position % ratio and the previous complete window's first series.

Two formulations, one per kind of step, with the same arithmetic per entry (pool: the same tensors
through the same ops, so a decode step's entries equal prefill's in float32 on the same inputs up to
the summation order the backend picks for each batch shape: 1 ulp on one CPU; tests/test_decode_graphs.py
checks it):
  prefill       one request's whole prompt at once, from an empty state: every complete window pooled;
                the open window's tokens and the last complete window's first series are left in its row;
  decode_token  one token per request of a batch, static shapes (a CUDA graph captures it): each token
                is stored at its slot, EVERY row is pooled (the caller writes the entry only where the
                token closes its window: write slot -1 elsewhere) and the overlap advances where a window
                closed. replay_token is the same without the pooling (a rollback re-applies kept tokens).

The lightning indexer scores each query against the request's indexer keys (index_scores, the shapes
transformers contracts) and keeps the top index_topk visible ones. Prefill takes transformers' call
(one torch.topk over each token's row with the future keys masked, so ties break as there); decode
keeps, over a row padded to a static width, the highest scores with exact ties broken by entry order
(lowest first: a stable sort), which does not depend on the row's width or on the batch (transformers'
decode calls torch.topk on a row of exactly the visible keys, whose tie order is the implementation's;
it matters only where more than index_topk entries are visible and the k-th score ties, as ReLU's
zeros do).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.kernel_source import op
from engine.kv_store import CompressorRows

CosSin = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # positions [n] -> (cos, sin) [n, r/2]


def pool(window_kv: torch.Tensor, window_gate: torch.Tensor) -> torch.Tensor:
    """window_kv, window_gate (position bias added) [n, m, d] -> [n, d]: kv weighted by the softmax of the
    gates over the m rows (fp32 softmax, cast back), summed."""
    return (window_kv * window_gate.softmax(dim=1, dtype=torch.float32).to(window_kv.dtype)).sum(dim=1)


def _entries(pooled: torch.Tensor, first_positions: torch.Tensor, norm_weight: torch.Tensor, eps: float,
             cos_sin: CosSin) -> torch.Tensor:
    """Pooled windows [n, d] -> entries: RMSNorm, RoPE at each window's first position."""
    cos, sin = cos_sin(first_positions)
    return op("rope")(op("rms_norm")(pooled, norm_weight, eps), cos, sin)


def prefill(rows: CompressorRows, row: int, kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor,
            norm_weight: torch.Tensor, eps: float, cos_sin: CosSin) -> torch.Tensor:
    """A request's prompt (kv, gate [L, width] of its tokens 0 .. L - 1) from an empty state: returns its
    L // ratio entries [n, head_dim] and leaves state row `row` as after those tokens."""
    ratio, d = rows.ratio, rows.head_dim
    n = kv.size(0) // ratio
    usable = n * ratio
    rest = kv.size(0) - usable
    rows.kv[row, :rest] = kv[usable:]  # the open window's tokens, at slots position % ratio = 0 .. rest - 1
    rows.gate[row, :rest] = gate[usable:]
    if n == 0:
        if rows.overlap:
            rows.overlap_kv[row] = 0
            rows.overlap_gate[row] = float("-inf")
        return kv.new_zeros((0, d))
    chunk_kv = kv[:usable].view(n, ratio, -1)
    chunk_gate = gate[:usable].view(n, ratio, -1) + position_bias
    if rows.overlap:
        window_kv = chunk_kv.new_zeros((n, 2 * ratio, d))
        window_gate = chunk_gate.new_full((n, 2 * ratio, d), float("-inf"))
        window_kv[:, ratio:] = chunk_kv[..., d:]
        window_gate[:, ratio:] = chunk_gate[..., d:]
        window_kv[1:, :ratio] = chunk_kv[:-1, :, :d]
        window_gate[1:, :ratio] = chunk_gate[:-1, :, :d]
        rows.overlap_kv[row] = chunk_kv[-1, :, :d]
        rows.overlap_gate[row] = chunk_gate[-1, :, :d]
    else:
        window_kv, window_gate = chunk_kv, chunk_gate
    first_positions = torch.arange(n, device=kv.device) * ratio
    return _entries(pool(window_kv, window_gate), first_positions, norm_weight, eps, cos_sin)


def _append(rows: CompressorRows, state_rows: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
            gate: torch.Tensor) -> None:
    slot = positions % rows.ratio
    rows.kv[state_rows, slot] = kv
    rows.gate[state_rows, slot] = gate.to(rows.gate.dtype)  # a bf16 model's gates in float32 rows: exact


def _advance_overlap(rows: CompressorRows, state_rows, positions, window_kv, window_gate, previous) -> None:
    """Where the token closed its window, the window's first series becomes the overlap."""
    d = rows.head_dim
    closes = ((positions + 1) % rows.ratio == 0)[:, None, None]
    prev_kv, prev_gate = previous
    rows.overlap_kv[state_rows] = torch.where(closes, window_kv[..., :d], prev_kv)
    rows.overlap_gate[state_rows] = torch.where(closes, window_gate[..., :d], prev_gate)


def decode_token(rows: CompressorRows, state_rows: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                 gate: torch.Tensor, position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 cos_sin: CosSin) -> torch.Tensor:
    """One token per request: request b (state row state_rows[b]) gets kv[b], gate[b] [width] at
    positions[b]. Returns [B, head_dim]: row b is the entry of the window that token closes, when
    (positions[b] + 1) % ratio == 0 (any value otherwise: the caller does not store it). GPU ops only."""
    ratio, d = rows.ratio, rows.head_dim
    _append(rows, state_rows, positions, kv, gate)
    window_kv = rows.kv[state_rows]  # [B, ratio, width]
    window_gate = rows.gate[state_rows] + position_bias
    if rows.overlap:
        previous = rows.overlap_kv[state_rows], rows.overlap_gate[state_rows]
        pooled = pool(torch.cat([previous[0], window_kv[..., d:]], dim=1),
                      torch.cat([previous[1], window_gate[..., d:]], dim=1))
        _advance_overlap(rows, state_rows, positions, window_kv, window_gate, previous)
    else:
        pooled = pool(window_kv, window_gate)
    return _entries(pooled, positions + 1 - ratio, norm_weight, eps, cos_sin)


def replay_token(rows: CompressorRows, state_rows: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                 gate: torch.Tensor, position_bias: torch.Tensor) -> None:
    """decode_token's state update without its entry (the entry was already stored)."""
    _append(rows, state_rows, positions, kv, gate)
    if rows.overlap:
        window_kv = rows.kv[state_rows]
        window_gate = rows.gate[state_rows] + position_bias
        previous = rows.overlap_kv[state_rows], rows.overlap_gate[state_rows]
        _advance_overlap(rows, state_rows, positions, window_kv, window_gate, previous)


def index_scores(scorer, q: torch.Tensor, keys_t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The lightning indexer's scores sum_h w_h * ReLU(q_h . k) * scale: q [..., S, H, d] (RoPE applied),
    keys_t [..., 1, d, T], x [..., S, hidden] (the weights' input) -> [..., S, T] fp32, contracted in
    transformers' shapes ([.., S, H, d] @ [.., 1, d, T], the heads summed last)."""
    scores = torch.relu(torch.matmul(q.float(), keys_t.float())) * scorer.softmax_scale
    weights = scorer.weights_proj(x).float() * scorer.weights_scaling
    return (scores * weights.unsqueeze(-1)).sum(dim=-2)


def decode_top_k(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """scores [B, s_q, E] of E entry ids, visible [B, s_q] (entries e < visible are complete for the
    query) -> [B, s_q, k] entry ids, highest score first, exact ties lowest id first, -1 where fewer
    than k are visible. GPU ops only."""
    ids = torch.arange(scores.size(-1), device=scores.device)
    masked = scores.masked_fill(ids >= visible[..., None], float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.where(masked.gather(-1, order) == float("-inf"), -1, order)
