"""RMSNorm as Qwen models define it: fp32 math, weight applied after casting back to the input dtype.

`unit_offset=True` is the Qwen3.5 / Qwen3-Next form: the weight is stored as w and applied as (1 + w).
"""

from __future__ import annotations

import torch
from torch import nn

from attention.norm_rope import rms_norm_reference


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
        return rms_norm_reference(x, self.weight, self.eps, self.unit_offset)
