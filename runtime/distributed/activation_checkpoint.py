"""Activation checkpointing of decoder blocks: full (recompute everything) or selective (keep matmul
and attention outputs, the MoE layers' collectives and host copies; recompute the rest). Blocks call their
`checkpoint_fn` around their body.

Selective keeps what recomputing would make the step wait for: the EP token exchange and the balance loss's
all-reduce (functional collectives over the groups parallelize names) and device-to-host copies (the EP
split sizes' `.tolist()`), so backward neither exchanges tokens again nor syncs the host. Context
parallelism's exchanges run over the cp group and are recomputed: keeping them would hold whole-row K/V
per layer, the memory cp exists to split."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from runtime.models.qwen import QwenForCausalLM


def _ops(*qualified: str) -> set:
    """Every overload of the named ops ("namespace::op") that this torch has registered (some exist
    only in newer releases; torch_attn's appear once torch.nn.attention.varlen is imported)."""
    found = set()
    for name in qualified:
        namespace, op = name.split("::")
        packet = getattr(getattr(torch.ops, namespace), op, None) if hasattr(torch.ops, namespace) else None
        if packet is not None:
            found.update(getattr(packet, overload) for overload in packet.overloads())
    return found


# Ops whose outputs selective checkpointing keeps (matmuls and every attention kernel the attention
# backends call); everything else in a block is recomputed.
_SAVE_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm",
             "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention",
             "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_cudnn_attention",
             "torch_attn::_varlen_attn")
# FSDP's pre-forward records a profiler range once more during recomputation than in forward when the
# experts are their own FSDP unit of one rank; selective checkpointing counts op invocations, so ops that
# only mark profiler ranges must not count (torch ignores shape queries the same way).
torch.utils.checkpoint.SAC_IGNORED_OPS |= _ops("profiler::_record_function_enter_new",
                                               "profiler::_record_function_exit")


_COLLECTIVE_OPS = ("_c10d_functional::all_to_all_single", "_c10d_functional::all_reduce",
                   "_c10d_functional::all_gather_into_tensor", "_c10d_functional::reduce_scatter_tensor")


_TO_COPY = torch.ops.aten._to_copy.default  # looked up once: the policy runs for every op of a checkpointed block


def _host_copy(args, kwargs) -> bool:
    """Whether a _to_copy is device-to-host (`.tolist()`, `.cpu()`): recomputing it would sync the host again."""
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"


def _selective_policy(save: frozenset, collectives: frozenset, keep_groups: frozenset, ctx, op, *args, **kwargs):
    keep = (op in save or (op is _TO_COPY and _host_copy(args, kwargs))
            or (op in collectives and kwargs.get("group_name", args[-1]) in keep_groups))
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_fn(mode: str, keep_groups: frozenset = frozenset()):
    """A `(fn, *args) -> out` that recomputes fn in backward: all of it (full) or all but its matmuls,
    attention, host copies and its collectives over the groups named in `keep_groups` (selective)."""
    if mode == "full":
        return lambda fn, *args: checkpoint(fn, *args, use_reentrant=False)

    # partials, not lambdas: torch.compile traces checkpoint only with a global or partial context_fn.
    # The ops are looked up now, after the model's layers have imported their kernels.
    policy = functools.partial(_selective_policy, frozenset(_ops(*_SAVE_OPS)), frozenset(_ops(*_COLLECTIVE_OPS)),
                               keep_groups)
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)

    def selective(fn, *args):
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)
    return selective


def apply_activation_checkpointing(model: QwenForCausalLM, mode: str, keep_groups: frozenset = frozenset()) -> None:
    """`keep_groups`: the names of the process groups whose collectives selective checkpointing keeps."""
    if mode == "none":
        return
    for block in model.model.layers.values():
        block.checkpoint_fn = checkpoint_fn(mode, keep_groups)
