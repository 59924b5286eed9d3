"""HF checkpoints <-> our models: config.json -> QwenConfig, safetensors -> parameters, and back.

Loading reads only the tensors this rank's modules need (for experts, only the E_local experts a
GroupedExperts owns, from either the per-expert key layout published for Qwen3-30B-A3B or the fused
transformers-v5 layout) straight into modules built on the meta device, so the model is never
materialized twice. Saving writes the per-expert layout, which transformers v4 and v5 both load.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import stat
from collections import defaultdict
from pathlib import Path
from typing import Self

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from attention.rope import RopeConfig
from moe.experts import PROJECTIONS, GroupedExperts
from quant import QuantizedWeight
from runtime.choices import MODEL_CHOICES
from runtime.models.qwen import GDNConfig, QwenConfig, QwenForCausalLM

log = logging.getLogger("runtime")

# Router selection biases (model.router_bias_update_rate) have no place in the HF format: exports write them
# beside the checkpoint in this file, under these keys' suffix.
ROUTER_BIAS_FILE = "router_bias.safetensors"
ROUTER_BIAS_SUFFIX = ".mlp.gate.e_score_correction_bias"

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text")
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# The published Qwen3.5 checkpoints are *ForConditionalGeneration: text config nested, text weights
# under model.language_model.*; we load their text part and save the text-only *ForCausalLM layout.
CONDITIONAL_GENERATION = {"qwen3_5": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
                          "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")}
TEXT_PREFIX = "model.language_model."
# Checkpoint parts the text model never uses: vision tower, multi-token-prediction heads.
_FOREIGN = re.compile(r"^(model\.visual\.|visual\.|mtp\.)")
_EXPERT_PARAM = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<name>gate_up|down)$")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model or cannot be read; the message names the keys or the file."""


def open_safetensors(file: Path, fix: str = "download the checkpoint again or re-save it with save_pretrained"):
    """safe_open(file), or CheckpointError naming the file and `fix` when its header cannot be read (a
    truncated or overwritten file: safetensors checks the header against the file size when it opens)."""
    try:
        return safe_open(file, "pt")
    except SafetensorError as err:
        raise CheckpointError(f"{file} is not a readable safetensors file ({err}: truncated or corrupted); "
                              f"{fix}") from None


def read_hf_config(path: str | Path) -> dict:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json: model.path must be a HF checkpoint folder")
    return json.loads(cfg_file.read_text())


def rope_config_from_hf(hf: dict) -> RopeConfig:
    # transformers v5 writes rope_parameters; v4 configs carry rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    known = {f for f in RopeConfig.__dataclass_fields__} - {"theta", "rope_type", "max_position_embeddings"}
    extras = {k: v for k, v in params.items() if k in known and v is not None}
    if "partial_rotary_factor" in hf:
        extras.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    return RopeConfig(theta=theta, rope_type=rope_type, max_position_embeddings=hf.get("max_position_embeddings", 32768),
                      **extras)


def text_config(hf: dict) -> dict:
    """The text model's HF config: nested text_config of a *ForConditionalGeneration, else hf itself."""
    if hf.get("model_type") not in CONDITIONAL_GENERATION:
        return hf
    model_type, architecture = CONDITIONAL_GENERATION[hf["model_type"]]
    return {**hf["text_config"], "model_type": model_type, "architectures": [architecture]}


def _gdn_config(hf: dict, model_type: str) -> GDNConfig:
    return GDNConfig(num_k_heads=hf["linear_num_key_heads"], num_v_heads=hf["linear_num_value_heads"],
                     head_k_dim=hf["linear_key_head_dim"], head_v_dim=hf["linear_value_head_dim"],
                     conv_kernel=hf.get("linear_conv_kernel_dim", 4),
                     layout="qwen3_next" if model_type == "qwen3_next" else "qwen3_5")


# The HF config keys config_from_hf reads, by the parts a model kind builds. The required ones have no
# default there: without them a MoE kind would build a dense model or a router picking no expert.
# runtime.models.config_check names the missing ones before anything runs.
_BASE_KEYS = {"required": ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"),
              "optional": ("num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
                           "tie_word_embeddings", "attention_bias", "initializer_range", "max_position_embeddings",
                           "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")}
_MOE_KEYS = {"required": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
             "optional": ("num_local_experts", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                          "shared_expert_intermediate_size")}
_HYBRID_KEYS = {"required": ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                             "linear_value_head_dim"),
                "optional": ("linear_conv_kernel_dim",)}


def _key_groups(model_type: str) -> list[dict]:
    return ([_BASE_KEYS] + ([_MOE_KEYS] if model_type in MOE_MODEL_TYPES else [])
            + ([_HYBRID_KEYS] if model_type in HYBRID_MODEL_TYPES else []))


def keys_read(model_type: str) -> set[str]:
    """Every key of a text config of `model_type` that config_from_hf reads."""
    return {k for group in _key_groups(model_type) for part in group.values() for k in part}


def missing_keys(hf: dict) -> list[str]:
    """Keys of a text config that config_from_hf needs, has no default for, and `hf` lacks (or sets to null)."""
    model_type = hf.get("model_type")
    required = [k for group in _key_groups(model_type) for k in group["required"]]
    # Dense MLP blocks: every block of a dense kind; in a MoE kind the mlp_only_layers and the blocks
    # between sparse steps.
    if (model_type not in MOE_MODEL_TYPES or hf.get("mlp_only_layers")
            or (hf.get("decoder_sparse_step") or 1) > 1):
        required.append("intermediate_size")
    present = {k for k, v in hf.items() if v is not None}
    if "num_local_experts" in present:  # transformers' other name for num_experts
        present.add("num_experts")
    return [k for k in required if k not in present]


def model_config(cfg, **names) -> QwenConfig:
    """The model's QwenConfig from model.path's config.json or model.config of `cfg` (a runtime.config.Config,
    which imports this module), with the run's choices (`names` overrides the implementation names of cfg.model)."""
    hf = read_hf_config(cfg.model.path) if cfg.model.path else dict(cfg.model.config)
    choices = {field: getattr(cfg.model, field) for field in MODEL_CHOICES}
    return config_from_hf(hf, **{**choices, **names}, router_aux_loss_coef=cfg.model.router_aux_loss_coef,
                          router_force_balanced=cfg.model.router_force_balanced,
                          router_bias_update_rate=cfg.model.router_bias_update_rate,
                          num_layers=cfg.model.num_layers_override)


def config_from_hf(hf: dict, **runtime_options) -> QwenConfig:
    """Our config from a HF config dict; `runtime_options` sets expert_backend, attn_backend, ..."""
    hf = text_config(hf)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    num_layers = runtime_options.pop("num_layers", None) or hf["num_hidden_layers"]
    # Qwen3.5-MoE always renormalizes its top-k weights and has no norm_topk_prob key.
    moe_fields = {"num_experts": hf.get("num_experts") or hf.get("num_local_experts") or 0,
                  "num_experts_per_tok": hf.get("num_experts_per_tok", 0),
                  "moe_intermediate_size": hf.get("moe_intermediate_size", 0),
                  "norm_topk_prob": hf.get("norm_topk_prob", model_type == "qwen3_5_moe_text"),
                  "decoder_sparse_step": hf.get("decoder_sparse_step") or 1,
                  "mlp_only_layers": tuple(hf.get("mlp_only_layers") or ()),
                  "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size") or 0,
                  } if model_type in MOE_MODEL_TYPES else {}
    hybrid_fields = {"layer_types": tuple(hf["layer_types"][:num_layers]), "gated_attention": True,
                     "norm_unit_offset": True, "gdn": _gdn_config(hf, model_type),
                     } if model_type in HYBRID_MODEL_TYPES else {}
    return QwenConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=num_layers,
        num_heads=hf["num_attention_heads"], num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        intermediate_size=hf.get("intermediate_size") or 0, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope=rope_config_from_hf(hf), tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=hf.get("attention_bias", False), initializer_range=hf.get("initializer_range", 0.02),
        hf_config=hf, **moe_fields, **hybrid_fields, **runtime_options)


class SafetensorsCheckpoint:
    """Key -> file index over a single-file or sharded (model.safetensors.index.json) checkpoint.
    Keys are presented in the text-only layout: model.language_model.X reads as model.X, and vision /
    MTP tensors are left out."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            stored = {k: self.path / f for k, f in weight_map.items()}
        else:
            # The router-bias side file of our exports is not part of the HF checkpoint.
            files = sorted(f for f in self.path.glob("*.safetensors") if f.name != ROUTER_BIAS_FILE)
            if not files:
                raise CheckpointError(f"no *.safetensors files in {self.path}")
            stored = {}
            for f in files:
                with open_safetensors(f) as handle:
                    stored.update(dict.fromkeys(handle.keys(), f))
        # our name -> (file, name in the file)
        self.files = {_text_name(k): (f, k) for k, f in stored.items() if not _FOREIGN.match(k)}
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()  # safe_open handles release their mmap when dropped

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def keys(self) -> set[str]:
        return set(self.files)

    def _each_file(self, keys):
        """(handle, [(our key, stored key)]) per file holding some of `keys`; a file is opened once
        for the checkpoint's lifetime, not once per read."""
        by_file: dict[Path, list[tuple[str, str]]] = defaultdict(list)
        for key in keys:
            file, stored = self.files[key]
            by_file[file].append((key, stored))
        for file, names in by_file.items():
            if file not in self._handles:
                self._handles[file] = open_safetensors(file)
            yield self._handles[file], names

    def shapes(self, keys) -> dict[str, tuple[int, ...]]:
        """Tensor shapes from the safetensors headers, without reading data."""
        return {k: tuple(handle.get_slice(stored).get_shape())
                for handle, names in self._each_file(keys) for k, stored in names}

    def read(self, requests: dict[str, tuple[int, int] | None]) -> dict[str, torch.Tensor]:
        """Reads {key: (start, end) rows of dim 0, or None for all}."""
        out = {}
        for handle, names in self._each_file(requests):
            for key, stored in names:
                rows = requests[key]
                out[key] = (handle.get_tensor(stored) if rows is None
                            else handle.get_slice(stored)[rows[0]:rows[1]])
        return out


def _text_name(key: str) -> str:
    return "model." + key.removeprefix(TEXT_PREFIX) if key.startswith(TEXT_PREFIX) else key


def _expert_sources(ckpt: SafetensorsCheckpoint, prefix: str, name: str, experts: GroupedExperts):
    """Checkpoint keys (row ranges) making up one GroupedExperts tensor, their expected shapes, and
    how to assemble them."""
    lo, hi = experts.expert_offset, experts.expert_offset + experts.num_experts
    H, I = experts.hidden, experts.intermediate
    fused = f"{prefix}.{name}_proj"
    if fused in ckpt:
        full_E = ckpt.shapes([fused])[fused][0]
        shape = (full_E, 2 * I, H) if name == "gate_up" else (full_E, H, I)
        return {fused: (lo, hi)}, {fused: shape}, lambda t: t[fused]
    parts = ("gate_proj", "up_proj") if name == "gate_up" else ("down_proj",)
    keys = [[f"{prefix}.{e}.{p}.weight" for p in parts] for e in range(lo, hi)]
    part_shape = (I, H) if name == "gate_up" else (H, I)
    return ({k: None for row in keys for k in row}, {k: part_shape for row in keys for k in row},
            lambda t: torch.stack([torch.cat([t[k] for k in row]) for row in keys]))


def _param_sources(model: QwenForCausalLM, ckpt: SafetensorsCheckpoint):
    """{our FQN: (checkpoint requests, expected shapes, assemble fn)} for every base weight (expert weights
    by their GroupedExperts projection, parameters or quantized alike)."""
    sources = {}
    for prefix, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for name in PROJECTIONS:
                sources[f"{prefix}.{name}"] = _expert_sources(ckpt, prefix, name, module)
    for fqn, param in model.named_parameters(remove_duplicate=True):
        if "lora_" in fqn or fqn in sources:
            continue  # adapters are not part of a base checkpoint
        sources[fqn] = ({fqn: None}, {fqn: tuple(param.shape)}, lambda t, k=fqn: t[k])
    return sources


def _layer_index(key: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return int(m[1]) if m else None


def load_hf_weights(model: QwenForCausalLM, path: str | Path, dtype: torch.dtype, device) -> None:
    """Fills a (meta-initialized) model with the checkpoint's tensors; raises CheckpointError listing
    missing keys, unexpected keys and shape mismatches before touching the model."""
    with SafetensorsCheckpoint(path) as ckpt:
        _load(model, ckpt, path, dtype, device)
    finish_materialize(model, device)


def _load(model: QwenForCausalLM, ckpt: SafetensorsCheckpoint, path, dtype: torch.dtype, device) -> None:
    sources = _param_sources(model, ckpt)
    wanted = {k for reqs, _, _ in sources.values() for k in reqs}
    missing = sorted(wanted - ckpt.keys())
    # Keys the model does not use on purpose: deeper layers (num_layers override), other EP ranks'
    # experts, a tied lm_head.
    skippable = re.compile(r"\.experts\.(\d+)\.|\.experts\.(gate_up|down)_proj$")
    unexpected = sorted(k for k in ckpt.keys() - wanted
                        if not skippable.search(k)
                        and not ((i := _layer_index(k)) is not None and i >= model.config.num_layers)
                        and not (k == "lm_head.weight" and model.config.tie_word_embeddings))
    if missing or unexpected:
        raise CheckpointError(_key_report(path, missing, unexpected))
    expected = {k: shape for _, shapes, _ in sources.values() for k, shape in shapes.items()}
    found = ckpt.shapes(expected)
    mismatched = [f"{k}: checkpoint {found[k]} vs model {expected[k]}" for k in sorted(expected)
                  if found[k] != expected[k]]
    if mismatched:
        raise CheckpointError(f"checkpoint {path} does not fit the model; shape mismatches ({len(mismatched)}):\n  "
                              + "\n  ".join(mismatched[:20]))
    state = {}
    for fqn, (requests, _, assemble) in sources.items():
        tensor = assemble(ckpt.read(requests)).to(device=device, dtype=dtype)
        owner, _, name = fqn.rpartition(".")
        target = getattr(model.get_submodule(owner), name)
        if isinstance(target, QuantizedWeight):  # quantized now: one dense projection of one layer at a time
            target.to_empty(device=device).fill_(tensor)
            del tensor
        else:
            state[fqn] = tensor
    model.load_state_dict(state, strict=False, assign=True)


def _key_report(path, missing: list[str], unexpected: list[str], limit: int = 20) -> str:
    lines = [f"checkpoint {path} does not match the model (is model.path the right checkpoint?)"]
    for title, keys in (("missing keys", missing), ("unexpected keys", unexpected)):
        if keys:
            lines.append(f"{title} ({len(keys)}): " + ", ".join(keys[:limit]) + (" ..." if len(keys) > limit else ""))
    return "\n".join(lines)


def finish_materialize(model: QwenForCausalLM, device) -> None:
    """Re-ties lm_head and recomputes the rope buffers (checkpoints hold neither; materializing a meta
    model unties and leaves buffers empty), then checks no parameter is left on the meta device.
    LoRA is applied after loading (runtime.lora.apply_lora), so every parameter must have come from
    the checkpoint."""
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.reset_parameters(model.config.rope, model.config.head_dim, device)
    for block in model.moe_blocks():
        block.gate.reset_buffers(device)  # the selection bias starts at zero (HF checkpoints hold none)
    leftover = [n for n, p in (*model.named_parameters(), *model.named_buffers()) if p.is_meta]
    if leftover:
        raise CheckpointError(f"parameters left uninitialized after loading: {leftover[:10]}")


# ----------------------------------------------------------------------------- saving


def hf_state_dict(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Base weights in the per-expert HF layout (LoRA factors excluded: they export as PEFT). A sharded
    model passes its gathered `state` (runtime.distributed.state_dict.full_state_dict)."""
    state = state if state is not None else model.state_dict()
    out = {}
    for fqn, tensor in state.items():
        if "lora_" in fqn:
            continue
        tensor = tensor.detach().cpu().contiguous()
        match = _EXPERT_PARAM.match(fqn)
        if not match:
            out[fqn] = tensor
            continue
        prefix = match["prefix"]
        for e, w in enumerate(tensor):
            if match["name"] == "gate_up":
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = w.contiguous()
    if getattr(model, "config", None) is not None and model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> None:
    shards, current, size = [], {}, 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = tensors[key]
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], out_dir / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out_dir / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def atomic_dir(out_dir: str | Path):
    """A temporary sibling folder; `commit()` renames it over out_dir so readers never see half a save.
    The folder and its files get the modes a plain mkdir / open give under the user's umask."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: it makes the folder 0700, and the export is meant to be shared.
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()

    def commit() -> None:
        _match_umask(tmp)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    return tmp, commit


def _match_umask(folder: Path) -> None:
    """Gives the files in `folder` the mode open() gives there. safetensors writes 0600 (a private temp
    file renamed into place); a probe file shows the mode the umask (and a default ACL) allow, without
    setting the process-wide umask, which other threads may be creating files under."""
    probe = folder / ".mode-probe"
    probe.touch()
    mode = stat.S_IMODE(probe.stat().st_mode)
    probe.unlink()
    for path in folder.rglob("*"):
        if path.is_file() and stat.S_IMODE(path.stat().st_mode) != mode:
            path.chmod(mode)


def hf_config_dict(cfg: QwenConfig, dtype: torch.dtype) -> dict:
    hf = dict(cfg.hf_config)
    hf["num_hidden_layers"] = cfg.num_layers
    if "layer_types" in hf:
        hf["layer_types"] = list(hf["layer_types"][:cfg.num_layers])
    hf["dtype"] = str(dtype).removeprefix("torch.")
    return hf


def pop_router_bias(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Removes and returns the routers' selection biases (model.router_bias_update_rate) from `tensors`."""
    return {k: tensors.pop(k) for k in [k for k in tensors if k.endswith(ROUTER_BIAS_SUFFIX)]}


def write_router_bias(bias: dict[str, torch.Tensor], folder: Path, export: Path) -> None:
    """Writes the selection biases beside an export, with the one warning that the export routes differently."""
    if not bias:
        return
    log.warning("model.router_bias_update_rate: the HF Qwen3-MoE format has no router selection bias, so %s "
                "routes differently from the trained model; the biases are written beside it as %s "
                "(keys model.layers.{i}.mlp.gate.e_score_correction_bias) for inference code that adds them to "
                "the router's probabilities before its top-k", export, ROUTER_BIAS_FILE)
    save_file({k: v.float().contiguous() for k, v in bias.items()}, folder / ROUTER_BIAS_FILE,
              metadata={"format": "pt"})


def save_pretrained(model: QwenForCausalLM, out_dir: str | Path, max_shard_bytes: int = 5 * 2**30,
                    state: dict[str, torch.Tensor] | None = None, dequantize: bool = False) -> None:
    """Writes config.json + safetensors (sharded past max_shard_bytes) atomically to out_dir. Quantized
    (FP4 / FP8) experts are written only with dequantize=True, as their dequantized values in the model's dtype.
    Router selection biases, which the HF format lacks, go beside them (write_router_bias)."""
    state = _with_dequantized_experts(model, state, dequantize)
    tensors = hf_state_dict(model, state)
    bias = pop_router_bias(tensors)
    dtype = next(iter(tensors.values())).dtype
    tmp, commit = atomic_dir(out_dir)
    write_safetensors(tensors, tmp, max_shard_bytes)
    write_router_bias(bias, tmp, Path(out_dir))
    (tmp / "config.json").write_text(json.dumps(hf_config_dict(model.config, dtype), indent=2))
    commit()


def _with_dequantized_experts(model: QwenForCausalLM, state: dict[str, torch.Tensor] | None,
                              dequantize: bool) -> dict[str, torch.Tensor] | None:
    """`state` (or the model's) plus the dequantized packed experts that it does not already hold as dense
    tensors (a merged export passes them); refuses unless asked to dequantize: a HF base checkpoint of
    quantized experts holds the quantized values, not the weights they were quantized from."""
    packed = {f"{prefix}.{name}": (module, module.base_weight(name))
              for prefix, module in model.named_modules() if isinstance(module, GroupedExperts)
              for name in PROJECTIONS if isinstance(module.base_weight(name), QuantizedWeight)
              and (state is None or f"{prefix}.{name}" not in state)}
    if not packed:
        return state
    fmt = next(iter(packed.values()))[1].fmt
    if not dequantize:
        raise ValueError(f"the routed experts' base weights are {fmt}-packed: a HF checkpoint holds dense weights. "
                         "Pass dequantize=True to write the dequantized values (not the original weights), "
                         "or export the LoRA adapter (LoRA runs with checkpoint.export_hf write a PEFT adapter "
                         "on the original base checkpoint)")
    state = dict(state if state is not None else model.state_dict())
    for fqn, (experts, weight) in packed.items():
        if experts.num_experts != model.config.num_experts:
            raise ValueError(f"{fqn} holds experts {experts.expert_offset}..{experts.expert_offset + experts.num_experts - 1}"
                             f" of {model.config.num_experts} (an EP rank); dequantize from a model that holds all")
        state[fqn] = weight.dequantize()
    return state
