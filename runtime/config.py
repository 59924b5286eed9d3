"""The YAML schema of a training run: names and values of every key. Checks of combinations against what the
implementations can do (capabilities, model shapes, the mesh) are runtime.plan's, also before any process group.

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

from runtime.errors import ConfigError
from runtime.models.config_check import model_config_problems
from runtime.registry import check_choice


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


INDUCTOR_OPTIONS = {
    "max_autotune", "max_autotune_gemm", "coordinate_descent_tuning", "epilogue_fusion",
    "shape_padding", "triton.cudagraphs", "aggressive_fusion", "reorder_for_compute_comm_overlap",
}


def _registered(section: str, name: str, info: ValidationInfo) -> str:
    """`name` if the registry of `section.<field>` knows it (names live with their implementations)."""
    problem = check_choice(f"{section}.{info.field_name}", name)
    if problem:
        raise PydanticCustomError("unknown_name", "{problem}", {"problem": problem})
    return name


class ModelConfig(Section):
    """The model: where its weights come from and which implementation computes each part."""

    path: str | None = Field(None, description="a HF checkpoint folder (config.json + safetensors); or set config")
    config: dict[str, Any] | None = Field(None, description=(
        "a HF-style config dict (model_type, sizes) for a randomly initialized model; or set path"))
    dtype: Literal["float32", "bfloat16"] = Field("float32", description=(
        "dtype the weights are kept in (float32: fp32 masters under bf16 autocast on CUDA)"))
    # Implementation names are checked against their registries (runtime/registry.py); runtime.plan resolves
    # "auto" from the capabilities they declare and records the choice in the run folder's resolved.yaml.
    expert_backend: str = Field("auto", description=(
        "the expert computation (moe/backends); eager is the per-expert reference"))
    attn_backend: str = Field("auto", description=(
        "attention kernel: sdpa masks packed documents, flash runs varlen over cu_seqlens"))
    norm_rope_impl: str = Field("auto", description=(
        "fused q/k RMSNorm + RoPE (attention/norm_rope.py); torch is the reference"))
    loss_impl: str = Field("auto", description=(
        "lm_head + cross-entropy (runtime/loss.py); chunked never holds [tokens, vocab] logits"))
    gdn_op_set: str = Field("auto", description=(
        "Gated DeltaNet kernels of hybrid models; torch is the exact reference, fla flash-linear-attention"))
    router_aux_loss_coef: float = Field(0.0, ge=0.0, description=(
        "weight of the router's load-balancing loss, computed over the global batch (0: off)"))
    router_force_balanced: bool = Field(False, description=(
        "benchmarks only: each token's k experts follow a fixed pattern that gives every expert the same "
        "slot count (weights still the router's probabilities); changes the model"))
    router_bias_update_rate: float = Field(0.0, ge=0.0, description=(
        "aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the top-k choice moves this much per step "
        "toward the mean load (e.g. 1e-3; 0: off); HF exports carry it beside, as router_bias.safetensors"))
    num_layers_override: int | None = Field(None, ge=1, description=(
        "build fewer decoder layers than the checkpoint has (parity checks of big models)"))

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
    """Training (and eval) documents, tokenized and packed into rows of seq_len tokens."""

    path: str = Field(description="training data: a JSONL or Parquet file, or a datasets.save_to_disk folder")
    format: Literal["auto", "jsonl", "parquet", "arrow"] = Field("auto", description=(
        "file format of path (auto: from its suffix, or a folder's files)"))
    kind: Literal["auto", "text", "chat"] = Field("auto", description=(
        "text records, or chat records rendered by the chat template (auto: chat where a record has messages)"))
    text_field: str = Field("text", description="the record field holding a text document")
    messages_field: str = Field("messages", description="the record field holding a chat's messages")
    tokenizer: str | None = Field(None, description="a tokenizer folder (defaults to model.path)")
    seq_len: int = Field(2048, ge=8, description="tokens per packed row")
    shuffle: bool = Field(True, description="shuffle documents (by seed) before packing")
    seed: int = Field(0, description="seed of the document shuffle and of the eval_fraction split")
    skip_bad_records: bool = Field(False, description="skip records that cannot be read (counted) instead of stopping")
    overlong: Literal["drop", "truncate"] = Field("drop", description=(
        "chat records longer than seq_len: drop them (counted at load) or keep their first seq_len tokens"))
    eval: str | None = Field(None, description="a held-out file for the eval loss (same format rules as path)")
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description=(
        "this share of the training documents, chosen by seed and never trained on, is the eval set"))

    @model_validator(mode="after")
    def _one_eval_source(self):
        if self.eval is not None and self.eval_fraction > 0:
            raise ValueError("set data.eval (a held-out file) or data.eval_fraction (a share of data.path), not both")
        return self

    @property
    def has_eval(self) -> bool:
        return self.eval is not None or self.eval_fraction > 0


class LoraConfig(Section):
    """LoRA adapters (PEFT format) on attention, GDN projections and experts."""

    enabled: bool = Field(False, description="train LoRA adapters on a frozen base instead of every weight")
    rank: int = Field(16, ge=1, description="LoRA rank r")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha (the update is scaled by alpha / rank)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the LoRA branch's input")
    target_modules: list[Literal["q_proj", "k_proj", "v_proj", "o_proj", "experts", "in_proj_qkv", "in_proj_z",
                                 "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj"]] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "experts"], description=(
            "modules with adapters; GDN: in_proj_qkv/z/b/a (Qwen3.5), in_proj_qkvz/ba (Qwen3-Next), out_proj"))


class ParallelismConfig(Section):
    """The mesh (world = dp_replicate * dp_shard * cp; ep carved out of dp_shard * cp) and its options."""

    dp_replicate: int = Field(1, ge=1, description="HSDP replicas (each holds a full FSDP-sharded copy)")
    dp_shard: int = Field(-1, ge=-1, description="FSDP shards per replica (-1: whatever the world size leaves)")
    cp: int = Field(1, ge=1, description="context parallelism: ranks that split every row along the sequence")
    cp_attention: Literal["allgather", "ulysses"] = Field("allgather", description=(
        "attention under cp > 1: all-gather K/V (any head count), or Ulysses all-to-all from sequence to heads"))
    cp_gdn: Literal["heads", "state"] = Field("heads", description=(
        "GDN layers under cp > 1: head-parallel (cp divides linear_num_key_heads), or state passing (any cp)"))
    ep: int = Field(1, ge=1, description="expert parallelism: ranks the experts are split over (divides dp_shard*cp)")
    dispatcher: str = Field("auto", description=(
        "the token exchange under ep > 1 (local: ep 1 only; all_gather: no host sync, more memory; auto: "
        "all_gather for LoRA at ep <= 4 where it fits, else all_to_all: docs/config-auto.md); every dispatcher "
        "is the identity at ep 1"))
    gather_capacity: float = Field(1.25, gt=0, description=(
        "all_gather's first bound on a rank's expert slots in training, in multiples of their count under balanced "
        "routing (per-slot buffers are sized by it); a step that needs more is computed again with 1.5x"))
    activation_checkpoint: Literal["none", "full", "selective"] = Field("none", description=(
        "recompute in backward: none, whole blocks (full), or all but matmul/attention outputs and EP exchanges"))
    fsdp_param_dtype: Literal["auto", "bf16", "fp32"] = Field("auto", description=(
        "dtype of FSDP's parameter gathers under CUDA autocast (fp32: one GPU's precision for norms, router)"))
    frozen_dense: Literal["auto", "replicate", "shard"] = Field("auto", description=(
        "LoRA's frozen dense weights whole on every rank, trainables in one FSDP unit, or whole too where no "
        "expert unit is left (ep = world; replicate), or per-block FSDP units (shard); auto: replicate when they "
        "take <= 1/8 of device memory"))
    collective_timeout_s: int = Field(600, ge=5, description=(
        "a collective that waits longer fails; the watchdog ends every rank once a peer stalls this long"))

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
    """Quantized expert weights."""

    base_weights: Literal["none", "mxfp4", "nvfp4", "fp8"] = Field("none", description=(
        "routed experts' frozen base weights held quantized (quant/): packed FP4 read by the expert kernels, or "
        "FP8 e4m3 with rowwise scales, whose GEMMs run on FP8 tensor cores; LoRA only"))
    train_fp8: Literal["none", "experts", "experts+dense"] = Field("none", description=(
        "full fine-tune GEMMs in FP8 e4m3 (scales from the current weights and activations, masters and optimizer "
        "unchanged): the routed experts' forward and both backward GEMMs (rowwise); experts+dense adds the decoder "
        "layers' dense linears large enough to gain (torchao float8 training, tensorwise); sm90+ on CUDA"))


class CompileConfig(Section):
    """torch.compile of the decoder blocks."""

    enabled: bool | Literal["auto"] = Field("auto", description=(
        "torch.compile every decoder block (fullgraph: a graph break is an error); auto compiles a LoRA run on CUDA "
        "without FP8 training or cp, on one device or at ep = world on the all_gather dispatcher (runtime.plan)"))
    inductor_options: dict[str, Any] = Field(default_factory=dict, description=(
        "an allowlist of torch._inductor.config keys, e.g. max_autotune, coordinate_descent_tuning"))

    @field_validator("enabled", mode="before")
    @classmethod
    def _bool_or_auto(cls, value):
        # one error line for anything else (the union would report each of its members)
        if value == "auto" or isinstance(value, bool):
            return value
        raise PydanticCustomError("bool_or_auto", "Input should be true, false or auto")

    @model_validator(mode="after")
    def _options(self):
        unknown = sorted(set(self.inductor_options) - INDUCTOR_OPTIONS)
        if unknown:
            raise ValueError(f"compile.inductor_options has unknown keys {unknown}; "
                             f"allowed: {sorted(INDUCTOR_OPTIONS)}")
        if self.inductor_options and self.enabled is False:
            raise ValueError("compile.inductor_options is set but compile.enabled is false; "
                             "set compile.enabled: true or drop the options")
        if self.inductor_options.get("triton.cudagraphs"):
            warnings.warn("compile.inductor_options triton.cudagraphs: packed batches change shape (documents "
                          "per row vary), so CUDA graphs re-record often; expect little gain", stacklevel=2)
        return self


class OptimConfig(Section):
    """AdamW with linear warmup and cosine decay."""

    lr: float = Field(2e-4, gt=0, description="peak learning rate of AdamW")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's beta1, beta2")
    eps: float = Field(1e-8, gt=0, description="AdamW's epsilon")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps, then cosine decay to min_lr_ratio * lr")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the learning rate at the end of the cosine, over lr")
    grad_clip: float = Field(1.0, ge=0, description="clip the global gradient norm to this (0: no clipping)")
    master_dtype: Literal["fp32", "bf16"] = Field("fp32", description=(
        "trainable parameters in fp32 (under bf16 autocast), or bf16 with a stochastic-rounding AdamW"))


class TrainConfig(Section):
    """The step loop."""

    max_steps: int = Field(100, ge=1, description="optimizer steps of the run")
    micro_batch_size: int = Field(1, ge=1, description="packed rows per rank per micro step")
    grad_accum_steps: int = Field(1, ge=1, description="micro steps per optimizer step")
    seed: int = Field(0, description="seed of the random init, the LoRA init and torch's RNG")
    output_dir: str = Field("outputs/run", description="the run folder: config, metrics.jsonl, checkpoints, exports")
    nan_policy: Literal["stop", "skip"] = Field("stop", description=(
        "a non-finite loss or grad norm: stop with an error, or skip that update and go on"))
    max_nan_skips: int = Field(3, ge=1, description="with nan_policy skip: stop after this many skipped steps in a row")
    eval_every_n_steps: int = Field(0, ge=0, description=(
        "eval loss every N optimizer steps when eval data is set (0: only at the end)"))
    gc_every_n_steps: int = Field(50, ge=0, description=(
        "Python's garbage collection at every N-th step boundary on every rank, never mid-step (0: automatic)"))
    graph_step: bool = Field(False, description=(
        "replay each step's forward, backward and update from a CUDA graph per batch-shape bucket (runtime.graph_step):"
        " for host-bound steps; CUDA, fused AdamW (fp32 masters), no FSDP unit (one GPU, or LoRA at ep = world on"
        " the all_gather dispatcher), no cp, no GDN layers"))


class CheckpointConfig(Section):
    """DCP checkpoints and exports at the end of the run."""

    every_n_steps: int = Field(0, ge=0, description="save a DCP checkpoint every N steps (0: only at the end)")
    keep_last: int = Field(2, ge=1, description="checkpoints of this run kept; older ones are pruned")
    resume: bool = Field(False, description="continue from the newest checkpoint in output_dir (also --resume)")
    resume_allow_model_change: bool = Field(False, description=(
        "resume although the model's definition (model.path/config/num_layers_override, lora, quant) differs "
        "from the run folder's config.yaml"))
    save_final: bool = Field(True, description="save a checkpoint at the end of the run")
    export_hf: bool = Field(False, description=(
        "at the end also write HF safetensors (full fine-tune, hf/) or a PEFT adapter (LoRA, adapter/)"))
    export_merged: bool = Field(False, description=(
        "LoRA runs: at the end also write a HF checkpoint with every adapter merged into its base weight"))


class WandbConfig(Section):
    """Weights & Biases tracker."""

    project: str = Field(description="the Weights & Biases project")
    name: str | None = Field(None, description="the run's name (default: W&B's)")
    mode: Literal["online", "offline", "disabled"] = Field("online", description=(
        "offline needs no network (wandb sync later)"))


class LoggingConfig(Section):
    """Metrics records and trackers."""

    every_n_steps: int = Field(1, ge=1, description="log a metrics record every N steps")
    progress_bar: bool = Field(True, description="a progress bar on rank 0")
    jsonl: bool = Field(True, description="write <output_dir>/metrics.jsonl")
    tensorboard: bool = Field(False, description=(
        "TensorBoard event files under <output_dir>/tensorboard (rank 0; pip install 'moe-runtime[trackers]')"))
    wandb: WandbConfig | None = Field(None, description="log to Weights & Biases (rank 0; moe-runtime[trackers])")


class ProfilingConfig(Section):
    """torch.profiler traces of chosen steps."""

    steps: list[int] = Field(default_factory=list, description=(
        "steps traced by torch.profiler: a Chrome trace and the top ops per rank under <output_dir>/profile/"))
    top: int = Field(25, ge=1, description="ops listed per rank and traced step")


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
