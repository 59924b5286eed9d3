"""The run folder (`train.output_dir`) as one run's property: claimed at start, never shared.

Contract of `claim_run_dir(output_dir, resume, rank)`, called on every rank before any model or
data work:
- a folder that already holds checkpoints is only entered with `--resume` (or checkpoint.resume);
  otherwise every rank raises RunDirError alike, naming the folder and the two choices;
- rank 0 holds an exclusive lock (`<output_dir>/.lock`, flock) for the process lifetime, so a second
  concurrent run on the same folder fails at start; the kernel drops the lock when the process dies
  (kill -9 included), so no stale lock survives a crash;
- the run id lives in `<output_dir>/run.json`: a fresh run writes a new one, a resumed run keeps it.
  Checkpoints and metrics records carry it, and pruning only touches checkpoints of this run id;
- `write_run_config` (rank 0) writes the resolved config to `<output_dir>/config.yaml` atomically, so a
  run folder says how it was made (runtime.export rebuilds the model from it); `read_run_config` reads it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = ".lock"
RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"  # the run's resolved config (flags and --set applied, paths absolute)
CHECKPOINTS = "checkpoints"
STEP_DIR = re.compile(r"^step_(\d{8})$")  # a finished checkpoint; a save in progress is .tmp-step_*


class RunDirError(RuntimeError):
    """The output dir cannot be used by this run; the message names it and the fix."""


@dataclass
class RunDir:
    root: Path
    run_id: str  # rank 0's business (it prunes, writes checkpoint metadata and metrics); "" elsewhere
    lock_fd: int | None  # rank 0 keeps the locked file open for the whole run

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS


def finished_checkpoints(output_dir: str | Path) -> list[Path]:
    """<output_dir>/checkpoints/step_XXXXXXXX folders, oldest first (torn .tmp saves excluded)."""
    folder = Path(output_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and STEP_DIR.match(p.name))


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _take_lock(root: Path) -> int:
    path = root / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown process"
        os.close(fd)
        raise RunDirError(f"output dir {root} is in use by another run ({holder}, lock file {path}); wait for it "
                          "to finish or set a new train.output_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())
    return fd


def _run_id(root: Path, resume: bool) -> str:
    run_file = root / RUN_FILE
    if resume and run_file.is_file():
        return json.loads(run_file.read_text())["run_id"]
    return uuid.uuid4().hex[:12]


def refuse_foreign_checkpoints(root: Path, resume: bool) -> None:
    found = finished_checkpoints(root)
    if found and not resume:
        raise RunDirError(f"output dir {root} already holds checkpoints (newest: {found[-1].name}) of an earlier "
                          "run; continue that run with --resume, or start a new one with a new train.output_dir")


def claim_run_dir(output_dir: str | Path, resume: bool, rank: int) -> RunDir:
    """Checks and claims the run folder (see the module docstring). Every rank raises alike on a folder
    with foreign checkpoints; only rank 0 can fail on the lock (the caller makes that failure common)."""
    root = Path(output_dir)
    refuse_foreign_checkpoints(root, resume)
    if rank != 0:
        return RunDir(root, "", None)
    root.mkdir(parents=True, exist_ok=True)
    fd = _take_lock(root)
    run_id = _run_id(root, resume)
    if not (root / RUN_FILE).is_file() or not resume:
        write_json_atomic(root / RUN_FILE, {"run_id": run_id, "created": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return RunDir(root, run_id, fd)


def release_run_dir(run_dir: RunDir) -> None:
    if run_dir.lock_fd is not None:
        os.close(run_dir.lock_fd)  # closing the descriptor drops the flock
        run_dir.lock_fd = None


def write_run_config(root: str | Path, config: dict) -> Path:
    """The resolved config as YAML, written atomically (a resumed run rewrites it with its own flags)."""
    import yaml

    path = Path(root) / CONFIG_FILE
    tmp = path.with_name(f".{CONFIG_FILE}.tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    os.replace(tmp, path)
    return path


def read_run_config(root: str | Path) -> dict:
    """The config dict a run wrote; RunDirError naming the folder when it has none."""
    import yaml

    path = Path(root) / CONFIG_FILE
    if not path.is_file():
        raise RunDirError(f"{root} holds no {CONFIG_FILE}: not a run folder of this runtime (train.output_dir)")
    return yaml.safe_load(path.read_text())
