"""runtime.graph_step at ep = 2 on gloo (LoRA, the all_gather dispatcher, the dense trainables replicated: the
layout it is for), with tests.unit.test_graph_step.capture_without_cuda standing in for torch's CUDA graph:
both ranks agree on every bucket, capture and replay alike, and train as the queued steps do."""

from __future__ import annotations

import pytest
import torch

STEPS = 6


def _losses(rank: int, world_size: int, tmp: str, graphed: bool) -> tuple[list[float], int | None]:
    import runtime.graph_step
    from runtime.data.chat import load_tokenizer
    from runtime.data.loader import build_dataloader
    from runtime.distributed.mesh import ParallelDims
    from runtime.distributed.parallelize import parallelize
    from runtime.distributed.process_group import DistEnv
    from runtime.models.factory import build_model
    from runtime.optim import split_by_kind
    from runtime.step import train_step
    from tests.dist.test_parity import tiny_config
    from tests.unit.test_graph_step import capture_without_cuda

    runtime.graph_step.capture_step = capture_without_cuda  # this child process only
    cfg = tiny_config(True, tmp, ep=2, dispatcher="all_gather", steps=STEPS)
    dims = ParallelDims.resolve(1, -1, 1, 2, world_size)
    env = DistEnv(rank, world_size, 0, torch.device("cpu"))
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, env, dims)
    parallelize(model, dims, dims.build_meshes("cpu"), cfg)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=True)
    optimizer.groups_by_kind = split_by_kind(optimizer)  # DTensor experts beside plain replicated trainables
    loader = build_dataloader(cfg.data, load_tokenizer(cfg.data.tokenizer), 1, dp_rank=rank, dp_world=2)
    runner = runtime.graph_step.GraphedSteps(model, optimizer, cfg, env) if graphed else None
    losses, previous = [], None
    for _ in range(STEPS):
        batches = [next(loader)]
        launched = (runner.launch(batches, previous) if runner else
                    train_step(model, batches, optimizer, cfg, env, previous=previous))
        losses.append(launched.result().loss)
        previous = launched
    return losses, len(runner.graphs) if runner else None


@pytest.mark.dist
def test_replayed_ep2_steps_train_as_queued_ones(run_dist, tmp_path):
    queued = run_dist(_losses, 2, str(tmp_path / "queued"), False, timeout_s=180)
    replayed = run_dist(_losses, 2, str(tmp_path / "replayed"), True, timeout_s=180)
    assert replayed[0][1] == replayed[1][1] and 0 < replayed[0][1] < STEPS - 1  # the same graphs, some replayed
    for (got, _), (want, _) in zip(replayed, queued):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
