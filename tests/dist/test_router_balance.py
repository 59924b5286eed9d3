"""Router balancing under expert parallelism (gloo, the tiny example): forced balanced routing gives every
EP rank the same number of slots."""

from __future__ import annotations

import logging

import torch

from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
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


def test_forced_balanced_routing_gives_every_ep_rank_the_same_slots(run_dist, tmp_path):
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
