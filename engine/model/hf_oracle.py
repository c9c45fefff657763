"""The end-to-end oracle: transformers' eager DeepseekV4ForCausalLM, greedy, one prompt at a time.

Each prompt runs alone (batch 1) through the model's own cache (DynamicCache with DeepSeek-V4's
sliding-window + compressor layers), one forward per generated token, argmax of the last logits.
Exactly `max_new_tokens` tokens are produced; EOS does not stop generation (the engine does the
same), so token lists always have the same length.
"""

from __future__ import annotations

import torch


def load_hf_model(checkpoint_dir, *, dtype: torch.dtype, device):
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(str(checkpoint_dir), dtype=dtype)
    return model.to(device).eval()


@torch.no_grad()
def hf_greedy(checkpoint_dir, prompts: list[list[int]], max_new_tokens: int, *, dtype=torch.float32,
              device="cpu") -> list[tuple[list[int], torch.Tensor]]:
    """For each prompt: (greedy tokens, per-step logits [max_new_tokens, vocab] fp32)."""
    from transformers import DynamicCache

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    model = load_hf_model(checkpoint_dir, dtype=dtype, device=device)
    results = []
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}]: expected at least one token")
        cache = DynamicCache(config=model.config)
        step_input = torch.tensor([prompt], dtype=torch.long, device=device)
        tokens: list[int] = []
        logits_per_step = []
        for _ in range(max_new_tokens):
            out = model(input_ids=step_input, past_key_values=cache, use_cache=True)
            logits = out.logits[0, -1].float()
            next_token = int(torch.argmax(logits))
            tokens.append(next_token)
            logits_per_step.append(logits.cpu())
            step_input = torch.tensor([[next_token]], dtype=torch.long, device=device)
        results.append((tokens, torch.stack(logits_per_step)))
    return results
