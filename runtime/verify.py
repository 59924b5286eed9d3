"""Distributed-vs-single-process parity as a user command:

    torchrun --nproc_per_node 4 -m runtime.verify --ep 2 cfg.yaml [--steps 3]

runs K optimizer steps with the requested parallelism, then (on rank 0) the same K steps of the same
config in one process over the same global batch, and prints per-step loss, grad-norm and per-tensor
gradient deltas with PASS/FAIL. Tolerances (norm-relative): fp32 loss 1e-5, grads 1e-4; bf16 (GPU:
FSDP casts parameters to bf16, the one-process reference autocasts fp32 parameters) loss 2e-2, grads
5e-2 at step 1 and 1e-1 after the first update, router weights 1e-1: the rounding differs, and in the
router it moves near-tie top-k choices; once the two runs' weights have drifted apart by one update,
such a flip moves whole tokens between experts (measured on GPUs: docs/validation.md).
"""

from __future__ import annotations

import sys
import tempfile

import torch
import torch.distributed as dist

from runtime.config import Config
from runtime.distributed.mesh import Meshes, ParallelDims
from runtime.distributed.process_group import DistEnv

TOLERANCES = {"float32": {"loss": 1e-5, "grad": 1e-4, "grad_after_update": 1e-4, "router_grad": 1e-4},
              "bfloat16": {"loss": 2e-2, "grad": 5e-2, "grad_after_update": 1e-1, "router_grad": 1e-1}}


def _grad_tolerance(fqn: str, tol: dict, step: int) -> float:
    if fqn.endswith("mlp.gate.weight"):
        return tol["router_grad"]
    return tol["grad"] if step == 1 else tol["grad_after_update"]


def _verification_config(cfg: Config, steps: int, output_dir: str, **parallelism) -> Config:
    update = {"train": cfg.train.model_copy(update={"max_steps": steps, "output_dir": output_dir}),
              "checkpoint": cfg.checkpoint.model_copy(update={"every_n_steps": 0, "save_final": False,
                                                               "export_hf": False, "resume": False}),
              "logging": cfg.logging.model_copy(update={"progress_bar": False, "jsonl": False})}
    if parallelism:
        update["parallelism"] = cfg.parallelism.model_copy(update=parallelism)
    return cfg.model_copy(update=update)


def full_grads(model: torch.nn.Module, meshes: Meshes | None) -> dict[str, torch.Tensor]:
    """Every gradient as the full tensor on CPU: FSDP shards gathered, EP expert slices concatenated
    in expert order. A collective on every rank; all ranks get the result."""
    from runtime.distributed.state_dict import gather_full, is_expert_param

    # clone: an optimizer step may scale p.grad in place (clipping)
    return {fqn: gather_full(p.grad, is_expert_param(model, fqn), meshes).detach().float().cpu().clone()
            for fqn, p in model.named_parameters() if p.grad is not None}


def record_run(cfg: Config, env: DistEnv, dims: ParallelDims, meshes: Meshes | None) -> list[dict]:
    """Trains cfg.train.max_steps steps; per step: loss, grad norm and the full gradients."""
    from runtime.train import train

    grads: list[dict] = []
    records = train(cfg, env, dims, meshes, on_grads=lambda m: grads.append(full_grads(m, meshes)))
    return [{"loss": r["loss"], "grad_norm": r["grad_norm"], "grads": g} for r, g in zip(records, grads)]


def reference_run(cfg: Config, dims: ParallelDims, steps: int, device: torch.device) -> list[dict]:
    """The same global batch in one process: micro-batch x dp_world, no parallelism."""
    with tempfile.TemporaryDirectory() as out:
        ref = _verification_config(cfg, steps, out, dp_replicate=1, dp_shard=1, cp=1, ep=1)
        ref = ref.model_copy(update={"train": ref.train.model_copy(
            update={"micro_batch_size": cfg.train.micro_batch_size * dims.dp_world})})
        return record_run(ref, DistEnv(0, 1, 0, device), ParallelDims(1, 1, 1, 1, 1), None)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def compare(dist_steps: list[dict], ref_steps: list[dict], dtype: str) -> tuple[bool, list[str]]:
    tol = TOLERANCES[dtype]
    lines, ok = [f"{'step':>4} {'loss':>12} {'ref loss':>12} {'rel':>9} {'gnorm rel':>9} {'worst grad (rel)':>40}  result"], True
    for i, (d, r) in enumerate(zip(dist_steps, ref_steps), 1):
        loss_rel = abs(d["loss"] - r["loss"]) / max(abs(r["loss"]), 1e-12)
        gn_rel = abs(d["grad_norm"] - r["grad_norm"]) / max(abs(r["grad_norm"]), 1e-12)
        if set(d["grads"]) != set(r["grads"]):
            missing = sorted(set(r["grads"]) ^ set(d["grads"]))
            return False, lines + [f"gradient sets differ: {missing[:5]}"]
        errs = {k: _rel(d["grads"][k], r["grads"][k]) for k in r["grads"]}
        # worst relative to its own tolerance
        worst = max(errs, key=lambda k: errs[k] / _grad_tolerance(k, tol, i))
        step_ok = (loss_rel <= tol["loss"] and errs[worst] <= _grad_tolerance(worst, tol, i)
                   and gn_rel <= tol["grad"])
        ok &= step_ok
        lines.append(f"{i:>4} {d['loss']:>12.6f} {r['loss']:>12.6f} {loss_rel:>9.1e} {gn_rel:>9.1e} "
                     f"{worst[-32:]:>32} {errs[worst]:>7.1e}  {'PASS' if step_ok else 'FAIL'}")
    return ok, lines


def main(argv: list[str] | None = None) -> int:
    """The CLI; failures end as in runtime.launch (one line from rank 0, --debug for the traceback)."""
    from runtime.distributed.process_group import env_world
    from runtime.failure_report import guarded_main
    from runtime.failures import RunContext
    from runtime.launch import setup_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging(env_world()[0])
    # Nothing to resume: verification writes no checkpoint.
    return guarded_main(lambda _context: verify(argv), RunContext(argv, module="runtime.verify", resumable=False))


def verify(argv: list[str]) -> int:
    """Runs the comparison; 0 when every step is within tolerance, else 1."""
    from runtime.distributed.process_group import init_distributed
    from runtime.launch import CliParser, prepare

    extra = CliParser(prog="python -m runtime.verify", add_help=False)
    extra.add_argument("--steps", type=int, default=3)
    known, rest = extra.parse_known_args(argv)
    _, cfg, dims = prepare(rest)
    env = init_distributed(timeout_s=cfg.parallelism.collective_timeout_s)
    meshes = dims.build_meshes(env.device.type) if env.world_size > 1 else None
    with tempfile.TemporaryDirectory() as out:
        dist_steps = record_run(_verification_config(cfg, known.steps, out), env, dims, meshes)
    ok = True
    if env.is_main:
        ref_steps = reference_run(cfg, dims, known.steps, env.device)
        dtype = "bfloat16" if env.device.type == "cuda" else "float32"
        ok, lines = compare(dist_steps, ref_steps, dtype)
        print(f"verify: {dims} vs one process, {known.steps} steps, {dtype}, tolerances {TOLERANCES[dtype]}")
        print("\n".join(lines))
        print("PASS" if ok else "FAIL")
    if env.world_size > 1:
        flag = torch.tensor([int(ok)], device=env.device)
        dist.broadcast(flag, 0)
        ok = bool(flag.item())
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
