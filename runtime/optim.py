"""What trainable parameters are kept in, the optimizer that updates them, and the LR schedule.

`optim.master_dtype` picks one of two contracts (apply_master_dtype, then build_optimizer):

    fp32  trainable parameters fp32 on CUDA (bf16 autocast computes, FSDP2 gathers them in bf16), fp32
          grads, torch AdamW (fused on CUDA) with fp32 states: 16 bytes per trainable parameter. Off CUDA
          there is no autocast: parameters stay in model.dtype. The reference; pick it for LoRA (few
          trainable parameters, so nothing to save) or whenever memory allows.
    bf16  trainable parameters bf16 everywhere, bf16 grads, torchao's AdamW with bf16 states that
          computes each update in fp32 and writes it back with stochastic rounding: 8 bytes per
          parameter. Pick it for full fine-tunes that do not fit with fp32 masters. Stochastic rounding
          is what keeps it training: an update below half a bf16 ulp (2^-9 to 2^-8 of the weight) rounds to
          nearest as no change at all, so plain bf16 AdamW stalls once lr * update is that small,
          while rounded stochastically the weight moves by it on average.

The bf16 optimizer (torchao 0.18's `_AdamW`) steps parameter by parameter, each update one
torch.compile'd function (Triton on CUDA, C++ on the CPU: a compile per distinct parameter shape and
placement on the first step), FSDP2 and EP DTensor shards included; its states are bf16 tensors shaped
and placed like their parameter, saved and resumed by DCP like torch AdamW's. It holds its lr as a
tensor (so the compiled update is not recompiled per lr): the schedule fills it in place and
`scheduler.get_last_lr()` returns tensors. Its stochastic rounding draws from the device's default
generator, which checkpoints save and restore, so a resumed run repeats the uninterrupted one.
"""

from __future__ import annotations

import math

import torch

from runtime.config import Config, OptimConfig

MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def lr_factor(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Linear warmup to 1, then cosine down to min_lr_ratio at max_steps (`step` counts from 0)."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    progress = (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * cosine


def apply_master_dtype(model: torch.nn.Module, master_dtype: str, device: torch.device) -> None:
    """Casts the trainable parameters in place to what `master_dtype` keeps them in (module docstring);
    frozen parameters keep model.dtype. Call after LoRA is applied and before FSDP shards the model."""
    if master_dtype == "fp32" and device.type != "cuda":
        return  # no autocast off CUDA: parameters compute in their own dtype, model.dtype's
    dtype = MASTER_DTYPES[master_dtype]
    if master_dtype == "bf16" and device.type != "cuda":
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()}
        if frozen - {dtype}:
            raise ValueError(f"optim.master_dtype: bf16 on {device.type} needs model.dtype: bfloat16 when some "
                             f"parameters are frozen (they are {sorted(map(str, frozen))}): without autocast "
                             "bf16 trainable and fp32 frozen weights cannot compute together")
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(dtype)


def build_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device):
    """(optimizer, LambdaLR scheduler) over the trainable parameters, per cfg.optim.master_dtype; the
    parameters must already be in that dtype (apply_master_dtype)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: enable lora or unfreeze the model")
    o = cfg.optim
    if o.master_dtype == "bf16":
        optimizer = _stochastic_rounding_adamw(params, o)
    else:
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                      fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, o, cfg.train.max_steps))
    return optimizer, scheduler


def _stochastic_rounding_adamw(params: list[torch.nn.Parameter], o: OptimConfig) -> torch.optim.Optimizer:
    # torchao only rounds bf16 parameters stochastically; any other dtype would silently round to nearest.
    if wrong := sorted({str(p.dtype) for p in params if p.dtype != torch.bfloat16}):
        raise ValueError(f"optim.master_dtype: bf16 needs bf16 trainable parameters, found {wrong}: "
                         "call runtime.optim.apply_master_dtype before build_optimizer")
    try:
        # torchao 0.18 names its plain (unquantized) AdamW `_AdamW`; it is the one with bf16 states.
        from torchao.optim import _AdamW
    except ImportError as err:
        raise ImportError("optim.master_dtype: bf16 needs torchao>=0.18 (its AdamW with bf16 stochastic "
                          "rounding): pip install 'torchao>=0.18', or set optim.master_dtype: fp32") from err
    return _AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                  bf16_stochastic_round=True)
