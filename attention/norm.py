"""RMSNorm as Qwen models define it: fp32 math, weight applied after casting back to the input dtype.

`unit_offset=True` is the Qwen3.5 / Qwen3-Next form: the weight is stored as w and applied as (1 + w).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            nn.init.zeros_(self.weight) if self.unit_offset else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # attention.norm_rope.rms_norm_reference's math and cast order; F.rms_norm is one fused kernel on CUDA
        # for the fp32 normalization, forward and backward, where pow / mean / rsqrt / mul are four passes
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return (self.weight * normed.to(x.dtype)).to(x.dtype)
