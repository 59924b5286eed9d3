"""Experiment trackers on rank 0: TensorBoard event files and Weights & Biases runs.

    check_trackers(cfg)                        # every rank, before any collective: the packages are there
    tracker_dirs(cfg)                          # {config key: folder it writes}: runtime.guard.preflight checks them
    trackers = Trackers.start(cfg, run_id, mesh, enabled=rank == 0)
    trackers.log(record)                       # a metrics record (runtime.observe.metrics): its numbers, at its step
    trackers.close()

`logging.tensorboard: true` writes <output_dir>/tensorboard (torch.utils.tensorboard's writer);
`logging.wandb: {project, name, mode}` logs to a W&B run in <output_dir> (mode offline needs no network;
the run id is the runtime's, so a resumed run continues its W&B run). Both receive the resolved config and
the mesh once at the start; training numbers go under train/, eval numbers under eval/.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from runtime.config import Config, ConfigError

_TRAIN_KEYS = ("loss", "lr", "grad_norm", "tok_s", "step_s", "mfu", "peak_mem_gib", "ep_imbalance",
               "ep_host_skew_s")
_EVAL_KEYS = ("eval_loss", "eval_tokens")
_INSTALL = "pip install 'moe-runtime[trackers]'"


def check_trackers(cfg: Config) -> None:
    """ConfigError naming the key and the install command when a requested tracker's package is absent."""
    wanted = {"logging.tensorboard": "tensorboard"} if cfg.logging.tensorboard else {}
    if cfg.logging.wandb is not None and cfg.logging.wandb.mode != "disabled":
        wanted["logging.wandb"] = "wandb"
    for key, package in wanted.items():
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"{key} needs the {package} package, which is not installed: {_INSTALL}, or unset "
                              f"{key}")


def tracker_dirs(cfg: Config) -> dict[str, Path]:
    """The folders the requested trackers write, by the config key that asks for them (preflight checks them)."""
    out = Path(cfg.train.output_dir)
    dirs = {"logging.tensorboard": out / "tensorboard"} if cfg.logging.tensorboard else {}
    if cfg.logging.wandb is not None and cfg.logging.wandb.mode != "disabled":
        dirs["logging.wandb"] = out / "wandb"  # wandb.init(dir=output_dir) writes its run there
    return dirs


def _numbers(record: dict, keys: tuple[str, ...]) -> dict[str, float]:
    return {k: record[k] for k in keys if isinstance(record.get(k), int | float) and math.isfinite(record[k])}


class Trackers:
    def __init__(self, tensorboard=None, wandb_run=None):
        self.tensorboard, self.wandb_run = tensorboard, wandb_run

    @classmethod
    def start(cls, cfg: Config, run_id: str, mesh: dict, enabled: bool) -> Trackers:
        if not enabled:
            return cls()
        trackers = cls(_tensorboard(cfg, mesh), _wandb(cfg, run_id, mesh))
        return trackers

    def log(self, record: dict) -> None:
        step = record["step"]
        values = {f"train/{k}": v for k, v in _numbers(record, _TRAIN_KEYS).items()}
        values.update({f"eval/{k.removeprefix('eval_')}": v for k, v in _numbers(record, _EVAL_KEYS).items()})
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb_run is not None and values:
            self.wandb_run.log(values, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _tensorboard(cfg: Config, mesh: dict):
    if not cfg.logging.tensorboard:
        return None
    import yaml
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tracker_dirs(cfg)["logging.tensorboard"]))
    # fenced, so TensorBoard's markdown keeps the YAML's layout
    writer.add_text("config", "```\n" + yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False) + "```", 0)
    writer.add_text("mesh", "```\n" + yaml.safe_dump(mesh, sort_keys=False) + "```", 0)
    return writer


def _wandb(cfg: Config, run_id: str, mesh: dict):
    w = cfg.logging.wandb
    if w is None or w.mode == "disabled":
        return None
    import wandb

    return wandb.init(project=w.project, name=w.name, mode=w.mode, dir=cfg.train.output_dir, id=run_id or None,
                      resume="allow", config={"config": cfg.model_dump(mode="json"), "mesh": mesh})
