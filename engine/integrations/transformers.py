"""transformers' DeepseekV4ForCausalLM through this project's kernels (transformers 5.21.1, kernels 0.17.2).

Three ways, each checked against transformers' eager model (tests/test_hf_integration.py):

1. `register()`, then `from_pretrained(path, attn_implementation="deepinfer_sparse_mla")`: transformers'
   attention module calls `sparse_mla_attention` in place of its eager attention. The entries each
   query attends are read from the eager mask (registered under the same name: without it
   transformers hands a registered attention no mask), K = V, the sinks from `s_aux`; the model still
   builds the dense mask and the indexer's bias, so this is a drop-in, not the sparse path.
2. `kernelize_sparse_attention(model, repo_id, revision)`: every DeepseekV4Attention's forward becomes the
   kernel repository's stateless `DeepseekV4SparseAttention` (engine/integrations/hf_layers.py), which
   takes the indexer's top-k and the sliding window directly and calls the sparse kernel on those
   rows; the caches stay transformers'.
3. `kernel_config(repo_id, revision)`: a KernelConfig with that layer plus the repository's layouts
   (a DeepseekV4RMSNorm whose weight is held as `scale`; `attn_hc` fused with `input_layernorm`), for
   `from_pretrained(path, kernel_config=..., device_map="cuda")`. transformers refuses a KernelConfig for
   a CPU model; `from_pretrained_on_cpu` does the same registrations, the load and kernelize there.

The kernel repository is loaded by `kernels` under its repo id and a revision; offline, point
LOCAL_KERNELS="<repo_id>=<path>" at a local copy.

Process-global state: transformers keeps the layouts' class patches and checkpoint renames (every
load with a KernelConfig registers them again; the renames are idempotent), so a later load without
a KernelConfig still builds the layouts; `forget_kernel_config()` removes them. A KernelConfig is
rewritten by the load that uses it: build a new one per load.
"""

from __future__ import annotations

import torch

from .hf_layers import sparse_attention

ATTENTION_NAME = "deepinfer_sparse_mla"
TRANSFORMERS_VERSION = "5.21.1"
KERNELS_VERSION = "0.17.2"

# The kernel layer name given to transformers' DeepseekV4Attention (it has none of its own).
ATTENTION_LAYER = "DeepseekV4Attention"
SPARSE_ATTENTION = "DeepseekV4SparseAttention"
RMS_NORM_KEY = "^DeepseekV4RMSNorm$"  # a class-name regex: unanchored "RMSNorm" also hits DeepseekV4UnweightedRMSNorm
HYPER_CONNECTION_NORM_KEY = (("DeepseekV4HyperConnection", "model.layers.*.attn_hc"),
                             ("DeepseekV4RMSNorm", "model.layers.*.input_layernorm"))
# What transformers patches for them: the layout class (string key) and the fused parent (tuple key).
_PATCHED_CLASS_NAMES = ("RMSNormScaleLayout", "FusedDeepseekV4DecoderLayer")


def _require_version(package: str, required: str) -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version(package)
    except PackageNotFoundError:
        installed = None
    if installed != required:
        raise RuntimeError(f"engine.integrations.transformers needs {package}=={required} (installed: "
                           f"{installed or 'none'}); install 'deepinfer-engine[hf-kernels]'")


def sparse_mla_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                         s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for DeepSeek-V4 on the sparse MLA kernel. query [B, H, S, D];
    key = value [B, 1, N, D] (window rows, then every compressed entry); attention_mask [B, 1, S, N]
    eager (0 where attended) or None (all attended); s_aux [H] the sinks. Returns ([B, S, H, D], None)."""
    if value is not key:
        raise ValueError("value: expected the key tensor itself (DeepSeek-V4 attends K = V)")
    if key.dim() != 4 or key.shape[1] != 1:
        raise ValueError(f"key: expected [B, 1, N, D] (one shared K = V head), got shape {tuple(key.shape)}")
    if s_aux is None:
        raise ValueError("s_aux: expected the attention sinks [H] (DeepseekV4Attention passes module.sinks)")
    if dropout:
        raise ValueError(f"dropout: the sparse MLA kernel has no dropout (inference only), got {dropout}")
    rows = key[:, 0]
    seq_len, n = query.shape[2], rows.shape[1]
    if attention_mask is None:
        valid = torch.ones((1, seq_len, n), dtype=torch.bool, device=query.device)
    else:
        valid = attention_mask[:, 0, :, :n] == 0
    # the attended columns of each row first, in ascending order; -1 past them
    order = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices
    count = valid.sum(dim=-1, keepdim=True)
    width = max(int(count.max()), 1)
    positions = torch.arange(width, device=query.device)
    entries = torch.where(positions < count, order[..., :width], -1).expand(query.shape[0], -1, -1)
    return sparse_attention(query.transpose(1, 2), rows, entries, scaling, s_aux), None


def register() -> None:
    """Register `sparse_mla_attention` and transformers' eager mask as attn_implementation
    "deepinfer_sparse_mla" (process-wide; calling it again changes nothing)."""
    _require_version("transformers", TRANSFORMERS_VERSION)
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    AttentionInterface.register(ATTENTION_NAME, sparse_mla_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)


def _name_attention_layer() -> None:
    """Give transformers' DeepseekV4Attention the kernel layer name ATTENTION_LAYER, so that kernelize
    (and KernelConfig's checks) find it."""
    _require_version("transformers", TRANSFORMERS_VERSION)
    _require_version("kernels", KERNELS_VERSION)
    from kernels import replace_kernel_forward_from_hub
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    replace_kernel_forward_from_hub(DeepseekV4Attention, ATTENTION_LAYER)


def kernelize_sparse_attention(model, repo_id: str, revision: str):
    """Bind the kernel repository's DeepseekV4SparseAttention to every DeepseekV4Attention of `model`
    (on the model's device type); returns the model. A mapped layer that cannot load raises."""
    _name_attention_layer()
    from kernels import KernelizeFallback, LayerRepository, Mode, kernelize, use_kernel_mapping

    device = next(model.parameters()).device.type
    repo = LayerRepository(repo_id, layer_name=SPARSE_ATTENTION, revision=revision)
    with use_kernel_mapping({ATTENTION_LAYER: {device: {Mode.INFERENCE: repo}}}, inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE, device=device, use_fallback=KernelizeFallback.NO_LAYER)
    return model


def kernel_mapping(repo_id: str, revision: str) -> dict:
    """KernelConfig mapping of every layer of the kernel repository: the sparse attention layer (key
    ATTENTION_LAYER), the RMSNorm layout (RMS_NORM_KEY) and the attn_hc + input_layernorm fusion
    (HYPER_CONNECTION_NORM_KEY). Any subset of it is a valid mapping. Names DeepseekV4Attention's
    kernel layer (kernels' replace_kernel_forward_from_hub), which transformers needs to find it."""
    _name_attention_layer()
    meta = {"revision": revision}
    return {
        ATTENTION_LAYER: (f"{repo_id}:{SPARSE_ATTENTION}", meta),
        RMS_NORM_KEY: (f"{repo_id}:RMSNormScale", meta),
        HYPER_CONNECTION_NORM_KEY: (f"{repo_id}:HyperConnectionNorm", meta),
    }


def kernel_config(repo_id: str, revision: str, mapping: dict | None = None):
    """A transformers KernelConfig of `mapping` (default: kernel_mapping(repo_id, revision)) that uses
    only these kernels (inherit_mapping=False)."""
    from transformers import KernelConfig

    return KernelConfig(kernel_mapping(repo_id, revision) if mapping is None else mapping, inherit_mapping=False)


def from_pretrained_on_cpu(path, config, **kwargs):
    """DeepseekV4ForCausalLM.from_pretrained(path, **kwargs) with KernelConfig `config` on CPU: transformers'
    registrations of the layouts and fusions, the load, then kernelize for "cpu" (a mapped layer that
    cannot load raises; unmapped hub layers keep their forward)."""
    _require_version("kernels", KERNELS_VERSION)
    from kernels import KernelizeFallback, LayerRepository, Mode, kernelize, use_kernel_mapping
    from transformers import AutoConfig, DeepseekV4ForCausalLM
    from transformers.integrations.hub_kernels import register_kernel_replacements_and_fusions

    register_kernel_replacements_and_fusions(DeepseekV4ForCausalLM, AutoConfig.from_pretrained(path), config)
    model = DeepseekV4ForCausalLM.from_pretrained(path, **kwargs)
    mapping = {}
    for name, (repo_layer, meta) in config.kernel_mapping.items():
        repo_id, _, layer = repo_layer.partition(":")
        mapping[name] = {"cpu": {Mode.INFERENCE: LayerRepository(repo_id, layer_name=layer, **meta)}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE, device="cpu", use_fallback=KernelizeFallback.NO_LAYER)
    return model


def forget_kernel_config() -> None:
    """Remove what loads with this module's KernelConfigs left in transformers' process-global
    registries: the layout / fused-parent class patches and the layouts' checkpoint renames for
    deepseek_v4. Later loads without a KernelConfig build transformers' own modules again."""
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )
    from transformers.monkey_patching import get_patch_mapping, unregister_patch_mapping

    from .hf_layers import HyperConnectionNormLayout, RMSNormScaleLayout

    ours = [key for key, cls in get_patch_mapping().items() if cls.__name__ in _PATCHED_CLASS_NAMES]
    if ours:
        unregister_patch_mapping(ours)
    renames = {_transform_signature(t) for layout in (RMSNormScaleLayout, HyperConnectionNormLayout)
               for t in layout.conversion_mapping}
    transforms = get_checkpoint_conversion_mapping("deepseek_v4") or []
    register_checkpoint_conversion_mapping(
        "deepseek_v4", [t for t in transforms if _transform_signature(t) not in renames], overwrite=True)


def _transform_signature(transform) -> tuple:
    return (type(transform).__name__, tuple(transform._original_source_patterns),
            tuple(transform._original_target_patterns))
