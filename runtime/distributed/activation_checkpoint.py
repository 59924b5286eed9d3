"""Activation checkpointing of decoder blocks: full (recompute everything) or selective (keep matmul
and attention outputs, recompute the rest). Blocks call their `checkpoint_fn` around their body."""

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


def _selective_policy(save: frozenset, ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_fn(mode: str):
    """A `(fn, *args) -> out` that recomputes fn in backward: all of it (full) or all but its matmuls
    and attention (selective)."""
    if mode == "full":
        return lambda fn, *args: checkpoint(fn, *args, use_reentrant=False)

    # partials, not lambdas: torch.compile traces checkpoint only with a global or partial context_fn.
    # The ops are looked up now, after the model's layers have imported their kernels.
    policy = functools.partial(_selective_policy, frozenset(_ops(*_SAVE_OPS)))
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)

    def selective(fn, *args):
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)
    return selective


def apply_activation_checkpointing(model: QwenForCausalLM, mode: str) -> None:
    if mode == "none":
        return
    for block in model.model.layers.values():
        block.checkpoint_fn = checkpoint_fn(mode)
