"""Full tensors from sharded state: FSDP shards gathered and, for experts, the EP ranks' slices
concatenated in global expert order. Every function here is a collective: all ranks call it, in one order."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from runtime.distributed.mesh import Meshes


def gather_full(t: torch.Tensor, expert: bool = False, meshes: Meshes | None = None) -> torch.Tensor:
    """The full tensor behind a parameter (or gradient): FSDP shards gathered, and for experts the
    EP ranks' slices concatenated in expert order. A collective: every rank calls it, in one order."""
    full = t.full_tensor() if isinstance(t, DTensor) else t
    if expert and meshes is not None and meshes.experts["ep"].size() > 1:
        parts = [torch.empty_like(full) for _ in range(meshes.experts["ep"].size())]
        dist.all_gather(parts, full.contiguous(), group=meshes.ep_group)
        full = torch.cat(parts)
    return full


def full_state_dict(model: nn.Module, meshes: Meshes | None, keep: bool = True) -> dict[str, torch.Tensor]:
    """Every entry of model.state_dict() as a full CPU tensor (collective: every rank calls it; see
    gather_full). Ranks with keep=False drop each tensor once gathered, so only the writer holds the model."""
    out = {}
    for fqn, t in model.state_dict().items():
        full = gather_full(t, ".experts." in fqn, meshes)
        if keep:
            out[fqn] = full.detach().cpu()
    return out
