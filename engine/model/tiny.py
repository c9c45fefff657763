"""The embedded default model: a tiny DeepSeek-V4 with deterministic seeded weights.

Nothing is downloaded. `write_tiny_checkpoint` writes an HF-format directory (config.json,
model.safetensors, tokenizer.json) that both transformers' DeepseekV4ForCausalLM and the engine
load. The config covers the three attention layer types (sliding, compressed-sparse with the
lightning indexer, heavily-compressed) and both MoE kinds (hash-routed and top-k routed) at the
real attention shapes (64 query heads, head_dim 512 with 64 RoPE dims, window 128), plus one NextN
(MTP) layer under `mtp.0.` (engine.model.nextn; transformers ignores those keys).

Weights are drawn per tensor from a generator seeded by (seed, crc32(name)), so they depend only
on the tensor names and shapes, not on module construction order or the transformers version.
initializer_range is 0.2: with 0.02 greedy decoding collapses into one repeated token, which makes
"same tokens as the oracle" a weak check.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import torch

# Bumped whenever the generated weights or files change, so stale cached checkpoints are not reused.
GENERATOR_VERSION = 2
CACHE_ROOT = Path.home() / ".cache" / "deepinfer"

BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 1
BYTE_OFFSET = 2  # byte b is token b + 2
TOKENIZER_KIND = "deepinfer-byte-level"

# Only fields that exist in every supported transformers version (5.17 .. 5.21), written as-is to
# config.json so that a checkpoint written by one version loads in the other.
TINY_CONFIG_FIELDS = {
    "vocab_size": 512,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 64,
    "o_groups": 8,
    "o_lora_rank": 32,
    "moe_intermediate_size": 64,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_topk": 64,
    "sliding_window": 128,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "sliding_attention",
    ],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "num_nextn_predict_layers": 1,
    "initializer_range": 0.2,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "tie_word_embeddings": False,
}


def tiny_config(**overrides):
    """DeepseekV4Config of the embedded default (15.9 M parameters); `overrides` replace fields."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{**TINY_CONFIG_FIELDS, **overrides})


def _tensor_for(name: str, shape: torch.Size, dtype: torch.dtype, config, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        # Hash routing table: num_experts_per_tok distinct experts per token id.
        rows = [torch.randperm(config.n_routed_experts, generator=gen)[: shape[1]] for _ in range(shape[0])]
        return torch.stack(rows).to(dtype)
    if leaf == "e_score_correction_bias":
        values = normal(0.1)
    elif leaf == "sinks":
        values = normal(1.0)
    elif leaf == "position_bias":
        values = normal(0.5)
    elif leaf in ("base", "hc_base"):
        values = normal(0.1)
    elif leaf in ("scale", "hc_scale"):
        values = normal(0.1, mean=1.0)
    elif name.endswith("norm.weight"):
        values = normal(0.1, mean=1.0)
    else:  # projections, experts, embeddings, head, hyper-connection mixers
        values = normal(config.initializer_range)
    return values.to(dtype)


def _tiny_state_dict(config, seed: int) -> dict[str, torch.Tensor]:
    from transformers import DeepseekV4ForCausalLM

    from engine.model.nextn import nextn_state_shapes

    with torch.device("meta"):
        skeleton = DeepseekV4ForCausalLM(config)
    shapes = {name: (t.shape, t.dtype) for name, t in skeleton.state_dict().items()}
    shapes.update(nextn_state_shapes(config))  # the NextN (MTP) layer, under mtp.0.
    return {name: _tensor_for(name, shape, dtype, config, seed) for name, (shape, dtype) in shapes.items()}


def write_tiny_checkpoint(path, *, seed: int = 0) -> Path:
    """Write the tiny checkpoint into directory `path` (created); returns it."""
    from safetensors.torch import save_file

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed: expected a non-negative int, got {seed!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    state = _tiny_state_dict(config, seed)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config_json = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "float32",
        **TINY_CONFIG_FIELDS,
    }
    (path / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    tokenizer_json = {
        "kind": TOKENIZER_KIND,
        "vocab_size": TINY_CONFIG_FIELDS["vocab_size"],
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "byte_offset": BYTE_OFFSET,
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json, indent=2) + "\n")
    (path / "generator.json").write_text(json.dumps({"generator_version": GENERATOR_VERSION, "seed": seed}) + "\n")
    return path


def default_checkpoint_dir() -> Path:
    """The embedded default checkpoint (seed 0) under ~/.cache/deepinfer, written on first use.

    Safe when several processes (DP ranks) call it at once: each writes a private temporary
    directory and renames it into place; the first rename wins, the others discard theirs."""
    target = CACHE_ROOT / f"tiny-deepseek-v4-g{GENERATOR_VERSION}-seed0"
    if (target / "generator.json").is_file():
        return target
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-staging-", dir=CACHE_ROOT))
    try:
        write_tiny_checkpoint(staging, seed=0)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "generator.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


class ByteTokenizer:
    """Byte-level tokenizer: token = byte + byte_offset; ids below the offset are specials (bos,
    eos). decode drops bos and writes every other non-byte id (eos, ids past the byte range, which
    the model can emit) as `<id>`; invalid UTF-8 decodes with replacement characters."""

    def __init__(self, vocab_size: int, bos_token_id: int, eos_token_id: int, byte_offset: int):
        if byte_offset + 256 > vocab_size:
            raise ValueError(f"vocab_size: expected >= byte_offset + 256 = {byte_offset + 256}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.byte_offset = byte_offset

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text: expected str, got {type(text).__name__}")
        ids = [b + self.byte_offset for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        pieces: list[str] = []
        pending = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"ids: token {i} outside [0, {self.vocab_size})")
            if self.byte_offset <= i < self.byte_offset + 256:
                pending.append(i - self.byte_offset)
                continue
            if pending:
                pieces.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if i != self.bos_token_id:
                pieces.append(f"<{i}>")
        if pending:
            pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)


def load_tokenizer(path) -> ByteTokenizer:
    """The byte-level tokenizer stored in checkpoint directory `path` (tokenizer.json)."""
    spec_path = Path(path) / "tokenizer.json"
    if not spec_path.is_file():
        raise FileNotFoundError(f"path: no tokenizer.json in {path}")
    spec = json.loads(spec_path.read_text())
    if spec.get("kind") != TOKENIZER_KIND:
        raise ValueError(f"path: {spec_path} is not a {TOKENIZER_KIND} tokenizer (kind={spec.get('kind')!r})")
    return ByteTokenizer(spec["vocab_size"], spec["bos_token_id"], spec["eos_token_id"], spec["byte_offset"])
