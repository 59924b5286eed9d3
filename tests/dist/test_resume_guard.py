"""Resume refusals (issue 41): a checkpoint folder missing one rank's shard is reported as incomplete, with the
older checkpoint to resume from (real gloo ranks, real DCP files); a config that defines another model than the
run folder's is refused, naming the keys, unless checkpoint.resume_allow_model_change says it is intended."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.checkpoint import ResumeError, model_changes
from runtime.config import load_config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
from runtime.guard.failures import RunContext, describe
from runtime.train import train
from tests.conftest import small_chat_data

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe.yaml"


def config(out: str, **extra):
    overrides = {"data.seq_len": 64, "train.micro_batch_size": 1, "optim.warmup_steps": 0, "train.max_steps": 2,
                 "checkpoint.every_n_steps": 1, "train.output_dir": out, "logging.progress_bar": False,
                 "parallelism.dp_shard": -1, "data.path": small_chat_data(), **extra}
    return load_config(EXAMPLE, overrides)


def _train_and_describe(rank, world_size, out, steps, resume):
    """Trains on this rank; the failure line describe() makes of what it raised, or None."""
    cfg = config(out, **{"train.max_steps": steps})
    dims = ParallelDims.resolve(1, -1, 1, 1, world_size)
    env = DistEnv(rank, world_size, 0, torch.device("cpu"))
    context = RunContext(["cfg.yaml"], output_dir=out)
    try:
        train(cfg, env, dims, dims.build_meshes("cpu"), resume=resume, progress=context.progress)
    except BaseException as err:  # noqa: BLE001  (CheckpointException is no Exception)
        failure = describe(err, context)
        return failure.kind, failure.line
    return None


def test_resume_with_a_deleted_shard_says_the_checkpoint_is_incomplete(run_dist, tmp_path):
    out = str(tmp_path / "run")
    assert run_dist(_train_and_describe, 2, out, 2, False) == [None, None]
    newest = tmp_path / "run" / "checkpoints" / "step_00000002"
    (newest / "__1_0.distcp").unlink()
    results = run_dist(_train_and_describe, 2, out, 3, True)
    for kind, line in results:  # every rank holds every rank's DCP failure: each describes it alike
        assert kind == "user", line
        assert line.startswith(f"error: checkpoint {newest} is unreadable ("), line
        assert "__1_0.distcp is missing" in line, line
        assert line.endswith(f"; delete it (or move it out of {newest.parent}) to resume from step_00000001"), line
        assert "check the path in the config" not in line


def test_resume_with_another_model_definition_is_refused(tmp_path, caplog):
    out = str(tmp_path / "run")
    env, dims = DistEnv(0, 1, 0, torch.device("cpu")), ParallelDims(1, 1, 1, 1, 1)
    train(config(out, **{"train.max_steps": 1}), env, dims)
    saved = (tmp_path / "run" / "config.yaml").read_bytes()
    changed = {"model.config.num_experts_per_tok": 4}  # same tensor shapes: a shape check alone trains on
    with pytest.raises(ResumeError) as caught:
        train(config(out, **changed), env, dims, resume=True)
    line = describe(caught.value, RunContext()).line
    assert line == (f"error: the config defines a different model than the one {out} was trained with "
                    f"(model.config.num_experts_per_tok: 2 -> 4; saved in {out}/config.yaml); restore those keys, "
                    "start a new run with a new train.output_dir, or set checkpoint.resume_allow_model_change: true "
                    "if the change is intended")
    assert (tmp_path / "run" / "config.yaml").read_bytes() == saved  # the run's record is kept
    assert not (tmp_path / "run" / "checkpoints" / "step_00000002").exists()
    # An implementation choice is no model change.
    assert [r["step"] for r in train(config(out, **{"model.expert_backend": "eager"}), env, dims, resume=True)] == [2]
    allowed = {**changed, "checkpoint.resume_allow_model_change": True, "train.max_steps": 3}
    assert [r["step"] for r in train(config(out, **allowed), env, dims, resume=True)] == [3]
    assert "model.config.num_experts_per_tok: 2 -> 4" in caplog.text


def test_model_changes_names_lora_and_quant_keys():
    base = {"model": {"path": "/m", "config": None, "num_layers_override": None, "expert_backend": "auto"},
            "lora": {"enabled": False, "rank": 16, "alpha": 32.0, "target_modules": ["q_proj"], "dropout": 0.0},
            "quant": {"base_weights": "none"}}
    other_impl = {**base, "model": {**base["model"], "expert_backend": "eager"}}
    assert model_changes(base, other_impl) == []
    assert model_changes(base, {**base, "lora": {**base["lora"], "rank": 8}}) == []  # LoRA off in both
    lora = {**base, "lora": {**base["lora"], "enabled": True}}
    edited = {**lora, "lora": {**lora["lora"], "alpha": 8.0, "target_modules": ["q_proj", "experts"],
                               "dropout": 0.1}, "quant": {"base_weights": "mxfp4"}}
    assert model_changes(lora, edited) == ["lora.alpha: 32.0 -> 8.0",
                                           "lora.target_modules: ['q_proj'] -> ['q_proj', 'experts']",
                                           "quant.base_weights: none -> mxfp4"]
    assert model_changes(base, lora) == ["lora.enabled: False -> True"]
