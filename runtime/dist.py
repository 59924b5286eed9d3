"""Process-group setup: the rank/world/device of this process under torchrun or as a plain process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) for a plain process."""
    return (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
            int(os.environ.get("LOCAL_RANK", "0")))


def init_distributed(timeout_s: int = 600) -> DistEnv:
    """gloo on CPU, NCCL on CUDA; a plain single process gets no process group at all."""
    rank, world, local_rank = env_world()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return DistEnv(rank, world, local_rank, device)


def all_reduce_sum(value: float, env: DistEnv) -> float:
    """Sum over the ranks of this run (a run of world size 1 never communicates, even when a process
    group exists, as in runtime.verify's single-process reference)."""
    if env.world_size == 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return float(t.item())
