"""Run safety in one process: the run folder is claimed, NaN never reaches the optimizer or a
checkpoint, label-less steps are skipped, pruning keeps other runs' checkpoints, metrics are strict JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import runtime.train as train_mod
from runtime.checkpoint import CheckpointManager, read_meta
from runtime.config import load_config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
from runtime.guard.run_dir import RunDirError, claim_run_dir, release_run_dir
from runtime.train import TrainingDiverged, train
from tests.conftest import small_chat_data

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe.yaml"
ENV = DistEnv(0, 1, 0, torch.device("cpu"))
DIMS = ParallelDims(1, 1, 1, 1, 1)


def config(out: Path, **extra):
    overrides = {"data.seq_len": 64, "train.micro_batch_size": 1, "optim.warmup_steps": 1, "train.max_steps": 6,
                 "checkpoint.every_n_steps": 2, "checkpoint.keep_last": 5, "train.output_dir": str(out),
                 "logging.progress_bar": False, "data.path": small_chat_data(), **extra}
    return load_config(EXAMPLE, overrides)


def poison_grads_at(*steps: int):
    """on_grads hook: a NaN in one gradient at the given (1-based) steps of this call of train()."""
    seen = {"n": 0}

    def hook(model):
        seen["n"] += 1
        if seen["n"] in steps:
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
    return hook


def strict_records(out: Path) -> list[dict]:
    def reject(token):
        raise AssertionError(f"metrics.jsonl holds {token}, which is not JSON")
    return [json.loads(line, parse_constant=reject) for line in (out / "metrics.jsonl").read_text().splitlines()]


def all_finite_checkpoints(out: Path) -> list[int]:
    steps = []
    for path in sorted((out / "checkpoints").glob("step_*")):
        state = torch.load(path / "extra_rank0.pt", weights_only=False)
        steps.append(state["step"])
    return steps


def test_nan_grad_norm_stops_before_the_update_and_names_a_finite_checkpoint(tmp_path):
    with pytest.raises(TrainingDiverged, match=r"grad norm nan at step 3: the update was not applied; "
                                               r"last good checkpoint: .*step_00000002"):
        train(config(tmp_path), ENV, DIMS, on_grads=poison_grads_at(3))
    assert all_finite_checkpoints(tmp_path) == [2]
    # The named checkpoint resumes (load() checks its parameters finite) and training goes on.
    records = train(config(tmp_path), ENV, DIMS, resume=True)
    assert [r["step"] for r in records] == [3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) for r in records)


def test_skip_policy_skips_updates_counts_them_and_stops_after_n_in_a_row(tmp_path):
    cfg = config(tmp_path / "a", **{"train.nan_policy": "skip", "train.max_nan_skips": 2})
    records = train(cfg, ENV, DIMS, on_grads=poison_grads_at(3, 5))
    assert [r.get("skipped") for r in records] == [None, None, "non_finite", None, "non_finite", None]
    assert all(math.isfinite(r["loss"]) for r in records if "skipped" not in r)
    logged = strict_records(tmp_path / "a")
    assert logged[2]["grad_norm"] is None and logged[2]["skipped"] == "non_finite"

    cfg = config(tmp_path / "b", **{"train.nan_policy": "skip", "train.max_nan_skips": 2})
    with pytest.raises(TrainingDiverged, match=r"at step 4: 2 non-finite steps in a row"):
        train(cfg, ENV, DIMS, on_grads=poison_grads_at(3, 4))


def test_a_skipped_update_leaves_the_weights_unchanged(tmp_path):
    cfg = config(tmp_path, **{"train.nan_policy": "skip", "train.max_steps": 1, "optim.warmup_steps": 0,
                            "checkpoint.every_n_steps": 0})
    seen = {}

    def poison_and_keep(model):
        seen["before"] = {k: v.detach().clone() for k, v in model.named_parameters()}
        seen["model"] = model
        poison_grads_at(1)(model)
    train(cfg, ENV, DIMS, on_grads=poison_and_keep)
    after = dict(seen["model"].named_parameters())
    assert all(torch.equal(v, after[k]) for k, v in seen["before"].items())


def test_a_step_without_label_tokens_is_skipped_not_fatal(tmp_path, monkeypatch):
    real = train_mod.build_dataloader

    def second_batch_unlabeled(*args, **kwargs):
        loader = real(*args, **kwargs)
        batches = iter(loader)

        class Wrapped:
            n = 0

            def __next__(self):
                self.n += 1
                batch = next(batches)
                if self.n == 2:
                    return dataclasses.replace(batch, labels=torch.full_like(batch.labels, -100), num_label_tokens=0)
                return batch

            def state_dict(self):
                return loader.state_dict()
        return Wrapped()
    monkeypatch.setattr(train_mod, "build_dataloader", second_batch_unlabeled)
    records = train(config(tmp_path, **{"train.max_steps": 3, "checkpoint.every_n_steps": 0}), ENV, DIMS)
    assert [r.get("skipped") for r in records] == [None, "no_labels", None]
    assert strict_records(tmp_path)[1]["loss"] is None


def test_a_second_fresh_run_in_a_used_dir_refuses_and_loses_nothing(tmp_path):
    train(config(tmp_path, **{"train.max_steps": 4}), ENV, DIMS)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(RunDirError, match=r"already holds checkpoints .*--resume.*train.output_dir"):
        train(config(tmp_path, **{"train.max_steps": 4}), ENV, DIMS)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before == ["step_00000002",
                                                                                      "step_00000004"]


def test_a_concurrent_run_on_the_same_dir_fails_at_start(tmp_path):
    holder = claim_run_dir(tmp_path, resume=False, rank=0)
    try:
        with pytest.raises(RunDirError, match=r"in use by another run \(pid \d+ on host"):
            train(config(tmp_path), ENV, DIMS)
    finally:
        release_run_dir(holder)
    assert len(train(config(tmp_path, **{"train.max_steps": 2}), ENV, DIMS)) == 2


def test_pruning_removes_only_older_checkpoints_of_the_same_run(tmp_path):
    foreign = tmp_path / "checkpoints" / "step_00000009"
    foreign.mkdir(parents=True)
    (foreign / "meta.json").write_text(json.dumps({"step": 9, "run_id": "someone-else"}))
    legacy = tmp_path / "checkpoints" / "step_00000001"  # written before checkpoints carried a run id
    legacy.mkdir()
    run_dir = claim_run_dir(tmp_path, resume=True, rank=0)
    try:
        mgr = CheckpointManager(run_dir, keep_last=1, env=ENV)
        for step in (2, 4):
            d = tmp_path / "checkpoints" / f"step_{step:08d}"
            d.mkdir()
            (d / "meta.json").write_text(json.dumps({"step": step, "run_id": run_dir.run_id}))
        mgr._prune(4)
    finally:
        release_run_dir(run_dir)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000001", "step_00000004", "step_00000009"]


def test_resume_under_another_world_size_reads_the_extra_state_of_rank_modulo_the_saved_world(tmp_path):
    train(config(tmp_path, **{"train.max_steps": 2}), ENV, DIMS)
    ckpt = tmp_path / "checkpoints" / "step_00000002"
    assert read_meta(ckpt)["world_size"] == 1
    run_dir = claim_run_dir(tmp_path, resume=True, rank=0)
    try:
        files = [CheckpointManager(run_dir, 2, DistEnv(r, 4, 0, torch.device("cpu")), ep=2).extra_file(ckpt)
                 for r in range(4)]
    finally:
        release_run_dir(run_dir)
    assert files == [ckpt / "extra_rank0.pt"] * 4


def test_metrics_after_resume_hold_each_step_once_with_one_run_id(tmp_path):
    class Crash(Exception):
        pass

    seen = {"n": 0}

    def crash_at_5(model):
        seen["n"] += 1
        if seen["n"] == 5:
            raise Crash
    with pytest.raises(Crash):
        train(config(tmp_path), ENV, DIMS, on_grads=crash_at_5)
    assert [r["step"] for r in strict_records(tmp_path)] == [1, 2, 3, 4]
    train(config(tmp_path), ENV, DIMS, resume=True)
    logged = strict_records(tmp_path)
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    assert len({r["run_id"] for r in logged}) == 1 and logged[0]["run_id"]
    assert json.loads((tmp_path / "run.json").read_text())["run_id"] == logged[0]["run_id"]
