"""SIGTERM to one rank of two while it writes a checkpoint (issue 41): rank 0, waiting in the save's barrier,
sees gloo's "Connection closed by peer" and must report the interrupt (step, last checkpoint, command), not an
internal error. Two real processes, a real gloo group and its store, a real signal; rank 1 sits in a Python
write loop (where a save spends its time) when the signal comes, so the order of events is fixed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.dist.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]

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


def test_sigterm_to_one_rank_mid_save_is_reported_as_the_interrupt(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "step_00000002").mkdir(parents=True)
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), port, str(out)], cwd=tmp_path,
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        assert ranks[1].stdout.readline().strip() == "writing", ranks[1].communicate(timeout=60)
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
