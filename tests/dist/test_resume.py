"""Resume: a run stopped after step 3 and resumed continues bit-identically (fp32, gloo, ep=2 + FSDP)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.checkpoint import ResumeError
from runtime.config import load_config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
from runtime.train import train

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe.yaml"


class Stop(Exception):
    pass


def config(out: str, **extra):
    overrides = {"data.seq_len": 64, "train.micro_batch_size": 1, "optim.warmup_steps": 2, "train.max_steps": 6,
                 "checkpoint.every_n_steps": 3, "train.output_dir": out, "logging.progress_bar": False,
                 "parallelism.dp_shard": -1, **extra}
    return load_config(EXAMPLE, overrides)


def _run(rank, world_size, out, ep, stop_at, resume):
    cfg = config(out, **{"parallelism.ep": ep})
    dims = ParallelDims.resolve(1, -1, 1, ep, world_size)
    env = DistEnv(rank, world_size, 0, torch.device("cpu"))
    seen = {"n": 0}

    def crash_at_step(model):
        seen["n"] += 1
        if stop_at and seen["n"] == stop_at:
            raise Stop
    try:
        records = train(cfg, env, dims, dims.build_meshes("cpu"), resume=resume, on_grads=crash_at_step)
    except Stop:
        return None
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records]


def test_resume_is_bit_identical(run_dist, tmp_path):
    full = run_dist(_run, 2, str(tmp_path / "a"), 2, 0, False)[0]
    run_dist(_run, 2, str(tmp_path / "b"), 2, 4, False)  # dies in step 4, after the step-3 checkpoint
    assert (tmp_path / "b" / "checkpoints" / "step_00000003").is_dir()
    assert not list((tmp_path / "b" / "checkpoints").glob(".tmp-*"))
    resumed = run_dist(_run, 2, str(tmp_path / "b"), 2, 0, True)[0]
    assert [r[0] for r in resumed] == [4, 5, 6]
    assert resumed == full[3:], (resumed, full[3:])


def test_resume_from_another_model_fails_clearly(tmp_path):
    env = DistEnv(0, 1, 0, torch.device("cpu"))
    dims = ParallelDims(1, 1, 1, 1, 1)
    train(config(str(tmp_path), **{"train.max_steps": 3}), env, dims)
    with pytest.raises(ResumeError, match=r"different model.*\n  missing \(\d+\): .*lora_A"):
        train(config(str(tmp_path), **{"train.max_steps": 4, "lora.enabled": True}), env, dims, resume=True)
