"""Expert tensors in checkpoints: global_expert_view presents an EP rank's FSDP-sharded experts as the
global [E, ...] tensor in expert order, so DCP reloads them under any ep, efsdp, HSDP or world size."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

from moe.experts import GroupedExperts
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.state_dict import gather_full, global_expert_view

E, H, I = 6, 4, 2


def _global_EOH() -> torch.Tensor:
    return torch.arange(E * 2 * I * H, dtype=torch.float32).view(E, 2 * I, H)


def _experts(rank, world_size, dp_replicate, ep):
    dims = ParallelDims(dp_replicate, world_size // dp_replicate, 1, ep, world_size)
    meshes = dims.build_meshes("cpu")
    per_rank = E // ep
    lo = dims.ep_rank(rank) * per_rank
    experts = GroupedExperts(per_rank, H, I, expert_offset=lo)
    with torch.no_grad():
        experts.gate_up.copy_(_global_EOH()[lo:lo + per_rank])
    fully_shard(experts, mesh=meshes.expert_fsdp)
    return experts, meshes


def _save(rank, world_size, path, dp_replicate, ep):
    experts, _ = _experts(rank, world_size, dp_replicate, ep)
    view = global_expert_view(experts.gate_up)
    assert view.shape == (E, 2 * I, H)
    dcp.save({"gate_up": view}, checkpoint_id=path)


def _load(rank, world_size, path, dp_replicate, ep):
    experts, meshes = _experts(rank, world_size, dp_replicate, ep)
    with torch.no_grad():
        experts.gate_up.to_local().zero_()
    dcp.load({"gate_up": global_expert_view(experts.gate_up)}, checkpoint_id=path)
    return gather_full(experts.gate_up, expert=True, meshes=meshes)


def test_experts_reload_under_any_layout(run_dist, tmp_path):
    path = str(tmp_path / "ckpt")
    run_dist(_save, 4, path, 1, 2)  # ep 2 x efsdp 2, 3 experts per EP rank: an uneven FSDP split
    for world_size, dp_replicate, ep in ((4, 2, 2), (3, 1, 3), (2, 1, 1)):  # HSDP; ep 3; no EP
        for full in run_dist(_load, world_size, path, dp_replicate, ep):
            assert torch.equal(full, _global_EOH()), (world_size, dp_replicate, ep)
    whole = {"gate_up": torch.zeros(E, 2 * I, H)}
    dcp.load(whole, checkpoint_id=path)  # one process, plain tensors
    assert torch.equal(whole["gate_up"], _global_EOH())
