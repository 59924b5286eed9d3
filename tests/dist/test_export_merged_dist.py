"""Merged export under FSDP x EP (gloo, 2 ranks, ep=2) writes the tensors the single-process export writes,
dense and FP4-packed experts alike (the packed ones are dequantized and gathered over the EP group)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from runtime.config import load_config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.parallelize import parallelize
from runtime.distributed.process_group import DistEnv
from runtime.export import export_merged
from runtime.models.factory import build_model
from tests.dist.test_parity import EXAMPLE


def _cfg(out: str, quant: str, ep: int):
    return load_config(EXAMPLE, {"lora.enabled": True, "lora.rank": 4, "quant.base_weights": quant,
                                 "train.output_dir": out, "parallelism.ep": ep, "parallelism.dp_shard": -1})


@torch.no_grad()
def _seed_lora_b_(model) -> None:
    """B != 0 with values that do not depend on the EP split (drawn for all experts, sliced)."""
    for name, p in model.named_parameters():
        if "lora_B" in name:
            owner = model.get_submodule(name.rpartition(".")[0])
            offset = getattr(owner, "expert_offset", None)
            shape = (model.config.num_experts, *p.shape[1:]) if offset is not None else p.shape
            full = torch.randn(shape, generator=torch.Generator().manual_seed(len(name))) * 0.05
            p.copy_(full[offset:offset + p.shape[0]] if offset is not None else full)


def _export(rank: int, world_size: int, out: str, quant: str):
    cfg = _cfg(out, quant, ep=world_size)
    dims = ParallelDims.resolve(1, -1, 1, world_size, world_size)
    model = build_model(cfg, DistEnv(rank, world_size, 0, torch.device("cpu")), dims)
    _seed_lora_b_(model)
    meshes = dims.build_meshes("cpu") if world_size > 1 else None
    parallelize(model, dims, meshes, cfg)
    return export_merged(model, cfg, rank, meshes)


def _tensors(folder) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("quant", ["none", "mxfp4"])
def test_merged_export_under_ep_equals_single_process(run_dist, tmp_path, quant):
    run_dist(_export, 2, str(tmp_path / "dist"), quant)
    _export(0, 1, str(tmp_path / "single"), quant)
    dist_t, single_t = _tensors(tmp_path / "dist" / "merged"), _tensors(tmp_path / "single" / "merged")
    assert dist_t.keys() == single_t.keys() and any(".experts.7.down_proj" in k for k in dist_t)
    for key, value in single_t.items():
        assert torch.allclose(dist_t[key], value, atol=1e-6), key
