"""transformers' DeepseekV4ForCausalLM through this project's kernels on a GPU (bf16): accuracy of the
three ways against eager, and eager vs the sparse attention layer at long contexts.

Accuracy (tiny checkpoint, a --accuracy-tokens prompt, then --decode-steps steps teacher-forced along
eager float32's greedy tokens): each way in bf16 against eager float32, logits max |diff| over the
prefill and over the decode steps. The yardstick is eager bf16 against eager float32 (the bf16
floor); a way fails when its max error exceeds FLOOR_FACTOR times the floor's (prefill or decode). The ways:
  attn_implementation   from_pretrained(attn_implementation="deepinfer_sparse_mla") after register()
  sparse layer          kernelize_sparse_attention (DeepseekV4Attention.forward -> the repository's layer)
  kernel_config         from_pretrained(kernel_config=kernel_config(...), device_map="cuda"), transformers'
                        own path: the sparse layer, the RMSNorm layout, attn_hc + input_layernorm fused
Speed (--contexts, default 4K / 16K / 64K tokens): eager bf16 vs the sparse layer bf16, prefill of the
context through the model's cache in --chunk-token chunks (eager's dense attention over one 16K chunk
needs more than an H200's memory) and one decode step after it; CUDA-synchronized wall time (median of
--reps runs for the decode step), peak memory.

The kernel repository is built from this checkout (scripts/build_kernel_repo.py) and loaded through
LOCAL_KERNELS. Needs CUDA, transformers 5.21.1, kernels 0.17.2 (imports transformers, kernels,
safetensors; on the H200 image only the transformers and kernels wheels are missing, docs/transformers.md).
Prints tables; --json PATH writes the numbers; exits 1 when a way fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FLOOR_FACTOR = 2.0


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 258, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _teacher_forced(model, prompt: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill logits [S, V], decode logits [len(tokens), V]) in float32, through the model's cache."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    prefill = model(prompt.to(device), past_key_values=cache, use_cache=True).logits[0].float()
    steps = [prefill[-1]]
    for token in tokens[:-1]:
        step = torch.tensor([[token]], device=device)
        steps.append(model(step, past_key_values=cache, use_cache=True).logits[0, -1].float())
    return prefill, torch.stack(steps)


def accuracy(checkpoint: str, hf, repo_id: str, revision: str, n_tokens: int, n_steps: int) -> dict:
    from transformers import DeepseekV4ForCausalLM

    def load(dtype, **kwargs):
        return DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=dtype, **kwargs).to("cuda").eval()

    prompt = _prompt(n_tokens, 1)
    reference = load(torch.float32)
    with torch.no_grad():  # eager float32's greedy continuation: the tokens every way is fed
        greedy = reference.generate(prompt.cuda(), max_new_tokens=n_steps, do_sample=False)[0, n_tokens:].tolist()
    ref_prefill, ref_steps = _teacher_forced(reference, prompt, greedy)
    del reference

    ways = {
        "eager bf16 (floor)": lambda: load(torch.bfloat16),
        "attn_implementation": lambda: load(torch.bfloat16, attn_implementation=hf.ATTENTION_NAME),
        "sparse layer": lambda: hf.kernelize_sparse_attention(load(torch.bfloat16), repo_id, revision),
        "kernel_config": lambda: DeepseekV4ForCausalLM.from_pretrained(
            checkpoint, dtype=torch.bfloat16, device_map="cuda", use_kernels=True,
            kernel_config=hf.kernel_config(repo_id, revision)).eval(),
    }
    rows = {}
    for name, make in ways.items():
        model = make()
        if name == "kernel_config":
            _check_kernel_config_model(model, hf)
        prefill, steps = _teacher_forced(model, prompt, greedy)
        with torch.no_grad():
            tokens = model.generate(prompt.cuda(), max_new_tokens=n_steps, do_sample=False)[0, n_tokens:].tolist()
        rows[name] = {"prefill_max_abs": (prefill - ref_prefill).abs().max().item(),
                      "prefill_mean_abs": (prefill - ref_prefill).abs().mean().item(),
                      "decode_max_abs": (steps - ref_steps).abs().max().item(),
                      "decode_mean_abs": (steps - ref_steps).abs().mean().item(),
                      "greedy_equals_eager_fp32": tokens == greedy}
        del model
        torch.cuda.empty_cache()
    floor = rows["eager bf16 (floor)"]
    for name, row in rows.items():
        row["ok"] = all(row[k] <= FLOOR_FACTOR * floor[k] for k in ("prefill_max_abs", "decode_max_abs"))
        row["x_floor"] = max(row[k] / floor[k] for k in ("prefill_max_abs", "decode_max_abs"))
    return {"prompt_tokens": n_tokens, "decode_steps": n_steps, "floor_factor": FLOOR_FACTOR, "ways": rows}


def _check_kernel_config_model(model, hf) -> None:
    """The kernels are bound (transformers falls back to the original forwards silently)."""
    names = {type(model.model.norm).__name__: model.model.norm.forward.__func__.__qualname__,
             type(model.model.layers[0].attn_hc).__name__: model.model.layers[0].attn_hc.forward.__func__.__qualname__,
             "self_attn": model.model.layers[1].self_attn.forward.__func__.__qualname__}
    expected = {"RMSNormScaleLayout": "RMSNormScale.forward",
                "HyperConnectionNormLayout": "HyperConnectionNorm.forward",
                "self_attn": f"{hf.SPARSE_ATTENTION}.forward"}
    if names != expected:
        raise RuntimeError(f"kernel_config: expected the kernels bound {expected}, got {names}")


@torch.no_grad()
def _time_context(model, ids: torch.Tensor, chunk: int, reps: int) -> dict:
    from transformers import DynamicCache

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    for part in ids.split(chunk, dim=1):
        model(part, past_key_values=cache, use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - start
    step = torch.tensor([[5]], device=ids.device)
    decode = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(step, past_key_values=cache, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        decode.append(time.perf_counter() - start)
    return {"prefill_s": prefill, "decode_ms": 1e3 * statistics.median(decode),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def speed(checkpoint: str, hf, repo_id: str, revision: str, contexts: list[int], chunk: int, reps: int) -> list:
    from transformers import DeepseekV4ForCausalLM

    eager = DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to("cuda").eval()
    sparse = DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to("cuda").eval()
    hf.kernelize_sparse_attention(sparse, repo_id, revision)
    warm = _prompt(min(chunk, 1024), 3).cuda()
    for model in (eager, sparse):
        _time_context(model, warm, chunk, 1)
    rows = []
    for n in contexts:
        ids = _prompt(n, 2).cuda()
        row = {"context": n, "chunk": chunk}
        for name, model in (("eager", eager), ("sparse", sparse)):
            try:
                row[name] = _time_context(model, ids, chunk, reps)
            except torch.OutOfMemoryError:
                row[name] = "OOM"
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def _print(acc: dict, rows: list) -> None:
    print(f"\naccuracy: bf16 vs eager float32, {acc['prompt_tokens']}-token prompt + {acc['decode_steps']} "
          f"teacher-forced decode steps (fail above {acc['floor_factor']} x the eager bf16 floor)")
    print("| way | prefill max abs | prefill mean abs | decode max abs | decode mean abs | x floor (max) "
          "| greedy = eager fp32 | ok |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in acc["ways"].items():
        print(f"| {name} | {r['prefill_max_abs']:.4f} | {r['prefill_mean_abs']:.5f} | {r['decode_max_abs']:.4f} | "
              f"{r['decode_mean_abs']:.5f} | {r['x_floor']:.2f} | {r['greedy_equals_eager_fp32']} | {r['ok']} |")
    print("\nspeed: eager bf16 vs the sparse attention layer bf16 (prefill in chunks through the cache; "
          "decode: one step after the prefill, median)")
    print("| context | chunk | eager prefill s | sparse prefill s | x | eager decode ms | sparse decode ms | x "
          "| eager peak GiB | sparse peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        e, s = r["eager"], r["sparse"]
        if e == "OOM" or s == "OOM":
            print(f"| {r['context']} | {r['chunk']} | {e if e == 'OOM' else round(e['prefill_s'], 3)} | "
                  f"{s if s == 'OOM' else round(s['prefill_s'], 3)} | | | | | | |")
            continue
        print(f"| {r['context']} | {r['chunk']} | {e['prefill_s']:.3f} | {s['prefill_s']:.3f} | "
              f"{e['prefill_s'] / s['prefill_s']:.1f} | {e['decode_ms']:.2f} | {s['decode_ms']:.2f} | "
              f"{e['decode_ms'] / s['decode_ms']:.2f} | {e['peak_gib']:.1f} | {s['peak_gib']:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--chunk", type=int, default=4096, help="prefill chunk (tokens)")
    parser.add_argument("--reps", type=int, default=5, help="decode steps timed (median)")
    parser.add_argument("--accuracy-tokens", type=int, default=300)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("hf_integration_bench: needs a CUDA GPU", file=sys.stderr)
        return 2

    import build_kernel_repo  # (this script's directory is on sys.path)
    from build_kernel_repo import REPO_ID, REVISION

    repo = Path(tempfile.mkdtemp(prefix="deepinfer_kernel_repo_"))
    build_kernel_repo.build(repo)
    os.environ["LOCAL_KERNELS"] = f"{REPO_ID}={repo}"
    os.environ["HF_HUB_OFFLINE"] = "1"
    from engine.integrations import transformers as hf
    from engine.model.tiny import default_checkpoint_dir

    import kernels
    import transformers

    hf.register()
    checkpoint = str(default_checkpoint_dir())
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"kernels {kernels.__version__}")
    acc = accuracy(checkpoint, hf, REPO_ID, REVISION, args.accuracy_tokens, args.decode_steps)
    hf.forget_kernel_config()
    rows = speed(checkpoint, hf, REPO_ID, REVISION, args.contexts, args.chunk, args.reps)
    _print(acc, rows)
    if args.json:
        args.json.write_text(json.dumps({"accuracy": acc, "speed": rows}, indent=2) + "\n")
    failed = [name for name, r in acc["ways"].items() if not r["ok"]]
    if failed:
        print(f"FAILED: {', '.join(failed)} beyond {FLOOR_FACTOR} x the bf16 floor", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
