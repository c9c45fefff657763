#!/usr/bin/env python3
"""The TileLang paged fp8 decode kernel alone (engine/h20_ops/attention/tilelang_sm90_paged_fp8.py) at
FlashMLA's sparse decode configurations, on an SM90 GPU.

Configurations (s_q 2; q bf16, sink given, no topk_length: what the decode entry point launches):
  MODEL1 (DeepSeek-V4, 584 B/token, d_qk 512): b in {2, 64, 74, 128, 148, 256} x h_q in {64, 128} x
    extra topk in {512, 1024}; cache 0 = the SWA cache in 256-token pages, topk 128 = each request's
    sliding window (128 consecutive tokens of its own pages); cache 1 = the compressed cache in 64-token
    pages, extra topk = distinct random entries of the request's 4 x extra-topk compressed tokens;
  V32 (DeepSeek-V3.2, 656 B/token, d_qk 576): b 128, h_q 128, topk 2048 distinct random tokens of the
    request's 8192 in one cache of 64-token pages.
Every request's pages are scattered over its cache (a random page table). Rows are quantized from
0.1 * N(0, 1) by kv_cache.quantize_into_cache.
Timing: the kernel launch (sparse_mla_fwd_sm90_paged_fp8) captured once in a CUDA graph and replayed;
triton.testing.do_bench's median, which clears a 256 MB buffer (flushing L2) before each replay and times
the replay alone with CUDA events.
Columns: us per call; TFLOP/s = 2 * b * s_q * topk_total * h_q * (d_qk + d_v) / time (d_v 512); CTAs (the
persistent grid, min(b * s_q * h_q / 64, SMs)).
Usage: python scripts/bench_tilelang_paged_fp8.py    (needs an SM90 GPU and TileLang; ~3 min, most of it
       the three compiles, cached in TILELANG_CACHE_DIR)
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import engine.h20_ops  # noqa: E402,F401
from engine.h20_ops import kv_cache  # noqa: E402
from engine.h20_ops.attention.tilelang_sm90_paged_fp8 import sparse_mla_fwd_sm90_paged_fp8  # noqa: E402
from engine.h20_ops.platform import sm_count  # noqa: E402

from bench_flash_mla import captured  # noqa: E402  (this folder is on sys.path: the script's own)

S_Q = 2
D_V = 512
BATCHES = (2, 64, 74, 128, 148, 256)
SWA_TOPK, SWA_PAGE, SWA_TOKENS = 128, 256, 512  # each request: 2 pages of 256 tokens, a 128-token window
CMP_PAGE, CMP_TOKENS_PER_TOPK = 64, 4  # compressed: 64-token pages, 4 x extra topk tokens per request
V32_TOPK, V32_PAGE, V32_TOKENS = 2048, 64, 8192


def paged_cache(layout, batch: int, tokens: int, page: int, gen: torch.Generator, device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache holding `tokens` tokens per request in `page`-token pages, the pages of all requests in a
    random order; returns (cache, slots [batch, tokens] int64: request b's token t is slot slots[b, t]).
    gen: a generator on `device`."""
    pages_per_request = -(-tokens // page)
    num_blocks = batch * pages_per_request
    cache = kv_cache.new_fp8_kv_cache(layout, num_blocks, page, device)
    table = torch.randperm(num_blocks, generator=gen, device=device).view(batch, pages_per_request)
    t = torch.arange(tokens, device=device)
    slots = table[:, t // page] * page + t % page
    flat = slots.flatten()
    for start in range(0, flat.numel(), 1 << 18):  # quantize in chunks (bounded bf16 staging)
        part = flat[start:start + (1 << 18)]
        rows = (torch.randn(part.numel(), 1, layout.d, generator=gen, device=device) * 0.1).bfloat16()
        kv_cache.quantize_into_cache(cache, part, rows)
    return cache, slots


def distinct_random(gen: torch.Generator, batch: int, tokens: int, topk: int, device) -> torch.Tensor:
    """[batch, S_Q, topk] int64: per (request, query) topk distinct token positions in [0, tokens)."""
    keys = torch.rand(batch * S_Q, tokens, generator=gen, device=device)
    return keys.argsort(dim=1)[:, :topk].view(batch, S_Q, topk)


def model1_inputs(batch: int, extra_topk: int, gen: torch.Generator, device):
    swa, swa_slots = paged_cache(kv_cache.MODEL1, batch, SWA_TOKENS, SWA_PAGE, gen, device)
    cmp_tokens = CMP_TOKENS_PER_TOPK * extra_topk
    cmp, cmp_slots = paged_cache(kv_cache.MODEL1, batch, cmp_tokens, CMP_PAGE, gen, device)
    # the window: the 128 tokens before a random position of the request's 512
    end = torch.randint(SWA_TOPK, SWA_TOKENS + 1, (batch, 1), generator=gen, device=device)
    window = torch.gather(swa_slots, 1, end - SWA_TOPK + torch.arange(SWA_TOPK, device=device)[None, :])
    picks = distinct_random(gen, batch, cmp_tokens, extra_topk, device)
    extra = torch.gather(cmp_slots[:, None, :].expand(batch, S_Q, cmp_tokens), 2, picks)
    n_swa = swa.size(0) * swa.size(1)
    indices = torch.cat([window[:, None, :].expand(batch, S_Q, SWA_TOPK), extra + n_swa], dim=2)
    return swa, cmp, indices.reshape(batch * S_Q, -1).to(torch.int32).contiguous()


def v32_inputs(batch: int, gen: torch.Generator, device):
    cache, slots = paged_cache(kv_cache.V32, batch, V32_TOKENS, V32_PAGE, gen, device)
    picks = distinct_random(gen, batch, V32_TOKENS, V32_TOPK, device)
    indices = torch.gather(slots[:, None, :].expand(batch, S_Q, V32_TOKENS), 2, picks)
    return cache, None, indices.reshape(batch * S_Q, -1).to(torch.int32).contiguous()


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device (SM90)")
        return 1
    import triton.testing

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    print(f"{torch.cuda.get_device_name(device)}, {sm_count(device)} SMs; kernel alone, CUDA graph replay, L2 flushed "
          f"(do_bench median); s_q {S_Q}")
    print(f"{'layout':>6s} {'b':>4s} {'h_q':>4s} {'topk':>10s} {'pages':>7s} {'CTAs':>5s} {'us':>8s} {'TFLOP/s':>8s}")
    # (layout, batch, extra topk, h_q values): the caches of one (layout, batch, extra topk) serve both h_q
    configs = [("MODEL1", batch, extra_topk, (64, 128)) for extra_topk in (512, 1024) for batch in BATCHES]
    configs.append(("V32", 128, 0, (128,)))
    for layout_name, batch, extra_topk, heads in configs:
        if layout_name == "MODEL1":
            cache0, cache1, indices = model1_inputs(batch, extra_topk, gen, device)
            topk_label, pages, d_qk = f"{SWA_TOPK}+{extra_topk}", f"{SWA_PAGE}/{CMP_PAGE}", kv_cache.MODEL1.d
        else:
            cache0, cache1, indices = v32_inputs(batch, gen, device)
            topk_label, pages, d_qk = str(V32_TOPK), str(V32_PAGE), kv_cache.V32.d
        rows, topk_total = batch * S_Q, indices.size(1)
        for h_q in heads:
            q = (torch.randn(rows, h_q, d_qk, generator=gen, device=device) * 0.1).bfloat16()
            sink = torch.randn(h_q, generator=gen, device=device)
            sm_scale = d_qk ** -0.5

            def call():
                return sparse_mla_fwd_sm90_paged_fp8(q, cache0, cache1, indices, sm_scale, attn_sink=sink)

            out, lse = call()
            assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all(), "non-finite output"
            replay = captured(call, device)
            ms = triton.testing.do_bench(replay, warmup=25, rep=200, return_mode="median")
            flop = 2 * rows * topk_total * h_q * (d_qk + D_V)
            ctas = min(rows * (h_q // 64), sm_count(device))
            print(f"{layout_name:>6s} {batch:4d} {h_q:4d} {topk_label:>10s} {pages:>7s} {ctas:5d} {ms * 1e3:8.1f} "
                  f"{flop / (ms * 1e-3) / 1e12:8.1f}", flush=True)
            del replay, out, lse
        del cache0, cache1, indices
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
