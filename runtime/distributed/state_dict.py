"""Sharded state as whole tensors, and expert state addressed by global expert index.

Expert parameters are the parameters of a `GroupedExperts` (`is_expert_param`); their dim 0 is the
expert. Under EP each rank holds a contiguous slice of the experts (`GroupedExperts.expert_offset`),
FSDP-sharded over efsdp, so the DTensor FSDP makes of it has the *local* expert count as its global
shape. `global_expert_view` presents the same storage as a DTensor of the global shape [E, ...],
sharded over (ep, efsdp) in expert order: DCP then writes global offsets, and a checkpoint loads
under any ep and world size.

gather_full and full_state_dict are collectives: every rank calls them, in one order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from moe.experts import GroupedExperts
from runtime.distributed.mesh import Meshes, expert_order_view


def is_expert_param(model: nn.Module, fqn: str) -> bool:
    """Whether `fqn` (a parameter, gradient or optimizer-state name in `model`) belongs to a
    GroupedExperts, i.e. its dim 0 indexes experts."""
    owner, _, _ = fqn.rpartition(".")
    try:
        return isinstance(model.get_submodule(owner), GroupedExperts)
    except AttributeError:
        return False


def global_expert_view(t: torch.Tensor) -> torch.Tensor:
    """An expert tensor [E_local, ...] of this EP rank as a DTensor of the global shape [E, ...],
    placed Shard(0) over ep then over efsdp (ep major: global expert order), sharing t's storage.
    Tensors that are not split over an EP mesh already have the global shape and come back as is."""
    if not isinstance(t, DTensor):
        return t
    experts = t.device_mesh._get_root_mesh()
    if "ep" not in (experts.mesh_dim_names or ()):
        return t
    ep = experts["ep"].size()
    # FSDP2 shards experts over (dp_replicate,) efsdp with Shard(0) on efsdp, replicas on dp_replicate.
    mesh = expert_order_view(experts)
    shape = torch.Size((t.shape[0] * ep, *t.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(t.to_local(), mesh, (Replicate(), Shard(0), Shard(0)), run_check=False,
                              shape=shape, stride=stride)


def gather_full(t: torch.Tensor, expert: bool = False, meshes: Meshes | None = None) -> torch.Tensor:
    """The full tensor behind a parameter (or gradient): FSDP shards gathered, and for experts the
    EP ranks' slices concatenated in expert order."""
    full = t.full_tensor() if isinstance(t, DTensor) else t
    if expert and meshes is not None and meshes.experts["ep"].size() > 1:
        parts = [torch.empty_like(full) for _ in range(meshes.experts["ep"].size())]
        dist.all_gather(parts, full.contiguous(), group=meshes.ep_group)
        full = torch.cat(parts)
    return full


def full_state_dict(model: nn.Module, meshes: Meshes | None, keep: bool = True) -> dict[str, torch.Tensor]:
    """Every entry of model.state_dict() as a full CPU tensor (see gather_full). Ranks with keep=False
    drop each tensor once gathered, so only the writer holds the model."""
    out = {}
    for fqn, t in model.state_dict().items():
        full = gather_full(t, is_expert_param(model, fqn), meshes)
        if keep:
            out[fqn] = full.detach().cpu()
    return out
