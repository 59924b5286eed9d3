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

The matching itself lives in runtime.choices, which model construction uses too.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from quant.weight import FP4_FORMATS
from runtime.choices import MODEL_CHOICES, Needs, choose, device_type, registry
from runtime.config import Config, ConfigError

log = logging.getLogger("runtime")

RESOLVED_FILE = "resolved.yaml"  # in the run folder, beside config.yaml (what the user wrote)

@dataclass(frozen=True)
class Plan:
    user_config: Config  # as written (flags and --set applied)
    config: Config  # every implementation name concrete, fsdp_param_dtype and frozen_dense concrete
    dims: Any  # runtime.distributed.mesh.ParallelDims
    device: str  # "cpu" | "cuda"

    def resolved(self) -> dict[str, Any]:
        """Dotted key -> value of every key the plan decides (auto resolved or derived)."""
        out = {f"model.{f}": getattr(self.config.model, f) for f in MODEL_CHOICES}
        p = self.config.parallelism
        out.update({"parallelism.dispatcher": p.dispatcher, "parallelism.fsdp_param_dtype": p.fsdp_param_dtype,
                    "parallelism.frozen_dense": p.frozen_dense,
                    "parallelism.cp_attention": p.cp_attention, "parallelism.cp_gdn": p.cp_gdn,
                    "compile.enabled": self.config.compile.enabled, "device": self.device,
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


def plan(cfg: Config, world: int, device=None, device_memory: int | None = None) -> Plan:
    """Resolves every `auto` of `cfg` for `world` ranks on `device` (a device type or torch.device; None: this
    machine's) and runs every cross-check, before any process group. Raises ConfigError / MeshError.
    device_memory: one device's memory in bytes (None: this machine's CUDA device's, where there is one)."""
    from runtime.distributed.fsdp import fsdp_gather_dtype, leaves_no_unit
    from runtime.distributed.mesh import ParallelDims
    from runtime.models.hf import model_config

    check_combinations(cfg)
    dev = device_type(device)
    if device_memory is None and dev == "cuda" and torch.cuda.is_available():  # --estimate: maybe no GPU here
        device_memory = device_memory_bytes(dev)
    p = cfg.parallelism
    dims = ParallelDims.resolve(p.dp_replicate, p.dp_shard, p.cp, p.ep, world)
    qcfg = model_config(cfg)  # names as written; only shapes are read here
    dims.check_experts(qcfg.num_experts)
    hybrid = any(qcfg.is_linear_attention(i) for i in range(qcfg.num_layers))
    has_moe = any(qcfg.is_moe_layer(i) for i in range(qcfg.num_layers))
    wanted_dispatcher = auto_dispatcher(cfg, dims, dev, device_memory)
    compiled = auto_compile(cfg, dims, dev, wanted_dispatcher)
    needs = Needs(dev, compile=compiled, quantized=cfg.quant.base_weights,
                  train_fp8=cfg.quant.train_fp8 != "none",
                  lora=cfg.lora.enabled and "experts" in cfg.lora.target_modules, ep=dims.ep, cp=dims.cp,
                  dtype=cfg.model.dtype)
    m = cfg.model
    try:
        names, notes = choose_model(cfg, needs, has_moe, hybrid)
    except ConfigError:
        if not compiled or cfg.compile.enabled != "auto":
            raise
        # compile auto on, but an implementation the config names does not compile: it runs eager
        compiled, needs = False, replace(needs, compile=False)
        names, notes = choose_model(cfg, needs, has_moe, hybrid)
    dispatcher, _ = choose("parallelism.dispatcher", wanted_dispatcher, needs, {"ep"})
    if hybrid and notes["gdn_op_set"] and m.gdn_op_set == "auto":
        warnings.warn(f"model.gdn_op_set auto: using op set {names['gdn_op_set']!r}, because "
                      f"{'; '.join(notes['gdn_op_set'])}", stacklevel=2)
    if has_moe and cfg.quant.base_weights in FP4_FORMATS:
        check_fp4_blocks(cfg, qcfg)
    if has_moe and (cfg.quant.base_weights == "fp8" or cfg.quant.train_fp8 != "none"):
        check_fp8(cfg, qcfg, dev)
    if dims.cp > 1:
        check_context_parallel(cfg, qcfg)
    if p.frozen_dense == "replicate" and not cfg.lora.enabled:
        raise ConfigError("parallelism.frozen_dense: replicate needs lora.enabled (a full fine-tune has no frozen "
                          "weights); set parallelism.frozen_dense to auto or shard")
    fsdp_dtype = fsdp_gather_dtype(p.fsdp_param_dtype, dims.ep)
    frozen_dense = resolve_frozen_dense(cfg, qcfg, device_memory)
    if cfg.train.graph_step:
        check_graph_step(cfg, dims, dev, hybrid, dispatcher, leaves_no_unit(cfg, qcfg, frozen_dense, dims, dev))
    resolved = cfg.model_copy(deep=True)
    for field, name in names.items():
        setattr(resolved.model, field, name)
    resolved.parallelism.dispatcher = dispatcher
    resolved.compile.enabled = compiled
    resolved.parallelism.fsdp_param_dtype = fsdp_dtype
    resolved.parallelism.frozen_dense = frozen_dense
    return Plan(user_config=cfg, config=resolved, dims=dims, device=dev)


def resolve_frozen_dense(cfg: Config, qcfg, device_memory: int | None) -> str:
    """parallelism.frozen_dense resolved (runtime.distributed.fsdp.frozen_dense_placement): auto under LoRA weighs
    the frozen dense weights of the run's model, built on the meta device as build_model builds it."""
    from runtime.distributed.fsdp import frozen_dense_bytes, frozen_dense_placement
    from runtime.models.factory import meta_model

    setting = cfg.parallelism.frozen_dense
    frozen_bytes = frozen_dense_bytes(meta_model(cfg, qcfg)) if setting == "auto" and cfg.lora.enabled else 0
    return frozen_dense_placement(setting, cfg.lora.enabled, frozen_bytes, device_memory)


def choose_model(cfg: Config, needs: Needs, has_moe: bool, hybrid: bool) -> tuple[dict, dict]:
    """({field: concrete name}, {field: notes on what auto passed over}) for every model choice of `cfg`."""
    names, notes = {}, {}
    expert_uses = {"compile", "quantized", "lora", "ep"} if has_moe else set()
    for field, uses in (("expert_backend", expert_uses), ("attn_backend", {"cp", "compile"}),
                        ("norm_rope_impl", {"compile"}), ("loss_impl", set()),
                        ("gdn_op_set", {"cp", "compile"} if hybrid else set())):
        name = getattr(cfg.model, field)
        if field == "gdn_op_set" and not hybrid and name == "auto":
            names[field] = registry("model.gdn_op_set").reference()  # no GDN layer: nothing to choose
            continue
        names[field], notes[field] = choose(f"model.{field}", name, needs, uses)
    return names, notes


def device_memory_bytes(device_type: str) -> int | None:
    """This process's accelerator memory; None on the CPU (frozen_dense_placement's fixed cap applies)."""
    if device_type != "cuda":
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


# all_gather sends every token to every EP rank: past ep 4 that is 1.5x all_to_all's bytes (moe/dispatch/all_gather.py)
GATHER_MAX_EP = 4
# The share of device memory all_gather's estimated peak may take (the estimate's error, the allocator's slack)
GATHER_MEMORY_SHARE = 0.9
GATHER_GROWTH_MARGIN = 1.5 ** 2


def auto_dispatcher(cfg: Config, dims, device: str, device_memory_bytes: int | None) -> str:
    """parallelism.dispatcher resolved: a named one as written; auto is all_gather for LoRA on CUDA at
    1 < ep <= GATHER_MAX_EP where the estimated peak with it (its bound grown twice) fits GATHER_MEMORY_SHARE
    of the device (no host
    sync: faster there, docs/config-auto.md), else all_to_all (a full fine-tune: all_gather's bytes share NCCL
    with FSDP's gathers and measured slower)."""
    name = cfg.parallelism.dispatcher
    if name != "auto":
        return name
    if not (cfg.lora.enabled and device == "cuda" and 1 < dims.ep <= GATHER_MAX_EP and device_memory_bytes):
        return "all_to_all"
    from runtime.estimate import estimate

    gathered = cfg.model_copy(deep=True)
    gathered.parallelism.dispatcher = "all_gather"
    # its bound after two growths: random-init routing's busiest rank takes 1.3-1.5x the mean (docs/benchmarks.md)
    gathered.parallelism.gather_capacity = cfg.parallelism.gather_capacity * GATHER_GROWTH_MARGIN
    peak = estimate(gathered, dims, cuda=True, device_memory_bytes=device_memory_bytes).peak
    return "all_gather" if peak <= GATHER_MEMORY_SHARE * device_memory_bytes else "all_to_all"


def auto_compile(cfg: Config, dims, device: str, dispatcher: str) -> bool:
    """compile.enabled resolved: true or false as written; auto compiles a LoRA run on CUDA without FP8 training
    or context parallelism, on one device or at ep = world on the all_gather dispatcher (`dispatcher`: as
    resolved), where compiled steps measured faster than eager (docs/config-auto.md), else runs eager. plan()
    turns auto back to false where an implementation the config names cannot compile."""
    enabled = cfg.compile.enabled
    if enabled != "auto":
        return enabled
    ep_world = dims.ep == dims.world_size and dispatcher == "all_gather"
    return (cfg.lora.enabled and device == "cuda" and (dims.world_size == 1 or ep_world) and dims.cp == 1
            and cfg.quant.train_fp8 == "none")


def check_graph_step(cfg: Config, dims, device: str, hybrid: bool, dispatcher: str, no_unit: bool) -> None:
    """train.graph_step's needs, `dispatcher` as resolved, `no_unit`: the layout has no FSDP unit
    (runtime.distributed.fsdp.leaves_no_unit), whose hooks a CUDA graph cannot hold."""
    several = dims.world_size > 1
    why = ("it replays CUDA graphs" if device != "cuda" else
           "context parallelism is not captured yet" if dims.cp > 1 else
           "GDN layers are not captured yet" if hybrid else
           "it needs torch's fused AdamW (optim.master_dtype: fp32)" if cfg.optim.master_dtype != "fp32" else
           "this layout has FSDP units, whose hooks a CUDA graph cannot hold (on several GPUs it needs LoRA at "
           "parallelism.ep = the world size, frozen_dense replicate and a bf16 expert base)"
           if several and not no_unit else
           f"parallelism.dispatcher {dispatcher} reads its counts on the host (it needs all_gather)"
           if several and dispatcher != "all_gather" else
           None)
    if why:
        raise ConfigError(f"train.graph_step: {why}; set train.graph_step: false")


def check_combinations(cfg: Config) -> None:
    """Keys of different sections that must agree (each section's own keys are checked by the schema)."""
    if cfg.optim.warmup_steps >= cfg.train.max_steps and cfg.optim.warmup_steps > 0:
        raise ConfigError(f"optim.warmup_steps ({cfg.optim.warmup_steps}) must be smaller than "
                          f"train.max_steps ({cfg.train.max_steps})")
    if cfg.model.config is not None and cfg.data.tokenizer is None:
        raise ConfigError("model.config (random init) has no tokenizer: set data.tokenizer")
    p = cfg.parallelism
    # Accepted by the schema but not built yet: refuse rather than train wrongly.
    if p.cp > 1 and cfg.data.seq_len % (2 * p.cp):
        raise ConfigError(f"parallelism.cp={p.cp} cuts every row into 2*cp = {2 * p.cp} equal pieces; set "
                          f"data.seq_len (now {cfg.data.seq_len}) to a multiple of {2 * p.cp}")
    if cfg.checkpoint.export_merged and not cfg.lora.enabled:
        raise ConfigError("checkpoint.export_merged merges LoRA adapters into the base weights, but lora.enabled "
                          "is false; a full fine-tune's HF checkpoint is checkpoint.export_hf")
    if outside := sorted(s for s in cfg.profiling.steps if not 1 <= s <= cfg.train.max_steps):
        raise ConfigError(f"profiling.steps {outside} are not steps of this run (1..train.max_steps = "
                          f"{cfg.train.max_steps})")
    if cfg.train.eval_every_n_steps and not cfg.data.has_eval:
        raise ConfigError("train.eval_every_n_steps is set but there is no eval data; set data.eval (a file) or "
                          "data.eval_fraction")
    if cfg.quant.train_fp8 != "none" and cfg.lora.enabled:
        raise ConfigError(f"quant.train_fp8: {cfg.quant.train_fp8} trains the expert GEMMs' weights in FP8 (a full "
                          "fine-tune), but lora.enabled is true; for LoRA on an FP8 expert base set "
                          "quant.base_weights: fp8 and quant.train_fp8: none")
    if cfg.quant.base_weights != "none" and not cfg.lora.enabled:
        raise ConfigError(f"quant.base_weights: {cfg.quant.base_weights} packs the routed experts' base weights "
                          "into frozen codes, which a full fine-tune would have to train; set lora.enabled: true "
                          "(LoRA on top of the packed experts) or quant.base_weights: none")
    if p.dp_shard > 0:
        shard_cp = p.dp_shard * p.cp
        if shard_cp % p.ep:
            raise ConfigError(f"parallelism.ep ({p.ep}) must divide dp_shard*cp ({p.dp_shard}*{p.cp}); "
                              "experts are carved out of the FSDP ranks")


def _model_key(cfg: Config, field: str) -> str:
    return f"model.config.{field}" if cfg.model.config is not None else f"{cfg.model.path}/config.json {field}"


def check_fp8(cfg: Config, qcfg, device: str) -> None:
    """FP8 GEMMs need Hopper or newer on CUDA, and every dim they reduce or write a multiple of 16 (that FP8
    training runs eager is a backend capability: runtime.choices)."""
    key = "quant.base_weights: fp8" if cfg.quant.base_weights == "fp8" else f"quant.train_fp8: {cfg.quant.train_fp8}"
    # A plan for CUDA made elsewhere (runtime.estimate on a laptop) cannot see the GPU: checked where it runs.
    if device == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
        raise ConfigError(f"{key} runs the expert GEMMs on FP8 tensor cores, which this GPU (sm"
                          f"{''.join(map(str, torch.cuda.get_device_capability()))}) lacks: they need sm90+ (H100, "
                          "H200, B200); use quant.base_weights: mxfp4 or none, quant.train_fp8: none")
    for field, size in (("moe_intermediate_size", qcfg.moe_intermediate_size), ("hidden_size", qcfg.hidden_size)):
        if size % 16:
            raise ConfigError(f"{key}: FP8 GEMMs need each expert dim a multiple of 16, but "
                              f"{_model_key(cfg, field)} = {size}; set quant.base_weights / quant.train_fp8 to none")


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
