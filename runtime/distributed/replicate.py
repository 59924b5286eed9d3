"""Trainable parameters kept whole on every rank, their gradients summed over the world after backward.

Contract
    grads = ReplicatedGrads(params)   # parameters every rank holds whole and computes a partial gradient of
    grads.all_reduce()                # after the step's last backward: each .grad becomes the sum over the ranks

Where: LoRA with parallelism.frozen_dense replicate and no expert unit left to shard (a model without experts, or
every expert alone on its FSDP mesh: ep = the world). There FSDP's one remaining unit would only gather the trainable factors before
forward and reduce-scatter them per micro-batch; instead nothing is gathered, gradients accumulate locally over
the micro-batches, and one all-reduce per dtype sums them, on the current stream and with no hook, so the
step's only collectives are ones it issues itself.

Sums, not means: the loss is divided by the global label-token count (runtime.step), as FSDP's reductions are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class ReplicatedGrads:
    """The gradients of `params` (whole on every rank, of every rank's partial gradient) summed over the world."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params

    def all_reduce(self) -> None:
        """One all-reduce of a flat buffer per dtype. A parameter without a gradient gets zeros first: every rank
        must contribute the same sizes in the same order."""
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for params in by_dtype.values():
            grads = [p.grad for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            torch._foreach_copy_(grads, [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]),
                                                                            grads)])
