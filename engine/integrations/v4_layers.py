"""Kernel layers for transformers' DeepSeek-V4 modules as transformers builds them (same parameters, same
layout), under the hub layer names transformers gives those modules (`use_kernel_forward_from_hub`).

The `kernels` library's layer rules: an nn.Module subclass without `__init__` and without members of its
own, whose stateless `forward` has the signature of the forward it replaces; kernelize binds that forward
to each module of the model, so `self` is transformers' module and the layer reads its attributes.

- RMSNorm replaces DeepseekV4RMSNorm.forward (hub layer name "RMSNorm"; reads `weight` and
  `variance_epsilon`) with engine.ops.rms_norm: DeepSeek-V4's numerics (fp32 statistics, the weight
  multiplied in fp32, one cast), by DEEPINFER_KERNELS (Triton: its own reduction order; ref: bit-equal to
  transformers' forward). Other models' RMSNorm classes share the hub name "RMSNorm" and some cast before
  multiplying: this layer is for DeepSeek-V4 models.

This module is copied into the kernel repository's package (scripts/build_kernel_repo.py), so its
imports are relative.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops


class RMSNorm(nn.Module):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


__all__ = ["RMSNorm"]
