"""The end-to-end oracle: transformers' eager DeepseekV4ForCausalLM, greedy (or teacher-forced along
given tokens), one prompt at a time.

Each prompt runs alone (batch 1) through the model's own cache (DynamicCache with DeepSeek-V4's
sliding-window + compressor layers), one forward per generated token; greedy feeds the argmax of
the last logits. Exactly `max_new_tokens` tokens are produced; EOS does not stop generation (the
engine does the same), so token lists always have the same length.

Options of both entry points:
  - kv_cache "fp8": the model's cache stores what the engine's fp8 (MODEL1) cache returns: window
    K=V rows and compressed entries pass through the fp8 quantizer's torch reference round trip on
    their way in (indexer keys stay exact, as in the engine); "auto" stores them as computed;
  - prefill_chunk: feed the prompt through the cache in pieces of that many tokens (None: one
    forward). The eager attention of one forward over L tokens holds [heads, L, L] scores, ~1 TiB
    in float32 for L = 65536; in pieces of C it holds [heads, C, C + window + compressed entries].
"""

from __future__ import annotations

import contextlib

import torch

from ..h20_ops import kv_cache as fp8_cache

KV_CACHES = ("auto", "fp8")


def load_hf_model(checkpoint_dir, *, dtype: torch.dtype, device):
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(str(checkpoint_dir), dtype=dtype)
    return model.to(device).eval()


# transformers 5.17-5.19 return float32 from DeepSeek-V4's weighted RMSNorm, so their model's forward
# in bf16 / fp16 stops in the next Linear ("expected m1 and m2 to have the same dtype"); 5.20.0 is the
# first that runs (checked on 5.17.0, 5.18.0, 5.19.0, 5.20.0, 5.21.0, 5.21.1). The engine does not
# run that norm and takes any supported release.
HALF_PRECISION_TRANSFORMERS = "5.20.0"


def _load_oracle_model(checkpoint_dir, dtype: torch.dtype, device):
    import transformers
    from packaging.version import Version

    if dtype != torch.float32 and Version(transformers.__version__) < Version(HALF_PRECISION_TRANSFORMERS):
        raise RuntimeError(
            f"dtype: the oracle in {dtype} needs transformers >= {HALF_PRECISION_TRANSFORMERS} (installed: "
            f"{transformers.__version__}, whose DeepSeek-V4 RMSNorm returns float32); install "
            f"'transformers>={HALF_PRECISION_TRANSFORMERS},<5.22' or use torch.float32")
    return load_hf_model(checkpoint_dir, dtype=dtype, device=device)


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [..., 512] -> what a MODEL1 fp8 cache returns for it (the fp8 quantizer's torch reference)."""
    rows = x.reshape(-1, x.size(-1))
    n = rows.size(0)
    cache = fp8_cache.new_fp8_kv_cache(fp8_cache.MODEL1, max(1, -(-n // 64)), 64, x.device)
    slots = torch.arange(n, device=x.device)
    fp8_cache.quantize_into_cache_ref(cache, slots, rows[:, None].float().contiguous())
    return fp8_cache.dequantize_from_cache_ref(cache, slots, x.dtype).reshape(x.shape)


@contextlib.contextmanager
def fp8_cache_emulation():
    """While active, every DeepSeek-V4 cache of transformers stores fp8_round_trip of its window rows
    (K = V) and of its compressed entries; indexer keys stay exact. Patches the cache classes."""
    from transformers import cache_utils
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    def rounding_update(original):
        def update(self, key_states, value_states, *args, **kwargs):
            kv = fp8_round_trip(key_states)  # K = V in DeepSeek-V4
            return original(self, kv, kv, *args, **kwargs)
        return update

    original_entries = v4.DeepseekV4HCACache.update_compressor_states

    def rounding_entries(self, name, compressed):
        return original_entries(self, name, fp8_round_trip(compressed) if name == "compressor" else compressed)

    originals = [(cache_utils.DynamicSlidingWindowLayer, "update"), (v4.DeepseekV4HCACache, "update"),
                 (v4.DeepseekV4HCACache, "update_compressor_states")]
    saved = [(cls, name, cls.__dict__[name]) for cls, name in originals]
    cache_utils.DynamicSlidingWindowLayer.update = rounding_update(cache_utils.DynamicSlidingWindowLayer.update)
    v4.DeepseekV4HCACache.update = rounding_update(v4.DeepseekV4HCACache.update)
    v4.DeepseekV4HCACache.update_compressor_states = rounding_entries
    try:
        yield
    finally:
        for cls, name, value in saved:
            setattr(cls, name, value)


def _check_options(kv_cache: str, prefill_chunk) -> None:
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache: expected one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk: expected None or an int >= 1, got {prefill_chunk!r}")


def _decode(model, prompt: list[int], steps: int, choose, device, prefill_chunk) -> tuple[list[int], torch.Tensor]:
    """The prompt (in pieces of prefill_chunk tokens, or at once), then `steps` forwards through the
    model's own cache, each feeding the token choose(step, logits) picked from the previous one's last
    logits: (tokens, logits [steps, vocab])."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    chunk = prefill_chunk or len(prompt)
    last = (len(prompt) - 1) // chunk * chunk  # the start of the last piece, whose last logits step 0 takes
    for start in range(0, last, chunk):  # the pieces before it only fill the cache
        model(input_ids=torch.tensor([prompt[start:start + chunk]], dtype=torch.long, device=device),
              past_key_values=cache, use_cache=True)
    step_input = torch.tensor([prompt[last:]], dtype=torch.long, device=device)
    tokens: list[int] = []
    logits_per_step = []
    for step in range(steps):
        out = model(input_ids=step_input, past_key_values=cache, use_cache=True)
        logits = out.logits[0, -1].float()
        token = choose(step, logits)
        tokens.append(token)
        logits_per_step.append(logits.cpu())
        step_input = torch.tensor([[token]], dtype=torch.long, device=device)
    return tokens, torch.stack(logits_per_step)


def _check_prompts(prompts: list[list[int]]) -> None:
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}]: expected at least one token")


@torch.no_grad()
def hf_greedy(checkpoint_dir, prompts: list[list[int]], max_new_tokens: int, *, dtype=torch.float32,
              device="cpu", kv_cache: str = "auto", prefill_chunk: int | None = None
              ) -> list[tuple[list[int], torch.Tensor]]:
    """For each prompt: (greedy tokens, per-step logits [max_new_tokens, vocab] fp32)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    _check_prompts(prompts)
    _check_options(kv_cache, prefill_chunk)
    model = _load_oracle_model(checkpoint_dir, dtype, device)
    with fp8_cache_emulation() if kv_cache == "fp8" else contextlib.nullcontext():
        return [_decode(model, prompt, max_new_tokens, lambda step, logits: int(torch.argmax(logits)), device,
                        prefill_chunk) for prompt in prompts]


@torch.no_grad()
def hf_teacher_forced(checkpoint_dir, prompts: list[list[int]], continuations: list[list[int]], *,
                      dtype=torch.float32, device="cpu", kv_cache: str = "auto",
                      prefill_chunk: int | None = None) -> list[torch.Tensor]:
    """For each prompt: the per-step logits [len(continuation), vocab] fp32 when the model is fed the
    given continuation instead of its own argmax (logits of step j: those continuation[j] follows),
    so that a run whose tokens may differ from greedy ones can be compared step by step."""
    if len(continuations) != len(prompts):
        raise ValueError(f"continuations: expected one per prompt ({len(prompts)}), got {len(continuations)}")
    _check_prompts(prompts)
    for i, continuation in enumerate(continuations):
        if len(continuation) == 0:
            raise ValueError(f"continuations[{i}]: expected at least one token")
    _check_options(kv_cache, prefill_chunk)
    model = _load_oracle_model(checkpoint_dir, dtype, device)
    with fp8_cache_emulation() if kv_cache == "fp8" else contextlib.nullcontext():
        return [_decode(model, prompt, len(continuation), lambda step, logits, c=continuation: int(c[step]), device,
                        prefill_chunk)[1] for prompt, continuation in zip(prompts, continuations)]
