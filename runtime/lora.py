"""LoRA on attention projections and on routed experts; PEFT-format export and import.

Contract
    apply_lora(model, cfg)         cfg.target_modules' attention nn.Linear -> LoRALinear (same weight
                                   tensors), "experts" -> GroupedExperts.add_lora (per-expert A/B); every
                                   other parameter is frozen. A no-op when cfg.enabled is False.
    lora_state_dict(model)         {our FQN: tensor} of the LoRA factors only (DTensors stay DTensors)
    export_peft(model, out_dir)    adapter_config.json + adapter_model.safetensors as PEFT writes them for
                                   transformers' Qwen3(-MoE)ForCausalLM with LoraConfig(task_type="CAUSAL_LM",
                                   target_modules=[attention names], target_parameters=
                                   ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]), so
                                   `peft.PeftModel.from_pretrained(hf_model, out_dir)` reproduces our logits.
    load_peft(model, adapter_dir)  the reverse. A model without LoRA gets it applied from adapter_config.json
                                   first; a model with LoRA must match it (targets, rank, scaling).

Shapes (E experts, r rank, O out, I in). Ours: LoRALinear lora_A [r, I], lora_B [O, r];
GroupedExperts {gate_up,down}_lora_A [E, r, I], {gate_up,down}_lora_B [E, O, r]; per expert
y = x W_e^T + scaling * x A_e^T B_e^T.

PEFT 0.21 layout (peft.tuners.lora.layer.ParamWrapper), keys prefixed with "base_model.model.":
    attention  {fqn}.lora_A.weight [r, I], {fqn}.lora_B.weight [O, r]: the same tensors as ours.
    experts    one ParamWrapper per targeted 3D parameter, nested in the parameters' registration order on
               transformers' Qwen3MoeExperts (gate_up_proj, then down_proj), so the inner wrapper is gate_up:
                   gate_up_proj -> {experts}.base_layer.lora_{A,B}.weight
                   down_proj    -> {experts}.lora_{A,B}.weight
               lora_A.weight [E*r, I]: expert-major rows,  row e*r + j    = A_e[j, :]
               lora_B.weight [O, r*E]: rank-major columns, column j*E + e = B_e[:, j]
               (ParamWrapper.get_delta_factors: A.reshape(E, r, I), B.reshape(O, r, E).permute(2, 0, 1);
               W_e + scaling * B_e @ A_e, scaling = lora_alpha / r.)
ParamWrapper refuses lora_dropout != 0, so an adapter that targets experts is written with lora_dropout 0
(dropout only acts in training; inference is unchanged).

Distributed: export gathers DTensor factors with full_tensor() (a collective: every rank calls export_peft)
and rank 0 writes. Import runs before parallelize (build order: load -> LoRA -> parallelize) and fills
EP-local experts (GroupedExperts.expert_offset) with their slice of the adapter's experts.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from attention.projection import LinearPart, fused_linear
from moe.experts import GroupedExperts
from runtime.config import ConfigError, LoraConfig
from runtime.distributed.state_dict import gather_full
from runtime.models.hf import atomic_dir, open_safetensors

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj",
                     # Gated DeltaNet projections (Qwen3.5 and Qwen3-Next layouts)
                     "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj")
EXPERTS_TARGET = "experts"
PEFT_PREFIX = "base_model.model."
# Our GroupedExperts projection -> (transformers parameter name, PEFT wrapper path under the experts module).
EXPERT_PROJS = {"gate_up": ("gate_up_proj", "base_layer."), "down": ("down_proj", "")}
PEFT_TARGET_PARAMETERS = [f"mlp.experts.{hf_name}" for hf_name, _ in EXPERT_PROJS.values()]
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# adapter_config.json fields that change the math beyond plain LoRA; load_peft refuses them when set.
UNSUPPORTED_PEFT_FIELDS = ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern", "lora_bias",
                           "modules_to_save", "layers_to_transform", "fan_in_fan_out")


class LoRAFormatError(ValueError):
    """An adapter that does not fit the model or uses PEFT features we do not implement."""


class LoRALinear(nn.Linear):
    """nn.Linear + scaling * B(A(dropout(x))). `weight`/`bias` keep their names so base checkpoint keys
    (…q_proj.weight) are unchanged; the factors are named lora_A [r, in], lora_B [out, r]."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        # nn.Linear.__init__ would allocate a second weight; adopt the base tensors instead.
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.lora_rank = rank
        self.lora_scaling = alpha / rank
        self.lora_dropout = dropout
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, **factory))
        if not self.weight.is_meta:  # a meta model calls reset_lora_parameters() after materializing
            self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        # PEFT's init: kaiming-uniform A, zero B, so a fresh adapter leaves the output unchanged.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_dropout == 0:
            return fused_linear(x, [self.linear_part()])[0]
        x_lora = F.dropout(x, self.lora_dropout, self.training)
        # The scaling on the rank-sized product: no [tokens, out] pass to scale it, forward or backward
        delta = F.linear(F.linear(x_lora, self.lora_A) * self.lora_scaling, self.lora_B)
        return F.linear(x, self.weight, self.bias) + delta

    @property
    def joins_fused_projection(self) -> bool:
        """Whether a fused projection may compute this layer (attention.projection): not with dropout, which acts
        on the LoRA branch's input alone."""
        return self.lora_dropout == 0

    def linear_part(self) -> LinearPart:
        """What this layer computes, for attention.projection.fused_linear (which has no dropout)."""
        if not self.joins_fused_projection:
            raise ValueError("LoRA dropout acts on the LoRA branch's input alone: a fused projection cannot apply it")
        return LinearPart(self.weight, self.bias, self.lora_A, self.lora_B, self.lora_scaling)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.lora_rank}, lora_scaling={self.lora_scaling}"


# ----------------------------------------------------------------------------- apply


def _attention_linears(model: nn.Module, names) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, child name, linear) for every nn.Linear child named like a targeted attention projection."""
    return [(parent, child_name, child) for parent in model.modules()
            for child_name, child in parent.named_children()
            if child_name in names and isinstance(child, nn.Linear)]


def _experts(model: nn.Module) -> list[GroupedExperts]:
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def _check_targets(model: nn.Module, targets: list[str]) -> None:
    present = {name for _, name, _ in _attention_linears(model, ATTENTION_TARGETS)}
    if _experts(model):
        present.add(EXPERTS_TARGET)
    absent = [t for t in targets if t not in present]
    if absent:
        hint = " ('experts' needs MoE layers; this model is dense)" if EXPERTS_TARGET in absent else ""
        raise ConfigError(f"lora.target_modules names {absent} but the model has no such module{hint}; "
                         f"remove them from lora.target_modules (this model offers {sorted(present)})")


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Adds LoRA to cfg.target_modules in place and freezes every non-LoRA parameter; returns model."""
    if not cfg.enabled:
        return model
    if any("lora_" in name for name, _ in model.named_parameters()):
        raise ValueError("the model already has LoRA parameters; apply_lora runs once per model")
    _check_targets(model, cfg.target_modules)
    for parent, name, linear in _attention_linears(model, set(cfg.target_modules) & set(ATTENTION_TARGETS)):
        setattr(parent, name, LoRALinear(linear, cfg.rank, cfg.alpha, cfg.dropout))
    if EXPERTS_TARGET in cfg.target_modules:
        for experts in _experts(model):
            experts.add_lora(cfg.rank, cfg.alpha, cfg.dropout)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    return model


@torch.no_grad()
def seed_lora_A(model: nn.Module, seed: int) -> None:
    """Re-draws every LoRA A from a generator keyed by (seed, parameter name), for the full expert
    count, keeping this rank's slice: the same values whatever the EP size or init order (B is 0).
    Kaiming-uniform with a=sqrt(5), PEFT's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    modules = dict(model.named_modules())
    for fqn, param in model.named_parameters():
        if "lora_A" not in fqn:
            continue
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{fqn}".encode()))
        owner = modules[fqn.rsplit(".", 1)[0]]
        shape, lo = tuple(param.shape), 0
        if isinstance(owner, GroupedExperts):
            shape, lo = (model.config.num_experts, *shape[1:]), owner.expert_offset
        bound = 1.0 / math.sqrt(shape[-1])
        full = torch.empty(shape).uniform_(-bound, bound, generator=gen)
        param.copy_(full[lo:lo + param.shape[0]] if isinstance(owner, GroupedExperts) else full)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach() for name, param in model.named_parameters() if "lora_" in name}


# ----------------------------------------------------------------------------- PEFT layout


def experts_A_to_peft(A_ErI: torch.Tensor) -> torch.Tensor:
    return A_ErI.reshape(-1, A_ErI.shape[-1])  # [E*r, I], row e*r + j


def experts_B_to_peft(B_EOr: torch.Tensor) -> torch.Tensor:
    return B_EOr.permute(1, 2, 0).reshape(B_EOr.shape[1], -1)  # [O, r*E], column j*E + e


def experts_A_from_peft(A_peft: torch.Tensor, num_experts: int) -> torch.Tensor:
    return A_peft.reshape(num_experts, -1, A_peft.shape[-1])


def experts_B_from_peft(B_peft: torch.Tensor, num_experts: int) -> torch.Tensor:
    return B_peft.reshape(B_peft.shape[0], -1, num_experts).permute(2, 0, 1)


Gather = Callable[[torch.Tensor, bool], torch.Tensor]


@dataclass
class _Site:
    """One LoRA factor: our parameter, its PEFT key and shape, and the layout maps between the two."""
    peft_key: str
    param: nn.Parameter
    peft_shape: tuple[int, ...]
    to_peft: Callable[[torch.Tensor], torch.Tensor]  # our full tensor -> PEFT tensor
    from_peft: Callable[[torch.Tensor], torch.Tensor]  # PEFT tensor -> our (EP-local) tensor
    expert: bool = False  # an expert factor: EP ranks hold slices of it


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _linear_sites(name: str, m: LoRALinear) -> list[_Site]:
    return [_Site(f"{PEFT_PREFIX}{name}.lora_{f}.weight", p, tuple(p.shape), _identity, _identity)
            for f, p in (("A", m.lora_A), ("B", m.lora_B))]


def _expert_sites(name: str, m: GroupedExperts, total_experts: int) -> list[_Site]:
    lo, hi, r = m.expert_offset, m.expert_offset + m.num_experts, m.lora_rank
    sites = []
    for proj, (_, wrapper) in EXPERT_PROJS.items():
        A, B = m.lora(proj)
        key = f"{PEFT_PREFIX}{name}.{wrapper}lora_"
        sites += [
            _Site(key + "A.weight", A, (total_experts * r, A.shape[-1]), experts_A_to_peft,
                  lambda t: experts_A_from_peft(t, total_experts)[lo:hi], expert=True),
            _Site(key + "B.weight", B, (B.shape[1], r * total_experts), experts_B_to_peft,
                  lambda t: experts_B_from_peft(t, total_experts)[lo:hi], expert=True),
        ]
    return sites


def _sites(model: nn.Module) -> list[_Site]:
    total_experts = getattr(getattr(model, "config", None), "num_experts", 0)
    sites = []
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            sites += _linear_sites(name, m)
        elif isinstance(m, GroupedExperts) and m.has_lora:
            sites += _expert_sites(name, m, total_experts or m.num_experts)
    return sites


def _lora_hparams(model: nn.Module) -> dict:
    """rank, alpha, dropout and targets of the model's LoRA; one value each, as a PEFT config holds."""
    found = {}  # (rank, scaling, dropout) -> target names
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            target = name.rsplit(".", 1)[-1]
        elif isinstance(m, GroupedExperts) and m.has_lora:
            target = EXPERTS_TARGET
        else:
            continue
        found.setdefault((m.lora_rank, m.lora_scaling, m.lora_dropout), set()).add(target)
    if not found:
        raise ValueError("the model has no LoRA parameters: call apply_lora first")
    if len(found) > 1:
        raise ValueError(f"LoRA modules disagree on (rank, scaling, dropout): {sorted(found)}; "
                         "one PEFT adapter holds one value of each")
    (rank, scaling, dropout), targets = found.popitem()
    return {"rank": rank, "alpha": scaling * rank, "dropout": dropout, "targets": targets}


# ----------------------------------------------------------------------------- export


def peft_state_dict(model: nn.Module, gather: Gather = gather_full) -> dict[str, torch.Tensor]:
    """The model's LoRA factors under PEFT's keys and layout, full tensors on the CPU. `gather(t,
    expert)` assembles a sharded tensor (a collective with DTensors or EP: every rank calls it)."""
    out = {}
    for site in _sites(model):
        tensor = site.to_peft(gather(site.param.detach(), site.expert)).cpu().contiguous()
        if tuple(tensor.shape) != site.peft_shape:
            raise ValueError(f"{site.peft_key}: shape {tuple(tensor.shape)} after gathering, PEFT expects "
                             f"{site.peft_shape}; EP-local experts must be DTensors to export all of them")
        out[site.peft_key] = tensor
    return out


def peft_lora_config(model: nn.Module, base_model_name_or_path: str | None = None):
    """The peft.LoraConfig that PEFT would write for this model's adapter."""
    from peft import LoraConfig as PeftLoraConfig  # imported here: runs without LoRA never pay for peft

    hp = _lora_hparams(model)
    targets_experts = EXPERTS_TARGET in hp["targets"]
    alpha = int(hp["alpha"]) if float(hp["alpha"]).is_integer() else hp["alpha"]
    return PeftLoraConfig(
        task_type="CAUSAL_LM", r=hp["rank"], lora_alpha=alpha, inference_mode=True,
        # ParamWrapper refuses dropout (see module docstring); it only matters in training anyway.
        lora_dropout=0.0 if targets_experts else hp["dropout"],
        # An empty list, not None: None makes PEFT fall back to its default targets (q_proj, v_proj).
        target_modules=sorted(hp["targets"] - {EXPERTS_TARGET}),
        target_parameters=PEFT_TARGET_PARAMETERS if targets_experts else None,
        base_model_name_or_path=base_model_name_or_path)


def export_peft(model: nn.Module, out_dir: str | Path, base_model_name_or_path: str | None = None,
                gather: Gather = gather_full) -> None:
    """Writes the adapter to out_dir atomically (temp sibling folder, then rename); rank 0 writes."""
    tensors = peft_state_dict(model, gather)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    peft_config = peft_lora_config(model, base_model_name_or_path)
    tmp, commit = atomic_dir(out_dir)
    save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    peft_config.save_pretrained(str(tmp))
    commit()


# ----------------------------------------------------------------------------- import


def read_adapter_config(adapter_dir: str | Path) -> dict:
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise LoRAFormatError(f"{adapter_dir} has no {ADAPTER_CONFIG}: not a PEFT adapter folder")
    return json.loads(path.read_text())


def lora_config_from_peft(peft_cfg: dict) -> LoraConfig:
    """Our LoraConfig for a PEFT adapter_config.json; LoRAFormatError for what we do not implement."""
    if peft_cfg.get("peft_type") != "LORA":
        raise LoRAFormatError(f"peft_type {peft_cfg.get('peft_type')!r} is not supported; "
                              "only LORA adapters load")
    unsupported = [f for f in UNSUPPORTED_PEFT_FIELDS if peft_cfg.get(f)]
    if peft_cfg.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise LoRAFormatError(f"adapter uses PEFT options this runtime does not implement: {unsupported}")
    modules = peft_cfg.get("target_modules") or []
    params = peft_cfg.get("target_parameters") or []
    if isinstance(modules, str):
        raise LoRAFormatError(f"target_modules {modules!r} is a regex; only a list of names "
                              f"from {list(ATTENTION_TARGETS)} is supported")
    bad_modules = sorted(set(modules) - set(ATTENTION_TARGETS))
    bad_params = params and sorted(params) != sorted(PEFT_TARGET_PARAMETERS)
    if bad_modules or bad_params:
        raise LoRAFormatError(f"adapter targets modules {sorted(modules)} and parameters {sorted(params)}; "
                              f"supported: modules from {list(ATTENTION_TARGETS)}, parameters none or all "
                              f"of {PEFT_TARGET_PARAMETERS}")
    targets = [m for m in ATTENTION_TARGETS if m in modules] + ([EXPERTS_TARGET] if params else [])
    return LoraConfig(enabled=True, rank=peft_cfg["r"], alpha=peft_cfg["lora_alpha"],
                      dropout=peft_cfg.get("lora_dropout") or 0.0, target_modules=targets)


def _check_same_lora(model: nn.Module, cfg: LoraConfig) -> None:
    hp = _lora_hparams(model)
    ours = (hp["rank"], hp["alpha"] / hp["rank"], sorted(hp["targets"]))
    theirs = (cfg.rank, cfg.alpha / cfg.rank, sorted(cfg.target_modules))
    if ours[0] != theirs[0] or not math.isclose(ours[1], theirs[1]) or ours[2] != theirs[2]:
        raise LoRAFormatError(f"the adapter's LoRA (rank, scaling, targets) = {theirs} differs from the "
                              f"model's {ours}; set lora.rank / lora.alpha / lora.target_modules to match")


def _mismatch_report(adapter_dir, missing, unexpected, shapes, limit: int = 20) -> str:
    lines = [f"adapter {adapter_dir} does not fit the model's LoRA"]
    for title, items in (("missing keys", missing), ("unexpected keys", unexpected),
                         ("shape mismatches", shapes)):
        if items:
            more = " ..." if len(items) > limit else ""
            lines.append(f"{title} ({len(items)}): " + ", ".join(items[:limit]) + more)
    return "\n".join(lines)


def load_peft(model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """Loads a PEFT LoRA adapter in place (before parallelize); applies LoRA from its config when the model
    has none, else checks that the model's LoRA matches. Raises LoRAFormatError listing every key and shape
    mismatch before any value is loaded."""
    cfg = lora_config_from_peft(read_adapter_config(adapter_dir))
    weights = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise LoRAFormatError(f"{adapter_dir} has no {ADAPTER_WEIGHTS} (only safetensors adapters load)")
    if any("lora_" in name for name, _ in model.named_parameters()):
        _check_same_lora(model, cfg)
    else:
        apply_lora(model, cfg)
    sites = _sites(model)
    if any(hasattr(s.param, "full_tensor") for s in sites):
        raise LoRAFormatError("load_peft fills plain tensors: call it before parallelize (FSDP/EP DTensors)")
    with open_safetensors(weights, fix="export or download the adapter again") as handle:
        keys = set(handle.keys())
        found = {s.peft_key: tuple(handle.get_slice(s.peft_key).get_shape())
                 for s in sites if s.peft_key in keys}
        missing = sorted(s.peft_key for s in sites if s.peft_key not in keys)
        unexpected = sorted(keys - {s.peft_key for s in sites})
        shapes = [f"{s.peft_key}: adapter {found[s.peft_key]} vs model {s.peft_shape}" for s in sites
                  if s.peft_key in found and found[s.peft_key] != s.peft_shape]
        if missing or unexpected or shapes:
            raise LoRAFormatError(_mismatch_report(adapter_dir, missing, unexpected, shapes))
        with torch.no_grad():
            for s in sites:
                s.param.copy_(s.from_peft(handle.get_tensor(s.peft_key)))
    return model
