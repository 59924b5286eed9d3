"""torch.compile of the decoder blocks (fullgraph: a graph break is an error) and inductor options."""

from __future__ import annotations

import torch

from runtime.models.qwen import QwenForCausalLM


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
