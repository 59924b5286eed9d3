"""SIGTERM to one rank of two while it writes a checkpoint (issue 41): rank 0, waiting in the save's barrier,
sees gloo's "Connection closed by peer" and must report the interrupt (step, last checkpoint, command), not an
internal error. Two real processes, a real gloo group and its store, a real signal; rank 1 sits in a Python
write loop (where a save spends its time) when the signal comes, so the order of events is fixed."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.conftest import Forked
from tests.dist.conftest import free_port

RANK = r'''
import datetime, os, sys, time
import torch.distributed as dist
from runtime.guard.failure_report import guarded_main
from runtime.guard.failures import RunContext

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
context = RunContext(["cfg.yaml"], output_dir=out)
context.progress.step, context.progress.training = 3, True

def save(_context):
    dist.barrier()  # both ranks connected
    if rank == 1:
        print("writing", flush=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the Python part of a checkpoint write
            time.sleep(0.01)
    dist.barrier()  # rank 0 waits here for rank 1 to finish writing
    return 0

sys.exit(guarded_main(save, context))
'''


def _rank(rank: int, port: str, out: Path, tmp_path: Path) -> Forked:
    """RANK as `python -c RANK rank port out` with RANK and WORLD_SIZE set, in a child forked from this process
    (tests.conftest.Forked: a process of its own, without a Python start)."""
    setup = (f"import os, sys\nos.environ.update(RANK='{rank}', WORLD_SIZE='2')\n"
             "os.environ.pop('TORCHELASTIC_RUN_ID', None)\n"
             f"sys.argv = ['-c', '{rank}', '{port}', {str(out)!r}]\n")
    return Forked(setup + RANK, tmp_path / f"stderr{rank}.txt", stdout_path=tmp_path / f"stdout{rank}.txt")


def test_sigterm_to_one_rank_mid_save_is_reported_as_the_interrupt(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "step_00000002").mkdir(parents=True)
    port = str(free_port())
    ranks = [_rank(r, port, out, tmp_path) for r in range(2)]
    try:
        deadline = time.monotonic() + 60
        while ranks[1].stdout_path.read_text().strip() != "writing":
            assert ranks[1].poll() is None and time.monotonic() < deadline, ranks[1].stderr_path.read_text()
            time.sleep(0.05)
        ranks[1].send_signal(signal.SIGTERM)
        _, err1 = ranks[1].communicate(timeout=60)
        _, err0 = ranks[0].communicate(timeout=60)
    finally:
        for proc in ranks:
            proc.kill()
    expected = (f"interrupted at step 3 (SIGTERM); the last checkpoint is {out}/checkpoints/step_00000002; "
                f"continue with: python -m runtime.launch cfg.yaml --resume")
    assert err0.splitlines() == [expected], err0
    assert ranks[0].returncode == 128 + signal.SIGTERM
    assert (ranks[1].returncode, err1) == (128 + signal.SIGTERM, ""), err1  # rank 0 speaks for it
