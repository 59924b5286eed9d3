"""The trained result in HF form. export_final: a PEFT adapter (LoRA runs) or a full HF checkpoint. Merged
export of LoRA runs: a HF checkpoint whose base weights have the adapters folded in (attention and
GDN projections, routed experts), which transformers loads like any checkpoint of the model.

    export_final(model, cfg, rank, meshes)           # end of a run (checkpoint.export_hf): every rank calls it
    export_merged(model, cfg, rank, meshes)          # end of a run (checkpoint.export_merged): every rank
                                                     # calls it; rank 0 writes <train.output_dir>/merged
    python -m runtime.export RUN_DIR --merged OUT [--step N]     # from a run folder's checkpoint, on the CPU

W + scaling * B @ A is computed in fp32 and rounded once to the base weight's dtype. Quantized experts
(quant.base_weights) are dequantized first, so the merged experts are dense (the quantized values plus the
adapter, not the weights the base was quantized from). The CLI rebuilds the run's model from RUN_DIR's
config.yaml in one process and loads the LoRA factors of its newest (or --step) checkpoint.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from moe.experts import PROJECTIONS, GroupedExperts
from runtime.config import Config, ConfigError, config_from_dict
from runtime.distributed.state_dict import full_state_dict, gather_full
from runtime.guard.run_dir import STEP_DIR, RunDirError, finished_checkpoints, read_run_config
from runtime.lora import LoRALinear, export_peft
from runtime.models.hf import pop_router_bias, save_pretrained, write_router_bias

MERGED_DIR = "merged"


def merged_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict:
    """`state` (default: the model's own) with every LoRA folded into its base weight (our FQNs; the
    factors stay in and are skipped by the HF writer). Packed experts must be in `state` dequantized
    (gather_packed_experts) unless the model holds them all."""
    state = dict(state if state is not None else model.state_dict())
    for prefix, module in model.named_modules():
        if isinstance(module, LoRALinear):
            key = f"{prefix}.weight"
            delta = state[f"{prefix}.lora_B"].float() @ state[f"{prefix}.lora_A"].float()
            state[key] = (state[key].float() + module.lora_scaling * delta).to(state[key].dtype)
        elif isinstance(module, GroupedExperts):
            for proj in PROJECTIONS:
                key = f"{prefix}.{proj}"
                base = state[key] if key in state else module.dense_weight(proj)
                if module.has_lora:
                    A_ErI, B_EOr = state[f"{prefix}.{proj}_lora_A"], state[f"{prefix}.{proj}_lora_B"]
                    merged = base.float() + module.lora_scaling * torch.bmm(B_EOr.float(), A_ErI.float())
                    base = merged.to(base.dtype)
                state[key] = base
    return state


def gather_packed_experts(model: torch.nn.Module, meshes=None, keep: bool = True) -> dict[str, torch.Tensor]:
    """The dequantized expert weights (FP4 / FP8 bases) of every EP rank, in global expert order (a collective
    under EP: every rank calls it); {} for a model without quantized experts."""
    out = {}
    for prefix, module in model.named_modules():
        if isinstance(module, GroupedExperts) and module.is_quantized:
            for proj in PROJECTIONS:
                full = gather_full(module.dense_weight(proj), expert=True, meshes=meshes)
                if keep:
                    out[f"{prefix}.{proj}"] = full.cpu()
    return out


def export_merged(model: torch.nn.Module, cfg: Config, rank: int, meshes=None) -> Path:
    """Every rank gathers its shards; rank 0 writes <train.output_dir>/merged atomically."""
    out = Path(cfg.train.output_dir) / MERGED_DIR
    keep = rank == 0
    state = full_state_dict(model, meshes, keep=keep)
    state.update(gather_packed_experts(model, meshes, keep=keep))
    if keep:
        save_pretrained(model, out, state=merged_state_dict(model, state))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return out


def export_final(model, cfg, rank: int, meshes=None) -> Path:
    """The trained result in HF form, gathered from the shards: a PEFT adapter (LoRA runs) under
    <output_dir>/adapter, else a full HF checkpoint under <output_dir>/hf. Every rank calls it. Router
    selection biases (model.router_bias_update_rate) go beside either as router_bias.safetensors."""
    out = Path(cfg.train.output_dir)
    if cfg.lora.enabled:
        out = out / "adapter"
        export_peft(model, out, cfg.model.path, gather=partial(gather_full, meshes=meshes))
        if rank == 0:  # the biases are buffers, the same whole tensor on every rank
            write_router_bias(pop_router_bias({k: b.detach().cpu() for k, b in model.named_buffers()}), out, out)
    else:
        out = out / "hf"
        state = full_state_dict(model, meshes, keep=rank == 0)
        if rank == 0:
            save_pretrained(model, out, state=state)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return out


# ----------------------------------------------------------------------------- python -m runtime.export


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    found = finished_checkpoints(run_dir)
    if not found:
        raise RunDirError(f"{run_dir} holds no finished checkpoint; train with checkpoint.save_final (the default) "
                          "or checkpoint.every_n_steps")
    if step is None:
        return found[-1]
    steps = {int(STEP_DIR.match(p.name)[1]): p for p in found}
    if step not in steps:
        raise RunDirError(f"{run_dir} has no checkpoint of step {step}; it has steps {sorted(steps)}")
    return steps[step]


def load_run_model(run_dir: Path, step: int | None = None):
    """(cfg, the run's model on the CPU with the LoRA factors of its checkpoint, that checkpoint)."""
    from runtime.choices import MODEL_CHOICES
    from runtime.distributed.mesh import ParallelDims
    from runtime.distributed.process_group import DistEnv
    from runtime.models.factory import build_model
    from runtime.plan import plan

    cfg = config_from_dict(read_run_config(run_dir))
    # One CPU process that only loads weights: the run's kernels and mesh do not matter here.
    cfg = plan(cfg.model_copy(update={
        "model": cfg.model.model_copy(update=dict.fromkeys(MODEL_CHOICES, "auto")),
        "compile": cfg.compile.model_copy(update={"enabled": False, "inductor_options": {}}),
        "parallelism": cfg.parallelism.model_copy(update={"dp_replicate": 1, "dp_shard": 1, "cp": 1, "ep": 1,
                                                          "dispatcher": "all_to_all"})}), 1, "cpu").config
    if not cfg.lora.enabled:
        raise ConfigError(f"{run_dir} is a full fine-tune (lora.enabled: false): its HF checkpoint is what "
                          "checkpoint.export_hf writes; there is no adapter to merge")
    path = _checkpoint(run_dir, step)
    model = build_model(cfg, DistEnv(0, 1, 0, torch.device("cpu")), ParallelDims(1, 1, 1, 1, 1))
    factors = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    dcp.load({"model": factors}, checkpoint_id=str(path), no_dist=True)  # in place, global expert order = all experts here
    return cfg, model, path


def main(argv: list[str] | None = None) -> int:
    """The CLI; failures end as in runtime.launch (one `error:` line, --debug for the traceback)."""
    from runtime.guard.failure_report import guarded_main
    from runtime.guard.failures import RunContext

    argv = list(sys.argv[1:] if argv is None else argv)
    return guarded_main(lambda _context: export_cli(argv), RunContext(argv, module="runtime.export", resumable=False))


def export_cli(argv: list[str]) -> int:
    from runtime.cli import CliParser

    parser = CliParser(prog="python -m runtime.export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run folder (train.output_dir) of a LoRA run")
    parser.add_argument("--merged", type=Path, required=True, help="where to write the merged HF checkpoint")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    parser.add_argument("--debug", action="store_true", help="print the traceback of user errors too")
    args = parser.parse_args(argv)
    _, model, path = load_run_model(args.run_dir, args.step)
    save_pretrained(model, args.merged, state=merged_state_dict(model, {**model.state_dict(),
                                                                        **gather_packed_experts(model)}))
    print(f"{args.merged}: merged from {path}")
    return 0


if __name__ == "__main__":
    # The imported module's main, not this __main__ copy's (as runtime.launch does).
    from runtime.export import main as _main

    sys.exit(_main())
