"""DeepSeek-V4's NextN (multi-token prediction) layer: the drafter of speculative decoding.

One extra decoder layer after the main model, DeepSeek-V3 style: for position i it takes the
embedding of token i + 1 and the main model's final hidden state h_i (after the head's
hyper-connection collapse, before the final norm), computes
    x_i = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))
runs x_i (expanded to the hc_mult residual streams) through a sliding-window-only decoder layer
(no compressor, top-k routed MoE) at position i, collapses the streams with its own hyper-head and
final norm, and predicts token i + 2 through the main model's lm_head; embeddings are shared too.
Chained drafts (k > 1) feed the layer's own collapsed hidden state back as h.

Checkpoint keys: `mtp.0.` + {enorm.weight, hnorm.weight, eh_proj.weight, hc_head.*, norm.weight,
layer.<decoder layer keys>}. transformers' DeepseekV4ForCausalLM ignores `mtp.*` keys when loading.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

PREFIX = "mtp.0."
SLIDING = "sliding_attention"


def nextn_config(config):
    """The main config with one window-only, top-k-routed decoder layer (index 0)."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    cfg.layer_types = [SLIDING]
    cfg.mlp_layer_types = ["moe"]
    return cfg


class NextNLayer(nn.Module):
    """Weights of the NextN layer (reusing transformers' DeepSeek-V4 modules)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4DecoderLayer, DeepseekV4HyperHead, DeepseekV4RMSNorm)

        hidden = config.hidden_size
        self.enorm = DeepseekV4RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV4RMSNorm(hidden, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = DeepseekV4DecoderLayer(nextn_config(config), 0)
        self.hc_head = DeepseekV4HyperHead(config)
        self.norm = DeepseekV4RMSNorm(hidden, eps=config.rms_norm_eps)


def nextn_state_shapes(config) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Checkpoint key -> (shape, dtype) of every NextN tensor."""
    with torch.device("meta"):
        skeleton = NextNLayer(config)
    return {PREFIX + name: (t.shape, t.dtype) for name, t in skeleton.state_dict().items()}


def load_nextn_layer(checkpoint_dir, config, *, dtype: torch.dtype, device) -> NextNLayer:
    """The NextN layer of an HF-format checkpoint (model.safetensors); a clear error if it has none."""
    from safetensors import safe_open

    path = Path(checkpoint_dir) / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        state = {key[len(PREFIX):]: f.get_tensor(key) for key in f.keys() if key.startswith(PREFIX)}
    if not state:
        raise ValueError(f"checkpoint_dir: {path} has no NextN ({PREFIX}*) weights; NextN decoding "
                         f"(DEEPINFER_USE_NEXTN_DECODE=1) needs them")
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4PreTrainedModel

    with torch.device("meta"):
        layer = NextNLayer(config)
    layer.load_state_dict(state, strict=True, assign=True)
    # As transformers loads the main model: these modules stay float32 in every dtype (the
    # attention kernels take float32 sinks); the NextN input norms count as norms. Each tensor goes
    # from the checkpoint straight to its dtype (through `dtype` first would round the float32 ones).
    fp32_modules = set(DeepseekV4PreTrainedModel._keep_in_fp32_modules_strict) | {"enorm", "hnorm"}
    for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
        target = tensor.dtype
        if tensor.is_floating_point():
            target = torch.float32 if fp32_modules & set(name.split(".")) else dtype
        tensor.data = tensor.data.to(device=device, dtype=target)
    return layer.eval()
