"""The run's model from a Config: the QwenConfig it names, the model with this rank's weights (train, verify,
export), and the same model on the meta device (estimate, preflight), so every tool sees one definition.

    qcfg = model_config(cfg)                     # model.path's config.json, or model.config, plus runtime options
    model = build_model(cfg, env, dims)          # this rank's weights on env.device (runtime.models.build)
    model = meta_model(cfg, qcfg, dtype)         # allocates nothing: LoRA applied, experts packed as trained
"""

from __future__ import annotations

import logging

import torch

from quant import quantize_experts
from runtime.config import Config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
from runtime.float8 import apply_fp8_training
from runtime.lora import apply_lora, seed_lora_A
from runtime.models.build import build
from runtime.models.hf import model_config
from runtime.models.qwen import QwenConfig, QwenForCausalLM
from runtime.optim import apply_master_dtype

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(cfg: Config, env: DistEnv, dims: ParallelDims) -> QwenForCausalLM:
    """The model with this rank's weights (runtime.models.build): checkpoint shards (only its experts
    under EP) or the seeded random init, whose every EP slice equals the single-process init."""
    qcfg = model_config(cfg)
    dims.check_experts(qcfg.num_experts)
    if qcfg.router_force_balanced and env.is_main:
        log.warning("model.router_force_balanced: every expert receives the same number of slots regardless of "
                    "the router (benchmarks only: this changes the model)")
    model = build(qcfg, DTYPES[cfg.model.dtype], env.device, path=cfg.model.path, seed=cfg.train.seed,
                  ep_rank=dims.ep_rank(env.rank), ep=dims.ep, quant=cfg.quant.base_weights)
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora)
        seed_lora_A(model, cfg.train.seed)
    apply_master_dtype(model, cfg.optim.master_dtype, env.device)
    apply_fp8_training(model, cfg.quant.train_fp8)
    return model


def meta_model(cfg: Config, qcfg: QwenConfig | None = None, dtype: torch.dtype | None = None) -> QwenForCausalLM:
    """The run's model on the meta device: LoRA applied, experts packed as build_model builds them.
    `dtype` defaults to model.dtype."""
    qcfg = qcfg or model_config(cfg)
    with torch.device("meta"):
        model = QwenForCausalLM(qcfg, dtype=dtype or DTYPES[cfg.model.dtype])
        if cfg.quant.base_weights != "none":
            for block in model.moe_blocks():
                quantize_experts(block.experts, cfg.quant.base_weights)
        if cfg.lora.enabled:
            apply_lora(model, cfg.lora)
    return model
