"""transformers' own causal LM (+ PEFT LoRA) from a HF config dict: the end-to-end training baseline.

    model, note = transformers_model(hf_config, device, mode="lora" | "full", dtype=torch.bfloat16)

What a transformers user trains instead of our runtime: `AutoModelForCausalLM.from_config` on the config
class of `hf_config["model_type"]` (Qwen3MoeForCausalLM, Qwen3_5MoeForCausalLM), SDPA attention,
transformers' grouped_mm experts, no KV cache, randomly initialized on `device` in `dtype`.
mode "lora": PEFT LoRA r=16, alpha=32 on q/k/v/o_proj and, through `target_parameters`, on the fused
experts' gate_up_proj and down_proj (per-expert factors, PEFT's ParamWrapper); PEFT keeps the adapters in
fp32 and freezes the rest. mode "full": every parameter trains, in `dtype`.
`note` names what ran where transformers chooses silently (GDN kernels: fla when it imports, else torch).
"""

from __future__ import annotations

import importlib

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

LORA_RANK, LORA_ALPHA = 16, 32
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
IMPLEMENTATIONS = {"attn_implementation": "sdpa", "experts_implementation": "grouped_mm"}


def transformers_config(hf: dict):
    """transformers' config object for the HF config dict, with the baseline's implementations set."""
    kwargs = {k: v for k, v in hf.items() if k != "model_type"}
    return AutoConfig.for_model(hf["model_type"], **kwargs, **IMPLEMENTATIONS, use_cache=False)


def check_implementations(model: nn.Module) -> None:
    """Fails when transformers dropped a requested implementation (an unknown kwarg in some version, a
    silent fallback to eager) instead of timing something else than the baseline claims."""
    for key, want in IMPLEMENTATIONS.items():
        got = getattr(model.config, f"_{key}", None)
        if got != want:
            raise RuntimeError(f"transformers {transformers.__version__} built {type(model).__name__} with "
                               f"{key}={got!r}, not {want!r}")


def transformers_model(hf: dict, device: torch.device | str, mode: str,
                       dtype: torch.dtype = torch.bfloat16) -> tuple[nn.Module, str]:
    """(model ready to train, note on the implementations) built as the module docstring says."""
    if mode not in ("lora", "full"):
        raise ValueError(f"mode {mode!r}: use lora or full")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(transformers_config(hf), dtype=dtype)
    check_implementations(model)
    note = ", ".join(filter(None, [f"{type(model).__name__} sdpa grouped_mm", gdn_kernels(model),
                                   f"transformers {transformers.__version__}"]))
    if mode == "lora":
        model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=TARGET_MODULES,
                                                 target_parameters=TARGET_PARAMETERS))
        note += f", peft {peft.__version__}"
    model.train()
    return model, note


def gdn_kernels(model: nn.Module) -> str | None:
    """Which Gated DeltaNet kernels the model's linear-attention layers run; None without such layers.
    transformers 5.17 binds them per layer (`layer.chunk_gated_delta_rule`, `layer.causal_conv1d_fn`, None for
    the torch conv); 5.23 picks fla / causal_conv1d at import when those provide the function, else torch."""
    layer = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    if layer is None:
        return None
    if hasattr(layer, "chunk_gated_delta_rule"):
        fla = layer.chunk_gated_delta_rule.__module__.startswith("fla")
        conv = getattr(layer, "causal_conv1d_fn", None) is not None
    else:
        fla, conv = _provides("fla.ops", "chunk_gated_delta_rule"), _provides("causal_conv1d", "causal_conv1d_fn")
    return (f"gdn {'fla' if fla else 'torch fallback'}, conv1d {'causal_conv1d' if conv else 'torch'}")


def _provides(module: str, name: str) -> bool:
    try:
        return getattr(importlib.import_module(module), name, None) is not None
    except Exception:  # noqa: BLE001 - transformers falls back on any import failure; so does this answer
        return False

