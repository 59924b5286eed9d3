"""How a run ends when it fails, as a user sees it (runtime.launch's guarded_main, runtime.guard.preflight).

On real files: every user error ends in exactly one `error:` line from rank 0, no traceback unless
--debug, exit 1 (runtime.launch's main in process, the `cli` fixture); in processes of their own, one case
of each class: Ctrl-C says where to resume and a bug keeps its traceback under one summary line (children
forked from this process, tests.conftest.Forked); the printed resume hint, run with its arguments after a
shard was cut (forked too), names the corrupted checkpoint; under torchrun a data error is printed once. In process too:
describe() on errors hard to cause for real (a full disk), the PeerBoard protocol on a shared store, the
preflight checks and the checkpoint-size estimate.
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from runtime.config import load_config
from runtime.guard import preflight as preflight_mod
from runtime.guard.failure_report import PeerBoard, debug_requested, report_as_peer, report_as_rank0
from runtime.guard.failures import EXIT_INTERNAL_ERROR, Failure, RunContext, describe
from runtime.guard.preflight import PreflightError, estimate_checkpoints, preflight
from tests.conftest import Ahead, Finished, Forked, forked_launch, lane_environ, small_chat_data

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe.yaml"
# Two steps, no warmup (warmup must be < max_steps), no progress bar in captured output, 300 chat records.
FAST = ["--max-steps", "2", "--set", "optim.warmup_steps=0", "--set", "logging.progress_bar=false",
        "--set", f"data.path={small_chat_data()}"]
ERROR_LINE = re.compile(r"^(\[ranks? [\d,.]+\] )?error: ")


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ERROR_LINE.match(line)]


def assert_one_clean_error(proc, *fragments: str) -> str:
    """Exit 1, exactly one `error:` line holding every fragment, no traceback; returns the line."""
    lines = error_lines(proc.stderr)
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# --- output dir: preflight, before any model or data work -----------------------------------------------

def test_output_dir_under_a_file_fails_before_step_1(tmp_path, cli):
    """Works as root too: no permission bit stops root, a file in the path does."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = cli([EXAMPLE, *FAST, "--output-dir", blocker / "run"])
    assert_one_clean_error(proc, "train.output_dir cannot be created", str(blocker / "run"), "Not a directory",
                           "set train.output_dir")
    assert "packed rows" not in proc.stderr  # failed before loading data


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any permission bits")
def test_read_only_output_dir(tmp_path, cli):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        proc = cli([EXAMPLE, *FAST, "--output-dir", parent / "run"])
    finally:
        parent.chmod(0o700)
    assert_one_clean_error(proc, "train.output_dir cannot be created", "Permission denied")


def test_debug_flag_shows_the_traceback(tmp_path, cli):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = cli([EXAMPLE, *FAST, "--output-dir", blocker / "run", "--debug"])
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "PreflightError" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("error: train.output_dir cannot be created")


def test_debug_env_var():
    assert debug_requested([], {"RUNTIME_DEBUG": "1"})
    assert debug_requested(["cfg.yaml", "--debug"], {})
    assert not debug_requested(["cfg.yaml"], {"RUNTIME_DEBUG": "0"})
    assert not debug_requested(["cfg.yaml"], {})


# --- an interrupted run, then its newest checkpoint corrupted ---------------------------------------------

@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory):
    """A run saving every step, stopped with SIGINT once it has two checkpoints: (process, stderr, output
    dir). runtime.launch's main in a child forked from this process (tests.conftest.Forked: a process of its
    own without a Python start)."""
    out = tmp_path_factory.mktemp("interrupted") / "run"
    log = out.parent / "stderr.txt"
    proc = forked_launch([EXAMPLE, "--output-dir", out, "--max-steps", "500",
                          "--set", "checkpoint.every_n_steps=1", "--set", "logging.progress_bar=false",
                          "--set", f"data.path={small_chat_data()}"], log)
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "step_00000002").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    return proc, log.read_text(), out


def test_sigint_says_where_to_resume(interrupted_run):
    proc, stderr, out = interrupted_run
    assert proc.returncode == 128 + signal.SIGINT, stderr
    assert "Traceback" not in stderr and not error_lines(stderr), stderr
    hints = [line for line in stderr.splitlines() if line.startswith("interrupted")]
    assert len(hints) == 1, stderr
    m = re.fullmatch(r"interrupted at step (\d+) \(SIGINT\); the last checkpoint is (\S+); continue with: (.+)", hints[0])
    assert m, hints[0]
    newest = max((out / "checkpoints").glob("step_*"))
    assert m[2] == str(newest) and int(m[1]) >= int(newest.name.removeprefix("step_"))
    tail = (f"--output-dir {out} --max-steps 500 --set checkpoint.every_n_steps=1 "
            f"--set logging.progress_bar=false --set data.path={small_chat_data()} --resume")
    assert m[3].startswith("python -m runtime.launch ") and m[3].endswith(tail)


def test_corrupted_checkpoint_is_one_error_line(interrupted_run):
    """The interrupt's own hint, run as printed, after a shard of the newest checkpoint was truncated."""
    _, stderr, out = interrupted_run
    command = re.search(r"continue with: (.+)", stderr)[1]
    checkpoints = sorted((out / "checkpoints").glob("step_*"))
    newest, older = checkpoints[-1], checkpoints[-2]
    shard = next(newest.glob("*.distcp"))
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size // 3)
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "runtime.launch"], command
    proc = forked_launch(argv[3:], out.parent / "resume.stderr")  # the command's own start: test_user_faults
    _, stderr = proc.communicate(timeout=120)
    assert_one_clean_error(Finished(proc.returncode, stderr), f"checkpoint {newest} is unreadable (",
                           f"to resume from {older.name}")


# --- a bug ------------------------------------------------------------------------------------------------

def test_internal_error_keeps_its_traceback(tmp_path):
    """The script as `python -c` runs it, in a child forked from this process (tests.conftest.Forked)."""
    script = ("import runtime.train\n"
              "def broken(*args, **kwargs):\n"
              "    raise RuntimeError('boom')\n"
              "runtime.train.train = broken\n"
              "from runtime.launch import main\n"
              f"main({[str(EXAMPLE), *FAST, '--output-dir', str(tmp_path / 'run')]!r})\n")
    proc = Forked(script, tmp_path / "stderr.txt")
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERNAL_ERROR, stderr
    assert "Traceback" in stderr
    last = stderr.rstrip().splitlines()[-1]
    assert error_lines(stderr) == [last]
    assert re.fullmatch(r"error: internal error \(RuntimeError: boom, at <string>:3\); this is a bug: .*", last), last


# --- torchrun: printed once ----------------------------------------------------------------------------------

def _torchrun_with_empty_data(tmp: Path) -> tuple[Finished, Path]:
    """`torchrun --nproc_per_node 2 -m runtime.launch` on an empty data file: (its end, the data file)."""
    empty = tmp / "empty.jsonl"
    empty.write_text("")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "runtime.launch", str(EXAMPLE), *FAST, "--set", f"data.path={empty}",
                           "--output-dir", str(tmp / "run")],
                          cwd=ROOT, env=lane_environ(), capture_output=True, text=True, timeout=180, check=False)
    return Finished(done.returncode, done.stderr), empty


# CI time: torchrun's agent and workers (fresh processes) run beside the in-process tests.
TORCHRUN_WITH_EMPTY_DATA = Ahead(_torchrun_with_empty_data)


@pytest.mark.ahead(TORCHRUN_WITH_EMPTY_DATA)
def test_torchrun_two_ranks_print_the_error_once():
    """Both ranks raise the same DataError after the process group exists; rank 0 prints it, rank 1 learns
    so through the PeerBoard and stays silent. (torchrun's agent prints its own ChildFailedError report.)"""
    proc, empty = TORCHRUN_WITH_EMPTY_DATA.result()
    stderr = proc.stderr
    assert proc.returncode != 0
    expected = (f"error: {empty}: no usable records (0 skipped as bad); check data.path, data.kind and "
                "data.text_field / data.messages_field")
    assert error_lines(stderr) == [expected], stderr
    assert str(ROOT / "runtime") not in stderr, stderr  # no worker traceback


# --- describe(): errors that are hard to cause for real --------------------------------------------------------

def test_full_disk_and_permission_errors_are_one_line(tmp_path):
    context = RunContext(["cfg.yaml"], output_dir=str(tmp_path))
    full = describe(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "checkpoints" / "x")), context)
    assert (full.kind, full.exit_code) == ("user", 1)
    assert full.line.startswith(f"error: no space left on device ({tmp_path / 'checkpoints' / 'x'}); free space")
    assert "train.output_dir" in full.line
    denied = describe(PermissionError(errno.EACCES, "Permission denied", "/data/train.jsonl"), context)
    assert denied.line == "error: permission denied (/data/train.jsonl); give this user access to it"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_checkpoint_exception_is_unwrapped(tmp_path):
    """A real CheckpointException (a BaseException) from torch.distributed.checkpoint reading a torn shard."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "checkpoints" / "step_00000003"
    dcp.save({"w": torch.ones(1000)}, checkpoint_id=str(folder))
    (tmp_path / "checkpoints" / "step_00000002").mkdir()
    for shard in folder.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(1000)}, checkpoint_id=str(folder))
    failure = describe(info.value, RunContext([]))
    assert type(info.value).__name__ == "CheckpointException"
    assert failure.kind == "user"
    assert failure.line.startswith(f"error: checkpoint {folder} is unreadable (")
    assert failure.line.endswith(f"); delete it (or move it out of {folder.parent}) to resume from step_00000002")


def test_interrupt_inside_a_checkpoint_save_is_an_interrupt():
    """DCP catches BaseException per rank and re-raises them wrapped: a Ctrl-C during a save arrives so."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as err:
        wrapped = CheckpointException("write", {0: _wrap_exception(err)})
    failure = describe(wrapped, RunContext([], output_dir=None))
    assert (failure.kind, failure.exit_code) == ("interrupt", 128 + signal.SIGINT)
    assert failure.line == "interrupted before training started (SIGINT)"


def test_interrupt_that_broke_the_checkpoint_writer_is_an_interrupt():
    """Ctrl-C inside torch.save's zip writer surfaces as the writer's RuntimeError raised while handling it
    (seen in CI: "[enforce fail at inline_container.cc] unexpected pos"), wrapped by DCP: still an interrupt."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    except RuntimeError as err:
        wrapped = CheckpointException("write", {0: _wrap_exception(err)})
    failure = describe(wrapped, RunContext([], output_dir=None))
    assert (failure.kind, failure.exit_code) == ("interrupt", 128 + signal.SIGINT)


# --- PeerBoard: who prints what ----------------------------------------------------------------------------------

def _boards(world: int) -> list[PeerBoard]:
    store = dist.HashStore()
    boards = [PeerBoard(store, rank, world) for rank in range(world)]
    for b in boards:
        b.GATHER_S, b.VERDICT_S = 0.2, 0.2
    return boards


def test_error_every_rank_raises_is_printed_once(capsys):
    boards = _boards(3)
    same = Failure("user", "error: bad data (x.jsonl); fix it")
    boards[1].post(same)
    boards[2].post(same)
    report_as_rank0(same, boards[0], debug=False)
    report_as_peer(same, boards[1], debug=False, rank=1)
    report_as_peer(same, boards[2], debug=False, rank=2)
    assert capsys.readouterr().err == "error: bad data (x.jsonl); fix it\n"


def test_error_of_one_rank_only(capsys):
    boards = _boards(2)
    own = Failure("user", "error: cannot read shard (s.safetensors); fix it")
    report_as_peer(own, boards[1], debug=False, rank=1)  # rank 0 is busy in a collective: no verdict comes
    assert capsys.readouterr().err == "[rank 1] error: cannot read shard (s.safetensors); fix it\n"
    # rank 0 then fails on the broken collective: an echo of rank 1's error, already printed
    code = report_as_rank0(Failure("internal", "error: internal error (RuntimeError: connection closed)",
                                   "Traceback...", EXIT_INTERNAL_ERROR), boards[0], debug=False)
    assert capsys.readouterr().err == ""
    assert code == 1  # the run failed on a user error, not on a bug


def test_rank0_prints_a_different_peer_error_for_it(capsys):
    boards = _boards(2)
    boards[1].post(Failure("user", "error: other (b); fix b"))
    report_as_rank0(Failure("user", "error: mine (a); fix a"), boards[0], debug=False)
    report_as_peer(Failure("user", "error: other (b); fix b"), boards[1], debug=False, rank=1)
    assert capsys.readouterr().err == "error: mine (a); fix a\n[rank 1] error: other (b); fix b\n"


# --- preflight ---------------------------------------------------------------------------------------------------

def test_preflight_names_missing_inputs(tmp_path):
    cfg = load_config(EXAMPLE, {"train.output_dir": str(tmp_path / "run"), "data.path": str(tmp_path / "nope.jsonl")})
    with pytest.raises(PreflightError, match=r"^data.path does not exist \(.*nope.jsonl\); set it to "):
        preflight(cfg, rank=0)
    cfg = load_config(EXAMPLE, {"train.output_dir": str(tmp_path / "run"), "data.tokenizer": str(tmp_path / "tok")})
    with pytest.raises(PreflightError, match=r"^data.tokenizer does not exist"):
        preflight(cfg, rank=0)


def test_preflight_leaves_writable_dirs_clean(tmp_path):
    cfg = load_config(EXAMPLE, {"train.output_dir": str(tmp_path / "run")})
    preflight(cfg, rank=0)
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == ["checkpoints"]


def test_checkpoint_estimate_and_disk_warning(tmp_path, monkeypatch, caplog):
    full = load_config(EXAMPLE, {"train.output_dir": str(tmp_path)})
    lora = load_config(EXAMPLE, {"train.output_dir": str(tmp_path), "lora.enabled": True})
    n_full, n_lora = estimate_checkpoints(full), estimate_checkpoints(lora)
    assert n_full.bytes_each == 190_848 * 4 * 3 and n_full.copies == 2  # every 20 of 40 steps: 20, then 40
    assert 0 < n_lora.bytes_each < n_full.bytes_each
    monkeypatch.setattr(preflight_mod.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1, 1, 1000))
    preflight(full, rank=0)
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith(f"low disk space for checkpoints ({tmp_path / 'checkpoints'}: 0.0 MiB free, ~4.4 MiB "
                              "needed for 2 checkpoint(s) of ~2.2 MiB: 190,848 parameters x 4 B x 3")


# torch 2.x's message (c10's CUDA caching allocator), as users see it
OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is "
       "free. Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the allocated memory 75.30 "
       "GiB is allocated by PyTorch, and {spare} is reserved by PyTorch but unallocated. If reserved but unallocated "
       "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
       "documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


def test_out_of_gpu_memory_is_a_user_error_with_the_fix():
    """A CUDA OOM is not a bug of ours: one line with what was asked and free, the step, the config keys that
    shrink a rank, and the estimate command for this very run; raised as itself or inside another error."""
    context = RunContext(["--ep", "4", "cfg.yaml", "--resume"])
    context.progress.step, context.progress.training = 7, True
    failure = describe(torch.OutOfMemoryError(OOM.format(spare="520.57 MiB")), context)
    assert (failure.kind, failure.exit_code) == ("user", 1)
    assert failure.line.startswith("error: out of GPU memory (2.00 GiB asked with 1.06 GiB of GPU 0's 79.19 GiB "
                                   "free, at step 7); set parallelism.activation_checkpoint: selective or full")
    assert "quant.base_weights: mxfp4" in failure.line and "expandable_segments" not in failure.line
    assert failure.line.endswith("`python -m runtime.launch --estimate --world-size 1 --ep 4 cfg.yaml` prints what "
                                 "each rank needs")
    try:
        try:
            raise torch.OutOfMemoryError(OOM.format(spare="9.35 GiB"))
        except torch.OutOfMemoryError as oom:
            raise RuntimeError("a hook failed") from oom
    except RuntimeError as err:
        wrapped = describe(err, RunContext(["cfg.yaml"], module="runtime.verify"))
    assert wrapped.kind == "user" and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (9.35 GiB" in wrapped.line
    assert "--estimate" not in wrapped.line  # runtime.verify's flags are not runtime.launch's
    assert describe(torch.OutOfMemoryError("out of memory"), RunContext([])).line.startswith(
        "error: out of GPU memory (out of memory); set")
