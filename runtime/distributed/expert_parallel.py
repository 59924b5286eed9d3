"""Expert parallelism: the MoE blocks' distributed wiring, and the one step that applies every
parallelism of ParallelDims to a built model (EP wiring, activation checkpointing, compile, FSDP2).
Which experts an EP rank holds is decided at build time (runtime.models.build.keep_local_experts).

Gradient scaling: every FSDP reduction is a plain sum (divide factor 1) and the loss is divided by
the global label-token count (runtime.train), so each gradient equals the single-process gradient of
the same global batch, for dense, expert, router and LoRA parameters alike.
"""

from __future__ import annotations

import torch.distributed as dist

from moe.dispatch import LoadReading, build_dispatcher
from runtime.config import Config
from runtime.distributed.activation_checkpoint import apply_activation_checkpointing
from runtime.distributed.compile import apply_compile
from runtime.distributed.context_parallel import ContextParallel
from runtime.distributed.fsdp import apply_fsdp, gather_dtype
from runtime.distributed.mesh import Meshes, ParallelDims
from runtime.models.qwen import QwenForCausalLM


def wire_moe_blocks(model: QwenForCausalLM, dims: ParallelDims, meshes: Meshes | None, cfg: Config) -> frozenset:
    """Every MoE block's distributed wiring, in one step: the dispatcher of parallelism.dispatcher over
    the EP group (the local identity with ep 1), the balance loss over the global micro-batch (every
    rank's tokens, data and context shards alike, with meshes), its gradient weighed by the
    micro-batches per step (so a step's balance loss is their mean). Returns the names of the groups
    the MoE blocks' collectives run over."""
    ep_group = meshes.ep_group if meshes is not None and dims.ep > 1 else None
    dispatcher = build_dispatcher(cfg.parallelism.dispatcher, ep_group, model.config.num_experts)
    balance_group = dist.group.WORLD if meshes is not None else None
    for block in model.moe_blocks():
        block.wire(dispatcher, balance_group, aux_grad_scale=1.0 / cfg.train.grad_accum_steps)
    return frozenset(g.group_name for g in (ep_group, balance_group) if g is not None)


def ep_load(model: QwenForCausalLM, device) -> LoadReading | None:
    """Routing imbalance and host skew of the EP exchanges since the last call (moe/dispatch/load.py), read
    from the dispatcher the MoE blocks share: a collective over the EP group (every rank calls it); None
    without EP or MoE layers."""
    block = next(iter(model.moe_blocks()), None)
    return None if block is None else block.dispatcher.load_reading(device)


def parallelize(model: QwenForCausalLM, dims: ParallelDims, meshes: Meshes | None, cfg: Config,
                autocast: bool = True) -> QwenForCausalLM:
    """MoE wiring (EP dispatcher with meshes), context parallelism (cp > 1), activation checkpointing,
    compile, FSDP2 (with meshes), in the order they compose: compile wraps the checkpointed blocks, FSDP
    wraps the compiled ones. `autocast`: the step computes in bf16 on CUDA (FSDP gathers bf16 parameters)."""
    moe_groups = wire_moe_blocks(model, dims, meshes, cfg)
    model.context_parallel = ContextParallel.build(meshes, dims, dist.get_rank() if meshes else 0, cfg, model.config)
    apply_activation_checkpointing(model, cfg.parallelism.activation_checkpoint, keep_groups=moe_groups)
    if cfg.compile.enabled:
        apply_compile(model, cfg.compile.inductor_options)
    if meshes is not None:
        apply_fsdp(model, meshes, meshes.world.device_type, autocast,
                   gather_dtype(cfg.parallelism.fsdp_param_dtype, dims.ep))
    return model
