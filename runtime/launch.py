"""CLI entry: `python -m runtime.launch [--ep N] [--cp N] [--dp-shard N] [--dp-replicate N]
[--max-steps N] [--output-dir D] [--resume] [--debug] [--set KEY=VALUE ...] cfg.yaml`, under torchrun or
as a plain process.

Flags override the YAML; `--set` overrides any key. Config and mesh errors are raised before any process
group exists, then runtime.preflight checks the file system (output dir writable, inputs readable, disk).

How a run ends when it fails (`guarded_main`, shared with runtime.verify):
- a user error (config, data, checkpoint, resume, divergence, permissions, full disk, a corrupted DCP
  checkpoint, a command-line typo) prints one line `error: <what> (<file/key/step>); <fix>` and exits 1;
  `--debug` or RUNTIME_DEBUG=1 prints the traceback above it;
- any other exception is a bug: its traceback, then one `error: internal error (...)` line, exit 70;
- Ctrl-C or SIGTERM (torchrun stopping its workers, SLURM preemption) prints `interrupted at step N; the
  last checkpoint is <dir>; continue with: <the same command> --resume` and exits 128 + the signal.
Each failure is printed once, by rank 0; another rank prints only what is its alone (PeerBoard says how
rank 0 learns about it). The process then ends with os._exit: a teardown that waits on a peer stuck in a
collective would hang, and torchrun stops the other ranks once one has exited.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import pickle
import re
import shlex
import shutil
import signal
import sys
import threading
import time
import traceback
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import yaml

from runtime.config import ConfigError, load_config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import env_world

log = logging.getLogger("runtime")

EXIT_USER_ERROR = 1
EXIT_INTERNAL_ERROR = 70  # EX_SOFTWARE of sysexits.h: a bug
# Errors whose message is the whole story (what, where, the fix): no traceback unless --debug. Matched by
# qualified class name through the MRO, so this module knows them without importing the model stack, and
# a subclass counts too.
USER_ERRORS = frozenset({
    "runtime.config.ConfigError", "runtime.distributed.mesh.MeshError", "runtime.data.DataError",
    "runtime.models.hf.CheckpointError", "runtime.checkpoint.ResumeError", "runtime.train.TrainingDiverged",
    "runtime.run_dir.RunDirError", "runtime.preflight.PreflightError", "runtime.lora.LoRAFormatError",
    "runtime.launch.UsageError",
})
# Raised from the command line, the YAML and the world size alone, before any rank could differ.
ALIKE_ON_EVERY_RANK = frozenset({
    "runtime.config.ConfigError", "runtime.distributed.mesh.MeshError", "runtime.launch.UsageError"})


class UsageError(ValueError):
    """A command-line mistake: an unknown flag, a missing config path, a value of the wrong type."""


class CliParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing the usage and exiting, so a typo in a torchrun
    command is reported once, by rank 0, like every other user error."""

    def error(self, message: str):
        raise UsageError(f"{message} (command line); see {self.prog} --help")


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


@dataclass
class RunContext:
    """What a failure report needs to know about the run: filled in as the run gets that far."""

    argv: list[str] = field(default_factory=list)  # this entry point's arguments, for the command to run again
    module: str = "runtime.launch"
    resumable: bool = True  # the run writes checkpoints, so an interrupt can say where to resume
    output_dir: str | None = None  # known once the config is loaded


def run(argv: list[str] | None = None, context: RunContext | None = None) -> list[dict]:
    from runtime.distributed.process_group import init_distributed
    from runtime.preflight import preflight
    from runtime.train import train

    args, cfg, dims = prepare(argv)
    if context is not None:
        context.output_dir = cfg.train.output_dir
    preflight(cfg, env_world()[0])
    env = init_distributed(timeout_s=cfg.parallelism.collective_timeout_s)
    meshes = dims.build_meshes(env.device.type) if env.world_size > 1 else None
    return train(cfg, env, dims, meshes, resume=args.resume)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body(context: RunContext) -> int:
        run(argv, context)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 0

    return guarded_main(body, RunContext(argv))


# ---------------------------------------------------------------------------------------------------
# Failure reporting. describe() turns an exception into a Failure (pure, testable in process);
# PeerBoard lets rank 0 speak for every rank; guarded_main ties them together.


class Interrupted(KeyboardInterrupt):
    """SIGTERM raised like Ctrl-C's KeyboardInterrupt, so both end through the same report (and, being no
    Exception, neither is swallowed by an `except Exception` on the way up)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, _frame):
    raise Interrupted(signum)


@dataclass
class Failure:
    kind: str  # "user" | "internal" | "interrupt"
    line: str  # the one line printed; "error: ..." or "interrupted ..."
    detail: str = ""  # the traceback: printed above the line for internal errors, and for all with --debug
    exit_code: int = EXIT_USER_ERROR
    alike: bool = False  # raised alike on every rank by construction (same YAML, same world size)


def describe(err: BaseException, context: RunContext) -> Failure:
    """The report of `err` (see the module docstring). Reads the traceback's frames for what the exception
    does not carry: the step (runtime/train.py's loop variable) and the checkpoint folder being read or
    written (torch.distributed.checkpoint's `checkpoint_id`, runtime/checkpoint.py's `path`/`tmp`)."""
    detail = "".join(traceback.format_exception(err))
    signum = _interrupt_signal(err)
    if signum is not None:
        return Failure("interrupt", interrupt_line(err, context, signum), detail, 128 + signum)
    line = user_error_line(err, context)
    if line is not None:
        return Failure("user", line, detail, alike=bool(_qualnames(err) & ALIKE_ON_EVERY_RANK))
    return Failure("internal", internal_error_line(err), detail, EXIT_INTERNAL_ERROR)


def _describe_safely(err: BaseException, context: RunContext) -> Failure:
    """describe(), or the plain exception with its traceback should describing it fail: a bug in the
    report must not hide the failure it reports."""
    try:
        return describe(err, context)
    except Exception as bug:  # noqa: BLE001  (any bug of describe: fall back, the report goes on)
        detail = "".join(traceback.format_exception(err))
        return Failure("internal", f"error: {type(err).__name__}: {err} (describing it failed: {bug!r})", detail,
                       EXIT_INTERNAL_ERROR)


def _qualnames(err: BaseException) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(err).__mro__}


def _checkpoint_failures(err: BaseException) -> list[tuple[int, BaseException]] | None:
    """torch.distributed.checkpoint's CheckpointException (a BaseException: it escapes `except Exception`)
    carries every rank's exception, gathered, so each rank holds the same list: [(rank, exception)]."""
    failures = getattr(err, "failures", None)
    if "torch.distributed.checkpoint.api.CheckpointException" not in _qualnames(err) or not isinstance(failures, dict):
        return None
    return sorted((rank, pair[0] if isinstance(pair, tuple) else pair) for rank, pair in failures.items())


def _interrupt_signal(err: BaseException) -> int | None:
    failures = _checkpoint_failures(err)
    inner = [e for _, e in failures] if failures else [err]
    for e in inner:
        if isinstance(e, KeyboardInterrupt):
            return getattr(e, "signum", signal.SIGINT)
    return None


def _frames(err: BaseException) -> list:
    """The traceback's frames, innermost first."""
    return [frame for frame, _ in traceback.walk_tb(err.__traceback__)][::-1]


def _in_file(frame, suffix: str) -> bool:
    return frame.f_code.co_filename.replace(os.sep, "/").endswith(suffix)


def _training_step(err: BaseException) -> tuple[str, int] | None:
    """("at", step) inside runtime/train.py's step loop, ("before", start + 1) before it, or None. Outermost
    frame first: the loop's own `step`, not a helper's argument of the same name (lr_factor's counts from 0)."""
    for frame in reversed(_frames(err)):
        if _in_file(frame, "runtime/train.py"):
            step, start = frame.f_locals.get("step"), frame.f_locals.get("start")
            if isinstance(step, int):
                return "at", step
            if isinstance(start, int):
                return "before", start + 1
    return None


def _checkpoint_call(err: BaseException) -> tuple[str, Path] | None:
    """("load" | "save", folder) of the checkpoint being read or written when `err` was raised, or None."""
    for frame in _frames(err):
        code, local = frame.f_code, frame.f_locals
        path = code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/checkpoint/" in path and code.co_name in ("load", "save", "async_save"):
            if local.get("checkpoint_id"):
                return code.co_name.removeprefix("async_"), Path(local["checkpoint_id"])
        elif path.endswith("runtime/checkpoint.py"):
            if code.co_name == "save" and local.get("tmp"):
                return "save", Path(local["tmp"])
            if code.co_name in ("load", "check_compatible", "check_sizes") and local.get("path"):
                return "load", Path(local["path"])
    return None


# errno -> (what happened, the fix); {or_key} names train.output_dir when the path lies under it.
_OS_ERRORS = {
    errno.EACCES: ("permission denied", "give this user access to it{or_key}"),
    errno.EPERM: ("operation not permitted", "give this user access to it{or_key}"),
    errno.EROFS: ("read-only file system", "point the run at a writable disk{or_key}"),
    errno.ENOSPC: ("no space left on device",
                   "free space there{or_key} (checkpoint.keep_last bounds the checkpoints kept)"),
    errno.EDQUOT: ("disk quota exceeded", "free space there{or_key}"),
    errno.ENOENT: ("no such file or directory", "check the path in the config"),
    errno.ENOTDIR: ("not a directory", "a part of the path is a file: check the path in the config"),
    errno.EISDIR: ("is a directory", "check the path in the config"),
}
# Data that cannot be decoded: what a torn or overwritten checkpoint file raises when read.
_CORRUPT_DATA = (EOFError, pickle.UnpicklingError, json.JSONDecodeError, zipfile.BadZipFile, UnicodeDecodeError)


def user_error_line(err: BaseException, context: RunContext) -> str | None:
    """`error: ...` for an error the user can fix, None for a bug."""
    from runtime.distributed.process_group import collective_error_message

    if _qualnames(err) & USER_ERRORS:
        return f"error: {err}"
    if message := collective_error_message(err):
        return f"error: {message}"
    ckpt = _checkpoint_call(err)
    failures = _checkpoint_failures(err)
    causes = [e for _, e in failures] if failures else [err]
    if all(isinstance(e, OSError) and e.errno in _OS_ERRORS for e in causes):
        return os_error_line(causes[0], ckpt[1] if ckpt else None, err, context)
    corrupt = all(isinstance(e, _CORRUPT_DATA) or _is_torn_zip(e) for e in causes)
    if ckpt and ckpt[0] == "save":
        if all(_is_write_failure(e) for e in causes):
            return write_failure_line(ckpt[1], causes[0], err)
        return None  # anything else going wrong in a save is ours
    if (ckpt and (failures or corrupt)) or (failures and corrupt):
        return unreadable_checkpoint_line(ckpt[1] if ckpt else None, failures or [(0, err)])
    return None


def os_error_line(err: OSError, fallback: Path | None, top: BaseException, context: RunContext) -> str:
    what, fix = _OS_ERRORS[err.errno]
    path = err.filename or fallback
    where = f"{path} -> {err.filename2}" if path and err.filename2 else str(path or "path not reported")
    under_output = context.output_dir and path and _is_under(Path(path), Path(context.output_dir))
    or_key = " or set train.output_dir to another folder" if under_output or path is None else ""
    return f"error: {what} ({where}{_step_note(top)}); {fix.format(or_key=or_key)}"


def write_failure_line(folder: Path, cause: BaseException, top: BaseException) -> str:
    """A checkpoint write that failed in torch.save (whose zip writer reports a full disk without an errno,
    e.g. "unexpected pos 704 vs 598"): the free space left says whether the disk is the cause."""
    try:
        free = shutil.disk_usage(_existing_parent(folder)).free
    except OSError:
        free = None
    if free is not None and free < 64 * 2**20:
        fix = (f"the disk holding it has {free / 2**20:.1f} MiB free: free space there or set train.output_dir "
               "to a larger disk (checkpoint.keep_last bounds the checkpoints kept)")
    else:
        fix = "check the disk and the permissions of train.output_dir"
    return f"error: writing checkpoint {folder} failed ({_cause(cause)}{_step_note(top)}); {fix}"


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def unreadable_checkpoint_line(folder: Path | None, failures: list) -> str:
    """The one line for a checkpoint that cannot be read back, with the older checkpoint to fall back to."""
    by_cause: dict[str, set[int]] = {}
    for rank, e in failures:
        by_cause.setdefault(_cause(e), set()).add(rank)
    # With several ranks, which of them failed to read says which shard is torn.
    causes = sorted(by_cause) if env_world()[1] == 1 else [f"{_ranks_text(r)}: {c}" for c, r in sorted(by_cause.items())]
    if folder is None:  # not found in the traceback
        return (f"error: a checkpoint is unreadable ({'; '.join(causes)}); delete the newest one under "
                "<train.output_dir>/checkpoints to resume from the one before it")
    older = sorted(p.name for p in folder.parent.glob("step_*") if p.is_dir() and p.name < folder.name)
    fix = (f"delete it (or move it out of {folder.parent}) to resume from {older[-1]}" if older
           else "delete it and start over without --resume (there is no older checkpoint)")
    return f"error: checkpoint {folder} is unreadable ({'; '.join(causes)}); {fix}"


def _cause(err: BaseException) -> str:
    """One short phrase for an exception: torch's own messages for torn files run to paragraphs."""
    if isinstance(err, EOFError):
        return "EOFError: the data ends early, a truncated file"
    if isinstance(err, pickle.UnpicklingError):
        return "UnpicklingError: the data is not what was written"
    if _is_torn_zip(err):
        return "RuntimeError: a torn torch.save file (PytorchStreamReader failed reading the zip archive)"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160]}" if text else type(err).__name__


def _is_write_failure(err: BaseException) -> bool:
    # torch.save reports a failed write (ENOSPC included) as a RuntimeError from its zip writer.
    text = str(err)
    return isinstance(err, OSError) or (isinstance(err, RuntimeError) and (
        "file write failed" in text or "inline_container" in text or "PytorchStreamWriter" in text))


def _is_torn_zip(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and "PytorchStreamReader failed" in str(err)


def _is_under(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except (ValueError, OSError):
        return False


def _step_note(err: BaseException) -> str:
    step = _training_step(err)
    return f", {step[0]} step {step[1]}" if step else ""


def internal_error_line(err: BaseException) -> str:
    """The summary under a bug's traceback: type, message's first line, and where it was raised."""
    text = str(err).strip().splitlines()
    message = f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__
    frames = traceback.extract_tb(err.__traceback__)
    where = f", at {_short_path(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    return f"error: internal error ({message}{where}); this is a bug: please report it with the traceback above"


def _short_path(filename: str) -> str:
    parts = Path(filename).parts
    for root in ("runtime", "moe", "attention", "quant", "gpu", "torch", "transformers"):
        if root in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(root):])
    return filename


def interrupt_line(err: BaseException, context: RunContext, signum: int) -> str:
    """`interrupted at step N (SIGINT); the last checkpoint is <dir>; continue with: <command> --resume`."""
    step = _training_step(err)
    head = f"interrupted {step[0]} step {step[1]}" if step else "interrupted before training started"
    head += f" ({signal.Signals(signum).name})"
    if not context.resumable or context.output_dir is None:
        return head
    latest = latest_checkpoint(Path(context.output_dir))
    if latest is None:
        return (f"{head}; no checkpoint was saved yet in {context.output_dir}, so there is nothing to resume; "
                f"start over with: {rerun_command(context, resume=False)}")
    return f"{head}; the last checkpoint is {latest}; continue with: {rerun_command(context, resume=True)}"


_STEP_DIR = re.compile(r"^step_\d{8}$")  # as runtime/checkpoint.py names its finished checkpoints


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest finished checkpoint folder, <output_dir>/checkpoints/step_XXXXXXXX, or None."""
    folder = output_dir / "checkpoints"
    if not folder.is_dir():
        return None
    steps = sorted(p for p in folder.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))
    return steps[-1] if steps else None


def rerun_command(context: RunContext, resume: bool) -> str:
    """The command that started this run, as the user typed it: torchrun's command line (read from the
    parent process: a torchrun worker does not get it) or `python -m <module> <args>`; with --resume."""
    args = _torchrun_command() or ["python", "-m", context.module, *context.argv]
    if resume and "--resume" not in args:
        args.append("--resume")
    if not resume:
        args = [a for a in args if a != "--resume"]
    return shlex.join(args)


def _torchrun_command() -> list[str] | None:
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return None
    for i, arg in enumerate(argv):  # `python .../bin/torchrun args`, or `torchrun args`
        if Path(arg).name in ("torchrun", "run.py") or arg == "torch.distributed.run":
            return ["torchrun", *argv[i + 1:]]
    return None


class PeerBoard:
    """How rank 0 knows what failed on the other ranks: every failing rank posts its line in a key-value
    store that outlives the ranks (torchrun's agent store; else the process group's), and rank 0 prints.

    A rank other than 0 posts, then waits for rank 0's verdict: {"seen": ranks whose posts rank 0 read,
    "covered": those it printed for}. Covered: silent. Seen but not covered (its error differs from rank
    0's and needs its own traceback): it prints its own. Not seen (rank 0 had already reported and left;
    this rank's error is the echo, e.g. a collective broken by rank 0's exit): silent. No verdict within
    VERDICT_S (rank 0 is fine, waiting in a collective for this rank): its error is its alone, it prints.
    Rank 0 waits up to GATHER_S for the others' posts, so errors that every rank raises alike (config,
    data, a corrupted checkpoint) are printed once. Callers bound every call with _bounded: a store call
    to a frozen store host never returns (runtime/watchdog.py measured it)."""

    GATHER_S = 2.0
    VERDICT_S = 5.0

    def __init__(self, store, rank: int, world: int):
        self.store, self.rank, self.world = store, rank, world

    @classmethod
    def connect(cls, rank: int, world: int) -> PeerBoard | None:
        """The board of this run, or None (a single process, or no store to share)."""
        if world <= 1:
            return None
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun hosts it in its agent
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=cls.VERDICT_S), wait_for_workers=False)
        elif dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
        else:
            return None
        # Per torchrun restart: an agent store may outlive a failed attempt, and its posts.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(dist.PrefixStore(f"runtime/failures/{attempt}/", store), rank, world)

    def post(self, failure: Failure, printed: bool = False) -> None:
        self.store.set(f"rank{self.rank}", json.dumps({"line": failure.line, "kind": failure.kind, "printed": printed}))
        if not printed:
            self.store.add("posted", 1)

    def gather(self, wait_s: float) -> dict[int, dict]:
        """Rank 0: the other ranks' posts, waiting up to wait_s for all of them."""
        deadline = time.monotonic() + wait_s
        while self.store.add("posted", 0) < self.world - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        return {r: json.loads(self.store.get(f"rank{r}")) for r in range(1, self.world)
                if self.store.check([f"rank{r}"])}

    def conclude(self, seen: set[int], covered: set[int], exit_code: int) -> None:
        self.store.set("verdict", json.dumps({"seen": sorted(seen), "covered": sorted(covered),
                                              "exit_code": exit_code}))

    def verdict(self, wait_s: float) -> dict:
        """Rank 0's verdict; TimeoutError when none comes within wait_s. Polled with check(): a timed-out
        store.wait() has c10d log two warning lines into the user's output."""
        deadline = time.monotonic() + wait_s
        while not self.store.check(["verdict"]):
            if time.monotonic() > deadline:
                raise TimeoutError("no verdict from rank 0")
            time.sleep(0.05)
        return json.loads(self.store.get("verdict"))


def _bounded(fn: Callable, seconds: float, default=None):
    """fn() run in a daemon thread; `default` when it raises or has not returned within `seconds`. For
    every store call of a report: a report must end, and must never hide the failure it reports."""
    result = [default]

    def target():
        with contextlib.suppress(Exception):  # any failure of the exchange: fall back to `default`
            result[0] = fn()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    return default if thread.is_alive() else result[0]


def _write(failure: Failure, debug: bool, prefix: str = "") -> None:
    if failure.detail and (failure.kind == "internal" or debug):
        sys.stderr.write(failure.detail)
    sys.stderr.write(prefix + failure.line + "\n")


def report_as_rank0(failure: Failure, board: PeerBoard | None, debug: bool) -> int:
    """Prints this run's failure once: rank 0's own, and the other ranks' lines that differ from it. Rank 0's
    internal error or interrupt that follows a peer's user error is that error's echo (a collective broken
    by the peer's exit, torchrun's SIGTERM): then the peer's line is the story. Returns the exit code."""
    posts = {}
    if board is not None:
        wait = 0.0 if failure.kind == "interrupt" else board.GATHER_S  # peers get the same signal: no posts
        posts = _bounded(lambda: board.gather(wait), wait + 2.0, default={})
    echo = failure.kind != "user" and any(p["kind"] == "user" for p in posts.values())
    if echo:
        if debug:
            sys.stderr.write(failure.detail)
    else:
        _write(failure, debug)
    covered = set()
    for line, ranks in _group_by_line(posts).items():
        if line == failure.line and not echo:
            covered |= ranks
            continue
        unprinted = {r for r in ranks if not posts[r]["printed"]}
        if unprinted and posts[min(unprinted)]["kind"] == "user" and not debug:
            sys.stderr.write(f"[{_ranks_text(unprinted)}] {line}\n")
            covered |= unprinted
    exit_code = EXIT_USER_ERROR if echo else failure.exit_code
    if board is not None:
        _bounded(lambda: board.conclude(set(posts), covered, exit_code), 2.0)
    return exit_code


def report_as_peer(failure: Failure, board: PeerBoard | None, debug: bool, rank: int) -> int:
    """A rank other than 0: silent when rank 0 speaks for it (see PeerBoard); interrupts are rank 0's.
    Returns the exit code: rank 0's when this rank's error is covered by or an echo of rank 0's report."""
    if failure.kind == "interrupt":
        return failure.exit_code
    if board is None:
        # Nobody to ask: config and mesh errors come from the same YAML and world size on every rank.
        if not failure.alike:
            _write(failure, debug, prefix=f"[rank {rank}] ")
        return failure.exit_code

    def exchange() -> dict:
        board.post(failure)
        return board.verdict(board.VERDICT_S)

    verdict = _bounded(exchange, board.VERDICT_S + 2.0)
    if verdict is not None and (rank in verdict["covered"] or (rank not in verdict["seen"] and not debug)):
        return verdict["exit_code"]
    _write(failure, debug, prefix=f"[rank {rank}] ")
    if verdict is None:  # so that rank 0, failing later as this error's echo, does not print it again
        _bounded(lambda: board.post(failure, printed=True), 2.0)
    return failure.exit_code


def _group_by_line(posts: dict[int, dict]) -> dict[str, set[int]]:
    groups: dict[str, set[int]] = {}
    for rank, post in posts.items():
        groups.setdefault(post["line"], set()).add(rank)
    return groups


def _ranks_text(ranks: set[int]) -> str:
    ordered = sorted(ranks)
    shown = ",".join(map(str, ordered[:8])) + (",..." if len(ordered) > 8 else "")
    return f"rank {shown}" if len(ordered) == 1 else f"ranks {shown}"


def debug_requested(argv: list[str], environ=os.environ) -> bool:
    return "--debug" in argv or environ.get("RUNTIME_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def guarded_main(body: Callable[[RunContext], int], context: RunContext) -> int:
    """Runs body(context) and returns its exit code; on any failure reports it (module docstring) and ends
    the process with os._exit. SIGTERM is turned into an Interrupted exception for the time of the run."""
    rank, world, _ = env_world()
    setup_logging(rank)
    debug = debug_requested(context.argv)
    # Not on the main thread (an embedding caller), SIGTERM keeps its default.
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        return body(context)
    except BaseException as err:  # CheckpointException and KeyboardInterrupt are no Exception
        if isinstance(err, SystemExit):
            raise
        # No signal may turn into another exception half-way through the report. A second Ctrl-C ends the
        # process at once. torchrun's SIGTERM (sent once any rank has exited, or right after a Ctrl-C that
        # reached rank 0 too) must not cut rank 0's report, which is bounded (PeerBoard; torchrun sends
        # SIGKILL after its grace period anyway); another rank then has nothing left to say.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN if rank == 0 else signal.SIG_DFL)
        failure = _describe_safely(err, context)
        board = _bounded(lambda: PeerBoard.connect(rank, world), 5.0)
        exit_code = failure.exit_code
        if rank == 0:
            exit_code = report_as_rank0(failure, board, debug)
        else:
            exit_code = report_as_peer(failure, board, debug, rank)
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip the process-group teardown: a peer stuck in a collective would make it hang; torchrun sees
        # the exit and stops the other ranks.
        os._exit(exit_code)


if __name__ == "__main__":
    # The imported module's main, not this __main__ copy's: its classes (UsageError) are the ones that
    # USER_ERRORS names and that runtime.verify raises.
    from runtime.launch import main as _main

    sys.exit(_main())
