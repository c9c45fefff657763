"""What every attention entry point returns."""

from typing import NamedTuple

import torch


class AttentionOutput(NamedTuple):
    out: torch.Tensor  # [..., h_q, 512] in q's dtype; 0 for a query without a valid entry
    lse_log2: torch.Tensor  # [..., h_q] fp32, log2 of the softmax denominator (sink excluded); +inf when empty
