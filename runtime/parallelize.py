"""Applies the parallelism of ParallelDims to a built model: EP placement, activation checkpointing,
torch.compile of the decoder blocks, FSDP2 (dense mesh + separate expert mesh under EP), gathering
full tensors back from the shards, and gradient-norm reduction across those meshes.

Gradient scaling: every FSDP reduction is a plain sum (divide factor 1) and the loss is divided by
the global label-token count (runtime.train), so each gradient equals the single-process gradient of
the same global batch, for dense, expert, router and LoRA parameters alike.
"""

from __future__ import annotations

import functools
import math
import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from moe.dispatch import build_dispatcher
from moe.experts import GroupedExperts
from runtime.config import Config
from runtime.mesh import Meshes, ParallelDims
from runtime.models.qwen import QwenForCausalLM


def localize_experts(model: QwenForCausalLM, ep_rank: int, ep: int) -> None:
    """Keeps only this EP rank's contiguous E/ep experts in every MoE block (meta or materialized)."""
    if ep == 1:
        return
    for block in model.moe_blocks():
        old = block.experts
        per_rank = old.num_experts // ep
        lo = ep_rank * per_rank
        new = GroupedExperts(per_rank, old.hidden, old.intermediate, device=old.gate_up.device,
                             dtype=old.gate_up.dtype, expert_offset=old.expert_offset + lo)
        if not old.gate_up.is_meta:
            with torch.no_grad():
                new.gate_up.copy_(old.gate_up[lo:lo + per_rank])
                new.down.copy_(old.down[lo:lo + per_rank])
        block.experts = new


@torch.no_grad()
def seed_lora_A(model: QwenForCausalLM, seed: int) -> None:
    """Re-draws every LoRA A from a generator keyed by (seed, parameter name), for the full expert
    count, keeping this rank's slice: the same values whatever the EP size or init order (B is 0).
    Kaiming-uniform with a=sqrt(5), PEFT's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    modules = dict(model.named_modules())
    for fqn, param in model.named_parameters():
        if "lora_A" not in fqn:
            continue
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{fqn}".encode()))
        owner = modules[fqn.rsplit(".", 1)[0]]
        shape, lo = tuple(param.shape), 0
        if isinstance(owner, GroupedExperts):
            shape, lo = (model.config.num_experts, *shape[1:]), owner.expert_offset
        bound = 1.0 / math.sqrt(shape[-1])
        full = torch.empty(shape).uniform_(-bound, bound, generator=gen)
        param.copy_(full[lo:lo + param.shape[0]] if isinstance(owner, GroupedExperts) else full)


# Ops whose outputs selective checkpointing keeps; everything else in a block is recomputed.
_SAVE_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
if hasattr(torch.ops.aten, "_grouped_mm"):
    _SAVE_OPS.add(torch.ops.aten._grouped_mm.default)


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_fn(mode: str):
    """A `(fn, *args) -> out` that recomputes fn in backward: all of it (full) or all but its matmuls
    and attention (selective)."""
    if mode == "full":
        return lambda fn, *args: checkpoint(fn, *args, use_reentrant=False)

    # a partial, not a lambda: torch.compile traces checkpoint only with a global or partial context_fn
    context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)

    def selective(fn, *args):
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)
    return selective


def apply_activation_checkpointing(model: QwenForCausalLM, mode: str) -> None:
    if mode == "none":
        return
    for block in model.model.layers.values():
        block.checkpoint_fn = checkpoint_fn(mode)


def _mp_policy(device_type: str) -> MixedPrecisionPolicy:
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: QwenForCausalLM, meshes: Meshes, device_type: str) -> None:
    mp = _mp_policy(device_type)
    fsdp_modules = []
    expert_parallel = meshes.experts["ep"].size() > 1
    for block in model.model.layers.values():
        experts = getattr(block.mlp, "experts", None)
        # Under EP the experts shard over their own mesh; otherwise they join the block's unit (a
        # nested unit's hooks would also land inside a compiled block forward).
        if experts is not None and expert_parallel:
            fsdp_modules.append(fully_shard(experts, mesh=meshes.expert_fsdp, mp_policy=mp))
        fsdp_modules.append(fully_shard(block, mesh=meshes.dense, mp_policy=mp))
    fsdp_modules.append(fully_shard(model, mesh=meshes.dense, mp_policy=mp))
    for module in fsdp_modules:
        module.set_gradient_divide_factor(1.0)  # sums: the loss is already normalized globally
        module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)


def apply_inductor_options(options: dict) -> None:
    """Sets torch._inductor.config keys (dotted for nested ones, e.g. "triton.cudagraphs")."""
    import torch._inductor.config as inductor_config

    for key, value in options.items():
        *parents, leaf = key.split(".")
        target = inductor_config
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, value)


def check_compilable(model: QwenForCausalLM) -> None:
    """torch._grouped_mm traces only in bf16: fp32 experts on the CPU (no autocast) cannot compile."""
    param = model.model.embed_tokens.weight
    if (model.config.expert_backend == "grouped_mm" and model.moe_blocks() and param.device.type == "cpu"
            and param.dtype != torch.bfloat16):
        raise ValueError("compile.enabled with model.expert_backend: grouped_mm on the CPU needs model.dtype: "
                         "bfloat16 (torch._grouped_mm compiles for bf16 only); or disable compile")


def apply_compile(model: QwenForCausalLM, options: dict, backend: str = "inductor") -> None:
    """Compiles every decoder block's forward in place (FQNs unchanged) with fullgraph=True: a graph
    break is an error, not a silent slowdown. Blocks of one kind share their compiled graph."""
    check_compilable(model)
    apply_inductor_options(options)
    for block in model.model.layers.values():
        # Compile forward, not the module call: FSDP's hooks on the block must stay outside the graph.
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=True)


def parallelize(model: QwenForCausalLM, dims: ParallelDims, meshes: Meshes | None, cfg: Config) -> QwenForCausalLM:
    """EP placement (with meshes), activation checkpointing, compile, FSDP2 (with meshes), in the
    order they compose: compile wraps the checkpointed blocks, FSDP wraps the compiled ones."""
    if meshes is not None:
        for block in model.moe_blocks():
            # Every rank's tokens (data and context shards alike) form the global batch.
            block.gate.balance_group = dist.group.WORLD
            if dims.ep > 1:
                block.dispatcher = build_dispatcher(meshes.ep_group, model.config.num_experts)
    apply_activation_checkpointing(model, cfg.parallelism.activation_checkpoint)
    if cfg.compile.enabled:
        apply_compile(model, cfg.compile.inductor_options)
    if meshes is not None:
        apply_fsdp(model, meshes, meshes.world.device_type)
    return model


def _replication(t: torch.Tensor, world_size: int) -> int:
    """How many ranks of the world hold each element of t (DTensor replicas, or all for plain tensors)."""
    if isinstance(t, DTensor):
        return math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements) if p.is_replicate())
    return world_size


def total_grad_norm(grads: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """L2 norm over gradients that live on different meshes (dense FSDP, expert FSDP x EP): every rank
    adds its local shards' squares, weighted so replicated elements count once, then one all-reduce."""
    if not grads:
        return torch.zeros(())
    device = (grads[0].to_local() if isinstance(grads[0], DTensor) else grads[0]).device
    sq = torch.zeros((), device=device, dtype=torch.float32)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        sq += local.float().pow(2).sum() / _replication(g, world_size)
    if world_size > 1:
        dist.all_reduce(sq)
    return sq.sqrt()


def gather_full(t: torch.Tensor, expert: bool = False, meshes: Meshes | None = None) -> torch.Tensor:
    """The full tensor behind a parameter (or gradient): FSDP shards gathered, and for experts the
    EP ranks' slices concatenated in expert order. A collective: every rank calls it, in one order."""
    full = t.full_tensor() if isinstance(t, DTensor) else t
    if expert and meshes is not None and meshes.experts["ep"].size() > 1:
        parts = [torch.empty_like(full) for _ in range(meshes.experts["ep"].size())]
        dist.all_gather(parts, full.contiguous(), group=meshes.ep_group)
        full = torch.cat(parts)
    return full


def full_state_dict(model: nn.Module, meshes: Meshes | None, keep: bool = True) -> dict[str, torch.Tensor]:
    """Every entry of model.state_dict() as a full CPU tensor (collective: every rank calls it; see
    gather_full). Ranks with keep=False drop each tensor once gathered, so only the writer holds the model."""
    out = {}
    for fqn, t in model.state_dict().items():
        full = gather_full(t, ".experts." in fqn, meshes)
        if keep:
            out[fqn] = full.detach().cpu()
    return out
