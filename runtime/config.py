"""The YAML schema of a training run. Every check happens here, before any process group or model.

`load_config(path, overrides)` -> Config, or ConfigError whose message names the key and the fix.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from moe.dispatch.deepep import deepep_unavailable_reason
from runtime.model_config_check import model_config_problems
from runtime.registry import check_choice


class ConfigError(ValueError):
    """A config problem found before anything ran; the message names the key and the fix."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


INDUCTOR_OPTIONS = {
    "max_autotune", "max_autotune_gemm", "coordinate_descent_tuning", "epilogue_fusion",
    "shape_padding", "triton.cudagraphs", "aggressive_fusion",
}


def _registered(section: str, name: str, info: ValidationInfo) -> str:
    """`name` if the registry of `section.<field>` knows it (names live with their implementations)."""
    problem = check_choice(f"{section}.{info.field_name}", name)
    if problem:
        raise PydanticCustomError("unknown_name", "{problem}", {"problem": problem})
    return name


class ModelConfig(Section):
    # A HF checkpoint folder (config.json + safetensors), or `config` for random init (tiny demos).
    path: str | None = None
    config: dict[str, Any] | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Implementation names, checked against their registries (runtime/registry.py).
    expert_backend: str = "auto"  # scattermoe on CUDA where Triton is installed, else grouped_mm
    attn_backend: str = "auto"  # flash (varlen over cu_seqlens) on CUDA when installed, else sdpa
    norm_rope_impl: str = "auto"
    # lm_head + cross-entropy (runtime/loss.py): auto = a fused loss that never holds [tokens, vocab] logits.
    loss_impl: str = "auto"
    # Gated DeltaNet kernels of hybrid models: auto = fla on CUDA when installed and able to run its
    # backward here (FLA on Hopper with Triton < 3.7.1 needs tilelang), else torch.
    gdn_op_set: str = "auto"
    router_aux_loss_coef: float = Field(0.0, ge=0.0)
    # Benchmarks only: each token's k experts are chosen by a fixed pattern that gives every expert the
    # same slot count (weights still the router's probabilities); it changes the model.
    router_force_balanced: bool = False
    # Aux-loss-free load balancing (DeepSeek-V3): a per-expert bias on the top-k choice moves by this much
    # per optimizer step toward the mean load (e.g. 1e-3); 0: off. HF exports carry no bias (a side file).
    router_bias_update_rate: float = Field(0.0, ge=0.0)
    # Fewer decoder layers than the checkpoint has (parity checks of big models).
    num_layers_override: int | None = Field(None, ge=1)

    @field_validator("expert_backend", "attn_backend", "norm_rope_impl", "gdn_op_set", "loss_impl")
    @classmethod
    def _implementation(cls, name: str, info: ValidationInfo) -> str:
        return _registered("model", name, info)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.config is None):
            raise ValueError("set exactly one of model.path (a HF checkpoint folder) or model.config "
                             "(a HF-style config dict for a randomly initialized model)")
        return self


class DataConfig(Section):
    path: str
    format: Literal["auto", "jsonl", "parquet", "arrow"] = "auto"
    kind: Literal["auto", "text", "chat"] = "auto"
    text_field: str = "text"
    messages_field: str = "messages"
    tokenizer: str | None = None  # defaults to model.path
    seq_len: int = Field(2048, ge=8)
    shuffle: bool = True
    seed: int = 0
    skip_bad_records: bool = False
    # Chat records longer than seq_len: drop them (counted at load) or keep their first seq_len tokens.
    overlong: Literal["drop", "truncate"] = "drop"
    # Held-out documents for the eval loss: a file (same format rules as path), or this fraction of the
    # training documents, chosen by `seed` and never trained on. Neither: no eval.
    eval: str | None = None
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _one_eval_source(self):
        if self.eval is not None and self.eval_fraction > 0:
            raise ValueError("set data.eval (a held-out file) or data.eval_fraction (a share of data.path), not both")
        return self

    @property
    def has_eval(self) -> bool:
        return self.eval is not None or self.eval_fraction > 0


class LoraConfig(Section):
    enabled: bool = False
    rank: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # GDN projections: in_proj_qkv/z/b/a (Qwen3.5), in_proj_qkvz/ba (Qwen3-Next), out_proj.
    target_modules: list[Literal["q_proj", "k_proj", "v_proj", "o_proj", "experts", "in_proj_qkv", "in_proj_z",
                                 "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj"]] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "experts"])


class ParallelismConfig(Section):
    dp_replicate: int = Field(1, ge=1)
    dp_shard: int = Field(-1, ge=-1)  # -1: whatever the world size leaves
    cp: int = Field(1, ge=1)
    # Attention under cp > 1 (attention/context_parallel.py): K/V all-gather, or Ulysses head exchange.
    cp_attention: Literal["allgather", "ulysses"] = "allgather"
    # GDN layers under cp > 1 (attention/gdn.py): head-parallel (linear_num_key_heads % cp == 0), or state
    # passing between the zigzag pieces (any cp; needs model.gdn_op_set torch).
    cp_gdn: Literal["heads", "state"] = "heads"
    ep: int = Field(1, ge=1)
    # The EP dispatcher (runtime/registry.py); with ep 1 every dispatcher is the local identity.
    dispatcher: str = "all_to_all"
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    # FSDP's parameter gathers under bf16 autocast (CUDA): bf16 rounds every parameter for compute, norms, router,
    # embedding and GDN decay included; fp32 gathers the parameters in their own dtype and autocast casts only
    # the matmul inputs: one GPU's precision, at twice the gather bytes of fp32 masters; auto: fp32 under EP
    # (the experts keep their own bf16 units there), bf16 without (runtime/distributed/fsdp.py).
    fsdp_param_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    # A collective that waits longer fails; the watchdog ends every rank once a peer stalls this long.
    collective_timeout_s: int = Field(600, ge=5)

    @field_validator("dispatcher")
    @classmethod
    def _registered_dispatcher(cls, name: str, info: ValidationInfo) -> str:
        return _registered("parallelism", name, info)

    @model_validator(mode="after")
    def _dp_shard(self):
        if self.dp_shard == 0:
            raise ValueError("parallelism.dp_shard must be >= 1, or -1 to use the rest of the world size")
        return self


class QuantConfig(Section):
    # Routed experts' frozen base weights packed in FP4 (quant/), read by the expert kernels; LoRA only.
    base_weights: Literal["none", "mxfp4", "nvfp4"] = "none"


class CompileConfig(Section):
    enabled: bool = False
    inductor_options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _options(self):
        unknown = sorted(set(self.inductor_options) - INDUCTOR_OPTIONS)
        if unknown:
            raise ValueError(f"compile.inductor_options has unknown keys {unknown}; "
                             f"allowed: {sorted(INDUCTOR_OPTIONS)}")
        if self.inductor_options and not self.enabled:
            raise ValueError("compile.inductor_options is set but compile.enabled is false; "
                             "set compile.enabled: true or drop the options")
        if self.inductor_options.get("triton.cudagraphs"):
            warnings.warn("compile.inductor_options triton.cudagraphs: packed batches change shape (documents "
                          "per row vary), so CUDA graphs re-record often; expect little gain", stacklevel=2)
        return self


class OptimConfig(Section):
    lr: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0)  # 0 disables clipping
    # What trainable parameters are kept in (runtime/optim.py): fp32 masters under bf16 autocast, or bf16
    # parameters with a stochastic-rounding AdamW (half the memory of parameters, grads and states).
    master_dtype: Literal["fp32", "bf16"] = "fp32"


class TrainConfig(Section):
    max_steps: int = Field(100, ge=1)
    micro_batch_size: int = Field(1, ge=1)  # packed rows per rank per micro step
    grad_accum_steps: int = Field(1, ge=1)
    seed: int = 0
    output_dir: str = "outputs/run"
    # A non-finite loss or grad norm: stop (no update, clear error) or skip the update and go on,
    # stopping once max_nan_skips steps in a row were skipped.
    nan_policy: Literal["stop", "skip"] = "stop"
    max_nan_skips: int = Field(3, ge=1)
    # Eval loss every N optimizer steps (0: only at the end of the run), when data.eval / eval_fraction is set.
    eval_every_n_steps: int = Field(0, ge=0)
    # Python's garbage collection at every N-th step boundary, the same on every rank, instead of automatic
    # collections that pause one rank mid-step while the others wait (runtime.gc_schedule); 0: automatic.
    gc_every_n_steps: int = Field(50, ge=0)


class CheckpointConfig(Section):
    every_n_steps: int = Field(0, ge=0)  # 0: only at the end
    keep_last: int = Field(2, ge=1)
    resume: bool = False
    save_final: bool = True
    export_hf: bool = False  # also write HF safetensors (full) or a PEFT adapter (LoRA) at the end
    # LoRA runs: also write a HF checkpoint with the adapters merged into the base weights (experts too)
    export_merged: bool = False


class WandbConfig(Section):
    project: str
    name: str | None = None
    mode: Literal["online", "offline", "disabled"] = "online"


class LoggingConfig(Section):
    every_n_steps: int = Field(1, ge=1)
    progress_bar: bool = True
    jsonl: bool = True
    # Trackers (rank 0 only; optional packages: pip install 'moe-runtime[trackers]'): TensorBoard event files
    # under <output_dir>/tensorboard, Weights & Biases runs (offline mode works without network).
    tensorboard: bool = False
    wandb: WandbConfig | None = None


class ProfilingConfig(Section):
    # Optimizer steps traced by torch.profiler (runtime/profiling.py): per rank a Chrome trace and the top ops
    # under <output_dir>/profile/, and on rank 0 one line of wall time, device kernel time and host syncs.
    steps: list[int] = Field(default_factory=list)
    top: int = Field(25, ge=1)  # ops listed per rank and step


class Config(Section):
    model: ModelConfig
    data: DataConfig
    lora: LoraConfig = Field(default_factory=LoraConfig)
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    quant: QuantConfig = Field(default_factory=QuantConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    profiling: ProfilingConfig = Field(default_factory=ProfilingConfig)

    @model_validator(mode="after")
    def _combinations(self):
        if self.optim.warmup_steps >= self.train.max_steps and self.optim.warmup_steps > 0:
            raise ValueError(f"optim.warmup_steps ({self.optim.warmup_steps}) must be smaller than "
                             f"train.max_steps ({self.train.max_steps})")
        if self.model.config is not None and self.data.tokenizer is None:
            raise ValueError("model.config (random init) has no tokenizer: set data.tokenizer")
        p = self.parallelism
        # Accepted by the schema but not built yet: refuse rather than train wrongly.
        if p.cp > 1 and self.data.seq_len % (2 * p.cp):
            raise ValueError(f"parallelism.cp={p.cp} cuts every row into 2*cp = {2 * p.cp} equal pieces; set "
                             f"data.seq_len (now {self.data.seq_len}) to a multiple of {2 * p.cp}")
        if p.dispatcher == "deepep" and (missing := deepep_unavailable_reason()):
            raise ValueError(f"parallelism.dispatcher: deepep cannot run here: {missing}; or use all_to_all")
        if p.dispatcher == "local" and p.ep > 1:
            raise ValueError(f"parallelism.dispatcher: local keeps every expert on every rank, but "
                             f"parallelism.ep is {p.ep}; use all_to_all")
        if self.checkpoint.export_merged and not self.lora.enabled:
            raise ValueError("checkpoint.export_merged merges LoRA adapters into the base weights, but lora.enabled "
                             "is false; a full fine-tune's HF checkpoint is checkpoint.export_hf")
        if outside := sorted(s for s in self.profiling.steps if not 1 <= s <= self.train.max_steps):
            raise ValueError(f"profiling.steps {outside} are not steps of this run (1..train.max_steps = "
                             f"{self.train.max_steps})")
        if self.train.eval_every_n_steps and not self.data.has_eval:
            raise ValueError("train.eval_every_n_steps is set but there is no eval data; set data.eval (a file) or "
                             "data.eval_fraction")
        if self.quant.base_weights != "none" and not self.lora.enabled:
            raise ValueError(f"quant.base_weights: {self.quant.base_weights} packs the routed experts' base weights "
                             "into frozen FP4, which a full fine-tune would have to train; set lora.enabled: true "
                             "(LoRA on top of the packed experts) or quant.base_weights: none")
        if p.dp_shard > 0:
            shard_cp = p.dp_shard * p.cp
            if shard_cp % p.ep:
                raise ValueError(f"parallelism.ep ({p.ep}) must divide dp_shard*cp ({p.dp_shard}*{p.cp}); "
                                 "experts are carved out of the FSDP ranks")
        return self


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see runtime/config.py for the schema)"
        elif e["type"] == "missing":
            msg = "required key is missing"
        lines.append(f"  {key}: {msg}" + (f" (got {e['input']!r})" if e["type"] not in
                                          ("missing", "extra_forbidden") and "input" in e
                                          and not isinstance(e["input"], dict) else ""))
    return "\n".join(lines)


def _apply_override(raw: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {key} is not a section")
    node[leaf] = value


def config_from_dict(raw: dict, overrides: dict[str, Any] | None = None, source: str = "<dict>",
                     base_dir: str | Path | None = None) -> Config:
    """Dict -> validated Config; relative paths that exist under `base_dir` are made absolute first, so the
    model and tokenizer folders are checked where they will be read."""
    raw = dict(raw)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _apply_override(raw, dotted, value)
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None
    if base_dir is not None:
        _resolve_paths(cfg, Path(base_dir))
    problems = model_config_problems(cfg.model.config, cfg.model.path, cfg.data.tokenizer or cfg.model.path,
                                     "data.tokenizer" if cfg.data.tokenizer else "model.path")
    if problems:
        raise ConfigError("\n".join([f"invalid config {source}:"] + [f"  {p}" for p in problems]))
    return cfg


def _resolve_paths(cfg: Config, base: Path) -> None:
    for section, key in (("model", "path"), ("data", "path"), ("data", "tokenizer"), ("data", "eval")):
        sec = getattr(cfg, section)
        value = getattr(sec, key)
        if value and not Path(value).is_absolute() and (base / value).exists():
            setattr(sec, key, str(base / value))


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """YAML file -> validated Config. `overrides` maps dotted keys ("parallelism.ep") to values."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: YAML syntax error: {getattr(err, 'problem', err)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, ...)")
    # Relative paths in a config are relative to the config file, so examples run from anywhere.
    return config_from_dict(raw, overrides, source=str(path), base_dir=path.resolve().parent)
