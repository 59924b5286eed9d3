"""Distributed-vs-single-process parity as a user command:

    torchrun --nproc_per_node 4 -m runtime.verify --ep 2 cfg.yaml [--steps 3] [--exact]

runs K optimizer steps with the requested parallelism, then (on rank 0) the same K steps of the same
config in one process over the same global batch, and prints per-step loss, grad-norm and per-tensor
gradient deltas with PASS/FAIL. Tolerances (norm-relative): fp32 loss 1e-5, grads 1e-4; bf16 (GPU:
FSDP gathers parameters in parallelism.fsdp_param_dtype, the one-process reference autocasts fp32
parameters) loss 2e-2, grads
5e-2 at step 1 and 1e-1 after the first update, router weights 1e-1: the rounding differs, and in the
router it moves near-tie top-k choices; once the two runs' weights have drifted apart by one update,
such a flip moves whole tokens between experts (docs/validation.md#runtimeverify-on-nccl).

In bf16 a third run calibrates those bounds: the same steps in one process in fp32 without autocast, on
the plainest implementation of each kind (EXACT_MODEL). A value beyond its fixed bound still passes when
the distributed run is no further from that fp32 run than twice the one-process bf16 run is (the
criterion of FlashAttention's tests): a tensor whose bf16 rounding alone moves it by 5% may differ by
that much between two bf16 runs. Calibration is dropped when the fp32 run's first loss disagrees with
the bf16 reference's (then it is not the same model).

`--exact` checks the parallelism alone on GPUs: both runs in IEEE fp32 without autocast, on EXACT_MODEL's
implementations, judged by the fp32 tolerances. A bf16 FAIL that passes with --exact is the kernels'
rounding (or a kernel's defect under parallelism: its GPU tests say which), not the sharding, the token
exchange or the state passing of context parallelism.
"""

from __future__ import annotations

import sys
import tempfile

import torch
import torch.distributed as dist

from runtime.choices import MODEL_CHOICES, registry
from runtime.config import Config, ConfigError
from runtime.distributed.mesh import Meshes, ParallelDims
from runtime.distributed.process_group import DistEnv

TOLERANCES = {"float32": {"loss": 1e-5, "grad": 1e-4, "grad_after_update": 1e-4, "router_grad": 1e-4},
              "bfloat16": {"loss": 2e-2, "grad": 5e-2, "grad_after_update": 1e-1, "router_grad": 1e-1}}
# The fp32 reference: parameters and compute in fp32, each kernel choice the plainest (Capabilities.reference:
# sharing no kernel with the runs it judges where the model allows).
EXACT_MODEL = {"dtype": "float32", **{field: registry(f"model.{field}").reference() for field in MODEL_CHOICES}}
NOISE_FACTOR = 2.0  # how much further from fp32 than the bf16 reference a distributed value may be


def _grad_tolerance(fqn: str, tol: dict, step: int) -> float:
    if fqn.endswith("mlp.gate.weight"):
        return tol["router_grad"]
    return tol["grad"] if step == 1 else tol["grad_after_update"]


def _verification_config(cfg: Config, steps: int, output_dir: str, **parallelism) -> Config:
    """cfg for `steps` verification steps; the warmup is shortened to fit them (runtime.plan refuses a warmup
    as long as the run), the same for the distributed and the reference run."""
    update = {"train": cfg.train.model_copy(update={"max_steps": steps, "output_dir": output_dir}),
              "optim": cfg.optim.model_copy(update={"warmup_steps": min(cfg.optim.warmup_steps, steps - 1)}),
              "checkpoint": cfg.checkpoint.model_copy(update={"every_n_steps": 0, "save_final": False,
                                                               "export_hf": False, "resume": False}),
              "logging": cfg.logging.model_copy(update={"progress_bar": False, "jsonl": False}),
              "profiling": cfg.profiling.model_copy(update={"steps": []})}
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


def record_run(cfg: Config, env: DistEnv, dims: ParallelDims, meshes: Meshes | None,
               autocast: bool = True) -> list[dict]:
    """Trains cfg.train.max_steps steps; per step: loss, grad norm and the full gradients."""
    from runtime.train import train

    grads: list[dict] = []
    records = train(cfg, env, dims, meshes, on_grads=lambda m: grads.append(full_grads(m, meshes)),
                    autocast=autocast)
    return [{"loss": r["loss"], "grad_norm": r["grad_norm"], "grads": g} for r, g in zip(records, grads)]


def exact_config(cfg: Config) -> Config:
    """cfg on EXACT_MODEL's implementations with fp32 parameters and masters, without FP8 training (what the
    fp32 run calibrating an FP8 run's bounds measures is the FP8 and bf16 error together)."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update=EXACT_MODEL),
                                  "optim": cfg.optim.model_copy(update={"master_dtype": "fp32"}),
                                  "quant": cfg.quant.model_copy(update={"train_fp8": "none"})})


def check_exact(cfg: Config) -> None:
    """--exact judges at fp32 bounds: refused (before any collective) where a chosen part computes in bf16."""
    if cfg.parallelism.dispatcher == "deepep":
        raise ConfigError("runtime.verify --exact: parallelism.dispatcher deepep combines in bf16 (DeepEP's combine "
                          "kernels), which fp32 bounds would fail; run --exact with dispatcher all_to_all, or verify "
                          "deepep without --exact (bf16 bounds)")
    if cfg.quant.train_fp8 != "none":
        raise ConfigError(f"runtime.verify --exact: quant.train_fp8: {cfg.quant.train_fp8} computes in FP8, which fp32 "
                          "bounds would fail; verify it without --exact (bf16 bounds)")


def ieee_fp32() -> None:
    """fp32 matmuls and convolutions in IEEE fp32 on CUDA (cuDNN's convolutions default to TF32)."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        conv.fp32_precision = "ieee"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    else:  # a torch before the fp32_precision API
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False


def reference_run(cfg: Config, dims: ParallelDims, steps: int, device: torch.device,
                  exact: bool = False) -> list[dict]:
    """The same global batch in one process: micro-batch x dp_world, no parallelism; `exact`: in fp32
    without autocast, on EXACT_MODEL's implementations."""
    with tempfile.TemporaryDirectory() as out:
        ref = _verification_config(exact_config(cfg) if exact else cfg, steps, out,
                                   dp_replicate=1, dp_shard=1, cp=1, ep=1)
        ref = ref.model_copy(update={"train": ref.train.model_copy(
            update={"micro_batch_size": cfg.train.micro_batch_size * dims.dp_world})})
        return record_run(ref, DistEnv(0, 1, 0, device), ParallelDims(1, 1, 1, 1, 1), None, autocast=not exact)


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _score(value, ref, exact, bound: float) -> tuple[float, float, float | None]:
    """(score, error against the reference, the reference's error against fp32): passes at score <= 1."""
    err = _rel(value, ref)
    score = err / bound
    if exact is None:
        return score, err, None
    noise = _rel(ref, exact)
    if noise > 0:
        score = min(score, _rel(value, exact) / (NOISE_FACTOR * noise))
    return score, err, noise


def compare(dist_steps: list[dict], ref_steps: list[dict], dtype: str,
            exact_steps: list[dict] | None = None) -> tuple[bool, list[str]]:
    tol = TOLERANCES[dtype]
    header = (f"{'step':>4} {'loss':>12} {'ref loss':>12} {'rel':>9} {'gnorm rel':>9} {'worst (rel)':>40} "
              f"{'ref-fp32':>8}  result")
    lines, ok = [header], True
    for i, (d, r) in enumerate(zip(dist_steps, ref_steps), 1):
        x = exact_steps[i - 1] if exact_steps else None
        if set(d["grads"]) != set(r["grads"]):
            missing = sorted(set(r["grads"]) ^ set(d["grads"]))
            return False, lines + [f"gradient sets differ: {missing[:5]}"]
        checks = {"loss": (d["loss"], r["loss"], x and x["loss"], tol["loss"]),
                  "grad norm": (d["grad_norm"], r["grad_norm"], x and x["grad_norm"], tol["grad"])}
        checks.update({k: (d["grads"][k], r["grads"][k], x and x["grads"][k], _grad_tolerance(k, tol, i))
                       for k in r["grads"]})
        scores = {k: _score(*v) for k, v in checks.items()}
        worst = max(scores, key=lambda k: scores[k][0])
        score, err, noise = scores[worst]
        step_ok = score <= 1.0
        ok &= step_ok
        noise_col = "-" if noise is None else f"{noise:.1e}"
        lines.append(f"{i:>4} {d['loss']:>12.6f} {r['loss']:>12.6f} {scores['loss'][1]:>9.1e} "
                     f"{scores['grad norm'][1]:>9.1e} {worst[-32:]:>32} {err:>7.1e} {noise_col:>8}  "
                     f"{'PASS' if step_ok else 'FAIL'}")
    return ok, lines


def exact_reference(cfg: Config, dims: ParallelDims, steps: int, device: torch.device,
                    ref_steps: list[dict]) -> tuple[list[dict] | None, str]:
    """The fp32 run that calibrates bf16 bounds, or None (with why) when its first loss is not the bf16
    reference's: then it is not the same model (a random init drawn differently in fp32, say)."""
    exact = reference_run(cfg, dims, steps, device, exact=True)
    loss_err = _rel(ref_steps[0]["loss"], exact[0]["loss"])
    if loss_err > TOLERANCES["bfloat16"]["loss"]:
        return None, f"fp32 reference not used: its step-1 loss {exact[0]['loss']:.6f} is {loss_err:.1e} away"
    impls = ", ".join(f"{k}={v}" for k, v in EXACT_MODEL.items())
    return exact, (f"fp32 reference ({impls}): step-1 loss {exact[0]['loss']:.6f}; ref-fp32 = the bf16 "
                   "reference's error against it")


def main(argv: list[str] | None = None) -> int:
    """The CLI; failures end as in runtime.launch (one line from rank 0, --debug for the traceback)."""
    from runtime.distributed.process_group import env_world
    from runtime.guard.failure_report import guarded_main
    from runtime.guard.failures import RunContext
    from runtime.launch import setup_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging(env_world()[0])
    # Nothing to resume: verification writes no checkpoint.
    return guarded_main(lambda _context: verify(argv), RunContext(argv, module="runtime.verify", resumable=False))


def verify(argv: list[str]) -> int:
    """Runs the comparison; 0 when every step is within tolerance, else 1."""
    from runtime.cli import CliParser, UsageError
    from runtime.distributed.process_group import init_distributed
    from runtime.launch import prepare

    extra = CliParser(prog="python -m runtime.verify", add_help=False)
    extra.add_argument("--steps", type=int, default=3)
    extra.add_argument("--exact", action="store_true")
    known, rest = extra.parse_known_args(argv)
    if known.steps < 1:  # zero steps compare nothing and would print PASS
        raise UsageError(f"--steps {known.steps}: verification needs at least one step (command line); "
                         "pass --steps 1 or more (default 3)")
    _, cfg, dims, run_plan = prepare(rest)
    cfg = run_plan.config  # every auto resolved; --exact replaces the names by each registry's reference
    if known.exact:
        check_exact(cfg)
        cfg = exact_config(cfg)
    ieee_fp32()
    env = init_distributed(timeout_s=cfg.parallelism.collective_timeout_s)
    meshes = dims.build_meshes(env.device.type) if env.world_size > 1 else None
    with tempfile.TemporaryDirectory() as out:
        dist_steps = record_run(_verification_config(cfg, known.steps, out), env, dims, meshes,
                                autocast=not known.exact)
    ok = True
    if env.is_main:
        ref_steps = reference_run(cfg, dims, known.steps, env.device, exact=known.exact)
        dtype = "bfloat16" if env.device.type == "cuda" and not known.exact else "float32"
        exact_steps, note = (exact_reference(cfg, dims, known.steps, env.device, ref_steps) if dtype == "bfloat16"
                             else (None, ""))
        ok, lines = compare(dist_steps, ref_steps, dtype, exact_steps)
        print(f"verify: {dims} vs one process, {known.steps} steps, {dtype}, tolerances {TOLERANCES[dtype]}")
        if note:
            print(note)
        print("\n".join(lines))
        print("PASS" if ok else "FAIL")
        if not ok and dtype == "bfloat16":
            print("bf16 rounding moves near-tie routing choices between runs: `--exact` runs both sides in fp32 on the "
                  "plain kernels and checks the parallelism alone at fp32 bounds")
            if cfg.parallelism.fsdp_param_dtype == "bf16" and dims.dp_shard * dims.cp > 1:
                print("FSDP gathered the parameters in bf16 (parallelism.fsdp_param_dtype: bf16), rounding norms, router, "
                      "embedding and GDN decay parameters the one-process reference computes in fp32: "
                      "--set parallelism.fsdp_param_dtype=fp32 verifies at one GPU's precision")
    if env.world_size > 1:
        flag = torch.tensor([int(ok)], device=env.device)
        dist.broadcast(flag, 0)
        ok = bool(flag.item())
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
