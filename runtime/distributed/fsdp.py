"""FSDP2 over the dense mesh, with a separate expert mesh under EP, and the gradient norm over
parameters that live on those different meshes. Under LoRA the frozen dense weights may instead stay whole
on every rank (parallelism.frozen_dense), which leaves the step one FSDP unit of trainable parameters.

Every FSDP reduction is a plain sum: the loss is already normalized by the global label-token count
(runtime.train), so each gradient equals the single-process gradient of the same global batch.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from moe.experts import GroupedExperts
from runtime.config import Config
from runtime.distributed.mesh import Meshes, ParallelDims
from runtime.distributed.replicate import ReplicatedGrads
from runtime.models.factory import DTYPES
from runtime.models.qwen import QwenConfig, QwenForCausalLM


def _mp_policy(device_type: str, autocast: bool = True, param_dtype: str = "bf16") -> MixedPrecisionPolicy:
    """Under CUDA autocast fp32 reductions, with parameters gathered in bf16 or (`param_dtype` fp32) in their own
    dtype, where autocast casts only matmul inputs, as on one GPU; else the parameters' own dtype (the CPU, and
    runtime.verify's fp32 runs on CUDA)."""
    if device_type == "cuda" and autocast:
        # Inputs arrive in the embedding's dtype already; a cast would rebuild every dataclass argument,
        # the per-batch AttnMeta and its CPShard (whose derived fields dataclasses.replace refuses), per block.
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if param_dtype == "bf16" else None,
                                    reduce_dtype=torch.float32, cast_forward_inputs=False)
    return MixedPrecisionPolicy()


def _expert_mp_policy(device_type: str, autocast: bool, expert_fsdp_size: int) -> MixedPrecisionPolicy:
    """The policy of the experts' own unit (under EP): bf16 gathers whatever fsdp_param_dtype says, since the
    expert kernels read bf16 and rounding before the gather equals rounding after it. With one rank on their
    FSDP mesh nothing is reduced, so no fp32 copy of every expert gradient is made for a reduction that does
    not happen (FSDP copies into the reduce dtype anyway)."""
    mp = _mp_policy(device_type, autocast)
    return dataclasses.replace(mp, reduce_dtype=None) if expert_fsdp_size == 1 else mp


def experts_left_unwrapped(expert_fsdp_size: int, packed: bool, weight_dtype: torch.dtype, device_type: str,
                           autocast: bool = True) -> bool:
    """Whether apply_fsdp gives experts no FSDP unit (_unwrapped_experts): alone on their FSDP mesh (one rank, no
    replica) and readable by the kernels as stored, i.e. not packed and already in the gather dtype. A cast copy
    (fp32 masters) would be saved for backward in every layer, where FSDP's gather is freed after forward and
    made again in backward."""
    mp = _expert_mp_policy(device_type, autocast, expert_fsdp_size)
    return expert_fsdp_size == 1 and not packed and mp.param_dtype in (None, weight_dtype)


def leaves_no_unit(cfg: Config, qcfg: QwenConfig, frozen_dense: str, dims: ParallelDims, device_type: str) -> bool:
    """apply_fsdp's layout without any FSDP unit, foreseen from the config (runtime.estimate, runtime.plan):
    frozen_dense replicate (LoRA, whose frozen experts hold model.dtype weights), and every rank's experts left
    unwrapped, or no experts."""
    if frozen_dense != "replicate":
        return False
    return not qcfg.num_experts or experts_left_unwrapped(
        dims.dp_replicate * dims.efsdp, cfg.quant.base_weights != "none", DTYPES[cfg.model.dtype], device_type)


def _unwrapped_experts(experts: GroupedExperts, mesh: DeviceMesh) -> list[nn.Parameter]:
    """Experts alone on their FSDP mesh (one rank, no replicas): nothing to gather or reduce, so no FSDP unit,
    whose per-call gathers and gradient copies of every expert weight are pure overhead there. Their
    parameters become the DTensors FSDP would make (Shard(0) over that mesh: checkpoints, the gradient norm and
    the optimizer see no difference), read as local tensors (GroupedExperts' accessors; the backends cast fp32
    LoRA factors to the activations' dtype). Returns them, for the enclosing FSDP units to ignore."""
    params = []
    for name, p in list(experts.named_parameters(recurse=False)):
        sharded = nn.Parameter(DTensor.from_local(p.data, mesh, [Shard(0)], run_check=False),
                               requires_grad=p.requires_grad)
        setattr(experts, name, sharded)
        params.append(sharded)
    return params


# 1/8 of a 64 GiB device, below every GPU this runtime is sized for: the CPU (tests, tiny models) replicates.
FROZEN_DENSE_CAP = 8 * 2**30


def fsdp_gather_dtype(setting: str, ep: int) -> str:
    """parallelism.fsdp_param_dtype resolved: auto is fp32 under EP, where the experts (the bulk of the bytes)
    gather in their own bf16 units and fp32 gathers of the rest cost nothing measurable, and bf16 without EP,
    where the experts would gather in fp32 with their block (slower: docs/benchmarks.md#fsdp-gathers)."""
    if setting != "auto":
        return setting
    return "fp32" if ep > 1 else "bf16"


def frozen_dense_placement(setting: str, lora_enabled: bool, frozen_dense_bytes: int,
                           device_memory_bytes: int | None) -> str:
    """parallelism.frozen_dense resolved to "replicate" or "shard". auto replicates under LoRA when the frozen
    dense weights take at most 1/8 of device memory (what replication adds on every rank next to the experts,
    activations and buffers), or at most FROZEN_DENSE_CAP where the memory is unknown (the CPU); else shard.
    A full fine-tune has no frozen weights: it shards."""
    if setting != "auto":
        return setting
    if not lora_enabled:
        return "shard"
    budget = FROZEN_DENSE_CAP if device_memory_bytes is None else device_memory_bytes // 8
    return "replicate" if frozen_dense_bytes <= budget else "shard"


def _expert_params(model: nn.Module) -> set[nn.Parameter]:
    return {p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}


def frozen_dense_bytes(model: nn.Module) -> int:
    """Bytes of the frozen parameters outside the experts: what frozen_dense replicate keeps whole on every rank."""
    experts = _expert_params(model)
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad and p not in experts)


def apply_fsdp(model: QwenForCausalLM, meshes: Meshes, device_type: str, autocast: bool = True,
               param_dtype: str = "bf16", frozen_dense: str = "shard") -> None:
    """FSDP2 units: each decoder block, under EP its experts (their own mesh), and the root; `param_dtype`:
    runtime.plan.fsdp_gather_dtype's bf16 or fp32. `frozen_dense` replicate (frozen_dense_placement): no block
    unit; the frozen dense parameters stay plain tensors on every rank and the experts take their own units as
    under EP. The trainable ones outside the experts join the root unit (one gather at the start of forward, one
    reduce-scatter at the end of each backward), or, where no expert unit was made (each rank alone on its
    experts' mesh), stay plain tensors too: no FSDP unit at all, model.replicated_grads sums their gradients."""
    mp = _mp_policy(device_type, autocast, param_dtype)
    expert_mp = _expert_mp_policy(device_type, autocast, meshes.expert_fsdp.size())
    replicate = frozen_dense == "replicate"
    fsdp_modules = []
    ignored: set[nn.Parameter] = set()
    own_expert_units = meshes.experts["ep"].size() > 1 or replicate
    for block in model.model.layers.values():
        experts = getattr(block.mlp, "experts", None)
        # Under EP the experts shard over their own mesh (or, alone on it, need no unit); otherwise they join
        # the block's unit (a nested unit's hooks would also land inside a compiled block forward).
        unwrapped: set[nn.Parameter] = set()
        if experts is not None and own_expert_units:
            if experts_left_unwrapped(meshes.expert_fsdp.size(), experts.is_quantized,
                                      experts.base_weight("gate_up").dtype, device_type, autocast):
                unwrapped.update(_unwrapped_experts(experts, meshes.expert_fsdp))
            else:
                fsdp_modules.append(fully_shard(experts, mesh=meshes.expert_fsdp, mp_policy=expert_mp))
        ignored |= unwrapped
        if not replicate:
            fsdp_modules.append(fully_shard(block, mesh=meshes.dense, mp_policy=mp,
                                            ignored_params=unwrapped or None))
    if replicate:
        # The experts' units (just made) own their frozen weights; every other frozen weight stays whole
        experts = _expert_params(model)
        ignored |= {p for p in model.parameters() if not p.requires_grad and p not in experts}
        if not fsdp_modules:  # nothing left to shard: the trainables stay whole too, summed by one all-reduce
            model.replicated_grads = ReplicatedGrads([p for p in model.parameters() if p not in ignored])
            return
    fsdp_modules.append(fully_shard(model, mesh=meshes.dense, mp_policy=mp, ignored_params=ignored or None))
    for module in fsdp_modules:
        module.set_gradient_divide_factor(1.0)  # sums: the loss is already normalized globally
        module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)


def _replication(t: torch.Tensor, world_size: int) -> int:
    """How many ranks of the world hold each element of t (DTensor replicas, or all for plain tensors)."""
    if isinstance(t, DTensor):
        return math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements) if p.is_replicate())
    return world_size


def local_grads(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's shard of every gradient (a DTensor's local tensor shares its storage)."""
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]


def total_grad_norm(grads: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """L2 norm over gradients that live on different meshes (dense FSDP, expert FSDP x EP): every rank
    adds its local shards' squares, weighted so replicated elements count once, then one all-reduce.
    Per-tensor norms come from one multi-tensor kernel per (replication, device, dtype) group, fp32
    accumulated (a kernel per gradient costs tens of ms per step at billions of parameters)."""
    if not grads:
        return torch.zeros(())
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g, local in zip(grads, local_grads(grads)):
        groups.setdefault((_replication(g, world_size), local.device, local.dtype), []).append(local)
    device = next(iter(groups))[1]
    sq = torch.zeros((), device=device, dtype=torch.float32)
    for (replication, _, _), tensors in groups.items():
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
        sq += torch.stack(norms).pow(2).sum() / replication
    if world_size > 1:
        dist.all_reduce(sq)
    return sq.sqrt()
