"""Exports of a run trained with aux-loss-free balancing (model.router_bias_update_rate): the HF format has no
selection bias, so it is left out of the safetensors and written beside them, with one warning per export;
such an export loads back (transformers, and our loader with the option on: bias from zero)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from runtime.config import load_config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
from runtime.models import from_pretrained
from runtime.models.hf import ROUTER_BIAS_FILE, ROUTER_BIAS_SUFFIX
from runtime.train import train

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-moe.yaml"
KEYS = [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(2)]


def test_lora_run_exports_write_the_bias_beside_adapter_and_merged_checkpoint(tmp_path, caplog):
    cfg = load_config(EXAMPLE, {"data.seq_len": 64, "train.micro_batch_size": 2, "optim.warmup_steps": 0,
                                "train.max_steps": 3, "train.output_dir": str(tmp_path),
                                "logging.progress_bar": False, "checkpoint.save_final": False,
                                "checkpoint.export_hf": True,
                                "checkpoint.export_merged": True, "lora.enabled": True, "lora.rank": 4,
                                "model.router_bias_update_rate": 1e-2})
    seen = {}
    with caplog.at_level(logging.WARNING, logger="runtime"):
        train(cfg, DistEnv(0, 1, 0, torch.device("cpu")), ParallelDims(1, 1, 1, 1, 1),
              on_grads=lambda model: seen.update(model=model))
    trained = {k: b for k, b in seen["model"].named_buffers() if k.endswith(ROUTER_BIAS_SUFFIX)}
    assert sorted(trained) == KEYS and all(b.abs().max() > 0 for b in trained.values())
    warnings = [r.getMessage() for r in caplog.records if "model.router_bias_update_rate" in r.getMessage()]
    assert len(warnings) == 2 and all("routes differently" in w for w in warnings), warnings

    for folder in ("adapter", "merged"):
        side = load_file(tmp_path / folder / ROUTER_BIAS_FILE)
        assert sorted(side) == KEYS and all(torch.equal(side[k], trained[k]) for k in KEYS)
    merged = tmp_path / "merged"
    assert not [k for k in load_file(merged / "model.safetensors") if k.endswith(ROUTER_BIAS_SUFFIX)]

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(merged)  # a plain HF Qwen3-MoE checkpoint
    ours = from_pretrained(merged, router_bias_update_rate=1e-2)  # no missing-key error; the bias starts at zero
    assert all(not block.gate.e_score_correction_bias.any() for block in ours.moe_blocks())
    assert all(block.gate.e_score_correction_bias.device.type == "cpu" for block in ours.moe_blocks())
