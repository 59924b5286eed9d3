"""runtime.graph_step at ep = 2 on gloo (LoRA, the all_gather dispatcher, the dense trainables replicated: the
layout it is for), with tests.unit.test_graph_step.capture_without_cuda standing in for torch's CUDA graph:
both ranks agree on every bucket, capture and replay alike, and train as the queued steps do."""

from __future__ import annotations

import pytest
import torch

STEPS = 6


def _losses(rank: int, world_size: int, tmp: str, graphed: bool, config: dict | None = None
            ) -> tuple[list[float], int | None, list[int]]:
    import runtime.graph_step
    from runtime.data.chat import load_tokenizer
    from runtime.data.loader import build_dataloader
    from runtime.distributed.mesh import ParallelDims
    from runtime.distributed.parallelize import parallelize
    from runtime.distributed.process_group import DistEnv
    from runtime.models.factory import build_model
    from runtime.optim import split_by_kind
    from runtime.step import settle, train_step
    from tests.dist.test_parity import tiny_config
    from tests.unit.test_graph_step import capture_without_cuda

    runtime.graph_step.capture_step = capture_without_cuda  # this child process only
    cfg = tiny_config(True, tmp, **{"ep": 2, "dispatcher": "all_gather", "steps": STEPS, **(config or {})})
    dims = ParallelDims.resolve(1, -1, 1, 2, world_size)
    env = DistEnv(rank, world_size, 0, torch.device("cpu"))
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, env, dims)
    parallelize(model, dims, dims.build_meshes("cpu"), cfg)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=True)
    optimizer.groups_by_kind = split_by_kind(optimizer)  # DTensor experts beside plain replicated trainables
    loader = build_dataloader(cfg.data, load_tokenizer(cfg.data.tokenizer), 1, dp_rank=rank, dp_world=2)
    runner = runtime.graph_step.GraphedSteps(model, optimizer, cfg, env) if graphed else None
    dropped = []
    if runner:  # a spy on the graphs a grown bound drops
        drop = runner.drop
        runner.drop = lambda why: (dropped.append(len(runner.graphs)), drop(why))
    losses, previous = [], None
    for _ in range(cfg.train.max_steps):  # as the trainer: a step is read once the next is launched (settled)
        batches = [next(loader)]
        launched = (runner.launch(batches, previous) if runner else
                    train_step(model, batches, optimizer, cfg, env, previous=previous))
        if previous is not None:
            losses.append(previous.result().loss)
        previous = launched
    settle(previous, model, optimizer, cfg, env)
    losses.append(previous.result().loss)
    return losses, len(runner.graphs) if runner else None, dropped


@pytest.mark.dist
def test_replayed_ep2_steps_train_as_queued_ones(run_dist, tmp_path):
    queued = run_dist(_losses, 2, str(tmp_path / "queued"), False, timeout_s=180)
    replayed = run_dist(_losses, 2, str(tmp_path / "replayed"), True, timeout_s=180)
    assert replayed[0][1] == replayed[1][1] and 0 < replayed[0][1] < STEPS - 1  # the same graphs, some replayed
    for (got, *_), (want, *_) in zip(replayed, queued):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)


@pytest.mark.dist
def test_a_grown_bound_drops_the_graphs_and_the_steps_still_train_as_queued(run_dist, tmp_path):
    """scattermoe behind all_gather with buffers for half a rank's balanced slots (tests.dist.test_all_gather's
    BOUNDED): steps drop slots, the next launch computes them again with a grown bound, the graphs captured at
    the old bound are dropped, and the losses are the queued run's."""
    from tests.dist.test_all_gather import BOUNDED

    bounded = {**BOUNDED, "steps": 4}
    bounded.pop("ep")
    queued = run_dist(_losses, 2, str(tmp_path / "queued"), False, bounded, timeout_s=300)
    replayed = run_dist(_losses, 2, str(tmp_path / "replayed"), True, bounded, timeout_s=300)
    assert any(n > 0 for n in replayed[0][2]), replayed[0][2]  # a bound grew while graphs were held
    for (got, *_), (want, *_) in zip(replayed, queued):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
