"""Runs a function in several gloo processes: the harness of the distributed tests.

    def check(rank, world_size, n):          # module-level or a closure: nothing is pickled
        ...                                  # the default process group is up (gloo, CPU)
        return some_value                    # optional; must be picklable
    results = run_dist(check, 2, 16)         # [value of rank 0, value of rank 1]

`run_dist` is a fixture returning the function, so test modules need not import this file (every
conftest.py is a module named `conftest`; importing one by name picks whichever came last).
A child that raises fails the test with the tracebacks of the failed children, the first to fail
first, and the others are killed. A collective that waits longer than `timeout_s` raises in its
child, and the parent kills every child once `timeout_s` plus a grace period has passed, so a
broken test never hangs CI.
"""

from __future__ import annotations

import datetime
import gc
import glob
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Time for the children to start and report a collective's timeout before the parent kills them.
_GRACE_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, fn: Callable, world_size: int, port: int, timeout_s: float, out_dir: str,
           args: tuple) -> None:
    # CI has 2 cores shared by all the children: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        # Rank 0 hosts the store: no rank may end (and rank 0 take the store down) while a peer still uses it,
        # e.g. to set up a process group rank 0 is not in ("Connection reset by peer" there).
        dist.barrier()
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        # Kept for the parent: the first rank to fail holds the cause, the others mostly report
        # a peer that went away.
        with open(os.path.join(out_dir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _child_failures(out_dir: str) -> str | None:
    """The tracebacks the children left, in the order they failed; None if none left one."""
    paths = sorted(glob.glob(os.path.join(out_dir, "*.err")), key=os.path.getmtime)
    if not paths:
        return None
    reports = []
    for i, path in enumerate(paths):
        rank = os.path.basename(path).removesuffix(".err")
        with open(path) as f:
            reports.append(f"-- rank {rank}{' (first to fail)' if i == 0 else ''}:\n{f.read()}")
    return "\n".join(reports)


def run_dist_processes(fn: Callable, world_size: int, *args: Any, timeout_s: float = 60) -> list[Any]:
    """fn(rank, world_size, *args) in `world_size` processes sharing a gloo group; their results."""
    with tempfile.TemporaryDirectory() as out_dir:
        # fork, not spawn: a child starts in ~0.05 s instead of the seconds of re-importing torch,
        # and fn needs no pickling. Only safe while the parent has not initialized CUDA.
        # Frozen, the parent's objects (a whole test session's modules) are skipped by the children's
        # collections (the trainer collects at start): no pass over them, no copy-on-write of their pages.
        gc.freeze()
        try:
            ctx = mp.start_processes(_child, args=(fn, world_size, free_port(), timeout_s, out_dir, args),
                                     nprocs=world_size, join=False, start_method="fork")
        finally:
            gc.unfreeze()
        deadline = time.monotonic() + timeout_s + _GRACE_S
        try:
            while not ctx.join(timeout=0.1):  # raises once a child has failed, killing the others
                if time.monotonic() > deadline:
                    for process in ctx.processes:
                        process.kill()
                    raise TimeoutError(f"run_dist({getattr(fn, '__name__', fn)}, world_size={world_size}) "
                                       f"did not finish within {timeout_s + _GRACE_S:.0f} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            failures = _child_failures(out_dir)
            if failures is None:  # killed by a signal before it could write its traceback
                raise
            raise RuntimeError(f"a child of run_dist failed\n{failures}") from None
        return [torch.load(os.path.join(out_dir, f"{rank}.pt"), weights_only=False)
                for rank in range(world_size)]


@pytest.fixture
def run_dist() -> Callable[..., list[Any]]:
    return run_dist_processes
