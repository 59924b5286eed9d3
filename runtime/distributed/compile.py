"""torch.compile of the decoder blocks (fullgraph: a graph break is an error) and inductor options.

A block is compiled whole when its MLP traces: a dense MLP, or an MoE block whose dispatcher says
`traceable` (the `local` identity, ep=1). An MoE block behind an exchange that cannot be traced (the
all_to_all dispatcher's host-side split sizes, its routing-dependent row count M) is compiled around
it, in four fullgraph regions, with dispatch and combine running eagerly between them:

    mix (norm -> attention | GDN -> residual -> norm) | router | [dispatch] | experts | [combine]
    | shared expert + sum

Every region compiles `forward` or a method, never a module's call: FSDP's hooks (the block's, and
the experts' own unit under EP) and an eager activation checkpoint around the block stay outside the
graphs. The experts region takes M rows that change with the routing every step: their dimension is
marked dynamic, so new routings reuse one graph instead of recompiling.

The regions that take the batch's AttnMeta (a whole block, or `mix`) see the packing change every step:
the document count (the length of cu_seqlens) and the longest document (max_seqlen, a python int).
Both are marked dynamic from the first step: left to dynamo, each would cost a recompile the first
time it changes. What stays is one recompile where a region branches on them (the varlen backend sends
rows of one document each to cuDNN: the first batch with more documents takes the other branch).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.fx.experimental.sym_node import DynamicInt

from attention.attention import AttnMeta
from moe.experts import GroupedExperts
from moe.layer import MoEBlock
from runtime.models.qwen import DecoderBlock, QwenForCausalLM


def apply_inductor_options(options: dict) -> None:
    """Sets torch._inductor.config keys (dotted for nested ones, e.g. "triton.cudagraphs")."""
    import torch._inductor.config as inductor_config

    for key, value in options.items():
        *parents, leaf = key.split(".")
        target = inductor_config
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, value)


def apply_compile(model: QwenForCausalLM, options: dict, backend: str = "inductor") -> None:
    """Compiles every decoder block in place (FQNs unchanged), fullgraph=True: whole, or around an
    untraceable token exchange (see the module docstring). Call it after the MoE blocks are wired
    (the dispatcher decides the split) and before FSDP. Blocks of one kind share their graphs. runtime.plan
    checked that the chosen implementations compile (Capabilities.compile...)."""
    apply_inductor_options(options)
    for block in model.model.layers.values():
        if isinstance(block.mlp, MoEBlock) and not block.mlp.dispatcher.traceable:
            _compile_around_exchange(block, backend)
        else:
            block.forward = _with_dynamic_packing(_compile(block.forward, backend))


def compile_experts(experts: GroupedExperts, backend: str = "inductor") -> None:
    """Compiles experts.forward in place (fullgraph) with the row dimension M of its inputs dynamic: M
    follows the routing (it differs per layer and step), and marked up front one graph serves every M
    from the first call; unmarked, the first change of M would recompile."""
    compiled = _compile(experts.forward, backend)

    def forward(x_MH: torch.Tensor, expert_ids_Mk: torch.Tensor, weights_Mk: torch.Tensor, **kwargs) -> torch.Tensor:
        for t in (x_MH, expert_ids_Mk, weights_Mk):
            # maybe_: an M of 0 or 1 (a rank that received almost nothing) gets a specialized graph
            # of its own instead of an error.
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(x_MH, expert_ids_Mk, weights_Mk, **kwargs)
    experts.forward = forward


def mark_packing_dynamic(meta: AttnMeta) -> AttnMeta:
    """meta with the sizes that follow the packing marked dynamic for dynamo: the document count
    (cu_seqlens' length; maybe_: a region that branches on it specializes instead of failing) and
    max_seqlen (a DynamicInt: an int to every other reader)."""
    if meta.cu_seqlens is not None:
        torch._dynamo.maybe_mark_dynamic(meta.cu_seqlens, 0)
    if meta.max_seqlen is not None and not isinstance(meta.max_seqlen, DynamicInt):
        meta = replace(meta, max_seqlen=DynamicInt(int(meta.max_seqlen)))
    return meta


def _with_dynamic_packing(compiled):
    """A compiled region of signature (h, cos, sin, meta) whose meta gets mark_packing_dynamic on every call
    (each batch brings new tensors to mark)."""
    def region(h_BSH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta):
        return compiled(h_BSH, cos, sin, mark_packing_dynamic(meta))
    return region


def _compile(fn, backend: str):
    return torch.compile(fn, backend=backend, fullgraph=True)


def _compile_around_exchange(block: DecoderBlock, backend: str) -> None:
    moe = block.mlp
    block.mix = _with_dynamic_packing(_compile(block.mix, backend))
    moe.gate.forward = _compile(moe.gate.forward, backend)
    compile_experts(moe.experts, backend)
    moe.add_shared = _compile(moe.add_shared, backend)
