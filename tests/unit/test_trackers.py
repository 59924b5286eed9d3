"""Trackers: a short run with TensorBoard and W&B (offline) on records the train and eval numbers at their
steps, and the config and mesh once; a requested tracker whose package is absent fails before anything runs."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from runtime.config import ConfigError, load_config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
from runtime.observe import trackers as trackers_module
from runtime.observe.trackers import check_trackers
from runtime.train import train
from tests.dist.test_parity import EXAMPLE

STEPS = 4


def _cfg(out, **extra):
    return load_config(EXAMPLE, {"data.seq_len": 64, "train.micro_batch_size": 2, "optim.warmup_steps": 1,
                                 "train.max_steps": STEPS, "train.output_dir": str(out), "logging.progress_bar": False,
                                 "checkpoint.save_final": False, "data.eval_fraction": 0.02,
                                 "train.eval_every_n_steps": 2, **extra})


def test_tensorboard_and_wandb_offline_record_the_run(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    sent = []  # what our trackers hand to the real W&B run (whose offline files are binary)
    real_wandb = trackers_module._wandb

    def wandb_run(*args):
        run = real_wandb(*args)
        real_log = run.log
        run.log = lambda values, step: (sent.append((step, dict(values))), real_log(values, step=step))[1]
        sent.append(("config", dict(run.config)))
        return run
    monkeypatch.setattr(trackers_module, "_wandb", wandb_run)
    cfg = _cfg(tmp_path, **{"logging.tensorboard": True, "logging.wandb": {"project": "tiny", "mode": "offline"}})
    records = train(cfg, DistEnv(0, 1, 0, torch.device("cpu")), ParallelDims(1, 1, 1, 1, 1))
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, STEPS + 1))
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    evals = events.Scalars("eval/loss")
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e.step for e in evals] == [2, 4] == [r["step"] for r in logged if "eval_loss" in r]
    assert {"config/text_summary", "mesh/text_summary"} <= set(events.Tags()["tensors"])
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert sent[0][0] == "config" and sent[0][1]["mesh"]["world_size"] == 1
    assert sent[0][1]["config"]["data"]["eval_fraction"] == 0.02
    train_losses = {step: v["train/loss"] for step, v in sent[1:] if "train/loss" in v}
    assert train_losses == pytest.approx({r["step"]: r["loss"] for r in records}, rel=1e-6)
    assert {step: v["eval/loss"] for step, v in sent[1:] if "eval/loss" in v} == pytest.approx(
        {r["step"]: r["eval_loss"] for r in logged if "eval_loss" in r}, rel=1e-6)


@pytest.mark.parametrize("key,package", [("logging.tensorboard", "tensorboard"), ("logging.wandb", "wandb")])
def test_a_requested_tracker_without_its_package_fails_first(tmp_path, monkeypatch, key, package):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    value = True if key == "logging.tensorboard" else {"project": "p", "mode": "offline"}
    with pytest.raises(ConfigError, match=rf"{key} needs the {package} package.*pip install 'moe-runtime\[trackers\]'"):
        check_trackers(_cfg(tmp_path, **{key: value}))
