"""Expert parallelism: the MoE blocks' distributed wiring (dispatcher over the EP group, balance loss over
the global micro-batch) and the dispatcher they share. Which experts an EP rank holds is decided at build time
(runtime.models.build.keep_local_experts); runtime.distributed.parallelize applies this with the rest."""

from __future__ import annotations

import torch.distributed as dist

from moe.dispatch import Dispatcher, build_dispatcher
from runtime.config import Config
from runtime.distributed.mesh import Meshes, ParallelDims
from runtime.models.qwen import QwenForCausalLM


def wire_moe_blocks(model: QwenForCausalLM, dims: ParallelDims, meshes: Meshes | None, cfg: Config,
                    dispatcher_name: str) -> frozenset:
    """Every MoE block's distributed wiring, in one step: the dispatcher `dispatcher_name` (concrete) over
    the EP group (the local identity with ep 1), the balance loss over the global micro-batch (every
    rank's tokens, data and context shards alike, with meshes), its gradient weighed by the
    micro-batches per step (so a step's balance loss is their mean). Returns the names of the groups
    the MoE blocks' collectives run over."""
    ep_group = meshes.ep_group if meshes is not None and dims.ep > 1 else None
    tokens_per_rank = cfg.train.micro_batch_size * cfg.data.seq_len // dims.cp
    dispatcher = build_dispatcher(dispatcher_name, ep_group, model.config.num_experts, tokens_per_rank,
                                  cfg.parallelism.gather_capacity)
    balance_group = dist.group.WORLD if meshes is not None else None
    for block in model.moe_blocks():
        block.wire(dispatcher, balance_group, aux_grad_scale=1.0 / cfg.train.grad_accum_steps)
    return frozenset(g.group_name for g in (ep_group, balance_group) if g is not None)


def moe_dispatcher(model: QwenForCausalLM) -> Dispatcher | None:
    """The dispatcher the MoE blocks share (None without MoE layers)."""
    block = next(iter(model.moe_blocks()), None)
    return None if block is None else block.dispatcher
