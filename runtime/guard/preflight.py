"""Checks that need only the config and the file system, run before any process group, model or data
exists, so that a run that cannot finish fails before step 1 and not at its first checkpoint.

Contract of `preflight(cfg, rank)`, called by runtime.launch on every rank after the config is loaded:
- raises PreflightError, one line `<what> (<key> = <path>: <reason>); <fix>`, when train.output_dir or
  its checkpoints folder cannot be created or written (probed by writing and removing a small file; the
  folders are left in place, the run would create them anyway), or when data.path, data.eval, the
  tokenizer folder or model.path does not exist or cannot be read, or a requested tracker's folder
  (<output_dir>/tensorboard, <output_dir>/wandb) cannot be written; raises ConfigError when a tracker
  (logging.tensorboard / wandb) is asked for and its package is absent. Every rank checks its own view of the file system (nodes
  may mount differently); on one node all ranks fail alike and runtime.launch prints the error once;
- on rank 0 only, logs one warning line (never an error: the estimate is rough and disks get freed) when
  the free space under the checkpoints folder is below what the run's checkpoints need at once.

The checkpoint size is estimated from the model config alone (a model built on the meta device, which
allocates nothing): trainable parameters x bytes per value x 3 (the weights and AdamW's two moments),
where a LoRA run saves only its adapter and a full fine-tune every parameter.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from runtime.config import Config
from runtime.guard.run_dir import CHECKPOINTS
from runtime.observe.trackers import check_trackers, tracker_dirs

log = logging.getLogger("runtime")

OUTPUT_FIX = "set train.output_dir (or --output-dir) to a folder this user can write"


class PreflightError(ValueError):
    """A run that cannot work, found before anything ran; the message names the key, the path and the fix."""


def preflight(cfg: Config, rank: int) -> None:
    """See the module docstring."""
    if cfg.model.path:
        check_input(cfg.model.path, "model.path", "a HF checkpoint folder (config.json + *.safetensors)")
    if cfg.data.tokenizer:  # else the tokenizer is model.path's, checked above
        check_input(cfg.data.tokenizer, "data.tokenizer", "a tokenizer folder (tokenizer.json, tokenizer_config.json)")
    check_input(cfg.data.path, "data.path", "a JSONL/Parquet file, a folder of them, or a datasets.save_to_disk folder")
    if cfg.data.eval:
        check_input(cfg.data.eval, "data.eval", "a held-out JSONL/Parquet file or folder, like data.path")
    check_trackers(cfg)
    output = Path(cfg.train.output_dir)
    check_writable_dir(output, "train.output_dir")
    for key, folder in tracker_dirs(cfg).items():
        check_writable_dir(folder, f"the {key} folder under train.output_dir")
    if writes_checkpoints(cfg):
        check_writable_dir(output / CHECKPOINTS, "the checkpoint folder under train.output_dir")
        if rank == 0:
            warn_if_disk_short(cfg, output / CHECKPOINTS)


def check_input(path: str, key: str, expected: str) -> None:
    """Raises PreflightError unless `path` exists and this user can read it (and list it, for a folder)."""
    p = Path(path)
    if not p.exists():
        raise PreflightError(f"{key} does not exist ({p}); set it to {expected}")
    mode = os.R_OK | (os.X_OK if p.is_dir() else 0)
    if not os.access(p, mode):
        raise PreflightError(f"{key} is not readable ({p}: permission denied); give this user read access to it "
                             "or point the config at a copy it can read")


def check_writable_dir(path: Path, key: str) -> None:
    """Creates `path` (with parents) and writes, then removes, a probe file in it; PreflightError otherwise.
    The probe's name carries host and pid: every rank probes, possibly in the same shared folder."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        if path.is_file():
            raise PreflightError(f"{key} cannot be created ({path}: a file is in the way); move that file away or "
                                 f"{OUTPUT_FIX}") from None
        raise PreflightError(f"{key} cannot be created ({path}: {_reason(err)}); {OUTPUT_FIX}") from None
    probe = path / f".preflight-{socket.gethostname()}-{os.getpid()}"
    try:
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as err:
        raise PreflightError(f"{key} is not writable ({path}: {_reason(err)}); {OUTPUT_FIX}") from None


def _reason(err: OSError) -> str:
    return err.strerror or type(err).__name__


def writes_checkpoints(cfg: Config) -> bool:
    return bool(cfg.checkpoint.every_n_steps or cfg.checkpoint.save_final)


@dataclass(frozen=True)
class CheckpointEstimate:
    bytes_each: int  # one checkpoint: trainable values x bytes x 3
    copies: int  # checkpoints on disk at once
    how: str  # the arithmetic, for the warning line

    @property
    def total(self) -> int:
        return self.bytes_each * self.copies


def estimate_checkpoints(cfg: Config) -> CheckpointEstimate:
    """The disk the run's checkpoints need at once (see the module docstring)."""
    trainable = trainable_parameters(cfg)
    # Trainable parameters are fp32 master copies on CUDA (runtime.models.factory.build_model); on the CPU they
    # keep model.dtype. AdamW's moments take the parameters' dtype.
    import torch

    nbytes = 4 if cfg.model.dtype == "float32" or torch.cuda.is_available() else 2
    what = "LoRA adapter values" if cfg.lora.enabled else "parameters"
    return CheckpointEstimate(trainable * nbytes * 3, checkpoints_at_once(cfg),
                              f"{trainable:,} {what} x {nbytes} B x 3 for the weights and AdamW moments")


def trainable_parameters(cfg: Config) -> int:
    """Values a checkpoint saves: every parameter, or only the LoRA factors (the frozen base comes from
    model.path on resume). Counted on a meta-device model, which allocates no memory."""
    from runtime.models.factory import meta_model

    model = meta_model(cfg)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def checkpoints_at_once(cfg: Config) -> int:
    """keep_last kept plus the one being written before the oldest is pruned, but no more than the run
    saves at all (every_n_steps saves before max_steps, then the final one)."""
    c, max_steps = cfg.checkpoint, cfg.train.max_steps
    saves = ((max_steps - 1) // c.every_n_steps if c.every_n_steps else 0) + int(c.save_final)
    return max(1, min(c.keep_last + 1, saves))


def warn_if_disk_short(cfg: Config, folder: Path) -> None:
    """One warning line when the free space under `folder` is below estimate_checkpoints(cfg).total."""
    try:
        need = estimate_checkpoints(cfg)
    except Exception as err:  # noqa: BLE001  (advisory: a failed estimate must not stop a run the real checks pass)
        log.warning("could not estimate the checkpoint size (%s: %s); free disk space was not checked",
                    type(err).__name__, err)
        return
    free = shutil.disk_usage(folder).free
    if free < need.total:
        log.warning("low disk space for checkpoints (%s: %s free, ~%s needed for %d checkpoint(s) of ~%s: %s); "
                    "free space, lower checkpoint.keep_last, or set train.output_dir to a larger disk",
                    folder, _gib(free), _gib(need.total), need.copies, _gib(need.bytes_each), need.how)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"
