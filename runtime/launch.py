"""CLI entry: `python -m runtime.launch [--ep N] [--cp N] [--dp-shard N] [--dp-replicate N]
[--max-steps N] [--output-dir D] [--resume] [--debug] [--set KEY=VALUE ...] cfg.yaml`, under torchrun or
as a plain process.

Flags override the YAML; `--set` overrides any key. Config and mesh errors, and every choice this machine
cannot run (runtime.plan), are raised before any process group exists, then runtime.guard.preflight checks the file
system (output dir writable, inputs readable, disk).
`--estimate [--world-size N]` prints the memory one rank would hold (runtime.estimate) and exits there,
before any weight, process group or preflight.
A failure ends as runtime.guard.failure_report says: one `error:` line from rank 0, exit code != 0.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch.distributed as dist
import yaml

from runtime.cli import CliParser
from runtime.config import ConfigError, load_config
from runtime.distributed.process_group import env_world
from runtime.guard.failures import RunContext
from runtime.plan import plan

log = logging.getLogger("runtime")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = CliParser(prog="python -m runtime.launch", description=__doc__.split("\n")[0])
    p.add_argument("config", help="YAML config file")
    p.add_argument("--ep", type=int, help="expert-parallel size (parallelism.ep)")
    p.add_argument("--cp", type=int, help="context-parallel size (parallelism.cp)")
    p.add_argument("--dp-shard", type=int, help="FSDP size (parallelism.dp_shard; -1 fills the world)")
    p.add_argument("--dp-replicate", type=int, help="HSDP replicas (parallelism.dp_replicate)")
    p.add_argument("--max-steps", type=int, help="optimizer steps (train.max_steps)")
    p.add_argument("--output-dir", help="run folder for logs and checkpoints (train.output_dir)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the output dir")
    p.add_argument("--debug", action="store_true", help="print the traceback of user errors too (or RUNTIME_DEBUG=1)")
    p.add_argument("--estimate", action="store_true",
                   help="print the memory one rank needs (parameters, gradients, optimizer, activations, the largest "
                        "temporaries) and exit, before any weight or process group (runtime/estimate.py)")
    p.add_argument("--world-size", type=int,
                   help="with --estimate: the number of ranks the run will have (default: WORLD_SIZE, else 1)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                   help="override any config key, e.g. --set model.expert_backend=scattermoe --set lora.rank=32 "
                        "(VALUE is read as YAML; repeatable; applied after the flags above)")
    return p.parse_args(argv)


def parse_sets(sets: list[str]) -> dict:
    """["a.b=1", ...] -> {"a.b": 1, ...}, each value read as YAML (numbers, bools, lists, strings)."""
    out = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted config key, e.g. "
                              "--set model.expert_backend=scattermoe")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML") from None
        if parsed is None:  # an override of None means "not given": the key would keep its YAML value unnoticed
            raise ConfigError(f"--set {item!r}: no value for {key.strip()}; give one (--set {key.strip()}=VALUE) "
                              "or leave the flag out to keep the config's value")
        out[key.strip()] = parsed
    return out


def config_overrides(args: argparse.Namespace) -> dict:
    flags = {"parallelism.ep": args.ep, "parallelism.cp": args.cp, "parallelism.dp_shard": args.dp_shard,
             "parallelism.dp_replicate": args.dp_replicate, "train.max_steps": args.max_steps,
             "train.output_dir": args.output_dir}
    return {**flags, **parse_sets(args.sets)}


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.ERROR
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def prepare(argv: list[str] | None = None, device=None):
    """(args, the config as written, ParallelDims, runtime.plan's Plan) from argv: every key validated, every
    `auto` resolved and every combination checked before any process group exists. `device`: the device type
    the run will use (None: this machine's)."""
    args = parse_args(argv)
    cfg = load_config(args.config, config_overrides(args))
    _, world, _ = env_world()
    run_plan = plan(cfg, args.world_size or world, device)
    return args, cfg, run_plan.dims, run_plan


def run(argv: list[str] | None = None, context: RunContext | None = None) -> list[dict]:
    from runtime.distributed.process_group import init_distributed
    from runtime.guard.preflight import preflight
    from runtime.train import train

    context = context or RunContext()
    estimating = "--estimate" in (argv if argv is not None else sys.argv[1:])
    # an estimate is for the GPU run (bf16 autocast), wherever it is asked
    args, cfg, dims, run_plan = prepare(argv, "cuda" if estimating else None)
    if args.estimate:
        from runtime.estimate import report

        print(report(run_plan.config, dims))
        return []
    context.output_dir = cfg.train.output_dir
    preflight(run_plan.config, env_world()[0])
    env = init_distributed(timeout_s=cfg.parallelism.collective_timeout_s)
    meshes = dims.build_meshes(env.device.type) if env.world_size > 1 else None
    return train(cfg, env, dims, meshes, resume=args.resume, progress=context.progress, plan=run_plan)


def main(argv: list[str] | None = None) -> int:
    from runtime.guard.failure_report import guarded_main

    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging(env_world()[0])

    def body(context: RunContext) -> int:
        run(argv, context)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 0

    return guarded_main(body, RunContext(argv))


if __name__ == "__main__":
    # The imported module's main, not this __main__ copy's: its classes (UsageError) are the ones that
    # USER_ERRORS names and that runtime.verify raises.
    from runtime.launch import main as _main

    sys.exit(_main())
