"""The model's HF config checked before anything runs: model.config (random init) or model.path's
config.json, and the tokenizer against it.

    model_config_problems(config, path, tokenizer, tokenizer_key) -> list[str]

Each problem is one line naming the key and the fix; [] means the config builds the model it says.
model.config keys must be ones its model_type uses: transformers' config class for that model_type
(its arguments and what it writes) or what runtime.models.hf.config_from_hf reads (head_dim, legacy rope
keys). model.path's config.json is trusted for its keys (published configs carry keys of older
transformers versions); both are checked for missing keys, sizes, top-k, heads and vocab vs tokenizer.
A key transformers knows but no training step here reads (hidden_act, ...) set to a non-default value
warns. A path that does not exist on this machine is left to its loader: configs are also validated
where the model is not (a login node, CI).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import warnings
from pathlib import Path
from typing import Any

from runtime.models.hf import (
    CONDITIONAL_GENERATION,
    HYBRID_MODEL_TYPES,
    MOE_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    keys_read,
    missing_keys,
    text_config,
)

MODEL_TYPES = SUPPORTED_MODEL_TYPES + tuple(CONDITIONAL_GENERATION)
POSITIVE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts",
                 "num_experts_per_tok", "decoder_sparse_step", "linear_num_key_heads", "linear_num_value_heads",
                 "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
POSITIVE_FLOAT_KEYS = ("rms_norm_eps",)
# Read by transformers but not by a training step: inference and tokenizer settings, and the legacy
# name of dtype. Setting them to anything is harmless.
NO_TRAINING_EFFECT = {"use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "torch_dtype"}
# transformers' model keys whose job a runtime key does here.
RUNTIME_KEYS = {"router_aux_loss_coef": "model.router_aux_loss_coef",
                "output_router_logits": "model.router_aux_loss_coef"}


def model_config_problems(config: dict | None, path: str | None, tokenizer: str | None,
                          tokenizer_key: str) -> list[str]:
    """Problems of model.config (or, when it is None, of model.path's config.json) and of the tokenizer
    folder (`tokenizer_key` names the YAML key that chose it)."""
    hf, problems = None, []
    if config is not None:
        hf, where = config, "model.config."
        problems = _config_problems(hf, where, strict_keys=True)
    elif Path(path).is_dir():
        file = Path(path) / "config.json"
        hf, problem = _read_config_json(file)
        where = f"{file} "
        problems = [problem] if problem else _config_problems(hf, where, strict_keys=False)
    if tokenizer is None or not Path(tokenizer).is_dir():
        return problems
    size, problem = _tokenizer_size(Path(tokenizer), tokenizer_key)
    if problem:
        return problems + [problem]
    if hf is not None and not problems:
        vocab = text_config(hf)["vocab_size"]
        if vocab < size:
            problems.append(f"{_text_where(hf, where)}vocab_size: {vocab} is smaller than the tokenizer's {size} "
                            f"tokens ({tokenizer_key}: {tokenizer}); token ids past {vocab - 1} would index past "
                            f"the embedding. Set vocab_size >= {size} or use the model's own tokenizer")
    return problems


def _read_config_json(file: Path) -> tuple[dict | None, str | None]:
    """(model.path's config.json, None), or (None, the problem reading it)."""
    if not file.is_file():
        return None, (f"model.path: {file.parent} has no config.json; point model.path at a HF checkpoint "
                      "folder (config.json + *.safetensors)")
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        return None, (f"model.path: {file} is not valid JSON (line {err.lineno}: {err.msg}); "
                      "restore it from the checkpoint")
    return (hf, None) if isinstance(hf, dict) else (None, f"model.path: {file} must hold a JSON object (a HF config)")


def _text_where(hf: dict, where: str) -> str:
    """Where the text model's keys are: `where` names the config's keys with a prefix ("model.config.")."""
    return f"{where}text_config." if hf.get("model_type") in CONDITIONAL_GENERATION else where


def _config_problems(hf: dict, where: str, strict_keys: bool) -> list[str]:
    model_type = hf.get("model_type")
    if model_type is None:
        return [f"{where}model_type: required key is missing; set one of {', '.join(MODEL_TYPES)}"]
    if model_type not in MODEL_TYPES:
        return [f"{where}model_type: {model_type!r} is not supported; supported: {', '.join(MODEL_TYPES)}"]
    if model_type in CONDITIONAL_GENERATION and not isinstance(hf.get("text_config"), dict):
        return [f"{where}text_config: required key is missing; a {model_type} config nests its text model there"]
    unknown = _unknown_keys(hf, where) if strict_keys else []
    problems = [message for message, _ in unknown]
    text, text_where = text_config(hf), _text_where(hf, where)
    # A misspelled key already names the key it should be; saying that one is missing too adds nothing.
    suggested = {suggestion for _, suggestion in unknown}
    problems += [f"{text_where}{key}: required key is missing for model_type {text['model_type']}; "
                 "set it (this runtime has no default for it)" for key in missing_keys(text) if key not in suggested]
    problems += [f"{text_where}{key}: must be a positive integer (got {text[key]!r})" for key in POSITIVE_KEYS
                 if text.get(key) is not None and not _positive_int(text[key])]
    # YAML 1.1 reads 1e-06 (no dot) as a string: say so here, not as a TypeError inside the first norm.
    problems += [f"{text_where}{key}: must be a positive number (got {text[key]!r}; write 1.0e-6, not 1e-6)"
                 for key in POSITIVE_FLOAT_KEYS if text.get(key) is not None and not _positive_number(text[key])]
    return problems or _shape_problems(text, text_where)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _shape_problems(hf: dict, where: str) -> list[str]:
    """Relations between sizes; `hf` is a text config with every required key a positive integer."""
    problems = []
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % kv_heads:
        problems.append(f"{where}num_attention_heads: {heads} is not divisible by num_key_value_heads ({kv_heads}); "
                        "each key/value head serves an equal group of query heads")
    if not hf.get("head_dim") and hf["hidden_size"] % heads:
        problems.append(f"{where}head_dim: required when hidden_size ({hf['hidden_size']}) is not divisible by "
                        f"num_attention_heads ({heads}); set head_dim")
    if hf["model_type"] in MOE_MODEL_TYPES:
        top_k, experts = hf["num_experts_per_tok"], hf.get("num_experts") or hf["num_local_experts"]
        if top_k > experts:
            problems.append(f"{where}num_experts_per_tok: top-k ({top_k}) must be <= num_experts ({experts}); "
                            "lower num_experts_per_tok or raise num_experts")
    if hf["model_type"] not in HYBRID_MODEL_TYPES:
        return problems
    layer_types, layers = hf["layer_types"], hf["num_hidden_layers"]
    if (not isinstance(layer_types, list) or len(layer_types) < layers
            or not all(t in ("linear_attention", "full_attention") for t in layer_types)):
        problems.append(f"{where}layer_types: must name each of the {layers} layers 'linear_attention' or "
                        f"'full_attention' (got {layer_types!r})")
    if hf["linear_num_value_heads"] % hf["linear_num_key_heads"]:
        problems.append(f"{where}linear_num_value_heads: {hf['linear_num_value_heads']} is not divisible by "
                        f"linear_num_key_heads ({hf['linear_num_key_heads']}); each Gated DeltaNet key head "
                        "serves an equal group of value heads")
    return problems


# ----------------------------------------------------------------------------- keys of model.config


def _unknown_keys(hf: dict, where: str) -> list[tuple[str, str | None]]:
    """(problem, the known key it is closest to) per key of model.config (and of its text_config and rope
    mapping) that its model_type does not use. Warns about keys transformers knows but this runtime
    ignores, set to a non-default value."""
    from transformers import CONFIG_MAPPING  # here: transformers loads only when a model.config is checked

    model_type = hf["model_type"]
    cls = CONFIG_MAPPING[model_type]
    if model_type in CONDITIONAL_GENERATION:
        # Only the text model is built: its config is checked; of the outer one only the keys that say
        # what it holds (the vision tower's config is not ours to check).
        text_type = CONDITIONAL_GENERATION[model_type][0]
        checks = [({k: v for k, v in hf.items() if k != "vision_config"}, where, cls, {"model_type", "text_config"},
                   keys_read(text_type)),
                  (hf["text_config"], f"{where}text_config.", cls.sub_configs["text_config"], keys_read(text_type),
                   set())]
    else:
        checks = [(hf, where, cls, keys_read(model_type), set())]
    unknown = []
    for config, config_where, config_cls, read, nested_keys in checks:
        known = _transformers_keys(config_cls) | read
        unknown += [_unknown(config_where, key, config_cls, known, nested_keys) for key in config if key not in known]
        for rope_key in ("rope_parameters", "rope_scaling"):
            if isinstance(config.get(rope_key), dict):
                unknown += [_unknown(f"{config_where}{rope_key}.", key, config_cls, _rope_keys(), set())
                             for key in config[rope_key] if key not in _rope_keys()]
        _warn_ignored(config, config_where, config_cls, read)
    return unknown


def _unknown(where: str, key: str, cls: type, known: set[str], nested_keys: set[str]) -> tuple[str, str | None]:
    """The problem and the known key suggested instead. A key of the nested text_config, or of other model
    kinds (num_experts on a dense qwen3: most likely the model_type is the mistake), says so."""
    problem = f"{where}{key}: unknown key for model_type {cls.model_type}"
    if key in nested_keys:
        return f"{problem}; it belongs in {where}text_config", None
    kinds = [t for t in SUPPORTED_MODEL_TYPES if key in keys_read(t)]
    # A key this kind reads too, misplaced (in rope_parameters), is not a sign of the wrong kind.
    if kinds and key not in keys_read(cls.model_type):
        return f"{problem}; it configures {', '.join(kinds)}: change model_type or remove it", None
    close = next(iter(difflib.get_close_matches(key, sorted(known), n=1)), None)
    fix = f"did you mean {close}?" if close else f"remove it (transformers' {cls.__name__} does not take it)"
    return f"{problem}; {fix}", close


@functools.cache
def _defaults(cls: type) -> dict:
    """What transformers writes for a default config of `cls`."""
    return cls().to_dict()


def _transformers_keys(cls: type) -> set[str]:
    """What transformers' config class takes (its arguments, the common PretrainedConfig ones included),
    writes (aliases such as num_local_experts, _name_or_path) or still reads (torch_dtype, now dtype)."""
    arguments = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    return arguments | set(_defaults(cls)) | {"torch_dtype"}


def _rope_keys() -> set[str]:
    from transformers.modeling_rope_utils import RopeParameters

    return set(RopeParameters.__annotations__) | {"type"}  # "type": rope_scaling's older name of rope_type


def _warn_ignored(config: dict, where: str, cls: type, read: set[str]) -> None:
    """A key transformers knows that no training step here reads (hidden_act, attention_dropout, sliding
    windows, output_router_logits) trains as transformers' default whatever it says: warn when it says
    otherwise. A warning, not an error: a value can differ and still change nothing (max_window_layers
    without sliding windows). Keys with a list or mapping default are left out: transformers derives
    those from other keys (layer_types from num_hidden_layers)."""
    from transformers import PretrainedConfig

    common = set(_defaults(PretrainedConfig)) | NO_TRAINING_EFFECT
    defaults = _defaults(cls)
    for key in sorted(set(config) & set(defaults) - read - common):
        scalar_default = isinstance(defaults[key], (str, int, float, bool))
        if scalar_default and config[key] is not None and config[key] != defaults[key]:
            does = (f"reads {RUNTIME_KEYS[key]} instead; set that" if key in RUNTIME_KEYS else
                    f"does not read it and trains as transformers' default ({defaults[key]!r}) does; remove the key")
            warnings.warn(f"{where}{key}: {config[key]!r} has no effect; this runtime {does}", stacklevel=2)


# ----------------------------------------------------------------------------- tokenizer


def _tokenizer_size(folder: Path, key: str) -> tuple[int, str | None]:
    """(len(tokenizer), None), or (0, the problem) for a folder holding no loadable tokenizer."""
    from transformers import AutoTokenizer

    fix = (f"copy the model's tokenizer files (tokenizer.json, tokenizer_config.json) into it or point {key} "
           "at a folder that has them")
    files = sorted(p.name for p in folder.iterdir())
    if not files:
        return 0, f"{key}: tokenizer folder {folder} is empty; {fix}"
    try:
        return len(AutoTokenizer.from_pretrained(str(folder), local_files_only=True)), None
    except (OSError, ValueError, KeyError, TypeError) as err:
        # transformers reports a missing or broken tokenizer file with any of these.
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        return 0, (f"{key}: tokenizer folder {folder} holds no loadable tokenizer (files: {', '.join(files)}; "
                   f"{reason}); {fix}")
