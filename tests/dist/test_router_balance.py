"""Router balancing under expert parallelism (gloo, the tiny example): forced balanced routing gives every
EP rank the same number of slots; the aux-loss-free bias is the same on every rank, checkpointed across a
change of ep, and exported beside the HF checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime.config import load_config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
from runtime.models.hf import ROUTER_BIAS_FILE, ROUTER_BIAS_SUFFIX
from runtime.train import train
from tests.dist.test_parity import tiny_config


def _ep_imbalance(rank, world_size, tmp, model_overrides):
    cfg = tiny_config(False, tmp, ep=world_size)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update=model_overrides),
                                 "train": cfg.train.model_copy(update={"max_steps": 2})})
    p = cfg.parallelism
    dims = ParallelDims.resolve(p.dp_replicate, p.dp_shard, p.cp, p.ep, world_size)
    records = train(cfg, DistEnv(rank, world_size, 0, torch.device("cpu")), dims, dims.build_meshes("cpu"))
    return [r["ep_imbalance"] for r in records]


def test_forced_balanced_routing_gives_every_ep_rank_the_same_slots(run_dist, tmp_path, tokenize_once):
    tokenize_once(tiny_config(False, str(tmp_path)))  # here, once, not in every rank of both runs
    forced = run_dist(_ep_imbalance, 2, str(tmp_path / "forced"), {"router_force_balanced": True}, timeout_s=120)
    assert all(v == 1.0 for ranks in forced for v in ranks), forced
    routed = run_dist(_ep_imbalance, 2, str(tmp_path / "routed"), {}, timeout_s=120)
    assert any(v > 1.0 for v in routed[0]), routed  # the router alone does not balance exactly


def test_forced_balanced_routing_is_announced(tmp_path, caplog):
    from runtime.models.factory import build_model

    cfg = tiny_config(False, str(tmp_path))
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"router_force_balanced": True})})
    dims = ParallelDims.resolve(1, -1, 1, 1, 1)
    with caplog.at_level(logging.WARNING, logger="runtime"):
        model = build_model(cfg, DistEnv(0, 1, 0, torch.device("cpu")), dims)
    assert "model.router_force_balanced" in caplog.text
    assert all(block.gate.force_balanced for block in model.moe_blocks())


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-moe.yaml"
RATE = 1e-2  # large enough that a few steps move the bias visibly


def bias_config(out: str, ep: int, **extra):
    return load_config(EXAMPLE, {
        "data.seq_len": 64, "train.micro_batch_size": 1, "optim.warmup_steps": 0, "train.max_steps": 4,
        "train.output_dir": out, "logging.progress_bar": False, "parallelism.dp_shard": -1,
        "parallelism.ep": ep, "model.router_bias_update_rate": RATE, **extra})


def biases(model) -> dict[str, torch.Tensor]:
    return {k: b.detach().clone() for k, b in model.named_buffers() if k.endswith(ROUTER_BIAS_SUFFIX)}


def _train_biases(rank, world_size, out, ep, extra, resume=False):
    """(biases after training, biases seen in the first step's backward: before any update of this run)."""
    cfg = bias_config(out, ep, **extra)
    dims = ParallelDims.resolve(1, -1, 1, ep, world_size)
    seen = {}

    def keep(model):
        seen.setdefault("first", biases(model))
        seen["model"] = model
    train(cfg, DistEnv(rank, world_size, 0, torch.device("cpu")), dims,
          dims.build_meshes("cpu") if world_size > 1 else None, on_grads=keep, resume=resume)
    return biases(seen["model"]), seen["first"]


def test_bias_is_identical_on_every_rank_saved_restored_across_ep_and_exported(run_dist, tmp_path,
                                                                                 tokenize_once):
    """ep=2 on 2 ranks, 4 steps with the bias on: every rank holds the same bias, that of one process over
    the same global batch; the HF export leaves it out and writes it beside; a resume on 4 ranks with ep=4
    starts from it."""
    out = tmp_path / "ep2"
    tokenize_once(bias_config(str(out), 2))  # here, once, not in every rank of the three runs
    ranks = run_dist(_train_biases, 2, str(out), 2, {"checkpoint.export_hf": True}, timeout_s=120)
    final = ranks[0][0]
    assert len(final) == 2 and all(b.abs().max() > 0 for b in final.values())
    for other, _ in ranks[1:]:
        assert all(torch.equal(other[k], final[k]) for k in final)
    ref, _ = _train_biases(0, 1, str(tmp_path / "ref"), 1, {"train.micro_batch_size": 2})
    assert all(torch.equal(ref[k], final[k]) for k in final), (ref, final)

    hf = load_file(out / "hf" / "model.safetensors")
    assert not [k for k in hf if "e_score_correction_bias" in k] and "model.layers.0.mlp.gate.weight" in hf
    side = load_file(out / "hf" / ROUTER_BIAS_FILE)
    assert sorted(side) == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(2)]
    assert all(torch.equal(side[k], final[k]) for k in final)

    resumed = run_dist(_train_biases, 4, str(out), 4, {"train.max_steps": 5}, True, timeout_s=120)
    for _, first in resumed:  # the step-4 checkpoint's bias, before step 5 moves it
        assert all(torch.equal(first[k], final[k]) for k in final), (first, final)


DEMO_STEPS = 120
DEMO_RATE = 1e-3  # the paper's gamma


def _demo_config(out: str, ep: int, rate: float):
    return load_config(EXAMPLE, {"train.max_steps": DEMO_STEPS, "train.output_dir": out,
                                 "logging.progress_bar": False, "checkpoint.every_n_steps": 0,
                                 "checkpoint.save_final": False,
                                 "parallelism.ep": ep, "model.router_bias_update_rate": rate})


def _demo_run(rank, world_size, out, rate):
    cfg = _demo_config(out, world_size, rate)
    dims = ParallelDims.resolve(1, -1, 1, world_size, world_size)
    train(cfg, DistEnv(rank, world_size, 0, torch.device("cpu")), dims, dims.build_meshes("cpu"))


def _metrics(out: Path) -> tuple[list[float], list[float]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "ep_imbalance" in r]
    return [r["ep_imbalance"] for r in records], [r["loss"] for r in records]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
def test_bias_balancing_evens_the_ep_load_of_the_tiny_example(run_dist, tmp_path, tokenize_once):
    """The example as written (router_aux_loss_coef 0.001) at ep=4, 120 steps, without and with the bias at
    rate 1e-3: the mean ep_imbalance of the last 40 steps falls to <= 1.10 with it and stays above 1.15
    without; the loss of the last 10 steps stays within 10% of the run without."""
    tokenize_once(_demo_config(str(tmp_path), 4, 0.0))  # here, once, not in every rank of both runs
    for name, rate in (("plain", 0.0), ("bias", DEMO_RATE)):
        run_dist(_demo_run, 4, str(tmp_path / name), rate, timeout_s=600)
    (plain_imb, plain_loss), (bias_imb, bias_loss) = _metrics(tmp_path / "plain"), _metrics(tmp_path / "bias")
    assert len(plain_imb) == len(bias_imb) == DEMO_STEPS
    summary = (f"ep_imbalance last 40: {_mean(plain_imb[-40:]):.3f} without, {_mean(bias_imb[-40:]):.3f} with; "
               f"loss last 10: {_mean(plain_loss[-10:]):.4f} without, {_mean(bias_loss[-10:]):.4f} with")
    print(summary)
    assert _mean(bias_imb[-40:]) <= 1.10 and _mean(plain_imb[-40:]) > 1.15, summary
    assert abs(_mean(bias_loss[-10:]) / _mean(plain_loss[-10:]) - 1) <= 0.10, summary
