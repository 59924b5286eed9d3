"""The one recipe that applies every parallelism of ParallelDims to a built model, in the order they compose:
EP wiring, context parallelism, activation checkpointing, compile, FSDP2 (compile wraps the checkpointed
blocks, FSDP wraps the compiled ones). Each concern lives in its own module beside this one.

Gradient scaling: every FSDP reduction is a plain sum (divide factor 1) and the loss is divided by
the global label-token count (runtime.train), so each gradient equals the single-process gradient of
the same global batch, for dense, expert, router and LoRA parameters alike.
"""

from __future__ import annotations

import torch.distributed as dist

from runtime.config import Config
from runtime.distributed.activation_checkpoint import apply_activation_checkpointing
from runtime.distributed.compile import apply_compile
from runtime.distributed.context_parallel import ContextParallel
from runtime.distributed.expert_parallel import wire_moe_blocks
from runtime.distributed.fsdp import apply_fsdp, frozen_dense_bytes, frozen_dense_placement, fsdp_gather_dtype
from runtime.distributed.mesh import Meshes, ParallelDims
from runtime.models.qwen import QwenForCausalLM
from runtime.plan import auto_compile, auto_dispatcher, device_memory_bytes


def parallelize(model: QwenForCausalLM, dims: ParallelDims, meshes: Meshes | None, cfg: Config,
                autocast: bool = True) -> QwenForCausalLM:
    """`model`, wired and wrapped in place (module docstring). `autocast`: the step computes in bf16 on CUDA
    (FSDP gathers bf16 parameters)."""
    device = meshes.world.device_type if meshes is not None else next(model.parameters()).device.type
    memory = device_memory_bytes(device)
    # plan() passes a concrete dispatcher, compile.enabled and frozen_dense; a model built without it gets plan's
    # rules
    dispatcher = auto_dispatcher(cfg, dims, device, memory)
    moe_groups = wire_moe_blocks(model, dims, meshes, cfg, dispatcher)  # EP: dispatcher over the EP group
    model.context_parallel = ContextParallel.build(meshes, dims, dist.get_rank() if meshes else 0, cfg, model.config)
    apply_activation_checkpointing(model, cfg.parallelism.activation_checkpoint, keep_groups=moe_groups)
    if auto_compile(cfg, dims, device, dispatcher):
        apply_compile(model, cfg.compile.inductor_options)
    if meshes is not None:
        frozen_dense = frozen_dense_placement(cfg.parallelism.frozen_dense, cfg.lora.enabled,
                                              frozen_dense_bytes(model), memory)
        apply_fsdp(model, meshes, meshes.world.device_type, autocast,
                   fsdp_gather_dtype(cfg.parallelism.fsdp_param_dtype, dims.ep), frozen_dense)
    return model
