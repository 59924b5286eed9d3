"""transformers' own MoE experts (its grouped_mm implementation), with PEFT LoRA: the experts baseline.

    layer, backend, ids_Mk = transformers_layer(ex, ids_Mk)

What a user of transformers runs instead of our backends: `Qwen3MoeExperts` (transformers v5's fused
[E, 2I, H] / [E, H, I] layout, the layout of our GroupedExperts) with `experts_implementation="grouped_mm"`,
holding a copy of `ex`'s base weights. With a LoRA rank on `ex`: PEFT's `target_parameters` adapters on
gate_up_proj and down_proj (same r and alpha, frozen base). `backend(x, ids, w, layer)` has our
expert-backend signature, so the benchmark times it exactly as it times ours. -1 slots (an EP rank's
view) become transformers' EP sentinel (the local expert count), which its grouped_mm path skips.
tests/unit/test_bench_baseline.py checks on the CPU that it computes our layer; keep this module free of
benchmark code so that test stays small.
"""

from __future__ import annotations

import torch
from torch import nn

from moe.experts import GroupedExperts


class _Holder(nn.Module):
    """PEFT adapts parameters of a module's submodules: the experts sit one level down."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts

    def forward(self, x_MH, ids_Mk, weights_Mk):
        return self.experts(x_MH, ids_Mk, weights_Mk)


def transformers_layer(ex: GroupedExperts, ids_Mk: torch.Tensor):
    """(module, backend, ids with transformers' sentinel) for the experts `ex` (base weights copied)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    E = ex.num_experts
    config = Qwen3MoeConfig(hidden_size=ex.hidden, moe_intermediate_size=ex.intermediate, num_experts=E,
                            num_experts_per_tok=ids_Mk.shape[1], hidden_act="silu",
                            experts_implementation="grouped_mm")
    gate_up, down = ex.base_weight("gate_up"), ex.base_weight("down")
    with torch.device(gate_up.device):
        experts = Qwen3MoeExperts(config).to(gate_up.dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
    experts._is_expert_parallel = bool((ids_Mk < 0).any())
    layer: nn.Module = _Holder(experts)
    if ex.lora_rank:
        from peft import LoraConfig, get_peft_model
        lora = LoraConfig(r=ex.lora_rank, lora_alpha=ex.lora_scaling * ex.lora_rank, target_modules=[],
                          target_parameters=["experts.gate_up_proj", "experts.down_proj"])
        layer = get_peft_model(layer, lora)
    else:
        layer.requires_grad_(True)

    def backend(x_MH, ids, weights_Mk, module):
        return module(x_MH, ids, weights_Mk)

    return layer, backend, torch.where(ids_Mk < 0, E, ids_Mk)
