"""The float32 reference (oracle) for sparse MLA: every backend and adapter is tested against it.

Semantics (docs/contract.md; FlashMLA's current contract):
  - entry j of row i is valid iff 0 <= idx[i, j] < s_kv and (if given) j < topk_length[i];
    invalid entries are masked and never dereferenced; duplicates count once per occurrence;
  - P = q_i . kv[idx]^T * sm_scale (fp32), invalid -> -inf; lse = logsumexp(P) (natural log);
    max_logits = max(P); out = softmax(P) @ kv[idx, :d_v];
  - sink s [h_q]: out *= 1 / (1 + exp(s - lse)); it never changes lse or max_logits;
  - a row with no valid entry: out = 0, max_logits = -inf, lse = +inf.
Decode is the same per (request, query token) over the union of a main and an optional extra cache
(entries are slot ids of each cache): one softmax, the sink applied once.

Readable first: it runs on CPU or GPU, in chunks of query rows to bound memory.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..checks import check_decode_list, check_sink, check_sparse_mla_args, require_tensor

_ROWS_PER_CHUNK = 64


class RefResult(NamedTuple):
    out: torch.Tensor  # fp32 [..., h_q, d_v]
    max_logits: torch.Tensor  # fp32 [..., h_q], natural scale
    lse: torch.Tensor  # fp32 [..., h_q], natural log


def _attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sm_scale: float, d_v: int,
            attn_sink: torch.Tensor | None) -> RefResult:
    """q [n, h, d] fp32, keys [n, k, d] fp32 (rows of invalid entries are ignored), valid [n, k]."""
    # Zero the invalid rows so NaN/Inf in them cannot leak through 0 * NaN.
    keys = torch.where(valid[:, :, None], keys, torch.zeros((), dtype=keys.dtype, device=keys.device))
    scores = torch.einsum("nhd,nkd->nhk", q, keys) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    max_logits = scores.amax(dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    empty = ~valid.any(dim=-1)  # [n]
    # Empty rows (all scores -inf) give 0 / 0 = NaN: they attend to nothing (out 0). Only they: a NaN
    # from the inputs of a valid row stays NaN.
    probs = torch.softmax(scores, dim=-1).masked_fill(empty[:, None, None], 0.0)
    out = torch.einsum("nhk,nkd->nhd", probs, keys[:, :, :d_v])
    lse = lse.masked_fill(empty[:, None], float("inf"))
    if attn_sink is not None:
        # 1 / (1 + exp(s - lse)) written as a sigmoid: exact at s = +-inf and for empty rows
        # (lse = +inf -> factor 1, out already 0), no overflow for large |s - lse|.
        factor = torch.sigmoid(lse - attn_sink.float()[None, :])
        factor = torch.where(empty[:, None], torch.ones_like(factor), factor)
        out = out * factor[:, :, None]
    return RefResult(out, max_logits, lse)


def _valid_entries(indices: torch.Tensor, limit: int, topk_length: torch.Tensor | None) -> torch.Tensor:
    """[n, k] bool: 0 <= idx < limit and position < topk_length (per row)."""
    valid = (indices >= 0) & (indices < limit)
    if topk_length is not None:
        positions = torch.arange(indices.size(-1), device=indices.device)
        valid &= positions[None, :] < topk_length[:, None].long()
    return valid


def _gather(kv_rows: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """kv_rows [s_kv, d] -> [n, k, d] fp32; invalid entries read row 0 (or nothing if s_kv == 0)."""
    if kv_rows.size(0) == 0:
        return kv_rows.new_zeros((*indices.shape, kv_rows.size(-1)), dtype=torch.float32)
    safe = torch.where(valid, indices, torch.zeros_like(indices)).long()
    return kv_rows[safe].float()


def sparse_mla_prefill_ref(q, kv, indices, sm_scale, d_v: int = 512, attn_sink=None,
                           topk_length=None) -> RefResult:
    """q [s_q, h_q, d_qk]; kv [s_kv, 1, d_qk]; indices [s_q, topk] or [s_q, 1, topk] int32."""
    shape, indices = check_sparse_mla_args(
        q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
        q_dtypes=(torch.bfloat16, torch.float16, torch.float32), limit_shapes=False)
    kv_rows = kv[:, 0, :]
    outs, maxes, lses = [], [], []
    for start in range(0, shape.s_q, _ROWS_PER_CHUNK):
        rows = slice(start, start + _ROWS_PER_CHUNK)
        idx = indices[rows]
        valid = _valid_entries(idx, shape.s_kv, None if topk_length is None else topk_length[rows])
        res = _attend(q[rows].float(), _gather(kv_rows, idx, valid), valid, float(sm_scale), d_v, attn_sink)
        outs.append(res.out)
        maxes.append(res.max_logits)
        lses.append(res.lse)
    if shape.s_q == 0:
        empty = q.new_zeros((0, shape.h_q), dtype=torch.float32)
        return RefResult(q.new_zeros((0, shape.h_q, d_v), dtype=torch.float32), empty, empty)
    return RefResult(torch.cat(outs), torch.cat(maxes), torch.cat(lses))


def sparse_mla_decode_ref(q, kv, indices, sm_scale, d_v: int = 512, attn_sink=None, topk_length=None,
                          extra_kv=None, extra_indices=None, extra_topk_length=None) -> RefResult:
    """Decode over flat caches: q [B, s_q, h_q, d]; kv [n_slots, 1, d] (a cache's rows, dequantized if it
    is fp8) with indices [B, s_q, topk] slot ids, valid iff 0 <= id < n_slots and position <
    topk_length[b]; optional extra cache extra_kv [n_slots1, 1, d] with extra_indices [B, s_q, etopk] and
    extra_topk_length [B], attended in the SAME softmax (the sink applied once). Returns out
    [B, s_q, h_q, d_v], max_logits and lse [B, s_q, h_q] (natural log)."""
    require_tensor("q", q, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=4)
    if q.size(0) == 0 or q.size(1) == 0:
        raise ValueError(f"q: expected at least one request and one query token, got shape {tuple(q.shape)}")
    b, s_q, h_q, d = q.shape
    require_tensor("kv", kv, dtypes=(q.dtype, torch.float32), ndim=3)
    if kv.size(1) != 1 or kv.size(2) != d:
        raise ValueError(f"kv: expected shape [n_slots, 1, {d}], got {tuple(kv.shape)}")
    check_decode_list("indices", indices, "topk_length", topk_length, q)
    if (extra_kv is None) != (extra_indices is None):
        raise ValueError("extra_kv and extra_indices: pass both or neither")
    if extra_kv is not None:
        require_tensor("extra_kv", extra_kv, dtypes=(q.dtype, torch.float32), ndim=3)
        if extra_kv.size(1) != 1 or extra_kv.size(2) != d:
            raise ValueError(f"extra_kv: expected shape [n_slots, 1, {d}], got {tuple(extra_kv.shape)}")
        check_decode_list("extra_indices", extra_indices, "extra_topk_length", extra_topk_length, q)
    elif extra_topk_length is not None:
        raise ValueError("extra_topk_length: given without extra_kv / extra_indices")
    check_sink(attn_sink, h_q)

    def per_row(lengths):  # per request [B] -> per query row [B * s_q]
        return None if lengths is None else lengths.repeat_interleave(s_q)

    rows = indices.reshape(b * s_q, -1)
    valid = _valid_entries(rows, kv.size(0), per_row(topk_length))
    keys = _gather(kv[:, 0, :], rows, valid)
    if extra_kv is not None:
        extra_rows = extra_indices.reshape(b * s_q, -1)
        extra_valid = _valid_entries(extra_rows, extra_kv.size(0), per_row(extra_topk_length))
        keys = torch.cat([keys, _gather(extra_kv[:, 0, :], extra_rows, extra_valid)], dim=1)
        valid = torch.cat([valid, extra_valid], dim=1)
    res = _attend(q.reshape(b * s_q, h_q, d).float(), keys, valid, float(sm_scale), d_v, attn_sink)
    return RefResult(res.out.view(b, s_q, h_q, d_v), res.max_logits.view(b, s_q, h_q), res.lse.view(b, s_q, h_q))
