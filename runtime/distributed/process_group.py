"""Process-group setup: the rank/world/device of this process under torchrun or as a plain process.

No silent hangs: `init_distributed(timeout_s)` takes parallelism.collective_timeout_s. With more than
one rank it starts the watchdog (watchdog.py), which ends every rank within about timeout_s when one
rank stops responding, naming it; a collective that waits longer than timeout_s + collective_grace(timeout_s)
raises, and `collective_error_message` says that in one line naming the key. A failure handler calls
`defer_to_watchdog()` first: an error that is the echo of a stall already named ends there, quietly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from runtime.distributed.watchdog import TIMEOUT_KEY, Watchdog, collective_grace

# The timeout the process group was made with, for collective_error_message; None: no group made here.
_timeout_s: float | None = None
_watchdog: Watchdog | None = None


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
    """gloo on CPU, NCCL on CUDA; a plain single process gets no process group at all.

    `timeout_s` is parallelism.collective_timeout_s (600 s is its default). When this call creates
    the process group (world > 1), the watchdog starts: a rank silent for timeout_s ends every rank.
    Collectives wait timeout_s + collective_grace(timeout_s) before the backend raises: the few
    heartbeats more let the watchdog, which names the frozen rank, act first; a collective that
    still times out has live ranks out of step (see collective_error_message).
    """
    global _timeout_s, _watchdog
    rank, world, local_rank = env_world()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s + collective_grace(timeout_s)),
                                device_id=device if device.type == "cuda" else None)
        _timeout_s = float(timeout_s)
        if _watchdog is None:  # one per process: a second would beat under the same key
            # env:// (the default init above) rendezvoused on this store, so both are set.
            _watchdog = Watchdog(rank, world, timeout_s, os.environ["MASTER_ADDR"],
                                 int(os.environ["MASTER_PORT"])).start()
    return DistEnv(rank, world, local_rank, device)


def defer_to_watchdog(wait_s: float = 1.0) -> None:
    """For a failure handler, before it reports anything: when the watchdog of some rank has already
    named a stalled rank, the error being handled is that stall's echo (a collective broken by the
    exit of the rank that found it), and this process ends inside this call with the watchdog's exit
    code, quietly (rank 0 repeats the line). A store that stopped answering ends it the same way, on the
    watchdog's own verdict (a peer's exit on that verdict broke this collective). Otherwise it returns
    within wait_s (a store round takes milliseconds) and the error is this process's to report. A no-op
    without a watchdog."""
    if _watchdog is not None:
        _watchdog.check_now(wait_s)


def collective_error_message(err: BaseException) -> str | None:
    """One line for a collective that timed out, naming the config key; None for any other error.

    The watchdog has not fired, so every rank still beats: the ranks are out of step rather than
    frozen (one in a long phase without collectives, or ranks calling different collectives)."""
    text = str(err)
    if _timeout_s is None or not isinstance(err, RuntimeError) or "timed out" not in text.lower():
        return None
    # gloo's message starts with "[<source path>:<line>] "; keep what follows, first line only.
    detail = text.strip().splitlines()[0].split("] ", 1)[-1]
    waited = _timeout_s + collective_grace(_timeout_s)
    return (f"a collective waited longer than {waited:g} s ({TIMEOUT_KEY}={_timeout_s:g} plus "
            f"{collective_grace(_timeout_s):g} s of watchdog grace) while every rank still answered its "
            "heartbeat: the ranks are out of step (one in a long phase without collectives, or ranks calling "
            f"different collectives); raise {TIMEOUT_KEY} if such a phase legitimately takes longer "
            f"({detail})")


def all_reduce_sum(value: float, env: DistEnv) -> float:
    """Sum over the ranks of this run (a run of world size 1 never communicates, even when a process
    group exists, as in runtime.verify's single-process reference)."""
    return all_reduce_sums([value], env)[0]


def all_reduce_sums(values: list[float], env: DistEnv) -> list[float]:
    """all_reduce_sum of several numbers in one collective."""
    if env.world_size == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return t.tolist()
