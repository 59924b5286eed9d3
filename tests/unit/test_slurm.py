"""The SLURM script's logic, checked on one machine through its DRY_RUN mode."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "train.sbatch"


def dry_run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "DRY_RUN": "1", "SLURM_NNODES": "2", "SLURM_JOB_ID": "77", "HEAD_NODE": "node01",
                "GPUS_PER_NODE": "4", **env}
    return subprocess.run(["bash", str(SCRIPT), *args], env=full_env, capture_output=True, text=True, timeout=30,
                          check=False)


def test_prints_srun_torchrun_line_with_rendezvous_and_default_output_dir():
    proc = dry_run("cfg.yaml", "--ep", "8")
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("srun --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun --nnodes 2 --nproc_per_node 4")
    assert "--rdzv_backend c10d --rdzv_endpoint node01:29500 -m runtime.launch cfg.yaml --ep 8" in line
    assert line.endswith("--output-dir runs/moe-train-77")
    assert "NCCL_NVLS_ENABLE=0" in proc.stdout and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in proc.stdout


def test_user_output_dir_is_kept():
    line = dry_run("cfg.yaml", "--output-dir", "/x").stdout.strip().splitlines()[-1]
    assert line.endswith("--output-dir /x") and "runs/" not in line


def test_outside_slurm_fails_with_reason():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    proc = subprocess.run(["bash", str(SCRIPT), "cfg.yaml"], env=env, capture_output=True, text=True, timeout=30,
                          check=False)
    assert proc.returncode != 0 and "not inside a SLURM allocation" in proc.stderr


def test_no_config_prints_usage():
    proc = dry_run()
    assert proc.returncode == 2 and "usage:" in proc.stderr
