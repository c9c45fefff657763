"""Layer kernels for torch models built from transformers classes: `kernels.kernelize` over the kernel layers
of the kernel source (engine.kernel_source).

kernelize(model, device=..., mode=Mode.INFERENCE) maps every kernel layer of the source -- a class that
follows the `kernels` library's layer rules (an nn.Module subclass without `__init__`), under its own
name, which is the hub layer name transformers gives the modules it replaces (e.g. "RMSNorm" for
DeepseekV4RMSNorm) -- for the given device type and mode, and calls kernels.kernelize(model, mode=mode,
device=device, use_fallback=...) with only that mapping (transformers' own default mapping is not
inherited). The layers:
- DEEPINFER_KERNEL_SOURCE=native: this package's (engine/integrations/*_layers.py);
- hub: the `layers` module of the verified kernel (engine.kernel_source.loaded_kernel()); a kernel that
  cannot be used, or has no `layers`, falls back to this package's layers (counted per layer name in
  engine.kernel_source.fallback_counts() as "layer <name>", once per module that has that name) or,
  under DEEPINFER_OPS_STRICT=1, raises.
Fallbacks: strict (DEEPINFER_OPS_STRICT=1) is KernelizeFallback.NO_LAYER: a module whose hub layer name
is not mapped keeps its forward (e.g. DeepSeek-V4's "SiLU"), a mapped layer that cannot load raises;
otherwise KernelizeFallback.ALL. `kernels` checks each layer class against the forward it replaces
(same number and kind of arguments, no members of its own) when it first binds it.

Needs the `kernels` package (imported here, on call) and transformers' hub layer names, which
transformers sets only when it accepts the installed kernels (5.18-5.21.x for kernels 0.17.x).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from . import config, kernel_source


@dataclass(frozen=True)
class _LayerClass:
    """kernels' repository protocol over a layer class already imported (from the verified kernel, or
    this package): load() returns it, nothing is resolved or downloaded again."""
    layer_name: str
    cls: type
    origin: str

    def load(self) -> type:
        return self.cls

    def __str__(self) -> str:
        return f"{self.origin}, layer `{self.layer_name}`"


def kernel_layers(module: ModuleType) -> dict[str, type]:
    """The kernel layers a module exports (its __all__): nn.Module subclasses without an __init__ of their own."""
    found = {}
    for name in getattr(module, "__all__", ()):
        obj = getattr(module, name)
        if inspect.isclass(obj) and issubclass(obj, nn.Module) and obj.__init__ is nn.Module.__init__:
            found[name] = obj
    return found


def native_layers() -> dict[str, type]:
    """This package's kernel layers: every engine/integrations/*_layers.py (what a built repository's
    `layers` module re-exports)."""
    from . import integrations

    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(integrations.__path__):
        if info.name.endswith("_layers"):
            found.update(kernel_layers(importlib.import_module(f"{integrations.__name__}.{info.name}")))
    return found


def kernelize(model: nn.Module, *, device: str | torch.device, mode=None) -> nn.Module:
    """kernels.kernelize(model) with the kernel source's layers (module docstring); returns the model.
    device: the device type the model runs on ("cuda", "cpu", or a torch.device), given explicitly;
    mode: a kernels.Mode (default Mode.INFERENCE)."""
    from kernels import KernelizeFallback, Mode, kernelize as kernels_kernelize, use_kernel_mapping

    mode = Mode.INFERENCE if mode is None else mode
    device_type = device.type if isinstance(device, torch.device) else str(device)
    strict = config.ops_strict()
    kernel = kernel_source.loaded_kernel()  # raises under strict when the hub kernel cannot be used
    hub_layers = getattr(kernel.module, "layers", None) if kernel is not None else None
    if hub_layers is not None:
        layers, origin = kernel_layers(hub_layers), kernel.describe()
    else:
        layers, origin = native_layers(), "engine (native)"
        if config.kernel_source_settings().source == "hub":
            if kernel is not None and strict:
                raise kernel_source.KernelSourceError(f"kernel {kernel.describe()} has no `layers` module, "
                                                      "and DEEPINFER_OPS_STRICT=1")
            for m in model.modules():  # the hub kernel (or its layers) missing: this package's layers, counted
                name = getattr(type(m), "kernel_layer_name", None)
                if name in layers:
                    kernel_source.count_fallback(f"layer {name}")
    mapping = {name: {device_type: {mode: _LayerClass(name, cls, origin)}} for name, cls in layers.items()}
    fallback = KernelizeFallback.NO_LAYER if strict else KernelizeFallback.ALL
    with use_kernel_mapping(mapping, inherit_mapping=False):
        return kernels_kernelize(model, mode=mode, device=device_type, use_fallback=fallback)
