"""Selective activation checkpointing under EP keeps the MoE layers' collectives (gloo): backward sends
each layer's gradients back once (three all_to_alls: combine's, and dispatch's x and weights) and neither
exchanges tokens again nor all-reduces the balance loss's statistics, as recomputing the blocks would.
Loss and gradients against one process are test_parity's (fsdp4_ep2_selective_ac)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.config import load_config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.parallelize import parallelize
from runtime.distributed.process_group import DistEnv
from runtime.models.factory import build_model
from tests.dist.test_parity import EXAMPLE

COLLECTIVES = {"all_to_all_single", "all_reduce"}


class CollectiveCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = {name: 0 for name in COLLECTIVES}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func.__name__.split(".")[0] in COLLECTIVES:
            self.calls[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _backward_collectives(rank, world_size, mode):
    cfg = load_config(EXAMPLE, {"parallelism.dp_shard": -1, "parallelism.ep": 2, "data.seq_len": 32,
                                "model.router_aux_loss_coef": 0.01, "parallelism.activation_checkpoint": mode})
    dims = ParallelDims.resolve(1, -1, 1, 2, world_size)
    model = build_model(cfg, DistEnv(rank, world_size, 0, torch.device("cpu")), dims)
    parallelize(model, dims, dims.build_meshes("cpu"), cfg)
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(rank))
    loss = model(ids, labels=ids)
    counter = CollectiveCounter()
    with counter:
        loss.backward()
    return counter.calls, len(list(model.moe_blocks()))


@pytest.mark.parametrize("mode", ["selective", "none"])
def test_backward_does_not_exchange_tokens_again(run_dist, mode):
    for calls, moe_layers in run_dist(_backward_collectives, 2, mode):
        assert calls == {"all_to_all_single": 3 * moe_layers, "all_reduce": 0}, (mode, calls)


def _exchange_forms(rank, world_size):
    """Which form of collective the MoE layers issue: none functional outside a dispatch mode, all of them
    (every all_to_all and the balance all-reduce) functional inside one."""
    from moe.dispatch import collectives

    functional = []
    real = collectives.funcol.all_to_all_single
    collectives.funcol.all_to_all_single = lambda *args, **kwargs: functional.append(1) or real(*args, **kwargs)
    cfg = load_config(EXAMPLE, {"parallelism.dp_shard": -1, "parallelism.ep": 2, "data.seq_len": 32,
                                "model.router_aux_loss_coef": 0.01})
    dims = ParallelDims.resolve(1, -1, 1, 2, world_size)
    model = build_model(cfg, DistEnv(rank, world_size, 0, torch.device("cpu")), dims)
    parallelize(model, dims, dims.build_meshes("cpu"), cfg)
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(rank))
    model(ids, labels=ids).backward()
    plain_functional = len(functional)
    counter = CollectiveCounter()
    with counter:
        model(ids, labels=ids).backward()
    return plain_functional, counter.calls, len(list(model.moe_blocks()))


def test_plain_collectives_outside_a_dispatch_mode_functional_inside(run_dist):
    for plain_functional, calls, moe_layers in run_dist(_exchange_forms, 2):
        assert plain_functional == 0
        # forward: counts, ids, x, weights, combine; backward: combine's, x's and weights' gradients
        assert calls == {"all_to_all_single": 8 * moe_layers, "all_reduce": moe_layers}, calls
