"""The end-to-end oracle: transformers' eager DeepseekV4ForCausalLM, greedy (or teacher-forced along
given tokens), one prompt at a time.

Each prompt runs alone (batch 1) through the model's own cache (DynamicCache with DeepSeek-V4's
sliding-window + compressor layers), one forward per generated token; greedy feeds the argmax of
the last logits. Exactly `max_new_tokens` tokens are produced; EOS does not stop generation (the
engine does the same), so token lists always have the same length.
"""

from __future__ import annotations

import torch


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


def _decode(model, prompt: list[int], steps: int, choose, device) -> tuple[list[int], torch.Tensor]:
    """The prompt, then `steps` forwards through the model's own cache, each feeding the token
    choose(step, logits) picked from the previous one's last logits: (tokens, logits [steps, vocab])."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    step_input = torch.tensor([prompt], dtype=torch.long, device=device)
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
              device="cpu") -> list[tuple[list[int], torch.Tensor]]:
    """For each prompt: (greedy tokens, per-step logits [max_new_tokens, vocab] fp32)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    _check_prompts(prompts)
    model = _load_oracle_model(checkpoint_dir, dtype, device)
    return [_decode(model, prompt, max_new_tokens, lambda step, logits: int(torch.argmax(logits)), device)
            for prompt in prompts]


@torch.no_grad()
def hf_teacher_forced(checkpoint_dir, prompts: list[list[int]], continuations: list[list[int]], *,
                      dtype=torch.float32, device="cpu") -> list[torch.Tensor]:
    """For each prompt: the per-step logits [len(continuation), vocab] fp32 when the model is fed the
    given continuation instead of its own argmax (logits of step j: those continuation[j] follows),
    so that a run whose tokens may differ from greedy ones can be compared step by step."""
    if len(continuations) != len(prompts):
        raise ValueError(f"continuations: expected one per prompt ({len(prompts)}), got {len(continuations)}")
    _check_prompts(prompts)
    for i, continuation in enumerate(continuations):
        if len(continuation) == 0:
            raise ValueError(f"continuations[{i}]: expected at least one token")
    model = _load_oracle_model(checkpoint_dir, dtype, device)
    return [_decode(model, prompt, len(continuation), lambda step, logits, c=continuation: int(c[step]), device)[1]
            for prompt, continuation in zip(prompts, continuations)]
