"""The one model build path, for checkpoint load and random init alike:

    model on the meta device -> keep this EP rank's experts -> load its tensors from safetensors
    straight onto the target device, or materialize there and run the seeded init

    model = build(cfg, dtype, device, path=None, seed=0, ep_rank=0, ep=1, quant="none")
    model = from_pretrained(hf_dir, dtype, device, **runtime_options)   # build from a HF folder
    model = random_init(cfg, dtype, device, seed=0)

No full model is ever built on the host and nothing is initialized twice: meta construction skips
every module's own init. Under EP a rank holds, reads and draws only its E/ep experts; the seeded
init (qwen.init_weights) gives them the values the single-process model holds at those indices.
With quant="mxfp4" | "nvfp4" | "fp8" the routed experts' base weights are quantized (quant.QuantizedWeight): each
projection of one layer's local experts is read (or drawn) in `dtype`, quantized on `device` and dropped
before the next, so no dense copy of all experts exists at any time.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe.experts import GroupedExperts
from quant import quantize_experts
from runtime.choices import resolve_model_choices
from runtime.models.hf import config_from_hf, finish_materialize, load_hf_weights, read_hf_config
from runtime.models.qwen import QwenConfig, QwenForCausalLM, init_weights


def build(cfg: QwenConfig, dtype: torch.dtype, device: torch.device | str, *, path: str | Path | None = None,
          seed: int = 0, ep_rank: int = 0, ep: int = 1, quant: str = "none") -> QwenForCausalLM:
    """This rank's model on `device`: the checkpoint's weights from `path`, else the init seeded by `seed`;
    routed experts quantized unless quant is "none". "auto" names in cfg are resolved for `device`."""
    cfg = resolve_model_choices(cfg, device)
    with torch.device("meta"):
        model = QwenForCausalLM(cfg, dtype=dtype)
    keep_local_experts(model, ep_rank, ep)
    if quant != "none":
        for block in model.moe_blocks():
            quantize_experts(block.experts, quant)  # empty packed containers, filled by the load or the init
    if path is not None:
        load_hf_weights(model, path, dtype, device)
        return model
    model.to_empty(device=device)
    finish_materialize(model, device)
    init_weights(model, seed)
    return model


def keep_local_experts(model: QwenForCausalLM, ep_rank: int, ep: int) -> None:
    """Replaces every MoE block's (meta) experts by this EP rank's contiguous E/ep of them."""
    if ep == 1:
        return
    for block in model.moe_blocks():
        old = block.experts
        if not old.gate_up.is_meta:
            raise ValueError("keep_local_experts slices a meta-device model (nothing to copy)")
        if old.num_experts % ep:
            raise ValueError(f"{old.num_experts} experts do not split over ep={ep}")
        per_rank = old.num_experts // ep
        block.experts = GroupedExperts(per_rank, old.hidden, old.intermediate, device="meta",
                                       dtype=old.gate_up.dtype, expert_offset=old.expert_offset + ep_rank * per_rank)


def from_pretrained(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu",
                    **runtime_options) -> QwenForCausalLM:
    """Our model with the HF checkpoint's weights. `runtime_options`: expert_backend, attn_backend,
    norm_rope_impl, router_aux_loss_coef, num_layers."""
    cfg = config_from_hf(read_hf_config(path), **runtime_options)
    return build(cfg, dtype, device, path=path)


def random_init(cfg: QwenConfig, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0) -> QwenForCausalLM:
    """The seeded random init of `cfg` (all experts)."""
    return build(cfg, dtype, device, seed=seed)
