"""The plan of a run: every `auto` resolved once, every cross-check, before any process group.

    p = plan(cfg, world, device)     # Plan, or ConfigError / MeshError naming the key, the reason and the fix
    p.config                          # cfg with every implementation name concrete (what train builds from)
    p.resolved()                      # {"model.expert_backend": "grouped_mm", ...}: what `auto` became
    p.write(run_folder)               # resolved.yaml beside the config.yaml the user wrote

Choices are matched by the capabilities each implementation declares where it registers
(gpu.registry.Capabilities: devices, availability on this install, compile, EP, CP, LoRA, FP4 base), never
by name. `auto` takes the available implementation of highest priority whose capabilities fit the run; a
named one that cannot run here, or cannot do what the run asks, is one error line. Layers receive these
names and never resolve anything.

`resolve_model_choices(qcfg, device)` applies the same rules to a model config alone (runtime.models.build,
direct model construction), where no run config exists.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from runtime.config import Config, ConfigError

log = logging.getLogger("runtime")

RESOLVED_FILE = "resolved.yaml"  # in the run folder, beside config.yaml (what the user wrote)

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
    lora: bool = False
    ep: int = 1
    cp: int = 1
    dtype: str = "float32"  # model.dtype


def _mismatch(key: str, name: str, caps, needs: Needs, uses: set[str]) -> str | None:
    """Why `name` (capabilities `caps`) cannot do what the run needs, naming the keys involved; None if it can.
    `uses`: the needs that apply to this key."""
    if "compile" in uses and needs.compile and not caps.compile:
        return f"{name} runs in eager mode only, but compile.enabled is true"
    if "compile" in uses and needs.compile and needs.quantized != "none" and not caps.compile_quantized:
        return (f"{name} does not compile FP4-packed experts (quant.base_weights: {needs.quantized}; it dequantizes "
                "them in eager mode only), but compile.enabled is true")
    if ("compile" in uses and needs.compile and needs.device == "cpu"
            and needs.dtype not in caps.compile_cpu_dtypes):
        return (f"{name} compiles on the CPU only in model.dtype {' or '.join(caps.compile_cpu_dtypes)} (model.dtype "
                f"is {needs.dtype}), but compile.enabled is true")
    if "quantized" in uses and needs.quantized != "none" and not caps.quantized_base:
        return f"{name} cannot read FP4-packed experts (quant.base_weights: {needs.quantized})"
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


def _device_type(device) -> str:
    if device is None:
        return default_device()
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    return "cuda" if kind == "cuda" else "cpu"


def model_config(cfg: Config, **names):
    """The model's QwenConfig from model.path's config.json or model.config, with the run's choices
    (`names` overrides the implementation names of cfg.model)."""
    from runtime.models.hf import config_from_hf, read_hf_config

    hf = read_hf_config(cfg.model.path) if cfg.model.path else dict(cfg.model.config)
    choices = {field: getattr(cfg.model, field) for field in MODEL_CHOICES}
    return config_from_hf(hf, **{**choices, **names}, router_aux_loss_coef=cfg.model.router_aux_loss_coef,
                          router_force_balanced=cfg.model.router_force_balanced,
                          num_layers=cfg.model.num_layers_override)


@dataclass(frozen=True)
class Plan:
    user_config: Config  # as written (flags and --set applied)
    config: Config  # every implementation name concrete, fsdp_param_dtype concrete
    dims: Any  # runtime.distributed.mesh.ParallelDims
    device: str  # "cpu" | "cuda"
    compile: bool

    def resolved(self) -> dict[str, Any]:
        """Dotted key -> value of every key the plan decides (auto resolved or derived)."""
        out = {f"model.{f}": getattr(self.config.model, f) for f in MODEL_CHOICES}
        p = self.config.parallelism
        out.update({"parallelism.dispatcher": p.dispatcher, "parallelism.fsdp_param_dtype": p.fsdp_param_dtype,
                    "parallelism.cp_attention": p.cp_attention, "parallelism.cp_gdn": p.cp_gdn,
                    "compile.enabled": self.compile, "device": self.device,
                    "mesh": {"dp_replicate": self.dims.dp_replicate, "dp_shard": self.dims.dp_shard,
                             "cp": self.dims.cp, "ep": self.dims.ep}})
        return out

    def write(self, root: str | Path) -> Path:
        """<root>/resolved.yaml: what the plan resolved, next to config.yaml (what the user wrote)."""
        path = Path(root) / RESOLVED_FILE
        tmp = path.with_suffix(".yaml.tmp")
        tmp.write_text(yaml.safe_dump({"resolved": self.resolved()}, sort_keys=False))
        tmp.replace(path)
        return path


def plan(cfg: Config, world: int, device=None) -> Plan:
    """Resolves every `auto` of `cfg` for `world` ranks on `device` (a device type or torch.device; None: this
    machine's) and runs every cross-check, before any process group. Raises ConfigError / MeshError."""
    from runtime.distributed.mesh import ParallelDims

    dev = _device_type(device)
    p = cfg.parallelism
    dims = ParallelDims.resolve(p.dp_replicate, p.dp_shard, p.cp, p.ep, world)
    qcfg = model_config(cfg)  # names as written; only shapes are read here
    dims.check_experts(qcfg.num_experts)
    hybrid = any(qcfg.is_linear_attention(i) for i in range(qcfg.num_layers))
    has_moe = any(qcfg.is_moe_layer(i) for i in range(qcfg.num_layers))
    needs = Needs(dev, compile=cfg.compile.enabled, quantized=cfg.quant.base_weights,
                  lora=cfg.lora.enabled and "experts" in cfg.lora.target_modules, ep=dims.ep, cp=dims.cp,
                  dtype=cfg.model.dtype)
    m = cfg.model
    names, notes = {}, {}
    expert_uses = {"compile", "quantized", "lora", "ep"} if has_moe else set()
    for field, uses in (("expert_backend", expert_uses), ("attn_backend", {"cp", "compile"}),
                        ("norm_rope_impl", {"compile"}), ("loss_impl", set()),
                        ("gdn_op_set", {"cp", "compile"} if hybrid else set())):
        name = getattr(m, field)
        if field == "gdn_op_set" and not hybrid and name == "auto":
            names[field] = registry("model.gdn_op_set").reference()  # no GDN layer: nothing to choose
            continue
        names[field], notes[field] = choose(f"model.{field}", name, needs, uses)
    dispatcher, _ = choose("parallelism.dispatcher", p.dispatcher, needs, {"ep"})
    if hybrid and notes["gdn_op_set"] and m.gdn_op_set == "auto":
        warnings.warn(f"model.gdn_op_set auto: using op set {names['gdn_op_set']!r}, because "
                      f"{'; '.join(notes['gdn_op_set'])}", stacklevel=2)
    if has_moe and cfg.quant.base_weights != "none":
        check_fp4_blocks(cfg, qcfg)
    if dims.cp > 1:
        check_context_parallel(cfg, qcfg)
    fsdp_dtype = p.fsdp_param_dtype if p.fsdp_param_dtype != "auto" else fsdp_gather_dtype(dims.ep)
    resolved = cfg.model_copy(deep=True)
    for field, name in names.items():
        setattr(resolved.model, field, name)
    resolved.parallelism.dispatcher = dispatcher
    resolved.parallelism.fsdp_param_dtype = fsdp_dtype
    return Plan(user_config=cfg, config=resolved, dims=dims, device=dev, compile=cfg.compile.enabled)


def fsdp_gather_dtype(ep: int) -> str:
    """parallelism.fsdp_param_dtype auto: fp32 under EP, where the experts (the bulk of the bytes) gather in
    their own bf16 units and fp32 gathers of the rest cost nothing measurable; bf16 without EP, where the
    experts would gather in fp32 with their block (docs/benchmarks.md)."""
    return "fp32" if ep > 1 else "bf16"


def _model_key(cfg: Config, field: str) -> str:
    return f"model.config.{field}" if cfg.model.config is not None else f"{cfg.model.path}/config.json {field}"


def check_fp4_blocks(cfg: Config, qcfg) -> None:
    """FP4 scales blocks of 32 (mxfp4) or 16 (nvfp4) along each expert weight's input dim: hidden_size (gate_up)
    and moe_intermediate_size (down) must be multiples of the block."""
    from quant.fp4 import BLOCK_SIZE

    fmt = cfg.quant.base_weights
    block = BLOCK_SIZE[fmt]
    for field, size in (("moe_intermediate_size", qcfg.moe_intermediate_size), ("hidden_size", qcfg.hidden_size)):
        if size % block:
            others = [f for f, b in BLOCK_SIZE.items() if size % b == 0 and f != fmt]
            fix = f"quant.base_weights: {others[0]} (blocks of {BLOCK_SIZE[others[0]]})" if others else "none"
            raise ConfigError(f"quant.base_weights: {fmt} packs blocks of {block} along each expert weight's input "
                              f"dim, which does not divide {_model_key(cfg, field)} = {size}; use {fix} or "
                              "quant.base_weights: none")


def check_context_parallel(cfg: Config, qcfg) -> None:
    """What cp > 1 needs of the data and the model: rows cut into 2*cp equal pieces, heads that split for Ulysses
    and for head-parallel GDN layers, GDN state passing with pieces no shorter than the conv tail."""
    from attention.context_parallel import zigzag_index

    cp, mode = cfg.parallelism.cp, cfg.parallelism.cp_attention
    try:
        zigzag_index(cfg.data.seq_len, cp, 0)
    except ValueError as err:
        raise ConfigError(f"data.seq_len: {err}") from None
    if mode == "ulysses":
        if qcfg.num_heads % cp:
            raise ConfigError(f"parallelism.cp_attention: ulysses splits the {qcfg.num_heads} query heads over "
                              f"cp={cp}, which does not divide them; use cp_attention: allgather or another cp")
        kv = qcfg.num_kv_heads
        if kv % cp and cp % kv:
            raise ConfigError(f"parallelism.cp_attention: ulysses needs the {kv} kv heads to divide cp={cp} or be "
                              "divisible by it; use cp_attention: allgather or another cp")
    if any(qcfg.is_linear_attention(i) for i in range(qcfg.num_layers)):
        _check_gdn_cp(cfg, qcfg.gdn)


def _check_gdn_cp(cfg: Config, gdn) -> None:
    """GDN layers under parallelism.cp_gdn: heads need cp | num_k_heads; state needs pieces of at least
    conv_kernel-1 tokens (either op set)."""
    cp, piece = cfg.parallelism.cp, cfg.data.seq_len // (2 * cfg.parallelism.cp)
    if cfg.parallelism.cp_gdn == "heads":
        if gdn.num_k_heads % cp:
            raise ConfigError(f"parallelism.cp={cp}: Gated DeltaNet layers run head-parallel (parallelism.cp_gdn: "
                              f"heads) and need cp to divide linear_num_key_heads={gdn.num_k_heads}; or set "
                              "parallelism.cp_gdn: state")
        return
    if piece < gdn.conv_kernel - 1:
        raise ConfigError(f"parallelism.cp_gdn: state reads conv tails of linear_conv_kernel_dim-1 = "
                          f"{gdn.conv_kernel - 1} tokens from the previous zigzag piece, but pieces hold "
                          f"data.seq_len/(2*cp) = {piece}; use a longer data.seq_len or a smaller cp")


def resolve_model_choices(qcfg, device=None):
    """`qcfg` (a QwenConfig) with every "auto" implementation name resolved for `device` by the plan's rules,
    for models built without a run config (from_pretrained, random_init, direct construction)."""
    needs = Needs(_device_type(device))
    names = {f: choose(f"model.{f}", getattr(qcfg, f), needs)[0] for f in MODEL_CHOICES if getattr(qcfg, f) == "auto"}
    return dataclasses.replace(qcfg, **names) if names else qcfg
