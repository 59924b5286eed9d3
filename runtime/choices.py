"""Choosing implementations by capability: `choose(key, name, needs)` turns a config key's name ("auto" or a
named implementation) into one that can run here and do what the run needs, from the capabilities each
implementation declares where it registers (gpu.registry.Capabilities), never by name; a choice that cannot
run is one ConfigError line (key, reason, fix). runtime.plan applies it to a run's config;
`resolve_model_choices` to a model config alone (model construction without a run config).

Imports nothing of the runtime above runtime.errors, so model code may use it without an import circle.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

from runtime.errors import ConfigError

# config key -> the module that owns its registry (imported only when a plan is made)
_REGISTRY_MODULES = {
    "model.expert_backend": ("moe.backends", "EXPERT_BACKENDS"),
    "model.attn_backend": ("attention.attention", "ATTN_BACKENDS"),
    "model.norm_rope_impl": ("attention.norm_rope", "NORM_ROPE_IMPLS"),
    "model.loss_impl": ("runtime.loss", "LOSS_IMPLS"),
    "model.gdn_op_set": ("attention.gdn", "GDN_OP_SETS"),
    "parallelism.dispatcher": ("moe.dispatch", "DISPATCHERS"),
}
MODEL_CHOICES = ("expert_backend", "attn_backend", "norm_rope_impl", "loss_impl", "gdn_op_set")


def registry(config_key: str):
    module, name = _REGISTRY_MODULES[config_key]
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Needs:
    """What a run asks of the implementations; each flag is matched against gpu.registry.Capabilities."""
    device: str
    compile: bool = False
    quantized: str = "none"  # quant.base_weights
    train_fp8: bool = False  # quant.train_fp8 names the experts
    lora: bool = False
    ep: int = 1
    cp: int = 1
    dtype: str = "float32"  # model.dtype


def _mismatch(key: str, name: str, caps, needs: Needs, uses: set[str]) -> str | None:
    """Why `name` (capabilities `caps`) cannot do what the run needs, naming the keys involved; None if it can.
    `uses`: the needs that apply to this key."""
    if "quantized" in uses and needs.quantized != "none" and needs.quantized not in caps.quantized_base:
        return f"{name} cannot read {needs.quantized} experts (quant.base_weights: {needs.quantized})"
    if "compile" in uses and needs.compile and not caps.compile:
        return f"{name} runs in eager mode only, but compile.enabled is true"
    if ("compile" in uses and needs.compile and needs.quantized != "none"
            and needs.quantized not in caps.compile_quantized):
        return (f"{name} runs {needs.quantized} experts (quant.base_weights: {needs.quantized}) in eager mode only, "
                "but compile.enabled is true")
    if ("compile" in uses and needs.compile and needs.device == "cpu"
            and needs.dtype not in caps.compile_cpu_dtypes):
        return (f"{name} compiles on the CPU only in model.dtype {' or '.join(caps.compile_cpu_dtypes)} (model.dtype "
                f"is {needs.dtype}), but compile.enabled is true")
    if "quantized" in uses and needs.train_fp8 and not caps.train_fp8:
        return f"{name} has no FP8 expert GEMMs (quant.train_fp8)"
    if "compile" in uses and "quantized" in uses and needs.compile and needs.train_fp8 and not caps.compile_train_fp8:
        return f"{name} trains its experts in FP8 (quant.train_fp8) in eager mode only, but compile.enabled is true"
    if "lora" in uses and needs.lora and not caps.lora:
        return f"{name} has no LoRA path (lora.enabled with experts in lora.target_modules)"
    if "ep" in uses and needs.ep > 1 and not caps.ep:
        return f"{name} keeps every expert on every rank, but parallelism.ep is {needs.ep}"
    if "cp" in uses and needs.cp > 1 and not caps.cp:
        return f"{name} does not run under context parallelism (parallelism.cp {needs.cp})"
    return None


def choose(key: str, name: str, needs: Needs, uses: set[str] = frozenset()) -> tuple[str, list[str]]:
    """(the concrete name for `name` under `key`, notes on candidates `auto` passed over). Raises ConfigError
    (one line: key, reason, fix) when a named implementation cannot run or fit, or `auto` finds none."""
    reg = registry(key)

    def problem(n: str) -> str | None:
        reason = reg.unavailable_reason(n, needs.device)
        if reason is not None:
            return f"{n} cannot run here: {reason}"
        return _mismatch(key, n, reg.capabilities(n), needs, uses)

    if name == "auto" and reg.offers_auto:
        passed = []
        for candidate in reg.candidates(needs.device):
            why = problem(candidate)
            if why is None:
                return candidate, passed
            passed.append(why)
        raise ConfigError(f"{key}: auto finds no {reg.kind} for this run ({'; '.join(passed) or 'none is declared'}); "
                          f"name one of {_fitting(reg, problem) or reg.names()} or change the run")
    why = problem(name)
    if why is not None:
        fits = _fitting(reg, problem)
        fix = f"choose one of {fits}" if fits else "change the run's settings named above"
        raise ConfigError(f"{key}: {why}; {fix}" + (" (or auto)" if fits and reg.offers_auto else ""))
    return name, []


def _fitting(reg, problem) -> list[str]:
    return [n for n in reg.names() if n != "auto" and problem(n) is None]


def default_device() -> str:
    """The device type training will use here (runtime.distributed.process_group.init_distributed's choice)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_type(device) -> str:
    if device is None:
        return default_device()
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    return "cuda" if kind == "cuda" else "cpu"


def resolve_model_choices(qcfg, device=None):
    """`qcfg` (a QwenConfig) with every "auto" implementation name resolved for `device` by the plan's rules,
    for models built without a run config (from_pretrained, random_init, direct construction)."""
    needs = Needs(device_type(device))
    names = {f: choose(f"model.{f}", getattr(qcfg, f), needs)[0] for f in MODEL_CHOICES if getattr(qcfg, f) == "auto"}
    return dataclasses.replace(qcfg, **names) if names else qcfg
