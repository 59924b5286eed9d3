"""No silent hangs (issue 15, item 7): real torchrun runs on gloo, frozen and ended as a user would see.

A rank frozen with SIGSTOP ends every other rank within parallelism.collective_timeout_s + a margin,
with one line naming it; the rendezvous store frozen ends every rank too; ranks slow outside collectives
and a rank finishing later than its peers raise nothing (a normal run ending cleanly is every torchrun
training test's: the watchdog is always on); a collective that times out on live ranks is explained in one
line naming the key.

Worker pids are read from /proc (the children of torchrun and their RANK), so this is Linux-only.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import small_chat_data

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads worker pids from /proc")]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe.yaml"
# Beyond the timeout: the watchdog's own delay (2 heartbeats: 1 s at timeouts of 5 s and less), process
# exit, and a loaded 2-core CI machine.
MARGIN_S = 20
# The scripts' timeout: short (CI time), yet six heartbeats long (heartbeat_interval's 0.5 s floor).
SCRIPT_TIMEOUT_S = 3
STALL_LINE = "stopped responding for"

# Several modes of a small job around init_distributed, run by torchrun like runtime.launch.
SCRIPT = '''
import os, sys, time
import torch
import torch.distributed as dist
from runtime.distributed.process_group import collective_error_message, defer_to_watchdog, init_distributed

mode, timeout_s = sys.argv[1], int(sys.argv[2])
env = init_distributed(timeout_s=timeout_s)
t = torch.ones(1)


def busy(seconds):  # pure Python: the heartbeat thread gets the GIL only at switch intervals
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


try:
    if mode == "slow":  # longer than the timeout outside collectives, then rank 0 outlives rank 1
        busy(1.2 * timeout_s) if env.rank == 1 else time.sleep(1.2 * timeout_s)
        dist.all_reduce(t)
        if env.rank == 0:
            busy(1.2 * timeout_s)
    elif mode == "out_of_step":  # rank 0 waits in a collective that rank 1, alive, never joins
        if env.rank == 0:
            dist.all_reduce(t)
        else:
            time.sleep(4 * timeout_s)
    elif mode == "loop":
        print("ready", flush=True)
        while True:
            dist.all_reduce(t)
            time.sleep(0.01)
    dist.destroy_process_group()
except RuntimeError as err:
    defer_to_watchdog()  # as runtime.guard's failure handler does
    print(collective_error_message(err) or f"unexplained: {err}", file=sys.stderr, flush=True)
    os._exit(1)
'''


class Torchrun:
    """`torchrun --standalone --nproc_per_node 2 ...` in the background, its output in files."""

    def __init__(self, tmp_path: Path, args: list[str]):
        self.out, self.err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args],
                cwd=ROOT, env=env, stdout=out, stderr=err)

    def workers(self, timeout_s: float = 60) -> dict[int, int]:
        """{rank: pid} of torchrun's two workers."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = {}
            for pid in _children(self.proc.pid):
                rank = _environ(pid).get("RANK")
                if rank is not None:
                    found[int(rank)] = pid
            if len(found) == 2:
                return found
            time.sleep(0.2)
        raise TimeoutError(f"torchrun did not start 2 workers in {timeout_s} s\n{self.stderr()}")

    def stderr(self) -> str:
        return self.err.read_text()

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def kill_all(self, pids) -> None:
        """Cleanup whatever the test left: workers first (a stopped one only dies of SIGKILL)."""
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        _signal(self.proc.pid, signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: its parent may be the frozen torchrun)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _freeze(pid: int, timeout_s: float = 30) -> float:
    """SIGSTOP, then waits until every thread of `pid` has stopped; returns that moment (monotonic).
    kill() returns before the stop: Linux wakes one thread to begin it, and until that thread runs
    the others keep running; on a loaded host the store's server thread could answer a round meanwhile."""
    _signal(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not all(_state(task) in ("T", "Z", None) for task in Path(f"/proc/{pid}/task").glob("[0-9]*")):
        assert time.monotonic() < deadline, f"pid {pid} did not stop in {timeout_s} s"
        time.sleep(0.01)
    return time.monotonic()


def _state(task: Path) -> str | None:
    """A thread's state letter from /proc/PID/task/TID/stat; None once it is gone."""
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _wait_gone(pids: list[int], since: float, timeout_s: float) -> dict[int, float]:
    """{pid: seconds from `since` until it exited}; raises if one is still running after timeout_s."""
    exited: dict[int, float] = {}
    while len(exited) < len(pids):
        now = time.monotonic()
        for pid in pids:
            if pid not in exited and _gone(pid):
                exited[pid] = now - since
        if now - since > timeout_s:
            raise AssertionError(f"still running {timeout_s:.0f} s later: {set(pids) - set(exited)}")
        time.sleep(0.1)
    return exited


def _wait_for(condition, what: str, proc: Torchrun, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.proc.poll() is not None:
            raise AssertionError(f"torchrun ended before {what}\n{proc.stderr()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} in {timeout_s} s\n{proc.stderr()}")
        time.sleep(0.2)


def _launch_args(tmp_path: Path, timeout_s: int, max_steps: int) -> list[str]:
    return ["-m", "runtime.launch", str(EXAMPLE), "--output-dir", str(tmp_path / "run"),
            "--set", f"parallelism.collective_timeout_s={timeout_s}", "--set", f"train.max_steps={max_steps}",
            "--set", "optim.warmup_steps=1", "--set", "logging.progress_bar=false",
            "--set", f"data.path={small_chat_data()}"]


def _script_args(tmp_path: Path, mode: str, timeout_s: int) -> list[str]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    return [str(script), mode, str(timeout_s)]


def _metrics_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


LAUNCH_TIMEOUT_S = 5  # the least parallelism.collective_timeout_s takes


def _frozen_rank(tmp_path: Path) -> tuple[dict[int, int], dict[int, float], int, int, str]:
    """The launch stopped by freezing rank 1 after its first step: ({rank: pid}, {rank 0's pid: seconds from
    the freeze to its exit}, metrics lines by then, torchrun's exit code, stderr)."""
    run = Torchrun(tmp_path, _launch_args(tmp_path, LAUNCH_TIMEOUT_S, max_steps=200))
    pids = {}
    try:
        pids = run.workers()
        metrics = tmp_path / "run" / "metrics.jsonl"
        _wait_for(lambda: _metrics_lines(metrics) >= 1, "training step in metrics.jsonl", run)
        frozen_at = _freeze(pids[1])
        exited = _wait_gone([pids[0]], frozen_at, LAUNCH_TIMEOUT_S + MARGIN_S)
        steps_before = _metrics_lines(metrics)
        _signal(pids[1], signal.SIGKILL)  # torchrun's SIGTERM waits while it is stopped; 30 s, then SIGKILL
        code = run.wait(60)
    finally:
        run.kill_all(pids.values())
    return pids, exited, steps_before, code, run.stderr()


def _slow(tmp_path: Path) -> tuple[int, float, str]:
    """(exit code, seconds from start to exit, stderr) of the "slow" job."""
    run = Torchrun(tmp_path, _script_args(tmp_path, "slow", SCRIPT_TIMEOUT_S))
    started = time.monotonic()
    try:
        code = run.wait(120)
    finally:
        run.kill_all([])
    return code, time.monotonic() - started, run.stderr()


def _frozen_store(tmp_path: Path) -> tuple[dict[int, float], int, str]:
    """({worker pid: seconds from freezing torchrun to its exit}, torchrun's exit code, stderr)."""
    run = Torchrun(tmp_path, _script_args(tmp_path, "loop", SCRIPT_TIMEOUT_S))
    pids = {}
    try:
        pids = run.workers()
        _wait_for(lambda: run.out.read_text().count("ready") == 2, "ready workers", run)
        frozen_at = _freeze(run.proc.pid)
        exited = _wait_gone(list(pids.values()), frozen_at, SCRIPT_TIMEOUT_S + MARGIN_S)
        _signal(run.proc.pid, signal.SIGCONT)
        code = run.wait(60)
    finally:
        run.kill_all(pids.values())
    return exited, code, run.stderr()


# A failure handler that runs while the store is frozen (the echo of a peer's exit on its own store
# verdict, the race of the frozen_store job made certain): it must end on this rank's store verdict too.
HANDLER_ON_FROZEN_STORE = '''
import sys
from runtime.distributed.watchdog import Watchdog
if sys.argv[3] == "late-guard":  # a guard that never rules (a host so loaded that its wake-ups come too late)
    Watchdog._guard_loop = lambda self: self._stop.wait()
watchdog = Watchdog(0, 1, int(sys.argv[2]), "127.0.0.1", int(sys.argv[1])).start()
print("beating", flush=True)
sys.stdin.readline()  # the test has frozen the store's process (this one's parent) by now
watchdog.check_now(1.0)  # what process_group.defer_to_watchdog calls
print("returned", flush=True)
'''
STORE_HOST = '''
import subprocess, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(store.port), *sys.argv[2:]],
                         stdin=subprocess.PIPE, stdout=sys.stdout, stderr=sys.stderr)
print(child.pid, flush=True)
time.sleep(600)
'''


def _handler_on_frozen_store(tmp_path: Path, guard: str = "guard") -> tuple[float, str, str]:
    """The store hosted by a parent process, the watchdog and a failure handler in its child: (seconds
    from the handler's call to the child's exit, its stdout, its stderr). The store's host is frozen
    once the child beats. guard "late-guard": the child's guard thread never rules."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out.open("w") as out_f, err.open("w") as err_f:
        host = subprocess.Popen([sys.executable, "-c", STORE_HOST, HANDLER_ON_FROZEN_STORE,
                                 str(SCRIPT_TIMEOUT_S), guard], cwd=ROOT, env=env, stdout=out_f, stderr=err_f)
    try:
        deadline = time.monotonic() + 120
        while "beating" not in out.read_text():
            assert host.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        child = int(out.read_text().split()[0])
        time.sleep(2 * SCRIPT_TIMEOUT_S / 10)  # a few heartbeats
        called_at = _freeze(host.pid)
        Path(f"/proc/{child}/fd/0").write_text("go\n")
        exited = _wait_gone([child], called_at, SCRIPT_TIMEOUT_S + MARGIN_S)[child]
    finally:
        _signal(host.pid, signal.SIGCONT)
        host.kill()
        host.wait()
    return exited, out.read_text(), err.read_text()


def _out_of_step(tmp_path: Path) -> tuple[int, str]:
    """(exit code, stderr) of the "out_of_step" job."""
    run = Torchrun(tmp_path, _script_args(tmp_path, "out_of_step", SCRIPT_TIMEOUT_S))
    try:
        code = run.wait(120)
    finally:
        run.kill_all([])
    return code, run.stderr()


JOBS = {"frozen_rank": _frozen_rank, "slow": _slow, "frozen_store": _frozen_store,
        "out_of_step": _out_of_step, "handler_on_frozen_store": _handler_on_frozen_store,
        "handler_with_a_late_guard": lambda tmp_path: _handler_on_frozen_store(tmp_path, "late-guard")}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The jobs (four of torchrun), started together: most of their time goes to starting Python and to waiting
    out a timeout or a sleep, so on CI's two cores they overlap (CI time: one after another took ~40 s).
    {name: future of the job's outcome}; a test's .result() raises what its job raised."""
    pool = ThreadPoolExecutor(len(JOBS))
    yield {name: pool.submit(job, tmp_path_factory.mktemp(name)) for name, job in JOBS.items()}
    pool.shutdown(wait=True)


@pytest.mark.slow
def test_a_frozen_rank_ends_every_rank_naming_it(jobs):
    pids, exited, steps_before, code, err = jobs["frozen_rank"].result()
    assert code != 0
    # Not before rank 1 was silent for about the timeout (2 s of slack).
    assert exited[pids[0]] >= LAUNCH_TIMEOUT_S - 2, exited
    stall = [line for line in err.splitlines() if STALL_LINE in line]
    assert len(stall) == 1, err
    host = socket.gethostname()
    assert stall[0].startswith(f"error: rank 1 (host {host}, pid {pids[1]}) stopped responding")
    assert f"(parallelism.collective_timeout_s={LAUNCH_TIMEOUT_S}); every rank stops now" in stall[0]
    assert steps_before < 200  # it stopped the run, not the end of training


def test_slow_ranks_and_a_late_finisher_are_not_stalls(jobs):
    """Rank 1 busy in Python and rank 0 asleep, both longer than the timeout, then rank 0 works on
    alone for longer than the timeout after rank 1 has ended: no watchdog line, exit 0."""
    code, elapsed, err = jobs["slow"].result()
    assert code == 0, err
    assert elapsed > 2.4 * SCRIPT_TIMEOUT_S
    assert STALL_LINE not in err and "error" not in err.lower(), err


def test_a_frozen_store_ends_every_rank(jobs):
    """torchrun hosts the store: frozen, no heartbeat can be read, and each rank says so and exits."""
    exited, code, err = jobs["frozen_store"].result()
    assert code != 0
    assert min(exited.values()) >= SCRIPT_TIMEOUT_S - 1, exited
    lost = [line for line in err.splitlines() if "lost the rendezvous store at" in line]
    assert sorted(re.findall(r"error: rank (\d+) lost the rendezvous store at", err)) == ["0", "1"], err
    assert all(f", parallelism.collective_timeout_s={SCRIPT_TIMEOUT_S}); every rank stops now" in line
               for line in lost)


def test_a_collective_timeout_on_live_ranks_names_the_key(jobs):
    """Both ranks beat, rank 0 waits in a collective rank 1 never joins: gloo raises after the timeout
    plus the watchdog's grace, and collective_error_message turns it into one line naming the key."""
    code, err = jobs["out_of_step"].result()
    assert code != 0
    assert STALL_LINE not in err, err
    assert (f"a collective waited longer than 5.5 s (parallelism.collective_timeout_s={SCRIPT_TIMEOUT_S} "
            "plus 2.5 s of watchdog grace)") in err, err


def test_a_failure_handler_on_a_frozen_store_ends_on_the_store_verdict(jobs):
    """A collective broken by a peer's exit on its store verdict reaches this rank's failure handler
    before this rank's own verdict: the handler's check waits for that verdict instead of returning."""
    exited, out, err = jobs["handler_on_frozen_store"].result()
    assert "returned" not in out, (out, err)
    assert "error: rank 0 lost the rendezvous store at 127.0.0.1:" in err, err
    assert exited <= SCRIPT_TIMEOUT_S + MARGIN_S, exited


def test_a_failure_handler_gives_the_store_verdict_when_the_guard_has_not(jobs):
    """The guard's verdict can come late on a loaded host (its late wake-ups read as its own freeze): the
    handler's check then gives the store's verdict itself at its deadline instead of returning."""
    exited, out, err = jobs["handler_with_a_late_guard"].result()
    assert "returned" not in out, (out, err)
    assert "error: rank 0 lost the rendezvous store at 127.0.0.1:" in err and "(no answer for" in err, err
    assert exited <= SCRIPT_TIMEOUT_S + MARGIN_S, exited
