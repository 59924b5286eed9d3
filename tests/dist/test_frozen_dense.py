"""parallelism.frozen_dense under LoRA (runtime/distributed/fsdp.py): replicate leaves no decoder block an FSDP
unit, the frozen dense weights whole plain tensors on every rank and the trainable ones outside the experts in
the root unit, or, with no expert unit either, whole too (runtime/distributed/replicate.py); shard keeps today's
per-block units. (Parity with one process: tests/dist/test_parity.py.)"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from moe.experts import GroupedExperts
from runtime.config import load_config
from runtime.distributed.fsdp import leaves_no_unit
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
from runtime.models.hf import model_config
from runtime.train import train
from tests.conftest import small_chat_data
from tests.dist.test_parity import EXAMPLE


def _layout(rank, world_size, ep, frozen_dense, out):
    cfg = load_config(EXAMPLE, {"data.seq_len": 32, "train.micro_batch_size": 1, "train.max_steps": 1,
                                "optim.warmup_steps": 0, "logging.progress_bar": False, "parallelism.ep": ep,
                                "checkpoint.save_final": False, "lora.enabled": True, "lora.rank": 4,
                                "parallelism.frozen_dense": frozen_dense, "train.output_dir": out,
                                "data.path": small_chat_data()})
    dims = ParallelDims.resolve(1, -1, 1, ep, world_size)
    seen = {}

    def on_grads(model):
        experts = {p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
        dense = [(n, p) for n, p in model.named_parameters() if p not in experts]
        names = {p: n for n, p in model.named_parameters()}
        group = model._get_fsdp_state()._fsdp_param_group if isinstance(model, FSDPModule) else None
        seen["root_unit"] = isinstance(model, FSDPModule)
        seen["replicated"] = sorted(names[p] for p in model.replicated_grads.params) if model.replicated_grads else []
        seen["block_units"] = {isinstance(b, FSDPModule) for b in model.model.layers.values()}
        seen["expert_units"] = {isinstance(m, FSDPModule) for m in model.modules() if isinstance(m, GroupedExperts)}
        seen["root_params"] = sorted(fp._param_fqn for fp in group.fsdp_params) if group else []
        seen["trainable_dense"] = sorted(n for n, p in dense if p.requires_grad)
        seen["frozen_plain"] = {type(p) is torch.nn.Parameter and not isinstance(p, DTensor)
                                for _, p in dense if not p.requires_grad}
        seen["grads"] = {type(p.grad).__name__ for _, p in dense if p.requires_grad}

    train(cfg, DistEnv(rank, world_size, 0, torch.device("cpu")), dims, dims.build_meshes("cpu"), on_grads=on_grads)
    seen["foreseen_no_unit"] = leaves_no_unit(cfg, model_config(cfg), frozen_dense, dims, "cpu")  # plan, estimate
    return seen


@pytest.mark.parametrize("world,ep", [(4, 2), (2, 1)], ids=["fsdp4_ep2", "fsdp2"])
def test_replicate_leaves_one_root_unit_of_trainables(run_dist, tmp_path, world, ep):
    """The experts keep units of their own (efsdp 2, as under EP): the trainables outside them form the root."""
    seen = run_dist(_layout, world, ep, "replicate", str(tmp_path), timeout_s=240)[0]
    assert seen["block_units"] == {False} and seen["expert_units"] == {True}
    assert seen["trainable_dense"] and seen["root_params"] == seen["trainable_dense"]
    assert all("lora_" in n for n in seen["root_params"]) and not seen["replicated"]
    assert seen["frozen_plain"] == {True} and seen["grads"] == {"DTensor"}
    assert seen["foreseen_no_unit"] is False


def test_replicate_at_ep_the_world_leaves_no_unit(run_dist, tmp_path):
    """ep = world: each rank alone on its experts' mesh, so nothing is left to shard: no FSDP unit at all, the
    trainables outside the experts plain tensors whose gradients model.replicated_grads sums (their values:
    tests/dist/test_parity.py's ep2 LoRA case against one process)."""
    seen = run_dist(_layout, 2, 2, "replicate", str(tmp_path), timeout_s=240)[0]
    assert not seen["root_unit"] and seen["block_units"] == {False} and seen["expert_units"] == {False}
    assert seen["trainable_dense"] and seen["replicated"] == seen["trainable_dense"]
    assert all("lora_" in n for n in seen["replicated"])
    assert seen["frozen_plain"] == {True} and seen["grads"] == {"Tensor"}
    assert seen["foreseen_no_unit"] is True


def test_shard_keeps_a_unit_per_block(run_dist, tmp_path):
    seen = run_dist(_layout, 2, 2, "shard", str(tmp_path), timeout_s=240)[0]
    assert seen["block_units"] == {True} and seen["frozen_plain"] == {False}
    assert not seen["root_params"] or all("lora_" not in n for n in seen["root_params"])
    assert seen["foreseen_no_unit"] is False
