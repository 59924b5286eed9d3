"""How a failed run ends: each failure printed once, by rank 0, then os._exit (a teardown that waits on a
peer stuck in a collective would hang; torchrun stops the other ranks once one has exited).

    guarded_main(body, context) -> exit code    # runtime.launch and runtime.verify run through it

Another rank prints only what is its alone (PeerBoard says how rank 0 learns about it). `--debug` or
RUNTIME_DEBUG=1 prints the traceback above a user error's line. SIGTERM is raised like Ctrl-C for the
time of the run, so both end through the same report.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from runtime.distributed.process_group import env_world
from runtime.guard.failures import EXIT_USER_ERROR, Failure, RunContext, describe_safely, ranks_text


class Interrupted(KeyboardInterrupt):
    """SIGTERM raised like Ctrl-C's KeyboardInterrupt, so both end through the same report (and, being no
    Exception, neither is swallowed by an `except Exception` on the way up)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, _frame):
    raise Interrupted(signum)


class PeerBoard:
    """How rank 0 knows what failed on the other ranks: every failing rank posts its line in a key-value
    store that outlives the ranks (torchrun's agent store; else the process group's), and rank 0 prints.

    A rank other than 0 posts, then waits for rank 0's verdict: {"seen": ranks whose posts rank 0 read,
    "covered": those it printed for}. Covered: silent. Seen but not covered (its error differs from rank
    0's and needs its own traceback): it prints its own. Not seen (rank 0 had already reported and left;
    this rank's error is the echo, e.g. a collective broken by rank 0's exit): silent. No verdict within
    VERDICT_S (rank 0 is fine, waiting in a collective for this rank): its error is its alone, it prints.
    An interrupted rank posts and leaves without a verdict: rank 0 prints that interrupt in place of the
    internal error of the collective its exit broke.
    Rank 0 waits up to GATHER_S for the others' posts, so errors that every rank raises alike (config,
    data, a corrupted checkpoint) are printed once. Callers bound every call with _bounded: a store call
    to a frozen store host never returns (runtime/distributed/watchdog.py measured it)."""

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
        self.store.set(f"rank{self.rank}", json.dumps({"line": failure.line, "kind": failure.kind, "printed": printed,
                                                       "exit_code": failure.exit_code}))
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
    # A peer interrupted alone (a SIGTERM to one rank, mid-save) breaks rank 0's collective: the interrupt is
    # the story, and its line (step, last checkpoint, command) is the same on every rank.
    interrupted = next((posts[r] for r in sorted(posts) if posts[r]["kind"] == "interrupt"), None)
    if failure.kind == "internal" and not echo and interrupted is not None:
        if debug:
            sys.stderr.write(failure.detail)
        sys.stderr.write(interrupted["line"] + "\n")
        _bounded(lambda: board.conclude(set(posts), set(posts), interrupted["exit_code"]), 2.0)
        return interrupted["exit_code"]
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
            sys.stderr.write(f"[{ranks_text(unprinted)}] {line}\n")
            covered |= unprinted
    exit_code = EXIT_USER_ERROR if echo else failure.exit_code
    if board is not None:
        _bounded(lambda: board.conclude(set(posts), covered, exit_code), 2.0)
    return exit_code


def report_as_peer(failure: Failure, board: PeerBoard | None, debug: bool, rank: int) -> int:
    """A rank other than 0: silent when rank 0 speaks for it (see PeerBoard); interrupts are rank 0's to print
    (posted, so that rank 0 names an interrupt of this rank alone rather than the collective it broke).
    Returns the exit code: rank 0's when this rank's error is covered by or an echo of rank 0's report."""
    if failure.kind == "interrupt":
        if board is not None:
            _bounded(lambda: board.post(failure), 2.0)
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


def debug_requested(argv: list[str], environ=os.environ) -> bool:
    return "--debug" in argv or environ.get("RUNTIME_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def guarded_main(body: Callable[[RunContext], int], context: RunContext) -> int:
    """Runs body(context) and returns its exit code; on any failure reports it (module docstring) and ends
    the process with os._exit. SIGTERM is turned into an Interrupted exception for the time of the run."""
    rank, world, _ = env_world()
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
        # A stall another rank found ends this one quietly: this error is its echo.
        from runtime.distributed.process_group import defer_to_watchdog

        defer_to_watchdog()
        failure = describe_safely(err, context)
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
