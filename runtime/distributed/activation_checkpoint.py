"""Activation checkpointing of decoder blocks: full (recompute everything) or selective (keep matmul
and attention outputs, recompute the rest). Blocks call their `checkpoint_fn` around their body."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from runtime.models.qwen import QwenForCausalLM

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
