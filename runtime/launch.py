"""CLI entry: `python -m runtime.launch [--ep N] [--cp N] [--dp-shard N] [--dp-replicate N]
[--max-steps N] [--output-dir D] [--resume] [--set KEY=VALUE ...] cfg.yaml`, under torchrun or as a
plain process.

Flags override the YAML; `--set` overrides any key. Config and mesh errors are raised before any process
group exists; any error ends every rank with one message from rank 0 and a non-zero exit (torchrun then
stops the rest), never a hang or a stack of identical tracebacks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

import yaml

from runtime.config import ConfigError, load_config
from runtime.dist import env_world
from runtime.mesh import MeshError, ParallelDims

log = logging.getLogger("runtime")

# Errors whose message is the whole story: no traceback for these.
USER_ERRORS = (ConfigError, MeshError, FileNotFoundError)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.launch", description=__doc__.split("\n")[0])
    p.add_argument("config", help="YAML config file")
    p.add_argument("--ep", type=int, help="expert-parallel size (parallelism.ep)")
    p.add_argument("--cp", type=int, help="context-parallel size (parallelism.cp)")
    p.add_argument("--dp-shard", type=int, help="FSDP size (parallelism.dp_shard; -1 fills the world)")
    p.add_argument("--dp-replicate", type=int, help="HSDP replicas (parallelism.dp_replicate)")
    p.add_argument("--max-steps", type=int, help="optimizer steps (train.max_steps)")
    p.add_argument("--output-dir", help="run folder for logs and checkpoints (train.output_dir)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the output dir")
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
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML") from None
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


def prepare(argv: list[str] | None = None):
    """Config and ParallelDims from argv; validates everything before any process group exists."""
    args = parse_args(argv)
    cfg = load_config(args.config, config_overrides(args))
    _, world, _ = env_world()
    p = cfg.parallelism
    dims = ParallelDims.resolve(p.dp_replicate, p.dp_shard, p.cp, p.ep, world)
    return args, cfg, dims


def run(argv: list[str] | None = None) -> list[dict]:
    from runtime.dist import init_distributed
    from runtime.train import train

    args, cfg, dims = prepare(argv)
    env = init_distributed()
    meshes = dims.build_meshes(env.device.type) if env.world_size > 1 else None
    return train(cfg, env, dims, meshes, resume=args.resume)


def report_failure(err: BaseException, rank: int) -> None:
    """One message from rank 0; other ranks stay quiet unless the error is theirs alone."""
    if rank != 0:
        print(f"[rank {rank}] {type(err).__name__}: {err}", file=sys.stderr)
        return
    if isinstance(err, USER_ERRORS):
        print(f"error: {err}", file=sys.stderr)
    else:
        traceback.print_exc()
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    rank = env_world()[0]
    setup_logging(rank)
    try:
        run(argv)
    except (Exception, KeyboardInterrupt) as err:
        report_failure(err, rank)
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip the process-group teardown: a peer stuck in a collective would make it hang; torchrun
        # sees the exit and stops the other ranks.
        os._exit(1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
