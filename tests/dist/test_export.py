"""Exports gathered from EP + FSDP shards equal the single-process exports of the same training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime.config import load_config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
from runtime.train import train
from tests.conftest import small_chat_data

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe.yaml"


def config(out: str, lora: bool, micro_batch: int, ep: int):
    # optim.eps 1e-3: Adam's first update g / (|g| + eps) is a sign for |g| >> eps, so gradient entries
    # at the summation-order noise floor would flip whole updates; with eps above that floor the
    # update is linear in g there. The test is about the gather, not that.
    return load_config(EXAMPLE, {
        "data.seq_len": 64, "train.micro_batch_size": micro_batch, "optim.warmup_steps": 0, "optim.eps": 1e-3,
        "train.max_steps": 1, "train.output_dir": out, "logging.progress_bar": False,
        "checkpoint.save_final": False, "checkpoint.export_hf": True, "lora.enabled": lora, "lora.rank": 4,
        "parallelism.dp_shard": -1, "parallelism.ep": ep, "data.path": small_chat_data()})


def _train(rank, world_size, out, lora):
    dims = ParallelDims.resolve(1, -1, 1, 2, world_size)
    train(config(out, lora, 1, 2), DistEnv(rank, world_size, 0, torch.device("cpu")), dims,
          dims.build_meshes("cpu"))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("lora", [False, True], ids=["hf", "peft"])
def test_export_from_shards_equals_single_process(run_dist, tmp_path, lora):
    run_dist(_train, 2, str(tmp_path / "dist"), lora)
    train(config(str(tmp_path / "ref"), lora, 2, 1), DistEnv(0, 1, 0, torch.device("cpu")),
          ParallelDims(1, 1, 1, 1, 1))
    sub = "adapter" if lora else "hf"
    got, ref = _tensors(tmp_path / "dist" / sub), _tensors(tmp_path / "ref" / sub)
    assert set(got) == set(ref) and len(ref) > 0
    for key in ref:
        err = (got[key] - ref[key]).norm() / ref[key].norm().clamp_min(1e-12)
        assert err <= 1e-5, f"{key}: {err:.2e}"
    if not lora:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "dist" / "hf")
        assert hf.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8
