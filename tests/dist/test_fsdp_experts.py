"""Experts alone on their FSDP mesh (ep = world size, efsdp 1) get no FSDP unit: their parameters are the
DTensors FSDP would make (Shard(0) over the one-rank mesh), with DTensor gradients, and nothing gathers them;
with efsdp 2 they stay an FSDP unit. (Parity with one process under both: tests/dist/test_parity.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Shard

from moe.experts import GroupedExperts
from runtime.config import load_config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
from runtime.train import train
from tests.conftest import small_chat_data

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-moe.yaml"


def _layout(rank, world_size, ep, out):
    cfg = load_config(EXAMPLE, {"data.seq_len": 32, "train.micro_batch_size": 1, "train.max_steps": 1,
                                "optim.warmup_steps": 0, "logging.progress_bar": False, "parallelism.ep": ep,
                                "checkpoint.save_final": False, "train.output_dir": out,
                                "data.path": small_chat_data()})
    dims = ParallelDims.resolve(1, -1, 1, ep, world_size)
    seen = {}

    def on_grads(model):
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        params = [p for m in experts for p in m.parameters()]
        seen["units"] = {isinstance(m, FSDPModule) for m in experts}
        seen["layout"] = {(p.device_mesh.size(), tuple(p.placements)) for p in params}
        seen["grads"] = {type(p.grad).__name__ for p in params}
        seen["local"] = {tuple(p.to_local().shape) == tuple(p.shape) for p in params}

    train(cfg, DistEnv(rank, world_size, 0, torch.device("cpu")), dims, dims.build_meshes("cpu"), on_grads=on_grads)
    return seen


def test_experts_alone_on_their_mesh_are_no_fsdp_unit(run_dist, tmp_path):
    seen = run_dist(_layout, 2, 2, str(tmp_path / "run"), timeout_s=180)[0]
    assert seen == {"units": {False}, "layout": {(1, (Shard(0),))}, "grads": {"DTensor"}, "local": {True}}


def test_experts_sharded_over_efsdp_stay_an_fsdp_unit(run_dist, tmp_path):
    seen = run_dist(_layout, 4, 2, str(tmp_path / "run"), timeout_s=240)[0]
    assert seen["units"] == {True} and seen["layout"] == {(2, (Shard(0),))}


@pytest.mark.parametrize("backend", ["eager", "grouped_mm"])
def test_fp32_factors_compute_in_the_activations_dtype(backend):
    """Unwrapped experts' accessors hand the stored tensors over; the backends cast them under autocast (no FSDP
    gather does it)."""
    experts = GroupedExperts(2, 4, 2, lora_rank=2)
    A, B = experts.lora("down")
    assert A is experts.down_lora_A and B is experts.down_lora_B and experts.base_weight("gate_up") is experts.gate_up
    x_MH, ids_Mk, w_Mk = torch.randn(3, 4, dtype=torch.bfloat16), torch.tensor([[0, 1], [1, -1], [0, 0]]), torch.rand(3, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert experts(x_MH, ids_Mk, w_Mk, backend=backend).dtype == torch.bfloat16
    assert experts.gate_up.dtype == torch.float32  # the parameter itself is left as it is
