"""What a failed run prints: an exception turned into one Failure (a line, an exit code, the traceback).

    describe(err, context) -> Failure

- a user error (config, data, checkpoint, resume, divergence, permissions, full disk, a corrupted DCP
  checkpoint, a command-line typo, the GPU out of memory): `error: <what> (<file/key/step>); <fix>`, exit 1;
- anything else is a bug: `error: internal error (...)` under its traceback, exit 70;
- Ctrl-C or SIGTERM: `interrupted at step N; the last checkpoint is <dir>; continue with: <command>
  --resume`, exit 128 + the signal.
The step comes from the trainer's Progress (context.progress); the checkpoint folder being read or
written from torch.distributed.checkpoint's `checkpoint_id` argument or runtime/checkpoint.py's
save/load frames in the traceback, since DCP's exceptions do not carry it. Pure: printing is
runtime.guard.failure_report's.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shlex
import shutil
import signal
import traceback
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from runtime.distributed.process_group import env_world
from runtime.guard.run_dir import STEP_DIR, finished_checkpoints

EXIT_USER_ERROR = 1
EXIT_INTERNAL_ERROR = 70  # EX_SOFTWARE of sysexits.h: a bug
# Errors whose message is the whole story (what, where, the fix): no traceback unless --debug. Matched by
# qualified class name through the MRO, so this module knows them without importing the model stack, and
# a subclass counts too.
USER_ERRORS = frozenset({
    "runtime.errors.ConfigError", "runtime.distributed.mesh.MeshError", "runtime.data.formats.DataError",
    "runtime.models.hf.CheckpointError", "runtime.checkpoint.ResumeError", "runtime.train.TrainingDiverged",
    "runtime.guard.run_dir.RunDirError", "runtime.guard.preflight.PreflightError", "runtime.lora.LoRAFormatError",
    "runtime.cli.UsageError",
})
# Raised from the command line, the YAML and the world size alone, before any rank could differ.
ALIKE_ON_EVERY_RANK = frozenset({
    "runtime.errors.ConfigError", "runtime.distributed.mesh.MeshError", "runtime.cli.UsageError"})


@dataclass
class Progress:
    """Where the trainer is, for the failure report: `step` is the step being trained (training=True) or
    the first step still to train (training=False: building, loading, resuming)."""

    step: int | None = None
    training: bool = False


@dataclass
class RunContext:
    """What a failure report needs to know about the run: filled in as the run gets that far."""

    argv: list[str] = field(default_factory=list)  # this entry point's arguments, for the command to run again
    module: str = "runtime.launch"
    resumable: bool = True  # the run writes checkpoints, so an interrupt can say where to resume
    output_dir: str | None = None  # known once the config is loaded
    progress: Progress = field(default_factory=Progress)  # updated by runtime.train


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


def describe_safely(err: BaseException, context: RunContext) -> Failure:
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
    """The signal of a Ctrl-C / SIGTERM behind `err`: raised itself, or the cause or context of what it
    became (an interrupt inside torch.save surfaces as the writer's RuntimeError), on any rank's DCP failure."""
    failures = _checkpoint_failures(err)
    inner = [e for _, e in failures] if failures else [err]
    for link in (link for e in inner for link in _chain(e)):
        if isinstance(link, KeyboardInterrupt):
            return getattr(link, "signum", signal.SIGINT)
    return None


def _chain(err: BaseException) -> list[BaseException]:
    """err and the exceptions it was raised from or while handling, transitively."""
    seen, todo = [], [err]
    while todo:
        e = todo.pop()
        if e is not None and all(e is not s for s in seen):
            seen.append(e)
            todo += [e.__cause__, e.__context__]
    return seen


def _frames(err: BaseException) -> list:
    """The traceback's frames, innermost first."""
    return [frame for frame, _ in traceback.walk_tb(err.__traceback__)][::-1]


def _training_step(context: RunContext) -> tuple[str, int] | None:
    """("at", step) inside the step loop, ("before", first step) before it, or None."""
    p = context.progress
    if p.step is None:
        return None
    return ("at" if p.training else "before"), p.step


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
            if code.co_name in ("load", "check_compatible") and local.get("path"):
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
    if oom := next((e for e in _chain(err) if "torch.OutOfMemoryError" in _qualnames(e)), None):
        return out_of_memory_line(oom, context)
    ckpt = _checkpoint_call(err)
    failures = _checkpoint_failures(err)
    causes = [e for _, e in failures] if failures else [err]
    if ckpt and ckpt[0] == "load" and all(_missing_from(e, ckpt[1]) for e in causes):
        # A file of the checkpoint itself is gone: the folder is incomplete, not the config's path wrong.
        return unreadable_checkpoint_line(ckpt[1], failures or [(0, err)], context)
    if all(isinstance(e, OSError) and e.errno in _OS_ERRORS for e in causes):
        return os_error_line(causes[0], ckpt[1] if ckpt else None, context)
    corrupt = all(isinstance(e, _CORRUPT_DATA) or _is_torn_zip(e) for e in causes)
    if ckpt and ckpt[0] == "save":
        if all(_is_write_failure(e) for e in causes):
            return write_failure_line(ckpt[1], causes[0], context)
        return None  # anything else going wrong in a save is ours
    if (ckpt and (failures or corrupt)) or (failures and corrupt):
        return unreadable_checkpoint_line(ckpt[1] if ckpt else None, failures or [(0, err)], context)
    return None


def out_of_memory_line(err: BaseException, context: RunContext) -> str:
    """A CUDA out-of-memory error: what torch says of the allocation, then the config keys that shrink a rank's
    memory and the command that estimates it (runtime.estimate)."""
    text = str(err)
    asked = re.search(r"Tried to allocate ([\d.]+ \w+)", text)
    device = re.search(r"GPU (\d+) has a total capac\w* of ([\d.]+ \w+) of which ([\d.]+ \w+) is free", text)
    if asked and device:
        what = f"{asked[1]} asked with {device[3]} of GPU {device[1]}'s {device[2]} free"
    else:
        what = (text.strip().splitlines() or [type(err).__name__])[0][:160]
    fix = ("set parallelism.activation_checkpoint: selective or full, lower data.seq_len or train.micro_batch_size, "
           "spread the model over more ranks (ep, cp, dp_shard), or with LoRA quant.base_weights: mxfp4")
    spare = re.search(r"([\d.]+) (\w+) is reserved by PyTorch but unallocated", text)
    if spare and spare[2] == "GiB" and float(spare[1]) >= 1:
        fix += (f", or PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ({spare[1]} GiB reserved but unallocated: "
                "fragmentation)")
    if context.module == "runtime.launch":
        world = env_world()[1]
        args = [a for a in context.argv if a != "--resume"]
        fix += (f"; `python -m runtime.launch --estimate --world-size {world} {shlex.join(args)}` prints what each "
                "rank needs")
    return f"error: out of GPU memory ({what}{_step_note(context)}); {fix}"


def os_error_line(err: OSError, fallback: Path | None, context: RunContext) -> str:
    what, fix = _OS_ERRORS[err.errno]
    path = err.filename or fallback
    where = f"{path} -> {err.filename2}" if path and err.filename2 else str(path or "path not reported")
    under_output = context.output_dir and path and _is_under(Path(path), Path(context.output_dir))
    or_key = " or set train.output_dir to another folder" if under_output or path is None else ""
    return f"error: {what} ({where}{_step_note(context)}); {fix.format(or_key=or_key)}"


def write_failure_line(folder: Path, cause: BaseException, context: RunContext) -> str:
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
    return f"error: writing checkpoint {folder} failed ({_cause(cause)}{_step_note(context)}); {fix}"


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _missing_from(err: BaseException, folder: Path) -> bool:
    return isinstance(err, FileNotFoundError) and bool(err.filename) and _is_under(Path(err.filename), folder)


def unreadable_checkpoint_line(folder: Path | None, failures: list, context: RunContext | None = None) -> str:
    """The one line for a checkpoint that cannot be read back, with the older checkpoint to fall back to
    (runtime.export: the older checkpoint to export with --step)."""
    by_cause: dict[str, set[int]] = {}
    for rank, e in failures:
        by_cause.setdefault(_cause(e), set()).add(rank)
    # With several ranks, which of them failed to read says which shard is torn.
    causes = sorted(by_cause) if env_world()[1] == 1 else [f"{ranks_text(r)}: {c}" for c, r in sorted(by_cause.items())]
    if folder is None:  # not found in the traceback
        return (f"error: a checkpoint is unreadable ({'; '.join(causes)}); delete the newest one under "
                "<train.output_dir>/checkpoints to resume from the one before it")
    older = [p.name for p in finished_checkpoints(folder.parent.parent) if p.name < folder.name]
    if context is not None and context.module == "runtime.export":
        fix = (f"export the one before it with --step {int(STEP_DIR.match(older[-1])[1])}" if older
               else "it is the run's only checkpoint: train again to export")
    elif older:
        fix = f"delete it (or move it out of {folder.parent}) to resume from {older[-1]}"
    else:
        fix = "delete it and start over without --resume (there is no older checkpoint)"
    return f"error: checkpoint {folder} is unreadable ({'; '.join(causes)}); {fix}"


def _cause(err: BaseException) -> str:
    """One short phrase for an exception: torch's own messages for torn files run to paragraphs."""
    if isinstance(err, EOFError):
        return "EOFError: the data ends early, a truncated file"
    if isinstance(err, FileNotFoundError) and err.filename:
        return f"{Path(err.filename).name} is missing"
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


def _step_note(context: RunContext) -> str:
    step = _training_step(context)
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
    step = _training_step(context)
    head = f"interrupted {step[0]} step {step[1]}" if step else "interrupted before training started"
    head += f" ({signal.Signals(signum).name})"
    if not context.resumable or context.output_dir is None:
        return head
    latest = latest_checkpoint(Path(context.output_dir))
    if latest is None:
        return (f"{head}; no checkpoint was saved yet in {context.output_dir}, so there is nothing to resume; "
                f"start over with: {rerun_command(context, resume=False)}")
    return f"{head}; the last checkpoint is {latest}; continue with: {rerun_command(context, resume=True)}"


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest finished checkpoint folder, or None."""
    found = finished_checkpoints(output_dir)
    return found[-1] if found else None


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


def ranks_text(ranks: set[int]) -> str:
    ordered = sorted(ranks)
    shown = ",".join(map(str, ordered[:8])) + (",..." if len(ordered) > 8 else "")
    return f"rank {shown}" if len(ordered) == 1 else f"ranks {shown}"
