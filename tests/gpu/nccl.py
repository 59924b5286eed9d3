"""Runs a check on `world` local GPUs, one spawned process per rank over NCCL, and gathers its results.

    results = spawn(check, world)   # check(rank, world) -> picklable; results[rank]

A failing rank's traceback comes back as the RuntimeError's message.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _child(rank: int, world: int, port: int, out_dir: str, check: Callable[[int, int], object]) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", rank))
    try:
        torch.save(check(rank, world), os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def spawn(check: Callable[[int, int], object], world: int) -> list:
    """check(rank, world) on every rank (a module-level function: it travels by name)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_child, args=(world, port, out_dir, check), nprocs=world, join=True,
                               start_method="spawn")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            errs = sorted(f for f in os.listdir(out_dir) if f.endswith(".err"))
            raise RuntimeError("\n".join(Path(out_dir, f).read_text() for f in errs) or "a child failed") from None
        return [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(world)]
