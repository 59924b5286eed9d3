"""optim.master_dtype: bf16 under FSDP2 + EP on 2 gloo ranks: bf16 DTensor parameters and optimizer states,
and a run stopped after its step-2 checkpoint resumes to the uninterrupted run's losses (DCP restores the
bf16 AdamW states and the RNG state its stochastic rounding draws from)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from runtime.config import load_config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
from runtime.train import train
from tests.conftest import small_chat_data

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe.yaml"


class Stop(Exception):
    pass


def _run(rank, world_size, out, stop_at, resume):
    overrides = {"data.seq_len": 64, "train.micro_batch_size": 1, "optim.warmup_steps": 1, "train.max_steps": 4,
                 "checkpoint.every_n_steps": 2, "train.output_dir": out, "logging.progress_bar": False,
                 "parallelism.dp_shard": -1, "parallelism.ep": 2, "optim.master_dtype": "bf16",
                 "data.path": small_chat_data()}
    cfg = load_config(EXAMPLE, overrides)
    dims = ParallelDims.resolve(1, -1, 1, 2, world_size)
    env = DistEnv(rank, world_size, 0, torch.device("cpu"))
    seen = {"n": 0, "kinds": set()}

    def on_grads(model):
        seen["n"] += 1
        seen["kinds"] |= {(type(t).__name__, t.dtype) for p in model.parameters() for t in (p, p.grad)}
        if stop_at and seen["n"] == stop_at:
            raise Stop

    try:
        records = train(cfg, env, dims, dims.build_meshes("cpu"), resume=resume, on_grads=on_grads)
    except Stop:
        return None
    assert seen["kinds"] == {("DTensor", torch.bfloat16)}, seen["kinds"]  # FSDP2/EP shards, grads too
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records]


def _saved_dtypes(checkpoint: Path) -> dict[str, set]:
    """{"model": dtypes of the weights, "exp_avg": ..., "exp_avg_sq": ..., "step": ...} as DCP saved them."""
    meta = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    dtypes = {}
    for key, value in meta.items():
        if key.startswith(("model.", "optim.state.")):
            kind = "model" if key.startswith("model.") else key.rsplit(".", 1)[1]
            dtypes.setdefault(kind, set()).add(value.properties.dtype)
    return dtypes


def test_bf16_masters_train_and_resume_under_fsdp2_and_ep(run_dist, tmp_path):
    full = run_dist(_run, 2, str(tmp_path / "a"), 0, False, timeout_s=240)[0]
    run_dist(_run, 2, str(tmp_path / "b"), 3, False, timeout_s=240)  # dies in step 3, after the step-2 checkpoint
    checkpoint = tmp_path / "b" / "checkpoints" / "step_00000002"
    bf16 = {torch.bfloat16}
    assert _saved_dtypes(checkpoint) == {"model": bf16, "exp_avg": bf16, "exp_avg_sq": bf16, "step": {torch.float32}}
    resumed = run_dist(_run, 2, str(tmp_path / "b"), 0, True, timeout_s=240)[0]
    assert [r[0] for r in resumed] == [3, 4]
    assert resumed == full[2:], (resumed, full[2:])
    assert full[-1][1] < full[0][1]  # it trains
