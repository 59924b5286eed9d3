"""ParallelDims and the DeviceMesh views a training run needs.

    world = dp_replicate * dp_shard * cp
    dense params: FSDP over dp_shard*cp ("dp_shard_cp"), replicated over dp_replicate (HSDP)
    experts:      split over ep (carved out of dp_shard*cp, consecutive ranks so EP stays intra-node),
                  FSDP over efsdp = dp_shard*cp / ep, replicated over dp_replicate
    data:         one slice per (dp_replicate, dp_shard) coordinate; cp ranks share their slice
Every check runs in `ParallelDims.__post_init__`, before any process group exists.
`expert_order_view` reorders the expert mesh ep major, the order of global expert indices.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class MeshError(ValueError):
    """Parallel sizes that cannot form a mesh; the message names the flags to change."""


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    world_size: int

    def __post_init__(self):
        for name in ("dp_replicate", "dp_shard", "cp", "ep", "world_size"):
            if getattr(self, name) < 1:
                raise MeshError(f"{name} must be >= 1, got {getattr(self, name)} (flag --{name.replace('_', '-')})")
        product = self.dp_replicate * self.dp_shard * self.cp
        if product != self.world_size:
            raise MeshError(f"dp_replicate*dp_shard*cp = {self.dp_replicate}*{self.dp_shard}*{self.cp} = {product} "
                            f"but the world size is {self.world_size}; change --dp-shard/--dp-replicate/--cp "
                            "(or set dp_shard: -1 to fill the world)")
        if (self.dp_shard * self.cp) % self.ep:
            raise MeshError(f"ep={self.ep} must divide dp_shard*cp = {self.dp_shard * self.cp}: experts are "
                            "carved out of the FSDP ranks; change --ep or --dp-shard")

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int, cp: int, ep: int, world_size: int) -> ParallelDims:
        """dp_shard=-1 takes whatever world_size leaves after dp_replicate and cp."""
        if dp_shard == -1:
            if world_size % (dp_replicate * cp):
                raise MeshError(f"world size {world_size} is not divisible by dp_replicate*cp = {dp_replicate * cp}")
            dp_shard = world_size // (dp_replicate * cp)
        return cls(dp_replicate, dp_shard, cp, ep, world_size)

    def check_experts(self, num_experts: int) -> None:
        if num_experts and num_experts % self.ep:
            raise MeshError(f"ep={self.ep} must divide the number of experts ({num_experts}); change --ep")

    @property
    def efsdp(self) -> int:
        return self.dp_shard * self.cp // self.ep

    @property
    def dp_world(self) -> int:
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """Data slice of a global rank: ranks differing only in their cp coordinate share it."""
        return rank // self.cp

    def ep_rank(self, rank: int) -> int:
        """Position in the EP group: EP groups are runs of `ep` consecutive ranks."""
        return rank % self.ep

    def build_meshes(self, device_type: str) -> Meshes:
        world = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.cp),
                                 mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
        dense = world[("dp_shard", "cp")]._flatten("dp_shard_cp")
        dense = world["dp_replicate", "dp_shard_cp"] if self.dp_replicate > 1 else dense
        experts = init_device_mesh(device_type, (self.dp_replicate, self.efsdp, self.ep),
                                   mesh_dim_names=("dp_replicate", "efsdp", "ep"))
        return Meshes(world=world, dense=dense, experts=experts)


@dataclass
class Meshes:
    world: DeviceMesh    # (dp_replicate, dp_shard, cp)
    dense: DeviceMesh    # FSDP mesh of dense params: (dp_shard_cp) or (dp_replicate, dp_shard_cp)
    experts: DeviceMesh  # (dp_replicate, efsdp, ep)

    @property
    def ep_group(self):
        return self.experts.get_group("ep")

    @property
    def expert_fsdp(self) -> DeviceMesh:
        return self.experts["dp_replicate", "efsdp"] if self.experts["dp_replicate"].size() > 1 \
            else self.experts["efsdp"]


def expert_order_view(experts: DeviceMesh) -> DeviceMesh:
    """The expert mesh (dp_replicate, efsdp, ep) with its dims ordered (dp_replicate, ep, efsdp): a
    tensor sharded on dim 0 over (ep, efsdp) then follows global expert order. It describes placement
    only (no process groups of its own): DCP reads this rank's coordinates from it."""
    if experts.mesh_dim_names != ("dp_replicate", "efsdp", "ep"):
        raise ValueError(f"not the expert mesh of ParallelDims.build_meshes: dims {experts.mesh_dim_names}")
    return DeviceMesh(experts.device_type, experts.mesh.permute(0, 2, 1),
                      mesh_dim_names=("dp_replicate", "ep", "efsdp"), _init_backend=False)
